"""The lock of one run of a task.

:func:`run_owner` / :func:`request_owner` name the run that owns it; :class:`TaskLock`
is that lock on one Redis (with parking and hand-over), :class:`QuorumTaskLock` on a
quorum of masters (``redislock_urls``), and :func:`task_lock` picks one for an app.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import redis

from .. import signals
from .._core import LINE_MARGIN_MS, OwnerFinished, OwnerRunning, lease_ms
from .._errors import LockConfigurationError, LockNotOwnedError, LockQuorumError
from .._keyspace import debounce_registry, parked_registry
from .._quorum import decided_by, given_back, quorum_error, release_code
from .._renewal import scheduler_for
from .._replies import (
    HandoffReply,
    LatestReply,
    decode_acquire,
    decode_handoff,
    decode_latest,
    decode_park,
    decode_release,
)
from .._scripts import run
from ..lock import RedisLock, SyncSingle
from ..redlock import RedLock
from ..semaphore import RedisSemaphore
from ..settings import LockOptions
from .clients import client_for, quorum_clients_for, settings_for
from .envelope import _Handed, _handed, _text, push_targets

if TYPE_CHECKING:
    from .lookahead import _Pull

log = logging.getLogger(__name__)


class LatestCall(NamedTuple):
    """A "last call wins" call's particulars for its park script (latest.lua): its task
    id, when it was sent (µs since the epoch, its publisher's clock), and the debounce's
    quiet period and bound in ms (0, 0: ``on_contention="replace"`` alone)."""

    task_id: str
    sent_us: int
    quiet_ms: int = 0
    max_ms: int = 0

    def args(self) -> list[Any]:
        return [self.task_id, self.sent_us, self.quiet_ms, self.max_ms]


def _task_argv(owner: str, lease: int, line: Any, tok: str, adopt: Any, by: str = "") -> list[Any]:
    """acquire.lua's ARGV for a task run: never a re-entry ("task"), or taking over the
    hold an earlier run kept across ``self.retry()`` ("adopt"); ``by`` (ARGV[9]): the
    process taking it (``runon.tag``), kept beside the hold for its worker's release."""
    argv: list[Any] = [owner, lease, line, tok, "task" if adopt is None else "adopt", ""]
    argv.append(adopt or "")
    return [*argv, "", by] if by else argv


def run_owner(task_id: str, retries: Any = 0, nesting: Any = 0) -> str:
    """The lock owner of one run of a task: its id, and the run's place among the runs
    that share that id (``self.retry()`` sends the same id again with ``retries`` + 1,
    ``self.replace()`` with ``replaced_task_nesting`` + 1). A redelivery of a message is
    the same run (same owner: its duplicate is recognised); a retry or a replacement is
    a new run that waits for the previous one like any other task, and is not taken for
    a duplicate of it. The first run's owner is the task id itself."""
    if retries.__class__ is nesting.__class__ is int and not retries and not nesting:
        return task_id  # (exact 0s; any other value's truth may raise: the loop's way)
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


#: ``runon.took_handed``, set when :mod:`.runon` (which imports this module) is imported.
_took_handed: Callable[[Any, str], bool] | None = None


class _ParkedRun(SyncSingle):
    """What the two task locks of one Redis share, the mutex's (:class:`TaskLock`) and the
    permit's (:class:`TaskSemaphore`): parking a run, and a run's end with its hand-over.
    Each gives its scripts' keys and arguments (``_park_call``, ``handoff_args``, ``_keep``);
    ``self._scripts`` names them alike (``park``, ``handoff``)."""

    pulled: str | None = None  # the queued task the last finish() handed the lock to
    run_on = ""  #: this process's tag (``runon.tag``) when a release may hand it a task to run
    #: The process taking it (``runon.tag``); in the main process, the dead one released for.
    by = ""
    #: The queue lists a hand-over may push a parked envelope to itself, and the task names
    #: it may be for, one a line (the hand-over scripts' ``lists``, ``tasks``): ``task_lock``
    #: sets the app's. Other envelopes come back to the worker, which checks them first.
    _push_to: tuple[str, str] = ("", "")
    #: The app whose push targets those are (``task_lock`` sets it): read at the first
    #: hand-over script call, not when the lock is made (a delivery check needs none).
    _push_app: Any = None

    @property
    def push_to(self) -> tuple[str, str]:
        if self._push_app is not None:
            self._push_to = push_targets(self._push_app)
            self._push_app = None
        return self._push_to

    @push_to.setter
    def push_to(self, value: tuple[str, str]) -> None:
        self._push_to = value
        self._push_app = None

    if TYPE_CHECKING:

        def _park_call(
            self,
            owner: str,
            message: str,
            keep_ms: int,
            behind: bool,
            latest: LatestCall | None = None,
        ) -> Any: ...
        def _keep(
            self, owner: str, hold: float, done_ttl: float | None, token: int | None
        ) -> int: ...
        def handoff_args(
            self,
            owner: str | bytes,
            mode: str,
            done_ttl: float | None,
            pull: _Pull | None = None,
            token: int | None = None,
        ) -> tuple[list[Any], list[Any]]: ...

    _adopt: str | None = None  # set during take(adopt=...)
    _direct_grants = False  # a hold count of 0 means "handed over, not started" here

    def _run_keys(self, task_id: str) -> None:
        self.done_key = self.keys.done(task_id)
        self.parked = self.keys.parked
        self.parked_messages = self.keys.parked_messages
        self.dispatched = self.keys.parked_dispatched
        self.registry = parked_registry(self.prefix)  # the sweeper's: locks with parked tasks

    def _acquire_keys(self) -> list[bytes]:
        return [*super()._acquire_keys(), self.done_key]

    def take(self, *, adopt: str | None = None) -> bool:
        """One attempt, renewed while held. Raises OwnerFinished (this run finished) or
        OwnerRunning (another delivery of this run holds it; nothing changed).

        ``adopt``: the owner of an earlier run of this task that kept the lock (permit)
        across ``self.retry()``; its hold, if still there, becomes this run's.
        """
        owner = self._current_owner()
        if _took_handed is None:
            from . import runon  # noqa: F401  (sets _took_handed; it imports this module)
        if isinstance(self, TaskLock) and _took_handed is not None and _took_handed(self, owner):
            return True  # run on: the release wrote the hold as this run's, taken
        self._adopt = adopt
        try:
            return self._try(owner, self._lease, True) is True
        finally:
            self._adopt = None

    def park(self, message: str, keep_for: float, *, behind: bool = False) -> bool | int | None:
        """Take the lock (a permit), or park ``message`` until a release hands it over:
        True, or ms to wait for a change (the holder's lease left).

        With ``behind``, park only behind other owners' holds and never take it: None when
        it is free (a permit is) or this task id holds it (the worker's main process
        parking before a pool process gets the task). A parked task's lock is also entered
        in the registry the workers' sweeper scans, in the same script.
        """
        owner = self._current_owner()
        sent_at = time.monotonic()
        keep_ms = lease_ms(keep_for, "parking lifetime")
        reply = decode_park(self._park_call(owner, message, keep_ms, behind))
        if reply is None:
            return None
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

    def park_latest(self, message: str, keep_for: float, latest: LatestCall) -> LatestReply:
        """:meth:`park` for a "last call wins" call (``celery.latest``): superseded by a
        newer call of its key, pending until due (debounce), taken, or parked as the key's
        one pending call — taking the place of an older pending call (``evicted``).

        Raises OwnerFinished or OwnerRunning as :meth:`take`.
        """
        owner = self._current_owner()
        sent_at = time.monotonic()
        keep_ms = lease_ms(keep_for, "parking lifetime")
        reply = decode_latest(self._park_call(owner, message, keep_ms, False, latest))
        park = reply.park
        if park.finished:
            raise OwnerFinished(self.name)
        if park.running:
            raise OwnerRunning(self.name)
        if park.acquired:
            hold, is_new = self._record_acquired(owner, park, sent_at, self._lease, True)
            if is_new:
                scheduler_for(self.client).add(hold)
        return reply

    def handed(self, reply: HandoffReply) -> _Handed | None:
        """The parked task a hand-over script's ``reply`` says the worker must send, if any."""
        return _handed(self.keys.lock, reply.handed)

    def handoff(self, owner: str | bytes, mode: str, done_ttl: float | None) -> HandoffReply:
        """One hand-over script run for ``owner`` (mode "all": its process died, or
        ``celery redislock release --owner``; "unstarted": a hand-over to it it never
        took up), without look-ahead."""
        keys, args = self.handoff_args(owner, mode, done_ttl)
        return decode_handoff(run(self.client, self._scripts.handoff, keys, args))

    def finish(
        self,
        *,
        hold: float,
        done_ttl: float | None,
        lookahead: Callable[[], _Pull | None] | None = None,
        token: int | None = None,
    ) -> _Handed | None:
        """Give the hold back (or keep it ``hold`` seconds more, unrenewed).

        ``token``: only the holding with this fencing token (default: this object's
        holding's). A release must not touch a later holding of the same run: another copy
        of its message that took the lock after this one's lease ran out.

        With ``done_ttl``, also mark the task id done so a later delivery of the same
        message does not run again. Returns the parked task the lock was handed to whose
        message the worker must check and send (:func:`deliver_handed_over`), if any.
        Raises like :meth:`release` when the hold was lost — after recording any hand-over
        on the exception's ``handed_to``.

        ``lookahead`` (a release without ``hold``; a mutex's only): finds the next queued
        task of this lock, which the release hands the lock to when no task is parked or
        waiting; ``self.pulled`` is then its task id.
        """
        self.pulled = None
        owner = self._current_owner()
        held = self._holds.get(owner)
        if held is not None:
            held.releasing += 1  # a renewal crossing this release must not report a loss
            if token is None:  # this holding only: not a later one of this run (another copy)
                token = held.token
        message = None
        try:
            if hold <= 0:
                pull = None
                if lookahead is not None:
                    try:
                        pull = lookahead()
                    except Exception:  # only a shortcut: the task comes in its turn anyway
                        log.debug("redislock: look-ahead failed for %r", self.name, exc_info=True)
                handoff_keys, handoff_args = self.handoff_args(owner, "one", done_ttl, pull, token)
                reply = decode_handoff(
                    run(self.client, self._scripts.handoff, handoff_keys, handoff_args)
                )
                code = reply.code
                message = self.handed(reply)
                if reply.pulled is not None:  # handed to the look-ahead's queued task
                    self.pulled = _text(reply.pulled)
                if reply.pushed is not None and signals.task_handed_over.receivers:
                    # (its task not named: counted under the releasing run's)
                    signals.task_handed_over.send(
                        self, name="", task_id=_text(reply.pushed), via="release", owner=owner
                    )
            else:
                code = self._keep(owner, hold, done_ttl, token)
        except redis.ResponseError:
            # The script failed (a key of the wrong type where it writes: whoever may write
            # the prefix wrote it), maybe after some of its writes. The run is over: its
            # hold stops renewing, so its lease ends it at the latest.
            if held is not None:
                self._forget(held)
                self._signals.pop(owner, None)
            raise
        finally:
            if held is not None:
                held.releasing -= 1
        try:
            self._record_released(owner, code)
        except LockNotOwnedError as exc:
            exc.handed_to = message  # type: ignore[attr-defined]
            raise
        return message


class TaskLock(_ParkedRun, RedisLock):
    """A :class:`RedisLock` owned by one run of a task (:func:`run_owner`), with the run's
    "done" marker beside it. A run never re-enters its lock: an attempt that finds its own
    owner holding it (another delivery of the same run) raises ``OwnerRunning`` and
    changes nothing."""

    def __init__(self, client: Any, name: str, *, task_id: str, options: LockOptions) -> None:
        super().__init__(client, name, ttl=options.ttl, owner=task_id, prefix=options.prefix)
        self._run_keys(task_id)

    def _acquire_argv(self, owner: str, lease: int, line: bool) -> list[Any]:
        margin = LINE_MARGIN_MS if line else ""
        return _task_argv(owner, lease, margin, "", self._adopt, self.by)

    def _park_call(
        self,
        owner: str,
        message: str,
        keep_ms: int,
        behind: bool,
        latest: LatestCall | None = None,
    ) -> Any:
        keys = [
            self.keys.lock,
            self.keys.fence,
            self.done_key,
            self.parked,
            self.parked_messages,
            self.dispatched,
            self.keys.waiters,
            self.keys.claims,
            self.keys.wake,
            self.registry,
        ]
        args = [owner, self._lease, message, keep_ms]
        if behind:
            args.append("behind")
        if latest is not None:
            keys += [self.keys.latest, debounce_registry(self.prefix)]
            args += ["", *latest.args()]
        return run(self.client, self._scripts.park, keys, args)

    def handoff_args(
        self,
        owner: str | bytes,
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
            self.keys.wake,
        ]
        done_ms = 0 if done_ttl is None else lease_ms(done_ttl, "lock_done_ttl")
        args: list[Any] = [owner, mode, self._lease, done_ms]
        if pull is not None:
            next_done = self.keys.done(pull.task_id)
            keys += [pull.queue_list, self.registry, pull.chain, next_done]
            args += [pull.task_id, pull.raw, pull.entry, pull.keep_ms, pull.reach]
        else:
            args += ["", "", "", "", ""]
        fence = "" if token is None else token
        if self.run_on:  # every parked envelope comes back (handoff.lua's run_on)
            return keys, [*args, "", "", fence, "", self.run_on]
        by = [fence, "", "", self.by] if mode == "all" and self.by else [fence]
        return keys, [*args, *self.push_to, *by]

    def _keep(self, owner: str, hold: float, done_ttl: float | None, token: int | None) -> int:
        """Keep the hold ``hold`` seconds more, unrenewed (release.lua "hold")."""
        keys = self.keys.release_keys()
        args: list[Any] = [owner, "hold", lease_ms(hold, "lock_hold"), "", ""]
        if done_ttl is not None:
            keys.append(self.done_key)
            args[3] = lease_ms(done_ttl, "lock_done_ttl")
        if token is not None:
            args.append(token)
        return decode_release(run(self.client, self._scripts.release, keys, args))


class TaskSemaphore(_ParkedRun, RedisSemaphore):
    """A permit of a :class:`RedisSemaphore` owned by one run of a task (``lock_limit``):
    :class:`TaskLock`'s rules (one hold per run, the done marker, parking and hand-over)
    with ``limit`` runs at once per key. Its ``keys`` are the semaphore's (``keys.lock``
    is its holders set: the key the run is parked under and its messages signed for)."""

    _decode_acquire = staticmethod(functools.partial(decode_acquire, script="sem_acquire"))

    def __init__(
        self, client: Any, name: str | bytes, *, task_id: str, options: LockOptions, limit: int
    ) -> None:
        super().__init__(client, name, limit, ttl=options.ttl, owner=task_id, prefix=options.prefix)
        self._run_keys(task_id)

    def _acquire_keys(self) -> list[bytes]:
        """sem_acquire.lua's: a task run's also name its done marker and the parked tasks
        (served before it)."""
        line = self.keys
        return [*super()._acquire_keys(), line.parked, line.parked_messages, line.parked_limit]

    def _acquire_argv(self, owner: str, lease: int, line: bool) -> list[Any]:
        argv = super()._acquire_argv(owner, lease, line)
        return [*argv, "task", ""] if self._adopt is None else [*argv, "adopt", self._adopt]

    def _park_call(
        self,
        owner: str,
        message: str,
        keep_ms: int,
        behind: bool,
        latest: LatestCall | None = None,
    ) -> Any:
        keys = self.semaphore_keys.park_keys(self.done_key, self.registry)
        args = [owner, self._lease, message, keep_ms, "behind" if behind else "", self.limit]
        args.append(self.semaphore_keys.permits)
        if latest is not None:
            keys += [self.keys.latest, debounce_registry(self.prefix)]
            args += latest.args()
        return run(self.client, self._scripts.park, keys, args)

    def handoff_args(
        self,
        owner: str | bytes,
        mode: str,
        done_ttl: float | None,
        pull: _Pull | None = None,
        token: int | None = None,
        hold_ms: int | str = "",
    ) -> tuple[list[Any], list[Any]]:
        """sem_handoff.lua's KEYS and ARGV (``pull`` is unused: no look-ahead for permits)."""
        done_ms = 0 if done_ttl is None else lease_ms(done_ttl, "lock_done_ttl")
        args: list[Any] = [owner, mode, self._lease, done_ms, *self.push_to]
        args += ["" if token is None else token, "", self.limit, self.semaphore_keys.permits]
        return self.semaphore_keys.handoff_keys(owner), [*args, hold_ms]

    def _keep(self, owner: str, hold: float, done_ttl: float | None, token: int | None) -> int:
        """Keep the permit ``hold`` seconds more, unrenewed (sem_handoff.lua "hold")."""
        hold_ms = lease_ms(hold, "lock_hold")
        keys, args = self.handoff_args(owner, "hold", done_ttl, None, token, hold_ms)
        return decode_handoff(run(self.client, self._scripts.handoff, keys, args)).code


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
        self.done_key = self.keys.done(task_id)

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
        args: list[Any] = [owner, "all", 0]
        if hold > 0:
            args = [owner, "hold", lease_ms(hold, "lock_hold")]
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


AnyTaskLock = TaskLock | TaskSemaphore | QuorumTaskLock
#: The task locks a run can park behind (a single Redis).
PARKABLE = (TaskLock, TaskSemaphore)


def task_lock(
    app: Any, name: str, *, task_id: str, options: LockOptions, limit: int | None = None
) -> AnyTaskLock:
    """The lock of one task execution: on the app's one Redis, or its quorum of masters;
    with ``limit`` (``lock_limit``), a permit of that key's semaphore on the one Redis."""
    settings = settings_for(app)
    if limit is not None:
        if settings.urls:
            raise LockConfigurationError(
                f"lock_limit is not offered with redislock_urls (the lock {name!r} would need "
                f"a quorum semaphore, which is not built yet): use one Redis for limited tasks"
            )
        permit = TaskSemaphore(client_for(app), name, task_id=task_id, options=options, limit=limit)
        permit._push_app = app
        return permit
    if settings.urls:
        return QuorumTaskLock(
            quorum_clients_for(app),
            name,
            task_id=task_id,
            options=options,
            node_timeout=settings.node_timeout,
        )
    lock = TaskLock(client_for(app), name, task_id=task_id, options=options)
    lock._push_app = app
    return lock
