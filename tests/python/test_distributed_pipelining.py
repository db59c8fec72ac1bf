"""torch.distributed.pipelining with deferred weight gradients on two gloo processes
(SPEC C9).

A model of four blocks, each mixing a deferred dwgraph Linear with a plain torch Linear or
a deferred LayerNormMLP, is cut into stages (two for Schedule1F1B, four -- two per rank --
for ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
ScheduleDualPipeV) of dwgraph.distributed.pipelining.PipelineStage, run eagerly and with
per-microbatch graphs (make_graphed_stages), with .grad and with fused main_grad, for 5
steps of 4 microbatches. Every rank compares the gradients and parameters of its stages
with a single-process run on the whole batch (FP32, 1e-6 relative), and counts the wgrad
hooks (once per module per microbatch) and what is left queued (nothing).

The shared-weight scenarios (Note [Shared parameters are scaled once]) put one Parameter on
two stages of a rank (a tied embedding and output head, deferred Linears sharing a weight)
and check, against a single process with the same ties, that it is scaled once, summed
over both stages, with scale_grads True and False, eager and graphed (bitwise equal), and
reduced once by a data-parallel reducer.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

import dwgraph
import dwgraph.distributed as dwdist
import dwgraph.distributed.pipelining as dwpp
from dist_harness import DEVICES, Failure, device_results, run_scenarios
from dist_models import (LR, STEPS, assert_matches, deferred_modules, fused_ids, gradient, loss_fn, max_errors,
                         ref_parameter, reference_run, sgd, torch_reference)

D = 16
BLOCKS = 4
MICROBATCHES = 4
MB_ROWS = 4
SCHEDULES = {"1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv_zero_bubble": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")  # the first and the last stage on one rank


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
    if kind in V_SCHEDULES:
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

    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    blocks = _blocks(False)
    modules = [torch.nn.Sequential(*blocks[2 * s:2 * s + 2]).to(ctx.device) for s in range(2)]
    for m in modules:
        for b in m:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
    if reducer_first:
        dwdist.FullyShardReducer(modules[0])
    stages = [dwpp.PipelineStage(modules[s], s, 2, ctx.device, group=groups[ctx.rank]) for s in range(2)]
    return modules, SCHEDULES[kind](stages, MICROBATCHES, loss_fn=loss_fn)


def _after_a_loss_error(ctx, kind: str):
    """Both stages on each rank (a group of one), graphed and eager dwgraph stages side by
    side: the loss function raises at the first microbatch of step 1 and the caller goes on.
    The graphed stages replay the captured order from its start at the next step, as the
    eager ones run it (a review found every later step refused: the order's cursor stayed
    where the failed step left it). Returns, per step, whether the gradients of the two are
    bitwise equal ('raised' for the failed step)."""
    group = [dist.new_group([r]) for r in range(ctx.world_size)][ctx.rank]
    failing = {"now": False}

    def loss(out, target):
        if failing["now"]:
            failing["now"] = False
            raise KeyError("the user's loss failed")
        return loss_fn(out, target)

    runs = []
    for graphed in (True, False):
        blocks = _blocks(False)
        modules = [torch.nn.Sequential(*blocks[2 * s:2 * s + 2]).to(ctx.device) for s in range(2)]
        stages = [dwpp.PipelineStage(modules[s], s, 2, ctx.device, group=group) for s in range(2)]
        schedule = SCHEDULES[kind](stages, MICROBATCHES, loss_fn=loss)
        if graphed:
            dwpp.make_graphed_stages(schedule, {0: (torch.randn(MB_ROWS, D, device=ctx.device),),
                                                1: (torch.randn(MB_ROWS, D, device=ctx.device, requires_grad=True),)},
                                     num_warmup_iters=1)
        runs.append((schedule, modules))
    out = []
    for step in range(3):
        x, y = (t.to(ctx.device) for t in _batch(step))
        seen = []
        for schedule, modules in runs:
            for m in modules:
                m.zero_grad(set_to_none=True)
            failing["now"] = step == 1
            try:
                schedule.step(x, target=y)
            except KeyError:
                seen.append("raised")
                continue
            seen.append([p.grad for m in modules for p in m.parameters()])
        graphed, eager = seen
        out.append(graphed if graphed == "raised" == eager else
                   not isinstance(graphed, str) and not isinstance(eager, str) and
                   all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(graphed, eager)))
    return out


for _kind in V_SCHEDULES:
    globals()[f"scenario_after_a_loss_error_{_kind}"] = lambda ctx, _kind=_kind: _after_a_loss_error(ctx, _kind)
AFTER_ERROR = [f"after_a_loss_error_{_kind}" for _kind in V_SCHEDULES]


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
    modules, _ = _fsdp_stages(ctx, "zbv_zero_bubble")
    dwdist.FullyShardReducer(modules[1])


def scenario_fsdp_graphed_stages(ctx):
    _, schedule = _fsdp_stages(ctx, "zbv_zero_bubble")
    dwpp.make_graphed_stages(schedule, {0: (torch.randn(MB_ROWS, D),), 1: (torch.randn(MB_ROWS, D, requires_grad=True),)},
                             num_warmup_iters=1)


# -- shared parameters (Note [Shared parameters are scaled once]) -----------------------------
#
# Four stage modules: stage 0 starts with a plain torch Embedding, each has a deferred
# dwgraph Linear and a GELU, stage 1 a plain torch Linear, stage 2 a second deferred Linear,
# stage 3 ends with a deferred output head. Which parameters are one Parameter (`TIES`):
# "v" (the first and last stage on one rank, as ZBV and DualPipeV place them): the head's
# weight is the embedding's (the tied GPT embedding, rank 0), stage 2's two Linears use
# stage 1's Linear's weight (rank 1); "interleaved" (stages s and s + 2 on one rank): stage
# 2's Linears use stage 0's weight, stage 3's uses stage 1's; "across_ranks": the embedding
# and the head tied on stages 0 and 3, which an interleaved schedule puts on two ranks.
V = 12  # vocabulary of the embedding and the head
TIES = {
    "v": [((3, "head"), (0, "emb")), ((1, "lin"), (2, "lin")), ((1, "lin"), (2, "lin_b"))],
    "interleaved": [((0, "lin"), (2, "lin")), ((0, "lin"), (2, "lin_b")), ((1, "lin"), (3, "lin"))],
    "across_ranks": [((3, "head"), (0, "emb"))],
}


def _tie(blocks, ties: str) -> None:
    for (a, an), (b, bn) in TIES[ties]:
        setattr(getattr(blocks[b], bn), "weight", getattr(blocks[a], an).weight)


def _shared_blocks(fused: bool, ties: str):
    torch.manual_seed(0)

    def linear(out=D, bias=True):
        return dwgraph.nn.Linear(D, out, bias=bias, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)

    blocks = []
    for s in range(4):
        layers = OrderedDict()
        if s == 0:
            layers["emb"] = torch.nn.Embedding(V, D)
        layers["lin"] = linear()
        layers["act"] = torch.nn.GELU()
        if s == 1:
            layers["plain"] = torch.nn.Linear(D, D)
        if s == 2:
            layers["lin_b"] = linear()
        if s == 3:
            layers["head"] = linear(V, bias=False)
        blocks.append(torch.nn.Sequential(layers))
    _tie(blocks, ties)  # the fused weights keep their main_grad: each tie takes a dwgraph weight
    return blocks


def _token_batch(step: int):
    gen = torch.Generator().manual_seed(4000 + step)
    rows = MICROBATCHES * MB_ROWS
    return torch.randint(V, (rows,), generator=gen), torch.randn(rows, V, generator=gen)


def _total_grad(p, fused: set):
    """What the optimizer steps with: main_grad for a fused weight, plus the .grad plain
    modules accumulated (the embedding tied to a fused head)."""
    g = p.main_grad.detach().clone() if id(p) in fused else None
    if p.grad is not None:
        g = p.grad.detach().clone() if g is None else g + p.grad
    if g is None:
        raise AssertionError("a parameter has no gradient")
    return g


def _shared_reference(fused: bool, ties: str, loss_scale: float, steps: int):
    """The single process on the whole batch in plain torch.nn and float64, the same
    parameters tied (torch_reference rebuilds the dwgraph Linears, so they are tied again),
    per step the gradients and the parameters after the SGD step, by every name (a tied
    parameter under each of its names)."""
    model = torch.nn.Sequential(*_shared_blocks(fused, ties))
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    ref = torch_reference(model)
    _tie(list(ref), ties)
    unique = list(ref.parameters())
    out = []
    for step in range(steps):
        x, y = _token_batch(step)
        for p in unique:
            p.grad = None
        (loss_scale * loss_fn(ref(x), y.double())).backward()
        grads = {n: ref_parameter(ref, n).grad.clone() for n in names}
        with torch.no_grad():
            for p in unique:
                p.sub_(LR * p.grad)
        out.append(dict(grads=grads, params={n: ref_parameter(ref, n).detach().clone() for n in names}))
    return out


SHARED_STEPS = 2


def _shared_run(ctx, kind: str, fused: bool, graphed: bool, scale: bool, set_to_none: bool, ties: str,
                stage_cls=dwpp.PipelineStage, reduce_across_ranks: bool = False):
    num_stages, mine = _layout(kind, ctx.rank, ctx.world_size)
    blocks = _shared_blocks(fused, ties)
    modules = {s: blocks[s].to(ctx.device) for s in mine}
    stages = [stage_cls(modules[s], s, num_stages, ctx.device) for s in mine]
    schedule = SCHEDULES[kind](stages, MICROBATCHES, loss_fn=loss_fn, scale_grads=scale)
    if graphed:
        sample = {s: (torch.randint(V, (MB_ROWS,), device=ctx.device) if s == 0 else
                      torch.randn(MB_ROWS, D, device=ctx.device, requires_grad=True),) for s in mine}
        dwpp.make_graphed_stages(schedule, sample, num_warmup_iters=1)
    deferred = list({id(m): m for s in mine for m in deferred_modules(modules[s])}.values())
    hooks = {id(m): 0 for m in deferred}
    for m in deferred:
        m.register_wgrad_hook(lambda mod: hooks.__setitem__(id(mod), hooks[id(mod)] + 1))
    fused_set = set().union(*(fused_ids(modules[s]) for s in mine))
    named = [(f"{s}.{n}", p) for s in mine for n, p in modules[s].named_parameters(remove_duplicate=False)]
    unique = list({id(p): p for _, p in named}.values())
    tied = [p for s in mine for n, p in modules[s].named_parameters() if n in ("emb.weight", "head.weight")]

    per_step, hook_counts, queued = [], [], []
    for step in range(SHARED_STEPS):
        x, y = (t.to(ctx.device) for t in _token_batch(step))
        kwargs = {}
        if 0 in mine:
            kwargs["x"] = x
        if num_stages - 1 in mine:
            kwargs["target"] = y
        for k in hooks:
            hooks[k] = 0
        schedule.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
        if reduce_across_ranks:
            # docs/distributed.md, Shared weights: the copies on the ranks holding the first
            # and the last stage (Megatron's embedding group; here the world) sum their
            # gradients after step(), each already scaled once by its own stage.
            for p in tied:
                dist.all_reduce(p.grad)
        hook_counts.append(sorted(set(hooks.values())))
        queued.append(sum(m.num_queued_wgrad_units() for m in deferred))
        grads = {n: _total_grad(p, fused_set) for n, p in named}
        with torch.no_grad():
            for p in unique:
                p.sub_(LR * _total_grad(p, fused_set).to(p.dtype))
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
                if id(p) in fused_set:
                    p.main_grad.zero_()
        per_step.append(dict(grads=grads, params={n: p.detach().clone() for n, p in named}))
    ref = _shared_reference(fused, ties, 1.0 if scale else float(MICROBATCHES), SHARED_STEPS)
    return dict(errors=max_errors(per_step, ref, across_ranks=True, device=ctx.device), hooks=hook_counts,
                queued=queued, steps=[{k: {n: t.cpu() for n, t in d.items()} for k, d in st.items()}
                                      for st in per_step])


SHARED = {f"shared_{kind}_{grad}_{'scaled' if scale else 'summed'}_{'none' if none else 'zeros'}_{mode}":
          (kind, grad == "main_grad", mode == "graphed", scale, none, "v")
          for kind in V_SCHEDULES for grad in ("grad", "main_grad") for scale in (True, False)
          for none in (True, False) for mode in ("eager", "graphed")}
SHARED.update({f"shared_{kind}_{grad}_scaled_none_{mode}": (kind, grad == "main_grad", mode == "graphed", True, True,
                                                            "interleaved")
               for kind in ("interleaved_1f1b", "interleaved_zero_bubble") for grad in ("grad", "main_grad")
               for mode in ("eager", "graphed")})
for _name, _args in SHARED.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _args=_args: _shared_run(ctx, *_args)

ACROSS_RANKS = {f"shared_across_ranks_{mode}": mode == "graphed" for mode in ("eager", "graphed")}
for _name, _graphed in ACROSS_RANKS.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _graphed=_graphed: _shared_run(
        ctx, "interleaved_1f1b", False, _graphed, True, True, "across_ranks", reduce_across_ranks=True)


def scenario_shared_torch_stage(ctx):
    """What torch's own stage does with the tied embedding of a V schedule (a dw_builder
    that calls backward_dw(), scale_grads=True): each stage divides the shared gradient."""
    return _shared_run(ctx, "zbv_zero_bubble", False, False, True, True, "v", stage_cls=_naive_stage)


def _dp_shared_stages(ctx, fused: bool):
    """Data parallel over the ranks, the pipeline within each rank: the V of one rank (two
    stages, blocks 0-1 and 2-3 of the shared model, so the tied embedding and head and the
    Linears sharing a weight are on both stages)."""
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    blocks = _shared_blocks(fused, "v")
    modules = [torch.nn.Sequential(*blocks[2 * s:2 * s + 2]).to(ctx.device) for s in range(2)]
    return groups[ctx.rank], modules


def _dp_shared_run(ctx, kind: str, fused: bool, graphed: bool):
    """One DataParallelReducer over both stage modules reduces each shared parameter once;
    the step runs inside its no_sync() and finish() follows it, so the reduction reads the
    gradients every stage has landed and scaled."""
    group, modules = _dp_shared_stages(ctx, fused)
    reducer = dwdist.DataParallelReducer(torch.nn.ModuleList(modules))
    stages = [dwpp.PipelineStage(modules[s], s, 2, ctx.device, group=group) for s in range(2)]
    schedule = SCHEDULES[kind](stages, MICROBATCHES, loss_fn=loss_fn)
    rows = MICROBATCHES * MB_ROWS // ctx.world_size // MICROBATCHES
    if graphed:
        dwpp.make_graphed_stages(schedule, {0: (torch.randint(V, (rows,), device=ctx.device),),
                                            1: (torch.randn(rows, D, device=ctx.device, requires_grad=True),)},
                                 num_warmup_iters=1)
    fused_set = set().union(*(fused_ids(m) for m in modules))
    named = [(f"{2 * s + int(n.split('.', 1)[0])}.{n.split('.', 1)[1]}", p)
             for s, m in enumerate(modules) for n, p in m.named_parameters(remove_duplicate=False)]
    unique = list({id(p): p for _, p in named}.values())
    by_reducer = {id(p) for _, p in reducer.named_parameters()}
    # How often the reducer reduces each shared parameter, by its first name.
    shared = {n: p for n, p in named if sum(q is p for _, q in named) > 1}
    reduced = {n: sum(q is p for _, q in reducer.named_parameters()) for n, p in shared.items()}
    per_step = []
    for step in range(SHARED_STEPS):
        x, y = (t.chunk(ctx.world_size)[ctx.rank].to(ctx.device) for t in _token_batch(step))
        with reducer.no_sync():
            schedule.step(x, target=y)
        reducer.finish()
        # What the reducer does not own: the plain modules' parameters, and what the plain
        # embedding accumulates in .grad of the head's fused weight (its main_grad is reduced).
        for p in unique:
            if p.grad is not None and (id(p) not in by_reducer or id(p) in fused_set):
                dist.all_reduce(p.grad)
                p.grad.div_(ctx.world_size)
        grads = {n: _total_grad(p, fused_set) for n, p in named}
        with torch.no_grad():
            for p in unique:
                p.sub_(LR * _total_grad(p, fused_set).to(p.dtype))
                p.grad = None
                if id(p) in fused_set:
                    p.main_grad.zero_()
        per_step.append(dict(grads=grads, params={n: p.detach().clone() for n, p in named}))
    return dict(errors=max_errors(per_step, _shared_reference(fused, "v", 1.0, SHARED_STEPS)), reduced=reduced,
                steps=[{k: {n: t.cpu() for n, t in d.items()} for k, d in st.items()} for st in per_step])


DP_SHARED = {f"dp_shared_{kind}_{grad}_{mode}": (kind, grad == "main_grad", mode == "graphed")
             for kind in V_SCHEDULES for grad in ("grad", "main_grad") for mode in ("eager", "graphed")}
for _name, _args in DP_SHARED.items():
    globals()[f"scenario_{_name}"] = lambda ctx, _args=_args: _dp_shared_run(ctx, *_args)


def scenario_dp_shared_reducer_per_stage(ctx):
    """A DataParallelReducer per stage module: the weight both stages use would be averaged
    twice; the second is refused."""
    _, modules = _dp_shared_stages(ctx, False)
    dwdist.DataParallelReducer(modules[0])
    dwdist.DataParallelReducer(modules[1])


def scenario_dp_shared_ddp_per_stage(ctx):
    """dwgraph's DistributedDataParallel per stage module (torch's way of combining DDP with
    pipelining): stage 0's torch DDP would reduce the tied embedding, stage 1's dwgraph
    reducer the head's weight, which is the same parameter; the second is refused."""
    _, modules = _dp_shared_stages(ctx, False)
    dwdist.DistributedDataParallel(modules[0])
    dwdist.DistributedDataParallel(modules[1])


