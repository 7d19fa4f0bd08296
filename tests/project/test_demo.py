"""The demo runs end to end, against a user's Redis, and leaves no key behind; with an
external worker (docker compose) its scenes feed the dashboard's series; the tenants,
merchants and reindex scenes' arithmetic (waits, the most at once or in a period, refused
calls, counts of runs, conclusions)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from celery_redislock._rates import parse_rates
from celery_redislock.demo import merchants, reindex
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


def _rows(lines: list[str]) -> dict[str, list[str]]:
    """Rows split on runs of two or more spaces (a value such as "0.62 s" is one cell)."""
    rows = {}
    for line in lines:
        label, *cells = re.split(r"\s{2,}", line.strip())
        rows[label] = cells
    return rows


def _block(stdout: str, title: str) -> list[str]:
    """A scene's lines, from its title line to the blank line after its conclusion."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{title}: "))
    # Blank lines: before the table, before the conclusion, after it.
    blanks = [i for i in range(start, len(lines)) if lines[i] == ""]
    return lines[start : blanks[2]]


def _check_merchants(stdout: str, *, rate: str, hot: int, small: list[str], each: int) -> None:
    """What must hold in any run of the merchants scene, whatever its timings: every call
    ran once, the rate held per merchant (at most N calls in any period, at the slots it
    booked), none refused under it, and the conclusion is the table's numbers."""
    limit = parse_rates(rate)[0]
    quota = limit.count
    lines = _block(stdout, "merchants")
    head = next(i for i, line in enumerate(lines) if line.startswith("merchant "))
    assert lines[head - 1].split() == ["without", "lock_rate", f"lock_rate={rate}"]
    period = merchants.period_words(limit.period_us)[1]
    unit = ["in", *period.split(), "refused", "max", "wait"]
    assert lines[head].split() == ["merchant", "calls", *unit, *unit]
    names = [merchants.HOT, *small]
    rows = _rows(lines[head + 1 : head + 1 + len(names)])
    assert list(rows) == names
    total = hot + len(small) * each
    for name, (calls, *cells) in rows.items():
        assert int(calls) == (hot if name == merchants.HOT else each)
        assert len(cells) == 6, (name, cells)
        for most, refused, wait in (cells[0:3], cells[3:6]):
            # A period holding M calls: the partner accepts at most N of them.
            assert 1 <= int(most) <= int(calls)
            assert int(refused) >= int(most) - quota
            assert _seconds(wait) >= 0
        assert int(cells[3]) <= quota  # the rate held: at most N per period per merchant
        assert cells[4] == "0"  # so the partner refused none
    summary = _rows(lines[head + 1 + len(names) : head + 5 + len(names)])
    assert summary["calls run once"] == [f"{total} / {total}"] * 2  # none dropped
    assert summary["deferred"][0] == "-"
    deferred = int(summary["deferred"][1])
    # Each merchant's first call finds its rate idle; the hot one's burst is deferred.
    assert min(hot, 2) - 1 <= deferred <= total - len(names)
    assert summary["start after slot"][0] == "-" and _seconds(summary["start after slot"][1]) >= 0
    line = lines[-1]
    refused_before = sum(int(cells[1]) for _, *cells in rows.values())
    assert line.startswith(
        f"lock_rate={rate}: the hot merchant's busiest period went from "
        f"{rows[merchants.HOT][1]} calls to {rows[merchants.HOT][4]} (quota {quota}), "
        f"calls over the quota {refused_before} -> 0; {total} of {total} calls ran once, "
        f"{deferred} deferred to their slot"
    )
    assert "FAILED" not in stdout


def _versions(cell: str) -> list[int]:
    """A "ran" cell's versions: ``0..3`` or ``0,3,1``."""
    if ".." in cell:
        first, last = cell.split("..")
        return list(range(int(first), int(last) + 1))
    return [int(v) for v in cell.split(",")]


