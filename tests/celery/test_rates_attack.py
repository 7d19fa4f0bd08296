"""Attacks on ``lock_rate`` (issue 18): deferral and the drainers under hostile data,
forged headers, Redis restarts, and real prefork workers running chains, links,
``Task.replace``, retries, ``countdown`` and ``expires`` through deferred runs,
duplicate deliveries, and several drainers at once.

Every run of the workers' tasks records its booked slot (``tests/rates_attack_app.py``),
so the oracles count every run, copies included, and check the bound over the slots.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chain
from celery.exceptions import Ignore

from celery_redislock import signals
from celery_redislock._keyspace import RateKeys
from celery_redislock._rates import Limit
from celery_redislock.celery.deferral import BOOKED_HEADER, Drainer, admit_or_defer
from celery_redislock.task import LockedTask
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .. import rates_attack_app as raa
from .._celery import wait_until, worker
from .._gcra import excess
from .test_rates import HANDOFF, PREFIX, REGISTRY, SENDING, _defer, _keys, _sent_ids

APP = "tests.rates_attack_app"
TEN_A_SECOND = Limit(10, 1_000_000)


def _runs(r: redis.Redis, key: str) -> list[tuple[int, str, str, int, int]]:
    """(slot µs, tag, task id, retries, replaced nesting) of every run recorded on ``key``."""
    found = []
    for line in r.lrange(raa.runs_key(key), 0, -1):
        slot, tag, task_id, retries, nesting = line.decode().split()
        found.append((int(slot), tag, task_id, int(retries), int(nesting)))
    return found


def _values(r: redis.Redis, list_key: str) -> list[str]:
    return [line.decode().split()[0] for line in r.lrange(list_key, 0, -1)]


def _line_gone(r: redis.Redis, key: str) -> bool:
    """Nothing of ``key``'s rate line is left: deferred, taken for sending, or queued."""
    deferred = RateKeys.for_name(f"ra:{key}", PREFIX).deferred
    return (
        r.llen(deferred) == 0
        and r.zscore(REGISTRY, deferred) is None
        and r.zcard(SENDING) == 0
        and r.llen(HANDOFF) == 0
        and r.llen("celery") == 0
    )


# -- hostile data and forged headers, in process --------------------------------------------


@pytest.mark.parametrize("ahead", ["hour", "inf"])
def test_a_registry_score_beyond_any_heads_reach_does_not_wedge_the_line(
    broker: RedisServer, ahead: str
) -> None:
    """A line's registry score far past any slot its head can have (written by anyone who
    can write the registry, or left by a server clock stepped back an hour) is not waited
    for: the next look at the line (a call joining it) reschedules it at its head's due
    time, and the line drains."""
    r = broker.client()
    keys = _keys("far")
    deferred = _defer(r, "far", 3)
    assert len(deferred) == 2
    now_s, _micros = r.time()
    far = now_s * 1000 + 3_600_000 if ahead == "hour" else float("inf")
    r.zadd(REGISTRY, {keys.deferred: far})
    deferred += _defer(r, "far", 1, start=3)  # a call joins the line
    assert len(deferred) == 3
    drainer = Drainer(ca.app, [PREFIX])
    wait_until(lambda: drainer.drain_once() is not None and len(_sent_ids(r)) == 3, 10)
    assert _sent_ids(r) == deferred


