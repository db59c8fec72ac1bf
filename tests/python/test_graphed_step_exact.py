"""``@dwgraph.graphed_step`` behaves like the eager step it replaces (issue 11): each case is
bitwise the undecorated function run eagerly on a deep copy, or a typed error.

  1. tensors inside non-pytree objects (SimpleNamespace, dataclasses, attributes) key the
     graph by what it depends on; arguments the key cannot describe are refused;
  2. returned tensors keep their values after later calls of any key (test_graphed_step.py);
  3. the RNG stream matches eager from the first call (dropout);
  4. code inside the step that reads or changes .grad (clipping, a norm log) sees what
     eager sees, with gradient accumulation across calls;
  5. tensors the step trains are found from what its backward reaches (a free tensor, an
     input that requires grad), not from module hooks;
  6. hooks see grad_added_to_main_grad set (test_core_contracts.py);
  7. a capture failing between backward() and backward_dw() rolls every unit back;
  8. nothing a step installs affects another thread, nor blocks make_graphed_callables there;
  plus autocast inside the step (exact) and around it with the cache on (refused), and the
  log lines of captures and evictions.

Cases the hostile reviews found (each silently wrong, untyped or a false refusal before its
fix), checked the same way, the parameters too:

  9. an optimizer inside the step (momentum, foreach, RMSprop's step counters, clipping and
     zero_grad inside, accumulation across calls) is exact, and its state, param groups,
     learning rates or instance changed between calls select another graph; an LR scheduler
     stepped or a hyperparameter changed inside the step is refused at capture;
 10. a tensor the step trains, or tensors sharing memory, as arguments are refused; the same
     tensor passed twice is exact;
 11. the graph follows what changes between calls: the pattern of existing gradients (the
     output structure may depend on it), the autocast dtype, train/eval switches, module
     hooks and buffers changed after capture; modules built elsewhere do not stop graphing;
 12. deferred units queued before the call (also of a module met only through its
     backward_dw()), or left queued by it, are refused before anything is written;
 13. any change of a generator outside the kernels (reseeding, fork_rng around draws,
     checkpoint's recomputed dropout, a user torch.Generator) is refused at capture, the
     generator untouched; fork_rng and checkpoint without draws are exact;
 14. host reads, optimizer state the capture would create, collectives and sparse gradients
     inside a capture are typed refusals; constants made from Python data, step-local
     leaves and a torch.compile'd model replay exactly;
 15. the wgrad hooks of dwgraph layers run as the step runs them eagerly (Note [Hook runs
     a capture saw]): once per use of a layer, per backward_dw() call, not for a head the
     loss does not use, a layer under no_grad, a detached or frozen branch, or in eval mode.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import types

import pytest
import torch
import torch.nn.functional as F

import dwgraph
from safety_common import assert_same_grads_and_params, assert_unchanged, snapshot_grads, two_deferred

H = 8
B = 4


def _net(dropout: float = 0.0):
    torch.manual_seed(31)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Dropout(dropout),
                               dwgraph.nn.Linear(H, H, delay_wgrad_compute=True))


def _grads_equal(a, b, what):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {n}.grad presence differs"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{what}: {n}.grad differs"


# step bodies of the review cases (sections 8-14), over safety_common.two_deferred ------------
def _land(model, loss):
    loss.backward()
    model[0].backward_dw()
    model[2].backward_dw()
    return loss


def _eager(model, x):
    return _land(model, model(x).square().mean())


def _check_step_against_eager(m, e, body, calls, warmup=1, zero=False, before=None):
    """Runs body(m, x) graphed and body(e, x) eagerly on the same inputs: bitwise equal."""
    step = dwgraph.graphed_step(lambda x: body(m, x), warmup_iters=warmup)
    for i in range(calls):
        if before is not None:
            before(i)
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(e, x)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")
        if zero:
            m.zero_grad(set_to_none=True)
            e.zero_grad(set_to_none=True)
    return step


# 1 -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    scale: float


@pytest.mark.parametrize("kind", ["namespace", "dataclass", "object"])
def test_tensors_inside_objects_key_and_feed_the_graph(kind):
    eager = _net()
    m = copy.deepcopy(eager)

    def body(model, batch):
        loss = F.mse_loss(model(batch.x) * batch.scale, batch.y)
        loss.backward()
        model[2].backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda batch: body(m, batch), warmup_iters=1)

    def make(x, y, scale):
        if kind == "namespace":
            return types.SimpleNamespace(x=x, y=y, scale=scale)
        if kind == "dataclass":
            return Batch(x, y, scale)
        obj = type("Obj", (), {})()
        obj.x, obj.y, obj.scale = x, y, scale
        return obj

    losses = []
    for s in range(6):
        big = 5000  # larger than anything repr() would print in full
        x, y = torch.randn(big, H), torch.randn(big, H)
        scale = 1.0 if s < 4 else 2.0  # a non-tensor value selects another graph
        lg, le = step(make(x, y, scale)), body(eager, make(x, y, scale))
        assert torch.equal(lg, le), f"call {s}"
        _grads_equal(eager, m, f"call {s}")
        losses.append(lg)
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
    assert len({l.item() for l in losses}) == len(losses), "different batches gave the same loss"
    assert step.num_captures == 2


def test_arguments_the_key_cannot_describe_are_refused():
    step = dwgraph.graphed_step(lambda a, b: a.sum(), warmup_iters=0, params=[])

    class Opaque:
        __slots__ = ("t",)

        def __init__(self):
            self.t = torch.randn(2)

    with pytest.raises(dwgraph.ArgumentError, match=r"argument args\[1\] is a .*Opaque.*cannot describe"):
        step(torch.randn(2), Opaque())


# 3 -------------------------------------------------------------------------------------------
def test_rng_stream_matches_eager_from_the_first_call():
    eager = _net(dropout=0.5)
    m = copy.deepcopy(eager)

    def body(model, x):
        loss = model(x).square().mean()
        loss.backward()
        model[2].backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, x), warmup_iters=2)
    xs = [torch.randn(B, H) for _ in range(6)]
    torch.manual_seed(123)
    graphed = [step(x) for x in xs]
    g_grads = [p.grad.clone() for p in m.parameters()]
    torch.manual_seed(123)
    eager_losses = [body(eager, x) for x in xs]
    for s, (a, b) in enumerate(zip(graphed, eager_losses)):
        assert torch.equal(a, b), f"call {s}: the dropout masks differ from eager"
    assert all(torch.equal(a, p.grad) for a, p in zip(g_grads, eager.parameters()))


# 4 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accumulate", [1, 3], ids=["no_accumulation", "accumulate3"])
def test_code_reading_grad_inside_the_step_sees_what_eager_sees(accumulate):
    eager = _net()
    m = copy.deepcopy(eager)
    norms = {"eager": [], "graphed": []}

    def body(model, x, tag):
        loss = model(x).square().mean()
        loss.backward()
        model[2].backward_dw()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        norms[tag].append(total)  # a gradient-norm log (a tensor: the graph recomputes it)
        return loss, total

    step = dwgraph.graphed_step(lambda x: body(m, x, "graphed"), warmup_iters=1)
    for s in range(8):
        x = torch.randn(B, H)
        (lg, ng), (le, ne) = step(x), body(eager, x, "eager")
        assert torch.equal(lg, le) and torch.equal(ng, ne), f"call {s}: loss or clipped norm differs"
        _grads_equal(eager, m, f"call {s}")
        if (s + 1) % accumulate == 0:  # the optimizer outside the step, then zero_grad
            with torch.no_grad():
                for p, q in zip(m.parameters(), eager.parameters()):
                    p.sub_(0.1 * p.grad), q.sub_(0.1 * q.grad)
            m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)


# 5 -------------------------------------------------------------------------------------------
def test_tensors_the_step_trains_are_found_from_its_backward():
    torch.manual_seed(2)
    free = torch.randn(H, requires_grad=True)  # no module owns it, no params= given
    free_e = free.detach().clone().requires_grad_()
    lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    lin_e = copy.deepcopy(lin)

    def body(module, scale, x):
        loss = (module(x) * scale).square().mean()
        loss.backward()
        module.backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x: body(lin, free, x), warmup_iters=1)
    for s in range(4):
        x = torch.randn(B, H, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        assert torch.equal(step(x), body(lin_e, free_e, xe))
        assert torch.equal(free.grad, free_e.grad), f"call {s}: the free tensor's gradient differs"
        assert torch.equal(x.grad, xe.grad), f"call {s}: the input's gradient differs"
        assert torch.equal(lin.weight.grad, lin_e.weight.grad)
        for t in (free, free_e):
            t.grad = None
        lin.zero_grad(set_to_none=True), lin_e.zero_grad(set_to_none=True)


def test_input_with_history_is_refused():
    w = torch.randn(H, requires_grad=True)
    step = dwgraph.graphed_step(lambda x: x.sum(), warmup_iters=0, params=[])
    with pytest.raises(dwgraph.ArgumentError, match="has autograd history"):
        step(torch.randn(B, H) * w)


# 7 -------------------------------------------------------------------------------------------
def test_capture_failing_between_backward_and_backward_dw_rolls_back():
    eager = _net()
    m = copy.deepcopy(eager)

    def body(model, x, fail):
        loss = model(x).square().mean()
        loss.backward()
        if fail:
            loss.item()  # refused inside a capture, after the unit was queued
        model[2].backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, x, True), warmup_iters=1)
    x = torch.randn(B, H)
    step(x)  # warmup: eager, .item() is fine
    body(eager, x, False)
    with pytest.raises(dwgraph.GraphStateError, match=r"aten::(item|_local_scalar_dense)|Tensor\.item\(\)"):
        step(x)
    assert m[2].num_queued_wgrad_units() == 0, "the failed capture left its unit queued"
    _grads_equal(eager, m, "after the failed capture")
    for s in range(3):  # eager training is not one microbatch behind
        x = torch.randn(B, H)
        body(m, x, False), body(eager, x, False)
        _grads_equal(eager, m, f"eager call {s} after the failed capture")


# 8 -------------------------------------------------------------------------------------------
def test_nothing_a_step_installs_affects_another_thread():
    m = _net()
    other = torch.nn.Linear(H, H)
    other_e = copy.deepcopy(other)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(other_e.parameters(), lr=0.1)
    errors = []

    # Its own generator: draws from the shared default one inside the step would change
    # what the step leaves behind in it, which a replay cannot (refused at capture).
    gen = torch.Generator().manual_seed(0)

    def train_other():
        try:
            for _ in range(3):
                x = torch.randn(B, H, generator=gen)
                for mod, o in ((other, opt), (other_e, opt_e)):
                    mod(x).sum().backward()
                    o.step()
                    o.zero_grad()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def body(x):
        # Another thread trains its own model while this step runs (warmup and capture).
        t = threading.Thread(target=train_other)
        t.start()
        t.join()
        loss = m(x).square().mean()
        loss.backward()
        m[2].backward_dw()
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1)
    torch.manual_seed(0)
    for _ in range(3):
        step(torch.randn(B, H))
    assert not errors, f"the other thread failed: {errors[0]!r}"
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), other_e.parameters()))


def test_graphed_step_on_another_thread_does_not_block_make_graphed_callables():
    import threading

    inside, release = threading.Event(), threading.Event()
    m = two_deferred()

    def body(x):
        inside.set()
        release.wait(10)
        return _eager(m, x)

    step = dwgraph.graphed_step(body, warmup_iters=1)
    t = threading.Thread(target=lambda: step(torch.randn(B, H)))
    t.start()
    try:
        assert inside.wait(10)
        g = dwgraph.make_graphed_callables(two_deferred(), (torch.randn(B, H, requires_grad=True),))
        g(torch.randn(B, H)).sum().backward()
        g.backward_dw()
    finally:
        release.set()
        t.join()


# autocast and logs ------------------------------------------------------------------------------
def test_autocast_inside_the_step_is_exact_and_around_it_refused_with_the_cache():
    eager = _net()
    m = copy.deepcopy(eager)

    def body(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model[0](x)
        loss = model[2](out.float()).square().mean()
        loss.backward()
        model[2].backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, x), warmup_iters=1)
    for s in range(4):
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(eager, x)), f"call {s}"
        _grads_equal(eager, m, f"call {s}")
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(dwgraph.ArgumentError, match="autocast.*cache_enabled=False"):
            step(torch.randn(B, H))
    plain = dwgraph.graphed_step(lambda x: m[0](x).square().mean(), warmup_iters=1)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        for _ in range(3):
            x = torch.randn(B, H)
            assert torch.equal(plain(x), eager[0](x).square().mean())


def test_captures_and_evictions_are_logged(caplog):
    m = _net()

    def body(x):
        loss = m(x).square().mean()
        loss.backward()
        m[2].backward_dw()
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1, max_graphs=1)
    with caplog.at_level(logging.INFO, logger="dwgraph"):
        for rows in (4, 4, 5, 5):
            step(torch.randn(rows, H))
    captures = [r for r in caplog.records if "captured graph #" in r.getMessage()]
    evictions = [r for r in caplog.records if "released graph #" in r.getMessage()]
    assert len(captures) == 2 and len(evictions) == 1
    assert "kernels" in captures[0].getMessage() and "pool" in captures[0].getMessage()


def test_in_place_writes_to_arguments_reach_the_caller():
    w = torch.nn.Parameter(torch.randn(H))
    w_e = w.detach().clone().requires_grad_()

    def body(weight, x, counter):
        x.mul_(2)            # eager changes the caller's tensor
        counter.add_(1)
        loss = (weight * x).sum()
        loss.backward()
        return loss

    step = dwgraph.graphed_step(lambda x, c: body(w, x, c), warmup_iters=1)
    cg, ce = torch.zeros(()), torch.zeros(())
    for s in range(4):
        x = torch.randn(B, H)
        xg, xe = x.clone(), x.clone()
        assert torch.equal(step(xg, cg), body(w_e, xe, ce))
        assert torch.equal(xg, xe) and torch.equal(cg, ce), f"call {s}: an argument's in-place update was lost"
        assert torch.equal(w.grad, w_e.grad)


# 9 an optimizer inside the step: exact, and following its changes between calls ------------------
@pytest.mark.parametrize("keep", [False, True], ids=["plain", "step_keeps_grads"])
def test_step_accumulating_with_optimizer_and_zero_grad_inside(keep):
    # Accumulate three calls, then clip, step and zero_grad(set_to_none=True) inside the
    # step: the graph must read the caller's .grad although the step clears it.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(H, H), dwgraph.nn.Linear(H, 4, delay_wgrad_compute=True))
    e = copy.deepcopy(m)
    om, oe = (torch.optim.SGD(x.parameters(), lr=0.1, momentum=0.9) for x in (m, e))
    kept = []

    def body(model, opt, x, do_step):
        loss = model(x).square().mean()
        loss.backward()
        model[1].backward_dw()
        if do_step:
            if keep:
                kept.append([p.grad for p in model.parameters()])
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    step = dwgraph.graphed_step(lambda x, s: body(m, om, x, s), warmup_iters=1)
    for i in range(12):
        x = torch.randn(B, H)
        do = i % 3 == 2
        assert torch.equal(step(x, do), body(e, oe, x, do)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")


def test_step_with_a_stateless_optimizer_needs_no_warmup():
    # SGD without momentum never makes state: nothing to create inside the capture.
    torch.manual_seed(0)
    m = torch.nn.Linear(H, H)
    e = copy.deepcopy(m)
    om, oe = (torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, e))

    def body(model, opt, x):
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, om, x), warmup_iters=0, params=m)
    for i in range(3):
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(e, oe, x)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")


@pytest.mark.parametrize("change", ["load_state_dict", "state_clear", "add_param_group"])
def test_step_follows_optimizer_state_replaced_or_grown_after_capture(change):
    # The captured optimizer step reads the state tensors it found; reloaded, cleared or
    # new state (and new param groups) select another graph, warmed up eagerly first.
    m, e = two_deferred(), two_deferred()
    first = (lambda x: x[0].parameters()) if change == "add_param_group" else (lambda x: x.parameters())
    om, oe = (torch.optim.SGD(first(x), lr=0.1, momentum=0.9) for x in (m, e))

    def body(model, opt, x):
        loss = _eager(model, x)
        opt.step()
        opt.zero_grad()
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, om, x), warmup_iters=2)
    for i in range(10):
        if i == 1:
            ckpt = [copy.deepcopy(o.state_dict()) for o in (om, oe)]
        if i == 5:
            for o, c in zip((om, oe), ckpt):
                if change == "load_state_dict":
                    held = o.state_dict()  # noqa: F841 (someone still holds the live state)
                    o.load_state_dict(c)
                elif change == "state_clear":
                    o.state.clear()
            if change == "add_param_group":
                om.add_param_group({"params": list(m[2].parameters()), "lr": 0.05})
                oe.add_param_group({"params": list(e[2].parameters()), "lr": 0.05})
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(e, oe, x)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")
    assert step.num_captures >= 2


@pytest.mark.parametrize("change", ["state_clear_each_call", "swap_param_groups", "lr_every_call"])
def test_step_follows_optimizer_changes_every_call(change):
    m, e = two_deferred(), two_deferred()
    groups = lambda x: [{"params": list(x[0].parameters()), "lr": 0.1},  # noqa: E731
                        {"params": list(x[2].parameters()), "lr": 0.01}]
    om, oe = (torch.optim.SGD(groups(x), lr=0.1, momentum=0.0 if change == "swap_param_groups" else 0.9)
              for x in (m, e))

    def body(model, opt, x):
        loss = _eager(model, x)
        opt.step()
        opt.zero_grad()
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, om, x), warmup_iters=1, max_graphs=2)
    for i in range(8):
        for o in (om, oe):
            if change == "state_clear_each_call":
                o.state.clear()
            elif change == "swap_param_groups" and i == 4:
                o.param_groups[0]["params"], o.param_groups[1]["params"] = (o.param_groups[1]["params"],
                                                                          o.param_groups[0]["params"])
            elif change == "lr_every_call":
                o.param_groups[0]["lr"] = 0.1 / (i + 1)
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(e, oe, x)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")
    assert len(step._out_specs) <= 2 * 2 + 1, "bookkeeping of released graphs is kept"


def test_step_follows_a_replaced_optimizer_instance():
    m, e = two_deferred(), two_deferred()
    opts = {k: torch.optim.SGD(x.parameters(), lr=0.1, momentum=0.9) for k, x in (("m", m), ("e", e))}

    def body(model, opt, x):
        loss = _eager(model, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, opts["m"], x), warmup_iters=2)
    for i in range(8):
        if i == 5:  # a new phase: a new optimizer, the old one dropped
            opts = {k: torch.optim.SGD(x.parameters(), lr=0.01, momentum=0.9) for k, x in (("m", m), ("e", e))}
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(e, opts["e"], x)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")


@pytest.mark.parametrize("foreach", [False, True])
def test_step_counters_of_foreach_optimizers_replay_exactly(foreach):
    m, e = two_deferred(), two_deferred()
    om, oe = (torch.optim.RMSprop(x.parameters(), lr=0.01, foreach=foreach) for x in (m, e))

    def body(model, opt, x):
        loss = _eager(model, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, om, x), warmup_iters=1)
    for i in range(5):
        x = torch.randn(B, H)
        assert torch.equal(step(x), body(e, oe, x)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")
    for p, q in zip(m.parameters(), e.parameters()):
        assert float(om.state[p]["step"]) == float(oe.state[q]["step"]) == 5


@pytest.mark.parametrize("foreach", [False, True])
def test_step_with_a_foreach_optimizer_hands_back_gradients(foreach):
    # torch._foreach_add_(params, ...) returns its list: not tensors the step made.
    m, e = two_deferred(), two_deferred()
    om, oe = (torch.optim.SGD(x.parameters(), lr=0.1, momentum=0.9, foreach=foreach) for x in (m, e))

    def body(model, x):
        loss = _eager(model, x)
        (om if model is m else oe).step()
        return loss

    def zero(i):
        for x in (m, e):
            x.zero_grad(set_to_none=i % 2 == 0)

    _check_step_against_eager(m, e, body, 6, before=zero)


def test_step_refuses_an_lr_scheduler_stepped_inside_it_and_restores_it():
    m = two_deferred()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    def body(x):
        loss = _eager(m, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1)
    step(torch.randn(B, H))
    before = repr(sched.state_dict()), opt.param_groups[0]["lr"]
    with pytest.raises(dwgraph.GraphStateError, match="LR scheduler"):
        step(torch.randn(B, H))
    assert (repr(sched.state_dict()), opt.param_groups[0]["lr"]) == before


def test_step_that_changes_its_own_learning_rate_is_refused_at_capture():
    m = two_deferred()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def body(x):
        loss = _eager(m, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.param_groups[0]["lr"] *= 0.9  # a hand-written schedule inside the step
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1)
    step(torch.randn(B, H))
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(dwgraph.GraphStateError, match="changes the hyperparameters"):
        step(torch.randn(B, H))
    assert opt.param_groups[0]["lr"] == lr


# 10 arguments: trained or overlapping tensors refused, the same tensor twice exact ---------------
def test_step_refuses_parameters_and_overlapping_tensors_as_arguments():
    lin = torch.nn.Linear(H, H)
    step = dwgraph.graphed_step(lambda x, w: (lin(x).sum() + (w * w).sum()), warmup_iters=0, params=lin)
    with pytest.raises(dwgraph.ArgumentError, match="tensor the step trains"):
        step(torch.randn(B, H), lin.weight)
    both = dwgraph.graphed_step(lambda a, b: (a * b).sum(), warmup_iters=0, params=[])
    x = torch.randn(B, H)
    with pytest.raises(dwgraph.ArgumentError, match="share memory"):
        both(x, x[1:])


def test_step_with_the_same_tensor_twice_matches_eager():
    torch.manual_seed(0)
    lin = torch.nn.Linear(H, H)
    lin_e = copy.deepcopy(lin)

    def body(model, a, b):
        a.mul_(2)
        loss = model(b).sum()
        loss.backward()
        return loss

    step = dwgraph.graphed_step(lambda a, b: body(lin, a, b), warmup_iters=1)
    for i in range(4):
        x = torch.randn(B, H)
        xg, xe = x.clone(), x.clone()
        assert torch.equal(step(xg, xg), body(lin_e, xe, xe)), f"call {i}"
        assert torch.equal(xg, xe)
        assert_same_grads_and_params(lin, lin_e, f"call {i}")
        lin.zero_grad(), lin_e.zero_grad()


# 11 what selects a graph between calls: gradients, autocast, modes, hooks, buffers, modules ------
def test_step_output_structure_per_gradient_pattern():
    torch.manual_seed(0)
    lin = torch.nn.Linear(H, H)
    lin_e = copy.deepcopy(lin)

    def body(model, x):
        accumulating = model.weight.grad is not None
        loss = model(x).square().mean()
        loss.backward()
        return (loss, model.weight.grad.norm()) if accumulating else loss

    step = dwgraph.graphed_step(lambda x: body(lin, x), warmup_iters=1)
    for i in range(8):
        x = torch.randn(B, H)
        out, ref = step(x), body(lin_e, x)
        assert type(out) is type(ref), f"call {i}: {type(out).__name__} vs {type(ref).__name__}"
        assert all(torch.equal(a, b) for a, b in zip(out if isinstance(out, tuple) else (out,),
                                                     ref if isinstance(ref, tuple) else (ref,)))
        if i % 2 == 1:
            lin.zero_grad(set_to_none=True), lin_e.zero_grad(set_to_none=True)


def test_step_autocast_dtype_selects_its_graph():
    torch.manual_seed(0)
    lin = torch.nn.Linear(H, H)
    lin_e = copy.deepcopy(lin)

    def body(model, x):
        loss = model(x).float().square().sum()
        loss.backward()
        return loss

    step = dwgraph.graphed_step(lambda x: body(lin, x), warmup_iters=1)
    for i, dtype in enumerate([torch.bfloat16] * 3 + [torch.float16] * 3):
        x = torch.randn(B, H)
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            assert torch.equal(step(x), body(lin_e, x)), f"call {i} ({dtype})"
        assert_same_grads_and_params(lin, lin_e, f"call {i}")
        lin.zero_grad(), lin_e.zero_grad()


def test_the_default_autocast_dtype_selects_its_graph_while_autocast_is_off():
    # torch.autocast("cpu") without a dtype takes torch.get_autocast_dtype("cpu"): a step
    # that enters it inside bakes in the default, which a caller may set between calls
    # while autocast itself is off.
    torch.manual_seed(0)
    lin = torch.nn.Linear(H, H)
    lin_e = copy.deepcopy(lin)

    def body(model, x):
        with torch.autocast("cpu", cache_enabled=False):
            loss = model(x).float().square().sum()
        loss.backward()
        return loss

    step = dwgraph.graphed_step(lambda x: body(lin, x), warmup_iters=1)
    default = torch.get_autocast_dtype("cpu")
    try:
        for i, dtype in enumerate([torch.bfloat16] * 3 + [torch.float16] * 3 + [torch.bfloat16] * 2):
            torch.set_autocast_dtype("cpu", dtype)
            x = torch.randn(B, H)
            assert torch.equal(step(x), body(lin_e, x)), f"call {i} ({dtype})"
            assert_same_grads_and_params(lin, lin_e, f"call {i}")
            lin.zero_grad(), lin_e.zero_grad()
    finally:
        torch.set_autocast_dtype("cpu", default)
    assert step.num_graphs == 2


def test_step_follows_train_eval_switches():
    torch.manual_seed(0)
    m = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.BatchNorm1d(H),
                            torch.nn.Dropout(0.5))
    e = copy.deepcopy(m)

    def body(model, x):
        loss = model(x).square().mean()
        loss.backward()
        model[0].backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, x), warmup_iters=1)
    for i in range(8):
        if i == 3:
            m.eval(), e.eval()
        if i == 5:
            m[1].train(), e[1].train()  # only BatchNorm back to training
        x = torch.randn(B, H)
        torch.manual_seed(100 + i)
        lg = step(x)
        torch.manual_seed(100 + i)
        assert torch.equal(lg, body(e, x)), f"call {i}"
        assert_same_grads_and_params(m, e, f"call {i}")
        assert all(torch.equal(a, b) for a, b in zip(m.buffers(), e.buffers())), f"call {i}: buffers"


def test_step_follows_module_hooks_added_after_capture():
    m, e = two_deferred(), two_deferred()

    def body(model, x):
        return _eager(model, x)

    def add_hook(i):
        if i == 3:
            for mod in (m, e):
                mod[1].register_forward_hook(lambda mod_, inp, out: out * 2)

    step = _check_step_against_eager(m, e, body, 6, zero=True, before=add_hook)
    assert step.num_captures == 2


def test_step_follows_a_replaced_buffer():
    def mk():
        torch.manual_seed(0)
        return torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.BatchNorm1d(H),
                                   dwgraph.nn.Linear(H, 4, delay_wgrad_compute=True))

    m, e = mk(), mk()
    held = []

    def replace(i):
        if i == 4:
            for x in (m, e):
                held.append(x.state_dict())  # the old buffers stay referenced
                x[1].running_mean = torch.zeros(H)

    _check_step_against_eager(m, e, _eager, 7, zero=True, before=replace)
    assert torch.equal(m[1].running_mean, e[1].running_mean)


def test_modules_built_elsewhere_do_not_stop_a_step_from_graphing():
    m, e = two_deferred(), two_deferred()

    def body(model, x):
        loss_fn = torch.nn.MSELoss()  # a module built inside the step, every call
        return _land(model, loss_fn(model(x), torch.zeros(B, 4)))

    step = _check_step_against_eager(m, e, body, 5, zero=True,
                                     before=lambda i: torch.nn.Linear(2, 2))  # and one built elsewhere
    assert step.num_captures == 1
    m[2].weight = torch.nn.Parameter(m[2].weight.detach().clone())  # a trained parameter replaced
    e[2].weight = torch.nn.Parameter(e[2].weight.detach().clone())
    x = torch.randn(B, H)
    assert torch.equal(step(x), body(e, x))
    assert_same_grads_and_params(m, e, "after the replacement")


# 12 deferred units queued before the call, or left queued by it: refused -------------------------
def test_step_refuses_units_queued_before_the_call_at_capture_and_replay():
    # Eagerly the step's backward_dw() lands the oldest queued unit (the caller's); a graph
    # would land its own. Refused before anything is written, at capture and at replay.
    m = two_deferred()

    def body(x):
        loss = m(x).square().mean()
        loss.backward()
        m[0].backward_dw()
        m[2].backward_dw()
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1)
    m(torch.randn(B, H)).sum().backward()  # a unit queued before the loop (W one step behind)
    step(torch.randn(B, H))  # the warmup call runs eagerly: FIFO, as eager
    assert m[0].num_queued_wgrad_units() == 1
    before = snapshot_grads(m)
    with pytest.raises(dwgraph.GraphStateError, match=r"queued from before this call, which it would capture"):
        step(torch.randn(B, H))
    assert m[0].num_queued_wgrad_units() == 1 and m[2].num_queued_wgrad_units() == 1, "the refusal lost a unit"
    assert_unchanged(m, before, "the refused capture")
    m[0].backward_dw()
    m[2].backward_dw()
    m.zero_grad(set_to_none=True)
    e = copy.deepcopy(m)
    x = torch.randn(B, H)
    assert torch.equal(step(x), _eager(e, x))
    assert_same_grads_and_params(m, e, "capture after the queue was drained")
    m(torch.randn(B, H)).sum().backward()
    m.zero_grad(set_to_none=True)  # the gradient pattern the graph was captured with
    before = snapshot_grads(m)
    with pytest.raises(dwgraph.GraphStateError, match=r"queued from before this call, which it would replay"):
        step(torch.randn(B, H))
    assert m[0].num_queued_wgrad_units() == 1
    assert_unchanged(m, before, "the refused replay")


def test_step_leaving_units_queued_is_refused_at_capture():
    m = two_deferred()

    def body(x):
        loss = m(x).square().mean()
        loss.backward()  # backward_dw() left to the caller
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1)
    step(torch.randn(B, H))
    m[0].backward_dw()
    m[2].backward_dw()
    before = snapshot_grads(m)
    with pytest.raises(dwgraph.GraphStateError, match=r"the step leaves 1 deferred weight-gradient unit queued"):
        step(torch.randn(B, H))
    assert m[0].num_queued_wgrad_units() == 0 and m[2].num_queued_wgrad_units() == 0
    assert_unchanged(m, before, "the refused capture")


def test_step_module_met_only_through_backward_dw_is_guarded():
    # A's forward runs outside the step, its backward_dw() inside: A is one of the step's
    # modules, so the unit queued before the call is refused (eager would land it).
    torch.manual_seed(0)
    a, o = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.Linear(H, H)

    def body(x):
        a.backward_dw()
        loss = o(x).square().mean()
        loss.backward()
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1)
    a(torch.randn(B, H)).sum().backward()
    step(torch.randn(B, H))  # eager warmup: lands the unit
    a(torch.randn(B, H)).sum().backward()
    before = snapshot_grads(a)
    with pytest.raises(dwgraph.GraphStateError, match="queued from before this call"):
        step(torch.randn(B, H))
    assert a.num_queued_wgrad_units() == 1, "the refused capture consumed the caller's unit"
    assert_unchanged(a, before, "the refused capture")


# 13 the random number generator changed outside the kernels: refused at capture ------------------
@pytest.mark.parametrize("how", ["manual_seed", "checkpoint_dropout"])
def test_step_that_reseeds_then_draws_is_refused_at_capture(how):
    from torch.utils.checkpoint import checkpoint

    m = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.Dropout(0.5),
                            dwgraph.nn.Linear(H, 4, delay_wgrad_compute=True))

    def body(x):
        if how == "manual_seed":
            torch.manual_seed(1)
            y = m(x)
        else:
            y = checkpoint(m, x.requires_grad_(), use_reentrant=False)
        return _land(m, y.square().mean())

    step = dwgraph.graphed_step(body, warmup_iters=1)
    step(torch.randn(B, H))
    with pytest.raises(dwgraph.GraphStateError, match="random number generator changed"):
        step(torch.randn(B, H))


@pytest.mark.parametrize("how", ["generator_method", "fork_rng_around_draws", "seed_at_the_end", "alias"])
def test_any_change_of_the_generator_outside_the_kernels_is_refused(how):
    # The host capture follows the default generator itself, however Python changed it.
    from torch import set_rng_state as alias_set_rng_state

    m = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.Dropout(0.5),
                            dwgraph.nn.Linear(H, 4, delay_wgrad_compute=True))

    def body(x):
        if how == "generator_method":
            torch.default_generator.manual_seed(1)
        if how == "alias":
            alias_set_rng_state(torch.get_rng_state())  # restores what it is: no change
            state = torch.get_rng_state()
            y = m(x)
            alias_set_rng_state(state)  # undoes the dropout's draw
        elif how == "fork_rng_around_draws":
            with torch.random.fork_rng():
                y = m(x)
        else:
            y = m(x)
        loss = _land(m, y.square().mean())
        if how == "seed_at_the_end":
            torch.manual_seed(7)
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1)
    step(torch.randn(B, H))
    x = torch.randn(B, H)
    state = torch.get_rng_state()
    with pytest.raises(dwgraph.GraphStateError, match="random number generator changed"):
        step(x)
    assert torch.equal(torch.get_rng_state(), state), "the refused capture moved the generator"


@pytest.mark.parametrize("fresh", [True, False], ids=["made_in_the_step", "kept_across_calls"])
def test_step_drawing_from_a_user_generator_is_refused_at_capture(fresh):
    m = two_deferred()
    kept = torch.Generator().manual_seed(0)

    def body(x):
        g = torch.Generator().manual_seed(0) if fresh else kept
        return _eager(m, x + torch.randn(x.shape, generator=g))

    step = dwgraph.graphed_step(body, warmup_iters=1)
    step(torch.randn(B, H))
    state = kept.get_state()
    with pytest.raises(dwgraph.GraphStateError, match="torch.Generator other than the default"):
        step(torch.randn(B, H))
    assert torch.equal(kept.get_state(), state), "the refused capture advanced the caller's generator"


def test_checkpoint_without_randomness_is_graphed_exactly():
    from torch.utils.checkpoint import checkpoint

    def body(model, x):
        return _land(model, checkpoint(model, x.requires_grad_(), use_reentrant=False).square().mean())

    _check_step_against_eager(two_deferred(), two_deferred(), body, 4, zero=True)


def test_fork_rng_around_code_without_draws_is_graphed_exactly():
    def body(model, x):
        with torch.random.fork_rng():
            y = model(x)
        return _land(model, y.square().mean())

    _check_step_against_eager(two_deferred(), two_deferred(), body, 4, zero=True)


# 14 inside a capture: host reads, collectives, sparse gradients refused; the rest exact ----------
def test_step_refuses_host_reads_and_lazy_optimizer_state_in_a_capture():
    m = torch.nn.Linear(H, H)
    for read in (lambda t: t.tolist(), lambda t: t.numpy(), lambda t: bool(t.sum() > 0)):
        step = dwgraph.graphed_step(lambda x, read=read: (read(x), m(x).sum())[1], warmup_iters=0, params=m)
        with pytest.raises(dwgraph.GraphStateError, match="reads a tensor's value on the host"):
            step(torch.randn(B, H))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def body(x):
        loss = m(x).sum()
        loss.backward()
        opt.step()
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=0, params=m)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(dwgraph.GraphStateError, match=r"would create its state .*warmup_iters >= 1"):
        step(torch.randn(B, H))
    assert not opt.state, "the refused capture left optimizer state behind"
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters())), "the refused capture changed parameters"
    assert all(p.grad is None for p in m.parameters())


def test_collectives_inside_a_capture_are_refused(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        m = two_deferred()

        def body(x):
            loss = _eager(m, x)
            for p in m.parameters():
                dist.all_reduce(p.grad)
            return loss

        step = dwgraph.graphed_step(body, warmup_iters=1)
        step(torch.randn(B, H))
        with pytest.raises(dwgraph.GraphStateError, match="collective"):
            step(torch.randn(B, H))
    finally:
        dist.destroy_process_group()


def test_sparse_gradients_are_a_typed_refusal():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    step = dwgraph.graphed_step(lambda i: emb(i).sum().backward(), warmup_iters=1)
    step(torch.tensor([1, 2]))
    with pytest.raises(dwgraph.GraphStateError, match="strided"):
        step(torch.tensor([1, 2]))


def test_constants_made_from_python_data_inside_a_capture_replay_exactly():
    # torch.tensor(...) data is written outside the dispatcher; its first reader is
    # aten::lift_fresh, which is not replayed: the constant's bytes are restored anyway.
    def body(model, x):
        return _land(model, model(x).square().mean() * torch.tensor(2.0) + torch.as_tensor([0.5]).sum())

    _check_step_against_eager(two_deferred(), two_deferred(), body, 4, zero=True)


def test_step_local_leaves_do_not_make_the_capture_retry_forever():
    def body(model, x):
        delta = torch.zeros_like(x, requires_grad=True)  # an adversarial perturbation, FGSM-style
        model(x + delta).square().sum().backward(inputs=[delta])
        x_adv = (x + 0.1 * delta.grad.sign()).detach()
        for mod in (model[0], model[2]):
            mod.discard_wgrad_units()
        return _eager(model, x_adv)

    _check_step_against_eager(two_deferred(), two_deferred(), body, 3)


def test_step_around_a_compiled_model_matches_eager():
    m, e = two_deferred(), two_deferred()
    cm, ce = (torch.compile(x, backend="aot_eager") for x in (m, e))

    def body(model, x):
        compiled = cm if model is m else ce
        return _land(model, compiled(x).square().mean())

    _check_step_against_eager(m, e, body, 4, zero=True)


class _HookedLayers(torch.nn.Module):
    def __init__(self, delay):
        super().__init__()
        self.a, self.b, self.c = (dwgraph.nn.Linear(H, H, delay_wgrad_compute=delay) for _ in range(3))

    def forward(self, x, case):
        if case == "unused_head":
            return self.a(x), self.b(x)
        if case == "used_twice":
            return self.a(torch.tanh(self.a(x))), None
        if case == "layer_under_no_grad":
            with torch.no_grad():
                h = self.b(x)
            return self.a(x + h), None
        if case == "detached_branch":
            return self.a(self.b(x).detach()), None
        return self.a(x), self.b(x)


@pytest.mark.parametrize("eval_mode", [False, True], ids=["train", "eval"])
@pytest.mark.parametrize("case", ["unused_head", "used_twice", "layer_under_no_grad", "detached_branch", "dw_twice"])
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "deferred"])
def test_wgrad_hooks_run_as_the_step_runs_them_eagerly(delay, case, eval_mode):
    # The graph ran every module's hooks once per call, whatever the step did (a review found
    # it): now as often and in the order its capture met them.
    torch.manual_seed(0)
    eager = _HookedLayers(delay)
    graphed = copy.deepcopy(eager)
    logs = {"e": [], "g": []}
    for tag, m in (("e", eager), ("g", graphed)):
        m.train(not eval_mode)
        for name in "abc":
            getattr(m, name).register_wgrad_hook(lambda mod, n=name, log=logs[tag]: log.append(n))

    def make(m):
        def step(x):
            loss = m(x, case)[0].square().sum()
            loss.backward()
            if delay:
                for layer in (m.a, m.b):
                    while layer.num_pending_wgrad_units():
                        layer.backward_dw()
                if case == "dw_twice":
                    torch.tanh(m.a(x)).sum().backward()
                    m.a.backward_dw()
            return loss.detach()
        return step

    run_eager, run_graphed = make(eager), dwgraph.graphed_step(make(graphed))
    for step in range(6):
        x = torch.randn(B, H)
        for tag, run in (("e", run_eager), ("g", run_graphed)):
            logs[tag].append("|")
            run(x.clone())
        assert logs["g"] == logs["e"], (step, logs)
        for m in (eager, graphed):
            m.zero_grad(set_to_none=True)
    assert run_graphed.num_captures >= 1


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "sharing_a_module"])
def test_two_steps_capturing_at_once_on_two_threads_keep_their_hook_runs_apart(shared):
    # Deterministic overlap: the first step's capture calls the second step's capture on a
    # thread it joins. Each recording takes the runs of its own modules (Note [Hook runs a
    # capture saw]); sharing a module makes them ambiguous, and the capture is refused.
    def model():
        return torch.nn.ModuleDict(dict(a=dwgraph.nn.Linear(H, H), head=dwgraph.nn.Linear(H, H)))

    torch.manual_seed(0)
    first, second = model(), model()
    if shared:
        second["a"] = first["a"]
    logs = {"first": [], "second": []}
    for tag, m in (("first", first), ("second", second)):
        m["head"].register_wgrad_hook(lambda mod, log=logs[tag]: log.append("head"))
    if not shared:
        for tag, m in (("first", first), ("second", second)):
            m["a"].register_wgrad_hook(lambda mod, log=logs[tag]: log.append("a"))
    state = {"nest": False}
    errors = []

    def body(m, nest):
        def step(x):
            loss = m["a"](x).square().sum()
            m["head"](x)  # an output the loss does not use: eager runs no hook of `head`
            if nest and state["nest"]:
                state["nest"] = False

                def other():
                    try:
                        run_second(x)
                    except dwgraph.GraphStateError as e:
                        errors.append(str(e))
                t = threading.Thread(target=other)
                t.start()
                t.join()
            loss.backward()
            return loss.detach()
        return step

    run_first = dwgraph.graphed_step(body(first, True), warmup_iters=1)
    run_second = dwgraph.graphed_step(body(second, False), warmup_iters=1)
    x = torch.randn(B, H)
    run_first(x)  # warmup
    run_second(x)  # warmup
    state["nest"] = True
    if shared:
        with pytest.raises(dwgraph.GraphStateError, match="captured on another thread at the same time"):
            run_first(x)  # its capture: the second captures inside it
        assert len(errors) == 1 and "at the same time" in errors[0], errors
        return
    run_first(x)  # captures, the second capturing inside it
    for tag in logs:
        logs[tag].clear()
    for _ in range(2):
        run_first(x)
        run_second(x)
    assert errors == [] and logs["first"] == ["a", "a"] and logs["second"] == ["a", "a"], (errors, logs)
    assert run_first.num_captures == 1 and run_second.num_captures == 1
