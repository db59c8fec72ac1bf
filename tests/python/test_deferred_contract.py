"""SPEC C1 (deferred accumulation) of ``dwgraph.nn`` against plain ``torch.nn`` autograd.

Every case builds a two-module model ``x -> a -> b`` of one kind with
``delay_wgrad_compute=True`` and an equivalent plain ``torch.nn`` model with the same
weights, then runs two training steps on both. Per microbatch: forward, loss.backward();
after all the backwards, ``backward_dw()`` once per microbatch per module, in the case's
module order (``(a, b)`` or ``(b, a)``). Between the steps: ``SGD(lr=0.1).step()`` and
``zero_grad(set_to_none=...)``. The matrix:

  kind       Linear | LayerNormMLP | LayerNormMLP(checkpoint=True) | the same with
             normalization="RMSNorm" | LayerNormLinear (LayerNorm | RMSNorm) |
             GroupedLinear (weight0.., bias0..) | GroupedLinear packed
  tying      tied (b's deferred parameters *are* a's) | independent
  drain      (a, b) | (b, a)
  micro      1 | 3 microbatches
  zero_grad  set_to_none=True | set_to_none=False
  bias       with | without
  dtype      float32 | bfloat16

What each case asserts:
  * after every main backward and before any backward_dw(): the deferred parameters'
    ``.grad`` is untouched (still ``None``, or still the same zeroed tensor after
    ``zero_grad(set_to_none=False)``: the backward returned no buffer for them), and each
    module's ``num_queued_wgrad_units()`` equals the number of backwards so far;
  * after draining: 0 queued units, and one more ``backward_dw()`` raises
    ``dwgraph.GraphStateError`` naming ``backward_dw`` and saying nothing is deferred;
  * step 1 and step 2: every parameter gradient (deferred and not, e.g. LayerNormMLP's
    LayerNorm) and every microbatch input gradient equal the torch.nn reference's (see
    the tolerances below); the SGD-updated weights agree too;
  * step 2: every gradient equals, bit for bit in every dtype, that of a FRESH dwgraph
    model built from the post-step-1 weights and run once on the same step-2 inputs with
    the same schedule -- so nothing of step 1 leaks into step 2 under either zero_grad mode.

Tolerances (torch.equal unless stated):
  * Exact wherever both sides add the same terms in the same order -- in both dtypes.
    Every GEMM is the same ATen CPU call torch.nn makes (mm / addmm on the same operands,
    rounded once to the output dtype), the bias gradient is the same column sum, a
    gradient that lands on a .grad of None is taken as is, and a later one is added by
    one ``add_`` in the gradient's dtype, exactly as AccumulateGrad does. That covers
    every single-microbatch case (a tied parameter receives exactly two terms, whose sum
    is the same in either order: the main backward and the backward_dw() drain order do
    not matter), every independent multi-microbatch case (g1 + g2 + g3 in microbatch order
    on both sides), every input gradient, and the LayerNorm parameters (plain autograd in
    both models). A checkpointed LayerNormMLP recomputes its activations in the backward
    from the same values with the same kernels, so it is exact wherever the plain one is.
  * Tied deferred parameters with 3 microbatches: |dwgraph - ref| <= 4 ulp(max |ref|) per
    tensor, ulp(v) = 2**(floor(log2 v) - 7) for bfloat16 and 2**(floor(log2 v) - 23) for
    float32 (SPEC: "a few BF16 ulps at the gradient's magnitude where summation order
    differs"; the same count of FP32 ulps for FP32). Autograd adds each microbatch's two
    contributions first, (a1 + b1) + (a2 + b2) + (a3 + b3), while backward_dw() lands
    them one at a time, ((((a1 + b1) + a2) + b2) + a3) + b3: the same six terms in another
    association, so the last bits differ (up to 2-3 ulps observed here, with partial sums
    larger than the final value). The SGD-updated weights of those parameters get the
    same tolerance.
  * step 2 versus the fresh model: exact in every dtype (same code path, same inputs).

Two smaller matrices check the FIFO contract directly (each backward_dw() lands exactly
the oldest queued backward's contribution, and nothing of the other module's) and two
other drain schedules: right after each backward, and module by module.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F

import dwgraph
from references import RefLNLinear, RefMLP, ulp

HIDDEN = 8          # in == out for Linear / Grouped, hidden for LayerNormMLP
FFN = 12            # LayerNormMLP's ffn_hidden_size
ROWS = 5            # rows per microbatch for Linear / LayerNormMLP
M_SPLITS = [3, 0, 5]  # grouped row splits, with an empty group
LR = 0.1

KINDS = ["linear", "mlp", "mlp_ckpt", "mlp_ckpt_rms", "lnlinear", "lnlinear_rms", "grouped", "grouped_packed"]
MLPS = ("mlp", "mlp_ckpt", "mlp_ckpt_rms")


def normalization(kind: str) -> str:
    return "RMSNorm" if kind.endswith("_rms") else "LayerNorm"
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


# --------------------------------------------------------------------------- model kinds
def deferred_names(kind: str, bias: bool) -> List[str]:
    """The parameters whose gradients are deferred to backward_dw() (and that get tied)."""
    if kind in ("linear", "lnlinear", "lnlinear_rms", "grouped_packed"):
        return ["weight"] + (["bias"] if bias else [])
    if kind in MLPS:
        return ["fc1_weight", "fc2_weight"] + (["fc1_bias", "fc2_bias"] if bias else [])
    g = len(M_SPLITS)
    return [f"weight{i}" for i in range(g)] + ([f"bias{i}" for i in range(g)] if bias else [])


def param_names(kind: str, bias: bool) -> List[str]:
    """All parameters of one module (deferred ones plus the LayerNorm's)."""
    if kind in MLPS or kind.startswith("lnlinear"):
        extra = ["layer_norm_weight"] + (["layer_norm_bias"] if normalization(kind) == "LayerNorm" else [])
    else:
        extra = []
    return deferred_names(kind, bias) + extra


def make_dw(kind: str, bias: bool, dtype: torch.dtype) -> torch.nn.Module:
    common = dict(delay_wgrad_compute=True, dtype=dtype)
    if kind == "linear":
        return dwgraph.nn.Linear(HIDDEN, HIDDEN, bias, **common)
    if kind in MLPS:
        return dwgraph.nn.LayerNormMLP(HIDDEN, FFN, bias, eps=1e-5, checkpoint=kind.startswith("mlp_ckpt"),
                                       normalization=normalization(kind), **common)
    if kind.startswith("lnlinear"):
        return dwgraph.nn.LayerNormLinear(HIDDEN, HIDDEN, 1e-5, bias=bias, normalization=normalization(kind), **common)
    return dwgraph.nn.GroupedLinear(len(M_SPLITS), HIDDEN, HIDDEN, bias,
                                    packed_weights=(kind == "grouped_packed"), **common)


class RefLinear(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN, bias=bias)
        self.slots = {"weight": (self.lin, "weight"), "bias": (self.lin, "bias")}

    def forward(self, x):
        return self.lin(x)


class RefGrouped(torch.nn.Module):
    """Per-group ``F.linear`` over the row splits; discrete (weight0..) or packed weights."""

    def __init__(self, bias: bool, packed: bool):
        super().__init__()
        g = len(M_SPLITS)
        self.packed, self.use_bias = packed, bias
        if packed:
            self.weight = torch.nn.Parameter(torch.zeros(g, HIDDEN, HIDDEN))
            self.bias = torch.nn.Parameter(torch.zeros(g, HIDDEN)) if bias else None
            names = ["weight", "bias"]
        else:
            for i in range(g):
                setattr(self, f"weight{i}", torch.nn.Parameter(torch.zeros(HIDDEN, HIDDEN)))
                if bias:
                    setattr(self, f"bias{i}", torch.nn.Parameter(torch.zeros(HIDDEN)))
            names = [f"weight{i}" for i in range(g)] + [f"bias{i}" for i in range(g)]
        self.slots = {n: (self, n) for n in names}

    def forward(self, x, m_splits):
        outs = []
        for g, rows in enumerate(torch.split(x, list(m_splits), dim=0)):
            if self.packed:
                w = self.weight[g]
                b = self.bias[g] if self.use_bias else None
            else:
                w = getattr(self, f"weight{g}")
                b = getattr(self, f"bias{g}") if self.use_bias else None
            outs.append(F.linear(rows, w, b))
        return torch.cat(outs, dim=0)


def make_ref(kind: str, bias: bool) -> torch.nn.Module:
    if kind == "linear":
        return RefLinear(bias)
    if kind in MLPS:
        return RefMLP(HIDDEN, FFN, bias, normalization(kind))
    if kind.startswith("lnlinear"):
        return RefLNLinear(HIDDEN, HIDDEN, bias, normalization=normalization(kind))
    return RefGrouped(bias, packed=(kind == "grouped_packed"))


def ref_param(ref: torch.nn.Module, name: str) -> torch.nn.Parameter:
    owner, attr = ref.slots[name]
    return getattr(owner, attr)


def set_ref_param(ref: torch.nn.Module, name: str, p: torch.nn.Parameter) -> None:
    owner, attr = ref.slots[name]
    setattr(owner, attr, p)


def tie(kind: str, bias: bool, a, b, *, ref: bool = False) -> None:
    """Makes b's deferred parameters the very Parameter objects of a."""
    for name in deferred_names(kind, bias):
        if ref:
            set_ref_param(b, name, ref_param(a, name))
        else:
            setattr(b, name, getattr(a, name))


def build_dw_pair(kind, bias, dtype, tied, src=None):
    """Two dwgraph modules; with ``src`` (a dwgraph pair) their values are copied from it."""
    a, b = make_dw(kind, bias, dtype), make_dw(kind, bias, dtype)
    if tied:
        tie(kind, bias, a, b)
    if src is not None:
        with torch.no_grad():
            for dst_m, src_m in zip((a, b), src):
                for name in param_names(kind, bias):
                    getattr(dst_m, name).copy_(getattr(src_m, name))
    for m in (a, b):
        for p in m.parameters():
            assert p.grad is None
    return a, b


def build_ref_pair(kind, bias, dtype, tied, src):
    a, b = make_ref(kind, bias).to(dtype), make_ref(kind, bias).to(dtype)
    if tied:
        tie(kind, bias, a, b, ref=True)
    sync_ref(kind, bias, (a, b), src)
    return a, b


def sync_ref(kind, bias, ref_pair, dw_pair) -> None:
    with torch.no_grad():
        for r, d in zip(ref_pair, dw_pair):
            for name in param_names(kind, bias):
                ref_param(r, name).copy_(getattr(d, name))


def unique_params(modules) -> List[torch.nn.Parameter]:
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def call(kind, module, x):
    return module(x, M_SPLITS) if kind.startswith("grouped") else module(x)


def make_inputs(kind, dtype, n_micro) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per microbatch: the input values and the fixed FP32 weights of the loss."""
    rows = sum(M_SPLITS) if kind.startswith("grouped") else ROWS
    return [(torch.randn(rows, HIDDEN).to(dtype), torch.randn(rows, HIDDEN)) for _ in range(n_micro)]


def microbatch_loss(out, loss_w):
    return (out.float() * loss_w).sum()


# ------------------------------------------------------------------------------ runners
def run_ref(kind, pair, inputs) -> List[torch.Tensor]:
    """Plain autograd: forward + backward per microbatch. Returns the input gradients."""
    a, b = pair
    x_grads = []
    for x_val, loss_w in inputs:
        x = x_val.clone().requires_grad_(True)
        microbatch_loss(call(kind, b, call(kind, a, x)), loss_w).backward()
        x_grads.append(x.grad)
    return x_grads


def run_dw(kind, bias, pair, inputs, order, *, check_protocol=True) -> List[torch.Tensor]:
    """All backwards first, then backward_dw() once per microbatch per module in ``order``
    (indices into ``pair``). Checks the C1 protocol on the way. Returns the input grads."""
    a, b = pair
    deferred = [getattr(m, n) for m in pair for n in deferred_names(kind, bias)]
    before = [(p.grad, None if p.grad is None else p.grad.clone()) for p in deferred]
    x_grads = []
    for i, (x_val, loss_w) in enumerate(inputs):
        x = x_val.clone().requires_grad_(True)
        microbatch_loss(call(kind, b, call(kind, a, x)), loss_w).backward()
        x_grads.append(x.grad)
        if check_protocol:
            for p, (g0, v0) in zip(deferred, before):
                if g0 is None:
                    assert p.grad is None, "main backward produced a .grad for a deferred parameter"
                else:
                    assert p.grad is g0 and torch.equal(p.grad, v0), \
                        "main backward touched the .grad of a deferred parameter"
            assert [m.num_queued_wgrad_units() for m in pair] == [i + 1, i + 1]
    for _ in inputs:
        for j in order:
            pair[j].backward_dw()
    if check_protocol:
        assert [m.num_queued_wgrad_units() for m in pair] == [0, 0]
        for m in pair:
            with pytest.raises(dwgraph.GraphStateError) as err:
                m.backward_dw()
            msg = str(err.value)
            assert "backward_dw" in msg and "no deferred" in msg, msg
            assert m.num_queued_wgrad_units() == 0
    for p in deferred:
        assert p.grad is not None, "backward_dw() left a deferred parameter without .grad"
    return x_grads


# --------------------------------------------------------------------------- comparisons
def assert_grad_matches(actual, expected, *, exact: bool, what: str, n_ulps: int = 4) -> None:
    assert actual is not None, f"{what}: no gradient"
    assert expected is not None, f"{what}: reference has no gradient"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype} {tuple(actual.shape)} vs ref {expected.dtype} {tuple(expected.shape)}"
    if exact:
        if not torch.equal(actual, expected):
            diff = (actual.double() - expected.double()).abs().max().item()
            raise AssertionError(f"{what}: not bit-exact, max |diff| = {diff:.3e}")
        return
    act64, exp64 = actual.double(), expected.double()
    bound = n_ulps * ulp(exp64.abs().max().item(), expected.dtype)
    diff = (act64 - exp64).abs().max().item()
    assert diff <= bound, f"{what}: max |diff| {diff:.3e} > {n_ulps} ulp = {bound:.3e}"


def compare_grads(kind, bias, dw_pair, ref_pair, dw_xg, ref_xg, reordered, *, what) -> None:
    """dwgraph vs torch.nn: exact, except the parameters in ``reordered`` (ulp tolerance)."""
    for tag, d, r in zip("ab", dw_pair, ref_pair):
        for name in param_names(kind, bias):
            assert_grad_matches(getattr(d, name).grad, ref_param(r, name).grad,
                                exact=name not in reordered, what=f"{what}: {tag}.{name}.grad")
    for i, (gd, gr) in enumerate(zip(dw_xg, ref_xg)):
        assert_grad_matches(gd, gr, exact=True, what=f"{what}: input grad of microbatch {i}")


def compare_dw_dw(kind, bias, pair, fresh, xg, fresh_xg, what) -> None:
    for tag, d, f in zip("ab", pair, fresh):
        for name in param_names(kind, bias):
            assert_grad_matches(getattr(d, name).grad, getattr(f, name).grad, exact=True,
                                what=f"{what}: {tag}.{name}.grad")
    for i, (g1, g2) in enumerate(zip(xg, fresh_xg)):
        assert_grad_matches(g1, g2, exact=True, what=f"{what}: input grad of microbatch {i}")


# ------------------------------------------------------------------------------ the matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("n_micro", [1, 3], ids=["mb1", "mb3"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["drain_ab", "drain_ba"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "independent"])
@pytest.mark.parametrize("kind", KINDS)
def test_deferred_matches_autograd_over_two_steps(kind, tied, order, n_micro, set_to_none, bias, dtype):
    torch.manual_seed(1234)
    # Only these gradients are summed in another order than autograd's (module docstring).
    reordered = set(deferred_names(kind, bias)) if (tied and n_micro > 1) else set()

    dw = build_dw_pair(kind, bias, dtype, tied)
    ref = build_ref_pair(kind, bias, dtype, tied, dw)
    opt_dw = torch.optim.SGD(unique_params(dw), lr=LR)
    opt_ref = torch.optim.SGD(unique_params(ref), lr=LR)

    # ---- step 1
    inputs1 = make_inputs(kind, dtype, n_micro)
    xg_dw = run_dw(kind, bias, dw, inputs1, order)
    xg_ref = run_ref(kind, ref, inputs1)
    compare_grads(kind, bias, dw, ref, xg_dw, xg_ref, reordered, what="step 1")
    opt_dw.step()
    opt_ref.step()
    for tag, d, r in zip("ab", dw, ref):
        for name in param_names(kind, bias):
            assert_grad_matches(getattr(d, name).detach(), ref_param(r, name).detach(),
                                exact=name not in reordered, what=f"after SGD step 1: {tag}.{name}")
    opt_dw.zero_grad(set_to_none=set_to_none)
    opt_ref.zero_grad(set_to_none=set_to_none)
    for p in unique_params(dw):
        assert (p.grad is None) if set_to_none else (p.grad is not None and not p.grad.any())
    # Step 2 compares gradients on identical weights: where step 1 is only within a
    # tolerance the updated weights may differ in the last bit, so take dwgraph's.
    sync_ref(kind, bias, ref, dw)
    # The fresh model: dwgraph modules built from the post-step-1 weights, no .grad.
    fresh = build_dw_pair(kind, bias, dtype, tied, src=dw)

    # ---- step 2
    inputs2 = make_inputs(kind, dtype, n_micro)
    xg_dw = run_dw(kind, bias, dw, inputs2, order)
    xg_fresh = run_dw(kind, bias, fresh, inputs2, order)
    xg_ref = run_ref(kind, ref, inputs2)
    compare_dw_dw(kind, bias, dw, fresh, xg_dw, xg_fresh, what="step 2 vs fresh model")
    compare_grads(kind, bias, dw, ref, xg_dw, xg_ref, reordered, what="step 2")
    if tied:
        for name in deferred_names(kind, bias):
            assert getattr(dw[0], name) is getattr(dw[1], name)


# ------------------------------------------------------------------ FIFO / drain variants
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_backward_dw_lands_the_oldest_backward(kind, bias, dtype):
    """Three backwards, then one backward_dw() at a time: after k calls on module a its
    deferred gradients are exactly the sum of microbatches 1..k (FIFO, one backward's
    worth per call), and module b is untouched until its own calls."""
    torch.manual_seed(4321)
    dw = build_dw_pair(kind, bias, dtype, tied=False)
    inputs = make_inputs(kind, dtype, 3)
    for x_val, loss_w in inputs:
        x = x_val.clone().requires_grad_(True)
        microbatch_loss(call(kind, dw[1], call(kind, dw[0], x)), loss_w).backward()
    ref = build_ref_pair(kind, bias, dtype, tied=False, src=dw)
    for k in range(1, 4):
        # Reference: plain autograd over microbatches 1..k, accumulated in the same order.
        run_ref(kind, ref, inputs[k - 1:k])
        dw[0].backward_dw()
        assert dw[0].num_queued_wgrad_units() == 3 - k
        assert dw[1].num_queued_wgrad_units() == 3
        for name in deferred_names(kind, bias):
            # Independent modules, same accumulation order as autograd: exact in both dtypes.
            assert_grad_matches(getattr(dw[0], name).grad, ref_param(ref[0], name).grad,
                                exact=True, what=f"a.{name}.grad after {k} backward_dw()")
            assert getattr(dw[1], name).grad is None
    for k in range(3):
        dw[1].backward_dw()
    for name in deferred_names(kind, bias):
        assert_grad_matches(getattr(dw[1], name).grad, ref_param(ref[1], name).grad,
                            exact=True, what=f"b.{name}.grad")
    with pytest.raises(dwgraph.GraphStateError, match="no deferred"):
        dw[1].backward_dw()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("schedule", ["after_each_backward", "module_major"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["drain_ab", "drain_ba"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "independent"])
@pytest.mark.parametrize("kind", KINDS)
def test_other_drain_schedules(kind, tied, order, schedule, dtype):
    """Three microbatches, drained either right after each backward (both modules, in
    ``order``) or, after all backwards, module by module (all of the first module's
    units, then all of the other's)."""
    torch.manual_seed(99)
    bias = True
    dw = build_dw_pair(kind, bias, dtype, tied)
    ref = build_ref_pair(kind, bias, dtype, tied, dw)
    inputs = make_inputs(kind, dtype, 3)
    xg_dw = []
    if schedule == "after_each_backward":
        for x_val, loss_w in inputs:
            xg_dw += run_dw(kind, bias, dw, [(x_val, loss_w)], order)
            assert [m.num_queued_wgrad_units() for m in dw] == [0, 0]
    else:
        for x_val, loss_w in inputs:
            x = x_val.clone().requires_grad_(True)
            microbatch_loss(call(kind, dw[1], call(kind, dw[0], x)), loss_w).backward()
            xg_dw.append(x.grad)
        for j in order:
            for left in (2, 1, 0):
                dw[j].backward_dw()
                assert dw[j].num_queued_wgrad_units() == left
        for m in dw:
            with pytest.raises(dwgraph.GraphStateError, match="no deferred"):
                m.backward_dw()
    xg_ref = run_ref(kind, ref, inputs)
    # Tied: autograd sums (a_i + b_i) per microbatch; these schedules land a_i and b_i
    # separately, in another association. Independent: g1 + g2 + g3 on both sides.
    reordered = set(deferred_names(kind, bias)) if tied else set()
    compare_grads(kind, bias, dw, ref, xg_dw, xg_ref, reordered, what=schedule)
