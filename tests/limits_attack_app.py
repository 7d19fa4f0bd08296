"""Limited tasks for tests/celery/test_limits_attack.py, on the test app of
``tests.celery_app`` (``celery -A tests.limits_attack_app worker`` runs that app with
these tasks added).

Every task here shares the key ``cap:{tenant}`` and records what it did with writes that
survive a restart of the Redis they go to (retried until it answers), so an oracle can
count every run even when the server restarts under it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from celery_redislock.task import LockedTask

from .celery_app import app, r

__all__ = ["app"]

#: One run: "<tenant> <run id> <token> <limit> <enter> <leave> <pid>".
RUNS = "attack:runs"


def record(key: str, value: str) -> None:
    """RPUSH that waits for a restarting server (up to 30 s) instead of failing the task."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            r().rpush(key, value)
            return
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _run(task: Any, tenant: str, seconds: float, limit: int) -> int:
    token = int(task.lock.token)
    enter = time.time()
    record(f"attack:started:{tenant}", f"{task.request.id} {token} {os.getpid()}")
    time.sleep(seconds)
    run_id = task.request.id
    if task.request.retries:
        run_id += f"~r{task.request.retries}"
    record(RUNS, f"{tenant} {run_id} {token} {limit} {enter!r} {time.time()!r} {os.getpid()}")
    return token


@app.task(bind=True, base=LockedTask, lock_key="cap:{tenant}", lock_limit=2)
def capped(self: Any, tenant: str, seconds: float) -> int:
    """At most two at once per tenant."""
    return _run(self, tenant, seconds, 2)


def _limit_of(args: Any, kwargs: Any) -> int:
    return int(kwargs.get("limit", 2))


@app.task(bind=True, base=LockedTask, lock_key="cap:{tenant}", lock_limit=_limit_of)
def capped_at(self: Any, tenant: str, seconds: float, limit: int = 2) -> int:
    """Shares ``capped``'s permits; its limit is the call's ``limit``."""
    return _run(self, tenant, seconds, limit)


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="cap:{tenant}",
    lock_limit=2,
    max_retries=2,
    lock_release_on_retry=False,
)
def capped_retry_keeping(self: Any, tenant: str, work: float) -> int:
    """Keeps its permit across one retry (adopted by the retry's run), then works."""
    record(f"attack:attempts:{tenant}", f"{self.request.retries} {self.lock.token}")
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)
    return _run(self, tenant, work, 2)


@app.task(bind=True, base=LockedTask, lock_key="cap:{tenant}", lock_limit=2, max_retries=2)
def capped_retry_no_throw(self: Any, tenant: str, work: float) -> str:
    """``self.retry(throw=False)``: the first run returns, and its retry runs too."""
    _run(self, tenant, work, 2)
    if self.request.retries == 0:
        self.retry(countdown=0, throw=False)
        return "first"
    return "retried"


@app.task(bind=True, base=LockedTask, lock_key="cap:{tenant}", lock_limit=2)
def capped_replace(self: Any, tenant: str, step: int = 0) -> str:
    """Replaces itself (same key) with its next step; the last step returns."""
    record(f"attack:steps:{tenant}", f"{step} {self.request.id} {self.lock.token}")
    if step < 2:
        raise self.replace(capped_replace.s(tenant, step + 1))
    return f"step {step}"
