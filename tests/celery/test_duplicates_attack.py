"""The check at delivery of a copy back from its delay queue (``celery.duplicates``)
attacked in-process against real redis-servers: the same finished copy delivered twice,
a copy of a run that has not finished, the locks' Redis cut at the check's round trip,
and a done marker someone else wrote (of another type)."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from celery_redislock.celery.parking import Outage
from celery_redislock.parking import Parker
from celery_redislock.testing import RedisServer

from .._celery import EveryKeySeen
from .test_parking import _fetch

DEATH = {"x-death": [{"count": 1, "reason": "expired", "queue": "redislock.delay.2000.q"}]}


def test_a_finished_runs_copies_are_dropped_and_a_cut_redis_delivers_them(
    broker: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    from celery import Celery

    from celery_redislock import LockedTask
    from celery_redislock.testing import FaultProxy

    queue = f"copies-{secrets.token_hex(3)}"
    r = broker.client()
    with FaultProxy(broker) as proxy:
        app = Celery("copies", broker=broker.url)
        app.conf.redislock_url = proxy.url
        app.conf.redislock_redis_options = {"socket_timeout": 0.3, "socket_connect_timeout": 0.3}

        @app.task(bind=True, base=LockedTask, lock_key="job:{name}", shared=False)
        def job(self: Any, name: str) -> None:
            pass

        def done_key(task_id: str) -> bytes:
            return job.run_lock(("c",), {}, task_id, job.lock_options()).done_key

        try:
            outage = Outage()
            parker = Parker(
                job, app, revoked=set(), seen=EveryKeySeen(), envelopes=False, outage=outage
            )
            r.set(done_key("finished"), b"1")
            r.hset(done_key("forged"), "any", "thing")  # another type, by a prefix writer
            for task_id in ("finished", "finished", "forged", "running"):
                job.apply_async(("c",), queue=queue, task_id=task_id, headers=DEATH)
            with caplog.at_level("INFO", logger="celery_redislock.celery.duplicates"):
                _fetch(queue, app=app, parker=parker, parks=True)  # dropped
                _fetch(queue, app=app, parker=parker, parks=True)  # the same copy again
                _fetch(queue, app=app, parker=parker, parks=True)  # the marker's type aside
            ignored = [m for m in caplog.messages if "ignored at delivery" in m]
            assert len(ignored) == 3 and sum("[finished]" in m for m in ignored) == 2
            # Not finished, its key free: delivered (its pool process runs it).
            _fetch(queue, app=app, parker=parker, parks=False)
            # The locks' Redis cut at the check's round trip: delivered, the check paused.
            job.apply_async(("c",), queue=queue, task_id="finished", headers=DEATH)
            proxy.partition()
            with caplog.at_level("WARNING", logger="celery_redislock.celery.parking"):
                _fetch(queue, app=app, parker=parker, parks=False)
            assert outage.paused()
            assert [m for m in caplog.messages if "the locks' Redis did not answer" in m]
            proxy.heal()
            assert not r.exists("redislock:{job:c}") and not r.exists("redislock:{job:c}:parked")
            assert r.llen(queue) == 0
        finally:
            app.close()
