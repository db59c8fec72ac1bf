"""FP8 amax reduced across ranks (issue 25, docs/fp8.md, Note [Amax reduced across ranks] in
ops/fp8.h) on two gloo processes (dist_harness).

Under ``fp8_autocast(amax_reduction_group=...)`` (or graphs captured with it) the
quantizations record their amax and keep the scales; ``dwgraph.fp8.reduce_amax(model, group)``,
once per step after the last ``backward_dw()``, reduces the histories over the group and
sets the scales. Each rank trains on its own data. Shown: graphed equals eager bitwise on
every rank over several steps and microbatches (both schedules, weight caching on and off);
after each reduction every rank holds the same history and scales; the reduced history is
the elementwise maximum of the ranks' own histories and each scale is the recipe's formula
of it (the independent reference); refusals are typed errors on every rank.
"""

from __future__ import annotations

import pytest
import torch

import dwgraph
from dist_harness import DEVICES, Failure, device_results, run_scenarios
from dwgraph.fp8 import DelayedScaling, Format, fp8_autocast, reduce_amax

H, ROWS, N_MICRO, STEPS = 16, 16, 3, 4
ORDER = [1, 1, -1, 1, -1.5, -1, -1.5, -1, -1.5]  # 1F1B-like, three microbatches, one chunk
FMAX = {"fwd": 448.0, "bwd": 57344.0}


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, device=device),
        dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, device=device))


def _dw(model):
    return [m for m in model.modules() if isinstance(m, dwgraph.nn._DeferredWgradModule)]


def _fp8_state(model):
    return [(b.clone(), s.clone()) for b, s in ((m.fp8_amax_history, m.fp8_scale) for m in _dw(model))]


def _train(ctx, schedule: str, cache: bool):
    import torch.distributed as dist

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    group = dist.group.WORLD
    eager, model = _model(ctx.device), _model(ctx.device)
    for m in (eager, model):
        for p in m.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    sample = lambda: (torch.randn(ROWS, H, device=ctx.device, requires_grad=True),)  # noqa: E731
    fp8 = dict(enabled=True, recipe=recipe, amax_reduction_group=group, cache_quantized_params=cache)
    if schedule == "sequential":
        g = dwgraph.make_graphed_callables((model,), (sample(),), **fp8)[0]
        slots = [g] * N_MICRO
    else:
        slots = dwgraph.make_graphed_callables((model,), tuple(sample() for _ in range(N_MICRO)), order=ORDER, **fp8)

    # Replays run no Python of the module: its forward's FP8 set-up counts eager forwards.
    cls, ran = type(model[0]), []
    original = cls._fp8_kwargs
    cls._fp8_kwargs = lambda self, *a, **k: (ran.append(1) if self is model[0] else None, original(self, *a, **k))[1]

    def eager_call(x, first):
        with fp8_autocast(recipe=recipe, amax_reduction_group=group):
            for mod in eager:
                x = mod(x, is_first_microbatch=first) if cache else mod(x)
            return x

    gen = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own data
    out = {"before": [], "after": [], "grads": [], "same": []}
    for step in range(STEPS):
        xs = [torch.randn(ROWS, H, generator=gen).to(ctx.device) for _ in range(N_MICRO)]
        results = []
        for name, call, dw in (("graphed", lambda mb, x: slots[mb](x, **({"is_first_microbatch": mb == 0}
                                                                         if cache else {})),
                                lambda mb: slots[mb].backward_dw()),
                               ("eager", lambda mb, x: eager_call(x, mb == 0), lambda mb: [m.backward_dw()
                                                                                        for m in _dw(eager)])):
            target = model if name == "graphed" else eager
            inputs = [x.clone().requires_grad_() for x in xs]
            if schedule == "sequential":
                for mb in range(N_MICRO):
                    call(mb, inputs[mb]).square().sum().backward()
                    dw(mb)
            else:
                ys, f, b = {}, 0, 0
                for a in ORDER:
                    if a > 0:
                        ys[f] = call(f, inputs[f])
                        f += 1
                    elif a == int(a):
                        ys[b].square().sum().backward()
                        b += 1
                    else:
                        dw(b - 1)
            before = _fp8_state(target)
            reduce_amax(target, group)
            results.append(([x.grad for x in inputs] + [p.main_grad.clone() for p in target.parameters()], before,
                            _fp8_state(target)))
        (g_grads, g_before, g_after), (e_grads, e_before, e_after) = results
        same = all(torch.equal(a, b) for a, b in zip(g_grads, e_grads)) and all(
            torch.equal(a, b) for pa, pb in ((g_before, e_before), (g_after, e_after))
            for (ha, sa), (hb, sb) in zip(pa, pb) for a, b in ((ha, hb), (sa, sb)))
        out["same"].append(same)
        out["before"].append([(h.cpu(), s.cpu()) for h, s in e_before])
        out["after"].append([(h.cpu(), s.cpu()) for h, s in e_after])
        for m in (eager, model):
            for p in m.parameters():
                p.main_grad.zero_()
    cls._fp8_kwargs = original
    out["graphed_forwards"] = len(ran)
    return out


