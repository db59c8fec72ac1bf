"""Data parallelism with deferred weight gradients on two gloo processes (SPEC C9).

One spawned job runs every scenario below on both ranks (dist_harness); the tests check
its results. The training scenarios run 5 steps of a model mixing deferred and plain
modules under dwgraph.distributed.DistributedDataParallel and compare, at every step, each
gradient (.grad, or main_grad when fused) and each parameter with a single-process run on
the concatenated batch (FP32, 1e-6 relative), eagerly and with dwgraph.make_graphed_callables.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dwgraph
import dwgraph.distributed as dwdist
from dist_harness import DEVICES, Failure, device_results, run_scenarios
from dist_models import (IN, GraphedNet, OUT, ROWS, STEPS, assert_matches, batch, deferred_modules, fused_ids, gradients, local,
                         loss_fn, make_model, max_errors, model_reference, sgd)

BUCKET_MB = 2e-3  # about 2 KB: several buckets, launched in order from the hooks


def _train(ctx, fused: bool, graphed: bool, micro: int = 1, zero_to_none: bool = True):
    model = make_model(fused, device=ctx.device)
    rows = ROWS // micro
    g = (dwgraph.make_graphed_callables(model, (torch.randn(rows, IN, device=ctx.device),), num_warmup_iters=1)
         if graphed else None)
    ddp = dwdist.DistributedDataParallel(GraphedNet(model, g) if graphed else model, deferred_bucket_cap_mb=BUCKET_MB)
    fused_set = fused_ids(model)
    per_step, ready, queued, launched = [], [], [], []
    for step in range(STEPS):
        x, y = batch(step, ROWS * ctx.world_size, ctx.device)
        for k, (xm, ym) in enumerate(zip(local(ctx, x).chunk(micro), local(ctx, y).chunk(micro))):
            with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                (loss_fn(ddp(xm), ym) / micro).backward()
            if graphed:
                g.backward_dw()
            else:
                for m in reversed(deferred_modules(model)):
                    m.backward_dw()
        launched.append(ddp.deferred.num_launched)
        ddp.finish()
        ready.append(ddp.deferred.ready_counts())
        queued.append(sum(m.num_queued_wgrad_units() for m in deferred_modules(model)))
        grads = gradients(model)
        sgd(model.parameters(), fused_set)
        if not zero_to_none:
            for p in model.parameters():
                if id(p) not in fused_set:
                    p.grad = torch.zeros_like(p)
        per_step.append(dict(grads=grads, params={n: p.detach().clone() for n, p in model.named_parameters()}))
    errors = max_errors(per_step, model_reference(fused, ctx.world_size))
    return dict(errors=errors, ready=ready, queued=queued, launched=launched, buckets=ddp.deferred.num_buckets)


TRAIN = {f"train_{grad}_{mode}{suffix}": (grad == "main_grad", mode == "graphed", micro, zero)
         for grad in ("grad", "main_grad") for mode in ("eager", "graphed")
         for suffix, micro, zero in (("", 1, True), ("_accumulate", 2, False))}
for _name, _args in TRAIN.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _args=_args: _train(ctx, *_args)


class _Tied(torch.nn.Module):
    """Two deferred Linears sharing one weight, and a fused Linear without deferral used
    twice per forward (its hook runs twice at the end of each backward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = dwgraph.nn.Linear(IN, IN, delay_wgrad_compute=True)
        self.b = dwgraph.nn.Linear(IN, IN, delay_wgrad_compute=True)
        self.b.weight = self.a.weight
        self.c = dwgraph.nn.Linear(IN, OUT, fuse_wgrad_accumulation=True)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x))))
        return self.c(h) + self.c(0.5 * h)


def scenario_tied_and_reused_in_forward_order(ctx):
    """Against the same model in one process (FP32): weight steps in forward order."""
    model, ref = _Tied().to(ctx.device), _Tied().to(ctx.device)
    ddp = dwdist.DistributedDataParallel(model, deferred_bucket_cap_mb=BUCKET_MB)
    errors, ready = [], []
    for step in range(3):
        x, y = batch(step, ROWS * ctx.world_size, ctx.device)
        loss_fn(ddp(local(ctx, x)), local(ctx, y)).backward()
        model.a.backward_dw()
        model.b.backward_dw()
        ddp.finish()
        ready.append(ddp.deferred.ready_counts())
        loss_fn(ref(x), y).backward()
        ref.a.backward_dw()
        ref.b.backward_dw()
        got, want = gradients(model), gradients(ref)
        errors.append(max_errors([dict(grads=got, params={})], [dict(grads=want, params={})])["grads"])
        for m in (model, ref):
            sgd(m.parameters(), fused_ids(m))
    return dict(errors=errors, ready=ready)


