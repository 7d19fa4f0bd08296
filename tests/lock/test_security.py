"""TLS (``rediss://``) and Redis ACL users, against real redis-server processes.

TLS: a throwaway CA, server and client certificate are made with ``openssl`` and a
redis-server is started listening on a TLS port only (``--port 0``), so every
connection the package opens — the caller's, the shared pub/sub subscriber's and the
watchdog's private client — has to speak TLS for the tests to pass.

ACL: a redis-server with a user confined to ``~redislock:*`` keys and ``&redislock:*``
channels and only the commands listed below (see docs/security.md). The lock, semaphores
and rate limiters, fencing and the Celery layer (limited and rate-limited tasks included)
must work fully as that user, a key outside the prefix must be refused, and every listed
command is shown to be needed: removing any one of them makes the server deny it (ACL
LOG) while the same scenario runs. Those trials run in subprocesses (``python -m
tests.lock.test_security <part> <port> <user>``), one private server each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
from redis.connection import SSLConnection

from celery_redislock import (
    AsyncRedisLock,
    AsyncRedisRateLimiter,
    AsyncRedisSemaphore,
    FencedResource,
    RedisLock,
    RedisRateLimiter,
    RedisSemaphore,
    _lone_waiter,
    _waiting,
)
from celery_redislock._keyspace import SemaphoreKeys, parked_registry
from celery_redislock._renewal import scheduler_for
from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisServer, free_port, redis_server_binary

from .._support import wait_until

ROOT = Path(__file__).resolve().parent.parent.parent

#: A lease only the watchdog can keep over TLS (renewed every third of it). Its first
#: renewal opens the watchdog's own TLS connection, which must land within the other two
#: thirds: redis-py builds a new SSL context per connection (the system CA bundle is
#: parsed each time, some 60 ms of CPU on a quiet machine), and 0.3 s leases (0.2 s for
#: that) expired on a loaded CI machine.
TLS_LEASE = 1.5
#: How long a test holds a TLS_LEASE lock to show the watchdog kept it: past the lease.
PAST_TLS_LEASE = 2.0

# ------------------------------------------------------------------ the minimal ACL

#: What RedisLock / AsyncRedisLock need: the scripts (EVALSHA, and SCRIPT LOAD when the
#: server answers NOSCRIPT), the commands the scripts call, the direct queries
#: (locked/owned/remaining) and the waiters' pub/sub subscriber.
LOCK_COMMANDS = (
    "evalsha",
    "script|load",
    "exists",
    "hexists",
    "hget",
    "hset",
    "hincrby",
    "incr",
    "pexpire",
    "pttl",
    "del",
    "publish",
    "subscribe",
    "unsubscribe",
    # the line of blocked waiters: a list in arrival order, a sorted set of claims, and
    # a hash of the waiters' wake ids for direct grants
    "hdel",
    "rpush",
    "lpop",
    "lindex",
    "llen",
    "lrem",
    "zadd",
    "zscore",
    "zrem",
    "time",
    # a lone blocked acquire's own grant box (_lone_waiter.BoxWaiter)
    "blpop",
)
#: RedisSemaphore / AsyncRedisSemaphore add the holders set (SADD/SREM/SMEMBERS) and the
#: look along the line of waiters for the places ahead (LRANGE); RedisRateLimiter /
#: AsyncRedisRateLimiter add the limits' schedules (GET/SET, in rate.lua).
LIMITER_EXTRA_COMMANDS = ("sadd", "srem", "smembers", "lrange", "get", "set")
LIMITER_COMMANDS = LOCK_COMMANDS + LIMITER_EXTRA_COMMANDS
#: A rate limiter used alone: its one script (rate.lua: TIME, GET and SET of the
#: schedules), no channel at all.
RATE_COMMANDS = ("evalsha", "script|load", "get", "set", "time")
#: FencedResource: fence.lua (GET/SET of ``<prefix>fence:<resource>``) and ``highest()``.
FENCE_COMMANDS = ("evalsha", "script|load", "get", "set")
#: LockedTask adds the done marker (SET PX), parking and hand-over (park/handoff/sweep
#: scripts), the ``<prefix>parked`` registry (ZADD/ZRANGE/ZREM), the workers' stats in
#: ``<prefix>stats`` (HINCRBY/HINCRBYFLOAT) and PING (client_for's health checks) to what
#: the lock, semaphores and rate limiters use (limited tasks take a semaphore's permits,
#: rate-limited tasks book a rate limiter's slots). Rate-limited tasks add TYPE (the
#: deferral script replaces a key of another type where its list or registry belongs) and
#: ZRANGEBYSCORE (the drainer's look for deferred calls whose drainer stopped).
CELERY_EXTRA_COMMANDS = (
    "set",
    "hsetnx",
    "hgetall",
    "hlen",
    "zrange",
    "hincrbyfloat",
    "ping",
    "type",
    "zrangebyscore",
    "hmget",
)
CELERY_COMMANDS = tuple(dict.fromkeys(LIMITER_COMMANDS + CELERY_EXTRA_COMMANDS))
#: ``celery -A proj redislock ls|show|stats|release`` (an operator's user) adds these.
#: SCAN is not confined by key patterns: it lists key names outside the prefix too.
#: ZSCAN (the sweeper's registry) reads the limited keys (``lock_limit``), as SMEMBERS
#: (its holders) and HMGET (its parked tasks' limits; a last-call-wins key's pending
#: call), already in the Celery set, do.
OPERATOR_EXTRA_COMMANDS = ("scan", "pubsub|numsub", "zscan")
OPERATOR_COMMANDS = CELERY_COMMANDS + OPERATOR_EXTRA_COMMANDS
#: ``celery -A proj redislock exporter|top`` (a read-only user of their own).
WATCHER_COMMANDS = (
    "time", "scan", "zscan", "hgetall", "pttl", "llen", "lrange", "hmget", "smembers",
    "lindex", "zscore",
)  # fmt: skip
PASSWORD = "secret"
#: redis-py sends these on connect (CLIENT SETINFO: Redis >= 7.2; CLIENT MAINT_NOTIFICATIONS:
#: redis-py >= 6 over RESP3) and ignores a refusal: harmless, but they show in ACL LOG.
HARMLESS_DENIALS = {"client|setinfo", "client|maint_notifications"}


def acl_rules(
    commands: tuple[str, ...],
    keys: tuple[str, ...] = ("redislock:*",),
    channels: tuple[str, ...] = ("redislock:*",),
) -> list[str]:
    """The ``ACL SETUSER <user> ...`` arguments documented in docs/security.md."""
    return [
        "reset",
        "on",
        f">{PASSWORD}",
        "resetkeys",
        *(f"~{k}" for k in keys),
        "resetchannels",
        *(f"&{c}" for c in channels),
        "-@all",
        *(f"+{c}" for c in commands),
    ]


def set_user(admin: redis.Redis, user: str, rules: list[str]) -> None:
    assert admin.execute_command("ACL", "SETUSER", user, *rules) in (b"OK", "OK", True)


def denials(admin: redis.Redis, user: str | None = None) -> list[dict[str, Any]]:
    """ACL LOG entries (of ``user``), without the harmless ones."""
    entries = admin.acl_log(count=10_000)
    return [
        e
        for e in entries
        if (user is None or e["username"] == user) and e["object"] not in HARMLESS_DENIALS
    ]


@pytest.fixture
def subscriber_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every blocked acquire waits through the subscriber (none reads its own grant box):
    for the tests of the subscriber's connection."""
    monkeypatch.setattr(_lone_waiter, "LONE_WAITERS", False)


