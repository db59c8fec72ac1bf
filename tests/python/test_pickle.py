"""torch.save / pickle of dwgraph.nn modules: a module with nothing queued round-trips
(parameters, main_grad, configuration) and trains like the original; one with queued
weight-gradient work is refused with GraphStateError before anything is written. Copies
(deepcopy, pickle, torch.load) are guarded by the optimizer like the original, and a module
graphed (reset, then graphed again) saves without its graphs."""

import copy
import io
import pickle

import pytest
import torch

import dwgraph
from safety_common import SMALL_B, SMALL_H, assert_same_as_eager, deferred_bn_linear, eager_backward_dw

MODULES = {
    "Linear": lambda **kw: dwgraph.nn.Linear(12, 8, **kw),
    "GroupedLinear": lambda **kw: dwgraph.nn.GroupedLinear(2, 12, 8, **kw),
    "GroupedLinear-packed": lambda **kw: dwgraph.nn.GroupedLinear(2, 12, 8, packed_weights=True, **kw),
    "LayerNormMLP": lambda **kw: dwgraph.nn.LayerNormMLP(12, 16, **kw),
    "LayerNormMLP-checkpoint": lambda **kw: dwgraph.nn.LayerNormMLP(12, 16, checkpoint=True, **kw),
    "LayerNormLinear": lambda **kw: dwgraph.nn.LayerNormLinear(12, 8, **kw),
    "LayerNormLinear-RMSNorm": lambda **kw: dwgraph.nn.LayerNormLinear(12, 8, normalization="RMSNorm", **kw),
}


def _forward(m, x):
    return m(x, [3, 2]) if isinstance(m, dwgraph.nn.GroupedLinear) else m(x)


def _torch_roundtrip(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _train_step(m, x, g):
    _forward(m, x).backward(g)
    if m.need_backward_dw():
        m.backward_dw()


@pytest.mark.parametrize("fused", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("roundtrip", ["torch.save", "pickle"])
def test_module_roundtrips_and_trains_like_the_original(kind, fused, roundtrip):
    torch.manual_seed(0)
    m = MODULES[kind](delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    x, g = torch.randn(5, 12), torch.randn(5, 12 if kind.startswith("LayerNormMLP") else 8)
    _train_step(m, x, g)  # gradients and main_grad hold values; nothing is queued
    loaded = _torch_roundtrip(m) if roundtrip == "torch.save" else pickle.loads(pickle.dumps(m))

    assert type(loaded) is type(m) and loaded.extra_repr() == m.extra_repr()
    assert loaded.num_queued_wgrad_units() == 0
    for (name, p), (lname, lp) in zip(m.named_parameters(), loaded.named_parameters()):
        assert name == lname and torch.equal(p, lp), name
        assert lp.grad is None, name  # as for any torch Parameter, .grad is not saved
        if fused and hasattr(p, "main_grad"):
            # main_grad is the caller's accumulation buffer: saved, as a copy.
            assert torch.equal(p.main_grad, lp.main_grad) and lp.main_grad.data_ptr() != p.main_grad.data_ptr(), name
    # The loaded module has its own, empty store and trains exactly as the original.
    assert loaded._wgrad_store is not m._wgrad_store
    m.zero_grad(set_to_none=True)
    _train_step(m, x, g)
    _train_step(loaded, x, g)
    for (name, p), (_, lp) in zip(m.named_parameters(), loaded.named_parameters()):
        if p.grad is not None:
            assert torch.equal(p.grad, lp.grad), name
        if fused and hasattr(p, "main_grad"):
            assert torch.equal(p.main_grad, lp.main_grad), name


@pytest.mark.parametrize("kind", list(MODULES))
def test_module_with_queued_work_is_refused(kind):
    m = MODULES[kind](delay_wgrad_compute=True)
    x = torch.randn(5, 12)
    _forward(m, x).sum().backward()
    _forward(m, x).sum().backward()
    before = [p.detach().clone() for p in m.parameters()]
    for save in (lambda: pickle.dumps(m), lambda: torch.save(m, io.BytesIO())):
        with pytest.raises(dwgraph.GraphStateError, match=r"cannot pickle a module with 2 queued weight-gradient"):
            save()
    # Nothing consumed: the queued units still land.
    assert m.num_queued_wgrad_units() == 2
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    m.backward_dw()
    m.backward_dw()
    pickle.loads(pickle.dumps(m))  # and once drained, it pickles


def test_the_store_itself_refuses_when_not_empty():
    store = dwgraph._C.nn.WgradStore()
    assert isinstance(pickle.loads(pickle.dumps(store)), dwgraph._C.nn.WgradStore)
    m = dwgraph.nn.Linear(4, 4, delay_wgrad_compute=True)
    m(torch.randn(2, 4)).sum().backward()
    with pytest.raises(dwgraph.GraphStateError, match=r"WgradStore: cannot pickle a store with 1 queued"):
        pickle.dumps(m._wgrad_store)
    assert copy.deepcopy(m).num_queued_wgrad_units() == 0  # deepcopy still starts empty


def test_model_with_dwgraph_modules_saves_and_loads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(dwgraph.nn.Linear(8, 16, delay_wgrad_compute=True), torch.nn.GELU(),
                                dwgraph.nn.LayerNormMLP(16, 32))
    loaded = _torch_roundtrip(model)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), loaded(x))
    assert loaded.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.load"])
def test_copies_of_dwgraph_modules_are_guarded_like_the_original(how):
    import pickle

    orig = torch.nn.Sequential(dwgraph.nn.Linear(SMALL_H, SMALL_H, delay_wgrad_compute=True))
    if how == "deepcopy":
        mod = copy.deepcopy(orig)
    elif how == "pickle":
        mod = pickle.loads(pickle.dumps(orig))
    else:
        buf = io.BytesIO()
        torch.save(orig, buf)
        buf.seek(0)
        mod = torch.load(buf, weights_only=False)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    mod(torch.randn(SMALL_B, SMALL_H)).sum().backward()  # backward_dw() forgotten
    before = [p.detach().clone() for p in mod.parameters()]
    with pytest.raises(dwgraph.GraphStateError, match="never landed"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, mod.parameters()))


def test_regraph_after_reset_and_pickle_of_a_graphed_module():
    m = deferred_bn_linear()
    e = copy.deepcopy(m)
    g = dwgraph.make_graphed_callables(m, (torch.randn(SMALL_B, SMALL_H),))
    dwgraph.graphed_handle(g).reset()
    g = dwgraph.make_graphed_callables(m, (torch.randn(SMALL_B, SMALL_H),))
    x = torch.randn(SMALL_B, SMALL_H)
    g(x).sum().backward(), g.backward_dw()
    e(x).sum().backward(), eager_backward_dw(e)
    assert_same_as_eager(m, e, "after regraphing")
    m.zero_grad(set_to_none=True)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert "dwgraph_graphed" not in loaded.__dict__ and "forward" not in loaded.__dict__
