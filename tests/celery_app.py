"""The Celery app real test workers run (``celery -A tests.celery_app worker``).

Everything points at the private redis-server whose URL the test passes in
``REDISLOCK_TEST_URL``: broker, result backend and locks.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Reject

from celery_redislock import FencedResource, metrics
from celery_redislock.task import LockedTask

URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6399/0")

app = Celery("redislock_tests", broker=URL, backend=URL)
app.conf.update(
    redislock_ttl=float(os.environ.get("REDISLOCK_TEST_TTL", "3")),
    redislock_requeue_backoff=(0.02, 0.5),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("REDISLOCK_TEST_VT", "3600")),
        # with a short visibility timeout, look for messages to restore every second
        **(
            {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}
            if os.environ.get("REDISLOCK_TEST_VT")
            else {}
        ),
    },
    result_expires=600,
    worker_hijack_root_logger=False,
)
if os.environ.get("REDISLOCK_TEST_BAD_SETTING"):  # a misconfigured deployment
    app.conf.redislock_on_contention = "whenever"
if os.environ.get("REDISLOCK_TEST_BROKER"):  # e.g. RabbitMQ; locks stay in Redis
    app.conf.broker_url = os.environ["REDISLOCK_TEST_BROKER"]
    app.conf.redislock_url = URL


def amqp_queues(specs: list[dict[str, Any]]) -> list[Any]:
    """kombu queues from ``{name, exchange, routing_key, type?, arguments?}`` specs."""
    from kombu import Exchange, Queue

    return [
        Queue(
            q["name"],
            Exchange(q["exchange"], type=q.get("type", "direct")),
            routing_key=q["routing_key"],
            queue_arguments=q.get("arguments"),
        )
        for q in specs
    ]


if os.environ.get("REDISLOCK_TEST_AMQP_QUEUES"):  # queues of named exchanges, quorum, priority
    app.conf.task_queues = amqp_queues(json.loads(os.environ["REDISLOCK_TEST_AMQP_QUEUES"]))
if os.environ.get("REDISLOCK_TEST_RESULT_BACKEND"):  # e.g. file://<dir>: a polling backend
    app.conf.result_backend = os.environ["REDISLOCK_TEST_RESULT_BACKEND"]
if os.environ.get("REDISLOCK_TEST_QUEUES_IN_OTHER_DB"):  # a broker's lists in another db
    app.conf.redislock_queues_in_other_db = True
if os.environ.get("REDISLOCK_TEST_NO_FALLBACK"):
    app.conf.redislock_park_fallback = False
if os.environ.get("REDISLOCK_TEST_LOCK_URL"):  # locks in a Redis of their own
    app.conf.redislock_url = os.environ["REDISLOCK_TEST_LOCK_URL"]
if os.environ.get("REDISLOCK_TEST_LOCK_TIMEOUT"):  # a lock Redis that may stop answering
    seconds = float(os.environ["REDISLOCK_TEST_LOCK_TIMEOUT"])
    app.conf.redislock_redis_options = {
        "socket_timeout": seconds,
        "socket_connect_timeout": seconds,
    }
if os.environ.get("REDISLOCK_TEST_QUORUM"):  # locks on a quorum of masters
    app.conf.redislock_urls = os.environ["REDISLOCK_TEST_QUORUM"].split(",")
if os.environ.get("REDISLOCK_TEST_SIGNING_KEY"):  # a worker with another signing key
    app.conf.redislock_signing_key = os.environ["REDISLOCK_TEST_SIGNING_KEY"]

_r: redis.Redis | None = None


def r() -> redis.Redis:
    global _r
    if _r is None:
        _r = redis.Redis.from_url(URL)
    return _r


def section(kind: str, key: Any, task_id: str, enter: float, leave: float) -> None:
    r().rpush(f"sections:{kind}", f"{key} {task_id} {enter!r} {leave!r}")


@app.task(bind=True, base=LockedTask, lock_key="account:{account_id}")
def settle(self: Any, account_id: int, amount: int, work: float = 0.02) -> int:
    enter = time.monotonic()
    balance = int(r().get(f"balance:{account_id}") or 0)
    time.sleep(work)  # the window in which an unlocked update is lost
    r().set(f"balance:{account_id}", balance + amount)
    section("settle", account_id, self.request.id, enter, time.monotonic())
    return balance + amount


@app.task(bind=True)
def settle_unlocked(self: Any, account_id: int, amount: int, work: float = 0.02) -> int:
    balance = int(r().get(f"balance:{account_id}") or 0)
    time.sleep(work)
    r().set(f"balance:{account_id}", balance + amount)
    return balance + amount


_DELIVERY = ("exchange", "routing_key", "priority")


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", soft_time_limit=30)
def hold_for(self: Any, name: str, seconds: float, fence: bool = False) -> int | None:
    """Hold the lock ``seconds``; reports the attempt's token; fenced write at the end."""
    lock = self.lock
    token = lock.token
    r().rpush(f"started:{name}", f"{self.request.id} {token} {os.getpid()}")
    info = self.request.delivery_info or {}
    r().rpush(f"delivered:{name}", json.dumps([info.get(k) for k in _DELIVERY]))
    time.sleep(seconds)
    if fence:
        admitted = FencedResource(r(), f"res:{name}").write(token, f"res:{name}:value", token)
        r().rpush(f"fenced:{name}", f"{token} {admitted}")
    return token


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", time_limit=1.0, soft_time_limit=1.0)
def exceed_hard_limit(self: Any, name: str) -> None:
    r().rpush(f"started:{name}", self.request.id)
    try:
        time.sleep(30)
    except BaseException:  # ignore the soft limit: only the hard kill stops this task
        time.sleep(30)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", time_limit=60, soft_time_limit=0.5)
