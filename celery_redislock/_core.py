"""I/O-free logic shared by the sync and asyncio locks.

Argument validation, owner ids, local validity deadlines and retry backoff live here
once (key names: :mod:`._keyspace`; script replies: :mod:`._replies`; both
re-exported); :mod:`celery_redislock.lock` and :mod:`celery_redislock.aio` only drive
I/O around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import secrets
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

from ._errors import LockConfigurationError, LockLostError

# Every Redis name lives in _keyspace, every script reply's decoder in _replies; the
# names this module has always offered are re-exported from there.
from ._keyspace import DEFAULT_PREFIX as DEFAULT_PREFIX
from ._keyspace import LockKeys as LockKeys
from ._keyspace import name_from_lock_key as name_from_lock_key
from ._keyspace import validate_prefix as validate_prefix
from ._process import ProcessLocal, current, on_fork
from ._replies import AcquireReply as AcquireReply
from ._replies import decode_acquire as decode_acquire

FENCE_FIELD = "__fence__"
#: The lock hash's field naming the wait a release granted the lock to directly.
GRANT_FIELD = "__grant__"
#: Field of a LockedTask's lock hash naming the queue list of its look-ahead chain.
CHAIN_FIELD = "__chain__"
#: Field of a semaphore's permit: the limit it was taken under (sem.lua's give_permit).
LIMIT_FIELD = "__limit__"

#: The longest a blocked acquire sleeps before it retries on its own (a release would
#: have woken it sooner): for a lock with no expiry, and as a cap on the holder's lease.
NO_TTL_RECHECK = 5.0
#: A waiter keeps its place in line this long past the holder's lease without retrying.
LINE_MARGIN_MS = 2000
#: The lease release.lua gives a lock it hands to a waiter (its ARGV[5] default): the
#: waiter takes it up within this time (with a round trip, or, granted directly, by its
#: watchdog's first renewal), or the grant lapses; the next waiter then finds the lock
#: free at its own re-check (nothing is published when a lease ends).
GRANT_MS = 2000


# --------------------------------------------------------------------- validation

#: The longest duration any argument or setting of this package accepts, in seconds
#: (365 days): leases (``ttl``, ``lease=``, ``extend(ttl)``, ``lock_hold``, the done
#: marker's ``done_ttl``), timeouts, waits, back-offs and delays alike. It keeps every
#: value far inside what the layers below take: Redis's ``PEXPIRE`` (about 2**63 ms from
#: now), Lua's exact integers (2**53), and ``threading.TIMEOUT_MAX`` (about 292 years on
#: POSIX) for the waits a timeout turns into. ``None`` still means "no limit" where a
#: timeout allows it.
MAX_SECONDS = 365 * 24 * 3600
#: :data:`MAX_SECONDS` in milliseconds: the Lua scripts refuse any duration above it
#: (``lua/args.lua`` is loaded with this value).
MAX_MS = MAX_SECONDS * 1000
#: The largest limit of a semaphore (sem.lua's ``sem_limit``; ``lock_limit``).
MAX_LIMIT = 2**31 - 1
#: The shortest lease (and every other duration that must not be zero): 1 ms.
#: ``PEXPIRE`` with 0 or less deletes the key.
MIN_SECONDS = 0.001


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _in_range(value: object, low: float) -> bool:
    """Whether ``value`` is an int or float from ``low`` to :data:`MAX_SECONDS`.

    Compared as it is, never converted first: ``float()`` of a huge int overflows.
    """
    kind = value.__class__
    if kind is float or kind is int:  # (NaN and the infinities fail the comparison)
        return low <= value <= MAX_SECONDS  # type: ignore[operator]
    if not _is_number(value):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return low <= value <= MAX_SECONDS  # type: ignore[operator]


def duration_error(
    argument: str, value: object, low: float = MIN_SECONDS, *, alternative: str = ""
) -> LockConfigurationError:
    """The one message for a bad duration: it names the argument and the allowed range
    (and the ``alternative`` it may also be, such as ``"None (no limit)"``)."""
    allowed = f"{alternative} or a number" if alternative else "a number"
    return LockConfigurationError(
        f"{argument} must be {allowed} between {low:g} and {MAX_SECONDS} seconds (365 days), "
        f"got {value!r}"
    )


def seconds(value: object, argument: str, *, low: float = MIN_SECONDS) -> float:
    """Validate a duration in seconds: a number from ``low`` (0.001 unless given; 0 where
    zero means "none") to :data:`MAX_SECONDS`."""
    if not _in_range(value, low):
        raise duration_error(argument, value, low)
    return float(value)  # type: ignore[arg-type]


def lease_ms(value: object, argument: str) -> int:
    """Convert a lease in seconds to whole milliseconds, from 1 to :data:`MAX_MS`.

    ``PEXPIRE`` with 0 or a negative value deletes the key, so anything that does not
    come out as at least one millisecond is refused here (and again in Lua), and so is
    anything above :data:`MAX_SECONDS`.
    """
    if not _in_range(value, 0.0):
        raise duration_error(argument, value)
    millis = round(float(value) * 1000)  # type: ignore[arg-type]
    if millis < 1:
        raise duration_error(argument, value)
    return millis


def optional_seconds(value: object, argument: str) -> float | None:
    """Validate a timeout: None (no limit) or a number from 0 to :data:`MAX_SECONDS`."""
    if value is None:
        return None
    if not _in_range(value, 0.0):
        raise duration_error(argument, value, 0.0, alternative="None (no limit)")
    return float(value)  # type: ignore[arg-type]


def acquire_arguments(
    blocking: object, timeout: object, lease: object
) -> tuple[float | None, int | None]:
    """Check ``acquire()``'s arguments as strictly as the constructor's, before any I/O.

    ``blocking`` must be a bool (``"no"`` is not False), ``timeout`` None or a number of
    seconds from 0 to :data:`MAX_SECONDS`, ``lease`` None or a lease like ``ttl``.
    Returns (timeout in seconds or None, lease in milliseconds or None).
    """
    if not isinstance(blocking, bool):
        raise LockConfigurationError(f"blocking must be True or False, got {blocking!r}")
    wait_limit = optional_seconds(timeout, "timeout")
    return wait_limit, None if lease is None else lease_ms(lease, "lease")


def validate_owner(owner: object) -> str | None:
    """An explicit owner must be a non-empty str that cannot clash with the token field."""
    if owner is None:
        return None
    if not isinstance(owner, str) or not owner:
        raise LockConfigurationError(f"owner must be None or a non-empty str, got {owner!r}")
    if owner in (FENCE_FIELD, GRANT_FIELD, CHAIN_FIELD, LIMIT_FIELD):
        raise LockConfigurationError(f"owner must not be {owner!r} (a reserved field)")
    return owner


# --------------------------------------------------------------------- owners

#: 128 random bits naming this process (a forked child draws its own).
_process_id = ProcessLocal(lambda: secrets.token_hex(16))
_thread_ids = threading.local()
_thread_counter = itertools.count(1)


def process_id() -> str:
    """128 random bits naming this process; new in every forked child."""
    return _process_id.get()


def thread_owner() -> str:
    """Owner id of the calling thread: process id plus a per-thread serial.

    A serial rather than ``threading.get_ident()``: idents are reused after a thread
    exits, and a new thread must never inherit a dead thread's holds.
    """
    serial = getattr(_thread_ids, "serial", None)
    if serial is None:
        serial = _thread_ids.serial = next(_thread_counter)
    return f"{_process_id.get()}:t{serial}"


def new_owner_suffix() -> int:
    return next(_thread_counter)


# --------------------------------------------------------------------- abandoned waits


class AbandonedWaits:
    """Blocked acquires whose ``leave`` failed (a Redis error), process-wide.

    Their place in line may still be granted directly (until the place lapses, and for
    the grant's lease after): any later acquire of the same owner on that lock, from
    any lock object, sends the wait's name, so that Redis counts such a grant as that
    acquire's one hold instead of a re-entry on top of it. Entries expire by then.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every entry (and the mutex: a forked child starts afresh)."""
        self._mutex = threading.Lock()
        self._waits: dict[tuple[bytes, str], tuple[bytes, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._waits)

    def add(self, lock_key: bytes, owner: str, grant_name: bytes, until: float) -> None:
        now = time.monotonic()
        with self._mutex:
            for key in [k for k, (_n, end) in self._waits.items() if end <= now]:
                del self._waits[key]
            self._waits[(lock_key, owner)] = (grant_name, until)

    def get(self, lock_key: bytes, owner: str) -> bytes | None:
        with self._mutex:
            found = self._waits.get((lock_key, owner))
            if found is None:
                return None
            if found[1] <= time.monotonic():
                del self._waits[(lock_key, owner)]
                return None
            return found[0]


abandoned_waits = AbandonedWaits()
on_fork(abandoned_waits.reset)  # a forked child's acquires never send its parent's waits


# --------------------------------------------------------------------- replies


# AcquireReply and decode_acquire: _replies (every script reply's decoder), re-exported above.


class OwnerFinished(Exception):
    """Internal: the acquire script found the owner's "done" marker (a finished task)."""


class OwnerRunning(Exception):
    """Internal: a task run's attempt found its own owner holding the lock already
    (another delivery of the same run); nothing was changed in Redis."""


RELEASE_EXPIRED = -1
RENEW_OK, RENEW_EXPIRED, RENEW_STOLEN = 1, 0, -1
RELEASE_STOLEN = -2


def loss_reason_from_release(code: int) -> str:
    return "expired" if code == RELEASE_EXPIRED else "stolen"


def loss_reason_from_renew(code: int) -> str:
    return "expired" if code == RENEW_EXPIRED else "stolen"


# --------------------------------------------------------------------- deadlines


def server_clock_us(clock: Sequence[Any]) -> int:
    """The Redis server's clock from a ``TIME`` reply (seconds, microseconds), in whole
    microseconds since the epoch: the one reading of it on this side (the scripts' is
    ``now_us()`` in ``lua/args.lua``)."""
    seconds, micros = clock
    return int(seconds) * 1_000_000 + int(micros)


def drift_ms(lease: int) -> float:
    """Clock-drift allowance: 1% of the lease plus 2 ms (the Redlock paper's rule)."""
    return lease * 0.01 + 2.0


def validity_deadline(sent_at: float, lease: int) -> float:
    """Monotonic time after which a lease granted by a command sent at ``sent_at`` may be gone."""
    return sent_at + (lease - drift_ms(lease)) / 1000.0


def wait_bound(pttl: int, remaining: float | None) -> float:
    """How long a blocked acquire may sleep before retrying on its own.

    A release publishes a wake-up, an expiry does not, so the wait is capped by the
    holder's remaining lease and by the caller's remaining timeout.
    """
    if pttl == -2:  # vanished between check and reply: retry at once
        lease_left = 0.0
    elif pttl < 0:
        lease_left = NO_TTL_RECHECK
    else:
        # Capped too: a lock handed directly to a waiter that then died lapses after
        # GRANT_MS without any message to the waiters of other processes.
        lease_left = min(pttl / 1000.0 + 0.001, NO_TTL_RECHECK)
    return lease_left if remaining is None else max(0.0, min(lease_left, remaining))


def backoff(attempt: int, *, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [base/2, min(cap, base * 2**attempt)]."""
    high = min(cap, base * (2 ** min(attempt, 30)))
    return (rng or random).uniform(min(base / 2, high), high)


# --------------------------------------------------------------------- hold state


class LossSignal:
    """What both lease-loss views share: ``bool(lost)``, ``is_set()`` and ``reason``."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def __bool__(self) -> bool:
        return self._flag

    def _set(self, reason: str) -> None:
        """Mark lost at once (``is_set()``); waiters are woken by :meth:`_wake`."""
        self.reason = reason
        self._flag = True

    def _wake(self) -> None:
        """Wake whoever waits on it (after the on_lost callbacks ran)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} lost={self._flag} reason={self.reason!r}>"


class LeaseLost(LossSignal):
    """An event-like view of one hold's lease: set once the lease is known to be lost.

    ``bool(lock.lost)`` and ``lock.lost.is_set()`` say whether it happened,
    ``lock.lost.reason`` why, ``lock.lost.wait(timeout)`` blocks until it happens.
    """

    _events_mutex = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self._event: threading.Event | None = None  # made on first wait(): most holds never wait

    def wait(self, timeout: float | None = None) -> bool:
        timeout = optional_seconds(timeout, "timeout")
        with self._events_mutex:
            if self._event is None:
                self._event = threading.Event()
                if self._flag:
                    self._event.set()
        return self._event.wait(timeout)

    def _wake(self) -> None:
        with self._events_mutex:
            if self._event is not None:
                self._event.set()


class AsyncLeaseLost(LossSignal):
    """The asyncio lock's lease-loss view: like :class:`LeaseLost`, with ``await lost.wait()``."""

    def __init__(self) -> None:
        super().__init__()
        self._events: list[asyncio.Event] = []

    async def wait(self, timeout: float | None = None) -> bool:
        timeout = optional_seconds(timeout, "timeout")
        if self._flag:
            return True
        event = asyncio.Event()
        self._events.append(event)
        try:
            return await wait_event(event, timeout)
        finally:
            self._events.remove(event)

    def _wake(self) -> None:
        for event in self._events:
            event.set()


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task (if any) and wait until it has finished."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; True if it was set.

    Not ``asyncio.wait_for``: before Python 3.12 it swallows a cancellation that
    arrives just as the awaited thing completes, and a swallowed cancel would keep a
    cancelled ``acquire`` waiting.
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()
    return bool(done)


class Hold:
    """Local bookkeeping for one owner's hold on one lock in this process."""

    __slots__ = (
        "__weakref__",
        "acquired_at",
        "count",
        "deadline",
        "failures",
        "fenced",
        "keys",
        "lease",
        "lost",
        "next_due",
        "notify",
        "owner",
        "owner_task",
        "pid",
        "releasing",
        "renew",
        "token",
    )

    def __init__(
        self,
        keys: LockKeys,
        owner: str,
        *,
        token: int,
        lease: int,
        renew: bool,
        sent_at: float,
        lost: LossSignal,
        notify: Callable[[Hold, str], None],
        owner_task: weakref.ref[Any] | None = None,
        fenced: bool = False,
    ) -> None:
        self.keys = keys
        #: Renewals name this holding's token (a single Redis's hold: its hash keeps the
        #: token it was taken with); a later holding of the same owner is not renewed.
        self.fenced = fenced
        self.owner = owner
        #: The asyncio task a default owner names (weakly): once it is done, nobody can
        #: release the hold, so the watchdog stops renewing it (see :meth:`abandoned`).
        self.owner_task = owner_task
        self.count = 0
        self.token = token
        self.lease = lease
        self.renew = renew
        #: The process that took it (:func:`._process.current`, its pid): a forked child
        #: neither renews nor releases its parent's holds.
        self.pid = current()
        self.deadline = validity_deadline(sent_at, lease)
        self.next_due = sent_at + self.renew_interval
        self.failures = 0
        self.lost = lost
        self.notify = notify
        self.acquired_at = sent_at
        #: Releases of this hold in flight (a renewal crossing one must not cry "lost").
        self.releasing = 0

    @property
    def renew_interval(self) -> float:
        return self.lease / 3000.0

    def renewed(self, sent_at: float) -> None:
        self.deadline = validity_deadline(sent_at, self.lease)
        self.next_due = sent_at + self.renew_interval
        self.failures = 0

    def abandoned(self) -> bool:
        """Whether the asyncio task or thread that owns this hold has ended (no release is
        under way): nobody can release it any more."""
        if self.owner_task is None or self.releasing:
            return False
        owner = self.owner_task()
        if owner is None:
            return True
        try:
            if isinstance(owner, threading.Thread):
                return not owner.is_alive()
            return bool(owner.done())
        except Exception:  # never let one owner's oddity stop the watchdog
            return False

    def past_deadline(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline

    def mark_lost(self, reason: str) -> bool:
        """Record the loss once; returns False if it was already recorded."""
        if self.lost.is_set():
            return False
        self.lost._set(reason)
        try:
            self.notify(self, reason)
        finally:
            self.lost._wake()
        return True


def hold_problem(hold: object, now: float) -> str | None:
    """Why the watchdog cannot renew ``hold`` (None: it can).

    Every hold made through a lock passes (its lease was validated); this guards the
    watchdog against one that did not, so that it drops that hold alone instead of
    failing the others renewed with it.
    """
    lease = getattr(hold, "lease", None)
    if not isinstance(lease, int) or isinstance(lease, bool) or not 1 <= lease <= MAX_MS:
        return f"its lease {lease!r} is not a whole number of milliseconds from 1 to {MAX_MS}"
    for field in ("next_due", "deadline"):
        value = getattr(hold, field, None)
        if not _is_number(value) or not -math.inf < value <= now + MAX_SECONDS:  # type: ignore[operator]
            return f"its {field} {value!r} is not a time within {MAX_SECONDS} s"
    keys, owner = getattr(hold, "keys", None), getattr(hold, "owner", None)
    if not isinstance(getattr(keys, "lock", None), bytes) or not isinstance(owner, str):
        return f"its key or owner is not usable ({keys!r}, {owner!r})"
    return None


LOSS_TEXT = {
    "expired": "its lease expired in Redis before it was renewed",
    "stolen": "its lease expired and another owner now holds the lock",
    "unreachable": "Redis could not be reached to renew it before the lease's validity deadline",
    "deadline": "the lease's local validity deadline passed without a renewal",
    "released": "it was force-released",
    "unrenewable": "the watchdog could not renew it (its lease was out of range, or renewing "
    "it raised an unexpected error; logged) and stopped renewing it",
    "abandoned": "the thread or asyncio task that owned it ended without releasing it, so it "
    "was no longer renewed and expires with its lease",
}


def lost_error(name: str | bytes, owner: str, reason: str) -> LockLostError:
    text = LOSS_TEXT.get(reason, reason)
    return LockLostError(
        f"lock {name!r} held by owner {owner!r} was lost: {text}; the protected work may "
        f"have overlapped with another holder (use the fencing token to reject stale writes)",
        name=name,
        owner=owner,
        reason=reason,
    )


def batched(items: Sequence[Hold], size: int) -> Iterator[Sequence[Hold]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def renew_args(holds: Sequence[Hold]) -> tuple[list[bytes], list[Any]]:
    """renew.lua's KEYS and ARGV for ``holds``: owner, lease and (fenced holds) token each."""
    keys = [h.keys.lock for h in holds]
    args: list[Any] = []
    for h in holds:
        args += (h.owner, h.lease, h.token if h.fenced else "")
    return keys, args
