"""dwgraph: CUDA graphs for training steps with deferred weight gradients.

``import dwgraph`` loads the native library, which registers the ``torch.ops.dwgraph.*``
operators. The native code logs to ``logging.getLogger("dwgraph")`` (docs/logging.md).
See README.md and docs/contract.md for the contract.
"""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from .errors import ArgumentError, DanglingCaptureError, DwgraphError, GraphStateError
from . import _C
from . import ops
from . import fp8
from . import nn
from . import graphs
from . import graphed as _graphed
from .graphed import GraphedCallable, graphed_handle, make_graphed_callables
from .step import GraphedStep, graphed_step
from .memory import EagerMemory, eager_memory

__version__ = _C.version()


from . import _watch  # noqa: E402

# Note [Checks paid when state changes]: the graphs hear of every change they check; the
# RNG watch makes both graph entry points refuse a random draw after a reseed.
_watch.install()


def summary(graphed) -> str:
    """A table of graphs: of a graphed step, :meth:`GraphedStep.summary`; of what
    ``make_graphed_callables`` returned, its set's graphs, kernels and memory, one table
    per set when the callables come from several (dwgraph.graphed.summary). Here, above
    both, so neither imports the other."""
    if isinstance(graphed, GraphedStep):
        return graphed.summary()
    if isinstance(graphed, (tuple, list)) and any(isinstance(g, GraphedStep) for g in graphed):
        raise ArgumentError("dwgraph.summary: pass a GraphedStep on its own, or what make_graphed_callables "
                            "returned; a sequence holding a GraphedStep is neither")
    return _graphed.summary(graphed)


def cuda_built() -> bool:
    """True when this build compiled the CUDA sources (cuBLASLt GEMMs, the CUDA graph backend)."""
    return bool(_C.cuda_built())


def cuda_available() -> bool:
    """True when CUDA was compiled in and a CUDA device is usable now."""
    return bool(_C.cuda_available())


__all__ = [
    "__version__",
    "cuda_built",
    "cuda_available",
    "ops",
    "fp8",
    "nn",
    "graphs",
    "make_graphed_callables",
    "GraphedCallable",
    "graphed_handle",
    "summary",
    "eager_memory",
    "EagerMemory",
    "graphed_step",
    "GraphedStep",
    "DwgraphError",
    "ArgumentError",
    "GraphStateError",
    "DanglingCaptureError",
]
