"""AsyncRedisLock: the same semantics over redis.asyncio, per-task owners, cancellation safety."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from celery_redislock import (
    AsyncRedisLock,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
    RedisLock,
)
from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisServer


@pytest_asyncio.fixture
async def aclient(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=redis_server.port, socket_timeout=5)
    await client.flushall()
    yield client
    await aclose_background(client)
    await client.aclose()


def _public(cls: type) -> dict[str, object]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    return {n: inspect.getattr_static(cls, n) for n in names}


def test_sync_and_async_twins_have_the_same_public_surface() -> None:
    sync, aio = _public(RedisLock), _public(AsyncRedisLock)
    assert sorted(sync) == sorted(aio)
    for name, member in sync.items():
        other = aio[name]
        if isinstance(member, property):
            assert isinstance(other, property), name
            continue
        sync_fn = member.__func__ if isinstance(member, staticmethod) else member
        aio_fn = other.__func__ if isinstance(other, staticmethod) else other
        assert type(member) is type(other), name
        s, a = inspect.signature(sync_fn), inspect.signature(aio_fn)  # type: ignore[arg-type]
        assert list(s.parameters.values()) == list(a.parameters.values()), name
    sync_init = inspect.signature(RedisLock.__init__).parameters
    assert sync_init == inspect.signature(AsyncRedisLock.__init__).parameters


async def test_acquire_reenter_release(aclient: aioredis.Redis) -> None:
    lock = AsyncRedisLock(aclient, "job")
    assert await lock.acquire() and await lock.acquire()
    assert lock.hold_count == 2 and lock.token == 1
    await lock.release()
    assert await lock.locked()
    await lock.release()
    assert not await lock.locked() and lock.hold_count == 0


async def test_a_flushed_script_cache_is_reloaded_by_acquire_and_release(
    aclient: aioredis.Redis,
) -> None:
    lock = AsyncRedisLock(aclient, "job")
    await aclient.script_flush()
    assert await lock.acquire(blocking=False)
    await aclient.script_flush()
    await lock.release()
    assert not await lock.locked()


async def test_two_coroutines_on_one_thread_are_different_owners(aclient: aioredis.Redis) -> None:
    lock = AsyncRedisLock(aclient, "job")

    async def try_it() -> bool:
        return await lock.acquire(blocking=False)

    assert await asyncio.create_task(try_it()) is True  # that task now holds it
    assert await asyncio.create_task(try_it()) is False  # another task is another owner
    with pytest.raises(LockNotOwnedError):
        await lock.release()  # and so is this one
    shared = AsyncRedisLock(aclient, "shared", owner="job-1")

    async def take_shared() -> None:
        await shared.acquire()

    await asyncio.create_task(take_shared())
    await shared.release()  # an explicit owner spans tasks
    assert not await shared.locked()


async def test_waiter_wakes_on_release(aclient: aioredis.Redis) -> None:
    holder = AsyncRedisLock(aclient, "job", ttl=60, auto_renew=False, owner="holder")
    await holder.acquire()
    waiter = asyncio.create_task(AsyncRedisLock(aclient, "job", owner="w").acquire(timeout=20))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    await holder.release()
    assert await asyncio.wait_for(waiter, 20) is True  # long before the 60 s lease ends


async def test_a_release_grants_the_first_waiter_directly(aclient: aioredis.Redis) -> None:
    """As for RedisLock: the waiter's reader alone is told, with the token, and the
    waiter (the default owner: its task) holds the lock without another round trip;
    the watchdog lengthens the grant's lease; re-entries count as usual."""
    holder = AsyncRedisLock(aclient, "direct", ttl=60, auto_renew=False, owner="holder")
    await holder.acquire()
    keys = holder.keys
    checked = asyncio.Event()
    counts: list[bytes | None] = []

    async def waiter_task() -> tuple[bool, int | None]:
        lock = AsyncRedisLock(aclient, "direct", ttl=30)
        acquired = await lock.acquire(timeout=20)
        owner = lock._current_owner()
        token = lock.token
        await checked.wait()
        inner = AsyncRedisLock(aclient, "direct", ttl=30)
        assert await inner.acquire(blocking=False) is True
        counts.append(await aclient.hget(keys.lock, owner))
        await inner.release()
        await lock.release()
        assert not lock.lost
        return acquired, token

    task = asyncio.create_task(waiter_task())
    for _ in range(500):
        if await aclient.hlen(keys.waiters + b":wake"):
            break
        await asyncio.sleep(0.01)
    await aclient.config_resetstat()
    await holder.release()
    for _ in range(500):
        if await aclient.hget(keys.lock, "holder") is None and await aclient.exists(keys.lock):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    evalsha = (await aclient.info("commandstats"))["cmdstat_evalsha"]
    # The release alone (a first release also meets NOSCRIPT once: a failed call).
    assert evalsha["calls"] - evalsha["failed_calls"] == 1
    for _ in range(200):
        if await aclient.pttl(keys.lock) > 2000:
            break
        await asyncio.sleep(0.05)
    assert await aclient.pttl(keys.lock) > 20000  # the watchdog's first renewal
    checked.set()
    acquired, token = await asyncio.wait_for(task, 20)
    assert acquired is True
    assert token == int(await aclient.get(keys.fence))
    assert counts == [b"2"]
    assert not await aclient.exists(keys.lock)


