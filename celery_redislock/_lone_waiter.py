"""A lone waiter reads its own grant: one blocked acquire per pool in a process waits on
a list of its own (its *box*) instead of the shared subscriber.

A direct grant (:mod:`._waiting`, "Direct grants") reaches a waiter through its process's
subscriber thread, which reads it and wakes the waiting thread: a thread switch on every
contended hand-over. A waiter whose wake id names a box (``L<16 hex>``: grant.lua) is
told its grant by a push to ``<channel>:<box id>``, and blocks on that list itself
(BLPOP on a connection of the lock's own pool, ``_scripts.pop_box``): the thread that
waits is the one that reads the grant. It keeps a pooled connection for as long as it
waits, so only one wait per pool and process at a time is a box wait
(:func:`waiter_for`), only on pools that can spare a connection; the others, and
everything the lock's channel says besides the waiter's own grants, go through the
subscriber (docs/concepts.md, "A lone waiter reads its own grant").
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any

import redis
from redis.exceptions import NoPermissionError, ResponseError

from ._keyspace import grant_channel_tail
from ._process import ProcessRegistry
from ._replies import decode_box
from ._scripts import _direct_pool, pop_box
from ._waiting import BROKEN, Waiter, WaiterBase
from ._waiting import waiter_for as subscriber_waiter_for

log = logging.getLogger(__name__)

#: False: every blocked acquire waits through the subscriber (no :class:`BoxWaiter`).
LONE_WAITERS = True
#: A pool's lone waiter uses its pool only if the pool may open this many connections (it
#: keeps one for as long as it waits).
BOX_MIN_CONNECTIONS = 8
#: A box read ends this long before the connection's socket timeout; a pool whose socket
#: timeout is shorter than BOX_MIN_TIMEOUT has no lone waiters (its reads would all be
#: shorter than ``_scripts.PRECISE_POP_UNDER``: each one that times out drops its
#: connection).
BOX_SOCKET_MARGIN = 0.25
BOX_MIN_TIMEOUT = 1.5


def waiter_for(
    client: Any, channel: bytes, owner: str, within: float | None = None, *, lone: bool = False
) -> Waiter | BoxWaiter:
    """A waiter on ``channel`` for ``owner`` (``_waiting.waiter_for``'s arguments). ``lone``:
    the acquire takes direct grants; it reads its own (:class:`BoxWaiter`) if it is its
    pool's only such waiter in this process and the pool can spare a connection."""
    if lone:
        box = _box_waiter(client, channel, owner, within)
        if box is not None:
            return box
    return subscriber_waiter_for(client, channel, owner, within)


class BoxWaiter(WaiterBase):
    """A blocked acquire that reads its direct grant itself: the only one of its pool in
    this process at a time (:func:`waiter_for`).

    Its wake id names a list, its *box* (``<channel>:<box id>``, the box id starting with
    ``L``), instead of a subscriber: a release that grants it the lock pushes
    ``<token>:<nonce>`` there (grant.lua), and the waiting thread, blocked on the box
    (BLPOP on a connection of the lock's own pool), returns with it. No subscriber thread
    wakes it: one thread switch less between a release and the acquire it ends. A grant
    to it the usual way (a ``LockedTask``'s release: count 0, its owner id published on
    the lock's channel) is pushed to its box too, and it retries at once. Other wake-ups
    (a release with nobody in line, an expired holder) reach it when its wait, bounded
    by the holder's lease as any waiter's, ends.

    A Redis user that may not BLPOP (``NOPERM``) sends the waiter, and later ones of its
    pool, back to the subscriber: the wait goes on as a :class:`Waiter`.
    """

    __slots__ = (
        "_answered", "_box_id", "_client", "_fallback", "_pool", "_pool_box", "_read_for",
        "_within", "box",
    )  # fmt: skip

    def __init__(
        self,
        client: Any,
        pool: Any,
        name: bytes,
        owner: str,
        within: float | None,
        pool_box: _PoolBox,
    ):
        super().__init__(None, name, owner, None, None)
        self._client = client
        self._pool = pool
        #: The pool's lone wait this waiter took (:func:`_box_waiter`), given back on exit.
        self._pool_box = pool_box
        self._box_id = b"L" + secrets.token_hex(8).encode()
        self.box = name + grant_channel_tail(self._box_id)
        self._fallback: Waiter | None = None
        #: Whether an attempt made after the fallback has been answered (it reached Redis:
        #: from then on the line names the wait by the fallback's wake id).
        self._answered = False
        timeout = pool.connection_kwargs.get("socket_timeout")
        #: A read must end before the connection's socket timeout (None: no limit).
        self._read_for = None if timeout is None else timeout - BOX_SOCKET_MARGIN
        #: The acquire's timeout: bounds a fallback's wait for its subscription.
        self._within = within

    def _grant_id(self) -> bytes | None:
        return self._box_id

    def __enter__(self) -> BoxWaiter:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._fallback is not None:
                self._fallback.__exit__(None, None, None)
        finally:
            self._pool_box.done()

    @property
    def grant_name(self) -> bytes:
        """How a direct grant to this wait is named in Redis: the box's until an attempt
        made after a fallback is answered. An attempt that failed may never have reached
        Redis, whose line still names the box then; leaving, or remembering a failed leave
        (``AbandonedWaits``), under the fallback's name would not match that grant, and
        the owner's next acquire would count it as a re-entry on top of it."""
        if self._fallback is not None and self._answered:
            return self._fallback.grant_name
        return super().grant_name

    def next_wake_id(self) -> bytes:
        if self._fallback is not None:
            return self._fallback.next_wake_id()
        return super().next_wake_id()

    def take_grant(self) -> int | None:
        if self._fallback is not None:
            return self._fallback.take_grant()
        return super().take_grant()

    def _fall_back(self) -> bool:
        """The rest of this wait goes through the subscriber: retry at once (True). A grant
        pushed to the box meanwhile, or lost with a failed read, is still the owner's hold
        in Redis: the next blocked attempt takes it up (acquire.lua)."""
        self._fallback = subscriber_waiter_for(
            self._client, self._name, self.owner.decode(), self._within
        )
        self._fallback.__enter__()
        return True

    def wait(self, timeout: float) -> bool:
        """Block on the box until a grant (True) or ``timeout`` (False); a read that fails
        or is refused sends the rest of the wait to the subscriber (True: retry now)."""
        if self._fallback is not None:
            # Called after an attempt answered: one made after the fallback, if any.
            self._answered = self._answered or self._fallback.attempt > 0
            return self._fallback.wait(timeout)
        read_for = timeout if self._read_for is None else min(timeout, self._read_for)
        try:
            reply = pop_box(self._pool, self.box, read_for)
        except NoPermissionError as exc:
            self._pool_box.refuse(exc)
            return self._fall_back()
        except (*BROKEN, ResponseError) as exc:
            # The read failed (its grant, if any, may be lost with it), or Redis refused it
            # (WRONGTYPE: a key of another type put at the box by a prefix writer).
            log.debug("redislock: a box read failed (%r); waiting through the subscriber", exc)
            return self._fall_back()
        popped = decode_box(reply)
        if popped is None:
            return False
        nonce, token = popped
        if nonce == self.nonce and token is not None:
            self.granted = (nonce, token)
        return True


class _PoolBox:
    """One connection pool's lone wait in this process: whether one is on now, and whether
    the pool's Redis user was refused BLPOP."""

    __slots__ = ("busy", "mutex", "refused")

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.busy = False
        self.refused = False

    def take(self) -> bool:
        with self.mutex:
            if self.busy or self.refused:
                return False
            self.busy = True
            return True

    def done(self) -> None:
        with self.mutex:
            self.busy = False

    def refuse(self, exc: Exception) -> None:
        with self.mutex:
            known, self.refused = self.refused, True
        if not known:
            log.warning(
                "redislock: Redis refused BLPOP (%s); blocked acquires wait through the "
                "subscriber only (grant BLPOP on the prefix's keys for the faster wake-up)",
                exc,
            )


#: Per connection pool, its lone wait in this process (a forked child starts afresh).
_pool_boxes: ProcessRegistry[Any, _PoolBox] = ProcessRegistry()


def _pool_box(pool: Any) -> _PoolBox:
    return _pool_boxes.get(pool, _PoolBox)


def _box_waiter(client: Any, name: bytes, owner: str, within: float | None) -> BoxWaiter | None:
    """A :class:`BoxWaiter` if ``client``'s pool has no lone waiter in this process now
    and can have one: a plain client whose scripts run on its pool directly
    (``_scripts._direct_pool``), enough connections, a socket timeout long enough to
    wait in, a Redis user allowed BLPOP."""
    if not LONE_WAITERS:
        return None
    pool = _direct_pool(client)
    if pool is None or not isinstance(client, redis.Redis):
        return None
    timeout = pool.connection_kwargs.get("socket_timeout")
    if (timeout is not None and timeout < BOX_MIN_TIMEOUT) or (
        getattr(pool, "max_connections", 0) < BOX_MIN_CONNECTIONS
    ):
        return None
    pool_box = _pool_box(pool)
    if not pool_box.take():
        return None
    return BoxWaiter(client, pool, name, owner, within, pool_box)
