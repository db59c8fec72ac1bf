"""Helpers shared by the test files (not a test module): independent torch.nn references
and the BF16/FP32 ulp used by the tolerances."""

import math

import torch


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` at magnitude `value` (7 mantissa bits for BF16, 23 for FP32)."""
    mant = {torch.float32: 23, torch.bfloat16: 7}[dtype]
    return 2.0 ** (math.floor(math.log2(value)) - mant) if value > 0 else 0.0


def _norm(width: int, eps: float, normalization: str):
    """torch.nn.LayerNorm or torch.nn.RMSNorm, and the slots of its parameters."""
    if normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(width, eps=eps)
        return norm, {"layer_norm_weight": (norm, "weight")}
    norm = torch.nn.LayerNorm(width, eps=eps)
    return norm, {"layer_norm_weight": (norm, "weight"), "layer_norm_bias": (norm, "bias")}


class RefMLP(torch.nn.Module):
    """dwgraph.nn.LayerNormMLP in plain torch.nn: LayerNorm (or RMSNorm), fc1, exact GELU,
    fc2. `slots` maps dwgraph's parameter names to (module, attribute) here."""

    def __init__(self, hidden: int, ffn: int, bias: bool, normalization: str = "LayerNorm"):
        super().__init__()
        self.ln, norm_slots = _norm(hidden, 1e-5, normalization)
        self.fc1 = torch.nn.Linear(hidden, ffn, bias=bias)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(ffn, hidden, bias=bias)
        self.slots = {
            **norm_slots,
            "fc1_weight": (self.fc1, "weight"), "fc1_bias": (self.fc1, "bias"),
            "fc2_weight": (self.fc2, "weight"), "fc2_bias": (self.fc2, "bias"),
        }

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.ln(x))))


class RefLNLinear(torch.nn.Module):
    """dwgraph.nn.LayerNormLinear in plain torch.nn: LayerNorm (or RMSNorm), Linear. `slots`
    maps dwgraph's parameter names to (module, attribute) here."""

    def __init__(self, in_features: int, out_features: int, bias: bool, eps: float = 1e-5,
                 normalization: str = "LayerNorm"):
        super().__init__()
        self.ln, norm_slots = _norm(in_features, eps, normalization)
        self.linear = torch.nn.Linear(in_features, out_features, bias=bias)
        self.slots = {**norm_slots, "weight": (self.linear, "weight"), "bias": (self.linear, "bias")}

    def forward(self, x):
        return self.linear(self.ln(x))


def copy_into_reference(ref: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    """Copies `module`'s parameters into the reference `ref` (RefMLP / RefLNLinear) through
    its slots; returns `ref`."""
    with torch.no_grad():
        for name, (mod, attr) in ref.slots.items():
            src = getattr(module, name)
            if src is not None:
                getattr(mod, attr).copy_(src)
    return ref
