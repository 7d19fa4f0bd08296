"""How long lock calls take when Redis stops answering (docs/guarantees.md, "How long a
call can take"): a private redis-server is paused with SIGSTOP, never one we did not start."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import pytest
import redis
import redis.asyncio
from celery import Celery
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import AsyncRedisLock, LockQuorumError, RedisLock, RedLock
from celery_redislock.task import client_for, quorum_clients_for
from celery_redislock.testing import RedisServer

#: The client settings the docs recommend, scaled down: one attempt, half a second.
BOUNDED = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}


@contextmanager
def paused(server: RedisServer, after: float = 0.0) -> Iterator[None]:
    """SIGSTOP ``server`` (now, or ``after`` seconds into the block); SIGCONT at the end."""
    timer = threading.Timer(after, server.signal, (signal.SIGSTOP,))
    timer.start()
    try:
        if not after:
            timer.join()
        yield
    finally:
        timer.cancel()
        timer.join()
        server.signal(signal.SIGCONT)


def outcome(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except Exception as exc:
        return exc
    return None


def still_stopped(server: RedisServer) -> bool:
    """Whether the server is still SIGSTOPped: a call that returned meanwhile was ended
    by its own bounds (socket timeout, node timeout), not by the server answering. No
    timing is measured: the measured times are in docs/guarantees.md."""
    with open(f"/proc/{server.pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_lock_on_a_client_without_socket_timeout_warns_once_per_pool(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_redislock")
    unbounded = redis.Redis(port=redis_server.port, socket_timeout=None)
    RedisLock(unbounded, "a")
    RedisLock(unbounded, "b")
    RedisLock(redis.Redis(connection_pool=unbounded.connection_pool), "c")
    AsyncRedisLock(redis.asyncio.Redis(port=redis_server.port, socket_timeout=None), "d")
    warned = [r.getMessage() for r in caplog.records if "no socket_timeout" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "'a'" in warned[0] and "'d'" in warned[1]
    assert "socket_connect_timeout" in warned[0] and "guarantees.md" in warned[0]

    caplog.clear()
    RedisLock(redis_server.client(**BOUNDED), "e")
    RedisLock(redis.Redis.from_url(redis_server.url, socket_timeout=3), "f")
    # The quorum lock's rounds use private clients bounded by node_timeout.
    RedLock([redis.Redis(port=redis_server.port, socket_timeout=None)], "g")
    assert not [r for r in caplog.records if "no socket_timeout" in r.getMessage()]


def test_the_clients_the_package_makes_have_socket_timeouts(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    servers = [redis_server_factory() for _ in range(3)]
    one = Celery("bounds-one", broker="memory://", set_as_current=False)
    one.conf.redislock_url = servers[0].url
    quorum = Celery("bounds-quorum", broker="memory://", set_as_current=False)
    quorum.conf.redislock_urls = [s.url for s in servers]
    tuned = Celery("bounds-tuned", broker="memory://", set_as_current=False)
    tuned.conf.redislock_urls = [s.url for s in servers]
    tuned.conf.redislock_redis_options = {"socket_timeout": 2.5}
    try:
        for client in [client_for(one), *quorum_clients_for(quorum)]:
            kwargs = client.connection_pool.connection_kwargs
            assert kwargs.get("socket_timeout") == 10.0
            assert kwargs.get("socket_connect_timeout") == 10.0
        for client in quorum_clients_for(tuned):  # the app's own options win
            assert client.connection_pool.connection_kwargs["socket_timeout"] == 2.5
    finally:
        for app in (one, quorum, tuned):
            app.close()


def test_a_stalled_redis_bounds_acquire_and_release_by_the_socket_timeout(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """acquire(timeout=t) takes at most t plus two commands' time (its last attempt, and
    leaving the line); each command is bounded by the client's socket timeout."""
    server = redis_server_factory()
    client = server.client(**BOUNDED, retry=Retry(NoBackoff(), 0))
    holder = RedisLock(server.client(), "stall", owner="holder", ttl=30)
    mine = RedisLock(client, "mine", owner="me", ttl=30)
    assert mine.acquire(blocking=False)

    with paused(server):
        error = outcome(lambda: RedisLock(client, "free", ttl=30).acquire(timeout=1))
        assert still_stopped(server)
    assert isinstance(error, redis.exceptions.TimeoutError), error

    with paused(server):
        error = outcome(mine.release)
        assert still_stopped(server)
    # The last hold's release returns (it is retried in the background).
    assert error is None, error

    assert holder.acquire(blocking=False)
    waiter = RedisLock(client, "stall", owner="waiter", ttl=30)
    with paused(server, after=0.3):  # stalls while the waiter waits
        error = outcome(lambda: waiter.acquire(timeout=1))
        assert still_stopped(server)
    assert isinstance(error, redis.exceptions.TimeoutError), error


async def test_a_stalled_redis_bounds_the_async_lock_by_the_socket_timeout(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory()
    client = redis.asyncio.Redis(port=server.port, **BOUNDED, retry=AsyncRetry(NoBackoff(), 0))
    lock = AsyncRedisLock(client, "async-stall", owner="me", ttl=30)
    try:
        assert await lock.acquire(blocking=False)
        with paused(server):
            with pytest.raises(redis.exceptions.TimeoutError):
                await AsyncRedisLock(client, "free", ttl=30).acquire(timeout=1)
            await lock.release()  # returns: retried in the background
            assert still_stopped(server)
    finally:
        await client.aclose()


def test_the_quorum_lock_is_bounded_by_node_timeout_even_on_unbounded_clients(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    servers = [redis_server_factory() for _ in range(3)]
    clients = [redis.Redis(port=s.port, socket_timeout=None) for s in servers]
    lock = RedLock(clients, "q-stall", owner="me", ttl=10, node_timeout=0.25)
    with paused(servers[0]), paused(servers[1]), paused(servers[2]):
        error = outcome(lambda: lock.acquire(timeout=1))
        assert all(still_stopped(s) for s in servers)
    assert isinstance(error, LockQuorumError), error


def test_a_client_that_re_sends_the_scripts_is_logged_once(
    redis_server_factory: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """redis-py's default client re-sends a command whose connection failed, and the lock
    scripts are not idempotent. On a plain ``redis.Redis`` the scripts go to a pooled
    connection directly and are never re-sent, so nothing is said; a client whose scripts
    take redis-py's command path (a class with its own ``execute_command``, say) is
    logged once a pool."""
    server = redis_server_factory()
    plain = redis.Redis(port=server.port, socket_timeout=1)  # redis-py's default retry

    class Traced(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            return super().execute_command(*args, **options)

    traced = Traced(port=server.port, socket_timeout=1)
    single = Traced(port=server.port, socket_timeout=1, retry=Retry(NoBackoff(), 0))
    with caplog.at_level("WARNING", logger="celery_redislock"):
        RedisLock(plain, "p")
        RedisLock(traced, "a")
        RedisLock(traced, "b")
        RedisLock(single, "c")
    found = [r for r in caplog.records if "re-sends a command" in r.getMessage()]
    assert len(found) == 1 and "'a'" in found[0].getMessage()
