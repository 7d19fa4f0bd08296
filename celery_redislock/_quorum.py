"""The I/O-free half of the quorum lock, shared by :class:`RedLock` and :class:`AsyncRedLock`.

What a round of per-node replies means (acquired? by whom? which nodes failed?), the
validity rule, and the per-node holds behind one quorum hold live here; the two
classes in :mod:`celery_redislock.redlock` only send the commands.

The rules are the published Redlock algorithm's:

* every attempt goes to all N nodes in parallel, each with a short timeout;
* it succeeds when a majority (N // 2 + 1) granted it **and** the validity left,
  ``ttl - elapsed - drift`` with ``elapsed`` measured on the monotonic clock from the
  start of the attempt and ``drift = 1 % of ttl + 2 ms``, is positive;
* a failed attempt is undone on every node it may have reached, and retried after a
  random delay (so competing clients that split the vote do not collide again);
* renewal extends under the same rule: the hold stays valid while a majority of nodes
  renewed it, until the latest time at which a majority's leases still run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._core import Hold, LossSignal, validity_deadline
from ._errors import LockConfigurationError, LockQuorumError
from ._replies import AcquireReply, decode_acquire, decode_release, decode_renew_one


def quorum_of(nodes: int) -> int:
    """A majority of ``nodes``."""
    return nodes // 2 + 1


def validate_nodes(clients: object) -> list[Any]:
    """The node list: a non-empty sequence of clients or ``redis://`` URLs (that no two
    reach one server is :func:`celery_redislock._nodes.check_distinct`'s to check)."""
    if isinstance(clients, (str, bytes)) or not isinstance(clients, Sequence) or not clients:
        raise LockConfigurationError(
            f"clients must be a non-empty list of redis-py clients or redis:// URLs, one per "
            f"independent Redis master (an odd number, 3 or 5, is recommended), got {clients!r}"
        )
    for node in clients:
        if node is None or isinstance(node, bytes):
            raise LockConfigurationError(
                f"clients must hold redis-py clients or redis:// URLs, got {node!r}"
            )
    return list(clients)


@dataclass
class Round:
    """The replies of one round to every node: a value, or the exception it raised."""

    replies: list[Any]
    labels: Sequence[str]
    #: Every node's request (a future or task), in node order.
    sources: list[Any] = field(default_factory=list)

    @property
    def pending(self) -> list[Any]:
        """Requests still running when the round ended: they land later."""
        return [r for r in self.sources if not r.done()]

    def answered(self) -> list[int]:
        return [i for i, r in enumerate(self.replies) if not isinstance(r, BaseException)]

    def failures(self) -> dict[str, str]:
        return {
            self.labels[i]: _describe(r)
            for i, r in enumerate(self.replies)
            if isinstance(r, BaseException)
        }


class NoReply(TimeoutError):
    """A node's reply had not come when the round ended (its request may still land)."""


Decided = Callable[[Round], bool]


def decided_by(is_yes: Callable[[Any], bool], quorum: int) -> Decided:
    """A round is decided once a majority said yes, or enough said no that it cannot."""

    def decided(round_: Round) -> bool:
        replies = [round_.replies[i] for i in round_.answered()]
        yes = sum(1 for r in replies if is_yes(r))
        no = len(replies) - yes
        return yes >= quorum or no > len(round_.replies) - quorum

    return decided


def granted(reply: Any) -> bool:
    return decode_acquire(reply).acquired


def given_back(reply: Any) -> bool:
    return decode_release(reply) >= 0


def renewed(reply: Any) -> bool:
    return decode_renew_one(reply) == 1


def answered(_reply: Any) -> bool:
    return True


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


@dataclass
class QuorumAcquire:
    """What a round of acquire replies adds up to."""

    granted: list[int] = field(default_factory=list)
    #: The token each granting node handed out, in the order of ``granted``.
    tokens: list[int] = field(default_factory=list)
    token: int = 0
    hold_count: int = 0
    #: Nodes whose reply never came or failed (the grant may have landed there).
    unknown: list[int] = field(default_factory=list)
    #: Shortest remaining lease of another owner among the nodes that refused (ms).
    pttl: int = 0
    #: Some nodes granted it, not a majority: a split vote (retry after a random delay).
    split: bool = False
    finished: bool = False
    #: A node found the owner holding it already (a task run's other delivery).
    running: bool = False

    def reply(self) -> AcquireReply:
        return AcquireReply(True, token=self.token, hold_count=self.hold_count)

    def taken(self, quorum: int) -> bool:
        """Whether a majority granted it."""
        return len(self.granted) >= quorum

    def needs_write_back(self, quorum: int) -> bool:
        """Whether the token must still be written back to a majority of the counters.

        Each granting node handed out its counter's new value, so when a majority of them
        handed out the same (highest) token, a majority of counters already holds it (the
        usual case: counters move together); otherwise the write-back makes it so.
        """
        return self.tokens.count(self.token) < quorum


def tally_acquire(replies: Sequence[Any], decode: Callable[[Any], AcquireReply]) -> QuorumAcquire:
    outcome = QuorumAcquire()
    waits: list[int] = []
    for i, raw in enumerate(replies):
        if isinstance(raw, BaseException):
            outcome.unknown.append(i)
            continue
        reply = decode(raw)
        if reply.acquired:
            outcome.granted.append(i)
            outcome.tokens.append(reply.token)
            outcome.token = max(outcome.token, reply.token)
            outcome.hold_count = max(outcome.hold_count, reply.hold_count)
        elif reply.finished:
            outcome.finished = True
        elif reply.running:
            outcome.running = True
        else:
            waits.append(reply.pttl)
    positive = [w for w in waits if w > 0]
    outcome.pttl = min(positive) if positive else (-1 if -1 in waits else 0)
    outcome.split = bool(outcome.granted)
    return outcome


