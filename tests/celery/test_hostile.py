"""Hostile data: what the workers read back from Redis is trusted no more than whoever could
write it.

The attacker is exactly the least-privilege "locker" user of docs/security.md: it may write
under ``redislock:*`` and nothing else (no broker queue). It writes fake parked tasks (a
parked list entry, its message and the sweeper's registry entry) for the real task
``settle(999, -1000000)``: as a parked signature, as a parked broker envelope in the exact
form a hand-over pushes, and as an envelope naming a list outside the prefix. Real workers
must never run them, never push them anywhere, report each once and take back the
hand-over, while the tasks they really parked still run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redislock import LockConfigurationError, RedisLock, signals, signing
from celery_redislock._scripts import scripts_for
from celery_redislock.parking import Parker
from celery_redislock.settings import LockSettings
from celery_redislock.task import (
    TaskLock,
    deliver_handed_over,
    envelope_entry,
    push_targets,
    settings_for,
)
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import EveryKeySeen, wait_until, worker
from ..lock.test_security import LOCK_COMMANDS, PASSWORD, acl_rules, set_user

REFUSED = "redislock: refused the parked message of task"
PLACEHOLDER = "rltag0123456789abcdef"


def lock_of(account: int) -> str:
    return f"redislock:{{account:{account}}}"


@pytest.fixture
def locker(broker: RedisServer) -> Iterator[redis.Redis]:
    """The lock user of docs/security.md's first ACL line: ``~redislock:*`` only."""
    admin = broker.client()
    set_user(admin, "locker", acl_rules(LOCK_COMMANDS))
    client = redis.Redis.from_url(f"redis://locker:{PASSWORD}@127.0.0.1:{broker.port}/0")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.rpush("celery", b"a task")  # it cannot reach the broker's queues itself
        yield client
    finally:
        client.close()
        admin.execute_command("ACL", "DELUSER", "locker")
        admin.close()


def forge(locker: redis.Redis, lock: str, task_id: str, message: str | bytes) -> None:
    """What the locker user writes (RPUSH, HSET, ZADD: all in its command set)."""
    locker.rpush(lock + ":parked", task_id)
    locker.hset(lock + ":parked:messages", task_id, message)
    locker.zadd("redislock:parked", {lock: 0})


def forged_signature(task_id: str) -> str:
    """``settle(999, -1000000)`` as a parked signature (the format before signing)."""
    return json.dumps(dict(ca.settle.signature((999, -1000000), task_id=task_id)))


def forged_envelope(admin: redis.Redis, task_id: str, lock: str, queue_list: str) -> str:
    """``settle(999, -1000000)`` as a parked broker envelope, in exactly the form a hand-over
    script checks (the format is public: kombu writes the envelope to a scratch queue
    first), with a made-up signature."""
    ca.settle.apply_async((999, -1000000), queue="scratch", task_id=task_id)
    envelope = json.loads(admin.rpop("scratch"))
    envelope["properties"]["delivery_tag"] = PLACEHOLDER
    envelope["headers"]["redislock_parked"] = {"lock": lock, "list": queue_list, "mac": "0" * 64}
    return f"E{queue_list}\n{PLACEHOLDER}\n{json.dumps(envelope)}"


def ran(admin: redis.Redis) -> list[str]:
    """The task ids of the settle runs that happened."""
    return [line.split()[1].decode() for line in admin.lrange("sections:settle", 0, -1)]


def refusals(text: str, task_id: str) -> int:
    return text.count(f"{REFUSED} {task_id!r}")


def test_the_sweeper_never_sends_what_the_lock_user_forged(
    broker: RedisServer, locker: redis.Redis, tmp_path: Path
) -> None:
    """Nobody holds the locks: the workers' sweeper hands each one to its "parked" task."""
    admin = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2)
    try:
        forge(locker, lock_of(997), "evil-signature", forged_signature("evil-signature"))
        envelope = forged_envelope(admin, "evil-envelope", lock_of(998), "celery")
        forge(locker, lock_of(998), "evil-envelope", envelope)
        # An envelope naming any other list the worker may write: pushed there, it would
        # be raw bytes of the attacker's choice.
        forge(locker, lock_of(999), "evil-push", f"Evictim\n{PLACEHOLDER}\n{PLACEHOLDER} bytes")
        # And a registry entry naming no lock at all (its "parked" keys under the prefix).
        forge(locker, "redislock:junk", "evil-junk", forged_signature("evil-junk"))
        forged = ("evil-signature", "evil-envelope", "evil-push")
        wait_until(lambda: all(refusals(proc.text(), t) for t in forged), timeout=30)
        wait_until(lambda: not admin.zscore("redislock:parked", "redislock:junk"), timeout=10)
        time.sleep(2.0)  # four more passes of the sweeper: nothing is sent again
        settled = ca.settle.delay(999, 5)  # the lock the forgeries named still works
        assert settled.get(timeout=30) == 5
        text = proc.text()
    finally:
        proc.stop()
    assert ran(admin) == [settled.id]  # nothing forged ran
    assert admin.get("balance:999") == b"5"
    assert not admin.exists("victim")  # nothing was pushed anywhere
    assert [refusals(text, t) for t in forged] == [1, 1, 1]  # each reported once
    assert "not a lock key of this prefix" in text  # the registry entry, dropped
    for task_id, account in zip(forged, (997, 998, 999)):
        assert f"[{task_id}] received" not in text
        assert not admin.hexists(lock_of(account) + ":parked:messages", task_id)  # removed
        assert not admin.exists(lock_of(account))  # the hand-over was taken back
    assert "redislock_signing_key is not set and the broker URL carries no password" in text
    assert admin.hget("redislock:stats", "parked_rejected") == b"4"


