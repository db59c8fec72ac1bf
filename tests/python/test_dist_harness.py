"""The distributed tests' harness (dist_harness.py) fails fast, with the failing rank's own
error: a rank that raises while its peer waits in a collective, a rank that dies, a rank
that waits for what no rank sends, a rank that cannot even import the module. The
scenarios are in dist_harness_scenarios.py.

Fail fast is shown by the error each test gets, not by a clock: the jobs run with a short
timeout, and gloo's collectives time out only after the job does, so a harness that waited
for a timeout would hand back "timed out" (or a gloo timeout), never these errors."""

from __future__ import annotations

import os

import pytest

from dist_harness import Failure, run_scenarios

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_harness_scenarios.py")
TIMEOUT = 300.0  # the whole job, start-ups included (each stopped scenario restarts it)


def _not_a_timeout(text: str) -> None:
    assert "timed out" not in text.lower() and "timeout" not in text.lower(), text


@pytest.fixture(scope="module")
def raised():
    return run_scenarios(SCENARIOS, ["ok", "every_rank_raises", "one_raises_the_other_returns",
                                     "one_raises_the_other_waits", "receives_what_nobody_sends", "after"],
                         timeout=TIMEOUT)


@pytest.fixture(scope="module")
def crashed():
    return run_scenarios(SCENARIOS, ["exits", "segfaults", "after"], timeout=TIMEOUT)


def test_results_of_every_rank_come_back(raised):
    assert raised["ok"] == [dict(rank=0, sum=1), dict(rank=1, sum=1)]


def test_an_error_on_every_rank_is_each_ranks_failure(raised):
    for rank, r in enumerate(raised["every_rank_raises"]):
        assert isinstance(r, Failure) and r.type == "ValueError" and r.message == f"expected on rank {rank}", r
        assert "scenario_every_rank_raises" in r.traceback


def test_an_error_on_one_rank_leaves_the_others_result(raised):
    r0, r1 = raised["one_raises_the_other_returns"]
    assert r0 == "rank 0 returns"
    assert isinstance(r1, Failure) and r1.type == "LookupError" and r1.message == "only rank 1 raises", r1


def test_an_error_on_one_rank_while_the_other_waits_is_that_ranks_error(raised):
    r0, r1 = raised["one_raises_the_other_waits"]
    assert isinstance(r1, Failure) and r1.type == "KeyError" and "rank 1's own error" in r1.message, r1
    # Rank 0 was blocked in the all-reduce: its result leads with rank 1's error and
    # traceback, then where rank 0 waited.
    assert isinstance(r0, Failure) and r0.type == "PeerFailure", r0
    assert r0.message.startswith("rank 1 raised KeyError: \"rank 1's own error\""), r0.message
    assert "blocked" in r0.message
    assert r0.traceback.startswith(r1.traceback), r0.traceback
    assert "rank 0 was blocked in scenario one_raises_the_other_waits" in r0.traceback
    assert "all_reduce" in r0.traceback and "_sum_of_ranks" in r0.traceback, r0.traceback
    _not_a_timeout(r0.message)


def test_the_scenarios_after_stopped_ones_run_on_every_rank(raised):
    assert raised["after"] == [1, 1]


def test_a_rank_that_exits_is_reported_with_its_output(crashed):
    r0, r1 = crashed["exits"]
    assert isinstance(r1, Failure) and r1.type == "RankCrashed", r1
    assert r1.message == "rank 1 exited with status 7 in scenario exits", r1.message
    assert "rank 1 goes down now" in r1.traceback
    # Rank 0 lost its peer in the all-reduce: its own error follows rank 1's.
    assert isinstance(r0, Failure) and r0.type == "PeerFailure", r0
    assert r0.message.startswith("rank 1 exited with status 7 in scenario exits -- this rank "), r0.message
    assert "rank 1 goes down now" in r0.traceback


def test_a_rank_that_segfaults_is_reported_with_its_stack(crashed):
    r0, r1 = crashed["segfaults"]
    assert isinstance(r1, Failure) and r1.type == "RankCrashed", r1
    assert r1.message == "rank 1 was killed by signal SIGSEGV in scenario segfaults", r1.message
    assert "rank 1 reads address 0" in r1.traceback
    assert "Segmentation fault" in r1.traceback and "scenario_segfaults" in r1.traceback, r1.traceback
    assert isinstance(r0, Failure) and r0.type == "PeerFailure" and r0.message.startswith(r1.message), r0


def test_a_rank_that_waits_for_what_nobody_sends_is_reported_where_it_waits(raised):
    r0, r1 = raised["receives_what_nobody_sends"]
    assert r1 == 1
    assert isinstance(r0, Failure) and r0.type == "RankBlocked", r0
    assert r0.message.startswith("rank 0 was blocked in scenario receives_what_nobody_sends"), r0.message
    assert "every other rank had finished it" in r0.message
    assert "scenario_receives_what_nobody_sends" in r0.traceback and "recv" in r0.traceback, r0.traceback
    _not_a_timeout(r0.message)


def test_the_job_goes_on_after_crashes(crashed):
    assert crashed["after"] == [1, 1]


def test_a_deadlock_is_every_ranks_failure_and_the_restarts_are_bounded():
    res = run_scenarios(SCENARIOS, ["deadlock", "after"], timeout=TIMEOUT, max_restarts=0)
    for rank, r in enumerate(res["deadlock"]):
        assert isinstance(r, Failure) and r.type == "RankBlocked", r
        assert r.message.startswith(f"rank {rank} was blocked in scenario deadlock"), r.message
        assert "as was every rank" in r.message and "scenario_deadlock" in r.traceback, r
    for r in res["after"]:
        assert isinstance(r, Failure) and r.type == "NotRun" and "deadlock: rank 0 was blocked" in r.message, r


def test_a_rank_that_fails_before_the_scenarios_ends_the_job_with_its_error(monkeypatch):
    monkeypatch.setenv("DIST_HARNESS_TEST_FAIL_IMPORT", "1")
    with pytest.raises(RuntimeError) as info:
        run_scenarios(SCENARIOS, ["ok"], timeout=TIMEOUT)
    text = str(info.value)
    assert text.startswith("distributed job dist_harness_scenarios.py: rank 1 raised:\nTraceback"), text
    assert "ImportError: rank 1 cannot import this module" in text.split("--- rank 1's output", 1)[0], text
    assert "(rank 1 while importing dist_harness_scenarios.py; the job was stopped.)" in text
    _not_a_timeout(text)
