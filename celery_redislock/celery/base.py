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

    A contended message of a key that came again is parked instead, in the worker's
    main process, before a pool process gets it. Where the broker is the locks' own
    Redis, the holder's release hands the lock to it and puts it back at the head of its
    queue; a task handed its lock that way also searches its queue while it runs
    (``lock_lookahead`` messages, default 64) for the next task of its lock, which its
    release then hands the lock to and moves ahead, when nobody is parked. With any
    other broker (RabbitMQ, a Redis elsewhere) or fallback copies on, its signature is
    parked, with its fallback copy, and the release publishes it to ``<queue>.redislock``
    (docs/concepts.md, "Parking and hand-over").
``"wait"``
    Block the worker slot up to ``lock_wait`` seconds, woken by the holder's release;
    then act as ``lock_wait_fallback`` (``"requeue"`` or ``"raise"``).
``"skip"``
    Do not run; record the task as ``SKIPPED`` (for deduplicating periodic jobs).
``"replace"``
    Last call wins: one run and one pending call per key; a newer call takes the pending
    call's place, and the older ends as ``SUPERSEDED`` without running. With
    ``lock_debounce`` a call also waits for that many seconds of quiet first
    (``celery_redislock.celery.latest``).
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

The options are read and checked in :mod:`.options`; calls made outside the worker
(direct, eager, nested) run in :mod:`.direct`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from celery.exceptions import Ignore, Retry

from .._core import MAX_SECONDS, OwnerFinished, OwnerRunning, lease_ms
from .._deferred import UNREACHABLE
from .._errors import (
    LockConfigurationError,
    LockLostError,
    LockNotOwnedError,
    LockQuorumError,
)
from .._keyspace import run_key
from ..keys import KeyTemplate
from ..semaphore import validate_limit
from ..settings import APP_SETTING, LockOptions
from . import duplicates, runon, signing
from .clients import settings_for
from .contention import DEAD_LETTER_HEADERS, FIRST_TRY_HEADER, Contention, _Call, first_try
from .deferral import BOOKED_HEADER, admit_or_defer
from .direct import DirectCalls, _current_execution, _permit_counted
from .envelope import TAG_PREFIX, _Handed
from .finish import _claim_kept_hold, _finish_quietly, _mark_kept_hold
from .handover import deliver_handed_over
from .latest import LastCallWins
from .lookahead import (
    LOOKAHEAD_HEADER,
    _lookahead_denied,
    _lookahead_thread,
    _next_queued,
    _Pull,
    lookahead_chain,
)
from .options import configure
from .tasklock import PARKABLE, AnyTaskLock, TaskLock, TaskSemaphore, request_owner, task_lock

log = logging.getLogger(__name__)


