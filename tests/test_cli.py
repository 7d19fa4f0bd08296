"""`celery -A app redislock ...` against a real worker holding a real lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from celery.bin.celery import celery
from click.testing import CliRunner

from celery_redislock import RedisLock
from celery_redislock.testing import RedisServer

from . import celery_app as ca
from ._celery import wait_until, worker


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
        held = ca.hold_for.delay("cli", 6.0)
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
