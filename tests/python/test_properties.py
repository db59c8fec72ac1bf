"""Property-based tests of make_graphed_callables (SPEC C8) with hypothesis: random models
(deferred and plain modules, fused main_grad or not, bias or not, ties inside and across
callables), random microbatch counts and pipeline orders, random zero_grad modes and
replay orders. Every call of a graphed run either equals the same modules run eagerly,
bitwise, after every event, or raises a dwgraph error; then nothing was written by that
call (the gradients equal eager's before it). Replays in capture order are never refused.

Profiles (environment DWGRAPH_HYPOTHESIS_PROFILE): ``ci`` (the default, 200 examples,
derandomized so CI is reproducible) and ``slow`` (2000 random examples, for a soak on a
developer machine, e.g. ``DWGRAPH_HYPOTHESIS_PROFILE=slow pytest tests/python/test_properties.py``).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dwgraph
from safety_common import cloned_grads as _grads, same_grads as _same, zero_grads as _zero

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
