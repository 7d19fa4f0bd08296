"""Real ``redis-server`` processes for tests, benchmarks and the demo.

:class:`RedisServer` starts a private server on a free loopback port in a temporary
directory (no persistence unless asked), and stops it by its own pid. It never
touches a server it did not start.

:class:`FaultProxy` sits between a client and such a server and fails a chosen command
(drop it, lose its reply, delay or stall it, or partition the server): see
:mod:`celery_redislock._faultproxy`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from ._faultproxy import Command as Command
from ._faultproxy import Fault as Fault
from ._faultproxy import FaultProxy as FaultProxy


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; ``cluster``: one whose cluster bus port (10,000 higher, at most
    65535) is free too, as a cluster node needs both."""
    for _attempt in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not cluster:
            return port
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus:
            try:
                bus.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port with a free cluster bus port")


#: A cluster node's bus port is its port plus this (redis-server's default).
CLUSTER_BUS_OFFSET = 10000


def _bulk_size(reply: bytes) -> int:
    """The whole length of the RESP bulk string ``reply`` begins (header, body, CRLF)."""
    header, _, _ = reply.partition(b"\r\n")
    if not header.startswith(b"$"):
        return len(reply)  # an error or another type: nothing more to wait for
    return len(header) + 2 + int(header[1:]) + 2


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "redis-server is not installed: `sudo apt-get install redis-server` "
            "(Debian/Ubuntu) or see https://redis.io/docs/install/"
        )
    return found


class RedisServer:
    """One redis-server process owned by the caller.

    Args:
        appendonly: turn on AOF persistence (``appendfsync`` as given).
        extra: more ``--option value`` arguments for redis-server.
    """

    def __init__(
        self,
        *,
        appendonly: bool = False,
        appendfsync: str = "always",
        extra: list[str] | None = None,
        directory: str | None = None,
    ) -> None:
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="redislock-test-"))
        self.port = 0
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra = list(extra or [])
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "server not started"
        return self.process.pid

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        kwargs.setdefault("socket_timeout", 5.0)
        kwargs.setdefault("socket_connect_timeout", 5.0)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self, port: int | None = None) -> RedisServer:
        for _attempt in range(5):
            self.port = port or self.port or free_port(cluster="--cluster-enabled" in self.extra)
            args = [
                redis_server_binary(),
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync,
                "--logfile", str(self.dir / "redis.log"),
                "--daemonize", "no",
                *self.extra,
            ]  # fmt: skip
            self.process = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            if self._wait_ready():
                return self
            self.stop()
            if port is None:
                self.port = 0  # the port was taken meanwhile: try another
                if "--cluster-enabled" in self.extra:  # its config names the port it had
                    with contextlib.suppress(OSError):
                        (self.dir / "nodes.conf").unlink()
        raise RuntimeError(f"redis-server did not start; its log ends:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.dir / "redis.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def _wait_ready(self, within: float = 10.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return self._answered_by_own_process(sock)
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def _answered_by_own_process(self, sock: socket.socket) -> bool:
        """Whether the server on our port is our process, not another one that took the
        free port between :func:`free_port` and our bind (tests run side by side)."""
        assert self.process is not None
        sock.settimeout(2.0)
        sock.sendall(b"INFO server\r\n")
        reply = b""
        while b"\r\n" not in reply or len(reply) < _bulk_size(reply):
            chunk = sock.recv(65536)
            if not chunk:
                return False
            reply += chunk
        found = re.search(rb"\nprocess_id:(\d+)\r", reply)
        return found is not None and int(found.group(1)) == self.process.pid

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL the server (no shutdown save) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGCONT)
                self.process.terminate()
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def restart(self, *, delay: float = 0.0, kill: bool = True) -> None:
        """Stop (SIGKILL by default) and start again on the same port."""
        if kill:
            self.kill()
        else:
            self.stop()
        if delay:
            time.sleep(delay)
        self.start(self.port)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class RedisClusterServers:
    """A real Redis Cluster of ``masters`` primaries (no replicas) owned by the caller.

    Each node is a :class:`RedisServer` started with ``--cluster-enabled yes`` in its own
    temporary directory on a free loopback port; ``redis-cli --cluster create`` assigns
    the slots. :meth:`stop` stops every node by its own pid.
    """

    def __init__(self, masters: int = 3, *, node_timeout_ms: int = 2000) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.nodes = [
            RedisServer(
                extra=[
                    *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                    *("--cluster-node-timeout", str(node_timeout_ms)),
                ]
            )
            for _ in range(masters)
        ]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RuntimeError("redis-cli is not installed (it comes with redis-server)")
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{p}" for p in self.ports),
                    "--cluster-yes",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=60,
            )
            self._wait_ok()
        except BaseException:
            self.cleanup()
            raise
        return self

    def _wait_ok(self, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                client = node.client()
                try:
                    info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    states.append("cluster_state:ok" in text)
                finally:
                    client.close()
            if all(states):
                return
            time.sleep(0.1)
        raise RuntimeError("the test cluster did not reach cluster_state:ok")

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.cluster.RedisCluster`` on this cluster."""
        from redis.cluster import ClusterNode, RedisCluster

        kwargs.setdefault("socket_timeout", 5.0)
        kwargs.setdefault("socket_connect_timeout", 5.0)
        nodes = [ClusterNode("127.0.0.1", p) for p in self.ports]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        """A ``redis.asyncio.cluster.RedisCluster`` on this cluster."""
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        kwargs.setdefault("socket_timeout", 5.0)
        kwargs.setdefault("socket_connect_timeout", 5.0)
        return RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports], **kwargs
        )

    def flushall(self) -> None:
        """Empty every node of this cluster (only the servers it started)."""
        for node in self.nodes:
            client = node.client()
            try:
                client.flushall()
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class RedisSentinel(RedisServer):
    """One Redis Sentinel process (``redis-server <conf> --sentinel``) owned by the caller.

    It monitors the master ``service`` at ``127.0.0.1:<master_port>`` with quorum 1,
    so one sentinel can fail the master over (``SENTINEL FAILOVER <service>``).
    """

    def __init__(
        self,
        master_port: int,
        *,
        service: str = "m",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        super().__init__()
        self.master_port = master_port
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def start(self, port: int | None = None) -> RedisSentinel:
        for _attempt in range(5):
            self.port = port or self.port or free_port()
            conf = self.dir / "sentinel.conf"  # sentinel rewrites its own config
            conf.write_text(
                f"port {self.port}\n"
                "bind 127.0.0.1\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 1\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n",
                encoding="utf-8",
            )
            args = [redis_server_binary(), str(conf), "--sentinel"]
            args += ["--dir", str(self.dir), "--logfile", str(self.dir / "sentinel.log")]
            self.process = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            if self._wait_ready():
                return self
            self.stop()
            if port is None:
                self.port = 0
        raise RuntimeError(f"redis sentinel did not start; see {self.dir / 'sentinel.log'}")

    def sentinel(self, **kwargs: Any) -> Any:
        """A ``redis.sentinel.Sentinel`` talking to this sentinel."""
        from redis.sentinel import Sentinel

        kwargs.setdefault("socket_timeout", 5.0)
        return Sentinel([("127.0.0.1", self.port)], **kwargs)  # type: ignore[no-untyped-call,unused-ignore]
