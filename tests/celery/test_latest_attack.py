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

import itertools
import json
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


def _running_and_pending(lr: Any, key: str, seconds: float) -> tuple[Any, Any]:
    """A first ``replace`` call of ``key`` running ``seconds`` (its lock taken, in ``lr``),
    and an older call pending behind it: both results."""
    first = laa.replace.delay(key, "first", seconds)
    wait_until(lambda: lr.exists(keys_of(key).lock), what="the first run's lock")
    older = laa.replace.delay(key, "older", 0.0)
    wait_until(lambda: lr.hget(keys_of(key).latest, "pt") == older.id.encode())
    return first, older


def test_a_worker_sees_the_sent_header_of_a_message(broker: RedisServer, tmp_path: Path) -> None:
    proc = worker(broker.url, tmp_path / "w.log", concurrency=1, app=APP)
    try:
        seen = laa.sent_header.apply_async(headers={SENT_HEADER: 12345}).get(timeout=10)
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
        # (its result is stored after its release handed the lock on)
        wait_until(lambda: state(pending.id) == "SUCCESS", timeout=10, what="pending's result")
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


# -- the drainer's sent-but-not-taken window ------------------------------------------


def test_a_due_debounced_call_whose_message_is_lost_is_sent_again_and_runs_once(
    broker: RedisServer, tmp_path: Path
) -> None:
    """A drainer sends a due call's message, and the message is lost before any worker
    takes it up (emptied from the queue here): the next drainer sends it again once
    ``redislock_ttl`` has passed since, and it runs once."""
    from celery_redislock.celery.latest import serve_debounced

    r = broker.client()
    one = worker(broker.url, tmp_path / "w1.log", concurrency=1, name="w1", app=APP)
    two = None
    try:
        call = laa.debounced.delay("lost", "x", 0.0)
        wait_until(lambda: r.hget(keys_of("lost").latest, "pt") == call.id.encode())
        one.kill()  # before it is due: no drainer left
        wait_until(lambda: r.llen("celery") == 0)
        time.sleep(laa.DEBOUNCE)
        serve_debounced(laa.app, r, "redislock:", 3000)  # this process sends it...
        assert r.llen("celery.redislock") == 1
        assert r.hget(keys_of("lost").latest, "pq") is not None
        r.delete("celery.redislock")  # ...and the message is lost
        two = worker(broker.url, tmp_path / "w2.log", concurrency=1, name="w2", app=APP)
        wait_until(lambda: state(call.id) == "SUCCESS", timeout=20, what="the resent call's run")
        time.sleep(0.5)
        assert tags(r, "lost") == ["x"]
        nothing_left(r, "lost")
    finally:
        one.kill()
        if two is not None:
            two.kill()


# -- hostile data under the prefix -----------------------------------------------------


def test_a_forged_due_debounced_call_is_refused_and_never_runs(
    broker: RedisServer, tmp_path: Path
) -> None:
    """Whoever may write the prefix writes a due pending call (message unsigned, then
    signed with another key) under a debounced task's key: the drainer refuses it, never
    runs it, and clears it; real calls of the key still run."""
    from celery_redislock.celery import signing
    from celery_redislock.celery.envelope import _dumps

    r = broker.client()
    keys = keys_of("forged")
    registry = debounce_registry("redislock:")
    signature = laa.debounced.signature(("forged", "evil", 0.0), task_id="evil")
    text = _dumps(dict(signature))
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        for message in (text, signing.sign_signature(b"k" * 32, keys.lock, "evil", text)):
            past = now_us() - 10**6
            r.hset(
                keys.latest,
                mapping={"p": "evil", "pt": "evil", "ps": past, "pf": past, "pd": 1, "pm": message},
            )
            r.zadd(registry, {keys.latest: 1})
            wait_until(lambda: r.hget(keys.latest, "p") is None, what="the forged call cleared")
        time.sleep(0.5)
        assert tags(r, "forged") == []
        assert proc.text().count("refused the parked message of task 'evil'") == 2
        call = laa.debounced.delay("forged", "real", 0.0)
        wait_until(lambda: state(call.id) == "SUCCESS", timeout=10, what="a real call's run")
        assert tags(r, "forged") == ["real"]
        nothing_left(r, "forged")
    finally:
        proc.kill()


