"""``@graphed_step``'s plain call (Note [A step's plain call], graphs/graphed_step.h; contract
C10): a call whose arguments are distinct plain tensors, like the last such call, under the
same ambient state and state epoch, is replayed by the core without the front end building
its key. Each test reaches the steady state (warmup calls, capture, replays through the
plain path), changes one thing between two calls, and checks the graphed step against the
same step run eagerly on a copy, bitwise (FP32 on the host graph), or the typed refusal
the general path gives; then a few calls more, through the plain path again where it applies.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

import dwgraph
from dwgraph import step as step_module


def _body_of(m, opt):
    def body(x, y):
        loss = (m(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return body


def _make(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    twin = copy.deepcopy(model)
    opts = [make_opt(m.parameters()) for m in (model, twin)]
    eager = _body_of(model, opts[0])
    graphed = dwgraph.graphed_step(_body_of(twin, opts[1]))
    return (model, opts[0], eager), (twin, opts[1], graphed)


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared by type below
        return e


def _same(a, b):
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b)
    return torch.equal(a, b)


def _check_models(e, g):
    for p, q in zip(e[0].parameters(), g[0].parameters()):
        assert torch.equal(p, q)


class _KeyBuilds:
    """Counts the front end's key builds (its general path)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = step_module._flatten

        def counting(obj, tensors, path):
            if path in ("args", "kwargs"):
                self.n += 1
            return real(obj, tensors, path)

        monkeypatch.setattr(step_module, "_flatten", counting)


def _keep_matching(e, g, x, y, calls=5, check_each=False):
    """`calls` more calls of both with the same arguments, equal each time; the models equal
    after each call or at the end."""
    for _ in range(calls):
        assert _same(e[2](x, y), g[2](x, y))
        if check_each:
            _check_models(e, g)
    _check_models(e, g)


def _steady(e, g, x, y, steps=6):
    for _ in range(steps):
        assert _same(e[2](x, y), g[2](x, y))
    assert g[2].num_captures == 1


def test_steady_calls_build_no_key(monkeypatch):
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    builds = _KeyBuilds(monkeypatch)
    for _ in range(4):
        x, y = torch.randn(3, 4), torch.randn(3, 4)  # new tensors each step, as a data loader gives
        assert _same(e[2](x, y), g[2](x, y))
    assert builds.n == 0
    assert g[2].stats()["replays"] >= 5
    _check_models(e, g)


@pytest.mark.parametrize("schedule", [False, True])
def test_steady_plain_calls_do_not_ask_the_variant_state(monkeypatch, schedule):
    """Note [A step's plain call]: while nothing moved but a schedule's numbers (taken by the
    core), the binding's probe stands for the variant state: the front end is not asked."""
    e, g = _make()
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9) for o in (e[1], g[1])] if schedule else []
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    asked = [0]
    real = g[2]._variant_state

    def counting():
        asked[0] += 1
        return real()

    monkeypatch.setattr(g[2], "_variant_state", counting)
    for _ in range(5):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        assert _same(e[2](x, y), g[2](x, y))
        for s in scheds:
            s.step()
    assert asked[0] == 0
    assert g[2].num_captures == 1
    _check_models(e, g)
    # A change the probe does not stand for (the learning rate's type): asked again, and the
    # probe follows the answer (the next calls are not asked again).
    for opt in (e[1], g[1]):
        opt.param_groups[0]["lr"] = 1
    _keep_matching(e, g, x, y, calls=1)
    assert asked[0] >= 1
    before = asked[0]
    _keep_matching(e, g, x, y, calls=3, check_each=True)
    assert asked[0] == before


def test_a_grad_scaler_state_left_on_the_optimizer_is_refused_as_eagerly():
    """grad_scale set on the optimizer between plain calls selects another variant (the
    watch's words hold it): torch's step is captured and refuses it as eagerly; removed,
    the first graph serves again."""
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    _change_grad_scale_set(e, g, x, y)
    for _ in range(3):
        got, want = _outcome(g[2], x, y), _outcome(e[2], x, y)
        assert isinstance(want, AssertionError) and _same(want, got), (want, got)
        _check_models(e, g)
    for m, opt in ((e[0], e[1]), (g[0], g[1])):
        del opt.grad_scale
        m.zero_grad(set_to_none=True)  # eager's failed steps left their gradients (a known difference)
    _keep_matching(e, g, x, y, check_each=True)


