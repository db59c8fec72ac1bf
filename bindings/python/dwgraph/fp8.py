"""FP8 training, spelled as TransformerEngine's: ``fp8_autocast(enabled=True, recipe=DelayedScaling(...))``
around the forward of dwgraph.nn modules runs their GEMMs in FP8 (docs/fp8.md).

The recipes and the thread's FP8 state live in the C++ core (ops/fp8.h); this module
describes them. ``DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024,
amax_compute_algo="max")`` keeps per-tensor amax histories and scales in each module's
buffers ``fp8_amax_history`` and ``fp8_scale``, updated by tensor ops inside the forward and
backward (so a graph replays them); ``Float8CurrentScaling(fp8_format=Format.HYBRID, margin=0)``
scales each tensor by its own amax and keeps no state.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
import zlib

import torch
import torch.optim.optimizer as _optimizer

from . import _C
from .errors import ArgumentError, GraphStateError, flag

Format = _C.fp8.Format
Recipe = _C.fp8.Recipe
DelayedScaling = _C.fp8.DelayedScaling
Float8CurrentScaling = _C.fp8.Float8CurrentScaling

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "fp8_autocast", "is_fp8_enabled",
           "get_fp8_recipe", "reduce_amax"]


def make_state(api: str, enabled, calibrating=False, recipe=None, amax_reduction_group=None):
    """The C++ state fp8_autocast (and make_graphed_callables) sets for these arguments;
    TransformerEngine's that dwgraph has no counterpart for are refused here."""
    enabled = flag(api, "enabled", enabled)
    if calibrating:
        raise ArgumentError(f"{api}: calibrating=True (amax calibration in high precision) is not supported; "
                            "dwgraph's FP8 recipes calibrate as they train")
    if amax_reduction_group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ArgumentError(f"{api}: an amax_reduction_group needs torch.distributed initialised "
                                "(init_process_group)")
        if not isinstance(amax_reduction_group, dist.ProcessGroup):
            raise ArgumentError(f"{api}: amax_reduction_group must be a torch.distributed ProcessGroup "
                                f"(dist.group.WORLD, dist.new_group(...)), got {type(amax_reduction_group).__name__}")
    group_id = id(amax_reduction_group) if amax_reduction_group is not None else None
    return _C.fp8.make_state(enabled, recipe, amax_reduction_group=group_id)


# Note [Optimizer steps the FP8 weight cache sees]: a reuse of a cached FP8 weight
# (is_first_microbatch=False) is refused when the weight changed since the cache was
# filled. Version counters see in-place writes through autograd-visible tensors, but not
# the fused optimizers' kernels (AdamW(fused=True) moves a weight and leaves its version
# alone): so, once a module has used weight caching, torch's global optimizer post-step
# hook numbers every step of a torch.optim.Optimizer and keeps, for the last
# _STEPS_KEPT steps, the ids of the parameters the optimizer held then (a frozenset, built
# at C speed: the optimizer may be gone or its groups changed by the reuse). A reuse after
# a step that held the weight is refused, and so is one after more steps than are kept.
# An id reused by a later tensor can only over-refuse. A step taken inside a capture (an
# optimizer step inside dwgraph.graphed_step) is counted again after each replay of its
# graph (a host call after the replay): a replay runs no hook, and the weight moved.
_STEPS_KEPT = 64
_steps = 0
_stepped: "collections.deque" = collections.deque(maxlen=_STEPS_KEPT)  # (step, ids of the parameters it held)
_steps_lock = threading.Lock()
_step_hook = None


def _count_step(opt, args, kwargs) -> None:
    held = frozenset(map(id, itertools.chain.from_iterable(g["params"] for g in opt.param_groups)))
    _note_step(held)
    if _C.graphs.capturing():
        _C.graphs.after_replay(functools.partial(_note_step, held), state_only=True)


def _note_step(held: frozenset) -> None:
    global _steps
    with _steps_lock:
        _steps += 1
        _stepped.append((_steps, held))


