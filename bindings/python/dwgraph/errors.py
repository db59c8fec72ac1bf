"""dwgraph's exception types.

Every error dwgraph raises on purpose derives from :class:`DwgraphError` (a
``RuntimeError``). The C++ core raises them by a stable error code (``common/check.h``,
Note [Error types]) which the extension maps to these classes, so they keep their type
wherever they surface: inside ``loss.backward()``, inside a captured region under a torch
op, or from dwgraph's own calls.
"""


class DwgraphError(RuntimeError):
    """Base class of dwgraph's errors."""


class ArgumentError(DwgraphError, ValueError):
    """A bad argument: wrong shape, dtype, device, layout or value.

    The message names the function, the argument, the expected and the actual value.
    """


class GraphStateError(DwgraphError):
    """An API used in a state that does not allow it (after ``reset()``, ``backward_dw()``
    with nothing queued or before its backward)."""


class DanglingCaptureError(DwgraphError):
    """A graph replay would touch a storage that its owner has released."""


class _FoundMore(GraphStateError):
    """graphed_step (internal): a capture met a tensor the step trains, or a dwgraph module
    it runs, that its warmup calls did not; the capture is abandoned and retried."""


class _CreatesState(GraphStateError):
    """graphed_step (internal): the optimizer would create state inside the capture; the
    call runs eagerly instead (with warmup_iters >= 1)."""


def flag(api: str, name: str, value) -> bool:
    """`value` as a bool for argument `name` of `api`: a bool (numpy's too), else
    ArgumentError naming it. A string, an int or a tensor is no decision: read for its truth,
    "no" and 0 would mean opposite things."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise ArgumentError(f"{api}: argument '{name}' must be a bool, got {type(value).__name__} {value!r}")


def count(api: str, name: str, value) -> int:
    """`value` as an int for argument `name` of `api` (numpy's ints too; not a bool), else
    ArgumentError naming it. Its range is the caller's to check."""
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        return value.__index__()
    raise ArgumentError(f"{api}: argument '{name}' must be an int, got {type(value).__name__} {value!r}")


__all__ = ["DwgraphError", "ArgumentError", "GraphStateError", "DanglingCaptureError"]
