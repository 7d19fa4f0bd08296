"""Last-call-wins tasks for tests/celery/test_latest_attack.py, on the test app of
``tests.celery_app`` (``celery -A tests.latest_attack_app worker``).

Every run records one line in ``l19:runs:<key>``: "<tag> <task id> <retries> <enter>
<leave>", so an oracle counts every run (copies and retries included) and its arguments.
Every task of one ``key`` shares the lock ``l19:<key>`` (mixed policies on one key).
"""

from __future__ import annotations

import time
from typing import Any

from celery_redislock.celery.latest import SENT_HEADER
from celery_redislock.task import LockedTask

from .celery_app import app, r

__all__ = ["app"]

DEBOUNCE = 0.5
KEY = "l19:{key}"


def runs_key(key: str) -> str:
    return f"l19:runs:{key}"


def _run(task: Any, key: str, tag: str, seconds: float) -> str:
    enter = time.time()
    time.sleep(seconds)
    request = task.request
    line = f"{tag} {request.id} {request.retries or 0} {enter:.6f} {time.time():.6f}"
    r().rpush(runs_key(key), line)
    return tag


@app.task(bind=True, base=LockedTask, lock_key=KEY, on_contention="replace", lock_ttl=3)
def replace(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """One run and the newest pending call per key."""
    return _run(self, key, tag, seconds)


@app.task(bind=True, base=LockedTask, lock_key=KEY, lock_debounce=DEBOUNCE, lock_ttl=3)
def debounced(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """Runs once its key has been quiet for DEBOUNCE seconds (no bound)."""
    return _run(self, key, tag, seconds)


@app.task(bind=True, base=LockedTask, lock_key=KEY, lock_ttl=3)
def requeue(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """The default policy (parked behind the holder, every call runs), on the same key."""
    return _run(self, key, tag, seconds)


@app.task(
    bind=True, base=LockedTask, lock_key=KEY, on_contention="replace", lock_limit=2, lock_ttl=3
)
def replace_two(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    return _run(self, key, tag, seconds)


@app.task(
    bind=True,
    base=LockedTask,
    lock_key=KEY,
    on_contention="replace",
    lock_ttl=3,
    max_retries=3,
    default_retry_delay=0.5,
)
def retrying(self: Any, key: str, tag: str, seconds: float = 0.0, retry: int = 1) -> str:
    """Runs ``seconds``, then calls ``self.retry()`` until it has retried ``retry`` times;
    every attempt is recorded (a retry's tag ends "/r<n>")."""
    attempt = self.request.retries or 0
    _run(self, key, f"{tag}/r{attempt}", seconds)
    if attempt < retry:
        raise self.retry(countdown=0.5)
    return tag


@app.task(bind=True)
def sent_header(self: Any) -> Any:
    """What a worker sees of a message's SENT header (request.headers and attribute)."""
    headers = self.request.headers
    return {
        "headers": None if headers is None else headers.get(SENT_HEADER),
        "attribute": getattr(self.request, SENT_HEADER, None),
    }


@app.task(bind=True)
def follow(self: Any, value: Any, key: str) -> Any:
    """A chain's next link: records that it ran, after what."""
    r().rpush(f"l19:follow:{key}", f"{value} {self.request.id}")
    return value
