"""A Redis broker in another database of the locks' server: parking at delivery, the
hand-over's push and the look-ahead reach its queue lists (``celery.queuelists``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import redis
from celery import Celery

from celery_redislock import RedisLock
from celery_redislock._core import LockKeys
from celery_redislock._keyspace import parked_registry
from celery_redislock._replies import decode_handoff
from celery_redislock._scripts import scripts_for
from celery_redislock.celery.contention import _park_fallback
from celery_redislock.celery.envelope import _handed
from celery_redislock.celery.handover import deliver_handed_over
from celery_redislock.celery.parking import Parker, _broker_place, _same_redis
from celery_redislock.celery.queuelists import Place, place_of, queue_call
from celery_redislock.task import Sweeper, TaskLock, _next_queued, push_targets
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import EveryKeySeen, wait_until, worker
from .test_parking import _fetch

PARKED = "redislock:{job:%s}:parked"


def _db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
def broker_db1(broker: RedisServer) -> Iterator[Celery]:
    """A client app whose broker is database 1 of the locks' server (results in 0)."""
    app = Celery("broker-db1", broker=_db(broker.url, 1), backend=broker.url)
    app.conf.task_acks_late = True
    yield app
    app.close()


@pytest.fixture
def db1(broker: RedisServer) -> Iterator[redis.Redis]:
    """A client of database 1 of the session's server, emptied after the test."""
    client = redis.Redis.from_url(_db(broker.url, 1))
    yield client
    client.flushdb()
    client.close()


def _parked_behind_holder(
    r: redis.Redis, app: Celery, name: str, queue: str, count: int
) -> tuple[list[Any], Parker]:
    """``count`` tasks of ``job:<name>`` sent through ``app`` (database 1), parked at
    delivery behind a plain lock's holder ("holder") by a parker that knows the place."""
    RedisLock(r, f"job:{name}", ttl=60, owner="holder", auto_renew=False).acquire()
    sent = [app.send_task(ca.hold_for.name, args=(name, 0.01), queue=queue) for _ in range(count)]
    parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen(), place=Place(1, 0))
    for result in sent:
        assert _fetch(queue, app=app, parker=parker).headers["id"] == result.id
    return sent, parker


def _release_as(r: redis.Redis, name: str, owner: str, lists: str) -> list[Any]:
    lock = TaskLock(r, f"job:{name}", task_id=owner, options=ca.hold_for.lock_options())
    lock.push_to = (lists, push_targets(ca.app)[1])
    keys, args = lock.handoff_args(owner, "one", None)
    return list(scripts_for(r).handoff(keys=keys, args=args))


@pytest.fixture
def other_db_app(broker: RedisServer) -> Iterator[Celery]:
    """An app of the locks in database 0 of the session's server, its broker's lists in
    other databases reached there (``redislock_queues_in_other_db``)."""
    app = Celery("other-db-on", broker=_db(broker.url, 1))
    app.conf.redislock_url = broker.url
    app.conf.redislock_queues_in_other_db = True
    yield app
    app.close()


def test_the_broker_s_place_is_probed_not_guessed(
    broker: RedisServer, redis_server_factory: Any, other_db_app: Celery
) -> None:
    app = other_db_app
    assert place_of(app, broker.url) == Place(0, 0)
    assert place_of(app, _db(broker.url, 5)) == Place(5, 0)
    other = redis_server_factory()
    assert place_of(app, _db(other.url, 5)) is None  # another server, whatever its db
    assert place_of(app, "amqp://guest@127.0.0.1:5672//") is None
    assert Place(5, 0).name("celery") == "celery\r5\r0"
    assert Place(0, 0).name("celery") == "celery"
    assert Place(5, 0).name("odd\rname") is None  # never qualified twice
    consumer = SimpleNamespace(connection=Celery(broker=_db(broker.url, 3)).connection_for_read())
    try:
        assert _broker_place(app, consumer) == Place(3, 0)
        assert not _same_redis(app, consumer)  # (the same database only)
        # By default another database is out of reach (a release before the setting
        # would push its lists' messages into the locks' database): as another server.
        assert place_of(ca.app, broker.url) == Place(0, 0)
        assert place_of(ca.app, _db(broker.url, 5)) is None
        assert _broker_place(ca.app, consumer) is None
    finally:
        consumer.connection.release()


