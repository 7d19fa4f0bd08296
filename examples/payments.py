"""Payment settlement: two workers must never settle the same account at once.

Worker:  celery -A examples.payments worker -l info -c 4
Client:  python -m examples.payments
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import redis
from celery import Celery

from celery_redislock import FencedResource, LockedTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("examples.payments", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True, redislock_ttl=30)
ledger = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


@app.task(bind=True, base=LockedTask, lock_key="account:{account_id}", on_contention="requeue")
def settle(self: Any, account_id: int, amount: int) -> int:
    """Read-modify-write of a balance: safe only because one settle per account runs at a time."""
    balance = int(ledger.get(f"example:balance:{account_id}") or 0)
    time.sleep(0.02)  # the window in which an unlocked update would be lost
    self.lock.ensure_held()  # raises LockLostError if the lease was lost meanwhile
    # The fenced write rejects this holder if a newer one exists (a paused, expired holder).
    FencedResource(ledger, f"example:account:{account_id}").write(
        self.lock.token, f"example:balance:{account_id}", balance + amount
    )
    return balance + amount


if __name__ == "__main__":
    payments = [(random.randrange(4), random.randrange(1, 100)) for _ in range(200)]
    results = [settle.delay(account, amount) for account, amount in payments]
    for result in results:
        result.get(timeout=300)
    for account in range(4):
        expected = sum(a for acct, a in payments if acct == account)
        print(account, ledger.get(f"example:balance:{account}"), "expected +", expected)
