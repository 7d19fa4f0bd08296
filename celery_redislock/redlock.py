"""The quorum lock over N independent Redis masters: :class:`RedLock` and :class:`AsyncRedLock`.

The same public API as :class:`~celery_redislock.RedisLock` (reentrant, owner-checked,
fenced, self-renewing, woken on release), with every operation sent to all N nodes
in parallel and decided by a majority (see :mod:`celery_redislock._quorum` for the
rules). It keeps working while a majority of the nodes runs.

Fencing tokens stay strictly increasing across nodes: an acquisition takes the
highest of the tokens its majority handed out and writes it back to every node's
counter (set-if-greater) before it counts as acquired, so any later majority
includes a node that has seen it. This needs the fence counters to survive a node's
restart (AOF persistence on every node); see docs/guarantees.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from ._base import AsyncContext, LockBase, SyncContext
from ._core import (
    DEFAULT_PREFIX,
    MAX_MS,
    AsyncLeaseLost,
    Hold,
    LeaseLost,
    LockKeys,
    OwnerFinished,
    OwnerRunning,
    decode_acquire,
    lease_ms,
    seconds,
    thread_owner,
    validate_prefix,
    wait_bound,
    wait_event,
)
from ._errors import LockConfigurationError, LockQuorumError
from ._nodes import check_distinct, node_label
from ._quorum import (
    Decided,
    HoldGroup,
    NodeHold,
    NoReply,
    QuorumAcquire,
    Round,
    answered,
    attempt_valid,
    decided_by,
    given_back,
    granted,
    quorum_error,
    quorum_of,
    release_code,
    renew_code,
    renewed,
    tally_acquire,
    validate_nodes,
)
from ._renewal import async_scheduler_for, scheduler_for
from ._replies import decode_release
from ._scripts import scripts_for
from ._waiting import UNCONFIRMED_POLL, async_subscriber_for, subscriber_for
from .aio import Caller, caller, owner_turns, task_owner, to_completion

T = TypeVar("T")

#: Default per-node timeout of one request (seconds): small next to any sensible ttl.
NODE_TIMEOUT = 0.25
#: Default ceiling of the random delay before retrying after a split vote (seconds).
RETRY_DELAY = 0.1


def _bounded(client: Any, timeout: float, *, asyncio_client: bool) -> Any:
    """A client on a private pool whose socket timeouts are ``timeout``: a stalled node
    costs one attempt ``timeout`` at most, never a hung call."""
    if isinstance(client, str):
        if asyncio_client:
            import redis.asyncio

            return redis.asyncio.Redis.from_url(
                client,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=AsyncRetry(NoBackoff(), 0),
            )
        import redis

        return redis.Redis.from_url(
            client,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["socket_timeout"] = min(kwargs.get("socket_timeout") or timeout, timeout)
    kwargs["socket_connect_timeout"] = min(kwargs.get("socket_connect_timeout") or timeout, timeout)
    # One attempt per node per round: a stalled node costs ``timeout`` once, not 3 times.
    kwargs["retry"] = (AsyncRetry if asyncio_client else Retry)(NoBackoff(), 0)
    own = type(pool)(connection_class=pool.connection_class, **kwargs)
    return type(client)(connection_pool=own)


class _QuorumBase:
    """Node set, timeouts and the per-node holds: what both quorum locks share."""

    clients: tuple[Any, ...]
    client: Any
    _fast: list[Any]
    _node_scripts: list[Any]
    quorum: int
    node_timeout: float
    retry_delay: float
    _labels: list[str]
    _groups: dict[int, HoldGroup]
    #: Per owner: give-backs still in flight (futures or tasks) and when they were sent.
    _undoing: dict[str, list[tuple[Any, float]]]
    _undoing_mutex: threading.Lock

    #: The twin's client kind (redis.asyncio for AsyncRedLock).
    _asyncio_clients = False

    def __init__(
        self,
        clients: Sequence[Any],
        name: str | bytes,
        *,
        ttl: float = 30.0,
        owner: str | None = None,
        auto_renew: bool = True,
        blocking: bool = True,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        node_timeout: float | None = None,
        retry_delay: float = RETRY_DELAY,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]  # LockBase, next in either twin's MRO
            clients,
            name,
            ttl=ttl,
            owner=owner,
            auto_renew=auto_renew,
            blocking=blocking,
            timeout=timeout,
            prefix=prefix,
        )
        self._setup_nodes(clients, node_timeout, retry_delay, asyncio_client=self._asyncio_clients)

    def _setup_nodes(
        self, clients: Any, node_timeout: float | None, retry_delay: float, *, asyncio_client: bool
    ) -> None:
        """Validate the nodes and options; open the private per-node clients."""
        nodes = validate_nodes(clients)
        check_distinct(nodes, "clients")
        ttl = self._lease / 1000.0  # type: ignore[attr-defined]
        timeout = seconds(NODE_TIMEOUT if node_timeout is None else node_timeout, "node_timeout")
        if timeout * 2 >= ttl:
            raise LockConfigurationError(
                f"node_timeout ({timeout}s) must be well below ttl ({ttl}s): an attempt that "
                f"takes longer than the lease can never be valid (use at most ttl / 10)"
            )
        self.node_timeout = timeout
        self.retry_delay = seconds(retry_delay, "retry_delay", low=0.0)
        self.quorum = quorum_of(len(nodes))
        self._fast = [_bounded(c, self.node_timeout, asyncio_client=asyncio_client) for c in nodes]
        # The caller's clients (for waiting and renewal); a URL's client is the private one.
        self.clients = tuple(
            self._fast[i] if isinstance(c, str) else c for i, c in enumerate(nodes)
        )
        self.client = self.clients
        self._labels = [node_label(c) for c in self._fast]
        self._node_scripts = [scripts_for(c) for c in self._fast]
        self._groups = {}
        # Late arrivals: each attempt is numbered, and a node whose reply to one never came
        # may still run it later (a slow node, a timed-out socket). Before giving back to
        # such a node, the sender voids its attempts there: acquire.lua refuses any attempt
        # whose number is not above the void record (see _void_record).
        self._numbers = itertools.count(1)
        self._sent: dict[str, int] = {}
        self._unanswered: dict[str, set[int]] = {}
        self._void_nonce = uuid.uuid4().hex
        # Give-backs still in flight (a failed attempt's undo, the slowest nodes' share of a
        # release): the owner's next attempt waits for them, so a late "give back
        # everything" cannot land on top of its new grant.
        self._undoing = {}
        self._undoing_mutex = threading.Lock()

    def _retry_pause(self, outcome: QuorumAcquire | None) -> float:
        """After a split vote (or with no holder to wait for), a random delay; otherwise
        none: the wait for the holder's release (bounded by its lease) follows."""
        if outcome is not None and (outcome.split or outcome.pttl == 0):
            return random.uniform(0, self.retry_delay)
        return 0.0

    def _begin_attempt(self, owner: str) -> bool:
        """Whether this attempt is fresh (no hold here); a hold already known lost is
        dropped first, so taking the lock again starts over with a new token."""
        hold = self._live_hold(owner)  # type: ignore[attr-defined]
        if hold is not None and hold.lost.is_set():
            self._forget(hold)  # type: ignore[attr-defined]
            hold = None
        return hold is None

    def _attempt_argv(self, owner: str, lease: int, fresh: bool) -> list[Any]:
        """A fresh attempt asks every node for a new token, re-entry or not: the highest
        token of its majority must be newer than any written back before it, and a node
        re-entered (a leftover of this owner's earlier attempt) would return an old one."""
        return [owner, lease, "", "new-token"] if fresh else [owner, lease]

    def _numbered(self, owner: str, fresh: bool, lease: int) -> tuple[list[bytes], list[Any]]:
        """acquire.lua's keys and ARGV for the next attempt: numbered (ARGV[8]), with this
        sender's void record for the owner as the last key."""
        number = next(self._numbers)
        self._sent[owner] = number
        argv = self._attempt_argv(owner, lease, fresh)
        argv += [""] * (7 - len(argv))
        keys = self._acquire_keys()  # type: ignore[attr-defined]
        return [*keys, self.keys.void(self._void_nonce, owner)], [*argv, number]  # type: ignore[attr-defined]

    def _unanswered_in(self, owner: str, replies: Sequence[Any]) -> None:
        """Remember the nodes whose acquire reply never came (it may land later)."""
        silent = {i for i, reply in enumerate(replies) if isinstance(reply, BaseException)}
        if silent:
            self._unanswered.setdefault(owner, set()).update(silent)

    def _void(self, owner: str) -> tuple[bytes, int, int]:
        """(void record key, last attempt number sent, lifetime in ms) of the owner here:
        acquire.lua refuses an attempt numbered at most what the record holds."""
        lifetime = min(self._lease * 2 + int(self.node_timeout * 4000), MAX_MS)  # type: ignore[attr-defined]
        return self.keys.void(self._void_nonce, owner), self._sent.get(owner, 0), lifetime  # type: ignore[attr-defined]

    def _undo_plan(
        self, owner: str, outcome: QuorumAcquire | None, fresh: bool
    ) -> tuple[list[int], list[Any]]:
        """Which nodes a failed attempt gives back to, and how: a fresh one gives back
        whatever this owner has there (including a grant that may land late), a re-entry
        only the hold it added."""
        if outcome is None:
            nodes = set(range(len(self._fast)))
        else:
            nodes = set(outcome.granted) | (set(outcome.unknown) if fresh else set())
        return sorted(nodes), [owner, "all" if fresh else "one"]

    def _track(self, owner: str, running: Sequence[Any]) -> None:
        if running:
            now = time.monotonic()
            with self._undoing_mutex:
                self._undoing.setdefault(owner, []).extend((r, now) for r in running)

    def _still_undoing(self, owner: str) -> tuple[list[Any], float]:
        """The owner's give-backs still running, and how long to wait for them at most
        (until each could have timed out at its node)."""
        with self._undoing_mutex:
            entries = [(r, at) for r, at in self._undoing.pop(owner, []) if not r.done()]
            if entries:
                self._undoing[owner] = entries
        if not entries:
            return [], 0.0
        latest = max(at for _, at in entries)
        return [r for r, _ in entries], max(0.0, latest + self.node_timeout * 2 - time.monotonic())

    def _settle_acquire(self, owner: str, round_: Round, fresh: bool) -> tuple[QuorumAcquire, bool]:
        """(what the nodes said, granted by a majority?); raises if too few answered."""
        outcome = tally_acquire(round_.replies, decode_acquire)
        if len(round_.answered()) < self.quorum:
            raise quorum_error(self.name, owner, "acquire", round_, self.quorum)  # type: ignore[attr-defined]
        return outcome, outcome.taken(self.quorum)

    @staticmethod
    def _valid(hold: Hold | None) -> bool:
        """Whether a hold is still valid here (checked before a release is sent)."""
        return hold is not None and not hold.lost.is_set() and not hold.past_deadline()

    def _settle_release(self, owner: str, hold: Hold | None, round_: Round, valid: bool) -> None:
        self._track(owner, round_.pending)  # the slowest nodes' give-backs still running
        last = hold is None or hold.count <= 1
        code = release_code(round_, self.quorum, valid=valid, last=last)
        if code is None:
            raise self._unclear_release(owner, round_)
        self._record_released(owner, code)  # type: ignore[attr-defined]

    def _settle_extend(self, owner: str, round_: Round, lease: int, sent_at: float) -> None:
        code = renew_code(round_, self.quorum)
        if code is None:
            raise quorum_error(self.name, owner, "extend", round_, self.quorum)  # type: ignore[attr-defined]
        if code == 1 and not attempt_valid(sent_at, lease):
            code = 0
        self._record_extended(owner, code, lease, sent_at)  # type: ignore[attr-defined]
        hold = self._holds.get(owner)  # type: ignore[attr-defined]
        group = None if hold is None else self._group_of(hold)
        if group is not None:
            group.extended(round_.replies, lease, sent_at)

    def _group_of(self, hold: Hold) -> HoldGroup | None:
        return self._groups.get(id(hold))

    def _start_group(
        self, hold: Hold, outcome: QuorumAcquire, sent_at: float, signal: type[Any]
    ) -> list[tuple[int, NodeHold]]:
        """One watchdog-renewed part per node that granted the hold, and per node whose
        reply had not come (its grant may land late): those count only once a renewal
        confirms them, and a renewal that finds nothing drops them."""
        group = HoldGroup(hold, self.quorum, signal)
        for node in outcome.granted:
            group.add(node, sent_at)
        for node in outcome.unknown:
            part = group.add(node, sent_at)
            part.deadline = 0.0  # not counted until confirmed
            part.next_due = time.monotonic() + self.node_timeout
        self._groups[id(hold)] = group
        group.refresh()
        return group.parts

    def _unclear_release(self, owner: str, round_: Round) -> Exception:
        """Too few nodes answered a release to tell. The requests still in flight land
        when their nodes answer, and the rest expires with the lease: a retried release
        could not tell either, so the hold is given up here and the caller told."""
        hold = self._holds.get(owner)  # type: ignore[attr-defined]
        if hold is not None:
            self._forget(hold)  # type: ignore[attr-defined]
        self._signals.pop(owner, None)  # type: ignore[attr-defined]
        return quorum_error(
            self.name,  # type: ignore[attr-defined]
            owner,
            "confirm the release (it was sent to every node; the silent ones give it back "
            "when they answer, or it expires with the lease)",
            round_,
            self.quorum,
        )

    @staticmethod
    def _release_args(owner: str, hold: Hold | None) -> list[str]:
        """This object's last hold gives back everything the owner has on each node,
        including a leftover of an earlier attempt's late grant there."""
        return [owner, "all"] if hold is not None and hold.count <= 1 else [owner]

    def _ack_releasing(self, hold: Hold | None, delta: int) -> None:
        if hold is None:
            return
        hold.releasing += delta
        group = self._group_of(hold)
        if group is not None:
            group.set_releasing(delta)


