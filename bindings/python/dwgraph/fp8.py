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

import contextlib
import threading

from . import _C
from .errors import ArgumentError, GraphStateError

Format = _C.fp8.Format
Recipe = _C.fp8.Recipe
DelayedScaling = _C.fp8.DelayedScaling
Float8CurrentScaling = _C.fp8.Float8CurrentScaling

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "fp8_autocast", "is_fp8_enabled",
           "get_fp8_recipe", "reduce_amax"]


def make_state(api: str, enabled, calibrating=False, recipe=None, amax_reduction_group=None):
    """The C++ state fp8_autocast (and make_graphed_callables) sets for these arguments;
    TransformerEngine's that dwgraph has no counterpart for are refused here."""
    if not isinstance(enabled, bool):
        raise ArgumentError(f"{api}: 'enabled' must be a bool, got {type(enabled).__name__}")
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
    state = _C.fp8.make_state(enabled, recipe, amax_reduction_group=group_id)
    if state.amax_reduction:
        state.amax_reduction_group = amax_reduction_group  # the object; the core keeps its id
    return state


class _Groups(threading.local):
    stack: list

    def __init__(self):
        self.stack = []


_groups = _Groups()


def current_group():
    """The amax reduction group of the innermost FP8 state this thread runs under (None: none)."""
    return _groups.stack[-1] if _groups.stack else None


@contextlib.contextmanager
def state_scope(state):
    """Runs the block under the C++ FP8 ``state`` (a ``_C.fp8.State``), then restores the previous one."""
    previous = _C.fp8.exchange_state(state)
    _groups.stack.append(getattr(state, "amax_reduction_group", None))
    try:
        yield
    finally:
        _groups.stack.pop()
        _C.fp8.exchange_state(previous)


class _GraphedCall(threading.local):
    depth = 0


_graphed_call = _GraphedCall()


@contextlib.contextmanager
def graphed_call_scope(state):
    """A graphed callable's warmup, capture or eager fallback: under its FP8 ``state``, and
    modules captured with weight caching read the first-microbatch flag the call wrote
    (Note [FP8 weight cache], ops/fp8.h); outside it they decide as eager modules do."""
    _graphed_call.depth += 1
    try:
        with state_scope(state):
            yield
    finally:
        _graphed_call.depth -= 1


def in_graphed_call() -> bool:
    return _graphed_call.depth > 0


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


def reduce_amax(model) -> None:
    """Note [Amax reduced across ranks] (ops/fp8.h): for the dwgraph modules of ``model`` whose
    last FP8 forward ran under ``fp8_autocast(amax_reduction_group=...)`` (or graphs captured
    with it), reduces their amax histories over that group (elementwise max: one all-reduce
    per group) and sets their scales from the reduced histories. Under such a state the
    quantizations record their amax and keep the scales, so call this once per step after
    the step's last ``backward_dw()``, at the same point in eager and graphed code (outside
    any capture: a graph replays kernels, not collectives). Every rank of a group must call
    it with the same modules; a mismatch is a typed error on every rank."""
    import torch
    import torch.distributed as dist

    if _C.graphs.capturing():
        raise GraphStateError("dwgraph.fp8.reduce_amax: called inside a graph capture; a graph replays kernels, "
                              "not collectives. Call it after the step, outside the captured region")
    held = [m for m in model.modules() if getattr(m, "_fp8_group", None) is not None]
    if not held:
        raise ArgumentError("dwgraph.fp8.reduce_amax: no module of the model has run in FP8 under an "
                            "amax_reduction_group (fp8_autocast(amax_reduction_group=...) or "
                            "make_graphed_callables(..., amax_reduction_group=...))")
    groups: dict = {}
    for m in held:
        groups.setdefault(id(m._fp8_group), (m._fp8_group, []))[1].append(m)
    for group, mods in groups.values():
        flat = torch.cat([m.fp8_amax_history.detach().reshape(-1) for m in mods])
        # The same modules on every rank: sizes compared first, so a mismatch is an error
        # on every rank instead of an all-reduce of different lengths.
        sizes = torch.tensor([flat.numel(), -flat.numel(), len(mods), -len(mods)], dtype=torch.int64,
                             device=flat.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        if sizes.tolist() != [flat.numel(), -flat.numel(), len(mods), -len(mods)]:
            raise GraphStateError(f"dwgraph.fp8.reduce_amax: this rank holds {len(mods)} modules with "
                                  f"{flat.numel()} amax entries under the group, another rank a different count; "
                                  "every rank must run the same FP8 modules under the group before reducing")
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
