"""A fault-injecting TCP proxy between a Redis client and a ``redis-server`` (test tooling).

:class:`FaultProxy` listens on a free loopback port and forwards every connection to
the server. It reads the RESP stream in both directions, so it knows each command
(its name, and for ``EVALSHA`` which of this package's scripts it runs) and each
reply, and can be told to fail one chosen command:

=============  ==============================================================
``drop``       close both sides instead of forwarding it: it never runs
``drop_reply`` forward it (it runs on Redis), then close both sides before
               its reply reaches the client
``delay``      hold it ``seconds``, then forward it
``stall``      hold it, and everything after it on that connection, until
               :meth:`FaultProxy.resume` or ``seconds``; then forward it, even
               if the client has given up meanwhile (a late delivery)
``refuse``     do not forward it: close every connection and refuse new ones
               for ``seconds`` (a partition; :meth:`FaultProxy.heal` ends it)
``blackhole``  freeze every connection, both ways, for ``seconds``: clients
               time out; what was sent (this command too) arrives afterwards
=============  ==============================================================

A fault fires on the ``nth`` matching command counted from its injection, over all
connections. ``on`` is a command name (``"PTTL"``, ``"SUBSCRIBE"``), a script name
(``"acquire"``, ``"release"``, ``"renew"``, ``"handoff"``: see ``_scripts.SCRIPT_NAMES``),
``"release:<mode>"`` (``leave``, ``force``, ``all``, ``hold``; ``one`` for a plain
release), ``"message"`` for a pub/sub message the server pushes to a subscriber (not a
command: ``drop``, ``delay``, ``stall`` and ``refuse`` apply to it), or a callable
taking the :class:`Command`.

It counts every command it forwarded (:meth:`FaultProxy.count`), so a test can assert
which steps happened. :meth:`FaultProxy.close` stops every thread and closes every
socket it opened.

A script's first ``EVALSHA`` on a server that has not cached it is answered NOSCRIPT
and sent again after ``SCRIPT LOAD``: both count as matching commands. Load the scripts
first (``SCRIPT LOAD``) where the count matters.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from . import _scripts
from ._resp import Incomplete, parse, parse_command

ACTIONS = ("drop", "drop_reply", "delay", "stall", "refuse", "blackhole")
#: Actions that apply to a pushed pub/sub message (``on="message"``).
PUSH_ACTIONS = ("drop", "delay", "stall", "refuse", "blackhole")
_SUBSCRIBING = {"SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE"}
_MESSAGES = {b"message", b"pmessage", b"smessage"}
#: How long a ``drop_reply`` waits for the reply before it closes the connection anyway.
_REPLY_WAIT = 5.0
_POLL = 0.05


def script_shas() -> dict[str, str]:
    """SHA1 of each of the package's scripts (plain and sharded) -> its name."""
    shas: dict[str, str] = {}
    for name in _scripts.SCRIPT_NAMES:
        for text in (_scripts.source(name), _scripts.sharded_source(name)):
            shas[hashlib.sha1(text.encode("utf-8")).hexdigest()] = name
    return shas


@dataclass
class Command:
    """One command a client sent (or, with ``name == "MESSAGE"``, one message pushed to
    a subscriber), as the proxy saw it."""

    name: str
    args: list[bytes]
    connection: int
    #: The package's script an ``EVALSHA`` runs (None: another command or script).
    script: str | None = None
    at: float = field(default_factory=time.monotonic)

    @property
    def keys(self) -> list[bytes]:
        """KEYS of an ``EVALSHA`` (empty for other commands)."""
        if self.name not in ("EVALSHA", "EVAL") or len(self.args) < 2:
            return []
        return self.args[2 : 2 + int(self.args[1])]

    @property
    def argv(self) -> list[bytes]:
        """ARGV of an ``EVALSHA`` (empty for other commands)."""
        if self.name not in ("EVALSHA", "EVAL") or len(self.args) < 2:
            return []
        return self.args[2 + int(self.args[1]) :]

    @property
    def label(self) -> str:
        """The script's name, ``"message"`` for a push, or the command's name."""
        if self.script is not None:
            return self.script
        return "message" if self.name == "MESSAGE" else self.name

    @property
    def mode(self) -> str | None:
        """A release's mode (its ARGV[2]: ``one``, ``all``, ``hold``, ``leave``, ``force``)."""
        if self.script != "release":
            return None
        argv = self.argv
        return argv[1].decode() if len(argv) > 1 and argv[1] else "one"

    def matches(self, on: Matcher) -> bool:
        if callable(on):
            return bool(on(self))
        if on == "message" or self.name == "MESSAGE":
            return on == "message" and self.name == "MESSAGE"
        if ":" in on:
            script, _, mode = on.partition(":")
            return self.script == script and self.mode == mode
        return on == self.script or on.upper() == self.name