def test_a_broker_on_the_locks_server_needs_no_fallback_copies(
    broker: RedisServer, other_db_app: Celery
) -> None:
    assert not _park_fallback(other_db_app)  # same server: parked tasks share its fate
    off = Celery("fallback-db1", broker=_db(broker.url, 1))
    off.conf.redislock_url = broker.url
    assert _park_fallback(off)  # by default: another database is as another server
    other = Celery("fallback-amqp", broker="amqp://guest@127.0.0.1:5672//")
    other.conf.redislock_url = broker.url
    assert _park_fallback(other)  # the locks' Redis could lose them alone
    off.close()
    other.close()


def test_the_queue_script_reaches_another_database_and_nothing_else(
    broker: RedisServer, db1: redis.Redis
) -> None:
    r = broker.client()
    name = "q-x\r1\r0"
    assert queue_call(r, "RPUSH", name, b"a", b"b") == 2
    assert db1.lrange("q-x", 0, -1) == [b"a", b"b"] and not r.exists("q-x")
    assert queue_call(r, "LRANGE", name, 0, -1) == [b"a", b"b"]
    assert queue_call(r, "LREM", name, 0, b"a") == 1
    with pytest.raises(redis.ResponseError, match="not a queue list command"):
        queue_call(r, "DEL", name)
    with pytest.raises(redis.ResponseError):  # no such database: nothing written
        queue_call(r, "RPUSH", "q-x\r99999\r0", b"c")
    assert db1.lrange("q-x", 0, -1) == [b"b"]
    assert queue_call(r, "RPUSH", "q-plain", b"p") == 1  # a plain name: the locks' database
    assert r.lrange("q-plain", 0, -1) == [b"p"] and not db1.exists("q-plain")


def test_a_contended_message_parks_and_comes_back_to_its_list_in_the_other_database(
    broker: RedisServer, broker_db1: Celery, db1: redis.Redis
) -> None:
    r = broker.client()
    queue = "db1-parking"
    spec = f"{queue}\r1\r0"
    sent, parker = _parked_behind_holder(r, broker_db1, "db1", queue, 3)
    entries = r.hgetall(PARKED % "db1" + ":messages")
    assert len(entries) == 3
    assert all(e.startswith(b"E" + spec.encode() + b"\n") for e in entries.values())
    assert db1.llen(queue) == 0 and not r.exists(queue)

    reply = _release_as(r, "db1", "holder", spec)  # the script pushes it itself
    assert reply[0] == 0 and reply[1] is None and reply[2].decode() == sent[0].id
    assert db1.llen(queue) == 1 and not r.exists(queue)  # in the broker's database
    assert r.hget("redislock:{job:db1}", sent[0].id) == b"0"  # the lock's in its own
    first = _fetch(queue, app=broker_db1, parker=parker, parks=False)
    assert first.headers["id"] == sent[0].id
    assert first.delivery_tag.startswith("rltag")
    assert first.headers["redislock_lookahead"] == spec  # its release looks there

    # A releasing worker that does not list the qualified name gets the envelope back
    # and pushes it itself, to the same list.
    reply = _release_as(r, "db1", sent[0].id, queue)
    assert reply[2].decode() == sent[1].id and reply[1] is not None
    handed = _handed(b"redislock:{job:db1}", decode_handoff(reply).handed)
    assert deliver_handed_over(ca.app, handed, 3000) == 1
    assert db1.llen(queue) == 1 and not r.exists(queue)
    assert _fetch(queue, app=broker_db1).headers["id"] == sent[1].id


