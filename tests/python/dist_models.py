"""What the distributed tests share (helper, not a test module): a small model mixing
deferred and plain modules, its batches, a manual SGD step that reads ``main_grad`` for
fused weights, the independent single-process reference on the concatenated batch (plain
torch.nn in float64), and the norm-wise relative error."""

from __future__ import annotations

import copy
from typing import Dict, List

import torch

import dwgraph
from references import RefMLP

IN, HIDDEN, FFN, OUT = 16, 32, 48, 8
ROWS = 8  # per rank and step
LR = 0.1
STEPS = 5


def make_model(fused: bool, seed: int = 0, device="cpu") -> torch.nn.Sequential:
    """Deferred Linear, GELU, plain torch Linear, deferred LayerNormMLP, dwgraph Linear
    without deferral (initialised on the CPU, so every device starts from the same values)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        dwgraph.nn.Linear(IN, HIDDEN, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        dwgraph.nn.LayerNormMLP(HIDDEN, FFN, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
        dwgraph.nn.Linear(HIDDEN, OUT),
    ).to(device)


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


class GraphedNet(torch.nn.Module):
    """The model's parameters, with a forward that replays its graphs (what a DDP wrapper
    around a graphed model sees)."""

    def __init__(self, body, graphed):
        super().__init__()
        self.body = body
        self._graphed = [graphed]

    def forward(self, x):
        return self._graphed[0](x)


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


def batch(step: int, rows: int, device="cpu") -> tuple:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, IN, generator=gen).to(device), torch.randn(rows, OUT, generator=gen).to(device)


def local(ctx, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a batch."""
    return t.chunk(ctx.world_size)[ctx.rank]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64, r64 = a.detach().cpu().double(), ref.detach().cpu().double()
    denom = r64.norm().item()
    return (a64 - r64).norm().item() / denom if denom else (a64 - r64).norm().item()


def torch_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The same model in plain torch.nn and float64, from the same initial values: dwgraph
    Linear becomes torch.nn.Linear, LayerNormMLP the RefMLP of references.py."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, dwgraph.nn.Linear):
            new = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            pairs = [(new, n, getattr(m, n)) for n in ("weight", "bias") if getattr(m, n) is not None]
        elif isinstance(m, dwgraph.nn.LayerNormMLP):
            new = RefMLP(m.hidden_size, m.ffn_hidden_size, m.use_bias)
            pairs = [(*new.slots[n], p) for n, p in m.named_parameters()]
        else:
            continue
        with torch.no_grad():
            for owner, attr, p in pairs:
                getattr(owner, attr).copy_(p)
        parent, _, leaf = name.rpartition(".")
        setattr(ref.get_submodule(parent) if parent else ref, leaf, new)
    return ref.double()


def ref_parameter(ref: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter of a torch_reference model that the dwgraph model calls `name`."""
    prefix, _, leaf = name.rpartition(".")
    owner = ref.get_submodule(prefix) if prefix else ref
    if isinstance(owner, RefMLP):
        owner, leaf = owner.slots[leaf]
    return getattr(owner, leaf)


def reference_run(model: torch.nn.Module, batches) -> List[Dict[str, Dict[str, torch.Tensor]]]:
    """The single-process run on each whole batch, in plain torch.nn and float64, of a
    freshly built (untrained) dwgraph `model`: per step, the gradients and then the
    parameters after the SGD step, by the dwgraph model's parameter names."""
    ref = torch_reference(model.cpu())
    names = [n for n, _ in model.named_parameters()]
    out = []
    for x, y in batches:
        ref.zero_grad(set_to_none=True)
        loss_fn(ref(x.cpu().double()), y.cpu().double()).backward()
        grads = {n: ref_parameter(ref, n).grad.clone() for n in names}
        with torch.no_grad():
            for n in names:
                p = ref_parameter(ref, n)
                p.sub_(LR * p.grad)
        out.append(dict(grads=grads, params={n: ref_parameter(ref, n).detach().clone() for n in names}))
    return out


def model_reference(fused: bool, world: int, steps: int = STEPS):
    """reference_run of make_model on the batches of the training scenarios."""
    return reference_run(make_model(fused), [batch(step, ROWS * world) for step in range(steps)])


def max_errors(per_step: List[Dict[str, Dict[str, torch.Tensor]]], ref: List[Dict[str, Dict[str, torch.Tensor]]],
               across_ranks: bool = False, device="cpu") -> Dict[str, float]:
    """Largest relative errors over the steps: ``grads``, of the model's whole gradient
    (every parameter's, concatenated: norm-wise, as the GEMM tests measure; with
    ``across_ranks``, each rank holds a part and the parts' errors are summed over the
    ranks, with a collective on ``device``); ``grad_tensor``, of any one parameter's
    gradient (a small bias gradient is a sum with cancellation, whose FP32 rounding alone
    reaches ~1e-6 of its norm, distributed or not); ``params``, of any one parameter after
    the step."""
    worst = {"grads": 0.0, "grad_tensor": 0.0, "params": 0.0}
    for got, want in zip(per_step, ref, strict=True):
        assert got["grads"], "nothing recorded"
        num = torch.tensor(sum((got["grads"][n].cpu().double() - want["grads"][n]).square().sum().item()
                               for n in got["grads"]), dtype=torch.float64, device=device)
        if across_ranks:
            torch.distributed.all_reduce(num)
        den = sum(g.square().sum().item() for g in want["grads"].values())
        worst["grads"] = max(worst["grads"], (num.item() / den) ** 0.5)
        for n, g in got["grads"].items():
            worst["grad_tensor"] = max(worst["grad_tensor"], rel(g, want["grads"][n]))
        for n, t in got["params"].items():
            worst["params"] = max(worst["params"], rel(t, want["params"][n]))
    return worst


def assert_matches(errors: Dict[str, float]) -> None:
    """The distributed run matches the single-process one: FP32, 1e-6 relative (1e-5 for
    any single gradient tensor, see max_errors)."""
    assert errors["grads"] < 1e-6 and errors["params"] < 1e-6 and errors["grad_tensor"] < 1e-5, errors
