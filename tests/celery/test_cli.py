"""`celery -A app redislock ...` against a real worker holding a real lock."""

from __future__ import annotations

import json
import os
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

from celery_redislock import RedisLock, RedLock
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
