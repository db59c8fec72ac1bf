"""What the C++ core decides once for both entry points (issue "one source of truth"):

  * the landing order: hand-off, then ``grad_added_to_main_grad``, then the wgrad hooks,
    as eager modules do it, for ``make_graphed_callables`` and ``graphed_step`` alike;
  * errors keep their dwgraph type wherever they surface, inside ``loss.backward()`` too;
  * the one ``order`` parser (typed errors naming the entry, no overflow) and slot layout;
  * the typed spec classes (a misspelt field is an error, never a silent default);
  * deferred units queued from autograd's device thread (CUDA) land exactly.
"""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch

import dwgraph
from dwgraph import _C

H = 8
B = 4


# ----------------------------------------------------------------------------- landing order
def _fused_model(delay: bool, device: str = "cpu"):
    torch.manual_seed(3)
    return torch.nn.Sequential(
        dwgraph.nn.Linear(H, H, delay_wgrad_compute=delay, fuse_wgrad_accumulation=True, device=device),
        torch.nn.ReLU(),
        dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=delay, fuse_wgrad_accumulation=True, device=device))


def _watch_flags(model, log):
    """Megatron-style hooks: record what each hook sees of grad_added_to_main_grad."""
    for i, m in enumerate(model):
        if isinstance(m, dwgraph.nn._DeferredWgradModule):
            m.register_wgrad_hook(lambda mod, i=i: log.append(
                (i, tuple(getattr(p, "grad_added_to_main_grad", None) for _, p in mod._fused_parameters()))))


def _reset_flags(model):
    for m in model:
        if isinstance(m, dwgraph.nn._DeferredWgradModule):
            for _, p in m._fused_parameters():
                p.grad_added_to_main_grad = False  # as Megatron's zero_grad_buffer does


@pytest.mark.parametrize("delay", [True, False], ids=["deferred", "not_deferred"])
@pytest.mark.parametrize("entry", ["callables", "step"])
def test_hooks_see_main_grad_flag_as_eager(device, entry, delay):
    eager = _fused_model(delay, device)
    graphed = copy.deepcopy(eager)
    log_e, log_g = [], []
    if entry == "callables":
        x0 = torch.randn(B, H, device=device)
        g = dwgraph.make_graphed_callables(graphed, (x0,))
    else:
        def body(model, x):
            model(x).square().sum().backward()
            for m in model:
                if getattr(m, "delay_wgrad_compute", False):
                    m.backward_dw()

        g = dwgraph.graphed_step(lambda x: body(graphed, x), warmup_iters=1)
    _watch_flags(eager, log_e)
    _watch_flags(graphed, log_g)
    for step in range(4):
        _reset_flags(eager), _reset_flags(graphed)
        x = torch.randn(B, H, device=device)
        eager(x).square().sum().backward()
        if delay:
            eager[0].backward_dw(), eager[2].backward_dw()
        if entry == "callables":
            g(x).square().sum().backward()
            if delay:
                g.backward_dw()  # the graphed Sequential's: both modules' backward-dw graph
        else:
            g(x)
        assert sorted(log_g) == sorted(log_e), f"step {step}: hooks saw {log_g}, eager {log_e}"
        assert all(flags == (True,) * len(flags) for _, flags in log_e)
        for pe, pg in zip(eager.parameters(), graphed.parameters()):
            if hasattr(pe, "main_grad"):
                assert torch.equal(pe.main_grad, pg.main_grad)
        log_e.clear(), log_g.clear()


# ----------------------------------------------------------------------------- error types
def test_errors_keep_their_type_inside_backward_after_reset():
    lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    g = dwgraph.make_graphed_callables(lin, (torch.randn(B, H, requires_grad=True),))
    y = g(torch.randn(B, H, requires_grad=True))
    dwgraph.graphed_handle(g).reset()
    with pytest.raises(dwgraph.GraphStateError, match=r"after reset\(\)"):
        y.sum().backward()


class _Scaled(torch.nn.Module):
    """Multiplies by a tensor held outside the module (neither input nor parameter nor
    buffer): the graphs borrow it, and its release is a dangling capture."""

    def __init__(self, holder):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)
        self.holder = holder

    def forward(self, x):
        return self.lin(x) * self.holder["c"]


def test_dangling_saved_tensor_raises_inside_backward(device):
    # On CUDA the backward graph replays on autograd's device thread: the error must still
    # surface as DanglingCaptureError from loss.backward(), having run nothing.
    holder = {"c": torch.randn(B, H, device=device)}
    m = _Scaled(holder).to(device)
    g = dwgraph.make_graphed_callables(m, (torch.randn(B, H, device=device, requires_grad=True),))
    x = torch.randn(B, H, device=device, requires_grad=True)
    y = g(x)
    holder["c"] = None
    gc.collect()
    with pytest.raises(dwgraph.DanglingCaptureError, match=r"released"):
        y.sum().backward()
    assert m.lin.weight.grad is None and x.grad is None


