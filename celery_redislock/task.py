"""Celery integration: ``LockedTask``, a task base that takes a Redis lock keyed on its arguments.

Usage::

    from celery_redislock import LockedTask

    @app.task(base=LockedTask, lock_key="account:{account_id}", on_contention="requeue")
    def settle(account_id, amount):
        ...

    @app.task(bind=True, base=LockedTask, lock_key="user:{user.id}", on_contention="wait")
    def rebuild(self, user, full=False):
        self.lock.ensure_held()          # raises LockLostError if the lease was lost
        write(fence=self.lock.token)     # reject stale writers at the resource

How it works
============

* The lock is taken **in the worker, right before ``run``** (so it holds whatever
  published the task: ``delay``, ``send_task``, beat, chains, chords). Its owner is the
  task id.
* While ``run`` executes, the process's watchdog renews the lease every ``ttl / 3``.
* It is released on success and on any exception (including ``self.retry()``, unless
  ``lock_release_on_retry = False``, and soft time limits). When the worker process
  itself dies (SIGKILL, OOM, hard time limit, ``revoke(terminate=True)``) the worker's
  main process releases it by task id; if the whole host dies, the lease expires.
* A finished task id is remembered next to the lock for ``lock_done_ttl`` seconds, so
  a second delivery of the same message (visibility-timeout redelivery with
  ``acks_late``) does not run the work twice. A delivery that finds its own task id
  still holding the lock (the first copy still running) is re-queued, not run.

On contention (``on_contention``)
=================================

``"requeue"`` (default)
    Give the worker slot back: the task is sent again with the same id, arguments,
    links and chain after a jittered backoff (``lock_requeue_backoff``, capped well
    below the broker's visibility timeout). Re-queues are counted in a message header,
    separately from ``max_retries``; after ``lock_max_requeues`` the task fails with
    ``LockContendedError`` (``lock_requeue_exhausted="fail"``) or is dropped with a
    warning (``"drop"``).

    Where the broker is the locks' own Redis, a contended message is parked instead, in
    the worker's main process, and the holder's release hands the lock to it and puts
    it back at the head of its queue. A task handed its lock that way also searches its
    queue while it runs (``lock_lookahead`` messages, default 64) for the next task of
    its lock, which its release then hands the lock to and moves ahead, when nobody is
    parked (docs/concepts.md, "Parking and hand-over").
``"wait"``
    Block the worker slot up to ``lock_wait`` seconds, woken by the holder's release;
    then act as ``lock_wait_fallback`` (``"requeue"`` or ``"raise"``).
``"skip"``
    Do not run; record the task as ``SKIPPED`` (for deduplicating periodic jobs).
``"raise"``
    Fail with ``LockContendedError``.

Direct calls (``settle(7, 10)``) and eager mode (``task_always_eager``, ``.apply()``)
never re-queue (that would recurse): they wait up to ``lock_wait`` for the lock, then
raise ``LockContendedError`` (``"skip"`` returns None instead). A call made while a
LockedTask's body runs in the same thread is a plain function call under the caller's
ownership: it re-enters the caller's lock (docs/concepts.md, "Direct and nested calls").

Runs
====

The lock's owner is the *run*: the task id, plus the run's generation (``retries``,
``replaced_task_nesting``), see :func:`run_owner`. A redelivered message is the same run
(its duplicate is recognised in one atomic step: the acquire script never re-enters a
run's own hold); ``self.retry()`` and ``self.replace()`` start new runs that wait for the
previous one. A release that cannot reach Redis does not fail the run: its hold stops
renewing and the release is retried in the background.

Lease lost mid-run
==================

If the watchdog cannot keep the lease (Redis unreachable past the lease's validity
deadline, the key gone or taken), a warning is logged at once, ``self.lock.lost`` is
set and the next ``self.lock.ensure_held()`` raises ``LockLostError``. The work is not
interrupted (no lock can stop a paused process: fence your writes with
``self.lock.token``). When ``run`` returns, the task fails with ``LockLostError`` instead
of succeeding, so its outcome records that the work may have overlapped another run.

Periodic jobs
=============

``lock_hold=<seconds>`` keeps the lock for that long after a successful run, so a second
beat (or a restarted one) firing the same job within the period finds it held and,
with ``on_contention="skip"``, skips it.
"""

from __future__ import annotations

import base64
import contextvars
import functools
import hashlib
import logging
import os
import random
import secrets
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, NamedTuple

import redis
from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery import Task
from celery import signals as celery_signals
from celery.exceptions import Ignore, Reject, Retry
from celery.worker.request import Request
from kombu import compression, serialization
from kombu.utils import json as kombu_json

from . import metrics, signals, signing
from ._core import (
    LINE_MARGIN_MS,
    MAX_SECONDS,
    MIN_SECONDS,
    LockKeys,
    OwnerFinished,
    OwnerRunning,
    backoff,
    decode_acquire,
    lease_ms,
    name_from_lock_key,
)
from ._deferred import UNREACHABLE, deferred_releases
from ._errors import (
    LockConfigurationError,
    LockContendedError,
    LockLostError,
    LockNotOwnedError,
    LockQuorumError,
)
from ._quorum import decided_by, given_back, quorum_error, release_code
from ._renewal import scheduler_for
from ._scripts import scripts_for
from .keys import KeyTemplate
from .lock import RedisLock
from .redlock import RedLock
from .settings import LockOptions, LockSettings, task_overrides

log = logging.getLogger(__name__)

#: Message header counting re-queues (kept apart from Celery's ``retries``).
REQUEUE_HEADER = "redislock_requeues"
#: Header the worker's main process sets (in memory, never published) on a message that was
#: handed its lock through a queue list: the list its release searches (look-ahead).
LOOKAHEAD_HEADER = "redislock_lookahead"
SKIPPED = "SKIPPED"


class _Pull(NamedTuple):
    """The next queued task of a lock (look-ahead): its message, as found in its list;
    ``task_id`` "" when none was found (the release ends the lock's look-ahead chain)."""

    queue_list: str
    chain: str  # the queue list's look-ahead chain key (handoff.lua)
    task_id: str = ""  # "" (none found, or the search had not finished)
    raw: bytes = b""
    entry: str = ""  # the message as a parked envelope (envelope_entry)
    keep_ms: int = 0  # lifetime of its parked records (the parking lifetime)
    reach: int = 0  # how far from the read end the release looks for it (handoff.lua)


class _Handed(NamedTuple):
    """A parked task a release (or the sweeper) just handed the lock to, whose message the
    worker checks and sends: :func:`deliver_handed_over`. Everything but ``lock_key`` was
    read back from Redis."""

    lock_key: bytes
    task_id: bytes
    message: bytes  # a signed parked signature, or a parked broker envelope
    tag: bytes = b""  # an envelope's delivery tag: "<placeholder>h<tag>"


class _Call(NamedTuple):
    """One execution's particulars, passed between the contention steps."""

    request: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: LockOptions
    name: str


def _task_argv(owner: str, lease: int, line: Any, token: str, adopt: str | None) -> list[Any]:
    """acquire.lua's ARGV for a task run: never a re-entry ("task"), or taking over the
    hold an earlier run kept across ``self.retry()`` ("adopt")."""
    if adopt is None:
        return [owner, lease, line, token, "task"]
    return [owner, lease, line, token, "adopt", "", adopt]


def run_owner(task_id: str, retries: Any = 0, nesting: Any = 0) -> str:
    """The lock owner of one run of a task: its id, and the run's place among the runs
    that share that id (``self.retry()`` sends the same id again with ``retries`` + 1,
    ``self.replace()`` with ``replaced_task_nesting`` + 1). A redelivery of a message is
    the same run (same owner: its duplicate is recognised); a retry or a replacement is
    a new run that waits for the previous one like any other task, and is not taken for
    a duplicate of it. The first run's owner is the task id itself."""
    suffix = ""
    for tag, value in (("n", nesting), ("r", retries)):
        try:
            number = int(value or 0)
        except (TypeError, ValueError, OverflowError):  # a header no producer of ours sends
            number = 0
        if number > 0:
            suffix += f"{tag}{number}"
    return f"{task_id}~{suffix}" if suffix else task_id


def request_owner(request: Any) -> str:
    """:func:`run_owner` of a Celery request (or a message's headers, as a dict)."""
    get = request.get if isinstance(request, dict) else functools.partial(getattr, request)
    return run_owner(str(get("id", None)), get("retries", 0), get("replaced_task_nesting", 0))


