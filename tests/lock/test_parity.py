"""Every sync/asyncio twin matches its other half: the same public surface, and the same
observable behaviour on a real ``redis-server``.

The twins share their decisions (``_base``, ``_single``, ``_quorum_runtime``, the
``SubscriberBase`` and ``WaiterBase`` of ``_waiting``) and only drive I/O apart; these
tests keep the drivers from drifting: a method added to one twin, a parameter renamed
or a default changed on one side, or a scenario that ends differently fails here.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis

from celery_redislock import (
    AsyncRedisLock,
    AsyncRedisRateLimiter,
    AsyncRedisSemaphore,
    AsyncRedLock,
    LockLostError,
    LockNotOwnedError,
    RedisLock,
    RedisLockError,
    RedisRateLimiter,
    RedisSemaphore,
    RedLock,
)
from celery_redislock._async_waiting import AsyncSubscriber, AsyncWaiter, _AsyncChannel
from celery_redislock._base import AsyncContext, SyncContext
from celery_redislock._renewal import AsyncRenewalScheduler, RenewalScheduler
from celery_redislock._waiting import LINGER, Subscriber, Waiter, _Channel, subscriber_for
from celery_redislock.aio import AsyncSingle, aclose_background
from celery_redislock.aio_redlock import _AsyncMultiWaiter
from celery_redislock.lock import SyncSingle
from celery_redislock.redlock import _MultiWaiter
from celery_redislock.testing import RedisServer

#: The methods of the locks that talk to Redis: awaited on the asyncio twin.
LOCK_IO = {"acquire", "release", "extend", "locked", "owned", "remaining", "force_release"}

#: What the drivers of a lock on one Redis (and so the semaphores) send to Redis.
SINGLE_IO = {"acquire", "release", "extend", "owned"}

#: (sync, asyncio, their methods that are awaited on the asyncio side, what only the
#: asyncio side has: closing its background tasks or connections in its event loop).
PAIRS: list[tuple[type, type, set[str], set[str]]] = [
    (RedisLock, AsyncRedisLock, LOCK_IO, set()),
    (RedLock, AsyncRedLock, LOCK_IO, {"aclose"}),
    (SyncSingle, AsyncSingle, SINGLE_IO, set()),
    (RedisSemaphore, AsyncRedisSemaphore, SINGLE_IO, set()),
    (RedisRateLimiter, AsyncRedisRateLimiter, {"acquire", "reserve"}, set()),
    (SyncContext, AsyncContext, {"acquire", "release"}, set()),
    (_Channel, _AsyncChannel, set(), set()),
    (Subscriber, AsyncSubscriber, set(), {"aclose"}),
    (Waiter, AsyncWaiter, {"wait"}, set()),
    (RenewalScheduler, AsyncRenewalScheduler, set(), {"aclose"}),
    (_MultiWaiter, _AsyncMultiWaiter, {"wait"}, set()),
]

#: A context manager's two spellings.
CONTEXT = {"__enter__": "__aenter__", "__exit__": "__aexit__"}


def _public(cls: type) -> dict[str, Any]:
    return {n: inspect.getattr_static(cls, n) for n in dir(cls) if not n.startswith("_")}


def _function(member: Any) -> Any:
    return member.__func__ if isinstance(member, (staticmethod, classmethod)) else member


def _parameters(fn: Any) -> list[tuple[str, Any, Any]]:
    """Names, kinds and defaults (not annotations: those name each side's own types)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _awaitable(fn: Any) -> bool:
    """A coroutine function, or a plain method returning its coroutine (the owner-checked
    ones resolve the owner when called, then return the coroutine)."""
    if inspect.iscoroutinefunction(fn):
        return True
    annotation = str(inspect.signature(fn).return_annotation)
    return annotation.startswith(("Coroutine[", "Awaitable["))


@pytest.mark.parametrize(
    ("sync", "aio", "awaited", "async_only"), PAIRS, ids=[p[0].__name__ for p in PAIRS]
)
def test_each_pair_has_one_public_surface(
    sync: type, aio: type, awaited: set[str], async_only: set[str]
) -> None:
    mine, theirs = _public(sync), _public(aio)
    assert sorted(mine) == sorted(set(theirs) - async_only)
    for name in async_only:
        assert _awaitable(_function(theirs[name])), name
    seen_awaited = set()
    for name, member in mine.items():
        other = theirs[name]
        if isinstance(member, property) or isinstance(other, property):
            assert isinstance(member, property) and isinstance(other, property), name
            continue
        assert type(member) is type(other), name  # staticmethod stays staticmethod
        if not callable(_function(member)):
            continue
        sync_fn, aio_fn = _function(member), _function(other)
        assert _parameters(sync_fn) == _parameters(aio_fn), name
        assert not _awaitable(sync_fn), name
        if _awaitable(aio_fn):
            seen_awaited.add(name)
    assert seen_awaited == awaited
    assert _parameters(sync.__init__) == _parameters(aio.__init__)  # type: ignore[misc]
    for plain, spelled in CONTEXT.items():
        if hasattr(sync, plain):
            assert hasattr(aio, spelled) and not hasattr(aio, plain), (aio, spelled)
            assert _awaitable(getattr(aio, spelled)), spelled


def test_every_twin_in_the_package_is_listed() -> None:
    """A new sync/asyncio pair gets a row in PAIRS (it is found by its Async name)."""
    import celery_redislock._async_waiting as async_waiting
    import celery_redislock._renewal as renewal
    import celery_redislock.aio as aio
    import celery_redislock.aio_redlock as aio_redlock
    import celery_redislock.ratelimit as ratelimit
    import celery_redislock.semaphore as semaphore

    listed = {aio_cls.__name__ for _, aio_cls, _, _ in PAIRS}
    found = {
        name
        for module in (aio, aio_redlock, async_waiting, renewal, semaphore, ratelimit)
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and name.lstrip("_").startswith("Async")
        and name not in {"AsyncCalls"}  # the asyncio side's shared calls, not a twin
    }
    assert found <= listed, found - listed


# -- behaviour ------------------------------------------------------------------


async def _settle(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _inside(lock: Any) -> tuple[int, bool]:
    """Enter the lock as its twin does (``with`` or ``async with``): what it shows inside."""
    if isinstance(lock, AsyncContext):
        async with lock:
            return lock.hold_count, await _settle(lock.owned())
    with lock:
        return lock.hold_count, await _settle(lock.owned())


async def scenario(make: Callable[[str | None], Any], force: Callable[[], Any]) -> list[Any]:
    """One story, told to either twin: what each step showed."""
    seen: list[Any] = []
    mine, other = make(None), make("other")
    seen.append(("acquire", await _settle(mine.acquire(blocking=False)), mine.hold_count))
    first = mine.token
    assert isinstance(first, int)
    again = await _settle(mine.acquire(blocking=False))
    seen.append(("re-enter", again, mine.token == first, mine.hold_count))
    seen.append(
        (
            "owned, locked",
            await _settle(mine.owned()),
            await _settle(other.owned()),
            await _settle(mine.locked()),
        )
    )
    remaining = await _settle(mine.remaining())
    seen.append(("remaining", remaining is not None and 0 < remaining <= 30))
    refused = await _settle(other.acquire(blocking=False))
    timed_out = await _settle(other.acquire(timeout=0.05))
    seen.append(("contended", refused, timed_out, other.hold_count, other.token))
    await _settle(mine.extend(5))
    remaining = await _settle(mine.remaining())
    seen.append(("extended", remaining is not None and 0 < remaining <= 5))
    await _settle(mine.release())
    seen.append(("inner release", mine.hold_count, await _settle(mine.locked())))
    await _settle(mine.release())
    seen.append(
        (
            "released",
            mine.hold_count,
            mine.token,
            await _settle(mine.locked()),
            await _settle(mine.owned()),
        )
    )
    with pytest.raises(LockNotOwnedError):
        await _settle(mine.release())
    seen.append("not owned")
    seen.append(("other takes", await _settle(other.acquire(blocking=False)), other.token > first))
    await _settle(other.release())
    seen.append(("inside", *(await _inside(mine)), mine.hold_count))
    assert await _settle(mine.acquire(blocking=False))
    seen.append(("forced", await _settle(force())))
    mine.ensure_held()  # locally it cannot know yet: the next call to Redis tells
    with pytest.raises(LockLostError) as lost:
        await _settle(mine.release())
    seen.append(("lost", lost.value.reason, mine.lost.is_set(), mine.hold_count, mine.token))
    with pytest.raises(RedisLockError) as after:
        mine.ensure_held()
    seen.append(("after loss", type(after.value).__name__))
    with pytest.raises(RedisLockError) as extended:
        await _settle(mine.extend(5))
    seen.append(("extend after loss", type(extended.value).__name__))
    return seen


#: What the story shows on every twin (so two twins that both drift also fail).
EXPECTED = [
    ("acquire", True, 1),
    ("re-enter", True, True, 2),
    ("owned, locked", True, False, True),
    ("remaining", True),
    ("contended", False, False, 0, None),
    ("extended", True),
    ("inner release", 1, True),
    ("released", 0, None, False, False),
    "not owned",
    ("other takes", True, True),
    ("inside", 1, True, 0),
    ("forced", True),
]


def _check(seen: list[Any]) -> None:
    assert seen[: len(EXPECTED)] == EXPECTED
    assert len(seen) == len(EXPECTED) + 3  # every step ran
    assert seen[-3][2:] == (True, 0, None)  # lost: reported, and no hold left


def _until_idle(clients: list[redis.Redis]) -> None:
    """Let the subscribers of ``clients`` drop their lingering channels and stop before
    the servers do: one whose server is gone keeps reconnecting until then, drawing
    redis-py's random backoff (which trips hypothesis in the tests that follow)."""
    give_up = time.monotonic() + 4 * LINGER
    while any(subscriber_for(c)._thread is not None for c in clients):
        if time.monotonic() > give_up:
            break
        time.sleep(0.05)


@pytest.fixture(scope="module")
def quorum_servers() -> Iterator[list[RedisServer]]:
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    for server in servers:
        server.cleanup()


@pytest_asyncio.fixture
async def aclient(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=redis_server.port, socket_timeout=5)
    yield client
    await aclose_background(client)
    await client.aclose()


async def test_redis_lock_twins_behave_alike(
    redis_client: redis.Redis, aclient: aioredis.Redis
) -> None:
    sync_seen = await scenario(
        lambda owner: RedisLock(redis_client, "parity", owner=owner),
        lambda: RedisLock.force_release(redis_client, "parity"),
    )
    redis_client.flushall()  # a server the tests started; the asyncio run starts afresh
    async_seen = await scenario(
        lambda owner: AsyncRedisLock(aclient, "parity", owner=owner),
        lambda: AsyncRedisLock.force_release(aclient, "parity"),
    )
    _check(sync_seen)
    assert async_seen == sync_seen


async def test_quorum_lock_twins_behave_alike(quorum_servers: list[RedisServer]) -> None:
    clients = [server.client(socket_timeout=5) for server in quorum_servers]
    for client in clients:
        client.flushall()  # servers this module started
    sync_locks: list[RedLock] = []

    def make_sync(owner: str | None) -> RedLock:
        sync_locks.append(RedLock(clients, "parity", owner=owner))
        return sync_locks[-1]

    sync_seen = await scenario(make_sync, lambda: RedLock.force_release(clients, "parity"))
    for lock in sync_locks:
        lock.close()
    for client in clients:
        client.flushall()
    aclients = [aioredis.Redis(port=server.port, socket_timeout=5) for server in quorum_servers]
    async_locks: list[AsyncRedLock] = []

    def make_async(owner: str | None) -> AsyncRedLock:
        async_locks.append(AsyncRedLock(aclients, "parity", owner=owner))
        return async_locks[-1]

    def force() -> Awaitable[bool]:
        return AsyncRedLock.force_release(aclients, "parity")

    try:
        async_seen = await scenario(make_async, force)
    finally:
        for alock in async_locks:
            alock.close()
            await alock.aclose()
        for aclient in aclients:
            await aclose_background(aclient)
            await aclient.aclose()
        _until_idle(clients)
        for client in clients:
            client.close()
    _check(sync_seen)
    assert async_seen == sync_seen