def optimizer_steps() -> int:
    """The optimizer steps counted so far (the hook is installed on the first call)."""
    global _step_hook
    if _step_hook is None:
        with _steps_lock:
            if _step_hook is None:
                _step_hook = _optimizer.register_optimizer_step_post_hook(_count_step)
    return _steps


def optimizer_stepped(tensor: torch.Tensor, since: int) -> bool:
    """Whether an optimizer step after count ``since`` held ``tensor`` (or, beyond the
    steps kept, may have)."""
    with _steps_lock:
        if _steps == since:
            return False
        if _steps - since > len(_stepped):
            return True
        key = id(tensor)
        return any(key in held for n, held in _stepped if n > since)


@contextlib.contextmanager
def state_scope(state):
    """Runs the block under the C++ FP8 ``state`` (a ``_C.fp8.State``), then restores the previous one."""
    previous = _C.fp8.exchange_state(state)
    try:
        yield
    finally:
        _C.fp8.exchange_state(previous)


class _GraphedCall(threading.local):
    def __init__(self):
        self.calls: list = []  # (known, cached) per graphed call running on this thread, innermost last


_graphed_call = _GraphedCall()


@contextlib.contextmanager
def graphed_call_scope(state, known, cached):
    """A graphed callable's warmup, capture or eager fallback: under its FP8 ``state``.
    ``known`` (a collection supporting ``in``) holds the dwgraph modules of the callable's
    module tree, whose FP8 state the capture makes and puts back; ``cached``, those whose
    weight caches the call drives (after writing their first-microbatch flags and checking
    them), which read those flags (Note [FP8 weight cache], ops/fp8.h). It is the call's
    decision, not the module's: a module graphed in two sets follows the set whose call
    runs, and a module a call does not drive decides as an eager module does."""
    _graphed_call.calls.append((known, cached))
    try:
        with state_scope(state):
            yield
    finally:
        _graphed_call.calls.pop()


def graphed_call_caches(module) -> bool:
    """Whether the innermost graphed call running on this thread drives ``module``'s FP8 weight cache."""
    return bool(_graphed_call.calls) and module in _graphed_call.calls[-1][1]


def graphed_call_hides(module) -> bool:
    """Whether a graphed call runs on this thread whose module tree does not hold ``module``."""
    return bool(_graphed_call.calls) and module not in _graphed_call.calls[-1][0]


def fp8_autocast(enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None, *,
                 fp8_recipe=None, fp8_group=None):
    """Within the block, the forwards of dwgraph.nn modules run their GEMMs in FP8 under
    ``recipe`` (``None``: ``DelayedScaling()``, TransformerEngine's default); their backwards
    follow the recipe of their forward wherever they run. ``fp8_recipe`` and ``fp8_group``
    are TransformerEngine's older spellings of ``recipe`` and ``amax_reduction_group``."""
    for new, old, name in ((recipe, fp8_recipe, "recipe"), (amax_reduction_group, fp8_group, "amax_reduction_group")):
        if new is not None and old is not None:
            raise ArgumentError(f"dwgraph.fp8.fp8_autocast: pass '{name}' or its older spelling, not both")
    state = make_state("dwgraph.fp8.fp8_autocast", enabled, calibrating, recipe if recipe is not None else fp8_recipe,
                       amax_reduction_group if amax_reduction_group is not None else fp8_group)
    return state_scope(state)


