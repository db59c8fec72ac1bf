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

import copy
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from . import _C, _guards
from .errors import ArgumentError, GraphStateError
from .graphs import RefuseHostReads

__all__ = ["make_graphed_callables", "GraphedCallable", "graphed_handle", "summary"]

_UNSET = object()
_HOOK_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_CAPTURE_TIME_HOOK_NAMES = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


# -- describing modules to the core ----------------------------------------------------------
def _is_dwgraph_module(m) -> bool:
    from .nn import _DeferredWgradModule

    return isinstance(m, _DeferredWgradModule)


def _flag_accessors(param: torch.Tensor):
    def get():
        return param.__dict__.get("grad_added_to_main_grad")

    def set_(value):
        if value is None:
            param.__dict__.pop("grad_added_to_main_grad", None)
        else:
            param.grad_added_to_main_grad = value

    return get, set_


def _main_grad_of(param: torch.Tensor, name: str) -> torch.Tensor:
    mg = getattr(param, "main_grad", None)
    if mg is None:
        raise GraphStateError(f"dwgraph: parameter '{name}' has no main_grad any more; the graphs accumulate its "
                              "weight gradient into the main_grad they captured. Zero it in place instead of "
                              "deleting it, or reset() and capture again")
    return mg


def _weak(module: torch.nn.Module, freed: Optional[Callable[[], Exception]] = None):
    """A function returning `module` while it lives, raising `freed()` (default: a
    GraphStateError naming it) after. Note [Graphs hold their modules weakly]: the core
    keeps the functions it is given; a strong reference from there to the module would
    close the cycle module -> its graphed forward -> graphs -> module through C++, where
    the garbage collector cannot see it, and a dropped graphed model would never be freed.
    The module owns its graphs, so it outlives every call that asks."""
    ref = weakref.ref(module)
    name = type(module).__name__
    if freed is None:
        freed = lambda: GraphStateError(  # noqa: E731
            f"dwgraph: the graphed module ('{name}') was freed while its graphs were in use")

    def get():
        m = ref()
        if m is None:
            raise freed()
        return m

    return get


def _dwgraph_module_spec(name: str, module) -> "_C.graphs.ModuleSpec":
    mod = _weak(module)  # Note [Graphs hold their modules weakly]
    info = _C.graphs.DwgraphModuleInfo()
    info.name = name
    info.display_name = module._display_name()
    info.store = module._wgrad_store
    info.delay_wgrad_compute = module.delay_wgrad_compute
    info.fuse_wgrad_accumulation = module.fuse_wgrad_accumulation
    named = list(module.named_parameters(recurse=False))
    info.parameter_names = [n for n, _ in named]
    info.parameters = [p for _, p in named]
    info.run_hooks = lambda: mod()._run_wgrad_hooks()
    info.main_grad = lambda n: _main_grad_of(getattr(mod(), n), n)
    info.get_flag = lambda n: _flag_accessors(getattr(mod(), n))[0]()
    info.set_flag = lambda n, v: _flag_accessors(getattr(mod(), n))[1](v)
    return _C.graphs.dwgraph_module_spec(info)


def _foreign_module_spec(name: str, module) -> "_C.graphs.ModuleSpec":
    # Another library's module with backward_dw()/need_backward_dw() (TransformerEngine's):
    # its backward_dw runs its own hooks; weights with main_grad under
    # fuse_wgrad_accumulation accumulate there, every other trainable parameter may land in
    # .grad in backward_dw.
    spec = _C.graphs.ModuleSpec()
    spec.name = name or type(module).__name__
    spec.defers = bool(module.need_backward_dw())
    mod = _weak(module)  # Note [Graphs hold their modules weakly]
    spec.backward_dw = lambda: mod().backward_dw()
    fusing = bool(getattr(module, "fuse_wgrad_accumulation", False))
    deferred, fused = [], []
    for n, p in module.named_parameters():
        qualified = f"{name}.{n}" if name else n
        if fusing and hasattr(p, "main_grad"):
            f = _C.graphs.FusedParameter()
            f.name, f.param = qualified, p
            f.main_grad = lambda p=p, q=qualified: _main_grad_of(p, q)
            f.get_flag, f.set_flag = _flag_accessors(p)
            fused.append(f)
        else:
            deferred.append((qualified, p))
    spec.deferred_names = [n for n, _ in deferred]
    spec.deferred = [p for _, p in deferred]
    spec.fused = fused
    return spec


