"""The task queues' prefetch window narrowed while a handed task runs (RabbitMQ): a pool
process running a task of a hand-over queue leaves no place in Celery's window for the
backlog to fill, so a reserved backlog message is never ahead of the next hot-key task
handed over (``handoff_channel._narrowed``). Kombu's own QoS and messages, then a real
worker on the real RabbitMQ."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kombu.common import QoS
from kombu.message import Message

from celery_redislock.celery import handoff_channel as hc
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import wait_until
from .conftest import Rabbit
from .test_delay_queues import _rabbit_worker, rabbitmq
from .test_parking_signatures import _names, _started


class _Channel:
    """What a kombu Message settles through: records each call."""

    no_ack_consumers = None

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def basic_ack(self, tag: Any, multiple: bool = False) -> None:
        self.calls.append("ack")
        if self.fail:
            raise ConnectionError("the connection is gone")

    def basic_reject(self, tag: Any, requeue: bool = False) -> None:
        self.calls.append(f"reject requeue={requeue}")


def _consumer(value: int, max_prefetch: int | None = None) -> Any:
    """A consumer whose ``qos`` records each window its loop sends the broker."""
    sent: list[int] = []
    qos = QoS(lambda prefetch_count: sent.append(prefetch_count), value, max_prefetch)
    qos.update()  # (Tasks.start sends the first)
    return SimpleNamespace(qos=qos, sent=sent)


def _window(c: Any) -> int:
    """The window the broker has once Celery's loop applied the qos (``asynloop``: when
    ``qos.prev != qos.value``)."""
    if c.qos.prev != c.qos.value:
        c.qos.update()
    return int(c.sent[-1])


def _message(tag: int = 1, fail: bool = False) -> Message:
    return Message(body=b"{}", delivery_tag=tag, channel=_Channel(fail=fail))


@pytest.mark.parametrize("settle", ["ack", "reject", "requeue"])
def test_a_handed_message_narrows_the_window_until_it_is_settled(settle: str) -> None:
    """One narrower on arrival; given back once, however the message is settled (and a
    second settle, which kombu refuses, gives nothing more back)."""
    c, message = _consumer(4), _message()
    handled: list[Any] = []
    hc._on_handed(c, handled.append, message)
    assert handled == [message] and _window(c) == 3
    getattr(message, settle)()
    assert _window(c) == 4 and message.channel.calls
    with pytest.raises(Exception):  # noqa: B017 (kombu's MessageStateError)
        message.ack()
    assert _window(c) == 4 and c.qos.value == 4


def test_a_settle_that_fails_still_gives_the_place_back() -> None:
    """An ack lost with its connection: the place goes back all the same (Celery makes a
    new window at the reconnect; the old one is given back harmlessly)."""
    c, message = _consumer(2), _message(fail=True)
    hc._narrowed(c, message)
    assert _window(c) == 1
    with pytest.raises(ConnectionError):
        message.ack()
    assert _window(c) == 2


def test_a_give_back_after_a_reconnect_leaves_the_new_window_alone() -> None:
    """Celery's consumer restarts (a new connection: a new qos) while a handed task runs,
    and a handed task of the new connection narrows the new window: the first one's
    give-back, after that (its ack failing with its connection), goes to the old qos
    only; the new window stays narrowed, and nothing is sent for it."""
    c, old = _consumer(2), _message(1, fail=True)
    hc._narrowed(c, old)
    assert _window(c) == 1
    restarted = _consumer(2)
    c.qos, c.sent = restarted.qos, restarted.sent  # (Tasks.start: a new QoS)
    new = _message(2)
    hc._narrowed(c, new)
    assert _window(c) == 1
    with pytest.raises(ConnectionError):
        old.ack()
    assert _window(c) == 1 and c.sent == [2, 1]
    new.ack()
    assert _window(c) == 2 and c.qos.value == 2


@pytest.mark.parametrize("value", [0, 1])
def test_a_window_at_its_least_or_unbounded_is_left_so(value: int) -> None:
    """A window of 1 is not narrowed (none of 0), and nothing is given back for it: the
    window never grows past what it was, and no window is sent again for it."""
    c = _consumer(value)
    messages = [_message(i) for i in range(3)]
    for message in messages:
        hc._narrowed(c, message)
    assert _window(c) == value
    for message in messages:
        message.ack()
    assert _window(c) == value and c.sent == [value]


def test_several_handed_messages_narrow_it_down_to_one() -> None:
    """Three handed tasks on a window of 3: at least 1, and one narrower per handed task
    still running as they are settled (none given back while another still runs);
    Celery's own value again once the last is."""
    c = _consumer(3)
    messages = [_message(i) for i in range(3)]
    for message in messages:
        hc._narrowed(c, message)
    assert _window(c) == 1
    messages[0].ack()
    assert _window(c) == 1
    messages[1].reject()
    assert _window(c) == 2
    messages[2].ack()
    assert _window(c) == 3 and c.sent == [3, 1, 2, 3]


def test_no_consumer_qos_is_no_narrowing() -> None:
    message = _message()
    hc._narrowed(SimpleNamespace(), message)
    message.ack()


# ------------------------------------------------------- Celery's own changes meanwhile


def test_eta_tasks_received_and_applied_meanwhile_leave_the_window_as_it_was() -> None:
    """Celery widens its window by one for each ``eta`` task it holds and narrows it back
    when the task is due (``strategy``, ``Consumer.apply_eta_task``). A due task's
    narrowing that lands on a window narrowed to 1 by the hand-overs must not be lost to
    the floor of 1: the hand-overs' give-backs would then leave the window wider than
    Celery's own for good (each such round one wider: a worker reserving ever more)."""
    c = _consumer(2)
    a, b = _message(1), _message(2)
    hc._narrowed(c, a)  # a handed task runs
    c.qos.increment_eventually()  # an eta task received
    hc._narrowed(c, b)  # another handed task runs
    assert _window(c) == 1
    c.qos.decrement_eventually()  # the eta task due: to the pool
    a.ack()
    b.ack()
    assert _window(c) == 2


