"""Edge cases of the scripts' semantics, pinned across the Lua/keyspace/replies refactor.

Each test drives the public lock API (or a script with the names every version uses) on a
real server and checks the exact state Redis is left in: a free lock handed to a waiter
the usual way by a task's release (count 0, the 2000 ms grant lease), a hand-over after
the releasing hold expired, a kept hold's done marker, the sweeper's hand-over and
re-send, the line's lapsed places, force_release and "leave" passing a lock on.
"""

from __future__ import annotations

import json

import pytest
import redis

from celery_redislock import LockLostError, RedisLock
from celery_redislock._core import OwnerFinished, OwnerRunning
from celery_redislock._scripts import scripts_for
from celery_redislock.settings import LockOptions
from celery_redislock.task import TaskLock

NAME = "review"


def _task(client: redis.Redis, task_id: str) -> TaskLock:
    return TaskLock(client, NAME, task_id=task_id, options=LockOptions(ttl=300))


def _now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _queue(client: redis.Redis, lock: RedisLock, owner: str, keep_ms: int = 60_000) -> None:
    """Put ``owner`` in the lock's line, its place kept ``keep_ms`` (negative: lapsed)."""
    client.rpush(lock.keys.waiters, owner)
    client.zadd(lock.keys.claims, {owner: _now_ms(client) + keep_ms})


def _wake(lock: RedisLock) -> bytes:
    return lock.keys.waiters + b":wake"


def test_task_release_grants_first_waiter_the_usual_way(redis_client: redis.Redis) -> None:
    holder = _task(redis_client, "h")
    assert holder.acquire(blocking=False)
    token = holder.token
    assert token is not None
    _queue(redis_client, holder, "gone", keep_ms=-1000)  # lapsed: skipped, dropped
    _queue(redis_client, holder, "w")
    redis_client.hset(_wake(holder), mapping={"gone": "s1:n.1:300000", "w": "s2:n.1:300000"})
    assert holder.finish(hold=0, done_ttl=60) is None
    lock = holder.keys.lock
    state = redis_client.hgetall(lock)
    assert state == {b"w": b"0", b"__fence__": str(token + 1).encode()}
    assert 0 < redis_client.pttl(lock) <= 2000  # the grant lease, not the task lease
    assert redis_client.llen(holder.keys.waiters) == 0
    assert redis_client.zcard(holder.keys.claims) == 0
    assert redis_client.hlen(_wake(holder)) == 0  # both wake ids went with their places
    assert redis_client.exists(holder.done_key) == 1
    holder.close()


def test_expired_task_hold_still_hands_over_to_parked(redis_client: redis.Redis) -> None:
    holder = _task(redis_client, "h")
    parked = _task(redis_client, "p")
    assert holder.acquire(blocking=False)
    message = json.dumps({"task": "t", "id": "p"})
    assert parked.park(message, keep_for=60) is not True
    redis_client.delete(holder.keys.lock)  # the holder's lease ran out
    with pytest.raises(LockLostError) as caught:
        holder.finish(hold=0, done_ttl=60)
    handed = caught.value.handed_to  # type: ignore[attr-defined]
    assert handed is not None
    assert handed.task_id == b"p" and handed.message == message.encode()
    assert redis_client.hget(holder.keys.lock, "p") == b"0"
    assert 290_000 < redis_client.pttl(holder.keys.lock) <= 300_000  # the task lease
    assert redis_client.exists(holder.done_key) == 1
    assert redis_client.hexists(holder.dispatched, "p")
    holder.close()
    parked.close()


def test_kept_hold_sets_the_done_marker(redis_client: redis.Redis) -> None:
    holder = _task(redis_client, "h")
    assert holder.acquire(blocking=False)
    _queue(redis_client, holder, "w")
    assert holder.finish(hold=5, done_ttl=60) is None
    assert redis_client.hget(holder.keys.lock, "h") == b"1"
    assert 0 < redis_client.pttl(holder.keys.lock) <= 5000
    assert 0 < redis_client.pttl(holder.done_key) <= 60_000
    assert redis_client.lrange(holder.keys.waiters, 0, -1) == [b"w"]  # still waiting
    holder.close()


def test_park_replies(redis_client: redis.Redis) -> None:
    first = _task(redis_client, "a")
    assert first.park("{}", keep_for=60, behind=True) is None  # free: not parked
    assert first.park("{}", keep_for=60) is True  # free: taken
    assert first.park("{}", keep_for=60, behind=True) is None  # its own
    again = _task(redis_client, "a")  # another delivery of the same run
    with pytest.raises(OwnerRunning):
        again.park("{}", keep_for=60)
    second = _task(redis_client, "b")
    wait = second.park("{}", keep_for=60, behind=True)
    assert isinstance(wait, int) and wait > 0 and wait is not True
    assert redis_client.lrange(first.parked, 0, -1) == [b"b"]
    assert second.park("{}", keep_for=60) is not True  # parked already: not queued twice
    assert redis_client.lrange(first.parked, 0, -1) == [b"b"]
    assert first.finish(hold=0, done_ttl=60) is not None  # handed to "b"
    with pytest.raises(OwnerFinished):
        _task(redis_client, "a").park("{}", keep_for=60)
    assert second.park("{}", keep_for=60) is True  # the hand-over taken up
    assert redis_client.hget(first.keys.lock, "b") == b"1"
    for lock in (first, again, second):
        lock.close()


