"""Sharded deferred weights (dwgraph.distributed.ShardedWeight) on two gloo processes
(SPEC C5, C9).

The training scenarios shard the weights of the model's deferred modules over the two
ranks (each rank holds half the rows), reduce the rest with
dwgraph.distributed.DistributedDataParallel, and compare every gradient and parameter
(shards gathered) with a single-process run on the concatenated batch (FP32, 1e-6
relative), for 5 steps, eagerly and with dwgraph.make_graphed_callables (whose graphs read
a full-weight buffer all-gathered before each replay and reduce-scatter the gradient after
the backward_dw() replay: docs/distributed.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dwgraph
import dwgraph.distributed as dwdist
from dist_harness import DEVICES, Failure, device_results, run_scenarios
from dist_models import (HIDDEN, IN, GraphedNet, ROWS, STEPS, assert_matches, batch, deferred_modules, fused_ids, gradient, local,
                         loss_fn, make_model, max_errors, model_reference, sgd)

SHARDED = [(0, "weight"), (3, "fc1_weight"), (3, "fc2_weight"), (4, "weight")]  # (4: not deferred)


def _shard(model):
    for index, name in SHARDED:
        setattr(model[index], name, dwdist.ShardedWeight.from_full(getattr(model[index], name)))
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    """All ranks' dim-0 shards of `t`, concatenated."""
    out = torch.empty((t.shape[0] * dist.get_world_size(), *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.detach().contiguous())
    return out


def _train(ctx, fused: bool, graphed: bool):
    model = _shard(make_model(fused, device=ctx.device))
    g = (dwgraph.make_graphed_callables(model, (torch.randn(ROWS, IN, device=ctx.device),), num_warmup_iters=1)
         if graphed else None)
    sharded = [getattr(model[i], n) for i, n in SHARDED]
    for w in sharded:
        w.reduce_count = 0  # the warmup ran every collective once, eagerly
    ddp = dwdist.DistributedDataParallel(GraphedNet(model, g) if graphed else model, deferred_bucket_cap_mb=2e-3)
    fused_set = fused_ids(model)
    ids = {id(w) for w in sharded}
    per_step, reductions, queued = [], [], []
    for step in range(STEPS):
        x, y = batch(step, ROWS * ctx.world_size, ctx.device)
        with ddp.deferred_step():
            loss_fn(ddp(local(ctx, x)), local(ctx, y)).backward()
            if graphed:
                g.backward_dw()
            else:
                for m in reversed(deferred_modules(model)):
                    m.backward_dw()
        reductions.append([w.reduce_count for w in sharded])
        queued.append(sum(m.num_pending_wgrad_units() for m in deferred_modules(model)))
        grads = {n: _full(g) if id(p) in ids else g
                 for (n, p), g in ((np, gradient(np[1], fused_set)) for np in model.named_parameters())}
        sgd(model.parameters(), fused_set)
        per_step.append(dict(grads=grads, params={n: _full(p) if id(p) in ids else p.detach().clone()
                                                  for n, p in model.named_parameters()}))
    return dict(errors=max_errors(per_step, model_reference(fused, ctx.world_size)), reductions=reductions,
                queued=queued, shard_rows=model[0].weight.shape[0], world=ctx.world_size)


TRAIN = {f"train_{grad}_{mode}": (grad == "main_grad", mode == "graphed")
         for grad in ("grad", "main_grad") for mode in ("eager", "graphed")}
for _name, (_fused, _graphed) in TRAIN.items():
    globals()[f"scenario_{_name}"] = (lambda f, gr: lambda ctx: _train(ctx, f, gr))(_fused, _graphed)


def _hooked_run(ctx, hooked: bool):
    """Forward under saved_tensors_hooks (or not), two backwards through the retained
    graph, a backward_dw() after each."""
    torch.manual_seed(3)
    lin = dwgraph.nn.Linear(6, 4 * ctx.world_size, delay_wgrad_compute=True)
    lin.weight = dwdist.ShardedWeight.from_full(lin.weight)
    x = torch.randn(5, 6, requires_grad=True)
    g = torch.randn(5, 4 * ctx.world_size)
    packed = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t)
    with hooks if hooked else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = lin(x)
    if not hooked:
        packed.clear()
    y.backward(g, retain_graph=True)
    lin.backward_dw()
    y.backward(g)
    lin.backward_dw()
    return dict(rank=ctx.rank, y=y.detach(), dx=x.grad.clone(), grad=lin.weight.grad.clone(), packed=len(packed),
                weight_type=type(lin.weight).__name__, reduce_count=lin.weight.reduce_count, x=x.detach(), g=g,
                full=_full(lin.weight))


