"""make_graphed_callables over a training loop (SPEC C1-C4): graphed vs eager vs torch.nn.

Every case builds three copies of one model from the same seed:

  * graphed   -- dwgraph.nn modules, wrapped ONCE by make_graphed_callables before the loop;
  * eager     -- the same dwgraph.nn modules (built from the same seed), run un-graphed;
  * reference -- plain torch.nn modules (torch.nn.Linear / LayerNorm+Linear+GELU+Linear /
                 LayerNorm+Linear / per-group F.linear) holding the same values, run with
                 plain autograd;

and trains them side by side for STEPS SGD(lr=0.1) steps, every module with
``delay_wgrad_compute=True``. The matrix:

  schedule     sequential: y = gb(ga(x)) (or one callable), loss.backward(), then each
               callable's backward_dw() in forward order; one microbatch.
               pipeline: 2 chunks x 3 microbatches, ORDER below, replayed in exactly
               that order (forwards chunk1, chunk2 per microbatch; then per microbatch
               loss.backward() -- bwd of chunk 2 then chunk 1 -- and backward_dw() of
               chunk 2 then chunk 1).
  zero_grad    set_to_none=True | set_to_none=False between steps (all three models).
  dtype        float32 | bfloat16.
  bias         with | without.
  tie          within: one callable holds two modules sharing every parameter
                       (torch.nn.Sequential(a, b), b's parameters are a's);
               across: a and b are two graphed callables (two chunks in the pipeline)
                       sharing every parameter;
               untied.
  wgrad        fused: fuse_wgrad_accumulation=True, weights accumulate into the FP32
                      ``main_grad`` (zeroed in place every step, its tensor object never
                      replaced), biases and LayerNorm parameters land in ``.grad``;
               grad:  every gradient lands in ``.grad``.
  pre          present: every step starts with a nonzero caller gradient on every
                        parameter (``.grad``, and ``main_grad`` for fused weights), as
                        left by an earlier eager accumulation; the step must add to it.
                        In step 0 it is there before make_graphed_callables, so capture
                        runs with caller gradients in place.
               absent.
  kind         Linear, LayerNormMLP, LayerNormLinear, GroupedLinear (a wrapper module that
               passes fixed m_splits with an empty group) and LayerNormMLP(checkpoint=True)
               rotate, so that each kind meets both schedules, both dtypes, every tie mode
               and both wgrad modes.
  device       cpu (the host graph) | cuda (CUDA graphs; marked ``cuda``, skipped without
               a CUDA device): the same matrix, every tensor and module on that device.

Asserted per case:
  * capture changes nothing the caller sees: parameters, .grad (values and tensor
    objects), main_grad (values and tensor objects) equal the eager copy's;
  * after every step's backward_dw(): graphed == eager BITWISE (torch.equal, same dtype)
    for every output, every input gradient, every parameter's .grad (None where eager
    has None) and main_grad; grad_added_to_main_grad is set on fused weights. A deferred
    parameter shared by two modules of ONE graphed callable is handed over one module
    at a time (.grad += a; .grad += b), exactly as the eager modules land it, so this
    holds there too (WITHIN_CALLABLE below).
  * after every SGD step: graphed parameters == eager parameters bitwise;
  * eager vs reference, per step (after each step the eager copy and the reference are
    re-synchronised to the graphed parameters, in place, so every step compares
    gradients on identical weights):
      - outputs and input gradients: bitwise (same ATen GEMMs on the same operands);
      - parameter gradients: bitwise wherever both sides add the same terms in the same
        association -- every single-microbatch case without a tied pre-existing
        gradient, every untied multi-microbatch case, and every parameter whose gradient
        both sides get from autograd (LayerNorm weights/biases) -- in both dtypes, since
        each wgrad is the same ATen mm rounded once and each accumulation one ``add_`` in
        the gradient's dtype, exactly as AccumulateGrad does;
      - elsewhere |d| <= 4 * ulp(v), ulp(v) = 2**(floor(log2 v) - 7) for bfloat16 and
        2**(floor(log2 v) - 23) for float32 (SPEC: "a few BF16 ulps at the gradient's
        magnitude where summation order differs"; the same count of FP32 ulps for FP32),
        v = the largest magnitude the reference gradient reaches while it accumulates
        (the caller's gradient, then after each microbatch's backward): every rounding
        of either side happens at a partial sum no larger than that. This is where the
        summation order provably differs:
          . tied deferred parameters with several terms per step: autograd sums a
            microbatch's two uses first and then accumulates, ((p + (a1 + b1)) + (a2 +
            b2)) ..., while backward_dw() lands one module at a time, (((p + a1) + b1)
            + a2) + b2 ... -- same terms, another association;
          . fused weights: main_grad is accumulated by the GEMM itself (beta = 1, FP32,
            products of BF16 inputs exact in FP32; the BLAS adds into C in its own
            order) while the reference rounds each product to the parameter dtype and
            adds it with AccumulateGrad; for BF16 the FP32 main_grad is compared against
            the BF16 reference .grad. Here the bound is 2 ulps per accumulated term
            (at least 4): with 6 accumulated K=8 GEMMs of random FP32 data, this
            reassociation reaches 7 FP32 ulps at v (measured over 2000 draws), past a
            flat 4;
      - parameters after SGD: bitwise where the gradient was bitwise; elsewhere the
        gradient tolerance carried through the update (lr * 4 ulp(v)) plus 2 ulp of the
        parameter for the rounding of p - lr * g.
    On CUDA graphed == eager stays bitwise (the graph replays the kernels eager runs),
    but eager vs reference is never bitwise: dwgraph's GEMMs (cuBLASLt) and torch.nn's
    (ATen's cuBLAS) may sum in another order. There every eager-vs-reference comparison
    (outputs, input gradients, parameter gradients, parameters after SGD) uses the ulp
    bound above with a floor relative to the magnitude, 1e-5 for FP32 and 1e-2 for BF16
    (``CUDA_REF_RTOL``, calibrated as explained there).
"""

