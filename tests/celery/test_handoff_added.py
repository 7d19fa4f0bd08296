"""Hand-over queues a worker is told to consume by remote control (``add_consumer``), with
real workers: on a Redis broker elsewhere than the locks (hand-overs published as
signatures to ``<queue>.redislock``), and on RabbitMQ by a worker that had no hand-over
queue at its last start (so no hand-over consumer of its own yet: ``handoff_control``
sets one up then, as the consumer's start does)."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
from celery import Celery

from celery_redislock import RedisLock

from .. import celery_app as ca
from .._celery import wait_until, worker
from .test_handoff_channel import (
    _active_queues,
    _clean_log,
    _control,
    _counts_become,
    _each_once_in_turn,
)
from .test_handoff_reconnect import (
    Relay,
    _client,
    _connected,
    _consumed_once,
    _queues,
    _send,
    _warm,
    rabbitmq,
)

if TYPE_CHECKING:
    from celery_redislock.testing import RedisServer

    from .conftest import Rabbit

PARKED = "redislock:{job:%s}:parked"


class Brpops:
    """The worker's ``BRPOP`` commands on a Redis broker, seen through ``MONITOR``: the
    queue lists each one names (those naming ``marker``, a queue only the worker consumes;
    the client's reply polls name none). :meth:`mark` notes a point in the stream, after
    which :meth:`since` gives the ``BRPOP`` commands the server ran."""

    def __init__(self, server: RedisServer, marker: str) -> None:
        self.client = server.client(socket_timeout=None)
        self.marker = marker
        self.stop = f"brpops-stop-{secrets.token_hex(4)}"
        self.events: list[str | frozenset[str]] = []
        self.mutex = threading.Lock()
        self.watching = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        assert self.watching.wait(10), "MONITOR did not start"

    def _watch(self) -> None:
        with self.client.monitor() as monitor:
            self.watching.set()
            for command in monitor.listen():
                words = str(command["command"]).split()
                if self.stop in words:
                    return
                if words[:1] == ["ECHO"] and len(words) == 2:
                    event: str | frozenset[str] = words[1]
                elif words[:1] == ["BRPOP"] and self.marker in words:
                    event = frozenset(words[1:-1])
                else:
                    continue
                with self.mutex:
                    self.events.append(event)

    def mark(self, writer: redis.Redis) -> str:
        """A point in the command stream (an ``ECHO`` of a new token), once seen."""
        token = f"brpops-mark-{secrets.token_hex(4)}"
        writer.echo(token)
        wait_until(lambda: token in self._events(), timeout=10, what=f"{token} monitored")
        return token

    def since(self, token: str) -> list[frozenset[str]]:
        events = self._events()
        return [e for e in events[events.index(token) + 1 :] if isinstance(e, frozenset)]

    def _events(self) -> list[str | frozenset[str]]:
        with self.mutex:
            return list(self.events)

    def close(self, writer: redis.Redis) -> None:
        writer.echo(self.stop)
        self.thread.join(10)
        self.client.close()


def _lists(queue: str) -> set[str]:
    """The Redis lists of ``queue`` (kombu's priority steps after the first)."""
    return {queue, *(f"{queue}\\x06\\x16{step}" for step in (3, 6, 9))}


def _brpops_become(
    brpops: Brpops, writer: redis.Redis, test: Callable[[frozenset[str]], bool], what: str
) -> str:
    """A mark after which the worker's ``BRPOP`` commands pass ``test``, two of them at
    least: the mark."""
    token = brpops.mark(writer)
    wait_until(lambda: len(brpops.since(token)) >= 2, timeout=20, what=f"two BRPOPs ({what})")
    assert all(test(keys) for keys in brpops.since(token)), (what, brpops.since(token))
    return token


def _only_bindings(b: redis.Redis) -> bool:
    """Nothing left in the broker's Redis but kombu's bindings: no message in a queue's
    lists, none delivered and not acknowledged (kombu's ``unacked`` hash and index)."""
    return all(key.startswith(b"_kombu.binding") for key in b.scan_iter())


def _nothing_left(r: redis.Redis, name: str, ran: list[str]) -> None:
    """Of the lock ``job:<name>`` only its fence and the runs' done markers are left (none
    held, parked or handed over, and the sweeper's registry does not list it)."""
    lock = f"redislock:{{job:{name}}}"
    wait_until(lambda: not r.exists(lock), timeout=15, what=f"{lock} released")
    wait_until(lambda: r.zscore("redislock:parked", lock) is None, timeout=15, what="unlisted")
    left = {key.decode() for key in r.scan_iter(match=f"{lock}*")}
    assert left == {f"{lock}:fence", *(f"{lock}:done:{task_id}" for task_id in ran)}, left


def _started(r: redis.Redis, name: str) -> list[tuple[str, int]]:
    """(task id, token) of each run of ``hold_for`` on ``name``, in order."""
    return [
        (line.split()[0].decode(), int(line.split()[1]))
        for line in r.lrange(f"started:{name}", 0, -1)
    ]


def test_add_consumer_on_a_redis_broker_elsewhere_takes_hand_overs_from_its_hand_over_queue(
    broker: RedisServer, redis_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """The broker a Redis server of its own, the locks on another: parked tasks are
    signatures, each handed its lock through ``<queue>.redislock``, each with a fallback
    copy in the broker (an ``eta`` task, 6 s). A worker started on ``base`` is told
    ``add_consumer q``: it polls ``q`` and ``q.redislock`` (its ``BRPOP`` commands name
    them), and ``inspect active_queues`` lists them. Eight tasks of one key sent to ``q``,
    parked behind a holder at delivery, then released: each runs exactly once, in the
    order sent, one at a time (strictly increasing tokens), every one received from
    ``q.redislock`` (a fallback copy's delivery says ``q``); their fallback copies are
    dropped as duplicates, and nothing is left in either Redis. ``cancel_consumer q``:
    the worker polls neither list any more (a task in each stays there) while it still
    runs ``base``'s tasks."""
    other = redis_server_factory()
    r, b = broker.client(), other.client()
    base, queue = f"base-{secrets.token_hex(3)}", f"added-{secrets.token_hex(3)}"
    handoff, name = f"{queue}.redislock", f"hot-{secrets.token_hex(3)}"
    client = Celery("handoff-added-client", broker=other.url, backend=broker.url)
    brpops = Brpops(other, base)
    env = {"REDISLOCK_TEST_BROKER": other.url, "REDISLOCK_TEST_TTL": "6"}
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, env=env, extra=["-Q", base])
    try:
        assert _active_queues(client, proc) == sorted([base, f"{base}.redislock"])
        _brpops_become(brpops, b, lambda keys: not keys & _lists(handoff), "before add_consumer")

        _control(client, proc, "add_consumer", queue)
        listed = _active_queues(client, proc)
        assert listed == sorted([base, f"{base}.redislock", queue, handoff]), listed
        both = _lists(queue) | _lists(handoff)
        _brpops_become(brpops, b, lambda keys: both <= keys, "q and q.redislock polled")

        def send(seconds: float, to: str = queue) -> Any:
            return client.send_task(ca.hold_for.name, args=(name, seconds), queue=to)

        warm = send(0.0)
        warm.get(timeout=30)  # the check at delivery is for keys that come again
        wait_until(lambda: not r.exists(f"redislock:{{job:{name}}}"), timeout=10)
        r.delete(f"started:{name}", f"delivered:{name}")
        holder = RedisLock(r, f"job:{name}", ttl=60, owner="holder", auto_renew=False)
        assert holder.acquire()
        sent = [send(0.05) for _ in range(8)]
        wait_until(lambda: r.llen(PARKED % name) == 8, timeout=30, what="eight parked")
        holder.release()  # (the sweeper hands the lock to the first parked task)
        for result in sent:
            result.get(timeout=60)
        # (and the fallback copies, eta tasks, delivered, found done and acknowledged)
        wait_until(lambda: _only_bindings(b), timeout=60, what="nothing left in the broker")

        started = _started(r, name)
        assert [task_id for task_id, _ in started] == [result.id for result in sent], started
        tokens = [token for _, token in started]
        assert tokens == sorted(set(tokens)), tokens  # one at a time, in line
        routed = [json.loads(line)[1] for line in r.lrange(f"delivered:{name}", 0, -1)]
        assert routed == [handoff] * len(sent), routed  # every run handed its lock
        text = proc.text()
        assert text.count("before dispatch; fallback copy in") == len(sent), text[-3000:]
        assert text.count("duplicate delivery ignored") == len(sent), text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        _nothing_left(r, name, [warm.id, *(result.id for result in sent)])

        _control(client, proc, "cancel_consumer", queue)
        assert _active_queues(client, proc) == sorted([base, f"{base}.redislock"])
        token = _brpops_become(brpops, b, lambda keys: not keys & both, "after cancel_consumer")
        left = [send(0.0), send(0.0, to=handoff)]
        other_key = client.send_task(ca.hold_for.name, args=(f"{name}-b", 0.0), queue=base)
        other_key.get(timeout=30)  # base is still consumed
        _brpops_become(brpops, b, lambda keys: not keys & both, "still not polled")
        assert b.llen(queue) == 1 and b.llen(handoff) == 1  # neither taken
        assert not any(keys & both for keys in brpops.since(token))
        assert all(result.state == "PENDING" for result in left)
    finally:
        proc.kill()
        brpops.close(b)
        client.close()
        r.close()
        b.close()


def _handed_in_while_the_window_is_full(
    r: redis.Redis, client: Any, rabbit: Rabbit, queue: str, slots: int
) -> None:
    """With the worker's ``slots`` pool processes and its task queues' prefetch window (as
    many) taken by tasks of ``queue`` waiting for a lock the test holds, a task published
    to ``queue.redislock`` (as a hand-over publishes it) is taken in at once: it has a
    window of its own (consumed on Celery's channel, it would wait in the queue for a
    waiting task's acknowledgement). Then all run, each once."""
    gate, other = f"gate-{secrets.token_hex(3)}", f"handed-{secrets.token_hex(3)}"
    holder = RedisLock(r, f"job:{gate}", ttl=60, owner="gate", auto_renew=False)
    assert holder.acquire()
    try:
        waiting = [
            client.send_task(ca.wait_if_busy.name, args=(gate,), queue=queue) for _ in range(slots)
        ]
        wait_until(lambda: rabbit.count(queue) == 0, timeout=20, what="the window taken")
        handed = client.send_task(ca.hold_for.name, args=(other, 0.0), queue=f"{queue}.redislock")
        # (the waiting tasks wait 20 s at most, and cannot take the lock the test holds)
        wait_until(
            lambda: rabbit.count(f"{queue}.redislock") == 0,
            timeout=15,
            what="the handed task taken in while the task queues' window is full",
        )
        assert all(result.state == "PENDING" for result in waiting) and holder.owned()
    finally:
        holder.release()
    assert [result.get(timeout=30) for result in waiting] == ["ran"] * slots
    handed.get(timeout=30)
    assert [task_id for task_id, _ in _started(r, other)] == [handed.id]


@rabbitmq
@pytest.mark.parametrize("how", ["started consuming nothing", "its queues cancelled, reconnected"])
def test_add_consumer_gives_a_worker_with_no_hand_over_consumer_one(
    broker: RedisServer, tmp_path: Path, rabbit: Rabbit, how: str
) -> None:
    """A worker on RabbitMQ that had no hand-over queue at its last start, so no
    hand-over consumer: started with every queue excluded (``-X celery``: it consumes
    nothing, not ``celery.redislock`` either), or started on ``base``, told
    ``cancel_consumer base`` and reconnected. Told ``add_consumer q``, it consumes ``q``
    and ``q.redislock`` (one consumer each), the latter on a channel of its own: a handed
    task is taken in while the task queues' window is full; ten contended tasks on one key
    each run once, in turn. After its connection is cut the hand-over queue is back on
    its own channel, consumed once; ``cancel_consumer q`` stops both queues."""
    queue = _queues(rabbit)
    both = [queue, f"{queue}.redislock"]
    r = broker.client()
    account = secrets.randbelow(10**9)
    relay = Relay().start()
    client = _client(broker)
    base = None if how == "started consuming nothing" else _queues(rabbit)
    env = {"REDISLOCK_TEST_BROKER": relay.url, "REDISLOCK_TEST_VT": "8"}
    extra = ["-X", "celery"] if base is None else ["-Q", base]
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, env=env, extra=extra)
    try:
        connections = 1
        if base is not None:
            _consumed_once(base, samples=0)
            _control(client, proc, "cancel_consumer", base)
            _counts_become([base, f"{base}.redislock"], [0, 0], samples=0)
            assert relay.cut() >= 1
            connections += 1
            _connected(proc, connections)
        assert _active_queues(client, proc) == []

        _control(client, proc, "add_consumer", queue)
        _consumed_once(queue)
        assert _active_queues(client, proc) == sorted(both)
        _handed_in_while_the_window_is_full(r, client, rabbit, queue, 2)
        _warm(client, queue, account, r)
        _each_once_in_turn(r, account, _send(client, queue, account, 10))
        assert proc.text().count("before dispatch") > 0  # parked: hand-overs were needed

        assert relay.cut() >= 1
        connections += 1
        _connected(proc, connections)
        _consumed_once(queue)
        _handed_in_while_the_window_is_full(r, client, rabbit, queue, 2)

        _control(client, proc, "cancel_consumer", queue)
        _counts_become(both, [0, 0])
        assert _active_queues(client, proc) == []
        assert f"started consuming from {both[1]} on the hand-over channel" in proc.text()
        _clean_log(proc)
    finally:
        proc.kill()
        client.close()
        relay.close()
        r.close()
