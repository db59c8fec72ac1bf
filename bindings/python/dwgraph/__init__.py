"""dwgraph: CUDA graphs for training steps with deferred weight gradients.

``import dwgraph`` loads the native library, which registers the ``torch.ops.dwgraph.*``
operators. The native code logs to ``logging.getLogger("dwgraph")`` (docs/logging.md).
See README.md and docs/contract.md for the contract.
"""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from .errors import ArgumentError, DanglingCaptureError, DwgraphError, GraphStateError
from . import _C
from . import ops
from . import nn
from . import graphs
from .graphed import GraphedCallable, graphed_handle, make_graphed_callables, summary
from .step import GraphedStep, graphed_step

__version__ = _C.version()


def _registration_hook(table: str):
    def hook(module, name, _value):
        # A parameter, buffer or submodule (re)registered anywhere: graphed callables
        # re-check, at their next call, that their module still holds what they captured;
        # graphed steps ask whether a tensor they train was displaced (step._displaced).
        old = getattr(module, table, {}).get(name)
        if isinstance(old, torch.nn.Module):
            for t in list(old.parameters()) + list(old.buffers()):
                _step_module._note_displaced(t)
        elif isinstance(old, torch.Tensor):
            _step_module._note_displaced(old)
        _C.graphs.bump_registration_version()

    return hook


from . import step as _step_module  # noqa: E402

_step_module._install_rng_watch()  # both graph entry points refuse a random draw after a reseed
torch.nn.modules.module.register_module_parameter_registration_hook(_registration_hook("_parameters"))
torch.nn.modules.module.register_module_module_registration_hook(_registration_hook("_modules"))
torch.nn.modules.module.register_module_buffer_registration_hook(_registration_hook("_buffers"))


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
    "nn",
    "graphs",
    "make_graphed_callables",
    "GraphedCallable",
    "graphed_handle",
    "summary",
    "graphed_step",
    "GraphedStep",
    "DwgraphError",
    "ArgumentError",
    "GraphStateError",
    "DanglingCaptureError",
]
