"""Property tests of pipeline schedules whose microbatch slots share the graph pool by
liveness (issue 21, Note [Slots share the pool by liveness] in graphs/manager_impl.h):
``order`` given, no ``pool`` and no ``reuse_static_buffers``, so sharing is on.

Random valid orders over one or two chunks (a chunk's input is the previous chunk's output
detached, as a pipeline stage boundary; its backward gets the next chunk's input gradient),
deferred and plain layers, fused main_grad or not, several steps with both zero_grad
modes. Properties:

- replayed in the captured order, every step equals the same modules run eagerly,
  bitwise, after every event;
- replayed in another valid order, every call either equals eager or is refused with a
  dwgraph error having written nothing (the pool's replay-order tracking);
- an order is refused (GraphStateError) exactly when the same graphs with the pool's
  replay-order checks off (the negative control) depart from eager, and no later than
  the event where they depart.

Example counts are small (the ``ci`` profile of test_properties.py applies to the whole
session; these tests cap their own); ``DWGRAPH_HYPOTHESIS_PROFILE=slow`` runs more.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dwgraph
from safety_common import cloned_grads as _grads, same_grads as _same, zero_grads as _zero

H = 8
B = 4
_SLOW = os.environ.get("DWGRAPH_HYPOTHESIS_PROFILE") == "slow"
_SETTINGS = settings(max_examples=300 if _SLOW else 25, deadline=None, derandomize=not _SLOW,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

Event = Tuple[str, int, int]  # phase ("F", "B", "W"), chunk (1-based), microbatch


@dataclass
class Layer:
    kind: str  # "dlinear", "mlp", "tlinear", "gelu"
    delay: bool
    fuse: bool


@dataclass
class Case:
    chunks: List[List[Layer]]
    microbatches: int
    capture: List[Event]
    replays: List[List[Event]]  # one order per step after the first
    zero: List[str]             # per step: "none" (set_to_none=True) or "zero"
    seed: int


def _defers(layers: List[Layer]) -> bool:
    return any(l.kind in ("dlinear", "mlp") and l.delay for l in layers)


@st.composite
def _order(draw, m: int, defers: List[bool], sequential: bool = False) -> List[Event]:
    """A valid order: per chunk and phase, microbatches in order; F of chunk c after F of
    chunk c - 1, B after its F and after B of chunk c + 1, W after its B (chunks that defer
    only). `sequential`: each microbatch's events finish before the next one's start."""
    n = len(defers)
    done = set()
    nxt = {(ph, c): 0 for ph in "FBW" for c in range(1, n + 1)}
    total = sum(3 if d else 2 for d in defers) * m
    out: List[Event] = []
    while len(out) < total:
        options = []
        for c in range(1, n + 1):
            f, b, w = nxt[("F", c)], nxt[("B", c)], nxt[("W", c)]
            if f < m and (c == 1 or ("F", c - 1, f) in done):
                options.append(("F", c, f))
            if b < f and (c == n or ("B", c + 1, b) in done):
                options.append(("B", c, b))
            if defers[c - 1] and w < b:
                options.append(("W", c, w))
        if sequential:
            oldest = min(mb for _, _, mb in options)
            options = [o for o in options if o[2] == oldest]
        e = draw(st.sampled_from(options))
        out.append(e)
        done.add(e)
        nxt[e[:2]] += 1
    return out


@st.composite
def _layers(draw) -> List[Layer]:
    layers = [Layer(draw(st.sampled_from(["dlinear", "dlinear", "mlp", "tlinear", "gelu"])), draw(st.booleans()),
                    draw(st.booleans())) for _ in range(draw(st.integers(1, 2)))]
    if all(l.kind == "gelu" for l in layers):
        layers[0].kind = "dlinear"  # every chunk trains something
    return layers


@st.composite
def cases(draw):
    chunks = [draw(_layers()) for _ in range(draw(st.integers(1, 2)))]
    m = draw(st.integers(1, 4))
    defers = [_defers(c) for c in chunks]
    # Microbatches one after another half the time: later slots then reuse the earlier
    # ones' memory the most, and most other replay orders must be refused.
    capture = draw(_order(m, defers, sequential=draw(st.booleans())))
    replays = [capture if draw(st.booleans()) else draw(_order(m, defers)) for _ in range(2)]
    modes = draw(st.permutations(["none", "zero", draw(st.sampled_from(["none", "zero"]))]))
    return Case(chunks, m, capture, replays, list(modes), draw(st.integers(0, 2 ** 16)))


def _layer(l: Layer) -> torch.nn.Module:
    if l.kind == "dlinear":
        return dwgraph.nn.Linear(H, H, delay_wgrad_compute=l.delay, fuse_wgrad_accumulation=l.fuse)
    if l.kind == "mlp":
        return dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=l.delay, fuse_wgrad_accumulation=l.fuse)
    if l.kind == "tlinear":
        return torch.nn.Linear(H, H)
    return torch.nn.GELU()


class _Run:
    """One side (graphed or eager) of a pipeline rank: events in, gradients out."""

    def __init__(self, chunk_fwd, chunk_dw, num_chunks: int):
        self.fwd, self.dw, self.n = chunk_fwd, chunk_dw, num_chunks
        self.acts: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: Dict[int, torch.Tensor] = {}

    def __call__(self, e: Event, xs, ws) -> None:
        ph, c, mb = e
        if ph == "F":
            x = xs[mb] if c == 1 else self.acts[(c - 1, mb)][1].detach().requires_grad_()
            self.acts[(c, mb)] = (x, self.fwd(c, mb, x))
        elif ph == "B":
            x, y = self.acts[(c, mb)]
            if c == self.n:
                (y * ws[mb]).sum().backward()
            else:
                y.backward(self.grads.pop(mb))
            del self.acts[(c, mb)]
            if c > 1:
                self.grads[mb] = x.grad
        else:
            self.dw(c, mb)


def _setup(case: Case):
    torch.manual_seed(case.seed)
    chunks = [torch.nn.Sequential(*[_layer(l) for l in layers]) for layers in case.chunks]
    eager = copy.deepcopy(chunks)
    n, m = len(chunks), case.microbatches
    # Slot layout (graphs/schedule.h): chunk by chunk, microbatch by microbatch.
    samples = tuple((torch.randn(B, H, requires_grad=c > 0),) for c in range(n) for _ in range(m))
    order = [c if ph == "F" else -c if ph == "B" else -(c + 0.5) for ph, c, _ in case.capture]
    slots = dwgraph.make_graphed_callables(tuple(chunks), samples, num_warmup_iters=1, order=order,
                                           num_layers_per_chunk=[1] * n)
    graphed = _Run(lambda c, mb, x: slots[(c - 1) * m + mb](x), lambda c, mb: slots[(c - 1) * m + mb].backward_dw(), n)

    def eager_dw(c, mb):
        for mod in eager[c - 1].modules():
            if getattr(mod, "delay_wgrad_compute", False):
                mod.backward_dw()

    reference = _Run(lambda c, mb, x: eager[c - 1](x), eager_dw, n)
    return chunks, eager, graphed, reference, slots


@_SETTINGS
@given(cases())
def test_valid_orders_equal_eager_or_refuse(case: Case):
    chunks, eager, graphed, reference, _ = _setup(case)
    m = case.microbatches
    for step, mode in enumerate(case.zero):
        _zero(chunks, mode), _zero(eager, mode)
        xs = [torch.randn(B, H) for _ in range(m)]
        ws = [torch.randn(B, H) for _ in range(m)]
        order = case.capture if step == 0 else case.replays[step - 1]
        for e in order:
            before = _grads(chunks)
            try:
                graphed(e, xs, ws)
            except dwgraph.DwgraphError as err:
                assert order != case.capture, f"step {step}: the captured order was refused at {e}: {err}"
                if e[0] != "B":  # a refusal inside backward() stops it where it was raised
                    assert _same(_grads(chunks), before), f"step {step}: the refused {e} changed a gradient"
                event("refused")
                return
            reference(e, xs, ws)
            assert _same(_grads(chunks), _grads(eager)), f"step {step}, after {e}: graphed != eager"
    event("exact, " + ("captured order" if all(r == case.capture for r in case.replays) else "other orders"))


@_SETTINGS
@given(cases())
def test_refused_orders_are_the_orders_that_corrupt(case: Case):
    # Negative control: the same graphs with the pool's replay-order checks off replay any
    # order, reading whatever another slot left in shared memory, as CUDA would. An order
    # whose unchecked replay departs from eager must be refused (GraphStateError) at or
    # before the event where it departs; an order that is refused must depart unchecked
    # (the refusal was needed).
    checked, unchecked = _setup(case), _setup(case)
    unchecked[4][0]._native._pool._set_order_checks(False)
    m = case.microbatches
    refused_at = departed_at = None
    for step, order in enumerate((case.capture, case.replays[0])):
        for side in (checked, unchecked):
            _zero(side[0], case.zero[step]), _zero(side[1], case.zero[step])
        xs = [torch.randn(B, H) for _ in range(m)]
        ws = [torch.randn(B, H) for _ in range(m)]
        for k, e in enumerate(order):
            at = (step, k)
            if refused_at is None:
                try:
                    checked[2](e, xs, ws)
                except dwgraph.GraphStateError:
                    assert order is not case.capture, f"the captured order was refused at {e}"
                    refused_at = at
            checked[3](e, xs, ws)
            if departed_at is None:
                try:
                    unchecked[2](e, xs, ws)
                except dwgraph.DwgraphError:
                    departed_at = at  # refused by a check the negative control keeps
                unchecked[3](e, xs, ws)
                if departed_at is None and not _same(_grads(unchecked[0]), _grads(unchecked[1])):
                    departed_at = at
            if refused_at is None:
                assert _same(_grads(checked[0]), _grads(checked[1])), f"step {step}, after {e}: graphed != eager"
    if departed_at is not None:
        assert refused_at is not None and refused_at <= departed_at, (
            f"the unchecked replay departed from eager at {departed_at}, the checked one was refused at {refused_at}")
        event("refused, and would corrupt")
    else:
        assert refused_at is None, f"refused at {refused_at}, yet the unchecked replay equals eager"
        event("exact")
