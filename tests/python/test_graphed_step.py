"""``@dwgraph.graphed_step`` (SPEC C3, C4, C7) on the CPU host graph, against the same step run eagerly.

Every training test builds one model, deep-copies it (``copy.deepcopy``: same initial
weights, ``main_grad`` buffers copied too), and trains the two copies side by side on the
same data: the *eager* copy runs the step body directly, the *graphed* copy runs it
through ``dwgraph.graphed_step``. The optimizer (SGD, lr 0.1) and ``zero_grad`` stay
outside the step. The step semantics under test:

  * per input key (non-tensor arguments, tensor shapes / dtypes / strides / devices /
    requires_grad) the first ``warmup_iters`` calls run the body eagerly, the next captures
    it and replays it once, every later call replays;
  * the graph sees the gradients as the eager step would (Note [A step's gradients are
    graph state]): one variant per pattern of existing ``.grad``s, in-place accumulation
    into the caller's values, handed back after each replay; then the wgrad hooks of
    ``dwgraph.nn`` modules run; fused ``main_grad`` accumulates inside the graph;
  * returned tensors are fresh clones.

Every comparison is bitwise (``torch.equal``): FP32 on the CPU, the host graph replays
exactly the ATen kernels the eager body runs, on identical operands, and a gradient that
lands on a ``.grad`` of None is taken as is while ``0 + g == g`` exactly, so both
``zero_grad`` modes and in-step microbatch accumulation give identical bits.

The training-loop, shape, ``max_graphs``, burst, hook, ``main_grad``, returned-tensor and
``warmup_iters=0`` tests also run on CUDA (the ``device`` fixture: marked ``cuda``,
skipped without a CUDA device), still bitwise: CUDA graphs replay the kernels the eager
body runs (each step's batch is then its own allocation, see ``per_step``).

"""

from __future__ import annotations

import collections
import copy
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

import dwgraph

H = 8        # hidden size
FFN = 12     # LayerNormMLP's ffn_hidden_size
B = 4        # rows per microbatch
LR = 0.1
STEPS = 10
CLONE_LIMIT = 4096  # outputs larger than this were once returned as static buffers


# --------------------------------------------------------------------------------------
# the model and the step body
# --------------------------------------------------------------------------------------
class Net(torch.nn.Module):
    """torch.nn.Linear -> deferred dwgraph Linear -> relu -> deferred LayerNormMLP ->
    non-deferred dwgraph Linear. ``fuse=True`` fuses the deferred modules' weights into
    ``main_grad``; ``delay=False`` makes them non-deferred. ``te=True``: TransformerEngine's
    blocks instead, a LayerNormLinear for the Linear and a checkpointed LayerNormMLP."""

    def __init__(self, *, delay: bool = True, fuse: bool = False, device: str = "cpu", te: bool = False):
        super().__init__()
        self.inp = torch.nn.Linear(H, H, device=device)
        flags = dict(delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse, device=device)
        self.lin = dwgraph.nn.LayerNormLinear(H, H, **flags) if te else dwgraph.nn.Linear(H, H, **flags)
        self.mlp = dwgraph.nn.LayerNormMLP(H, FFN, checkpoint=te, **flags)
        self.out = dwgraph.nn.Linear(H, H, device=device)

    def forward(self, x):
        return self.out(self.mlp(torch.relu(self.lin(self.inp(x)))))

    def deferred(self):
        return [m for m in (self.lin, self.mlp, self.out) if m.delay_wgrad_compute]

    def fused_weights(self):
        return [p for m in (self.lin, self.mlp) for _, p in m._fused_parameters()]


def body(model: Net, xs: torch.Tensor, ys: torch.Tensor):
    """One training step: per microbatch forward, loss.backward(), backward_dw() of every
    deferred module. Returns (summed loss, last microbatch's output)."""
    total = None
    out = None
    for i in range(xs.shape[0]):
        out = model(xs[i])
        loss = F.mse_loss(out, ys[i])
        loss.backward()
        for m in model.deferred():
            m.backward_dw()
        total = loss.detach() if total is None else total + loss.detach()
    return total, out.detach()


