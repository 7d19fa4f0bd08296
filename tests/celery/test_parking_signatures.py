"""Parking at delivery where the broker cannot take a parked envelope back (RabbitMQ, a
Redis on another server, fallback copies on): the worker's main process parks the task's
signature, as a pool process would, publishes its fallback copy, and acks the message; no
pool process is taken. Real workers, a real RabbitMQ and real redis-servers."""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import chain

from celery_redislock import RedisLock, series
from celery_redislock.celery import signing
from celery_redislock.celery.clients import settings_for
from celery_redislock.celery.contention import DELAY_QUEUE_PREFIX, FIRST_TRY_HEADER, REQUEUE_HEADER
from celery_redislock.celery.parking import Outage
from celery_redislock.parking import Parker
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import EveryKeySeen, wait_until
from .conftest import Rabbit
from .test_delay_queues import _rabbit_worker, rabbitmq
from .test_parking import _fetch

PARKED = "redislock:{job:%s}:parked"


def _names(rabbit: Rabbit) -> tuple[str, str]:
    """A queue of the test's own on the shared RabbitMQ and its fallback copies' delay
    queue (2 s: ``_rabbit_worker``'s settings), all deleted at the test's end."""
    name = f"redislock-test-{secrets.token_hex(4)}"
    delayed = f"{DELAY_QUEUE_PREFIX}2000.{name}"
    rabbit.queues += [name, f"{name}.redislock", delayed]
    rabbit.exchanges += [name, f"{name}.redislock"]
    return name, delayed


def signing_payload(entry: bytes) -> dict[str, Any]:
    """The headers of a parked signature's entry (its MAC not checked: the test reads it)."""
    text = entry.split(b"\n", 1)[1]
    return dict(json.loads(text)["options"].get("headers") or {})


def _started(r: redis.Redis, name: str) -> list[str]:
    return [line.split()[0].decode() for line in r.lrange(f"started:{name}", 0, -1)]


def _nothing_left(r: redis.Redis, name: str) -> None:
    wait_until(lambda: not r.exists(f"redislock:{{job:{name}}}"), timeout=10)
    assert not r.llen(PARKED % name)
    assert not r.hlen(PARKED % name + ":messages")
    assert not r.hlen(PARKED % name + ":dispatched")


@rabbitmq
def test_a_rabbitmq_worker_parks_a_busy_keys_tasks_before_dispatch(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """Five tasks of a held key are parked by the main process (no pool process runs or
    parks one), each with one fallback copy in the delay queue; the holder's release hands
    them on in arrival order, one at a time; the copies come back, find each run done and
    are ignored; nothing is left in Redis or the delay queue."""
    name, delayed = _names(rabbit)
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name)
    try:

        def send(seconds: float) -> Any:
            return client.send_task(ca.hold_for.name, args=("sg", seconds), queue=name)

        send(0.0).get(timeout=30)  # the key comes again: its next messages are checked
        r.delete("started:sg")
        holder = send(1.5)
        wait_until(lambda: r.llen("started:sg") == 1, timeout=15)
        parked = [send(0.02) for _ in range(5)]
        wait_until(lambda: r.llen(PARKED % "sg") == 5, timeout=15)
        assert _started(r, "sg") == [holder.id]  # no pool process took one
        wait_until(lambda: proc.text().count("before dispatch; fallback copy in 2.0s") == 5)
        assert proc.text().count("parked behind") == 5  # none parked by a pool process
        wait_until(lambda: rabbit.count(delayed) == 5, timeout=5)
        tokens = [holder.get(timeout=30)] + [result.get(timeout=30) for result in parked]
        assert tokens == sorted(tokens) and len(set(tokens)) == 6  # in line, one at a time
        assert _started(r, "sg") == [holder.id] + [result.id for result in parked]
        # Back from the delay queue after 2 s, each copy is found done by the main process
        # (the run's done marker), which drops it before any pool process gets it.
        wait_until(lambda: proc.text().count("duplicate delivery ignored") == 5, timeout=20)
        assert proc.text().count("duplicate delivery ignored at delivery") == 5
        for result in parked:  # received once: its hand-over (the copy never dispatched)
            assert proc.text().count(f"[{result.id}] received") == 1
        assert rabbit.count(delayed) == 0 and rabbit.count(name) == 0
        assert _started(r, "sg") == [holder.id] + [result.id for result in parked]
        _nothing_left(r, "sg")
        assert "ERROR" not in proc.text()
    finally:
        proc.kill()
        client.close()


