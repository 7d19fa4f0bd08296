"""Running on (``redislock_run_on``): a worker process that releases a lock with tasks parked
on it runs them itself, in turn, instead of handing each over through the broker; and
nothing is lost or run twice when that process dies in the middle.

Real ``celery worker`` processes on the session's private redis-server
(``tests.runon_app``); the oracle is each run's start and end, logged by the task."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redislock._core import LockKeys
from celery_redislock._scripts import scripts_for
from celery_redislock.testing import RedisServer

from .. import runon_app as ra
from .._celery import wait_until, worker

APP = "tests.runon_app"
RUNS_ON = "runs on with"


def _park(r: redis.Redis, name: str, calls: list[tuple[Any, float]]) -> list[Any]:
    """Send each call, one by one, once the one before it is parked on ``job:<name>``."""
    sent = []
    lock = f"redislock:{{job:{name}}}:parked"
    for task, seconds in calls:
        before = r.llen(lock)
        sent.append(task.delay(name, seconds))
        wait_until(lambda before=before: r.llen(lock) == before + 1, timeout=30)
    return sent


def _starts(r: redis.Redis, name: str) -> list[tuple[str, int, int, float]]:
    """(task id, token, pid, start time) of every run of ``job:<name>``, in start order."""
    found = []
    for line in r.lrange(f"started:{name}", 0, -1):
        task_id, token, pid, at = line.decode().split()
        found.append((task_id, int(token), int(pid), float(at)))
    return found


def _ends(r: redis.Redis, name: str) -> dict[str, float]:
    return {
        line.split()[0].decode(): float(line.split()[1])
        for line in r.lrange(f"ended:{name}", 0, -1)
    }


def _assert_one_at_a_time(r: redis.Redis, name: str, expected: list[str]) -> None:
    """Every expected run started (the oracle saw each one), and none began before the
    one before it had ended, with rising fencing tokens."""
    starts, ends = _starts(r, name), _ends(r, name)
    assert {s[0] for s in starts} >= set(expected), (starts, expected)
    for before, after in zip(starts, starts[1:]):
        assert before[0] in ends, f"{before[0]} never ended but {after[0]} started"
        assert after[3] >= ends[before[0]], f"{after[0]} started inside {before[0]}"
        assert after[1] > before[1], "fencing tokens must rise"


def _lock_records_gone(r: redis.Redis, name: str, prefix: str = "redislock:") -> None:
    lock = f"{prefix}{{job:{name}}}"
    wait_until(lambda: not r.exists(lock), timeout=15, what="the lock given back")
    for suffix in (":parked", ":parked:messages", ":parked:dispatched"):
        assert not r.exists(lock + suffix), suffix


def _warm(name: str) -> None:
    """One run of the key: its next messages are checked (parked) at delivery."""
    ra.job.delay(name).get(timeout=60)


@pytest.mark.parametrize("where", ["same", "otherdb"])
def test_a_releasing_process_runs_the_tasks_parked_on_its_lock_itself(
    runon_server: RedisServer, tmp_path: Path, where: str
) -> None:
    """Five tasks parked behind a running one (at delivery, as envelopes; or, the locks in
    another database, by pool processes, as signatures): the holder's process runs each
    in turn after it, in arrival order, each once, one at a time, its result stored."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_LOCK_URL": runon_server.url[:-1] + "1"} if where == "otherdb" else {}
    locks = redis.Redis.from_url(env.get("REDISLOCK_TEST_LOCK_URL", runon_server.url))
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    try:
        _warm("chain")
        first = ra.job.delay("chain", 1.0)
        wait_until(lambda: len(_starts(r, "chain")) == 2, timeout=30)
        parked = []
        for n in range(5):  # one by one: parked in this order
            parked.append(ra.job.delay("chain", 0.05))
            wait_until(lambda n=n: locks.llen("redislock:{job:chain}:parked") == n + 1, timeout=30)
        tokens = [result.get(timeout=60) for result in [first, *parked]]
        assert tokens == sorted(tokens) and len(set(tokens)) == 6
        starts = _starts(r, "chain")[1:]
        assert [s[0] for s in starts] == [first.id] + [p.id for p in parked]  # each once
        assert {s[2] for s in starts} == {starts[0][2]}  # all in the first one's process
        _assert_one_at_a_time(r, "chain", [first.id] + [p.id for p in parked])
        wait_until(lambda: proc.text().count(RUNS_ON) >= 5, timeout=10)
        assert proc.text().count(RUNS_ON) == 5
        _lock_records_gone(locks, "chain")
    finally:
        proc.kill()
        locks.close()


