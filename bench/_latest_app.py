"""The Celery app of the last-call-wins benchmark (``bench/latest.py``).

Three tasks with the same body on one key family: ``latest.requeue`` (the default
policy), ``latest.replace`` (``on_contention="replace"``) and ``latest.debounce``
(``lock_debounce`` from ``LATEST_DEBOUNCE``). Each run records "<tag> <enter> <leave>" in
``latest:runs:<key>``. Configured from the environment: ``LATEST_URL`` (broker, results
and locks).
"""

from __future__ import annotations

import os
import time

from celery import Celery

from bench._libs import process_client
from celery_redislock.task import LockedTask

URL = os.environ.get("LATEST_URL", "redis://127.0.0.1:1/0")  # never the default 6379
DEBOUNCE = float(os.environ.get("LATEST_DEBOUNCE", "0.2"))

app = Celery("bench._latest_app", broker=URL, backend=URL)
app.conf.update(
    task_default_queue="latest-bench",
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
#: One client per process (a new one after the prefork fork).
client = process_client(URL)


def _run(key: str, tag: str, seconds: float) -> str:
    enter = time.time()
    time.sleep(seconds)
    client().rpush(f"latest:runs:{key}", f"{tag} {enter:.6f} {time.time():.6f}")
    return tag


@app.task(name="latest.requeue", base=LockedTask, lock_key="lb:{key}")
def requeue(key: str, tag: str, seconds: float = 0.0) -> str:
    return _run(key, tag, seconds)


@app.task(name="latest.replace", base=LockedTask, lock_key="lb:{key}", on_contention="replace")
def replace(key: str, tag: str, seconds: float = 0.0) -> str:
    return _run(key, tag, seconds)


@app.task(name="latest.debounce", base=LockedTask, lock_key="lb:{key}", lock_debounce=DEBOUNCE)
def debounce(key: str, tag: str, seconds: float = 0.0) -> str:
    return _run(key, tag, seconds)
