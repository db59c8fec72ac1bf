"""make_graphed_callables as a drop-in for torch's and TransformerEngine's (issue 14):

  * modules come back as the same objects with their forward replaced: they stay in
    Sequential/ModuleList, keep parameters(), train()/eval() (eval runs eagerly) and
    state_dict(); plain callables come back as callables; a forward set on the instance is
    the one graphed (and the one the eager fallback runs);
  * arbitrary pytrees of inputs and outputs (nested tuples/lists/dicts, None leaves,
    non-tensor leaves fixed at capture, keyword arguments);
  * TransformerEngine's argument spellings and pools: ``_order``, ``_num_layers_per_chunk``,
    ``_reuse_graph_input_output_buffers`` (memory shared across microbatches, exact);
  * the scenarios PyTorch's own make_graphed_callables tests cover, in our own code: dict
    inputs and outputs, a parameterless module whose output needs no grad, two calls sharing
    a pool, autocast with the cache disabled, allow_unused_input.
Each graphed result is compared bitwise with the same modules run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dwgraph
from safety_common import assert_same_as_eager, eager_backward_dw, one_f_one_b, run_order

H = 8
B = 4


def _mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.ReLU(),
                               torch.nn.Linear(H, H))


def test_modules_come_back_with_forward_replaced():
    a, b = _mlp(), _mlp()
    ea, eb = copy.deepcopy(a), copy.deepcopy(b)
    ga, gb = dwgraph.make_graphed_callables((a, b), ((torch.randn(B, H),), (torch.randn(B, H, requires_grad=True),)))
    assert ga is a and gb is b
    model = torch.nn.Sequential(ga, torch.nn.Tanh(), gb)      # back into a container
    eager = torch.nn.Sequential(ea, torch.nn.Tanh(), eb)
    assert len(list(model.parameters())) == len(list(eager.parameters()))
    assert set(model.state_dict()) == set(eager.state_dict())
    for step in range(3):
        x = torch.randn(B, H)
        model(x).square().sum().backward()
        ga.backward_dw(), gb.backward_dw()
        eager(x).square().sum().backward()
        eager_backward_dw(eager)
        assert_same_as_eager(model, eager, f"step {step}")
    model.eval(), eager.eval()
    with torch.no_grad():
        x = torch.randn(B, H)
        assert torch.equal(model(x), eager(x))  # eval runs the original forward
    assert dwgraph.graphed_handle(a).stats()["num_graphs"] == 6
    fn = dwgraph.make_graphed_callables(lambda x: x * 2 + 1, (torch.randn(B, H),))
    assert isinstance(fn, dwgraph.GraphedCallable)
    x = torch.randn(B, H)
    assert torch.equal(fn(x), x * 2 + 1)


def test_a_module_list_is_a_sequence_of_callables():
    # model.blocks as users hold it: each block graphed, the list itself has no forward.
    blocks = torch.nn.ModuleList([_mlp(), _mlp()])
    eager = copy.deepcopy(blocks)
    graphed = dwgraph.make_graphed_callables(
        blocks, ((torch.randn(B, H),), (torch.randn(B, H, requires_grad=True),)))
    assert isinstance(graphed, tuple) and graphed[0] is blocks[0] and graphed[1] is blocks[1]
    for step in range(3):
        x = torch.randn(B, H)
        blocks[1](blocks[0](x)).square().sum().backward()
        for b in graphed:
            b.backward_dw()
        eager[1](eager[0](x)).square().sum().backward()
        eager_backward_dw(eager)
        assert_same_as_eager(blocks, eager, f"step {step}")


def test_a_forward_set_on_the_instance_is_what_gets_graphed():
    # make_graphed_callables stripped any instance 'forward' (meant for its own, from an
    # earlier graphing), so the graphs ran the class forward instead of the caller's.
    torch.manual_seed(0)
    m = torch.nn.Linear(H, H)
    e = copy.deepcopy(m)
    for mm in (m, e):
        mm.forward = (lambda mm: lambda x: torch.nn.functional.linear(x, mm.weight, mm.bias) * 3.0)(mm)
    dwgraph.make_graphed_callables(m, (torch.randn(B, H, requires_grad=True),), num_warmup_iters=1)
    x = torch.randn(B, H)
    assert torch.equal(m(x), e(x))
    m.eval()
    e.eval()
    assert torch.equal(m(x), e(x))  # the eager fallback runs it too


class _DictModule(torch.nn.Module):
    """Dict in, nested structure with None and a non-tensor leaf out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
        self.other = torch.nn.Linear(H, H)

    def forward(self, batch, scale=1.0, mask=None):
        h = self.lin(batch["x"]) * scale
        out = {"y": self.other(h) + batch["bias"], "aux": [h.detach(), None], "tag": "ok"}
        return out, None


