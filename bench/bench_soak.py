"""Soak (not a CI test): many replays of graphed callables, alternating zero_grad modes and
the order of the backward_dw() calls, side by side with the same modules run eagerly.
At the end the gradients must equal eager's bitwise, and the process's resident memory
and the graph pool's bytes must be flat (first and last figures printed).

    python bench/bench_soak.py [--device cpu|cuda] [--quick]      (10,000 steps; --quick: 500)
"""

from __future__ import annotations

import copy
import os
import time

import torch

import dwgraph
from common import bench_args

H = 64
B = 16


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main() -> None:
    args = bench_args(__doc__)
    args.replays = 500 if args.quick else 10000
    dev = args.device
    torch.manual_seed(0)
    a = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, device=dev)
    b = torch.nn.Sequential(dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=True, device=dev),
                            dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True,
                                              device=dev))
    ea, eb = copy.deepcopy((a, b))
    ga, gb = dwgraph.make_graphed_callables((a, b), ((torch.randn(B, H, device=dev),),
                                                     (torch.randn(B, H, device=dev, requires_grad=True),)))
    handle = dwgraph.graphed_handle(ga)
    figures = []
    start = time.perf_counter()
    for step in range(args.replays):
        set_to_none = step % 2 == 0
        for m in (a, b, ea, eb):
            m.zero_grad(set_to_none=set_to_none)
        b[1].weight.main_grad.zero_(), eb[1].weight.main_grad.zero_()
        x = torch.randn(B, H, device=dev)
        gb(ga(x)).square().mean().backward()
        eb(ea(x)).square().mean().backward()
        if step % 3 == 0:  # alternate the landing order
            ga.backward_dw(), gb.backward_dw()
            ea.backward_dw(), eb[0].backward_dw(), eb[1].backward_dw()
        else:
            gb.backward_dw(), ga.backward_dw()
            eb[0].backward_dw(), eb[1].backward_dw(), ea.backward_dw()
        with torch.no_grad():  # a tiny SGD step on both, so every step sees new weights
            for p, q in zip(list(a.parameters()) + list(b.parameters()), list(ea.parameters()) + list(eb.parameters())):
                if p.grad is not None:
                    p.sub_(1e-3 * p.grad), q.sub_(1e-3 * q.grad)
        if step in (99, args.replays - 1):
            st = handle.stats()
            figures.append((step + 1, rss_mib(), st["pool_reserved_bytes"], st["pool_allocated_bytes"]))
    elapsed = time.perf_counter() - start
    exact = all(torch.equal(p, q) for p, q in zip(list(a.parameters()) + list(b.parameters()),
                                                   list(ea.parameters()) + list(eb.parameters())))
    exact = exact and all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
                          for p, q in zip(list(a.parameters()) + list(b.parameters()),
                                          list(ea.parameters()) + list(eb.parameters())))
    exact = exact and torch.equal(b[1].weight.main_grad, eb[1].weight.main_grad)
    print(f"# soak: {args.replays} graphed steps on {dev} ({elapsed:.1f} s, eager twin in lockstep)\n")
    print("| after step | RSS MiB | pool reserved B | pool live B |\n|---:|---:|---:|---:|")
    for f in figures:
        print(f"| {f[0]} | {f[1]:.1f} | {f[2]} | {f[3]} |")
    print(f"\nparameters, .grad and main_grad equal to eager, bitwise: {'yes' if exact else 'NO'}")
    if not exact:
        raise SystemExit("the soak diverged from eager")


if __name__ == "__main__":
    main()
