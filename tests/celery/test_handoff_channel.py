"""The hand-over channel (``celery.handoff_channel``) with real workers on RabbitMQ: a
thread pool (tasks finish off the event loop's thread), the hand-over queues under remote
control (``add_consumer`` / ``cancel_consumer`` / ``active_queues``), and a connection
lost at the hand-over consumer's own ``basic_consume``.

The workers run this module as their app (``tests.celery_app``'s, plus probes set by
environment variables: ``REDISLOCK_TEST_LOOP_PROBE`` records in the test's Redis every
call of the hub's ``call_later`` and every change of the hand-over pairing's state made
off the event loop's thread; ``REDISLOCK_TEST_CUT_AT_CONSUME=n`` holds the hand-over
consumer's n-th ``consume`` until the test has cut the worker's broker connections)."""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from .. import celery_app as ca
from .._celery import CeleryProcess, wait_until, worker
from .test_handoff_reconnect import (
    PROMPT,
    RABBITMQ,
    Relay,
    _client,
    _connected,
    _consumed_once,
    _consumers,
    _nothing_left,
    _queues,
    _sections,
    _send,
    _warm,
    rabbitmq,
)

if TYPE_CHECKING:
    from celery_redislock.testing import RedisServer

    from .conftest import Rabbit

#: The workers' app (``celery -A tests.celery.test_handoff_channel``).
app = ca.app

#: Where the loop probe writes: one line per call or change made off the loop's thread.
OFF_LOOP = "probe:off-loop"
#: The consume probe: it pushes here when it holds the consume, and waits for CUT_DONE.
AT_CONSUME, CUT_DONE = "probe:at-consume", "probe:cut-done"
#: What the held consume raised (its repr).
CONSUME_ERROR = "probe:consume-error"


def _install_loop_probe() -> None:
    """In the worker: record any ``Hub.call_later`` and any change of the pairing's
    ``expected`` / ``waiting`` made on a thread other than the hub's loop's (kombu's
    hub, its timer and those dicts are the loop's alone; ``call_soon`` is its one entry
    for other threads)."""
    from kombu.asynchronous import Hub

    from celery_redislock.celery import handoff_channel as hc

    def off_loop(what: str) -> None:
        hub = hc._state.hub
        loop = getattr(hub, "_loop_thread", None)
        if loop is not None and threading.get_ident() != loop:
            ca.r().rpush(OFF_LOOP, f"{what} on {threading.current_thread().name}")

    call_later = Hub.call_later

    def probed_call_later(self: Any, delay: float, callback: Any, *args: Any) -> Any:
        if self is hc._state.hub:
            off_loop(f"call_later({callback!r})")
        return call_later(self, delay, callback, *args)

    class LoopOnly(dict):  # type: ignore[type-arg]
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def __setitem__(self, key: Any, value: Any) -> None:
            off_loop(f"{self.name}[...] =")
            super().__setitem__(key, value)

        def __delitem__(self, key: Any) -> None:
            off_loop(f"del {self.name}[...]")
            super().__delitem__(key)

        def setdefault(self, key: Any, default: Any = None) -> Any:
            off_loop(f"{self.name}.setdefault")
            return super().setdefault(key, default)

        def pop(self, key: Any, *default: Any) -> Any:
            off_loop(f"{self.name}.pop")
            return super().pop(key, *default)

    Hub.call_later = probed_call_later  # type: ignore[method-assign]
    hc._state.expected = LoopOnly("expected")
    hc._state.waiting = LoopOnly("waiting")


def _install_consume_probe(at: int) -> None:
    """In the worker: the hand-over consumer's ``at``-th ``consume`` (its ``basic_consume``)
    waits, after telling the test, until the test has cut the connection under it, and
    records what it raises."""
    from celery_redislock.celery import handoff_channel as hc

    calls = [0]

    class CutAtConsume(hc.Consumer):  # type: ignore[misc,name-defined]
        def consume(self, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] != at:
                return super().consume(*args, **kwargs)
            ca.r().rpush(AT_CONSUME, str(time.monotonic()))
            ca.r().blpop([CUT_DONE], timeout=20)
            try:
                return super().consume(*args, **kwargs)
            except BaseException as exc:
                ca.r().rpush(CONSUME_ERROR, repr(exc))
                raise

    hc.Consumer = CutAtConsume  # type: ignore[attr-defined]


if os.environ.get("REDISLOCK_TEST_LOOP_PROBE"):
    _install_loop_probe()
if os.environ.get("REDISLOCK_TEST_CUT_AT_CONSUME"):
    _install_consume_probe(int(os.environ["REDISLOCK_TEST_CUT_AT_CONSUME"]))


# ------------------------------------------------------------------------ helpers


