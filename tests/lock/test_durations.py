"""Durations are bounded (issue 15): at validation, in every Lua script, and in the watchdog.

* every duration the package accepts is a number of seconds up to ``MAX_SECONDS`` (365
  days), refused past it with a ``LockConfigurationError`` naming the argument and range;
* every script that takes a duration checks all of its numeric arguments before its first
  write: called directly with a bad one, it fails and leaves Redis exactly as it was;
* the watchdog survives any single hold it cannot renew: that hold is reported lost
  ("unrenewable") and dropped, and every other lock goes on being renewed.
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
import threading
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from celery_redislock import (
    AsyncRedisLock,
    LockConfigurationError,
    RedisLock,
    RedLock,
    locked,
)
from celery_redislock._core import (
    MAX_MS,
    MAX_SECONDS,
    Hold,
    LeaseLost,
    LockKeys,
    lease_ms,
    optional_seconds,
    seconds,
)
from celery_redislock._renewal import async_scheduler_for, scheduler_for
from celery_redislock._scripts import scripts_for, source
from celery_redislock.aio import aclose_background
from celery_redislock.settings import LockOptions, LockSettings, task_overrides
from celery_redislock.task import TaskLock
from celery_redislock.testing import RedisServer

from .._support import wait_until

RANGE = "between 0.001 and 31536000 seconds (365 days)"

# ------------------------------------------------------------------ the bound, in Python


def test_the_bound_is_365_days_in_one_place() -> None:
    assert MAX_SECONDS == 365 * 24 * 3600 and MAX_MS == MAX_SECONDS * 1000
    assert MAX_SECONDS < threading.TIMEOUT_MAX  # every wait a timeout becomes is safe
    assert MAX_MS < 2**53  # an exact integer in Lua
    # The scripts are loaded with the same number.
    assert f"whole_arg(value, what .. ' (ms)', low or 1, {MAX_MS})" in source("acquire")


@pytest.mark.parametrize("value", [1e12, sys.maxsize, 10**400, MAX_SECONDS + 0.5, 1e16])
def test_a_huge_lease_is_refused_naming_the_argument_and_the_range(value: object) -> None:
    with pytest.raises(LockConfigurationError) as info:
        lease_ms(value, "ttl")
    assert str(info.value) == f"ttl must be a number {RANGE}, got {value!r}"


def test_the_bounds_themselves_are_accepted() -> None:
    assert lease_ms(MAX_SECONDS, "ttl") == MAX_MS
    assert lease_ms(0.001, "ttl") == 1
    assert optional_seconds(MAX_SECONDS, "timeout") == MAX_SECONDS
    assert optional_seconds(0, "timeout") == 0.0
    assert seconds(MAX_SECONDS, "x") == MAX_SECONDS


@pytest.mark.parametrize("value", [1e12, sys.maxsize, 10**400, -1, math.inf, math.nan, "5"])
def test_a_timeout_out_of_range_is_refused(value: object) -> None:
    with pytest.raises(LockConfigurationError) as info:
        optional_seconds(value, "timeout")
    message = str(info.value)
    assert message.startswith("timeout must be None (no limit) or a number between 0 and 31536000")


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda c: RedisLock(c, "x", ttl=1e12), "ttl"),
        (lambda c: RedisLock(c, "x", ttl=sys.maxsize), "ttl"),
        (lambda c: RedisLock(c, "x", timeout=1e12), "timeout"),
        (lambda c: RedisLock(c, "x", replica_timeout=1e12), "replica_timeout"),
        (lambda c: RedisLock(c, "x").acquire(lease=1e12), "lease"),
        (lambda c: RedisLock(c, "x").acquire(timeout=1e12), "timeout"),
        (lambda c: RedisLock(c, "x").lost.wait(1e12), "timeout"),
        (lambda c: RedLock([c], "x", ttl=1e12), "ttl"),
        (lambda c: RedLock([c], "x", node_timeout=1e12), "node_timeout"),
        (lambda c: RedLock([c], "x", retry_delay=1e12), "retry_delay"),
        (lambda c: locked(c, "x", ttl=1e12), "ttl"),
        (lambda c: locked(c, "x", timeout=1e12), "timeout"),
        (lambda c: locked(c, "x", retry_delay=1e12), "retry_delay"),
        (lambda c: locked(c, "x", retry_delay=None), "retry_delay"),
    ],
)
def test_every_entry_point_refuses_a_huge_duration_before_any_write(
    redis_client: redis.Redis, make: Any, argument: str
) -> None:
    with pytest.raises(LockConfigurationError, match=rf"^{argument} must be .* 31536000 seconds"):
        make(redis_client)
    assert redis_client.dbsize() == 0


def test_extend_refuses_a_huge_ttl_and_keeps_the_lease(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "x", ttl=5, auto_renew=False)
    with lock:
        before = expire_time(redis_client, lock.keys.lock)
        expected = "^" + re.escape(f"ttl must be a number {RANGE}, got 1000000000000.0")
        with pytest.raises(LockConfigurationError, match=expected):
            lock.extend(1e12)
        assert expire_time(redis_client, lock.keys.lock) == before


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("redislock_ttl", 1e12),
        ("redislock_wait", 1e12),
        ("redislock_done_ttl", 1e16),
        ("redislock_requeue_backoff", (0.05, 1e12)),
        ("redislock_node_timeout", 1e12),
    ],
)
def test_app_settings_refuse_huge_durations(setting: str, value: object) -> None:
    with pytest.raises(LockConfigurationError, match=rf"^{setting}(\[1\])? must be .* 31536000"):
        LockSettings.from_conf({"broker_url": "redis://localhost", setting: value})


def test_a_quorum_node_timeout_must_be_well_below_the_app_ttl() -> None:
    urls = ["redis://a:1", "redis://b:2", "redis://c:3"]
    match = r"^redislock_node_timeout \(0.25s\) must be well below redislock_ttl \(0.4s\)"
    with pytest.raises(LockConfigurationError, match=match):
        LockSettings.from_conf({"redislock_urls": urls, "redislock_ttl": 0.4})
    assert (
        LockSettings.from_conf({"redislock_urls": urls, "redislock_ttl": 0.6}).node_timeout == 0.25
    )


@pytest.mark.parametrize(
    ("attribute", "value"),
    [("lock_ttl", 1e12), ("lock_done_ttl", 1e16), ("lock_hold", 1e12), ("lock_wait", 1e12)],
)
def test_task_options_refuse_huge_durations_at_decoration(attribute: str, value: object) -> None:
    with pytest.raises(LockConfigurationError, match=rf"^task 't': {attribute} must be .*31536000"):
        task_overrides({attribute: value}, "t")


def test_lock_hold_is_zero_or_a_lease() -> None:
    assert task_overrides({"lock_hold": 0}, "t") == {"hold": 0.0}
    with pytest.raises(LockConfigurationError, match=r"lock_hold must be 0 \(release at once\)"):
        task_overrides({"lock_hold": -1}, "t")


# ------------------------------------------------------------------ the scripts


def expire_time(r: redis.Redis, key: bytes | str) -> int:
    return int(r.execute_command("PEXPIRETIME", key))


def snapshot(r: redis.Redis) -> dict[bytes, tuple[bytes, int]]:
    """Every key's serialized value and absolute expiry: equal snapshots, nothing changed."""
    return {key: (r.dump(key), expire_time(r, key)) for key in r.keys("*")}  # type: ignore[misc,union-attr]


