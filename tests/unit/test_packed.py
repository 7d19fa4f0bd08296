"""The scripts' own command packing (``_scripts.packed``) gives the bytes redis-py's
packer gives, or refuses what it refuses, for every kind of connection and argument."""

from __future__ import annotations

import array
from typing import ClassVar

import pytest
import redis
import redis.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from redis._parsers import Encoder
from redis.connection import PythonRespSerializer

from celery_redislock import AsyncRedisLock, RedisLock, _packing, _scripts
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


class _PrefixingEncoder(Encoder):
    """An asyncio connection's ``encoder_class`` of its own: its packing is redis-py's."""

    def encode(self, value):  # type: ignore[no-untyped-def]
        if isinstance(value, str):
            return b"p:" + value.encode()
        return super().encode(value)


def _async_own_encoder() -> redis.asyncio.Connection:
    connection = redis.asyncio.Connection(encoder_class=_PrefixingEncoder)
    connection._command_packer = None
    return connection


def _connections() -> list[object]:
    """Every packer a connection of redis-py's may have here: its Python one (sync and
    asyncio), hiredis's where installed, another encoding and an encoder class of its
    own (redis-py's way only)."""
    found: list[object] = [
        _sync_python(),
        _async_python(),
        redis.Connection(encoding="latin-1"),
        _async_own_encoder(),
    ]
    if _packing._hiredis_pack is not None:
        found += [
            redis.Connection(),
            redis.asyncio.Connection(),
            redis.asyncio.Connection(encoder_class=_PrefixingEncoder),
        ]
    return found


def _redis_py(connection: object, command: tuple[object, ...]) -> bytes | type[BaseException]:
    try:  # (joined as the socket would take the parts: a strided memoryview fails)
        parts = connection.pack_command(*command)  # type: ignore[attr-defined]
        return parts if isinstance(parts, bytes) else b"".join(parts)
    except Exception as exc:
        return type(exc)


def _ours(connection: object, command: tuple[object, ...]) -> bytes | type[BaseException]:
    try:
        found = packed(connection, command)
        return found if isinstance(found, bytes) else b"".join(found)
    except Exception as exc:
        return type(exc)


class _Str(str):
    pass


class _Int(int):
    pass


class _OwnEncode(str):
    """A str that encodes itself its own way (redis-py calls ``value.encode``)."""

    def encode(self, *args: object, **kwargs: object) -> bytes:
        return b"own:" + str.encode(self)


ARGUMENTS = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.binary(max_size=10).map(bytearray),
    st.binary(max_size=10).map(memoryview),
    st.text(max_size=5).map(_Str),
    st.text(max_size=5).map(_OwnEncode),
    # hiredis copies a memoryview's buffer as if contiguous bytes; redis-py sends it
    # as it is (a strided one fails, one of wider items has its length in items)
    st.binary(min_size=2, max_size=10).map(lambda b: memoryview(b)[::2]),
    st.lists(st.integers(-5, 5), max_size=3).map(lambda i: memoryview(array.array("i", i))),
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


@pytest.mark.parametrize(
    "argument",
    [
        memoryview(b"abcdef")[::2],  # hiredis would send b"abc"; redis-py refuses to send it
        memoryview(array.array("i", [1, 2])),
        _OwnEncode("x"),
        True,
        _Int(3),
    ],
    ids=["strided-memoryview", "int-memoryview", "str-own-encode", "bool", "int-subclass"],
)
def test_what_hiredis_takes_its_own_way_goes_redis_py_s_way(argument: object) -> None:
    command = ("EVALSHA", "f" * 40, 1, b"k", argument)
    for connection in _connections():
        assert _ours(connection, command) == _redis_py(connection, command), connection


def test_an_encoder_class_of_its_own_packs_redis_py_s_way() -> None:
    command = ("EVALSHA", "f" * 40, 1, "k", 5)
    own = redis.asyncio.Connection(encoder_class=_PrefixingEncoder)
    for connection in (_async_own_encoder(), own):
        assert _ours(connection, command) == _redis_py(connection, command)
        assert b"p:k" in _ours(connection, command)  # type: ignore[operator]


