"""Running on: a worker process that releases a lock with tasks parked on it runs the next
one itself (``redislock_run_on`` / ``lock_run_on`` seconds at most), instead of handing it
over through the broker.

A hand-over through the broker costs the releasing slot's acknowledgement, the next
fetch by the worker's main process and the dispatch to a pool process: a few
milliseconds per task of a hot key, on every broker. Run on, it costs the release
script and this process's start of the next trace. The task runs as the pool process
would run it from its message (Celery's own tracer: its signals, result, retries and
logs), after the releasing task's outcome is stored and its ``task_postrun`` receivers
have run (this module's receiver connects last, in each pool process).

It is taken only where it keeps the rules of a delivery (docs/concepts.md, "Running
on"): a mutex's (not a permit's or a quorum lock's) release in a worker's pool process,
the releasing and the next task without time limits (the main process enforces those per
message: a next task run on would count against the releasing one's), a worker that
sends no task events (the main process sends those), a parked message (a broker envelope,
or a signature where the broker is elsewhere) of a ``LockedTask`` registered here that
runs on too, for a queue this worker consumes, with no ``eta`` and no ``expires``, within
the releasing run's budget. Anything else is handed over through the broker as before.

No task is lost if the process dies while it runs on: the hand-over script keeps the
next task's parked record, marked run-on, until that run's own release; once its hold
is gone without that release (its lease ran out), the workers' sweeper puts it back at
the head of the parked line (after a grace that lets a release retried in the background
land first: ``parked.lua``'s ``resend_stale``).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from celery import signals as celery_signals
from celery.worker import control

from .. import _process, signals
from .._core import LockKeys, lease_ms
from .._renewal import scheduler_for
from .._replies import AcquireReply
from .._scripts import run, scripts_for
from ..settings import LockOptions
from . import revokes, terminate
from . import tasklock as _tasklock
from .clients import client_for
from .envelope import _Handed, _text, envelope_body, push_targets
from .lookahead import LOOKAHEAD_HEADER
from .tasklock import TaskLock

log = logging.getLogger(__name__)


class _Next(NamedTuple):
    """A parked task this process runs on with: its message as a pool process gets it."""

    handed: _Handed  # the hand-over: its lock, the task's run, its message, its token
    name: str
    request: dict[str, Any]
    body: Any  # bytes as received; or (args, kwargs, embed), decoded (content_type "")
    content_type: str
    content_encoding: str
    send: Callable[[], Any]  # hands it over through the broker instead (nothing ran)
    sent_at: float  # when the release that handed it over was sent
    lease: int  # ms: the lease the release wrote the hold with

    @property
    def task_id(self) -> str:
        return _text(self.handed.task_id)


#: A message as a pool process gets it: task name, request, body, content type, encoding.
_Message = tuple[str, dict[str, Any], Any, str, str]


class _State(threading.local):
    """Per pool thread (a prefork process has one): the chain this process runs on."""

    def __init__(self) -> None:
        self.started: float | None = None  # when the chain's first release ran on
        self.budget = 0.0  # seconds it may run on from then
        self.running = False  # the loop of task_postrun runs the next one
        self.next: list[_Next] = []
        self.taking: _Next | None = None  # the one whose trace runs now, until it takes it


_state = _State()
#: Whether the worker sends task events (``-E``/``--task-events`` or
#: ``worker_send_task_events``: its main process sends them per message, so tasks run on
#: would be missing from them) or has time limits of its own (``--time-limit``,
#: ``--soft-time-limit``: its main process enforces them per message, so a chain would
#: count against the releasing task's); running on is off then.
_events_on = False
#: What remote control turned on at run time, which a pool process does not see by itself:
#: bit ``REMOTE_EVENTS`` task events (``celery control enable_events``, as Flower does),
#: until ``disable_events``; bit ``REMOTE_LIMITS`` a time limit (``celery control
#: time_limit``), ``REMOTE_STAMPS`` a revoke by stamped headers (``celery control
#: revoke_by_stamped_headers``: revoked ids are :mod:`.revokes`'), ``REMOTE_RATES`` a rate
#: limit (``celery control rate_limit``: the main process applies it per message) and
#: ``REMOTE_QUEUES`` a queue no longer consumed (``celery control cancel_consumer``: a
#: pool process's queues are those of its fork), each for the rest of the worker's life.
#: Running on is off while any is set.
#: Shared memory, made by the worker's main process before it forks its pool
#: (:func:`_follow_remote_control`); None elsewhere.
_remote: Any = None
REMOTE_EVENTS, REMOTE_LIMITS, REMOTE_STAMPS, REMOTE_RATES, REMOTE_QUEUES = 1, 2, 4, 8, 16
#: The commands that set a bit for good (their reply "ok"), and how they are logged.
_FOR_GOOD = {
    "time_limit": (REMOTE_LIMITS, "a time limit set"),
    "revoke_by_stamped_headers": (REMOTE_STAMPS, "a revoke by stamped headers"),
    "rate_limit": (REMOTE_RATES, "a rate limit set"),
    "cancel_consumer": (REMOTE_QUEUES, "a queue cancelled"),
}


def allowed(task: Any, lock: Any, options: LockOptions) -> bool:
    """Whether the release of ``task``'s run (holding ``lock``) may hand a parked task to
    this process itself."""
    if options.run_on <= 0 or _events_on or not isinstance(lock, TaskLock) or lock.min_replicas:
        return False
    if _remote is not None and _remote.value:
        return False  # task events, a time limit, ... set by remote control (_remote)
    if not revokes.followed():  # (a spawned pool process: it could run nothing on)
        return False
    if options.on_contention != "requeue" or options.latest or options.rate is not None:
        return False
    request = task.request
    limits = getattr(request, "timelimit", None)
    if request.is_eager or request.called_directly or not _no_time_limits(task, limits):
        return False
    if getattr(task.app.conf, "worker_send_task_events", False):
        return False
    state = _state
    if state.started is None:
        return True
    return time.monotonic() - state.started < state.budget


def running_on() -> bool:
    """Whether this process runs a chain on now (the trace running is a task run on)."""
    return _state.running


def tag(task: Any, request: Any = None) -> str:
    """This worker process's run-on tag, ``<node name>:<pid>``: its run-on records name it,
    so that its worker's main process finds them when it dies (``LockedRequest``).
    ``request``: the task's current request, if the caller has it at hand."""
    return _tag((task.request if request is None else request).hostname, _process.current())