def sgd_step(model: Net, lr: float = LR) -> None:
    """SGD on .grad, and on main_grad for fused weights (in place: no reallocation)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
        for p in model.fused_weights():
            p.add_(p.main_grad, alpha=-lr)


def zero_grad(model: Net, set_to_none: bool) -> None:
    for p in model.parameters():
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.zero_()


def assert_grads_equal(eager: torch.nn.Module, graphed: torch.nn.Module, what: str) -> None:
    for (name, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
        if pe.grad is None:
            assert pg.grad is None, f"{what}: {name}.grad should be None (as eager), got a tensor"
        else:
            assert pg.grad is not None, f"{what}: {name}.grad is None, eager has a gradient"
            assert torch.equal(pg.grad, pe.grad), f"{what}: {name}.grad differs from eager"
        if hasattr(pe, "main_grad"):
            assert torch.equal(pg.main_grad, pe.main_grad), f"{what}: {name}.main_grad differs from eager"


def assert_params_equal(eager: torch.nn.Module, graphed: torch.nn.Module, what: str) -> None:
    for (name, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(pg, pe), f"{what}: parameter {name} differs from eager"


def per_step(t: torch.Tensor, device: str):
    """``t`` moved to ``device``, indexed by step. On CUDA every step's batch is its own
    allocation: cuBLASLt chooses its algorithm by the operands' alignment (dwgraph's and
    ATen's cuBLASLt calls pass the pointers' alignment, up to 256 bytes), and a graphed
    step copies its inputs into freshly allocated static buffers, so an eager call on a
    view at an odd offset into one big tensor might get another algorithm and not be
    bitwise comparable. On the CPU, the tensor itself (the values are the same)."""
    t = t.to(device)
    return t if device == "cpu" else [b.clone() for b in t.unbind(0)]


def data(steps: int, micro: int, rows: int = B, device: str = "cpu"):
    # Drawn on the CPU and moved: the CPU cases see exactly the values they always did.
    return per_step(torch.randn(steps, micro, rows, H), device), per_step(torch.randn(steps, micro, rows, H), device)


# --------------------------------------------------------------------------------------
# 1. a training loop: graphed == eager, bitwise, every step
# --------------------------------------------------------------------------------------
FORMS = {
    # name: (warmup_iters the form implies)
    "bare": 3,      # @dwgraph.graphed_step
    "args": 2,      # @dwgraph.graphed_step(warmup_iters=2, max_graphs=4)
    "params": 1,    # @dwgraph.graphed_step(warmup_iters=1, params=[...])
}


def make_step(model: Net, form: str):
    if form == "bare":
        @dwgraph.graphed_step
        def step(xs, ys):
            return body(model, xs, ys)
    elif form == "args":
        @dwgraph.graphed_step(warmup_iters=2, max_graphs=4)
        def step(xs, ys):
            return body(model, xs, ys)
    else:
        @dwgraph.graphed_step(warmup_iters=1, params=list(model.parameters()))
        def step(xs, ys):
            return body(model, xs, ys)
    assert isinstance(step, dwgraph.GraphedStep)
    return step


@pytest.mark.parametrize("te", [False, True], ids=["linear-mlp", "lnlinear-mlp_ckpt"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("micro", [1, 3], ids=["micro1", "micro3"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zero"])
def test_training_loop_matches_eager(device, form, micro, set_to_none, te):
    eager = Net(device=device, te=te)
    graphed = copy.deepcopy(eager)
    assert_params_equal(eager, graphed, "initial weights")
    opt_e = torch.optim.SGD(eager.parameters(), lr=LR)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=LR)
    step = make_step(graphed, form)
    warmup = FORMS[form]
    xs, ys = data(STEPS, micro, device=device)

    for s in range(STEPS):
        le, oe = body(eager, xs[s], ys[s])
        lg, og = step(xs[s], ys[s])
        what = f"step {s} ({'warmup' if s < warmup else 'capture' if s == warmup else 'replay'})"
        assert torch.equal(lg, le), f"{what}: loss {lg.item()} != eager {le.item()}"
        assert torch.equal(og, oe), f"{what}: output differs from eager"
        assert_grads_equal(eager, graphed, what)
        assert step.num_captures == (0 if s < warmup else 1), what
        for m in graphed.deferred():
            assert m.num_queued_wgrad_units() == 0, f"{what}: wgrad work left queued"
        opt_e.step(), opt_g.step()
        assert_params_equal(eager, graphed, what)
        opt_e.zero_grad(set_to_none=set_to_none), opt_g.zero_grad(set_to_none=set_to_none)
        if not set_to_none and s > 0:
            assert all(p.grad is not None and not p.grad.any() for p in graphed.parameters())
    assert step.num_graphs == 1
    assert step.num_captures == 1


# --------------------------------------------------------------------------------------
# 2. two shapes alternating: one graph each, never re-captured
# --------------------------------------------------------------------------------------
def test_two_shapes_alternating(device):
    eager = Net(device=device)
    graphed = copy.deepcopy(eager)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(xs, ys):
        return body(graphed, xs, ys)

    rows = [4, 6]
    n = 14
    for i in range(n):
        r = rows[i % 2]
        xs, ys = torch.randn(1, r, H).to(device), torch.randn(1, r, H).to(device)
        le, oe = body(eager, xs, ys)
        lg, og = step(xs, ys)
        assert torch.equal(lg, le) and torch.equal(og, oe), f"call {i} (rows {r}) differs from eager"
        assert_grads_equal(eager, graphed, f"call {i}")
        # calls 0, 1: warmup of each shape; 2, 3: capture of each; then replays only
        expected = {0: 0, 1: 0, 2: 1}.get(i, 2)
        assert step.num_captures == expected, f"call {i}: num_captures {step.num_captures} != {expected}"
        if i >= 3:
            assert step.num_graphs == 2
        sgd_step(eager), sgd_step(graphed)
        zero_grad(eager, True), zero_grad(graphed, True)
    assert_params_equal(eager, graphed, "end")
    assert step.num_captures == 2 and step.num_graphs == 2


# --------------------------------------------------------------------------------------
# 3. max_graphs: least recently used graph released, re-captured when its key returns
# --------------------------------------------------------------------------------------
def _expected_captures(seq: List[int], warmup: int, max_graphs: int):
    """The documented policy: per key ``warmup`` eager calls then a capture; capturing
    beyond ``max_graphs`` graphs releases the least recently used graph, whose key captures
    again (without new warmup calls) when it returns."""
    calls: Dict[int, int] = collections.defaultdict(int)
    graphs: "collections.OrderedDict[int, bool]" = collections.OrderedDict()
    captures, out = 0, []
    for key in seq:
        calls[key] += 1
        if key in graphs:
            graphs.move_to_end(key)
        elif calls[key] > warmup:
            while len(graphs) >= max_graphs:
                graphs.popitem(last=False)
            graphs[key] = True
            captures += 1
        out.append((captures, len(graphs)))
    return out


@pytest.mark.parametrize("pattern", ["pairs", "cycle"])
def test_max_graphs_bound(device, pattern):
    eager = Net(device=device)
    graphed = copy.deepcopy(eager)
    if pattern == "pairs":
        # each shape twice in a row (warmup, capture), a cached key revisited, then evicted keys return
        warmup = 1
        seq = [4, 4, 5, 5, 4, 6, 6, 5, 5, 4, 4, 6, 6, 4]
        step = dwgraph.graphed_step(lambda xs, ys: body(graphed, xs, ys), warmup_iters=warmup, max_graphs=2)
    else:
        # three shapes cycling with no warmup (params given): every call is a new capture
        warmup = 0
        seq = [4, 5, 6] * 4
        step = dwgraph.graphed_step(lambda xs, ys: body(graphed, xs, ys), warmup_iters=warmup, max_graphs=2,
                                    params=list(graphed.parameters()))
    expected = _expected_captures(seq, warmup, 2)
    assert expected[-1][0] > 3, "the sequence must re-capture evicted keys"
    for i, r in enumerate(seq):
        xs, ys = torch.randn(1, r, H).to(device), torch.randn(1, r, H).to(device)
        le, oe = body(eager, xs, ys)
        lg, og = step(xs, ys)
        assert torch.equal(lg, le) and torch.equal(og, oe), f"call {i} (rows {r}) differs from eager"
        assert_grads_equal(eager, graphed, f"call {i} (rows {r})")
        captures, captured = expected[i]
        assert step.num_captures == captures, f"call {i} (rows {r}): num_captures {step.num_captures} != {captures}"
        assert captured <= step.num_graphs <= 2, f"call {i}: num_graphs {step.num_graphs}"
        sgd_step(eager), sgd_step(graphed)
        zero_grad(eager, True), zero_grad(graphed, True)
    assert_params_equal(eager, graphed, "end")


# --------------------------------------------------------------------------------------
# 4. zero_grad(set_to_none=True) then an allocation burst: replays never write freed memory
# --------------------------------------------------------------------------------------
def test_set_to_none_then_allocation_burst(device):
    # On CUDA too: the gradients equal eager after zero_grad(set_to_none=True) between
    # replays, and no replay writes into the burst or into a dropped gradient (whether the
    # burst lands on freed gradient memory is up to the allocator; nothing asserts it).
    eager = Net(device=device)
    graphed = copy.deepcopy(eager)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(xs, ys):
        return body(graphed, xs, ys)

    sentinel = 12345.0
    bursts: List[torch.Tensor] = []
    xs, ys = data(8, 1, device=device)
    for s in range(8):
        held = [p.grad for p in graphed.parameters()]  # the caller's gradients of the last step
        held_copy = [None if g is None else g.clone() for g in held]
        zero_grad(eager, True), zero_grad(graphed, True)
        # freed gradient memory is likely reused by these
        shapes = [p.shape for p in graphed.parameters()]
        bursts += [torch.full(shp, sentinel, device=device) for shp in shapes for _ in range(8)]
        le, _ = body(eager, xs[s], ys[s])
        lg, _ = step(xs[s], ys[s])
        assert torch.equal(lg, le), f"step {s}: loss differs"
        assert_grads_equal(eager, graphed, f"step {s}")
        for i, t in enumerate(bursts):
            assert bool((t == sentinel).all()), f"step {s}: burst tensor {i} was overwritten"
        for g, c in zip(held, held_copy):
            if g is not None:
                assert torch.equal(g, c), f"step {s}: a gradient the caller dropped was written after its release"
        sgd_step(eager), sgd_step(graphed)
    assert step.num_captures == 1


# --------------------------------------------------------------------------------------
# 5. errors
# --------------------------------------------------------------------------------------
def _small(device: str = "cpu"):
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(H, H), dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)).to(device)


def _small_body(m, x):
    loss = m(x).square().mean()
    loss.backward()
    m[1].backward_dw()
    return loss


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zero"])
def test_optimizer_step_and_zero_grad_inside_match_eager(set_to_none):
    # A whole step (forward, backward, backward_dw, clipping, SGD with momentum, zero_grad)
    # inside the graph: bitwise the eager step, parameters and optimizer state included.
    eager = _small()
    m = copy.deepcopy(eager)
    opts = [torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9) for model in (eager, m)]

    def whole(model, opt, x):
        loss = _small_body(model, x)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss

    step = dwgraph.graphed_step(lambda x: whole(m, opts[1], x), warmup_iters=1)
    for s in range(5):
        x = torch.randn(B, H)
        assert torch.equal(step(x), whole(eager, opts[0], x)), f"call {s}"
        assert_params_equal(eager, m, f"call {s}")
        assert_grads_equal(eager, m, f"call {s}")
        for pe, pg in zip(eager.parameters(), m.parameters()):
            assert torch.equal(opts[0].state[pe]["momentum_buffer"], opts[1].state[pg]["momentum_buffer"])
    assert step.num_captures == 1


def test_non_capturable_optimizer_inside_is_refused():
    # Adagrad on the CPU reads its step count on the host (.item()): its step cannot be
    # captured (Adam/AdamW and SGD can: test_graphed_step_optim.py). The message names the
    # ways out.
    m = _small()
    opt = torch.optim.Adagrad(m.parameters(), lr=1e-3)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        loss = _small_body(m, x)
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randn(B, H)
    step(x)  # warmup: eager, fine
    before = [p.detach().clone() for p in m.parameters()]
    state = {k: v.clone() for k, v in opt.state[m[0].weight].items()}
    with pytest.raises(dwgraph.GraphStateError, match=r"Adagrad\.step\(\).*cannot be captured.*fused=True"):
        step(x)
    # the refused capture changed nothing: parameters and optimizer state as before
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert all(torch.equal(state[k], v) for k, v in opt.state[m[0].weight].items())


def _captured_small(warmup: int = 1):
    m = _small()

    @dwgraph.graphed_step(warmup_iters=warmup)
    def step(x):
        return _small_body(m, x)

    x = torch.randn(B, H)
    for _ in range(warmup + 1):
        step(x)
    assert step.num_captures == 1
    m.zero_grad(set_to_none=True)
    return m, step, x


@pytest.mark.parametrize("change", ["freeze", "unfreeze", "reallocate", "replace", "load_assign"])
def test_parameter_changes_after_capture_recapture(change):
    # What the step trains changed after capture: the next call captures again (a new
    # variant or, after a registration, warmup and capture) and equals eager, bitwise.
    m = _small()
    if change == "unfreeze":
        m[0].weight.requires_grad_(False)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        return _small_body(m, x)

    x = torch.randn(B, H)
    step(x), step(x)
    assert step.num_captures == 1
    m.zero_grad(set_to_none=True)
    if change == "freeze":
        m[0].weight.requires_grad_(False)
    elif change == "unfreeze":
        m[0].weight.requires_grad_(True)
    elif change == "reallocate":
        m[1].weight.data = m[1].weight.data.clone()
    elif change == "replace":
        m[0].weight = torch.nn.Parameter(torch.randn(H, H))
    else:
        m.load_state_dict({k: v.clone() + 1 for k, v in m.state_dict().items()}, assign=True)
    eager = copy.deepcopy(m)
    for s in range(3):
        lg, le = step(x), _small_body(eager, x)
        assert torch.equal(lg, le), f"call {s} after {change}"
        assert_grads_equal(eager, m, f"call {s} after {change}")
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
    assert step.num_captures == 2


class _Scaled(torch.nn.Module):
    """A deferred Linear times a module buffer."""

    def __init__(self):
        super().__init__()
        self.lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
        self.register_buffer("scale", torch.full((H,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def _scaled_body(model, x):
    loss = model(x).square().sum()
    loss.backward()
    model.lin.backward_dw()
    return loss


def _captured_beside_eager(m):
    """An eager copy of `m` and a graphed step over `m`, called three times beside it
    (bitwise equal), the graph captured: for tests that change both models next."""
    eager = copy.deepcopy(m)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        return _scaled_body(m, x)

    for _ in range(3):  # .grad None before every call: one variant of the gradients
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
        x = torch.randn(B, H)
        assert torch.equal(step(x), _scaled_body(eager, x))
    assert step.num_captures == 1
    return eager, step


@pytest.mark.parametrize("change", ["data", "set_", "requires_grad"])
def test_a_buffer_changed_under_its_module_after_capture_recaptures(change):
    # `buffer.data = t`, `buffer.set_(t)` (the old memory still alive elsewhere, so no
    # storage dangles) and `buffer.requires_grad_()` move no module dict and no watched
    # setter: the variant state does not see them. Where the buffer's memory is and whether
    # it requires grad are part of the variant pattern (as for parameters), so the next
    # call captures again and equals eager, bitwise.
    torch.manual_seed(5)
    m = _Scaled()
    eager, step = _captured_beside_eager(m)
    kept = m.scale.detach()
    for model in (m, eager):
        if change == "data":
            model.scale.data = torch.full((H,), 3.0)
        elif change == "set_":
            with torch.no_grad():
                model.scale.set_(torch.full((H,), 3.0))
        else:
            model.scale.requires_grad_(True)
    for s in range(3):
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
        x = torch.randn(B, H)
        assert torch.equal(step(x), _scaled_body(eager, x)), f"call {s} after {change}"
        assert_grads_equal(eager, m, f"call {s} after {change}")
        ge, gg = eager.scale.grad, m.scale.grad
        assert (ge is None) == (gg is None) and (ge is None or torch.equal(ge, gg)), f"call {s}: the buffer's .grad"
        m.scale.grad = eager.scale.grad = None
    assert step.num_captures == 2
    assert torch.equal(kept, torch.full((H,), 2.0)), "the old memory was written"


class _MaybeScaled(_Scaled):
    """Scales by its buffer while it has one (as an FP8 module reads its scaling state
    while it exists), and runs its optional child while it has one."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(H, H)

    def forward(self, x):
        y = self.lin(x)
        if "scale" in self._buffers:
            y = y * self.scale
        if "extra" in self._modules:
            y = self.extra(y)
        return y


