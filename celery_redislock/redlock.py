"""The quorum lock over N independent Redis masters: :class:`RedLock`.

The same public API as :class:`~celery_redislock.RedisLock` (reentrant, owner-checked,
fenced, self-renewing, woken on release), with every operation sent to all N nodes
in parallel and decided by a majority (see :mod:`celery_redislock._quorum` for the
rules). It keeps working while a majority of the nodes runs. Its asyncio twin,
:class:`~celery_redislock.aio_redlock.AsyncRedLock` (re-exported here), shares every
decision through :mod:`celery_redislock._quorum_runtime`; this module only drives the
I/O on threads.

Fencing tokens stay strictly increasing across nodes: an acquisition takes the
highest of the tokens its majority handed out and writes it back to every node's
counter (set-if-greater) before it counts as acquired, so any later majority
includes a node that has seen it. This needs the fence counters to survive a node's
restart (AOF persistence on every node); see docs/guarantees.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._base import LockBase, SyncContext
from ._core import (
    DEFAULT_PREFIX,
    Hold,
    LeaseLost,
    LockKeys,
    decode_acquire,
    lease_ms,
    thread_owner,
    validate_prefix,
)
from ._errors import LockQuorumError
from ._private_clients import bounded_client
from ._process import ProcessRegistry
from ._quorum import (
    Decided,
    QuorumAcquire,
    Round,
    answered,
    decided_by,
    given_back,
    granted,
    renewed,
    tally_acquire,
    validate_nodes,
)
from ._quorum_runtime import (
    NODE_TIMEOUT,
    RETRY_DELAY,
    MultiWaiterBase,
    QuorumBase,
    majority_remaining,
    round_of,
)
from ._renewal import scheduler_for
from ._replies import decode_release
from ._scripts import scripts_for
from ._waiting import subscriber_for
from .aio_redlock import AsyncRedLock

__all__ = ["NODE_TIMEOUT", "RETRY_DELAY", "AsyncRedLock", "RedLock"]


#: This process's thread pools, by kind (a forked child starts its own).
_executors: ProcessRegistry[str, concurrent.futures.ThreadPoolExecutor]
_executors = ProcessRegistry(weak=False)


def _threads(kind: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    return _executors.get(
        kind,
        lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"redislock-quorum-{kind}"
        ),
    )


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The rounds' requests, one per node."""
    return _threads("round", 32)


