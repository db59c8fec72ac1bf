"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with deferred weight gradients (SPEC C9).

FSDP2 reduce-scatters a parameter group's gradients and frees its unsharded parameters in
the group's post-backward, during the main backward; a deferred weight's gradient lands
later, in ``backward_dw()``, on the unsharded parameter. :class:`FullyShardReducer` uses
FSDP2's own controls so that the deferred gradient reaches the sharded ``.grad`` exactly as
an undeferred one does: manual backward finalization on the root, and, for the FSDP modules
that hold deferred parameters, no gradient sync and no reshard after backward (the
unsharded parameters and their gradients stay) until :meth:`finish`, which turns both back
on and lets ``finalize_backward()`` run FSDP's reduce-scatter. Its
:meth:`~FullyShardReducer.make_graphed_callables` graphs the model's units over their
unsharded parameters, kept at fixed addresses.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Dict, List, Tuple

import torch

from .. import _C, _guards, graphed
from . import _stages
from ..errors import ArgumentError, GraphStateError
from ..nn import DistributedWeight, _DeferredWgradModule

__all__ = ["FullyShardReducer"]


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


class FullyShardReducer:
    """Drives FSDP2 for the dwgraph modules inside ``root`` (the root ``fully_shard``
    module). Each step: forward, backward, every ``backward_dw()``, then :meth:`finish`
    (or the :meth:`deferred_step` block), then ``optimizer.step()``; microbatches that
    accumulate into the step run inside :meth:`no_sync` but the last. A forward after the
    step's last one without ``finish()`` raises GraphStateError.

    Fused modules (``fuse_wgrad_accumulation=True``) accumulate into an FP32 ``main_grad``
    that this reducer attaches to FSDP's unsharded parameter; :meth:`finish` hands it to
    FSDP as that parameter's gradient and zeroes it, so the sharded ``.grad`` is the same
    as without fusion. FSDP modules holding deferred parameters must not have their
    gradient sync or reshard-after-backward changed by the caller while this reducer is in
    use.
    """

    def __init__(self, root: torch.nn.Module):
        fsdp_cls = _fsdp_module_class()
        if fsdp_cls is None or not isinstance(root, fsdp_cls):
            raise ArgumentError(f"dwgraph.distributed.FullyShardReducer: argument 'root' must be the root module "
                                f"torch.distributed.fsdp.fully_shard was applied to, got {type(root).__name__}")
        if not hasattr(root, "finalize_backward") or not hasattr(root, "set_manual_backward_finalization"):
            raise ArgumentError("dwgraph.distributed.FullyShardReducer: this torch's FSDP2 has no manual backward "
                                "finalization (FSDPModule.finalize_backward); it needs torch 2.15 or newer")

        _stages.refuse_stage_overlap(root)
        self.root = root
        managers = {n: m for n, m in root.named_modules() if isinstance(m, fsdp_cls)}
        self._modules: List[Tuple[str, _DeferredWgradModule]] = []
        holders: Dict[str, torch.nn.Module] = {}
        for name, m in root.named_modules():
            if not isinstance(m, _DeferredWgradModule) or not (m.delay_wgrad_compute or m.fuse_wgrad_accumulation):
                continue
            if any(isinstance(p, DistributedWeight) for p in m.parameters(recurse=False)):
                raise ArgumentError(f"dwgraph.distributed.FullyShardReducer: module '{name}' has a DistributedWeight; "
                                    "FSDP2 shards its parameters itself, use plain parameters")
            owner = max((n for n in managers if n == "" or name == n or name.startswith(n + ".")), key=len)
            holders[owner] = managers[owner]
            self._modules.append((name, m))
        if not self._modules:
            raise ArgumentError("dwgraph.distributed.FullyShardReducer: 'root' holds no dwgraph module with "
                                "delay_wgrad_compute or fuse_wgrad_accumulation; fully_shard alone handles it")
        self._holders = list(holders.values())
        self._landings = [0] * len(self._modules)
        self._last_landings = [0] * len(self._modules)
        self._accumulating = False  # inside no_sync()
        self._closed = False  # the step's last forward (outside no_sync) ran
        self._in_step = False  # a forward ran since the last finish()
        self._handles = [m.register_wgrad_hook(functools.partial(self._landed, i))
                         for i, (_, m) in enumerate(self._modules)]
        # FSDP creates the unsharded parameters at the first all-gather: main_grad is attached
        # then (make_graphed_callables attaches it for the modules it graphs and drops the hook).
        self._main_grad_hooks = {id(m): m.register_forward_pre_hook(self._attach_main_grads)
                                 for _, m in self._modules if m.fuse_wgrad_accumulation}
        # First, so a refused forward has started no collective of FSDP.
        self._handles.append(root.register_forward_pre_hook(self._before_forward, prepend=True))
        sharded = next(p for p in root.parameters())
        mesh = getattr(sharded, "device_mesh", None)
        if mesh is None:
            raise ArgumentError("dwgraph.distributed.FullyShardReducer: the root's parameters are not sharded "
                                "DTensors; build it after fully_shard(root)")
        self._group = mesh.get_group()
        # The sharded parameters, which the optimizer steps (the module registers the
        # unsharded ones between forward and reshard).
        self._sharded = list(root.named_parameters())
        self._device = sharded.device
        root.set_manual_backward_finalization(True)
        self._arm()
        _guards.track_reducer(self)

    def _arm(self) -> None:
        # Until finish(): FSDP keeps the unsharded parameters and their gradients after the
        # backward instead of reduce-scattering and freeing them.
        for h in self._holders:
            h.set_requires_gradient_sync(False, recurse=False)
            h.set_reshard_after_backward(False, recurse=False)

    @graphed.around_calls
    def _before_forward(self, _module, _args) -> None:
        if not torch.is_grad_enabled():
            return
        self._in_step = True
        if self._closed:
            raise GraphStateError(
                "dwgraph.distributed.FullyShardReducer: a new forward after the previous step's last forward "
                "without finish(); call finish() after the last backward_dw() of each step and before "
                "optimizer.step(), and run the microbatches that accumulate into one step but the last "
                "inside reducer.no_sync()")
        self._closed = not self._accumulating

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards inside accumulate into the step without ending it (the step's last
        forward runs outside; finish() follows its backward_dw())."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def make_graphed_callables(self, modules, sample_args, **kwargs):
        """``dwgraph.make_graphed_callables`` for modules of this reducer's FSDP2 model:
        FSDP units themselves (``fully_shard(block)``, graphed as ``block``) or modules
        inside one unit (the root's own layers). Same arguments and return value.

        The graphs capture each unit's unsharded parameters, so their storage must stay
        where it is: the units holding the graphed modules' parameters get
        ``set_keep_unsharded_storage(True)`` (their unsharded parameters stay allocated
        between steps, as without resharding; gradients and optimizer state stay sharded),
        and are unsharded for the capture and resharded after it. FSDP's hooks on a graphed
        unit run around each replay: its all-gather refills the kept storage before the
        forward (and, resharded after forward, before the backward), its reduce-scatter
        reads the gradients the replays handed over. A graphed module whose unit has
        registered its sharded parameters (called outside the unit's forward) raises
        GraphStateError. Every rank must capture together: the warmup runs the modules
        eagerly, without FSDP's collectives.
        """
        if not hasattr(self.root, "set_keep_unsharded_storage"):
            raise ArgumentError("dwgraph.distributed.FullyShardReducer.make_graphed_callables: this torch's FSDP2 "
                                "cannot keep unsharded parameter storage (FSDPModule.set_keep_unsharded_storage); "
                                "graphs need it at fixed addresses (torch 2.15 or newer)")
        if self._in_step or self.pending():
            raise GraphStateError("dwgraph.distributed.FullyShardReducer.make_graphed_callables: a step is in "
                                  "progress (a forward ran or weight gradients landed since the last finish()); "
                                  "capture between steps, after finish()")
        mods = tuple(modules) if isinstance(modules, (tuple, list)) else (modules,)
        owners = self._units_by_parameter()
        units: List[torch.nn.Module] = []
        for i, m in enumerate(mods):
            if not isinstance(m, torch.nn.Module):
                continue
            if not any(m is sub for sub in self.root.modules()):
                raise ArgumentError(f"dwgraph.distributed.FullyShardReducer.make_graphed_callables: modules[{i}] "
                                    f"('{type(m).__name__}') is not part of this reducer's root module")
            for p in m.parameters():
                unit = owners.get(id(p))
                if unit is not None and not any(unit is u for u in units):
                    units.append(unit)
        for u in units:
            u.set_keep_unsharded_storage(True, recurse=False)
        try:
            for u in units:
                u.unshard()
            inside = [m for _, m in self._modules if m.fuse_wgrad_accumulation and
                      any(m is sub for g in mods if isinstance(g, torch.nn.Module) for sub in g.modules())]
            for m in inside:
                # The capture needs main_grad on the unsharded parameters, which stay (kept
                # storage), so the hook that attaches it lazily is no longer needed there (a
                # hook inside a graphed module would be refused: a replay does not run it).
                self._attach_main_grads(m, ())
                hook = self._main_grad_hooks.pop(id(m), None)
                if hook is not None:
                    hook.remove()
            return graphed.make_graphed_callables(modules, sample_args, **kwargs)
        finally:
            for u in units:
                u.reshard()

    def _units_by_parameter(self) -> Dict[int, torch.nn.Module]:
        """id of each sharded parameter -> the FSDP unit (module) that owns it."""
        out: Dict[int, torch.nn.Module] = {}
        fsdp_cls = _fsdp_module_class()
        for unit in self.root.modules():
            if not isinstance(unit, fsdp_cls):
                continue
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    out[id(fp.sharded_param)] = unit
        return out

    @staticmethod
    def _attach_main_grads(module, _args) -> None:
        # The forward sees FSDP's unsharded parameter (created once, reused every step).
        for _, p in module._fused_parameters():
            if getattr(p, "main_grad", None) is None:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _landed(self, i: int, _module) -> None:
        self._landings[i] += 1

    def pending(self) -> bool:
        """True when weight gradients landed since the last finish()."""
        return any(self._landings)

    def landings(self) -> Dict[str, int]:
        """How many weight steps each module landed in the last finished step."""
        return {n: c for (n, _), c in zip(self._modules, self._last_landings)}

    def named_parameters(self):
        return list(self._sharded)

    def finish(self) -> None:
        """Lets FSDP reduce-scatter every gradient of the step into the sharded ``.grad``.
        Raises GraphStateError on every rank, before any collective of FSDP, when a rank
        still has queued weight-gradient work."""
        # Pending in a graphed callable counts: its replayed backward holds the work outside
        # the module's queue until backward_dw().
        problems = [f"module '{n}': {m.num_pending_wgrad_units()} backward(s) still queued or pending in a graph; "
                    "call backward_dw() once per backward before finish() (discard_wgrad_units() drops work of an "
                    "abandoned step)" for n, m in self._modules if m.num_pending_wgrad_units()]
        agreeing = _C.distributed.count_agreeing(self._group, not problems, self._device)
        world = torch.distributed.get_world_size(self._group)
        if agreeing != world:
            details = "".join(f"\n  this rank: {p}" for p in problems)
            raise GraphStateError(f"dwgraph.distributed.FullyShardReducer.finish(): {world - agreeing} of {world} "
                                  f"ranks have weight-gradient work still queued; FSDP reduced nothing (call "
                                  f"root.reset_iter_state() before retrying the step).{details}")
        for _, m in self._modules:
            for _, p in m._fused_parameters():
                # p is FSDP's unsharded parameter (no reshard after this step's backward).
                mg = getattr(p, "main_grad", None)
                if mg is None:
                    continue
                # In the dtype FSDP reduces this parameter's gradient in (grad_dtype: FP32 under a
                # mixed-precision policy with a BF16 parameter); main_grad is zeroed below.
                g = mg.to(getattr(p, "grad_dtype", None) or p.dtype, copy=True)
                _C.nn.accumulate_grad(p, g, "dwgraph.distributed.FullyShardReducer.finish()")  # the one hand-off rule
                mg.zero_()
        for h in self._holders:
            h.set_requires_gradient_sync(True, recurse=False)
            h.set_reshard_after_backward(True, recurse=False)
        try:
            self.root.finalize_backward()
        finally:
            self._arm()
            self._last_landings, self._landings = self._landings, [0] * len(self._modules)
            self._closed = False
            self._in_step = False

    @contextlib.contextmanager
    def deferred_step(self):
        """``with reducer.deferred_step():`` forward, backward, every ``backward_dw()``;
        :meth:`finish` on exit."""
        yield self
        self.finish()

    def remove(self) -> None:
        """Detaches the reducer: its hooks go and FSDP is configured as without it (gradient
        sync, reshard after backward, automatic backward finalization)."""
        for h in [*self._handles, *self._main_grad_hooks.values()]:
            h.remove()
        self._handles, self._main_grad_hooks = [], {}
        for h in self._holders:
            h.set_requires_gradient_sync(True, recurse=False)
            h.set_reshard_after_backward(True, recurse=False)
        self.root.set_manual_backward_finalization(False)
