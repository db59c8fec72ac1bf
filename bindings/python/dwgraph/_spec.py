"""How a ``torch.nn.Module`` is described to the C++ core (``dwgraph._C.graphs``), for both
graph entry points (``make_graphed_callables`` and ``graphed_step``): which of its modules
defer weight gradients and how their gradients land (module specs), which hooks are the
user's and where they sit, what a call's mode is, and the rules both entry points share.

Note [Graphs hold their modules weakly]: the core keeps the functions it is given; a strong
reference from there to a module would close the cycle module -> its graphed forward ->
graphs -> module through C++, where the garbage collector cannot see it, and a dropped
graphed model would never be freed. Every function handed to the core reaches its module
through :func:`weak`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import _C
from .errors import ArgumentError, GraphStateError
from .nn import _DeferredWgradModule

__all__ = ["is_dwgraph_module", "weak", "module_specs", "dwgraph_module_spec", "around_calls", "first_hook",
           "user_global_hooks", "refuse_hooks", "refuse_autocast_cache", "call_mode_reader", "slot_reader",
           "submodules_changed", "saved_state_seen", "bound_tensors", "rebinding", "rebound", "rebound_message", "HOOK_KINDS"]

HOOK_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def is_dwgraph_module(m) -> bool:
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


def weak(module: torch.nn.Module, freed: Optional[Callable[[], Exception]] = None):
    """A function returning `module` while it lives, raising `freed()` (default: a
    GraphStateError naming it) after (Note [Graphs hold their modules weakly]). The module
    owns its graphs, so it outlives every call that asks."""
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


def dwgraph_module_spec(name: str, module) -> "_C.graphs.ModuleSpec":
    mod = weak(module)
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


def _fused_parameter(name: str, p: torch.Tensor) -> "_C.graphs.FusedParameter":
    f = _C.graphs.FusedParameter()
    f.name, f.param = name, p
    f.main_grad = lambda p=p, q=name: _main_grad_of(p, q)
    f.get_flag, f.set_flag = _flag_accessors(p)
    return f


def _foreign_module_spec(name: str, module) -> List["_C.graphs.ModuleSpec"]:
    # Another library's module with backward_dw()/need_backward_dw() (TransformerEngine's,
    # a Megatron layer): its backward_dw runs its own hooks; every trainable parameter may
    # land in .grad in backward_dw, except weights with main_grad under
    # fuse_wgrad_accumulation, which accumulate there. dwgraph modules inside it keep their
    # own rule for their parameters, and their stores and hooks go with the spec. The fused
    # weights of dwgraph modules inside it that do not defer accumulate in the main
    # backward, not in its backward_dw(): they get a spec of their own that does not defer
    # (a partial backward that skips one is refused as it is outside such a layer).
    spec = _C.graphs.ModuleSpec()
    spec.name = name or type(module).__name__
    spec.defers = bool(module.need_backward_dw())
    mod = weak(module)
    spec.backward_dw = lambda: mod().backward_dw()
    fusing = bool(getattr(module, "fuse_wgrad_accumulation", False))
    prefix = f"{name}." if name else ""
    owned = {}  # id(param) -> the dwgraph module inside that owns it
    for sub_name, sub in module.named_modules():
        if sub is module or not is_dwgraph_module(sub):
            continue
        for p in sub.parameters(recurse=False):
            owned.setdefault(id(p), sub)
        sub_ref = weak(sub)
        spec.add_inner(sub._wgrad_store, lambda sub_ref=sub_ref: sub_ref()._run_wgrad_hooks(),
                       bool(sub.delay_wgrad_compute))
    deferred, fused, undeferred_fused = [], [], []
    for n, p in module.named_parameters():
        qualified = prefix + n
        inner = owned.get(id(p))
        if inner is not None:
            role = _C.nn.classify_parameter(n.rsplit(".", 1)[-1], inner.delay_wgrad_compute,
                                            inner.fuse_wgrad_accumulation)
            if role == "fused":
                (fused if inner.delay_wgrad_compute else undeferred_fused).append(_fused_parameter(qualified, p))
            elif role == "deferred":
                deferred.append((qualified, p))
        elif fusing and hasattr(p, "main_grad"):
            fused.append(_fused_parameter(qualified, p))
        else:
            deferred.append((qualified, p))
    spec.deferred_names = [n for n, _ in deferred]
    spec.deferred = [p for _, p in deferred]
    spec.fused = fused
    if not undeferred_fused:
        return [spec]
    main = _C.graphs.ModuleSpec()
    main.name = f"{spec.name} (main backward)"
    main.defers = False
    main.fused = undeferred_fused
    return [spec, main]


def _is_foreign_deferring(m) -> bool:
    return callable(getattr(m, "backward_dw", None)) and callable(getattr(m, "need_backward_dw", None))


def module_specs(module: torch.nn.Module) -> list:
    """One spec per dwgraph module of the tree and per other deferring module (whose own
    backward_dw() covers everything inside it, the root included)."""
    specs, covered = [], []
    for name, sub in module.named_modules():
        if any(c == "" or name.startswith(c + ".") for c in covered):
            continue  # inside another library's deferring module: its backward_dw covers it
        if is_dwgraph_module(sub):
            specs.append(dwgraph_module_spec(name, sub))
        elif _is_foreign_deferring(sub):
            foreign = _foreign_module_spec(name, sub)
            if foreign[0].defers:
                specs.extend(foreign)
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


def first_hook(module: torch.nn.Module, include_self: bool):
    """(where, what) of the first module hook inside `module`, or None. Parameters' tensor
    hooks are not among them: the graphed backward hands each parameter's gradient to its
    AccumulateGrad, which runs them as in eager (Note [Parameter tensor hooks at replay] in
    graphs/manager_impl.h)."""
    for name, sub in module.named_modules():
        if not name and not include_self:
            continue
        for kind in HOOK_KINDS:
            hooks = getattr(sub, kind, None) or {}
            if any(name or not _runs_around_calls(h) for h in hooks.values()):
                return ("itself" if not name else repr(name)), kind[1:].replace("_", " ")
    return None


def user_global_hook_items():
    """(kind, handle id, hook) of every global module hook (register_module_*_hook) that is
    not dwgraph's own (graphed_step's per-call pre-hook, a no-op on other threads)."""
    return [(kind, k, h) for kind in _GLOBAL_HOOKS
            for k, h in (getattr(torch.nn.modules.module, kind, None) or {}).items()
            if not getattr(h, "_dwgraph_internal", False)]


def user_global_hooks():
    """(kind, hook) of every global module hook that is not dwgraph's own."""
    return [(kind, h) for kind, _, h in user_global_hook_items()]


