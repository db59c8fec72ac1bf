"""``@dwgraph.graphed_step``: a whole training step as graphs.

    @dwgraph.graphed_step
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        for m in deferred_modules:
            m.backward_dw()
        return loss

    for x, y in data:
        loss = train_step(x, y)          # warmup calls run eagerly, then capture, then replay
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

The optimizer stays outside the step. After each replay every gradient the step produced
is handed to the caller (``.grad = contribution.clone()`` when ``.grad`` is None, added
otherwise), then the delayed (wgrad) hooks run. See docs/graphed-step.md.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.optim.optimizer as _optimizer
from torch.utils import _pytree as pytree

from . import _C
from .errors import GraphStateError, _translated

__all__ = ["graphed_step", "GraphedStep"]


def _raise_inside(what: str):
    def refuse(*args, **kwargs):
        raise GraphStateError(
            f"dwgraph.graphed_step: the step calls {what} inside; a graphed step must leave the "
            "optimizer outside: run optimizer.step() and zero_grad() after the step returns"
        )

    return refuse


class GraphedStep:
    """The callable ``@graphed_step`` returns. ``num_graphs`` and ``num_captures`` report
    how many graphs it holds and how often it captured; ``reset()`` releases them."""

    def __init__(self, fn: Callable, *, warmup_iters: int = 3, pool=None,
                 params: Optional[Sequence[torch.Tensor]] = None, max_graphs: int = 8):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._given_params = list(params) if params is not None else None
        if self._given_params is None:
            # The parameters are found by running the step: one eager call at least.
            warmup_iters = max(int(warmup_iters), 1)
        self._modules: Dict[int, torch.nn.Module] = {}
        self._out_specs: Dict[str, object] = {}
        self._current = None
        self._native = _C.graphs.GraphedStep(
            self._run_flat, warmup_iters=warmup_iters, pool=pool, max_graphs=max_graphs,
            params=lambda: [p for _, p in self._params()], param_names=lambda: [n for n, _ in self._params()],
            main_grads=lambda: [p.main_grad for _, p in self._fused()],
            main_grad_names=lambda: [n for n, _ in self._fused()],
            mark_main_grads=self._mark_main_grads, after_hand_off=self._after_hand_off,
            capturing=self._capturing)

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [l for l in leaves if isinstance(l, torch.Tensor)]
        constants = [(i, l) for i, l in enumerate(leaves) if not isinstance(l, torch.Tensor)]
        key = repr((spec, constants))
        self._current = (leaves, spec, key)
        try:
            out = self._native(tensors, key)
        except (RuntimeError, ValueError) as e:
            ours = _translated(e)
            if ours is None:
                raise
            raise ours from e
        return pytree.tree_unflatten(out, self._out_specs[key])

    def _run_flat(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        leaves, spec, key = self._current
        it = iter(tensors)
        leaves = [next(it) if isinstance(l, torch.Tensor) else l for l in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        with self._watch():
            out = self._fn(*args, **kwargs)
        out_leaves, out_spec = pytree.tree_flatten(out)
        for leaf in out_leaves:
            if leaf is not None and not isinstance(leaf, torch.Tensor):
                raise TypeError(f"dwgraph.graphed_step: the step must return tensors (or None), got a "
                                f"{type(leaf).__name__}; return the tensor, not its .item()")
        self._out_specs[key] = out_spec
        return list(out_leaves)

    @contextlib.contextmanager
    def _watch(self):
        """Finds the modules the step runs (for its parameters) and refuses the optimizer."""
        def seen(module, _inputs):
            self._modules.setdefault(id(module), module)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(seen)
        opt_handle = _optimizer.register_optimizer_step_pre_hook(
            lambda *a, **k: _raise_inside("optimizer.step()")())
        saved = (torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad)
        torch.optim.Optimizer.zero_grad = _raise_inside("optimizer.zero_grad()")
        torch.nn.Module.zero_grad = _raise_inside("module.zero_grad()")
        try:
            yield
        finally:
            handle.remove()
            opt_handle.remove()
            torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad = saved

    # -- what the native step asks -------------------------------------------------------
    def _params(self):
        if self._given_params is not None:
            return [(f"params[{i}]", p) for i, p in enumerate(self._given_params)]
        # Frozen parameters too: the graph checks that requires_grad stays as captured.
        out, seen = [], set()
        for m in self._modules.values():
            for n, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{type(m).__name__}.{n}", p))
        return out

    def _deferred_modules(self):
        from .nn import _DeferredWgradModule

        return [m for m in self._modules.values() if isinstance(m, _DeferredWgradModule)]

    def _capturing(self, on: bool) -> None:
        for m in self._deferred_modules():
            m._suppress_wgrad_hooks = on

    def _after_hand_off(self) -> None:
        # Every dwgraph module's hooks, deferred or not: their gradients have just landed.
        for m in self._deferred_modules():
            m._run_wgrad_hooks()

    def _fused(self):
        out, seen = [], set()
        for m in self._deferred_modules():
            for n, p in m._fused_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{type(m).__name__}.{n}", p))
        return out

    def _mark_main_grads(self) -> None:
        for _, p in self._fused():
            p.grad_added_to_main_grad = True

    # -- reporting ---------------------------------------------------------------------------
    @property
    def num_graphs(self) -> int:
        return self._native.num_graphs

    @property
    def num_captures(self) -> int:
        return self._native.num_captures

    def reset(self) -> None:
        self._native.reset()


def graphed_step(fn: Optional[Callable] = None, *, warmup_iters: int = 3, pool=None,
                 params: Optional[Sequence[torch.Tensor]] = None, max_graphs: int = 8):
    """Decorates a training step (forward, ``loss.backward()``, ``backward_dw()`` calls)
    so it runs as graphs: ``warmup_iters`` eager calls per input signature, then a capture
    on a private pool, then replays. Tensor arguments are copied into static inputs;
    non-tensor arguments and tensor shapes, dtypes and devices select the graph (up to
    ``max_graphs``, least recently used released first). ``params``: the parameters the
    step gives gradients to (default: those of every module the step calls, found during
    the warmup calls, so at least one warmup call runs when ``params`` is not given). Returned
    tensors of at most 4096 elements (the loss, scalars) are clones; larger ones are the
    graph's static outputs, overwritten by the next call."""
    def wrap(f):
        return GraphedStep(f, warmup_iters=warmup_iters, pool=pool, params=params, max_graphs=max_graphs)

    return wrap(fn) if fn is not None else wrap
