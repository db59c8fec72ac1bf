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
non-deferred parameter as dwgraph's) and subtracted ("net"). Contract C10 asks for overhead that does
not grow with the tree (the largest at most 1.2x the smallest) and at most 5 us. A last row
runs the one-layer tree with the caches evicted before each call (a 64 MiB tensor rewritten
outside the timed region): the work of the first row in the memory state a large tree's
calls meet. bench_overhead_instructions.py counts the work itself.

The clock (2026-12-05): on CPU the wall clock by default (``time.perf_counter`` and the
core's steady clock, tens of nanoseconds a read). The calling thread's CPU time
(``--thread-clock``, the default before) does not count time spent waiting for a core on a
loaded machine, but on this VM each read is a system call of about 0.6 us, and a call
reads it eight times (twice around the call, twice around its replay and each copy): a
few microseconds of every phase's figure were the clock's own. Run on an idle machine, or
pass ``--thread-clock`` on a loaded one and read the clock's cost (printed) into it.

A second table sets each phase beside torch's own mechanism over the same kernels
(contract C10's "over Graph.replay() of the same graph"): torch.cuda.make_graphed_callables'
autograd.Function (copy the input into a static input, ``Graph.replay()`` the forward,
return a copy of the static output; on backward copy the gradient in, replay the backward
graph, return copies of the static gradients) over dwgraph Graphs captured from an
identical copy of the tree, called alternately with the graphed callable in one loop, the
difference taken call by call. Replays of the same kernels in two graphs differ by their
memory placement (by up to a third at 1024 layers on this machine), so the large trees'
differences carry that, not the wrappers'.

A third table gives whole steps against the same modules run eagerly.

    python bench/bench_overhead.py [--quick] [--thread-clock]   (--device cuda: the same on a GPU)
"""

from __future__ import annotations

import statistics
import time

import torch

import dwgraph
from dwgraph import _C
from common import bench_args
from dwgraph.graphs import Graph, graph_pool_handle

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


THREAD_CLOCK = False  # --thread-clock: the calling thread's CPU time on CPU (see the docstring)


def _clock(dev, kind="time"):
    """The wall clock (on CPU with --thread-clock the calling thread's CPU time: the whole
    call, autograd's backward included, runs on it, and time spent waiting for a core on a
    loaded machine is not counted; on CUDA autograd runs the backward on its device thread,
    so the wall clock always). kind "instructions": the core's counter of the calling
    thread's user-space instructions, in the unit the totals use (count / 1e9)."""
    if kind == "instructions":
        read = _C.graphs.phase_clock
        return lambda: read() * 1e-9
    return time.thread_time if dev == "cpu" and THREAD_CLOCK else time.perf_counter


def _core_clock(dev, kind):
    if kind == "instructions":
        return "instructions"
    return "thread_cpu" if dev == "cpu" and THREAD_CLOCK else "wall"


def _clock_cost_us(dev):
    """What one read of the Python-side clock costs (the core's costs the same)."""
    read = _clock(dev)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        read()
    return (time.perf_counter() - t0) / n * 1e6


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


def _graphed_phases(g, x, dy, clock, dev):
    """One graphed call, its backward and backward_dw(): the time of each."""
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
    return t1 - t0, t2 - t1, t3 - t2


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
            for k, t in zip(per, _graphed_phases(g, x, dy, clock, dev)):
                wall[k] += t
            model.zero_grad(set_to_none=True)
        totals = _C.graphs.phase_totals()
        _C.graphs.set_phase_timing(False)
        for k in per:
            per[k].append((wall[k] - totals[k]["replay_s"] - totals[k]["copy_s"]) / n * 1e6)
    return {k: statistics.median(v) for k, v in per.items()}


class _TorchStyle(torch.autograd.Function):
    """torch.cuda.make_graphed_callables' mechanics over dwgraph Graphs: the forward copies
    the input into the static input, replays the forward graph and returns a copy of the
    static output (dwgraph's call returns a copy too); the backward copies the gradient in,
    replays the backward graph and returns copies of the static gradients."""

    @staticmethod
    def forward(ctx, x, run, *params):
        ctx.run = run
        run["sx"].copy_(x)
        run["fwd"].replay()
        return run["sy"].clone()

    @staticmethod
    def backward(ctx, dy):
        run = ctx.run
        run["sdy"].copy_(dy)
        run["bwd"].replay()
        return (None, None) + tuple(None if g is None else g.clone() for g in run["grads"])


def _tree(size, dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True, device=dev)
                                 for _ in range(size)])


