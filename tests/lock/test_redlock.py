"""The quorum lock over independent real redis-server masters (3 and 5 of them)."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import signal
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

from celery_redislock import (
    AsyncRedLock,
    LockConfigurationError,
    LockLostError,
    LockQuorumError,
    RedisLock,
    RedLock,
)
from celery_redislock._core import decode_acquire
from celery_redislock._quorum import NoReply, QuorumAcquire, Round, release_code, tally_acquire
from celery_redislock._scripts import scripts_for
from celery_redislock.testing import RedisServer

from .. import _procs
from .._support import wait_until


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[RedisServer]]:
    servers = [RedisServer().start() for _ in range(5)]
    yield servers
    for server in servers:
        server.cleanup()


@pytest.fixture
def five(nodes: list[RedisServer]) -> Iterator[list[redis.Redis]]:
    clients = []
    for server in nodes:
        client = server.client(socket_timeout=5)
        client.flushall()  # servers this module started
        clients.append(client)
    yield clients
    for client in clients:
        client.close()


@pytest.fixture
def three(five: list[redis.Redis]) -> list[redis.Redis]:
    return five[:3]


@contextmanager
def stopped(*servers: RedisServer) -> Iterator[None]:
    for server in servers:
        server.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for server in servers:
            server.signal(signal.SIGCONT)


def held_on(clients: list[redis.Redis], lock: RedLock | AsyncRedLock) -> list[bool]:
    """Which nodes show the lock, once the requests still in flight have landed.

    A quorum operation returns as soon as a majority has answered; the request to the
    slowest node lands a moment later. Poll briefly for a settled answer.
    """
    seen: list[bool] = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        now = [bool(c.exists(lock.keys.lock)) for c in clients]
        if now == seen and len(set(now)) == 1:
            return now
        seen = now
        time.sleep(0.02)
    return seen


def test_acquire_release_reentry_on_every_node(three: list[redis.Redis]) -> None:
    lock = RedLock(three, "pay:1", ttl=10, node_timeout=1.0)
    assert lock.quorum == 2
    assert lock.acquire(blocking=False)
    assert held_on(three, lock) == [True, True, True]
    token = lock.token
    assert token is not None and lock.owned() and lock.locked()
    remaining = lock.remaining()
    assert remaining is not None and 8 < remaining <= 10
    assert lock.acquire(blocking=False) and lock.hold_count == 2 and lock.token == token
    other = RedLock(three, "pay:1", ttl=10, owner="someone-else")
    assert not other.acquire(blocking=False)
    lock.release()
    assert held_on(three, lock) == [True, True, True]
    lock.release()
    assert held_on(three, lock) == [False, False, False]
    assert not lock.locked() and lock.remaining() is None
    assert other.acquire(blocking=False)
    assert other.token is not None and other.token > token
    other.release()


def test_tokens_stay_monotonic_when_the_majority_changes(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    # Earlier holders wrote token 100 back to a majority (nodes 0 and 1); node 2 missed it.
    fence_key = RedLock(three, "acct", ttl=10).keys.fence
    three[0].set(fence_key, 100)
    three[1].set(fence_key, 100)
    first = RedLock(three, "acct", ttl=10)
    assert first.acquire(blocking=False)
    # Any majority shares a node with that one: the highest of its tokens is 101.
    assert first.token == 101
    counters = [int(c.get(fence_key) or 0) for c in three]
    assert sum(1 for c in counters if c >= 101) >= 2  # written back to a majority
    first.release()
    # A later majority without node 0 still hands out a larger one.
    with stopped(nodes[0]):
        second = RedLock(three, "acct", ttl=10, node_timeout=0.2)
        assert second.acquire(blocking=False)
        assert second.token is not None and second.token > 101
        second.release()


def test_one_of_three_nodes_stopped_still_acquires_within_the_node_timeout(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    lock = RedLock(three, "job", ttl=5, node_timeout=0.2)
    with stopped(nodes[1]):
        # Within its own timeout: the attempts did not hang on the stopped node (one
        # round costs at most its node timeout; bench/quorum.py measures how long).
        assert lock.acquire(timeout=3)
        assert held_on([three[0], three[2]], lock) == [True, True]
        lock.release()
        assert held_on([three[0], three[2]], lock) == [False, False]


def test_two_of_five_nodes_stopped_still_acquires(
    nodes: list[RedisServer], five: list[redis.Redis]
) -> None:
    lock = RedLock(five, "job5", ttl=5, node_timeout=0.2)
    assert lock.quorum == 3
    with stopped(nodes[0], nodes[3]):
        assert lock.acquire(timeout=3)
        assert sum(held_on([five[1], five[2], five[4]], lock)) == 3
        lock.release()


def test_a_majority_down_is_a_quorum_error_naming_the_nodes(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    lock = RedLock(three, "down", ttl=5, node_timeout=0.2)
    with stopped(nodes[0], nodes[2]):
        with pytest.raises(LockQuorumError) as caught:
            lock.acquire(timeout=1)
    error = caught.value
    assert isinstance(error, TimeoutError)
    assert set(error.failures) == {f"127.0.0.1:{nodes[0].port}", f"127.0.0.1:{nodes[2].port}"}
    assert f"127.0.0.1:{nodes[2].port}" in str(error) and "quorum needs 2" in str(error)
    # The attempt was undone on the node it reached: nothing is left behind.
    time.sleep(0.3)
    assert held_on(three, lock) == [False, False, False]


def test_a_waiter_is_woken_by_the_release_not_the_ttl(three: list[redis.Redis]) -> None:
    holder = RedLock(three, "wake", ttl=30, owner="holder")
    assert holder.acquire(blocking=False)
    got: list[float] = []

    def wait() -> None:
        waiter = RedLock(three, "wake", ttl=30)
        assert waiter.acquire(timeout=20)
        got.append(time.monotonic())
        waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    released = time.monotonic()
    holder.release()
    thread.join(25)
    assert got, "the waiter never acquired"
    assert got[0] - released < 5.0  # the holder's lease had 29 s left


def test_the_watchdog_renews_on_a_majority_and_reports_losing_it(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    lock = RedLock(three, "renewed", ttl=1.0, node_timeout=0.1)
    reasons: list[str] = []
    lock.on_lost(lambda _lock, error: reasons.append(error.reason))
    assert lock.acquire(blocking=False)
    with stopped(nodes[2]):
        time.sleep(2.5)  # 2.5 TTLs: renewed on the two running nodes
        lock.ensure_held()
        assert held_on(three[:2], lock) == [True, True]
        with stopped(nodes[1]):
            assert lock.lost.wait(5), "losing the majority was never reported"
            assert reasons and reasons[0] in ("unreachable", "expired")
            with pytest.raises(LockLostError):
                lock.ensure_held()
    with pytest.raises(LockLostError):
        lock.release()


def test_bad_arguments_are_named(three: list[redis.Redis]) -> None:
    with pytest.raises(LockConfigurationError, match="clients"):
        RedLock([], "x")
    with pytest.raises(LockConfigurationError, match="clients"):
        RedLock("redis://127.0.0.1:1", "x")
    with pytest.raises(LockConfigurationError, match="twice"):
        RedLock([three[0], three[0]], "x")
    with pytest.raises(LockConfigurationError, match="node_timeout"):
        RedLock(three, "x", ttl=1, node_timeout=0.6)
    with pytest.raises(LockConfigurationError, match="retry_delay"):
        RedLock(three, "x", retry_delay=-1)
    with pytest.raises(LockConfigurationError, match="ttl"):
        RedLock(three, "x", ttl=0)


def _same_server_pairs(
    client_class: type[Any], server: RedisServer, tmp_path: Path
) -> list[tuple[str, list[Any]]]:
    """Pairs of nodes that each reach ``server`` (or one unix socket) twice."""
    client = client_class(host="localhost", port=server.port)
    socket_dir = tmp_path / "sockets"
    socket_dir.mkdir()
    (tmp_path / "link").symlink_to(socket_dir)
    return [
        ("the same client object", [client, client]),
        ("two clients on one pool", [client, client_class(connection_pool=client.connection_pool)]),
        ("the same connection kwargs", [client, client_class(host="localhost", port=server.port)]),
        ("localhost and 127.0.0.1", [client, client_class(host="127.0.0.1", port=server.port)]),
        ("localhost and 127.0.0.1 URLs", [f"redis://localhost:{server.port}", server.url]),
        ("another database", [client, f"redis://127.0.0.1:{server.port}/5"]),
        ("IPv4-mapped IPv6", [f"redis://[::ffff:127.0.0.1]:{server.port}", server.url]),
        (
            "one unix socket by two paths",
            [f"unix://{socket_dir}/redis.sock", f"unix://{tmp_path}/link/redis.sock?db=1"],
        ),
    ]


@pytest.mark.parametrize(
    ("lock_class", "client_class"),
    [(RedLock, redis.Redis), (AsyncRedLock, redis.asyncio.Redis)],
)
def test_nodes_that_reach_one_server_are_refused_naming_both(
    nodes: list[RedisServer],
    five: list[redis.Redis],
    tmp_path: Path,
    lock_class: type[Any],
    client_class: type[Any],
) -> None:
    """One server counted twice would cast two votes (issue 15: ``localhost:P`` and
    ``127.0.0.1:P`` were two masters): refused before anything is sent, naming both."""
    others = [client_class(host="127.0.0.1", port=server.port) for server in nodes[:3]]
    for case, pair in _same_server_pairs(client_class, nodes[3], tmp_path):
        with pytest.raises(LockConfigurationError, match="clients") as caught:
            lock_class([others[0], pair[0], others[1], pair[1]], "dup", ttl=5)
        message = str(caught.value)
        assert "clients[1]" in message and "clients[3]" in message, (case, message)
        assert "twice" in message, (case, message)
    assert not any(client.exists("redislock:{dup}") for client in five)
    # Distinct servers, by any spelling, are accepted.
    lock_class([f"redis://localhost:{nodes[0].port}", nodes[1].url, others[2]], "ok", ttl=5)


def test_urls_are_accepted(nodes: list[RedisServer], three: list[redis.Redis]) -> None:
    lock = RedLock([s.url for s in nodes[:3]], "by-url", ttl=5, node_timeout=1.0)
    with lock:
        assert held_on(three, lock) == [True, True, True]
    assert held_on(three, lock) == [False, False, False]


def test_force_release_clears_every_node(three: list[redis.Redis]) -> None:
    lock = RedLock(three, "stuck", ttl=30, owner="gone", node_timeout=1.0)
    assert lock.acquire(blocking=False)
    # The acquire returned once a majority granted it; the third node's request finishes
    # in the background and, landing after force_release, would take the lock there again.
    wait_until(
        lambda: all(c.exists(lock.keys.lock) for c in three), timeout=10, what="held on all three"
    )
    assert RedLock.force_release(three, "stuck")
    assert held_on(three, lock) == [False, False, False]


def test_same_public_api_as_the_single_node_lock() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(RedisLock) <= public(RedLock)
    assert public(RedLock) - public(RedisLock) <= {"quorum", "clients", "node_timeout"}


# ------------------------------------------------------------------- processes


def test_processes_on_a_quorum_never_overlap(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    ports = [s.port for s in nodes[:3]]
    ctx = multiprocessing.get_context("spawn")
    workers = [
        ctx.Process(target=_procs.hammer_quorum, args=(ports, "q-counter", 25, "q-log"))
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0] * 4
    lines: list[bytes] = three[0].lrange("q-log", 0, -1)  # type: ignore[assignment]
    sections = sorted(
        (float(e), float(x), int(t)) for e, x, t in (raw.decode().split() for raw in lines)
    )
    assert len(sections) == 4 * 25  # every critical section was seen
    assert [(a, b) for a, b in zip(sections, sections[1:]) if b[0] < a[1]] == []
    tokens = [t for *_, t in sections]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert int(three[0].get("q-counter") or 0) == 4 * 25


# ------------------------------------------------------------------- asyncio


async def test_async_quorum_lock(nodes: list[RedisServer], three: list[redis.Redis]) -> None:
    clients = [redis.asyncio.Redis(port=s.port) for s in nodes[:3]]
    try:
        lock = AsyncRedLock(clients, "a-pay", ttl=10, node_timeout=1.0)
        async with lock:
            await asyncio.sleep(0.3)  # the slowest node's request lands (held_on blocks the loop)
            assert held_on(three, lock) == [True, True, True]
            assert await lock.owned() and lock.token is not None
            assert await lock.acquire(blocking=False) and lock.hold_count == 2
            await lock.release()
        assert not await lock.locked()

        holder = AsyncRedLock(clients, "a-wake", ttl=30, owner="holder", node_timeout=1.0)
        assert await holder.acquire(blocking=False)
        waiter = AsyncRedLock(clients, "a-wake", ttl=30, node_timeout=0.2, owner="w")
        task = asyncio.ensure_future(waiter.acquire(timeout=20))
        await asyncio.sleep(0.3)
        released = time.monotonic()
        await holder.release()
        assert await asyncio.wait_for(task, 25)
        assert time.monotonic() - released < 5.0
        with stopped(nodes[0]):
            await waiter.release()  # two of three give it back
            again = AsyncRedLock(clients, "a-wake", ttl=5, node_timeout=0.2)
            assert await again.acquire(timeout=3)
            await again.release()
        for each in (lock, holder, waiter, again):
            await each.aclose()
    finally:
        from celery_redislock.aio import aclose_background

        for client in clients:
            await aclose_background(client)
            await client.aclose()


def test_a_release_with_a_silent_node_succeeds_while_the_hold_is_valid(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    keys = RedLock(three, "unclear", ttl=10).keys
    three[2].hset(keys.lock, "other", 1)  # node 2 belongs to someone else
    three[2].pexpire(keys.lock, 10_000)
    lock = RedLock(three, "unclear", ttl=10, node_timeout=0.2)
    assert lock.acquire(blocking=False)  # on nodes 0 and 1
    # Node 1 stalls during the release: one node gave it back, one shows another owner,
    # one is silent. The hold was valid when the release was sent, so nobody else can
    # have held it: that is a release, and node 1 gets it when it answers.
    with stopped(nodes[1]):
        lock.release()
        assert lock.hold_count == 0
    assert held_on(three[:2], lock) == [False, False]


def test_what_a_release_round_adds_up_to() -> None:
    def round_of(*replies: object) -> Round:
        return Round(list(replies), ["a", "b", "c"])

    silent = NoReply("no reply")
    assert release_code(round_of(0, 0, silent), 2) == 0
    assert release_code(round_of(1, 1, -1), 2) == 1  # an inner hold given back
    assert release_code(round_of(0, -2, silent), 2) is None  # cannot tell...
    assert release_code(round_of(0, -2, silent), 2, valid=True) == 0  # ...unless still valid
    # A majority without the hold is a loss, whatever the local clock says.
    assert release_code(round_of(-2, -2, 0), 2, valid=True) == -2
    assert release_code(round_of(silent, silent, silent), 2, valid=True) is None
    assert release_code(round_of(-1, -2, silent), 2) == -2  # lost: another owner has it
    assert release_code(round_of(-1, -1, 0), 2) == -1


def test_one_node_is_allowed_and_extend_follows_the_quorum_rule(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    single = RedLock(three[:1], "solo", ttl=5)
    assert single.quorum == 1
    with single:
        assert single.owned()
    lock = RedLock(three, "extended", ttl=2, node_timeout=0.2)
    assert lock.acquire(blocking=False)
    with stopped(nodes[0]):
        lock.extend(20)  # two of three renewed: valid
        remaining = lock.remaining()
        assert remaining is not None and remaining > 15
        with stopped(nodes[1]):
            with pytest.raises(LockQuorumError, match="extend"):
                lock.extend(20)
    lock.release()
    with pytest.raises(LockLostError):
        late = RedLock(three, "gone", ttl=1, auto_renew=False)
        assert late.acquire(blocking=False)
        time.sleep(1.1)
        late.extend(5)  # never recreates an expired lock


async def test_a_cancelled_async_acquire_leaves_nothing_behind(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    clients = [redis.asyncio.Redis(port=s.port) for s in nodes[:3]]
    try:
        holder = AsyncRedLock(clients, "a-cancel", ttl=30, owner="holder")
        assert await holder.acquire(blocking=False)
        waiter = AsyncRedLock(clients, "a-cancel", ttl=30, owner="waiter", node_timeout=0.2)
        task = asyncio.ensure_future(waiter.acquire(timeout=20))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await holder.release()
        await asyncio.sleep(0.3)  # give-backs run in the background
        assert [bool(c.hexists(holder.keys.lock, "waiter")) for c in three] == [False] * 3
        assert not await holder.locked()
        await waiter.aclose()
        await holder.aclose()
    finally:
        from celery_redislock.aio import aclose_background

        for client in clients:
            await aclose_background(client)
            await client.aclose()


# ------------------------------------------------------- regressions found in review


def test_tokens_stay_monotonic_when_a_node_is_re_entered(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """B's fresh acquire re-enters a leftover hold of its own on node x, the one node that
    saw A's written-back token: x must still hand B a new token, or B's would be older."""
    _, y, z = servers = [redis_server_factory(appendonly=True) for _ in range(3)]

    def clients() -> list[redis.Redis]:
        return [s.client(socket_timeout=2) for s in servers]

    raw = clients()
    y.kill()  # three acquisitions while y is down: counters x, z run ahead of y
    for _ in range(3):
        c = RedLock(clients(), "ledger", owner="C", ttl=5, auto_renew=False, node_timeout=1.0)
        assert c.acquire(blocking=False)
        c.release()
    y.start(y.port)
    keys = c.keys
    # A late grant of an earlier attempt of B's, left on x.
    args = [keys.lock, keys.fence, keys.waiters, keys.claims, keys.wake]
    scripts_for(raw[0]).acquire(keys=args, args=["B", 20000])
    a = RedLock(clients(), "ledger", owner="A", ttl=5, auto_renew=False, node_timeout=1.0)
    write_back = a._write_back

    def y_dies_before_the_write_back(token: int) -> bool:
        y.kill()  # AOF always: y keeps A's grant and its counter, misses the write-back
        return write_back(token)

    a._write_back = y_dies_before_the_write_back  # type: ignore[method-assign]
    assert a.acquire(blocking=False)
    token_a = a.token
    y.start(y.port)
    a.release()
    with stopped(z):
        b = RedLock(clients(), "ledger", owner="B", ttl=5, auto_renew=False, node_timeout=1.0)
        assert b.acquire(blocking=False)  # majority {x (re-entered), y}
    assert token_a is not None and b.token is not None
    assert b.token > token_a


def test_extend_moves_only_the_shares_of_nodes_that_renewed(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    with stopped(nodes[2]):
        lock = RedLock(three, "x-extend", owner="A", ttl=6, node_timeout=0.3)
        assert lock.acquire(blocking=False)  # node 2's share is unconfirmed
        group = lock._group_of(lock._holds["A"])
        assert group is not None
        lock.extend(6)
        now = time.monotonic()
        deadlines = {node: part.deadline - now for node, part in group.parts}
        assert deadlines[0] > 5 and deadlines[1] > 5
        assert deadlines[2] <= 0  # it did not renew: it does not count
    lock.release()


def test_a_lost_hold_is_not_re_entered(nodes: list[RedisServer], three: list[redis.Redis]) -> None:
    lock = RedLock(three, "relost", owner="A", ttl=1.0, node_timeout=0.1)
    assert lock.acquire(blocking=False)
    first = lock.token
    with stopped(nodes[0], nodes[1]):
        assert lock.lost.wait(5)
    time.sleep(1.1)  # the shares on nodes 0 and 1 expired meanwhile
    assert lock.acquire(timeout=5)  # starts over: a new hold with a newer token
    assert lock.hold_count == 1 and not lock.lost
    assert first is not None and lock.token is not None and lock.token > first
    lock.release()


def test_a_task_release_that_cannot_tell_does_not_keep_the_lock(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    from celery_redislock.settings import LockOptions
    from celery_redislock.task import QuorumTaskLock

    servers = [redis_server_factory(appendonly=True) for _ in range(3)]
    clients = [s.client() for s in servers]
    lock = QuorumTaskLock(
        clients, "job", task_id="task-1", options=LockOptions(ttl=3.0), node_timeout=0.2
    )
    assert lock.take()
    servers[1].kill()
    servers[2].kill()
    assert lock.finish(hold=0.0, done_ttl=None) is None  # warns, does not raise
    assert lock.hold_count == 0  # not renewed any more
    servers[1].start(servers[1].port)
    servers[2].start(servers[2].port)
    other = RedLock([s.client() for s in servers], "job", owner="other", ttl=3, node_timeout=0.5)
    assert other.acquire(timeout=10)  # the lease ran out; nobody renewed it
    other.release()


def test_the_write_back_is_skipped_only_when_a_majority_already_has_the_token() -> None:
    def tally(*tokens: int) -> QuorumAcquire:
        return tally_acquire([[1, t, 1] for t in tokens], decode_acquire)

    assert not tally(7, 7, 7).needs_write_back(2)  # counters in step: no extra round
    assert not tally(7, 7, 5).needs_write_back(2)
    assert tally(7, 6, 5).needs_write_back(2)  # only one counter has 7
    assert tally(9, 7).needs_write_back(2)


# ------------------------------------------- the owner of an acquire run in another task


@asynccontextmanager
async def async_clients(nodes: list[RedisServer]) -> AsyncIterator[list[redis.asyncio.Redis]]:
    clients = [redis.asyncio.Redis(port=s.port) for s in nodes[:3]]
    try:
        yield clients
    finally:
        from celery_redislock.aio import aclose_background

        for client in clients:
            await aclose_background(client)
            await client.aclose()


async def test_an_async_quorum_acquire_run_in_another_task_holds_for_the_calling_task(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    """As for AsyncRedisLock: wait_for (a task of its own before Python 3.12), gather
    and create_task acquire for the task that called acquire(), whose release matches;
    two acquires of that task at once take turns (the second re-enters)."""
    async with async_clients(nodes) as clients:
        lock = AsyncRedLock(clients, "a-owner", ttl=10, node_timeout=1.0)
        assert await asyncio.wait_for(lock.acquire(), 10)
        assert lock.hold_count == 1 and await lock.owned()
        await lock.release()
        assert await asyncio.gather(lock.acquire(), lock.acquire()) == [True, True]
        assert await asyncio.ensure_future(lock.acquire()) is True
        assert lock.hold_count == 3
        for _ in range(3):
            await lock.release()
        assert not await lock.locked() and lock.hold_count == 0
        await lock.aclose()


async def test_an_async_quorum_hold_whose_task_ended_is_not_renewed_for_ever(
    nodes: list[RedisServer], three: list[redis.Redis]
) -> None:
    """Every node's share stops being renewed once the owning task has ended: the hold
    is lost ("abandoned") and expires everywhere with its lease."""
    async with async_clients(nodes) as clients:
        lock = AsyncRedLock(clients, "a-orphan", ttl=0.6, node_timeout=0.1)
        losses: list[str] = []
        lock.on_lost(lambda _lock, error: losses.append(error.reason))

        async def forgetful() -> None:
            assert await lock.acquire()

        await asyncio.create_task(forgetful())
        for _ in range(100):
            if not any([await c.exists(lock.keys.lock) for c in clients]):
                break
            await asyncio.sleep(0.05)
        assert [await c.exists(lock.keys.lock) for c in clients] == [0, 0, 0]
        assert losses == ["abandoned"] and not lock._holds
        await lock.aclose()


def test_a_dropped_redlock_frees_its_private_clients(three: list[redis.Redis]) -> None:
    """The per-node clients a ``RedLock`` opens for itself go with it (a RedLock made per
    task must not leave a connection open per node each time)."""
    lock = RedLock(three, "dropped-redlock", auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    private = [weakref.ref(client) for client in lock._fast]
    del lock

    def freed() -> bool:
        gc.collect()  # (a node request's thread may still be letting go of its call)
        return all(ref() is None for ref in private)

    wait_until(freed, 5.0, what="the private clients collected")
