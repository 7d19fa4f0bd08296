"""How waiters wake: one shared pub/sub subscriber per connection pool per process.

A blocked ``acquire`` subscribes to the lock's release channel *before* it retries,
then sleeps at most min(holder's remaining lease, caller's remaining timeout). Blocked
acquires also join the lock's line in Redis (first come, first served): a release hands
the lock straight to the head of the line and publishes that waiter's owner id, and the
subscriber wakes exactly that waiter, which finds the lock already its own. A release
with nobody in line publishes "1", which wakes the longest-waiting local waiter of that
lock (not all). An expiry publishes nothing, which is why the sleep is bounded by the
lease.

**Direct grants** (one Redis, not sharded): a waiter also tells the line its wake id,
``<subscriber>:<nonce>``. A release that hands it the lock then publishes
``<token>:<nonce>`` on ``<channel>:<subscriber>``, a channel only that waiter's
process subscribes to (in the same SUBSCRIBE as the lock's channel): no other process
wakes, and the waiter counts the grant as acquired without another round trip (its
watchdog lengthens the grant's short lease; see ``LockBase._take_grant``). The nonce,
``<wait>.<attempt>``, is new for every attempt: only a grant that answers the waiter's
latest attempt counts (it was made after that attempt reached Redis, which dates its
lease), and a late message from an earlier attempt or wait is ignored.

**A lone waiter** (sync, a plain client): one blocked acquire per pool in a process at a
time skips the subscriber: its wake id names a list of its own (its *box*), the release
pushes the grant there, and it waits in BLPOP on a connection of the lock's pool, so
the thread that waits is the one that reads the grant (:mod:`._lone_waiter`).

Subscriptions are reference-counted per channel and dropped a little after their
last waiter leaves, so a lock contended in bursts is not re-subscribed each time.
If the subscriber's connection breaks, every waiter is woken to retry (a release
may have been missed) and waits poll briefly until the subscription is confirmed
again.

Redis Cluster clients publish with SPUBLISH (see :mod:`._scripts`), so their waiters use
**sharded** pub/sub: one subscriber per cluster node's pool, sending SSUBSCRIBE and
SUNSUBSCRIBE to the node that owns the channel's slot (one channel per command: a
sharded subscription cannot span slots). When that slot moves to another node, the
server ends the subscription (a ``sunsubscribe`` push, or MOVED for a new one); the
channel's waiters are then woken to retry and re-register with the subscriber of the
node that owns the slot now.

This module holds what the sync and asyncio subscribers share (``SubscriberBase``,
``WaiterBase``: every decision on names, replies and wake-ups) and the sync one, a
reader thread per pool; :mod:`celery_redislock._async_waiting` is the asyncio twin.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import threading
import time
import weakref
from collections import deque
from types import TracebackType
from typing import Any, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._core import LINE_MARGIN_MS
from ._keyspace import grant_channel_tail
from ._process import ProcessRegistry
from ._scripts import is_cluster

log = logging.getLogger(__name__)

#: After a release hands the lock to a waiter of another process (and says so on the
#: lock's channel: not for a direct grant), how long until that grant lapses if never
#: taken (release.lua keeps it LINE_MARGIN_MS), plus a margin.
GRANT_WINDOW = LINE_MARGIN_MS / 1000.0 + 0.05
#: Longest a new waiter waits for its SUBSCRIBE to be confirmed before it retries anyway.
CONFIRM_WAIT = 1.0
#: While a channel's subscription is not confirmed, waiters poll this often.
UNCONFIRMED_POLL = 0.05
#: A channel with no waiters is unsubscribed after this long.
LINGER = 2.0
#: A subscription Redis refused (an ACL without the channel) is tried again this often.
REFUSED_RETRY = 2.0
#: A reader waits this long for a reply before it checks for idle channels again.
READ_SLICE = 0.5
#: Nonces of blocked acquires in this process (see "Direct grants" above).
_nonces = itertools.count(1)
#: What a broken subscriber connection raises.
BROKEN = (RedisConnectionError, RedisTimeoutError, OSError)


class _Channel:
    """One lock's release channel in this process: its waiters, oldest first."""

    __slots__ = ("confirmed", "idle_since", "moved", "waiters")

    def __init__(self) -> None:
        self.waiters: deque[Any] = deque()
        self.confirmed: Any = threading.Event()
        self.idle_since: float | None = None
        #: Sharded only: the node no longer serves this channel's slot (its waiters move).
        self.moved = False

    def wake_all(self) -> None:
        for waiter in self.waiters:
            waiter.kick()

    def wake_one(self) -> None:
        for waiter in self.waiters:
            if not waiter.kicked:
                waiter.kick()
                return

    def grant(self, data: bytes) -> None:
        """A direct grant, ``<token>:<nonce>``: hand the token to the wait whose latest
        attempt has that nonce.

        None has (it left, passing the grant on, or has made another attempt since,
        which found the grant in Redis): nothing to do.
        """
        token, _, nonce = data.partition(b":")
        for waiter in self.waiters:
            if waiter.nonce == nonce:
                if token.isdigit():
                    waiter.granted = (nonce, int(token))
                waiter.kick()
                return

    def wake(self, data: bytes) -> None:
        """A release names the waiter it handed the lock to, or says "1": wake one.

        Handed to a waiter of another process, the lock is that waiter's to take within
        the grant's window; if it never does (it died), the grant lapses without a
        message. So the oldest waiter here re-checks when the window ends, not when its
        own (lease-bounded) wait would have ended. (A direct grant says nothing here:
        then only the 5 s cap on every wait bounds the delay.)
        """
        if data == b"1":
            self.wake_one()
            return
        for waiter in self.waiters:
            if waiter.owner == data:
                waiter.kick()
                return
        # Only the oldest local waiter re-checks: it is this process's first in line, so
        # if the line's head is here, it is the one. One request per process per window.
        if self.waiters:
            self.waiters[0].nudge(time.monotonic() + GRANT_WINDOW)


