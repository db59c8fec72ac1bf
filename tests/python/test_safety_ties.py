"""Tied weights and partial backwards inside one graphed callable (SPEC C1, C8):

  * a weight tied between a non-deferred module (``nn.Embedding``) and a deferred
    ``dwgraph.nn.Linear`` inside one callable gets both shares: the embedding's from the
    backward graph (through autograd, as eager), the Linear's from ``backward_dw()``;
  * ties across callables, and two deferred modules sharing a weight inside one callable;
  * ``Sequential(dwgraph Linear(delay), nn.Linear)`` fed an input that does not require
    grad: the deferred module's backward still runs (its weights are backward targets);
  * a forward that uses a tensor requiring grad which is neither an input nor a parameter
    is refused: the graphs would drop its gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dwgraph
from safety_common import assert_close_to_reference, assert_same_as_eager, eager_backward_dw, torch_reference

H = 16
B = 8
V = 32


class _TiedLM(torch.nn.Module):
    """Embedding -> deferred LayerNormMLP -> deferred output Linear tied to the embedding."""

    def __init__(self, fused: bool = False):
        super().__init__()
        torch.manual_seed(17)
        self.emb = torch.nn.Embedding(V, H)
        self.mlp = dwgraph.nn.LayerNormMLP(H, 2 * H, delay_wgrad_compute=True)
        self.out = dwgraph.nn.Linear(H, V, bias=False, delay_wgrad_compute=True)
        self.out.weight = self.emb.weight  # tied

    def forward(self, tokens):
        return self.out(self.mlp(self.emb(tokens)))


@pytest.mark.parametrize("zero", ["none", "zero"])
def test_tie_between_embedding_and_deferred_linear_inside_one_callable(zero):
    model = _TiedLM()
    eager, ref = copy.deepcopy(model), torch_reference(model)
    ref.out.weight = ref.emb.weight
    assert eager.out.weight is eager.emb.weight
    g = dwgraph.make_graphed_callables(model, (torch.randint(0, V, (B,)),))
    for step in range(3):
        tokens = torch.randint(0, V, (B,))
        target = torch.randn(B, V)
        for m in (model, eager, ref):
            if zero == "none":
                m.zero_grad(set_to_none=True)
            else:
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
        (g(tokens) - target).square().sum().backward()
        g.backward_dw()
        (eager(tokens) - target).square().sum().backward()
        eager_backward_dw(eager)
        (ref(tokens) - target).square().sum().backward()
        assert_same_as_eager(model, eager, f"step {step}")
        assert_close_to_reference(model, ref, f"step {step}")
        assert model.emb.weight.grad is not None and model.emb.weight.grad.abs().sum() > 0


def test_two_deferred_modules_sharing_a_weight_and_ties_across_callables():
    torch.manual_seed(2)
    a = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    b = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    c = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
    b.weight = a.weight                       # across callables (a and b are callables 0 and 1)
    inner = torch.nn.Sequential(b, torch.nn.Tanh(), c)
    c.weight = a.weight                       # and inside callable 1
    ea, einner = copy.deepcopy((a, inner))
    assert einner[0].weight is einner[2].weight
    ga, gb = dwgraph.make_graphed_callables((a, inner), ((torch.randn(B, H),), (torch.randn(B, H, requires_grad=True),)))
    for step in range(3):
        x = torch.randn(B, H)
        gb(ga(x)).square().sum().backward()
        ga.backward_dw(), gb.backward_dw()
        einner(ea(x)).square().sum().backward()
        ea.backward_dw(), einner[0].backward_dw(), einner[2].backward_dw()
        assert torch.equal(a.weight.grad, ea.weight.grad), f"step {step}: tied weight differs"
        assert torch.equal(a.bias.grad, ea.bias.grad) and torch.equal(c.bias.grad, einner[2].bias.grad)
        for m in (a, inner, ea, einner):
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("input_grad", [False, True])
def test_deferred_module_before_an_ordinary_one(input_grad):
    torch.manual_seed(6)
    model = torch.nn.Sequential(dwgraph.nn.Linear(H, H, delay_wgrad_compute=True), torch.nn.Linear(H, H))
    eager, ref = copy.deepcopy(model), torch_reference(model)
    g = dwgraph.make_graphed_callables(model, (torch.randn(B, H, requires_grad=input_grad),))
    for step in range(3):
        x = torch.randn(B, H, requires_grad=input_grad)
        xe, xr = x.detach().clone().requires_grad_(input_grad), x.detach().clone().requires_grad_(input_grad)
        g(x).square().sum().backward()
        g.backward_dw()
        eager(xe).square().sum().backward()
        eager_backward_dw(eager)
        ref(xr).square().sum().backward()
        assert_same_as_eager(model, eager, f"step {step}")
        assert_close_to_reference(model, ref, f"step {step}")
        if input_grad:
            assert torch.equal(x.grad, xe.grad)


def test_tensor_requiring_grad_outside_inputs_and_parameters_is_refused():
    scale = torch.randn(H, requires_grad=True)  # a free tensor: not a Parameter of the module

    class Free(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)

        def forward(self, x):
            return self.lin(x) * scale

    with pytest.raises(dwgraph.ArgumentError, match="neither (one of )?its inputs nor (a|its) parameter"):
        dwgraph.make_graphed_callables(Free(), (torch.randn(B, H),))
    with pytest.raises(dwgraph.ArgumentError, match="neither (one of )?its inputs nor (a|its) parameter"):
        lin = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
        dwgraph.make_graphed_callables(lambda x: lin(x), (torch.randn(B, H),))  # a plain function's closure