#: Not a whole number of milliseconds from 1 to MAX_MS.
BAD_MS = [
    "0",
    "-5",
    "1.5",
    "1e3",
    "nan",
    "inf",
    "abc",
    "",
    str(MAX_MS + 1),
    str(sys.maxsize * 1000),
]


def refused(call: Any) -> str:
    with pytest.raises(redis.ResponseError) as info:
        call()
    assert "redislock:" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("bad", BAD_MS)
def test_acquire_lua_writes_nothing_with_a_bad_lease(redis_client: redis.Redis, bad: str) -> None:
    keys = LockKeys.for_name("a")
    RedisLock(redis_client, "a", auto_renew=False).acquire()  # the fence counter exists
    redis_client.delete(keys.lock)
    before = snapshot(redis_client)
    script = scripts_for(redis_client).acquire
    args = [keys.lock, keys.fence, keys.waiters, keys.claims, keys.wake]
    assert "lease (ms)" in refused(lambda: script(keys=args, args=["owner", bad]))
    assert snapshot(redis_client) == before  # no token handed out, no key without expiry


@pytest.mark.parametrize("bad", ["-1", "x", str(MAX_MS + 1)])
def test_acquire_lua_writes_nothing_with_a_bad_line_margin(
    redis_client: redis.Redis, bad: str
) -> None:
    keys = LockKeys.for_name("a")
    RedisLock(redis_client, "a", owner="holder", auto_renew=False).acquire()
    before = snapshot(redis_client)
    script = scripts_for(redis_client).acquire
    args = [keys.lock, keys.fence, keys.waiters, keys.claims, keys.wake]
    assert "line margin" in refused(lambda: script(keys=args, args=["waiter", 1000, bad]))
    assert snapshot(redis_client) == before  # not in line


