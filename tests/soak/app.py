"""The Celery app the soak's workers run (``celery -A tests.soak.app worker``).

The broker, the result backend and the locks are one redis-server (``SOAK_BROKER_URL``,
AOF, restarted by the soak). Balances and the ledger live in another
(``SOAK_LEDGER_URL``), never faulted, so the oracles survive the faults they judge.

A settlement adds ``amount`` to an account's balance by a non-atomic read-modify-write
(GET, work, write), fenced by the lock's token and idempotent per task id:

1. admit the token at the account's :class:`FencedResource` (a newer holder's admit
   makes every later write of an older token fail), then read the balance;
2. work (sleep);
3. one script (:data:`APPLY`): refuse the write if a newer token was admitted
   (``stale``); do nothing if this task id was applied already (``again``: the first
   run applied, then died before its message was acknowledged); else write the new
   balance and record the task id, token and process in the ledger (``applied``).

A run killed before step 3 has changed nothing; one killed after it is recorded. Every
run logs ``start`` (after step 1) and ``end`` (after step 3, with the outcome and
whether ``self.lock.ensure_held()`` passed just before and just after the write) as JSON
to the list ``soak:events``; ``soak:running`` maps a pool process to the task it runs
(the soak picks its SIGKILL victims there).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

from celery_redislock import FencedResource, LockLostError
from celery_redislock.task import LockedTask

BROKER = os.environ.get("SOAK_BROKER_URL", "redis://127.0.0.1:6399/0")
LEDGER = os.environ.get("SOAK_LEDGER_URL", "redis://127.0.0.1:6398/0")
VT = float(os.environ.get("SOAK_VT", "60"))

app = Celery("redislock_soak", broker=BROKER, backend=BROKER)
app.conf.update(
    redislock_ttl=float(os.environ.get("SOAK_TTL", "5")),
    redislock_requeue_backoff=(0.02, 0.5),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options={
        "visibility_timeout": VT,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    broker_connection_retry_on_startup=True,
    result_expires=3600,
    worker_hijack_root_logger=False,
)
if os.environ.get("SOAK_RUN_ON"):  # running on (lock_run_on) under the soak's faults
    app.conf.redislock_run_on = float(os.environ["SOAK_RUN_ON"])

EVENTS = "soak:events"
RUNNING = "soak:running"
APPLIED = "soak:applied"  # task id -> JSON record of the run that applied it
APPLIED_BY = "soak:applied-by"  # task id -> run id (pid:token:t_enter)
APPLY_LOG = "soak:apply-log"  # "account token task_id", in apply order
STATS = "soak:stats"
FAKE_TOKENS = "soak:fake-token"  # only for the self-test without a lock


def balance_key(account: int) -> str:
    return f"soak:balance:{account}"


def fence_for(client: Any, account: int) -> FencedResource:
    return FencedResource(client, f"soak:account:{account}")


#: apply(keys=[fence, balance, applied, applied_by, apply_log, stats],
#:       args=[token, task_id, new_balance, record, run_id, log_line]) -> 1 applied,
#:       0 stale, 2 again (applied by an earlier run), 3 this run applied it already
APPLY = """
local token = tonumber(ARGV[1])
local highest = tonumber(redis.call('GET', KEYS[1]) or '0')
if token < highest then
  redis.call('HINCRBY', KEYS[6], 'stale', 1)
  return 0
end
if token > highest then redis.call('SET', KEYS[1], token) end
local by = redis.call('HGET', KEYS[4], ARGV[2])
if by then
  if by == ARGV[5] then return 3 end
  redis.call('HINCRBY', KEYS[6], 'again', 1)
  return 2
end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
redis.call('HSET', KEYS[4], ARGV[2], ARGV[5])
redis.call('RPUSH', KEYS[5], ARGV[6])
redis.call('HINCRBY', KEYS[6], 'applied', 1)
return 1
"""
OUTCOMES = {0: "stale", 1: "applied", 2: "again", 3: "applied"}

_ledger: redis.Redis | None = None
_apply: Any = None


def ledger() -> redis.Redis:
    global _ledger, _apply
    if _ledger is None:
        _ledger = redis.Redis.from_url(LEDGER, socket_timeout=10)
        _apply = _ledger.register_script(APPLY)
    return _ledger


def _event(**record: Any) -> None:
    ledger().rpush(EVENTS, json.dumps(record))


def _held(task: Task) -> bool | None:
    lock = getattr(task, "lock", None)
    if lock is None:
        return None  # no lock at all (the self-test): the run believes it is alone
    try:
        lock.ensure_held()
    except LockLostError:
        return False
    return True


def _settle(task: Task, account: int, amount: int, work: float, token: int) -> str:
    client = ledger()
    task_id = task.request.id
    pid = os.getpid()
    t_enter = time.monotonic()
    fence = fence_for(client, account)
    admit = fence.admit(token)
    read = int(client.get(balance_key(account)) or 0)
    client.hset(RUNNING, str(pid), task_id)
    _event(ev="start", id=task_id, pid=pid, account=account, token=token, t=t_enter, admit=admit)
    time.sleep(work)
    held_before = _held(task)
    run_id = f"{pid}:{token}:{t_enter!r}"
    t_write = time.monotonic()
    record = json.dumps(
        {"pid": pid, "token": token, "account": account, "amount": amount, "t_write": t_write}
    )
    keys = [fence.key, balance_key(account), APPLIED, APPLIED_BY, APPLY_LOG, STATS]
    args = [token, task_id, read + amount, record, run_id, f"{account} {token} {task_id}"]
    assert _apply is not None
    outcome = OUTCOMES[int(_apply(keys=keys, args=args))]
    held_after = _held(task)
    _event(
        ev="end", id=task_id, pid=pid, account=account, token=token, t=time.monotonic(),
        t_write=t_write, outcome=outcome, held_before=held_before, held_after=held_after,
    )  # fmt: skip
    client.hdel(RUNNING, str(pid))
    return outcome


@app.task(bind=True, base=LockedTask, lock_key="account:{account}")
def settle(self: Any, account: int, amount: int, work: float) -> str:
    token = self.lock.token
    if not token:
        raise RuntimeError(f"no fencing token for {self.request.id}")
    outcome = _settle(self, account, amount, work, token)
    if outcome == "stale":  # a newer holder wrote: our lease is gone; do it again
        raise self.retry(countdown=0.05, max_retries=None)
    return outcome


@app.task(bind=True)
def settle_unlocked(self: Any, account: int, amount: int, work: float) -> str:
    """The self-test: the same work without a lock (tokens from a plain counter)."""
    token = int(ledger().incr(FAKE_TOKENS))
    outcome = _settle(self, account, amount, work, token)
    if outcome == "stale":
        raise self.retry(countdown=0.05, max_retries=None)
    return outcome
