"""The demo's Celery app: its scenes' tasks, each without and with ``LockedTask``.

Payments: each account's record is a JSON list of the payment ids applied to it, updated
with a non-atomic read-modify-write that takes ``DEMO_WORK`` seconds, so a lost update
shows up as a payment id missing from its account.

Tenants: one job body sent as a plain task and as a ``LockedTask`` with
``lock_limit=DEMO_LIMIT`` per tenant; each run records its tenant, job number, when it was
sent, when it started and when it ended (``time.time()``, inside the permit), so the
scene can tell each job's wait and how many of one tenant's jobs ran at once.

Merchants: a call to a partner API sent as a plain task and as a ``LockedTask`` with
``lock_rate=DEMO_RATE`` per merchant (no lock: ``lock_limit=None``); each run records its
merchant, call number, when it was sent, started and ended, and (rated) the slot its rate
booked for it (µs on the Redis server's clock).

Reindex: "rebuild the search index for a user" sent as a plain task, with
``on_contention="replace"`` and with ``lock_debounce=DEMO_DEBOUNCE``; each run records the
version it rebuilt, and writes it as the user's index; a superseded call is recorded by
the package's ``task_superseded`` signal.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redislock import LockedTask

PREFIX = os.environ.get("DEMO_PREFIX", "redislock-demo:")
WORK = float(os.environ.get("DEMO_WORK", "0.02"))
LIMIT = int(os.environ.get("DEMO_LIMIT", "2"))
RATE = os.environ.get("DEMO_RATE", "10/s")
DEBOUNCE = float(os.environ.get("DEMO_DEBOUNCE", "0.5"))

app = Celery("celery_redislock.demo.app")
app.conf.update(
    broker_url=os.environ.get("DEMO_BROKER_URL", "redis://127.0.0.1:6379/0"),
    redislock_url=os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/0"),
    redislock_prefix=PREFIX + "lock:",
    task_default_queue=os.environ.get("DEMO_QUEUE", "redislock-demo"),
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    # No remote control: its pidbox bindings would outlive the demo in the broker.
    worker_enable_remote_control=False,
)

_store: redis.Redis | None = None


def store() -> redis.Redis:
    global _store
    if _store is None:
        _store = redis.Redis.from_url(
            app.conf.redislock_url, socket_timeout=10, socket_connect_timeout=10
        )
    return _store


def _apply(phase: str, account: int, payment: int) -> None:
    key = f"{PREFIX}{phase}:account:{account}"
    applied: list[int] = json.loads(store().get(key) or "[]")
    time.sleep(WORK)  # the window in which a concurrent update is lost
    applied.append(payment)
    pipe = store().pipeline(transaction=False)
    pipe.set(key, json.dumps(applied))
    pipe.incr(f"{PREFIX}{phase}:done")
    pipe.execute()


@app.task(name="demo.settle_unlocked")
def settle_unlocked(account: int, payment: int) -> None:
    _apply("unlocked", account, payment)


@app.task(name="demo.settle_locked", base=LockedTask, lock_key="account:{account}")
def settle_locked(account: int, payment: int) -> None:
    _apply("locked", account, payment)


def tenant_runs_key(phase: str) -> str:
    return f"{PREFIX}tenants:{phase}:runs"


def tenant_done_key(phase: str) -> str:
    return f"{PREFIX}tenants:{phase}:done"


def _run_tenant_job(phase: str, tenant: str, job: int, sent: float, work: float) -> None:
    started = time.time()
    time.sleep(work)
    run = json.dumps([tenant, job, sent, started, time.time()])  # ended inside the permit
    pipe = store().pipeline(transaction=False)
    pipe.rpush(tenant_runs_key(phase), run)
    pipe.incr(tenant_done_key(phase))
    pipe.execute()


@app.task(name="demo.tenant_job")
def tenant_job(tenant: str, job: int, sent: float, work: float) -> None:
    _run_tenant_job("unlimited", tenant, job, sent, work)


@app.task(
    name="demo.tenant_job_limited", base=LockedTask, lock_key="tenant:{tenant}", lock_limit=LIMIT
)
def tenant_job_limited(tenant: str, job: int, sent: float, work: float) -> None:
    _run_tenant_job("limited", tenant, job, sent, work)


def merchant_runs_key(phase: str) -> str:
    return f"{PREFIX}merchants:{phase}:runs"


def merchant_done_key(phase: str) -> str:
    return f"{PREFIX}merchants:{phase}:done"


def _run_partner_call(
    phase: str, merchant: str, call: int, sent: float, work: float, slot_us: int | None
) -> None:
    started = time.time()
    time.sleep(work)  # the partner API's answer
    run = json.dumps([merchant, call, sent, started, time.time(), slot_us])
    pipe = store().pipeline(transaction=False)
    pipe.rpush(merchant_runs_key(phase), run)
    pipe.incr(merchant_done_key(phase))
    pipe.execute()


@app.task(name="demo.partner_call")
def partner_call(merchant: str, call: int, sent: float, work: float) -> None:
    _run_partner_call("unrated", merchant, call, sent, work, None)


@app.task(
    bind=True,
    name="demo.partner_call_rated",
    base=LockedTask,
    lock_key="merchant:{merchant}",
    lock_limit=None,  # a rate only: no lock, no permit
    lock_rate=RATE,
)
def partner_call_rated(self: Any, merchant: str, call: int, sent: float, work: float) -> None:
    # When the rate admitted this run: µs since the epoch on the Redis server's clock.
    slot = getattr(self.request, "redislock_rate_slot_us", None)
    _run_partner_call("rated", merchant, call, sent, work, slot)


#: The reindex scene's phase of each of its tasks.
REINDEX_PHASES = {
    "demo.reindex": "every",
    "demo.reindex_replace": "replace",
    "demo.reindex_debounce": "debounce",
}


def reindex_runs_key(phase: str) -> str:
    return f"{PREFIX}reindex:{phase}:runs"


def reindex_done_key(phase: str) -> str:
    """Calls that ran or were superseded."""
    return f"{PREFIX}reindex:{phase}:done"


def reindex_received_key(phase: str) -> str:
    """Task ids of the calls the worker has taken up: running, or waiting for quiet."""
    return f"{PREFIX}reindex:{phase}:received"


def reindex_superseded_key(phase: str) -> str:
    return f"{PREFIX}reindex:{phase}:superseded"


def reindex_index_key(phase: str, user: str) -> str:
    """The version the user's index was last rebuilt at."""
    return f"{PREFIX}reindex:{phase}:index:{user}"