@pytest.mark.parametrize(
    "junk",
    [
        {"p": "ghost", "pt": "ghost", "ps": "soon", "pf": "x", "pd": "later"},
        {"p": "ghost", "pt": "ghost", "ps": "12", "pf": "nan", "pd": "-5"},
        {"p": "ghost"},
        {"s": "yesterday", "st": "ghost"},
        {"s": "12"},
        {"pd": "1", "pm": "junk"},
    ],
)
def test_junk_in_the_latest_hash_never_stops_the_key(
    broker: RedisServer, tmp_path: Path, junk: dict[str, str]
) -> None:
    r = broker.client()
    keys = keys_of("junk")
    r.hset(keys.latest, mapping=junk)
    r.zadd(debounce_registry("redislock:"), {keys.latest: 1, b"redislock:{nope}": 1, b"x": 2})
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        calls = [laa.replace.delay("junk", "r", 0.0), laa.debounced.delay("junk", "d", 0.0)]
        wait_until(lambda: state(calls[1].id) == "SUCCESS", timeout=15, what="the last call")
        assert state(calls[0].id) in ("SUCCESS", SUPERSEDED)
        assert tags(r, "junk")[-1] == "d"
        nothing_left(r, "junk")
        wait_until(lambda: r.zcard(debounce_registry("redislock:")) == 0, timeout=10)
    finally:
        proc.kill()


@pytest.mark.parametrize("field", ["s", "ps"])
def test_a_wrong_type_or_far_future_time_under_the_prefix(
    broker: RedisServer, tmp_path: Path, field: str
) -> None:
    """A string where the hash belongs is replaced. A sent time far in the future written
    in the hash (``s``: the newest run that started; ``ps``: a pending call that is not
    parked) by whoever may write the prefix would make every call of the key SUPERSEDED
    until then: no worker can have counted such a time (each caps a call's at its
    clock), so it is read as junk and the key's next call runs."""
    r = broker.client()
    keys = keys_of(f"far{field}")
    r.set(keys.latest, "junk")
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        call = laa.replace.delay(f"far{field}", "x", 0.0)
        wait_until(lambda: state(call.id) == "SUCCESS", what="a call over a string")
        far = str(now_us() + 10**15)
        r.hset(keys.latest, mapping={field: far, {"s": "st", "ps": "pt"}[field]: "ghost"})
        if field == "ps":
            r.hset(keys.latest, "p", "ghost")
        r.persist(keys.latest)
        after = laa.replace.delay(f"far{field}", "y", 0.0)
        wait_until(lambda: state(after.id) == "SUCCESS", what="the call after the forged time")
        assert tags(r, f"far{field}") == ["x", "y"]
    finally:
        proc.kill()


# -- Redis faults ----------------------------------------------------------------------