def exceed_soft_limit(self: Any, name: str) -> None:
    r().rpush(f"started:{name}", self.request.id)
    time.sleep(30)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", max_retries=2)
def retry_once(self: Any, name: str) -> str:
    r().rpush(f"attempts:{name}", f"{self.request.retries} {self.lock.owned()}")
    if self.request.retries == 0:
        raise self.retry(countdown=0.5)
    return "done"


@app.task(
    bind=True, base=LockedTask, lock_key="job:{name}", max_retries=2, lock_release_on_retry=False
)
def retry_keeping(self: Any, name: str) -> str:
    r().rpush(f"attempts:{name}", f"{self.request.retries} {self.lock.hold_count}")
    if self.request.retries == 0:
        raise self.retry(countdown=0.5)
    return "done"


@app.task(
    bind=True, base=LockedTask, lock_key="job:{name}", max_retries=2, lock_release_on_retry=False
)
def retry_keeping_long(self: Any, name: str, work: float) -> str:
    """Keeps its lock across one retry, then works ``work`` seconds (longer than a short
    visibility timeout: the retry message is redelivered while it runs)."""
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)
    r().rpush(f"runs:{name}", f"start {self.request.retries} {os.getpid()} {self.lock.token}")
    time.sleep(work)
    r().rpush(f"runs:{name}", f"end {self.request.retries} {os.getpid()}")
    return "done"


@app.task(bind=True, base=LockedTask, lock_key="job:{name}")
def reject(self: Any, name: str) -> None:
    raise Reject("no", requeue=False)


@app.task(bind=True, base=LockedTask, lock_key="job:{name}")
def fail(self: Any, name: str) -> None:
    raise RuntimeError("task failed on purpose")


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", on_contention="skip")
def skip_if_busy(self: Any, name: str) -> str:
    return "ran"


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", on_contention="raise")
def raise_if_busy(self: Any, name: str) -> str:
    return "ran"


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", on_contention="wait", lock_wait=20)
def wait_if_busy(self: Any, name: str) -> str:
    return "ran"


@app.task(base=LockedTask, lock_key="user:{user[id]}")
def bad_value(user: dict[str, Any]) -> None:
    return None


@app.task(base=LockedTask, on_contention="skip", lock_hold=2.0)
def nightly() -> None:
    r().rpush("nightly:runs", f"{time.time()!r}")


if os.environ.get("REDISLOCK_TEST_BEAT"):
    app.conf.beat_schedule = {
        "nightly": {"task": "tests.celery_app.nightly", "schedule": 1.0},
    }


# ---------------------------------------------------------------- canvas and nested calls


@app.task(bind=True, base=LockedTask, lock_key="job:{name}", max_retries=2)
def retry_no_throw(self: Any, name: str) -> str:
    """``self.retry(throw=False)``: the first run returns, and the retry runs too."""
    r().rpush(f"attempts:{name}", f"{self.request.retries} {self.lock.token}")
    if self.request.retries == 0:
        self.retry(countdown=0, throw=False)
        return "first"
    return "retried"


@app.task(bind=True, base=LockedTask, lock_key="job:{name}")
def replace_me(self: Any, name: str, step: int = 0) -> str:
    """Replaces itself (same lock key) with its next step; the last step returns."""
    r().rpush(f"steps:{name}", f"{step} {self.request.id}")
    if step < 2:
        raise self.replace(replace_me.s(name, step + 1))
    return f"step {step}"


@app.task(bind=True, base=LockedTask, lock_key="job:{name}")
def replace_with_other(self: Any, name: str) -> Any:
    """Replaced by another LockedTask on the same lock key."""
    r().rpush(f"steps:{name}", f"outer {self.request.id}")
    raise self.replace(hold_for.s(name, 0.0))


