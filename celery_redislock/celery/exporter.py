"""``celery -A proj redislock exporter``: the one process that turns what the workers
counted and what Redis holds now into Prometheus series (:mod:`celery_redislock.series`).

Run one per deployment, beside celery-exporter (it listens on port 9818 by default; a
second one is harmless, only redundant). On each scrape it reads, at most once every
``interval`` seconds (a scrape in between is served the last reading):

* the hash ``<prefix>stats``, where every worker adds its counts (one ``HGETALL``): the
  counters and histograms of the workers' series, summed over every worker that ever
  reported (they only grow, as counters should; a restart of a worker loses nothing);
* what is parked, deferred and held now (:func:`.survey.survey`: ``SCAN`` and reads of
  the busy keys only): the gauges. How long a holding has been held is counted from
  when this process first saw it, so it restarts at 0 when the exporter does.

With ``redislock_urls`` (the quorum lock) the workers report to the first node, which
this reads; no gauge of what is held now is read there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from redis.exceptions import RedisError

from .. import metrics, series
from .._keyspace import stats_key
from .inspection import read
from .survey import Survey, survey

log = logging.getLogger(__name__)

#: The port ``redislock exporter`` listens on unless told (celery-exporter's is 9808).
DEFAULT_PORT = 9818


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError(
            "the exporter needs prometheus_client: pip install 'celery_redislock[prometheus]'"
        ) from exc
    return prometheus_client


class RedisLockCollector:
    """A ``prometheus_client`` collector of every ``celery_redislock_*`` series, read
    from one Redis (see the module docstring)."""

    def __init__(
        self, client: Any, prefix: str, *, interval: float = 5.0, gauges: bool = True
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.interval = interval
        self.gauges = gauges
        self._mutex = threading.Lock()
        self._read_at: float | None = None
        self._last: list[Any] = []
        #: (kind, key name, owner) of each holding seen -> when first seen (monotonic)
        self._first_seen: dict[tuple[str, str, str], float] = {}

    def describe(self) -> list[Any]:
        return []  # (built on each collect: the families depend on what is read)

    def collect(self) -> Iterator[Any]:
        with self._mutex:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self.interval:
                self._last = self._families(now)
                self._read_at = now
            yield from self._last

    # ------------------------------------------------------------------ reading

    def _families(self, now: float) -> list[Any]:
        prom = _prometheus()
        core = prom.core
        families: dict[str, Any] = {}
        for found in series.ALL_SERIES:
            make = {
                series.COUNTER: core.CounterMetricFamily,
                series.HISTOGRAM: core.HistogramMetricFamily,
                series.GAUGE: core.GaugeMetricFamily,
            }[found.type]
            families[found.name] = make(found.family, found.help, labels=found.labels)
        up = families[series.series("exporter_redis_up").name]
        try:
            (fields,) = read(self.client, ("hgetall", stats_key(self.prefix)))
            totals = metrics.numbers(fields if isinstance(fields, dict) else {})
        except Exception:  # (a Redis that cannot be read: said by exporter_redis_up)
            up.add_metric([], 0.0)
            return list(families.values())
        state: Survey | None = None
        try:  # (the counters are served whatever the survey meets)
            state = survey(self.client, self.prefix) if self.gauges else None
            up.add_metric([], 1.0)
        except RedisError:
            up.add_metric([], 0.0)
        except Exception:
            log.exception("redislock exporter: could not read what is held now")
            up.add_metric([], 1.0)
        for name, rows in series.worker_samples(totals).items():
            found, family = series.BY_NAME[name], families[name]
            for labels, value in rows:
                values = [labels[label] for label in found.labels]
                if found.type == series.HISTOGRAM:
                    buckets, total = value
                    family.add_metric(values, buckets=buckets, sum_value=total)
                else:
                    family.add_metric(values, value)
        if state is not None:
            for short, gauge_rows in self._gauges(state, now).items():
                for label_values, reading in gauge_rows:
                    families[series.series(short).name].add_metric(label_values, reading)
        return list(families.values())

    def _gauges(self, state: Survey, now: float) -> dict[str, list[tuple[list[str], float]]]:
        parked: dict[tuple[str, str], int] = {}
        deferred: dict[str, int] = {}
        held = dict.fromkeys(("lock", "limit"), 0)
        in_use = dict.fromkeys(series.KINDS, 0)
        overdue = 0.0
        seen: dict[tuple[str, str, str], float] = {}
        for key in state.keys:
            in_use[key.kind] += 1
            for task, count in key.parked_by_task.items():
                parked[(task, key.kind)] = parked.get((task, key.kind), 0) + count
            if key.kind == "rate":
                task = key.deferred_task or "?"
                deferred[task] = deferred.get(task, 0) + key.deferred
                if key.head_due is not None and key.head_due < 0:
                    overdue = max(overdue, -key.head_due)
                continue
            if key.deferred:  # a debounced call waiting for its quiet period to end
                task = key.deferred_task or "?"
                deferred[task] = deferred.get(task, 0) + key.deferred
                if key.head_due is not None and key.head_due < 0:
                    overdue = max(overdue, -key.head_due)
            held[key.kind] += key.holders
            for owner in key.owners:
                holding = (key.kind, key.name, owner)
                seen[holding] = self._first_seen.get(holding, now)
        self._first_seen = seen
        oldest = dict.fromkeys(("lock", "limit"), 0.0)
        for (kind, _name, _owner), since in seen.items():
            oldest[kind] = max(oldest[kind], now - since)
        return {
            "parked": [([task, kind], n) for (task, kind), n in sorted(parked.items())],
            "deferred": [([task], n) for task, n in sorted(deferred.items())],
            "deferred_overdue_seconds": [([], round(overdue, 3))],
            "held": [([kind], n) for kind, n in held.items()],
            "keys_in_use": [([kind], n) for kind, n in in_use.items()],
            "oldest_hold_seconds": [([kind], round(s, 3)) for kind, s in oldest.items()],
        }


def registry_for(collector: RedisLockCollector) -> Any:
    """A ``prometheus_client`` registry serving ``collector`` alone."""
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(collector: RedisLockCollector) -> str:
    """One reading, as the Prometheus text format."""
    data: bytes = _prometheus().generate_latest(registry_for(collector))
    return data.decode("utf-8")


def serve(collector: RedisLockCollector, port: int, addr: str) -> Any:
    """Serve ``/metrics`` on ``addr:port`` in a background thread; returns the server."""
    return _prometheus().start_http_server(port, addr=addr, registry=registry_for(collector))
