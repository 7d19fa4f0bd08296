"""The series' counts: each lock signal put down to the task run that owns the lock (its
task name and queue, :func:`track_run`), counted into :data:`~._stats.STATS` as the
``celery_redislock_*`` fields of :mod:`celery_redislock.series`.
"""

from __future__ import annotations

import bisect
import functools
from typing import Any

from . import series, signals
from ._keyspace import HANDOFF_QUEUE_SUFFIX
from ._process import on_fork
from ._stats import STATS, task_name


class _Run:
    """What a run's series are labelled with: its task, queue, and what it holds."""

    __slots__ = ("kind", "name", "queue")

    def __init__(self, name: str, queue: str) -> None:
        self.name, self.queue, self.kind = name, queue, "lock"


#: Runs in progress in this process, by lock owner (:func:`track_run`; a forked child has none).
_runs: dict[str, _Run] = {}
on_fork(_runs.clear)


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
    histogram = _histogram(short, tuple(labels.items()))
    STATS.add_each((histogram.bucket(seconds),), histogram.sum, float(seconds))


class _Histogram:
    """One histogram's fields for one label set, built once: its bucket bounds, the field
    of each bucket (the last: ``+Inf``) and of its sum (what :func:`_observe` writes)."""

    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, short: str, labels: tuple[tuple[str, str], ...]) -> None:
        found = series.series(short)
        self.bounds = found.buckets
        les = [series.bucket_bound(found.buckets, bound) for bound in found.buckets]
        self.buckets = tuple(
            _field(found.name + "_bucket", (*labels, ("le", le))) for le in [*les, "+Inf"]
        )
        self.sum = _field(found.name + "_sum", labels)

    def bucket(self, seconds: float) -> str:
        """The field of the bucket ``seconds`` falls in (as :func:`series.bucket_bound`:
        the first bound it is not above; NaN is above them all)."""
        if seconds != seconds:  # NaN
            return self.buckets[-1]
        return self.buckets[bisect.bisect_left(self.bounds, seconds)]


@functools.lru_cache(maxsize=4096)
def _histogram(short: str, labels: tuple[tuple[str, str], ...]) -> _Histogram:
    return _Histogram(short, labels)


class _RunFields:
    """A run's series fields for one task, queue and kind ("lock" or "limit"): what its
    lock signals count, built once per label set (:func:`_fields_of`)."""

    __slots__ = ("acquired", "hold", "wait")

    def __init__(self, name: str, queue: str, kind: str) -> None:
        labels = (("name", name), ("queue_name", queue), ("kind", kind))
        self.acquired = _field(series.NAMESPACE + "task_acquired_total", labels)
        self.wait = _histogram("task_wait_seconds", labels)
        self.hold = _histogram("task_hold_seconds", labels)


@functools.lru_cache(maxsize=4096)
def _fields_of(name: str, queue: str, kind: str) -> _RunFields:
    return _RunFields(name, queue, kind)


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
    fields = _fields_of(run.name, run.queue, "lock")
    wait = fields.wait
    STATS.add_each((fields.acquired, wait.bucket(waited)), wait.sum, float(waited))


def _on_series_released(sender: Any = None, owner: str = "", held: float = 0.0, **_: Any) -> None:
    run = _runs.get(owner)
    if run is not None:
        kind = "limit" if _is_permit(sender) else "lock"
        hold = _fields_of(run.name, run.queue, kind).hold
        STATS.add_each((hold.bucket(held),), hold.sum, float(held))


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


_CONTENDED = "task_contended_total"
#: The series' receivers (:func:`celery_redislock.metrics.enable` connects them).
RECEIVERS: list[tuple[signals.Signal, Any]] = [
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