def test_a_release_never_runs_what_the_lock_user_parked_behind_its_holder(
    broker: RedisServer, locker: redis.Redis, tmp_path: Path
) -> None:
    """The hot path: a real task holds the lock, and forgeries are parked behind it, a
    signature (the releasing pool process refuses it) and an envelope in the form the
    hand-over script pushes itself (the worker that fetches it refuses it), then a real
    task. The lock goes on past both to the real one."""
    admin = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", concurrency=2)
    try:
        holder = ca.settle.delay(999, 0, 2.0)
        wait_until(lambda: admin.exists(lock_of(999)), timeout=30)
        forge(locker, lock_of(999), "evil-signature", forged_signature("evil-signature"))
        envelope = forged_envelope(admin, "evil-envelope", lock_of(999), "celery")
        forge(locker, lock_of(999), "evil-envelope", envelope)
        parked = ca.settle.delay(999, 5)  # a real task, parked at delivery behind them
        wait_until(lambda: admin.llen(lock_of(999) + ":parked") == 3, timeout=30)
        assert holder.get(timeout=30) == 0
        assert parked.get(timeout=30) == 5
        wait_until(lambda: refusals(proc.text(), "evil-envelope"), timeout=10)
        text = proc.text()
    finally:
        proc.stop()
    assert ran(admin) == [holder.id, parked.id]  # nothing forged ran
    assert refusals(text, "evil-envelope") == 1 and refusals(text, "evil-signature") == 1
    assert f"ERROR/MainProcess] {REFUSED} 'evil-envelope'" in text  # fetched, then refused
    assert "[evil-envelope] received" not in text
    assert admin.hlen(lock_of(999) + ":parked:messages") == 0
    assert admin.hget("redislock:stats", "parked_rejected") == b"2"


def test_a_worker_with_another_signing_key_refuses_what_was_parked(
    broker: RedisServer, tmp_path: Path
) -> None:
    """A task parked at delivery by a worker with this app's key (the default, derived from
    the broker URL), handed over and pushed back, reaches a worker whose
    ``redislock_signing_key`` differs: refused, never run; the next one is handed the lock."""
    r = broker.client()
    queue = "celery"
    RedisLock(r, "job:keyed", ttl=60, owner="holder", auto_renew=False).acquire()
    sent = [ca.hold_for.apply_async(("keyed", 0.01), queue=queue) for _ in range(2)]
    parker = Parker(ca.hold_for, ca.app, revoked=set(), seen=EveryKeySeen())
    with ca.app.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue)
        for _ in sent:
            message = simple.get(timeout=5.0)
            assert parker.park(message)
            message.ack()
        simple.close()
    lock = TaskLock(r, "job:keyed", task_id="holder", options=ca.hold_for.lock_options())
    lock.push_to = (queue, push_targets(ca.app)[1])
    keys, args = lock.handoff_args("holder", "one", None)
    assert scripts_for(r).handoff(keys=keys, args=args)[1] is None  # pushed to "celery"
    env = {"REDISLOCK_TEST_SIGNING_KEY": "another key, 32 bytes long......"}
    proc = worker(broker.url, tmp_path / "w.log", env=env)
    try:
        wait_until(lambda: refusals(proc.text(), sent[1].id), timeout=30)
        text = proc.text()
    finally:
        proc.stop()
    assert r.llen("started:keyed") == 0  # neither ran
    assert refusals(text, sent[0].id) == 1 and refusals(text, sent[1].id) == 1
    assert "its signature does not verify" in text
    assert not r.exists("redislock:{job:keyed}")  # nothing left holding the lock


