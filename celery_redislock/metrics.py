"""Metrics: counters and wait-time histograms fed by :mod:`celery_redislock.signals`.

Three ways to read them:

* in process: ``metrics.STATS.snapshot()`` and ``STATS.permits_held()`` (after
  ``metrics.enable()``);
* across workers: ``LockedTask`` workers add their numbers to the Redis hash
  ``<prefix>stats`` about once a second, which ``celery redislock stats`` reads;
* Prometheus: ``celery -A proj redislock exporter`` serves the vocabulary of
  :mod:`celery_redislock.series` (``celery_redislock_*``: per task name and queue, the
  workers' counts from the hash and gauges read from Redis by that one process);
  ``metrics.enable_prometheus()`` registers this process's older ``redislock_*`` series
  with ``prometheus_client`` (locks used outside Celery tasks too).

The workers' series are counted per run: a lock signal (its sender the lock, its
``owner`` a run's) is put down to the task whose run owns it through :func:`track_run`,
which the Celery layer calls as each run starts (a dict look-up; nothing is sent).

Limited tasks (``lock_limit``) are counted per task name, never per key (keys are
unbounded): ``limit_<what>@<task name>`` fields (:data:`LIMIT_COUNTERS`, a wait-time
histogram) and the gauge of permits held by this process's runs, which is never written
to Redis (a process that dies would leave its count there for ever).

Homes: the counts themselves in :mod:`._stats` (``STATS``), the series' per-run counting
in :mod:`._series_counts`; both re-exported here. This module connects the signals,
flushes the counts to Redis, reads them back, and exports them to ``prometheus_client``.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import signals
from ._keyspace import stats_key
from ._process import on_fork
from ._series_counts import RECEIVERS as _SERIES_RECEIVERS
from ._series_counts import _count as _count
from ._series_counts import _observe as _observe
from ._series_counts import end_run as end_run
from ._series_counts import queue_name as queue_name
from ._series_counts import track_run as track_run
from ._stats import COUNTERS as COUNTERS
from ._stats import DEFERRAL_BUCKETS as DEFERRAL_BUCKETS
from ._stats import LIMIT_COUNTERS as LIMIT_COUNTERS
from ._stats import STATS as STATS
from ._stats import TASK_SEPARATOR as TASK_SEPARATOR
from ._stats import WAIT_BUCKETS as WAIT_BUCKETS
from ._stats import LockStats as LockStats
from ._stats import _bucket as _wait_bucket
from ._stats import task_field as task_field
from ._stats import task_name as task_name

log = logging.getLogger(__name__)


def _on_acquired(sender: Any = None, waited: float = 0.0, **_: Any) -> None:
    STATS.add_each(("acquired", _wait_bucket(waited)), "wait_sum", float(waited))


def _counter(field: str, amount_key: str | None = None) -> Any:
    def receive(sender: Any = None, **kwargs: Any) -> None:
        STATS.add(field, kwargs.get(amount_key, 1) if amount_key else 1)

    return receive


def _deferred(field: str) -> Any:
    """Count ``field``, and a limited task's deferral as ``limit_<field>@<task>``."""

    def receive(sender: Any = None, limit: int | None = None, **_: Any) -> None:
        STATS.add(field)
        if limit is not None:
            STATS.add(task_field("limit_" + field, task_name(sender)))

    return receive


def _per_task(field: str) -> Any:
    """Count ``field`` overall and per task name (``<field>:<task name>``)."""

    def receive(sender: Any = None, **_: Any) -> None:
        STATS.add(field)
        task = getattr(sender, "name", None)
        if isinstance(task, str):
            STATS.add(f"{field}:{task}")

    return receive


def _on_permit_taken(sender: Any = None, waited: float = 0.0, **_: Any) -> None:
    task = task_name(sender)
    STATS.add(task_field("limit_taken", task))
    STATS.observe_wait(waited, task)
    STATS.hold(task, 1)


def _on_permit_ended(sender: Any = None, **_: Any) -> None:
    STATS.hold(task_name(sender), -1)


