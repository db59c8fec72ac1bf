"""What the distributed tests share (helper, not a test module): a small model mixing
deferred and plain modules, its batches, a manual SGD step that reads ``main_grad`` for
fused weights, the single-process reference on the concatenated batch, and the norm-wise
relative error."""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

import dwgraph

IN, HIDDEN, FFN, OUT = 16, 32, 48, 8
ROWS = 8  # per rank and step
LR = 0.1
STEPS = 5


def make_model(fused: bool, seed: int = 0) -> torch.nn.Sequential:
    """Deferred Linear, GELU, plain torch Linear, deferred LayerNormMLP, dwgraph Linear
    without deferral."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        dwgraph.nn.Linear(IN, HIDDEN, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        dwgraph.nn.LayerNormMLP(HIDDEN, FFN, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
        dwgraph.nn.Linear(HIDDEN, OUT),
    )


def deferred_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, dwgraph.nn._DeferredWgradModule) and m.delay_wgrad_compute]


def fused_ids(model: torch.nn.Module) -> set:
    return {id(p) for m in model.modules() if isinstance(m, dwgraph.nn._DeferredWgradModule)
            for _, p in m._fused_parameters()}


def gradient(p: torch.Tensor, fused: set) -> torch.Tensor:
    g = p.main_grad if id(p) in fused else p.grad
    if g is None:
        raise AssertionError("a parameter has no gradient")
    g = g.full_tensor() if hasattr(g, "full_tensor") else g
    return g.detach().clone()


def gradients(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    fused = fused_ids(model)
    return {n: gradient(p, fused) for n, p in model.named_parameters()}


@torch.no_grad()
def sgd(params, fused: set) -> None:
    """p -= LR * gradient; then .grad = None and main_grad zeroed (the caller's duty)."""
    for p in params:
        g = p.main_grad if id(p) in fused else p.grad
        p.sub_(LR * g.to(p.dtype))
        p.grad = None
        if id(p) in fused:
            p.main_grad.zero_()


def batch(step: int, rows: int) -> tuple:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, IN, generator=gen), torch.randn(rows, OUT, generator=gen)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64, r64 = a.detach().double(), ref.detach().double()
    denom = r64.norm().item()
    return (a64 - r64).norm().item() / denom if denom else (a64 - r64).norm().item()


def reference_run(fused: bool, world: int, steps: int = STEPS, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """The single-process run on the concatenated batch: per step, the gradients and then
    the parameters after the SGD step."""
    model = make_model(fused, seed)
    fused_set = fused_ids(model)
    out = []
    for step in range(steps):
        x, y = batch(step, ROWS * world)
        loss_fn(model(x), y).backward()
        for m in deferred_modules(model):
            m.backward_dw()
        grads = gradients(model)
        sgd(model.parameters(), fused_set)
        out.append(dict(grads=grads, params={n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def max_errors(per_step: List[Dict[str, Dict[str, torch.Tensor]]], ref: List[Dict[str, Dict[str, torch.Tensor]]],
               rename: Callable[[str], str] = lambda n: n) -> Dict[str, float]:
    """Largest relative error of any gradient and any parameter over the steps; each
    ``per_step`` entry maps parameter names (``rename`` maps them to the reference's)."""
    worst = {"grads": 0.0, "params": 0.0}
    for got, want in zip(per_step, ref, strict=True):
        for kind in worst:
            assert got[kind], f"no {kind} recorded"
            for n, t in got[kind].items():
                worst[kind] = max(worst[kind], rel(t, want[kind][rename(n)]))
    return worst
