"""Activation checkpointing inside graphs, against the same modules run eagerly (SPEC C8).

torch.utils.checkpoint(use_reentrant=False) recomputes its function at backward and, with
early stop (torch's default), ends the recomputation by raising out of the last call whose
output the backward saves, after that call's kernel ran. The host graph records a call when
it returns, so that kernel was missing from the replay and the backward read the capture's
values: silently wrong input and weight gradients (up to several units off). Now the
checkpoints a capture makes recompute whole (Note [Checkpoints recompute whole in a host
capture], dwgraph/graphs.py), and a call that raised inside a region that went on is
refused (Note [A call that raised], graphs/recorder.cpp).

Every case compares a replay with eager autograd on the same weights and new inputs,
bitwise, over several calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import dwgraph
from dwgraph.graphs import Graph

B, H = 3, 6


def _body(kind: str, layer: torch.nn.Module):
    """The checkpointed function; each ends in a call whose output its backward reads."""
    if kind == "tanh":
        return lambda u: torch.tanh(layer(u))
    if kind == "sigmoid_exp":
        return lambda u: torch.sigmoid(layer(u)).exp()
    if kind == "relu":
        return lambda u: torch.relu(layer(u))
    if kind == "softmax":
        return lambda u: torch.softmax(layer(u), dim=-1)
    if kind == "gelu_tail":  # the last saving call is followed by calls nothing saves
        return lambda u: (torch.nn.functional.gelu(layer(u)) * 2.0 + 1.0).sum(-1, keepdim=True)
    raise AssertionError(kind)


KINDS = ["tanh", "sigmoid_exp", "relu", "softmax", "gelu_tail"]


def _layer(deferred: bool) -> torch.nn.Module:
    torch.manual_seed(5)
    if deferred:
        return dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    return torch.nn.Linear(H, H)


def _grads(layer, x):
    return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def _assert_equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: gradient {i} differs by {(a - b).abs().max().item():.3g}"


def _eager_grads(layer, fn_of, x_value, reentrant):
    """Eager autograd (with torch's default checkpoint settings) on a copy of the layer."""
    e = copy.deepcopy(layer)
    x = x_value.clone().requires_grad_(True)
    y = checkpoint(fn_of(e), x, use_reentrant=reentrant)
    y.square().sum().backward()
    if getattr(e, "delay_wgrad_compute", False):
        e.backward_dw()
    return _grads(e, x)


def _zero(layer, x):
    x.grad = None
    for p in layer.parameters():
        p.grad = None


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("deferred", [False, True], ids=["torch_linear", "deferred_linear"])
@pytest.mark.parametrize("kind", KINDS)
def test_graph_capture_of_a_checkpoint_replays_eager_gradients(kind, deferred, reentrant):
    layer = _layer(deferred)
    x = torch.randn(B, H, requires_grad=True)
    g = Graph("cpu")
    with g.capture():
        y = checkpoint(_body(kind, layer), x, use_reentrant=reentrant)
        y.square().sum().backward()
        if deferred:
            layer.backward_dw()
    for call in range(3):
        new = torch.randn(B, H)
        with torch.no_grad():
            x.copy_(new)
        # The graph accumulates into the captured .grad tensors: start each call from zero.
        with torch.no_grad():
            for t in [x] + list(layer.parameters()):
                t.grad.zero_()
        g.replay()
        want = _eager_grads(layer, lambda m: _body(kind, m), new, reentrant)
        _assert_equal(_grads(layer, x), want, f"call {call}")


@pytest.mark.parametrize("kind", KINDS)
def test_graphed_callable_with_a_checkpoint_matches_eager(kind):
    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(9)
            self.lin = torch.nn.Linear(H, H)

        def forward(self, u):
            return checkpoint(_body(kind, self.lin), u, use_reentrant=False)

    eager = Checkpointed()
    m = copy.deepcopy(eager)
    graphed = dwgraph.make_graphed_callables(m, (torch.randn(B, H, requires_grad=True),))
    for call in range(3):
        xv = torch.randn(B, H)
        xg, xe = xv.clone().requires_grad_(True), xv.clone().requires_grad_(True)
        yg, ye = graphed(xg), eager(xe)
        assert torch.equal(yg, ye), f"call {call}: outputs differ"
        yg.square().sum().backward()
        ye.square().sum().backward()
        _assert_equal(_grads(m.lin, xg), _grads(eager.lin, xe), f"call {call}")


def test_a_reentrant_checkpoint_in_a_graphed_callable_is_a_typed_error_naming_the_fix():
    # torch's reentrant checkpoint refuses torch.autograd.grad with inputs, which warmup and
    # capture call; eager's loss.backward() does not. torch's RuntimeError reached the user
    # untyped; the typed error names use_reentrant=False, which the test above graphs exactly.
    class Reentrant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(H, H)

        def forward(self, u):
            return checkpoint(lambda t: torch.tanh(self.lin(t)), u, use_reentrant=True)

    m = Reentrant()
    m(torch.randn(B, H, requires_grad=True)).sum().backward()  # eager runs it
    with pytest.raises(dwgraph.ArgumentError, match="use_reentrant=True.*Pass use_reentrant=False"):
        dwgraph.make_graphed_callables(m, (torch.randn(B, H, requires_grad=True),))


@pytest.mark.parametrize("kind", KINDS)
def test_graphed_step_with_a_checkpoint_matches_eager(kind):
    eager = _layer(deferred=True)
    m = copy.deepcopy(eager)

    def body(layer, x):
        y = checkpoint(_body(kind, layer), x.requires_grad_(), use_reentrant=False)
        loss = y.square().sum()
        loss.backward()
        layer.backward_dw()
        return loss

    step = dwgraph.graphed_step(lambda x: body(m, x), warmup_iters=1)
    for call in range(4):
        xv = torch.randn(B, H)
        assert torch.equal(step(xv.clone()), body(eager, xv.clone())), f"call {call}: losses differ"
        for p, q in zip(m.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), f"call {call}: {kind} weight gradient differs"
        m.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


def test_early_stop_asked_for_inside_the_capture_is_refused():
    layer = _layer(deferred=False)
    x = torch.randn(B, H, requires_grad=True)
    g = Graph("cpu")
    with pytest.raises(dwgraph.GraphStateError, match=r"aten::tanh raised inside the captured region"):
        with g.capture(), set_checkpoint_early_stop(True):
            y = checkpoint(_body("tanh", layer), x, use_reentrant=False)
            y.square().sum().backward()
    # Refused as a failed capture: nothing captured, and the graph can capture again.
    assert x.grad is None and layer.weight.grad is None
    with g.capture():
        y = checkpoint(_body("tanh", layer), x, use_reentrant=False)
        y.square().sum().backward()
    g.replay()


def test_a_checkpoint_made_before_the_capture_and_recomputed_in_it_is_refused():
    layer = _layer(deferred=False)
    x = torch.randn(B, H, requires_grad=True)
    y = checkpoint(_body("tanh", layer), x, use_reentrant=False)  # early stop: torch's default
    g = Graph("cpu")
    with pytest.raises(dwgraph.GraphStateError, match="raised inside the captured region"):
        with g.capture():
            y.square().sum().backward()


def test_an_exception_caught_inside_the_region_is_refused_at_its_end():
    # Not checkpoint's: any call that raised inside a region that went on (here a shape
    # error caught by the region's own code) leaves the record unsure, so it is refused.
    x = torch.randn(B, H)
    g = Graph("cpu")
    with pytest.raises(dwgraph.GraphStateError, match=r"aten::mm raised inside the captured region .*at the end"):
        with g.capture():
            y = x * 2
            try:
                torch.mm(x, x)
            except RuntimeError:
                pass
    with g.capture():
        y = x * 2
    g.replay()
    assert torch.equal(y, x * 2)


_REFUSED = {
    "item": lambda y: y.sum().item(),
    "nonzero": torch.nonzero,
    "tolist": lambda y: y.tolist(),  # the front end's refusal, no dispatcher call
    "randn": lambda y: torch.randn(3, generator=torch.Generator().manual_seed(0)),  # another generator
    "_sparse_mm": lambda y: torch.sparse.mm(_SPARSE, y),  # a sparse tensor made before the capture
}
_SPARSE = torch.eye(B).to_sparse()


@pytest.mark.parametrize("refused", sorted(_REFUSED))
def test_a_refusal_caught_inside_the_region_is_refused_at_its_end(refused, device):
    # A call the capture refuses before it runs (a host read), caught by the region's own
    # code: eager would have run it, so the region went on along a path eager does not take
    # (until 2026-12-05 the capture ended and replayed without it). On CUDA too: the read
    # that would have invalidated the stream capture never ran.
    x = torch.randn(B, H, device=device)
    g = Graph(device)
    if refused == "_sparse_mm" and device == "cuda":
        pytest.skip("a CPU sparse case")
    name = "Tensor.tolist" if refused == "tolist" else f"aten::{refused}"
    with pytest.raises(dwgraph.GraphStateError, match=rf"{name} was refused inside the captured region"):
        with g.capture():
            y = x * 2
            try:
                _REFUSED[refused](y)
            except dwgraph.GraphStateError:
                pass
            y.add_(1)
    with g.capture():
        y = x * 2
    g.replay()
    assert torch.equal(y, x * 2)


def test_early_stop_is_put_back_after_a_capture_and_untouched_in_eager_calls():
    layer = _layer(deferred=False)
    x = torch.randn(B, H, requires_grad=True)
    before = torch.utils.checkpoint._enable_checkpoint_early_stop
    g = Graph("cpu")
    with g.capture():
        assert torch.utils.checkpoint._enable_checkpoint_early_stop is False
        y = checkpoint(_body("tanh", layer), x, use_reentrant=False)
        y.square().sum().backward()
    assert torch.utils.checkpoint._enable_checkpoint_early_stop is before
    with set_checkpoint_early_stop(True):
        graphed = dwgraph.make_graphed_callables(torch.nn.Linear(H, H), (torch.randn(B, H, requires_grad=True),))
        graphed(torch.randn(B, H, requires_grad=True))  # a replay: no capture, nothing set
        assert torch.utils.checkpoint._enable_checkpoint_early_stop is True


# Fast paths that look for torch function modes --------------------------------------------------
# A capture used to run under a torch function mode (to refuse .tolist() and .numpy()), which
# turns off nn.TransformerEncoderLayer's and MultiheadAttention's fused inference path: a
# graph captured in eval under no_grad replayed the standard path, 2e-7..5e-7 off eager's.
@pytest.mark.parametrize("entry", ["make_graphed_callables", "graph"])
@pytest.mark.parametrize("layer", ["encoder_layer", "multihead_attention"])
def test_inference_fast_paths_replay_as_eager(layer, entry):
    torch.manual_seed(0)
    if layer == "encoder_layer":
        eager = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
        call = lambda mod, u: mod(u)  # noqa: E731
    else:
        eager = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
        call = lambda mod, u: mod(u, u, u, need_weights=False)[0]  # noqa: E731
    m = copy.deepcopy(eager)
    with torch.no_grad():
        if entry == "make_graphed_callables":
            fn = (lambda g: lambda u: g(u))(dwgraph.make_graphed_callables(
                (lambda mod: lambda u: call(mod, u))(m), (torch.randn(2, 5, 16),)))
        else:
            static = torch.randn(2, 5, 16)
            g = Graph("cpu")
            with g.capture():
                out = call(m, static)

            def fn(u):
                static.copy_(u)
                g.replay()
                return out
        for i in range(3):
            x = torch.randn(2, 5, 16)
            want, got = call(eager, x), fn(x)
            assert torch.equal(got, want), f"call {i}: {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("read", ["tolist", "numpy", "array", "from_dlpack", "to_dlpack"])
@pytest.mark.parametrize("entry", ["make_graphed_callables", "graph"])
def test_host_reads_are_refused_inside_captures_and_free_outside(read, entry):
    import numpy as np

    def reading(u):
        v = u * 2
        {"tolist": lambda: v.tolist(), "numpy": lambda: v.numpy(), "array": lambda: np.asarray(v),
         "from_dlpack": lambda: np.from_dlpack(v), "to_dlpack": lambda: torch.utils.dlpack.to_dlpack(v)}[read]()
        return v

    with pytest.raises(dwgraph.GraphStateError, match="reads a tensor's value on the host"):
        if entry == "graph":
            with Graph("cpu").capture():
                reading(torch.randn(3))
        else:
            with torch.no_grad():
                dwgraph.make_graphed_callables(reading, (torch.randn(3),))
    t = torch.arange(3.0)
    assert t.tolist() == [0.0, 1.0, 2.0] and t.numpy().tolist() == [0.0, 1.0, 2.0]
    assert np.asarray(t).tolist() == [0.0, 1.0, 2.0]


def _assert_graphed_step_as_eager(mod, call, calls=3):
    """graphed_step over call(mod, x) against call(a copy of mod, x) under no_grad, bitwise."""
    eager = copy.deepcopy(mod)
    step = dwgraph.graphed_step(lambda u: call(mod, u), warmup_iters=1)
    with torch.no_grad():
        for i in range(calls):
            x = torch.randn(2, 5, 16)
            assert torch.equal(step(x), call(eager, x)), f"call {i}"


def _padding_mask(lens, s=5):
    return torch.arange(s)[None, :] >= torch.tensor(lens)[:, None]


def _encoder():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
                                2).eval()


