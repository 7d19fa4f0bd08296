"""Last call wins, measured: bursts of calls of one key, as ``requeue``, ``replace`` and
``lock_debounce``, on one prefork worker against a private redis-server.

    .venv/bin/python -m bench.latest                  # ~20 s on 2 cores
    .venv/bin/python -m bench.latest --bursts 3 --calls 10

Each burst: a first call that runs ``--work`` seconds, then ``--calls`` calls of the same
key sent while it runs (``time.sleep(--gap)`` apart), the last with the newest arguments.
Per policy it prints the runs per burst, whether the last run had the newest arguments,
the calls ended ``SUPERSEDED``, the time from the first run's end to the newest call's
start (replace: the hand-over), and for the debounce the time from the last call's send
to its run's start, against the quiet period (the least it can be). Ends non-zero if a
burst ran the wrong calls or left a call unsettled.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from celery.result import AsyncResult

from celery_redislock.testing import RedisServer

from .celery_pertask import ROOT, log
from .celery_settlement import Worker

POLICIES = ("requeue", "replace", "debounce")


def _burst(app: Any, task: Any, key: str, args: argparse.Namespace) -> tuple[list[Any], float]:
    """The burst's calls, and when its last call was sent."""
    first = task.delay(key, "first", args.work)
    time.sleep(min(args.work / 3, 0.1))  # the first call holds its key
    calls = [first]
    sent = time.time()
    for i in range(args.calls):
        if i:
            time.sleep(args.gap)
        sent = time.time()
        calls.append(task.delay(key, str(i), 0.0))
    return calls, sent


def _settle(app: Any, calls: list[Any], timeout: float = 60.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {c.id: AsyncResult(c.id, app=app).state for c in calls}
        if all(s in ("SUCCESS", "SUPERSEDED") for s in states.values()):
            return states
        time.sleep(0.05)
    return {c.id: AsyncResult(c.id, app=app).state for c in calls}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--bursts", type=int, default=5, help="bursts per policy")
    parser.add_argument("--calls", type=int, default=20, help="calls sent during each first run")
    parser.add_argument("--gap", type=float, default=0.01, help="seconds between those calls")
    parser.add_argument("--work", type=float, default=0.5, help="seconds the first call runs")
    parser.add_argument("--debounce", type=float, default=0.2, help="lock_debounce (seconds)")
    parser.add_argument("--concurrency", type=int, default=4, help="the worker's pool processes")
    parser.add_argument("--log-level", default="info", help="the worker's log level")
    args = parser.parse_args(argv)
    failures = 0
    with RedisServer() as server:
        env = {**os.environ, "LATEST_URL": server.url, "LATEST_DEBOUNCE": str(args.debounce)}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        os.environ.update({k: env[k] for k in ("LATEST_URL", "LATEST_DEBOUNCE")})
        from . import _latest_app as bench_app

        bench_app.app.conf.update(broker_url=server.url, result_backend=server.url)
        r = server.client()
        worker = Worker(
            "run", env, args, app="bench._latest_app", queue="latest-bench", tag="latest"
        )
        try:
            _wait_ready(worker)
            rows = []
            for policy in POLICIES:
                task = getattr(bench_app, policy)
                runs_per_burst, supersed, newest_ok, gaps, late = [], 0, 0, [], []
                for b in range(args.bursts):
                    key = f"{policy}-{b}"
                    calls, sent_last = _burst(bench_app.app, task, key, args)
                    states = _settle(bench_app.app, calls)
                    if any(s not in ("SUCCESS", "SUPERSEDED") for s in states.values()):
                        log(f"{policy}: burst {b} left calls unsettled: {set(states.values())}")
                        failures += 1
                    runs = [line.decode().split() for line in r.lrange(f"latest:runs:{key}", 0, -1)]
                    runs_per_burst.append(len(runs))
                    supersed += list(states.values()).count("SUPERSEDED")
                    newest_ok += runs[-1][0] == str(args.calls - 1) if runs else 0
                    if policy == "replace" and len(runs) == 2:
                        gaps.append(float(runs[1][1]) - float(runs[0][2]))
                    if policy == "debounce" and runs:
                        late.append(float(runs[-1][1]) - sent_last)
                    expected = {"requeue": args.calls + 1, "replace": 2, "debounce": None}[policy]
                    if expected is not None and len(runs) != expected:
                        log(f"{policy}: burst {b} ran {len(runs)} calls, expected {expected}")
                        failures += 1
                rows.append((policy, runs_per_burst, supersed, newest_ok, gaps, late))
        finally:
            worker.stop()
    calls = args.calls + 1
    print(
        f"{args.bursts} bursts of {calls} calls of one key (first runs {args.work}s; the "
        f"others sent {args.gap}s apart while it runs), prefork {args.concurrency}"
    )
    print(
        f"{'policy':<10}{'runs/burst':>12}{'superseded':>12}{'newest ran':>12}"
        f"{'hand-over ms':>14}{'after last call ms':>20}"
    )
    for policy, runs, supersed, newest_ok, gaps, late in rows:
        median_runs = statistics.median(runs)
        gap = f"{statistics.median(gaps) * 1000:.1f}" if gaps else "-"
        after = f"{statistics.median(late) * 1000:.0f}" if late else "-"
        print(
            f"{policy:<10}{median_runs:>12g}{supersed:>12}{newest_ok:>9}/{args.bursts:<2}"
            f"{gap:>14}{after:>20}"
        )
    print(
        f"debounce: the least a run can start after the last call is the quiet period, "
        f"{args.debounce * 1000:.0f} ms (measured from the sender's clock)"
    )
    return 1 if failures else 0


def _wait_ready(worker: Worker, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "ready." in worker.text():
            return
        if worker.process.poll() is not None:
            raise SystemExit(f"the worker exited:\n{worker.text()[-3000:]}")
        time.sleep(0.1)
    raise SystemExit(f"the worker did not start:\n{worker.text()[-3000:]}")


if __name__ == "__main__":
    sys.exit(main())