def quorum_error(
    name: str | bytes, owner: str, what: str, round_: Round, quorum: int
) -> LockQuorumError:
    failures = round_.failures()
    listed = "; ".join(f"{node}: {why}" for node, why in failures.items())
    return LockQuorumError(
        f"lock {name!r}: could not {what}: only {len(round_.answered())} of "
        f"{len(round_.replies)} Redis nodes answered, a quorum needs {quorum} "
        f"(failed: {listed})",
        name=name,
        owner=owner,
        failures=failures,
    )


def release_code(
    round_: Round, quorum: int, *, valid: bool = False, last: bool = True
) -> int | None:
    """One release code for the quorum (see release.lua), or None: too few answered.

    n >= 0 when a majority gave the hold back (n: holds still left), or when the hold was
    still ``valid`` here when the release was sent and some node gave it back (the
    nodes that did not answer get the release when they do, or their lease ends) —
    unless a majority answered that it did not have the hold: that is a loss whatever
    the local clock says (-2 if some node shows another owner, -1 if it was simply
    gone). None if the silent nodes could still make a majority either way.
    """
    codes = [decode_release(round_.replies[i]) for i in round_.answered()]
    given_back = [c for c in codes if c >= 0]
    if len(given_back) >= quorum:
        return max(given_back)
    if len(codes) - len(given_back) >= quorum:  # a majority did not have it: a loss
        return -2 if -2 in codes else -1
    if valid and given_back:
        return max(given_back, default=0 if last else 1)
    if len(given_back) + len(round_.replies) - len(codes) >= quorum:
        return None
    return -2 if -2 in codes else -1


def renew_code(round_: Round, quorum: int) -> int | None:
    """One renew code for the quorum (see renew.lua): 1, 0, -1, or None (too few answered)."""
    codes = [decode_renew_one(round_.replies[i]) for i in round_.answered()]
    renewed = sum(1 for c in codes if c == 1)
    if renewed >= quorum:
        return 1
    if renewed + len(round_.replies) - len(codes) >= quorum:
        return None
    return -1 if -1 in codes else 0


#: How often a share of a lost quorum hold still wakes the watchdog (it renews nothing).
IDLE_SHARE = 3600.0


class NodeHold(Hold):
    """One node's share of a quorum hold, renewed by that node's watchdog."""

    __slots__ = ("group",)

    group: HoldGroup

    def renewed(self, sent_at: float) -> None:
        if self.group.over:
            # The quorum hold is lost: this share is not renewed again (the watchdog drops
            # it when the hold is released or taken anew).
            self.next_due = time.monotonic() + IDLE_SHARE
            return
        super().renewed(sent_at)
        self.group.refresh()


class HoldGroup:
    """The per-node holds behind one quorum hold; it stays valid while a majority does."""

    def __init__(self, hold: Hold, quorum: int, signal_type: type[LossSignal]) -> None:
        self.hold = hold
        self.quorum = quorum
        self.parts: list[tuple[int, NodeHold]] = []
        self._signal_type = signal_type
        self._mutex = threading.Lock()
        self._reasons: list[str] = []
        #: The quorum hold is lost: its shares are no longer renewed.
        self.over = False

    def add(self, node: int, sent_at: float) -> NodeHold:
        hold = self.hold
        part = NodeHold(
            hold.keys,
            hold.owner,
            token=hold.token,
            lease=hold.lease,
            renew=True,
            sent_at=sent_at,
            lost=self._signal_type(),
            notify=self._part_lost,
            owner_task=hold.owner_task,
        )
        part.group = self
        self.parts.append((node, part))
        return part

    def extended(self, replies: Sequence[Any], lease: int, sent_at: float) -> None:
        """Apply an ``extend`` round: a node that renewed moves its share's deadline, a
        node that no longer had the hold loses its share, a silent node changes nothing."""
        for node, part in self.parts:
            reply = replies[node]
            if part.lost.is_set() or isinstance(reply, BaseException):
                continue
            code = decode_renew_one(reply)
            if code == 1:
                part.lease = lease
                part.renewed(sent_at)
            else:
                part.mark_lost("expired" if code == 0 else "stolen")

    def set_releasing(self, delta: int) -> None:
        for _, part in self.parts:
            part.releasing += delta

    def alive(self, now: float) -> int:
        """Shares that still count: not lost, and confirmed with a deadline ahead."""
        return sum(1 for _, p in self.parts if not p.lost.is_set() and p.deadline > now)

    def refresh(self) -> None:
        """Validity = the latest time a majority of the nodes' leases all still run."""
        with self._mutex:
            live = sorted((p.deadline for _, p in self.parts if not p.lost.is_set()), reverse=True)
            if len(live) >= self.quorum:
                self.hold.deadline = live[self.quorum - 1]
            else:
                self.hold.deadline = min(self.hold.deadline, time.monotonic())

    def _part_lost(self, part: Hold, reason: str) -> None:
        with self._mutex:
            self._reasons.append(reason)
            alive = self.alive(time.monotonic())
            reasons = list(self._reasons)
        self.refresh()
        if alive >= self.quorum:
            return
        self.over = True
        for why in ("stolen", "unreachable", "expired"):
            if why in reasons:
                self.hold.mark_lost(why)
                return
        self.hold.mark_lost(reason)


def attempt_valid(sent_at: float, lease: int) -> bool:
    """The Redlock validity rule: some of the lease is left after elapsed time and drift."""
    return validity_deadline(sent_at, lease) > time.monotonic()
