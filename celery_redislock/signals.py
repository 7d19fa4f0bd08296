"""Signals users can connect to, shaped like Celery's (``connect``, ``sender=`` filters).

::

    from celery_redislock import signals

    @signals.lock_lost.connect
    def page_someone(sender, name, owner, reason, **kwargs):
        ...

=====================  =======================================  ================================
signal                 sent when                                keyword arguments
=====================  =======================================  ================================
``lock_acquired``      a new hold is taken (not re-entries)     name, owner, token, waited
``lock_contended``     an acquire found the lock held           name, owner
``lock_released``      the last hold is given back              name, owner, held
``lock_lost``          a hold's lease is known lost             name, owner, reason
``lock_renewed``       the watchdog renewed a batch             count
``task_parked``        a LockedTask was parked behind a holder  name, task_id, limit (and
                                                                queue: parked at delivery)
``task_requeued``      a LockedTask was re-queued (countdown)   name, task_id, countdown, limit
``task_permit_taken``  a limited LockedTask's run (or direct    name, task_id, limit, waited
                       call) holds its permit
``task_permit_ended``  that run ended: its permit given back,   name, task_id, held
                       kept (``lock_hold``, a retry) or lost
``task_pulled``        a release moved the next queued task     name, task_id (the one moved)
                       of its lock ahead, handing it the lock
``lock_release_failed``  a release could not reach Redis: the  name, owner, error
                       hold stopped renewing (its lease ends
                       it); retried in the background
``task_rate_admitted`` a rate-limited LockedTask was admitted  name, task_id, delay (0.0)
                       by its rate at once (``lock_rate``)
``task_deferred``      a rate-limited LockedTask was deferred   name, task_id
                       to its slot
``task_undeferred``    a drainer sent a deferred task, its      name (the task's), task_id,
                       slot due                                 delay (seconds deferred)
``task_superseded``    a LockedTask call ended without running: name, task_id (the call that
                       a newer call of its key took its place   ended), superseded_by (the
                       (``on_contention="replace"``,            newer call's task id, or None
                       ``lock_debounce``)                       when a run already started
                                                                was newer), queue (the
                                                                recording delivery's)
``task_debounced``     a debounced LockedTask call became its   name, task_id, due (seconds
                       key's pending call, waiting for quiet    from now)
``task_handed_over``   a parked run's message was sent on,     name (the task's), task_id,
                       handed its lock or permit                via (release, sweeper,
                                                                worker, cli), queue; or,
                                                                pushed back by a release's
                                                                script: name "", owner (the
                                                                releasing run's)
``task_skipped``       a LockedTask run did not run: its key    name, task_id, limit
                       was held (``on_contention="skip"``)
``task_duplicate``     a delivery of a run that had already     name, task_id
                       finished was ignored
``lock_renewal_failed``  a renewal of a hold failed; retried   key (its hash), owner, error,
                                                                failures
                       until its lease's deadline (then
                       ``lock_lost``, reason unreachable)
``parked_rejected``    a worker refused a parked message read   key, task_id, reason
                       back from Redis (its signature does not
                       verify): it is not sent or run
=====================  =======================================  ================================

``sender`` is the lock object (the task for ``task_*``, the Celery app for
``parked_rejected`` and ``task_handed_over``, the watchdog for ``lock_renewed`` and
``lock_renewal_failed``). ``limit`` is the run's
``lock_limit`` (None for the mutex); ``waited`` is the time since the run's first
attempt at its permit (over deferrals: wall clocks). Receivers run synchronously in
the thread that sent the signal — for ``lock_lost`` and ``lock_renewed`` that is the
watchdog — so keep them short.
Exceptions in receivers are logged and never reach the lock. This module does not
import Celery.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

Receiver = Callable[..., Any]


class Signal:
    """A minimal synchronous signal: ``connect`` (also as a decorator), ``disconnect``, ``send``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._receivers: list[tuple[Receiver, object]] = []
        self._mutex = threading.Lock()

    def __repr__(self) -> str:
        return f"<Signal {self.name}>"

    @property
    def receivers(self) -> bool:
        """Whether anyone listens (senders skip building arguments when not)."""
        return bool(self._receivers)

    def connect(self, receiver: Receiver | None = None, *, sender: object = None) -> Any:
        """Connect ``receiver(sender, **kwargs)``; only for ``sender`` when given."""

        def add(func: Receiver) -> Receiver:
            if not callable(func):
                raise TypeError(f"signal receiver must be callable, got {func!r}")
            with self._mutex:
                if (func, sender) not in self._receivers:
                    self._receivers = [*self._receivers, (func, sender)]
            return func

        return add if receiver is None else add(receiver)

    def disconnect(self, receiver: Receiver, *, sender: object = None) -> None:
        with self._mutex:
            self._receivers = [r for r in self._receivers if r != (receiver, sender)]

    def send(self, sender: object, **kwargs: Any) -> None:
        for receiver, only in self._receivers:
            if only is not None and only is not sender:
                continue
            try:
                receiver(sender=sender, signal=self, **kwargs)
            except Exception:
                log.exception("redislock: receiver %r of %s failed", receiver, self.name)


lock_acquired = Signal("lock_acquired")
lock_contended = Signal("lock_contended")
lock_released = Signal("lock_released")
lock_lost = Signal("lock_lost")
lock_renewed = Signal("lock_renewed")
task_parked = Signal("task_parked")
task_requeued = Signal("task_requeued")
task_pulled = Signal("task_pulled")
task_permit_taken = Signal("task_permit_taken")
task_permit_ended = Signal("task_permit_ended")
lock_release_failed = Signal("lock_release_failed")
parked_rejected = Signal("parked_rejected")
task_rate_admitted = Signal("task_rate_admitted")
task_deferred = Signal("task_deferred")
task_undeferred = Signal("task_undeferred")
task_superseded = Signal("task_superseded")
task_debounced = Signal("task_debounced")
task_handed_over = Signal("task_handed_over")
task_skipped = Signal("task_skipped")
task_duplicate = Signal("task_duplicate")
lock_renewal_failed = Signal("lock_renewal_failed")

__all__ = [
    "Signal",
    "lock_acquired",
    "lock_contended",
    "lock_lost",
    "lock_release_failed",
    "lock_released",
    "lock_renewal_failed",
    "lock_renewed",
    "parked_rejected",
    "task_parked",
    "task_permit_ended",
    "task_permit_taken",
    "task_deferred",
    "task_duplicate",
    "task_handed_over",
    "task_pulled",
    "task_rate_admitted",
    "task_requeued",
    "task_skipped",
    "task_debounced",
    "task_superseded",
    "task_undeferred",
]
