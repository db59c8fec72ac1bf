"""Shared pytest configuration for dwgraph's Python tests.

* the ``cuda`` marker, for tests (or parameter sets) that need a CUDA device;
* the ``device`` fixture: every test that takes ``device`` runs on ``"cpu"`` and on
  ``"cuda"``; the CUDA case carries the ``cuda`` marker and skips cleanly when
  ``dwgraph.cuda_available()`` is false (``-m "not cuda"`` deselects it);
* a per-test deterministic seed, so a failure reproduces with the same inputs;
* ``assert_rel``: a norm-wise relative error check against a float64 reference, with the
  bound set by the dtype the result is rounded to.
"""

from __future__ import annotations

import sys
import zlib

import pytest
import torch

import dwgraph

CUDA_AVAILABLE = dwgraph.cuda_available()

requires_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="no CUDA device")

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
]

# Bound on ||out - ref|| / ||ref|| by the dtype `out` is stored in. FP32 results of
# FP32-accumulated GEMMs of the sizes used in the tests stay far below 2e-6 (bf16 and fp16
# products are exact in FP32, so the same bound holds for FP32 results of such inputs);
# BF16 / FP16 results are dominated by the final rounding (2^-9 and 2^-12 relative).
REL_TOL = {
    torch.float32: 2e-6,
    torch.bfloat16: 8e-3,
    torch.float16: 2e-3,
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device; skipped when dwgraph.cuda_available() is false"
    )


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The device a test runs on: "cpu", and "cuda" where a CUDA device is usable."""
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh, reproducible random inputs per test (the seed depends on the test id)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's caches and recompile counts are per code object and process-wide: the
    dwgraph modules' forward, compiled by tests in several files, could exceed its recompile
    limit in a later test depending on the order the tests run in. Each test starts without
    them (reset costs microseconds; dynamo is not imported for tests that never compile)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def rel_error(out: torch.Tensor, ref: torch.Tensor, scale: float | None = None) -> float:
    """||out - ref|| / ||ref|| (or / ``scale``) in float64 on the CPU; 0 when both are zero."""
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    assert out64.shape == ref64.shape, f"shape {tuple(out64.shape)} != reference {tuple(ref64.shape)}"
    denom = ref64.norm().item() if scale is None else scale
    num = (out64 - ref64).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def _assert_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None,
                what: str = "result", scale: float | None = None) -> None:
    dtype = out.dtype if dtype is None else dtype
    bound = REL_TOL[dtype]
    err = rel_error(out, ref, scale)
    assert err <= bound, f"{what}: relative error {err:.3e} exceeds {bound:.1e} for {dtype}"


@pytest.fixture
def assert_rel():
    """``assert_rel(out, ref, dtype=None, what=..., scale=None)``: ||out-ref||/||ref|| (or
    / ``scale``) within the bound of ``dtype`` (default: ``out.dtype``), with ``ref`` a
    float64 reference."""
    return _assert_rel