def test_pytrees_in_and_out():
    m = _DictModule()
    eager = copy.deepcopy(m)
    sample = ({"x": torch.randn(B, H, requires_grad=True), "bias": torch.randn(H)},)
    g = dwgraph.make_graphed_callables(m, sample, sample_kwargs={"scale": 0.5, "mask": None})
    for step in range(3):
        batch = {"x": torch.randn(B, H, requires_grad=True), "bias": torch.randn(H)}
        ebatch = {"x": batch["x"].detach().clone().requires_grad_(), "bias": batch["bias"].clone()}
        (out, none), (eout, _) = g(batch, scale=0.5, mask=None), eager(ebatch, scale=0.5, mask=None)
        assert none is None and out["tag"] == "ok" and out["aux"][1] is None
        assert torch.equal(out["y"], eout["y"]) and torch.equal(out["aux"][0], eout["aux"][0])
        out["y"].square().sum().backward()
        g.backward_dw()
        eout["y"].square().sum().backward()
        eager.lin.backward_dw()
        assert torch.equal(batch["x"].grad, ebatch["x"].grad)
        assert_same_as_eager(m, eager, f"step {step}")
    with pytest.raises(dwgraph.ArgumentError, match="structure and non-tensor values"):
        g({"x": torch.randn(B, H), "bias": torch.randn(H)}, scale=2.0)  # another baked value


def test_keywords_in_another_order_than_the_samples_are_the_same_call():
    m = _DictModule()
    eager = copy.deepcopy(m)
    sample = ({"x": torch.randn(B, H, requires_grad=True), "bias": torch.randn(H)},)
    g = dwgraph.make_graphed_callables(m, sample, sample_kwargs={"scale": 0.5, "mask": None})
    batch = {"x": torch.randn(B, H, requires_grad=True), "bias": torch.randn(H)}
    (out, _), (eout, _) = g(batch, mask=None, scale=0.5), eager(batch, mask=None, scale=0.5)
    assert torch.equal(out["y"], eout["y"])
    with pytest.raises(dwgraph.ArgumentError, match="structure and non-tensor values"):
        g(batch, mask=None, scale=2.0)  # another baked value, whatever the order


class _CatsKeywords(torch.nn.Module):
    def forward(self, x, **feats):
        return torch.cat([x, *feats.values()], dim=-1)


def test_keywords_a_var_keyword_forward_takes_keep_their_order():
    """**kwargs sees the call's order (a review found a reordered call replayed in the
    samples' order, 4.0 off eager): refused as before."""
    g = dwgraph.make_graphed_callables(_CatsKeywords(), (torch.randn(B, H),),
                                       sample_kwargs={"a": torch.randn(B, H), "b": torch.randn(B, H)})
    x, a, b = torch.randn(B, H), torch.randn(B, H), torch.randn(B, H)
    assert torch.equal(g(x, a=a, b=b), torch.cat([x, a, b], dim=-1))
    with pytest.raises(dwgraph.ArgumentError, match="structure and non-tensor values"):
        g(x, b=b, a=a)


class _ViewHeads(torch.nn.Module):
    """Returns views with gaps (a language model's shifted logits, a split, the last step)
    and views whose elements overlap (an expanded one, an unfolded one)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(H, 3 * H)

    def forward(self, x):
        h = self.lin(x)
        return h[:, :-1], h.split(H, dim=-1)[1], h[:, -1], h[:, :1].expand(-1, 3, -1), h[0].unfold(0, 2, 1)


def _reduce_views(outs):
    return sum(o.std() + o.sum() for o in outs)


@pytest.mark.parametrize("entry", ["make_graphed_callables", "make_graphed_callables_no_clone", "graphed_step"])
def test_outputs_with_gaps_keep_eagers_strides_so_reductions_over_them_are_bitwise(entry):
    """A review found them returned as dense copies: equal values, other strides, and a loss
    summed over them in another order (about 1e-2 apart after five SGD steps; an expanded
    output's sum 0.095 off)."""
    torch.manual_seed(0)
    m = _ViewHeads()
    eager = copy.deepcopy(m)

    def step_body(model, inp):  # the whole step, for graphed_step (its outputs need no grad)
        model.zero_grad(set_to_none=True)
        outs = model(inp)
        _reduce_views(outs).backward()
        return outs

    x = torch.randn(4, 6, H)
    if entry == "graphed_step":
        run = dwgraph.graphed_step(lambda inp: step_body(m, inp))
    else:
        g = dwgraph.make_graphed_callables(m, (x,), clone_outputs=entry == "make_graphed_callables")
    for step in range(5):
        x = torch.randn(4, 6, H)
        if entry == "graphed_step":
            outs, eouts = run(x), step_body(eager, x)
        else:
            outs, eouts = g(x), eager(x)
            loss, eloss = _reduce_views(outs), _reduce_views(eouts)
            assert torch.equal(loss, eloss), f"step {step}"
            m.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            loss.backward()
            eloss.backward()
        for o, e in zip(outs, eouts):
            assert o.stride() == e.stride() and torch.equal(o, e), f"step {step}"
        assert torch.equal(_reduce_views(outs), _reduce_views(eouts)), f"step {step}"
        for (n, p), pe in zip(m.named_parameters(), eager.parameters()):
            assert torch.equal(p.grad, pe.grad), f"step {step}: {n}.grad"


def test_te_spellings_and_buffer_reuse():
    torch.manual_seed(4)
    layers = (dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), dwgraph.nn.LayerNormMLP(H, 2 * H))
    m = 4
    # 1F1B-like for one chunk of two layers, backward-dw right after each backward
    order = [1, 1, -1, -1.5, 1, -1, -1.5, 1, -1, -1.5, -1, -1.5]
    samples = tuple((torch.randn(B, H, requires_grad=l > 0),) for _ in range(m) for l in range(2))
    stats = {}
    for reuse in (False, True):
        mods = copy.deepcopy(layers)
        eager = copy.deepcopy(layers)
        slots = dwgraph.make_graphed_callables(mods, samples, _order=order, _num_layers_per_chunk=[2],
                                               _reuse_graph_input_output_buffers=reuse)
        stats[reuse] = slots[0].stats()["pool_reserved_bytes"]
        xs = [torch.randn(B, H) for _ in range(m)]
        outs, eouts, f, b = {}, {}, 0, 0
        for o in order:
            if o == 1:
                outs[f] = slots[f * 2 + 1](slots[f * 2](xs[f]))
                eouts[f] = eager[1](eager[0](xs[f]))
                f += 1
            elif o == -1:
                outs.pop(b).square().sum().backward()
                eouts.pop(b).square().sum().backward()
                b += 1
            else:
                slots[(b - 1) * 2].backward_dw()
                eager[0].backward_dw()
        for pg, pe in zip([p for mod in mods for p in mod.parameters()],
                          [p for mod in eager for p in mod.parameters()]):
            assert torch.equal(pg.grad, pe.grad), f"reuse={reuse}: gradients differ from eager"
        # Out of the capture order, a call whose buffers another microbatch still needs is
        # refused, having run nothing: microbatch 2's static inputs share microbatch 0's
        # memory (its lifetime starts after 0's backward-dw). With the graphs' own pool,
        # reuse is subsumed by the pool's sharing by liveness, whose replay order refuses it.
        y0 = slots[1](slots[0](xs[0]))
        with pytest.raises(dwgraph.GraphStateError, match="static inputs of graphed callable 0 .*microbatch 2.*"
                           "Nothing was run"):
            slots[5](slots[4](xs[2]))
        y0.sum().backward()
        slots[0].backward_dw()
    # TE's explicit reuse never holds more than dwgraph's default sharing.
    assert stats[True] <= stats[False], f"reuse holds more pool memory than the default: {stats}"


