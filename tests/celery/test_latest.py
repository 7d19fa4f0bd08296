"""Last call wins (``on_contention="replace"``, ``lock_debounce``) against real Redis and
real prefork workers: at most one run and one pending call per key, the newest call's
arguments run, every superseded call ends as ``SUPERSEDED``, nothing left behind."""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_redislock import LockConfigurationError
from celery_redislock._keyspace import LockKeys, SemaphoreKeys, debounce_registry
from celery_redislock.celery.latest import SENT_HEADER, SUPERSEDED
from celery_redislock.task import LockedTask
from celery_redislock.testing import RedisServer

from .. import latest_app as la
from .._celery import wait_until, worker

APP = "tests.latest_app"


def _runs(r: Any, key: str) -> list[tuple[str, str, float, float]]:
    found = []
    for line in r.lrange(la.runs_key(key), 0, -1):
        tag, task_id, enter, leave = line.decode().split()
        found.append((tag, task_id, float(enter), float(leave)))
    return found


def _states(ids: list[str]) -> dict[str, str]:
    return {task_id: AsyncResult(task_id, app=la.app).state for task_id in ids}


def _settled(ids: list[str], ran: set[str]) -> bool:
    """Every call ran (SUCCESS) or ended SUPERSEDED: none left PENDING."""
    states = _states(ids)
    return all(states[i] == ("SUCCESS" if i in ran else SUPERSEDED) for i in ids)


def _wait_settled(r: Any, key: str, ids: list[str], ran: set[str], timeout: float) -> None:
    """``_settled`` within ``timeout`` seconds, or fail naming the calls left unsettled
    (their states), the key's runs and its ``latest`` hash."""
    try:
        wait_until(lambda: _settled(ids, ran), timeout=timeout, what="states")
    except AssertionError as exc:
        states = _states(ids)
        left = {i: s for i, s in states.items() if s != ("SUCCESS" if i in ran else SUPERSEDED)}
        latest = r.hgetall(LockKeys.for_name(f"lw:{key}").latest)
        raise AssertionError(f"{exc}; left {left}; runs {_runs(r, key)}; latest {latest}") from None


def _nothing_left(r: Any, key: str, limited: bool = False) -> None:
    keys = SemaphoreKeys.for_name(f"lw:{key}").line if limited else LockKeys.for_name(f"lw:{key}")
    assert not r.exists(keys.lock), "the lock is still held"
    assert r.llen(keys.parked) == 0, "a call is still parked"
    pending = r.hget(keys.latest, "p")
    assert pending is None, f"a call is still pending: {pending!r}"


