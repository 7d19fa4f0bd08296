"""``lock_limit``: at most N runs at once per key, with the mutex's guarantees — parking and
hand-over of permits, duplicate deliveries, the sweeper, validation — against real Redis
and real prefork workers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import LockConfigurationError, LockContendedError, RedisSemaphore
from celery_redislock._core import OwnerFinished, OwnerRunning
from celery_redislock._keyspace import SemaphoreKeys, parked_registry
from celery_redislock.celery.parking import Parker
from celery_redislock.celery.sweeper import Sweeper
from celery_redislock.celery.tasklock import TaskSemaphore, task_lock
from celery_redislock.task import LockedTask
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import EveryKeySeen, wait_until, worker
from .test_parking import _fetch

SEM = SemaphoreKeys.for_name("tenant:t")


def _permit(r: redis.Redis, owner: str, limit: int = 2, name: str = "tenant:t") -> TaskSemaphore:
    lock = task_lock(ca.app, name, task_id=owner, options=ca.tenant_job.lock_options(), limit=limit)
    assert isinstance(lock, TaskSemaphore)
    return lock


def _holders(r: redis.Redis, keys: SemaphoreKeys = SEM) -> set[str]:
    return {h.decode() for h in r.smembers(keys.line.lock)}


def _overlap(sections: list[tuple[float, float]]) -> int:
    """The most sections open at one instant."""
    events = sorted([(enter, 1) for enter, _ in sections] + [(leave, -1) for _, leave in sections])
    most = inside = 0
    for _at, step in events:
        inside += step
        most = max(most, inside)
    return most


def _sections(r: redis.Redis, tenant: str) -> list[tuple[str, float, float]]:
    found = []
    for line in r.lrange("sections:limit", 0, -1):
        key, task_id, enter, leave = line.decode().split()
        if key == tenant:
            found.append((task_id, float(enter), float(leave)))
    return found


# -- the task's permit on Redis -----------------------------------------------------


def test_a_run_takes_one_of_n_permits_and_the_next_parks(broker: RedisServer) -> None:
    r = broker.client()
    first, second, third = (_permit(r, f"run-{i}") for i in range(3))
    assert first.take() and second.take()
    assert _holders(r) == {"run-0", "run-1"}
    assert first.token is not None and second.token == first.token + 1
    assert not third.take()
    assert third.park("S-message", keep_for=60) is not True  # parked behind the two
    assert r.lrange(SEM.line.parked, 0, -1) == [b"run-2"]
    assert r.zscore(parked_registry("redislock:"), SEM.line.lock) is not None
    assert r.hget(SEM.line.parked_limit, "run-2") == b"2"  # its limit, for its hand-over
    # The first run's release hands its permit to the parked run (count 0, a fresh token).
    handed = first.finish(hold=0, done_ttl=60)
    assert handed is not None and handed.task_id == b"run-2" and handed.message == b"S-message"
    assert handed.lock_key == SEM.line.lock
    assert r.hget(SEM.permit("run-2"), "run-2") == b"0"
    assert r.exists(SEM.line.done("run-0"))
    assert third.take()  # the handed permit taken up
    assert third.token == second.token + 1 and _holders(r) == {"run-1", "run-2"}
    # A finished run's copy finds its done marker; a running run's copy changes nothing.
    with pytest.raises(OwnerFinished):
        _permit(r, "run-0").take()
    with pytest.raises(OwnerRunning):
        _permit(r, "run-1").take()
    assert _holders(r) == {"run-1", "run-2"}
    for lock in (second, third):
        assert lock.finish(hold=0, done_ttl=None) is None
    assert _holders(r) == set() and r.keys(SEM.permits + b"*") == []


def test_the_permits_of_a_key_are_shared_by_task_types_and_read_at_each_acquire(
    broker: RedisServer,
) -> None:
    r = broker.client()
    tenant = _permit(r, "a", limit=2)
    assert tenant.take()
    # plan_job renders the same key: a free-plan call (limit 1) finds it full...
    free = ca.plan_job.run_lock(("t", 0.0), {"plan": "free"}, "b")
    assert isinstance(free, TaskSemaphore) and free.limit == 1 and not free.take()
    # ...a pro call (limit 3) takes a second permit, and tenant_job (2) then no third.
    pro = ca.plan_job.run_lock(("t", 0.0), {"plan": "pro"}, "c")
    assert pro.take() and not _permit(r, "d", limit=2).take()
    # A task parked with limit 1 while two are held: a release leaves one held, which is
    # not fewer than its limit, so nothing is handed on; the next release hands it one.
    _permit(r, "e", limit=1).park("S-e", keep_for=60)
    assert tenant.finish(hold=0, done_ttl=None) is None
    assert _holders(r) == {"c"}
    assert pro.finish(hold=0, done_ttl=None) is not None  # now below every limit: handed on
    assert _holders(r) == {"e"}


def test_a_kept_permit_outlives_the_run_and_a_retry_adopts_it(broker: RedisServer) -> None:
    r = broker.client()
    run = _permit(r, "job")
    assert run.take()
    token = run.token
    assert run.finish(hold=30, done_ttl=60) is None  # kept 30 s, unrenewed
    assert 25_000 < r.pttl(SEM.permit("job")) <= 30_000 and _holders(r) == {"job"}
    retry = _permit(r, "job~r1")
    assert retry.take(adopt="job")  # its hold, its token
    assert retry.token == token and _holders(r) == {"job~r1"}
    assert not r.exists(SEM.permit("job"))
    retry.finish(hold=0, done_ttl=None)
    assert _holders(r) == set()


def test_a_bad_limit_is_refused_at_decoration_and_a_bad_callable_value_takes_nothing(
    broker: RedisServer,
) -> None:
    app = Celery("limits-validation", broker=broker.url)
    app.finalize()  # tasks are created at decoration, as in a worker
    for bad in (0, -1, True, 2.5, "3", 2**31, [2]):
        with pytest.raises(LockConfigurationError, match="lock_limit must be an int from 1"):

            @app.task(base=LockedTask, lock_key="k:{x}", lock_limit=bad, shared=False)
            def refused(x: int) -> None: ...

    with pytest.raises(LockConfigurationError, match="redislock_limit must be an int from 1"):
        from celery_redislock.settings import LockSettings

        LockSettings.from_conf({"broker_url": broker.url, "redislock_limit": 0})
    calls = {"value": None}

    @app.task(
        base=LockedTask, lock_key="k:{x}", lock_limit=lambda a, k: calls["value"], shared=False
    )
    def computed(x: int) -> None: ...

    for value, error in ((0, "lock_limit must be an int"), ("2", "lock_limit must be an int")):
        calls["value"] = value
        with pytest.raises(LockConfigurationError, match=error):
            computed.run_lock((1,), {}, "owner")

    def boom(args: Any, kwargs: Any) -> int:
        raise KeyError("plan")

    @app.task(base=LockedTask, lock_key="k:{x}", lock_limit=boom, shared=False)
    def failing(x: int) -> None: ...

    with pytest.raises(LockConfigurationError, match=r"lock_limit\(\(1,\), \{\}\) raised KeyError"):
        failing.run_lock((1,), {}, "owner")
    assert broker.client().keys("redislock:*") == []  # nothing written


def test_limits_are_not_offered_on_a_quorum(broker: RedisServer) -> None:
    from celery_redislock.settings import LockSettings

    urls = [f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)]  # never reached
    with pytest.raises(LockConfigurationError, match="redislock_limit is not offered"):
        LockSettings.from_conf({"redislock_urls": urls, "redislock_limit": 2})
    app = Celery("limits-quorum", broker="memory://")
    app.conf.redislock_urls = urls
    app.finalize()

    @app.task(base=LockedTask, lock_key="k:{x}", lock_limit=2, shared=False)
    def limited(x: int) -> None: ...

    with pytest.raises(LockConfigurationError, match="lock_limit is not offered with redislock"):
        limited.run_lock((1,), {}, "owner")
    from celery_redislock.celery.worker import _check_settings_at_worker_start

    with pytest.raises(SystemExit, match="is not offered with redislock_urls"):  # refused
        _check_settings_at_worker_start(sender=type("Worker", (), {"app": app})())
    app.close()


def test_a_direct_call_takes_a_permit(broker: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    r = broker.client()
    others = [RedisSemaphore(r, "tenant:direct", 2, owner=f"o{i}") for i in range(2)]
    assert others[0].acquire(blocking=False)
    token = ca.tenant_job("direct", 0)  # direct call: waits up to lock_wait for a permit
    assert others[0].token is not None and token == others[0].token + 1
    assert others[1].acquire(blocking=False)  # the direct call's permit was given back
    task_type = type(ca.app.tasks[ca.tenant_job.name])
    monkeypatch.setattr(task_type, "_lock_overrides", {**task_type._lock_overrides, "wait": 0.1})
    with pytest.raises(LockContendedError, match="is held"):
        ca.tenant_job("direct", 0)
    for other in others:
        other.release()
    assert _holders(r, SemaphoreKeys.for_name("tenant:direct")) == set()


# -- parking at delivery, the sweeper, hostile data -----------------------------------


def test_the_main_process_parks_over_limit_messages_and_the_sweeper_serves_free_permits(
    broker: RedisServer,
) -> None:
    r = broker.client()
    queue = "limits-parking"
    holders = [_permit(r, f"h{i}") for i in range(2)]
    assert all(h.take() for h in holders)
    sent = [ca.tenant_job.apply_async(("t", 0.01), queue=queue) for _ in range(3)]
    free = ca.tenant_job.apply_async(("other", 0.01), queue=queue)
    parker = Parker(ca.tenant_job, ca.app, revoked=set(), seen=EveryKeySeen())
    for result in sent:
        assert _fetch(queue, parker=parker).headers["id"] == result.id
    assert _fetch(queue, parker=parker, parks=False).headers["id"] == free.id
    assert [p.decode() for p in r.lrange(SEM.line.parked, 0, -1)] == [s.id for s in sent]
    sweeper = Sweeper(ca.app)
    assert sweeper.sweep_once() == 0  # both holders alive
    # Both holders vanish (leases gone): one pass hands both free permits, in order.
    for h in holders:
        h.close()
        r.delete(SEM.permit(h.owner))
    assert sweeper.sweep_once() == 2
    assert [_fetch(queue).headers["id"] for _ in range(2)] == [sent[0].id, sent[1].id]
    assert r.llen(SEM.line.parked) == 1
    # A registry entry under the prefix that names no lock or semaphore is dropped.
    r.zadd(parked_registry("redislock:"), {b"redislock:{x}:sem:junk": 0})
    sweeper.sweep_once()
    assert r.zscore(parked_registry("redislock:"), b"redislock:{x}:sem:junk") is None


def test_a_forged_parked_message_under_a_semaphore_is_refused_and_the_permit_handed_on(
    broker: RedisServer,
) -> None:
    r = broker.client()
    holder = _permit(r, "holder", limit=1)
    assert holder.take()
    genuine = _permit(r, "genuine", limit=1)
    assert genuine.park("S-unsigned", keep_for=60) is not True
    r.rpush(SEM.line.parked, "forged")
    r.hset(SEM.line.parked_messages, "forged", json.dumps({"task": "x"}))
    r.lrem(SEM.line.parked, 0, "genuine")
    r.rpush(SEM.line.parked, "genuine")  # the forged one first
    handed = holder.finish(hold=0, done_ttl=None)
    assert handed is not None and handed.task_id == b"forged"
    from celery_redislock.celery.handover import deliver_handed_over

    # Neither is a signed message: both refused in turn, the permit ends free.
    assert deliver_handed_over(ca.app, handed, 3000) == 0
    assert _holders(r) == set() and r.llen(SEM.line.parked) == 0


# -- real prefork workers -------------------------------------------------------------


def test_tenants_with_lock_limit_2_run_two_at_a_time_each_and_every_task_once(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=6)
    try:
        hot = [ca.tenant_job.delay("hot", 0.4) for _ in range(8)]
        small = [ca.tenant_job.delay(f"small{i}", 0.1) for i in range(3)]
        for result in hot + small:
            result.get(timeout=90)
        sections = _sections(r, "hot")
        assert sorted(s[0] for s in sections) == sorted(h.id for h in hot)  # once each
        assert _overlap([(s[1], s[2]) for s in sections]) == 2  # reached 2, never 3
        # No slot blocked: the small tenants ran while the hot one's backlog was parked.
        last_hot = max(s[1] for s in sections)
        for i in range(3):
            (one,) = _sections(r, f"small{i}")
            assert one[1] < last_hot
        assert "parked behind the holder" in proc.text()
        wait_until(lambda: not r.exists(SemaphoreKeys.for_name("tenant:hot").line.lock), 10)
    finally:
        proc.kill()  # everything was checked while it ran


def test_a_child_killed_mid_task_frees_its_permit_at_once(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    keys = SemaphoreKeys.for_name("tenant:kill")
    # A long lease: the permit must come back through the worker, not the lease's end.
    proc = worker(broker.url, tmp_path / "w.log", concurrency=3, env={"REDISLOCK_TEST_TTL": "60"})
    try:
        long = [ca.tenant_job.delay("kill", 5) for _ in range(2)]
        wait_until(lambda: r.llen("started:kill") == 2, timeout=30)
        waiting = ca.tenant_job.delay("kill", 0.01)
        wait_until(lambda: r.llen(keys.line.parked) == 1, timeout=30)
        victim = r.lindex("started:kill", 0).decode().split()
        os.kill(int(victim[2]), signal.SIGKILL)
        waiting.get(timeout=30)
        # Freed by the worker's main process once it saw the child die (billiard reports
        # a lost child within seconds), not by the end of the permit's 60 s lease.
        assert "its worker process died" in proc.text()
        # ...and the killed run, its message rejected back to the queue
        # (task_reject_on_worker_lost), runs again once a permit is free: not lost.
        wait_until(lambda: r.llen("started:kill") == 4, timeout=30)
        started = [line.decode().split()[0] for line in r.lrange("started:kill", 0, -1)]
        assert set(started[2:]) == {waiting.id, victim[0]}  # (whichever permit came first)
        waited = [line.decode().split() for line in r.lrange("sections:limit", 0, -1)]
        assert _overlap([(float(e), float(x)) for k, _i, e, x in waited if k == "kill"]) <= 2
    finally:
        proc.kill()  # everything was checked while it ran
        for result in long:
            result.forget()


def test_a_limit_by_configuration_takes_permits(broker: RedisServer) -> None:
    """``lock_limit`` in ``redislock_tasks``: a task whose base cannot change gets permits."""
    from celery_redislock.celery.configured import configure_tasks

    app = Celery("limits-configured", broker=broker.url, set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        redislock_tasks={"cfg.*": {"lock_key": "tenant:{tenant}", "lock_limit": 2}},
    )
    seen: list[Any] = []

    @app.task(bind=True, name="cfg.job")
    def job(self: Any, tenant: str) -> None:
        seen.append((type(self.lock).__name__, self.lock.limit, self.lock.name))

    app.finalize()
    configure_tasks(app)
    assert isinstance(app.tasks["cfg.job"], LockedTask)
    lock = app.tasks["cfg.job"].run_lock(("t",), {}, "run-1")
    assert isinstance(lock, TaskSemaphore) and lock.limit == 2
    app.tasks["cfg.job"].delay("t").get()
    assert seen == [("RedisSemaphore", 2, "tenant:t")]  # an eager call: a plain permit
    with pytest.raises(LockConfigurationError, match=r"redislock_tasks\['cfg.\*'\].*lock_limit"):
        from celery_redislock.settings import task_rules

        task_rules({"redislock_tasks": {"cfg.*": {"lock_limit": 0}}})
    app.close()


def test_wait_skip_and_raise_work_with_n_permits(broker: RedisServer, tmp_path: Path) -> None:
    """Two plain holders fill the key's two permits: "skip" records SKIPPED, "raise" fails
    with LockContendedError, "wait" blocks its slot until a holder releases, then runs."""
    r = broker.client()
    holders = [RedisSemaphore(r, "tenant:pol", 2, owner=f"plain-{i}") for i in range(2)]
    assert all(h.acquire(blocking=False) for h in holders)
    proc = worker(broker.url, tmp_path / "w.log", concurrency=3)
    try:
        skipped = ca.tenant_skip.delay("pol")
        raised = ca.tenant_raise.delay("pol")
        waiting = ca.tenant_wait.delay("pol")
        wait_until(lambda: skipped.state == "SKIPPED", timeout=30)
        with pytest.raises(LockContendedError):
            raised.get(timeout=30)
        line = SemaphoreKeys.for_name("tenant:pol").line.waiters
        wait_until(lambda: r.lrange(line, 0, -1) == [waiting.id.encode()], timeout=30)
        assert not waiting.ready()
        holders[0].release()  # wakes the waiting run, which takes the freed permit
        assert waiting.get(timeout=30) > holders[1].token  # type: ignore[operator]
        holders[1].release()
        wait_until(lambda: _holders(r, SemaphoreKeys.for_name("tenant:pol")) == set(), 10)
    finally:
        proc.kill()  # everything was checked while it ran


def test_a_limited_task_that_cannot_reach_the_lock_redis_at_take_is_not_lost(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """The permit's Redis does not answer at the take (a stalled server): the run is not
    failed (its acks_late message would be acknowledged, the task lost) but sent again,
    and runs once when Redis answers; nothing is left held."""
    locks = redis_server_factory()
    r = broker.client()
    env = {"REDISLOCK_TEST_LOCK_URL": locks.url, "REDISLOCK_TEST_LOCK_TIMEOUT": "0.5"}
    proc = worker(broker.url, tmp_path / "w.log", concurrency=1, env=env)
    try:
        assert ca.tenant_job.delay("out", 0.0).get(timeout=30) is not None  # warm
        locks.signal(signal.SIGSTOP)  # the take gets no answer (socket timeout)
        try:
            result = ca.tenant_job.delay("out", 0.0)
            wait_until(
                lambda: result.state == "FAILURE" or "could not take 'tenant:out'" in proc.text(),
                timeout=30,
            )
        finally:
            locks.signal(signal.SIGCONT)
        assert result.get(timeout=30) is not None
        started = [line.decode().split()[0] for line in r.lrange("started:out", 0, -1)]
        assert started.count(result.id) == 1 and len(started) == 2
        keys = SemaphoreKeys.for_name("tenant:out")
        wait_until(lambda: locks.client().scard(keys.line.lock) == 0, timeout=10)
    finally:
        proc.kill()
