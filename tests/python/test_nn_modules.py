"""dwgraph.nn modules:

  * fused main_grad and grad_dtype accumulation (SPEC C2); grad_dtype contributions
    accumulate across backwards bitwise as the graphs add them;
  * weights across saved-tensor hooks (C5);
  * hooks; errors (a packed grouped weight cannot be distributed, among others);
  * torch.nn.Module behaviour;
  * deferred work whose input, output gradient or main_grad changed between the backward
    and backward_dw() is refused before anything lands (a main_grad renewed over the same
    memory is accepted); a saved input changed in place is refused at the backward, as
    torch.nn's;
  * LayerNormMLP(checkpoint=True): saves only its input (counted through saved-tensor
    hooks), bitwise checkpoint=False (deferred, fused, grad_dtype, autocast, frozen
    LayerNorm), parameter hooks once; LayerNormLinear: TE's parameters and arguments, the
    LayerNorm output returned, refusals.

References are computed independently in float64 (or with plain torch.nn autograd) from
the same input values."""

import copy

import pytest
import torch

import dwgraph
from references import RefLNLinear, copy_into_reference
from safety_common import SMALL_B, SMALL_H


def _wgrad_ref(dys, xs):
    """Σ dyᵀ·x over microbatches in float64, from the tensors' exact values."""
    return sum(dy.double().reshape(-1, dy.shape[-1]).t() @ x.double().reshape(-1, x.shape[-1])
               for dy, x in zip(dys, xs))


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def _run_microbatches(module, xs, gs):
    for x, g in zip(xs, gs):
        module(x).backward(g)


# ---- fused accumulation into main_grad (C2) ------------------------------------------------