@pytest.mark.parametrize("change", ["del buffer", "pop buffer", "del child", "parameter set in its dict"])
def test_a_buffer_or_child_removed_after_capture_recaptures(change):
    # A removal registers nothing (torch's registration hooks see additions only): the
    # module's dicts are watching dicts, so it moves the state epoch and the next call sees
    # the module tree changed, runs the step's Python again and captures what eager now
    # does. Before, the step replayed the graph that read the removed buffer (a review
    # found it with reset_fp8_state(), which pops the FP8 scaling buffers).
    torch.manual_seed(6)
    m = _MaybeScaled()
    eager, step = _captured_beside_eager(m)
    new_weight = torch.randn(H, H)
    for model in (m, eager):
        if change == "del buffer":
            del model.scale
        elif change == "pop buffer":
            model._buffers.pop("scale")
        elif change == "del child":
            del model.extra
        else:  # as accelerate's set_module_tensor_to_device and NamedMemberAccessor write it
            model.extra._parameters["weight"] = torch.nn.Parameter(new_weight.clone())
    for s in range(3):
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
        x = torch.randn(B, H)
        assert torch.equal(step(x), _scaled_body(eager, x)), f"call {s} after {change}"
        assert_grads_equal(eager, m, f"call {s} after {change}")
    assert step.num_captures == 2