def numsub(admin: redis.Redis, channel: bytes) -> int:
    return int(admin.pubsub_numsub(channel)[0][1])


def blocked_pops(admin: redis.Redis) -> int:
    """Clients blocked in BLPOP now (a lone waiter on its grant box)."""
    return sum(1 for c in admin.client_list() if c.get("cmd") == "blpop" and "b" in c["flags"])


# ------------------------------------------------------------------ scenarios
# Used by the in-process tests and, for the minimality trials, by subprocesses.


def exercise_lock(client: redis.Redis, admin: redis.Redis, tag: str) -> None:
    """Every Redis path of RedisLock: acquire (first call meets NOSCRIPT on a fresh
    script cache), re-entry, queries, extend, contention, two waiters woken by releases
    over pub/sub (and the UNSUBSCRIBE of the channel left idle while the other is still
    waited on: needs ``_waiting.LINGER`` short), a lone waiter woken through its grant
    box (BLPOP), watchdog renewal and force_release."""
    lock = RedisLock(client, f"{tag}:a", ttl=30)
    assert lock.acquire() and lock.acquire()
    assert lock.hold_count == 2 and lock.token is not None and lock.token >= 1
    assert lock.locked() and lock.owned()
    remaining = lock.remaining()
    assert remaining is not None and 0 < remaining <= 30
    lock.extend(20)
    other = RedisLock(client, f"{tag}:b", ttl=30)
    assert other.acquire()

    results: dict[str, tuple[bool, float]] = {}

    def wait_for(name: str) -> None:
        waiter = RedisLock(client, name, ttl=30)  # its own thread: another owner
        assert waiter.acquire(blocking=False) is False  # contended: the holder's pttl
        got = waiter.acquire(timeout=20)
        results[name] = (got, time.monotonic())
        if got:
            waiter.release()

    threads = {
        held.keys.channel: threading.Thread(target=wait_for, args=(held.name,), daemon=True)
        for held in (lock, other)
    }
    lone = _lone_waiter.LONE_WAITERS
    _lone_waiter.LONE_WAITERS = False  # both through the subscriber (the box comes below)
    try:
        for thread in threads.values():
            thread.start()
        for channel in threads:
            wait_until(lambda ch=channel: numsub(admin, ch) == 1, what=f"{channel!r} subscribed")
    finally:
        _lone_waiter.LONE_WAITERS = lone

    # Both holders have 20-30 s leases: only the release's publish can wake a waiter now.
    lock.release()
    released_at = time.monotonic()
    lock.release()
    threads[lock.keys.channel].join(10)
    got, at = results[lock.name]
    assert got and at - released_at < 5.0
    # Channel a has no waiter any more; b still has one: a is unsubscribed after LINGER.
    wait_until(lambda: numsub(admin, lock.keys.channel) == 0, what="idle channel unsubscribed")
    other.release()
    released_at = time.monotonic()
    threads[other.keys.channel].join(10)
    got, at = results[other.name]
    assert got and at - released_at < 5.0

    # A lone waiter reads its grant itself: BLPOP on its box, where the release pushes it
    # (a user without BLPOP: refused once, then the subscriber).
    boxed = RedisLock(client, f"{tag}:box", ttl=30)
    assert boxed.acquire()
    box_results: list[tuple[bool, float]] = []

    def wait_boxed() -> None:
        waiter = RedisLock(client, boxed.name, ttl=30)
        box_results.append((waiter.acquire(timeout=20), time.monotonic()))
        waiter.release()

    box_thread = threading.Thread(target=wait_boxed, daemon=True)
    box_thread.start()
    wait_until(
        lambda: blocked_pops(admin) + numsub(admin, boxed.keys.channel) == 1,
        what="the lone waiter blocked on its box (or subscribed)",
    )
    boxed.release()
    released_at = time.monotonic()
    box_thread.join(10)
    assert box_results and box_results[0][0] and box_results[0][1] - released_at < 5.0

    # The watchdog (its own client, built from the pool's connection kwargs) renews.
    short = RedisLock(client, f"{tag}:short", ttl=0.3)
    assert short.acquire()
    time.sleep(1.0)
    assert short.owned() and not short.lost.is_set()
    short.ensure_held()
    short.release()
    assert not short.locked()

    # A waiter whose holder's fixed lease runs out: the free lock goes to the head of the
    # line (LINDEX/LPOP), and a waiter that times out leaves the line (LREM).
    lapsing = RedisLock(client, f"{tag}:d", ttl=30, owner="lapsing")
    assert lapsing.acquire(lease=0.3)
    assert RedisLock(client, f"{tag}:d", owner="next in line").acquire(timeout=10)
    assert RedisLock(client, f"{tag}:d", owner="impatient").acquire(timeout=0.1) is False

    RedisLock(client, f"{tag}:c", ttl=30, owner="an operator's victim").acquire()
    assert RedisLock.force_release(client, f"{tag}:c")


def exercise_fence(client: redis.Redis, tag: str, data_key: str) -> None:
    """FencedResource: admit, write (the data key needs its own ACL pattern), highest."""
    resource = FencedResource(client, tag)
    assert resource.admit(2)
    assert resource.write(3, data_key, "newest")
    assert not resource.write(1, data_key, "stale")
    assert not resource.admit(2)
    assert resource.highest() == 3


def exercise_semaphore(client: redis.Redis, admin: redis.Redis, tag: str) -> None:
    """Every Redis path of RedisSemaphore: permits taken and re-entered (the first call
    meets NOSCRIPT), queries, extend, a refusal, a waiter in line woken by the release
    that hands it the freed permit (over pub/sub), a waiter that times out and leaves the
    line, and a permit whose lease runs out freed for the next in line."""
    name = f"{tag}:sem"
    first = RedisSemaphore(client, name, 2, ttl=30, owner="first")
    second = RedisSemaphore(client, name, 2, ttl=30, owner="second")
    assert first.acquire() and first.acquire() and second.acquire()
    assert first.hold_count == 2 and first.owned() and first.token is not None
    first.extend(20)
    assert RedisSemaphore(client, name, 2, owner="third").acquire(blocking=False) is False
    assert RedisSemaphore(client, name, 2, owner="impatient").acquire(timeout=0.1) is False

    got: list[tuple[bool, float]] = []

    def wait() -> None:
        waiter = RedisSemaphore(client, name, 2, ttl=30, owner="waiter")
        got.append((waiter.acquire(timeout=20), time.monotonic()))
        waiter.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    channel = first.keys.channel
    wait_until(lambda: numsub(admin, channel) == 1, what=f"{channel!r} subscribed")
    second.release()  # leases of 20-30 s: only the release's grant can wake the waiter
    released_at = time.monotonic()
    thread.join(10)
    assert got and got[0][0] and got[0][1] - released_at < 5.0
    first.release()
    first.release()

    lapsing = RedisSemaphore(client, f"{tag}:lapse", 1, ttl=30, owner="lapsing")
    assert lapsing.acquire(lease=0.3)
    following = RedisSemaphore(client, f"{tag}:lapse", 1, ttl=30, owner="next in line")
    assert following.acquire(timeout=10)
    following.release()


