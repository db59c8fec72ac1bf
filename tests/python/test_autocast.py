"""dwgraph.nn modules and the GEMM ops under torch.autocast (issue 14).

As torch.nn.Linear: inside an autocast region the GEMMs run in the region's dtype (the
output has it), inputs of the autocast dtype are accepted with FP32 weights, and the input
gradient comes back in the input's dtype; parameters of another low-precision dtype than
the region's (FP16 in a BF16 region, BF16 in an FP16 one) get their gradients in their own
dtype. Weight gradients of FP32 parameters are written in FP32 from the lower-precision
operands (TransformerEngine's behaviour; torch rounds them to the autocast dtype first), so
they are checked against a float64 product of those operands. Eager, torch.compile and
graph replays of the same module agree bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dwgraph
from safety_common import SMALL_B, SMALL_H, assert_same_as_eager, eager_backward_dw

H = 16
B = 6
LOW = [torch.bfloat16, torch.float16]
CONFIGS = [dict(), dict(delay_wgrad_compute=True), dict(delay_wgrad_compute=True, fuse_wgrad_accumulation=True)]
CONFIG_IDS = ["plain", "deferred", "deferred_fused"]


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _finish(module):
    if getattr(module, "delay_wgrad_compute", False):
        module.backward_dw()


def _wgrad_of(module, name):
    p = getattr(module, name)
    return p.main_grad if getattr(module, "fuse_wgrad_accumulation", False) else p.grad


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("input_dtype", ["fp32", "autocast"])
def test_linear_under_autocast_is_torch_linear(dtype, cfg, input_dtype):
    torch.manual_seed(0)
    lin = dwgraph.nn.Linear(H, 8, **cfg)
    ref = torch.nn.Linear(H, 8)
    ref.load_state_dict({k: v for k, v in lin.state_dict().items()})
    x = torch.randn(B, H, dtype=torch.float32 if input_dtype == "fp32" else dtype, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
        y, yr = lin(x), ref(xr)
    assert y.dtype == yr.dtype == dtype
    assert torch.equal(y, yr), "forward differs from torch.nn.Linear under autocast"
    dy = torch.randn_like(y)
    y.backward(dy)
    yr.backward(dy)
    _finish(lin)
    assert x.grad.dtype == x.dtype and torch.equal(x.grad, xr.grad), "input gradient differs from torch's"
    # Weight and bias gradients: FP32 results of the autocast-dtype operands.
    x_low, dy_low = x.detach().to(dtype).double(), dy.double()
    w_ref = dy_low.t() @ x_low
    dw = _wgrad_of(lin, "weight")
    assert dw.dtype == torch.float32 and _rel(dw, w_ref) < 2e-6
    assert lin.bias.grad.dtype == torch.float32 and _rel(lin.bias.grad, dy_low.sum(0)) < 2e-6


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("params, region", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
                         ids=["fp16_in_bf16", "bf16_in_fp16"])
def test_parameters_of_another_low_precision_dtype_than_the_autocast_region(delay, params, region):
    # As torch.nn.Linear: the GEMMs run in the region's dtype, the gradients come back in the
    # parameters' dtype (through an FP32 buffer, since wgrad_gemm writes FP32 or its
    # operands' dtype).
    torch.manual_seed(0)
    lin = dwgraph.nn.Linear(SMALL_H, 4, delay_wgrad_compute=delay, dtype=params)
    x = torch.randn(SMALL_B, SMALL_H, requires_grad=True)
    with torch.autocast("cpu", dtype=region, cache_enabled=False):
        y = lin(x)
    assert y.dtype == region
    dy = torch.randn_like(y)
    y.backward(dy)
    if delay:
        lin.backward_dw()
    assert lin.weight.grad.dtype == params and lin.bias.grad.dtype == params
    ref = dy.double().t() @ x.detach().to(region).double()
    err = ((lin.weight.grad.double() - ref).norm() / ref.norm()).item()
    assert err < (8e-3 if params == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("kind", ["grouped", "grouped_packed", "layernorm_mlp", "layernorm_mlp_checkpoint",
                                  "layernorm_linear", "layernorm_linear_rms"])
def test_other_modules_follow_autocast(cfg, kind):
    torch.manual_seed(1)
    layernorm = kind.startswith("layernorm")
    if layernorm:
        norm = "RMSNorm" if kind.endswith("rms") else "LayerNorm"
        m = (dwgraph.nn.LayerNormLinear(H, H, normalization=norm, **cfg) if kind.startswith("layernorm_linear")
             else dwgraph.nn.LayerNormMLP(H, 2 * H, checkpoint=kind.endswith("checkpoint"), **cfg))
        args = (torch.randn(B, H),)
    else:
        m = dwgraph.nn.GroupedLinear(3, H, 8, packed_weights=kind == "grouped_packed", **cfg)
        args = (torch.randn(B, H), [1, 0, 5])
    plain = copy.deepcopy(m)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        y = m(*args)
    assert y.dtype == torch.bfloat16
    # The same module with its parameters and input rounded to bf16 and no autocast runs
    # the same bf16 GEMMs: the outputs agree bitwise.
    low = plain.to(torch.bfloat16)
    if layernorm:
        # LayerNorm itself runs in FP32 under CPU autocast; only its output is cast.
        with torch.no_grad():
            h = (torch.nn.functional.rms_norm(args[0], (H,), m.layer_norm_weight, m.eps) if norm == "RMSNorm"
                 else torch.nn.functional.layer_norm(args[0], (H,), m.layer_norm_weight, m.layer_norm_bias, m.eps))
        assert y.shape == (B, H) and torch.isfinite(y.float()).all()
        ref_in = h
    else:
        ref_in = args[0]
    if kind.startswith("layernorm_linear"):
        # fc in bf16 on the FP32 LayerNorm output, as torch.nn's Linear under autocast.
        assert torch.equal(y, torch.nn.functional.linear(h.bfloat16(), m.weight.bfloat16(), m.bias.bfloat16()))
    if not layernorm:
        assert torch.equal(y, low(ref_in.to(torch.bfloat16), *args[1:]))
    y.float().square().sum().backward()
    _finish(m)
    for n, p in m.named_parameters():
        g = p.main_grad if (cfg.get("fuse_wgrad_accumulation") and "weight" in n and "layer_norm" not in n) else p.grad
        assert g is not None and g.dtype == torch.float32 and torch.isfinite(g).all(), n


@pytest.mark.parametrize("kind", ["linear", "grouped", "layernorm_mlp", "layernorm_mlp_checkpoint",
                                  "layernorm_linear"])
def test_compiled_and_eager_agree_bitwise_under_autocast(kind):
    torch.manual_seed(2)
    make = {"linear": lambda: dwgraph.nn.Linear(H, 8),
            "grouped": lambda: dwgraph.nn.GroupedLinear(2, H, 8),
            "layernorm_mlp": lambda: dwgraph.nn.LayerNormMLP(H, 2 * H),
            "layernorm_mlp_checkpoint": lambda: dwgraph.nn.LayerNormMLP(H, 2 * H, checkpoint=True),
            "layernorm_linear": lambda: dwgraph.nn.LayerNormLinear(H, 8)}[kind]
    a = make()
    b = copy.deepcopy(a)
    compiled = torch.compile(b, fullgraph=True, backend="aot_eager")
    args = (torch.randn(B, H),) + (([2, 4],) if kind == "grouped" else ())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = a(*args), compiled(*args)
    assert ya.dtype == yb.dtype == torch.bfloat16 and torch.equal(ya, yb)
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()  # outside the region, as usual
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), f"{n}.grad: compiled differs from eager"


def test_the_backward_keeps_the_forwards_precision_whatever_region_it_runs_in():
    # Forward in FP32, backward and backward_dw inside a bf16 region: FP32 GEMMs still.
    torch.manual_seed(3)
    a = dwgraph.nn.Linear(H, 8, delay_wgrad_compute=True)
    b = copy.deepcopy(a)
    x = torch.randn(B, H, requires_grad=True)
    xb = x.detach().clone().requires_grad_()
    ya, yb = a(x), b(xb)
    ya.square().sum().backward()
    a.backward_dw()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb.square().sum().backward()
        b.backward_dw()
    assert torch.equal(x.grad, xb.grad) and torch.equal(a.weight.grad, b.weight.grad)
    assert torch.equal(a.bias.grad, b.bias.grad)


def test_gemm_ops_have_autocast_kernels():
    x, w, b = torch.randn(5, H), torch.randn(8, H), torch.randn(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.dwgraph.fwd_gemm(x, w, b)
        dx = torch.ops.dwgraph.dgrad_gemm(torch.randn(5, 8), w)
        out = torch.zeros(8, H)
        dy = torch.randn(5, 8)
        torch.ops.dwgraph.wgrad_gemm(dy, x, out, False)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16
    assert torch.equal(y, torch.ops.dwgraph.fwd_gemm(x.bfloat16(), w.bfloat16(), b.bfloat16()))
    # The FP32 output stays FP32: the bf16 operands' product, accumulated in FP32.
    assert out.dtype == torch.float32
    assert _rel(out, dy.bfloat16().double().t() @ x.bfloat16().double()) < 2e-6


def test_mismatched_dtypes_outside_autocast_are_refused():
    lin = dwgraph.nn.Linear(H, 8)
    with pytest.raises(dwgraph.ArgumentError, match=r"input must have the weight's dtype torch.float32, got "
                                                    r"torch.bfloat16|input must have the weight's dtype Float"):
        lin(torch.randn(B, H, dtype=torch.bfloat16))


@pytest.mark.parametrize("sample_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_graphs_captured_under_autocast_replay_the_autocast_graph(sample_dtype, cfg, device):
    torch.manual_seed(4)
    m = torch.nn.Sequential(dwgraph.nn.Linear(H, H, **cfg), torch.nn.GELU(),
                            dwgraph.nn.LayerNormMLP(H, 2 * H, **cfg)).to(device)
    eager = copy.deepcopy(m)
    dt = torch.float32 if sample_dtype == "fp32" else torch.bfloat16
    region = dict(device_type=device, dtype=torch.bfloat16, cache_enabled=False)
    with torch.autocast(**region):
        g = dwgraph.make_graphed_callables(m, (torch.randn(B, H, dtype=dt, device=device, requires_grad=True),))
    for step in range(3):
        x = torch.randn(B, H, dtype=dt, device=device, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        with torch.autocast(**region):
            y, ye = g(x), eager(xe)
        assert y.dtype == torch.bfloat16 and torch.equal(y, ye), f"step {step}: output"
        y.float().square().sum().backward()
        ye.float().square().sum().backward()
        if cfg.get("delay_wgrad_compute"):
            g.backward_dw()
            eager_backward_dw(eager)
        assert torch.equal(x.grad, xe.grad), f"step {step}: input gradient"
        assert_same_as_eager(m, eager, f"autocast step {step}")


def test_linear_under_autocast_on_the_device(device):
    # On CUDA torch's GEMM and cuBLASLt may sum in other orders: a float64 reference of the
    # autocast-dtype operands, with the bounds of the result's dtype.
    torch.manual_seed(6)
    lin = dwgraph.nn.Linear(64, 32, delay_wgrad_compute=True, device=device)
    x = torch.randn(48, 64, device=device, requires_grad=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    xl, wl, bl = (t.detach().bfloat16().double() for t in (x, lin.weight, lin.bias))
    assert _rel(y, xl @ wl.t() + bl) < 8e-3
    dy = torch.randn_like(y)
    y.backward(dy)
    lin.backward_dw()
    assert x.grad.dtype == torch.float32 and _rel(x.grad, dy.double() @ wl) < 8e-3
    assert lin.weight.grad.dtype == torch.float32 and _rel(lin.weight.grad, dy.double().t() @ xl) < 1e-5
    assert _rel(lin.bias.grad, dy.double().sum(0)) < 1e-5


def test_graphed_step_with_dwgraph_modules_under_autocast_is_exact():
    torch.manual_seed(5)
    m = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.ReLU(), dwgraph.nn.Linear(H, 4))
    e = copy.deepcopy(m)
    om, oe = (torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, e))

    def body(model, opt, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        model[0].backward_dw()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, om, x), warmup_iters=1, params=m)
    for i in range(4):
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(e, oe, x)), f"call {i}: loss"
        for (n, p), q in zip(m.named_parameters(), e.parameters()):
            assert torch.equal(p, q), f"call {i}: {n}"


class _Router(torch.nn.Module):
    """An MoE-style router: a projection under autocast, then an FP32 region
    (autocast(enabled=False)) whose matmuls eager's backward runs in FP32 when
    loss.backward() is called outside the autocast region and in BF16 inside it."""

    def __init__(self, device):
        super().__init__()
        self.proj = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, device=device)
        self.gate = torch.nn.Linear(H, 4, device=device)

    def forward(self, x):
        h = self.proj(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = self.gate(h.float())
        return h, torch.softmax(logits, -1)


def _router_loss(h, r):
    return h.float().square().sum() + (r * torch.arange(4.0, device=r.device)).sum()


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward_outside", "backward_inside"])
def test_backward_graph_runs_in_the_autocast_state_of_the_backward(backward_inside, device):
    # Note [Autocast in the backward]: captured as the backward will run (outside the
    # region by default, inside with backward_under_autocast=True), bitwise eager; a
    # backward started in the other state is refused before anything is written.
    torch.manual_seed(7)
    m = _Router(device)
    eager, ref = copy.deepcopy(m), copy.deepcopy(m)
    region = dict(device_type=device, dtype=torch.bfloat16, cache_enabled=False)
    with torch.autocast(**region):
        g = dwgraph.make_graphed_callables(m, (torch.randn(B, H, device=device, requires_grad=True),),
                                           backward_under_autocast=backward_inside)
    for step in range(3):
        x = torch.randn(B, H, device=device, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        with torch.autocast(**region):
            out, oute = g(x), eager(xe)
            if backward_inside:
                _router_loss(*out).backward()
                _router_loss(*oute).backward()
        if not backward_inside:
            _router_loss(*out).backward()
            _router_loss(*oute).backward()
        g.backward_dw()
        eager.proj.backward_dw()
        assert torch.equal(x.grad, xe.grad), f"step {step}: input gradient"
        assert_same_as_eager(m, eager, f"step {step}")
    # The FP32 region's gradient really depends on where the backward runs: the other
    # state gives other bits, which a graph captured for one state would replay for both.
    inside, outside = copy.deepcopy(ref), copy.deepcopy(ref)
    x = torch.randn(B, H, device=device)
    with torch.autocast(**region):
        _router_loss(*inside(x)).backward()
        loss = _router_loss(*outside(x))
    loss.backward()
    assert not torch.equal(inside.gate.weight.grad, outside.gate.weight.grad)
    # A backward in the other state is refused, naming the way out.
    with torch.autocast(**region):
        out = g(torch.randn(B, H, device=device))
    before = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    with pytest.raises(dwgraph.GraphStateError, match="backward_under_autocast=True" if not backward_inside
                       else "outside the autocast region|inside the autocast region"):
        if backward_inside:
            _router_loss(*out).backward()
        else:
            with torch.autocast(**region):
                _router_loss(*out).backward()
    for n, p in m.named_parameters():
        if n in before:
            assert torch.equal(p.grad, before[n]), f"{n} written by a refused backward"


def test_multihead_attention_graphed_under_autocast_is_exact():
    # nn.MultiheadAttention (its math path runs FP32 pieces): graphed under autocast with
    # the backward outside it, as in the natural loop.
    torch.manual_seed(8)

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(H, 2, batch_first=True)
            self.out = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)

        def forward(self, x):
            return self.out(self.attn(x, x, x, need_weights=False)[0])

    m = SelfAttention()
    eager = copy.deepcopy(m)
    region = dict(device_type="cpu", dtype=torch.bfloat16, cache_enabled=False)
    with torch.autocast(**region):
        g = dwgraph.make_graphed_callables(m, (torch.randn(2, 5, H, requires_grad=True),))
    for step in range(3):
        x = torch.randn(2, 5, H, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        with torch.autocast(**region):
            y, ye = g(x), eager(xe)
        y.float().square().sum().backward()
        ye.float().square().sum().backward()
        g.backward_dw()
        eager.out.backward_dw()
        assert torch.equal(x.grad, xe.grad), f"step {step}: input gradient"
        assert_same_as_eager(m, eager, f"step {step}")


def test_a_default_autocast_dtype_set_since_capture_is_refused_at_the_call():
    # torch.autocast("cpu") entered inside a module without a dtype takes the default, baked
    # into the graph: a call after torch.set_autocast_dtype would replay the old dtype.
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = dwgraph.nn.Linear(H, H)

        def forward(self, x):
            with torch.autocast("cpu", cache_enabled=False):
                return self.lin(x).float()

    torch.manual_seed(0)
    m = Inner()
    e = copy.deepcopy(m)
    g = dwgraph.make_graphed_callables(m, (torch.randn(B, H, requires_grad=True),))
    default = torch.get_autocast_dtype("cpu")
    try:
        x = torch.randn(B, H, requires_grad=True)
        x_e = x.detach().clone().requires_grad_()
        out, ref = g(x), e(x_e)
        out.sum().backward(), ref.sum().backward()
        assert torch.equal(out, ref) and torch.equal(x.grad, x_e.grad)
        torch.set_autocast_dtype("cpu", torch.float16)
        with pytest.raises(dwgraph.ArgumentError, match=r"called with autocast off \(default dtype cpu torch.float16\), "
                                                        r"captured with off"):
            g(torch.randn(B, H, requires_grad=True))
    finally:
        torch.set_autocast_dtype("cpu", default)
    x = torch.randn(B, H)
    assert torch.equal(g(x), e(x))  # the default back: replayed as captured
