#!/usr/bin/env python3
"""FP8 versus BF16 GEMMs (docs/fp8.md): the raw GEMM and a whole dwgraph.nn.Linear step.

Rows, per shape (M, N, K):
  * ``gemm``: one forward GEMM, ``torch._scaled_mm`` on E4M3 operands into FP32 (what the
    FP8 modules call) against ``torch.mm`` on BF16 operands;
  * ``linear step``: forward, backward and ``backward_dw()`` of a deferred, fused
    ``dwgraph.nn.Linear`` in BF16, outside and inside ``fp8_autocast`` with delayed and
    current scaling (quantization, amax bookkeeping and the three GEMMs included).

Both sides run interleaved sample by sample; the table reports the median time per call
and the ratio FP8 / BF16. Caveat: on the CPU, ATen's FP8 GEMM dequantizes to FP32 and runs
an FP32 GEMM, so FP8 is *slower* here; the numbers measure dwgraph's overhead around the
GEMMs, not the tensor-core speed-up FP8 gives on a GPU (run ``--device cuda`` there).
Timings are printed only, never asserted.

    python bench/bench_fp8.py            # CPU, < 1 minute on 2 cores
    python bench/bench_fp8.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

import dwgraph
from dwgraph.fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast

SHAPES = {False: [(512, 512, 512), (1024, 1024, 1024)], True: [(128, 128, 128), (256, 256, 256)]}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_per_call(fns: Dict[str, Callable[[], None]], samples: int, iters: int, device: str) -> Dict[str, float]:
    for fn in fns.values():  # warm up
        fn()
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(samples):
        for k, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            _sync(device)
            times[k].append((time.perf_counter() - t0) / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def gemm_row(m: int, n: int, k: int, device: str, samples: int, iters: int) -> Dict[str, float]:
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)
    xb, wb = x.bfloat16(), w.bfloat16()
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    return _median_per_call({
        "bf16": lambda: torch.mm(xb, wb.t()),
        "fp8": lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.float32),
    }, samples, iters, device)


def linear_row(m: int, n: int, k: int, device: str, samples: int, iters: int) -> Dict[str, float]:
    mod = dwgraph.nn.Linear(k, n, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, device=device,
                            dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step(recipe):
        def run():
            with fp8_autocast(enabled=recipe is not None, recipe=recipe):
                y = mod(x)
            y.backward(gy)
            mod.backward_dw()
        return run

    return _median_per_call({"bf16": step(None), "fp8 delayed": step(DelayedScaling(amax_history_len=16)),
                             "fp8 current": step(Float8CurrentScaling())}, samples, iters, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    samples, iters = (3, 2) if args.quick else (7, 3)
    print(f"# FP8 vs BF16 on {args.device} (torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    print("| shape (M, N, K) | what | BF16 ms | FP8 ms | FP8 / BF16 |")
    print("|---|---|---|---|---|")
    for m, n, k in SHAPES[args.quick]:
        g = gemm_row(m, n, k, args.device, samples, iters)
        print(f"| {m}x{n}x{k} | forward GEMM | {g['bf16'] * 1e3:.3f} | {g['fp8'] * 1e3:.3f} | "
              f"{g['fp8'] / g['bf16']:.2f} |")
        s = linear_row(m, n, k, args.device, samples, iters)
        for name in ("fp8 delayed", "fp8 current"):
            print(f"| {m}x{n}x{k} | Linear step, {name[4:]} scaling | {s['bf16'] * 1e3:.3f} | {s[name] * 1e3:.3f} | "
                  f"{s[name] / s['bf16']:.2f} |")
    if args.device == "cpu":
        print("\nCPU FP8 is not the GPU's: ATen dequantizes to FP32 here, so a ratio above 1 is expected.")


if __name__ == "__main__":
    main()
