"""The demo's Celery app: the same payment settlement, without and with ``LockedTask``.

Each account's record is a JSON list of the payment ids applied to it, updated with a
non-atomic read-modify-write that takes ``DEMO_WORK`` seconds, so a lost update shows up
as a payment id missing from its account.
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


def parked_count() -> int:
    """How many times a locked settlement was parked behind its account's holder."""
    return int(store().get(f"{PREFIX}parked") or 0)


def _count_parked(sender: Any = None, **_: Any) -> None:
    store().incr(f"{PREFIX}parked")


def _announce_ready(sender: Any = None, **_: Any) -> None:
    store().set(f"{PREFIX}worker-ready", os.getpid())


# Counted through the package's own signal, as an operator would.
from celery import signals as _celery_signals  # noqa: E402

from celery_redislock import signals as _signals  # noqa: E402

_signals.task_parked.connect(_count_parked)
_celery_signals.worker_ready.connect(_announce_ready, weak=False)
