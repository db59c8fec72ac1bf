"""Scenarios of the harness's own tests (test_dist_harness.py; helper, not a test module):
ranks that raise, crash or hang, alone or together, while the other waits."""

from __future__ import annotations

import ctypes
import os

import torch
import torch.distributed as dist

if os.environ.get("DIST_HARNESS_TEST_FAIL_IMPORT") == os.environ.get("DIST_HARNESS_RANK"):
    raise ImportError(f"rank {os.environ['DIST_HARNESS_RANK']} cannot import this module")


def _sum_of_ranks(ctx) -> int:
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return int(t.item())


def scenario_ok(ctx):
    return dict(rank=ctx.rank, sum=_sum_of_ranks(ctx))


def scenario_every_rank_raises(ctx):
    _sum_of_ranks(ctx)
    raise ValueError(f"expected on rank {ctx.rank}")


def scenario_one_raises_the_other_returns(ctx):
    if ctx.rank == 1:
        raise LookupError("only rank 1 raises")
    return "rank 0 returns"


def scenario_one_raises_the_other_waits(ctx):
    """Rank 1 raises before the all-reduce that rank 0 is already waiting in."""
    if ctx.rank == 1:
        raise KeyError("rank 1's own error")
    return _sum_of_ranks(ctx)


def scenario_after(ctx):
    """A collective after the failures: the job goes on with every rank."""
    return _sum_of_ranks(ctx)


def scenario_exits(ctx):
    if ctx.rank == 1:
        print("rank 1 goes down now", flush=True)
        os._exit(7)
    return _sum_of_ranks(ctx)


def scenario_segfaults(ctx):
    if ctx.rank == 1:
        print("rank 1 reads address 0", flush=True)
        ctypes.string_at(0)
    return _sum_of_ranks(ctx)


def scenario_receives_what_nobody_sends(ctx):
    """Rank 0 waits for a tensor rank 1 never sends (rank 1 returns)."""
    if ctx.rank == 0:
        dist.recv(torch.zeros(1), src=1)
    return ctx.rank


def scenario_deadlock(ctx):
    """Both ranks receive first: neither sends."""
    t = torch.zeros(1)
    dist.recv(t, src=1 - ctx.rank)
    dist.send(t, dst=1 - ctx.rank)
