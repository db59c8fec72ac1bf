"""The GEMMs under dwgraph's modules, as thin front ends over ``torch.ops.dwgraph.*``.

Shapes are row-major: ``x [M, K]`` (M tokens, K in-features), ``w [N, K]`` (N
out-features), ``y``/``dy [M, N]``. Inputs are float32, bfloat16 or float16 and share one
dtype. Products accumulate in FP32 on every backend (ATen on CPU, cuBLASLt on CUDA).
A bad argument raises :class:`dwgraph.ArgumentError` naming it, and nothing is written.

Calling ``torch.ops.dwgraph.<name>`` directly (for instance under ``torch.compile``) runs
the same kernels; its argument errors are plain ``ValueError`` with the same message.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

from .errors import ArgumentError

Weights = Union[torch.Tensor, Sequence[torch.Tensor]]


def _as_dwgraph_errors(fn):
    """Re-raise the ops' argument errors (ValueError from the dispatcher) as ArgumentError."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ArgumentError:
            raise
        except ValueError as e:
            if str(e).startswith("dwgraph."):
                raise ArgumentError(str(e)) from None
            raise

    return wrapper


@_as_dwgraph_errors
def fwd_gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y[M, N] = x[M, K] @ w[N, K].T (+ bias[N])``, in the input dtype."""
    return torch.ops.dwgraph.fwd_gemm(x, w, bias)


@_as_dwgraph_errors
def dgrad_gemm(dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dx[M, K] = dy[M, N] @ w[N, K]``, in the input dtype."""
    return torch.ops.dwgraph.dgrad_gemm(dy, w)


@_as_dwgraph_errors
def wgrad_gemm(
    dy: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    bias_grad_out: Optional[torch.Tensor] = None,
) -> None:
    """``out[N, K] = (out if accumulate else 0) + dy[M, N].T @ x[M, K]``, in place.

    Accumulated in FP32; ``out`` is float32 or the input dtype. With ``accumulate=True``
    and a float32 ``out`` the GEMM adds into ``out`` itself (beta = 1): no temporary and
    no separate add. ``bias_grad_out[N]``, when given, is overwritten with ``dy.sum(0)``
    in ``out``'s dtype.
    """
    torch.ops.dwgraph.wgrad_gemm(dy, x, out, accumulate, bias_grad_out)


def _is_packed(w: Weights) -> bool:
    return isinstance(w, torch.Tensor)


@_as_dwgraph_errors
def grouped_fwd_gemm(
    x: torch.Tensor,
    w: Weights,
    m_splits: Sequence[int],
    bias: Optional[Weights] = None,
) -> torch.Tensor:
    """Grouped :func:`fwd_gemm`: rows ``m_splits[g]`` of ``x`` use weight ``g``.

    ``w`` is a list of G ``[N, K]`` tensors or one packed ``[G, N, K]`` tensor; ``bias``
    is then a list of G ``[N]`` tensors or one ``[G, N]`` tensor.
    """
    m_splits = [int(m) for m in m_splits]
    if _is_packed(w):
        return torch.ops.dwgraph.grouped_fwd_gemm_packed(x, w, m_splits, bias)
    return torch.ops.dwgraph.grouped_fwd_gemm(x, list(w), m_splits, None if bias is None else list(bias))


@_as_dwgraph_errors
def grouped_dgrad_gemm(dy: torch.Tensor, w: Weights, m_splits: Sequence[int]) -> torch.Tensor:
    """Grouped :func:`dgrad_gemm` (``w`` as in :func:`grouped_fwd_gemm`)."""
    m_splits = [int(m) for m in m_splits]
    if _is_packed(w):
        return torch.ops.dwgraph.grouped_dgrad_gemm_packed(dy, w, m_splits)
    return torch.ops.dwgraph.grouped_dgrad_gemm(dy, list(w), m_splits)


@_as_dwgraph_errors
def grouped_wgrad_gemm(
    dy: torch.Tensor,
    x: torch.Tensor,
    out: Weights,
    m_splits: Sequence[int],
    accumulate: bool,
    bias_grad_out: Optional[Weights] = None,
) -> None:
    """Grouped :func:`wgrad_gemm`: ``out`` is a list of G ``[N, K]`` tensors or one
    ``[G, N, K]`` tensor, ``bias_grad_out`` a list of G ``[N]`` or one ``[G, N]``. An
    empty group's output is zeroed (or left as is when accumulating)."""
    m_splits = [int(m) for m in m_splits]
    if _is_packed(out):
        torch.ops.dwgraph.grouped_wgrad_gemm_packed(dy, x, out, m_splits, accumulate, bias_grad_out)
    else:
        torch.ops.dwgraph.grouped_wgrad_gemm(
            dy, x, list(out), m_splits, accumulate, None if bias_grad_out is None else list(bias_grad_out)
        )


__all__ = [
    "fwd_gemm",
    "dgrad_gemm",
    "wgrad_gemm",
    "grouped_fwd_gemm",
    "grouped_dgrad_gemm",
    "grouped_wgrad_gemm",
]
