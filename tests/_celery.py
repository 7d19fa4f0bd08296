"""Real ``celery worker`` / ``celery beat`` subprocesses for the integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from celery_redislock.celery.parking import RecentKeys

from ._support import wait_until as wait_until  # the one wait_until; re-exported here

ROOT = Path(__file__).resolve().parent.parent


class CeleryProcess:
    """A celery sub-command run as a real process, logging to a file; stopped by its pid."""

    def __init__(self, args: list[str], *, url: str, log: Path, env: dict[str, str] | None = None):
        self.args = args
        self.log = log
        self.env = {**os.environ, "REDISLOCK_TEST_URL": url, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.app = "tests.celery_app"

    def start(self) -> CeleryProcess:
        handle = self.log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", self.app, *self.args],
            cwd=ROOT,
            env=self.env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, needle: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"celery exited ({self.process.returncode}):\n{self.text()}")
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} not seen within {timeout}s:\n{self.text()[-4000:]}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        """Warm shutdown (SIGTERM), then SIGKILL of the whole process group if it hangs."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        # children left behind by a killed main process
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode

    def kill(self) -> int | None:
        """End it at once: SIGKILL of its whole process group (main process and pool).

        For a worker whose test has checked everything it ran it for. A warm shutdown
        (:meth:`stop`) takes some 2 s for a prefork pool (its supervisor is joined) and
        is only worth waiting for where the test looks at what it does: running tasks
        finish and release, the last counts are flushed to ``<prefix>stats``."""
        if self.process is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        return self.process.returncode


def worker(
    url: str,
    log: Path,
    *,
    concurrency: int = 4,
    pool: str = "prefork",
    name: str = "w1",
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
    app: str = "tests.celery_app",
    heartbeat: bool = False,
) -> CeleryProcess:
    """A worker, started and ready. ``heartbeat``: it sends worker heartbeat events (it has
    an event dispatcher then, which remote control's ``enable_events`` needs)."""
    if (env or {}).get("REDISLOCK_TEST_BROKER", "").startswith("amqp"):
        # The shared RabbitMQ: a worker's pidbox queue is exclusive to one connection, so
        # two test processes' workers there must not share a node name.
        name = f"{name}-{os.getpid()}"
    args = [
        "worker",
        "-P", pool,
        "-c", str(concurrency),
        "-l", "info",
        "-n", f"{name}@localhost",
        "--without-gossip", "--without-mingle", *(() if heartbeat else ("--without-heartbeat",)),
        *(extra or []),
    ]  # fmt: skip
    proc = CeleryProcess(args, url=url, log=log, env=env)
    proc.app = app
    proc.start()
    proc.wait_for_log("ready.")
    return proc


class EveryKeySeen(RecentKeys):
    """A Parker's recent keys (``Parker.seen``) that know every key: each message is
    checked at delivery, as if its key had come before (tests of the check itself)."""

    def again(self, key: bytes) -> bool:
        return True


@contextlib.contextmanager
def silent_server(port: int) -> Iterator[None]:
    """A server on 127.0.0.1:``port`` that takes every connection and answers none (a
    broker that stalls); on exit it closes them, so a read waiting on one fails."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    taker = threading.Thread(target=accept, daemon=True)
    taker.start()
    try:
        yield
    finally:
        stop.set()
        taker.join(5)
        listener.close()
        for connection in accepted:
            connection.close()
