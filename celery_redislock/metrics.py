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
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import series, signals
from ._keyspace import HANDOFF_QUEUE_SUFFIX, stats_key

log = logging.getLogger(__name__)

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
    "superseded",
    "debounced",
)

#: Counters of limited tasks' runs, per task name (fields ``<counter>@<task name>``):
#: runs that took a permit, and deferrals (parked, or re-queued with a countdown).
LIMIT_COUNTERS = ("limit_taken", "limit_parked", "limit_requeued")
#: Between a per-task field's metric and its task name (metric names have none).
TASK_SEPARATOR = "@"


def _bucket(seconds: float) -> str:
    index = bisect.bisect_left(WAIT_BUCKETS, seconds)
    return f"wait_le_{WAIT_BUCKETS[index]}" if index < len(WAIT_BUCKETS) else "wait_le_inf"


def task_field(metric: str, task: str) -> str:
    """The stats field of ``metric`` for the limited task ``task``."""
    return f"{metric}{TASK_SEPARATOR}{task}"


class LockStats:
    """Thread-safe counters and wait-time histograms; ``drain()`` hands out deltas. The
    gauge of permits held per task name (``permits_held()``) is kept apart: not drained."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._counts: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._last_flush = time.monotonic()

    def add(self, field: str, amount: float = 1) -> None:
        with self._mutex:
            self._counts[field] = self._counts.get(field, 0) + amount

    def observe_wait(self, seconds: float, task: str | None = None) -> None:
        """Count a wait; with ``task``, a limited task's wait for its permit."""
        bucket, total = _bucket(seconds), "wait_sum"
        if task is not None:
            bucket, total = task_field("limit_" + bucket, task), task_field("limit_wait_sum", task)
        with self._mutex:
            self._counts[bucket] = self._counts.get(bucket, 0) + 1
            self._counts[total] = self._counts.get(total, 0.0) + float(seconds)

    def hold(self, task: str, step: int, then: Callable[[int], Any] | None = None) -> None:
        """A run of ``task`` took (``step`` 1) or ended its hold of (-1) a permit; ``then``
        gets the new count, in order (under the mutex). Never below 0: counting that
        starts while runs hold permits settles once they end."""
        with self._mutex:
            held = max(0, self._held.get(task, 0) + step)
            if held:
                self._held[task] = held
            else:
                self._held.pop(task, None)
            if then is not None:
                then(held)

    def permits_held(self) -> dict[str, int]:
        """Permits held by this process's runs, per task name (tasks holding none left out)."""
        with self._mutex:
            return dict(self._held)

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

    def pending(self) -> bool:
        """Whether any count waits to be flushed."""
        return bool(self._counts)

    def _forked(self) -> None:
        """In a forked child: the parent's counts are the parent's to flush (a pool
        process flushing them too would count them twice), and it holds no permit."""
        self._mutex = threading.Lock()
        self._counts = {}
        self._held = {}


STATS = LockStats()
os.register_at_fork(after_in_child=STATS._forked)


# ------------------------------------------------------------------ the series' counts


class _Run:
    """What a run's series are labelled with: its task, queue, and what it holds."""

    __slots__ = ("kind", "name", "queue")

    def __init__(self, name: str, queue: str) -> None:
        self.name, self.queue, self.kind = name, queue, "lock"


#: Runs in progress in this process, by lock owner (:func:`track_run`).
_runs: dict[str, _Run] = {}


def _forget_runs() -> None:
    _runs.clear()


os.register_at_fork(after_in_child=_forget_runs)


def queue_name(routing_key: Any) -> str:
    """The ``queue_name`` label of a delivery's routing key: a hand-over's queue
    (``<queue>.redislock``) counts as its queue, and so does a Redis transport's list of
    one priority of it."""
    if not isinstance(routing_key, str):
        return ""
    queue = routing_key.split("\x06\x16", 1)[0]
    return queue[: -len(HANDOFF_QUEUE_SUFFIX)] if queue.endswith(HANDOFF_QUEUE_SUFFIX) else queue


