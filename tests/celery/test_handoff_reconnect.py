"""The hand-over channel (``celery.handoff_channel``) across broker connection losses: a
real prefork worker whose RabbitMQ is reached through a TCP relay that cuts every one of
its connections mid-workload (the consumer's, the pool processes' publishing ones), then
lets it reconnect at once or after an outage. A contended workload on one lock key must
finish each task once, one at a time, with nothing left held; after each reconnect the
hand-over queue is consumed exactly once (one consumer, not none, not two) and hand-overs
keep flowing, well before any fallback copy would run a task.

The relay is a plain byte pump: ``FaultProxy`` parses RESP (it buffers an AMQP stream
until a CRLF that never comes, so a connection through it never opens).

The worker runs this module as its app (``tests.celery_app``'s, plus a probe, with
``REDISLOCK_TEST_HANDOFF_PROBE`` set, that records each ``handoff_channel.defer_ack``
answer in the test's Redis)."""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from .. import celery_app as ca
from .._celery import CeleryProcess, wait_until, worker

if TYPE_CHECKING:
    from celery_redislock.testing import RedisServer

    from .conftest import Rabbit

#: The worker's app (``celery -A tests.celery.test_handoff_reconnect``).
app = ca.app

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
#: Where the probe writes: one "<held 0|1> <event loop found 0|1> <monotonic>" per call.
PROBE = "probe:defer_ack"
TASKS = 20
WORK = 0.05
#: A fallback copy runs a parked task 2 s after its parking at the earliest (ttl 3 s,
#: visibility timeout 8 s): a gap under this between two runs was a hand-over's.
PROMPT = 1.0


def _install_probe() -> None:
    """In the worker: record every ``defer_ack`` answer, and whether kombu's current
    event loop (``get_event_loop``, which ``defer_ack`` asks) was set at the time."""
    from kombu.asynchronous import get_event_loop

    from celery_redislock.celery import handoff_channel

    original = handoff_channel.defer_ack

    def probed(key: bytes, ack: Any) -> bool:
        held = original(key, ack)
        found = get_event_loop() is not None
        ca.r().rpush(PROBE, f"{int(held)} {int(found)} {time.monotonic()!r}")
        return held

    handoff_channel.defer_ack = probed


if os.environ.get("REDISLOCK_TEST_HANDOFF_PROBE"):
    _install_probe()


def _rabbitmq_running() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=0.5):
            return True
    except OSError:
        return False


rabbitmq = pytest.mark.skipif(not _rabbitmq_running(), reason="no RabbitMQ on 127.0.0.1:5672")


class Relay:
    """A loopback TCP relay to RabbitMQ: :meth:`cut` closes every connection through it
    (both sides, as a broker restart or a network reset would); :meth:`refuse` closes
    new ones at once for a while (an outage)."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5672)) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.mutex = threading.Lock()
        self.live: list[tuple[socket.socket, socket.socket]] = []
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.accepted = 0
        self.refuse_until = 0.0
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> Relay:
        self._thread(self._accept)
        return self

    def _thread(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self.mutex:
            self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            ready, _, _ = select.select([self.listener], [], [], 0.05)
            if not ready:
                continue
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            if time.monotonic() < self.refuse_until:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2.0)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.mutex:
                self.live.append((client, upstream))
                self.sockets += [client, upstream]
                self.accepted += 1
            self._thread(self._pump, client, upstream)
            self._thread(self._pump, upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        _shut(source, sink)

    def cut(self) -> int:
        """Close every connection now; how many there were."""
        with self.mutex:
            live, self.live = self.live, []
        for pair in live:
            _shut(*pair)
        return len(live)

    def refuse(self, seconds: float) -> None:
        with self.mutex:
            self.refuse_until = time.monotonic() + seconds

    def close(self) -> None:
        self.stopping.set()
        self.cut()
        with self.mutex:
            threads = list(self.threads)
        for thread in threads:
            thread.join(5)
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def _shut(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


# ------------------------------------------------------------------------ helpers


def _queues(rabbit: Rabbit) -> str:
    """A queue of the test's own, its hand-over queue and its fallback copies' delay
    queue (2 s), all deleted at the test's end."""
    from celery_redislock.celery.contention import DELAY_QUEUE_PREFIX

    name = f"redislock-test-{secrets.token_hex(4)}"
    rabbit.queues += [name, f"{name}.redislock", f"{DELAY_QUEUE_PREFIX}2000.{name}"]
    rabbit.exchanges += [name, f"{name}.redislock"]
    return name


