"""Signals and metrics: what a lock's life sends, counted in process and for Prometheus."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import redis

from celery_redislock import RedisLock, metrics, signals


def test_signals_report_a_locks_life(redis_client: redis.Redis) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def record(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        seen.append((signal.name, kwargs))

    lock = RedisLock(redis_client, "observed", ttl=5)
    hooks = [signals.lock_acquired, signals.lock_contended, signals.lock_released]
    for hook in hooks:
        hook.connect(record, sender=lock)
    try:
        lock.acquire()
        lock.acquire()  # a re-entry is not a new acquisition
        lock.release()
        lock.release()
        RedisLock(redis_client, "observed", owner="other").acquire()
        assert lock.acquire(blocking=False) is False
    finally:
        for hook in hooks:
            hook.disconnect(record, sender=lock)
    assert [name for name, _ in seen] == ["lock_acquired", "lock_released", "lock_contended"]
    assert seen[0][1]["token"] == 1 and seen[0][1]["name"] == "observed"
    assert seen[1][1]["held"] >= 0


def test_stats_count_and_flush_to_redis(redis_client: redis.Redis) -> None:
    metrics.enable()
    metrics.STATS.drain()
    lock = RedisLock(redis_client, "counted", ttl=5)
    for _ in range(3):
        lock.acquire()
        lock.release()
    metrics.flush_to_redis(redis_client, "redislock:", force=True)
    stored = {k.decode(): float(v) for k, v in redis_client.hgetall("redislock:stats").items()}
    assert stored["acquired"] == 3 and stored["released"] == 3
    assert metrics.percentile(stored, 0.5) is not None


def test_prometheus_export(redis_client: redis.Redis) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    metrics.enable_prometheus(registry)
    lock = RedisLock(redis_client, "exported", ttl=5)
    lock.acquire()
    lock.release()
    assert registry.get_sample_value("redislock_acquired_total") >= 1
    assert registry.get_sample_value("redislock_wait_seconds_count") >= 1


def test_stats_read_back_from_redis_skip_what_is_not_a_number() -> None:
    stored = {
        b"acquired": b"3",
        b"wait_sum": b"0.25",
        b"lost": b"many",
        b"renewed": b"nan",
        b"released": b"inf",
        b"\xff\xfe": b"1",  # a field that is not UTF-8
        "contended": 2,
    }
    assert metrics.numbers(stored) == {"acquired": 3.0, "wait_sum": 0.25, "contended": 2.0}


def test_limited_tasks_are_summed_per_task_name() -> None:
    totals = {
        "acquired": 9.0,  # not a limited task's
        "limit_taken@proj.sync": 4.0,
        "limit_parked@proj.sync": 2.0,
        "limit_requeued@proj.sync": 1.0,
        "limit_wait_le_0.001@proj.sync": 3.0,
        "limit_wait_le_2.5@proj.sync": 1.0,
        "limit_wait_sum@proj.sync": 2.1,
        "limit_taken@odd@name": 1.0,  # a task name may hold the separator
        "limit_taken@": 5.0,  # no task name: skipped
        "wait_le_0.5@proj.sync": 7.0,  # not a limit_ field: skipped
    }
    assert metrics.limit_summary(totals) == {
        "odd@name": {
            "taken": 1,
            "parked": 0,
            "requeued": 0,
            "deferred": 0,
            "wait_p50": None,
            "wait_p95": None,
            "wait_p99": None,
        },
        "proj.sync": {
            "taken": 4,
            "parked": 2,
            "requeued": 1,
            "deferred": 3,
            "wait_p50": 0.001,
            "wait_p95": 2.5,
            "wait_p99": 2.5,
        },
    }


def test_a_forked_child_starts_counting_from_zero() -> None:
    """Its parent flushes its own counts: a pool process must not add them again."""
    metrics.enable()
    metrics.STATS.drain()
    metrics.STATS.add("acquired", 2)
    metrics.STATS.hold("proj.sync", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        clean = metrics.STATS.snapshot() == {} and metrics.STATS.permits_held() == {}
        metrics.STATS.add("acquired")  # and it counts on its own
        os._exit(0 if clean and metrics.STATS.snapshot() == {"acquired": 1} else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert metrics.STATS.snapshot() == {"acquired": 2}  # the parent's, untouched
    assert metrics.STATS.permits_held() == {"proj.sync": 1}
    metrics.STATS.hold("proj.sync", -1)
    metrics.STATS.drain()