def test_explicit_buffer_reuse_on_a_callers_pool_refuses_clobbering_calls():
    """On a caller's pool (no sharing by liveness) reuse_static_buffers shares one
    callable's static inputs across microbatches explicitly, and a call whose buffers
    another microbatch still needs is refused naming it."""
    torch.manual_seed(4)
    layers = (dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), dwgraph.nn.LayerNormMLP(H, 2 * H))
    order = [1, 1, -1, -1.5, 1, -1, -1.5, 1, -1, -1.5, -1, -1.5]
    samples = tuple((torch.randn(B, H, requires_grad=l > 0),) for _ in range(4) for l in range(2))
    sizes = {}
    for reuse in (False, True):
        slots = dwgraph.make_graphed_callables(copy.deepcopy(layers), samples, order=order, num_layers_per_chunk=[2],
                                               pool=dwgraph.graphs.graph_pool_handle(), reuse_static_buffers=reuse)
        sizes[reuse] = slots[0].stats()["static_bytes"]
    xs = [torch.randn(B, H) for _ in range(3)]
    y0 = slots[1](slots[0](xs[0]))
    with pytest.raises(dwgraph.GraphStateError, match="shared with"):
        slots[5](slots[4](xs[2]))
    y0.sum().backward()
    slots[0].backward_dw()
    assert sizes[True] < sizes[False], f"reuse did not save static bytes: {sizes}"


def test_num_layers_per_chunk_as_one_int():
    # TE's other form: one int, that many layers in every chunk.
    torch.manual_seed(6)
    layers = tuple(torch.nn.Linear(H, H) for _ in range(4))
    eager = copy.deepcopy(layers)
    order = [1, 2, -2, -1]
    samples = tuple((torch.randn(B, H, requires_grad=True),) for _ in range(4))
    as_int = dwgraph.make_graphed_callables(layers, samples, _order=order, _num_layers_per_chunk=2)
    as_list = dwgraph.make_graphed_callables(layers, samples, _order=order, _num_layers_per_chunk=[2, 2])
    assert [s.module for s in as_int] == [s.module for s in as_list] == list(layers)
    x = torch.randn(B, H, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    y, ye = x, xe
    for s, e in zip(as_int, eager):
        y, ye = s(y), e(ye)
    y.square().sum().backward(), ye.square().sum().backward()
    assert torch.equal(x.grad, xe.grad)
    for p, pe in zip([p for m in layers for p in m.parameters()], [p for m in eager for p in m.parameters()]):
        assert torch.equal(p.grad, pe.grad)
    with pytest.raises(dwgraph.ArgumentError, match="sums to 6 but 4 callables"):
        dwgraph.make_graphed_callables(layers, samples, _order=order, _num_layers_per_chunk=3)
    with pytest.raises(dwgraph.ArgumentError, match="needs 'order'"):
        dwgraph.make_graphed_callables(layers, samples, num_layers_per_chunk=2)


@pytest.mark.parametrize("value,message", [
    (True, r"must be a list of ints \(one per chunk\) or one int for every chunk, got bool"),
    (2.0, r"must be a list of ints \(one per chunk\) or one int for every chunk, got float"),
    ("22", r"must be a list of ints \(one per chunk\) or one int for every chunk, got str"),
    ([True, 1], r"entry 0 must be an int, got bool"),
    ([2, 2.0], r"entry 1 must be an int, got float"),
    ([2, "2"], r"entry 1 must be an int, got str"),
])
def test_num_layers_per_chunk_that_is_not_ints_is_refused(value, message):
    # The int form (issue 23) let a bool or a float through to a TypeError of Python's
    # ('bool' object is not iterable), and the list form converted entries with int(): a
    # string '22' or [True, 1] was accepted as layer counts. Checked before any conversion,
    # as the order entries are.
    layers = tuple(torch.nn.Linear(H, H) for _ in range(4))
    samples = tuple((torch.randn(B, H, requires_grad=True),) for _ in range(4))
    with pytest.raises(dwgraph.ArgumentError, match=message):
        dwgraph.make_graphed_callables(layers, samples, order=[1, 2, -2, -1], num_layers_per_chunk=value)


@pytest.mark.parametrize("spelling", ["clone_param_grads_on_return", "_clone_param_grads_on_return"])
@pytest.mark.parametrize("value", [True, False])
def test_clone_param_grads_on_return_is_accepted_and_grads_are_always_the_callers(spelling, value):
    # TransformerEngine's argument: False lets TE hand out its static gradient buffers.
    # dwgraph never does: a gradient kept from one step is not overwritten by the next
    # replay, whatever the value.
    model = torch.nn.Sequential(torch.nn.Linear(H, H), dwgraph.nn.Linear(H, H, delay_wgrad_compute=True))
    eager = copy.deepcopy(model)
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H, requires_grad=True),), **{spelling: value})
    kept, eager_kept = [], []
    for step in range(3):
        x = torch.randn(B, H, requires_grad=True)
        g(x).square().sum().backward()
        g.backward_dw()
        eager(x.detach().requires_grad_()).square().sum().backward()
        eager_backward_dw(eager)
        assert_same_as_eager(model, eager, f"step {step}")
        kept.append(model[0].weight.grad)  # held past the next replays, as a hook or a logger would
        eager_kept.append(eager[0].weight.grad)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert len(kept) == len(eager_kept) == 3
    for a, b in zip(kept, eager_kept):
        assert torch.equal(a, b), "a kept gradient was overwritten by a later replay"
    with pytest.raises(dwgraph.ArgumentError, match="clone_param_grads_on_return"):
        dwgraph.make_graphed_callables(copy.deepcopy(eager), (torch.randn(B, H),), clone_param_grads_on_return="no")