@rabbitmq
def test_finished_runs_copies_and_duplicates_are_dropped_at_delivery_while_the_key_is_held(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """Three tasks parked at delivery run through their hand-overs within the first
    holder's second; a second holder then keeps the key busy while their fallback copies
    come back from the delay queue (2 s) and while a duplicate of the first finished run
    (same task id) is sent. The main process drops all four (each run's done marker), so
    no pool process gets one: every run started once and was received once (its
    hand-over), the queues are empty and nothing is left held. Each of the four is counted
    as a pool process counts it (its task's request, so its queue: ``queue_name``)."""
    name, delayed = _names(rabbit)
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name)
    try:

        def send(seconds: float, **options: Any) -> Any:
            return client.send_task(ca.hold_for.name, args=("fd", seconds), queue=name, **options)

        send(0.0).get(timeout=30)  # the key comes again: its next messages are checked
        r.delete("started:fd")
        holder = send(1.0)
        wait_until(lambda: r.llen("started:fd") == 1, timeout=15)
        parked = [send(0.02) for _ in range(3)]
        wait_until(lambda: proc.text().count("before dispatch; fallback copy in 2.0s") == 3)
        for result in (holder, *parked):
            result.get(timeout=30)
        second = send(4.0)
        wait_until(lambda: r.llen("started:fd") == 5, timeout=15)
        assert rabbit.count(delayed) == 3  # the copies are still in their delay queue
        send(0.02, task_id=parked[0].id)  # a duplicate of a finished run, its key busy
        wait_until(lambda: proc.text().count("duplicate delivery ignored") == 4, timeout=20)
        assert r.exists("redislock:{job:fd}")  # the second holder still runs: key held
        assert proc.text().count("duplicate delivery ignored at delivery") == 4
        second.get(timeout=30)
        assert _started(r, "fd") == [holder.id, *(result.id for result in parked), second.id]
        for result in parked:  # received once: its hand-over (copy, duplicate never dispatched)
            assert proc.text().count(f"[{result.id}] received") == 1
        assert rabbit.count(delayed) == 0 and rabbit.count(name) == 0
        _nothing_left(r, "fd")
        wait_until(lambda: sum(_duplicates_counted(r).values()) == 4, timeout=15)
        assert _duplicates_counted(r) == {(ca.hold_for.name, name): 4}
        assert "ERROR" not in proc.text()
    finally:
        proc.kill()
        client.close()


def _duplicates_counted(r: redis.Redis) -> dict[tuple[str, str], float]:
    """``task_duplicate_ignored_total`` in ``redislock:stats``, by (task name, queue)."""
    found: dict[tuple[str, str], float] = {}
    for field, value in r.hgetall("redislock:stats").items():
        parsed = series.parse_field(field.decode())
        if parsed is not None and parsed[0].name.endswith("task_duplicate_ignored_total"):
            key = (parsed[2]["name"], parsed[2]["queue_name"])
            found[key] = found.get(key, 0.0) + float(value)
    return found