def _module_specs(module: torch.nn.Module) -> list:
    specs, covered = [], []
    for name, sub in module.named_modules():
        if any(name.startswith(c + ".") for c in covered):
            continue  # inside another library's deferring module: its backward_dw covers it
        if _is_dwgraph_module(sub):
            specs.append(_dwgraph_module_spec(name, sub))
        elif callable(getattr(sub, "backward_dw", None)) and callable(getattr(sub, "need_backward_dw", None)):
            spec = _foreign_module_spec(name, sub)
            if spec.defers:
                specs.append(spec)
                covered.append(name)
    return specs


def around_calls(fn):
    """Marks a module hook as one that belongs around every call of the module, replays
    included (dwgraph's own: FullyShardReducer attaching main_grad); returns ``fn``."""
    fn._dwgraph_around_calls = True
    return fn


def _runs_around_calls(hook) -> bool:
    """A hook on the graphed module itself that must run around each replay, not inside
    the captured region: FSDP2's (it unshards the parameters the graphs read into storage
    it keeps, and reshards after) and the ones marked with around_calls()."""
    if getattr(hook, "_dwgraph_around_calls", False):
        return True
    owner = getattr(hook, "__self__", None)
    return type(owner).__name__ == "FSDPState" and type(owner).__module__.startswith("torch.distributed.fsdp")


def _first_hook(module: torch.nn.Module, include_self: bool):
    """(where, what) of the first module or parameter hook inside `module`, or None."""
    for name, sub in module.named_modules():
        if not name and not include_self:
            continue
        for kind in _HOOK_KINDS:
            hooks = getattr(sub, kind, None) or {}
            if any(name or not _runs_around_calls(h) for h in hooks.values()):
                return ("itself" if not name else repr(name)), kind[1:].replace("_", " ")
    for name, p in module.named_parameters():
        if getattr(p, "_backward_hooks", None):
            return f"parameter {name!r}", "tensor hooks (register_hook)"
    return None


def _user_global_hooks():
    """(kind, hook) of every global module hook (register_module_*_hook) that is not
    dwgraph's own (graphed_step's per-call pre-hook, a no-op on other threads)."""
    return [(kind, h) for kind in _GLOBAL_HOOKS for h in (getattr(torch.nn.modules.module, kind, None) or {}).values()
            if not getattr(h, "_dwgraph_internal", False)]


def _user_global_hook_kind():
    """The first kind of user global module hook, or None."""
    hooks = _user_global_hooks()
    return hooks[0][0] if hooks else None


def _refuse_hooks(index: int, module: torch.nn.Module) -> None:
    """Hooks present at capture would run inside the captured region and never at replay."""
    hook = _first_hook(module, include_self=True)
    if hook is not None:
        raise ArgumentError(
            f"dwgraph.make_graphed_callables: module {index} ('{type(module).__name__}') has {hook[1]} registered "
            f"on {hook[0]}; they would run during capture and never at replay. Register module hooks after "
            "make_graphed_callables on the module itself (they then run around each replay), or pass capture-time "
            "hooks with capture_time_hooks=")
    kind = _user_global_hook_kind()
    if kind is not None:
        raise ArgumentError(
            f"dwgraph.make_graphed_callables: global module {kind[8:].replace('_', ' ')} are registered "
            "(torch.nn.modules.module.register_module_*_hook); they would run during capture and never at "
            "replay. Remove them while capturing")
    for name, buf in module.named_buffers():
        if buf.requires_grad:
            raise ArgumentError(
                f"dwgraph.make_graphed_callables: buffer '{name}' of module {index} requires grad; only parameters "
                "may be trainable (a buffer's gradient would not be handed to anyone)")


