"""`celery -A app redislock ...` against a real worker holding a real lock."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import pytest
import redis
from celery import Celery
from celery.bin.celery import celery
from click.testing import CliRunner, Result

from celery_redislock import RedisLock, RedisSemaphore, RedLock
from celery_redislock._keyspace import SemaphoreKeys, parked_registry
from celery_redislock.testing import RedisServer

from .. import celery_app as ca
from .._celery import wait_until, worker


def run(*args: str, input: str | None = None) -> str:
    result = CliRunner().invoke(celery, ["-A", "tests.celery_app", "redislock", *args], input=input)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_ls_show_release_and_stats_on_a_running_worker(broker: RedisServer, tmp_path: Path) -> None:
    r = broker.client()
    proc = worker(broker.url, tmp_path / "w.log", env={"REDISLOCK_TEST_TTL": "30"})
    try:
        results = [ca.settle.delay(1, 1) for _ in range(5)]
        for result in results:
            result.get(timeout=60)
        held = ca.hold_for.delay("cli", 2.0)  # held while the commands below run (well under 1 s)
        wait_until(lambda: r.llen("started:cli"))
        RedisLock(r, "other:lock", owner="someone", ttl=60).acquire()

        rows = [json.loads(line) for line in run("ls", "--json").splitlines()]
        assert {row["name"] for row in rows} == {"job:cli", "other:lock"}
        mine = next(row for row in rows if row["name"] == "job:cli")
        assert mine["owners"] == {held.id: 1} and mine["holds"] == 1 and mine["token"] >= 1
        assert 0 < mine["ttl"] <= 30
        assert "job:cli" in run("ls", "job:*") and "other:lock" not in run("ls", "job:*")
        assert f"task {held.id}" in run("show", "job:cli")

        declined = CliRunner().invoke(
            celery, ["-A", "tests.celery_app", "redislock", "release", "job:cli"], input="n\n"
        )
        assert declined.exit_code != 0 and r.exists("redislock:{job:cli}")
        assert "released" in run("release", "job:cli", "--yes")
        assert not r.exists("redislock:{job:cli}")
        # The evicted task learns it: its outcome records the lost lease.
        with pytest.raises(Exception, match="lost"):
            held.get(timeout=60)

    finally:
        proc.stop()  # a warm shutdown flushes every process's last counts
    totals = json.loads(run("stats", "--json"))
    assert totals["acquired"] >= 6 and totals["lost"] >= 1
    assert totals["wait_p50"] is not None


# ----------------------------------------------------------------- apps of their own

#: The app the tests below point the CLI at (``-A tests.test_cli:APP``), set per test.
APP: Celery | None = None


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(
        celery, ["-A", "tests.celery.test_cli:APP", "redislock", *args], input=input
    )


@contextmanager
def app_on(**settings: Any) -> Iterator[Celery]:
    global APP
    APP = Celery("cli", broker="memory://", set_as_current=False)
    APP.conf.update(settings)
    try:
        yield APP
    finally:
        APP.close()
        APP = None


@pytest.fixture
def one(redis_client: redis.Redis, redis_server: RedisServer) -> Iterator[redis.Redis]:
    with app_on(redislock_url=redis_server.url):
        yield redis_client


@pytest.fixture
def quorum(redis_server_factory: Callable[..., RedisServer]) -> Iterator[list[RedisServer]]:
    servers = [redis_server_factory() for _ in range(3)]
    with app_on(redislock_urls=[s.url for s in servers]):
        yield servers


HOSTILE_NAMES = [
    "with{braces}and%25",
    "}{",
    "%7B",
    "line\nbreak and \x1b[31mescape",
    "\udcff\udcfe not UTF-8",  # the bytes b"\xff\xfe" as a command line delivers them
    "ü" * 5000,  # very long (10,000 bytes)
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_any_lock_name_can_be_shown_and_released(one: redis.Redis, name: str) -> None:
    raw = os.fsencode(name)
    RedisLock(one, raw, owner="holder", ttl=60).acquire()
    shown = json.loads(invoke("show", name, "--json").output)
    assert shown["owners"] == {"holder": 1}
    listed = invoke("ls").output
    assert "\x1b" not in listed and len(listed.splitlines()) == 3  # printed escaped
    assert [json.loads(row)["owners"] for row in invoke("ls", "--json").output.splitlines()] == [
        {"holder": 1}
    ]
    result = invoke("release", name, "--yes")
    assert result.exit_code == 0 and "released" in result.output, result.output
    assert not one.exists(RedisLock(one, raw).keys.lock)


def test_a_pattern_matches_names_with_braces_and_percent_literally(one: redis.Redis) -> None:
    for name in ("a{1}", "a%1", "b{1}"):
        RedisLock(one, name, owner="holder", ttl=60).acquire()
    found = {json.loads(row)["name"] for row in invoke("ls", "a{*", "--json").output.splitlines()}
    assert found == {"a{1}"}
    found = {json.loads(row)["name"] for row in invoke("ls", "*%*", "--json").output.splitlines()}
    assert found == {"a%1"}


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (("show", ""), "Invalid value for 'NAME': must not be empty"),
        (("release", "", "--yes"), "Invalid value for 'NAME': must not be empty"),
        (("ls", ""), "Invalid value for '[PATTERN]': must not be empty"),
        (("show", "\ud800"), "cannot be encoded"),  # a lone surrogate: no bytes to give back
        (("release", "x\ud800", "--yes"), "cannot be encoded"),
        (("ls", "--prefix", "a{b"), "Invalid value for '--prefix'"),
        (("show", "--prefix", "}", "x"), "Invalid value for '--prefix'"),
    ],
)
def test_bad_names_patterns_and_prefixes_are_usage_errors(
    one: redis.Redis, args: tuple[str, ...], complaint: str
) -> None:
    RedisLock(one, "x", owner="holder", ttl=60).acquire()
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert complaint in result.output and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert one.exists("redislock:{x}")


def test_an_unreachable_redis_is_one_line_and_exit_status_1(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory()
    with app_on(redislock_url=server.url):
        server.kill()
        for args in (("ls",), ("show", "x"), ("release", "x", "--yes"), ("stats",)):
            result = invoke(*args)
            assert result.exit_code == 1, (args, result.output)
            assert f"127.0.0.1:{server.port}: unreachable (ConnectionError" in result.output
            assert "Traceback" not in result.output


def test_quorum_ls_and_show_ask_every_node(quorum: list[RedisServer]) -> None:
    clients = [server.client() for server in quorum]
    RedLock(clients, "everywhere", owner="task-1", ttl=60).acquire()
    # Held on a majority that leaves out the first node: a lock all the same.
    RedLock(clients[1:], "not-on-the-first", owner="task-2", ttl=60).acquire()
    RedisLock(clients[2], "leftover", owner="task-3", ttl=60).acquire()

    rows = {
        row["name"]: row for row in map(json.loads, invoke("ls", "--json").output.split("\n")[:-1])
    }
    assert set(rows) == {"everywhere", "not-on-the-first", "leftover"}
    assert [len(rows[n]["held_on"]) for n in ("everywhere", "not-on-the-first", "leftover")] == [
        3,
        2,
        1,
    ]
    assert rows["not-on-the-first"]["owners"] == {"task-2": 1}
    assert 50 < rows["not-on-the-first"]["ttl"] <= 60
    table = invoke("ls").output
    assert "2/3" in table and "1/3" in table

    shown = json.loads(invoke("show", "not-on-the-first", "--json").output)
    assert shown["locked"] and shown["quorum"] == 2
    assert shown["held_on"] == [f"127.0.0.1:{s.port}" for s in quorum[1:]]
    assert not json.loads(invoke("show", "leftover", "--json").output)["locked"]
    text = invoke("show", "not-on-the-first").output
    assert "held on 2 of 3 nodes (a majority is 2): locked" in text
    assert f"node 127.0.0.1:{quorum[0].port}: not locked" in text


def test_quorum_release_releases_every_node_and_names_an_unreachable_one(
    quorum: list[RedisServer],
) -> None:
    clients = [server.client() for server in quorum]
    lock = RedLock(clients, "pay:1", owner="task-1", ttl=60)
    assert lock.acquire(blocking=False)
    result = invoke("release", "pay:1", "--yes")
    assert result.exit_code == 0, result.output
    assert not any(c.exists(lock.keys.lock) for c in clients)
    assert [line.split(": ")[1] for line in result.output.splitlines()[:3]] == ["released"] * 3
    assert "pay:1: released on 3 of 3 nodes (was held by task task-1)" in result.output

    again = RedLock(clients, "pay:1", owner="task-2", ttl=60)
    assert again.acquire(blocking=False)
    # The acquire returns once a majority answered; let the third node's request land
    # before deleting there, or it would land after the delete.
    for _ in range(200):
        if all(c.exists(again.keys.lock) for c in clients):
            break
        time.sleep(0.01)
    assert all(c.exists(again.keys.lock) for c in clients)
    clients[0].delete(again.keys.lock)  # gone from one node already
    quorum[2].kill()
    result = invoke("release", "pay:1", "--yes")
    assert result.exit_code == 1, result.output
    assert f"127.0.0.1:{quorum[0].port}: not locked" in result.output
    assert f"127.0.0.1:{quorum[1].port}: released" in result.output
    assert f"127.0.0.1:{quorum[2].port}: unreachable (ConnectionError" in result.output
    assert "released on 1 of 3 nodes" in result.output
    assert not clients[1].exists(again.keys.lock)
    # ls and show still answer from the nodes that are up, and say which one is not.
    for args in (("ls",), ("show", "pay:1")):
        result = invoke(*args)
        assert result.exit_code == 1
        assert f"127.0.0.1:{quorum[2].port}: unreachable" in result.output


def test_an_empty_prefix_is_a_prefix(one: redis.Redis) -> None:
    RedisLock(one, "bare", owner="holder", ttl=60, prefix="").acquire()
    assert json.loads(invoke("show", "--prefix", "", "bare", "--json").output)["owners"] == {
        "holder": 1
    }
    assert "not locked" in invoke("show", "bare").output  # the app's prefix: another lock


# ----------------------------------------------------------------- limited keys (lock_limit)


def test_limited_keys_are_listed_shown_and_a_holders_permit_freed_and_handed_on(
    broker: RedisServer, tmp_path: Path
) -> None:
    r = broker.client()
    keys = SemaphoreKeys.for_name("tenant:cli")
    proc = worker(broker.url, tmp_path / "w.log", concurrency=4, env={"REDISLOCK_TEST_TTL": "30"})
    try:
        running = [ca.tenant_job.delay("cli", 6.0) for _ in range(2)]
        wait_until(lambda: r.llen("started:cli") == 2, timeout=30)
        waiting = ca.tenant_job.delay("cli", 0.01)
        wait_until(lambda: r.llen(keys.line.parked) == 1, timeout=30)
        RedisLock(r, "tenant:cli", owner="someone", ttl=60).acquire()  # a lock of that name
        holders = {line.decode().split()[0] for line in r.lrange("started:cli", 0, -1)}
        assert holders == {result.id for result in running}

        rows = [json.loads(line) for line in run("ls", "--json").splitlines()]
        assert [(row["name"], row["kind"]) for row in rows] == [
            ("tenant:cli", "lock"),
            ("tenant:cli", "semaphore"),
        ]
        limited = rows[1]
        assert limited["owners"] == dict.fromkeys(holders, 1) and limited["holders"] == 2
        assert limited["limit"] == 2 and limited["parked"] == 1 and limited["token"] >= 2
        assert 0 < limited["ttl"] <= 30
        table = run("ls", "tenant:*").splitlines()
        assert len(table) == 4 and table[-1] == "1 lock(s) held, 1 limited key(s) in use"
        assert table[2].split()[:2] == ["tenant:cli", "limit"] and " 2/2 " in table[2]
        assert run("ls", "job:*").splitlines()[1:] == ["0 lock(s) held"]

        lock, shown = (
            json.loads(line) for line in run("show", "tenant:cli", "--json").splitlines()
        )
        assert lock["kind"] == "lock" and lock["owners"] == {"someone": 1}
        assert shown["kind"] == "semaphore" and shown["limit"] == 2
        assert {p["owner"]: p["holds"] for p in shown["permits"]} == dict.fromkeys(holders, 1)
        assert all(0 < p["ttl"] <= 30 and p["limit"] == 2 for p in shown["permits"])
        assert len({p["token"] for p in shown["permits"]}) == 2
        assert shown["parked_tasks"] == [{"task": waiting.id, "limit": 2}]
        text = run("show", "tenant:cli")
        assert "tenant:cli (lock): locked" in text
        assert "tenant:cli (limited key): 2 of 2 permit(s) held" in text
        assert f"parked: task {waiting.id} (limit 2)" in text
        assert all(f"holder: {holder} (1 hold(s)), lease left" in text for holder in holders)

        victim, other = running
        declined = CliRunner().invoke(
            celery,
            ["-A", "tests.celery_app", "redislock", "release", "tenant:cli", "--owner", victim.id],
            input="n\n",
        )
        assert declined.exit_code != 0 and r.exists(keys.permit(victim.id))
        freed = run("release", "tenant:cli", "--owner", victim.id, "--yes")
        assert freed.splitlines() == [
            f"tenant:cli: the permit of {victim.id} freed",
            f"tenant:cli: handed on to parked task {waiting.id}",
        ]
        assert not r.exists(keys.permit(victim.id))
        waiting.get(timeout=30)  # sent, and run with the freed permit
        assert other.get(timeout=30) >= 1
        with pytest.raises(Exception, match="lost"):  # the evicted run learns it
            victim.get(timeout=30)
        rows = [json.loads(line) for line in run("ls", "--json").splitlines()]
        assert [(row["name"], row["kind"]) for row in rows] == [("tenant:cli", "lock")]
    finally:
        proc.stop()  # a warm shutdown flushes every process's last counts
    totals = json.loads(run("stats", "--json"))
    assert totals["limited_keys_now"] == 0 and totals["permits_held_now"] == 0
    job = totals["limits"]["tests.celery_app.tenant_job"]
    assert job["taken"] == 3 and job["parked"] == 1 and job["deferred"] == 1
    assert job["parked_now"] == 0 and job["wait_p99"] is not None
    assert "tests.celery_app.tenant_job: taken 3, deferred 1 (parked 1, re-queued 0)" in run(
        "stats"
    )


def test_a_limited_key_is_read_as_it_comes_whatever_redis_holds(one: redis.Redis) -> None:
    name = "evil\x1b[31m"
    keys = SemaphoreKeys.for_name(name)
    owners = ["ok-owner", "str-owner", "\x1b]0;title\x07", "gone-owner"]
    one.sadd(keys.line.lock, *owners)
    one.hset(keys.permit(owners[0]), mapping={owners[0]: 2, "__fence__": 7, "__limit__": 3})
    one.pexpire(keys.permit(owners[0]), 60_000)
    one.set(keys.permit(owners[1]), "not a hash", px=50_000)  # counted, as the scripts count it
    junk = {owners[2]: "lots", "__fence__": "x", "__limit__": "-1", "extra": "1"}
    one.hset(keys.permit(owners[2]), mapping=junk)  # (no expiry)
    one.rpush(keys.line.parked, "p1", "p2")  # p2's message is gone
    one.hset(keys.line.parked_messages, "p1", "S" + "0" * 64 + "\n{not json")
    one.hset(keys.line.parked_limit, "p1", "zzz")
    one.rpush(keys.line.waiters, "w\x1b")
    one.set(SemaphoreKeys.for_name("string").line.lock, "a string, not a set")
    one.hset("redislock:{junklock}", mapping={"o": 1, "__fence__": "NaN"})
    one.set(parked_registry("redislock:"), "not a sorted set")
    stats = {"acquired": "abc", "released": "nan", "contended": 5, "limit_taken@": 9}
    stats |= {
        "limit_taken@\x1b[2Jt": 3,
        "limit_wait_le_0.5@\x1b[2Jt": "2",
        "limit_parked@t": "1e999",
    }
    one.hset("redislock:stats", mapping=stats)

    for args in (("ls",), ("show", name), ("show", "string"), ("stats",)):
        result = invoke(*args)
        assert result.exit_code == 0, (args, result.output)
        assert "\x1b" not in result.output and "\x07" not in result.output, args
    rows = {row["name"]: row for row in map(json.loads, invoke("ls", "--json").output.splitlines())}
    assert set(rows) == {"junklock", name} and rows["junklock"]["token"] == 0
    limited = rows[name]
    assert limited["owners"] == {owners[0]: 2, owners[1]: 0, owners[2]: 0}
    assert limited["holders"] == 3 and limited["holds"] == 2 and limited["limit"] == 3
    assert limited["token"] == 7 and 0 < limited["ttl"] <= 50 and limited["parked"] == 2
    (shown,) = map(json.loads, invoke("show", name, "--json").output.splitlines())
    permits = {p["owner"]: p for p in shown["permits"]}
    assert {o: (p["holds"], p["token"], p["limit"]) for o, p in permits.items()} == {
        owners[0]: (2, 7, 3),
        owners[1]: (0, None, None),
        owners[2]: (0, None, None),
    }
    assert [permits[o]["ttl"] is None for o in owners[:3]] == [False, False, True]
    assert shown["parked_tasks"] == [{"task": "p1", "limit": None}, {"task": "p2", "limit": None}]
    assert shown["waiters"] == ["w\x1b"] and shown["waiting"] == 1
    assert "not locked" in invoke("show", "string").output
    totals = json.loads(invoke("stats", "--json").output)
    assert (totals["acquired"], totals["released"], totals["contended"]) == (0, 0, 5)
    assert totals["limits"]["\x1b[2Jt"]["taken"] == 3
    assert totals["limits"]["\x1b[2Jt"]["wait_p50"] == 0.5
    assert totals["limits"]["?"]["parked_now"] == 1  # p1's message names no task
    assert set(totals["limits"]) == {"\x1b[2Jt", "?"}  # "t" had no finite count
    assert (totals["limited_keys_now"], totals["permits_held_now"]) == (1, 3)


def test_a_limited_key_with_only_parked_tasks_is_listed(one: redis.Redis) -> None:
    """Its permits all ran out (no holders set): the sweeper's registry still names it."""
    keys = SemaphoreKeys.for_name("stuck")
    one.rpush(keys.line.parked, "p1")
    one.hset(keys.line.parked_messages, "p1", "S")
    one.hset(keys.line.parked_limit, "p1", 4)
    one.zadd(parked_registry("redislock:"), {keys.line.lock: 0})
    (row,) = map(json.loads, invoke("ls", "--json").output.splitlines())
    assert (row["name"], row["kind"], row["holders"], row["limit"]) == ("stuck", "semaphore", 0, 4)
    assert row["parked"] == 1 and row["ttl"] is None
    assert invoke("ls").output.splitlines()[1].split()[3:7] == ["0/4", "-", "-", "1"]