def _on_undeferred(sender: Any = None, name: str = "", delay: float = 0.0, **_: Any) -> None:
    """A deferred task sent: counted, and its deferral delay in a histogram per task name
    (``deferral_le_<bound>:<task>``, ``deferral_sum:<task>``)."""
    STATS.add("undeferred")
    STATS.add(f"undeferred:{name}")
    index = bisect.bisect_left(DEFERRAL_BUCKETS, delay)
    bound = DEFERRAL_BUCKETS[index] if index < len(DEFERRAL_BUCKETS) else "inf"
    STATS.add(f"deferral_le_{bound}:{name}")
    STATS.add(f"deferral_sum:{name}", float(delay))


_RECEIVERS: list[tuple[signals.Signal, Any]] = [
    (signals.lock_acquired, _on_acquired),
    (signals.lock_contended, _counter("contended")),
    (signals.lock_released, _counter("released")),
    (signals.lock_lost, _counter("lost")),
    (signals.lock_renewed, _counter("renewed", "count")),
    (signals.task_parked, _deferred("parked")),
    (signals.task_requeued, _deferred("requeued")),
    (signals.task_permit_taken, _on_permit_taken),
    (signals.task_permit_ended, _on_permit_ended),
    (signals.task_pulled, _counter("pulled")),
    (signals.lock_release_failed, _counter("release_failed")),
    (signals.parked_rejected, _counter("parked_rejected")),
    (signals.task_rate_admitted, _per_task("rate_admitted")),
    (signals.task_deferred, _per_task("deferred")),
    (signals.task_undeferred, _on_undeferred),
    (signals.task_superseded, _per_task("superseded")),
    (signals.task_debounced, _per_task("debounced")),
    # The vocabulary's series (celery_redislock.series), per task name and queue:
    *_SERIES_RECEIVERS,
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
    """Add the counts gathered since the last flush to ``<prefix>stats`` (one round trip).

    Not due yet (``every``): the counts wait, and this process's flusher thread (started
    here) adds them within ``every`` seconds, so the counts of a process that goes idle
    (its last run's, a lease lost) still reach Redis."""
    _keep_flushing(client, prefix, every)
    if not (force or STATS.due(every)):
        return
    counts = STATS.drain()
    if not counts:
        return
    pipe = client.pipeline(transaction=False)
    for field, amount in counts.items():
        # A sum of seconds is a float, even when it adds up to a whole number (0.0: runs
        # that took their lock at once): HINCRBY would be refused on a field that already
        # holds a fraction ("hash value is not an integer"), HINCRBYFLOAT never is.
        if isinstance(amount, float):
            pipe.hincrbyfloat(stats_key(prefix), field, amount)
        else:
            pipe.hincrby(stats_key(prefix), field, int(amount))
    pipe.execute()


#: Where this process's flusher thread adds counts left waiting: (client, prefix, every).
_flush_target: tuple[Any, str, float] | None = None
_flusher: threading.Thread | None = None
_flusher_mutex = threading.Lock()


#: Whether :func:`flush_to_redis` starts this process's flusher: worker processes only
#: (``celery_redislock.celery.worker`` turns it on at ``worker_init`` and
#: ``worker_process_init``); elsewhere counts wait for the next flush, as before.
_flushing = False


def keep_flushing(on: bool = True) -> None:
    """Let :func:`flush_to_redis` start (``on``) or keep running this process's flusher
    thread, which adds waiting counts to ``<prefix>stats`` within a second (off: it idles)."""
    global _flushing
    _flushing = on


def _keep_flushing(client: Any, prefix: str, every: float) -> None:
    global _flush_target, _flusher
    if not _flushing:
        return
    _flush_target = (client, prefix, every)
    if _flusher is not None:
        return
    with _flusher_mutex:
        if _flusher is None:
            _flusher = threading.Thread(target=_flush_loop, name="redislock-stats", daemon=True)
            _flusher.start()


def _flush_loop() -> None:
    """Every ``every`` seconds, add the counts left waiting (none: no round trip)."""
    while True:
        target = _flush_target
        time.sleep(target[2] if target else 1.0)
        target = _flush_target
        if not _flushing or target is None or not STATS.pending():
            continue
        client, prefix, every = target
        if not STATS.due(every):
            continue
        try:
            flush_to_redis(client, prefix, force=True)
        except Exception:  # stats are best effort; tried again at the next tick
            log.debug("redislock: could not flush stats", exc_info=True)


def _forget_flusher() -> None:
    """In a forked child: the parent's thread did not come along."""
    global _flusher, _flush_target, _flusher_mutex
    _flusher, _flush_target, _flusher_mutex = None, None, threading.Lock()


on_fork(_forget_flusher)


def percentile(buckets: Mapping[str, float], fraction: float) -> float | None:
    """The bucket upper bound below which ``fraction`` of the observed waits fall."""
    bounds = [*WAIT_BUCKETS, float("inf")]
    counts = [
        max(0.0, float(buckets.get(f"wait_le_{b}" if b != float("inf") else "wait_le_inf", 0)))
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


def numbers(fields: Mapping[bytes | str, Any]) -> dict[str, float]:
    """The ``<prefix>stats`` hash as read from Redis, as numbers: fields whose name is
    not UTF-8 or whose value is not a finite number are left out (anyone who may write
    the hash may have written them)."""
    found: dict[str, float] = {}
    for field, value in fields.items():
        try:
            name = field.decode("utf-8") if isinstance(field, bytes) else str(field)
            number = float(value)
        except (TypeError, ValueError, UnicodeDecodeError):
            continue
        if math.isfinite(number):
            found[name] = number
    return found


def limit_summary(totals: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Per limited task name, from the stats totals (:func:`numbers`): runs that took a
    permit (``taken``), deferrals (``parked``, ``requeued``, ``deferred``: both) and the
    wait for a permit (``wait_p50``, ``wait_p95``, ``wait_p99``: bucket bounds, or None)."""
    per_task: dict[str, dict[str, float]] = {}
    for field, value in totals.items():
        metric, separator, task = field.partition(TASK_SEPARATOR)
        if separator and task and metric.startswith("limit_"):
            per_task.setdefault(task, {})[metric[len("limit_") :]] = value
    summary: dict[str, dict[str, Any]] = {}
    for task, fields in sorted(per_task.items()):
        row: dict[str, Any] = {
            name: int(fields.get(name, 0)) for name in ("taken", "parked", "requeued")
        }
        row["deferred"] = row["parked"] + row["requeued"]
        for label, fraction in (("wait_p50", 0.5), ("wait_p95", 0.95), ("wait_p99", 0.99)):
            row[label] = percentile(fields, fraction)
        summary[task] = row
    return summary


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
    permits = prom.Gauge(
        "redislock_limit_permits_held",
        "Permits of limited keys held by this process's runs, per task name (lock_limit)",
        ["task"],
        multiprocess_mode="livesum",
        **kwargs,
    )
    deferred = prom.Counter(
        "redislock_limit_deferred_total",
        "Limited tasks deferred (lock_limit), per task name: how is parked or requeued",
        ["task", "how"],
        **kwargs,
    )
    limit_wait = prom.Histogram(
        "redislock_limit_wait_seconds",
        "Time from a limited task's first attempt at its permit to holding it, per task name",
        ["task"],
        buckets=WAIT_BUCKETS,
        **kwargs,
    )

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
        (signals.task_superseded, "superseded"),
        (signals.task_debounced, "debounced"),
    ):
        signal.connect(lambda sender=None, _c=counters[name], **_: _c.inc())
    signals.lock_renewed.connect(lambda sender=None, count=1, **_: counters["renewed"].inc(count))

    holding = LockStats()  # the gauge's values, never below 0 (LockStats.hold)
    on_fork(holding._forked)

    def permit_taken(sender: Any = None, waited: float = 0.0, **_: Any) -> None:
        task = task_name(sender)
        limit_wait.labels(task=task).observe(waited)
        holding.hold(task, 1, then=permits.labels(task=task).set)

    def permit_ended(sender: Any = None, **_: Any) -> None:
        task = task_name(sender)
        holding.hold(task, -1, then=permits.labels(task=task).set)

    def deferral(how: str) -> Any:
        def receive(sender: Any = None, limit: int | None = None, **_: Any) -> None:
            if limit is not None:
                deferred.labels(task=task_name(sender), how=how).inc()

        return receive

    signals.task_permit_taken.connect(permit_taken)
    signals.task_permit_ended.connect(permit_ended)
    signals.task_parked.connect(deferral("parked"))
    signals.task_requeued.connect(deferral("requeued"))
