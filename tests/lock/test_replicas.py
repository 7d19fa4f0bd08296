"""The lock with replicas: ``min_replicas`` (WAIT) and Sentinel-managed clients.

Real servers only: a master with a replica (``--replicaof``), a replica frozen with
SIGSTOP so it stops acknowledging, and a Sentinel that fails the master over.
"""

from __future__ import annotations

import asyncio
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from celery_redislock import (
    AsyncRedisLock,
    LockConfigurationError,
    LockLostError,
    RedisLock,
    RedisLockError,
)
from celery_redislock._errors import LockReplicationError
from celery_redislock.testing import RedisServer

from .._support import wait_until

#: A master starts a replica's (diskless) sync at once instead of waiting 5 s for more
#: replicas to join it (repl-diskless-sync-delay): there is only ever one replica here.
SYNC_AT_ONCE = ["--repl-diskless-sync-delay", "0"]


def link_up(master: RedisServer, replica: RedisServer) -> None:
    m, r = master.client(), replica.client()
    try:
        wait_until(
            lambda: (
                r.info("replication").get("master_link_status") == "up"
                and int(m.info("replication").get("connected_slaves", 0)) >= 1
            ),
            timeout=15,
            what="the replica's link to its master",
            ignore=(redis.RedisError,),
        )
    finally:
        m.close()
        r.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and one replica (module-scoped; tests that SIGSTOP it SIGCONT it after)."""
    with RedisServer(extra=SYNC_AT_ONCE) as master:
        replica_of = ["--replicaof", "127.0.0.1", str(master.port)]
        with RedisServer(extra=[*SYNC_AT_ONCE, *replica_of]) as replica:
            link_up(master, replica)
            yield master, replica


@pytest.fixture
def master_client(pair: tuple[RedisServer, RedisServer]) -> Iterator[redis.Redis]:
    master, _replica = pair
    client = master.client()
    client.flushall()  # our own server only
    yield client
    client.close()


class Frozen:
    """SIGSTOP a server we started for the block, SIGCONT it after."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    def __enter__(self) -> Frozen:
        self.server.signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.signal(signal.SIGCONT)


# --------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True, None])
def test_min_replicas_must_be_an_int_at_least_zero(master_client: redis.Redis, bad: Any) -> None:
    with pytest.raises(LockConfigurationError, match="min_replicas"):
        RedisLock(master_client, "x", min_replicas=bad)
    with pytest.raises(LockConfigurationError, match="min_replicas"):
        AsyncRedisLock(aioredis.Redis(), "x", min_replicas=bad)


@pytest.mark.parametrize("bad", [0, -0.5, 0.0001, float("nan"), float("inf"), "1", None])
def test_replica_timeout_must_be_at_least_a_millisecond(
    master_client: redis.Redis, bad: Any
) -> None:
    with pytest.raises(LockConfigurationError, match="replica_timeout"):
        RedisLock(master_client, "x", min_replicas=1, replica_timeout=bad)


def test_min_replicas_is_refused_on_a_cluster_client() -> None:
    from redis.cluster import RedisCluster

    # Never connects: the refusal happens before any I/O (no cluster needed).
    client = RedisCluster.__new__(RedisCluster)
    with pytest.raises(LockConfigurationError, match="min_replicas=1 is not supported"):
        RedisLock(client, "x", min_replicas=1)