def test_junk_in_the_registry_the_sending_set_and_the_line_is_survived_in_order(
    broker: RedisServer,
) -> None:
    r = broker.client()
    keys = _keys("junk")
    deferred = _defer(r, "junk", 4)
    assert len(deferred) == 3
    # Junk entries amid the genuine ones (an empty one, a non-JSON one, a genuine entry's
    # copy signed for another list), each refused in its turn; the line goes on in order.
    genuine = r.lrange(keys.deferred, 0, -1)
    r.linsert(keys.deferred, "AFTER", genuine[0], b"")
    r.linsert(keys.deferred, "AFTER", genuine[1], b"D" + b"f" * 64 + b"\nnot json")
    r.rpush(keys.deferred, genuine[2].replace(b"charge-junk", b"charge-forged"))
    # The registry: members at -inf, negative and huge scores, of other prefixes, of a
    # hash where a list belongs; the sending set: members with no list, no entry, at
    # -inf, and a genuine-looking one of another prefix.
    hashed = _keys("hashed").deferred
    r.hset(hashed, "a", "b")
    r.zadd(
        REGISTRY,
        {
            b"junk": float("-inf"),
            b"other:{x}:rate:deferred": -5,
            hashed: 0,
            b"huge": 1e300,
        },
    )
    r.zadd(
        SENDING,
        {
            b"no newline": float("-inf"),
            keys.deferred + b"\n": 0,
            b"other:{x}:rate:deferred\n" + genuine[0]: -1,
            b"late": 1e300,
        },
    )
    drainer = Drainer(ca.app, [PREFIX])
    refused: list[str] = []

    def seen(sender: Any = None, reason: str = "", **_: Any) -> None:
        refused.append(reason)

    signals.parked_rejected.connect(seen)
    try:
        wait_until(lambda: drainer.drain_once() is not None and len(_sent_ids(r)) >= 3, 10)
        time.sleep(0.3)
        drainer.drain_once()
    finally:
        signals.parked_rejected.disconnect(seen)
    assert _sent_ids(r) == deferred  # the genuine ones, once each, in order
    assert r.llen(keys.deferred) == 0 and r.zscore(REGISTRY, keys.deferred) is None
    for member in (b"junk", b"other:{x}:rate:deferred", hashed, b"huge"):
        assert r.zscore(REGISTRY, member) is None  # (huge: beyond any head's reach)
    left = set(r.zrange(SENDING, 0, -1))
    assert left == {b"late"}  # not stale yet: only ever looked at after redislock_ttl
    # Each reported once: the line's three, the registry's three of no list of this prefix
    # (the hash is a list's name: taken out quietly), the sending set's three.
    assert len(refused) == 3 + 3 + 3, refused


@pytest.mark.parametrize("value", [10**30, -5, "yes", [1], {"a": 1}, 1.5, True])
def test_a_forged_booked_header_skips_the_rate_and_nothing_else(
    broker: RedisServer, value: Any
) -> None:
    """Documented: the header skips the rate check. It books nothing, writes nothing,
    leaves no line behind, and a genuine call on the key is still admitted in its turn."""
    r = broker.client()
    keys = _keys("forged")
    for n in range(5):
        ca.charge.push_request(
            id=f"forged-{n}", args=("forged", n), kwargs={}, headers={BOOKED_HEADER: value}
        )
        try:
            admit_or_defer(
                ca.charge, ca.charge.request, ("forged", n), {}, ca.charge.lock_options()
            )
            assert ca.charge.request.redislock_rate_slot_us >= 1
        finally:
            ca.charge.pop_request()
    assert r.dbsize() == 0  # nothing booked, deferred or registered
    assert _defer(r, "forged", 3, start=10) == ["charge-forged-11", "charge-forged-12"]
    drainer = Drainer(ca.app, [PREFIX])
    wait_until(lambda: drainer.drain_once() is not None and len(_sent_ids(r)) == 2, 10)
    assert _sent_ids(r) == ["charge-forged-11", "charge-forged-12"]
    sent = [json.loads(raw)["headers"] for raw in r.lrange(HANDOFF, 0, -1)]
    assert all(isinstance(h[BOOKED_HEADER], int) and h[BOOKED_HEADER] > 1 for h in sent)
    assert r.llen(keys.deferred) == 0


# -- Redis restarts mid-drain ----------------------------------------------------------------


def _restart_mid_drain(server: RedisServer) -> tuple[list[str], list[str]]:
    """Defer 20 runs on a fresh app over ``server``, drain some, SIGKILL and restart the
    server, drain the rest: (the deferred ids, the ids the drainers sent, in order)."""
    app = Celery("rates-restart", broker=server.url, set_as_current=False)
    app.conf.update(redislock_signing_key="a restart test's key of 32 bytes")

    @app.task(
        bind=True,
        base=LockedTask,
        lock_key="m:{m}",
        lock_limit=None,
        lock_rate="50/s",
        shared=False,
    )
    def restart_charge(self: Any, m: str, n: int) -> None: ...

    app.finalize()
    r = server.client()
    deferred = []
    try:
        for n in range(21):
            restart_charge.push_request(
                id=f"restart-{n}", args=("x", n), kwargs={}, headers={}, delivery_info={}
            )
            try:
                admit_or_defer(
                    restart_charge,
                    restart_charge.request,
                    ("x", n),
                    {},
                    restart_charge.lock_options(),
                )
            except Ignore:
                deferred.append(f"restart-{n}")
            finally:
                restart_charge.pop_request()
        assert len(deferred) == 20
        drainer = Drainer(app, [PREFIX])
        wait_until(lambda: drainer.drain_once() is not None and len(_sent_ids(r)) >= 5, 10)
        server.restart()
        r = server.client()

        def drained() -> bool:
            try:
                drainer.drain_once()
            except redis.ConnectionError:
                return False
            return r.zcard(REGISTRY) == 0

        wait_until(drained, 15)
        return deferred, _sent_ids(r)
    finally:
        app.close()


