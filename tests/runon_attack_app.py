"""The running-on attack tests' worker app (``celery -A tests.runon_attack_app worker``):
``tests.runon_app``'s app and tasks, with a ``task_postrun`` receiver that stalls after a
run of ``runon.slow_post`` (``REDISLOCK_TEST_POSTRUN_SLEEP`` seconds) and a task that
retries itself once."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import signals

from celery_redislock.task import LockedTask

from .runon_app import _section, app, job, limited, off, r

__all__ = ["app", "job", "limited", "off", "slow_post", "flaky"]

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


@signals.task_postrun.connect
def _stall(sender: Any = None, task: Any = None, **_: Any) -> None:
    """(Connected at import: before the run-on runner, as an app's own receivers are.)"""
    if task is not None and task.name == "runon.slow_post" and POSTRUN_SLEEP:
        r().rpush("postrun:stalled", str(time.monotonic()))
        time.sleep(POSTRUN_SLEEP)
