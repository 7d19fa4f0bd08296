"""RabbitMQ fallback copies coming back after their tasks ran: what a worker spends on them.

    .venv/bin/python -m bench.fallback_copies              # ~1 minute; RabbitMQ on 127.0.0.1:5672
    .venv/bin/python -m bench.fallback_copies --repeat 3 --tasks 40

With the locks on another Redis than the broker, each parked task gets a fallback copy in
a RabbitMQ delay queue, in case the locks' Redis loses it; the copy comes back after its
delay, most often long after the task ran through its hand-over. A real prefork worker
(``bench._copies_app``, 2 processes) runs a holder of 0.5 s and ``--tasks`` tasks of one
key parked behind it, then waits for their copies (2 s delay). Two variants, in turns:
``pool``, the worker's main process leaving the copies to pool processes (the check at
delivery switched off in the app: how it was before), and ``delivery``, the main process
dropping each copy whose run's done marker it finds. Printed per run: the copies found
done, how many of them a pool process was given (``task_prerun`` counted beyond the
tasks themselves), and the span from the first copy found done to the last. Queues of the
run's own, deleted after; one private redis-server, stopped by pid.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from typing import Any

from celery_redislock.testing import RedisServer

from .celery_settlement import AMQP_URL, ROOT, Worker, amqp_reachable, delete_queues

monotonic = time.monotonic


def _wait(what: str, check: Any, timeout: float, worker: Worker) -> None:
    deadline = monotonic() + timeout
    while not check():
        if not worker.alive() or monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout}s:\n{worker.text()[-3000:]}")
        time.sleep(0.02)


def one_run(variant: str, server: RedisServer, tasks: int) -> dict[str, float]:
    from celery import Celery

    run = f"copies-{secrets.token_hex(4)}"
    queue = f"bench-copies-{run}"
    r = server.client()
    env = {
        **os.environ,
        "COPIES_URL": server.url,
        "COPIES_RUN": run,
        "COPIES_AT_DELIVERY": "1" if variant == "delivery" else "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    args = argparse.Namespace(concurrency=2, log_level="warning")
    worker = Worker(variant, env, args, app="bench._copies_app", queue=queue, tag="copies")
    client = Celery("copies-client", broker=AMQP_URL)
    done = f"{run}:done"
    try:

        def send(seconds: float) -> None:
            client.send_task("copies.job", args=("hot", seconds), queue=queue)

        send(0.0)  # the worker's start, and the key comes again: the next are checked
        _wait("the worker's start", lambda: int(r.get(done) or 0) == 1, 60, worker)
        send(0.5)
        _wait("the holder", lambda: r.exists("redislock:{cp:hot}"), 30, worker)
        for _ in range(tasks):
            send(0.0)
        _wait("the tasks", lambda: int(r.get(done) or 0) == tasks + 2, 60, worker)
        duplicates = f"{run}:duplicates"
        _wait("the copies", lambda: r.llen(duplicates) >= tasks, 60, worker)
        time.sleep(0.5)  # (a copy dispatched late would still count)
        found = sorted(float(t) for t in r.lrange(duplicates, 0, -1))
        return {
            "copies": len(found),
            "to pool processes": int(r.get(f"{run}:dispatched") or 0) - (tasks + 2),
            "first to last (ms)": 1000 * (found[-1] - found[0]),
        }
    finally:
        worker.stop()
        client.close()
        delete_queues(AMQP_URL, [queue, f"{queue}.redislock", f"redislock.delay.2000.{queue}"])
        r.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=40, help="tasks parked behind the holder (40)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per variant, in turns (2)")
    args = ap.parse_args(argv)
    if not 1 <= args.tasks <= 1000 or not 1 <= args.repeat <= 20:
        ap.error("--tasks must be 1 to 1000 and --repeat 1 to 20")
    if not amqp_reachable():
        print("no RabbitMQ on 127.0.0.1:5672: nothing to measure")
        return 0
    runs: dict[str, list[dict[str, float]]] = {"pool": [], "delivery": []}
    with RedisServer() as server:
        for n in range(args.repeat):
            for variant in runs:
                result = one_run(variant, server, args.tasks)
                runs[variant].append(result)
                print(
                    f"  [{n + 1}] {variant:8s} "
                    + ", ".join(f"{k} {v:g}" for k, v in result.items())
                )
    print(
        f"\n{args.tasks} tasks parked behind a 0.5 s holder, their copies back after 2 s "
        f"(prefork 2, RabbitMQ; medians of {args.repeat}):"
    )
    for key in ("copies", "to pool processes", "first to last (ms)"):
        cells = [statistics.median(r[key] for r in runs[v]) for v in runs]
        print(f"  {key:22s} pool {cells[0]:8.1f}   at delivery {cells[1]:8.1f}")
    pool, delivery = (statistics.median(r["first to last (ms)"] for r in runs[v]) for v in runs)
    if delivery > 0:
        print(f"  copies cleared: at delivery {pool / delivery:.1f}x faster than by pool processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
