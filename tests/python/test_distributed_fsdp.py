"""FSDP2 (fully_shard) with deferred weight gradients on two gloo processes (SPEC C9).

The training scenarios shard a model mixing deferred and plain modules with fully_shard
(each deferred block, then the root), drive it with dwgraph.distributed.FullyShardReducer,
and compare every sharded gradient (gathered) and parameter with a single-process run on
the concatenated batch (FP32, 1e-6 relative), for 5 steps, eagerly and graphed with
FullyShardReducer.make_graphed_callables (the FSDP units and the root's own layers graphed
over their unsharded parameters, kept at fixed addresses; FSDP's hooks run around each
replay: docs/distributed.md).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dwgraph
import dwgraph.distributed as dwdist
from dist_harness import DEVICES, Failure, device_results, run_scenarios
from dist_models import (HIDDEN, IN, LR, ROWS, STEPS, assert_matches, batch, deferred_modules, local, loss_fn, make_model,
                         max_errors, model_reference)



def _sharded(ctx, fused: bool, **fsdp_kwargs):
    model = make_model(fused, device=ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    fully_shard(model[0], mesh=mesh, **fsdp_kwargs)
    fully_shard(model[3], mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


class _CountingReduceScatter:
    """Counts FSDP's reduce-scatters (torch.distributed.reduce_scatter_single calls)."""

    def __enter__(self):
        import torch.distributed as dist

        self.count, self._orig = 0, dist.reduce_scatter_single

        def counted(*args, **kwargs):
            self.count += 1
            return self._orig(*args, **kwargs)

        dist.reduce_scatter_single = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.reduce_scatter_single = self._orig


def _graph(ctx, model, reducer, rows: int, dtype=torch.float32):
    """The two FSDP units (model[0], model[3]) and the root's own layers (model[2],
    model[4]) graphed; returns a counter of eager fallbacks (a graph that did not replay)."""
    layers = (model[0], model[2], model[3], model[4])
    samples = ((torch.randn(rows, IN, device=ctx.device, dtype=dtype),),
               *((torch.randn(rows, HIDDEN, device=ctx.device, dtype=dtype, requires_grad=True),) for _ in range(3)))
    reducer.make_graphed_callables(layers, samples, num_warmup_iters=1)
    eager = [0]
    for m in layers:
        handle = dwgraph.graphed_handle(m)
        run = handle._forward  # what the handle calls when its graphs do not replay

        def counted(*args, run=run, **kwargs):
            eager[0] += 1
            return run(*args, **kwargs)

        handle._forward = counted
    return eager