def test_transformer_engines_fp8_arguments_are_accepted_off_on_and_refused_where_unsupported():
    model = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True))
    sample = (torch.randn(B, H, requires_grad=True),)
    off = dict(enabled=False, calibrating=False, recipe=None, amax_reduction_group=None, cache_quantized_params=False)
    g = dwgraph.make_graphed_callables(copy.deepcopy(model), sample, **off)
    assert g(sample[0]).shape == (B, H)
    old_off = dict(fp8_enabled=False, fp8_calibrating=False, fp8_recipe=None, fp8_group=None, fp8_weight_caching=False)
    assert dwgraph.make_graphed_callables(copy.deepcopy(model), sample, **old_off)(sample[0]).shape == (B, H)
    # TE's `enabled` may be one bool per module.
    pair = dwgraph.make_graphed_callables((copy.deepcopy(model), copy.deepcopy(model)), (sample, sample),
                                          enabled=(False, False))
    assert pair[1](sample[0]).shape == (B, H)
    # Asking for FP8 is accepted (tests/python/test_fp8.py checks what it computes), in both spellings.
    recipe = dwgraph.fp8.DelayedScaling(amax_history_len=4)
    for on in (dict(enabled=True, recipe=recipe), dict(fp8_enabled=True, fp8_recipe=recipe),
               dict(enabled=(False, True), recipe=dwgraph.fp8.Float8CurrentScaling())):
        n = len(on["enabled"]) if isinstance(on.get("enabled"), tuple) else 1
        mods = tuple(copy.deepcopy(model) for _ in range(n))
        got = dwgraph.make_graphed_callables(mods if n > 1 else mods[0], (sample,) * n if n > 1 else sample, **on)
        out = (got[-1] if n > 1 else got)(sample[0])
        assert out.shape == (B, H)
    # What dwgraph has no counterpart for is refused, naming it.
    # Weight caching is accepted too; its calls then take is_first_microbatch (test_fp8.py).
    cached = dwgraph.make_graphed_callables(copy.deepcopy(model), sample, enabled=True, cache_quantized_params=True)
    assert cached(sample[0], is_first_microbatch=True).shape == (B, H)
    for bad, match in ((dict(enabled=True, cache_quantized_params="yes"), "'cache_quantized_params' must be a bool"),
                       (dict(enabled=True, calibrating=True), "calibrating"),
                       (dict(enabled=True, amax_reduction_group=object()), "amax_reduction_group needs torch.distributed initialised"),
                       (dict(enabled=True, recipe=object()), "recipe must be a dwgraph.fp8"),
                       (dict(enabled=(True,) * 2), "one bool per callable"),
                       (dict(enabled=True, fp8_enabled=True), "or its older spelling")):
        with pytest.raises(dwgraph.ArgumentError, match=match):
            dwgraph.make_graphed_callables(copy.deepcopy(model), sample, **bad)
    with pytest.raises(TypeError, match="unexpected keyword argument 'fp8_mode'"):
        dwgraph.make_graphed_callables(copy.deepcopy(model), sample, fp8_mode=True)


@pytest.mark.parametrize("bad", [dict(allow_unused_input=1), dict(retain_graph_in_backward="yes"),
                                 dict(reuse_static_buffers=None), dict(_reuse_graph_input_output_buffers="x"),
                                 dict(clone_outputs=0), dict(backward_under_autocast="x"),
                                 dict(clone_param_grads_on_return=1), dict(plan_placement="no"),
                                 dict(num_warmup_iters=2.5), dict(num_warmup_iters=True), dict(num_warmup_iters=-1)],
                         ids=lambda bad: f"{next(iter(bad))}={next(iter(bad.values()))!r}")