class LockedTask(LastCallWins, Contention, DirectCalls):
    """Task base that runs each call under a Redis lock keyed on its arguments.

    Options (task attributes; ``None`` means the app's ``redislock_*`` setting):
    ``lock_key`` (template, callable or None for one lock per task), ``lock_key_hash``,
    ``lock_ttl``, ``lock_prefix``, ``on_contention``, ``lock_wait``,
    ``lock_wait_fallback``, ``lock_max_requeues``, ``lock_requeue_backoff``,
    ``lock_requeue_exhausted``, ``lock_release_on_retry``, ``lock_done_ttl``,
    ``lock_hold``, ``lock_lookahead``, ``lock_run_on``, ``lock_limit``, ``lock_rate``,
    ``lock_rate_key``, ``lock_debounce``, ``lock_debounce_max``. See the module docstring
    for what each does.
    """

    abstract = True
    Request = "celery_redislock.celery.worker:LockedRequest"
    Strategy = "celery_redislock.celery.parking:strategy"

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
    lock_run_on: ClassVar[float | None] = None
    #: ``APP_SETTING`` (the default): the app's ``redislock_limit``; None: no lock at all
    #: (a rate only: ``lock_rate`` must be set).
    lock_limit: ClassVar[Any] = APP_SETTING
    lock_rate: ClassVar[Any] = None
    lock_rate_key: ClassVar[Any] = None
    lock_debounce: ClassVar[float | None] = None
    lock_debounce_max: ClassVar[float | None] = None

    _lock_template: ClassVar[KeyTemplate]
    _rate_template: ClassVar[KeyTemplate]
    _lock_overrides: ClassVar[dict[str, Any]] = {}
    #: lock_options()'s last result: (the app's defaults, the overrides, merged).
    _merged_options: tuple[LockOptions, dict[str, Any], LockOptions] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Validate the lock options when the task is decorated, naming task and option."""
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is None:
            return  # an intermediate base class: checked when a task is made from it
        configure(cls, run, [attr for attr in dir(LockedTask) if attr.startswith("lock_")])

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
        """The app's defaults merged with this task's options: merged once per settings
        object and overrides (both read again on every call, so a new app settings object
        or a replaced ``_lock_overrides`` is seen at once; LockOptions is frozen)."""
        defaults = settings_for(self.app).defaults
        overrides = self._lock_overrides
        cached = self._merged_options
        if cached is not None and cached[0] is defaults and cached[1] is overrides:
            return cached[2]
        options = defaults.merged(overrides)
        self._merged_options = (defaults, overrides, options)
        return options

    def lock_name(self, args: Any, kwargs: Any) -> str:
        """The lock name this call would take (the rendered ``lock_key``)."""
        return self._lock_template.render(tuple(args or ()), dict(kwargs or {}))

    def rate_name(self, args: Any, kwargs: Any) -> str:
        """The rate key this call is counted under (the rendered ``lock_rate_key``)."""
        return self._rate_template.render(tuple(args or ()), dict(kwargs or {}))

    def lock_limit_for(
        self, args: Any, kwargs: Any, options: LockOptions | None = None
    ) -> int | None:
        """How many runs may hold this call's key at once: None for the mutex
        (``lock_limit=1``), else the limit (a callable's value for these arguments).

        Raises :class:`LockConfigurationError` naming the task when a callable fails or
        returns anything but an int from 1 to ``MAX_LIMIT``: nothing is taken then.
        """
        options = options or self.lock_options()
        if not options.limited:
            return None
        limit = options.limit
        if callable(limit):
            try:
                limit = limit(tuple(args or ()), dict(kwargs or {}))
            except Exception as exc:
                raise LockConfigurationError(
                    f"task {self.name!r}: lock_limit({args!r}, {kwargs!r}) raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        try:
            return validate_limit(limit)
        except LockConfigurationError as exc:
            raise LockConfigurationError(f"task {self.name!r}: lock_{exc}") from None

    def run_key(self, args: Any, kwargs: Any) -> bytes:
        """The key this call's run holds, is parked under, and is signed for: its lock's,
        or its semaphore's (``lock_limit``)."""
        options = self.lock_options()
        return run_key(self.lock_name(args, kwargs), options.prefix, limited=options.limited)

    def run_lock(
        self, args: Any, kwargs: Any, owner: str, options: LockOptions | None = None
    ) -> AnyTaskLock:
        """The lock (or permit) of the run ``owner`` of this call."""
        options = options or self.lock_options()
        name = self.lock_name(args, kwargs)  # a bad value fails here: nothing taken
        limit = self.lock_limit_for(args, kwargs, options)
        return task_lock(self.app, name, task_id=owner, options=options, limit=limit)

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
        if options.rate is not None:
            # Before any lock or permit: a run never holds one while it waits for the rate.
            admit_or_defer(self, request, args, kwargs, options)
        if not options.locked:
            return self._run_unlocked(args, kwargs)
        owner = request_owner(request)
        lock = self.run_lock(args, kwargs, owner, options)  # a bad value fails the task here
        if isinstance(lock, TaskLock):  # its hold names this process, for its worker's release
            lock.by = runon.tag(self, request)
        name = str(lock.name)  # (the rendered lock_key: a str)
        limit = lock.limit if isinstance(lock, TaskSemaphore) else None
        tried = _header(request, FIRST_TRY_HEADER) if limit is not None else None
        call = _Call(request, args, kwargs, options, name, limit, first_try(tried, time.time()))
        # A retry adopts the hold its previous run kept (lock_release_on_retry=False) only
        # once: the first delivery of the retry message claims the marker.
        kept = None
        try:
            if request.retries and not options.release_on_retry:
                kept = _claim_kept_hold(lock, request)
            # One atomic attempt: taken (or handed to this run), held by another owner,
            # held by this very run (another delivery of it: nothing is changed), or done.
            if options.latest and isinstance(lock, PARKABLE):
                self._take_latest(lock, call)  # returns holding it, else Ignore
            elif not lock.take(adopt=kept):
                lock._contended(owner)
                policy = options.on_contention
                if policy == "wait" and self._wait_for(lock, options):
                    pass
                elif policy == "requeue" and isinstance(lock, PARKABLE) and self._park(lock, call):
                    pass  # the lock came free meanwhile
                else:
                    return self._contended(call, duplicate=False)
        except OwnerFinished:
            duplicates.ignored(self, name, request.id)
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
        if limit is None:
            return self._run_holding(lock, options, args, kwargs)
        waited = max(0.0, time.time() - call.first_try)
        with _permit_counted(self, name, request.id, limit, waited):
            return self._run_holding(lock, options, args, kwargs)

    def _run_body(self, lock: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The task's body, with ``self.lock`` and nested calls seeing this execution."""
        owner = lock._current_owner()
        token = _current_execution.set((owner, self, lock))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _current_execution.reset(token)

    def _run_unlocked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A rate-only task's body (``lock_limit=None``): ``self.lock`` is None; a call
        nested in it runs under this run's owner."""
        token = _current_execution.set((request_owner(self.request), self, None))
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
        except (SystemExit, KeyboardInterrupt):
            # The process is being ended under the run (SIGTERM: revoke(terminate=True), a
            # pool or systemd stopping it), not the run ended: no done marker, so that its
            # redelivery (or, run on, its re-parking by the worker: runon.dead) runs it again.
            self._ended_under_run(lock, options, lookahead)
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

    def _ended_under_run(
        self, lock: AnyTaskLock, options: LockOptions, lookahead: Callable[[], _Pull | None] | None
    ) -> None:
        """The process ends under a run: a run-on task's hold and run-on record are left as
        they are (no broker message of it exists: the record is what brings it back, when
        the worker's main process or the sweeper finds its process dead); any other run's
        hold is given back without its done marker."""
        if runon.running_on():
            lock.close()  # not renewed: its lease ends it, if nobody parks it again first
            return
        _finish_quietly(lock, self, options, hold=0.0, done=False, lookahead=lookahead)

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
            or options.latest  # (a debounce): the next call is the pending one, not the queue's
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
        re-queue must not carry it to another delivery), a parked envelope's signature, or
        when a limited run first tried for its permit, or a drained task's booked rate slot
        (a retry is a run of its own: rate-checked again, its wait starting afresh; a
        re-queue or a parking of this run sets them again: ``Contention._sent_again``), nor
        RabbitMQ's dead-letter headers (a fallback copy back from its delay queue): Celery
        drops them from the headers it copies itself, not from headers passed in."""
        signature = super().signature_from_request(request, args, kwargs, queue, **extra_options)
        headers = signature.options.get("headers")
        dropped = (
            LOOKAHEAD_HEADER,
            signing.PARKED_HEADER,
            FIRST_TRY_HEADER,
            BOOKED_HEADER,
            *DEAD_LETTER_HEADERS,
        )
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

    def publish_handed_over(
        self, handed: _Handed | None, *, run_on: bool = False, sent_at: float = 0.0
    ) -> None:
        """Send the message of the parked task the lock was just handed to, if it verifies
        (:func:`deliver_handed_over`), or with ``run_on`` keep it for this process to run
        after this task (``runon``) when it may; never raises."""
        if handed is None:
            return
        try:
            options = self.lock_options()
            run_here = None
            if run_on:
                run_here = functools.partial(
                    runon.take,
                    self.app,
                    options=options,
                    hostname=self.request.hostname,
                    sent_at=sent_at,
                )
            lease = lease_ms(options.ttl, "lock_ttl")
            deliver_handed_over(self.app, handed, lease, run_here=run_here)
        except Exception:  # the sweeper (or its fallback copy) still runs it
            log.exception("redislock: could not publish the task the lock was handed to")
            if run_on:  # a run-on hand-over (count 1) nobody runs: a usual one, re-sent
                runon.unrun(self.app, handed, lease_ms(self.lock_options().ttl, "lock_ttl"))


def has_locked_tasks(app: Any) -> bool:
    """Whether ``app`` has a LockedTask (its workers check their settings at start, sweep,
    and consume the hand-over queues)."""
    return any(isinstance(task, LockedTask) for task in app.tasks.values())


def _header(request: Any, name: str) -> Any:
    """A custom header of the request's message (Celery gives them as attributes too)."""
    headers = getattr(request, "headers", None)
    found = headers.get(name) if isinstance(headers, dict) else None
    return found if found is not None else getattr(request, name, None)
