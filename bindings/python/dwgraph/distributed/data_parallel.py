"""Data parallelism with deferred weight gradients: ``DataParallelReducer`` and the
``DistributedDataParallel`` that uses it (SPEC C9, docs/distributed.md).

torch's DDP reduces a parameter when autograd accumulates its gradient. A deferred weight
gets its gradient later, in ``backward_dw()`` (a fused one in ``main_grad``), so DDP is told
to ignore those parameters and dwgraph's reducer (C++, ``distributed/data_parallel.h``)
takes them: bucketed asynchronous all-reduce started from each module's wgrad hook,
waited on by ``finish()``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _C, _guards
from ..errors import ArgumentError
from ..nn import DistributedWeight, _DeferredWgradModule

__all__ = ["DataParallelReducer", "DistributedDataParallel", "reduced_parameter_names"]


def _dwgraph_modules(model: torch.nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _DeferredWgradModule)]


def _owned(module: _DeferredWgradModule) -> List[Tuple[str, torch.Tensor]]:
    # A DistributedWeight reduces its own gradient (finalize_wgrad).
    return [(n, p) for n, p in _guards.owned_parameters(module) if not isinstance(p, DistributedWeight)]


def reduced_parameter_names(model: torch.nn.Module) -> List[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters torch's DDP must
    ignore: deferred and fused ones (dwgraph's reducer takes them) and distributed weights
    (their ``finalize_wgrad`` reduces them)."""
    skip = {id(p) for _, m in _dwgraph_modules(model) for _, p in _owned(m)}
    return [n for n, p in model.named_parameters()
            if id(p) in skip or isinstance(p, DistributedWeight)]


# The live dwgraph DistributedDataParallel wrappers, for the parameters their torch side
# reduces: see _refuse_reduced_twice.
_wrappers: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()


def _refuse_reduced_twice(named: List[Tuple[str, torch.Tensor]], group, api: str) -> None:
    """A parameter is reduced over a process group by one data-parallel reduction only:
    raises ArgumentError when one of ``named`` is already reduced over ``group`` by an
    active DataParallelReducer (not removed) or by the torch side of a live dwgraph
    DistributedDataParallel (whose reducer is not removed). A weight shared by the modules
    of two reducers (a tied embedding and output head, two pipeline stages of one rank
    sharing a weight) would be reduced by each, neither waiting for the other's modules to
    land their gradients."""
    ids = {id(p): n for n, p in named}
    others = [(r, r._params) for r in list(_guards._reducers)
              if isinstance(r, DataParallelReducer) and r._handles and r.process_group is group]
    others += [(w, w._dwgraph_torch_reduced) for w in list(_wrappers)
               if w.deferred._handles and w.process_group is group]
    for other, theirs in others:
        for theirs_name, p in theirs:
            if id(p) in ids:
                what = ("the torch DistributedDataParallel side of another dwgraph.distributed.DistributedDataParallel"
                        if isinstance(other, DistributedDataParallel) else "another DataParallelReducer")
                raise ArgumentError(
                    f"{api}: parameter '{ids[id(p)]}' is already reduced by {what} (as '{theirs_name}'); a parameter "
                    "used by several modules (a tied embedding and output head, two pipeline stages of this rank "
                    "sharing a weight) must be reduced once, after all of its gradients have landed. Build one "
                    "DataParallelReducer over a module holding every module that uses it (for pipeline stages: a "
                    "torch.nn.ModuleList of this rank's stage modules, schedule.step() inside its no_sync() and "
                    "finish() after it; docs/distributed.md, Shared weights), or remove() the other reducer "
                    "(ddp.deferred.remove() for a DistributedDataParallel) if it is no longer used")


