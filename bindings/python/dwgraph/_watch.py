"""Process-wide instrumentation of torch that dwgraph's graphs rely on.

Note [Checks paid when state changes] (graphs/state_epoch.h, contract C10): a graphed
call refuses a parameter replaced, reallocated, frozen or unfrozen since capture, a hook or
submodule added, a module switched to eval, a swapped main_grad (C7, C8). Instead of
looking at the module tree at every call, the core keeps one state epoch and runs a
callable's full checks only after the epoch moved. This module moves it on every change
those checks can see:

* torch's global registration hooks: a parameter, buffer or submodule registered anywhere;
* ``torch.nn.Module.__setattr__``: a module's ``training`` flag changing (``train()``,
  ``eval()``, a direct assignment), dwgraph's module flags, and one of the dicts below
  assigned anew;
* ``Module._apply`` (``.to()``, ``.half()``, ...), ``torch.utils.swap_tensors``, and
  ``torch.Tensor.requires_grad_`` / ``detach_`` / ``set_`` on a watched parameter or tensor
  (as a method or unbound);
* torch's global module hook dicts, replaced by watching dicts;
* torch's reseeding functions (manual_seed, set_rng_state, ...): on a capturing thread
  they tell the core, which refuses a random draw after them (the RNG watch);
* ``Tensor.tolist``, ``numpy``, ``__array__`` and ``__dlpack__``, which read a value on the host without a
  dispatcher call the core could refuse: on a capturing thread they raise (the host-read
  watch; ``.item()``, ``bool(t)``, ``int(t)`` reach the core's own refusal);
* ``torch.amp.GradScaler.unscale_`` (which its ``step()`` calls): on a capturing thread it
  raises (the scaler watch): it keeps the optimizer's "unscaled" stage and its found_inf in
  the scaler's Python state, which a replay does not redo;
* per graphed module tree (:func:`watch_module_tree`): every submodule's parameter,
  buffer, child and hook dicts become watching dicts (a direct ``_parameters[name] = t``,
  as FSDP2 and ``torch.func.functional_call`` do, is seen too), and the parameters' types
  get the setter watch of ``dwgraph._C`` (``.data``, ``.requires_grad``, ``.grad_dtype``,
  ``.main_grad`` assignments), and so do the tree's buffers and the parameters' main_grads,
  one tensor at a time (:func:`watch_tensor`: their type is every tensor's).

A tree that cannot be watched (a parameter type with its own ``__setattr__``) is checked
at every call instead. What is not seen: writes into a module's ``__dict__`` by hand, the
attribute descriptors called directly (``torch.Tensor.data.__set__(p, t)``,
``object.__setattr__``), torch's C methods called on their base class
(``torch._C.TensorBase.set_(p, t)``) and changes made from C++; docs/memory-contract.md lists
them.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref

import torch
import torch.random
import torch.utils.dlpack

from . import _C
from .errors import GraphStateError

__all__ = ["install", "watch_module", "watch_module_tree", "watch_tensor", "changed", "was_displaced"]

changed = _C.graphs.bump_state_epoch  # the one way anything here says "state moved"

# Tensors a module stopped holding (replaced by a registration), held weakly: a graphed
# step that trains one must capture again.
_displaced: "dict[int, weakref.ref]" = {}


def _note_displaced(t: torch.Tensor) -> None:
    key = id(t)
    _displaced[key] = weakref.ref(t, lambda _r, key=key: _displaced.pop(key, None))


def was_displaced(t: torch.Tensor) -> bool:
    """True when a registration replaced `t` in some module since it was made."""
    r = _displaced.get(id(t))
    return r is not None and r() is t


def _watching(base):
    """A subclass of dict type `base` whose mutations move the state epoch. Pickles and
    copies as a plain `base` (a copy is not graphed)."""

    class Watched(base):
        __slots__ = ()

        def __setitem__(self, key, value):
            changed()
            base.__setitem__(self, key, value)

        def __delitem__(self, key):
            changed()
            base.__delitem__(self, key)

        def pop(self, *args):
            changed()
            return base.pop(self, *args)

        def popitem(self, *args):
            changed()
            return base.popitem(self, *args)

        def clear(self):
            changed()
            base.clear(self)

        def update(self, *args, **kwargs):
            changed()
            base.update(self, *args, **kwargs)

        def setdefault(self, key, default=None):
            if key not in self:
                changed()
            return base.setdefault(self, key, default)

        def __ior__(self, other):
            changed()
            return base.__ior__(self, other)

        def __reduce_ex__(self, protocol):
            return base, (list(self.items()),)

    Watched.__name__ = Watched.__qualname__ = f"Watched{base.__name__}"
    return Watched


WatchedDict = _watching(dict)
WatchedOrderedDict = _watching(collections.OrderedDict)
if not hasattr(WatchedDict, "__weakref__"):  # RemovableHandle keeps a weak reference to hook dicts
    WatchedDict = type("WatchedDict", (WatchedDict,), {"__slots__": ("__weakref__",)})

# The per-module dicts a graph's checks depend on: what the module holds and which hooks run.
_STATE_DICTS = ("_parameters", "_buffers", "_modules")
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                      "_global_forward_hooks_always_called", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")
# Module attributes whose change changes what a graph would have captured.
_MODE_ATTRIBUTES = frozenset(("training", "delay_wgrad_compute", "fuse_wgrad_accumulation"))
# The module's dicts themselves, assigned anew (``module._parameters = {...}``,
# ``module._forward_hooks = OrderedDict()``): the change is one, and the new dict of a module
# that was watched keeps watching (watch_module_tree's rule: hook dicts only when empty).
_DICT_ATTRIBUTES = frozenset(_STATE_DICTS + _HOOK_DICTS)
_WATCHED_ATTRIBUTES = _MODE_ATTRIBUTES | _DICT_ATTRIBUTES

_lock = threading.Lock()
_installed = False
_global_hooks_watched = False


def _watched_copy(d):
    cls = WatchedOrderedDict if isinstance(d, collections.OrderedDict) else WatchedDict
    return d if isinstance(d, (WatchedDict, WatchedOrderedDict)) else cls(d)


def _replace_if_safe(owner_dict: dict, name: str) -> bool:
    """Puts a watching copy of owner_dict[name] in its place. Only an empty dict is
    replaced: a RemovableHandle made earlier keeps a reference to the dict it registered
    into, and removing its hook must still reach the dict that is used."""
    d = owner_dict.get(name)
    if d is None:
        return True
    if isinstance(d, (WatchedDict, WatchedOrderedDict)):
        return True
    if name in _STATE_DICTS or not d:
        owner_dict[name] = _watched_copy(d)
        return True
    return False


def global_hooks_watched() -> bool:
    """True when torch's global module hook dicts are watching dicts (they were empty when
    dwgraph was imported); otherwise graphed calls look at them at every call."""
    return _global_hooks_watched


def _after(fn, what=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            changed()

    wrapper._dwgraph_watch = True
    return wrapper


def _on_watched_tensors(fn):
    """`fn` (a tensor method that moves memory or requires_grad: set_, requires_grad_) moves
    the state epoch when it changes a parameter of a watched type or a tensor watched by
    itself, called as a method or unbound (``torch.Tensor.set_(p, t)``). Inside dynamo's
    trace it is left alone: compiled code changes tensors inside its graph, never here."""
    is_watched = _C.graphs.is_watched_tensor
    compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if compiling() or not is_watched(self):
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        finally:
            changed()

    wrapper._dwgraph_watch = True
    return wrapper


def _on_leaf_hooks(fn):
    """`fn` (Tensor.register_hook, register_post_accumulate_grad_hook) moves the tensor
    hook epoch when it registers on a leaf: graphed calls then look at their parameters'
    hooks again (Note [Parameter hooks in autograd's order], graphs/manager_replay.cpp).
    A hook on another tensor (an activation's, every forward) costs one attribute read."""
    bump = _C.graphs.bump_tensor_hook_epoch
    compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if self.grad_fn is None and not compiling():
            bump()
            try:
                out._dwgraph_leaf_hook = True  # its remove() moves the epoch too (_after_removal)
            except AttributeError:  # a handle type without attributes: its removal is not seen
                pass
        return out

    wrapper._dwgraph_watch = True
    return wrapper


def _after_removal(fn):
    """RemovableHandle.remove: a leaf's tensor hook removed (a handle _on_leaf_hooks marked)
    moves the tensor hook epoch; any other handle's removal costs one attribute read."""
    bump = _C.graphs.bump_tensor_hook_epoch

    @functools.wraps(fn)
    def remove(self, *args, **kwargs):
        if not getattr(self, "_dwgraph_leaf_hook", False):
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        finally:
            bump()

    remove._dwgraph_watch = True
    return remove


# Single tensors watched (captured buffers and main_grads): id -> weak reference whose
# callback stops the watch when the tensor dies.
_watched_tensors: "dict[int, weakref.ref]" = {}


def _unwatch(key: int) -> None:
    _watched_tensors.pop(key, None)
    try:
        _C.graphs.unwatch_tensor(key)
    except Exception:  # at interpreter shutdown the extension may be gone first
        pass


def watch_tensor(t: torch.Tensor) -> bool:
    """Makes `.data`, `.requires_grad`, `set_()` and `requires_grad_()` of `t` move the state
    epoch (a buffer or main_grad the graphs read: its type is every tensor's). False when
    its type has its own __setattr__."""
    key = id(t)
    r = _watched_tensors.get(key)
    if r is not None and r() is t:
        return True
    if not _C.graphs.watch_tensor_setters(t):
        return False
    _watched_tensors[key] = weakref.ref(t, lambda _r, key=key: _unwatch(key))
    return True


def _install_rng_watch() -> None:
    """torch's reseeding functions tell the core when they run on a capturing thread
    (graphs/recorder.h, note_reseed), which then refuses a random draw after them; inert
    everywhere else. Both graph entry points rely on it."""

    def watched(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _C.graphs.capturing():
                _C.graphs.note_reseed()
            return fn(*args, **kwargs)

        wrapper._dwgraph_rng_watch = True
        return wrapper

    for owner, names in ((torch, ("manual_seed", "set_rng_state", "seed")),
                         (torch.random, ("manual_seed", "set_rng_state", "seed")),
                         (torch.cuda, ("manual_seed", "manual_seed_all", "set_rng_state", "set_rng_state_all"))):
        for name in names:
            fn = getattr(owner, name, None)
            if fn is not None and not getattr(fn, "_dwgraph_rng_watch", False):
                setattr(owner, name, watched(fn))


def _install_host_read_watch() -> None:
    """Inside a capture, the tensor methods that read a value on the host with no dispatcher
    call (the capture would bake the value in; CUDA cannot capture them at all) raise before
    they read. Methods, not a torch function mode: a mode active during the capture would
    make torch take other paths there than eagerly (nn.TransformerEncoderLayer's and
    MultiheadAttention's fast paths are off whenever a mode is active: their last bits
    differ). Calls outside captures cost one check."""
    capturing = _C.graphs.capturing

    def watched(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if capturing():
                _C.graphs.note_refused(f"Tensor.{fn.__name__}")  # refused again should the region catch it
                raise GraphStateError(
                    f"dwgraph graph capture: Tensor.{fn.__name__}() reads a tensor's value on the host (as .item(), "
                    "bool(t) do), which a graph cannot capture (it would replay the value of its capture forever); "
                    "move it out of the captured region")
            return fn(self, *args, **kwargs)

        wrapper._dwgraph_watch = True
        return wrapper

    for name in ("tolist", "numpy", "__array__", "__dlpack__"):
        fn = getattr(torch.Tensor, name)
        if not getattr(fn, "_dwgraph_watch", False):
            setattr(torch.Tensor, name, watched(fn))
    to_dlpack = torch.utils.dlpack.to_dlpack
    if not getattr(to_dlpack, "_dwgraph_watch", False):
        to_dlpack = watched(to_dlpack)
        torch.utils.dlpack.to_dlpack = to_dlpack
        if getattr(torch, "to_dlpack", None) is not None:
            torch.to_dlpack = to_dlpack


def _install_scaler_watch() -> None:
    """Inside a capture, an enabled GradScaler's unscale_ raises before it runs: its kernels
    would replay, its bookkeeping (the optimizer marked unscaled, found_inf kept for step())
    would not, and scaler.step() after a replay would unscale the gradients a second time (a
    review found a step under clipping silently 256 times off). Subclasses that override
    unscale_ (FSDP's ShardedGradScaler) are not seen."""
    capturing = _C.graphs.capturing
    unscale = torch.amp.GradScaler.unscale_
    if getattr(unscale, "_dwgraph_watch", False):
        return

    @functools.wraps(unscale)
    def wrapper(self, optimizer):
        if getattr(self, "_enabled", True) and capturing():
            _C.graphs.note_refused("GradScaler.unscale_")  # refused again should the region catch it
            raise GraphStateError(
                "dwgraph graph capture: GradScaler.unscale_() (which GradScaler.step() calls) inside the captured "
                "region: it marks the optimizer unscaled and keeps its found_inf in the scaler's Python state, "
                "which a replay does not redo, so scaler.step() after a replay would unscale the gradients again. "
                "Keep scaler.scale(loss).backward() inside; call scaler.unscale_(optimizer) (and gradient "
                "clipping), scaler.step(optimizer) and scaler.update() after the graphed step returns")
        return unscale(self, optimizer)

    wrapper._dwgraph_watch = True
    torch.amp.GradScaler.unscale_ = wrapper


def install() -> None:
    """Once per process (import dwgraph)."""
    global _installed, _global_hooks_watched
    with _lock:
        if _installed:
            return
        module_mod = torch.nn.modules.module
        Module = torch.nn.Module

        def registration_hook(table):
            def hook(module, name, value):
                old = getattr(module, table, {}).get(name)
                if old is value:
                    # Registered again (a forward re-tying a weight at every call: self.dec.weight
                    # = self.enc.weight): nothing displaced. Noted as displaced, it made a graphed
                    # step that trains it drop its graphs at every call and run eagerly for good.
                    pass
                elif isinstance(old, torch.nn.Module):
                    for t in list(old.parameters()) + list(old.buffers()):
                        _note_displaced(t)
                elif isinstance(old, torch.Tensor):
                    _note_displaced(old)
                _C.graphs.bump_registration_epoch()

            return hook

        module_mod.register_module_parameter_registration_hook(registration_hook("_parameters"))
        module_mod.register_module_module_registration_hook(registration_hook("_modules"))
        module_mod.register_module_buffer_registration_hook(registration_hook("_buffers"))

        setattr_ = Module.__setattr__

        def __setattr__(self, name, value):
            if name in _WATCHED_ATTRIBUTES:
                old = self.__dict__.get(name, value)
                if old is not value:
                    changed()
                    # Only plain dicts: another library's dict type keeps its own behaviour.
                    if (name in _DICT_ATTRIBUTES and isinstance(old, (WatchedDict, WatchedOrderedDict))
                            and type(value) in (dict, collections.OrderedDict) and (name in _STATE_DICTS or not value)):
                        value = _watched_copy(value)
            setattr_(self, name, value)

        __setattr__._dwgraph_watch = True
        functools.update_wrapper(__setattr__, setattr_)
        Module.__setattr__ = __setattr__
        Module._apply = _after(Module._apply)
        torch.utils.swap_tensors = _after(torch.utils.swap_tensors)
        # On torch.Tensor, not Parameter: unbound calls (torch.Tensor.set_(p, t)), parameters
        # of tensor subclasses (whose type is not Parameter) and watched buffers go through it.
        # The in-place methods that give a tensor other sizes or strides over its memory too,
        # and detach_ (it freezes a parameter as requires_grad_(False) does: a review found a
        # graphed step training a weight frozen so).
        for name in ("requires_grad_", "detach_", "set_", "t_", "transpose_", "swapdims_", "swapaxes_",
                     "as_strided_", "squeeze_", "unsqueeze_", "resize_", "resize_as_"):
            fn = getattr(torch.Tensor, name, None)
            if fn is None:
                continue
            if not getattr(fn, "_dwgraph_watch", False):
                setattr(torch.Tensor, name, _on_watched_tensors(fn))
        for name in ("register_hook", "register_post_accumulate_grad_hook"):
            fn = getattr(torch.Tensor, name, None)
            if fn is not None and not getattr(fn, "_dwgraph_watch", False):
                setattr(torch.Tensor, name, _on_leaf_hooks(fn))
        # A leaf's tensor hook removed through its handle moves the tensor hook epoch too: a
        # graphed step captured with a parameter's hook must not replay it after its removal.
        remove = torch.utils.hooks.RemovableHandle.remove
        if not getattr(remove, "_dwgraph_watch", False):
            torch.utils.hooks.RemovableHandle.remove = _after_removal(remove)
        _global_hooks_watched = all(_replace_if_safe(vars(module_mod), n) for n in _GLOBAL_HOOK_DICTS
                                    if n in vars(module_mod))
        _install_rng_watch()
        _install_host_read_watch()
        _install_scaler_watch()
        _installed = True


def watch_module(module: torch.nn.Module, hooks: bool = True) -> bool:
    """Makes `module`'s own dicts of parameters, buffers and children watching dicts (an
    entry added, replaced or removed moves the state epoch: a buffer popped by
    ``reset_fp8_state()``, ``del module.layer``, ``_parameters[name] = p`` as accelerate and
    ``NamedMemberAccessor`` write it), its hook dicts too where `hooks` and they are empty
    (_replace_if_safe), and gives its parameters' types the setter watch. False when some
    of it cannot be watched."""
    d = module.__dict__
    ok = True
    for name in _STATE_DICTS + (_HOOK_DICTS if hooks else ()):
        ok = _replace_if_safe(d, name) and ok
    for p in module._parameters.values():
        if p is not None and not _C.graphs.watch_parameter_setters(type(p)):
            ok = False
    return ok


def watch_module_tree(module: torch.nn.Module) -> bool:
    """Makes every change of `module`'s tree that a graph's checks read move the state
    epoch. False when some of it cannot be watched (its graphed calls then check at every
    call)."""
    ok = _global_hooks_watched
    for sub in module.modules():
        # The graphed module's own hooks run around its replays: not part of its graphs.
        ok = watch_module(sub, hooks=sub is not module) and ok
    for p in module.parameters():
        main_grad = p.__dict__.get("main_grad")
        if isinstance(main_grad, torch.Tensor):
            ok = watch_tensor(main_grad) and ok
    for b in module.buffers():
        ok = watch_tensor(b) and ok
    return ok