def test_the_autoscaler_shrinking_meanwhile_leaves_the_window_as_celery_sets_it() -> None:
    """The autoscaler narrows the window by the multiplier per process it stops
    (``Consumer._update_prefetch_count``): a hand-over's give-back after it must leave it
    at Celery's value, not one wider."""
    c = _consumer(2)  # two processes, multiplier 1
    message = _message()
    hc._narrowed(c, message)
    c.qos.decrement_eventually(1)  # one process stopped: Celery's window is 1
    message.ack()
    assert _window(c) == 1


def test_a_window_celery_sets_meanwhile_is_the_one_left() -> None:
    """After a reconnect Celery sets its window outright as tasks finish
    (``_restore_prefetch_count_after_connection_restart``: ``qos.value = n``): once the
    handed task is settled, the window is that value, not one more."""
    c = _consumer(2)
    message = _message()
    hc._narrowed(c, message)
    c.qos.value = 4  # restored to the maximum
    c.qos.set(c.qos.value)
    assert _window(c) == 3  # (still one narrower while the handed task runs)
    message.ack()
    assert _window(c) == 4


def test_an_eta_task_limit_below_the_window_does_not_shrink_it() -> None:
    """``worker_eta_task_limit`` caps Celery's qos increments (kombu's ``max_prefetch``):
    a give-back capped so would leave a window of 8 at the limit, 4, for good."""
    c = _consumer(8, max_prefetch=4)
    message = _message()
    hc._narrowed(c, message)
    assert _window(c) == 7
    message.ack()
    assert _window(c) == 8


@rabbitmq
def test_a_running_handed_task_leaves_no_place_for_the_backlog(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """Two slots, a window of two (prefetch multiplier 1). A handed task (published to
    ``<queue>.redislock``) runs in one slot; two backlog tasks come: one runs in the other
    slot, and the other stays in RabbitMQ (not reserved by the worker, where it would take
    the next slot ahead of a hand-over) until the handed task is done. Every task runs
    once."""
    name, _delayed = _names(rabbit)
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name, concurrency=2)
    try:
        handed = client.send_task(ca.hold_for.name, args=("hq", 3.0), queue=f"{name}.redislock")
        wait_until(lambda: r.llen("started:hq") == 1, timeout=15)
        backlog = [
            client.send_task(ca.hold_for.name, args=(f"b{i}", 1.0), queue=name) for i in (0, 1)
        ]
        wait_until(lambda: r.llen("started:b0") + r.llen("started:b1") == 1, timeout=10)
        time.sleep(0.5)  # (a place in the window would be filled by now)
        assert rabbit.count(name) == 1, "a backlog task was reserved while the handed one ran"
        assert not handed.ready()
        assert handed.get(timeout=30) is not None
        assert [res.get(timeout=30) is not None for res in backlog] == [True, True]
        assert [len(_started(r, k)) for k in ("hq", "b0", "b1")] == [1, 1, 1]
        assert rabbit.count(name) == 0
        assert "Traceback" not in proc.text()
    finally:
        proc.kill()
        client.close()


@rabbitmq
def test_an_eta_task_due_while_hand_overs_run_leaves_the_window_as_it_was(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """Two slots, a window of two. A handed task runs (window 1); an ``eta`` task comes
    (Celery widens its window: 2), a second handed task runs (1), the eta task falls due
    (Celery narrows its window: the floor, 1). Once all of them are done the window is
    two again: four backlog tasks then leave two in RabbitMQ (a window of three, the
    eta task's narrowing lost to the floor, would reserve a third). Every task runs once."""
    name, _delayed = _names(rabbit)
    r = broker.client()
    proc, client = _rabbit_worker(broker, tmp_path, name, concurrency=2)
    try:
        handoff = f"{name}.redislock"
        first = client.send_task(ca.hold_for.name, args=("ha", 4.0), queue=handoff)
        wait_until(lambda: r.llen("started:ha") == 1, timeout=15)
        eta = client.send_task(ca.hold_for.name, args=("e", 0.1), queue=name, countdown=2)
        wait_until(lambda: rabbit.count(name) == 0, timeout=10)  # (received: held till due)
        second = client.send_task(ca.hold_for.name, args=("hb", 4.0), queue=handoff)
        wait_until(lambda: r.llen("started:hb") == 1, timeout=10)
        assert not r.llen("started:e")  # (due while both hand-overs run)
        assert [res.get(timeout=30) is not None for res in (first, second, eta)] == [True] * 3
        time.sleep(0.5)  # (the loop sends the window)
        backlog = [
            client.send_task(ca.hold_for.name, args=(f"b{i}", 3.0), queue=name) for i in range(4)
        ]
        wait_until(lambda: sum(r.llen(f"started:b{i}") for i in range(4)) == 2, timeout=10)
        time.sleep(1.0)  # (a wider window would have been filled by now)
        assert rabbit.count(name) == 2, "the worker reserves more than its window"
        assert [res.get(timeout=30) is not None for res in backlog] == [True] * 4
        started = [len(_started(r, k)) for k in ("ha", "hb", "e", "b0", "b1", "b2", "b3")]
        assert started == [1] * 7
        assert "Traceback" not in proc.text()
    finally:
        proc.kill()
        client.close()
