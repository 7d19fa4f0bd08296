"""Bodies of the real processes the tests start (spawned, so nothing is inherited)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import redis

from celery_redislock import RedisLock

from ._support import blpop_within


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


def _no_resend(port: int, **kwargs: Any) -> redis.Redis:
    """A client that never re-sends a command (neither the lock's scripts nor the witness's
    are idempotent: docs/concepts.md, 'A release that cannot reach Redis')."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(port=port, retry=Retry(NoBackoff(), 0), **kwargs)


#: witness(keys=[inside, seq, log], args=[event, pid, token]) -> holders inside after the
#: event. Runs on a server the semaphore does not use: one atomic step that counts the
#: holders inside (INCR on "enter", DECR on "exit"), numbers the event (one sequence for
#: all processes: a total order, no clock involved) and logs it with the server's TIME.
WITNESS = """
local inside
if ARGV[1] == 'enter' then
  inside = redis.call('incr', KEYS[1])
else
  inside = redis.call('decr', KEYS[1])
end
local seq = redis.call('incr', KEYS[2])
local now = redis.call('time')
redis.call('rpush', KEYS[3], table.concat(
  {ARGV[1], ARGV[2], ARGV[3], seq, inside, now[1] .. string.format('%06d', now[2])}, ' '))
return inside
"""


def sem_sections(
    lock_port: int,
    witness_port: int,
    name: str,
    limit: int,
    iterations: int,
    hold: float,
    prefix: str,
) -> None:
    """Wait for "go" (a push on ``<prefix>:go`` on the witness), then take a permit of the
    semaphore ``name`` (on the server on ``lock_port``) ``iterations`` times, holding it for
    ``hold`` seconds. Each section reports its entry (after the acquire returned) and its
    exit (before the release) to the witness server (:data:`WITNESS`, keys under
    ``prefix``); at the end the process reports how many sections it completed."""
    from celery_redislock import RedisSemaphore

    client = _no_resend(lock_port, socket_timeout=30)
    witness = _no_resend(witness_port, socket_timeout=30)
    record = witness.register_script(WITNESS)
    keys = [f"{prefix}:inside", f"{prefix}:seq", f"{prefix}:log"]
    sem = RedisSemaphore(client, name, limit=limit, ttl=10)
    pid = os.getpid()
    witness.rpush(f"{prefix}:ready", pid)
    assert blpop_within(witness, [f"{prefix}:go"], 120) is not None
    done = 0
    for _ in range(iterations):
        assert sem.acquire(timeout=120)
        record(keys=keys, args=["enter", pid, sem.token])
        time.sleep(hold)
        record(keys=keys, args=["exit", pid, sem.token])
        sem.release()
        done += 1
    witness.rpush(f"{prefix}:done", f"{pid} {done}")
    client.close()
    witness.close()


def sem_lease_holder(
    lock_port: int, witness_port: int, name: str, owner: str, ttl: float, report_key: str
) -> None:
    """Take a permit (limit 3, lease ``ttl``, renewed by the watchdog) as ``owner`` and report
    its token on the witness; then wait for an order on ``<report_key>:go``: "write" writes
    through the FencedResource "ledger" (on the witness) with the token, "check" does not;
    either way, report whether the permit is still held and release it if so."""
    import json

    from celery_redislock import FencedResource, LockLostError, RedisSemaphore

    client = _no_resend(lock_port, socket_timeout=10)
    witness = _no_resend(witness_port, socket_timeout=10)
    sem = RedisSemaphore(client, name, limit=3, ttl=ttl, owner=owner)
    assert sem.acquire(timeout=30)
    token = sem.token
    assert token is not None
    witness.rpush(report_key, json.dumps({"owner": owner, "token": token, "pid": os.getpid()}))
    order = None
    deadline = time.monotonic() + 120
    while order is None and time.monotonic() < deadline:  # bounded: a SIGSTOP waits here
        order = witness.blpop([f"{report_key}:go"], timeout=1)
    assert order is not None
    wrote = None
    if order[1] == b"write":
        wrote = FencedResource(witness, "ledger").write(token, "ledger:value", owner)
    try:
        sem.ensure_held()
        held = "held"
    except LockLostError as exc:
        held = f"lost {exc.reason}"
    report = {"owner": owner, "wrote": wrote, "held": held, "lost": sem.lost.is_set()}
    if held == "held":
        sem.release()
    witness.rpush(report_key, json.dumps(report))


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
    popped = blpop_within(client, [go_key], 60)
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
