"""Runs a test module's distributed scenarios in real processes (helper, not a test module).

``run_scenarios(path, names, device)`` starts one Python process per rank on this machine
(two gloo ranks on the CPU; on CUDA, NCCL with one rank per GPU, at most two), each of
which imports the module at ``path``, joins the process group (rendezvous through a file,
so no port is chosen up front; gloo's own connections bind free loopback ports), runs
``scenario_<name>(ctx)`` for every name in the same order on every rank, and hands back
each scenario's result, or a ``Failure`` (its exception's type, message and traceback).
One job serves a whole test module and device, so each pays the process start-up once.
Each rank's process has ``DIST_HARNESS_RANK`` set in its environment.

How it fails, fast and with the failing rank's own error:

* The ranks step from one scenario to the next through files in the job's directory
  (each rank writes its result, then waits for every rank's), not through a collective, so
  a rank whose scenario raised never meets its peer in the wrong collective, and the
  parent sees, at any time, which rank is still in which scenario.
* The parent watches every rank. A rank still in a scenario that every other rank has
  finished (or that every rank is still in) and whose process has used no CPU for
  ``STALL_S`` seconds waits on a collective or receive that no rank will join: the
  parent takes its Python stack (faulthandler, SIGUSR1), stops the job, and starts the
  remaining scenarios in a fresh one. Such a rank's result is a ``Failure`` of type
  ``PeerFailure`` whose message starts with the error of the rank that raised in that
  scenario (or ``RankBlocked`` where no rank raised: a hang), its traceback that rank's,
  then where this one was blocked.
* A rank that dies in a scenario (a signal, ``os._exit``) is a ``RankCrashed`` failure,
  with its output since the scenario began; the other ranks' results of that scenario
  are ``PeerFailure`` (their own errors, likely the lost connection, after the crash),
  and the job goes on in a fresh one likewise (at most ``max_restarts`` times; the
  scenarios left after that are ``NotRun`` failures).
* A rank that fails outside the scenarios (importing the module, joining the process
  group, leaving it) ends the job at once: ``run_scenarios`` raises RuntimeError with that
  rank's error first, then every rank's output.
* Nothing else depends on time: the start-up (imports are slow on a busy machine) is not
  counted against the collectives, whose timeout (gloo) is the job's; ``timeout`` is only the
  last resort for a rank that keeps computing forever (RuntimeError with every rank's
  stack). Scenarios must not sleep for ``STALL_S`` seconds (that reads as blocked). NCCL
  ranks spin while they wait, so on CUDA a stall is not seen: a blocked rank there ends at
  its collective timeout (``CUDA_COLLECTIVE_TIMEOUT_S``), as a failure or a crash.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import pytest
import torch

WORLD_SIZE = 2
JOB_TIMEOUT_S = 600.0  # last resort only (see above): generous for a loaded machine
STALL_S = 5.0  # no CPU for this long, in a scenario no rank will finish with it: blocked
MAX_RESTARTS = 3
# NCCL ranks spin while they wait (no stall to see): their collectives time out instead.
CUDA_COLLECTIVE_TIMEOUT_S = 120.0
_IDLE_CPU_S = 0.05  # a blocked process uses (almost) none
_POLL_S = 0.05
_MARK = "--- dist_harness: scenario "
_TAIL = 6000


@dataclasses.dataclass
class Context:
    rank: int
    world_size: int
    device: torch.device


def world_size(device: str) -> int:
    return WORLD_SIZE if device == "cpu" else min(WORLD_SIZE, torch.cuda.device_count())


DEVICES = [
    pytest.param("cpu", id="gloo-cpu"),
    pytest.param("cuda", id="nccl-cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device")]),
]


def device_results(request, cpu_results: str, names: List[str], min_world: int = 1):
    """The body of a module's device-parametrised results fixture: on the CPU, the
    results of the module's CPU job (fixture ``cpu_results``); on CUDA, a job of `names`."""
    if request.param == "cpu":
        return request.getfixturevalue(cpu_results)
    if world_size("cuda") < min_world:
        pytest.skip(f"needs {min_world} GPUs (NCCL runs one rank per GPU)")
    return run_scenarios(request.module.__file__, names, device="cuda")


@dataclasses.dataclass
class Failure:
    """A scenario that raised: the exception's type name, message and traceback. The
    harness's own types: ``RankCrashed`` (the process died), ``RankBlocked`` (it waited
    on what no rank would do), ``PeerFailure`` (another rank failed first: its error
    leads the message and the traceback), ``NotRun``."""
    type: str
    message: str
    traceback: str


