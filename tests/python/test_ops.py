"""The GEMM ops of ``dwgraph.ops`` against independent float64 references.

Shapes are row-major: x [M, K], w [N, K], y / dy [M, N]; wgrad writes out [N, K] (and
bias_grad_out [N]). Every reference is computed in float64 from the very values the op
sees (after rounding the random inputs to bf16 / fp16), so the only error measured is the
op's own: FP32 accumulation and the final rounding to the output dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import pytest
import torch
import torch.nn.functional as F

import dwgraph
from dwgraph import ops

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_DT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# wgrad's (input dtype, out dtype): out is float32 or the input dtype.
WGRAD_DTYPES = [
    (dt, odt) for dt in FLOAT_DTYPES for odt in dict.fromkeys([torch.float32, dt])
]
WGRAD_DTYPE_IDS = [f"in_{_DT[dt]}-out_{_DT[odt]}" for dt, odt in WGRAD_DTYPES]

# (M, N, K): each of M, N and K takes each of 1, 7, 33 and 128.
SHAPES = [(1, 1, 1), (7, 33, 1), (1, 7, 33), (33, 128, 7), (128, 1, 33), (128, 33, 128)]
SHAPE_IDS = [f"M{m}-N{n}-K{k}" for m, n, k in SHAPES]

# Grouped cases (m_splits, N, K); each has an empty group.
GROUPED = [
    ([7, 0, 33, 1], 33, 7),
    ([0, 128], 7, 33),
    ([1, 0, 0, 7], 1, 128),
    ([33, 0], 128, 1),
]
GROUPED_IDS = ["splits_" + "_".join(map(str, s)) + f"-N{n}-K{k}" for s, n, k in GROUPED]

dtype_param = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=[_DT[d] for d in FLOAT_DTYPES])
wgrad_dtypes_param = pytest.mark.parametrize("dtype,out_dtype", WGRAD_DTYPES, ids=WGRAD_DTYPE_IDS)
shape_param = pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
grouped_param = pytest.mark.parametrize("case", GROUPED, ids=GROUPED_IDS)
bias_param = pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
accumulate_param = pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
packed_param = pytest.mark.parametrize("packed", [False, True], ids=["list", "packed"])


def rand(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Random values drawn on the CPU (the same on every device), rounded to ``dtype``."""
    if dtype.is_floating_point:
        t = torch.randn(*shape, dtype=torch.float32).to(dtype)
    else:
        t = torch.randint(-3, 4, shape, dtype=dtype)
    return t.to(device)


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def wgrad_ref(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return f64(dy).t() @ f64(x)


def group_rows(m_splits: Sequence[int]):
    """(group, first row, rows) of each group."""
    start = 0
    for g, rows in enumerate(m_splits):
        yield g, start, rows
        start += rows


def check_accumulated(out, out0, products, assert_rel):
    """After accumulating calls: ``out == out0 + sum(products)``.

    A float32 ``out`` is checked against that sum directly. A bf16 / fp16 ``out`` is
    rounded to its dtype after every call, and where the products cancel ``out0`` that
    intermediate rounding alone exceeds the bound relative to the (small) final value; so
    there each call is checked against the value ``out`` held before it (done by the
    callers), and the end result against the sum with the bound scaled to the magnitudes
    involved (one rounding per call).
    """
    ref = out0 + sum(products)
    if out.dtype == torch.float32:
        assert_rel(out, ref, what="out0 + all products")
    else:
        scale = (out0.norm() + sum(p.norm() for p in products)).item()
        assert_rel(out, ref, what="out0 + all products", scale=scale / len(products))


# --------------------------------------------------------------------------------------
# Values against float64 references
# --------------------------------------------------------------------------------------


@dtype_param
@shape_param
@bias_param
def test_fwd_gemm(device, dtype, shape, with_bias, assert_rel):
    m, n, k = shape
    x, w = rand(m, k, dtype=dtype, device=device), rand(n, k, dtype=dtype, device=device)
    bias = rand(n, dtype=dtype, device=device) if with_bias else None

    y = ops.fwd_gemm(x, w, bias)

    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    ref = f64(x) @ f64(w).t()
    if with_bias:
        ref += f64(bias)
    assert_rel(y, ref)


@dtype_param
@shape_param
def test_dgrad_gemm(device, dtype, shape, assert_rel):
    m, n, k = shape
    dy, w = rand(m, n, dtype=dtype, device=device), rand(n, k, dtype=dtype, device=device)

    dx = ops.dgrad_gemm(dy, w)

    assert dx.shape == (m, k) and dx.dtype == dtype and dx.device == dy.device
    assert_rel(dx, f64(dy) @ f64(w))


@wgrad_dtypes_param
@shape_param
@accumulate_param
@bias_param
def test_wgrad_gemm(device, dtype, out_dtype, shape, accumulate, with_bias, assert_rel):
    m, n, k = shape
    out0 = rand(n, k, dtype=out_dtype, device=device)
    out = out0.clone()
    bias_grad0 = rand(n, dtype=out_dtype, device=device) if with_bias else None
    bias_grad = bias_grad0.clone() if with_bias else None
    # Accumulating: two calls with different (dy, x) must add both products to out0.
    pairs = [
        (rand(m, n, dtype=dtype, device=device), rand(m, k, dtype=dtype, device=device))
        for _ in range(2 if accumulate else 1)
    ]

    for i, (dy, x) in enumerate(pairs):
        before = f64(out)
        ops.wgrad_gemm(dy, x, out, accumulate, bias_grad)
        # Each call adds its product to the value `out` holds, rounded once.
        assert_rel(out, wgrad_ref(dy, x) + (before if accumulate else 0), what=f"out after call {i}")

    assert out.shape == (n, k) and out.dtype == out_dtype and out.device == out0.device
    if accumulate:
        check_accumulated(out, f64(out0), [wgrad_ref(dy, x) for dy, x in pairs], assert_rel)
    if with_bias:
        # Overwritten (never accumulated) with the last call's dy.sum(0), in out's dtype.
        assert bias_grad.dtype == out_dtype
        assert_rel(bias_grad, f64(pairs[-1][0]).sum(0), what="bias_grad_out")


def _grouped_weights(g, n, k, dtype, device, packed):
    if packed:
        return rand(g, n, k, dtype=dtype, device=device)
    return [rand(n, k, dtype=dtype, device=device) for _ in range(g)]


def _grouped_vectors(g, n, dtype, device, packed):
    if packed:
        return rand(g, n, dtype=dtype, device=device)
    return [rand(n, dtype=dtype, device=device) for _ in range(g)]


def _clone_all(t):
    return t.clone() if isinstance(t, torch.Tensor) else [e.clone() for e in t]


@dtype_param
@grouped_param
@packed_param
@bias_param
def test_grouped_fwd_gemm(device, dtype, case, packed, with_bias, assert_rel):
    m_splits, n, k = case
    g_count, m = len(m_splits), sum(m_splits)
    x = rand(m, k, dtype=dtype, device=device)
    w = _grouped_weights(g_count, n, k, dtype, device, packed)
    bias = _grouped_vectors(g_count, n, dtype, device, packed) if with_bias else None

    y = ops.grouped_fwd_gemm(x, w, m_splits, bias)

    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    ref = torch.empty(m, n, dtype=torch.float64)
    for g, start, rows in group_rows(m_splits):
        ref[start:start + rows] = f64(x[start:start + rows]) @ f64(w[g]).t()
        if with_bias:
            ref[start:start + rows] += f64(bias[g])
    assert_rel(y, ref)


@dtype_param
@grouped_param
@packed_param
def test_grouped_dgrad_gemm(device, dtype, case, packed, assert_rel):
    m_splits, n, k = case
    g_count, m = len(m_splits), sum(m_splits)
    dy = rand(m, n, dtype=dtype, device=device)
    w = _grouped_weights(g_count, n, k, dtype, device, packed)

    dx = ops.grouped_dgrad_gemm(dy, w, m_splits)

    assert dx.shape == (m, k) and dx.dtype == dtype and dx.device == dy.device
    ref = torch.cat([f64(dy[s:s + r]) @ f64(w[g]) for g, s, r in group_rows(m_splits)])
    assert_rel(dx, ref)


@wgrad_dtypes_param
@grouped_param
@packed_param
@accumulate_param
@bias_param
def test_grouped_wgrad_gemm(device, dtype, out_dtype, case, packed, accumulate, with_bias,
                            assert_rel):
    m_splits, n, k = case
    g_count, m = len(m_splits), sum(m_splits)
    out = _grouped_weights(g_count, n, k, out_dtype, device, packed)
    out0 = _clone_all(out)
    bias_grad = _grouped_vectors(g_count, n, out_dtype, device, packed) if with_bias else None
    pairs = [
        (rand(m, n, dtype=dtype, device=device), rand(m, k, dtype=dtype, device=device))
        for _ in range(2 if accumulate else 1)
    ]

    for i, (dy, x) in enumerate(pairs):
        before = [f64(o) for o in out]
        ops.grouped_wgrad_gemm(dy, x, out, m_splits, accumulate, bias_grad)
        for g, start, rows in group_rows(m_splits):
            if rows:
                ref = wgrad_ref(dy[start:start + rows], x[start:start + rows])
                assert_rel(out[g], ref + (before[g] if accumulate else 0), what=f"out[{g}] after call {i}")

    for g, start, rows in group_rows(m_splits):
        assert out[g].shape == (n, k) and out[g].dtype == out_dtype
        if rows == 0:
            if accumulate:
                assert torch.equal(out[g], out0[g]), f"empty group {g} was written"
            else:
                assert torch.count_nonzero(out[g]) == 0, f"empty group {g} was not zeroed"
            if with_bias:
                assert torch.count_nonzero(bias_grad[g]) == 0, f"bias_grad_out[{g}] not zeroed"
            continue
        if accumulate:
            products = [wgrad_ref(dy[start:start + rows], x[start:start + rows]) for dy, x in pairs]
            check_accumulated(out[g], f64(out0[g]), products, assert_rel)
        if with_bias:
            last_dy = pairs[-1][0]
            assert_rel(bias_grad[g], f64(last_dy[start:start + rows]).sum(0),
                       what=f"bias_grad_out[{g}]")


# --------------------------------------------------------------------------------------
# Bitwise agreement with torch.nn.functional.linear and its autograd (FP32, CPU)
# --------------------------------------------------------------------------------------


@shape_param
@bias_param
def test_fwd_gemm_fp32_equals_linear_bitwise(shape, with_bias):
    m, n, k = shape
    x, w = rand(m, k), rand(n, k)
    bias = rand(n) if with_bias else None

    assert torch.equal(ops.fwd_gemm(x, w, bias), F.linear(x, w, bias))


@shape_param
@bias_param
def test_dgrad_wgrad_fp32_equal_linear_autograd_bitwise(shape, with_bias):
    m, n, k = shape
    x = rand(m, k).requires_grad_()
    w = rand(n, k).requires_grad_()
    bias = rand(n).requires_grad_() if with_bias else None
    dy = rand(m, n)
    F.linear(x, w, bias).backward(dy)

    dx = ops.dgrad_gemm(dy, w.detach())
    out = rand(n, k)  # random, so an accumulation instead of an overwrite would show
    bias_grad = rand(n) if with_bias else None
    ops.wgrad_gemm(dy, x.detach(), out, False, bias_grad)

    assert torch.equal(dx, x.grad)
    assert torch.equal(out, w.grad)
    if with_bias:
        assert torch.equal(bias_grad, bias.grad)


# --------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------


def test_torch_compile_matches_eager(device, assert_rel):
    """The ops under torch.compile (Meta kernels for fake tensors, the mutable wgrad
    functionalized and re-inplaced) give the eager values, including the in-place
    FP32 accumulation into a persistent main_grad across calls."""

    def step(x, w, dy, main_grad):
        y = torch.ops.dwgraph.fwd_gemm(x, w, None)
        torch.ops.dwgraph.wgrad_gemm(dy, x, main_grad, True, None)
        return y * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    m, n, k = 33, 7, 16
    w = rand(n, k, dtype=torch.bfloat16, device=device)
    main_grad0 = rand(n, k, device=device)
    main_grad_eager, main_grad_compiled = main_grad0.clone(), main_grad0.clone()
    ref = f64(main_grad0)
    for _ in range(2):
        x = rand(m, k, dtype=torch.bfloat16, device=device)
        dy = rand(m, n, dtype=torch.bfloat16, device=device)
        y_eager = step(x, w, dy, main_grad_eager)
        y_compiled = compiled(x, w, dy, main_grad_compiled)
        ref += wgrad_ref(dy, x)
        assert torch.equal(y_compiled, y_eager)
        assert torch.equal(main_grad_compiled, main_grad_eager)
    assert_rel(main_grad_compiled, ref, what="main_grad")


# --------------------------------------------------------------------------------------
# Bad arguments: ArgumentError naming the argument and its value, nothing written
# --------------------------------------------------------------------------------------

_M, _N, _K = 6, 5, 4  # distinct, so a message's numbers say which dimension it means
_SPLITS = [2, 4]
BF16, F16, F64, I32 = torch.bfloat16, torch.float16, torch.float64, torch.int32


class BadCase(NamedTuple):
    id: str
    fn: str  # name in dwgraph.ops
    make: Callable[[str], tuple]  # device -> positional arguments
    match: str  # regex the message must match (pytest.raises uses re.search)


def _bad(id, fn, make, match):
    return pytest.param(BadCase(id, fn, make, match), id=id)


def T(*shape, dtype=torch.float32, d="cpu"):  # noqa: N802  (short on purpose: the table below)
    return rand(*shape, dtype=dtype, device=d)


def _wgrad_ok(d, dtype=torch.float32, out_dtype=torch.float32):
    """Valid wgrad_gemm arguments, to be spoiled one at a time."""
    return (T(_M, _N, dtype=dtype, d=d), T(_M, _K, dtype=dtype, d=d), T(_N, _K, dtype=out_dtype, d=d),
            False, T(_N, dtype=out_dtype, d=d))


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return tuple(args)


def _gw_list(d, n=_N, k=_K, dtype=torch.float32, g=2):
    return [T(n, k, dtype=dtype, d=d) for _ in range(g)]


BAD_CASES = [
    # mismatched M, K, N
    _bad("wgrad-x-rows", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 1, T(_M + 1, _K, d=d)),
         r"wgrad_gemm: argument 'x' must have M = 6 rows.*got shape \[7, 4\]"),
    _bad("fwd-w-cols", "fwd_gemm", lambda d: (T(_M, _K, d=d), T(_N, _K - 1, d=d)),
         r"fwd_gemm: argument 'w' must have K = 4 columns.*got shape \[5, 3\]"),
    _bad("dgrad-w-rows", "dgrad_gemm", lambda d: (T(_M, _N, d=d), T(_N - 2, _K, d=d)),
         r"dgrad_gemm: argument 'w' must have N = 5 rows.*got shape \[3, 4\]"),
    _bad("wgrad-out-shape", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 2, T(_K, _N, d=d)),
         r"wgrad_gemm: argument 'out' must have shape \[5, 4\].*got \[4, 5\]"),
    _bad("grouped-dgrad-w0-rows", "grouped_dgrad_gemm",
         lambda d: (T(_M, _N, d=d), _gw_list(d, n=_N - 2), _SPLITS),
         r"grouped_dgrad_gemm: argument 'w\[0\]' must have N = 5 rows.*got shape \[3, 4\]"),
    _bad("grouped-fwd-w1-shape", "grouped_fwd_gemm",
         lambda d: (T(_M, _K, d=d), [T(_N, _K, d=d), T(_N + 1, _K, d=d)], _SPLITS),
         r"grouped_fwd_gemm: argument 'w\[1\]' must have shape \[5, 4\].*got \[6, 4\]"),
    # unsupported dtypes
    _bad("fwd-float64", "fwd_gemm", lambda d: (T(_M, _K, dtype=F64, d=d), T(_N, _K, dtype=F64, d=d)),
         r"fwd_gemm: argument 'x' must be float32, bfloat16 or float16, got Double"),
    _bad("wgrad-int32", "wgrad_gemm",
         lambda d: _replace(_replace(_wgrad_ok(d), 0, T(_M, _N, dtype=I32, d=d)), 1, T(_M, _K, dtype=I32, d=d)),
         r"wgrad_gemm: argument 'dy' must be float32, bfloat16 or float16, got Int"),
    _bad("wgrad-out-float64", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 2, T(_N, _K, dtype=F64, d=d)),
         r"wgrad_gemm: argument 'out' must be float32 or the input dtype Float, got Double"),
    _bad("fwd-mixed-dtypes", "fwd_gemm", lambda d: (T(_M, _K, d=d), T(_N, _K, dtype=BF16, d=d)),
         r"fwd_gemm: argument 'w' must have dtype Float \(the dtype of 'x'\), got BFloat16"),
    # wrong device
    _bad("fwd-w-meta", "fwd_gemm", lambda d: (T(_M, _K, d=d), T(_N, _K, d="meta")),
         r"fwd_gemm: argument 'w' must be on device \S+ \(the device of 'x'\), got meta"),
    _bad("wgrad-out-meta", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 2, T(_N, _K, d="meta")),
         r"wgrad_gemm: argument 'out' must be on device \S+ \(the device of 'dy'\), got meta"),
    _bad("wgrad-bias_grad_out-meta", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 4, T(_N, d="meta")),
         r"wgrad_gemm: argument 'bias_grad_out' must be on device \S+ \(the device of 'out'\), got meta"),
    # non-contiguous (transposed views)
    _bad("fwd-x-transposed", "fwd_gemm", lambda d: (T(_K, _M, d=d).t(), T(_N, _K, d=d)),
         r"fwd_gemm: argument 'x' must be contiguous.*got strides \[1, 6\] for shape \[6, 4\]"),
    _bad("dgrad-w-transposed", "dgrad_gemm", lambda d: (T(_M, _N, d=d), T(_K, _N, d=d).t()),
         r"dgrad_gemm: argument 'w' must be contiguous.*got strides \[1, 5\] for shape \[5, 4\]"),
    _bad("wgrad-out-transposed", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 2, T(_K, _N, d=d).t()),
         r"wgrad_gemm: argument 'out' must be contiguous.*got strides \[1, 5\] for shape \[5, 4\]"),
    # m_splits: wrong sum, wrong length, negative entry
    _bad("grouped-fwd-splits-sum", "grouped_fwd_gemm",
         lambda d: (T(_M, _K, d=d), _gw_list(d), [2, 3]),
         r"grouped_fwd_gemm: argument 'm_splits' must sum to M = 6.*got \[2, 3\] which sums to 5"),
    _bad("grouped-wgrad-packed-splits-sum", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(_M, _K, d=d), T(2, _N, _K, d=d), [4, 4], True, T(2, _N, d=d)),
         r"grouped_wgrad_gemm: argument 'm_splits' must sum to M = 6.*got \[4, 4\] which sums to 8"),
    _bad("grouped-dgrad-packed-splits-length", "grouped_dgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(2, _N, _K, d=d), [6]),
         r"grouped_dgrad_gemm: argument 'm_splits' must have one entry per weight \(2\), got 1 entries \[6\]"),
    _bad("grouped-wgrad-list-splits-length", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(_M, _K, d=d), _gw_list(d), [1, 2, 3], False, None),
         r"grouped_wgrad_gemm: argument 'm_splits' must have one entry per weight \(2\), got 3 entries \[1, 2, 3\]"),
    _bad("grouped-fwd-packed-splits-negative", "grouped_fwd_gemm",
         lambda d: (T(_M, _K, d=d), T(2, _N, _K, d=d), [7, -1]),
         r"grouped_fwd_gemm: argument 'm_splits' entry 1 must be >= 0, got -1"),
    _bad("grouped-wgrad-list-splits-negative", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(_M, _K, d=d), _gw_list(d), [-1, 7], False, [T(_N, d=d), T(_N, d=d)]),
         r"grouped_wgrad_gemm: argument 'm_splits' entry 0 must be >= 0, got -1"),
    # out: wrong shape, wrong dtype
    _bad("grouped-wgrad-packed-out-shape", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(_M, _K, d=d), T(2, _N, _K - 1, d=d), _SPLITS, False, None),
         r"grouped_wgrad_gemm: argument 'out' must have shape \[2, 5, 4\].*got \[2, 5, 3\]"),
    _bad("grouped-wgrad-list-out1-shape", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(_M, _K, d=d), [T(_N, _K, d=d), T(_K, _N, d=d)], _SPLITS, False, None),
         r"grouped_wgrad_gemm: argument 'out\[1\]' must have shape \[5, 4\].*got \[4, 5\]"),
    _bad("wgrad-out-fp16-for-bf16", "wgrad_gemm", lambda d: _wgrad_ok(d, dtype=BF16, out_dtype=F16),
         r"wgrad_gemm: argument 'out' must be float32 or the input dtype BFloat16, got Half"),
    _bad("grouped-wgrad-packed-out-fp16-for-bf16", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, dtype=BF16, d=d), T(_M, _K, dtype=BF16, d=d), T(2, _N, _K, dtype=F16, d=d),
                    _SPLITS, True, None),
         r"grouped_wgrad_gemm: argument 'out' must be float32 or the input dtype BFloat16, got Half"),
    _bad("grouped-wgrad-list-out-mixed-dtypes", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, dtype=BF16, d=d), T(_M, _K, dtype=BF16, d=d),
                    [T(_N, _K, d=d), T(_N, _K, dtype=BF16, d=d)], _SPLITS, False, None),
         r"grouped_wgrad_gemm: argument 'out\[1\]' must have dtype Float \(the dtype of the first output\), "
         r"got BFloat16"),
    # bias / bias_grad_out: wrong shape (and dtype)
    _bad("fwd-bias-shape", "fwd_gemm", lambda d: (T(_M, _K, d=d), T(_N, _K, d=d), T(_N - 1, d=d)),
         r"fwd_gemm: argument 'bias' must have shape \[5\].*got \[4\]"),
    _bad("wgrad-bias_grad_out-shape", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 4, T(_N - 1, d=d)),
         r"wgrad_gemm: argument 'bias_grad_out' must have shape \[5\].*got \[4\]"),
    _bad("wgrad-bias_grad_out-dtype", "wgrad_gemm", lambda d: _replace(_wgrad_ok(d), 4, T(_N, dtype=BF16, d=d)),
         r"wgrad_gemm: argument 'bias_grad_out' must have dtype Float \(the dtype of 'out'\), got BFloat16"),
    _bad("grouped-fwd-packed-bias-shape", "grouped_fwd_gemm",
         lambda d: (T(_M, _K, d=d), T(2, _N, _K, d=d), _SPLITS, T(2, _N - 1, d=d)),
         r"grouped_fwd_gemm: argument 'bias' must have shape \[2, 5\].*got \[2, 4\]"),
    _bad("grouped-wgrad-list-bias_grad_out1-shape", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(_M, _K, d=d), _gw_list(d), _SPLITS, True, [T(_N, d=d), T(_N - 1, d=d)]),
         r"grouped_wgrad_gemm: argument 'bias_grad_out\[1\]' must have shape \[5\].*got \[4\]"),
    _bad("grouped-wgrad-packed-bias_grad_out-shape", "grouped_wgrad_gemm",
         lambda d: (T(_M, _N, d=d), T(_M, _K, d=d), T(2, _N, _K, d=d), _SPLITS, False, T(_N, d=d)),
         r"grouped_wgrad_gemm: argument 'bias_grad_out' must have shape \[2, 5\].*got \[5\]"),
]