def exercise_rate(client: redis.Redis, tag: str) -> None:
    """Every Redis path of RedisRateLimiter: admitted at once (the first call meets
    NOSCRIPT), refused without blocking, a slot booked ahead, a blocked call."""
    limiter = RedisRateLimiter(client, f"{tag}:rate", rate=["20/s", "1000/m"])
    assert limiter.acquire(blocking=False)
    assert limiter.acquire(blocking=False) is False
    slot = limiter.reserve()
    assert slot.admitted and slot.wait > 0
    assert limiter.acquire(timeout=5)


def exercise_celery(url: str, tag: str, redis_options: dict[str, Any]) -> None:
    """The Celery layer's Redis paths, no worker: ``client_for`` (PING health checks when
    ``health_check_interval`` is short), an eager LockedTask, a worker's TaskLock taking
    the lock, two tasks parking behind it (one written without the signing key), the
    hand-over at finish (the unsigned one refused and its hand-over taken back, the signed
    one published), the done marker, ``lock_hold``, the sweeper and the workers' stats."""
    from celery import Celery

    from celery_redislock import metrics, signing
    from celery_redislock._core import OwnerFinished
    from celery_redislock.celery.tasklock import TaskSemaphore
    from celery_redislock.task import (
        LockedTask,
        TaskLock,
        client_for,
        deliver_handed_over,
        settings_for,
    )

    app = Celery(f"security-{tag}", broker="memory://", backend="cache+memory://")
    app.conf.update(
        redislock_url=url,
        redislock_redis_options=redis_options,
        redislock_wait=5.0,
        # As docs/security.md says for a lock user of its own (the lock URL is not the
        # broker's): deferred runs are then kept in the lock Redis, not the broker.
        redislock_park_fallback=False,
    )
    taken: list[TaskLock | TaskSemaphore] = []
    try:

        @app.task(shared=False, bind=True, base=LockedTask, lock_key="acct:{n}", name=f"t.{tag}")
        def work(self: Any, n: int) -> int:
            self.lock.ensure_held()
            return int(self.lock.token)

        @app.task(
            shared=False, base=LockedTask, lock_key="tenant:{t}", lock_limit=2, name=f"l.{tag}"
        )
        def limited(t: int) -> None:
            pass

        @app.task(
            shared=False,
            base=LockedTask,
            lock_key="merchant:{m}",
            lock_limit=None,
            lock_rate="20/s",
            name=f"r.{tag}",
        )
        def rated(m: str) -> None:
            pass

        @app.task(
            shared=False, base=LockedTask, lock_key="doc:{d}", lock_debounce=0.05, name=f"d.{tag}"
        )
        def debounced(d: int) -> None:
            pass

        app.finalize()
        client = client_for(app)
        assert work.apply(args=(1,)).get() >= 1  # eager: a plain RedisLock on client_for(app)

        options = work.lock_options()
        name = "acct:7"
        first = TaskLock(client, name, task_id=f"{tag}-1", options=options)
        second = TaskLock(client, name, task_id=f"{tag}-2", options=options)
        third = TaskLock(client, f"{tag}:periodic", task_id=f"{tag}-3", options=options)
        forged = TaskLock(client, name, task_id=f"{tag}-forged", options=options)
        taken += [first, second, third, forged]
        assert first.acquire(blocking=False)
        assert forged.park(json.dumps({"task": f"t.{tag}"}), keep_for=60) is not True
        signature = json.dumps(dict(work.signature((7,), task_id=second.owner)))
        key = settings_for(app).signing_key
        signed = signing.sign_signature(key, second.keys.lock, second.owner, signature)
        assert second.park(signed, keep_for=60) is not True
        time.sleep(0.1)  # longer than a short health_check_interval: next command PINGs
        sweeper = _default_prefix_sweeper(app)
        assert sweeper.sweep_once() == 0  # the holder is alive: the parked tasks wait
        # The holder's finish hands the lock to the first parked task: its message is
        # refused, the hand-over taken back and the lock handed to the signed one.
        handed = first.finish(hold=0, done_ttl=60)
        assert handed is not None and handed.task_id == forged.owner.encode()
        assert deliver_handed_over(app, handed, 30_000) == 1
        assert client.hget(second.keys.lock, second.owner) == b"0"
        assert client.hget(second.parked_messages, forged.owner) is None
        assert sweeper.sweep_once() == 0  # handed over just now: nothing to re-publish
        try:
            first.acquire(blocking=False)
        except OwnerFinished:
            pass  # the done marker: a second delivery of task 1 does not run again
        else:
            raise AssertionError("a finished task id took the lock again")
        assert second.acquire(blocking=False) and second.hold_count == 1
        assert second.finish(hold=0, done_ttl=60) is None  # nobody parked: publishes
        assert client.zrange("redislock:parked", 0, -1) == [b"redislock:{" + name.encode() + b"}"]
        assert sweeper.sweep_once() == 0  # nothing parked any more: the lock is forgotten
        assert client.zrange("redislock:parked", 0, -1) == []

        assert third.acquire(blocking=False)
        assert third.finish(hold=5, done_ttl=60) is None  # lock_hold: kept 5 s, unrenewed
        assert third.locked()

        # What a worker adds to <prefix>stats after each task (counts and wait times),
        # from a private LockStats so that nothing else in this process is drained.
        stats, previous = metrics.LockStats(), metrics.STATS
        stats.add("acquired")
        stats.observe_wait(0.0123)
        metrics.STATS = stats
        try:
            metrics.flush_to_redis(client, "redislock:", force=True)
        finally:
            metrics.STATS = previous
        assert float(client.hget("redislock:stats", "wait_sum") or 0) >= 0.0123

        _exercise_limited_tasks(app, limited, tag, taken)
        _exercise_rated_tasks(app, rated, tag)
        _exercise_latest_tasks(app, debounced, tag, taken)
    finally:
        for lock in taken:
            lock.close()  # after a failure: stop renewing what is still held
        app.close()


def _exercise_limited_tasks(app: Any, task: Any, tag: str, taken: list[Any]) -> None:
    """``lock_limit``: two runs take the key's two permits, two more park behind them
    (sem_park.lua), a finish hands its permit to the first parked run, whose message the
    worker checks and sends (sem_handoff.lua), the sweeper hands the permit of a lost
    holder to the next (sem_sweep.lua), ``lock_hold`` keeps a permit, and the sweeper
    forgets the key once nothing is parked."""
    from celery_redislock.celery import signing
    from celery_redislock.celery.tasklock import TaskSemaphore, task_lock
    from celery_redislock.task import client_for, deliver_handed_over, settings_for

    client = client_for(app)
    options = task.lock_options()
    runs = [
        task_lock(app, "tenant:7", task_id=f"{tag}-l{n}", options=options, limit=2)
        for n in range(4)
    ]
    taken += runs
    first, second, third, fourth = runs
    assert all(isinstance(run, TaskSemaphore) for run in runs)
    assert first.take() and second.take() and not third.take()
    key = settings_for(app).signing_key
    for run in (third, fourth):
        signature = json.dumps(dict(task.signature((7,), task_id=run.owner)))
        signed = signing.sign_signature(key, run.keys.lock, run.owner, signature)
        assert run.park(signed, keep_for=60) is not True
    handed = first.finish(hold=0, done_ttl=60)
    assert handed is not None and handed.task_id == third.owner.encode()
    assert deliver_handed_over(app, handed, 30_000) == 1
    assert third.take()
    sweeper = _default_prefix_sweeper(app)
    assert sweeper.sweep_once() == 0  # both permits held: the parked run waits
    second.close()  # its holder lost: the permit's lease runs out (here: deleted)
    client.delete(second.semaphore_keys.permit(second.owner))
    assert sweeper.sweep_once() == 1  # the freed permit handed to the parked run, sent
    assert fourth.take()
    assert third.finish(hold=5, done_ttl=60) is None  # lock_hold: kept 5 s, unrenewed
    assert fourth.finish(hold=0, done_ttl=60) is None  # nobody parked: publishes
    assert sweeper.sweep_once() == 0
    assert client.zrange("redislock:parked", 0, -1) == []  # the key forgotten


