"""``ShardedWeight``: a deferred-wgrad weight whose parameter is this rank's shard (SPEC C5, C9).

Each rank holds rows ``[r * n, (r + 1) * n)`` of the full weight (dim 0). The forward and
the backward's input gradient all-gather the full weight with torch.distributed (it is not
kept between them); the weight gradient, computed at full size (in ``backward_dw()`` when
deferred), is reduce-scattered into the shard and averaged over the group, as data-parallel
training over sharded parameters (ZeRO-3, FSDP) does. dwgraph's autograd functions keep the
parameter object as a plain reference (Note [Weights are plain references]), so
``saved_tensors_hooks`` cannot strip its type and a ``retain_graph=True`` backward
all-gathers again. Inside a dwgraph capture the collectives are handed to the host around
each replay (Note [Host work around a replay], graphs/host_calls.h): the graphs read a
full buffer all-gathered before each replay and the reduce-scatter runs after it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from .. import _C
from ..errors import ArgumentError
from ..nn import DistributedWeight

__all__ = ["ShardedWeight"]


class ShardedWeight(DistributedWeight):
    """This rank's dim-0 shard of a weight sharded over ``process_group`` (default: world).

    Build it from the full weight, identical on every rank, with :meth:`from_full`, and
    assign it to a dwgraph module (``lin.weight = ShardedWeight.from_full(lin.weight)``).
    Its gradient (``.grad``, or ``main_grad`` when ``full`` had one: a fused module's weight)
    is the shard of the weight gradient averaged over the group. ``reduce_count`` counts
    reduce-scatters.
    """

    def __new__(cls, data: Optional[torch.Tensor] = None, requires_grad: bool = True):
        return super().__new__(cls, data, requires_grad)

    @classmethod
    def from_full(cls, full: torch.Tensor, process_group=None) -> "ShardedWeight":
        group = process_group if process_group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if full.dim() < 1 or full.shape[0] % world != 0:
            raise ArgumentError(f"dwgraph.distributed.ShardedWeight.from_full: argument 'full' must have a first "
                                f"dimension divisible by the group size {world}, got shape {tuple(full.shape)}")
        rows = full.shape[0] // world
        shard = cls(full.detach()[rank * rows:(rank + 1) * rows].clone(), full.requires_grad)
        shard.process_group = group
        shard.reduce_count = 0
        if getattr(full, "main_grad", None) is not None:
            # A fused module's weight: its shard accumulates into a shard-sized FP32 main_grad.
            shard.main_grad = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
        return shard

    def _group(self):
        group = getattr(self, "process_group", None)
        if group is None:
            raise ArgumentError("dwgraph.distributed.ShardedWeight: no process group; build it with "
                                "ShardedWeight.from_full(full, process_group)")
        return group

    def full_shape(self) -> torch.Size:
        return torch.Size((self.shape[0] * dist.get_world_size(self._group()), *self.shape[1:]))

    @staticmethod
    def _refuse_foreign_capture(what: str) -> None:
        # A CUDA capture that is not dwgraph's (torch.cuda.graph, torch's
        # make_graphed_callables) would keep the collective out of its graph silently.
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            raise ArgumentError(
                f"dwgraph.distributed.ShardedWeight: its {what} is a collective that a torch CUDA graph cannot "
                "replay; graph modules with sharded weights with dwgraph.make_graphed_callables, which runs it "
                "around each replay")

    def _gather_into(self, full: torch.Tensor) -> None:
        dist.all_gather_into_tensor(full, self.detach().contiguous(), group=self._group())

    def materialize_forward(self) -> torch.Tensor:
        if _C.graphs.capturing():
            # Note [Host work around a replay]: the graphs read one full buffer per pool,
            # all-gathered before each replay that reads it.
            return _C.graphs.replay_buffer(self, "all-gather", list(self.full_shape()), self.dtype, self._gather_into)
        self._refuse_foreign_capture("all-gather")
        full = torch.empty(self.full_shape(), dtype=self.dtype, device=self.device)
        self._gather_into(full)
        return full

    def finalize_wgrad(self, wgrad: torch.Tensor) -> None:
        if tuple(wgrad.shape) != tuple(self.full_shape()):
            raise ArgumentError(f"dwgraph.distributed.ShardedWeight.finalize_wgrad: expected the full weight "
                                f"gradient of shape {tuple(self.full_shape())}, got {tuple(wgrad.shape)}")
        if _C.graphs.capturing():
            # The graph computes the full gradient; the reduce-scatter into the shard runs
            # after each replay (after backward_dw()'s replay when deferred).
            _C.graphs.after_replay(functools.partial(self._reduce_scatter, wgrad))
            return
        self._refuse_foreign_capture("reduce-scatter")
        self._reduce_scatter(wgrad)

    def _reduce_scatter(self, wgrad: torch.Tensor) -> None:
        group = self._group()
        shard = torch.empty(self.shape, dtype=wgrad.dtype, device=wgrad.device)
        dist.reduce_scatter_tensor(shard, wgrad.contiguous(), group=group)
        shard.div_(dist.get_world_size(group))
        self.reduce_count = getattr(self, "reduce_count", 0) + 1
        main_grad = getattr(self, "main_grad", None)
        if main_grad is not None:
            main_grad.add_(shard)
            self.grad_added_to_main_grad = True
        else:
            _C.nn.accumulate_grad(self, shard, "dwgraph.distributed: a sharded weight's reduce-scatter")  # the one hand-off rule
