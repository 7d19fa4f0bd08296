"""Last call wins: ``on_contention="replace"`` and ``lock_debounce``.

::

    @app.task(base=LockedTask, lock_key="user:{user_id}", on_contention="replace")
    def rebuild_index(user_id, version): ...

    @app.task(base=LockedTask, lock_key="doc:{doc_id}", lock_debounce=2.0,
              lock_debounce_max=30.0)
    def reindex(doc_id, revision): ...

Each key has at most one run going (``lock_limit`` runs) and one *pending* call. A call
that finds its key busy becomes the pending call; a newer call takes its place, and the
older one ends without running, as ``SUPERSEDED``. When the run ends, the pending call
(the newest) is handed the lock, as a parked task is. A call older than a run that has
already started is superseded too: a call never runs after a newer call of its key began.

With ``lock_debounce=d`` every call is first the pending call for ``d`` seconds from when
it was sent; a newer call restarts that quiet period (``lock_debounce_max`` bounds it,
counted from the oldest call superseded since the last run). When it is due, a drainer
(a thread of each worker's main process, :func:`serve_debounced`) sends its message, which
then takes the lock, or waits in the parked line as the key's pending call. No worker
slot waits during the quiet period.

**Newest** is decided by when a call was *published*: :func:`stamp_sent` (a
``before_task_publish`` receiver) writes :data:`SENT_HEADER` (µs since the epoch on the
publisher's clock) into every message that lacks one, so re-queues, parkings and retries of
a call keep its time. Ties are broken by task id. A message without the header (published
by a process that did not import this package) counts as sent when its worker received it;
a header later than the worker's clock is taken as the worker's time (a publisher's clock
that runs ahead cannot make its calls win for longer). Keep the publishers' clocks in sync
(NTP): calls sent closer together than their clocks' offset may be ordered by the offset.

Everything is decided in one script run per delivery (``latest.lua`` in ``park.lua`` /
``sem_park.lua``), atomically with the take or the parking. A superseded call is reported
in the result backend as :data:`SUPERSEDED` (meta ``{"lock": name, "superseded_by": id}``),
by the worker that superseded it, with :data:`~celery_redislock.signals.task_superseded`.
``SUPERSEDED`` is made one of Celery's ready states when this layer is imported
(:mod:`~celery_redislock.celery.ready`): ``AsyncResult.get()`` on it returns that meta at
once, ``ready()`` is True; read ``AsyncResult.state`` to tell it from a run's result.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Task, states
from celery import signals as celery_signals
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore

from .. import signals
from .._core import MAX_MS, lease_ms, server_clock_us
from .._errors import LockConfigurationError
from .._keyspace import debounce_registry, latest_run_key, parked_under
from .._replies import DUE_SEND, decode_latest_due
from .._scripts import scripts_for
from . import signing
from .contention import _Call
from .envelope import _Handed, _text
from .handover import _checked, _report_refused
from .tasklock import LatestCall, TaskLock, TaskSemaphore

log = logging.getLogger(__name__)

#: The result state of a call a newer call of its key took the place of.
SUPERSEDED = "SUPERSEDED"
#: Message header: when the call was published (µs since the epoch, publisher's clock).
SENT_HEADER = "redislock_sent"
#: How far ahead of now a debounced key is looked at again at the latest (a stale send).
MAX_SLEEP = 1.0
#: Keys one drainer pass serves at most.
MAX_PER_PASS = 1000


def stamp_sent(headers: Any = None, **_: Any) -> None:
    """``before_task_publish`` receiver: write :data:`SENT_HEADER` into a message that has
    none (a re-sent copy of a call keeps its own)."""
    if isinstance(headers, dict) and SENT_HEADER not in headers:
        headers[SENT_HEADER] = time.time_ns() // 1000


def sent_us(request: Any, now_us: int | None = None) -> int:
    """When the call of ``request`` was published (:data:`SENT_HEADER`), in µs: at most
    now (the worker's clock); now when the header is missing or not a whole number."""
    now = time.time_ns() // 1000 if now_us is None else now_us
    headers = getattr(request, "headers", None)
    value = headers.get(SENT_HEADER) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, SENT_HEADER, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return now
    return min(value, now)


def latest_call(task_id: str, sent: int, options: Any) -> LatestCall:
    """The script arguments of one call under ``options`` (:class:`LockOptions`)."""
    if options.debounce <= 0:
        return LatestCall(task_id, sent)
    quiet = lease_ms(options.debounce, "lock_debounce")
    bound = options.debounce_max
    bound = MAX_MS if bound is None else lease_ms(bound, "lock_debounce_max")
    return LatestCall(task_id, sent, quiet, bound)


class LastCallWins(Task):  # type: ignore[misc]
    """The last-call-wins step of :class:`~celery_redislock.celery.base.LockedTask` (a
    base class of it, not a task base of its own)."""

    def _take_latest(self, lock: TaskLock | TaskSemaphore, call: _Call) -> None:
        """Return once this call holds its lock (permit); else it is superseded, pending
        until due, or parked as its key's pending call: ``Ignore``. Raises OwnerFinished
        and OwnerRunning (another delivery of this run) as ``take`` does."""
        request, options, name = call.request, call.options, call.name
        signature = self._sent_again(call, dict(request.headers or {}))
        try:
            message = self._signed(lock, call, signature)
        except TypeError as exc:
            raise LockConfigurationError(
                f"task {self.name}[{request.id}]: on_contention='replace' and lock_debounce "
                f"keep the pending call's message in Redis as JSON, and these arguments are "
                f"not JSON-serialisable ({exc})"
            ) from None
        latest = latest_call(str(request.id), sent_us(request), options)
        reply = lock.park_latest(message, self._parking_lifetime(options), latest)
        ended = {
            _text(task_id): None if by is None else _text(by) for task_id, by in reply.unreported
        }
        if reply.evicted is not None:
            ended.setdefault(_text(reply.evicted), str(request.id))
        if reply.superseded:
            by = None if reply.superseded_by is None else _text(reply.superseded_by)
            ended.setdefault(str(request.id), by)
        if ended:
            self._record_superseded(lock, name, ended)
        if reply.park.acquired:
            return
        if reply.superseded:
            raise Ignore()
        fallback = self._fallback_delay(options)
        if reply.pending_ms is not None:
            due = reply.pending_ms / 1000
            signals.task_debounced.send(self, name=name, task_id=request.id, due=due)
            self._fallback_copy(call, signature, due + fallback)
            log.info(
                "redislock: %s[%s] is the pending call of %r, due in %.3fs",
                self.name,
                request.id,
                name,
                due,
            )
            raise Ignore()
        self._fallback_copy(call, signature, fallback)
        signals.task_parked.send(self, name=name, task_id=request.id, limit=call.limit)
        log.info(
            "redislock: %s[%s] is the pending call of %r, behind its run",
            self.name,
            request.id,
            name,
        )
        raise Ignore()

    def _record_superseded(
        self, lock: TaskLock | TaskSemaphore, name: str, ended: dict[str, str | None]
    ) -> None:
        """Record each call of ``ended`` (task id -> the newer call's, None: a run that had
        started) as ``SUPERSEDED`` (unless results are ignored), send
        :data:`~celery_redislock.signals.task_superseded`, and take what was recorded out
        of the key's ``x:`` fields (a call not recorded stays there for the next call of
        the key to record: this worker may die, or the backend fail, before it is)."""
        done = [task_id for task_id, by in ended.items() if self._superseded(task_id, name, by=by)]
        if done:
            try:
                lock.client.hdel(lock.keys.latest, *(f"x:{task_id}" for task_id in done))
            except Exception:  # recorded again by the key's next call: the same record
                log.debug("redislock: could not clear superseded records", exc_info=True)

    def _superseded(self, task_id: str, name: str, *, by: str | None) -> bool:
        """Record the call ``task_id`` as ``SUPERSEDED`` (unless results are ignored) and
        send :data:`~celery_redislock.signals.task_superseded`; False if the result
        backend could not store it. A call whose result already says how it ended is
        neither stored nor signalled again (:meth:`_ended`): True. Not stored with the RPC
        backend: it sends a state to the caller of the running task (this call's), under
        this call's id, where it would read as this call's own result."""
        if not self.ignore_result and not isinstance(self.backend, RPCBackend):
            try:
                if self._ended(task_id):
                    return True
                meta = {"lock": name, "superseded_by": by}
                self.backend.store_result(task_id, meta, SUPERSEDED)
            except Exception:  # the call still ends: its state is only a record
                log.warning(
                    "redislock: could not record %s[%s] as SUPERSEDED",
                    self.name,
                    task_id,
                    exc_info=True,
                )
                return False
        log.info(
            "redislock: %s[%s] superseded on %r by %s",
            self.name,
            task_id,
            name,
            f"the newer call {by}" if by else "a newer call",
        )
        # The queue of the delivery whose worker records it (the superseded call may be
        # another delivery's: the metrics count it under this one's queue).
        info = getattr(self.request, "delivery_info", None)
        queue = info.get("routing_key") if isinstance(info, dict) else None
        signals.task_superseded.send(
            self, name=name, task_id=task_id, superseded_by=by, queue=queue
        )
        return True

    def _ended(self, task_id: str) -> bool:
        """Whether the result backend already says how ``task_id`` ended: ``SUPERSEDED``
        (stored by the worker of a call that superseded it before: a copy of it, such as
        its fallback copy or a redelivery, superseded again is not stored or counted
        again), or a ready state (SUCCESS, FAILURE, REVOKED), which a superseded call never
        has: its record was written by whoever may write the lock prefix, naming any task
        id of the backend, and is not stored over it."""
        if isinstance(self.backend, DisabledBackend):
            return False
        state = self.backend.get_state(task_id)
        if state == SUPERSEDED:
            return True
        # Celery's own ready states: SUPERSEDED and SKIPPED are ready states too (ready.py),
        # and a SKIPPED record is stored over as before.
        if state in (states.SUCCESS, states.FAILURE, states.REVOKED):
            log.warning(
                "redislock: %s[%s] is recorded as superseded, but its result says it "
                "ended (%s): its state is kept (a record not written by a worker?)",
                self.name,
                task_id,
                state,
            )
            return True
        return False


# ----------------------------------------------------------------------------- drainer


#: The drainer looks at the debounce registry at least every quarter of the shortest
#: debounce (a newly pending call is due at most that late), and no more often than this.
MIN_LOOK = 0.05


def latest_prefixes(app: Any) -> tuple[list[str], float]:
    """The prefixes of the app's debounced tasks (where a drainer looks), and how long
    the drainer may sleep at most: a quarter of the shortest debounce (at least
    :data:`MIN_LOOK`, at most :data:`MAX_SLEEP`), so that a call pending in a registry the
    drainer found empty is sent at most that late."""
    from .base import LockedTask  # (base imports this module)

    found = set()
    shortest = MAX_SLEEP * 4
    for task in app.tasks.values():
        if isinstance(task, LockedTask):
            options = task.lock_options()
            if options.latest and options.debounce > 0:
                found.add(options.prefix)
                shortest = min(shortest, options.debounce)
    return sorted(found), min(MAX_SLEEP, max(MIN_LOOK, shortest / 4))


def serve_debounced(
    app: Any, client: Any, prefix: str, stale_ms: int, longest: float = MAX_SLEEP
) -> float:
    """Send every debounced pending call of ``prefix`` that is due (its message checked
    first); the seconds until the next is due (at most ``longest``)."""
    registry = debounce_registry(prefix)
    script = scripts_for(client).latest_due
    sleep = longest
    for _ in range(MAX_PER_PASS):
        pipe = client.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(registry, 0, 0, withscores=True)
        clock, earliest = pipe.execute()
        if not earliest:
            break
        member, score = earliest[0]
        now_ms = server_clock_us(clock) / 1000
        if score > now_ms:
            sleep = min(sleep, (score - now_ms) / 1000)
            break
        run_key = latest_run_key(member)
        if run_key is None or parked_under(run_key, prefix) is None:
            client.zrem(registry, member)
            _report_refused(app, member, None, "not a last-call-wins key of this prefix")
            continue
        code, _wait, message, owner = decode_latest_due(
            script(keys=[member, registry], args=[stale_ms])
        )
        if code != DUE_SEND or message is None or owner is None:
            continue
        handed = _Handed(run_key, owner, message)
        try:
            send, _envelope = _checked(app, handed)
        except signing.Refused as exc:
            client.hdel(member, "p", "pt", "ps", "pf", "pd", "pm", "pq")
            _report_refused(app, run_key, owner, f"a debounced call: {exc}")
            continue
        send()
    else:
        sleep = 0.0
    return max(sleep, 0.0)


celery_signals.before_task_publish.connect(stamp_sent, weak=False)
