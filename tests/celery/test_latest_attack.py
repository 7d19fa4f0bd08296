"""Attacks on last call wins (``on_contention="replace"``, ``lock_debounce``): duplicate
deliveries, retries and replacement, canvas, mixed policies on one key, Redis faults,
hostile data under the prefix and forged headers — against real Redis and real prefork
workers (``tests/latest_attack_app.py``).

Promises checked: never two holders, never a stuck lock or pending call, never a lost or
doubled call; at most one run (``lock_limit`` runs) and one pending call per key; the
newest *sent* call's arguments run; every superseded call ends ``SUPERSEDED``; nothing is
left behind in Redis. Each oracle counts the runs it expects, each exactly once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

from celery_redislock._keyspace import LockKeys, SemaphoreKeys, debounce_registry
from celery_redislock.celery.latest import SENT_HEADER, SUPERSEDED
from celery_redislock.celery.tasklock import LatestCall, TaskLock
from celery_redislock.testing import RedisServer

from .. import latest_attack_app as laa
from .._celery import wait_until, worker

APP = "tests.latest_attack_app"


class Run:
    def __init__(self, line: bytes) -> None:
        tag, task_id, retries, enter, leave = line.decode().split()
        self.tag, self.id, self.retries = tag, task_id, int(retries)
        self.enter, self.leave = float(enter), float(leave)

    def __repr__(self) -> str:
        return f"Run({self.tag} {self.id[:8]} r{self.retries} {self.enter:.3f}-{self.leave:.3f})"


def runs(r: redis.Redis, key: str) -> list[Run]:
    return [Run(line) for line in r.lrange(laa.runs_key(key), 0, -1)]


def tags(r: redis.Redis, key: str) -> list[str]:
    return [run.tag for run in runs(r, key)]


def state(task_id: str) -> str:
    return str(AsyncResult(task_id, app=laa.app).state)


def keys_of(key: str, limited: bool = False) -> LockKeys:
    name = f"l19:{key}"
    return SemaphoreKeys.for_name(name).line if limited else LockKeys.for_name(name)


def no_overlap(found: list[Run], limit: int = 1) -> None:
    """At most ``limit`` runs inside at once (their intervals, on one host's clock): when
    each run enters, fewer than ``limit`` others are inside."""
    for run in found:
        inside = [o for o in found if o is not run and o.enter <= run.enter < o.leave]
        assert len(inside) < limit, (run, inside)


def nothing_left(r: redis.Redis, key: str, limited: bool = False) -> None:
    keys = keys_of(key, limited)
    assert not r.exists(keys.lock), f"the lock is still held: {r.hgetall(keys.lock)!r}"
    assert r.llen(keys.parked) == 0, f"a call is still parked: {r.lrange(keys.parked, 0, -1)}"
    pending = r.hget(keys.latest, "p")
    assert pending is None, f"a call is still pending: {pending!r}"
    # A drainer's send rescores its key at now + redislock_ttl (a stale resend), and its
    # next look after that takes the key out: it is gone within a lease.
    wait_until(
        lambda: r.zscore(debounce_registry("redislock:"), keys.latest) is None,
        timeout=10,
        what="the key out of the debounce registry",
    )


def now_us() -> int:
    return time.time_ns() // 1000


# -- what a worker sees of the SENT header ---------------------------------------------


def test_a_worker_sees_the_sent_header_of_a_message(broker: RedisServer, tmp_path: Path) -> None:
    proc = worker(broker.url, tmp_path / "w.log", concurrency=1, app=APP)
    try:
        seen = laa.sent_header.apply_async(headers={SENT_HEADER: 12345}).get(timeout=10)
        print(seen)
        assert 12345 in (seen["headers"], seen["attribute"])
    finally:
        proc.kill()


# -- retries ---------------------------------------------------------------------------


def test_a_retry_with_no_newer_call_runs_again(broker: RedisServer, tmp_path: Path) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        call = laa.retrying.delay("r1", "x", 0.0, 1)
        wait_until(lambda: state(call.id) == "SUCCESS", timeout=20, what="the retried run")
        assert tags(r, "r1") == ["x/r0", "x/r1"]
        nothing_left(r, "r1")
    finally:
        proc.kill()


def test_a_retry_of_a_call_older_than_a_run_that_started_is_superseded(
    broker: RedisServer, tmp_path: Path
) -> None:
    """``self.retry()`` keeps the call's SENT header: the retry is the same call, older
    than the newer call that ran meanwhile, so it ends SUPERSEDED, not run with the older
    arguments after the newer call's run."""
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        call = laa.retrying.delay("r2", "old", 1.0, 1)
        wait_until(lambda: r.exists(keys_of("r2").lock), what="the first attempt's lock")
        newer = laa.replace.delay("r2", "new", 1.0)
        wait_until(lambda: state(newer.id) == "SUCCESS", timeout=20, what="the newer run")
        wait_until(lambda: state(call.id) == SUPERSEDED, timeout=20, what="the retry superseded")
        time.sleep(0.5)
        assert tags(r, "r2") == ["old/r0", "new"]
        assert AsyncResult(call.id, app=laa.app).info["superseded_by"] == newer.id
        no_overlap(runs(r, "r2"))
        nothing_left(r, "r2")
    finally:
        proc.kill()


# -- a call handed the lock -------------------------------------------------------------


def test_a_call_handed_the_lock_runs_though_a_newer_call_came_meanwhile(
    broker: RedisServer, tmp_path: Path
) -> None:
    """The release of a run hands the lock to the pending call P and sends P's message;
    a newer call N delivered before P's message is parked as the key's pending call
    (P counts as started). P's delivery then must run: it holds the lock. Superseding it
    instead left the lock to P's unused hand-over, which the sweeper handed to P again
    every sweep (superseded again each time): the lock stayed held, N never ran."""
    r = broker.client()
    main = worker(broker.url, tmp_path / "w1.log", concurrency=2, name="w1", app=APP)
    slow = worker(
        broker.url, tmp_path / "w2.log", concurrency=1, name="w2", app=APP, extra=["-Q", "slow"]
    )
    late = None
    try:
        first = laa.replace.delay("h", "first", 1.5)
        wait_until(lambda: r.exists(keys_of("h").lock), what="the first run's lock")
        pending = laa.replace.apply_async(("h", "pending", 0.0), queue="slow")
        wait_until(
            lambda: r.hget(keys_of("h").latest, "pt") == pending.id.encode(),
            what="the pending call",
        )
        slow.kill()  # nobody takes P's message up when the release sends it to "slow"
        wait_until(lambda: state(first.id) == "SUCCESS", timeout=20, what="the first run")
        wait_until(lambda: r.hget(keys_of("h").lock, pending.id) == b"0", what="the hand-over to P")
        newer = laa.replace.delay("h", "newer", 0.0)
        wait_until(
            lambda: r.hget(keys_of("h").latest, "pt") == newer.id.encode(),
            what="the newer call pending",
        )
        late = worker(
            broker.url, tmp_path / "w3.log", concurrency=1, name="w3", app=APP, extra=["-Q", "slow"]
        )
        wait_until(lambda: state(newer.id) == "SUCCESS", timeout=15, what="the newer run")
        assert state(pending.id) == "SUCCESS", state(pending.id)
        assert tags(r, "h") == ["first", "pending", "newer"]
        no_overlap(runs(r, "h"))
        nothing_left(r, "h")
    finally:
        main.kill()
        slow.kill()
        if late is not None:
            late.kill()


def test_scripts_a_handed_over_call_takes_its_lock_whatever_is_pending(
    redis_server: RedisServer,
) -> None:
    """The same at the script level (no worker): the park script of a call the lock was
    handed to takes it up, though a newer call became the pending one meanwhile."""
    client = redis_server.client()
    options = laa.replace.lock_options()
    name = f"scripts-{time.time_ns()}"

    def lock(owner: str) -> TaskLock:
        return TaskLock(client, name, task_id=owner, options=options)

    run, handed, newer = lock("run"), lock("handed"), lock("newer")
    sent = now_us()
    assert run.park_latest("m-run", 60, LatestCall("run", sent)).park.acquired
    assert not handed.park_latest("m-handed", 60, LatestCall("handed", sent + 1)).park.acquired
    assert run.finish(hold=0, done_ttl=60) is not None  # handed to "handed"
    reply = newer.park_latest("m-newer", 60, LatestCall("newer", sent + 2))
    assert not reply.park.acquired and not reply.superseded and reply.evicted is None
    reply = handed.park_latest("m-handed", 60, LatestCall("handed", sent + 1))
    assert reply.park.acquired and not reply.superseded, reply
    assert handed.finish(hold=0, done_ttl=60) is not None  # handed to the newer call
    assert newer.park_latest("m-newer", 60, LatestCall("newer", sent + 2)).park.acquired
    assert newer.finish(hold=0, done_ttl=60) is None
    keys = run.keys
    assert not client.exists(keys.lock) and client.llen(keys.parked) == 0
    assert client.hget(keys.latest, "p") is None
    assert client.hget(keys.latest, "st") == b"newer"


# -- duplicate deliveries --------------------------------------------------------------


def test_duplicates_of_the_running_pending_and_superseded_calls_run_nothing_twice(
    broker: RedisServer, tmp_path: Path
) -> None:
    """Each call's message published again (same id, same SENT header) while the first
    runs, while it is pending, after it was superseded, and after everything ran: the
    first and the newest run once each, the superseded call stays SUPERSEDED."""
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    base = now_us()

    def send(tag: str, sent: int, seconds: float = 0.0, task_id: str | None = None) -> Any:
        return laa.replace.apply_async(
            ("dup", tag, seconds), headers={SENT_HEADER: sent}, task_id=task_id
        )

    try:
        first = send("first", base, 1.5)
        wait_until(lambda: r.exists(keys_of("dup").lock), what="the first run's lock")
        older = send("older", base + 1)
        wait_until(lambda: r.hget(keys_of("dup").latest, "pt") == older.id.encode())
        newest = send("newest", base + 2)
        wait_until(lambda: state(older.id) == SUPERSEDED, what="the older call superseded")
        for _ in range(2):  # copies of each, while the first still runs
            send("first", base, 1.5, task_id=first.id)
            send("older", base + 1, task_id=older.id)
            send("newest", base + 2, task_id=newest.id)
        wait_until(lambda: state(newest.id) == "SUCCESS", timeout=20, what="the newest run")
        for _ in range(2):  # and after everything ran
            send("first", base, 1.5, task_id=first.id)
            send("older", base + 1, task_id=older.id)
            send("newest", base + 2, task_id=newest.id)
        time.sleep(1.0)
        wait_until(lambda: not r.llen("celery"), what="every copy taken")
        time.sleep(0.5)
        assert tags(r, "dup") == ["first", "newest"]
        assert (state(first.id), state(older.id)) == ("SUCCESS", SUPERSEDED)
        no_overlap(runs(r, "dup"))
        nothing_left(r, "dup")
    finally:
        proc.kill()


# -- mixed policies on one key ---------------------------------------------------------


def test_requeue_and_replace_calls_of_one_key_never_overlap_and_every_requeue_call_runs(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        first = laa.replace.delay("mix", "first", 1.0)
        wait_until(lambda: r.exists(keys_of("mix").lock), what="the first run's lock")
        queued = [laa.requeue.delay("mix", f"q{i}", 0.1) for i in range(3)]
        replaced = [laa.replace.delay("mix", f"p{i}", 0.1) for i in range(3)]
        queued += [laa.requeue.delay("mix", f"q{i}", 0.1) for i in range(3, 5)]
        ids = [first.id, *(c.id for c in queued), replaced[-1].id]
        wait_until(lambda: all(state(i) == "SUCCESS" for i in ids), timeout=30, what="runs")
        assert [state(c.id) for c in replaced[:-1]] == [SUPERSEDED, SUPERSEDED]
        time.sleep(0.5)
        found = tags(r, "mix")
        assert sorted(found) == sorted(["first", "q0", "q1", "q2", "q3", "q4", "p2"]), found
        no_overlap(runs(r, "mix"))
        nothing_left(r, "mix")
    finally:
        proc.kill()


def test_a_replace_call_takes_the_place_of_an_older_debounced_call_of_its_key(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        waiting = laa.debounced.delay("mixd", "debounced", 0.0)
        wait_until(lambda: r.hget(keys_of("mixd").latest, "pt") == waiting.id.encode())
        now = laa.replace.delay("mixd", "replace", 0.0)
        wait_until(lambda: state(now.id) == "SUCCESS", what="the replace call's run")
        wait_until(lambda: state(waiting.id) == SUPERSEDED, what="the debounced call superseded")
        time.sleep(laa.DEBOUNCE + 0.5)  # the drainer finds nothing to send
        assert tags(r, "mixd") == ["replace"]
        nothing_left(r, "mixd")
    finally:
        proc.kill()


def test_replace_with_lock_limit_two_never_runs_three_and_runs_the_newest(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    base = now_us()
    try:
        calls = []
        for i in range(12):  # sent in order; workers take them in any order
            calls.append(
                laa.replace_two.apply_async(("two", f"c{i}", 0.4), headers={SENT_HEADER: base + i})
            )
            time.sleep(0.05)
        ids = [c.id for c in calls]
        wait_until(
            lambda: all(state(i) in ("SUCCESS", SUPERSEDED) for i in ids),
            timeout=30,
            what="every call ran or was superseded",
        )
        found = runs(r, "two")
        ran = {run.id for run in found}
        assert len(ran) == len(found)  # none twice
        assert ran == {i for i in ids if state(i) == "SUCCESS"}
        assert calls[-1].id in ran  # the newest sent runs
        no_overlap(found, limit=2)
        nothing_left(r, "two", limited=True)
    finally:
        proc.kill()


# -- forged and odd SENT headers -------------------------------------------------------


@pytest.mark.parametrize("header", [-5, "soon", 2**80, 1.5, None, True])
def test_a_replace_call_with_an_odd_sent_header_runs_as_if_sent_when_received(
    broker: RedisServer, tmp_path: Path, header: Any
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        call = laa.replace.apply_async(("odd", "x", 0.0), headers={SENT_HEADER: header})
        wait_until(lambda: state(call.id) == "SUCCESS", what="the call's run")
        later = laa.replace.delay("odd", "later", 0.0)
        wait_until(lambda: state(later.id) == "SUCCESS", what="a later call's run")
        assert tags(r, "odd") == ["x", "later"]
        nothing_left(r, "odd")
    finally:
        proc.kill()


def test_a_debounced_call_with_a_sent_header_far_ahead_still_runs_once(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        ahead = now_us() + 10**12  # some 11 days ahead: a forged header, or a bad clock
        call = laa.debounced.apply_async(("ahead", "x", 0.0), headers={SENT_HEADER: ahead})
        wait_until(lambda: state(call.id) == "SUCCESS", timeout=8, what="the call's run")
        time.sleep(laa.DEBOUNCE + 0.5)
        assert tags(r, "ahead") == ["x"]
        nothing_left(r, "ahead")
    finally:
        proc.kill()