@pytest.mark.parametrize("bad", BAD_MS)
def test_renew_lua_checks_every_lease_before_renewing_any(
    redis_client: redis.Redis, bad: str
) -> None:
    first = RedisLock(redis_client, "first", owner="o", ttl=5, auto_renew=False)
    second = RedisLock(redis_client, "second", owner="o", ttl=5, auto_renew=False)
    first.acquire()
    second.acquire()
    before = snapshot(redis_client)
    keys = [first.keys.lock, second.keys.lock]
    script = scripts_for(redis_client).renew
    args = ["o", 60000, "", "o", bad, ""]
    assert "lease (ms)" in refused(lambda: script(keys=keys, args=args))
    assert snapshot(redis_client) == before  # the first lease was not touched either


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["o", "hold", MAX_MS + 1], "hold"),
        (["o", "hold", "0"], "hold"),
        (["o", "one", "", 10**17], "done marker lifetime"),
        (["o", "one", "", 60000, "1e99"], "grant lease"),
        (["o", "one", "", 60000, "0"], "grant lease"),
    ],
)
def test_release_lua_writes_nothing_with_a_bad_duration(
    redis_client: redis.Redis, args: list[Any], what: str
) -> None:
    holder = RedisLock(redis_client, "r", owner="o", ttl=5, auto_renew=False)
    holder.acquire()
    waiter = RedisLock(redis_client, "r", owner="w", ttl=5, auto_renew=False)
    thread = threading.Thread(target=lambda: waiter.acquire(timeout=10) and waiter.release())
    thread.start()  # a waiter in line: a release would hand it the lock
    wait_until(lambda: redis_client.llen(holder.keys.waiters) == 1, timeout=5)
    before = snapshot(redis_client)
    keys = [*holder.keys.release_keys(), holder.keys.lock + b":done:o"]
    script = scripts_for(redis_client).release
    assert what in refused(lambda: script(keys=keys, args=args))
    assert snapshot(redis_client) == before  # still held by "o", the waiter still in line
    holder.release()
    thread.join()
    assert redis_client.dbsize() == 1  # the fence counter alone: the waiter had its turn


def task_lock(r: redis.Redis, task_id: str) -> TaskLock:
    return TaskLock(r, "job", task_id=task_id, options=LockOptions(ttl=300))


def park_two(r: redis.Redis) -> TaskLock:
    """Task "holder" holds the lock (not renewed here), task "next" is parked behind it."""
    holder = task_lock(r, "holder")
    assert holder.park('{"task": "holder"}', 600) is True
    holder.close()  # no renewal may change the snapshot
    assert task_lock(r, "next").park('{"task": "next"}', 600) > 0  # type: ignore[operator]
    return holder