@rabbitmq
def test_a_chain_link_and_a_limited_task_parked_before_dispatch_keep_their_canvas(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """A chain's first link parked at delivery runs when handed its lock, and the chain
    goes on to its next link (the embedded chain travels in the parked signature); a
    ``lock_limit=2`` task whose two permits are taken is parked at delivery too, and the
    tenant never runs more than two at once."""
    name, _delayed = _names(rabbit)
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name)
    try:
        link = client.signature(ca.hold_for.name, args=("ch", 0.0), queue=name, immutable=True)
        client.send_task(ca.hold_for.name, args=("ch", 0.0), queue=name).get(timeout=30)
        r.delete("started:ch")
        holder = client.send_task(ca.hold_for.name, args=("ch", 1.0), queue=name)
        wait_until(lambda: r.llen("started:ch") == 1, timeout=15)
        nxt = client.signature(ca.hold_for.name, args=("ch-next", 0.0), queue=name, immutable=True)
        result = chain(link, nxt).apply_async()
        wait_until(lambda: r.llen(PARKED % "ch") == 1, timeout=15)
        assert "before dispatch" in proc.text()
        assert result.get(timeout=30) is not None  # the next link's token
        assert len(_started(r, "ch")) == 2 and len(_started(r, "ch-next")) == 1
        assert holder.get(timeout=30) is not None

        def tenant(seconds: float) -> Any:
            return client.send_task(ca.tenant_job.name, args=("tn", seconds), queue=name)

        tenant(0.0).get(timeout=30)
        r.delete("started:tn", "sections:limit")
        first = [tenant(1.0) for _ in range(2)]
        wait_until(lambda: r.llen("started:tn") == 2, timeout=15)
        waiting = [tenant(0.05) for _ in range(3)]
        wait_until(lambda: proc.text().count("before dispatch") == 4, timeout=15)
        stored = [
            signing_payload(v)
            for k in r.scan_iter(match="*tenant:tn*:parked:messages")
            for v in r.hvals(k)
        ]
        assert len(stored) == 3  # each says when its run first tried for its permit
        assert all(isinstance(h.get(FIRST_TRY_HEADER), float) for h in stored), stored
        for sent in first + waiting:
            sent.get(timeout=30)
        assert sorted(_started(r, "tn")) == sorted(s.id for s in first + waiting)  # once each
        spans = []
        for line in r.lrange("sections:limit", 0, -1):
            key, _task_id, enter, leave = line.decode().split()
            if key == "tn":
                spans.append((float(enter), float(leave)))
        assert len(spans) == 5
        for enter, _leave in spans:  # never a third one inside two others
            assert sum(1 for a, b in spans if a <= enter < b) <= 2
        _nothing_left(r, "ch")
        assert "ERROR" not in proc.text()
    finally:
        proc.kill()
        client.close()


def test_the_parked_signature_is_what_a_pool_process_would_send_again(
    broker: RedisServer,
) -> None:
    """In the main process, from the broker's message alone: the signed signature keeps the
    task id, its arguments, links, chain, priority, custom headers and result routing,
    counts the parking as a re-queue and drops nothing a re-sent task needs; a limited
    task's also says when it first tried for its permit. The MAC is checked as a release
    checks it (signed for this lock and this run)."""
    r = broker.client()
    queue = f"sig-{secrets.token_hex(3)}"
    holder = RedisLock(r, "job:sig", ttl=60, owner="holder", auto_renew=False)
    holder.acquire()
    parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen(), envelopes=False)
    sent = ca.hold_for.apply_async(
        ("sig", 0.5),
        queue=queue,
        link=ca.hold_for.si("sig-link", 0.0),
        priority=3,
        headers={"x-custom": "kept"},
    )
    message = _fetch(queue, parker=parker)
    entries = r.hgetall(PARKED % "sig" + ":messages")
    assert list(entries) == [sent.id.encode()]
    entry = entries[sent.id.encode()]
    key = settings_for(ca.app).signing_key
    signature = signing.open_signature(key, b"redislock:{job:sig}", sent.id.encode(), entry)
    again = ca.app.signature(signature)
    options = again.options
    assert again.task == ca.hold_for.name and list(again.args) == ["sig", 0.5]
    assert options["task_id"] == sent.id and options["priority"] == 3
    assert options["headers"][REQUEUE_HEADER] == 1
    assert options["headers"]["x-custom"] == "kept"
    assert FIRST_TRY_HEADER not in options["headers"]
    assert [dict(s)["args"] for s in options["link"]] == [["sig-link", 0.0]]
    assert options.get("reply_to") == message.properties.get("reply_to") is not None
    with pytest.raises(signing.Refused):  # signed for this lock and run only
        signing.open_signature(key, b"redislock:{job:other}", sent.id.encode(), entry)
    holder.release()  # (a plain lock's release: the parked task is the sweeper's to hand on)


