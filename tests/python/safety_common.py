"""Helpers of the safety tests (not a test module): the same model as plain torch.nn (the
independent reference), a twin for the eager run, and the comparisons.

Every safety case is checked two ways: graphed against the same dwgraph modules run
eagerly (bitwise, ``torch.equal``) and against plain torch.nn autograd on the same weights
(a float tolerance: the summation order of a deferred GEMM may differ).

The small models at the end (``SMALL_H`` features, ``SMALL_B`` rows) are those of the
regression cases found by the hostile reviews, which several feature files share."""

from __future__ import annotations

import copy
import threading
from typing import Dict, Iterable, Optional

import torch

import dwgraph
from references import RefLNLinear, RefMLP, copy_into_reference

REF_RTOL = 1e-5


def _reference_module(m: torch.nn.Module) -> Optional[torch.nn.Module]:
    if isinstance(m, dwgraph.nn.Linear):
        ref = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                              device=m.weight.device, dtype=m.weight.dtype)
        with torch.no_grad():
            ref.weight.copy_(m.weight)
            if m.bias is not None:
                ref.bias.copy_(m.bias)
        return ref
    if isinstance(m, dwgraph.nn.LayerNormMLP):
        ref = RefMLP(m.hidden_size, m.ffn_hidden_size, m.use_bias, m.normalization)
        return copy_into_reference(ref.to(m.fc1_weight.device), m)
    if isinstance(m, dwgraph.nn.LayerNormLinear):
        ref = RefLNLinear(m.in_features, m.out_features, m.bias is not None, m.eps, m.normalization).to(m.weight.device)
        return copy_into_reference(ref, m)
    return None


def torch_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with every dwgraph.nn module replaced by plain torch.nn."""
    holder = torch.nn.ModuleDict({"root": copy.deepcopy(model)})
    made: Dict[int, torch.nn.Module] = {}  # a module used twice stays one module

    def convert(parent: torch.nn.Module) -> None:
        for name, child in list(parent._modules.items()):  # every slot, a shared module in each
            if child is None:
                continue
            ref = made.get(id(child))
            if ref is None:
                ref = _reference_module(child)
                if ref is not None:
                    made[id(child)] = ref
            if ref is not None:
                setattr(parent, name, ref)
            else:
                convert(child)

    convert(holder)
    return holder["root"]


def reference_name(model: torch.nn.Module, name: str) -> str:
    """The name in torch_reference(model) of dwgraph parameter `name`."""
    prefix, _, leaf = name.rpartition(".")
    owner = model.get_submodule(prefix) if prefix else model
    if isinstance(owner, (dwgraph.nn.LayerNormMLP, dwgraph.nn.LayerNormLinear)):
        mod = {"layer_norm": "ln", "fc1": "fc1", "fc2": "fc2", "": "linear"}
        head, _, attr = leaf.rpartition("_")
        return ".".join(p for p in (prefix, mod[head], attr) if p)
    return name


def gradient(p: torch.Tensor) -> Optional[torch.Tensor]:
    """What a parameter accumulated: main_grad for fused weights, .grad otherwise."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def zero_grads(modules, mode: str) -> None:
    """optimizer.zero_grad over `modules`: ``"none"`` sets .grad to None, ``"zero"`` zeroes it
    in place; main_grad is zeroed in place either way."""
    for mod in modules:
        for p in mod.parameters():
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
            if p.grad is not None:
                if mode == "none":
                    p.grad = None
                else:
                    p.grad.zero_()


def cloned_grads(modules):
    """Every parameter's gradient (main_grad where fused), cloned, or None."""
    return [None if gradient(p) is None else gradient(p).clone() for mod in modules for p in mod.parameters()]


