"""Attacks on running on (``redislock_run_on``): revocation, a run-on hand-over whose
lease runs out before the next task starts, leases of long run-on tasks, retries.

Real ``celery worker`` processes on the session's private redis-server
(``tests.runon_attack_app``); the oracle is each run's start and end, logged by the task
(``tests.runon_app``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from celery_redislock.testing import RedisServer

from .. import runon_app as ra
from .. import runon_attack_app as raa
from .._celery import wait_until, worker
from .test_run_on import (
    RUNS_ON,
    _assert_one_at_a_time,
    _ends,
    _lock_records_gone,
    _park,
    _replied,
    _round_of_three,
    _starts,
    _warm,
)

APP = "tests.runon_attack_app"


@pytest.mark.parametrize(
    "kind",
    [
        "off",  # lock_run_on=0: handed over through the broker, dropped there
        "job",  # run on: the releasing process finds the id revoked (celery.revokes)
    ],
)
def test_a_revoked_parked_task_is_not_run_on(
    runon_server: RedisServer, tmp_path: Path, kind: str
) -> None:
    """A parked task revoked before the lock comes to it is dropped, as its delivery
    through the broker is (the worker's main process knows it revoked; it hands the lock
    on to the next): the process that releases the lock must not run it on."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        _warm("rev")
        first = ra.job.delay("rev", 1.5)
        wait_until(lambda: len(_starts(r, "rev")) == 2, timeout=30)
        task = ra.off if kind == "off" else ra.job
        revoked, after = _park(r, "rev", [(task, 0.05), (ra.job, 0.05)])
        ra.app.control.revoke(revoked.id)  # type: ignore[attr-defined]
        wait_until(lambda: f"revoked: {revoked.id}" in proc.text(), timeout=15)
        first.get(timeout=60)
        after.get(timeout=60)  # type: ignore[attr-defined]
        ids = [s[0] for s in _starts(r, "rev")]
        assert revoked.id not in ids, "a revoked task ran (run on)"  # type: ignore[attr-defined]
        _lock_records_gone(r, "rev")
    finally:
        proc.kill()


