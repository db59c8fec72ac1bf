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
  8. nothing a step installs affects another thread;
  plus autocast inside the step (exact) and around it with the cache on (refused), and the
  log lines of captures and evictions.
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
    captures = [r for r in caplog.records if "captured key" in r.getMessage()]
    evictions = [r for r in caplog.records if "released the graph" in r.getMessage()]
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
