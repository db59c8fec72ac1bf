"""Hooks and errors (SPEC C8):

  * module hooks present at capture would run inside the captured region and never at
    replay: refused (on the module and on every submodule, and torch's global module
    hooks), unless given as capture-time hooks (TransformerEngine's ``capture_time_hooks``,
    run around warmup and capture, outside the graphs, never replayed);
  * parameter tensor hooks (``register_hook``, ``register_post_accumulate_grad_hook``),
    registered before capture or after, run at each graphed backward as in eager (the
    deferred weight's with None, as in eager dwgraph), never during warmup or capture;
  * hooks registered after make_graphed_callables run around every replay, as eager; those
    registered on a submodule, or global ones, are refused at the call (fine again once
    removed);
  * a wgrad hook that ``reset()``s the graphs while gradients land: every module's hook
    runs, the gradients land, later calls are refused; a hook on the call's input that
    ``reset()``s them between the graphed backward and the parameters' hand-off: the
    parameters get that backward's gradients, as eager;
  * buffers that require grad are refused;
  * errors keep their type through ``loss.backward()`` and from inside a capture (the
    remaining cases are in test_core_contracts.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import dwgraph
from safety_common import (SMALL_B, SMALL_H, assert_same_as_eager, deferred_bn_linear, eager_backward_dw,
                           run_where, step_graphed_and_eager, two_deferred)

H = 16
B = 8


def _model():
    torch.manual_seed(9)
    return torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.GELU(),
                               torch.nn.Linear(H, H))


HOOKS = {
    "forward_on_module": lambda m: m.register_forward_hook(lambda mod, i, o: o * 2),
    "forward_pre_on_submodule": lambda m: m[2].register_forward_pre_hook(lambda mod, i: None),
    "full_backward_on_submodule": lambda m: m[0].register_full_backward_hook(lambda mod, gi, go: None),
    "backward_pre_on_module": lambda m: m.register_full_backward_pre_hook(lambda mod, go: None),
}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_hooks_present_at_capture_are_refused(hook):
    model = _model()
    HOOKS[hook](model)
    with pytest.raises(dwgraph.ArgumentError, match="capture_time_hooks"):
        dwgraph.make_graphed_callables(model, (torch.randn(B, H),))
    assert model[0].num_queued_wgrad_units() == 0


def test_global_module_hooks_are_refused():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, i, o: None)
    try:
        with pytest.raises(dwgraph.ArgumentError, match="global module forward hooks"):
            dwgraph.make_graphed_callables(_model(), (torch.randn(B, H),))
    finally:
        handle.remove()


def test_buffer_that_requires_grad_is_refused():
    model = _model()
    model.register_buffer("scale", torch.ones(H, requires_grad=True))
    with pytest.raises(dwgraph.ArgumentError, match="buffer 'scale' .* requires grad"):
        dwgraph.make_graphed_callables(model, (torch.randn(B, H),))


def test_hooks_registered_after_capture_run_around_every_replay():
    model = _model()
    eager = copy.deepcopy(model)
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H),))
    seen = []
    for m, tag in ((model, "graphed"), (eager, "eager")):
        m.register_forward_hook(lambda mod, i, o, tag=tag: (seen.append(tag), o * 2)[1])
    for step in range(3):
        x = torch.randn(B, H)
        yg, ye = g(x), eager(x)
        assert torch.equal(yg, ye)
        yg.square().sum().backward()
        g.backward_dw()
        ye.square().sum().backward()
        eager_backward_dw(eager)
        assert_same_as_eager(model, eager, f"step {step}")
    assert seen == ["graphed", "eager"] * 3


def test_capture_time_hooks_run_at_capture_only():
    model = _model()
    calls = []
    hooks = [{
        "forward_pre_hooks": {0: lambda m: calls.append("fwd_pre")},
        "forward_hooks": {0: lambda m: calls.append("fwd")},
        "backward_pre_hooks": {0: lambda m: calls.append("bwd_pre")},
        "backward_hooks": {0: lambda m: calls.append("bwd")},
    }]
    g = dwgraph.make_graphed_callables((model,), ((torch.randn(B, H),),), num_warmup_iters=2,
                                       capture_time_hooks=hooks)[0]
    # two warmup iterations and one capture of each graph
    assert calls == ["fwd_pre", "fwd", "bwd_pre", "bwd"] * 2 + ["fwd_pre", "fwd", "bwd_pre", "bwd"]
    calls.clear()
    g(torch.randn(B, H)).sum().backward()
    g.backward_dw()
    assert calls == [], "capture-time hooks ran at replay"
    with pytest.raises(dwgraph.ArgumentError, match="unknown keys"):
        dwgraph.make_graphed_callables((_model(),), ((torch.randn(B, H),),), capture_time_hooks=[{"fwd": {}}])
    bad = [{"forward_hooks": {0: lambda m: 1}}]
    with pytest.raises(dwgraph.ArgumentError, match="must not return a value"):
        dwgraph.make_graphed_callables((_model(),), ((torch.randn(B, H),),), capture_time_hooks=bad)


def test_errors_from_replays_keep_their_type():
    model = _model()
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H),))
    with pytest.raises(dwgraph.ArgumentError, match=r"argument 0 must be a Float tensor of shape \[8, 16\] on cpu as at capture, got .* \[9, 16\]"):
        g(torch.randn(B + 1, H))
    with pytest.raises(dwgraph.GraphStateError, match="no backward is pending"):
        g.backward_dw()
    y = g(torch.randn(B, H))
    model[0].weight.requires_grad_(False)
    with pytest.raises(dwgraph.GraphStateError, match="no longer requires grad"):
        y.sum().backward()  # raised inside the graphed backward node, through autograd


# parameter tensor hooks, submodule and global hooks after capture, reset() inside a wgrad hook ---
def _tensor_hook_model():
    torch.manual_seed(13)
    # torch's Linear, a deferred dwgraph Linear, an undeferred one: three ways a weight's
    # gradient reaches its AccumulateGrad (or, deferred, does not).
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.GELU(),
                               dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.Tanh(),
                               dwgraph.nn.Linear(H, H))


TENSOR_HOOKS = {
    # what the hook does with the gradient (None for a deferred weight, in eager as graphed)
    "observes": lambda g: None,
    "changes_it_in_place": lambda g: None if g is None else g.mul_(2),
    "returns_another": lambda g: None if g is None else g * 3 + 1,
}


def _register_tensor_hooks(model, action, log):
    handles = []
    for name, p in model.named_parameters():
        def hook(g, name=name):
            log.setdefault(name, []).append(None if g is None else g.clone())
            return TENSOR_HOOKS[action](g)

        handles.append(p.register_hook(hook))
        handles.append(p.register_post_accumulate_grad_hook(
            lambda p, name=name: log.setdefault(name + " after", []).append(None if p.grad is None else p.grad.clone())))
    return handles


def _same_logs(a, b):
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                       for x, y in zip(a[k], b[k])) for k in a)


@pytest.mark.parametrize("when", ["before_capture", "after_capture", "after_calls"])
@pytest.mark.parametrize("action", list(TENSOR_HOOKS))
def test_parameter_tensor_hooks_run_as_in_eager(action, when):
    # Note [Parameter tensor hooks at replay]: the graphed backward hands every parameter's
    # gradient to its AccumulateGrad, which runs the parameter's hooks on a tensor the caller
    # owns: each hook sees eager's gradient (None for the deferred weight, whose gradient
    # backward_dw() lands without hooks, in eager dwgraph as graphed), may change it as in
    # eager, and stops when removed. Warmup and capture run none of them.
    model = _tensor_hook_model()
    eager = copy.deepcopy(model)
    logs = {"graphed": {}, "eager": {}}
    handles = []
    if when == "before_capture":
        handles += _register_tensor_hooks(model, action, logs["graphed"])
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H),), num_warmup_iters=2)
    assert logs["graphed"] == {}, "a tensor hook ran during warmup or capture"
    if when == "after_capture":
        handles += _register_tensor_hooks(model, action, logs["graphed"])
    if when != "after_calls":
        handles += _register_tensor_hooks(eager, action, logs["eager"])
    for step in range(5):
        if step == 1 and when == "after_calls":  # after calls that replayed (contract C10)
            handles += _register_tensor_hooks(model, action, logs["graphed"])
            handles += _register_tensor_hooks(eager, action, logs["eager"])
        if step == 4:
            for h in handles:
                h.remove()
        x = torch.randn(B, H)
        g(x).square().sum().backward()
        g.backward_dw()
        eager(x).square().sum().backward()
        eager_backward_dw(eager)
        assert _same_logs(logs["graphed"], logs["eager"]), f"step {step}: the hooks saw other gradients than eager's"
        assert_same_as_eager(model, eager, f"step {step}")
        if step == 2:  # a step that accumulates into the gradients of the one before
            continue
        model.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
    ran = 3 if when == "after_calls" else 4
    assert logs["eager"]["2.weight"] == [None] * ran, "the deferred weight's hook saw a gradient in eager"
    assert all(len(v) == ran for v in logs["graphed"].values()), "a removed hook still ran"



@pytest.mark.parametrize("registered_in", ["pre_warmup_hook", "forward_pre_hooks", "backward_pre_hooks"])
def test_parameter_tensor_hooks_registered_during_warmup_or_capture_run_as_in_eager(registered_in):
    # The guard took the parameters' tensor hooks off them once, before warmup: a hook a
    # warmup hook or a capture-time hook registered afterwards ran inside the captured
    # backward and again at every replay (a doubling hook doubled twice, silently). Each
    # warmup and captured backward now takes such hooks off first; they run at the replays.
    model = _tensor_hook_model()
    eager = copy.deepcopy(model)
    logs = {"graphed": [], "eager": []}

    def register(mm, log):
        mm[0].weight.register_hook(lambda g: (log.append(g.clone()), g * 2)[1])

    once = []

    def from_graphing(*_):
        if not once:
            once.append(register(model, logs["graphed"]))

    hooks = {"pre_warmup_hook": from_graphing} if registered_in == "pre_warmup_hook" else \
        {"capture_time_hooks": [{registered_in: {0: from_graphing}}]}
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H),), num_warmup_iters=2, **hooks)
    assert logs["graphed"] == [], "the hook ran during warmup or capture"
    register(eager, logs["eager"])
    for step in range(2):
        step_graphed_and_eager(g, eager, torch.randn(B, H))
        assert _same_logs({"h": logs["graphed"]}, {"h": logs["eager"]}), f"step {step}: the hook saw other gradients"
        assert_same_as_eager(model, eager, f"step {step}")

def test_submodule_hooks_after_capture_are_refused():
    m = deferred_bn_linear()
    g = dwgraph.make_graphed_callables(m, (torch.randn(SMALL_B, SMALL_H),))
    handle = g[1].register_forward_hook(lambda mod, i, o: o * 2)
    with pytest.raises(dwgraph.ArgumentError, match="registered on '1' after capture would not run"):
        g(torch.randn(SMALL_B, SMALL_H))
    handle.remove()
    g(torch.randn(SMALL_B, SMALL_H)).sum().backward()  # fine again
    g.backward_dw()


def test_global_module_hooks_registered_after_capture_are_refused_at_the_call():
    m = dwgraph.make_graphed_callables(two_deferred(), (torch.randn(SMALL_B, SMALL_H, requires_grad=True),))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, i, o: None)
    try:
        with pytest.raises(dwgraph.ArgumentError, match="global"):
            m(torch.randn(SMALL_B, SMALL_H))
    finally:
        handle.remove()
    m(torch.randn(SMALL_B, SMALL_H)).sum().backward()
    m.backward_dw()


def test_reset_inside_a_wgrad_hook_while_gradients_land():
    # A hook that reset() the graphs destroyed the landing (and the callables) it was
    # being run from: a segfault with two hooked modules. The landing runs from a copy.
    torch.manual_seed(0)
    model = torch.nn.Sequential(dwgraph.nn.Linear(SMALL_H, SMALL_H, delay_wgrad_compute=True),
                                dwgraph.nn.Linear(SMALL_H, SMALL_H, delay_wgrad_compute=True))
    ran = []
    dwgraph.make_graphed_callables(model, (torch.randn(SMALL_B, SMALL_H, requires_grad=True),), num_warmup_iters=1)
    model[0].register_wgrad_hook(lambda m: (ran.append(0), dwgraph.graphed_handle(model).reset()))
    model[1].register_wgrad_hook(lambda m: ran.append(1))
    model(torch.randn(SMALL_B, SMALL_H)).sum().backward()
    model.backward_dw()
    assert sorted(ran) == [0, 1] and model[0].weight.grad is not None and model[1].weight.grad is not None
    with pytest.raises(dwgraph.GraphStateError, match="after reset"):
        model(torch.randn(SMALL_B, SMALL_H))


@pytest.mark.parametrize("layers", [2, 9], ids=["few_parameters", "many_parameters"])
@pytest.mark.parametrize("hooks", [False, True], ids=["one_node", "parameter_hooks_chain"])
def test_reset_from_an_input_hook_between_the_backward_and_the_hand_off_lands_as_eager(hooks, layers):
    # The input's hook runs after the graphed backward made the parameters' gradients and
    # before the node that hands them to the parameters; its reset() released the slot that
    # held them, and every .grad of that backward was silently None (a review found it).
    # Few parameters without hooks: the call's node hands them over itself (Note [Parameter
    # gradients through one node]); many: the slot's parameter node.
    def build():
        torch.manual_seed(0)
        body = [m for _ in range(layers - 1) for m in (torch.nn.Linear(H, H), torch.nn.Tanh())]
        return torch.nn.Sequential(*body, torch.nn.Linear(H, 2))

    eager, model = build(), build()
    dwgraph.make_graphed_callables(model, (torch.randn(B, H, requires_grad=True),))
    if hooks:  # the chain of relays (Note [Parameter hooks in autograd's order])
        for m in (eager, model):
            for p in m.parameters():
                p.register_hook(lambda g: g * 2)
    x = torch.randn(B, H, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    before_hand_off = []

    def reset(g):
        before_hand_off.append(all(p.grad is None for p in model.parameters()))
        dwgraph.graphed_handle(model).reset()

    x.register_hook(reset)
    model(x).square().sum().backward()
    assert before_hand_off == [True]  # the reset came inside the window
    eager(xe).square().sum().backward()
    assert torch.equal(x.grad, xe.grad)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    with pytest.raises(dwgraph.GraphStateError, match="after reset"):
        model(x)


@pytest.mark.parametrize("layers", [2, 9], ids=["few_parameters", "many_parameters"])
@pytest.mark.parametrize("where", ["same_thread", "another_thread"])
@pytest.mark.parametrize("start", ["input_hook", "parameter_hook"])
@pytest.mark.parametrize("hooks", [False, True], ids=["one_node", "parameter_hooks_chain"])
def test_a_backward_of_the_same_callable_between_the_backward_and_the_hand_off_lands_both(hooks, start, where, layers):
    # A hook on the call's input runs between the graphed backward and the parameters'
    # hand-off, a parameter's hook between two relays of the hand-off's chain; a call and
    # backward of the same callable there (on this thread, or on one it joins) made a second
    # set of parameter gradients that replaced the first, or the rest of it, before it was
    # handed on: those .grad held one backward's gradient, not both (reviews found both).
    # Few parameters without hooks: the call's node hands them over itself; many: the
    # slot's parameter node, through its stash.
    def build():
        torch.manual_seed(0)
        body = [m for _ in range(layers - 1) for m in (torch.nn.Linear(H, H), torch.nn.ReLU())]
        return torch.nn.Sequential(*body, torch.nn.Linear(H, H))

    eager, model = build(), build()
    dwgraph.make_graphed_callables(model, (torch.randn(B, H, requires_grad=True),))
    if hooks:
        for m in (eager, model):
            for p in m.parameters():
                p.register_hook(lambda g: g * 2)
    xa, xb = torch.randn(B, H), torch.randn(B, H)

    def run(m):
        a, b = xa.clone().requires_grad_(), xb.clone().requires_grad_()
        fired = []

        def inner():
            with torch.enable_grad():
                m(b).square().sum().backward()

        def trigger(_grad):
            if not fired:  # the nested backward reaches the same hook
                fired.append(1)
                run_where(where, inner)

        handle = (a if start == "input_hook" else m[-1].bias).register_hook(trigger)
        m(a).square().sum().backward()
        handle.remove()
        return a.grad, b.grad

    got, want = run(model), run(eager)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
