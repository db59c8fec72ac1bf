"""Per-call host work of make_graphed_callables over the replays themselves (contract C10),
for module trees of 1, 16, 128 and 1024 deferred Linear layers, measured in one run.

For each tree, one graphed callable (the whole Sequential) is called, backpropagated and
given its ``backward_dw()`` many times with dwgraph's phase clock on
(``dwgraph._C.graphs.set_phase_timing``, graphs/phase_timing.h): the core adds up the time
each phase spends inside its graph's ``replay()`` and in its copies (static inputs in,
outputs cloned, gradients copied and handed over). What is left of each phase's wall time
is the manager's own host work: the checks, the slot bookkeeping, the autograd node, the
Python front end. The backward's time also holds the autograd engine's own cost of running
a backward over an edge per parameter, which eager code and torch's make_graphed_callables
(one ``autograd.Function`` over the input and every parameter) pay too: it is measured side
by side with such a no-op ``torch.autograd.Function`` that hands each parameter what the
graphed backward hands it (a gradient, which AccumulateGrad sets as .grad, or None; until
2026-12-05 it handed None to all, so the net counted AccumulateGrad's work on every
non-deferred parameter as dwgraph's) and subtracted ("net"). On CPU the
clock is the calling thread's CPU time (``time.thread_time`` and the core's phase clock set
to the same), so a loaded machine does not inflate the figures. Contract C10 asks for overhead that does
not grow with the tree (the largest at most 1.2x the smallest) and at most 5 us. A last row
runs the one-layer tree with the caches evicted before each call (a 64 MiB tensor rewritten
outside the timed region): the work of the first row in the memory state a large tree's
calls meet. bench_overhead_instructions.py counts the work itself.

A second table gives whole steps against the same modules run eagerly.

    python bench/bench_overhead.py [--quick]     (--device cuda: the same on a GPU)
"""

from __future__ import annotations

import statistics
import time

import torch

import dwgraph
from common import bench_args
from dwgraph import _C

SIZES = (1, 16, 128, 1024)


class _Noop(torch.autograd.Function):
    """The autograd node torch's own make_graphed_callables builds: one Function over the
    input and every parameter, its backward handing each parameter what the graphed
    backward hands it: a fresh gradient where that backward gives one (AccumulateGrad then
    sets .grad, as in eager), None where it gives none (a deferred weight). `fresh`: those
    for the next backward, made outside the clock (the graphed backward's copies are
    counted as copies, not overhead)."""

    fresh: list = []

    @staticmethod
    def forward(x, *params):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        out = (g,) + tuple(_Noop.fresh)
        _Noop.fresh = []
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _clock(dev, kind="time"):
    """The calling thread's CPU time on CPU (the whole call, autograd's backward included,
    runs on it; time spent waiting for a core on a loaded machine is not counted), the
    wall clock on CUDA (autograd runs the backward on its device thread). kind
    "instructions": the core's counter of the calling thread's user-space instructions, in
    the unit the totals use (count / 1e9)."""
    if kind == "instructions":
        read = _C.graphs.phase_clock
        return lambda: read() * 1e-9
    return time.thread_time if dev == "cpu" else time.perf_counter


def _core_clock(dev, kind):
    return "instructions" if kind == "instructions" else ("thread_cpu" if dev == "cpu" else "wall")


def _instructions_available():
    try:
        _C.graphs.set_phase_timing(True, clock="instructions")
    except Exception as e:  # noqa: BLE001 - a VM without counters: the time tables only
        print(f"(no instruction counts: {e})\n")
        return False
    _C.graphs.set_phase_timing(False)
    return True


def _engine_floor(model, given, dev, reps, n, kind="time"):
    """A backward through a no-op node with edges to the input and every parameter, handing
    the parameters the gradients the graphed backward hands them (`given`, per parameter:
    a gradient or None): autograd's own cost, AccumulateGrad's included, which eager code
    and torch's graphs pay too."""
    clock = _clock(dev, kind)
    if kind == "instructions":
        _C.graphs.set_phase_timing(True, clock="instructions")
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    dy = torch.randn(4, 8, device=dev)
    params = [p for p in model.parameters() if p.requires_grad]
    best = []
    for _ in range(reps):
        total = 0.0
        for _ in range(n):
            y = _Noop.apply(x, *params)
            _Noop.fresh = [None if g is None else g.clone() for g in given]  # outside the clock, as the graphed copies
            t0 = clock()
            y.backward(dy)
            total += clock() - t0
            model.zero_grad(set_to_none=True)  # as between the graphed steps
        best.append(total / n)
    if kind == "instructions":
        _C.graphs.set_phase_timing(False)
    return statistics.median(best) * 1e6


def _overheads(model, g, x, dy, dev, reps, n, kind="time", evict=None):
    """`evict` (a tensor larger than the caches): rewritten before each call, outside the
    timed region, so the call finds its data evicted, as after a large graph's replays."""
    clock = _clock(dev, kind)
    per = {"call": [], "backward": [], "backward_dw": []}
    for _ in range(reps):
        wall = dict.fromkeys(per, 0.0)
        _C.graphs.set_phase_timing(True, clock=_core_clock(dev, kind))
        for _ in range(n):
            if evict is not None:
                evict.add_(1)
                _sync(dev)
            t0 = clock()
            y = g(x)
            _sync(dev)
            t1 = clock()
            y.backward(dy)
            _sync(dev)
            t2 = clock()
            g.backward_dw()
            _sync(dev)
            t3 = clock()
            model.zero_grad(set_to_none=True)
            wall["call"] += t1 - t0
            wall["backward"] += t2 - t1
            wall["backward_dw"] += t3 - t2
        totals = _C.graphs.phase_totals()
        _C.graphs.set_phase_timing(False)
        for k in per:
            per[k].append((wall[k] - totals[k]["replay_s"] - totals[k]["copy_s"]) / n * 1e6)
    return {k: statistics.median(v) for k, v in per.items()}