def test_returning_item_is_refused():
    m = _small()

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        return _small_body(m, x).item()

    with pytest.raises(dwgraph.ArgumentError, match=r"must return tensors.*float.*\.item\(\)"):
        step(torch.randn(B, H))


def test_item_during_capture_raises_graph_state_error():
    # No warmup: the first call captures, and .item() inside a capture is refused.
    m = _small()

    @dwgraph.graphed_step(warmup_iters=0, params=list(m.parameters()))
    def step(x):
        return _small_body(m, x).item()

    with pytest.raises(dwgraph.GraphStateError, match=r"\.item\(\)"):
        step(torch.randn(B, H))


def test_failed_capture_can_be_retried():
    # SPEC C7: a capture that raises leaves nothing behind and can be retried; C3: it
    # changes no caller-visible state (.grad, main_grad).
    m = torch.nn.Sequential(torch.nn.Linear(H, H),
                            dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True))
    eager = copy.deepcopy(m)
    fail = [False]

    def raw(model, x):
        loss = _small_body(model, x)
        if fail[0]:
            raise ValueError("boom inside the step")
        return loss

    step = dwgraph.graphed_step(lambda x: raw(m, x), warmup_iters=1)
    xs = torch.randn(4, B, H)
    assert torch.equal(step(xs[0]), raw(eager, xs[0]))  # warmup
    grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    main = m[1].weight.main_grad.clone()
    fail[0] = True
    with pytest.raises(ValueError, match="boom"):
        step(xs[1])  # the capture call
    fail[0] = False
    assert step.num_captures == 0
    with_grad = [p for p in m.parameters() if p.grad is not None]
    assert len(with_grad) == len(grads), "a failed capture changed which parameters have a .grad"
    for g, p in zip(grads, with_grad):
        assert torch.equal(p.grad, g), "a failed capture changed a caller .grad"
    assert torch.equal(m[1].weight.main_grad, main), "a failed capture changed main_grad"
    assert torch.ones(3).sum().item() == 3.0  # no capture mode left behind
    for s in range(1, 4):
        lg, le = step(xs[s]), raw(eager, xs[s])
        assert torch.equal(lg, le), f"call {s} after the failed capture"
        assert_grads_equal(eager, m, f"call {s} after the failed capture")
    assert step.num_captures == 1


