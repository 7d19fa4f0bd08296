"""The demo runs end to end, against a user's Redis, and leaves no key behind; the tenants
scene's arithmetic (waits, the most at once, its count of runs, its conclusion)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest

from celery_redislock.demo.tenants import (
    ALL_SMALL,
    HOT,
    Run,
    Stats,
    conclusion,
    jobs,
    miscounted,
    most_at_once,
    summarize,
)
from celery_redislock.testing import RedisServer

from .._celery import ROOT


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery_redislock.demo", *args],
        cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _tenant_table(
    stdout: str, limit: int
) -> tuple[dict[str, list[str]], dict[str, list[str]], str]:
    """(tenant rows, summary rows, the conclusion) of the tenants scene's table.

    A tenant row is its jobs, then per run: median wait, longest wait, the most at once.
    """
    lines = stdout.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("tenant ")) - 1 :]
    assert lines[0].split() == ["without", "lock_limit", f"lock_limit={limit}"]
    assert lines[1].split() == ["tenant", "jobs"] + ["p50", "wait", "max", "wait", "at", "once"] * 2
    tenants: dict[str, list[str]] = {}
    summary: dict[str, list[str]] = {}
    row = 2
    while not lines[row].startswith("jobs run once"):
        name, jobs_sent, *cells = re.split(r"\s{2,}", lines[row].strip())
        # Values print as "0.62 s": one cell each once the unit is attached.
        tenants[name] = [jobs_sent, *cells]
        row += 1
    for line in lines[row : row + 3]:
        label, *values = re.split(r"\s{2,}", line.strip())
        summary[label] = values
    assert lines[row + 3] == ""
    return tenants, summary, lines[row + 4]


def _seconds(cell: str) -> float:
    assert cell.endswith(" s"), cell
    return float(cell[:-2])


def _check_tenants(
    stdout: str, *, hot: int, small: list[str], each: int, limit: int, pool: int
) -> None:
    """What must hold in any run of the scene, whatever its timings."""
    tenants, summary, line = _tenant_table(stdout, limit)
    assert list(tenants) == [HOT, *small, ALL_SMALL]
    total = hot + len(small) * each
    assert [tenants[t][0] for t in tenants] == [str(hot)] + [str(each)] * len(small) + [
        str(len(small) * each)
    ]
    for name, (_, *cells) in tenants.items():
        assert len(cells) == 6, (name, cells)
        for p50, longest in ((cells[0], cells[1]), (cells[3], cells[4])):
            assert 0 <= _seconds(p50) <= _seconds(longest)
        if name == ALL_SMALL:
            assert cells[2] == cells[5] == "-"
        else:
            assert 1 <= int(cells[5]) <= limit  # never more than the limit at once
            assert 1 <= int(cells[2]) <= pool
    assert int(tenants[HOT][6]) == limit  # the hot tenant reached the limit, no more
    # Every job ran exactly once, in both runs.
    assert summary["jobs run once"] == [f"{total} / {total}"] * 2
    assert summary["parked"][0] == "-" and summary["parked"][1].isdigit()
    assert [_seconds(cell) > 0 for cell in summary["time"]] == [True, True]
    # The conclusion is the table's numbers, in words.
    small_p50 = [tenants[ALL_SMALL][1], tenants[ALL_SMALL][4]]
    hot_p50 = [tenants[HOT][1], tenants[HOT][4]]
    assert line.startswith(f"lock_limit={limit}: the small tenants' median wait ")
    for before, after in (small_p50, hot_p50):
        if before == after:
            assert f"stayed at {after}" in line
        else:
            verb = "fell" if _seconds(after) < _seconds(before) else "rose"
            assert f"{verb} {before} -> {after}" in line
    assert line.endswith(f"running at most {tenants[HOT][6]} at once ({tenants[HOT][3]} without).")
    assert "FAILED" not in stdout


def test_demo_against_a_given_redis_prints_both_tables_and_cleans_up(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    client.flushall()
    client.set("users:own:key", "untouched")
    out = _demo(
        "--redis-url", redis_server.url, "--concurrency", "3",
        "--payments", "60", "--accounts", "3",
        "--hot-jobs", "12", "--small-tenants", "2", "--small-jobs", "2",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "scenes: payments, tenants" in out.stdout  # both, by default
    table = out.stdout[out.stdout.index("without a lock   with LockedTask") :]
    lost_row = next(line for line in table.splitlines() if line.startswith("lost updates"))
    exact_row = next(line for line in table.splitlines() if line.startswith("exact balances"))
    assert lost_row.split()[-1] == "0"  # with the lock: nothing lost
    assert exact_row.split()[-3:] == ["3", "/", "3"]
    _check_tenants(out.stdout, hot=12, small=["small-1", "small-2"], each=2, limit=2, pool=3)
    assert "no demo process is left running" in out.stdout
    assert client.keys("*") == [b"users:own:key"]  # the demo removed everything it wrote


@pytest.mark.slow  # ~7 s; the default demo test runs the tenants scene too
def test_the_tenants_scene_alone_with_its_limit_passed_to_the_worker(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    client.flushall()
    out = _demo(
        "--redis-url", redis_server.url, "--scene", "tenants", "--concurrency", "2",
        "--limit", "1", "--hot-jobs", "6", "--small-tenants", "3", "--small-jobs", "1",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "scenes: tenants" in out.stdout and "payments:" not in out.stdout
    _check_tenants(
        out.stdout, hot=6, small=["small-1", "small-2", "small-3"], each=1, limit=1, pool=2
    )
    assert client.keys("*") == []


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--payments", "0"], "--payments must be at least 1"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--small-tenants", "0"], "--small-tenants must be at least 1"),
        (["--tenant-work", "0"], "--tenant-work must be > 0"),
        (["--scene", "nope"], "invalid choice: 'nope'"),
    ],
)
def test_demo_rejects_bad_arguments(args: list[str], error: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "celery_redislock.demo", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and error in out.stderr


def test_with_an_external_worker_the_demo_leaves_the_workers_counts_to_its_exporter(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker compose: the demo-worker and the demo-exporter outlive each demo run; the
    demo deletes its keys, not the counters the exporter serves (a reset after every run)."""
    from celery_redislock.demo import __main__ as demo_main

    client = redis_server.client()
    client.flushall()
    prefix, queue = "redislock-demo-test:", "redislock-demo-test"
    for name, value in {"DEMO_PREFIX": prefix, "DEMO_QUEUE": queue, "DEMO_WORK": "0.02",
                        "DEMO_LIMIT": "2", "DEMO_REDIS_URL": redis_server.url,
                        "DEMO_BROKER_URL": redis_server.url}.items():  # fmt: skip
        monkeypatch.setenv(name, value)  # (restored after: main() sets them too)

    def scene(args: Any, store: Any, demo: Any) -> bool:  # what the worker would write
        store.hset(f"{prefix}stats", "celery_redislock_task_acquired_total{}", 3)
        store.set(f"{prefix}balance:1", 10)
        store.rpush(queue, "a message")
        return True

    monkeypatch.setattr(demo_main, "SCENES", {"payments": scene})
    code = demo_main.main(["--redis-url", redis_server.url, "--external-worker"])
    assert code == 0
    assert client.keys("*") == [f"{prefix}stats".encode()]
    assert client.hgetall(f"{prefix}stats") == {b"celery_redislock_task_acquired_total{}": b"3"}
    # Its own worker's prefix is the demo's alone: everything goes (the test above).
    assert demo_main.cleanup(client, prefix, queue, True) == 1
    assert client.keys("*") == []


