"""LockedTask with real `celery worker` processes (prefork) against a real Redis broker."""

from __future__ import annotations

import os
import random
import signal
from collections import defaultdict
from collections.abc import Iterator

import pytest
import redis

from celery_redislock import FencedResource
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import CeleryProcess, wait_until, worker
from ..conftest import empty


@pytest.fixture(scope="module")
def broker(celery_broker: RedisServer) -> RedisServer:
    """The session's Celery Redis, emptied of what earlier modules left in it."""
    return empty(celery_broker)


@pytest.fixture(scope="module")
def r(broker: RedisServer) -> Iterator[redis.Redis]:
    client = broker.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def shared_worker(
    broker: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryProcess]:
    """A prefork worker (concurrency 4, lock TTL 30 s) shared by this module's tests."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    proc = worker(broker.url, log, env={"REDISLOCK_TEST_TTL": "30"})
    yield proc
    proc.kill()


def sections(r: redis.Redis, kind: str) -> list[tuple[str, str, float, float]]:
    found = []
    for raw in r.lrange(f"sections:{kind}", 0, -1):
        key, task_id, enter, leave = raw.decode().split()
        found.append((key, task_id, float(enter), float(leave)))
    return found


def lock_key(name: str) -> str:
    return "redislock:{" + name + "}"


def test_payment_settlement_is_exact_and_serialised_per_account(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    rng = random.Random(7)
    payments = [(rng.randrange(5), rng.randrange(1, 100)) for _ in range(300)]
    results = [ca.settle.delay(account, amount) for account, amount in payments]
    for result in results:
        result.get(timeout=120)
    expected: dict[int, int] = defaultdict(int)
    for account, amount in payments:
        expected[account] += amount
    balances = {a: int(r.get(f"balance:{a}") or 0) for a in expected}
    assert balances == dict(expected)  # no lost update

    seen = sections(r, "settle")
    assert len(seen) == len(payments)  # it saw every critical section...
    assert sorted(t for _, t, _, _ in seen) == sorted(res.id for res in results)  # each ran once
    by_account: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, _, enter, leave in seen:
        by_account[key].append((enter, leave))
    for spans in by_account.values():  # ...and none overlapped another on its account
        spans.sort()
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
    assert not r.keys("redislock:{account:*}")  # every lock was released


def test_without_the_lock_updates_are_lost(r: redis.Redis, shared_worker: CeleryProcess) -> None:
    """The control experiment: the same workload unlocked really does lose updates."""
    results = [ca.settle_unlocked.delay(900 + i % 2, 1) for i in range(60)]
    for result in results:
        result.get(timeout=60)
    total = int(r.get("balance:900") or 0) + int(r.get("balance:901") or 0)
    assert total < 60


def test_worker_child_sigkilled_lock_freed_task_redelivered_and_fenced(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    result = ca.hold_for.delay("killed", 1.5, fence=True)  # killed at its start
    first = wait_until(lambda: r.lindex("started:killed", 0))
    _, token, pid = first.decode().split()
    os.kill(int(pid), signal.SIGKILL)
    # The worker's main process releases at once (the lease is 30 s)...
    wait_until(lambda: not r.hexists(lock_key("job:killed"), result.id), timeout=10)
    # ...the message is redelivered (acks_late + reject_on_worker_lost) and completes once.
    assert result.get(timeout=60) == int(token) + 1
    starts = [line.decode().split() for line in r.lrange("started:killed", 0, -1)]
    assert [s[0] for s in starts] == [result.id, result.id]
    assert int(starts[1][1]) > int(token)
    # The killed attempt's late write, with its older token, cannot land.
    assert FencedResource(r, "res:killed").write(int(token), "res:killed:value", "stale") is False
    assert int(r.get("res:killed:value") or 0) == int(starts[1][1])


def test_hard_time_limit_frees_the_lock_at_once(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    result = ca.exceed_hard_limit.delay("hard")
    wait_until(lambda: r.llen("started:hard"))
    wait_until(lambda: r.exists(lock_key("job:hard")))
    wait_until(lambda: not r.exists(lock_key("job:hard")), timeout=15)  # lease is 30 s
    assert result.state in {"FAILURE", "PENDING", "STARTED"}


def test_soft_time_limit_releases_from_the_task(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    result = ca.exceed_soft_limit.delay("soft")
    with pytest.raises(Exception, match="SoftTimeLimitExceeded"):
        result.get(timeout=30, propagate=True)
    assert not r.exists(lock_key("job:soft"))


def test_revoke_terminate_frees_the_lock_at_once(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    result = ca.hold_for.delay("revoked", 60.0)
    wait_until(lambda: r.llen("started:revoked"))
    result.revoke(terminate=True)
    wait_until(lambda: not r.exists(lock_key("job:revoked")), timeout=15)


def test_exception_and_reject_release_the_lock(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    failed = ca.fail.delay("failing")
    with pytest.raises(RuntimeError):
        failed.get(timeout=30)
    rejected = ca.reject.delay("rejecting")
    wait_until(lambda: rejected.state == "FAILURE", timeout=30)
    assert not r.exists(lock_key("job:failing")) and not r.exists(lock_key("job:rejecting"))


def test_retry_releases_by_default(r: redis.Redis, shared_worker: CeleryProcess) -> None:
    result = ca.retry_once.delay("retried")
    assert result.get(timeout=30) == "done"
    attempts = [a.decode() for a in r.lrange("attempts:retried", 0, -1)]
    assert attempts == ["0 True", "1 True"]
    assert not r.exists(lock_key("job:retried"))


def test_retry_can_keep_the_lock_for_the_next_attempt(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    result = ca.retry_keeping.delay("kept")
    wait_until(lambda: r.llen("attempts:kept") == 1)
    # Between the attempts the lock stays with this task id.
    assert r.hexists(lock_key("job:kept"), result.id)
    assert ca.raise_if_busy.delay("kept").get(timeout=30, propagate=False) is not None
    assert result.get(timeout=30) == "done"
    attempts = [a.decode() for a in r.lrange("attempts:kept", 0, -1)]
    assert attempts == ["0 1", "1 1"]  # adopted, not double-held
    assert not r.exists(lock_key("job:kept"))


def test_contention_policies(r: redis.Redis, shared_worker: CeleryProcess) -> None:
    holder = ca.hold_for.delay("busy", 2.0)
    wait_until(lambda: r.llen("started:busy"))
    skipped = ca.skip_if_busy.delay("busy")
    raised = ca.raise_if_busy.delay("busy")
    waited = ca.wait_if_busy.delay("busy")
    # SKIPPED is a ready state (celery_redislock.celery.ready): .get() returns its meta.
    assert skipped.get(timeout=30) == {"lock": "job:busy"}
    assert skipped.state == "SKIPPED" and skipped.ready()
    with pytest.raises(Exception, match=r"LockContendedError|is held by another task"):
        raised.get(timeout=30)
    assert waited.get(timeout=30) == "ran"
    holder.get(timeout=30)


def test_a_second_delivery_of_a_running_task_does_not_run_twice(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    first = ca.hold_for.delay("dup", 2.0)
    wait_until(lambda: r.llen("started:dup"))
    # Exactly what a visibility-timeout redelivery produces: the same message again.
    ca.hold_for.apply_async(("dup", 2.0), task_id=first.id)
    assert first.get(timeout=30) is not None
    # The copy was re-queued; when it comes back it finds the task done and does nothing.
    wait_until(lambda: "duplicate delivery ignored" in shared_worker.text(), timeout=30)
    assert r.llen("started:dup") == 1


def test_a_value_that_cannot_be_rendered_fails_the_task_and_takes_nothing(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    result = ca.bad_value.delay({"name": "no id here"})
    with pytest.raises(Exception, match="user"):
        result.get(timeout=30)
    assert not r.keys("redislock:{user:*")


def test_send_task_by_name_is_locked_too(r: redis.Redis, shared_worker: CeleryProcess) -> None:
    results = [ca.app.send_task("tests.celery_app.settle", args=[950, 1]) for _ in range(20)]
    for result in results:
        result.get(timeout=60)
    assert int(r.get("balance:950") or 0) == 20


def test_a_chain_keeps_its_links_through_parking_and_hand_over(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    from celery import chain

    blocker = ca.hold_for.delay("chain", 1.0)
    wait_until(lambda: r.llen("started:chain"))
    steps = chain(ca.hold_for.si("chain", 0.01), ca.hold_for.si("chain", 0.01)).delay()
    assert steps.get(timeout=60) is not None  # the last link ran...
    assert steps.parent is not None and steps.parent.get(timeout=5) is not None
    blocker.get(timeout=30)
    assert r.llen("started:chain") == 3  # ...after the first, which had to park and wait
    assert "parked behind the holder of 'job:chain'" in shared_worker.text()


# ------------------------------------------------------------------ canvas and nested calls


def test_retry_without_throw_runs_the_retry(r: redis.Redis, shared_worker: CeleryProcess) -> None:
    """``self.retry(throw=False)``: the first run returns and the retry (the same task id)
    still runs, as plain Celery runs it; it used to be dropped as a duplicate of the run
    that had just finished."""
    result = ca.retry_no_throw.delay("nothrow")
    wait_until(lambda: r.llen("attempts:nothrow") == 2, timeout=30)
    attempts = [a.decode().split() for a in r.lrange("attempts:nothrow", 0, -1)]
    assert [a[0] for a in attempts] == ["0", "1"]
    assert int(attempts[1][1]) > int(attempts[0][1])  # a new holding, a newer token
    # Both runs store a SUCCESS under the one task id, in whichever order they end (as
    # without a lock: the first run's result is stored after its release).
    wait_until(lambda: result.state == "SUCCESS", timeout=30)
    assert result.result in ("first", "retried")
    wait_until(lambda: not r.exists(lock_key("job:nothrow")), timeout=10)


@pytest.mark.parametrize("task", ["replace_me", "replace_with_other"])
def test_replace_with_a_task_on_the_same_key_runs_it(
    r: redis.Redis, shared_worker: CeleryProcess, task: str
) -> None:
    """``self.replace()`` freezes the replacement with the current task id; it used to be
    taken for a finished duplicate and ignored, its result PENDING for ever."""
    name = f"rep-{task}"
    result = getattr(ca, task).delay(name)
    expected = "step 2" if task == "replace_me" else None
    got = result.get(timeout=30)
    if expected is not None:
        assert got == expected
        steps = [s.decode().split() for s in r.lrange(f"steps:{name}", 0, -1)]
        assert [s[0] for s in steps] == ["0", "1", "2"]
        assert {s[1] for s in steps} == {result.id}  # one task id, three runs
    else:
        assert isinstance(got, int)  # hold_for's token: the replacement ran
        assert r.llen(f"started:{name}") == 1
    wait_until(lambda: not r.exists(lock_key(f"job:{name}")), timeout=10)


@pytest.mark.parametrize(
    ("how", "inner"), [("self", None), ("self", "elsewhere"), ("other", None), ("apply", None)]
)
def test_a_locked_task_called_inside_a_running_one_is_a_plain_call(
    r: redis.Redis, shared_worker: CeleryProcess, how: str, inner: str | None
) -> None:
    """Nested calls run under the caller's ownership: the same key re-enters (it used to
    abort the body with Ignore, or wait lock_wait and fail), another key is taken and
    given back, and ``self.lock`` is the caller's again afterwards (it used to stay the
    inner, released lock)."""
    name = f"nest-{how}-{inner}"
    result = ca.nest.delay(name, inner, how)
    got = result.get(timeout=30)
    records = [x.decode() for x in r.lrange(f"nested:{name}", 0, -1)]
    assert records[-1] == f"outer job:{name} {got}"
    inner_records = [x.decode() for x in r.lrange(f"nested:{inner or name}", 0, -1)]
    if how == "other":
        assert r.llen(f"started:{name}") == 1 and len(records) == 1
    else:
        assert got == "inner"
        assert inner_records[0] == f"inner job:{inner or name} True"
        assert len(records) == (2 if inner is None else 1) and len(inner_records) <= 2
    for key in {name, inner or name}:
        wait_until(lambda key=key: not r.exists(lock_key(f"job:{key}")), timeout=10)


@pytest.mark.parametrize("at", [0.0, 0.25, 0.48, 0.5, 0.52, 0.7])
def test_a_duplicate_delivered_at_any_point_of_a_run_never_runs_it_again(
    r: redis.Redis, shared_worker: CeleryProcess, at: float
) -> None:
    """The duplicate-delivery harness: the same message again (what a visibility-timeout
    redelivery produces) at a chosen point of a 0.5 s run — at its start, mid-way, just
    before, at and just after its release, and after it. The duplicate check used to be
    two round trips, and a run finishing between them left no done marker: the copy ran
    the work again."""
    import time as _time

    name = f"dup-at-{at}"
    first = ca.hold_for.delay(name, 0.5)
    wait_until(lambda: r.llen(f"started:{name}"), timeout=30)
    _time.sleep(at)
    copy = ca.hold_for.apply_async((name, 0.5), task_id=first.id)
    assert first.get(timeout=30) is not None
    # The copy is re-queued (the run still holds the lock) or finds the run done; either
    # way it comes back within the re-queue cap and never runs the body: it ends ignored
    # as a duplicate (or dropped, had it run out of re-queues). Had it run the body, its
    # start would be recorded first.
    wait_until(lambda: not r.exists(lock_key(f"job:{name}")), timeout=15)
    ended = (f"[{first.id}] already finished under", f"[{first.id}] gave up after")
    wait_until(
        lambda: (
            any(line in shared_worker.text() for line in ended) or r.llen(f"started:{name}") > 1
        ),
        timeout=30,
        what="the copy's end",
    )
    assert r.llen(f"started:{name}") == 1
    assert copy.state == "SUCCESS"
    assert not r.exists(lock_key(f"job:{name}"))


def test_groups_and_chords_over_one_key_run_each_member_once_in_turn(
    r: redis.Redis, shared_worker: CeleryProcess
) -> None:
    from celery import chord, group

    amounts = list(range(1, 9))
    grouped = group(ca.settle.s(9101, a, 0.01) for a in amounts).delay()
    assert sorted(grouped.get(timeout=60))[-1] == sum(amounts)
    body = chord((ca.settle.s(9102, a, 0.01) for a in amounts), ca.biggest.s()).delay()
    assert body.get(timeout=60) == sum(amounts)  # the body ran after every member
    assert int(r.get("balance:9101")) == int(r.get("balance:9102")) == sum(amounts)
    for account in ("9101", "9102"):
        spans = sorted((e, x) for k, _, e, x in sections(r, "settle") if k == account)
        assert len(spans) == len(amounts)  # every member seen once
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))  # none overlapped
    assert not r.keys("redislock:{account:910*}")
