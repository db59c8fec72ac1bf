"""make_graphed_callables overheads, measured side by side in one run.

1. Wrapper overhead per replay, from Python: a graphed callable whose graphs hold one
   kernel, call-to-return, against an eager call of the same module (forward only, and
   forward + backward + backward_dw for a deferred Linear).
2. Memory: graph-pool bytes and contribution bytes against their analytic minimum (the
   contributions are exactly one buffer per deferred parameter per backward-dw graph;
   the pool must at least hold the static outputs, saved activations and gradients).

``--device cuda`` on a GPU machine. The C++ side (replay, call and hand-off cost) is
build/bench/dwgraph_bench_replay, also run by scripts/bench.
"""

import torch

import dwgraph
from common import bench_args, median_time


class Scale(torch.nn.Module):
    """One kernel: y = x * 2."""

    def forward(self, x):
        return x * 2


def median_us(fn, iters, samples, sync):
    return median_time(fn, warmup=iters, samples=samples, sync=sync, iters=iters, scale=1e6)


def main():
    args = bench_args(__doc__)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    iters, samples = (100, 5) if args.quick else (1000, 9)
    torch.manual_seed(0)

    print(f"# make_graphed_callables overheads ({args.device})\n")
    print("| case | eager us | graphed us | graphed / eager |\n|---|---:|---:|---:|")
    for n in (16, 65536):
        x = torch.randn(n, device=dev)
        mod = Scale()
        g = dwgraph.make_graphed_callables(mod, (x,))
        e = median_us(lambda: mod(x), iters, samples, sync)
        r = median_us(lambda: g(x), iters, samples, sync)
        print(f"| one-kernel forward, {n} floats | {e:.2f} | {r:.2f} | {r / e:.2f} |")
    # A deferred Linear's whole step (forward, backward, backward_dw + hand-off).
    for hidden in (64, 512):
        lin = dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev)
        twin = dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev)
        twin.load_state_dict(lin.state_dict())
        x = torch.randn(32, hidden, device=dev, requires_grad=True)
        g = dwgraph.make_graphed_callables(twin, (x,))

        def eager_step():
            lin.weight.grad = None
            lin.bias.grad = None
            lin(x).sum().backward()
            lin.backward_dw()

        def graphed_step():
            twin.weight.grad = None
            twin.bias.grad = None
            g(x).sum().backward()
            g.backward_dw()

        e = median_us(eager_step, iters // 10 + 1, samples, sync)
        r = median_us(graphed_step, iters // 10 + 1, samples, sync)
        print(f"| deferred Linear({hidden}, {hidden}) step, batch 32 | {e:.2f} | {r:.2f} | {r / e:.2f} |")

        # The same step as one graph (@graphed_step): the autograd engine's backward, the
        # hand-off and the Python of every op replayed as one; its input a leaf as above.
        whole = dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev)
        whole.load_state_dict(lin.state_dict())
        xw = x.detach().clone().requires_grad_(True)

        @dwgraph.graphed_step
        def whole_step(inp):
            whole.weight.grad = None
            whole.bias.grad = None
            whole(inp).sum().backward()
            whole.backward_dw()

        for _ in range(5):
            eager_step()
            whole_step(xw)
        assert torch.equal(lin.weight.grad, whole.weight.grad) and torch.equal(lin.bias.grad, whole.bias.grad)
        e = median_us(eager_step, iters // 10 + 1, samples, sync)
        r = median_us(lambda: whole_step(xw), iters // 10 + 1, samples, sync)
        print(f"| deferred Linear({hidden}, {hidden}) step under @graphed_step, batch 32 | {e:.2f} | {r:.2f} | "
              f"{r / e:.2f} |")

    # @graphed_step: a whole step (forward, backward, backward_dw, SGD momentum), graphed
    # against the same undecorated function, with few and many parameters (the per-call
    # key and variant checks walk the step's modules, optimizer groups and state).
    print("\n| @graphed_step, whole step with SGD momentum | eager us | graphed us | graphed / eager |\n|---|---:|---:|---:|")
    for layers, hidden in ((2, 64), (64, 16)):
        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(*[dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev)
                                         for _ in range(layers)])

        me, mg = make(), make()
        oe, og = (torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in (me, mg))
        x = torch.randn(32, hidden, device=dev)

        def body(model, opt):
            loss = model(x).square().mean()
            loss.backward()
            for mod in reversed(model):
                mod.backward_dw()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        step = dwgraph.graphed_step(lambda: body(mg, og))
        e = median_us(lambda: body(me, oe), iters // 10 + 1, samples, sync)
        r = median_us(step, iters // 10 + 1, samples, sync)
        print(f"| {layers} x deferred Linear({hidden}), batch 32 | {e:.2f} | {r:.2f} | {r / e:.2f} |")

    print("\n| model | pool reserved | pool live | static bytes | contributions | analytic minimum of contributions | contributions / minimum |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for hidden, ffn in ((64, 256), (256, 1024)):
        mods = (dwgraph.nn.Linear(hidden, hidden, delay_wgrad_compute=True, device=dev),
                dwgraph.nn.LayerNormMLP(hidden, ffn, delay_wgrad_compute=True, device=dev))
        samples_in = ((torch.randn(64, hidden, device=dev),), (torch.randn(64, hidden, device=dev, requires_grad=True),))
        gs = dwgraph.make_graphed_callables(mods, samples_in)
        st = dwgraph.graphed_handle(gs[0]).stats()
        minimum = sum(p.nbytes for m in mods for _, p in m._deferred_parameters())
        print(f"| Linear({hidden}) + LayerNormMLP({hidden}, {ffn}), batch 64 | {st['pool_reserved_bytes']} | "
              f"{st['pool_allocated_bytes']} | {st['static_bytes']} | {st['contribution_bytes']} | {minimum} | "
              f"{st['contribution_bytes'] / minimum:.2f} |")
    print("\ngraphed = the callable returned by make_graphed_callables (input copy skipped when the caller passes "
          "the same tensor, ledger check, replay, outputs connected to autograd). Pool live bytes include the "
          "static outputs, saved activations and gradient buffers the graphs keep.")


if __name__ == "__main__":
    main()
