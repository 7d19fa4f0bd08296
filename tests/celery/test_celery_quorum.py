"""LockedTask on a quorum of masters (``redislock_urls``), with a real prefork worker."""

from __future__ import annotations

import random
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import CeleryProcess, wait_until, worker
from ..conftest import empty


@pytest.fixture(scope="module")
def lock_nodes() -> Iterator[list[RedisServer]]:
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    for server in servers:
        server.signal(signal.SIGCONT)
        server.cleanup()


@pytest.fixture(scope="module")
def quorum_worker(
    celery_broker: RedisServer,
    lock_nodes: list[RedisServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CeleryProcess]:
    empty(celery_broker)
    log: Path = tmp_path_factory.mktemp("quorum") / "worker.log"
    urls = ",".join(s.url for s in lock_nodes)
    proc = worker(
        celery_broker.url, log, env={"REDISLOCK_TEST_QUORUM": urls, "REDISLOCK_TEST_TTL": "10"}
    )
    yield proc
    proc.kill()


def lock_keys(nodes: list[RedisServer], name: str) -> list[bool]:
    found = []
    for server in nodes:
        client = server.client(socket_timeout=5)
        found.append(bool(client.exists("redislock:{" + name + "}")))
        client.close()
    return found


def test_settlement_on_a_quorum_is_exact_even_with_a_node_stopped(
    celery_broker: RedisServer, lock_nodes: list[RedisServer], quorum_worker: CeleryProcess
) -> None:
    r = celery_broker.client()
    rng = random.Random(11)
    payments = [(rng.randrange(3), rng.randrange(1, 100)) for _ in range(90)]
    first = [ca.settle.delay(a, m, 0.01) for a, m in payments[:45]]
    for result in first:
        result.get(timeout=120)
    lock_nodes[1].signal(signal.SIGSTOP)  # one of three masters stalls: work goes on
    try:
        second = [ca.settle.delay(a, m, 0.01) for a, m in payments[45:]]
        for result in second:
            result.get(timeout=120)
    finally:
        lock_nodes[1].signal(signal.SIGCONT)
    expected: dict[int, int] = defaultdict(int)
    for account, amount in payments:
        expected[account] += amount
    assert {a: int(r.get(f"balance:{a}") or 0) for a in expected} == dict(expected)
    lines: list[bytes] = r.lrange("sections:settle", 0, -1)  # type: ignore[assignment]
    seen = [raw.decode().split() for raw in lines]
    assert len(seen) == len(payments)  # every critical section was seen, once per task
    assert sorted(t for _, t, _, _ in seen) == sorted(x.id for x in first + second)
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, _, enter, leave in seen:
        spans[key].append((float(enter), float(leave)))
    for account_spans in spans.values():
        account_spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(account_spans, account_spans[1:]))
    # Every lock was given back on the nodes that were running.
    for account in expected:
        assert lock_keys([lock_nodes[0], lock_nodes[2]], f"account:{account}") == [False, False]
    # The locks really were on the quorum's nodes.
    for server in lock_nodes:
        client = server.client(socket_timeout=5)
        assert int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)) > 90
        client.close()
    r.close()


def test_hard_time_limit_frees_the_quorum_lock_at_once(
    lock_nodes: list[RedisServer], quorum_worker: CeleryProcess
) -> None:
    result = ca.exceed_hard_limit.delay("q-limit")
    with pytest.raises(Exception):  # noqa: B017 - TimeLimitExceeded, whatever its wrapping
        result.get(timeout=60)
    started = time.monotonic()
    wait_until(lambda: lock_keys(lock_nodes, "job:q-limit") == [False] * 3, timeout=8)
    assert time.monotonic() - started < 8  # the lease (10 s) did not have to run out


def test_a_copy_looking_for_its_own_delivery_keeps_the_quorum_leases_as_they_are(
    lock_nodes: list[RedisServer],
) -> None:
    from celery_redislock import RedLock
    from celery_redislock._core import OwnerRunning
    from celery_redislock.task import QuorumTaskLock

    clients = [server.client(socket_timeout=5) for server in lock_nodes]
    name = "job:quorum-dup"
    try:
        dead = RedLock(clients, name, ttl=1.0, owner="t-q", auto_renew=False)
        assert dead.acquire(blocking=False)  # the first delivery, whose worker died
        options = ca.hold_for.lock_options()
        copy = QuorumTaskLock(clients, name, task_id="t-q", options=options, node_timeout=0.5)
        with pytest.raises(OwnerRunning):
            copy.take()  # another delivery of this run: nothing changed anywhere
        key = "redislock:{" + name + "}"
        assert all(0 < c.pttl(key) <= 1000 for c in clients)  # not lengthened anywhere
        assert all(c.hget(key, "t-q") == b"1" for c in clients)
    finally:
        for client in clients:
            client.delete("redislock:{" + name + "}")
            client.close()


def test_a_copy_that_fails_its_quorum_gives_back_only_its_own_counts() -> None:
    """One node down, another stalled: a second delivery's attempt fails, and its undo
    must not delete the running delivery's holds (same task id) on the nodes it reached."""
    import threading

    from celery_redislock import LockQuorumError, RedLock
    from celery_redislock.task import QuorumTaskLock

    servers = [RedisServer().start() for _ in range(3)]
    try:
        clients = [server.client(socket_timeout=5) for server in servers]
        key = "redislock:{job:quorum-undo}"
        running = RedLock(clients, "job:quorum-undo", ttl=30, owner="t-u", node_timeout=0.5)
        servers[2].stop()
        assert running.acquire(blocking=False)  # holds on nodes 0 and 1
        servers[1].signal(signal.SIGSTOP)
        resume = threading.Timer(1.5, lambda: servers[1].signal(signal.SIGCONT))
        resume.start()
        copy = QuorumTaskLock(
            clients, "job:quorum-undo", task_id="t-u", options=ca.hold_for.lock_options(),
            node_timeout=0.5,
        )  # fmt: skip
        with pytest.raises(LockQuorumError):
            copy.take()
        resume.join()
        time.sleep(1.5)  # the background give-backs have landed
        assert [c.hget(key, "t-u") for c in clients[:2]] == [b"1", b"1"]
        running.ensure_held()
        running.release()
    finally:
        for server in servers:
            if server.process is not None:
                server.signal(signal.SIGCONT)
            server.cleanup()
