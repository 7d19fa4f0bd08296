"""The Celery app the settlement benchmark's worker loads (``bench/celery_settlement.py``).

Every task does the same non-atomic read-modify-write of an account balance (``GET``,
sleep ``SETTLE_WORK`` seconds, ``SET`` balance + 1) and logs its section
``account|enter|leave|pid`` (``time.monotonic()``, system-wide on Linux) to a per-run
list, so the parent can count lost updates and overlapping sections. The variants differ
only in how (whether) they lock the account:

* ``settle.nolock``   no lock;
* ``settle.recipe``   the Celery cookbook recipe: a redis-py lock taken with
  ``acquire(blocking=False)``, ``self.retry(countdown=1, max_retries=None)`` when held;
* ``settle.redispy``  a blocking redis-py lock inside the task;
* ``settle.prl``      a blocking python-redis-lock inside the task;
* ``settle.locked``   ``LockedTask`` in its default requeue mode;
* ``settle.runon``    the same with ``lock_run_on`` (``SETTLE_RUN_ON`` seconds, default 5): a
  releasing process runs the account's next parked task itself.

Configured from the environment (set by the benchmark): ``SETTLE_URL`` (locks and data:
one private redis-server), ``SETTLE_BROKER`` (the broker; default ``SETTLE_URL``; in
another database of that server, ``redislock_queues_in_other_db`` is on unless
``SETTLE_QUEUES_IN_OTHER_DB=0``),
``SETTLE_PREFIX`` (key prefix of the data),
``SETTLE_QUEUE`` (the worker's queue), ``SETTLE_WORK`` (seconds), ``SETTLE_PREFETCH``,
``SETTLE_TASKS`` (comma-separated variants to register; default all), ``SETTLE_LOOKAHEAD``
(``redislock_lookahead``; default: the package's), ``SETTLE_PARK_AT_DELIVERY=0``
(``redislock_park_at_delivery`` off), ``SETTLE_PARTS`` (a file: record the
hand-overs' parts there, ``bench/_handover_parts.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from bench._libs import process_client
from celery_redislock import signals as redislock_signals
from celery_redislock.task import LockedTask

URL = os.environ.get("SETTLE_URL", "redis://127.0.0.1:1/0")  # never the default 6379
PREFIX = os.environ.get("SETTLE_PREFIX", "settle:")
WORK = float(os.environ.get("SETTLE_WORK", "0.02"))
LOCK_TTL = 30
VARIANTS = ("nolock", "recipe", "redispy", "prl", "locked", "runon")
#: ``lock_run_on`` of ``settle.runon`` (seconds a worker process runs parked tasks on).
RUN_ON = float(os.environ.get("SETTLE_RUN_ON") or 5.0)
REGISTER = {v.strip() for v in os.environ.get("SETTLE_TASKS", ",".join(VARIANTS)).split(",")}

app = Celery("bench._settlement_app")
BROKER = os.environ.get("SETTLE_BROKER") or URL
app.conf.update(
    broker_url=BROKER,
    redislock_url=URL,  # the broker's string (by default): no parked-task fallback copies
    task_default_queue=os.environ.get("SETTLE_QUEUE", "settle"),
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=int(os.environ.get("SETTLE_PREFETCH", "1")),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
if os.environ.get("SETTLE_FALLBACK"):  # redislock_park_fallback: "auto" (default), 0, 1
    fallback = os.environ["SETTLE_FALLBACK"]
    app.conf.redislock_park_fallback = fallback if fallback == "auto" else fallback == "1"
if BROKER.startswith("redis") and BROKER.rsplit("/", 1)[-1] != URL.rsplit("/", 1)[-1]:
    # (every worker here runs this release; SETTLE_QUEUES_IN_OTHER_DB=0: the default, off)
    app.conf.redislock_queues_in_other_db = os.environ.get("SETTLE_QUEUES_IN_OTHER_DB") != "0"
if os.environ.get("SETTLE_PARK_AT_DELIVERY") == "0":  # redislock_park_at_delivery off
    app.conf.redislock_park_at_delivery = False
if os.environ.get("SETTLE_LOOKAHEAD"):
    app.conf.redislock_lookahead = int(os.environ["SETTLE_LOOKAHEAD"])

#: One client per process (a new one after the prefork fork).
client = process_client(URL)


def balance_key(account: str) -> str:
    return f"{PREFIX}bal:{account}"


def log_key(run: str) -> str:
    return f"{PREFIX}{run}:log"


def done_key(run: str) -> str:
    return f"{PREFIX}{run}:done"


def parked_key() -> str:
    return f"{PREFIX}parked"


def retries_key(run: str) -> str:
    return f"{PREFIX}{run}:retries"


def _section(run: str, account: str) -> None:
    """The read-modify-write, logged; then the completion counter."""
    r = client()
    key = balance_key(account)
    enter = time.monotonic()
    balance = int(r.get(key) or 0)
    time.sleep(WORK)  # the window in which a concurrent update is lost
    r.set(key, balance + 1)
    leave = time.monotonic()
    pipe = r.pipeline(transaction=False)
    pipe.rpush(log_key(run), f"{account}|{enter!r}|{leave!r}|{os.getpid()}")
    pipe.incr(done_key(run))
    pipe.execute()


def _lock_name(account: str) -> str:
    return f"{PREFIX}lock:account:{account}"


def _settle_nolock(run: str, account: str) -> None:
    _section(run, account)


def _settle_recipe(self: Any, run: str, account: str) -> None:
    lock = client().lock(_lock_name(account), timeout=LOCK_TTL)
    if not lock.acquire(blocking=False):
        client().incr(retries_key(run))
        raise self.retry(countdown=1, max_retries=None)
    try:
        _section(run, account)
    finally:
        lock.release()


def _settle_redispy(run: str, account: str) -> None:
    with client().lock(_lock_name(account), timeout=LOCK_TTL, blocking_timeout=None):
        _section(run, account)


def _settle_prl(run: str, account: str) -> None:
    import redis_lock  # type: ignore[import-untyped]

    with redis_lock.Lock(client(), _lock_name(account), expire=LOCK_TTL):
        _section(run, account)


def _settle_locked(run: str, account: str) -> None:
    _section(run, account)


TASKS: dict[str, Any] = {}
if "nolock" in REGISTER:
    TASKS["nolock"] = app.task(name="settle.nolock")(_settle_nolock)
if "recipe" in REGISTER:
    # max_retries=None on the task too: retry(max_retries=None) alone means "the task's
    # default" (3), after which Celery fails the task with MaxRetriesExceededError.
    TASKS["recipe"] = app.task(name="settle.recipe", bind=True, max_retries=None)(_settle_recipe)
if "redispy" in REGISTER:
    TASKS["redispy"] = app.task(name="settle.redispy")(_settle_redispy)
if "prl" in REGISTER:
    TASKS["prl"] = app.task(name="settle.prl")(_settle_prl)
if "locked" in REGISTER:
    # Default LockedTask settings: on_contention="requeue" (park and hand over).
    TASKS["locked"] = app.task(name="settle.locked", base=LockedTask, lock_key="account:{account}")(
        _settle_locked
    )


if "runon" in REGISTER:
    TASKS["runon"] = app.task(
        name="settle.runon", base=LockedTask, lock_key="account:{account}", lock_run_on=RUN_ON
    )(_settle_locked)


def _count_parked(sender: Any = None, **_: Any) -> None:
    client().incr(parked_key())


# Counted through the package's own signal, as an operator would.
redislock_signals.task_parked.connect(_count_parked)

if os.environ.get("SETTLE_PARTS"):  # bench.celery_settlement --parts
    import sys

    from bench import _handover_parts

    _handover_parts.install(os.environ["SETTLE_PARTS"], sys.modules[__name__])