# -- the tenants scene's arithmetic, without a worker -------------------------------


def _run(tenant: str, job: int, started: float, ended: float, sent: float = 0.0) -> Run:
    return Run(tenant, job, sent, started, ended)


def test_most_at_once_counts_overlaps_and_not_a_hand_over_at_one_instant() -> None:
    assert most_at_once([]) == 0
    chain = [_run("t", i, float(i), float(i + 1)) for i in range(5)]  # end == next start
    assert most_at_once(chain) == 1
    two = [_run("t", 0, 0, 2), _run("t", 1, 1, 3), _run("t", 2, 2, 4), _run("t", 3, 2.5, 2.6)]
    assert most_at_once(two) == 3  # 1, 2 and 3 are open at 2.5
    assert most_at_once([_run("t", i, 0, 1) for i in range(4)]) == 4


def test_summarize_gives_the_median_and_longest_wait() -> None:
    runs = [_run("t", i, started=s, ended=s + 1, sent=0.0) for i, s in enumerate([3, 1, 2, 10])]
    assert summarize(runs) == Stats(runs=4, wait_p50=2.5, wait_max=10, at_once=1)


def test_jobs_are_the_flood_then_the_small_tenants_in_turn() -> None:
    assert jobs(2, ["a", "b"], 2) == [(HOT, 0), (HOT, 1), ("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_miscounted_names_every_job_not_run_exactly_once() -> None:
    sent = [(HOT, 0), (HOT, 1), ("a", 0)]
    ok = [_run(t, j, 1, 2) for t, j in sent]
    assert miscounted(ok, sent) == []
    twice = [*ok, _run(HOT, 1, 3, 4)]
    assert miscounted(twice, sent) == ["hot job 1 ran 2 times"]
    assert miscounted(ok[1:], sent) == ["hot job 0 ran 0 times"]
    assert miscounted([*ok, _run("b", 9, 1, 2)], sent) == ["b job 9 ran but was never sent"]


def test_the_conclusion_follows_the_numbers() -> None:
    without = {HOT: Stats(40, 0.91, 1.83, 4), ALL_SMALL: Stats(12, 2.23, 2.43, 1)}
    limited = {HOT: Stats(40, 1.97, 3.93, 2), ALL_SMALL: Stats(12, 0.62, 1.14, 1)}
    assert conclusion(without, limited, 2) == (
        "lock_limit=2: the small tenants' median wait fell 2.23 s -> 0.62 s (3.6x shorter); "
        "the hot tenant's rose 0.91 s -> 1.97 s, running at most 2 at once (4 without)."
    )
    # Swapped, the same words turn around; equal printed values are "stayed".
    assert conclusion(limited, without, 1).startswith(
        "lock_limit=1: the small tenants' median wait rose 0.62 s -> 2.23 s; "
        "the hot tenant's fell 1.97 s -> 0.91 s (2.2x shorter)"
    )
    same = {HOT: Stats(1, 0.501, 1, 1), ALL_SMALL: Stats(1, 0.2, 1, 1)}
    close = {HOT: Stats(1, 0.499, 1, 1), ALL_SMALL: Stats(1, 0.2, 1, 1)}
    assert "median wait stayed at 0.20 s; the hot tenant's stayed at 0.50 s" in conclusion(
        same, close, 1
    )