def _consumers(queue: str) -> int | None:
    """Consumers RabbitMQ counts on ``queue`` now (None: no such queue)."""
    from amqp.exceptions import NotFound
    from kombu import Connection

    with Connection(RABBITMQ) as conn:
        try:
            return int(conn.default_channel.queue_declare(queue, passive=True).consumer_count)
        except NotFound:
            return None


def _consumed_once(name: str, samples: int = 5) -> None:
    """The task queue and its hand-over queue have one consumer each (the worker's), and
    keep one for ``samples`` tenths of a second: not none (the hand-over queue dropped),
    not two (consumed twice)."""
    queues = (name, f"{name}.redislock")
    wait_until(
        lambda: all(_consumers(q) == 1 for q in queues),
        timeout=20,
        what=f"one consumer each on {queues}: {[_consumers(q) for q in queues]}",
    )
    for _ in range(samples):
        time.sleep(0.1)
        counts = [_consumers(q) for q in queues]
        assert counts == [1, 1], f"consumers of {queues}: {counts}"


def _connected(proc: CeleryProcess, times: int) -> None:
    """The worker's consumer has connected ``times`` times (its log says so)."""
    wait_until(
        lambda: proc.text().count("Connected to amqp://") >= times,
        timeout=30,
        what=f"consumer connection #{times}",
    )


def _sections(r: redis.Redis, account: int) -> list[tuple[str, float, float]]:
    """(task id, enter, leave) of each finished body of ``settle`` on ``account``."""
    spans = []
    for line in r.lrange("sections:settle", 0, -1):
        key, task_id, enter, leave = line.decode().split()
        if key == str(account):
            spans.append((task_id, float(enter), float(leave)))
    return sorted(spans, key=lambda s: s[1])


def _runs(r: redis.Redis, account: int, count: int) -> None:
    wait_until(lambda: len(_sections(r, account)) >= count, timeout=30, what=f"{count} runs")


def _probe(r: redis.Redis) -> list[tuple[bool, bool, float]]:
    return [
        (held == "1", found == "1", float(at))
        for held, found, at in (line.decode().split() for line in r.lrange(PROBE, 0, -1))
    ]


def _start(broker: RedisServer, tmp_path: Path, name: str, relay: Relay) -> CeleryProcess:
    env = {
        "REDISLOCK_TEST_BROKER": relay.url,
        "REDISLOCK_TEST_VT": "8",
        "REDISLOCK_TEST_HANDOFF_PROBE": "1",
    }
    return worker(
        broker.url,
        tmp_path / "w.log",
        concurrency=2,
        extra=["-Q", name],
        env=env,
        app="tests.celery.test_handoff_reconnect",
    )


def _client(broker: RedisServer) -> Any:
    from celery import Celery

    return Celery("handoff-reconnect-client", broker=RABBITMQ, backend=broker.url)


def _warm(client: Any, name: str, account: int, r: redis.Redis) -> None:
    """One run of the key first: its next messages are checked (parked) at delivery."""
    client.send_task(ca.settle.name, args=(account, 0, 0.0), queue=name).get(timeout=30)
    r.delete("sections:settle", PROBE)


def _send(client: Any, name: str, account: int, count: int) -> list[Any]:
    return [
        client.send_task(ca.settle.name, args=(account, 1, WORK), queue=name) for _ in range(count)
    ]


def _nothing_left(r: redis.Redis, account: int) -> None:
    lock = f"redislock:{{account:{account}}}"
    wait_until(lambda: not r.exists(lock), timeout=15, what=f"{lock} released")
    wait_until(lambda: not r.llen(f"{lock}:parked"), timeout=15, what="nothing parked")
    assert not r.hlen(f"{lock}:parked:messages")
    assert not r.hlen(f"{lock}:parked:dispatched")


# -------------------------------------------------------------------------- tests


@contextlib.contextmanager
def _rig(broker: RedisServer, tmp_path: Path, rabbit: Rabbit) -> Iterator[tuple[Any, ...]]:
    """A worker reaching RabbitMQ through a :class:`Relay`, its queues consumed once each
    and its key warmed: (queue name, locks client, account, relay, client app, worker);
    all stopped and closed after."""
    name = _queues(rabbit)
    r = broker.client()
    account = secrets.randbelow(10**9)
    relay = Relay().start()
    client = _client(broker)
    proc: CeleryProcess | None = None
    try:
        proc = _start(broker, tmp_path, name, relay)
        _consumed_once(name)
        _warm(client, name, account, r)
        yield name, r, account, relay, client, proc
    finally:
        if proc is not None:
            proc.kill()
        client.close()
        relay.close()
        r.close()


