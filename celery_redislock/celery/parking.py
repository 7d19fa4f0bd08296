"""Parking at delivery: the worker's main process parks a contended task before a pool
process ever gets it.

``LockedTask.Strategy`` wraps Celery's default task strategy (the function the worker's
consumer calls for every message of a task type). For a message whose lock another task
holds, it parks the broker's own message (the *envelope*) behind the holder and acks it:
no pool process is taken, no publish is made. The holder's release (``handoff.lua``)
hands the lock to the first parked task and pushes its envelope back to the head of its
queue's first-read (priority 0) list in the same atomic step, so the next fetch of any
worker consuming that queue takes it at once.

Envelopes where it is exact: a Redis broker on the same server as the locks, in
their database or (``redislock_queues_in_other_db``) another one (checked once per worker
and broker URL, with a probe key: ``queuelists``), a queue list the locks' Redis user
may write, and no parked-task fallback copies. With any other broker (RabbitMQ, a Redis
elsewhere), or fallback copies on, it parks what a pool process would: the task's signature
(rebuilt from the message as Celery builds a pool process's request), signed, then
publishes its fallback copy (``Contention._fallback_copy``); its hand-over is published to
``<queue>.redislock`` as any parked signature's. Either way: messages of task protocol 2
without ``eta`` or ``expires``, ``on_contention="requeue"`` with re-queues left, a
single-Redis lock (not ``redislock_urls``), and ``redislock_park_at_delivery`` left on;
and only for a key that comes again
(:class:`RecentKeys`): a key's first message among the consumer's recent keys costs the
main loop no round trip. Everything else (and
any error here) goes the usual way: the pool process takes the lock, or parks the task
itself.

A message whose delivery tag says a hand-over pushed it back is run only if its signature
verifies (:func:`accept_handed_over`): a hand-over script pushes what it finds in Redis,
where anyone who may write the lock keys may have written it.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
import uuid
import weakref
from typing import Any

import redis
from celery._state import _task_stack  # (Celery's tracer pushes a running task on it)
from celery.exceptions import Reject
from celery.worker.strategy import default as default_strategy

from .. import signals
from .._core import OwnerFinished, lease_ms
from .._keyspace import HANDOFF_QUEUE_SUFFIX, parked_under
from . import handoff_channel, signing
from .base import LockedTask
from .clients import client_for, settings_for
from .contention import (
    FIRST_TRY_HEADER,
    REQUEUE_HEADER,
    _Call,
    _park_fallback,
    _request,
    first_try,
)
from .duplicates import finished_copy, ignored
from .envelope import TAG_PREFIX, envelope_entry, envelope_lock_key
from .handover import _report_refused, deliver_handed_over, refuse_handed_over
from .lookahead import LOOKAHEAD_HEADER
from .queuelists import SEP, Place, Reprobe, place_of, queue_call, reprobe_for
from .tasklock import PARKABLE, TaskLock, TaskSemaphore, request_owner

log = logging.getLogger(__name__)


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """Celery's default strategy, with contended messages parked before dispatch, and
    messages a hand-over pushed run only if they verify."""
    handler = default_strategy(task, app, consumer, **kwargs)
    parker = Parker.for_consumer(task, app, consumer)
    errors = consumer.connection_errors

    def task_message_handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any
    ) -> Any:
        if (
            str(message.delivery_tag).startswith(TAG_PREFIX)
            and not accept_handed_over(task, app, message)
        ) or (parker is not None and parker.park(message)):
            ack(log, errors)  # as Request.acknowledge does
            return None
        return handler(message, body, ack, reject, callbacks, **kw)

    return task_message_handler


def accept_handed_over(task: Any, app: Any, message: Any) -> bool:
    """Whether a message a hand-over pushed back (its delivery tag says so) may run.

    A hand-over script pushes a parked envelope it read from Redis, so it runs only if a
    worker holding the app's signing key parked it, under the lock its arguments take
    (``signing.check_envelope``). A refused one is reported, and its hand-over taken back
    (the lock goes to the next parked task): the caller acks it, so it never runs.
    """
    raw = getattr(message, "_raw", None)
    try:
        lock, _queue_list = signing.check_envelope(settings_for(app).signing_key, raw)
        if envelope_lock_key(app, raw) == lock.encode():
            return True
        reason = "its arguments do not take the lock it was parked under"
    except signing.Refused as exc:
        reason = str(exc)
    except Exception as exc:  # not a message any worker parked
        reason = f"not a parked message ({type(exc).__name__}: {exc})"
    try:
        lock_key, task_id = _parked_as(app, raw)
        if lock_key is None:
            _report_refused(app, b"", task_id, reason)
        else:
            lease = lease_ms(task.lock_options().ttl, "lock_ttl")
            handed = refuse_handed_over(app, lock_key, task_id, reason, lease)
            deliver_handed_over(app, handed, lease)
    except Exception:  # the sweeper hands the lock on when the hand-over's lease runs out
        log.exception("redislock: could not take back the hand-over of a refused message")
    return False


def _parked_as(app: Any, raw: Any) -> tuple[bytes | None, bytes]:
    """The lock key and task id a pushed message says it was parked as: a hand-over
    script pushes an envelope only if they are the ones it handed the lock to
    (envelope.lua's ``pushable``). No lock key if it names none of this app's locks."""
    headers = raw.get("headers") if isinstance(raw, dict) else None
    headers = headers if isinstance(headers, dict) else {}
    parked = headers.get(signing.PARKED_HEADER)
    task_id, lock = headers.get("id"), parked.get("lock") if isinstance(parked, dict) else None
    task_id = request_owner(headers).encode() if isinstance(task_id, str) else b""
    if not task_id or not isinstance(lock, str):
        return None, task_id
    prefixes = {t.lock_options().prefix for t in app.tasks.values() if isinstance(t, LockedTask)}
    for prefix in prefixes:
        if parked_under(lock.encode(), prefix) is not None:
            return lock.encode(), task_id
    return None, task_id


class Parker:
    """Parks one task type's contended messages in the worker's main process."""

    def __init__(
        self,
        task: Any,
        app: Any,
        revoked: Any,
        *,
        slots: int | None = None,
        seen: RecentKeys | None = None,
        place: Place | None = None,
        envelopes: bool = True,
        outage: Outage | None = None,
    ) -> None:
        self.task = task
        #: Where the broker's queue lists are (None: in the locks' database), if it parks
        #: envelopes (``envelopes``); else it parks signatures, as a pool process does.
        self.place = place
        self.envelopes = envelopes
        self.app = app
        self.revoked = revoked
        #: Look-ahead needs two worker slots here at least: a lock's tasks moved ahead
        #: would otherwise take this worker's only one in turn.
        self.lookahead = slots is None or slots >= 2
        self.queues: dict[tuple[str, str], list[str]] = {}
        #: Lock keys this check last found held (at most HELD_KEYS, oldest dropped): their
        #: next message goes straight to the park script, without the EXISTS probe first.
        self.held: dict[bytes, None] = {}
        #: Lock keys of the consumer's recent messages (every task type's alike).
        self.seen = seen if seen is not None else RecentKeys()
        #: Whether this task type's keys come again: if not, most messages skip the check.
        self.recurrence = Recurrence()
        #: The consumer's pause of the check (every task type's alike: one locks' Redis,
        #: one broker), after the locks' Redis failed to answer or the broker to take a
        #: fallback copy.
        self.outage = outage if outage is not None else Outage()
        #: The probe of a Redis broker's place failed to get an answer, so this parks
        #: signatures until a probe in the background finds the place
        #: (:meth:`_probed_again`); None: the place is known.
        self.reprobe: Reprobe | None = None

    @classmethod
    def for_consumer(cls, task: Any, app: Any, consumer: Any) -> Parker | None:
        if not isinstance(task, LockedTask):
            return None
        try:
            options = task.lock_options()
        except Exception:
            return None
        if options.rate is not None or not options.locked:
            return None  # the rate first, in the pool process: never parked before it
        if options.latest:
            return None  # last call wins: decided in the pool process (celery.latest)
        try:
            settings = settings_for(app)
            if not settings.park_at_delivery or settings.urls:
                return None
            # The broker's own message, where a release can push it back (a Redis on the
            # locks' server, no fallback copies); else the signature a pool process parks.
            place = None if _park_fallback(app) else _broker_place(app, consumer)
        except Exception:
            log.debug("redislock: parking at delivery is off for %s", task.name, exc_info=True)
            return None
        # The pool's size: its largest with --autoscale (the pool's limit is its least).
        slots = getattr(consumer.controller, "max_concurrency", None)
        if not isinstance(slots, int) or not slots:
            slots = getattr(getattr(consumer, "pool", None), "limit", None)
        parker = cls(
            task,
            app,
            consumer.controller.state.revoked,
            slots=slots if isinstance(slots, int) else None,
            seen=_recent_keys(consumer),
            place=place,
            envelopes=place is not None,
            outage=_per_consumer(_outages, consumer, Outage),
        )
        uri = _broker_uri(consumer) if place is None else None
        parker.reprobe = None if uri is None else reprobe_for(app, uri)
        return parker

    def park(self, message: Any) -> bool:
        """True if the message was parked (the caller acks it); False: deliver it."""
        # Only ever set here, never taken from a message (these are also the envelope's).
        (message.headers or {}).pop(LOOKAHEAD_HEADER, None)
        if self.outage.paused():
            return False  # a check failed lately: pool processes decide
        if self.reprobe is not None:
            self._probed_again()
        try:
            return self._park(message)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Each check waits up to the client's socket timeout in the worker's main loop:
            # with the locks' Redis away, one try per OUTAGE_PAUSE, not one per message.
            self.outage.pause(self.task.name, "the locks' Redis did not answer", exc)
            return False
        except Reject as exc:
            # The broker did not take the fallback copy (after its publish retries, in the
            # main loop): the task stays parked, and its pool process sends the copy.
            cause = exc.__cause__ or exc
            self.outage.pause(self.task.name, "the broker did not take a fallback copy", cause)
            return False
        except Exception:  # the pool process takes the usual way
            log.debug("redislock: could not park at delivery", exc_info=True)
            return False

    def _probed_again(self) -> None:
        """The broker's place, probed again in the background (the last probe got no
        answer): once found, this parks envelopes from now on (fallback copies off); once
        answered otherwise, signatures for good. Tasks parked as signatures meanwhile are
        handed over so."""
        probed = self.reprobe.poll() if self.reprobe is not None else None
        if probed is None:
            return
        self.reprobe = None
        (place,) = probed
        if place is not None and not _park_fallback(self.app):
            self.place, self.envelopes = place, True
            log.info(
                "redislock: the broker's queue lists found on the locks' Redis server now; "
                "%s tasks are parked at delivery as the broker's own messages",
                self.task.name,
            )

    def _park(self, message: Any) -> bool:
        headers = message.headers or {}
        raw: Any = getattr(message, "_raw", None)  # a dict, where envelopes are parked
        task_id = headers.get("id")
        if (
            (self.envelopes and not isinstance(raw, dict))
            or "task" not in headers  # task protocol 1
            or headers.get("eta")
            or headers.get("expires")
            or not task_id
            or task_id in self.revoked
        ):
            return False
        task = self.task
        options = task.lock_options()
        if options.on_contention != "requeue":
            return False
        handed = self.envelopes and str(message.delivery_tag).startswith(TAG_PREFIX)
        if not self.envelopes and finished_copy(task, message, headers, options):
            return True  # back from its delay queue after its run ended: dropped here
        count = int(headers.get(REQUEUE_HEADER) or 0)
        if count >= options.max_requeues and not handed:
            return False
        if handed:  # pushed back by a hand-over (and verified): the lock is its own
            queue_list = self._queue_list(message, raw)
            if queue_list is not None and options.lookahead and self.lookahead:
                # Its release looks in the list for the next task of its lock.
                message.headers[LOOKAHEAD_HEADER] = queue_list
            return False
        info = getattr(message, "delivery_info", None) or {}
        queue = info.get("routing_key")
        if not self.envelopes and str(queue or "").endswith(HANDOFF_QUEUE_SUFFIX):
            # A hand-over (or a re-sent copy) published to <queue>.redislock: it is most
            # likely the lock's own task; its pool process's acquire decides.
            if handoff_channel.expecting():  # the releasing task's ack may wait for it
                args, kwargs, _embed = message.decode()
                handoff_channel.received(task.run_key(args, kwargs))
            return False
        if self.recurrence.skip():
            return False  # no key came again lately: most messages go unchecked (Recurrence)
        args, kwargs, embed = message.decode()
        key = task.run_key(args, kwargs)  # a bad value: the pool process fails the task
        recurred = key in self.held or self.seen.again(key)
        self.recurrence.checked(recurred)
        if not recurred:
            # The first message of its key among the last SEEN_KEYS keys here goes to a pool
            # process unchecked: contention needs a key that recurs, and the check would
            # cost every message of a key that does not one round trip in the main loop.
            return False
        queue_list = self._queue_list(message, raw) if self.envelopes else ""
        if queue_list is None:
            return False
        lock = task.run_lock(args, kwargs, request_owner(headers), options)
        if not isinstance(lock, PARKABLE):
            return False
        if isinstance(lock, TaskLock) and key not in self.held:
            # park.lua "behind" answers "free" when the lock's hash does not exist: asked
            # first with EXISTS, a free key's message is delivered without its envelope
            # being built and signed (the pool process's acquire decides, as after the
            # script's answer). A key found held is remembered: its next message skips this.
            if not lock.client.exists(key):
                return False
            self.held[key] = None
            if len(self.held) > HELD_KEYS:
                del self.held[next(iter(self.held))]
        name = lock.name
        limit = lock.limit if isinstance(lock, TaskSemaphore) else None
        # A limited task's wait for a permit starts now (or at its first deferral).
        tried = first_try(headers.get(FIRST_TRY_HEADER), time.time()) if limit is not None else 0.0
        keep_for = task._parking_lifetime(options)
        call = signature = None
        if self.envelopes:
            entry = self._envelope(raw, lock, queue_list, count, None if limit is None else tried)
        else:
            call = _Call(
                _request(message, headers, args, kwargs, embed), args, kwargs, options,
                str(name), limit, tried,
            )  # fmt: skip
            signature, _count = task._next_delivery(call, duplicate=False)
            entry = task._signed(lock, call, signature)  # TypeError: not JSON, delivered
        try:
            outcome = lock.park(entry, keep_for, behind=True)
        except OwnerFinished:
            ignored(task, str(name), task_id, message=message)
            return True  # a delivery of a finished run: dropped here, as a pool process would
        if outcome is None or outcome is True:
            self.held.pop(key, None)  # free (or this task's): probed again next
            return False
        fallback = None
        if call is not None:
            handoff_channel.parked(key)
            # As a pool process's parking: a delayed copy in the broker, in case the locks'
            # Redis loses the parked task (a failure raises: delivered, its pool process
            # parks it again, finds it parked, and sends the copy or rejects the message).
            # Sent as from the task's own request, as its pool process sends it (its id
            # the copy's parent, its request's id in the logs).
            task.request_stack.push(call.request)
            _task_stack.push(task)
            try:
                fallback = task._fallback_copy(call, signature, task._fallback_delay(options))
            finally:
                _task_stack.pop()
                task.request_stack.pop()
        lock._contended(task_id)
        signals.task_parked.send(task, name=name, task_id=task_id, limit=limit, queue=queue)
        log.info(
            "redislock: %s[%s] parked behind the holder of %r (%d) before dispatch%s",
            task.name,
            task_id,
            name,
            count + 1,
            "" if fallback is None else f"; fallback copy in {fallback:.1f}s",
        )
        return True

    def _envelope(
        self, raw: dict[str, Any], lock: Any, queue_list: str, count: int, tried: float | None
    ) -> str:
        """The broker's own message as parked (``envelope_entry``): counted, signed."""
        # Copies of the two parts changed (the header here, the delivery tag when parked).
        envelope = {**raw, "headers": {**raw["headers"]}, "properties": {**raw["properties"]}}
        envelope["headers"][REQUEUE_HEADER] = count + 1
        if tried is not None:
            envelope["headers"][FIRST_TRY_HEADER] = tried
        signing_key = settings_for(self.app).signing_key
        return envelope_entry(queue_list, envelope, lock.keys.lock, signing_key)

    def _queue_list(self, message: Any, raw: dict[str, Any]) -> str | None:
        """The list a hand-over pushes this message to, if parking it is exact here.

        That is its queue's first-read list (kombu's BRPOP reads the lists in the order of
        priority_steps), whatever the message's priority: once handed the lock, it must
        not wait behind a backlog while it holds it. None: the message is bound to several
        queues, or to one this worker does not consume (dead letter), or the locks' Redis
        user may not write the list.
        """
        channel = message.channel
        info = raw["properties"]["delivery_info"]
        queues = self._queues_for(channel, info.get("exchange") or "", info["routing_key"])
        if len(queues) != 1 or queues[0] not in getattr(channel, "_active_queues", ()):
            return None
        first = channel.priority_steps[0]
        queue_list = str(channel.global_keyprefix + channel._q_for_pri(queues[0], first))
        if "\n" in queue_list or SEP in queue_list:
            return None
        if self.place is not None:
            named = self.place.name(queue_list)
            if named is None:
                return None
            queue_list = named
        if not self._may_push(client_for(self.app), queue_list):
            return None
        return queue_list

    def _may_push(self, client: Any, queue_list: str) -> bool:
        """Whether the lock's Redis user may write ``queue_list`` (the hand-over pushes
        to it from a script): an ``LREM`` of a value that is never there, once a list per
        app in a process (every task type asks; the ``LREM`` scans the whole list). In
        another database, through the script that selects it (``queuelists.queue_call``)."""
        writable = _writable.setdefault(self.app, {})
        found = writable.get(queue_list)
        if found is None:
            try:
                queue_call(client, "LREM", queue_list, 0, "redislock-probe-" + uuid.uuid4().hex)
                found = True
            except redis.ResponseError as exc:  # NOPERM: a lock user confined to its keys
                found = False
                log.warning(
                    "redislock: parking at delivery is off for queue %r: the locks' Redis "
                    "user may not write it (%s); pool processes park its tasks instead",
                    queue_list,
                    exc,
                )
            writable[queue_list] = found
        return found

    def _queues_for(self, channel: Any, exchange: str, routing_key: str) -> list[str]:
        found = self.queues.get((exchange, routing_key))
        if found is None:
            found = self.queues[(exchange, routing_key)] = list(
                channel._lookup(exchange, routing_key)
            )
        return found


