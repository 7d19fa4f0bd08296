"""The worker's main process: :class:`LockedRequest` (releases for a task whose process
died), the settings check at worker start, and the worker signal handlers (consume the
hand-off queues, start and stop the sweeper and the drainer, flush stats at exit),
connected once, when this module is imported.
"""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery import signals as celery_signals
from celery.worker.request import Request

from .. import metrics
from .._core import lease_ms
from .._errors import LockConfigurationError
from .._keyspace import HANDOFF_QUEUE_SUFFIX
from ..settings import check_latest
from . import handoff_channel, runon
from .base import LockedTask, has_locked_tasks
from .clients import _clients, client_for, settings_for
from .deferral import Drainer, _drainers
from .handover import deliver_handed_over, handoff_queue
from .sweeper import Sweeper, _sweepers
from .tasklock import QuorumTaskLock, request_owner

log = logging.getLogger(__name__)


_CHILD_DIED = (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit, KeyboardInterrupt)


class LockedRequest(Request):  # type: ignore[misc]
    """Runs in the worker's main process: releases for a task whose process died; holds a
    finished task's acknowledgement briefly for the hand-over of its lock
    (``handoff_channel.defer_ack``)."""

    def acknowledge(self) -> None:
        if self.acknowledged or not handoff_channel.expecting() or not self.task.acks_late:
            return super().acknowledge()  # type: ignore[no-any-return]
        try:
            key = self.task.run_key(self.args, self.kwargs)
        except Exception:
            key = None
        if key is None or not handoff_channel.defer_ack(key, super().acknowledge):
            super().acknowledge()

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
            if not options.locked:
                return  # a rate only: nothing is held
            owner = request_owner(self.request_dict or {"id": self.id})
            lock = task.run_lock(self.args, self.kwargs, owner, options)
            name = lock.name
            if isinstance(lock, QuorumTaskLock):
                if mode != "all":
                    return  # no hand-over on a quorum: nothing is handed to an unstarted task
                code = lock.release_all()
            else:
                done_ttl = options.done_ttl if mode == "unstarted" else None
                process = runon.dead_tag(self) if mode == "all" else None
                if process is not None:  # its holds only, not another copy's
                    lock.by = process
                reply = lock.handoff(owner, mode, done_ttl)
                code = reply.code
                _publish_for_dead_run(task, lock.handed(reply))
                if mode == "all":  # the tasks its process ran on, after it (lock_run_on)
                    _publish_for_dead_run(task, runon.dead(self, lock))
        except Exception as exc:  # the lease still expires by itself
            log.warning(
                "redislock: could not release for %s[%s] (%s): %r", task.name, self.id, why, exc
            )
            return
        if code == 0:
            log.warning(
                "redislock: released %r %s %s[%s]: %s (%s)",
                name,
                "held by" if mode == "all" else "handed to",
                task.name,
                self.id,
                "its worker process died" if mode == "all" else "it was dropped before it ran",
                why,
            )


def _publish_for_dead_run(task: LockedTask, handed: Any) -> None:
    """``task.publish_handed_over``, counted as handed on by the worker (``via``)."""
    if handed is None:
        return
    try:
        lease = lease_ms(task.lock_options().ttl, "lock_ttl")
        deliver_handed_over(task.app, handed, lease, via="worker")
    except Exception:  # the sweeper (or its fallback copy) still runs it
        log.exception("redislock: could not publish the task the lock was handed to")


def _track_run(sender: Any = None, task: Any = None, **_: Any) -> None:
    """A LockedTask run starts in this process: its lock signals count under its task
    and queue (:func:`metrics.track_run`; a dict write, nothing sent)."""
    if isinstance(task, LockedTask):
        request = task.request
        info = getattr(request, "delivery_info", None) or {}
        metrics.track_run(request_owner(request), task.name, info.get("routing_key"))


def _end_run(sender: Any = None, task: Any = None, **_: Any) -> None:
    if isinstance(task, LockedTask):
        metrics.end_run(request_owner(task.request))


celery_signals.task_prerun.connect(_track_run, weak=False)
celery_signals.task_postrun.connect(_end_run, weak=False)


