"""The examples run as documented: a real worker per example app, then the client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from celery_redislock.testing import RedisServer

from .._celery import ROOT, CeleryProcess


@pytest.mark.parametrize("example", ["payments", "per_user", "indexing"])
def test_example_runs_against_a_real_worker(example: str, tmp_path: Path) -> None:
    with RedisServer() as server:
        env = {"REDIS_URL": server.url}
        args = ["worker", "-l", "info", "-c", "4", "--without-gossip", "--without-mingle"]
        proc = CeleryProcess(args, url=server.url, log=tmp_path / "w.log", env=env)
        proc.app = f"examples.{example}"
        proc.start()
        try:
            proc.wait_for_log("ready.")
            out = subprocess.run(
                [sys.executable, "-m", f"examples.{example}"],
                cwd=ROOT,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=240,
                check=False,
            )
        finally:
            proc.kill()
    assert out.returncode == 0, out.stderr[-3000:] + proc.text()[-3000:]
    if example == "payments":
        for line in out.stdout.strip().splitlines():
            _account, balance, _, _, expected = line.replace("b'", "").replace("'", "").split()
            assert int(balance) == int(expected), line
    elif example == "indexing":
        # The burst of edits runs once, with the last revision; the rebuilds run the one
        # that first found the key free (the first sent, or an early one that reached a
        # pool process first: four of them take the ten messages at once) and the newest.
        assert "20 edits: 1 run, 19 superseded" in out.stdout, out.stdout
        assert "indexed revisions: [20]" in out.stdout, out.stdout
        rebuilt = out.stdout.split("rebuilt versions: ")[1].strip()
        assert rebuilt in ["[10]", *(f"[{first}, 10]" for first in range(1, 10))], out.stdout
    else:
        assert "rebuilt" in out.stdout and "ada@example.com" in out.stdout
