"""The running-on attack tests' worker app (``celery -A tests.runon_attack_app worker``):
``tests.runon_app``'s app and tasks, with a ``task_postrun`` receiver that stalls after a
run of ``runon.slow_post`` (``REDISLOCK_TEST_POSTRUN_SLEEP`` seconds), a ``task_prerun``
receiver that stalls a delivery sent with the ``stall_prerun`` header (seconds), a task
that retries itself once, and tasks that end otherwise than by returning (an exception,
``Ignore``, ``Reject(requeue=True)``, ``self.replace()``)."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import signals
from celery.exceptions import Ignore, Reject

from celery_redislock.task import LockedTask

from .runon_app import _section, app, job, limited, off, r

__all__ = [
    "app",
    "job",
    "limited",
    "off",
    "slow_post",
    "flaky",
    "boom",
    "ignored",
    "rejected",
    "replacer",
]

POSTRUN_SLEEP = float(os.environ.get("REDISLOCK_TEST_POSTRUN_SLEEP", "0"))


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.slow_post")
def slow_post(self: Any, name: str, seconds: float = 0.0) -> int:
    """Same key as ``runon.job``; the app's task_postrun receiver stalls after it."""
    return _section(self, name, seconds)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.flaky", max_retries=3)
def flaky(self: Any, name: str, seconds: float = 0.0) -> int:
    """Same key: its first run retries itself (no delay), its retry returns."""
    token = _section(self, name, seconds)
    if not self.request.retries:
        raise self.retry(countdown=0)
    return token


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.boom")
def boom(self: Any, name: str, seconds: float = 0.0) -> int:
    """Same key: raises ValueError after its section."""
    _section(self, name, seconds)
    raise ValueError("boom")


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.ignored")
def ignored(self: Any, name: str, seconds: float = 0.0) -> int:
    """Same key: raises Ignore after its section."""
    _section(self, name, seconds)
    raise Ignore()


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.rejected")
def rejected(self: Any, name: str, seconds: float = 0.0) -> int:
    """Same key: raises Reject(requeue=True) after its section (marked done all the same)."""
    _section(self, name, seconds)
    raise Reject("no", requeue=True)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", name="runon.replacer")
def replacer(self: Any, name: str, seconds: float = 0.0) -> Any:
    """Same key: replaces itself with ``runon.job`` on the same key after its section."""
    _section(self, name, seconds)
    return self.replace(job.si(name, seconds))


@signals.task_postrun.connect
def _stall(sender: Any = None, task: Any = None, **_: Any) -> None:
    """(Connected at import: before the run-on runner, as an app's own receivers are.)"""
    if task is not None and task.name == "runon.slow_post" and POSTRUN_SLEEP:
        r().rpush("postrun:stalled", str(time.monotonic()))
        time.sleep(POSTRUN_SLEEP)


@signals.task_prerun.connect
def _stall_before(sender: Any = None, task: Any = None, **_: Any) -> None:
    """A delivery sent with the header ``stall_prerun`` (seconds) stalls before its body's
    acquire, its process's pid logged in ``prerun:stalled``."""
    seconds = getattr(getattr(task, "request", None), "stall_prerun", None)
    if seconds:
        r().rpush("prerun:stalled", f"{task.request.id} {os.getpid()}")
        time.sleep(float(seconds))