def test_a_call_evicted_by_a_park_whose_reply_is_lost_still_ends_superseded(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """The locks' Redis behind a FaultProxy; the park round trip of the newest call runs
    (it takes the older pending call's place) and its reply is lost. The newest call
    comes back (Redis unreachable: sent again) and runs; the older call must still end
    SUPERSEDED (no fallback copy in the broker to supersede it again later)."""
    from celery_redislock.testing import FaultProxy

    locks = redis_server_factory()
    r, lr = broker.client(), locks.client()
    with FaultProxy(locks) as proxy:
        env = {
            "REDISLOCK_TEST_LOCK_URL": proxy.url,
            "REDISLOCK_TEST_LOCK_TIMEOUT": "0.5",
            "REDISLOCK_TEST_NO_FALLBACK": "1",
        }
        proc = worker(broker.url, tmp_path / "w.log", concurrency=2, env=env, app=APP)
        try:
            first, older = _running_and_pending(lr, "drop", 1.5)
            fault = proxy.inject("drop_reply", "park")
            newest = laa.replace.delay("drop", "newest", 0.0)
            wait_until(fault.fired.is_set, what="the newest call's park")
            wait_until(lambda: state(newest.id) == "SUCCESS", timeout=20, what="its run")
            assert tags(r, "drop") == ["first", "newest"]
            # (the first's result is stored after its release handed the lock on)
            wait_until(lambda: state(first.id) == "SUCCESS", timeout=10, what="first's result")
            wait_until(lambda: state(older.id) == SUPERSEDED, timeout=5, what="older superseded")
        finally:
            proc.kill()


# -- canvas, direct and eager calls ----------------------------------------------------


def test_a_superseded_link_of_a_chain_ends_the_chain(broker: RedisServer, tmp_path: Path) -> None:
    """Observed: a chain whose replace link is superseded stops there (the link ends
    SUPERSEDED, its callbacks are not sent): the chain's later links never run and their
    results stay PENDING, as after a SKIPPED link."""
    from celery import chain

    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        first = laa.replace.delay("chain", "first", 1.0)
        wait_until(lambda: r.exists(keys_of("chain").lock), what="the first run's lock")
        chained = chain(
            laa.replace.si("chain", "chained", 0.0), laa.follow.si("after", "chain")
        ).apply_async()
        link = chained.parent
        wait_until(lambda: r.hget(keys_of("chain").latest, "pt") == link.id.encode())
        newest = laa.replace.delay("chain", "newest", 0.0)
        wait_until(lambda: state(newest.id) == "SUCCESS", timeout=20, what="the newest run")
        assert state(link.id) == SUPERSEDED
        wait_until(lambda: state(first.id) == "SUCCESS", timeout=10, what="first's result")
        time.sleep(1.0)
        assert r.llen("l19:follow:chain") == 0 and chained.state == "PENDING"
        assert tags(r, "chain") == ["first", "newest"]
        nothing_left(r, "chain")
    finally:
        proc.kill()


def test_direct_and_eager_calls_of_a_replace_task_run_under_the_lock(broker: RedisServer) -> None:
    """Observed: a direct call or ``.apply()`` of a replace task takes the lock like any
    direct call (wait up to lock_wait, never pending, never superseding): it runs, and
    leaves no pending call and no 'newest started' record behind."""
    r = broker.client()
    assert laa.replace("direct", "called", 0.0) == "called"
    assert laa.replace.apply(("direct", "applied", 0.0)).get() == "applied"
    assert tags(r, "direct") == ["called", "applied"]
    assert not r.exists(keys_of("direct").latest)
    nothing_left(r, "direct")


# -- validation ------------------------------------------------------------------------


@pytest.mark.hypothesis  # its @given is inner: marked so conftest keeps the collector off
def test_any_debounce_values_are_taken_or_refused_at_decoration_naming_the_option() -> None:
    """Hypothesis: whatever lock_debounce / lock_debounce_max / on_contention hold, the
    task is either refused at decoration with a LockConfigurationError naming the option,
    or it is made and its LatestCall arguments are whole milliseconds in range."""
    from celery import Celery
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from celery_redislock import LockConfigurationError
    from celery_redislock._core import MAX_MS
    from celery_redislock.celery.latest import latest_call
    from celery_redislock.task import LockedTask

    numbers = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**12), max_value=10**12),
        st.floats(),
        st.floats(min_value=0.0, max_value=0.01),
        st.text(max_size=4),
        st.just(10**400),
    )
    policies = st.sampled_from([None, "requeue", "replace", "skip", "wait", "raise", "nope"])
    from celery_redislock.settings import LockOptions

    app = Celery("latest-hypothesis")
    app.finalize()  # tasks decorated from now on are made at once
    names = itertools.count()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(numbers, numbers, policies)
    def check(debounce: Any, bound: Any, policy: Any) -> None:
        options = {"lock_debounce": debounce, "lock_debounce_max": bound}
        if policy is not None:
            options["on_contention"] = policy
        try:

            @app.task(
                base=LockedTask, lock_key="k:{x}", shared=False, name=f"m{next(names)}", **options
            )
            def made(x: int) -> None: ...

        except LockConfigurationError as exc:
            message = str(exc)
            assert "lock_debounce" in message or "on_contention" in message, message
            return
        lock_options = LockOptions().merged(type(made)._lock_overrides)
        call = latest_call("id", 1, lock_options)
        if lock_options.debounce > 0:
            assert 1 <= call.quiet_ms <= call.max_ms <= MAX_MS
        else:
            assert (call.quiet_ms, call.max_ms) == (0, 0)

    check()


def test_a_task_bound_over_the_apps_debounce_setting_is_accepted() -> None:
    from celery import Celery

    from celery_redislock.task import LockedTask

    app = Celery("latest-app-debounce", broker="redis://127.0.0.1:1/0")
    app.conf.redislock_debounce = 1.0

    @app.task(base=LockedTask, lock_key="k:{x}", lock_debounce_max=5.0, shared=False)
    def bounded(x: int) -> None: ...

    app.finalize()


# -- second round: the superseded records (x:<task id>) --------------------------------


def _scripts_lock(client: redis.Redis, name: str) -> Any:
    options = laa.replace.lock_options()
    return lambda owner: TaskLock(client, name, task_id=owner, options=options)


