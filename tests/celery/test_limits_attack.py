"""Attacks on ``lock_limit``: duplicate deliveries, redelivery, retries and replacement,
hostile data under the prefix, limits that change between calls, the sweeper, revokes
and Redis restarts — against real Redis and real prefork workers.

Every run records its section and its permit's fencing token (``tests/limits_attack_app.py``).
Tokens are handed out in the order permits are taken, so the oracle can check each run
against the limit it took its permit under: at most ``limit - 1`` runs that took their
permit earlier are still inside when it enters. Each oracle also counts the runs it
expected to see, each exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis

from celery_redislock import LockConfigurationError, LockNotOwnedError, RedisSemaphore
from celery_redislock._core import OwnerRunning
from celery_redislock._keyspace import SemaphoreKeys, parked_registry
from celery_redislock.celery import signing
from celery_redislock.celery.clients import settings_for
from celery_redislock.celery.envelope import _dumps
from celery_redislock.celery.handover import deliver_handed_over
from celery_redislock.celery.parking import Parker
from celery_redislock.celery.sweeper import Sweeper
from celery_redislock.celery.tasklock import TaskSemaphore, task_lock
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .. import limits_attack_app as lap
from .._celery import EveryKeySeen, wait_until, worker
from .test_parking import _fetch

APP = "tests.limits_attack_app"


def keys_of(tenant: str) -> SemaphoreKeys:
    return SemaphoreKeys.for_name(f"cap:{tenant}")


def permit(owner: str, tenant: str = "t", limit: int = 2, options: Any = None) -> TaskSemaphore:
    """The permit of the run ``owner`` of ``capped(tenant, ...)`` (as a worker builds it)."""
    lock = task_lock(
        ca.app,
        f"cap:{tenant}",
        task_id=owner,
        options=options or lap.capped.lock_options(),
        limit=limit,
    )
    assert isinstance(lock, TaskSemaphore)
    return lock


def signed_parked(task_id: str, tenant: str = "t") -> str:
    """``capped(tenant, 0)`` parked by a pool process: its signature, signed for its key."""
    signature = lap.capped.signature((tenant, 0.0), task_id=task_id)
    key = settings_for(ca.app).signing_key
    return signing.sign_signature(key, keys_of(tenant).line.lock, task_id, _dumps(dict(signature)))


def holders(r: redis.Redis, tenant: str = "t") -> set[str]:
    return {h.decode() for h in r.smembers(keys_of(tenant).line.lock)}


class Run(NamedTuple):
    tenant: str
    run: str
    token: int
    limit: int
    enter: float
    leave: float


def runs_of(r: redis.Redis, tenant: str) -> list[Run]:
    found = []
    for raw in r.lrange(lap.RUNS, 0, -1):
        t, run, token, limit, enter, leave, _pid = raw.decode().split()
        if t == tenant:
            found.append(Run(t, run, int(token), int(limit), float(enter), float(leave)))
    return found


def most_at_once(runs: list[Run]) -> int:
    events = sorted([(run.enter, 1) for run in runs] + [(run.leave, -1) for run in runs])
    most = inside = 0
    for _at, step in events:
        inside += step
        most = max(most, inside)
    return most


def check_limits(runs: list[Run]) -> None:
    """Each run took its permit (its token) while fewer than its limit were held: a run
    that took its permit earlier (a lower token) and was still inside when this one
    entered held its permit when this one took its own."""
    tokens = [run.token for run in runs]
    assert len(set(tokens)) == len(tokens), f"two runs with one permit: {sorted(tokens)}"
    for run in runs:
        earlier = [o for o in runs if o.token < run.token and o.leave > run.enter]
        assert len(earlier) < run.limit, (run, earlier)


def ran_once_each(runs: list[Run], expected: list[str]) -> None:
    assert sorted(run.run for run in runs) == sorted(expected)


# -- two deliveries of one run ----------------------------------------------------------


@pytest.mark.parametrize("handed_by", ["release", "sweeper"])
def test_a_parked_run_whose_copy_took_a_free_permit_is_not_handed_a_second_one(
    broker: RedisServer, handed_by: str
) -> None:
    """A run parked behind two holders; one holder's lease runs out (its host died), and
    before anyone serves the parked run another copy of its message (a duplicate publish,
    a fallback copy) takes the free permit and runs. The next hand-over must not give the
    parked entry of that same run a permit: its envelope would be sent, and the second
    copy would take the handed permit up while the first still runs."""
    r = broker.client()
    sem = keys_of("t")
    first, second = permit("h1"), permit("h2")
    assert first.take() and second.take()
    parked = permit("X")
    assert parked.park(signed_parked("X"), keep_for=60) is not True
    first.close()
    r.delete(sem.permit("h1"))  # h1's lease ran out
    running = permit("X")  # another delivery of run X
    assert running.take()
    token = running.token
    if handed_by == "release":
        second.finish(hold=0, done_ttl=60)
    else:
        second.close()
        r.delete(sem.permit("h2"))
        Sweeper(ca.app).sweep_once()
    # The running copy still holds its own permit, untouched...
    assert r.hget(sem.permit("X"), "X") == b"1"
    assert r.hget(sem.permit("X"), "__fence__") == str(token).encode()
    # ...and a copy of X delivered now is another delivery of a running run.
    with pytest.raises(OwnerRunning):
        permit("X").take()
    assert running.owned()
    running.finish(hold=0, done_ttl=60)
    assert holders(r) == set()


def test_a_retry_delivery_that_took_a_permit_is_not_joined_by_one_adopting_the_kept_one(
    broker: RedisServer,
) -> None:
    """lock_release_on_retry=False, and two deliveries of the retry's run (a redelivery):
    the first claims the kept-hold marker, and before its acquire lands, the second (the
    marker gone: nothing to adopt) takes a free permit. The first's adopting acquire must
    then find its run holding a permit (another delivery), not take the kept one over it."""
    r = broker.client()
    sem = keys_of("t")
    first_run = permit("X")
    assert first_run.take()
    first_run.finish(hold=30, done_ttl=60)  # kept for the retry, unrenewed
    second_delivery = permit("X~r1")
    assert second_delivery.take()  # a permit of its own (one was free)
    token = second_delivery.token
    adopting = permit("X~r1")
    with pytest.raises(OwnerRunning):
        adopting.take(adopt="X")
    assert r.hget(sem.permit("X~r1"), "__fence__") == str(token).encode()
    assert second_delivery.owned()


def test_a_parked_run_of_a_lower_limit_is_not_starved_by_later_runs_of_a_higher_one(
    broker: RedisServer,
) -> None:
    """Two task types share a key's budget, one with limit 4, one with limit 2. Three runs
    of the first hold permits; a run of the second parks (3 held, its limit 2). From then
    on, each time a holder finishes a new run of the first type arrives. First come, first
    served, the parked run is served once fewer than two are held; it must not wait for
    ever behind runs that came after it."""
    r = broker.client()
    sem = keys_of("starve")

    def call(owner: str, limit: int) -> TaskSemaphore:
        lock = lap.capped_at.run_lock(("starve", 0.0), {"limit": limit}, owner)
        assert isinstance(lock, TaskSemaphore)
        return lock

    running = [call(f"big-{i}", 4) for i in range(3)]
    assert all(run.take() for run in running)
    small = call("small", 2)
    assert small.park(signed_parked("small", "starve"), keep_for=60) is not True
    for i in range(5):
        if running:  # (later runs park behind it now: the ones running run out)
            running.pop(0).finish(hold=0, done_ttl=None)
        late = call(f"late-{i}", 4)
        if late.take():
            running.append(late)
        else:
            late.park(signed_parked(f"late-{i}", "starve"), keep_for=60)
    assert r.hexists(sem.permit("small"), "small"), (
        holders(r, "starve"),
        r.lrange(sem.line.parked, 0, -1),
    )
    for run in running:
        run.close()


def test_a_copy_whose_lease_lapsed_is_told_and_leaves_the_later_copys_permit_alone(
    broker: RedisServer,
) -> None:
    """Copy A of a run is paused past its lease (its permit gone); copy B of the same run
    (a redelivery) takes a permit. A's release must not free B's permit (B would run on
    without one, and an N+1st run take it), and A must be told it lost its own."""
    r = broker.client()
    sem = keys_of("lapse")
    options = dataclasses.replace(lap.capped.lock_options(), ttl=0.6)
    copy_a = permit("X", "lapse", options=options)
    copy_b = permit("X", "lapse", options=options)
    try:
        assert copy_a.take()
        r.delete(sem.permit("X"))  # A's lease ran out while it was paused
        assert copy_b.take() and copy_b.token != copy_a.token
        with contextlib.suppress(LockNotOwnedError):
            copy_a.finish(hold=0, done_ttl=60)
        assert r.hget(sem.permit("X"), "__fence__") == str(copy_b.token).encode()
        assert copy_b.owned() and not copy_b.lost.is_set()
        wait_until(copy_a.lost.is_set, timeout=3, what="A told of its lost permit")
    finally:
        copy_a.close()
        copy_b.close()


@pytest.mark.slow  # about 25 s
def test_two_copies_of_one_run_never_run_at_once_through_a_worker(
    broker: RedisServer, tmp_path: Path
) -> None:
    """The same, end to end: copy A of run X is parked at delivery behind two plain holders
    (code sharing the key's permits); one of them releases (a plain release serves no
    parked task; the sweeper does, later), copy B of X is delivered and takes that permit;
    the other holder releases, and the sweeper passes. The run runs once (it ran twice at
    once when the sweeper handed copy A's parked entry a permit over copy B's)."""
    r = broker.client()
    queue = "celery"
    plain = [RedisSemaphore(r, "cap:dup", 2, ttl=60, owner=f"plain-{i}") for i in range(2)]
    assert all(p.acquire(blocking=False) for p in plain)
    copy_a = lap.capped.apply_async(("dup", 8.0), queue=queue, task_id="run-x")
    assert (
        _fetch(
            queue, parker=Parker(lap.capped, ca.app, revoked=set(), seen=EveryKeySeen())
        ).headers["id"]
        == "run-x"
    )
    assert r.lrange(keys_of("dup").line.parked, 0, -1) == [b"run-x"]
    plain[0].release()
    lap.capped.apply_async(("dup", 8.0), queue=queue, task_id="run-x")  # copy B
    # A long lease: the sweeper passes every 5 s, so copy B is served long before.
    proc = worker(
        broker.url, tmp_path / "w.log", concurrency=3, app=APP, env={"REDISLOCK_TEST_TTL": "30"}
    )
    try:
        wait_until(lambda: r.llen("attack:started:dup") == 1, timeout=30)
        plain[1].release()
        copy_a.get(timeout=60)
        time.sleep(10.0)  # a sweeper pass (5 s) and a whole second run (8 s)
        started = [x.decode().split()[0] for x in r.lrange("attack:started:dup", 0, -1)]
        assert started == ["run-x"], proc.text()[-3000:]
        assert r.llen(keys_of("dup").line.parked) == 0  # copy A's entry went with B's take
    finally:
        proc.kill()  # everything was checked while it ran


def test_duplicate_copies_of_limited_runs_run_once_each_and_never_beyond_the_limit(
    broker: RedisServer, tmp_path: Path
) -> None:
    """Copies of each run (the same task id published again) arrive before it starts,
    while it runs and right as it finishes: each run runs once, at most two at once, and
    two at once is reached; afterwards no permit is held."""
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=6, app=APP)
    try:
        ids = [f"dup-{i}" for i in range(5)]
        results = [lap.capped.apply_async(("dups", 0.4), task_id=i) for i in ids]
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # copies all through the runs
            for i in ids:
                lap.capped.apply_async(("dups", 0.4), task_id=i)
            time.sleep(0.15)
        for result in results:
            result.get(timeout=60)
        # Every copy is parked, re-queued (another delivery runs) or dropped (done).
        wait_until(lambda: r.llen("celery") == 0, timeout=30, what="the queue drained")
        time.sleep(2.0)  # re-queued copies (0.5 s at most) come back and find the runs done
        runs = runs_of(r, "dups")
        ran_once_each(runs, ids)
        check_limits(runs)
        assert most_at_once(runs) == 2
        assert "another delivery of this task" in proc.text() or "duplicate delivery" in proc.text()
        wait_until(lambda: holders(r, "dups") == set(), timeout=10)
    finally:
        proc.kill()  # everything was checked while it ran


@pytest.mark.slow  # ~10 s; the mutex's redelivery test and in-process duplicates stay default
def test_a_run_redelivered_after_the_visibility_timeout_runs_once(
    broker: RedisServer, tmp_path: Path
) -> None:
    """acks_late with a visibility timeout shorter than the runs: each running run's message
    is delivered again while it runs (another delivery of the run: re-queued, then found
    done). Three runs on one key, limit 2: each once, never three at once."""
    r = broker.client()
    env = {"REDISLOCK_TEST_TTL": "3", "REDISLOCK_TEST_VT": "1.5"}
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP, env=env)
    try:
        results = [lap.capped.delay("vt", 3.5) for _ in range(3)]
        for result in results:
            result.get(timeout=60)
        time.sleep(1.0)  # room for a late copy to start, had it been let in
        runs = runs_of(r, "vt")
        ran_once_each(runs, [result.id for result in results])
        check_limits(runs)
        assert most_at_once(runs) == 2
        assert "held by another delivery of this task" in proc.text()  # the copies were seen
    finally:
        proc.kill()  # everything was checked while it ran


# -- retries and replacement -----------------------------------------------------------


@pytest.mark.slow  # ~8 s; adoption itself is tested in process (test_limits, this file)
def test_a_retry_adopts_the_kept_permit_once_and_its_redelivered_copy_does_not(
    broker: RedisServer, tmp_path: Path
) -> None:
    """lock_release_on_retry=False: the first run keeps its permit for its retry, which
    adopts it (same token) and works past the visibility timeout, so its message comes
    again: that copy must not adopt it too, nor take a second permit. Two other runs share
    the key meanwhile: never more than two at once."""
    r = broker.client()
    env = {"REDISLOCK_TEST_TTL": "3", "REDISLOCK_TEST_VT": "2"}
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP, env=env)
    try:
        retried = lap.capped_retry_keeping.delay("retry", 4.5)
        wait_until(lambda: r.llen("attack:attempts:retry") >= 2, timeout=30)
        others = [lap.capped.delay("retry", 1.0) for _ in range(2)]
        assert retried.get(timeout=60) is not None
        for result in others:
            result.get(timeout=60)
        time.sleep(2.0)
        attempts = [x.decode().split() for x in r.lrange("attack:attempts:retry", 0, -1)]
        assert [a[0] for a in attempts] == ["0", "1"], attempts  # the retry ran once
        assert attempts[0][1] == attempts[1][1]  # the kept permit, its token
        runs = runs_of(r, "retry")
        ran_once_each(runs, [f"{retried.id}~r1", *(o.id for o in others)])
        check_limits([run for run in runs if run.run != f"{retried.id}~r1"])
        assert most_at_once(runs) <= 2
        assert "held by another delivery of this task" in proc.text()  # the copy was seen
        wait_until(lambda: holders(r, "retry") == set(), timeout=10)
    finally:
        proc.kill()  # everything was checked while it ran


def test_retry_without_throw_and_replace_run_each_run_once_and_free_every_permit(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        no_throw = lap.capped_retry_no_throw.delay("canvas", 0.3)
        replaced = lap.capped_replace.delay("canvas")
        busy = [lap.capped.delay("canvas", 0.3) for _ in range(3)]
        assert replaced.get(timeout=60) == "step 2"
        assert no_throw.get(timeout=60) in ("first", "retried")
        for result in busy:
            result.get(timeout=60)
        wait_until(lambda: len(runs_of(r, "canvas")) == 5, timeout=30)
        time.sleep(1.0)
        runs = runs_of(r, "canvas")
        ran_once_each(runs, [no_throw.id, f"{no_throw.id}~r1", *(b.id for b in busy)])
        check_limits(runs)
        steps = [x.decode().split() for x in r.lrange("attack:steps:canvas", 0, -1)]
        assert [s[0] for s in steps] == ["0", "1", "2"]  # each step once
        assert len({s[2] for s in steps}) == 3  # each a permit of its own
        wait_until(lambda: holders(r, "canvas") == set(), timeout=10)
        assert r.keys(keys_of("canvas").permits + b"*") == []
    finally:
        proc.kill()  # everything was checked while it ran


# -- reserved names, hostile data ----------------------------------------------------------


def test_a_run_whose_task_id_is_a_permit_field_frees_its_permit(broker: RedisServer) -> None:
    r = broker.client()
    sem = keys_of("t")
    try:
        run = permit("__limit__")
    except LockConfigurationError:
        return  # refused like "__fence__": fine
    assert run.take()
    run.finish(hold=0, done_ttl=60)
    assert holders(r) == set() and not r.exists(sem.permit("__limit__"))
    assert r.exists(sem.line.done("__limit__"))
    plain = RedisSemaphore(r, "plain", 2, owner="__limit__")
    assert plain.acquire(blocking=False)
    plain.release()
    assert not r.exists(SemaphoreKeys.for_name("plain").permit("__limit__"))


def test_a_release_that_fails_on_junk_does_not_keep_the_permit_renewed(
    broker: RedisServer,
) -> None:
    """A key of the wrong type where a limited run's release writes (whoever may write the
    prefix wrote it, with a short TTL). The release may fail, but once the junk is gone
    the permit must come back within its lease: not renewed by a run that is over."""
    r = broker.client()
    sem = keys_of("junkrel")
    options = dataclasses.replace(lap.capped.lock_options(), ttl=1.0)
    run = permit("run", "junkrel", options=options)
    assert run.take()
    r.set(sem.line.parked_limit, "junk", px=300)
    try:
        # Refused: acceptable, as long as the permit is not held on for ever.
        with contextlib.suppress(redis.ResponseError):
            run.finish(hold=0, done_ttl=60)
        wait_until(lambda: not r.exists(sem.line.parked_limit), timeout=5)
        wait_until(lambda: not r.exists(sem.permit("run")), timeout=5, what="the permit ran out")
        assert permit("next", "junkrel", options=options).take()
    finally:
        run.close()


@pytest.mark.parametrize(
    "junk", ["abc", "-2", "0", "2.5", "1e3", "0x10", "99999999999999999999", "2147483648", ""]
)
def test_a_junk_parked_limit_counts_as_one_and_never_wedges_the_key(
    broker: RedisServer, junk: str
) -> None:
    r = broker.client()
    sem = keys_of("junk")
    first, second = permit("h1", "junk"), permit("h2", "junk")
    assert first.take() and second.take()
    parked = permit("p", "junk")
    assert parked.park(signed_parked("p", "junk"), keep_for=60) is not True
    r.hset(sem.line.parked_limit, "p", junk)
    assert first.finish(hold=0, done_ttl=None) is None  # one held: not fewer than 1
    assert r.lrange(sem.line.parked, 0, -1) == [b"p"]
    handed = second.finish(hold=0, done_ttl=None)  # none held: handed
    assert handed is not None and handed.task_id == b"p"
    assert parked.take() and holders(r, "junk") == {"p"}
    assert not r.exists(sem.line.parked_limit) or not r.hexists(sem.line.parked_limit, "p")
    parked.finish(hold=0, done_ttl=None)
    assert holders(r, "junk") == set()


def test_junk_of_the_wrong_type_under_a_semaphore_is_refused_and_does_not_outlive_itself(
    broker: RedisServer,
) -> None:
    """A holders set that is a string, a listed holder whose permit is a list: a run's
    attempt fails without taking anything (it does not run), and once the junk's TTL
    ends the key works at its full limit."""
    r = broker.client()
    sem = keys_of("wrongtype")
    r.set(sem.line.lock, "not a set", px=400)
    run = permit("a", "wrongtype")
    with pytest.raises(redis.ResponseError):
        run.take()
    with pytest.raises(redis.ResponseError):
        run.park(signed_parked("a", "wrongtype"), keep_for=60)
    assert not r.exists(sem.permit("a")) and not r.exists(sem.line.parked)
    wait_until(lambda: not r.exists(sem.line.lock), timeout=5)
    # A listed holder whose "permit" is a list with a TTL: it counts until it ends.
    r.sadd(sem.line.lock, "ghost", "gone")
    r.rpush(sem.permit("ghost"), "x")
    r.pexpire(sem.permit("ghost"), 400)
    assert run.take()
    assert not permit("b", "wrongtype").take()  # "ghost" and "a": full
    assert holders(r, "wrongtype") == {"ghost", "a"}  # "gone" (no permit) dropped
    wait_until(lambda: permit("b", "wrongtype").take(), timeout=5)
    assert holders(r, "wrongtype") == {"a", "b"}
    assert run.token == 1  # the refused attempts took no token


def test_an_unsigned_envelope_parked_under_a_semaphore_is_refused_and_the_permit_passes_on(
    broker: RedisServer, tmp_path: Path
) -> None:
    """Whoever may write the prefix parks a broker envelope in exactly the form a hand-over
    pushes itself (but with a made-up MAC) behind two running limited runs, then a real run
    parks behind it. The release pushes the forgery; the worker that fetches it refuses it
    and passes the permit on to the real run, which runs."""
    r = broker.client()
    sem = keys_of("forged")
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        running = [lap.capped.delay("forged", 1.5) for _ in range(2)]
        wait_until(lambda: r.llen("attack:started:forged") == 2, timeout=30)
        lap.capped.apply_async(("evil", 0.0), queue="scratch", task_id="evil")
        envelope = json.loads(r.rpop("scratch"))
        placeholder = "rltag0123456789abcdef"
        envelope["properties"]["delivery_tag"] = placeholder
        envelope["headers"]["redislock_parked"] = {
            "lock": sem.line.lock.decode(),
            "list": "celery",
            "mac": "0" * 64,
        }
        # Its arguments render another key: the script pushes it all the same (it only
        # checks the form); the worker refuses it.
        message = f"Ecelery\n{placeholder}\n{json.dumps(envelope)}"
        r.rpush(sem.line.parked, "evil")
        r.hset(sem.line.parked_messages, "evil", message)
        r.hset(sem.line.parked_limit, "evil", "2")
        real = lap.capped.delay("forged", 0.1)
        wait_until(lambda: r.llen(sem.line.parked) == 2, timeout=30)
        for result in [*running, real]:
            result.get(timeout=60)
        wait_until(lambda: "refused the parked message of task 'evil'" in proc.text(), timeout=10)
        text = proc.text()
        runs = runs_of(r, "forged")
        ran_once_each(runs, [*(x.id for x in running), real.id])
        assert runs_of(r, "evil") == []
        assert "[evil] received" not in text
        wait_until(lambda: holders(r, "forged") == set(), timeout=10)
        assert r.hlen(sem.line.parked_messages) == 0
    finally:
        proc.kill()  # everything was checked while it ran


# -- limits that change between calls ------------------------------------------------------


def test_a_lowered_limit_waits_for_permits_to_be_released_and_a_raised_one_fills_up(
    broker: RedisServer,
) -> None:
    r = broker.client()
    sem = keys_of("vary")
    three = [lap.capped_at.run_lock(("vary", 0.0), {"limit": 3}, f"big-{i}") for i in range(3)]
    assert all(run.take() for run in three)
    lowered = lap.capped_at.run_lock(("vary", 0.0), {"limit": 2}, "low")
    assert isinstance(lowered, TaskSemaphore) and lowered.limit == 2
    assert lowered.park(signed_parked("low", "vary"), keep_for=60) is not True
    assert r.hget(sem.line.parked_limit, "low") == b"2"
    assert three[0].finish(hold=0, done_ttl=None) is None  # two held: not fewer than 2
    handed = three[1].finish(hold=0, done_ttl=None)  # one held: handed
    assert handed is not None and handed.task_id == b"low" and lowered.take()
    # Raised to 4 for a new call: it fills up to 4, the parked one still waits its turn.
    raised = [lap.capped_at.run_lock(("vary", 0.0), {"limit": 4}, f"up-{i}") for i in range(3)]
    assert [run.take() for run in raised] == [True, True, False]
    assert len(holders(r, "vary")) == 4
    for run in (three[2], lowered, raised[0], raised[1]):
        run.finish(hold=0, done_ttl=None)
    assert raised[2].take()  # its place in line: granted a freed permit, or a free one
    raised[2].finish(hold=0, done_ttl=None)
    assert holders(r, "vary") == set()


def test_runs_with_mixed_limits_on_one_key_each_respect_their_own_limit(
    broker: RedisServer, tmp_path: Path
) -> None:
    """Calls of one key whose limit comes from the call (1, 2 or 3), parked and handed over
    by a real worker: every run once, and each took its permit while fewer than its own
    limit were held."""
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=6, app=APP)
    try:
        limits = [3, 1, 2, 3, 3, 1, 2, 2, 3, 1]
        results = [lap.capped_at.delay("mixed", 0.3, limit=n) for n in limits]
        for result in results:
            result.get(timeout=90)
        runs = runs_of(r, "mixed")
        ran_once_each(runs, [result.id for result in results])
        assert sorted(run.limit for run in runs) == sorted(limits)
        check_limits(runs)
        assert most_at_once(runs) >= 2  # they really ran side by side
        wait_until(lambda: holders(r, "mixed") == set(), timeout=10)
    finally:
        proc.kill()  # everything was checked while it ran


# -- the sweeper ---------------------------------------------------------------------------


def test_the_sweeper_hands_out_free_permits_up_to_the_limit_and_resends_a_lost_one(
    broker: RedisServer,
) -> None:
    r = broker.client()
    queue = "limits-attack-sweep"
    sem = keys_of("sweep")
    held = [permit(f"h{i}", "sweep") for i in range(2)]
    assert all(h.take() for h in held)
    sent = [lap.capped.apply_async(("sweep", 0.0), queue=queue) for _ in range(4)]
    parker = Parker(lap.capped, ca.app, revoked=set(), seen=EveryKeySeen())
    for result in sent:
        assert _fetch(queue, parker=parker).headers["id"] == result.id
    sweeper = Sweeper(ca.app)
    assert sweeper.sweep_once() == 0
    # One holder's lease runs out: one permit free, one handed out.
    held[0].close()
    r.delete(sem.permit("h0"))
    assert sweeper.sweep_once() == 1
    assert sweeper.sweep_once() == 0  # never beyond the limit
    assert holders(r, "sweep") == {"h1", sent[0].id}
    # The other's too: one more, in arrival order; two handed, two parked.
    held[1].close()
    r.delete(sem.permit("h1"))
    assert sweeper.sweep_once() == 1 and sweeper.sweep_once() == 0
    assert holders(r, "sweep") == {sent[0].id, sent[1].id}
    assert [p.decode() for p in r.lrange(sem.line.parked, 0, -1)] == [s.id for s in sent[2:]]
    assert r.hget(sem.permit(sent[0].id), sent[0].id) == b"0"  # handed, not started
    # Both hand-overs' messages are lost on their way (fetched, never run): once stale,
    # the sweeper sends each again, and a re-send is no new permit.
    lost = {_fetch(queue).headers["id"] for _ in range(2)}
    assert lost == {sent[0].id, sent[1].id} and r.llen(queue) == 0
    time.sleep(sweeper.ttl / 2 + 0.3)
    assert sweeper.sweep_once() == 2
    assert {_fetch(queue).headers["id"] for _ in range(2)} == lost
    assert holders(r, "sweep") == lost
    # The handed runs take their permits up and finish: each hands its permit on to the
    # next parked run, in order (pushed to its queue by the release itself, or sent here).
    for result in sent[:2]:
        run = permit(result.id, "sweep")
        assert run.take()
        deliver_handed_over(ca.app, run.finish(hold=0, done_ttl=60), 3000)
    assert holders(r, "sweep") == {sent[2].id, sent[3].id} and r.llen(sem.line.parked) == 0
    assert {_fetch(queue).headers["id"] for _ in range(2)} == {sent[2].id, sent[3].id}
    for result in sent[2:]:
        run = permit(result.id, "sweep")
        assert run.take()
        assert run.finish(hold=0, done_ttl=60) is None
    assert holders(r, "sweep") == set()
    assert sweeper.sweep_once() == 0  # nothing parked or handed: the registry forgets it
    assert r.zscore(parked_registry("redislock:"), sem.line.lock) is None


# -- revoke ----------------------------------------------------------------------------------


def test_a_revoked_parked_limited_task_passes_its_permit_on(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    sem = keys_of("rv")
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, app=APP)
    try:
        running = [lap.capped.delay("rv", 1.5) for _ in range(2)]
        wait_until(lambda: r.llen("attack:started:rv") == 2, timeout=30)
        dropped = lap.capped.delay("rv", 0.1)
        after = [lap.capped.delay("rv", 0.1) for _ in range(2)]
        wait_until(lambda: r.llen(sem.line.parked) == 3, timeout=30)
        dropped.revoke()
        for result in [*running, *after]:
            result.get(timeout=30)  # not stuck behind the revoked task's unstarted permit
        assert dropped.state == "REVOKED"
        runs = runs_of(r, "rv")
        ran_once_each(runs, [*(x.id for x in running), *(a.id for a in after)])
        check_limits(runs)
        assert "it was dropped before it ran (revoked)" in proc.text()
        wait_until(lambda: holders(r, "rv") == set(), timeout=10)
    finally:
        proc.kill()  # everything was checked while it ran


# -- Redis restarts ----------------------------------------------------------------------------


@pytest.mark.slow  # about 15 s
def test_a_restart_of_the_lock_redis_with_aof_mid_drain_loses_nothing(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """Locks in a Redis of their own with AOF (fsync always), SIGKILLed and restarted while
    two runs hold the permits and four are parked (with their fallback copies in the
    broker): every run runs once, never three at once, and no permit is left held.

    (Not the broker's own Redis: a worker whose Redis broker is still down when its
    consumer reconnects can die of kombu's "Unrecoverable error: AttributeError('NoneType'
    object has no attribute 'hostname')" while restoring its unacked messages, which made
    that variant of this test fail at random; it is Celery's, not this package's.)"""
    locks = redis_server_factory(appendonly=True)
    r = broker.client()
    proc = worker(
        broker.url,
        tmp_path / "w.log",
        concurrency=4,
        app=APP,
        env={"REDISLOCK_TEST_LOCK_URL": locks.url},
    )
    try:
        results = [lap.capped.delay("aof", 1.5) for _ in range(6)]
        wait_until(lambda: locks.client().llen(keys_of("aof").line.parked) >= 3, timeout=30)
        locks.restart()  # SIGKILL, then start again on its port from the AOF
        for result in results:
            result.get(timeout=60)
        time.sleep(2.0)  # the fallback copies come and find their runs done
        runs = runs_of(r, "aof")
        ran_once_each(runs, [result.id for result in results])
        check_limits(runs)
        assert most_at_once(runs) == 2
        lr = locks.client()
        wait_until(lambda: holders(lr, "aof") == set(), timeout=15)
    finally:
        proc.kill()  # everything was checked while it ran


@pytest.mark.slow  # about 20 s
def test_a_restart_of_a_separate_lock_redis_without_persistence_loses_no_parked_run(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """Locks in a Redis of their own, without persistence: runs parked behind two plain
    holders lose their parked records (and the holders their permits) in a restart; the
    fallback copies kept in the broker run each once, never more than two at once."""
    locks = redis_server_factory()
    r = broker.client()
    lr = locks.client()
    proc = worker(
        broker.url,
        tmp_path / "w.log",
        concurrency=4,
        app=APP,
        env={"REDISLOCK_TEST_TTL": "2", "REDISLOCK_TEST_LOCK_URL": locks.url},
    )
    try:
        plain = [RedisSemaphore(lr, "cap:restart", 2, ttl=60, owner=f"p{i}") for i in range(2)]
        assert all(p.acquire(blocking=False) for p in plain)
        results = [lap.capped.delay("restart", 0.5) for _ in range(5)]
        wait_until(lambda: lr.llen(keys_of("restart").line.parked) == 5, timeout=30)
        for p in plain:
            p.close()
        locks.restart()
        assert not lr.exists(keys_of("restart").line.parked)
        for result in results:
            result.get(timeout=60)
        time.sleep(2.0)
        runs = runs_of(r, "restart")
        ran_once_each(runs, [result.id for result in results])
        check_limits(runs)
        assert most_at_once(runs) == 2
        assert "fallback copy" in proc.text()
    finally:
        proc.kill()  # everything was checked while it ran


# -- a child killed while its permit was handed over --------------------------------------------


def test_a_child_killed_right_after_taking_a_handed_permit_frees_it_for_the_next(
    broker: RedisServer, tmp_path: Path
) -> None:
    """A run handed its permit by a release is SIGKILLed as soon as it starts: the worker's
    main process frees that permit and hands it on; its message, rejected back, runs
    again later; the other parked runs run; nobody goes beyond two."""
    r = broker.client()
    proc = worker(
        broker.url, tmp_path / "w.log", concurrency=4, app=APP, env={"REDISLOCK_TEST_TTL": "60"}
    )
    try:
        first = [lap.capped.delay("kill", 0.8) for _ in range(2)]
        wait_until(lambda: r.llen("attack:started:kill") == 2, timeout=30)
        victim = lap.capped.delay("kill", 2.0)
        rest = [lap.capped.delay("kill", 0.2) for _ in range(2)]
        wait_until(lambda: r.llen(keys_of("kill").line.parked) == 3, timeout=30)
        wait_until(
            lambda: any(
                x.decode().startswith(victim.id) for x in r.lrange("attack:started:kill", 0, -1)
            ),
            timeout=30,
        )
        line = next(
            x.decode().split()
            for x in r.lrange("attack:started:kill", 0, -1)
            if x.decode().startswith(victim.id)
        )
        os.kill(int(line[2]), signal.SIGKILL)
        for result in [*first, *rest, victim]:
            result.get(timeout=60)
        runs = runs_of(r, "kill")
        ran_once_each(runs, [*(f.id for f in first), *(x.id for x in rest), victim.id])
        check_limits(runs)
        assert "its worker process died" in proc.text()
        wait_until(lambda: holders(r, "kill") == set(), timeout=10)
    finally:
        proc.kill()  # everything was checked while it ran