def scenario_sequential_requantize(ctx):
    return _train(ctx, "sequential", False)


def scenario_sequential_cache(ctx):
    return _train(ctx, "sequential", True)


def scenario_pipeline_requantize(ctx):
    return _train(ctx, "pipeline", False)


def scenario_pipeline_cache(ctx):
    return _train(ctx, "pipeline", True)


def _one_fp8_step(ctx, model, group, modules=None):
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=group):
        x = torch.randn(ROWS, H, device=ctx.device)
        y = x
        for m in (modules if modules is not None else model):
            y = m(y)
        y.sum().backward()


def scenario_ranks_with_other_modules(ctx):
    import torch.distributed as dist

    model = _model(ctx.device)
    # Rank 1 runs only the first module in FP8: the ranks hold different state.
    _one_fp8_step(ctx, model, dist.group.WORLD, None if ctx.rank == 0 else [model[0]])
    reduce_amax(model, dist.group.WORLD)


def scenario_one_rank_without_fp8(ctx):
    import torch.distributed as dist

    model = _model(ctx.device)
    if ctx.rank == 0:
        _one_fp8_step(ctx, model, dist.group.WORLD)
    reduce_amax(model, dist.group.WORLD)  # rank 1 holds nothing: an error on both, no rank left waiting


def scenario_reset_on_one_rank(ctx):
    import torch.distributed as dist

    model = _model(ctx.device)
    _one_fp8_step(ctx, model, dist.group.WORLD)
    if ctx.rank == 1:
        model[1].reset_fp8_state()
    reduce_amax(model, dist.group.WORLD)


def scenario_other_recipes_with_equal_sizes(ctx):
    import torch.distributed as dist

    model = _model(ctx.device)
    recipe = DelayedScaling(amax_history_len=4, margin=ctx.rank)  # same sizes, other margins
    with fp8_autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
        model(torch.randn(ROWS, H, device=ctx.device)).sum().backward()
    reduce_amax(model, dist.group.WORLD)


def scenario_empty_chunk_list_on_one_rank(ctx):
    import torch.distributed as dist

    model = _model(ctx.device)
    _one_fp8_step(ctx, model, dist.group.WORLD)
    reduce_amax(model if ctx.rank == 0 else [], dist.group.WORLD)  # refused on both, after the agreement


def scenario_chunks_copies_and_other_groups(ctx):
    import copy

    import torch.distributed as dist

    # Model chunks as a list; a group made with new_group; a deep copy after an FP8 step
    # (the group is not kept on the modules); an eager call without a group in between.
    g2 = dist.new_group([0, 1])
    chunks = [_model(ctx.device), _model(ctx.device)]
    _one_fp8_step(ctx, None, g2, [chunks[0][0], chunks[0][1], chunks[1][0], chunks[1][1]])
    clone = copy.deepcopy(chunks)
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
        chunks[1][1](torch.randn(ROWS, H, device=ctx.device))
        clone[1][1](torch.randn(ROWS, H, device=ctx.device))
    reduce_amax(chunks, g2)
    reduce_amax(clone, g2)
    return [b.cpu() for c in chunks for n, b in c.named_buffers() if n.endswith(("fp8_amax_history", "fp8_scale"))]


