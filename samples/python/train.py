"""A small model with deferred weight gradients, trained eagerly and graphed side by side.

Three dwgraph modules (Linear -> LayerNormMLP -> Linear) with delay_wgrad_compute=True:
each backward computes input gradients only, and each module's backward_dw() computes
its weight gradients later, as a zero-bubble pipeline schedule places them. Three
identical copies train on the same data, each with optimizer.zero_grad(set_to_none=True)
and SGD:
  - eager: plain PyTorch autograd and the modules' own backward_dw();
  - per module: the three modules captured once with dwgraph.make_graphed_callables
    (forward, backward and backward-dw graphs on one private pool) and replayed every
    step; the loss and the optimizer step stay eager;
  - whole step: @dwgraph.graphed_step on the whole training step (zero_grad, forward, loss,
    loss.backward(), backward_dw(), optimizer step), replayed as one graph.
The host graph backend runs the graphs on CPU, CUDA graphs on a GPU. The loss curves and
the trained parameters must be identical, bit for bit; the sample stops at the first
difference. It prints each graphed copy's step time over eager's (replay/eager): graphs
remove host work (Python, dispatch, autograd bookkeeping), so the more of a launch-bound
step a graph holds, the lower the ratio.

    scripts/sample                     # or: .venv/bin/python samples/python/train.py --steps 40
    .venv/bin/python samples/python/train.py --device cuda
"""

import argparse
import time

import torch

import dwgraph


def build(d_in, hidden, ffn, d_out, device, dtype):
    flags = dict(delay_wgrad_compute=True, device=device, dtype=dtype)
    return torch.nn.ModuleList([
        dwgraph.nn.Linear(d_in, hidden, **flags),
        dwgraph.nn.LayerNormMLP(hidden, ffn, **flags),
        dwgraph.nn.Linear(hidden, d_out, **flags),
    ])


def gradients(stages, x, target):
    """forward, loss.backward(), then each stage's backward_dw(); returns the loss."""
    h = x
    for stage in stages:
        h = stage(h)
    loss = (h.float() - target).square().mean()
    loss.backward()
    for stage in stages:
        stage.backward_dw()
    return loss.detach()


def training_step(stages, opt):
    """One optimizer step on (x, target): the function both eager copies run as it is and
    the whole-step copy runs under @dwgraph.graphed_step."""
    def step(x, target):
        opt.zero_grad(set_to_none=True)
        loss = gradients(stages, x, target)
        opt.step()
        return loss
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lr", type=float, default=0.05)
    # The sample's tensors are small: torch's intra-op threads add nothing to them, and on a
    # machine where another process holds a core every op waits for its second thread (a
    # loaded run took 49 ms a step for each copy, against 0.9 ms idle, and the ratios read 1).
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU (default 1)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.float32
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    d_in, hidden, ffn, d_out = 32, 64, 128, 8

    torch.manual_seed(0)
    models = {name: build(d_in, hidden, ffn, d_out, device, dtype) for name in ("eager", "per module", "whole step")}
    for model in models.values():
        model.load_state_dict(models["eager"].state_dict())
    opts = {name: torch.optim.SGD(model.parameters(), lr=args.lr) for name, model in models.items()}
    teacher = torch.randn(d_out, d_in, device=device)

    # Per module: captured once; the sample inputs give each stage's shapes (and whether it
    # needs dgrad). The modules come back graphed, so the same step function drives them.
    samples = ((torch.randn(args.batch, d_in, device=device),),
               (torch.randn(args.batch, hidden, device=device, requires_grad=True),),
               (torch.randn(args.batch, hidden, device=device, requires_grad=True),))
    graphed = dwgraph.make_graphed_callables(tuple(models["per module"]), samples)
    steps = {
        "eager": training_step(models["eager"], opts["eager"]),
        "per module": training_step(graphed, opts["per module"]),
        # Whole step: warmup calls run eagerly, then one capture, then replays.
        "whole step": dwgraph.graphed_step(training_step(models["whole step"], opts["whole step"])),
    }

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    print(f"dwgraph {dwgraph.__version__} on {device} (CUDA built: {dwgraph.cuda_built()})")
    print(f"{'step':>4}  {'eager loss':>12}  {'per module':>12}  {'whole step':>12}  identical")
    spent = dict.fromkeys(steps, 0.0)
    # Timed after the one-time costs: @graphed_step's three eager warmup steps and its
    # capture in the fourth, make_graphed_callables' first replays.
    timed_from = 5
    for step in range(args.steps):
        x = torch.randn(args.batch, d_in, device=device)
        target = x @ teacher.t()
        losses = {}
        for name, fn in steps.items():  # the same data, one copy after the other
            sync(); t0 = time.perf_counter()
            losses[name] = fn(x, target)
            sync()
            if step >= timed_from:
                spent[name] += time.perf_counter() - t0
        same = all(torch.equal(losses["eager"], loss) for loss in losses.values())
        if step % 5 == 0 or step == args.steps - 1 or not same:
            print(f"{step:>4}  " + "  ".join(f"{losses[n].item():>12.6f}" for n in steps) +
                  f"  {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit("a graphed run diverged from the eager run")
    for name, model in models.items():
        for pe, pg in zip(models["eager"].parameters(), model.parameters()):
            assert torch.equal(pe, pg), f"parameters of the {name} copy differ from eager's after training"
    timed = args.steps - timed_from
    if timed > 0:
        print("step time: " + ", ".join(f"{n} {1e3 * spent[n] / timed:.3f} ms" for n in steps))
        print(f"replay/eager: whole step (@dwgraph.graphed_step) {spent['whole step'] / spent['eager']:.2f}, "
              f"per module (make_graphed_callables) {spent['per module'] / spent['eager']:.2f}")
    else:
        print(f"step time: not measured (the first {timed_from} steps hold the one-time costs; run more steps)")
    stats = dwgraph.graphed_handle(graphed[0]).stats()
    print(f"per module: graph pool {stats['pool_reserved_bytes']} B reserved, {stats['pool_allocated_bytes']} B live; "
          f"contributions {stats['contribution_bytes']} B; static buffers {stats['static_bytes']} B; "
          f"{stats['num_graphs']} graphs")
    whole = steps["whole step"]
    print(f"whole step: {whole.num_graphs} graph(s), {whole.num_captures} capture(s)")


if __name__ == "__main__":
    main()