@app.task(bind=True, base=LockedTask, lock_key="job:{name}")
def nest(self: Any, name: str, inner: str | None = None, how: str = "self") -> str:
    """Calls a LockedTask directly from its body (``inner`` None: itself, same key)."""
    if inner == "-":  # the nested call
        r().rpush(f"nested:{name}", f"inner {self.lock.name} {self.lock.owned()}")
        return "inner"
    outer = self.lock
    if how == "self":
        got = nest(inner or name, "-")
    elif how == "other":
        got = str(hold_for(inner or name, 0.0))
    else:  # eager .apply() inside the body
        got = str(nest.apply((inner or name, "-")).get(disable_sync_subtasks=False))
    assert self.lock is outer, "self.lock must be the outer lock again"
    self.lock.ensure_held()
    r().rpush(f"nested:{name}", f"outer {self.lock.name} {got}")
    return got


@app.task
def biggest(values: list[int]) -> int:
    """A chord's body: the largest of its header's results."""
    return max(values)


if not os.environ.get("REDISLOCK_TEST_QUORUM"):  # (lock_limit: one Redis, refused on a quorum)

    @app.task(bind=True, base=LockedTask, lock_key="tenant:{tenant}", lock_limit=2)
    def tenant_job(self: Any, tenant: str, seconds: float, fence: bool = False) -> int | None:
        """At most two at once per tenant: records its section, and its token's fenced write."""
        token = self.lock.token
        enter = time.time()
        r().rpush(f"started:{tenant}", f"{self.request.id} {token} {os.getpid()}")
        time.sleep(seconds)
        if fence:
            admitted = FencedResource(r(), f"res:{tenant}").write(token, f"res:{tenant}:v", token)
            r().rpush(f"fenced:{tenant}", f"{token} {admitted}")
        section("limit", tenant, self.request.id, enter, time.time())
        return token

    @app.task(
        bind=True,
        base=LockedTask,
        lock_key="tenant:{tenant}",
        lock_limit=lambda args, kwargs: 3 if kwargs.get("plan") == "pro" else 1,
    )
    def plan_job(self: Any, tenant: str, seconds: float, plan: str = "free") -> int:
        """Shares tenant_job's permits; its limit comes from the call's plan."""
        enter = time.time()
        time.sleep(seconds)
        section("limit", tenant, self.request.id, enter, time.time())
        return int(self.lock.token)

    def _limited_by_policy(policy: str) -> Any:
        @app.task(
            bind=True,
            base=LockedTask,
            name=f"tests.celery_app.tenant_{policy}",
            lock_key="tenant:{tenant}",
            lock_limit=2,
            on_contention=policy,
            lock_wait=20,
        )
        def job(self: Any, tenant: str) -> int:
            return int(self.lock.token)

        return job

    tenant_wait, tenant_skip, tenant_raise = map(_limited_by_policy, ("wait", "skip", "raise"))

    @app.task(bind=True, base=LockedTask, lock_key="tenant:{tenant}", lock_limit=2, max_retries=1)
    def limited_outcome(self: Any, tenant: str, how: str) -> str:
        """Ends as ``how`` says: "ok", "fail" (an exception), "retry" (``self.retry()``
        once), "lost" (its permit deleted under it); records the permits this process's
        runs hold meanwhile (``metrics.STATS.permits_held()``)."""
        r().rpush(f"held:{tenant}", json.dumps(metrics.STATS.permits_held()))
        if how == "fail":
            raise ValueError("failed on purpose")
        if how == "retry" and not self.request.retries:
            raise self.retry(countdown=0.1)
        if how == "lost":
            r().delete(self.lock.semaphore_keys.permit(self.lock.owner))
        return how

    @app.task(
        bind=True,
        base=LockedTask,
        lock_key="tenant:{tenant}",
        lock_limit=2,
        on_contention="wait",
        lock_wait=0.05,
        lock_wait_fallback="requeue",
    )
    def limited_wait(self: Any, tenant: str) -> int:
        """Waits briefly for its permit, then is re-queued (never parked)."""
        return int(self.lock.token)

    @app.task(
        bind=True,
        base=LockedTask,
        lock_key="merchant:{merchant}",
        lock_limit=None,
        lock_rate=os.environ.get("REDISLOCK_TEST_RATE", "20/s"),
    )
    def charge(self: Any, merchant: str, n: int) -> int:
        """A rate only (no lock): records every start with when its rate admitted it."""
        slot = self.request.redislock_rate_slot_us
        r().rpush(f"starts:{merchant}", f"{slot} {n} {self.request.id}")
        return n

    @app.task(
        bind=True,
        base=LockedTask,
        lock_key="account:{account}",
        lock_limit=2,
        lock_rate="10/s",
        lock_rate_key="merchant:{merchant}",
    )
    def settle_rated(self: Any, account: str, merchant: str, seconds: float) -> int:
        """Two at a time per account, 10 a second per merchant: records its section."""
        enter = time.time()
        slot = self.request.redislock_rate_slot_us
        r().rpush(f"starts:{merchant}", f"{slot} 0 {self.request.id}")
        time.sleep(seconds)
        section("limit", account, self.request.id, enter, time.time())
        return 0


@app.task
def permits_held() -> dict[str, int]:
    """The permits this worker process's runs hold, per task name (metrics)."""
    return metrics.STATS.permits_held()
