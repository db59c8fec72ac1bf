"""``dwgraph.make_graphed_callables``: capture and replay training steps with deferred
weight gradients (contract C3, C4, C7, C8, docs/contract.md).

Each callable gets a forward graph, a backward graph and, when any of its modules defers
its weight gradients, a backward-dw graph, all on one private pool. After every
``backward_dw()`` replay the gradients are handed to the caller's ``.grad`` (cloned when
it is ``None``, added otherwise) before the delayed hooks run, so
``optimizer.zero_grad(set_to_none=True)`` between steps is always safe. See
docs/memory-contract.md.

The C++ core (``dwgraph._C.graphs``) decides everything about schedules, slots, states,
checks and landings; this module only describes ``torch.nn.Module`` objects to it and
turns pytrees into the flat tensor lists it works on.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from . import _C, _guards, _spec, _watch
from . import fp8 as _fp8
from .errors import ArgumentError, GraphStateError, count, flag
from .graphs import torch_code_as_captured

__all__ = ["make_graphed_callables", "GraphedCallable", "graphed_handle", "summary"]

_CAPTURE_TIME_HOOK_NAMES = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")

# Kept for code that imported them from here (graphed_step); _spec is their home.
_HOOK_KINDS = _spec.HOOK_KINDS
_user_global_hooks = _spec.user_global_hooks
_refuse_autocast_cache = _spec.refuse_autocast_cache
_dwgraph_module_spec = _spec.dwgraph_module_spec
around_calls = _spec.around_calls


# -- pytrees --------------------------------------------------------------------------------
class _Signature:
    """The structure of a call or a return: a pytree spec with its non-tensor leaves. The
    tensors are what the graphs see; everything else is baked in at capture."""

    def __init__(self, tree):
        leaves, self.spec = pytree.tree_flatten(tree)
        self.is_tensor = [isinstance(l, torch.Tensor) for l in leaves]
        self.constants = [None if t else l for t, l in zip(self.is_tensor, leaves)]
        # The common cases skip the pytree work at every call: positional tensors in,
        # one tensor out.
        self.positional_tensors = (all(self.is_tensor) and isinstance(tree, tuple) and len(tree) == 2 and
                                   isinstance(tree[1], dict) and not tree[1] and
                                   all(isinstance(a, torch.Tensor) for a in tree[0]))
        self.single_tensor = isinstance(tree, torch.Tensor)
        self.num_leaves = len(leaves)
        # The keywords of an (args, kwargs) call, in their order: a pytree spec tells dicts
        # apart by their key order, a call does not.
        self.kwarg_order = (tuple(tree[1]) if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], dict)
                            else None)

    @staticmethod
    def tensors_of(tree) -> List[torch.Tensor]:
        return [l for l in pytree.tree_leaves(tree) if isinstance(l, torch.Tensor)]

    def matches(self, other: "_Signature") -> bool:
        if self.spec != other.spec or self.is_tensor != other.is_tensor:
            return False
        return all(_same_constant(a, b) for a, b, t in zip(self.constants, other.constants, self.is_tensor) if not t)

    def rebuild(self, tensors: Sequence[torch.Tensor]):
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if t else c for t, c in zip(self.is_tensor, self.constants)], self.spec)


def _binds_by_name(fn: Callable, names) -> bool:
    """Whether `fn` takes every one of `names` as a named parameter (not through **kwargs)."""
    if not names:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: keep the order
        return False
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return all(n in params and params[n].kind in named for n in names)


def _same_constant(a, b) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (an object without a usable ==)
        return a is b


# -- the callables --------------------------------------------------------------------------
class GraphedCallable:
    """One graphed (callable, microbatch) slot. Call it like the callable; after the
    backward, ``backward_dw()`` replays the weight-gradient graph and hands the gradients
    over. In the sequential schedule each graphed module carries one as
    ``module.dwgraph_graphed`` (see :func:`graphed_handle`)."""

    def __init__(self, native, target, forward: Callable, in_sig: "_Signature", out_sig: Dict[str, Any]):
        self._native = native
        self.module = target
        self._forward = forward
        self._in_sig = in_sig
        self._out = out_sig
        # Positional tensors only, as captured: the count the common path of __call__ takes.
        self._positional = in_sig.num_leaves if in_sig.positional_tensors else -1
        # Keywords the forward binds by name may come in any order; those a **kwargs takes
        # keep the order it sees (a forward may iterate them: a review found one reordered).
        self._kwarg_order = in_sig.kwarg_order if _binds_by_name(forward, in_sig.kwarg_order) else None
        is_module = isinstance(target, torch.nn.Module)
        self._dw_modules = [m for m in target.modules() if _spec.is_dwgraph_module(m)] if is_module else []

    _fp8_cache = False  # captured with cache_quantized_params=True: calls take is_first_microbatch
    _fp8_cached_modules = ()  # the modules whose FP8 weight caches those calls drive (none with FP8 off)

    def _begin_fp8_microbatch(self, kwargs):
        """Note [FP8 weight cache]: the call's is_first_microbatch goes into each module's
        flag, which the graphs read, after the stale-cache check. Returns what a first
        microbatch records once it has run (None otherwise)."""
        first = kwargs.pop("is_first_microbatch", None)
        if not isinstance(first, bool):
            raise ArgumentError(f"graphed {self._native.name}: captured with cache_quantized_params=True, so every "
                                "call needs is_first_microbatch=True (the step's first microbatch: quantize the "
                                f"weights) or False (reuse them); got {first!r}")
        for m in self._fp8_cached_modules:
            if "_fp8_first_microbatch" not in m._buffers:
                raise GraphStateError(
                    f"graphed {self._native.name}: {m._display_name()} has no FP8 weight cache any more "
                    "(reset_fp8_state() since the capture); graph the module again to cache its FP8 weights")
        filled = [(m, m._fp8_check_cache(first)) for m in self._fp8_cached_modules]
        for m in self._fp8_cached_modules:
            m._fp8_first_microbatch.fill_(first)
        return filled if first else None

    def __call__(self, *args, **kwargs):
        if not self._fp8_cache:
            return self._call(args, kwargs)
        filled = self._begin_fp8_microbatch(kwargs)
        out = self._call(args, kwargs)
        for m, versions in filled or ():  # only a first microbatch that ran refreshed the caches
            m._fp8_cache_versions = versions
        return out

    def _call(self, args: tuple, kwargs: dict):
        # Contract C10: O(1) host work here; the core decides replay or eager and runs its
        # checks only when something they watch changed (Note [Checks paid when state
        # changes]). The arguments as the caller's tuple and dict: no repacking per call.
        _guards.check_data_parallel(self._dw_modules)  # a replay runs no module forward
        if not kwargs and len(args) == self._positional:
            out_sig = self._out["sig"]
            outs = self._native.call_tensors(args, out_sig.single_tensor)
            if outs is None:
                return self._forward(*args)  # a mode the graphs were not captured in
            if outs is not NotImplemented:
                return outs if out_sig.single_tensor else out_sig.rebuild(outs)
        in_sig = self._in_sig
        order = self._kwarg_order
        if kwargs and order is not None and tuple(kwargs) != order and set(kwargs) == set(order):
            kwargs = {k: kwargs[k] for k in order}  # named parameters in another order: the same call
        sig = _Signature((args, kwargs))
        if not sig.matches(in_sig):
            if not self._native.replays():
                return self._forward(*args, **kwargs)
            raise ArgumentError(
                f"graphed {self._native.name}: the arguments must have the structure and non-tensor values of the "
                f"sample arguments (the graphs bake them in); got {sig.spec} with constants "
                f"{[c for c, t in zip(sig.constants, sig.is_tensor) if not t]}, captured {in_sig.spec} with "
                f"{[c for c, t in zip(in_sig.constants, in_sig.is_tensor) if not t]}")
        outs = self._native(_Signature.tensors_of((args, kwargs)))
        if outs is None:
            return self._forward(*args, **kwargs)
        return self._out["sig"].rebuild(outs)

    def backward_dw(self) -> None:
        self._native.backward_dw()

    def need_backward_dw(self) -> bool:
        return self._native.need_backward_dw()

    def reset(self) -> None:
        """Releases every graph, the pool reference and the contributions of the whole set."""
        self._native.reset()

    def contribution_bytes(self) -> int:
        return self._native.contribution_bytes()

    def stats(self) -> Dict[str, Any]:
        """Of the whole set: ``pool_reserved_bytes``, ``pool_allocated_bytes`` (live),
        ``pool_peak_allocated_bytes`` (the pool's high-water mark of live bytes),
        ``eager_peak_bytes`` (the peak of the same schedule run eagerly, once recorded by
        :func:`dwgraph.eager_memory` or :meth:`record_eager_peak`; else ``None``),
        ``contribution_bytes``, ``static_bytes``, ``num_graphs``, ``num_kernels`` and
        ``graphs`` (one dict per graph: ``callable``, ``kind``, ``num_kernels``). The pool's
        bytes are the pool's: a pool passed to several sets counts all of them."""
        return self._native.stats()

    def record_eager_peak(self, nbytes: int) -> None:
        """Records the peak live bytes of the same schedule run eagerly, measured by other
        means than :func:`dwgraph.eager_memory` (a profiler, another run), for ``stats()``
        and ``dwgraph.summary`` to compare the pool with. ``nbytes`` must be positive."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise ArgumentError(f"GraphedCallable.record_eager_peak: argument 'nbytes' must be an int, "
                                f"got {type(nbytes).__name__}")
        self._native.record_eager_peak(nbytes)

    def same_set(self, other) -> bool:
        """Whether `other` (a GraphedCallable or a graphed module) came from the same
        make_graphed_callables call: one pool, one stats()."""
        return self._native.same_set(graphed_handle(other)._native)

    @property
    def slot(self) -> int:
        return self._native.index

    def __repr__(self) -> str:
        return f"GraphedCallable(slot {self._native.index}: {self._native.name})"


def graphed_handle(obj) -> GraphedCallable:
    """The :class:`GraphedCallable` of a graphed module (or the object itself)."""
    if isinstance(obj, GraphedCallable):
        return obj
    handle = getattr(obj, "dwgraph_graphed", None)
    if not isinstance(handle, GraphedCallable):
        raise ArgumentError(f"dwgraph.graphed_handle: {type(obj).__name__} was not returned by make_graphed_callables")
    return handle


_INSTALLED = ("forward", "dwgraph_graphed", "backward_dw", "need_backward_dw", "reset", "__deepcopy__",
              "__getstate__")


def _strip_graphs(module: torch.nn.Module) -> Dict[str, Any]:
    """What _install_on_module put on a graphed module; nothing on another (a forward the
    caller set on the instance is the caller's, and is what gets graphed)."""
    if "dwgraph_graphed" not in module.__dict__:
        return {}
    return {k: module.__dict__.pop(k) for k in _INSTALLED if k in module.__dict__}


def _without_graphs(module: torch.nn.Module, action):
    """Runs `action` on the module as it was before graphing (its graphs bake in this
    module's memory: a copy or a pickle gets the plain module)."""
    saved = _strip_graphs(module)
    try:
        return action()
    finally:
        module.__dict__.update(saved)


def _install_on_module(module: torch.nn.Module, handle: GraphedCallable) -> None:
    # As torch and TransformerEngine do: the same module object, its forward replaced, so it
    # stays in Sequential/ModuleList and keeps parameters(), train()/eval() and state_dict().
    module.forward = handle
    module.dwgraph_graphed = handle
    module.backward_dw = handle.backward_dw
    module.need_backward_dw = handle.need_backward_dw
    if not hasattr(type(module), "reset"):
        module.reset = handle.reset
    # copy.deepcopy and pickle look these up on the instance first.
    module.__deepcopy__ = lambda memo: _without_graphs(module, lambda: copy.deepcopy(module, memo))
    module.__getstate__ = lambda: _without_graphs(module, module.__getstate__)


def _canonical_capture_time_hooks(hooks, n: int):
    if hooks is None:
        return [dict() for _ in range(n)]
    if len(hooks) != n:
        raise ArgumentError(f"dwgraph.make_graphed_callables: argument 'capture_time_hooks' has {len(hooks)} entries "
                            f"but there are {n} callables")
    out = []
    for i, h in enumerate(hooks):
        h = dict(h or {})
        unknown = set(h) - set(_CAPTURE_TIME_HOOK_NAMES)
        if unknown:
            raise ArgumentError(f"dwgraph.make_graphed_callables: capture_time_hooks[{i}] has unknown keys "
                                f"{sorted(unknown)}; expected some of {list(_CAPTURE_TIME_HOOK_NAMES)}")
        out.append({k: list(dict(h.get(k) or {}).values()) for k in _CAPTURE_TIME_HOOK_NAMES})
    return out


def _resolve_pool(pool):
    if pool is None or isinstance(pool, _C.graphs.GraphPool):
        return pool
    handle = getattr(pool, "id", pool)  # torch.cuda.MemPool has .id
    if isinstance(handle, tuple) and len(handle) == 2 and all(isinstance(v, int) for v in handle):
        return _C.graphs.graph_pool_from_handle(handle)
    raise ArgumentError("dwgraph.make_graphed_callables: argument 'pool' must be a dwgraph.graphs.graph_pool_handle(), "
                        f"a torch.cuda.graph_pool_handle() or a torch.cuda.MemPool, got {type(pool).__name__}")


def _refusing_hooks_after(post_warmup_hook, modules):
    """The post_warmup_hook handed to the core, which calls it last before the captures: the
    caller's, then the refusal of module hooks present at capture once more, since the warmup
    hooks ran after the first (a hook one registers on a submodule would be captured into
    the graphs, refused at every call as registered after capture, and its effect would stay
    in the replays once removed)."""
    def run():
        if post_warmup_hook is not None:
            post_warmup_hook()
        for i, m in enumerate(modules):
            if isinstance(m, torch.nn.Module):
                _spec.refuse_hooks(i, m, " (by pre_warmup_hook or post_warmup_hook)")

    return run


# TransformerEngine's FP8 arguments of make_graphed_callables, current and older spellings.
_TE_FP8_ARGUMENTS = ("enabled", "calibrating", "recipe", "amax_reduction_group", "cache_quantized_params",
                     "fp8_enabled", "fp8_calibrating", "fp8_recipe", "fp8_group", "fp8_weight_caching")


def _fp8_states(arguments: Dict[str, Any], num_callables: int):
    """One C++ FP8 state per callable from TransformerEngine's arguments: each callable's
    warmup, capture and any eager fallback run under it, whatever fp8_autocast the caller
    is in (the graphs bake it in, as TransformerEngine's do)."""
    unknown = sorted(set(arguments) - set(_TE_FP8_ARGUMENTS))
    if unknown:
        raise TypeError(f"make_graphed_callables() got an unexpected keyword argument '{unknown[0]}'")
    args = dict(arguments)
    for old, new in (("fp8_enabled", "enabled"), ("fp8_calibrating", "calibrating"), ("fp8_recipe", "recipe"),
                     ("fp8_group", "amax_reduction_group"), ("fp8_weight_caching", "cache_quantized_params")):
        if old in args:
            if new in args:
                raise ArgumentError(f"dwgraph.make_graphed_callables: pass '{new}' or its older spelling '{old}', "
                                    "not both")
            args[new] = args.pop(old)
    enabled = args.get("enabled", False)
    # TE's `enabled` may be one bool per callable.
    per_callable = list(enabled) if isinstance(enabled, (tuple, list)) else [enabled] * num_callables
    if len(per_callable) != num_callables:
        raise ArgumentError(f"dwgraph.make_graphed_callables: 'enabled' must be a bool or one bool per callable "
                            f"({num_callables}), got {len(per_callable)}")
    cache = flag("dwgraph.make_graphed_callables", "cache_quantized_params", args.get("cache_quantized_params", False))
    return cache, [_fp8.make_state("dwgraph.make_graphed_callables", e, args.get("calibrating", False),
                            args.get("recipe"), args.get("amax_reduction_group")) for e in per_callable]


def _prepare_fp8_capture(m, state, cache: bool) -> None:
    """Note [FP8 weight cache] (ops/fp8.h): a capture with cache_quantized_params=True
    records the in-graph first-microbatch decision (warmup and capture quantize afresh),
    and starts with no filled cache: the first replay must be a first microbatch."""
    m._prepare_fp8(state.recipe)
    m._fp8_cache_versions = None
    if cache and state.enabled:
        m._prepare_fp8_cache()
        m._fp8_first_microbatch.fill_(True)


def _under_fp8(fn: Callable, state, known, cached) -> Callable:
    """``fn`` run under the C++ FP8 ``state``, as a graphed call of a callable whose tree
    holds the modules in ``known``, driving the FP8 weight caches of those in ``cached``."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with _fp8.graphed_call_scope(state, known, cached):
            return fn(*args, **kwargs)
    return call


def make_graphed_callables(
    modules,
    sample_args,
    *,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    order: Optional[Sequence[float]] = None,
    num_layers_per_chunk: Optional[Sequence[int]] = None,
    pool=None,
    retain_graph_in_backward: bool = False,
    capture_time_hooks: Optional[Sequence[Optional[Dict[str, Dict]]]] = None,
    reuse_static_buffers: bool = False,
    clone_outputs: bool = True,
    backward_under_autocast: bool = False,
    clone_param_grads_on_return: bool = True,
    pre_warmup_hook: Optional[Callable[[], None]] = None,
    post_warmup_hook: Optional[Callable[[], None]] = None,
    plan_placement: bool = True,
    _order: Optional[Sequence[float]] = None,
    _num_layers_per_chunk: Optional[Sequence[int]] = None,
    _reuse_graph_input_output_buffers: Optional[bool] = None,
    _clone_param_grads_on_return: Optional[bool] = None,
    _unsafe_capture_with_caller_grad: bool = False,
    **fp8_arguments,
):
    """Graphs ``modules`` (one module or callable, or a tuple, list or ``torch.nn.ModuleList``
    of them; a sequence comes back as a tuple) on the device of
    ``sample_args``. Inputs and outputs may be arbitrary pytrees; tensors are the graphs'
    inputs and outputs, everything else is fixed at capture.

    Sequential schedule (``order=None``): ``sample_args[i]`` is the tuple of arguments of
    callable ``i``. Modules come back as the same objects with their ``forward`` replaced
    (plus ``backward_dw``, ``need_backward_dw`` and ``dwgraph_graphed``); plain callables as
    :class:`GraphedCallable`.

    Pipeline schedule: ``order`` as TransformerEngine's ``_order`` (``+c`` forward of chunk
    ``c`` for its next microbatch, ``-c`` its backward, ``-(c + 0.5)`` its backward-dw,
    chunks from 1); ``modules`` are the layers of all chunks in order
    (``num_layers_per_chunk`` each: a list, or one int for every chunk), ``sample_args`` holds one tuple per (chunk,
    microbatch, layer) slot in that nesting, and one :class:`GraphedCallable` per slot is
    returned.

    TransformerEngine spellings ``_order`` and ``_num_layers_per_chunk`` are accepted;
    ``pool`` may be a dwgraph pool, a ``torch.cuda.graph_pool_handle()`` or a
    ``torch.cuda.MemPool``; ``capture_time_hooks[i]`` (TransformerEngine's meaning) maps
    ``"forward_pre_hooks"``, ``"forward_hooks"``, ``"backward_pre_hooks"`` and
    ``"backward_hooks"`` to dicts of ``fn(module)``, run around warmup and capture, outside
    the captured region, never replayed. ``reuse_static_buffers`` (TransformerEngine's
    ``_reuse_graph_input_output_buffers``; pipeline schedule only): on the set's own pool
    subsumed by the slots' sharing by liveness (never more memory than the default); on a
    caller's ``pool``, slots of one callable whose lifetimes in ``order`` do not overlap
    share their static inputs and grad outputs.
    ``clone_outputs`` (default): outputs are fresh tensors the caller owns; ``False`` returns
    the graphs' static outputs, overwritten by the slot's next call, and in a pipeline on
    the set's own pool by other slots' replays once that output's backward has run (torch's and
    TransformerEngine's behaviour, one copy per output per call cheaper).
    ``backward_under_autocast``: the backward graphs are captured with autocast off, as
    the natural loop (forward under ``torch.autocast``, ``loss.backward()`` outside it) runs
    them; ``True`` captures them in the forward's autocast state, for a loop that calls the
    backward inside the region. A backward in the other state is refused.

    ``clone_param_grads_on_return`` (TransformerEngine's, also ``_clone_param_grads_on_return``):
    dwgraph hands autograd and ``.grad`` fresh gradient tensors the caller owns, never the
    graphs' static buffers, whatever the value (what ``True`` asks for); ``False`` lets
    TransformerEngine skip that copy and hand out buffers the next replay overwrites, a
    lifetime dwgraph does not offer, so it is accepted and changes nothing.

    ``pre_warmup_hook`` and ``post_warmup_hook`` (TransformerEngine's): called with no
    arguments once before the first warmup iteration and once after the last (one after the
    other when ``num_warmup_iters=0``), before any capture. Warmup runs in the order of the
    capture (sequential: every forward, then the backwards in reverse, then the
    backward-dw steps; with ``order``, its sequence), as TransformerEngine's does, so
    capture-time hooks see one sequence throughout. What warmup and capture leave
    restored (``.grad``, buffers, ``main_grad``, queued units, the RNG) is restored after
    these hooks too.

    ``plan_placement`` (default; a pipeline schedule on the set's own host pool): the
    captures' allocations are recorded, offsets planned for them, and when that plan spans
    at least 1% less than the pool holds the set is captured once more on a pool that
    follows it (no warmup, no warmup hooks; sets with ``capture_time_hooks`` are captured
    once). ``False``: one capture, blocks placed by best fit (docs/memory-contract.md).

    TransformerEngine's FP8 arguments (``enabled``, ``calibrating``, ``recipe``,
    ``amax_reduction_group``, ``cache_quantized_params``, and the older ``fp8_enabled``,
    ``fp8_calibrating``, ``fp8_recipe``, ``fp8_group``, ``fp8_weight_caching``):
    ``enabled`` (a bool, or one per callable) and ``recipe`` (a ``dwgraph.fp8`` recipe; None:
    ``DelayedScaling()``) give each callable's FP8 state, under which its warmup, capture and
    any eager fallback run, whatever ``fp8_autocast`` the caller is in; the scaling state is
    made before warmup and updated inside the graphs. ``cache_quantized_params=True`` caches
    the quantized weights across microbatches: every call then takes
    ``is_first_microbatch``. ``amax_reduction_group`` (delayed scaling) records the amaxes in
    the graphs and keeps the scales until ``dwgraph.fp8.reduce_amax`` reduces them once per
    step; ``calibrating=True`` is refused (docs/fp8.md).

    ``_unsafe_capture_with_caller_grad`` is for tests only: it captures backward-dw with
    the caller's ``.grad`` in place and skips the hand-off (the unfixed hazard).
    """
    for alias, value, name in ((_order, order, "order"), (_num_layers_per_chunk, num_layers_per_chunk,
                                                          "num_layers_per_chunk")):
        if alias is not None and value is not None:
            raise ArgumentError(f"dwgraph.make_graphed_callables: pass '{name}' or '_{name}', not both")
    if _reuse_graph_input_output_buffers is not None:
        reuse_static_buffers = _reuse_graph_input_output_buffers
    if _clone_param_grads_on_return is not None:
        clone_param_grads_on_return = _clone_param_grads_on_return
    # A flag that is not a bool is refused, not read for its truth: a string or a tensor
    # is no decision.
    api = "dwgraph.make_graphed_callables"
    allow_unused_input = flag(api, "allow_unused_input", allow_unused_input)
    retain_graph_in_backward = flag(api, "retain_graph_in_backward", retain_graph_in_backward)
    reuse_static_buffers = flag(api, "reuse_static_buffers" if _reuse_graph_input_output_buffers is None
                                else "_reuse_graph_input_output_buffers", reuse_static_buffers)
    clone_outputs = flag(api, "clone_outputs", clone_outputs)
    backward_under_autocast = flag(api, "backward_under_autocast", backward_under_autocast)
    clone_param_grads_on_return = flag(api, "clone_param_grads_on_return", clone_param_grads_on_return)
    plan_placement = flag(api, "plan_placement", plan_placement)
    num_warmup_iters = count(api, "num_warmup_iters", num_warmup_iters)  # its range: the core
    for name, hook in (("pre_warmup_hook", pre_warmup_hook), ("post_warmup_hook", post_warmup_hook)):
        if hook is not None and not callable(hook):
            raise ArgumentError(f"dwgraph.make_graphed_callables: argument '{name}' must be a callable taking no "
                                f"arguments, or None; got {type(hook).__name__}")
    order = order if order is not None else _order
    num_layers_per_chunk = num_layers_per_chunk if num_layers_per_chunk is not None else _num_layers_per_chunk

    # A ModuleList is a container, not a callable (it has no forward): its modules are the
    # callables, as a tuple of them would be.
    single = not isinstance(modules, (tuple, list, torch.nn.ModuleList))
    if single:
        modules, sample_args = (modules,), (sample_args,)
        if sample_kwargs is not None:
            sample_kwargs = (sample_kwargs,)
    modules = tuple(modules)
    fp8_cache, fp8_states = _fp8_states(fp8_arguments, len(modules))
    for i, m in enumerate(modules):
        if not callable(m):
            raise ArgumentError(f"dwgraph.make_graphed_callables: modules[{i}] must be a torch.nn.Module or a "
                                f"callable, got {type(m).__name__}")
    if pre_warmup_hook is not None or post_warmup_hook is not None:
        post_warmup_hook = _refusing_hooks_after(post_warmup_hook, modules)
    # The core decides every schedule and slot question (graphs/schedule.h).
    schedule = _C.graphs.Schedule.from_arguments(order, num_layers_per_chunk, len(modules))
    if order is None and len({id(m) for m in modules}) != len(modules):
        raise ArgumentError("dwgraph.make_graphed_callables: the same module appears twice; each callable of the "
                            "sequential schedule gets one slot (use 'order' for one slot per microbatch)")
    num_slots = schedule.num_slots
    sample_args = tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args)
    schedule.check_per_slot(len(sample_args), "sample_args")
    if sample_kwargs is None:
        sample_kwargs = tuple({} for _ in range(num_slots))
    schedule.check_per_slot(len(sample_kwargs), "sample_kwargs")
    if fp8_cache:
        # Every call passes is_first_microbatch, which the graphed callable takes out before
        # its arguments are matched; the capture records the in-graph decision, so a sample
        # value is only left out (kept, every call failed the structure check).
        sample_kwargs = tuple({k: v for k, v in (kw or {}).items() if k != "is_first_microbatch"}
                              for kw in sample_kwargs)
    hooks = _canonical_capture_time_hooks(capture_time_hooks, len(modules))
    _refuse_autocast_cache("dwgraph.make_graphed_callables", "capture",
                           "Use torch.autocast(..., cache_enabled=False) around the capture")

    # One input signature per callable, the same for each of its slots.
    in_sigs: List[Optional[_Signature]] = [None] * len(modules)
    flat_args = []
    for s in range(num_slots):
        c = schedule.callable_of_slot(s)
        sig = _Signature((sample_args[s], dict(sample_kwargs[s] or {})))
        if in_sigs[c] is None:
            in_sigs[c] = sig
        elif not sig.matches(in_sigs[c]):
            raise ArgumentError(f"dwgraph.make_graphed_callables: the sample arguments of slot {s} have another "
                                f"structure or other non-tensor values than the first slot of callable {c}")
        flat_args.append(_Signature.tensors_of((sample_args[s], dict(sample_kwargs[s] or {}))))

    # A module graphed before is graphed again as the plain module (its earlier graphs keep
    # their own handle); on failure it gets its earlier graphed attributes back.
    previous = [_strip_graphs(m) if isinstance(m, torch.nn.Module) else {} for m in modules]
    try:
        specs, forwards, out_sigs, natives = _capture_all(
            modules, schedule, in_sigs, flat_args, hooks, fp8_states, fp8_cache, num_warmup_iters=num_warmup_iters,
            allow_unused_input=allow_unused_input, pool=pool, retain_graph_in_backward=retain_graph_in_backward,
            reuse_static_buffers=reuse_static_buffers, clone_outputs=clone_outputs,
            backward_under_autocast=backward_under_autocast, pre_warmup_hook=pre_warmup_hook,
            post_warmup_hook=post_warmup_hook, plan_placement=plan_placement,
            unsafe_capture_with_caller_grad=_unsafe_capture_with_caller_grad)
    except BaseException as e:
        for m, saved in zip(modules, previous):
            if saved:
                m.__dict__.update(saved)
        if isinstance(e, RuntimeError) and "use_reentrant=True" in str(e) and ".grad()" in str(e):
            # torch's reentrant checkpoint refuses a backward that asks for some gradients
            # only, which warmup and capture make (torch.autograd.grad over the inputs and
            # parameters); eager's loss.backward() does not ask.
            raise ArgumentError(
                "dwgraph.make_graphed_callables: a callable's forward runs torch.utils.checkpoint(use_reentrant=True), "
                "whose backward refuses the gradient call of warmup and capture (torch.autograd.grad over the inputs "
                "and parameters). Pass use_reentrant=False (torch's recommended setting), which is graphed exactly. "
                "Nothing was graphed") from e
        raise
    handles = []
    for native in natives:
        c = native.callable_index
        handle = GraphedCallable(native, modules[c], forwards[c], in_sigs[c], out_sigs[c])
        # As TransformerEngine's: with weight caching every call takes is_first_microbatch,
        # which a callable captured with FP8 off accepts and has no use for.
        handle._fp8_cache = fp8_cache
        handle._fp8_cached_modules = tuple(handle._dw_modules) if fp8_states[c].enabled else ()
        handles.append(handle)
    if order is not None:
        return tuple(handles)
    out = []
    for module, handle in zip(modules, handles):
        if isinstance(module, torch.nn.Module):
            _install_on_module(module, handle)
            out.append(module)
        else:
            out.append(handle)
    return out[0] if single else tuple(out)


def _state_checker(module: torch.nn.Module, name: str):
    """What the core asks when the state epoch moved (Note [Checks paid when state
    changes]): hooks registered after capture inside the module or globally would not run
    at replay, and a changed module tree would keep running the captured one."""
    mod = _spec.weak(module)
    tree = [id(m) for m in module.modules()]

    def check(where: str) -> None:
        m = mod()
        hook = _spec.first_hook(m, include_self=False)
        if hook is None and _spec.user_global_hook_kind() is not None:
            hook = ("every submodule (global)", _spec.user_global_hook_kind()[8:].replace("_", " "))
        if hook is not None:
            raise ArgumentError(
                f"{where}: {hook[1]} registered on {hook[0]} after capture would not run: the graphs replay the "
                "forward and backward as captured. Register hooks on the graphed module itself, or remove them "
                "(or capture again)")
        if [id(sub) for sub in m.modules()] != tree:
            raise _spec.submodules_changed(name)

    return check


def _capture_all(modules, schedule, in_sigs, flat_args, hooks, fp8_states, fp8_cache, **options):
    # What the modules hold as given, put back if anything below fails or makes or rebinds
    # module state (a review found a capture failing for another reason, a reentrant
    # checkpoint, leaving a forward's own FP8 state with the failed warmup's amaxes in it).
    fp8_as_given = _fp8_made_state(modules)
    bound: Dict[int, tuple] = {}
    try:
        specs, forwards, out_sigs, natives = _capture(modules, schedule, in_sigs, flat_args, hooks, fp8_states,
                                                      fp8_cache, bound, **options)
    except BaseException:
        _put_back(bound, fp8_as_given)
        raise
    _refuse_state_made(bound, fp8_as_given, natives)
    return specs, forwards, out_sigs, natives


def _capture(modules, schedule, in_sigs, flat_args, hooks, fp8_states, fp8_cache, bound, **options):
    """_capture_all's work; `bound` gets what every module holds as the core begins."""
    specs, forwards, out_sigs = [], [], []
    for i, module in enumerate(modules):
        is_module = isinstance(module, torch.nn.Module)
        if is_module:
            _spec.refuse_hooks(i, module)
            # The FP8 scaling state exists before warmup: warmup and capture restore the
            # buffers they find, and the graphs update them in place.
            for m in module.modules():
                if _spec.is_dwgraph_module(m):
                    _prepare_fp8_capture(m, fp8_states[i], fp8_cache)
        # The dwgraph modules of the callable's tree (a plain function has none), and those
        # whose FP8 weight caches its calls drive (the flag they read is the one its calls write).
        known = weakref.WeakSet(m for m in module.modules() if _spec.is_dwgraph_module(m)) \
            if is_module else weakref.WeakSet()
        cached = known if fp8_cache and fp8_states[i].enabled else weakref.WeakSet()
        # The module's own forward; hooks of the module itself run around the replays, as
        # around eager calls.
        forward = module.forward if is_module else module
        out_sig: Dict[str, Any] = {}
        mod = _spec.weak(module) if is_module else None  # Note [Graphs hold their modules weakly]
        if mod is not None and getattr(forward, "__self__", None) is module and hasattr(forward, "__func__"):
            call = (lambda f, mod: lambda *a, **k: f(mod(), *a, **k))(forward.__func__, mod)
        else:
            # A plain callable, a forward set on the instance or bound some other way
            # (functools.partialmethod): held as given, strongly.
            call = forward
        call = _under_fp8(call, fp8_states[i], known, cached)

        saved: Dict[int, Any] = {}  # Note [State saved for the backward]: of the last capture

        def run(tensors, call=call, in_sig=in_sigs[i], out_sig=out_sig, i=i, saved=saved, module=mod):
            args, kwargs = in_sig.rebuild(tensors)
            seen = contextlib.nullcontext()
            if module is not None and _C.graphs.capturing():
                saved.clear()
                seen = _spec.saved_state_seen(module(), saved)
            with torch_code_as_captured(), seen:
                out = call(*args, **kwargs)
            sig = _Signature(out)
            if "sig" not in out_sig:
                out_sig["sig"] = sig
            elif not sig.matches(out_sig["sig"]):
                raise ArgumentError(f"dwgraph.make_graphed_callables: callable {i} returned another output structure "
                                    "than in its earlier calls; graphs need a fixed structure")
            return _Signature.tensors_of(out)

        spec = _C.graphs.GraphableCallable()
        spec.name = type(module).__name__ if is_module else getattr(module, "__name__", type(module).__name__)
        spec.forward = run
        if is_module:
            named = list(module.named_parameters())
            spec.parameters = [p for _, p in named]
            spec.parameter_names = [n for n, _ in named]
            spec.current_parameters = lambda mod=mod: list(mod().named_parameters())
            spec.modules = _spec.module_specs(module)
            named_buffers = list(module.named_buffers())
            spec.buffers = [b for _, b in named_buffers]
            spec.buffer_names = [n for n, _ in named_buffers]
            spec.current_buffers = lambda mod=mod: list(mod().named_buffers())
            spec.saved_state = lambda saved=saved: list(saved.values())
            spec.training_mode = _spec.call_mode_reader(module)
            spec.check_state = _state_checker(module, spec.name)
            # Note [Checks paid when state changes]: watched trees are checked when they change.
            spec.state_watched = _watch.watch_module_tree(module)
            spec.registered_parameters = _spec.slot_reader(module)
        h = hooks[i]
        if any(h.values()):
            def capture_time_hook(phase: str, after: bool, h=h, target=mod or (lambda module=module: module)):
                kind = {("forward", False): "forward_pre_hooks", ("forward", True): "forward_hooks",
                        ("backward", False): "backward_pre_hooks", ("backward", True): "backward_hooks"}.get((phase, after))
                for fn in h.get(kind, ()):
                    if fn(target()) is not None:
                        raise ArgumentError(f"dwgraph.make_graphed_callables: capture_time_hooks {kind} must not "
                                            "return a value")

            spec.capture_time_hook = capture_time_hook
        specs.append(spec)
        forwards.append(_under_fp8(forward, fp8_states[i], known, cached))
        out_sigs.append(out_sig)

    pool = _resolve_pool(options.pop("pool"))
    bound.update({id(m): (m, f"callable {i}'s '{name or type(m).__name__}'", _spec.bound_tensors(m))
                  for i, module in enumerate(modules) if isinstance(module, torch.nn.Module)
                  for name, m in module.named_modules()})
    natives = _C.graphs.make_graphed_callables(specs, flat_args, schedule=schedule, pool=pool, **options)
    return specs, forwards, out_sigs, natives


def _put_back(bound, fp8_as_given) -> List[tuple]:
    """Puts back what the modules held (`bound`, _spec.rebound) and their FP8 state as given
    (`fp8_as_given`: buffers and _fp8_ attributes, the state the FP8 arguments asked for
    before warmup removed too). Returns, per module that had changed, (module, where,
    before, changed)."""
    found = [(m, where, before, changed) for m, where, before in bound.values()
             for changed in [_spec.rebound(m, before)] if changed]
    for m, names, attributes in fp8_as_given.values():
        for name in set(m._buffers) - names:
            del m._buffers[name]
        for k in [k for k in m.__dict__ if k.startswith("_fp8_") and k not in attributes]:
            del m.__dict__[k]
        m.__dict__.update(attributes)
    return found


def _fp8_made_state(modules):
    """The FP8 state of every dwgraph module of the callables as given: its buffer names and
    its _fp8_ attributes (a refused capture puts them back, the state the FP8 arguments
    asked for before warmup included)."""
    out = {}
    for module in modules:
        if isinstance(module, torch.nn.Module):
            for m in module.modules():
                if _spec.is_dwgraph_module(m) and id(m) not in out:
                    out[id(m)] = (m, set(m._buffers), {k: v for k, v in m.__dict__.items() if k.startswith("_fp8_")})
    return out


def _refuse_state_made(bound, fp8_as_given, natives) -> None:
    """A forward that registered or gave another tensor to a module's parameter or buffer
    during warmup or capture would leave graphs over state the caller never had, every later
    call refused as a buffer added or replaced since capture: refused here, the graphs
    released, the modules as given (`bound`: what each held as the core began;
    `fp8_as_given`: the FP8 state before the one the FP8 arguments asked for). Made by
    dwgraph's FP8 (the forward enters an fp8_autocast of its own, or passes
    is_first_microbatch without cache_quantized_params), the warmup's amaxes would be in it,
    and reset() and capture again trained apart from eager (a review found it)."""
    if not any(_spec.rebinding(m, before) for m, _, before in bound.values()):
        return
    for native in natives:
        native.reset()
    found = _put_back(bound, fp8_as_given)
    api = "dwgraph.make_graphed_callables"
    for m, where, before, changed in found:
        fp8 = [n for kind, n in changed if (kind, n) not in before and kind == "buffer" and
               _spec.is_dwgraph_module(m) and n in m._fp8_state_buffer_names()]
        if fp8:
            cache = any(n.startswith("_fp8_weight_cache") or n == "_fp8_first_microbatch" for n in fp8)
            raise ArgumentError(
                f"{api}: {where} made FP8 state during warmup or capture ({', '.join(fp8)}): "
                + ("a sample argument passes is_first_microbatch, which caches the FP8 weights; pass "
                   "cache_quantized_params=True (with enabled=True and the recipe), which makes the cache before "
                   "warmup and takes is_first_microbatch at every call, or leave is_first_microbatch out of the "
                   "sample arguments"
                   if cache else
                   "its forward runs under an fp8_autocast of its own. Pass enabled=True and the recipe (and "
                   "amax_reduction_group) to make_graphed_callables, which makes the FP8 state before warmup, or run "
                   "one forward eagerly before capturing")
                + ". Nothing was graphed; the modules are as they were")
    m, where, before, changed = found[0]
    raise ArgumentError(_spec.rebound_message(api, where, before, changed[0], "warmup or capture",
                                              "outside the graphed callable") + ". Nothing was graphed")


def summary(graphed) -> str:
    """A small table of a set of graphed callables: each graph with its kernel count, then
    the pool's reserved, live and peak bytes, the contribution and static-buffer bytes, and
    the eager peak the pool is compared with when one was recorded.

    ``graphed`` is what :func:`make_graphed_callables` returned (a graphed module, a
    ``GraphedCallable`` or their tuple): the table covers the whole set it belongs to. A
    tuple or list holding callables of several sets (separate ``make_graphed_callables``
    calls) gets one table per set, in the order their first callable appears, each under
    a ``set i of n`` line. ``print(dwgraph.summary(g))``.
    """
    items = list(graphed) if isinstance(graphed, (tuple, list, torch.nn.ModuleList)) else [graphed]
    handles = []
    for i, item in enumerate(items):
        handle = graphed_handle(item) if isinstance(item, torch.nn.Module) else item
        if not isinstance(handle, GraphedCallable):
            where = f"element {i} of argument 'graphed'" if item is not graphed else "argument 'graphed'"
            raise ArgumentError(f"dwgraph.summary: {where} must be what make_graphed_callables returned "
                                f"(a graphed module, a GraphedCallable or their tuple), got {type(item).__name__}")
        handles.append(handle)
    if not handles:
        raise ArgumentError("dwgraph.summary: argument 'graphed' must be what make_graphed_callables returned "
                            "(a graphed module, a GraphedCallable or their tuple), got an empty "
                            f"{type(graphed).__name__}")
    sets: List[GraphedCallable] = []
    for h in handles:
        if not any(h.same_set(s) for s in sets):
            sets.append(h)
    if len(sets) == 1:
        return _set_table(sets[0])
    return "\n".join(f"set {i + 1} of {len(sets)}\n{_set_table(s)}" for i, s in enumerate(sets))


def _set_table(handle: GraphedCallable) -> str:
    st = handle.stats()
    fmt = _C.format_bytes
    kernels = sum(g["num_kernels"] for g in st["graphs"])
    rows = [(g["callable"], g["kind"], str(g["num_kernels"])) for g in st["graphs"]]
    header = ("callable", "graph", "kernels")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    line = lambda r: f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}"  # noqa: E731
    out = [f"dwgraph: {st['num_graphs']} graphs, {kernels} kernels", line(header)]
    out += [line(r) for r in rows]
    out += [f"  {name:<15} {fmt(st[key])}" for name, key in (
        ("pool reserved", "pool_reserved_bytes"), ("pool live", "pool_allocated_bytes"),
        ("pool peak", "pool_peak_allocated_bytes"), ("contributions", "contribution_bytes"),
        ("static buffers", "static_bytes"))]
    eager = st["eager_peak_bytes"]
    out.append(f"  {'eager peak':<15} " + ("unknown (dwgraph.eager_memory records it)" if eager is None else
                                          f"{fmt(eager)} (pool reserved {st['pool_reserved_bytes'] / eager:.2f}x)"))
    return "\n".join(out)