def _torch_op(fn: str, args: tuple):
    """The torch.ops.dwgraph overload dwgraph.ops.<fn> calls for these arguments."""
    weights_at = {"grouped_fwd_gemm": 1, "grouped_dgrad_gemm": 1, "grouped_wgrad_gemm": 2}
    if fn in weights_at and isinstance(args[weights_at[fn]], torch.Tensor):
        fn += "_packed"
    return getattr(torch.ops.dwgraph, fn)


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (e for e in a if isinstance(e, torch.Tensor))


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_argument_raises_and_writes_nothing(device, case):
    args = case.make(device)
    # Every buffer passed in (outputs and inputs alike) must come out untouched; meta
    # tensors hold no data to compare.
    before = [(t, t.clone()) for t in _tensors(args) if t.device.type != "meta"]

    def assert_unchanged():
        for i, (t, t0) in enumerate(before):
            assert torch.equal(t, t0), f"tensor argument {i} was written before the error"

    with pytest.raises(dwgraph.ArgumentError, match=case.match) as via_ops:
        getattr(ops, case.fn)(*args)
    assert isinstance(via_ops.value, ValueError)
    assert_unchanged()

    with pytest.raises(ValueError, match=case.match) as via_dispatcher:
        _torch_op(case.fn, args)(*args)
    assert str(via_dispatcher.value) == str(via_ops.value)
    assert_unchanged()