def _exercise_latest_tasks(app: Any, task: Any, tag: str, taken: list[Any]) -> None:
    """Last call wins (``lock_debounce``): two calls of one key (the newer supersedes the
    pending older one), the drainer's send of the due call, and its run taking the lock."""
    from celery_redislock.celery import signing
    from celery_redislock.celery.latest import latest_call, serve_debounced
    from celery_redislock.celery.tasklock import TaskLock
    from celery_redislock.task import client_for, settings_for

    client, key = client_for(app), settings_for(app).signing_key
    options = task.lock_options()
    calls = [TaskLock(client, "doc:1", task_id=f"{tag}-d{i}", options=options) for i in (1, 2)]
    taken += calls
    sent = time.time_ns() // 1000
    replies = []
    for i, call in enumerate(calls):
        text = json.dumps(dict(task.signature((1,), task_id=call.owner)))
        message = signing.sign_signature(key, call.keys.lock, call.owner, text)
        replies.append(call.park_latest(message, 60, latest_call(call.owner, sent + i, options)))
    assert replies[0].pending_ms is not None and replies[1].pending_ms is not None
    assert replies[1].evicted == calls[0].owner.encode()  # the older pending call superseded
    time.sleep(0.1)  # its quiet period over: the drainer sends it
    assert serve_debounced(app, client, "redislock:", 30_000) == 1.0
    text = json.dumps(dict(task.signature((1,), task_id=calls[1].owner)))
    message = signing.sign_signature(key, calls[1].keys.lock, calls[1].owner, text)
    reply = calls[1].park_latest(message, 60, latest_call(calls[1].owner, sent + 1, options))
    assert reply.park.acquired
    assert calls[1].finish(hold=0, done_ttl=60) is None


def _exercise_rated_tasks(app: Any, task: Any, tag: str) -> None:
    """``lock_rate``: a run admitted at its rate and two deferred behind it
    (rate_defer.lua); a drainer takes the first for sending and stops before sending it
    (rate_drain.lua), another sends it again once stale (rate_resend.lua) and the second
    when it is due."""
    from celery.exceptions import Ignore

    from celery_redislock import signals
    from celery_redislock._keyspace import RateKeys, deferred_sending
    from celery_redislock.celery.deferral import Drainer, admit_or_defer
    from celery_redislock.task import client_for

    client = client_for(app)
    deferred = []
    for n in range(3):
        task.push_request(id=f"{tag}-r{n}", args=("m",), kwargs={}, headers={})
        try:
            admit_or_defer(task, task.request, ("m",), {}, task.lock_options())
        except Ignore:
            deferred.append(f"{tag}-r{n}")
        finally:
            task.pop_request()
    assert deferred == [f"{tag}-r1", f"{tag}-r2"]

    class Stopping(Drainer):
        def _send(self, found: dict[str, Any], slot_us: int = 1) -> None:
            raise SystemExit("stopped before sending")

    list_key = RateKeys.for_name("merchant:m").deferred

    def stops() -> bool:
        try:
            Stopping(app, ["redislock:"]).serve(client, "redislock:", list_key)
        except SystemExit:
            return True
        return False

    wait_until(stops, 10, what="the first deferred run taken for sending")
    sending = deferred_sending("redislock:")
    [member] = client.zrange(sending, 0, -1)
    client.zadd(sending, {member: 0})  # long unconfirmed: its drainer stopped
    sent: list[str] = []

    def undeferred(sender: Any = None, task_id: Any = None, **_: Any) -> None:
        sent.append(task_id)

    signals.task_undeferred.connect(undeferred)
    try:
        drainer = Drainer(app, ["redislock:"])
        wait_until(lambda: drainer.drain_once() >= 0 and len(sent) >= 2, 10, what="drained")
    finally:
        signals.task_undeferred.disconnect(undeferred)
    assert sent == deferred  # each once, in order
    assert client.llen(list_key) == 0 and client.zrange(sending, 0, -1) == []


def exercise_cli(url: str, admin: redis.Redis, tag: str) -> None:
    """The operator's ``celery redislock ls|show|stats|release`` with the lock Redis at ``url``."""
    from celery import Celery
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_redislock.cli import redislock

    app = Celery(f"security-cli-{tag}", broker="memory://", backend="cache+memory://")
    app.conf.update(redislock_url=url)
    try:
        held = RedisLock(admin, f"{tag}:job", owner="someone", ttl=60, auto_renew=False)
        assert held.acquire()
        admin.hincrby("redislock:stats", "acquired", 3)
        # A limited key with a holder and a parked task (as sem_park.lua leaves one).
        limited = RedisSemaphore(admin, f"{tag}:sem", 1, owner="holder", ttl=60, auto_renew=False)
        assert limited.acquire()
        line = SemaphoreKeys.for_name(f"{tag}:sem").line
        admin.rpush(line.parked, "parked-task")
        admin.hset(line.parked_messages, "parked-task", 'S\n{"task": "proj.sync"}')
        admin.hset(line.parked_limit, "parked-task", 1)
        admin.zadd(parked_registry("redislock:"), {line.lock: 0})
        context = CLIContext(app=app, no_color=True, workdir=None, quiet=True)

        def run(*args: str) -> str:
            result = CliRunner().invoke(redislock, list(args), obj=context)
            assert result.exit_code == 0, result.output + repr(result.exception)
            return str(result.output)

        rows = [json.loads(line) for line in run("ls", "--json").splitlines()]
        assert [(row["name"], row["kind"]) for row in rows] == [
            (f"{tag}:job", "lock"),
            (f"{tag}:sem", "semaphore"),
        ]
        assert "task someone" in run("show", f"{tag}:job")
        assert "parked: task parked-task (limit 1)" in run("show", f"{tag}:sem")
        totals = json.loads(run("stats", "--json"))
        assert totals["acquired"] == 3 and totals["permits_held_now"] == 1
        assert totals["limits"]["proj.sync"]["parked_now"] == 1
        assert "released" in run("release", f"{tag}:job", "--yes")
        assert not admin.exists(held.keys.lock)
    finally:
        app.close()


