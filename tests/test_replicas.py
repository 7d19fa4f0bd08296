"""The lock with replicas: ``min_replicas`` (WAIT) and Sentinel-managed clients.

Real servers only: a master with a replica (``--replicaof``), a replica frozen with
SIGSTOP so it stops acknowledging, and a Sentinel that fails the master over.
"""

from __future__ import annotations

import asyncio
import pickle
import signal
import time
from collections.abc import Iterator
from typing import Any, Callable

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


def wait_until(check: Callable[[], bool], within: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check}")


def link_up(master: RedisServer, replica: RedisServer) -> None:
    m, r = master.client(), replica.client()
    try:
        wait_until(
            lambda: (
                r.info("replication").get("master_link_status") == "up"
                and int(m.info("replication").get("connected_slaves", 0)) >= 1
            ),
            what="the replica's link to its master",
        )
    finally:
        m.close()
        r.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and one replica (module-scoped; tests that SIGSTOP it SIGCONT it after)."""
    with RedisServer() as master:
        with RedisServer(extra=["--replicaof", "127.0.0.1", str(master.port)]) as replica:
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