def run_scenarios(path: str, names: List[str], device: str = "cpu", timeout: float = JOB_TIMEOUT_S,
                  max_restarts: int = MAX_RESTARTS) -> Dict[str, List[Any]]:
    """{name: [result of rank 0, result of rank 1, ...]}; raises RuntimeError with the
    failing rank's error and every rank's output when a rank fails outside the scenarios,
    or when the job runs out of time."""
    world = world_size(device)
    deadline = time.monotonic() + timeout
    results: Dict[str, List[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dwgraph-dist-") as tmp:
        todo, aborted = list(names), []
        for attempt in range(max_restarts + 1):
            job = _Job(path, os.path.join(tmp, f"job{attempt}"), world, device, todo, deadline, timeout)
            done, abort = job.run()
            results.update(done)
            if abort is None:
                todo = []
                break
            name, per_rank = abort
            results[name] = per_rank
            aborted.append(f"{name}: {next(r for r in per_rank if isinstance(r, Failure)).message}")
            todo = todo[len(done) + 1:]
            if not todo:
                break
        for name in todo:
            results[name] = [Failure("NotRun", f"not run: the scenarios that stopped the job used up its "
                                     f"{max_restarts} restarts:\n" + "\n".join(aborted), "")] * world
    return {name: results[name] for name in names}


def _cpu_seconds(pid: int) -> Optional[float]:
    """User and system CPU time of the process, all its threads (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _exit_status(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}" if rc else "exited before it finished"


class _Job:
    """One start of the ranks' processes on the scenarios `names`."""

    def __init__(self, path, jobdir, world, device, names, deadline, timeout):
        self.path, self.dir, self.world, self.device, self.names = path, jobdir, world, device, list(names)
        self.deadline, self.timeout = deadline, timeout
        self.module = os.path.basename(path)

    def _file(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _has(self, name: str) -> bool:
        return os.path.exists(self._file(name))

    def _load(self, name: str):
        return torch.load(self._file(name), weights_only=False)

    def run(self):
        """(the results of the scenarios all ranks finished, in order; None, or
        (name, per-rank results) of the scenario that stopped the job)."""
        os.makedirs(self.dir)
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        # gloo's collectives never time out before the job does (the parent acts first).
        collective_timeout = max(self.deadline - time.monotonic(), 1.0) + 60.0
        if self.device != "cpu":
            collective_timeout = min(collective_timeout, CUDA_COLLECTIVE_TIMEOUT_S)
        self.procs, self.logs = [], []
        try:
            for rank in range(self.world):
                log = open(self._file(f"rank{rank}.log"), "w")
                self.logs.append(log)
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), self.path, self.dir, str(rank), str(self.world),
                     self.device, str(collective_timeout), *self.names],
                    stdout=log, stderr=subprocess.STDOUT, env=dict(env, DIST_HARNESS_RANK=str(rank))))
            return self._watch()
        finally:
            self._stop()

    def _stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        for log in self.logs:
            log.close()

    def _output(self, rank: int, since: Optional[str] = None) -> str:
        text = _read(self._file(f"rank{rank}.log"))
        if since is not None and f"{_MARK}{since}\n" in text:
            text = text.rsplit(f"{_MARK}{since}\n", 1)[1]
        return text[-_TAIL:]

    def _stack(self, rank: int, wait_s: float = 5.0) -> str:
        """The rank's Python stack, all threads (faulthandler, on SIGUSR1)."""
        path = self._file(f"stack.{rank}")
        try:
            self.procs[rank].send_signal(signal.SIGUSR1)
        except OSError:
            return ""
        end, size = time.monotonic() + wait_s, -1
        while time.monotonic() < end:
            time.sleep(0.1)
            now = os.path.getsize(path) if os.path.exists(path) else 0
            if now and now == size:
                break
            size = now
        return _read(path)

    def _watch(self):
        n, world = len(self.names), self.world
        done = [0] * world  # scenarios each rank has finished
        idle: List[Optional[tuple]] = [None] * world  # (scenario, cpu then, since when)
        while True:
            now = time.monotonic()
            for r in range(world):
                while done[r] < n and self._has(f"done.{done[r]}.{r}"):
                    done[r] += 1
            rcs = [p.poll() for p in self.procs]
            finished = [rc == 0 and self._has(f"finished.{r}") for r, rc in enumerate(rcs)]
            if all(finished):
                return self._collect(n), None
            failed = [r for r, rc in enumerate(rcs) if rc is not None and not finished[r]]
            if failed:
                return self._failed(failed, rcs, done)
            if all(self._has(f"joined.{r}") for r in range(world)) and min(done) < n:
                k = min(done)
                laggards = [r for r in range(world) if done[r] == k]
                stalled = []
                for r in laggards:
                    cpu = _cpu_seconds(self.procs[r].pid)
                    if cpu is None:
                        idle[r] = None
                    elif idle[r] is None or idle[r][0] != k or cpu - idle[r][1] > _IDLE_CPU_S:
                        idle[r] = (k, cpu, now)
                    stalled.append(idle[r] is not None and now - idle[r][2] >= STALL_S)
                if all(stalled):
                    return self._collect(k), self._blocked(k, laggards)
            if now > self.deadline:
                raise self._timed_out(done)
            time.sleep(_POLL_S)

    def _collect(self, k: int) -> Dict[str, List[Any]]:
        return {self.names[i]: [self._load(f"done.{i}.{r}") for r in range(self.world)] for i in range(k)}

    def _own(self, k: int, rank: int):
        return self._load(f"done.{k}.{rank}") if self._has(f"done.{k}.{rank}") else None

    def _blocked(self, k: int, laggards: Sequence[int]):
        name = self.names[k]
        stacks = {r: self._stack(r) for r in laggards}
        own = {r: self._own(k, r) for r in range(self.world)}  # before the stop, which wakes the blocked
        self._stop()
        laggards = [r for r in laggards if own[r] is None]  # one that finished after all was not blocked
        own = {r: res for r, res in own.items() if r not in laggards}
        raised = [r for r, res in own.items() if isinstance(res, Failure)]
        per_rank: List[Any] = []
        for r in range(self.world):
            if r not in laggards:
                per_rank.append(own[r])
                continue
            where = f"\n--- rank {r} was blocked in scenario {name} here:\n{stacks[r]}"
            if raised:
                p = raised[0]
                per_rank.append(Failure(
                    "PeerFailure", f"rank {p} raised {own[p].type}: {own[p].message} -- and rank {r} was then "
                    f"blocked in the scenario (no CPU for {STALL_S:.0f} s; stopped)", own[p].traceback + where))
            else:
                whom = "every other rank had finished it" if own else "as was every rank"
                per_rank.append(Failure(
                    "RankBlocked", f"rank {r} was blocked in scenario {name} (no CPU for {STALL_S:.0f} s; stopped) "
                    f"while {whom}: a collective or receive that no rank would join", where))
        return name, per_rank

    def _failed(self, failed: List[int], rcs, done):
        """A rank ended before it finished: in a scenario, that scenario's results;
        anywhere else, RuntimeError."""
        def key(r):  # the first to fail: a crash (no Python error recorded), else the earliest error
            return (self._has(f"fatal.{r}"), self._load(f"fatal.{r}")["time"] if self._has(f"fatal.{r}") else 0, r)

        for q in range(self.world):  # what they wrote before they ended
            while done[q] < len(self.names) and self._has(f"done.{done[q]}.{q}"):
                done[q] += 1
        r = min(failed, key=key)
        k = done[r]
        fatal = self._load(f"fatal.{r}") if self._has(f"fatal.{r}") else None
        in_scenario = self._has(f"joined.{r}") and k < len(self.names) and k == min(done)
        if not in_scenario:
            self._stop()
            raise self._error(r, rcs[r], fatal, done)
        name = self.names[k]
        self._stop()
        output = self._output(r, since=name)
        crash = Failure("RankCrashed", f"rank {r} {_exit_status(rcs[r])} in scenario {name}"
                        + (f": {fatal['error']}" if fatal else ""),
                        f"--- rank {r}'s output in scenario {name}:\n{output}")
        per_rank: List[Any] = []
        for q in range(self.world):
            res = crash if q == r else self._own(k, q)
            if q != r and (res is None or isinstance(res, Failure)):
                then = (f"this rank then raised {res.type}: {res.message}" if res is not None else
                        "this rank was stopped before it finished the scenario")
                res = Failure("PeerFailure", f"{crash.message} -- {then}", crash.traceback + (
                    f"\n--- rank {q}'s own error:\n{res.traceback}" if res is not None else ""))
            per_rank.append(res)
        return self._collect(k), (name, per_rank)

    def _where(self, r: int, done) -> str:
        if not self._has(f"ready.{r}"):
            return f"while importing {self.module}"
        if not self._has(f"joined.{r}"):
            return "while joining the process group"
        if done[r] >= len(self.names):
            return "after its last scenario"
        return f"after scenario {self.names[done[r] - 1]}" if done[r] else "before its first scenario"

    def _logs(self, first: int) -> str:
        order = [first] + [r for r in range(self.world) if r != first]
        return "\n".join(f"--- rank {r}'s output:\n{self._output(r)}" for r in order)

    def _error(self, r: int, rc: int, fatal, done) -> RuntimeError:
        what = f"raised:\n{fatal['traceback']}" if fatal else f"{_exit_status(rc)}."
        return RuntimeError(f"distributed job {self.module}: rank {r} {what.rstrip()}\n"
                            f"(rank {r} {self._where(r, done)}; the job was stopped.)\n\n{self._logs(r)}")

    def _timed_out(self, done) -> RuntimeError:
        running = [r for r, p in enumerate(self.procs) if p.poll() is None]
        stacks = {r: self._stack(r) for r in running}
        self._stop()
        where = "; ".join(f"rank {r} in scenario {self.names[done[r]]}"
                          if self._has(f"joined.{r}") and done[r] < len(self.names) else
                          f"rank {r} {self._where(r, done)}" for r in running)
        return RuntimeError(f"distributed job {self.module} timed out after {self.timeout:.0f} s ({where}); "
                            "the job never stalled (a rank kept using CPU):\n\n"
                            + "\n".join(f"--- rank {r}'s stack:\n{stacks[r]}" for r in running)
                            + "\n" + self._logs(running[0] if running else 0))