def _rebuild(task: Any, user: str, version: int, work: float) -> None:
    phase = REINDEX_PHASES[task.name]
    task_id = task.request.id
    started = time.time()
    store().sadd(reindex_received_key(phase), task_id)
    time.sleep(work)
    run = json.dumps([user, version, task_id, started, time.time()])
    pipe = store().pipeline(transaction=False)
    pipe.set(reindex_index_key(phase, user), version)
    pipe.rpush(reindex_runs_key(phase), run)
    pipe.incr(reindex_done_key(phase))
    pipe.execute()


@app.task(bind=True, name="demo.reindex")
def reindex(self: Any, user: str, version: int, work: float) -> None:
    _rebuild(self, user, version, work)


@app.task(
    bind=True,
    name="demo.reindex_replace",
    base=LockedTask,
    lock_key="user:{user}",
    on_contention="replace",
)
def reindex_replace(self: Any, user: str, version: int, work: float) -> None:
    _rebuild(self, user, version, work)


@app.task(
    bind=True,
    name="demo.reindex_debounce",
    base=LockedTask,
    lock_key="user:{user}",
    lock_debounce=DEBOUNCE,
)
def reindex_debounce(self: Any, user: str, version: int, work: float) -> None:
    _rebuild(self, user, version, work)


def deferred_count(task: Any) -> int:
    """How many times ``task``'s runs were deferred to their rate slot."""
    return int(store().get(f"{PREFIX}deferred:{task.name}") or 0)


def _count_deferred(sender: Any = None, **_: Any) -> None:
    store().incr(f"{PREFIX}deferred:{getattr(sender, 'name', '?')}")


def _record_superseded(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    phase = REINDEX_PHASES.get(getattr(sender, "name", ""))
    if phase is None or task_id is None:
        return
    # A call counts once, however many times its record is written (a re-sent copy).
    if store().sadd(reindex_superseded_key(phase), task_id):
        store().incr(reindex_done_key(phase))


def _record_debounced(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    phase = REINDEX_PHASES.get(getattr(sender, "name", ""))
    if phase is not None and task_id is not None:
        store().sadd(reindex_received_key(phase), task_id)


def parked_count(task: Any) -> int:
    """How many times ``task`` was parked behind its key's holders."""
    return int(store().get(f"{PREFIX}parked:{task.name}") or 0)


def _count_parked(sender: Any = None, **_: Any) -> None:
    store().incr(f"{PREFIX}parked:{getattr(sender, 'name', '?')}")


def _announce_ready(sender: Any = None, **_: Any) -> None:
    store().set(f"{PREFIX}worker-ready", os.getpid())


# Counted through the package's own signal, as an operator would.
from celery import signals as _celery_signals  # noqa: E402

from celery_redislock import signals as _signals  # noqa: E402

_signals.task_parked.connect(_count_parked)
_signals.task_deferred.connect(_count_deferred)
_signals.task_superseded.connect(_record_superseded)
_signals.task_debounced.connect(_record_debounced)
_celery_signals.worker_ready.connect(_announce_ready, weak=False)
