"""Zero-bubble pipeline training with deferred weight gradients, on two ranks, graphed.

Four blocks (a deferred dwgraph Linear, GELU, a deferred LayerNormMLP) are cut into four
stages placed as torch's ScheduleZBVZeroBubble wants them (rank 0: stages 0 and 3, rank
1: stages 1 and 2). Each stage is a dwgraph.distributed.pipelining.PipelineStage: every
backward computes input gradients only, and the schedule's W step runs backward_dw() for
the microbatch it means. make_graphed_stages captures one graph set per (stage,
microbatch), in the order this rank runs them, and the stages replay them. The sample
starts the two processes itself (gloo on the loopback, rendezvous through a file), and
prints the pipeline's loss next to a single-process run of the same model on the same
batches.

    .venv/bin/python samples/python/pipeline.py
    .venv/bin/python samples/python/pipeline.py --eager          # no graphs
    .venv/bin/python samples/python/pipeline.py --device cuda    # NCCL, needs two GPUs
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import ScheduleZBVZeroBubble

import dwgraph
from dwgraph.distributed import pipelining

WORLD = 2
STAGES = 4


def build_blocks(hidden, device):
    torch.manual_seed(0)
    flags = dict(delay_wgrad_compute=True, device=device)
    return [torch.nn.Sequential(dwgraph.nn.Linear(hidden, hidden, **flags), torch.nn.GELU(),
                                dwgraph.nn.LayerNormMLP(hidden, 4 * hidden, **flags))
            for _ in range(STAGES)]


def batches(args, device):
    gen = torch.Generator().manual_seed(1)
    rows = args.microbatches * args.microbatch_rows
    for _ in range(args.steps):
        x = torch.randn(rows, args.hidden, generator=gen)
        yield x.to(device), torch.sin(x).to(device)


def loss_fn(out, target):
    return (out - target).square().mean()


def worker(rank, args, rendezvous, results):
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{rendezvous}",
                            rank=rank, world_size=WORLD)
    blocks = build_blocks(args.hidden, device)
    mine = [rank, STAGES - 1 - rank]  # the V
    stages = [pipelining.PipelineStage(blocks[s], s, STAGES, device) for s in mine]
    schedule = ScheduleZBVZeroBubble(stages, args.microbatches, loss_fn=loss_fn)
    if not args.eager:
        sample = {s: (torch.randn(args.microbatch_rows, args.hidden, device=device, requires_grad=s > 0),)
                  for s in mine}
        pipelining.make_graphed_stages(schedule, sample)
    params = [p for s in mine for p in blocks[s].parameters()]
    opt = torch.optim.SGD(params, lr=args.lr)
    curve = []
    for x, y in batches(args, device):
        losses = []
        if rank == 0:  # holds stage 0 (the input) and stage 3 (the loss)
            schedule.step(x, target=y, losses=losses)
            curve.append(torch.stack(losses).mean().item())
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        results.put(curve)
    dist.destroy_process_group()


def single_process(args):
    model = torch.nn.Sequential(*build_blocks(args.hidden, args.device))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    curve = []
    for x, y in batches(args, args.device):
        loss = loss_fn(model(x), y)
        loss.backward()
        for m in model.modules():
            if isinstance(m, (dwgraph.nn.Linear, dwgraph.nn.LayerNormMLP)):
                m.backward_dw()
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(loss.item())
    return curve


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-rows", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--eager", action="store_true", help="run the stages eagerly instead of graphed")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        parser.error(f"--device cuda needs {WORLD} GPUs (NCCL runs one rank per GPU)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "rendezvous"), results), nprocs=WORLD)
    pipeline = results.get()
    reference = single_process(args)
    mode = "eager" if args.eager else "graphed"
    print(f"ScheduleZBVZeroBubble, {WORLD} ranks, {STAGES} stages, {args.microbatches} microbatches, {mode} stages")
    print(f"{'step':>4}  {'pipeline loss':>14}  {'single-process':>14}  {'rel. diff':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(pipeline, reference)):
        diff = abs(a - b) / abs(b)
        worst = max(worst, diff)
        print(f"{step:>4}  {a:>14.8f}  {b:>14.8f}  {diff:>9.1e}")
    print(f"largest relative difference: {worst:.1e} (FP32 summation order; the curves match)")
    if worst > 1e-5:
        raise SystemExit("the pipeline diverged from the single-process run")


if __name__ == "__main__":
    main()
