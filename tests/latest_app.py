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
#: A quiet period long enough for a test to act (kill a worker) while a call is pending.
LONG_DEBOUNCE = 3.0
#: A quiet period no test waits for (calls stay pending for the test's length).
VERY_LONG_DEBOUNCE = 120.0
#: How long a gated run waits for its gate at most.
GATE_TIMEOUT = 60.0


def runs_key(key: str) -> str:
    return f"lw:runs:{key}"


def gate_key(key: str) -> str:
    """Set by a test to end the gated runs of ``key`` (after their ``seconds``)."""
    return f"lw:gate:{key}"


def _run(task: Any, key: str, tag: str, seconds: float, gate: bool = False) -> str:
    enter = time.time()
    time.sleep(seconds)
    deadline = time.monotonic() + GATE_TIMEOUT
    while gate and not r().exists(gate_key(key)) and time.monotonic() < deadline:
        time.sleep(0.02)
    line = f"{tag} {task.request.id} {enter:.6f} {time.time():.6f}"
    r().rpush(runs_key(key), line)
    return tag


@app.task(bind=True, base=LockedTask, lock_key="lw:{key}", on_contention="replace", lock_ttl=5)
def rebuild(self: Any, key: str, tag: str, seconds: float = 0.0, gate: bool = False) -> str:
    """One run and the newest pending call per key (``gate``: the run lasts ``seconds``,
    and until :func:`gate_key` is set)."""
    return _run(self, key, tag, seconds, gate)


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


@app.task(bind=True, base=LockedTask, lock_key="lw:{key}", lock_debounce=LONG_DEBOUNCE, lock_ttl=5)
def reindex_long(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """As :func:`reindex`, with a quiet period of LONG_DEBOUNCE."""
    return _run(self, key, tag, seconds)


@app.task(
    bind=True, base=LockedTask, lock_key="lw:{key}", lock_debounce=VERY_LONG_DEBOUNCE, lock_ttl=5
)
def reindex_later(self: Any, key: str, tag: str, seconds: float = 0.0) -> str:
    """As :func:`reindex`, with a quiet period of VERY_LONG_DEBOUNCE."""
    return _run(self, key, tag, seconds)