#: A task type none of whose last QUIET_AFTER checked messages had a key that came again
#: has one message in QUIET_EVERY checked only, at random, until one has (:class:`Recurrence`).
QUIET_AFTER = 256
QUIET_EVERY = 8
#: The sampled check's draw, from 0 to 1 (a module attribute: a test may seed it).
_draw = random.random


class Recurrence:
    """Whether one task type's lock keys come again, from the messages checked at delivery.

    Finding a message's key costs the main loop its decoding and the key's rendering
    (about as much as the rest of its delivery), and only a key that comes again can be
    parked there. Once QUIET_AFTER checked messages in a row had new keys (one key per
    order, say), each message is checked with a chance of one in QUIET_EVERY; the first
    whose key came again brings back the check of every message. A message not checked
    goes to a pool process, whose acquire decides and parks it if the lock is held, as a
    key's first message does: what this saves is never a guarantee, only a shortcut.

    Drawn, not every QUIET_EVERY-th: a fixed stride never checks a hot key whose messages
    come in step with it (first in each batch of 8 a producer sends, say), and would keep
    them from being parked at delivery for as long as the other keys stay new.
    """

    __slots__ = ("quiet",)

    def __init__(self) -> None:
        self.quiet = 0  # checked messages in a row whose keys were new

    def skip(self) -> bool:
        """Whether the next message goes unchecked."""
        return self.quiet >= QUIET_AFTER and _draw() * QUIET_EVERY >= 1.0

    def checked(self, recurred: bool) -> None:
        """Count a checked message: ``recurred``, its key came again."""
        self.quiet = 0 if recurred else self.quiet + 1


