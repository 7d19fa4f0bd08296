"""This process's counts: the counters and wait-time histograms that
:mod:`celery_redislock.metrics` feeds from the signals, and their names.

A forked child starts from zero: its parent's counts are the parent's to flush.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from typing import Any

from ._process import on_fork

#: Upper bounds (seconds) of the wait-time histogram buckets; the last bucket is +inf.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COUNTERS = (
    "acquired",
    "contended",
    "released",
    "lost",
    "renewed",
    "parked",
    "requeued",
    "pulled",
    "release_failed",
    "parked_rejected",
    "rate_admitted",
    "deferred",
    "undeferred",
    "superseded",
    "debounced",
)

#: Counters of limited tasks' runs, per task name (fields ``<counter>@<task name>``):
#: runs that took a permit, and deferrals (parked, or re-queued with a countdown).
LIMIT_COUNTERS = ("limit_taken", "limit_parked", "limit_requeued")
#: Between a per-task field's metric and its task name (metric names have none).
TASK_SEPARATOR = "@"


#: The field of each wait-time bucket, the last +inf's.
_BUCKET_FIELDS = (*(f"wait_le_{bound}" for bound in WAIT_BUCKETS), "wait_le_inf")


def _bucket(seconds: float) -> str:
    return _BUCKET_FIELDS[bisect.bisect_left(WAIT_BUCKETS, seconds)]


def task_field(metric: str, task: str) -> str:
    """The stats field of ``metric`` for the limited task ``task``."""
    return f"{metric}{TASK_SEPARATOR}{task}"


class LockStats:
    """Thread-safe counters and wait-time histograms; ``drain()`` hands out deltas. The
    gauge of permits held per task name (``permits_held()``) is kept apart: not drained."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._counts: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._last_flush = time.monotonic()

    def add(self, field: str, amount: float = 1) -> None:
        with self._mutex:
            self._counts[field] = self._counts.get(field, 0) + amount

    def add_each(self, fields: tuple[str, ...], total: str, amount: float) -> None:
        """Add 1 to each of ``fields`` and ``amount`` to ``total``, under one lock."""
        with self._mutex:
            counts = self._counts
            for field in fields:
                counts[field] = counts.get(field, 0) + 1
            counts[total] = counts.get(total, 0.0) + amount

    def observe_wait(self, seconds: float, task: str | None = None) -> None:
        """Count a wait; with ``task``, a limited task's wait for its permit."""
        bucket, total = _bucket(seconds), "wait_sum"
        if task is not None:
            bucket, total = task_field("limit_" + bucket, task), task_field("limit_wait_sum", task)
        with self._mutex:
            self._counts[bucket] = self._counts.get(bucket, 0) + 1
            self._counts[total] = self._counts.get(total, 0.0) + float(seconds)

    def hold(self, task: str, step: int, then: Callable[[int], Any] | None = None) -> None:
        """A run of ``task`` took (``step`` 1) or ended its hold of (-1) a permit; ``then``
        gets the new count, in order (under the mutex). Never below 0: counting that
        starts while runs hold permits settles once they end."""
        with self._mutex:
            held = max(0, self._held.get(task, 0) + step)
            if held:
                self._held[task] = held
            else:
                self._held.pop(task, None)
            if then is not None:
                then(held)

    def permits_held(self) -> dict[str, int]:
        """Permits held by this process's runs, per task name (tasks holding none left out)."""
        with self._mutex:
            return dict(self._held)

    def snapshot(self) -> dict[str, float]:
        with self._mutex:
            return dict(self._counts)

    def drain(self) -> dict[str, float]:
        with self._mutex:
            counts, self._counts = self._counts, {}
            self._last_flush = time.monotonic()
            return counts

    def due(self, every: float) -> bool:
        return time.monotonic() - self._last_flush >= every

    def pending(self) -> bool:
        """Whether any count waits to be flushed."""
        return bool(self._counts)

    def _forked(self) -> None:
        """In a forked child: the parent's counts are the parent's to flush (a pool
        process flushing them too would count them twice), and it holds no permit."""
        self._mutex = threading.Lock()
        self._counts = {}
        self._held = {}


STATS = LockStats()
on_fork(STATS._forked)


def task_name(sender: Any) -> str:
    """The task name a ``task_*`` signal's sender (the task) is counted under."""
    return str(getattr(sender, "name", None) or "?")


#: Upper bounds (seconds) of the deferral-delay histogram buckets; the last is +inf.
DEFERRAL_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 3600.0)