def _node_failures_as_round(futures: Sequence[Any], labels: Sequence[str]) -> Round:
    replies: list[Any] = []
    for future in futures:
        if not future.done():
            replies.append(NoReply("no reply within the node timeout"))
        elif future.cancelled():
            replies.append(NoReply("cancelled at the node timeout"))
        elif future.exception() is not None:
            replies.append(future.exception())
        else:
            replies.append(future.result())
    return Round(replies, labels, list(futures))


_executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_executor_mutex = threading.Lock()


def _threads(kind: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    with _executor_mutex:
        found = _executors.get(kind)
        if found is None:
            found = _executors[kind] = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"redislock-quorum-{kind}"
            )
        return found


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The rounds' requests, one per node."""
    return _threads("round", 32)


def _subscriptions() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that subscribe waiters to each node, apart from the rounds' pool: a
    subscription to a stalled node may block (connecting under its subscriber's lock)
    until the node answers, and must not take a worker the rounds need."""
    return _threads("subscribe", 8)


def _after_fork_in_child() -> None:
    global _executor_mutex
    _executors.clear()
    _executor_mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class RedLock(_QuorumBase, LockBase[LeaseLost], SyncContext):
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
            if pending and decided and decided(_node_failures_as_round(futures, self._labels)):
                break
        return _node_failures_as_round(futures, self._labels)

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
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                pause = self._retry_pause(outcome)
                if pause:
                    time.sleep(pause if remaining is None else min(pause, remaining))
                else:
                    waiter.wait(wait_bound(outcome.pttl, remaining))
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
            outcome, acquired = self._settle_acquire(owner, round_, fresh)
        except LockQuorumError:
            self._undo(owner, tally_acquire(round_.replies, decode_acquire), fresh, round_)
            raise
        if acquired or not fresh:  # the owner holds it: its last give-back voids them
            self._unanswered_in(owner, round_.replies)
        if (
            acquired
            and (fresh or outcome.hold_count == 1)
            and outcome.needs_write_back(self.quorum)
        ):
            acquired = self._write_back(outcome.token)
        if acquired and attempt_valid(sent_at, lease):
            hold, is_new = self._record_acquired(
                owner, outcome.reply(), sent_at, lease, renew, started
            )
            if is_new and renew:
                for node, part in self._start_group(hold, outcome, sent_at, LeaseLost):
                    scheduler_for(self.clients[node]).add(part)
            return None
        self._undo(owner, outcome, fresh, round_)
        if outcome.finished:
            raise OwnerFinished(self.name)
        if outcome.running:
            raise OwnerRunning(self.name)
        outcome.split = outcome.split and not acquired
        return outcome

    def _giving_back(self, owner: str, keys: list[Any], args: list[Any]) -> Callable[[int], Any]:
        """A round's call that gives back on one node; a give-back of everything first
        voids the owner's attempts that node never answered (they may land later)."""
        if len(args) < 2 or args[1] != "all":
            return lambda i: self._node_scripts[i].release(keys=keys, args=args)
        silent = self._unanswered.pop(owner, set())
        void, number, lifetime = self._void(owner)

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
            request = futures[node]
            if not request.done() or request.exception() is not None:
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
            lambda i: self._node_scripts[i].renew(keys=keys, args=[owner, lease]),
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
        return _remaining(self._pttls(), self.quorum)

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
                    _bounded(client, 1.0, asyncio_client=False)
                    if isinstance(client, str)
                    else client
                )
                deleted |= (
                    decode_release(scripts_for(node).release(keys=keys, args=["", "force"])) == 0
                )
        return deleted


