"""Memory of pipeline graphs with and without static buffers reused across microbatches
(``reuse_static_buffers``, TransformerEngine's ``_reuse_graph_input_output_buffers``),
against the peak of the same schedule run eagerly, measured side by side in one run.

Graphed: the static buffers (inputs, outputs, grad outputs, grad inputs; shared ones
counted once) and the graph pool's reserved and live bytes. Eager: the peak bytes of the
same 1F1B schedule run eagerly with its allocations routed to a fresh host pool (a host
graph capture executes the region for real; its pool counts every allocation, activations,
temporaries and gradients included; on CUDA: the caching allocator's peak).

    python bench/bench_reuse.py [--quick]      (--device cuda: the same, on the GPU's pool)
"""

from __future__ import annotations

import copy

import torch

import dwgraph
from common import bench_args


def one_f_one_b(m: int, warm: int):
    """Forwards first `warm` microbatches, then one backward (and backward-dw) per forward."""
    order, f, b = [], 0, 0
    for _ in range(min(warm, m)):
        order.append(1)
        f += 1
    while b < m:
        order += [-1, -1.5]
        b += 1
        if f < m:
            order.append(1)
            f += 1
    return order


def run_schedule(order, forward, backward_dw, xs):
    outs, f, b = {}, 0, 0
    for o in order:
        if o == 1:
            outs[f] = forward(f, xs[f])
            f += 1
        elif o == -1:
            outs.pop(b).square().mean().backward()
            b += 1
        else:
            backward_dw(b - 1)


def main() -> None:
    args = bench_args(__doc__)
    dev = args.device
    print(f"# Static buffers reused across microbatches (pipeline schedule, {dev})\n")
    print("| model, microbatches, in flight | static bytes | static bytes reused | saving | pool reserved | "
          "pool reserved reused | eager peak |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    shapes = [(256, 1024, 64)] if args.quick else [(256, 1024, 64), (512, 2048, 128)]
    for hidden, ffn, rows in shapes:
        for m, warm in ((4, 2), (8, 2)):
            torch.manual_seed(0)
            layers = (dwgraph.nn.LayerNormMLP(hidden, ffn, delay_wgrad_compute=True, device=dev),
                      dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev))
            order = one_f_one_b(m, warm)
            samples = tuple((torch.randn(rows, hidden, device=dev, requires_grad=True),) for _ in range(m) for _ in layers)
            xs = [torch.randn(rows, hidden, device=dev, requires_grad=True) for _ in range(m)]
            row = []
            for reuse in (False, True):
                mods = copy.deepcopy(layers)
                slots = dwgraph.make_graphed_callables(mods, samples, order=order, num_layers_per_chunk=[len(mods)],
                                                       reuse_static_buffers=reuse)
                run_schedule(order, lambda f, x: slots[f * 2 + 1](slots[f * 2](x)),
                             lambda b: [slots[b * 2 + i].backward_dw() for i in range(2)], xs)
                st = slots[0].stats()
                row.append((st["static_bytes"], st["pool_reserved_bytes"]))
            eager = copy.deepcopy(layers)
            if dev == "cpu":
                graph = dwgraph.graphs.Graph("cpu")
                with graph.capture():  # executes the eager schedule with its memory counted by the pool
                    run_schedule(order, lambda f, x: eager[1](eager[0](x)),
                                 lambda b: [e.backward_dw() for e in eager], xs)
                peak = graph.pool.stats()["peak_allocated_bytes"]
                graph.reset()
            else:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run_schedule(order, lambda f, x: eager[1](eager[0](x)), lambda b: [e.backward_dw() for e in eager], xs)
                peak = torch.cuda.max_memory_allocated() - base
            (s0, p0), (s1, p1) = row
            print(f"| LayerNormMLP({hidden},{ffn}) + Linear, {rows} rows, {m} microbatches, {warm} in flight | "
                  f"{s0} | {s1} | {s0 / s1:.2f}x | {p0} | {p1} | {peak} |")
    print("\nstatic bytes: distinct storages of the static inputs, outputs, grad outputs and grad inputs; "
          "pool: the graphs' private pool; eager peak: the peak live bytes of the eager schedule.")


if __name__ == "__main__":
    main()