#: Seconds a consumer's Parkers deliver every message unchecked after the locks' Redis
#: failed to answer a check (a connection error or a timeout) or the broker to take a
#: fallback copy: a Redis or a broker that stalls costs the worker's main loop one socket
#: timeout (or one publish's retries) per this many seconds, not one per message.
OUTAGE_PAUSE = 30.0


class Outage:
    """A consumer's pause of parking at delivery, shared by its task types' Parkers (they
    check against one locks' Redis and publish to one broker)."""

    __slots__ = ("until",)

    def __init__(self) -> None:
        self.until = 0.0  # monotonic; 0: checking

    def paused(self) -> bool:
        return bool(self.until) and time.monotonic() < self.until

    def pause(self, task_name: str, why: str, exc: BaseException) -> None:
        self.until = time.monotonic() + OUTAGE_PAUSE
        log.warning(
            "redislock: parking at delivery paused for %.0fs (at %s): %s (%s: %s); pool "
            "processes take the tasks meanwhile",
            OUTAGE_PAUSE,
            task_name,
            why,
            type(exc).__name__,
            exc,
        )


#: How many lock keys found held a Parker remembers (:attr:`Parker.held`).
HELD_KEYS = 1024
#: How many lock keys of its recent messages a worker's consumer remembers (RecentKeys).
SEEN_KEYS = 4096
#: A key longer than this many bytes is remembered by a digest half as long.
_DIGEST_OVER = 64