def dead_tag(request: Any) -> str | None:
    """In the worker's main process, the tag of the pool process that ran the job
    ``request`` (``worker_pid``), as :func:`tag` gave it there; None if none is known."""
    pid = getattr(request, "worker_pid", None)
    return _tag(request.hostname, pid) if pid else None


def _tag(hostname: Any, pid: Any) -> str:
    return f"{hostname}:{pid}"


def dead(request: Any, lock: Any) -> Any:
    """In the worker's main process, for a pool process that died (``worker_pid``) while
    its job ``request`` held ``lock``: park again, first in line, the tasks it ran on
    (handoff.lua "dead"); returns the hand-over to send, if the lock was theirs (and the
    release script did not push it back itself)."""
    process = dead_tag(request)
    if process is None or not isinstance(lock, TaskLock):
        return None
    reply = lock.handoff(process, "dead", None)
    if reply.code != -2:  # the lock was a run-on task's of that process: handed on
        log.warning(
            "redislock: pool process %s died while it ran on under %r; its task parked again, "
            "first in line",
            process,
            lock.name,
        )
    return lock.handed(reply)


def _no_time_limits(task: Any, limits: Any) -> bool:
    """Whether neither ``limits`` (a message's ``timelimit``: [hard, soft]; anything else
    but None counts as a limit) nor the task nor the app sets a time limit."""
    if not isinstance(limits, (list, tuple)):
        limits = () if limits is None else (limits,)
    conf = task.app.conf
    found = (*limits, task.time_limit, task.soft_time_limit)
    found += (conf.task_time_limit, conf.task_soft_time_limit)
    return all(limit is None for limit in found)


def take(
    app: Any,
    handed: _Handed,
    queue_list: bytes,
    envelope: dict[str, Any],
    send: Callable[[], Any],
    options: LockOptions,
    hostname: str | None,
    sent_at: float,
) -> bool:
    """Keep a checked parked message to run on with after the current task, if it may run
    here (see the module docstring). False: its hand-over is made a usual one (``unrun``),
    and the caller hands it over through the broker (``send``)."""
    lease = lease_ms(options.ttl, "lock_ttl")
    try:
        found = _next_of(app, handed, queue_list, envelope, hostname, options)
    except Exception:  # undecodable here: the broker's worker decides
        log.debug("redislock: cannot run on with %r", _text(handed.task_id), exc_info=True)
        found = None
    if found is not None and revokes.maybe_revoked(str(found[1].get("id"))):
        found = None  # revoked while parked, maybe: the main process decides (the broker's)
    if found is None:
        unrun(app, handed, lease)
        return False
    state = _state
    if state.started is None:
        state.started, state.budget = time.monotonic(), options.run_on
    state.next.append(_Next(handed, *found, send, sent_at, lease))
    return True


