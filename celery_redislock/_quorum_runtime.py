"""What the quorum locks share: the node set, attempts and their undoing, per-node holds.

:class:`~celery_redislock.redlock.RedLock` (threads) and
:class:`~celery_redislock.aio_redlock.AsyncRedLock` (asyncio) only drive the I/O: a
round of requests to every node, and the waits. Every decision on what a round's
replies mean is made here (or, free of any lock state, in :mod:`._quorum`), so the
twins cannot drift apart.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ._core import (
    DEFAULT_PREFIX,
    MAX_MS,
    Hold,
    OwnerFinished,
    OwnerRunning,
    decode_acquire,
    seconds,
    wait_bound,
)
from ._errors import LockConfigurationError
from ._nodes import check_distinct, node_label
from ._private_clients import bounded_client, close_with
from ._quorum import (
    HoldGroup,
    NodeHold,
    NoReply,
    QuorumAcquire,
    Round,
    attempt_valid,
    quorum_error,
    quorum_of,
    release_code,
    renew_code,
    tally_acquire,
    validate_nodes,
)
from ._scripts import scripts_for
from ._waiting import UNCONFIRMED_POLL

#: Default per-node timeout of one request (seconds): small next to any sensible ttl.
NODE_TIMEOUT = 0.25
#: Default ceiling of the random delay before retrying after a split vote (seconds).
RETRY_DELAY = 0.1
#: The jitter of a retried round: a generator of its own (the global one is the app's).
_rng = random.Random()


class QuorumBase:
    """Node set, timeouts and the per-node holds: what both quorum locks share."""

    clients: tuple[Any, ...]
    client: Any
    _fast: list[Any]
    _closer: Any
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
        self._fast = [
            bounded_client(c, self.node_timeout, asyncio_client=asyncio_client) for c in nodes
        ]
        # Their connections are closed when this lock goes (a lock made per task must not
        # leave a socket per node open each time); AsyncRedLock.aclose() closes them first.
        self._closer = close_with(self, self._fast, nodes)
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
            return _rng.uniform(0, self.retry_delay)
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

    def _settle_acquire(
        self, owner: str, round_: Round, fresh: bool
    ) -> tuple[QuorumAcquire, bool, bool]:
        """(what the nodes said, granted by a majority?, the token to write back to every
        node's counter first?). Raises :class:`LockQuorumError` if too few answered (the
        caller then undoes the attempt)."""
        outcome = tally_acquire(round_.replies, decode_acquire)
        if len(round_.answered()) < self.quorum:
            raise quorum_error(self.name, owner, "acquire", round_, self.quorum)  # type: ignore[attr-defined]
        acquired = outcome.taken(self.quorum)
        if acquired or not fresh:  # the owner holds it: its last give-back voids them
            self._unanswered_in(owner, round_.replies)
        write_back = (
            acquired
            and (fresh or outcome.hold_count == 1)
            and outcome.needs_write_back(self.quorum)
        )
        return outcome, acquired, write_back

    def _take(
        self,
        owner: str,
        outcome: QuorumAcquire,
        acquired: bool,
        sent_at: float,
        lease: int,
        renew: bool,
        started: float | None,
        owner_task: Any = None,
    ) -> list[tuple[int, NodeHold]] | None:
        """Count an attempt a majority granted, while still valid, as acquired: returns
        the per-node parts the watchdog must now renew (none for a re-entry or an
        unrenewed hold); None when it is not taken (the caller undoes it, then asks
        :meth:`_refused`)."""
        if not (acquired and attempt_valid(sent_at, lease)):
            return None
        hold, is_new = self._record_acquired(  # type: ignore[attr-defined]
            owner, outcome.reply(), sent_at, lease, renew, started, owner_task
        )
        if is_new and renew:
            return self._start_group(hold, outcome, sent_at, self._signal_type)  # type: ignore[attr-defined]
        return []

    def _refused(self, outcome: QuorumAcquire, acquired: bool) -> QuorumAcquire:
        """What an attempt not taken returns (raises for a finished or running task)."""
        if outcome.finished:
            raise OwnerFinished(self.name)  # type: ignore[attr-defined]
        if outcome.running:
            raise OwnerRunning(self.name)  # type: ignore[attr-defined]
        outcome.split = outcome.split and not acquired
        return outcome

    def _next_wait(
        self, outcome: QuorumAcquire, deadline: float | None
    ) -> tuple[float, float] | None:
        """Before a blocked acquire's next attempt: None when its time is up, else
        (pause, wait): a random pause after a split vote, or else how long to wait for
        the holder's release."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        pause = self._retry_pause(outcome)
        if pause:
            return (pause if remaining is None else min(pause, remaining)), 0.0
        return 0.0, wait_bound(outcome.pttl, remaining)

    def _voids_first(self, owner: str, args: list[Any]) -> tuple[set[int], tuple[bytes, int, int]]:
        """Before a release: the nodes where the owner's void record must be set first
        (a give-back of everything voids the attempts a node never answered: they may
        land later), and that record (see :meth:`_void`)."""
        if len(args) < 2 or args[1] != "all":
            return set(), self._void(owner)
        return self._unanswered.pop(owner, set()), self._void(owner)

    @staticmethod
    def _may_land(request: Any) -> bool:
        """Whether an acquire request (a future or task) may still land on its node."""
        return not request.done() or request.cancelled() or request.exception() is not None

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


def round_of(futures: Sequence[Any], labels: Sequence[str]) -> Round:
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


def majority_remaining(round_: Round, quorum: int) -> float | None:
    leases = sorted(
        (
            float("inf") if round_.replies[i] == -1 else round_.replies[i] / 1000.0
            for i in round_.answered()
            if round_.replies[i] != -2
        ),
        reverse=True,
    )
    return leases[quorum - 1] if len(leases) >= quorum else None


class MultiWaiterBase:
    """One blocked acquire subscribed to the lock's release channel on every node, all
    sharing one event (the twins make the subscriptions, in the background: subscribing
    may have to connect, and a stalled node must not hold up the waiter). Until some
    node has confirmed its subscription, the wait polls briefly."""

    _event: Any

    def __init__(self, clients: Sequence[Any], channel: bytes, owner: str) -> None:
        self._waiters: list[Any] = []
        self._clients = clients
        self._channel = channel
        self._owner = owner
        self._mutex = threading.Lock()  # never held across an await
        self._closed = False
        #: Whether some node's subscription was confirmed when the last attempt started:
        #: only then can a release after that attempt not have been missed.
        self._listening = False

    def mark(self) -> None:
        """Call just before an attempt (see ``_listening``)."""
        with self._mutex:
            self._listening = any(w._channel.confirmed.is_set() for w in self._waiters)

    def _waiter_of(self, subscriber: Any) -> Any:
        waiter = subscriber.waiter(self._channel, self._owner)
        waiter.event = self._event
        return waiter

    def _adopt(self, subscriber: Any, waiter: Any) -> None:
        """Keep a node's subscription, unless the acquire ended meanwhile."""
        with self._mutex:
            if not self._closed:
                self._waiters.append(waiter)
                return
        subscriber._unregister(self._channel, waiter)

    def _bound(self, timeout: float) -> float:
        return timeout if self._listening else min(timeout, UNCONFIRMED_POLL)

    def _rearm(self) -> None:
        """After a wait: the wake-ups are used, the next release may wake it again."""
        self._event.clear()
        with self._mutex:  # every subscription, also one made while this waited
            for waiter in self._waiters:
                waiter.kicked = False

    def exit(self) -> None:
        """Leave every node's channel."""
        with self._mutex:
            self._closed = True
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter._subscriber._unregister(self._channel, waiter)