@pytest.mark.parametrize("impl", ["fused_sgd", "fused_adam"])
def test_a_grad_scale_replaced_between_plain_calls_matches_eager(impl):
    """A fused optimizer unscales by the grad_scale tensor set on it (as GradScaler.step does
    for it): set, replaced by another tensor, removed between calls, each matches eager (the
    tensor's identity is in the variant state; a graph reads the tensor it captured)."""
    e, g = _make({"fused_sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
                  "fused_adam": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True)}[impl])
    oe, og = e[1], g[1]
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    kept = []
    for scale in (2.0, 4.0, None):
        for opt in (oe, og):
            if scale is None:
                del opt.grad_scale
            else:
                opt.grad_scale = torch.tensor(scale)
                kept.append(opt.grad_scale)  # the replaced one stays alive: compared by identity
        _keep_matching(e, g, x, y, calls=3, check_each=True)


@pytest.mark.parametrize("replacement", ["function", "module"])
def test_a_module_the_step_ran_dropped_between_plain_calls_matches_eager(replacement):
    """The step keeps the modules it ran weakly: one dropped between calls (a loss module
    swapped for a function, or for a module of another class with the same flags and hooks)
    moves no epoch; the plain call's probe counts the modules, and their classes are in the
    variant state (so the first graph is not chosen again for the new module)."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"loss": torch.nn.MSELoss()}

    def body_of(m, opt, held):
        def body(x, y):
            loss = held["loss"](m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return body

    me, oe, he = make()
    mg, og, hg = make()
    eager, graphed = body_of(me, oe, he), dwgraph.graphed_step(body_of(mg, og, hg))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(6):
        assert torch.equal(eager(x, y), graphed(x, y))
    if replacement == "function":
        he["loss"] = hg["loss"] = torch.nn.functional.l1_loss
    else:
        he["loss"], hg["loss"] = torch.nn.L1Loss(), torch.nn.L1Loss()
    for _ in range(4):
        assert torch.equal(eager(x, y), graphed(x, y))
        assert torch.equal(me.weight, mg.weight) and torch.equal(me.bias, mg.bias)
    assert graphed.num_captures == (2 if replacement == "function" else 3)


def _trained_plain_tensor_step():
    torch.manual_seed(0)
    w = [torch.randn(4, requires_grad=True) for _ in range(2)]
    opts = [torch.optim.SGD([t], lr=0.1) for t in w]

    def body_of(t, opt):
        def body(x):
            (t * x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return body

    return w, dwgraph.graphed_step(body_of(w[1], opts[1]))


def test_a_trained_plain_tensor_as_argument_is_refused_after_plain_replays():
    w, step = _trained_plain_tensor_step()
    for _ in range(6):
        step(torch.randn(4))
    assert step.num_captures == 1
    before = w[1].detach().clone()
    with pytest.raises(dwgraph.ArgumentError, match="trains"):
        step(w[1])
    assert torch.equal(w[1], before)  # refused before anything ran
    step(torch.randn(4))  # the plain path still replays
    assert step.num_captures == 1


# Each change: (what it does to both copies between two calls, the arguments of the next call).
def _change_param_argument(e, g, x, y):
    return (x, g[0][0].weight), (x, e[0][0].weight)


def _change_same_tensor_twice(e, g, x, y):
    return (x, x), (x, x)


def _change_views_of_one_storage(e, g, x, y):
    both = torch.randn(2, 3, 4)
    return (both[0], both[1]), (both[0], both[1])


def _change_shape(e, g, x, y):
    x2, y2 = torch.randn(5, 4), torch.randn(5, 4)
    return (x2, y2), (x2, y2)


def _change_requires_grad(e, g, x, y):
    x2 = x.clone().requires_grad_()
    return (x2, y), (x2.detach().clone().requires_grad_(), y)


def _change_dtype(e, g, x, y):
    return (x.double(), y), (x.double(), y)


def _change_forward_hook(e, g, x, y):
    for m in (e[0], g[0]):
        m[1].register_forward_hook(lambda mod, inp, out: out * 0.5)
    return (x, y), (x, y)


def _change_eval(e, g, x, y):
    e[0].eval()
    g[0].eval()
    return (x, y), (x, y)


def _change_parameter_replaced(e, g, x, y):
    torch.manual_seed(1)
    w = torch.randn(4, 4)
    for m, opt in ((e[0], e[1]), (g[0], g[1])):
        m[2].weight = torch.nn.Parameter(w.clone())
        opt.param_groups[0]["params"][2] = m[2].weight
    return (x, y), (x, y)


def _change_submodule_replaced(e, g, x, y):
    for m in (e[0], g[0]):
        m[1] = torch.nn.Sigmoid()  # no parameters, no optimizer change: only the tree says it
    return (x, y), (x, y)


def _change_parameter_replaced_outside_the_optimizer(e, g, x, y):
    torch.manual_seed(1)
    w = torch.randn(4, 4)
    for m in (e[0], g[0]):
        m[0].weight = torch.nn.Parameter(w.clone())  # gets a .grad, which no optimizer steps
    return (x, y), (x, y)


def _change_lr(e, g, x, y):
    for opt in (e[1], g[1]):
        opt.param_groups[0]["lr"] = 0.05
    return (x, y), (x, y)


def _change_lr_type(e, g, x, y):
    # An int learning rate after floats: another variant (its type selects one), found by
    # asking the variant state again after the plain call's probe finds the group moved.
    for opt in (e[1], g[1]):
        opt.param_groups[0]["lr"] = 1
    return (x, y), (x, y)


def _change_momentum_zero(e, g, x, y):
    for opt in (e[1], g[1]):
        opt.param_groups[0]["momentum"] = 0.0  # torch branches on it
    return (x, y), (x, y)


def _change_state_cleared(e, g, x, y):
    for opt in (e[1], g[1]):
        opt.state.clear()
    return (x, y), (x, y)


def _change_momentum_buffer_none(e, g, x, y):
    # torch's SGD makes a new buffer where it finds None (a way to reset momentum): the
    # capture would make it in the graph's pool, so that call runs eagerly first.
    for opt in (e[1], g[1]):
        for st in opt.state.values():
            st["momentum_buffer"] = None
    return (x, y), (x, y)


def _change_group_added(e, g, x, y):
    for m, opt in ((e[0], e[1]), (g[0], g[1])):
        params = opt.param_groups[0]["params"]
        del params[next(i for i, p in enumerate(params) if p is m[2].bias)]  # in place: the same list
        opt.add_param_group({"params": [m[2].bias], "lr": 0.2})
    return (x, y), (x, y)


def _change_grad_scale_set(e, g, x, y):
    # A GradScaler's state left on the optimizer: eagerly SGD's step refuses it
    # (AssertionError); a graph captured without it must not replay as if it were absent.
    for opt in (e[1], g[1]):
        opt.grad_scale = torch.tensor(2.0)
    return (x, y), (x, y)


def _change_grad_exists(e, g, x, y):
    for m in (e[0], g[0]):
        m[0].bias.grad = torch.ones(4)
    return (x, y), (x, y)


def _change_frozen(e, g, x, y):
    for m in (e[0], g[0]):
        m[0].weight.requires_grad_(False)
    return (x, y), (x, y)


def _change_reset(e, g, x, y):
    g[2].reset()
    return (x, y), (x, y)


CHANGES = {
    "parameter_argument": _change_param_argument,
    "same_tensor_twice": _change_same_tensor_twice,
    "views_of_one_storage": _change_views_of_one_storage,
    "shape": _change_shape,
    "requires_grad": _change_requires_grad,
    "dtype": _change_dtype,
    "forward_hook": _change_forward_hook,
    "eval": _change_eval,
    "parameter_replaced": _change_parameter_replaced,
    "parameter_replaced_outside_the_optimizer": _change_parameter_replaced_outside_the_optimizer,
    "submodule_replaced": _change_submodule_replaced,
    "lr": _change_lr,
    "lr_type": _change_lr_type,
    "momentum_zero": _change_momentum_zero,
    "state_cleared": _change_state_cleared,
    "group_added": _change_group_added,
    "momentum_buffer_none": _change_momentum_buffer_none,
    "grad_exists": _change_grad_exists,
    "frozen": _change_frozen,
    "reset": _change_reset,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_between_plain_calls_matches_eager(change):
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    g_args, e_args = CHANGES[change](e, g, x, y)
    got = _outcome(g[2], *g_args)
    if change in ("parameter_argument", "views_of_one_storage"):
        # A parameter as an argument, two arguments sharing memory: refused before anything
        # ran (eager runs them), exactly as on a first call.
        assert isinstance(got, dwgraph.ArgumentError), got
    else:
        assert _same(_outcome(e[2], *e_args), got)
    _check_models(e, g)
    # A few calls more, the changed state kept (the same arguments as before the change).
    _keep_matching(e, g, x, y)


@pytest.mark.parametrize("how", ["no_grad", "autocast_without_cache", "autocast_with_cache"])
def test_the_ambient_state_changed_between_plain_calls(how):
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    ctx = {
        "no_grad": torch.no_grad,
        "autocast_without_cache": lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
        "autocast_with_cache": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }[how]
    with ctx():
        got = _outcome(g[2], x, y)
    if how == "autocast_with_cache":
        # The autocast weight cache would outlive the capture: refused, before anything ran.
        assert isinstance(got, dwgraph.ArgumentError), got
    else:
        with ctx():
            expected = _outcome(e[2], x, y)
        assert _same(expected, got), (expected, got)
    _check_models(e, g)
    _keep_matching(e, g, x, y)


def test_keyword_arguments_after_plain_calls_take_the_general_path(monkeypatch):
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    builds = _KeyBuilds(monkeypatch)
    assert _same(e[2](x, y=y), g[2](x, y=y))
    assert builds.n == 2  # args and kwargs, through the general path
    _keep_matching(e, g, x, y)


@pytest.mark.parametrize("how", ["detach", "view"])
def test_a_view_of_a_trained_tensor_as_argument_is_refused(how):
    # Eagerly the argument shares the trained tensor's memory and sees the optimizer's
    # update; a graph would read its static copy.
    w, step = _trained_plain_tensor_step()
    for _ in range(6):
        step(torch.randn(4))
    alias = w[1].detach() if how == "detach" else w[1].detach()[:2]
    before = w[1].detach().clone()
    with pytest.raises(dwgraph.ArgumentError, match="shares memory with what the step updates"):
        step(alias)
    assert torch.equal(w[1], before)
    step(torch.randn(4))  # the plain path still replays
    assert step.num_captures == 1


def test_a_trained_tensor_found_by_a_call_that_raised_is_refused_at_the_next_plain_call():
    # The general call that finds a new trained tensor raises after finding it: the plain
    # call recorded before it must not let that tensor through.
    torch.manual_seed(0)
    w1, w2 = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    opt = torch.optim.SGD([w1, w2], lr=0.1)

    def body(x, also=False):
        loss = (w1 * x).sum() + ((w2 * x).sum() if also else 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return 1.0 if also else loss  # a number: refused after the step ran

    step = dwgraph.graphed_step(body)
    for _ in range(6):
        step(torch.randn(4))
    with pytest.raises(dwgraph.ArgumentError):
        step(torch.randn(4), also=True)
    with pytest.raises(dwgraph.ArgumentError, match="trains"):
        step(w2)


def test_an_inference_tensor_argument_is_refused_outside_inference_mode():
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    with torch.inference_mode():
        xi = torch.randn(3, 4)
    with pytest.raises(dwgraph.ArgumentError, match="inference tensor"):
        g[2](xi, y)
    assert isinstance(_outcome(e[2], xi, y), RuntimeError)  # eager cannot save it for backward
    _check_models(e, g)
    _keep_matching(e, g, x, y, calls=3)


def test_inference_mode_with_grad_enabled_inside_is_in_the_key():
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    with torch.inference_mode(), torch.enable_grad():
        expected, got = _outcome(e[2], x, y), _outcome(g[2], x, y)
    assert isinstance(expected, RuntimeError) and _same(expected, got), (expected, got)
    _check_models(e, g)


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_parameter_hook_added_and_removed_after_capture_matches_eager(kind):
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)

    def scale(t):
        if kind == "register_hook":
            return t * 3
        t.grad.mul_(3)

    handles = [getattr(m[0].bias, kind)(scale) for m in (e[0], g[0])]
    _keep_matching(e, g, x, y, check_each=True)
    for h in handles:
        h.remove()
    _keep_matching(e, g, x, y, check_each=True)


@pytest.mark.parametrize("what", ["momentum_buffer", "momentum_slice", "from_numpy_slice"])
def test_state_the_step_updates_as_argument_is_refused(what):
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    w = g[0][0].weight
    arg = {
        "momentum_buffer": lambda: g[1].state[w]["momentum_buffer"],
        "momentum_slice": lambda: g[1].state[w]["momentum_buffer"][1:],
        "from_numpy_slice": lambda: torch.from_numpy(w.detach().numpy()[1:]),  # another storage, same memory
    }[what]()
    with pytest.raises(dwgraph.ArgumentError, match="shares memory with what the step updates"):
        g[2](arg[:3, :4] if arg.dim() == 2 else arg, y)
    _check_models(e, g)


def test_a_slice_of_a_buffer_the_step_only_reads_is_accepted():
    # A lookup table held as a module buffer, batches sliced from it: not what the step
    # updates (refused for a few commits of 2026-12-05, which refused every buffer).
    e, g = _make()
    for m in (e[0], g[0]):
        m.register_buffer("table", torch.arange(48, dtype=torch.float32).view(12, 4) / 48)
    y = torch.randn(3, 4)
    for i in range(8):
        xe, xg = e[0].table[i:i + 3], g[0].table[i:i + 3]
        assert _same(e[2](xe, y), g[2](xg, y))
    assert g[2].num_captures == 1
    _check_models(e, g)


@pytest.mark.parametrize("change", ["load_state_dict", "assigned"])
def test_optimizer_state_moved_then_passed_as_argument_is_refused_at_once(change):
    # The general path's first call after the state tensors moved compares the arguments
    # with the state as it is now, not as the last call pushed it.
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    w = g[0][0].weight
    if change == "load_state_dict":
        g[1].load_state_dict(copy.deepcopy(g[1].state_dict()))
    else:
        g[1].state[w]["momentum_buffer"] = g[1].state[w]["momentum_buffer"].clone()
    with pytest.raises(dwgraph.ArgumentError, match="shares memory with what the step updates"):
        g[2](x=g[1].state[w]["momentum_buffer"][:3], y=y)  # keyword arguments: the general path


def _twin_linear_steps(make_opt):
    """Two equal Linear(4, 4), each with its optimizer from `make_opt`: the step
    `body(x, scale)` on the first run eagerly, on the second graphed."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())

    def body_of(m, opt):
        def body(x, scale=1.0):
            loss = (m(x) * scale).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return body

    eager, graphed = (body_of(m, make_opt(m)) for m in models)
    return models, eager, dwgraph.graphed_step(graphed)