def test_release_by_owner_frees_that_permit_for_a_waiter_and_names_what_is_not_held(
    one: redis.Redis,
) -> None:
    holder = RedisSemaphore(one, "one-at-a-time", 1, owner="first", ttl=60)
    assert holder.acquire(blocking=False)
    waiter = RedisSemaphore(one, "one-at-a-time", 1, owner="second", ttl=60)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=60)))
    thread.start()
    wait_until(lambda: one.llen(waiter.keys.waiters) == 1)

    result = invoke("release", "one-at-a-time", "--yes")  # no --owner: the lock of that name
    assert result.exit_code == 0 and result.output.splitlines() == [
        "one-at-a-time: not locked; nothing to release",
        "one-at-a-time is a limited key with 1 holder(s): free one holder's permit with "
        "--owner OWNER (see: show NAME)",
    ]
    result = invoke("release", "one-at-a-time", "--owner", "nobody", "--yes")
    assert result.exit_code == 0
    assert "nobody holds no permit of it; nothing to release" in result.output
    result = invoke("release", "one-at-a-time", "--owner", "first", "--yes")
    assert result.exit_code == 0
    assert result.output == "one-at-a-time: the permit of first freed\n"
    thread.join(60)
    assert got == [True]  # handed to the waiter in line, as a dying worker's release does
    assert waiter.owned() and not holder.owned()
    waiter.release()