class TaskLock(RedisLock):
    """A :class:`RedisLock` owned by one run of a task (:func:`run_owner`), with the run's
    "done" marker beside it. A run never re-enters its lock: an attempt that finds its own
    owner holding it (another delivery of the same run) raises ``OwnerRunning`` and
    changes nothing."""

    _adopt: str | None = None  # set during take(adopt=...)
    _direct_grants = False  # a hold count of 0 means "handed over, not started" here
    pulled: str | None = None  # the queued task the last finish() handed the lock to
    #: The queue lists a hand-over may push a parked envelope to itself, and the task names
    #: it may be for, one a line (handoff.lua's ARGV[10], ARGV[11]): ``task_lock`` sets the
    #: app's. Other envelopes come back to the worker, which checks them first.
    push_to: tuple[str, str] = ("", "")

    def __init__(self, client: Any, name: str, *, task_id: str, options: LockOptions) -> None:
        super().__init__(client, name, ttl=options.ttl, owner=task_id, prefix=options.prefix)
        self.done_key = self.keys.lock + b":done:" + task_id.encode()
        self.parked = self.keys.lock + b":parked"
        self.parked_messages = self.keys.lock + b":parked:messages"
        self.dispatched = self.keys.lock + b":parked:dispatched"
        self.registry = self.prefix + "parked"  # the sweeper's: locks with parked tasks

    def _acquire_keys(self) -> list[bytes]:
        return [*super()._acquire_keys(), self.done_key]

    def take(self, *, adopt: str | None = None) -> bool:
        """One attempt, renewed while held. Raises OwnerFinished (this run finished) or
        OwnerRunning (another delivery of this run holds it; nothing changed).

        ``adopt``: the owner of an earlier run of this task that kept the lock across
        ``self.retry()``; its hold, if still there, becomes this run's.
        """
        self._adopt = adopt
        try:
            return self._try(self._current_owner(), self._lease, True) is True
        finally:
            self._adopt = None

    def _acquire_argv(self, owner: str, lease: int, line: bool) -> list[Any]:
        return _task_argv(owner, lease, LINE_MARGIN_MS if line else "", "", self._adopt)

    def park(self, message: str, keep_for: float, *, behind: bool = False) -> bool | int | None:
        """Take the lock, or park ``message`` behind the holder: True, or the holder's pttl.

        With ``behind``, park only behind another owner's hold and never take the lock:
        None when it is free or this task id holds it (the worker's main process parking
        before a pool process gets the task). A parked task's lock is also entered in
        the registry the workers' sweeper scans, in the same script.
        """
        owner = self._current_owner()
        sent_at = time.monotonic()
        keys = [
            self.keys.lock,
            self.keys.fence,
            self.done_key,
            self.parked,
            self.parked_messages,
            self.dispatched,
            self.registry,
        ]
        args = [owner, self._lease, message, lease_ms(keep_for, "parking lifetime")]
        if behind:
            args.append("behind")
        raw = self._scripts.park(keys=keys, args=args)
        if int(raw[0]) == 2:
            return None
        reply = decode_acquire(raw)
        if reply.finished:
            raise OwnerFinished(self.name)
        if reply.running:
            raise OwnerRunning(self.name)
        if not reply.acquired:
            return reply.pttl
        hold, is_new = self._record_acquired(owner, reply, sent_at, self._lease, True)
        if is_new:
            scheduler_for(self.client).add(hold)
        return True

    def handoff_args(
        self,
        owner: str,
        mode: str,
        done_ttl: float | None,
        pull: _Pull | None = None,
        token: int | None = None,
    ) -> tuple[list[Any], list[Any]]:
        keys: list[Any] = [
            self.keys.lock,
            self.keys.channel,
            self.keys.fence,
            self.parked,
            self.parked_messages,
            self.done_key,
            self.dispatched,
            self.keys.waiters,
            self.keys.claims,
        ]
        done_ms = 0 if done_ttl is None else lease_ms(done_ttl, "lock_done_ttl")
        args: list[Any] = [owner, mode, self._lease, done_ms]
        if pull is not None:
            keys += [pull.queue_list, self.registry, pull.chain]
            args += [pull.task_id, pull.raw, pull.entry, pull.keep_ms, pull.reach]
        else:
            args += ["", "", "", "", ""]
        return keys, [*args, *self.push_to, "" if token is None else token]

    def handed(self, reply: list[Any]) -> _Handed | None:
        """The parked task a hand-over script's ``reply`` says the worker must send, if any."""
        return _handed(self.keys.lock, reply)

    def finish(
        self,
        *,
        hold: float,
        done_ttl: float | None,
        lookahead: Callable[[], _Pull | None] | None = None,
        token: int | None = None,
    ) -> _Handed | None:
        """Give the hold back (or keep it ``hold`` seconds more, unrenewed).

        ``token``: only the holding with this fencing token (a release retried late must
        not touch a later holding of the same run: another copy of its message that took
        the lock after this one's lease ran out).

        With ``done_ttl``, also mark the task id done so a later delivery of the same
        message does not run again. Returns the parked task the lock was handed to whose
        message the worker must check and send (:func:`deliver_handed_over`), if any.
        Raises like :meth:`release` when the hold was lost — after recording any hand-over
        on the exception's ``handed_to``.

        ``lookahead`` (a release without ``hold``): finds the next queued task of this
        lock, which the release hands the lock to when no task is parked or waiting;
        ``self.pulled`` is then its task id.
        """
        self.pulled = None
        owner = self._current_owner()
        held = self._holds.get(owner)
        if held is not None:
            held.releasing += 1  # a renewal crossing this release must not report a loss
        try:
            if hold <= 0:
                pull = None
                if lookahead is not None:
                    try:
                        pull = lookahead()
                    except Exception:  # only a shortcut: the task comes in its turn anyway
                        log.debug("redislock: look-ahead failed for %r", self.name, exc_info=True)
                handoff_keys, handoff_args = self.handoff_args(owner, "one", done_ttl, pull, token)
                reply = self._scripts.handoff(keys=handoff_keys, args=handoff_args)
                code = int(reply[0])
                message = self.handed(reply)
                if len(reply) > 3 and reply[1] is None:  # handed to the look-ahead's queued task
                    self.pulled = _text(reply[2])
            else:
                keys = self.keys.release_keys()
                args: list[Any] = [owner, "hold", lease_ms(hold, "lock_hold"), "", ""]
                if done_ttl is not None:
                    keys.append(self.done_key)
                    args[3] = lease_ms(done_ttl, "lock_done_ttl")
                if token is not None:
                    args.append(token)
                code, message = int(self._scripts.release(keys=keys, args=args)), None
        finally:
            if held is not None:
                held.releasing -= 1
        try:
            self._record_released(owner, code)
        except LockNotOwnedError as exc:
            exc.handed_to = message  # type: ignore[attr-defined]
            raise
        return message