def track_run(owner: str, name: str, routing_key: Any) -> None:
    """A run of task ``name`` owning locks as ``owner`` starts in this process (delivered
    with ``routing_key``): its lock signals are counted under its task and queue."""
    _runs[owner] = _Run(name, queue_name(routing_key))


def end_run(owner: str) -> None:
    """The run ``owner`` ended (:func:`track_run`)."""
    _runs.pop(owner, None)


@functools.lru_cache(maxsize=4096)
def _field(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    # (label sets are few: a task's name and queue, a kind; built once each)
    return series.field(name, dict(labels))


def _count(short: str, **labels: str) -> None:
    STATS.add(_field(series.NAMESPACE + short, tuple(labels.items())))


def _observe(short: str, seconds: float, **labels: str) -> None:
    found = series.series(short)
    bound = series.bucket_bound(found.buckets, seconds)
    STATS.add(_field(found.name + "_bucket", (*labels.items(), ("le", bound))))
    STATS.add(_field(found.name + "_sum", tuple(labels.items())), float(seconds))


def _task_of(sender: Any, task_id: Any) -> tuple[str, str]:
    """A ``task_*`` signal's task name and queue: the queue from the task's current
    request when it is the run the signal is about (else "")."""
    request = getattr(sender, "request", None)
    queue = ""
    if request is not None and task_id is not None and getattr(request, "id", None) == task_id:
        info = getattr(request, "delivery_info", None)
        queue = queue_name(info.get("routing_key") if isinstance(info, dict) else None)
    return task_name(sender), queue


def _is_permit(lock: Any) -> bool:
    return getattr(lock, "limit", None) is not None


def _on_series_acquired(sender: Any = None, owner: str = "", waited: float = 0.0, **_: Any) -> None:
    run = _runs.get(owner)
    if run is None:
        return
    if _is_permit(sender):  # counted, with its wait over deferrals, by task_permit_taken
        run.kind = "limit"
        return
    run.kind = "lock"
    _count("task_acquired_total", name=run.name, queue_name=run.queue, kind="lock")
    _observe("task_wait_seconds", waited, name=run.name, queue_name=run.queue, kind="lock")


def _on_series_released(sender: Any = None, owner: str = "", held: float = 0.0, **_: Any) -> None:
    run = _runs.get(owner)
    if run is not None:
        kind = "limit" if _is_permit(sender) else "lock"
        _observe("task_hold_seconds", held, name=run.name, queue_name=run.queue, kind=kind)


def _run_event(short: str, **extra: str) -> Any:
    """Count ``short`` for the run whose lock (or permit) the signal is about."""

    def receive(sender: Any = None, owner: Any = None, **kwargs: Any) -> None:
        run = _runs.get(owner) if isinstance(owner, str) else None
        if run is None:
            return
        labels = {"name": run.name, "queue_name": run.queue, "kind": run.kind, **extra}
        if "reason" in extra:
            reason = kwargs.get("reason")
            labels["reason"] = reason if reason in series.REASONS else "other"
        _count(short, **labels)

    return receive


def _task_event(*shorts: str, kind: str | None = None) -> Any:
    """Count each of ``shorts`` for the task (the sender) of a ``task_*`` signal; with
    ``kind`` "lock", the kind is "limit" when the signal names a ``limit``."""

    def receive(sender: Any = None, task_id: Any = None, **kwargs: Any) -> None:
        name, queue = _task_of(sender, task_id)
        given = kwargs.get("queue")  # (parked at delivery: no current request to ask)
        labels = {"name": name, "queue_name": queue_name(given) if given else queue}
        for short in shorts:
            found = series.series(short)
            if "kind" in found.labels:
                what = kind or "lock"
                if kind == "lock" and kwargs.get("limit") is not None:
                    what = "limit"
                _count(short, **labels, kind=what)
            else:
                _count(short, **labels)

    return receive


def _on_series_permit_taken(
    sender: Any = None, task_id: Any = None, waited: float = 0.0, **_: Any
) -> None:
    name, queue = _task_of(sender, task_id)
    _count("task_acquired_total", name=name, queue_name=queue, kind="limit")
    _observe("task_wait_seconds", waited, name=name, queue_name=queue, kind="limit")


def _on_series_undeferred(sender: Any = None, name: str = "", delay: float = 0.0, **_: Any) -> None:
    _count("task_undeferred_total", name=name, queue_name="")
    _observe("task_wait_seconds", delay, name=name, queue_name="", kind="rate")


def _on_series_handed_over(
    sender: Any = None,
    name: str = "",
    via: str = "release",
    queue: Any = None,
    owner: Any = None,
    **_: Any,
) -> None:
    via = via if via in series.VIAS else "release"
    run = _runs.get(owner) if isinstance(owner, str) else None
    if not name and run is not None:  # pushed back by the releasing run's script
        name, queue = run.name, run.queue
    _count("task_handed_over_total", name=name or "?", queue_name=queue_name(queue), via=via)


def _on_series_pulled(sender: Any = None, **_: Any) -> None:
    name, queue = _task_of(sender, None)
    request = getattr(sender, "request", None)
    info = getattr(request, "delivery_info", None)
    if isinstance(info, dict):
        queue = queue_name(info.get("routing_key"))
    _count("task_handed_over_total", name=name, queue_name=queue, via="lookahead")


def _on_series_rejected(sender: Any = None, **_: Any) -> None:
    _count("parked_rejected_total")


def _on_acquired(sender: Any = None, waited: float = 0.0, **_: Any) -> None:
    STATS.add("acquired")
    STATS.observe_wait(waited)


def _counter(field: str, amount_key: str | None = None) -> Any:
    def receive(sender: Any = None, **kwargs: Any) -> None:
        STATS.add(field, kwargs.get(amount_key, 1) if amount_key else 1)

    return receive


def task_name(sender: Any) -> str:
    """The task name a ``task_*`` signal's sender (the task) is counted under."""
    return str(getattr(sender, "name", None) or "?")


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


#: Upper bounds (seconds) of the deferral-delay histogram buckets; the last is +inf.
DEFERRAL_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0, 3600.0)