def _step_ratio(size, dev, reps):
    """A whole step (forward, backward, backward_dw, zero_grad) graphed against eager."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(*[dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True, device=dev)
                                  for _ in range(size)])
    graphed_model = torch.nn.Sequential(*[dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True, device=dev)
                                          for _ in range(size)])
    graphed_model.load_state_dict(eager.state_dict())
    x = torch.randn(4, 8, device=dev)
    g = dwgraph.make_graphed_callables(graphed_model, (x,))

    def eager_step():
        eager(x).sum().backward()
        for m in eager:
            m.backward_dw()
        eager.zero_grad(set_to_none=True)

    def graphed_step():
        g(x).sum().backward()
        g.backward_dw()
        graphed_model.zero_grad(set_to_none=True)

    n = max(3, 600 // size)
    times = {"eager": [], "graphed": []}
    for fn in (eager_step, graphed_step):
        fn()
    for _ in range(reps):  # alternated, so a load change hits both
        for name, fn in (("eager", eager_step), ("graphed", graphed_step)):
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            _sync(dev)
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    e, r = statistics.median(times["eager"]), statistics.median(times["graphed"])
    return e, r


def _ratios(rows, floors):
    first, last = rows[SIZES[0]], rows[SIZES[-1]]
    out = {}
    for k in ("call", "backward", "backward_dw"):
        net = k == "backward"
        a = first[k] - (floors[SIZES[0]] if net else 0)
        b = last[k] - (floors[SIZES[-1]] if net else 0)
        out[k] = f"{b / a:.2f}" if a > 0 else "n/a"
    return out


def main() -> None:
    args = bench_args(__doc__)
    dev = args.device
    reps = 3 if args.quick else 7
    counted = dev == "cpu" and _instructions_available()
    kinds = ("time", "instructions") if counted else ("time",)
    rows = {k: {} for k in kinds}
    floors = {k: {} for k in kinds}
    for size in SIZES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True, device=dev)
                                      for _ in range(size)])
        x = torch.randn(4, 8, device=dev)
        dy = torch.randn(4, 8, device=dev)
        g = dwgraph.make_graphed_callables(model, (x,))
        for _ in range(5):
            g(x).backward(dy)
            g.backward_dw()
            model.zero_grad(set_to_none=True)
        # What the graphed backward hands each parameter (before backward_dw()): the floor
        # hands the same.
        g(x).backward(dy)
        given = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
        g.backward_dw()
        model.zero_grad(set_to_none=True)
        n = max(20, (1000 if args.quick else 4000) // size)
        for kind in kinds:
            rows[kind][size] = _overheads(model, g, x, dy, dev, reps, n, kind)
            floors[kind][size] = _engine_floor(model, given, dev, reps, n, kind)

    # One layer again, its caches evicted before each call: the same work as the first row,
    # the memory state the largest tree's calls meet.
    torch.manual_seed(0)
    model = torch.nn.Sequential(dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True, device=dev))
    x, dy = torch.randn(4, 8, device=dev), torch.randn(4, 8, device=dev)
    g = dwgraph.make_graphed_callables(model, (x,))
    evict = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)  # 64 MiB
    cold = _overheads(model, g, x, dy, dev, reps, 200 if args.quick else 800, "time", evict)
    del evict

    print(f"# make_graphed_callables per-call host work over the replays ({dev}, "
          f"{'thread CPU time' if dev == 'cpu' else 'wall time'})\n")
    print("| modules | call us | backward us (net) | backward us (raw) | autograd floor us | backward_dw us |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in SIZES:
        o, floor = rows["time"][size], floors["time"][size]
        print(f"| {size} | {o['call']:.2f} | {o['backward'] - floor:.2f} | {o['backward']:.2f} | {floor:.2f} | "
              f"{o['backward_dw']:.2f} |")
    print(f"| 1, caches evicted before each call | {cold['call']:.2f} | | {cold['backward']:.2f} | | "
          f"{cold['backward_dw']:.2f} |")
    r = _ratios(rows["time"], floors["time"])
    print("\n| phase | largest / smallest (time) |\n|---|---:|")
    for k in r:
        print(f"| {k} | {r[k]} |")
    if counted:
        # The same phases counted in user-space instructions of the calling thread: what the
        # manager executes besides the replays and copies, free of the noise that the
        # difference of two large times carries when a graph of 1024 layers replays.
        print("\n# the same, in user-space instructions of the calling thread (thousands)\n")
        print("| modules | call k-instr | backward k-instr (net) | autograd floor k-instr | backward_dw k-instr |")
        print("|---:|---:|---:|---:|---:|")
        for size in SIZES:
            o, floor = rows["instructions"][size], floors["instructions"][size]
            # _overheads and _engine_floor scale by 1e6 (us): counts / 1e9 * 1e6 = thousands.
            print(f"| {size} | {o['call']:.1f} | {o['backward'] - floor:.1f} | {floor:.1f} | {o['backward_dw']:.1f} |")
        r = _ratios(rows["instructions"], floors["instructions"])
        print("\n| phase | largest / smallest (instructions) |\n|---|---:|")
        for k in r:
            print(f"| {k} | {r[k]} |")

    print("\n| modules | eager step us | graphed step us | graphed / eager |\n|---:|---:|---:|---:|")
    for size in SIZES if not args.quick else SIZES[:3]:
        e, r = _step_ratio(size, dev, reps)
        print(f"| {size} | {e:.1f} | {r:.1f} | {r / e:.2f} |", flush=True)


if __name__ == "__main__":
    main()
