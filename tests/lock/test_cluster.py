"""The lock through Redis Cluster clients, against a real local three-master cluster.

Wake-ups travel over sharded pub/sub (SPUBLISH/SSUBSCRIBE) on the node that owns the
lock's slot; renewal batches go per slot to their node; fencing works when the written
key shares the resource's hash tag.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster

from celery_redislock import AsyncRedisLock, FencedResource, LockConfigurationError, RedisLock
from celery_redislock._core import LockKeys
from celery_redislock._scripts import PUBLISH_CALL, SPUBLISH_CALL, scripts_for, sharded_source
from celery_redislock._scripts import source as lua_source
from celery_redislock._waiting import subscriber_for
from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisClusterServers


@pytest.fixture
def cluster(redis_cluster: RedisClusterServers) -> Any:
    redis_cluster.flushall()  # only the servers this module started
    client = redis_cluster.client()
    yield client
    client.close()


def node_of(client: RedisCluster, name: str) -> str:
    return str(client.get_node_from_key(LockKeys.for_name(name).lock).name)


def names_on_every_node(client: RedisCluster, per_node: int = 1) -> list[str]:
    """Lock names whose slots land on each of the cluster's masters."""
    found: dict[str, list[str]] = {}
    i = 0
    while len(found) < 3 or min(len(v) for v in found.values()) < per_node:
        name = f"acct:{i}"
        found.setdefault(node_of(client, name), []).append(name)
        i += 1
    return [n for names in found.values() for n in names[:per_node]]


# --------------------------------------------------------------------- scripts


def test_cluster_scripts_publish_sharded_and_nothing_else_changes() -> None:
    # grant.lua (prepended to both): a grant and a direct grant; each script: a wake-up ("1").
    for name, calls in (("release", 3), ("handoff", 3)):
        classic, sharded = lua_source(name), sharded_source(name)
        assert classic.count(PUBLISH_CALL) == calls
        assert sharded.count(PUBLISH_CALL) == 0
        assert sharded.count(SPUBLISH_CALL) == calls
        assert sharded.replace(SPUBLISH_CALL, PUBLISH_CALL) == classic
    # No other script publishes, in any spelling.
    for name in ("acquire", "renew", "fence", "park", "sweep", "rate"):
        assert "publish'" not in lua_source(name).replace(" ", "")
        assert sharded_source(name) == lua_source(name)


def test_cluster_client_gets_sharded_scripts(cluster: RedisCluster) -> None:
    scripts = scripts_for(cluster)
    assert scripts.sharded
    assert SPUBLISH_CALL in scripts.release.script


# --------------------------------------------------------------------- the basics


def test_acquire_release_reentry_and_tokens_on_every_node(cluster: RedisCluster) -> None:
    names = names_on_every_node(cluster)
    assert len({node_of(cluster, n) for n in names}) == 3  # three different masters
    for name in names:
        lock = RedisLock(cluster, name, ttl=10)
        tokens = []
        for _ in range(3):
            assert lock.acquire(blocking=False)
            assert lock.acquire(blocking=False)  # re-entry keeps the token
            assert lock.hold_count == 2 and lock.server_hold_count == 2
            assert lock.owned() and lock.locked()
            tokens.append(lock.token)
            lock.release()
            assert lock.locked()
            lock.release()
            assert not lock.locked()
        assert tokens == sorted(tokens) and len(set(tokens)) == 3
        # The lock's keys all live on the node that owns its slot.
        node = cluster.get_node_from_key(LockKeys.for_name(name).lock)
        direct = cluster.get_redis_connection(node)
        assert direct.get(LockKeys.for_name(name).fence) == str(tokens[-1]).encode()


def test_contention_and_force_release(cluster: RedisCluster) -> None:
    name = names_on_every_node(cluster)[1]
    a = RedisLock(cluster, name, ttl=10, owner="a")
    b = RedisLock(cluster, name, ttl=10, owner="b")
    assert a.acquire(blocking=False)
    assert not b.acquire(blocking=False)
    assert not b.acquire(timeout=0.2)
    assert RedisLock.force_release(cluster, name)
    assert b.acquire(blocking=False)
    b.release()


def wait_then_report(ports: list[int], name: str, result_key: str) -> None:
    """Block on ``name`` (held elsewhere with a long TTL) and report how long it took."""
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports])
    lock = RedisLock(client, name, ttl=30)
    client.rpush(result_key + ":ready", "1")
    started = time.monotonic()
    assert lock.acquire(timeout=25)
    client.rpush(result_key, f"{time.monotonic() - started!r} {lock.token}")
    lock.release()
    client.close()


