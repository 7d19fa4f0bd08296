"""Bodies of the real processes the tests start (spawned, so nothing is inherited)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import redis

from celery_redislock import RedisLock


def hammer(port: int, name: str, iterations: int, log_key: str) -> None:
    """Take the lock ``iterations`` times; inside, a non-atomic read-modify-write.

    Every critical section is logged as (pid, enter, exit) on the shared monotonic clock
    so the test can check that no two overlapped and that it saw them all.
    """
    client = redis.Redis(port=port, socket_timeout=10)
    lock = RedisLock(client, name, ttl=10)
    for _ in range(iterations):
        with lock:
            enter = time.monotonic()
            value = int(client.get(f"{name}:counter") or 0)
            time.sleep(0.0005)
            client.set(f"{name}:counter", value + 1)
            leave = time.monotonic()
            client.rpush(log_key, f"{os.getpid()} {enter!r} {leave!r} {lock.token}")
    client.close()


def hold_then_report(port: int, name: str, ttl: float, owner: str | None, ready_key: str) -> None:
    """Acquire and signal readiness, then sleep until killed."""
    client = redis.Redis(port=port, socket_timeout=10)
    lock = RedisLock(client, name, ttl=ttl, owner=owner, auto_renew=False)
    assert lock.acquire(timeout=5)
    client.rpush(ready_key, str(lock.token))
    time.sleep(600)


def release_as(port: int, name: str, owner: str, result_key: str) -> None:
    """Release a hold taken in another process under an explicit owner."""
    client = redis.Redis(port=port, socket_timeout=10)
    try:
        RedisLock(client, name, owner=owner).release()
        client.rpush(result_key, "released")
    except Exception as exc:  # reported to the test, which asserts on it
        client.rpush(result_key, f"error {type(exc).__name__}")


def run(target: Any, *args: Any) -> Any:
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    return process


def sigkill(process: Any) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)


def try_steal(port: int, name: str, seconds: float, result_key: str) -> None:
    """Try a non-blocking acquire every 20 ms for ``seconds``; report how many succeeded."""
    client = redis.Redis(port=port, socket_timeout=10)
    lock = RedisLock(client, name, ttl=5, auto_renew=False)
    stolen = attempts = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        attempts += 1
        if lock.acquire(blocking=False):
            stolen += 1
            lock.release()
        time.sleep(0.02)
    client.rpush(result_key, f"{stolen} {attempts}")


def hold_until_lost(port: int, name: str, ttl: float, report_key: str) -> None:
    """Hold with the watchdog on; once the loss is reported, show what the holder sees."""
    from celery_redislock import FencedResource, LockLostError

    client = redis.Redis(port=port, socket_timeout=10)
    lock = RedisLock(client, name, ttl=ttl)
    reasons: list[str] = []
    lock.on_lost(lambda _lock, error: reasons.append(error.reason))
    assert lock.acquire(timeout=5)
    token = lock.token
    assert token is not None
    assert FencedResource(client, "ledger").write(token, "ledger:value", "first holder")
    client.rpush(report_key, f"ready {token}")
    signalled = lock.lost.wait(60)  # the test SIGSTOPs us past the lease, then SIGCONTs
    client.rpush(report_key, f"lost {signalled} {lock.lost.reason} callbacks={','.join(reasons)}")
    try:
        lock.ensure_held()
        client.rpush(report_key, "ensure_held passed")
    except LockLostError as exc:
        client.rpush(report_key, f"ensure_held raised {exc.reason}")
    admitted = FencedResource(client, "ledger").write(token, "ledger:value", "stale holder")
    client.rpush(report_key, f"fenced write admitted={admitted}")
    try:
        lock.release()
        client.rpush(report_key, "release passed")
    except LockLostError as exc:
        client.rpush(report_key, f"release raised {type(exc).__name__}")


def wait_in_line(port: int, name: str) -> None:
    """Block in acquire (joining the line) until killed."""
    client = redis.Redis(port=port, socket_timeout=10)
    RedisLock(client, name, ttl=30, owner="doomed-waiter").acquire(timeout=600)


def hammer_quorum(ports: list[int], name: str, iterations: int, log_key: str) -> None:
    """:func:`hammer` through the quorum lock; the counter and log live on the first node."""
    from celery_redislock import RedLock

    clients = [redis.Redis(port=p, socket_timeout=10) for p in ports]
    # A generous node timeout: this checks exclusion, not speed, on a busy 2-core machine.
    lock = RedLock(clients, name, ttl=10, node_timeout=1.0)
    data = clients[0]
    for _ in range(iterations):
        with lock:
            enter = time.monotonic()
            value = int(data.get(name) or 0)
            time.sleep(0.0005)
            data.set(name, value + 1)
            leave = time.monotonic()
            data.rpush(log_key, f"{enter!r} {leave!r} {lock.token}")


def sem_hammer(port: int, name: str, limit: int, iterations: int, log_key: str) -> None:
    """Take a permit of the semaphore ``name`` ``iterations`` times; inside, count the
    holders in Redis (INCR on entry, DECR on exit) and log (pid, inside, token)."""
    from celery_redislock import RedisSemaphore

    client = redis.Redis(port=port, socket_timeout=10)
    sem = RedisSemaphore(client, name, limit=limit, ttl=10)
    for _ in range(iterations):
        with sem:
            inside = client.incr(f"{name}:inside")
            time.sleep(0.01)
            client.decr(f"{name}:inside")
            client.rpush(log_key, f"{os.getpid()} {inside} {sem.token}")
    client.close()


def sem_holder(port: int, name: str, owner: str, ttl: float, report_key: str) -> None:
    """Take a permit (limit 3) as ``owner`` and report its token; on "go" (a push on
    ``<report_key>:go``), write through a FencedResource with it and report the outcome."""
    import json

    from celery_redislock import FencedResource, LockLostError, RedisSemaphore

    client = redis.Redis(port=port, socket_timeout=10)
    sem = RedisSemaphore(client, name, limit=3, ttl=ttl, owner=owner)
    assert sem.acquire(timeout=10)
    client.rpush(report_key, json.dumps({"owner": owner, "token": sem.token}))
    while client.blpop([f"{report_key}:go"], timeout=5) is None:
        pass
    wrote = FencedResource(client, f"{name}:ledger").write(sem.token, f"{name}:value", owner)
    try:
        sem.ensure_held()
        held = "held"
    except LockLostError as exc:
        held = f"lost {exc.reason}"
    client.rpush(report_key, json.dumps({"owner": owner, "wrote": wrote, "held": held}))


def rate_hammer(port: int, name: str, rate: str, burst: int, go_key: str, log_key: str) -> None:
    """Be admitted by the rate limiter ``name`` as fast as it allows, from "go" (a push on
    ``go_key`` carrying the end, in microseconds of the server's clock) until a slot would
    be due after that end. Each admitted slot is booked and slept to as ``acquire()`` does
    (``reserve()``, then a sleep for its wait), so its server-time due moment can be logged:
    one entry per admission, then ``done <admissions>``."""
    from celery_redislock import RedisRateLimiter

    client = redis.Redis(port=port, socket_timeout=10)
    limiter = RedisRateLimiter(client, name, rate, burst=burst)
    client.rpush(f"{log_key}:ready", os.getpid())
    popped = client.blpop([go_key], timeout=60)
    assert popped is not None
    end_us = int(popped[1])
    admitted = 0
    while True:
        slot = limiter.reserve()
        assert slot.admitted  # no max_wait: every call books its slot
        if slot.due_us > end_us:
            break
        client.rpush(log_key, slot.due_us)
        admitted += 1
        time.sleep(slot.wait)
    client.rpush(f"{log_key}:done", admitted)
    client.close()
