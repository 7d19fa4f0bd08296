"""AsyncRedisLock: the same semantics over redis.asyncio, per-task owners, cancellation safety."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from celery_redislock import (
    AsyncRedisLock,
    AsyncRedLock,
    LockConfigurationError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
    RedisLock,
)
from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisServer

from .test_lock import BAD_ACQUIRE_CALLS, in_thread


def _public(cls: type) -> dict[str, object]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    return {n: inspect.getattr_static(cls, n) for n in names}


#: The methods that talk to Redis: awaited on the asyncio twin, plain on the sync one.
IO_METHODS = {"acquire", "release", "extend", "locked", "owned", "remaining", "force_release"}


def _returns_awaitable(fn: object) -> bool:
    """A coroutine function, or a plain method returning its coroutine (the owner-checked
    ones: they resolve the owner when called, then return the coroutine)."""
    if inspect.iscoroutinefunction(fn):
        return True
    annotation = inspect.signature(fn).return_annotation  # type: ignore[arg-type]
    return str(annotation).startswith(("Coroutine[", "Awaitable["))


def test_sync_and_async_twins_have_the_same_public_surface() -> None:
    sync, aio = _public(RedisLock), _public(AsyncRedisLock)
    assert sorted(sync) == sorted(aio)
    awaited: dict[str, set[str]] = {"sync": set(), "aio": set()}
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
        for side, fn in (("sync", sync_fn), ("aio", aio_fn)):
            if _returns_awaitable(fn):
                awaited[side].add(name)
    assert awaited == {"sync": set(), "aio": IO_METHODS}
    sync_init = inspect.signature(RedisLock.__init__).parameters
    assert sync_init == inspect.signature(AsyncRedisLock.__init__).parameters
    for side in (AsyncRedisLock, AsyncRedLock):  # `async with` resolves owners the same way
        assert _returns_awaitable(side.__aenter__) and _returns_awaitable(side.__aexit__)


@pytest.mark.parametrize(("kwargs", "argument"), BAD_ACQUIRE_CALLS)
async def test_bad_acquire_arguments_are_refused_when_called(
    aclient: aioredis.Redis, kwargs: dict[str, Any], argument: str
) -> None:
    """At the call, before a coroutine exists (so ``create_task(lock.acquire(...))``
    fails in the caller), and nothing reaches Redis."""
    lock = AsyncRedisLock(aclient, "job")
    await aclient.config_resetstat()
    with pytest.raises(LockConfigurationError, match=f"^{argument} must"):
        lock.acquire(**kwargs)
    stats = await aclient.info("commandstats")
    assert "cmdstat_evalsha" not in stats and not await lock.locked()


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


@pytest_asyncio.fixture
async def own_aclient(
    redis_server_factory: Callable[..., RedisServer],
) -> AsyncIterator[aioredis.Redis]:
    """A client of a server of its own: for tests that count the server's commands (no
    other test's leftover renewal or retry can add to them)."""
    server = redis_server_factory()
    client = aioredis.Redis(port=server.port, socket_timeout=5)
    yield client
    await aclose_background(client)
    await client.aclose()


async def test_a_release_grants_the_first_waiter_directly(own_aclient: aioredis.Redis) -> None:
    """As for RedisLock: the waiter's reader alone is told, with the token, and the
    waiter (the default owner: its task) holds the lock without another round trip;
    the watchdog lengthens the grant's lease; re-entries count as usual."""
    aclient = own_aclient
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


# ------------------------------------------- the owner of an acquire run in another task

#: Ways to run an awaitable that put ``lock.acquire()`` in a task of its own (wait_for
#: too, before Python 3.12): each must still acquire for the task that called acquire().
RUN_ELSEWHERE: dict[str, Callable[[Awaitable[bool]], Awaitable[Any]]] = {
    "wait_for": lambda acquiring: asyncio.wait_for(acquiring, 10),
    "create_task": asyncio.ensure_future,
    "gather": lambda acquiring: asyncio.gather(acquiring, asyncio.sleep(0)),
    "shield": asyncio.shield,
}


@pytest.mark.parametrize("run", sorted(RUN_ELSEWHERE))
async def test_an_acquire_run_in_another_task_holds_for_the_calling_task(
    aclient: aioredis.Redis, run: str
) -> None:
    """``await asyncio.wait_for(lock.acquire(), t)`` and friends, then ``release()``:
    the hold is the caller's (the acquire used to hold for the task that ran it, so the
    caller's release raised LockNotOwnedError and the hold was renewed for ever)."""
    lock = AsyncRedisLock(aclient, "job", ttl=5)
    result = await RUN_ELSEWHERE[run](lock.acquire())
    assert result is True or result == [True, None]
    assert lock.hold_count == 1 and await lock.owned()
    await lock.release()
    assert lock.hold_count == 0 and not await lock.locked()


