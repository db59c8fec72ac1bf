"""Per-call host work of make_graphed_callables in executed instructions (contract C10), for
module trees of 1, 16, 128 and 1024 deferred Linear layers: the deterministic companion of
bench_overhead.py.

bench_overhead.py subtracts the time of the replays and copies from each phase's time; for a
graph of 1024 layers that is the difference of two numbers of several milliseconds, and
cache misses and a shared core move it by more than the overhead itself. Here the same
phases run under valgrind's callgrind, which counts the instructions each function executes
(no timing, no load dependence), after warmup (the counters are zeroed once the graphs are
captured and the first checks ran). Per call of each entry point of the core
(``GraphManager::replay_call``, ``::backward``, ``::backward_dw``) it prints the instructions
outside the graphs' replays (a replay includes its checks: those of backward_dw()'s parts run
together before the first of them, ``Graph::check_run``), and apart the gradient hand-off (``Landing::land`` and
``Landing::check``: one checked ``.grad`` per parameter, which eager's AccumulateGrad pays
as well). Contract C10 asks the
rest not to grow with the tree. Two last columns count what the replays of a step execute
besides their kernels (``Graph::replay()`` less ``HostGraph::launch()``: the pool scope, the
profiler range, the version bumps and the pool's replay-order bookkeeping,
``PoolOrder::replayed``), one replay per call and per backward and one per deferring
module's part in backward_dw(): that part grows with the deferring modules.

The Python front end and pybind's call are not counted here (bench_overhead.py's time covers
them; they do not depend on the tree).

The same for ``@graphed_step`` (the model of bench_step.py's overhead), counted from the
start of the timed loop to its end, the Python front end included, and nothing else: the
loop runs inside exec(), to which collection is restricted (until 2026-12-05 the Python of
the zero and dump subprocess calls around it was counted in, about 50,000 instructions per
step of the five).

    python bench/bench_overhead_instructions.py [--quick]   (needs valgrind; CPU only)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

from common import bench_args

SIZES = (1, 16, 128, 1024)
ENTRY = {
    "call": "dwgraph::graphs::GraphManager::replay_call(",
    "backward": "dwgraph::graphs::GraphManager::backward(",
    "backward_dw": "dwgraph::graphs::GraphManager::backward_dw(",
}
REPLAY = "dwgraph::graphs::Graph::replay()"
LAUNCH = "dwgraph::graphs::HostGraph::launch()"
ORDER = "dwgraph::graphs::PoolOrder::replayed("
# The checks of a run of graphs replayed together (backward_dw()'s parts), done before the
# first of them so that a refusal runs nothing; each replay of the run then skips its own
# (Note [A checked run of consecutive captures]): counted with the replays.
RUN_CHECK = "dwgraph::graphs::Graph::check_run("
# The hand-off and its per-parameter .grad check (dtype, shape, device: what eager's
# AccumulateGrad checks too).
HANDOFF = ("dwgraph::graphs::Landing::land(", "dwgraph::graphs::Landing::check(")

_DRIVER = r"""
import os, subprocess, sys, torch, dwgraph
n, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(*[dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True) for _ in range(n)])
x, dy = torch.randn(4, 8), torch.randn(4, 8)
g = dwgraph.make_graphed_callables(model, (x,))
def step():
    g(x).backward(dy)
    g.backward_dw()
    model.zero_grad(set_to_none=True)
for _ in range(3):
    step()