def _worker(
    broker: RedisServer, tmp_path: Path, queue: str, *, broker_url: str = RABBITMQ, **options: Any
) -> CeleryProcess:
    """A worker of this module's app on ``queue`` (RabbitMQ, or ``broker_url``; locks on
    ``broker``; fallback copies after 2 s), with ``options`` for ``worker()``."""
    env = {"REDISLOCK_TEST_BROKER": broker_url, "REDISLOCK_TEST_VT": "8", **options.pop("env", {})}
    return worker(
        broker.url,
        tmp_path / "w.log",
        extra=["-Q", queue],
        env=env,
        app="tests.celery.test_handoff_channel",
        **options,
    )


def _node(proc: CeleryProcess) -> str:
    """The worker's node name (``worker()`` names RabbitMQ workers per test process)."""
    return proc.args[proc.args.index("-n") + 1]


def _each_once_in_turn(r: redis.Redis, account: int, sent: list[Any]) -> list[Any]:
    """Every task sent ran its body exactly once, never two at once, the balance counts
    each once, and nothing is left held or parked: the sections, in order."""
    results = [res.get(timeout=60) for res in sent]
    spans = _sections(r, account)
    counted = collections.Counter(task_id for task_id, _, _ in spans)
    assert counted == {res.id: 1 for res in sent}, counted  # every one seen, once
    for (_, _, leave), (task_id, enter, _) in zip(spans, spans[1:]):
        assert enter >= leave, f"{task_id} entered at {enter} before {leave}"
    assert sorted(results) == list(range(1, len(sent) + 1))  # each saw the one before it
    assert int(r.get(f"balance:{account}") or 0) == len(sent)
    _nothing_left(r, account)
    return spans


def _clean_log(proc: CeleryProcess) -> None:
    text = proc.text()
    assert "Traceback" not in text, text[-4000:]
    assert "could not consume the hand-over queues" not in text


# -------------------------------------------------------------------------- tests


