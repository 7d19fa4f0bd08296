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
locks), ``PERTASK_PREFIX``, ``PERTASK_QUEUE``, ``PERTASK_PREFETCH``.
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


def done_key(run: str) -> str:
    return f"{PREFIX}{run}:done"


def mark_key(run: str, which: str) -> str:
    return f"{PREFIX}{run}:{which}"


def _body(run: str, first: int, last: int) -> None:
    r = client()
    count = int(r.incr(done_key(run)))
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
