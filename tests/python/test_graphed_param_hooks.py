"""Hooks on the parameters of a graphed callable against the same modules eagerly (issue 23):
a wgrad hook that raises while backward_dw() lands, and the order of parameter tensor
hooks after a graphed backward."""

from __future__ import annotations

import copy

import pytest
import torch

import dwgraph

H, B = 4, 2


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("graphed", [False, True])
def test_a_raising_wgrad_hook_lands_once_and_consumes_the_unit(graphed, fused):
    torch.manual_seed(0)
    m = dwgraph.nn.Linear(H, 3, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    if fused:
        m.weight.main_grad = torch.zeros_like(m.weight)
    x = torch.randn(B, H, requires_grad=True)
    run = dwgraph.make_graphed_callables(m, (x,)) if graphed else m
    calls = []

    def bad(module):
        calls.append(module)
        raise ValueError("boom from the hook")

    m.register_wgrad_hook(bad)
    m.weight.grad = None
    run(x).sum().backward()
    assert m.num_pending_wgrad_units() == 1
    with pytest.raises(ValueError, match="boom from the hook"):
        m.backward_dw()
    assert calls == [m] and m.num_pending_wgrad_units() == 0
    landed = (m.weight.main_grad if fused else m.weight.grad).clone()
    with pytest.raises(dwgraph.GraphStateError):
        m.backward_dw()  # nothing owed any more: refused, nothing added twice
    assert torch.equal(m.weight.main_grad if fused else m.weight.grad, landed)
    # The reference: the same weights eagerly, a hook that does not raise.
    ref = dwgraph.nn.Linear(H, 3, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    ref.load_state_dict(m.state_dict())
    if fused:
        ref.weight.main_grad = torch.zeros_like(ref.weight)
    ref(x.detach().clone().requires_grad_()).sum().backward()
    ref.backward_dw()
    assert torch.equal(landed, ref.weight.main_grad if fused else ref.weight.grad)


def _hook_order(model, x, graphed):
    order = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, n=name: order.append(("hook", n)))
        p.register_post_accumulate_grad_hook(lambda p, n=name: order.append(("post", n)))
    run = dwgraph.make_graphed_callables(model, (x,)) if graphed else model
    run(x).sum().backward()
    return order


@pytest.mark.xfail(strict=True, reason="open (issue 23): after a graphed backward the parameter hooks run in "
                                       "named_parameters() order, not in autograd's order")
def test_parameter_hooks_run_in_eagers_order_after_a_graphed_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(dwgraph.nn.Linear(H, 3, delay_wgrad_compute=True), torch.nn.Linear(3, 2))
    twin = copy.deepcopy(model)
    x = torch.randn(B, H, requires_grad=True)
    assert _hook_order(twin, x, graphed=True) == _hook_order(model, x, graphed=False)


def _wgrad_hook_runs(model, graphed, fused, change):
    """Which wgrad hooks of the non-deferred layer run at a backward, with `change` made
    between the forward and the backward, over three calls (the change at the first)."""
    layer = [m for m in model.modules() if isinstance(m, dwgraph.nn.Linear) and not m.delay_wgrad_compute][0]
    for m in model.modules():
        if isinstance(m, dwgraph.nn.Linear) and m.fuse_wgrad_accumulation:
            m.weight.main_grad = torch.zeros_like(m.weight)
    torch.manual_seed(1)
    xs = [torch.randn(B, H, requires_grad=True) for _ in range(3)]
    run = dwgraph.make_graphed_callables(model, (torch.randn(B, H, requires_grad=True),)) if graphed else model
    runs, handles = [], []

    def hook(name):
        return lambda mod: runs[-1].append((name, mod.bias.grad.clone()))

    if change != "added":
        handles.append(layer.register_wgrad_hook(hook("first")))
    for step, x in enumerate(xs):
        runs.append([])
        y = run(x)
        if step == 0:
            if change == "removed":
                handles.pop().remove()
            else:
                handles.append(layer.register_wgrad_hook(hook("added")))
        y.sum().backward()
        for m in model.modules():
            if isinstance(m, dwgraph.nn.Linear) and m.delay_wgrad_compute:
                m.backward_dw()
    return runs


@pytest.mark.parametrize("change", ["added", "removed", "another added"])
@pytest.mark.parametrize("model", ["alone", "after a deferred one"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_wgrad_hook_of_a_layer_without_deferral_changed_after_the_forward(fused, model, change):
    # Eager: a layer whose gradients land in the backward runs its hooks after the backward
    # only if it had some at its forward (those it has then); graphed the same.
    def make():
        torch.manual_seed(0)
        plain = dwgraph.nn.Linear(H, 3, fuse_wgrad_accumulation=fused)
        if model == "alone":
            return plain
        return torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused),
                                   plain)

    eager = _wgrad_hook_runs(make(), False, fused, change)
    graphed = _wgrad_hook_runs(make(), True, fused, change)
    assert [[n for n, _ in r] for r in graphed] == [[n for n, _ in r] for r in eager]
    for g, e in zip(graphed, eager):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(g, e))
    assert eager[0] == [] if change == "added" else True  # the case the eager rule decides
