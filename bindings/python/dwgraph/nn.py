"""Deferred-wgrad modules: ``Linear``, ``GroupedLinear``, ``LayerNormLinear``, ``LayerNormMLP`` (contract C1, C2,
C5, docs/contract.md).

Each is an ordinary ``torch.nn.Module`` with ordinary ``Parameter``s whose forward applies
dwgraph's C++ autograd functions. With ``delay_wgrad_compute=True`` the backward returns
``None`` for the weights and biases and queues their gradient work; each ``backward_dw()``
runs the oldest queued unit (one backward's worth), which initialises ``.grad`` when it is
``None`` and adds to it otherwise, then runs the hooks registered with
``register_wgrad_hook``. With ``fuse_wgrad_accumulation=True`` every weight carries a
persistent FP32 ``main_grad`` that the wgrad GEMM accumulates into directly.
See docs/deferred-wgrad.md.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from . import _C, _guards, _traced
from . import fp8 as _fp8
from ._weights import DistributedWeight
from .errors import ArgumentError, GraphStateError, _FoundMore

__all__ = ["DistributedWeight", "Linear", "GroupedLinear", "LayerNormLinear", "LayerNormMLP"]


def _set_added_to_main_grad(param: torch.Tensor) -> None:
    param.grad_added_to_main_grad = True


@torch.compiler.assume_constant_result
def _fp8_enabled() -> bool:
    # Read while tracing, as torch.autocast's state is: a compiled forward under
    # fp8_autocast runs the eager FP8 path (the traced GEMMs have no FP8).
    return bool(_C.fp8.current_state().enabled)


class _StepContext(threading.local):
    """The dwgraph modules a graphed step runs, seen by this thread (dwgraph.step)."""

    def __init__(self):
        self.modules = None  # a dict id -> module while a step is watched
        self.capture_known = None  # while a step is captured: the module ids its capture guards

    def saw(self, module) -> None:
        if self.modules is not None:
            self.modules.setdefault(id(module), module)
            if self.capture_known is not None and id(module) not in self.capture_known:
                raise _FoundMore(
                    f"dwgraph.graphed_step: at capture the step ran {module._display_name()}, which its earlier "
                    "calls did not; the capture was abandoned before it ran and is retried with it")


_step_context = _StepContext()


class _WgradHooks(collections.OrderedDict):
    """A module's wgrad hooks (register_wgrad_hook, removed through their handles). Its
    store knows how many there are: a graph's hand-off calls into a module's hooks only
    when it has some."""

    def __init__(self, store=None):
        super().__init__()
        self.store = store

    def _count(self) -> None:
        if self.store is not None:
            self.store.set_num_hooks(len(self))

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._count()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._count()

    def pop(self, *args):
        out = super().pop(*args)
        self._count()
        return out

    def popitem(self, *args):
        out = super().popitem(*args)
        self._count()
        return out

    def clear(self):
        super().clear()
        self._count()


def _set_fp8_recipe(module_ref, recipe) -> None:
    module = module_ref()
    if module is not None:
        module._fp8_recipe = recipe


class _DeferredWgradModule(torch.nn.Module):
    """What the modules share: the wgrad store, backward_dw, hooks, main_grad."""

    def __init__(self, delay_wgrad_compute: bool, fuse_wgrad_accumulation: bool):
        super().__init__()
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self._wgrad_store = _C.nn.WgradStore()
        self._wgrad_store.set_notes_hook_runs(True)  # Note [Hook runs a capture saw] (ops/wgrad_store.h)
        # OrderedDict: RemovableHandle keeps a weak reference to it (a dict cannot have one).
        self._wgrad_hooks: Dict[int, Callable] = _WgradHooks(self._wgrad_store)
        # The parameter objects the last forward used: backward_dw() lands on those.
        self._forward_params: Dict[str, torch.Tensor] = {}
        _guards.track_module(self)

    # -- the deferred-wgrad protocol (also what make_graphed_callables looks for) --------
    def need_backward_dw(self) -> bool:
        """True when this module defers its weight gradients to ``backward_dw()``."""
        return self.delay_wgrad_compute

    def backward_dw(self) -> None:
        """Runs the oldest queued unit of weight-gradient work, then the wgrad hooks."""
        _step_context.saw(self)  # a graphed step's W step may run modules its forward did not
        self._backward_dw_without_hooks()
        self._run_wgrad_hooks()

    def _backward_dw_without_hooks(self) -> None:
        # The graph manager captures this, and runs the hooks itself after the hand-off.
        if not self.delay_wgrad_compute:
            raise GraphStateError(
                f"{self._display_name()}.backward_dw(): delay_wgrad_compute is False, so no "
                "weight-gradient work is ever queued; expected a module built with "
                "delay_wgrad_compute=True"
            )
        self._check_forward_params()
        self._wgrad_store.run_oldest(self._display_name())

    def _parameters_by_role(self, role: str):
        # The one rule (C++ ops/param_roles.h) decides which parameter lands where.
        return [(n, p) for n, p in self.named_parameters(recurse=False)
                if _C.nn.classify_parameter(n, self.delay_wgrad_compute, self.fuse_wgrad_accumulation) == role]

    def _check_forward_params(self) -> None:
        # A queued unit lands on the parameter objects its forward used, as autograd would.
        # FSDP2 swaps the module's parameters: unsharded for forward and backward, sharded
        # DTensors after its post-backward, which has then already reduce-scattered and
        # freed the unsharded ones: a landing there would never reach the sharded .grad.
        for name, used in self._forward_params.items():
            now = getattr(self, name, None)
            if now is used or type(now).__name__ != "DTensor" or type(used).__name__ == "DTensor":
                continue
            raise GraphStateError(
                f"{self._display_name()}.backward_dw(): parameter '{name}' is sharded by FSDP2 (fully_shard), "
                "which resharded it after the backward: the deferred gradient would land on the freed "
                "unsharded parameter and never reach the sharded .grad. Build a "
                "dwgraph.distributed.FullyShardReducer(root) to keep it until the weight step (docs/distributed.md)")

    def _deferred_parameters(self):
        """(name, parameter) of every parameter whose gradient lands in backward_dw()."""
        return self._parameters_by_role("deferred")

    def _fused_parameters(self):
        """(name, parameter) of every weight whose gradient accumulates into main_grad."""
        return self._parameters_by_role("fused")

    def num_queued_wgrad_units(self) -> int:
        """How many backwards' worth of weight-gradient work wait for this module's own
        ``backward_dw()``. Backwards replayed by a graphed callable wait in its graphs
        instead; ``num_pending_wgrad_units()`` counts both."""
        return self._wgrad_store.num_units()

    def discard_wgrad_units(self) -> None:
        """Drops every backward's weight-gradient work without running it, queued here or
        pending in a graphed callable's graphs (those will not replay it), and forgets
        graphed backwards whose graphs were released before their ``backward_dw()``: to go
        on after an aborted step, without those gradients."""
        self._wgrad_store.clear()

    def num_pending_wgrad_units(self) -> int:
        """Every backward of this module whose weight gradients have not landed yet: queued
        here, or waiting in a graphed callable's graphs for that callable's ``backward_dw()``."""
        return self._wgrad_store.num_pending()

    def register_wgrad_hook(self, fn: Callable[["torch.nn.Module"], None]) -> RemovableHandle:
        """Calls ``fn(module)`` once after each landing of this module's weight gradients:
        after every ``backward_dw()`` when deferred, at the end of each backward otherwise."""
        handle = RemovableHandle(self._wgrad_hooks)
        self._wgrad_hooks[handle.id] = fn
        return handle

    def _run_wgrad_hooks(self) -> None:
        # Graph warmup and capture suppress them (the core decides, through the store); the
        # graph manager runs them after each hand-off instead.
        if self._wgrad_store.hooks_suppressed():
            self._wgrad_store.note_hook_run()  # Note [Hook runs a capture saw] (ops/wgrad_store.h)
            return
        for fn in list(self._wgrad_hooks.values()):
            fn(self)

    # -- FP8 (docs/fp8.md) ---------------------------------------------------------------
    _fp8_gemms = 1  # GEMMs whose scaling state the module keeps (LayerNormMLP: fc1, fc2)
    _fp8_weight_names = ("weight",)  # their weights, in GEMM order
    # (per weight (id, version, storage, data_ptr), optimizer steps) when its FP8 cache was filled
    _fp8_cache_versions = None
    _fp8_recipe = None  # of the last delayed-scaling forward: dwgraph.fp8.reduce_amax sets the scales by it
    _fp8_filling = None  # the versions a first microbatch's forward records once it has succeeded
    _fp8_ran = False  # a forward of this module ever ran in FP8 (Note [A forward recomputed inside a backward])
    _fp8_ran_without = False  # ... and one without FP8

    def _fp8_kwargs(self, is_first_microbatch: Optional[bool] = None) -> dict:
        """The module's FP8 state for the C++ forward under fp8_autocast (buffers made on the
        first FP8 forward); nothing outside it. ``is_first_microbatch`` (TransformerEngine's):
        None, no weight caching; True, quantize the weights and cache them; False, reuse the
        cache (Note [FP8 weight cache], ops/fp8.h)."""
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            # As a graphed callable's: a truthy string or tensor is no decision.
            raise ArgumentError(f"{self._display_name()}: is_first_microbatch must be True, False or None, got "
                                f"{is_first_microbatch!r}")
        state = _C.fp8.current_state()
        # Note [A forward recomputed inside a backward] (ops/fp8.h): asked before anything
        # below is written. Without FP8 now or ever no rule applies, and nothing is asked (a
        # module that never runs in FP8 pays no extra call).
        recomputing = (state.enabled or self._fp8_ran) and \
            _C.fp8.check_not_recomputing(self._display_name(), state, self._fp8_ran, self._fp8_ran_without)
        if recomputing and is_first_microbatch:
            # The copy this microbatch's forward filled: reused, not refilled (ops/fp8.h).
            is_first_microbatch = False
        if state.enabled and state.recipe.delayed() and _fp8.graphed_call_hides(self):
            # The capture's warmup would move this module's scaling state, which the capture
            # does not know to put back (it puts back its tree's buffers): graphed and eager
            # would part from the first call.
            raise ArgumentError(
                f"{self._display_name()}: an FP8 forward with delayed scaling inside a graphed callable whose "
                "module tree does not hold this module (one kept in a plain list or dict, or called from a "
                "plain function); its warmup would move the module's scaling state unseen. Register it as a "
                "submodule of the graphed module (an attribute, or a torch.nn.ModuleList)")
        filling = None
        if state.enabled and is_first_microbatch is not None:  # refusals before anything is written
            if _step_context.modules is not None:
                # A graphed step's replay runs no Python: the stale-cache check of a later
                # microbatch (_fp8_check_cache) would never run there.
                raise ArgumentError(
                    f"{self._display_name()}: FP8 weight caching (is_first_microbatch={is_first_microbatch!r}) "
                    "inside dwgraph.graphed_step is not supported: its replays would reuse the cached weight "
                    "without the stale-cache check. Leave is_first_microbatch out there (every microbatch "
                    "quantizes), or graph the module with make_graphed_callables(..., cache_quantized_params=True)")
            filling = self._fp8_check_cache(is_first_microbatch)
        if state.enabled:
            self._fp8_ran = True
        else:
            self._fp8_ran_without = True
        self._fp8_filling = filling
        if not state.enabled:
            return {}
        recipe = state.recipe
        self._prepare_fp8(recipe)
        if recipe.delayed() and self.fp8_amax_history.shape[0] == recipe.amax_history_len:
            # Note [Amax reduced across ranks] (ops/fp8.h); a recipe the core refuses (another
            # history length) is not the one the state follows.
            self._fp8_recipe = recipe
            if state.amax_reduction and _C.graphs.capturing():
                # A replay is an FP8 forward too, and runs no Python: reduce_amax, which sets
                # the scales by the recipe of the module's last one, learns it after each
                # replay (a review found it using an eager forward's or another capture's).
                _C.graphs.after_replay(functools.partial(_set_fp8_recipe, weakref.ref(self), recipe),
                                       state_only=True)
        kw = dict(amax_history=self.fp8_amax_history, scale=self.fp8_scale) if recipe.delayed() else {}
        # A module captured with weight caching reads its flag only inside its graphed
        # callable (capture, eager fallback); called on its own it decides as any eager call.
        if is_first_microbatch is not None or _fp8.graphed_call_caches(self):
            self._prepare_fp8_cache()
            kw.update(weight_cache=[(getattr(self, f"_fp8_weight_cache{i}"), getattr(self, f"_fp8_weight_scale_inv{i}"))
                                    for i in range(self._fp8_gemms)],
                      first=self._fp8_first_microbatch,
                      host_first=None if is_first_microbatch is None else bool(is_first_microbatch))
        return dict(fp8=_C.fp8.Meta(**kw))

    def _fp8_state_buffer_names(self) -> List[str]:
        """Every buffer of the FP8 state: the scaling state, then the weight cache's."""
        return ["fp8_amax_history", "fp8_scale"] + self._fp8_cache_buffer_names()

    def _fp8_cache_buffer_names(self) -> List[str]:
        """The weight cache's buffers (non-persistent), as _prepare_fp8_cache names them."""
        return ([f"_fp8_weight_cache{i}" for i in range(self._fp8_gemms)]
                + [f"_fp8_weight_scale_inv{i}" for i in range(self._fp8_gemms)] + ["_fp8_first_microbatch"])

    def _prepare_fp8_cache(self) -> None:
        """Non-persistent buffers: one FP8 copy of each weight with its 1/scale, and the
        first-microbatch flag a graph reads."""
        if "_fp8_first_microbatch" in self._buffers:
            return
        device = self._fp8_device()
        for i, shape in enumerate(self._fp8_cache_shapes()):
            self.register_buffer(f"_fp8_weight_cache{i}", torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                                 persistent=False)
            self.register_buffer(f"_fp8_weight_scale_inv{i}", torch.ones((), dtype=torch.float32, device=device),
                                 persistent=False)
        self.register_buffer("_fp8_first_microbatch", torch.ones((), dtype=torch.bool, device=self._fp8_device()),
                             persistent=False)

    def _fp8_cache_shapes(self):
        """The shape of each GEMM's weight (one cache each)."""
        return [getattr(self, n).shape for n in self._fp8_weight_names]

    def _fp8_device(self) -> torch.device:
        return getattr(self, self._fp8_weight_names[0]).device

    def _fp8_check_cache(self, first: bool):
        """Before a microbatch with weight caching: a later one is refused when the cache
        would be stale (never filled since the module was captured, or a weight replaced or
        changed in place since). A first one returns the weights' versions, which the caller
        records in ``_fp8_cache_versions`` once the call has succeeded (until then, and for
        good if it fails, the cache counts as unfilled: a failed first microbatch may not
        have refreshed it). A weight is the same when it is the same object, at the same
        version, in the same storage (weakly referenced, so that no later storage can take
        its identity), and no optimizer holding it has stepped since (Note [Optimizer steps the FP8 weight
        cache sees], fp8.py): an assignment to ``weight.data`` (``vector_to_parameters``,
        ``module.to()``) keeps the object and its version but not its storage, and fused
        optimizers move a weight without bumping its version."""
        weights = [(n, getattr(self, n)) for n in self._fp8_weight_names]
        now = [(id(w), w._version, w.untyped_storage(), w.data_ptr()) for _, w in weights]
        steps = _fp8.optimizer_steps()
        if first:
            self._fp8_cache_versions = None
            return ([(i, v, StorageWeakRef(s), p) for i, v, s, p in now], steps)
        recorded = self._fp8_cache_versions
        if recorded is None:
            raise GraphStateError(
                f"{self._display_name()}: is_first_microbatch=False, but no microbatch has filled the FP8 weight "
                "cache since it was made, captured or its weights converted to another dtype; pass is_first_microbatch=True on each step's first microbatch")
        then, steps_then = recorded
        for (name, w), (i0, v0, s0, p0), (i1, v1, s1, p1) in zip(weights, then, now):
            why = None
            if i0 != i1:
                why = "the parameter was replaced"
            elif v0 != v1:
                why = f"it was changed in place (version {v0}, now {v1})"
            elif s0.expired() or s0.cdata != s1._cdata or p0 != p1:
                why = "its data was replaced (an assignment to .data)"
            elif _fp8.optimizer_stepped(w, steps_then):
                why = "an optimizer holding it stepped (a fused optimizer bumps no version counter)"
            if why is not None:
                raise GraphStateError(
                    f"{self._display_name()}: is_first_microbatch=False would reuse a stale FP8 copy of '{name}': "
                    + why
                    + " since the step's first microbatch quantized it. Pass is_first_microbatch=True on the first "
                    "microbatch after every weight update")

    def _prepare_fp8(self, recipe) -> None:
        """Registers the buffers ``fp8_amax_history`` and ``fp8_scale`` for ``recipe`` when
        the module has none (a graph capture makes them before its warmup). A module keeps
        them: a recipe with another history length is refused by the core until
        ``reset_fp8_state()``."""
        if recipe is None or not recipe.delayed() or "fp8_scale" in self._buffers:
            return
        device = next(self.parameters()).device
        history, scale = _C.fp8.make_meta(self._fp8_gemms, recipe, device)
        self.register_buffer("fp8_amax_history", history)
        self.register_buffer("fp8_scale", scale)

    def reset_fp8_state(self) -> None:
        """Forgets the FP8 scaling state (the next FP8 forward starts from unit scales)."""
        for name in self._fp8_state_buffer_names():
            self._buffers.pop(name, None)
        self._fp8_cache_versions = self._fp8_filling = None
        self._fp8_recipe = None  # _fp8_ran stays: a checkpointed FP8 forward may still be pending

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A checkpoint with FP8 state loads into a module that has not run in FP8 yet: the
        # buffers are made with the stored shapes, then filled as any buffer.
        stored = [state_dict.get(prefix + n) for n in ("fp8_amax_history", "fp8_scale")]
        if all(isinstance(t, torch.Tensor) for t in stored) and "fp8_scale" not in self._buffers:
            device = next(self.parameters()).device
            self.register_buffer("fp8_amax_history", torch.zeros(stored[0].shape, dtype=torch.float32, device=device))
            self.register_buffer("fp8_scale", torch.ones(stored[1].shape, dtype=torch.float32, device=device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _traceable(self) -> bool:
        """Under torch.compile, modules whose weight gradients land in the backward run the
        traceable forward of dwgraph._traced (same GEMMs); deferred or fused ones run eagerly
        (their backward has side effects outside autograd: one graph break per call)."""
        if not torch.compiler.is_compiling():
            return False
        if self.delay_wgrad_compute or self.fuse_wgrad_accumulation or self._wgrad_hooks:
            return False
        if _fp8_enabled():
            return False
        return not any(isinstance(p, DistributedWeight) for p in self.parameters(recurse=False))

    def _after_forward(self, out: torch.Tensor) -> torch.Tensor:
        if self._fp8_filling is not None:  # a first microbatch's forward succeeded: its cache is filled
            self._fp8_cache_versions, self._fp8_filling = self._fp8_filling, None
        # Without deferral the gradients land during the backward; the hooks run when the
        # whole backward has finished (after AccumulateGrad), once per forward.
        # Warmup or capture (hooks suppressed): whether or not it has hooks now, the runs a
        # backward reaching this output would make are noted (Note [Hook runs a capture
        # saw]), so that graphs run the hooks where eager would.
        if not self.delay_wgrad_compute and out.requires_grad and (
                self._wgrad_hooks or self._wgrad_store.hooks_suppressed()):
            engine = torch.autograd.Variable._execution_engine

            def queue(_grad):
                engine.queue_callback(self._run_wgrad_hooks)

            out.register_hook(queue)
        return out

    # -- helpers ----------------------------------------------------------------------------
    def _display_name(self) -> str:
        return f"dwgraph.nn.{type(self).__name__}({self.extra_repr()})"

    def _config(self) -> dict:
        _step_context.saw(self)
        grad = torch.is_grad_enabled()
        _guards.check_data_parallel((self,))
        return dict(
            delay_wgrad_compute=self.delay_wgrad_compute,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            store=self._wgrad_store,
            unit_id=self._wgrad_store.new_unit_id() if (self.delay_wgrad_compute and grad) else 0,
            module=self._display_name(),
        )

    def _ref(self, name: str, param: Optional[torch.Tensor], *, is_weight: bool):
        if param is None:
            return None
        self._forward_params[name] = param
        fused = self.fuse_wgrad_accumulation and is_weight
        kwargs = {}
        if fused:
            kwargs["main_grad"] = getattr(param, "main_grad", None)
            kwargs["on_main_grad_accumulated"] = functools.partial(_set_added_to_main_grad, param)
            kwargs["current_main_grad"] = functools.partial(getattr, param, "main_grad", None)
        grad_dtype = getattr(param, "grad_dtype", None)
        if grad_dtype is not None and grad_dtype != param.dtype:
            kwargs["grad_dtype"] = grad_dtype
        if isinstance(param, DistributedWeight):
            kwargs["materialize_forward"] = param.materialize_forward
            kwargs["materialize_backward"] = param.materialize_backward
            kwargs["finalize"] = param.finalize_wgrad
        return _C.nn.WeightRef(param, name, **kwargs)

    def _allocate_main_grads(self) -> None:
        for _, p in self._fused_parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    _FP8_BUFFERS = ("fp8_amax_history", "fp8_scale", "_fp8_")  # names (or prefixes) of the FP8 state's buffers

    def _apply(self, fn, *args, **kwargs):
        # main_grad is an attribute, not a buffer: follow the parameters to their device,
        # keeping it FP32 (it is the accumulation buffer, whatever the parameter dtype).
        had = {n: getattr(p, "main_grad", None) for n, p in self.named_parameters(recurse=False)}
        # The FP8 state (scaling state in FP32, the FP8 weight cache) follows a device move
        # but not a dtype conversion (module.bfloat16() would round the state and turn the
        # cache into BF16); a weight whose dtype changed makes the cache stale.
        fp8_state = {n: b for n, b in self._buffers.items() if b is not None and n.startswith(self._FP8_BUFFERS)}
        weight_dtypes = [getattr(getattr(self, n, None), "dtype", None) for n in self._fp8_weight_names]
        out = super()._apply(fn, *args, **kwargs)
        for n, before in fp8_state.items():
            now = self._buffers.get(n)
            if now is not None and now.dtype != before.dtype:
                self._buffers[n] = before.to(device=now.device)
        if weight_dtypes != [getattr(getattr(self, n, None), "dtype", None) for n in self._fp8_weight_names]:
            self._fp8_cache_versions = None
        for n, p in self.named_parameters(recurse=False):
            mg = had.get(n)
            if mg is not None and (not hasattr(p, "main_grad") or p.main_grad.device != p.device):
                p.main_grad = mg.to(device=p.device)
        return out

    def __getstate__(self):
        # torch.save(module) / pickle: queued wgrad units belong to live autograd graphs and
        # cannot be saved; an empty store pickles and comes back empty.
        queued = self._wgrad_store.num_pending()
        if queued:
            raise GraphStateError(
                f"{self._display_name()}: cannot pickle a module with {queued} queued weight-gradient "
                "unit(s) (eager or in a graphed callable's graphs); expected none: run backward_dw() for each "
                "queued backward before saving")
        state = super().__getstate__()
        # A copy has no filled FP8 weight cache: neither the record (weak references to the
        # weights' storages) nor the cache buffers (non-persistent; FP8 tensors, which
        # plain pickle cannot rebuild) go with it.
        cache = set(self._fp8_cache_buffer_names())
        state = dict(state, _fp8_cache_versions=None, _fp8_filling=None,
                     _buffers={n: b for n, b in self._buffers.items() if n not in cache},
                     _non_persistent_buffers_set=self._non_persistent_buffers_set - cache)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._link_hooks()
        _guards.track_module(self)  # a copy (pickle, torch.load) is guarded like the original

    def _link_hooks(self) -> None:
        hooks = self.__dict__.get("_wgrad_hooks")
        if not isinstance(hooks, _WgradHooks):
            hooks = _WgradHooks(self._wgrad_store)
            hooks.update(self.__dict__.get("_wgrad_hooks") or {})
            self.__dict__["_wgrad_hooks"] = hooks
        hooks.store = self._wgrad_store
        hooks._count()

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            # The FP8 cache's record is of the original's weights: a copy has no filled cache.
            object.__setattr__(new, k, None if k in ("_fp8_cache_versions", "_fp8_filling") else copy.deepcopy(v, memo))
        # Parameter.__deepcopy__ drops Python attributes; main_grad goes with its parameter.
        for name, p in self.named_parameters(recurse=False):
            if getattr(p, "main_grad", None) is not None:
                getattr(new, name).main_grad = copy.deepcopy(p.main_grad, memo)
        new._link_hooks()
        _guards.track_module(new)
        return new


def _kaiming_(weight: torch.Tensor, bias: Optional[torch.Tensor], fan_in: int) -> None:
    # torch.nn.Linear's initialisation, so a seeded dwgraph module matches a seeded nn.Linear.
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        torch.nn.init.uniform_(bias, -bound, bound)


def _linear_parameters(module: torch.nn.Module, in_features: int, out_features: int, bias: bool,
                       factory: dict) -> None:
    """``weight [out, in]`` and ``bias [out]`` (or ``None``), initialised as torch.nn.Linear's."""
    module.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
    if bias:
        module.bias = torch.nn.Parameter(torch.empty(out_features, **factory))
    else:
        module.register_parameter("bias", None)
    _kaiming_(module.weight, module.bias, in_features)


def _norm_parameters(module: torch.nn.Module, name: str, normalization: str, width: int, factory: dict) -> None:
    """``layer_norm_weight`` (ones) and, for LayerNorm, ``layer_norm_bias`` (zeros; ``None``
    for RMSNorm), as TransformerEngine names them."""
    _C.nn.check_normalization(name, normalization)
    module.normalization = normalization
    module.layer_norm_weight = torch.nn.Parameter(torch.ones(width, **factory))
    if normalization == "LayerNorm":
        module.layer_norm_bias = torch.nn.Parameter(torch.zeros(width, **factory))
    else:
        module.register_parameter("layer_norm_bias", None)


class Linear(_DeferredWgradModule):
    """``y = x @ weight.T + bias`` with deferred and/or fused weight gradients.

    Args: ``in_features``, ``out_features``, ``bias``; keyword-only
    ``delay_wgrad_compute``, ``fuse_wgrad_accumulation``, ``device``, ``dtype``.
    Shapes: ``x [..., in_features] -> y [..., out_features]``. State-dict keys are
    ``weight`` and ``bias``, as in ``torch.nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 delay_wgrad_compute: bool = False, fuse_wgrad_accumulation: bool = False,
                 device=None, dtype=None):
        super().__init__(delay_wgrad_compute, fuse_wgrad_accumulation)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        factory = dict(device=device, dtype=dtype)
        _linear_parameters(self, in_features, out_features, bias, factory)
        if self.fuse_wgrad_accumulation:
            self._allocate_main_grads()

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        if self._traceable():
            return _traced.linear(x, self.weight, self.bias)
        return self._eager_forward(x, is_first_microbatch)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        out = _C.nn.linear(x, self._ref("weight", self.weight, is_weight=True),
                           self._ref("bias", self.bias, is_weight=False), **self._config(),
                           **self._fp8_kwargs(is_first_microbatch))
        return self._after_forward(out)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, delay_wgrad_compute={self.delay_wgrad_compute}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}")


class GroupedLinear(_DeferredWgradModule):
    """``num_gemms`` Linear layers over consecutive row groups: ``forward(x, m_splits)``.

    Rows ``m_splits[g]`` of ``x [tokens, in_features]`` go through weight ``g``. Weights
    are ``weight0 .. weight{G-1}`` (``[out, in]`` each) with biases ``bias0 ..``, or with
    ``packed_weights=True`` one ``weight [G, out, in]`` with ``bias [G, out]``.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 packed_weights: bool = False, delay_wgrad_compute: bool = False,
                 fuse_wgrad_accumulation: bool = False, device=None, dtype=None):
        super().__init__(delay_wgrad_compute, fuse_wgrad_accumulation)
        self.num_gemms = int(num_gemms)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.packed_weights = bool(packed_weights)
        self.use_bias = bool(bias)
        self._fp8_gemms = self.num_gemms
        self._fp8_weight_names = ("weight",) if self.packed_weights else tuple(f"weight{g}" for g in range(num_gemms))
        factory = dict(device=device, dtype=dtype)
        if self.packed_weights:
            self.weight = torch.nn.Parameter(torch.empty(num_gemms, out_features, in_features, **factory))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(num_gemms, out_features, **factory))
            else:
                self.register_parameter("bias", None)
            for g in range(num_gemms):
                _kaiming_(self.weight[g], None if self.bias is None else self.bias[g], in_features)
        else:
            for g in range(num_gemms):
                w = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
                b = torch.nn.Parameter(torch.empty(out_features, **factory)) if bias else None
                _kaiming_(w, b, in_features)
                setattr(self, f"weight{g}", w)
                if b is not None:
                    setattr(self, f"bias{g}", b)
        if self.fuse_wgrad_accumulation:
            self._allocate_main_grads()

    def _fp8_cache_shapes(self):
        if self.packed_weights:  # one GEMM per group of the packed weight
            return [self.weight.shape[1:]] * self.num_gemms
        return super()._fp8_cache_shapes()

    def _weights(self):
        if self.packed_weights:
            return [("weight", self.weight)]
        return [(f"weight{g}", getattr(self, f"weight{g}")) for g in range(self.num_gemms)]

    def _biases(self):
        if not self.use_bias:
            return []
        if self.packed_weights:
            return [("bias", self.bias)]
        return [(f"bias{g}", getattr(self, f"bias{g}")) for g in range(self.num_gemms)]

    def forward(self, x: torch.Tensor, m_splits: Sequence[int], is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        if self._traceable():
            return _traced.grouped_linear(x, m_splits, self.packed_weights, [p for _, p in self._weights()],
                                          [p for _, p in self._biases()])
        return self._eager_forward(x, m_splits, is_first_microbatch)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, m_splits: Sequence[int],
                       is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        out = _C.nn.grouped_linear(
            x, [int(m) for m in m_splits],
            [self._ref(n, p, is_weight=True) for n, p in self._weights()],
            [self._ref(n, p, is_weight=False) for n, p in self._biases()],
            **self._config(), **self._fp8_kwargs(is_first_microbatch))
        return self._after_forward(out)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}, "
                f"packed_weights={self.packed_weights}, delay_wgrad_compute={self.delay_wgrad_compute}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}")