# ------------------------------------------------------------------ no worker


def _envelope(queue: str, task_id: str = "t-1") -> dict[str, Any]:
    """A real broker envelope of ``hold_for("lua", 0.01)``, as kombu decodes it."""
    r = redis.Redis.from_url(ca.URL)
    ca.hold_for.apply_async(("lua", 0.01), queue="scratch", task_id=task_id)
    envelope: dict[str, Any] = json.loads(r.rpop("scratch"))
    r.close()
    return envelope


@pytest.mark.parametrize(
    "spoil",
    [
        "none",
        "placeholder twice",
        "tag elsewhere",
        "another lock",
        "another task id",
        "list not the worker's",
        "list not signed for",
        "not a LockedTask",
        "not JSON",
        "no newline",
    ],
)
def test_a_hand_over_pushes_only_an_envelope_in_the_checked_form(
    broker: RedisServer, spoil: str
) -> None:
    """handoff.lua pushes a parked envelope itself only to the worker's own queue lists,
    for one of its LockedTasks, parked as the task it hands the lock to, with its tag
    placeholder once and as its delivery tag; anything else comes back to the worker."""
    r = broker.client()
    lock = RedisLock(r, "job:lua", ttl=60, owner="holder", auto_renew=False)
    assert lock.acquire()
    queue = "celery"
    envelope = _envelope(queue)
    key = settings_for(ca.app).signing_key
    entry = envelope_entry(queue, envelope, lock.keys.lock, key)
    placeholder = entry.split("\n")[1]
    head, text = entry.split(placeholder + "\n", 1)
    if spoil == "placeholder twice":
        text = text.replace('"body"', f'"{placeholder}": 1, "body"')
    elif spoil == "tag elsewhere":
        text = text.replace(f'"delivery_tag": "{placeholder}"', '"delivery_tag": "x"')
        text = text.replace('"body"', f'"{placeholder}": 1, "body"')
    elif spoil == "another lock":
        text = text.replace("redislock:{job:lua}", "redislock:{job:other}")
    elif spoil == "another task id":
        text = text.replace('"id": "t-1"', '"id": "t-2"')
    elif spoil == "list not the worker's":
        head, text = (
            head.replace("Ecelery", "Eelsewhere"),
            text.replace('"list": "celery"', '"list": "elsewhere"'),
        )
    elif spoil == "list not signed for":
        head = head.replace("Ecelery", "Eelsewhere")
    elif spoil == "not a LockedTask":
        text = text.replace("tests.celery_app.hold_for", "tests.celery_app.settle_unlocked")
    elif spoil == "not JSON":
        text = text[:-1]
    elif spoil == "no newline":
        head, placeholder = "Ecelery", ""
    message = head + placeholder + "\n" + text if placeholder else head + text
    r.rpush(lock.keys.lock + b":parked", "t-1")
    r.hset(lock.keys.lock + b":parked:messages", "t-1", message)
    releasing = TaskLock(r, "job:lua", task_id="holder", options=ca.hold_for.lock_options())
    releasing.push_to = (queue, push_targets(ca.app)[1])
    keys, args = releasing.handoff_args("holder", "one", None)
    reply = scripts_for(r).handoff(keys=keys, args=args)
    assert reply[2] == b"t-1" and r.hget(lock.keys.lock, "t-1") == b"0"  # handed over
    if spoil == "none":
        assert reply[1] is None and r.llen(queue) == 1  # pushed: the worker checks it
        pushed = json.loads(r.lindex(queue, 0))
        token = r.hget(lock.keys.lock, "__fence__").decode()  # type: ignore[union-attr]
        assert pushed["properties"]["delivery_tag"] == f"{placeholder}h{token}"
        signing.check_envelope(key, pushed)
    else:
        assert reply[1] == message.encode() and r.llen(queue) == 0  # back to the worker
        assert r.llen("elsewhere") == 0
        assert len(reply) == 4  # with the token of its delivery tag
    r.delete(queue)