class QuorumTaskLock(RedLock):
    """:class:`TaskLock` over a quorum of masters (``redislock_urls``): no parking.

    Owned by the task id, with the task's "done" marker on every node; a contended task
    is re-queued with a countdown (parked hand-over needs a single Redis).
    """

    _adopt: str | None = None  # set during take(adopt=...)

    def __init__(
        self,
        clients: list[Any],
        name: str,
        *,
        task_id: str,
        options: LockOptions,
        node_timeout: float,
    ) -> None:
        super().__init__(
            clients,
            name,
            ttl=options.ttl,
            owner=task_id,
            prefix=options.prefix,
            node_timeout=node_timeout,
        )
        self.done_key = self.keys.lock + b":done:" + task_id.encode()

    def _acquire_keys(self) -> list[bytes]:
        return [*super()._acquire_keys(), self.done_key]

    def take(self, *, adopt: str | None = None) -> bool:
        """One attempt on every node, renewed while held; raises like :meth:`TaskLock.take`."""
        self._adopt = adopt
        try:
            return self._try(self._current_owner(), self._lease, True) is None
        finally:
            self._adopt = None

    def _attempt_argv(self, owner: str, lease: int, fresh: bool) -> list[Any]:
        return _task_argv(owner, lease, "", "new-token" if fresh else "", self._adopt)

    def _each_node(self, keys: list[bytes], args: list[Any]) -> int:
        owner = self._current_owner()
        round_ = self._round(self._giving_back(owner, keys, args))
        code = release_code(round_, self.quorum)
        if code is None:
            raise quorum_error(self.name, owner, "release", round_, self.quorum)
        return code

    def _start_group(self, hold: Any, outcome: Any, sent_at: float, signal: Any) -> Any:
        self._granted_by = list(outcome.granted)
        return super()._start_group(hold, outcome, sent_at, signal)

    def _undo_plan(self, owner: str, outcome: Any, fresh: bool) -> tuple[list[int], list[Any]]:
        if outcome is not None and outcome.running:
            # Another delivery of this run holds it (there): give back only what this
            # attempt is known to have taken, never a hold that may be the other's.
            return sorted(outcome.granted), [owner, "one"]
        return super()._undo_plan(owner, outcome, fresh)

    def release_all(self) -> int:
        """Every hold of the task id, on every node (its process died)."""
        return self._each_node(self.keys.release_keys(), [self.owner, "all"])

    pulled: str | None = None  # never: a quorum lock does not look ahead

    def finish(
        self,
        *,
        hold: float,
        done_ttl: float | None,
        lookahead: Callable[[], _Pull | None] | None = None,
        token: int | None = None,
    ) -> _Handed | None:
        """Give the hold back on every node (or keep it ``hold`` seconds), marking the task
        id done (``lookahead`` is unused: ``LockedTask._lookahead`` gives a quorum lock
        none). Raises :class:`LockLostError` like :meth:`TaskLock.finish`; when too few
        nodes answer to tell, the hold is given up with a warning (the silent nodes get
        the release when they answer, or the lease ends there)."""
        owner = self._current_owner()
        keys = self.keys.release_keys()
        args: list[Any] = (
            [owner, "hold", lease_ms(hold, "lock_hold")]
            if hold > 0
            else [
                owner,
                "all",
                0,
            ]
        )
        if done_ttl is not None:
            keys.append(self.done_key)
            args.append(lease_ms(done_ttl, "lock_done_ttl"))
        held = self._holds.get(owner)
        valid = self._valid(held)
        self._ack_releasing(held, 1)
        try:
            round_ = self._round(
                self._giving_back(owner, keys, args), decided_by(given_back, self.quorum)
            )
        finally:
            self._ack_releasing(held, -1)
        try:
            self._settle_release(owner, held, round_, valid)
        except LockQuorumError as exc:
            log.warning("redislock: %s", exc)
        return None


AnyTaskLock = TaskLock | QuorumTaskLock


def task_lock(app: Any, name: str, *, task_id: str, options: LockOptions) -> AnyTaskLock:
    """The lock of one task execution: on the app's one Redis, or its quorum of masters."""
    settings = settings_for(app)
    if settings.urls:
        return QuorumTaskLock(
            quorum_clients_for(app),
            name,
            task_id=task_id,
            options=options,
            node_timeout=settings.node_timeout,
        )
    lock = TaskLock(client_for(app), name, task_id=task_id, options=options)
    lock.push_to = push_targets(app)
    return lock


# ------------------------------------------------------------------ per-app state

_settings: weakref.WeakKeyDictionary[Any, LockSettings] = weakref.WeakKeyDictionary()
_clients: weakref.WeakKeyDictionary[Any, tuple[int, redis.Redis]] = weakref.WeakKeyDictionary()


def settings_for(app: Any) -> LockSettings:
    """The app's validated ``redislock_*`` settings (read once per app)."""
    found = _settings.get(app)
    if found is None:
        found = _settings[app] = LockSettings.from_conf(app.conf)
        log.debug("redislock: using Redis from %s", found.url_source)
    return found


def client_for(app: Any) -> redis.Redis:
    """The Redis client for the app's locks, one per process (new after a fork)."""
    found = _clients.get(app)
    if found is None or found[0] != os.getpid():
        settings = settings_for(app)
        options = {
            "socket_timeout": 10.0,
            "socket_connect_timeout": 10.0,
            "health_check_interval": 30,
        }
        options.update(settings.redis_options)
        found = _clients[app] = (os.getpid(), redis.Redis.from_url(settings.url, **options))
    return found[1]


_quorum_clients: weakref.WeakKeyDictionary[Any, tuple[int, list[redis.Redis]]]
_quorum_clients = weakref.WeakKeyDictionary()


def quorum_clients_for(app: Any) -> list[redis.Redis]:
    """One client per ``redislock_urls`` node, one set per process (new after a fork)."""
    found = _quorum_clients.get(app)
    if found is None or found[0] != os.getpid():
        settings = settings_for(app)
        options: dict[str, Any] = {
            "socket_timeout": 10.0,
            "socket_connect_timeout": 10.0,
            "health_check_interval": 30,
        }
        options.update(settings.redis_options)
        clients = [redis.Redis.from_url(url, **options) for url in settings.urls]
        found = _quorum_clients[app] = (os.getpid(), clients)
    return found[1]


# ------------------------------------------------------------------ the task base


