"""The task queues' prefetch window narrowed while a handed task runs
(``handoff_channel._narrowed``), across a loss of the worker's AMQP connection: a real
prefork worker reaches RabbitMQ through a relay that reads the AMQP frames it sends,
records each ``basic.qos`` (the windows the broker is told) and cuts the consumer's
connection at a chosen one, or at once.

Celery restarts its consumer on a new connection with a new ``QoS`` object. A narrowing
of the old one is given back on the old one only (its handed task's settle fails with its
channel): the new consumer's window ends up Celery's own (``inspect stats``), told to the
broker and kept by it (a backlog leaves in RabbitMQ all but that many), neither narrowed
for good nor wider; every task's body runs once, and nothing is left held or parked."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import CeleryProcess, wait_until, worker
from .conftest import Rabbit
from .test_handoff_channel import _node
from .test_handoff_reconnect import Relay, _client, _connected, _consumed_once, _shut
from .test_handoff_reconnect import rabbitmq as rabbitmq
from .test_parking_signatures import _names, _nothing_left, _started

#: The worker's app (``celery -A tests.celery.test_handoff_window_reconnect``):
#: ``tests.celery_app``'s, with Celery's prefetch reduction after a reconnect turned off
#: when ``REDISLOCK_TEST_NO_PREFETCH_REDUCTION`` is set.
app = ca.app
if os.environ.get("REDISLOCK_TEST_NO_PREFETCH_REDUCTION"):
    app.conf.worker_enable_prefetch_count_reduction = False

#: The protocol header a client opens an AMQP 0-9-1 connection with.
_HEADER = 8
#: A method frame's (class, method) of ``basic.qos``.
_BASIC_QOS = struct.pack(">HH", 60, 10)


class QosRelay(Relay):
    """A :class:`Relay` that reads the AMQP frames the worker sends (not those the broker
    sends back): it records the prefetch count of each global ``basic.qos`` it forwards
    (the task consumer's window: Celery sets ``qos_global`` on RabbitMQ, the hand-over
    channel a window per consumer), and closes the connection that sends one of a count
    it was told (:meth:`cut_at`), or that sent the last one (:meth:`cut_consumer`)."""

    def __init__(self) -> None:
        super().__init__()
        #: The global ``basic.qos`` prefetch counts forwarded, in order.
        self.windows: list[int] = []
        #: The connection (worker side, broker side) that sent the last of them.
        self.consumer: tuple[socket.socket, socket.socket] | None = None
        self._cut: tuple[int, bool] | None = None
        self.fired = threading.Event()

    def cut_at(self, count: int, forwarded: bool) -> None:
        """Close the connection that sends the next global ``basic.qos`` of ``count``,
        as it sends it: that frame forwarded to the broker first, or not at all."""
        with self.mutex:
            self._cut = (count, forwarded)

    def cut_consumer(self) -> None:
        with self.mutex:
            consumer = self.consumer
        assert consumer is not None, "no basic.qos went through"
        _shut(*consumer)

    def sent(self) -> list[int]:
        with self.mutex:
            return list(self.windows)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        if source.getpeername()[1] == self.target[1]:  # (from the broker)
            super()._pump(source, sink)
            return
        pending: bytes | None = b""
        try:
            while pending is not None:
                data = source.recv(65536)
                if not data:
                    break
                pending = self._frames(source, sink, pending + data)
        except OSError:
            pass
        _shut(source, sink)

    def _frames(self, source: socket.socket, sink: socket.socket, pending: bytes) -> bytes | None:
        """Forward the whole frames of ``pending`` (and the protocol header); what is
        left of it, or None: the connection is to be closed."""
        out: list[bytes] = []
        if pending.startswith(b"AMQP"):
            if len(pending) < _HEADER:
                return pending
            out.append(pending[:_HEADER])
            pending = pending[_HEADER:]
        while len(pending) >= 7:
            kind, _channel, size = struct.unpack(">BHI", pending[:7])
            if len(pending) < 8 + size:
                break
            frame, pending = pending[: 8 + size], pending[8 + size :]
            cut = False
            if kind == 1 and frame[7:11] == _BASIC_QOS:
                _size, count, flags = struct.unpack(">IHB", frame[11:18])
                if flags & 1:
                    cut, forward = self._qos(source, sink, count)
                    if not forward:
                        frame = b""
            out.append(frame)
            if cut:
                sink.sendall(b"".join(out))
                self.fired.set()
                return None
        sink.sendall(b"".join(out))
        return pending

    def _qos(self, source: socket.socket, sink: socket.socket, count: int) -> tuple[bool, bool]:
        """A global ``basic.qos`` of ``count``: (cut there, forward it)."""
        with self.mutex:
            armed = self._cut
            cut, forward = False, True
            if armed is not None and armed[0] == count:
                self._cut = None
                cut, forward = True, armed[1]
            if forward:
                self.windows.append(count)
                self.consumer = (source, sink)
        return cut, forward


# ------------------------------------------------------------------------ helpers


@contextlib.contextmanager
def _rig(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit, slots: int, reduction: bool = True
) -> Iterator[tuple[str, str, Any, QosRelay, Any, CeleryProcess]]:
    """A worker of ``slots`` processes (Celery's window: as many, prefetch multiplier 1;
    with Celery's prefetch reduction after a reconnect, or not) reaching RabbitMQ
    through a :class:`QosRelay`, its queues consumed and its window told to the broker:
    (queue, delay queue, locks client, relay, client app, worker); all stopped and closed
    after."""
    name, delayed = _names(rabbit)
    env = {"REDISLOCK_TEST_VT": "8"}
    if not reduction:
        env["REDISLOCK_TEST_NO_PREFETCH_REDUCTION"] = "1"
    with contextlib.ExitStack() as stack:  # (closed in the reverse order: the worker first)
        r = broker.client()
        stack.callback(r.close)
        relay = QosRelay()
        relay.start()
        stack.callback(relay.close)
        client = _client(broker)
        stack.callback(client.close)
        env["REDISLOCK_TEST_BROKER"] = relay.url
        proc = worker(
            broker.url,
            tmp_path / "w.log",
            concurrency=slots,
            extra=["-Q", name],
            env=env,
            app="tests.celery.test_handoff_window_reconnect",
        )
        stack.callback(proc.kill)
        _consumed_once(name, samples=0)
        wait_until(lambda: relay.sent()[-1:] == [slots], timeout=10, what=f"window {slots} told")
        yield name, delayed, r, relay, client, proc


def _inspect(client: Any, proc: CeleryProcess, what: str) -> Any:
    node = _node(proc)
    replies = getattr(client.control.inspect(destination=[node], timeout=5), what)()
    return (replies or {}).get(node)


def _celery_window(client: Any, proc: CeleryProcess) -> int:
    """Celery's own window now (its ``qos.value``: ``inspect stats``)."""
    return int(_inspect(client, proc, "stats")["prefetch_count"])


def _handed(client: Any, name: str, key: str, seconds: float) -> Any:
    """A task of ``key`` published to the hand-over queue, as a hand-over would."""
    return client.send_task(ca.hold_for.name, args=(key, seconds), queue=f"{name}.redislock")


def _running(r: Any, key: str) -> None:
    wait_until(lambda: r.llen(f"started:{key}") == 1, timeout=15, what=f"{key} running")


def _reconnected(proc: CeleryProcess, name: str) -> None:
    _connected(proc, 2)
    _consumed_once(name, samples=0)


def _drained(rabbit: Rabbit, name: str, delayed: str) -> None:
    """No message waits in the test's queues: the fallback copies of a redelivered handed
    task (parked behind its first run) have come back from the delay queue and been
    ignored (that run done), so none comes into the task queue later."""
    queues = (name, f"{name}.redislock", delayed)
    wait_until(
        lambda: all(not rabbit.count(q) for q in queues),
        timeout=30,
        what=f"the queues {queues} empty: {[rabbit.count(q) for q in queues]}",
    )


def _idle(client: Any, proc: CeleryProcess) -> bool:
    """The worker runs, reserves and holds (``eta``: Celery counts them in its window)
    nothing."""
    return all(_inspect(client, proc, what) == [] for what in ("active", "reserved", "scheduled"))


def _settled(client: Any, proc: CeleryProcess, r: Any, keys: list[str], *queues: Any) -> None:
    """Nothing held or parked for ``keys``, nothing waiting in the queues, and the worker
    idle."""
    for key in keys:
        _nothing_left(r, key)
    _drained(*queues)
    wait_until(lambda: _idle(client, proc), timeout=20, what="the worker idle")


def _window_kept(
    client: Any, proc: CeleryProcess, r: Any, rabbit: Rabbit, name: str, window: int
) -> None:
    """The worker, idle, reserves ``window`` messages of the task queue, no more and no
    less: of two more backlog tasks than that, ``window`` are taken (each runs in a slot
    of its own) and two stay in RabbitMQ; then each runs once."""
    keys = [f"w{i}" for i in range(window + 2)]
    backlog = [client.send_task(ca.hold_for.name, args=(key, 2.0), queue=name) for key in keys]
    wait_until(lambda: sum(r.llen(f"started:{k}") for k in keys) == window, timeout=15)
    time.sleep(1.0)  # (a wider window would have been filled by now)
    assert rabbit.count(name) == 2, f"the worker reserves other than its window, {window}"
    assert [res.get(timeout=30) is not None for res in backlog] == [True] * len(keys)
    assert [_started(r, k) for k in keys] == [[res.id] for res in backlog]
    for key in keys:
        _nothing_left(r, key)


# -------------------------------------------------------------------------- tests


@rabbitmq
@pytest.mark.parametrize("forwarded", [False, True], ids=["before it", "after it"])
def test_a_connection_lost_at_a_narrowed_windows_qos_leaves_celerys_window_after(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit, forwarded: bool
) -> None:
    """Three slots, a window of three. A handed task runs (window 2, told to the broker);
    a second comes, and the worker's connection is cut as its loop sends the window one
    narrower again (1): before the broker gets that ``basic.qos``, or just after. Both
    handed tasks run once (a redelivered copy waits for its first run and finds it done,
    or runs if the pool never got the first delivery), the first ending after the
    reconnect (its give-back on the old window). Once all is done the new consumer's
    window is Celery's own, at the broker too: the worker reserves that many.

    Celery's own is three, or two: with its default prefetch reduction after a reconnect
    (a window of two here, one task running), the increase that restores it is capped at
    three while an ``eta`` task's increase is in the value (a waiting handed copy's
    retry), and the restoring stops there; the ``eta`` task's decrease then leaves two
    (Celery's own arithmetic, ``qos.value`` alone: the narrowing never changes it)."""
    with _rig(broker, tmp_path, rabbit, slots=3) as (name, delayed, r, relay, client, proc):
        first = _handed(client, name, "h1", 4.0)
        _running(r, "h1")
        wait_until(lambda: relay.sent()[-1:] == [2], timeout=10, what="the narrowed window told")
        relay.cut_at(1, forwarded)
        second = _handed(client, name, "h2", 2.0)
        wait_until(relay.fired.is_set, timeout=15, what="the narrowed window sent")
        _reconnected(proc, name)
        assert not first.ready()  # (its settle comes after the reconnect)
        assert [res.get(timeout=30) is not None for res in (first, second)] == [True] * 2
        _settled(client, proc, r, ["h1", "h2"], rabbit, name, delayed)
        assert [_started(r, k) for k in ("h1", "h2")] == [[first.id], [second.id]]
        window = _celery_window(client, proc)
        assert window in (2, 3), (window, relay.sent())
        # A handed copy's eta retry may still be narrowing for a moment (seen once in CI:
        # the last window told was 1 just as all was settled): the broker must come back to
        # Celery's own window; a narrowing never given back would keep it below for good.
        wait_until(lambda: relay.sent()[-1] == window, timeout=15, what="Celery's window told")
        _window_kept(client, proc, r, rabbit, name, window)
        assert "could not consume the hand-over queues" not in proc.text()


@rabbitmq
def test_a_handed_task_ending_after_a_reconnect_leaves_the_new_window_as_it_is(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """Two slots, a window of two (Celery's, kept so across a reconnect: its prefetch
    reduction off). A handed task runs with the window narrowed to 1 (told to the
    broker); the consumer's connection is cut. On the new connection another handed task
    runs (the new window narrowed to 1); the first ends then, its give-back on the old
    window: the new one stays narrowed while the second runs (of two backlog tasks, one
    runs in the free slot and the other stays in RabbitMQ), and is Celery's own, two, once
    it is done. Every task runs once; nothing is left held."""
    slots = 2
    with _rig(broker, tmp_path, rabbit, slots, reduction=False) as rig:
        name, delayed, r, relay, client, proc = rig
        first = _handed(client, name, "h1", 4.0)
        _running(r, "h1")
        wait_until(lambda: relay.sent()[-1:] == [1], timeout=10, what="the narrowed window told")
        relay.cut_consumer()
        _reconnected(proc, name)
        second = _handed(client, name, "h2", 12.0)
        _running(r, "h2")
        assert first.get(timeout=30) is not None
        # The first's settle is done (its ack, on the lost channel): the worker no longer
        # runs it, and its redelivered copy, handed the lock at its release, found it done.
        wait_until(lambda: first.id not in {t["id"] for t in _inspect(client, proc, "active")})
        _nothing_left(r, "h1")
        _drained(rabbit, name, delayed)
        wait_until(lambda: _inspect(client, proc, "scheduled") == [], timeout=10)
        assert _celery_window(client, proc) == slots  # (1 at the broker: the narrowing's)

        backlog = [
            client.send_task(ca.hold_for.name, args=(f"b{i}", 2.0), queue=name) for i in (0, 1)
        ]
        wait_until(lambda: r.llen("started:b0") + r.llen("started:b1") == 1, timeout=10)
        time.sleep(1.0)  # (a place in the window would be filled by now)
        assert not second.ready()
        assert rabbit.count(name) == 1, "a backlog task was reserved while the handed one ran"
        assert relay.sent()[-1] == 1, relay.sent()

        assert [res.get(timeout=30) is not None for res in (second, *backlog)] == [True] * 3
        _settled(client, proc, r, ["h2", "b0", "b1"], rabbit, name, delayed)
        started = [_started(r, k) for k in ("h1", "h2", "b0", "b1")]
        assert started == [[res.id] for res in (first, second, *backlog)]
        assert _celery_window(client, proc) == slots and relay.sent()[-1] == slots
        _window_kept(client, proc, r, rabbit, name, slots)
