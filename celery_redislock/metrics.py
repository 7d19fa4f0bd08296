"""Metrics: counters and wait-time histograms fed by :mod:`celery_redislock.signals`.

Three ways to read them:

* in process: ``metrics.STATS.snapshot()`` (after ``metrics.enable()``);
* across workers: ``LockedTask`` workers add their numbers to the Redis hash
  ``<prefix>stats`` about once a second, which ``celery redislock stats`` reads;
* Prometheus (``pip install celery_redislock[prometheus]``): ``metrics.enable_prometheus()``
  registers ``redislock_*`` counters and histograms with ``prometheus_client``.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import signals
from ._keyspace import stats_key

#: Upper bounds (seconds) of the wait-time histogram buckets; the last bucket is +inf.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COUNTERS = (
    "acquired",
    "contended",
    "released",
    "lost",
    "renewed",
    "parked",
    "requeued",
    "pulled",
    "release_failed",
    "parked_rejected",
    "rate_admitted",
    "deferred",
    "undeferred",
)


class LockStats:
    """Thread-safe counters and a wait-time histogram; ``drain()`` hands out deltas."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._counts: dict[str, float] = {}
        self._last_flush = time.monotonic()

    def add(self, field: str, amount: float = 1) -> None:
        with self._mutex:
            self._counts[field] = self._counts.get(field, 0) + amount

    def observe_wait(self, seconds: float) -> None:
        index = bisect.bisect_left(WAIT_BUCKETS, seconds)
        bucket = f"wait_le_{WAIT_BUCKETS[index]}" if index < len(WAIT_BUCKETS) else "wait_le_inf"
        with self._mutex:
            self._counts[bucket] = self._counts.get(bucket, 0) + 1
            self._counts["wait_sum"] = self._counts.get("wait_sum", 0) + seconds

    def snapshot(self) -> dict[str, float]:
        with self._mutex:
            return dict(self._counts)

    def drain(self) -> dict[str, float]:
        with self._mutex:
            counts, self._counts = self._counts, {}
            self._last_flush = time.monotonic()
            return counts

    def due(self, every: float) -> bool:
        return time.monotonic() - self._last_flush >= every


STATS = LockStats()


def _on_acquired(sender: Any = None, waited: float = 0.0, **_: Any) -> None:
    STATS.add("acquired")
    STATS.observe_wait(waited)


def _counter(field: str, amount_key: str | None = None) -> Any:
    def receive(sender: Any = None, **kwargs: Any) -> None:
        STATS.add(field, kwargs.get(amount_key, 1) if amount_key else 1)

    return receive


def _per_task(field: str) -> Any:
    """Count ``field`` overall and per task name (``<field>:<task name>``)."""

    def receive(sender: Any = None, **_: Any) -> None:
        STATS.add(field)
        task = getattr(sender, "name", None)
        if isinstance(task, str):
            STATS.add(f"{field}:{task}")

    return receive


def _on_undeferred(sender: Any = None, name: str = "", delay: float = 0.0, **_: Any) -> None:
    """A deferred task sent: counted, and its deferral delay in a histogram per task name
    (``deferral_le_<bound>:<task>``, ``deferral_sum:<task>``)."""
    STATS.add("undeferred")
    STATS.add(f"undeferred:{name}")
    index = bisect.bisect_left(DEFERRAL_BUCKETS, delay)
    bound = DEFERRAL_BUCKETS[index] if index < len(DEFERRAL_BUCKETS) else "inf"
    STATS.add(f"deferral_le_{bound}:{name}")
    STATS.add(f"deferral_sum:{name}", delay)


#: Upper bounds (seconds) of the deferral-delay histogram buckets; the last is +inf.
DEFERRAL_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 3600.0)