class DataParallelReducer:
    """Averages the deferred and fused gradients of every dwgraph module in ``model`` over
    ``process_group`` (default: the world).

    Each module's wgrad hook reports its landing; once a module has nothing left queued
    (and the step synchronises: not inside :meth:`no_sync`), its buffers go into flat
    buckets, and each full bucket starts an asynchronous all-reduce, in the same bucket
    order on every rank, while the remaining ``backward_dw()`` calls run. :meth:`finish`
    waits and writes the averages into ``.grad`` (``main_grad`` when fused). Under
    ``dwgraph.make_graphed_callables`` the hooks run after each replay's hand-off, so the
    reduction runs outside the graphs.

    ``broadcast_from_rank0`` copies rank 0's values of these parameters to every rank, as
    DDP does for the parameters it owns.
    """

    def __init__(self, model: torch.nn.Module, process_group=None, *, bucket_cap_mb: float = 25.0,
                 broadcast_from_rank0: bool = True):
        if not dist.is_initialized():
            raise ArgumentError("dwgraph.distributed.DataParallelReducer: torch.distributed is not initialised; "
                                "call torch.distributed.init_process_group first")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        index: Dict[int, int] = {}
        params: List[dict] = []
        modules: List[dict] = []
        self._modules: List[Tuple[str, _DeferredWgradModule, List[Tuple[str, torch.Tensor, bool]]]] = []
        for mname, m in _dwgraph_modules(model):
            owned = _owned(m)
            if not owned:
                continue
            fused_ids = {id(p) for _, p in m._fused_parameters()}
            entries = []
            for pname, p in owned:
                fused = id(p) in fused_ids
                qualified = f"{mname}.{pname}" if mname else pname
                if fused and getattr(p, "main_grad", None) is None:
                    raise ArgumentError(f"dwgraph.distributed.DataParallelReducer: parameter '{qualified}' has "
                                        "fuse_wgrad_accumulation=True but no main_grad")
                if id(p) not in index:
                    index[id(p)] = len(params)
                    grad_dtype = p.main_grad.dtype if fused else (getattr(p, "grad_dtype", None) or p.dtype)
                    params.append(dict(param=p, name=qualified, fused=fused, grad_dtype=grad_dtype, owners=[]))
                params[index[id(p)]]["owners"].append(len(modules))
                entries.append((pname, p, fused))
            modules.append(dict(name=mname or type(m).__name__,
                                store=m._wgrad_store if m.delay_wgrad_compute else None,
                                params=[index[id(p)] for _, p, _ in entries]))
            self._modules.append((mname, m, entries))
        if not params:
            raise ArgumentError("dwgraph.distributed.DataParallelReducer: the model has no deferred or fused "
                                "parameters (no dwgraph module with delay_wgrad_compute or "
                                "fuse_wgrad_accumulation); torch's DistributedDataParallel alone reduces it")
        self._params = [(d["name"], d["param"]) for d in params]
        _refuse_reduced_twice(self._params, self.process_group, "dwgraph.distributed.DataParallelReducer")
        if broadcast_from_rank0:
            dist._broadcast_coalesced(self.process_group, [p.detach() for _, p in self._params],
                                      int(bucket_cap_mb * 2**20), 0)
        self._native = _C.distributed.DataParallelReducer(self.process_group, params, modules,
                                                          int(bucket_cap_mb * 2**20))
        self._last_task: Dict[int, int] = {}
        self._handles = [m.register_wgrad_hook(functools.partial(self._landed, i))
                         for i, (_, m, _) in enumerate(self._modules)]
        _guards.track_reducer(self)

    # -- what the hooks and the step call --------------------------------------------------
    def _buffers(self, i: int) -> List[Optional[torch.Tensor]]:
        return [p.main_grad if fused else p.grad for _, p, fused in self._modules[i][2]]

    def _landed(self, i: int, module) -> None:
        if not module.delay_wgrad_compute:
            # Without deferral the hook runs at the end of each backward, once per forward of
            # the module: one backward is one landing.
            task = torch._C._current_graph_task_id()
            if task != -1 and self._last_task.get(i) == task:
                return
            self._last_task[i] = task
        self._native.on_landed(i, self._buffers(i))

    def begin_forward(self, sync: bool = True) -> None:
        """Called by a forward of the step; ``sync=False`` keeps this forward's landings from
        starting reductions (gradient accumulation). Raises GraphStateError when the
        previous step started reducing and ``finish()`` was not called."""
        if torch.is_grad_enabled():
            self._native.begin_forward(bool(sync))

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards (and their landings) inside accumulate without reducing."""
        self._native.begin_forward(False)
        try:
            yield
        finally:
            self._native.begin_forward(True)

    def finish(self) -> None:
        """Launches what no hook started, waits, and writes the averages. Raises
        GraphStateError on every rank, before writing any gradient, when a rank's
        contribution is incomplete (a skipped ``backward_dw()``, a module that did not run)."""
        self._native.finish([self._buffers(i) for i in range(len(self._modules))])

    def abandon(self) -> None:
        """Forgets the current step (after an exception); launched reductions complete unseen."""
        self._native.abandon()

    @contextlib.contextmanager
    def deferred_step(self):
        """``with reducer.deferred_step():`` forward, backward, every ``backward_dw()``; the
        exit calls :meth:`finish` (or :meth:`abandon` when the block raised)."""
        try:
            yield self
        except BaseException:
            self.abandon()
            raise
        self.finish()

    # -- introspection ------------------------------------------------------------------------
    def pending(self) -> bool:
        """True when gradients landed (or reductions started) since the last finish()."""
        return self._native.pending()

    def ready_counts(self) -> Dict[str, int]:
        """How often each module's gradients were handed to the reduction in the last
        finished step (1 per module per step when every landing was complete)."""
        return {name or type(m).__name__: n
                for (name, m, _), n in zip(self._modules, self._native.ready_counts())}

    @property
    def num_buckets(self) -> int:
        return self._native.num_buckets

    @property
    def num_launched(self) -> int:
        """Buckets whose all-reduce started in the current step."""
        return self._native.num_launched

    def named_parameters(self):
        return list(self._params)

    def remove(self) -> None:
        """Removes the wgrad hooks; the reducer does nothing afterwards."""
        for h in self._handles:
            h.remove()
        self._handles = []


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's ``DistributedDataParallel`` for models with dwgraph deferred-wgrad modules.

    The deferred and fused parameters (and distributed weights, which reduce themselves) are
    registered as ignored before torch's DDP is built, so its reducer handles only the
    others; ``self.deferred`` (a :class:`DataParallelReducer` on the same process group)
    reduces the deferred ones after their ``backward_dw()``. Call :meth:`finish` (or use
    :meth:`deferred_step`) after the last ``backward_dw()`` of each step, before
    ``optimizer.step()``. ``no_sync()`` covers both reducers. Every other argument is
    torch's; ``deferred_bucket_cap_mb`` sizes dwgraph's buckets.
    """

    def __init__(self, module: torch.nn.Module, *args, deferred_bucket_cap_mb: float = 25.0, **kwargs):
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        ignored.update(reduced_parameter_names(module))
        # Checked before torch's DDP registers anything: both sides, torch's and dwgraph's.
        _refuse_reduced_twice([(n, p) for n, p in module.named_parameters() if p.requires_grad],
                              kwargs.get("process_group") or dist.group.WORLD,
                              "dwgraph.distributed.DistributedDataParallel")
        torch_reduced = [(n, p) for n, p in module.named_parameters() if n not in ignored and p.requires_grad]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(ignored))
        super().__init__(module, *args, **kwargs)
        self._dwgraph_torch_reduced = torch_reduced
        self.deferred = DataParallelReducer(module, self.process_group, bucket_cap_mb=deferred_bucket_cap_mb,
                                            broadcast_from_rank0=kwargs.get("init_sync", True))
        _wrappers.add(self)

    def forward(self, *inputs, **kwargs):
        self.deferred.begin_forward(sync=self.require_backward_grad_sync)
        return super().forward(*inputs, **kwargs)

    def finish(self) -> None:
        """Waits for the reduction of the deferred gradients (see DataParallelReducer.finish)."""
        self.deferred.finish()

    def deferred_step(self):
        """``with ddp.deferred_step():`` ... -- :meth:`finish` on exit."""
        return self.deferred.deferred_step()