@pytest.mark.parametrize("how", ["refused", "blackhole"])
def test_a_locks_redis_that_does_not_answer_pauses_the_check_not_the_main_loop(
    broker: RedisServer, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Locks in a Redis of their own, behind a proxy that refuses connections or forwards
    nothing: the first check fails (its socket timeout, in the main loop), the message
    is delivered (a pool process decides), and the checks pause: the next messages are
    delivered unchecked, though the key is held, until the pause ends; then a held key's
    message parks again."""
    from celery import Celery

    from celery_redislock import LockedTask
    from celery_redislock.testing import FaultProxy

    queue = f"pause-{secrets.token_hex(3)}"
    r = broker.client()
    with FaultProxy(broker) as proxy:
        app = Celery("pause", broker=broker.url)
        app.conf.redislock_url = proxy.url
        app.conf.redislock_park_fallback = False
        app.conf.redislock_redis_options = {"socket_timeout": 0.3, "socket_connect_timeout": 0.3}

        @app.task(bind=True, base=LockedTask, lock_key="job:{name}", shared=False)
        def job(self: Any, name: str) -> None:
            pass

        @app.task(bind=True, base=LockedTask, lock_key="job:{name}", shared=False)
        def other(self: Any, name: str) -> None:
            pass

        try:
            outage = Outage()  # (a consumer's Parkers share it)
            seen = EveryKeySeen()
            parker = Parker(job, app, revoked=set(), seen=seen, envelopes=False, outage=outage)
            other_parker = Parker(
                other, app, revoked=set(), seen=EveryKeySeen(), envelopes=False, outage=outage
            )
            RedisLock(r, "job:p", ttl=60, owner="holder", auto_renew=False).acquire()
            for send in (job, job, other, job):  # (fetched in this order)
                send.apply_async(("p",), queue=queue)
            proxy.partition(blackhole=how == "blackhole")
            with caplog.at_level("WARNING", logger="celery_redislock.celery.parking"):
                _fetch(queue, app=app, parker=parker, parks=False)
            assert outage.paused() and parker.outage is other_parker.outage
            assert [m for m in caplog.messages if "the locks' Redis did not answer" in m]
            proxy.heal()
            _fetch(queue, app=app, parker=parker, parks=False)  # paused: not even asked
            _fetch(queue, app=app, parker=other_parker, parks=False)  # another task type too
            assert not r.llen(PARKED % "p")
            outage.until = 0.0  # the pause over
            _fetch(queue, app=app, parker=parker, parks=True)
            assert r.llen(PARKED % "p") == 1
        finally:
            app.close()


def test_a_broker_that_does_not_take_the_fallback_copy_pauses_the_check_and_loses_nothing(
    broker: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fallback copies on, the broker's publishing connection (``broker_write_url``) behind
    a proxy that refuses connections: a contended message is parked, its copy's publish
    fails, and the message is delivered (its pool process finds the task parked and sends
    the copy); the check pauses for every task type. Healed, a parked message's fallback
    copy is sent as from its own request: the task's id its parent, its root kept."""
    from celery import Celery

    from celery_redislock import LockedTask
    from celery_redislock.testing import FaultProxy

    queue = f"pause-copy-{secrets.token_hex(3)}"
    r = broker.client()
    with FaultProxy(broker) as proxy:
        app = Celery("pause-copy", broker=broker.url)
        app.conf.broker_write_url = proxy.url
        app.conf.redislock_url = broker.url
        app.conf.redislock_park_fallback = True
        app.conf.task_publish_retry_policy = {"max_retries": 1, "interval_start": 0}
        app.conf.broker_transport_options = {"socket_connect_timeout": 0.3, "socket_timeout": 0.3}

        @app.task(bind=True, base=LockedTask, lock_key="job:{name}", shared=False)
        def job(self: Any, name: str) -> None:
            pass

        try:
            outage = Outage()
            seen = EveryKeySeen()
            parker = Parker(job, app, revoked=set(), seen=seen, envelopes=False, outage=outage)
            RedisLock(r, "job:c", ttl=60, owner="holder", auto_renew=False).acquire()
            first = job.apply_async(("c",), queue=queue)
            second = job.apply_async(("c",), queue=queue, root_id="the-root")
            proxy.partition()
            with caplog.at_level("WARNING", logger="celery_redislock.celery.parking"):
                _fetch(queue, app=app, parker=parker, parks=False)
            assert outage.paused()
            assert [m for m in caplog.messages if "the broker did not take a fallback copy" in m]
            # Parked all the same (its pool process finds it so and sends the copy).
            assert r.lrange(PARKED % "c", 0, -1) == [first.id.encode()]
            proxy.heal()
            outage.until = 0.0
            _fetch(queue, app=app, parker=parker, parks=True)
            assert r.lrange(PARKED % "c", 0, -1) == [first.id.encode(), second.id.encode()]
            copy = _fetch(queue, app=app)  # the second's fallback copy (an eta message)
            assert copy.headers["id"] == second.id and copy.headers["eta"]
            assert copy.headers["parent_id"] == second.id
            assert copy.headers["root_id"] == "the-root"
        finally:
            app.close()


# ----------------------------------------------------- the hand-over channel (RabbitMQ)


@rabbitmq
def test_a_handed_task_is_taken_in_while_every_slot_runs(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """The hand-over queue is consumed on a channel of its own, with a window of its own:
    a task published to ``<queue>.redislock`` while both slots run long tasks is received
    at once (no longer ready in RabbitMQ), not when a slot frees; it runs after them, once."""
    name, _delayed = _names(rabbit)
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name, concurrency=2)
    try:
        long = [
            client.send_task(ca.hold_for.name, args=(f"slot{i}", 2.0), queue=name) for i in (0, 1)
        ]
        wait_until(lambda: r.llen("started:slot0") == r.llen("started:slot1") == 1, timeout=15)
        handed = client.send_task(ca.hold_for.name, args=("hq", 0.0), queue=f"{name}.redislock")
        wait_until(lambda: rabbit.count(f"{name}.redislock") == 0, timeout=1.5)
        assert not r.llen("started:hq") and all(not res.ready() for res in long)
        assert handed.get(timeout=30) is not None
        assert [res.get(timeout=30) is not None for res in long] == [True, True]
        assert len(_started(r, "hq")) == 1
        assert "could not consume the hand-over queues" not in proc.text()
    finally:
        proc.kill()
        client.close()


def test_a_finished_tasks_ack_waits_for_its_keys_hand_over_at_most_briefly() -> None:
    """``handoff_channel.defer_ack`` on a real kombu event loop: an ack of a key with a
    hand-over expected waits for it and goes when it arrives; one whose hand-over never
    comes goes after ACK_WAIT, and its key is no longer expected; a key with nothing
    expected is acked at once; a stopping channel flushes what waits."""
    from kombu.asynchronous import Hub, set_event_loop

    from celery_redislock.celery import handoff_channel as hc

    hub = Hub()
    set_event_loop(hub)
    state = hc._state
    saved = (state.active, dict(state.expected), dict(state.waiting), state.hub, state.loop_thread)
    acked: list[str] = []
    try:
        state.active, state.expected, state.waiting, state.hub = True, {}, {}, hub
        state.loop_thread = threading.get_ident()  # (this test runs the hub's timers)
        assert not hc.defer_ack(b"k", lambda: acked.append("none expected"))
        hc.parked(b"k")
        hc.parked(b"k")
        assert hc.expecting() and state.expected[b"k"] == 2
        assert hc.defer_ack(b"k", lambda: acked.append("first"))
        assert acked == []
        hc.received(b"k")  # its hand-over: the ack goes now
        assert acked == ["first"] and state.expected[b"k"] == 1
        assert hc.defer_ack(b"k", lambda: acked.append("second"))
        deadline = time.monotonic() + 5
        while len(acked) < 2 and time.monotonic() < deadline:
            hub.fire_timers(propagate=(Exception,))
            time.sleep(0.001)
        assert acked == ["first", "second"]  # timed out: its hand-over went elsewhere
        assert not hc.expecting() and not state.waiting
        hc.received(b"k")  # a late one changes nothing
        assert not hc.expecting() and acked == ["first", "second"]
        # From another thread (a thread pool's): nothing changes off the loop; the loop
        # takes the ack through call_soon and holds it for the key's hand-over.
        hc.parked(b"t")
        answers: list[bool] = []
        thread = threading.Thread(
            target=lambda: answers.append(hc.defer_ack(b"t", lambda: acked.append("threaded")))
        )
        thread.start()
        thread.join()
        assert answers == [True] and not state.waiting and acked[-1] == "second"
        next(hub.create_loop())  # (one turn: the ready callbacks run)
        assert len(state.waiting[b"t"]) == 1
        hc.received(b"t")
        assert acked[-1] == "threaded" and not state.waiting
        hc.parked(b"other")
        assert hc.defer_ack(b"other", lambda: acked.append("flushed"))
        state.flush()
        assert acked[-1] == "flushed" and not state.waiting
        for n in range(hc.EXPECTED_KEYS + 10):  # bounded
            hc.parked(b"key%d" % n)
        assert len(state.expected) <= hc.EXPECTED_KEYS
    finally:
        state.active, state.expected, state.waiting, state.hub, state.loop_thread = saved
        set_event_loop(None)
        hub.close()


def test_the_hand_over_channel_consumes_when_celery_s_consumer_does() -> None:
    """``handoff_channel._consume_with``: the hand-over consumer starts only when Celery's
    loop starts its task consumer (not at the step's start); one that fails to start (not a
    connection error) puts its queues back on Celery's consumer, consumed there; a
    connection error goes to Celery (its consumer restarts)."""
    from celery_redislock.celery import handoff_channel as hc

    class Fake:
        def __init__(self, fail: BaseException | None = None) -> None:
            self.calls = 0
            self.fail = fail
            self.added: list[str] = []
            self.channel = SimpleNamespace(close=lambda: None)

        def consume(self) -> None:
            self.calls += 1
            if self.fail is not None:
                raise self.fail

        def add_queue(self, queue: Any) -> None:
            self.added.append(queue.name)

    queue = SimpleNamespace(name="q.redislock")
    saved = hc._state.active
    try:
        c = SimpleNamespace(connection_errors=(ConnectionError,), redislock_handoff_consumer=1)
        celery_consumer, own = Fake(), Fake()
        hc._consume_with(c, celery_consumer, own, [queue])
        assert own.calls == 0  # not before Celery's loop consumes
        celery_consumer.consume()
        assert (celery_consumer.calls, own.calls, celery_consumer.added) == (1, 1, [])

        hc._state.active = True
        celery_consumer, own = Fake(), Fake(fail=RuntimeError("refused"))
        hc._consume_with(c, celery_consumer, own, [queue])
        celery_consumer.consume()
        assert celery_consumer.added == ["q.redislock"] and celery_consumer.calls == 2
        assert c.redislock_handoff_consumer is None and not hc._state.active

        celery_consumer, own = Fake(), Fake(fail=ConnectionError("lost"))
        hc._consume_with(c, celery_consumer, own, [queue])
        with pytest.raises(ConnectionError):
            celery_consumer.consume()
        assert celery_consumer.added == []
    finally:
        hc._state.active = saved
