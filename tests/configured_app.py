"""A Celery app whose tasks are locked by configuration (``redislock_tasks``), for
``celery -A tests.configured_app worker``: a plain task, a task with a base of its own
(hooks like a Sentry or DB-session base), and ``LockedTask`` composed by hand with that
base in either order. ``REDISLOCK_TEST_BAD_ENTRY`` makes one entry bad."""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, Task, current_task

import celery_redislock  # noqa: F401  (after celery: the redislock_tasks hook)
from celery_redislock.task import LockedTask

URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6399/0")

app = Celery("redislock_configured", broker=URL, backend=URL)
app.conf.update(
    redislock_ttl=30.0,
    redislock_requeue_backoff=(0.02, 0.5),
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    result_expires=600,
    worker_hijack_root_logger=False,
)
ENTRIES: dict[str, Any] = {
    "tests.configured_app.plain_*": {"lock_key": "job:{name}"},
    "tests.configured_app.based_work": {"lock_key": "job:{name}"},
    "tests.configured_app.skip_*": {"lock_key": "job:{name}", "on_contention": "skip"},
    "tests.configured_app.newest_*": {"lock_key": "job:{name}", "on_contention": "replace"},
    "tests.configured_app.nothing.*": {"lock_key": None},
}
BAD = {
    "unknown": {"lock_key": "job:{name}", "lock_tll": 3},
    "value": {"lock_key": "job:{name}", "lock_ttl": -1},
    "argument": {"lock_key": "job:{nobody}"},
}
if os.environ.get("REDISLOCK_TEST_BAD_ENTRY"):  # first: it matches before the glob
    bad = BAD[os.environ["REDISLOCK_TEST_BAD_ENTRY"]]
    ENTRIES = {"tests.configured_app.plain_work": bad, **ENTRIES}
app.conf.redislock_tasks = ENTRIES
if os.environ.get("REDISLOCK_TEST_BAD_SETTING"):  # a bad app-wide setting
    app.conf.redislock_on_contention = "whenever"

_r: redis.Redis | None = None


def r() -> redis.Redis:
    global _r
    if _r is None:
        _r = redis.Redis.from_url(URL)
    return _r


def _section(name: str, outcome: str, seconds: float) -> None:
    """The critical section: records who ran when, and what it found in the lock."""
    task = current_task
    owned = task.lock is not None and task.lock.owned()
    enter = time.monotonic()
    time.sleep(seconds)
    leave = time.monotonic()
    retries = task.request.retries
    r().rpush(f"sections:{name}", f"{task.request.id} {retries} {owned} {enter!r} {leave!r}")
    if outcome == "fail":
        raise RuntimeError("failed on purpose")
    if outcome == "retry" and retries == 0:
        raise task.retry(countdown=0.1)


class HookedTask(Task):  # type: ignore[misc]
    """A base of its own, as a Sentry or DB-session base: its hooks record that they ran."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r().rpush(f"hooks:{args[0]}", f"call {self.request.id}")
        return super().__call__(*args, **kwargs)

    def on_failure(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        r().rpush(f"hooks:{args[0]}", f"on_failure {task_id}")

    def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        r().rpush(f"hooks:{args[0]}", f"on_retry {task_id}")

    def after_return(self, status: str, *rest: Any) -> None:
        r().rpush(f"hooks:{rest[2][0]}", f"after_return {rest[1]} {status}")


class LockedFirst(LockedTask, HookedTask):  # type: ignore[misc]
    """LockedTask composed by hand, first."""


class HookedFirst(HookedTask, LockedTask):  # type: ignore[misc]
    """LockedTask composed by hand, second (HookedTask's __call__ calls super())."""


@app.task(max_retries=2)
def plain_work(name: str, seconds: float = 0.05, outcome: str = "ok") -> str:
    _section(name, outcome, seconds)
    return "done"


@app.task(bind=True, base=HookedTask, max_retries=2)
def based_work(self: Any, name: str, seconds: float = 0.05, outcome: str = "ok") -> str:
    _section(name, outcome, seconds)
    return "done"


@app.task
def skip_work(name: str) -> str:
    return "ran"


if not os.environ.get("REDISLOCK_TEST_ONLY_CONFIGURED"):  # no LockedTask of its own

    @app.task(bind=True, base=LockedFirst, lock_key="job:{name}", max_retries=2)
    def locked_first(self: Any, name: str, seconds: float = 0.05, outcome: str = "ok") -> str:
        _section(name, outcome, seconds)
        return "done"

    @app.task(bind=True, base=HookedFirst, lock_key="job:{name}", max_retries=2)
    def hooked_first(self: Any, name: str, seconds: float = 0.05, outcome: str = "ok") -> str:
        _section(name, outcome, seconds)
        return "done"


@app.task
def newest_work(name: str, tag: str, seconds: float = 0.0) -> str:
    """Last call wins by configuration: records its tag."""
    time.sleep(seconds)
    r().rpush(f"newest:{name}", tag)
    return tag


@app.task
def unlocked(name: str) -> str:
    return "ran"
