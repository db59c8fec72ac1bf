"""Host work hoisted around a replay (graphs/host_calls.h, Note [Host work around a
replay]): on each backend, a replay_buffer is refilled before every replay, after_replay
calls run after it, graphs of one pool share a buffer, a failing fill runs nothing, and
graphed_step refuses after-calls. On CUDA this is where the fill (on the current stream
before the launch) and the buffer's allocation inside the capture are first exercised."""

from __future__ import annotations

import pytest
import torch

import dwgraph


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def test_buffers_are_refilled_and_after_calls_follow_every_replay(device):
    source = torch.arange(12.0, device=device).reshape(3, 4)
    target = torch.zeros(3, 4, device=device)
    pool = dwgraph.graphs.graph_pool_handle(device)
    first, second = dwgraph.graphs.Graph(device), dwgraph.graphs.Graph(device)
    assert not dwgraph.graphs.capturing()
    with first.capture(pool=pool):
        assert dwgraph.graphs.capturing()
        buf = dwgraph.graphs.replay_buffer(source, "gather", (3, 4), torch.float32, lambda b: b.copy_(source))
        out1 = buf * 2 + 1
        dwgraph.graphs.after_replay(lambda: target.add_(out1))
    with second.capture(pool=pool):
        again = dwgraph.graphs.replay_buffer(source, "gather", (3, 4), torch.float32, lambda b: b.copy_(source))
        out2 = again.sum(0)
    assert again.data_ptr() == buf.data_ptr()  # one buffer per (owner, tag) on a pool
    assert (first.num_before_calls, first.num_after_calls, second.num_before_calls) == (1, 1, 1)
    expected = torch.zeros_like(target)
    for _ in range(3):
        source.add_(torch.randn_like(source))
        first.replay()
        _sync(device)
        expected += source * 2 + 1
        torch.testing.assert_close(out1, source * 2 + 1, rtol=0, atol=0)
        torch.testing.assert_close(target, expected)
        source.mul_(0.5)
        second.replay()  # refills the shared buffer with the newer values
        _sync(device)
        torch.testing.assert_close(out2, source.sum(0))


def test_a_fill_that_raises_replays_nothing(device):
    source = torch.ones(4, device=device)
    fail = [False]

    def fill(b):
        if fail[0]:
            raise RuntimeError("collective failed")
        b.copy_(source)

    g = dwgraph.graphs.Graph(device)
    with g.capture():
        out = dwgraph.graphs.replay_buffer(source, "x", (4,), torch.float32, fill) + 1
    g.replay()
    _sync(device)
    before = out.clone()
    fail[0] = True
    source.fill_(5.0)
    with pytest.raises(RuntimeError, match="collective failed"):
        g.replay()
    _sync(device)
    assert torch.equal(out, before)


def test_outside_a_capture_is_a_state_error():
    with pytest.raises(dwgraph.GraphStateError, match="no dwgraph capture"):
        dwgraph.graphs.after_replay(lambda: None)
    with pytest.raises(dwgraph.GraphStateError, match="no dwgraph capture"):
        dwgraph.graphs.replay_buffer(torch.zeros(2), "x", (2,), torch.float32, lambda b: None)


def test_graphed_step_refuses_after_calls(device):
    w = torch.nn.Parameter(torch.randn(4, 4, device=device))
    opt = torch.optim.SGD([w], lr=0.1)

    @dwgraph.graphed_step(warmup_iters=0)
    def step(x):
        loss = (x @ w).square().sum()
        loss.backward()
        if dwgraph.graphs.capturing():
            dwgraph.graphs.after_replay(lambda: None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    with pytest.raises(dwgraph.ArgumentError, match="optimizer would read"):
        for _ in range(3):  # the capture comes after the step's eager calls
            step(torch.randn(2, 4, device=device))
    assert step.num_graphs == 0


def test_a_region_that_writes_what_a_fill_reads_is_refused(device):
    """The fill runs before the replay; a kernel of the region that changes its source
    first (a weight clamped in place in the forward) would be lost: refused at capture."""
    source = torch.ones(4, device=device)
    g = dwgraph.graphs.Graph(device)
    with pytest.raises(dwgraph.ArgumentError, match="gathers before each replay"):
        with g.capture():
            source.mul_(2.0)
            dwgraph.graphs.replay_buffer(source, "x", (4,), torch.float32, lambda b: b.copy_(source))
    assert not g.is_captured
    _sync(device)
    assert torch.equal(source, torch.ones(4, device=device))  # the capture's write was undone
