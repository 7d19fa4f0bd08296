"""``lock_rate``: a task over its rate is deferred to its slot, in arrival order per key,
and drained by the workers' drainers — validation, the defer and drain scripts against
real Redis (order, a backlog, several drainers, junk and forged entries), and real
prefork workers."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockConfigurationError
from celery_redislock._keyspace import RateKeys, deferred_registry, deferred_sending
from celery_redislock._rates import Limit
from celery_redislock.celery import signing
from celery_redislock.celery.deferral import BOOKED_HEADER, Drainer, _dumps
from celery_redislock.settings import TASK_OPTIONS, LockSettings, task_rules
from celery_redislock.task import LockedTask
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import wait_until, worker
from .._gcra import excess

PREFIX = "redislock:"
REGISTRY = deferred_registry(PREFIX)
SENDING = deferred_sending(PREFIX)
HANDOFF = "celery.redislock"  # where the drainer sends the default queue's tasks


def _keys(merchant: str) -> RateKeys:
    return RateKeys.for_name(f"merchant:{merchant}", PREFIX)


def _sent_ids(r: redis.Redis) -> list[str]:
    """Task ids of the messages the drainers sent, in the order a worker fetches them."""
    return [json.loads(raw)["headers"]["id"] for raw in reversed(r.lrange(HANDOFF, 0, -1))]


def _sent_headers(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw)["headers"] for raw in reversed(r.lrange(HANDOFF, 0, -1))]


def _defer(r: redis.Redis, merchant: str, count: int, *, start: int = 0) -> list[str]:
    """Send ``count`` charges through the worker's admission step (in process); the ids
    of those it deferred, in order."""
    from celery.exceptions import Ignore

    from celery_redislock.celery.deferral import admit_or_defer

    deferred = []
    for n in range(start, start + count):
        task_id = f"charge-{merchant}-{n}"
        ca.charge.push_request(id=task_id, args=(merchant, n), kwargs={}, headers={})
        try:
            admit_or_defer(
                ca.charge, ca.charge.request, (merchant, n), {}, ca.charge.lock_options()
            )
        except Ignore:
            deferred.append(task_id)
        finally:
            ca.charge.pop_request()
    return deferred


def _commands(r: redis.Redis) -> int:
    return sum(int(v["calls"]) for k, v in r.info("commandstats").items())


# -- validation -------------------------------------------------------------------------


def test_rates_are_checked_at_decoration_and_no_lock_needs_a_rate(broker: RedisServer) -> None:
    app = Celery("rates-validation", broker=broker.url, set_as_current=False)
    app.finalize()
    for bad in ("20/x", 0, "0/s", [], ["1/s", "2/s"], (1, 0), True):
        with pytest.raises(LockConfigurationError, match="lock_rate"):

            @app.task(base=LockedTask, lock_key="k:{x}", lock_rate=bad, shared=False)
            def refused(x: int) -> None: ...

    with pytest.raises(LockConfigurationError, match="lock_limit=None means no lock"):

        @app.task(base=LockedTask, lock_key="k:{x}", lock_limit=None, shared=False)
        def nothing(x: int) -> None: ...

    with pytest.raises(LockConfigurationError, match="lock_rate_key"):

        @app.task(base=LockedTask, lock_rate="1/s", lock_rate_key="m:{nope}", shared=False)
        def unknown(x: int) -> None: ...

    with pytest.raises(LockConfigurationError, match="lock_rate_key must be None"):

        @app.task(base=LockedTask, lock_rate="1/s", lock_rate_key=7, shared=False)
        def number(x: int) -> None: ...

    @app.task(
        base=LockedTask,
        lock_key="a:{x}",
        lock_rate=["5/s", "1000/h"],
        lock_rate_key="m:{y}",
        shared=False,
    )
    def both(x: int, y: int) -> None: ...

    options = both.lock_options()
    assert options.locked and not options.limited
    assert options.rate == (Limit(5, 1_000_000), Limit(1000, 3_600_000_000))
    assert both.rate_name((1, 2), {}) == "m:2" and both.lock_name((1, 2), {}) == "a:1"

    @app.task(base=LockedTask, lock_key="a:{x}", shared=False)
    def plain(x: int) -> None: ...

    assert plain.lock_options().rate is None and plain.lock_options().locked  # unchanged

    with pytest.raises(LockConfigurationError, match="redislock_rate"):
        LockSettings.from_conf({"broker_url": broker.url, "redislock_rate": "fast"})
    urls = [f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)]  # never reached
    with pytest.raises(LockConfigurationError, match="redislock_rate is not offered"):
        LockSettings.from_conf({"redislock_urls": urls, "redislock_rate": "1/s"})
    defaults = LockSettings.from_conf({"broker_url": broker.url, "redislock_rate": "3/m"})
    assert defaults.defaults.rate == (Limit(3, 60_000_000),)
    assert {"lock_rate", "lock_rate_key", "lock_limit"} <= set(TASK_OPTIONS)
    rules = task_rules({"redislock_tasks": {"x.*": {"lock_rate": "2/s", "lock_rate_key": "m:{m}"}}})
    assert rules[0].options["lock_rate"] == "2/s"
    with pytest.raises(LockConfigurationError, match=r"redislock_tasks\['x'\].*lock_rate"):
        task_rules({"redislock_tasks": {"x": {"lock_rate": "2/q"}}})
    app.close()


# -- the defer and drain scripts, in process ---------------------------------------------


def test_over_rate_runs_are_deferred_in_order_and_drained_at_the_rate(broker: RedisServer) -> None:
    r = broker.client()
    keys = _keys("m")
    # "20/s", burst 1: the first is admitted at once, every later one joins the line.
    deferred = _defer(r, "m", 6)
    assert deferred == [f"charge-m-{n}" for n in range(1, 6)]
    assert r.llen(keys.deferred) == 5
    assert r.zscore(REGISTRY, keys.deferred) is not None
    # Another key is not behind them.
    assert _defer(r, "other", 1) == []
    drainers = [Drainer(ca.app, [PREFIX]) for _ in range(3)]
    sent: list[str] = []
    while len(sent) < 5:
        for drainer in drainers:  # several drainers at once: each head sent once
            drainer.drain_once()
        sent = _sent_ids(r)
    assert sent == deferred  # arrival order, each once
    assert r.llen(keys.deferred) == 0 and r.zscore(REGISTRY, keys.deferred) is None
    assert r.zcard(SENDING) == 0  # every one confirmed sent
    slots = [h[BOOKED_HEADER] for h in _sent_headers(r)]
    # Each was admitted at its own slot: the bound holds over the booked moments.
    assert excess([(slot, 1) for slot in slots], 1, Limit(20, 1_000_000)) == []


def test_a_backlog_of_10000_costs_only_its_head_per_tick(broker: RedisServer) -> None:
    r = broker.client()
    keys = _keys("big")
    # A slow rate (1 a minute per merchant, as a test rate): the line never comes due here.
    limits = (Limit(1, 60_000_000),)
    r.set(keys.schedule(60_000_000), str(10**16 - 1))  # junk: read as full
    from celery_redislock.celery.clients import settings_for

    signing_key = settings_for(ca.app).signing_key
    pipe = r.pipeline(transaction=False)
    for n in range(10_000):
        text = _dumps(
            {
                "signature": dict(ca.charge.s("big", n).set(task_id=f"t{n}")),
                "limits": [[limit.count, limit.period_us] for limit in limits],
            }
        )
        pipe.rpush(keys.deferred, signing.sign_deferred(signing_key, keys.deferred, text))
    pipe.execute()
    r.zadd(REGISTRY, {keys.deferred: 0})  # due now: the drainer looks at it
    drainer = Drainer(ca.app, [PREFIX])
    drainer.drain_once()  # the head is not due: rescheduled, nothing sent
    assert r.llen(HANDOFF) == 0 and r.llen(keys.deferred) == 10_000
    due = r.zscore(REGISTRY, keys.deferred)
    assert due is not None and due > 0
    before = _commands(r)
    for _ in range(50):  # ticks before the head's slot: one look each, whatever the backlog
        drainer.drain_once()
    spent = _commands(r) - before
    # Per tick: TIME and the registry's first and last members (a last one beyond any
    # head's reach is junk, served at once), TIME and the stale-sending scan (+ INFO).
    assert spent == 50 * 5 + 1, spent
    assert r.llen(keys.deferred) == 10_000


def test_junk_and_forged_entries_are_refused_and_the_line_goes_on(broker: RedisServer) -> None:
    r = broker.client()
    keys = _keys("h")
    # A registry member that names no deferred list, and a list key of the wrong type.
    r.zadd(REGISTRY, {b"redislock:{x}:junk": 0, _keys("str").deferred: 0})
    r.set(_keys("str").deferred, "not a list")
    deferred = _defer(r, "h", 3)
    assert len(deferred) == 2
    # Forged entries before the genuine ones: unsigned, signed with another key, signed
    # for another list, and one for a task whose arguments take another key.
    text = _dumps(
        {"signature": dict(ca.charge.s("h", 99).set(task_id="f")), "limits": [[20, 10**6]]}
    )
    moved = _dumps(
        {"signature": dict(ca.charge.s("elsewhere", 1).set(task_id="g")), "limits": [[20, 10**6]]}
    )
    from celery_redislock.celery.clients import settings_for

    genuine_key = settings_for(ca.app).signing_key
    forged = [
        b"D" + b"0" * 64 + b"\n" + text.encode(),
        signing.sign_deferred(b"another key of 16 bytes", keys.deferred, text).encode(),
        signing.sign_deferred(genuine_key, _keys("other").deferred, text).encode(),
        signing.sign_deferred(genuine_key, keys.deferred, moved).encode(),
        b"junk",
    ]
    for entry in reversed(forged):
        r.lpush(keys.deferred, entry)
    refused: list[str] = []
    from celery_redislock import signals

    def seen(sender: Any = None, reason: str = "", **_: Any) -> None:
        refused.append(reason)

    signals.parked_rejected.connect(seen)
    try:
        drainer = Drainer(ca.app, [PREFIX])
        wait_until(lambda: drainer.drain_once() is not None and len(_sent_ids(r)) == 2, 10)
    finally:
        signals.parked_rejected.disconnect(seen)
    assert _sent_ids(r) == deferred  # only the genuine ones, in order
    assert len(refused) >= len(forged) + 1  # each forged entry, and the junk member
    assert r.zscore(REGISTRY, b"redislock:{x}:junk") is None
    assert r.zscore(REGISTRY, _keys("str").deferred) is None


def test_a_call_taken_for_sending_by_a_drainer_that_died_is_sent_again(
    broker: RedisServer,
) -> None:
    r = broker.client()
    keys = _keys("d")
    deferred = _defer(r, "d", 2)
    assert len(deferred) == 1
    head = r.lindex(keys.deferred, 0)
    assert head is not None
    # A drainer takes the head for sending and dies before sending it (its script ran).

    class Dying(Drainer):
        def _send(self, found: dict[str, Any], slot_us: int = 1) -> None:
            raise SystemExit("killed")

    def attempt() -> bool:
        try:
            Dying(ca.app, [PREFIX]).serve(r, PREFIX, keys.deferred)
        except SystemExit:
            return True
        return False

    wait_until(attempt, 5)
    assert r.llen(HANDOFF) == 0 and r.llen(keys.deferred) == 0
    member = r.zrange(SENDING, 0, 0)[0]
    assert member == keys.deferred + b"\n" + head
    r.zadd(SENDING, {member: 0})  # long unconfirmed
    other = Drainer(ca.app, [PREFIX])
    other.drain_once()
    assert _sent_ids(r) == deferred and r.zcard(SENDING) == 0


# -- real prefork workers -----------------------------------------------------------------


@pytest.mark.parametrize("count", [100, pytest.param(500, marks=pytest.mark.slow)])  # 500: ~30 s
def test_a_merchant_backlog_drains_at_the_rate_once_each_and_others_are_not_behind_it(
    broker: RedisServer, tmp_path: Path, count: int
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2)
    try:
        charges = [ca.charge.delay("m", n) for n in range(count)]
        others = [ca.settle.delay(f"other{i}", 1) for i in range(10)]
        for result in others:
            result.get(timeout=60)
        # The unrelated tasks, sent after the whole backlog, were not queued behind it:
        # all ran while it was still draining (no worker slot waits for a charge's slot).
        assert r.llen("starts:m") < count
        for result in charges:
            result.get(timeout=60 + count / 20)
        starts = [line.decode().split() for line in r.lrange("starts:m", 0, -1)]
        # Every charge ran once...
        assert sorted(s[2] for s in starts) == sorted(c.id for c in charges)
        # ...each at a slot its rate admitted, within burst + rate * T in every window.
        assert excess([(int(s[0]), 1) for s in starts], 1, Limit(20, 1_000_000)) == []
        assert r.llen("sections:settle") == 10
        assert "deferred to its slot" in proc.text()
        assert r.llen(_keys("m").deferred) == 0 and r.zcard(SENDING) == 0
    finally:
        proc.kill()  # everything was checked while it ran


def test_rate_then_permits_compose_and_a_permit_is_never_held_waiting(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4)
    try:
        jobs = [ca.settle_rated.delay("acc", "mm", 0.3) for _ in range(8)]
        for job in jobs:
            job.get(timeout=60)
        starts = [line.decode().split() for line in r.lrange("starts:mm", 0, -1)]
        assert sorted(s[2] for s in starts) == sorted(j.id for j in jobs)  # once each
        assert excess([(int(s[0]), 1) for s in starts], 1, Limit(10, 1_000_000)) == []
        from .test_limits import _overlap, _sections

        assert _overlap([(s[1], s[2]) for s in _sections(r, "acc")]) <= 2
    finally:
        proc.kill()  # everything was checked while it ran


# -- a worker killed during the drain ------------------------------------------------------


def _runs(r: redis.Redis, merchant: str) -> list[tuple[int, str]]:
    """(booked slot, task id) of every start recorded for ``merchant``, copies included."""
    found = []
    for line in r.lrange(f"starts:{merchant}", 0, -1):
        slot, _n, task_id = line.decode().split()
        found.append((int(slot), task_id))
    return found


def _drained(r: redis.Redis, merchants: list[str]) -> bool:
    """Nothing of the runs is left anywhere: deferred, taken for sending, queued, unacked."""
    return (
        all(r.llen(_keys(m).deferred) == 0 for m in merchants)
        and r.zcard(SENDING) == 0
        and r.llen(HANDOFF) == 0
        and r.llen("celery") == 0
        and r.hlen("unacked") == 0
    )


def _kill_during_the_drain(
    broker: RedisServer, tmp_path: Path, charges: int, settles: int, kills: int
) -> None:
    """``charges`` rate-only runs ("20/s") and ``settles`` locked ones ("10/s" per
    merchant, two at a time per account) are sent at once; the worker holding their
    backlog is killed (SIGKILL of its process group: main process, drainer and pool)
    while it drains, ``kills`` times, a new worker started each time. Every run is
    accounted for: none lost; a rate-only run may run twice (at-least-once, counted and
    reported), a locked one completes once (its done marker); the bound holds over the
    slots booked."""
    r = broker.client()
    env = {"REDISLOCK_TEST_TTL": "3", "REDISLOCK_TEST_VT": "2"}
    proc = worker(broker.url, tmp_path / "w0.log", concurrency=2, env=env, name="w0")
    procs = [proc]
    try:
        charged = [ca.charge.delay("kill", n).id for n in range(charges)]
        settled = [ca.settle_rated.delay(f"k{n % 4}", "killmk", 0.2).id for n in range(settles)]
        backlog_at_kill = []
        for round_ in range(kills):
            target = r.llen("starts:kill") + charges // (kills + 2)
            wait_until(lambda target=target: r.llen("starts:kill") >= target, 60)
            backlog_at_kill.append(r.llen(_keys("kill").deferred))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.stop()
            log = tmp_path / f"w{round_ + 1}.log"
            proc = worker(broker.url, log, concurrency=2, env=env, name=f"w{round_ + 1}")
            procs.append(proc)
        # The kills fell inside the drain: the backlog was still deferred in Redis.
        assert all(backlog > 0 for backlog in backlog_at_kill), backlog_at_kill
        wait_until(lambda: _drained(r, ["kill", "killmk"]), 90)
        time.sleep(1.0)  # room for a late copy to start, had one been sent
        assert _drained(r, ["kill", "killmk"])

        charge_runs = _runs(r, "kill")
        ids = [task_id for _, task_id in charge_runs]
        assert set(ids) <= set(charged)  # none made up
        # None lost, but for kombu's Redis transport: a message its consumer popped (BRPOP)
        # and had not yet recorded as unacknowledged when SIGKILLed is gone with it (the
        # worker logs "received" only after that record). At most one per kill, and only
        # a run every received delivery of which was deferred (its due copy, sent by a
        # drainer, never reached a worker).
        missing = set(charged) - set(ids)
        logs = "".join(p.text() for p in procs)
        lost_by_us = [
            m
            for m in missing
            if logs.count(f"[{m}] received") != logs.count(f"[{m}] deferred to its slot")
        ]
        assert len(missing) <= kills and not lost_by_us, f"runs lost: {sorted(missing)}"
        duplicates = len(ids) - len(set(ids))
        # Settled runs: each completed exactly once (a copy of a done run is stopped by
        # its done marker); a start with no section is a run the kill cut short.
        sections = [line.decode().split()[1] for line in r.lrange("sections:limit", 0, -1)]
        assert sorted(sections) == sorted(settled)
        settle_runs = _runs(r, "killmk")
        assert {task_id for _, task_id in settle_runs} == set(settled)
        cut_short = len(settle_runs) - len(settled)
        assert cut_short <= 2 * kills  # at most the killed pool's two runs each time

        # The bound, over the slots booked (a copy of a run reuses its run's slot; a run
        # sent again by another drainer after its drainer died says "booked" only: 1).
        for runs, limit in (
            (charge_runs, Limit(20, 1_000_000)),
            (settle_runs, Limit(10, 1_000_000)),
        ):
            booked = {(slot, task_id) for slot, task_id in runs if slot > 1}
            assert excess([(slot, 1) for slot, _ in booked], 1, limit) == []
            assert len(booked) >= len({task_id for _, task_id in runs}) - 2 * kills
        print(
            f"\nkilled {kills}x during the drain (backlogs {backlog_at_kill}): "
            f"{charges} rate-only runs, {duplicates} ran twice; "
            f"{settles} locked runs, each completed once, {cut_short} cut short by a kill"
        )
    finally:
        for each in procs:
            each.kill()


def test_a_worker_killed_during_the_drain_loses_no_run(broker: RedisServer, tmp_path: Path) -> None:
    _kill_during_the_drain(broker, tmp_path, charges=60, settles=24, kills=1)


@pytest.mark.slow
def test_workers_killed_again_and_again_during_a_long_drain_lose_no_run(
    broker: RedisServer, tmp_path: Path
) -> None:
    _kill_during_the_drain(broker, tmp_path, charges=300, settles=100, kills=3)
