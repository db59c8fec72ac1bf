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
from .errors import ArgumentError

Format = _C.fp8.Format
Recipe = _C.fp8.Recipe
DelayedScaling = _C.fp8.DelayedScaling
Float8CurrentScaling = _C.fp8.Float8CurrentScaling

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "fp8_autocast", "is_fp8_enabled",
           "get_fp8_recipe"]


def make_state(api: str, enabled, calibrating=False, recipe=None, amax_reduction_group=None):
    """The C++ state fp8_autocast (and make_graphed_callables) sets for these arguments;
    TransformerEngine's that dwgraph has no counterpart for are refused here."""
    if not isinstance(enabled, bool):
        raise ArgumentError(f"{api}: 'enabled' must be a bool, got {type(enabled).__name__}")
    if calibrating:
        raise ArgumentError(f"{api}: calibrating=True (amax calibration in high precision) is not supported; "
                            "dwgraph's FP8 recipes calibrate as they train")
    if amax_reduction_group is not None:
        raise ArgumentError(f"{api}: an amax reduction group is not supported: each rank keeps its own scaling "
                            "state; pass None")
    return _C.fp8.make_state(enabled, recipe)


@contextlib.contextmanager
def state_scope(state):
    """Runs the block under the C++ FP8 ``state`` (a ``_C.fp8.State``), then restores the previous one."""
    previous = _C.fp8.exchange_state(state)
    try:
        yield
    finally:
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


def is_fp8_enabled() -> bool:
    """True inside an enabled ``fp8_autocast`` on this thread."""
    return _C.fp8.current_state().enabled


def get_fp8_recipe():
    """The recipe of the enclosing enabled ``fp8_autocast``, or ``None``."""
    return _C.fp8.current_state().recipe