async def test_a_wait_for_timeout_while_the_acquire_is_at_redis_gives_the_hold_back(
    aclient: aioredis.Redis,
) -> None:
    """The timeout cancels the task running the acquire after its script was sent but
    before it ran (writes are paused at the server): the script takes the lock when
    the pause ends, and the cancelled acquire gives it back, for the caller's owner."""
    lock = AsyncRedisLock(aclient, "job", ttl=5)
    assert await lock.acquire(blocking=False)  # loads the script; released below
    await lock.release()
    await aclient.client_pause(1000, all=False)  # scripts wait; reads do not
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(lock.acquire(), 0.1)
    assert time.monotonic() - started >= 0.5  # it waited for the paused script to finish
    assert await aclient.get(lock.keys.fence) == b"2"  # the script did take the lock ...
    assert not await aclient.exists(lock.keys.lock)  # ... and it was given back
    assert lock.hold_count == 0 and not lock._holds
    assert await asyncio.wait_for(lock.acquire(), 10)  # and the caller takes it again
    await lock.release()


@pytest.mark.parametrize("contended", [False, True])
async def test_an_acquire_in_another_task_cancelled_at_any_point_leaves_no_hold(
    aclient: aioredis.Redis, contended: bool
) -> None:
    """As for explicit owners above, with the default owner: the acquire runs in a task
    of its own (as wait_for's does on timeout) but holds, or gives back, for the caller."""
    holder = AsyncRedisLock(aclient, "job", ttl=30, auto_renew=False, owner="holder")
    outcomes = {"cancelled": 0, "acquired": 0}
    for steps in range(0, 60):
        if contended:
            await holder.acquire()
        lock = AsyncRedisLock(aclient, "job", ttl=5)
        task = asyncio.create_task(lock.acquire(timeout=10))
        await _step(steps)
        if contended and steps % 3 == 0:
            await holder.release()
        task.cancel()
        try:
            acquired = await task
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1
            assert lock.hold_count == 0, f"hold recorded after a cancel at {steps} steps"
        else:
            outcomes["acquired"] += 1
            assert acquired and lock.hold_count == 1 and await lock.owned()
            await lock.release()
        if contended and await holder.owned():
            await holder.release()
        assert not await aclient.exists(lock.keys.lock), steps
        assert not await aclient.exists(lock.keys.waiters), steps
    assert outcomes["cancelled"] > 0  # the cancellation really landed at various points
    assert contended or outcomes["acquired"] > 0  # and some acquires finished first


async def test_one_tasks_concurrent_acquires_take_turns(aclient: aioredis.Redis) -> None:
    """A task that runs two acquires at once (gather, create_task) holds the lock twice:
    they take turns, so the second re-enters once the first holds it; a non-blocking one
    that meets a running one returns False at once. No loss is reported on the way."""
    lock = AsyncRedisLock(aclient, "job", ttl=5)
    losses: list[str] = []
    lock.on_lost(lambda _lock, error: losses.append(error.reason))
    holder = AsyncRedisLock(aclient, "job", ttl=30, auto_renew=False, owner="holder")
    await holder.acquire()
    both = asyncio.gather(lock.acquire(timeout=10), lock.acquire(timeout=10))
    in_line = asyncio.ensure_future(lock.acquire(timeout=10))  # a third, after them
    await asyncio.sleep(0.2)
    assert await lock.acquire(blocking=False) is False  # its turn has not come
    await holder.release()
    assert await asyncio.wait_for(both, 10) == [True, True]
    assert await asyncio.wait_for(in_line, 10) is True
    owner = lock._current_owner()
    assert lock.hold_count == 3 and await aclient.hget(lock.keys.lock, owner) == b"3"
    for _ in range(3):
        await lock.release()
    assert not await aclient.exists(lock.keys.lock)

    # The task's own blocked acquire (granted directly) while one it handed off waits too.
    await holder.acquire()
    handed_off = asyncio.create_task(lock.acquire(timeout=10))

    async def release_soon() -> None:
        await asyncio.sleep(0.2)
        await holder.release()

    releasing = asyncio.ensure_future(release_soon())
    assert await lock.acquire(timeout=10) is True
    assert await asyncio.wait_for(handed_off, 10) is True
    await releasing
    assert lock.hold_count == 2 and await aclient.hget(lock.keys.lock, owner) == b"2"
    await lock.release()
    await lock.release()
    assert not await aclient.exists(lock.keys.lock)
    assert losses == [] and not lock.lost