def test_replication_error_is_a_lock_error_and_pickles() -> None:
    error = LockReplicationError(
        "m", name="n", owner="o", min_replicas=2, acknowledged=1, timeout=0.5
    )
    assert isinstance(error, RedisLockError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is LockReplicationError
    assert (copy.name, copy.owner, copy.min_replicas, copy.acknowledged, copy.timeout) == (
        "n",
        "o",
        2,
        1,
        0.5,
    )
    assert str(copy) == "m"


# --------------------------------------------------------------------- min_replicas


def test_min_replicas_1_acquires_and_the_replica_holds_the_lock(
    pair: tuple[RedisServer, RedisServer], master_client: redis.Redis
) -> None:
    _master, replica = pair
    lock = RedisLock(master_client, "acct:1", ttl=10, min_replicas=1)
    with lock:
        assert lock.acquire()  # re-entry is replicated too
        on_replica = replica.client()
        try:
            # WAIT returned 1: the replica already has the hash, no polling needed.
            assert on_replica.hget(lock.keys.lock, lock._current_owner()) == b"2"
            assert int(on_replica.get(lock.keys.fence) or 0) == lock.token
        finally:
            on_replica.close()
        lock.extend(10)
        lock.release()
    assert not master_client.exists(lock.keys.lock)


def test_an_unacknowledged_acquire_raises_and_leaves_no_lock(
    pair: tuple[RedisServer, RedisServer], master_client: redis.Redis
) -> None:
    _master, replica = pair
    lock = RedisLock(master_client, "acct:2", ttl=10, min_replicas=1, replica_timeout=0.2)
    with Frozen(replica):
        with pytest.raises(LockReplicationError) as caught:
            lock.acquire(blocking=False)
        assert not master_client.exists(lock.keys.lock)  # given back at once
        assert lock.hold_count == 0 and lock.token is None
    error = caught.value
    assert (error.min_replicas, error.acknowledged, error.timeout) == (1, 0, 0.2)
    assert "min_replicas=1" in str(error) and "only 0 acknowledged" in str(error)
    assert "0.2s" in str(error)
    # A waiter in line behind it is not stuck: the give-back was a real release.
    assert RedisLock(master_client, "acct:2", ttl=10).acquire(blocking=False)


def test_more_replicas_than_connected_is_refused_and_says_so(
    master_client: redis.Redis,
) -> None:
    lock = RedisLock(master_client, "acct:3", ttl=10, min_replicas=2, replica_timeout=0.05)
    with pytest.raises(LockReplicationError, match="reports 1 connected replicas"):
        with lock:
            pass
    assert not master_client.exists(lock.keys.lock)


def test_a_reentry_the_replicas_miss_gives_back_only_itself(
    pair: tuple[RedisServer, RedisServer], master_client: redis.Redis
) -> None:
    _master, replica = pair
    lock = RedisLock(master_client, "acct:4", ttl=10, min_replicas=1, replica_timeout=0.1)
    assert lock.acquire()
    with Frozen(replica):
        with pytest.raises(LockReplicationError):
            lock.acquire()
        assert lock.hold_count == 1
        assert master_client.hget(lock.keys.lock, lock._current_owner()) == b"1"
    lock.release()
    assert not master_client.exists(lock.keys.lock)


def test_renewals_the_replicas_miss_end_in_a_lost_hold(
    pair: tuple[RedisServer, RedisServer], master_client: redis.Redis
) -> None:
    _master, replica = pair
    lock = RedisLock(master_client, "acct:5", ttl=1.2, min_replicas=1, replica_timeout=0.1)
    plain = RedisLock(master_client, "acct:6", ttl=1.2)  # same watchdog, no min_replicas
    assert lock.acquire()
    assert plain.acquire()
    with Frozen(replica):
        # Renewed on the master every 0.4 s, but never acknowledged: the deadline does
        # not move, and past it the hold is lost.
        assert lock.lost.wait(6)
        assert lock.lost.reason == "unreachable"
        with pytest.raises(LockLostError):
            lock.ensure_held()
        plain.ensure_held()  # the hold without min_replicas kept being renewed
    plain.release()


def test_asyncio_min_replicas(pair: tuple[RedisServer, RedisServer]) -> None:
    master, replica = pair

    async def main() -> None:
        client = aioredis.Redis(port=master.port, socket_timeout=5)
        try:
            lock = AsyncRedisLock(client, "acct:7", ttl=10, min_replicas=1, replica_timeout=0.2)
            async with lock:
                await lock.extend(10)
            with Frozen(replica):
                with pytest.raises(LockReplicationError, match="only 0 acknowledged"):
                    await lock.acquire(blocking=False)
                assert not await client.exists(lock.keys.lock)
        finally:
            await client.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------- Sentinel


def test_sentinel_master_for_acquire_wait_release_and_failover() -> None:
    from celery_redislock.testing import RedisSentinel

    with (
        RedisServer(extra=SYNC_AT_ONCE) as master,
        RedisServer(extra=[*SYNC_AT_ONCE, "--replicaof", "127.0.0.1", str(master.port)]) as replica,
    ):
        link_up(master, replica)
        with RedisSentinel(master.port) as sentinel_server:
            sentinel = sentinel_server.sentinel()
            client = sentinel.master_for("m", socket_timeout=2.0)
            assert client.connection_pool.connection_kwargs.get("connection_pool") is not None

            # Acquire, wait (woken by the release through the Sentinel-managed pool), release.
            holder = RedisLock(client, "job", ttl=30, owner="holder")
            assert holder.acquire()
            waited: list[float] = []

            def wait() -> None:
                lock = RedisLock(client, "job", ttl=30)
                started = time.monotonic()
                assert lock.acquire(timeout=25)
                waited.append(time.monotonic() - started)
                lock.release()

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(0.3)
            holder.release()
            thread.join(30)
            assert waited and waited[0] < 15.0  # the release woke it, not the 30 s lease

            # A hold through the watchdog's own Sentinel-managed pool survives renewals.
            kept = RedisLock(client, "kept", ttl=1.5)
            assert kept.acquire()
            time.sleep(1.2)
            kept.ensure_held()

            # The asyncio twin through redis.asyncio's Sentinel.
            async def via_asyncio() -> None:
                from redis.asyncio.sentinel import Sentinel as AsyncSentinel

                from celery_redislock.aio import aclose_background

                found = AsyncSentinel([("127.0.0.1", sentinel_server.port)], socket_timeout=5)
                async_client = found.master_for("m", socket_timeout=2.0)
                try:
                    lock = AsyncRedisLock(async_client, "async-job", ttl=1.5)
                    async with lock:
                        await asyncio.sleep(1.2)  # past a renewal by the watchdog task
                        lock.ensure_held()
                    await aclose_background(async_client)
                finally:
                    await async_client.aclose()
                    for each in found.sentinels:  # its connections to the sentinel
                        await each.aclose()

            asyncio.run(via_asyncio())

            # Fail the master over while the hold is alive.
            probe = redis.Redis(port=sentinel_server.port, socket_timeout=5)
            try:
                wait_until(
                    lambda: len(probe.execute_command("SENTINEL", "REPLICAS", "m")) >= 1,
                    timeout=15,
                    what="the sentinel to discover the replica",
                    ignore=(redis.RedisError,),
                )
                probe.execute_command("SENTINEL", "FAILOVER", "m")
            finally:
                probe.close()
            wait_until(
                lambda: sentinel.discover_master("m")[1] == replica.port,
                timeout=20,
                ignore=(redis.RedisError,),
                what="the failover",
            )
            # Until the sentinel demotes the old master, clients still connected to it
            # can write there (a split-brain window Sentinel has by design). The sentinel
            # demotes it only some 10 s later (its INFO period, not configurable): the
            # test sends now what the sentinel sends then, in one transaction (REPLICAOF,
            # then CLIENT KILL of the normal and pub/sub clients), and waits for it.
            old = master.client()
            try:
                demote = old.pipeline(transaction=True)
                demote.execute_command("REPLICAOF", "127.0.0.1", replica.port)
                demote.execute_command("CLIENT", "KILL", "TYPE", "normal")
                demote.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                demote.execute()
                wait_until(
                    lambda: old.info("replication").get("role") == "slave",
                    timeout=20,
                    ignore=(redis.RedisError,),
                    what="the old master's demotion",
                )
            finally:
                old.close()
            # New acquires go to the new master (the pool reconnects on READONLY).
            after = RedisLock(client, "after", ttl=10)
            assert after.acquire(timeout=10)
            direct = replica.client()
            try:
                assert direct.exists(after.keys.lock)
            finally:
                direct.close()
            after.release()
            # The old hold is either still valid on the new master or reported lost:
            # never silently held.
            time.sleep(2.0)  # a few renewal intervals through the failover
            if kept.lost:
                with pytest.raises(LockLostError):
                    kept.ensure_held()
            else:
                kept.ensure_held()
                assert kept.owned()
                direct = replica.client()
                try:
                    assert direct.hexists(kept.keys.lock, kept._current_owner())
                finally:
                    direct.close()
                kept.release()
