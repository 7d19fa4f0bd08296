"""Smoke tests of the benchmarks at tiny sizes: they run and their safety rows hold.

No timing is asserted here (speed is shown by the benchmarks themselves, see
docs/benchmarks.md); only that each script runs to the end, prints its table, and that
the rows which are correctness checks (overlapping sections, lost updates, completed
tasks, a rate limiter's bound) show what they must. Peer libraries of the ``bench``
extra are not needed: the runs below use ``celery_redislock`` and redis-py only.
Nothing is written to bench/results.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def _run(*args: str, timeout: float) -> str:
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _row(table: str, label: str) -> list[str]:
    lines = [line for line in table.splitlines() if line.strip().startswith(label)]
    assert lines, f"no row {label!r} in:\n{table}"
    return lines[0][len(lines[0].split(label)[0]) + len(label) :].split()


def test_the_lock_benchmark_runs_at_tiny_sizes() -> None:
    out = _run(
        "bench.locks",
        "--libs", "ours,redispy",
        "--cycles", "100",
        "--procs", "2",
        "--duration", "0.5",
        "--rounds", "2",
        "--dead-reps", "1",
        "--waiters", "8",
        "--handoffs", "20",
        "--many-seconds", "5",
        "--renew-locks", "100",
        "--renew-hold", "1.2",
        "--no-plot",
        "--no-json",
        timeout=240,
    )  # fmt: skip
    # ours, redis-py, the two-round-trip floor's "-", the one-token floor
    assert _row(out, "2 overlapping sections") == ["0", "0", "-", "0"]
    assert "gap / token floor" in out
    assert "within each round" in out
    assert _row(out, "5 renew 100: leases lost")[0] == "0"
    assert _row(out, "5 renew 100: loss reports on clean release")[0] == "0"
    uncontended = _row(out, "1 uncontended acquire+release /s")
    assert all(float(value) > 0 for value in uncontended[:2])
    assert "Ratios:" in out


def test_the_rate_limiter_benchmark_runs_at_tiny_sizes_within_the_bound() -> None:
    out = _run(
        "bench.rates",
        "--libs", "ours",
        "--procs", "2",
        "--duration", "1",
        "--calls", "100",
        "--no-json",
        timeout=240,
    )  # fmt: skip
    assert _row(out, "1 worst units over 5 + 50*T, any T")[0] == "0"
    assert int(_row(out, "1 fullest 1 s window (bound 55)")[0]) <= 55
    assert int(_row(out, "1 admitted in 1 s")[0]) > 0
    assert float(_row(out, "2 uncontended acquire us/call")[0]) > 0


def test_the_semaphore_benchmark_runs_at_tiny_sizes() -> None:
    out = _run(
        "bench.semaphores",
        "--libs", "ours,zset",
        "--cycles", "100",
        "--procs", "4",
        "--duration", "0.5",
        "--no-json",
        timeout=240,
    )  # fmt: skip
    assert int(_row(out, "2 most holders at once (limit 3)")[0]) <= 3  # ours; never above N
    assert _row(out, "2 acquire timeouts")[0] == "0"
    assert int(_row(out, "2 hot key throughput acq/s")[0].split(".")[0]) > 0
    uncontended = _row(out, "1 uncontended acquire+release /s")
    assert len(uncontended) == 4  # ours, the recipe, the mutex, the floor
    assert all(float(value) > 0 for value in uncontended)
    assert "Ratios:" in out


def test_the_settlement_benchmark_runs_lockedtask_without_lost_updates() -> None:
    out = _run(
        "bench.celery_settlement",
        "--variants", "locked",
        "--no-json",
        "--no-plot",
        "--timeout", "120",
        timeout=400,
    )  # fmt: skip
    assert _row(out, "lost updates") == ["0"]
    assert _row(out, "overlapping sections") == ["0"]
    for makespan in re.findall(r"makespan \(s\)\s+(\S+)", out):
        assert float(makespan) > 0  # a number: every task completed (not "timeout")
    assert "LockedTask makespan/ideal W2" in out


def test_the_hot_key_plot_draws_one_row_per_broker(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    from bench.celery_settlement import plot_hot_key

    sections = [(i * 0.025, i * 0.025 + 0.02) for i in range(50)]
    meds = {"same": {"locked": {"W2": {"hot_efficiency": 0.8}}}}
    path = tmp_path / "hotkey.png"
    assert plot_hot_key({"same": sections, "amqp": sections}, meds, 0.02, path)
    assert path.stat().st_size > 1000


def test_the_celery_rate_benchmark_runs_at_tiny_sizes() -> None:
    out = _run(
        "bench.celery_rates", "--libs", "ours", "--tasks", "12", "--workers", "2", timeout=180
    )
    assert _row(out, "tasks completed") == ["12"]
    assert _row(out, "tasks run twice") == ["0"]
    # Ours keeps its bound (1 + 20 in any 1 s) over the starts and the booked slots.
    assert int(_row(out, "most starts in 1 s (bound 21)")[0]) <= 21
    assert int(_row(out, "most booked slots in 1 s")[0]) <= 21
    assert "ours (lock_rate): bound kept" in out


def test_the_hand_over_parts_benchmark_runs_at_tiny_sizes() -> None:
    out = _run(
        "bench.handoff_parts",
        "--procs", "2",
        "--duration", "0.5",
        "--rounds", "1",
        "--calls", "20",
        timeout=120,
    )  # fmt: skip
    # (bench.handoff_parts exits non-zero on an overlap, or a kind with no section)
    assert "overlapping sections: ours 0, token 0" in out
    assert "gap / token floor, within each round" in out
    assert float(_row(out, "release granting to a box")[0]) > 0
    assert float(_row(out, "LPUSH")[0]) > 0


@pytest.mark.parametrize("bad", [["--hold-ms", "-1"], ["--work-ms", "nan"], ["--calls", "0"]])
def test_the_hand_over_parts_benchmark_refuses_bad_sizes(bad: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.handoff_parts", *bad],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and bad[0] in done.stderr, done.stderr


def test_the_per_task_cost_benchmark_runs_every_locked_task_once() -> None:
    out = _run(
        "bench.celery_pertask",
        "--variants", "locked",
        "--tasks", "30",
        "--warm", "10",
        "--count-tasks", "0",
        "--no-json",
        timeout=120,
    )  # fmt: skip
    assert _row(out, "tasks run (of published)") == ["40/40"]
    assert float(_row(out, "Redis commands per task")[0]) > 0


def test_the_last_call_wins_benchmark_runs_the_calls_each_policy_says() -> None:
    out = _run(
        "bench.latest", "--bursts", "1", "--calls", "4", "--work", "0.3", timeout=120
    )  # fmt: skip
    # (bench.latest exits non-zero if a burst ran other calls than its policy says)
    assert _row(out, "requeue")[:2] == ["5", "0"]  # every call runs
    assert _row(out, "replace")[:3] == ["2", "3", "1/1"]
    assert _row(out, "debounce")[:3] == ["1", "4", "1/1"]


def test_the_hand_over_parts_split_each_gap_into_its_steps(tmp_path: Path) -> None:
    """``bench.celery_settlement --parts``: records of the hot account's gaps, one of each
    kind (a pushed envelope the main process checks, a published task, run on), one whose
    next task found the lock free, one with a record missing, and a line cut short: each
    gap counted where it belongs, none taken for another kind."""
    from bench._handover_parts import PUBLISHED_STEPS, RUN_ON_STEPS, STEPS, parts

    events = tmp_path / "events"
    events.write_text(
        "\n".join(
            [
                "1 section r-W2:hot 1.000 1.020",
                "1 finish - 1.0202 1.0207",
                "1 script - 1.0203 1.0206",
                "1 sent t2 1.0206 0",
                "1 postrun t1 1.0208 0",
                "2 accept t2 1.0222 1.0224",
                "1 prerun t2 1.0230 0",
                "1 script - 1.0231 1.0233",
                "1 section r-W2:hot 1.0236 1.0436",  # through the broker: 3.6 ms
                "1 section other 1.0437 1.0438",
                "1 finish - 1.0440 1.0444",
                "1 script - 1.0441 1.0443",
                "1 runon t3 1.0446 0",
                "1 prerun t3 1.0450 0",
                "1 section r-W2:hot 1.0452 1.0652",  # run on: 1.6 ms
                "1 finish - 1.0653 1.0656",
                "1 script - 1.0654 1.0655",
                "1 sent t4 1.0656 0",
                "9 received t4 1.0680 1.0681",  # the main process has it
                "3 prerun t4 1.0700 0",
                "3 script - 1.0701 1.0703",
                "3 section r-W2:hot 1.0705 1.0905",  # published (no check), another process
                "3 finish - 1.0906 1.0908",
                "3 script - 1.0906 1.0907",
                "3 prerun t5 1.0950 0",
                "3 section r-W2:hot 1.0960 1.1160",  # t5 found the lock free: not handed
                "4 section r-W2:hot 1.2000 1.2200",  # no release recorded before it
                "4 prerun t6 1.2",  # cut short
            ]
        )
        + "\n"
    )
    found, counts = parts(events, "W2:hot")
    broker, published, ran_on = found["through the broker"], found["published"], found["run on"]
    assert broker["hand-overs"] == ran_on["hand-overs"] == published["hand-overs"] == 1
    assert set(broker) == {label for label, _ in STEPS} | {"hand-overs"}
    assert set(ran_on) == {label for label, _ in RUN_ON_STEPS} | {"hand-overs"}
    assert set(published) == {label for label, _ in PUBLISHED_STEPS} | {"hand-overs"}
    assert abs(broker["gap"] - 3.6) < 1e-6
    assert abs(broker["release end -> main process has it"] - 1.5) < 1e-6
    assert abs(broker["main process: the envelope's check"] - 0.2) < 1e-6
    assert abs(broker["  the acquire's script call"] - 0.2) < 1e-6
    assert abs(ran_on["gap"] - 1.6) < 1e-6
    assert abs(ran_on["release end -> task_prerun"] - 0.6) < 1e-6
    assert abs(published["gap"] - 5.3) < 1e-6
    assert abs(published["release end -> task_prerun"] - 4.4) < 1e-6
    assert abs(published["  release end -> main process has it"] - 2.4) < 1e-6
    assert abs(published["  main process has it -> task_prerun"] - 2.0) < 1e-6
    assert counts == {"not handed over": 1, "records missing": 1, "bad lines": 1}
    assert parts(events, "nothing") == (
        {},
        {"not handed over": 0, "records missing": 0, "bad lines": 1},
    )


def test_parts_needs_the_hot_key_s_workload(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.celery_settlement", "--parts", "--workloads", "W3"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--parts" in done.stderr, done.stderr