def test_a_flag_or_count_of_another_type_is_refused_naming_it(bad):
    # A review found strings and ints read for their truth (clone_outputs=0 meant False)
    # and pybind's TypeError for others: each is an ArgumentError naming the argument.
    name = next(iter(bad))
    with pytest.raises(dwgraph.ArgumentError, match=f"argument '{name}' must be"):
        dwgraph.make_graphed_callables(dwgraph.nn.Linear(H, H), (torch.randn(B, H),), **bad)


def test_numpy_bools_and_ints_are_flags_and_counts():
    np = pytest.importorskip("numpy")
    g = dwgraph.make_graphed_callables(dwgraph.nn.Linear(H, H), (torch.randn(B, H),), num_warmup_iters=np.int64(1),
                                       clone_outputs=np.bool_(True), enabled=np.bool_(False))
    assert g(torch.randn(B, H)).shape == (B, H)


def test_torch_pool_handles_are_accepted_or_refused_clearly():
    with pytest.raises(dwgraph.ArgumentError, match="torch CUDA pool handle"):
        dwgraph.make_graphed_callables(_mlp(), (torch.randn(B, H),), pool=(0, 1))
    with pytest.raises(dwgraph.ArgumentError, match="argument 'pool' must be"):
        dwgraph.make_graphed_callables(_mlp(), (torch.randn(B, H),), pool="mine")


@pytest.mark.cuda
@pytest.mark.skipif(not dwgraph.cuda_available(), reason="no CUDA device")
def test_torch_pool_handle_and_mempool_on_cuda():
    for pool in (torch.cuda.graph_pool_handle(), torch.cuda.MemPool()):
        m = _mlp().cuda()
        eager = copy.deepcopy(m)
        g = dwgraph.make_graphed_callables(m, (torch.randn(B, H, device="cuda"),), pool=pool)
        x = torch.randn(B, H, device="cuda")
        g(x).sum().backward(), g.backward_dw()
        eager(x).sum().backward(), eager_backward_dw(eager)
        assert_same_as_eager(m, eager, "torch pool")


# -- PyTorch's make_graphed_callables scenarios, in our own code --------------------------------
def test_parameterless_module_without_grad_and_shared_pool():
    pool = dwgraph.graphs.graph_pool_handle("cpu")
    relu = torch.nn.ReLU()
    g1 = dwgraph.make_graphed_callables(relu, (torch.randn(B, H),), pool=pool)
    m = _mlp()
    eager = copy.deepcopy(m)
    g2 = dwgraph.make_graphed_callables(m, (torch.randn(B, H),), pool=pool)  # a second call on the same pool
    for _ in range(3):
        x = torch.randn(B, H)
        y = g2(g1(x))
        assert not g1(x).requires_grad
        y.sum().backward()
        g2.backward_dw()
        eager(x.relu()).sum().backward()
        eager_backward_dw(eager)
        assert_same_as_eager(m, eager, "shared pool")


def test_autocast_with_the_cache_disabled():
    m = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.GELU(), torch.nn.Linear(H, H))
    eager = copy.deepcopy(m)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        g = dwgraph.make_graphed_callables(m, (torch.randn(B, H),))
    with pytest.raises(dwgraph.ArgumentError, match="cache_enabled=False"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dwgraph.make_graphed_callables(copy.deepcopy(m), (torch.randn(B, H),))
    with pytest.raises(dwgraph.ArgumentError, match=r"called with autocast off, captured with on \(cpu torch.bfloat16\)"):
        g(torch.randn(B, H))  # eager would run without autocast: a replay would not
    for _ in range(3):
        x = torch.randn(B, H)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            y = g(x)  # replays the autocast graph
            ye = eager(x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, ye)
        y.float().sum().backward()
        ye.float().sum().backward()
        assert_same_as_eager(m, eager, "autocast")


@pytest.mark.parametrize("allow", [False, True])
def test_allow_unused_input(allow):
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(H, H)

        def forward(self, x, unused):
            return self.lin(x)

    sample = (torch.randn(B, H, requires_grad=True), torch.randn(B, H, requires_grad=True))
    if not allow:
        with pytest.raises(dwgraph.ArgumentError, match="allow_unused_input"):
            dwgraph.make_graphed_callables(TwoInputs(), sample)
        return
    g = dwgraph.make_graphed_callables(TwoInputs(), sample, allow_unused_input=True)
    x, u = torch.randn(B, H, requires_grad=True), torch.randn(B, H, requires_grad=True)
    g(x, u).sum().backward()
    assert x.grad is not None and u.grad is None


# -- torch.compile ----------------------------------------------------------------------------------
def _compile_cases():
    return {
        "linear": (lambda: dwgraph.nn.Linear(H, 2 * H), False),
        "layernorm_mlp": (lambda: dwgraph.nn.LayerNormMLP(H, 2 * H, activation="gelu_tanh"), False),
        "layernorm_mlp_checkpoint": (lambda: dwgraph.nn.LayerNormMLP(H, 2 * H, activation="gelu_tanh",
                                                                     checkpoint=True), False),
        "layernorm_linear": (lambda: dwgraph.nn.LayerNormLinear(H, 2 * H), False),
        "layernorm_linear_rms": (lambda: dwgraph.nn.LayerNormLinear(H, 2 * H, normalization="RMSNorm"), False),
        "grouped": (lambda: dwgraph.nn.GroupedLinear(2, H, 2 * H), True),
        "grouped_packed": (lambda: dwgraph.nn.GroupedLinear(2, H, 2 * H, packed_weights=True), True),
    }


@pytest.mark.parametrize("case", list(_compile_cases()))
def test_undeferred_modules_compile_fullgraph(case):
    # delay_wgrad_compute=False: traced without a graph break (fullgraph=True), bitwise eager.
    make, grouped = _compile_cases()[case]
    torch.manual_seed(3)
    m = make()
    eager = copy.deepcopy(m)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        x = torch.randn(B, H, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        extra = ([1, 3],) if grouped else ()
        y, ye = compiled(x, *extra), eager(xe, *extra)
        assert torch.equal(y, ye)
        y.square().sum().backward()
        ye.square().sum().backward()
        assert torch.equal(x.grad, xe.grad)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), eager.parameters()))