def _next_of(
    app: Any,
    handed: _Handed,
    queue_list: bytes,
    envelope: dict[str, Any],
    hostname: str | None,
    options: LockOptions,
) -> _Message | None:
    """The message as a pool process gets it, if it may run here (else None)."""
    if not queue_list:
        return _next_of_signature(app, handed, envelope, hostname, options)
    if queue_list.decode() not in push_targets(app)[0].split("\n"):
        return None  # a queue this worker does not consume
    headers, properties = dict(envelope["headers"]), dict(envelope["properties"])
    name = headers.get("task")
    limits = headers.get("timelimit")
    task = _runnable(app, name, headers.get("expires"), headers.get("eta"), limits, options)
    if task is None:
        return None
    body = envelope_body(envelope)
    info = properties.get("delivery_info") or {}
    # As celery.worker.request.Request builds it from the message.
    headers.update(
        {
            "properties": properties,
            "reply_to": properties.get("reply_to"),
            "correlation_id": properties.get("correlation_id"),
            "hostname": hostname,
            "delivery_info": {
                "exchange": info.get("exchange"),
                "routing_key": info.get("routing_key"),
                "priority": properties.get("priority"),
                "redelivered": False,
            },
            LOOKAHEAD_HEADER: queue_list.decode(),
        }
    )
    body = body if isinstance(body, bytes) else str(body).encode()
    return str(name), headers, body, envelope["content-type"], envelope["content-encoding"]


def _next_of_signature(
    app: Any,
    handed: _Handed,
    signature: dict[str, Any],
    hostname: str | None,
    lock_options: LockOptions,
) -> _Message | None:
    """A parked signature (the broker elsewhere) as the message Celery would publish for
    it (``app.amqp.as_task_v2``, as ``send_task`` builds it), decoded already."""
    options = dict(signature.get("options") or {})
    name = signature.get("task")
    queue = options.get("queue") or options.get("routing_key") or app.conf.task_default_queue
    queues = app.amqp.queues
    if queue not in (queues.consume_from or queues):
        return None  # a queue this worker does not consume
    if options.get("countdown"):
        return None
    limits = (options.get("time_limit"), options.get("soft_time_limit"))
    task = _runnable(app, name, options.get("expires"), options.get("eta"), limits, lock_options)
    if task is None:
        return None
    stamped = options.get("stamped_headers") or []
    headers, properties, body, _sent = app.amqp.as_task_v2(
        options.get("task_id"),
        name,
        signature.get("args") or (),
        signature.get("kwargs") or {},
        group_id=options.get("group_id"),
        group_index=options.get("group_index"),
        retries=options.get("retries") or 0,
        chord=options.get("chord"),
        callbacks=options.get("link"),
        errbacks=options.get("link_error"),
        reply_to=options.get("reply_to"),
        root_id=options.get("root_id"),
        parent_id=options.get("parent_id"),
        shadow=options.get("shadow"),
        chain=options.get("chain"),
        origin=options.get("origin"),
        ignore_result=options.get("ignore_result"),
        replaced_task_nesting=options.get("replaced_task_nesting") or 0,
        stamped_headers=stamped or None,
        **{header: options.get(header) for header in stamped},
    )
    headers.update(options.get("headers") or {})  # as send_task_message merges them
    headers.update(
        {
            "properties": {**properties, "priority": options.get("priority")},
            "reply_to": properties.get("reply_to"),
            "correlation_id": properties.get("correlation_id"),
            "hostname": hostname,
            "delivery_info": {
                "exchange": options.get("exchange") or "",
                "routing_key": queue,
                "priority": options.get("priority"),
                "redelivered": False,
            },
        }
    )
    return str(name), headers, body, "", ""


