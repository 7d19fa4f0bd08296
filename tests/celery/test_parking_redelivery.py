"""A worker's main process dies right after it parked a task's signature at delivery:
the parked entry is in the locks' Redis, its fallback copy in the broker, and the ack of
the original message never reached the broker, which redelivers it to another worker.

Real workers (prefork), a real RabbitMQ (or a Redis broker in another database of the
locks' server, which parks signatures too) and the tests' own redis-server. The first
worker SIGKILLs its own main process in its N-th ``task_parked`` signal
(``tests.parking_redelivery_app``); the test then kills its whole process group (the
pool with it), starts a second worker on the same queues and lets everything finish.
Counting oracles: every task id sent ran its body to the end exactly once (a body the
kill cut short may run again: at-least-once, docs/concepts.md "Runs"), no two bodies of
the key overlapped, nothing is left held or parked under the test's lock prefix, and
the fallback copies that come back later run nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock._keyspace import LockKeys, parked_registry
from celery_redislock.celery.contention import DELAY_QUEUE_PREFIX
from celery_redislock.testing import RedisServer

from .. import parking_redelivery_app as pra
from .._celery import CeleryProcess, wait_until, worker
from .conftest import RABBITMQ, Rabbit
from .test_celery_more import _rabbitmq_running

rabbitmq = pytest.mark.skipif(
    not _rabbitmq_running(), reason="no RabbitMQ answers on 127.0.0.1:5672"
)

#: Each case bounded (its workers killed in its ``finally`` when the cap hits).
pytestmark = pytest.mark.timeout(60)

APP = "tests.parking_redelivery_app"
#: Tasks sent after the holder (each of 50 ms).
BURST = 8
HOLD = 0.4  # the first task's body: the burst's tasks arrive while it holds the key
BODY = 0.05
#: The fallback delay of these workers: min(max(ttl 3, backoff cap 0.5), VT / 4).
RABBIT_VT, RABBIT_FALLBACK = "8", 2.0
REDIS_VT, REDIS_FALLBACK = "4", 1.0


# --------------------------------------------------------------------------- helpers


def _worker(r: redis.Redis, log: Path, node: str, env: dict[str, str], queue: str) -> Any:
    """A prefork worker (2 processes) of this test's app on ``queue``."""
    return worker(_url(r), log, concurrency=2, name=node, env=env, extra=["-Q", queue], app=APP)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` still runs (zombies do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _kill_group(proc: CeleryProcess) -> float:
    """SIGKILL whatever is left of the worker's process group (its pool); the moment
    (monotonic) by which all of it was gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.process is not None
    proc.process.wait(30)
    wait_until(lambda: not _group_alive(proc.pid), timeout=30, what="the pool gone")
    return time.monotonic()


class Runs:
    """The body runs ``section_job`` recorded for one key."""

    def __init__(self, r: redis.Redis, name: str) -> None:
        self.starts: dict[str, tuple[str, float, int]] = {}  # run -> (task id, enter, token)
        self.ends: dict[str, tuple[str, float]] = {}  # run -> (task id, leave)
        for line in r.lrange(f"{pra.RECORDS}runs:{name}", 0, -1):
            parts = line.decode().split()
            if parts[0] == "start":
                self.starts[parts[2]] = (parts[1], float(parts[3]), int(parts[4]))
            else:
                self.ends[parts[2]] = (parts[1], float(parts[3]))

    def completed(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for task_id, _leave in self.ends.values():
            counts[task_id] = counts.get(task_id, 0) + 1
        return counts

    def started(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for task_id, _enter, _token in self.starts.values():
            counts[task_id] = counts.get(task_id, 0) + 1
        return counts

    def cut_short(self) -> list[str]:
        """Runs that started and never ended (killed with the first worker's pool)."""
        return [run for run in self.starts if run not in self.ends]


def _check_runs(runs: Runs, ids: list[str], killed_by: float, *, strict: bool) -> None:
    """Each id's body ran to its end exactly once; a body cut short only by the kill
    (``strict``: none at all); no two sections overlap; tokens rise with the sections."""
    assert runs.completed() == {task_id: 1 for task_id in ids}, (
        f"bodies run to the end per task id (expected each of {len(ids)} once): {runs.completed()}"
    )
    cut = runs.cut_short()
    for run in cut:
        task_id, enter, _token = runs.starts[run]
        assert enter < killed_by, f"{task_id}'s body started after the kill and never ended"
    if strict:
        assert not cut, f"bodies cut short, though the kill waited for an idle pool: {cut}"
    started = runs.started()
    assert all(started[task_id] <= 2 for task_id in ids), started
    assert sum(started.values()) == len(ids) + len(cut), started
    spans = []
    for run, (task_id, enter, token) in runs.starts.items():
        leave = runs.ends[run][1] if run in runs.ends else killed_by
        spans.append((enter, leave, token, task_id))
    spans.sort()
    assert len(spans) == len(ids) + len(cut)  # every expected section seen
    for (enter, leave, token, task_id), (nxt, _l, next_token, next_id) in zip(spans, spans[1:]):
        assert leave <= nxt, f"{task_id} [{enter}, {leave}] overlaps {next_id} from {nxt}"
        assert token < next_token, f"tokens do not rise: {task_id} {token}, {next_id} {next_token}"


def _nothing_left(r: redis.Redis, name: str) -> None:
    """No lock held and nothing parked under the test's prefix: only the fence counter,
    the runs' done markers and the stats counters remain; the sweeper's registry no
    longer names the lock."""
    keys = LockKeys.for_name(f"rd:{name}", pra.PREFIX)
    registry = parked_registry(pra.PREFIX)
    wait_until(lambda: not r.exists(keys.lock), timeout=15, what="the lock given back")
    wait_until(
        lambda: r.zscore(registry, keys.lock) is None, timeout=15, what="dropped from registry"
    )
    assert not r.exists(keys.parked, keys.parked_messages, keys.parked_dispatched), {
        "parked": r.lrange(keys.parked, 0, -1),
        "messages": list(r.hkeys(keys.parked_messages)),
        "dispatched": r.hgetall(keys.parked_dispatched),
    }
    left = sorted(k for k in r.scan_iter(match=pra.PREFIX + "*", count=1000))
    stats = (pra.PREFIX + "stats").encode()  # the counters `celery redislock stats` reads
    done = keys.lock + b":done:"
    assert all(k in (keys.fence, stats) or k.startswith(done) for k in left), left


def _quiet(check: Any, seconds: float, timeout: float) -> None:
    """Wait until ``check()`` (a value) stays the same for ``seconds`` (bounded)."""
    deadline = time.monotonic() + timeout
    last, since = check(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = check()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return
    raise AssertionError(f"still changing after {timeout}s: {last}")


def _scenario(
    r: redis.Redis,
    tmp_path: Path,
    client: Celery,
    queue: str,
    env: dict[str, str],
    mode: str,
    kill_at: int,
    fallback: float,
    side: Any,
) -> None:
    """The whole story (see the module's docstring); ``side``: the broker's view
    (:class:`_RabbitSide`, :class:`_RedisSide`)."""
    name = f"k{secrets.token_hex(3)}"
    keys = LockKeys.for_name(f"rd:{name}", pra.PREFIX)
    env = {**env, "REDISLOCK_TEST_TTL": "3"}
    first_env = {
        **env,
        "REDISLOCK_TEST_KILL_AT_PARKING": str(kill_at),
        "REDISLOCK_TEST_KILL_MODE": mode,
    }

    def send(seconds: float) -> str:
        sent = client.send_task(
            pra.section_job.name, args=(name, seconds), queue=queue, ignore_result=True
        )
        return str(sent.id)

    w1 = _worker(r, tmp_path / "w1.log", "rd-doomed", first_env, queue)
    w2 = None
    try:
        warm = client.send_task(pra.section_job.name, args=(name, 0.0), queue=queue)
        warm.get(timeout=30)  # the key comes again: the next messages are checked
        wait_until(lambda: not r.exists(keys.lock), timeout=15)
        r.delete(f"{pra.RECORDS}runs:{name}")
        ids = [send(HOLD)] + [send(BODY) for _ in range(BURST)]
        assert w1.process is not None
        try:
            w1.process.wait(25)  # killed by its own hook at the kill_at-th parking
        except Exception:
            raise AssertionError(
                f"the first worker never reached its parking #{kill_at}:\n{w1.text()[-3000:]}"
            ) from None
        killed_by = _kill_group(w1)
        parkings = [line.decode().split() for line in r.lrange(f"{pra.RECORDS}parkings", 0, -1)]
        killed = [line.decode().split() for line in r.lrange(f"{pra.RECORDS}killed", 0, -1)]
        assert len(killed) == 1 and len(parkings) == kill_at, (parkings, killed)
        victim = killed[0][0]
        assert victim in ids
        # The scenario happened: the victim's entry parked, its message never acked.
        assert r.hexists(keys.parked_messages, victim) or r.hexists(
            keys.parked_dispatched, victim
        ), "the victim was not parked when its worker died"
        assert f"{victim}] parked behind" not in w1.text()  # killed before its log line
        # ... and its message is still the broker's (the ack lost), beside its fallback
        # copy; in "after-release", the hand-over the holder's release published too.
        held = side.held()
        assert ("queue", victim, True) in held, held
        assert sum(1 for _where, task_id, _again in held if task_id == victim) >= 2, held
        if mode == "after-release":
            assert [h for h in held if h[0] == "hand-over"], held
        # (Held until the second worker is ready, so that this shows the redelivery alone;
        # a worker starting with hand-overs waiting: test_..._hand_overs_waiting below.)
        w2 = _worker(r, tmp_path / "w2.log", "rd-heir", env, queue)
        side.release()
        wait_until(
            lambda: set(Runs(r, name).completed()) >= set(ids),
            timeout=30,
            what="every task run",
        )
        # The fallback copies (2 s / 1 s after their parkings, and those sent again by
        # re-parkings) come back: wait until the broker holds nothing and the second
        # worker's log stops growing for longer than a fallback delay.
        wait_until(side.idle, timeout=20, what="the broker's queues empty")
        _quiet(lambda: (len(w2.text()), side.idle()), fallback * 2 + 1.0, timeout=25)
        runs = Runs(r, name)
        _check_runs(runs, ids, killed_by, strict=mode == "after-release")
        _nothing_left(r, name)
        text = w2.text()
        assert f"{victim}] already finished" in text  # its other copies came, ran nothing
        assert "Traceback" not in text and " ERROR/" not in text, text[-4000:]
    finally:
        side.release()
        w1.kill()
        if w2 is not None:
            w2.kill()


def _url(r: redis.Redis) -> str:
    kwargs = r.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"


# ----------------------------------------------------------------------------- cases

MODES = [
    # The first parking: the holder's body is cut short by the kill (and runs again).
    pytest.param("at-once", 1, id="at-once-1st"),
    # A later parking: more entries parked (acked) ahead of the victim.
    pytest.param("at-once", 4, id="at-once-4th"),
    # The main loop stopped until the holder's release handed the lock to the first
    # parked task and published its hand-over, which this worker never acks either.
    pytest.param("after-release", 3, id="after-release-3rd"),
]


@pytest.fixture
def records(broker: RedisServer) -> Iterator[redis.Redis]:
    r = broker.client()
    yield r
    r.close()


class _RabbitSide:
    """The test's queues on the shared RabbitMQ: the task queue, its hand-over queue and
    its fallback copies' delay queue."""

    def __init__(self, rabbit: Rabbit, queue: str) -> None:
        self.rabbit = rabbit
        self.places = {
            queue: "queue",
            f"{queue}.redislock": "hand-over",
            f"{DELAY_QUEUE_PREFIX}{int(RABBIT_FALLBACK * 1000)}.{queue}": "delay",
        }

    def idle(self) -> bool:
        return all(not self.rabbit.count(q) for q in self.places)

    def held(self) -> list[tuple[str, str, bool]]:
        """(where, task id, redelivered) of every message ready in the test's queues, each
        read without an ack and held until :meth:`release` (then requeued in place)."""
        from amqp.exceptions import NotFound
        from kombu import Connection

        found = []
        self.connection = Connection(RABBITMQ)
        for queue, where in self.places.items():
            channel = self.connection.channel()
            try:
                while True:
                    message = channel.basic_get(queue, no_ack=False)
                    if message is None:
                        break
                    redelivered = bool(message.delivery_info.get("redelivered"))
                    found.append((where, message.headers.get("id"), redelivered))
            except NotFound:
                pass  # (not declared: nothing sent there; the channel is closed)
        return found

    def release(self) -> None:
        """Give back what :meth:`held` holds: the broker requeues it (redelivered)."""
        connection, self.connection = self.connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.release()

    connection: Any = None


class _RedisSide:
    """The test's lists in the Redis broker's database, and its unacked messages."""

    def __init__(self, db: redis.Redis, queue: str) -> None:
        self.db = db
        self.places = {queue: "queue", f"{queue}.redislock": "hand-over"}

    def idle(self) -> bool:
        return not any(self.db.llen(q) for q in self.places) and not self.db.hlen("unacked")

    def held(self) -> list[tuple[str, str, bool]]:
        """(where, task id, redelivered: taken by a worker, not acked) of every message
        in the lists or unacked; the fallback copies (eta tasks) are "queue" messages."""
        found = []
        for queue, where in self.places.items():
            for raw in self.db.lrange(queue, 0, -1):
                found.append((where, json.loads(raw)["headers"]["id"], False))
        for raw in self.db.hvals("unacked"):
            message, _exchange, routing_key = json.loads(raw)
            where = self.places.get(routing_key, routing_key)
            found.append((where, message["headers"]["id"], True))
        return found

    def release(self) -> None:
        pass  # (read, not taken)


@rabbitmq
@pytest.mark.parametrize(("mode", "kill_at"), MODES)
def test_rabbitmq_worker_killed_after_parking_before_the_ack(
    records: redis.Redis, tmp_path: Path, rabbit: Rabbit, mode: str, kill_at: int
) -> None:
    """RabbitMQ: the dead worker's unacked messages (the victim's among them) are requeued
    at once; the fallback copies wait 2 s in their delay queue."""
    r = records
    queue = f"redislock-test-{secrets.token_hex(4)}"
    side = _RabbitSide(rabbit, queue)
    rabbit.queues += list(side.places)
    rabbit.exchanges += [queue, f"{queue}.redislock"]
    client = Celery("rd-client", broker=RABBITMQ, backend=_url(r))
    env = {"REDISLOCK_TEST_BROKER": RABBITMQ, "REDISLOCK_TEST_VT": RABBIT_VT}
    try:
        _scenario(r, tmp_path, client, queue, env, mode, kill_at, RABBIT_FALLBACK, side)
    finally:
        client.close()


@pytest.mark.parametrize(("mode", "kill_at"), MODES[::2])
def test_redis_broker_in_another_db_worker_killed_after_parking_before_the_ack(
    records: redis.Redis, tmp_path: Path, mode: str, kill_at: int
) -> None:
    """The broker in database 1 of the locks' server, without
    ``redislock_queues_in_other_db``: signatures parked, fallback copies as eta tasks
    (1 s); the dead worker's unacked messages come back after the visibility timeout (4 s)."""
    r = records
    queue = f"rd-{secrets.token_hex(3)}"
    broker_url = _url(r).rsplit("/", 1)[0] + "/1"
    db1 = redis.Redis.from_url(broker_url)
    client = Celery("rd-client-db1", broker=broker_url, backend=_url(r))
    env = {"REDISLOCK_TEST_BROKER": broker_url, "REDISLOCK_TEST_VT": REDIS_VT}
    try:
        side = _RedisSide(db1, queue)
        _scenario(r, tmp_path, client, queue, env, mode, kill_at, REDIS_FALLBACK, side)
    finally:
        client.close()
        db1.flushdb()
        db1.close()


class _DiedAtStart(AssertionError):
    """The worker exited at start with the pool not yet on the event loop."""


@rabbitmq
def test_a_worker_started_with_hand_overs_waiting_takes_them_in(
    records: redis.Redis, tmp_path: Path, rabbit: Rabbit
) -> None:
    """What a dead worker leaves (its hand-overs requeued, as above): a worker that starts
    while ``<queue>.redislock`` holds messages starts, and runs them. A step after the
    hand-over channel's makes one round trip on the connection 0.3 s later, as Celery's
    own Control step does at once (without the wait the worker died in 3 of 8 starts)."""
    r = records
    queue = f"redislock-test-{secrets.token_hex(4)}"
    handover = f"{queue}.redislock"
    rabbit.queues += [queue, handover]
    rabbit.exchanges += [queue, handover]
    from kombu import Connection, Queue

    with Connection(RABBITMQ) as conn:
        Queue(handover, routing_key=handover)(conn.default_channel).declare()
    client = Celery("rd-client", broker=RABBITMQ, backend=_url(r))
    env = {
        "REDISLOCK_TEST_BROKER": RABBITMQ,
        "REDISLOCK_TEST_VT": RABBIT_VT,
        "REDISLOCK_TEST_ROUND_TRIP_AFTER": "0.3",
    }
    proc = None
    try:
        names = [f"h{secrets.token_hex(3)}" for _ in range(3)]
        sent = [
            client.send_task(
                pra.section_job.name, args=(name, 0.0), queue=handover, ignore_result=True
            )
            for name in names
        ]
        wait_until(lambda: rabbit.count(handover) == 3, timeout=10)
        try:
            proc = _worker(r, tmp_path / "w.log", "rd-start", env, queue)
        except AssertionError as exc:
            text = (tmp_path / "w.log").read_text(errors="replace")
            if "Unrecoverable error" in text and "'NoneType' object is not callable" in text:
                raise _DiedAtStart(text[-3000:]) from exc
            raise
        wait_until(
            lambda: all(Runs(r, n).completed() == {s.id: 1} for n, s in zip(names, sent)),
            timeout=30,
            what="each waiting hand-over run once",
        )
    finally:
        if proc is not None:
            proc.kill()
        client.close()
