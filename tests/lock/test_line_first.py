"""A lock whose last blocked acquire had to wait joins the line with its next blocked
acquire's first attempt (``SingleBase._expect_wait``): one round trip per contended acquire
instead of two, and never at the cost of a re-entry, a grant or a signal.

Real redis-server processes (the session's, flushed); attempts are counted by wrapping the
lock object's own ``_try``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from celery_redislock import AsyncRedisLock, RedisLock, RedisSemaphore, signals
from celery_redislock.celery.tasklock import TaskLock

from .._support import wait_until


def counted(lock: Any) -> list[tuple[bool, bool]]:
    """Each attempt ``lock`` makes from now on, as (first in line, in line)."""
    attempts: list[tuple[bool, bool]] = []
    original = lock._try

    def attempt(*args: Any, **kwargs: Any) -> Any:
        attempts.append((kwargs.get("first", False), kwargs.get("line", False)))
        return original(*args, **kwargs)

    lock._try = attempt
    return attempts


def line_keys_left(client: redis.Redis, lock: Any) -> list[bytes]:
    keys = lock.keys
    return [k for k in (keys.lock, keys.waiters, keys.claims, keys.wake) if client.exists(k)]


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # reported by the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def test_a_lock_that_waited_joins_the_line_with_its_first_attempt(
    redis_client: redis.Redis,
) -> None:
    name = "linefirst:a"
    holder = RedisLock(redis_client, name, ttl=30, owner="holder")
    waiter = RedisLock(redis_client, name, ttl=30)
    attempts = counted(waiter)
    contended: list[str] = []

    def on_contended(sender: Any, **kw: Any) -> None:
        if sender is waiter:
            contended.append(kw["owner"])

    signals.lock_contended.connect(on_contended)
    try:
        seen = []
        for turn in range(3):
            assert holder.acquire()
            attempts.clear()

            def wait_and_release() -> int:
                assert waiter.acquire(timeout=20)
                token = waiter.token
                waiter.release()
                return token

            thread, out = in_thread(wait_and_release)
            wait_until(lambda: redis_client.llen(waiter.keys.waiters) == 1, what="in line")
            holder.release()
            thread.join(20)
            assert not thread.is_alive() and "error" not in out, out
            seen.append(out["value"])
            if turn == 0:  # no hint yet: alone first, then in line
                assert attempts == [(False, False), (False, True)]
            else:  # it waited last time: one attempt, in line at once, then granted
                assert attempts == [(True, True)]
            assert len(contended) == turn + 1  # the signal once per contended acquire
        assert len(set(seen)) == 3  # three holds, three tokens
        # Free now: the hinted acquire takes it with its one attempt and drops the hint.
        attempts.clear()
        assert waiter.acquire(timeout=5)
        waiter.release()
        assert waiter.acquire(timeout=5)
        waiter.release()
        assert attempts == [(True, True), (False, False)]
        assert len(contended) == 3
        assert line_keys_left(redis_client, waiter) == []
    finally:
        signals.lock_contended.disconnect(on_contended)


def test_a_first_attempt_in_line_re_enters_a_hold_the_owner_has_through_another_object(
    redis_client: redis.Redis,
) -> None:
    """The first attempt joins the line with the thread's wake id: a hold of the thread
    taken through another lock object of the name is re-entered (counted again), not taken
    up as a grant to this wait (acquire.lua's mode "first")."""
    name = "linefirst:reenter"
    holder = RedisLock(redis_client, name, ttl=30, owner="holder")
    hinted = RedisLock(redis_client, name, ttl=30)
    other = RedisLock(redis_client, name, ttl=30)
    assert holder.acquire()

    def scenario() -> tuple[bytes | None, bytes | None, bool]:
        assert hinted.acquire(timeout=20)  # waits: the hint is set
        hinted.release()
        assert hinted._expect_wait
        assert other.acquire(timeout=5)  # the thread's hold, through another object
        assert hinted.acquire(timeout=5)  # a re-entry, made in line with its wake id
        owner = hinted._current_owner()
        both = redis_client.hget(name_key, owner)
        hinted.release()
        one = redis_client.hget(name_key, owner)
        other.release()
        return both, one, hinted._expect_wait

    name_key = hinted.keys.lock
    thread, out = in_thread(scenario)
    wait_until(lambda: redis_client.llen(hinted.keys.waiters) == 1, what="in line")
    holder.release()
    thread.join(20)
    assert not thread.is_alive() and "error" not in out, out
    both, one, hint = out["value"]
    assert (both, one) == (b"2", b"1")
    assert hint is False  # taken at its first attempt: the next one tries alone
    assert line_keys_left(redis_client, hinted) == []


def test_only_a_plain_lock_joins_the_line_first(redis_client: redis.Redis) -> None:
    """A semaphore's and a task's acquire scripts read their own modes where a lock's reads
    "first": they always try alone first."""
    assert RedisLock(redis_client, "linefirst:kinds")._first_in_line
    assert not RedisSemaphore(redis_client, "linefirst:kinds", limit=2)._first_in_line
    assert not TaskLock.__new__(TaskLock)._first_in_line  # (decided by its kind alone)


async def test_an_asyncio_lock_that_waited_joins_the_line_first_and_still_re_enters(
    aclient: aioredis.Redis,
) -> None:
    name = "linefirst:async"
    holder = AsyncRedisLock(aclient, name, ttl=30, owner="holder")
    waiter = AsyncRedisLock(aclient, name, ttl=30)
    attempts = counted(waiter)
    for turn in range(2):
        await holder.acquire()
        attempts.clear()
        task = asyncio.ensure_future(waiter.acquire(timeout=20))
        for _ in range(200):
            if await aclient.llen(waiter.keys.waiters) == 1:
                break
            await asyncio.sleep(0.01)
        await holder.release()
        assert await asyncio.wait_for(task, 20) is True
        assert attempts == ([(False, False), (False, True)] if turn == 0 else [(True, True)])
        await waiter.release()
    # Re-entry within the task that holds it: counted twice in Redis.
    attempts.clear()
    assert await waiter.acquire(timeout=5)  # free: in line first, taken, hint dropped
    assert await waiter.acquire(timeout=5)  # a re-entry, alone
    assert attempts == [(True, True), (False, False)]
    assert await aclient.hget(waiter.keys.lock, waiter._current_owner()) == b"2"
    await waiter.release()
    await waiter.release()
    assert not await aclient.exists(waiter.keys.lock, waiter.keys.waiters, waiter.keys.claims)
