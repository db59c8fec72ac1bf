#!/usr/bin/env python3
"""Fused versus unfused weight-gradient accumulation into an FP32 ``main_grad``.

Fused (contract C2): ``dwgraph.ops.wgrad_gemm(dy, x, main_grad, accumulate=True)``, one
GEMM that accumulates into ``main_grad`` (beta = 1).

Unfused (what a framework without the fused GEMM does): the same wgrad GEMM into a fresh
temporary, ``tmp = dy.T @ x`` (``dwgraph.ops.wgrad_gemm(dy, x, tmp, accumulate=False)``),
then ``main_grad.add_(tmp)``. The temporary is in the input dtype (the usual unfused path)
and, for BF16 inputs, also in FP32 (the same GEMM kernel as the fused path, so that row
isolates the cost of the extra pass).

Both paths run side by side in one process, interleaved sample by sample, and the table
reports the median time per call, the ratio unfused / fused, and the analytic bytes each
path moves (fused: read dy and x, read and write main_grad; unfused: the same plus write
tmp and read it back) with their ratio. Timings are not asserted anywhere; they are only
printed (as a markdown table on stdout).

    python bench/bench_gemm.py                  # CPU, a few shapes, < 2 minutes on 2 cores
    python bench/bench_gemm.py --device cuda    # larger shapes on a GPU
    python bench/bench_gemm.py --quick          # smaller shapes, fewer samples
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable, List, Sequence, Tuple

import torch

import dwgraph
from dwgraph import ops

Shape = Tuple[int, int, int]  # (M, N, K): dy [M, N], x [M, K], main_grad [N, K]

SHAPES = {
    ("cpu", False): [(1024, 1024, 1024), (4096, 1024, 1024), (2048, 4096, 1024)],
    ("cpu", True): [(256, 256, 256), (1024, 512, 512)],
    ("cuda", False): [(4096, 4096, 4096), (16384, 4096, 4096), (8192, 16384, 4096)],
    ("cuda", True): [(2048, 2048, 2048), (8192, 4096, 4096)],
}
DTYPES = [torch.float32, torch.bfloat16]
_DT_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _sample(fn: Callable[[], None], iters: int, device: str) -> float:
    """Seconds per call over ``iters`` back-to-back calls."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def time_side_by_side(fns: Sequence[Callable[[], None]], device: str, samples: int,
                      iters: int, warmup: int) -> List[float]:
    """Median seconds per call of each function, sampled alternately so drift (clocks,
    other load) hits every path alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    _sync(device)
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(samples):
        for i, fn in enumerate(fns):
            times[i].append(_sample(fn, iters, device))
    return [statistics.median(t) for t in times]


def bytes_moved(shape: Shape, in_dtype: torch.dtype, tmp_dtype: torch.dtype) -> Tuple[int, int]:
    """Analytic DRAM traffic (fused, unfused), each operand touched once per pass."""
    m, n, k = shape
    s_in = torch.empty((), dtype=in_dtype).element_size()
    s_tmp = torch.empty((), dtype=tmp_dtype).element_size()
    inputs = (m * n + m * k) * s_in      # read dy, read x
    main_grad = 2 * n * k * 4            # read + write the FP32 main_grad
    fused = inputs + main_grad
    unfused = inputs + n * k * s_tmp + n * k * s_tmp + main_grad  # write tmp, read tmp
    return fused, unfused


def check_same_result(dy, x, main_grad0, tmp_dtype) -> float:
    """Relative difference of one fused and one unfused accumulation (sanity only)."""
    fused = main_grad0.clone()
    unfused = main_grad0.clone()
    ops.wgrad_gemm(dy, x, fused, True)
    tmp = torch.empty(unfused.shape, dtype=tmp_dtype, device=unfused.device)
    ops.wgrad_gemm(dy, x, tmp, False)
    unfused.add_(tmp)
    return ((fused.double() - unfused.double()).norm() / unfused.double().norm()).item()


def bench_one(shape: Shape, dtype: torch.dtype, tmp_dtype: torch.dtype, device: str,
              samples: int, iters: int, warmup: int) -> dict:
    m, n, k = shape
    gen = torch.Generator().manual_seed(0)
    dy = torch.randn(m, n, generator=gen).to(device=device, dtype=dtype)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    main_grad = torch.randn(n, k, generator=gen).to(device)  # persistent FP32 buffer

    rel = check_same_result(dy, x, main_grad, tmp_dtype)
    tol = 1e-5 if tmp_dtype == torch.float32 else 2e-2
    if not rel <= tol:
        raise RuntimeError(f"fused and unfused results differ: rel {rel:.2e} for {shape} {dtype}")

    def fused() -> None:
        ops.wgrad_gemm(dy, x, main_grad, True)

    def unfused() -> None:
        tmp = torch.empty((n, k), dtype=tmp_dtype, device=device)
        ops.wgrad_gemm(dy, x, tmp, False)
        main_grad.add_(tmp)

    t_fused, t_unfused = time_side_by_side([fused, unfused], device, samples, iters, warmup)
    b_fused, b_unfused = bytes_moved(shape, dtype, tmp_dtype)
    return {
        "shape": shape,
        "dtype": dtype,
        "tmp_dtype": tmp_dtype,
        "fused_ms": t_fused * 1e3,
        "unfused_ms": t_unfused * 1e3,
        "tflops_fused": 2.0 * m * n * k / t_fused / 1e12,
        "fused_mb": b_fused / 1e6,
        "unfused_mb": b_unfused / 1e6,
    }


def print_table(rows: List[dict], args, out=sys.stdout) -> None:
    dev = "cpu" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"# wgrad accumulation into FP32 main_grad: fused vs unfused ({dev})", file=out)
    print(file=out)
    print(f"torch {torch.__version__}, dwgraph {dwgraph.__version__}, "
          f"{torch.get_num_threads()} CPU threads, {platform.machine()}; "
          f"median of {args.samples} samples x {args.iters} call(s), {args.warmup} warmup call(s)",
          file=out)
    print(file=out)
    print("| M | N | K | input | tmp | fused ms | unfused ms | unfused/fused | fused TFLOP/s "
          "| fused MB | unfused MB | bytes ratio |", file=out)
    print("|---:|---:|---:|:---|:---|---:|---:|---:|---:|---:|---:|---:|", file=out)
    for r in rows:
        m, n, k = r["shape"]
        print(f"| {m} | {n} | {k} | {_DT_NAME[r['dtype']]} | {_DT_NAME[r['tmp_dtype']]} | {r['fused_ms']:.3f} | "
              f"{r['unfused_ms']:.3f} | {r['unfused_ms'] / r['fused_ms']:.2f} | "
              f"{r['tflops_fused']:.3f} | {r['fused_mb']:.1f} | {r['unfused_mb']:.1f} | "
              f"{r['unfused_mb'] / r['fused_mb']:.2f} |", file=out)
    print(file=out)
    print("fused: `dwgraph.ops.wgrad_gemm(dy, x, main_grad, accumulate=True)`; unfused: "
          "`tmp = empty(N, K, tmp dtype)`, `dwgraph.ops.wgrad_gemm(dy, x, tmp, False)`, "
          "`main_grad.add_(tmp)`. Bytes are analytic: fused = dy + x + 2 x main_grad; "
          "unfused = fused + 2 x tmp.", file=out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer samples")
    p.add_argument("--samples", type=int, default=None, help="timed samples per path")
    p.add_argument("--iters", type=int, default=None, help="calls per timed sample")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per path first")
    args = p.parse_args(argv)
    if args.device == "cuda" and not dwgraph.cuda_available():
        p.error("--device cuda: dwgraph reports no usable CUDA device")
    on_gpu = args.device == "cuda"
    defaults = {  # (samples, iters, warmup)
        (False, False): (9, 1, 2),
        (False, True): (3, 1, 1),
        (True, False): (10, 10, 5),
        (True, True): (5, 5, 3),
    }[(on_gpu, args.quick)]
    for name, value in zip(("samples", "iters", "warmup"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for shape in SHAPES[(args.device, args.quick)]:
        for dtype in DTYPES:
            for tmp_dtype in dict.fromkeys([dtype, torch.float32]):
                rows.append(bench_one(shape, dtype, tmp_dtype, args.device, args.samples,
                                      args.iters, args.warmup))
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
