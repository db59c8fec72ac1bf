"""dwgraph.distributed: torch.distributed with deferred weight gradients (SPEC C9).

dwgraph plugs into torch.distributed and never replaces it:

* data parallel -- :class:`DistributedDataParallel` (torch's DDP with the deferred and
  fused parameters left to :class:`DataParallelReducer`, which all-reduces them after
  their ``backward_dw()``);
* FSDP2 -- :class:`FullyShardReducer` keeps ``fully_shard``'s unsharded parameters until
  the weight steps land, then lets FSDP reduce-scatter them;
* pipelining -- :mod:`dwgraph.distributed.pipelining` runs dwgraph modules in
  ``torch.distributed.pipelining`` stages, eager or with per-microbatch graphs;
* sharded weights -- :class:`ShardedWeight`, a ``dwgraph.nn.DistributedWeight`` whose
  parameter is this rank's shard.

See docs/distributed.md.
"""

from .data_parallel import DataParallelReducer, DistributedDataParallel, reduced_parameter_names
from .fsdp import FullyShardReducer
from .sharded import ShardedWeight
from . import pipelining

__all__ = [
    "DataParallelReducer",
    "DistributedDataParallel",
    "reduced_parameter_names",
    "FullyShardReducer",
    "ShardedWeight",
    "pipelining",
]