from __future__ import annotations

import copy
import math
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

import dwgraph
from references import RefLNLinear, RefMLP, ulp

HIDDEN = 8
FFN = 12
ROWS = 8                 # rows per microbatch (= sum(M_SPLITS) for GroupedLinear)
M_SPLITS = [3, 0, 5]     # GroupedLinear row groups, one of them empty
LR = 0.1
STEPS = 3
N_MICRO_PIPELINE = 3
SEED = 20240611
# TransformerEngine's _order: +c forward of chunk c, -c its backward, -(c + 0.5) its backward-dw.
ORDER = [1, 2, 1, 2, 1, 2, -2, -1, -2.5, -1.5, -2, -1, -2.5, -1.5, -2, -1, -2.5, -1.5]

# How a graphed callable that holds two modules sharing a deferred parameter hands it
# over: "per_module" -- one contribution per (module, parameter), handed over in landing
# order, .grad += a; .grad += b, exactly what the eager modules do (dwgraph's behaviour);
# "per_callable" -- one summed contribution, .grad += (a + b), which would equal torch.nn's
# association instead and differ from eager in the last bits.
WITHIN_CALLABLE = "per_module"

SCHEDULES = ["sequential", "pipeline"]
TIES = ["within", "across", "untied"]
KINDS = ["linear", "mlp", "lnlinear", "grouped", "mlp_ckpt"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- model kinds
class GroupedBlock(torch.nn.Module):
    """GroupedLinear with fixed m_splits, so it is called (and graphed) as f(x)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x, M_SPLITS)


class RefGrouped(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.use_bias = bias
        for g in range(len(M_SPLITS)):
            setattr(self, f"weight{g}", torch.nn.Parameter(torch.zeros(HIDDEN, HIDDEN)))
            if bias:
                setattr(self, f"bias{g}", torch.nn.Parameter(torch.zeros(HIDDEN)))

    def forward(self, x):
        outs = []
        for g, rows in enumerate(torch.split(x, M_SPLITS, dim=0)):
            b = getattr(self, f"bias{g}") if self.use_bias else None
            outs.append(F.linear(rows, getattr(self, f"weight{g}"), b))
        return torch.cat(outs, dim=0)


def param_names(kind: str, bias: bool) -> List[str]:
    if kind == "linear":
        return ["weight"] + (["bias"] if bias else [])
    if kind in ("mlp", "mlp_ckpt"):
        return (["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc2_weight"]
                + (["fc1_bias", "fc2_bias"] if bias else []))
    if kind == "lnlinear":
        return ["layer_norm_weight", "layer_norm_bias", "weight"] + (["bias"] if bias else [])
    g = len(M_SPLITS)
    return [f"weight{i}" for i in range(g)] + ([f"bias{i}" for i in range(g)] if bias else [])


def is_weight(kind: str, name: str) -> bool:
    """Deferred weights (the fused ones under fuse_wgrad_accumulation)."""
    return name.startswith("weight") or name in ("fc1_weight", "fc2_weight")


def is_autograd_param(kind: str, name: str) -> bool:
    """Parameters whose gradient comes from the main backward, not backward_dw()."""
    return name.startswith("layer_norm")


def make_dw_leaf(kind: str, bias: bool, dtype, fused: bool, device: str = "cpu") -> torch.nn.Module:
    common = dict(delay_wgrad_compute=True, fuse_wgrad_accumulation=fused, dtype=dtype, device=device)
    if kind == "linear":
        return dwgraph.nn.Linear(HIDDEN, HIDDEN, bias, **common)
    if kind in ("mlp", "mlp_ckpt"):
        return dwgraph.nn.LayerNormMLP(HIDDEN, FFN, bias, eps=1e-5, checkpoint=kind == "mlp_ckpt", **common)
    if kind == "lnlinear":
        return dwgraph.nn.LayerNormLinear(HIDDEN, HIDDEN, 1e-5, bias=bias, **common)
    return GroupedBlock(dwgraph.nn.GroupedLinear(len(M_SPLITS), HIDDEN, HIDDEN, bias, **common))


def make_ref_leaf(kind: str, bias: bool, dtype, device: str = "cpu") -> torch.nn.Module:
    if kind == "linear":
        return torch.nn.Linear(HIDDEN, HIDDEN, bias=bias).to(device=device, dtype=dtype)
    if kind in ("mlp", "mlp_ckpt"):
        return RefMLP(HIDDEN, FFN, bias).to(device=device, dtype=dtype)
    if kind == "lnlinear":
        return RefLNLinear(HIDDEN, HIDDEN, bias).to(device=device, dtype=dtype)
    return RefGrouped(bias).to(device=device, dtype=dtype)


def dw_slot(kind: str, leaf: torch.nn.Module, name: str) -> Tuple[torch.nn.Module, str]:
    return (leaf.inner, name) if kind == "grouped" else (leaf, name)


def ref_slot(kind: str, leaf: torch.nn.Module, name: str) -> Tuple[torch.nn.Module, str]:
    if kind == "linear":
        return leaf, name
    if kind in ("mlp", "mlp_ckpt", "lnlinear"):
        return leaf.slots[name]
    return leaf, name


def get_p(slot):
    return getattr(*slot)


class Model:
    """One copy of the case's model: leaves, the callables made of them, and the list of
    unique parameters as (name-for-messages, kind-name, slot) in a fixed order."""

    def __init__(self, kind, bias, dtype, fused, tie, schedule, *, ref: bool, device: str = "cpu"):
        n_leaves = 4 if (tie == "within" and schedule == "pipeline") else 2
        names = param_names(kind, bias)
        if ref:
            self.leaves = [make_ref_leaf(kind, bias, dtype, device) for _ in range(n_leaves)]
            slot = lambda leaf, n: ref_slot(kind, leaf, n)  # noqa: E731
        else:
            self.leaves = [make_dw_leaf(kind, bias, dtype, fused, device) for _ in range(n_leaves)]
            slot = lambda leaf, n: dw_slot(kind, leaf, n)  # noqa: E731
        if tie in ("within", "across"):
            for src, dst in ((0, 1), (2, 3))[: n_leaves // 2]:
                for n in names:
                    setattr(*slot(self.leaves[dst], n), get_p(slot(self.leaves[src], n)))
        if tie == "within":
            self.callables = [torch.nn.Sequential(self.leaves[i], self.leaves[i + 1])
                              for i in range(0, n_leaves, 2)]
        else:
            self.callables = list(self.leaves)
        # Unique parameters, in a fixed order; `uses` counts how many leaves hold each.
        self.params: List[Tuple[str, str, Tuple[torch.nn.Module, str]]] = []
        self.uses: Dict[int, int] = {}
        for li, leaf in enumerate(self.leaves):
            for n in names:
                s = slot(leaf, n)
                p = get_p(s)
                if id(p) not in self.uses:
                    self.uses[id(p)] = 0
                    self.params.append((f"leaf{li}.{n}", n, s))
                self.uses[id(p)] += 1

    def param_list(self) -> List[torch.nn.Parameter]:
        return [get_p(s) for _, _, s in self.params]


def unit_dw_modules(callable_module) -> List[torch.nn.Module]:
    return [m for m in callable_module.modules()
            if isinstance(m, (dwgraph.nn.Linear, dwgraph.nn.LayerNormMLP, dwgraph.nn.LayerNormLinear,
                              dwgraph.nn.GroupedLinear))]


def eager_dw(callable_module):
    mods = unit_dw_modules(callable_module)
    assert mods

    def run():
        for m in mods:
            m.backward_dw()
    return run


# ----------------------------------------------------------------------------- comparisons
def assert_bitwise(actual, expected, what: str) -> None:
    if expected is None:
        assert actual is None, f"{what}: expected None, got a tensor"
        return
    assert actual is not None, f"{what}: None, expected a tensor"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal, max |diff| = {diff:.3e}")


def assert_close_ulps(actual, expected, dtype, what: str, n_ulps: int = 4, extra: float = 0.0,
                      scale: float | None = None) -> None:
    """|actual - expected| <= n_ulps * ulp(scale) + extra, scale = max|expected| by default."""
    assert actual is not None and expected is not None, f"{what}: missing tensor"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    a64, e64 = actual.double(), expected.double()
    if scale is None:
        scale = e64.abs().max().item()
    bound = n_ulps * ulp(scale, dtype) + extra
    diff = (a64 - e64).abs().max().item()
    assert diff <= bound, f"{what}: max |diff| {diff:.3e} > bound {bound:.3e} ({n_ulps} ulp {dtype})"


# Eager vs torch.nn on CUDA (module docstring): dwgraph's GEMMs are its own cuBLASLt
# calls and torch.nn's are ATen's cuBLAS / cuBLASLt calls, possibly with other algorithms
# and so another FP32 summation order, so the two can differ in the last bits of every
# GEMM result (and of everything computed from it) even where the CPU comparison is
# bitwise. The bound is relative to the magnitude of the reference (its largest element,
# or the largest value a gradient reaches while it accumulates): the CPU's ulp bound (4
# ulps of the magnitude, 2 per term for fused weights), and at least 1e-5 of it for FP32
# (a few rounding errors of K <= 12 products, carried through up to four GEMMs and two
# LayerNorms of a pipeline) or 1e-2 for BF16 (one flipped final rounding is up to 2**-7
# of the value; the 4-ulp bound is already 1.6-3.1e-2). Calibrated on the CPU by
# reversing the FP32 summation order of every reference GEMM (forward, dgrad, wgrad,
# bias grad) over the whole matrix: the largest difference is 1.5e-6 of the magnitude in
# FP32 (0.15 of the bound) and 9.9e-3 in BF16 (half the bound). Wrong results (a missing
# term, a wrong transpose, a lost accumulation) are off by O(1) of the magnitude.
CUDA_REF_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def ref_bound(dtype, scale: float, n_ulps: int, device: str) -> float:
    """Eager vs torch.nn bound at magnitude ``scale``: ``n_ulps`` ulps on the CPU; on CUDA
    at least ``CUDA_REF_RTOL`` of the magnitude."""
    bound = n_ulps * ulp(scale, dtype)
    if device != "cpu":
        bound = max(bound, CUDA_REF_RTOL[dtype] * scale)
    return bound


def assert_eager_vs_ref(actual, expected, dtype, what: str, *, device: str, exact: bool, n_ulps: int = 4,
                        scale: float | None = None) -> None:
    """Eager dwgraph vs torch.nn: on the CPU bitwise where ``exact``, else within
    ``n_ulps`` ulps of ``scale``; on CUDA within :func:`ref_bound` (never bitwise)."""
    if device == "cpu":
        if exact:
            assert_bitwise(actual, expected, what)
        else:
            assert_close_ulps(actual, expected, dtype, what, n_ulps=n_ulps, scale=scale)
        return
    assert actual is not None and expected is not None, f"{what}: missing tensor"
    assert actual.device == expected.device, f"{what}: on {actual.device}, torch.nn on {expected.device}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    a64, e64 = actual.double(), expected.double()
    if scale is None:
        scale = e64.abs().max().item()
    bound = ref_bound(dtype, scale, n_ulps, device)
    diff = (a64 - e64).abs().max().item()
    assert diff <= bound, (f"{what}: max |diff| {diff:.3e} > bound {bound:.3e} (CUDA, {dtype}, "
                           f"magnitude {scale:.3e})")


class ParamClass:
    """How one parameter's gradient is compared (module docstring)."""

    def __init__(self, *, fused_w: bool, eager_ref_exact: bool, graphed_per_callable: bool, terms: int):
        self.fused_w = fused_w
        # main_grad vs reference: 2 ulps per accumulated term, at least 4 (docstring).
        self.fused_ulps = max(4, 2 * terms)
        self.eager_ref_exact = eager_ref_exact
        self.graphed_per_callable = graphed_per_callable



def classify(model: "Model", kind, name, p, tie, fused, pre, n_micro) -> ParamClass:
    fused_w = fused and is_weight(kind, name)
    tied = model.uses[id(p)] > 1
    deferred = not is_autograd_param(kind, name)
    # Several terms land on the parameter in one step (a caller gradient, or another
    # microbatch), so association matters.
    several = pre or n_micro > 1
    reordered = tied and deferred and several
    return ParamClass(
        fused_w=fused_w,
        eager_ref_exact=not fused_w and not reordered,
        graphed_per_callable=not fused_w and deferred and tie == "within" and several and WITHIN_CALLABLE == "per_callable",
        terms=model.uses[id(p)] * n_micro + (1 if pre else 0),
    )


# ----------------------------------------------------------------------------- case setup
def case_kind(schedule, tie, fused, dtype_id, bias) -> str:
    """The five kinds rotate so that each meets both schedules, every tie mode, both wgrad
    modes and both dtypes (bias alternates)."""
    i = SCHEDULES.index(schedule) + 2 * TIES.index(tie) + (1 if fused else 0) + (1 if dtype_id == "bf16" else 0)
    if not bias:
        i += 1
    return KINDS[i % len(KINDS)]


def make_inputs(dtype, n_micro, device="cpu"):
    # Drawn on the CPU and moved: the CPU cases see exactly the values they always did.
    return [(torch.randn(ROWS, HIDDEN).to(device=device, dtype=dtype), torch.randn(ROWS, HIDDEN).to(device))
            for _ in range(n_micro)]


def loss_of(y, w):
    return (y.float() * w).sum()


def run_sequential(calls, dws, inputs, after_backward=None):
    (x_val, w), = inputs
    x = x_val.clone().requires_grad_(True)
    h = x
    for c in calls:
        h = c(h)
    loss_of(h, w).backward()
    if after_backward is not None:
        after_backward()
    for dw in dws:
        dw()
    return [h.detach().clone()], [x.grad]


def run_pipeline(c1, c2, dw1, dw2, inputs, after_backward=None):
    xs = [v.clone().requires_grad_(True) for v, _ in inputs]
    ys = []
    for m in range(len(inputs)):
        h = c1[m](xs[m])
        ys.append(c2[m](h))
    for m, (_, w) in enumerate(inputs):
        loss_of(ys[m], w).backward()
        if after_backward is not None:
            after_backward()
        if dw2 is not None:
            dw2[m]()
            dw1[m]()
    return [y.detach().clone() for y in ys], [x.grad for x in xs]


def fused_params(model: Model, kind, fused):
    return [get_p(s) for _, n, s in model.params if fused and is_weight(kind, n)]


def prefill(models, kind, fused, dtype, gen_seed):
    """Adds the same nonzero 'earlier accumulation' to every model's caller gradients:
    .grad (initialised when None, added otherwise, as AccumulateGrad would) and, for
    fused weights, main_grad in place (graphed/eager) or .grad (reference, models[2])."""
    g = torch.Generator().manual_seed(gen_seed)
    for entries in zip(*(m.params for m in models)):
        name = entries[0][1]
        p0 = get_p(entries[0][2])
        val = torch.randn(p0.shape, generator=g).to(device=p0.device, dtype=dtype)
        for mi, (_, _, slot) in enumerate(entries):
            p = get_p(slot)
            if fused and is_weight(kind, name) and mi != 2:
                p.main_grad.add_(val.float())
            elif p.grad is None:
                p.grad = val.clone()
            else:
                p.grad.add_(val)


def snapshot(model: Model):
    out = []
    for _, _, s in model.params:
        p = get_p(s)
        mg = getattr(p, "main_grad", None)
        out.append((p.detach().clone(), p.grad, None if p.grad is None else p.grad.clone(),
                    mg, None if mg is None else mg.clone()))
    return out


# ----------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("pre", [True, False], ids=["pregrad", "nograd"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "grad"])
@pytest.mark.parametrize("tie", TIES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeroed"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_graphed_matches_eager_and_reference(device, schedule, set_to_none, dtype_id, bias, tie, fused, pre):
    dtype = DTYPES[dtype_id]
    kind = case_kind(schedule, tie, fused, dtype_id, bias)
    n_micro = 1 if schedule == "sequential" else N_MICRO_PIPELINE
    names = param_names(kind, bias)

    torch.manual_seed(SEED)
    graphed_m = Model(kind, bias, dtype, fused, tie, schedule, ref=False, device=device)
    torch.manual_seed(SEED)
    eager_m = Model(kind, bias, dtype, fused, tie, schedule, ref=False, device=device)
    torch.manual_seed(SEED)
    ref_m = Model(kind, bias, dtype, fused, tie, schedule, ref=True, device=device)
    with torch.no_grad():
        for (_, _, sd), (_, _, se), (_, _, sr) in zip(graphed_m.params, eager_m.params, ref_m.params):
            assert torch.equal(get_p(sd), get_p(se)), "same seed must give the same parameters"
            get_p(sr).copy_(get_p(se))
    assert len(graphed_m.params) == len(ref_m.params) == len(eager_m.params)
    for m in (graphed_m, eager_m, ref_m):
        for label, _, s in m.params:
            assert get_p(s).device.type == device, f"{label} is on {get_p(s).device}, the case runs on {device}"
    models = (graphed_m, eager_m, ref_m)
    opts = [torch.optim.SGD(m.param_list(), lr=LR) for m in models]

    # Step 0's pre-existing gradients are there before capture.
    if pre:
        prefill(models, kind, fused, dtype, SEED)

    # ---- capture once, before the loop
    before = snapshot(graphed_m)
    if schedule == "sequential":
        sample = [(torch.randn(ROWS, HIDDEN, dtype=dtype, device=device, requires_grad=True),)
                  for _ in graphed_m.callables]
        g = dwgraph.make_graphed_callables(tuple(graphed_m.callables), tuple(sample))
        assert isinstance(g, tuple) and len(g) == len(graphed_m.callables)
    else:
        sample = [(torch.randn(ROWS, HIDDEN, dtype=dtype, device=device, requires_grad=True),)
                  for _ in range(2 * n_micro)]
        g = dwgraph.make_graphed_callables(tuple(graphed_m.callables), tuple(sample), order=ORDER,
                                           num_layers_per_chunk=[1, 1])
        assert isinstance(g, tuple) and len(g) == 2 * n_micro
    after = snapshot(graphed_m)
    for (label, _, _), b, a, (_, _, se) in zip(graphed_m.params, before, after, eager_m.params):
        pe = get_p(se)
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], pe.detach()), f"capture changed {label}"
        assert a[1] is b[1], f"capture replaced the .grad tensor of {label}"
        assert_bitwise(a[2], b[2], f"capture: .grad of {label}")
        assert_bitwise(a[2], pe.grad, f"capture: .grad of {label} vs eager")
        assert a[3] is b[3], f"capture replaced main_grad of {label}"
        assert_bitwise(a[4], b[4], f"capture: main_grad of {label}")

    if schedule == "sequential":
        g_calls, g_dws = list(g), [gg.backward_dw for gg in g]
        e_calls, e_dws = eager_m.callables, [eager_dw(c) for c in eager_m.callables]
    else:
        g_c1, g_c2 = g[:n_micro], g[n_micro:]
        e_c1, e_c2 = [eager_m.callables[0]] * n_micro, [eager_m.callables[1]] * n_micro

    for step in range(STEPS):
        if step > 0:
            for m, opt in zip(models, opts):
                opt.zero_grad(set_to_none=set_to_none)
            for p in fused_params(graphed_m, kind, fused) + fused_params(eager_m, kind, fused):
                p.main_grad.zero_()
            if pre:
                prefill(models, kind, fused, dtype, SEED + step)
        inputs = make_inputs(dtype, n_micro, device)
        what = f"step {step} ({kind})"
        # The largest magnitude each reference gradient reaches while it accumulates
        # (the caller's gradient, then after every microbatch): the scale of the ulp
        # tolerance (module docstring).
        peak = {label: 0.0 for label, _, _ in ref_m.params}

        def track_peak():
            for label, _, sr in ref_m.params:
                gr = get_p(sr).grad
                if gr is not None:
                    peak[label] = max(peak[label], gr.double().abs().max().item())
        track_peak()

        if schedule == "sequential":
            y_g, xg_g = run_sequential(g_calls, g_dws, inputs)
            y_e, xg_e = run_sequential(e_calls, e_dws, inputs)
            y_r, xg_r = run_sequential(ref_m.callables, [], inputs, track_peak)
        else:
            y_g, xg_g = run_pipeline(g_c1, g_c2, [gg.backward_dw for gg in g_c1], [gg.backward_dw for gg in g_c2],
                                     inputs)
            y_e, xg_e = run_pipeline(e_c1, e_c2, [eager_dw(eager_m.callables[0])] * n_micro,
                                     [eager_dw(eager_m.callables[1])] * n_micro, inputs)
            y_r, xg_r = run_pipeline(ref_m.callables[:1] * n_micro, ref_m.callables[1:] * n_micro, None, None,
                                     inputs, track_peak)

        # Outputs and input gradients: graphed == eager, bitwise; eager == reference,
        # bitwise on the CPU, within ref_bound on CUDA.
        for i in range(n_micro):
            assert_bitwise(y_g[i], y_e[i], f"{what}: graphed output {i}")
            assert_bitwise(xg_g[i], xg_e[i], f"{what}: graphed input grad {i}")
            assert_eager_vs_ref(y_e[i], y_r[i], dtype, f"{what}: eager output {i} vs torch.nn",
                                device=device, exact=True)
            assert_eager_vs_ref(xg_e[i], xg_r[i], dtype, f"{what}: eager input grad {i} vs torch.nn",
                                device=device, exact=True)
        # Parameter gradients.
        classes = {}
        for (label, name, sg), (_, _, se), (_, _, sr) in zip(graphed_m.params, eager_m.params, ref_m.params):
            pg, pe, pr = get_p(sg), get_p(se), get_p(sr)
            c = classify(graphed_m, kind, name, pg, tie, fused, pre, n_micro)
            classes[label] = c
            if c.fused_w:
                assert pg.main_grad.dtype == torch.float32 and pe.main_grad.dtype == torch.float32
                assert_bitwise(pg.main_grad, pe.main_grad, f"{what}: graphed {label}.main_grad")
                assert_bitwise(pg.grad, pe.grad, f"{what}: graphed {label}.grad (fused weight)")
                assert getattr(pg, "grad_added_to_main_grad", False) is True, \
                    f"{what}: graphed {label}.grad_added_to_main_grad not set"
                assert_eager_vs_ref(pe.main_grad, pr.grad.float(), dtype, f"{what}: eager {label}.main_grad vs torch.nn",
                                    device=device, exact=False, scale=peak[label], n_ulps=c.fused_ulps)
                continue
            assert pg.grad is not None and pe.grad is not None, f"{what}: {label} has no gradient"
            if c.graphed_per_callable:
                # One contribution per parameter per graph (SPEC C4): the graphed callable
                # hands over a + b in one add, as autograd accumulates; eager lands them
                # one module at a time (module docstring, WITHIN_CALLABLE).
                assert_bitwise(pg.grad, pr.grad, f"{what}: graphed {label}.grad vs torch.nn (per-callable sum)")
                assert_close_ulps(pg.grad, pe.grad, dtype, f"{what}: graphed {label}.grad vs eager",
                                  scale=peak[label])
            else:
                assert_bitwise(pg.grad, pe.grad, f"{what}: graphed {label}.grad")
            assert_eager_vs_ref(pe.grad, pr.grad, dtype, f"{what}: eager {label}.grad vs torch.nn",
                                device=device, exact=c.eager_ref_exact, scale=peak[label])

        # ---- optimizer step. Fused weights step on main_grad (cast to the parameter
        # dtype), as a Megatron-style optimizer does.
        for m in (graphed_m, eager_m):
            for p in fused_params(m, kind, fused):
                p.grad = p.main_grad.to(p.dtype)
        bounds = {label: LR * ref_bound(dtype, peak[label], classes[label].fused_ulps if classes[label].fused_w else 4,
                                        device)
                  for label, _, _ in ref_m.params}
        for opt in opts:
            opt.step()
        for (label, name, sg), (_, _, se), (_, _, sr) in zip(graphed_m.params, eager_m.params, ref_m.params):
            pg, pe, pr = get_p(sg), get_p(se), get_p(sr)
            c = classes[label]
            if c.graphed_per_callable:
                assert_close_ulps(pg.detach(), pe.detach(), dtype, f"{what}: graphed {label} after SGD vs eager",
                                  n_ulps=2, extra=bounds[label])
                assert_bitwise(pg.detach(), pr.detach(), f"{what}: graphed {label} after SGD vs torch.nn")
            else:
                assert_bitwise(pg.detach(), pe.detach(), f"{what}: graphed {label} after SGD")
            if c.eager_ref_exact and device == "cpu":
                assert_bitwise(pe.detach(), pr.detach(), f"{what}: eager {label} after SGD vs torch.nn")
            else:
                assert_close_ulps(pe.detach(), pr.detach(), dtype, f"{what}: eager {label} after SGD vs torch.nn",
                                  n_ulps=2, extra=bounds[label])
        # Re-synchronise so the next step compares gradients on identical weights: the
        # eager copy and the reference take the graphed values where they may differ in
        # the last bits (graphed parameters are updated in place and never replaced).
        with torch.no_grad():
            for (_, _, sg), (_, _, se), (_, _, sr) in zip(graphed_m.params, eager_m.params, ref_m.params):
                get_p(se).copy_(get_p(sg))
                get_p(sr).copy_(get_p(sg))
        if tie != "untied":
            for m in (graphed_m, eager_m):
                assert len(m.params) < len(m.leaves) * len(names), "ties were lost"