def test_sweep_hands_a_free_lock_over_then_resends(redis_client: redis.Redis) -> None:
    holder = _task(redis_client, "h")
    parked = _task(redis_client, "p")
    assert holder.acquire(blocking=False)
    assert parked.park('{"task": "t"}', keep_for=60) is not True
    holder.close()
    lock = holder.keys.lock
    redis_client.delete(lock)  # the holder vanished
    registry = "redislock:parked"
    keys = [
        lock,
        holder.keys.channel,
        holder.keys.fence,
        holder.parked,
        holder.parked_messages,
        lock + b":parked:unused",
        holder.dispatched,
        registry,
    ]
    sweep = scripts_for(redis_client).sweep
    reply = sweep(keys=keys, args=[300_000, 1000, 100])
    token = int(redis_client.hget(lock, "__fence__"))
    assert reply == [1, b'{"task": "t"}', b"p", token]
    assert redis_client.hget(lock, "p") == b"0"
    assert sweep(keys=keys, args=[300_000, 1000, 100]) == [0]  # just handed over
    redis_client.hset(holder.dispatched, "p", 1)  # handed over long ago, never started
    reply = sweep(keys=keys, args=[300_000, 1000, 100])
    assert reply[:3] == [1, b'{"task": "t"}', b"p"]
    sent = redis_client.hget(holder.dispatched, "p")
    assert reply[3] == f"{token}s".encode() + sent
    assert parked.park('{"task": "t"}', keep_for=60) is True  # the message ran
    assert parked.finish(hold=0, done_ttl=60) is None
    assert sweep(keys=keys, args=[300_000, 1000, 100]) == [-1]  # nothing left: forgotten
    parked.close()


def test_acquire_drops_lapsed_places_and_takes_its_own(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, NAME, owner="me", auto_renew=False)
    _queue(redis_client, lock, "gone", keep_ms=-1000)
    _queue(redis_client, lock, "me")
    _queue(redis_client, lock, "next")
    redis_client.hset(_wake(lock), mapping={"gone": "s:n.1:1000", "me": "s:m.1:1000"})
    assert lock.acquire(blocking=False)
    assert redis_client.lrange(lock.keys.waiters, 0, -1) == [b"next"]
    assert redis_client.zrange(lock.keys.claims, 0, -1) == [b"next"]
    assert redis_client.hlen(_wake(lock)) == 0
    lock.release()
    other = RedisLock(redis_client, NAME, owner="other", auto_renew=False)
    assert not other.acquire(blocking=False)  # "next" was handed it
    assert redis_client.hget(lock.keys.lock, "next") == b"0"


def test_free_lock_waits_for_the_first_in_line(redis_client: redis.Redis) -> None:
    _queue(redis_client, RedisLock(redis_client, NAME), "first")
    lock = RedisLock(redis_client, NAME, owner="me", auto_renew=False)
    assert not lock.acquire(blocking=False)
    assert redis_client.exists(lock.keys.lock) == 0
    assert redis_client.lrange(lock.keys.waiters, 0, -1) == [b"first"]  # not joined: one try


def test_force_release_and_leave_pass_the_lock_on(redis_client: redis.Redis) -> None:
    holder = RedisLock(redis_client, NAME, owner="h", auto_renew=False)
    assert holder.acquire(blocking=False)
    _queue(redis_client, holder, "w1")
    _queue(redis_client, holder, "w2")
    assert RedisLock.force_release(redis_client, NAME)
    assert redis_client.hget(holder.keys.lock, "w1") == b"0"
    assert 0 < redis_client.pttl(holder.keys.lock) <= 2000
    release = scripts_for(redis_client).release
    keys = holder.keys.release_keys()
    assert release(keys=keys, args=["w1", "leave"]) == 0  # passes its grant on
    assert redis_client.hget(holder.keys.lock, "w2") == b"0"
    assert release(keys=keys, args=["w3", "leave"]) == -3  # held nothing
    assert not RedisLock.force_release(redis_client, "other")


# -- deliberate changes of the refactor (these fail on the code before it) ---------------


def test_park_on_a_free_lock_waits_behind_the_first_in_line(redis_client: redis.Redis) -> None:
    """park.lua now honours the line of a free lock as acquire.lua does: a parking task
    no longer jumps ahead of a blocked acquire whose place is first."""
    task = _task(redis_client, "t")
    _queue(redis_client, task, "first")
    wait = task.park("{}", keep_for=60)
    assert wait is not True and isinstance(wait, int) and 0 < wait <= 1000
    assert redis_client.exists(task.keys.lock) == 0
    assert redis_client.lrange(task.parked, 0, -1) == [b"t"]
    assert redis_client.lrange(task.keys.waiters, 0, -1) == [b"first"]
    task.close()


def test_a_voided_attempt_is_refused_not_finished(redis_server: object) -> None:
    """acquire.lua answers an attempt at or below the sender's void record {0, 0} (not
    taken), no longer {-1, 0}, the done marker's reply."""
    from celery_redislock import RedLock

    client = redis_server.client()  # type: ignore[attr-defined]
    client.flushall()
    lock = RedLock([client], NAME, owner="o", auto_renew=False)
    keys, argv = lock._numbered("o", True, 10_000)
    client.set(keys[-1], argv[-1])  # the sender voided this attempt before it landed
    assert scripts_for(client).acquire(keys=keys, args=argv) == [0, 0]
    assert client.exists(lock.keys.lock) == 0
    client.close()