def _train(ctx, fused: bool, micro: int, graphed: bool, skip=None, sample_dtype=torch.float32, **fsdp_kwargs):
    """`skip(step, microbatch, module, model)`: True where this rank leaves out a backward_dw()."""
    model = _sharded(ctx, fused, **fsdp_kwargs)
    reducer = dwdist.FullyShardReducer(model)
    eager = _graph(ctx, model, reducer, ROWS // micro, sample_dtype) if graphed else [0]
    per_step, reduce_scatters, landings, queued = [], [], [], []
    for step in range(STEPS):
        x, y = batch(step, ROWS * ctx.world_size, ctx.device)
        with _CountingReduceScatter() as rs:
            for k, (xm, ym) in enumerate(zip(local(ctx, x).chunk(micro), local(ctx, y).chunk(micro))):
                with reducer.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    (loss_fn(model(xm), ym) / micro).backward()
                for m in reversed(deferred_modules(model)):
                    if skip is None or not skip(step, k, m, model):
                        m.backward_dw()
            reducer.finish()
        reduce_scatters.append(rs.count)
        landings.append(reducer.landings())
        queued.append(sum(m.num_pending_wgrad_units() for m in deferred_modules(model)))
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
                p.grad = None
        per_step.append(dict(grads=grads, params={n: p.full_tensor() for n, p in model.named_parameters()}))
    if fsdp_kwargs:  # another precision than the reference's: the run itself is the result
        return dict(per_step=per_step, eager_calls=eager[0])
    return dict(errors=max_errors(per_step, model_reference(fused, ctx.world_size)), reduce_scatters=reduce_scatters,
                landings=landings, queued=queued, eager_calls=eager[0])


TRAIN = {f"train_{grad}{suffix}_{mode}": (grad == "main_grad", micro, mode == "graphed")
         for grad in ("grad", "main_grad") for suffix, micro in (("", 1), ("_accumulate", 2))
         for mode in ("eager", "graphed")}
for _name, _args in TRAIN.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _args=_args: _train(ctx, *_args)


def _local_batch(ctx):
    x, y = batch(0, ROWS * ctx.world_size)
    return local(ctx, x), local(ctx, y)


def scenario_plain_fully_shard(ctx):
    """What a user tries first: fully_shard alone. FSDP reshards after the backward, so
    backward_dw() would land on the freed unsharded parameter: a typed error instead."""
    model = _sharded(ctx, False)
    x, y = _local_batch(ctx)
    loss_fn(model(x), y).backward()
    queued = model[0].num_queued_wgrad_units()
    try:
        model[0].backward_dw()
    except dwgraph.GraphStateError as e:
        return dict(error=str(e), queued_after=model[0].num_queued_wgrad_units(), queued_before=queued)
    return dict(error=None)


def scenario_rank_skips_backward_dw(ctx):
    model = _sharded(ctx, False)
    reducer = dwdist.FullyShardReducer(model)
    x, y = _local_batch(ctx)
    loss_fn(model(x), y).backward()
    for m in deferred_modules(model):
        if not (ctx.rank == 1 and m is model[0]):
            m.backward_dw()
    reducer.finish()


def scenario_missing_finish_optimizer(ctx):
    model = _sharded(ctx, False)
    reducer = dwdist.FullyShardReducer(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _local_batch(ctx)
    loss_fn(model(x), y).backward()
    for m in deferred_modules(model):
        m.backward_dw()
    try:
        opt.step()
    finally:
        reducer.finish()


def scenario_missing_finish_next_forward(ctx):
    model = _sharded(ctx, False)
    dwdist.FullyShardReducer(model)
    x, y = _local_batch(ctx)
    for _ in range(2):
        loss_fn(model(x), y).backward()
        for m in deferred_modules(model):
            m.backward_dw()


def scenario_root_must_be_fully_sharded(ctx):
    dwdist.FullyShardReducer(make_model(False))


def scenario_graphed_make_graphed_callables(ctx):
    """A graph of a module that contains FSDP units: their hooks (all-gather, reshard) would
    run inside the capture and never at replay, so the capture refuses (typed)."""
    model = _sharded(ctx, False)
    dwdist.FullyShardReducer(model)
    x, _ = _local_batch(ctx)
    dwgraph.make_graphed_callables(model, (x.requires_grad_(),), num_warmup_iters=1)


def scenario_graphed_step(ctx):
    model = _sharded(ctx, False)
    reducer = dwdist.FullyShardReducer(model)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        for m in reversed(deferred_modules(model)):
            m.backward_dw()
        return loss

    x, y = _local_batch(ctx)
    for _ in range(3):
        step(x, y)
        reducer.finish()


def _skipping(ctx, everyone: bool):
    """Graphed, two microbatches; a rank (or every rank) leaves out model[0].backward_dw()
    of the last one: its replayed backward holds that work outside the module's queue."""
    return _train(ctx, False, 2, True,
                  skip=lambda step, k, m, model: k == 1 and (everyone or ctx.rank == 1) and m is model[0])


def scenario_graphed_rank_skips_backward_dw(ctx):
    return _skipping(ctx, everyone=False)


def scenario_graphed_every_rank_skips_backward_dw(ctx):
    return _skipping(ctx, everyone=True)


def scenario_mixed_precision_fused(ctx):
    """A BF16 mixed-precision policy with fused FP32 main_grad (FSDP reduces in FP32): the
    reducer hands main_grad over in FSDP's gradient dtype; graphed equals eager bitwise.
    FSDP defers the FP32 upcast after a microbatch has left a gradient (grad_dtype None),
    which dwgraph modules' forwards read: those calls run eagerly (a mode not captured)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    eager = _train(ctx, True, 2, False, mp_policy=policy)
    graphed = _train(ctx, True, 2, True, mp_policy=policy, sample_dtype=torch.bfloat16)
    return dict(eager=eager["per_step"], graphed=graphed["per_step"], eager_calls=graphed["eager_calls"])


def scenario_fused_block_unit_and_root_only(ctx):
    """A unit that is a block holding a fused deferred module (the reducer's main_grad hook
    sat on a submodule), and a model whose only unit is the root, graphed whole: both
    match their eager runs."""
    def build(root_only: bool):
        torch.manual_seed(0)
        block = torch.nn.Sequential(dwgraph.nn.Linear(IN, HIDDEN, delay_wgrad_compute=True,
                                                      fuse_wgrad_accumulation=True), torch.nn.GELU())
        model = torch.nn.Sequential(block, dwgraph.nn.Linear(HIDDEN, IN, delay_wgrad_compute=True)).to(ctx.device)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        if not root_only:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, block

    out = {}
    for root_only in (False, True):
        runs = []
        for graphed in (False, True):
            model, block = build(root_only)
            reducer = dwdist.FullyShardReducer(model)
            if graphed:
                target = model if root_only else block
                reducer.make_graphed_callables(target, (torch.randn(ROWS, IN, device=ctx.device),),
                                               num_warmup_iters=1)
            grads = []
            for step in range(3):
                x, _ = batch(step, ROWS * ctx.world_size, ctx.device)
                model(local(ctx, x)).square().mean().backward()
                if graphed and root_only:
                    model.backward_dw()  # the graphed root's deferred work, both modules
                else:
                    model[1].backward_dw()
                    (block if graphed else block[0]).backward_dw()
                reducer.finish()
                grads.append({n: (p.grad if p.grad is not None else p.main_grad).full_tensor().clone()
                              for n, p in model.named_parameters() if p.grad is not None})
                with torch.no_grad():
                    for p in model.parameters():
                        p.sub_(LR * p.grad)
                        p.grad = None
            runs.append(grads)
        out["root_only" if root_only else "block"] = runs
    return out


def scenario_capture_mid_step(ctx):
    model = _sharded(ctx, False)
    reducer = dwdist.FullyShardReducer(model)
    x, y = _local_batch(ctx)
    loss = loss_fn(model(x), y)
    _graph(ctx, model, reducer, ROWS)  # between the forward and its backward


def scenario_graphed_called_outside_its_unit(ctx):
    """A graphed layer of the root called directly, while FSDP has its sharded parameters
    registered (the kept unsharded storage holds the previous step's values): refused."""
    model = _sharded(ctx, False)
    reducer = dwdist.FullyShardReducer(model)
    _graph(ctx, model, reducer, ROWS)
    x, y = _local_batch(ctx)
    loss_fn(model(x), y).backward()
    for m in deferred_modules(model):
        m.backward_dw()
    reducer.finish()
    model[2](torch.randn(ROWS, HIDDEN, device=ctx.device))


def scenario_graphed_unit_without_reducer(ctx):
    """dwgraph.make_graphed_callables on an FSDP unit directly: its parameters are sharded
    DTensors between calls; typed, pointing at FullyShardReducer.make_graphed_callables."""
    model = _sharded(ctx, False)
    dwgraph.make_graphed_callables(model[0], (torch.randn(ROWS, IN, device=ctx.device),), num_warmup_iters=1)


SCENARIOS = [*TRAIN, "graphed_called_outside_its_unit", "graphed_unit_without_reducer",
             "graphed_rank_skips_backward_dw", "graphed_every_rank_skips_backward_dw", "mixed_precision_fused",
             "fused_block_unit_and_root_only", "capture_mid_step", "plain_fully_shard", "rank_skips_backward_dw", "missing_finish_optimizer",
             "missing_finish_next_forward", "root_must_be_fully_sharded", "graphed_make_graphed_callables",
             "graphed_step"]


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
        assert_matches(res["errors"])
        # FSDP's own reduce-scatter, once per parameter group (model[0], model[3], root)
        # per step; each deferred module landed once per microbatch; nothing left queued.
        assert res["reduce_scatters"] == [3] * STEPS, res["reduce_scatters"]
        micro = 2 if "accumulate" in name else 1
        assert all(set(l.values()) == {micro} for l in res["landings"]), res["landings"]
        assert res["queued"] == [0] * STEPS
        assert res["eager_calls"] == 0  # graphed: every call replayed


def test_plain_fully_shard_is_a_typed_error_before_landing(results):
    for r in results["plain_fully_shard"]:
        assert not isinstance(r, Failure), f"{r.type}: {r.message}"
        assert r["error"] is not None and "FullyShardReducer" in r["error"], r
        assert r["queued_before"] == r["queued_after"] == 1  # nothing ran


def test_a_rank_that_skips_backward_dw_fails_every_rank(results):
    for r in results["rank_skips_backward_dw"]:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "1 of 2 ranks" in r.message, r


@pytest.mark.parametrize("name", ["missing_finish_optimizer", "missing_finish_next_forward"])
def test_missing_finish_is_caught_at_the_next_step(results, name):
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "finish()" in r.message, r


def test_root_must_be_fully_sharded(results):
    for r in results["root_must_be_fully_sharded"]:
        assert isinstance(r, Failure) and r.type == "ArgumentError", r


@pytest.mark.parametrize("name,error,says", [("graphed_make_graphed_callables", "ArgumentError", "hooks"),
                                             ("graphed_step", "ArgumentError", "DTensor")])
def test_graphs_of_an_fsdp2_model_are_refused(results, name, error, says):
    # Typed, before anything is written (graphed_step's first call was an eager warmup;
    # it once crashed at the capture, cloning the freed unsharded parameters).
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == error and says in r.message, r


def test_graphed_layer_called_outside_its_unit_is_refused(results):
    for r in results["graphed_called_outside_its_unit"]:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "not the tensor the graphs captured" in \
            r.message, r


def test_graphing_an_fsdp_unit_without_the_reducer_is_refused(results):
    for r in results["graphed_unit_without_reducer"]:
        assert isinstance(r, Failure) and r.type == "ArgumentError" and "FullyShardReducer" in r.message, r


@pytest.mark.parametrize("name", ["graphed_rank_skips_backward_dw", "graphed_every_rank_skips_backward_dw"])
def test_a_skipped_graphed_backward_dw_fails_every_rank_before_fsdp_reduces(results, name):
    # The replayed backward holds its work outside the module's queue; finish() counts it.
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "still queued" in r.message, r
    assert any("pending in a graph" in r.message for r in results[name])  # the rank that skipped


def test_mixed_precision_with_fused_main_grad_graphed_equals_eager(results):
    for r in results["mixed_precision_fused"]:
        assert not isinstance(r, Failure), f"{r.type}: {r.message}\n{r.traceback}"
        # Of 4 graphed layers x 2 microbatches x 5 steps, at most the second microbatch's
        # three dwgraph layers ran eagerly (those whose parameters FSDP left without
        # grad_dtype at that forward: the root's); the rest replayed.
        assert 0 < r["eager_calls"] <= 3 * STEPS
        for e, g in zip(r["eager"], r["graphed"], strict=True):
            for kind in ("grads", "params"):
                for n in e[kind]:
                    assert torch.equal(e[kind][n], g[kind][n]), (kind, n)


def test_fused_block_unit_and_root_only_unit_graphed_equal_eager(results):
    for r in results["fused_block_unit_and_root_only"]:
        assert not isinstance(r, Failure), f"{r.type}: {r.message}\n{r.traceback}"
        for case in ("block", "root_only"):
            eager, graphed = r[case]
            for e, g in zip(eager, graphed, strict=True):
                assert e.keys() == g.keys() and e
                for n in e:
                    assert torch.equal(e[n], g[n]), (case, n)


def test_capture_in_the_middle_of_a_step_is_refused(results):
    for r in results["capture_mid_step"]:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "step is in progress" in r.message, r
