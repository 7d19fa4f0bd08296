"""The Celery layer: every module of celery_redislock that imports Celery or kombu.

One module per job:

* ``base`` — :class:`LockedTask`, the task base: a call run under its lock in a worker,
  look-ahead started, the release at its end.
* ``options`` — a task's lock options, read from its class and checked when it is
  decorated; its key templates built.
* ``direct`` — calls made outside the worker (directly, eagerly, nested in a running
  body): they wait for the lock and never re-queue.
* ``contention`` — what a run does when its lock is held (``on_contention``): wait,
  park behind the holder from the pool process, re-queue, skip, fail.
* ``finish`` — a run's release (retried in the background when Redis does not answer)
  and the hold kept across ``self.retry()``.
* ``tasklock`` — the lock of one run (``TaskLock``, ``QuorumTaskLock``, ``task_lock``)
  and the run that owns it (``run_owner``, ``request_owner``).
* ``clients`` — per-app state: the app's settings and Redis clients, per process.
* ``envelope`` — the parked messages' formats, and the lock key a kombu message takes.
* ``lookahead`` — the search of a queue list for the next task of a lock.
* ``handover`` — checking and sending the task a lock was handed to.
* ``parking`` — parking at delivery, in the worker's main process (``LockedTask.Strategy``).
* ``sweeper`` — the thread serving parked tasks whose holder or hand-over was lost.
* ``worker`` — ``LockedRequest`` (releases for a task whose process died), the settings
  check at worker start, and the worker signal handlers.
* ``signing`` — the MACs of parked messages.
* ``cli`` — ``celery -A proj redislock``; ``cli_nodes`` the servers it asks (one, or a
  quorum), ``cli_print`` how ``show`` prints what they hold.
* ``ready`` — ``SKIPPED`` and ``SUPERSEDED`` made Celery ready states (``.get()`` returns).
* ``configured`` — the ``redislock_tasks`` setting: tasks locked by configuration, their
  classes made LockedTask subclasses of their own at finalization and worker start.

The old homes (``celery_redislock.task``, ``.parking``, ``.signing``, ``.cli``) re-export
these names. Importing any module here connects the worker signal handlers, once, and makes
``SKIPPED`` and ``SUPERSEDED`` ready states of Celery in this process (``ready``: Celery's
``states.READY_STATES``, ``Backend.READY_STATES`` and the ready states its result backends
captured as default arguments, extended).
"""

from __future__ import annotations

from . import worker as worker  # connects the worker signal handlers (at first import)
from .ready import install_ready_states

install_ready_states()  # SKIPPED and SUPERSEDED are ready states of Celery (ready.py)