def _check_settings_at_worker_start(sender: Any = None, **_: Any) -> None:
    """Fail the worker at start, not mid-task, when its app's redislock settings are bad."""
    app = getattr(sender, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    metrics.enable()
    try:
        settings = settings_for(app)
        limited = sorted(
            task.name
            for task in app.tasks.values()
            if isinstance(task, LockedTask) and task.lock_options().limited
        )
        rated = sorted(
            task.name
            for task in app.tasks.values()
            if isinstance(task, LockedTask) and task.lock_options().rate is not None
        )
        if settings.urls and rated:
            raise LockConfigurationError(
                f"lock_rate is not offered with redislock_urls (a rate limiter over a quorum "
                f"is not built), but {', '.join(map(repr, rated))} set it: use one Redis "
                f"(redislock_url) for rate-limited tasks"
            )
        latest = []
        for task in app.tasks.values():
            if isinstance(task, LockedTask):
                options = task.lock_options()
                check_latest(options, f"task {task.name!r}")
                if options.latest:
                    latest.append(task.name)
        if settings.urls and latest:
            raise LockConfigurationError(
                f"on_contention='replace' and lock_debounce are not offered with "
                f"redislock_urls (the pending call lives beside the lock on one Redis), but "
                f"{', '.join(map(repr, sorted(latest)))} set them: use one Redis "
                f"(redislock_url) for last-call-wins tasks"
            )
        if settings.urls and limited:
            raise LockConfigurationError(
                f"lock_limit is not offered with redislock_urls (a quorum semaphore is not "
                f"built yet), but {', '.join(map(repr, limited))} set it: use one Redis "
                f"(redislock_url) for limited tasks"
            )
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


def _consume_handoff_queues(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Every worker also consumes ``<q>.redislock`` for each queue ``q`` it consumes (from
    its start; remote control's ``add_consumer q`` adds it too: ``handoff_control``). A
    worker that consumes no queue (``-X`` of every one) consumes no hand-over queue."""
    app = getattr(instance, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    queues = app.amqp.queues
    for name in list(queues.consume_from):
        if not name.endswith(HANDOFF_QUEUE_SUFFIX):
            queues.select_add(handoff_queue(name))


def _start_sweeper(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not has_locked_tasks(app):
        return
    if app not in _sweepers:
        sweeper = _sweepers[app] = Sweeper(app)
        sweeper.start()


def _stop_sweeper(sender: Any = None, **_: Any) -> None:
    for sweeper in list(_sweepers.values()):
        sweeper.stopping.set()


def _start_drainer(sender: Any = None, **_: Any) -> None:
    """A drainer for every worker whose app has rate-limited tasks (``lock_rate``) or
    debounced ones (``lock_debounce``)."""
    app = getattr(sender, "app", None)
    if app is None or app in _drainers:
        return
    drainer = Drainer(app)
    if drainer.prefixes or drainer.debounce_prefixes:
        _drainers[app] = drainer
        drainer.start()


def _stop_drainer(sender: Any = None, **_: Any) -> None:
    for drainer in list(_drainers.values()):
        drainer.stopping.set()


def _flush_stats_at_exit(**_: Any) -> None:
    for app, client in _clients.items():  # this process's clients only
        try:
            metrics.flush_to_redis(client, settings_for(app).defaults.prefix, force=True)
        except Exception:
            log.debug("redislock: could not flush stats at exit", exc_info=True)


def _flush_stats_after_a_run(sender: Any = None, **_: Any) -> None:
    """After any run of a LockedTask (ignored ones too: a duplicate, a superseded call), its
    counts go to ``<prefix>stats`` when due, else within a second (metrics' flusher)."""
    if not isinstance(sender, LockedTask):
        return
    try:
        prefix = sender.lock_options().prefix
        metrics.flush_to_redis(client_for(sender.app), prefix)
    except Exception:  # stats are best effort
        log.debug("redislock: could not flush stats", exc_info=True)


def _keep_flushing(**_: Any) -> None:
    """Worker processes (the main one, and each pool process after its fork) add waiting
    counts to ``<prefix>stats`` within a second, though they go idle."""
    metrics.keep_flushing()


celery_signals.task_postrun.connect(_flush_stats_after_a_run, weak=False)
celery_signals.worker_init.connect(_keep_flushing, weak=False)
celery_signals.worker_process_init.connect(_keep_flushing, weak=False)
celery_signals.worker_process_shutdown.connect(_flush_stats_at_exit, weak=False)
celery_signals.worker_shutdown.connect(_flush_stats_at_exit, weak=False)
celery_signals.celeryd_init.connect(handoff_channel.add_step, weak=False)
celery_signals.celeryd_after_setup.connect(_consume_handoff_queues, weak=False)
celery_signals.worker_ready.connect(_start_sweeper, weak=False)
celery_signals.worker_shutdown.connect(_stop_sweeper, weak=False)
celery_signals.worker_ready.connect(_start_drainer, weak=False)
celery_signals.worker_shutdown.connect(_stop_drainer, weak=False)