@pytest.mark.parametrize("how", ["reassigned", "data"])
def test_main_grad_reallocated_since_capture_raises(how):
    # SPEC C4/C7: main_grad must be the storage captured. `param.main_grad = t` and
    # `main_grad.data = t` (the same tensor object, new memory) both move the state epoch
    # (Note [A step's checks paid when state changes]: a watched step checks main_grad only
    # then), so the next replay refuses before writing.
    m = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True))

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        loss = m(x).square().mean()
        loss.backward()
        m[0].backward_dw()
        return loss

    x = torch.randn(B, H)
    step(x), step(x), step(x)
    assert step._native.watched, "every tensor of this step can be watched"
    old = m[0].weight.main_grad.data
    old_copy = old.clone()
    if how == "reassigned":
        m[0].weight.main_grad = torch.zeros_like(old)
    else:
        m[0].weight.main_grad.data = torch.zeros_like(old)
    with pytest.raises(dwgraph.GraphStateError, match=r"main_grad"):
        step(x)
    assert torch.equal(old, old_copy), "the replay wrote into the main_grad's old memory"


@pytest.mark.parametrize("order", ["none,set,none", "set,none,set", "half"])
def test_which_gradients_exist_selects_the_variant_at_every_call(order):
    # No watch sees a .grad appear or go (zero_grad, an eager backward outside the step): a
    # watched step still compares which gradients exist at every call. Each pattern gets its
    # own graph; every call equals eager, bitwise, gradients included.
    torch.manual_seed(4)
    m = _small()
    eager = copy.deepcopy(m)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        return _small_body(m, x)

    def prepare(model, kind):
        for i, p in enumerate(model.parameters()):
            if kind == "none" or (kind == "half" and i % 2):
                p.grad = None
            elif p.grad is None:
                p.grad = torch.full_like(p, 0.25)

    kinds = order.split(",") if order != "half" else ["none", "half", "none", "half", "set"]
    for rnd in range(2):
        for k, kind in enumerate(kinds * 2):
            prepare(m, kind), prepare(eager, kind)
            x = torch.randn(B, H)
            assert torch.equal(step(x), _small_body(eager, x)), f"round {rnd} call {k} ({kind})"
            assert_grads_equal(eager, m, f"round {rnd} call {k} ({kind})")
    assert step._native.watched
    assert step.num_captures == len(set(kinds))


@pytest.mark.cuda
@pytest.mark.skipif(not dwgraph.cuda_available(), reason="no CUDA device")
def test_cpu_argument_to_cuda_step_raises():
    m = _small().cuda()

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        return _small_body(m, x)

    x = torch.randn(B, H, device="cuda")
    step(x), step(x)
    with pytest.raises(dwgraph.ArgumentError, match="is on cpu but the step runs on cuda"):
        step(x.cpu())


# --------------------------------------------------------------------------------------
# 6. wgrad hooks: once per step, after the gradients landed
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [True, False], ids=["deferred", "non_deferred"])
def test_wgrad_hooks_once_per_step(device, delay):
    def build():
        torch.manual_seed(3)
        return torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=delay, device=device),
                                   dwgraph.nn.LayerNormMLP(H, FFN, delay_wgrad_compute=delay, device=device))

    eager = build()
    graphed = build()
    logs: Dict[str, List] = {"eager": [], "graphed": []}

    def hook_for(log):
        def hook(mod):
            names = [n for n, _ in mod.named_parameters() if not n.startswith("layer_norm")]
            log.append((type(mod).__name__, {n: None if getattr(mod, n).grad is None else getattr(mod, n).grad.clone()
                                             for n in names}))
        return hook

    for model, key in ((eager, "eager"), (graphed, "graphed")):
        for mod in model:
            mod.register_wgrad_hook(hook_for(logs[key]))

    def raw(model, x):
        loss = model(x).square().mean()
        loss.backward()
        for mod in model:
            if delay:
                mod.backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x: raw(graphed, x), warmup_iters=2)
    xs = per_step(torch.randn(7, B, H), device)
    for s in range(len(xs)):
        ne, ng = len(logs["eager"]), len(logs["graphed"])
        le = raw(eager, xs[s])
        lg = step(xs[s])
        assert torch.equal(lg, le)
        for key, model, n in (("eager", eager, ne), ("graphed", graphed, ng)):
            new = logs[key][n:]
            assert sorted(name for name, _ in new) == ["LayerNormMLP", "Linear"], (
                f"step {s} ({key}): hooks ran {[name for name, _ in new]}, expected each module once")
            for (name, seen), mod in zip(sorted(new, key=lambda e: e[0] != "Linear"), model):
                for pname, g in seen.items():
                    final = getattr(mod, pname).grad
                    assert g is not None, f"step {s} ({key}): {name} hook ran before {pname}'s gradient landed"
                    assert torch.equal(g, final), f"step {s} ({key}): {name} hook saw {pname}.grad != final"
        assert_grads_equal(eager, graphed, f"step {s}")
        for model in (eager, graphed):
            for p in model.parameters():
                p.grad = None


# --------------------------------------------------------------------------------------
# 7. fused main_grad
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("te", [False, True], ids=["linear-mlp", "lnlinear-mlp_ckpt"])
@pytest.mark.parametrize("delay", [True, False], ids=["deferred", "non_deferred"])
def test_fused_main_grad_accumulates_like_eager(device, delay, te):
    eager = Net(delay=delay, fuse=True, device=device, te=te)
    graphed = copy.deepcopy(eager)
    fused_e, fused_g = eager.fused_weights(), graphed.fused_weights()
    assert len(fused_g) == 3  # lin.weight, mlp.fc1_weight, mlp.fc2_weight
    buffers = [p.main_grad for p in fused_g]
    for pe, pg in zip(fused_e, fused_g):
        assert pe.main_grad.data_ptr() != pg.main_grad.data_ptr()

    @dwgraph.graphed_step(warmup_iters=2)
    def step(xs, ys):
        return body(graphed, xs, ys)

    xs, ys = data(STEPS, 1, device=device)
    for s in range(STEPS):
        for p in fused_e + fused_g:
            p.grad_added_to_main_grad = False
        le, _ = body(eager, xs[s], ys[s])
        lg, _ = step(xs[s], ys[s])
        assert torch.equal(lg, le), f"step {s}: loss differs"
        assert_grads_equal(eager, graphed, f"step {s}")  # includes main_grad
        for p in fused_g:
            assert p.grad_added_to_main_grad is True, f"step {s}: grad_added_to_main_grad not set"
            assert p.grad is None, f"step {s}: a fused weight got a .grad"
            assert bool(p.main_grad.abs().sum() > 0)
        assert all(p.main_grad is b for p, b in zip(fused_g, buffers))
        sgd_step(eager), sgd_step(graphed)
        assert_params_equal(eager, graphed, f"step {s}")
        zero_grad(eager, True), zero_grad(graphed, True)
        if s % 3 == 2:  # main_grad accumulates over 3 steps, then the caller zeroes it in place
            for p in fused_e + fused_g:
                p.main_grad.zero_()
    assert step.num_captures == 1


