"""A two-layer MLP trained with dwgraph's GEMM ops, next to plain PyTorch autograd.

Each microbatch's backward computes only the input gradient (``dgrad_gemm``) and queues
its weight-gradient work, as a zero-bubble pipeline schedule does; the queued work then
runs as fused accumulation (``wgrad_gemm(..., accumulate=True)``) straight into FP32
``main_grad`` buffers, with no temporary and no separate add. The same model trained
with ``torch.nn`` autograd from the same weights and data gives the reference curve.

    scripts/sample            # or: .venv/bin/python samples/python/train.py --steps 40
"""

import argparse
import collections
import time

import torch

import dwgraph


def deferred_step(w1, w2, main_grads, x, target, microbatches):
    """One training step's gradients with deferred, fused weight-gradient accumulation."""
    for g in main_grads:
        g.zero_()  # the caller owns main_grad and zeroes it in place
    queue = collections.deque()
    loss = 0.0
    for xm, tm in zip(x.chunk(microbatches), target.chunk(microbatches)):
        xm = xm.contiguous()
        h = torch.relu(dwgraph.ops.fwd_gemm(xm, w1))
        y = dwgraph.ops.fwd_gemm(h, w2)
        diff = y - tm
        loss += diff.pow(2).mean().item() / microbatches
        dy = (diff * (2.0 / (diff.numel() * microbatches))).contiguous()
        dh = (dwgraph.ops.dgrad_gemm(dy, w2) * (h > 0)).contiguous()
        queue.append((dy, h, main_grads[1]))
        queue.append((dh, xm, main_grads[0]))
    while queue:  # the backward_dw phase
        dy, inp, main_grad = queue.popleft()
        dwgraph.ops.wgrad_gemm(dy, inp, main_grad, accumulate=True)
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    torch.manual_seed(0)
    batch, d_in, hidden, d_out = 64, 32, 64, 8
    ref = torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden, bias=False), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out, bias=False)
    )
    w1 = ref[0].weight.detach().clone()
    w2 = ref[2].weight.detach().clone()
    main_grads = [torch.zeros_like(w1), torch.zeros_like(w2)]
    opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    teacher = torch.randn(d_out, d_in)

    print(f"dwgraph {dwgraph.__version__} (CUDA built: {dwgraph.cuda_built()}, available: {dwgraph.cuda_available()})")
    print(f"{'step':>4}  {'loss (dwgraph)':>14}  {'loss (torch.nn)':>15}  {'max |dW| diff':>13}")
    t_dw = t_ref = 0.0
    for step in range(args.steps):
        x = torch.randn(batch * args.microbatches, d_in)
        target = x @ teacher.t()

        t0 = time.perf_counter()
        loss = deferred_step(w1, w2, main_grads, x, target, args.microbatches)
        t_dw += time.perf_counter() - t0

        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ref_loss = 0.0
        for xm, tm in zip(x.chunk(args.microbatches), target.chunk(args.microbatches)):
            l = (ref(xm) - tm).pow(2).mean() / args.microbatches
            l.backward()
            ref_loss += l.item()
        t_ref += time.perf_counter() - t0

        diff = max((main_grads[0] - ref[0].weight.grad).abs().max().item(),
                   (main_grads[1] - ref[2].weight.grad).abs().max().item())
        if diff > 1e-4:
            raise SystemExit(f"step {step}: gradients differ from torch.nn by {diff:.3g}")
        if step % 5 == 0 or step == args.steps - 1:
            print(f"{step:>4}  {loss:>14.6f}  {ref_loss:>15.6f}  {diff:>13.2e}")
        w1.sub_(main_grads[0], alpha=args.lr)
        w2.sub_(main_grads[1], alpha=args.lr)
        opt.step()
    print(f"gradient time per step: dwgraph {1e3 * t_dw / args.steps:.2f} ms, torch.nn {1e3 * t_ref / args.steps:.2f} ms")


if __name__ == "__main__":
    main()