SCENARIOS = [*TRAIN, *NAIVE, *FSDP, "1f1b_without_dw_builder", "zero_bubble_without_dw_builder", "graphed_out_of_order",
             "fsdp_stage_with_reducer", "fsdp_reducer_over_stage", "fsdp_graphed_stages",
             *SHARED, *ACROSS_RANKS, "shared_torch_stage", *DP_SHARED, "dp_shared_reducer_per_stage",
             "dp_shared_ddp_per_stage", *AFTER_ERROR]


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


@pytest.mark.parametrize("name", AFTER_ERROR)
def test_graphed_stages_go_on_after_a_step_that_raised(results, name):
    for r in results[name]:
        assert not isinstance(r, Failure), f"{r.type}: {r.message}\n{r.traceback}"
        assert r == [True, "raised", True], r


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


@pytest.fixture(scope="module", params=DEVICES)
def shared(request):
    return device_results(request, "results", [*SHARED, *ACROSS_RANKS], min_world=2)


@pytest.mark.parametrize("name", [*SHARED, *ACROSS_RANKS])
def test_shared_parameter_is_scaled_once(shared, name):
    # A tied embedding and head, and deferred Linears sharing one weight, on stages of one
    # rank: every gradient (the shared ones once under each name) and parameter as in the
    # single process, with scale_grads True (divided once) and False (summed).
    for res in shared[name]:
        assert not isinstance(res, Failure), f"{res.type}: {res.message}\n{res.traceback}"
        assert_matches(res["errors"])
        assert res["hooks"] == [[MICROBATCHES]] * SHARED_STEPS, res["hooks"]
        assert res["queued"] == [0] * SHARED_STEPS


