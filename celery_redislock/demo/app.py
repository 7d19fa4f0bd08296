"""The demo's Celery app: its two scenes' tasks, each without and with ``LockedTask``.

Payments: each account's record is a JSON list of the payment ids applied to it, updated
with a non-atomic read-modify-write that takes ``DEMO_WORK`` seconds, so a lost update
shows up as a payment id missing from its account.

Tenants: one job body sent as a plain task and as a ``LockedTask`` with
``lock_limit=DEMO_LIMIT`` per tenant; each run records its tenant, job number, when it was
sent, when it started and when it ended (``time.time()``, inside the permit), so the
scene can tell each job's wait and how many of one tenant's jobs ran at once.
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
_celery_signals.worker_ready.connect(_announce_ready, weak=False)
