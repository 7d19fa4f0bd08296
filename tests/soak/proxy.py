"""A TCP forwarder in front of a redis-server that can drop every connection at once.

Minimal on purpose (the soak only needs "every client loses its connection now"): one
thread, non-blocking sockets, per-direction buffers, so a SIGSTOPped client that stops
reading never stalls the others. :meth:`DropProxy.drop` shuts every forwarded
connection down in both directions; clients reconnect through the proxy as usual. While
the upstream server is down, a new connection is accepted and closed at once.

A shared fault proxy with more faults (delays, partitions) may replace this one.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import Any


class _Pipe:
    """One direction of a forwarded connection: bytes read from ``src`` wait for ``dst``."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.pending = bytearray()


class DropProxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream>``; :meth:`drop` cuts all."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._drop_requests: list[threading.Event] = []
        self._dropped = 0
        self._stopping = False
        self._pairs: dict[socket.socket, socket.socket] = {}  # each end -> the other end
        self._pipes: dict[socket.socket, _Pipe] = {}  # src -> its pipe
        self._clients: set[socket.socket] = set()  # the client end of each connection
        self._thread = threading.Thread(target=self._loop, name="drop-proxy", daemon=True)
        #: Connections accepted and dropped so far.
        self.accepted = 0
        self.drops = 0

    def start(self) -> DropProxy:
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        return self

    def drop(self) -> int:
        """Shut every forwarded connection down now; the number of connections cut."""
        done = threading.Event()
        with self._lock:
            self._drop_requests.append(done)
        self._wake_w.send(b"x")
        done.wait(10)
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        self.drops += 1
        return dropped

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(10)
        for sock in list(self._pairs):
            self._close(sock)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stopping:
            for key, mask in self._selector.select(timeout=0.5):
                tag: Any = key.data
                if tag == "accept":
                    self._accept()
                elif tag == "wake":
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                    self._serve_drops()
                else:
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock not in self._pairs:
                        continue  # closed earlier in this round
                    if mask & selectors.EVENT_READ:
                        self._read(sock)
                    if sock in self._pairs and mask & selectors.EVENT_WRITE:
                        self._flush(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except BlockingIOError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=1)
            except OSError:
                client.close()  # the server is down: the client sees the connection close
                continue
            self.accepted += 1
            for sock in (client, server):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pairs[client], self._pairs[server] = server, client
            self._clients.add(client)
            self._pipes[client] = _Pipe(client, server)
            self._pipes[server] = _Pipe(server, client)
            for sock in (client, server):
                self._selector.register(sock, selectors.EVENT_READ, "conn")

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(sock)
            return
        pipe = self._pipes[sock]
        pipe.pending += data
        self._flush(pipe.dst)

    def _flush(self, dst: socket.socket) -> None:
        """Send what waits for ``dst``; watch it for writability while some is left."""
        pipe = self._pipes[self._pairs[dst]]
        if pipe.pending:
            try:
                sent = dst.send(pipe.pending)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(dst)
                return
            del pipe.pending[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pipe.pending else 0)
        self._selector.modify(dst, events, "conn")

    def _close(self, sock: socket.socket) -> None:
        other = self._pairs.pop(sock, None)
        for end in (sock, other):
            if end is None:
                continue
            self._pairs.pop(end, None)
            self._pipes.pop(end, None)
            self._clients.discard(end)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(end)
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def _serve_drops(self) -> None:
        with self._lock:
            requests, self._drop_requests = self._drop_requests, []
        if not requests:
            return
        clients = list(self._clients)
        for sock in clients:
            self._close(sock)
        with self._lock:
            self._dropped += len(clients)
        for done in requests:
            done.set()
