"""The one builder of the library's own clients (no server needed: pools connect lazily)."""

from __future__ import annotations

import redis
import redis.asyncio
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.retry import Retry

from celery_redislock._private_clients import bounded_client


def test_a_user_client_gets_a_private_bounded_pool_without_retries() -> None:
    user = redis.Redis(host="127.0.0.1", port=1, db=3, password="pw", socket_timeout=None)
    own = bounded_client(user, 0.5, asyncio_client=False, max_connections=2)
    assert own is not user and own.connection_pool is not user.connection_pool
    kwargs = own.connection_pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.5, 0.5)
    assert (kwargs["db"], kwargs["password"], kwargs["port"]) == (3, "pw", 1)
    assert own.connection_pool.max_connections == 2
    assert isinstance(kwargs["retry"], Retry) and kwargs["retry"].get_retries() == 0
    shorter = bounded_client(redis.Redis(socket_timeout=0.1), 0.5, asyncio_client=False)
    assert shorter.connection_pool.connection_kwargs["socket_timeout"] == 0.1  # kept: shorter


def test_asyncio_clients_and_urls() -> None:
    own = bounded_client(redis.asyncio.Redis(port=1), 0.25, asyncio_client=True)
    assert isinstance(own, redis.asyncio.Redis)
    assert isinstance(own.connection_pool.connection_kwargs["retry"], AsyncRetry)
    for asyncio_client, kind in ((False, redis.Redis), (True, redis.asyncio.Redis)):
        from_url = bounded_client("redis://127.0.0.1:1/2", 0.25, asyncio_client=asyncio_client)
        assert isinstance(from_url, kind)
        kwargs = from_url.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["db"]) == (0.25, 2)


def test_a_sentinel_pool_keeps_its_service_and_sentinels() -> None:
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", 1)])
    user = sentinel.master_for("mymaster")
    own = bounded_client(user, 1.0, asyncio_client=False, max_connections=2)
    pool = own.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
    assert pool is not user.connection_pool
    assert pool.service_name == "mymaster" and pool.sentinel_manager is sentinel
    assert pool.connection_kwargs["socket_timeout"] == 1.0
