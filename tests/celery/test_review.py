"""Review findings (fresh-eyes attack on run owners, nested calls, deferred releases)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import LockLostError, RedisLock, _scripts
from celery_redislock._deferred import deferred_releases
from celery_redislock.task import LockedTask, TaskLock, _finish_quietly, task_lock
from celery_redislock.testing import FaultProxy, RedisServer

from .. import celery_app as ca
from .._celery import CeleryProcess, wait_until, worker
from ..conftest import empty


@pytest.fixture
def proxy(redis_server_factory: Any) -> Iterator[FaultProxy]:
    server = redis_server_factory()
    direct = server.client()
    for name in _scripts.SCRIPT_NAMES:  # a NOSCRIPT round trip would take the fault
        direct.script_load(_scripts.source(name))
    direct.close()
    with FaultProxy(server) as proxy:
        yield proxy


def _no_resend() -> Retry:
    return Retry(NoBackoff(), 0)  # type: ignore[no-untyped-call]


def test_two_objects_of_one_owner_a_lost_release_reply_never_frees_the_other(
    proxy: FaultProxy, redis_server_factory: Any
) -> None:
    """Two lock objects of one explicit owner on one key (the second re-enters the
    first's holding). The second's release runs but its reply is lost: it is retried in
    the background. The retry must not give back the first object's hold."""
    client = proxy.client(retry=_no_resend())
    outer = RedisLock(client, "k", owner="run-1", ttl=5.0)
    inner = RedisLock(client, "k", owner="run-1", ttl=5.0)
    assert outer.acquire()
    assert inner.acquire()
    proxy.inject("drop_reply", "release")
    inner.release()  # ran on Redis (count 2 -> 1); its reply is lost
    assert deferred_releases().wait_idle(10)
    other = RedisLock(proxy.client(), "k", owner="B", ttl=5.0)
    taken = other.acquire(blocking=False)
    outer_holds = outer.locked()
    if taken:
        other.release()
    with contextlib.suppress(LockLostError):
        outer.release()
    assert outer_holds and not taken, "B got the lock while the outer object still held it"


@pytest.fixture
def app(proxy: FaultProxy) -> Iterator[Celery]:
    app = Celery("review", broker="memory://", backend="cache+memory://")
    app.conf.update(
        redislock_url=proxy.url,
        redislock_wait=0.2,
        redislock_redis_options={"retry": _no_resend()},
        task_always_eager=True,
    )
    app.finalize()
    yield app
    app.close()


def test_a_nested_call_whose_release_reply_is_lost_keeps_the_callers_lock(
    app: Celery, proxy: FaultProxy
) -> None:
    """A direct call nested in a run on the run's own key re-enters the caller's lock.
    The nested release runs, its reply is lost: the background retry of it must not
    give back the caller's hold while the caller's body still runs."""
    seen: list[bool] = []

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="account:{account_id}")
    def settle(self: Any, account_id: int, nested: bool) -> None:
        if not nested:
            return
        proxy.inject("drop_reply", "release")
        settle(account_id, False)
        assert deferred_releases().wait_idle(10)
        other = RedisLock(proxy.client(), f"account:{account_id}", owner="B", ttl=5.0)
        taken = other.acquire(blocking=False)
        if taken:
            other.release()
        seen.append(taken)

    with contextlib.suppress(LockLostError):  # the caller's release finds its lock gone
        settle.delay(7, True).get(disable_sync_subtasks=False)
    assert seen == [False], "another owner got the lock while the caller's body ran"


def test_a_task_release_retried_late_spares_a_later_holding_of_the_same_run(
    app: Celery, proxy: FaultProxy, redis_server_factory: Any
) -> None:
    """Run X's release cannot reach Redis (its worker is cut off): its hold stops renewing
    and the release is retried in the background (for up to max(60 s, 2 x ttl)). The
    lease runs out; another copy of run X's message (no done marker: the release never
    landed) takes the lock in another worker and runs. When X's worker reaches Redis
    again, its retried release must not give back that copy's holding: C would get in
    beside it."""

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="job:{name}", lock_ttl=1.0)
    def job(self: Any, name: str) -> None: ...

    options = job.lock_options()
    first = task_lock(app, "job:x", task_id="run-x", options=options)
    assert isinstance(first, TaskLock) and first.take()
    proxy.partition()  # this worker is cut off from Redis
    _finish_quietly(first, job, options, hold=0.0)
    assert deferred_releases().pending() == 1
    time.sleep(options.ttl + 0.3)  # the unrenewed lease runs out
    direct = proxy._target.client()  # another worker, which reaches Redis
    copy = TaskLock(direct, "job:x", task_id="run-x", options=options)
    assert copy.take()  # the copy of run X runs
    proxy.heal()
    assert deferred_releases().wait_idle(10)
    other = RedisLock(direct, "job:x", owner="C", ttl=5.0)
    taken = other.acquire(blocking=False)
    if taken:
        other.release()
    with contextlib.suppress(LockLostError):
        copy.finish(hold=0.0, done_ttl=None)
    assert not taken, "C got the lock while the copy of run X held it"


# ---------------------------------------------------------------- with real workers


@pytest.fixture(scope="module")
def worker_broker(celery_broker: RedisServer) -> RedisServer:
    return empty(celery_broker)


@pytest.fixture(scope="module")
def r(worker_broker: RedisServer) -> Iterator[redis.Redis]:
    client = worker_broker.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def shared_worker(
    worker_broker: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryProcess]:
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    proc = worker(worker_broker.url, log, concurrency=2, env={"REDISLOCK_TEST_TTL": "30"})
    yield proc
    proc.kill()


@pytest.mark.parametrize(
    ("task", "seen"), [("retry_once", ["0 True", "1 True"]), ("retry_keeping", ["0 1", "1 1"])]
)
def test_a_late_copy_of_a_run_that_retried_does_not_run_again(
    r: redis.Redis, shared_worker: CeleryProcess, task: str, seen: list[str]
) -> None:
    """Run 0 ends with self.retry(); run 1 succeeds. A copy of run 0's message delivered
    later (a visibility-timeout redelivery re-queued while run 0 ran) is a duplicate of a
    finished run: its body must not run again (it did not before runs had owners of
    their own: the retry's success marked the task id done)."""
    name = f"late-copy-{task}"
    first = getattr(ca, task).delay(name)
    assert first.get(timeout=30) == "done"
    getattr(ca, task).apply_async((name,), task_id=first.id)  # the same message again
    wait_until(
        lambda: (
            f"[{first.id}] already finished" in shared_worker.text()
            or r.llen(f"attempts:{name}") > 2
        ),
        timeout=30,
    )
    attempts = [a.decode() for a in r.lrange(f"attempts:{name}", 0, -1)]
    assert attempts == seen
