"""``DistributedWeight``: a parameter materialised on use, whose gradient lands through a
finalize step (contract C5). Its own floor: the deferred-wgrad modules (nn.py) use it, and
the guards (_guards.py) ask whether a parameter is one.
"""

from __future__ import annotations

import torch

from . import _C

__all__ = ["DistributedWeight"]


class DistributedWeight(torch.nn.Parameter):
    """A weight that is materialised on use and receives its gradient in a finalize step.

    Subclasses override :meth:`materialize_forward` / :meth:`materialize_backward` (for
    example an all-gather of a sharded weight; they may differ) and :meth:`finalize_wgrad`
    (for example a reduce-scatter into the shard's gradient). dwgraph's autograd functions
    keep the object itself as a plain reference, never as a saved tensor, so installed
    ``torch.autograd.graph.saved_tensors_hooks`` cannot strip its type (contract C5, docs/contract.md).
    """

    def materialize_forward(self) -> torch.Tensor:
        return self.detach()

    def materialize_backward(self) -> torch.Tensor:
        return self.materialize_forward()

    def finalize_wgrad(self, wgrad: torch.Tensor) -> None:
        # The one rule of the core (ops/grad_accumulation.h): .grad = wgrad when None, else
        # .grad += wgrad, a mismatch an error.
        _C.nn.accumulate_grad(self, wgrad, "DistributedWeight.finalize_wgrad")