def _refuse_autocast_cache(api: str, what: str, fix: str) -> None:
    """The autocast weight cache keeps cast weights across calls; a graph would read them
    after autocast frees them. Shared by make_graphed_callables and graphed_step."""
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled():
            raise ArgumentError(
                f"{api}: {what} under torch.autocast('{device_type}') with the autocast weight cache enabled; the "
                f"cache keeps cast weights from outside the graph, which the graph would read after autocast frees "
                f"them. {fix}")


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

    def __init__(self, native, target, forward: Callable, in_sig: "_Signature", out_sig: Dict[str, Any],
                 autocast):
        self._native = native
        self.module = target
        self._forward = forward
        self._in_sig = in_sig
        self._out = out_sig
        self._autocast = autocast
        is_module = isinstance(target, torch.nn.Module)
        self._dw_modules = [m for m in target.modules() if _is_dwgraph_module(m)] if is_module else []
        self._tree = [id(m) for m in target.modules()] if is_module else []
        self._tree_version = _C.graphs.registration_version()

    def _check_call(self) -> None:
        """What a replay would silently ignore: refused, naming it."""
        now = _autocast_state()
        if now != self._autocast:
            raise ArgumentError(
                f"graphed {self._native.name}: called with autocast {_describe_autocast(now)}, captured with "
                f"{_describe_autocast(self._autocast)}; a graph replays the kernels of its capture. Call it under the "
                "autocast state it was captured in (or capture it in this one)")
        if not isinstance(self.module, torch.nn.Module):
            return
        hook = _first_hook(self.module, include_self=False)
        if hook is None and _user_global_hook_kind() is not None:
            hook = ("every submodule (global)", _user_global_hook_kind()[8:].replace("_", " "))
        if hook is not None:
            raise ArgumentError(
                f"graphed {self._native.name}: {hook[1]} registered on {hook[0]} after capture would not run: the "
                "graphs replay the forward and backward as captured. Register hooks on the graphed module itself, or "
                "remove them (or capture again)")
        version = _C.graphs.registration_version()
        if version != self._tree_version:
            if [id(m) for m in self.module.modules()] != self._tree:
                raise _submodules_changed(self._native.name)
            self._tree_version = version

    def __call__(self, *args, **kwargs):
        _guards.check_data_parallel(self._dw_modules)  # a replay runs no module forward
        if not self._native.replays():
            return self._forward(*args, **kwargs)  # a mode the graphs were not captured in
        self._check_call()
        out_sig = self._out["sig"]
        if (self._in_sig.positional_tensors and not kwargs and len(args) == len(self._in_sig.is_tensor) and
                all(isinstance(a, torch.Tensor) for a in args)):
            outs = self._native(list(args))
            return outs[0] if out_sig.single_tensor else out_sig.rebuild(outs)
        sig = _Signature((args, kwargs))
        if not sig.matches(self._in_sig):
            raise ArgumentError(
                f"graphed {self._native.name}: the arguments must have the structure and non-tensor values of the "
                f"sample arguments (the graphs bake them in); got {sig.spec} with constants "
                f"{[c for c, t in zip(sig.constants, sig.is_tensor) if not t]}, captured {self._in_sig.spec} with "
                f"{[c for c, t in zip(self._in_sig.constants, self._in_sig.is_tensor) if not t]}")
        outs = self._native(_Signature.tensors_of((args, kwargs)))
        return out_sig.rebuild(outs)

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
        ``pool_peak_allocated_bytes``, ``contribution_bytes``, ``static_bytes``,
        ``num_graphs``, ``num_kernels`` and ``graphs`` (one dict per graph: ``callable``, ``kind``,
        ``num_kernels``)."""
        return self._native.stats()

    @property
    def slot(self) -> int:
        return self._native.index

    def __repr__(self) -> str:
        return f"GraphedCallable(slot {self._native.index}: {self._native.name})"


def _autocast_state():
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


def _describe_autocast(state) -> str:
    on = [f"{d} {dtype}" for d, (enabled, dtype) in zip(("cpu", "cuda"), state) if enabled]
    return "on (" + ", ".join(on) + ")" if on else "off"


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
    _order: Optional[Sequence[float]] = None,
    _num_layers_per_chunk: Optional[Sequence[int]] = None,
    _reuse_graph_input_output_buffers: Optional[bool] = None,
    _unsafe_capture_with_caller_grad: bool = False,
):
    """Graphs ``modules`` (one module or callable, or a tuple of them) on the device of
    ``sample_args``. Inputs and outputs may be arbitrary pytrees; tensors are the graphs'
    inputs and outputs, everything else is fixed at capture.

    Sequential schedule (``order=None``): ``sample_args[i]`` is the tuple of arguments of
    callable ``i``. Modules come back as the same objects with their ``forward`` replaced
    (plus ``backward_dw``, ``need_backward_dw`` and ``dwgraph_graphed``); plain callables as
    :class:`GraphedCallable`.

    Pipeline schedule: ``order`` as TransformerEngine's ``_order`` (``+c`` forward of chunk
    ``c`` for its next microbatch, ``-c`` its backward, ``-(c + 0.5)`` its backward-dw,
    chunks from 1); ``modules`` are the layers of all chunks in order
    (``num_layers_per_chunk`` each), ``sample_args`` holds one tuple per (chunk,
    microbatch, layer) slot in that nesting, and one :class:`GraphedCallable` per slot is
    returned.

    TransformerEngine spellings ``_order`` and ``_num_layers_per_chunk`` are accepted;
    ``pool`` may be a dwgraph pool, a ``torch.cuda.graph_pool_handle()`` or a
    ``torch.cuda.MemPool``; ``capture_time_hooks[i]`` (TransformerEngine's meaning) maps
    ``"forward_pre_hooks"``, ``"forward_hooks"``, ``"backward_pre_hooks"`` and
    ``"backward_hooks"`` to dicts of ``fn(module)``, run around warmup and capture, outside
    the captured region, never replayed. ``reuse_static_buffers`` (TransformerEngine's
    ``_reuse_graph_input_output_buffers``; pipeline schedule only): slots of one callable
    whose lifetimes in ``order`` do not overlap share their static inputs and grad outputs.
    ``clone_outputs`` (default): outputs are fresh tensors the caller owns; ``False`` returns
    the graphs' static outputs, overwritten by the slot's next call (torch's and
    TransformerEngine's behaviour, one copy per output per call cheaper).

    ``_unsafe_capture_with_caller_grad`` is for tests only: it captures backward-dw with
    the caller's ``.grad`` in place and skips the hand-off (the unfixed hazard).
    """
    for alias, value, name in ((_order, order, "order"), (_num_layers_per_chunk, num_layers_per_chunk,
                                                          "num_layers_per_chunk")):
        if alias is not None and value is not None:
            raise ArgumentError(f"dwgraph.make_graphed_callables: pass '{name}' or '_{name}', not both")
    if _reuse_graph_input_output_buffers is not None:
        reuse_static_buffers = bool(_reuse_graph_input_output_buffers)
    order = order if order is not None else _order
    num_layers_per_chunk = num_layers_per_chunk if num_layers_per_chunk is not None else _num_layers_per_chunk

    single = not isinstance(modules, (tuple, list))
    if single:
        modules, sample_args = (modules,), (sample_args,)
        if sample_kwargs is not None:
            sample_kwargs = (sample_kwargs,)
    modules = tuple(modules)
    for i, m in enumerate(modules):
        if not callable(m):
            raise ArgumentError(f"dwgraph.make_graphed_callables: modules[{i}] must be a torch.nn.Module or a "
                                f"callable, got {type(m).__name__}")
    if order is None:
        schedule = _C.graphs.Schedule.sequential(len(modules))
        if len({id(m) for m in modules}) != len(modules):
            raise ArgumentError("dwgraph.make_graphed_callables: the same module appears twice; each callable of the "
                                "sequential schedule gets one slot (use 'order' for one slot per microbatch)")
    else:
        schedule = _C.graphs.Schedule.pipeline(order, None if num_layers_per_chunk is None else
                                               [int(n) for n in num_layers_per_chunk], len(modules))
    num_slots = schedule.num_slots
    sample_args = tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args)
    if len(sample_args) != num_slots:
        raise ArgumentError(f"dwgraph.make_graphed_callables: argument 'sample_args' must hold one entry per "
                            f"{'slot' if order is not None else 'callable'} ({num_slots}), got {len(sample_args)}")
    if sample_kwargs is None:
        sample_kwargs = tuple({} for _ in range(num_slots))
    if len(sample_kwargs) != num_slots:
        raise ArgumentError(f"dwgraph.make_graphed_callables: argument 'sample_kwargs' must hold one dict per "
                            f"{'slot' if order is not None else 'callable'} ({num_slots}), got {len(sample_kwargs)}")
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
            modules, schedule, in_sigs, flat_args, hooks, num_warmup_iters=num_warmup_iters,
            allow_unused_input=allow_unused_input, pool=pool, retain_graph_in_backward=retain_graph_in_backward,
            reuse_static_buffers=reuse_static_buffers, clone_outputs=clone_outputs,
            unsafe_capture_with_caller_grad=_unsafe_capture_with_caller_grad)
    except BaseException:
        for m, saved in zip(modules, previous):
            if saved:
                m.__dict__.update(saved)
        raise
    autocast = _autocast_state()
    handles = []
    for native in natives:
        c = native.callable_index
        handles.append(GraphedCallable(native, modules[c], forwards[c], in_sigs[c], out_sigs[c], autocast))
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


def _submodules_changed(name: str) -> GraphStateError:
    return GraphStateError(f"graphed {name}: a submodule was added, removed or replaced since capture; the graphs "
                           "would keep running the captured one. Capture again")


def _call_mode_reader(module: torch.nn.Module):
    """What a call's kernels depend on besides its tensors, as a string the core compares
    with the capture's (a call in another mode runs eagerly): every module's training flag,
    and the grad_dtype of dwgraph modules' parameters, which their forward reads to choose
    the weight-gradient GEMM's output dtype (FSDP2 under a mixed-precision policy switches it
    between microbatches). The tree is read once here (a changed tree is refused at the call
    by _check_call); modules are held weakly (Note [Graphs hold their modules weakly])."""
    name = type(module).__name__
    modules = [_weak(m, lambda: _submodules_changed(name)) for m in module.modules()]
    dw = [(get, n) for get, m in zip(modules, module.modules()) if _is_dwgraph_module(m)
          for n, _ in m.named_parameters(recurse=False)]

    def read() -> str:
        flags = "".join("1" if get().training else "0" for get in modules)
        dtypes = []
        for get, n in dw:
            p = getattr(get(), n)
            g = getattr(p, "grad_dtype", None)
            dtypes.append("." if g is None or g == p.dtype else str(g))
        return flags + "|" + ",".join(dtypes)

    return read


def _slot_reader(module: torch.nn.Module):
    """What every parameter slot of `module`'s tree holds, read at each call without a
    traversal (FSDP2 swaps parameters straight into module._parameters)."""
    slots = [(f"{name}.{n}" if name else n, sub._parameters, n)
             for name, sub in module.named_modules(remove_duplicate=False)
             for n, p in sub._parameters.items() if p is not None]

    def read():
        return [(q, d[n]) for q, d, n in slots if d.get(n) is not None]

    return read


def _capture_all(modules, schedule, in_sigs, flat_args, hooks, **options):
    specs, forwards, out_sigs = [], [], []
    for i, module in enumerate(modules):
        is_module = isinstance(module, torch.nn.Module)
        if is_module:
            _refuse_hooks(i, module)
        # The module's own forward; hooks of the module itself run around the replays, as
        # around eager calls.
        forward = module.forward if is_module else module
        out_sig: Dict[str, Any] = {}
        mod = _weak(module) if is_module else None  # Note [Graphs hold their modules weakly]
        if mod is not None and getattr(forward, "__self__", None) is module and hasattr(forward, "__func__"):
            call = (lambda f, mod: lambda *a, **k: f(mod(), *a, **k))(forward.__func__, mod)
        else:
            # A plain callable, a forward set on the instance or bound some other way
            # (functools.partialmethod): held as given, strongly.
            call = forward

        def run(tensors, call=call, in_sig=in_sigs[i], out_sig=out_sig, i=i):
            args, kwargs = in_sig.rebuild(tensors)
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
            spec.parameters_version = _C.graphs.registration_version
            spec.registered_parameters = _slot_reader(module)
            spec.modules = _module_specs(module)
            named_buffers = list(module.named_buffers())
            spec.buffers = [b for _, b in named_buffers]
            spec.buffer_names = [n for n, _ in named_buffers]
            spec.current_buffers = lambda mod=mod: list(mod().named_buffers())
            spec.training_mode = _call_mode_reader(module)
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
        forwards.append(forward)
        out_sigs.append(out_sig)

    pool = _resolve_pool(options.pop("pool"))
    with RefuseHostReads():
        natives = _C.graphs.make_graphed_callables(specs, flat_args, schedule=schedule, pool=pool, **options)
    return specs, forwards, out_sigs, natives


def summary(graphed) -> str:
    """A small table of a set of graphed callables: each graph with its kernel count, then
    the pool's reserved and live bytes, the contribution and static-buffer bytes.

    ``graphed`` is what :func:`make_graphed_callables` returned (a graphed module, a
    ``GraphedCallable`` or their tuple): the table covers the whole set it belongs to. ``print(dwgraph.summary(g))``.
    """
    first = graphed[0] if isinstance(graphed, (tuple, list)) and graphed else graphed
    first = graphed_handle(first) if isinstance(first, torch.nn.Module) else first
    if not isinstance(first, GraphedCallable):
        raise ArgumentError(f"dwgraph.summary: argument 'graphed' must be what make_graphed_callables returned "
                            f"(a graphed module, a GraphedCallable or their tuple), got {type(graphed).__name__}")
    st = first.stats()
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
        ("contributions", "contribution_bytes"), ("static buffers", "static_bytes"))]
    return "\n".join(out)
