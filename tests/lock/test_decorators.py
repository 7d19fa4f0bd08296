"""``locked``: the key language on plain functions and coroutines, against real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from celery_redislock import LockConfigurationError, LockContendedError, current_lock, locked
from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisServer


def test_calls_with_the_same_key_never_overlap(redis_client: redis.Redis) -> None:
    spans: list[tuple[float, float]] = []

    @locked(redis_client, "account:{account_id}", ttl=5)
    def settle(account_id: int, amount: int) -> int:
        lock = current_lock()
        assert lock is not None and lock.token is not None
        enter = time.monotonic()
        time.sleep(0.01)
        spans.append((enter, time.monotonic()))
        return amount

    threads = [threading.Thread(target=settle, args=(7,), kwargs={"amount": i}) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(spans) == 8
    spans.sort()
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
    assert not redis_client.exists("redislock:{account:7}")
    assert current_lock() is None


def test_timeout_raises_or_skips_and_retries_are_counted(redis_client: redis.Redis) -> None:
    from celery_redislock import RedisLock

    RedisLock(redis_client, "job:1", owner="holder", ttl=30).acquire()
    calls: list[int] = []

    @locked(redis_client, "job:{n}", timeout=0.05, retries=2, retry_delay=0.01)
    def strict(n: int) -> None:
        calls.append(n)

    @locked(redis_client, "job:{n}", blocking=False, on_timeout="skip")
    def lenient(n: int) -> str:
        calls.append(n)
        return "ran"

    with pytest.raises(LockContendedError, match="3 attempts"):
        strict(1)
    assert lenient(1) is None
    assert lenient(2) == "ran"
    assert calls == [2]


def test_exceptions_release_the_lock(redis_client: redis.Redis) -> None:
    @locked(redis_client, "job:{n}")
    def boom(n: int) -> None:
        raise ValueError(n)

    with pytest.raises(ValueError):
        boom(3)
    assert not redis_client.exists("redislock:{job:3}")


def test_bad_decorator_arguments_fail_at_decoration(redis_client: redis.Redis) -> None:
    with pytest.raises(LockConfigurationError, match="ttl"):
        locked(redis_client, ttl=0)
    with pytest.raises(LockConfigurationError, match="on_timeout"):
        locked(redis_client, on_timeout="wait")
    with pytest.raises(LockConfigurationError, match="retries"):
        locked(redis_client, retries=-1)
    with pytest.raises(LockConfigurationError, match="missing"):

        @locked(redis_client, "x:{missing}")
        def f(present: int) -> None: ...


async def test_coroutines_get_the_asyncio_lock(redis_server: RedisServer) -> None:
    client = aioredis.Redis(port=redis_server.port)
    try:

        @locked(client, "user:{user_id}", ttl=5)
        async def rebuild(user_id: int) -> int:
            lock = current_lock()
            assert lock is not None and await lock.owned()  # type: ignore[misc]
            return user_id

        assert await rebuild(5) == 5
        assert not await client.exists("redislock:{user:5}")
    finally:
        await aclose_background(client)
        await client.aclose()
