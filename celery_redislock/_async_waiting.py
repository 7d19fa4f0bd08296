"""How asyncio waiters wake: :class:`AsyncSubscriber`, one reader task per pool per loop.

The asyncio twin of :mod:`celery_redislock._waiting` (see its docstring for the
protocol: reference-counted subscriptions, direct grants, sharded pub/sub on a
cluster). What both subscribers decide (which commands (un)subscribe, what a reply
means, which channels are idle, who is woken when the connection breaks) lives there,
in ``SubscriberBase`` and ``WaiterBase``; this module only drives the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import Any, Callable

from redis.exceptions import ResponseError

from ._core import cancel_and_wait, wait_event
from ._process import ProcessRegistry
from ._scripts import is_cluster
from ._waiting import (
    BROKEN,
    CONFIRM_WAIT,
    READ_SLICE,
    SubscriberBase,
    WaiterBase,
    _Channel,
)

log = logging.getLogger(__name__)


class _AsyncChannel(_Channel):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__()
        self.confirmed = asyncio.Event()


class AsyncWaiter(WaiterBase):
    """The asyncio twin of :class:`Waiter` (``async with``)."""

    __slots__ = ()

    def __init__(
        self,
        subscriber: AsyncSubscriber,
        name: bytes,
        owner: str,
        relocate: Callable[[], AsyncSubscriber] | None = None,
    ) -> None:
        super().__init__(subscriber, name, owner, relocate, asyncio.Event())

    async def __aenter__(self) -> AsyncWaiter:
        try:
            self._channel = await self._subscriber._register(self._name, self)
            await wait_event(self._channel.confirmed, self.confirm_wait)
        except BaseException:
            self._subscriber._unregister(self._name, self)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._subscriber._unregister(self._name, self)

    async def wait(self, timeout: float) -> bool:
        assert self._channel is not None
        if self._channel.moved and self._relocate is not None:
            self._subscriber._unregister(self._name, self)
            self._subscriber = self._relocate()
            self._channel = await self._subscriber._register(self._name, self)
        end = self._end(timeout)
        while True:
            left = self._bound(end)
            if left > 0 and not self.event.is_set():
                await wait_event(self.event, left)
            woken = self._woken(end)
            if woken is not None:
                return woken


class AsyncSubscriber(SubscriberBase):
    """The subscriber of one ``redis.asyncio`` pool in one event loop; a reader task, no thread."""

    def __init__(self, pool: Any, *, sharded: bool = False) -> None:
        # ``pool``: anything with ``connection_class`` and ``connection_kwargs`` (a
        # connection pool, or an asyncio cluster node). A pool weakly, as a sync
        # Subscriber's: the registry of subscribers is keyed weakly by it.
        self._pool: Callable[[], Any] = _weakly(pool)
        self.sharded = sharded
        self._channels: dict[bytes, _AsyncChannel] = {}
        self._conn: Any = None
        self._task: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()  # one connection, however many tasks subscribe at once
        self._init_grants()

    def waiter(
        self,
        channel: bytes,
        owner: str,
        relocate: Callable[[], AsyncSubscriber] | None = None,
    ) -> AsyncWaiter:
        return AsyncWaiter(self, channel, owner, relocate)

    async def _subscribe(self, names: list[bytes], unsubscribe: bool = False) -> None:
        for command in self._subscribe_commands(names, unsubscribe):
            await self._send(*command)

    async def _register(self, name: bytes, waiter: AsyncWaiter) -> _AsyncChannel:
        channel = self._channels.get(name)
        if channel is None:
            channel = self._channels[name] = _AsyncChannel()
            channel.waiters.append(waiter)
            await self._subscribe([name])
        else:
            channel.waiters.append(waiter)
        channel.idle_since = None
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return channel

    def _unregister(self, name: bytes, waiter: AsyncWaiter) -> None:
        self._drop_waiter(name, waiter)

    async def _send(self, *args: Any) -> None:
        async with self._send_lock:
            try:
                if self._conn is None:
                    pool = self._pool()
                    if pool is None:  # nobody can be waiting on it any more
                        return
                    conn = pool.connection_class(**pool.connection_kwargs)
                    await conn.connect()
                    self._conn = conn
                await self._conn.send_command(*args, check_health=False)
            except BROKEN as exc:
                log.debug("redislock subscriber could not send %s: %r", args[0], exc)
                await self._drop_connection()

    async def aclose(self) -> None:
        """Stop the reader task and close the connection (waiters retry on their own)."""
        await cancel_and_wait(self._task)

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # best effort on a broken socket
                await conn.disconnect(nowait=True)
        self._kick_all()

    async def _run(self) -> None:
        failures = 0
        try:
            while True:
                await self._sweep()
                if not self._channels:
                    return
                if self._conn is None:
                    await self._subscribe(list(self._channels))
                conn = self._conn
                if conn is None:
                    failures += 1
                    await asyncio.sleep(min(1.0, 0.02 * 2**failures))
                    continue
                try:
                    reply = await conn.read_response(
                        disable_decoding=True, timeout=READ_SLICE, push_request=True
                    )
                except BROKEN as exc:
                    log.warning("redislock subscriber connection lost (%r); resubscribing", exc)
                    if self._conn is conn:
                        await self._drop_connection()
                    continue
                except ResponseError as exc:
                    if not (self.sharded and str(exc).startswith(("MOVED", "ASK"))):
                        raise
                    self._moved(self._unconfirmed())
                    continue
                failures = 0
                if reply is not None:
                    self._dispatch(reply)
        finally:
            self._task = None
            conn, self._conn = self._conn, None
            if conn is not None:
                await conn.disconnect()

    def _dispatch(self, reply: Any) -> None:
        moved = self._apply(reply)
        if moved is not None:
            self._moved([moved])

    async def _sweep(self) -> None:
        idle = self._drop_idle()
        if idle and self._conn is not None:
            await self._subscribe(idle, unsubscribe=True)


#: Event loop -> connection pool -> its subscriber, in this process (a forked child starts empty).
_async_subscribers: ProcessRegistry[Any, weakref.WeakKeyDictionary[Any, AsyncSubscriber]]
_async_subscribers = ProcessRegistry()


_PerClient = weakref.WeakKeyDictionary[Any, dict[str, AsyncSubscriber]]
#: Cluster clients: event loop -> client -> node name -> that node's sharded subscriber.
_async_cluster_subscribers: ProcessRegistry[Any, _PerClient] = ProcessRegistry()


def _weakly(pool: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(pool)
    except TypeError:  # an asyncio cluster node (slots): its client's registry is weak
        return lambda: pool


def async_subscriber_for(
    client: Any, channel: bytes | None = None, *, create: bool = True
) -> AsyncSubscriber | None:
    """The subscriber shared by every asyncio lock on ``client``'s pool in this event loop.

    For a ``redis.asyncio`` cluster client: the sharded subscriber of the node that owns
    ``channel``'s slot (``channel`` is then required).
    """
    loop = asyncio.get_running_loop()
    if is_cluster(client):
        if channel is None:
            raise TypeError("a Redis Cluster client's subscriber depends on the channel: pass it")
        node = client.get_node_from_key(channel)
        per_client = _async_cluster_subscribers.get(loop, weakref.WeakKeyDictionary)
        nodes = per_client.setdefault(client, {})
        found = nodes.get(node.name)
        if found is None and create:
            found = nodes[node.name] = AsyncSubscriber(node, sharded=True)
        return found
    per_loop = _async_subscribers.get(loop, weakref.WeakKeyDictionary)
    found = per_loop.get(client.connection_pool)
    if found is None and create:
        found = per_loop[client.connection_pool] = AsyncSubscriber(client.connection_pool)
    return found


def async_waiter_for(
    client: Any, channel: bytes, owner: str, within: float | None = None
) -> AsyncWaiter:
    """An asyncio waiter on ``channel`` for ``owner`` (follows the slot on a cluster);
    ``within`` as :func:`waiter_for`'s."""

    def relocate() -> AsyncSubscriber:
        found = async_subscriber_for(client, channel)
        assert found is not None
        return found

    waiter = relocate().waiter(channel, owner, relocate if is_cluster(client) else None)
    if within is not None:
        waiter.confirm_wait = max(0.0, min(CONFIRM_WAIT, within))
    return waiter


def async_subscribers_of(client: Any) -> list[AsyncSubscriber]:
    """Every subscriber of ``client`` in the running event loop (for shutdown)."""
    loop = asyncio.get_running_loop()
    if is_cluster(client):
        per_client = _async_cluster_subscribers.peek(loop)
        return [] if per_client is None else list(per_client.get(client, {}).values())
    found = async_subscriber_for(client, create=False)
    return [] if found is None else [found]