def _runnable(
    app: Any, name: Any, expires: Any, eta: Any, limits: Any, options: LockOptions
) -> Any:
    """The task a parked message names, if this process may run it on: a ``LockedTask``
    registered here that runs on itself (``lock_run_on``) in requeue mode with neither a
    rate (``lock_rate``, Celery's ``rate_limit``) nor a limit nor last-call-wins, that gives
    its lock back at its end (no ``lock_hold``, ``lock_release_on_retry``), without
    ``expires``, ``eta`` or time limits, whose lease is the releasing task's (the hold was
    written with it)."""
    from .base import LockedTask  # (base imports this module)

    task = app.tasks.get(name) if isinstance(name, str) else None
    if not isinstance(task, LockedTask) or expires is not None or eta is not None:
        return None
    own = task.lock_options()
    if own.run_on <= 0 or own.ttl != options.ttl or not _no_time_limits(task, limits):
        return None
    if own.on_contention != "requeue" or own.latest or own.rate is not None or own.limited:
        return None
    # Its end must give the lock back (a kept hold would keep its run-on record), and
    # Celery's own rate_limit is the main process's, per message.
    if own.hold > 0 or not own.release_on_retry or task.rate_limit:
        return None
    return task


def unrun(app: Any, handed: _Handed, lease: int) -> None:
    """Make a run-on hand-over (the hold written taken, count 1) a usual one (count 0),
    for the task's own acquire to take up once its message is delivered (handoff.lua
    "unrun"). If Redis does not answer, the hold's lease runs out and the sweeper hands
    the task on (``resend_stale``)."""
    keys = LockKeys.for_lock(handed.lock_key).handoff_keys(handed.task_id)
    args = [handed.task_id, "unrun", lease, 0, "", "", "", "", "", "", "", handed.tag]
    try:
        client = client_for(app)
        run(client, scripts_for(client).handoff, keys, args)
    except Exception:
        log.warning(
            "redislock: could not give back the run-on hand-over of %r",
            _text(handed.task_id),
            exc_info=True,
        )


def took_handed(lock: Any, owner: str) -> bool:
    """Record the hold a run-on hand-over wrote for ``owner``'s run (count 1, its token),
    without a round trip, when the trace now running is that run's (``TaskLock.take``)."""
    found = _state.taking
    if found is None or found.handed.lock_key != lock.keys.lock or found.task_id != owner:
        return False
    _state.taking = None
    if time.monotonic() - found.sent_at >= found.lease / 1000 * TRUSTED_SHARE:
        # The hold may be gone (its lease ran out while the releasing task's task_postrun
        # receivers, or this one's task_prerun receivers, ran; nothing renewed it), and
        # the lock another run's: confirmed first (renew.lua, owner- and token-checked).
        # If it is not this run's any more, the run's own acquire takes the lock or parks
        # as any run; its run-on record stays meanwhile (it is still run here, with no
        # broker message: a death of this process must still bring it back).
        confirmed_at = time.monotonic()
        if not _confirmed(lock, owner, found):
            return False
        found = found._replace(sent_at=confirmed_at)
    reply = AcquireReply(True, token=int(found.handed.tag), hold_count=1)
    hold = lock._held(owner, reply, found.sent_at, found.lease, True, None, None)
    if hold is not None:
        scheduler_for(lock.client).add(hold)
    return True


def _confirmed(lock: Any, owner: str, found: _Next) -> bool:
    """Whether the hold the run-on hand-over wrote is still ``owner``'s, with its token;
    its lease renewed if so."""
    keys, args = [lock.keys.lock], [owner, found.lease, found.handed.tag]
    try:
        return list(run(lock.client, lock._scripts.renew, keys, args)) == [1]
    except Exception:  # not confirmed: the run's own acquire decides
        log.debug("redislock: could not confirm the run-on hand-over of %r", owner, exc_info=True)
        return False


#: The share of its lease a run-on hand-over is recorded without a round trip within
#: (from its release): the watchdog's first renewal of the hold is not due before then.
TRUSTED_SHARE = 1 / 3


def _run_next(sender: Any = None, task: Any = None, **_: Any) -> None:
    """``task_postrun``: after a run whose release kept a parked task to run on with, run
    it (and the ones its own release keeps, in this loop: the chain does not nest)."""
    state = _state
    if state.running or not state.next:
        return
    state.running = True
    app = task.app if task is not None else None
    try:
        while state.next:
            _run(app, state.next.pop(0))
    finally:
        left, state.next = state.next, []
        state.running = False
        state.started = None
        state.taking = None
        for found in left:  # (a run on ended by SystemExit and the like): through the broker
            _send(app, found)


def _send(app: Any, found: _Next) -> None:
    try:
        if app is not None:
            unrun(app, found.handed, found.lease)
        found.send()
    except Exception:  # its parked record stays: the sweeper sends it
        log.exception("redislock: could not hand %s[%s] over", found.name, found.task_id)


