"""One small adapter per semaphore, so every scenario of bench/semaphores.py drives them
the same way: ``acquire(timeout) -> bool`` (blocking; ``None``: no limit), ``release()``.

* ``ours``: ``RedisSemaphore(client, name, limit=N, ttl=...)``, ``acquire(timeout=...)``:
  waits in a first-come-first-served line, woken by the release that frees its permit.
* ``dramatiq``: Dramatiq's ``ConcurrentRateLimiter`` on its ``RedisBackend``. It has no
  blocking wait (an over-limit Dramatiq actor raises ``RateLimitExceeded`` and is retried
  later), so a caller that wants to wait loops over its public
  ``limiter.acquire(raise_on_failure=False)`` context manager, sleeping ``poll`` between
  tries. Its ``ttl`` is the counter key's expiry (refreshed by every take and give-back),
  not a lease per holder.
* ``zset``: the "fair semaphore" of *Redis in Action* (section 6.3.2, listing 6.14, as
  redis.io publishes it), written here with redis-py: a ZSET of holders scored by the
  client's clock (entries older than ``timeout`` are dropped), an "owner" ZSET scored by a
  counter (INCR: a strictly increasing number per try, usable as a fencing token), a
  holder being one whose rank in the owner ZSET is below the limit. Two MULTI/EXEC
  transactions per try, as published (the book later wraps it in a lock to close the race
  between them: the bench shows whether that race let more than N in). Waiting is a
  sleep-poll loop, ``poll`` between tries.
* ``mutex``: our ``RedisLock`` (the uncontended row only: what one permit costs beside one
  lock).
* ``floor``: two ``PING`` round trips (the uncontended row only).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

#: Semaphores compared in every scenario; the poll interval of each polling one in ms.
LIBS = ("ours", "dramatiq", "dramatiq_fast", "zset", "zset_fast")
POLL_MS = {"dramatiq": 10.0, "dramatiq_fast": 1.0, "zset": 10.0, "zset_fast": 1.0}
LABELS = {
    "ours": "RedisSemaphore",
    "dramatiq": "dramatiq poll 10ms",
    "dramatiq_fast": "dramatiq poll 1ms",
    "zset": "zset recipe 10ms",
    "zset_fast": "zset recipe 1ms",
    "mutex": "RedisLock (mutex)",
    "floor": "floor (2 PING)",
}


class FairSemaphore:
    """*Redis in Action*'s fair semaphore (``acquire_fair_semaphore`` /
    ``release_fair_semaphore``), with a sleep-poll wait around its single try."""

    def __init__(self, client: Any, name: str, limit: int, timeout: float, poll: float) -> None:
        self.client = client
        self.name = name
        self.owners = name + ":owner"
        self.counter = name + ":counter"
        self.limit = limit
        self.timeout = timeout
        self.poll = poll
        self.identifier: str | None = None
        self.token: int | None = None  # the counter value of the winning try

    def try_acquire(self) -> bool:
        identifier = str(uuid.uuid4())
        now = time.time()
        pipe = self.client.pipeline(True)
        pipe.zremrangebyscore(self.name, "-inf", now - self.timeout)
        pipe.zinterstore(self.owners, {self.owners: 1, self.name: 0})
        pipe.incr(self.counter)
        counter = pipe.execute()[-1]
        pipe.zadd(self.name, {identifier: now})
        pipe.zadd(self.owners, {identifier: counter})
        pipe.zrank(self.owners, identifier)
        if pipe.execute()[-1] < self.limit:
            self.identifier, self.token = identifier, int(counter)
            return True
        pipe.zrem(self.name, identifier)
        pipe.zrem(self.owners, identifier)
        pipe.execute()
        return False

    def acquire(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.try_acquire():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.poll)
        return True

    def release(self) -> None:
        assert self.identifier is not None, "not acquired"
        pipe = self.client.pipeline(True)
        pipe.zrem(self.name, self.identifier)
        pipe.zrem(self.owners, self.identifier)
        pipe.execute()
        self.identifier = None


class DramatiqSemaphore:
    """Dramatiq's ``ConcurrentRateLimiter`` used through its public context manager, with
    a sleep-poll wait (it has none of its own)."""

    def __init__(self, client: Any, name: str, limit: int, ttl: float, poll: float) -> None:
        from dramatiq.rate_limits import ConcurrentRateLimiter
        from dramatiq.rate_limits.backends import RedisBackend

        backend = RedisBackend(client=client)
        self.limiter = ConcurrentRateLimiter(backend, name, limit=limit, ttl=int(ttl * 1000))
        self.poll = poll
        self._held: Any = None

    def try_acquire(self) -> bool:
        attempt = self.limiter.acquire(raise_on_failure=False)
        if attempt.__enter__():
            self._held = attempt
            return True
        attempt.__exit__(None, None, None)
        return False

    def acquire(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.try_acquire():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.poll)
        return True

    def release(self) -> None:
        held, self._held = self._held, None
        assert held is not None, "not acquired"
        held.__exit__(None, None, None)


class Adapter:
    """``acquire(timeout) -> bool``, ``release()`` over one of :data:`LIBS` (or ``mutex``,
    ``floor``, ``ours_norenew``)."""

    def __init__(self, lib: str, client: Any, name: str, limit: int, ttl: float) -> None:
        self.lib = lib
        self.client = client
        if lib in ("ours", "ours_norenew"):
            from celery_redislock import RedisSemaphore

            self.impl: Any = RedisSemaphore(
                client, name, limit=limit, ttl=ttl, auto_renew=lib == "ours"
            )
        elif lib == "mutex":
            from celery_redislock import RedisLock

            self.impl = RedisLock(client, name, ttl=ttl)
        elif lib in ("dramatiq", "dramatiq_fast"):
            self.impl = DramatiqSemaphore(client, name, limit, ttl, POLL_MS[lib] / 1e3)
        elif lib in ("zset", "zset_fast"):
            self.impl = FairSemaphore(client, name, limit, ttl, POLL_MS[lib] / 1e3)
        elif lib == "floor":
            self.impl = None
        else:
            raise ValueError(f"unknown lib {lib!r}")

    def acquire(self, timeout: float | None) -> bool:
        if self.lib == "floor":
            self.client.ping()
            return True
        if self.lib in ("ours", "ours_norenew", "mutex"):
            return bool(self.impl.acquire(blocking=True, timeout=timeout))
        return bool(self.impl.acquire(timeout))

    def release(self) -> None:
        if self.lib == "floor":
            self.client.ping()
        else:
            self.impl.release()


def make(lib: str, client: Any, name: str, limit: int, ttl: float) -> Adapter:
    return Adapter(lib, client, name, limit, ttl)
