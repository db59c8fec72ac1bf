#!/usr/bin/env python3
"""Graph replay against eager execution, and graph-pool memory, side by side in one run.

1. Time: the forward + backward of a small MLP (three ``torch.nn.Linear`` layers with
   ReLU, MSE loss) run eagerly (``zero_grad(set_to_none=True)``, forward, backward)
   against the same step captured once in a ``dwgraph.graphs.Graph`` and replayed
   (copy the new inputs into the static inputs, ``g.replay()``). The two are interleaved
   sample by sample; the table gives median ms per step and replay / eager. Tiny and
   small MLPs (hidden 64 and 256, batch 32: launch/dispatch overhead matters most; the
   issue's target is replay / eager <= 0.5) and a large one (hidden 1024, batch 256 on
   CPU: compute dominates, the ratio should approach 1). One extra replay and
   eager step on the same fresh inputs are compared bitwise (loss and every gradient).

2. Memory: the graph pool's ``reserved_bytes``, ``peak_allocated_bytes`` and
   ``allocated_bytes`` right after capture, against the analytic sum of the bytes of the
   static buffers the capture leaves alive in the pool (its outputs, the ``.grad``
   tensors AccumulateGrad stole, and the saved activations that stay alive when only the
   forward is captured), with ratios (the issue's target: pool bytes <= 1.25x the live
   static buffers).

Timings are printed, never asserted.

    python bench/bench_graphs.py                 # CPU host graph, < 90 s on 2 cores
    python bench/bench_graphs.py --quick         # fewer samples
    python bench/bench_graphs.py --device cuda   # CUDA graphs on a GPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

import dwgraph
from dwgraph.graphs import Graph, graph_pool_handle

MB = 1024.0 * 1024.0


def build_mlp(d_in: int, hidden: int, d_out: int, device: str) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, d_out),
    ).to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def eager_step(model, x, t):
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), t)
    loss.backward()
    return loss


def warmup(model, x, t, device: str, iters: int = 3) -> None:
    """Eager iterations before capture (lazy initialisation: cuBLAS handles and workspaces,
    autograd engine threads); on CUDA also on a side stream, as torch recommends."""
    for _ in range(iters):
        eager_step(model, x, t)
    if device == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(iters):
                eager_step(model, x, t)
        torch.cuda.current_stream().wait_stream(s)
    sync(device)
    model.zero_grad(set_to_none=True)


def unique_storage_bytes(tensors, exclude_ptrs=()) -> int:
    """Bytes of the distinct storages behind `tensors`, skipping those in exclude_ptrs."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen or ptr in exclude_ptrs or st.nbytes() == 0:
            continue
        seen.add(ptr)
        total += st.nbytes()
    return total


class Captured:
    """One MLP training step captured on a graph, with its static inputs and outputs."""

    def __init__(self, model, x, t, device: str, forward_only: bool = False):
        self.model, self.device = model, device
        self.static_x, self.static_t = x.clone(), t.clone()
        self.pool = graph_pool_handle(device)
        self.graph = Graph(device)
        saved: List[torch.Tensor] = []

        def pack(tensor):
            saved.append(tensor)
            return tensor

        model.zero_grad(set_to_none=True)
        sync(device)
        peak_before = None
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            peak_before = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with self.graph.capture(pool=self.pool):
                self.out = model(self.static_x)
                self.loss = F.mse_loss(self.out, self.static_t)
                if not forward_only:
                    self.loss.backward()
        sync(device)
        device_peak = torch.cuda.max_memory_allocated() - peak_before if device == "cuda" else None
        # Graph-owned gradient buffers (AccumulateGrad stole them during capture).
        self.grads = [p.grad for p in model.parameters()]
        caller = {p.untyped_storage().data_ptr() for p in model.parameters()}
        caller |= {self.static_x.untyped_storage().data_ptr(), self.static_t.untyped_storage().data_ptr()}
        outputs = unique_storage_bytes([self.out, self.loss], caller)
        # After backward (retain_graph=False) the saved tensors are released; with a
        # forward-only capture they stay alive for a later backward. Saved tensors that are
        # outputs too (and parameters, inputs: caller memory) are not counted again.
        saved_alive = saved if forward_only else []
        self.static_bytes = {
            "outputs": outputs,
            "grads": unique_storage_bytes(self.grads, caller),
            "saved": unique_storage_bytes([self.out, self.loss] + saved_alive, caller) - outputs,
        }
        saved.clear()  # our references only: the pool counters below must not see them
        self.stats = dict(self.pool.stats())
        if device_peak is not None:  # a true high-water mark (the CUDA pool's peak is sampled)
            self.stats["device_peak_bytes"] = device_peak

    def step(self, x, t):
        self.static_x.copy_(x)
        self.static_t.copy_(t)
        self.graph.replay()


