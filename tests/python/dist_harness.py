"""Runs a test module's distributed scenarios in real processes (helper, not a test module).

``run_scenarios(path, names, device)`` starts one Python process per rank on this machine
(two gloo ranks on the CPU; on CUDA, NCCL with one rank per GPU, at most two), each of
which imports the module at ``path``, joins the process group (rendezvous through a file,
so no port is chosen up front; gloo's own connections bind free loopback ports), runs
``scenario_<name>(ctx)`` for every name in the same order on every rank, and sends back
each scenario's result (or its exception type and message). One job serves a whole test
module and device, so each pays the process start-up once. Everything is bounded in time:
the collectives by the process group's timeout, the job by ``timeout``.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List

import pytest
import torch

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 60  # generous: a loaded machine starts the processes slowly


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
    """A scenario that raised: the exception's type name, message and traceback."""
    type: str
    message: str
    traceback: str


def run_scenarios(path: str, names: List[str], device: str = "cpu", timeout: float = 240.0) -> Dict[str, List[Any]]:
    """{name: [result of rank 0, result of rank 1, ...]}; raises RuntimeError with the
    processes' output when the job fails or runs out of time."""
    world = world_size(device)
    with tempfile.TemporaryDirectory(prefix="dwgraph-dist-") as tmp:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                               os.environ.get("PYTHONPATH", "")]))
        procs = []
        for rank in range(world):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
            procs.append((subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), path, tmp, str(rank), str(world), device, str(timeout),
                 *names],
                stdout=log, stderr=subprocess.STDOUT, env=env), log))
        deadline = time.monotonic() + timeout
        failed = False
        for p, log in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                failed = True
            failed = failed or p.returncode != 0
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        if failed:
            logs = "\n".join(f"--- rank {r}:\n" + open(os.path.join(tmp, f"rank{r}.log")).read()[-6000:]
                             for r in range(world))
            raise RuntimeError(f"distributed job {os.path.basename(path)} failed or timed out after "
                               f"{timeout:.0f} s:\n{logs}")
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        return {name: [res[name] for res in per_rank] for name in names}


def _child(path: str, tmp: str, rank: int, world: int, device: str, timeout: float, names: List[str]) -> None:
    import faulthandler

    import torch.distributed as dist

    # A hung rank prints where it waits, then exits, before the parent gives up.
    faulthandler.dump_traceback_later(max(timeout - 10, 5), exit=True)

    spec = importlib.util.spec_from_file_location("dwgraph_dist_scenarios", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    ctx = Context(rank=rank, world_size=world, device=torch.device(device, rank) if device == "cuda" else
                  torch.device("cpu"))
    results: Dict[str, Any] = {}
    for name in names:
        try:
            results[name] = getattr(module, f"scenario_{name}")(ctx)
        except Exception as e:  # reported to the test, which decides
            results[name] = Failure(type(e).__name__, str(e), traceback.format_exc())
            print(f"scenario {name} raised:\n{results[name].traceback}", flush=True)
        dist.barrier()
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    # Through the importable module, so results pickle as dist_harness.Failure.
    import dist_harness

    dist_harness._child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
                        float(sys.argv[6]), sys.argv[7:])
