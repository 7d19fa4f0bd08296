"""The Celery app of the running-on tests (``celery -A tests.runon_app worker``).

Broker and results on the private redis-server the test passes in ``REDISLOCK_TEST_URL``;
locks there too, or in ``REDISLOCK_TEST_LOCK_URL`` (another database: parked tasks are then
signatures, parked by pool processes). ``REDISLOCK_TEST_TTL``: the locks' lease;
``REDISLOCK_TEST_RUN_ON_GRACE``: the sweeper's least wait before a run-on task whose
process died goes back to the line; ``REDISLOCK_TEST_RUN_ON``: ``redislock_run_on`` (30 s).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redislock.celery import sweeper
from celery_redislock.task import LockedTask

URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6399/0")

app = Celery("redislock_runon_tests", broker=URL, backend=URL)
app.conf.update(
    redislock_ttl=float(os.environ.get("REDISLOCK_TEST_TTL", "3")),
    redislock_run_on=float(os.environ.get("REDISLOCK_TEST_RUN_ON", "30")),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    result_expires=600,
    worker_hijack_root_logger=False,
)
if os.environ.get("REDISLOCK_TEST_LOCK_URL"):
    app.conf.redislock_url = os.environ["REDISLOCK_TEST_LOCK_URL"]
if os.environ.get("REDISLOCK_TEST_RUN_ON_GRACE"):
    sweeper.RUN_ON_GRACE = float(os.environ["REDISLOCK_TEST_RUN_ON_GRACE"])

_r: redis.Redis | None = None


def r() -> redis.Redis:
    global _r
    if _r is None:
        _r = redis.Redis.from_url(URL)
    return _r


def _section(task: Any, name: str, seconds: float) -> int:
    """Log the run's start (id, token, pid, time) and end: the test's oracle."""
    token = task.lock.token
    r().rpush(f"started:{name}", f"{task.request.id} {token} {os.getpid()} {time.monotonic()!r}")
    time.sleep(seconds)
    r().rpush(f"ended:{name}", f"{task.request.id} {time.monotonic()!r}")
    return int(token)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.job")
def job(self: Any, name: str, seconds: float = 0.0) -> int:
    return _section(self, name, seconds)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.limited", time_limit=60)
def limited(self: Any, name: str, seconds: float = 0.0) -> int:
    """Same key, with a time limit: never run on (its limit is the main process's)."""
    return _section(self, name, seconds)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.off", lock_run_on=0)
def off(self: Any, name: str, seconds: float = 0.0) -> int:
    """Same key, running on turned off for it: its release hands over through the broker."""
    return _section(self, name, seconds)
