"""The demo runs end to end, against a user's Redis, and leaves no key behind."""

from __future__ import annotations

import os
import subprocess
import sys

from celery_redislock.testing import RedisServer

from .._celery import ROOT


def test_demo_against_a_given_redis_prints_the_table_and_cleans_up(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    client.flushall()
    client.set("users:own:key", "untouched")
    out = subprocess.run(
        [sys.executable, "-m", "celery_redislock.demo", "--redis-url", redis_server.url,
         "--payments", "60", "--accounts", "3", "--concurrency", "3"],
        cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout[out.stdout.index("without a lock   with LockedTask") :]
    lost_row = next(line for line in table.splitlines() if line.startswith("lost updates"))
    exact_row = next(line for line in table.splitlines() if line.startswith("exact balances"))
    assert lost_row.split()[-1] == "0"  # with the lock: nothing lost
    assert exact_row.split()[-3:] == ["3", "/", "3"]
    assert "no demo process is left running" in out.stdout
    assert client.keys("*") == [b"users:own:key"]  # the demo removed everything it wrote


def test_demo_rejects_bad_arguments() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "celery_redislock.demo", "--payments", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--payments must be at least 1" in out.stderr
