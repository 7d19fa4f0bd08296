"""Fixtures: real redis-server processes on free loopback ports, started and stopped here."""

from __future__ import annotations

import gc
import random
import warnings
from collections.abc import Iterator
from typing import Callable

import pytest
import redis

from celery_redislock.testing import RedisClusterServers, RedisServer

#: The module-level functions of `random` that code running beside a test may call.
_RANDOM_FUNCTIONS = ("random", "uniform", "randint", "randrange", "choice", "getrandbits")


@pytest.fixture(autouse=True)
def _global_random_left_to_hypothesis(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Hypothesis fails a test when the global `random` state moves while it draws an
    example. Code running beside the test can do that: a redis-py object of an earlier
    test collected mid-draw (its `__del__` resets a connection), or a background thread
    (a watchdog, a subscriber reconnecting) whose client retries with jitter from
    `random`. So a Hypothesis test runs with the collector off, after a collection of its
    own, and with the module's functions drawing from a private generator meanwhile."""
    if request.node.get_closest_marker("hypothesis") is None:
        yield
        return
    private = random.Random()
    for name in _RANDOM_FUNCTIONS:
        monkeypatch.setattr(random, name, getattr(private, name))
    with warnings.catch_warnings():
        # (the garbage of earlier tests: a client one of them left unclosed is theirs)
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server shared by the session's tests; each test uses its own key prefix."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    client.flushall()  # our own server only
    yield client
    client.close()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start extra private servers (for kill/restart tests); all are stopped at teardown."""
    started: list[RedisServer] = []

    def start(**options: object) -> RedisServer:
        server = RedisServer(**options).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.cleanup()


@pytest.fixture(scope="session")
def celery_broker() -> Iterator[RedisServer]:
    """A private redis-server for Celery tests: broker, results and locks (one per session,
    because Celery caches its backend per app)."""
    from . import celery_app

    with RedisServer() as server:
        celery_app.app.conf.update(broker_url=server.url, result_backend=server.url)
        celery_app.URL = server.url
        celery_app._r = None
        yield server
        celery_app.app.close()


def empty(server: RedisServer) -> RedisServer:
    """Flush a server these tests started (never one they did not)."""
    client = server.client()
    client.flushall()
    client.close()
    return server


@pytest.fixture
def broker(celery_broker: RedisServer) -> RedisServer:
    """The session's Celery Redis, emptied: for tests that run their own workers."""
    return empty(celery_broker)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A real three-master Redis Cluster on free loopback ports (one per test module)."""
    with RedisClusterServers() as cluster:
        yield cluster
