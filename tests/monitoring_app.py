"""The Celery app of the monitoring tests (``celery -A tests.monitoring_app worker``): one
task per thing the dashboard and alerts watch, each on a key family of its own.

Everything points at the private redis-server whose URL the test passes in
``REDISLOCK_TEST_URL``: broker, result backend and locks. Every task is routed to the
queue :data:`QUEUE`, so the series' ``queue_name`` label has a value to check.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redislock import signals
from celery_redislock.task import LockedTask

URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6399/0")
QUEUE = "monitoring"
#: The longest any task here waits for its test to let it go (a test that died).
LONGEST = 30.0

app = Celery("redislock_monitoring", broker=URL, backend=URL)
app.conf.update(
    redislock_ttl=3.0,
    redislock_requeue_backoff=(0.02, 0.5),
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    result_expires=600,
    worker_hijack_root_logger=False,
)

_client: redis.Redis | None = None


def r() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(URL)
    return _client


def _until(check: Any) -> None:
    deadline = time.monotonic() + LONGEST
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)


@app.task(base=LockedTask, lock_key="mon-lock:{key}")
def hold(key: str, gate: str) -> str:
    """Holds its lock until the test sets ``gate``; a second call of the key is parked."""
    _until(lambda: r().exists(gate))
    return key


@app.task(base=LockedTask, lock_key="mon-limit:{key}", lock_limit=2)
def limited(key: str, gate: str) -> str:
    """Holds one of the two permits of its limited key until ``gate`` is set."""
    _until(lambda: r().exists(gate))
    return key


@app.task(base=LockedTask, lock_key="mon-rate:{key}", lock_limit=None, lock_rate="12/m")
def rated(key: str) -> str:
    """A slot every 5 s per key: a burst of calls is deferred (long enough for the test to
    look at them while they are)."""
    return key


@app.task(bind=True, base=LockedTask, lock_key="mon-lost:{key}", lock_ttl=1.5)
def lose(self: Any, key: str) -> str:
    """Its lock vanishes under it (as a lease that ran out): the watchdog finds it lost."""
    r().delete(self.lock.keys.lock)
    time.sleep(1.5)  # a renewal every 0.5 s finds it gone
    return key


@app.task(bind=True, base=LockedTask, lock_key="mon-renew:{key}", lock_ttl=1.5)
def unrenewable(self: Any, key: str) -> str:
    """Its lock's key becomes a value of another type: each renewal fails (and is
    retried) until the lease's deadline, when the hold is lost."""
    lock_key = self.lock.keys.lock
    r().delete(lock_key)
    r().set(lock_key, "not a lock", px=10_000)
    time.sleep(2.0)  # (its release then fails too: the script finds a value of another type)
    return key


#: Counts the runs re-queued in the worker, for the test to wait on.
REQUEUED = "mon:requeued"


@signals.task_requeued.connect
def _count_requeued(sender: Any = None, **_: Any) -> None:
    r().incr(REQUEUED)


@app.task(base=LockedTask, lock_key="mon-wait:{key}", on_contention="wait", lock_wait=0.1)
def waiting(key: str, gate: str) -> str:
    """Holds its lock until ``gate`` is set; a second call waits 0.1 s for it, then is
    re-queued with a countdown (``lock_wait_fallback="requeue"``)."""
    _until(lambda: r().exists(gate))
    return key


@app.task(bind=True, base=LockedTask, lock_key="mon-sweep:{key}")
def abandon(self: Any, key: str, role: str) -> str:
    """``role="holder"``: once a ``waiter`` is parked behind it, its lock vanishes (its
    holder gone without a release): the sweeper hands the lock to the waiter."""
    if role == "holder":
        parked = self.lock.keys.parked
        _until(lambda: r().llen(parked) >= 1)
        r().delete(self.lock.keys.lock)
        _until(lambda: not r().llen(parked))  # the sweeper took it
    return role


@app.task(base=LockedTask, lock_key="mon-newest:{key}", on_contention="replace")
def newest(key: str, tag: str, gate: str = "") -> str:
    """Last call wins: holds its lock until ``gate`` is set (when given); of the calls sent
    meanwhile only the newest runs after it, the others end SUPERSEDED."""
    if gate:
        _until(lambda: r().exists(gate))
    return tag


@app.task(base=LockedTask, lock_key="mon-quiet:{key}", lock_debounce=0.2)
def quiet(key: str, tag: str) -> str:
    """Debounced: runs once its key has been quiet for 0.2 s, with the newest arguments."""
    return tag


@app.task(base=LockedTask, lock_key="mon-skip:{key}", on_contention="skip")
def skipping(key: str, gate: str) -> str:
    """Holds its lock until ``gate`` is set; a call that finds it held is skipped."""
    _until(lambda: r().exists(gate))
    return key
