"""Fixtures the lock tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
import redis.asyncio as aioredis

from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisServer


@pytest_asyncio.fixture
async def aclient(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the session's redis-server, flushed first; its background
    tasks stopped and the client closed after."""
    client = aioredis.Redis(port=redis_server.port, socket_timeout=5)
    await client.flushall()
    yield client
    await aclose_background(client)
    await client.aclose()
