"""Parking at delivery: the worker's main process parks a contended task's broker envelope,
and the holder's release pushes it back to the head of its queue (Redis broker)."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from celery_redislock import RedisLock
from celery_redislock._core import OwnerRunning
from celery_redislock._scripts import scripts_for
from celery_redislock.celery import base as base_module
from celery_redislock.celery import parking as parking_module
from celery_redislock.celery import sweeper as sweeper_module
from celery_redislock.celery.parking import SEEN_KEYS, RecentKeys
from celery_redislock.parking import Parker, _same_redis
from celery_redislock.task import (
    QUEUE_REACH,
    Sweeper,
    TaskLock,
    _lookahead_denied,
    _next_queued,
    _Pull,
    push_targets,
)
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import EveryKeySeen, wait_until, worker
from ..lock.test_security import CELERY_COMMANDS, PASSWORD, acl_rules, denials, set_user

PARKED = "redislock:{job:%s}:parked"
CHAIN = "redislock:lookahead:%s"


def _release_as(r: redis.Redis, name: str, owner: str) -> list[Any]:
    """The holder's release (what a finishing task runs): hand over to the first parked,
    pushing a parked envelope back to its queue (as a worker consuming every queue the
    test app has sent to)."""
    lock = TaskLock(r, f"job:{name}", task_id=owner, options=ca.hold_for.lock_options())
    lock.push_to = ("\n".join(ca.app.amqp.queues), push_targets(ca.app)[1])
    keys, args = lock.handoff_args(owner, "one", None)
    return list(scripts_for(r).handoff(keys=keys, args=args))


class _Consumer:
    """A stand-in for the worker's consumer (hashable and weakly referable, as Celery's is)."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


def _warm(r: redis.Redis, name: str) -> None:
    """One task of ``job:<name>`` run to its end by the worker: the key is then among its
    recent keys, so its next messages are checked at delivery. Its start record goes."""
    ca.hold_for.delay(name, 0.0).get(timeout=60)
    wait_until(lambda: not r.exists(f"redislock:{{job:{name}}}"), timeout=10)
    r.delete(f"started:{name}")


def _fetch(queue: str, *, app: Any = None, parker: Parker | None = None, parks: bool = True) -> Any:
    """The next message of ``queue``, acked; first offered to ``parker`` (as the worker's
    main process does), which must answer ``parks``."""
    with (app or ca.app).connection_for_read() as conn:
        simple = conn.SimpleQueue(queue)
        try:
            message = simple.get(timeout=5.0)
            if parker is not None:
                assert parker.park(message) is parks
            message.ack()
            return message
        finally:
            simple.close()


def test_a_contended_message_is_parked_as_its_envelope_and_comes_back_first(
    broker: RedisServer,
) -> None:
    r = broker.client()
    queue = "parking-envelope"
    RedisLock(r, "job:env", ttl=60, owner="holder", auto_renew=False).acquire()
    # Task ids are the caller's to choose: quotes, backslashes and %-escapes included.
    ids = ['say "hi"', "C:\\temp\\x", "sync%2Fuser%1"]
    sent = [ca.hold_for.apply_async(("env", 0.01), queue=queue, task_id=i) for i in ids]
    other = ca.hold_for.apply_async(("free", 0.01), queue=queue)  # its lock is free
    parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen())
    for result in sent:  # parked: the worker acks it
        assert _fetch(queue, parker=parker).headers["id"] == result.id
    # free: delivered as usual
    assert _fetch(queue, parker=parker, parks=False).headers["id"] == other.id
    parked = [p.decode() for p in r.lrange(PARKED % "env", 0, -1)]
    assert parked == [result.id for result in sent]  # first come, first served
    entries = r.hgetall(PARKED % "env" + ":messages")
    assert all(entry.startswith(b"E" + queue.encode() + b"\n") for entry in entries.values())
    assert r.llen(queue) == 0
    assert r.zscore("redislock:parked", "redislock:{job:env}") is not None  # for the sweeper
    assert r.zscore("redislock:parked", "redislock:{job:free}") is None  # nothing parked there

    # The holder's release hands the lock to the first and pushes its envelope back.
    reply = _release_as(r, "env", "holder")
    assert reply[0] == 0 and reply[1] is None and reply[2].decode() == sent[0].id
    assert r.hget("redislock:{job:env}", sent[0].id) == b"0"  # handed over, not yet started
    assert r.llen(queue) == 1
    envelope = json.loads(r.lindex(queue, -1))
    assert envelope["headers"]["id"] == sent[0].id
    assert envelope["headers"]["redislock_requeues"] == 1
    tag = envelope["properties"]["delivery_tag"]
    assert re.fullmatch(r"rltag[0-9a-f]{16}h[0-9]+", tag)  # the placeholder, filled in once
    assert tag.split("h")[0].encode() in entries[sent[0].id.encode()]
    # ...and a newer message published meanwhile does not overtake it.
    later = ca.hold_for.apply_async(("later", 0.01), queue=queue)
    first = _fetch(queue)
    assert first.headers["id"] == sent[0].id
    assert first.decode()[0] == ["env", 0.01]
    assert first.delivery_tag.startswith("rltag")  # "handed over": not checked again
    # The next two come back the same way, ids intact.
    for previous, result in zip(sent, sent[1:]):
        reply = _release_as(r, "env", previous.id)
        assert reply[0] == 0 and reply[2].decode() == result.id
        assert _fetch(queue).headers["id"] == result.id
    assert _fetch(queue).headers["id"] == later.id


def test_a_key_s_first_message_goes_to_a_pool_process_unchecked(broker: RedisServer) -> None:
    """The check at delivery is for keys that come again: a key's first message among a
    worker's recent keys is delivered without a round trip (its lock held or not: the
    pool process's acquire decides, and parks it); its next one is checked and parked.
    The recent keys are the consumer's, every task type's alike, and the oldest go."""
    r = broker.client()
    queue = "parking-first-seen"
    RedisLock(r, "job:seen", ttl=60, owner="holder", auto_renew=False).acquire()
    first, second = (ca.hold_for.apply_async(("seen", 0.01), queue=queue) for _ in range(2))
    parker = Parker(ca.hold_for, ca.app, revoked=set())
    before = r.info("commandstats")
    assert _fetch(queue, parker=parker, parks=False).headers["id"] == first.id
    after = r.info("commandstats")
    assert after.get("cmdstat_exists") == before.get("cmdstat_exists")  # not asked
    assert after.get("cmdstat_evalsha") == before.get("cmdstat_evalsha")
    assert _fetch(queue, parker=parker).headers["id"] == second.id  # parked at delivery
    assert [p.decode() for p in r.lrange(PARKED % "seen", 0, -1)] == [second.id]
    # Bounded, oldest first: a key pushed out is unchecked again.
    recent = RecentKeys(size=2)
    assert [recent.again(k) for k in (b"a", b"b", b"a", b"c", b"b", b"a")] == [
        False,
        False,
        True,
        False,  # b is now the oldest, and goes
        False,
        False,  # a went when b came back
    ]


