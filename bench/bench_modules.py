"""Eager training steps of dwgraph.nn modules, measured side by side in one run.

1. Deferred (``delay_wgrad_compute=True``: backward, then ``backward_dw()`` per module)
   against non-deferred dwgraph modules and against plain ``torch.nn``: the cost of
   splitting the backward.
2. Fused ``main_grad`` accumulation over microbatches against unfused accumulation into
   ``.grad`` (a wgrad GEMM into a fresh buffer, then AccumulateGrad's add).

Prints median step times and ratios. ``--device cuda`` on a GPU machine.
"""

import torch

import dwgraph
from common import bench_args, median_time


def build(kind, hidden, layers, device, dtype, **flags):
    if kind == "torch":
        mods = [torch.nn.Linear(hidden, hidden, device=device, dtype=dtype) for _ in range(layers)]
    else:
        mods = [dwgraph.nn.Linear(hidden, hidden, device=device, dtype=dtype, **flags) for _ in range(layers)]
    return torch.nn.Sequential(*mods)


def step(model, xs, deferred):
    for x in xs:
        model(x).float().square().mean().backward()
    if deferred:
        for _ in xs:
            for m in model:
                m.backward_dw()


def timeit(fn, device, warmup, samples):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return median_time(fn, warmup=warmup, samples=samples, sync=sync)


def main():
    args = bench_args(__doc__)
    hidden, tokens, layers, micro = (512, 256, 4, 4) if args.device == "cpu" else (4096, 4096, 4, 4)
    if args.quick:
        hidden, tokens = hidden // 2, tokens // 2
    samples, warmup = (5, 1) if args.quick else (9, 2)
    torch.manual_seed(0)
    print(f"# eager steps of dwgraph.nn.Linear x{layers} ({args.device}), hidden {hidden}, "
          f"{micro} microbatches of {tokens} tokens; median of {samples}\n")
    print("| dtype | torch.nn ms | dwgraph ms | deferred ms | deferred / dwgraph | dwgraph / torch.nn "
          "| fused main_grad ms | fused / unfused (.grad) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        xs = [torch.randn(tokens, hidden, device=args.device, dtype=dtype) for _ in range(micro)]
        ref = build("torch", hidden, layers, args.device, dtype)
        plain = build("dw", hidden, layers, args.device, dtype)
        deferred = build("dw", hidden, layers, args.device, dtype, delay_wgrad_compute=True)
        fused = build("dw", hidden, layers, args.device, dtype, delay_wgrad_compute=True,
                      fuse_wgrad_accumulation=True)

        def run_ref():
            ref.zero_grad(set_to_none=True)
            step(ref, xs, False)

        def run_plain():
            plain.zero_grad(set_to_none=True)
            step(plain, xs, False)

        def run_deferred():
            deferred.zero_grad(set_to_none=True)
            step(deferred, xs, True)

        def run_fused():
            for m in fused:
                m.weight.main_grad.zero_()
            fused.zero_grad(set_to_none=True)
            step(fused, xs, True)

        t = {name: timeit(fn, args.device, warmup, samples) for name, fn in
             [("ref", run_ref), ("plain", run_plain), ("deferred", run_deferred), ("fused", run_fused)]}
        name = str(dtype).replace("torch.", "")
        print(f"| {name} | {t['ref']:.2f} | {t['plain']:.2f} | {t['deferred']:.2f} | "
              f"{t['deferred'] / t['plain']:.2f} | {t['plain'] / t['ref']:.2f} | {t['fused']:.2f} | "
              f"{t['fused'] / t['deferred']:.2f} |")
    print("\ndwgraph = non-deferred dwgraph.nn.Linear; deferred = delay_wgrad_compute=True with "
          "backward_dw() per module per microbatch, accumulating into .grad; fused = deferred with "
          "fuse_wgrad_accumulation=True (FP32 main_grad, beta = 1).")


if __name__ == "__main__":
    main()
