"""Signals and metrics: what a lock's life sends, counted in process and for Prometheus."""

from __future__ import annotations

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
