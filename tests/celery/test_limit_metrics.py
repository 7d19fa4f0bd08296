"""Metrics of limited tasks (``lock_limit``), per task name: the permits this process's runs
hold (a gauge that must not drift, whatever way a run ends), runs that took a permit,
deferrals, and the wait for a permit across deferrals — against real Redis, real
parking at delivery and a real worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu.utils import json as kombu_json

from celery_redislock import LockLostError, RedisSemaphore, metrics, signals
from celery_redislock._keyspace import SemaphoreKeys, stats_key
from celery_redislock.celery.contention import FIRST_TRY_HEADER
from celery_redislock.celery.handover import deliver_handed_over
from celery_redislock.celery.parking import Parker
from celery_redislock.task import LockedTask
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import EveryKeySeen, wait_until, worker
from .test_limits import _permit
from .test_parking import _fetch

TENANT_JOB = "tests.celery_app.tenant_job"
OUTCOME = "tests.celery_app.limited_outcome"


@pytest.fixture
def counting() -> Iterator[None]:
    """In-process counting, from zero."""
    metrics.enable()
    metrics.STATS.drain()
    yield
    metrics.STATS.drain()


@pytest.fixture
def limited_app(broker: RedisServer) -> Iterator[Celery]:
    app = Celery("limit-metrics", broker="memory://")
    app.conf.update(redislock_url=broker.url, redislock_wait=0.2)
    app.finalize()  # tasks are created at decoration, as in a worker
    yield app
    app.close()


def test_a_direct_calls_permit_is_counted_while_held_and_on_every_way_out(
    limited_app: Celery, broker: RedisServer, counting: None
) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    metrics.enable_prometheus(registry)
    r = broker.client()
    seen: list[tuple[float | None, dict[str, int]]] = []

    def gauge() -> float | None:
        return registry.get_sample_value("redislock_limit_permits_held", {"task": "quota"})

    @limited_app.task(
        name="quota", bind=True, base=LockedTask, lock_key="q:{n}", lock_limit=2, shared=False
    )
    def quota(self: Any, n: int, how: str) -> str:
        seen.append((gauge(), metrics.STATS.permits_held()))
        if how == "fail":
            raise ValueError("failed on purpose")
        if how == "lost":  # its permit gone under it: the release finds it lost
            r.delete(self.lock.semaphore_keys.permit(self.lock._current_owner()))
        if how == "nested":  # a call nested in a run is part of it: not counted again
            assert quota(n, "ok") == "ok"
        return how

    assert quota(1, "ok") == "ok"
    with pytest.raises(ValueError, match="on purpose"):
        quota(1, "fail")
    with pytest.raises(LockLostError):
        quota(1, "lost")
    assert quota(1, "nested") == "nested"
    assert quota.apply((1, "ok")).get() == "ok"  # eager
    # Each run saw its own permit counted (1, the nested call too), and nothing is left.
    assert seen == [(1.0, {"quota": 1})] * 6
    assert gauge() == 0.0 and metrics.STATS.permits_held() == {}
    counts = metrics.STATS.snapshot()
    assert counts["limit_taken@quota"] == 5  # the nested call took no permit of its own
    assert sum(v for k, v in counts.items() if k.startswith("limit_wait_le_")) == 5
    assert registry.get_sample_value("redislock_limit_wait_seconds_count", {"task": "quota"}) == 5
    assert r.scard(SemaphoreKeys.for_name("q:1").line.lock) == 0


def test_the_gauge_never_drops_below_zero_for_runs_counted_before_it_started() -> None:
    stats = metrics.LockStats()
    seen: list[int] = []
    stats.hold("t", -1, then=seen.append)  # a run that began before counting did
    stats.hold("t", 1, then=seen.append)
    stats.hold("t", 1, then=seen.append)
    assert stats.permits_held() == {"t": 2}
    stats.hold("t", -1, then=seen.append)
    stats.hold("t", -1, then=seen.append)
    assert seen == [0, 1, 2, 1, 0] and stats.permits_held() == {}


def test_parking_at_delivery_counts_a_deferral_and_the_wait_starts_at_the_first_try(
    broker: RedisServer, counting: None
) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    metrics.enable_prometheus(registry)
    r = broker.client()
    deferred: list[dict[str, Any]] = []

    def record(sender: Any = None, **kwargs: Any) -> None:
        deferred.append({"task": sender.name, **kwargs})

    signals.task_parked.connect(record)
    try:
        holders = [_permit(r, f"h{i}") for i in range(2)]
        assert all(h.take() for h in holders)
        queue = "limit-metrics-parking"
        sent = ca.tenant_job.apply_async(("t", 0.01), queue=queue)
        mutex = ca.settle.apply_async((5, 1), queue=queue)  # (free: taken, not parked)
        before = time.time()
        parker = Parker(ca.tenant_job, ca.app, revoked=set(), seen=EveryKeySeen())
        assert _fetch(queue, parker=parker).headers["id"] == sent.id
        after = time.time()
        assert _fetch(
            queue, parker=Parker(ca.settle, ca.app, revoked=set(), seen=EveryKeySeen()), parks=False
        )
    finally:
        signals.task_parked.disconnect(record)
    assert [(d["task"], d["task_id"], d["limit"]) for d in deferred] == [(TENANT_JOB, sent.id, 2)]
    assert mutex.id not in {d["task_id"] for d in deferred}
    assert metrics.STATS.snapshot()[f"limit_parked@{TENANT_JOB}"] == 1
    sample = {"task": TENANT_JOB, "how": "parked"}
    assert registry.get_sample_value("redislock_limit_deferred_total", sample) == 1
    # The parked envelope says when its run first tried for a permit.
    keys = SemaphoreKeys.for_name("tenant:t")
    entry = r.hget(keys.line.parked_messages, sent.id)
    envelope = kombu_json.loads(entry.split(b"\n", 2)[2])
    assert before <= envelope["headers"][FIRST_TRY_HEADER] <= after


def test_a_worker_counts_every_run_and_its_permit_gauge_ends_at_zero_on_every_way_out(
    broker: RedisServer, tmp_path: Path
) -> None:
    """One process (solo pool): the runs and the probe share the gauge they report."""
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", pool="solo", concurrency=1)
    try:
        runs = {how: ca.limited_outcome.delay("m", how) for how in ("ok", "fail", "retry", "lost")}
        assert runs["ok"].get(timeout=60) == "ok"
        with pytest.raises(ValueError, match="on purpose"):
            runs["fail"].get(timeout=60)
        assert runs["retry"].get(timeout=60) == "retry"
        with pytest.raises(LockLostError):
            runs["lost"].get(timeout=60)
        assert ca.permits_held.delay().get(timeout=60) == {}  # no drift
        held = [json.loads(line) for line in r.lrange("held:m", 0, -1)]
        assert held == [{OUTCOME: 1}] * 5  # ok, fail, retry's two runs, lost
    finally:
        proc.stop()  # a warm shutdown flushes the counts
    totals = metrics.numbers(r.hgetall(stats_key("redislock:")))
    assert totals[f"limit_taken@{OUTCOME}"] == 5
    (row,) = [row for task, row in metrics.limit_summary(totals).items() if task == OUTCOME]
    assert row["taken"] == 5 and row["deferred"] == 0 and row["wait_p50"] is not None
    wait_until(lambda: not r.exists(SemaphoreKeys.for_name("tenant:m").line.lock), 10)


def test_a_deferred_run_carries_its_first_try_and_its_wait_spans_the_deferral(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    holders = [_permit(r, f"h{i}") for i in range(2)]
    assert all(h.take() for h in holders)
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2)
    try:
        waiting = ca.tenant_job.delay("t", 0.01)
        keys = SemaphoreKeys.for_name("tenant:t")
        wait_until(lambda: r.hexists(keys.line.parked_messages, waiting.id), timeout=30)
        parked_at = time.time()
        time.sleep(0.3)  # a gap the recorded wait must cover (it is measured from before)
        released_at = time.time()
        handed = holders[0].finish(hold=0, done_ttl=None)  # its permit to the parked task
        deliver_handed_over(ca.app, handed, 3000)  # (None when the script pushed it back)
        waiting.get(timeout=30)
        holders[1].finish(hold=0, done_ttl=None)
    finally:
        proc.stop()  # a warm shutdown flushes the counts
    totals = metrics.numbers(r.hgetall(stats_key("redislock:")))
    assert totals[f"limit_parked@{TENANT_JOB}"] == 1
    assert totals[f"limit_taken@{TENANT_JOB}"] == 1
    assert totals[f"limit_wait_sum@{TENANT_JOB}"] >= released_at - parked_at


def test_a_requeued_run_is_a_deferral_and_its_wait_spans_its_requeues(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    blockers = [RedisSemaphore(r, "tenant:rq", 2, owner=f"b{i}", ttl=30) for i in range(2)]
    assert all(blocker.acquire(blocking=False) for blocker in blockers)
    proc = worker(broker.url, tmp_path / "w.log", pool="solo", concurrency=1)
    try:
        result = ca.limited_wait.delay("rq")
        wait_until(lambda: "re-queued in" in proc.text(), timeout=30)
        requeued_at = time.time()  # its first try was before this
        time.sleep(0.3)  # a gap the recorded wait must cover
        released_at = time.time()
        blockers[0].release()
        assert result.get(timeout=30) == 3  # the permit after the two blockers'
        blockers[1].release()
    finally:
        proc.stop()  # a warm shutdown flushes the counts
    totals = metrics.numbers(r.hgetall(stats_key("redislock:")))
    task = "tests.celery_app.limited_wait"
    assert totals[f"limit_taken@{task}"] == 1 and totals[f"limit_requeued@{task}"] >= 1
    assert f"limit_parked@{task}" not in totals
    assert totals[f"limit_wait_sum@{task}"] >= released_at - requeued_at