def _check_reindex(stdout: str, *, users: int, calls: int, debounce: str) -> None:
    """Every call ran once or was superseded once; the plain task ran them all, replace
    the first and the newest of each burst, debounce the newest only; the indexes under
    last call wins end at the newest version; the conclusion says so."""
    lines = _block(stdout, "reindex")
    head = next(i for i, line in enumerate(lines) if line.startswith("user "))
    labels = ["plain task", 'on_contention="replace"', f"lock_debounce={debounce}"]
    assert re.split(r"\s{2,}", lines[head - 1].strip()) == labels
    assert lines[head].split() == ["user", "calls"] + ["ran", "index"] * 3
    names = reindex.users(users)
    rows = _rows(lines[head + 1 : head + 1 + users])
    assert list(rows) == names
    newest = calls - 1
    for cells in rows.values():
        sent, every, every_index, replace, replace_index, debounced, debounce_index = cells
        assert int(sent) == calls
        assert sorted(_versions(every)) == list(range(calls))  # every call rebuilt, once
        assert int(every_index) in range(calls)
        assert replace == f"0,{newest}"  # the first, then the newest
        assert debounced == str(newest)  # the newest only
        assert replace_index == debounce_index == str(newest)
    total = users * calls
    summary = _rows(lines[head + 1 + users : head + 5 + users])
    assert summary["calls accounted"] == [f"{total} / {total}"] * 3
    assert summary["superseded"] == ["-", str(total - 2 * users), str(total - users)]
    assert summary["rebuilds run"] == [str(total), str(2 * users), str(users)]
    assert lines[-1].startswith(
        f"{total} calls: the plain task ran {total} rebuilds; "
        f'on_contention="replace" ran {2 * users} (the first and the newest of each burst), '
        f"{total - 2 * users} superseded; lock_debounce={debounce} ran {users} "
        f"(only the newest of each burst), {total - users} superseded; "
    )
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
        "--hot-calls", "12", "--small-merchants", "1", "--small-calls", "2",
        "--users", "2", "--rebuilds", "4", "--rebuild-work", "1.0",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "scenes: payments, tenants, merchants, reindex" in out.stdout  # all, by default
    table = out.stdout[out.stdout.index("without a lock   with LockedTask") :]
    lost_row = next(line for line in table.splitlines() if line.startswith("lost updates"))
    exact_row = next(line for line in table.splitlines() if line.startswith("exact balances"))
    assert lost_row.split()[-1] == "0"  # with the lock: nothing lost
    assert exact_row.split()[-3:] == ["3", "/", "3"]
    _check_tenants(out.stdout, hot=12, small=["small-1", "small-2"], each=2, limit=2, pool=3)
    _check_merchants(out.stdout, rate="10/s", hot=12, small=["small-1"], each=2)
    _check_reindex(out.stdout, users=2, calls=4, debounce="0.5")
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

    stats = f"{prefix}lock:stats"  # the stats hash under the demo app's lock prefix

    def scene(args: Any, store: Any, demo: Any) -> bool:  # what the worker would write
        assert demo.app.conf.redislock_prefix + "stats" == stats
        store.hset(stats, "celery_redislock_task_acquired_total{}", 3)
        store.set(f"{prefix}balance:1", 10)
        store.rpush(queue, "a message")
        return True

    monkeypatch.setattr(demo_main, "SCENES", {"payments": scene})
    code = demo_main.main(["--redis-url", redis_server.url, "--external-worker"])
    assert code == 0
    assert client.keys("*") == [stats.encode()]
    assert client.hgetall(stats) == {b"celery_redislock_task_acquired_total{}": b"3"}
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


