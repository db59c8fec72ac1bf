"""``@dwgraph.graphed_step``: a whole training step as graphs.

    @dwgraph.graphed_step
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        for m in deferred_modules:
            m.backward_dw()
        return loss

    for x, y in data:
        loss = train_step(x, y)          # warmup calls run eagerly, then capture, then replay
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

Every call behaves like the undecorated function run eagerly, to the bit on the same
backend: the step may read and change ``.grad`` (clipping, loss scaling), accumulate
across calls, draw random numbers, and step an optimizer whose step can be captured. The
C++ core (``dwgraph._C.graphs.GraphedStep``) owns keys, variants, capture, checks and the
gradient hand-back (Note [A step's gradients are graph state]); this module finds what the
step touches and turns arguments into tensors and a key. See docs/graphed-step.md.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copy
import dataclasses
import enum
import functools
import hashlib
import itertools
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.optim.optimizer as _optimizer
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from . import _C, _optim, _spec
from . import _watch as _state_watch
from .errors import ArgumentError, GraphStateError, _CreatesState, _FoundMore, count
from .graphs import torch_code_as_captured as _torch_code_as_captured
from .nn import _step_context

__all__ = ["graphed_step", "GraphedStep"]


# -- what a step touches, seen from its own thread ----------------------------------------------
class _Watch(threading.local):
    def __init__(self):
        self.step: Optional["GraphedStep"] = None
        self.optimizer = None  # the optimizer whose step() is running
        self.state_before = None  # inside a capture: its state's keys before that step()
        self.state_none = None  # and the keys whose value was None
        self.seeing: list = []  # (step, its watcher) of each step call running on this thread (_seen_module)


_watch = _Watch()


def _eager_frame(fn=None, *, below: bool = False):
    """Note [A step around compiled code]: dynamo never compiles a frame of `fn` (where a
    compiled region runs code eagerly, after a graph break, it would otherwise compile the
    step's watching code as a frame of its own: one op graphs for inductor, or, for a
    function that tests torch.compiler.is_compiling(), a compiled body that skips what it
    does), yet still traces through `fn` where compiled code calls it. `below`: neither
    does it compile what `fn` calls. Without torch's switch for this, `fn` is dynamo-
    disabled: what the step watches stays exact, the compiled code around it does not."""
    if fn is None:
        return functools.partial(_eager_frame, below=below)
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return torch._dynamo.disable(fn)
    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP,
                                                          FrameAction.SKIP if below else FrameAction.DEFAULT))
    return fn


# Note [A step around compiled code]: a step calls torch.compile'd code (a compiled model,
# a compiled function) like the undecorated function does only if dynamo sees the same
# program. Under an active torch function mode dynamo traces the mode's __torch_function__
# into every op, and with global module hooks it traces the hooks into every module call;
# a dynamo-disabled one there is a graph break, one per op, so inductor fuses nothing and
# even the eager warmup calls round differently. So the step's watcher (_GradientWatcher)
# and its module hook (_seen_module) are traced as nothing (torch.compiler.is_compiling()),
# the compiled graph is the same one (a cache entry of its own: dynamo guards on the mode
# stack's types and on the hooks' keys, hence one key for the hook for the whole process),
# and the eager calls run inductor's kernels, bitwise the undecorated compiled step's.
# Where a compiled region runs code eagerly (after a graph break) dynamo would compile the
# watching code's own frames (one-op graphs for inductor, or a body that tests
# is_compiling() and does nothing): _eager_frame keeps them plain Python there.
# What the watcher does not see inside: a compiled module called from eager code stands
# for its whole module tree and all of its parameters (_seen_module); inside a compiled
# function (or a module.compile()d module) the modules and frozen parameters dynamo traced
# into its graph are not seen: on the host a capture runs that code eagerly (below) and sees them, which
# takes one more capture; a CUDA capture does not, so there their training flags and
# hooks are not in the key (docs/graphed-step.md, "torch.compile inside the step").
#
# Capture: a CUDA graph captures inductor's kernels, so its replays are the compiled
# step's bits too. The host graph records ATen kernels at the dispatcher, and inductor's
# CPU kernels are C++ functions it calls directly, which a host capture would miss (a
# replay would skip them and read the capture's values). So inside a host capture the
# compiled code runs its own Python eagerly (torch's thread-local switch that its compiler
# uses for nested compiled code), and host replays are bitwise the same step with
# torch.compile removed: within inductor's FP32 rounding of the compiled step, not equal
# to it. test_graphed_step.py, test_step_around_an_inductor_compiled_model, checks both.
@_eager_frame(below=True)
def _seen_module(module, _inputs) -> None:
    """The global forward pre-hook that finds the modules a step runs (their training
    flags, buffers and hooks are what its graphs depend on); a no-op on threads running no
    step. Under torch.compile it does nothing and is traced as nothing (Note [A step
    around compiled code]); a torch.compile'd module, called from eager code, stands for
    its whole module tree and every parameter in it (its frozen ones too)."""
    if torch.compiler.is_compiling():
        return
    if _watch.seeing:
        _refuse_fast_path(module, _inputs)
    inner = _compiled_module_tree(module)
    for step, watcher in _watch.seeing:
        step._see_module(module)
        for m in inner:
            step._see_module(m)
            for p in m.parameters(recurse=False):
                watcher._see(p)


def _refuse_fast_path(module, inputs) -> None:  # noqa: C901 - torch's conditions, spelled out
    """Note [Fast paths a step's mode turns off]: torch runs nn.TransformerEncoder(Layer) and
    nn.MultiheadAttention in eval without grad through a fused inference path only while no
    torch function mode is active; a step's call (warmup or capture) runs under its gradient
    watch, so there they would take the standard path, whose values differ from eager's (a
    nested-tensor encoder's padded positions wholly). Refused while the fast path could
    apply (make_graphed_callables and Graph captures run no mode and replay eager's path)."""
    kinds = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention)
    if not isinstance(module, kinds) or module.training:
        return

    def fast_attention(mha) -> bool:  # torch's own conditions on the module (the call's come below)
        return (isinstance(mha, torch.nn.MultiheadAttention) and mha.batch_first and mha._qkv_same_embed_dim and
                mha.num_heads % 2 == 0 and mha.bias_k is None and not mha.add_zero_attn)

    if isinstance(module, torch.nn.MultiheadAttention):
        # Self-attention only; called with keywords (which a pre-hook does not see): refused.
        self_attention = len(inputs) < 3 or (inputs[0] is inputs[1] and inputs[1] is inputs[2])
        if not (fast_attention(module) and self_attention):
            return
    else:
        layer = module.layers[0] if isinstance(module, torch.nn.TransformerEncoder) and len(module.layers) else module
        if not (isinstance(layer, torch.nn.TransformerEncoderLayer) and fast_attention(layer.self_attn) and
                getattr(layer, "activation_relu_or_gelu", False)):
            return
    if torch.is_grad_enabled() and (any(p.requires_grad for p in module.parameters()) or
                                    any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)):
        return
    raise GraphStateError(
        f"dwgraph.graphed_step: a {type(module).__name__} runs in eval without grad inside the step, where torch "
        "takes its fused inference path only when no torch function mode is active; the step watches its calls "
        "with one, so it would run torch's standard path, whose values differ from eager's. Call it outside the "
        "step, or graph it with dwgraph.make_graphed_callables or dwgraph.graphs.Graph (which run no mode)")


_seen_module._dwgraph_internal = True  # not a user's global hook (make_graphed_callables refuses those)


def _compiled_module_tree(module) -> list:
    """The modules inside a torch.compile'd module (an OptimizedModule), else []."""
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(optimized, "OptimizedModule", None)
    if optimized is None or not isinstance(module, optimized):
        return []
    return list(module._orig_mod.modules())