def _save(path: str, obj) -> None:
    """Written whole or not at all (the parent and the peers poll for the file)."""
    try:
        torch.save(obj, path + ".tmp")
    except Exception as e:  # an unpicklable result
        torch.save(Failure(type(e).__name__, f"the scenario's result could not be saved: {e}",
                           traceback.format_exc()), path + ".tmp")
    os.replace(path + ".tmp", path)


def _wait_for(paths: List[str], parent: int) -> None:
    """Until every file exists (the parent stops a job that waits too long)."""
    pause = 0.001
    while not all(os.path.exists(p) for p in paths):
        if os.getppid() != parent:
            os._exit(3)  # the parent is gone
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S)


def _child(path: str, jobdir: str, rank: int, world: int, device: str, timeout: float, names: List[str]) -> None:
    import faulthandler

    parent = os.getppid()
    try:  # die with the parent, even while blocked in a collective
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    faulthandler.enable(all_threads=True)  # a crash prints every thread's stack to the log
    stacks = open(os.path.join(jobdir, f"stack.{rank}"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    def file(name):
        return os.path.join(jobdir, name)

    def wait(prefix):
        _wait_for([file(f"{prefix}.{r}") for r in range(world)], parent)

    try:
        import torch.distributed as dist

        spec = importlib.util.spec_from_file_location("dwgraph_dist_scenarios", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        open(file(f"ready.{rank}"), "w").close()
        wait("ready")  # every rank has imported: the rendezvous does not wait on imports
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"file://{file('rendezvous')}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        open(file(f"joined.{rank}"), "w").close()
        ctx = Context(rank=rank, world_size=world, device=torch.device(device, rank) if device == "cuda" else
                      torch.device("cpu"))
        for k, name in enumerate(names):
            print(f"{_MARK}{name}", flush=True)
            try:
                result = getattr(module, f"scenario_{name}")(ctx)
            except Exception as e:  # reported to the test, which decides
                result = Failure(type(e).__name__, str(e), traceback.format_exc())
                print(f"scenario {name} raised:\n{result.traceback}", flush=True)
            _save(file(f"done.{k}.{rank}"), result)
            wait(f"done.{k}")
        dist.destroy_process_group()
        open(file(f"finished.{rank}"), "w").close()
    except BaseException as e:
        tb = traceback.format_exc()
        print(f"dist_harness: rank {rank} failed:\n{tb}", flush=True)
        _save(file(f"fatal.{rank}"), dict(traceback=tb, error=f"{type(e).__name__}: {e}", time=time.time()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown to hang in


if __name__ == "__main__":
    # Through the importable module, so results pickle as dist_harness.Failure.
    import dist_harness

    dist_harness._child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
                        float(sys.argv[6]), sys.argv[7:])
