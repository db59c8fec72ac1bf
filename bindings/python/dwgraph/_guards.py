"""Checks that turn the silent ways of losing a deferred weight gradient into typed errors
(SPEC C8, C9), whether or not ``dwgraph.distributed`` is used:

* a dwgraph module whose deferred (or fused) parameters run under a plain
  ``torch.nn.parallel.DistributedDataParallel``, whose reducer would all-reduce them during
  the main backward, before ``backward_dw()`` computes them: raised at the forward;
* ``optimizer.step()`` over parameters whose deferred gradient is still queued (no
  ``backward_dw()``) or whose data-parallel reduction was never finished: raised before the
  optimizer writes anything.
"""

from __future__ import annotations

import weakref
from typing import Iterable, List, Tuple

import torch
import torch.optim.optimizer as _optimizer

from ._weights import DistributedWeight
from .errors import GraphStateError

_DDP = torch.nn.parallel.DistributedDataParallel

__all__ = ["check_data_parallel", "track_module", "track_reducer"]

_modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_reducers: "weakref.WeakSet[object]" = weakref.WeakSet()
_hook_handle = None


def owned_parameters(module: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """(name, parameter) of a dwgraph module's parameters that torch's DDP must not reduce:
    deferred ones (they land in backward_dw), fused ones (they land in main_grad) and
    distributed weights (their finalize_wgrad reduces them; their values differ by rank)."""
    distributed = [(n, p) for n, p in module.named_parameters(recurse=False) if isinstance(p, DistributedWeight)]
    seen, out = set(), []
    for name, p in list(module._deferred_parameters()) + list(module._fused_parameters()) + distributed:
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append((name, p))
    return out


def _covered_by(ddp) -> frozenset:
    cached = ddp.__dict__.get("_dwgraph_reduced_ids")
    if cached is None:
        params = getattr(ddp, "_module_parameters", None)
        if params is None:
            ignore = getattr(ddp, "parameters_to_ignore", set())
            params = [p for n, p in ddp.module.named_parameters() if n not in ignore]
        cached = frozenset(id(p) for p in params)
        ddp.__dict__["_dwgraph_reduced_ids"] = cached
    return cached


def check_data_parallel(modules: Iterable[torch.nn.Module]) -> None:
    """Raises when a plain DDP forward is running and would reduce deferred parameters."""
    ddp = _DDP._active_ddp_module  # set by torch's DDP for the length of its forward
    if ddp is None or not torch.is_grad_enabled():
        return
    covered = _covered_by(ddp)
    for m in modules:
        bad = [n for n, p in owned_parameters(m) if id(p) in covered]
        if bad:
            raise GraphStateError(
                f"{m._display_name()}: torch.nn.parallel.DistributedDataParallel reduces its "
                f"parameters {bad} when autograd accumulates them, during the main backward, but their "
                "gradients land later (backward_dw() or main_grad); it would all-reduce zeros and leave "
                "every rank with its own local gradient. Wrap the model with "
                "dwgraph.distributed.DistributedDataParallel, which leaves these parameters to "
                "dwgraph's reducer (see docs/distributed.md)")


def track_module(module: torch.nn.Module) -> None:
    _modules.add(module)
    _install()


def track_reducer(reducer) -> None:
    _reducers.add(reducer)
    _install()


def _install() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = _optimizer.register_optimizer_step_pre_hook(_before_optimizer_step)


def _queued(m):
    store = m._wgrad_store
    graphed, lost = store.num_graph_pending(), store.num_graph_lost()
    where = (f" ({graphed} of them in the graphs of a graphed callable: call its backward_dw(), or the module's)"
             if graphed else "")
    if lost:
        where += (f" ({lost} of them were pending in graphs released before their backward_dw(), by reset() or "
                  "by dropping the graphed callable: those gradients are lost; call discard_wgrad_units() on the "
                  "module to go on without them)")
    return lambda names: (
        f"optimizer.step(): {m._display_name()} still has {store.num_pending()} queued backward(s) whose weight "
        f"gradients never landed{where}, so {names} would be updated without them. Call backward_dw() once per "
        "backward before the step (in torch.distributed.pipelining, build the stages with "
        "dwgraph.distributed.pipelining.PipelineStage)")


def _unfinished(names):
    return (f"optimizer.step(): the reduction of deferred gradients {names[:4]}{' ...' if len(names) > 4 else ''} "
            "was started but not finished; call finish() (or leave its deferred_step() block) after the last "
            "backward_dw() and before optimizer.step()")


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    checks = [(m.named_parameters(), _queued(m)) for m in list(_modules) if m._wgrad_store.num_pending() > 0]
    checks += [(r.named_parameters(), _unfinished) for r in list(_reducers) if r.pending()]
    if not checks:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for named, message in checks:
        names = [n for n, p in named if id(p) in stepped]
        if names:
            raise GraphStateError(message(names))
