"""``dwgraph.eager_memory``: the peak live bytes of eager code, measured by the rules the
graphs' pool follows, so a graph set's memory can be compared with what the same schedule
needs without graphs (docs/memory-contract.md, "Memory of a graph set").

    with dwgraph.eager_memory(graphed) as eager:   # graphed: what make_graphed_callables returned
        run_the_schedule(eager_modules)            # the same schedule, eagerly
    eager.peak_bytes                               # also graphed's stats()["eager_peak_bytes"]
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from . import _C
from .errors import ArgumentError
from .graphed import GraphedCallable, graphed_handle

__all__ = ["EagerMemory", "eager_memory"]


class EagerMemory:
    """What :func:`eager_memory` measured; the fields are ``None`` until its block exits.

    ``peak_bytes``: the high-water mark of live bytes the block allocated. ``reserved_bytes``
    (host only): the memory the measuring pool had to reserve for them (the eager analogue of
    a graph pool's reserved bytes); ``None`` on CUDA, whose default pool is shared with
    everything else."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes: Optional[int] = None
        self.reserved_bytes: Optional[int] = None

    def __repr__(self) -> str:
        return f"EagerMemory(device={self.device}, peak_bytes={self.peak_bytes}, reserved_bytes={self.reserved_bytes})"


def _set_of(graphed) -> GraphedCallable:
    first = graphed[0] if isinstance(graphed, (tuple, list)) and graphed else graphed
    first = graphed_handle(first) if isinstance(first, torch.nn.Module) else first
    if not isinstance(first, GraphedCallable):
        raise ArgumentError(f"dwgraph.eager_memory: argument 'graphed' must be what make_graphed_callables returned "
                            f"(a graphed module, a GraphedCallable or their tuple) or None, got {type(graphed).__name__}")
    return first


@contextlib.contextmanager
def eager_memory(graphed=None, *, device=None) -> Iterator[EagerMemory]:
    """Measures the peak live bytes of the eager code run in the block.

    Host (CPU): the calling thread's CPU allocations in the block come from a fresh host
    graph pool, the allocator (block rounding, best-fit reuse) the graphs' pool uses, and
    ``peak_bytes`` is that pool's high-water mark of live bytes. Everything the block
    allocates counts (activations, temporaries, gradients, a ``.grad`` first created there);
    what existed before it (parameters, inputs) does not; what it leaves alive stays valid
    and is freed as usual. CPU autograd runs the backward on the calling thread, so
    ``loss.backward()`` inside the block is measured; work on other threads is not.

    CUDA: the caching allocator's peak allocated bytes on the device during the block, above
    what was allocated when it began (the graphs' private pool is served by the same
    allocator). This calls ``torch.cuda.reset_peak_memory_stats(device)``, and allocations of
    other threads and streams during the block count too.

    ``graphed``: what :func:`make_graphed_callables` returned (or one of its graphed modules
    or callables); the peak is then recorded on that set (``stats()["eager_peak_bytes"]``,
    ``dwgraph.summary``) and the device is the set's. Otherwise ``device`` (default
    ``"cpu"``). Nothing is recorded when the block raises or allocates nothing."""
    target = None if graphed is None else _set_of(graphed)
    if target is not None:
        dev = target._native.device
        req = None if device is None else torch.device(device)
        if req is not None and (req.type != dev.type or (req.index is not None and req.index != dev.index)):
            raise ArgumentError(f"dwgraph.eager_memory: argument 'device' is {req} but the graphs of "
                                f"'graphed' run on {dev}; expected the same device or None")
    else:
        dev = torch.device("cpu" if device is None else device)
    result = EagerMemory(dev)
    if dev.type == "cpu":
        pool = _C.graphs.graph_pool_handle(dev)
        with pool._allocation_scope():
            yield result
        st = pool.stats()
        result.peak_bytes, result.reserved_bytes = st["peak_allocated_bytes"], st["reserved_bytes"]
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield result
        torch.cuda.synchronize(dev)
        result.peak_bytes = max(0, torch.cuda.max_memory_allocated(dev) - base)
    else:
        raise ArgumentError(f"dwgraph.eager_memory: argument 'device' must be a CPU or CUDA device, got {dev}")
    if target is not None and result.peak_bytes > 0:
        target.record_eager_peak(result.peak_bytes)
