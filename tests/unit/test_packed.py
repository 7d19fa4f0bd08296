"""The scripts' own command packing (``_scripts.packed``) gives the bytes redis-py's
packer gives, or refuses what it refuses, for every kind of connection and argument."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.connection import PythonRespSerializer

from celery_redislock import _packing, _scripts
from celery_redislock._packing import packed


def _sync_python() -> redis.Connection:
    connection = redis.Connection()
    connection._command_packer = PythonRespSerializer(
        connection._buffer_cutoff, connection.encoder.encode
    )
    return connection


def _async_python() -> redis.asyncio.Connection:
    connection = redis.asyncio.Connection()
    connection._command_packer = None  # what an asyncio connection has without hiredis
    return connection


def _connections() -> list[object]:
    """Every packer a connection of redis-py's may have here: its Python one (sync and
    asyncio), hiredis's where installed, and another encoding (redis-py's way only)."""
    found: list[object] = [_sync_python(), _async_python(), redis.Connection(encoding="latin-1")]
    if _packing._hiredis_pack is not None:
        found += [redis.Connection(), redis.asyncio.Connection()]
    return found


def _redis_py(connection: object, command: tuple[object, ...]) -> bytes | type[BaseException]:
    try:
        parts = connection.pack_command(*command)  # type: ignore[attr-defined]
    except Exception as exc:
        return type(exc)
    return parts if isinstance(parts, bytes) else b"".join(parts)


def _ours(connection: object, command: tuple[object, ...]) -> bytes | type[BaseException]:
    try:
        found = packed(connection, command)
    except Exception as exc:
        return type(exc)
    return found if isinstance(found, bytes) else b"".join(found)


class _Str(str):
    pass


class _Int(int):
    pass


ARGUMENTS = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.binary(max_size=10).map(bytearray),
    st.binary(max_size=10).map(memoryview),
    st.text(max_size=5).map(_Str),
    st.integers(-5, 5).map(_Int),
    st.none(),
    st.just("\ud800"),  # not encodable: both refuse
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ARGUMENTS, max_size=30))
def test_packed_is_what_redis_py_packs(arguments: list[object]) -> None:
    command = ("EVALSHA", "f" * 40, 0, *arguments)
    for connection in _connections():
        assert _ours(connection, command) == _redis_py(connection, command), connection


def test_a_script_call_s_arguments_reach_the_server_as_sent(redis_server) -> None:
    """Through the direct path, on a real server: what the script sees is what was sent."""
    client = redis_server.client()
    try:
        echo = client.register_script("return {KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4]}")
        echo(keys=[b"k"], args=["x"])  # loaded
        pool = _scripts._direct_pool(client)
        assert pool is not None
        reply = _scripts.run(client, echo, [b"k\xff"], ["é", 12, -7, b"\x00\r\n"])
        assert reply == [b"k\xff", "é".encode(), b"12", b"-7", b"\x00\r\n"]
        with pytest.raises(redis.DataError):
            _scripts.run(client, echo, [b"k"], [True])
        assert client.ping()  # the refused call sent nothing: the connection is in step
    finally:
        client.close()