def test_a_tensor_learning_rate_passed_as_argument_is_accepted():
    # A param group's tensor value is read by the step, not updated by it.
    lr = torch.tensor(0.01)
    models, eager, step = _twin_linear_steps(lambda m: torch.optim.Adam(m.parameters(), lr=lr, fused=True))
    for _ in range(7):
        x = torch.randn(3, 4)
        assert torch.equal(eager(x, lr), step(x, lr))
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


def test_arguments_with_gaps_in_memory_are_captured_in_their_layout():
    # A column slice (strides with gaps) as every call's argument: the static input keeps
    # the layout, so the step captures and replays the kernels eager runs on it (it was
    # refused at every call after the warmup, its static copy being dense).
    models, eager, step = _twin_linear_steps(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    for _ in range(7):
        x = torch.randn(3, 8)[:, ::2]
        assert torch.equal(eager(x), step(x))
    assert step.num_captures == 1
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


def test_an_unused_slice_of_a_flat_parameter_buffer_is_accepted():
    # Parameters viewing one flat buffer: a part of it no parameter uses is not what the
    # step updates.
    torch.manual_seed(0)
    flat = torch.zeros(40)
    w = torch.nn.Parameter(flat[:16].view(4, 4))
    w.data.copy_(torch.randn(4, 4))
    opt = torch.optim.SGD([w], lr=0.1)

    def body(x):
        (x @ w).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = dwgraph.graphed_step(body)
    for _ in range(6):
        step(torch.randn(3, 4))
    step(flat[20:32].view(3, 4))  # no ArgumentError
    assert step.num_captures == 1


def test_an_argument_with_tensor_hooks_is_refused():
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    xh = x.clone().requires_grad_()
    xh.register_hook(lambda t: t * 3)
    with pytest.raises(dwgraph.ArgumentError, match="tensor hooks"):
        g[2](xh, y)
    _check_models(e, g)


def test_inference_tensor_arguments_with_grad_disabled_match_eager():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)

    @dwgraph.graphed_step
    def evaluate(x):
        return model(x).square().mean()

    with torch.inference_mode():
        xs = [torch.randn(3, 4) for _ in range(6)]
    with torch.no_grad():
        for x in xs:
            assert torch.equal(evaluate(x), model(x).square().mean())
    assert evaluate.num_captures == 1