def _trial_main(argv: list[str]) -> int:
    """``python -m tests.lock.test_security <part> <port> <user>``: one trial (part: lock,
    limiters, rate, fence, celery or cli)."""
    part, port, user = argv
    url = f"redis://{user}:{PASSWORD}@127.0.0.1:{port}/0"
    _waiting.LINGER = 0.2
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    admin = redis.Redis(host="127.0.0.1", port=int(port), socket_timeout=5)
    try:
        if part == "lock":
            exercise_lock(client, admin, "trial")
        elif part == "limiters":
            exercise_semaphore(client, admin, "trial")
            exercise_rate(client, "trial")
        elif part == "rate":
            exercise_rate(client, "trial")
        elif part == "fence":
            exercise_fence(client, "trial", "redislock:data:trial")
        elif part == "cli":
            exercise_cli(url, admin, "trial")
        else:
            exercise_celery(url, "trial", {"health_check_interval": 0.05})
    except Exception as exc:
        print(f"trial {part} as {user}: {exc!r}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ TLS servers


class Certs:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca = directory / "ca.crt"
        self.server_cert, self.server_key = directory / "server.crt", directory / "server.key"
        self.client_cert, self.client_key = directory / "client.crt", directory / "client.key"

    def make(self) -> Certs:
        d = self.dir
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl(
            "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=celery_redislock test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        for role, usage, san in (
            ("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
            ("client", "clientAuth", ""),
        ):
            (d / f"{role}.ext").write_text(
                f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                f"extendedKeyUsage={usage}\nauthorityKeyIdentifier=keyid,issuer\n"
                f"subjectKeyIdentifier=hash\n{san}"
            )
            self._openssl(
                "req", "-new", *key, "-keyout", f"{role}.key", "-out", f"{role}.csr",
                "-subj", f"/CN={'127.0.0.1' if role == 'server' else 'locker'}",
            )  # fmt: skip
            self._openssl(
                "x509", "-req", "-in", f"{role}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-set_serial", "2" if role == "server" else "3", "-days", "2",
                "-out", f"{role}.crt", "-extfile", f"{role}.ext",
            )  # fmt: skip
        return self

    def _openssl(self, *args: str) -> None:
        done = subprocess.run(
            ["openssl", *args], cwd=self.dir, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args[:2])} failed:\n{done.stderr}")


class TLSUnavailable(Exception):
    """This redis-server cannot serve TLS (built without it)."""


_NO_TLS = re.compile(r"tls.*(not supported|not built|disabled|unknown)|bad directive.*tls", re.I)


class TLSRedisServer(RedisServer):
    """A private redis-server on a TLS-only loopback port, stopped by its pid (RedisServer.stop).

    Args:
        certs: the CA and the server (and client) certificates.
        auth_clients: ``--tls-auth-clients``: "no", "yes" (client certificates required).
    """

    def __init__(self, certs: Certs, *, auth_clients: str = "no") -> None:
        super().__init__()
        self.certs = certs
        self.auth_clients = auth_clients

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def tls_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"ssl_ca_certs": str(self.certs.ca)}
        if self.auth_clients == "yes":
            options.update(
                ssl_certfile=str(self.certs.client_cert), ssl_keyfile=str(self.certs.client_key)
            )
        return options

    def client(self, **kwargs: Any) -> redis.Redis:
        kwargs.setdefault("ssl", True)
        for option, value in self.tls_options().items():
            kwargs.setdefault(option, value)
        return super().client(**kwargs)

    def start(self, port: int | None = None) -> TLSRedisServer:
        why = ""
        for _attempt in range(5):
            self.port = port or free_port()
            args = [
                redis_server_binary(),
                "--port", "0",
                "--tls-port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--save", "",
                "--appendonly", "no",
                "--logfile", str(self.dir / "redis.log"),
                "--daemonize", "no",
                "--tls-cert-file", str(self.certs.server_cert),
                "--tls-key-file", str(self.certs.server_key),
                "--tls-ca-cert-file", str(self.certs.ca),
                "--tls-auth-clients", self.auth_clients,
            ]  # fmt: skip
            with (self.dir / "stderr.log").open("wb") as stderr:
                self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr)
            if self._wait_ready():
                return self
            self.stop()
            why = self._startup_output()
            if _NO_TLS.search(why):
                raise TLSUnavailable(why.strip()[-500:])
            if "already in use" not in why:
                break
        raise RuntimeError(f"TLS redis-server did not start:\n{why[-2000:]}")

    def _startup_output(self) -> str:
        texts = []
        for name in ("stderr.log", "redis.log"):
            path = self.dir / name
            if path.exists():
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)

    def _wait_ready(self, within: float = 10.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            probe = self.client(socket_timeout=0.5, socket_connect_timeout=0.2)
            try:
                if probe.ping():
                    return True
            except (redis.RedisError, OSError):
                pass
            finally:
                probe.close()
            time.sleep(0.02)
        return False


@pytest.fixture(scope="module")
def certs() -> Iterator[Certs]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    directory = Path(tempfile.mkdtemp(prefix="redislock-certs-"))
    try:
        yield Certs(directory).make()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _start_tls(certs: Certs, auth_clients: str) -> TLSRedisServer:
    server = TLSRedisServer(certs, auth_clients=auth_clients)
    try:
        return server.start()
    except TLSUnavailable as exc:
        server.cleanup()
        pytest.skip(f"redis-server has no TLS support: {exc}")
    except BaseException:
        server.cleanup()
        raise


@pytest.fixture(scope="module")
def tls_server(certs: Certs) -> Iterator[TLSRedisServer]:
    server = _start_tls(certs, "no")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def mtls_server(certs: Certs) -> Iterator[TLSRedisServer]:
    """Client certificates required (``--tls-auth-clients yes``)."""
    server = _start_tls(certs, "yes")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def tls_client(tls_server: TLSRedisServer) -> Iterator[redis.Redis]:
    client = tls_server.client()
    client.flushall()
    yield client
    client.close()


# ------------------------------------------------------------------ TLS tests


def test_the_tls_port_refuses_plain_and_unverified_clients(tls_server: TLSRedisServer) -> None:
    # No retries: redis-py's default would only repeat each refused attempt, with backoff.
    port = tls_server.port
    plain = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, retry=None)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    unverified = redis.Redis(host="127.0.0.1", port=port, ssl=True, socket_timeout=2, retry=None)
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate verify failed"):
        unverified.ping()
    plain.close()
    unverified.close()


def test_lock_over_tls_acquire_reenter_release_and_fence(tls_client: redis.Redis) -> None:
    assert tls_client.connection_pool.connection_class is SSLConnection
    lock = RedisLock(tls_client, "tls:job", ttl=30)
    assert lock.acquire() and lock.acquire()
    assert lock.hold_count == 2 and lock.token == 1
    assert lock.locked() and lock.owned()
    lock.release()
    assert lock.owned()
    lock.release()
    assert not lock.locked()
    with lock:
        assert lock.token == 2
        assert FencedResource(tls_client, "ledger").write(lock.token, "ledger:1", "v")


def test_rediss_url_with_ca_in_the_query(tls_server: TLSRedisServer) -> None:
    url = f"{tls_server.url}?ssl_ca_certs={tls_server.certs.ca}&ssl_cert_reqs=required"
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        assert client.connection_pool.connection_class is SSLConnection
        lock = RedisLock(client, "tls:url", ttl=TLS_LEASE)
        with lock:
            time.sleep(PAST_TLS_LEASE)  # past the lease: only the watchdog (over TLS) keeps it
            assert lock.owned()
            lock.ensure_held()
        assert not lock.locked()
    finally:
        client.close()


