"""Graph backends (contract C6, C7, docs/contract.md): one ``Graph`` for CUDA and for the host.

``Graph("cuda")`` wraps ``torch.cuda.CUDAGraph`` (captured on a side stream, thread-local
capture mode, on a private pool); ``Graph("cpu")`` is the host graph, which follows CUDA
graph semantics on CPU: capture records the kernels the region dispatches, replay
re-runs exactly those kernels on the same memory, and Python side effects are not
replayed. See docs/graphs.md.

    g = dwgraph.graphs.Graph("cpu")
    with g.capture():
        y = model(static_x)          # runs once, recorded; caller-visible state is put back
    static_x.copy_(new_x)
    g.replay()                       # y now holds model(new_x)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
import torch.utils.checkpoint

from . import _C

GraphPool = _C.graphs.GraphPool

def torch_code_as_captured():
    """Around every captured region's Python (a callable's forward, a step, a ``Graph``
    block): inside a capture on the host graph, two of torch's own switches are set so that
    what runs can be recorded; anywhere else (eager calls, warmups, CUDA captures) nothing
    changes.

    * Note [A step around compiled code] (step.py): torch.compile'd code (this thread only)
      runs its original Python eagerly, so the host graph records its ATen kernels
      (inductor's CPU kernels are C++ functions it calls directly, which a host capture
      would miss: a replay would skip them and read the capture's values).
    * Note [Checkpoints recompute whole in a host capture]: a non-reentrant
      ``torch.utils.checkpoint`` made here recomputes its whole function at backward (early
      stop off). With early stop its recomputation ends by raising out of the last saving
      call, after that call's kernel ran; the host graph records a call when it returns,
      so a replay would skip that kernel and the backward would read the capture's values
      (a silently wrong gradient). The core refuses any call that raised inside a region
      which went on (graphs/recorder.h); this keeps the default checkpoint exact instead.
      On CUDA the stream captured the kernel either way, and early stop stays as set."""
    if not _C.graphs.capturing() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    # torch's own thread-local switch (its compiler runs nested compiled code eagerly with
    # it); test_graphed_step.py and test_dropin.py fail if a torch without it records half
    # a region.
    eager = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "_use_eager_on_nested_compile", None)
    if eager is not None:
        stack.enter_context(eager())
    stack.enter_context(_whole_recomputation())
    return stack


_recompute_lock = threading.Lock()
_recompute_open = 0  # captured regions running now, on any thread
_recompute_saved = None  # torch's setting when the first of them began


@contextlib.contextmanager
def _whole_recomputation():
    """Early stop off while any host capture's region runs. torch's setting is one per
    process, read when a checkpoint's forward runs: it is put back when the last region
    open ends, not when each does (two threads' captures that overlap without nesting
    would otherwise switch it on under the other one, or leave it off). Another thread's
    eager checkpoints made meanwhile recompute whole too: slower, as exact."""
    global _recompute_open, _recompute_saved
    with _recompute_lock:
        if _recompute_open == 0:
            _recompute_saved = torch.utils.checkpoint._enable_checkpoint_early_stop
        _recompute_open += 1
        torch.utils.checkpoint._enable_checkpoint_early_stop = False
    try:
        yield
    finally:
        with _recompute_lock:
            _recompute_open -= 1
            if _recompute_open == 0:
                torch.utils.checkpoint._enable_checkpoint_early_stop = _recompute_saved


def graph_pool_handle(device="cpu") -> GraphPool:
    """A fresh private pool; pass it to several graphs' ``capture(pool=...)`` to share it.
    A later capture may reuse memory an earlier one freed, so the pool refuses (with
    :class:`dwgraph.GraphStateError`, before anything runs) a replay that would read
    memory another graph overwrote, or overwrite memory another graph still has to read."""
    return _C.graphs.graph_pool_handle(torch.device(device))


class Graph:
    """A captured region on ``device`` (``"cpu"``: the host graph; ``"cuda"``)."""

    def __init__(self, device="cpu"):
        self._graph = _C.graphs.Graph(torch.device(device))

    @contextlib.contextmanager
    def capture(self, pool: Optional[GraphPool] = None):
        """Captures the block. If the block raises, the capture is abandoned: no graph, no
        pool reference and no capture mode remain, and the block can be captured again."""
        self._graph.capture_begin(pool)
        try:
            with torch_code_as_captured():
                yield self
        except BaseException:
            self._graph.capture_abort()
            raise
        self._graph.capture_end()

    def capture_begin(self, pool: Optional[GraphPool] = None) -> None:
        self._graph.capture_begin(pool)

    def capture_end(self) -> None:
        self._graph.capture_end()

    def capture_abort(self) -> None:
        self._graph.capture_abort()

    def replay(self) -> None:
        """Re-runs the captured kernels. Raises :class:`dwgraph.DanglingCaptureError`,
        having run nothing, when a storage the graph does not own was released."""
        self._graph.replay()

    def reset(self) -> None:
        """Releases the kernels, the pool reference and the ledger."""
        self._graph.reset()

    @property
    def name(self) -> str:
        """The graph's name in error messages."""
        return self._graph.name

    @name.setter
    def name(self, value: str) -> None:
        self._graph.name = value

    @property
    def device(self) -> torch.device:
        return self._graph.device

    @property
    def pool(self) -> Optional[GraphPool]:
        return self._graph.pool

    @property
    def is_captured(self) -> bool:
        return self._graph.is_captured

    @property
    def num_before_calls(self) -> int:
        """Host calls hoisted out of the capture that run before each replay
        (:func:`replay_buffer` fills)."""
        return self._graph.num_before_calls

    @property
    def num_after_calls(self) -> int:
        """Host calls hoisted out of the capture that run after each replay
        (:func:`after_replay`)."""
        return self._graph.num_after_calls

    @property
    def num_kernels(self) -> int:
        """Kernels replay runs (host: dispatcher calls recorded, less views and allocations)."""
        return self._graph.num_kernels

    def recorded_calls(self):
        """The dispatcher calls the capture recorded, in order; "[skipped]" marks views,
        allocations and composites whose pieces are replayed instead."""
        return self._graph.recorded_calls()

    def storages(self):
        """Every storage the capture touched: ownership ("graph pool", "caller",
        "persistent"), size, role, and whether its owner still holds it."""
        return self._graph.storages()

    def set_role(self, tensor: torch.Tensor, role: str, *, persistent: bool = False) -> None:
        """Names ``tensor``'s storage in error messages (e.g. ``"static input 0"``)."""
        self._graph.set_role(tensor, role, persistent)


def capturing() -> bool:
    """True while a dwgraph capture claims this thread's work (host graphs) or the current
    stream's (CUDA graphs)."""
    return _C.graphs.capturing()


def replay_buffer(owner: torch.Tensor, tag: str, sizes, dtype: torch.dtype, fill) -> torch.Tensor:
    """Inside a dwgraph capture: a buffer the captured kernels may read in place of data
    that host work produces (a collective), ``fill(buffer)`` being called right before each
    replay of the graph. The graphs of one pool share one buffer per ``(owner, tag)``
    (Note [Host work around a replay], graphs/host_calls.h). ``dwgraph.distributed.ShardedWeight``
    all-gathers through it."""
    return _C.graphs.replay_buffer(owner, tag, [int(s) for s in sizes], dtype, fill)


def after_replay(fn, state_only: bool = False) -> None:
    """Inside a dwgraph capture: ``fn()`` runs right after each replay of the graph (a
    reduce-scatter of a gradient the graph computed). ``graphed_step`` refuses it, unless
    ``state_only``: ``fn`` keeps host bookkeeping and touches no tensor a graph reads or
    writes (a count of the optimizer steps a replay takes)."""
    _C.graphs.after_replay(fn, state_only)


__all__ = ["Graph", "GraphPool", "graph_pool_handle", "capturing", "replay_buffer", "after_replay"]