def test_a_hook_replaced_by_another_at_the_same_address_selects_another_graph():
    # Removing a hook and registering a new closure often reuses the freed function's
    # address: the variant tells them apart by handle id.
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)

    def make(scale):
        return lambda t: t * scale

    handles = [m[0].bias.register_hook(make(2.0)) for m in (e[0], g[0])]
    for scale in (3.0, 0.5, 4.0):
        _keep_matching(e, g, x, y, calls=2, check_each=True)
        for h in handles:
            h.remove()
        handles = [m[0].bias.register_hook(make(scale)) for m in (e[0], g[0])]
    _keep_matching(e, g, x, y, calls=2, check_each=True)



def test_a_capture_refused_inside_a_grad_scalers_step_leaves_no_scaler_state_on_the_optimizer():
    """scaler.step(opt) sets grad_scale/found_inf on a fused optimizer and removes them after
    its step; a capture refused inside it removes them too, so the next call does not take
    them for a scaled optimizer of the caller's (it is refused the same way)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)

    def body(x, y):
        loss = (model(x) - y).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    step = dwgraph.graphed_step(body)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(3):
        step(x, y)  # warmup: eager
    for _ in range(3):
        with pytest.raises(dwgraph.GraphStateError):
            step(x, y)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        assert step.num_captures == 0


def test_a_module_built_inside_the_step_and_kept_replays_without_capturing_again():
    """A criterion built inside the step at each call and kept on the model until the next
    (a pattern of training_step methods): the same class, so the same graph replays."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    twin = copy.deepcopy(model)
    holders = [types.SimpleNamespace(), types.SimpleNamespace()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin)]

    def body_of(m, opt, holder):
        def body(x, y):
            holder.crit = torch.nn.MSELoss()
            loss = holder.crit(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return body

    eager, graphed = body_of(model, opts[0], holders[0]), dwgraph.graphed_step(body_of(twin, opts[1], holders[1]))
    for _ in range(12):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        assert torch.equal(eager(x, y), graphed(x, y))
    _check_models((model,), (twin,))
    assert graphed.num_captures == 1


def test_an_optimizer_state_dict_after_graphed_steps_loads_with_weights_only():
    """The watching dicts are the optimizer's state, not its state_dict(): torch.load's
    weights_only unpickler (torch's default) refuses a dict subclass."""
    import io

    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    buf = io.BytesIO()
    torch.save(g[1].state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    e[1].load_state_dict(loaded)
    assert all(type(v) is dict for v in g[1].state_dict()["state"].values())
    _keep_matching(e, g, x, y)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_a_tensor_lr_of_a_fused_optimizer_under_a_scheduler_matches_eager(opt):
    """The scheduler's state is compared around the capture without printing its tensors
    (a tensor lr's base_lrs: printing reads its value, which a capture refuses)."""
    e, g = _make({"adam": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), fused=True),
                  "sgd": lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1), momentum=0.9, fused=True)}[opt])
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (e[1], g[1])]
    for _ in range(8):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        assert _same(e[2](x, y), g[2](x, y))
        _check_models(e, g)
        for s in scheds:
            s.step()


