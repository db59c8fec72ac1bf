"""Hooks on the parameters of a graphed callable against the same modules eagerly (issue 23):
a wgrad hook that raises while backward_dw() lands, and the order of parameter tensor
hooks after a graphed backward (Note [Parameter hooks in autograd's order])."""

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


_MODELS = {
    "deferred + torch": lambda: torch.nn.Sequential(dwgraph.nn.Linear(H, 3, delay_wgrad_compute=True),
                                                    torch.nn.Linear(3, H)),
    "torch x3": lambda: torch.nn.Sequential(torch.nn.Linear(H, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3),
                                            torch.nn.Linear(3, H)),
    "layernorm mlp + linear": lambda: torch.nn.Sequential(dwgraph.nn.LayerNormMLP(H, 8),
                                                          dwgraph.nn.Linear(H, H, fuse_wgrad_accumulation=True)),
    "one parameter": lambda: torch.nn.Linear(H, H, bias=False),
}


class _Sandwich(torch.nn.Module):
    """Eager layers before and after the graphed part, as a per-layer graphed model has."""

    def __init__(self, middle):
        super().__init__()
        self.pre, self.middle, self.post = torch.nn.Linear(H, H), middle, torch.nn.Linear(H, 2)

    def forward(self, x):
        return self.post(self.middle(self.pre(x)))


def _hook_order(model, graphed, inputs=None, steps=3, when="before capture"):
    for m in model.modules():
        if isinstance(m, dwgraph.nn.Linear) and m.fuse_wgrad_accumulation:
            m.weight.main_grad = torch.zeros_like(m.weight)
    order = []

    def register():
        for name, p in model.named_parameters():
            p.register_hook(lambda g, n=name: order.append(("hook", n, None if g is None else g.clone())))
            p.register_post_accumulate_grad_hook(lambda p, n=name: order.append(("post", n, None)))

    if when == "before capture":
        register()
    torch.manual_seed(1)
    x = torch.randn(B, H, requires_grad=True)
    if graphed:
        model.middle = dwgraph.make_graphed_callables(model.middle, (torch.randn(B, H, requires_grad=True),))
    if when == "after capture":
        register()
    runs = []
    for step in range(steps):
        if when == "after a call" and step == 1:
            register()
        order.clear()
        loss = model(x).sum()
        params = dict(model.named_parameters())
        if inputs is None:
            loss.backward()
        else:
            loss.backward(inputs=[params[n] for n in inputs])
        for m in model.modules():
            if isinstance(m, dwgraph.nn.Linear) and m.delay_wgrad_compute and m.num_pending_wgrad_units():
                m.backward_dw()
        runs.append(list(order))
    return runs


def _same_order(graphed, eager):
    assert [[e[:2] for e in r] for r in graphed] == [[e[:2] for e in r] for r in eager]
    for rg, re_ in zip(graphed, eager):
        for (_, _, a), (_, _, b) in zip(rg, re_):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("when", ["before capture", "after capture", "after a call"])
@pytest.mark.parametrize("inputs", [None, "some"], ids=["backward", "backward(inputs=...)"])
@pytest.mark.parametrize("model", list(_MODELS))
def test_parameter_hooks_run_in_eagers_order_after_a_graphed_backward(model, inputs, when):
    # Note [Parameter hooks in autograd's order]: the graphed part's parameter hooks run
    # where and in the order eager's backward runs them, between the eager layers' own.
    torch.manual_seed(0)
    eager = _Sandwich(_MODELS[model]())
    twin = copy.deepcopy(eager)
    names = [n for n, _ in eager.named_parameters()]
    asked = None if inputs is None else names[::2]  # every other one, the graphed part's among them
    _same_order(_hook_order(twin, True, asked, when=when), _hook_order(eager, False, asked, when=when))


@pytest.mark.parametrize("layers", [3, 9], ids=["few parameters", "many parameters"])
def test_parameter_gradients_go_through_relays_only_while_a_parameter_has_hooks(layers):
    # The chain costs an engine node per parameter: a call's node leads to it only once some
    # parameter has a tensor hook (a removed Python hook leaves its empty hook dict on the
    # tensor, which keeps the chain: the same order, at the chain's cost). Without hooks, a
    # slot with few parameters has the edges to them on the call's node itself (no node in
    # between: Note [Parameter gradients through one node]); one with many, on the slot's
    # one node with an edge per parameter, so a call's edges stay bounded.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(H, H) for _ in range(layers)])
    run = dwgraph.make_graphed_callables(model, (torch.randn(B, H, requires_grad=True),))
    params = list(model.parameters())
    n = len(params)

    def param_edges():
        node = run(torch.randn(B, H, requires_grad=True)).grad_fn
        return [f for f, _ in node.next_functions[1:]]  # after the input's

    def leads_to_each_parameter(fns):
        return sorted(id(f.variable) for f in fns) == sorted(id(p) for p in params)

    def plain():
        fns = param_edges()
        if n <= 16:
            return len(fns) == n and leads_to_each_parameter(fns)
        return len(fns) == 1 and leads_to_each_parameter([f for f, _ in fns[0].next_functions])

    assert plain()
    torch.zeros(1, requires_grad=True).register_hook(lambda g: None)  # a leaf elsewhere: looked, none
    assert plain()
    model[-1].bias.register_post_accumulate_grad_hook(lambda p: None)
    fns = param_edges()
    assert len(fns) == 1 and len(fns[0].next_functions) == 2  # the chain's head: a parameter and the next relay


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
