"""Fixtures of the Celery tests that share one app module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redislock.testing import RedisServer

from .. import runon_app as ra

#: The shared RabbitMQ, when one runs (tests use queues of their own, deleted after).
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


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


class Rabbit:
    """Queues and exchanges a test made on the shared RabbitMQ, deleted at its end."""

    def __init__(self) -> None:
        self.queues: list[str] = []
        self.exchanges: list[str] = []

    def delete(self) -> None:
        from kombu import Connection

        with Connection(RABBITMQ) as conn:
            channel = conn.default_channel
            for name in self.queues:
                channel.queue_delete(name)
            for name in self.exchanges:
                channel.exchange_delete(name)

    def count(self, queue: str) -> int | None:
        """Messages in ``queue``, or None when it does not exist."""
        from amqp.exceptions import NotFound
        from kombu import Connection

        with Connection(RABBITMQ) as conn:
            try:
                return int(conn.default_channel.queue_declare(queue, passive=True).message_count)
            except NotFound:
                return None


@pytest.fixture
def rabbit() -> Iterator[Rabbit]:
    made = Rabbit()
    try:
        yield made
    finally:
        made.delete()