# --------------------------------------------------------------------------------------
# 8. returned tensors: fresh tensors the caller owns, never overwritten by later calls
# --------------------------------------------------------------------------------------
def test_returned_tensors_are_fresh_across_keys(device):
    torch.manual_seed(5)
    lin = torch.nn.Linear(H, H).to(device)
    fan = torch.randn(H, H).to(device)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        out = lin(x)
        loss = out.square().mean()
        loss.backward()
        big = out.detach() @ fan
        return loss, big[:4].contiguous(), big

    kept = []
    for s in range(8):
        rows = (CLONE_LIMIT // H + 1) if s % 2 == 0 else (CLONE_LIMIT // H + 3)  # two keys, both large
        x = torch.randn(rows, H).to(device)
        loss, small, big = step(x)
        ref_big = torch.nn.functional.linear(x, lin.weight, lin.bias) @ fan
        assert torch.equal(big, ref_big) and torch.equal(small, ref_big[:4])
        kept.append((loss, small, big, loss.clone(), small.clone(), big.clone()))
        lin.zero_grad(set_to_none=True)
    for s, (loss, small, big, loss0, small0, big0) in enumerate(kept):
        assert torch.equal(loss, loss0) and torch.equal(small, small0) and torch.equal(big, big0), \
            f"call {s}: a returned tensor changed after later calls"
    assert len({k[2].data_ptr() for k in kept}) == len(kept)


# --------------------------------------------------------------------------------------
# warmup_iters=0 without params=: the parameters must still be found
# --------------------------------------------------------------------------------------
def test_warmup_zero_without_params(device):
    eager = _small(device)
    m = copy.deepcopy(eager)

    @dwgraph.graphed_step(warmup_iters=0)
    def step(x):
        return _small_body(m, x)

    xs = per_step(torch.randn(4, B, H), device)
    grads_seen = []
    for s in range(4):
        lg, le = step(xs[s]), _small_body(eager, xs[s])
        assert torch.equal(lg, le)
        assert_grads_equal(eager, m, f"call {s}")
        grads_seen.append([(p.grad, p.grad.clone()) for p in m.parameters()])
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
    for s, held in enumerate(grads_seen):
        for g, c in held:
            assert torch.equal(g, c), f"the .grad handed over at call {s} was overwritten by a later replay"


# --------------------------------------------------------------------------------------
# a dropped step is freed (Note [A graphed step holds itself weakly], dwgraph/step.py)
# --------------------------------------------------------------------------------------
def _whole_step(model: Net, opt, xs, ys):
    loss, out = body(model, xs, ys)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, out


def _graphed_whole_step(model: Net, opt):
    # Its own scope: `del` of the test's names cannot empty the cells the step's function
    # holds, so only the step itself keeps model and optimizer alive.
    return dwgraph.graphed_step(lambda xs, ys: _whole_step(model, opt, xs, ys), warmup_iters=1)


def test_a_dropped_graphed_step_is_freed(device):
    # The step gave the C++ core its bound methods, which held the step (and through its
    # function the model and the optimizer) from C++, where the garbage collector cannot
    # see the cycle: a dropped step, its graphs and its pool were never freed.
    import gc
    import weakref

    eager = Net(device=device)
    graphed = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=LR, momentum=0.9)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=LR, momentum=0.9)
    step = _graphed_whole_step(graphed, opt_g)
    xs, ys = data(5, 1, device=device)
    for s in range(5):
        gc.collect()  # a live step's functions in the core still reach it
        lg, og = step(xs[s], ys[s])
        le, oe = _whole_step(eager, opt_e, xs[s], ys[s])
        assert torch.equal(lg, le) and torch.equal(og, oe), f"call {s}"
        assert_params_equal(eager, graphed, f"call {s}")
        assert_grads_equal(eager, graphed, f"call {s}")
    assert step.num_captures == 1 and step.num_graphs == 1  # captured at call 1, replayed at 2..4
    alive = [weakref.ref(o) for o in (step, graphed, opt_g, graphed.lin)]
    del step, graphed, opt_g, lg, og
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive), "a dropped graphed step (or what it trained) lives on"


# --------------------------------------------------------------------------------------
# container arguments: the caller's own objects on eager calls
# --------------------------------------------------------------------------------------
def test_container_arguments_are_the_callers_own_on_eager_calls():
    # Eager (warmup) calls got copies of list, dict and object arguments, rebuilt around
    # the tensors: an append inside the step never reached the caller. A capture runs the
    # step on copies around the static inputs, and a replay runs no Python, so a step that
    # changes an argument's structure is refused at its capture, before anything is written.
    import types

    eager = _small()
    m = copy.deepcopy(eager)
    ids = []

    def logged(model, x, log, stats, batch):
        ids.append((id(log), id(stats), id(batch)))
        loss = _small_body(model, x)
        log.append(loss.detach())
        stats["last"] = loss.detach()
        batch.seen = True
        return loss

    step = dwgraph.graphed_step(lambda x, log, stats, batch: logged(m, x, log, stats, batch), warmup_iters=2)
    log_g, stats_g, batch_g = [], {}, types.SimpleNamespace(tag="b")
    for s in range(2):
        x = torch.randn(B, H)
        le = logged(eager, x, [], {}, types.SimpleNamespace(tag="b"))
        lg = step(x, log_g, stats_g, batch_g)
        assert torch.equal(lg, le), f"warmup call {s}"
        assert ids[-1] == (id(log_g), id(stats_g), id(batch_g)), f"warmup call {s} ran on copies of the arguments"
        assert len(log_g) == 1 and torch.equal(log_g[0], le) and torch.equal(stats_g["last"], le), f"call {s}"
        assert batch_g.seen is True
        assert_grads_equal(eager, m, f"warmup call {s}")
        log_g.clear(), stats_g.clear()  # the same key again next call
        del batch_g.seen
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(dwgraph.GraphStateError, match=r"changed its argument args\[1\]"):
        step(torch.randn(B, H), log_g, stats_g, batch_g)
    assert log_g == [] and stats_g == {} and not hasattr(batch_g, "seen"), "the refused capture changed an argument"
    assert all(p.grad is None for p in m.parameters()), "the refused capture wrote a gradient"
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert step.num_graphs == 0


