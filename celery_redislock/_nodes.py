"""Which Redis server each node of a quorum is, so that one server is never counted twice.

A quorum lock is only as safe as its nodes are independent: ``localhost:6379`` and
``127.0.0.1:6379``, two databases of one server, or one client passed twice would let
a single server cast two votes. Each node (a redis-py client or a URL) is reduced to
the addresses it connects to, resolved once when the lock or the settings are built:
the host through :func:`socket.getaddrinfo` (a name that does not resolve is compared
by name), a unix socket by its real path. Two nodes that share an address, a client
object or a connection pool are the same server. Nothing here sends a command.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import weakref
from typing import Any

from ._errors import LockConfigurationError

#: Resolved addresses per connection pool: a pool's clients are checked once per process.
_resolved: weakref.WeakKeyDictionary[Any, frozenset[tuple[str, ...]]] = weakref.WeakKeyDictionary()


def node_label(node: Any) -> str:
    """``host:port`` (or ``unix:path``) of a redis-py client or URL, without credentials."""
    kwargs = _connection_kwargs(node)
    if kwargs is None:
        return "?"
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    host = kwargs.get("host", "?")
    shown = f"[{host}]" if ":" in str(host) else host
    return f"{shown}:{kwargs.get('port', 6379)}"


def _connection_kwargs(node: Any) -> dict[str, Any] | None:
    if isinstance(node, str):
        from redis.connection import parse_url

        return dict(parse_url(node))  # type: ignore[no-untyped-call]
    pool = getattr(node, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None) if pool is not None else None
    return dict(kwargs) if isinstance(kwargs, dict) else None


def _address(host: str, port: int) -> tuple[str, ...]:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ("tcp", host, str(port))
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return ("tcp", str(mapped or ip), str(port))


def _resolve(kwargs: dict[str, Any]) -> frozenset[tuple[str, ...]]:
    if "path" in kwargs:
        return frozenset({("unix", os.path.realpath(str(kwargs["path"])))})
    host = kwargs.get("host")
    if not isinstance(host, str):
        return frozenset()  # a Sentinel pool: no fixed address to compare
    port = int(kwargs.get("port") or 6379)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # unresolvable now: compare by name
        return frozenset({("name", host.lower().rstrip("."), str(port))})
    return frozenset(_address(str(info[4][0]), port) for info in found)


def addresses(node: Any) -> frozenset[tuple[str, ...]]:
    """What identifies the server ``node`` reaches: its resolved addresses, plus the
    client object and its connection pool (a client without an address, such as a
    Sentinel ``master_for`` client, is identified by those alone)."""
    marks = {("object", str(id(node)))}
    pool = None if isinstance(node, str) else getattr(node, "connection_pool", None)
    if pool is None:
        kwargs = _connection_kwargs(node)
        return (_resolve(kwargs) if kwargs is not None else frozenset()) | marks
    marks.add(("pool", str(id(pool))))
    with contextlib.suppress(TypeError):  # a pool that is not weak-referenceable
        cached = _resolved.get(pool)
        if cached is not None:
            return cached | marks
    kwargs = _connection_kwargs(node)
    found = _resolve(kwargs) if kwargs is not None else frozenset()
    with contextlib.suppress(TypeError):
        _resolved[pool] = found
    return found | marks


#: Which shared mark an error names first: an address says more than an object identity.
_SHOWN_FIRST = ("tcp", "unix", "name", "pool", "object")


def _shown(mark: tuple[str, ...]) -> str:
    kind, *rest = mark
    if kind == "unix":
        return f"unix:{rest[0]}"
    if kind in ("object", "pool"):
        return f"the same {'client object' if kind == 'object' else 'connection pool'}"
    host, port = rest
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def check_distinct(nodes: list[Any], argument: str) -> None:
    """Raise :class:`LockConfigurationError` naming ``argument`` when two of ``nodes``
    reach the same Redis server."""
    seen: list[frozenset[tuple[str, ...]]] = []
    for index, node in enumerate(nodes):
        try:
            found = addresses(node)
        except ValueError as exc:  # a URL redis-py cannot parse
            raise LockConfigurationError(
                f"{argument}[{index}] is not a Redis URL redis-py can parse: {exc}"
            ) from None
        for earlier, marks in enumerate(seen):
            shared = found & marks
            if shared:
                mark = min(shared, key=lambda m: _SHOWN_FIRST.index(m[0]))
                raise LockConfigurationError(
                    f"{argument} lists one Redis server twice: {argument}[{earlier}] "
                    f"({node_label(nodes[earlier])}) and {argument}[{index}] "
                    f"({node_label(node)}) both reach {_shown(mark)}; a quorum needs "
                    f"independent Redis masters"
                )
        seen.append(found)