@pytest.mark.parametrize("bad", BAD_MS)
def test_park_lua_writes_nothing_with_a_bad_parking_lifetime(
    redis_client: redis.Redis, bad: str
) -> None:
    holder = task_lock(redis_client, "holder")
    assert holder.park('{"task": "holder"}', 600) is True
    holder.close()
    before = snapshot(redis_client)
    parker = task_lock(redis_client, "parked")
    keys = [
        parker.keys.lock,
        parker.keys.fence,
        parker.done_key,
        parker.parked,
        parker.parked_messages,
        parker.dispatched,
        parker.registry,
    ]
    script = scripts_for(redis_client).park
    assert "parking lifetime" in refused(
        lambda: script(keys=keys, args=["parked", 5000, '{"task": "parked"}', bad])
    )
    assert snapshot(redis_client) == before  # not parked, no record without expiry


@pytest.mark.parametrize(
    ("position", "bad", "what"),
    [
        (3, str(10**16), "done marker lifetime"),  # the lock_done_ttl=1e16 (in ms)
        (3, "-1", "done marker lifetime"),
        (2, str(sys.maxsize * 1000), "lease"),
        (2, "0", "lease"),
    ],
)
def test_handoff_lua_keeps_the_parked_task_when_an_argument_is_bad(
    redis_client: redis.Redis, position: int, bad: str, what: str
) -> None:
    holder = park_two(redis_client)
    before = snapshot(redis_client)
    keys, args = holder.handoff_args("holder", "one", 60)
    args[position] = bad
    assert what in refused(lambda: scripts_for(redis_client).handoff(keys=keys, args=args))
    assert snapshot(redis_client) == before
    assert redis_client.lrange(holder.parked, 0, -1) == [b"next"]  # not popped and lost


@pytest.mark.parametrize(
    ("args", "what"),
    [
        ([str(10**16), 2500, 1000], "lease"),
        (["0", 2500, 1000], "lease"),
        ([5000, "-1", 1000], "staleness"),
        ([5000, 2500, "0"], "queue reach"),
    ],
)
def test_sweep_lua_keeps_the_parked_task_when_an_argument_is_bad(
    redis_client: redis.Redis, args: list[Any], what: str
) -> None:
    holder = park_two(redis_client)
    redis_client.delete(holder.keys.lock)  # the holder vanished: a sweep would hand over
    before = snapshot(redis_client)
    lock_key = holder.keys.lock
    keys = [
        lock_key,
        lock_key + b":released",
        lock_key + b":fence",
        holder.parked,
        holder.parked_messages,
        lock_key + b":parked:unused",
        holder.dispatched,
        holder.registry,
    ]
    assert what in refused(lambda: scripts_for(redis_client).sweep(keys=keys, args=args))
    assert snapshot(redis_client) == before


# ------------------------------------------------------------------ the watchdog


def try_to_steal(r: redis.Redis, names: list[str], seconds: float) -> tuple[int, int]:
    """Non-blocking acquires of ``names`` by another owner for ``seconds``: (stolen, tries)."""
    thieves = [RedisLock(r, n, owner="thief", ttl=5, auto_renew=False) for n in names]
    stolen = tries = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for thief in thieves:
            tries += 1
            if thief.acquire(blocking=False):
                stolen += 1
                thief.release()
        time.sleep(0.02)
    return stolen, tries


class Exploding(Hold):
    """A hold whose renewal bookkeeping raises: what no lock makes, injected by hand."""

    __slots__ = ()

    def renewed(self, sent_at: float) -> None:
        raise RuntimeError("this hold cannot be renewed")


def exploding_hold(r: redis.Redis, name: str) -> Exploding:
    """A hold Redis really has (so its renewal succeeds there, then raises here)."""
    lock = RedisLock(r, name, owner="exploding", ttl=0.3, auto_renew=False)
    assert lock.acquire()
    return Exploding(
        lock.keys,
        "exploding",
        token=1,
        lease=300,
        renew=True,
        sent_at=time.monotonic(),
        lost=LeaseLost(),
        notify=lambda hold, reason: None,
    )