def test_container_arguments_a_step_only_reads_replay_like_eager():
    # Lists, dicts and objects whose structure the step leaves alone are graphed as usual
    # (the tensors in them are static inputs), and in-place writes into their tensors reach
    # the caller's tensors at every call, replays included.
    import types

    eager = _small()
    m = copy.deepcopy(eager)

    def reads(model, batch, extra):
        loss = _small_body(model, batch.x)
        extra["seen"].add_(1)
        return loss

    step = dwgraph.graphed_step(lambda batch, extra: reads(m, batch, extra), warmup_iters=1)
    seen_g, seen_e = torch.zeros(()), torch.zeros(())
    for s in range(4):
        x = torch.randn(B, H)
        lg = step(types.SimpleNamespace(x=x), {"seen": seen_g})
        le = reads(eager, types.SimpleNamespace(x=x), {"seen": seen_e})
        assert torch.equal(lg, le), f"call {s}"
        assert torch.equal(seen_g, seen_e) and seen_g.item() == s + 1, f"call {s}"
        assert_grads_equal(eager, m, f"call {s}")
        m.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
    assert step.num_captures == 1


# --------------------------------------------------------------------------------------
# around torch.compile (inductor): Note [A step around compiled code], dwgraph/step.py
# --------------------------------------------------------------------------------------
def _compiled_twins(device, kind):
    def mk():
        torch.manual_seed(0)
        if kind == "torch":  # one graph, fused by inductor
            return torch.nn.Sequential(torch.nn.Linear(H, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                       torch.nn.Linear(32, 4)).to(device)
        # dwgraph.nn's deferred forwards are compiler-disabled: dynamo breaks the graph in
        # Sequential's loop and runs it eagerly, compiling none of it (the step's watching
        # code there must not become compiled frames of its own)
        return torch.nn.Sequential(dwgraph.nn.Linear(H, 32, delay_wgrad_compute=True), torch.nn.GELU(),
                                   torch.nn.LayerNorm(32),
                                   dwgraph.nn.Linear(32, 4, delay_wgrad_compute=True)).to(device)

    return mk(), mk(), mk()


def _compiled_body(model, x, deferred=()):
    loss = model(x).square().mean()
    loss.backward()
    for m in deferred:
        m.backward_dw()
    return loss


def _grads_of(model):
    return [p.grad.clone() for p in model.parameters()]


def _within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int) -> bool:
    """|a - b| <= ulps FP32 epsilons of b's largest magnitude, everywhere."""
    return bool((a - b).abs().max() <= ulps * torch.finfo(torch.float32).eps * b.abs().max())


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.parametrize("kind", ["torch", "dwgraph"])
def test_step_around_an_inductor_compiled_model(device, kind):
    # The step's watching mode and module hook were dynamo-disabled: under them dynamo
    # broke the compiled graph at every op, so inductor fused nothing and even the eager
    # warmup calls differed from the undecorated compiled step at rounding level. Now
    # they are traced as nothing, and never compiled as frames of their own where the
    # compiled model runs eagerly. The warmup calls (more than dynamo's recompile limit:
    # the hook's key is fixed, so nothing recompiles per call) equal the compiled twin
    # bitwise. A CUDA graph captures inductor's kernels, so replays equal it too; the host
    # graph records ATen kernels and inductor's CPU kernels are not ATen kernels, so on the
    # CPU the capture runs the compiled code's own Python: replays equal the uncompiled
    # twin bitwise, and differ from the compiled one by inductor's rounding.
    torch._dynamo.reset()
    m, twin, plain = _compiled_twins(device, kind)
    compiled, twin_compiled = torch.compile(m), torch.compile(twin)
    deferred = (lambda model: (model[0], model[3])) if kind == "dwgraph" else (lambda model: ())
    warmup = 10
    step = dwgraph.graphed_step(lambda x: _compiled_body(compiled, x, deferred(m)), warmup_iters=warmup)
    xs = per_step(torch.randn(warmup + 4, B, H), device)
    fused_differs = False
    for s in range(warmup + 4):
        lg = step(xs[s])
        gg = _grads_of(m)
        lc, gc_ = _compiled_body(twin_compiled, xs[s], deferred(twin)), _grads_of(twin)
        lu, gu = _compiled_body(plain, xs[s], deferred(plain)), _grads_of(plain)
        fused_differs |= not (torch.equal(lc, lu) and all(torch.equal(a, b) for a, b in zip(gc_, gu)))
        exact = (lc, gc_) if s < warmup or device == "cuda" else (lu, gu)
        what = f"call {s} ({'warmup' if s < warmup else 'capture' if s == warmup else 'replay'})"
        assert torch.equal(lg, exact[0]), f"{what}: loss differs"
        assert all(torch.equal(a, b) for a, b in zip(gg, exact[1])), f"{what}: a gradient differs"
        # The bound between the two: FP32 rounding of inductor's fused, reordered
        # reductions, a few ulps of each tensor's magnitude (3 and 5 on this model).
        assert _within_ulps(lg, lc, 16), f"{what}: loss beyond 16 ulps of the compiled step's"
        assert all(_within_ulps(a, b, 16) for a, b in zip(gg, gc_)), f"{what}: a gradient beyond 16 ulps"
        for model in (m, twin, plain):
            model.zero_grad(set_to_none=True)
    assert step.num_captures == 1
    if kind == "torch":
        # Inductor's fusion changed bits on some call: the test tells a compiled step from
        # an uncompiled (graph-broken) one.
        assert fused_differs, "inductor gave the uncompiled bits on every call; the test no longer tells them apart"


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("repeat", [False, True], ids=["distinct", "one_tensor_twice"])
def test_the_tensor_tuple_fast_path_gives_the_general_key_and_rebuild(n, repeat):
    from dwgraph import step as step_module

    xs = tuple(torch.randn(2) for _ in range(n))
    if repeat:
        xs = xs + xs[:1]
    found, general = [], []
    key, rebuild = step_module._flatten(xs, found, "args")
    key2, rebuild2 = step_module._flatten_node(xs, step_module._CONTAINERS[tuple], general, "args")
    assert key == key2 and [id(t) for t in found] == [id(t) for t in general]
    ts = [torch.randn(1) for _ in found]
    a, b = rebuild(ts), rebuild2(ts)
    assert type(a) is tuple and len(a) == len(b) and all(p is q for p, q in zip(a, b))
    # A Parameter or another tensor type takes the general path (the same key either way).
    mixed = (xs[0], torch.nn.Parameter(torch.randn(2)))
    general_mixed = step_module._flatten_node(mixed, step_module._CONTAINERS[tuple], [], "args")[0]
    assert step_module._flatten(mixed, [], "args")[0] == general_mixed


