"""What a task does when its lock is held (``on_contention``): wait, park behind the
holder (in the pool process), re-queue, skip or fail; and when it gives up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
import time
import weakref
from typing import Any, NamedTuple

from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject
from kombu.entity import Exchange, Queue

from .. import signals
from .._core import MAX_SECONDS, LockKeys, backoff
from .._errors import LockContendedError
from .._keyspace import run_key
from ..settings import LockOptions
from . import signing
from .clients import client_for, settings_for
from .envelope import _dumps
from .queuelists import broker_place
from .tasklock import AnyTaskLock, TaskLock, TaskSemaphore, request_owner

log = logging.getLogger(__name__)


#: Message header counting re-queues (kept apart from Celery's ``retries``).
REQUEUE_HEADER = "redislock_requeues"
#: Message header of a limited task's deferred copies: when its run first tried for its
#: permit (seconds since the epoch), so that its wait is measured across deferrals.
FIRST_TRY_HEADER = "redislock_first_try"
#: celery.deferral's header of a run whose rate slot is booked, and the in-memory mark of
#: a run its rate admitted (spelled there; here because deferral imports this module).
RATE_BOOKED = "redislock_rate_booked"
RATE_ADMITTED = "redislock_rate_admitted"
SKIPPED = "SKIPPED"
#: The headers RabbitMQ adds to a dead-lettered message (a fallback copy back from its
#: delay queue), not carried into the messages sent for the same run.
DEAD_LETTER_HEADERS = (
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
)


def first_try(value: Any, now: float) -> float:
    """When a run first tried for its permit: ``value`` (a deferred copy's
    :data:`FIRST_TRY_HEADER`) if it is a time within a year before ``now``, else ``now``
    (a message may carry anything; another host's clock may be ahead)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and now - MAX_SECONDS <= value <= now:
        return float(value)
    return now


class _Call(NamedTuple):
    """One execution's particulars, passed between the contention steps: with ``limit``
    (a limited task's run), when it first tried for its permit (:func:`first_try`)."""

    request: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: LockOptions
    name: str
    limit: int | None = None
    first_try: float = 0.0


class Contention(Task):  # type: ignore[misc]
    """The contention policies of :class:`~celery_redislock.celery.base.LockedTask`
    (a base class of it, not a task base of its own)."""

    def _unreachable(self, call: _Call, exc: BaseException) -> Any:
        """The lock could not be taken because Redis did not answer: send the task again
        after the longest re-queue backoff, without counting it as a re-queue (an outage
        is not contention), or, when that cannot be published either (the broker is the
        same Redis), reject its message with requeue: unacknowledged, it is delivered
        again when the broker is back. The body never ran, so nothing runs twice."""
        request, options, name = call.request, call.options, call.name
        countdown = min(options.requeue_backoff[1], _visibility_timeout(self.app) / 4)
        signature = self._sent_again(call, dict(request.headers or {}))
        log.warning(
            "redislock: %s[%s] could not take %r (%s: %s); sent again in %.1fs",
            self.name,
            request.id,
            name,
            type(exc).__name__,
            exc,
            countdown,
        )
        self._publish(signature, countdown=countdown)
        signals.task_requeued.send(
            self, name=name, task_id=request.id, countdown=countdown, limit=call.limit
        )
        raise Ignore()

    def _sent_again(self, call: _Call, headers: dict[str, Any]) -> Any:
        """The signature that sends this call again (same id, links, chain) with
        ``headers``; a limited task's also says when its run first tried for its permit."""
        signature = self.signature_from_request(
            call.request, call.args, call.kwargs, headers=headers
        )
        if call.limit is not None:
            headers = signature.options.get("headers") or {}
            signature.options["headers"] = {**headers, FIRST_TRY_HEADER: call.first_try}
        if getattr(call.request, RATE_ADMITTED, False):
            # Admitted by its rate, then contended: its next delivery keeps the slot.
            slot = getattr(call.request, "redislock_rate_slot_us", None)
            signature.options.setdefault("headers", {})[RATE_BOOKED] = slot or 1
        return signature

    def _publish(self, signature: Any, **options: Any) -> None:
        """Publish a copy of the running task's message; if the broker cannot take it,
        reject the running message with requeue instead of failing the task (a failed
        task's message is acknowledged: the task would be lost)."""
        try:
            signature.apply_async(**options)
        except Exception as exc:
            log.warning(
                "redislock: %s[%s] could not be sent again (%s: %s); its message is "
                "rejected with requeue (delivered again when the broker answers)",
                self.name,
                self.request.id,
                type(exc).__name__,
                exc,
            )
            raise Reject(exc, requeue=True) from exc

    def _wait_for(self, lock: AnyTaskLock, options: LockOptions) -> bool:
        # OwnerFinished (another delivery of this run finished meanwhile) goes on to the
        # caller, LockedTask's run: logged and signalled there (duplicates.ignored).
        return lock.acquire(timeout=options.wait)

    def _contended(
        self,
        call: _Call,
        *,
        duplicate: bool,
    ) -> Any:
        request, options, name = call.request, call.options, call.name
        policy = options.on_contention
        if (
            duplicate
            or policy in ("requeue", "replace")
            or (policy == "wait" and options.wait_fallback == "requeue")
        ):
            return self._requeue(call, duplicate=duplicate)
        if policy == "skip":
            log.info("redislock: %s[%s] skipped: %r is held", self.name, request.id, name)
            if not self.ignore_result and request.id:
                self.update_state(state=SKIPPED, meta={"lock": name})
            signals.task_skipped.send(self, name=name, task_id=request.id, limit=call.limit)
            raise Ignore()
        raise LockContendedError(
            f"task {self.name}[{request.id}] did not run: lock {name!r} is held by another task "
            f"(on_contention={policy!r})",
            name=name,
            owner=request.id,
        )

    def _next_delivery(
        self,
        call: _Call,
        *,
        duplicate: bool,
    ) -> tuple[Any, int]:
        """The signature that runs this task again (same id, links, chain), counted.

        Raises the exhausted action once ``lock_max_requeues`` is reached.
        """
        request, options, name = call.request, call.options, call.name
        headers = dict(request.headers or {})
        done = int(headers.get(REQUEUE_HEADER) or getattr(request, REQUEUE_HEADER, 0) or 0)
        if done >= options.max_requeues:
            if not duplicate and self._still_parked(call):
                # A fallback copy of a task that is still parked: the parked entry runs it.
                log.warning(
                    "redislock: %s[%s] is still parked behind %r after %d re-queues; this "
                    "fallback copy stops here",
                    self.name,
                    request.id,
                    name,
                    done,
                )
                raise Ignore()
            message = (
                f"task {self.name}[{request.id}] gave up after {done} re-queues: lock {name!r} "
                f"stayed held (raise lock_max_requeues or lock_requeue_backoff)"
            )
            if duplicate:  # the delivery holding the lock will record the outcome
                log.warning(
                    "redislock: %s; another delivery of it holds the lock: dropped", message
                )
                raise Ignore()
            if options.requeue_exhausted == "drop":
                log.warning("redislock: %s; dropping it", message)
                raise Ignore()
            raise LockContendedError(message, name=name, owner=request.id)
        headers[REQUEUE_HEADER] = done + 1
        return self._sent_again(call, headers), done + 1

    def _still_parked(self, call: _Call) -> bool:
        if settings_for(self.app).urls:
            return False  # no parking on a quorum
        limited = call.options.limited
        keys = LockKeys.for_lock(run_key(call.name, call.options.prefix, limited=limited))
        owner = request_owner(call.request)
        return bool(client_for(self.app).hexists(keys.parked_messages, owner))

    def _park(
        self,
        lock: TaskLock | TaskSemaphore,
        call: _Call,
    ) -> bool:
        """Park behind the holder, who hands the lock over at release. True if acquired.

        The worker slot is given back at once. In case the hand-over never comes (the
        releasing worker dies, Redis restarts), a fallback copy of the task is also
        published with a countdown; whichever copy runs first runs the task, the other
        finds it done (or running) and does nothing. False if the message cannot be
        parked (arguments not JSON-serialisable): then the plain re-queue is used.
        """
        request, options, name = call.request, call.options, call.name
        signature, count = self._next_delivery(call, duplicate=False)
        try:
            message = self._signed(lock, call, signature)
        except TypeError:
            return False
        outcome = lock.park(message, keep_for=self._parking_lifetime(options))  # (as above)
        if outcome is True:
            return True
        fallback = self._fallback_copy(call, signature, self._fallback_delay(options))
        signals.task_parked.send(self, name=name, task_id=request.id, limit=call.limit)
        log.info(
            "redislock: %s[%s] parked behind the holder of %r (%d)%s",
            self.name,
            request.id,
            name,
            count,
            "" if fallback is None else f"; fallback copy in {fallback:.1f}s",
        )
        raise Ignore()

    def _signed(self, lock: TaskLock | TaskSemaphore, call: _Call, signature: Any) -> str:
        """``signature`` as the message a parking keeps in Redis: JSON, signed for the
        lock and the run (raises TypeError for arguments that are not JSON-serialisable)."""
        key = settings_for(self.app).signing_key
        owner = lock.owner or call.request.id
        return signing.sign_signature(key, lock.keys.lock, owner, _dumps(dict(signature)))

    def _fallback_copy(self, call: _Call, signature: Any, countdown: float) -> float | None:
        """Publish the fallback copy of a run kept in the lock Redis (parked, or pending),
        where its broker is not that Redis (``_park_fallback``): its countdown, or None.

        With an AMQP broker the copy waits in a delay queue of the broker's own
        (:func:`delay_queue`), not in a worker's memory as an ``eta`` task would: held
        ``eta`` messages count against the consumer's prefetch, and a worker holding one
        per parked task was seen to stall for seconds."""
        if not _park_fallback(self.app):
            return None
        delayed = delay_queue(self.app, signature, countdown)
        if delayed is not None:
            try:
                signature.apply_async(queue=delayed, exchange="", routing_key=delayed.name)
                return countdown
            except Exception as exc:  # sent as an eta task instead, or rejected (_publish)
                if isinstance(exc, _channel_errors(self.app)):  # the queue refused, not the broker
                    self._refused_delay_queue(delayed.name, exc)
        self._publish(signature, countdown=countdown)
        return countdown

    def _refused_delay_queue(self, name: str, exc: BaseException) -> None:
        """The broker refused the delay queue ``name`` (declared with other arguments, or
        not for this user to declare): not tried again by this process for a while."""
        _refuse(name)
        log.warning(
            "redislock: %s[%s]: its fallback copy cannot wait in the delay queue %r "
            "(%s: %s); it is sent as an eta task instead (delay queues of this name "
            "are not tried again for %.0fs)",
            self.name,
            self.request.id,
            name,
            type(exc).__name__,
            exc,
            _REFUSED_FOR,
        )

    def _fallback_delay(self, options: LockOptions) -> float:
        return min(max(options.ttl, options.requeue_backoff[1]), _visibility_timeout(self.app) / 4)

    def _parking_lifetime(self, options: LockOptions) -> float:
        """How long a parked task's records are kept (extended by every parking)."""
        lifetime = max(options.done_ttl, self._fallback_delay(options) * 4 + options.ttl)
        return min(lifetime, MAX_SECONDS)

    def _requeue(
        self,
        call: _Call,
        *,
        duplicate: bool,
    ) -> Any:
        request, options, name = call.request, call.options, call.name
        signature, count = self._next_delivery(call, duplicate=duplicate)
        base, cap = options.requeue_backoff
        cap = min(cap, _visibility_timeout(self.app) / 4)
        # A duplicate delivery waits the full cap: the copy holding the lock is still working.
        countdown = (
            cap if duplicate else backoff(count - 1, base=base, cap=max(cap, base), rng=_rng)
        )
        self._publish(signature, countdown=countdown)
        signals.task_requeued.send(
            self, name=name, task_id=request.id, countdown=countdown, limit=call.limit
        )
        log.info(
            "redislock: %s[%s] re-queued in %.3fs (%d): %r is held%s",
            self.name,
            request.id,
            countdown,
            count,
            name,
            " by another delivery of this task" if duplicate else "",
        )
        raise Ignore()


_rng = random.Random()


def _park_fallback(app: Any) -> bool:
    """Whether parked tasks also get a delayed fallback copy in the broker.

    Parked messages live in the lock Redis. If that is the broker's own Redis server (its
    database, or another with ``redislock_queues_in_other_db``: ``queuelists``), they
    share its fate and the sweeper covers a dead releasing worker; a separate lock Redis
    could lose them alone (a restart without persistence), so a copy is kept in the broker.
    """
    settings = settings_for(app)
    if settings.park_fallback == "auto":
        return (
            not settings.url_source.startswith("broker_url")
            and settings.url
            != (getattr(app.conf, "broker_url", None) or app.conf.get("broker_url"))
            and broker_place(app) is None
        )
    return bool(settings.park_fallback)


#: Where the fallback copies of an AMQP broker wait: ``<prefix><ms>.<target>``, one queue per
#: delay and destination, with no consumers; a copy dead-letters to its destination when
#: the queue's message TTL (the delay) runs out.
DELAY_QUEUE_PREFIX = "redislock.delay."
#: AMQP caps queue names at 255 bytes: a longer destination is named by its digest.
_MAX_QUEUE_NAME = 255
#: How long an unused delay queue is kept beyond its delay (it is declared again, so kept
#: on, by every copy published to it).
_KEEP_UNUSED_MS = 60_000
#: How long a delay queue the broker refused is not tried again (its copies are eta tasks).
_REFUSED_FOR = 60.0
_amqp: weakref.WeakKeyDictionary[Any, tuple[type[BaseException], ...] | None]
_amqp = weakref.WeakKeyDictionary()
_refused: dict[str, float] = {}
#: Taken to change ``_refused`` (a threads pool's tasks may note refusals at once).
_refused_lock = threading.Lock()


def delay_queue(app: Any, signature: Any, countdown: float) -> Any:
    """The queue a fallback copy of ``signature`` waits about ``countdown`` seconds in
    before it goes where ``signature`` would go, or None when the broker is not AMQP (the
    copy is then an ``eta`` task), or when the broker refused that queue lately.

    A queue with a message TTL of the delay, dead-lettering to the destination's exchange
    and routing key: every message in it waits the same time, so they leave it in order
    (RabbitMQ expires messages at the head of a queue). The delay is ``countdown`` rounded
    up to a step of at most 1/8 of it (whole seconds, at least one): a debounced call's
    copy waits its own due time, and a queue per distinct delay would make one per call.
    Declared again by every copy published to it (``x-expires``: kombu does not cache
    the declaration), so a queue deleted meanwhile is made again, and one unused for its
    delay plus a minute (or twice its delay) is deleted by the broker. Nothing consumes it.
    """
    if not _is_amqp(app):
        return None
    options = signature.options
    exchange = options.get("exchange") or ""
    exchange = getattr(exchange, "name", exchange)
    routing_key = options.get("routing_key")
    queue = options.get("queue")
    if not routing_key:
        routing_key = getattr(queue, "name", queue) or app.conf.task_default_queue
    if not isinstance(exchange, str) or not isinstance(routing_key, str):
        return None
    delay_ms = _delay_ms(countdown)
    name = f"{DELAY_QUEUE_PREFIX}{delay_ms}.{_target(exchange, routing_key)}"
    if _refused.get(name, 0.0) > time.monotonic():
        return None
    return Queue(  # type: ignore[no-untyped-call]
        name,
        exchange=Exchange("", type="direct"),  # type: ignore[no-untyped-call]
        routing_key=name,
        durable=True,
        queue_arguments={
            "x-message-ttl": delay_ms,
            "x-dead-letter-exchange": exchange,
            "x-dead-letter-routing-key": routing_key,
            "x-expires": delay_ms + max(delay_ms, _KEEP_UNUSED_MS),
        },
    )


def _delay_ms(countdown: float) -> int:
    """``countdown`` in ms, rounded up to whole seconds, then to a step of 2**(k-3) s for
    2**k <= countdown < 2**(k+1) s (at most 1/8 of it): 8 steps a doubling."""
    # Bounded both ways: at least a second (a negative or NaN countdown too), at most the
    # package's longest duration (an infinite one too).
    bounded = 1.0 if not countdown >= 1 else min(countdown, MAX_SECONDS)
    seconds = max(1, math.ceil(bounded - 1e-9))
    step = 1 << max(0, seconds.bit_length() - 4)
    return -(-seconds // step) * step * 1000


def _target(exchange: str, routing_key: str) -> str:
    """The destination part of a delay queue's name: ``<routing key>`` (the default
    exchange) or ``<exchange>/<routing key>`` where that names one destination only and
    fits; else ``#`` and a digest of both."""
    readable = f"{exchange}/{routing_key}" if exchange else routing_key
    plain = "/" not in (exchange or routing_key) and not readable.startswith("#")
    if plain and len(f"{DELAY_QUEUE_PREFIX}{2**40}.{readable}".encode()) <= _MAX_QUEUE_NAME:
        return readable
    both = json.dumps([exchange, routing_key]).encode()
    return "#" + hashlib.sha256(both).hexdigest()[:32]


def _refuse(name: str) -> None:
    now = time.monotonic()
    with _refused_lock:
        for stale in [n for n, until in _refused.items() if until <= now]:
            del _refused[stale]
        _refused[name] = now + _REFUSED_FOR


def _is_amqp(app: Any) -> bool:
    return _channel_errors(app) != ()


def _channel_errors(app: Any) -> tuple[type[BaseException], ...]:
    """The AMQP transport's channel errors (a queue refused: its arguments, permissions),
    or () when the broker is not AMQP."""
    found = _amqp.get(app)
    if found is None:
        try:
            with app.connection_for_write() as conn:  # not connected: the transport's kind
                amqp = conn.transport.driver_type == "amqp"
                found = tuple(conn.channel_errors) if amqp else ()
        except Exception:
            found = ()
        _amqp[app] = found
    return found


def _visibility_timeout(app: Any) -> float:
    options = app.conf.get("broker_transport_options") or {}
    return float(options.get("visibility_timeout") or 3600.0)


def _request(message: Any, headers: dict[str, Any], args: Any, kwargs: Any, embed: Any) -> Context:
    """The request a pool process would run ``message`` with, as Celery builds it (its
    headers, properties and delivery info, then the arguments and the embedded canvas):
    what ``signature_from_request`` sends it again from, here in the main process."""
    properties = message.properties or {}
    info = message.delivery_info or {}
    return Context(
        {
            **headers,
            "properties": properties,
            "reply_to": properties.get("reply_to"),
            "correlation_id": properties.get("correlation_id"),
            "delivery_info": {
                "exchange": info.get("exchange"),
                "routing_key": info.get("routing_key"),
                "priority": properties.get("priority"),
                "redelivered": info.get("redelivered", False),
            },
            **(embed or {}),
        },
        args=args,
        kwargs=kwargs,
        called_directly=False,
    )