@pytest.mark.usefixtures("subscriber_only")
def test_waiter_is_woken_by_release_through_the_tls_subscriber(
    tls_server: TLSRedisServer, tls_client: redis.Redis
) -> None:
    holder = RedisLock(tls_client, "tls:wake", ttl=30)
    assert holder.acquire()
    outcome: list[tuple[bool, float]] = []

    def wait() -> None:
        waiter = RedisLock(tls_client, "tls:wake", ttl=30)
        got = waiter.acquire(timeout=20)
        outcome.append((got, time.monotonic()))
        if got:
            waiter.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    # The server has no plain port: this subscription is the subscriber's TLS connection.
    wait_until(lambda: numsub(tls_client, holder.keys.channel) == 1, what="subscribed")
    holder.release()
    released_at = time.monotonic()
    thread.join(10)
    assert outcome and outcome[0][0]
    assert outcome[0][1] - released_at < 5.0  # the holder's lease was 30 s: woken, not expired


def test_watchdog_renews_over_tls(tls_client: redis.Redis) -> None:
    lock = RedisLock(tls_client, "tls:renew", ttl=TLS_LEASE)
    assert lock.acquire()
    try:
        own = scheduler_for(tls_client)._client  # the watchdog's private client
        assert own is not tls_client
        assert own.connection_pool.connection_class is SSLConnection
        assert own.connection_pool.connection_kwargs["ssl_ca_certs"] == str(
            tls_client.connection_pool.connection_kwargs["ssl_ca_certs"]
        )
        time.sleep(PAST_TLS_LEASE)
        assert lock.owned() and not lock.lost.is_set()
        lock.ensure_held()
    finally:
        lock.release()