def test_matrix_covers_every_kind_in_every_mode():
    """The kind rotation really puts every kind in both schedules, every tie mode, both
    wgrad modes and both dtypes."""
    seen = {}
    for schedule in SCHEDULES:
        for tie in TIES:
            for fused in (True, False):
                for dtype_id in DTYPES:
                    for bias in (True, False):
                        k = case_kind(schedule, tie, fused, dtype_id, bias)
                        for axis in (("schedule", schedule), ("tie", tie), ("fused", fused), ("dtype", dtype_id)):
                            seen.setdefault(k, set()).add(axis)
    for k in KINDS:
        for axis in ([("schedule", s) for s in SCHEDULES] + [("tie", t) for t in TIES]
                     + [("fused", True), ("fused", False)] + [("dtype", d) for d in DTYPES]):
            assert axis in seen[k], f"{k} never meets {axis}"


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_a_recurrent_layer_whose_kernel_branches_on_grad_mode_replays_as_eager(kind):
    # oneDNN's RNN kernels keep their training workspace only with grad on: a host-graph
    # replay runs each kernel in the grad mode it was captured in (OpRecord::grad_enabled);
    # under no_grad the LSTM's replay raised (a workspace without storage).
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(4, 4, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]

    torch.manual_seed(0)
    eager = Net()
    graphed = copy.deepcopy(eager)
    dwgraph.make_graphed_callables(graphed, (torch.randn(2, 3, 4, requires_grad=True),))
    for step in range(3):
        x = torch.randn(2, 3, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        ye, yg = eager(x), graphed(x2)
        ye.square().sum().backward()
        yg.square().sum().backward()
        assert torch.equal(ye, yg) and torch.equal(x.grad, x2.grad), f"step {step}"
        for (n, a), b in zip(eager.named_parameters(), graphed.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}: {n}.grad"


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
@pytest.mark.parametrize("call_grad", [True, False], ids=["called_with_grad", "called_under_no_grad"])
@pytest.mark.parametrize("capture_grad", [True, False], ids=["captured_with_grad", "captured_under_no_grad"])
def test_a_call_in_another_grad_mode_than_its_capture_is_eager_exact(capture_grad, call_grad, trainable):
    # oneDNN's RNN takes its training kernel whenever grad mode is on (whether or not
    # anything requires grad), and its last bits differ from the inference kernel: a call
    # in the grad mode it was captured in replays, one in the other mode runs eagerly
    # (Note [Calls eager autograd would differentiate further]).
    torch.manual_seed(0)
    eager = torch.nn.LSTM(4, 4, num_layers=2, bidirectional=True, batch_first=True)
    for p in eager.parameters():
        p.requires_grad_(trainable)
    graphed = copy.deepcopy(eager)
    with torch.set_grad_enabled(capture_grad):
        g = dwgraph.make_graphed_callables(graphed, (torch.randn(2, 3, 4),))
    with torch.set_grad_enabled(call_grad):
        for step in range(2):
            x = torch.randn(2, 3, 4)
            ye, yg = eager(x)[0], g(x)[0]
            assert torch.equal(ye, yg), f"step {step}: {(ye - yg).abs().max().item():.3g}"
            assert ye.requires_grad == yg.requires_grad
            if ye.requires_grad:
                ye.square().sum().backward()
                yg.square().sum().backward()
                for (n, a), b in zip(eager.named_parameters(), graphed.parameters()):
                    assert torch.equal(a.grad, b.grad), f"step {step}: {n}.grad"
