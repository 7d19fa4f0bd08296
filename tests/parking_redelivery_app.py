"""The test app of ``tests/celery/test_parking_redelivery.py``: ``tests.celery_app``'s app
(its broker, locks and settings, from the same environment variables), with one more task
and a hook that kills the worker's main process right after it parks a task at delivery.

``section_job`` records every run of its body (start and end, on the monotonic clock all
processes of the machine share) under ``rdrec:`` on the locks' Redis; its locks live under
a prefix of their own (:data:`PREFIX`), so the test can read everything left there.

``REDISLOCK_TEST_KILL_AT_PARKING=N``: the worker's main process SIGKILLs itself in its
N-th ``task_parked`` signal (a parking at delivery: sent after the parked entry and the
fallback copy, before the strategy acks the message). ``REDISLOCK_TEST_KILL_MODE``:
``at-once`` (default) kills it there; ``after-release`` first waits (its main loop
stopped) until no body has run for a while, so that the holder's release has handed the
lock on and published the hand-over, none of whose messages this worker will ack.

``REDISLOCK_TEST_ROUND_TRIP_AFTER=<seconds>``: a consumer step after the hand-over channel's
(``handoff_channel.HandoffChannel``) waits that long, then makes one synchronous round trip
on the worker's broker connection (a channel opened and closed), as Celery's own later steps
do at start (``Control`` opens the pidbox's channel): py-amqp reads and dispatches whatever
deliveries arrived meanwhile. The wait only makes sure the broker's deliveries have arrived
by then, which they often have without it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

from celery import bootsteps
from celery.signals import celeryd_init, worker_init

from celery_redislock import signals as redislock_signals
from celery_redislock.task import LockedTask

from .celery_app import app, r

__all__ = ["app", "section_job"]

#: The lock prefix of this app's task (every lock key the test reads is under it).
PREFIX = "rdtest:"
#: Where the runs are recorded (not under the lock prefix).
RECORDS = "rdrec:"

KILL_AT = int(os.environ.get("REDISLOCK_TEST_KILL_AT_PARKING") or 0)
KILL_MODE = os.environ.get("REDISLOCK_TEST_KILL_MODE", "at-once")
ROUND_TRIP_AFTER = float(os.environ.get("REDISLOCK_TEST_ROUND_TRIP_AFTER") or 0)

_main_pid: int | None = None
_parkings = 0


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="rd:{name}",
    lock_prefix=PREFIX,
    soft_time_limit=30,
)
def section_job(self: Any, name: str, seconds: float) -> int | None:
    """Hold the lock of ``rd:<name>`` ``seconds``; each run of the body is recorded."""
    run = uuid.uuid4().hex
    token = self.lock.token
    client = r()
    client.incr(f"{RECORDS}inside:{name}")
    enter = time.monotonic()
    client.rpush(
        f"{RECORDS}runs:{name}",
        f"start {self.request.id} {run} {enter!r} {token} {os.getpid()}",
    )
    time.sleep(seconds)
    leave = time.monotonic()
    client.rpush(f"{RECORDS}runs:{name}", f"end {self.request.id} {run} {leave!r}")
    client.decr(f"{RECORDS}inside:{name}")
    return int(token) if token is not None else None


@worker_init.connect(weak=False)
def _remember_main_process(**_kwargs: Any) -> None:
    global _main_pid
    _main_pid = os.getpid()


def _wait_for_idle_pool(name: str, quiet: float = 0.6, timeout: float = 15.0) -> None:
    """Wait until no body of ``name`` has run for ``quiet`` seconds (bounded)."""
    client = r()
    deadline = time.monotonic() + timeout
    since = None
    while time.monotonic() < deadline:
        if int(client.get(f"{RECORDS}inside:{name}") or 0) <= 0:
            since = since or time.monotonic()
            if time.monotonic() - since >= quiet:
                return
        else:
            since = None
        time.sleep(0.02)


def _kill_after_parking(sender: Any, task_id: str | None = None, **kwargs: Any) -> None:
    """The N-th parking at delivery of this worker's main process: SIGKILL it, before its
    strategy acks the parked message (see the module's docstring)."""
    global _parkings
    if not KILL_AT or os.getpid() != _main_pid or "queue" not in kwargs:
        return  # (a pool process's parking sends no queue)
    _parkings += 1
    client = r()
    client.rpush(f"{RECORDS}parkings", f"{_parkings} {task_id} {kwargs.get('queue')}")
    if _parkings != KILL_AT:
        return
    if KILL_MODE == "after-release":
        lock_name = str(kwargs.get("name") or "")  # "rd:<name>"
        _wait_for_idle_pool(lock_name.split(":", 1)[-1])
    client.rpush(f"{RECORDS}killed", f"{task_id} {time.monotonic()!r}")
    os.kill(os.getpid(), signal.SIGKILL)


redislock_signals.task_parked.connect(_kill_after_parking)


class RoundTripAfterHandoff(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer step after the hand-over channel's: one synchronous round trip on the
    broker connection, ``ROUND_TRIP_AFTER`` seconds after that step started."""

    requires = ("celery_redislock.celery.handoff_channel:HandoffChannel",)
    label = "test round trip after the hand-over channel"

    def start(self, c: Any) -> None:
        time.sleep(ROUND_TRIP_AFTER)
        c.connection.channel().close()


@celeryd_init.connect(weak=False)
def _add_round_trip_step(sender: Any = None, instance: Any = None, **_kwargs: Any) -> None:
    if ROUND_TRIP_AFTER > 0 and instance is not None:
        instance.app.steps["consumer"].add(RoundTripAfterHandoff)
