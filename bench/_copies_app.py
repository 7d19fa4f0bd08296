"""The Celery app of ``bench/fallback_copies.py``'s worker: one ``LockedTask`` on a
RabbitMQ broker with its locks on a private redis-server, so parked tasks get fallback
copies, which come back from their delay queue after 2 s (``lock_ttl`` 2 s and a
visibility timeout of 8 s: min(max(ttl, backoff cap 5 s), 8 / 4)).

Every ``task_prerun`` in a pool process (a message dispatched to it) counts itself in
``<run>:dispatched``; every ``task_duplicate`` (a copy found done, in a pool process or
in the main process at delivery) pushes its time to ``<run>:duplicates``. With
``COPIES_AT_DELIVERY=0`` the worker's main process does not drop finished copies at
delivery (``parking.finished_copy`` answers "no"): each goes to a pool process, which
finds it done, as before that check existed.

Configured from the environment: ``COPIES_URL`` (locks, results, counters), ``COPIES_RUN``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery import signals as celery_signals

from bench._libs import process_client
from celery_redislock import signals as redislock_signals
from celery_redislock.task import LockedTask

URL = os.environ.get("COPIES_URL", "redis://127.0.0.1:1/0")  # never the default 6379
RUN = os.environ.get("COPIES_RUN", "copies")
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"

app = Celery("bench._copies_app")
app.conf.update(
    broker_url=AMQP_URL,
    redislock_url=URL,  # another server than the broker: parked tasks get fallback copies
    broker_transport_options={"visibility_timeout": 8},
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
client = process_client(URL)

if os.environ.get("COPIES_AT_DELIVERY") == "0":
    from celery_redislock.celery import parking

    parking.finished_copy = lambda *args, **kwargs: False  # type: ignore[assignment]


@app.task(name="copies.job", base=LockedTask, lock_key="cp:{key}", lock_ttl=2)
def job(key: str, seconds: float) -> None:
    time.sleep(seconds)
    client().incr(f"{RUN}:done")


@celery_signals.task_prerun.connect
def _dispatched(**_: Any) -> None:
    client().incr(f"{RUN}:dispatched")


@redislock_signals.task_duplicate.connect
def _duplicate(**_: Any) -> None:
    client().rpush(f"{RUN}:duplicates", repr(time.time()))
