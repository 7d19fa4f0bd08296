"""Fixtures of the Celery tests that share one app module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redislock.testing import RedisServer

from .. import runon_app as ra


@pytest.fixture
def runon_server(broker: RedisServer) -> Iterator[RedisServer]:
    """The session's (emptied) Redis, as the running-on test app's broker and backend
    too (``tests.runon_app``, which ``tests.runon_attack_app`` extends). Its clients
    made with ``client()`` during the test are closed after it."""
    ra.app.conf.update(broker_url=broker.url, result_backend=broker.url)
    ra.URL = broker.url
    if ra._r is not None:
        ra._r.close()
        ra._r = None
    made: list[redis.Redis] = []

    def client(**kwargs: Any) -> redis.Redis:
        made.append(RedisServer.client(broker, **kwargs))
        return made[-1]

    broker.client = client  # type: ignore[method-assign]
    try:
        yield broker
    finally:
        del broker.client
        for each in made:
            each.close()