def _halve_grads(opt, args, kwargs):
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(0.5)


def _halve_params(opt, args, kwargs):
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                p.mul_(0.5)


@pytest.mark.parametrize("scope", ["optimizer", "global"])
@pytest.mark.parametrize("when", ["pre", "post"])
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.Adam(ps, lr=0.01)], ids=["sgd", "adam"])
def test_an_optimizer_step_hook_added_and_removed_after_capture_matches_eager(scope, when, make_opt):
    """An optimizer's step hooks run inside its step(): a capture runs them, so one added
    after the capture (a gradient clip as a pre-hook), or removed, selects another graph,
    captured with the hooks as they are (until 2026-12-05 the replays ran the hooks of the
    capture: a hook added later was silently not run)."""
    e, g = _make(make_opt)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    fn = _halve_grads if when == "pre" else _halve_params
    if scope == "optimizer":
        handles = [getattr(o, f"register_step_{when}_hook")(fn) for o in (e[1], g[1])]
    else:  # one global hook runs for both optimizers' steps
        handles = [getattr(torch_optimizer, f"register_optimizer_step_{when}_hook")(fn)]
    try:
        _keep_matching(e, g, x, y, check_each=True)
        captures = g[2].num_captures
        assert captures == 2
    finally:
        for h in handles:
            h.remove()
    _keep_matching(e, g, x, y, check_each=True)
    assert g[2].num_captures == captures  # the first graph serves again


