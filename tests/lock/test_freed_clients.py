"""The clients a lock used, and those it opened for itself, go when nobody uses them.

A registry keyed weakly by a client (or a pool) must not keep its key alive through its
value: a user making a client per task would leak its pool and sockets each time. The
private clients a quorum lock or a watchdog opens are closed when their owner goes.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import weakref
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

from celery_redislock import AsyncRedLock, RedisLock, RedLock, aio_redlock
from celery_redislock._core import DEFAULT_PREFIX, LockKeys
from celery_redislock._faultproxy import FaultProxy
from celery_redislock._renewal import scheduler_for
from celery_redislock._replies import decode_release
from celery_redislock._scripts import scripts_for
from celery_redislock.testing import RedisServer

from .._support import wait_until


@pytest.fixture(scope="module")
def servers() -> Iterator[list[RedisServer]]:
    started = [RedisServer().start() for _ in range(3)]
    yield started
    for server in started:
        server.cleanup()


@pytest.fixture
def admins(servers: list[RedisServer]) -> Iterator[list[redis.Redis]]:
    clients = [server.client() for server in servers]
    yield clients
    for client in clients:
        client.close()


def named(admins: list[redis.Redis], name: str) -> list[int]:
    """How many connections named ``name`` each server has."""
    return [sum(1 for c in a.client_list() if c.get("name") == name) for a in admins]


def test_a_dropped_redlock_closes_its_private_connections(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """Its per-node clients (named as the caller's: same options) close their sockets
    when the lock goes, and the caller's clients stay usable."""
    mine = [redis.Redis(port=s.port, client_name="dropped-quorum") for s in servers]
    try:
        lock = RedLock(mine, "dropped-quorum", auto_renew=False)
        assert lock.acquire(blocking=False)
        lock.release()
        wait_until(lambda: min(named(admins, "dropped-quorum")) >= 1, what="connected")
        private = [weakref.ref(c) for c in lock._fast]
        del lock

        def freed() -> bool:
            gc.collect()  # (a node request's thread may still be letting go of its call)
            return all(ref() is None for ref in private)

        wait_until(freed, 5.0, what="the private clients collected")
        wait_until(lambda: named(admins, "dropped-quorum") == [0, 0, 0], what="closed")
        assert all(c.ping() for c in mine)
    finally:
        for client in mine:
            client.close()


async def test_an_async_redlock_s_aclose_closes_its_private_connections_only(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    mine = [redis.asyncio.Redis(port=s.port, client_name="aclosed-quorum") for s in servers]
    try:
        for _ in mine:
            lock = AsyncRedLock(mine, "aclosed-quorum", auto_renew=False)
            assert await lock.acquire(blocking=False)
            await lock.release()
            await lock.aclose()
            await lock.aclose()  # again: nothing left to close
        # Closed by aclose(), not left to their collection (the server sees a close on
        # its next turn).
        wait_until(lambda: named(admins, "aclosed-quorum") == [0, 0, 0], what="closed")
        assert all([await c.ping() for c in mine])  # the caller's own: still open
    finally:
        for client in mine:
            await client.aclose()


async def test_an_async_redlock_dropped_unclosed_closes_its_connections_in_its_loop(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    mine = [redis.asyncio.Redis(port=s.port, client_name="dropped-aquorum") for s in servers]
    try:
        lock = AsyncRedLock(mine, "dropped-aquorum", auto_renew=False)
        assert await lock.acquire(blocking=False)
        await lock.release()
        # The slowest node's share of the release may still be running (it holds the lock).
        await asyncio.gather(*aio_redlock._background_tasks, return_exceptions=True)
        private = [weakref.ref(c) for c in lock._fast]
        del lock
        gc.collect()
        assert all(ref() is None for ref in private)
        # Closed without waiting: the loop runs the transports' close (never timed here).
        while named(admins, "dropped-aquorum") != [0, 0, 0]:
            await asyncio.sleep(0.05)
    finally:
        for client in mine:
            await client.aclose()


def test_a_dropped_client_s_watchdog_closes_and_frees_its_private_client(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """The watchdog of a client's pool renews on a private client (same options): once
    nothing is held it closes its connections, and it goes with the pool."""
    client = redis.Redis(port=servers[0].port, client_name="dropped-watchdog")
    lock = RedisLock(client, "dropped-watchdog", ttl=3)
    assert lock.acquire(blocking=False)
    own = weakref.ref(scheduler_for(client)._client)
    lock.release()
    gone = weakref.ref(client)
    del client, lock
    gc.collect()
    assert gone() is None

    def freed() -> bool:
        gc.collect()  # (its thread lets it go when it exits, idle)
        return own() is None

    wait_until(freed, 10.0, what="the watchdog's private client collected")
    wait_until(lambda: named(admins[:1], "dropped-watchdog") == [0], what="closed")


def test_a_client_wrapped_on_its_instance_is_freed(servers: list[RedisServer]) -> None:
    """A wrapper set on the client itself (tracing) refers to it: what the scripts noted
    of it (to run them directly or not) must not keep it alive."""
    client = redis.Redis(port=servers[0].port)
    # A wrapper on the instance, referring to it (as a tracing integration's may).
    client.execute_command = functools.partial(redis.Redis.execute_command, client)  # type: ignore[method-assign]
    lock = RedisLock(client, "wrapped-instance", auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    gone = weakref.ref(client)
    client.close()
    del client, lock
    gc.collect()
    assert gone() is None


def test_scripts_are_kept_per_client_and_call_through_it(servers: list[RedisServer]) -> None:
    client = redis.Redis(port=servers[0].port)
    try:
        scripts = scripts_for(client)
        assert scripts is scripts_for(client)
        keys = LockKeys.for_name("kept", DEFAULT_PREFIX)
        acquire = [keys.lock, keys.fence, keys.waiters, keys.claims, keys.wake]
        assert scripts.acquire(keys=acquire, args=["me", 5000])[0] == 1
        assert decode_release(scripts.release(keys=keys.release_keys(), args=["me"])) == 0
    finally:
        client.close()


async def test_an_async_redlock_s_aclose_lets_a_node_request_in_flight_land_first(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """A release returns once a quorum answered; the slowest node's request goes on in the
    background. ``aclose()`` right after must not close that node's private client under
    it: the request would connect it again, and nothing would close it then."""
    with FaultProxy(servers[1]) as proxy:
        mine = [
            redis.asyncio.Redis(port=servers[0].port, client_name="inflight-quorum"),
            proxy.async_client(client_name="inflight-quorum"),
            redis.asyncio.Redis(port=servers[2].port, client_name="inflight-quorum"),
        ]
        try:
            lock = AsyncRedLock(mine, "inflight-quorum", auto_renew=False)
            assert await lock.acquire(blocking=False)
            released = proxy.count("release")
            proxy.inject("delay", "release", seconds=0.15)  # (under the node timeout)
            await lock.release()  # a quorum of two answered; the delayed node's goes on
            await lock.aclose()
            assert proxy.count("release") == released + 1  # it landed, then was closed
            wait_until(lambda: named(admins, "inflight-quorum") == [0, 0, 0], what="closed")
            assert not await mine[1].exists(lock.keys.lock)
        finally:
            for client in mine:
                await client.aclose()


def test_a_client_whose_lock_waited_is_freed_with_its_pool(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """A blocked acquire waits on its pool's subscriber, kept in a registry keyed weakly by
    the pool: the subscriber must not keep the pool (a client made per task) alive."""
    holder = RedisLock(admins[0], "waited-pool", auto_renew=False, owner="holder")
    assert holder.acquire(blocking=False)
    try:
        client = redis.Redis(port=servers[0].port, client_name="waited-pool")
        # Through a subscriber, not a lone waiter's box (a RedLock always waits so).
        lock = RedLock([client], "waited-pool", auto_renew=False, owner="other")
        assert not lock.acquire(timeout=0.2)
        pool = weakref.ref(client.connection_pool)
        del client, lock

        def freed() -> bool:
            gc.collect()  # (the subscriber lets its channel go after a while, idle)
            return pool() is None

        wait_until(freed, 15.0, what="the pool collected")
    finally:
        holder.release()


async def test_an_asyncio_client_whose_lock_waited_is_freed_with_its_pool(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    holder = RedisLock(admins[0], "awaited-pool", auto_renew=False, owner="holder")
    assert holder.acquire(blocking=False)
    try:
        client = redis.asyncio.Redis(port=servers[0].port, client_name="awaited-pool")
        lock = AsyncRedLock([client], "awaited-pool", auto_renew=False, owner="other")
        assert not await lock.acquire(timeout=0.2)
        await lock.aclose()
        pool = weakref.ref(client.connection_pool)
        await client.aclose()
        del client, lock
        for _ in range(300):  # (never timed: the subscriber's idle channel goes in a while)
            gc.collect()
            if pool() is None:
                break
            await asyncio.sleep(0.05)
        assert pool() is None
    finally:
        holder.release()


async def test_an_async_redlock_s_aclose_closes_every_private_client_if_one_fails(
    servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """One node's close failing (its connection's error) leaves none of the others open:
    they are closed all the same, and the first error is raised after."""
    mine = [redis.asyncio.Redis(port=s.port, client_name="afailed-quorum") for s in servers]
    try:
        lock = AsyncRedLock(mine, "afailed-quorum", auto_renew=False)
        assert await lock.acquire(blocking=False)
        await lock.release()
        await asyncio.gather(*aio_redlock._background_tasks, return_exceptions=True)
        first = lock._fast[0]

        async def failing_close() -> None:
            raise redis.ConnectionError("closing node 0 failed")

        first.aclose = failing_close
        with pytest.raises(redis.ConnectionError, match="node 0"):
            await lock.aclose()
        wait_until(lambda: named(admins, "afailed-quorum")[1:] == [0, 0], what="others closed")
        del first.aclose
        await first.aclose()
        await first.connection_pool.disconnect()
    finally:
        for client in mine:
            await client.aclose()