def median_ms(fn, iters: int, samples: int, device: str) -> List[float]:
    times = []
    for _ in range(samples):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    return times


def time_config(name, d_in, hidden, d_out, batch, device, samples, target_ms) -> Dict:
    torch.manual_seed(0)
    model = build_mlp(d_in, hidden, d_out, device)
    inputs = [(torch.randn(batch, d_in, device=device), torch.randn(batch, d_out, device=device))
              for _ in range(4)]
    warmup(model, *inputs[0], device)
    cap = Captured(model, *inputs[0], device)
    for x, t in inputs[:2]:  # replay warmup
        cap.step(x, t)
    sync(device)

    k = {"i": 0}

    def run_eager():
        x, t = inputs[k["i"] % len(inputs)]
        k["i"] += 1
        eager_step(model, x, t)

    def run_replay():
        x, t = inputs[k["i"] % len(inputs)]
        k["i"] += 1
        cap.step(x, t)

    # Calibrate the inner loop so each sample lasts about target_ms.
    one = min(median_ms(run_eager, 1, 3, device))
    iters = max(1, int(target_ms / max(one, 1e-3)))
    eager_t, replay_t, bare_t = [], [], []
    for _ in range(samples):  # interleaved, sample by sample
        eager_t += median_ms(run_eager, iters, 1, device)
        replay_t += median_ms(run_replay, iters, 1, device)
        bare_t += median_ms(cap.graph.replay, iters, 1, device)

    # Bitwise check on fresh inputs: one replay against one eager step.
    x, t = torch.randn(batch, d_in, device=device), torch.randn(batch, d_out, device=device)
    cap.step(x, t)
    sync(device)
    graph_loss = cap.loss.detach().clone()
    graph_grads = [g.detach().clone() for g in cap.grads]
    # The eager step sets the parameters' .grad to fresh tensors; the graph's buffers
    # (held in cap.grads) are untouched by it.
    eager_loss = eager_step(model, x, t)
    bitwise = torch.equal(graph_loss, eager_loss.detach()) and all(
        torch.equal(a, p.grad) for a, p in zip(graph_grads, model.parameters()))
    model.zero_grad(set_to_none=True)
    return {
        "name": name, "shape": f"{d_in}-{hidden}-{hidden}-{d_out}, batch {batch}",
        "kernels": cap.graph.num_kernels, "iters": iters,
        "eager": statistics.median(eager_t), "replay": statistics.median(replay_t),
        "bare": statistics.median(bare_t),
        "bitwise": bitwise,
    }


