"""RedisSemaphore / AsyncRedisSemaphore on a real redis-server: at most N holders per name,
each permit a lease of its own (renewed, lost, fenced), waiters first come, first served and
woken by a release (issue 17, the primitive). With real processes, SIGKILLed and
SIGSTOPped holders: test_semaphore_processes.py."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis

from celery_redislock import (
    AsyncRedisSemaphore,
    LockConfigurationError,
    LockLostError,
    RedisSemaphore,
)
from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisServer

from .._support import wait_until


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis_server.client()
    c.flushall()
    yield c
    c.close()


@pytest_asyncio.fixture
async def aclient(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis(port=redis_server.port)
    await c.flushall()
    yield c
    await aclose_background(c)
    await c.aclose()


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0))


# -- configuration -----------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, True, False, 1.5, "3", None, 2**31])
@pytest.mark.parametrize("cls", [RedisSemaphore, AsyncRedisSemaphore])
def test_a_bad_limit_is_refused_by_name_and_writes_nothing(
    client: redis.Redis, cls: type, limit: Any
) -> None:
    with pytest.raises(LockConfigurationError, match="limit"):
        cls(client, "s", limit=limit)
    assert client.dbsize() == 0


@pytest.mark.parametrize("cls", [RedisSemaphore, AsyncRedisSemaphore])
def test_a_quorum_of_clients_is_refused_not_used_as_one(client: redis.Redis, cls: type) -> None:
    with pytest.raises(LockConfigurationError, match=r"quorum semaphore .* not offered"):
        cls([client, client, client], "s", limit=2)
    assert client.dbsize() == 0


def test_limit_bounds_accepted(client: redis.Redis) -> None:
    assert RedisSemaphore(client, "s", limit=1).limit == 1
    assert RedisSemaphore(client, "s", limit=2**31 - 1).limit == 2**31 - 1
    assert "limit=1" in repr(RedisSemaphore(client, "s", limit=1))


# -- one process -------------------------------------------------------------------


def test_at_most_limit_owners_then_a_release_frees_one(client: redis.Redis) -> None:
    sems = [RedisSemaphore(client, "s", limit=2, owner=f"o{i}") for i in range(3)]
    assert sems[0].acquire() and sems[1].acquire()
    assert not sems[2].acquire(blocking=False)
    assert sems[0].owned() and not sems[2].owned()
    sems[0].release()
    assert sems[2].acquire(blocking=False)
    for sem in sems[1:]:
        sem.release()
    assert client.keys("*") == [RedisSemaphore(client, "s").keys.fence]  # only the counter


def test_an_owner_holding_a_permit_re_enters_it(client: redis.Redis) -> None:
    a = RedisSemaphore(client, "s", limit=2, owner="a")
    b = RedisSemaphore(client, "s", limit=2, owner="b")
    assert a.acquire()
    token = a.token
    assert a.acquire()
    assert a.hold_count == 2 and a.token == token
    assert b.acquire(blocking=False)  # a's re-entry took no second permit
    a.release()
    assert a.owned()
    a.release()
    assert not a.owned()
    b.release()


def test_tokens_strictly_increase_across_all_permits(client: redis.Redis) -> None:
    tokens = []
    sems = [RedisSemaphore(client, "s", limit=3, owner=f"o{i}") for i in range(3)]
    for _ in range(4):
        for sem in sems:
            assert sem.acquire()
            tokens.append(sem.token)
        for sem in sems:
            sem.release()
    assert tokens == sorted(set(tokens))


def test_a_blocked_waiter_is_woken_by_the_release_not_by_polling(client: redis.Redis) -> None:
    holder = RedisSemaphore(client, "s", limit=1, ttl=30, owner="holder")
    assert holder.acquire()
    waiter = RedisSemaphore(client, "s", limit=1, ttl=30, owner="waiter")
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(waiter.acquire(timeout=30)))
    before = evalsha_calls(client)
    thread.start()
    wait_until(lambda: client.llen(waiter.keys.waiters) == 1, what="the waiter in line")
    holder.release()
    thread.join()
    # Taken (the holder's renewed 30 s permit could only free by the release), in four
    # scripts: a first try, the try that joined the line, the release, the take-up.
    assert result == [True] and waiter.owned()
    assert evalsha_calls(client) - before <= 5
    waiter.release()


def test_waiters_are_served_first_come_first_served(client: redis.Redis) -> None:
    holder = RedisSemaphore(client, "s", limit=1, owner="holder")
    assert holder.acquire()
    order: list[int] = []
    threads = []

    def wait(i: int) -> None:
        sem = RedisSemaphore(client, "s", limit=1, owner=f"w{i}")
        assert sem.acquire(timeout=30)
        order.append(i)
        sem.release()

    for i in range(4):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        wait_until(lambda i=i: client.llen(holder.keys.waiters) == i + 1, what=f"waiter {i}")
    holder.release()
    for thread in threads:
        thread.join()
    assert order == [0, 1, 2, 3]


def test_a_lowered_limit_takes_effect_as_permits_are_released(client: redis.Redis) -> None:
    a, b = (RedisSemaphore(client, "s", limit=2, owner=o) for o in "ab")
    assert a.acquire() and b.acquire()
    c = RedisSemaphore(client, "s", limit=1, owner="c")
    a.release()
    assert not c.acquire(blocking=False)  # b holds: 1 held, limit 1
    b.release()
    assert c.acquire(blocking=False)
    c.release()


def test_a_permit_deleted_is_reported_lost(client: redis.Redis) -> None:
    sem = RedisSemaphore(client, "s", limit=2, ttl=0.6)
    assert sem.acquire()
    sem.ensure_held()
    client.delete(sem._hold_keys(sem._current_owner()).lock)
    wait_until(lambda: sem.lost.is_set(), what="the loss reported")
    with pytest.raises(LockLostError):
        sem.ensure_held()
    with pytest.raises(LockLostError):
        sem.release()


def test_a_permit_not_renewed_frees_when_its_lease_runs_out(client: redis.Redis) -> None:
    a = RedisSemaphore(client, "s", limit=1, ttl=0.3, auto_renew=False, owner="a")
    b = RedisSemaphore(client, "s", limit=1, ttl=5, owner="b")
    assert a.acquire()
    assert not b.acquire(blocking=False)
    assert b.acquire(timeout=10)
    with pytest.raises(LockLostError):
        a.ensure_held()
    b.release()


# -- asyncio -----------------------------------------------------------------------


async def test_async_basic_reentry_wake_and_loss(aclient: aioredis.Redis) -> None:
    import asyncio

    a = AsyncRedisSemaphore(aclient, "s", limit=1, ttl=0.6, owner="a")
    b = AsyncRedisSemaphore(aclient, "s", limit=1, ttl=30, owner="b")
    async with a:
        token = a.token
        assert await a.acquire() and a.token == token and a.hold_count == 2
        await a.release()
        assert not await b.acquire(blocking=False)
        waiting = asyncio.ensure_future(b.acquire(timeout=30))
        while not await aclient.llen(b.keys.waiters):
            await asyncio.sleep(0.01)
    assert await waiting and await b.owned()
    assert b.token is not None and token is not None and b.token > token
    await aclient.delete(b._hold_keys("b").lock)
    b2 = AsyncRedisSemaphore(aclient, "s", limit=1, ttl=0.6, owner="c")
    async with b2:
        b2.ensure_held()
    with pytest.raises(LockLostError):
        await b.release()
