"""Last-call-wins tasks for tests/celery/test_latest*.py, on the test app of
``tests.celery_app`` (``celery -A tests.latest_app worker`` runs that app with these
tasks added).

Every run records one line in ``lw:runs:<key>``: "<tag> <task id> <enter> <leave>", so
an oracle counts every run (copies included), its arguments, and when it ran.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_redislock.task import LockedTask

from .celery_app import app, r

__all__ = ["app"]

DEBOUNCE = float(os.environ.get("REDISLOCK_TEST_DEBOUNCE", "0.5"))
DEBOUNCE_MAX = float(os.environ.get("REDISLOCK_TEST_DEBOUNCE_MAX", "1.0"))


def runs_key(key: str) -> str:
    return f"lw:runs:{key}"


def _run(task: Any, key: str, tag: str, seconds: float) -> str:
    enter = time.time()
    time.sleep(seconds)
    line = f"{tag} {task.request.id} {enter:.6f} {time.time():.6f}"
    r().rpush(runs_key(key), line)
    return tag


@app.task(bind=True, base=LockedTask, lock_key="lw:{key}", on_contention="replace", lock_ttl=5)
def rebuild(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """One run and the newest pending call per key."""
    return _run(self, key, tag, seconds)


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="lw:{key}",
    on_contention="replace",
    lock_limit=2,
    lock_ttl=5,
)
def rebuild_two(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """Two runs and the newest pending call per key."""
    return _run(self, key, tag, seconds)


@app.task(bind=True, base=LockedTask, lock_key="lw:{key}", lock_debounce=DEBOUNCE, lock_ttl=5)
def reindex(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """Runs once its key has been quiet for DEBOUNCE seconds, with the newest arguments."""
    return _run(self, key, tag, seconds)


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="lw:{key}",
    lock_debounce=DEBOUNCE,
    lock_debounce_max=DEBOUNCE_MAX,
    lock_ttl=5,
)
def reindex_bounded(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """As :func:`reindex`, waiting at most DEBOUNCE_MAX from the oldest pending call."""
    return _run(self, key, tag, seconds)