@pytest_asyncio.fixture
async def tls_aclient(tls_server: TLSRedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(
        host="127.0.0.1",
        port=tls_server.port,
        ssl=True,
        ssl_ca_certs=str(tls_server.certs.ca),
        socket_timeout=5,
    )
    await client.flushall()
    yield client
    await aclose_background(client)
    await client.aclose()


async def test_async_lock_over_tls(tls_aclient: aioredis.Redis) -> None:
    lock = AsyncRedisLock(tls_aclient, "tls:async", ttl=TLS_LEASE)
    assert await lock.acquire() and await lock.acquire()
    assert lock.hold_count == 2
    await asyncio.sleep(PAST_TLS_LEASE)  # the asyncio watchdog's own client renews over TLS
    assert await lock.owned() and not lock.lost.is_set()

    async def wait() -> float:
        waiter = AsyncRedisLock(tls_aclient, "tls:async", ttl=30)
        assert await waiter.acquire(timeout=20)
        at = time.monotonic()
        await waiter.release()
        return at

    task = asyncio.ensure_future(wait())
    for _ in range(500):
        if int((await tls_aclient.pubsub_numsub(lock.keys.channel))[0][1]) == 1:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the asyncio subscriber never subscribed over TLS")
    await lock.release()
    await lock.release()
    released_at = time.monotonic()
    assert await asyncio.wait_for(task, 10) - released_at < 5.0


def test_celery_client_for_a_rediss_url(tls_server: TLSRedisServer) -> None:
    from celery import Celery

    from celery_redislock.task import LockedTask, client_for

    app = Celery("tls", broker="memory://", backend="cache+memory://")
    app.conf.update(
        redislock_url=tls_server.url,
        redislock_redis_options={"ssl_ca_certs": str(tls_server.certs.ca)},
        redislock_wait=5.0,
    )
    try:

        @app.task(shared=False, bind=True, base=LockedTask, lock_key="acct:{n}")
        def settle(self: Any, n: int) -> int:
            self.lock.ensure_held()
            return int(self.lock.token)

        app.finalize()
        client = client_for(app)
        assert client.connection_pool.connection_class is SSLConnection
        lock = RedisLock(client, "tls:celery", ttl=TLS_LEASE)
        with lock:
            time.sleep(PAST_TLS_LEASE)
            assert lock.owned() and not lock.lost.is_set()
        assert settle.apply(args=(7,)).get() >= 1  # eager run under a lock via client_for
    finally:
        app.close()


@pytest.mark.usefixtures("subscriber_only")
def test_mutual_tls_client_certificate_through_redis_options(mtls_server: TLSRedisServer) -> None:
    from celery import Celery

    from celery_redislock.task import client_for

    no_cert = redis.Redis(
        host="127.0.0.1",
        port=mtls_server.port,
        ssl=True,
        ssl_ca_certs=str(mtls_server.certs.ca),
        socket_timeout=2,
        retry=None,  # redis-py's default would only repeat the refused attempt, with backoff
    )
    with pytest.raises(redis.ConnectionError):
        no_cert.ping()
    no_cert.close()

    app = Celery("mtls", broker="memory://", backend="cache+memory://")
    app.conf.update(
        redislock_url=mtls_server.url, redislock_redis_options=mtls_server.tls_options()
    )
    admin = mtls_server.client()
    try:
        client = client_for(app)
        holder = RedisLock(client, "mtls:job", ttl=TLS_LEASE)
        assert holder.acquire()
        time.sleep(PAST_TLS_LEASE)  # the watchdog's client presents the client certificate too
        assert holder.owned() and not holder.lost.is_set()
        got: list[bool] = []

        def wait() -> None:
            waiter = RedisLock(client, "mtls:job", ttl=30)
            got.append(waiter.acquire(timeout=20))
            if got[-1]:
                waiter.release()

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        # The subscriber's connection, made from the pool, presents the certificate too.
        wait_until(lambda: numsub(admin, holder.keys.channel) == 1, what="subscribed")
        holder.release()
        thread.join(10)
        assert got == [True]
    finally:
        admin.flushall()
        admin.close()
        app.close()


# ------------------------------------------------------------------ ACL tests


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    with RedisServer(extra=["--acllog-max-len", "1024"]) as server:
        admin = server.client()
        set_user(admin, "locker", acl_rules(LOCK_COMMANDS))
        set_user(admin, "limiter", acl_rules(LIMITER_COMMANDS))
        set_user(admin, "rate-limiter", acl_rules(RATE_COMMANDS, channels=()))
        set_user(admin, "fencer", acl_rules(LOCK_COMMANDS + FENCE_COMMANDS[2:]))
        set_user(
            admin,
            "fencer-ledger",
            acl_rules(LOCK_COMMANDS + FENCE_COMMANDS[2:], keys=("redislock:*", "ledger:*")),
        )
        set_user(admin, "celery", acl_rules(CELERY_COMMANDS))
        set_user(admin, "operator", acl_rules(OPERATOR_COMMANDS))
        admin.close()
        yield server


@pytest.fixture
def admin(acl_server: RedisServer) -> Iterator[redis.Redis]:
    client = acl_server.client()
    client.flushall()
    client.script_flush()  # the first script call meets NOSCRIPT: SCRIPT LOAD is exercised
    client.acl_log_reset()
    yield client
    client.close()


def user_client(server: RedisServer, user: str) -> redis.Redis:
    return server.client(username=user, password=PASSWORD)


def test_acl_user_runs_the_whole_lock(
    acl_server: RedisServer, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_waiting, "LINGER", 0.2)
    client = user_client(acl_server, "locker")
    try:
        exercise_lock(client, admin, "acl")
    finally:
        client.close()
    assert denials(admin) == []  # nothing refused, not even silently (e.g. in a thread)


def test_acl_user_is_confined_to_the_prefix(acl_server: RedisServer, admin: redis.Redis) -> None:
    admin.set("other:key", "secret data")
    client = user_client(acl_server, "locker")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.get("other:key")  # GET is not even in the lock's command list
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.exists("other:key")  # an allowed command, a key outside the prefix
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.hexists("other:{job}", "owner")  # an allowed command, a foreign key
        with pytest.raises(redis.exceptions.NoPermissionError):
            RedisLock(client, "job", prefix="other:").acquire()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()  # not in the command list
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.publish("other:{job}:released", "1")  # a foreign channel
    finally:
        client.close()
    refused = {(e["reason"], e["object"]) for e in denials(admin, "locker")}
    assert refused == {
        ("command", "get"),
        ("key", "other:key"),
        ("key", "other:{job}"),
        ("command", "flushall"),
        ("channel", "other:{job}:released"),
    }
    assert admin.get("other:key") == b"secret data"


async def test_acl_user_runs_the_async_lock(acl_server: RedisServer, admin: redis.Redis) -> None:
    client = aioredis.Redis(
        host="127.0.0.1", port=acl_server.port, username="locker", password=PASSWORD
    )
    try:
        lock = AsyncRedisLock(client, "acl:async", ttl=0.3)
        assert await lock.acquire() and await lock.acquire()
        await asyncio.sleep(1.0)
        assert await lock.owned() and not lock.lost.is_set()

        async def wait() -> bool:
            waiter = AsyncRedisLock(client, "acl:async", ttl=30)
            got = await waiter.acquire(timeout=20)
            await waiter.release()
            return got

        task = asyncio.ensure_future(wait())
        for _ in range(500):
            if numsub(admin, lock.keys.channel) == 1:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the asyncio subscriber never subscribed")
        await lock.release()
        await lock.release()
        assert await asyncio.wait_for(task, 10)
        assert await lock.remaining() is None
    finally:
        await aclose_background(client)
        await client.aclose()
    assert denials(admin) == []


def test_acl_user_runs_semaphores_and_rate_limiters(
    acl_server: RedisServer, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_waiting, "LINGER", 0.2)
    limiter = user_client(acl_server, "limiter")
    rate_only = user_client(acl_server, "rate-limiter")
    locker = user_client(acl_server, "locker")
    try:
        exercise_semaphore(limiter, admin, "acl")
        exercise_rate(limiter, "acl")
        exercise_rate(rate_only, "acl:alone")
        assert denials(admin) == []
        # The lock's set is not enough: refused inside the scripts (SMEMBERS, GET).
        with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
            RedisSemaphore(locker, "acl:sem:locker", 2).acquire(blocking=False)
        with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
            RedisRateLimiter(locker, "acl:rate:locker", "5/s").acquire(blocking=False)
    finally:
        for client in (limiter, rate_only, locker):
            client.close()
    refused = {(e["username"], e["reason"], e["object"]) for e in denials(admin)}
    # GET is called with redis.pcall (a schedule that cannot be read is read as full):
    # refused and logged all the same, then SET stops the script.
    assert refused == {
        ("locker", "command", "smembers"),
        ("locker", "command", "get"),
        ("locker", "command", "set"),
    }


async def test_acl_user_runs_the_async_semaphore_and_rate_limiter(
    acl_server: RedisServer, admin: redis.Redis
) -> None:
    client = aioredis.Redis(
        host="127.0.0.1", port=acl_server.port, username="limiter", password=PASSWORD
    )
    try:
        first = AsyncRedisSemaphore(client, "acl:asem", 1, ttl=0.3, owner="first")
        assert await first.acquire() and await first.acquire()
        await asyncio.sleep(1.0)  # the asyncio watchdog renews the permit
        assert await first.owned() and not first.lost.is_set()

        async def wait() -> bool:
            waiter = AsyncRedisSemaphore(client, "acl:asem", 1, ttl=30, owner="waiter")
            got = await waiter.acquire(timeout=20)
            await waiter.release()
            return got

        task = asyncio.ensure_future(wait())
        for _ in range(500):
            if numsub(admin, first.keys.channel) == 1:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the asyncio subscriber never subscribed")
        await first.release()
        await first.release()
        assert await asyncio.wait_for(task, 10)
        limiter = AsyncRedisRateLimiter(client, "acl:arate", "20/s")
        assert await limiter.acquire(blocking=False)
        assert (await limiter.reserve()).admitted
    finally:
        await aclose_background(client)
        await client.aclose()
    assert denials(admin) == []


def test_acl_fencing_needs_get_set_and_the_data_keys(
    acl_server: RedisServer, admin: redis.Redis
) -> None:
    locker = user_client(acl_server, "locker")  # lock commands only: no GET/SET
    fencer = user_client(acl_server, "fencer")  # + GET/SET, keys only under the prefix
    ledger = user_client(acl_server, "fencer-ledger")  # + ~ledger:*
    try:
        with RedisLock(fencer, "acl:fence") as lock:
            assert lock.token == 1
            # Refused inside the script: a plain ResponseError ("The user executing the
            # script can't run this command"), not NoPermissionError.
            with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
                FencedResource(locker, "ledger").admit(lock.token)
            resource = FencedResource(fencer, "ledger")
            assert resource.admit(lock.token) and resource.highest() == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                resource.write(lock.token, "ledger:1", "v")  # refused before the script runs
            assert admin.get("ledger:1") is None
            exercise_fence(ledger, "acl", "ledger:1")
            assert admin.get("ledger:1") == b"newest"
            assert admin.get("redislock:fence:acl") == b"3"
    finally:
        for client in (locker, fencer, ledger):
            client.close()
    refused = {(e["username"], e["reason"], e["object"]) for e in denials(admin)}
    assert refused == {("locker", "command", "get"), ("fencer", "key", "ledger:1")}


def test_acl_user_runs_the_celery_layer(acl_server: RedisServer, admin: redis.Redis) -> None:
    url = f"redis://celery:{PASSWORD}@127.0.0.1:{acl_server.port}/0"
    exercise_celery(url, "acl", {"health_check_interval": 0.05})
    assert denials(admin) == []
    locker_url = f"redis://locker:{PASSWORD}@127.0.0.1:{acl_server.port}/0"
    # The lock's set is not enough for LockedTask: refused (a command, or one in a script).
    with pytest.raises(redis.exceptions.ResponseError, match=r"NOPERM|can't run this command"):
        exercise_celery(locker_url, "acl2", {})


def test_the_documented_acl_lines_are_the_tested_ones(
    acl_server: RedisServer, admin: redis.Redis
) -> None:
    text = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    lines = [line.split() for line in text.splitlines() if line.startswith("ACL SETUSER ")]
    documented = {line[2]: line[3:] for line in lines}
    tested = {
        "locker": LOCK_COMMANDS,
        "limiter": LIMITER_COMMANDS,
        "rate-limiter": RATE_COMMANDS,
        "celery-locks": CELERY_COMMANDS,
        "lock-operator": OPERATOR_COMMANDS,
        "lock-watcher": WATCHER_COMMANDS,
    }
    assert set(documented) == set(tested)
    for user, rules in documented.items():
        assert sorted(r[1:] for r in rules if r.startswith("+")) == sorted(set(tested[user]))
        channels = () if user in ("rate-limiter", "lock-watcher") else ("redislock:*",)
        assert [r for r in rules if not r.startswith("+")] == acl_rules((), channels=channels)[1:]
        set_user(admin, f"doc-{user}", rules)  # the server accepts the line as written


def test_acl_watcher_reads_what_the_exporter_and_top_show(
    acl_server: RedisServer, admin: redis.Redis
) -> None:
    """The read-only user of docs/security.md runs the exporter's collection and top's
    survey over a lock held, a limited key's permits with a task parked, a deferred rate
    entry and a last-call-wins key's records, with no command refused."""
    from celery_redislock.celery.exporter import RedisLockCollector, exposition
    from celery_redislock.celery.survey import survey

    set_user(admin, "lock-watcher", acl_rules(WATCHER_COMMANDS, channels=()))
    held = RedisLock(admin, "acl:watched", ttl=30, auto_renew=False)
    permits = [RedisSemaphore(admin, "acl:sem", 2, ttl=30, auto_renew=False) for _ in range(2)]
    assert held.acquire(blocking=False) and all(p.acquire(blocking=False) for p in permits)
    sem = SemaphoreKeys.for_name("acl:sem")
    admin.rpush(sem.line.parked, "parked-id")
    admin.hset(sem.line.parked_messages, "parked-id", "S-not-read-as-a-task")
    admin.zadd("redislock:parked", {sem.line.lock: 0})
    admin.rpush(b"redislock:{acl:rate}:rate:deferred", b"an entry")
    admin.zadd("redislock:deferred", {b"redislock:{acl:rate}:rate:deferred": 1})
    admin.hset(b"redislock:{acl:latest}:latest", mapping={"p": "t", "pt": "t", "pd": "0"})
    admin.acl_log_reset()
    watcher = user_client(acl_server, "lock-watcher")
    try:
        found = survey(watcher, "redislock:")
        names = {state.name for state in found.hottest()}
        assert {"acl:watched", "acl:sem"} <= names, names
        text = exposition(RedisLockCollector(watcher, "redislock:", interval=0))
        assert "celery_redislock_held" in text and "celery_redislock_exporter_redis_up 1.0" in text
        assert denials(admin, "lock-watcher") == []
    finally:
        watcher.close()
        held.release()
        for permit in permits:
            permit.release()


def test_acl_operator_runs_the_cli(acl_server: RedisServer, admin: redis.Redis) -> None:
    exercise_cli(f"redis://operator:{PASSWORD}@127.0.0.1:{acl_server.port}/0", admin, "acl")
    assert denials(admin) == []


def refused(found: list[dict[str, Any]], command: str) -> bool:
    """Whether the ACL LOG entries ``found`` include a refusal of ``command``."""
    return any(e["reason"] == "command" and e["object"] == command for e in found)


def _trial(
    part: str, commands: tuple[str, ...], removed: str | None, channels: tuple[str, ...]
) -> tuple[int, list[Any]]:
    """Run one scenario as a user lacking ``removed`` on a private server; ACL LOG after.

    A trial lacking a command is over once the server has refused that command: what it
    is to show is then in the log, and the rest of the scenario would only wait out the
    timeouts of what the refusal broke (a waiter never woken, a subscription never
    confirmed). The trial with every command runs to its end."""
    user = f"trial-{(removed or 'none').replace('|', '-')}"
    with RedisServer(extra=["--acllog-max-len", "1024"]) as server:
        admin = server.client()
        kept = tuple(c for c in commands if c != removed)
        set_user(admin, user, acl_rules(kept, channels=channels))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.lock.test_security", part, str(server.port), user],
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(
                lambda: (
                    proc.poll() is not None
                    or (removed is not None and refused(denials(admin, user), removed))
                ),
                timeout=90,
                what=f"the {part} trial without {removed}",
            )
            code = proc.returncode if proc.returncode is not None else -1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        found = denials(admin, user)
        admin.close()
    return code, found


@pytest.mark.parametrize(
    ("part", "commands"),
    [
        ("lock", LOCK_COMMANDS),
        ("limiters", LIMITER_COMMANDS),
        ("rate", RATE_COMMANDS),
        ("fence", FENCE_COMMANDS),
        ("celery", CELERY_COMMANDS),
        ("cli", OPERATOR_COMMANDS),
    ],
)
def test_every_command_of_the_minimal_acl_is_needed(part: str, commands: tuple[str, ...]) -> None:
    """The set is enough (no denial at all), and removing any one command is refused.

    For "limiters", "celery" and "cli" only the commands they add to the set they extend
    are removed one by one (the lock's are shown needed by the "lock" trials, the
    semaphores' and rate limiters' by the "limiters" trials; the Celery scenario does not
    wait on pub/sub). The rate limiter alone is granted no channel.
    """
    to_remove = {
        "limiters": LIMITER_EXTRA_COMMANDS,
        "celery": CELERY_EXTRA_COMMANDS,
        "cli": OPERATOR_EXTRA_COMMANDS,
    }.get(part, commands)
    channels: tuple[str, ...] = () if part == "rate" else ("redislock:*",)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            removed: pool.submit(_trial, part, commands, removed, channels)
            for removed in (None, *to_remove)
        }
        results = {removed: future.result() for removed, future in futures.items()}
    code, found = results.pop(None)
    assert (code, found) == (0, []), f"the full {part} set is not enough: {found}"
    not_needed = [
        removed for removed, (_code, found) in results.items() if not refused(found, removed)
    ]
    assert not_needed == [], f"{part}: commands never refused when removed: {not_needed}"