@pytest.mark.parametrize("delay", [False, True], ids=["eager-wgrad", "deferred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_fused_main_grad_accumulates_in_the_callers_buffer(delay, dtype, microbatches):
    torch.manual_seed(1)
    lin = dwgraph.nn.Linear(16, 8, bias=True, delay_wgrad_compute=delay,
                            fuse_wgrad_accumulation=True, dtype=dtype)
    # The caller replaces the module's buffer with its own (non-zero) one before use.
    start = torch.randn(8, 16)
    mine = start.clone()
    lin.weight.main_grad = mine
    ptr = mine.data_ptr()
    xs = [torch.randn(5, 16, dtype=dtype) for _ in range(microbatches)]
    gs = [torch.randn(5, 8, dtype=dtype) for _ in range(microbatches)]
    flags = []
    for x, g in zip(xs, gs):
        lin.weight.grad_added_to_main_grad = False
        lin(x).backward(g)
        if delay:
            assert lin.weight.grad_added_to_main_grad is False  # nothing landed yet
            lin.backward_dw()
        flags.append(lin.weight.grad_added_to_main_grad)
    assert flags == [True] * microbatches  # set after every accumulation
    assert lin.weight.main_grad is mine and mine.data_ptr() == ptr
    assert lin.weight.grad is None
    ref = start.double() + _wgrad_ref(gs, xs)
    # FP32 accumulation of exactly representable products: FP32 rounding only.
    assert _rel(mine, ref) < 2e-6
    # The bias is not fused: its gradient lands in .grad (init, then add).
    bias_ref = sum(g.double().sum(0) for g in gs)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert _rel(lin.bias.grad, bias_ref) < tol


def test_fused_main_grad_grouped():
    torch.manual_seed(2)
    grp = dwgraph.nn.GroupedLinear(3, 8, 4, packed_weights=True, delay_wgrad_compute=True,
                                   fuse_wgrad_accumulation=True)
    x = torch.randn(9, 8)
    g = torch.randn(9, 4)
    splits = [4, 0, 5]
    grp(x, splits).backward(g)
    grp.backward_dw()
    for k, (lo, hi) in enumerate([(0, 4), (4, 4), (4, 9)]):
        ref = g[lo:hi].double().t() @ x[lo:hi].double()
        got = grp.weight.main_grad[k].double()
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert grp.weight.grad is None and grp.weight.grad_added_to_main_grad


_LAYERNORM_KINDS = {
    "mlp": lambda **kw: dwgraph.nn.LayerNormMLP(8, 12, **kw),
    "mlp_checkpoint": lambda **kw: dwgraph.nn.LayerNormMLP(8, 12, checkpoint=True, **kw),
    "layernorm_linear": lambda **kw: dwgraph.nn.LayerNormLinear(8, 6, **kw),
}


@pytest.mark.parametrize("kind", list(_LAYERNORM_KINDS))
def test_fused_main_grad_of_the_layernorm_modules(kind):
    torch.manual_seed(2)
    x = torch.randn(9, 8)
    mod = _LAYERNORM_KINDS[kind](delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    ref = copy.deepcopy(mod)
    y = mod(x)
    y.backward(torch.ones_like(y))
    mod.backward_dw()
    # The same module without fusion, its wgrads landing in .grad, is the reference.
    ref.fuse_wgrad_accumulation = False
    fused = [n for n, _ in mod._fused_parameters()]
    assert fused == [n for n, _ in mod.named_parameters() if n.endswith("weight") and "layer_norm" not in n]
    for name in fused:
        del getattr(ref, name).main_grad
    yr = ref(x)
    yr.backward(torch.ones_like(yr))
    ref.backward_dw()
    for name in fused:
        assert getattr(mod, name).grad is None and getattr(mod, name).grad_added_to_main_grad
        assert torch.allclose(getattr(mod, name).main_grad, getattr(ref, name).grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(mod.layer_norm_weight.grad, ref.layer_norm_weight.grad)


# ---- grad_dtype: BF16 parameters with FP32 .grad (C2) ---------------------------------------

@pytest.mark.parametrize("delay", [False, True], ids=["eager-wgrad", "deferred"])
def test_grad_dtype_gives_fp32_grad_equal_to_fp32_accumulation(delay):
    torch.manual_seed(3)
    lin = dwgraph.nn.Linear(16, 8, bias=False, delay_wgrad_compute=delay, dtype=torch.bfloat16)
    lin.weight.grad_dtype = torch.float32
    xs = [torch.randn(6, 16, dtype=torch.bfloat16) for _ in range(3)]
    gs = [torch.randn(6, 8, dtype=torch.bfloat16) for _ in range(3)]
    for x, g in zip(xs, gs):
        lin(x).backward(g)
        if delay:
            lin.backward_dw()
    assert lin.weight.dtype == torch.bfloat16
    assert lin.weight.grad.dtype == torch.float32
    assert _rel(lin.weight.grad, _wgrad_ref(gs, xs)) < 2e-6


@pytest.mark.parametrize("delay", [False, True], ids=["eager-wgrad", "deferred"])
def test_grad_dtype_never_adds_the_buffer_to_itself(delay):
    """After two microbatches .grad is c1 + c2; a self-add would give 2·c1 + c2 or 2·(c1 + c2)."""
    torch.manual_seed(4)
    lin = dwgraph.nn.Linear(8, 4, bias=False, delay_wgrad_compute=delay, dtype=torch.bfloat16)
    lin.weight.grad_dtype = torch.float32
    x1, x2 = (torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(2))
    g1, g2 = (torch.randn(3, 4, dtype=torch.bfloat16) for _ in range(2))
    c1 = _wgrad_ref([g1], [x1])
    c2 = _wgrad_ref([g2], [x2])
    lin(x1).backward(g1)
    if delay:
        lin.backward_dw()
    first = lin.weight.grad
    assert _rel(first, c1) < 2e-6
    lin(x2).backward(g2)
    if delay:
        lin.backward_dw()
    assert _rel(lin.weight.grad, c1 + c2) < 2e-6
    assert _rel(lin.weight.grad, 2 * c1 + c2) > 1e-2
    if delay:
        # The second contribution was folded into the same buffer by the GEMM (beta = 1).
        # (Without deferral the buffer is returned to AccumulateGrad, which may copy it.)
        assert lin.weight.grad.data_ptr() == first.data_ptr()


@pytest.mark.parametrize("module", ["linear", "grouped", "mlp", "mlp_checkpoint", "mlp_checkpoint_rms",
                                    "layernorm_linear", "layernorm_linear_rms"])
@pytest.mark.parametrize("delay", [False, True])
def test_grad_dtype_accumulation_across_backwards_is_bitwise(module, delay):
    # Large enough that the CPU GEMM rounds a beta = 1 accumulation differently from a
    # fresh product added afterwards (what a graph does): eager now does the latter too.
    def mk():
        torch.manual_seed(0)
        m = {"linear": lambda: dwgraph.nn.Linear(64, 64, delay_wgrad_compute=delay),
             "grouped": lambda: dwgraph.nn.GroupedLinear(2, 64, 64, delay_wgrad_compute=delay),
             "mlp": lambda: dwgraph.nn.LayerNormMLP(64, 96, delay_wgrad_compute=delay),
             "mlp_checkpoint": lambda: dwgraph.nn.LayerNormMLP(64, 96, checkpoint=True, delay_wgrad_compute=delay),
             "mlp_checkpoint_rms": lambda: dwgraph.nn.LayerNormMLP(64, 96, checkpoint=True, normalization="RMSNorm",
                                                                   delay_wgrad_compute=delay),
             "layernorm_linear": lambda: dwgraph.nn.LayerNormLinear(64, 64, delay_wgrad_compute=delay),
             "layernorm_linear_rms": lambda: dwgraph.nn.LayerNormLinear(64, 64, normalization="RMSNorm",
                                                                         delay_wgrad_compute=delay),
             }[module]().bfloat16()
        for q in m.parameters():
            q.grad_dtype = torch.float32
        return m

    args = (lambda x: (x, [256, 256])) if module == "grouped" else (lambda x: (x,))
    e, g = mk(), mk()
    dwgraph.make_graphed_callables(g, args(torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)),
                                   num_warmup_iters=1)
    for _ in range(3):  # no zero_grad: the gradients accumulate
        x = torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)
        for m in (e, g):
            m(*args(x)).float().square().mean().backward()
            if delay:
                m.backward_dw()
        for (n, pe), pg in zip(e.named_parameters(), g.parameters()):
            assert torch.equal(pe.grad, pg.grad), n


# ---- weights across saved-tensor hooks (C5) --------------------------------------------------

class CountingWeight(dwgraph.nn.DistributedWeight):
    """A fake distributed weight: forward and backward see differently scaled copies."""

    def setup(self):
        self.calls = {"forward": 0, "backward": 0, "finalize": 0}
        self.wgrads = []
        return self

    def materialize_forward(self):
        self.calls["forward"] += 1
        return self.detach() * 2.0

    def materialize_backward(self):
        self.calls["backward"] += 1
        return self.detach() * 3.0

    def finalize_wgrad(self, wgrad):
        self.calls["finalize"] += 1
        self.wgrads.append(wgrad.clone())


def _distributed_run(kind, delay, hooked, seed=5):
    torch.manual_seed(seed)
    if kind == "linear":
        mod = dwgraph.nn.Linear(8, 6, delay_wgrad_compute=delay)
        mod.weight = CountingWeight(mod.weight.detach().clone()).setup()
        weights = [mod.weight]
        call = lambda x: mod(x)  # noqa: E731
    else:
        mod = dwgraph.nn.GroupedLinear(2, 8, 6, delay_wgrad_compute=delay)
        for g in range(2):
            setattr(mod, f"weight{g}", CountingWeight(getattr(mod, f"weight{g}").detach().clone()).setup())
        weights = [mod.weight0, mod.weight1]
        call = lambda x: mod(x, [3, 4])  # noqa: E731
    x = torch.randn(7, 8, requires_grad=True)
    g = torch.randn(7, 6)
    packs = []

    def pack(t):
        packs.append(1)
        return t

    if hooked:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = call(x)
    else:
        y = call(x)
    y.backward(g, retain_graph=True)
    if delay:
        mod.backward_dw()
    dx1 = x.grad.clone()
    # A second backward through the retained graph still reaches the wrapper.
    y.backward(g)
    if delay:
        mod.backward_dw()
    return y.detach(), dx1, weights, len(packs)


@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("delay", [False, True], ids=["eager-wgrad", "deferred"])
def test_distributed_weights_survive_saved_tensor_hooks(kind, delay):
    y0, dx0, w0, packs0 = _distributed_run(kind, delay, hooked=False)
    y1, dx1, w1, packs1 = _distributed_run(kind, delay, hooked=True)
    assert packs0 == 0 and packs1 >= 1  # the hooks did see the saved activation
    assert torch.equal(y0, y1)
    assert torch.equal(dx0, dx1)
    for a, b in zip(w0, w1):
        assert a.calls == b.calls == {"forward": 1, "backward": 2, "finalize": 2}
        assert len(a.wgrads) == len(b.wgrads) == 2
        for ga, gb in zip(a.wgrads, b.wgrads):
            assert torch.equal(ga, gb)
        assert a.grad is None and b.grad is None  # the wrapper received it, not .grad
    # The GEMMs used the materialised weights: forward 2·w, backward 3·w.
    torch.manual_seed(5)
    if kind == "linear":
        ref = torch.nn.Linear(8, 6)
        x = torch.randn(7, 8)
        g = torch.randn(7, 6)
        assert torch.allclose(y0, torch.nn.functional.linear(x, 2 * ref.weight.detach(), ref.bias.detach()),
                              rtol=1e-6, atol=1e-6)
        assert torch.allclose(dx0, g @ (3 * ref.weight.detach()), rtol=1e-6, atol=1e-6)
        assert torch.allclose(w0[0].wgrads[0], g.t() @ x, rtol=1e-6, atol=1e-6)


# ---- hooks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("delay", [False, True], ids=["eager-wgrad", "deferred"])
def test_wgrad_hook_runs_once_after_the_gradients_landed(delay):
    torch.manual_seed(6)
    lin = dwgraph.nn.Linear(8, 4, delay_wgrad_compute=delay)
    seen = []
    handle = lin.register_wgrad_hook(lambda m: seen.append((m.weight.grad.clone(), m.bias.grad.clone())))
    x, g = torch.randn(3, 8), torch.randn(3, 4)
    lin(x).backward(g)
    if delay:
        assert seen == []
        lin.backward_dw()
    assert len(seen) == 1
    assert torch.equal(seen[0][0], g.t() @ x) and torch.equal(seen[0][1], g.sum(0))
    handle.remove()
    lin(x).backward(g)
    if delay:
        lin.backward_dw()
    assert len(seen) == 1


# ---- errors ---------------------------------------------------------------------------------

def test_backward_dw_with_nothing_queued_names_the_module():
    lin = dwgraph.nn.Linear(8, 4, delay_wgrad_compute=True)
    with pytest.raises(dwgraph.GraphStateError, match=r"Linear\(in_features=8, out_features=4.*backward_dw\(\): no deferred"):
        lin.backward_dw()
    plain = dwgraph.nn.Linear(8, 4)
    with pytest.raises(dwgraph.GraphStateError, match="delay_wgrad_compute is False"):
        plain.backward_dw()


@pytest.mark.parametrize("problem", ["missing", "wrong-shape", "none"])
def test_fused_mode_rejects_a_bad_main_grad_by_parameter(problem):
    mlp = dwgraph.nn.LayerNormMLP(8, 12, fuse_wgrad_accumulation=True)
    if problem == "missing":
        del mlp.fc2_weight.main_grad
        expected = r"LayerNormMLP.*parameter 'fc2_weight'.*no main_grad"
    elif problem == "none":
        mlp.fc2_weight.main_grad = None
        expected = r"LayerNormMLP.*parameter 'fc2_weight'.*no main_grad"
    else:
        mlp.fc2_weight.main_grad = torch.zeros(12, 8)
        expected = r"LayerNormMLP.*main_grad of parameter 'fc2_weight'.*\[8, 12\], got \[12, 8\]"
    with pytest.raises(dwgraph.ArgumentError, match=expected):
        mlp(torch.randn(3, 8))


def test_m_splits_not_summing_to_the_batch():
    grp = dwgraph.nn.GroupedLinear(3, 8, 4)
    with pytest.raises(dwgraph.ArgumentError, match=r"GroupedLinear.*m_splits.*10 rows.*\[3, 3, 3\].*summing to 9"):
        grp(torch.randn(10, 8), [3, 3, 3])
    assert grp.num_queued_wgrad_units() == 0


def test_input_of_the_wrong_width():
    lin = dwgraph.nn.Linear(8, 4)
    with pytest.raises(dwgraph.ArgumentError, match=r"in_features = 8.*got shape \[3, 7\]"):
        lin(torch.randn(3, 7))


def test_a_packed_grouped_weight_cannot_be_distributed():
    # Its group count is its first dimension, which a shard does not hold whole (a sharded
    # packed weight failed with "m_splits must have num_gemms = 1 entries" on 2 groups).
    m = dwgraph.nn.GroupedLinear(2, 4, 6, packed_weights=True)
    m.weight = dwgraph.nn.DistributedWeight(m.weight.detach().clone())
    with pytest.raises(dwgraph.ArgumentError, match="packed weights cannot be distributed"):
        m(torch.randn(6, 4), [3, 3])


# ---- torch.nn.Module behaviour ------------------------------------------------------------

def test_state_dict_round_trips_with_torch_nn_linear_keys():
    torch.manual_seed(7)
    ref = torch.nn.Linear(8, 4)
    lin = dwgraph.nn.Linear(8, 4, delay_wgrad_compute=True)
    assert set(lin.state_dict()) == {"weight", "bias"}
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 8)
    assert torch.equal(lin(x), ref(x))
    ref2 = torch.nn.Linear(8, 4)
    ref2.load_state_dict(lin.state_dict())
    assert torch.equal(ref2.weight, ref.weight)


def test_seeded_initialisation_matches_torch_nn_linear():
    torch.manual_seed(8)
    a = torch.nn.Linear(8, 4)
    torch.manual_seed(8)
    b = dwgraph.nn.Linear(8, 4)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


def test_deepcopy_to_and_repr():
    mlp = dwgraph.nn.LayerNormMLP(8, 12, activation="relu", delay_wgrad_compute=True,
                                  fuse_wgrad_accumulation=True)
    mlp(torch.randn(2, 8)).sum().backward()  # one unit queued in the original
    twin = copy.deepcopy(mlp)
    assert twin.num_queued_wgrad_units() == 0 and mlp.num_queued_wgrad_units() == 1
    assert twin.fc1_weight.main_grad is not mlp.fc1_weight.main_grad
    assert torch.equal(twin.fc1_weight, mlp.fc1_weight)
    twin = twin.to(dtype=torch.bfloat16)
    assert twin.fc1_weight.dtype == torch.bfloat16
    assert twin.fc1_weight.main_grad.dtype == torch.float32  # the accumulator stays FP32
    text = repr(twin)
    for part in ("LayerNormMLP", "hidden_size=8", "ffn_hidden_size=12", "activation='relu'",
                 "delay_wgrad_compute=True", "fuse_wgrad_accumulation=True"):
        assert part in text
    mlp.backward_dw()
    assert mlp.num_queued_wgrad_units() == 0


def test_modules_need_backward_dw_reports_the_setting():
    assert dwgraph.nn.Linear(4, 4, delay_wgrad_compute=True).need_backward_dw()
    assert not dwgraph.nn.GroupedLinear(2, 4, 4).need_backward_dw()


@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp", "layernorm_mlp_checkpoint", "layernorm_linear"])
def test_each_backward_of_a_retained_graph_queues_its_own_unit(kind):
    """Two backwards through one forward (retain_graph=True) are two units: each
    backward_dw() lands one backward's worth (a checkpointed module recomputes its nodes in
    each backward: still one unit per backward)."""
    torch.manual_seed(9)
    mod = {"linear": lambda: dwgraph.nn.Linear(4, 4, delay_wgrad_compute=True),
           "layernorm_mlp": lambda: dwgraph.nn.LayerNormMLP(4, 8, delay_wgrad_compute=True),
           "layernorm_mlp_checkpoint": lambda: dwgraph.nn.LayerNormMLP(4, 8, checkpoint=True,
                                                                       delay_wgrad_compute=True),
           "layernorm_linear": lambda: dwgraph.nn.LayerNormLinear(4, 4, delay_wgrad_compute=True)}[kind]()
    weight = mod.fc1_weight if kind.startswith("layernorm_mlp") else mod.weight
    y = mod(torch.randn(3, 4))
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert mod.num_queued_wgrad_units() == 2
    mod.backward_dw()
    once = weight.grad.clone()
    mod.backward_dw()
    assert torch.equal(weight.grad, 2 * once)
    with pytest.raises(dwgraph.GraphStateError):
        mod.backward_dw()


# ---- a backward queues work only for the gradients it asks for ------------------------------

def _deferred_module(kind):
    if kind == "linear":
        return dwgraph.nn.Linear(6, 5, delay_wgrad_compute=True), lambda m, x: m(x)
    if kind == "grouped":
        return dwgraph.nn.GroupedLinear(2, 6, 5, delay_wgrad_compute=True), lambda m, x: m(x, [3, 4])
    if kind == "layernorm_linear":
        return dwgraph.nn.LayerNormLinear(6, 5, delay_wgrad_compute=True), lambda m, x: m(x)
    return (dwgraph.nn.LayerNormMLP(6, 10, checkpoint=kind == "layernorm_mlp_checkpoint", delay_wgrad_compute=True),
            lambda m, x: m(x))


@pytest.mark.parametrize("kind", ["linear", "grouped", "layernorm_mlp", "layernorm_mlp_checkpoint",
                                  "layernorm_linear"])
def test_backward_for_the_inputs_only_queues_no_unit(kind):
    """torch.autograd.grad w.r.t. the input (pipelining's shape inference and its dI step)
    asks for no weight gradient: nothing is queued, and the input gradient is the one plain
    autograd gives. A later full backward queues exactly one unit."""
    torch.manual_seed(10)
    mod, call = _deferred_module(kind)
    ref = copy.deepcopy(mod)
    ref.delay_wgrad_compute = False
    x = torch.randn(7, 6, requires_grad=True)
    g = torch.randn(7, 6 if kind.startswith("layernorm_mlp") else 5)
    y = call(mod, x)
    (dx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    assert mod.num_queued_wgrad_units() == 0
    (dx_ref,) = torch.autograd.grad(call(ref, x), x, g)
    assert torch.equal(dx, dx_ref)
    assert all(p.grad is None for p in mod.parameters())
    y.backward(g)
    assert mod.num_queued_wgrad_units() == 1
    mod.backward_dw()
    assert mod.num_queued_wgrad_units() == 0


@pytest.mark.parametrize("frozen", ["weight", "weight-and-bias"])
def test_frozen_parameters_queue_only_the_remaining_work(frozen):
    torch.manual_seed(11)
    lin = dwgraph.nn.Linear(6, 5, delay_wgrad_compute=True)
    lin.weight.requires_grad_(False)
    if frozen == "weight-and-bias":
        lin.bias.requires_grad_(False)
    x = torch.randn(4, 6, requires_grad=True)
    g = torch.randn(4, 5)
    lin(x).backward(g)
    if frozen == "weight-and-bias":
        assert lin.num_queued_wgrad_units() == 0
        with pytest.raises(dwgraph.GraphStateError, match="no deferred"):
            lin.backward_dw()
    else:
        assert lin.num_queued_wgrad_units() == 1
        lin.backward_dw()
        assert torch.allclose(lin.bias.grad, g.sum(0)) and lin.weight.grad is None
    assert torch.equal(x.grad, g @ lin.weight)


_H = 8


class _Scaled(torch.nn.Module):
    def forward(self, w):
        return 2.0 * w


@pytest.mark.parametrize("flags", [dict(delay_wgrad_compute=True), dict(fuse_wgrad_accumulation=True)],
                         ids=["deferred", "fused"])
def test_a_parametrized_weight_cannot_be_deferred(flags):
    # torch.nn.utils.parametrize (weight_norm too) makes the weight a non-leaf computed from
    # `original`: its gradient must flow back through that computation in the main
    # backward, so a deferred or fused weight gradient (which lands on a leaf) is refused,
    # in eager code and at capture; without deferral it trains as torch.nn.Linear does.
    lin = dwgraph.nn.Linear(_H, 4, **flags)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", _Scaled())
    with pytest.raises(dwgraph.ArgumentError, match=r"parameter 'weight' is computed by autograd"):
        lin(torch.randn(3, _H))
    with pytest.raises(dwgraph.ArgumentError, match=r"parameter 'weight' is computed by autograd"):
        dwgraph.make_graphed_callables(lin, (torch.randn(3, _H),))
    assert lin.parametrizations.weight.original.grad is None
    if not flags.get("fuse_wgrad_accumulation"):  # (a fused module wants its main_grad even then)
        with torch.no_grad():
            assert lin(torch.randn(3, _H)).shape == (3, 4)  # inference needs no gradient


def test_a_parametrized_weight_trains_without_deferral():
    torch.manual_seed(3)
    lin = dwgraph.nn.Linear(_H, 4)
    ref = torch.nn.Linear(_H, 4)
    ref.load_state_dict(lin.state_dict())
    for m in (lin, ref):
        torch.nn.utils.parametrize.register_parametrization(m, "weight", _Scaled())
    x = torch.randn(3, _H)
    lin(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert torch.equal(lin.parametrizations.weight.original.grad, ref.parametrizations.weight.original.grad)


# ---- deferred work: what changed between the backward and backward_dw() ----------------------

@pytest.mark.parametrize("what", ["x", "dy", "main_grad"])
def test_backward_dw_refuses_inputs_changed_since_the_backward_and_loses_nothing(what):
    # Eager autograd computes the weight gradient in the backward; deferred work that would
    # read changed values (the next microbatch copied into the input buffer, a reused
    # gradient buffer, a replaced main_grad) is refused before anything lands.
    torch.manual_seed(0)
    lin = dwgraph.nn.Linear(SMALL_H, 4, delay_wgrad_compute=True, fuse_wgrad_accumulation=what == "main_grad")
    ref = torch.nn.Linear(SMALL_H, 4)
    ref.load_state_dict(lin.state_dict())
    x, dy = torch.randn(SMALL_B, SMALL_H), torch.randn(SMALL_B, 4)
    ref(x.clone()).backward(dy.clone())
    lin(x).backward(dy)
    old_main_grad = getattr(lin.weight, "main_grad", None)
    if what == "x":
        x.add_(100.0)
    elif what == "dy":
        dy.mul_(0.0)
    else:
        lin.weight.main_grad = torch.zeros(4, SMALL_H)
    with pytest.raises(dwgraph.GraphStateError, match="modified in place|was replaced after the forward"):
        lin.backward_dw()
    assert lin.weight.grad is None and lin.bias.grad is None, "a refused unit wrote a gradient"
    if what != "main_grad":
        # The values the unit needs are gone: it is dropped, and the module goes on.
        assert lin.num_queued_wgrad_units() == 0
        lin(x).backward(dy)
        lin.backward_dw()
        assert lin.weight.grad is not None
        return
    # A replaced main_grad can be put back: the unit stayed queued and lands eager's result.
    assert lin.num_queued_wgrad_units() == 1
    lin.weight.main_grad = old_main_grad
    lin.backward_dw()
    assert torch.allclose(lin.weight.main_grad, ref.weight.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-6)


def test_eager_dwgraph_linear_checks_its_saved_input():
    lin = dwgraph.nn.Linear(SMALL_H, SMALL_H, delay_wgrad_compute=True)
    x = torch.randn(SMALL_B, SMALL_H)
    y = lin(x.requires_grad_() * 1)  # a non-leaf input, changed in place after the forward
    xx = torch.randn(SMALL_B, SMALL_H)
    y = lin(xx)
    xx.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_eager_backward_dw_accepts_main_grad_reviewed_over_the_same_memory():
    lin = dwgraph.nn.Linear(SMALL_H, SMALL_H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    buf = torch.zeros(SMALL_H * SMALL_H)
    lin.weight.main_grad = buf.view(SMALL_H, SMALL_H)
    lin(torch.randn(SMALL_B, SMALL_H)).sum().backward()
    lin.weight.main_grad = buf.view(SMALL_H, SMALL_H)  # the same buffer, another tensor object
    lin.backward_dw()
    assert buf.abs().sum() > 0


# ---- LayerNormMLP(checkpoint=True): recompute in the backward --------------------------------

def _saved(fn):
    """Runs fn() and returns (its result, the tensors autograd saved for the backward):
    torch's saved-tensor hooks see every tensor an autograd node saves (C5)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def _nbytes(tensors):
    # Each piece of memory once (LayerNorm and fc1 may save the same tensor twice).
    return sum({(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)): t.numel() * t.element_size()
                for t in tensors}.values())


@pytest.mark.parametrize("delay", [False, True], ids=["eager-wgrad", "deferred"])
def test_checkpoint_saves_only_the_input(delay):
    rows, hidden, ffn = 32, 16, 64
    torch.manual_seed(12)
    plain = dwgraph.nn.LayerNormMLP(hidden, ffn, delay_wgrad_compute=delay)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpoint = True
    x = torch.randn(rows, hidden, requires_grad=True)
    y, kept = _saved(lambda: ckpt(x))
    yp, kept_plain = _saved(lambda: plain(x))
    assert len(kept) == 1 and kept[0] is x, "checkpoint=True keeps the input and nothing else"
    # Without it: LayerNorm's input and statistics, fc1's input [rows, hidden], the
    # activation's input and fc2's input [rows, ffn] each.
    assert _nbytes(kept_plain) >= (2 * rows * hidden + 2 * rows * ffn) * 4
    assert _nbytes(kept) == rows * hidden * 4
    assert torch.equal(y, yp)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    (dxp,) = torch.autograd.grad(yp, x, g, retain_graph=True)
    assert torch.equal(dx, dxp)
    y.backward(g)
    yp.backward(g)
    if delay:
        ckpt.backward_dw()
        plain.backward_dw()
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), n


_CKPT_MODES = ["fp32", "bf16-grad_dtype", "autocast", "frozen-layernorm"]


@pytest.mark.parametrize("mode", _CKPT_MODES)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("flags", [dict(), dict(delay_wgrad_compute=True), dict(fuse_wgrad_accumulation=True),
                                   dict(delay_wgrad_compute=True, fuse_wgrad_accumulation=True)],
                         ids=["plain", "deferred", "fused", "deferred-fused"])
def test_checkpoint_is_bitwise_the_stored_forward(flags, activation, mode):
    """Two microbatches, both forwards first (a pipeline's order), then both backwards and
    backward_dw()s: every output, input gradient, .grad and main_grad of checkpoint=True
    equals checkpoint=False bit for bit, and the same units are queued."""
    torch.manual_seed(13)
    dtype = torch.bfloat16 if mode == "bf16-grad_dtype" else torch.float32
    plain = dwgraph.nn.LayerNormMLP(8, 24, activation=activation, dtype=dtype, **flags)
    if mode == "bf16-grad_dtype":
        for p in plain.parameters():
            p.grad_dtype = torch.float32
    if mode == "frozen-layernorm":
        plain.layer_norm_weight.requires_grad_(False)
        plain.layer_norm_bias.requires_grad_(False)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpoint = True
    if mode == "bf16-grad_dtype":  # (deepcopy does not copy a Parameter's grad_dtype)
        for p in ckpt.parameters():
            p.grad_dtype = torch.float32
    xs = [torch.randn(6, 8, dtype=dtype, requires_grad=mode != "frozen-layernorm") for _ in range(2)]
    results = []
    for m in (plain, ckpt):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            ys = [m(x.detach().clone().requires_grad_(x.requires_grad)) for x in xs]
        grads = []
        for y in ys:
            y.float().square().sum().backward()
        if m.delay_wgrad_compute:
            assert m.num_queued_wgrad_units() == 2
            m.backward_dw()
            m.backward_dw()
        for n, p in m.named_parameters():
            grads.append(p.grad)
            if hasattr(p, "main_grad"):
                grads.append(p.main_grad)
        results.append(([y.detach() for y in ys], grads))
    (ys_p, g_p), (ys_c, g_c) = results
    for a, b in zip(ys_p, ys_c):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert len(g_p) == len(g_c)
    for i, (a, b) in enumerate(zip(g_p, g_c)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), i
    if mode == "bf16-grad_dtype":
        assert all(p.grad.dtype == torch.float32 for p in ckpt.parameters() if p.grad is not None)


def test_checkpoint_runs_parameter_hooks_once_with_eagers_gradient():
    # The recomputation runs on detached aliases: a tensor hook of a parameter (or the
    # input) sees each gradient once, as without checkpoint, and can change it.
    torch.manual_seed(14)
    plain = dwgraph.nn.LayerNormMLP(8, 16)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpoint = True
    seen = {}
    x_val = torch.randn(5, 8)
    for tag, m in (("plain", plain), ("ckpt", ckpt)):
        seen[tag] = []
        for n, p in m.named_parameters():
            p.register_hook(lambda g, n=n, tag=tag: seen[tag].append((n, g.clone())) or g * 2)
        x = x_val.clone().requires_grad_()
        x.register_hook(lambda g, tag=tag: seen[tag].append(("x", g.clone())))
        m(x).square().sum().backward()
        seen[tag].append(("x.grad", x.grad))
    # Once each (the order differs: one node hands over every gradient at once).
    assert sorted(n for n, _ in seen["ckpt"]) == sorted(n for n, _ in seen["plain"])
    assert len(seen["ckpt"]) == len(set(n for n, _ in seen["ckpt"])) == 1 + len(list(plain.parameters())) + 1
    got = dict(seen["ckpt"])
    for n, a in seen["plain"]:
        assert torch.equal(a, got[n]), n
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), n  # the hooks' doubling applied once on both


@pytest.mark.parametrize("what", ["input", "layer_norm_weight"])
def test_checkpoint_refuses_what_it_recomputes_from_changed_in_place(what):
    # Without checkpoint, LayerNorm's saved input and weight refuse the backward after a
    # change in place; the recomputation reads them, so it refuses too.
    m = dwgraph.nn.LayerNormMLP(8, 16, checkpoint=True, delay_wgrad_compute=True)
    x = torch.randn(4, 8)
    y = m(x)
    with torch.no_grad():
        (x if what == "input" else m.layer_norm_weight).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation|modified in place after the forward"):
        y.sum().backward()
    assert m.num_queued_wgrad_units() == 0


def test_checkpoint_without_grad_builds_no_node():
    m = dwgraph.nn.LayerNormMLP(8, 16, checkpoint=True, delay_wgrad_compute=True)
    with torch.no_grad():
        y = m(torch.randn(4, 8))
    assert y.grad_fn is None and m.num_queued_wgrad_units() == 0
    assert "checkpoint=True" in repr(m)


# ---- LayerNormLinear ------------------------------------------------------------------------

def test_layernorm_linear_has_transformer_engines_parameters():
    m = dwgraph.nn.LayerNormLinear(8, 6, 1e-6, bias=True, delay_wgrad_compute=True)
    assert [n for n, _ in m.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    assert m.eps == 1e-6 and m.need_backward_dw()
    assert [n for n, _ in dwgraph.nn.LayerNormLinear(8, 6, bias=False).named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "weight"]
    rms = dwgraph.nn.LayerNormLinear(8, 6, normalization="RMSNorm")
    assert [n for n, _ in rms.named_parameters()] == ["layer_norm_weight", "weight", "bias"]
    assert rms.layer_norm_bias is None and "normalization='RMSNorm'" in repr(rms)
    # Loads the values of a plain LayerNorm + Linear and computes what they compute.
    torch.manual_seed(15)
    ref = RefLNLinear(8, 6, bias=True, eps=1e-6)
    with torch.no_grad():
        ref.ln.weight.uniform_()
        ref.ln.bias.uniform_()
    m.load_state_dict({n: getattr(*ref.slots[n]) for n in ref.slots})
    x = torch.randn(3, 5, 8)
    assert torch.equal(m(x), ref(x))
    assert torch.equal(copy_into_reference(RefLNLinear(8, 6, bias=True, eps=1e-6), m)(x), ref(x))
    text = repr(m)
    for part in ("LayerNormLinear", "in_features=8", "out_features=6", "eps=1e-06", "delay_wgrad_compute=True"):
        assert part in text


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_layernorm_linear_returns_the_layernorm_output(graphed):
    # return_layernorm_output=True (TE's): (out, ln_out); a loss on both differentiates
    # through both, as torch.nn's LayerNorm + Linear. Graphed: bitwise the eager module.
    torch.manual_seed(16)
    m = dwgraph.nn.LayerNormLinear(8, 6, return_layernorm_output=True, delay_wgrad_compute=True)
    ref = copy.deepcopy(m)
    ref.return_layernorm_output, ref.delay_wgrad_compute = False, False
    if graphed:
        eager = copy.deepcopy(m)
        call = dwgraph.make_graphed_callables(m, (torch.randn(4, 8, requires_grad=True),))
    for step in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        out, ln_out = (call if graphed else m)(x)
        assert out.shape == (4, 6) and ln_out.shape == (4, 8)
        (out.square().sum() + ln_out.sin().sum()).backward()
        m.backward_dw()
        xr = x.detach().clone().requires_grad_()
        h = torch.nn.functional.layer_norm(xr, (8,), ref.layer_norm_weight, ref.layer_norm_bias, ref.eps)
        assert torch.equal(ln_out, h)
        yr = torch.nn.functional.linear(h, ref.weight, ref.bias)
        assert torch.equal(out, yr)
        (yr.square().sum() + h.sin().sum()).backward()
        assert torch.equal(x.grad, xr.grad)
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {n}"
        if graphed:
            xe = x.detach().clone().requires_grad_()
            oe, le = eager(xe)
            (oe.square().sum() + le.sin().sum()).backward()
            eager.backward_dw()
            assert torch.equal(oe, out) and torch.equal(le, ln_out) and torch.equal(xe.grad, x.grad)
            eager.zero_grad(set_to_none=step % 2 == 0)
        m.zero_grad(set_to_none=step % 2 == 0)
        ref.zero_grad(set_to_none=step % 2 == 0)


def test_layernorm_linear_refuses_what_it_does_not_implement():
    for make in (dwgraph.nn.LayerNormLinear, dwgraph.nn.LayerNormMLP):
        with pytest.raises(dwgraph.ArgumentError,
                           match=rf"{make.__name__}: normalization must be 'LayerNorm' or 'RMSNorm', got 'BatchNorm'"):
            make(8, 4, normalization="BatchNorm")
    # TE's third positional argument is eps, not bias.
    with pytest.raises(dwgraph.ArgumentError, match=r"eps must be a number.*bias is keyword-only.*False"):
        dwgraph.nn.LayerNormLinear(8, 4, False)
    with pytest.raises(dwgraph.ArgumentError, match=r"LayerNormLinear.*in_features = 8.*got shape \[3, 7\]"):
        dwgraph.nn.LayerNormLinear(8, 4)(torch.randn(3, 7))
