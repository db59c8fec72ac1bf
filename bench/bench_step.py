"""@dwgraph.graphed_step: per-call overhead of its checks, and training loops as people write them.

1. Per-call overhead (contract C10): a step over N modules (N x Linear(4, 4), SGD with
   momentum and zero_grad inside), replaying: the wall time of a call minus the time the
   core spent in the replay and the copies (static inputs, gradients in and out, outputs),
   which the phase clock reports (dwgraph._C.graphs.phase_totals()["step"]). What is left is
   the step's own host work: the key, the variant checks, the parameter and gradient
   checks. Also with an LR scheduler stepping between calls (a value the graph reads).
   With a build whose core has no step clock, only the wall time is printed.
2. The loops of issue 22, 50 steps each, graphed against the same loop run eagerly on a
   copy of the model: a small GPT-like model, AdamW + cosine schedule + clipping + 4
   microbatches (``--fused`` for AdamW(fused=True), which a build without the tensor path
   can capture too), and SGD (momentum, nesterov) + step decay. Total time of the 50 steps
   (warmup and capture included), the median step after the capture, and the captures.

``--device cuda`` is accepted for symmetry with the other benchmarks; the hyperparameters
are read at replay on the CPU only.
"""

import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F

import dwgraph
from common import bench_args


def _phase(name):
    totals = dwgraph._C.graphs.phase_totals()
    return totals.get(name)


def overhead_step(n_modules, scheduler=False):
    """The step overhead() times (and bench_overhead_instructions.py counts), and its scheduler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n_modules)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9999) if scheduler else None
    x = torch.randn(2, 4)

    def body():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return dwgraph.graphed_step(body), sched


def overhead(n_modules, iters, scheduler, reps):
    step, sched = overhead_step(n_modules, scheduler)
    for _ in range(6):
        step()
        if sched:
            sched.step()
    captures = step.num_captures
    has_clock = _phase("step") is not None
    walls, rest = [], []
    for _ in range(reps):
        if has_clock:
            dwgraph._C.graphs.set_phase_timing(True)
        wall = 0.0
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            wall += time.perf_counter() - t0
            if sched:
                sched.step()
        if has_clock:
            t = _phase("step")
            dwgraph._C.graphs.set_phase_timing(False)
            assert t["count"] == iters, t
            rest.append((wall - t["replay_s"] - t["copy_s"]) / iters * 1e6)
        walls.append(wall / iters * 1e6)
    grew = step.num_captures - captures
    return statistics.median(walls), (statistics.median(rest) if rest else None), grew


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=128, dim=64, seq=32):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList()
        for _ in range(2):
            self.blocks.append(torch.nn.ModuleDict(dict(
                ln1=torch.nn.LayerNorm(dim), qkv=dwgraph.nn.Linear(dim, 3 * dim), proj=torch.nn.Linear(dim, dim),
                ln2=torch.nn.LayerNorm(dim), fc=dwgraph.nn.Linear(dim, 4 * dim, delay_wgrad_compute=True),
                out=dwgraph.nn.Linear(4 * dim, dim, delay_wgrad_compute=True))))
        self.lnf = torch.nn.LayerNorm(dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).chunk(3, dim=-1)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            att = att.masked_fill(~self.mask, float("-inf")).softmax(-1)
            x = x + b["proj"](att @ v)
            x = x + b["out"](F.gelu(b["fc"](b["ln2"](x))))
        return self.lnf(x) @ self.tok.weight.t()

    def deferred(self):
        return [m for b in reversed(self.blocks) for m in (b["out"], b["fc"])]


def loop(kind, steps, fused):
    torch.manual_seed(0)
    eager = TinyGPT()
    graphed = copy.deepcopy(eager)
    if kind == "adamw":
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,  # noqa: E731
                                                **({"fused": True} if fused else {}))
        make_sched = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps)  # noqa: E731
    else:
        make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)  # noqa: E731
        make_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5)  # noqa: E731
    opts = [make_opt(m.parameters()) for m in (eager, graphed)]
    scheds = [make_sched(o) for o in opts]

    def body(model, opt, idx, tgt):
        total = None
        for i in range(idx.shape[0]):
            logits = model(idx[i])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[i].reshape(-1)) / idx.shape[0]
            loss.backward()
            for m in model.deferred():
                m.backward_dw()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    step = dwgraph.graphed_step(lambda i, t: body(graphed, opts[1], i, t))
    data = [(torch.randint(0, 128, (4, 8, 32)), torch.randint(0, 128, (4, 8, 32))) for _ in range(steps)]
    times = {"eager": [], "graphed": []}
    same = True
    for s, (idx, tgt) in enumerate(data):
        t0 = time.perf_counter()
        lg = step(idx, tgt)
        t1 = time.perf_counter()
        le = body(eager, opts[0], idx, tgt)
        t2 = time.perf_counter()
        times["graphed"].append(t1 - t0)
        times["eager"].append(t2 - t1)
        same = same and torch.equal(lg, le)
        for sc in scheds:
            sc.step()
    same = same and all(torch.equal(a, b) for a, b in zip(eager.parameters(), graphed.parameters()))
    after = slice(5, None)  # after the warmup calls and the first capture
    return (sum(times["eager"]) * 1e3, sum(times["graphed"]) * 1e3,
            statistics.median(times["eager"][after]) * 1e3, statistics.median(times["graphed"][after]) * 1e3,
            step.num_captures, same)


def main():
    args = bench_args(__doc__)
    quick = args.quick
    print("# @graphed_step per-call overhead (cpu)\n")
    print("| modules | LR scheduler between calls | wall us / call | replay + copies us | overhead us | new captures |")
    print("|---:|---|---:|---:|---:|---:|")
    for n, iters in ((1, 400), (16, 200), (128, 40), (1024, 8)):
        for sched in (False, True):
            wall, rest, grew = overhead(n, max(2, iters // (4 if quick else 1)), sched, 3 if quick else 7)
            rp = f"{wall - rest:.1f}" if rest is not None else "-"
            oh = f"{rest:.1f}" if rest is not None else "-"
            print(f"| {n} | {'yes' if sched else 'no'} | {wall:.1f} | {rp} | {oh} | {grew} |")
    steps = 20 if quick else 50
    print(f"\n# issue 22's loops, {steps} steps, graphed vs eager (cpu)\n")
    print("| loop | eager ms total | graphed ms total | graphed / eager | eager ms / step | graphed ms / step "
          "| graphed / eager per step | captures | bitwise equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for kind, fused, name in (("adamw", False, "AdamW + cosine + clipping + 4 microbatches"),
                              ("adamw", True, "AdamW(fused=True) + cosine + clipping + 4 microbatches"),
                              ("sgd", False, "SGD(momentum, nesterov) + StepLR + clipping + 4 microbatches")):
        try:
            te, tg, me, mg, caps, same = loop(kind, steps, fused)
        except dwgraph.GraphStateError as e:
            print(f"| {name} | - | refused: {str(e)[:80]}... | | | | | | |")
            continue
        print(f"| {name} | {te:.0f} | {tg:.0f} | {tg / te:.2f} | {me:.2f} | {mg:.2f} | {mg / me:.2f} | {caps} | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
