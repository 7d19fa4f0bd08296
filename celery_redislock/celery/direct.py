"""A ``LockedTask`` called outside the worker: directly (``settle(7, 10)``), eagerly
(``task_always_eager``, ``.apply()``), or nested in a running LockedTask's body (a call made
there is a plain function call under the caller's owner: ``_current_execution`` says
whose). Such a call waits up to ``lock_wait`` for its rate slot and its lock and never
re-queues (that would recurse): it raises :class:`~celery_redislock.LockContendedError`
instead, or returns None when ``on_contention="skip"`` finds the lock held.

Also here, because both paths use it: a limited call's permit as the metrics count it
(:func:`_permit_counted`).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any

from celery import Task

from .. import signals
from .._errors import LockContendedError
from ..lock import RedisLock
from ..ratelimit import RedisRateLimiter
from ..redlock import RedLock
from ..semaphore import RedisSemaphore
from ..settings import LockOptions
from .clients import client_for, quorum_clients_for, settings_for
from .deferral import rate_pairs
from .tasklock import task_lock


class DirectCalls(Task):  # type: ignore[misc]
    """``LockedTask``'s calls made outside the worker (a base class of it, not a task base
    of its own)."""

    def _call_locally(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], enclosing: str | None = None
    ) -> Any:
        """A direct or eager call: wait up to ``lock_wait`` (never re-queue). Its owner is
        ``enclosing`` (the owner of the LockedTask body this call is nested in), else the
        eager request's task id, else the calling thread."""
        options = self.lock_options()
        if options.rate is not None:
            self._admit_locally(args, kwargs, options)
        if not options.locked:
            return self._run_unlocked_locally(args, kwargs, enclosing)
        name = self.lock_name(args, kwargs)
        request_id = self.request.id
        owner = enclosing or request_id or None
        settings = settings_for(self.app)
        limit = self.lock_limit_for(args, kwargs, options)
        lock: RedisLock | RedLock | RedisSemaphore
        if limit is not None:
            if settings.urls:  # (task_lock's error, for a direct call)
                task_lock(self.app, name, task_id=owner or "", options=options, limit=limit)
            lock = RedisSemaphore(
                client_for(self.app),
                name,
                limit,
                ttl=options.ttl,
                owner=owner,
                prefix=options.prefix,
            )
        elif settings.urls:
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
        asked = time.monotonic()
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
        # A call nested in a running task's body is part of that run: counted with it.
        counted = limit is not None and enclosing is None
        with (
            _permit_counted(self, name, request_id, limit, time.monotonic() - asked)
            if counted
            else contextlib.nullcontext()
        ):
            try:
                return self._run_body(lock, args, kwargs)
            finally:
                self.request.redislock = previous
                lock.release()

    def _admit_locally(self, args: Any, kwargs: Any, options: LockOptions) -> None:
        """A direct or eager call of a rate-limited task waits up to ``lock_wait`` for its
        slot (never deferred), else raises :class:`LockContendedError`."""
        name = self.rate_name(args, kwargs)
        assert options.rate is not None
        limiter = RedisRateLimiter(
            client_for(self.app), name, rate_pairs(options.rate), prefix=options.prefix
        )
        wait = 0.0 if options.on_contention in ("skip", "raise") else options.wait
        if not limiter.acquire(timeout=wait):
            raise LockContendedError(
                f"{self.name} called directly/eagerly: rate key {name!r} is over its rate "
                f"(waited {wait}s; direct and eager calls are never deferred)",
                name=name,
                owner=self.request.id,
            )

    def _run_unlocked_locally(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], enclosing: str | None
    ) -> Any:
        owner = enclosing or self.request.id or f"direct:{id(self)}"
        token = _current_execution.set((owner, self, None))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _current_execution.reset(token)


@contextlib.contextmanager
def _permit_counted(
    task: Any, name: str, task_id: str | None, limit: int | None, waited: float
) -> Iterator[None]:
    """A limited run's hold of its permit, as the metrics see it: ``task_permit_taken``
    now, ``task_permit_ended`` when the block ends, however it ends (success, exception,
    retry, a lost lease; a killed process sends nothing, and its counts die with it)."""
    signals.task_permit_taken.send(task, name=name, task_id=task_id, limit=limit, waited=waited)
    since = time.monotonic()
    try:
        yield
    finally:
        held = time.monotonic() - since
        signals.task_permit_ended.send(task, name=name, task_id=task_id, held=held)


#: The LockedTask execution whose body runs in this context (thread, or asyncio task):
#: (its lock owner, the task, its lock). A LockedTask called inside it is a plain function
#: call under that owner (LockedTask.__call__).
_current_execution: contextvars.ContextVar[tuple[str, Any, Any] | None] = contextvars.ContextVar(
    "celery_redislock_task_execution", default=None
)