def test_a_task_type_whose_keys_never_come_again_is_checked_at_one_message_in_a_few(
    broker: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding a message's key costs the main loop its decoding and rendering: after
    QUIET_AFTER checked messages in a row with new keys, a message is checked with a
    chance of one in QUIET_EVERY; the first checked one whose key came again brings back
    the check of every message, and a held key's messages are parked at delivery again."""
    monkeypatch.setattr(parking_module, "QUIET_AFTER", 12)
    monkeypatch.setattr(parking_module, "_draw", random.Random(4).random)
    r = broker.client()
    queue = "parking-quiet"
    RedisLock(r, "job:quiet-hot", ttl=60, owner="holder", auto_renew=False).acquire()
    for i in range(12):  # one key each: never again
        ca.hold_for.apply_async((f"quiet-{i}", 0.01), queue=queue)
    parker = Parker(ca.hold_for, ca.app, revoked=set())
    for _ in range(12):
        _fetch(queue, parker=parker, parks=False)
    assert parker.recurrence.quiet == 12
    decoded = []
    original = parker.task.run_key

    def counting(args: Any, kwargs: Any) -> Any:
        decoded.append(args)
        return original(args, kwargs)

    monkeypatch.setattr(parker.task, "run_key", counting)
    # Checked at random: its key new the first time, come again the second (parked).
    delivered, hot, parks = [], [], []
    while len(decoded) < 2 and len(delivered) < 400:
        hot.append(ca.hold_for.apply_async(("quiet-hot", 0.01), queue=queue))
        task_id, parked_now = _offer(queue, parker)
        delivered.append(task_id)
        parks.append(parked_now)
    assert len(decoded) == 2 and 2 < len(delivered) < 400  # some went unchecked
    assert parks == [False] * (len(parks) - 1) + [True]
    assert parker.recurrence.quiet == 0
    for _ in range(3):  # then every message
        hot.append(ca.hold_for.apply_async(("quiet-hot", 0.01), queue=queue))
        delivered.append(_fetch(queue, parker=parker).headers["id"])
    assert delivered == [h.id for h in hot] and len(decoded) == 5
    parked = [p.decode() for p in r.lrange(PARKED % "quiet-hot", 0, -1)]
    assert parked == [h.id for h in hot[-4:]]


def _offer(queue: str, parker: Parker) -> tuple[str, bool]:
    """The next message of ``queue`` offered to ``parker``: its id, and whether it parked."""
    with ca.app.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue)
        try:
            message = simple.get(timeout=5.0)
            parked = parker.park(message)
            message.ack()
            return message.headers["id"], parked
        finally:
            simple.close()