async def test_tasks_sharing_one_handle_never_overlap(aclient: aioredis.Redis) -> None:
    """Each task is its own owner, however its acquire is run: one handle shared by
    five tasks still lets one in at a time, and every section runs."""
    lock = AsyncRedisLock(aclient, "shared", ttl=5)
    rounds = 12
    inside: list[int] = []
    sections: list[tuple[int, int, int]] = []
    runners = [
        lambda: lock.acquire(timeout=20),
        lambda: asyncio.wait_for(lock.acquire(timeout=20), 30),
        lambda: asyncio.ensure_future(lock.acquire(timeout=20)),
        lambda: asyncio.shield(lock.acquire(timeout=20)),
    ]

    async def worker(n: int) -> None:
        for i in range(rounds):
            assert await runners[(n + i) % len(runners)]() is True
            try:
                inside.append(n)
                assert len(inside) == 1, f"{inside} inside at once"
                token = lock.token
                assert token is not None
                sections.append((token, n, i))
                await asyncio.sleep(0.002)
            finally:
                inside.remove(n)
                await lock.release()

    await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(5))), 120)
    assert sorted((n, i) for _, n, i in sections) == [
        (n, i) for n in range(5) for i in range(rounds)
    ]
    tokens = [t for t, _, _ in sections]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert not await aclient.exists(lock.keys.lock)


async def test_a_hold_whose_task_ended_is_not_renewed_for_ever(aclient: aioredis.Redis) -> None:
    """A task that ends holding the lock (default owner) can never release it: the
    watchdog stops renewing it, reports it lost ("abandoned"), and it expires with its
    lease. A hold of an explicit owner outlives the task that took it."""
    lock = AsyncRedisLock(aclient, "orphan", ttl=0.6)
    shared = AsyncRedisLock(aclient, "kept", ttl=0.6, owner="job-1")
    losses: list[str] = []
    lock.on_lost(lambda _lock, error: losses.append(error.reason))

    async def forgetful() -> None:
        assert await lock.acquire() and await shared.acquire()

    await asyncio.create_task(forgetful())
    assert await lock.locked()
    for _ in range(100):
        if not await aclient.exists(lock.keys.lock):
            break
        await asyncio.sleep(0.05)
    assert not await aclient.exists(lock.keys.lock)  # was renewed for ever
    assert losses == ["abandoned"] and not lock._holds
    assert await AsyncRedisLock(aclient, "orphan", owner="next").acquire(blocking=False)
    assert await shared.owned()  # many leases later: still renewed
    await shared.release()


def test_an_acquire_called_outside_any_task_is_the_calling_threads(
    redis_server: RedisServer,
) -> None:
    """A thread that drives a loop in another thread (``run_coroutine_threadsafe``)
    calls acquire() and release() outside any task: both resolve to that thread's
    owner, so they match, as its lock's properties do."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever)
    runner.start()

    def on_loop(awaitable: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(awaitable, loop).result(20)  # type: ignore[arg-type]

    client = aioredis.Redis(port=redis_server.port, socket_timeout=5)
    try:
        lock = AsyncRedisLock(client, "bridged", ttl=5)
        assert on_loop(lock.acquire()) is True
        assert lock.hold_count == 1 and on_loop(lock.owned()) is True
        # Another thread is another owner.
        assert in_thread(lambda: on_loop(lock.acquire(blocking=False))) is False
        on_loop(lock.release())
        assert lock.hold_count == 0 and on_loop(lock.locked()) is False
    finally:
        on_loop(aclose_background(client))
        on_loop(client.aclose())
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


async def test_a_release_that_cannot_reach_redis_stops_renewing_and_is_retried(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """The asyncio twin of test_lock's: the last hold's release returns, the hold stops
    renewing at once, and the release lands in the background once Redis answers."""
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff

    from celery_redislock import signals
    from celery_redislock._deferred import pending_async

    server = redis_server_factory()
    client = aioredis.Redis(
        host="127.0.0.1", port=server.port, socket_timeout=0.3, retry=AsyncRetry(NoBackoff(), 0)
    )
    lock = AsyncRedisLock(client, "job", ttl=3)
    failed: list[str] = []
    receiver = signals.lock_release_failed.connect(lambda sender, owner, **_: failed.append(owner))
    try:
        assert await lock.acquire()
        server.signal(19)  # SIGSTOP
        try:
            await lock.release()  # does not raise
            assert lock.hold_count == 0 and len(failed) == 1
        finally:
            server.signal(18)  # SIGCONT
        for _ in range(100):
            if not pending_async():
                break
            await asyncio.sleep(0.05)
        assert not pending_async()
        assert not await client.exists(lock.keys.lock)  # released long before the lease
    finally:
        signals.lock_release_failed.disconnect(receiver)
        await aclose_background(client)
        await client.aclose()
