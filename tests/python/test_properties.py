"""Property-based tests of make_graphed_callables (SPEC C8) with hypothesis: random models
(deferred and plain modules, fused main_grad or not, bias or not, ties inside and across
callables), random microbatch counts and pipeline orders, random zero_grad modes and
replay orders. Every call of a graphed run either equals the same modules run eagerly,
bitwise, after every event, or raises a dwgraph error; then nothing was written by that
call (the gradients equal eager's before it). Replays in capture order are never refused.

A second property (issue 19) graphs one module tree of random structure and runs it for a
few steps with a random loss each step: deferred modules used twice (``Sequential(lin, act,
lin)``, one Linear in the trunk and a head), one or two outputs with a random subset of them
in the loss, full and partial backwards (``loss.backward(inputs=...)``,
``torch.autograd.grad(..., allow_unused=True)``), and TransformerEngine-style layers (a
module whose own ``backward_dw()`` runs its children's) as the root and inside containers.
Every step equals the same modules run eagerly, bitwise (outputs, returned gradients,
``.grad``, ``main_grad`` and its flags), or is the documented refusal: a partial backward
that does not ask for a fused weight (``GraphStateError`` naming main_grad, nothing written).

Profiles (environment DWGRAPH_HYPOTHESIS_PROFILE): ``ci`` (the default, 200 examples of the
first property and 40 of the second, derandomized so CI is reproducible) and ``slow`` (ten
times as many random examples, for a soak on a developer machine, e.g.
``DWGRAPH_HYPOTHESIS_PROFILE=slow pytest tests/python/test_properties.py``).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dwgraph
from safety_common import cloned_grads as _grads, gradient, same_grads as _same, snapshot_grads, zero_grads as _zero

settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("slow", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("DWGRAPH_HYPOTHESIS_PROFILE", "ci"))

H = 8
B = 4


@dataclass
class Layer:
    kind: str   # "dlinear", "mlp", "tlinear", "gelu"
    delay: bool
    fuse: bool
    bias: bool


@dataclass
class Case:
    callables: List[List[Layer]]
    tie: str                   # "none", "inside", "across"
    pipeline: bool
    microbatches: int
    capture: List[Tuple[str, int]]
    replay: List[Tuple[str, int]]
    zero: List[str]            # per step: "none" or "zero"
    seed: int


def _defers(layers: List[Layer]) -> bool:
    return any(l.kind in ("dlinear", "mlp") and l.delay for l in layers)


@st.composite
def _events(draw, m: int, with_dw: bool):
    """A valid order of F, B, W events of m microbatches: each in microbatch order, B after
    its F, W after its B (W in B order, as a FIFO landing needs)."""
    done = {"F": 0, "B": 0, "W": 0}
    out = []
    total = m * (3 if with_dw else 2)
    while len(out) < total:
        options = []
        if done["F"] < m:
            options.append("F")
        if done["B"] < done["F"]:
            options.append("B")
        if with_dw and done["W"] < done["B"]:
            options.append("W")
        phase = draw(st.sampled_from(options))
        out.append((phase, done[phase]))
        done[phase] += 1
    return out


@st.composite
def cases(draw):
    n = draw(st.integers(1, 3))
    callables = []
    for _ in range(n):
        layers = [Layer(draw(st.sampled_from(["dlinear", "dlinear", "mlp", "tlinear", "gelu"])), draw(st.booleans()),
                        draw(st.booleans()), draw(st.booleans())) for _ in range(draw(st.integers(1, 3)))]
        if all(l.kind == "gelu" for l in layers):
            layers[0].kind = "tlinear"  # every callable trains something
        callables.append(layers)
    pipeline = draw(st.sampled_from([True, True, False]))
    m = draw(st.integers(1, 3)) if pipeline else 1
    with_dw = any(_defers(c) for c in callables)
    capture = draw(_events(m, with_dw))
    replay = capture if draw(st.integers(0, 2)) == 0 else draw(_events(m, with_dw))
    return Case(callables, draw(st.sampled_from(["none", "inside", "across"])), pipeline, m, capture, replay,
                [draw(st.sampled_from(["none", "zero"])) for _ in range(2)], draw(st.integers(0, 2 ** 16)))


def _layer(l: Layer) -> torch.nn.Module:
    if l.kind == "dlinear":
        return dwgraph.nn.Linear(H, H, l.bias, delay_wgrad_compute=l.delay, fuse_wgrad_accumulation=l.fuse)
    if l.kind == "mlp":
        return dwgraph.nn.LayerNormMLP(H, 2 * H, l.bias, delay_wgrad_compute=l.delay, fuse_wgrad_accumulation=l.fuse)
    if l.kind == "tlinear":
        return torch.nn.Linear(H, H, bias=l.bias)
    return torch.nn.GELU()


def _build(case: Case) -> List[torch.nn.Module]:
    torch.manual_seed(case.seed)
    mods = [torch.nn.Sequential(*[_layer(l) for l in layers]) for layers in case.callables]
    linears = [(i, m) for i, seq in enumerate(mods) for m in seq
               if isinstance(m, (dwgraph.nn.Linear, torch.nn.Linear)) and not getattr(m, "fuse_wgrad_accumulation", False)]
    if case.tie == "inside":
        for i in range(len(mods)):
            mine = [m for j, m in linears if j == i]
            if len(mine) >= 2:
                mine[1].weight = mine[0].weight
                break
    elif case.tie == "across" and len({i for i, _ in linears}) >= 2:
        first = linears[0]
        other = next(m for j, m in linears if j != first[0])
        other.weight = first[1].weight
    return mods


@given(cases())
def test_graphed_equals_eager_or_refuses(case: Case):
    mods = _build(case)
    eager = copy.deepcopy(mods)
    n, m = len(mods), case.microbatches
    defers = [_defers(c) for c in case.callables]
    samples = []
    for _ in range(m):
        for i in range(n):
            samples.append((torch.randn(B, H, requires_grad=i > 0),))
    order = None
    if case.pipeline:
        order = [1 if p == "F" else -1 if p == "B" else -1.5 for p, _ in case.capture]
    graphed = dwgraph.make_graphed_callables(tuple(mods), tuple(samples if case.pipeline else samples[:n]),
                                             num_warmup_iters=1, order=order,
                                             num_layers_per_chunk=[n] if case.pipeline else None)
    slots = [[graphed[mb * n + i] for i in range(n)] for mb in range(m)] if case.pipeline else [list(graphed)]
    replay = case.replay if case.pipeline else [("F", 0), ("B", 0)] + ([("W", 0)] if any(defers) else [])
    for step, mode in enumerate(case.zero):
        _zero(mods, mode), _zero(eager, mode)
        xs = [torch.randn(B, H) for _ in range(m)]
        ws = [torch.randn(B, H) for _ in range(m)]
        outs_g, outs_e = {}, {}
        used = replay if step > 0 or not case.pipeline else case.capture
        for phase, mb in used:
            # One call at a time: a refused call must have written nothing, and every call
            # before it must equal eager. (A refusal inside loss.backward() stops that
            # backward where it was raised, as any error in a backward does: what other
            # nodes accumulated before it stays, so it is only checked to be typed.)
            calls = [i for i in range(n) if defers[i]] if phase == "W" else [None]
            for i in calls:
                before = _grads(mods)
                try:
                    if phase == "F":
                        y = xs[mb]
                        for s in slots[mb]:
                            y = s(y)
                        outs_g[mb] = y
                    elif phase == "B":
                        (outs_g.pop(mb) * ws[mb]).sum().backward()
                    else:
                        slots[mb][i].backward_dw()
                except dwgraph.DwgraphError as e:
                    assert case.pipeline and used != case.capture, f"an order that matches the capture was refused: {e}"
                    if phase != "B":
                        assert _same(_grads(mods), before), "a refused call changed a gradient"
                        assert _same(before, _grads(eager)), "the graphed run differed from eager before the refusal"
                    event("refused")
                    return
                if phase == "F":
                    y = xs[mb]
                    for seq in eager:
                        y = seq(y)
                    outs_e[mb] = y
                elif phase == "B":
                    (outs_e.pop(mb) * ws[mb]).sum().backward()
                else:
                    for mod in eager[i].modules():
                        if getattr(mod, "delay_wgrad_compute", False):
                            mod.backward_dw()
                assert _same(_grads(mods), _grads(eager)), f"step {step}, after {phase}{mb}: graphed != eager"
    event(f"exact ({'pipeline' if case.pipeline else 'sequential'}, {'other order' if case.replay != case.capture else 'capture order'})")


# ---- modules used twice, several outputs, partial backwards, foreign layers (issue 19) -----
@dataclass
class Block:
    kind: str            # "dlinear", "mlp", "tlinear", "gelu", "twice", "reuse", "foreign"
    delay: bool
    fuse: bool
    bias: bool
    pick: int            # "reuse": which earlier dwgraph Linear
    inner: List["Block"]  # "foreign": the layer's blocks


@dataclass
class Step:
    zero: str            # "none" or "zero"
    used: List[int]      # the outputs in the loss
    backward: str        # "full", "inputs" (loss.backward(inputs=...)), "grad" (torch.autograd.grad)
    asked: List[int]     # targets of a partial backward, into [x if it requires grad] + parameters


@dataclass
class Tree:
    foreign_root: bool
    trunk: List[Block]
    heads: List[Block]
    x_grad: bool
    steps: List[Step]
    seed: int


_TOP = ["dlinear", "dlinear", "mlp", "tlinear", "gelu", "twice", "reuse", "foreign"]
_INNER = ["dlinear", "mlp", "tlinear", "gelu", "twice"]  # a foreign layer holds modules of its own


@st.composite
def _blocks(draw, inner: bool):
    kind = draw(st.sampled_from(_INNER if inner else _TOP))
    body = [draw(_blocks(True)) for _ in range(draw(st.integers(1, 2)))] if kind == "foreign" else []
    # Mostly deferred; fused in a quarter (a partial backward skipping one is refused).
    return Block(kind, draw(st.integers(0, 3)) > 0, draw(st.integers(0, 3)) == 0, draw(st.booleans()),
                 draw(st.integers(0, 7)), body)


@st.composite
def trees(draw):
    heads = [draw(_blocks(False)) for _ in range(draw(st.integers(1, 2)))]
    steps = [Step(draw(st.sampled_from(["none", "zero"])),
                  sorted(draw(st.sets(st.integers(0, len(heads) - 1), min_size=1))),
                  draw(st.sampled_from(["full", "full", "inputs", "grad"])),
                  draw(st.lists(st.integers(0, 63), min_size=1, max_size=4)))
             for _ in range(3)]
    return Tree(draw(st.integers(0, 2)) == 0, [draw(_blocks(False)) for _ in range(draw(st.integers(1, 3)))],
                heads, draw(st.booleans()), steps, draw(st.integers(0, 2 ** 16)))


def _run_dw(module: torch.nn.Module, include_self: bool = True) -> None:
    """Eager's weight step for `module`'s tree: every unit a dwgraph module queued (a module
    used twice queued two), a foreign layer through its own backward_dw()."""
    if include_self and getattr(module, "delay_wgrad_compute", False):
        while module.num_queued_wgrad_units() > 0:
            module.backward_dw()
        return
    if include_self and isinstance(module, _Foreign):
        if module.need_backward_dw():
            module.backward_dw()
        return
    for child in module.children():
        _run_dw(child)


def _tree_defers(module: torch.nn.Module) -> bool:
    return any(getattr(m, "delay_wgrad_compute", False) for m in module.modules())


class _Foreign(torch.nn.Module):
    """A TransformerEngine / Megatron-style layer: dwgraph modules inside, and a
    backward_dw() of its own that runs theirs (as a TransformerLayer does)."""

    def __init__(self, body: List[torch.nn.Module]):
        super().__init__()
        self.body = torch.nn.Sequential(*body)

    def forward(self, x):
        return self.body(x)

    def need_backward_dw(self) -> bool:
        return _tree_defers(self)

    def backward_dw(self) -> None:
        _run_dw(self, include_self=False)


class _Net(torch.nn.Module):
    """A trunk and one or two heads: one output or a tuple of two."""

    def __init__(self, trunk: List[torch.nn.Module], heads: List[torch.nn.Module]):
        super().__init__()
        self.trunk = torch.nn.Sequential(*trunk)
        self.heads = torch.nn.ModuleList(heads)

    def forward(self, x):
        h = self.trunk(x)
        outs = tuple(head(h) for head in self.heads)
        return outs[0] if len(outs) == 1 else outs


class _ForeignNet(_Net):
    """The same net as a foreign layer, passed as the graphed callable itself."""

    def need_backward_dw(self) -> bool:
        return _tree_defers(self)

    def backward_dw(self) -> None:
        _run_dw(self, include_self=False)


def _module(b: Block, shared: List[torch.nn.Module], inner: bool) -> torch.nn.Module:
    flags = dict(delay_wgrad_compute=b.delay, fuse_wgrad_accumulation=b.fuse)
    if b.kind == "reuse" and shared:
        return shared[b.pick % len(shared)]  # the same module object a second time
    if b.kind in ("dlinear", "twice", "reuse"):
        lin = dwgraph.nn.Linear(H, H, b.bias, **flags)
        if not inner:  # foreign layers keep their modules to themselves
            shared.append(lin)
        return torch.nn.Sequential(lin, torch.nn.GELU(), lin) if b.kind == "twice" else lin
    if b.kind == "mlp":
        return dwgraph.nn.LayerNormMLP(H, 2 * H, b.bias, **flags)
    if b.kind == "tlinear":
        return torch.nn.Linear(H, H, bias=b.bias)
    if b.kind == "gelu":
        return torch.nn.GELU()
    return _Foreign([_module(i, shared, True) for i in b.inner])


def _build_tree(tree: Tree) -> torch.nn.Module:
    torch.manual_seed(tree.seed)
    shared: List[torch.nn.Module] = []
    trunk = [_module(b, shared, False) for b in tree.trunk]
    heads = [_module(b, shared, False) for b in tree.heads]
    net = (_ForeignNet if tree.foreign_root else _Net)(trunk, heads)
    if not any(p.requires_grad for p in net.parameters()):
        net.trunk.append(torch.nn.Linear(H, H))  # every net trains something
    return net


def _all_blocks(blocks: List[Block]) -> List[Block]:
    return [x for b in blocks for x in [b] + _all_blocks(b.inner)]


def _unique_parameters(model: torch.nn.Module) -> List[torch.Tensor]:
    return list(model.parameters())  # parameters() lists a shared module's once


def _flags(model: torch.nn.Module):
    return [getattr(p, "grad_added_to_main_grad", None) for p in _unique_parameters(model)]


def _pending(model: torch.nn.Module) -> int:
    return sum(m.num_pending_wgrad_units() for m in model.modules() if isinstance(m, dwgraph.nn.Linear) or
               isinstance(m, dwgraph.nn.LayerNormMLP))


def _one_step(call, model: torch.nn.Module, x: torch.Tensor, ws: List[torch.Tensor], step: Step, graphed: bool):
    """Forward, loss, the step's backward and the weight step; returns what the caller sees
    besides the parameters' gradients: outputs, returned gradients, x.grad, whether weight
    work was pending after the backward."""
    outs = call(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((outs[i] * ws[i]).sum() for i in step.used)
    candidates = ([x] if x.requires_grad else []) + _unique_parameters(model)
    targets = list({id(candidates[i % len(candidates)]): candidates[i % len(candidates)]
                    for i in step.asked}.values())
    returned: Optional[List[Optional[torch.Tensor]]] = None
    if not loss.requires_grad:  # the outputs in the loss depend on no parameter (nor x)
        pass
    elif step.backward == "full":
        loss.backward()
    elif step.backward == "inputs":
        loss.backward(inputs=targets)
    else:
        returned = list(torch.autograd.grad(loss, targets, allow_unused=True))
    pending = _pending(model) > 0
    if pending and graphed:
        call.backward_dw()
    elif pending:
        _run_dw(model)
    assert _pending(model) == 0, "weight work left pending after the weight step"
    return [o.detach() for o in outs], returned, None if x.grad is None else x.grad.clone(), pending


def _equal(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _fused_not_asked(model: torch.nn.Module, step: Step, x_grad: bool) -> bool:
    candidates = ([None] if x_grad else []) + _unique_parameters(model)
    asked = {id(candidates[i % len(candidates)]) for i in step.asked}
    return step.backward != "full" and any(hasattr(p, "main_grad") and id(p) not in asked
                                           for p in _unique_parameters(model))


@settings(max_examples=max(1, settings.default.max_examples // 5))
@given(trees())
def test_shared_modules_outputs_partial_backwards_and_foreign_layers_equal_eager(tree: Tree):
    kinds = {b.kind for b in _all_blocks(tree.trunk + tree.heads)}
    for feature, present in (("a module used twice", bool(kinds & {"twice", "reuse"})),
                             ("a foreign layer inside", "foreign" in kinds),
                             ("a partial backward", any(s.backward != "full" for s in tree.steps)),
                             ("an output left out of a loss", any(len(s.used) < len(tree.heads) for s in tree.steps))):
        if present:
            event(feature)
    model = _build_tree(tree)
    eager = copy.deepcopy(model)
    graphed = dwgraph.make_graphed_callables(model, (torch.randn(B, H, requires_grad=tree.x_grad),),
                                             num_warmup_iters=1)
    assert graphed is model
    for k, step in enumerate(tree.steps):
        for m in (model, eager):
            for p in m.parameters():
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()
                if p.grad is not None and step.zero == "zero":
                    p.grad.zero_()
            if step.zero == "none":
                m.zero_grad(set_to_none=True)
        x = torch.randn(B, H)
        ws = [torch.randn(B, H) for _ in tree.heads]
        before = snapshot_grads(model)
        try:
            got = _one_step(graphed, model, x.clone().requires_grad_(tree.x_grad), ws, step, True)
        except dwgraph.DwgraphError as e:
            # The one refusal by design (Note [What a backward asked for]): the graphs
            # accumulate main_grad whatever is asked.
            assert _fused_not_asked(model, step, tree.x_grad), f"step {k}: refused: {e}"
            assert isinstance(e, dwgraph.GraphStateError) and "main_grad" in str(e), f"step {k}: {e!r}"
            after = snapshot_grads(model)
            assert all(_equal(after[n], before[n]) for n in before), f"step {k}: a refused backward wrote a gradient"
            event("refused: partial backward skipping a fused weight")
            return
        want = _one_step(eager, eager, x.clone().requires_grad_(tree.x_grad), ws, step, False)
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])), f"step {k}: outputs"
        assert (got[1] is None) == (want[1] is None), f"step {k}"
        if got[1] is not None:
            assert all(_equal(a, b) for a, b in zip(got[1], want[1])), f"step {k}: torch.autograd.grad's results"
        assert _equal(got[2], want[2]), f"step {k}: x.grad"
        # A foreign layer's backward_dw() may land any parameter inside it that is not a
        # dwgraph module's (as TransformerEngine's modules do), so a backward that reached
        # only such a parameter leaves the graphed layer's backward_dw() to call (a no-op
        # landing here) where the eager layer found nothing queued.
        assert got[3] == want[3] or (got[3] and any(isinstance(m, (_Foreign, _ForeignNet)) for m in model.modules())), \
            f"step {k}: weight work pending graphed {got[3]}, eager {want[3]}"
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert _equal(gradient(p), gradient(q)), f"step {k} ({step}): {n} differs from eager"
            assert _equal(p.grad, q.grad), f"step {k}: {n}.grad differs from eager"
        assert _flags(model) == _flags(eager), f"step {k}: grad_added_to_main_grad flags"
    event(f"exact ({'foreign root' if tree.foreign_root else 'container root'}, {len(tree.heads)} output(s))")