class _ModuleHook:
    """_seen_module, in torch's global forward pre-hooks while any thread runs a step's
    call (warmup and capture; replays run no module), under one key for the life of the
    process: torch.compile guards on the keys of that dict, so a fresh registration per
    call would recompile compiled code inside the step at every call (and fall back to
    eager at its recompile limit)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._key: Optional[int] = None

    # Through the plain dict's methods: dwgraph._watch may have made torch's hook dicts
    # watching dicts, whose changes make every graphed callable check again; this hook is
    # dwgraph's own (_dwgraph_internal), which no check looks at.
    def enter(self) -> None:
        hooks = torch.nn.modules.module._global_forward_pre_hooks
        base = collections.OrderedDict if isinstance(hooks, collections.OrderedDict) else dict
        with self._lock:
            if self._key is None:
                self._key = torch.utils.hooks.RemovableHandle(hooks).id  # a key of its own, never removed
            self._users += 1
            base.__setitem__(hooks, self._key, _seen_module)

    def leave(self) -> None:
        hooks = torch.nn.modules.module._global_forward_pre_hooks
        base = collections.OrderedDict if isinstance(hooks, collections.OrderedDict) else dict
        with self._lock:
            self._users -= 1
            if self._users == 0:
                base.pop(hooks, self._key, None)


_module_hook = _ModuleHook()
_hooks_installed = False
# Per optimizer: its step hooks (step_hooks_state) as of its last eager step() inside a
# graphed step (Note [An optimizer's step hooks, watched]).
_hooks_ran_eagerly: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _install_optimizer_hooks() -> None:
    """Once per process: inert for every thread but one running a graphed step."""
    global _hooks_installed
    if _hooks_installed:
        return

    def pre(opt, args, kwargs):
        if _watch.step is None:
            return
        _watch.step._optimizers.setdefault(id(opt), opt)
        _watch.step._hyper_before.setdefault(id(opt), (opt, _hyperparameters([opt])))
        capturing = _C.graphs.capturing()
        # The refusals first, before this step() is set up: one raised into a hook that
        # catches it (a hook stepping this optimizer inside try/except) leaves the outer
        # step() as it was (a review found the outer optimizer's state removed).
        if capturing and opt not in _watch.step._opt_watches:
            # Not in the variant state this capture was selected by (a new optimizer,
            # replacing one): start again knowing it, so its values select or are read.
            raise _optim.raised_in_capture(_FoundMore(
                f"dwgraph.graphed_step: at capture the step stepped a {type(opt).__name__} its earlier calls did "
                "not; the capture was abandoned and is retried with it"))
        # Note [An optimizer's step hooks, watched]: a hook's first run may make tensors of
        # its own (an EMA's copies), which made inside a capture would be the graph's and
        # made anew at every replay. The hooks as of the optimizer's last eager step() in a
        # step (recorded as they start: a hook that raises to skip the step must not leave
        # the hooks unrecorded, and every later call eager); a capture whose optimizer's
        # hooks are not those (changed, or a new optimizer) runs the call eagerly first, as
        # a warmup call. With warmup_iters=0 (no eager call wanted) the hooks run first
        # inside the capture.
        if not capturing:
            _hooks_ran_eagerly[opt] = _C.graphs.step_hooks_state(opt)
        elif _watch.step._warmup_iters >= 1 and _C.graphs.step_hooks_differ(opt, _hooks_ran_eagerly.get(opt)):
            err = _CreatesState(
                f"dwgraph.graphed_step: the step hooks of {type(opt).__name__} ran inside a capture before "
                "they ran eagerly (they changed, or the optimizer is new); their first run may make state "
                "of their own, which a capture would make the graph's: this call runs eagerly")
            err._dwgraph_complete = True
            raise _optim.raised_in_capture(err)
        found = (_watch.optimizer, _watch.state_before, _watch.state_none)  # an outer step()'s, if any
        _watch.optimizer = opt
        # State made inside a capture would live in the graph's pool and be the capture's,
        # not the caller's: it must exist before (a warmup call makes it). Stateless
        # optimizers (SGD without momentum) make none. A key whose value is None counts as
        # absent: torch's SGD makes a new momentum buffer where it finds None (a user's way
        # to reset momentum).
        _watch.state_before = ({p: {k for k, v in st.items() if v is not None} for p, st in opt.state.items()}
                               if capturing else None)
        _watch.state_none = ({p: {k for k, v in st.items() if v is None} for p, st in opt.state.items()}
                             if capturing else None)
        # Note [Hyperparameters a replay reads] (_optim.py): inside a capture, torch's
        # SGD/Adam implementations read this optimizer's values from its buffer.
        _optim.active.steps.append((opt, _watch.step._route_for(opt) if capturing else None, found))

    def post(opt, args, kwargs):
        if _watch.step is None:
            return
        steps = _optim.active.steps
        # A step() that started inside this one and raised (a hook of its own skipping it,
        # caught by the hook that called it) ran no post-hook: back to what it found.
        while steps and steps[-1][0] is not opt:
            _watch.optimizer, _watch.state_before, _watch.state_none = steps.pop()[2]
        before, before_none = _watch.state_before, _watch.state_none or {}
        # Back to the step() this one ran inside, if any (a step hook stepping another optimizer).
        _watch.optimizer, _watch.state_before, _watch.state_none = steps.pop()[2] if steps else (None, None, None)
        if before is None:
            return
        made = 0
        for p in list(opt.state):
            st = opt.state[p]
            new = {k for k, v in st.items() if v is not None} - before.get(p, set())
            for key in new:  # undo it: the caller's optimizer stays as it was (None where it was None)
                if key in st and p in before and key in before_none.get(p, ()):
                    st[key] = None
                else:
                    del st[key]
            if p not in before and not st:
                del opt.state[p]
            made += bool(new)
        if made:
            err = _CreatesState(
                f"dwgraph.graphed_step: {type(opt).__name__}.step() inside the step would create its state for "
                f"{made} parameter(s) during the capture; run at least one warmup call "
                "(warmup_iters >= 1) so the optimizer creates its state eagerly")
            err._dwgraph_complete = True  # already says what to do: not rewrapped below
            raise _optim.raised_in_capture(err)

    _optimizer.register_optimizer_step_pre_hook(pre)
    _optimizer.register_optimizer_step_post_hook(post)
    _hooks_installed = True


def _state_text(obj) -> str:
    """A scheduler's state in words, a tensor as which tensor it is and its version: its
    values would be read to print it, which a capture refuses (a tensor lr's base_lrs)."""
    if isinstance(obj, torch.Tensor):
        return f"tensor@{id(obj):x}v{obj._version}"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {_state_text(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(_state_text(v) for v in obj) + "]"
    return repr(obj)


def _leaves_of(roots) -> List[torch.Tensor]:
    """The leaves a backward from `roots` accumulates into."""
    out, seen, stack = [], set(), [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            out.append(variable)
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return out


@_eager_frame(below=True)
def _compiler_at_work() -> bool:
    """True while torch.compile compiles a frame on this thread (also in its bookkeeping
    outside the traced region, which handles fake tensors under the active modes)."""
    return torch._guards.CompileContext.try_get() is not None


class _GradientWatcher(TorchFunctionMode):
    """Records, on this thread, what a step may train: every tensor its backward calls give
    a gradient to (the leaves they reach), every tensor whose .grad it reads or sets, and
    every Parameter it passes to a torch function (a frozen one too, so unfreezing it later
    is noticed). Each with its .grad as it was when first seen."""

    def __init__(self, sink: Dict[int, tuple]):
        super().__init__()
        self.sink = sink
        # Tensors torch functions made during this call (a leaf for an adversarial
        # perturbation, a scratch buffer): the step's own, not the caller's state.
        self.made: set = set()

    def _see(self, t) -> None:
        if isinstance(t, torch.Tensor) and id(t) not in self.sink:
            self.sink[id(t)] = (t, t.grad)

    @_eager_frame
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Note [A step around compiled code]: under torch.compile the mode is traced as
        # nothing, so the compiled graph (and inductor's fusion of it) is the one the same
        # code compiles to without the step; the compiler's own work on fake tensors (its
        # bookkeeping after tracing runs under the mode) is not watched either. The call
        # itself runs as the caller's frame would run it (what it calls may be compiled).
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or _compiler_at_work():
            return func(*args, **kwargs)
        self._before(func, args, kwargs)
        result = func(*args, **kwargs)
        self._after(args, kwargs, result)
        return result

    @_eager_frame(below=True)
    def _before(self, func, args, kwargs) -> None:
        if func is torch.Tensor.backward:
            inputs = kwargs.get("inputs")
            for t in (inputs if inputs is not None else _leaves_of([args[0]])):
                self._see(t)
        elif func is torch.autograd.backward:
            tensors = args[0] if args else kwargs.get("tensors")
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            inputs = kwargs.get("inputs")
            for t in (inputs if inputs is not None else _leaves_of(tensors)):
                self._see(t)
        elif getattr(func, "__self__", None) is torch.Tensor.grad and args:
            self._see(args[0])
        else:
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.nn.Parameter):
                    self._see(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, torch.nn.Parameter):
                            self._see(b)

    @_eager_frame(below=True)
    def _after(self, args, kwargs, result) -> None:
        outs = result if isinstance(result, (tuple, list)) else (result,)
        # What the call was given is not made by it: in-place ops return self
        # (x.requires_grad_()), foreach ops their list (torch._foreach_add_(params, ...)).
        given = set()
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, (tuple, list)) else (a,)):
                if isinstance(t, torch.Tensor):
                    given.add(id(t))
        for r in outs:
            if isinstance(r, torch.Tensor) and id(r) not in given:
                self.made.add(id(r))


# -- arguments: tensors anywhere, everything else by value ---------------------------------------
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
            torch.memory_format, enum.Enum, range, slice, type(Ellipsis))