def test_a_hot_key_in_step_with_the_sampled_check_is_still_found(
    broker: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a task type's keys have been new for QUIET_AFTER checks, its messages are
    checked at a sample: a held key whose messages come in step with it (one in every
    QUIET_EVERY messages, the others' keys new, as a producer's fixed-size batches send
    them) is still checked again, and its messages parked at delivery, every message
    delivered or parked once."""
    monkeypatch.setattr(parking_module, "QUIET_AFTER", 8)
    monkeypatch.setattr(parking_module, "_draw", random.Random(8).random)
    every = parking_module.QUIET_EVERY
    r = broker.client()
    queue = "parking-in-step"
    RedisLock(r, "job:step-hot", ttl=120, owner="holder", auto_renew=False).acquire()
    parker = Parker(ca.hold_for, ca.app, revoked=set())
    for i in range(8):  # new keys: the type turns quiet
        ca.hold_for.apply_async((f"step-warm-{i}", 0.01), queue=queue)
        assert _offer(queue, parker)[1] is False
    assert parker.recurrence.quiet >= 8
    sent: list[str] = []
    delivered: list[str] = []
    parked: list[str] = []
    for batch in range(200):  # the hot key first in each batch of QUIET_EVERY messages
        sent.append(ca.hold_for.apply_async(("step-hot", 0.01), queue=queue).id)
        for i in range(every - 1):
            sent.append(ca.hold_for.apply_async((f"step-{batch}-{i}", 0.01), queue=queue).id)
        for _ in range(every):
            task_id, was_parked = _offer(queue, parker)
            (parked if was_parked else delivered).append(task_id)
        if parked:
            break
    assert parked, "the hot key's messages were never checked again"
    assert sorted(parked + delivered) == sorted(sent) and len(parked + delivered) == len(sent)
    assert [p.decode() for p in r.lrange(PARKED % "step-hot", 0, -1)] == parked


def test_a_key_found_free_by_the_park_script_is_probed_with_exists_again(
    broker: RedisServer,
) -> None:
    """A key the check found held skips the EXISTS probe next time; once the park script
    finds it free (or the message's own), it is forgotten, and its next message is
    probed with EXISTS again (not sent on to the park script, its envelope built and
    signed for nothing)."""
    r = broker.client()
    queue = "parking-forget-held"
    lock_key = b"redislock:{job:forget}"
    RedisLock(r, "job:forget", ttl=60, owner="holder", auto_renew=False).acquire()
    sent = [ca.hold_for.apply_async(("forget", 0.01), queue=queue) for _ in range(3)]
    parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen())
    assert _fetch(queue, parker=parker).headers["id"] == sent[0].id  # held: parked
    assert lock_key in parker.held
    r.delete(lock_key.decode())  # the holder's lease ran out
    assert _fetch(queue, parker=parker, parks=False).headers["id"] == sent[1].id
    assert lock_key not in parker.held  # found free by the park script: forgotten
    before = r.info("commandstats")
    assert _fetch(queue, parker=parker, parks=False).headers["id"] == sent[2].id
    after = r.info("commandstats")
    assert after["cmdstat_exists"]["calls"] == before["cmdstat_exists"]["calls"] + 1
    assert after["cmdstat_evalsha"] == before["cmdstat_evalsha"]  # not asked to park


def test_a_key_whose_messages_alternate_between_task_types_is_checked_the_second_time(
    broker: RedisServer,
) -> None:
    """The recent keys are the consumer's: a key's first message of one task type makes
    the next message of its lock, of another task type, a key that came again."""
    r = broker.client()
    queue = "parking-alternate"
    RedisLock(r, "job:alt", ttl=60, owner="holder", auto_renew=False).acquire()
    first = ca.hold_for.apply_async(("alt", 0.01), queue=queue)
    second = ca.fail.apply_async(("alt",), queue=queue)
    third = ca.hold_for.apply_async(("alt", 0.01), queue=queue)
    consumer = _Consumer(controller=SimpleNamespace(state=SimpleNamespace(revoked=set())))
    seen = parking_module._recent_keys(consumer)
    assert parking_module._recent_keys(consumer) is seen  # one per consumer
    holding = Parker(ca.hold_for, ca.app, revoked=set(), seen=seen)
    failing = Parker(ca.fail, ca.app, revoked=set(), seen=seen)
    assert _fetch(queue, parker=holding, parks=False).headers["id"] == first.id
    assert _fetch(queue, parker=failing).headers["id"] == second.id  # parked
    assert _fetch(queue, parker=holding).headers["id"] == third.id  # parked
    assert [p.decode() for p in r.lrange(PARKED % "alt", 0, -1)] == [second.id, third.id]


@pytest.mark.parametrize("seen", [RecentKeys, EveryKeySeen], ids=["first", "again"])
def test_a_message_whose_key_cannot_be_rendered_is_delivered_not_lost(
    broker: RedisServer, seen: type[RecentKeys]
) -> None:
    """A hostile or broken message (its lock key's value missing, or of the wrong type)
    makes the key's rendering raise in the worker's main process: the message is
    delivered (the pool process fails the task), never dropped, and nothing is recorded
    for it."""
    queue = f"parking-unrenderable-{seen.__name__}"
    recent = seen()
    parker = Parker(ca.bad_value, ca.app, revoked=set(), seen=recent)
    sent = [
        ca.bad_value.apply_async(({"no id": 1},), queue=queue),
        ca.bad_value.apply_async(("not a mapping",), queue=queue),
        ca.app.send_task(ca.bad_value.name, (), queue=queue),  # no argument at all
    ]
    for result in sent:
        assert _fetch(queue, parker=parker, parks=False).headers["id"] == result.id
    assert not parker.held
    assert not recent._keys


def test_the_recent_keys_and_the_held_keys_stay_bounded(broker: RedisServer) -> None:
    """Every message of a stream of keys that never repeat adds one recent key: at most
    SEEN_KEYS are kept, the oldest dropped first (and a key pushed out is new again)."""
    recent = RecentKeys()
    for n in range(3 * parking_module.SEEN_KEYS):
        assert not recent.again(b"k%d" % n)
    assert len(recent._keys) == parking_module.SEEN_KEYS
    assert next(iter(recent._keys)) == b"k%d" % (2 * parking_module.SEEN_KEYS)
    assert recent.again(b"k%d" % (3 * parking_module.SEEN_KEYS - 1))
    assert not recent.again(b"k0")
    assert len(recent._keys) == parking_module.SEEN_KEYS


def test_recent_keys_hold_long_keys_by_digest() -> None:
    """Keys are rendered from task arguments: 4,096 keys of 100 kB each must not keep
    400 MB in the worker's main process. Long keys are remembered by a digest, and are
    still told apart and found again."""
    recent = RecentKeys()
    long_keys = [
        b"redislock:{doc:" + bytes([i % 256]) * 100_000 + str(i).encode() + b"}" for i in range(3)
    ]
    assert [recent.again(k) for k in long_keys] == [False, False, False]
    assert [recent.again(k) for k in long_keys] == [True, True, True]
    for i in range(SEEN_KEYS):
        recent.again(b"x" * 100_000 + str(i).encode())
    assert sum(len(k) for k in recent._keys) <= SEEN_KEYS * 64
    assert recent.again(b"redislock:{short}") is False and recent.again(b"redislock:{short}")


def test_the_sweeper_resends_a_lost_envelope_and_serves_an_abandoned_lock(
    broker: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = broker.client()
    queue = "parking-sweeper"
    RedisLock(r, "job:swept", ttl=60, owner="holder", auto_renew=False).acquire()
    sent = [ca.hold_for.apply_async(("swept", 0.01), queue=queue) for _ in range(2)]
    parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen())
    for result in sent:
        message = _fetch(queue, parker=parker)
        assert message.headers["id"] == result.id
    sweeper = Sweeper(ca.app)
    assert sweeper.sweep_once() == 0  # the holder is alive: nothing to do

    _release_as(r, "swept", "holder")
    stale = sweeper.ttl / 2
    time.sleep(stale + 0.2)
    # Not fetched yet (busy workers), but still in its queue: not sent again, and the
    # hand-over's lease is renewed so that it is still the task's when it is fetched.
    assert sweeper.sweep_once() == 0
    assert r.llen(queue) == 1
    assert r.pttl("redislock:{job:swept}") > stale * 1000
    assert r.delete(queue) == 1  # now the handed-over message is lost on its way
    time.sleep(stale + 0.2)
    assert sweeper.sweep_once() == 1  # ...so the sweeper sends it again
    token = int(r.hget("redislock:{job:swept}", "__fence__"))
    copy = json.loads(r.lindex(queue, -1))
    assert re.fullmatch(rf"rltag[0-9a-f]{{16}}h{token}s\d+", copy["properties"]["delivery_tag"])
    for _ in range(2):
        time.sleep(stale + 0.2)
        assert sweeper.sweep_once() == 0  # the copy it sent waits in the queue: recognised
        assert r.llen(queue) == 1
        assert r.pttl("redislock:{job:swept}") > stale * 1000  # its lease renewed
    # Looked for near the read end only: pushed back past the sweeper's reach, it counts
    # as lost and is sent again (the task's hold absorbs the extra copy).
    r.rpush(queue, b"another message")
    monkeypatch.setattr(sweeper_module, "QUEUE_REACH", 1)
    time.sleep(stale + 0.2)
    assert sweeper.sweep_once() == 1
    assert r.llen(queue) == 3
    r.lrem(queue, 0, b"another message")
    again = _fetch(queue)
    assert again.headers["id"] == sent[0].id
    assert r.lpop(queue) is not None and r.llen(queue) == 0  # the extra copy

    # Its task never starts and its hand-over lease runs out: the next parked task is served.
    r.delete("redislock:{job:swept}")
    assert sweeper.sweep_once() == 1
    assert _fetch(queue).headers["id"] == sent[1].id


def _app_with_a_locked_task(name: str, broker_url: str, **conf: Any) -> tuple[Any, Any]:
    """A Celery app of its own (settings are read once per app) with one LockedTask."""
    from celery import Celery

    from celery_redislock.task import LockedTask

    app = Celery(name, broker=broker_url)
    app.conf.update(conf)

    @app.task(shared=False, base=LockedTask, lock_key="job:{name}", name=f"{name}.job")
    def job(name: str) -> None:
        pass

    app.finalize()
    return app, job


def test_a_worker_parks_contended_tasks_without_a_pool_process_and_runs_them_in_order(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log")
    try:
        _warm(r, "line")  # the check at delivery is for keys that come again
        RedisLock(r, "job:line", ttl=60, owner="holder", auto_renew=False).acquire()
        results = [ca.hold_for.delay("line", 0.01) for _ in range(5)]
        wait_until(lambda: r.llen(PARKED % "line") == 5, timeout=30)
        assert r.llen("started:line") == 0  # no pool process ran any of them
        # (each one's log line follows its parking's write: waited for, then counted)
        wait_until(lambda: proc.text().count("before dispatch") >= 5, timeout=10)
        assert proc.text().count("before dispatch") == 5
        assert _release_as(r, "line", "holder")[2].decode() == results[0].id
        tokens = [result.get(timeout=60) for result in results]
        started = [line.split()[0].decode() for line in r.lrange("started:line", 0, -1)]
        assert started == [result.id for result in results]  # once each, in arrival order
        assert tokens == sorted(tokens) and len(set(tokens)) == 5
        wait_until(lambda: not r.exists("redislock:{job:line}"), timeout=10)
    finally:
        proc.kill()


def test_parking_at_delivery_needs_the_locks_in_the_brokers_own_redis(
    broker: RedisServer, redis_server_factory: Any
) -> None:
    consumer = SimpleNamespace(connection=ca.app.connection_for_read())
    try:
        assert _same_redis(ca.app, consumer)
        other = redis_server_factory()
        ca.app.conf.broker_url = other.url  # the same code on another server: no
        consumer.connection.release()
        consumer.connection = ca.app.connection_for_read()
        assert not _same_redis(ca.app, consumer)
        ca.app.conf.broker_url = broker.url.rsplit("/", 1)[0] + "/5"  # same server, other db
        consumer.connection.release()
        consumer.connection = ca.app.connection_for_read()
        assert not _same_redis(ca.app, consumer)
    finally:
        consumer.connection.release()
        ca.app.conf.broker_url = broker.url


def test_one_broken_lock_does_not_stop_the_sweepers_pass(broker: RedisServer) -> None:
    r = broker.client()
    queue = "parking-broken"
    RedisLock(r, "job:good", ttl=60, owner="holder", auto_renew=False).acquire()
    sent = ca.hold_for.apply_async(("good", 0.01), queue=queue)
    _fetch(queue, parker=Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen()))
    # A lock ahead of it in the registry whose parked entry cannot be published.
    r.rpush("redislock:{job:bad}:parked", "t-bad")
    r.hset("redislock:{job:bad}:parked:messages", "t-bad", "{not json")
    r.zadd("redislock:parked", {"redislock:{job:bad}": 0})
    r.delete("redislock:{job:good}")  # the good lock's holder vanished
    assert Sweeper(ca.app).sweep_once() == 1
    assert _fetch(queue).headers["id"] == sent.id


def test_a_revoked_task_the_lock_was_handed_to_passes_it_on(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log")
    try:
        holder = ca.hold_for.delay("rv", 1.5)
        wait_until(lambda: r.llen("started:rv") == 1, timeout=30)
        dropped, after = ca.hold_for.delay("rv", 0.01), ca.hold_for.delay("rv", 0.01)
        wait_until(lambda: r.llen(PARKED % "rv") == 2, timeout=30)
        dropped.revoke()
        holder.get(timeout=30)
        after.get(timeout=30)  # not stuck behind the revoked task's unstarted hold
        assert dropped.state == "REVOKED"
        started = [line.split()[0].decode() for line in r.lrange("started:rv", 0, -1)]
        assert started == [holder.id, after.id]
        assert "it was dropped before it ran (revoked)" in proc.text()
        wait_until(lambda: not r.exists("redislock:{job:rv}"), timeout=10)
    finally:
        proc.kill()


def test_a_lock_user_that_may_not_write_the_queue_leaves_parking_to_pool_processes(
    broker: RedisServer, caplog: Any
) -> None:
    admin = broker.client()
    admin.execute_command("ACL", "SETUSER", "lockonly", "on", ">pw", "~redislock:*", "+@all")
    port = broker.url.rsplit(":", 1)[1].split("/")[0]
    app, job = _app_with_a_locked_task(
        "parking-acl",
        broker.url,
        redislock_url=f"redis://lockonly:pw@127.0.0.1:{port}/0",
        redislock_park_fallback=False,  # "auto" compares URL strings: these differ
    )
    queue = "parking-acl"
    try:
        with app.connection_for_read() as conn:
            consumer = _Consumer(
                connection=conn,
                controller=SimpleNamespace(state=SimpleNamespace(revoked=set())),
            )
            parking_module._seen[consumer] = EveryKeySeen()  # every message checked
            parkers = [Parker.for_consumer(job, app, consumer) for _ in range(2)]
        RedisLock(admin, "job:acl", ttl=60, owner="holder", auto_renew=False).acquire()
        for parker in parkers:  # as the Parkers of two task types of the app
            assert parker is not None  # same server and db: found with the probe key
            job.apply_async(("acl",), queue=queue)
            _fetch(queue, app=app, parker=parker, parks=False)  # a pool process parks it
        assert not admin.exists(PARKED % "acl")
        # Asked once per app and list (the probe's LREM scans the whole list).
        assert caplog.text.count("parking at delivery is off for queue 'parking-acl'") == 1
    finally:
        admin.execute_command("ACL", "DELUSER", "lockonly")
        app.close()


def test_a_prioritised_message_under_a_key_prefix_comes_back_to_the_first_read_list(
    broker: RedisServer,
) -> None:
    """kombu's Redis transport: ``global_keyprefix`` on every list, one list per priority
    step; a handed-over task goes to the list read first (the first priority step)."""
    r = broker.client()
    app, job = _app_with_a_locked_task(
        "parking-priority", broker.url, broker_transport_options={"global_keyprefix": "pfx:"}
    )
    queue = "parking-pri"
    try:
        RedisLock(r, "job:pri", ttl=60, owner="holder", auto_renew=False).acquire()
        sent = job.apply_async(("pri",), queue=queue, priority=9)
        assert r.llen(f"pfx:{queue}\x06\x169") == 1  # where kombu put it
        _fetch(queue, app=app, parker=Parker(job, app, revoked=set(), seen=EveryKeySeen()))
        lock = TaskLock(r, "job:pri", task_id="holder", options=job.lock_options())
        app.amqp.queues.select(queue)  # as a worker consuming it (celery worker -Q)
        lock.push_to = push_targets(app)  # (what task_lock sets: its lists are "pfx:...")
        keys, args = lock.handoff_args("holder", "one", None)
        assert scripts_for(r).handoff(keys=keys, args=args)[2].decode() == sent.id
        assert r.llen(f"pfx:{queue}") == 1  # the first-read list
        again = _fetch(queue, app=app)
        assert again.headers["id"] == sent.id
        assert again.properties.get("priority") == 9  # its own priority is kept
    finally:
        app.close()


def test_tasks_parked_at_delivery_survive_the_whole_worker_being_killed(
    broker: RedisServer, tmp_path: Path
) -> None:
    """SIGKILL of the worker's whole process group while one task holds the lock and
    three wait parked at delivery: a new worker runs all four, in turn, with rising
    tokens (the holder's unacked message comes back after the visibility timeout; the
    sweeper serves the parked tasks once the dead holder's lease runs out; whichever
    comes first, nothing runs beside another)."""
    import os
    import signal

    r = broker.client()
    env = {"REDISLOCK_TEST_TTL": "3", "REDISLOCK_TEST_VT": "2"}
    first = worker(broker.url, tmp_path / "w1.log", env=env, name="doomed")
    try:
        holder = ca.hold_for.delay("kill", 2.0)
        wait_until(lambda: r.llen("started:kill") == 1, timeout=30)
        parked = [ca.hold_for.delay("kill", 0.05) for _ in range(3)]
        wait_until(lambda: r.llen(PARKED % "kill") == 3, timeout=30)
        wait_until(lambda: first.text().count("before dispatch") >= 3, timeout=10)
        assert first.text().count("before dispatch") == 3
        os.killpg(first.pid, signal.SIGKILL)
        assert first.process is not None
        first.process.wait(10)
    finally:
        first.stop()
    second = worker(broker.url, tmp_path / "w2.log", env=env, name="heir")
    try:
        for result in [*parked, holder]:  # the killed holder runs again: nothing is lost
            result.get(timeout=60)
        started = [line.split() for line in r.lrange("started:kill", 0, -1)]
        ids = [entry[0].decode() for entry in started]
        assert ids[0] == holder.id and ids.count(holder.id) == 2  # killed once, then redelivered
        assert sorted(ids.count(p.id) for p in parked) == [1, 1, 1]  # each exactly once
        tokens = [int(entry[1]) for entry in started]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    finally:
        second.kill()


def test_a_copy_looking_for_its_own_delivery_does_not_keep_a_dead_ones_lease_alive(
    broker: RedisServer,
) -> None:
    """A redelivered copy of a task whose first delivery died finds that delivery's hold
    (same run owner). Its check must neither lengthen the dead lease (it used to, on every
    re-queue, until the copy gave up: the task was lost) nor change the hold count (a
    count it added and then dropped in a second call let the original's release leave no
    done marker when it finished in between: the work ran twice)."""
    r = broker.client()
    options = ca.hold_for.lock_options()
    key = "redislock:{job:dup}"
    RedisLock(r, "job:dup", ttl=1.0, owner="t-1", auto_renew=False).acquire()  # the dead one
    copy = TaskLock(r, "job:dup", task_id="t-1", options=options)
    with pytest.raises(OwnerRunning):
        copy.take()  # "another delivery of this run": nothing changed
    assert r.hgetall(key) == {b"t-1": b"1", b"__fence__": b"1"}
    assert 0 < r.pttl(key) <= 1000  # not lengthened to the task's ttl
    assert copy.hold_count == 0
    # A retry (its own run: owner "t-1~r1") adopting the hold its first run kept takes it
    # over with its full lease.
    adopter = TaskLock(r, "job:dup", task_id="t-1~r1", options=options)
    assert adopter.take(adopt="t-1") and r.pttl(key) > 1000
    assert r.hgetall(key) == {b"t-1~r1": b"1", b"__fence__": b"1"}
    adopter.release()
    # A lock handed to the task (hold count 0) is taken up with its full lease.
    r.hset(key, mapping={"t-2": 0, "__fence__": 7})
    r.pexpire(key, 500)
    taker = TaskLock(r, "job:dup", task_id="t-2", options=options)
    assert taker.take() and taker.server_hold_count == 1 and taker.token == 7
    assert r.pttl(key) > 1000
    taker.release()


# ------------------------------------------------------------------ look-ahead at release


def _holder(r: redis.Redis, name: str, owner: str = "holder") -> TaskLock:
    lock = TaskLock(r, f"job:{name}", task_id=owner, options=ca.hold_for.lock_options())
    assert lock.take() is True
    return lock


def test_a_release_with_nobody_parked_hands_the_lock_to_the_next_queued_task_of_its_lock(
    broker: RedisServer,
) -> None:
    r = broker.client()
    queue = "lookahead-pull"
    lock = _holder(r, "la")
    token = lock.token
    # Oldest first: tasks the look-ahead must pass over, then the one it takes.
    passed = [
        ca.hold_for.apply_async(("la", 0.01), queue=queue, countdown=60),  # an eta
        ca.skip_if_busy.apply_async(("la",), queue=queue),  # not requeue mode
        ca.hold_for.apply_async(("elsewhere", 0.01), queue=queue),  # another lock
        ca.settle.apply_async((7, 1), queue=queue),  # another task and lock
    ]
    target = ca.hold_for.apply_async(("la", 0.01), queue=queue)
    later = ca.hold_for.apply_async(("la", 0.01), queue=queue)  # newer: stays in its turn
    before = r.lrange(queue, 0, -1)

    pull = _next_queued(ca.app, lock, queue, 64, 60)
    assert pull is not None and pull.task_id == target.id
    assert pull.raw in before
    assert lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull) is None
    assert lock.pulled == target.id
    assert r.hget(CHAIN % queue, "lock") == b"redislock:{job:la}"  # its chain: the list's one
    # Handed over as a parked task would be: count 0, a new token, the sweeper's records.
    held = r.hgetall("redislock:{job:la}")
    assert held[target.id.encode()] == b"0"
    assert int(held[b"__fence__"]) == token + 1
    assert r.hexists(PARKED % "la" + ":messages", target.id)
    assert r.hexists(PARKED % "la" + ":dispatched", target.id)
    for record in (":messages", ":dispatched"):  # they expire as parked records do
        assert 50_000 < r.pttl(PARKED % "la" + record) <= 60_000
    assert r.zscore("redislock:parked", "redislock:{job:la}") is not None
    # Its message moved from its place to the read end, with a hand-over's delivery tag.
    after = r.lrange(queue, 0, -1)
    assert len(after) == len(before) and pull.raw not in after
    moved = json.loads(after[-1])
    assert moved["headers"]["id"] == target.id
    assert re.fullmatch(rf"rltag[0-9a-f]{{16}}h{token + 1}", moved["properties"]["delivery_tag"])
    assert [json.loads(m)["headers"]["id"] for m in after[:-1]] == [
        later.id,
        *reversed([p.id for p in passed]),
    ]
    # The worker's main process delivers it without checking the lock again, and tells
    # the pool process which list its own release is to search.
    parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen())
    first = _fetch(queue, parker=parker, parks=False)
    assert first.headers["id"] == target.id
    assert first.headers["redislock_lookahead"] == queue
    assert first.decode()[0] == ["la", 0.01]


def test_the_look_ahead_gives_way_to_parked_tasks_and_to_tasks_that_went_meanwhile(
    broker: RedisServer,
) -> None:
    r = broker.client()
    queue = "lookahead-misses"
    lock = _holder(r, "miss")
    queued = ca.hold_for.apply_async(("miss", 0.01), queue=queue)
    pull = _next_queued(ca.app, lock, queue, 64, 60)
    assert pull is not None and pull.task_id == queued.id

    # A task parked behind the holder meanwhile is handed the lock first.
    parked = TaskLock(r, "job:miss", task_id="parked", options=ca.hold_for.lock_options())
    assert isinstance(parked.park('{"parked": 1}', keep_for=60), int)  # the holder's pttl
    assert r.llen(PARKED % "miss") == 1
    assert _next_queued(ca.app, lock, queue, 64, 60) is None  # a task is parked: no search
    handed = lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull)
    assert handed is not None and handed.message == b'{"parked": 1}'  # to check, then send
    assert handed.task_id == b"parked" and lock.pulled is None
    assert r.hget("redislock:{job:miss}", "parked") == b"0"
    assert r.llen(queue) == 1 and r.lindex(queue, 0) == pull.raw  # left in its turn
    r.delete("redislock:{job:miss}")

    # The message was fetched meanwhile: the release just frees the lock.
    lock = _holder(r, "miss", "second")
    assert r.rpop(queue) == pull.raw
    lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull)
    assert lock.pulled is None and not r.exists("redislock:{job:miss}")

    # Its task id finished meanwhile (another delivery ran it): not handed the lock.
    r.lpush(queue, pull.raw)
    r.set(f"redislock:{{job:miss}}:done:{queued.id}", "1")
    lock = _holder(r, "miss", "third")
    lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull)
    assert lock.pulled is None and not r.exists("redislock:{job:miss}")
    assert r.lrange(queue, 0, -1) == [pull.raw]
    r.delete(f"redislock:{{job:miss}}:done:{queued.id}")

    # Moved back past the release's reach (found next to read, then a hand-over pushed to
    # the read end): left in its turn, the list not scanned further; within reach, pulled.
    assert pull.reach == 1 + QUEUE_REACH  # found next to read, plus the slack
    r.rpush(queue, b"another message")
    lock = _holder(r, "miss", "fourth")
    lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull._replace(reach=1))
    assert lock.pulled is None and not r.exists("redislock:{job:miss}")
    assert r.lrange(queue, 0, -1) == [pull.raw, b"another message"]
    lock = _holder(r, "miss", "fifth")
    lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull._replace(reach=2))
    assert lock.pulled == queued.id
    assert r.lindex(queue, 0) == b"another message" and r.llen(queue) == 2  # moved to the end


def test_the_look_ahead_searches_as_far_as_lock_lookahead_says(broker: RedisServer) -> None:
    r = broker.client()
    queue = "lookahead-far"
    lock = _holder(r, "far")
    for i in range(40):  # 40 older messages of other locks (over two reads of 16)
        ca.hold_for.apply_async((f"other{i}", 0.01), queue=queue)
    target = ca.hold_for.apply_async(("far", 0.01), queue=queue)
    assert _next_queued(ca.app, lock, queue, 40, 60) == _Pull(queue, CHAIN % queue)  # none
    found = _next_queued(ca.app, lock, queue, 41, 60)
    assert found is not None and found.task_id == target.id
    assert _next_queued(ca.app, lock, queue, 1000, 60).task_id == target.id  # type: ignore[union-attr]
    empty = "lookahead-empty"
    assert _next_queued(ca.app, lock, empty, 64, 60) == _Pull(empty, CHAIN % empty)
    lock.finish(hold=0, done_ttl=60)


def test_a_worker_runs_the_queued_tasks_of_a_busy_lock_ahead_of_the_backlog(
    broker: RedisServer, tmp_path: Path
) -> None:
    """Queue (oldest first): a, o0..o7, b, c, d — a, b, c, d on one lock, o* each on its own.
    With two slots and look-ahead, b, c and d run one after another as soon as the lock is
    free, each moved ahead of the o* backlog by the release before it (without look-ahead
    they would wait for o2..o7, in turn)."""
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2)
    try:
        _warm(r, "busy")  # the check at delivery is for keys that come again
        RedisLock(r, "job:busy", ttl=60, owner="holder", auto_renew=False).acquire()
        first = ca.hold_for.apply_async(("busy", 0.2), queue="celery")
        backlog = [ca.hold_for.apply_async((f"o{i}", 0.5), queue="celery") for i in range(8)]
        chain = [ca.hold_for.apply_async(("busy", 0.2), queue="celery") for _ in range(3)]
        wait_until(lambda: r.llen(PARKED % "busy") == 1, timeout=30)  # a, at delivery
        wait_until(lambda: r.llen("started:o1") == 1, timeout=30)  # both slots busy
        assert _release_as(r, "busy", "holder")[2].decode() == first.id
        tokens = [result.get(timeout=60) for result in [first, *chain]]
        # d is done while the backlog still has tasks that were queued long before it.
        assert sum(r.llen(f"started:o{i}") for i in range(8)) < 8
        assert proc.text().count("(look-ahead)") == 3  # b, c and d were moved ahead
        assert tokens == sorted(tokens) and len(set(tokens)) == 4  # one at a time
        for result in backlog:
            result.get(timeout=60)
        started = [line.split()[0].decode() for line in r.lrange("started:busy", 0, -1)]
        assert started == [first.id, *(result.id for result in chain)]  # each once, in order
        assert all(r.llen(f"started:o{i}") == 1 for i in range(8))
        # Nothing left behind: the lock, the parked and dispatched records are gone.
        wait_until(lambda: not r.exists("redislock:{job:busy}"), timeout=10)
        assert not r.hlen(PARKED % "busy" + ":messages")
        assert not r.hlen(PARKED % "busy" + ":dispatched")
    finally:
        proc.kill()


def test_a_lock_user_that_may_not_read_the_queue_releases_without_look_ahead(
    broker: RedisServer, caplog: Any
) -> None:
    admin = broker.client()
    queue = "lookahead-acl"
    admin.execute_command(
        "ACL",
        "SETUSER",
        "noread",
        "on",
        ">pw",
        "~redislock:*",
        f"~{queue}",
        "&redislock:*",
        "+@all",
        "-lrange",
    )
    port = broker.url.rsplit(":", 1)[1].split("/")[0]
    user = redis.Redis.from_url(f"redis://noread:pw@127.0.0.1:{port}/0")
    try:
        lock = _holder(user, "acl-read")
        queued = ca.hold_for.apply_async(("acl-read", 0.01), queue=queue)
        assert _next_queued(ca.app, lock, queue, 64, 60) is None
        assert "look-ahead is off for queue list 'lookahead-acl'" in caplog.text
        assert queue in _lookahead_denied
        options = ca.hold_for.lock_options()
        ca.hold_for.push_request(
            redislock_lookahead=queue, properties={"delivery_tag": "rltag0123h1"}
        )
        try:
            assert ca.hold_for._lookahead(lock, options) is None  # not searched again
        finally:
            ca.hold_for.pop_request()
        lock.finish(hold=0, done_ttl=60)
        assert not admin.exists("redislock:{job:acl-read}")
        assert json.loads(admin.lindex(queue, -1))["headers"]["id"] == queued.id  # untouched
    finally:
        _lookahead_denied.discard(queue)
        user.close()
        admin.execute_command("ACL", "DELUSER", "noread")


def test_only_the_worker_s_own_look_ahead_header_on_a_handed_over_delivery_counts(
    broker: RedisServer, monkeypatch: Any
) -> None:
    r = broker.client()
    lock = _holder(r, "trust")
    options = ca.hold_for.lock_options()
    task = ca.hold_for

    def lookahead(**request: Any) -> Any:
        task.push_request(**request)
        try:
            return task._lookahead(lock, options)
        finally:
            task.pop_request()

    handed = {"delivery_tag": "rltag0123456789abcdefh7"}
    assert callable(lookahead(redislock_lookahead="q", properties=handed))
    # A header that came in a message (a normal delivery tag) is not trusted.
    assert lookahead(redislock_lookahead="q", properties={"delivery_tag": "a-uuid"}) is None
    assert lookahead(properties=handed) is None  # no header: not a hand-over through a list
    # No thread to search with: the task runs and releases without look-ahead.
    monkeypatch.setattr(base_module, "_lookahead_thread", _no_thread)
    assert lookahead(redislock_lookahead="q", properties=handed) is None
    # A retry or a re-queue never publishes the header.
    task.push_request(
        id="t1", args=["trust", 0.01], kwargs={}, headers={"redislock_lookahead": "q", "x": 1}
    )
    try:
        signature = task.signature_from_request(headers={"redislock_lookahead": "q", "y": 2})
        assert "redislock_lookahead" not in signature.options["headers"]
        assert signature.options["headers"]["y"] == 2
    finally:
        task.pop_request()
    lock.finish(hold=0, done_ttl=60)


def _no_thread() -> Any:
    raise RuntimeError("can't start new thread")


def test_one_lock_at_a_time_is_served_ahead_in_a_queue(broker: RedisServer) -> None:
    """Two busy locks in one queue: the second lock's tasks are not moved ahead while the
    first's chain lasts (two or more such chains would take every slot in turn). A chain
    lasts while its lock is held by a task it was handed that way, whatever ends it."""
    r = broker.client()
    queue = "lookahead-chains"
    first, second = _holder(r, "one"), _holder(r, "two")
    later = [ca.hold_for.apply_async((name, 0.01), queue=queue) for name in ("one", "two")]
    pull = _next_queued(ca.app, first, queue, 64, 60)
    assert pull is not None and pull.task_id == later[0].id
    first.finish(hold=0, done_ttl=60, lookahead=lambda: pull)
    assert first.pulled == later[0].id
    assert r.hget(CHAIN % queue, "lock") == b"redislock:{job:one}"
    assert r.hget("redislock:{job:one}", "__chain__") == queue.encode()

    # The second lock's release finds the list taken: no move, though its task is there.
    pull = _next_queued(ca.app, second, queue, 64, 60)
    assert pull is not None and pull.task_id == later[1].id
    second.finish(hold=0, done_ttl=60, lookahead=lambda: pull)
    assert second.pulled is None and not r.exists("redislock:{job:two}")
    assert r.lrange(queue, 0, 0) == [pull.raw]  # left in its turn
    assert r.hget(CHAIN % queue, "lock") == b"redislock:{job:one}"  # not another lock's to end

    # The first chain ends without a release of its own that says so (its task dropped
    # unstarted, as for a revoked message): the list is free again at once.
    unstarted = TaskLock(r, "job:one", task_id=later[0].id, options=ca.hold_for.lock_options())
    keys, args = unstarted.handoff_args(later[0].id, "unstarted", 60)
    assert scripts_for(r).handoff(keys=keys, args=args)[0] == 0
    second = _holder(r, "two", "again")
    pull = _next_queued(ca.app, second, queue, 64, 60)
    assert pull is not None and pull.task_id == later[1].id
    second.finish(hold=0, done_ttl=60, lookahead=lambda: pull)
    assert second.pulled == later[1].id
    assert r.hget(CHAIN % queue, "lock") == b"redislock:{job:two}"

    # Its moved task's release finds no next one: the chain ends and its record goes.
    handed = _holder(r, "two", later[1].id)
    ended = _next_queued(ca.app, handed, queue, 64, 60)
    assert ended == _Pull(queue, CHAIN % queue)
    handed.finish(hold=0, done_ttl=60, lookahead=lambda: ended)
    assert not r.exists(CHAIN % queue) and not r.exists("redislock:{job:two}")


def test_a_kept_hold_is_no_chain(broker: RedisServer) -> None:
    """lock_hold / a retry keeping its hold: the lock stays held, its task does not run,
    so it is no look-ahead chain (release.lua's "hold" drops the mark)."""
    r = broker.client()
    r.hset("redislock:{job:kept}", mapping={"task": 1, "__fence__": 1, "__chain__": "q"})
    lock = TaskLock(r, "job:kept", task_id="task", options=ca.hold_for.lock_options())
    keys = lock.keys.release_keys()
    assert scripts_for(r).release(keys=keys, args=["task", "hold", 5000]) == 0
    assert r.hgetall("redislock:{job:kept}") == {b"task": b"1", b"__fence__": b"1"}


def test_a_worker_with_one_slot_does_not_look_ahead(broker: RedisServer) -> None:
    """Moved ahead, a lock's tasks would take a one-slot worker's only slot in turn."""
    r = broker.client()
    queue = "lookahead-one-slot"
    RedisLock(r, "job:solo", ttl=60, owner="holder", auto_renew=False).acquire()
    parked = ca.hold_for.apply_async(("solo", 0.01), queue=queue)
    for slots, header in ((1, False), (2, True)):
        parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen(), slots=slots)
        if slots == 1:
            _fetch(queue, parker=parker)  # parked at delivery
            _release_as(r, "solo", "holder")  # ...and handed its lock through the list
        message = _fetch(queue, parker=parker, parks=False)
        assert message.headers["id"] == parked.id
        assert ("redislock_lookahead" in message.headers) is header
        if slots == 1:  # deliver the same hand-over again, to a two-slot worker
            r.rpush(queue, json.dumps(message._raw))


@pytest.mark.parametrize("lpos", [True, False], ids=["documented", "without-lpos"])
def test_look_ahead_works_for_the_documented_lock_user(broker: RedisServer, lpos: bool) -> None:
    """docs/security.md: the Celery lock user, plus the queue list, +lrange and +lpos;
    without +lpos, the release finds the message with LREM alone (and logs a denial)."""
    admin = broker.client()
    queue = "lookahead-doc-acl"
    user = "lookahead-doc"
    commands = (*CELERY_COMMANDS, "lrange", *(["lpos"] if lpos else []))
    rules = acl_rules(commands, keys=("redislock:*", queue))
    set_user(admin, user, rules)
    admin.execute_command("ACL", "LOG", "RESET")
    port = broker.url.rsplit(":", 1)[1].split("/")[0]
    client = redis.Redis.from_url(f"redis://{user}:{PASSWORD}@127.0.0.1:{port}/0")
    try:
        lock = _holder(client, "doc-acl")
        queued = ca.hold_for.apply_async(("doc-acl", 0.01), queue=queue)
        pull = _next_queued(ca.app, lock, queue, 64, 60)
        assert pull is not None and pull.task_id == queued.id
        lock.finish(hold=0, done_ttl=60, lookahead=lambda: pull)
        assert lock.pulled == queued.id
        handed = _holder(client, "doc-acl", queued.id)
        ended = _next_queued(ca.app, handed, queue, 64, 60)
        handed.finish(hold=0, done_ttl=60, lookahead=lambda: ended)  # ends its chain
        assert not admin.exists("redislock:lookahead:" + queue)
        denied = {e["object"] for e in denials(admin, user)}
        assert denied == (set() if lpos else {"lpos"})
    finally:
        client.close()
        admin.execute_command("ACL", "DELUSER", user)


class _NoTruth:
    """A header value whose truth value raises (a numpy array, say, sent with pickle)."""

    def __bool__(self) -> bool:
        raise ValueError("ambiguous")


@pytest.mark.parametrize(
    ("retries", "nesting", "owner"),
    [
        (0, 0, "t"),
        (2, 0, "t~r2"),
        (0, 1, "t~n1"),
        (3, 1, "t~n1r3"),
        (-1, -5, "t"),
        ("2", None, "t~r2"),
        ("x", [], "t"),
        (float("inf"), float("nan"), "t"),
        (10**30, 0, f"t~r{10**30}"),
        (_NoTruth(), 0, "t"),  # a pickled header whose truth value raises
        (0, _NoTruth(), "t"),
        (0, [], "t"),
        ({}, None, "t"),
    ],
)
def test_a_run_owner_comes_from_any_header_values_without_failing(
    retries: object, nesting: object, owner: str
) -> None:
    """Headers are read back from the broker: a value of the wrong type, negative or huge
    (JSON's Infinity too) gives a documented owner, never an exception."""
    from celery_redislock.signing import task_id_of
    from celery_redislock.task import request_owner, run_owner

    assert run_owner("t", retries, nesting) == owner
    assert request_owner({"id": "t", "retries": retries, "replaced_task_nesting": nesting}) == owner
    assert task_id_of(owner) == "t"


def test_a_parking_task_does_not_jump_the_line_of_a_free_lock(redis_client: redis.Redis) -> None:
    """A holder's lease ran out with a blocked acquire first in line: the free lock is the
    waiter's, as for any other newcomer; the parking task parks (park.lua checks the line)."""
    r = redis_client
    holder = RedisLock(r, "job:line", ttl=60, owner="holder", auto_renew=False)
    assert holder.acquire()
    waiter = RedisLock(r, "job:line", ttl=60, owner="waiter", auto_renew=False)
    took: list[bool] = []
    thread = threading.Thread(target=lambda: took.append(waiter.acquire(timeout=30)))
    thread.start()
    try:
        wait_until(lambda: r.llen(holder.keys.waiters) == 1, timeout=30)
        r.delete(holder.keys.lock)  # the holder's lease ran out (an expiry publishes nothing)
        parking = TaskLock(r, "job:line", task_id="parking", options=ca.hold_for.lock_options())
        outcome = parking.park('{"parked": 1}', keep_for=60)
        assert outcome is not True  # parked behind the line, not taken
        assert r.lrange(parking.parked, 0, -1) == [b"parking"]
        assert r.hget(holder.keys.lock, "parking") is None
    finally:
        thread.join(timeout=30)
    assert took == [True]  # the waiter first in line took the lock
    assert r.hget(holder.keys.lock, "waiter") == b"1"
    waiter.release()