def scenario_current_scaling_with_a_group(ctx):
    import torch.distributed as dist

    from dwgraph.fp8 import Float8CurrentScaling

    with fp8_autocast(recipe=Float8CurrentScaling(), amax_reduction_group=dist.group.WORLD):
        pass


def scenario_not_a_group(ctx):
    with fp8_autocast(amax_reduction_group="world"):
        pass


def scenario_reduce_inside_a_capture(ctx):
    import torch.distributed as dist

    model = _model(ctx.device)
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=dist.group.WORLD):
        model(torch.randn(ROWS, H, device=ctx.device))
    with dwgraph.graphs.Graph("cpu").capture():
        reduce_amax(model, dist.group.WORLD)


def scenario_recipe_of_a_replay(ctx):
    """reduce_amax sets the scales by the recipe of each module's last FP8 forward; a replay
    is one, and runs no Python. A module graphed under one recipe, with an eager evaluation
    forward under another (same history length) between steps: after each step's replay
    the reduction follows the graph's recipe, as eager's follows its training forward (a
    review found it using the evaluation's). Per step: the scaling state and the weight
    gradient of the graphed copy equal to the eager one's."""
    import copy

    import torch.distributed as dist

    group = dist.group.WORLD
    train = DelayedScaling(amax_history_len=4, margin=0)
    evaluation = DelayedScaling(amax_history_len=4, margin=1, fp8_format=Format.E4M3)
    torch.manual_seed(ctx.rank)
    lin = dwgraph.nn.Linear(H, H, device=ctx.device)
    eager = copy.deepcopy(lin)
    # Graphed inside a Sequential, so the evaluation forward below reaches the module itself
    # (a graphed module's own eager calls run under its capture's FP8 state).
    g = dwgraph.make_graphed_callables(torch.nn.Sequential(lin),
                                       (torch.randn(ROWS, H, device=ctx.device, requires_grad=True),),
                                       enabled=True, recipe=train, amax_reduction_group=group)
    out = []
    for step in range(4):
        x, w = torch.randn(ROWS, H, device=ctx.device), torch.randn(ROWS, H, device=ctx.device)
        for m in (lin, eager):
            m.zero_grad(set_to_none=True)
        (g(x.clone().requires_grad_()) * w).sum().backward()
        with fp8_autocast(recipe=train, amax_reduction_group=group):
            (eager(x.clone().requires_grad_()) * w).sum().backward()
        reduce_amax(lin, group)
        reduce_amax(eager, group)
        out.append(torch.equal(lin.fp8_scale, eager.fp8_scale) and
                   torch.equal(lin.fp8_amax_history, eager.fp8_amax_history) and torch.equal(lin.weight.grad, eager.weight.grad))
        x = torch.randn(ROWS, H, device=ctx.device)
        with torch.no_grad(), fp8_autocast(recipe=evaluation, amax_reduction_group=group):
            for m in (lin, eager):
                m(x)
    return out


TRAIN = ["sequential_requantize", "sequential_cache", "pipeline_requantize", "pipeline_cache"]
SCENARIOS = [*TRAIN, "ranks_with_other_modules", "one_rank_without_fp8", "reset_on_one_rank", "other_recipes_with_equal_sizes",
             "empty_chunk_list_on_one_rank",
             "chunks_copies_and_other_groups", "current_scaling_with_a_group", "not_a_group", "reduce_inside_a_capture",
             "recipe_of_a_replay"]


@pytest.fixture(scope="module")
def results():
    return run_scenarios(__file__, SCENARIOS)


@pytest.fixture(scope="module", params=DEVICES)
def trained(request):
    return device_results(request, "results", TRAIN, min_world=2)


def _ok(per_rank, name):
    for r in per_rank:
        assert not isinstance(r, Failure), f"{name} raised {r.type}: {r.message}\n{r.traceback}"
    return per_rank