async def test_context_manager_times_out(aclient: aioredis.Redis) -> None:
    await AsyncRedisLock(aclient, "job", owner="holder").acquire()
    with pytest.raises(LockTimeoutError):
        async with AsyncRedisLock(aclient, "job", timeout=0.1):
            pytest.fail("body must not run")


async def test_watchdog_keeps_the_lease_past_five_ttls(aclient: aioredis.Redis) -> None:
    lock = AsyncRedisLock(aclient, "job", ttl=0.3)
    async with lock:
        token = lock.token
        for _ in range(15):
            await asyncio.sleep(0.1)
            assert not await AsyncRedisLock(aclient, "job", owner="thief").acquire(blocking=False)
        lock.ensure_held()
        assert lock.token == token
    assert not await lock.locked()


async def test_loss_is_reported_to_callbacks_waiters_and_ensure_held(
    aclient: aioredis.Redis,
) -> None:
    lock = AsyncRedisLock(aclient, "job", ttl=0.3)
    seen: list[str] = []
    lock.on_lost(lambda _lock, error: seen.append(error.reason))
    await lock.acquire()
    assert await AsyncRedisLock.force_release(aclient, "job")
    await AsyncRedisLock(aclient, "job", owner="next", auto_renew=False).acquire()
    assert await lock.lost.wait(5)
    assert seen == ["stolen"]
    with pytest.raises(LockLostError):
        lock.ensure_held()
    with pytest.raises(LockLostError):
        await lock.release()
    assert await AsyncRedisLock(aclient, "job", owner="next").owned()


async def _step(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("contended", [False, True])
async def test_cancelling_acquire_at_any_point_leaves_no_hold(
    aclient: aioredis.Redis, contended: bool
) -> None:
    holder = AsyncRedisLock(aclient, "job", ttl=30, auto_renew=False, owner="holder")
    outcomes = {"cancelled": 0, "acquired": 0}
    for steps in range(0, 60):
        if contended:
            await holder.acquire()
        lock = AsyncRedisLock(aclient, "job", ttl=5, owner=f"cancel-{steps}")
        task = asyncio.create_task(lock.acquire(timeout=10))
        await _step(steps)
        if contended and steps % 3 == 0:
            await holder.release()  # sometimes the release races the cancellation
        task.cancel()
        try:
            acquired = await task
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1
            assert not await lock.owned(), f"hold left behind when cancelled after {steps} steps"
            assert lock.hold_count == 0
        else:
            outcomes["acquired"] += 1
            assert acquired and await lock.owned()
            await lock.release()
        if contended and await holder.owned():
            await holder.release()
        assert not await aclient.exists(lock.keys.lock)
    assert outcomes["cancelled"] > 0  # the cancellation really landed at various points


async def test_cancelling_release_keeps_the_hold_releasable(aclient: aioredis.Redis) -> None:
    cancelled = 0
    for steps in range(0, 40):
        lock = AsyncRedisLock(aclient, "job", ttl=5, owner="owner")
        await lock.acquire()
        task = asyncio.create_task(lock.release())
        await _step(steps)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled += 1
        if lock.hold_count:  # not released yet: still identifiable, and a retry works
            await lock.release()
        assert not await aclient.exists(lock.keys.lock), steps
    assert cancelled > 0


async def test_many_waited_locks_share_one_reader(aclient: aioredis.Redis) -> None:
    holders = [AsyncRedisLock(aclient, f"job-{i}", owner="h", auto_renew=False) for i in range(10)]
    for h in holders:
        await h.acquire()
    before = {c["id"] for c in await aclient.client_list() if int(c.get("sub", 0)) > 0}
    waiters = [
        asyncio.create_task(AsyncRedisLock(aclient, f"job-{i}", owner="w").acquire(timeout=20))
        for i in range(10)
    ]
    await asyncio.sleep(0.3)
    subs = [
        c for c in await aclient.client_list() if int(c.get("sub", 0)) > 0 and c["id"] not in before
    ]
    # Two channels per lock: its release channel and this reader's direct-grant channel.
    assert len(subs) == 1 and int(subs[0]["sub"]) == 2 * 10
    for h in holders:
        await h.release()
    assert await asyncio.gather(*waiters) == [True] * 10
