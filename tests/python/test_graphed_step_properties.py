"""Property-based tests of ``@dwgraph.graphed_step`` (issue 11) with hypothesis: random step
bodies from a small grammar (deferred and plain modules, fused main_grad or not, dropout,
microbatches inside the step, gradient clipping, an SGD step inside or outside, gradient
accumulation across calls, shapes that change between calls, returned structures) run
graphed and eagerly from the same seed: every output, gradient, main_grad and parameter
equal, bitwise, after every call.

Profiles as in test_properties.py (DWGRAPH_HYPOTHESIS_PROFILE: ``ci`` 100 examples here,
derandomized; ``slow`` 1000).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dwgraph

_PROFILES = {"ci": 100, "slow": 1000}
_N = _PROFILES.get(os.environ.get("DWGRAPH_HYPOTHESIS_PROFILE", "ci"), 100)

H = 8


@dataclass
class Body:
    layers: List[str]      # "dlinear", "dlinear_fused", "linear", "mlp", "dropout", "gelu"
    microbatches: int
    clip: bool
    optimizer_inside: bool
    accumulate: int        # calls between zero_grad (outside the step)
    set_to_none: bool
    rows: List[int]        # batch rows per call (a change selects another graph)
    returns: str           # "loss", "tuple", "dict"
    warmup: int
    seed: int


bodies = st.builds(
    Body,
    layers=st.lists(st.sampled_from(["dlinear", "dlinear", "dlinear_fused", "linear", "mlp", "dropout", "gelu"]),
                    min_size=1, max_size=4),
    microbatches=st.integers(1, 2),
    clip=st.booleans(),
    optimizer_inside=st.booleans(),
    accumulate=st.integers(1, 3),
    set_to_none=st.booleans(),
    rows=st.lists(st.sampled_from([2, 3]), min_size=4, max_size=7),
    returns=st.sampled_from(["loss", "tuple", "dict"]),
    warmup=st.integers(1, 2),
    seed=st.integers(0, 2 ** 16),
)


def _build(body: Body) -> torch.nn.Module:
    torch.manual_seed(body.seed)
    mods = []
    for kind in body.layers:
        if kind == "dlinear":
            mods.append(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True))
        elif kind == "dlinear_fused":
            mods.append(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True))
        elif kind == "linear":
            mods.append(torch.nn.Linear(H, H))
        elif kind == "mlp":
            mods.append(dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=True))
        elif kind == "dropout":
            mods.append(torch.nn.Dropout(0.3))
        else:
            mods.append(torch.nn.GELU())
    if not any(isinstance(m, (torch.nn.Linear, dwgraph.nn.Linear, dwgraph.nn.LayerNormMLP)) for m in mods):
        mods.append(torch.nn.Linear(H, H))
    return torch.nn.Sequential(*mods)


def _step(body: Body, model: torch.nn.Module, opt, xs, ys):
    total = None
    out = None
    for i in range(body.microbatches):
        out = model(xs[i])
        loss = F.mse_loss(out, ys[i])
        loss.backward()
        for m in model:
            if getattr(m, "delay_wgrad_compute", False):
                m.backward_dw()
        total = loss.detach() if total is None else total + loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if body.clip else None
    if body.optimizer_inside:
        opt.step()
    if body.returns == "loss":
        return total
    if body.returns == "tuple":
        return total, out.detach(), norm
    return {"loss": total, "out": out.detach(), "norm": norm}


def _leaves(x):
    if isinstance(x, dict):
        return [x[k] for k in sorted(x)]
    return list(x) if isinstance(x, tuple) else [x]


@settings(max_examples=_N, deadline=None, derandomize=_N == 100,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies)
def test_graphed_step_equals_eager(body: Body):
    eager = _build(body)
    graphed = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.5)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.05, momentum=0.5)
    step = dwgraph.graphed_step(lambda xs, ys: _step(body, graphed, opt_g, xs, ys), warmup_iters=body.warmup)
    data_gen = torch.Generator().manual_seed(body.seed)
    for call, rows in enumerate(body.rows):
        xs = torch.randn(body.microbatches, rows, H, generator=data_gen)
        ys = torch.randn(body.microbatches, rows, H, generator=data_gen)
        state = torch.random.get_rng_state()
        out_g = step(xs, ys)
        torch.random.set_rng_state(state)  # the same dropout masks for the eager run
        out_e = _step(body, eager, opt_e, xs, ys)
        for a, b in zip(_leaves(out_g), _leaves(out_e)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"call {call}: outputs differ"
        for (n, pg), pe in zip(graphed.named_parameters(), eager.parameters()):
            assert torch.equal(pg, pe), f"call {call}: parameter {n} differs"
            assert (pg.grad is None) == (pe.grad is None), f"call {call}: {n}.grad presence differs"
            if pe.grad is not None:
                assert torch.equal(pg.grad, pe.grad), f"call {call}: {n}.grad differs"
            if hasattr(pe, "main_grad"):
                assert torch.equal(pg.main_grad, pe.main_grad), f"call {call}: {n}.main_grad differs"
        if (call + 1) % body.accumulate == 0:
            if not body.optimizer_inside:
                opt_g.step(), opt_e.step()
            opt_g.zero_grad(set_to_none=body.set_to_none), opt_e.zero_grad(set_to_none=body.set_to_none)
            for pg, pe in zip(graphed.parameters(), eager.parameters()):
                if hasattr(pe, "main_grad"):
                    pg.main_grad.zero_(), pe.main_grad.zero_()
