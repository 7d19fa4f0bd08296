"""The Lua scripts (one ``.lua`` file per operation, shipped as package data).

Each script is registered per client with ``register_script`` (EVALSHA, reloading
the script when the server answers NOSCRIPT), so a call is one round trip.

A Redis Cluster client gets the same sources with every ``redis.call('publish'``
replaced by ``redis.call('spublish'``: release wake-ups then travel over sharded pub/sub
(Redis 7+), on the node that owns the lock's slot, instead of being broadcast to the
whole cluster. The release channel shares the lock's ``{name}`` hash tag, so it is in
the script's slot.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import types
import weakref
from importlib import resources
from typing import Any, Iterator, NamedTuple, Sequence

import redis
import redis.asyncio
import redis.asyncio.client
import redis.client
from redis.exceptions import NoScriptError, ResponseError

from ._core import MAX_MS
from ._packing import own_send, packed
from ._process import ProcessLocal, current, is_current

SCRIPT_NAMES = (
    "acquire",
    "release",
    "renew",
    "fence",
    "park",
    "handoff",
    "sweep",
    "sem_acquire",
    "sem_release",
    "sem_park",
    "sem_handoff",
    "sem_sweep",
    "rate",
    "rate_defer",
    "rate_drain",
    "rate_resend",
    "latest_due",
    "queue",
)
#: Shared Lua functions prepended to the scripts that use them (``lua/<prelude>.lua``), in
#: this order: ``args`` checks numeric arguments (every script taking a duration uses it);
#: ``lock`` reads the clock and takes or re-enters a lock, fair to its line; ``grant`` hands
#: a freed lock to the first waiter in line (it publishes: only the releasing scripts get
#: it); ``sem`` counts a semaphore's permits and takes one (``celery_redislock.semaphore``);
#: ``envelope`` reads parked envelopes; ``parked`` parks a task, hands a lock or permit to
#: the first parked task and sends stale hand-overs again (after ``envelope``: it pushes
#: them); ``latest`` lets the newest call of a key win (``on_contention="replace"``,
#: ``lock_debounce``: ``celery_redislock.celery.latest``), for ``park`` and ``sem_park``;
#: ``gcra`` decides and books a rate limiter's slot (``celery_redislock.ratelimit``),
#: for ``rate`` and for a task's deferral and its drain (``celery_redislock.celery.deferral``).
PRELUDES: dict[str, tuple[str, ...]] = {
    "acquire": ("args", "lock"),
    "release": ("args", "lock", "grant"),
    "renew": ("args",),
    "park": ("args", "lock", "envelope", "parked", "latest"),
    "handoff": ("args", "lock", "grant", "envelope", "parked"),
    "sweep": ("args", "lock", "envelope", "parked"),
    "sem_acquire": ("args", "lock", "sem"),
    "sem_release": ("args", "lock", "grant", "sem"),
    "sem_park": ("args", "lock", "sem", "envelope", "parked", "latest"),
    "sem_handoff": ("args", "lock", "grant", "sem", "envelope", "parked"),
    "sem_sweep": ("args", "lock", "sem", "envelope", "parked"),
    "rate": ("args", "gcra"),
    "rate_defer": ("args", "gcra"),
    "rate_drain": ("args", "gcra"),
    "rate_resend": ("args",),
    "latest_due": ("args", "lock"),
    "queue": ("envelope",),
}
#: The name in ``lua/args.lua`` that stands for the longest duration the scripts accept.
MAX_MS_NAME = "MAX_MS"


#: The publish call of the classic scripts, and its sharded (Redis Cluster) replacement.
PUBLISH_CALL = "redis.call('publish',"
SPUBLISH_CALL = "redis.call('spublish',"


def _file(name: str) -> str:
    text = (resources.files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")
    # The scripts' bound is _core's, written in here: one number, in one place.
    return text.replace(MAX_MS_NAME, str(MAX_MS)) if name == "args" else text


@functools.cache
def source(name: str) -> str:
    """The script ``name``, after the shared functions it uses (``PRELUDES``)."""
    return "".join(_file(prelude) for prelude in PRELUDES.get(name, ())) + _file(name)


@functools.cache
def sharded_source(name: str) -> str:
    """``name``'s source with every publish made a sharded publish (for cluster clients)."""
    return source(name).replace(PUBLISH_CALL, SPUBLISH_CALL)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a Redis Cluster client (sync or asyncio)."""
    return not hasattr(client, "connection_pool") and hasattr(client, "get_node_from_key")


class SemaphoreScripts(NamedTuple):
    """A semaphore's scripts under the names a lock's driver (and a task's lock) calls:
    its permits are renewed by the lock's ``renew`` (a permit is a hash of the lock's
    shape)."""

    acquire: Any
    release: Any
    renew: Any
    park: Any
    handoff: Any
    sweep: Any


class Scripts:
    """The registered scripts of one client (sync or asyncio; redis-py picks the kind)."""

    def __init__(self, client: Any, registered_on: Any = None) -> None:
        """``registered_on``: what the scripts call when called without a client, in
        place of ``client`` itself (a weak proxy of it: :func:`scripts_for`)."""
        #: Whether release wake-ups are published with SPUBLISH (cluster clients).
        self.sharded = is_cluster(client)
        text = sharded_source if self.sharded else source
        if registered_on is not None:
            client = _Registering(client, registered_on)
        self.acquire = client.register_script(text("acquire"))
        self.release = client.register_script(text("release"))
        self.renew = client.register_script(text("renew"))
        self.fence = client.register_script(text("fence"))
        self.park = client.register_script(text("park"))
        self.handoff = client.register_script(text("handoff"))
        self.sweep = client.register_script(text("sweep"))
        #: A semaphore's scripts, in a lock's places (``acquire``, ``release``, ``renew``).
        self.semaphore = SemaphoreScripts(
            client.register_script(text("sem_acquire")),
            client.register_script(text("sem_release")),
            self.renew,
            client.register_script(text("sem_park")),
            client.register_script(text("sem_handoff")),
            client.register_script(text("sem_sweep")),
        )
        #: A rate limiter's one script (``celery_redislock.ratelimit``).
        self.rate = client.register_script(text("rate"))
        #: A rate-limited task's deferral, drain and re-send (``celery.deferral``).
        self.rate_defer = client.register_script(text("rate_defer"))
        self.rate_drain = client.register_script(text("rate_drain"))
        self.rate_resend = client.register_script(text("rate_resend"))
        #: A debounced task's pending call, sent when due (``celery.latest``).
        self.latest_due = client.register_script(text("latest_due"))
        #: A command on a queue list in another database of this server (``celery.queuelists``).
        self.queue = client.register_script(text("queue"))


class _Registering:
    """``register_script`` of a client whose scripts then refer to ``registered_on``."""

    def __init__(self, client: Any, registered_on: Any) -> None:
        self._client = client
        self._registered_on = registered_on

    def register_script(self, text: str) -> Any:
        script = self._client.register_script(text)
        script.registered_client = self._registered_on
        return script


def run(client: Any, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """Run a registered script on ``client`` (sync) in one round trip: EVALSHA, and on
    NOSCRIPT (a restarted or flushed server) SCRIPT LOAD and EVALSHA again.

    What ``script(keys=..., args=...)`` does, without its per-call work (argument
    tuples rebuilt, a pipeline check, two wrapper layers): the lock's hot path calls it.
    On a plain ``redis.Redis`` the command goes straight to a pooled connection
    (:func:`_direct_pool`): never re-sent, whatever the client's ``retry``.
    """
    pool = _direct_pool(client)
    if pool is not None:
        return _run_direct(pool, script, keys, args)
    try:
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        client.script_load(script.script)
        return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


def _run_direct(pool: Any, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """EVALSHA on one of ``pool``'s connections, read back on it; NOSCRIPT: load, run again.

    A connection error is raised, never retried: the script may have run (its reply
    lost), and the scripts are not idempotent (a re-sent release gives back two holds).
    The connection drops itself on any error it raises (redis-py's ``Connection``).
    """
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    with _pooled(pool) as connection:
        # (a bad argument raises here: nothing sent)
        wire = packed(connection, command) if own_send(connection) else None
        _send(connection, wire, command)
        try:
            return connection.read_response()
        except NoScriptError:  # nothing ran: load it (on this connection), run it
            connection.send_command("SCRIPT", "LOAD", script.script)
            connection.read_response()
            _send(connection, wire, command)
            return connection.read_response()


def _send(connection: Any, wire: Any, command: tuple[Any, ...]) -> Any:
    """Send ``command``: packed as ``wire`` already, or (None) through the connection's
    own ``send_command`` (:func:`._packing.own_send`). Returns what the send returns (an
    asyncio connection's: an awaitable)."""
    if wire is None:
        return connection.send_command(*command)
    return connection.send_packed_command(wire)


#: A box read shorter than this ends on the client's clock, not the server's tick.
PRECISE_POP_UNDER = 1.0


def pop_box(pool: Any, key: bytes, timeout: float) -> Any:
    """BLPOP ``key`` for at most ``timeout`` seconds (at least a millisecond: 0 would be
    for ever) on one of ``pool``'s connections (:func:`_direct_pool`'s): the reply, a
    ``[key, value]`` (bytes, whatever the client's ``decode_responses``) or None. The
    pool's socket timeout must be longer than ``timeout``."""
    with _pooled(pool) as connection:
        connection.send_command("BLPOP", key, f"{max(timeout, 0.001):.3f}")
        if timeout < PRECISE_POP_UNDER and not connection.can_read(timeout=timeout):
            # The server ends a timed-out BLPOP on its next tick (every 100 ms at hz 10),
            # a long time for a short wait: end it here, and with it the connection (the
            # BLPOP stays pending on it). A grant popped into it meanwhile is lost with
            # it, but stays the waiter's hold in Redis, for its next attempt.
            connection.disconnect()
            return None
        return connection.read_response(disable_decoding=True)


@contextlib.contextmanager
def _pooled(pool: Any) -> Iterator[Any]:
    """One of ``pool``'s connections, for one command sent and its reply read.

    A connection that raised anything but an error reply is dropped, not handed back in
    use: an exception raised between the send and the read (a signal handler's, such as
    Celery's soft time limit) is not seen by redis-py's Connection, and its next user
    would read that reply as its own (the pool checks a connection it hands out only
    without maintenance notifications, and only for a reply already arrived).
    """
    kept = _kept_of(pool)
    connection = _take(pool, kept)
    try:
        yield connection
    except ResponseError:  # an error reply, read whole: the connection is in step
        raise
    except BaseException:
        connection.disconnect()
        raise
    finally:
        if _should_reconnect(connection):  # a maintenance notice said so (redis-py 7+)
            connection.disconnect()
        if kept is not None and len(kept) < KEPT_CONNECTIONS:
            kept.append(connection)
        else:
            pool.release(connection)


#: How many idle connections the scripts keep out of a plain ``ConnectionPool``, per
#: process (:func:`_kept_of`).
KEPT_CONNECTIONS = 4
#: A pool that may open fewer connections than this lends the scripts each one per call.
KEPT_MIN_POOL = 64


class _KeptConnections:
    """Per plain ``ConnectionPool`` and process, the connections the scripts keep between
    calls (a forked child starts with none): held by the pool itself, not in a registry
    keyed weakly by it, since a connection refers to its pool (its maintenance handler),
    and a registry's value would keep its key alive, and its sockets open, for ever."""

    _ATTRIBUTE = "_redislock_kept"

    def __init__(self) -> None:
        self._mutex: ProcessLocal[threading.Lock] = ProcessLocal(threading.Lock)

    def get(self, pool: Any) -> collections.deque[Any]:
        """``pool``'s kept connections in this process (none yet: an empty deque)."""
        found = self.peek(pool)
        if found is None:
            with self._mutex.get():
                found = self.peek(pool)
                if found is None:
                    found = collections.deque()
                    setattr(pool, self._ATTRIBUTE, (current(), found))
        return found

    def peek(self, pool: Any) -> collections.deque[Any] | None:
        """``pool``'s kept connections in this process, or None (nothing is made)."""
        stamp, found = getattr(pool, self._ATTRIBUTE, (None, None))
        return found if stamp is not None and is_current(stamp) else None


_kept = _KeptConnections()


def _kept_of(pool: Any) -> collections.deque[Any] | None:
    """The connections the scripts keep out of ``pool`` between calls, or None (they take
    one from the pool per call): kept only of redis-py's plain ``ConnectionPool`` (not a
    blocking pool, which they would starve, nor a Sentinel's), on RESP2, without a
    credential provider, that may open ``KEPT_MIN_POOL`` connections or more.

    A pool's ``get_connection`` and ``release`` cost about 20 µs here (its lock, its
    check of the connection, its observability counters): a tenth of a lock's
    uncontended cycle, two round trips. A kept connection stays in use as the pool sees
    it (``client.close()`` still disconnects it; it connects again on its next use) and
    is checked as the pool would check it before each use (:func:`_take`).
    """
    found = _kept.peek(pool)  # (decided already for this pool and process)
    if found is not None:
        return found
    if (
        type(pool) is not redis.ConnectionPool
        or pool.max_connections < KEPT_MIN_POOL
        or pool.connection_kwargs.get("protocol") not in _RESP2
        # redis-py sends a rotated credential's AUTH on a connection in use only when it
        # goes back to the pool: a kept one would keep the old token until it expired.
        or pool.connection_kwargs.get("credential_provider") is not None
    ):
        return None
    return _kept.get(pool)


#: How a RESP2 pool names its protocol: RESP3's push messages (maintenance notices, client
#: tracking) are read only by redis-py's own connection checks.
_RESP2 = (None, 2, "2")


def _take(pool: Any, kept: collections.deque[Any] | None) -> Any:
    """A connection of ``pool`` (one of ``kept`` if there is one), connected and with
    nothing left to read on it: what ``ConnectionPool.get_connection`` checks."""
    if kept:
        try:
            connection = kept.pop()
        except IndexError:  # another thread took the last one meanwhile
            pass
        else:
            if connection not in pool._in_use_connections:
                # The pool was reset (``pool.reset()``) and forgot it: close it, as
                # ``client.close()`` no longer would, and take one the pool knows.
                connection.disconnect()
                return pool.get_connection(*_GET_CONNECTION_ARGS)
            try:
                try:
                    # Connects first if it is not (after client.close(), or dropped).
                    if connection.can_read():
                        raise redis.ConnectionError("Connection has data")
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    connection.disconnect()  # closed by the server, or out of step
                    connection.connect()
            except BaseException:
                pool.release(connection)
                raise
            return connection
    return pool.get_connection(*_GET_CONNECTION_ARGS)


def _should_reconnect(connection: Any) -> bool:
    should = getattr(connection, "should_reconnect", None)
    return bool(should()) if should is not None else False


#: What ``ConnectionPool.get_connection`` takes: a command name up to redis-py 5.2, nothing
#: from 5.3 on (an argument is deprecated there).
def _get_connection_args(pool_class: Any) -> tuple[str, ...]:
    command_name = inspect.signature(pool_class.get_connection).parameters.get("command_name")
    return () if command_name is None or command_name.default is None else ("EVALSHA",)


_GET_CONNECTION_ARGS = _get_connection_args(redis.ConnectionPool)
_GET_CONNECTION_ARGS_ASYNC = _get_connection_args(redis.asyncio.ConnectionPool)
#: The methods of redis-py's ``Redis`` a command goes through (redis-py 8.1; those a
#: version lacks are not looked at): a client whose class has another of any (a
#: subclass's, or one wrapped by tracing instrumentation) keeps its path for the scripts.
_COMMAND_PATH = (
    "execute_command",
    "_execute_command",
    "_send_command_parse_response",
    "parse_response",
)


def _own_code(cls: type, module: str) -> dict[str, Any]:
    """The code of ``cls``'s own methods of ``_COMMAND_PATH``, found under any wrapper
    that names them (``__wrapped__``: instrumentation may have patched the class before
    this module was imported)."""
    found: dict[str, Any] = {}
    for name in _COMMAND_PATH:
        function = inspect.unwrap(getattr(cls, name, None))  # type: ignore[arg-type]
        if isinstance(function, types.FunctionType) and (
            function.__module__,
            function.__qualname__,
        ) == (module, f"{cls.__name__}.{name}"):
            found[name] = function.__code__
    return found


_OWN_CODE = _own_code(redis.Redis, "redis.client")
_OWN_CODE_ASYNC = _own_code(redis.asyncio.Redis, "redis.asyncio.client")
#: Per client: the pool the scripts run on directly, or None, the ``execute_command`` of
#: its class when that was decided, and whether the instance had one of its own then
#: (only whether: a wrapper set on the instance may refer to it, and would keep it alive).
_direct: weakref.WeakKeyDictionary[Any, tuple[Any, Any, bool]] = weakref.WeakKeyDictionary()


def _direct_pool(client: Any) -> Any:
    """The connection pool the scripts of ``client`` go to directly, or None: they do on a
    plain ``redis.Redis`` (or a subclass that keeps its command path) with a connection
    pool of its own kind, no single connection, no client-side cache and no reply
    callback for EVALSHA; and the same of ``redis.asyncio.Redis``. Anything else (a
    pipeline, a cluster client, a traced client, a Sentinel's pool) goes through
    ``execute_command``.

    The direct way skips redis-py's per-command layers (retry wrapper, observability
    recorder, event dispatch): about a fifth of a short script's round trip here, and a
    script whose connection failed is never re-sent (redis-py's default ``Retry`` would).
    """
    try:
        pool, on_class, on_instance = _direct[client]
    except KeyError:
        pass
    except TypeError:  # not weakly referable
        return None
    else:
        # Still as decided: no tracing installed on the class or the instance since, no
        # EVALSHA reply callback set since (each a lookup: this runs on every script call).
        if (
            getattr(type(client), "execute_command", None) is on_class
            and ("execute_command" in getattr(client, "__dict__", {})) is on_instance
            and (pool is None or "EVALSHA" not in client.response_callbacks)
        ):
            return pool
    pool = None
    if isinstance(client, redis.Redis):
        kind: Any = redis.client
        own = _is_redis_own(client, _OWN_CODE)
    elif isinstance(client, redis.asyncio.Redis):
        kind = redis.asyncio.client
        own = _is_redis_own(client, _OWN_CODE_ASYNC)
    else:
        kind, own = None, False
    if (
        own
        and not isinstance(client, kind.Pipeline)
        and getattr(client, "connection", None) is None
        and not getattr(client, "single_connection_client", False)
        and type(getattr(client, "connection_pool", None)) in _POOLS
        and getattr(client.connection_pool, "cache", None) is None
        and "EVALSHA" not in getattr(client, "response_callbacks", {})
    ):
        pool = client.connection_pool
    _direct[client] = (
        pool,
        getattr(type(client), "execute_command", None),
        "execute_command" in getattr(client, "__dict__", {}),
    )
    return pool


def _is_redis_own(client: Any, own: dict[str, Any]) -> bool:
    """Whether ``client``'s command path is redis-py's own: every method of ``own`` the
    very function redis-py defines (a wrapper has code of its own, even one that copies
    the name with ``functools.wraps``, as Sentry's does), none set on the instance."""
    if "execute_command" not in own:
        return False
    cls = type(client)
    instance = getattr(client, "__dict__", {})
    for name, code in own.items():
        method = getattr(cls, name, None)
        if (
            name in instance
            or not isinstance(method, types.FunctionType)
            or method.__code__ is not code
        ):
            return False
    return True


#: The pools whose connections the scripts use directly: redis-py's own (a Sentinel's is a
#: subclass that picks its master itself, and keeps redis-py's command path).
_POOLS = (
    redis.ConnectionPool,
    redis.BlockingConnectionPool,
    redis.asyncio.ConnectionPool,
    redis.asyncio.BlockingConnectionPool,
)


async def run_async(client: Any, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """:func:`run` for ``redis.asyncio`` clients."""
    pool = _direct_pool(client)
    if pool is not None:
        return await _run_direct_async(pool, script, keys, args)
    try:
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        await client.script_load(script.script)
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


async def _run_direct_async(
    pool: Any, script: Any, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """:func:`_run_direct` for ``redis.asyncio`` (a cancelled read drops its connection:
    redis-py's asyncio ``Connection`` disconnects on any error it raises)."""
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    connection = await pool.get_connection(*_GET_CONNECTION_ARGS_ASYNC)
    try:
        wire = packed(connection, command) if own_send(connection) else None
        await _send(connection, wire, command)
        try:
            return await connection.read_response()
        except NoScriptError:
            await connection.send_command("SCRIPT", "LOAD", script.script)
            await connection.read_response()
            await _send(connection, wire, command)
            return await connection.read_response()
    except ResponseError:
        raise
    except BaseException:  # as in _run_direct: a reply may be left unread
        await connection.disconnect(nowait=True)
        raise
    finally:
        if _should_reconnect(connection):
            await connection.disconnect()
        await pool.release(connection)


#: Per client, its registered scripts (:func:`scripts_for`).
_registered: weakref.WeakKeyDictionary[Any, Scripts] = weakref.WeakKeyDictionary()


def scripts_for(client: Any) -> Scripts:
    """The scripts registered on ``client`` (registered now if they are not yet).

    Kept per client in a registry keyed weakly by it, whose scripts refer to it weakly
    too (a ``weakref.proxy``, see :class:`Scripts`): a script refers to its client, and a
    value that referred to its key strongly would keep it alive, with its pool and open
    sockets, for ever. A client dropped is freed at once, as if no lock had used it (no
    cycle left for the garbage collector, whose order of finalizers may find a socket
    before the connection that would have closed it). Hold the client as long as its
    scripts: one called after its client is gone raises ``ReferenceError``. A client
    that cannot be weakly referred to gets its scripts registered anew at each call.
    """
    try:
        found = _registered.get(client)
    except TypeError:  # not weakly referable: nothing is kept
        return Scripts(client)
    if found is None:
        found = _registered[client] = Scripts(client, weakref.proxy(client))
    return found
