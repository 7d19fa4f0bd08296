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
``"wait"``
    Block the worker slot up to ``lock_wait`` seconds, woken by the holder's release;
    then act as ``lock_wait_fallback`` (``"requeue"`` or ``"raise"``).
``"skip"``
    Do not run; record the task as ``SKIPPED`` (for deduplicating periodic jobs).
``"raise"``
    Fail with ``LockContendedError``.

Direct calls (``settle(7, 10)``) and eager mode (``task_always_eager``, ``.apply()``)
never re-queue (that would recurse): they wait up to ``lock_wait`` for the lock, then
raise ``LockContendedError`` (``"skip"`` returns None instead).

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

import functools
import logging
import os
import random
import weakref
from typing import Any, ClassVar

import redis
from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery import Task, signals
from celery.exceptions import Ignore, Retry
from celery.worker.request import Request

from ._core import OwnerFinished, backoff, lease_ms
from ._errors import LockConfigurationError, LockContendedError, LockLostError, LockNotOwnedError
from ._scripts import scripts_for
from .keys import KeyTemplate
from .lock import RedisLock
from .settings import LockOptions, LockSettings, task_overrides

log = logging.getLogger(__name__)

#: Message header counting re-queues (kept apart from Celery's ``retries``).
REQUEUE_HEADER = "redislock_requeues"
SKIPPED = "SKIPPED"


class TaskLock(RedisLock):
    """A :class:`RedisLock` owned by a task id, with the task's "done" marker beside it."""

    def __init__(self, client: Any, name: str, *, task_id: str, options: LockOptions) -> None:
        super().__init__(client, name, ttl=options.ttl, owner=task_id, prefix=options.prefix)
        self.done_key = self.keys.lock + b":done:" + task_id.encode()

    def _acquire_keys(self) -> list[bytes]:
        return [self.keys.lock, self.keys.fence, self.done_key]

    def finish(self, *, hold: float, done_ttl: float | None) -> None:
        """Give the hold back (or keep it ``hold`` seconds more, unrenewed).

        With ``done_ttl``, also mark the task id done so a later delivery of the same
        message does not run again.
        """
        owner = self._current_owner()
        mode, hold_ms = ("hold", lease_ms(hold, "lock_hold")) if hold > 0 else ("one", 0)
        keys = [self.keys.lock, self.keys.channel]
        args: list[Any] = [owner, mode, hold_ms]
        if done_ttl is not None:
            keys.append(self.done_key)
            args.append(lease_ms(done_ttl, "lock_done_ttl"))
        code = int(self._scripts.release(keys=keys, args=args))
        self._record_released(owner, code)


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


# ------------------------------------------------------------------ the task base