def memory_config(name, d_in, hidden, d_out, batch, device, forward_only) -> Dict:
    torch.manual_seed(0)
    model = build_mlp(d_in, hidden, d_out, device)
    x, t = torch.randn(batch, d_in, device=device), torch.randn(batch, d_out, device=device)
    warmup(model, x, t, device)
    cap = Captured(model, x, t, device, forward_only=forward_only)
    static = sum(cap.static_bytes.values())
    row = {"name": name, "what": "forward only" if forward_only else "forward + backward",
           "static": static, **cap.static_bytes, **cap.stats}
    del cap
    model.zero_grad(set_to_none=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="fewer samples")
    args = p.parse_args()
    if args.device == "cuda" and not dwgraph.cuda_available():
        p.error("--device cuda needs a usable CUDA device")
    dev = args.device
    samples = 5 if args.quick else 11
    target_ms = 60.0 if args.quick else 150.0
    if dev == "cpu":
        configs = [("tiny", 64, 64, 64, 32), ("small", 64, 256, 64, 32), ("large", 1024, 1024, 1024, 256)]
    else:
        configs = [("tiny", 64, 64, 64, 32), ("small", 64, 256, 64, 32), ("large", 4096, 4096, 4096, 4096)]

    threads = torch.get_num_threads()
    gpu = f", {torch.cuda.get_device_name()}" if dev == "cuda" else ""
    print(f"torch {torch.__version__}, dwgraph {dwgraph.__version__}, {platform.machine()}, "
          f"{threads} CPU threads{gpu}; device {dev}, fp32\n")

    print(f"## MLP training step: graph replay vs eager ({dev})\n")
    print(f"3 x nn.Linear + ReLU, MSE loss; eager = zero_grad(set_to_none) + forward + backward; "
          f"replay = copy x, target into the static inputs + g.replay(). Median of {samples} "
          f"interleaved samples, each a loop of `iters` steps.\n")
    print("| MLP | shape | kernels | iters | eager ms | replay ms | replay / eager | target | "
          "g.replay() alone ms | replay == eager (bitwise) |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---|")
    for name, d_in, hidden, d_out, batch in configs:
        r = time_config(name, d_in, hidden, d_out, batch, dev, samples, target_ms)
        ratio = r["replay"] / r["eager"]
        target = ("<= 0.5 " + ("met" if ratio <= 0.5 else "NOT met")) if name != "large" else "~1 (compute-bound)"
        print(f"| {r['name']} | {r['shape']} | {r['kernels']} | {r['iters']} | {r['eager']:.3f} | "
              f"{r['replay']:.3f} | {ratio:.2f} | {target} | {r['bare']:.3f} | "
              f"{'yes' if r['bitwise'] else 'NO'} |")

    print(f"\n## Graph pool bytes vs live static buffers ({dev})\n")
    print("Right after capture. static = bytes of the distinct storages the capture leaves alive "
          "in the pool: outputs (MLP output, loss) + .grad buffers + saved activations still "
          "alive (forward-only capture). reserved / peak / allocated from g.pool.stats()"
          + (" (CUDA: allocator snapshot of the private pool; peak = torch.cuda.max_memory_allocated "
             "delta during capture)" if dev == "cuda" else " (host pool: chunks sized to the request that opens them, 64-byte blocks)")
          + ".\n")
    print("| MLP | captured | outputs MB | grads MB | saved MB | static MB | allocated MB | peak MB | "
          "reserved MB | allocated / static | peak / static | reserved / static | reserved <= 1.25x |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, d_in, hidden, d_out, batch in configs:
        for forward_only in (False, True):
            r = memory_config(name, d_in, hidden, d_out, batch, dev, forward_only)
            peak = r.get("device_peak_bytes", r["peak_allocated_bytes"])
            s = r["static"]
            print(f"| {r['name']} | {r['what']} | {r['outputs'] / MB:.3f} | {r['grads'] / MB:.3f} | "
                  f"{r['saved'] / MB:.3f} | {s / MB:.3f} | {r['allocated_bytes'] / MB:.3f} | "
                  f"{peak / MB:.3f} | {r['reserved_bytes'] / MB:.3f} | {r['allocated_bytes'] / s:.2f} | "
                  f"{peak / s:.2f} | {r['reserved_bytes'] / s:.2f} | "
                  f"{'yes' if r['reserved_bytes'] <= 1.25 * s else 'no'} |")


if __name__ == "__main__":
    main()
