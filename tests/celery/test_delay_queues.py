"""Fallback copies of an AMQP broker in delay queues (``contention.delay_queue``), with
real workers and a real RabbitMQ: named and topic exchanges, quorum and priority queues,
a delay queue that cannot be declared, one deleted under a running worker, and copies
that come back through a dead-lettering (``x-death``) while their key is still busy."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from celery_redislock.celery.contention import DELAY_QUEUE_PREFIX, _delay_ms, delay_queue
from celery_redislock.testing import RedisServer

from .._celery import wait_until, worker
from ..celery_app import amqp_queues
from .conftest import Rabbit
from .test_celery_more import RABBITMQ, _rabbitmq_running

rabbitmq = pytest.mark.skipif(not _rabbitmq_running(), reason="no RabbitMQ on 127.0.0.1:5672")


def _amqp_app(queues: list[dict[str, Any]] | None = None, backend: str | None = None) -> Any:
    from celery import Celery

    client = Celery("rabbit-client", broker=RABBITMQ, backend=backend)
    if queues:
        client.conf.task_queues = amqp_queues(queues)
    return client


def _rabbit_worker(
    broker: RedisServer,
    tmp_path: Path,
    queue: str,
    queues: list[dict[str, Any]] | None = None,
    **options: Any,
) -> tuple[Any, Any]:
    """A worker of ``queue`` on RabbitMQ (locks on ``broker``; fallback copies after 2 s:
    min(max(ttl 3, cap 5), visibility timeout 8 / 4)), and a client app to send to it;
    both with ``queues`` (specs of ``celery_app.amqp_queues``) when given."""
    env = {"REDISLOCK_TEST_BROKER": RABBITMQ, "REDISLOCK_TEST_VT": "8"}
    if queues:
        env["REDISLOCK_TEST_AMQP_QUEUES"] = json.dumps(queues)
    proc = worker(broker.url, tmp_path / "w.log", extra=["-Q", queue], env=env, **options)
    return proc, _amqp_app(queues, backend=broker.url)


def _forget_locks(r: Any) -> None:
    for key in r.scan_iter("redislock:*"):  # the lock Redis forgets it all
        r.delete(key)


# ------------------------------------------------------------------------------ naming


def test_delay_queues_are_few_whatever_the_countdowns() -> None:
    """A debounced pending call's copy waits its own due time plus the fallback delay,
    to the millisecond: one queue per distinct delay would make a queue per call, each
    left in the broker for good. The delays are rounded up to a few steps."""
    client = _amqp_app()
    try:
        signature = client.signature("t", options={"queue": "q"})
        names = {delay_queue(client, signature, 30 + i / 997).name for i in range(3000)}
        assert len(names) <= 3
        for seconds in (0.001, 0.4, 2.0, 2.4, 7.3, 30.0, 95.5, 3600.0, 86400.0):
            queue = delay_queue(client, signature, seconds)
            delay = queue.queue_arguments["x-message-ttl"]
            assert seconds * 1000 <= delay <= max(seconds * 1000 * 1.125, seconds * 1000 + 1000)
            assert queue.name.startswith(f"{DELAY_QUEUE_PREFIX}{delay}.")
        assert delay_queue(client, signature, 2.0).name == f"{DELAY_QUEUE_PREFIX}2000.q"
        assert delay_queue(client, signature, 30.0).name == f"{DELAY_QUEUE_PREFIX}30000.q"
        assert len({_delay_ms(s / 10) for s in range(1, 864000)}) < 150
    finally:
        client.close()


@pytest.mark.parametrize(
    ("countdown", "delay_ms"),
    [(0, 1000), (-5.0, 1000), (float("nan"), 1000), (float("-inf"), 1000), (1.0, 1000)],
)
def test_a_delay_below_a_second_or_not_a_number_waits_a_second(
    countdown: float, delay_ms: int
) -> None:
    assert _delay_ms(countdown) == delay_ms


@pytest.mark.parametrize("countdown", [float("inf"), 1e30, 10 * 365 * 24 * 3600.0])
def test_a_delay_beyond_the_longest_duration_waits_the_longest(countdown: float) -> None:
    """Bounded by the package's longest duration (a year), not an overflow; RabbitMQ
    accepts a queue TTL that long."""
    longest = _delay_ms(365 * 24 * 3600.0)
    assert _delay_ms(countdown) == longest
    assert 365 * 24 * 3600 * 1000 <= longest <= 365 * 24 * 3600 * 1000 * 1.125


def test_delay_queues_of_different_destinations_never_share_a_name() -> None:
    """``<exchange>/<routing key>`` is ambiguous when a name holds a "/": two
    destinations on one delay queue would be declared with two dead-letter targets
    (PRECONDITION_FAILED for one of them)."""
    client = _amqp_app()
    try:
        destinations = [
            {"queue": "a/b"},  # the default exchange, routing key "a/b"
            {"exchange": "a", "routing_key": "b"},
            {"exchange": "a/b", "routing_key": "c"},
            {"exchange": "a", "routing_key": "b/c"},
            {"queue": "x" * 300},
            {"exchange": "x" * 150, "routing_key": "x" * 149},
            {"exchange": "x" * 149, "routing_key": "x" * 150},
        ]
        names = [delay_queue(client, client.signature("t", options=d), 2.0) for d in destinations]
        assert len({q.name for q in names}) == len(destinations)
        assert all(len(q.name.encode()) <= 255 for q in names)
    finally:
        client.close()


def test_a_fallback_copy_the_amqp_broker_cannot_take_rejects_the_message_as_before() -> None:
    """The broker down (not a queue refused): the running message is rejected with
    requeue, as for any copy the broker cannot take (``_publish``); no error escapes."""
    from celery import Celery
    from celery.exceptions import Reject

    from celery_redislock.task import LockedTask

    client = Celery("down", broker="amqp://guest:guest@127.0.0.1:1//")  # nothing listens
    client.conf.update(
        redislock_url="redis://127.0.0.1:1/0",  # locks elsewhere: fallback copies on
        broker_connection_timeout=0.2,
        broker_connection_retry=False,
        task_publish_retry=False,
    )

    @client.task(base=LockedTask, lock_key="k:{n}", shared=False)
    def job(n: int) -> None:
        return None

    try:
        signature = job.signature((1,), options={"queue": "q"})
        assert delay_queue(client, signature, 2.0) is not None
        job.push_request(id="t1")
        try:
            with pytest.raises(Reject):
                job._fallback_copy(None, signature, 2.0)
        finally:
            job.pop_request()
    finally:
        client.close()


# ------------------------------------------------------------------ where the copy goes

_KINDS = {
    # a named direct exchange whose routing key is not the queue's name
    "direct": ({"type": "direct"}, None),
    # a topic exchange: the queue is bound by a pattern, the task sent with a key of it
    "topic": ({"type": "topic"}, None),
    "quorum": ({"type": "direct", "arguments": {"x-queue-type": "quorum"}}, None),
    "priority": ({"type": "direct", "arguments": {"x-max-priority": 10}}, 7),
}


@rabbitmq
@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_a_dead_lettered_copy_reaches_the_tasks_own_queue(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit, kind: str
) -> None:
    """The copy dead-letters to the exchange and routing key the task came by: it reaches
    the queue the task came from (bound by a pattern to a topic exchange, a quorum queue),
    keeping its priority, and runs the task the lock Redis lost, once."""
    from celery_redislock import RedisLock

    spec, priority = _KINDS[kind]
    tag = secrets.token_hex(4)
    name, exchange = f"redislock-test-{tag}", f"redislock-test-x-{tag}"
    topic = spec["type"] == "topic"
    binding = f"jobs.*.{tag}" if topic else f"rk-{tag}"
    routing_key = f"jobs.fb.{tag}" if topic else binding
    queues = [{"name": name, "exchange": exchange, "routing_key": binding, **spec}]
    rabbit.queues += [name, f"{name}.redislock"]
    rabbit.exchanges += [exchange, name, f"{name}.redislock"]
    delayed = f"{DELAY_QUEUE_PREFIX}2000.{exchange}/{routing_key}"
    rabbit.queues.append(delayed)

    r = broker.client()
    RedisLock(r, "job:fb", ttl=60, owner="holder", auto_renew=False).acquire()
    proc, client = _rabbit_worker(broker, tmp_path, name, queues)
    try:
        # (a direct queue's exchange named too: Celery sends to a direct queue through the
        # default exchange, routing key its name, when no exchange is named)
        options: dict[str, Any] = {"queue": name, "exchange": exchange, "routing_key": routing_key}
        if priority is not None:
            options["priority"] = priority
        result = client.send_task("tests.celery_app.hold_for", args=("fb", 0.01), **options)
        wait_until(lambda: r.llen("redislock:{job:fb}:parked") == 1, timeout=15)
        wait_until(lambda: "fallback copy in 2.0s" in proc.text(), timeout=10)
        assert rabbit.count(delayed) == 1
        _forget_locks(r)
        assert result.get(timeout=15) is not None  # the copy ran it...
        time.sleep(0.5)
        assert r.llen("started:fb") == 1  # ...once
        delivered = json.loads(r.lindex("delivered:fb", 0))
        assert delivered == [exchange, routing_key, priority or 0]
    finally:
        proc.kill()
        client.close()


# ------------------------------------------------------------- a delay queue that fails


@rabbitmq
def test_a_delay_queue_declared_otherwise_falls_back_to_an_eta_copy(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """A queue of the delay queue's name already declared with other arguments
    (PRECONDITION_FAILED; or a user who may not declare it: ACCESS_REFUSED): the copy is
    an ``eta`` task instead, with a warning. Not: the running message rejected with
    requeue, delivered again at once, failing again, for as long as the key is held."""
    from kombu import Connection

    from celery_redislock import RedisLock

    name = f"redislock-test-{secrets.token_hex(4)}"
    delayed = f"{DELAY_QUEUE_PREFIX}2000.{name}"
    rabbit.queues += [name, f"{name}.redislock", delayed]
    rabbit.exchanges += [name, f"{name}.redislock"]
    with Connection(RABBITMQ) as conn:  # declared by someone else, with other arguments
        conn.default_channel.queue_declare(delayed, durable=True, auto_delete=False)

    r = broker.client()
    RedisLock(r, "job:fb", ttl=60, owner="holder", auto_renew=False).acquire()
    proc, client = _rabbit_worker(broker, tmp_path, name)
    try:
        result = client.send_task("tests.celery_app.hold_for", args=("fb", 0.01), queue=name)
        wait_until(lambda: r.llen("redislock:{job:fb}:parked") == 1, timeout=15)
        wait_until(lambda: "fallback copy" in proc.text(), timeout=3)
        time.sleep(1.0)  # (a rejected message would be delivered again and again meanwhile)
        text = proc.text()
        assert text.count("parked behind") == 1, text[-3000:]  # not delivered again and again
        assert "could not be sent again" not in text
        assert "cannot wait in the delay queue" in text and "as an eta task" in text
        assert rabbit.count(delayed) == 0
        _forget_locks(r)
        assert result.get(timeout=15) is not None  # the eta copy ran it...
        time.sleep(0.5)
        assert r.llen("started:fb") == 1  # ...once
    finally:
        proc.kill()
        client.close()


@rabbitmq
def test_a_delay_queue_deleted_under_a_running_worker_is_declared_again(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """An empty delay queue deleted (by an operator tidying up) is declared again by the
    next copy: not taken as still declared by the worker's connection, its copies
    published to no queue and dropped by the broker without a word."""
    from kombu import Connection

    from celery_redislock import RedisLock

    name = f"redislock-test-{secrets.token_hex(4)}"
    delayed = f"{DELAY_QUEUE_PREFIX}2000.{name}"
    rabbit.queues += [name, f"{name}.redislock", delayed]
    rabbit.exchanges += [name, f"{name}.redislock"]

    r = broker.client()
    RedisLock(r, "job:fb1", ttl=60, owner="holder", auto_renew=False).acquire()
    RedisLock(r, "job:fb2", ttl=60, owner="holder", auto_renew=False).acquire()
    proc, client = _rabbit_worker(broker, tmp_path, name)
    try:
        client.send_task("tests.celery_app.hold_for", args=("fb1", 0.01), queue=name)
        wait_until(lambda: r.llen("redislock:{job:fb1}:parked") == 1, timeout=15)
        wait_until(lambda: rabbit.count(delayed) == 1, timeout=5)
        with Connection(RABBITMQ) as conn:  # an operator tidying up (its copy lost with it)
            conn.default_channel.queue_delete(delayed)
        assert rabbit.count(delayed) is None
        result = client.send_task("tests.celery_app.hold_for", args=("fb2", 0.01), queue=name)
        wait_until(lambda: r.llen("redislock:{job:fb2}:parked") == 1, timeout=15)
        wait_until(lambda: proc.text().count("fallback copy") == 2, timeout=5)
        assert rabbit.count(delayed) == 1
        _forget_locks(r)
        assert result.get(timeout=15) is not None
    finally:
        proc.kill()
        client.close()


# ----------------------------------------------------- copies that come back (x-death)


@rabbitmq
def test_a_copy_back_from_the_delay_queue_while_still_parked_parks_again(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """The holder runs past two fallback delays: each copy comes back dead-lettered
    (``x-death``), finds the task still parked and sends the next copy; the hand-over
    runs it once. The parked message and the copies do not carry RabbitMQ's dead-letter
    headers along (Celery drops them from re-sent tasks)."""
    from kombu import Connection

    from celery_redislock._core import LockKeys
    from celery_redislock.celery.contention import DEAD_LETTER_HEADERS, REQUEUE_HEADER

    name = f"redislock-test-{secrets.token_hex(4)}"
    delayed = f"{DELAY_QUEUE_PREFIX}2000.{name}"
    rabbit.queues += [name, f"{name}.redislock", delayed]
    rabbit.exchanges += [name, f"{name}.redislock"]
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name)
    try:
        holder = client.send_task("tests.celery_app.hold_for", args=("xd", 5.0), queue=name)
        wait_until(lambda: r.llen("started:xd") == 1, timeout=15)
        parked = client.send_task("tests.celery_app.hold_for", args=("xd", 0.01), queue=name)
        wait_until(lambda: proc.text().count("fallback copy") >= 2, timeout=10)
        with Connection(RABBITMQ) as conn:  # the next copy, sent by the one back from it
            channel = conn.default_channel
            copy = channel.basic_get(delayed)
            assert copy is not None
            channel.basic_reject(copy.delivery_tag, requeue=True)
        assert REQUEUE_HEADER in copy.headers
        assert not set(copy.headers) & set(DEAD_LETTER_HEADERS), copy.headers
        keys = LockKeys.for_name("job:xd", "redislock:")
        assert keys.parked == b"redislock:{job:xd}:parked"
        stored = list(r.hgetall(keys.parked_messages).values())
        assert stored and all(b"x-death" not in m and b"x-first-death" not in m for m in stored)
        assert holder.get(timeout=15) is not None
        assert parked.get(timeout=15) is not None
        time.sleep(0.5)
        assert r.llen("started:xd") == 2
        assert "ERROR" not in proc.text()
    finally:
        proc.kill()
        client.close()


@rabbitmq
def test_a_pending_calls_copy_back_from_the_delay_queue_stays_the_pending_call(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """``on_contention="replace"``: the pending call's copy comes back dead-lettered while
    the run goes on, is the pending call again (not failed, not run twice); the newest
    call runs once when the run ends."""
    name = f"redislock-test-{secrets.token_hex(4)}"
    delayed = f"{DELAY_QUEUE_PREFIX}2000.{name}"
    rabbit.queues += [name, f"{name}.redislock", delayed]
    rabbit.exchanges += [name, f"{name}.redislock"]
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name, app="tests.latest_app")
    try:
        task = "tests.latest_app.rebuild"
        first = client.send_task(task, args=("xd", "first", 5.0), queue=name)
        wait_until(lambda: "received" in proc.text(), timeout=15)
        time.sleep(1.0)  # (it runs)
        pending = client.send_task(task, args=("xd", "pending", 0.0), queue=name)
        wait_until(lambda: proc.text().count("is the pending call") >= 2, timeout=10)
        assert first.get(timeout=15) == "first"
        assert pending.get(timeout=15) == "pending"
        time.sleep(0.5)
        runs = [line.split()[0] for line in r.lrange("lw:runs:xd", 0, -1)]
        assert runs == [b"first", b"pending"]
        assert "ERROR" not in proc.text()
    finally:
        proc.kill()
        client.close()


def test_refusals_noted_by_threads_at_once_never_fail_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A threads pool's tasks refused the same delay queue at once each note the refusal;
    noting one must not fail (a RuntimeError there escaped ``_fallback_copy`` after the
    task was parked: the task failed, and no copy was sent)."""
    import sys
    import threading

    from celery_redislock.celery import contention

    far = time.monotonic() + 3600
    monkeypatch.setattr(contention, "_refused", {f"kept.{n}": far for n in range(20_000)})
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the race shows at once
    errors: list[BaseException] = []

    def refuse(thread: int) -> None:
        for n in range(40):
            try:
                contention._refuse(f"refused.{thread}.{n}")
            except BaseException as exc:  # what the test looks for
                errors.append(exc)

    threads = [threading.Thread(target=refuse, args=(t,)) for t in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert all(f"refused.{t}.39" in contention._refused for t in range(4))
