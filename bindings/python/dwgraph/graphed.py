"""``dwgraph.make_graphed_callables``: capture and replay training steps with deferred
weight gradients (contract C3, C4, C7, docs/contract.md).

Each callable gets a forward graph, a backward graph and, when any of its modules defers
its weight gradients, a backward-dw graph, all on one private pool. After every
``backward_dw()`` replay the gradients are handed to the caller's ``.grad`` (cloned when
it is ``None``, added otherwise) before the delayed hooks run, so
``optimizer.zero_grad(set_to_none=True)`` between steps is always safe. See
docs/memory-contract.md.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from . import _C
from .errors import _translated
from .graphs import GraphPool

__all__ = ["make_graphed_callables", "GraphedCallable", "summary"]

_MISSING = object()


def _is_dwgraph_module(m) -> bool:
    from .nn import _DeferredWgradModule

    return isinstance(m, _DeferredWgradModule)


def _deferred_module_spec(name: str, sub: torch.nn.Module) -> Dict[str, Any]:
    if _is_dwgraph_module(sub):
        deferred, fused = sub._deferred_parameters(), sub._fused_parameters()
        store = sub._wgrad_store
        extra = dict(backward_dw=sub._backward_dw_without_hooks, run_hooks=sub._run_wgrad_hooks,
                     retain_consumed=store.set_retain_consumed, release_consumed=store.release_consumed)
    else:
        # Any other module with backward_dw()/need_backward_dw() (TransformerEngine's): its
        # backward_dw runs its own hooks; weights with main_grad under
        # fuse_wgrad_accumulation accumulate there, every other trainable parameter lands
        # in .grad (in backward_dw or in the main backward: exact_deferred=False).
        fusing = bool(getattr(sub, "fuse_wgrad_accumulation", False))
        named = [(n, p) for n, p in sub.named_parameters() if p.requires_grad]
        fused = [(n, p) for n, p in named if fusing and hasattr(p, "main_grad")]
        deferred = [(n, p) for n, p in named if not (fusing and hasattr(p, "main_grad"))]
        extra = dict(backward_dw=sub.backward_dw, exact_deferred=False)
    fused_params = [p for _, p in fused]
    qualified = lambda pairs: [f"{name}.{n}" if name else n for n, _ in pairs]  # noqa: E731
    return dict(
        name=name or type(sub).__name__,
        need_backward_dw=sub.need_backward_dw,
        deferred_parameters=[p for _, p in deferred],
        deferred_parameter_names=qualified(deferred),
        fused_parameters=fused_params,
        fused_parameter_names=qualified(fused),
        main_grad=lambda i: fused_params[i].main_grad,
        mark_main_grad_accumulated=lambda i: setattr(fused_params[i], "grad_added_to_main_grad", True),
        **extra,
    )


def _dwgraph_modules(module: torch.nn.Module):
    return [m for m in module.modules() if _is_dwgraph_module(m)]


def _after_backward(module: torch.nn.Module):
    """Hooks of the dwgraph modules without deferral: run at the end of each backward."""
    eager = [m for m in _dwgraph_modules(module) if not m.delay_wgrad_compute]
    if not eager:
        return None

    def run():
        for m in eager:
            m._run_wgrad_hooks()

    return run


def _deferred_modules(module: torch.nn.Module) -> List[Dict[str, Any]]:
    found, covered = [], set()
    for name, sub in module.named_modules():
        if any(name.startswith(c + ".") for c in covered):
            continue  # inside a deferred module: its backward_dw covers it
        if callable(getattr(sub, "backward_dw", None)) and callable(getattr(sub, "need_backward_dw", None)):
            if sub.need_backward_dw():
                found.append(_deferred_module_spec(name, sub))
                covered.add(name)
    return found


class GraphedCallable:
    """One graphed (module, microbatch) slot: call it like the module; after the backward,
    ``backward_dw()`` replays the weight-gradient graph and hands the gradients over."""

    def __init__(self, native, module, kwarg_names: Sequence[str], structure: Dict[str, Any]):
        self._native = native
        self.module = module
        self._kwarg_names = list(kwarg_names)
        self._structure = structure

    def __call__(self, *args, **kwargs):
        tensors = list(args) + [kwargs.pop(k) for k in self._kwarg_names if k in kwargs]
        if kwargs:
            raise TypeError(f"graphed {type(self.module).__name__}: unexpected keyword arguments {sorted(kwargs)}; "
                            f"only the sample kwargs {self._kwarg_names} can be passed")
        outs = self._native(tensors)
        return outs[0] if self._structure.get("single", True) else tuple(outs)

    forward = __call__

    def backward_dw(self) -> None:
        self._native.backward_dw()

    def need_backward_dw(self) -> bool:
        return self._native.need_backward_dw()

    def reset(self) -> None:
        """Releases every graph, the pool reference and the contributions of the whole set."""
        self._native.reset()

    def contribution_bytes(self) -> int:
        return self._native.contribution_bytes()

    def stats(self) -> Dict[str, Any]:
        """Of the whole set: ``pool_reserved_bytes``, ``pool_allocated_bytes`` (live),
        ``pool_peak_allocated_bytes``, ``contribution_bytes``, ``static_bytes``,
        ``num_graphs`` and ``graphs`` (one dict per graph: ``callable``, ``kind``,
        ``num_kernels``)."""
        return self._native.stats()

    def __repr__(self) -> str:
        return f"GraphedCallable({self.module!r})"


def make_graphed_callables(
    modules,
    sample_args,
    *,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    order: Optional[Sequence[float]] = None,
    num_layers_per_chunk: Optional[Sequence[int]] = None,
    pool: Optional[GraphPool] = None,
    retain_graph_in_backward: bool = False,
    _unsafe_capture_with_caller_grad: bool = False,
):
    """Graphs ``modules`` (one module or a tuple) on the device of ``sample_args``.

    Sequential schedule (``order=None``): ``sample_args[i]`` is the tuple of tensors for
    module ``i``; one graphed callable per module is returned (the same structure).
    Pipeline schedule: ``order`` as TransformerEngine's ``_order`` (``+c`` forward of chunk
    ``c`` for its next microbatch, ``-c`` its backward, ``-(c + 0.5)`` its backward-dw,
    chunks from 1); ``modules`` are the layers of all chunks in order
    (``num_layers_per_chunk`` each), ``sample_args`` holds one tuple per (chunk,
    microbatch, layer) slot in that nesting, and one callable per slot is returned.

    ``_unsafe_capture_with_caller_grad`` is for tests only: it captures backward-dw with
    the caller's ``.grad`` in place and skips the hand-off (the unfixed hazard).
    """
    single = isinstance(modules, torch.nn.Module) or callable(modules) and not isinstance(modules, (tuple, list))
    if single:
        modules = (modules,)
        sample_args = (sample_args,)
    modules = tuple(modules)
    sample_args = tuple(tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args)
    if sample_kwargs is None:
        sample_kwargs = tuple({} for _ in sample_args)
    elif isinstance(sample_kwargs, dict):
        sample_kwargs = (sample_kwargs,)
    slots_per_module = len(sample_args) // max(len(modules), 1)
    structures = [dict() for _ in modules]
    kwarg_names: List[List[str]] = []
    specs = []
    for i, module in enumerate(modules):
        kw = sample_kwargs[i] if i < len(sample_kwargs) else {}
        names = [k for k, v in kw.items() if isinstance(v, torch.Tensor)]
        fixed = {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)}
        kwarg_names.append(names)
        n_args = len(sample_args[i]) if i < len(sample_args) else 0

        def forward(tensors, module=module, names=tuple(names), fixed=fixed, n_args=n_args, st=structures[i]):
            kwargs = dict(fixed)
            kwargs.update(zip(names, tensors[n_args:]))
            out = module(*tensors[:n_args], **kwargs)
            if isinstance(out, torch.Tensor):
                st["single"] = True
                return [out]
            st["single"] = False
            return list(out)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad] if isinstance(module, torch.nn.Module) else []
        specs.append(dict(
            name=type(module).__name__,
            forward=forward,
            parameters=[p for _, p in named],
            parameter_names=[n for n, _ in named],
            buffers=list(module.buffers()) if isinstance(module, torch.nn.Module) else [],
            is_training=(lambda module=module: module.training) if isinstance(module, torch.nn.Module) else None,
            deferred_modules=_deferred_modules(module) if isinstance(module, torch.nn.Module) else [],
            after_backward=_after_backward(module) if isinstance(module, torch.nn.Module) else None,
        ))
    # Flatten kwargs tensors after the positional ones, per slot.
    flat_args = []
    for s, args in enumerate(sample_args):
        mod_index = s if order is None else _module_of_slot(s, len(modules), order, num_layers_per_chunk)
        kw = sample_kwargs[mod_index] if mod_index < len(sample_kwargs) else {}
        flat_args.append(list(args) + [kw[k] for k in kwarg_names[mod_index]])
    # Warmup and capture leave no trace: hooks do not run, flags are put back.
    dw_modules = [m for mod in modules if isinstance(mod, torch.nn.Module) for m in _dwgraph_modules(mod)]
    flags = [(p, p.__dict__.get("grad_added_to_main_grad", _MISSING))
             for m in dw_modules for _, p in m._fused_parameters()]
    for m in dw_modules:
        m._suppress_wgrad_hooks = True
    try:
        natives = _C.graphs.make_graphed_callables(
            specs, flat_args, num_warmup_iters=num_warmup_iters, allow_unused_input=allow_unused_input,
            order=None if order is None else [float(o) for o in order],
            num_layers_per_chunk=None if num_layers_per_chunk is None else [int(n) for n in num_layers_per_chunk],
            pool=pool, retain_graph_in_backward=retain_graph_in_backward,
            unsafe_capture_with_caller_grad=_unsafe_capture_with_caller_grad)
    except (RuntimeError, ValueError) as e:
        ours = _translated(e)
        if ours is None:
            raise
        raise ours from e
    finally:
        for m in dw_modules:
            m._suppress_wgrad_hooks = False
        for p, value in flags:
            if value is _MISSING:
                p.__dict__.pop("grad_added_to_main_grad", None)
            else:
                p.grad_added_to_main_grad = value
    out = []
    for native in natives:
        mod_index = native.index if order is None else _module_of_slot(native.index, len(modules), order, num_layers_per_chunk)
        out.append(GraphedCallable(native, modules[mod_index], kwarg_names[mod_index], structures[mod_index]))
    del slots_per_module
    return out[0] if single and order is None else tuple(out)


def _module_of_slot(slot: int, n_modules: int, order, num_layers_per_chunk) -> int:
    """The module (layer) index of pipeline slot ``slot``: slots are (chunk, microbatch,
    layer) in that nesting, as make_graphed_callables lays them out."""
    chunks = int(max(abs(o) for o in order) // 1)
    layers = list(num_layers_per_chunk) if num_layers_per_chunk is not None else [n_modules // chunks] * chunks
    microbatches = sum(1 for o in order if o == 1)
    offset = 0
    for c, n in enumerate(layers):
        span = n * microbatches
        if slot < offset * microbatches + span:
            within = slot - offset * microbatches
            return offset + within % n
        offset += n
    raise IndexError(slot)


def summary(graphed) -> str:
    """A small table of a set of graphed callables: each graph with its kernel count, then
    the pool's reserved and live bytes, the contribution and static-buffer bytes.

    ``graphed`` is what :func:`make_graphed_callables` returned (one ``GraphedCallable``
    or the tuple): the table covers the whole set it belongs to. ``print(dwgraph.summary(g))``.
    """
    first = graphed[0] if isinstance(graphed, (tuple, list)) and graphed else graphed
    if not isinstance(first, GraphedCallable):
        raise TypeError(f"dwgraph.summary: argument 'graphed' must be a GraphedCallable or the tuple "
                        f"make_graphed_callables returned, got {type(graphed).__name__}")
    st = first.stats()
    fmt = _C.format_bytes
    kernels = sum(g["num_kernels"] for g in st["graphs"])
    rows = [(g["callable"], g["kind"], str(g["num_kernels"])) for g in st["graphs"]]
    header = ("callable", "graph", "kernels")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    line = lambda r: f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}"  # noqa: E731
    out = [f"dwgraph: {st['num_graphs']} graphs, {kernels} kernels", line(header)]
    out += [line(r) for r in rows]
    out += [f"  {name:<15} {fmt(st[key])}" for name, key in (
        ("pool reserved", "pool_reserved_bytes"), ("pool live", "pool_allocated_bytes"),
        ("contributions", "contribution_bytes"), ("static buffers", "static_bytes"))]
    return "\n".join(out)
