"""A small model with deferred weight gradients, trained eagerly and graphed side by side.

Three dwgraph modules (Linear -> LayerNormMLP -> Linear) with delay_wgrad_compute=True:
each backward computes input gradients only, and each module's backward_dw() computes
its weight gradients later, as a zero-bubble pipeline schedule places them. One copy runs
eagerly; an identical copy is captured once with dwgraph.make_graphed_callables (forward,
backward and backward-dw graphs on one private pool; the host graph backend on CPU, CUDA
graphs on a GPU) and replayed every step. Both use optimizer.zero_grad(set_to_none=True).
The loss curves must be identical, bit for bit. With --step the graphed copy instead puts
@dwgraph.graphed_step on its whole training step (forward, loss.backward(), backward_dw()).

    scripts/sample                     # or: .venv/bin/python samples/python/train.py --steps 40
    .venv/bin/python samples/python/train.py --step
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


def train_step(compute, opt, x, target):
    opt.zero_grad(set_to_none=True)
    loss = compute(x, target)
    opt.step()
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step", action="store_true",
                        help="graph the whole step with @dwgraph.graphed_step instead of make_graphed_callables")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.float32
    d_in, hidden, ffn, d_out = 32, 64, 128, 8

    torch.manual_seed(0)
    eager = build(d_in, hidden, ffn, d_out, device, dtype)
    graphed_model = build(d_in, hidden, ffn, d_out, device, dtype)
    graphed_model.load_state_dict(eager.state_dict())
    teacher = torch.randn(d_out, d_in, device=device)

    eager_compute = lambda x, t: gradients(eager, x, t)  # noqa: E731
    if args.step:
        # The whole step as graphs: warmup calls run eagerly, then capture, then replays.
        graphed_compute = dwgraph.graphed_step(lambda x, t: gradients(graphed_model, x, t))
        report = None
        mode = "@dwgraph.graphed_step"
    else:
        # Capture once: the sample inputs give each stage's shapes (and whether it needs dgrad).
        samples = ((torch.randn(args.batch, d_in, device=device),),
                   (torch.randn(args.batch, hidden, device=device, requires_grad=True),),
                   (torch.randn(args.batch, hidden, device=device, requires_grad=True),))
        graphed = dwgraph.make_graphed_callables(tuple(graphed_model), samples)
        graphed_compute = lambda x, t: gradients(graphed, x, t)  # noqa: E731
        report = dwgraph.graphed_handle(graphed[0])
        mode = "make_graphed_callables"

    opt_e = torch.optim.SGD(eager.parameters(), lr=args.lr)
    opt_g = torch.optim.SGD(graphed_model.parameters(), lr=args.lr)
    print(f"dwgraph {dwgraph.__version__} on {device} (CUDA built: {dwgraph.cuda_built()}), graphed with {mode}")
    print(f"{'step':>4}  {'eager loss':>12}  {'graphed loss':>12}  identical")
    t_eager = t_graphed = 0.0
    for step in range(args.steps):
        x = torch.randn(args.batch, d_in, device=device)
        target = x @ teacher.t()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync(); t0 = time.perf_counter()
        loss_e = train_step(eager_compute, opt_e, x, target)
        sync(); t1 = time.perf_counter()
        loss_g = train_step(graphed_compute, opt_g, x, target)
        sync(); t2 = time.perf_counter()
        if step >= 3:  # after the first steps' one-time costs
            t_eager += t1 - t0
            t_graphed += t2 - t1
        same = torch.equal(loss_e, loss_g)
        if step % 5 == 0 or step == args.steps - 1 or not same:
            print(f"{step:>4}  {loss_e.item():>12.6f}  {loss_g.item():>12.6f}  {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit("the graphed run diverged from the eager run")
    for pe, pg in zip(eager.parameters(), graphed_model.parameters()):
        assert torch.equal(pe, pg), "parameters differ after training"
    timed = max(args.steps - 3, 1)
    print(f"step time: eager {1e3 * t_eager / timed:.3f} ms, graphed {1e3 * t_graphed / timed:.3f} ms, "
          f"replay/eager {t_graphed / max(t_eager, 1e-12):.2f}")
    if report is not None:
        stats = report.stats()
        print(f"graph pool: {stats['pool_reserved_bytes']} B reserved, {stats['pool_allocated_bytes']} B live; "
              f"contributions {stats['contribution_bytes']} B; static buffers {stats['static_bytes']} B; "
              f"{stats['num_graphs']} graphs")
    else:
        print(f"graphed step: {graphed_compute.num_graphs} graph(s), {graphed_compute.num_captures} capture(s)")


if __name__ == "__main__":
    main()