def test_limits_are_not_looked_for_on_a_quorum(quorum: list[RedisServer]) -> None:
    client = quorum[0].client()
    assert RedisSemaphore(client, "sem", 2, owner="a", ttl=60).acquire(blocking=False)
    assert invoke("ls", "--json").output == ""
    assert "limited key" not in invoke("show", "sem").output
    result = invoke("release", "sem", "--owner", "a", "--yes")
    assert result.exit_code == 2 and "limits are not offered with redislock_urls" in result.output
    assert client.exists(SemaphoreKeys.for_name("sem").permit("a"))


# ----------------------------------------------------------------- rate keys (lock_rate)


def _server_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return seconds * 1000 + micros // 1000


def test_show_and_ls_a_rate_key_its_limits_next_slot_and_deferred_backlog(
    broker: RedisServer,
) -> None:
    from celery_redislock._keyspace import RateKeys, deferred_registry

    from .test_rates import _defer

    r = broker.client()
    keys = RateKeys.for_name("merchant:m", "redislock:")
    deferred = _defer(r, "m", 4)  # "20/s": the first admitted, three deferred
    assert len(deferred) == 3
    # The schedule and the head's due time set far ahead, so what is shown is known.
    r.set(keys.schedule(1_000_000), str(_server_ms(r) * 1000 + 100_000_000))
    r.zadd(deferred_registry("redislock:"), {keys.deferred: _server_ms(r) + 60_000})
    RedisLock(r, "merchant:other", owner="someone", ttl=60).acquire()

    (row,) = [json.loads(line) for line in run("show", "merchant:m", "--json").splitlines()]
    assert row["kind"] == "rate" and row["name"] == "merchant:m"
    assert row["deferred"] == 3 and row["head_task"] == deferred[0]
    assert row["head_task_name"] == ca.charge.name
    assert 50 < row["head_due"] <= 60
    (limit,) = row["limits"]
    assert limit["period"] == 1.0 and limit["count"] == 20 and 90 < limit["next_free"] <= 100
    shown = run("show", "merchant:m")
    assert "merchant:m (rate key): 3 run(s) deferred" in shown
    assert "limit 20/1s: next free slot in" in shown
    assert f"head: task {deferred[0]} ({ca.charge.name}), due in" in shown

    rows = [json.loads(line) for line in run("ls", "--json").splitlines()]
    assert sorted((row["name"], row["kind"]) for row in rows) == [
        ("merchant:m", "rate"),
        ("merchant:other", "lock"),
    ]
    listed = run("ls", "merchant:m*")
    assert "rate" in listed and "0 lock(s) held, 1 rate key(s) with deferred runs" in listed
    assert "merchant:m" not in run("ls", "nothing*")

    # A rate key with a schedule only (no backlog): shown, its slot free once passed.
    r.set(RateKeys.for_name("quiet", "redislock:").schedule(60_000_000), "1", px=60_000)
    (quiet,) = [json.loads(line) for line in run("show", "quiet", "--json").splitlines()]
    assert quiet["deferred"] == 0 and quiet["head_due"] is None
    assert quiet["limits"] == [{"period": 60.0, "count": None, "next_free": 0.0}]
    assert "limit ?/60s: next free slot now" in run("show", "quiet")
    # Nothing of it: the lock's "not locked" as before.
    nothing = run("show", "nothing")
    assert nothing.startswith("nothing: not locked") and "rate key" not in nothing


