"""The hand-over queues on a channel of their own (AMQP brokers): a task handed its lock
is taken in at once, not behind the task queues' backlog.

A parked task whose lock is handed over through the broker is published to
``<queue>.redislock``, which every worker consuming ``<queue>`` also consumes. On
RabbitMQ, Celery's prefetch window is global to its consumer channel (``qos_global``,
RabbitMQ 3.3 and later), one window for the task queues and the hand-over queues alike:
when the releasing task's acknowledgement frees a place in it, RabbitMQ may fill it with
the next backlog message instead of the handed task, which then waits for another slot to
free, about one task's run, holding its lock all that time.

:class:`HandoffChannel`, a step of the worker's consumer after Celery's ``Tasks`` step,
moves the hand-over queues off Celery's task consumer to a consumer on a channel of its
own, with a prefetch window of the pool's size. A handed task is then received as soon as
it is published, while its releasing task is still finishing, and is queued for the pool
ahead of whatever the task queues deliver after that acknowledgement. Its messages go
through the same task handler (strategies, parking at delivery, the request's
acknowledgement on its own channel). The window bounds how many handed tasks a worker
reserves beyond its slots: each holds a lock whose next task it is, so none of them waits
on a task of another key.

It applies to brokers whose transport is ``amqp`` (RabbitMQ through py-amqp or
librabbitmq) and to nothing else: a Redis broker keeps its prefetch per channel already,
and pushes most hand-overs to the head of the task's own queue list (``parking``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from kombu.messaging import Consumer

from .._keyspace import HANDOFF_QUEUE_SUFFIX
from . import handoff_control

log = logging.getLogger(__name__)


class HandoffChannel(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consume the hand-over queues on a channel of their own (AMQP transports)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "redislock hand-over channel"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        c.redislock_handoff_consumer = None
        handoff_control.take_queues_along(c)  # (remote control: add_consumer, ...)
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        c.redislock_handoff_consumer = None  # (a restart: the last one's channel is gone)
        consumer = c.task_consumer
        connection = c.connection
        if consumer is None or connection is None:
            return
        if connection.transport.driver_type != "amqp":
            return
        queues = [q for q in consumer.queues if q.name.endswith(HANDOFF_QUEUE_SUFFIX)]
        if not queues:
            return
        channel = connection.channel()
        moved: list[Any] = []
        try:
            # Per consumer (RabbitMQ 3.3 and later; per channel before): quorum queues
            # refuse a global window.
            channel.basic_qos(0, window(c), False)
            own = Consumer(  # type: ignore[no-untyped-call]
                channel,
                queues=queues,
                accept=consumer.accept,
                on_decode_error=c.on_decode_error,
            )
            own.on_message = functools.partial(_on_handed, c, c.create_task_handler())
            for queue in queues:  # (Celery's consumer has not consumed yet: asynloop does)
                consumer.cancel_by_queue(queue.name)
                moved.append(queue)
        except Exception:
            _back_on(c, consumer, channel, moved)
            return
        c.redislock_handoff_consumer = own
        _consume_with(c, consumer, own, queues)
        # The consumer's hub, not kombu's get_event_loop(): asynloop resets the hub at each
        # reconnect, which unsets the event loop for good (Celery sets it once, at start).
        _state.hub = getattr(c, "hub", None)
        # The consumer's steps start on its loop's thread (the Evloop step runs the loop).
        _state.loop_thread = threading.get_ident()
        _state.active = True
        log.debug("redislock: hand-over queues %s on a channel of their own", _names(queues))

    def stop(self, c: Any) -> None:
        _state.active = False
        _state.flush()
        own = getattr(c, "redislock_handoff_consumer", None)
        if own is not None:
            _quietly(own.cancel)

    def shutdown(self, c: Any) -> None:
        own = getattr(c, "redislock_handoff_consumer", None)
        if own is not None:
            self.stop(c)
            _quietly(own.channel.close)
            c.redislock_handoff_consumer = None


def _consume_with(c: Any, consumer: Any, own: Any, queues: list[Any]) -> None:
    """Start ``own`` when Celery's loop starts its task ``consumer``: asynloop does so once
    the pool is on the event loop. Started before (here, at the step's start), a delivery
    that a later step's round trip on the connection reads (the pidbox's channel opened)
    would reach the task handler with no pool to send it to: the worker exits at start."""
    consume = consumer.consume

    def consume_both(*args: Any, **kwargs: Any) -> Any:
        started = consume(*args, **kwargs)
        try:
            own.consume()
        except c.connection_errors:
            raise  # (the consumer restarts)
        except Exception:
            _back_on(c, consumer, own.channel, queues)
            consume(*args, **kwargs)  # (the queues just added back; the others are on)
        return started

    consumer.consume = consume_both


def _on_handed(c: Any, handler: Callable[[Any], None], message: Any) -> None:
    """A message of a hand-over queue, to Celery's task handler, with the task queues'
    window one narrower until it is acknowledged (:func:`_narrowed`)."""
    _narrowed(c, message)
    handler(message)


def _narrowed(c: Any, message: Any) -> None:
    """Narrow the task queues' prefetch window (Celery's ``c.qos``) by one while
    ``message``, a handed task, is not settled (acknowledged, rejected or requeued).

    Celery's window counts only the task queues' unacknowledged messages: each pool process
    that runs a handed task leaves a place in it, which RabbitMQ fills with a backlog
    message the worker then reserves. When the next hot-key task is handed over, that
    reserved message is ahead of it in the pool's queue and takes the first process that
    frees: the handed task, holding its lock, waits a whole task of another key (the p90
    of a hot key's hand-over gap). Narrowed so, the window keeps the worker's reserved
    backlog as Celery's own multiplier sets it. The window Celery's loop sends is its own
    less the handed tasks running (:class:`_Narrowing`), at least 1; an unbounded one (0)
    is left so."""
    qos = getattr(c, "qos", None)
    if qos is None or not qos.value:
        return
    narrowing = _Narrowing.of(qos)
    narrowing.change(1)
    done = False

    def give_back() -> None:
        nonlocal done
        if not done:
            done = True
            narrowing.change(-1)  # (a qos replaced at a reconnect: harmless)

    for name in ("ack", "reject", "requeue"):
        settle = getattr(message, name)

        def settled(*args: Any, _settle: Any = settle, **kwargs: Any) -> Any:
            try:
                return _settle(*args, **kwargs)
            finally:
                give_back()

        setattr(message, name, settled)


class _Narrowing:
    """The handed tasks running against one Celery ``qos`` (kombu ``QoS``), taken off the
    window where it is sent to the broker (its callback), never off Celery's own value:
    Celery's relative changes (its ``eta`` tasks, the autoscaler) would otherwise be lost
    to kombu's floor of 1 or cap (``worker_eta_task_limit``) on a narrowed value, and the
    values it sets outright (after a reconnect) would drop a narrowing whose give-back then
    widens the window past Celery's for good."""

    def __init__(self, qos: Any) -> None:
        self.qos = qos
        self.count = 0
        self._lock = threading.Lock()
        self._send = qos.callback
        qos.callback = self._sent

    @classmethod
    def of(cls, qos: Any) -> _Narrowing:
        narrowing = getattr(qos, "redislock_narrowing", None)
        if narrowing is None:
            narrowing = qos.redislock_narrowing = cls(qos)
        return narrowing

    def window(self, value: int) -> int:
        return max(1, value - self.count) if value else value

    def _sent(self, prefetch_count: int, **kwargs: Any) -> Any:
        return self._send(prefetch_count=self.window(prefetch_count), **kwargs)

    def change(self, n: int) -> None:
        with self._lock:
            before = self.window(self.qos.value)
            self.count += n
            if self.window(self.qos.value) != before:
                self.qos.prev = None  # Celery's loop sends it (``qos.prev != qos.value``)


def _back_on(c: Any, consumer: Any, channel: Any, queues: list[Any]) -> None:
    """The hand-over ``queues`` back on Celery's consumer: as without this step."""
    log.warning(
        "redislock: could not consume the hand-over queues %s on a channel of their own; "
        "they share the task queues' prefetch window",
        _names(queues),
        exc_info=True,
    )
    _quietly(channel.close)
    for queue in queues:
        consumer.add_queue(queue)
    c.redislock_handoff_consumer = None
    _state.active = False


class _Pairing:
    """This main process's hand-overs in flight, per lock key, to pair the releasing task's
    acknowledgement with the handed task's arrival (:func:`defer_ack`)."""

    def __init__(self) -> None:
        self.active = False  # the hand-over channel is consuming
        #: The worker consumer's event loop (kombu hub) acknowledgements wait on.
        self.hub: Any = None
        #: The thread that runs it: the one thread that changes this state or its timers.
        self.loop_thread: int | None = None
        #: Per lock key: its tasks this process parked at delivery, not received back yet.
        self.expected: dict[bytes, int] = {}
        #: Per lock key: acknowledgements waiting for its hand-over, oldest first.
        self.waiting: dict[bytes, list[Callable[[], None]]] = {}

    def flush(self) -> None:
        """Every waiting acknowledgement, now (the channel stops)."""
        waiting, self.waiting = self.waiting, {}
        for acks in waiting.values():
            for ack in acks:
                ack()


_state = _Pairing()
#: At most this many keys' counts are kept (the oldest go first).
EXPECTED_KEYS = 4096
#: Seconds an acknowledgement waits for its key's hand-over at most.
ACK_WAIT = 0.005


def parked(key: bytes) -> None:
    """A task of ``key`` was parked at delivery here: its hand-over will come through a
    hand-over queue, most likely to this worker."""
    if not _state.active:
        return
    expected = _state.expected
    expected[key] = expected.pop(key, 0) + 1
    if len(expected) > EXPECTED_KEYS:
        del expected[next(iter(expected))]


def expecting() -> bool:
    """Whether any hand-over is expected (else nothing is worth a key's rendering)."""
    return bool(_state.expected)


def received(key: bytes) -> None:
    """A handed task of ``key`` came through a hand-over queue: the first acknowledgement
    waiting for it goes now, before the task is dispatched (so it is queued for the pool
    before whatever the task queues deliver after that acknowledgement)."""
    count = _state.expected.get(key, 0)
    if count <= 1:
        _state.expected.pop(key, None)
    else:
        _state.expected[key] = count - 1
    acks = _state.waiting.get(key)
    if acks:
        ack = acks.pop(0)
        if not acks:
            del _state.waiting[key]
        ack()


def defer_ack(key: bytes, ack: Callable[[], None]) -> bool:
    """Hold ``ack``, a finished task's acknowledgement (``acks_late``), until the hand-over
    of its lock ``key`` arrives, at most ACK_WAIT seconds; False (the caller acks now): no
    hand-over of ``key`` is expected here, or no event loop runs.

    With RabbitMQ, the acknowledgement frees a place in the task queues' prefetch window,
    and the broker fills it at once with the next backlog message, which the freed pool
    process then takes, while the handed task, published by the releasing process as it
    finished, is still on its way (about 2 ms on a busy host): it then waits a whole task
    of another key for the next free process, holding its lock. Held this briefly, the
    acknowledgement lets the handed task, which has its own channel and window, be queued
    first. The task is done and its result stored: a worker dying meanwhile gets its
    message delivered again, and that copy finds its done marker.

    Called on another thread than the loop's (a thread pool's, whose tasks finish off the
    loop), it hands the decision to the loop through the hub's ``call_soon``, its one
    thread-safe entry (the hub's timers and this module's state are the loop's alone):
    True, and the loop holds ``ack`` or, its hand-over no longer expected, sends it."""
    if not _state.active or not _state.expected.get(key):  # (a read: a stale answer at worst)
        return False
    hub = _state.hub
    if hub is None:
        return False
    if threading.get_ident() != _state.loop_thread:
        hub.call_soon(_hold_or_ack, key, ack)
        return True
    _hold(hub, key, ack)
    return True


def _hold_or_ack(key: bytes, ack: Callable[[], None]) -> None:
    """On the loop: :func:`defer_ack`'s hold, for an ``ack`` sent from another thread."""
    hub = _state.hub
    if not _state.active or not _state.expected.get(key) or hub is None:
        ack()
    else:
        _hold(hub, key, ack)


def _hold(hub: Any, key: bytes, ack: Callable[[], None]) -> None:
    """On the loop: ``ack`` waits for ``key``'s hand-over (:func:`received`), at most
    ACK_WAIT seconds."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            ack()

    def timed_out() -> None:
        acks = _state.waiting.get(key)
        if acks and once in acks:
            acks.remove(once)
            if not acks:
                del _state.waiting[key]
            # Its hand-over went elsewhere (another worker), or none came: count it gone.
            count = _state.expected.get(key, 0)
            if count <= 1:
                _state.expected.pop(key, None)
            else:
                _state.expected[key] = count - 1
        once()

    _state.waiting.setdefault(key, []).append(once)
    hub.call_later(ACK_WAIT, timed_out)


def window(c: Any) -> int:
    """The hand-over channel's prefetch window: the pool's size (its largest, with
    ``--autoscale``), at least 1."""
    slots = getattr(c.controller, "max_concurrency", None)
    if not isinstance(slots, int) or slots <= 0:
        slots = getattr(getattr(c, "pool", None), "num_processes", None)
    return slots if isinstance(slots, int) and slots > 0 else 1


def _quietly(call: Any) -> None:
    """``call()``, its errors logged at debug (a channel of a connection already lost)."""
    try:
        call()
    except Exception:
        log.debug("redislock: hand-over channel", exc_info=True)


def _names(queues: list[Any]) -> str:
    return ", ".join(repr(q.name) for q in queues)


def add_step(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """``celeryd_init``: add the step to the worker's app's consumer blueprint (once),
    before the worker builds it. The step does nothing where no hand-over queue is
    consumed (an app without ``LockedTask``) or the broker is not AMQP. And ``inspect
    active_queues`` lists the hand-over channel's queues too (``handoff_control``)."""
    app = getattr(instance, "app", None)
    if app is not None and HandoffChannel not in app.steps["consumer"]:
        app.steps["consumer"].add(HandoffChannel)
    handoff_control.list_handoff_queues()