def test_release_wakes_a_waiter_in_another_process_via_sharded_pubsub(
    redis_cluster: RedisClusterServers, cluster: RedisCluster
) -> None:
    name = names_on_every_node(cluster)[2]
    holder = RedisLock(cluster, name, ttl=30)
    assert holder.acquire()
    result = "{" + name + "}:result"  # same slot as the lock: one node for the test's keys
    proc = multiprocessing.get_context("spawn").Process(
        target=wait_then_report, args=(redis_cluster.ports, name, result)
    )
    proc.start()
    try:
        assert cluster.blpop([result + ":ready"], timeout=20)
        # Wait until the waiter is subscribed on the lock's node (sharded channel).
        node = cluster.get_node_from_key(LockKeys.for_name(name).channel)
        direct = cluster.get_redis_connection(node)
        channel = LockKeys.for_name(name).channel
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            numsub = direct.execute_command("PUBSUB", "SHARDNUMSUB", channel)
            counts = dict(zip(numsub[::2], numsub[1::2]))
            if counts.get(channel, 0) >= 1:
                break
            time.sleep(0.02)
        assert counts.get(channel, 0) >= 1
        # Classic pub/sub has no subscriber: the wake-up must come over SPUBLISH.
        assert direct.execute_command("PUBSUB", "NUMSUB", channel)[1] == 0
        time.sleep(0.2)
        holder.release()
        reply = cluster.blpop([result], timeout=20)
        assert reply is not None
        waited, token = reply[1].decode().split()
        # Woken by the release, far ahead of the holder's 30 s lease.
        assert float(waited) < 15.0
        assert int(token) > 1  # a fresh holding after the holder's
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_release_wakes_a_waiter_thread_on_each_node(cluster: RedisCluster) -> None:
    names = names_on_every_node(cluster)
    holders = [RedisLock(cluster, n, ttl=30, owner=f"h{i}") for i, n in enumerate(names)]
    for h in holders:
        assert h.acquire()
    waited: dict[str, float] = {}

    def wait(name: str) -> None:
        lock = RedisLock(cluster, name, ttl=30)
        started = time.monotonic()
        assert lock.acquire(timeout=25)
        waited[name] = time.monotonic() - started
        lock.release()

    threads = [threading.Thread(target=wait, args=(n,)) for n in names]
    for t in threads:
        t.start()
    # Each waiter is registered with the subscriber of its own node.
    subscribers = {id(subscriber_for(cluster, LockKeys.for_name(n).channel)) for n in names}
    assert len(subscribers) == 3
    time.sleep(0.3)
    for h in holders:
        h.release()
    for t in threads:
        t.join(30)
    assert sorted(waited) == sorted(names)
    assert max(waited.values()) < 15.0  # not the 30 s lease: the releases woke them


# --------------------------------------------------------------------- renewal


def test_watchdog_keeps_locks_on_every_node_past_several_ttls(cluster: RedisCluster) -> None:
    names = names_on_every_node(cluster, per_node=2)
    locks = [RedisLock(cluster, n, ttl=0.6) for n in names]
    for lock in locks:
        assert lock.acquire(blocking=False)
    time.sleep(2.2)  # more than three leases
    for lock in locks:
        lock.ensure_held()
        assert lock.owned()
        assert not lock.lost
        lock.release()


def test_watchdog_reports_a_deleted_lock_on_a_cluster(cluster: RedisCluster) -> None:
    name = names_on_every_node(cluster)[0]
    lock = RedisLock(cluster, name, ttl=0.6)
    assert lock.acquire()
    cluster.delete(LockKeys.for_name(name).lock)
    assert lock.lost.wait(5)
    assert lock.lost.reason == "expired"


# --------------------------------------------------------------------- exclusion


def hammer(ports: list[int], name: str, iterations: int, log_key: str) -> None:
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports])
    lock = RedisLock(client, name, ttl=10)
    counter = "{" + name + "}:counter"
    for _ in range(iterations):
        with lock:
            enter = time.monotonic()
            value = int(client.get(counter) or 0)
            time.sleep(0.0005)
            client.set(counter, value + 1)
            leave = time.monotonic()
            client.rpush(log_key, f"{os.getpid()} {enter!r} {leave!r} {lock.token}")
    client.close()