def _counting_plain(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    plain = _packing._pack_plain

    def counted(command: tuple[object, ...]) -> bytes | None:
        calls.append(1)
        return plain(command)

    monkeypatch.setattr(_packing, "_pack_plain", counted)
    return calls


def test_a_flushed_script_cache_is_reloaded_through_the_plain_packer(
    redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOSCRIPT on a connection with redis-py's Python packer: SCRIPT LOAD, EVALSHA again
    (packed by ``_pack_plain``), the lock acquired and released, the connection in step."""
    calls = _counting_plain(monkeypatch)
    pool = redis.ConnectionPool(
        port=redis_server.port,
        socket_timeout=5.0,
        command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
    )
    client = redis.Redis(connection_pool=pool)
    try:
        lock = RedisLock(client, "packed-noscript", auto_renew=False)
        client.script_flush()
        assert lock.acquire(blocking=False)
        client.script_flush()
        lock.release()
        assert not client.exists(lock.keys.lock)
        assert calls  # the plain packer's way, not the connection's
        assert client.ping()
    finally:
        client.close()


async def test_an_asyncio_flushed_script_cache_is_reloaded_without_hiredis(
    redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_plain(monkeypatch)
    client = redis.asyncio.Redis(port=redis_server.port, socket_timeout=5.0)
    real = client.connection_pool.get_connection

    async def without_hiredis(*args: object, **kwargs: object) -> object:
        connection = await real(*args, **kwargs)
        connection._command_packer = None  # as without hiredis
        return connection

    monkeypatch.setattr(client.connection_pool, "get_connection", without_hiredis)
    try:
        lock = AsyncRedisLock(client, "packed-noscript-aio", auto_renew=False)
        await client.script_flush()
        assert await lock.acquire(blocking=False)
        await client.script_flush()
        await lock.release()
        assert not await client.exists(lock.keys.lock)
        assert calls
    finally:
        await client.aclose()


class _Recording(redis.Connection):
    """A connection class with a ``send_command`` of its own (as one that logs or traces
    commands has): it sees every command its connections send."""

    sent: ClassVar[list[bytes]] = []

    def send_command(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _Recording.sent.append(str(args[0]).encode())
        return super().send_command(*args, **kwargs)


class _AsyncRecording(redis.asyncio.Connection):
    """An asyncio connection class with a ``pack_command`` of its own (redis-py's asyncio
    ``send_command`` packs through it)."""

    packed_names: ClassVar[list[str]] = []

    def pack_command(self, *args):  # type: ignore[no-untyped-def]
        _AsyncRecording.packed_names.append(str(args[0]))
        return super().pack_command(*args)


def test_a_connection_class_s_own_send_command_sends_the_scripts(redis_server) -> None:
    """The direct path packs a script call itself only for redis-py's own way of sending;
    a class with its own ``send_command`` gets every script call (and its NOSCRIPT reload)
    through it, with the lock working as ever."""
    _Recording.sent = []
    pool = redis.ConnectionPool(
        port=redis_server.port, socket_timeout=5.0, connection_class=_Recording
    )
    client = redis.Redis(connection_pool=pool)
    try:
        assert _scripts._direct_pool(client) is pool
        lock = RedisLock(client, "own-send", auto_renew=False)
        client.script_flush()
        assert lock.acquire(blocking=False)
        lock.release()
        assert not client.exists(lock.keys.lock)
        # acquire: EVALSHA (NOSCRIPT), SCRIPT LOAD, EVALSHA; release: EVALSHA (NOSCRIPT),
        # SCRIPT LOAD, EVALSHA
        assert _Recording.sent.count(b"EVALSHA") == 4
        assert _Recording.sent.count(b"SCRIPT") == 2
        assert client.ping()
    finally:
        client.close()
        pool.disconnect()


async def test_an_asyncio_connection_class_s_own_packer_packs_the_scripts(redis_server) -> None:
    _AsyncRecording.packed_names = []
    pool = redis.asyncio.ConnectionPool(
        port=redis_server.port, socket_timeout=5.0, connection_class=_AsyncRecording
    )
    client = redis.asyncio.Redis(connection_pool=pool)
    try:
        assert _scripts._direct_pool(client) is pool
        lock = AsyncRedisLock(client, "own-pack-aio", auto_renew=False)
        assert await lock.acquire(blocking=False)
        await lock.release()
        assert not await client.exists(lock.keys.lock)
        assert _AsyncRecording.packed_names.count("EVALSHA") >= 2
    finally:
        await client.aclose()
        await pool.disconnect()


def test_a_send_command_installed_later_or_on_one_connection_is_honoured(redis_server) -> None:
    """Instrumentation may patch a connection class after the scripts first ran, or set a
    ``send_command`` on one connection: either is looked up at each call."""

    class Late(redis.Connection):
        pass

    pool = redis.ConnectionPool(port=redis_server.port, socket_timeout=5.0, connection_class=Late)
    client = redis.Redis(connection_pool=pool)
    seen: list[object] = []
    try:
        lock = RedisLock(client, "own-send-late", auto_renew=False)
        assert lock.acquire(blocking=False)  # the direct path's own packing, as ever
        lock.release()
        assert _packing.own_send(Late())

        def traced(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(args[0])
            return redis.Connection.send_command(self, *args, **kwargs)

        Late.send_command = traced  # type: ignore[method-assign]
        assert lock.acquire(blocking=False)
        lock.release()
        assert seen.count("EVALSHA") == 2
        del Late.send_command
        connection = Late()
        assert _packing.own_send(connection)
        connection.send_command = traced  # type: ignore[method-assign]
        assert not _packing.own_send(connection)
    finally:
        client.close()
        pool.disconnect()
