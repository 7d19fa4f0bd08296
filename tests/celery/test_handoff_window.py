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


def _consumer(value: int) -> Any:
    return SimpleNamespace(qos=QoS(lambda **_: None, value))


@pytest.mark.parametrize("settle", ["ack", "reject", "requeue"])
def test_a_handed_message_narrows_the_window_until_it_is_settled(settle: str) -> None:
    """One narrower on arrival; given back once, however the message is settled (and a
    second settle, which kombu refuses, gives nothing more back)."""
    c, channel = _consumer(4), _Channel()
    message = Message(body=b"{}", delivery_tag=1, channel=channel)
    handled: list[Any] = []
    hc._on_handed(c, handled.append, message)
    assert handled == [message] and c.qos.value == 3
    getattr(message, settle)()
    assert c.qos.value == 4 and channel.calls
    with pytest.raises(Exception):  # noqa: B017 (kombu's MessageStateError)
        message.ack()
    assert c.qos.value == 4


def test_a_settle_that_fails_still_gives_the_place_back() -> None:
    """An ack lost with its connection: the place goes back all the same (Celery makes a
    new window at the reconnect; the old one is given back harmlessly)."""
    c = _consumer(2)
    message = Message(body=b"{}", delivery_tag=1, channel=_Channel(fail=True))
    hc._narrowed(c, message)
    assert c.qos.value == 1
    with pytest.raises(ConnectionError):
        message.ack()
    assert c.qos.value == 2


@pytest.mark.parametrize("value", [0, 1])
def test_a_window_at_its_least_or_unbounded_is_left_so(value: int) -> None:
    """A window of 1 is not narrowed (none of 0), and nothing is given back for it: the
    window never grows past what it was."""
    c = _consumer(value)
    messages = [Message(body=b"{}", delivery_tag=i, channel=_Channel()) for i in range(3)]
    for message in messages:
        hc._narrowed(c, message)
    assert c.qos.value == value
    for message in messages:
        message.ack()
    assert c.qos.value == value


def test_no_consumer_qos_is_no_narrowing() -> None:
    message = Message(body=b"{}", delivery_tag=1, channel=_Channel())
    hc._narrowed(SimpleNamespace(), message)
    message.ack()


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