@rabbitmq
def test_a_thread_pool_acks_through_the_event_loop_and_runs_a_hot_key_once_in_turn(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """A ``-P threads -c 4`` worker on RabbitMQ, 40 tasks on one key: the tasks finish on
    the pool's threads, whose acks the hand-over pairing holds; every task ran once, one
    at a time, nothing is left held or parked, the log has no traceback, and neither the
    hub's timers nor the pairing's state were touched off the event loop's thread."""
    name = _queues(rabbit)
    r = broker.client()
    account = secrets.randbelow(10**9)
    client = _client(broker)
    env = {"REDISLOCK_TEST_LOOP_PROBE": "1"}
    proc = _worker(broker, tmp_path, name, pool="threads", concurrency=4, env=env)
    try:
        _consumed_once(name, samples=0)
        _warm(client, name, account, r)
        r.delete(OFF_LOOP)
        sent = _send(client, name, account, 40)
        spans = _each_once_in_turn(r, account, sent)
        assert len(spans) == 40
        assert proc.text().count("before dispatch") > 0  # parked at delivery: paired
        off = [line.decode() for line in r.lrange(OFF_LOOP, 0, -1)]
        assert not off, f"{len(off)} off the loop's thread, e.g. {off[:3]}"
        _clean_log(proc)
    finally:
        proc.kill()
        client.close()
        r.close()


def _control(client: Any, proc: CeleryProcess, command: str, queue: str) -> None:
    """``celery control <command> <queue>`` to the worker, answered."""
    replies = getattr(client.control, command)(
        queue, destination=[_node(proc)], reply=True, timeout=10
    )
    assert replies and all("ok" in next(iter(each.values())) for each in replies), replies


def _consumer_counts(queues: list[str]) -> list[int | None]:
    return [_consumers(queue) for queue in queues]


def _counts_become(queues: list[str], counts: list[int], samples: int = 3) -> None:
    """RabbitMQ counts ``counts`` consumers on ``queues``, and still does a little after."""
    wait_until(
        lambda: _consumer_counts(queues) == counts,
        timeout=20,
        what=f"consumers of {queues}: {counts} ({_consumer_counts(queues)})",
    )
    for _ in range(samples):
        time.sleep(0.1)
        assert _consumer_counts(queues) == counts, f"consumers of {queues}"


def _active_queues(client: Any, proc: CeleryProcess) -> list[str]:
    replies = client.control.inspect(destination=[_node(proc)], timeout=10).active_queues()
    return sorted(queue["name"] for queue in (replies or {}).get(_node(proc), []))


@rabbitmq
def test_a_queue_added_by_remote_control_brings_its_hand_over_queue_along(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """A worker started without queue ``r`` is told ``add_consumer r``: it consumes ``r``
    and ``r.redislock`` (one consumer each), ``inspect active_queues`` lists both, and 20
    contended tasks on one key sent to ``r`` each run once, one at a time, following each
    other by hand-over (no gap a fallback copy's wait long: the handed tasks are taken in
    from ``r.redislock``), with nothing left held or parked."""
    base, name = _queues(rabbit), _queues(rabbit)
    r = broker.client()
    account = secrets.randbelow(10**9)
    client = _client(broker)
    proc = _worker(broker, tmp_path, base, concurrency=2)
    try:
        _consumed_once(base, samples=0)
        assert _consumer_counts([name, f"{name}.redislock"]) == [None, None]
        _control(client, proc, "add_consumer", name)
        _consumed_once(name)
        listed = _active_queues(client, proc)
        assert listed == sorted([base, f"{base}.redislock", name, f"{name}.redislock"]), listed
        _warm(client, name, account, r)
        spans = _each_once_in_turn(r, account, _send(client, name, account, 20))
        gaps = [b[1] - a[2] for a, b in zip(spans, spans[1:])]
        assert max(gaps) < PROMPT, f"gaps between runs: {gaps}"
        assert proc.text().count("before dispatch") > 0  # parked: hand-overs were needed
        assert f"started consuming from {name}.redislock on the hand-over channel" in proc.text()
        _consumed_once(base, samples=0)
        _clean_log(proc)
    finally:
        proc.kill()
        client.close()
        r.close()


@rabbitmq
def test_remote_control_of_hand_over_queues_acts_on_the_hand_over_channel(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """``cancel_consumer r`` stops ``r`` and ``r.redislock``; ``add_consumer r.redislock``
    consumes it once, however often it is told (not a second consumer on Celery's
    channel); ``cancel_consumer r.redislock`` stops it (not a no-op: it is not on Celery's
    consumer); ``inspect active_queues`` follows; the worker's other queue is untouched."""
    base, name = _queues(rabbit), _queues(rabbit)
    client = _client(broker)
    proc = _worker(broker, tmp_path, f"{base},{name}", concurrency=2)
    handoff, both = f"{name}.redislock", [base, f"{base}.redislock"]
    try:
        _counts_become([*both, name, handoff], [1, 1, 1, 1])
        assert handoff in _active_queues(client, proc)

        _control(client, proc, "cancel_consumer", name)
        _counts_become([*both, name, handoff], [1, 1, 0, 0])
        assert _active_queues(client, proc) == sorted(both)

        for _ in range(2):
            _control(client, proc, "add_consumer", handoff)
            _counts_become([*both, name, handoff], [1, 1, 0, 1])
        assert _active_queues(client, proc) == sorted([*both, handoff])

        _control(client, proc, "cancel_consumer", handoff)
        _counts_become([*both, name, handoff], [1, 1, 0, 0])
        assert _active_queues(client, proc) == sorted(both)

        _control(client, proc, "add_consumer", name)
        _counts_become([*both, name, handoff], [1, 1, 1, 1])
        _clean_log(proc)
    finally:
        proc.kill()
        client.close()


@rabbitmq
def test_a_connection_lost_at_the_hand_over_consumers_basic_consume_restarts_the_consumer(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """The worker reaches RabbitMQ through a relay. Its connections are cut once; as its
    consumer comes back, the hand-over consumer's ``basic_consume`` is held and the new
    connection cut under it: the connection error goes to Celery, which restarts the
    consumer (not the hand-over queues put back on Celery's channel, not the worker
    gone); after that reconnect each queue has one consumer and 20 contended tasks on one
    key each run once, in turn, by hand-over, with nothing left held or parked."""
    name = _queues(rabbit)
    r = broker.client()
    account = secrets.randbelow(10**9)
    relay = Relay().start()
    client = _client(broker)
    env = {"REDISLOCK_TEST_CUT_AT_CONSUME": "2"}
    proc = _worker(broker, tmp_path, name, broker_url=relay.url, concurrency=2, env=env)
    try:
        _consumed_once(name, samples=0)
        assert relay.cut() >= 1
        wait_until(lambda: r.llen(AT_CONSUME), timeout=30, what="the second consume held")
        assert relay.cut() >= 1  # under the held basic_consume
        r.rpush(CUT_DONE, "1")
        _connected(proc, 3)
        _consumed_once(name)
        raised = [e.decode() for e in r.lrange(CONSUME_ERROR, 0, -1)]
        assert len(raised) == 1, raised  # the held basic_consume failed, on the lost link
        lost = proc.text().split("Connection to broker lost")
        assert len(lost) >= 3 and raised[0] in lost[2].splitlines()[0], (raised, lost[2][:300])
        _warm(client, name, account, r)
        spans = _each_once_in_turn(r, account, _send(client, name, account, 20))
        gaps = [b[1] - a[2] for a, b in zip(spans, spans[1:])]
        assert max(gaps) < PROMPT, f"gaps between runs: {gaps}"
        assert r.llen(AT_CONSUME) == 1
        assert "could not consume the hand-over queues" not in proc.text()
        _consumed_once(name, samples=2)
    finally:
        proc.kill()
        client.close()
        relay.close()
        r.close()