def scenario_saved_tensor_hooks_and_retain_graph(ctx):
    return dict(plain=_hooked_run(ctx, False), hooked=_hooked_run(ctx, True))


def scenario_plain_ddp_with_sharded_weights(ctx):
    model = _shard(make_model(False))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, y = batch(0, ROWS)
    loss_fn(ddp(x), y).backward()


def scenario_graphed_step_is_refused(ctx):
    """One graph of the whole step would run the optimizer before the gradient's
    reduce-scatter, which runs after the replay: refused at capture."""
    torch.manual_seed(0)
    lin = dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True)
    lin.weight = dwdist.ShardedWeight.from_full(lin.weight)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        lin(x).sum().backward()
        lin.backward_dw()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step(torch.randn(4, 8))


def scenario_graphed_forward_writes_its_shard(ctx):
    """A forward that constrains its sharded weight in place before using it: the
    all-gather runs before the replay and would miss the write; refused at capture."""
    class Clamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.lin = dwgraph.nn.Linear(4, 2 * ctx.world_size)
            self.lin.weight = dwdist.ShardedWeight.from_full(self.lin.weight)

        def forward(self, x):
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
            return self.lin(x)

    dwgraph.make_graphed_callables(Clamped(), (torch.randn(3, 4),), num_warmup_iters=1)


def scenario_shard_rows_must_divide(ctx):
    dwdist.ShardedWeight.from_full(torch.zeros(3, 4))


SCENARIOS = [*TRAIN, "saved_tensor_hooks_and_retain_graph", "plain_ddp_with_sharded_weights",
             "graphed_step_is_refused", "graphed_forward_writes_its_shard", "shard_rows_must_divide"]


@pytest.fixture(scope="module")
def results():
    return run_scenarios(__file__, SCENARIOS)


@pytest.fixture(scope="module", params=DEVICES)
def trained(request):
    return device_results(request, "results", list(TRAIN))


@pytest.mark.parametrize("name", list(TRAIN))
def test_training_matches_single_process(trained, name):
    for res in trained[name]:
        assert not isinstance(res, Failure), f"{res.type}: {res.message}\n{res.traceback}"
        assert res["shard_rows"] == HIDDEN // res["world"]
        assert_matches(res["errors"])
        # One reduce-scatter per sharded weight per step; nothing left queued.
        assert res["reductions"] == [[s] * len(SHARDED) for s in range(1, STEPS + 1)], res["reductions"]
        assert res["queued"] == [0] * STEPS


def test_sharded_weight_survives_saved_tensor_hooks_and_retain_graph(results):
    for res in results["saved_tensor_hooks_and_retain_graph"]:
        assert not isinstance(res, Failure), f"{res.type}: {res.message}\n{res.traceback}"
        plain, hooked = res["plain"], res["hooked"]
        assert plain["packed"] == 0 and hooked["packed"] >= 1
        assert hooked["weight_type"] == "ShardedWeight" and hooked["reduce_count"] == 2
        for key in ("y", "dx", "grad"):
            assert torch.equal(plain[key], hooked[key]), key
        # Against plain autograd with the full weight: both backwards; every rank ran the
        # same input, so the average over ranks is this gradient, and the shard its rows.
        w = hooked["full"].clone().requires_grad_(True)
        x = hooked["x"].clone().requires_grad_(True)
        y = torch.nn.functional.linear(x, w)
        y.backward(hooked["g"], retain_graph=True)
        y.backward(hooked["g"])
        rows, r = hooked["grad"].shape[0], hooked["rank"]
        assert torch.allclose(hooked["grad"], w.grad[r * rows:(r + 1) * rows], rtol=1e-6, atol=1e-6)
        assert torch.allclose(hooked["dx"], x.grad, rtol=1e-6, atol=1e-6)


def test_plain_ddp_with_sharded_weights_is_a_typed_error(results):
    for r in results["plain_ddp_with_sharded_weights"]:
        assert isinstance(r, Failure) and r.type == "GraphStateError", r


def test_shard_rows_must_divide(results):
    for r in results["shard_rows_must_divide"]:
        assert isinstance(r, Failure) and r.type == "ArgumentError" and "divisible" in r.message, r


def test_graphed_step_over_a_sharded_weight_is_refused(results):
    for r in results["graphed_step_is_refused"]:
        assert isinstance(r, Failure) and r.type == "ArgumentError" and "reduce-scatter" in r.message, r


def test_a_graphed_forward_that_writes_its_shard_is_refused(results):
    for r in results["graphed_forward_writes_its_shard"]:
        assert isinstance(r, Failure) and r.type == "ArgumentError" and "gathers before each replay" in r.message, r