Matcher = Union[str, Callable[[Command], bool]]


class Fault:
    """One injected fault; ``fired`` is set when it took effect (``command``: on what)."""

    def __init__(self, action: str, on: Matcher, nth: int, seconds: float | None) -> None:
        self.action = action
        self.on = on
        self.nth = nth
        self.seconds = seconds
        self.seen = 0
        self.command: Command | None = None
        self.fired = threading.Event()
        #: When it fired (monotonic).
        self.fired_at: float | None = None
        #: Set as a delayed or stalled command is sent on (or when its connection closed
        #: first), at once for the other actions.
        self.over = threading.Event()
        self._resume = threading.Event()

    @property
    def ends_at(self) -> float | None:
        """When a fired delay or partition ends (monotonic; None: not known yet)."""
        if self.fired_at is None or self.seconds is None:
            return None
        return self.fired_at + self.seconds

    def resume(self) -> None:
        """End a stall now."""
        self._resume.set()

    def __repr__(self) -> str:
        state = "fired" if self.fired.is_set() else f"{self.seen}/{self.nth} seen"
        return f"<Fault {self.action} on {self.on!r} #{self.nth} ({state})>"


class _Connection:
    """One client connection and its upstream connection, pumped by two threads."""

    def __init__(self, proxy: FaultProxy, ident: int, client: socket.socket) -> None:
        self.proxy = proxy
        self.ident = ident
        self.client = client
        self.upstream: socket.socket | None = None
        self.closed = threading.Event()
        self.pubsub = False
        #: Per forwarded command, whether its reply must cut the connection instead.
        self.expect: deque[bool] = deque()
        self.cut_next_push = False
        self.mutex = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        try:
            self.upstream = socket.create_connection(
                (self.proxy.target_host, self.proxy.target_port), timeout=2.0
            )
            self.upstream.settimeout(None)
            # As redis-py and redis-server do: a command forwarded alone, and the next
            # one not held back by Nagle until its ACK (redis-py 8.2 pipelines the tail
            # of its handshake: through a proxy without this, each new connection waited
            # for a delayed ACK, about 40 ms).
            for sock in (self.client, self.upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            self.close()
            return
        for target, name in ((self._requests, "c2s"), (self._replies, "s2c")):
            thread = threading.Thread(
                target=target, name=f"faultproxy-{self.ident}-{name}", daemon=True
            )
            self.threads.append(thread)
            thread.start()

    def close(self) -> None:
        with self.mutex:
            if self.closed.is_set():
                return
            self.closed.set()
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed by the other side
                    sock.shutdown(socket.SHUT_RDWR)

    def release_sockets(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                sock.close()

    def _hold(self, until: float | None, resume: threading.Event | None) -> None:
        """Wait until ``until`` (monotonic), ``resume`` is set, or the connection or the
        proxy closes."""
        while not self.proxy._stopping.is_set() and not self.closed.is_set():
            if resume is not None and resume.is_set():
                return
            left = _POLL if until is None else min(_POLL, until - time.monotonic())
            if left <= 0:
                return
            time.sleep(left)

    def _gate(self) -> None:
        """Wait while the proxy is frozen (a blackhole partition)."""
        while time.monotonic() < self.proxy._frozen_until and not self.proxy._stopping.is_set():
            time.sleep(_POLL)

    def _apply(self, fault: Fault | None) -> bool:
        """Delay or stall per ``fault``; False if the command must not be forwarded."""
        if fault is None:
            return True
        if fault.action == "drop":
            self.close()
            return False
        if fault.action == "refuse":
            self.proxy.partition(fault.seconds)
            return False
        if fault.action == "blackhole":
            self.proxy.partition(fault.seconds, blackhole=True)
            return True  # held by the gate until the partition heals
        if fault.action in ("delay", "stall"):
            until = None if fault.seconds is None else time.monotonic() + fault.seconds
            self._hold(until, fault._resume if fault.action == "stall" else None)
        if self.proxy._stopping.is_set() or self.closed.is_set():
            fault.over.set()  # its connection is gone: it is never sent on
            return False
        return True

    def _requests(self) -> None:
        buf = b""
        assert self.upstream is not None
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                buf += data
                while buf:
                    try:
                        args, end = parse_command(buf)
                    except Incomplete:
                        break
                    raw, buf = buf[:end], buf[end:]
                    if not args:
                        continue
                    command = self.proxy._command(args, self.ident)
                    fault = self.proxy._match(command)
                    if not self._apply(fault):
                        return
                    self._gate()
                    cut = fault is not None and fault.action == "drop_reply"
                    with self.mutex:
                        if self.closed.is_set():
                            return
                        if command.name in _SUBSCRIBING:
                            self.pubsub = True
                        if cut and self.pubsub:
                            self.cut_next_push = True
                        elif not self.pubsub:
                            self.expect.append(cut)
                    # Recorded first: its reply can reach the client (which may then
                    # ask) before this thread runs again.
                    self.proxy._forwarded(command)
                    if fault is not None:
                        fault.over.set()  # a delayed or stalled command is sent on
                    self.upstream.sendall(raw)
                    if cut:  # nothing more runs on this connection: wait for the cut
                        self.closed.wait(_REPLY_WAIT)
                        self.close()
                        return
            # The client closed: let Redis run what it sent, then close (a half-close).
            self.upstream.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()

    def _replies(self) -> None:
        buf = b""
        assert self.upstream is not None
        try:
            while True:
                data = self.upstream.recv(65536)
                if not data:
                    break
                buf += data
                while buf:
                    try:
                        value, end = parse(buf)
                    except Incomplete:
                        break
                    raw, buf = buf[:end], buf[end:]
                    forward, fault = self._reply(value)
                    if not forward:
                        return
                    self._gate()
                    if fault is not None:
                        fault.over.set()
                    self.client.sendall(raw)
        except OSError:
            pass
        self.close()

    def _reply(self, value: Any) -> tuple[bool, Fault | None]:
        """Decide one reply or push: (False, _) when the connection was cut instead;
        the fault applied to a pushed message, if any."""
        pushed = isinstance(value, list) and value[:1] == ["__push__"]
        items = value[1:] if pushed else value
        is_message = (
            (self.pubsub or pushed) and isinstance(items, list) and items[:1] != [] and
            items[0] in _MESSAGES
        )  # fmt: skip
        with self.mutex:
            cut = False
            if self.pubsub and self.cut_next_push:
                cut, self.cut_next_push = True, False
            elif self.expect and not pushed and not is_message:  # a command's reply
                cut = self.expect.popleft()
        if cut:
            self.close()
            return False, None
        fault = None
        if is_message:
            message = self.proxy._command(
                [b"MESSAGE", *[bytes(i) for i in items[1:] if isinstance(i, bytes)]], self.ident
            )
            fault = self.proxy._match(message)
            if not self._apply(fault):
                return False, fault
            self.proxy._forwarded(message)
        return not self.closed.is_set(), fault


class FaultProxy:
    """A TCP proxy on a free loopback port in front of one Redis server, that fails
    chosen commands (see the module docstring).

    Args:
        target: the server (anything with ``.port``, such as
            :class:`~celery_redislock.testing.RedisServer`) or its port.
        host: the server's host.

    Use it as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, target: Any, *, host: str = "127.0.0.1") -> None:
        self._target = target
        self.target_host = host
        self.port = 0
        self._shas = script_shas()
        self._mutex = threading.Lock()
        self._faults: list[Fault] = []
        #: Every command forwarded (and message delivered), in order.
        self.log: list[Command] = []
        self._connections: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._refuse_until = 0.0
        self._frozen_until = 0.0

    @property
    def target_port(self) -> int:
        return int(getattr(self._target, "port", self._target))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.Redis`` connected through the proxy (socket timeouts 5 s unless given)."""
        import redis

        kwargs.setdefault("socket_timeout", 5.0)
        kwargs.setdefault("socket_connect_timeout", 5.0)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        """A ``redis.asyncio.Redis`` connected through the proxy."""
        import redis.asyncio

        kwargs.setdefault("socket_timeout", 5.0)
        kwargs.setdefault("socket_connect_timeout", 5.0)
        return redis.asyncio.Redis(host="127.0.0.1", port=self.port, **kwargs)

    # -- faults ----------------------------------------------------------------

    def inject(
        self, action: str, on: Matcher, *, nth: int = 1, seconds: float | None = None
    ) -> Fault:
        """Fail the ``nth`` command matching ``on`` from now on (see the module docstring).

        ``seconds``: how long a ``delay`` holds the command (required), a ``stall`` at
        most (None: until resumed), a partition lasts (None: until healed).
        """
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        if on == "message" and action not in PUSH_ACTIONS:
            raise ValueError(f"a pushed message can only take {PUSH_ACTIONS}, not {action!r}")
        if not isinstance(nth, int) or nth < 1:
            raise ValueError(f"nth must be an int >= 1, got {nth!r}")
        if action == "delay" and seconds is None:
            raise ValueError("a delay needs seconds")
        if seconds is not None and seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        fault = Fault(action, on, nth, seconds)
        with self._mutex:
            self._faults.append(fault)
        return fault

    def resume(self) -> None:
        """End every stall now."""
        with self._mutex:
            faults = list(self._faults)
        for fault in faults:
            fault.resume()

    def clear(self) -> None:
        """Forget faults that have not fired, and end stalls and partitions."""
        self.resume()
        self.heal()
        with self._mutex:
            self._faults = [f for f in self._faults if f.fired.is_set()]

    def partition(self, seconds: float | None = None, *, blackhole: bool = False) -> None:
        """Cut every open connection and refuse new ones (accepted, then closed at once)
        for ``seconds`` (None: until :meth:`heal`).

        ``blackhole=True`` instead keeps connections open and forwards nothing either
        way, so clients time out; what was sent arrives when the partition heals.
        """
        until = float("inf") if seconds is None else time.monotonic() + seconds
        with self._mutex:
            if blackhole:
                self._frozen_until = until
                return
            self._refuse_until = until
        self.cut()

    def heal(self) -> None:
        """End a partition now."""
        with self._mutex:
            self._refuse_until = self._frozen_until = 0.0

    def cut(self) -> int:
        """Close every open connection now; returns how many."""
        with self._mutex:
            connections = list(self._connections.values())
        for connection in connections:
            connection.close()
        return len(connections)

    def count(self, on: Matcher) -> int:
        """How many forwarded commands (or delivered messages) matched ``on``."""
        with self._mutex:
            return sum(1 for c in self.log if c.matches(on))

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._mutex:
            return sum(1 for c in self._connections.values() if not c.closed.is_set())

    # -- inside ------------------------------------------------------------------

    def _command(self, args: list[bytes], connection: int) -> Command:
        name = args[0].decode("utf-8", "replace").upper()
        script = None
        if name == "EVALSHA" and len(args) > 1:
            script = self._shas.get(args[1].decode("ascii", "replace").lower())
        return Command(name, args[1:], connection, script)

    def _match(self, command: Command) -> Fault | None:
        with self._mutex:
            for fault in self._faults:
                if fault.fired.is_set() or not command.matches(fault.on):
                    continue
                fault.seen += 1
                if fault.seen == fault.nth:
                    fault.command = command
                    fault.fired_at = time.monotonic()
                    fault.fired.set()
                    if fault.action not in ("delay", "stall"):
                        fault.over.set()
                    return fault
        return None

    def _forwarded(self, command: Command) -> None:
        with self._mutex:
            self.log.append(command)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            ready, _, _ = select.select([listener], [], [], _POLL)
            if not ready:
                self._reap()
                continue
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            with self._mutex:
                refused = time.monotonic() < self._refuse_until
            if refused or self._stopping.is_set():
                client.close()
                continue
            connection = _Connection(self, next(self._ids), client)
            with self._mutex:
                self._connections[connection.ident] = connection
            connection.start()

    def _reap(self) -> None:
        """Join and close connections whose threads have ended."""
        with self._mutex:
            ended = [
                c
                for c in self._connections.values()
                if c.closed.is_set() and not any(t.is_alive() for t in c.threads)
            ]
            for connection in ended:
                del self._connections[connection.ident]
        for connection in ended:
            for thread in connection.threads:
                thread.join()
            connection.release_sockets()

    # -- life ------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="faultproxy-accept", daemon=True
        )
        self._acceptor.start()
        return self

    def close(self) -> None:
        """Stop accepting, end stalls, close every connection, join every thread."""
        self._stopping.set()
        self.resume()
        if self._acceptor is not None:
            self._acceptor.join(10)
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.cut()
        with self._mutex:
            connections = list(self._connections.values())
            self._connections.clear()
        for connection in connections:
            connection.close()
            for thread in connection.threads:
                thread.join(10)
            connection.release_sockets()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