def test_the_sweeper_finds_a_pushed_envelope_in_the_other_database(
    broker: RedisServer, broker_db1: Celery, db1: redis.Redis
) -> None:
    r = broker.client()
    queue = "db1-sweep"
    (sent,), _parker = _parked_behind_holder(r, broker_db1, "db1s", queue, 1)
    _release_as(r, "db1s", "holder", f"{queue}\r1\r0")
    sweeper = Sweeper(ca.app)
    time.sleep(sweeper.ttl / 2 + 0.2)
    assert sweeper.sweep_once() == 0  # still in its queue list, found there
    assert db1.llen(queue) == 1
    assert db1.delete(queue) == 1  # lost on its way
    time.sleep(sweeper.ttl / 2 + 0.2)
    assert sweeper.sweep_once() == 1  # sent again, to the broker's database
    assert db1.llen(queue) == 1 and not r.exists(queue)
    copy = json.loads(db1.lindex(queue, -1))
    assert copy["headers"]["id"] == sent.id
    assert re.fullmatch(r"rltag[0-9a-f]{16}h\d+s\d+", copy["properties"]["delivery_tag"])


def test_a_forged_entry_naming_another_database_is_not_followed_by_the_sweep(
    broker: RedisServer, db1: redis.Redis
) -> None:
    """Whoever may write the lock keys may write a parked entry naming any list and
    databases: the sweep looks for it only in a list of the locks' own server whose "own"
    database is the sweeper's; anything else counts as not queued (sent again, through the
    worker's signature check), and the script never ends in the wrong database."""
    r = broker.client()
    lock_key = b"redislock:{job:forged}"
    keys = LockKeys.for_lock(lock_key)
    registry = parked_registry("redislock:")
    envelope = json.dumps({"headers": {"id": "t1"}, "properties": {"delivery_tag": "x"}})
    for own in ("7", "99999"):
        r.flushdb()
        r.hset(lock_key, mapping={"t1": 0, "__fence__": 5})
        r.pexpire(lock_key, 60_000)
        entry = f"Eq\r1\r{own}\nrltag{'0' * 16}\n{envelope}"
        r.hset(keys.parked_messages, "t1", entry)
        r.hset(keys.parked_dispatched, "t1", 1)  # handed over long ago
        sweep_keys = keys.sweep_keys(registry)
        reply = scripts_for(r).sweep(keys=sweep_keys, args=[3000, 1000, 1000, "", "0"])
        assert reply[0] == 1 and reply[2] == b"t1"  # to the worker: sent again or refused
        assert r.hget(keys.parked_dispatched, "t1") != b"1"  # its record, in db 0
    assert db1.dbsize() == 0


def test_the_look_ahead_reads_and_moves_in_the_other_database(
    broker: RedisServer, broker_db1: Celery, db1: redis.Redis
) -> None:
    r = broker.client()
    queue = "db1-lookahead"
    lock = TaskLock(r, "job:dla", task_id="holder", options=ca.hold_for.lock_options())
    assert lock.take() is True
    other = broker_db1.send_task(ca.hold_for.name, args=("elsewhere", 0.01), queue=queue)
    target = broker_db1.send_task(ca.hold_for.name, args=("dla", 0.01), queue=queue)
    pull = _next_queued(ca.app, lock, f"{queue}\r1\r0", 64, 60)
    assert pull is not None and pull.task_id == target.id
    assert lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull) is None
    assert lock.pulled == target.id
    ids = [json.loads(m)["headers"]["id"] for m in db1.lrange(queue, 0, -1)]
    assert ids == [other.id, target.id]  # moved to the read end (the right)
    assert json.loads(db1.lindex(queue, -1))["properties"]["delivery_tag"].startswith("rltag")
    assert r.hget("redislock:{job:dla}", target.id) == b"0" and not r.exists(queue)