@rabbitmq
@pytest.mark.parametrize("how", ["two cuts", "an outage"])
def test_a_contended_key_across_broker_reconnects_runs_each_task_once_in_turn(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit, how: str
) -> None:
    """20 tasks x 50 ms on one key, every broker connection of the worker cut partway
    (twice, reconnecting at once; or once, with new connections refused for 1 s): each
    task's body ran exactly once, never two at once, the balance is exact, nothing is left
    held or parked; after each reconnect the hand-over queue has exactly one consumer, and
    the tasks run after it follow each other by hand-over (no gap a fallback copy's wait
    long), so the queue is consumed."""
    with _rig(broker, tmp_path, rabbit) as (name, r, account, relay, client, proc):
        sent = _send(client, name, account, TASKS)
        cuts = [5, 12] if how == "two cuts" else [6]
        cut_at: list[float] = []
        connected_at: list[float] = []
        for n, at in enumerate(cuts, start=2):
            _runs(r, account, at)
            if how == "an outage":
                relay.refuse(1.0)
            cut_at.append(time.monotonic())
            assert relay.cut() >= 1
            assert len(_sections(r, account)) <= TASKS - 5  # partway through
            _connected(proc, n)
            connected_at.append(time.monotonic())
            _consumed_once(name, samples=0)  # (that it stays at one: sampled at the end)
        results = [res.get(timeout=30) for res in sent]
        assert sorted(results) == list(range(1, TASKS + 1))  # each saw the one before it

        spans = _sections(r, account)
        counted = collections.Counter(task_id for task_id, _, _ in spans)
        assert counted == {res.id: 1 for res in sent}, counted  # every one, once
        for (_, _, leave), (task_id, enter, _) in zip(spans, spans[1:]):
            assert enter >= leave, f"{task_id} entered at {enter} before {leave}"
        assert int(r.get(f"balance:{account}") or 0) == TASKS
        _nothing_left(r, account)

        # After each reconnect (until the next cut), runs follow each other by hand-over:
        # a parked task runs only when handed its lock, and its hand-over reaches the
        # worker through the hand-over queue's consumer on its new connection.
        ends = [*cut_at[1:], float("inf")]
        for n, (start, end) in enumerate(zip(connected_at, ends), start=1):
            window = [s for s in spans if start <= s[1] < end]
            assert len(window) >= 3, f"{len(window)} runs after reconnect #{n}"
            gaps = [b[1] - a[2] for a, b in zip(window, window[1:])]
            assert max(gaps) < PROMPT, f"gaps between runs after reconnect #{n}: {gaps}"
        _consumed_once(name, samples=2)  # still one consumer each, at the end

        text = proc.text()
        assert text.count("Connection to broker lost") >= len(cuts)
        assert "could not consume the hand-over queues" not in text
        # Before the first cut, acks were held for their key's hand-over (the pairing ran).
        assert any(held for held, _found, at in _probe(r) if at < cut_at[0]), _probe(r)


class Precondition(Exception):
    """The scenario did not come about (the test cannot show what it checks)."""


def _require(condition: Any, what: str) -> None:
    if not condition:
        raise Precondition(what)


@rabbitmq
def test_after_a_reconnect_a_finished_tasks_ack_is_still_held_for_its_hand_over(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit
) -> None:
    """Before any connection loss, finished tasks' acks wait for their key's hand-over
    (``defer_ack`` answers True); after one, with the hand-over channel consuming again
    and tasks parked at delivery again, they should still."""
    with _rig(broker, tmp_path, rabbit) as (name, r, account, relay, client, proc):
        for res in _send(client, name, account, 10):
            res.get(timeout=30)
        before = _probe(r)
        _require(any(held for held, _, _ in before), f"no ack held before the cut: {before}")
        _require(all(found for _, found, _ in before), f"no event loop before the cut: {before}")

        parked = proc.text().count("before dispatch")
        _require(relay.cut() >= 1, "no connection to cut")
        _connected(proc, 2)
        _consumed_once(name)
        cut_done = time.monotonic()
        for res in _send(client, name, account, 10):
            res.get(timeout=30)
        _require(proc.text().count("before dispatch") > parked, "nothing parked after the cut")
        after = [p for p in _probe(r) if p[2] >= cut_done]
        _require(after, "no ack after the reconnect")
        found = [f for _, f, _ in after]
        held = [h for h, _, _ in after]
        assert any(held), (
            f"no ack held after the reconnect ({len(after)} acks; kombu's event loop "
            f"found for {sum(found)} of them)"
        )
