"""Training steps of deferred-wgrad models under torch.distributed, eager against graphed,
measured side by side in one run on two processes (gloo on the loopback; --device cuda:
NCCL, one rank per GPU, at least two GPUs).

Cases: FSDP2 (every block its own ``fully_shard`` unit, driven by
``dwgraph.distributed.FullyShardReducer``; graphed with ``reducer.make_graphed_callables``)
and sharded weights (every deferred weight a ``ShardedWeight``, the rest reduced by
``dwgraph.distributed.DistributedDataParallel``; graphed with
``dwgraph.make_graphed_callables``). One step: forward, backward, every
``backward_dw()``, the reducer's ``finish()``, an SGD step. The collectives run in both
modes (the graphs hand them to the host around each replay), so the ratio shows what the
graphs save around them: kernel launches and Python, which matter for many small layers.
Every graphed step's loss is checked against the eager one (bitwise).

    python bench/bench_distributed.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_args  # noqa: E402

WORLD = 2


def _model(layers: int, hidden: int, device):
    import dwgraph

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True), torch.nn.GELU())
              for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, hidden)).to(device)  # a plain head


def _fsdp(model, graphed: bool, rows: int, hidden: int, device):
    from torch.distributed.fsdp import fully_shard

    import dwgraph.distributed as dwdist

    for block in model[:-1]:
        fully_shard(block)
    fully_shard(model)
    reducer = dwdist.FullyShardReducer(model)
    if graphed:
        samples = tuple((torch.randn(rows, hidden, device=device, requires_grad=i > 0),) for i in range(len(model)))
        reducer.make_graphed_callables(tuple(model), samples, num_warmup_iters=2)
    return model, reducer.finish


def _sharded(model, graphed: bool, rows: int, hidden: int, device):
    import dwgraph
    import dwgraph.distributed as dwdist

    for block in model[:-1]:
        block[0].weight = dwdist.ShardedWeight.from_full(block[0].weight)
    if graphed:
        dwgraph.make_graphed_callables(model, (torch.randn(rows, hidden, device=device),), num_warmup_iters=2)
    ddp = dwdist.DistributedDataParallel(model)
    return ddp, ddp.finish


def _steps(case: str, graphed: bool, layers: int, hidden: int, rows: int, steps: int, device):
    model = _model(layers, hidden, device)
    deferred = [b[0] for b in model[:-1]]
    run, finish = (_fsdp if case == "fsdp" else _sharded)(model, graphed, rows, hidden, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    xs = [torch.randn(rows, hidden, generator=gen).to(device) for _ in range(4)]
    times, losses = [], []
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        loss = run(xs[step % len(xs)]).square().mean()
        loss.backward()
        if graphed and case == "sharded":
            model.backward_dw()
        elif graphed:
            for b in reversed(model[:-1]):
                b.backward_dw()
        else:
            for m in reversed(deferred):
                m.backward_dw()
        finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.detach().cpu())
    return statistics.median(times[steps // 4:]), losses


def _worker(rank: int, init: str, quick: bool, device_type: str, out):
    try:
        _measure(rank, init, quick, device_type, out)
    except BaseException:  # noqa: BLE001 (handed to the parent, which raises it)
        import traceback

        out.put(("error", rank, traceback.format_exc()))
        raise


def _measure(rank: int, init: str, quick: bool, device_type: str, out):
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=WORLD)
    shapes = [(16, 64, 32)] if quick else [(16, 64, 32), (32, 64, 32), (8, 512, 256)]
    steps = 20 if quick else 40
    rows = []
    for case in ("fsdp", "sharded"):
        for layers, hidden, batch in shapes:
            eager_ms, eager_losses = _steps(case, False, layers, hidden, batch, steps, device)
            graphed_ms, graphed_losses = _steps(case, True, layers, hidden, batch, steps, device)
            same = all(torch.equal(a, b) for a, b in zip(eager_losses, graphed_losses))
            rows.append((case, layers, hidden, batch, eager_ms, graphed_ms, same))
    if rank == 0:
        out.put(("rows", rank, rows))
    dist.destroy_process_group()


def main() -> None:
    args = bench_args(__doc__)
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        print(f"# skipped: NCCL needs {WORLD} GPUs, found {torch.cuda.device_count()}")
        return
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tempfile.mktemp(prefix='dwgraph-bench-')}"
    procs = [ctx.Process(target=_worker, args=(r, init, args.quick, args.device, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    kind, rank, rows = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if kind == "error":
        raise RuntimeError(f"bench_distributed: rank {rank} failed:\n{rows}")
    print(f"# Distributed training steps, eager vs graphed ({WORLD} ranks, {args.device})\n")
    print("| case | blocks | hidden | rows per rank | eager ms | graphed ms | graphed / eager | losses bitwise |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for case, layers, hidden, batch, e, g, same in rows:
        name = "FSDP2 (FullyShardReducer)" if case == "fsdp" else "sharded weights + DDP"
        print(f"| {name} | {layers} | {hidden} | {batch} | {e:.2f} | {g:.2f} | {g / e:.2f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
