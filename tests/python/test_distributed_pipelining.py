"""torch.distributed.pipelining with deferred weight gradients on two gloo processes
(SPEC C9).

A model of four blocks, each mixing a deferred dwgraph Linear with a plain torch Linear or
a deferred LayerNormMLP, is cut into stages (two for Schedule1F1B, four -- two per rank --
for ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble) of
dwgraph.distributed.pipelining.PipelineStage, run eagerly and with per-microbatch graphs
(make_graphed_stages), with .grad and with fused main_grad, for 5 steps of 4 microbatches.
Every rank compares the gradients and parameters of its stages with a single-process run
on the whole batch (FP32, 1e-6 relative), and counts the wgrad hooks (once per module per
microbatch) and what is left queued (nothing).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

import dwgraph
import dwgraph.distributed.pipelining as dwpp
from dist_harness import DEVICES, Failure, device_results, run_scenarios
from dist_models import (LR, STEPS, assert_matches, deferred_modules, fused_ids, gradient, loss_fn, max_errors,
                         reference_run, sgd)

D = 16
BLOCKS = 4
MICROBATCHES = 4
MB_ROWS = 4
SCHEDULES = {"1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv_zero_bubble": ScheduleZBVZeroBubble}


def _blocks(fused: bool):
    torch.manual_seed(0)
    return [torch.nn.Sequential(
        dwgraph.nn.Linear(D, D, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
        torch.nn.GELU(),
        torch.nn.Linear(D, D) if b % 2 == 0 else
        dwgraph.nn.LayerNormMLP(D, 2 * D, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused))
        for b in range(BLOCKS)]


def _layout(kind: str, rank: int, world: int):
    """(number of stages, this rank's stage indices)."""
    if kind == "1f1b":
        return world, [rank]
    stages = 2 * world
    if kind == "zbv_zero_bubble":
        return stages, [rank, stages - 1 - rank]  # the V: rank 0 holds the first and last stage
    return stages, [rank, rank + world]


def _batch(step: int):
    gen = torch.Generator().manual_seed(2000 + step)
    rows = MICROBATCHES * MB_ROWS
    return torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)


def _naive_stage(module, *args, **kwargs):
    """What a user writes first: torch's stage with a dw_builder that calls backward_dw()."""
    deferred = deferred_modules(module)
    return PipelineStage(module, *args, dw_builder=lambda: lambda: [m.backward_dw() for m in deferred], **kwargs)


def _run(ctx, kind: str, fused: bool, graphed: bool = False, stage_cls=dwpp.PipelineStage, steps: int = STEPS):
    num_stages, mine = _layout(kind, ctx.rank, ctx.world_size)
    blocks = _blocks(fused)
    per = BLOCKS // num_stages
    modules = {s: torch.nn.Sequential(*blocks[s * per:(s + 1) * per]).to(ctx.device) for s in mine}
    stages = [stage_cls(modules[s], s, num_stages, ctx.device) for s in mine]
    schedule = SCHEDULES[kind](stages[0] if kind == "1f1b" else stages, MICROBATCHES, loss_fn=loss_fn)
    if graphed:
        sample = {s: (torch.randn(MB_ROWS, D, device=ctx.device, requires_grad=s > 0),) for s in mine}
        dwpp.make_graphed_stages(schedule, sample, num_warmup_iters=1)
    hooks = {}
    for s in mine:
        for m in deferred_modules(modules[s]):
            hooks[id(m)] = 0
            m.register_wgrad_hook(lambda mod: hooks.__setitem__(id(mod), hooks[id(mod)] + 1))
    fused_set = set().union(*(fused_ids(modules[s]) for s in mine))
    params = [p for s in mine for p in modules[s].parameters()]

    def name(s, n):  # the reference's name of stage s's parameter n
        b, rest = n.split(".", 1)
        return f"{s * per + int(b)}.{rest}"

    per_step, hook_counts, queued = [], [], []
    for step in range(steps):
        x, y = (t.to(ctx.device) for t in _batch(step))
        kwargs = {}
        if 0 in mine:
            kwargs["x"] = x
        if num_stages - 1 in mine:
            kwargs["target"] = y
        for k in hooks:
            hooks[k] = 0
        schedule.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
        hook_counts.append(sorted(set(hooks.values())))
        queued.append(sum(m.num_queued_wgrad_units() for s in mine for m in deferred_modules(modules[s])))
        grads = {name(s, n): gradient(p, fused_set) for s in mine for n, p in modules[s].named_parameters()}
        sgd(params, fused_set)
        per_step.append(dict(grads=grads, params={name(s, n): p.detach().clone()
                                                  for s in mine for n, p in modules[s].named_parameters()}))
    ref = reference_run(torch.nn.Sequential(*_blocks(fused)), [_batch(step) for step in range(steps)])
    return dict(errors=max_errors(per_step, ref, across_ranks=True, device=ctx.device), hooks=hook_counts,
                queued=queued)