class WaiterBase:
    """How a waiter is woken: ``kick`` (retry now) or ``nudge`` (retry by a time)."""

    __slots__ = (
        "_channel",
        "_name",
        "_relocate",
        "_subscriber",
        "attempt",
        "confirm_wait",
        "event",
        "granted",
        "kicked",
        "nonce",
        "owner",
        "recheck_at",
        "wait_id",
    )
    _channel: Any

    def __init__(self, subscriber: Any, name: bytes, owner: str, relocate: Any, event: Any) -> None:
        self._subscriber = subscriber
        self._name = name
        self._channel = None
        self._relocate = relocate
        self.event = event
        #: How long entering waits for the subscription to be confirmed (at most the
        #: acquire's remaining timeout: a short timeout must not wait a whole second).
        self.confirm_wait = CONFIRM_WAIT
        self.owner = owner.encode()
        self.kicked = False
        self.recheck_at: float | None = None
        #: This blocked acquire in this process, and its attempts (see "Direct grants").
        self.wait_id = str(next(_nonces)).encode()
        self.attempt = 0
        self.nonce = self.wait_id + b".0"
        #: (nonce, fencing token) of a direct grant (set by the subscriber).
        self.granted: tuple[bytes, int] | None = None

    def _grant_id(self) -> bytes | None:
        """Where a direct grant to this waiter goes: its subscriber's part of the grant
        channel's name (None: sharded, no direct grants)."""
        grant_id: bytes | None = self._subscriber.grant_id
        return grant_id

    @property
    def direct(self) -> bool:
        """Whether this waiter takes direct grants (its subscriber is not sharded)."""
        return self._grant_id() is not None

    @property
    def grant_name(self) -> bytes:
        """``<subscriber>:<wait>``: how a direct grant to this wait is named in Redis."""
        return (self._grant_id() or b"") + b":" + self.wait_id

    def next_wake_id(self) -> bytes:
        """A new nonce for the next attempt; ``<subscriber>:<nonce>`` for acquire.lua."""
        self.attempt += 1
        self.nonce = self.wait_id + b"." + str(self.attempt).encode()
        return (self._grant_id() or b"") + b":" + self.nonce

    def take_grant(self) -> int | None:
        """The token of a direct grant answering the latest attempt, or None."""
        granted, self.granted = self.granted, None
        if granted is None or granted[0] != self.nonce:
            return None
        return granted[1]

    def kick(self) -> None:
        self.kicked = True
        self.event.set()

    def nudge(self, at: float) -> None:
        if self.recheck_at is None or at < self.recheck_at:
            self.recheck_at = at
        self.event.set()  # the waiting side recomputes its wait with the new bound

    def _end(self, timeout: float) -> float:
        """When a wait of ``timeout`` ends (polling briefly while unconfirmed)."""
        assert self._channel is not None
        if not self._channel.confirmed.is_set():
            timeout = min(timeout, UNCONFIRMED_POLL)
        return time.monotonic() + timeout

    def _bound(self, end: float) -> float:
        """Seconds to sleep now: until ``end`` or the re-check time, whichever is first."""
        now = time.monotonic()
        recheck_at = self.recheck_at
        return min(end, recheck_at if recheck_at is not None else end) - now

    def _woken(self, end: float) -> bool | None:
        """After a sleep: True (retry now), False (timed out) or None (sleep again)."""
        self.event.clear()
        if self.kicked:
            self.kicked = False
            self.recheck_at = None
            return True
        now = time.monotonic()
        if self.recheck_at is not None and now >= self.recheck_at:
            self.recheck_at = None
            return True
        return False if now >= end else None


