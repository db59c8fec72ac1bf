"""Memory of graphed pipeline schedules against the same schedules run eagerly, in one run.

1. Liveness (issue 21): the graph pool of a pipeline schedule, whose microbatch slots share
   the pool by liveness (Note [Slots share the pool by liveness], graphs/manager_impl.h),
   against the peak live bytes of the same order run eagerly: 1F1B, interleaved 1F1B
   (two chunks), ZB-H1-like and ZB-V-like (two chunks in a V) zero-bubble orders with
   backward_dw separate, 4, 8 and 16 microbatches, two model sizes; then the sequential
   schedule (N layers x 1 microbatch).
2. reuse_static_buffers (issue 14, TransformerEngine's _reuse_graph_input_output_buffers):
   the static buffers with and without it on 1F1B.

Eager's peak: dwgraph.eager_memory, the library's own measurement: on the host, the eager
schedule's allocations (activations, temporaries, gradients, the parameters' first .grad)
come from a fresh host pool, the allocator and caching rules the graphs' pool uses, and
the peak is that pool's high-water mark of live bytes; on CUDA, the caching allocator's
peak allocated bytes during the schedule. Graphed: the pool's reserved bytes (what the
graphs hold), live bytes after the schedule ran, and peak live bytes, after one graphed run
of the same order from .grad = None.

    python bench/bench_reuse.py [--quick]      (--device cuda: the same, on the GPU's pool)
"""

from __future__ import annotations

import copy

import torch

import dwgraph
from common import bench_args

# An order is a list of (phase, chunk, microbatch): phase "F", "B" or "W" (backward_dw),
# chunk 1-based, microbatches of each chunk in order. All describe one rank of a 2-stage
# pipeline (per-chunk stages of the other rank between this rank's entries).


def one_f_one_b(m):
    """Rank 0 of 2: one warmup forward, then F/B pairs; each W right after its B."""
    out, f = [("F", 1, 0)], 1
    for b in range(m):
        if f < m:
            out.append(("F", 1, f))
            f += 1
        out += [("B", 1, b), ("W", 1, b)]
    return out


def interleaved_1f1b(m, p=2):
    """Megatron's interleaved 1F1B on rank 0 of p stages with 2 chunks: microbatches in
    groups of p per chunk, (p - 1) * 2 + p warmup forwards, then 1F1B; W right after B."""
    fwd = [(c, g + i) for g in range(0, m, p) for c in (1, 2) for i in range(p)]
    bwd = [(c, g + i) for g in range(0, m, p) for c in (2, 1) for i in range(p)]
    warm = min(len(fwd), (p - 1) * 2 + p)
    out = [("F", c, mb) for c, mb in fwd[:warm]]
    for k in range(len(bwd)):
        if warm + k < len(fwd):
            out.append(("F",) + fwd[warm + k])
        out += [("B",) + bwd[k], ("W",) + bwd[k]]
    return out


def zb_h1(m, lag=1):
    """ZB-H1-like on rank 0 of 2: 1F1B's F and B, each W `lag` steps after its B (filling
    the bubble), the last ones in the cooldown."""
    out, f, w = [("F", 1, 0)], 1, 0
    for b in range(m):
        if f < m:
            out.append(("F", 1, f))
            f += 1
        out.append(("B", 1, b))
        if b - w >= lag:
            out.append(("W", 1, w))
            w += 1
    out += [("W", 1, i) for i in range(w, m)]
    return out


