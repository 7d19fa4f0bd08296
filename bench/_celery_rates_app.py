"""The Celery app the rate benchmark's workers load (``bench/celery_rates.py``).

One task per variant, each recording its start (``time.time()``, and for ours the slot
its rate booked) in the list ``<RATES_PREFIX>starts`` as ``<start> <slot us> <id>``:

* ``rates.ours``      ``LockedTask`` with ``lock_rate`` (deferred to its slot, no lock);
* ``rates.celery``    Celery's own ``rate_limit`` (a token bucket in each worker);
* ``rates.dramatiq``  a plain task taking Dramatiq's ``WindowRateLimiter`` (Redis
  backend), ``self.retry(countdown=...)`` when refused (Dramatiq's own answer).

Configured from the environment (set by the benchmark): ``RATES_URL`` (broker, limiter
and data: one private redis-server), ``RATES_PREFIX``, ``RATES_QUEUE``, ``RATES_RATE``
("20/s").
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redislock.task import LockedTask

URL = os.environ.get("RATES_URL", "redis://127.0.0.1:1/0")  # never the default 6379
PREFIX = os.environ.get("RATES_PREFIX", "rates:")
RATE = os.environ.get("RATES_RATE", "20/s")
COUNT, _, UNIT = RATE.partition("/")
WINDOW_S = {"s": 1, "m": 60, "h": 3600}[UNIT]

app = Celery("bench._celery_rates_app")
app.conf.update(
    broker_url=URL,
    redislock_url=URL,
    task_default_queue=os.environ.get("RATES_QUEUE", "rates"),
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_client: tuple[int, redis.Redis] | None = None


def client() -> redis.Redis:
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(URL))
    return _client[1]


def record(task_id: str, slot_us: int = 0) -> None:
    client().rpush(PREFIX + "starts", f"{time.time():.6f} {slot_us} {task_id}")


@app.task(
    bind=True,
    base=LockedTask,
    name="rates.ours",
    lock_key="merchant:{merchant}",
    lock_limit=None,
    lock_rate=RATE,
)
def ours(self: Any, merchant: str) -> None:
    record(self.request.id, self.request.redislock_rate_slot_us)


@app.task(bind=True, name="rates.celery", rate_limit=RATE)
def celery_rate(self: Any, merchant: str) -> None:
    record(self.request.id)


_limiter: Any = None


@app.task(bind=True, name="rates.dramatiq", max_retries=None)
def dramatiq_rate(self: Any, merchant: str) -> None:
    global _limiter
    if _limiter is None:
        from dramatiq.rate_limits import WindowRateLimiter
        from dramatiq.rate_limits.backends import RedisBackend

        backend = RedisBackend(client=client())
        _limiter = WindowRateLimiter(
            backend, f"{PREFIX}dq:{merchant}", limit=int(COUNT), window=WINDOW_S
        )
    with _limiter.acquire(raise_on_failure=False) as acquired:
        if not acquired:
            client().incr(PREFIX + "refused")
            raise self.retry(countdown=0.05)
        record(self.request.id)