def test_a_run_on_hand_over_whose_lease_ran_out_is_not_taken_blindly(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """The releasing task's own task_postrun receivers run before the next task, run on,
    takes its hold: when they take longer than the lease, the hold the release wrote is
    gone, and another task takes the free lock meanwhile. The task run on must not then
    record the hold as its own without asking Redis (two holders at once)."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_TTL": "2", "REDISLOCK_TEST_POSTRUN_SLEEP": "3.5"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    lock = "redislock:{job:gap}"
    try:
        _warm("gap")
        first = raa.slow_post.delay("gap", 0.5)
        wait_until(lambda: len(_starts(r, "gap")) == 2, timeout=30)
        (handed,) = _park(r, "gap", [(ra.job, 0.5)])
        wait_until(lambda: r.llen("postrun:stalled") == 1, timeout=30)
        assert r.hget(lock, handed.id) == b"1"  # type: ignore[attr-defined]  # run on
        wait_until(lambda: not r.exists(lock), timeout=15, what="the run-on hold's lease out")
        other = ra.job.delay("gap", 2.0)
        for result in (first, handed, other):
            result.get(timeout=60, propagate=False)  # type: ignore[attr-defined]
        ids = [handed.id, other.id]  # type: ignore[attr-defined]
        _assert_one_at_a_time(r, "gap", [first.id, *ids])
        assert handed.successful(), handed.result  # type: ignore[attr-defined]
    finally:
        proc.kill()


def test_a_hand_over_confirmed_late_still_brings_its_task_back_if_the_process_dies(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """The next task, run on, takes its hold later than a third of its lease after the
    release (a slow task_postrun receiver), while the hold is still its own: confirmed by
    a renewal, and its run-on record stays, so a SIGKILL of the process in the middle of
    it still has the worker park it again at once; it then runs to its end, once more."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_TTL": "3", "REDISLOCK_TEST_POSTRUN_SLEEP": "1.5"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    try:
        _warm("late")
        first = raa.slow_post.delay("late", 0.5)
        wait_until(lambda: len(_starts(r, "late")) == 2, timeout=30)
        (doomed,) = _park(r, "late", [(ra.job, 3.0)])
        wait_until(lambda: len(_starts(r, "late")) == 3, timeout=30)
        victim = _starts(r, "late")[2]
        assert victim[0] == doomed.id and victim[2] == _starts(r, "late")[1][2]  # run on
        record = r.hget("redislock:{job:late}:parked:dispatched", doomed.id)
        assert record is not None and record.startswith(b"i")  # kept: still run on
        os.kill(victim[2], signal.SIGKILL)
        doomed.get(timeout=60)
        ids = [s[0] for s in _starts(r, "late")]
        assert ids.count(doomed.id) == 2 and ids.count(first.id) == 1
    finally:
        proc.kill()


def test_a_run_on_task_longer_than_its_lease_keeps_its_lock(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """A task run on records the hold the release wrote without a round trip: the
    watchdog still renews it, so a run longer than the lease keeps the lock (no other
    run beside it; it ends holding it)."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_TTL": "2"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    try:
        _warm("lease")
        first = ra.job.delay("lease", 0.5)
        wait_until(lambda: len(_starts(r, "lease")) == 2, timeout=30)
        (long,) = _park(r, "lease", [(ra.job, 5.0)])
        wait_until(lambda: len(_starts(r, "lease")) == 3, timeout=30)
        time.sleep(3.0)  # past the lease it was handed with: renewed, or lost
        later = ra.job.delay("lease", 0.05)
        for result in (first, long, later):
            result.get(timeout=60)  # type: ignore[attr-defined]
        assert f"{RUNS_ON} runon.job[{long.id}]" in proc.text()  # type: ignore[attr-defined]
        _assert_one_at_a_time(r, "lease", [first.id, long.id, later.id])  # type: ignore[attr-defined]
        _lock_records_gone(r, "lease")
    finally:
        proc.kill()


def test_a_run_on_task_that_retries_itself_hands_on_and_retries(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """A task run on that calls ``self.retry()``: its lock is released (handed on to the
    next parked task, run on too), its retry runs once, its result is stored, and nothing
    is left held or parked."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        _warm("retry")
        first = ra.job.delay("retry", 1.0)
        wait_until(lambda: len(_starts(r, "retry")) == 2, timeout=30)
        flaky, after = _park(r, "retry", [(raa.flaky, 0.05), (ra.job, 0.05)])
        assert flaky.get(timeout=60) > 0  # type: ignore[attr-defined]
        after.get(timeout=60)  # type: ignore[attr-defined]
        first.get(timeout=60)
        ids = [s[0] for s in _starts(r, "retry")]
        assert ids.count(flaky.id) == 2 and ids.count(after.id) == 1  # type: ignore[attr-defined]
        assert f"{RUNS_ON} runon.flaky[{flaky.id}]" in proc.text()  # type: ignore[attr-defined]
        _lock_records_gone(r, "retry")
    finally:
        proc.kill()


def test_a_run_on_task_that_lost_its_lease_is_not_run_again(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """A task run on whose process stalls past its lease (SIGSTOP): the sweeper hands the
    lock on, and the next task holds it when the stalled run ends. That run's release
    finds another owner's hold (LockLostError, as for any run that lost its lease), but
    its run did end: its run-on record must go with it, not be parked again by the
    sweeper for a second run of the same task."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_TTL": "2", "REDISLOCK_TEST_RUN_ON_GRACE": "1"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    try:
        _warm("stop")
        first = ra.job.delay("stop", 0.5)
        wait_until(lambda: len(_starts(r, "stop")) == 2, timeout=30)
        stalled, holder = _park(r, "stop", [(ra.job, 1.0), (ra.job, 4.0)])
        wait_until(lambda: len(_starts(r, "stop")) == 3, timeout=30)
        pid = _starts(r, "stop")[2][2]
        assert _starts(r, "stop")[2][0] == stalled.id  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGSTOP)
        try:  # the sweeper hands the lock on once the stalled run's lease is out
            wait_until(lambda: len(_starts(r, "stop")) == 4, timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        stalled.get(timeout=30, propagate=False)  # type: ignore[attr-defined]
        holder.get(timeout=30)  # type: ignore[attr-defined]
        first.get(timeout=30)
        time.sleep(8.0)  # past the sweeper's grace (2 x lock_ttl) and a few passes
        ids = [s[0] for s in _starts(r, "stop")]
        assert ids.count(stalled.id) == 1, ids  # type: ignore[attr-defined]
        _lock_records_gone(r, "stop")
    finally:
        proc.kill()


def test_a_rate_limit_set_by_remote_control_turns_running_on_off(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """Celery's ``rate_limit`` is applied by the worker's main process, per message, and
    ``celery control rate_limit`` (as Flower sends) changes it there only: a pool process
    forked before would run the task on as if it had none, past the limit. Running on
    turns off in that worker for good; every task still runs once, in order."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        _warm("rated")
        expected: list[str] = []
        assert _round_of_three(r, proc, "rated", expected) == 2
        assert _replied(ra.app.control.rate_limit, ra.job.name, "1000/s")
        assert _round_of_three(r, proc, "rated", expected) == 0
        assert _replied(ra.app.control.rate_limit, ra.job.name, "")  # (no limit again)
        assert _round_of_three(r, proc, "rated", expected) == 0  # for good
        _assert_one_at_a_time(r, "rated", expected)
        assert proc.text().count("running on is off in this worker") == 1, proc.text()
    finally:
        proc.kill()


def _consumes(queue: str) -> bool:
    replies = ra.app.control.inspect(timeout=5, limit=1).active_queues() or {}
    return any(q["name"] == queue for queues in replies.values() for q in queues)


def test_a_task_of_a_queue_cancelled_by_remote_control_is_not_run_on(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """``celery control cancel_consumer other``: the worker takes no more tasks of
    ``other`` (its main process stops consuming it); its pool processes, forked before,
    still count ``other`` among its queues. A task of ``other`` parked before the cancel
    must not be run on by the process releasing the lock after it: it is handed over
    through ``other``, and runs (once) where ``other`` is consumed, here once the worker
    is told ``add_consumer other`` again."""
    r = runon_server.client()
    extra = ["-Q", "celery,other"]
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, extra=extra)
    other = ra.job.s().set(queue="other")
    try:
        _warm("cancel")
        expected: list[str] = []
        assert _round_of_three(r, proc, "cancel", expected, parked_on=other) == 2
        first = ra.job.delay("cancel", 5.0)
        wait_until(lambda: len(_starts(r, "cancel")) == len(expected) + 2, timeout=30)
        (parked,) = _park(r, "cancel", [(other, 0.05)])
        assert _replied(ra.app.control.cancel_consumer, "other")
        wait_until(lambda: not _consumes("other"), timeout=30, what="other cancelled")
        assert first.id not in _ends(r, "cancel"), "the holder ended before the cancel"
        first.get(timeout=60)
        assert f"{RUNS_ON} runon.job[{parked.id}]" not in proc.text(), "ran on, cancelled"
        assert ra.app.control.add_consumer("other", reply=True, timeout=10, limit=1)
        parked.get(timeout=60)
        expected.extend([first.id, parked.id])
        assert [s[0] for s in _starts(r, "cancel")[1:]] == expected  # each once, in order
        _assert_one_at_a_time(r, "cancel", expected)
        _lock_records_gone(r, "cancel")
    finally:
        proc.kill()


@pytest.mark.parametrize("how", ["revoke", "terminate KILL"])
def test_revoke_terminate_of_a_task_while_it_runs_on_ends_it(
    runon_server: RedisServer, tmp_path: Path, how: str
) -> None:
    """``revoke(id, terminate=True)`` of a task that runs: Celery ends its process, and the
    task, revoked, is not run again. A task run on must not run to its end either: the
    worker finds the pool process that runs it on (``celery.terminate``) and ends it, and
    says so in its reply; the one parked behind it still runs, once. The same by the
    ``terminate`` command (``celery control terminate KILL <id>``), with its signal."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        _warm("stopit")
        first = ra.job.delay("stopit", 0.5)
        wait_until(lambda: len(_starts(r, "stopit")) == 2, timeout=30)
        victim, after = _park(r, "stopit", [(ra.job, 4.0), (ra.job, 0.05)])
        wait_until(lambda: len(_starts(r, "stopit")) == 3, timeout=30)
        assert f"{RUNS_ON} runon.job[{victim.id}]" in proc.text()  # type: ignore[attr-defined]
        if how == "revoke":
            replies = ra.app.control.revoke(  # type: ignore[attr-defined]
                victim.id, terminate=True, reply=True, timeout=10
            )
        else:
            replies = ra.app.control.broadcast(  # type: ignore[attr-defined]
                "terminate",
                arguments={"signal": "KILL", "task_id": [victim.id]},
                reply=True,
                timeout=10,
            )
        said = [answer["ok"] for reply in replies for answer in reply.values()]
        assert said == [f"terminate: {victim.id}"]  # type: ignore[attr-defined]
        first.get(timeout=60)
        after.get(timeout=60)  # type: ignore[attr-defined]
        _lock_records_gone(r, "stopit")
        ids = [s[0] for s in _starts(r, "stopit")]
        assert ids.count(after.id) == 1  # type: ignore[attr-defined]
        assert victim.id not in _ends(r, "stopit"), "revoked with terminate, ran to its end"  # type: ignore[attr-defined]
    finally:
        proc.kill()
