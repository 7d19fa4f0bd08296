"""The Celery app the per-task cost benchmark's worker loads (``bench/celery_pertask.py``).

Two tasks with the same short body, each called with a key of its own (no contention):
``pertask.nolock`` (a plain task) and ``pertask.locked`` (``LockedTask``, default
settings, ``lock_key="pt:{key}"``). The body counts itself done (``INCR``). The run that
makes the count reach ``first`` records the time and ``INFO commandstats``, and so does
the run that makes it reach ``last``: the parent reads both snapshots, so its own
commands and the worker's start are outside the measured window. Both runs also push to
a list the parent waits on (``BLPOP``: it reads the processes' CPU times then), so the
parent does not poll.

Configured from the environment (set by the benchmark): ``PERTASK_URL`` (broker and
locks), ``PERTASK_PREFIX``, ``PERTASK_QUEUE``, ``PERTASK_PREFETCH``; with
``PERTASK_TIME_SCRIPTS`` (``--time-scripts``, a diagnostic run of its own), every lock
script call of a pool process is timed, wall clock from the call to its reply, and each
run adds the time its process spent in them since its last report to ``<run>:script_us``,
and its body's ``INCR`` round trip to ``<run>:incr_us`` (two ``INCRBY`` per task more, in
that run only).
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from bench._libs import process_client
from celery_redislock.task import LockedTask

URL = os.environ.get("PERTASK_URL", "redis://127.0.0.1:1/0")  # never the default 6379
PREFIX = os.environ.get("PERTASK_PREFIX", "pertask:")

app = Celery("bench._pertask_app")
app.conf.update(
    broker_url=URL,
    redislock_url=URL,
    task_default_queue=os.environ.get("PERTASK_QUEUE", "pertask"),
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=int(os.environ.get("PERTASK_PREFETCH", "4")),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

#: One client per process (a new one after the prefork fork).
client = process_client(URL)

#: ``PERTASK_TIME_SCRIPTS``: this process's wall time in lock script calls, µs, not yet
#: reported (``_body`` adds it to ``<run>:script_us``).
_script_us = [0.0]


def _time_scripts() -> None:
    """Time every script call the lock and the task lock make (their module-level ``run``)."""
    from celery_redislock import _scripts, lock
    from celery_redislock.celery import tasklock

    untimed = _scripts.run

    def timed(*args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return untimed(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            _script_us[0] += (time.perf_counter() - started) * 1e6

    lock.run = tasklock.run = timed  # type: ignore[assignment]


TIMED = bool(os.environ.get("PERTASK_TIME_SCRIPTS"))
if TIMED:
    _time_scripts()


def done_key(run: str) -> str:
    return f"{PREFIX}{run}:done"


def mark_key(run: str, which: str) -> str:
    return f"{PREFIX}{run}:{which}"


def _body(run: str, first: int, last: int) -> None:
    r = client()
    if _script_us[0]:
        r.incrby(mark_key(run, "script_us"), int(_script_us[0]))
        _script_us[0] -= int(_script_us[0])
    started = time.perf_counter()
    count = int(r.incr(done_key(run)))
    if TIMED:  # the body's own round trip, beside the scripts': one INCRBY more
        r.incrby(mark_key(run, "incr_us"), int((time.perf_counter() - started) * 1e6))
    if count in (first, last):
        which = "first" if count == first else "last"
        stats = {k: int(v["calls"]) for k, v in r.info("commandstats").items()}
        r.set(mark_key(run, which), json.dumps({"t": time.monotonic(), "stats": stats}))
        # The parent waits on these to read the processes' CPU times at both ends.
        r.rpush(mark_key(run, "finished" if which == "last" else "reached"), "1")


@app.task(name="pertask.nolock")
def nolock(run: str, key: str, first: int, last: int) -> None:
    _body(run, first, last)


@app.task(name="pertask.locked", base=LockedTask, lock_key="pt:{key}")
def locked(run: str, key: str, first: int, last: int) -> None:
    _body(run, first, last)


TASKS = {"nolock": nolock, "locked": locked}
