"""Rate-limited tasks for tests/celery/test_rates_attack.py, on the test app of
``tests.celery_app`` (``celery -A tests.rates_attack_app worker`` runs that app with
these tasks added).

Every run records one line in ``ra:runs:<key>``: "<booked slot µs> <tag> <task id>
<retries> <replaced nesting>", so an oracle counts every run (copies included) and the
moment its rate admitted it.
"""

from __future__ import annotations

import os
from typing import Any

from celery_redislock.task import LockedTask

from .celery_app import app, r

__all__ = ["app"]

RATE = os.environ.get("REDISLOCK_TEST_ATTACK_RATE", "10/s")


def runs_key(key: str) -> str:
    return f"ra:runs:{key}"


def _record(task: Any, key: str, tag: str) -> None:
    request = task.request
    slot = getattr(request, "redislock_rate_slot_us", 0)
    nesting = request.replaced_task_nesting or 0
    line = f"{slot} {tag} {request.id} {request.retries} {nesting}"
    r().rpush(runs_key(key), line)


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="ra:{key}",
    lock_limit=None,
    lock_rate=RATE,
    max_retries=3,
)
def rated(self: Any, key: str, tag: str, how: str = "ok") -> str:
    """A rate only. ``how``: "ok"; "retry" (``self.retry()`` once, from its first run);
    "replace" (replaced by :func:`replaced`, keeping its chain)."""
    _record(self, key, tag)
    if how == "retry" and not self.request.retries:
        raise self.retry(countdown=0)
    if how == "replace":
        raise self.replace(replaced.s(key, tag))
    return tag


@app.task(bind=True, base=LockedTask, lock_key="ra:{key}", lock_rate=RATE, lock_ttl=5)
def rated_locked(self: Any, key: str, tag: str) -> str:
    """Under the lock ``ra:{key}`` and its rate: records its run."""
    _record(self, key, tag)
    return tag


@app.task(bind=True)
def replaced(self: Any, key: str, tag: str) -> str:
    """What :func:`rated` is replaced by: records that it ran."""
    r().rpush(f"ra:replaced:{key}", f"{tag} {self.request.id}")
    return f"replaced-{tag}"


@app.task(bind=True)
def after(self: Any, value: str, key: str) -> str:
    """A chain's next step, or a link: records the value it was given."""
    r().rpush(f"ra:after:{key}", f"{value} {self.request.id}")
    return value