def test_scripts_a_record_stamped_ahead_of_the_servers_clock_is_taken_over(
    redis_server: RedisServer,
) -> None:
    """A superseded call's record whose time is ahead of the server's clock (the clock
    stepped back since it was written, or junk) is listed to the key's next call like a
    stale one: taking over only records younger than 10 s on the *past* side left such a
    record unrecorded for as long as the key is used (its hash's life is extended by
    every call), the call PENDING for ever."""
    client = redis_server.client()
    lock = _scripts_lock(client, f"ahead-{time.time_ns()}")
    run = lock("run")
    sent = now_us()
    assert run.park_latest("m", 60, LatestCall("run", sent)).park.acquired
    seconds, micros = client.time()
    ahead = seconds * 1000 + micros // 1000 + 10**9
    client.hset(run.keys.latest, mapping={"x:ghost": f"{ahead} other", "x:junk": f"{10**30} "})
    reply = lock("newer").park_latest("m", 60, LatestCall("newer", sent + 1))
    assert not reply.park.acquired and not reply.superseded
    assert dict(reply.unreported) == {b"ghost": b"other", b"junk": None}, reply
    # claimed anew at the server's now: not listed again to the next call within 10 s
    reply = lock("newest").park_latest("m", 60, LatestCall("newest", sent + 2))
    assert reply.evicted == b"newer"
    assert dict(reply.unreported) == {b"newer": b"newest"}, reply
    run.finish(hold=0, done_ttl=60)


def test_scripts_a_superseded_call_keeps_its_record_alive(redis_server: RedisServer) -> None:
    """A call superseded by the newest-started mark is recorded in the key's hash; that
    hash's life is extended as by every other call, so the record outlives a hash that
    was about to expire (its worker may die before it stores the state)."""
    client = redis_server.client()
    lock = _scripts_lock(client, f"alive-{time.time_ns()}")
    run = lock("run")
    sent = now_us()
    assert run.park_latest("m", 60, LatestCall("run", sent)).park.acquired
    client.pexpire(run.keys.latest, 500)
    reply = lock("older").park_latest("m", 60, LatestCall("older", sent - 1))
    assert reply.superseded and reply.superseded_by == b"run"
    assert client.hget(run.keys.latest, "x:older") is not None
    assert client.pttl(run.keys.latest) > 30_000
    run.finish(hold=0, done_ttl=60)


def test_scripts_thousands_of_records_give_a_bounded_reply_and_drain(
    redis_server: RedisServer,
) -> None:
    """5000 records left unrecorded (a long result-backend outage, or junk): each call's
    reply lists at most 32, its own and the one it evicted among them, and claims the
    others it lists; successive calls list the rest."""
    client = redis_server.client()
    lock = _scripts_lock(client, f"many-{time.time_ns()}")
    run = lock("run")
    sent = now_us()
    assert run.park_latest("m", 60, LatestCall("run", sent)).park.acquired
    client.hset(run.keys.latest, mapping={f"x:old{i}": "1 someone" for i in range(5000)})
    seen: set[bytes] = set()
    for i in range(1, 4):
        reply = lock(f"c{i}").park_latest("m", 60, LatestCall(f"c{i}", sent + i))
        assert len(reply.unreported) <= 32
        listed = {task_id for task_id, _ in reply.unreported}
        assert not listed & seen  # claimed: not listed again within 10 s
        seen |= listed
        if i > 1:
            assert reply.evicted == f"c{i - 1}".encode()
    assert len({s for s in seen if s.startswith(b"old")}) >= 3 * 30
    run.finish(hold=0, done_ttl=60)


@pytest.mark.parametrize("ended", ["SUCCESS", "FAILURE", "REVOKED"])
def test_a_forged_record_does_not_overwrite_a_finished_tasks_result(
    broker: RedisServer, tmp_path: Path, ended: str
) -> None:
    """Whoever may write the lock prefix writes ``x:<id>`` naming a task that finished
    (any task id of the result backend, not one of the key's calls). The key's next
    call's worker must not store SUPERSEDED over its state: Celery's backend keeps a
    SUCCESS itself, and the worker keeps any ready state (a FAILURE, REVOKED), and takes
    the record out."""
    r = broker.client()
    victim = f"victim-{ended}-{time.time_ns()}"
    result: Any = "kept"
    if ended != "SUCCESS":
        result = {"exc_type": "ValueError", "exc_message": ["kept"], "exc_module": "builtins"}
    meta = {"status": ended, "result": result, "traceback": None, "children": []}
    r.set(f"celery-task-meta-{victim}", json.dumps({**meta, "task_id": victim}), ex=600)
    key = f"forged-x-{ended}"
    r.hset(keys_of(key).latest, f"x:{victim}", "1 ghost")
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        call = laa.replace.delay(key, "a", 0.0)
        wait_until(lambda: state(call.id) == "SUCCESS", timeout=10, what="the key's call")
        assert state(victim) == ended
        assert r.hget(keys_of(key).latest, f"x:{victim}") is None
        assert f"[{victim}] superseded" not in proc.text()
    finally:
        proc.kill()


