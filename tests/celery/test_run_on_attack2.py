"""Attacks on running on (``redislock_run_on``), second round: duplicate deliveries of a
task run on, a warm shutdown in the middle of a chain, run-on tasks that end otherwise
than by returning, forged parked messages in a run-on line, the worker's main process's
dead-process path (``runon.dead``), and two workers running on the same key.

Real ``celery worker`` processes on the session's private redis-server
(``tests.runon_attack_app``); the oracle is each run's start and end, logged by the task
(``tests.runon_app``)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from celery_redislock.testing import RedisServer

from .. import runon_app as ra
from .. import runon_attack_app as raa
from .._celery import wait_until, worker
from .test_run_on import RUNS_ON, _lock_records_gone, _park, _starts, _warm

APP = "tests.runon_attack_app"
PLACEHOLDER = "rltag0123456789abcdef"
REFUSED = "redislock: refused the parked message of task"


def _ends(r: redis.Redis, name: str) -> list[tuple[str, float]]:
    return [
        (line.split()[0].decode(), float(line.split()[1]))
        for line in r.lrange(f"ended:{name}", 0, -1)
    ]


def _assert_never_beside(r: redis.Redis, name: str, killed: tuple[float, ...] = ()) -> None:
    """No run of ``job:<name>`` started before the run before it ended (a run that never
    ended was killed: the next one started after a kill sent at one of ``killed``), and
    fencing tokens rose."""
    starts = _starts(r, name)
    ends: dict[str, list[float]] = {}
    for task_id, at in _ends(r, name):
        ends.setdefault(task_id, []).append(at)
    for n, (before, after) in enumerate(zip(starts, starts[1:])):
        again = [s[3] for s in starts[n + 1 :] if s[0] == before[0]]  # its next run, if any
        until = min(again, default=float("inf"))
        done = [at for at in ends.get(before[0], []) if before[3] <= at < until]
        if done:
            assert after[3] >= min(done), f"{after[0]} started inside {before[0]}"
        else:
            assert any(before[3] <= k <= after[3] for k in killed), (
                f"{before[0]} never ended but {after[0]} started",
                starts,
            )
        assert after[1] > before[1], ("fencing tokens must rise", starts)


def _ended_once(r: redis.Redis, name: str, ids: list[str]) -> None:
    """Each of ``ids`` ended exactly once."""
    ended = [task_id for task_id, _at in _ends(r, name)]
    assert [ended.count(task_id) for task_id in ids] == [1] * len(ids), (ids, ended)


def test_a_duplicate_of_a_task_run_on_does_not_run_it_again(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """The same task id sent again through the broker while its parked copy runs on
    (and one more while it is still parked): the copies find it running (re-queued) or
    finished (ignored); it runs once, nothing beside it, nothing left parked."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=3, app=APP)
    try:
        _warm("dup")
        first = ra.job.delay("dup", 1.0)
        wait_until(lambda: len(_starts(r, "dup")) == 2, timeout=30)
        x, y = _park(r, "dup", [(ra.job, 2.0), (ra.job, 0.05)])
        early = ra.job.apply_async(("dup", 0.05), task_id=y.id)  # while y is parked
        wait_until(lambda: len(_starts(r, "dup")) == 3, timeout=30)
        starts = _starts(r, "dup")
        assert starts[2][0] == x.id and starts[2][2] == starts[1][2]  # run on
        ra.job.apply_async(("dup", 2.0), task_id=x.id)  # while x runs on
        for result in (first, x, y, early):
            result.get(timeout=60)
        wait_until(lambda: "duplicate delivery ignored" in proc.text(), timeout=30)
        time.sleep(1.0)
        ids = [s[0] for s in _starts(r, "dup")]
        assert ids.count(x.id) == 1 and ids.count(y.id) == 1, ids
        _assert_never_beside(r, "dup")
        _lock_records_gone(r, "dup")
    finally:
        proc.kill()


