"""The metrics vocabulary: every Prometheus series the package exports, named in one place.

Names and labels sit beside celery-exporter's (``celery_task_*``): every series is
``celery_redislock_*``; a task's series carry its ``name`` and the ``queue_name`` it was
delivered from, and some a ``kind`` (``lock``, ``limit``, ``rate``), a ``via`` or a
``reason`` from a short fixed list. A lock key, a task id or an argument is never a label
(one value per tenant would grow without end).

Two sources feed them:

* **workers** (:data:`WORKER_SERIES`): counters and histograms counted in each worker
  process from :mod:`celery_redislock.signals` (:mod:`celery_redislock.metrics`) and added
  to the Redis hash ``<prefix>stats`` with the other counts (batched, at most once a
  second, never an extra round trip per task). A field is the series' name followed by
  its labels as a JSON object (:func:`field`); a histogram's buckets are stored one per
  bound, not cumulated (``le`` among the labels), with ``_sum`` beside them.
* **Redis now** (:data:`REDIS_SERIES`): gauges of what is parked, deferred and held,
  read from Redis by one process only, ``celery -A proj redislock exporter``, which also
  turns the hash into Prometheus series.

``docs/metrics.md`` lists each series with the question it answers. This module does
not import Celery, and it does no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Every series name starts with it.
NAMESPACE = "celery_redislock_"

COUNTER, HISTOGRAM, GAUGE = "counter", "histogram", "gauge"

#: Bounds (seconds) of the wait histogram: from a run's first try to holding its lock or
#: permit, or a deferred run's delay; the last bucket is +Inf.
WAIT_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)
#: Bounds (seconds) of the hold histogram: how long a run held its lock or permit.
HOLD_BUCKETS: tuple[float, ...] = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)

#: The values of the ``kind`` label.
KINDS = ("lock", "limit", "rate")
#: The values of ``task_handed_over_total``'s ``via`` label.
VIAS = ("release", "sweeper", "lookahead", "worker", "cli")
#: The values of ``task_lease_lost_total``'s ``reason`` label (LockLostError.reason).
REASONS = ("expired", "stolen", "unreachable", "deadline", "abandoned", "unrenewable")

TASK = ("name", "queue_name")
TASK_KIND = ("name", "queue_name", "kind")


@dataclass(frozen=True)
class Series:
    """One series: its full name (a counter's with ``_total``), type, labels, help text,
    and the question it answers (for docs/metrics.md)."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    question: str
    buckets: tuple[float, ...] = ()

    @property
    def family(self) -> str:
        """The name of its family as ``prometheus_client`` builds it (no ``_total``)."""
        return self.name[: -len("_total")] if self.type == COUNTER else self.name


def _s(name: str, kind: str, labels: tuple[str, ...], help: str, question: str) -> Series:
    buckets = {"task_wait_seconds": WAIT_BUCKETS, "task_hold_seconds": HOLD_BUCKETS}
    return Series(NAMESPACE + name, kind, labels, help, question, buckets.get(name, ()))


WORKER_SERIES = (
    _s(
        "task_acquired_total",
        COUNTER,
        TASK_KIND,
        "Runs that took their lock (kind=lock) or permit (limit), or were admitted by "
        "their rate at once (rate)",
        "How many runs got through their lock, limit or rate, per task?",
    ),
    _s(
        "task_contended_total",
        COUNTER,
        TASK_KIND,
        "Deliveries that found their key held (lock), full (limit) or over its rate "
        "(rate): parked, re-queued, deferred or skipped",
        "How often do a task's calls collide on their key?",
    ),
    _s(
        "task_parked_total",
        COUNTER,
        TASK_KIND,
        "Runs parked behind the holder of their lock or a full limit (the worker slot given back)",
        "How much work waits behind holders instead of in worker slots?",
    ),
    _s(
        "task_requeued_total",
        COUNTER,
        TASK_KIND,
        "Runs sent again with a countdown (no parking possible, or another delivery "
        "of the run holds the key)",
        "Are runs re-queued (polling) where parking should take them?",
    ),
    _s(
        "task_deferred_total",
        COUNTER,
        TASK,
        "Runs deferred to their slot by their rate (lock_rate)",
        "How much work does a rate hold back?",
    ),
    _s(
        "task_undeferred_total",
        COUNTER,
        TASK,
        "Deferred runs a drainer sent, their slot due",
        "Is deferred work being sent on (compare with task_deferred_total)?",
    ),
    _s(
        "task_handed_over_total",
        COUNTER,
        (*TASK, "via"),
        "Parked runs whose message was sent on, handed the lock or permit: by a "
        "release, the sweeper (its holder or hand-over was lost), look-ahead, a worker "
        "whose process died, the CLI",
        "Do holders hand their keys on, or does the sweeper have to (via=sweeper)?",
    ),
    _s(
        "task_superseded_total",
        COUNTER,
        TASK,
        "Calls that ended without running: a newer call of their key took their place "
        '(on_contention="replace", lock_debounce)',
        "How many calls does last-call-wins drop?",
    ),
    _s(
        "task_debounced_total",
        COUNTER,
        TASK,
        "Calls that became their key's pending call, waiting for quiet (lock_debounce)",
        "How many calls are held back for quiet?",
    ),
    _s(
        "task_skipped_total",
        COUNTER,
        TASK_KIND,
        'Runs that did not run: their key was held (on_contention="skip")',
        "How many periodic runs were dropped as duplicates of a running one?",
    ),
    _s(
        "task_duplicate_ignored_total",
        COUNTER,
        TASK,
        "Deliveries of a run that had already finished, ignored (done markers)",
        "How often does the broker deliver a finished run again?",
    ),
    _s(
        "task_lease_lost_total",
        COUNTER,
        (*TASK_KIND, "reason"),
        "Runs whose lease was lost while they held their lock or permit",
        "Did any run lose its lock while it worked (overlap possible)?",
    ),
    _s(
        "task_renewal_failures_total",
        COUNTER,
        TASK_KIND,
        "Lease renewals of a run's lock or permit that failed and were retried",
        "Is Redis slow or failing for the watchdog (before leases are lost)?",
    ),
    _s(
        "task_release_failed_total",
        COUNTER,
        TASK_KIND,
        "Releases that could not reach Redis (retried in the background; the lease "
        "ends the hold at the latest)",
        "Are releases failing (keys stay held until their lease ends)?",
    ),
    _s(
        "parked_rejected_total",
        COUNTER,
        (),
        "Parked messages refused by a worker: their signature does not verify",
        "Is someone writing parked messages without the signing key?",
    ),
    _s(
        "task_wait_seconds",
        HISTOGRAM,
        TASK_KIND,
        "From a run's first try to holding its lock (a blocking wait) or permit (over "
        "its deferrals), or a deferred run's delay (rate)",
        "How long do runs wait for their key or slot?",
    ),
    _s(
        "task_hold_seconds",
        HISTOGRAM,
        TASK_KIND,
        "How long a run held its lock or permit",
        "How long are keys held (what lease and alert thresholds fit)?",
    ),
)

REDIS_SERIES = (
    _s(
        "parked",
        GAUGE,
        ("name", "kind"),
        "Runs parked now behind a held lock (kind=lock) or a full limit (limit), by the "
        "task their parked message names",
        "How much work is parked right now, and is it growing?",
    ),
    _s(
        "deferred",
        GAUGE,
        ("name",),
        "Runs deferred now by a rate (lock_rate), each rate key's backlog counted "
        "under the task of its head, and debounced calls waiting for their quiet period "
        "(lock_debounce), one per key at most",
        "How much work is deferred right now, and is it growing?",
    ),
    _s(
        "deferred_overdue_seconds",
        GAUGE,
        (),
        "How long the most overdue deferred run has been due (0: none overdue)",
        "Are the drainers sending deferred work on time?",
    ),
    _s(
        "held",
        GAUGE,
        ("kind",),
        "Locks held (kind=lock), permits of limited keys held (limit) now",
        "How much is held right now?",
    ),
    _s(
        "keys_in_use",
        GAUGE,
        ("kind",),
        "Locks held, limited keys with a holder or parked work, rate keys with deferred work, now",
        "How many keys are busy right now?",
    ),
    _s(
        "oldest_hold_seconds",
        GAUGE,
        ("kind",),
        "The longest a lock or permit now held has been held by the same holding, as "
        "far as the exporter has seen it (counted from when it first saw it)",
        "Is a key held longer than any run should take?",
    ),
    _s(
        "exporter_redis_up",
        GAUGE,
        (),
        "1 if the exporter's last read of Redis succeeded, else 0",
        "Can the exporter see the lock Redis?",
    ),
)

ALL_SERIES = WORKER_SERIES + REDIS_SERIES
BY_NAME: dict[str, Series] = {series.name: series for series in ALL_SERIES}
BY_FAMILY: dict[str, Series] = {series.family: series for series in ALL_SERIES}


def series(short: str) -> Series:
    """The series ``celery_redislock_<short>``."""
    return BY_NAME[NAMESPACE + short]


def field(name: str, labels: Mapping[str, str]) -> str:
    """The ``<prefix>stats`` field of one sample: ``<series>{<labels as JSON>}``."""
    return name + json.dumps(dict(labels), sort_keys=True, separators=(",", ":"))


def bucket_bound(buckets: tuple[float, ...], value: float) -> str:
    """The ``le`` label of the bucket ``value`` falls in (not cumulated)."""
    for bound in buckets:
        if value <= bound:
            return repr(float(bound))
    return "+Inf"


def parse_field(name: str) -> tuple[Series, str, dict[str, str]] | None:
    """A ``<prefix>stats`` field as (its series, the suffix ``""``/``"_bucket"``/``"_sum"``,
    its labels), or None when it is not one of this vocabulary's (another counter of the
    hash, or anything else written there)."""
    if not name.startswith(NAMESPACE):
        return None
    head, brace, tail = name.partition("{")
    if not brace:
        return None
    suffix = ""
    found = BY_NAME.get(head)
    if found is None:
        for ending in ("_bucket", "_sum"):
            if head.endswith(ending):
                found, suffix = BY_NAME.get(head[: -len(ending)]), ending
                break
    if found is None or (suffix and found.type != HISTOGRAM) or found.type == GAUGE:
        return None
    try:
        labels = json.loads(brace + tail)
    except ValueError:
        return None
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        return None
    expected = set(found.labels) | ({"le"} if suffix == "_bucket" else set())
    if set(labels) != expected:
        return None
    if suffix == "_bucket" and labels["le"] not in _BOUNDS[found.name]:
        return None
    return found, suffix, labels


_BOUNDS = {
    s.name: {repr(float(b)) for b in s.buckets} | {"+Inf"}
    for s in WORKER_SERIES
    if s.type == HISTOGRAM
}


def worker_samples(totals: Mapping[str, float]) -> dict[str, list[tuple[dict[str, str], Any]]]:
    """The workers' series from the stats totals (:func:`celery_redislock.metrics.numbers`):
    per series name, (labels, value) for a counter, (labels, ([(le, cumulative count)],
    sum)) for a histogram. Negative counts (junk) are read as 0. The trouble counters
    the alert rules watch are served at 0 before their first count (:func:`_seed_zeros`)."""
    Key = tuple[tuple[str, str], ...]
    counters: dict[str, dict[Key, float]] = {}
    buckets: dict[str, dict[Key, dict[str, float]]] = {}
    sums: dict[str, dict[Key, float]] = {}
    for name, value in totals.items():
        parsed = parse_field(name)
        if parsed is None or not math.isfinite(value):
            continue
        found, suffix, labels = parsed
        value = max(0.0, value)
        if suffix == "_bucket":
            le = labels.pop("le")
            key = tuple(sorted(labels.items()))
            per = buckets.setdefault(found.name, {}).setdefault(key, {})
            per[le] = per.get(le, 0.0) + value
        elif suffix == "_sum":
            key = tuple(sorted(labels.items()))
            sums.setdefault(found.name, {})[key] = value
        else:
            key = tuple(sorted(labels.items()))
            counters.setdefault(found.name, {})[key] = value
    _seed_zeros(counters)
    samples: dict[str, list[tuple[dict[str, str], Any]]] = {}
    for name, rows in counters.items():
        samples[name] = [(dict(key), value) for key, value in sorted(rows.items())]
    for name, per_key in buckets.items():
        bounds = [*(repr(float(b)) for b in BY_NAME[name].buckets), "+Inf"]
        out: list[tuple[dict[str, str], Any]] = []
        for key, per in sorted(per_key.items()):
            running, cumulative = 0.0, []
            for le in bounds:
                running += per.get(le, 0.0)
                cumulative.append((le, running))
            out.append((dict(key), (cumulative, sums.get(name, {}).get(key, 0.0))))
        samples[name] = out
    return samples


#: The reasons a lease lost is counted under (LockLostError.reason, or "other").
LOST_REASONS = (*REASONS, "other")


def _seed_zeros(counters: dict[str, dict[Any, float]]) -> None:
    """Add a 0 for the trouble counters of every task the totals show, where they have no
    count yet. A counter is written to ``<prefix>stats`` at its first count, so its series
    would appear at 1, and Prometheus' ``increase()`` does not count a series' first
    sample: the first lease lost of a task (or the first refused parked message, the
    first sweeper hand-over) would never fire its alert ``> 0``. From the runs a task
    took its lock or permit (``task_acquired_total``): its leases lost (every reason),
    renewal failures and failed releases; from its parked runs: the sweeper's hand-overs.
    (Bounded: a few series per task name, queue and kind, as the totals already have.)"""

    def zero(short: str, key: tuple[tuple[str, str], ...]) -> None:
        counters.setdefault(NAMESPACE + short, {}).setdefault(key, 0.0)

    zero("parked_rejected_total", ())
    for key in counters.get(NAMESPACE + "task_acquired_total", {}):
        labels = dict(key)
        if labels.get("kind") not in ("lock", "limit"):
            continue  # (a rate holds nothing: no lease to lose)
        for short in ("task_renewal_failures_total", "task_release_failed_total"):
            zero(short, key)
        for reason in LOST_REASONS:
            zero("task_lease_lost_total", tuple(sorted({**labels, "reason": reason}.items())))
    for key in counters.get(NAMESPACE + "task_parked_total", {}):
        labels = {k: v for k, v in key if k != "kind"}
        zero("task_handed_over_total", tuple(sorted({**labels, "via": "sweeper"}.items())))
