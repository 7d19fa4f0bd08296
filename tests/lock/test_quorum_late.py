"""Quorum attempts whose reply never came, and which land on their node afterwards.

A node slower than ``node_timeout`` (a busy machine, a long GC-like pause, a stalled
socket) may run an attempt after its sender gave up on it. Whatever gives the attempt
back (the undo of a failed attempt, the release of a hold) may reach that node first:
the late attempt must then take nothing, or it leaves a hold nobody renews, which with
another node down blocks the majority for a whole lease. Real redis-servers; the late
arrival is made by the fault proxy holding the one attempt back.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

from celery_redislock import AsyncRedLock, LockQuorumError, RedLock, _scripts
from celery_redislock.testing import FaultProxy, RedisServer

NAME = "late"
KEY = "redislock:{" + NAME + "}"
STALL = 1.0  # how long the proxy holds the attempt back (node_timeout is 0.25)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[RedisServer]]:
    started = [RedisServer().start() for _ in range(3)]
    yield started
    for server in started:
        server.signal(signal.SIGCONT)
        server.cleanup()


@pytest.fixture
def proxy(servers: list[RedisServer]) -> Iterator[FaultProxy]:
    for server in servers:
        client = server.client(socket_timeout=5)
        client.flushall()  # servers this module started
        client.close()
    with FaultProxy(servers[2]) as found:
        yield found


@pytest.fixture
def nodes(servers: list[RedisServer], proxy: FaultProxy) -> Iterator[list[redis.Redis]]:
    """Clients of the two servers and of the proxy in front of the third, the scripts
    loaded (so that the attempt held back is not a NOSCRIPT round trip)."""
    clients = [servers[0].client(), servers[1].client(), proxy.client()]
    for client in clients:
        for script in ("acquire", "release"):
            client.script_load(_scripts.source(script))
    yield clients
    for client in clients:
        client.close()


def left_on(server: RedisServer) -> tuple[dict[bytes, bytes], int]:
    client = server.client(socket_timeout=5)
    try:
        return client.hgetall(KEY), client.pttl(KEY)  # type: ignore[return-value]
    finally:
        client.close()


def test_a_failed_attempt_that_lands_late_takes_nothing(
    servers: list[RedisServer], proxy: FaultProxy, nodes: list[redis.Redis]
) -> None:
    servers[1].signal(signal.SIGSTOP)  # one node down: the other two decide
    try:
        proxy.inject("stall", on="acquire", seconds=STALL)  # the third answers too late
        lock = RedLock(nodes, NAME, ttl=10, owner="A", node_timeout=0.25)
        with pytest.raises(LockQuorumError):
            lock.acquire(blocking=False)
        assert proxy.count("acquire") == 0  # still held back: it lands after the undo
        time.sleep(STALL + 0.5)
        assert proxy.count("acquire") == 1  # it did land on the node
        assert left_on(servers[2]) == ({}, -2)  # and took nothing there
        assert left_on(servers[0]) == ({}, -2)
        # The next owner gets the majority at once, not after A's lease of 10 s.
        other = RedLock([nodes[0], nodes[2]], NAME, ttl=10, owner="B")
        assert other.acquire(blocking=False)
        other.release()
    finally:
        servers[1].signal(signal.SIGCONT)


def test_a_hold_released_before_a_late_grant_lands_leaves_nothing(
    servers: list[RedisServer], proxy: FaultProxy, nodes: list[redis.Redis]
) -> None:
    proxy.inject("stall", on="acquire", seconds=STALL)
    lock = RedLock(nodes, NAME, ttl=10, owner="A", node_timeout=0.25)
    assert lock.acquire(blocking=False)  # nodes 0 and 1 granted; node 2 had not answered
    lock.release()  # reaches node 2 before its acquire does
    time.sleep(STALL + 0.5)
    assert proxy.count("acquire") == 1
    assert [left_on(s) for s in servers] == [({}, -2)] * 3
    # The owner takes it again afterwards: the void covers only the attempts before it.
    assert lock.acquire(blocking=False)
    assert all(left_on(s)[0].get(b"A") == b"1" for s in servers)
    lock.release()


async def test_async_a_failed_attempt_that_lands_late_takes_nothing(
    servers: list[RedisServer], proxy: FaultProxy, nodes: list[redis.Redis]
) -> None:
    urls = [servers[0].url, servers[1].url, proxy.url]
    clients = [redis.asyncio.Redis.from_url(url, socket_timeout=5) for url in urls]
    lock = AsyncRedLock(clients, NAME, ttl=10, owner="A", node_timeout=0.25)
    servers[1].signal(signal.SIGSTOP)
    try:
        proxy.inject("stall", on="acquire", seconds=STALL)
        with pytest.raises(LockQuorumError):
            await lock.acquire(blocking=False)
        assert proxy.count("acquire") == 0
        await asyncio.sleep(STALL + 0.5)
        assert proxy.count("acquire") == 1
        assert left_on(servers[2]) == ({}, -2)
        assert left_on(servers[0]) == ({}, -2)
    finally:
        servers[1].signal(signal.SIGCONT)
        await lock.aclose()  # its private per-node clients
        for client in clients:
            await client.aclose()


def test_a_task_attempt_that_lands_late_takes_nothing(
    servers: list[RedisServer], proxy: FaultProxy, nodes: list[redis.Redis]
) -> None:
    """The Celery layer's quorum lock (one take per delivery): a take that fails is
    re-queued, and must not leave the key held behind it for a lease."""
    from celery_redislock.settings import LockOptions
    from celery_redislock.task import QuorumTaskLock

    servers[1].signal(signal.SIGSTOP)
    try:
        proxy.inject("stall", on="acquire", seconds=STALL)
        take = QuorumTaskLock(
            nodes, NAME, task_id="t-1", options=LockOptions(ttl=10), node_timeout=0.25
        )
        with pytest.raises(LockQuorumError):
            take.take()
        time.sleep(STALL + 0.5)
        assert proxy.count("acquire") == 1
        assert left_on(servers[2]) == ({}, -2)
        assert left_on(servers[0]) == ({}, -2)
    finally:
        servers[1].signal(signal.SIGCONT)


def test_an_attempt_number_at_or_below_the_void_record_is_refused(
    servers: list[RedisServer],
) -> None:
    """acquire.lua's contract for ARGV[8], on one node (no proxy needed)."""
    from celery_redislock._scripts import scripts_for

    client: redis.Redis = servers[0].client(socket_timeout=5)
    client.flushall()
    scripts = scripts_for(client)
    void = KEY + ":void:x:A"
    keys = [KEY, KEY + ":fence", KEY + ":waiters", KEY + ":claims", KEY + ":waiters:wake", void]
    client.set(void, 3)
    assert scripts.acquire(keys=keys, args=["A", 5000, "", "", "", "", "", 3]) == [0, 0]
    assert client.exists(KEY) == 0
    assert scripts.acquire(keys=keys, args=["A", 5000, "", "", "", "", "", 4])[0] == 1
    client.set(void, "not a number")  # a forged record refuses nothing it should not
    assert scripts.acquire(keys=keys, args=["A", 5000, "", "", "", "", "", 5])[0] == 1
    client.close()