_RECEIVERS: list[tuple[signals.Signal, Any]] = [
    (signals.lock_acquired, _on_acquired),
    (signals.lock_contended, _counter("contended")),
    (signals.lock_released, _counter("released")),
    (signals.lock_lost, _counter("lost")),
    (signals.lock_renewed, _counter("renewed", "count")),
    (signals.task_parked, _counter("parked")),
    (signals.task_requeued, _counter("requeued")),
    (signals.task_pulled, _counter("pulled")),
    (signals.lock_release_failed, _counter("release_failed")),
    (signals.parked_rejected, _counter("parked_rejected")),
    (signals.task_rate_admitted, _per_task("rate_admitted")),
    (signals.task_deferred, _per_task("deferred")),
    (signals.task_undeferred, _on_undeferred),
]
_enabled = False


def enable() -> None:
    """Start counting into :data:`STATS` (idempotent). ``LockedTask`` workers call it."""
    global _enabled
    if not _enabled:
        for signal, receiver in _RECEIVERS:
            signal.connect(receiver)
        _enabled = True


def flush_to_redis(client: Any, prefix: str, *, every: float = 1.0, force: bool = False) -> None:
    """Add the counts gathered since the last flush to ``<prefix>stats`` (one round trip)."""
    if not (force or STATS.due(every)):
        return
    counts = STATS.drain()
    if not counts:
        return
    pipe = client.pipeline(transaction=False)
    for field, amount in counts.items():
        if isinstance(amount, float) and not amount.is_integer():
            pipe.hincrbyfloat(stats_key(prefix), field, amount)
        else:
            pipe.hincrby(stats_key(prefix), field, int(amount))
    pipe.execute()


def percentile(buckets: Mapping[str, float], fraction: float) -> float | None:
    """The bucket upper bound below which ``fraction`` of the observed waits fall."""
    bounds = [*WAIT_BUCKETS, float("inf")]
    counts = [
        float(buckets.get(f"wait_le_{b}" if b != float("inf") else "wait_le_inf", 0))
        for b in bounds
    ]
    total = sum(counts)
    if not total:
        return None
    running = 0.0
    for bound, count in zip(bounds, counts):
        running += count
        if running >= fraction * total:
            return bound
    return bounds[-1]


def enable_prometheus(registry: Any = None) -> None:
    """Export ``redislock_*`` metrics through ``prometheus_client`` (the ``prometheus`` extra)."""
    try:
        import prometheus_client as prom
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError(
            "enable_prometheus() needs prometheus_client: "
            "pip install 'celery_redislock[prometheus]'"
        ) from exc
    kwargs = {} if registry is None else {"registry": registry}
    counters = {
        name: prom.Counter(f"redislock_{name}_total", f"Locks {name} (celery_redislock)", **kwargs)
        for name in COUNTERS
    }
    wait = prom.Histogram(
        "redislock_wait_seconds",
        "Time from acquire() to holding the lock",
        buckets=WAIT_BUCKETS,
        **kwargs,
    )
    held = prom.Histogram("redislock_held_seconds", "Time a lock was held", **kwargs)

    def acquired(sender: Any = None, waited: float = 0.0, **_: Any) -> None:
        counters["acquired"].inc()
        wait.observe(waited)

    def released(sender: Any = None, held_for: float = 0.0, **kwargs: Any) -> None:
        counters["released"].inc()
        held.observe(kwargs.get("held", held_for))

    signals.lock_acquired.connect(acquired)
    signals.lock_released.connect(released)
    for signal, name in (
        (signals.lock_contended, "contended"),
        (signals.lock_lost, "lost"),
        (signals.task_parked, "parked"),
        (signals.task_requeued, "requeued"),
        (signals.task_pulled, "pulled"),
        (signals.lock_release_failed, "release_failed"),
        (signals.parked_rejected, "parked_rejected"),
        (signals.task_rate_admitted, "rate_admitted"),
        (signals.task_deferred, "deferred"),
        (signals.task_undeferred, "undeferred"),
    ):
        signal.connect(lambda sender=None, _c=counters[name], **_: _c.inc())
    signals.lock_renewed.connect(lambda sender=None, count=1, **_: counters["renewed"].inc(count))