def same_grads(a, b) -> bool:
    """Bitwise equal, None where the other is None."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def assert_same_as_eager(graphed: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    for (n, pg), pe in zip(graphed.named_parameters(), eager.parameters()):
        ge, gg = gradient(pe), gradient(pg)
        assert (ge is None) == (gg is None), f"{what}: {n}: eager gradient {'None' if ge is None else 'set'}, " \
                                            f"graphed {'None' if gg is None else 'set'}"
        if ge is not None:
            assert torch.equal(gg, ge), f"{what}: {n} differs from eager ({(gg - ge).abs().max().item():.3e})"


def assert_close_to_reference(graphed: torch.nn.Module, ref: torch.nn.Module, what: str,
                              rtol: float = REF_RTOL) -> None:
    refs = dict(ref.named_parameters())
    for n, pg in graphed.named_parameters():
        gr = refs[reference_name(graphed, n)].grad
        gg = gradient(pg)
        if gr is None or (gr == 0).all():
            assert gg is None or (gg == 0).all(), f"{what}: {n} got a gradient torch.nn does not give"
            continue
        assert gg is not None, f"{what}: {n} has no gradient, torch.nn gives one"
        err = ((gg.double() - gr.double()).norm() / gr.double().norm()).item()
        assert err <= rtol, f"{what}: {n} relative error {err:.2e} against torch.nn"


def deferred_modules(model: torch.nn.Module) -> Iterable[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "delay_wgrad_compute", False)]


def eager_backward_dw(model: torch.nn.Module) -> None:
    for m in deferred_modules(model):
        m.backward_dw()


def step_graphed_and_eager(graphed, eager: torch.nn.Module, x: torch.Tensor) -> None:
    """One training step of each on `x`: the sum of squares' backward, then backward_dw()
    (the graphed callable's, every deferred module's of the eager twin)."""
    graphed(x).square().sum().backward()
    graphed.backward_dw()
    eager(x).square().sum().backward()
    eager_backward_dw(eager)


def snapshot_grads(model: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: None if gradient(p) is None else gradient(p).clone() for n, p in model.named_parameters()}


def assert_unchanged(model: torch.nn.Module, before: Dict[str, Optional[torch.Tensor]], what: str) -> None:
    for n, p in model.named_parameters():
        g = gradient(p)
        assert (g is None) == (before[n] is None) and (g is None or torch.equal(g, before[n])), \
            f"{what}: the gradient of {n} changed although the call was refused"


# ---- the small models of the review rounds' regression cases ------------------------------------
SMALL_H = 8
SMALL_B = 4


def two_deferred(device: str = "cpu") -> torch.nn.Module:
    """Linear(8, 8) -> GELU -> Linear(8, 4), both dwgraph.nn with delay_wgrad_compute, seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(dwgraph.nn.Linear(SMALL_H, SMALL_H, delay_wgrad_compute=True), torch.nn.GELU(),
                               dwgraph.nn.Linear(SMALL_H, 4, delay_wgrad_compute=True)).to(device)


def deferred_bn_linear() -> torch.nn.Module:
    """A deferred dwgraph Linear -> BatchNorm1d -> torch.nn.Linear, seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(dwgraph.nn.Linear(SMALL_H, SMALL_H, delay_wgrad_compute=True),
                               torch.nn.BatchNorm1d(SMALL_H), torch.nn.Linear(SMALL_H, SMALL_H))


def assert_same_grads_and_params(a: torch.nn.Module, b: torch.nn.Module, what: str) -> None:
    """Every .grad (presence and value) and every parameter of `a` equals `b`'s, bitwise."""
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {n}.grad presence differs"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{what}: {n}.grad differs"
        assert torch.equal(p, q), f"{what}: parameter {n} differs"


def one_f_one_b(m: int, in_flight: int = 2):
    """A 1F1B `order` of one callable over `m` microbatches: `in_flight` forwards of warmup,
    then per microbatch its backward, its backward-dw and the next forward."""
    order, f = [], 0
    for _ in range(min(in_flight, m)):
        order.append(1)
        f += 1
    for _ in range(m):
        order += [-1, -1.5]
        if f < m:
            order.append(1)
            f += 1
    return order


def run_order(order, call, dw, xs, loss=lambda y: y.square().sum()):
    """Runs a one-callable `order`: call(i, x) for microbatch i's forward, the backward of
    loss(output), dw(i) for its backward-dw."""
    outs, f, b = {}, 0, 0
    for o in order:
        if o == 1:
            outs[f] = call(f, xs[f])
            f += 1
        elif o == -1:
            loss(outs.pop(b)).backward()
            b += 1
        else:
            dw(b - 1)


def assert_same_fp8_state(graphed: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    """The FP8 scaling state (docs/fp8.md) of both, bitwise; the weight cache's own flags are
    not compared (a graph writes its flag before each replay, eager decides on the host)."""
    for (name, b), (_, be) in zip(graphed.named_buffers(), eager.named_buffers()):
        if name.rsplit(".", 1)[-1] in ("fp8_amax_history", "fp8_scale"):
            assert torch.equal(b, be), f"{what}: buffer {name} (FP8 scaling state)"


def step_on_main_grads(pairs) -> None:
    """For each (model, optimizer): the FP32 main_grads become the gradients the optimizer
    steps with (as Megatron-style optimizers do) and are zeroed, then the step and
    zero_grad(set_to_none=True)."""
    for model, opt in pairs:
        for p in model.parameters():
            if hasattr(p, "main_grad"):
                p.grad = p.main_grad.clone()
                p.main_grad.zero_()
        opt.step()
        model.zero_grad(set_to_none=True)


def run_where(where: str, fn) -> None:
    """Runs fn on this thread ("same_thread") or on another one it joins ("another_thread")."""
    if where == "same_thread":
        fn()
        return
    t = threading.Thread(target=fn)
    t.start()
    t.join()