def _ema_hook(ema, in_state):
    """A post-hook keeping an average of the parameters, its tensors made at its first run
    (in the optimizer's state, or in a dict of its own)."""
    def hook(opt, args, kwargs):
        with torch.no_grad():
            for p in opt.param_groups[0]["params"]:
                held = opt.state[p] if in_state else ema
                key = "ema" if in_state else p
                if key not in held:
                    held[key] = p.detach().clone()
                else:
                    held[key].mul_(0.9).add_(p, alpha=0.1)
                if in_state:
                    ema[p] = held[key]

    return hook


@pytest.mark.parametrize("in_state", [False, True], ids=["own_dict", "optimizer_state"])
@pytest.mark.parametrize("scope", ["optimizer", "global"])
def test_a_step_hook_making_its_tensors_at_first_run_added_after_capture_matches_eager(scope, in_state):
    """A hook's first run may make tensors (an EMA's copies): made inside a capture they would
    be the graph's, remade at every replay (a review found the EMA reset at each call). The
    call after the hooks changed runs eagerly; the next captures with them."""
    e, g = _make()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    _steady(e, g, x, y)
    emas = [{}, {}]
    if scope == "optimizer":
        handles = [o.register_step_post_hook(_ema_hook(ema, in_state)) for o, ema in zip((e[1], g[1]), emas)]
    else:
        hooks = {id(o): _ema_hook(ema, in_state) for o, ema in zip((e[1], g[1]), emas)}
        handles = [torch_optimizer.register_optimizer_step_post_hook(lambda o, a, k: hooks[id(o)](o, a, k))]
    try:
        for _ in range(5):
            assert _same(e[2](x, y), g[2](x, y))
            _check_models(e, g)
            assert len(emas[0]) == len(emas[1]) > 0
            for a, b in zip(emas[0].values(), emas[1].values()):
                assert torch.equal(a, b)
        assert g[2].num_captures == 2
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.Adam(ps, lr=0.01)], ids=["sgd", "adam"])
@pytest.mark.parametrize("from_start", [True, False])
def test_a_step_hook_stepping_another_optimizer_matches_eager_under_a_schedule(make_opt, from_start):
    """An optimizer's pre-hook that steps another optimizer: the inner step() ends before the
    outer one runs, which is still captured reading its values at replay (a review found the
    outer optimizer captured with its learning rate baked in once the inner step ended)."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))]
    models.append(copy.deepcopy(models[0]))
    sides = []
    for m in models:
        main, aux = make_opt(m[0].parameters()), torch.optim.SGD(m[2].parameters(), lr=0.1)
        sides.append((m, main, aux, torch.optim.lr_scheduler.ExponentialLR(main, 0.5)))

    def hook_of(aux):
        return lambda o, a, k: aux.step()

    def body_of(m, main, aux):
        def body(x, y):
            loss = (m(x) - y).square().mean()
            loss.backward()
            main.step()
            main.zero_grad(set_to_none=True)
            aux.zero_grad(set_to_none=True)
            return loss

        return body

    if from_start:
        for _, main, aux, _ in sides:
            main.register_step_pre_hook(hook_of(aux))
    eager, graphed = body_of(*sides[0][:3]), dwgraph.graphed_step(body_of(*sides[1][:3]))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for i in range(10):
        if i == 5 and not from_start:
            for _, main, aux, _ in sides:
                main.register_step_pre_hook(hook_of(aux))
        assert _same(eager(x, y), graphed(x, y))
        for m, _, _, sched in sides:
            sched.step()
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)
    assert graphed.num_captures == (1 if from_start else 2)


def _eager_and_graphed(models, opts):
    """The step of models[0] eagerly and of models[1] graphed, each stepping opts[i] as it is
    at the call (a test may replace an optimizer between calls)."""
    def body_of(i):
        def body(x, y):
            loss = (models[i](x) - y).square().mean()
            loss.backward()
            opts[i].step()
            models[i].zero_grad(set_to_none=True)
            return loss

        return body

    return body_of(0), dwgraph.graphed_step(body_of(1))


def _check_pair(models, opts):
    """The eager and graphed models equal, and their first layer's optimizer state."""
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)
    for p, q in zip(models[0][0].parameters(), models[1][0].parameters()):
        for key, v in opts[0].state[p].items():
            assert torch.equal(v, opts[1].state[q][key])