def _subscriptions() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that subscribe waiters to each node, apart from the rounds' pool: a
    subscription to a stalled node may block (connecting under its subscriber's lock)
    until the node answers, and must not take a worker the rounds need."""
    return _threads("subscribe", 8)


class RedLock(QuorumBase, LockBase[LeaseLost], SyncContext):
    """A reentrant, owner-checked, fenced lock over N independent Redis masters.

    Args:
        clients: one ``redis.Redis`` client (or ``redis://`` URL) per independent master.
            An odd number (3 or 5) is recommended; 1 is allowed (then it is a
            :class:`RedisLock` with extra steps).
        name: the lock's name.
        ttl, owner, auto_renew, blocking, timeout, prefix: as for :class:`RedisLock`.
        node_timeout: how long one request to one node may take (seconds, default
            0.25); a node slower than that counts as failed for that attempt.
        retry_delay: after a split vote (some nodes granted it, not a majority), wait a
            random time up to this long before retrying (seconds, default 0.1).

    Raises :class:`LockQuorumError` (a :class:`LockTimeoutError`) when fewer than a
    majority of the nodes answer, naming each node that failed and why.
    """

    _signal_type = LeaseLost

    def _default_owner(self) -> str:
        return thread_owner()

    # -- one round to every node ---------------------------------------------

    def _round(self, call: Callable[[int], Any], decided: Decided | None = None) -> Round:
        """Send to every node at once; return when ``decided`` (a majority agrees, either
        way), when all answered, or at the node timeout. Requests still in flight then
        finish in the background (a late release still lands)."""
        futures = [_pool().submit(call, i) for i in range(len(self._fast))]
        deadline = time.monotonic() + self.node_timeout + 0.05
        pending: set[Any] = set(futures)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = concurrent.futures.wait(
                pending, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED
            )
            if pending and decided and decided(round_of(futures, self._labels)):
                break
        return round_of(futures, self._labels)

    # -- acquire / release -----------------------------------------------------

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, lease: float | None = None
    ) -> bool:
        """Take the lock on a majority of the nodes (or re-enter it); True on success.

        Same arguments as :meth:`RedisLock.acquire`. Raises :class:`LockQuorumError` when
        fewer than a majority of the nodes answer an attempt.
        """
        wait_limit, lease_millis, renew = self._acquire_args(blocking, timeout, lease)
        owner = self._current_owner()
        started = time.monotonic()
        outcome = self._try(owner, lease_millis, renew)
        if outcome is None:
            return True
        self._contended(owner)
        if not blocking:
            return False
        deadline = None if wait_limit is None else started + wait_limit
        with _MultiWaiter(self.clients, self.keys.channel, owner) as waiter:
            while True:
                step = self._next_wait(outcome, deadline)
                if step is None:
                    return False
                pause, bound = step
                if pause:
                    time.sleep(pause)
                else:
                    waiter.wait(bound)
                waiter.mark()
                outcome = self._try(owner, lease_millis, renew, started)
                if outcome is None:
                    return True

    def _try(
        self, owner: str, lease: int, renew: bool, started: float | None = None
    ) -> QuorumAcquire | None:
        """One attempt on every node: None if acquired, else what the nodes said."""
        running, within = self._still_undoing(owner)
        if running:
            concurrent.futures.wait(running, timeout=within)
        fresh = self._begin_attempt(owner)
        sent_at = time.monotonic()
        keys, argv = self._numbered(owner, fresh, lease)
        round_ = self._round(
            lambda i: self._node_scripts[i].acquire(keys=keys, args=argv),
            decided_by(granted, self.quorum),
        )
        try:
            outcome, acquired, write_back = self._settle_acquire(owner, round_, fresh)
        except LockQuorumError:
            self._undo(owner, tally_acquire(round_.replies, decode_acquire), fresh, round_)
            raise
        if write_back:
            acquired = self._write_back(outcome.token)
        parts = self._take(owner, outcome, acquired, sent_at, lease, renew, started)
        if parts is not None:
            for node, part in parts:
                scheduler_for(self.clients[node]).add(part)
            return None
        self._undo(owner, outcome, fresh, round_)
        return self._refused(outcome, acquired)

    def _giving_back(self, owner: str, keys: list[Any], args: list[Any]) -> Callable[[int], Any]:
        """A round's call that gives back on one node; a give-back of everything first
        voids the owner's attempts that node never answered (they may land later)."""
        silent, (void, number, lifetime) = self._voids_first(owner, args)

        def call(i: int) -> Any:
            if i in silent:
                self._fast[i].set(void, number, px=lifetime)
            return self._node_scripts[i].release(keys=keys, args=args)

        return call

    def _write_back(self, token: int) -> bool:
        """Raise every node's fence counter to ``token`` (a majority must confirm)."""
        keys = [self.keys.fence]
        round_ = self._round(
            lambda i: self._node_scripts[i].fence(keys=keys, args=[token]),
            decided_by(answered, self.quorum),
        )
        return len(round_.answered()) >= self.quorum

    def _undo(self, owner: str, outcome: QuorumAcquire, fresh: bool, round_: Round) -> None:
        """Give back what a failed attempt took (see :meth:`_undo_plan`), in the
        background: a stalled node must not delay the caller again. Each give-back waits
        for that node's acquire request, if it is still running, so it lands after it."""
        nodes, args = self._undo_plan(owner, outcome, fresh)
        keys = self.keys.release_keys()
        futures = round_.sources
        void, number, lifetime = self._void(owner)

        def give_back(node: int) -> Any:
            concurrent.futures.wait([futures[node]], timeout=self.node_timeout * 2)
            if self._may_land(futures[node]):
                # Its acquire may still land: void it there first (then nothing is left).
                self._fast[node].set(void, number, px=lifetime)
            if node not in nodes:
                return None
            return self._node_scripts[node].release(keys=keys, args=args)

        self._track(owner, [_pool().submit(give_back, node) for node in range(len(futures))])

    def release(self) -> None:
        """Give back one hold on every node; the last one frees the lock.

        Raises :class:`LockLostError` when a majority no longer had the hold, and
        :class:`LockQuorumError` when too few nodes answered to tell: the release still
        lands on each silent node when it answers (or the lease ends there), and the
        hold is no longer this object's.
        """
        owner = self._current_owner()
        self._check_not_inherited(owner)
        hold = self._holds.get(owner)
        keys = self.keys.release_keys()
        args = self._release_args(owner, hold)
        valid = self._valid(hold)
        self._ack_releasing(hold, 1)
        try:
            round_ = self._round(
                self._giving_back(owner, keys, args), decided_by(given_back, self.quorum)
            )
        finally:
            self._ack_releasing(hold, -1)
        self._settle_release(owner, hold, round_, valid)

    def extend(self, ttl: float) -> None:
        """Replace the calling owner's lease with ``ttl`` seconds on every node (quorum rule)."""
        lease = lease_ms(ttl, "ttl")
        owner = self._current_owner()
        self._check_not_inherited(owner)
        sent_at = time.monotonic()
        keys = [self.keys.lock]
        round_ = self._round(
            lambda i: self._node_scripts[i].renew(keys=keys, args=[owner, lease, ""]),
            decided_by(renewed, self.quorum),
        )
        self._settle_extend(owner, round_, lease, sent_at)

    def _unschedule(self, hold: Hold) -> None:
        group = self._groups.pop(id(hold), None)
        if group is not None:
            for node, part in group.parts:
                scheduler_for(self.clients[node]).remove(part)

    # -- queries ---------------------------------------------------------------

    def _pttls(self) -> Round:
        return self._round(lambda i: int(self._fast[i].pttl(self.keys.lock)))

    def locked(self) -> bool:
        """Whether a majority of the nodes shows the lock held (by anyone)."""
        round_ = self._pttls()
        return sum(1 for i in round_.answered() if round_.replies[i] != -2) >= self.quorum

    def owned(self) -> bool:
        """Whether a majority of the nodes shows the calling owner's hold."""
        owner = self._current_owner()
        round_ = self._round(lambda i: bool(self._fast[i].hexists(self.keys.lock, owner)))
        return sum(1 for i in round_.answered() if round_.replies[i]) >= self.quorum

    def remaining(self) -> float | None:
        """Seconds until fewer than a majority of the nodes hold the lock (None: not locked)."""
        return majority_remaining(self._pttls(), self.quorum)

    @staticmethod
    def force_release(
        clients: Sequence[Any], name: str | bytes, *, prefix: str = DEFAULT_PREFIX
    ) -> bool:
        """Operator's tool: delete the lock on every node whoever holds it; True if any had it."""
        keys = LockKeys.for_name(name, validate_prefix(prefix)).release_keys()
        deleted = False
        for client in validate_nodes(clients):
            with contextlib.suppress(Exception):
                node = (
                    bounded_client(client, 1.0, asyncio_client=False)
                    if isinstance(client, str)
                    else client
                )
                deleted |= (
                    decode_release(scripts_for(node).release(keys=keys, args=["", "force"])) == 0
                )
        return deleted


class _MultiWaiter(MultiWaiterBase):
    """:class:`MultiWaiterBase` for threads: each node's subscription is made on a
    thread of its own pool; ``with`` enters the channels and leaves them."""

    def __init__(self, clients: Sequence[Any], channel: bytes, owner: str) -> None:
        super().__init__(clients, channel, owner)
        self._event: threading.Event = threading.Event()

    def __enter__(self) -> _MultiWaiter:
        for client in self._clients:
            _subscriptions().submit(self._subscribe, client)
        return self

    def _subscribe(self, client: Any) -> None:
        subscriber = subscriber_for(client)
        waiter = self._waiter_of(subscriber)
        waiter._channel = subscriber._register(self._channel, waiter)
        self._adopt(subscriber, waiter)

    def __exit__(self, *exc: object) -> None:
        self.exit()

    def wait(self, timeout: float) -> bool:
        timeout = self._bound(timeout)
        woken = self._event.wait(timeout) if timeout > 0 else self._event.is_set()
        self._rearm()
        return woken