@pytest.mark.parametrize("entry", ["make_graphed_callables", "graph"])
def test_a_nested_tensor_inside_a_capture_is_a_typed_error_and_the_capture_can_be_retried(entry):
    # torch's encoder turns a padded batch into a nested tensor on its fast path: no fixed
    # shape a replay could rebuild (an untyped internal error before).
    enc, x, mask = _encoder(), torch.randn(2, 5, 16), _padding_mask([5, 3])
    g = Graph("cpu")
    with torch.no_grad(), pytest.raises(dwgraph.GraphStateError, match="nested tensor"):
        if entry == "graph":
            with g.capture():
                enc(x, src_key_padding_mask=mask)
        else:
            dwgraph.make_graphed_callables(lambda a, b: enc(a, src_key_padding_mask=b), (x, mask))
    with g.capture():
        y = x * 2
    g.replay()
    assert torch.equal(y, x * 2)


@pytest.mark.parametrize("layer", ["encoder_with_mask", "encoder_layer", "multihead_attention"])
def test_graphed_step_refuses_a_fast_path_its_watch_would_turn_off(layer):
    # Note [Fast paths a step's mode turns off]: eager's fused inference path (a nested
    # encoder's padded positions: 0 eagerly, ~2.7 under the step's mode) cannot be met.
    if layer == "encoder_with_mask":
        mod, call = _encoder(), lambda m, u: m(u, src_key_padding_mask=_padding_mask([5, 3]))
    elif layer == "encoder_layer":
        mod = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
        call = lambda m, u: m(u)  # noqa: E731
    else:
        mod = torch.nn.MultiheadAttention(16, 4, dropout=0.0, batch_first=True).eval()
        call = lambda m, u: m(u, u, u, need_weights=False)[0]  # noqa: E731
    step = dwgraph.graphed_step(lambda u: call(mod, u), warmup_iters=1)
    with torch.no_grad(), pytest.raises(dwgraph.GraphStateError, match="fused inference path"):
        step(torch.randn(2, 5, 16))
    # In training mode (no fast path eagerly either) the step graphs it, bitwise.
    mod.train()  # (no dropout: the layers are built with dropout=0.0)
    _assert_graphed_step_as_eager(mod, call)