@pytest.mark.slow  # ~8 s; the default demo test runs the merchants scene too
def test_the_merchants_scene_alone_holds_another_rate_passed_to_the_worker(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    client.flushall()
    out = _demo(
        "--redis-url", redis_server.url, "--scene", "merchants", "--concurrency", "2",
        "--rate", "5/s", "--hot-calls", "8", "--small-merchants", "2", "--small-calls", "2",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "scenes: merchants" in out.stdout and "tenants:" not in out.stdout
    assert "allows 5 calls a second per merchant" in out.stdout
    _check_merchants(out.stdout, rate="5/s", hot=8, small=["small-1", "small-2"], each=2)
    assert client.keys("*") == []


DASHBOARD = Path(ROOT) / "monitoring" / "grafana" / "celery-redislock.json"


def _panel_series(*titles: str) -> set[str]:
    """The series the dashboard's panels of these titles query."""
    found: dict[str, set[str]] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            if panel.get("title") in titles:
                exprs = " ".join(t.get("expr", "") for t in panel.get("targets", []))
                found[panel["title"]] = set(re.findall(r"celery_redislock_[a-z_]+", exprs))
            walk(panel.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    assert set(found) == set(titles)
    return set().union(*found.values())


def test_with_an_external_worker_the_new_scenes_fill_the_rate_and_last_call_wins_panels(
    redis_server: RedisServer,
) -> None:
    """docker compose: the demo-worker counts the merchants and reindex scenes' outcomes
    into the stats hash its exporter serves, under the series the dashboard's *Last call
    wins* panel and the rate lines of *Parked, re-queued, deferred, sent on*, *Acquired*
    and *Contended* query; and the demo leaves that hash to the exporter."""
    from celery_redislock.demo import __main__ as demo_main

    client = redis_server.client()
    client.flushall()
    prefix, queue = "redislock-demo-series:", "redislock-demo-series"
    env = {**os.environ, "DEMO_PREFIX": prefix, "DEMO_QUEUE": queue, "DEMO_WORK": "0.02",
           "DEMO_LIMIT": "2", "DEMO_RATE": "10/s", "DEMO_DEBOUNCE": "0.5",
           "DEMO_REDIS_URL": redis_server.url, "DEMO_BROKER_URL": redis_server.url}  # fmt: skip
    with tempfile.TemporaryFile() as log:
        worker = demo_main.start_worker(env, 3, queue, log)
        try:
            demo_main.wait_ready(client, prefix, worker, log, 60)
            for scene, extra in (
                ("merchants", ["--hot-calls", "6", "--small-merchants", "1", "--small-calls", "1"]),
                ("reindex", ["--users", "1", "--rebuilds", "3"]),
            ):
                out = subprocess.run(
                    [sys.executable, "-m", "celery_redislock.demo", "--redis-url",
                     redis_server.url, "--external-worker", "--scene", scene, *extra],
                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                )  # fmt: skip
                assert out.returncode == 0, out.stdout + out.stderr
        finally:
            demo_main.stop_worker(worker)
    stats = f"{prefix}lock:stats"
    assert client.keys(f"{prefix}*") == [stats.encode()]  # the rest is cleaned up
    fields = [field.decode() for field in client.hkeys(stats)]
    produced = {field.split("{")[0] for field in fields if field.startswith("celery_redislock_")}
    wanted = _panel_series("Last call wins") | {
        name for name in _panel_series("Parked, re-queued, deferred, sent on") if "deferred" in name
    }
    assert wanted == {
        "celery_redislock_task_superseded_total",
        "celery_redislock_task_debounced_total",
        "celery_redislock_task_deferred_total",
        "celery_redislock_task_undeferred_total",
    }
    assert wanted <= produced, wanted - produced
    labelled = [json.loads(f[f.index("{") :]) for f in fields if f.startswith("celery_redislock_")]
    for series in ("celery_redislock_task_acquired_total", "celery_redislock_task_contended_total"):
        assert series in _panel_series("Acquired", "Contended")
        kinds = {
            (labels["name"], labels["kind"])
            for field, labels in zip(
                (f for f in fields if f.startswith("celery_redislock_")), labelled
            )
            if field.startswith(series + "{")
        }
        assert ("demo.partner_call_rated", "rate") in kinds, kinds
    names = {labels.get("name") for labels in labelled}
    assert {"demo.partner_call_rated", "demo.reindex_replace", "demo.reindex_debounce"} <= names


# -- the merchants and reindex scenes' arithmetic, without a worker ------------------


def test_most_in_period_counts_a_half_open_window() -> None:
    assert merchants.most_in_period([], 1_000) == 0
    assert merchants.most_in_period([0, 100, 200, 300], 300) == 3  # [0, 300) holds 3
    assert merchants.most_in_period([0, 100, 200, 299], 300) == 4
    # Evenly spaced at the rate: N in any period, never N + 1.
    assert merchants.most_in_period([i * 100_000 for i in range(30)], 1_000_000) == 10


def test_refused_counts_calls_over_the_quota_in_the_period_before_them() -> None:
    assert merchants.refused([i * 100_000 for i in range(30)], 10, 1_000_000) == 0
    assert merchants.refused([0] * 12, 10, 1_000_000) == 2
    # Quota 2 per 1000: 20 and 30 are refused; at 1_005 only the accepted 0 and 10 count
    # (both out of its period), so 1_005 and 1_015 are accepted.
    assert merchants.refused([0, 10, 20, 30, 1_005, 1_015], 2, 1_000) == 2
    # Refused calls do not count against the quota: 1_012 finds only 1_005 accepted... and
    # 10 is out of its period (1_012 - 1_000 = 12 > 10).
    assert merchants.refused([0, 10, 20, 1_005, 1_012, 1_013], 2, 1_000) == 2  # 20, 1_013


def test_a_call_counts_at_its_booked_slot_else_its_start() -> None:
    call = merchants.Call("hot", 0, sent=1.0, started=2.5, ended=2.6, slot_us=2_400_000)
    assert call.moment_us == 2_400_000 and call.wait == 1.5
    plain = merchants.Call("hot", 0, sent=1.0, started=2.5, ended=2.6, slot_us=None)
    assert plain.moment_us == 2_500_000


def test_the_merchants_conclusion_follows_the_numbers() -> None:
    S = merchants.Stats
    without = {"hot": S(30, 30, 20, 0.34), "small-1": S(3, 3, 0, 0.40)}
    rated = {"hot": S(30, 10, 0, 2.98), "small-1": S(3, 3, 0, 0.54)}
    assert merchants.conclusion(without, rated, "10/s", 10, 33, 33, 29) == (
        "lock_rate=10/s: the hot merchant's busiest period went from 30 calls to 10 "
        "(quota 10), calls over the quota 20 -> 0; 33 of 33 calls ran once, 29 deferred to "
        "their slot; the small merchants' longest wait 0.40 s -> 0.54 s (the hot "
        "merchant's 2.98 s)."
    )
    assert merchants.period_words(60_000_000) == ("minute", "1 min")
    assert merchants.period_words(1_500_000) == ("1.5 s", "1.5 s")


def _rebuild(user: str, version: int, started: float) -> reindex.Rebuild:
    return reindex.Rebuild(user, version, f"{user}-{version}", started, started + 1)


def test_versions_text_shortens_runs_of_versions() -> None:
    assert reindex.versions_text([]) == "-"
    assert reindex.versions_text([0, 1, 2, 3]) == "0..3"
    assert reindex.versions_text([0, 1]) == "0,1"
    assert reindex.versions_text([0, 5]) == "0,5"


def test_account_names_every_call_not_run_once_or_superseded_once() -> None:
    sent = {f"u-{v}": ("u", v) for v in range(4)}
    runs = [_rebuild("u", 0, 1.0), _rebuild("u", 3, 2.0)]
    assert reindex.account(runs, {"u-1", "u-2"}, sent, True) == (4, [])
    # Lost: neither ran nor superseded; both; the newest not last; an older after it.
    accounted, problems = reindex.account(runs, {"u-1", "u-3"}, sent, True)
    assert accounted == 2
    assert problems == ["u version 2 ran 0 times", "u version 3 ran 1 times and was superseded"]
    late = [_rebuild("u", 3, 1.0), _rebuild("u", 0, 2.0)]
    _, problems = reindex.account(late, {"u-1", "u-2"}, sent, True)
    assert problems == [
        "u: the newest version 3 did not run last ([3, 0])",
        "u: an older version ran after a newer one ([3, 0])",
    ]
    assert reindex.account(late, {"u-1", "u-2"}, sent, False) == (4, [])  # plain: any order


def test_the_reindex_conclusion_follows_the_numbers() -> None:
    Row, Out = reindex.UserRow, reindex.Outcome
    every = Out("every", "plain task", {"user-1": Row(3, (0, 1, 2), 1)}, 3, 0, 1.0)
    replace = Out("replace", 'on_contention="replace"', {"user-1": Row(3, (0, 2), 2)}, 3, 1, 1.0)
    debounce = Out("debounce", "lock_debounce=0.5", {"user-1": Row(3, (2,), 2)}, 3, 2, 1.0)
    assert reindex.conclusion([every, replace, debounce], 3) == (
        '3 calls: the plain task ran 3 rebuilds; on_contention="replace" ran 2 (the first '
        "and the newest of each burst), 1 superseded; lock_debounce=0.5 ran 1 (only the "
        "newest of each burst), 2 superseded; with the plain task, 1 of 1 indexes ended at "
        "an older version."
    )
    odd = Out("replace", "r", {"user-1": Row(3, (0, 1, 2), 2)}, 3, 0, 1.0)
    assert "r ran 3 (user-1: 0..2)" in reindex.conclusion([every, odd], 3)
