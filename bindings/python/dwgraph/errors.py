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


__all__ = ["DwgraphError", "ArgumentError", "GraphStateError", "DanglingCaptureError"]