_CONTENDED = "task_contended_total"
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
    (signals.lock_acquired, _on_series_acquired),
    (signals.lock_released, _on_series_released),
    (signals.lock_lost, _run_event("task_lease_lost_total", reason="")),
    (signals.lock_renewal_failed, _run_event("task_renewal_failures_total")),
    (signals.lock_release_failed, _run_event("task_release_failed_total")),
    (signals.task_permit_taken, _on_series_permit_taken),
    (signals.task_parked, _task_event("task_parked_total", "task_contended_total", kind="lock")),
    (
        signals.task_requeued,
        _task_event("task_requeued_total", "task_contended_total", kind="lock"),
    ),
    (signals.task_rate_admitted, _task_event("task_acquired_total", kind="rate")),
    (
        signals.task_deferred,
        _task_event("task_deferred_total", "task_contended_total", kind="rate"),
    ),
    (signals.task_undeferred, _on_series_undeferred),
    (signals.task_handed_over, _on_series_handed_over),
    (signals.task_pulled, _on_series_pulled),
    (signals.task_superseded, _task_event("task_superseded_total")),
    (signals.task_debounced, _task_event("task_debounced_total")),
    (signals.task_skipped, _task_event("task_skipped_total", _CONTENDED, kind="lock")),
    (signals.task_duplicate, _task_event("task_duplicate_ignored_total")),
    (signals.parked_rejected, _on_series_rejected),
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


os.register_at_fork(after_in_child=_forget_flusher)


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
    os.register_at_fork(after_in_child=holding._forked)

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
