"""Memory of a graph set (docs/memory-contract.md, "Memory of a graph set"): stats() and
dwgraph.summary report the pool's reserved, live and peak bytes and, once recorded, the
eager peak they are compared with; dwgraph.eager_memory measures that peak on the
allocator the graphs' pool uses. And the pipeline schedule's pool, whose slots share it by
liveness (issue 21), stays at eager's peak whatever the microbatch count."""

from __future__ import annotations

import copy

import pytest
import torch

import dwgraph
from safety_common import one_f_one_b, run_order

H = 128
B = 64


def _mean_square(y):
    return y.square().mean()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(dwgraph.nn.LayerNormMLP(H, 4 * H, delay_wgrad_compute=True),
                               dwgraph.nn.Linear(H, H, delay_wgrad_compute=True))


def _graphed_and_eager(m: int, **kwargs):
    model = _model()
    eager = copy.deepcopy(model)
    order = one_f_one_b(m)
    slots = dwgraph.make_graphed_callables((model,), tuple((torch.randn(B, H),) for _ in range(m)), order=order,
                                           num_warmup_iters=1, **kwargs)
    xs = [torch.randn(B, H) for _ in range(m)]
    run_order(order, lambda i, x: slots[i](x), lambda i: slots[i].backward_dw(), xs, loss=_mean_square)
    with dwgraph.eager_memory(slots) as e:
        run_order(order, lambda i, x: eager(x), lambda i: (eager[0].backward_dw(), eager[1].backward_dw()), xs, loss=_mean_square)
    for pg, pe in zip(model.parameters(), eager.parameters()):
        assert torch.equal(pg.grad, pe.grad)
    return slots[0].stats(), e


def test_stats_report_reserved_live_peak_and_the_recorded_eager_peak():
    st, e = _graphed_and_eager(4)
    assert 0 < st["pool_allocated_bytes"] <= st["pool_peak_allocated_bytes"] <= st["pool_reserved_bytes"]
    assert st["eager_peak_bytes"] == e.peak_bytes > 0
    assert e.reserved_bytes >= e.peak_bytes and e.device == torch.device("cpu")


def test_pipeline_pool_is_flat_in_the_microbatches_and_at_eagers_peak():
    # Note [Slots share the pool by liveness]: the later microbatches reuse the blocks the
    # earlier ones' eager run would have freed. (The host pool's layout is deterministic.)
    four, e4 = _graphed_and_eager(4)
    eight, e8 = _graphed_and_eager(8)
    assert e8.peak_bytes == e4.peak_bytes  # 1F1B with 2 in flight: eager is flat too
    assert eight["pool_reserved_bytes"] == four["pool_reserved_bytes"]
    assert eight["pool_peak_allocated_bytes"] <= 1.1 * e8.peak_bytes
    # Reserved against reserved: the host pool's fragmentation is the same on both sides
    # (docs/benchmarks.md).
    assert eight["pool_reserved_bytes"] <= 1.05 * e8.reserved_bytes


def test_planned_placement_holds_less_than_best_fit_and_trains_bitwise():
    # Note [A second capture on a planned pool]: the same liveness (peak live bytes), a
    # tighter layout; both train as eager does (_graphed_and_eager compares the grads).
    best_fit, e = _graphed_and_eager(8, plan_placement=False)
    planned, e2 = _graphed_and_eager(8)
    assert e.peak_bytes == e2.peak_bytes
    assert planned["pool_peak_allocated_bytes"] == best_fit["pool_peak_allocated_bytes"]
    assert planned["pool_reserved_bytes"] < 0.99 * best_fit["pool_reserved_bytes"]
    # What is left of the layout's holes: under 10% of the pool's own peak of live bytes.
    assert planned["pool_reserved_bytes"] <= 1.1 * planned["pool_peak_allocated_bytes"]


class _Counted(torch.nn.Module):
    """A deferred Linear that counts its forward calls."""

    def __init__(self):
        super().__init__()
        self.inner = dwgraph.nn.Linear(H, H, delay_wgrad_compute=True)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)

    def backward_dw(self):
        self.inner.backward_dw()