def _remaining(round_: Round, quorum: int) -> float | None:
    leases = sorted(
        (
            float("inf") if round_.replies[i] == -1 else round_.replies[i] / 1000.0
            for i in round_.answered()
            if round_.replies[i] != -2
        ),
        reverse=True,
    )
    return leases[quorum - 1] if len(leases) >= quorum else None


class _MultiWaiter:
    """One blocked acquire subscribed to the lock's release channel on every node.

    Each node's subscription is made in the background: subscribing may have to connect,
    and a stalled node must not hold up the waiter (the other nodes' release messages
    wake it). Until some node has confirmed its subscription, the wait polls briefly.
    """

    def __init__(self, clients: Sequence[Any], channel: bytes, owner: str) -> None:
        self._event = threading.Event()
        self._waiters: list[Any] = []
        self._clients = clients
        self._channel = channel
        self._owner = owner
        self._mutex = threading.Lock()
        self._closed = False
        #: Whether some node's subscription was confirmed when the last attempt started:
        #: only then can a release after that attempt not have been missed.
        self._listening = False

    def __enter__(self) -> _MultiWaiter:
        for client in self._clients:
            _subscriptions().submit(self._subscribe, client)
        return self

    def mark(self) -> None:
        """Call just before an attempt (see ``_listening``)."""
        with self._mutex:
            self._listening = any(w._channel.confirmed.is_set() for w in self._waiters)

    def _subscribe(self, client: Any) -> None:
        subscriber = subscriber_for(client)
        waiter = subscriber.waiter(self._channel, self._owner)
        waiter.event = self._event
        waiter._channel = subscriber._register(self._channel, waiter)
        with self._mutex:
            if not self._closed:
                self._waiters.append(waiter)
                return
        subscriber._unregister(self._channel, waiter)  # the acquire ended meanwhile

    def __exit__(self, *exc: object) -> None:
        with self._mutex:
            self._closed = True
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter._subscriber._unregister(self._channel, waiter)

    def wait(self, timeout: float) -> bool:
        if not self._listening:
            timeout = min(timeout, UNCONFIRMED_POLL)
        woken = self._event.wait(timeout) if timeout > 0 else self._event.is_set()
        self._event.clear()
        with self._mutex:  # every subscription, also one made while this waited
            for waiter in self._waiters:
                waiter.kicked = False  # used: the next release may wake it again
        return woken