def _local_batch(ctx, step=0):
    x, y = batch(step, ROWS * ctx.world_size)
    return local(ctx, x), local(ctx, y)


def scenario_plain_ddp_eager(ctx):
    """What a user tries first: torch's DDP over deferred modules."""
    model = make_model(False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, y = _local_batch(ctx)
    loss_fn(ddp(x), y).backward()
    return "no error"


def scenario_plain_ddp_graphed(ctx):
    model = make_model(False)
    g = dwgraph.make_graphed_callables(model, (torch.randn(ROWS, IN),), num_warmup_iters=1)
    ddp = torch.nn.parallel.DistributedDataParallel(GraphedNet(model, g))
    x, y = _local_batch(ctx)
    loss_fn(ddp(x), y).backward()
    return "no error"


def _one_step(ctx, ddp, model):
    x, y = _local_batch(ctx)
    loss_fn(ddp(x), y).backward()
    for m in reversed(deferred_modules(model)):
        m.backward_dw()


def scenario_missing_finish_next_forward(ctx):
    model = make_model(False)
    ddp = dwdist.DistributedDataParallel(model, deferred_bucket_cap_mb=BUCKET_MB)
    _one_step(ctx, ddp, model)
    x, y = _local_batch(ctx, 1)
    try:
        ddp(x)
    finally:
        ddp.finish()  # the step can still be completed after the error


def scenario_missing_finish_optimizer(ctx):
    model = make_model(False)
    ddp = dwdist.DistributedDataParallel(model, deferred_bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _one_step(ctx, ddp, model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        opt.step()
    finally:
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        ddp.finish()
        assert unchanged, "the optimizer wrote parameters before the error"


def scenario_rank_skips_backward_dw(ctx):
    """Rank 1 forgets one module's backward_dw(): every rank raises at finish(), and no
    gradient is written (rank 0 keeps its local, unreduced gradients)."""
    model = make_model(False)
    ddp = dwdist.DistributedDataParallel(model, deferred_bucket_cap_mb=BUCKET_MB)
    x, y = _local_batch(ctx)
    loss_fn(ddp(x), y).backward()
    for m in reversed(deferred_modules(model)):
        if not (ctx.rank == 1 and m is model[0]):
            m.backward_dw()
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    try:
        ddp.finish()
    except dwgraph.GraphStateError as e:
        untouched = all(torch.equal(model.get_parameter(n).grad, g) for n, g in local.items()
                        if not n.startswith(("2.", "3.layer_norm", "4.")))  # torch's DDP reduced those
        return dict(error=str(e), untouched=untouched)
    return dict(error=None)


def scenario_graphed_rank_skips_last_backward_dw(ctx):
    """Graphed, two microbatches: rank 1 leaves out the graphed backward_dw() of the last
    one, whose replayed backward holds the work outside the modules' queues (the first
    microbatch's landing had marked them landed): every rank raises at finish()."""
    model = make_model(False)
    rows = ROWS // 2
    g = dwgraph.make_graphed_callables(model, (torch.randn(rows, IN),), num_warmup_iters=1)
    ddp = dwdist.DistributedDataParallel(GraphedNet(model, g), deferred_bucket_cap_mb=BUCKET_MB)
    x, y = _local_batch(ctx)
    for k, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
        with ddp.no_sync() if k == 0 else contextlib.nullcontext():
            (loss_fn(ddp(xm), ym) / 2).backward()
        if not (k == 1 and ctx.rank == 1):
            g.backward_dw()
    ddp.finish()


def scenario_abandoned_step_then_clean_step(ctx):
    """A step that raises inside deferred_step() (on every rank) is abandoned without
    waiting; the next step reduces into fresh buckets and matches the reference."""
    model = make_model(False)
    ddp = dwdist.DistributedDataParallel(model, deferred_bucket_cap_mb=BUCKET_MB)
    try:
        with ddp.deferred_step():
            _one_step(ctx, ddp, model)
            raise KeyError("the user's own error")
    except KeyError:
        pass
    model.zero_grad(set_to_none=True)
    with ddp.deferred_step():
        _one_step(ctx, ddp, model)
    got = dict(grads=gradients(model), params={})
    return max_errors([got], [dict(grads=model_reference(False, ctx.world_size, steps=1)[0]["grads"])])


def scenario_finish_twice(ctx):
    model = make_model(False)
    ddp = dwdist.DistributedDataParallel(model, deferred_bucket_cap_mb=BUCKET_MB)
    _one_step(ctx, ddp, model)
    ddp.finish()
    ddp.finish()


def scenario_no_deferred_modules(ctx):
    dwdist.DataParallelReducer(torch.nn.Linear(4, 4))


SCENARIOS = [*TRAIN, "tied_and_reused_in_forward_order", "plain_ddp_eager", "plain_ddp_graphed",
             "graphed_rank_skips_last_backward_dw",
             "missing_finish_next_forward", "missing_finish_optimizer", "rank_skips_backward_dw",
             "abandoned_step_then_clean_step", "finish_twice", "no_deferred_modules"]


@pytest.fixture(scope="module")
def results():
    return run_scenarios(__file__, SCENARIOS)


@pytest.fixture(scope="module", params=DEVICES)
def trained(request):
    return device_results(request, "results", [*TRAIN, "tied_and_reused_in_forward_order"])


def _ok(results, name):
    per_rank = results[name]
    for r in per_rank:
        assert not isinstance(r, Failure), f"{name} raised {r.type}: {r.message}\n{r.traceback}"
    return per_rank


@pytest.mark.parametrize("name", list(TRAIN))
def test_training_matches_single_process(trained, name):
    for res in _ok(trained, name):
        assert_matches(res["errors"])
        assert res["buckets"] > 1
        # Each module's gradients were handed to the reduction once per step, and every
        # bucket had started reducing from the hooks before finish() (overlap).
        assert all(set(r.values()) == {1} for r in res["ready"]), res["ready"]
        assert res["launched"] == [res["buckets"]] * STEPS
        assert res["queued"] == [0] * STEPS


def test_tied_and_reused_parameters_in_any_weight_step_order(trained):
    for res in _ok(trained, "tied_and_reused_in_forward_order"):
        assert max(res["errors"]) < 1e-6, res["errors"]
        assert all(r == {"a": 1, "b": 1, "c": 1} for r in res["ready"]), res["ready"]


@pytest.mark.parametrize("name", ["plain_ddp_eager", "plain_ddp_graphed"])
def test_plain_ddp_over_deferred_modules_is_a_typed_error(results, name):
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == "GraphStateError", r
        assert "dwgraph.distributed.DistributedDataParallel" in r.message


@pytest.mark.parametrize("name", ["missing_finish_next_forward", "missing_finish_optimizer"])
def test_missing_finish_is_caught_at_the_next_step(results, name):
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == "GraphStateError", r
        assert "finish()" in r.message


def test_a_rank_that_skips_a_graphed_backward_dw_fails_every_rank(results):
    rs = results["graphed_rank_skips_last_backward_dw"]
    for r in rs:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "1 of 2 ranks" in r.message, r
    assert "pending in a graph" in rs[1].message


def test_a_rank_that_skips_backward_dw_fails_every_rank_before_writing(results):
    for rank, r in enumerate(_ok(results, "rank_skips_backward_dw")):
        assert r["error"] is not None and r["untouched"], r
        assert "1 of 2 ranks" in r["error"]
    assert "this rank: module '0'" in results["rank_skips_backward_dw"][1]["error"]


def test_an_abandoned_step_leaves_the_next_one_exact(results):
    for res in _ok(results, "abandoned_step_then_clean_step"):
        assert res["grads"] < 1e-6 and res["grad_tensor"] < 1e-5, res


def test_finish_with_nothing_landed_is_an_error_on_every_rank(results):
    for r in results["finish_twice"]:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "no weight gradient landed" in r.message


def test_reducer_without_deferred_modules_is_an_argument_error(results):
    for r in results["no_deferred_modules"]:
        assert isinstance(r, Failure) and r.type == "ArgumentError"