_BY_IDENTITY = (torch.nn.Module, torch.optim.Optimizer, types.FunctionType, types.MethodType,
                types.BuiltinFunctionType, functools.partial, type)


def _flatten(obj, tensors: List[torch.Tensor], path: str):
    """(key text, rebuild function) of `obj`; its tensors are appended to `tensors`."""
    if type(obj) is tuple and obj and all(type(c) is torch.Tensor for c in obj):
        # The common call, step(x, y): the text and rebuild the general branch below gives.
        base, n = len(tensors), len(obj)
        tensors.extend(obj)
        key = _TENSOR_TUPLES.get(n)
        if key is None:
            key = _TENSOR_TUPLES[n] = f"tuple{None!r}[{','.join(['T'] * n)}]"
        return key, lambda ts, base=base, n=n: tuple(ts[base:base + n])
    node = _CONTAINERS.get(type(obj))
    if node is not None:  # a plain tuple, list or dict: the pytree branch below, without its lookups
        return _flatten_node(obj, node, tensors, path) if obj else _EMPTY[type(obj)]
    if isinstance(obj, torch.Tensor):
        index = len(tensors)
        tensors.append(obj)
        return "T", lambda ts, i=index: ts[i]
    if isinstance(obj, _SCALARS):
        return f"{type(obj).__name__}:{obj!r}", lambda ts, v=obj: v
    if isinstance(obj, _BY_IDENTITY) or (callable(obj) and not dataclasses.is_dataclass(obj) and
                                         not hasattr(obj, "__dict__")):
        return f"{type(obj).__name__}@{id(obj):x}", lambda ts, v=obj: v
    if (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) or (
            pytree.SUPPORTED_NODES.get(pytree._get_node_type(obj)) is None and hasattr(obj, "__dict__")):
        # Dataclasses (frozen ones too) and objects with attributes: a shallow copy with
        # the tensors replaced.
        names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else list(vars(obj))
        parts = {k: _flatten(getattr(obj, k), tensors, f"{path}.{k}") for k in names}

        def rebuild(ts, obj=obj, parts=parts):
            new = copy.copy(obj)
            for name, (_, fn) in parts.items():
                object.__setattr__(new, name, fn(ts))
            return new

        return f"{type(obj).__qualname__}({','.join(f'{k}={v[0]}' for k, v in parts.items())})", rebuild
    node = pytree.SUPPORTED_NODES.get(pytree._get_node_type(obj))
    if node is not None:
        return _flatten_node(obj, node, tensors, path)
    raise ArgumentError(f"dwgraph.graphed_step: argument {path} is a {type(obj).__qualname__}, which the step's graph "
                        "key cannot describe (it is neither a tensor, a number, a string, a container, a dataclass "
                        "nor an object with attributes); pass its tensors and values instead")


def _flatten_node(obj, node, tensors: List[torch.Tensor], path: str):
    children, context = node.flatten_fn(obj)
    parts = [_flatten(c, tensors, f"{path}[{i}]") for i, c in enumerate(children)]
    ctx_key = context if isinstance(context, (type(None), str, int, tuple, list)) else type(context).__name__
    return (f"{type(obj).__qualname__}{ctx_key!r}[{','.join(p[0] for p in parts)}]",
            lambda ts, parts=parts, context=context: node.unflatten_fn([fn(ts) for _, fn in parts], context))


# Exact types only: a subclass (a namedtuple, an OrderedDict) takes the general path.
_CONTAINERS = {t: pytree.SUPPORTED_NODES[t] for t in (tuple, list, dict)}
_TENSOR_TUPLES: Dict[int, str] = {}  # key text of a tuple of n plain tensors (_flatten's fast path)
# What an empty one flattens to (a step called without arguments); each rebuild makes a new one.
_EMPTY = {t: _flatten_node(t(), node, [], "") for t, node in _CONTAINERS.items()}


def _hyperparameters(optimizers) -> str:
    # Python numbers in param_groups are baked into a captured optimizer step: a change
    # (a learning-rate schedule) selects another graph. Tensor values are read by the graph.
    # Which parameters each group holds is baked in the same way (a parameter moved to a
    # group with another lr).
    parts = []
    for opt in optimizers:
        for g in opt.param_groups:
            parts.append(repr(sorted((k, _optim.value_text(v)) for k, v in g.items()
                                     if k != "params" and not isinstance(v, torch.Tensor))))
            parts.append(",".join(str(id(p)) for p in g["params"]))
    return ";".join(parts)


def _schedulers_of(optimizers) -> list:
    """The LR schedulers of these optimizers (found once per capture)."""
    import gc

    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    kinds = (LRScheduler, ReduceLROnPlateau)
    out = []
    for o in optimizers:
        for r in gc.get_referrers(o):
            # The scheduler itself, or its __dict__ once something materialised it.
            owners = [r] if isinstance(r, kinds) else (
                [x for x in gc.get_referrers(r) if isinstance(x, kinds) and x.__dict__ is r] if isinstance(r, dict)
                else [])
            out += [x for x in owners if getattr(x, "optimizer", None) is o and x not in out]
    return out


def _digest(text: str) -> str:
    """A short stand-in for a long variant-state text (the core compares it at every call)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _refuse_rebound_tensors(bound: Optional[Dict[int, tuple]]) -> None:
    """Raises GraphStateError (at capture) when the step gave a module's parameter or buffer
    another tensor (``self.running = 0.9 * self.running + 0.1 * x.mean(0)``). Eagerly every
    call makes a new tensor from the one the module holds; a replay runs no Python, so it
    would read the tensor the capture met at every replay and write the one the capture
    made: the buffer would stop moving (a review found it, loss and parameters silently
    apart from eager from the first replay on). What the module held is put back."""
    for module, before in (bound or {}).values():
        changed = _spec.rebound(module, before)
        if changed:
            raise GraphStateError(_spec.rebound_message("dwgraph.graphed_step", type(module).__name__, before,
                                                        changed[0], "its capture", "outside the step"))


def _refuse_fully_sharded(modules) -> None:
    """FSDP2 (``fully_shard``) puts its sharded and unsharded parameters straight into the
    module's parameter dict at every forward, which a watched tree sees as a change at every
    call: the step would run eagerly again forever, never reaching the capture's refusal of
    its DTensor parameters. Refused at the call, before anything runs, once a call has met
    such a module."""
    fsdp_module = _fsdp_module_type()
    if fsdp_module is None:
        return
    for m in modules:
        if isinstance(m, fsdp_module):
            raise ArgumentError(
                f"dwgraph.graphed_step: the step runs {type(m).__name__}, sharded by FSDP2 (fully_shard): its "
                "parameters are DTensors, whose unsharded memory FSDP2 swaps into the module at every forward, which "
                "a graph cannot hold. Graph FSDP2 modules with dwgraph.distributed.FullyShardReducer."
                "make_graphed_callables, which captures their unsharded parameters (docs/distributed.md), or run "
                "this step undecorated")


@functools.lru_cache(maxsize=None)
def _fsdp_module_type():
    """torch's FSDPModule, or None where torch.distributed is not built."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _refuse_changed_arguments(caller, rebuilt, given: List[torch.Tensor], static: List[torch.Tensor]) -> None:
    """Raises GraphStateError (at capture) when the step changed the structure of one of
    its arguments: replaced, added or removed an element of a list or dict argument, or
    set an attribute of an object argument. Eagerly that change reaches the caller's
    object at every call; a replay runs no Python, so the caller's object would stop
    changing after the warmup calls: a silent difference, refused before the graph exists.
    `caller` holds the caller's (args, kwargs), unchanged (the capture ran on `rebuilt`, a
    copy around the static inputs: the caller's tensor given[i] is static[i] there)."""
    static_of = {id(t): s for t, s in zip(given, static)}
    (args, kwargs), (new_args, new_kwargs) = caller, rebuilt
    paths = [(f"args[{i}]", a, b) for i, (a, b) in enumerate(zip(args, new_args))]
    paths += [(f"kwargs[{k!r}]", v, new_kwargs.get(k, _MISSING)) for k, v in kwargs.items()]
    for path, before, after in paths:
        was: List[torch.Tensor] = []
        now: List[torch.Tensor] = []
        try:
            same = (after is not _MISSING and _flatten(before, was, path)[0] == _flatten(after, now, path)[0]
                    and len(was) == len(now) and all(static_of.get(id(a)) is b for a, b in zip(was, now)))
        except ArgumentError:  # the step put something into it that no key describes
            same = False
        if not same:
            raise GraphStateError(
                f"dwgraph.graphed_step: the step changed its argument {path} (an element of a list or dict "
                "replaced, added or removed, or an attribute of an object set); eagerly that change reaches the "
                "caller's object at every call, but a graph replays no Python, so from its capture on the caller's "
                "object would stop changing. Return the values instead (or change the object outside the step)")