@pytest.mark.parametrize("hooks", [False, True], ids=["no_hooks", "capture_time_hooks"])
def test_the_second_capture_runs_no_warmup_and_not_with_capture_time_hooks(hooks):
    m = 6
    counts = {}
    for plan in (False, True):
        torch.manual_seed(0)
        mod = torch.nn.Sequential(_Counted(), torch.nn.GELU(), dwgraph.nn.LayerNormMLP(H, 4 * H, delay_wgrad_compute=True))
        warmups, events = [], []
        kwargs = dict(capture_time_hooks=[{"forward_hooks": {0: lambda module: events.append(1)}}]) if hooks else {}
        slots = dwgraph.make_graphed_callables((mod,), tuple((torch.randn(B, H),) for _ in range(m)),
                                               order=one_f_one_b(m), num_warmup_iters=1, plan_placement=plan,
                                               pre_warmup_hook=lambda: warmups.append(1), **kwargs)
        counts[plan] = (mod[0].calls, len(warmups), len(events), slots[0].stats()["pool_reserved_bytes"])
    (calls0, warm0, ev0, res0), (calls1, warm1, ev1, res1) = counts[False], counts[True]
    assert warm0 == warm1 == 1  # warmup hooks once, planned or not
    assert ev1 == ev0 and calls0 == 2 * m  # one warmup iteration and one capture per slot
    if hooks:  # the hooks would see each capture twice: captured once, best fit
        assert calls1 == calls0 and res1 == res0
    else:  # captured again, without warmup, on the planned pool
        assert calls1 == calls0 + m and res1 < res0


_MANY_POOLS = """
import resource, sys
import torch, dwgraph
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (6 << 30), resource.RLIM_INFINITY))
kept = []
for i in range(200):
    with dwgraph.eager_memory():
        kept.append(torch.ones(1000))  # keeps its pool alive
print(sum(float(t.sum()) for t in kept))
"""


def test_host_pools_reserve_address_space_as_they_grow():
    # Note [An expandable host segment]: a pool reserves 16 MiB of address space first,
    # not gigabytes, so a process under `ulimit -v` holds many pools (200 here, in 6 GiB).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MANY_POOLS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "200000.0"


def test_eager_memory_measures_the_high_water_mark_of_the_block():
    with dwgraph.eager_memory() as e:
        a = torch.empty(1000)  # 4000 bytes, a 4032-byte block (64-byte rounding)
        del a
        b = torch.empty(400)  # 1600 bytes each: both fit in a's block once it is free
        c = torch.empty(400)
    assert e.peak_bytes == 4032 and e.reserved_bytes == 4032
    # What the block left alive stays usable, apart from what is allocated after it.
    b.fill_(2.0), c.fill_(3.0)
    outside = torch.zeros(1000)
    assert bool((b == 2).all()) and bool((c == 3).all()) and bool((outside == 0).all())
    del b, c, outside
    with dwgraph.eager_memory(device="cpu") as nothing:
        pass
    assert nothing.peak_bytes == 0


def test_eager_memory_records_nothing_when_its_block_raises_or_allocates_nothing():
    lin = dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True)
    g = dwgraph.make_graphed_callables(lin, (torch.randn(4, 8, requires_grad=True),), num_warmup_iters=1)
    with pytest.raises(RuntimeError, match="boom"):
        with dwgraph.eager_memory(g):
            torch.empty(100)
            raise RuntimeError("boom")
    with dwgraph.eager_memory(g):
        pass
    assert dwgraph.graphed_handle(g).stats()["eager_peak_bytes"] is None
    with dwgraph.eager_memory(g) as e:
        torch.empty(100)
    assert dwgraph.graphed_handle(g).stats()["eager_peak_bytes"] == e.peak_bytes == 448


def test_record_eager_peak_and_eager_memory_refuse_bad_arguments():
    lin = dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True)
    g = dwgraph.make_graphed_callables(lin, (torch.randn(4, 8, requires_grad=True),), num_warmup_iters=1)
    handle = dwgraph.graphed_handle(g)
    with pytest.raises(dwgraph.ArgumentError, match=r"argument 'nbytes' must be the positive .* got 0"):
        handle.record_eager_peak(0)
    with pytest.raises(dwgraph.ArgumentError, match=r"argument 'nbytes' must be an int, got float"):
        handle.record_eager_peak(1.5)
    with pytest.raises(dwgraph.ArgumentError, match=r"argument 'nbytes' must be an int, got bool"):
        handle.record_eager_peak(True)
    assert handle.stats()["eager_peak_bytes"] is None
    handle.record_eager_peak(12345)
    assert handle.stats()["eager_peak_bytes"] == 12345
    with pytest.raises(dwgraph.ArgumentError, match=r"argument 'device' is cuda:0 but the graphs of 'graphed' run on cpu"):
        with dwgraph.eager_memory(g, device="cuda:0"):
            pass
    with pytest.raises(dwgraph.ArgumentError, match=r"argument 'graphed' must be .* got int"):
        with dwgraph.eager_memory(3):
            pass
    with pytest.raises(dwgraph.ArgumentError, match=r"argument 'device' must be a CPU or CUDA device, got meta"):
        with dwgraph.eager_memory(device="meta"):
            pass