# ----------------------------------------------------------------------------- asyncio


class AsyncRedLock(_QuorumBase, LockBase[AsyncLeaseLost], AsyncContext):
    """The asyncio twin of :class:`RedLock` over ``redis.asyncio`` clients (or URLs).

    Same arguments and rules; owners are asyncio tasks as for :class:`AsyncRedisLock`.
    A cancelled acquire gives back whatever its attempt took before re-raising.
    """

    _signal_type = AsyncLeaseLost
    _asyncio_clients = True

    def _default_owner(self) -> str:
        return task_owner()

    async def _round(
        self,
        call: Callable[[int], Awaitable[Any]],
        decided: Decided | None = None,
        tasks: list[asyncio.Future[Any]] | None = None,
    ) -> Round:
        """:meth:`RedLock._round` for asyncio. The requests are background tasks (pass
        ``tasks`` to see them even if the caller is cancelled): those in flight at the
        end finish by themselves, bounded by the nodes' socket timeout."""
        sources = [_background(call(i)) for i in range(len(self._fast))]
        if tasks is not None:
            tasks.extend(sources)
        deadline = time.monotonic() + self.node_timeout + 0.05
        pending: set[Any] = set(sources)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = await asyncio.wait(
                pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            if pending and decided and decided(_node_failures_as_round(sources, self._labels)):
                break
        return _node_failures_as_round(sources, self._labels)

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, lease: float | None = None
    ) -> Coroutine[Any, Any, bool]:
        """Take the lock on a majority of the nodes; see :meth:`RedLock.acquire`. The
        owner is resolved when called, as by :meth:`AsyncRedisLock.acquire`."""
        wait_limit, lease_millis, renew = self._acquire_args(blocking, timeout, lease)
        return self._acquire(caller(self.owner), blocking, wait_limit, lease_millis, renew)

    async def _acquire(
        self,
        called: Caller,
        blocking: bool,
        wait_limit: float | None,
        lease_millis: int,
        renew: bool,
    ) -> bool:
        owner, task = called

        def attempt(limit: float | None) -> Awaitable[bool]:
            return self._acquire_as(owner, task, blocking, limit, lease_millis, renew)

        if self.owner is not None:  # an explicit owner may be shared: no turns
            return await attempt(wait_limit)
        return await owner_turns.run((self.keys.lock, owner), blocking, wait_limit, attempt)

    async def _acquire_as(
        self,
        owner: str,
        task: asyncio.Task[Any] | None,
        blocking: bool,
        wait_limit: float | None,
        lease_millis: int,
        renew: bool,
    ) -> bool:
        started = time.monotonic()
        outcome = await self._try(owner, lease_millis, renew, owner_task=task)
        if outcome is None:
            return True
        self._contended(owner)
        if not blocking:
            return False
        deadline = None if wait_limit is None else started + wait_limit
        waiter = _AsyncMultiWaiter(self.clients, self.keys.channel, owner)
        await waiter.enter()
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                pause = self._retry_pause(outcome)
                if pause:
                    await asyncio.sleep(pause if remaining is None else min(pause, remaining))
                else:
                    await waiter.wait(wait_bound(outcome.pttl, remaining))
                waiter.mark()
                outcome = await self._try(owner, lease_millis, renew, started, owner_task=task)
                if outcome is None:
                    return True
        finally:
            waiter.exit()

    async def _try(
        self,
        owner: str,
        lease: int,
        renew: bool,
        started: float | None = None,
        *,
        owner_task: asyncio.Task[Any] | None = None,
    ) -> QuorumAcquire | None:
        """One attempt on every node: None if acquired, else what the nodes said."""
        running, within = self._still_undoing(owner)
        if running:
            await asyncio.wait(running, timeout=within)
        fresh = self._begin_attempt(owner)
        sent_at = time.monotonic()
        keys, argv = self._numbered(owner, fresh, lease)
        sources: list[asyncio.Future[Any]] = []
        try:
            round_ = await self._round(
                lambda i: self._node_scripts[i].acquire(keys=keys, args=argv),
                decided_by(granted, self.quorum),
                sources,
            )
            try:
                outcome, acquired = self._settle_acquire(owner, round_, fresh)
            except LockQuorumError:
                self._undo(owner, fresh, sources)
                raise
            if acquired or not fresh:  # the owner holds it: its last give-back voids them
                self._unanswered_in(owner, round_.replies)
            if (
                acquired
                and (fresh or outcome.hold_count == 1)
                and outcome.needs_write_back(self.quorum)
            ):
                acquired = await self._write_back(outcome.token)
        except asyncio.CancelledError:
            # Whatever reaches the nodes is given back, after it lands.
            self._undo(owner, fresh, sources)
            raise
        if acquired and attempt_valid(sent_at, lease):
            hold, is_new = self._record_acquired(
                owner, outcome.reply(), sent_at, lease, renew, started, owner_task
            )
            if is_new and renew:
                parts = self._start_group(hold, outcome, sent_at, AsyncLeaseLost)
                for node, part in parts:
                    scheduler = async_scheduler_for(self.clients[node])
                    assert scheduler is not None
                    scheduler.add(part)
            return None
        self._undo(owner, fresh, sources)
        if outcome.finished:
            raise OwnerFinished(self.name)
        if outcome.running:
            raise OwnerRunning(self.name)
        outcome.split = outcome.split and not acquired
        return outcome

    async def _write_back(self, token: int) -> bool:
        keys = [self.keys.fence]
        round_ = await self._round(
            lambda i: self._node_scripts[i].fence(keys=keys, args=[token]),
            decided_by(answered, self.quorum),
        )
        return len(round_.answered()) >= self.quorum

    def _undo(self, owner: str, fresh: bool, sources: list[asyncio.Future[Any]]) -> None:
        """Give back what a failed or cancelled attempt took, in the background, once
        each node's acquire request has landed (or timed out): see :meth:`_undo_plan`."""
        keys = self.keys.release_keys()
        void, number, lifetime = self._void(owner)

        async def give_back_on(node: int, nodes: list[int], args: list[Any]) -> Any:
            request = sources[node]
            if not request.done() or request.cancelled() or request.exception() is not None:
                # Its acquire may still land: void it there first (then nothing is left).
                await self._fast[node].set(void, number, px=lifetime)
            if node in nodes:
                return await self._node_scripts[node].release(keys=keys, args=args)
            return None

        async def give_back() -> None:
            if not sources:
                return
            await asyncio.wait(sources, timeout=self.node_timeout * 2)
            outcome = tally_acquire(
                _node_failures_as_round(sources, self._labels).replies, decode_acquire
            )
            nodes, args = self._undo_plan(owner, outcome, fresh)
            await asyncio.gather(
                *(give_back_on(n, nodes, args) for n in range(len(sources))),
                return_exceptions=True,
            )

        self._track(owner, [_background(give_back())])

    def release(self) -> Coroutine[Any, Any, None]:
        """Give back one hold on every node; see :meth:`RedLock.release`. A cancelled
        release still completes (and is recorded) before the cancellation goes on."""
        return self._release_for(caller(self.owner))

    async def _release_for(self, called: Caller) -> None:
        owner = called.owner
        self._check_not_inherited(owner)
        await to_completion(self._release(owner))

    async def _release(self, owner: str) -> None:
        hold = self._holds.get(owner)
        keys = self.keys.release_keys()
        args = self._release_args(owner, hold)
        valid = self._valid(hold)
        self._ack_releasing(hold, 1)
        try:
            round_ = await self._round(
                self._giving_back(owner, keys, args), decided_by(given_back, self.quorum)
            )
        finally:
            self._ack_releasing(hold, -1)
        self._settle_release(owner, hold, round_, valid)

    def _giving_back(
        self, owner: str, keys: list[Any], args: list[Any]
    ) -> Callable[[int], Awaitable[Any]]:
        """:meth:`RedLock._giving_back` for asyncio."""
        if len(args) < 2 or args[1] != "all":
            return lambda i: self._node_scripts[i].release(keys=keys, args=args)
        silent = self._unanswered.pop(owner, set())
        void, number, lifetime = self._void(owner)

        async def call(i: int) -> Any:
            if i in silent:
                await self._fast[i].set(void, number, px=lifetime)
            return await self._node_scripts[i].release(keys=keys, args=args)

        return call

    def extend(self, ttl: float) -> Coroutine[Any, Any, None]:
        """Replace the calling owner's lease with ``ttl`` seconds; see :meth:`RedLock.extend`."""
        return self._extend(caller(self.owner), lease_ms(ttl, "ttl"))

    async def _extend(self, called: Caller, lease: int) -> None:
        owner = called.owner
        self._check_not_inherited(owner)
        sent_at = time.monotonic()
        keys = [self.keys.lock]
        round_ = await self._round(
            lambda i: self._node_scripts[i].renew(keys=keys, args=[owner, lease]),
            decided_by(renewed, self.quorum),
        )
        self._settle_extend(owner, round_, lease, sent_at)

    def _unschedule(self, hold: Hold) -> None:
        group = self._groups.pop(id(hold), None)
        if group is None:
            return
        for node, part in group.parts:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to remove
                scheduler = async_scheduler_for(self.clients[node], create=False)
                if scheduler is not None:
                    scheduler.remove(part)

    async def _pttls(self) -> Round:
        async def one(i: int) -> int:
            return int(await self._fast[i].pttl(self.keys.lock))

        return await self._round(one)

    async def locked(self) -> bool:
        """Whether a majority of the nodes shows the lock held (by anyone)."""
        round_ = await self._pttls()
        return sum(1 for i in round_.answered() if round_.replies[i] != -2) >= self.quorum

    def owned(self) -> Coroutine[Any, Any, bool]:
        """Whether a majority of the nodes shows the calling owner's hold."""
        return self._owned(caller(self.owner))

    async def _owned(self, called: Caller) -> bool:
        owner = called.owner

        async def one(i: int) -> bool:
            return bool(await self._fast[i].hexists(self.keys.lock, owner))

        round_ = await self._round(one)
        return sum(1 for i in round_.answered() if round_.replies[i]) >= self.quorum

    async def remaining(self) -> float | None:
        """Seconds until fewer than a majority of the nodes hold the lock (None: not locked)."""
        return _remaining(await self._pttls(), self.quorum)

    async def aclose(self) -> None:
        """Close this lock's private per-node connections."""
        for client in self._fast:
            await client.aclose()


