"""Timing helpers shared by the benchmarks (not a benchmark itself)."""

import statistics
import time


def median_time(fn, *, warmup, samples, sync=lambda: None, iters=1, scale=1e3):
    """Median over `samples` of the mean time of `iters` calls of fn, times `scale`
    (1e3: milliseconds, 1e6: microseconds), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(samples):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / iters * scale)
    return statistics.median(out)


def bench_args(doc, extra=None):
    """--device cpu|cuda and --quick, refusing cuda without a usable device; `extra(parser)`
    adds a benchmark's own options."""
    import argparse

    import dwgraph

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if args.device == "cuda" and not dwgraph.cuda_available():
        p.error("--device cuda needs a usable CUDA device")
    return args
