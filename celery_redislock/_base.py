"""The I/O-free half of a lock, shared by :class:`RedisLock` and :class:`AsyncRedisLock`.

Argument validation, owner resolution, the per-owner hold table and what to do with
each script reply live here; the subclasses only send the commands.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Awaitable, Callable, Coroutine, Generic, Sequence, TypeVar

from . import _deferred, signals
from ._clientcheck import validate_replicas, warn_if_unbounded
from ._core import (
    DEFAULT_PREFIX,
    GRANT_MS,
    LINE_MARGIN_MS,
    AcquireReply,
    Hold,
    LockKeys,
    LossSignal,
    abandoned_waits,
    acquire_arguments,
    lease_ms,
    loss_reason_from_release,
    lost_error,
    optional_seconds,
    validate_owner,
    validate_prefix,
    validity_deadline,
)
from ._errors import (
    LockConfigurationError,
    LockForkedError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
)
from ._process import is_current

log = logging.getLogger("celery_redislock")

LostCallback = Callable[[Any, LockLostError], object]
L = TypeVar("L", bound="SyncContext")
A = TypeVar("A", bound="AsyncContext")
F = TypeVar("F", bound=LostCallback)
Signal = TypeVar("Signal", bound=LossSignal)

#: How long an acquire waits for ``min_replicas`` acknowledgements by default (seconds).
DEFAULT_REPLICA_TIMEOUT = 0.5


class LockBase(Generic[Signal]):
    """State and decisions common to the sync and asyncio locks."""

    _signal_type: type[Signal]
    #: Whether blocked acquires ask for direct grants (see :meth:`RedisLock.acquire`); a
    #: task lock does not (its hold counts carry meaning of their own).
    _direct_grants = True
    #: ARGV the release script takes after release.lua's six (a semaphore's limit and
    #: permit keys: see :meth:`_with_tail`); none for a lock.
    _release_tail: tuple[Any, ...] = ()
    #: Whether the watchdog's renewals name the holding's token (a lock on one Redis: its
    #: hash keeps the token; a quorum's node holds are renewed by owner alone).
    _fenced_renewals = False

    def __init__(
        self,
        client: Any,
        name: str | bytes,
        *,
        ttl: float = 30.0,
        owner: str | None = None,
        auto_renew: bool = True,
        blocking: bool = True,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        min_replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
    ) -> None:
        if client is None:
            raise LockConfigurationError("client must be a redis-py client, got None")
        if not isinstance(auto_renew, bool):
            raise LockConfigurationError(f"auto_renew must be True or False, got {auto_renew!r}")
        if not isinstance(blocking, bool):
            raise LockConfigurationError(f"blocking must be True or False, got {blocking!r}")
        self.client = client
        self.name = name
        self.prefix = validate_prefix(prefix)
        self.keys = LockKeys.for_name(name, self.prefix)
        #: KEYS of release.lua, built once (the hot path passes them as they are).
        self._release_keys = tuple(self.keys.release_keys())
        self.ttl = ttl
        self._lease = lease_ms(ttl, "ttl")
        self.owner = validate_owner(owner)
        self.auto_renew = auto_renew
        self.blocking = blocking
        self.timeout = optional_seconds(timeout, "timeout")
        self._holds: dict[str, Hold] = {}
        self._signals: dict[str, Signal] = {}
        self._callbacks: list[LostCallback] = []
        #: Redis's hold count for the owner after this object's last acquire (all objects).
        self._server_count = 0
        if (
            min_replicas.__class__ is int
            and not min_replicas
            and replica_timeout is DEFAULT_REPLICA_TIMEOUT
        ):  # the defaults, valid with any client (validate_replicas gives the same)
            self.min_replicas, self.replica_timeout = 0, DEFAULT_REPLICA_TIMEOUT
        else:
            self.min_replicas, self.replica_timeout = validate_replicas(
                client, min_replicas, replica_timeout
            )
        self._replica_timeout_ms = round(self.replica_timeout * 1000)
        warn_if_unbounded(client, self.name)
        self._attach(client)

    def _attach(self, client: Any) -> None:
        """Hook, last in ``__init__``: a lock on one Redis registers its scripts there."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} ttl={self.ttl!r} owner={self.owner!r}>"

    # -- ownership -------------------------------------------------------------

    def _default_owner(self) -> str:
        raise NotImplementedError

    def _current_owner(self) -> str:
        return self.owner if self.owner is not None else self._default_owner()

    def _live_hold(self, owner: str) -> Hold | None:
        hold = self._holds.get(owner)
        if hold is not None and not is_current(hold.pid):
            return None
        return hold

    def _check_not_inherited(self, owner: str) -> None:
        hold = self._holds.get(owner)
        if hold is not None and not is_current(hold.pid):
            raise LockForkedError(
                f"lock {self.name!r} was acquired by owner {owner!r} in process {hold.pid}, "
                f"the parent of this one; a forked child neither renews nor releases its "
                f"parent's holds (release it in process {hold.pid})",
                name=self.name,
                owner=owner,
            )

    # -- observable state ------------------------------------------------------

    @property
    def token(self) -> int | None:
        """The fencing token of the calling owner's hold (None when it holds nothing).

        Strictly increasing per lock name across all holders; re-entering keeps it.
        """
        hold = self._live_hold(self._current_owner())
        return None if hold is None else hold.token

    @property
    def hold_count(self) -> int:
        """How many times the calling owner holds the lock through this object (0: none).

        Another object for the same name and owner (a nested ``locked`` call, say) counts
        its own holds; Redis counts them all and frees the lock when every one is back.
        """
        hold = self._live_hold(self._current_owner())
        return 0 if hold is None else hold.count

    @property
    def server_hold_count(self) -> int:
        """Redis's hold count for the owner right after this object's last acquire: the
        holds of every object (and process) sharing the owner, not just this one's."""
        return self._server_count

    @property
    def lost(self) -> Signal:
        """Event-like: set once the calling owner's current (or last) lease is known lost."""
        owner = self._current_owner()
        signal = self._signals.get(owner)
        return signal if signal is not None else self._signal_type()

    def ensure_held(self) -> None:
        """Raise :class:`LockLostError` unless the calling owner still holds a valid lease.

        Local and instant: checks the watchdog's verdict and the local validity
        deadline (the lease may be gone from Redis by then even if no renewal failed
        yet). Call it before each step whose effect must not outlive the lock.
        """
        owner = self._current_owner()
        self._check_not_inherited(owner)
        hold = self._holds.get(owner)
        if hold is None:
            signal = self._signals.get(owner)
            if signal is not None and signal.is_set():
                raise lost_error(self.name, owner, signal.reason or "expired")
            raise LockNotOwnedError(
                f"lock {self.name!r} is not held by owner {owner!r}; acquire it first",
                name=self.name,
                owner=owner,
            )
        if not hold.lost.is_set() and hold.past_deadline():
            hold.mark_lost("deadline")
        if hold.lost.is_set():
            raise lost_error(self.name, owner, hold.lost.reason or "expired")

    def on_lost(self, callback: F) -> F:
        """Register ``callback(lock, error)`` to run when a hold of this lock is lost.

        It runs on the watchdog (thread or task), so keep it short: set a flag, cancel
        work. Usable as a decorator. Exceptions it raises are logged and ignored.
        """
        if not callable(callback):
            raise LockConfigurationError(f"on_lost callback must be callable, got {callback!r}")
        self._callbacks.append(callback)
        return callback

    # -- decisions on replies --------------------------------------------------

    def _acquire_keys(self) -> list[bytes]:
        """KEYS of acquire.lua, in order (a task lock adds its done marker)."""
        keys = self.keys
        return [keys.lock, keys.fence, keys.waiters, keys.claims, keys.wake]

    def _acquire_argv(self, owner: str, lease: int, line: bool) -> list[Any]:
        """ARGV of acquire.lua: a blocked acquire (``line``) joins the line when contended."""
        return [owner, lease, LINE_MARGIN_MS] if line else [owner, lease]

    def _hold_keys(self, owner: str) -> LockKeys:
        """The keys of ``owner``'s hold: ``.lock`` is the hash the watchdog renews and
        ``extend``/``owned`` read (a lock's own; a semaphore's permit of that owner)."""
        return self.keys

    def _with_tail(self, args: Sequence[Any]) -> Sequence[Any]:
        """release.lua's ARGV ``args``, followed by :attr:`_release_tail` (if any) at
        ARGV[7] on: the release script of a semaphore reads its limit and permit keys
        there, after release.lua's own arguments in their places."""
        tail = self._release_tail
        if not tail:
            return args
        return [*args, *("",) * (6 - len(args)), *tail]

    def _direct(self, renew: bool) -> bool:
        """Whether a blocked acquire may be granted the lock directly (no round trip):
        only a watchdog-renewed hold (the watchdog lengthens the grant's short lease),
        never one that must reach replicas first, and only for the default owner (the
        calling thread or task: an explicit owner may be shared by waits elsewhere,
        which would each take the one grant as theirs)."""
        return renew and self._direct_grants and not self.min_replicas and self.owner is None

    def _with_wake(self, owner: str, argv: list[Any], wake: bytes | None) -> list[Any]:
        """acquire.lua's ARGV with a wake id (ARGV[6]): a blocked attempt's own, or else
        the name of a wait of this owner on this lock whose leave failed (a direct grant
        to it may still come: taken then as this acquire's hold, not counted again)."""
        if wake is None and abandoned_waits:
            name = abandoned_waits.get(self.keys.lock, owner)
            wake = None if name is None else name + b".0"
        if wake is None:
            return argv
        argv = [*argv, *("",) * (5 - len(argv))]
        return [*argv[:5], wake, *argv[6:]]

    def _abandoned(self, owner: str, grant_name: bytes | None, pttl: int) -> None:
        """A leave failed: the wait's place (kept ``pttl`` + LINE_MARGIN_MS past its last
        attempt) may still be granted, and the grant lasts GRANT_MS more."""
        if grant_name is not None:
            keep_ms = max(pttl, 0) + LINE_MARGIN_MS + GRANT_MS
            until = time.monotonic() + keep_ms / 1000.0
            abandoned_waits.add(self.keys.lock, owner, grant_name, until)

    def _grant_hold(self, owner: str, sent_at: float, lease: int, owner_task: Any = None) -> Hold:
        """The hold a direct grant answering the attempt sent at ``sent_at`` would be, built
        before the wait (:meth:`_take_grant` only fills in its token and records it): the
        waiter's first microseconds after waking, when it runs cold, are the hand-over's.

        The release granted it after that attempt reached Redis, so the grant's lease
        (``GRANT_MS``, or the hold's lease if shorter: what release.lua gives a direct
        grant) ends after ``sent_at`` plus that lease at the earliest: the hold's deadline.
        The watchdog's first renewal is due at a third of it."""
        grant_ms = min(GRANT_MS, lease)
        hold = self._new_hold(owner, 0, sent_at, lease, True, owner_task)
        hold.deadline = validity_deadline(sent_at, grant_ms)
        hold.next_due = sent_at + grant_ms / 3000.0  # full lease well before the grant's ends
        return hold

    def _take_grant(self, hold: Hold, token: int, started: float) -> bool:
        """Count a direct grant (fencing token ``token``) as acquired, as ``hold``
        (:meth:`_grant_hold`), if its short lease can still be trusted: with less than half
        of it left, False (the caller takes the lock up with a round trip instead), as when
        the owner holds it already."""
        grant_ms = min(GRANT_MS, hold.lease)
        owner = hold.owner
        if hold.deadline - time.monotonic() < grant_ms / 2000.0 or self._live_hold(owner):
            return False
        hold.token = token
        self._server_count = 1
        self._install(hold, started)
        self._renewals().add(hold, renew_by=hold.acquired_at + grant_ms / 2000.0)
        return True

    def _renewals(self) -> Any:
        """This lock's watchdog (sync: a thread's scheduler; asyncio: the loop's)."""
        raise NotImplementedError

    def _acquire_args(
        self, blocking: object, timeout: object, lease: object
    ) -> tuple[float | None, int, bool]:
        """Check acquire()'s arguments: (wait limit, lease in ms, renewed by the watchdog?)."""
        wait_limit, lease_millis = acquire_arguments(blocking, timeout, lease)
        if lease_millis is None:
            return wait_limit, self._lease, self.auto_renew
        return wait_limit, lease_millis, False

    def _record_acquired(
        self,
        owner: str,
        reply: AcquireReply,
        sent_at: float,
        lease: int,
        renew: bool,
        started: float | None = None,
        owner_task: Any = None,
    ) -> tuple[Hold, bool]:
        """Update the hold table; returns (hold, is_new) — a new hold needs the watchdog.

        ``owner_task``: the asyncio task a default owner names (the watchdog stops
        renewing the hold once it is done).
        """
        self._server_count = reply.hold_count
        hold = self._live_hold(owner)
        if hold is not None and reply.hold_count == 1 and reply.token != hold.token:
            # We thought we held it, but Redis handed out a fresh hold: ours had expired.
            # (Count 1 with our token is a concurrent acquire of the same explicit owner
            # whose reply came after a re-entry's: still our holding.)
            self._forget(hold)
            hold.mark_lost("expired")
            hold = None
        if hold is None:
            hold = self._new_hold(owner, reply.token, sent_at, lease, renew, owner_task)
            self._install(hold, started)
            return hold, True
        hold.count += 1
        hold.renewed(sent_at)
        return hold, False

    def _new_hold(
        self, owner: str, token: int, sent_at: float, lease: int, renew: bool, owner_task: Any
    ) -> Hold:
        """A hold of ``owner`` (count 1, a loss signal of its own), not yet recorded."""
        hold = Hold(
            self._hold_keys(owner),
            owner,
            token=token,
            lease=lease,
            renew=renew,
            sent_at=sent_at,
            lost=self._signal_type(),
            notify=self._report_lost,
            owner_task=None if owner_task is None else weakref.ref(owner_task),
            fenced=self._fenced_renewals,
        )
        hold.count = 1
        return hold

    def _install(self, hold: Hold, started: float | None) -> None:
        """Record a new hold (:meth:`_new_hold`) as its owner's: the hold table, its loss
        signal, the log and ``lock_acquired``."""
        owner = hold.owner
        if _deferred._deferred.peek() is not None or _deferred._async_tasks:
            _deferred.cancel_deferred(self.keys.lock, owner)  # see DeferredReleases.cancel
        self._signals[owner] = hold.lost  # type: ignore[assignment]
        self._holds[owner] = hold
        log.debug("lock %r acquired by %s (token %d)", self.name, owner, hold.token)
        if signals.lock_acquired.receivers:
            sent_at = hold.acquired_at
            waited = 0.0 if started is None else max(0.0, sent_at - started)
            signals.lock_acquired.send(
                self, name=self.name, owner=owner, token=hold.token, waited=waited
            )

    def _record_released(self, owner: str, code: int) -> Hold | None:
        """Apply a release reply; returns the hold to stop renewing (or None). Raises on loss."""
        hold = self._holds.get(owner)
        if code >= 0:
            if hold is None:
                return None
            hold.count -= 1
            if code == 0 or hold.count <= 0:  # this object's last hold: stop renewing it
                self._forget(hold)
                self._signals.pop(owner, None)
                log.debug("lock %r released by %s", self.name, owner)
                if signals.lock_released.receivers:
                    held = time.monotonic() - hold.acquired_at
                    signals.lock_released.send(self, name=self.name, owner=owner, held=held)
                return hold
            return None
        if hold is None:
            signal = self._signals.get(owner)
            if signal is not None and signal.is_set():
                raise lost_error(self.name, owner, signal.reason or "expired")
            raise LockNotOwnedError(
                f"cannot release lock {self.name!r}: owner {owner!r} does not hold it "
                f"({'it is not locked' if code == -1 else 'another owner holds it'}); "
                f"nothing was changed",
                name=self.name,
                owner=owner,
            )
        self._forget(hold)
        hold.mark_lost(loss_reason_from_release(code))
        raise lost_error(self.name, owner, hold.lost.reason or "expired")

    def _record_extended(self, owner: str, code: int, lease: int, sent_at: float) -> None:
        hold = self._holds.get(owner)
        if code == 1:
            if hold is not None:
                hold.lease = lease
                hold.renewed(sent_at)
            return
        reason = loss_reason_from_release(-1 if code == 0 else -2)
        if hold is not None:
            self._forget(hold)
            hold.mark_lost(reason)
            raise lost_error(self.name, owner, reason)
        raise LockNotOwnedError(
            f"cannot extend lock {self.name!r}: owner {owner!r} does not hold it",
            name=self.name,
            owner=owner,
        )

    def _unconfirmed(self, hold: Hold, exc: BaseException) -> str:
        """The release of this object's last hold could not reach Redis: stop renewing it
        at once (its lease then ends it: never a lock renewed for ever) and report it.
        Returns how to name it in logs; the caller retries it in the background."""
        self._forget(hold)
        self._signals.pop(hold.owner, None)
        what = f"lock {self.name!r} (owner {hold.owner}, token {hold.token})"
        log.warning(
            "redislock: could not release %s: %r; it is no longer renewed, its lease ends "
            "it at the latest, and the release is retried in the background",
            what,
            exc,
        )
        signals.lock_release_failed.send(self, name=self.name, owner=hold.owner, error=exc)
        return what

    def _release_unreachable(
        self, owner: str, hold: Hold | None, exc: BaseException
    ) -> tuple[str, list[str]] | None:
        """What a release that Redis did not answer leaves to do (the sync and asyncio
        twins' one decision): re-raise ``exc`` for a hold not this process's or an inner
        one (:meth:`_inner_unconfirmed`); else stop renewing (:meth:`_unconfirmed`) and
        return (its name, release.lua's ARGV) for a background retry, or None when no
        retry is safe: other lock objects (or processes) hold for this owner too, and a
        retry could not tell this release from theirs (the lease ends what is left)."""
        if hold is None or not is_current(hold.pid):
            raise exc
        if hold.count > 1:
            self._inner_unconfirmed(hold)
            raise exc
        what = self._unconfirmed(hold, exc)
        if self._server_count > 1:
            return None
        return what, list(self._with_tail(_deferred._retry_release_args(owner, hold.token)))

    def _inner_unconfirmed(self, hold: Hold) -> None:
        """The release of an inner (re-entered) hold could not reach Redis: whether Redis
        counted it is unknown. The hold is counted as given back here, and stops being
        renewed at once: the remaining releases then give back what this object holds,
        and a count Redis kept for the lost release ends with the lease (it is never
        renewed for ever by a count nobody gives back). Work still done under the outer
        hold is covered until its validity deadline (``ensure_held()`` says so after it).
        The caller's error propagates."""
        hold.count -= 1
        self._unschedule(hold)

    def _forget(self, hold: Hold) -> None:
        if self._holds.get(hold.owner) is hold:
            del self._holds[hold.owner]
        self._unschedule(hold)

    def _unschedule(self, hold: Hold) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop renewing this lock's holds here (this process, or this event loop for the
        asyncio locks); they expire after their lease."""
        for hold in list(self._holds.values()):
            self._unschedule(hold)

    def _timeout_error(self, timeout: float | None) -> LockTimeoutError:
        return LockTimeoutError(
            f"lock {self.name!r} not acquired within {timeout}s: another owner holds it "
            f"(raise the timeout, or see who holds it with `celery redislock show`)"
            if timeout is not None
            else f"lock {self.name!r} is held by another owner (non-blocking acquire)",
            name=self.name,
            owner=self._current_owner(),
        )

    def _contended(self, owner: str) -> None:
        log.debug("lock %r contended (owner %s waits)", self.name, owner)
        if signals.lock_contended.receivers:
            signals.lock_contended.send(self, name=self.name, owner=owner)

    def _report_lost(self, hold: Hold, reason: str) -> None:
        if reason == "abandoned":  # its owner (a task) is gone: nothing here will release it
            self._forget(hold)
            self._signals.pop(hold.owner, None)
        error = lost_error(self.name, hold.owner, reason)
        signals.lock_lost.send(self, name=self.name, owner=hold.owner, reason=reason)
        log.warning(
            "redislock: lost lock %r (owner %s, token %d): %s",
            self.name,
            hold.owner,
            hold.token,
            reason,
        )
        for callback in list(self._callbacks):
            try:
                callback(self, error)
            except Exception:
                log.exception("redislock: on_lost callback %r failed", callback)

    @staticmethod
    def _now() -> float:
        return time.monotonic()


class SyncContext:
    """``with lock:`` for the blocking locks: acquire per the lock's defaults, release."""

    blocking: bool
    timeout: float | None

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def _timeout_error(self, timeout: float | None) -> LockTimeoutError:
        raise NotImplementedError

    def __enter__(self: L) -> L:
        if not self.acquire(self.blocking, self.timeout):
            raise self._timeout_error(self.timeout if self.blocking else None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class AsyncContext:
    """``async with lock:`` for the asyncio locks (owner resolved where entered and left,
    as by ``acquire()`` and ``release()``)."""

    blocking: bool
    timeout: float | None

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Awaitable[bool]:
        raise NotImplementedError

    def release(self) -> Awaitable[None]:
        raise NotImplementedError

    def _timeout_error(self, timeout: float | None) -> LockTimeoutError:
        raise NotImplementedError

    def __aenter__(self: A) -> Coroutine[Any, Any, A]:
        return self._entered(self.acquire(self.blocking, self.timeout))

    async def _entered(self: A, acquiring: Awaitable[bool]) -> A:
        if not await acquiring:
            raise self._timeout_error(self.timeout if self.blocking else None)
        return self

    def __aexit__(self, *exc: object) -> Awaitable[None]:
        return self.release()
