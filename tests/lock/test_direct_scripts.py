"""The scripts' direct way to Redis (``_scripts.run`` on a plain ``redis.Redis``): which
clients take it, and that it behaves as redis-py's command path does, without re-sending.

Real redis-server processes throughout; nothing mocked."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import redis
import redis.asyncio

from celery_redislock import AsyncRedisLock, RedisLock
from celery_redislock._scripts import _direct_pool, run, scripts_for
from celery_redislock.testing import RedisServer


def test_a_plain_client_runs_the_scripts_on_its_pool(redis_server: RedisServer) -> None:
    client = redis.Redis(port=redis_server.port)
    assert _direct_pool(client) is client.connection_pool
    asyncio_client = redis.asyncio.Redis(port=redis_server.port)
    assert _direct_pool(asyncio_client) is asyncio_client.connection_pool
    blocking = redis.Redis(
        connection_pool=redis.BlockingConnectionPool(port=redis_server.port, max_connections=2)
    )
    assert _direct_pool(blocking) is blocking.connection_pool
    lock = RedisLock(blocking, "blocking-pool", auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    blocking.close()


class Traced(redis.Redis):
    """A client whose class has its own command path (as a tracing wrapper gives)."""

    calls = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        Traced.calls += 1
        return super().execute_command(*args, **options)


def test_clients_with_another_command_path_keep_it(redis_server: RedisServer) -> None:
    port = redis_server.port
    plain = redis.Redis(port=port)
    single = redis.Redis(port=port, single_connection_client=True)
    traced = Traced(port=port)
    with_callback = redis.Redis(port=port)
    with_callback.set_response_callback("EVALSHA", lambda reply, **kw: reply)
    try:
        assert _direct_pool(plain.pipeline()) is None
        assert _direct_pool(single) is None
        assert _direct_pool(redis.asyncio.Redis(port=port).pipeline()) is None
        assert _direct_pool(traced) is None
        assert _direct_pool(with_callback) is None
        # A traced client's lock scripts go through its execute_command.
        Traced.calls = 0
        lock = RedisLock(traced, "traced", auto_renew=False)
        assert lock.acquire(blocking=False)
        lock.release()
        assert Traced.calls >= 2
    finally:
        for client in (plain, single, traced, with_callback):
            client.close()


def test_a_flushed_script_cache_is_loaded_again(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "flushed", auto_renew=False)
    assert lock.acquire(blocking=False)
    redis_client.script_flush()  # as a restarted server: NOSCRIPT on the next call
    lock.release()
    assert not redis_client.exists(lock.keys.lock)
    assert lock.acquire(blocking=False)
    lock.release()


def test_a_script_error_leaves_the_connection_usable(redis_client: redis.Redis) -> None:
    """A script's own error reply is raised, and the connection goes back to the pool in
    step: the next command on it reads its own reply, not the error's."""
    scripts = scripts_for(redis_client)
    pool = redis_client.connection_pool
    with pytest.raises(redis.ResponseError, match="max wait"):
        run(redis_client, scripts.rate, ["redislock:{e}:rate:1000"], ["-1", "1", "1"])
    assert len(pool._available_connections) == 1 and not pool._in_use_connections
    assert redis_client.ping() is True
    lock = RedisLock(redis_client, "after-error", auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()


def test_a_dead_connection_is_dropped_not_reused(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """A connection the server closed is not handed out again broken: the pool connects
    afresh (redis-py's pool checks a connection it hands out), and the script runs once."""
    redis_server = redis_server_factory()
    client = redis_server.client()
    lock = RedisLock(client, "killed-conn", auto_renew=False)
    assert lock.acquire(blocking=False)
    admin = redis_server.client()
    admin.client_kill_filter(_type="normal", skipme=True)  # every connection but admin's
    lock.release()
    assert not admin.exists(lock.keys.lock)
    client.close()
    admin.close()


async def test_an_asyncio_lock_runs_its_scripts_directly_and_reloads_them(
    redis_server: RedisServer,
) -> None:
    client = redis.asyncio.Redis(port=redis_server.port)
    try:
        lock = AsyncRedisLock(client, "aio-direct", auto_renew=False)
        assert await lock.acquire(blocking=False)
        await client.script_flush()
        await lock.release()
        assert not await client.exists(lock.keys.lock)
        pool = client.connection_pool
        assert not pool._in_use_connections  # every connection back in the pool
    finally:
        await client.aclose()