def test_a_task_that_may_not_run_on_is_handed_over_through_the_broker(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """Tasks parked behind a run-on release that may not run in its process get a usual
    hand-over, through the broker, with no lock left held for them: one with a time limit
    (the worker's main process enforces it per message), one with ``lock_run_on=0``. Of
    the others, only one whose releasing task runs on is run on."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        _warm("mixed")
        first = ra.job.delay("mixed", 1.0)
        wait_until(lambda: len(_starts(r, "mixed")) == 2, timeout=30)
        calls = [ra.limited, ra.job, ra.job, ra.off, ra.job]
        parked = []
        for n, task in enumerate(calls):  # one by one: parked in this order
            parked.append(task.delay("mixed", 0.05))
            wait_until(lambda n=n: r.llen("redislock:{job:mixed}:parked") == n + 1, timeout=30)
        for result in [first, *parked]:
            result.get(timeout=60)
        starts = _starts(r, "mixed")[1:]
        ids = [s[0] for s in starts]
        assert ids == [first.id] + [p.id for p in parked]
        # first -> limited: through the broker (limited may not run on); limited -> job A:
        # through the broker (a time-limited release does not run on); job A -> job B: run
        # on; job B -> off: through the broker; off -> job C: through the broker.
        assert proc.text().count(RUNS_ON) == 1, proc.text()
        assert f"{RUNS_ON} runon.job[{parked[2].id}]" in proc.text()
        assert starts[3][2] == starts[2][2]  # job B in job A's process
        _assert_one_at_a_time(r, "mixed", ids)
        _lock_records_gone(r, "mixed")
    finally:
        proc.kill()


def test_a_process_killed_while_it_runs_on_loses_no_task(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """SIGKILL of the pool process in the middle of a task it runs on: that task has no
    broker message; the worker's main process, told its process died, parks it again at
    the head of the line (and hands it the lock, if its hold is still there); it runs
    again, each task once more than it was killed, with rising tokens."""
    r = runon_server.client()
    env = {"REDISLOCK_TEST_TTL": "2", "REDISLOCK_TEST_RUN_ON_GRACE": "1"}
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, env=env)
    try:
        _warm("kill")
        first = ra.job.delay("kill", 0.5)
        wait_until(lambda: len(_starts(r, "kill")) == 2, timeout=30)
        doomed = ra.job.delay("kill", 3.0)
        wait_until(lambda: r.llen("redislock:{job:kill}:parked") == 1, timeout=30)
        after = [ra.job.delay("kill", 0.05) for _ in range(2)]
        wait_until(lambda: len(_starts(r, "kill")) == 3, timeout=30)
        victim = _starts(r, "kill")[2]
        assert victim[0] == doomed.id and victim[2] == _starts(r, "kill")[1][2]  # run on
        assert r.hget("redislock:{job:kill}:parked:dispatched", doomed.id).startswith(b"i")
        os.kill(victim[2], signal.SIGKILL)
        # The worker parks it again as soon as it sees its process dead (a busy machine
        # may see that only after the hold's lease ran out: the others ran meanwhile).
        for result in [doomed, *after]:
            result.get(timeout=90)
        starts = _starts(r, "kill")
        ids = [s[0] for s in starts]
        assert ids.count(doomed.id) == 2 and ids.index(doomed.id) == 2  # killed, then again
        assert [ids.count(a.id) for a in after] == [1, 1]
        assert ids.count(first.id) == 1  # its redelivery (worker lost) found it done
        tokens = [s[1] for s in starts]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    finally:
        proc.kill()


def test_the_sweeper_parks_again_a_run_on_task_whose_hold_is_gone(
    runon_server: RedisServer,
) -> None:
    """sweep.lua on a run-on record: kept while its hold is there; marked when first seen
    without its hold; parked again, first in line, once the grace has passed since."""
    r = runon_server.client()
    lock = "redislock:{job:swept}"
    scripts = scripts_for(r)
    keys = LockKeys.for_lock(lock.encode()).sweep_keys("redislock:parked")

    def sweep(grace_ms: int) -> Any:
        return scripts.sweep(keys=keys, args=[3000, 1500, 10, grace_ms])

    r.hset(lock, mapping={"t1": 1, "holder": 0, "__fence__": 7})
    r.hset(lock + ":parked:messages", mapping={"t1": "E-msg", "t2": "E-next"})
    r.rpush(lock + ":parked", "t2")
    r.hset(lock + ":parked:dispatched", "t1", "i1")
    assert sweep(1)[0] == 0
    assert r.hget(lock + ":parked:dispatched", "t1") == b"i1"  # its hold is there: kept
    r.hdel(lock, "t1")
    sweep(60_000)
    marked = r.hget(lock + ":parked:dispatched", "t1")
    assert marked is not None and marked.startswith(b"x")  # seen gone: marked, not parked
    sweep(60_000)
    assert r.lrange(lock + ":parked", 0, -1) == [b"t2"]  # within the grace: not yet
    time.sleep(0.01)
    sweep(1)
    assert r.lrange(lock + ":parked", 0, -1) == [b"t1", b"t2"]  # first in line again
    assert not r.hexists(lock + ":parked:dispatched", "t1")

    # The grace is at least twice the lease the record names.
    r.delete(lock + ":parked")
    r.hset(lock + ":parked:dispatched", "t3", "i1/5000")
    r.hset(lock + ":parked:messages", "t3", "E-3")
    sweep(1)
    time.sleep(0.01)
    sweep(1)
    assert r.hget(lock + ":parked:dispatched", "t3").startswith(b"x")  # not yet: 2 x 5 s
    assert r.llen(lock + ":parked") == 0

    # A run-on record whose run left its done marker (it ended keeping its hold, which
    # then ran out) goes, and the task is not parked again.
    r.set(LockKeys.for_lock(lock.encode()).done("t3"), 1)  # (as the run would name it)
    sweep(1)
    assert not r.hexists(lock + ":parked:dispatched", "t3")
    assert not r.hexists(lock + ":parked:messages", "t3")
    assert r.llen(lock + ":parked") == 0


def test_unrun_gives_back_only_a_run_on_hold_of_its_token(runon_server: RedisServer) -> None:
    """handoff.lua "unrun": a run-on hand-over (count 1, its token) becomes a usual one
    (count 0, a plain hand-over record); anything else is left alone."""
    r = runon_server.client()
    lock = "redislock:{job:unrun}"
    keys = LockKeys.for_lock(lock.encode()).handoff_keys("t1")

    def unrun(token: int) -> Any:
        args = ["t1", "unrun", 3000, 0, "", "", "", "", "", "", "", token]
        return scripts_for(r).handoff(keys=keys, args=args)

    r.hset(lock, mapping={"t1": 1, "__fence__": 5})
    r.hset(lock + ":parked:dispatched", "t1", "i100")
    assert unrun(4) == [-2] and r.hget(lock, "t1") == b"1"  # another holding's token
    assert unrun(5) == [0] and r.hget(lock, "t1") == b"0"
    assert not r.hget(lock + ":parked:dispatched", "t1").startswith(b"i")
    assert unrun(5) == [-2]  # count 0 now: nothing to give back
    r.hset(lock, "t1", 2)
    assert unrun(5) == [-2] and r.hget(lock, "t1") == b"2"


def test_what_may_run_on_follows_the_documented_conditions() -> None:
    """``runon._runnable``: a LockedTask that runs on too, in plain requeue mode, that gives
    its lock back at its end, with no time limit, rate, eta or expires, and the releasing
    task's lease; and a worker started with time limits or task events runs nothing on."""
    from celery import Celery

    from celery_redislock.celery import runon
    from celery_redislock.task import LockedTask

    app = Celery("runon_conditions", broker="redis://127.0.0.1:1/0")
    app.conf.redislock_run_on = 5

    def task(name: str, **options: Any) -> Any:
        def body(x: Any) -> Any:
            return x

        body.__name__ = name
        return app.task(name=name, base=LockedTask, lock_key="k:{x}", shared=False, **options)(body)

    plain = task("plain")
    refused = {
        "off": task("off", lock_run_on=0),
        "hold": task("hold", lock_hold=5),
        "kept": task("kept", lock_release_on_retry=False),
        "rate": task("rate", lock_rate="5/s"),
        "celery_rate": task("celery_rate", rate_limit="5/s"),
        "limited": task("limited", time_limit=30),
        "soft": task("soft", soft_time_limit=30),
        "wait": task("wait", on_contention="wait"),
        "latest": task("latest", on_contention="replace"),
        "permits": task("permits", lock_limit=3),
        "ttl": task("ttl", lock_ttl=7),
    }
    app.finalize()
    options = plain.lock_options()
    none = None
    assert runon._runnable(app, "plain", None, None, none, options) is app.tasks["plain"]
    for name in refused:
        assert runon._runnable(app, name, None, None, none, options) is None, name
    assert runon._runnable(app, "plain", "2030-01-01T00:00:00", None, none, options) is None
    assert runon._runnable(app, "plain", None, "2030-01-01T00:00:00", none, options) is None
    assert runon._runnable(app, "plain", None, None, [9, None], options) is None
    assert runon._runnable(app, "unknown", None, None, none, options) is None
    # a message's timelimit in another form than [hard, soft] counts as a limit
    assert runon._runnable(app, "plain", None, None, "60", options) is None

    before = runon._events_on
    try:
        for flag in ("task_events", "time_limit", "soft_time_limit"):
            runon._note_events(options={flag: 10})
            assert runon._events_on, flag
        runon._note_events(options={"concurrency": 4})
        assert not runon._events_on
    finally:
        runon._events_on = before


def test_a_release_for_a_dead_process_leaves_another_process_s_hold(
    runon_server: RedisServer,
) -> None:
    """handoff.lua "all" for a dead pool process (``by``): a hold whose ``__by__`` names
    another process (another delivery of the same run took it) is left alone; one of that
    process, or with no ``__by__`` (taken by an earlier version), is given back."""
    r = runon_server.client()
    lock = "redislock:{job:by}"
    keys = LockKeys.for_lock(lock.encode()).handoff_keys("t1")

    def release_for(by: str) -> Any:
        args = ["t1", "all", 3000, 0, "", "", "", "", "", "", "", "", "", "", by]
        return scripts_for(r).handoff(keys=keys, args=args)

    r.hset(lock, mapping={"t1": 1, "__fence__": 5, "__by__": "w1@h:100"})
    assert release_for("w1@h:200") == [-2] and r.hget(lock, "t1") == b"1"
    assert release_for("w1@h:100") == [0] and not r.exists(lock)
    r.hset(lock, mapping={"t1": 1, "__fence__": 6})
    assert release_for("w1@h:200") == [0] and not r.exists(lock)


def test_a_dead_process_s_run_on_record_frees_only_its_own_hold(
    runon_server: RedisServer,
) -> None:
    """handoff.lua "dead" for process P: a run-on record of P whose task now holds the lock
    through another process (a later delivery of the same run, ``__by__`` Q, after P's
    lease ran out) does not free that hold; one whose hold P took does, and the task is
    parked again, first."""
    r = runon_server.client()
    lock = "redislock:{job:dead}"
    keys = LockKeys.for_lock(lock.encode()).handoff_keys("w1@h:1")

    def dead(tag: str) -> Any:
        args = [tag, "dead", 3000, 0, "", "", "", "", "", "", "", ""]
        return scripts_for(r).handoff(keys=keys, args=args)

    r.hset(lock, mapping={"t1": 1, "__fence__": 7, "__by__": "w2@h:9"})
    r.hset(lock + ":parked:dispatched", "t1", "i1/3000/w1@h:1")
    r.hset(lock + ":parked:messages", "t1", "E-msg")
    assert dead("w1@h:1") == [-2]
    assert r.hgetall(lock) == {b"t1": b"1", b"__fence__": b"7", b"__by__": b"w2@h:9"}

    r.delete(lock + ":parked")
    r.hset(lock, "__by__", "w1@h:1")
    r.hset(lock + ":parked:dispatched", "t1", "i1/3000/w1@h:1")
    reply = dead("w1@h:1")
    assert reply[0] == -1 and reply[2] == b"t1"  # freed, and handed to it again
    assert r.hget(lock, "t1") == b"0"


def test_task_events_or_a_time_limit_turned_on_by_remote_control_turn_running_on_off(
    runon_server: RedisServer, tmp_path: Path
) -> None:
    """Pool processes do not see what remote control changes in the worker's main process:
    ``enable_events`` (as Flower sends) turns running on off until ``disable_events``
    (tasks run on would be missing from the events), and ``time_limit`` turns it off for
    good (a chain would count against the releasing task's limit). Each round: a holder
    and two tasks parked behind it, every task run once, one at a time, in order."""
    r = runon_server.client()
    proc = worker(runon_server.url, tmp_path / "w.log", concurrency=2, app=APP, heartbeat=True)
    control = ra.app.control
    try:
        _warm("remote")
        expected: list[str] = []

        def round_of_three() -> int:
            return _round_of_three(r, proc, "remote", expected)

        assert round_of_three() == 2
        assert _replied(control.enable_events)
        assert round_of_three() == 0
        assert _replied(control.disable_events)
        assert round_of_three() == 2
        assert _replied(control.time_limit, ra.job.name, soft=100, hard=200)
        assert round_of_three() == 0
        assert _replied(control.disable_events)
        assert round_of_three() == 0  # a time limit keeps it off for good
        _assert_one_at_a_time(r, "remote", expected)
        text = proc.text()
        assert text.count("running on is off in this worker") == 2, text
        assert text.count("running on is on again in this worker") == 1, text
        assert "ERROR" not in text
    finally:
        proc.kill()


def _round_of_three(
    r: redis.Redis, proc: Any, name: str, expected: list[str], parked_on: Any = ra.job
) -> int:
    """A holder of ``job:<name>`` and two tasks (``parked_on``: a task or a signature)
    parked behind it, after the runs ``expected`` (extended with these three): every task
    run once, in order, nothing left held or parked; how many of the two ran on."""
    before = proc.text().count(RUNS_ON)
    first = ra.job.delay(name, 0.6)
    wait_until(lambda: len(_starts(r, name)) == len(expected) + 2, timeout=30)
    parked = _park(r, name, [(parked_on, 0.05), (parked_on, 0.05)])
    for result in (first, *parked):
        result.get(timeout=60)
    expected.extend(result.id for result in (first, *parked))
    assert [s[0] for s in _starts(r, name)[1:]] == expected  # each once, in order
    _lock_records_gone(r, name)
    return proc.text().count(RUNS_ON) - before


def _replied(command: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether the one worker answered the remote control ``command`` with "ok"."""
    replies = command(*args, reply=True, timeout=10, limit=1, **kwargs)
    return len(replies) == 1 and "ok" in next(iter(replies[0].values()))
