"""A script call's command in RESP, packed with less work than redis-py's own packer does
per argument (the lock's hot path: :func:`._scripts.run` and its asyncio twin)."""

from __future__ import annotations

from typing import Any

import redis.asyncio.connection
import redis.connection

try:  # hiredis's packer, which redis-py uses too when it is installed
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - depends on the environment
    _hiredis_pack = None  # type: ignore[assignment]


def own_send(connection: Any) -> bool:
    """Whether ``connection`` sends a command the way redis-py's connections do: packed by
    redis-py's packer, then ``send_packed_command`` (the scripts' direct path then packs
    it itself: :func:`packed`). A connection with a ``send_command`` or ``pack_command``
    of its own (its class's, or one set on it: a subclass or instrumentation that logs,
    traces or rewrites commands) is sent every command through its ``send_command``
    instead (False). Looked up at each call, as redis-py would: such a method may be
    installed at any time."""
    kind = connection.__class__
    if (kind.send_command, kind.pack_command) not in _REDIS_SENDS:
        return False
    own = getattr(connection, "__dict__", None)
    return not own or ("send_command" not in own and "pack_command" not in own)


def packed(connection: Any, command: tuple[Any, ...]) -> Any:
    """``command`` in RESP, as ``connection.pack_command(*command)`` packs it, with less
    work on the way (the scripts' hot path: about 14 µs of a call's Python here for some
    25 arguments, against 2.5 µs through hiredis directly, 5 µs in :func:`_pack_plain`).

    The short way is taken only where it gives the very bytes redis-py would: the
    connection's own packer is redis-py's (hiredis's or its Python one), its encoder is
    redis-py's ``Encoder``, UTF-8 with strict errors, and every argument is exactly
    ``bytes``, ``str``, ``int`` or ``float`` for hiredis (written as redis-py writes them),
    or, without hiredis, exactly ``bytes``, ``str`` or ``int``. Anything else (a ``bool``,
    a ``bytearray``, a ``memoryview``, a ``str`` or ``int`` subclass, another encoding or
    encoder class) goes through the connection's packer, which raises its own
    ``DataError`` where it refuses (tests/unit/test_packed.py holds the two ways to the
    same bytes).
    """
    encoder = connection.encoder
    if (
        encoder.__class__ is _Encoder  # (an asyncio connection's encoder_class may differ)
        and encoder.encoding in _UTF8
        and encoder.encoding_errors == "strict"
    ):
        kind = getattr(connection, "_command_packer", _MISSING).__class__
        if (
            kind is _HiredisSerializer
            and _hiredis_pack is not None
            # Exact types only: hiredis takes a str subclass without its own ``encode``
            # (which redis-py calls), and any memoryview as if its buffer were contiguous
            # bytes (redis-py sends the view itself: a strided one fails to send).
            and _HIREDIS_TYPES.issuperset(map(type, command))
        ):
            try:
                return [_hiredis_pack(command)]  # (a list: a sync connection sends each item)
            except (TypeError, ValueError):
                pass  # (refused: redis-py's packer says how, or packs it its own way)
        elif kind in _PYTHON_PACKERS:
            found = _pack_plain(command)
            if found is not None:
                return [found]
    return connection.pack_command(*command)


#: redis-py's own ``send_command`` and ``pack_command`` (sync, asyncio): :func:`own_send`.
_REDIS_SENDS = tuple(
    (kind.send_command, kind.pack_command)
    for kind in (redis.connection.AbstractConnection, redis.asyncio.connection.AbstractConnection)
)
_UTF8 = ("utf-8", "utf8", "UTF-8")
#: The argument types hiredis packs as redis-py's packer does (a float subclass too, by
#: its repr, but it is rare enough to go redis-py's way).
_HIREDIS_TYPES = frozenset((bytes, str, int, float))
_Encoder = getattr(redis.connection, "Encoder", None)
_MISSING = object()
_HiredisSerializer = getattr(redis.connection, "HiredisRespSerializer", None)
#: A connection without hiredis: redis-py's Python packer (a sync connection's), or none
#: (an asyncio connection packs in its own method then).
_PYTHON_PACKERS = tuple(
    kind for kind in (getattr(redis.connection, "PythonRespSerializer", None), type(None)) if kind
)


def _pack_plain(command: tuple[Any, ...]) -> bytes | None:
    """RESP for arguments that are all exactly ``bytes``, ``str`` or ``int`` (None: one
    is not), as redis-py's Python packer writes them."""
    out = [b"*%d\r\n" % len(command)]
    add = out.append
    for arg in command:
        kind = arg.__class__
        if kind is str:
            arg = arg.encode()
        elif kind is int:
            arg = b"%d" % arg
        elif kind is not bytes:
            return None
        add(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)