def test_an_evicted_calls_fallback_copy_is_not_counted_superseded_twice(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """Locks in a Redis of their own: every pending call also gets a fallback copy in the
    broker (after ``redislock_ttl``, 3 s here). A newer call evicts the pending one (its
    worker stores SUPERSEDED, task_superseded once); the evicted call's fallback copy then
    comes, is superseded again, and must not be stored, signalled or counted again (its
    worker finds SUPERSEDED already stored: it was, before, once per copy)."""
    locks = redis_server_factory()
    r, lr = broker.client(), locks.client()
    env = {"REDISLOCK_TEST_LOCK_URL": locks.url}
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, env=env, app=APP)
    try:
        first, older = _running_and_pending(lr, "fb", 4.5)
        newer = laa.replace.delay("fb", "newer", 0.0)
        wait_until(lambda: state(older.id) == SUPERSEDED, what="the older call superseded")
        wait_until(lambda: state(newer.id) == "SUCCESS", timeout=20, what="the newer run")
        wait_until(lambda: state(first.id) == "SUCCESS", timeout=10, what="first's result")
        assert tags(r, "fb") == ["first", "newer"]
        copy = f"replace[{older.id}] received"
        wait_until(lambda: proc.text().count(copy) == 2, what="the older call's fallback copy")
        ignored = f"replace[{older.id}] ignored"
        wait_until(lambda: proc.text().count(ignored) == 2, what="the copy's outcome")
        assert proc.text().count(f"[{older.id}] superseded on") == 1, proc.text()
    finally:
        proc.kill()


@pytest.mark.xfail(
    strict=True,
    reason="the newest-started mark lives the parking lifetime from the key's last call "
    "(max(lock_done_ttl, ...)); a run longer than that lets an older call become pending "
    "and run after it (docs/guarantees.md says so)",
)
def test_scripts_a_call_older_than_a_long_run_is_superseded(redis_server: RedisServer) -> None:
    """The run's call started; the key's hash (its newest-started mark) lives the parking
    lifetime (1 s here, a short lock_done_ttl) from that call's script, and the run goes
    on longer. A call sent before the run's call, delivered now, must still be
    superseded, not parked as the pending call that runs after the newer one."""
    client = redis_server.client()
    lock = _scripts_lock(client, f"long-{time.time_ns()}")
    run = lock("run")
    sent = now_us()
    assert run.park_latest("m", 1.0, LatestCall("run", sent)).park.acquired
    wait_until(lambda: not client.exists(run.keys.latest), what="the mark's end", timeout=5)
    assert client.hexists(run.keys.lock, "run")  # the run goes on
    try:
        reply = lock("older").park_latest("m", 1.0, LatestCall("older", sent - 1))
        assert reply.superseded, reply
    finally:
        run.finish(hold=0, done_ttl=60)


@pytest.mark.parametrize("field", ["s", "ps"])
def test_scripts_a_sent_time_written_far_ahead_supersedes_nobody(
    redis_server: RedisServer, field: str
) -> None:
    """Whoever may write the prefix writes a newest-started mark (``s``) or a pending call
    (``ps``) sent ten days ahead of the server's clock. Every call of the key would be
    superseded until then; a sent time no worker can have counted (each caps its own at
    its clock) is junk: the next call takes the key."""
    client = redis_server.client()
    lock = _scripts_lock(client, f"ahead-{field}-{time.time_ns()}")
    latest = lock("x").keys.latest
    ahead = str(now_us() + 10 * 86_400_000_000)
    if field == "s":
        client.hset(latest, mapping={"s": ahead, "st": "forged"})
    else:
        client.hset(latest, mapping={"p": "forged", "pt": "forged", "ps": ahead, "pd": "0"})
    call = lock("call")
    reply = call.park_latest("m", 60, LatestCall("call", now_us()))
    try:
        assert reply.park.acquired and not reply.superseded, reply
        assert client.hget(latest, "st") == b"call"
    finally:
        call.finish(hold=0, done_ttl=60)