def test_a_new_optimizer_with_a_step_hook_runs_eagerly_before_its_capture():
    """A new phase's optimizer replacing the step's, born with a hook that makes its tensors at
    its first run: the call that meets it runs eagerly, the next captures (a review found the
    hook's first run inside the capture, its tensors remade at every replay)."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]

    eager, graphed = _eager_and_graphed(models, opts)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    emas = [{}, {}]
    for call in range(9):
        if call == 5:
            for i, m in enumerate(models):
                opts[i] = torch.optim.SGD(m.parameters(), lr=0.05)
                opts[i].register_step_post_hook(_ema_hook(emas[i], in_state=False))
        assert _same(eager(x, y), graphed(x, y))
        for p, q in zip(*(m.parameters() for m in models)):
            assert torch.equal(p, q)
        for a, b in zip(emas[0].values(), emas[1].values()):
            assert torch.equal(a, b)
    assert graphed.num_captures == 2


class _Skip(Exception):
    pass


def _stepping(other, catching):
    """A step pre-hook that steps `other` and ignores the exceptions of type `catching`."""
    def hook(opt, args, kwargs):
        try:
            other.step()
        except catching:
            pass

    return hook


@pytest.mark.parametrize("outer", ["sgd_momentum", "rmsprop"])
def test_a_nested_step_skipped_by_its_own_hook_leaves_the_outer_step_as_eagerly(outer):
    """The outer optimizer's pre-hook steps another, whose own pre-hook raises to skip it and
    is caught: the skipped step runs no post-hook. The outer step keeps its own route and
    state check (a review found the outer optimizer's state removed at every call, or its
    step refused, with the inner step's left in place)."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))]
    models.append(copy.deepcopy(models[0]))

    def make(m):
        a = (torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=0.9) if outer == "sgd_momentum"
             else torch.optim.RMSprop(m[0].parameters(), lr=0.01))
        b = torch.optim.SGD(m[1].parameters(), lr=0.1)

        def frozen(o, args, kwargs):
            raise _Skip()

        b.register_step_pre_hook(frozen)
        a.register_step_pre_hook(_stepping(b, catching=_Skip))
        return a

    opts = [make(m) for m in models]

    eager, graphed = _eager_and_graphed(models, opts)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(8):
        assert _same(eager(x, y), graphed(x, y))
        _check_pair(models, opts)
    assert graphed.num_captures == 1