class Waiter(WaiterBase):
    """One blocked acquire's registration; use as a context manager around the retry loop."""

    __slots__ = ()

    def __init__(
        self,
        subscriber: Subscriber,
        name: bytes,
        owner: str,
        relocate: Callable[[], Subscriber] | None = None,
    ) -> None:
        super().__init__(subscriber, name, owner, relocate, threading.Event())

    def __enter__(self) -> Waiter:
        self._channel = self._subscriber._register(self._name, self)
        self._channel.confirmed.wait(self.confirm_wait)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._subscriber._unregister(self._name, self)

    def wait(self, timeout: float) -> bool:
        """Sleep until woken by a release or ``timeout``; True if woken."""
        assert self._channel is not None
        if self._channel.moved and self._relocate is not None:
            # The channel's slot moved to another cluster node: follow it.
            self._subscriber._unregister(self._name, self)
            self._subscriber = self._relocate()
            self._channel = self._subscriber._register(self._name, self)
        end = self._end(timeout)
        while True:
            left = self._bound(end)
            if left > 0:
                self.event.wait(left)
            woken = self._woken(end)
            if woken is not None:
                return woken


class SubscriberBase:
    """What both subscribers share: the channel names (each lock channel ``<c>`` comes
    with this subscriber's direct-grant channel ``<c>:<grant_id>``, not for sharded
    pub/sub) and how a reply reaches its lock's waiters."""

    sharded: bool
    _channels: dict[bytes, Any]
    _conn: Any

    def _init_grants(self) -> None:
        #: This subscriber's part of direct-grant channel names (None: sharded, no grants).
        self.grant_id: bytes | None = None if self.sharded else b"g" + secrets.token_hex(8).encode()
        self._grant_tail = b"" if self.grant_id is None else grant_channel_tail(self.grant_id)

    def _with_grants(self, names: list[bytes]) -> list[bytes]:
        """Each lock's channel, then its direct-grant channel: the second confirmation
        means both are in place."""
        tail = self._grant_tail
        return [part for name in names for part in (name, name + tail)] if tail else names

    def _route(self, channel: bytes) -> tuple[bytes, bool]:
        """(the lock channel a reply is about, whether it came on the grant channel)."""
        tail = self._grant_tail
        if tail and channel.endswith(tail):
            return channel[: -len(tail)], True
        return channel, False

    def _confirms(self, kind: bytes, direct: bool) -> bool:
        return kind == b"ssubscribe" or (kind == b"subscribe" and (direct or not self._grant_tail))

    def _subscribe_commands(self, names: list[bytes], unsubscribe: bool) -> list[tuple[Any, ...]]:
        """The commands that (un)subscribe ``names``: one (UN)SUBSCRIBE with each lock's
        grant channel, or one S(UN)SUBSCRIBE per channel (a sharded one cannot span
        slots)."""
        if not self.sharded:
            return [("UNSUBSCRIBE" if unsubscribe else "SUBSCRIBE", *self._with_grants(names))]
        return [("SUNSUBSCRIBE" if unsubscribe else "SSUBSCRIBE", name) for name in names]

    def _moved(self, names: list[bytes]) -> None:
        """The node stopped serving these channels' slots: wake their waiters to move."""
        for name in names:
            channel = self._channels.pop(name, None)
            if channel is not None:
                channel.moved = True
                channel.confirmed.clear()
                channel.wake_all()

    def _unconfirmed(self) -> list[bytes]:
        return [n for n, ch in self._channels.items() if not ch.confirmed.is_set()]

    def _drop_waiter(self, name: bytes, waiter: Any) -> None:
        """A waiter leaves its channel (a wake-up it got and did not use is passed on);
        the channel lingers a while after its last waiter (see :meth:`_drop_idle`)."""
        channel = self._channels.get(name)
        if channel is None:
            return
        try:
            channel.waiters.remove(waiter)
        except ValueError:
            return
        if waiter.kicked:
            # The wake-up it got was not used for a retry: pass it on.
            channel.wake_one()
        if not channel.waiters:
            channel.idle_since = time.monotonic()

    def _drop_idle(self) -> list[bytes]:
        """Forget the channels idle for LINGER; returns those to unsubscribe (none when no
        channel is left: the connection then closes)."""
        now = time.monotonic()
        idle = [
            name
            for name, ch in self._channels.items()
            if not ch.waiters and ch.idle_since is not None and now - ch.idle_since >= LINGER
        ]
        for name in idle:
            del self._channels[name]
        return idle if self._channels else []

    def _kick_all(self) -> None:
        """The connection broke: a release may have been missed, so everyone retries."""
        for channel in self._channels.values():
            channel.confirmed.clear()
            for waiter in channel.waiters:
                waiter.kick()

    @property
    def connections(self) -> int:
        """Connections this subscriber has open (0 or 1)."""
        return 0 if self._conn is None else 1

    def _apply(self, reply: Any) -> bytes | None:
        """Apply one reply of the subscriber's connection to its lock's channel; returns
        the channel's name if the reply says its slot moved (a ``sunsubscribe`` that was
        not ours: we only unsubscribe channels already dropped)."""
        if not isinstance(reply, list) or len(reply) < 2:
            return None
        kind = reply[0]
        name, direct = self._route(reply[1])
        channel = self._channels.get(name)
        if channel is None:
            return None
        if kind in (b"message", b"smessage") and len(reply) > 2:
            if direct:
                channel.grant(reply[2])
            else:
                channel.wake(reply[2])
        elif self._confirms(kind, direct):
            channel.confirmed.set()
        elif kind == b"sunsubscribe":
            return bytes(reply[1])
        return None


