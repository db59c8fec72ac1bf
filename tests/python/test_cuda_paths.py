"""What only a GPU can show about this round's core changes (run by scripts/gpu-check;
skipped without a GPU):

* Note [Slots share the pool by liveness] on CUDA: a pipeline schedule's static inputs and
  grad outputs are allocated in the graphs' private pool through the caching allocator's
  beginAllocateToPool (GraphPool::allocation_scope), outside any capture; the host test
  backend uses its own pool, so only a GPU runs that routing. Replays must stay bitwise
  eager's and the pool must not grow with the microbatch count.
* Autograd runs a CUDA backward on its own device thread, not the caller's: the slot's
  parameter node (Note [Parameter gradients through one node]), or the call's node's own
  edges to the parameters where they are few, and what a partial backward asked for (Note
  [What a backward asked for]) are read there.
* FP8 (docs/fp8.md): cuBLASLt's FP8 GEMMs and the scaling-state update captured as kernels,
  the output gradient quantized on that device thread with the recipe its forward saved, and
  the weight cache's first-microbatch flag written before each replay.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dwgraph
from conftest import requires_cuda
from safety_common import assert_same_as_eager, assert_same_fp8_state, one_f_one_b, run_order, step_on_main_grads

pytestmark = [pytest.mark.cuda, requires_cuda]

H, B = 64, 16


def _layer():
    torch.manual_seed(0)
    return torch.nn.Sequential(dwgraph.nn.LayerNormMLP(H, 4 * H, delay_wgrad_compute=True, device="cuda"),
                               dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, device="cuda"))


def _graphed_pipeline(m: int):
    layer = _layer()
    eager = copy.deepcopy(layer)
    order = one_f_one_b(m)
    samples = tuple((torch.randn(B, H, device="cuda", requires_grad=True),) for _ in range(m))
    slots = dwgraph.make_graphed_callables((layer,), samples, order=order)
    return layer, eager, order, slots


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeroed"])
def test_pipeline_slots_sharing_the_private_pool_replay_bitwise(set_to_none):
    layer, eager, order, slots = _graphed_pipeline(4)
    for step in range(3):
        xs = [torch.randn(B, H, device="cuda", requires_grad=True) for _ in range(4)]
        run_order(order, lambda mb, x: slots[mb](x), lambda mb: slots[mb].backward_dw(), xs)
        eager_xs = [x.detach().clone().requires_grad_() for x in xs]
        run_order(order, lambda mb, x: eager(x), lambda mb: [m.backward_dw() for m in eager], eager_xs)
        torch.cuda.synchronize()
        for x, xe in zip(xs, eager_xs):
            assert torch.equal(x.grad, xe.grad), f"step {step}: input gradient"
        assert_same_as_eager(layer, eager, f"step {step}")
        layer.zero_grad(set_to_none=set_to_none)
        eager.zero_grad(set_to_none=set_to_none)


def test_pipeline_pool_does_not_grow_with_the_microbatches_on_cuda():
    reserved = {}
    for m in (4, 8):
        _, _, _, slots = _graphed_pipeline(m)
        reserved[m] = slots[0].stats()["pool_reserved_bytes"]
        for s in slots:
            s.reset()
        del slots
    # The caching allocator reserves whole segments: allow one extra 2 MiB segment.
    assert reserved[8] <= reserved[4] + (2 << 20), reserved


@pytest.mark.parametrize("asked", ["first_weight", "last_weight", "input"])
def test_partial_backward_on_the_device_thread_lands_what_was_asked(asked):
    # The CUDA backward runs on autograd's device thread: the graph task's exec_info (what
    # backward(inputs=...) asked for) is read there, by the slot's parameter node.
    torch.manual_seed(0)
    model = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, device="cuda"), torch.nn.GELU(),
                                dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, device="cuda"))
    eager = copy.deepcopy(model)
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H, device="cuda", requires_grad=True),))
    for step in range(2):
        x = torch.randn(B, H, device="cuda", requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        for m, call, inp in ((model, g, x), (eager, eager, xe)):
            target = {"first_weight": m[0].weight, "last_weight": m[2].weight, "input": inp}[asked]
            call(inp).square().sum().backward(inputs=[target])
        for m in (model[0], model[2]):
            if m.num_pending_wgrad_units():
                g.backward_dw()
                break
        for m in (eager[0], eager[2]):
            while m.num_pending_wgrad_units():
                m.backward_dw()
        torch.cuda.synchronize()
        assert (x.grad is None) == (xe.grad is None) and (x.grad is None or torch.equal(x.grad, xe.grad))
        assert_same_as_eager(model, eager, f"step {step}")
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


# FP8 on CUDA (docs/fp8.md): cuBLASLt's FP8 GEMMs, the scaling state's update as kernels in
# a CUDA graph, the output gradient quantized on autograd's device thread with the recipe the
# forward saved (the caller's fp8_autocast is not active there), and the weight cache's
# first-microbatch flag written before each replay.
@pytest.mark.parametrize("cache", [False, True], ids=["requantize", "cache_weights"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_pipeline_on_cuda_replays_bitwise_with_the_scaling_state(scaling, cache):
    from dwgraph.fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast

    recipe = DelayedScaling(amax_history_len=4) if scaling == "delayed" else Float8CurrentScaling()
    torch.manual_seed(0)
    layer = torch.nn.Sequential(
        dwgraph.nn.LayerNormMLP(H, 4 * H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, device="cuda"),
        dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, device="cuda"))
    eager = copy.deepcopy(layer)
    m = 4
    order = one_f_one_b(m)
    samples = tuple((torch.randn(B, H, device="cuda", requires_grad=True),) for _ in range(m))
    slots = dwgraph.make_graphed_callables((layer,), samples, order=order, enabled=True, recipe=recipe,
                                           cache_quantized_params=cache)
    opt, opt_e = torch.optim.SGD(layer.parameters(), lr=1e-2), torch.optim.SGD(eager.parameters(), lr=1e-2)
    for step in range(3):
        xs = [torch.randn(B, H, device="cuda", requires_grad=True) for _ in range(m)]
        kw = (lambda mb: dict(is_first_microbatch=mb == 0)) if cache else (lambda mb: {})
        run_order(order, lambda mb, x: slots[mb](x, **kw(mb)), lambda mb: slots[mb].backward_dw(), xs)
        eager_xs = [x.detach().clone().requires_grad_() for x in xs]

        def eager_fwd(mb, x):
            with fp8_autocast(enabled=True, recipe=recipe):
                return eager(x) if not cache else _with_first(eager, x, mb == 0)

        run_order(order, eager_fwd, lambda mb: [mod.backward_dw() for mod in eager], eager_xs)
        torch.cuda.synchronize()
        for x, xe in zip(xs, eager_xs):
            assert torch.equal(x.grad, xe.grad), f"step {step}: input gradient"
        assert_same_as_eager(layer, eager, f"step {step}")
        assert_same_fp8_state(layer, eager, f"step {step}")
        step_on_main_grads([(layer, opt), (eager, opt_e)])

def _with_first(seq, x, first):
    for mod in seq:
        x = mod(x, is_first_microbatch=first)
    return x


def test_parameter_hooks_run_in_eagers_order_on_the_device_thread():
    # Note [Parameter hooks in autograd's order]: the relays run on the CUDA device thread
    # (the token lives on the device); the order and the gradients the hooks see are eager's.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh(),
                                dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.Linear(H, 4)).cuda()
    twin = copy.deepcopy(eager)
    x = torch.randn(B, H, device="cuda", requires_grad=True)
    runs = {}
    for name, model in (("eager", eager), ("graphed", twin)):
        order = []
        for n, p in model.named_parameters():
            p.register_hook(lambda g, n=n: order.append((n, None if g is None else g.clone())))
        run = dwgraph.make_graphed_callables(model, (x.detach().clone().requires_grad_(),)) if name == "graphed" \
            else model
        for _ in range(2):
            order.clear()
            run(x).sum().backward()
            model[2].backward_dw()
        torch.cuda.synchronize()
        runs[name] = list(order)
    assert [n for n, _ in runs["graphed"]] == [n for n, _ in runs["eager"]]
    for (_, a), (_, b) in zip(runs["graphed"], runs["eager"]):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("layers", [2, 9], ids=["edges on the call's node", "the slot's parameter node"])
@pytest.mark.parametrize("stream", ["current", "side"])
def test_parameter_gradients_without_hooks_on_the_device_thread(layers, stream):
    # Note [Parameter gradients through one node]: up to 16 parameter edges the call's node
    # hands the gradients itself (no node between it and AccumulateGrad), beyond that the
    # slot's node does; both on autograd's device thread, with the call (and its node's
    # stream) on a side stream too. Gradients equal eager's, bitwise, across steps.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(*[dwgraph.nn.Linear(H, H, delay_wgrad_compute=(i % 2 == 0), device="cuda")
                                  for i in range(layers)])
    twin = copy.deepcopy(eager)
    run = dwgraph.make_graphed_callables(twin, (torch.randn(B, H, device="cuda", requires_grad=True),))
    side = torch.cuda.Stream()
    for step in range(3):
        x = torch.randn(B, H, device="cuda", requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        if stream == "side":
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y = run(x)
            torch.cuda.current_stream().wait_stream(side)
        else:
            y = run(x)
        y.square().sum().backward()
        run.backward_dw()
        eager(xe).square().sum().backward()
        for m in eager:
            if m.delay_wgrad_compute:
                m.backward_dw()
        torch.cuda.synchronize()
        assert torch.equal(x.grad, xe.grad), f"step {step}: input gradient"
        assert_same_as_eager(twin, eager, f"step {step}")
        twin.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)


# Note [FP8 in a checkpoint's recomputation] on CUDA: the recomputation runs on autograd's
# device thread, outside the caller's fp8_autocast, with the scales its forward kept; the
# graphed pipeline replays the snapshot of fp8_scale as a kernel.
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_checkpointed_mlp_on_cuda_equals_checkpoint_false_and_replays_bitwise(scaling):
    from dwgraph.fp8 import DelayedScaling, Float8CurrentScaling, fp8_autocast

    recipe = DelayedScaling(amax_history_len=4) if scaling == "delayed" else Float8CurrentScaling()

    def make(ckpt):
        torch.manual_seed(0)
        return torch.nn.Sequential(dwgraph.nn.LayerNormMLP(H, 4 * H, checkpoint=ckpt, delay_wgrad_compute=True,
                                                           fuse_wgrad_accumulation=True, device="cuda"))

    plain, eager, layer = make(False), make(True), make(True)
    m = 4
    order = one_f_one_b(m)
    samples = tuple((torch.randn(B, H, device="cuda", requires_grad=True),) for _ in range(m))
    slots = dwgraph.make_graphed_callables((layer,), samples, order=order, enabled=True, recipe=recipe)
    opts = [(mod, torch.optim.SGD(mod.parameters(), lr=1e-2)) for mod in (layer, eager, plain)]
    for step in range(3):
        xs = [torch.randn(B, H, device="cuda", requires_grad=True) for _ in range(m)]
        run_order(order, lambda mb, x: slots[mb](x), lambda mb: slots[mb].backward_dw(), xs)
        copies = {}
        for name, mod in (("eager", eager), ("plain", plain)):
            ex = copies[name] = [x.detach().clone().requires_grad_() for x in xs]

            def fwd(mb, x, mod=mod):
                with fp8_autocast(enabled=True, recipe=recipe):
                    return mod(x)

            run_order(order, fwd, lambda mb, mod=mod: [d.backward_dw() for d in mod], ex)
        torch.cuda.synchronize()
        for i in range(m):
            assert torch.equal(xs[i].grad, copies["eager"][i].grad), f"step {step}: graphed input gradient"
            assert torch.equal(copies["plain"][i].grad, copies["eager"][i].grad), f"step {step}: checkpoint=False"
        assert_same_as_eager(layer, eager, f"step {step}")
        assert_same_as_eager(plain, eager, f"step {step}: checkpoint=False")
        assert_same_fp8_state(layer, eager, f"step {step}")
        assert_same_fp8_state(plain, eager, f"step {step}: checkpoint=False")
        step_on_main_grads(opts)


# Note [Checkpoints recompute whole in a host capture] is host-only: a CUDA capture keeps
# torch's early stop, whose recomputation raises out of its last saving call after the
# stream captured that call's kernels. The replay must still be eager's.
@pytest.mark.parametrize("entry", ["make_graphed_callables", "graphed_step"])
def test_torch_checkpoint_with_early_stop_replays_eagers_gradients_on_cuda(entry):
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(H, H, device="cuda")

        def forward(self, u):
            return checkpoint(lambda v: torch.tanh(self.lin(v)), u, use_reentrant=False)

    eager, block = Block(), Block()
    if entry == "make_graphed_callables":
        graphed = dwgraph.make_graphed_callables(block, (torch.randn(B, H, device="cuda", requires_grad=True),))

        def run(mod, x):
            mod(x).square().sum().backward()
    else:
        def body(mod, x):
            loss = mod(x).square().sum()
            loss.backward()
            return loss

        graphed = dwgraph.graphed_step(lambda x: body(block, x), warmup_iters=1)
    for call in range(4):
        xv = torch.randn(B, H, device="cuda")
        if entry == "make_graphed_callables":
            xg, xe = xv.clone().requires_grad_(), xv.clone().requires_grad_()
            run(graphed, xg)
            run(eager, xe)
        else:
            assert torch.equal(graphed(xv.clone()), body(eager, xv.clone())), f"call {call}: loss"
        torch.cuda.synchronize()
        if entry == "make_graphed_callables":
            assert torch.equal(xg.grad, xe.grad), f"call {call}: input gradient"
        for p, q in zip(block.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), f"call {call}: weight gradient"
        block.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_torch_checkpoint_of_fp8_current_scaling_on_cuda_is_exact_or_refused(reentrant):
    # Note [A forward recomputed inside a backward]: on CUDA the recomputation runs on
    # autograd's device thread, where the caller's fp8_autocast (thread-local) is not
    # active: it must be refused (typed) rather than recompute in high precision; where it
    # does see FP8 it must equal the module without checkpoint bitwise. Never silently other.
    from dwgraph.fp8 import Float8CurrentScaling, fp8_autocast
    torch.manual_seed(0)
    m = dwgraph.nn.Linear(H, H, device="cuda")
    ref = copy.deepcopy(m)
    x = torch.randn(B, H, device="cuda", requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    with fp8_autocast(recipe=Float8CurrentScaling()):
        ye = ref(xe)
        ye.square().sum().backward()
        y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=reentrant)
        try:
            y.square().sum().backward()
        except dwgraph.ArgumentError as e:
            assert "inside a backward pass" in str(e)
            return
    assert torch.equal(y, ye) and torch.equal(x.grad, xe.grad) and torch.equal(m.weight.grad, ref.weight.grad)