_MISSING = object()


def _extent(t: torch.Tensor):
    """The byte range [start, end) of `t`'s elements, or None (no elements, not strided, or
    no memory of its own: a DTensor)."""
    if t.layout != torch.strided or t.numel() == 0:
        return None
    try:
        start = t.data_ptr()
    except RuntimeError:
        return None
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return start, start + (span + 1) * t.element_size()


def _overlaps(extent, ranges: List[tuple]) -> bool:
    """Whether `extent` overlaps one of the disjoint sorted `ranges`."""
    if extent is None or not ranges:
        return False
    i = bisect.bisect_left(ranges, (extent[1],)) - 1  # the last range starting before extent ends
    return i >= 0 and ranges[i][1] > extent[0]


def _call_ref(ref):
    return ref()


def _weakly(step: "GraphedStep", method: str, name: str) -> Callable:
    """`step.<method>` through a weak reference to `step` (Note [A graphed step holds
    itself weakly]); a GraphStateError naming the step if it is gone."""
    ref = weakref.ref(step)

    def call(*args):
        s = ref()
        if s is None:
            raise GraphStateError(f"dwgraph.graphed_step: the step '{name}' was freed while its graphs were in use")
        return getattr(s, method)(*args)

    return call


class GraphedStep:
    """The callable ``@graphed_step`` returns. ``num_graphs`` and ``num_captures`` report
    how many graphs it holds and how often it captured; ``reset()`` releases them."""

    def __init__(self, fn: Callable, *, warmup_iters: int = 3, pool=None, params=None, max_graphs: int = 8,
                 max_captures: int = 128):
        functools.update_wrapper(self, fn)
        # Counts as counts (errors.count); their ranges are the core's to check.
        api = "dwgraph.graphed_step"
        warmup_iters, max_graphs, max_captures = (count(api, "warmup_iters", warmup_iters),
                                                  count(api, "max_graphs", max_graphs),
                                                  count(api, "max_captures", max_captures))
        _install_optimizer_hooks()
        self._fn = fn
        self._given = self._named(params) if params is not None else None
        if self._given is None and warmup_iters == 0:
            # What the step touches is found by running it: one eager call at least (a
            # negative count goes to the core, which refuses it; it was raised to 1 unseen).
            warmup_iters = 1
        self._warmup_iters = warmup_iters
        self._native_max_graphs = max_graphs
        self._handed_modules: Optional[set] = None  # the modules the capture was told about
        # Capturing: what each module the step runs holds (_spec.bound_tensors), as the capture met it.
        self._bound_at_capture: Optional[Dict[int, tuple]] = None
        self._touched: Dict[int, torch.Tensor] = {}  # what the warmup calls trained
        self._modules: Dict[int, torch.nn.Module] = {}
        # Weak: an optimizer the caller replaced (a new phase) and dropped leaves the key's
        # variant state, so the graph that stepped it is not replayed for its successor.
        self._optimizers: "weakref.WeakValueDictionary[int, torch.optim.Optimizer]" = weakref.WeakValueDictionary()
        self._handed: Optional[Dict[int, torch.Tensor]] = None
        self._out_specs: Dict[str, Any] = {}  # per graph (key and gradient pattern)
        self._last_spec = None
        # Every module the step runs, weakly: one built inside the step (a loss module) is
        # gone after its call and must not make every call a new variant.
        self._all_modules: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
        self._current = None
        self._version = _C.graphs.registration_version()
        self._tree: list = []
        self._ran_python = False
        self._hyper_before: Dict[int, tuple] = {}  # this call: each optimizer's values when first seen
        self._changes_own_hyperparameters: Optional[str] = None  # seen in an eager call
        # Note [What selects a graph, watched]: the variant state, rebuilt only for what
        # changed. Modules: the state epoch (training flags, hook dicts made watching dicts
        # when a module is first seen, parameter setters) and which modules the step runs;
        # modules whose hooks cannot be watched are looked at every call.
        self._modules_added = 0
        self._unwatched: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
        self._modules_stamp = None
        self._modules_text = ""
        self._modules_digest = ""
        self._unwatched_words = ""
        # Optimizers: one _optim.OptimizerWatch each; a serial number instead of id() (a
        # new optimizer may get a dead one's id); the routed ones' hyperparameter buffers.
        self._opt_watches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._opt_serials: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._serials = itertools.count(1)
        self._module_types: Dict[type, int] = {}  # _type_number's
        self._state_pushed: tuple = ()
        # The last variant state text and its parts, returned as they are when no part moved.
        self._opt_pushed: Optional[tuple] = None
        self._opt_text = ""
        self._opt_refs: Optional[tuple] = None  # the optimizers' references at the last call
        self._opt_entries: list = []  # (reference, watch) of each, in that order
        self._state_of: tuple = (None, None)  # (modules digest, optimizers text) of _state_text
        self._state_text = ""
        self._plain_probe = None  # Note [A step's plain call]: _variant_probe()'s, with the record
        self._trained_ids: Optional[set] = None  # what _unique_arguments refuses, cached
        self._updated_memory_of: tuple = (None, [])  # (stamp, byte ranges), _updated_memory()
        # Note [A step's checks paid when state changes] (graphs/graphed_step.h): whether
        # every parameter, buffer, main_grad and optimizer state tensor the graphs depend on
        # is watched (a change of its memory or requires_grad moves the state epoch), per
        # kind; the core then checks them only when the epoch moved.
        self._watched: Dict[str, bool] = {}
        name = getattr(fn, "__name__", type(fn).__name__)
        # Note [A graphed step holds itself weakly]: the core keeps the functions it is
        # given for its lifetime, and this object keeps the core. A bound method (or a
        # lambda over self) given to it would close the cycle step -> core -> function ->
        # step through C++, where the garbage collector cannot see it: a dropped step, its
        # graphs, its pool and everything its function reaches (the model, the optimizer)
        # would never be freed. So the core gets functions that reach the step through a
        # weak reference, as graphed modules do (Note [Graphs hold their modules weakly],
        # graphed.py). The core calls them only from inside a call of this object, which
        # holds it alive; its destructor calls none of them.
        self._native = _C.graphs.GraphedStep(
            _weakly(self, "_run_flat", name), warmup_iters=warmup_iters, pool=pool, max_graphs=max_graphs,
            params=_weakly(self, "_params", name), modules=_weakly(self, "_module_specs", name),
            buffers=_weakly(self, "_buffers", name), variant_state=_weakly(self, "_variant_state", name),
            name=name, describe_state=_weakly(self, "_describe_state", name), max_captures=max_captures)

    @staticmethod
    def _named(params):
        if isinstance(params, torch.nn.Module):
            return list(params.named_parameters())
        if isinstance(params, dict):
            return list(params.items())
        out = []
        for i, p in enumerate(params):
            out.append(p if isinstance(p, tuple) else (f"params[{i}]", p))
        return out

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if not kwargs:
            # Note [A step's plain call] (graphs/graphed_step.h, contract C10): distinct plain
            # tensor arguments as in the last such call, nothing it depends on changed: the
            # core replays its graph without the key being built again here.
            outs = self._native.replay_plain(args, self._plain_probe)
            if outs is not None:
                return self._returned(outs)
        # Recorded again only when this call completes: what it finds (a tensor the step
        # trains) must not be missed by a plain call after it raised.
        self._clear_plain_call()
        # Grad mode, autocast and fp8 state, which a graph bakes in (docs/graphed-step.md,
        # "The key"), read by the core in one call.
        ambient, autocast_on = _C.graphs.step_ambient()
        if autocast_on:
            _spec.refuse_autocast_cache("dwgraph.graphed_step", "called",
                                        "Enter autocast inside the step, or pass cache_enabled=False")
        version = _C.graphs.registration_version()
        if version != self._version:
            # A parameter or submodule was (re)registered somewhere. If it was in a module
            # the step runs, what the step trains may have changed, so its graphs are
            # dropped and found again (warmup, capture); modules made elsewhere (a loss
            # module built inside the step, another model) change nothing here.
            _refuse_fully_sharded(self._all_modules.values())
            tree = self._module_tree()
            trained = list(self._touched.values()) + ([p for _, p in self._given] if self._given else [])
            if tree != self._tree or any(_state_watch.was_displaced(t) for t in trained):
                self._native.reset()
                self._touched.clear()
                self._trained_ids = None
                self._all_modules.clear()
                self._unwatched.clear()
                self._out_specs.clear()
                tree = self._module_tree()
            self._version, self._tree = version, tree
        found: List[torch.Tensor] = []
        key_args, rebuild_args = _flatten(args, found, "args")
        key_kwargs, rebuild_kwargs = _flatten(kwargs, found, "kwargs")
        tensors, where = self._unique_arguments(found)
        rebuild = lambda ts: (rebuild_args([ts[i] for i in where]), rebuild_kwargs([ts[i] for i in where]))  # noqa: E731
        # The arguments and the ambient state; the modules' training flags and the
        # optimizers' hyperparameters select a variant (_variant_state), as they are known
        # only after the warmup calls.
        key = f"args {key_args}|kwargs {key_kwargs}|aliases {where}|{ambient}"
        # Eager calls (warmup) run the step on the caller's own arguments, so what it does
        # to them (an append to a list argument, an attribute set on a batch object) is
        # what the undecorated function does; a capture runs it on a rebuilt copy holding
        # the graph's static inputs (_run_flat).
        self._current = (rebuild, key, tensors, args, kwargs)
        try:
            out = self._call(tensors, key)
        finally:
            self._current = None  # the caller's arguments are not kept past the call
        if not kwargs and where == list(range(len(args))) and all(type(a) is torch.Tensor for a in args):
            # Arguments in the form replay_plain() sees (distinct plain tensors): the next
            # such call has this key while the ambient state and the state epoch stay. What
            # _unique_arguments refuses, by identity (a Parameter fails replay_plain's type check).
            trained = self._trained()
            refused = [id(t) for t in self._trained_tensors() if type(t) is torch.Tensor and id(t) in trained]
            probe = self._variant_probe()
            self._native.set_plain_call(len(args), ambient, self._version, key, refused, self._updated_memory())
            self._plain_probe = probe
        return out

    def _clear_plain_call(self) -> None:
        self._plain_probe = None
        self._native.clear_plain_call()

    def _variant_probe(self):
        """Note [A step's plain call]: the probe of the variant state as it is now (see
        _variant_state); None before the variant state was first asked (warmup calls) or
        where it has parts that are not watched."""
        if self._modules_stamp is None:
            return None
        try:
            self._variant_state()
        except Exception:  # noqa: BLE001 - asked again by the next call, which raises before it runs
            return None
        return self._plain_probe

    def _call(self, tensors: List[torch.Tensor], key: str):
        try:
            # Capture again on _FoundMore, now knowing more of what it trains and runs:
            # every retry knows at least one more tensor or module than the last, and
            # those existed before the call, so the retries are bounded.
            limit = 2 * (len(self._touched) + len(self._modules)) + 16
            for attempt in itertools.count():
                try:
                    out = self._native(tensors, key)
                    break
                except _FoundMore:
                    if attempt >= limit:
                        raise
        except _CreatesState:
            # The optimizer's state does not exist yet for what this call steps (state
            # cleared, a param group added): the abandoned capture changed nothing, so this
            # call runs eagerly, as a warmup call, and a later one captures.
            if self._warmup_iters < 1:
                raise
            out = self._native.run_eagerly(tensors)
        return self._returned(out)

    def _returned(self, outs: List[torch.Tensor]):
        """The step's return value from the outputs the core gave this call."""
        if self._ran_python or _C.graphs.registration_version() != self._version:
            # The module tree as this call left it (a capture or eager call may have
            # found modules, or built some): the next call compares against it.
            self._version, self._tree = _C.graphs.registration_version(), self._module_tree()
            self._ran_python = False
        self._hyper_before: Dict[int, tuple] = {}  # this call: each optimizer's values when first seen
        variant = self._native.last_variant
        shape = self._out_specs.get(variant) if variant else None
        if shape is None:  # an eager call, or the capture that just recorded it
            shape = self._last_spec
            if variant:
                self._out_specs[variant] = shape
                if len(self._out_specs) > 2 * self._native_max_graphs:  # those of released graphs
                    live = set(self._native.live_variants)
                    self._out_specs = {k: v for k, v in self._out_specs.items() if k in live}
        spec, is_tensor, one_tensor = shape
        if one_tensor:  # the step returned one tensor (a loss): no tree to rebuild
            return outs[0]
        out = iter(outs)
        return pytree.tree_unflatten([next(out) if t else None for t in is_tensor], spec)

    def _module_tree(self):
        return [(id(m), [(n, id(p)) for n, p in m.named_parameters(recurse=False)],
                 [(n, id(b)) for n, b in m.named_buffers(recurse=False)],
                 [(n, id(c)) for n, c in m.named_children()]) for m in self._all_modules.values()]

    # -- the variant state (Note [What selects a graph, watched]) ---------------------------
    def _see_module(self, module) -> None:
        """A module the step runs: from now on part of its variant state. Its hook dicts
        become watching dicts (an added or removed hook moves the state epoch) and its
        parameters' types get the setter watch (grad_dtype); where that cannot be done (a
        hook registered before the step saw the module, a parameter type with its own
        __setattr__), the module is looked at every call."""
        if self._bound_at_capture is not None and id(module) not in self._bound_at_capture:
            self._bound_at_capture[id(module)] = (module, _spec.bound_tensors(module))  # before its forward runs
        if id(module) in self._all_modules:
            return
        self._all_modules[id(module)] = module
        self._modules_added += 1
        if not _state_watch.watch_module(module):
            self._unwatched[id(module)] = module

    def _type_number(self, cls) -> int:
        """A number per module class (held: a class is not freed while this step lives, so
        its number is never another's)."""
        n = self._module_types.get(cls)
        if n is None:
            n = self._module_types[cls] = len(self._module_types) + 1
        return n

    def _module_words(self, modules) -> str:
        modules = list(modules)
        # Of which classes the modules are: a module replaced by one of another class (a
        # loss module swapped, MSELoss for L1Loss) runs other code, so its graph is another.
        # By class, not by object: a module built inside the step at each call, and kept
        # until the next, is the same code (by object, every call would capture again); a
        # module replaced by another of the same class is not told apart (docs/graphed-step.md).
        which = ",".join(str(self._type_number(type(m))) for m in modules)
        modes = "".join("1" if m.training else "0" for m in modules)
        # The engine casts a leaf's gradient to its grad_dtype and dwgraph modules choose
        # their weight-gradient GEMM's output dtype by it: part of what the kernels are.
        grad_dtypes = ",".join("." if getattr(p, "grad_dtype", None) in (None, p.dtype) else str(p.grad_dtype)
                               for m in modules for p in m.parameters(recurse=False))
        # Module hooks are Python the captured kernels may depend on (a hook that changes
        # an output): hooks added or removed select another graph, captured with them.
        # By handle id (the dict's key, never reused) and function: a hook removed and another
        # registered may get the freed function's address.
        hooks = ",".join(f"{k}:{id(h)}" for m in modules for kind in _spec.HOOK_KINDS for k, h in getattr(m, kind).items())
        return f"modules {which}|training {modes}|grad_dtype {grad_dtypes}|hooks {hooks}"

    def _tensor_hook_words(self) -> str:
        """The tensor hooks (register_hook, register_post_accumulate_grad_hook) of what the
        step trains: a capture runs them, so hooks added or removed select another graph,
        captured with them (dwgraph._watch moves the tensor hook epoch on both)."""
        ids = []
        for t in self._trained_tensors():
            for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                hooks = getattr(t, name, None)
                if hooks:
                    ids += [f"{k}:{id(h)}" for k, h in hooks.items()]  # by handle id, as _module_words
        return "|tensor hooks " + ",".join(ids)

    def _variant_state(self) -> str:
        """Asked by the core at every call after the warmup calls: O(1) in the modules and
        parameters when nothing changed, O(groups) per optimizer (plus one pointer compare per
        parameter of its groups, at C speed)."""
        stamp = (_C.graphs.state_epoch(), self._modules_added, len(self._all_modules), _C.graphs.tensor_hook_epoch(),
                 len(self._touched))
        if stamp != self._modules_stamp:
            words = self._module_words(self._all_modules.values()) + self._tensor_hook_words()
            if _state_watch.global_hooks_watched():
                words += "|global hooks " + ",".join(f"{k}:{id(h)}" for _, k, h in _spec.user_global_hook_items())
            self._modules_text, self._modules_digest, self._modules_stamp = words, _digest(words), stamp
        if self._unwatched or not _state_watch.global_hooks_watched():
            # An unwatched part, recomputed at every call: nothing to reuse.
            words = self._module_words(self._unwatched.values()) if self._unwatched else ""
            if not _state_watch.global_hooks_watched():
                words += "|global hooks " + ",".join(f"{k}:{id(h)}" for _, k, h in _spec.user_global_hook_items())
            self._unwatched_words = words
            self._state_of = (None, None)
            self._plain_probe = None
            return f"modules {self._modules_digest}|unwatched {_digest(words)}|{self._optimizer_state()}"
        optimizers = self._optimizer_state()
        if self._modules_digest is not self._state_of[0] or optimizers is not self._state_of[1]:
            self._state_of = (self._modules_digest, optimizers)
            self._state_text = f"modules {self._modules_digest}|{optimizers}"
        # Note [A step's plain call]: what the binding checks in place of asking this again
        # (the plain call's probe): this text while the hook epoch of its stamp stands, the
        # modules it runs are as many (they are held weakly: one may die between calls) and
        # each optimizer is steady (OptimizerWatch.steady, in the core); the state epoch is
        # checked with the record. The rest of the stamp moves only in a run of the step,
        # whose call clears the record first. Made at every answer, so never older than the
        # text the last call was given.
        self._plain_probe = (stamp[3], self._state_text, [(ref, weakref.ref(w)) for ref, w in self._opt_entries],
                             self._all_modules, stamp[2])
        return self._state_text  # unchanged parts: the text the core compares, as last time

    def _optimizer_state(self) -> str:
        # The dict's own references (WeakValueDictionary.items() pays an iteration guard
        # per call); a snapshot, as a removal may run while this reads.
        refs = tuple(self._optimizers.data.values())
        if refs == self._opt_refs:
            # The optimizers of the last call, in its order: its text while none moved but
            # the numbers a replay reads (_optimizer_state_full's answer, in one check each).
            for ref, w in self._opt_entries:
                o = ref()
                if o is None or not w.steady(o):
                    break
            else:
                return self._opt_text
        text = self._optimizer_state_full(refs)
        if refs != self._opt_refs:
            live = [(r, r()) for r in refs]
            self._opt_refs = refs
            self._opt_entries = [(r, self._opt_watches[o]) for r, o in live if o is not None]
        return text

    def _optimizer_state_full(self, refs: tuple) -> str:
        optimizers = [o for o in map(_call_ref, refs) if o is not None]
        tokens = []
        pushed = []
        moved = changed = False
        for o in optimizers:
            w = self._opt_watches.get(o)
            if w is None:
                w = self._opt_watches[o] = _optim.OptimizerWatch(o)
                self._opt_serials[o] = next(self._serials)
                structure = values = state = True
            else:
                # (Only numbers the replay reads moved: the same graph, its buffer refilled.)
                structure, values, _numbers = w.groups_changed(o)
                state = structure or w.state_changed(o)
            if structure or values:
                tensors = w.group_tensors
                w.refresh_groups(o, structure)
                w.digest = _digest(w.params_text + "#" + w.values_text)
                if w.routed:
                    self._fill_hyper(o, w)
                moved = moved or not _C.graphs.same_objects(tensors, w.group_tensors)
            if state:
                w.refresh_state(o)
                w.state_digest = _digest(w.state_text)
                moved = True
            changed = changed or structure or values or state
            serial = self._opt_serials[o]
            pushed.append(serial)
            tokens.append((serial, w))
        pushed = tuple(pushed)
        if not changed and pushed == self._opt_pushed:
            return self._opt_text  # the same optimizers, none changed: the same text object
        self._opt_pushed = pushed
        if moved or pushed != self._state_pushed:
            # Where the state tensors' memory is: checked by the core when the epoch moved
            # (every call where one cannot be watched).
            state_tensors = [t for o in optimizers for t in self._opt_watches[o].watched_tensors()]
            self._native.set_state_tensors(state_tensors)
            self._note_watched("state", state_tensors)
            self._state_pushed = pushed
            self._clear_plain_call()  # its refused memory holds the old state tensors
        self._opt_text = "optimizers " + ",".join(f"{serial}:{w.digest}:{w.state_digest}" for serial, w in tokens)
        return self._opt_text

    def _fill_hyper(self, opt, w) -> None:
        """Note [Hyperparameters a replay reads]: the values the routed optimizer's captured
        step reads, written into its buffer."""
        _C.graphs.fill_hyper(w.hyper_buffer(), w.hyper)

    def _route_for(self, opt):
        """Inside a capture: the route of `opt`'s step, or None (torch's own code, its values
        in the key)."""
        w = self._opt_watches.get(opt)
        if w is None or not w.routed:
            return None
        return _optim.Route(opt, w.family, w.hyper_buffer())

    def _describe_state(self) -> str:
        """The variant state in words (the log's "what changed"; asked at capture only)."""
        parts = [self._modules_text]
        if self._unwatched_words:
            parts.append(f"unwatched {self._unwatched_words}")
        for _, o in self._optimizers.items():
            w = self._opt_watches.get(o)
            if w is None:
                continue
            name = f"{type(o).__name__}#{self._opt_serials.get(o)}"
            parts += [f"hyperparameters({name}) {w.values_text}", f"param_groups({name}) {w.params_text}",
                      f"optimizer_state({name}) {w.state_text}"]
        return "|".join(parts)

    def _trained_tensors(self):
        """What the step trains: the tensors its calls found, then those given as params=."""
        return itertools.chain(self._touched.values(), (p for _, p in self._given or ()))

    def _trained(self) -> set:
        """The ids of what the step trains (refused as arguments), cached."""
        if self._trained_ids is None:
            self._trained_ids = set(self._touched) | ({id(p) for _, p in self._given} if self._given else set())
        return self._trained_ids

    def _updated_memory(self) -> List[tuple]:
        """Where the memory the step updates is, as disjoint sorted byte ranges [start, end):
        what it trains and its optimizers' state tensors. An argument overlapping one is
        refused: eagerly it sees the update, a static copy does not. Recomputed when the
        state epoch moved (`.data = ...` and `set_()` on a watched tensor move it), what the
        step trains grew, or an optimizer's state moved (its watching dict's version; a
        state not yet watched, at every call)."""
        trained = self._trained()
        optimizers = [o for o in map(_call_ref, tuple(self._optimizers.data.values())) if o is not None]
        states = tuple((id(o.state), o.state.version if type(o.state) is _optim.WatchedState else object())
                       for o in optimizers)
        stamp = (_C.graphs.state_epoch(), id(trained), len(trained), states)
        if self._updated_memory_of[0] != stamp:
            state_tensors = (v for o in optimizers for st in list(o.state.values()) if isinstance(st, dict)
                             for v in st.values() if isinstance(v, torch.Tensor))
            tensors = itertools.chain(self._trained_tensors(), state_tensors)
            ranges = sorted(r for r in map(_extent, tensors) if r is not None)
            merged: List[list] = []
            for a, b in ranges:
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            self._updated_memory_of = (stamp, [tuple(r) for r in merged])
        return self._updated_memory_of[1]

    def _unique_arguments(self, found: List[torch.Tensor]):
        """The distinct tensor arguments, and for each argument its index among them. The
        same tensor twice is one static input; two tensors sharing memory, or a tensor the
        step trains passed as an argument, cannot be copied into static inputs faithfully
        and are refused."""
        trained = self._trained()
        unique, where, index, memory = [], [], {}, {}
        for i, t in enumerate(found):
            if id(t) in index:
                where.append(index[id(t)])
                continue
            if t.requires_grad and (t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None)):
                raise ArgumentError(
                    f"dwgraph.graphed_step: tensor argument {i} has tensor hooks (register_hook or "
                    "register_post_accumulate_grad_hook); a graphed step copies its arguments into static inputs, "
                    "which do not have them, so its gradient would skip them. Register the hook inside the step "
                    "on what it computes, or apply it to the .grad after the call")
            if isinstance(t, torch.nn.Parameter) or id(t) in trained:
                raise ArgumentError(
                    f"dwgraph.graphed_step: tensor argument {i} is a tensor the step trains; a graphed step copies "
                    "its arguments into static inputs, so it would train the copy. Reach parameters through "
                    "modules or closures, not arguments")
            if t.numel() > 0 and t.layout == torch.strided:
                storage = t.untyped_storage().data_ptr()
                if _overlaps(_extent(t), self._updated_memory()):
                    raise ArgumentError(
                        f"dwgraph.graphed_step: tensor argument {i} shares memory with what the step updates (a "
                        "tensor it trains or an optimizer's state tensor, or a view of one); a graphed "
                        "step copies its arguments into static inputs, so the step would read a copy the update "
                        "does not change. Reach it through modules or closures, not arguments")
                if storage in memory:
                    raise ArgumentError(
                        f"dwgraph.graphed_step: tensor arguments {memory[storage]} and {i} share memory; a graphed "
                        "step copies each argument into its own static input, so writes through one would not "
                        "reach the other. Pass one tensor and take the views inside the step")
                memory[storage] = i
            index[id(t)] = len(unique)
            where.append(len(unique))
            unique.append(t)
        return unique, where

    def _run_flat(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        rebuild, key, given, caller_args, caller_kwargs = self._current
        touched: Dict[int, tuple] = {}  # id -> (tensor, its .grad when first seen)
        # A capture follows the core asking what the step trains (_params); any other call
        # is eager. Taken here, so a failed capture leaves no stale "capturing" behind.
        handed, self._handed = self._handed, None
        if handed is not None and not _C.graphs.capturing():
            # The core asked what the step trains for a capture, then ran the call eagerly
            # instead (past max_captures): an eager call, on the caller's own arguments.
            handed = None
        if handed is None:
            # Eager: the caller's own objects, as the undecorated function gets them (the
            # core passes the caller's tensors themselves).
            args, kwargs = caller_args, caller_kwargs
        else:
            # Capturing: the same structure around the graph's static inputs.
            args, kwargs = rebuild(tensors)
        if handed is not None and self._changes_own_hyperparameters:
            raise GraphStateError(
                f"dwgraph.graphed_step: the step changes the hyperparameters of the {self._changes_own_hyperparameters} "
                "it steps (a learning-rate schedule or an assignment to param_groups inside it); a graph replays "
                "the values of its capture and no Python, so the optimizer's param_groups would stop following. "
                "Set them before calling the graphed step (their values select its graphs)")
        self._hyper_before = {i: (o, _hyperparameters([o])) for i, o in self._optimizers.items()}
        # Which GradScaler attributes each optimizer had before this call (a refused capture
        # removes those a GradScaler's step left set).
        scaler_before = {id(o): {n for n in ("grad_scale", "found_inf") if n in vars(o)}
                         for o in self._optimizers.values()}
        # Capturing: the LR schedulers of its optimizers, to refuse (and undo) a step of
        # theirs inside the capture.
        schedulers = _schedulers_of(list(self._optimizers.values())) if handed is not None else []
        sched_before = [(s, _state_text(s.state_dict()), copy.deepcopy(s.state_dict()),
                         [{k: v for k, v in g.items() if k != "params"} for g in s.optimizer.param_groups])
                        for s in schedulers]
        saved = (_watch.step, _watch.optimizer, _optim.active.steps, _optim.active.refused)
        saved_modules = _step_context.modules
        _watch.step, _watch.optimizer, _optim.active.steps, _optim.active.refused = self, None, [], None
        _step_context.modules = self._modules
        saved_known = _step_context.capture_known
        # Capturing: a dwgraph module the core was not told about (its forward or its
        # backward_dw() met for the first time) is refused before it runs anything, as
        # its queued units are not under the capture's guard; the capture is retried.
        _step_context.capture_known = self._handed_modules if handed is not None else None
        watcher = _GradientWatcher(touched)
        seeing = (self, watcher)
        _watch.seeing.append(seeing)
        _module_hook.enter()
        self._bound_at_capture = {i: (m, _spec.bound_tensors(m)) for i, m in self._all_modules.items()} \
            if handed is not None else None
        try:
            # Capturing: torch.optim's SGD and Adam implementations read the routed
            # optimizers' hyperparameters from their buffers (Note [Hyperparameters a
            # replay reads]).
            with watcher, _torch_code_as_captured(), (_optim.routing() if handed is not None
                                                      else contextlib.nullcontext()):
                out = self._fn(*args, **kwargs)
            if _optim.active.refused is not None:
                # A refusal raised inside the capture that the step's own code caught.
                raise _optim.active.refused
        except Exception as e:
            opt = _watch.optimizer
            if handed is not None:
                # A failed capture (retried with what it found, run eagerly instead, or
                # refused) leaves the modules holding what they held: a buffer the step
                # rebinds moved on by each abandoned attempt (a review found it).
                for module, before in self._bound_at_capture.values():
                    _spec.rebound(module, before)
                # A GradScaler's step sets grad_scale/found_inf on the optimizer and removes
                # them after the optimizer's step returns: a capture that failed inside it
                # leaves the optimizers as it found them (a failed capture writes nothing).
                for o in self._optimizers.values():
                    had = scaler_before.get(id(o))
                    for name in ("grad_scale", "found_inf"):
                        if had is not None and name not in had and name in vars(o):
                            del vars(o)[name]
            refused = _optim.active.refused
            if refused is not None and e is not refused:
                # The step's code caught dwgraph's refusal and raised its own error instead
                # (an optimizer step wrapped in try/except ... raise): the refusal decides
                # (retry the capture, or run this call eagerly), as if it had not been caught.
                raise refused from e
            # Only what a capture refuses (the host graph's GraphStateError, CUDA's RuntimeError):
            # a KeyError or TypeError of the optimizer's own code is raised as eagerly.
            # Not the core's refusal of a region that went on past a caught error (Note [A call
            # that raised]): it names the call the step's own code caught, not the optimizer.
            if opt is not None and handed is not None and not getattr(e, "_dwgraph_complete", False) and \
                    not isinstance(e, _FoundMore) and isinstance(e, RuntimeError) and \
                    not isinstance(e, ArgumentError) and "and the region went on" not in str(e):
                raise GraphStateError(
                    f"dwgraph.graphed_step: {type(opt).__name__}.step() inside the step cannot be captured ({e}): it "
                    "reads tensor values on the host. A graphed step reads the hyperparameters and step counts of "
                    "torch.optim.SGD, Adam and AdamW on the CPU at replay (Python-number hyperparameters, Adam's "
                    "betas in [0, 1) as torch's constructor requires); for "
                    "another optimizer pass fused=True where torch has a fused implementation (the CPU too), "
                    "capturable=True on CUDA (with a tensor lr, which it reads at replay), or step the optimizer "
                    "after the graphed step returns") from e
            raise
        finally:
            bound, self._bound_at_capture = self._bound_at_capture, None
            _module_hook.leave()
            _watch.seeing.remove(seeing)
            _watch.step, _watch.optimizer, _optim.active.steps, _optim.active.refused = saved
            _step_context.modules = saved_modules
            _step_context.capture_known = saved_known
        self._ran_python = True
        stepped = [s for s, text, _, _ in sched_before if _state_text(s.state_dict()) != text]
        if stepped:
            # Undo it (the refused capture changes nothing), then refuse.
            for s, _, state, groups in sched_before:
                s.load_state_dict(state)
                for g, saved in zip(s.optimizer.param_groups, groups):
                    g.update(saved)
            raise GraphStateError(
                f"dwgraph.graphed_step: the step steps the LR scheduler {type(stepped[0]).__name__} of an optimizer it "
                "steps; a graph replays no Python, so the schedule would stop at its capture. Step the scheduler "
                "after the graphed step returns")
        if handed is not None:
            _refuse_changed_arguments((caller_args, caller_kwargs), (args, kwargs), given, tensors)
            _refuse_rebound_tensors(bound)
        changed = [type(o).__name__ for o, before in self._hyper_before.values() if _hyperparameters([o]) != before]
        self._changes_own_hyperparameters = changed[0] if changed else None  # as of the latest call
        if changed:
            if handed is not None:  # warmup_iters=0: first seen at capture (the step did run once)
                raise GraphStateError(
                    f"dwgraph.graphed_step: the step changed the hyperparameters of the {changed[0]} it steps (a "
                    "learning-rate schedule or an assignment to param_groups inside it) during its capture; a graph "
                    "would replay the values of its capture. Set them before calling the graphed step")
        inputs = {id(t) for t in tensors}
        touched = {i: v for i, v in touched.items() if i not in inputs and i not in watcher.made}
        if handed is not None:
            # Capturing: the graph hands back only what the core was told about.
            stray = [(t, before) for i, (t, before) in touched.items() if i not in handed]
            if stray:
                for t, before in stray:
                    t.grad = before  # what the capture wrote there is the graph's memory
                self._touched.update({id(t): t for t, _ in stray})  # known from now on
                self._trained_ids = None
                raise _FoundMore(
                    f"dwgraph.graphed_step: at capture the step gave a gradient to (or used the .grad of) "
                    f"{_describe(stray[0][0])} that it did not touch in its earlier calls, so the graph would not hand "
                    "it back; the capture was abandoned and is retried with it")
            hooked = [m for m in self._modules.values() if getattr(m, "_wgrad_hooks", None)]
            if self._optimizers and hooked:
                raise GraphStateError(
                    f"dwgraph.graphed_step: the step steps an optimizer and {type(hooked[0]).__name__} has wgrad hooks; "
                    "hooks run after the step's graph, so they would see gradients only after the optimizer used "
                    "them. Move the optimizer step out of the graphed step, or remove the hooks")
        else:
            if any(i not in self._touched for i in touched):
                self._trained_ids = None
            self._touched.update({i: t for i, (t, _) in touched.items()})
        out_leaves, out_spec = pytree.tree_flatten(out)
        for leaf in out_leaves:
            if leaf is not None and not isinstance(leaf, torch.Tensor):
                raise ArgumentError(
                    f"dwgraph.graphed_step: the step must return tensors (or None), got a {type(leaf).__name__}; "
                    "a graph would return the value of its capture forever. Return the tensor, not its .item()")
        is_tensor = [isinstance(leaf, torch.Tensor) for leaf in out_leaves]
        self._last_spec = (out_spec, is_tensor, out_spec.is_leaf() and is_tensor == [True])
        return [leaf for leaf in out_leaves if leaf is not None]

    # -- what the native step asks -------------------------------------------------------
    def _note_watched(self, kind: str, tensors) -> None:
        """Watches `tensors` (dwgraph._watch.watch_tensor) and tells the core whether all the
        step depends on is watched. A kind found unwatched stays so for the step's lifetime:
        an older key's graphs may still depend on that tensor."""
        ok = self._watched.get(kind, True)
        for t in tensors:
            ok = _state_watch.watch_tensor(t) and ok
        self._watched[kind] = ok
        self._native.watched = all(self._watched.values())

    def _params(self):
        if self._given is not None:
            named = list(self._given)
            known = {id(p) for _, p in named}
            named += [(_describe(t), t) for i, t in self._touched.items() if i not in known]
        else:
            names = {}
            for m in self._modules.values():
                for n, p in m.named_parameters(recurse=False):
                    names.setdefault(id(p), f"{type(m).__name__}.{n}")
            named = [(names.get(i, _describe(t)), t) for i, t in self._touched.items()]
        self._handed = {id(t): t for _, t in named}
        self._note_watched("params", [t for _, t in named])
        return named

    def _buffers(self):
        buffers = [b for m in self._all_modules.values() for b in m.buffers(recurse=False)]
        self._note_watched("buffers", buffers)
        return buffers

    def _module_specs(self):
        self._handed_modules = set(self._modules)
        specs = [_spec.dwgraph_module_spec(type(m).__name__, m) for m in self._modules.values()]
        # A main_grad is read through its parameter (`param.main_grad = t` moves the epoch
        # for a watched parameter); the buffer itself by `.data` / set_().
        fused = [(f.param, f.main_grad() if f.main_grad else None) for s in specs for f in s.fused]
        self._note_watched("main_grads", [t for pair in fused for t in pair if isinstance(t, torch.Tensor)])
        return specs

    # -- reporting ---------------------------------------------------------------------------
    @property
    def num_graphs(self) -> int:
        return self._native.num_graphs

    @property
    def num_captures(self) -> int:
        return self._native.num_captures

    @property
    def num_variants(self) -> int:
        """Distinct (key, variant) pairs the step prepared a graph for, in its lifetime."""
        return self._native.stats()["num_variants"]

    def stats(self) -> Dict[str, Any]:
        """What the step did (Note [A step that keeps capturing], graphs/graphed_step.h):
        ``num_graphs`` (held now), ``num_captures`` (lifetime), ``captures_since_reset`` (what
        ``max_captures`` counts), ``num_variants``, ``num_keys``, ``replays``, ``eager_calls``
        (warmup calls, abandoned captures and ``capture_limited_calls``, the calls run eagerly
        past ``max_captures``), ``released`` (graphs released for room), ``dropped_keys``,
        ``max_graphs``, ``max_captures``, ``max_idle_keys``, the pool's bytes (reserved, live and
        peak: ``pool_reserved_bytes``, ``pool_allocated_bytes``, ``pool_peak_allocated_bytes``), and
        ``optimizers``: per optimizer the step runs, whether its hyperparameters are read at
        replay (``"read at replay"``) or select a graph by value (``"in the key"``)."""
        st = self._native.stats()
        st["optimizers"] = {f"{type(o).__name__}#{self._opt_serials.get(o)}":
                            ("read at replay" if self._opt_watches.get(o) is not None and self._opt_watches[o].routed
                             else "in the key")
                            for _, o in self._optimizers.items()}
        return st

    def summary(self) -> str:
        """A few lines: graphs, captures, variants, keys, calls, pool, optimizers."""
        st = self.stats()
        fmt = _C.format_bytes
        out = [f"dwgraph.graphed_step {self.__name__}: {st['num_graphs']} graphs held (max_graphs={st['max_graphs']})",
               f"  captures        {st['num_captures']} ({st['captures_since_reset']} since reset, "
               f"max_captures={st['max_captures']})",
               f"  variants        {st['num_variants']}",
               f"  keys            {st['num_keys']} ({st['dropped_keys']} dropped, max_idle_keys={st['max_idle_keys']})",
               f"  calls           {st['replays']} replayed, {st['eager_calls']} eager "
               f"({st['capture_limited_calls']} past max_captures)",
               f"  released        {st['released']} graphs",
               f"  pool reserved   {fmt(st['pool_reserved_bytes'])}",
               f"  pool live       {fmt(st['pool_allocated_bytes'])}",
               f"  pool peak       {fmt(st['pool_peak_allocated_bytes'])}"]
        out += [f"  optimizer       {name}: hyperparameters {how}" for name, how in st["optimizers"].items()]
        return "\n".join(out)

    def reset(self) -> None:
        self._native.reset()
        self._out_specs.clear()


def _describe(t: torch.Tensor) -> str:
    kind = "parameter" if isinstance(t, torch.nn.Parameter) else "tensor"
    return f"{kind} of shape {list(t.shape)} ({t.dtype})"


def graphed_step(fn: Optional[Callable] = None, *, warmup_iters: int = 3, pool=None, params=None,
                 max_graphs: int = 8, max_captures: int = 128):
    """Decorates a training step (forward, ``loss.backward()``, ``backward_dw()`` calls,
    optionally gradient clipping and a capturable optimizer step) so it runs as graphs:
    ``warmup_iters`` eager calls per key, then a capture on a private pool, then replays.

    The key is every tensor argument's dtype, shape, strides, device and requires_grad,
    wherever it sits (pytrees, dataclasses, objects' attributes), plus every other argument
    by value (modules, optimizers and functions by identity), the autocast state and the
    Python-number hyperparameters of the optimizers the step runs. Arguments the key cannot
    describe are refused. Up to ``max_graphs`` graphs are kept, least recently used
    released first. ``params``: what the step trains (a module, a dict, or tensors);
    by default whatever its backward calls reach during the warmup calls, so at least one
    warmup call runs. Returned tensors are fresh tensors the caller owns.

    The learning rates, momenta, betas, eps and weight decays of ``torch.optim.SGD``,
    ``Adam`` and ``AdamW`` stepped inside the step (CPU) are read at replay: an LR
    scheduler stepped outside the step selects no new graph. A step that keeps capturing
    warns once; after ``max_captures`` captures since its last ``reset()`` it runs calls
    that would capture eagerly (``stats()``, ``summary()``)."""
    def wrap(f):
        return GraphedStep(f, warmup_iters=warmup_iters, pool=pool, params=params, max_graphs=max_graphs,
                           max_captures=max_captures)

    return wrap(fn) if fn is not None else wrap