def zb_v(m, lag=1):
    """ZB-V-like (the V placement of ZB-V and DualPipeV) on rank 0 of 2: chunk 1 is the first
    stage, chunk 2 the last, so a microbatch's F1 precedes its F2, its B2 precedes its B1.
    Two F1 of warmup, then per step F1 (next), F2, B2, B1 of the oldest, Ws `lag` steps
    behind their B."""
    out, f1, f2, b = [], 0, 0, 0
    pending = []  # (chunk, microbatch) whose W is due
    while f1 < min(2, m):
        out.append(("F", 1, f1))
        f1 += 1
    while b < m:
        if f2 < f1:
            out.append(("F", 2, f2))
            f2 += 1
        if f1 < m:
            out.append(("F", 1, f1))
            f1 += 1
        out += [("B", 2, b), ("B", 1, b)]
        pending += [(2, b), (1, b)]
        b += 1
        while len(pending) > 2 * lag:
            out.append(("W",) + pending.pop(0))
    out += [("W",) + w for w in pending]
    return out


SCHEDULES = {"1F1B": (one_f_one_b, 1), "interleaved 1F1B": (interleaved_1f1b, 2), "ZB-H1": (zb_h1, 1),
             "ZB-V": (zb_v, 2)}


def to_order(steps):
    return [c if ph == "F" else -c if ph == "B" else -(c + 0.5) for ph, c, _ in steps]


def model(hidden, ffn, dev):
    """Four deferred layers; one chunk of four, or two chunks of two."""
    torch.manual_seed(0)
    return [dwgraph.nn.LayerNormMLP(hidden, ffn, delay_wgrad_compute=True, device=dev),
            dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev),
            dwgraph.nn.LayerNormMLP(hidden, ffn, delay_wgrad_compute=True, device=dev),
            dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev)]


def run(steps, chunk_fwd, chunk_dw, xs, num_chunks):
    """Runs an order as a pipeline rank does: a chunk's input is the previous chunk's output
    detached (the stage boundary), its backward gets the next chunk's input gradient."""
    acts, grads = {}, {}
    for ph, c, mb in steps:
        if ph == "F":
            x = xs[mb] if c == 1 else acts[(c - 1, mb)][1].detach().requires_grad_()
            acts[(c, mb)] = (x, chunk_fwd(c, mb, x))
        elif ph == "B":
            x, y = acts.pop((c, mb))
            if c == num_chunks:
                y.square().mean().backward()
            else:
                y.backward(grads.pop(mb))
            if c > 1:
                grads[mb] = x.grad
        else:
            chunk_dw(c, mb)


def measure(name, hidden, ffn, rows, m, dev, plan_placement=True):
    build, chunks = SCHEDULES[name]
    steps = build(m)
    layers = model(hidden, ffn, dev)
    per = len(layers) // chunks
    xs = [torch.randn(rows, hidden, device=dev) for _ in range(m)]
    # Slot layout (graphs/schedule.h): chunk by chunk, microbatch by microbatch, layer by layer.
    samples = tuple((torch.randn(rows, hidden, device=dev, requires_grad=c > 0 or l > 0),)
                    for c in range(chunks) for _ in range(m) for l in range(per))
    mods = copy.deepcopy(layers)
    slots = dwgraph.make_graphed_callables(tuple(mods), samples, order=to_order(steps),
                                           num_layers_per_chunk=[per] * chunks, num_warmup_iters=1,
                                           plan_placement=plan_placement)

    def slot(c, mb, l):
        return slots[(c - 1) * per * m + mb * per + l]

    def g_fwd(c, mb, x):
        for l in range(per):
            x = slot(c, mb, l)(x)
        return x

    run(steps, g_fwd, lambda c, mb: [slot(c, mb, l).backward_dw() for l in range(per)], xs, chunks)
    eager = copy.deepcopy(layers)

    def e_fwd(c, mb, x):
        for l in range(per):
            x = eager[(c - 1) * per + l](x)
        return x

    with dwgraph.eager_memory(slots) as e:
        run(steps, e_fwd, lambda c, mb: [eager[(c - 1) * per + l].backward_dw() for l in range(per)], xs, chunks)
    st = slots[0].stats()
    st["eager_reserved_bytes"] = e.reserved_bytes
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(
        (p for l in mods for p in l.parameters()), (p for l in eager for p in l.parameters())))
    return st, e.peak_bytes, same