def _reference_scales(history):
    """Each column's role's fp8_max and its history's maximum."""
    cols = history.shape[1]
    fmax = torch.tensor([FMAX["bwd"] if c % 3 == 2 else FMAX["fwd"] for c in range(cols)])
    amax = history.amax(0)
    return fmax, amax


@pytest.mark.parametrize("name", TRAIN)
def test_graphed_equals_eager_and_the_ranks_agree_after_each_reduction(trained, name):
    ranks = _ok(trained[name], name)
    for r in ranks:
        assert r["graphed_forwards"] == 0, "the graphed model ran its forward eagerly"
        assert all(r["same"]), f"graphed differs from eager at steps {[i for i, s in enumerate(r['same']) if not s]}"
    r0, r1 = ranks
    for step in range(STEPS):
        for m, ((h0, s0), (h1, s1)) in enumerate(zip(r0["after"][step], r1["after"][step])):
            assert torch.equal(h0, h1) and torch.equal(s0, s1), f"step {step}, module {m}: the ranks disagree"
            # The reference: the elementwise maximum of the ranks' own histories, and each
            # scale the recipe's formula of it (delayed scaling, margin 0, max over history).
            # Between reductions the quantizations kept the scales (they only recorded amaxes).
            for r in ranks:
                kept = r["after"][step - 1][m][1] if step else torch.ones_like(s0)
                assert torch.equal(r["before"][step][m][1], kept), f"step {step}, module {m}: a scale moved"
            b0, b1 = r0["before"][step][m][0], r1["before"][step][m][0]
            assert torch.equal(h0, torch.maximum(b0, b1)), f"step {step}, module {m}: history is not the max"
            fmax, amax = _reference_scales(h0)
            old = r0["before"][step][m][1]
            want = torch.where((amax > 0) & torch.isfinite(amax), torch.full_like(amax, 1.0) * fmax / amax, old)
            assert torch.equal(s0, want), f"step {step}, module {m}: scales"
    # The ranks' data differ, so their own amaxes did: the reduction had something to do.
    assert any(not torch.equal(r0["before"][s][m][0], r1["before"][s][m][0])
               for s in range(STEPS) for m in range(len(r0["before"][s])))


@pytest.mark.parametrize("name,kind,match", [
    ("ranks_with_other_modules", "GraphStateError", "another rank a different count"),
    ("one_rank_without_fp8", "GraphStateError", "another rank a different count"),
    ("reset_on_one_rank", "GraphStateError", "another rank a different count"),
    ("other_recipes_with_equal_sizes", "GraphStateError", "under other recipes"),
    ("empty_chunk_list_on_one_rank", None, None),
    ("current_scaling_with_a_group", "ArgumentError", "needs delayed scaling"),
    ("not_a_group", "ArgumentError", "must be a torch.distributed ProcessGroup"),
    ("reduce_inside_a_capture", "GraphStateError", "inside a graph capture"),
])
def test_refusals_are_typed_errors_on_every_rank(results, name, kind, match):
    if kind is None:  # the rank with the bad argument says so; its peer learns it from the agreement
        r0, r1 = results[name]
        assert isinstance(r0, Failure) and r0.type == "GraphStateError" and "cannot be updated" in r0.message, r0
        assert isinstance(r1, Failure) and r1.type == "ArgumentError" and "non-empty list" in r1.message, r1
        return
    for r in results[name]:
        assert isinstance(r, Failure) and r.type == kind and match in r.message, r


def test_chunks_copies_and_groups_made_with_new_group(results):
    r0, r1 = _ok(results["chunks_copies_and_other_groups"], "chunks_copies_and_other_groups")
    assert len(r0) == 8 and all(torch.equal(a, b) for a, b in zip(r0, r1)), "the ranks disagree after the reduction"


def test_the_reduction_follows_the_recipe_of_a_replay(results):
    for r in results["recipe_of_a_replay"]:
        assert not isinstance(r, Failure), f"{r.type}: {r.message}\n{r.traceback}"
        assert r == [True] * 4, r