def _torch_style(size, x, dy, dev):
    """Forward and backward graphs of an identical tree, captured as torch's
    make_graphed_callables captures them (torch.autograd.grad of the static output over the
    parameters; the deferred weights get None there, as in the graphed backward)."""
    twin = _tree(size, dev)
    params = [p for p in twin.parameters() if p.requires_grad]
    sx, sdy = x.clone().requires_grad_(True), dy.clone()
    pool = graph_pool_handle(dev)

    def warm():
        torch.autograd.grad(twin(sx), params, sdy, allow_unused=True)
        for m in twin:
            m.backward_dw()

    if dev == "cuda":  # warmup on a side stream, as torch's make_graphed_callables does
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                warm()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    else:
        for _ in range(2):
            warm()
    fwd, bwd = Graph(dev), Graph(dev)
    with fwd.capture(pool):
        sy = twin(sx)
    with bwd.capture(pool):
        grads = torch.autograd.grad(sy, params, sdy, allow_unused=True)
    return {"sx": sx, "sy": sy, "sdy": sdy, "fwd": fwd, "bwd": bwd, "grads": grads, "twin": twin,
            "params": params}


def _against_torch_style(size, dev, reps):
    """Per call and per backward: the graphed callable and torch's mechanism over graphs of
    the same kernels, alternated in one loop; the median of the call-by-call differences."""
    model = _tree(size, dev)
    x, dy = torch.randn(4, 8, device=dev), torch.randn(4, 8, device=dev)
    g = dwgraph.make_graphed_callables(model, (x,))
    run = _torch_style(size, x, dy, dev)
    xr = x.clone().requires_grad_(True)
    clock = _clock(dev)
    ours, theirs = [], []
    for i in range(5 + reps * max(10, 600 // size)):
        call, backward, _ = _graphed_phases(g, x, dy, clock, dev)
        model.zero_grad(set_to_none=True)
        t0 = clock()
        yb = _TorchStyle.apply(xr, run, *run["params"])
        _sync(dev)
        t1 = clock()
        yb.backward(dy)
        _sync(dev)
        t2 = clock()
        run["twin"].zero_grad(set_to_none=True)
        xr.grad = None
        if i >= 5:  # the first calls warm up
            ours.append((call, backward))
            theirs.append((t1 - t0, t2 - t1))
    out = {}
    for k, phase in enumerate(("call", "backward")):
        a = statistics.median(o[k] for o in ours) * 1e6
        b = statistics.median(t[k] for t in theirs) * 1e6
        d = statistics.median((o[k] - t[k]) * 1e6 for o, t in zip(ours, theirs))
        out[phase] = (a, b, d)
    return out


def _step_ratio(size, dev, reps):
    """A whole step (forward, backward, backward_dw, zero_grad) graphed against eager."""
    eager, graphed_model = _tree(size, dev), _tree(size, dev)  # the same weights (seeded)
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
    global THREAD_CLOCK
    args = bench_args(__doc__, lambda p: p.add_argument(
        "--thread-clock", action="store_true", help="on CPU, time by the calling thread's CPU time (a loaded machine)"))
    dev = args.device
    THREAD_CLOCK = args.thread_clock
    reps = 3 if args.quick else 7
    counted = dev == "cpu" and _instructions_available()
    kinds = ("time", "instructions") if counted else ("time",)
    rows = {k: {} for k in kinds}
    floors = {k: {} for k in kinds}
    for size in SIZES:
        model = _tree(size, dev)
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
    model = _tree(1, dev)
    x, dy = torch.randn(4, 8, device=dev), torch.randn(4, 8, device=dev)
    g = dwgraph.make_graphed_callables(model, (x,))
    evict = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)  # 64 MiB
    cold = _overheads(model, g, x, dy, dev, reps, 200 if args.quick else 800, "time", evict)
    del evict

    clock_name = "thread CPU time" if dev == "cpu" and THREAD_CLOCK else "wall time"
    print(f"# make_graphed_callables per-call host work over the replays ({dev}, {clock_name}; "
          f"one clock read {_clock_cost_us(dev):.3f} us, about eight per call)\n")
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

    print(f"\n# against torch's make_graphed_callables mechanism over graphs of the same kernels ({clock_name}; "
          "median of the call-by-call differences)\n")
    print("| modules | call us | torch-style call us | difference us | backward us | torch-style backward us | "
          "difference us |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in SIZES:
        r = _against_torch_style(size, dev, reps)
        print(f"| {size} | " + " | ".join(f"{a:.1f} | {b:.1f} | {d:.1f}" for a, b, d in (r["call"], r["backward"])) + " |",
              flush=True)

    print("\n| modules | eager step us | graphed step us | graphed / eager |\n|---:|---:|---:|---:|")
    for size in SIZES if not args.quick else SIZES[:3]:
        e, r = _step_ratio(size, dev, reps)
        print(f"| {size} | {e:.1f} | {r:.1f} | {r / e:.2f} |", flush=True)


if __name__ == "__main__":
    main()
