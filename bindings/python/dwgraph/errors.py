"""dwgraph's exception types.

Every error dwgraph raises on purpose derives from :class:`DwgraphError` (a
``RuntimeError``); the C++ library throws the matching C++ types (``common/check.h``) and
the extension translates them.
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


def _translated(exc: BaseException):
    """dwgraph's own error for an exception that reached Python through one of torch's
    bindings (which only know RuntimeError/ValueError), or None when it is not ours.

    A dwgraph error raised inside a captured region (e.g. by the host graph when the region
    calls ``.item()``) passes through torch's binding of that call, which keeps the message
    but not the type. The messages carry a stable prefix, which this maps back."""
    if isinstance(exc, DwgraphError):
        return None
    msg = str(exc)
    if isinstance(exc, RuntimeError) and msg.startswith("dwgraph graph capture:"):
        return GraphStateError(msg)
    if isinstance(exc, RuntimeError) and "lives in a storage its owner released" in msg:
        return DanglingCaptureError(msg)
    if isinstance(exc, ValueError) and msg.startswith("dwgraph"):
        return ArgumentError(msg)
    return None


__all__ = ["DwgraphError", "ArgumentError", "GraphStateError", "DanglingCaptureError"]