def test_deferred_modules_run_eagerly_under_compile():
    # Their backward queues work for backward_dw(): one graph break per call, same results.
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), dwgraph.nn.Linear(H, H, delay_wgrad_compute=True))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(B, H)
    compiled(x).square().sum().backward()
    model[1].backward_dw()
    eager(x).square().sum().backward()
    eager[1].backward_dw()
    assert_same_as_eager(model, eager, "compiled with a deferred module")


def _within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int) -> bool:
    return bool((a - b).abs().max() <= ulps * torch.finfo(torch.float32).eps * b.abs().max())


@pytest.mark.parametrize("kind", ["torch", "dwgraph"])
def test_a_compiled_module_graphed_on_the_host_replays_its_kernels(kind):
    # Inductor's CPU kernels are C++ functions it calls directly, not ATen kernels: a host
    # capture of the compiled module recorded none of them and every replay returned the
    # capture's values (outputs off by 0.5, silently). The capture now runs the compiled
    # code's own Python (Note [A step around compiled code]): replays are bitwise the
    # uncompiled module, within inductor's FP32 rounding of the compiled one.
    torch._dynamo.reset()

    def mk():
        torch.manual_seed(0)
        last = dwgraph.nn.Linear(32, H, delay_wgrad_compute=True) if kind == "dwgraph" else torch.nn.Linear(32, H)
        return torch.nn.Sequential(torch.nn.Linear(H, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), last)

    model, twin, plain = mk(), mk(), mk()
    compiled, twin_compiled = torch.compile(model), torch.compile(twin)
    graphed = dwgraph.make_graphed_callables(compiled, (torch.randn(B, H, requires_grad=True),))
    for step in range(3):
        x = torch.randn(B, H, requires_grad=True)
        results = []
        for call, m in ((graphed, model), (twin_compiled, twin), (plain, plain)):
            xi = x.detach().clone().requires_grad_()
            y = call(xi)
            y.square().sum().backward()
            if kind == "dwgraph":
                (graphed.backward_dw() if call is graphed else m[3].backward_dw())
            results.append([y.detach(), xi.grad] + [p.grad for p in m.parameters()])
        got, near, exact = results
        for a, b, c in zip(got, near, exact):
            assert torch.equal(a, c), f"step {step}: differs from the uncompiled module"
            assert _within_ulps(a, b, 16), f"step {step}: beyond 16 ulps of the compiled module"
        for m in (model, twin, plain):
            m.zero_grad(set_to_none=True)


# -- TransformerEngine's make_graphed_callables, round 2 (issue 23) -----------------------------
_HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


def _recording_hooks(n, events):
    """capture_time_hooks for n callables that append (callable, kind) to `events`."""
    return [{kind: {0: (lambda m, i=i, kind=kind: events.append((i, kind)))} for kind in _HOOK_KINDS}
            for i in range(n)]


def _expected_capture_sequence(order, layers):
    """The (layer, hook kind) sequence of a capture in `order` (None: sequential) of one
    chunk of `layers` layers: forwards layer by layer, backwards in reverse, backward-dw
    steps run no hooks."""
    order = order if order is not None else [1, -1]
    seq = []
    for o in order:
        if o == 1:
            seq += [(l, k) for l in range(layers) for k in ("forward_pre_hooks", "forward_hooks")]
        elif o == -1:
            seq += [(l, k) for l in reversed(range(layers)) for k in ("backward_pre_hooks", "backward_hooks")]
    return seq


def _round2_layers():
    torch.manual_seed(11)
    return (dwgraph.nn.Linear(H, H, delay_wgrad_compute=True),
            dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=True), torch.nn.Linear(H, H))