class LockedTask(Task):  # type: ignore[misc]
    """Task base that runs each call under a Redis lock keyed on its arguments.

    Options (task attributes; ``None`` means the app's ``redislock_*`` setting):
    ``lock_key`` (template, callable or None for one lock per task), ``lock_key_hash``,
    ``lock_ttl``, ``lock_prefix``, ``on_contention``, ``lock_wait``,
    ``lock_wait_fallback``, ``lock_max_requeues``, ``lock_requeue_backoff``,
    ``lock_requeue_exhausted``, ``lock_release_on_retry``, ``lock_done_ttl``,
    ``lock_hold``, ``lock_lookahead``. See the module docstring for what each does.
    """

    abstract = True
    Request = "celery_redislock.task:LockedRequest"
    Strategy = "celery_redislock.parking:strategy"

    lock_key: ClassVar[Any] = None
    lock_key_hash: ClassVar[bool] = False
    lock_ttl: ClassVar[float | None] = None
    lock_prefix: ClassVar[str | None] = None
    on_contention: ClassVar[str | None] = None
    lock_wait: ClassVar[float | None] = None
    lock_wait_fallback: ClassVar[str | None] = None
    lock_max_requeues: ClassVar[int | None] = None
    lock_requeue_backoff: ClassVar[tuple[float, float] | None] = None
    lock_requeue_exhausted: ClassVar[str | None] = None
    lock_release_on_retry: ClassVar[bool | None] = None
    lock_done_ttl: ClassVar[float | None] = None
    lock_hold: ClassVar[float | None] = None
    lock_lookahead: ClassVar[int | None] = None

    _lock_template: ClassVar[KeyTemplate]
    _lock_overrides: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Validate the lock options when the task is decorated, naming task and option."""
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is None:
            return  # an intermediate base class: checked when a task is made from it
        name = str(cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}")
        attributes = {
            attr: getattr(cls, attr, None) for attr in dir(LockedTask) if attr.startswith("lock_")
        }
        attributes["on_contention"] = cls.on_contention
        cls._lock_overrides = task_overrides(attributes, name)
        if not isinstance(cls.lock_key_hash, bool):
            raise LockConfigurationError(
                f"task {name!r}: lock_key_hash must be True or False, got {cls.lock_key_hash!r}"
            )
        if isinstance(run, staticmethod):
            signature_of: Any = run.__func__
        else:  # bind=True: the first parameter is the task itself
            signature_of = functools.partial(run, None)
        cls._lock_template = KeyTemplate(
            cls.lock_key, signature_of, owner_name=name, option="lock_key", hashed=cls.lock_key_hash
        )

    @property
    def lock(self) -> Any:
        """The lock of the current execution (``bind=True`` tasks: ``self.lock``); None outside.

        Inside a direct call nested in a running task (see :meth:`__call__`), the nested
        call's lock, and the caller's again once it returns.
        """
        current = _current_execution.get()
        if current is not None and current[1] is self:
            return current[2]
        return getattr(self.request, "redislock", None)

    def lock_options(self) -> LockOptions:
        return settings_for(self.app).defaults.merged(self._lock_overrides)

    def lock_name(self, args: Any, kwargs: Any) -> str:
        """The lock name this call would take (the rendered ``lock_key``)."""
        return self._lock_template.render(tuple(args or ()), dict(kwargs or {}))

    # -- execution -------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task under its lock.

        A call made while a LockedTask's body runs in the same thread (or asyncio task)
        — ``settle(7, 10)`` inside another task's body, or an eager ``.delay()`` /
        ``.apply()`` there — is a plain function call made under the caller's ownership:
        on a lock the caller holds it re-enters (no wait, no duplicate check), on another
        it waits up to ``lock_wait`` like any direct call, and ``self.lock`` inside it is
        its own lock until it returns.
        """
        enclosing = _current_execution.get()
        request = self.request
        if enclosing is not None or request.called_directly or request.is_eager:
            return self._call_locally(args, kwargs, None if enclosing is None else enclosing[0])
        return self._call_in_worker(args, kwargs)

    def _call_in_worker(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        options = self.lock_options()
        name = self.lock_name(args, kwargs)  # a bad value fails the task here: nothing taken
        owner = request_owner(request)
        lock = task_lock(self.app, name, task_id=owner, options=options)
        call = _Call(request, args, kwargs, options, name)
        # A retry adopts the hold its previous run kept (lock_release_on_retry=False) only
        # once: the first delivery of the retry message claims the marker.
        kept = None
        try:
            if request.retries and not options.release_on_retry:
                kept = _claim_kept_hold(lock, request)
            # One atomic attempt: taken (or handed to this run), held by another owner,
            # held by this very run (another delivery of it: nothing is changed), or done.
            if not lock.take(adopt=kept):
                lock._contended(owner)
                policy = options.on_contention
                if policy == "wait" and self._wait_for(lock, options):
                    pass
                elif policy == "requeue" and isinstance(lock, TaskLock) and self._park(lock, call):
                    pass  # the lock came free meanwhile
                else:
                    return self._contended(call, duplicate=False)
        except OwnerFinished:
            log.info(
                "redislock: %s[%s] already finished under %r; duplicate delivery ignored",
                self.name,
                request.id,
                name,
            )
            raise Ignore() from None
        except OwnerRunning:
            # Another delivery of this very run holds the lock (running, or just died and
            # its lease runs out): this copy comes back later, after the other's outcome.
            return self._contended(call, duplicate=True)
        except (*UNREACHABLE, LockQuorumError) as exc:
            # The lock's Redis (or a majority of its nodes) could not be asked: the body
            # has not run, so the task must not end as a failure (its message would be
            # acknowledged, and the task lost). It comes back later instead.
            return self._unreachable(call, exc)
        request.redislock = lock
        return self._run_holding(lock, options, args, kwargs)

    def _unreachable(self, call: _Call, exc: BaseException) -> Any:
        """The lock could not be taken because Redis did not answer: send the task again
        after the longest re-queue backoff, without counting it as a re-queue (an outage
        is not contention), or, when that cannot be published either (the broker is the
        same Redis), reject its message with requeue: unacknowledged, it is delivered
        again when the broker is back. The body never ran, so nothing runs twice."""
        request, options, name = call.request, call.options, call.name
        countdown = min(options.requeue_backoff[1], _visibility_timeout(self.app) / 4)
        headers = dict(request.headers or {})
        signature = self.signature_from_request(request, call.args, call.kwargs, headers=headers)
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
        signals.task_requeued.send(self, name=name, task_id=request.id, countdown=countdown)
        raise Ignore()

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
        try:
            return lock.acquire(timeout=options.wait)
        except OwnerFinished:  # another delivery of this task finished meanwhile
            raise Ignore() from None

    def _run_body(self, lock: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The task's body, with ``self.lock`` and nested calls seeing this execution."""
        owner = lock._current_owner()
        token = _current_execution.set((owner, self, lock))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _current_execution.reset(token)

    def _run_holding(
        self,
        lock: AnyTaskLock,
        options: LockOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        lookahead = self._lookahead(lock, options)
        try:
            result = self._run_body(lock, args, kwargs)
        except Retry as retry:
            # The run is over (the retry is a run of its own, with another owner): it is
            # marked done, so a late copy of this run's message does not run it again.
            if options.release_on_retry:
                _finish_quietly(lock, self, options, hold=0.0, lookahead=lookahead)
            else:
                self._keep_for_retry(lock, retry, options)
            raise
        except BaseException:  # lock_hold is for successes
            _finish_quietly(lock, self, options, hold=0.0, lookahead=lookahead)
            raise
        lost = lock.lost
        _finish_quietly(lock, self, options, lookahead=lookahead)
        if lost.is_set():
            raise LockLostError(
                f"task {self.name}[{self.request.id}] finished, but its lock {lock.name!r} was "
                f"lost while it ran ({lost.reason}); its effects may have overlapped another "
                f"run (fence writes with self.lock.token)",
                name=lock.name,
                owner=self.request.id,
                reason=lost.reason or "expired",
            )
        return result

    def _lookahead(
        self, lock: AnyTaskLock, options: LockOptions
    ) -> Callable[[], _Pull | None] | None:
        """How this run's release finds the next queued task of its lock, if it looks.

        Only a task handed its lock through a queue list looks: its lock has a queue of
        tasks behind it, so the next one is likely in the list, not yet fetched. The
        worker's main process says which list (``LOOKAHEAD_HEADER``, set in memory on a
        delivery with a hand-over's tag, where parking at delivery applies; a header
        that came in a message is not trusted). The search runs in this process's
        look-ahead thread while the task runs, off the lock's critical path: the release
        does not wait for it (a search not finished by then is not used). Never raises.
        """
        request = self.request
        queue_list = getattr(request, LOOKAHEAD_HEADER, None)
        properties = getattr(request, "properties", None) or {}
        if (
            not isinstance(lock, TaskLock)
            or not isinstance(queue_list, str)
            or not str(properties.get("delivery_tag", "")).startswith(TAG_PREFIX)
            or not options.lookahead
            or options.on_contention != "requeue"
            or queue_list in _lookahead_denied
        ):
            return None
        keep_for = self._parking_lifetime(options)
        try:
            search = _lookahead_thread().submit(
                _next_queued, self.app, lock, queue_list, options.lookahead, keep_for
            )
        except Exception:  # no thread to search with: release without look-ahead
            log.debug("redislock: look-ahead could not start", exc_info=True)
            return None
        nothing = _Pull(queue_list, lookahead_chain(options.prefix, queue_list))

        def found() -> _Pull | None:
            return search.result() if search.done() else nothing

        return found

    def signature_from_request(
        self,
        request: Any = None,
        args: Any = None,
        kwargs: Any = None,
        queue: Any = None,
        **extra_options: Any,
    ) -> Any:
        """Celery's, without the worker's in-memory look-ahead header (a retry or a
        re-queue must not carry it to another delivery) or a parked envelope's signature."""
        signature = super().signature_from_request(request, args, kwargs, queue, **extra_options)
        headers = signature.options.get("headers")
        dropped = (LOOKAHEAD_HEADER, signing.PARKED_HEADER)
        if isinstance(headers, dict) and any(name in headers for name in dropped):
            signature.options["headers"] = {k: v for k, v in headers.items() if k not in dropped}
        return signature

    def _keep_for_retry(self, lock: AnyTaskLock, retry: Retry, options: LockOptions) -> None:
        """Keep the hold for the retried run: an unrenewed lease covering the retry delay."""
        delay = retry.when if isinstance(retry.when, (int, float)) else options.ttl
        hold = min(max(0.0, float(delay)) + options.ttl, MAX_SECONDS)
        try:
            lock.finish(hold=hold, done_ttl=options.done_ttl)
            _mark_kept_hold(lock, self.request, hold)
        except (LockNotOwnedError, *UNREACHABLE) as exc:
            if not isinstance(exc, LockNotOwnedError):
                lock.close()  # not renewed: the lease ends it; the retry waits for that
            log.warning(
                "redislock: %s[%s] could not keep %r for its retry: %s",
                self.name,
                self.request.id,
                lock.name,
                exc,
            )
            return
        log.info(
            "redislock: %s[%s] keeps %r across its retry", self.name, self.request.id, lock.name
        )

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
            or policy == "requeue"
            or (policy == "wait" and options.wait_fallback == "requeue")
        ):
            return self._requeue(call, duplicate=duplicate)
        if policy == "skip":
            log.info("redislock: %s[%s] skipped: %r is held", self.name, request.id, name)
            if not self.ignore_result and request.id:
                self.update_state(state=SKIPPED, meta={"lock": name})
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
        request, args, kwargs, options, name = call
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
        return self.signature_from_request(request, args, kwargs, headers=headers), done + 1

    def _still_parked(self, call: _Call) -> bool:
        if settings_for(self.app).urls:
            return False  # no parking on a quorum
        lock_key = LockKeys.for_name(call.name, call.options.prefix).lock
        owner = request_owner(call.request)
        return bool(client_for(self.app).hexists(lock_key + b":parked:messages", owner))

    def _park(
        self,
        lock: TaskLock,
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
            message = _dumps(dict(signature))
        except TypeError:
            return False
        key = settings_for(self.app).signing_key
        message = signing.sign_signature(key, lock.keys.lock, lock.owner or request.id, message)
        fallback = self._fallback_delay(options)
        try:
            outcome = lock.park(message, keep_for=self._parking_lifetime(options))
        except OwnerFinished:
            raise Ignore() from None
        if outcome is True:
            return True
        with_fallback = _park_fallback(self.app)
        if with_fallback:
            self._publish(signature, countdown=fallback)
        signals.task_parked.send(self, name=name, task_id=request.id)
        log.info(
            "redislock: %s[%s] parked behind the holder of %r (%d)%s",
            self.name,
            request.id,
            name,
            count,
            f"; fallback copy in {fallback:.1f}s" if with_fallback else "",
        )
        raise Ignore()

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
        signals.task_requeued.send(self, name=name, task_id=request.id, countdown=countdown)
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

    def publish_handed_over(self, handed: _Handed | None) -> None:
        """Send the message of the parked task the lock was just handed to, if it verifies
        (:func:`deliver_handed_over`); never raises."""
        if handed is None:
            return
        try:
            deliver_handed_over(self.app, handed, lease_ms(self.lock_options().ttl, "lock_ttl"))
        except Exception:  # the sweeper (or its fallback copy) still runs it
            log.exception("redislock: could not publish the task the lock was handed to")

    def _call_locally(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], enclosing: str | None = None
    ) -> Any:
        """A direct or eager call: wait up to ``lock_wait`` (never re-queue). Its owner is
        ``enclosing`` (the owner of the LockedTask body this call is nested in), else the
        eager request's task id, else the calling thread."""
        options = self.lock_options()
        name = self.lock_name(args, kwargs)
        request_id = self.request.id
        owner = enclosing or request_id or None
        settings = settings_for(self.app)
        lock: RedisLock | RedLock
        if settings.urls:
            lock = RedLock(
                quorum_clients_for(self.app),
                name,
                ttl=options.ttl,
                owner=owner,
                prefix=options.prefix,
                node_timeout=settings.node_timeout,
            )
        else:
            lock = RedisLock(
                client_for(self.app), name, ttl=options.ttl, owner=owner, prefix=options.prefix
            )
        wait = 0.0 if options.on_contention in ("skip", "raise") else options.wait
        if not lock.acquire(timeout=wait):
            if options.on_contention == "skip":
                return None
            raise LockContendedError(
                f"{self.name} called directly/eagerly: lock {name!r} is held (waited {wait}s; "
                f"direct and eager calls never re-queue)",
                name=name,
                owner=request_id,
            )
        previous = getattr(self.request, "redislock", None)
        self.request.redislock = lock
        try:
            return self._run_body(lock, args, kwargs)
        finally:
            self.request.redislock = previous
            lock.release()


#: The LockedTask execution whose body runs in this context (thread, or asyncio task):
#: (its lock owner, the task, its lock). A LockedTask called inside it is a plain function
#: call under that owner (LockedTask.__call__).
_current_execution: contextvars.ContextVar[tuple[str, Any, Any] | None] = contextvars.ContextVar(
    "celery_redislock_task_execution", default=None
)

_rng = random.Random()


#: Messages one look-ahead read fetches (the next read, if any, fetches as many more).
LOOKAHEAD_CHUNK = 16
#: Bytes of messages one look-ahead search reads at most (it stops after the read that
#: reaches this).
LOOKAHEAD_BYTES = 1 << 20
_lookahead_executor: tuple[int, ThreadPoolExecutor] | None = None
_lookahead_mutex = threading.Lock()


def _lookahead_thread() -> ThreadPoolExecutor:
    """This process's one look-ahead thread (a new one after a fork)."""
    global _lookahead_executor
    with _lookahead_mutex:
        if _lookahead_executor is None or _lookahead_executor[0] != os.getpid():
            _lookahead_executor = (
                os.getpid(),
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="redislock-lookahead"),
            )
        return _lookahead_executor[1]


def lookahead_chain(prefix: str, queue_list: str) -> str:
    """The key naming the one lock whose tasks look-ahead moves ahead in ``queue_list``."""
    return f"{prefix}lookahead:{queue_list}"


def _next_queued(
    app: Any, lock: TaskLock, queue_list: str, limit: int, keep_for: float
) -> _Pull | None:
    """The oldest message among the ``limit`` next to be read from ``queue_list`` whose task
    takes ``lock`` (requeue mode), if no task is parked behind the lock already (None);
    else a :class:`_Pull` without a task (the release ends this lock's look-ahead chain,
    if it has one). Whether another lock's chain holds the list is the release's to say.

    kombu's Redis transport pushes messages on the left of a queue's list and reads them
    from the right: the right end is the oldest. One round trip reads the parked count and
    the first chunk; most hot locks have their next task in it.
    """
    try:
        return _search_queue(app, lock, queue_list, limit, lease_ms(keep_for, "parking lifetime"))
    except redis.exceptions.NoPermissionError as exc:
        _lookahead_denied.add(queue_list)
        log.warning(
            "redislock: look-ahead is off for queue list %r in this process: the locks' Redis "
            "user lacks a permission it needs (%s); grant it +lrange on the queue lists",
            queue_list,
            exc,
        )
        return None


#: Queue lists the locks' Redis user may not read (this process stops searching them).
_lookahead_denied: set[str] = set()


def _search_queue(
    app: Any, lock: TaskLock, queue_list: str, limit: int, keep_ms: int
) -> _Pull | None:
    accept = serialization.prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    chain = lookahead_chain(lock.prefix, queue_list)
    nothing = _Pull(queue_list, chain)
    signing_key = settings_for(app).signing_key
    start = read = 0
    while start < limit and read < LOOKAHEAD_BYTES:
        end = min(start + LOOKAHEAD_CHUNK, limit)
        if start == 0:
            pipe = lock.client.pipeline(transaction=False)
            pipe.llen(lock.parked)
            pipe.lrange(queue_list, -end, -1)
            parked, raws = pipe.execute()
            if parked:
                return None  # the release hands the lock to a parked task
        else:
            raws = lock.client.lrange(queue_list, -end, -start - 1)
        for position, raw in enumerate(map(_bytes, reversed(raws)), start):  # oldest first
            read += len(raw)
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            lock_key = _lock_of.get(digest, b"")
            if lock_key == b"":  # not seen by this process yet: decode it
                lock_key = _lock_of[digest] = _lock_key_of(app, raw, accept)
                if len(_lock_of) > LOOKAHEAD_CACHE:
                    del _lock_of[next(iter(_lock_of))]  # the oldest entry
            if lock_key == lock.keys.lock:
                envelope = kombu_json.loads(raw)  # type: ignore[no-untyped-call]
                headers = envelope["headers"]
                headers.pop(LOOKAHEAD_HEADER, None)
                queued_owner = request_owner(headers)
                if queued_owner != lock.owner:
                    entry = envelope_entry(queue_list, envelope, lock.keys.lock, signing_key)
                    reach = position + 1 + QUEUE_REACH
                    return _Pull(queue_list, chain, queued_owner, raw, entry, keep_ms, reach)
        if len(raws) < end - start:
            return nothing  # the whole list was read
        start = end
    return nothing


#: How far from a queue list's read end the hand-over scripts look for a message (LPOS
#: MAXLEN), so that one fetched meanwhile never costs a scan of a long backlog: a
#: look-ahead release, this much farther than where its search found the message (hand-overs
#: pushed to the read end meanwhile move it back; beyond that it stays in its turn), and
#: the sweeper, for an envelope a hand-over pushed (beyond that it is sent again).
QUEUE_REACH = 1000

#: Queued messages whose lock this process knows (digest of the message -> lock key or
#: None), so that each message is decoded once however many look-ahead searches read it.
_lock_of: dict[bytes, bytes | None] = {}
LOOKAHEAD_CACHE = 4096


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _lock_key_of(app: Any, raw: bytes, accept: Any) -> bytes | None:
    """The lock key the task of the broker envelope ``raw`` takes, if it takes one in
    requeue mode and could be parked at delivery (task protocol 2, a task id, no ``eta``
    or ``expires``); else None."""
    try:
        envelope = kombu_json.loads(raw)  # type: ignore[no-untyped-call]
        headers = envelope["headers"]
        task = app.tasks.get(headers.get("task"))
        if (
            not isinstance(task, LockedTask)
            or headers.get("eta")
            or headers.get("expires")
            or task.lock_options().on_contention != "requeue"
        ):
            return None
    except Exception:  # not a message this look-ahead understands: leave it in its turn
        return None
    return envelope_lock_key(app, envelope, accept)


def envelope_lock_key(app: Any, envelope: Any, accept: Any = None) -> bytes | None:
    """The lock key the task of a broker envelope (as kombu decodes it) takes: its
    arguments decoded and its ``lock_key`` rendered; None if it is not a ``LockedTask``'s
    message (task protocol 2, with a task id) or cannot be decoded or rendered here."""
    try:
        headers, properties = envelope["headers"], envelope["properties"]
        task = app.tasks.get(headers.get("task"))
        if not isinstance(task, LockedTask) or not isinstance(headers.get("id"), str):
            return None
        body = envelope["body"]
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if headers.get("compression"):
            body = compression.decompress(body, headers["compression"])  # type: ignore[no-untyped-call]
        if accept is None:
            accept = serialization.prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
        args, kwargs, _embed = serialization.loads(  # type: ignore[no-untyped-call]
            body, envelope["content-type"], envelope["content-encoding"], accept=accept
        )
        return LockKeys.for_name(task.lock_name(args, kwargs), task.lock_options().prefix).lock
    except Exception:
        return None


def LockKeysFor(name: str, prefix: str) -> bytes:
    return LockKeys.for_name(name, prefix).lock


def _park_fallback(app: Any) -> bool:
    """Whether parked tasks also get a delayed fallback copy in the broker.

    Parked messages live in the lock Redis. If that is the broker's own Redis, they share
    its fate and the sweeper covers a dead releasing worker; a separate lock Redis could
    lose them alone (a restart without persistence), so a copy is kept in the broker.
    """
    settings = settings_for(app)
    if settings.park_fallback == "auto":
        return not settings.url_source.startswith("broker_url") and (
            settings.url != (getattr(app.conf, "broker_url", None) or app.conf.get("broker_url"))
        )
    return bool(settings.park_fallback)


def _dumps(value: Any) -> str:
    return str(kombu_json.dumps(value))  # type: ignore[no-untyped-call]


def _loads(text: str) -> dict[str, Any]:
    return dict(kombu_json.loads(text))  # type: ignore[no-untyped-call]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _kept_hold_marker(lock: AnyTaskLock, retry_owner: str) -> tuple[Any, bytes]:
    """Where a hold kept across ``self.retry()`` is marked for the retry's run (owner
    ``retry_owner``): a key beside the lock (on the first node of a quorum), deleted by
    the one delivery that adopts the hold."""
    client = lock.clients[0] if isinstance(lock, RedLock) else lock.client
    return client, lock.keys.lock + f":kept:{retry_owner}".encode()


def _mark_kept_hold(lock: AnyTaskLock, request: Any, hold: float) -> None:
    retry_owner = run_owner(request.id, (request.retries or 0) + 1, _nesting(request))
    client, key = _kept_hold_marker(lock, retry_owner)
    try:
        client.set(key, b"1", px=lease_ms(hold, "kept hold"))
    except redis.RedisError as exc:  # the retry then waits for the kept hold to run out
        log.warning("redislock: could not mark %r kept for the retry: %r", lock.name, exc)


def _claim_kept_hold(lock: AnyTaskLock, request: Any) -> str | None:
    """The owner of the run whose kept hold this retry adopts, if it was kept for it."""
    client, key = _kept_hold_marker(lock, lock.owner or "")
    try:
        claimed = bool(client.delete(key))
    except redis.RedisError as exc:
        log.warning("redislock: could not claim the hold kept for %r: %r", lock.name, exc)
        return None
    return run_owner(request.id, request.retries - 1, _nesting(request)) if claimed else None


def _nesting(request: Any) -> int:
    try:
        return int(getattr(request, "replaced_task_nesting", 0) or 0)
    except (TypeError, ValueError):
        return 0


def _visibility_timeout(app: Any) -> float:
    options = app.conf.get("broker_transport_options") or {}
    return float(options.get("visibility_timeout") or 3600.0)


def _finish_quietly(
    lock: AnyTaskLock,
    task: Any,
    options: LockOptions,
    *,
    hold: float | None = None,
    done: bool = True,
    lookahead: Callable[[], _Pull | None] | None = None,
) -> None:
    """Release (handing over to a parked task) and publish the hand-over; never raises
    LockNotOwnedError (the caller reports a lost lease itself). Stats are flushed after
    the release, off the next task's critical path."""
    keep = options.hold if hold is None else hold
    done_ttl = options.done_ttl if done else None
    try:
        task.publish_handed_over(lock.finish(hold=keep, done_ttl=done_ttl, lookahead=lookahead))
        if lock.pulled is not None:
            signals.task_pulled.send(task, name=lock.name, task_id=lock.pulled)
            log.info(
                "redislock: %s[%s] handed %r to the next queued task %s (look-ahead)",
                task.name,
                task.request.id,
                lock.name,
                lock.pulled,
            )
    except LockNotOwnedError as exc:  # includes LockLostError: reported by the caller
        task.publish_handed_over(getattr(exc, "handed_to", None))
        log.warning(
            "redislock: %s[%s] could not release %r: %s", task.name, task.request.id, lock.name, exc
        )
    except UNREACHABLE as exc:
        # Redis did not answer: the run's outcome stands (a body that succeeded is not
        # failed for it). The hold stops renewing now, so its lease ends it at the latest,
        # and the release (with its done marker and hand-over) is retried in the background.
        _finish_later(lock, task, keep, done_ttl, exc, options)
    finally:
        try:
            stats_client = lock.clients[0] if isinstance(lock, RedLock) else lock.client
            metrics.flush_to_redis(stats_client, options.prefix)
        except Exception:  # stats are best effort; the lock is not
            log.debug("redislock: could not flush stats", exc_info=True)


def _finish_later(
    lock: AnyTaskLock,
    task: Any,
    keep: float,
    done_ttl: float | None,
    exc: BaseException,
    options: LockOptions,
) -> None:
    """A task's release that could not reach Redis: stop renewing, retry in the background."""
    owner = lock._current_owner()
    held = lock._holds.get(owner)
    token = None if held is None else held.token
    if held is None:
        lock.close()
        what = f"lock {lock.name!r} (owner {owner})"
        signals.lock_release_failed.send(lock, name=lock.name, owner=owner, error=exc)
    else:
        what = lock._unconfirmed(held, exc)

    def again() -> None:
        try:
            message = lock.finish(hold=keep, done_ttl=done_ttl, token=token)
        except LockNotOwnedError as lost:  # the lease ran out meanwhile: nothing to give back
            message = getattr(lost, "handed_to", None)
        task.publish_handed_over(message)

    # The retry may outlive the lease: a late release still writes the done marker and hands
    # the lock to a parked task. It names its holding's token: another copy of the run that
    # took the lock after the lease ran out is a later holding of the same owner.
    until = time.monotonic() + max(60.0, options.ttl * 2)
    deferred_releases().add(what, again, until=until)


# ------------------------------------------------------------------ the worker's main process

_CHILD_DIED = (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit, KeyboardInterrupt)


class LockedRequest(Request):  # type: ignore[misc]
    """Runs in the worker's main process: releases for a task whose process died."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            self._release_for_task("hard time limit")

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        try:
            return super().on_failure(
                exc_info, send_failed_event=send_failed_event, return_ok=return_ok
            )
        finally:
            exc = getattr(exc_info.exception, "exc", exc_info.exception)
            if isinstance(exc, _CHILD_DIED):
                self._release_for_task(type(exc).__name__)

    def _announce_revoked(self, reason: Any, terminated: Any, signum: Any, expired: Any) -> None:
        super()._announce_revoked(reason, terminated, signum, expired)
        if not terminated:  # dropped before it ran: give back a lock handed to it
            self._release_for_task("revoked" if not expired else "expired", "unstarted")

    def _release_for_task(self, why: str, mode: str = "all") -> None:
        """Release every hold of this task id (``mode="unstarted"``: only a lock handed
        to it that it never took up), handing over to the next parked task."""
        task = self.task
        if not isinstance(task, LockedTask):
            return
        try:
            options = task.lock_options()
            name = task.lock_name(self.args, self.kwargs)
            owner = request_owner(self.request_dict or {"id": self.id})
            lock = task_lock(task.app, name, task_id=owner, options=options)
            if isinstance(lock, QuorumTaskLock):
                if mode != "all":
                    return  # no hand-over on a quorum: nothing is handed to an unstarted task
                code = lock.release_all()
            else:
                done_ttl = options.done_ttl if mode == "unstarted" else None
                keys, args = lock.handoff_args(owner, mode, done_ttl)
                reply = scripts_for(lock.client).handoff(keys=keys, args=args)
                code = int(reply[0])
                task.publish_handed_over(lock.handed(reply))
        except Exception as exc:  # the lease still expires by itself
            log.warning(
                "redislock: could not release for %s[%s] (%s): %r", task.name, self.id, why, exc
            )
            return
        if int(code) == 0:
            log.warning(
                "redislock: released %r %s %s[%s]: %s (%s)",
                name,
                "held by" if mode == "all" else "handed to",
                task.name,
                self.id,
                "its worker process died" if mode == "all" else "it was dropped before it ran",
                why,
            )


def _check_settings_at_worker_start(sender: Any = None, **_: Any) -> None:
    """Fail the worker at start, not mid-task, when its app's redislock settings are bad."""
    app = getattr(sender, "app", None)
    if app is None or not any(isinstance(t, LockedTask) for t in app.tasks.values()):
        return
    metrics.enable()
    try:
        settings = settings_for(app)
    except LockConfigurationError as exc:
        # Celery logs and swallows Exceptions from signal receivers; SystemExit stops the
        # worker here, before it takes a single task.
        log.critical("celery_redislock: %s", exc)
        raise SystemExit(f"celery_redislock: {exc}") from exc
    if settings.signing_key_source != "redislock_signing_key" and not _has_password(app):
        log.warning(
            "redislock: redislock_signing_key is not set and the broker URL carries no "
            "password: parked messages are signed with a key derived from that URL, which "
            "anyone who knows it can derive. Set redislock_signing_key to a secret, the same "
            "on every worker (docs/security.md)"
        )
    if settings.urls:
        nodes = ", ".join(url.split("@")[-1] for url in settings.urls)
        log.info("redislock: quorum locks over %d masters: %s", len(settings.urls), nodes)
    else:
        where = settings.url.split("@")[-1]
        log.info("redislock: locks in %s (from %s)", where, settings.url_source)


def _has_password(app: Any) -> bool:
    urls = app.conf.broker_url
    urls = urls if isinstance(urls, (list, tuple)) else str(urls or "").split(";")
    try:
        return bool(urls) and all(urllib.parse.urlsplit(str(url)).password for url in urls)
    except ValueError:
        return False


celery_signals.worker_init.connect(_check_settings_at_worker_start, weak=False)


# ------------------------------------------------------------------ the sweeper


class Sweeper(threading.Thread):
    """The worker main process's safety net for parked tasks.

    Every few seconds, for each lock with parked tasks: if its holder vanished without
    releasing (lease expired), hand the lock to the next parked task; if a handed-over
    task's message never started it (the releasing worker died before publishing), publish
    it again. Several workers sweeping at once is safe: each step is one atomic script.
    """

    def __init__(self, app: Any) -> None:
        super().__init__(name="redislock-sweeper", daemon=True)
        self.app = app
        self.stopping = threading.Event()
        settings = settings_for(app)
        self.ttl = settings.defaults.ttl
        self.interval = max(0.5, min(self.ttl / 6, 5.0))
        self.prefixes = sorted(
            {t.lock_options().prefix for t in app.tasks.values() if isinstance(t, LockedTask)}
        )

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.sweep_once()
            except Exception:
                log.exception("redislock: sweeping parked tasks failed; retrying")

    def sweep_once(self) -> int:
        """One pass; returns how many messages it published."""
        client = client_for(self.app)
        scripts = scripts_for(client)
        published = 0
        for prefix in self.prefixes:
            registry = prefix + "parked"
            members: list[bytes] = list(client.zrange(registry, 0, -1))  # type: ignore[arg-type]
            for lock_key in members:
                name = name_from_lock_key(lock_key, prefix)
                if name is None or LockKeys.for_name(name, prefix).lock != lock_key:
                    # Anyone who may write the registry may have written it: no lock's keys.
                    client.zrem(registry, lock_key)
                    _report_refused(self.app, lock_key, None, "not a lock key of this prefix")
                    continue
                try:
                    published += self._sweep_lock(client, scripts, registry, lock_key)
                except Exception:  # one bad lock does not stop the pass
                    log.exception("redislock: sweeping %r failed; retrying next pass", lock_key)
        return published

    def _sweep_lock(self, client: Any, scripts: Any, registry: str, lock_key: bytes) -> int:
        keys = [
            lock_key,
            lock_key + b":released",
            lock_key + b":fence",
            lock_key + b":parked",
            lock_key + b":parked:messages",
            lock_key + b":parked:unused",
            lock_key + b":parked:dispatched",
            registry,
        ]
        stale = lease_ms(max(self.ttl / 2, MIN_SECONDS), "stale")
        args = [lease_ms(self.ttl, "redislock_ttl"), stale, QUEUE_REACH]
        reply = scripts.sweep(keys=keys, args=args)
        handed = _handed(lock_key, reply) if int(reply[0]) == 1 else None
        if handed is None:
            return 0
        log.warning(
            "redislock: sweeper hands %r to parked task %r (holder or hand-over lost)",
            lock_key,
            _text(handed.task_id),
        )
        return deliver_handed_over(self.app, handed, args[0])


_sweepers: weakref.WeakKeyDictionary[Any, Sweeper] = weakref.WeakKeyDictionary()


#: First character of a parked broker envelope (a parked signature's is signing.SIGNED).
ENVELOPE = "E"
#: Start of the delivery-tag placeholder of a parked envelope, and so of the delivery tag
#: of every envelope a hand-over (or the sweeper) pushed back.
TAG_PREFIX = "rltag"


def envelope_entry(queue_list: str, envelope: dict[str, Any], lock_key: bytes, key: bytes) -> str:
    """A parked broker envelope: ``E<queue list>\\n<tag placeholder>\\n<envelope JSON>``.

    The envelope is the broker's own message (Redis transport), with a placeholder for
    its delivery tag, signed with ``key`` for ``lock_key`` and ``queue_list``
    (:func:`signing.sign_envelope`): whoever hands the lock over pushes it back to the head
    of ``queue_list`` with a new tag (``handoff.lua``, or the worker).
    ``envelope["headers"]`` and ``envelope["properties"]`` must be the caller's own copies.
    """
    placeholder = TAG_PREFIX + secrets.token_hex(8)  # letters and digits, unique
    envelope["properties"]["delivery_tag"] = placeholder
    signing.sign_envelope(key, envelope, lock_key, queue_list)
    return f"{ENVELOPE}{queue_list}\n{placeholder}\n{_dumps(envelope)}"


def push_targets(app: Any) -> tuple[str, str]:
    """Where a hand-over script may push a parked envelope itself (handoff.lua's ARGV[10]
    and ARGV[11]): the first-read lists of the queues this worker consumes (as
    :class:`parking.Parker` names them) and this app's ``LockedTask`` names, one a line.
    An envelope for another list or task comes back to the worker, which checks it."""
    queues = app.amqp.queues
    names = sorted(queues.consume_from or queues)
    tasks = app.tasks
    marker = (tuple(names), len(tasks))
    found = _push_targets.get(app)
    if found is None or found[0] != marker:
        options = app.conf.broker_transport_options or {}
        prefix = str(options.get("global_keyprefix") or "")
        first = (options.get("priority_steps") or [0])[0]
        after = f"{_PRIORITY_SEP}{first}" if first else ""  # kombu's _q_for_pri
        lists = "\n".join(prefix + name + after for name in names if "\n" not in name)
        locked = sorted(n for n, t in tasks.items() if isinstance(t, LockedTask) and "\n" not in n)
        found = _push_targets[app] = (marker, (lists, "\n".join(locked)))
    return found[1]


_push_targets: weakref.WeakKeyDictionary[Any, tuple[Any, tuple[str, str]]]
_push_targets = weakref.WeakKeyDictionary()
#: kombu's Redis transport: between a queue's name and its priority step in a list's name.
_PRIORITY_SEP = "\x06\x16"
#: Refused parked messages one delivery gets past at most (each refusal hands the lock on
#: to the next parked task, whose message is checked in turn); the sweeper does the rest.
MAX_REFUSALS = 100


def deliver_handed_over(app: Any, handed: _Handed | None, lease: int) -> int:
    """Check the message of the parked task a lock was handed to, then send it: 1 if sent.

    Everything in it was read back from Redis, where anyone who may write the lock keys
    may have written it. It is sent only if a worker holding this app's signing key parked
    it, for this task id, under this lock, and (when the task is registered here) if its
    task is a ``LockedTask`` whose arguments take that lock. A parked signature is then
    published to ``<its queue>.redislock``, an envelope pushed to the read end of its queue
    list. Anything else is refused: not sent, reported (:func:`refuse_handed_over`), and its
    parked record removed, the lock handed on to the next parked task (``lease`` ms), whose
    message is checked in turn. Redis and publishing errors propagate.
    """
    for _ in range(MAX_REFUSALS):
        if handed is None:
            return 0
        try:
            send = _checked(app, handed)
        except signing.Refused as exc:
            handed = refuse_handed_over(app, handed.lock_key, handed.task_id, str(exc), lease)
            continue
        send()
        return 1
    if handed is not None:
        log.warning(
            "redislock: refused %d parked messages in a row under %r; the sweeper goes on",
            MAX_REFUSALS,
            _text(handed.lock_key),
        )
    return 0


def _checked(app: Any, handed: _Handed) -> Callable[[], Any]:
    """How to send a handed-over task's message, once it is checked; raises Refused."""
    key = settings_for(app).signing_key
    message = handed.message
    try:
        if message[:1] == signing.SIGNED.encode():
            signature = signing.open_signature(key, handed.lock_key, handed.task_id, message)
            options = signature.get("options") or {}
            run = run_owner(
                str(options.get("task_id")),
                options.get("retries"),
                options.get("replaced_task_nesting"),
            )
            if run != handed.task_id.decode():
                raise signing.Refused("its run is not the one it was parked as")
            _check_parked_under(app, signature.get("task"), handed.lock_key, signature)
            return functools.partial(publish_to_handoff_queue, app, signature)
        if message[:1] == ENVELOPE.encode():
            queue_list, pushed = _checked_envelope(app, key, handed)
            return functools.partial(client_for(app).rpush, queue_list, pushed)
    except signing.Refused:
        raise
    except Exception as exc:  # undecodable: no worker parked it
        raise signing.Refused(f"not a parked message ({type(exc).__name__}: {exc})") from None
    raise signing.Refused("not a signed parked message")


def _checked_envelope(app: Any, key: bytes, handed: _Handed) -> tuple[bytes, bytes]:
    head, placeholder, text = handed.message[1:].split(b"\n", 2)
    envelope = kombu_json.loads(text)  # type: ignore[no-untyped-call]
    if not isinstance(envelope, dict):
        raise signing.Refused("not a broker envelope")
    lock, queue_list = signing.check_envelope(key, envelope)
    if lock.encode() != handed.lock_key:
        raise signing.Refused(f"it was signed for another lock ({lock!r})")
    if queue_list.encode() != head:
        raise signing.Refused(f"it was signed for another queue list ({queue_list!r})")
    if request_owner(envelope["headers"]) != handed.task_id.decode():
        raise signing.Refused("its run is not the one it was parked as")
    tag = envelope["properties"].get("delivery_tag")
    once = text.count(placeholder) == 1  # where the tag goes, exactly
    if tag != placeholder.decode() or not tag.startswith(TAG_PREFIX) or not once:
        raise signing.Refused("its delivery tag is not its placeholder")
    _check_parked_under(app, envelope["headers"].get("task"), handed.lock_key, envelope)
    return head, text.replace(placeholder, placeholder + b"h" + handed.tag, 1)


def _check_parked_under(app: Any, name: Any, lock_key: bytes, message: dict[str, Any]) -> None:
    """Refuse a message whose task is known here and is not a ``LockedTask`` whose
    arguments take ``lock_key`` (a task not registered in this worker is vouched for by
    its signature alone)."""
    task = app.tasks.get(name) if isinstance(name, str) else None
    if task is None:
        return
    if not isinstance(task, LockedTask):
        raise signing.Refused(f"{name!r} is not a LockedTask")
    if "headers" in message:  # a broker envelope
        rendered = envelope_lock_key(app, message)
    else:  # a signature
        lock_name = task.lock_name(message.get("args"), message.get("kwargs"))
        rendered = LockKeys.for_name(lock_name, task.lock_options().prefix).lock
    if rendered != lock_key:
        raise signing.Refused("its arguments do not take the lock it was parked under")


def refuse_handed_over(
    app: Any, lock_key: bytes, task_id: bytes, reason: str, lease: int
) -> _Handed | None:
    """Report a parked message that must not be sent, and take its hand-over back: the
    lock goes to the next parked task (returned, to be checked and sent in turn), and the
    refused task's parked records are removed, so the sweeper never sends it again."""
    _report_refused(app, lock_key, task_id, reason)
    client = client_for(app)
    keys = [
        lock_key,
        lock_key + b":released",
        lock_key + b":fence",
        lock_key + b":parked",
        lock_key + b":parked:messages",
        lock_key + b":done:" + task_id,
        lock_key + b":parked:dispatched",
        lock_key + b":waiters",
        lock_key + b":claims",
    ]
    args = [task_id, "unstarted", lease, 0, "", "", "", "", "", *push_targets(app)]
    return _handed(lock_key, scripts_for(client).handoff(keys=keys, args=args))


def _report_refused(app: Any, key: bytes, task_id: bytes | None, reason: str) -> None:
    shown_key, shown_id = _text(key), None if task_id is None else _text(task_id)
    log.error(
        "redislock: refused the parked message of task %r under %r: %s. It is not sent or "
        "run. Whoever may write the lock keys wrote it without the workers' signing key, or "
        "a worker with another redislock_signing_key parked it (docs/security.md)",
        shown_id,
        shown_key,
        reason,
    )
    signals.parked_rejected.send(app, key=shown_key, task_id=shown_id, reason=reason)
    try:  # now: the worker's main process (the sweeper, a fetch) flushes no other way
        metrics.flush_to_redis(client_for(app), settings_for(app).defaults.prefix, force=True)
    except Exception:  # stats are best effort
        log.debug("redislock: could not flush stats", exc_info=True)


def _handed(lock_key: bytes, reply: list[Any]) -> _Handed | None:
    """The parked task a hand-over or sweep script's ``reply`` says to check and send."""
    if len(reply) < 3 or reply[1] is None:
        return None
    tag = reply[3] if len(reply) > 3 else b""
    return _Handed(lock_key, _bytes(reply[2]), _bytes(reply[1]), _tag(tag))


def _tag(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def publish_to_handoff_queue(app: Any, message: dict[str, Any]) -> None:
    """Publish a parked task's signature to ``<its queue>.redislock``."""
    signature = app.signature(message)
    options = dict(signature.options)
    # A re-built request carries its queue, or (sent through a named exchange) its routing
    # key, which for Celery's direct exchanges is the queue's name.
    routing_key = options.pop("routing_key", None)
    options.pop("exchange", None)
    queue = options.pop("queue", None) or routing_key or app.conf.task_default_queue
    signature.options = options
    signature.apply_async(queue=handoff_queue(queue))


def handoff_queue(queue: str) -> str:
    """The queue a task handed its lock is published to: ``<queue>.redislock``."""
    return queue if queue.endswith(".redislock") else f"{queue}.redislock"


def _consume_handoff_queues(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Every worker also consumes ``<q>.redislock`` for each queue ``q`` it consumes."""
    app = getattr(instance, "app", None)
    if app is None or not any(isinstance(t, LockedTask) for t in app.tasks.values()):
        return
    queues = app.amqp.queues
    for name in list(queues.consume_from or queues):
        if not name.endswith(".redislock"):
            queues.select_add(handoff_queue(name))


def _start_sweeper(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not any(isinstance(t, LockedTask) for t in app.tasks.values()):
        return
    if app not in _sweepers:
        sweeper = _sweepers[app] = Sweeper(app)
        sweeper.start()


def _stop_sweeper(sender: Any = None, **_: Any) -> None:
    for sweeper in list(_sweepers.values()):
        sweeper.stopping.set()


def _flush_stats_at_exit(**_: Any) -> None:
    for app, (pid, client) in list(_clients.items()):
        if pid == os.getpid():
            try:
                metrics.flush_to_redis(client, settings_for(app).defaults.prefix, force=True)
            except Exception:
                log.debug("redislock: could not flush stats at exit", exc_info=True)


celery_signals.worker_process_shutdown.connect(_flush_stats_at_exit, weak=False)
celery_signals.worker_shutdown.connect(_flush_stats_at_exit, weak=False)
celery_signals.celeryd_after_setup.connect(_consume_handoff_queues, weak=False)
celery_signals.worker_ready.connect(_start_sweeper, weak=False)
celery_signals.worker_shutdown.connect(_stop_sweeper, weak=False)
