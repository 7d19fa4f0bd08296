"""More LockedTask behaviour with real workers: the parking safety net, pools, two beats."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from celery_redislock import RedisLock
from celery_redislock._scripts import scripts_for
from celery_redislock.task import TaskLock, settings_for
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import CeleryProcess, wait_until, worker
from .conftest import RABBITMQ


def test_parked_tasks_survive_a_holder_that_never_releases_and_a_lost_hand_over(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", env={"REDISLOCK_TEST_TTL": "4"})
    try:
        # A holder that will never release (its host "died"): only its 2 s lease ends it.
        RedisLock(r, "job:stuck", ttl=2, owner="dead-host", auto_renew=False).acquire()
        results = [ca.hold_for.delay("stuck", 0.05) for _ in range(3)]
        wait_until(lambda: r.llen("redislock:{job:stuck}:parked") == 3, timeout=30)
        # The sweeper hands the expired lock to the first parked task; each hands to the next.
        for result in results:
            result.get(timeout=60)
        assert r.llen("started:stuck") == 3

        # Now a releaser that dies between handing over and publishing: the message is
        # dropped on the floor here, and the sweeper has to publish it again.
        RedisLock(r, "job:lost", ttl=60, owner="releaser", auto_renew=False).acquire()
        parked = [ca.hold_for.delay("lost", 0.05) for _ in range(2)]
        wait_until(lambda: r.llen("redislock:{job:lost}:parked") == 2, timeout=30)
        options = ca.hold_for.lock_options()
        lock = TaskLock(r, "job:lost", task_id="releaser", options=options)
        keys, args = lock.handoff_args("releaser", "one", None)
        reply = scripts_for(r).handoff(keys=keys, args=args)
        assert reply[2].decode() in {p.id for p in parked}  # handed over, never published
        for result in parked:
            result.get(timeout=60)
        assert r.llen("started:lost") == 2
        assert "sweeper hands" in proc.text()
    finally:
        proc.kill()


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_settlement_under_threads_and_solo_pools(
    broker: RedisServer, tmp_path: Path, pool: str
) -> None:
    r = broker.client()
    concurrency = 1 if pool == "solo" else 4
    proc = worker(
        broker.url,
        tmp_path / "w.log",
        pool=pool,
        concurrency=concurrency,
        env={"REDISLOCK_TEST_TTL": "0.6"},
    )
    try:
        # 0.6 s leases and 0.9 s tasks: only the watchdog keeps the locks alive.
        results = [ca.settle.delay(i % 2, 1, work=0.05) for i in range(12)]
        long_one = ca.hold_for.delay("long", 0.9)
        for result in results:
            result.get(timeout=60)
        assert long_one.get(timeout=60) is not None
        assert int(r.get("balance:0") or 0) == 6 and int(r.get("balance:1") or 0) == 6
        sections = [line.decode().split() for line in r.lrange("sections:settle", 0, -1)]
        assert len(sections) == 12
        for account in ("0", "1"):
            spans = sorted((float(e), float(x)) for k, _, e, x in sections if k == account)
            assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
        assert "lost lock" not in proc.text()
    finally:
        proc.kill()


def test_two_beats_fire_the_nightly_job_but_it_runs_once_per_period(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log")
    env = {"REDISLOCK_TEST_BEAT": "1"}
    beats = [
        CeleryProcess(
            ["beat", "-s", str(tmp_path / f"schedule-{i}"), "-l", "info",
             "--pidfile", str(tmp_path / f"beat-{i}.pid")],
            url=broker.url, log=tmp_path / f"beat-{i}.log", env=env,
        ).start()
        for i in range(2)
    ]  # fmt: skip

    def sent() -> int:
        return sum(beat.text().count("Sending due task nightly") for beat in beats)

    try:
        # Each beat sends the job every second and each run keeps its lock 2 s: until both
        # beats have fired several times and the job has run in two periods.
        wait_until(
            lambda: sent() >= 6 and r.llen("nightly:runs") >= 2,
            timeout=60,
            what="six sends and two runs",
        )
    finally:
        for beat in beats:
            beat.stop()
        time.sleep(1.0)
        proc.stop()
    runs = sorted(float(x) for x in r.lrange("nightly:runs", 0, -1))
    assert sent() >= 6  # both beats really fired, several times
    assert 2 <= len(runs) < sent()  # duplicates were skipped...
    assert all(b - a >= 1.75 for a, b in zip(runs, runs[1:]))  # ...never two within a hold


def test_settings_come_from_the_app(broker: RedisServer) -> None:
    settings = settings_for(ca.app)
    assert settings.url.startswith("redis://")


def test_parked_tasks_survive_a_restart_of_a_separate_lock_redis(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """Locks in their own Redis (no persistence): a restart loses the parked messages, and
    the fallback copies kept in the broker still run every task exactly once."""
    locks = redis_server_factory()
    r = broker.client()
    lr = locks.client()
    proc = worker(
        broker.url,
        tmp_path / "w.log",
        env={"REDISLOCK_TEST_TTL": "2", "REDISLOCK_TEST_LOCK_URL": locks.url},
    )
    try:
        RedisLock(lr, "job:restart", ttl=60, owner="holder", auto_renew=False).acquire()
        results = [ca.hold_for.delay("restart", 0.05) for _ in range(3)]
        wait_until(lambda: lr.llen("redislock:{job:restart}:parked") == 3, timeout=30)
        locks.restart()  # everything parked (and the stuck holder) is gone
        assert not lr.exists("redislock:{job:restart}:parked")
        for result in results:
            result.get(timeout=60)
        started = [line.decode().split()[0] for line in r.lrange("started:restart", 0, -1)]
        assert sorted(started) == sorted(res.id for res in results)  # each ran exactly once
        assert "fallback copy" in proc.text()
    finally:
        proc.kill()


def test_a_bad_setting_stops_the_worker_at_start(broker: RedisServer, tmp_path: Path) -> None:
    proc = CeleryProcess(
        ["worker", "-l", "info", "-c", "1", "--without-gossip", "--without-mingle"],
        url=broker.url,
        log=tmp_path / "w.log",
        env={"REDISLOCK_TEST_BAD_SETTING": "1"},
    ).start()
    try:
        assert proc.process is not None
        proc.process.wait(60)
        assert proc.process.returncode != 0
        assert "redislock_on_contention must be one of" in proc.text()
        assert "ready." not in proc.text()
    finally:
        proc.stop()


def test_hand_over_follows_a_task_routed_to_its_own_queue(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", extra=["-Q", "billing"])
    try:
        results = [ca.settle.apply_async((77, 1), queue="billing") for _ in range(12)]
        for result in results:
            result.get(timeout=60)
        assert int(r.get("balance:77") or 0) == 12
        assert "parked" in proc.text()  # they really contended and were handed over
    finally:
        proc.kill()


def _rabbitmq_running() -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _rabbitmq_running(), reason="no RabbitMQ on 127.0.0.1:5672")
def test_hand_over_through_rabbitmq_follows_the_tasks_own_queue(
    broker: RedisServer, tmp_path: Path
) -> None:
    """With an AMQP broker a re-built request names its exchange and routing key, not its
    queue: the hand-over must still reach a worker that consumes only that queue."""
    import secrets

    from celery import Celery
    from kombu import Connection, Exchange, Queue

    queue = f"redislock-test-{secrets.token_hex(4)}"
    r = broker.client()
    proc = worker(
        broker.url,
        tmp_path / "w.log",
        extra=["-Q", queue],
        env={"REDISLOCK_TEST_BROKER": RABBITMQ, "REDISLOCK_TEST_NO_FALLBACK": "1"},
    )
    client_app = Celery("rabbit-client", broker=RABBITMQ, backend=broker.url)
    try:
        results = [
            client_app.send_task("tests.celery_app.settle", args=(78, 1), queue=queue)
            for _ in range(10)
        ]
        for result in results:
            result.get(timeout=60)
        assert int(r.get("balance:78") or 0) == 10
        assert "parked" in proc.text()
    finally:
        proc.kill()
        client_app.close()
        with Connection(RABBITMQ) as conn:  # leave the shared RabbitMQ as we found it
            for name in (queue, f"{queue}.redislock"):
                Queue(name).bind(conn.default_channel).delete()
                Exchange(name).bind(conn.default_channel).delete()


def test_warm_shutdown_lets_the_task_finish_and_release(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", env={"REDISLOCK_TEST_TTL": "30"})
    result = ca.hold_for.delay("warm", 1.5)
    wait_until(lambda: r.llen("started:warm"))
    assert r.exists("redislock:{job:warm}")
    assert proc.stop(timeout=60) == 0  # SIGTERM: a warm shutdown waits for running tasks
    assert result.get(timeout=10) is not None
    assert not r.exists("redislock:{job:warm}")  # released by the task, not by the lease


def test_a_redelivered_retry_message_does_not_adopt_the_kept_hold_twice(
    broker: RedisServer, tmp_path: Path
) -> None:
    """lock_release_on_retry=False: the retry adopts the hold its first attempt kept. A
    second delivery of the same retry message (the visibility timeout ran out while the
    retry works) used to adopt it too and run beside it; only one may."""
    r = broker.client()
    env = {"REDISLOCK_TEST_TTL": "3", "REDISLOCK_TEST_VT": "2"}
    proc = worker(broker.url, tmp_path / "w.log", env=env)
    try:
        result = ca.retry_keeping_long.delay("twice", 6.0)
        assert result.get(timeout=60) == "done"
        # The copy, re-queued while the retry ran, comes back and finds it finished (or
        # runs out of re-queues); had it been let in, its start would be recorded.
        ended = (f"[{result.id}] already finished under", f"[{result.id}] gave up after")
        wait_until(
            lambda: (
                any(line in proc.text() for line in ended)
                or sum(x.startswith(b"start") for x in r.lrange("runs:twice", 0, -1)) > 1
            ),
            timeout=30,
            what="the copy's end",
        )
        runs = [line.decode().split() for line in r.lrange("runs:twice", 0, -1)]
        starts = [run for run in runs if run[0] == "start"]
        assert len(starts) == 1, runs  # the retry ran once
        assert "held by another delivery of this task" in proc.text()  # the copy was seen
    finally:
        proc.kill()


def test_a_task_whose_release_cannot_reach_redis_still_succeeds_and_frees_the_lock(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """The lock Redis stops answering while the task body runs and through its release.
    The task used to be recorded as FAILURE (a TimeoutError from the release) and its lock
    renewed until the worker exited; now it succeeds, the hold stops renewing, and the
    release (with its done marker) lands in the background once Redis answers."""
    locks = redis_server_factory()
    r = broker.client()
    lr = locks.client()
    proc = worker(
        broker.url,
        tmp_path / "w.log",
        concurrency=1,
        env={
            "REDISLOCK_TEST_TTL": "20",
            "REDISLOCK_TEST_LOCK_URL": locks.url,
            "REDISLOCK_TEST_LOCK_TIMEOUT": "0.5",
        },
    )
    key = "redislock:{job:relfail}"
    try:
        result = ca.hold_for.delay("relfail", 1.0)
        wait_until(lambda: r.llen("started:relfail") == 1, timeout=30)
        locks.signal(signal.SIGSTOP)  # the release (and renewals) get no answer
        try:
            wait_until(lambda: result.state != "PENDING", timeout=30)
            assert result.state == "SUCCESS", proc.text()[-3000:]
            assert "could not release" in proc.text()
        finally:
            locks.signal(signal.SIGCONT)
        wait_until(lambda: not lr.exists(key), timeout=15)  # long before the 20 s lease
        assert lr.exists(f"{key}:done:{result.id}")  # the done marker landed with it
        time.sleep(1.0)
        assert not lr.exists(key)  # and nothing renews it back
    finally:
        proc.kill()


def test_a_task_that_cannot_reach_the_lock_redis_at_take_is_not_lost(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path
) -> None:
    """The lock Redis does not answer when the task tries to take its lock (found by the
    soak: the broker's Redis restarting as a task started). The task used to end as
    FAILURE with a ConnectionError — its message acknowledged (acks_late acks failures),
    its body never run: a lost settlement. Now it is sent again, uncounted, until the
    lock Redis answers, and then runs once."""
    locks = redis_server_factory()
    r = broker.client()
    proc = worker(
        broker.url,
        tmp_path / "w.log",
        concurrency=1,
        env={
            "REDISLOCK_TEST_LOCK_URL": locks.url,
            "REDISLOCK_TEST_LOCK_TIMEOUT": "0.5",
        },
    )
    try:
        assert ca.settle.delay(900, 1, 0.0).get(timeout=30) == 1  # the worker is warm
        locks.signal(signal.SIGSTOP)  # the take gets no answer (socket timeout)
        try:
            result = ca.settle.delay(900, 10, 0.0)
            # Its take met the outage: it failed (the bug), or it was sent again.
            wait_until(
                lambda: result.state == "FAILURE" or "could not take 'account:900'" in proc.text(),
                timeout=30,
            )
        finally:
            locks.signal(signal.SIGCONT)
        assert result.get(timeout=30) == 11
        assert int(r.get("balance:900") or 0) == 11
        sections = [raw.decode().split() for raw in r.lrange("sections:settle", 0, -1)]
        assert [t for key, t, _, _ in sections if key == "900"].count(result.id) == 1
    finally:
        proc.kill()


@pytest.mark.parametrize("fault", ["drop_reply", "stall"])
def test_a_hand_over_whose_reply_is_lost_runs_every_task_once(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path, fault: str
) -> None:
    """The task's life through the fault proxy: the locks' Redis sits behind a
    FaultProxy, and the first release (``handoff``) of three tasks on one key loses its
    reply (it ran: the lock went to the next parked task, whose message was in that
    reply) or stalls past the client's timeout (it runs late). Every task still runs
    exactly once, every result is a success, and the lock is free at the end."""
    from celery_redislock.testing import FaultProxy

    locks = redis_server_factory()
    r = broker.client()
    lr = locks.client()
    with FaultProxy(locks) as proxy:
        proc = worker(
            broker.url,
            tmp_path / "w.log",
            env={
                "REDISLOCK_TEST_TTL": "2",
                "REDISLOCK_TEST_LOCK_URL": proxy.url,
                "REDISLOCK_TEST_LOCK_TIMEOUT": "0.5",
            },
        )
        try:
            first = ca.hold_for.delay("handfault", 0.5)
            wait_until(lambda: r.llen("started:handfault") == 1, timeout=30)
            rest = [ca.hold_for.delay("handfault", 0.05) for _ in range(2)]
            wait_until(lambda: lr.llen("redislock:{job:handfault}:parked") == 2, timeout=30)
            injected = proxy.inject(fault, "handoff", seconds=1.5 if fault == "stall" else None)
            results = [first, *rest]
            for result in results:
                assert result.get(timeout=60) is not None
            assert injected.fired.is_set()  # the first release met the fault
            assert "could not release" in proc.text()
            started = [x.decode().split()[0] for x in r.lrange("started:handfault", 0, -1)]
            assert sorted(started) == sorted(res.id for res in results)  # each ran once
            wait_until(lambda: not lr.exists("redislock:{job:handfault}"), timeout=15)
            time.sleep(2.0)  # late copies (sweeper, fallback) come and find the runs done
            again = [x.decode().split()[0] for x in r.lrange("started:handfault", 0, -1)]
            assert sorted(again) == sorted(started)
            assert not lr.exists("redislock:{job:handfault}")
        finally:
            proc.kill()


@pytest.mark.parametrize(
    ("step", "fault"),
    [("acquire", "drop_reply"), ("acquire", "stall"), ("park", "drop_reply"), ("park", "stall")],
)
def test_a_take_or_park_whose_reply_is_lost_runs_every_task_once(
    broker: RedisServer, redis_server_factory: Any, tmp_path: Path, step: str, fault: str
) -> None:
    """The task's life through the fault proxy, at its other round trips: the first
    task's take (``acquire``), or the parking of a task that found the key held
    (``park``), runs on Redis but loses its reply (drop_reply), or lands after the client
    gave up (stall). (A take that never ran: the test of a take that cannot reach the lock
    Redis, above.) A take that ran holds the lock for a run that does not know it,
    unrenewed: its lease ends it, and the run's copy, sent again, finds that hold as
    another delivery's until then. A park that ran leaves the task parked as well as sent
    again. Either way every task runs exactly once, every result is a success, and the
    lock is free at the end."""
    from celery_redislock._scripts import SCRIPT_NAMES, source
    from celery_redislock.testing import FaultProxy

    locks = redis_server_factory()
    r = broker.client()
    lr = locks.client()
    for name in SCRIPT_NAMES:  # a NOSCRIPT reply and its retry would be two commands
        lr.script_load(source(name))
    key = "redislock:{job:takefault}"
    with FaultProxy(locks) as proxy:
        proc = worker(
            broker.url,
            tmp_path / "w.log",
            env={
                "REDISLOCK_TEST_TTL": "2",
                "REDISLOCK_TEST_LOCK_URL": proxy.url,
                "REDISLOCK_TEST_LOCK_TIMEOUT": "0.5",
            },
        )
        try:
            seconds = 1.5 if fault == "stall" else None
            if step == "acquire":
                injected = proxy.inject(fault, "acquire", seconds=seconds)
                first = ca.hold_for.delay("takefault", 0.5)
            else:
                first = ca.hold_for.delay("takefault", 1.0)
                wait_until(lambda: r.llen("started:takefault") == 1, timeout=30)
                injected = proxy.inject(fault, "park", seconds=seconds)
            results = [first, *(ca.hold_for.delay("takefault", 0.05) for _ in range(2))]
            for result in results:
                assert result.get(timeout=60) is not None
            assert injected.fired.is_set()
            started = [x.decode().split()[0] for x in r.lrange("started:takefault", 0, -1)]
            assert sorted(started) == sorted(res.id for res in results)  # each ran once
            wait_until(lambda: not lr.exists(key), timeout=15)
            # Late copies (the take's or park's re-send, the sweeper's, a fallback copy)
            # come back and find their runs done.
            wait_until(
                lambda: not lr.exists(f"{key}:parked") and not r.llen("celery"),
                timeout=30,
                what="no parked or queued copy left",
            )
            time.sleep(2.0)
            again = [x.decode().split()[0] for x in r.lrange("started:takefault", 0, -1)]
            assert sorted(again) == sorted(started)
            assert not lr.exists(key)
        finally:
            proc.kill()