def user_global_hook_kind():
    """The first kind of user global module hook, or None."""
    hooks = user_global_hooks()
    return hooks[0][0] if hooks else None


def refuse_hooks(index: int, module: torch.nn.Module, by: str = "") -> None:
    """Hooks present at capture would run inside the captured region and never at replay.
    `by` names who registered them when it is known (the warmup hooks)."""
    hook = first_hook(module, include_self=True)
    if hook is not None:
        raise ArgumentError(
            f"dwgraph.make_graphed_callables: module {index} ('{type(module).__name__}') has {hook[1]} registered "
            f"on {hook[0]}{by}; they would run during capture and never at replay. Register module hooks after "
            "make_graphed_callables on the module itself (they then run around each replay), or pass capture-time "
            "hooks with capture_time_hooks=")
    kind = user_global_hook_kind()
    if kind is not None:
        raise ArgumentError(
            f"dwgraph.make_graphed_callables: global module {kind[8:].replace('_', ' ')} are registered{by} "
            "(torch.nn.modules.module.register_module_*_hook); they would run during capture and never at "
            "replay. Remove them while capturing")
    for name, buf in module.named_buffers():
        if buf.requires_grad:
            raise ArgumentError(
                f"dwgraph.make_graphed_callables: buffer '{name}' of module {index} requires grad; only parameters "
                "may be trainable (a buffer's gradient would not be handed to anyone)")


def refuse_autocast_cache(api: str, what: str, fix: str) -> None:
    """The autocast weight cache keeps cast weights across calls; a graph would read them
    after autocast frees them. Shared by make_graphed_callables and graphed_step."""
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled():
            raise ArgumentError(
                f"{api}: {what} under torch.autocast('{device_type}') with the autocast weight cache enabled; the "
                f"cache keeps cast weights from outside the graph, which the graph would read after autocast frees "
                f"them. {fix}")


def submodules_changed(name: str) -> GraphStateError:
    return GraphStateError(f"graphed {name}: a submodule was added, removed or replaced since capture; the graphs "
                           "would keep running the captured one. Capture again")


def call_mode_reader(module: torch.nn.Module):
    """What a call's kernels depend on besides its tensors, as a string the core compares
    with the capture's (a call in another mode runs eagerly): every module's training flag,
    and for dwgraph modules their flags and the grad_dtype of their parameters, which their
    forward reads to choose the weight-gradient GEMM's output dtype (FSDP2 under a
    mixed-precision policy switches it between microbatches). The tree is read once here
    (a changed tree is refused at the call); modules are held weakly."""
    name = type(module).__name__
    modules = [weak(m, lambda: submodules_changed(name)) for m in module.modules()]
    dw = [(get, n) for get, m in zip(modules, module.modules()) if is_dwgraph_module(m)
          for n, _ in m.named_parameters(recurse=False)]
    dw_modules = [get for get, m in zip(modules, module.modules()) if is_dwgraph_module(m)]

    def read() -> str:
        flags = "".join("1" if get().training else "0" for get in modules)
        dtypes = []
        for get, n in dw:
            p = getattr(get(), n)
            g = getattr(p, "grad_dtype", None)
            dtypes.append("." if g is None or g == p.dtype else str(g))
        deferral = "".join(f"{int(get().delay_wgrad_compute)}{int(get().fuse_wgrad_accumulation)}" for get in dw_modules)
        return flags + "|" + ",".join(dtypes) + "|" + deferral

    return read