def test_an_absurd_lease_is_dropped_alone_and_later_locks_keep_renewing(
    redis_client: redis.Redis,
) -> None:
    """The issue's case: a ttl=1e12 hold (1e15 ms, bypassing today's validation) killed the
    shared watchdog thread, and locks taken after it were never renewed, then stolen."""
    bad = RedisLock(redis_client, "bad", ttl=0.3)
    assert bad.acquire()
    bad._holds[bad._current_owner()].lease = 10**15
    reasons: list[str] = []
    bad.on_lost(lambda _lock, error: reasons.append(error.reason))
    assert bad.lost.wait(2.0) and bad.lost.reason == "unrenewable" and reasons == ["unrenewable"]
    locks = [RedisLock(redis_client, name, ttl=0.3) for name in ("a", "b")]
    for lock in locks:
        assert lock.acquire()
    tokens = [lock.token for lock in locks]
    stolen, tries = try_to_steal(redis_client, ["a", "b"], 1.5)  # five leases
    assert tries > 40 and stolen == 0
    for lock, token in zip(locks, tokens):
        lock.ensure_held()
        assert lock.token == token and not lock.lost and lock.owned()
        lock.release()
    assert len(scheduler_for(redis_client)) == 0


def test_a_bad_lease_in_a_shared_batch_fails_only_its_own_hold(redis_client: redis.Redis) -> None:
    """A lease Redis refuses (1e19 ms) used to fail the whole renewal batch it rode in:
    every lock renewed with it ran out as "unreachable"."""
    locks = [RedisLock(redis_client, name, ttl=0.3) for name in ("a", "b")]
    for lock in locks:
        assert lock.acquire()
    bad = RedisLock(redis_client, "bad", ttl=0.3)
    assert bad.acquire()
    bad._holds[bad._current_owner()].lease = 10**19
    stolen, tries = try_to_steal(redis_client, ["a", "b"], 1.5)
    assert tries > 40 and stolen == 0
    assert bad.lost.reason == "unrenewable"
    for lock in locks:
        lock.ensure_held()
        assert not lock.lost
        lock.release()


def test_a_hold_that_raises_while_renewed_is_dropped_alone(redis_client: redis.Redis) -> None:
    locks = [RedisLock(redis_client, name, ttl=0.3) for name in ("a", "b")]
    for lock in locks:
        assert lock.acquire()
    exploding = exploding_hold(redis_client, "exploding")
    scheduler_for(redis_client).add(exploding)
    stolen, tries = try_to_steal(redis_client, ["a", "b"], 1.5)
    assert tries > 40 and stolen == 0
    assert exploding.lost.reason == "unrenewable"
    for lock in locks:
        lock.ensure_held()
        assert not lock.lost
        lock.release()


async def test_the_asyncio_watchdog_survives_a_hold_that_raises(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    client = aioredis.Redis(port=redis_server.port)
    try:
        locks = [AsyncRedisLock(client, name, ttl=0.3) for name in ("a", "b")]
        for lock in locks:
            assert await lock.acquire()
        exploding = exploding_hold(redis_client, "exploding")
        scheduler = async_scheduler_for(client)
        assert scheduler is not None
        scheduler.add(exploding)
        stolen, tries = await asyncio.to_thread(try_to_steal, redis_client, ["a", "b"], 1.5)
        assert tries > 40 and stolen == 0
        assert exploding.lost.reason == "unrenewable"
        assert scheduler.running
        for lock in locks:
            lock.ensure_held()
            assert not lock.lost
            await lock.release()
    finally:
        await aclose_background(client)
        await client.aclose()


async def test_the_asyncio_watchdog_drops_an_absurd_lease_alone(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    client = aioredis.Redis(port=redis_server.port)
    try:
        locks = [AsyncRedisLock(client, name, ttl=0.3) for name in ("a", "b")]
        for lock in locks:
            assert await lock.acquire()
        bad = AsyncRedisLock(client, "bad", ttl=0.3)
        assert await bad.acquire()
        bad._holds[bad._current_owner()].lease = 10**19
        stolen, tries = await asyncio.to_thread(try_to_steal, redis_client, ["a", "b"], 1.5)
        assert tries > 40 and stolen == 0
        assert bad.lost.reason == "unrenewable"
        for lock in locks:
            lock.ensure_held()
            assert not lock.lost
            await lock.release()
    finally:
        await aclose_background(client)
        await client.aclose()