subprocess.run(["callgrind_control", "--zero", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
for _ in range(steps):
    step()
"""


# @graphed_step: the model of bench_step.overhead (Linear(4, 4) layers, SGD with momentum,
# zero_grad inside the step). Counted from the loop's start to its end (callgrind_control
# --zero, --dump), the Python front end included: the whole call besides the replay.
_STEP_DRIVER = r"""
import os, subprocess, sys
sys.path.insert(0, sys.argv[3])
import bench_step
n, steps = int(sys.argv[1]), int(sys.argv[2])
step, _ = bench_step.overhead_step(n)
for _ in range(6):
    step()
pid = str(os.getpid())
def ctl(what):
    subprocess.run(["callgrind_control", what, pid], check=True, stdout=subprocess.DEVNULL)
# Counted inside exec() only (--toggle-collect=builtin_exec): the steps, not the Python of
# the zero and dump subprocess calls around them.
loop = compile("for _ in range(steps):\n    step()", "<steps>", "exec")  # compiled outside the count
ctl("--zero")
exec(loop)
ctl("--dump")
assert step.num_captures == 1, step.num_captures
"""
# The core's entry points of a call: the general one, and the plain call's (Note [A step's
# plain call]), which replays without the front end building the key.
STEP_CALLS = ("dwgraph::graphs::GraphedStep::operator()(", "dwgraph::graphs::GraphedStep::replay_if_captured(")
STEP_VARIANT = "dwgraph::graphs::GraphedStep::variant_for("


def _inclusive(flat: str, entry: str) -> int:
    """Inclusive instructions of `entry` in callgrind_annotate --inclusive=yes output."""
    if entry == "PROGRAM TOTALS":
        m = re.search(r"^\s*([\d,]+) .*PROGRAM TOTALS", flat, re.M)
        return int(m.group(1).replace(",", "")) if m else 0
    # The largest line: a recursive call appears again as "name'2", inside the first.
    return max((int(line.split()[0].replace(",", "")) for line in flat.splitlines()
                if entry in line and re.match(r"^\s*[\d,]+ ", line)), default=0)


def _measure_step(size: int, steps: int, workdir: str):
    driver = os.path.join(workdir, "step_driver.py")
    with open(driver, "w") as f:
        f.write(_STEP_DRIVER)
    out = os.path.join(workdir, f"step{size}.out")
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--collect-atstart=no",
                    "--toggle-collect=builtin_exec", sys.executable, driver, str(size),
                    str(steps), os.path.dirname(os.path.abspath(__file__))], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    flat = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out + ".1"], check=True,
                          capture_output=True, text=True).stdout
    total, call = _inclusive(flat, "PROGRAM TOTALS"), sum(_inclusive(flat, c) for c in STEP_CALLS)
    replay, variant = _inclusive(flat, REPLAY), _inclusive(flat, STEP_VARIANT)
    return {"outside": (total - replay) / steps, "python": (total - call) / steps, "variant": variant / steps,
            "core": (call - replay - variant) / steps}


def _children(tree: str, entry: str):
    """(inclusive, {child: inclusive}) of `entry` from callgrind_annotate --tree=calling."""
    lines = tree.splitlines()
    for i, line in enumerate(lines):
        if "*" in line and entry in line and re.match(r"^\s*[\d,]+ ", line):
            total = int(line.split()[0].replace(",", ""))
            kids = {}
            for child in lines[i + 1:]:
                if ">" not in child or not re.match(r"^\s*[\d,]+ ", child):
                    break
                name = child.split(">", 1)[1].strip()
                kids[name] = kids.get(name, 0) + int(child.split()[0].replace(",", ""))
            return total, kids
    return 0, {}


def _measure(size: int, steps: int, workdir: str):
    driver = os.path.join(workdir, "driver.py")
    with open(driver, "w") as f:
        f.write(_DRIVER)
    out = os.path.join(workdir, f"cg{size}.out")
    toggles = [f"--toggle-collect={e}*" for e in ENTRY.values()]
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--collect-atstart=no", *toggles,
                    sys.executable, driver, str(size), str(steps)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--tree=calling", "--threshold=100", out],
                          check=True, capture_output=True, text=True).stdout
    row = {}
    # What each replay does besides running its kernels (HostGraph::launch): the pool scope,
    # its checks, the profiler range, the version bumps and the pool's replay-order
    # bookkeeping (PoolOrder::replayed), summed over every replay of a step: one per call and
    # per backward, one per part in backward_dw() (so it grows with the deferring modules).
    total, kids = _children(tree, REPLAY)
    launch = sum(v for k, v in kids.items() if LAUNCH in k)
    order = sum(v for k, v in kids.items() if ORDER in k)
    row["replays"] = ((total - launch) / steps, order / steps)
    for phase, entry in ENTRY.items():
        total, kids = _children(tree, entry)
        replay = sum(v for k, v in kids.items() if REPLAY in k or RUN_CHECK in k)
        handoff = sum(v for k, v in kids.items() if any(h in k for h in HANDOFF))
        row[phase] = ((total - replay - handoff) / steps, handoff / steps)
    return row


def main() -> None:
    args = bench_args(__doc__)
    if args.device != "cpu" or not (shutil.which("valgrind") and shutil.which("callgrind_annotate")):
        print("valgrind (callgrind) on CPU is needed; nothing measured")
        return
    steps = 5 if args.quick else 20
    print("# make_graphed_callables: instructions per call outside the graph replay (callgrind, after warmup)\n")
    print("| modules | call | backward | backward_dw | backward_dw hand-off (Landing::land, ::check) | "
          "replays besides their kernels, per step | of which the pool's replay order |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for size in SIZES:
            r = rows[size] = _measure(size, steps, d)
            print(f"| {size} | {r['call'][0]:,.0f} | {r['backward'][0]:,.0f} | {r['backward_dw'][0]:,.0f} | "
                  f"{r['backward_dw'][1]:,.0f} | {r['replays'][0]:,.0f} | {r['replays'][1]:,.0f} |", flush=True)
    print("\n| phase | largest / smallest |\n|---|---:|")
    for phase in ENTRY:
        a, b = rows[SIZES[0]][phase][0], rows[SIZES[-1]][phase][0]
        print(f"| {phase} | {b / a:.2f} |" if a > 0 else f"| {phase} | n/a |")
    print("\n# @graphed_step: instructions per call outside the graph replay (callgrind, after warmup;\n"
          "# the Python front end included; hand-off and copies are in 'core')\n")
    print("| modules | whole call besides replay | Python front end | variant check (incl. its Python) | "
          "rest of the core (key, checks, copies, hand-off) |")
    print("|---:|---:|---:|---:|---:|")
    step_rows = {}
    with tempfile.TemporaryDirectory() as d:
        for size in SIZES:
            r = step_rows[size] = _measure_step(size, steps, d)
            print(f"| {size} | {r['outside']:,.0f} | {r['python']:,.0f} | {r['variant']:,.0f} | {r['core']:,.0f} |",
                  flush=True)
    a, b = step_rows[SIZES[0]]["outside"], step_rows[SIZES[-1]]["outside"]
    print(f"\n| graphed_step | largest / smallest {b / a:.2f} |")


if __name__ == "__main__":
    main()