def test_calls_past_max_captures_run_eagerly_as_the_undecorated_step():
    # Past the limit a call that would capture runs eagerly, after the core asked what the
    # step trains: the front end must run it as an eager call (it once took it for a
    # capture and refused a step that changes its own learning rate, which eager runs).
    def make():
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        o = torch.optim.SGD(m.parameters(), lr=0.1)

        def body(x):
            loss = m(x).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            o.param_groups[0]["lr"] *= 0.5
            return loss

        return m, body

    (me, eager), (mg, body) = make(), make()
    step = dwgraph.graphed_step(body, max_captures=0)
    x = torch.randn(3, 4)
    for _ in range(6):
        assert torch.equal(eager(x), step(x))
    assert step.num_captures == 0 and step.stats()["capture_limited_calls"] == 3
    for p, q in zip(me.parameters(), mg.parameters()):
        assert torch.equal(p, q)



def _sgd_body(model, opt, x):
    opt.zero_grad(set_to_none=False)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


class _RunningMean(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = torch.nn.Linear(H, 1)
        self.register_buffer("running", torch.zeros(H))

    def forward(self, x):
        if self.how == "assign":
            self.running = 0.9 * self.running + 0.1 * x.mean(0).detach()
        elif self.how == "iadd":
            self.running += 0.1 * x.mean(0).detach()
        else:
            self.running.mul_(0.9).add_(0.1 * x.mean(0).detach())
        return self.lin(x - self.running)


@pytest.mark.parametrize("how", ["assign", "iadd", "in_place"])
def test_a_buffer_given_another_tensor_by_the_step_is_refused_at_capture(how):
    # Eagerly `self.running = 0.9 * self.running + ...` makes a new tensor at every call; a
    # replay would read the tensor the capture met and write the one it made, so the buffer
    # would stop moving (a review found loss, buffer and parameters silently apart from the
    # first replay on). Refused at capture, the module holding what it held; updated in
    # place (`+=`, mul_/add_) it is exact.
    m = _RunningMean(how)
    eager = copy.deepcopy(m)
    om, oe = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)

    step = dwgraph.graphed_step(warmup_iters=1)(lambda x: _sgd_body(m, om, x))
    x = torch.randn(B, H)
    assert torch.equal(step(x), _sgd_body(eager, oe, x))  # the warmup call, eager
    if how == "assign":
        held = m.running
        with pytest.raises(dwgraph.GraphStateError, match="buffer 'running' another tensor.*in place"):
            step(torch.randn(B, H))
        assert m.running is held and torch.equal(m.running, eager.running)
        return
    for _ in range(4):
        x = torch.randn(B, H)
        assert torch.equal(step(x), _sgd_body(eager, oe, x))
        assert torch.equal(m.running, eager.running)
    assert step.num_captures == 1


def test_a_weight_tied_again_at_every_call_is_captured_once():
    # Registering the same object again displaces nothing: the step used to take the tied
    # weight as replaced at every call, drop its graphs and run eagerly for good, silently.
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = torch.nn.Linear(H, H, bias=False)
            self.dec = torch.nn.Linear(H, H, bias=False)
            self.dec.weight = self.enc.weight

        def forward(self, x):
            self.dec.weight = self.enc.weight
            return self.dec(torch.tanh(self.enc(x)))

    m = Tied()
    eager = copy.deepcopy(m)
    om, oe = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)

    step = dwgraph.graphed_step(warmup_iters=1)(lambda x: _sgd_body(m, om, x))
    for _ in range(6):
        x = torch.randn(B, H)
        assert torch.equal(step(x), _sgd_body(eager, oe, x))
    assert step.num_captures == 1 and step.stats()["replays"] == 5  # the capture replays too


@pytest.mark.parametrize("bad", [dict(warmup_iters="2"), dict(warmup_iters=2.9), dict(warmup_iters=True),
                                 dict(warmup_iters=None), dict(warmup_iters=-3), dict(max_graphs="8"),
                                 dict(max_captures=True), dict(max_graphs=0)],
                         ids=lambda bad: f"{next(iter(bad))}={next(iter(bad.values()))!r}")
def test_a_count_of_another_type_or_out_of_range_is_refused_naming_it(bad):
    # A review found "2" and 2.9 read as 2, True as 1, -3 raised to 1 unseen, and None or
    # "8" reaching int()'s TypeError: each is an ArgumentError naming the argument.
    name = next(iter(bad))
    with pytest.raises(dwgraph.ArgumentError, match=f"argument '{name}' must be"):
        dwgraph.graphed_step(lambda x: x * 2, **bad)


def test_an_abandoned_capture_puts_back_a_buffer_the_step_rebinds():
    # With params= and warmup_iters=0 the first capture is abandoned and retried (it meets
    # the optimizer); the retry's snapshot held the abandoned attempt's buffer, so the
    # refusal left the module's buffer moved on (a review found it).
    m = _RunningMean("assign")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    held, value = m.running, m.running.clone()
    step = dwgraph.graphed_step(warmup_iters=0, params=list(m.parameters()))(lambda x: _sgd_body(m, opt, x))
    with pytest.raises(dwgraph.GraphStateError, match="buffer 'running' another tensor"):
        step(torch.randn(B, H))
    assert m.running is held and torch.equal(m.running, value)