def test_processes_never_overlap_on_a_cluster(
    redis_cluster: RedisClusterServers, cluster: RedisCluster
) -> None:
    processes, iterations = 4, 25
    name = "counter"
    log_key = "{" + name + "}:log"
    ctx = multiprocessing.get_context("spawn")
    workers = [
        ctx.Process(target=hammer, args=(redis_cluster.ports, name, iterations, log_key))
        for _ in range(processes)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(90)
    assert [w.exitcode for w in workers] == [0] * processes
    sections = []
    for raw in cluster.lrange(log_key, 0, -1):
        pid, enter, leave, token = raw.decode().split()
        sections.append((float(enter), float(leave), int(pid), int(token)))
    assert len(sections) == processes * iterations
    assert len({s[2] for s in sections}) == processes
    sections.sort()
    assert [(a, b) for a, b in zip(sections, sections[1:]) if b[0] < a[1]] == []
    tokens = [s[3] for s in sections]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert int(cluster.get("{" + name + "}:counter") or 0) == processes * iterations


# --------------------------------------------------------------------- asyncio


def test_asyncio_lock_on_the_asyncio_cluster_client(redis_cluster: RedisClusterServers) -> None:
    async def main() -> None:
        client: AsyncRedisCluster = redis_cluster.async_client()
        try:
            sync = redis_cluster.client()
            names = names_on_every_node(sync)
            sync.close()
            for name in names:
                lock = AsyncRedisLock(client, name, ttl=0.6)
                async with lock:
                    first = lock.token
                    assert await lock.acquire(blocking=False)  # re-entry
                    assert lock.token == first
                    await lock.release()
                    await asyncio.sleep(1.5)  # past two leases: the watchdog renews
                    lock.ensure_held()
                    assert await lock.owned()
                assert not await lock.locked()

            # Wake-on-release across tasks through sharded pub/sub, on every node.
            async def wait(name: str) -> float:
                waiter = AsyncRedisLock(client, name, ttl=30)
                started = time.monotonic()
                assert await waiter.acquire(timeout=25)
                took = time.monotonic() - started
                await waiter.release()
                return took

            holders = [AsyncRedisLock(client, n, ttl=30, owner=f"h{n}") for n in names]
            for h in holders:
                assert await h.acquire()
            tasks = [asyncio.ensure_future(wait(n)) for n in names]
            await asyncio.sleep(0.3)
            for h in holders:
                await h.release()
            waited = await asyncio.gather(*tasks)
            assert max(waited) < 15.0
            await aclose_background(client)
        finally:
            await client.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------- fencing


def test_fenced_resource_on_a_cluster(cluster: RedisCluster) -> None:
    name = names_on_every_node(cluster)[0]
    lock = RedisLock(cluster, name, ttl=10, owner="writer")
    resource = FencedResource(cluster, "{ledger}")
    with lock:
        stale = lock.token
    with lock:
        token = lock.token
        assert stale is not None and token is not None and token > stale
        assert resource.write(token, "{ledger}:balance", "100")
        assert resource.admit(token)
    assert not resource.write(stale, "{ledger}:balance", "1")  # an older holder: refused
    assert cluster.get("{ledger}:balance") == b"100"
    assert resource.highest() == token
    # A key in another slot cannot be written atomically with the token: refused, named.
    other = "balance"
    assert cluster.keyslot(other) != cluster.keyslot(resource.key)
    with pytest.raises(LockConfigurationError, match="key 'balance'"):
        resource.write(token, other, "5")
    assert cluster.get(other) is None


# --------------------------------------------------------------------- a slot that moves


def shard_subscribers(client: RedisCluster, node: Any, channel: bytes) -> int:
    numsub = client.get_redis_connection(node).execute_command("PUBSUB", "SHARDNUMSUB", channel)
    return int(dict(zip(numsub[::2], numsub[1::2])).get(channel, 0))


def move_slot(client: RedisCluster, slot: int, source: Any, target: Any) -> None:
    """Migrate one slot (and its keys) from ``source`` to ``target``, as resharding does."""
    src = client.get_redis_connection(source)
    dst = client.get_redis_connection(target)
    src_id = src.execute_command("CLUSTER", "MYID").decode()
    dst_id = dst.execute_command("CLUSTER", "MYID").decode()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)
    others = [n for n in client.get_primaries() if n not in (source, target)]
    for node in [target, source, *others]:
        client.get_redis_connection(node).execute_command(
            "CLUSTER", "SETSLOT", slot, "NODE", dst_id
        )


def test_a_waiter_follows_its_channel_when_the_slot_moves(cluster: RedisCluster) -> None:
    name = names_on_every_node(cluster)[0]
    keys = LockKeys.for_name(name)
    holder = RedisLock(cluster, name, ttl=30, owner="holder")
    assert holder.acquire()
    slot = cluster.keyslot(keys.lock)
    source = cluster.get_node_from_key(keys.lock)
    target = next(n for n in cluster.get_primaries() if n.name != source.name)
    waited: list[float] = []

    def wait() -> None:
        lock = RedisLock(cluster, name, ttl=30)
        started = time.monotonic()
        assert lock.acquire(timeout=25)
        waited.append(time.monotonic() - started)
        lock.release()

    thread = threading.Thread(target=wait)
    thread.start()
    deadline = time.monotonic() + 10
    while shard_subscribers(cluster, source, keys.channel) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shard_subscribers(cluster, source, keys.channel) == 1
    move_slot(cluster, slot, source, target)
    # The source node ended the sharded subscription (a sunsubscribe push); the waiter
    # retried and subscribed again on the node that owns the slot now.
    deadline = time.monotonic() + 10
    while shard_subscribers(cluster, target, keys.channel) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shard_subscribers(cluster, target, keys.channel) == 1
    assert cluster.get_node_from_key(keys.lock).name == target.name
    holder.release()
    thread.join(30)
    assert waited and waited[0] < 15.0  # woken by the release, not the 30 s lease