def test_a_worker_parks_at_delivery_and_looks_ahead_with_its_broker_in_database_1(
    broker: RedisServer, broker_db1: Celery, db1: redis.Redis, tmp_path: Path
) -> None:
    """Queue (oldest first): a, o0..o5, b, c, d — a, b, c, d on one lock, o* each on its own;
    two slots, the broker in database 1. a is parked at delivery (no pool process taken); the
    holder's release pushes it back to database 1's list; b, c and d are each moved ahead of
    the backlog by the release before them (look-ahead). Every task runs once, the lock's in
    order and one at a time; no fallback copy; nothing left behind in either database."""
    r = broker.client()
    env = {"REDISLOCK_TEST_BROKER": _db(broker.url, 1), "REDISLOCK_TEST_QUEUES_IN_OTHER_DB": "1"}
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, env=env)
    try:

        def send(name: str, seconds: float) -> Any:
            return broker_db1.send_task(ca.hold_for.name, args=(name, seconds), queue="celery")

        send("busy", 0.0).get(timeout=60)  # the check at delivery is for keys that come again
        wait_until(lambda: not r.exists("redislock:{job:busy}"), timeout=10)
        r.delete("started:busy")
        RedisLock(r, "job:busy", ttl=60, owner="holder", auto_renew=False).acquire()
        first = send("busy", 0.2)
        backlog = [send(f"o{i}", 0.5) for i in range(6)]
        chain = [send("busy", 0.2) for _ in range(3)]
        wait_until(lambda: r.llen(PARKED % "busy") == 1, timeout=30)  # a, at delivery
        wait_until(lambda: r.llen("started:o1") == 1, timeout=30)  # both slots busy
        reply = _release_as(r, "busy", "holder", "celery\r1\r0")
        assert reply[2].decode() == first.id and reply[1] is None  # pushed by the script
        tokens = [result.get(timeout=60) for result in [first, *chain]]
        assert sum(r.llen(f"started:o{i}") for i in range(6)) < 6  # ahead of the backlog
        text = proc.text()
        assert text.count("before dispatch") == 1 and text.count("(look-ahead)") == 3
        assert "fallback copy" not in text
        assert tokens == sorted(tokens) and len(set(tokens)) == 4  # one at a time
        for result in backlog:
            result.get(timeout=60)
        started = [line.split()[0].decode() for line in r.lrange("started:busy", 0, -1)]
        assert started == [first.id, *(result.id for result in chain)]  # each once, in order
        assert all(r.llen(f"started:o{i}") == 1 for i in range(6))
        wait_until(lambda: not r.exists("redislock:{job:busy}"), timeout=10)
        assert not r.hlen(PARKED % "busy" + ":messages")
        assert not r.hlen(PARKED % "busy" + ":dispatched")
        assert db1.llen("celery") == 0 and not r.exists("celery")
    finally:
        proc.kill()


def test_by_default_a_worker_with_its_broker_in_database_1_parks_signatures(
    broker: RedisServer, broker_db1: Celery, db1: redis.Redis, tmp_path: Path
) -> None:
    """Without ``redislock_queues_in_other_db`` the broker in database 1 is as another
    server: what a release before the setting understands. The main process parks the
    hot key's tasks as signatures (never an envelope naming a list in another database),
    each with its fallback copy in the broker, and no pool process is taken to park
    them; every task of the hot key runs once, one at a time."""
    r = broker.client()
    env = {"REDISLOCK_TEST_BROKER": _db(broker.url, 1)}
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2, env=env)
    try:

        def send(name: str, seconds: float) -> Any:
            return broker_db1.send_task(ca.hold_for.name, args=(name, seconds), queue="celery")

        send("plain", 0.0).get(timeout=60)
        r.delete("started:plain")
        RedisLock(r, "job:plain", ttl=60, owner="holder", auto_renew=False).acquire()
        sent = [send("plain", 0.1) for _ in range(4)]
        wait_until(lambda: r.llen(PARKED % "plain") == 4, timeout=30)
        entries = list(r.hvals(PARKED % "plain" + ":messages"))
        assert len(entries) == 4 and not any(e.startswith(b"E") for e in entries), entries
        assert all(b"\r" not in e.split(b"\n", 1)[0] for e in entries), entries
        wait_until(lambda: proc.text().count("before dispatch; fallback copy in") == 4)
        RedisLock(r, "job:plain", ttl=60, owner="holder", auto_renew=False).release()
        tokens = [result.get(timeout=60) for result in sent]
        assert tokens == sorted(tokens) and len(set(tokens)) == 4  # in line, one at a time
        started = [line.split()[0].decode() for line in r.lrange("started:plain", 0, -1)]
        assert started == [result.id for result in sent]  # each once, in arrival order
        text = proc.text()
        assert text.count("before dispatch") == 4 and "parked behind the holder" in text
        assert text.count("parked behind") == 4  # no pool process parked one
        for client in (r, db1):
            assert not [k for k in client.scan_iter(count=1000) if b"\r" in k]
    finally:
        proc.kill()