_background_tasks: set[asyncio.Future[Any]] = set()


def _background(awaitable: Awaitable[T]) -> asyncio.Future[T]:
    """Run ``awaitable`` as a task that is kept alive and whose error is collected."""
    task = asyncio.ensure_future(awaitable)
    _background_tasks.add(task)
    task.add_done_callback(_collected)
    return task


def _collected(task: asyncio.Future[Any]) -> None:
    _background_tasks.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a late node failure is not an unhandled error


class _AsyncMultiWaiter:
    """:class:`_MultiWaiter` for asyncio: one subscription per node, made in background
    tasks, and one shared event."""

    def __init__(self, clients: Sequence[Any], channel: bytes, owner: str) -> None:
        self._event = asyncio.Event()
        self._waiters: list[Any] = []
        self._clients = clients
        self._channel = channel
        self._owner = owner
        self._closed = False
        self._listening = False  # as in _MultiWaiter

    def mark(self) -> None:
        self._listening = any(w._channel.confirmed.is_set() for w in self._waiters)

    async def enter(self) -> None:
        for client in self._clients:
            _background(self._subscribe(client))

    async def _subscribe(self, client: Any) -> None:
        subscriber = async_subscriber_for(client)
        assert subscriber is not None
        waiter = subscriber.waiter(self._channel, self._owner)
        waiter.event = self._event
        waiter._channel = await subscriber._register(self._channel, waiter)
        if self._closed:
            subscriber._unregister(self._channel, waiter)  # the acquire ended meanwhile
        else:
            self._waiters.append(waiter)

    def exit(self) -> None:
        self._closed = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter._subscriber._unregister(self._channel, waiter)

    async def wait(self, timeout: float) -> bool:
        if not self._listening:
            timeout = min(timeout, UNCONFIRMED_POLL)
        woken = self._event.is_set() or (timeout > 0 and await wait_event(self._event, timeout))
        self._event.clear()
        for waiter in self._waiters:
            waiter.kicked = False  # used: the next release may wake it again
        return woken