def test_capture_refusal_keeps_its_type():
    class Item(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(H, H)

        def forward(self, x):
            y = self.lin(x)
            return y * float(y.sum().item() > 0)

    with pytest.raises(dwgraph.GraphStateError, match=r"aten::_local_scalar_dense|aten::item|Tensor\.item\(\)"):
        dwgraph.make_graphed_callables(Item(), (torch.randn(B, H),), num_warmup_iters=0)


# ----------------------------------------------------------------------------- order parsing
@pytest.mark.parametrize("bad, says", [
    ([1, -1, True], "entry 2 must be a number, got a bool"),
    ([1, -1, "2"], "entry 2 must be a number, got str"),
    ([1, -1, 10 ** 30], "entry 2 .* out of range"),
    ([1, -1, 1e19], r"entry 2 \(1e\+19\)"),
    ([1, -1, 1e9], r"entry 2"),
    ([1, float("nan"), -1], "entry 1"),
    ([1, 1.25, -1], r"entry 1 \(1.25\) must be an integer"),
    ([1, -1.5, -1], "backward-dw 1 of chunk 1 but only 0 backwards"),
])
def test_bad_order_entries_are_typed_errors(bad, says):
    m = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    with pytest.raises(dwgraph.ArgumentError, match=says):
        dwgraph.make_graphed_callables((m,), ((torch.randn(B, H),),), order=bad)


def test_order_aliases_and_layout_come_from_the_core():
    mods = (dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.Linear(H, H),
            dwgraph.nn.Linear(H, H, delay_wgrad_compute=True))
    order = [1, 2, -2, -2.5, 1, 2, -2, -2.5, -1, -1.5, -1, -1.5]
    sched = _C.graphs.Schedule.pipeline(order, [1, 2], 3)
    assert [sched.callable_of_slot(s) for s in range(sched.num_slots)] == [0, 0, 1, 2, 1, 2]
    samples = tuple((torch.randn(B, H, requires_grad=s > 1),) for s in range(6))
    slots = dwgraph.make_graphed_callables(mods, samples, _order=order, _num_layers_per_chunk=[1, 2])
    assert [s.module for s in slots] == [mods[0], mods[0], mods[1], mods[2], mods[1], mods[2]]
    with pytest.raises(dwgraph.ArgumentError, match="not both"):
        dwgraph.make_graphed_callables(mods, samples, order=order, _order=order)


def test_spec_classes_refuse_unknown_fields():
    spec = _C.graphs.GraphableCallable()
    with pytest.raises(AttributeError):
        spec.forwrd = lambda t: t
    with pytest.raises(AttributeError):
        _C.graphs.ModuleSpec().deffered = []


def test_one_classifier_for_parameters():
    # The rule every front end asks (C++ ops/param_roles.h).
    c = _C.nn.classify_parameter
    assert c("weight", True, False) == "deferred" and c("weight3", True, True) == "fused"
    assert c("fc1_weight", False, True) == "fused" and c("fc2_bias", True, True) == "deferred"
    assert c("layer_norm_weight", True, True) == "main backward" and c("bias", False, True) == "main backward"
    mlp = dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    assert [n for n, _ in mlp._fused_parameters()] == ["fc1_weight", "fc2_weight"]
    assert [n for n, _ in mlp._deferred_parameters()] == ["fc1_bias", "fc2_bias"]


# ----------------------------------------------------------------------------- device thread
@pytest.mark.cuda
@pytest.mark.skipif(not dwgraph.cuda_available(), reason="no CUDA device")
def test_units_queued_on_the_device_thread_land_exactly():
    # Autograd runs CUDA backward on its device thread: the unit is queued there, the
    # backward_dw() of the main thread lands it, exactly as torch.nn.Linear's gradient.
    torch.manual_seed(11)
    lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True, device="cuda")
    ref = torch.nn.Linear(H, H, device="cuda")
    with torch.no_grad():
        ref.weight.copy_(lin.weight), ref.bias.copy_(lin.bias)
    threads = []
    x = torch.randn(B, H, device="cuda", requires_grad=True)
    y = lin(x)
    y.register_hook(lambda g: threads.append(threading.get_ident()))
    y.square().sum().backward()
    assert threads and threads[0] != threading.get_ident(), "the backward did not run on the device thread"
    assert lin.num_queued_wgrad_units() == 1
    lin.backward_dw()
    ref(x.detach()).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-6, atol=1e-6)
    # Graphed: the backward graph's kernels come from the device thread on the capture stream.
    eager = copy.deepcopy(lin)
    g = dwgraph.make_graphed_callables(lin, (torch.randn(B, H, device="cuda", requires_grad=True),))
    for _ in range(3):
        lin.zero_grad(set_to_none=True), eager.zero_grad(set_to_none=True)
        x = torch.randn(B, H, device="cuda")
        g(x).square().sum().backward()
        g.backward_dw()
        eager(x).square().sum().backward()
        eager.backward_dw()
        assert torch.equal(lin.weight.grad, eager.weight.grad) and torch.equal(lin.bias.grad, eager.bias.grad)
