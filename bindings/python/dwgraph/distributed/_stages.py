"""The live dwgraph pipeline stages of this process (helper of dwgraph.distributed):
``FullyShardReducer`` refuses their modules, because torch's ``PipelineStage`` drives FSDP2
itself. Its own floor, so the reducer (fsdp.py) and the stages (pipelining.py) both ask it
and neither imports the other's module."""

from __future__ import annotations

import weakref

import torch

from ..errors import ArgumentError

__all__ = ["register", "overlaps", "refuse_stage_overlap"]

_stages: "weakref.WeakSet" = weakref.WeakSet()


def register(stage) -> None:
    _stages.add(stage)


def overlaps(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return any(a is m for m in b.modules()) or any(b is m for m in a.modules())


def refuse_stage_overlap(root: torch.nn.Module) -> None:
    for stage in list(_stages):
        if overlaps(stage.submod, root):
            raise ArgumentError(
                "dwgraph.distributed.FullyShardReducer: argument 'root' is (part of) the module of a pipeline "
                "stage; torch's PipelineStage drives FSDP2 itself (gradient sync and the reduce-scatter after the "
                "stage's last weight step). With pipelining, fully_shard the stage modules without a "
                "FullyShardReducer")