def slot_reader(module: torch.nn.Module):
    """What every parameter slot of `module`'s tree holds (FSDP2 swaps parameters straight
    into module._parameters). Reads the modules' dicts at each call, so a dict the watch
    replaced is the one read."""
    modules = [(name, weak(sub)) for name, sub in module.named_modules(remove_duplicate=False)]
    slots = [(name, i, n) for i, (name, sub) in enumerate(module.named_modules(remove_duplicate=False))
             for n, p in sub._parameters.items() if p is not None]

    def read():
        out = []
        for name, i, n in slots:
            p = modules[i][1]()._parameters.get(n)
            if p is not None:
                out.append((f"{name}.{n}" if name else n, p))
        return out

    return read


@contextlib.contextmanager
def saved_state_seen(module: torch.nn.Module, found: Dict[int, Tuple[str, torch.Tensor]]):
    """Note [State saved for the backward] (graphs/manager_impl.h): while it is entered,
    every tensor autograd saves for the backward that is one of `module`'s parameters or
    buffers, or a view of one, goes into `found` (by id: (qualified name, tensor)). Through
    autograd's saved-tensor hooks: an outer pair (activation offloading) still packs and
    unpacks, this one only looks. Without one, autograd would skip its check of the saved
    tensors' versions while hooks are on (a review found an output changed in place inside
    the forward no longer refused), so the hooks keep each tensor detached (the tensor
    itself would make an output's saved copy hold its own node alive, a cycle Python's
    collector cannot see) with its version, and check it as autograd does. Hooks disabled
    (``disable_saved_tensors_hooks``): nothing is seen."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        yield
        return
    state = {id(t): (n, t) for n, t in module.named_parameters()}
    state.update({id(t): (n, t) for n, t in module.named_buffers()})
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack(t):
        base = t if t._base is None else t._base
        named = state.get(id(base))
        if named is not None and named[1] is base:
            found[id(base)] = named
        return outer[0](t) if outer else (t.detach(), t._version)

    def unpack(packed):
        if outer:
            return outer[1](packed)
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead "
                "(dwgraph: checked during a graph capture, as autograd checks it eagerly)")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def bound_tensors(module: torch.nn.Module) -> Dict[tuple, object]:
    """What `module` holds by name: its own parameters and buffers (the objects), keyed
    ("parameter" or "buffer", name)."""
    out = {("parameter", n): t for n, t in module._parameters.items()}
    out.update({("buffer", n): t for n, t in module._buffers.items()})
    return out


def rebinding(module: torch.nn.Module, before: Dict[tuple, object]) -> List[tuple]:
    """The (kind, name) of what `module` holds now that is not the object it held in
    `before` (bound_tensors), by identity, sorted."""
    now = bound_tensors(module)
    return sorted(key for key in set(before) | set(now) if now.get(key) is not before.get(key))


def rebound(module: torch.nn.Module, before: Dict[tuple, object]) -> List[tuple]:
    """The (kind, name) of what `module` holds now that is not the object it held in
    `before` (bound_tensors), put back as it was: a forward that gives a buffer another
    tensor (``self.running = 0.9 * self.running + ...``), seen at a capture, which a replay
    cannot follow (it runs no Python: it would read the tensor the capture met)."""
    changed = rebinding(module, before)
    for kind, name in changed:
        table = module._parameters if kind == "parameter" else module._buffers
        if (kind, name) in before:
            table[name] = before[(kind, name)]
        else:
            table.pop(name, None)
    return changed


def rebound_message(api: str, who: str, before: Dict[tuple, object], key: tuple, when: str, outside: str) -> str:
    """Why a capture is refused for `key` of rebound(): a parameter or buffer the region
    made (a mask or cache made by a first forward: run one forward eagerly first), or one it
    gave another tensor (update it in place)."""
    kind, name = key
    if key not in before:
        return (f"{api}: {who} registers its {kind} '{name}' during {when} (made by its first forward); the "
                f"graphs would hold one the module did not have. Run one forward eagerly before capturing, so that "
                f"it exists")
    return (f"{api}: {who} gives its {kind} '{name}' another tensor during {when} (an assignment such as "
            f"self.{name} = 0.9 * self.{name} + ...); a graph replays no Python, so every replay would read the "
            f"{kind} the capture met. Update it in place (self.{name}.mul_(0.9).add_(...)), or {outside}")
