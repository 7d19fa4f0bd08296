"""The end of a task's run: its release (:func:`_finish_quietly`, retried in the
background when Redis does not answer: :func:`_finish_later`), and the marker of a hold
kept across ``self.retry()`` for the retry's run to adopt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from .. import metrics, signals
from .._core import lease_ms
from .._deferred import UNREACHABLE, deferred_releases
from .._errors import LockNotOwnedError
from ..redlock import RedLock
from ..settings import LockOptions
from . import runon
from .tasklock import AnyTaskLock, TaskLock, run_owner

if TYPE_CHECKING:
    from .lookahead import _Pull

log = logging.getLogger(__name__)


def _kept_hold_marker(lock: AnyTaskLock, retry_owner: str) -> tuple[Any, bytes]:
    """Where a hold kept across ``self.retry()`` is marked for the retry's run (owner
    ``retry_owner``): a key beside the lock (on the first node of a quorum), deleted by
    the one delivery that adopts the hold."""
    client = lock.clients[0] if isinstance(lock, RedLock) else lock.client
    return client, lock.keys.kept(retry_owner)


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
    run_on = keep <= 0 and done and runon.allowed(task, lock, options)
    sent_at = time.monotonic()
    try:
        if isinstance(lock, TaskLock):
            lock.run_on = runon.tag(task) if run_on else ""
        handed = lock.finish(hold=keep, done_ttl=done_ttl, lookahead=lookahead)
        task.publish_handed_over(handed, run_on=run_on, sent_at=sent_at)
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
        task.publish_handed_over(getattr(exc, "handed_to", None), run_on=run_on, sent_at=sent_at)
        log.warning(
            "redislock: %s[%s] could not release %r: %s", task.name, task.request.id, lock.name, exc
        )
    except redis.ResponseError as exc:
        # The release script failed (hostile data under the prefix): the hold no longer
        # renews (TaskLock.finish), so its lease ends it; the run's outcome stands.
        log.error(
            "redislock: %s[%s] could not release %r: %s; its lease ends it",
            task.name,
            task.request.id,
            lock.name,
            exc,
        )
        signals.lock_release_failed.send(lock, name=lock.name, owner=lock.owner, error=exc)
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

    if isinstance(lock, TaskLock):
        lock.run_on = ""  # a late release hands over through the broker

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
