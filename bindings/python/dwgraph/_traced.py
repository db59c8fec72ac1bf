"""The dwgraph.nn forwards torch.compile can trace (modules without deferral or fusion).

Eagerly, dwgraph.nn modules run C++ autograd nodes (ops/linear.cpp). Under torch.compile
those are opaque to Dynamo, so a module whose weight gradients land in the backward
(``delay_wgrad_compute=False``, ``fuse_wgrad_accumulation=False``, plain parameters) uses
these autograd functions instead: the same ``torch.ops.dwgraph`` GEMMs, which have fake
kernels, in a form AOTAutograd traces, so ``fullgraph=True`` works. Deferred or fused
modules are not traced: their backward queues work for ``backward_dw()`` or writes
``main_grad``, side effects outside autograd a compiled graph cannot express, so each of
their calls runs eagerly (one graph break, see ``_DeferredWgradModule.forward``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


def _wgrad(dy2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, with_bias: bool):
    dw = torch.empty_like(w)
    db = torch.empty(w.shape[0], dtype=w.dtype, device=w.device) if with_bias else None
    torch.ops.dwgraph.wgrad_gemm(dy2, x2, dw, False, db)
    return dw, db


# Under torch.autocast the ops' Autocast kernels (ops/autocast.cpp) decide the forward's
# GEMM dtype and cast inside the op, unseen by autograd; the backward runs its GEMMs in the
# forward output's dtype (the dtype of dy), whatever autocast region it runs in. As in the
# eager modules, an FP32 weight's gradient is written in FP32 from those operands.
def _in(dtype, *ts):
    return [t if t is None or t.dtype == dtype else t.to(dtype) for t in ts]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.dwgraph.fwd_gemm(x2, w, b)
        ctx.save_for_backward(x2, w)
        ctx.x_shape, ctx.with_bias = x.shape, b is not None
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        with torch.autocast(dy.device.type, enabled=False):
            x2, w_op = _in(dy.dtype, x2, w)  # dy has the forward output's (GEMM) dtype
            dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
            dx = torch.ops.dwgraph.dgrad_gemm(dy2, w_op).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
            dw = db = None
            if ctx.needs_input_grad[1] or (ctx.with_bias and ctx.needs_input_grad[2]):
                dw, db = _wgrad(dy2, x2, w, ctx.with_bias and ctx.needs_input_grad[2])
        return dx, dw if ctx.needs_input_grad[1] else None, db


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits: List[int], packed: bool, *params):
        ctx.m_splits, ctx.packed = list(m_splits), packed
        n_w = 1 if packed else len(m_splits)
        weights, biases = params[:n_w], params[n_w:]
        ctx.with_bias = bool(biases)
        ctx.save_for_backward(x, *weights)
        if packed:
            return torch.ops.dwgraph.grouped_fwd_gemm_packed(x, weights[0], ctx.m_splits,
                                                            biases[0] if biases else None)
        return torch.ops.dwgraph.grouped_fwd_gemm(x, list(weights), ctx.m_splits, list(biases) if biases else None)

    @staticmethod
    def backward(ctx, dy):
        with torch.autocast(dy.device.type, enabled=False):
            return _GroupedLinear._backward(ctx, dy.contiguous())

    @staticmethod
    def _backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        x, *ops = _in(dy.dtype, x, *weights)  # dy has the forward output's (GEMM) dtype
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (torch.ops.dwgraph.grouped_dgrad_gemm_packed(dy, ops[0], ctx.m_splits) if ctx.packed
                  else torch.ops.dwgraph.grouped_dgrad_gemm(dy, ops, ctx.m_splits))
        if ctx.packed:
            w = weights[0]
            dw = torch.empty_like(w)
            db = torch.empty(w.shape[0], w.shape[1], dtype=w.dtype, device=w.device) if ctx.with_bias else None
            torch.ops.dwgraph.grouped_wgrad_gemm_packed(dy, x, dw, ctx.m_splits, False, db)
            return (dx, None, None, dw, *([db] if ctx.with_bias else []))
        dws, dbs, start = [], [], 0
        for w, m in zip(weights, ctx.m_splits):
            dw, db = _wgrad(dy[start:start + m], x[start:start + m], w, ctx.with_bias)
            dws.append(dw)
            dbs.append(db)
            start += m
        return (dx, None, None, *dws, *(dbs if ctx.with_bias else []))


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return _Linear.apply(x, w, b)


def grouped_linear(x: torch.Tensor, m_splits: Sequence[int], packed: bool, weights, biases) -> torch.Tensor:
    return _GroupedLinear.apply(x, [int(m) for m in m_splits], packed, *weights, *biases)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    shape = (module.layer_norm_weight.shape[0],)
    if module.normalization == "RMSNorm":
        return F.rms_norm(x, shape, module.layer_norm_weight, module.eps)
    return F.layer_norm(x, shape, module.layer_norm_weight, module.layer_norm_bias, module.eps)


def layernorm_linear(module, x: torch.Tensor):
    """(output, LayerNorm output), as ops::layernorm_linear."""
    h = _norm(module, x)
    return linear(h, module.weight, module.bias), h


def _mlp(module, x: torch.Tensor) -> torch.Tensor:
    h = _norm(module, x)
    a = linear(h, module.fc1_weight, module.fc1_bias)
    if module.activation == "relu":
        act = F.relu(a)
    else:
        act = F.gelu(a, approximate="tanh" if module.activation == "gelu_tanh" else "none")
    return linear(act, module.fc2_weight, module.fc2_bias)


def layernorm_mlp(module, x: torch.Tensor) -> torch.Tensor:
    if module.checkpoint:
        # torch's own recomputation, which AOTAutograd traces: the same ops recomputed.
        return torch.utils.checkpoint.checkpoint(_mlp, module, x, use_reentrant=False)
    return _mlp(module, x)
