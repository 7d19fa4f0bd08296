"""The rate limiters of bench/rates.py, and the body of its spawned workers.

Every worker bounds its own lifetime: its waits have timeouts and its loop ends at a
deadline. Times are wall-clock seconds (``time.time()``): the same clock as the private
redis-server's ``TIME`` on this machine, so our slots (server time) and the peers'
admissions (client time) are on one axis.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from typing import Any

import redis

#: The columns: ours, and Dramatiq's two Redis-backed rate limiters.
LIBS = ("ours", "window", "bucket")
LABELS = {
    "ours": "celery_redislock",
    "window": "dramatiq Window",
    "bucket": "dramatiq Bucket",
    "floor": "floor (PING)",
}


class CountingConnection(redis.Connection):
    """Counts the requests written (a command, or a whole pipeline): round trips."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        super().send_packed_command(command, check_health)


def client_for(url: str, counting: bool = False) -> redis.Redis:
    extra: dict[str, Any] = {"connection_class": CountingConnection} if counting else {}
    return redis.Redis.from_url(url, socket_timeout=15, socket_connect_timeout=5, **extra)


class Limiter:
    """One library's limiter of ``count`` per second behind one call: ``admit()``, True
    when admitted now (ours: after sleeping to its slot), with the admission's moment."""

    def __init__(self, lib: str, client: redis.Redis, name: str, count: int, burst: int):
        self.lib = lib
        if lib == "ours":
            from celery_redislock import RedisRateLimiter

            self.ours = RedisRateLimiter(client, name, (count, 1), burst=burst)
        else:
            from dramatiq.rate_limits import BucketRateLimiter, WindowRateLimiter
            from dramatiq.rate_limits.backends import RedisBackend

            backend = RedisBackend(client=client)
            if lib == "window":
                self.peer = WindowRateLimiter(backend, name, limit=count, window=1)
            else:
                self.peer = BucketRateLimiter(backend, name, limit=count, bucket=1000)

    def try_once(self) -> bool:
        """One non-blocking attempt (the uncontended measurement)."""
        if self.lib == "ours":
            return self.ours.acquire(blocking=False)
        with self.peer.acquire(raise_on_failure=False) as acquired:
            return bool(acquired)


def contended_worker(
    lib: str,
    url: str,
    name: str,
    count: int,
    burst: int,
    poll: float,
    ready_q: Any,
    go: Any,
    start_at: Any,
    duration: float,
    out_q: Any,
) -> None:
    """Be admitted as fast as the limiter allows from ``start_at`` for ``duration`` s.

    Ours: ``reserve()``, then a sleep for its wait (what ``acquire()`` does), so the slot's
    server-clock moment is recorded. Dramatiq's limiters do not wait: a refused attempt
    sleeps ``poll`` seconds and tries again (an admitted one tries again at once).
    Reports (pid, admission moments in microseconds, attempts, requests sent).
    """
    warnings.simplefilter("ignore")
    try:
        client = client_for(url, counting=True)
        limiter = Limiter(lib, client, name, count, burst)
        client.ping()
        ready_q.put(os.getpid())
        if not go.wait(60):
            out_q.put((os.getpid(), "error", "go not received"))
            return
        start, end = start_at.value, start_at.value + duration
        time.sleep(max(0.0, start - time.time()))
        CountingConnection.sent = 0
        stamps: list[int] = []
        attempts = 0
        while True:
            attempts += 1
            if lib == "ours":
                slot = limiter.ours.reserve()
                if slot.due_us > end * 1_000_000:
                    break
                stamps.append(slot.due_us)
                time.sleep(slot.wait)
                continue
            if time.time() > end:
                attempts -= 1
                break
            with limiter.peer.acquire(raise_on_failure=False) as acquired:
                if acquired:
                    stamps.append(round(time.time() * 1_000_000))
            if not acquired:
                time.sleep(poll)
        out_q.put((os.getpid(), stamps, attempts, CountingConnection.sent))
    except Exception:
        out_q.put((os.getpid(), "error", traceback.format_exc()))