@pytest.mark.parametrize("outer_momentum", [0.0, 0.9])
def test_a_refusal_inside_the_capture_caught_by_the_step_is_raised_again(outer_momentum):
    """A pre-hook stepping another optimizer and catching every exception around it: the
    refusal dwgraph raises inside the capture (here: that optimizer's hooks changed, so this
    call runs eagerly first) is raised again when the step's code returns, so the capture is
    abandoned as if it had not been caught (a review found the capture going on without the
    inner step, replayed from then on)."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))]
    models.append(copy.deepcopy(models[0]))
    inner = []

    def make(m):
        a = torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=outer_momentum)  # with state: kept as it was
        b = torch.optim.SGD(m[1].parameters(), lr=0.1)
        inner.append(b)

        a.register_step_pre_hook(_stepping(b, catching=Exception))  # the user's hook swallows everything
        return a

    opts = [make(m) for m in models]
    eager, graphed = _eager_and_graphed(models, opts)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for call in range(9):
        if call == 5:
            for b in inner:
                b.register_step_post_hook(lambda o, a, k: None)
        assert _same(eager(x, y), graphed(x, y))
        _check_pair(models, opts)
    assert graphed.num_captures == 2


def test_a_host_read_caught_inside_the_step_is_refused_at_every_call():
    """The step's own code catching the refusal of a host read (a logging .item() in a try):
    eager runs the read, so the capture went on along another path; refused, before the
    graph exists, at every call (until 2026-12-05 it captured and replayed without it)."""
    e, g = _make()
    logged = []

    def body(x, y):
        loss = (g[0](x) - y).square().mean()
        loss.backward()
        try:
            logged.append(loss.item())
        except dwgraph.GraphStateError:
            logged.append(None)
        g[1].step()
        g[1].zero_grad(set_to_none=True)
        return loss

    step = dwgraph.graphed_step(body)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for call in range(6):
        if call < 3:
            step(x, y)  # the warmup calls run eagerly: the read succeeds
        else:
            with pytest.raises(dwgraph.GraphStateError, match="aten::item was refused inside the captured region"):
                step(x, y)
    assert step.num_captures == 0


def test_a_host_read_caught_in_an_optimizer_hook_is_named_not_the_optimizer():
    """A pre-hook logging the gradient norm with .item() in a try: refused at every capture,
    naming the read the hook caught (not "SGD.step() cannot be captured", which pointed at
    fused=True and capturable=True)."""
    e, g = _make()
    norms = []

    def log_norm(opt, args, kwargs):
        try:
            norms.append(sum(p.grad.norm() for p in opt.param_groups[0]["params"]).item())
        except dwgraph.GraphStateError:
            norms.append(None)

    g[1].register_step_pre_hook(log_norm)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for call in range(5):
        if call < 3:
            g[2](x, y)
        else:
            with pytest.raises(dwgraph.GraphStateError, match="aten::item was refused inside the captured region") as r:
                g[2](x, y)
            assert "cannot be captured" not in str(r.value)


@pytest.mark.parametrize("wrapped_as", [RuntimeError, ValueError])
def test_a_refusal_the_step_wraps_in_its_own_error_is_handled_as_the_refusal(wrapped_as):
    """The step wraps its optimizer step's errors in its own (try: opt.step() except Exception
    as e: raise RuntimeError(...) from e): dwgraph's refusal inside the capture (the hooks
    changed: run this call eagerly) still decides, instead of the user's error being raised
    at every call from then on (a review found the step never recovering)."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]

    def body_of(i):
        def body(x):
            loss = models[i](x).square().mean()
            loss.backward()
            try:
                opts[i].step()
            except Exception as e:  # noqa: BLE001 - the user's own wrapping
                raise wrapped_as(f"optimizer step failed: {e}") from e
            opts[i].zero_grad(set_to_none=True)
            return loss

        return body

    eager, graphed = body_of(0), dwgraph.graphed_step(body_of(1))
    x = torch.randn(3, 4)
    for call in range(8):
        if call == 5:
            for o in opts:
                o.register_step_post_hook(lambda o, a, k: None)
        assert _same(eager(x), graphed(x))
        for p, q in zip(*(m.parameters() for m in models)):
            assert torch.equal(p, q)
    assert graphed.num_captures == 2
