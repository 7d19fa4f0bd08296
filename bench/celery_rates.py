"""Rate limits across Celery workers: ``lock_rate`` beside Celery's own ``rate_limit`` and
Dramatiq's ``WindowRateLimiter`` inside a plain task.

    .venv/bin/python -m bench.celery_rates               # ~1 minute on 2 cores
    .venv/bin/python -m bench.celery_rates --libs ours   # no peers (dramatiq not needed)

A burst of ``--tasks`` tasks for one merchant is published at once to 4 workers (``-P
prefork -c 1`` each: 4 worker processes) for each variant (columns, in
bench/_celery_rates_app.py): ours (``lock_rate``: over-rate runs deferred to their slot
in Redis), Celery's ``rate_limit`` (a token bucket per worker: 4 workers admit up to 4x),
Dramatiq's window limiter taken in the task, ``self.retry(countdown=0.05)`` when refused.

Rows: the bound (the most starts in any 1 s window against ``1 + rate x 1 s``; ours
also over its booked slots), the throughput achieved against the rate allowed, Redis
commands per task (INFO commandstats of the private server over the run: broker and
limiter, less the benchmark's own record and sampling), attempts per task (a refused
attempt holds a pool slot), and the most messages held unacknowledged by the workers
while waiting (sampled: a token-bucket wait holds its message in the worker). Then the
ratios. One private redis-server on a free loopback port, started and stopped here; each
variant its own queue and workers, started in their own process groups and stopped by
pid (SIGTERM, then ``os.killpg`` SIGKILL).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from celery_redislock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ours", "celery", "dramatiq")
LABELS = {"ours": "ours (lock_rate)", "celery": "celery rate_limit", "dramatiq": "dramatiq window"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def most_in_window(moments: list[float], window: float) -> int:
    """The most moments in any closed window of length ``window``."""
    moments = sorted(moments)
    most, start = 0, 0
    for end, moment in enumerate(moments):
        while moment - moments[start] > window:
            start += 1
        most = max(most, end - start + 1)
    return most


def start_workers(url: str, queue: str, rate: str, count: int, logs: Path) -> list[Any]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RATES_URL": url,
        "RATES_QUEUE": queue,
        "RATES_RATE": rate,
        "RATES_PREFIX": f"{queue}:",
    }
    procs = []
    for n in range(count):
        path = logs / f"{queue}-{n}.log"
        handle = path.open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bench._celery_rates_app", "worker",
             "-P", "prefork", "-c", "1", "-l", "info", "-Q", queue, "-n", f"{queue}{n}@bench",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        handle.close()
        procs.append((proc, path))
    deadline = time.monotonic() + 60
    for proc, path in procs:
        while "ready." not in path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{path.read_text()[-3000:]}")
            time.sleep(0.1)
    return procs


def stop_workers(procs: list[Any]) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def commands(r: redis.Redis) -> int:
    return sum(int(v["calls"]) for v in r.info("commandstats").values())


def run_variant(server: RedisServer, variant: str, args: argparse.Namespace, logs: Path) -> dict:
    r = server.client()
    queue = f"rates_{variant}"
    procs = start_workers(server.url, queue, args.rate, args.workers, logs)
    try:
        os.environ.update(RATES_URL=server.url, RATES_RATE=args.rate)
        from bench import _celery_rates_app as rates_app

        rates_app.app.conf.update(broker_url=server.url, redislock_url=server.url)
        task = rates_app.app.tasks[f"rates.{variant}"]
        held_most, polls, done = 0, 0, threading.Event()
        sampler = server.client()

        def sample() -> None:
            nonlocal held_most, polls
            while not done.is_set():
                held_most = max(held_most, int(sampler.hlen("unacked")))
                polls += 1
                time.sleep(0.05)

        r.config_resetstat()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        published = time.time()
        for _ in range(args.tasks):
            task.apply_async(("m1",), queue=queue)
        starts_key = f"{queue}:starts"
        deadline = time.monotonic() + args.timeout
        while r.llen(starts_key) < args.tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set()
        thread.join()
        spent = commands(r)
        rows = [line.decode().split() for line in r.lrange(starts_key, 0, -1)]
        refused = int(r.get(f"{queue}:refused") or 0)
    finally:
        stop_workers(procs)
    starts = [float(row[0]) for row in rows]
    slots = [int(row[1]) / 1e6 for row in rows if int(row[1]) > 1]
    ids = {row[2] for row in rows}
    rate_per_s = float(args.rate.split("/")[0])
    span = max(starts) - min(starts) if len(starts) > 1 else float("nan")
    # The benchmark's own: one RPUSH per start, INCR per refusal, the sampler's HLENs,
    # the LLEN polls and the final reads are left out.
    own = len(rows) + refused + polls
    return {
        "completed": len(ids),
        "duplicates": len(rows) - len(ids),
        "most_1s": most_in_window(starts, 1.0),
        "most_1s_slots": most_in_window(slots, 1.0) if slots else None,
        "throughput": (len(starts) - 1) / span if len(starts) > 1 else 0.0,
        "allowed": rate_per_s,
        "commands": max(spent - own, 0) / max(len(ids), 1),
        "attempts": (len(rows) + refused) / max(len(ids), 1),
        "held_most": held_most,
        "first_start_s": min(starts) - published if starts else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", default=",".join(VARIANTS))
    parser.add_argument("--rate", default="20/s")
    parser.add_argument("--tasks", type=int, default=100, help="the burst (default: 5 s)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    variants = [v for v in args.libs.split(",") if v]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as logs, RedisServer() as server:
        for variant in variants:
            log(f"{variant}: {args.tasks} tasks at {args.rate} on {args.workers} workers")
            results[variant] = run_variant(server, variant, args, Path(logs))
            log(f"  {results[variant]}")
    rate = float(args.rate.split("/")[0])
    bound = 1 + rate
    rows = [
        ("completed", "tasks completed", "{:.0f}"),
        ("duplicates", "tasks run twice", "{:.0f}"),
        ("most_1s", f"most starts in 1 s (bound {bound:g})", "{:.0f}"),
        ("most_1s_slots", "most booked slots in 1 s", "{}"),
        ("throughput", f"starts/s (allowed {rate:g})", "{:.1f}"),
        ("commands", "Redis commands per task", "{:.1f}"),
        ("attempts", "attempts per task", "{:.2f}"),
        ("held_most", "most msgs held unacked", "{:.0f}"),
    ]
    width = 22
    print(f"{'':<36}" + "".join(f"{LABELS[v]:>{width}}" for v in variants))
    for key, label, fmt in rows:
        cells = []
        for v in variants:
            value = results[v][key]
            cells.append(f"{'-' if value is None else fmt.format(value):>{width}}")
        print(f"{label:<36}" + "".join(cells))
    print()
    for v in variants:
        res = results[v]
        kept = "kept" if res["most_1s"] <= bound else "BROKEN"
        print(
            f"{LABELS[v]}: bound {kept} ({res['most_1s'] / bound:.2f}x of it), "
            f"throughput {res['throughput'] / rate:.2f}x the allowed rate"
        )
    if "ours" in results:
        for v in variants:
            if v != "ours" and results["ours"]["commands"]:
                print(
                    f"{LABELS[v]} / ours: Redis commands per task "
                    f"{results[v]['commands'] / results['ours']['commands']:.2f}x"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