TRAIN = {f"{kind}_{grad}_{mode}": (kind, grad == "main_grad", mode == "graphed")
         for kind in SCHEDULES for grad in ("grad", "main_grad") for mode in ("eager", "graphed")}
for _name, _args in TRAIN.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _args=_args: _run(ctx, *_args)

NAIVE = {f"naive_dw_builder_{kind}": kind for kind in SCHEDULES}
for _name, _kind in NAIVE.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _kind=_kind: _run(ctx, _kind, False, stage_cls=_naive_stage)


def scenario_1f1b_without_dw_builder(ctx):
    """torch's own stage, no dw_builder: the units stay queued, and the optimizer refuses
    to step over their parameters."""
    num_stages, mine = _layout("1f1b", ctx.rank, ctx.world_size)
    module = torch.nn.Sequential(*_blocks(False)[2 * ctx.rank:2 * ctx.rank + 2])
    stage = PipelineStage(module, ctx.rank, num_stages, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    x, y = _batch(0)
    schedule.step(x) if ctx.rank == 0 else schedule.step(target=y)
    torch.optim.SGD(module.parameters(), lr=LR).step()


def scenario_graphed_out_of_order(ctx):
    """A graphed stage refuses an action the graphs were not captured for."""
    num_stages, mine = _layout("1f1b", ctx.rank, ctx.world_size)
    module = torch.nn.Sequential(*_blocks(False)[2 * ctx.rank:2 * ctx.rank + 2])
    stage = dwpp.PipelineStage(module, ctx.rank, num_stages, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    dwpp.make_graphed_stages(schedule, {ctx.rank: (torch.randn(MB_ROWS, D, requires_grad=ctx.rank > 0),)},
                             num_warmup_iters=0)
    stage.forward_one_chunk(1, (torch.randn(MB_ROWS, D),))  # microbatch 1 before microbatch 0


def scenario_zero_bubble_without_dw_builder(ctx):
    """torch's own stage, no dw_builder: torch's W step asks autograd for the weights'
    gradients, which the deferred modules queue instead of returning; torch fails the step
    there (before any optimizer step) on every rank."""
    num_stages, mine = _layout("zbv_zero_bubble", ctx.rank, ctx.world_size)
    blocks = _blocks(False)
    stages = [PipelineStage(blocks[s], s, num_stages, torch.device("cpu")) for s in mine]
    schedule = ScheduleZBVZeroBubble(stages, MICROBATCHES, loss_fn=loss_fn)
    x, y = _batch(0)
    schedule.step(x, target=y) if ctx.rank == 0 else schedule.step()
    torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=LR).step()


def _fsdp_stages(ctx, kind: str, reducer_first: bool = False):
    """Data parallel over the ranks by FSDP2 (each block and each stage module sharded
    over the world), the pipeline within each rank (both stages local): torch's
    PipelineStage drives FSDP itself, its reduce-scatter after the stage's last W step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    blocks = _blocks(False)
    modules = [torch.nn.Sequential(*blocks[2 * s:2 * s + 2]).to(ctx.device) for s in range(2)]
    for m in modules:
        for b in m:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
    if reducer_first:
        import dwgraph.distributed as dwdist
        dwdist.FullyShardReducer(modules[0])
    stages = [dwpp.PipelineStage(modules[s], s, 2, ctx.device, group=groups[ctx.rank]) for s in range(2)]
    return modules, SCHEDULES[kind](stages, MICROBATCHES, loss_fn=loss_fn)


def _fsdp_run(ctx, kind: str):
    modules, schedule = _fsdp_stages(ctx, kind)
    params = [(f"{2 * s + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", p)
              for s, m in enumerate(modules) for n, p in m.named_parameters()]
    per_step = []
    for step in range(STEPS):
        x, y = _batch_rows(step, ctx.world_size)
        schedule.step(x.chunk(ctx.world_size)[ctx.rank].to(ctx.device),
                      target=y.chunk(ctx.world_size)[ctx.rank].to(ctx.device))
        grads = {n: p.grad.full_tensor() for n, p in params}
        with torch.no_grad():
            for _, p in params:
                p.sub_(LR * p.grad)
                p.grad = None
        per_step.append(dict(grads=grads, params={n: p.full_tensor() for n, p in params}))
    ref = reference_run(torch.nn.Sequential(*_blocks(False)), [_batch_rows(s, ctx.world_size) for s in range(STEPS)])
    return dict(errors=max_errors(per_step, ref))


def _batch_rows(step: int, world: int):
    gen = torch.Generator().manual_seed(3000 + step)
    rows = world * MICROBATCHES * MB_ROWS
    return torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)


FSDP = {f"fsdp_{kind}": kind for kind in ("interleaved_1f1b", "zbv_zero_bubble")}
for _name, _kind in FSDP.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _kind=_kind: _fsdp_run(ctx, _kind)


def scenario_fsdp_stage_with_reducer(ctx):
    _fsdp_stages(ctx, "zbv_zero_bubble", reducer_first=True)


def scenario_fsdp_reducer_over_stage(ctx):
    import dwgraph.distributed as dwdist

    modules, _ = _fsdp_stages(ctx, "zbv_zero_bubble")
    dwdist.FullyShardReducer(modules[1])


def scenario_fsdp_graphed_stages(ctx):
    _, schedule = _fsdp_stages(ctx, "zbv_zero_bubble")
    dwpp.make_graphed_stages(schedule, {0: (torch.randn(MB_ROWS, D),), 1: (torch.randn(MB_ROWS, D, requires_grad=True),)},
                             num_warmup_iters=1)


SCENARIOS = [*TRAIN, *NAIVE, *FSDP, "1f1b_without_dw_builder", "zero_bubble_without_dw_builder", "graphed_out_of_order",
             "fsdp_stage_with_reducer", "fsdp_reducer_over_stage", "fsdp_graphed_stages"]


@pytest.fixture(scope="module")
def results():
    return run_scenarios(__file__, SCENARIOS)


@pytest.fixture(scope="module", params=DEVICES)
def trained(request):
    return device_results(request, "results", [*TRAIN, *NAIVE], min_world=2)


@pytest.mark.parametrize("name", [*TRAIN, *NAIVE])
def test_training_matches_single_process(trained, name):
    for res in trained[name]:
        assert not isinstance(res, Failure), f"{res.type}: {res.message}\n{res.traceback}"
        assert_matches(res["errors"])
        assert res["hooks"] == [[MICROBATCHES]] * STEPS, res["hooks"]  # once per module per microbatch
        assert res["queued"] == [0] * STEPS


def test_1f1b_without_dw_builder_is_refused_at_the_optimizer(results):
    for r in results["1f1b_without_dw_builder"]:
        assert isinstance(r, Failure) and r.type == "GraphStateError" and "queued" in r.message, r


def test_graphed_stage_refuses_an_action_out_of_the_captured_order(results):
    r = results["graphed_out_of_order"][0]
    assert isinstance(r, Failure) and r.type == "GraphStateError" and "captured" in r.message, r


def test_zero_bubble_without_dw_builder_fails_at_the_first_weight_step(results):
    # Not a dwgraph error type: it is torch.autograd.grad inside torch's stage that fails.
    for r in results["zero_bubble_without_dw_builder"]:
        assert isinstance(r, Failure) and r.type == "RuntimeError" and "not have been used" in r.message, r
        assert "backward_weight_one_chunk" in r.traceback


@pytest.mark.parametrize("name", list(FSDP))
def test_fsdp2_stage_modules_match_single_process(results, name):
    # Eager: torch's stage keeps FSDP from reducing until after the last W step, so the
    # deferred gradients are in before the reduce-scatter.
    for res in results[name]:
        assert not isinstance(res, Failure), f"{res.type}: {res.message}\n{res.traceback}"
        assert_matches(res["errors"])


@pytest.mark.parametrize("name,says", [("fsdp_stage_with_reducer", "drives FSDP2 itself"),
                                       ("fsdp_reducer_over_stage", "drives FSDP2 itself"),
                                       ("fsdp_graphed_stages", "not supported")])
def test_fsdp2_with_pipelining_refuses_what_would_fight_torchs_stage(results, name, says):
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == "ArgumentError" and says in r.message, r
