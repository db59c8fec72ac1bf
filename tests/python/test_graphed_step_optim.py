"""Training loops as people write them under ``@dwgraph.graphed_step`` (issue 22, contract C10):
optimizers and LR schedules inside graphs without recapture, a recapture storm reported and
bounded, and the step's per-call checks paid only when what they watch changes.

Every training test builds a model, deep-copies it, and trains the two copies side by side
on the same data with the same optimizer and scheduler: the *eager* copy runs the step body
directly, the *graphed* copy through ``dwgraph.graphed_step``; the scheduler steps outside
the step. Comparisons are bitwise (``torch.equal``): on the CPU a replay of an SGD or
Adam/AdamW step runs ``dwgraph::optim_sgd_`` / ``optim_adam_``, which call the ATen kernels
torch's eager code calls with the same Scalar values, computed in double as Python does
(Note [Hyperparameters a replay reads], ops/optim.cpp). Nothing differs from eager there,
so no tolerance is needed (and none is used).
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

import dwgraph
from dwgraph import _optim

H = 8
B = 4
MICRO = 4  # microbatches accumulated per step


# --------------------------------------------------------------------------------------
# models and steps
# --------------------------------------------------------------------------------------
class TinyGPT(torch.nn.Module):
    """Token embedding + position embedding, one pre-LN transformer block (causal
    attention through a dwgraph Linear, a deferred-wgrad MLP), a tied LM head."""

    def __init__(self, vocab=16, dim=H, seq=6):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = dwgraph.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc = dwgraph.nn.Linear(dim, 4 * dim, delay_wgrad_compute=True)
        self.out = dwgraph.nn.Linear(4 * dim, dim, delay_wgrad_compute=True)
        self.lnf = torch.nn.LayerNorm(dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj(att @ v)
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return self.lnf(x) @ self.tok.weight.t()

    def deferred(self):
        return [self.out, self.fc]


def gpt_batch(vocab=16, seq=6):
    idx = torch.randint(0, vocab, (MICRO, B, seq))
    return idx, torch.randint(0, vocab, (MICRO, B, seq))


def gpt_body(model, opt, idx, tgt, set_to_none=True, clip=1.0):
    """4 microbatches accumulated, clipping, the optimizer step and zero_grad inside."""
    total = None
    for i in range(MICRO):
        logits = model(idx[i])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[i].reshape(-1)) / MICRO
        loss.backward()
        for m in model.deferred():
            m.backward_dw()
        total = loss.detach() if total is None else total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return total


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(H, H)
        self.b = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def small_body(model, opt, x, set_to_none=True):
    loss = model(x).square().mean()
    loss.backward()
    model.b.backward_dw()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss


def assert_same(eager, graphed, opt_e, opt_g, what):
    for (name, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(pe, pg), f"{what}: parameter {name} differs from eager"
        assert (pe.grad is None) == (pg.grad is None), f"{what}: {name}.grad presence differs"
        if pe.grad is not None:
            assert torch.equal(pe.grad, pg.grad), f"{what}: {name}.grad differs"
    for pe, pg in zip(eager.parameters(), graphed.parameters()):
        se, sg = opt_e.state.get(pe, {}), opt_g.state.get(pg, {})
        assert set(se) == set(sg), f"{what}: optimizer state keys differ"
        for k in se:
            a, b = se[k], sg[k]
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f"{what}: state {k} differs"
    for ge, gg in zip(opt_e.param_groups, opt_g.param_groups):
        for k, v in ge.items():
            if k != "params":
                assert gg[k] == v and type(gg[k]) is type(v), f"{what}: param group {k} differs"


def twins(make, opt_fn, sched_fn=None):
    torch.manual_seed(0)
    eager = make()
    graphed = copy.deepcopy(eager)
    opt_e, opt_g = opt_fn(eager.parameters()), opt_fn(graphed.parameters())
    sch = (sched_fn(opt_e), sched_fn(opt_g)) if sched_fn else (None, None)
    return eager, graphed, opt_e, opt_g, sch


# --------------------------------------------------------------------------------------
# the loops of the issue: 50 steps, one capture
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zero"])
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_adamw_cosine_clipping_accumulation_50_steps(impl, set_to_none):
    kw = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    eager, graphed, opt_e, opt_g, (se, sg) = twins(
        TinyGPT, lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, **kw),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50, eta_min=0.0))
    step = dwgraph.graphed_step(lambda i, t: gpt_body(graphed, opt_g, i, t, set_to_none))
    for s in range(50):
        idx, tgt = gpt_batch()
        lg = step(idx, tgt)
        le = gpt_body(eager, opt_e, idx, tgt, set_to_none)
        assert torch.equal(lg, le), f"step {s}: loss differs from eager"
        assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
        se.step()
        sg.step()
    assert step.num_captures == 1, step.summary()
    assert step.stats()["replays"] == 50 - 3 and step.stats()["optimizers"] == {"AdamW#1": "read at replay"}
    # the optimizer is as the user made it: Python numbers a scheduler and a logger can read
    lr = opt_g.param_groups[0]["lr"]
    assert type(lr) is float and float(lr) == opt_e.param_groups[0]["lr"] and lr == 0.0  # the cosine's end


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zero"])
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_sgd_step_decay_50_steps(impl, set_to_none):
    kw = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    eager, graphed, opt_e, opt_g, (se, sg) = twins(
        TinyGPT, lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9, nesterov=True, weight_decay=1e-4, **kw),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5))
    step = dwgraph.graphed_step(lambda i, t: gpt_body(graphed, opt_g, i, t, set_to_none))
    for s in range(50):
        idx, tgt = gpt_batch()
        assert torch.equal(step(idx, tgt), gpt_body(eager, opt_e, idx, tgt, set_to_none)), f"step {s}"
        assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
        se.step()
        sg.step()
    assert step.num_captures == 1, step.summary()


# --------------------------------------------------------------------------------------
# every optimizer family x every scheduler family
# --------------------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-nesterov-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "sgd-maximize-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, maximize=True, weight_decay=0.01,
                                                     fused=True),
    "sgd-maximize-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, maximize=True, weight_decay=0.01,
                                                       foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-amsgrad-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.01),
    "adam-foreach-amsgrad-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True,
                                                                 weight_decay=0.01, foreach=True),
    "adam-fused-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-foreach-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
    "adamw-fused-maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True, fused=True),
}

S = torch.optim.lr_scheduler
SCHEDULERS = {
    "step": lambda o: S.StepLR(o, step_size=2, gamma=0.7),
    "multistep": lambda o: S.MultiStepLR(o, milestones=[2, 5], gamma=0.5),
    "exponential": lambda o: S.ExponentialLR(o, gamma=0.9),
    "lambda": lambda o: S.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "multiplicative": lambda o: S.MultiplicativeLR(o, lambda s: 0.95),
    "cosine": lambda o: S.CosineAnnealingLR(o, T_max=8),
    "warm-restarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3),
    "linear": lambda o: S.LinearLR(o, start_factor=0.3, total_iters=5),
    "constant": lambda o: S.ConstantLR(o, factor=0.5, total_iters=3),
    "polynomial": lambda o: S.PolynomialLR(o, total_iters=8, power=2.0),
    "sequential": lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.5, total_iters=2),
                                               S.ExponentialLR(o, gamma=0.8)], milestones=[2]),
    "chained": lambda o: S.ChainedScheduler([S.ExponentialLR(o, gamma=0.9), S.StepLR(o, step_size=3)]),
    # these move the momentum (SGD) or betas[0] (Adam, AdamW) too
    "onecycle": lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=12),
    "cyclic": lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.05, step_size_up=2,
                                   cycle_momentum="momentum" in o.defaults and o.defaults["momentum"] > 0 or
                                   "betas" in o.defaults),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_every_optimizer_under_every_scheduler(optim, sched):
    eager, graphed, opt_e, opt_g, (se, sg) = twins(Small, OPTIMIZERS[optim], SCHEDULERS[sched])
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    moved = set()
    for s in range(10):
        x = torch.randn(B, H)
        assert torch.equal(step(x), small_body(eager, opt_e, x)), f"step {s}"
        assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
        before = {k: v for k, v in opt_g.param_groups[0].items() if k != "params"}
        se.step()
        sg.step()
        moved |= {k for k, v in opt_g.param_groups[0].items() if k != "params" and before.get(k) != v}
    assert "lr" in moved
    if sched == "onecycle":
        assert moved & {"momentum", "betas"}, moved
    assert step.num_captures == 1, step.summary()


def test_reduce_lr_on_plateau():
    eager, graphed, opt_e, opt_g, (se, sg) = twins(
        Small, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    lrs = set()
    for s in range(10):
        x = torch.randn(B, H)
        lg, le = step(x), small_body(eager, opt_e, x)
        assert torch.equal(lg, le), f"step {s}"
        assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
        se.step(1.0)  # never better: halves the lr at every step
        sg.step(1.0)
        lrs.add(opt_g.param_groups[0]["lr"])
    assert len(lrs) > 5 and step.num_captures == 1


def test_two_param_groups_and_a_hand_written_schedule():
    # Values set by hand between calls (momentum, weight decay, betas too) are read at
    # replay; per group.
    torch.manual_seed(0)
    eager = Small()
    graphed = copy.deepcopy(eager)

    def make(m):
        return torch.optim.SGD([{"params": m.a.parameters(), "lr": 0.1},
                                {"params": m.b.parameters(), "lr": 0.05, "momentum": 0.5}], lr=0.1, momentum=0.9)

    opt_e, opt_g = make(eager), make(graphed)
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    for s in range(8):
        for opt in (opt_e, opt_g):
            opt.param_groups[0]["lr"] = 0.1 / (s + 1)
            opt.param_groups[1]["momentum"] = 0.5 + 0.05 * s
            opt.param_groups[1]["weight_decay"] = 0.01 * max(0, s - 2)  # 0, then not: torch branches on it
            opt.param_groups[0]["dampening"] = 0.1 * (s % 2)
        x = torch.randn(B, H)
        assert torch.equal(step(x), small_body(eager, opt_e, x)), f"step {s}"
        assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
    # one graph for weight_decay == 0, one for != 0 (torch branches on it)
    assert step.num_captures == 2, step.summary()


def test_integer_hyperparameters_keep_python_arithmetic():
    # lr=1 (an int) and SGD's default momentum=0/dampening=0: ints, as Python keeps them.
    eager, graphed, opt_e, opt_g, _ = twins(Small, lambda ps: torch.optim.SGD(ps, lr=1, momentum=0.5))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    for s in range(4):
        x = torch.randn(B, H) * 0.01
        assert torch.equal(step(x), small_body(eager, opt_e, x))
        assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
    for opt in (opt_e, opt_g):
        opt.param_groups[0]["lr"] = 0.5  # int -> float: another graph
    x = torch.randn(B, H) * 0.01
    assert torch.equal(step(x), small_body(eager, opt_e, x))
    assert_same(eager, graphed, opt_e, opt_g, "float lr")
    assert step.num_captures == 2


# --------------------------------------------------------------------------------------
# the optimizer stays the user's
# --------------------------------------------------------------------------------------
def test_state_dict_round_trip_and_pickling():
    eager, graphed, opt_e, opt_g, (se, sg) = twins(Small, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                                   lambda o: S.ExponentialLR(o, gamma=0.9))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    xs = [torch.randn(B, H) for _ in range(12)]
    for s in range(4):
        assert torch.equal(step(xs[s]), small_body(eager, opt_e, xs[s]))
        se.step()
        sg.step()
    sd = opt_g.state_dict()
    blob = pickle.dumps(sd)
    assert pickle.loads(blob)["param_groups"][0]["lr"] == opt_e.param_groups[0]["lr"]
    assert type(pickle.loads(blob)["state"][0]) is dict
    twin = copy.deepcopy(opt_g)
    assert type(twin.state) is collections.defaultdict and all(type(v) is dict for v in twin.state.values())
    assert type(pickle.loads(pickle.dumps(opt_g)).state) is collections.defaultdict
    # an older state loaded into both: the graphed step steps the loaded state
    old_e, old_g = copy.deepcopy(opt_e.state_dict()), copy.deepcopy(sd)
    for s in range(4, 8):
        assert torch.equal(step(xs[s]), small_body(eager, opt_e, xs[s]))
    opt_e.load_state_dict(old_e)
    opt_g.load_state_dict(old_g)
    for s in range(8, 12):
        assert torch.equal(step(xs[s]), small_body(eager, opt_e, xs[s])), f"step {s}"
        assert_same(eager, graphed, opt_e, opt_g, f"after load_state_dict, step {s}")
    assert isinstance(opt_g.param_groups[0]["lr"], float)


def test_a_tensor_lr_with_fused_is_read_by_torch_itself():
    # The documented way out for other optimizers: fused=True with a tensor lr (torch's own
    # tensor_lr kernel reads it at replay); here with Adam, not routed.
    eager, graphed, opt_e, opt_g, _ = twins(Small, lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2),
                                                                                 fused=True))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    for s in range(5):
        x = torch.randn(B, H)
        assert torch.equal(step(x), small_body(eager, opt_e, x))
        assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
        for o in (opt_e, opt_g):
            o.param_groups[0]["lr"].fill_(1e-2 / (s + 2))
    assert step.num_captures == 1 and step.stats()["optimizers"] == {"Adam#1": "in the key"}


def test_betas_switched_to_tensors_after_replays_are_seen():
    # (0.9, 0.999) == (tensor(0.9), tensor(0.999)) is true, so the change went unseen and
    # the captured step (reading number betas) kept replaying: parameters drifted from
    # eager's silently. Now it is a change of the groups: torch's fused Adam with tensor
    # betas reads them on the host, which a capture refuses with the ways out.
    eager, graphed, opt_e, opt_g, _ = twins(Small, lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    _checked(eager, graphed, opt_e, opt_g, step, "number betas")
    for o in (opt_e, opt_g):
        o.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
    with pytest.raises(dwgraph.GraphStateError, match="fused=True|capturable=True"):
        for _ in range(3):  # warmup calls of the new variant run eagerly, then its capture is refused
            step(torch.randn(B, H))


@pytest.mark.parametrize("impl", ["single", "foreach"])
def test_betas_list_changed_in_place_after_replays_is_seen(impl):
    # torch accepts betas as a list. Routed, the replay reads beta1/beta2 from dwgraph's
    # buffer, and the list is compared by its words, which hold only the values' types: an
    # in-place change of betas[0] went unseen and replays kept the captured beta1.
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, **({"foreach": True} if impl == "foreach" else {}))  # noqa: E731
    eager, graphed, opt_e, opt_g, _ = twins(Small, make)
    for o in (opt_e, opt_g):
        o.param_groups[0]["betas"] = [0.9, 0.999]
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    _checked(eager, graphed, opt_e, opt_g, step, "list betas")
    for beta1 in (0.5, 0.7):
        for o in (opt_e, opt_g):
            o.param_groups[0]["betas"][0] = beta1
        _checked(eager, graphed, opt_e, opt_g, step, f"betas[0] = {beta1} in place")
    assert step.num_captures == 1  # read at replay: a new value, not a new graph


def test_an_optimizer_error_of_its_own_is_raised_as_eagerly():
    # A group missing a key torch reads makes eager's step raise KeyError; the capture of the
    # new variant raised it as "reads tensor values on the host ... pass fused=True".
    eager, graphed, opt_e, opt_g, _ = twins(Small, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    _checked(eager, graphed, opt_e, opt_g, step, "before")
    for o in (opt_e, opt_g):
        o.param_groups[0].pop("maximize")
    x = torch.randn(B, H)
    with pytest.raises(KeyError, match="maximize"):
        small_body(eager, opt_e, x)
    with pytest.raises(KeyError, match="maximize"):
        for _ in range(3):  # the new variant's warmup call runs eagerly, raising as eager does
            step(x)


def test_an_optimizer_that_reads_the_host_is_refused_naming_the_ways_out():
    m = Small()
    opt = torch.optim.Adagrad(m.parameters(), lr=1e-2)
    step = dwgraph.graphed_step(lambda x: small_body(m, opt, x), warmup_iters=1)
    x = torch.randn(B, H)
    step(x)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(dwgraph.GraphStateError, match=r"Adagrad\.step\(\).*cannot be captured.*SGD, Adam and "
                                                      r"AdamW.*fused=True.*capturable=True"):
        step(x)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    # and the way out works: Adagrad(fused=True) on the CPU
    eager, graphed, opt_e, opt_g, _ = twins(Small, lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    _checked(eager, graphed, opt_e, opt_g, step, "Adagrad(fused=True)", n=4)


# --------------------------------------------------------------------------------------
# a recapture storm: reported once, bounded
# --------------------------------------------------------------------------------------
def _rmsprop_storm(max_graphs, max_captures):
    # RMSprop's step is capturable but not routed: its Python-number lr is baked into the
    # graph, so an LR schedule makes every call capture.
    return twins(Small, lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
                 lambda o: S.ExponentialLR(o, gamma=0.9))


def test_a_step_that_keeps_capturing_warns_once_naming_what_changed(caplog):
    eager, graphed, opt_e, opt_g, (se, sg) = _rmsprop_storm(2, 128)
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1, max_graphs=2)
    with caplog.at_level(logging.WARNING, logger="dwgraph"):
        for s in range(8):
            x = torch.randn(B, H)
            assert torch.equal(step(x), small_body(eager, opt_e, x))
            se.step()
            sg.step()
    storms = [r for r in caplog.records if "keeps capturing" in r.getMessage()]
    assert len(storms) == 1, [r.getMessage() for r in caplog.records]
    msg = storms[0].getMessage()
    assert "hyperparameters(RMSprop#1)" in msg and "'lr'" in msg and "max_graphs=2" in msg, msg
    assert step.stats()["num_captures"] == 7 and step.stats()["optimizers"] == {"RMSprop#1": "in the key"}


def test_past_max_captures_calls_run_eagerly_and_say_so(caplog):
    eager, graphed, opt_e, opt_g, (se, sg) = _rmsprop_storm(2, 4)
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1, max_graphs=2,
                                max_captures=4)
    with caplog.at_level(logging.WARNING, logger="dwgraph"):
        for s in range(10):
            x = torch.randn(B, H)
            assert torch.equal(step(x), small_body(eager, opt_e, x)), f"step {s}"
            assert_same(eager, graphed, opt_e, opt_g, f"step {s}")
            se.step()
            sg.step()
    st = step.stats()
    assert st["num_captures"] == 4 and st["capture_limited_calls"] == 5 and st["eager_calls"] == 6, st
    limits = [r for r in caplog.records if "max_captures=4" in r.getMessage() and "runs eagerly" in r.getMessage()]
    assert len(limits) == 1
    assert "captures        4 (4 since reset, max_captures=4)" in step.summary()
    assert "captures" in dwgraph.summary(step)
    step.reset()  # starts counting again
    x = torch.randn(B, H)
    assert torch.equal(step(x), small_body(eager, opt_e, x))
    assert step.stats()["captures_since_reset"] == 0  # a new key's first call warms up
    assert torch.equal(step(x), small_body(eager, opt_e, x))
    assert step.stats()["captures_since_reset"] == 1


def test_a_key_that_changes_every_call_is_bounded(caplog):
    m = Small()
    m_e = copy.deepcopy(m)

    def body(model, x, i):
        loss = model(x).square().mean() * (1 + i % 3)
        loss.backward()
        model.b.backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x, i: body(m, x, i), warmup_iters=1)
    limit = step.stats()["max_idle_keys"]
    with caplog.at_level(logging.WARNING, logger="dwgraph"):
        for i in range(limit + 20):
            x = torch.randn(B, H)
            assert torch.equal(step(x, i), body(m_e, x, i))
            m.zero_grad(set_to_none=True)
            m_e.zero_grad(set_to_none=True)
    st = step.stats()
    assert st["num_keys"] <= limit and st["dropped_keys"] == 20 and st["num_captures"] == 0, st
    keys = [r.getMessage() for r in caplog.records if "key changed at every call" in r.getMessage()]
    assert len(keys) == 1 and "positional arguments: " in keys[0] and "int:" in keys[0], keys


# --------------------------------------------------------------------------------------
# C10: the per-call checks cost nothing until what they watch changes; every change is seen
# --------------------------------------------------------------------------------------
def _checked(eager, graphed, opt_e, opt_g, step, what, n=3):
    for s in range(n):
        x = torch.randn(B, H)
        assert torch.equal(step(x), small_body(eager, opt_e, x)), f"{what}, call {s}"
        assert_same(eager, graphed, opt_e, opt_g, f"{what}, call {s}")


def _watched_twins():
    eager, graphed, opt_e, opt_g, _ = twins(Small, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    _checked(eager, graphed, opt_e, opt_g, step, "before", n=5)
    assert step.num_captures == 1
    return eager, graphed, opt_e, opt_g, step


def test_nothing_changed_reuses_the_variant_state():
    eager, graphed, opt_e, opt_g, step = _watched_twins()
    calls = []
    real = type(step)._module_words
    type(step)._module_words = lambda self, mods: calls.append(1) or real(self, mods)
    try:
        _checked(eager, graphed, opt_e, opt_g, step, "replays", n=4)
    finally:
        type(step)._module_words = real
    assert calls == [], "the modules were walked although nothing changed"
    assert step.num_captures == 1 and not step._unwatched


@pytest.mark.parametrize("change", ["training", "hook added", "hook removed",
                                    "param group added", "hyperparameter", "load_state_dict", "state.clear",
                                    "grad_dtype", "state tensor moved", "state tensor .data",
                                    "parameter moved between groups", "equal value, new object", "keys reordered"])
def test_every_change_after_replays_is_seen(change):
    eager, graphed, opt_e, opt_g, step = _watched_twins()
    captures = step.num_captures
    if change == "training":
        eager.a.eval()
        graphed.a.eval()
    elif change in ("hook added", "hook removed"):
        handles = [m.b.register_forward_hook(lambda mod, i, o: o * 2) for m in (eager, graphed)]
        if change == "hook removed":
            _checked(eager, graphed, opt_e, opt_g, step, "with the hook")
            assert step.num_captures > captures
            for h in handles:
                h.remove()
            captures = None  # back to the graph captured without it (a stale one would double the output)
    elif change == "param group added":
        extra_e, extra_g = torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.ones(H))
        opt_e.add_param_group({"params": [extra_e], "lr": 0.5})
        opt_g.add_param_group({"params": [extra_g], "lr": 0.5})
    elif change == "hyperparameter":
        # a Python number in the group torch's SGD does not read at replay: by value
        for o in (opt_e, opt_g):
            o.param_groups[0]["nesterov"] = True
            o.param_groups[0]["dampening"] = 0
    elif change == "load_state_dict":
        sd_e, sd_g = copy.deepcopy(opt_e.state_dict()), copy.deepcopy(opt_g.state_dict())
        for sd in (sd_e, sd_g):
            for st in sd["state"].values():
                st["momentum_buffer"].mul_(0.5)
        opt_e.load_state_dict(sd_e)
        opt_g.load_state_dict(sd_g)
    elif change == "state.clear":
        opt_e.state.clear()
        opt_g.state.clear()
    elif change == "grad_dtype":
        if not hasattr(torch.Tensor, "grad_dtype"):
            pytest.skip("this torch has no Tensor.grad_dtype")
        for m in (eager, graphed):
            m.a.bias.grad_dtype = torch.float64
    elif change == "state tensor moved":
        for o, m in ((opt_e, eager), (opt_g, graphed)):
            buf = o.state[m.a.weight]["momentum_buffer"]
            buf.set_(buf.clone())  # same tensor object, new memory
    elif change == "state tensor .data":
        for o, m in ((opt_e, eager), (opt_g, graphed)):
            buf = o.state[m.a.weight]["momentum_buffer"]
            buf.data = buf.data.clone()  # the epoch moves (a watched state tensor), not the state dict
    elif change == "parameter moved between groups":
        for o, m in ((opt_e, eager), (opt_g, graphed)):
            o.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.2})
            ps = o.param_groups[0]["params"]
            moved = ps.pop(next(i for i, p in enumerate(ps) if p is m.b.weight))
            o.param_groups[1]["params"].append(moved)
    elif change in ("equal value, new object", "keys reordered"):
        # What the one-call identity check (same_groups) cannot vouch for is compared by
        # value: the same graph, replayed (nothing a replay reads changed).
        for o in (opt_e, opt_g):
            g = o.param_groups[0]
            if change == "keys reordered":
                g["momentum"] = g.pop("momentum")
            else:
                g["lr"] = float(str(g["lr"]))
        _checked(eager, graphed, opt_e, opt_g, step, f"after {change}")
        assert step.num_captures == captures, f"{change}: captured again though no value changed"
        return
    _checked(eager, graphed, opt_e, opt_g, step, f"after {change}")
    if captures is not None:
        assert step.num_captures > captures, f"{change}: no new graph was captured"


# Numbers a replay reads, changed after replays (what a schedule does): the same graph,
# its buffer refilled, unless a value that selects a graph changed with them.
_NUMBERS_MOVED = {  # name: (optimizer, what is set in the first group, a new graph expected)
    "sgd lr": ("sgd", {"lr": 0.04}, False),
    "sgd momentum": ("sgd", {"momentum": 0.5}, False),
    "sgd dampening": ("sgd", {"dampening": 0.1}, True),  # torch's default 0 is an int: another type
    "sgd momentum to 0": ("sgd", {"momentum": 0.0}, True),  # torch branches on momentum != 0
    "sgd weight_decay from 0": ("sgd", {"weight_decay": 0.01}, True),  # ... and on weight_decay != 0
    "sgd lr an int": ("sgd", {"lr": 1}, True),  # another Python type: other arithmetic
    "sgd lr with nesterov": ("sgd", {"lr": 0.04, "nesterov": True}, True),  # with a value not read at replay
    "adamw betas, eps, lr": ("adamw", {"betas": (0.8, 0.99), "eps": 1e-6, "lr": 0.02}, False),
    "adamw weight_decay": ("adamw", {"weight_decay": 0.02}, False),
    "adamw weight_decay to 0": ("adamw", {"weight_decay": 0.0}, True),
    "adamw betas a list": ("adamw", {"betas": [0.8, 0.99]}, False),  # a list: read at replay as well
    "adamw lr with maximize": ("adamw", {"lr": 0.02, "maximize": True}, True),
}


@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
@pytest.mark.parametrize("change", list(_NUMBERS_MOVED))
def test_numbers_a_replay_reads_moved_after_replays(change, impl):
    fam, values, new_graph = _NUMBERS_MOVED[change]
    kw = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    make = (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, **kw)) if fam == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01, **kw))
    eager, graphed, opt_e, opt_g, _ = twins(Small, make)
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    _checked(eager, graphed, opt_e, opt_g, step, "before", n=4)
    captures = step.num_captures
    assert captures == 1 and "read at replay" in step.summary(), step.summary()
    for o in (opt_e, opt_g):
        o.param_groups[0].update(values)
    rebuilt = []
    real = _optim.OptimizerWatch.refresh_groups
    _optim.OptimizerWatch.refresh_groups = lambda self, *a: rebuilt.append(1) or real(self, *a)
    try:
        _checked(eager, graphed, opt_e, opt_g, step, f"after {change}", n=4)
    finally:
        _optim.OptimizerWatch.refresh_groups = real
    if not new_graph and not isinstance(values.get("betas"), list):
        # Only the buffer refilled: the groups' words were not built again.
        assert rebuilt == [], f"{change}: the variant state was rebuilt for numbers read at replay"
    if new_graph:
        assert step.num_captures == captures + 1, f"{change}: no new graph was captured"
    else:
        assert step.num_captures == captures, f"{change}: captured again though only numbers read at replay moved"
    # And back: each value again, the first graph replayed.
    for o in (opt_e, opt_g):
        o.param_groups[0]["lr"] = 0.03
    _checked(eager, graphed, opt_e, opt_g, step, f"after {change}, lr moved again", n=2)
    assert step.num_captures == captures + new_graph


def test_a_parameter_swapped_between_groups_in_place_is_seen():
    # Same lengths, same list objects: only an element-by-element identity check sees it.
    torch.manual_seed(0)
    eager = Small()
    graphed = copy.deepcopy(eager)

    def make(m):
        return torch.optim.SGD([{"params": [m.a.weight, m.a.bias], "lr": 0.1},
                                {"params": [m.b.weight, m.b.bias], "lr": 0.01}], lr=0.1, momentum=0.9)

    opt_e, opt_g = make(eager), make(graphed)
    step = dwgraph.graphed_step(lambda x: small_body(graphed, opt_g, x), warmup_iters=1)
    _checked(eager, graphed, opt_e, opt_g, step, "before", n=4)
    for o in (opt_e, opt_g):
        g0, g1 = o.param_groups[0]["params"], o.param_groups[1]["params"]
        g0[0], g1[0] = g1[0], g0[0]
    captures = step.num_captures
    _checked(eager, graphed, opt_e, opt_g, step, "after the swap")
    assert step.num_captures > captures


def test_optimizer_replaced_behind_the_same_closure_is_seen():
    # The step reaches the optimizer through a mutable cell: a new optimizer object there
    # (the old one dropped) selects another graph, which steps the new one.
    torch.manual_seed(0)
    eager = Small()
    graphed = copy.deepcopy(eager)
    cell = {"e": torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9),
            "g": torch.optim.SGD(graphed.parameters(), lr=0.05, momentum=0.9)}
    step = dwgraph.graphed_step(lambda x: small_body(graphed, cell["g"], x), warmup_iters=1)
    for s in range(4):
        x = torch.randn(B, H)
        assert torch.equal(step(x), small_body(eager, cell["e"], x))
    captures = step.num_captures
    cell["e"] = torch.optim.Adam(eager.parameters(), lr=1e-2)
    cell["g"] = torch.optim.Adam(graphed.parameters(), lr=1e-2)
    for s in range(4):
        x = torch.randn(B, H)
        assert torch.equal(step(x), small_body(eager, cell["e"], x)), f"call {s}"
        assert_same(eager, graphed, cell["e"], cell["g"], f"call {s}")
    assert step.num_captures > captures


def _scaled_pair(enabled=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
             torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2, enabled=enabled)) for m in (model, twin)]


def test_a_grad_scalers_unscale_inside_the_step_is_refused_at_capture_before_it_runs():
    """unscale_'s kernels would replay, its bookkeeping (the optimizer marked unscaled, its
    found_inf) would not: scaler.step() after a replay unscaled the gradients again (a review
    found the parameters 0.085 off eager's after eight steps)."""
    (model, opt, scaler), _ = _scaled_pair()

    def body(x):
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss.detach()

    step = dwgraph.graphed_step(body)
    x = torch.randn(3, 4)
    for _ in range(3):  # warmup: eager, as the unwrapped loop
        step(x)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(dwgraph.GraphStateError, match=r"GradScaler.unscale_\(\).*scaler.step\(\) after a replay"):
        step(x)
    assert step.num_captures == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert scaler._per_optimizer_states[id(opt)]["stage"] is torch.amp.grad_scaler.OptState.READY


@pytest.mark.parametrize("enabled", [True, False], ids=["scaler", "disabled_scaler"])
def test_a_grad_scalers_scale_inside_and_unscale_clip_step_update_outside_match_eager(enabled):
    """The refusal's advice, with an overflowing step among them (the scaler skips it and
    halves its scale, which the replays read); a disabled scaler's unscale_ inside is a no-op."""
    pairs = _scaled_pair(enabled)

    def body(model, opt, scaler, x):
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        if not enabled:
            scaler.unscale_(opt)
        return loss.detach()

    (me, oe, se), (mg, og, sg) = pairs
    step = dwgraph.graphed_step(lambda x: body(mg, og, sg, x))
    for i in range(8):
        x = torch.randn(3, 4) * (1e30 if i == 5 else 1.0)
        for run, (m, o, s) in ((lambda x: body(me, oe, se, x), pairs[0]), (step, pairs[1])):
            loss = run(x)
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s.step(o)
            s.update()
            o.zero_grad(set_to_none=True)
        assert se.get_scale() == sg.get_scale(), f"step {i}"
        for pe, pg in zip(me.parameters(), mg.parameters()):
            assert torch.equal(pe, pg), f"step {i}"
        for k, v in oe.state_dict()["state"].items():
            assert torch.equal(v["momentum_buffer"], og.state_dict()["state"][k]["momentum_buffer"]), f"step {i}"
    assert step.num_captures == 1