def _run(app: Any, found: _Next) -> None:
    from celery.app import trace

    if app is None:
        _send(None, found)
        return
    log.info(
        "redislock: runs on with %s[%s] (parked, handed to this process)", found.name, found.task_id
    )
    if signals.task_handed_over.receivers:
        signals.task_handed_over.send(
            app,
            name=found.name,
            task_id=found.task_id,
            via="run_on",
            queue=found.request["delivery_info"]["routing_key"] or "",
        )
    args = (
        found.name,
        str(found.request.get("id") or found.task_id),  # (task_id: the run's lock owner)
        dict(found.request),
        found.body,
        found.content_type,
        found.content_encoding,
    )
    _state.taking = found  # its acquire records the hold the release wrote (took_handed)
    try:
        with terminate.running_on(args[1]):  # (revoke(terminate=True) finds it there)
            if app.use_fast_trace_task:
                trace.fast_trace_task(*args)
            else:
                trace.trace_task_ret(*args, app=app)
    except Exception:  # (Reject and the like: its parked record stays; the sweeper goes on)
        log.exception(
            "redislock: %s[%s], run on, ended outside its body", found.name, found.task_id
        )
    if _state.taking is found:  # its run never took it up (it ended before): hand it over
        _state.taking = None
        _send(app, found)


def _connect_last(**_: Any) -> None:
    """Connect the runner after every ``task_postrun`` receiver the app's modules
    connected at import: the releasing task's receivers all run before the next task."""
    celery_signals.task_postrun.disconnect(_run_next, dispatch_uid=_UID)
    celery_signals.task_postrun.connect(_run_next, weak=False, dispatch_uid=_UID)


def _note_events(sender: Any = None, instance: Any = None, options: Any = None, **_: Any) -> None:
    """``celeryd_init``: whether this worker sends task events (``-E``) or has time limits
    of its own (``--time-limit``, ``--soft-time-limit``)."""
    global _events_on
    found = options or {}
    _events_on = any(found.get(name) for name in ("task_events", "time_limit", "soft_time_limit"))


def _follow_remote_control(**_: Any) -> None:
    """``worker_init`` (the main process, before the pool is forked): make the shared
    :data:`_remote`, and wrap Celery's ``enable_events`` and ``disable_events`` commands,
    and those of :data:`_FOR_GOOD` (their arguments as Celery declares them), to keep it
    up to date; once per process."""
    global _remote
    if _remote is None:
        _remote = multiprocessing.RawValue("i", 0)
    panel = control.Panel.data
    for name in ("enable_events", "disable_events", *_FOR_GOOD):
        celery_s = panel.get(name)
        if celery_s is not None and not getattr(celery_s, "redislock", False):
            panel[name] = _followed(name, celery_s)


def _followed(name: str, celery_s: Callable[..., Any]) -> Callable[..., Any]:
    def command(state: Any, *args: Any, **kwargs: Any) -> Any:
        reply = celery_s(state, *args, **kwargs)
        before = _remote.value
        if name in _FOR_GOOD:  # (Celery's reply says whether it took it)
            taken = isinstance(reply, dict) and "ok" in reply
            _remote.value = before | _FOR_GOOD[name][0] if taken else before
        else:  # Celery's dispatcher sends a task event if it is on and its groups allow it
            dispatcher = getattr(state.consumer, "event_dispatcher", None)
            groups = getattr(dispatcher, "groups", None)
            on = bool(getattr(dispatcher, "enabled", False)) and (not groups or "task" in groups)
            _remote.value = before | REMOTE_EVENTS if on else before & ~REMOTE_EVENTS
        if bool(_remote.value) != bool(before):
            log.info(
                "redislock: running on is %s in this worker (%s by remote control)",
                "off" if _remote.value else "on again",
                _FOR_GOOD[name][1] if name in _FOR_GOOD else f"task events: {name}",
            )
        return reply

    command.__doc__ = celery_s.__doc__
    command.__name__ = getattr(celery_s, "__name__", name)
    command.redislock = True  # type: ignore[attr-defined]
    return command


_UID = "celery_redislock.run_on"
celery_signals.task_postrun.connect(_run_next, weak=False, dispatch_uid=_UID)
celery_signals.worker_process_init.connect(_connect_last, weak=False)
celery_signals.worker_init.connect(_connect_last, weak=False)
celery_signals.celeryd_init.connect(_note_events, weak=False)
celery_signals.worker_init.connect(_follow_remote_control, weak=False)
celery_signals.worker_init.connect(revokes.follow, weak=False)
celery_signals.worker_init.connect(terminate.follow, weak=False)
_tasklock._took_handed = took_handed  # (TaskLock.take: tasklock cannot import this module)