def test_a_dead_duplicate_delivery_does_not_free_the_lock_of_the_copy_running_on(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """A second delivery of a task run on, whose pool process dies before its acquire
    (SIGKILL; a redelivery after a visibility timeout, an OOM kill): the worker's main
    process releases "every hold of that task id" for it — the hold of the copy still
    running on in another process. The lock goes to the next parked task while the first
    copy runs: two holders."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=3, app=APP)
    try:
        _warm("dead-dup")
        first = ra.job.delay("dead-dup", 1.0)
        wait_until(lambda: len(_starts(r, "dead-dup")) == 2, timeout=30)
        x, y = _park(r, "dead-dup", [(ra.job, 4.0), (ra.job, 0.05)])
        wait_until(lambda: len(_starts(r, "dead-dup")) == 3, timeout=30)
        assert _starts(r, "dead-dup")[2][0] == x.id  # run on
        ra.job.apply_async(("dead-dup", 4.0), task_id=x.id, headers={"stall_prerun": 10})
        wait_until(lambda: r.llen("prerun:stalled") == 1, timeout=30)
        pid = int(r.lindex("prerun:stalled", 0).split()[1])
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for result in (first, x, y):
            result.get(timeout=60, propagate=False)
        time.sleep(1.0)
        ids = [s[0] for s in _starts(r, "dead-dup")]
        assert ids.count(x.id) == 1 and ids.count(y.id) == 1, ids
        _assert_never_beside(r, "dead-dup", (killed,))
        assert x.successful(), x.result
    finally:
        proc.kill()


def test_a_warm_shutdown_in_the_middle_of_a_chain_loses_and_doubles_nothing(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """SIGTERM to the worker's main process while its pool process runs on, with more
    parked behind (a budget that ends mid-chain: the rest is handed over through the
    broker) and more sent after: once a worker is started again, every task has ended
    exactly once, none beside another, and the lock is free with nothing parked."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_RUN_ON": "1.5"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    again = None
    try:
        _warm("warm")
        first = ra.job.delay("warm", 1.0)
        wait_until(lambda: len(_starts(r, "warm")) == 2, timeout=30)
        parked = _park(r, "warm", [(ra.job, 0.4)] * 6)
        wait_until(lambda: len(_starts(r, "warm")) == 3, timeout=30)
        assert proc.process is not None
        proc.process.send_signal(signal.SIGTERM)
        later = [ra.job.delay("warm", 0.05) for _ in range(3)]
        proc.process.wait(60)
        again = worker(runon_server.url, tmp_path / "w2.log", concurrency=2, app=APP, env=env)
        every = [first, *parked, *later]
        for result in every:
            result.get(timeout=60)
        _ended_once(r, "warm", [result.id for result in every])
        _assert_never_beside(r, "warm")
        _lock_records_gone(r, "warm")
        assert RUNS_ON in proc.text()
    finally:
        proc.kill()
        if again is not None:
            again.kill()


def test_run_on_tasks_that_raise_ignore_reject_or_replace_hand_on(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """A chain of run-on tasks, each ending its own way (ValueError, Ignore,
    Reject(requeue=True), self.replace() with a task of the same key), with a usual task
    behind each: each runs once (the replacement once more, as its own run), the chain
    goes on, nothing beside another, and nothing is left held or parked."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        _warm("ends")
        first = ra.job.delay("ends", 1.0)
        wait_until(lambda: len(_starts(r, "ends")) == 2, timeout=30)
        calls = [(raa.boom, 0.05), (ra.job, 0.05), (raa.ignored, 0.05), (ra.job, 0.05)]
        calls += [(raa.rejected, 0.05), (ra.job, 0.05), (raa.replacer, 0.05), (ra.job, 0.05)]
        sent = _park(r, "ends", calls)
        boom, after_boom, ignored, after_ignored, rejected, after_reject, replacer, last = sent
        with pytest.raises(ValueError):
            boom.get(timeout=60)
        for result in (first, after_boom, after_ignored, after_reject, last):
            result.get(timeout=60)
        assert replacer.get(timeout=60) > 0  # the replacement's token
        time.sleep(1.5)  # a requeued Reject, if any, would be back by now
        ids = [s[0] for s in _starts(r, "ends")]
        for result in (boom, after_boom, ignored, after_ignored, rejected, after_reject, last):
            assert ids.count(result.id) == 1, (result.id, ids)
        assert ids.count(replacer.id) == 2, ids  # the replacer, then its replacement
        names = ("runon.boom", "runon.ignored", "runon.rejected", "runon.replacer")
        for task_name, result in zip(names, (boom, ignored, rejected, replacer)):
            assert f"{RUNS_ON} {task_name}[{result.id}]" in proc.text(), task_name
        _assert_never_beside(r, "ends")
        _lock_records_gone(r, "ends")
    finally:
        proc.kill()


def _forged_envelope(admin: redis.Redis, task_id: str, lock: str) -> str:
    """``runon.job("forge", 0.0)`` as a parked broker envelope (its format is public),
    with a made-up signature."""
    ra.job.apply_async(("forge", 0.0), queue="scratch", task_id=task_id)
    envelope = json.loads(admin.rpop("scratch"))
    envelope["properties"]["delivery_tag"] = PLACEHOLDER
    envelope["headers"]["redislock_parked"] = {"lock": lock, "list": "celery", "mac": "0" * 64}
    return f"Ecelery\n{PLACEHOLDER}\n{json.dumps(envelope)}"


def test_a_forged_parked_message_in_a_run_on_line_is_refused(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """Forged parked messages (an envelope with a made-up signature, an unsigned
    signature) first in the line behind a task whose release runs on: refused, never
    run; the legit tasks behind them run once each; the lock ends free."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    lock = "redislock:{job:forge}"
    try:
        _warm("forge")
        first = ra.job.delay("forge", 1.5)
        wait_until(lambda: len(_starts(r, "forge")) == 2, timeout=30)
        envelope = _forged_envelope(r, "evil-envelope", lock)
        signature = json.dumps(dict(ra.job.signature(("forge", 0.0), task_id="evil-signature")))
        for task_id, message in (("evil-envelope", envelope), ("evil-signature", signature)):
            r.rpush(lock + ":parked", task_id)
            r.hset(lock + ":parked:messages", task_id, message)
        legit = _park(r, "forge", [(ra.job, 0.05), (ra.job, 0.05)])
        for result in (first, *legit):
            result.get(timeout=60)
        ids = [s[0] for s in _starts(r, "forge")]
        assert "evil-envelope" not in ids and "evil-signature" not in ids
        assert [ids.count(result.id) for result in legit] == [1, 1]
        assert f"{REFUSED} 'evil-envelope'" in proc.text()
        assert f"{REFUSED} 'evil-signature'" in proc.text()
        _assert_never_beside(r, "forge")
        _lock_records_gone(r, "forge")
    finally:
        proc.kill()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_of_the_releasing_task_mid_chain(
    runon_server: RedisServer, tmp_path: Path, how: str
) -> None:
    """``revoke(terminate=True)`` of the releasing task's id (its job is the whole chain,
    as the main process sees it) while its process runs on a long task with more parked
    behind: the task running on is parked again and run again, every task ends exactly
    once, none beside another; nothing is left."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_TTL": "2", "REDISLOCK_TEST_RUN_ON_GRACE": "1"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    try:
        _warm("term")
        first = ra.job.delay("term", 0.5)
        wait_until(lambda: len(_starts(r, "term")) == 2, timeout=30)
        doomed, *after = _park(r, "term", [(ra.job, 3.0), (ra.job, 0.05), (ra.job, 0.05)])
        wait_until(lambda: len(_starts(r, "term")) == 3, timeout=30)
        assert _starts(r, "term")[2][0] == doomed.id
        killed = time.monotonic()
        ra.app.control.revoke(first.id, terminate=True, signal=how)
        try:
            for result in (doomed, *after):
                result.get(timeout=30)
            first.get(timeout=30)
        finally:
            (tmp_path / "keys").write_text(repr({k: r.type(k) for k in r.keys("redislock:*")}))
            lk = "redislock:{job:term}"
            dump = {"lock": r.hgetall(lk), "parked": r.lrange(lk + ":parked", 0, -1)}
            dump["dispatched"] = r.hgetall(lk + ":parked:dispatched")
            dump["starts"] = _starts(r, "term")
            dump["ids"] = [doomed.id, *(a.id for a in after), first.id]
            (tmp_path / "dump").write_text(repr(dump))
        _ended_once(r, "term", [doomed.id, *(a.id for a in after)])
        _assert_never_beside(r, "term", (killed,))
        _lock_records_gone(r, "term")
    finally:
        proc.kill()


def test_a_process_killed_in_the_releasing_tasks_postrun_loses_no_task(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """SIGKILL of the pool process after its release handed the next task to it (count
    1, its run-on record) and before that task started (a stalled task_postrun receiver):
    the main process parks it again and it runs once; the releasing task is not run
    again; nothing is left."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_TTL": "3", "REDISLOCK_TEST_POSTRUN_SLEEP": "0.8"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    lock = "redislock:{job:post}"
    try:
        _warm("post")
        first = raa.slow_post.delay("post", 1.0)
        wait_until(lambda: len(_starts(r, "post")) == 2, timeout=30)
        handed, after = _park(r, "post", [(ra.job, 0.05), (ra.job, 0.05)])
        wait_until(lambda: r.llen("postrun:stalled") == 1, timeout=30)
        assert r.hget(lock, handed.id) == b"1"
        os.kill(_starts(r, "post")[1][2], signal.SIGKILL)
        killed = time.monotonic()
        for result in (handed, after):
            result.get(timeout=60)
        first.get(timeout=30)
        time.sleep(1.0)
        ids = [s[0] for s in _starts(r, "post")]
        assert [ids.count(t.id) for t in (first, handed, after)] == [1, 1, 1], ids
        _assert_never_beside(r, "post", (killed,))
        _lock_records_gone(r, "post")
    finally:
        proc.kill()


def test_two_workers_running_on_the_same_key(runon_server: RedisServer, tmp_path: Path) -> None:
    """Two workers, both running on, a burst of one key's tasks sent to both: every task
    ends exactly once, none beside another, and the lock ends free."""
    r = runon_server.client()
    one = worker(runon_server.url, tmp_path / "w1.log", concurrency=2, app=APP, name="w1")
    two = worker(runon_server.url, tmp_path / "w2.log", concurrency=2, app=APP, name="w2")
    try:
        _warm("two")
        _warm("two")
        sent = [ra.job.delay("two", 0.05) for _ in range(40)]
        for result in sent:
            result.get(timeout=60)
        _ended_once(r, "two", [result.id for result in sent])
        _assert_never_beside(r, "two")
        _lock_records_gone(r, "two")
        assert RUNS_ON in one.text() + two.text()
    finally:
        one.kill()
        two.kill()


def test_a_process_ended_by_sigterm_mid_body_leaves_its_task_to_run_again(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """SIGTERM to the pool process in the middle of a usual task's body (not run on;
    revoke(terminate=True) of another task's id, a supervisor stopping the process group):
    billiard raises SystemExit in the body. The process is ended, not the run: no done
    marker, so the redelivery (task_reject_on_worker_lost) runs it again to its end."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        _warm("sigterm")
        doomed = ra.job.delay("sigterm", 3.0)
        wait_until(lambda: len(_starts(r, "sigterm")) == 2, timeout=30)
        killed = time.monotonic()
        os.kill(_starts(r, "sigterm")[1][2], signal.SIGTERM)
        doomed.get(timeout=30)
        _ended_once(r, "sigterm", [doomed.id])
        _assert_never_beside(r, "sigterm", (killed,))
        _lock_records_gone(r, "sigterm")
    finally:
        proc.kill()
