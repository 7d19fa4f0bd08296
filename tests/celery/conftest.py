"""Fixtures of the Celery tests that share one app module."""

from __future__ import annotations

import pytest

from celery_redislock.testing import RedisServer

from .. import runon_app as ra


@pytest.fixture
def runon_server(broker: RedisServer) -> RedisServer:
    """The session's (emptied) Redis, as the running-on test app's broker and backend
    too (``tests.runon_app``, which ``tests.runon_attack_app`` extends)."""
    ra.app.conf.update(broker_url=broker.url, result_backend=broker.url)
    ra.URL, ra._r = broker.url, None
    return broker