class RecentKeys:
    """The lock keys of a consumer's last ``size`` distinct keys' messages, oldest first.

    The check at delivery asks only for a key that comes again: a key seen for the first
    time (or not among the last ``size``) goes to a pool process, whose acquire decides.
    """

    def __init__(self, size: int = SEEN_KEYS) -> None:
        self.size = size
        self._keys: dict[bytes, None] = {}

    def again(self, key: bytes) -> bool:
        """Whether ``key`` is among the recent keys; it is the most recent one after.

        A key longer than a digest is remembered by its digest: keys are rendered from the
        tasks' arguments, and ``size`` of them must not hold ``size`` arguments' worth of
        memory in the worker's main process (two keys of one digest only share a check).
        """
        if len(key) > _DIGEST_OVER:
            key = hashlib.blake2b(key, digest_size=_DIGEST_OVER // 2).digest()
        keys = self._keys
        known = keys.pop(key, False) is None
        keys[key] = None
        if not known and len(keys) > self.size:
            del keys[next(iter(keys))]
        return known


_seen: weakref.WeakKeyDictionary[Any, RecentKeys] = weakref.WeakKeyDictionary()


def _recent_keys(consumer: Any) -> RecentKeys:
    """The consumer's recent keys, shared by its task types (keys are, too)."""
    seen: RecentKeys = _per_consumer(_seen, consumer, RecentKeys)
    return seen


def _per_consumer(table: weakref.WeakKeyDictionary[Any, Any], consumer: Any, make: Any) -> Any:
    """``table``'s entry for ``consumer``, made with ``make()`` at first."""
    try:
        return table.setdefault(consumer, make())
    except TypeError:  # not weakly referable: this task type's own
        return make()


#: Per consumer: its Parkers' pause (:class:`Outage`).
_outages: weakref.WeakKeyDictionary[Any, Outage] = weakref.WeakKeyDictionary()


#: Per app: queue lists the locks' Redis user may write (True) or not (False).
_writable: weakref.WeakKeyDictionary[Any, dict[str, bool]] = weakref.WeakKeyDictionary()


def _broker_uri(consumer: Any) -> str | None:
    """The consumer's broker URL (with its password), if it is a Redis; else None."""
    connection = consumer.connection
    if connection is None or connection.transport.driver_type != "redis":
        return None
    return str(connection.as_uri(include_password=True))


def _broker_place(app: Any, consumer: Any) -> Place | None:
    """Where the consumer's Redis broker keeps its queue lists (``place_of``), or None."""
    uri = _broker_uri(consumer)
    return None if uri is None else place_of(app, uri)


def _same_redis(app: Any, consumer: Any) -> bool:
    """Whether the broker is a Redis on the same server and database as the locks."""
    place = _broker_place(app, consumer)
    return place is not None and place.db == place.own
