"""dwgraph modules in ``torch.distributed.pipelining`` stages (SPEC C9).

:class:`PipelineStage` is torch's ``PipelineStage`` with a ``dw_builder`` that knows
dwgraph's deferred modules: right after the backward of a microbatch (a full backward, or
the I step of a zero-bubble schedule, which with a ``dw_builder`` runs the full backward),
it takes the weight-gradient units that backward queued out of each module's FIFO, and the
schedule's W step for that microbatch runs exactly those, then the modules' wgrad hooks.
Which microbatch a W step lands therefore does not depend on the order of W steps or on
anything else queued. Every schedule works: ``Schedule1F1B``, ``ScheduleInterleaved1F1B``
(the W step runs right after each full backward), ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (W steps where the schedule puts them,
and right after its full backwards).

``scale_grads`` divides each parameter once per step, after its last contribution, also
when several stages of the rank hold it (a tied embedding and head on a V schedule), and a
fused weight's ``main_grad`` with it: Note [Shared parameters are scaled once].

:func:`make_graphed_stages` captures one graph set per (stage, microbatch) with
``dwgraph.make_graphed_callables`` in the pipeline schedule, whose ``order`` is this rank's
action list of the torch schedule; the stages then replay them, and refuse (GraphStateError,
before replaying) an action out of that order.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from .. import _guards
from ..errors import ArgumentError, GraphStateError
from . import _stages
from .fsdp import FullyShardReducer
from ..graphed import make_graphed_callables
from ..nn import _DeferredWgradModule

__all__ = ["PipelineStage", "make_graphed_stages"]


class _ReplayPlan:
    """This rank's compute actions, in schedule order, that the captured graphs follow."""

    def __init__(self, actions: List[Tuple[int, str, int]]):
        self.actions = actions
        self.cursor = 0

    def expect(self, stage_index: int, kind: str, mb: int) -> None:
        want = self.actions[self.cursor]
        if want != (stage_index, kind, mb):
            raise GraphStateError(
                f"dwgraph.distributed.pipelining: stage {stage_index} runs {kind} of microbatch {mb}, but the "
                f"graphs were captured for {want[1]} of microbatch {want[2]} on stage {want[0]} at this point "
                f"(action {self.cursor} of {len(self.actions)} of the schedule); replaying out of the captured "
                "order could overwrite graph memory another microbatch still needs")
        self.cursor = (self.cursor + 1) % len(self.actions)


class _Step:
    """The dwgraph stages of this process that one schedule step runs, and which of them
    hold each parameter.

    Note [Shared parameters are scaled once]: torch's schedules call ``scale_grads`` once
    per stage and step, right after that stage's last backward (B or W) of the step, and
    torch's ``PipelineStage.scale_grads`` divides the ``.grad`` of every parameter of the
    stage module. A parameter held by two stages of one rank (a tied embedding and output
    head on the first and last stage of a V schedule, layers sharing a weight on stages s
    and s + ranks of an interleaved one) is then divided twice, the first time before the
    other stage's remaining weight steps have added to it. dwgraph's stages divide each
    parameter once per step (its ``.grad``, and its ``main_grad`` when a dwgraph module of
    any holder fuses it), when the last of the step's stages holding it scales: that stage
    has run its last backward, and the others have too (they scaled before), so every
    contribution of the step has landed, wherever the schedule puts the W steps. A
    parameter of one stage is divided when that stage scales, as torch divides it. The
    step's stages are the ones the schedule clears together when ``step()`` starts
    (``clear_runtime_states``, called on each of its stages before any of them computes);
    a stage no schedule has stepped (``scale_grads`` called by hand) divides all of its own
    parameters, as torch's does.
    """

    def __init__(self):
        self.stages: "weakref.WeakSet[PipelineStage]" = weakref.WeakSet()
        self.open = True  # until one of the stages computes
        self._holders: Optional[Dict[int, list]] = None  # id(p) -> [p, holders, fused]
        self._scaled: Dict[int, int] = {}  # id(p) -> how many of its holders scaled so far

    def _index(self) -> Dict[int, list]:
        if self._holders is None:
            holders: Dict[int, list] = {}
            for stage in list(self.stages):
                for p, fused in stage._stage_parameters():
                    entry = holders.setdefault(id(p), [p, 0, False])
                    entry[1] += 1
                    entry[2] = entry[2] or fused
            self._holders = holders
        return self._holders

    def to_scale(self, stage: "PipelineStage") -> List[Tuple[torch.Tensor, bool]]:
        """(parameter, fused) of the parameters of ``stage`` whose last holder in this step
        is ``stage``; fused when a dwgraph module of any holder accumulates it into main_grad."""
        index = self._index()
        out = []
        for p, fused in stage._stage_parameters():
            entry = index.get(id(p))
            if entry is None or entry[1] == 1:
                out.append((p, fused))
                continue
            seen = self._scaled.get(id(p), 0) + 1
            if seen < entry[1]:
                self._scaled[id(p)] = seen
                continue
            self._scaled.pop(id(p), None)
            out.append((p, entry[2]))
        return out


