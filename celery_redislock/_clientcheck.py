"""Checks of the Redis client a lock is given, made once when the lock is built.

``min_replicas`` against the client kind (a cluster client cannot check replication),
and a warning, once per connection pool, when nothing bounds a command that reached a
Redis which stopped answering (no ``socket_timeout``), or when the client re-sends
commands whose connection failed (lock scripts are not idempotent).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

from ._core import lease_ms
from ._errors import LockConfigurationError
from ._scripts import _direct_pool, is_cluster

log = logging.getLogger("celery_redislock")


def validate_replicas(
    client: Any, min_replicas: object, replica_timeout: object
) -> tuple[int, float]:
    """Check ``min_replicas`` (an int >= 0) and ``replica_timeout`` (seconds, >= 1 ms)."""
    if not isinstance(min_replicas, int) or isinstance(min_replicas, bool) or min_replicas < 0:
        raise LockConfigurationError(
            f"min_replicas must be an int >= 0 (0: do not wait for replicas), got {min_replicas!r}"
        )
    timeout_ms = lease_ms(replica_timeout, "replica_timeout")
    if min_replicas and is_cluster(client):
        raise LockConfigurationError(
            f"min_replicas={min_replicas} is not supported with a Redis Cluster client: "
            f"redis-py sends WAIT to every node, not to the node that took the write, so "
            f"replication could not be checked (use min_replicas=0 on a cluster)"
        )
    return min_replicas, timeout_ms / 1000.0


#: Connection pools already checked by :func:`warn_if_unbounded` (each is checked once).
_checked_pools: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_UNKNOWN = object()


def _connection_default(connection_class: Any, option: str) -> Any:
    """The default of ``option`` in ``connection_class``'s constructor (or ``_UNKNOWN``)."""
    for klass in getattr(connection_class, "__mro__", ()):
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            parameter = inspect.signature(init).parameters.get(option)
        except (TypeError, ValueError):
            return _UNKNOWN
        if parameter is not None:
            return parameter.default
    return _UNKNOWN


def warn_if_unbounded(client: Any, name: str | bytes) -> None:
    """Log once per connection pool when its connections have no ``socket_timeout``.

    Nothing else bounds a command that reached a Redis which stopped answering: the
    lock's own timeouts bound its waits, not a command in flight (see
    docs/guarantees.md, "How long a call can take").
    """
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if pool is None or not isinstance(kwargs, dict):
        return  # a cluster client, or one this cannot inspect
    try:
        if pool in _checked_pools:
            return
        _checked_pools[pool] = True
    except TypeError:  # not weak-referenceable: not checked
        return
    if "socket_timeout" in kwargs:
        timeout = kwargs["socket_timeout"]
    else:  # redis-py's own default, which differs between its versions
        timeout = _connection_default(getattr(pool, "connection_class", None), "socket_timeout")
    if timeout is None:
        log.warning(
            "redislock: the Redis client of lock %r has no socket_timeout: if that Redis stops "
            "answering (paused, overloaded, a network that drops packets), lock calls wait "
            "until it answers again, acquire(timeout=...) and asyncio timeouts included. Set "
            "socket_timeout and socket_connect_timeout on the client (see docs/guarantees.md, "
            "'How long a call can take'). This is logged once per connection pool.",
            name,
        )
    retry = kwargs.get("retry")
    retries = getattr(retry, "_retries", 0) if retry is not None else 0
    if isinstance(retries, int) and retries > 0 and _direct_pool(client) is None:
        # (On a plain redis.Redis the scripts go to a pooled connection directly and are
        # never re-sent: _scripts.run.)
        log.warning(
            "redislock: the Redis client of lock %r re-sends a command whose connection "
            "failed (retry with %d retries). Lock scripts are not idempotent: a re-sent "
            "release can give back two holds (an outer hold's too), a re-sent acquire can "
            "take two. Give lock clients retry=Retry(NoBackoff(), 0) (see docs/concepts.md, "
            "'A release that cannot reach Redis'). This is logged once per connection pool.",
            name,
            retries,
        )