def test_a_redis_restart_mid_drain_with_aof_always_loses_no_deferred_run(
    redis_server_factory: Any,
) -> None:
    server = redis_server_factory(appendonly=True)
    server.client().config_set("appendfsync", "always")
    deferred, sent = _restart_mid_drain(server)
    assert sent == deferred  # each once, in order, across the restart


def test_a_redis_restart_without_persistence_loses_the_backlog_as_documented(
    redis_server_factory: Any,
) -> None:
    """docs/guarantees.md: without persistence every deferred run is lost (their
    messages were acknowledged). Checked, so the docs stay true."""
    server = redis_server_factory()
    deferred, sent = _restart_mid_drain(server)
    assert sent == []  # the sent messages were in that Redis too
    assert len(deferred) == 20


# -- real prefork workers ---------------------------------------------------------------------


def test_chains_links_and_replace_through_deferred_runs_continue_once_each(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        chains = [chain(raa.rated.s("ch", f"c{n}"), raa.after.s("ch")).delay() for n in range(6)]
        linked = [
            raa.rated.apply_async(("ch", f"l{n}"), link=raa.after.s("ch-link")) for n in range(4)
        ]
        replaced = [
            chain(raa.rated.s("ch", f"r{n}", "replace"), raa.after.s("ch")).delay()
            for n in range(4)
        ]
        for result in chains + replaced:
            result.get(timeout=60)
        for result in linked:
            result.get(timeout=60)
        wait_until(lambda: r.llen("ra:after:ch-link") >= 4, 30)
        wait_until(lambda: _line_gone(r, "ch"), 30)
        time.sleep(1.0)  # room for a late copy, had one been sent
        runs = _runs(r, "ch")
        assert sorted(tag for _, tag, *_ in runs) == sorted(
            [f"c{n}" for n in range(6)] + [f"l{n}" for n in range(4)] + [f"r{n}" for n in range(4)]
        )
        assert len({task_id for _, _, task_id, *_ in runs}) == 14
        assert sorted(_values(r, "ra:after:ch")) == sorted(
            [f"c{n}" for n in range(6)] + [f"replaced-r{n}" for n in range(4)]
        )
        assert sorted(_values(r, "ra:after:ch-link")) == [f"l{n}" for n in range(4)]
        assert sorted(_values(r, "ra:replaced:ch")) == [f"r{n}" for n in range(4)]
        assert excess([(slot, 1) for slot, *_ in runs], 1, TEN_A_SECOND) == []
        assert "deferred to its slot" in proc.text()
    finally:
        proc.kill()  # everything was checked while it ran


def test_a_retry_from_a_drained_run_is_rate_checked_again(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        jobs = [raa.rated.delay("rt", f"t{n}", "retry") for n in range(8)]
        for job in jobs:
            job.get(timeout=60)
        wait_until(lambda: _line_gone(r, "rt"), 30)
        time.sleep(0.5)
        runs = _runs(r, "rt")
        # Each job ran twice (its run and its retry), no more.
        assert sorted((task_id, retries) for _, _, task_id, retries, _ in runs) == sorted(
            (job.id, n) for job in jobs for n in (0, 1)
        )
        # The retry booked a slot of its own: it did not reuse its run's.
        slots = [slot for slot, *_ in runs]
        assert len(set(slots)) == 16 and min(slots) > 1
        assert excess([(slot, 1) for slot in slots], 1, TEN_A_SECOND) == []
    finally:
        proc.kill()  # everything was checked while it ran


def test_countdown_is_honoured_and_an_expired_deferred_run_is_dropped_not_blocking(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        seconds, micros = r.time()
        sent_us = seconds * 1_000_000 + micros
        later = [raa.rated.apply_async(("eta", f"e{n}"), countdown=1.5) for n in range(3)]
        expiring = [raa.rated.apply_async(("ex", f"x{n}"), expires=0.4) for n in range(10)]
        expires_us = sent_us + 400_000 + 200_000  # (sent after sent_us; a margin for that)
        kept = [raa.rated.delay("ex", f"k{n}") for n in range(5)]
        for result in later + kept:
            result.get(timeout=60)
        wait_until(lambda: _line_gone(r, "ex") and _line_gone(r, "eta"), 30)
        time.sleep(1.0)
        eta_runs = _runs(r, "eta")
        assert sorted(tag for _, tag, *_ in eta_runs) == ["e0", "e1", "e2"]
        assert all(slot >= sent_us + 1_500_000 for slot, *_ in eta_runs)  # not before the eta
        runs = _runs(r, "ex")
        ran = [tag for _, tag, *_ in runs]
        assert len(ran) == len(set(ran))  # none twice
        assert {f"k{n}" for n in range(5)} <= set(ran)  # none behind an expired run is lost
        expired_ran = [(slot, tag) for slot, tag, *_ in runs if tag.startswith("x")]
        assert len(expired_ran) <= 7, expired_ran  # at 10/s, most expired in the line
        assert all(slot <= expires_us for slot, _ in expired_ran)  # none ran after its expiry
        dropped = [job for job in expiring if f"x{expiring.index(job)}" not in ran]
        assert len(dropped) >= 3
        wait_until(lambda: all(job.state == "REVOKED" for job in dropped), 10)
    finally:
        proc.kill()  # everything was checked while it ran


def test_duplicate_deliveries_of_a_deferred_locked_run_complete_it_once(
    broker: RedisServer, tmp_path: Path
) -> None:
    """Two copies of each message (one task id), most deferred: with a lock, each task
    runs once; each copy is drained (a slot spent on a copy is lost, never more runs)."""
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, app=APP)
    try:
        ids = [f"dup-{n}" for n in range(6)]
        results = []
        for task_id in ids:
            results.append(raa.rated_locked.apply_async(("dup", task_id), task_id=task_id))
            raa.rated_locked.apply_async(("dup", task_id), task_id=task_id)
        for result in results:
            result.get(timeout=60)
        wait_until(lambda: _line_gone(r, "dup"), 30)
        time.sleep(1.0)
        runs = _runs(r, "dup")
        assert sorted(task_id for _, _, task_id, *_ in runs) == ids
        assert excess([(slot, 1) for slot, *_ in runs], 1, TEN_A_SECOND) == []
    finally:
        proc.kill()  # everything was checked while it ran


@pytest.mark.slow  # ~14 s; the default suite has several drainers in one process (test_rates)
def test_several_workers_drain_one_line_at_the_rate_each_run_once(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    procs = [
        worker(broker.url, tmp_path / f"w{n}.log", concurrency=2, app=APP, name=f"w{n}")
        for n in range(3)
    ]
    try:
        jobs = [raa.rated.delay("many", f"m{n}") for n in range(30)]
        others = [raa.rated.delay(f"other{n}", "o") for n in range(6)]
        for job in jobs + others:
            job.get(timeout=60)
        wait_until(lambda: _line_gone(r, "many"), 30)
        time.sleep(0.5)
        runs = _runs(r, "many")
        assert sorted(task_id for _, _, task_id, *_ in runs) == sorted(j.id for j in jobs)
        assert excess([(slot, 1) for slot, *_ in runs], 1, TEN_A_SECOND) == []
        # Every worker's drainer took part, or at least the line was not one worker's.
        assert all(len(_runs(r, f"other{n}")) == 1 for n in range(6))
    finally:
        for proc in procs:
            proc.stop()


# -- known gaps (strict xfails: each passes once its bug is fixed) ------------------------------


def test_a_junk_registry_score_on_a_line_nobody_joins_does_not_wedge_it(
    broker: RedisServer,
) -> None:
    r = broker.client()
    keys = _keys("stuck")
    deferred = _defer(r, "stuck", 3)
    assert len(deferred) == 2
    r.zadd(REGISTRY, {keys.deferred: float("inf")})
    drainer = Drainer(ca.app, [PREFIX])
    wait_until(lambda: drainer.drain_once() is not None and len(_sent_ids(r)) == 2, 5)
    assert _sent_ids(r) == deferred


def test_an_expired_deferred_run_books_no_slot(broker: RedisServer) -> None:
    from datetime import datetime, timedelta, timezone

    r = broker.client()
    past = (datetime.now(timezone.utc) - timedelta(seconds=60)).isoformat()
    deferred = []
    for n in range(12):
        task_id = f"charge-exp-{n}"
        expires = past if 0 < n < 11 else None  # the first (admitted) and the last live
        ca.charge.push_request(id=task_id, args=("exp", n), kwargs={}, headers={}, expires=expires)
        try:
            admit_or_defer(ca.charge, ca.charge.request, ("exp", n), {}, ca.charge.lock_options())
        except Ignore:
            deferred.append(task_id)
        finally:
            ca.charge.pop_request()
    assert len(deferred) == 11
    drainer = Drainer(ca.app, [PREFIX])
    wait_until(lambda: drainer.drain_once() is not None and r.llen(_keys("exp").deferred) == 0, 10)
    headers = [json.loads(raw)["headers"] for raw in reversed(r.lrange(HANDOFF, 0, -1))]
    booked = [h["id"] for h in headers if h.get(BOOKED_HEADER)]
    assert booked == ["charge-exp-11"]  # only the live run took a slot