_current_step: Optional["weakref.ref[_Step]"] = None


def _join_step(stage: "PipelineStage") -> bool:
    """``stage`` starts a step: it joins the stages cleared since the last computation on
    this process, or starts a new set (then True)."""
    global _current_step
    step = _current_step() if _current_step is not None else None
    new = step is None or not step.open or stage in step.stages
    if new:
        step = _Step()
        _current_step = weakref.ref(step)
    step.stages.add(stage)
    stage._step = step
    return new


def _refuse_reducer_overlap(module: torch.nn.Module, api: str) -> None:
    """torch's PipelineStage drives an FSDP2 stage module itself (no gradient sync and no
    reshard until its last weight step, then finalize_backward): a FullyShardReducer over
    the same modules would fight it."""
    for r in list(_guards._reducers):
        if isinstance(r, FullyShardReducer) and r._handles and _stages.overlaps(r.root, module):
            raise ArgumentError(
                f"{api}: the module is driven by a dwgraph.distributed.FullyShardReducer, and torch's PipelineStage "
                "drives FSDP2 itself (gradient sync and the reduce-scatter after the stage's last weight step). With "
                "pipelining, fully_shard the stage modules without a FullyShardReducer (reducer.remove() detaches "
                "one); fused main_grad is not supported there")


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` (same arguments, without ``dw_builder``) for a submodule
    containing dwgraph deferred-wgrad modules. See the module docstring."""

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device, *args, **kwargs):
        if kwargs.get("dw_builder") is not None:
            raise ArgumentError("dwgraph.distributed.pipelining.PipelineStage: argument 'dw_builder' is provided "
                                "by the stage (it runs the deferred modules' weight steps); got one")
        kwargs["dw_builder"] = self._build_dw
        _refuse_reducer_overlap(submodule, "dwgraph.distributed.pipelining.PipelineStage")
        self._deferred = [m for m in submodule.modules()
                          if isinstance(m, _DeferredWgradModule) and m.delay_wgrad_compute]
        self._keep: Optional[List[int]] = None
        self._bwd_mb: Optional[int] = None
        self._fwd_mb: Optional[int] = None
        self._graphs: Optional[Dict[int, object]] = None
        self._plan: Optional[_ReplayPlan] = None
        self._step: Optional[_Step] = None
        super().__init__(submodule, stage_index, num_stages, device, *args, **kwargs)
        _stages.register(self)

    # -- forward: the graphed slot of this microbatch -----------------------------------------
    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        if self._plan is not None:
            self._plan.expect(self.stage_index, "F", fwd_chunk_id)
        if self._step is not None:
            self._step.open = False
        self._fwd_mb = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            self._fwd_mb = None

    def forward_maybe_with_nosync(self, *args, **kwargs):
        if self._graphs is None or self._fwd_mb is None:
            return super().forward_maybe_with_nosync(*args, **kwargs)
        if kwargs:
            raise ArgumentError(f"dwgraph.distributed.pipelining: graphed stage {self.stage_index} takes positional "
                                f"tensors only, got keyword arguments {sorted(kwargs)}")
        return self._graphs[self._fwd_mb](*args)

    # -- backward: remember what this microbatch's backward queued ---------------------------
    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        if self._plan is not None:
            self._plan.expect(self.stage_index, "B" if full_backward else "I", bwd_chunk_id)
        self._keep = [m.num_queued_wgrad_units() for m in self._deferred]
        self._bwd_mb = bwd_chunk_id
        try:
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)
        finally:
            self._keep = None
            self._bwd_mb = None

    def _build_dw(self):
        # Called by torch right after the backward of microbatch self._bwd_mb.
        mb = self._bwd_mb
        if self._graphs is not None:
            slot = self._graphs[mb]
            plan = self._plan
            has_dw = slot.need_backward_dw()

            def replay():
                plan.expect(self.stage_index, "W", mb)
                if has_dw:
                    slot.backward_dw()  # hand-off, then the wgrad hooks

            return replay
        taken = [(m, m._wgrad_store.take_after(keep)) for m, keep in zip(self._deferred, self._keep)]

        def run():
            for m, units in taken:
                if len(units):
                    m._check_forward_params()
                    units.run(m._display_name())
                    m._run_wgrad_hooks()

        return run

    # -- scaling: once per parameter and step (Note [Shared parameters are scaled once]) ----
    def clear_runtime_states(self) -> None:
        # The schedule calls this on each of its stages at the start of every step, before
        # any of them computes: the stages cleared together are the step's stages.
        super().clear_runtime_states()
        if _join_step(self) and self._plan is not None:
            # A step replays the captured order from its start, wherever the last one
            # stopped: one that raised mid-way (a loss function's error, caught by the
            # caller) left the order mid-way, and every later step was refused. What the
            # aborted step left in the graphs (a pending weight step, data a replay wrote
            # for a backward that never ran) the graphs' own checks still see.
            self._plan.cursor = 0

    def _stage_parameters(self) -> List[Tuple[torch.Tensor, bool]]:
        """(parameter, fused) of every parameter of the stage module, each once; fused when
        a dwgraph module of the stage accumulates it into main_grad."""
        fused = {id(p) for m in self.submod.modules() if isinstance(m, _DeferredWgradModule)
                 for _, p in m._fused_parameters()}
        return [(p, id(p) in fused) for p in self.submod.parameters()]

    def scale_grads(self, grad_scale_factor: int) -> None:
        # torch's divides the .grad of every parameter of the stage module, a parameter that
        # another stage of this rank holds too once by each; here each parameter once per
        # step, by the last stage of the step holding it, and a fused weight's main_grad
        # with it (Note [Shared parameters are scaled once]).
        if grad_scale_factor == 1:
            return
        step = self._step if self._step is not None and self in self._step.stages else None
        for p, fused in (step.to_scale(self) if step is not None else self._stage_parameters()):
            if p.grad is not None:
                p.grad.div_(grad_scale_factor)
            if fused and getattr(p, "main_grad", None) is not None:
                p.main_grad.div_(grad_scale_factor)


def _schedule_stages(schedule) -> List[PipelineStage]:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stages = [schedule._stage]
    return list(stages)


def _compute_actions(action) -> List[Tuple[int, str, int]]:
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [a for s in subs for a in _compute_actions(s)]
    kind = str(getattr(action.computation_type, "value", action.computation_type))
    if kind in ("F", "B", "I", "W"):
        return [(action.stage_index, kind, action.microbatch_index)]
    return []


def _rank_actions(schedule, stages) -> List[Tuple[int, str, int]]:
    """(stage index, F/B/I/W, microbatch) in the order this rank runs them."""
    if isinstance(schedule, _PipelineScheduleRuntime):
        # The runtime executes pipeline_order[rank] as written.
        rank = dist.get_rank(stages[0].group)
        return [a for act in schedule.pipeline_order[rank] for a in _compute_actions(act)]
    # Single-stage schedules run their own loop (their pipeline_order is only a picture of
    # it): the same loop, written out.
    stage, m = stages[0], schedule._n_microbatches
    if isinstance(schedule, Schedule1F1B):
        warmup = min(m, schedule._num_stages - stage.stage_index)
        order = [("F", i) for i in range(warmup)]
        for b in range(m):
            order.append(("B", b))
            if warmup + b < m:
                order.append(("F", warmup + b))
    elif isinstance(schedule, ScheduleGPipe):
        order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    else:
        raise ArgumentError(f"dwgraph.distributed.pipelining.make_graphed_stages: {type(schedule).__name__} is not "
                            "supported; use Schedule1F1B, ScheduleGPipe or a schedule with a per-rank action "
                            "list (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, "
                            "ScheduleDualPipeV)")
    return [(stage.stage_index, kind, mb) for kind, mb in order]


def make_graphed_stages(schedule, sample_args: Dict[int, Sequence[torch.Tensor]], *, num_warmup_iters: int = 3,
                        pool=None) -> None:
    """Captures the graphs of this rank's stages of ``schedule`` (built from
    :class:`PipelineStage` objects): one forward, backward and backward-dw graph per
    (stage, microbatch), captured with ``dwgraph.make_graphed_callables`` in the order this
    rank runs them in the schedule. ``sample_args[stage_index]`` are one microbatch's
    inputs of that stage, with the ``requires_grad`` they have at run time (the first
    stage's do not require grad, the received activations of the others do). Call it once
    after building the schedule, before the first ``schedule.step()``.
    """
    stages = _schedule_stages(schedule)
    for s in stages:
        if not isinstance(s, PipelineStage):
            raise ArgumentError("dwgraph.distributed.pipelining.make_graphed_stages: every stage of the schedule "
                                f"must be a dwgraph.distributed.pipelining.PipelineStage, got {type(s).__name__}")
        if s._graphs is not None:
            raise GraphStateError(f"dwgraph.distributed.pipelining.make_graphed_stages: stage {s.stage_index} is "
                                  "already graphed")
    actions = _rank_actions(schedule, stages)
    stages = sorted(stages, key=lambda s: s.stage_index)
    chunk = {s.stage_index: c + 1 for c, s in enumerate(stages)}
    deferred = {s.stage_index: bool(s._deferred) for s in stages}
    microbatches = sum(1 for a in actions if a[1] == "F" and a[0] == stages[0].stage_index)
    order: List[float] = []
    plan: List[Tuple[int, str, int]] = []
    for stage_index, kind, mb in actions:
        c = chunk[stage_index]
        if kind == "F":
            order.append(c)
        elif kind in ("B", "I"):
            order.append(-c)
        if deferred[stage_index] and kind in ("B", "W"):
            order.append(-(c + 0.5))
        plan.append((stage_index, kind, mb))
        if kind == "B":
            plan.append((stage_index, "W", mb))  # torch runs the weight step right after
    for s in stages:
        if s.stage_index not in sample_args:
            raise ArgumentError(f"dwgraph.distributed.pipelining.make_graphed_stages: argument 'sample_args' has "
                                f"no entry for stage {s.stage_index} (this rank's stages: {sorted(chunk)})")
    modules = tuple(s.submod for s in stages)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()
    for s in stages:
        if any(isinstance(m, FSDPModule) for m in s.submod.modules()):
            raise ArgumentError(f"dwgraph.distributed.pipelining.make_graphed_stages: stage {s.stage_index} holds "
                                "FSDP2 modules (fully_shard); graphed pipeline stages of FSDP2 models are not "
                                "supported (FSDP's hooks inside a stage would not run at replay): run them eagerly")
    args = [tuple(sample_args[s.stage_index]) for s in stages for _ in range(microbatches)]
    graphed = make_graphed_callables(modules, tuple(args), order=order, num_layers_per_chunk=[1] * len(stages),
                                     num_warmup_iters=num_warmup_iters, pool=pool)
    shared = _ReplayPlan(plan)
    for c, s in enumerate(stages):
        s._graphs = {mb: graphed[c * microbatches + mb] for mb in range(microbatches)}
        s._plan = shared