@pytest.mark.parametrize("schedule", ["sequential", "1f1b"])
def test_warmup_runs_in_the_capture_order(schedule):
    # TransformerEngine warms up in the order it captures (all forwards, then the backwards in
    # reverse; or exactly _order), so capture_time_hooks see one sequence, warmup and capture
    # alike. Then the graphs train exactly as the same layers eagerly.
    layers = _round2_layers()
    eager = copy.deepcopy(layers)
    n, m, warmups = len(layers), 3, 2
    order = None if schedule == "sequential" else one_f_one_b(m)
    mbs = 1 if order is None else m
    samples = tuple((torch.randn(B, H, requires_grad=l > 0),) for _ in range(mbs) for l in range(n))
    events = []
    kwargs = {} if order is None else {"order": order, "num_layers_per_chunk": [n]}
    graphed = dwgraph.make_graphed_callables(layers, samples, num_warmup_iters=warmups,
                                             capture_time_hooks=_recording_hooks(n, events), **kwargs)
    assert events == _expected_capture_sequence(order, n) * (warmups + 1), \
        "warmup and capture saw different sequences"
    events.clear()
    # Microbatch mb's layers: its slots (pipeline) or the graphed modules (sequential).
    slots = [graphed[mb * n:(mb + 1) * n] if order else graphed for mb in range(mbs)]

    def chain(mods, x):
        for mod in mods:
            x = mod(x)
        return x

    for step in range(2):
        xs = [torch.randn(B, H) for _ in range(mbs)]
        run_order(order or [1, -1, -1.5], lambda mb, x: chain(slots[mb], x),
                  lambda mb: (slots[mb][0].backward_dw(), slots[mb][1].backward_dw()), xs)
        run_order(order or [1, -1, -1.5], lambda mb, x: chain(eager, x),
                  lambda mb: (eager[0].backward_dw(), eager[1].backward_dw()), xs)
        for pg, pe in zip([p for mod in layers for p in mod.parameters()],
                          [p for mod in eager for p in mod.parameters()]):
            assert torch.equal(pg.grad, pe.grad), f"step {step}: gradients differ from eager"
    assert events == [], "capture-time hooks ran at replay"


class _Gather(torch.nn.Module):
    """PyTorch's parameterless module: a dict in, a dict out; counts its eager forwards."""

    def __init__(self):
        super().__init__()
        self.eager_calls = 0

    def forward(self, inputs: dict):
        self.eager_calls += 1
        x = inputs["x"]
        idx = torch.arange(x.size(0)).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx.flip(0)), "argmax": x.argmax(1)}


def test_parameterless_module_captured_without_grad_called_with_grad():
    # PyTorch's test: captured with inputs that need no grad, called with ones that do. The
    # call succeeds and gives eager's outputs exactly, requires_grad included, and a backward
    # gives eager's input gradient (Note [Calls eager autograd would differentiate further]:
    # such calls run eagerly); calls like the sample still replay.
    mod = _Gather()
    g = dwgraph.make_graphed_callables(mod, ({"x": torch.randn(B, H), "unused": torch.randn(B, 2)},),
                                       allow_unused_input=True)
    captured = mod.eager_calls
    for needs in (True, False, True):
        x = torch.randn(B, H, requires_grad=needs)
        xe = x.detach().clone().requires_grad_(needs)
        out, ref = g({"x": x, "unused": torch.randn(B, 2)}), _Gather()({"x": xe, "unused": torch.randn(B, 2)})
        for k in ("output", "argmax"):
            assert torch.equal(out[k], ref[k]) and out[k].requires_grad == ref[k].requires_grad, k
        if needs:
            out["output"].square().sum().backward()
            ref["output"].square().sum().backward()
            assert torch.equal(x.grad, xe.grad)
    assert mod.eager_calls == captured + 2, "the calls with grad did not run eagerly, or the one without did not replay"


class _CountingMLP(torch.nn.Module):
    def __init__(self, deferred: bool = False):
        super().__init__()
        torch.manual_seed(3)
        first = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True) if deferred else torch.nn.Linear(H, H)
        self.net = torch.nn.Sequential(first, torch.nn.GELU(), torch.nn.Linear(H, H))
        self.eager_calls = 0

    def forward(self, x):
        self.eager_calls += 1
        return self.net(x)


@pytest.mark.parametrize("deferred", [False, True], ids=["torch_linear", "deferred_linear"])
def test_a_capture_under_no_grad_called_with_grad_runs_eagerly(deferred):
    # Captured under torch.no_grad(), the graphs hold no autograd graph: with grad enabled
    # eager's output would require grad (trainable weights), so such calls run eagerly and
    # train exactly as eager; under no_grad they replay. With a deferred module the capture
    # failed ('no wgrad unit queued after its backward capture'): it tried a backward-dw
    # graph for a backward that does not exist; backward_dw() now lands the eager units.
    model = _CountingMLP(deferred)
    eager = copy.deepcopy(model)
    with torch.no_grad():
        g = dwgraph.make_graphed_callables(model, (torch.randn(B, H),))
    captured = model.eager_calls
    for step in range(2):
        x = torch.randn(B, H)
        y, ye = g(x), eager(x)
        assert y.requires_grad and torch.equal(y, ye)
        y.square().sum().backward(), ye.square().sum().backward()
        if deferred:
            g.backward_dw(), eager_backward_dw(eager)
            assert model.net[0].num_pending_wgrad_units() == 0
        assert_same_as_eager(model, eager, f"step {step}")
    assert model.eager_calls == captured + 2
    with torch.no_grad():
        x = torch.randn(B, H)
        assert torch.equal(g(x), eager(x)) and model.eager_calls == captured + 2, "a call under no_grad did not replay"
    if deferred:
        with pytest.raises(dwgraph.GraphStateError, match="no backward is pending"):
            g.backward_dw()