def sequential_order(n):
    """The sequential schedule stated as an `order`: each layer a chunk of its own, one
    microbatch: every forward, the backwards in reverse, then every backward-dw."""
    return list(range(1, n + 1)) + [-c for c in range(n, 0, -1)] + [-(c + 0.5) for c in range(1, n + 1)]


def sequential(hidden, ffn, rows, n, dev, as_order=False):
    """N layers, one microbatch: forward, loss.backward(), every backward_dw(); without an
    order (the sequential schedule), or with sequential_order(n) (a pipeline schedule)."""
    torch.manual_seed(0)
    layers = [l for _ in range(n // 2) for l in model(hidden, ffn, dev)[:2]]
    mods = copy.deepcopy(layers)
    samples = tuple((torch.randn(rows, hidden, device=dev, requires_grad=i > 0),) for i in range(n))
    extra = dict(order=sequential_order(n), num_layers_per_chunk=[1] * n) if as_order else {}
    g = dwgraph.make_graphed_callables(tuple(mods), samples, num_warmup_iters=1, **extra)
    calls = g if as_order else mods
    x = torch.randn(rows, hidden, device=dev)

    def step(ls):
        y = x
        for l in ls:
            y = l(y)
        y.square().mean().backward()
        for l in ls:
            l.backward_dw()

    step(calls)
    eager = copy.deepcopy(layers)
    with dwgraph.eager_memory(g) as e:
        step(eager)
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(
        (p for l in mods for p in l.parameters()), (p for l in eager for p in l.parameters())))
    handle = g[0] if as_order else dwgraph.graphed_handle(g[0])
    return handle.stats(), e.peak_bytes, same


def reuse_rows(hidden, ffn, rows, dev):
    """Issue 14's table: static bytes with and without reuse_static_buffers (1F1B, two
    microbatches in flight)."""
    out = []
    for m in (4, 8):
        steps = one_f_one_b(m)
        layers = model(hidden, ffn, dev)[:2]
        samples = tuple((torch.randn(rows, hidden, device=dev, requires_grad=l > 0),) for _ in range(m) for l in range(2))
        xs = [torch.randn(rows, hidden, device=dev) for _ in range(m)]
        row = []
        for reuse in (False, True):
            mods = copy.deepcopy(layers)
            slots = dwgraph.make_graphed_callables(tuple(mods), samples, order=to_order(steps), num_layers_per_chunk=[2],
                                                   reuse_static_buffers=reuse, num_warmup_iters=1)
            run(steps, lambda c, mb, x: slots[mb * 2 + 1](slots[mb * 2](x)),
                lambda c, mb: [slots[mb * 2 + i].backward_dw() for i in range(2)], xs, 1)
            st = slots[0].stats()
            row.append((st["static_bytes"], st["pool_reserved_bytes"]))
        eager = copy.deepcopy(layers)
        with dwgraph.eager_memory(device=dev) as e:
            run(steps, lambda c, mb, x: eager[1](eager[0](x)), lambda c, mb: [l.backward_dw() for l in eager], xs, 1)
        out.append((m, row, e.peak_bytes))
    return out


def mb(n):
    return f"{n / 1e6:.2f}"


def main() -> None:
    args = bench_args(__doc__)
    dev = args.device
    shapes = [(256, 1024, 64)] if args.quick else [(256, 1024, 64), (512, 2048, 128)]
    counts = (4, 8) if args.quick else (4, 8, 16)
    print(f"# Graphed pipeline schedules against eager's peak ({dev}; MB = 1e6 bytes)\n")
    print("Planned placement (the default) against one capture placed by best fit (plan_placement=False), "
          "both in this run.\n")
    print("| schedule | model | microbatches | pool reserved MB | pool live MB | pool peak MB | eager peak MB | "
          "reserved / eager peak | peak / eager peak | eager reserved MB | reserved / eager reserved | "
          "best fit: reserved MB | best fit: reserved / eager peak | grads bitwise |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    flat = []
    for hidden, ffn, rows in shapes:
        label = f"2x(LayerNormMLP({hidden},{ffn}) + Linear), {rows} rows"
        for name in SCHEDULES:
            res = {}
            for m in counts:
                st, eager, same = measure(name, hidden, ffn, rows, m, dev)
                bf, bf_eager, bf_same = measure(name, hidden, ffn, rows, m, dev, plan_placement=False)
                same = same and bf_same
                res[m] = (st["pool_reserved_bytes"], eager)
                # The host measuring pool reserves too (CUDA: the default pool is everyone's).
                er = "-" if st["eager_reserved_bytes"] is None else mb(st["eager_reserved_bytes"])
                rr = "-" if st["eager_reserved_bytes"] is None else f"{st['pool_reserved_bytes'] / st['eager_reserved_bytes']:.2f}x"
                print(f"| {name} | {label} | {m} | {mb(st['pool_reserved_bytes'])} | {mb(st['pool_allocated_bytes'])} | "
                      f"{mb(st['pool_peak_allocated_bytes'])} | {mb(eager)} | {st['pool_reserved_bytes'] / eager:.2f}x | "
                      f"{st['pool_peak_allocated_bytes'] / eager:.2f}x | {er} | {rr} | {mb(bf['pool_reserved_bytes'])} | "
                      f"{bf['pool_reserved_bytes'] / bf_eager:.2f}x | {'yes' if same else 'NO'} |",
                      flush=True)
            lo, hi = min(counts), max(counts)
            flat.append((name, label, res[hi][0] / res[lo][0], res[hi][1] / res[lo][1]))
    print(f"\n| schedule | model | pool reserved, {max(counts)} / {min(counts)} microbatches | "
          f"eager peak, {max(counts)} / {min(counts)} |")
    print("|---|---|---:|---:|")
    for name, label, g, e in flat:
        print(f"| {name} | {label} | {g:.3f}x | {e:.3f}x |")

    print("\n# Sequential schedule: N layers x 1 microbatch, without an order and stated as one\n")
    print("| model | pool reserved MB | pool peak MB | static buffers MB | eager peak MB | reserved / eager peak | "
          "as an order: reserved MB | as an order: reserved / eager peak | grads bitwise |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for hidden, ffn, rows in shapes:
        for n in (4, 8):
            st, eager, same = sequential(hidden, ffn, rows, n, dev)
            so, eager_o, same_o = sequential(hidden, ffn, rows, n, dev, as_order=True)
            print(f"| {n // 2}x(LayerNormMLP({hidden},{ffn}) + Linear), {rows} rows | {mb(st['pool_reserved_bytes'])} | "
                  f"{mb(st['pool_peak_allocated_bytes'])} | {mb(st['static_bytes'])} | {mb(eager)} | "
                  f"{st['pool_reserved_bytes'] / eager:.2f}x | {mb(so['pool_reserved_bytes'])} | "
                  f"{so['pool_reserved_bytes'] / eager_o:.2f}x | {'yes' if same and same_o else 'NO'} |",
                  flush=True)

    print("\n# Static buffers reused across microbatches (1F1B, LayerNormMLP + Linear, 2 in flight)\n")
    print("| model, microbatches | static bytes | static bytes reused | saving | pool reserved | pool reserved reused | "
          "eager peak | reserved / eager peak | reserved reused / eager peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for hidden, ffn, rows in shapes:
        for m, ((s0, p0), (s1, p1)), peak in reuse_rows(hidden, ffn, rows, dev):
            print(f"| LayerNormMLP({hidden},{ffn}) + Linear, {rows} rows, {m} | {s0} | {s1} | {s0 / s1:.2f}x | {p0} | {p1} | "
                  f"{peak} | {p0 / peak:.2f}x | {p1 / peak:.2f}x |")


if __name__ == "__main__":
    main()