def test_signed_envelopes_verify_as_the_broker_delivers_them_and_not_otherwise() -> None:
    key = b"k" * 32
    envelope = _envelope("celery")
    entry = envelope_entry("celery", envelope, b"redislock:{job:lua}", key)
    signed = json.loads(entry.split("\n", 2)[2])
    assert signing.check_envelope(key, signed) == ("redislock:{job:lua}", "celery")
    # What the transport changes on the way does not matter: the tag a hand-over fills in,
    # kombu's redelivered flags on a restored unacked message.
    restored = json.loads(json.dumps(signed))
    restored["properties"]["delivery_tag"] += "h7"
    restored["headers"]["redelivered"] = True
    restored["properties"]["delivery_info"]["redelivered"] = True
    assert signing.check_envelope(key, restored) == ("redislock:{job:lua}", "celery")
    # Anything else does: arguments, task, id, lock, list, key.
    changes: list[tuple[str, Any]] = [
        ("body", "W1sxLCAyXSwge30sIHt9XQ=="),
        ("task", "tests.celery_app.settle"),
        ("id", "t-2"),
        ("lock", "redislock:{job:other}"),
        ("list", "other"),
    ]
    for field, value in changes:
        spoiled = json.loads(json.dumps(signed))
        if field == "body":
            spoiled["body"] = value
        elif field in ("lock", "list"):
            spoiled["headers"]["redislock_parked"][field] = value
        else:
            spoiled["headers"][field] = value
        with pytest.raises(signing.Refused, match="does not verify"):
            signing.check_envelope(key, spoiled)
    with pytest.raises(signing.Refused, match="does not verify"):
        signing.check_envelope(b"x" * 32, signed)
    unsigned = json.loads(json.dumps(signed))
    del unsigned["headers"]["redislock_parked"]
    with pytest.raises(signing.Refused, match="no signature"):
        signing.check_envelope(key, unsigned)


def test_signed_signatures_open_only_as_parked() -> None:
    key = b"k" * 32
    text = forged_signature("t-1")
    entry = signing.sign_signature(key, b"redislock:{account:999}", "t-1", text).encode()
    opened = signing.open_signature(key, b"redislock:{account:999}", b"t-1", entry)
    assert opened["args"] == [999, -1000000]
    for lock, task_id, spoiled, with_key in [
        (b"redislock:{account:1}", b"t-1", entry, key),  # under another lock
        (b"redislock:{account:999}", b"t-2", entry, key),  # as another task
        (b"redislock:{account:999}", b"t-1", entry.replace(b"-1000000", b"-1000001"), key),
        (b"redislock:{account:999}", b"t-1", entry, b"x" * 32),  # another key
        (b"redislock:{account:999}", b"t-1", text.encode(), key),  # unsigned
    ]:
        with pytest.raises(signing.Refused):
            signing.open_signature(with_key, lock, task_id, spoiled)


def test_a_signed_message_whose_arguments_take_another_lock_is_refused(
    broker: RedisServer,
) -> None:
    """Defence in depth: even a message signed for this lock is refused if its task's
    lock_key does not render that lock (a worker's bug, a changed lock_key)."""
    r = broker.client()
    seen: list[dict[str, Any]] = []

    def record(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock = TaskLock(r, "account:1", task_id="holder", options=ca.settle.lock_options())
    assert lock.acquire(blocking=False)
    key = settings_for(ca.app).signing_key
    entry = signing.sign_signature(key, lock.keys.lock, "t-1", forged_signature("t-1"))
    r.rpush(lock.keys.lock + b":parked", "t-1")
    r.hset(lock.keys.lock + b":parked:messages", "t-1", entry)
    handed = lock.finish(hold=0, done_ttl=60)
    assert handed is not None and handed.task_id == b"t-1"
    signals.parked_rejected.connect(record)
    try:
        assert deliver_handed_over(ca.app, handed, 30_000) == 0
    finally:
        signals.parked_rejected.disconnect(record)
    assert seen == [
        {
            "key": "redislock:{account:1}",
            "task_id": "t-1",
            "reason": "its arguments do not take the lock it was parked under",
        }
    ]
    assert not r.exists(lock.keys.lock)  # the hand-over taken back: nobody else parked


def test_the_signing_key_setting() -> None:
    broker = {"broker_url": "redis://:secret@127.0.0.1:6379/0"}
    derived = LockSettings.from_conf(broker)
    assert derived.signing_key_source == "derived from broker_url"
    assert derived.signing_key == signing.derive_key("redis://:secret@127.0.0.1:6379/0")
    other = LockSettings.from_conf({"broker_url": "redis://:other@127.0.0.1:6379/0"})
    assert other.signing_key != derived.signing_key  # the password is what makes it secret
    explicit = LockSettings.from_conf({**broker, "redislock_signing_key": "s" * 16})
    assert explicit.signing_key == b"s" * 16
    assert LockSettings.from_conf({**broker, "redislock_signing_key": b"b" * 20}).signing_key
    assert "s" * 16 not in repr(explicit)
    for bad in ("short", b"", 12345, ["a" * 16]):
        with pytest.raises(LockConfigurationError, match="redislock_signing_key must be a str"):
            LockSettings.from_conf({**broker, "redislock_signing_key": bad})
