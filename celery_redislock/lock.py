"""How a lock is taken: :class:`RedisLock`, the synchronous reentrant fenced lock.

Guarantees with one Redis server (see docs/guarantees.md for replicas and quorum):

* at most one owner holds a lock while its lease is valid; an owner that stops
  renewing loses the lock when the lease expires, so a crashed holder never
  deadlocks anyone;
* release and extend are owner-checked: nobody deletes another owner's hold;
* fencing tokens are strictly increasing per lock name, so a protected resource
  that checks them (see :mod:`celery_redislock.fencing`) rejects a holder whose
  lease expired while it was paused;
* a lost lease is reported (``lost``, ``on_lost``, ``ensure_held()``), never silent.

Not guaranteed: that work inside the lock stops when the lease is lost — the lock
cannot stop a paused process; use the fencing token for that.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from redis.exceptions import RedisError

from ._base import SyncContext
from ._core import (
    DEFAULT_PREFIX,
    Hold,
    LeaseLost,
    lease_ms,
    thread_owner,
)
from ._deferred import UNREACHABLE, deferred_releases
from ._lone_waiter import waiter_for
from ._process import is_current
from ._renewal import RenewalScheduler, scheduler_for
from ._replies import decode_release, decode_renew_one
from ._scripts import run, scripts_for
from ._single import SingleBase

log = logging.getLogger(__name__)


def _owner_thread() -> threading.Thread | None:
    """The calling thread, if the watchdog can tell when it ends: not a thread Python did
    not start (a greenlet under gevent or eventlet, a foreign thread), whose "alive" is
    not known."""
    thread = threading.current_thread()
    return None if isinstance(thread, threading._DummyThread) else thread


class SyncSingle(SingleBase[LeaseLost], SyncContext):
    """The synchronous driver of a lock on one Redis: :class:`RedisLock`, and
    :class:`~celery_redislock.RedisSemaphore` (which supplies its own scripts, keys and
    reply decoder through the hooks of ``SingleBase``/``LockBase``)."""

    _signal_type = LeaseLost
    _cached_scheduler: RenewalScheduler | None = None

    def _default_owner(self) -> str:
        return thread_owner()

    def _scheduler(self) -> RenewalScheduler:
        # Cached per process: a forked child must get (and cache) its own.
        cached = self._cached_scheduler
        if cached is None or not is_current(cached.pid):
            cached = self._cached_scheduler = scheduler_for(self.client)
        return cached

    def _renewals(self) -> RenewalScheduler:
        return self._scheduler()

    def _unschedule(self, hold: Hold) -> None:
        if hold.renew:
            self._scheduler().remove(hold)

    # -- acquire / release -----------------------------------------------------

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, lease: float | None = None
    ) -> bool:
        """Take the lock (or re-enter it); True on success.

        Args:
            blocking: wait while another owner holds it (False: one attempt).
            timeout: seconds to wait at most (None: until acquired).
            lease: a fixed lease in seconds for this hold, not renewed (default: the
                lock's ``ttl``, renewed while held if ``auto_renew``).

        Returns False when not acquired in time. Waiting is woken by the holder's
        release (pub/sub), never by polling; an expired holder is noticed when its
        remaining lease, fetched with each attempt, runs out (a waiter re-checks at
        least every 5 s).

        A release hands the lock to the first waiter in line. A watchdog-renewed
        waiter with the default owner (the calling thread), on one Redis (no cluster,
        no ``min_replicas``), is granted it *directly*:
        only its process is woken, with the fencing token, and the acquire returns
        without another round trip. The grant's lease is short (2 s from the release,
        or ``ttl`` if shorter), so a waiter that died in line cannot keep the lock; the
        watchdog's first renewal, due well inside it, gives the hold its full lease.
        The grant is dated from the waiter's latest attempt: one that comes more than
        about 1 s after it (half the grant's lease, less the drift allowance) is taken
        with a round trip instead, as is any grant without direct grants.
        """
        wait_limit, lease_millis, renew = self._acquire_args(blocking, timeout, lease)
        owner = self._current_owner()
        started = time.monotonic()
        # A lock whose last blocked acquire had to wait joins the line with its first attempt
        # (it would most likely be refused alone): one round trip less per contended acquire.
        in_line_first = self._joins_line_first(blocking, owner)
        if not in_line_first:
            if self._try(owner, lease_millis, renew) is True:
                return True
            self._contended(owner)
            if not blocking:
                return False
        deadline = None if wait_limit is None else time.monotonic() + wait_limit
        acquired = False
        direct = self._direct(renew)
        thread = _owner_thread() if direct else None
        with waiter_for(self.client, self.keys.channel, owner, wait_limit, lone=direct) as waiter:
            direct = direct and waiter.direct
            pttl = 0  # the holder's lease at the last attempt (how long our place is kept)
            try:
                while True:
                    sent_at = time.monotonic()
                    wake = waiter.next_wake_id() if direct else None
                    outcome = self._try(
                        owner,
                        lease_millis,
                        renew,
                        started,
                        line=True,
                        wake=wake,
                        first=in_line_first,
                    )
                    self._answered_in_line(owner, in_line_first, outcome is True)
                    in_line_first = False
                    if outcome is True:
                        acquired = True
                        return True
                    pttl = outcome
                    bound = self._wait_for(outcome, deadline)
                    if bound is None:
                        return False
                    # A direct grant's hold is built before the wait, not after waking.
                    grant = (
                        self._grant_hold(owner, sent_at, lease_millis, thread) if direct else None
                    )
                    waiter.wait(bound)
                    token = waiter.take_grant()
                    if (
                        token is not None
                        and grant is not None
                        and self._take_grant(grant, token, started)
                    ):
                        acquired = True
                        return True
            finally:
                if not acquired:
                    self._leave_line(owner, waiter.grant_name if direct else None, pttl)

    def _leave_line(self, owner: str, grant_name: bytes | None = None, pttl: int = 0) -> None:
        """Give up a place in line (and pass on a lock granted to us meanwhile; granted
        directly, to the wait ``grant_name``)."""
        try:
            self._scripts.release(
                keys=self.keys.release_keys(), args=self._leave_args(owner, grant_name)
            )
        except RedisError as exc:  # the place lapses by itself: LINE_MARGIN_MS past the lease
            log.debug("redislock: could not leave the line of %r: %r", self.name, exc)
            self._abandoned(owner, grant_name, pttl)

    def _try(
        self,
        owner: str,
        lease: int,
        renew: bool,
        started: float | None = None,
        *,
        line: bool = False,
        wake: bytes | None = None,
        first: bool = False,
    ) -> bool | int:
        """One attempt: True if acquired, else ms to wait at most (the holder's lease).

        ``line=True`` (a blocked acquire) joins the line of waiters when contended;
        ``wake`` (its waiter's wake id) asks for a direct grant.
        """
        sent_at = time.monotonic()
        argv = self._attempt_argv(owner, lease, line, wake, first)
        acks: Any = None
        if self.min_replicas:
            raw, acks = self._replicated(self._scripts.acquire, self._acquire_keys(), argv)
        else:
            raw = run(self.client, self._scripts.acquire, self._acquire_keys(), argv)
        reply = self._decode_acquire(raw)
        if not reply.acquired:
            return self._refused_wait(reply)
        if self.min_replicas and self._unreplicated(acks):
            self._give_back(owner)
            raise self._replication_error(acks, "acquire", owner, self._connected_replicas())
        thread = _owner_thread() if self.owner is None else None
        hold = self._held(owner, reply, sent_at, lease, renew, started, thread)
        if hold is not None:
            self._scheduler().add(hold)
        return True

    def _replicated(self, script: Any, keys: list[Any], args: list[Any]) -> tuple[Any, Any]:
        """(script reply, WAIT reply) in one round trip (the script reloaded on NOSCRIPT)."""
        for attempt in range(2):
            pipe = self._replicated_pipeline(self.client.pipeline(False), script, keys, args)
            reply, acks = pipe.execute(raise_on_error=False)
            if self._reload_first(reply, attempt):
                self.client.script_load(script.script)
                continue
            return reply, acks
        raise AssertionError("unreachable")  # pragma: no cover

    def _give_back(self, owner: str) -> None:
        """Undo an acquire the replicas did not acknowledge (owner-checked, one hold)."""
        try:
            self._scripts.release(keys=self.keys.release_keys(), args=[owner])
        except RedisError as exc:  # the hold's lease ends it
            self._give_back_failed(exc)

    def _connected_replicas(self) -> int | None:
        try:
            return self._replica_count(self.client.info("replication"))
        except RedisError:
            return None

    def release(self) -> None:
        """Give back one hold of the calling owner; the last one frees the lock.

        Raises:
            LockLostError: the lease was lost before the release (the work it
                protected may have overlapped another holder's).
            LockNotOwnedError: the caller does not hold the lock; nothing changed.
            LockForkedError: the hold belongs to the parent of this forked process.
            redis.exceptions.ConnectionError: Redis unreachable while releasing an
                inner (re-entered) hold: it is kept, still renewed, and the call can be
                retried.

        When Redis cannot be reached to release this object's *last* hold, the call
        does not raise: the hold stops being renewed at once (its lease ends it at the
        latest), ``lock_release_failed`` is sent, and the release is retried in the
        background until Redis answers or the hold's validity deadline passes.
        """
        owner = self._current_owner()
        self._check_not_inherited(owner)
        hold = self._holds.get(owner)
        if hold is not None:
            hold.releasing += 1
        try:
            code = decode_release(
                run(
                    self.client,
                    self._scripts.release,
                    self._release_keys,
                    self._with_tail((owner,)),
                )
            )
        except UNREACHABLE as exc:
            retry = self._release_unreachable(owner, hold, exc)
            if retry is None:
                return
            what, retry_args = retry
            assert hold is not None
            deferred_releases().add(
                what,
                lambda: run(self.client, self._scripts.release, self._release_keys, retry_args),
                until=hold.deadline,
                key=(self.keys.lock, owner),
            )
            return
        finally:
            if hold is not None:
                hold.releasing -= 1
        self._record_released(owner, code)

    def extend(self, ttl: float) -> None:
        """Replace the lease of the calling owner's hold with ``ttl`` seconds from now.

        Owner-checked; never recreates an expired lock. Later watchdog renewals use
        the new lease. Raises :class:`LockLostError` if the hold is already gone.
        """
        lease = lease_ms(ttl, "ttl")
        owner = self._current_owner()
        self._check_not_inherited(owner)
        sent_at = time.monotonic()
        if self.min_replicas:
            codes, acks = self._replicated(
                self._scripts.renew, [self._hold_keys(owner).lock], self._extend_args(owner, lease)
            )
            if self._extend_unreplicated(decode_renew_one(codes), acks):
                raise self._replication_error(acks, "extend", owner, self._connected_replicas())
        else:
            codes = self._scripts.renew(
                keys=[self._hold_keys(owner).lock], args=self._extend_args(owner, lease)
            )
        self._record_extended(owner, decode_renew_one(codes), lease, sent_at)

    def owned(self) -> bool:
        """Whether the calling owner holds the lock (server-side)."""
        owner = self._current_owner()
        return bool(self.client.hexists(self._hold_keys(owner).lock, owner))


class RedisLock(SyncSingle):
    """A reentrant, owner-checked, fenced lock on one Redis server.

    Args:
        client: a ``redis.Redis`` client, a Sentinel ``master_for`` client, or a
            ``redis.cluster.RedisCluster`` (Redis 7+: wake-ups use sharded pub/sub).
        name: the lock's name (str or bytes, non-empty).
        ttl: lease in seconds. With ``auto_renew`` the watchdog renews it every
            ``ttl / 3`` while held; without, the hold ends after ``ttl``.
        owner: who holds it. ``None`` (default) means the calling thread; pass a
            string (a task id, say) to share one hold across threads or processes.
        auto_renew: renew the lease in the background while held (default True).
        blocking: default for the context-manager form (``with lock:``).
        timeout: default wait limit of the context-manager form (None: no limit).
        prefix: key prefix; a lock uses ``<prefix>{<name>}`` and two keys beside it.
        min_replicas: 0 (default) or how many replicas must acknowledge each acquire,
            extend and renewal (``WAIT``, sent in the same round trip as the script).
            An acquire they do not acknowledge is given back and raises
            :class:`LockReplicationError`; an unacknowledged renewal does not move the
            hold's validity deadline. Not available with Redis Cluster clients.
        replica_timeout: seconds the ``WAIT`` may block (default 0.5; at least 1 ms).
    """

    # -- queries ---------------------------------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds the lock (server-side)."""
        return bool(self.client.exists(self.keys.lock))

    def remaining(self) -> float | None:
        """Seconds left on the current lease, whoever holds it (None: not locked)."""
        return self._seconds_left(int(self.client.pttl(self.keys.lock)))

    @staticmethod
    def force_release(client: Any, name: str | bytes, *, prefix: str = DEFAULT_PREFIX) -> bool:
        """Operator's tool: delete the lock whoever holds it and wake its waiters.

        The evicted holder learns of it at its next renewal (``lost`` with reason
        "expired"). Returns whether a lock was deleted.
        """
        keys = RedisLock._force_keys(name, prefix)
        code = scripts_for(client).release(keys=keys, args=["", "force"])
        return decode_release(code) == 0