@pytest.mark.parametrize("name", [n for n in [*SHARED, *ACROSS_RANKS] if n.endswith("_graphed")])
def test_shared_parameter_graphed_is_bitwise_eager(shared, name):
    eager = shared[name[:-len("graphed")] + "eager"]
    for got, want in zip(shared[name], eager, strict=True):
        assert not isinstance(got, Failure) and not isinstance(want, Failure), (got, want)
        for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
            for kind in ("grads", "params"):
                assert g[kind].keys() == w[kind].keys()
                for n in g[kind]:
                    assert torch.equal(g[kind][n], w[kind][n]), (step, kind, n)


def test_torch_stage_divides_a_shared_parameter_once_per_stage(results):
    # torch's own PipelineStage (scale_grads=True, a dw_builder calling backward_dw()): each
    # stage divides the tied embedding's gradient, the first time before the other stage's
    # weight steps landed. Recorded so that the references above would catch it.
    res = results["shared_torch_stage"]
    assert not any(isinstance(r, Failure) for r in res), res
    assert max(r["errors"]["grads"] for r in res) > 0.1, [r["errors"] for r in res]


def test_unshared_parameters_are_scaled_as_torch_scales_them(results):
    # The first step's gradients of the parameters of one stage: dwgraph's stage divides
    # them as torch's does, bit for bit (later steps differ: the shared ones did).
    tied = {f"{s}.{attr}.weight" for pair in TIES["v"] for s, attr in pair}
    for ours, torchs in zip(results["shared_zbv_zero_bubble_grad_scaled_none_eager"], results["shared_torch_stage"],
                            strict=True):
        first, theirs = ours["steps"][0]["grads"], torchs["steps"][0]["grads"]
        unshared = [n for n in first if n not in tied]
        assert unshared and all(torch.equal(first[n], theirs[n]) for n in unshared), unshared
        assert any(not torch.equal(first[n], theirs[n]) for n in first if n in tied)


@pytest.mark.parametrize("name", list(DP_SHARED))
def test_data_parallel_reduces_a_shared_parameter_once(results, name):
    # Every shared parameter reduced once (one slot in the one reducer), averaged after the
    # stages scaled it: every gradient as in the single process on the whole batch.
    for res in results[name]:
        assert not isinstance(res, Failure), f"{res.type}: {res.message}\n{res.traceback}"
        assert_matches(res["errors"])
        assert len(res["reduced"]) == 5 and set(res["reduced"].values()) == {1}, res["reduced"]
    if name.endswith("_graphed"):
        for got, want in zip(results[name], results[name[:-len("graphed")] + "eager"], strict=True):
            for g, w in zip(got["steps"], want["steps"], strict=True):
                assert all(torch.equal(g[k][n], w[k][n]) for k in ("grads", "params") for n in g[k])


@pytest.mark.parametrize("name,says", [("dp_shared_reducer_per_stage", "another DataParallelReducer"),
                                       ("dp_shared_ddp_per_stage", "already reduced by")])
def test_a_shared_parameter_in_two_data_parallel_reducers_is_refused(results, name, says):
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == "ArgumentError" and says in r.message, r
        assert "ModuleList" in r.message and "no_sync()" in r.message, r.message