def test_a_capture_under_inference_mode_called_outside_it_runs_eagerly():
    torch.manual_seed(0)
    eager = torch.nn.Linear(H, H)
    m = copy.deepcopy(eager)
    with torch.inference_mode():
        g = dwgraph.make_graphed_callables(m, (torch.randn(B, H),))
        x = torch.randn(B, H)
        assert torch.equal(g(x), eager(x))
    for mode in (torch.no_grad, torch.enable_grad):
        with mode():
            x = torch.randn(B, H)
            assert torch.equal(g(x), eager(x)), mode.__name__  # raised an untyped inference-tensor error


def test_overlapping_captures_on_two_threads_keep_early_stop_off_and_put_it_back():
    import threading

    before = torch.utils.checkpoint._enable_checkpoint_early_stop
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    errors, seen = [], {}

    def capture(name, layer, x, wait_before_end, signal_in):
        try:
            g = Graph("cpu")
            with g.capture():
                signal_in.set()
                wait_before_end.wait(30)
                y = checkpoint(_body("tanh", layer), x, use_reentrant=False)
                y.square().sum().backward()
                seen[name] = torch.utils.checkpoint._enable_checkpoint_early_stop
            g.replay()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            if name == "A":
                a_out.set()

    la, lb = _layer(False), _layer(False)
    ta = threading.Thread(target=capture, args=("A", la, torch.randn(B, H, requires_grad=True), b_in, a_in))
    tb = threading.Thread(target=capture, args=("B", lb, torch.randn(B, H, requires_grad=True), a_out, b_in))
    ta.start()
    a_in.wait(30)
    tb.start()  # B begins inside A and ends after it: the regions overlap without nesting
    ta.join(60)
    tb.join(60)
    assert not errors, errors
    assert seen == {"A": False, "B": False}
    assert torch.utils.checkpoint._enable_checkpoint_early_stop is before


@pytest.mark.parametrize("layer", ["cross_attention", "odd_heads", "sequence_first_layer"])
def test_graphed_step_graphs_attention_that_takes_no_fast_path_eagerly(layer):
    # torch's own conditions: no fused path eagerly either, so nothing to refuse.
    torch.manual_seed(0)
    if layer == "cross_attention":
        mod = torch.nn.MultiheadAttention(16, 4, dropout=0.0, batch_first=True).eval()
        memory = torch.randn(2, 3, 16)
        call = lambda m, u: m(u, memory, memory, need_weights=False)[0]  # noqa: E731
    elif layer == "odd_heads":
        mod = torch.nn.MultiheadAttention(16, 1, dropout=0.0, batch_first=True).eval()
        call = lambda m, u: m(u, u, u, need_weights=False)[0]  # noqa: E731
    else:
        mod = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=False).eval()
        call = lambda m, u: m(u)  # noqa: E731
    _assert_graphed_step_as_eager(mod, call)