class Subscriber(SubscriberBase):
    """The process-wide subscriber of one connection pool (see the module docstring)."""

    def __init__(self, pool: Any, *, sharded: bool = False) -> None:
        # Weakly: the registry of subscribers is keyed weakly by the pool, and a value
        # referring to its key would keep the pool (a client's made per task) for ever.
        # A waiter's lock holds its client, and so the pool, while it waits.
        self._pool = weakref.ref(pool)
        #: SSUBSCRIBE/SUNSUBSCRIBE (a cluster node) instead of SUBSCRIBE/UNSUBSCRIBE.
        self.sharded = sharded
        self._mutex = threading.Lock()
        self._channels: dict[bytes, _Channel] = {}
        self._conn: Any = None
        self._thread: threading.Thread | None = None
        self._init_grants()

    # -- used by waiters -------------------------------------------------------

    def waiter(
        self, channel: bytes, owner: str, relocate: Callable[[], Subscriber] | None = None
    ) -> Waiter:
        return Waiter(self, channel, owner, relocate)

    def _register(self, name: bytes, waiter: Waiter) -> _Channel:
        with self._mutex:
            channel = self._channels.get(name)
            if channel is None:
                channel = self._channels[name] = _Channel()
                self._subscribe_locked([name])
            channel.waiters.append(waiter)
            channel.idle_since = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="redislock-subscriber", daemon=True
                )
                self._thread.start()
            return channel

    def _unregister(self, name: bytes, waiter: Waiter) -> None:
        with self._mutex:
            self._drop_waiter(name, waiter)

    # -- the connection --------------------------------------------------------

    def _subscribe_locked(self, names: list[bytes], unsubscribe: bool = False) -> None:
        for command in self._subscribe_commands(names, unsubscribe):
            self._send_locked(*command)

    def _send_locked(self, *args: Any) -> None:
        """Send a command; on failure leave the reader thread to reconnect and resubscribe."""
        try:
            if self._conn is None:
                # Not pool.make_connection(): that counts against max_connections for good.
                pool = self._pool()
                if pool is None:  # nobody can be waiting on it any more
                    return
                conn = pool.connection_class(**pool.connection_kwargs)
                conn.connect()
                self._conn = conn
            self._conn.send_command(*args, check_health=False)
        except BROKEN as exc:
            log.debug("redislock subscriber could not send %s: %r", args[0], exc)
            self._drop_connection_locked()

    def _drop_connection_locked(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # best effort on a broken socket
                self._conn.disconnect()
            self._conn = None
        self._kick_all()

    def _resubscribe_unconfirmed_locked(self) -> None:
        names = [n for n, ch in self._channels.items() if ch.waiters and not ch.confirmed.is_set()]
        if names:
            self._subscribe_locked(names)

    def _reconnect_locked(self) -> None:
        names = list(self._channels)
        if names:
            self._subscribe_locked(names)

    # -- the reader thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            self._read_loop()
        finally:
            with self._mutex:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _read_loop(self) -> None:
        failures = 0
        next_retry = 0.0
        while True:
            with self._mutex:
                self._sweep_locked()
                if not self._channels:
                    if self._conn is not None:
                        self._conn.disconnect()
                        self._conn = None
                    self._thread = None
                    return
                if self._conn is None:
                    self._reconnect_locked()
                elif time.monotonic() >= next_retry:
                    self._resubscribe_unconfirmed_locked()
                    next_retry = time.monotonic() + REFUSED_RETRY
                conn = self._conn
            if conn is None:
                failures += 1
                time.sleep(min(1.0, 0.02 * 2**failures))
                continue
            try:
                if not conn.can_read(timeout=READ_SLICE):
                    continue
                reply = conn.read_response(disable_decoding=True, push_request=True)
            except ResponseError as exc:
                if self.sharded and str(exc).startswith(("MOVED", "ASK")):
                    # A new sharded subscription went to a node that no longer owns
                    # the slot: its waiters retry and follow the slot.
                    with self._mutex:
                        self._moved(self._unconfirmed())
                    continue
                # e.g. NOPERM: the ACL grants the lock keys but not their channels. Waiters
                # keep polling; the subscription is retried every REFUSED_RETRY seconds.
                log.error(
                    "redislock: Redis refused a subscription (%s); waiters poll every %.2fs "
                    "until it is allowed (grant the channel pattern '&<prefix>*')",
                    exc,
                    UNCONFIRMED_POLL,
                )
                next_retry = time.monotonic() + REFUSED_RETRY
                continue
            except Exception as exc:  # broken, or closed under us by a failed send
                with self._mutex:
                    if self._conn is conn:
                        log.warning("redislock subscriber connection lost (%r); resubscribing", exc)
                        self._drop_connection_locked()
                continue
            failures = 0
            self._dispatch(reply)

    def _dispatch(self, reply: Any) -> None:
        with self._mutex:
            moved = self._apply(reply)
            if moved is not None:
                self._moved([moved])

    def _sweep_locked(self) -> None:
        idle = self._drop_idle()
        if idle and self._conn is not None:
            self._subscribe_locked(idle, unsubscribe=True)


#: Per connection pool, this process's subscriber (a forked child opens its own).
_subscribers: ProcessRegistry[Any, Subscriber] = ProcessRegistry()


def _cluster_pool(client: Any, channel: bytes | None) -> Any:
    if channel is None:
        raise TypeError("a Redis Cluster client's subscriber depends on the channel: pass it")
    return client.get_redis_connection(client.get_node_from_key(channel)).connection_pool


def subscriber_for(client: Any, channel: bytes | None = None) -> Subscriber:
    """The subscriber shared by every lock on ``client``'s connection pool in this process.

    For a Redis Cluster client: the sharded subscriber of the pool of the node that owns
    ``channel``'s slot (``channel`` is then required).
    """
    sharded = is_cluster(client)
    pool = _cluster_pool(client, channel) if sharded else client.connection_pool
    return _subscribers.get(pool, lambda: Subscriber(pool, sharded=sharded))


def waiter_for(client: Any, channel: bytes, owner: str, within: float | None = None) -> Waiter:
    """A waiter on ``channel`` for ``owner`` (it follows the channel's slot on a cluster);
    ``within``: the acquire's remaining timeout, which bounds the wait for confirmation.
    (A lone waiter reading its own grant: :func:`._lone_waiter.waiter_for`.)"""
    relocate = (lambda: subscriber_for(client, channel)) if is_cluster(client) else None
    waiter = subscriber_for(client, channel).waiter(channel, owner, relocate)
    if within is not None:
        waiter.confirm_wait = max(0.0, min(CONFIRM_WAIT, within))
    return waiter