def test_rate_keys_hostile_data_is_tolerated_and_names_are_escaped(broker: RedisServer) -> None:
    from celery_redislock._keyspace import RateKeys, deferred_registry

    r = broker.client()
    registry = deferred_registry("redislock:")
    name = "\x1b[31mred"
    keys = RateKeys.for_name(name, "redislock:")
    r.set(keys.schedule(1_000_000), "12abc")  # junk: read as full by the scripts
    r.hset(keys.schedule(2_000_000), "x", "1")  # another type: not a schedule
    r.set(keys.schedules + b"xyz", "5")  # not a period
    r.rpush(keys.deferred, b"junk", b"D" + b"0" * 64 + b"\n{}")
    r.zadd(registry, {keys.deferred: float("inf"), b"redislock:{x}:junk": 1, b"\xff": 2})
    other = RateKeys.for_name("typed", "redislock:")
    r.set(other.deferred, "not a list")
    r.zadd(registry, {other.deferred: 5})

    (row,) = [json.loads(line) for line in run("show", name, "--json").splitlines()]
    assert row["deferred"] == 2 and row["head_due"] is None
    assert row["head_task"] is None and row["head_task_name"] is None
    assert row["limits"] == [{"period": 1.0, "count": None, "next_free": None}]
    shown = run("show", name)
    assert "\x1b" not in shown and "\\x1b[31mred (rate key): 2 run(s) deferred" in shown
    assert "next free slot unreadable" in shown and "head: unreadable entry" in shown
    (typed,) = [json.loads(line) for line in run("show", "typed", "--json").splitlines()]
    assert typed["deferred"] == 0 and typed["head_due"] is not None

    listed = run("ls")
    assert "\x1b" not in listed and "\\x1b[31mred" in listed
    assert "1 rate key(s) with deferred runs" in listed  # "typed" has none; junk skipped
    # A registry of another type: nothing listed from it, no error.
    r.delete(registry)
    r.set(registry, "junk")
    assert "0 lock(s) held" in run("ls")
    assert "rate key" in run("show", name)
