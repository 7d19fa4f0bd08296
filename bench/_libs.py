"""One small adapter per lock library, so every scenario drives them the same way.

Each adapter uses its library's own blocking wait, as that library's docs intend:

* celery_redislock: ``acquire(blocking=True, timeout=...)`` (pub/sub wake-up, lease-bounded);
* redis-py: ``client.lock(name, timeout=ttl, sleep=...)`` then
  ``acquire(blocking=True, blocking_timeout=...)`` (sleep polling);
* python-redis-lock: ``Lock(client, name, expire=...)`` then
  ``acquire(blocking=True, timeout=...)`` (BLPOP on a signal list);
* pottery: ``Redlock(key=..., masters={client}, auto_release_time=...)`` then
  ``acquire(blocking=True, timeout=...)`` (random 0-200 ms sleep polling).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import redis

LIBS = ("ours", "redispy", "redispy_fast", "prl", "pottery")
LABELS = {
    "ours": "celery_redislock",
    "redispy": "redis-py sleep=.1",
    "redispy_fast": "redis-py sleep=.001",
    "prl": "python-redis-lock",
    "pottery": "pottery Redlock",
    "floor": "floor (2 RTT)",
    "token": "floor (BLPOP token)",
}


class Adapter:
    """acquire(timeout) -> bool (blocking; timeout None = no limit), try_acquire(), release()."""

    def __init__(self, lib: str, client: Any, name: str, ttl: float, *, renew: bool = True):
        self.lib = lib
        self.ttl = ttl
        if lib == "ours":
            from celery_redislock import RedisLock

            self.lock = RedisLock(client, name, ttl=ttl, auto_renew=renew)
        elif lib in ("redispy", "redispy_fast"):
            sleep = 0.1 if lib == "redispy" else 0.001
            self.lock = client.lock(name, timeout=ttl, sleep=sleep)
        elif lib == "prl":
            import redis_lock

            # python-redis-lock has no batched renewal; auto_renewal=True is a thread per lock.
            self.lock = redis_lock.Lock(client, name, expire=int(ttl), auto_renewal=False)
        elif lib == "pottery":
            from pottery import Redlock

            self.lock = Redlock(key=name, masters={client}, auto_release_time=ttl)
        elif lib == "floor":
            self.lock = client.register_script("return 1")
        elif lib == "token":
            self.client, self.name = client, name
            self.lock = None
        else:
            raise ValueError(f"unknown lib {lib!r}")

    def acquire(self, timeout: float | None) -> bool:
        lib, lock = self.lib, self.lock
        if lib == "ours":
            return bool(lock.acquire(blocking=True, timeout=timeout))
        if lib in ("redispy", "redispy_fast"):
            return bool(lock.acquire(blocking=True, blocking_timeout=timeout))
        if lib == "prl":
            # python-redis-lock wants whole seconds (and, without renewal, <= expire).
            t = None if timeout is None else max(1, math.ceil(timeout))
            return bool(lock.acquire(blocking=True, timeout=t))
        if lib == "pottery":
            return bool(lock.acquire(blocking=True, timeout=-1 if timeout is None else timeout))
        if lib == "floor":
            lock()
            return True
        if lib == "token":
            wait = 0 if timeout is None else timeout
            return self.client.blpop([self.name], timeout=wait) is not None
        raise AssertionError(lib)

    def try_acquire(self) -> bool:
        lib, lock = self.lib, self.lock
        if lib == "ours":
            return bool(lock.acquire(blocking=False))
        if lib in ("redispy", "redispy_fast", "prl", "pottery"):
            return bool(lock.acquire(blocking=False))
        return self.acquire(None)

    def release(self) -> None:
        if self.lib == "floor":
            self.lock()
        elif self.lib == "token":
            self.client.lpush(self.name, "token")
        else:
            self.lock.release()


def seed_token(client: Any, name: str) -> None:
    """Put the one token of a ``token`` floor in its list (and nothing else)."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(name)
    pipe.lpush(name, "token")
    pipe.execute()


def make(lib: str, client: Any, name: str, ttl: float, *, renew: bool = True) -> Adapter:
    return Adapter(lib, client, name, ttl, renew=renew)


def hold_lease(lib: str, client: Any, name: str, ttl: float) -> Adapter:
    """A lock whose lease is NOT renewed (the dead-holder scenario's holder)."""
    return Adapter(lib, client, name, ttl, renew=False)


def process_client(url: str) -> Callable[[], redis.Redis]:
    """A getter of one client of ``url`` per process (a new one after a prefork fork): the
    benchmark apps' tasks write their records with it."""
    held: list[tuple[int, redis.Redis]] = []

    def client() -> redis.Redis:
        if not held or held[0][0] != os.getpid():
            held[:] = [(os.getpid(), redis.Redis.from_url(url, socket_timeout=30))]
        return held[0][1]

    return client