class LockedTask(Task):  # type: ignore[misc]
    """Task base that runs each call under a Redis lock keyed on its arguments.

    Options (task attributes; ``None`` means the app's ``redislock_*`` setting):
    ``lock_key`` (template, callable or None for one lock per task), ``lock_key_hash``,
    ``lock_ttl``, ``lock_prefix``, ``on_contention``, ``lock_wait``,
    ``lock_wait_fallback``, ``lock_max_requeues``, ``lock_requeue_backoff``,
    ``lock_requeue_exhausted``, ``lock_release_on_retry``, ``lock_done_ttl``,
    ``lock_hold``. See the module docstring for what each does.
    """

    abstract = True
    Request = "celery_redislock.task:LockedRequest"

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
    def lock(self) -> TaskLock | None:
        """The lock of the current execution (``bind=True`` tasks: ``self.lock``); None outside."""
        return getattr(self.request, "redislock", None)

    def lock_options(self) -> LockOptions:
        return settings_for(self.app).defaults.merged(self._lock_overrides)

    def lock_name(self, args: Any, kwargs: Any) -> str:
        """The lock name this call would take (the rendered ``lock_key``)."""
        return self._lock_template.render(tuple(args or ()), dict(kwargs or {}))

    # -- execution -------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager:
            return self._call_locally(args, kwargs)
        return self._call_in_worker(args, kwargs)

    def _call_in_worker(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        options = self.lock_options()
        name = self.lock_name(args, kwargs)  # a bad value fails the task here: nothing taken
        lock = TaskLock(client_for(self.app), name, task_id=request.id, options=options)
        try:
            outcome = lock._try(request.id, lock._lease, True)
        except OwnerFinished:
            log.info(
                "redislock: %s[%s] already finished under %r; duplicate delivery ignored",
                self.name,
                request.id,
                name,
            )
            raise Ignore() from None
        if outcome is True and lock.hold_count > 1:
            # Our own task id already held it.
            lock.release()
            if not (request.retries and not options.release_on_retry):
                # Another delivery of this very task is running (or just died).
                lock.close()
                return self._contended(request, args, kwargs, options, name, duplicate=True)
            # else: the hold our previous attempt kept across self.retry(): adopt it.
        if outcome is not True:
            if options.on_contention == "wait" and lock.acquire(timeout=options.wait):
                outcome = True
            else:
                return self._contended(request, args, kwargs, options, name, duplicate=False)
        request.redislock = lock
        return self._run_holding(lock, options, args, kwargs)

    def _run_holding(
        self, lock: TaskLock, options: LockOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            result = super().__call__(*args, **kwargs)
        except Retry as retry:
            if options.release_on_retry:
                _release_quietly(lock, self, "retry")
            else:
                self._keep_for_retry(lock, retry, options)
            raise
        except BaseException:
            _finish_quietly(lock, self, options)
            raise
        lost = lock.lost
        _finish_quietly(lock, self, options)
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

    def _keep_for_retry(self, lock: TaskLock, retry: Retry, options: LockOptions) -> None:
        """Keep the hold for the retried run: an unrenewed lease covering the retry delay."""
        delay = retry.when if isinstance(retry.when, (int, float)) else options.ttl
        try:
            lock.finish(hold=max(0.0, float(delay)) + options.ttl, done_ttl=None)
        except LockNotOwnedError as exc:
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
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: LockOptions,
        name: str,
        *,
        duplicate: bool,
    ) -> Any:
        policy = options.on_contention
        if (
            duplicate
            or policy == "requeue"
            or (policy == "wait" and options.wait_fallback == "requeue")
        ):
            return self._requeue(request, args, kwargs, options, name, duplicate=duplicate)
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

    def _requeue(
        self,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: LockOptions,
        name: str,
        *,
        duplicate: bool,
    ) -> Any:
        headers = dict(request.headers or {})
        done = int(headers.get(REQUEUE_HEADER) or getattr(request, REQUEUE_HEADER, 0) or 0)
        if done >= options.max_requeues:
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
        base, cap = options.requeue_backoff
        cap = min(cap, _visibility_timeout(self.app) / 4)
        # A duplicate delivery waits the full cap: the copy holding the lock is still working.
        countdown = cap if duplicate else backoff(done, base=base, cap=max(cap, base), rng=_rng)
        headers[REQUEUE_HEADER] = done + 1
        signature = self.signature_from_request(
            request, args, kwargs, countdown=countdown, headers=headers
        )
        signature.apply_async()
        log.info(
            "redislock: %s[%s] re-queued in %.3fs (%d): %r is held%s",
            self.name,
            request.id,
            countdown,
            done + 1,
            name,
            " by another delivery of this task" if duplicate else "",
        )
        raise Ignore()

    def _call_locally(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        options = self.lock_options()
        name = self.lock_name(args, kwargs)
        request_id = self.request.id
        lock = RedisLock(
            client_for(self.app),
            name,
            ttl=options.ttl,
            owner=request_id or None,
            prefix=options.prefix,
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
            return super().__call__(*args, **kwargs)
        finally:
            self.request.redislock = previous
            lock.release()


_rng = random.Random()


def _visibility_timeout(app: Any) -> float:
    options = app.conf.get("broker_transport_options") or {}
    return float(options.get("visibility_timeout") or 3600.0)


def _finish_quietly(lock: TaskLock, task: Any, options: LockOptions) -> None:
    try:
        lock.finish(hold=options.hold, done_ttl=options.done_ttl)
    except LockNotOwnedError as exc:  # includes LockLostError: reported by the caller
        log.warning(
            "redislock: %s[%s] could not release %r: %s", task.name, task.request.id, lock.name, exc
        )


def _release_quietly(lock: RedisLock, task: Any, why: str) -> None:
    try:
        lock.release()
    except LockNotOwnedError as exc:
        log.warning(
            "redislock: %s[%s] (%s) could not release %r: %s",
            task.name,
            task.request.id,
            why,
            lock.name,
            exc,
        )


# ------------------------------------------------------------------ the worker's main process

_CHILD_DIED = (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit, KeyboardInterrupt)


class LockedRequest(Request):  # type: ignore[misc]
    """Runs in the worker's main process: releases for a task whose process died."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            self._release_for_dead_process("hard time limit")

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
                self._release_for_dead_process(type(exc).__name__)

    def _release_for_dead_process(self, why: str) -> None:
        task = self.task
        if not isinstance(task, LockedTask):
            return
        try:
            options = task.lock_options()
            name = task.lock_name(self.args, self.kwargs)
            lock = RedisLock(client_for(task.app), name, owner=self.id, prefix=options.prefix)
            code = scripts_for(lock.client).release(
                keys=[lock.keys.lock, lock.keys.channel], args=[self.id, "all"]
            )
        except Exception as exc:  # the lease still expires by itself
            log.warning(
                "redislock: could not release for %s[%s] (%s): %r", task.name, self.id, why, exc
            )
            return
        if int(code) == 0:
            log.warning(
                "redislock: released %r held by %s[%s]: its worker process died (%s)",
                name,
                task.name,
                self.id,
                why,
            )


def _check_settings_at_worker_start(sender: Any = None, **_: Any) -> None:
    """Fail the worker at start, not mid-task, when its app's redislock settings are bad."""
    app = getattr(sender, "app", None)
    if app is None or not any(isinstance(t, LockedTask) for t in app.tasks.values()):
        return
    settings = settings_for(app)
    log.info("redislock: locks in %s (from %s)", settings.url.split("@")[-1], settings.url_source)


signals.worker_init.connect(_check_settings_at_worker_start, weak=False)