def test_allocation_scope_is_entered_once():
    pool = dwgraph.graphs.graph_pool_handle("cpu")
    scope = pool._allocation_scope()
    with scope:
        with pytest.raises(dwgraph.GraphStateError, match=r"already entered; expected one `with` per scope"):
            scope.__enter__()
        t = torch.empty(16)
    assert pool.stats()["allocated_bytes"] == 64
    del t
    assert pool.stats()["allocated_bytes"] == 0 and pool.stats()["peak_allocated_bytes"] == 64


def test_graphed_step_reports_its_pools_peak():
    lin = torch.nn.Linear(8, 8)

    @dwgraph.graphed_step(warmup_iters=1)
    def step(x):
        lin(x).sum().backward()

    for _ in range(3):
        step(torch.randn(4, 8))
    st = step.stats()
    assert st["pool_allocated_bytes"] <= st["pool_peak_allocated_bytes"] <= st["pool_reserved_bytes"]
    assert st["pool_peak_allocated_bytes"] > 0
    assert "pool peak" in step.summary()


class _LazyTable(torch.nn.Module):
    """Makes a tensor in its first forward: with no warmup that is inside the first capture
    only, so the second capture allocates otherwise."""

    def __init__(self):
        super().__init__()
        self.lin = dwgraph.nn.Linear(16, 16, delay_wgrad_compute=True)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.arange(64, dtype=torch.float32).reshape(4, 16).sin()
        return self.lin(x) * self.table

    def backward_dw(self):
        self.lin.backward_dw()


def test_a_second_capture_larger_than_the_first_is_logged_and_trains_as_eager():
    import logging

    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record)

    logger = logging.getLogger("dwgraph")
    handler, old_level = Keep(level=logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        torch.manual_seed(0)
        model = _LazyTable()
        eager = copy.deepcopy(model)
        m = 6
        order = one_f_one_b(m)
        slots = dwgraph.make_graphed_callables((model,), tuple((torch.randn(4, 16),) for _ in range(m)), order=order,
                                               num_warmup_iters=0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    larger = [r for r in kept if "the second capture, on a planned pool" in r.getMessage()]
    assert larger and "plan_placement=False" in larger[0].getMessage()
    xs = [torch.randn(4, 16) for _ in range(m)]
    run_order(order, lambda i, x: slots[i](x), lambda i: slots[i].backward_dw(), xs)
    run_order(order, lambda i, x: eager(x), lambda i: eager.backward_dw(), xs)
    for pg, pe in zip(model.parameters(), eager.parameters()):
        assert torch.equal(pg.grad, pe.grad)


def test_the_sequential_schedule_stated_as_an_order_holds_eagers_peak():
    """N layers x 1 microbatch: without an order the backward-dw graphs keep their inputs
    apart so they replay in any order (more than eager holds); stated as an order (each
    layer a chunk, one microbatch) the slots share the pool by liveness: at eager's peak,
    and as eager bitwise."""
    n = 4
    torch.manual_seed(0)
    layers = [dwgraph.nn.LayerNormMLP(H, 4 * H, delay_wgrad_compute=True) if i % 2 == 0
              else dwgraph.nn.Linear(H, H, delay_wgrad_compute=True) for i in range(n)]
    eager = copy.deepcopy(layers)
    order = list(range(1, n + 1)) + [-c for c in range(n, 0, -1)] + [-(c + 0.5) for c in range(1, n + 1)]
    slots = dwgraph.make_graphed_callables(tuple(layers), tuple((torch.randn(B, H, requires_grad=i > 0),)
                                                                for i in range(n)),
                                           order=order, num_layers_per_chunk=[1] * n, num_warmup_iters=1)
    x = torch.randn(B, H)

    def step(calls):
        y = x
        for f in calls:
            y = f(y)
        _mean_square(y).backward()
        for f in calls:
            f.backward_dw()

    step(slots)
    with dwgraph.eager_memory(slots) as e:
        step(eager)
    for pg, pe in zip((p for l in layers for p in l.parameters()), (p for l in eager for p in l.parameters())):
        assert torch.equal(pg.grad, pe.grad)
    assert slots[0].stats()["pool_reserved_bytes"] <= 1.05 * e.peak_bytes
    # More steps, with either zero_grad: still eager's gradients, bitwise.
    for set_to_none in (True, False, True):
        for ls in (layers, eager):
            for l in ls:
                l.zero_grad(set_to_none=set_to_none)
        x = torch.randn(B, H)
        step(slots)
        step(eager)
        for pg, pe in zip((p for l in layers for p in l.parameters()), (p for l in eager for p in l.parameters())):
            assert torch.equal(pg.grad, pe.grad)


@pytest.mark.parametrize("value", ["no", None, 0])
def test_plan_placement_must_be_a_bool(value):
    with pytest.raises(dwgraph.ArgumentError, match="'plan_placement' must be a bool"):
        dwgraph.make_graphed_callables(_model(), (torch.randn(B, H),), plan_placement=value)