@pytest.mark.usefixtures("subscriber_only")
def test_a_refused_subscribe_does_not_kill_the_subscriber(
    acl_server: RedisServer, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A custom prefix whose keys were granted but whose channels were not (docs: both).
    set_user(admin, "half-granted", acl_rules(LOCK_COMMANDS, keys=("app:*",)))
    crashed: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    client = user_client(acl_server, "half-granted")
    try:
        holder = RedisLock(client, "job", prefix="app:", ttl=30)
        # Fixed leases: they expire by themselves (a release's PUBLISH would be refused).
        assert holder.acquire(lease=0.5)
        waiter = RedisLock(client, "job", prefix="app:", ttl=30)
        thread = threading.Thread(target=lambda: waiter.acquire(timeout=10, lease=0.5), daemon=True)
        thread.start()
        thread.join(15)
        time.sleep(0.2)
        assert crashed == [], f"the subscriber thread died: {crashed!r}"

        # Once the operator grants the channels, waiting must go back to pub/sub.
        set_user(
            admin,
            "half-granted",
            acl_rules(LOCK_COMMANDS, keys=("app:*",), channels=("app:*",)),
        )
        admin.delete(holder.keys.lock)
        assert holder.acquire(lease=30)
        got: list[bool] = []
        second = threading.Thread(
            target=lambda: got.append(waiter.acquire(timeout=10, lease=5)), daemon=True
        )
        second.start()
        subscriber = _waiting.subscriber_for(client)
        wait_until(lambda: holder.keys.channel in subscriber._channels, what="registered")
        assert subscriber._channels[holder.keys.channel].confirmed.wait(5), "not subscribed"
        holder.release()
        second.join(10)
        assert got == [True]
    finally:
        client.close()


def _default_prefix_sweeper(app: Any) -> Any:
    """A sweeper of the default prefix alone: the shared test app's tasks may carry the
    prefixes of other test modules, whose keys this ACL user may not read."""
    from celery_redislock.task import Sweeper

    sweeper = Sweeper(app)
    assert "redislock:" in sweeper.prefixes
    sweeper.prefixes = ["redislock:"]
    return sweeper


if __name__ == "__main__":
    sys.exit(_trial_main(sys.argv[1:]))
