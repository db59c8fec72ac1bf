"""Optimizers inside a graphed step: what their graphs read at replay, and what selects one.

Note [Hyperparameters a replay reads] (ops/optim.cpp, contract C10): a learning rate that
a schedule moves is data, not code. A host graph replays the dispatcher calls of its
capture with the arguments of its capture, and torch.optim's CPU implementations pass
their Python-number hyperparameters as such arguments (``param.add_(grad, alpha=-lr)``)
and read Adam's step count with ``.item()``. So while ``graphed_step`` captures the step of
a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (their own ``step()``, CPU parameters, the
hyperparameters Python numbers), its single-tensor, foreach and fused implementations
run as ``dwgraph::optim_sgd_`` / ``dwgraph::optim_adam_``: the same algorithm calling the
same ATen kernels with the same values, but reading every hyperparameter from a float64
buffer (and the step counts from the state tensors) each time it runs. The step fills the
buffer from ``param_groups`` before each call, so one graph replays for every learning
rate, momentum, beta, eps and weight decay a scheduler sets, bitwise the eager step with
those values. Only where torch branches on a value (SGD's ``momentum != 0``, a non-zero
``weight_decay``) and the values' Python types (int or float) are part of the graph's key.
The optimizer itself is not changed: ``param_groups`` keep their Python numbers, eager
calls run torch's own code, and nothing of this is in ``state_dict()``.

Everything else (another optimizer, a subclass with its own ``step()``, CUDA, a tensor
hyperparameter, ``differentiable``, complex parameters, ``grad_scale``/``found_inf``) keeps
torch's code in the capture, with its Python-number hyperparameters in the key: a new
value selects another graph (bounded, and reported, by the step's ``max_captures``).

Note [What selects a graph, watched] (contract C10): a step's variant state reads its
optimizers' param groups and state at every call. Reading them costs O(groups) per call:
the groups' keys and values are compared to the last call's (a tuple of each group's
values), their parameter lists by identity and length and element by element at C speed
(``_C.graphs.same_objects``). ``optimizer.state`` is made a watching dict
(:class:`WatchedState`, which pickles and copies as the plain ``defaultdict`` it was)
whose changes move its own version; ``load_state_dict`` replaces it, which its identity
shows. The text of the variant state is built again only for what changed; where only
numbers a routed replay reads moved (a schedule's learning rate: same types, zero where
torch branches on it as before), nothing of it is: the buffer is refilled in place
(``OptimizerWatch.take_numbers``, one call into the core) and the same graph replays.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.optim.adam as _adam
import torch.optim.sgd as _sgd

from . import _C
from .errors import GraphStateError

__all__ = ["WatchedState", "OptimizerWatch", "routing", "active", "family_of"]


# -- which optimizers take the tensor path -------------------------------------------------------
_SGD_VALUES = ("lr", "momentum", "dampening", "weight_decay")
_ADAM_VALUES = ("lr", "beta1", "beta2", "eps", "weight_decay")
# Where torch's code branches on a value: part of the key (zero or not).
_BRANCHES = {"sgd": frozenset(("momentum", "weight_decay")), "adam": frozenset(("weight_decay",))}
_VALUES = {"sgd": _SGD_VALUES, "adam": _ADAM_VALUES}
# Group keys the values are read from (the rest of a group is in the key by value).
_READ_FROM = {"sgd": frozenset(_SGD_VALUES), "adam": frozenset(("lr", "betas", "eps", "weight_decay"))}
# Group flags the ops take as bools.
_FLAGS = {"sgd": ("nesterov", "maximize"), "adam": ("amsgrad", "maximize", "decoupled_weight_decay")}
# Group flags under which torch runs other code than the ops reproduce.
_NOT_ROUTED_IF = ("differentiable", "capturable")

_IMPLS = {  # (module, function name) -> (family, ops implementation index)
    (_sgd, "_single_tensor_sgd"): ("sgd", 0), (_sgd, "_multi_tensor_sgd"): ("sgd", 1), (_sgd, "_fused_sgd"): ("sgd", 2),
    (_adam, "_single_tensor_adam"): ("adam", 0), (_adam, "_multi_tensor_adam"): ("adam", 1),
    (_adam, "_fused_adam"): ("adam", 2),
}
# The parameters these functions have in the torch versions the ops reproduce; another
# signature means another algorithm: no routing (Python-number values stay in the key).
_SIGNATURES = {
    "sgd": ("params", "grads", "momentum_buffer_list", "grad_scale", "found_inf", "weight_decay", "momentum", "lr",
            "dampening", "nesterov", "maximize", "has_sparse_grad"),
    "adam": ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "grad_scale",
             "found_inf", "amsgrad", "has_complex", "beta1", "beta2", "lr", "weight_decay", "eps", "maximize",
             "capturable", "differentiable", "decoupled_weight_decay"),
}
_ORIGINALS = {key: getattr(*key, None) for key in _IMPLS}
_SIGNATURE_OF = {}
for _key, _fn in _ORIGINALS.items():
    try:
        _SIGNATURE_OF[_key] = inspect.signature(_fn) if _fn is not None else None
    except (TypeError, ValueError):
        _SIGNATURE_OF[_key] = None
_SUPPORTED = {fam for fam in ("sgd", "adam")
              if all(sig is not None and tuple(sig.parameters) == _SIGNATURES[fam]
                     for key, sig in _SIGNATURE_OF.items() if _IMPLS[key][0] == fam)}
_STEPS = {"sgd": inspect.unwrap(torch.optim.SGD.step), "adam": inspect.unwrap(torch.optim.Adam.step)}


def family_of(opt) -> Optional[str]:
    """"sgd" or "adam" when `opt.step` is torch's SGD.step or Adam.step (AdamW's too),
    in a torch whose implementations the ops reproduce; else None."""
    for cls in type(opt).__mro__:
        if "step" in vars(cls):
            fn = inspect.unwrap(vars(cls)["step"])
            for fam, step in _STEPS.items():
                if fn is step and fam in _SUPPORTED:
                    return fam
            return None
    return None


def _read(group: dict, name: str):
    if name == "beta1":
        return group["betas"][0]
    if name == "beta2":
        return group["betas"][1]
    return group[name]


# A value the ops read as the eager step's Python arithmetic computes with it (an int a
# double holds exactly, a float, numpy's float64; not a subclass, not bool; Adam's betas in
# [0, 1), where torch's Python arithmetic computes as the replay does): decided by the core.
_routable = _C.graphs.routable


def _params_routable(opt) -> bool:
    """The parameters' part of the decision (asked when the groups' parameters change):
    real CPU tensors."""
    return all(isinstance(p, torch.Tensor) and p.device.type == "cpu" and not p.is_complex()
               for g in opt.param_groups for p in g["params"])


def _values_routable(opt, fam: Optional[str]) -> bool:
    """The values' part (asked when a group's values change): Python-number
    hyperparameters, none of the flags under which torch runs other code."""
    if fam is None:
        return False
    if _C.graphs.optimizer_scaled(opt):  # a GradScaler's grad_scale/found_inf on it
        return False
    for g in opt.param_groups:
        if any(g.get(flag) for flag in _NOT_ROUTED_IF):
            return False
        # The ops take these as bools; torch's code may refuse another type (fused kernels).
        if any(type(g[flag]) is not bool for flag in _FLAGS[fam] if flag in g):
            return False
        try:
            if fam == "adam" and len(g["betas"]) != 2:  # torch refuses other lengths; the ops read two
                return False
            if not all(_routable(n, _read(g, n)) for n in _VALUES[fam]):
                return False
        except (KeyError, TypeError, IndexError):
            return False
    return True


def _immutable(v) -> bool:
    """A value whose identity stands for its contents (a change replaces the object)."""
    if v is None or isinstance(v, (int, float, complex, str, bytes, torch.dtype, torch.device, torch.Tensor)):
        return True
    return isinstance(v, tuple) and all(_immutable(x) for x in v)


# -- watching optimizer.state ------------------------------------------------------------------
class _WatchedInner(dict):
    """One parameter's state: a change (a new tensor for a key, a key removed) moves the
    version of the WatchedState it belongs to; assigning the same object again (SGD does,
    at every step) does not."""

    __slots__ = ("_owner",)

    def _moved(self):
        owner = self._owner
        if owner is not None:
            owner.version += 1

    def __setitem__(self, key, value):
        if dict.get(self, key, _MISSING) is not value:
            self._moved()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self._moved()
        dict.__delitem__(self, key)

    def pop(self, *args):
        self._moved()
        return dict.pop(self, *args)

    def popitem(self):
        self._moved()
        return dict.popitem(self)

    def clear(self):
        self._moved()
        dict.clear(self)

    def update(self, *args, **kwargs):
        self._moved()
        dict.update(self, *args, **kwargs)

    def setdefault(self, key, default=None):
        if key not in self:
            self._moved()
        return dict.setdefault(self, key, default)

    def __ior__(self, other):
        self._moved()
        return dict.__ior__(self, other)

    def __reduce_ex__(self, protocol):
        return dict, (list(self.items()),)


_MISSING = object()


class WatchedState(collections.defaultdict):
    """``optimizer.state`` while a graphed step steps the optimizer: a ``defaultdict(dict)``
    whose changes (a parameter's state made, replaced or removed, ``clear()``) move
    ``version``. Pickles, copies and deep-copies as a plain ``defaultdict(dict)``."""

    __slots__ = ("version",)

    def __init__(self, items=()):
        super().__init__(dict)
        self.version = 0
        for k, v in (items.items() if hasattr(items, "items") else items):
            self[k] = v

    def _inner(self, value):
        if type(value) is dict:
            inner = _WatchedInner(value)
            inner._owner = self
            return inner
        if isinstance(value, _WatchedInner) and value._owner is not self:
            inner = _WatchedInner(value)
            inner._owner = self
            return inner
        return value

    def __missing__(self, key):
        value = self[key] = self._inner({})
        return value

    def __setitem__(self, key, value):
        self.version += 1
        collections.defaultdict.__setitem__(self, key, self._inner(value))

    def __delitem__(self, key):
        self.version += 1
        collections.defaultdict.__delitem__(self, key)

    def pop(self, *args):
        self.version += 1
        return collections.defaultdict.pop(self, *args)

    def popitem(self):
        self.version += 1
        return collections.defaultdict.popitem(self)

    def clear(self):
        self.version += 1
        collections.defaultdict.clear(self)

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default if default is not None else {}
        return collections.defaultdict.__getitem__(self, key)

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce_ex__(self, protocol):
        return collections.defaultdict, (dict,), None, None, iter((k, dict(v) if isinstance(v, _WatchedInner) else v)
                                                                   for k, v in self.items())

    def __copy__(self):
        return collections.defaultdict(dict, self)

    def __repr__(self):
        return repr(collections.defaultdict(dict, self))


def _watch_state(opt) -> WatchedState:
    state = opt.state
    if isinstance(state, WatchedState):
        return state
    if not (isinstance(state, collections.defaultdict) and state.default_factory is dict):
        return None  # an optimizer that keeps its state otherwise: looked at every call
    watched = WatchedState(state)
    opt.state = watched
    if opt not in _plain_state_dicts and hasattr(opt, "register_state_dict_post_hook"):
        opt.register_state_dict_post_hook(_plain_state_dict)
        _plain_state_dicts.add(opt)
    return watched


# Optimizers whose state_dict() gives their per-parameter state as plain dicts again.
_plain_state_dicts: "weakref.WeakSet" = weakref.WeakSet()


def _plain_state_dict(opt, state_dict):
    """optimizer.state_dict() with each parameter's state a plain dict, as torch's own:
    torch.load's weights_only unpickler refuses a dict subclass (the watching dicts)."""
    state = state_dict.get("state")
    if isinstance(state, dict):
        state_dict["state"] = {k: dict(v) if isinstance(v, _WatchedInner) else v for k, v in state.items()}
    return state_dict


# -- the variant state of one optimizer ---------------------------------------------------------
def _same(a: tuple, b: tuple) -> bool:
    """Element by element: the same object, or an equal Python value of the same type."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if type(x) is not type(y) or isinstance(x, torch.Tensor) or not isinstance(x, (int, float, str, bool, tuple,
                                                                                      type(None))):
            return False
        if isinstance(x, tuple):
            # Element by element too: (0.9, 0.999) == (tensor(0.9), tensor(0.999)) is true,
            # but tensor betas run other code than numbers.
            if not _same(x, y):
                return False
            continue
        try:
            if not (x == y):
                return False
        except Exception:  # noqa: BLE001 - something whose == does not give a truth value
            return False
    return True


def value_text(v) -> str:
    """A group value as a variant key sees it, never reading a tensor's data (tensors
    nested in tuples too: tensor betas)."""
    if isinstance(v, torch.Tensor):  # read by the graph: which tensor it is, not its value
        return f"tensor@{id(v):x}:{v.data_ptr():x}"
    if isinstance(v, tuple):
        return "(" + ", ".join(value_text(x) for x in v) + ")"
    return repr(v)


_tokens = itertools.count(1)


class OptimizerWatch:
    """What one optimizer contributes to a step's variant state, recomputed only for what
    changed since the last call (Note [What selects a graph, watched])."""

    def __init__(self, opt):
        self.ref = weakref.ref(opt)
        self.family = family_of(opt)
        # Where a routed replay's numbers are read from (take_numbers, in the core): the
        # group keys, those torch branches on, the buffer's values in order.
        self.read_from = _READ_FROM.get(self.family)
        self.branches = _BRANCHES.get(self.family)
        self.value_names = _VALUES.get(self.family)
        self.groups_list = None  # opt.param_groups, as last seen
        self.groups: List[dict] = []
        self.keys: List[tuple] = []
        self.values: List[tuple] = []
        self.value_list: List[list] = []  # the same, as lists (same_objects compares lists)
        self.params: List[list] = []  # copies of each group's params list
        self.params_text = ""
        self.values_text = ""
        self.routed = False
        self.scaled = False  # a GradScaler's state on the optimizer, as last seen
        self.scaler_seen = (None, None)  # its grad_scale and found_inf (held: compared by identity)
        # Note [An optimizer's step hooks, watched] (bindings/optimizer_watch.cpp): its own
        # and torch's global step hooks, as last seen (step_hooks_state).
        self.step_hooks_seen = None
        self.params_ok = False  # _params_routable, as of the last change of the parameters
        self.volatile = False  # a group holds a mutable value (a list): compared by its text every call
        self.group_tensors: List[torch.Tensor] = []  # tensor values of the groups (a tensor lr)
        self.hyper: List[float] = []  # routed: the buffer's values, in slot order
        # Routed: the step's hyperparameter buffers, one per number of values (a graph
        # captured with another layout keeps reading its own).
        self.hyper_buffers: Dict[int, torch.Tensor] = {}
        self.state_obj = None
        self.state_version = -1
        self.state_text = ""
        self.state_tensors: List[torch.Tensor] = []
        self.changes = 0  # how often the text changed (the step's "what changed" report)

    # Groups ---------------------------------------------------------------------------------
    def groups_changed(self, opt) -> Tuple[bool, bool, bool]:
        """(structure changed, values changed, numbers taken) since the last call; numbers
        taken: only numbers a routed replay reads moved (take_numbers, which refilled the
        buffer), and nothing else changed."""
        pg = opt.param_groups
        if pg is not self.groups_list or len(pg) != len(self.groups):
            return True, True, False
        if _C.graphs.scaler_moved(opt, self) or _C.graphs.step_hooks_moved(opt, self):
            # A GradScaler's state set, removed or replaced between calls; a step hook added
            # or removed (a capture runs them: Note [An optimizer's step hooks, watched]).
            return False, True, False
        # The common case in one call: the same groups, keys, value objects and parameters.
        if _C.graphs.same_groups(pg, self.groups, self.keys, self.value_list, self.params):
            values_changed = False
        else:
            if self.take_numbers(opt):
                return False, False, True
            values_changed = False
            same_objects = _C.graphs.same_objects
            for i, g in enumerate(pg):
                if g is not self.groups[i]:
                    return True, True, False
                ps = g.get("params")
                if not isinstance(ps, list) or not same_objects(ps, self.params[i]):
                    return True, True, False
                if not values_changed and not ((same_objects(list(g.values()), self.value_list[i]) or
                                                _same(tuple(g.values()), self.values[i])) and tuple(g) == self.keys[i]):
                    # (The same objects as last time is the common case, compared at C speed;
                    # otherwise equal values of the same types.)
                    values_changed = True
        if self.volatile and not values_changed:
            # A mutable value (a list of betas) changed in place: its words, and for a routed
            # optimizer the numbers its replay reads (the words hold only their types).
            hyper = self.hyper
            values_changed = self._values_words(opt) != self.values_text or self.hyper != hyper
        return False, values_changed, False

    def steady(self, opt) -> bool:
        """Whether nothing groups_changed() and state_changed() look at moved since the last
        call, but numbers a routed replay reads (a schedule's learning rate), which
        take_numbers() has then taken and written into the buffer: the common call, in one
        check in the core (a False answer: ask them)."""
        return _C.graphs.optimizer_steady(opt, self)

    def take_numbers(self, opt) -> bool:
        """Whether only numbers a routed replay reads moved since the last call (a schedule's
        learning rate), each of the same type and, where torch branches on it, zero or not
        as before, the groups otherwise the same objects: then nothing that selects a graph
        changed (the groups' words would be the same). Takes them (self.values,
        self.value_list, self.hyper) and writes them into the replay's buffer, in one call
        into the core; otherwise changes nothing. The caller has found the GradScaler state
        unmoved (scaler_moved)."""
        return _C.graphs.take_numbers_of(opt, self)

    def hyper_buffer(self) -> torch.Tensor:
        """Note [Hyperparameters a replay reads]: the buffer the routed step's replay reads
        (one per number of values: a graph captured with another layout keeps reading its
        own)."""
        buf = self.hyper_buffers.get(len(self.hyper))
        if buf is None:
            buf = self.hyper_buffers[len(self.hyper)] = torch.zeros(len(self.hyper), dtype=torch.float64)
        return buf

    def refresh_groups(self, opt, structure: bool) -> None:
        pg = opt.param_groups
        self.scaler_seen = _C.graphs.scaler_state(opt)  # the objects, compared by identity (scaler_moved)
        self.scaled = any(v is not None for v in self.scaler_seen)
        self.step_hooks_seen = _C.graphs.step_hooks_state(opt)
        if structure:
            self.groups_list = pg
            self.groups = list(pg)
            self.params = [list(g.get("params", ())) for g in pg]
            # Which parameters each group holds is baked into the captured step.
            self.params_text = ";".join(",".join(f"{id(p):x}" for p in ps) for ps in self.params)
            self.params_ok = _params_routable(opt)
        self.keys = [tuple(g) for g in pg]
        self.values = [tuple(g.values()) for g in pg]
        self.value_list = [list(v) for v in self.values]
        self.volatile = any(not _immutable(v) for g in pg for k, v in g.items() if k != "params")
        self.group_tensors = [v for g in pg for k, v in g.items() if isinstance(v, torch.Tensor)]
        self.routed = self.params_ok and _values_routable(opt, self.family)
        text = self._values_words(opt)
        if text != self.values_text:
            self.changes += 1
        self.values_text = text

    def _values_words(self, opt) -> str:
        """The groups' values as the key sees them; fills self.hyper when routed."""
        parts = []
        hyper: List[float] = []
        fam = self.family
        for g in opt.param_groups:
            if self.routed:
                # Read at replay: only torch's branches on them and their types select a graph.
                skip = _READ_FROM[fam]
                dyn = []
                for n in _VALUES[fam]:
                    v = _read(g, n)
                    hyper.append(float(v))
                    dyn.append(f"{n}:{type(v).__name__}{'=0' if n in _BRANCHES[fam] and v == 0 else ''}")
                fixed = sorted((k, value_text(v)) for k, v in g.items() if k != "params" and k not in skip)
                parts.append(f"read at replay {','.join(dyn)} {fixed}")
            else:
                parts.append(repr(sorted((k, value_text(v)) for k, v in g.items() if k != "params")))
        self.hyper = hyper
        scaler = f"|scaled {value_text(self.scaler_seen[0])},{value_text(self.scaler_seen[1])}" if self.scaled else ""
        # By handle id (never reused) and function, as the module hooks in the key.
        hooks = ";".join(",".join(f"{k}:{id(h)}" for k, h in d.items()) if isinstance(d, dict) else "-"
                         for d in self.step_hooks_seen[::3])
        return "|".join(parts) + scaler + f"|step hooks {hooks}"

    # State ----------------------------------------------------------------------------------
    def state_changed(self, opt) -> bool:
        state = opt.state
        return state is not self.state_obj or not isinstance(state, WatchedState) or state.version != self.state_version

    def refresh_state(self, opt) -> None:
        state = _watch_state(opt)
        if state is None:
            state = opt.state
        # A captured optimizer step reads and updates the state tensors it found at capture:
        # which tensors they are (load_state_dict, state.clear() replace them) selects a graph.
        parts, tensors = [], []
        for ps in self.params:
            for p in ps:
                st = state.get(p)
                if st:
                    items = sorted(st.items(), key=lambda kv: str(kv[0]))
                    parts.append(",".join(f"{k}:{id(v):x}" if isinstance(v, torch.Tensor) else f"{k}" for k, v in items))
                    tensors += [v for _, v in items if isinstance(v, torch.Tensor)]
                else:
                    parts.append("-")
        self.state_obj = state
        self.state_version = state.version if isinstance(state, WatchedState) else -1
        self.state_text = ";".join(parts)
        self.state_tensors = tensors

    def watched_tensors(self) -> List[torch.Tensor]:
        """The tensors whose memory the core checks at every call: the state's, and tensor
        values of the groups."""
        return self.state_tensors + self.group_tensors


# -- routing during a capture ---------------------------------------------------------------------
class _Active(threading.local):
    def __init__(self):
        # Each optimizer step() running on this thread inside a graphed step, innermost last
        # (a step hook may step another optimizer): (optimizer, its Route while captured,
        # else None, what the step's front end keeps for the step() it ran inside).
        self.steps: list = []
        # The first refusal raised inside this thread's capture (raised_in_capture).
        self.refused: Optional[BaseException] = None


active = _Active()


class Route:
    """A routed optimizer's hyperparameter buffer for one capture: slot i * n + k holds
    value k of group i."""

    def __init__(self, opt, fam: str, buffer: torch.Tensor):
        self.opt = opt
        self.family = fam
        self.buffer = buffer

    def _group_of(self, params: List[torch.Tensor]):
        first = params[0]
        for i, g in enumerate(self.opt.param_groups):
            if any(p is first for p in g["params"]):
                return i, g
        raise raised_in_capture(GraphStateError(
            f"dwgraph.graphed_step: {type(self.opt).__name__}.step() updated a parameter of none of its param groups; "
            "its captured step could not read that group's hyperparameters at replay"))

    def call(self, fam: str, impl: int, original, args, kwargs):
        bound = _SIGNATURE_OF[next(k for k, v in _IMPLS.items() if v == (fam, impl))].bind(*args, **kwargs)
        a = bound.arguments
        params = a["params"]
        if not params:
            return original(*args, **kwargs)
        if a.get("grad_scale") is not None or a.get("found_inf") is not None:
            raise _refusal(self.opt, "it was given grad_scale/found_inf (a GradScaler)")
        gi, g = self._group_of(params)
        n = len(_VALUES[fam])
        names = _VALUES[fam]
        passed = {"lr": a["lr"], "weight_decay": a["weight_decay"]}
        if fam == "sgd":
            passed.update(momentum=a["momentum"], dampening=a["dampening"])
        else:
            passed.update(beta1=a["beta1"], beta2=a["beta2"], eps=a["eps"])
        for name in names:
            want = _read(g, name)
            if passed[name] is not want and not (type(passed[name]) is type(want) and passed[name] == want):
                raise _refusal(self.opt, f"its {name} was not its param group's value")
        slots = [gi * n + k for k in range(n)]
        ints = [int(isinstance(passed[name], int)) for name in names]
        if fam == "sgd":
            return self._sgd(a, impl, slots, ints, original, args, kwargs)
        return self._adam(a, impl, slots, ints, original, args, kwargs)

    def _sgd(self, a, impl, slots, ints, original, args, kwargs):
        params, grads, bufs = a["params"], a["grads"], a["momentum_buffer_list"]
        has_momentum = a["momentum"] != 0
        if a.get("has_sparse_grad") or any(g.is_sparse for g in grads):
            return original(*args, **kwargs)  # refused by the step's capture (sparse)
        if has_momentum and any(b is None for b in bufs):
            return original(*args, **kwargs)  # it makes its state: the capture is abandoned
        common = dict(hyper=self.buffer, slots=slots, ints=ints, has_momentum=has_momentum,
                      has_weight_decay=a["weight_decay"] != 0, nesterov=bool(a["nesterov"]),
                      maximize=bool(a["maximize"]), impl=impl)
        op = torch.ops.dwgraph.optim_sgd_
        # torch's fused SGD bumps no version (its kernel writes below autograd).
        changed = [] if impl == 2 else [params, bufs] if has_momentum else [params]
        if impl == 0:
            op(list(params), list(grads), list(bufs) if has_momentum else [], **common)
            return _changed_in_place(changed)
        lists = [params, grads, bufs] if has_momentum else [params, grads]
        for (device_lists, _) in torch.optim.Optimizer._group_tensors_by_device_and_dtype(
                lists, with_indices=(impl == 1)).values():
            p, gr = device_lists[0], device_lists[1]
            b = device_lists[2] if has_momentum else []
            op(list(p), list(gr), list(b), **common)
        return _changed_in_place(changed)

    def _adam(self, a, impl, slots, ints, original, args, kwargs):
        if a["capturable"] or a["differentiable"] or a["has_complex"]:
            raise _refusal(self.opt, "it is capturable, differentiable or has complex parameters")
        amsgrad = bool(a["amsgrad"])
        common = dict(hyper=self.buffer, slots=slots, ints=ints, has_weight_decay=a["weight_decay"] != 0,
                      amsgrad=amsgrad, maximize=bool(a["maximize"]),
                      decoupled_weight_decay=bool(a["decoupled_weight_decay"]), impl=impl)
        op = torch.ops.dwgraph.optim_adam_
        lists = [a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["max_exp_avg_sqs"], a["state_steps"]]
        # torch's fused Adam bumps only the step counts (its kernel writes below autograd).
        changed = [a["state_steps"]] if impl == 2 else \
            [a["params"], a["exp_avgs"], a["exp_avg_sqs"], a["max_exp_avg_sqs"] if amsgrad else [], a["state_steps"]]
        if impl == 0:
            op(*[list(x) for x in lists], **common)
            return _changed_in_place(changed)
        for (device_lists, _) in torch.optim.Optimizer._group_tensors_by_device_and_dtype(lists).values():
            op(*[[t for t in x if t is not None] if x is not None else [] for x in device_lists], **common)
        return _changed_in_place(changed)


def _changed_in_place(lists) -> None:
    """What torch's own update leaves on the tensors it changed: their version counters
    bumped (the dwgraph op bumps none), so that a replay bumps them too (Note [Version
    counters at a replay], graphs/recorder.cpp) and version checks outside the graphs see
    the step (autograd's saved tensors, the FP8 weight cache); none where torch's own bumps
    none (its fused kernels: a backward after such a step is allowed there, as eagerly)."""
    tensors = [t for ts in lists for t in (ts or ()) if t is not None]
    if tensors:
        torch.autograd.graph.increment_version(tensors)


def raised_in_capture(err: BaseException) -> BaseException:
    """Notes `err`, a refusal about to be raised inside this thread's capture, and returns it:
    the step raises it again when its code returns, should that code have caught it (a
    capture that went on past a refusal would hold a path eager code does not take, as a
    hook catching every exception around another optimizer's step())."""
    if active.refused is None:
        active.refused = err
    return err


def _refusal(opt, why: str) -> GraphStateError:
    err = GraphStateError(
        f"dwgraph.graphed_step: {type(opt).__name__}.step() inside the step was to read its hyperparameters at "
        f"replay, but {why}; step the optimizer after the graphed step returns, or call reset()")
    err._dwgraph_complete = True  # says what to do: not rewrapped by the step
    return raised_in_capture(err)


def _route_of(params) -> Optional[Route]:
    """The route of the step() whose implementation updates `params`: the innermost step()
    running whose groups hold them. A step() that started inside another and raised (a
    hook of its own skipping it, caught by the hook that called it) leaves its entry on top
    until the outer one ends; its route must not serve the outer one's update. None of them
    holds them: the innermost's (which refuses them)."""
    steps = active.steps
    if not steps:
        return None
    first = params[0] if isinstance(params, (list, tuple)) and params else None
    if first is not None and len(steps) > 1:
        for opt, route, _ in reversed(steps):
            if any(p is first for g in opt.param_groups for p in g["params"]):
                return route
    return steps[-1][1]


def _routed(key):
    fam, impl = _IMPLS[key]
    original = _ORIGINALS[key]

    def routed(*args, **kwargs):
        route = _route_of(args[0] if args else kwargs.get("params"))
        if route is None or route.family != fam:
            return original(*args, **kwargs)
        return route.call(fam, impl, original, args, kwargs)

    routed.__wrapped__ = original
    routed.__name__ = getattr(original, "__name__", "routed")
    routed._dwgraph_routed = True
    return routed


_ROUTED = {key: _routed(key) for key in _IMPLS if _IMPLS[key][0] in _SUPPORTED}
_lock = threading.Lock()
_users = 0


@contextlib.contextmanager
def routing():
    """While a capture runs: torch.optim's SGD and Adam implementations look at `active`
    (this thread's routed optimizer, set by the step's optimizer pre-hook) and run torch's
    own code for every other call, on every other thread."""
    global _users
    with _lock:
        if _users == 0:
            for (module, name), fn in _ROUTED.items():
                setattr(module, name, fn)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for (module, name) in _ROUTED:
                    setattr(module, name, _ORIGINALS[(module, name)])