def reduce_amax(model, group) -> None:
    """Note [Amax reduced across ranks] (ops/fp8.h): reduces the amax histories of every
    dwgraph module with delayed-scaling state in ``model`` (a module, or a list of model
    chunks) over the process group ``group`` (elementwise max, one all-reduce) and sets their
    scales from the reduced histories by the recipe of each module's last FP8 forward.
    Under ``fp8_autocast(amax_reduction_group=group)`` (or graphs captured with it) the
    quantizations record their amax and keep the scales, so call this once per step after
    the step's last ``backward_dw()``, at the same point in eager and graphed code, outside
    any capture (a graph replays kernels, not collectives). The ranks first agree on what
    they reduce: a rank holding other modules, or a module it cannot update, is a
    ``GraphStateError`` on every rank, never a collective one rank waits in alone."""
    import torch
    import torch.distributed as dist

    api = "dwgraph.fp8.reduce_amax"
    if _C.graphs.capturing():
        raise GraphStateError(f"{api}: called inside a graph capture; a graph replays kernels, not collectives. "
                              "Call it after the step, outside the captured region")
    if not (dist.is_available() and dist.is_initialized()):
        raise ArgumentError(f"{api}: torch.distributed is not initialised (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise ArgumentError(f"{api}: group must be a torch.distributed ProcessGroup (dist.group.WORLD, "
                            f"dist.new_group(...)), got {type(group).__name__}")
    # A bad `model` on one rank is refused after the agreement, so its peers do not wait.
    roots = [model] if isinstance(model, torch.nn.Module) else (list(model) if isinstance(model, (list, tuple)) else [])
    bad_model = not roots or not all(isinstance(r, torch.nn.Module) for r in roots)
    if bad_model:
        roots = []
    seen, mods = set(), []
    for root in roots:
        for m in root.modules():
            if id(m) not in seen and "fp8_amax_history" in m._buffers and "fp8_scale" in m._buffers:
                seen.add(id(m))
                mods.append(m)
    unusable = [m for m in mods if getattr(m, "_fp8_recipe", None) is None]
    if mods:
        device = mods[0].fp8_amax_history.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
            torch.device("cpu")
    flat = torch.cat([m.fp8_amax_history.detach().reshape(-1) for m in mods]) if mods else \
        torch.zeros(0, device=device)
    # Each module's history shape and recipe, in order: ranks whose totals match but whose
    # columns do not line up (other history lengths, another recipe) must not reduce.
    layout = zlib.crc32("|".join(f"{tuple(m.fp8_amax_history.shape)}:{m._fp8_recipe!r}" for m in mods).encode())
    mine = [flat.numel(), -flat.numel(), len(mods), -len(mods), layout, -layout, 1 if unusable or bad_model else 0]
    agreed = torch.tensor(mine, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    agreed = agreed.tolist()
    if agreed[6]:
        if bad_model:
            raise ArgumentError(f"{api}: model must be a torch.nn.Module or a non-empty list of them (model chunks), "
                                f"got {type(model).__name__}")
        what = (f"{type(unusable[0]).__name__} has FP8 state but has run no FP8 forward since it was made or "
                "loaded (its recipe is unknown)") if unusable else "a module of another rank cannot be updated"
        raise GraphStateError(f"{api}: {what}; run a forward under fp8_autocast first")
    if agreed[:4] != mine[:4]:
        raise GraphStateError(f"{api}: this rank holds {len(mods)} modules with delayed-scaling FP8 state "
                              f"({flat.numel()} amax entries), another rank a different count; every rank of the "
                              "group must run the same FP8 modules before reducing")
    if agreed[4:6] != mine[4:6]:
        raise GraphStateError(f"{api}: the ranks' modules hold their FP8 state in other layouts or under other "
                              "recipes (history lengths, margins, formats); every rank of the group must run the same "
                              "modules under the same recipe before reducing")
    if not mods:
        raise ArgumentError(f"{api}: no module of the model has delayed-scaling FP8 state (no FP8 forward under "
                            "DelayedScaling yet)")
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    with torch.no_grad():
        for m in mods:
            n = m.fp8_amax_history.numel()
            m.fp8_amax_history.copy_(flat[offset:offset + n].view_as(m.fp8_amax_history))
            offset += n
            _C.fp8.update_scales(m.fp8_amax_history, m.fp8_scale, m._fp8_recipe)


def is_fp8_enabled() -> bool:
    """True inside an enabled ``fp8_autocast`` on this thread."""
    return _C.fp8.current_state().enabled


def get_fp8_recipe():
    """The recipe of the enclosing enabled ``fp8_autocast``, or ``None``."""
    return _C.fp8.current_state().recipe