def test_replace_runs_the_first_and_the_newest_of_a_burst(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        first = la.rebuild.delay("a", "0", 1.0)
        wait_until(lambda: r.exists(LockKeys.for_name("lw:a").lock), what="the first run's lock")
        burst = [la.rebuild.delay("a", str(i), 0.0) for i in range(1, 31)]  # ~0.3 s or less
        ids = [first.id] + [c.id for c in burst]
        wait_until(lambda: len(_runs(r, "a")) >= 2, timeout=30, what="two runs")
        wait_until(lambda: _settled(ids, {first.id, burst[-1].id}), timeout=15, what="states")
        runs = _runs(r, "a")
        assert [run[0] for run in runs] == ["0", "30"], runs  # the first and the newest
        assert runs[1][2] >= runs[0][3] - 0.01  # one after the other, never together
        states = _states(ids)
        assert sum(s == SUPERSEDED for s in states.values()) == 29  # none PENDING
        assert list(states.values()).count("SUCCESS") == 2
        meta = AsyncResult(burst[0].id, app=la.app).info
        assert meta["lock"] == "lw:a" and meta["superseded_by"] in {c.id for c in burst}
        _nothing_left(r, "a")
    finally:
        proc.stop()  # warm: the last counts are flushed
    stats = {k.decode(): float(v) for k, v in r.hgetall("redislock:stats").items()}
    assert stats.get("superseded") == 29 == stats.get(f"superseded:{la.rebuild.name}"), stats


def test_replace_across_two_workers_runs_the_newest_sent_whatever_the_delivery_order(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    procs = [
        worker(broker.url, tmp_path / f"w{n}.log", concurrency=2, name=f"w{n}", app=APP)
        for n in (1, 2)
    ]
    try:
        first = la.rebuild.delay("b", "0", 1.0)
        wait_until(lambda: r.exists(LockKeys.for_name("lw:b").lock), what="the first run's lock")
        # 29 calls "sent" at increasing times, published (delivered) in a shuffled order.
        base = time.time_ns() // 1000
        order = list(range(1, 30))
        random.Random(19).shuffle(order)
        calls = {}
        for i in order:
            headers = {SENT_HEADER: base + i * 1000}
            calls[i] = la.rebuild.apply_async(("b", str(i), 0.0), headers=headers)
        ids = [first.id] + [calls[i].id for i in range(1, 30)]
        newest = calls[29].id
        wait_until(lambda: _settled(ids, {first.id, newest}), timeout=30, what="states")
        runs = _runs(r, "b")
        assert [run[0] for run in runs] == ["0", "29"], runs
        # The newest call ran with the time it was sent: its parked message kept the header.
        latest = LockKeys.for_name("lw:b").latest
        assert r.hmget(latest, "s", "st") == [str(base + 29_000).encode(), newest.encode()]
        _nothing_left(r, "b")
    finally:
        for proc in procs:
            proc.kill()


def test_a_call_older_than_a_run_that_started_is_superseded_even_on_a_free_key(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        base = time.time_ns() // 1000
        newer = la.rebuild.apply_async(("c", "new", 0.0), headers={SENT_HEADER: base})
        wait_until(lambda: newer.state == "SUCCESS", what="the newer call's run")
        older = la.rebuild.apply_async(("c", "old", 0.0), headers={SENT_HEADER: base - 5000})
        wait_until(lambda: older.state == SUPERSEDED, what="the older call superseded")
        assert older.info["superseded_by"] == newer.id
        # A call sent later runs as usual; a copy of the run that ran does not run again.
        later = la.rebuild.delay("c", "later", 0.0)
        wait_until(lambda: later.state == "SUCCESS", what="the later call's run")
        assert [run[0] for run in _runs(r, "c")] == ["new", "later"]
        # A copy of a run that finished is ignored: its result stays the run's.
        la.rebuild.apply_async(("c", "later", 0.0), task_id=later.id)
        proc.wait_for_log(f"rebuild[{later.id}] already finished")
        assert later.state == "SUCCESS" and later.result == "later"
        assert [run[0] for run in _runs(r, "c")] == ["new", "later"]
        _nothing_left(r, "c")
    finally:
        proc.kill()


def test_replace_with_lock_limit_two_runs_two_and_the_newest(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        # One after the other: a call never runs after a newer one started (were r1 to
        # start first, r0 would be superseded, by design, though a permit is free).
        holders = SemaphoreKeys.for_name("lw:d").line.lock
        running = [la.rebuild_two.delay("d", "r0", 1.0)]
        wait_until(lambda: r.scard(holders) == 1, what="one permit held")
        running.append(la.rebuild_two.delay("d", "r1", 1.0))
        wait_until(lambda: r.scard(holders) == 2, what="two permits held")
        burst = [la.rebuild_two.delay("d", str(i), 0.0) for i in range(1, 11)]
        ids = [c.id for c in running + burst]
        wait_until(lambda: _settled(ids, {*(c.id for c in running), burst[-1].id}), timeout=30)
        runs = _runs(r, "d")
        assert sorted(run[0] for run in runs) == ["10", "r0", "r1"], runs
        _nothing_left(r, "d", limited=True)
    finally:
        proc.kill()


def test_debounce_runs_a_burst_once_with_the_last_arguments_after_the_quiet_period(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        calls = []
        for i in range(20):  # 20 calls in about 0.2 s
            calls.append(la.reindex.delay("e", str(i), 0.0))
            time.sleep(0.01)
        last_sent = time.time()
        ids = [c.id for c in calls]
        # Settled in about DEBOUNCE (0.5-0.7 s here, loaded or not); CI once took over 20 s.
        _wait_settled(r, "e", ids, {calls[-1].id}, timeout=60)
        runs = _runs(r, "e")
        assert [run[0] for run in runs] == ["19"], runs
        assert runs[0][2] >= last_sent + la.DEBOUNCE - 0.05, (runs, last_sent)
        time.sleep(0.3)  # nothing more runs
        assert len(_runs(r, "e")) == 1
        assert r.zcard(debounce_registry("redislock:")) == 0 or not r.hget(
            LockKeys.for_name("lw:e").latest, "p"
        )
        _nothing_left(r, "e")
    finally:
        proc.kill()


def test_debounce_max_runs_a_steady_stream_about_every_bound(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        started = time.time()
        calls = []
        while time.time() - started < 3.0:  # a call every 0.1 s for 3 s
            calls.append(la.reindex_bounded.delay("f", str(len(calls)), 0.0))
            time.sleep(0.1)
        ids = [c.id for c in calls]
        wait_until(
            lambda: all(s in ("SUCCESS", SUPERSEDED) for s in _states(ids).values()),
            timeout=20,
            what="every call ran or was superseded",
        )
        runs = _runs(r, "f")
        ran = {run[1] for run in runs}
        assert ran == {i for i, s in _states(ids).items() if s == "SUCCESS"}
        assert calls[-1].id in ran  # the last call runs (the quiet period after it)
        enters = [started] + [run[2] for run in runs]
        gaps = [b - a for a, b in zip(enters, enters[1:])]
        # A run at least every lock_debounce_max (+ a tolerance for delivery), while calls
        # keep coming; each run has the newest arguments of its moment (increasing tags).
        assert len(runs) >= 3, runs
        assert max(gaps[:-1]) <= la.DEBOUNCE_MAX + 0.6, gaps
        tags = [int(run[0]) for run in runs]
        assert tags == sorted(tags) and len(set(tags)) == len(tags)
        _nothing_left(r, "f")
    finally:
        proc.kill()


def test_a_pending_call_still_runs_once_after_its_worker_is_killed(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    one = worker(broker.url, tmp_path / "w1.log", concurrency=2, name="w1", app=APP)
    two = None
    try:
        first = la.rebuild.delay("g", "0", 30.0)  # runs until its worker is killed
        wait_until(lambda: r.exists(LockKeys.for_name("lw:g").lock), what="the first run's lock")
        pending = [la.rebuild.delay("g", str(i), 0.0) for i in (1, 2)]
        wait_until(
            lambda: r.hget(LockKeys.for_name("lw:g").latest, "pt") == pending[1].id.encode(),
            what="the newest call pending",
        )
        one.kill()  # the run dies with its worker; its lease (5 s) ends its hold
        two = worker(broker.url, tmp_path / "w2.log", concurrency=2, name="w2", app=APP)
        wait_until(lambda: pending[1].state == "SUCCESS", timeout=40, what="the pending call's run")
        assert pending[0].state == SUPERSEDED
        assert [run[0] for run in _runs(r, "g")] == ["2"]
        del first
        _nothing_left(r, "g")
    finally:
        one.kill()
        if two is not None:
            two.kill()


def test_a_debounced_call_still_runs_once_after_its_worker_is_killed(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    one = worker(broker.url, tmp_path / "w1.log", concurrency=2, name="w1", app=APP)
    two = None
    try:
        call = la.reindex.delay("h", "only", 0.0)
        wait_until(
            lambda: r.hget(LockKeys.for_name("lw:h").latest, "pt") == call.id.encode(),
            what="the call pending",
        )
        from celery.bin.celery import celery as celery_command
        from click.testing import CliRunner

        shown = CliRunner().invoke(celery_command, ["-A", APP, "redislock", "show", "lw:h"])
        assert f"pending call: task {call.id}, due in" in shown.output, shown.output
        one.kill()  # before its quiet period ends: no drainer is left
        time.sleep(la.DEBOUNCE)
        two = worker(broker.url, tmp_path / "w2.log", concurrency=2, name="w2", app=APP)
        wait_until(lambda: call.state == "SUCCESS", timeout=20, what="the debounced call's run")
        time.sleep(0.3)
        assert [run[0] for run in _runs(r, "h")] == ["only"]
        _nothing_left(r, "h")
    finally:
        one.kill()
        if two is not None:
            two.kill()


# -- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_debounce": 0}, "lock_debounce"),
        ({"lock_debounce": -1}, "lock_debounce"),
        ({"lock_debounce": float("inf")}, "lock_debounce"),
        ({"lock_debounce": float("nan")}, "lock_debounce"),
        ({"lock_debounce": "2"}, "lock_debounce"),
        ({"lock_debounce": 1e12}, "lock_debounce"),
        ({"lock_debounce": 2.0, "lock_debounce_max": 1.0}, "must be >= lock_debounce"),
        ({"lock_debounce": 1.0, "on_contention": "skip"}, "lock_debounce goes with"),
        ({"on_contention": "replaced"}, "on_contention must be one of"),
    ],
)
def test_bad_last_call_wins_options_are_refused_at_decoration(
    options: dict[str, Any], message: str
) -> None:
    from celery import Celery

    app = Celery(f"latest-validation-{uuid.uuid4().hex}")
    with pytest.raises(LockConfigurationError, match=message):

        @app.task(base=LockedTask, lock_key="k:{x}", shared=False, **options)
        def refused(x: int) -> None: ...

        app.finalize()


def test_a_bound_without_a_debounce_is_refused_at_worker_start() -> None:
    """A task's lock_debounce_max may bound the app's redislock_debounce: decoration cannot
    tell, the worker's start does (and refuses to start)."""
    from types import SimpleNamespace

    from celery import Celery

    from celery_redislock.celery.worker import _check_settings_at_worker_start
    from celery_redislock.settings import check_latest

    for debounce, refused in ((None, True), (0.5, False), (10.0, True)):
        app = Celery(f"latest-bound-{uuid.uuid4().hex}", broker="redis://127.0.0.1:1/0")
        app.conf.redislock_debounce = debounce

        @app.task(base=LockedTask, lock_key="k:{x}", lock_debounce_max=5.0, shared=False)
        def bounded(x: int) -> None: ...

        app.finalize()
        where = f"task {bounded.name!r}"
        if refused:
            with pytest.raises(LockConfigurationError, match="lock_debounce_max"):
                check_latest(bounded.lock_options(), where)
        else:
            check_latest(bounded.lock_options(), where)
    # The worker's start refuses it (before it takes a task), naming the task.
    app = Celery(f"latest-bound-{uuid.uuid4().hex}", broker="redis://127.0.0.1:1/0")

    @app.task(base=LockedTask, lock_key="k:{x}", lock_debounce_max=5.0, shared=False)
    def unbounded(x: int) -> None: ...

    app.finalize()
    with pytest.raises(SystemExit, match=f"{unbounded.name}.*lock_debounce_max .* needs"):
        _check_settings_at_worker_start(SimpleNamespace(app=app))