@pytest.mark.parametrize("warmups", [0, 2])
def test_pre_and_post_warmup_hooks(warmups):
    # TransformerEngine's: once before all warmup iterations and once after them, before any
    # capture; what warmup restores is restored after them too (here a buffer they change).
    layers = _round2_layers()
    eager = copy.deepcopy(layers)
    events = []

    def pre():
        events.append("pre")
        with torch.no_grad():
            layers[2].weight.grad = torch.ones_like(layers[2].weight)  # .grad: restored after warmup

    samples = tuple((torch.randn(B, H, requires_grad=l > 0),) for l in range(3))
    graphed = dwgraph.make_graphed_callables(layers, samples, num_warmup_iters=warmups,
                                             capture_time_hooks=_recording_hooks(3, events),
                                             pre_warmup_hook=pre, post_warmup_hook=lambda: events.append("post"))
    capture = _expected_capture_sequence(None, 3)
    assert events == ["pre"] + capture * warmups + ["post"] + capture
    assert layers[2].weight.grad is None, "the hook's .grad outlived warmup"
    x = torch.randn(B, H)
    run_order([1, -1, -1.5], lambda mb, x: graphed[2](graphed[1](graphed[0](x))),
              lambda mb: (graphed[0].backward_dw(), graphed[1].backward_dw()), [x])
    run_order([1, -1, -1.5], lambda mb, x: eager[2](eager[1](eager[0](x))),
              lambda mb: (eager[0].backward_dw(), eager[1].backward_dw()), [x])
    for pg, pe in zip([p for m in layers for p in m.parameters()], [p for m in eager for p in m.parameters()]):
        assert torch.equal(pg.grad, pe.grad)
    with pytest.raises(dwgraph.ArgumentError, match="argument 'post_warmup_hook' must be a callable"):
        dwgraph.make_graphed_callables(_round2_layers()[0], (torch.randn(B, H),), post_warmup_hook=3)

    def failing():
        raise KeyError("from the hook")

    lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    with pytest.raises(KeyError, match="from the hook"):
        dwgraph.make_graphed_callables(lin, (torch.randn(B, H),), pre_warmup_hook=failing)
    assert lin.num_queued_wgrad_units() == 0
    g = dwgraph.make_graphed_callables(lin, (torch.randn(B, H),))  # a failed capture can be retried
    g(torch.randn(B, H)).sum().backward()
    g.backward_dw()


@pytest.mark.parametrize("registered_in", ["pre_warmup_hook", "post_warmup_hook"])
def test_module_hooks_a_warmup_hook_registers_are_refused_before_capture(registered_in):
    # The refusal of module hooks present at capture ran before the warmup hooks: a forward
    # hook one registered on a submodule was captured into the graphs, every call was refused
    # as 'registered after capture', and once the hook was removed the replays still applied
    # it (silently not eager's output). It is now refused before anything is captured, and a
    # hook the warmup hooks remove again is fine.
    model = _mlp()
    eager = copy.deepcopy(model)
    handles = []

    def register():
        handles.append(model[2].register_forward_hook(lambda mod, args, out: out * 2))

    with pytest.raises(dwgraph.ArgumentError, match=r"forward hooks registered on '2' \(by pre_warmup_hook or "
                                                    r"post_warmup_hook\); they would run during capture"):
        dwgraph.make_graphed_callables(model, (torch.randn(B, H),), **{registered_in: register})
    handles.pop().remove()
    assert "dwgraph_graphed" not in model.__dict__
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H),), pre_warmup_hook=register,
                                       post_warmup_hook=lambda: handles.pop().remove())
    for step in range(2):
        x = torch.randn(B, H)
        y, ye = g(x), eager(x)
        assert torch.equal(y, ye), "the replays differ from eager"
        y.square().sum().backward(), g.backward_dw()
        ye.square().sum().backward(), eager_backward_dw(eager)
        assert_same_as_eager(model, eager, f"step {step}")


_STATE_SWITCHES = {
    "grad_off": (lambda: torch.set_grad_enabled(False), lambda: torch.set_grad_enabled(True), "switched grad mode off"),
    "autocast_on": (lambda: torch.set_autocast_enabled("cpu", True), lambda: torch.set_autocast_enabled("cpu", False),
                    "changed the autocast state"),
}


@pytest.mark.parametrize("switch", list(_STATE_SWITCHES))
@pytest.mark.parametrize("hook", ["pre_warmup_hook", "post_warmup_hook"])
def test_a_warmup_hook_that_switches_grad_mode_or_autocast_is_refused(hook, switch):
    # The core reads the grad mode and autocast state of the capture before the warmup
    # hooks run: one that left grad off had the graphs captured without grad while the calls
    # were compared with grad on, so calls with grad replayed outputs that did not require
    # grad (silently no gradients). Refused before anything is captured; the retry captures.
    on, off, message = _STATE_SWITCHES[switch]
    model = _mlp()
    eager = copy.deepcopy(model)
    try:
        with pytest.raises(dwgraph.ArgumentError, match=f"argument '{hook}' {message}"):
            dwgraph.make_graphed_callables(model, (torch.randn(B, H),), **{hook: on})
    finally:
        off()
    assert model[0].num_queued_wgrad_units() == 0 and all(p.grad is None for p in model.parameters())
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H),), **{hook: lambda: (on(), off())})
    x = torch.randn(B, H)
    y, ye = g(x), eager(x)
    assert y.requires_grad and torch.equal(y, ye)
    y.square().sum().backward(), g.backward_dw()
    ye.square().sum().backward(), eager_backward_dw(eager)
    assert_same_as_eager(model, eager, "after the retry")
