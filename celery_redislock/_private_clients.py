"""The clients the library opens for itself: private and bounded.

The watchdog (:mod:`._renewal`) and the quorum locks' per-node requests
(:mod:`._quorum_runtime`) must not wait on a user's pool (exhausted, or without socket
timeouts) nor behind redis-py's own retries: a stalled server must cost one attempt of a
known length. :func:`bounded_client` builds such a client on the server(s) a user's client
(or a ``redis://`` URL) reaches: same connection options (TLS, credentials, database), its
own pool, socket timeouts of ``timeout`` at most, no retries inside redis-py. A Sentinel
pool keeps its service and sentinels; a Redis Cluster client gets a cluster client of its
own on the same nodes.

The subscribers (:mod:`._waiting`, :mod:`._async_waiting`) open their pub/sub connection
from the user's pool's connection class and options as they are: a subscription waits
for messages indefinitely, so it keeps the user's timeouts and is not built here.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import weakref
from typing import Any, Sequence

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from ._scripts import is_cluster

log = logging.getLogger(__name__)

#: Connection options a cluster client sets up for itself (bound to that client).
_CLUSTER_INTERNAL = ("redis_connect_func", "oss_cluster_maint_notifications_handler")


def bounded_client(
    client: Any, timeout: float, *, asyncio_client: bool, max_connections: int | None = None
) -> Any:
    """A client on a private pool whose socket timeouts are ``timeout`` at most and that
    never retries inside redis-py, on the server ``client`` reaches (a redis-py client of
    the kind ``asyncio_client`` says, or a ``redis://`` URL); ``max_connections`` bounds
    its pool. A client without a pool that is not a cluster client is returned as it is."""
    if isinstance(client, str):
        return _from_url(client, timeout, asyncio_client=asyncio_client)
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return _cluster_client(client, timeout) if is_cluster(client) else client
    kwargs = _bounded(pool.connection_kwargs, timeout)
    # One attempt: a stalled server costs ``timeout`` once, not redis-py's default 3
    # retries with backoff (the callers retry by themselves, when they should).
    kwargs["retry"] = (AsyncRetry if asyncio_client else Retry)(NoBackoff(), 0)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    service = getattr(pool, "service_name", None)
    if service is not None and hasattr(pool, "sentinel_manager"):
        # A Sentinel-managed pool: same service, same sentinels (the pool's proxy entry
        # in connection_kwargs belongs to the user's pool).
        kwargs.pop("connection_pool", None)
        own_pool = type(pool)(
            service,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            is_master=getattr(pool, "is_master", True),
            check_connection=getattr(pool, "check_connection", False),
            **kwargs,
        )
    else:
        own_pool = type(pool)(connection_class=pool.connection_class, **kwargs)
    return type(client)(connection_pool=own_pool)


def close_with(
    owner: Any, clients: Sequence[Any], given: Sequence[Any]
) -> weakref.finalize[Any, Any]:
    """Close the connections of ``clients`` that are private (none of ``given``, the
    caller's own clients or URLs) when ``owner`` is gone: a lock made per task must not
    leave a socket open per node each time. Returns the finalizer (call it to close now).

    A ``redis.asyncio`` client cannot be awaited then: its connections are closed
    without waiting (as redis-py does for a client collected unclosed), if their event
    loop still runs; ``aclose()`` closes them properly.
    """
    private = [c for c in clients if not any(c is g for g in given)]
    return weakref.finalize(owner, _close_now, private)


def private_clients(closer: weakref.finalize[Any, Any]) -> list[Any]:
    """The private clients ``closer`` (:func:`close_with`'s) would close, now the caller's
    to close: ``closer`` is detached (none after the first call)."""
    detached = closer.detach()
    return list(detached[2][0]) if detached is not None else []


async def aclose_private(client: Any) -> None:
    """Close a private ``redis.asyncio`` client and its pool (a client built on a pool
    it was given does not close it)."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        await pool.disconnect()


def _close_now(clients: list[Any]) -> None:
    for client in clients:
        try:
            _close_connections(client)
        except Exception as exc:  # closing is best effort: the sockets go with the client
            log.debug("redislock: closing a private client failed: %r", exc)


def _close_connections(client: Any) -> None:
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a cluster client: a pool per node (sync), a list per node (asyncio)
        if hasattr(client, "disconnect_connection_pools"):
            client.disconnect_connection_pools()
        else:
            for node in client.get_nodes():
                _close_async(getattr(node, "_connections", ()))
    elif inspect.iscoroutinefunction(pool.disconnect):
        _close_async(itertools.chain(pool._available_connections, pool._in_use_connections))
    else:
        pool.disconnect()


def _close_async(connections: Any) -> None:
    for connection in list(connections):
        # Its loop closed: its transport cannot be closed any more (redis-py warns).
        with contextlib.suppress(RuntimeError):
            connection._close()


def _from_url(url: str, timeout: float, *, asyncio_client: bool) -> Any:
    if asyncio_client:
        import redis.asyncio

        return redis.asyncio.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=AsyncRetry(NoBackoff(), 0),
        )
    import redis

    return redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )


def _bounded(kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    kwargs = dict(kwargs)
    for option in ("socket_timeout", "socket_connect_timeout"):
        kwargs[option] = min(kwargs.get(option) or timeout, timeout)
    return kwargs


def _cluster_client(client: Any, timeout: float) -> Any:
    """A private cluster client on the same nodes with bounded timeouts (or ``client``)."""
    node_class = type(client.get_nodes()[0]) if client.get_nodes() else None
    startup = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
    try:
        kwargs = {
            k: v for k, v in client.get_connection_kwargs().items() if k not in _CLUSTER_INTERNAL
        }
        params = inspect.signature(type(client)).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            # redis.asyncio's cluster takes named options only (SSL as ``ssl=True``).
            connection_class = kwargs.pop("connection_class", None)
            if connection_class is not None and "SSL" in connection_class.__name__:
                kwargs["ssl"] = True
            kwargs = {k: v for k, v in kwargs.items() if k in params and k != "startup_nodes"}
        kwargs = _bounded(kwargs, timeout)
        node_class = node_class or type(startup[0])
        nodes = [node_class(n.host, n.port) for n in startup]
        return type(client)(startup_nodes=nodes, **kwargs)
    except Exception as exc:  # an unusual client: use it, as it is
        log.debug("redislock: sharing the cluster client (no private one: %r)", exc)
        return client