class LayerNormLinear(_DeferredWgradModule):
    """LayerNorm then a Linear, as TransformerEngine's ``LayerNormLinear`` (the attention
    QKV projection): ``x [..., in_features] -> [..., out_features]``.

    Args as TE's: ``in_features``, ``out_features``, ``eps``; keyword-only ``bias``,
    ``normalization`` (``"LayerNorm"`` or ``"RMSNorm"``), ``return_layernorm_output`` (the
    forward returns ``(out, ln_out)``), ``delay_wgrad_compute``, ``fuse_wgrad_accumulation``,
    ``device``, ``dtype``. Parameters as TE's: ``layer_norm_weight``, ``layer_norm_bias``
    (``None`` for RMSNorm; gradients in the main backward, as in ``LayerNormMLP``),
    ``weight``, ``bias`` (deferred / fused per the flags).
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *, bias: bool = True,
                 normalization: str = "LayerNorm", return_layernorm_output: bool = False,
                 delay_wgrad_compute: bool = False, fuse_wgrad_accumulation: bool = False,
                 device=None, dtype=None):
        super().__init__(delay_wgrad_compute, fuse_wgrad_accumulation)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            # TE's third positional argument is eps: LayerNormLinear(8, 8, False) is not bias=False.
            raise ArgumentError(f"dwgraph.nn.LayerNormLinear: eps must be a number (the third positional argument, "
                                f"as in TransformerEngine; bias is keyword-only), got {eps!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.eps = float(eps)
        self.return_layernorm_output = bool(return_layernorm_output)
        factory = dict(device=device, dtype=dtype)
        _norm_parameters(self, "dwgraph.nn.LayerNormLinear", normalization, in_features, factory)
        _linear_parameters(self, in_features, out_features, bias, factory)
        if self.fuse_wgrad_accumulation:
            self._allocate_main_grads()

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        if self._traceable():
            out, ln_out = _traced.layernorm_linear(self, x)
        else:
            out, ln_out = self._eager_forward(x, is_first_microbatch)
        return (out, ln_out) if self.return_layernorm_output else out

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        out, ln_out = _C.nn.layernorm_linear(
            x, self.layer_norm_weight, self.layer_norm_bias, self.eps,
            self._ref("weight", self.weight, is_weight=True),
            self._ref("bias", self.bias, is_weight=False), normalization=self.normalization, **self._config(),
            **self._fp8_kwargs(is_first_microbatch))
        return self._after_forward(out), ln_out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, eps={self.eps}, "
                f"bias={self.bias is not None}, normalization={self.normalization!r}, "
                f"return_layernorm_output={self.return_layernorm_output}, "
                f"delay_wgrad_compute={self.delay_wgrad_compute}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}")


class LayerNormMLP(_DeferredWgradModule):
    """LayerNorm, fc1, activation, fc2: ``x [..., hidden] -> [..., hidden]``.

    ``activation`` is ``"gelu"`` (erf, as ``torch.nn.GELU()``), ``"gelu_tanh"`` or
    ``"relu"``. Both FC weights and both FC biases are deferred / fused per the flags; the
    LayerNorm parameters (``layer_norm_weight``, ``layer_norm_bias``) get their gradients
    in the main backward as usual. One forward queues one unit (fc2's and fc1's work).
    ``checkpoint=True`` (TE's): the forward keeps only its input; the backward recomputes
    LayerNorm, fc1 and the activation, giving the same gradients and units bit for bit
    (Note [Checkpointed LayerNormMLP], ops/linear.cpp). ``normalization="RMSNorm"`` (TE's):
    no ``layer_norm_bias``.
    """

    _fp8_gemms = 2
    _fp8_weight_names = ("fc1_weight", "fc2_weight")
    # Class defaults: a module pickled before these settings existed loads with them.
    checkpoint = False
    normalization = "LayerNorm"

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True, *,
                 activation: str = "gelu", eps: float = 1e-5, checkpoint: bool = False,
                 normalization: str = "LayerNorm", delay_wgrad_compute: bool = False,
                 fuse_wgrad_accumulation: bool = False, device=None, dtype=None):
        super().__init__(delay_wgrad_compute, fuse_wgrad_accumulation)
        _C.nn.check_activation(f"dwgraph.nn.LayerNormMLP", activation)
        self.hidden_size = int(hidden_size)
        self.ffn_hidden_size = int(ffn_hidden_size)
        self.activation = activation
        self.eps = float(eps)
        self.checkpoint = bool(checkpoint)
        self.use_bias = bool(bias)
        factory = dict(device=device, dtype=dtype)
        _norm_parameters(self, "dwgraph.nn.LayerNormMLP", normalization, hidden_size, factory)
        self.fc1_weight = torch.nn.Parameter(torch.empty(ffn_hidden_size, hidden_size, **factory))
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **factory))
        if bias:
            self.fc1_bias = torch.nn.Parameter(torch.empty(ffn_hidden_size, **factory))
            self.fc2_bias = torch.nn.Parameter(torch.empty(hidden_size, **factory))
        else:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)
        _kaiming_(self.fc1_weight, self.fc1_bias, hidden_size)
        _kaiming_(self.fc2_weight, self.fc2_bias, ffn_hidden_size)
        if self.fuse_wgrad_accumulation:
            self._allocate_main_grads()

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        if self._traceable():
            return _traced.layernorm_mlp(self, x)
        return self._eager_forward(x, is_first_microbatch)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        out = _C.nn.layernorm_mlp(
            x, self.layer_norm_weight, self.layer_norm_bias, self.eps,
            self._ref("fc1_weight", self.fc1_weight, is_weight=True),
            self._ref("fc1_bias", self.fc1_bias, is_weight=False), self.activation,
            self._ref("fc2_weight", self.fc2_weight, is_weight=True),
            self._ref("fc2_bias", self.fc2_bias, is_weight=False), checkpoint=self.checkpoint,
            normalization=self.normalization, **self._config(), **self._fp8_kwargs(is_first_microbatch))
        return self._after_forward(out)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"bias={self.use_bias}, activation={self.activation!r}, eps={self.eps}, "
                + (f"checkpoint=True, " if self.checkpoint else "")
                + (f"normalization={self.normalization!r}, " if self.normalization != "LayerNorm" else "")
                + f"delay_wgrad_compute={self.delay_wgrad_compute}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}")
