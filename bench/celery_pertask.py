"""What a lock costs a short task that nobody contends: LockedTask against a plain task.

    .venv/bin/python -m bench.celery_pertask                  # ~30 s on 2 cores
    .venv/bin/python -m bench.celery_pertask --repeat 3       # medians of 3 runs

``--tasks`` short tasks (default 2,000), each on a key of its own, run by one prefork
worker (``-c 2``, prefetch multiplier 4, ``acks_late``), broker and locks on one private
redis-server. The same body runs as a plain task (``nolock``) and as a ``LockedTask``
(``locked``); see ``bench/_pertask_app.py``. Every message is published before the
worker starts; the first ``--warm`` tasks warm the worker up (imports, connections,
scripts) and the window is the next ``--tasks``: throughput from the tasks' own clock,
and Redis commands per task by kind from ``INFO commandstats`` snapshots taken by the
tasks at both ends of the window (so the parent's commands and the worker's start are
not counted; the broker's are, in both columns alike).

Prints the table, the throughput ratio (LockedTask ÷ plain) and the commands per task
that the lock adds, by kind. One private redis-server on a free loopback port, started
and stopped here by pid; each worker runs in its own process group, stopped with SIGTERM
and then ``os.killpg`` SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from celery_redislock.testing import RedisServer

from .celery_settlement import Worker as SettleWorker

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("nolock", "locked")
LABELS = {"nolock": "plain task", "locked": "LockedTask"}
# Commands of the benchmark itself inside the window: the first mark's SET and RPUSH, the
# last INFO.
OWN = {"set": 1, "rpush": 1, "info": 1}
#: The processes whose CPU time is read at both ends of the window (``cpu_times``).
CPU_PARTS = ("main", "pool", "redis")
monotonic = time.monotonic


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def Worker(variant: str, env: dict[str, str], args: argparse.Namespace) -> SettleWorker:
    """The per-task app's worker on its queue (the settlement benchmark's worker class)."""
    queue = env["PERTASK_QUEUE"]
    return SettleWorker(variant, env, args, app="bench._pertask_app", queue=queue, tag="pertask")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times(worker_pid: int, redis_pid: int) -> dict[str, float] | None:
    """CPU seconds used so far by the worker's main process, its pool processes (its
    children) and the redis-server; None where ``/proc`` cannot tell (not Linux)."""
    try:
        children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
        return {
            "main": _cpu_seconds(worker_pid),
            "pool": sum(_cpu_seconds(int(child)) for child in children),
            "redis": _cpu_seconds(redis_pid),
        }
    except (OSError, ValueError, IndexError):
        return None


def script_names() -> dict[str, str]:
    """EVALSHA's first argument -> the package's script name."""
    import hashlib

    from celery_redislock import _scripts

    return {
        hashlib.sha1(_scripts.source(name).encode()).hexdigest(): name
        for name in _scripts.SCRIPT_NAMES
    }


class Monitor(threading.Thread):
    """``MONITOR`` on its own connection: counts, between the first mark's ``SET`` and the
    last ``INFO``, the commands clients sent (EVALSHA named by script) and those scripts ran."""

    def __init__(self, url: str, first_mark: str) -> None:
        super().__init__(daemon=True, name="pertask-monitor")
        self.client = redis.Redis.from_url(url, socket_timeout=60)
        self.first_mark = first_mark
        self.sent: Counter[str] = Counter()
        self.scripted: Counter[str] = Counter()
        self.ended = threading.Event()
        self.error: str | None = None
        self.scripts = script_names()

    def run(self) -> None:
        quoted = re.compile(r'"((?:[^"\\]|\\.)*)"')
        try:
            with self.client.monitor() as monitor:
                conn = monitor.connection
                inside = False
                self.started = True
                while True:
                    line = conn.read_response()
                    text = line.decode(errors="replace") if isinstance(line, bytes) else str(line)
                    head, _, rest = text.partition("] ")
                    words = quoted.findall(rest)
                    if not words:
                        continue
                    name = words[0].lower()
                    if not inside:
                        if name == "set" and len(words) > 1 and words[1] == self.first_mark:
                            inside = True
                        continue
                    if name == "info" and not head.endswith("lua"):
                        self.ended.set()
                        return
                    if head.endswith("lua"):
                        self.scripted[name] += 1
                    elif name == "evalsha" and len(words) > 1:
                        self.sent["evalsha " + self.scripts.get(words[1], words[1][:8])] += 1
                    else:
                        self.sent[name] += 1
        except Exception as exc:  # reported by the parent; the thread ends
            self.error = repr(exc)
            self.ended.set()


def run_variant(
    variant: str,
    url: str,
    redis_pid: int,
    store: redis.Redis,
    pa: Any,
    args: argparse.Namespace,
    tasks: int | None = None,
    *,
    monitored: bool = False,
    timed: bool = False,
) -> dict[str, Any]:
    token = secrets.token_hex(3)
    queue = f"pertask-{variant}-{token}"
    run = f"{token}-{variant}"
    tasks = args.tasks if tasks is None else tasks
    first, last = args.warm, args.warm + tasks
    monitor = None
    if monitored:  # the counting run
        monitor = Monitor(url, pa.mark_key(run, "first"))
        monitor.start()
        time.sleep(0.2)
    task = pa.TASKS[variant]
    with task.app.producer_or_acquire() as producer:
        for i in range(last):
            task.apply_async((run, f"{run}:{i}", first, last), queue=queue, producer=producer)
    env = {
        **os.environ,
        "PERTASK_URL": url,
        "PERTASK_PREFIX": pa.PREFIX,
        "PERTASK_QUEUE": queue,
        "PERTASK_PREFETCH": str(args.prefetch),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if timed:
        env["PERTASK_TIME_SCRIPTS"] = "1"
    worker = Worker(variant, env, args)
    cpu: list[dict[str, float] | None] = []
    script_us: list[int] = []
    incr_us: list[int] = []
    try:
        for mark in ("reached", "finished"):
            got = store.blpop([pa.mark_key(run, mark)], timeout=args.timeout)
            if got is None:
                text = worker.text()[-3000:]
                raise SystemExit(f"{variant}: not {mark} in {args.timeout}s:\n{text}")
            cpu.append(cpu_times(worker.process.pid, redis_pid))
            script_us.append(int(store.get(pa.mark_key(run, "script_us")) or 0))
            incr_us.append(int(store.get(pa.mark_key(run, "incr_us")) or 0))
        if monitor is not None and not monitor.ended.wait(30):
            raise SystemExit(f"{variant}: MONITOR did not see the window end")
    finally:
        worker.stop()
        store.delete(queue)
        if monitor is not None:
            monitor.client.close()
    if monitor is not None:
        if monitor.error:
            raise SystemExit(f"{variant}: MONITOR failed: {monitor.error}")
        sent = {k: v / tasks for k, v in monitor.sent.items()}
        return {
            "sent": sent,
            "scripted": {k: v / tasks for k, v in monitor.scripted.items()},
            "sent_per_task": sum(monitor.sent.values()) / tasks,
        }
    marks = [json.loads(store.get(pa.mark_key(run, w)) or "{}") for w in ("first", "last")]
    seconds = marks[1]["t"] - marks[0]["t"]
    per_kind: dict[str, float] = {}
    for name, calls in marks[1]["stats"].items():
        delta = calls - marks[0]["stats"].get(name, 0) - OWN.get(name.removeprefix("cmdstat_"), 0)
        if delta > 0:
            per_kind[name.removeprefix("cmdstat_")] = delta / tasks
    done = int(store.get(pa.done_key(run)) or 0)
    start_cpu, end_cpu = cpu
    cpu_per_task = (
        {part: (end_cpu[part] - start_cpu[part]) / tasks for part in CPU_PARTS}
        if start_cpu is not None and end_cpu is not None
        else {}
    )
    res = {
        "cpu_per_task": cpu_per_task,
        "tasks_per_s": tasks / seconds,
        "per_kind": per_kind,
        "per_task": sum(per_kind.values()),
        "ran": done,
        "expected": last,
    }
    if timed:
        res["script_wall_per_task"] = (script_us[1] - script_us[0]) / 1e6 / tasks
        res["incr_wall_per_task"] = (incr_us[1] - incr_us[0]) / 1e6 / tasks
    log(
        f"  {LABELS[variant]:10s} {res['tasks_per_s']:7.0f} tasks/s  "
        f"{res['per_task']:5.2f} Redis commands per task  (ran {done} of {last})"
    )
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.celery_pertask",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--tasks", type=int, default=2000, help="tasks in the window (2000)")
    ap.add_argument("--warm", type=int, default=200, help="warm-up tasks before it (200)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per variant; medians (1)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {VARIANTS}")
    ap.add_argument(
        "--count-tasks", type=int, default=300, help="tasks of the MONITOR run (300; 0: none)"
    )
    ap.add_argument("--concurrency", type=int, default=2, help="worker processes (2)")
    ap.add_argument("--prefetch", type=int, default=4, help="worker_prefetch_multiplier (4)")
    ap.add_argument("--timeout", type=float, default=240.0, help="per run (240 s)")
    ap.add_argument(
        "--time-scripts",
        action="store_true",
        help="one more LockedTask run timing its script calls and its body's INCR in the pool "
        "processes (wall clock, call to reply; two INCRBY per task more, in that run only)",
    )
    ap.add_argument("--log-level", default="warning", help="worker log level (warning)")
    ap.add_argument("--no-json", action="store_true", help="do not write pertask.json")
    args = ap.parse_args(argv)
    if args.tasks < 1 or args.warm < 1 or args.repeat < 1:
        ap.error("--tasks, --warm and --repeat must be >= 1")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = monotonic()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variant_list}
    counted: dict[str, dict[str, Any]] = {}
    timed_run: dict[str, Any] | None = None
    with RedisServer() as server:
        url = server.url
        os.environ.update({"PERTASK_URL": url, "PERTASK_PREFIX": f"pt:{secrets.token_hex(3)}:"})
        from bench import _pertask_app as pa  # reads PERTASK_* at import: after the server

        store = server.client()
        version = store.info("server")["redis_version"]
        log(f"private redis-server {version} at {url} (pid {server.pid})")
        try:
            for _rep in range(args.repeat):
                for variant in args.variant_list:
                    runs[variant].append(run_variant(variant, url, server.pid, store, pa, args))
            if args.time_scripts and "locked" in args.variant_list:
                log("  timed run: the pool processes' wall time in lock scripts")
                timed_run = run_variant("locked", url, server.pid, store, pa, args, timed=True)
            if args.count_tasks:
                log(f"  counting run under MONITOR ({args.count_tasks} tasks each)")
                for variant in args.variant_list:
                    counted[variant] = run_variant(
                        variant, url, server.pid, store, pa, args, args.count_tasks, monitored=True
                    )
        finally:
            pa.app.close()
            store.close()

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    def cpu_med(variant: str, part: str) -> float:
        return statistics.median(r["cpu_per_task"][part] for r in runs[variant])

    def kinds(variant: str) -> dict[str, float]:
        names = {k for r in runs[variant] for k in r["per_kind"]}
        return {
            k: statistics.median(r["per_kind"].get(k, 0.0) for r in runs[variant]) for k in names
        }

    per = {v: kinds(v) for v in args.variant_list}
    names = sorted(
        {k for v in per for k in per[v]}, key=lambda k: -max(p.get(k, 0) for p in per.values())
    )
    width = 14
    lines = [
        "",
        f"Per-task cost: {args.tasks} tasks each on its own key, prefork x{args.concurrency}, "
        f"prefetch multiplier {args.prefetch}, acks_late; broker + locks on one private "
        f"redis-server {version}; {os.cpu_count()} CPUs; "
        + (f"median of {args.repeat} runs" if args.repeat > 1 else "1 run"),
        "",
        f"{'':34}" + "".join(f"{LABELS[v]:>{width}}" for v in args.variant_list),
        f"  {'tasks per second':32}"
        + "".join(f"{med(v, 'tasks_per_s'):>{width}.0f}" for v in args.variant_list),
        f"  {'Redis commands per task':32}"
        + "".join(f"{med(v, 'per_task'):>{width}.2f}" for v in args.variant_list),
        f"  {'tasks run (of published)':32}"
        + "".join(
            f"{r['ran']}/{r['expected']}".rjust(width)
            for r in (runs[v][-1] for v in args.variant_list)
        ),
    ]
    if all(r["cpu_per_task"] for v in args.variant_list for r in runs[v]):
        for part, title in (
            ("main", "CPU us/task: worker main process"),
            ("pool", "CPU us/task: pool processes"),
            ("redis", "CPU us/task: redis-server"),
        ):
            lines.append(
                f"  {title:32}"
                + "".join(f"{cpu_med(v, part) * 1e6:>{width}.0f}" for v in args.variant_list)
            )
    lines.append("  by kind (per task):")
    for name in names:
        lines.append(
            f"    {name:30}"
            + "".join(f"{per[v].get(name, 0.0):>{width}.2f}" for v in args.variant_list)
        )
    if counted:
        lines += [
            "",
            f"Under MONITOR ({args.count_tasks} tasks): per task, what clients sent (each one "
            "round trip unless pipelined) and what scripts ran",
        ]
        for part, title in (("sent", "sent by clients"), ("scripted", "run inside scripts")):
            keys = sorted(
                {k for c in counted.values() for k in c[part]},
                key=lambda k: (-max(c[part].get(k, 0.0) for c in counted.values()), k),
            )
            total = "".join(f"{sum(counted[v][part].values()):>{width}.2f}" for v in counted)
            lines.append(f"  {title:32}" + total)
            for k in keys:
                lines.append(
                    f"    {k:30}"
                    + "".join(f"{counted[v][part].get(k, 0.0):>{width}.2f}" for v in counted)
                )
    lines += ["", "Ratios:"]
    if "nolock" in per and "locked" in per:
        lines.append(
            f"  throughput LockedTask / plain task = "
            f"{med('locked', 'tasks_per_s') / med('nolock', 'tasks_per_s'):.2f}   (target >= 0.95)"
        )
        if args.repeat > 1:  # each run's pair (run one after the other): the machine drifts
            pairs = [
                locked["tasks_per_s"] / plain["tasks_per_s"]
                for plain, locked in zip(runs["nolock"], runs["locked"])
            ]
            lines.append(
                "    within each run's pair: "
                + ", ".join(f"{ratio:.2f}" for ratio in pairs)
                + f" (median {statistics.median(pairs):.2f})"
            )
        if all(r["cpu_per_task"] for v in ("nolock", "locked") for r in runs[v]):
            added_cpu = {p: cpu_med("locked", p) - cpu_med("nolock", p) for p in CPU_PARTS}
            lines.append(
                "  CPU the lock adds per task: "
                + ", ".join(f"{p} {d * 1e6:+.0f} us" for p, d in added_cpu.items())
                + f" (total {sum(added_cpu.values()) * 1e6:+.0f} us; the main process's "
                "includes its event loop's own cost over a longer run)"
            )
        if timed_run is not None:
            # A fair prefork pool hands a process its next task only when it is free: each
            # process's cycle (concurrency / throughput) is its CPU plus what it waits for.
            cycle = {
                v: args.concurrency / med(v, "tasks_per_s") * 1e6 for v in ("nolock", "locked")
            }
            lines.append(
                f"  a pool process's cycle per task: plain {cycle['nolock']:.0f} us, LockedTask "
                f"{cycle['locked']:.0f} us ({cycle['locked'] - cycle['nolock']:+.0f} us); in "
                f"the timed run (its own, {timed_run['tasks_per_s']:.0f} tasks/s), the lock's "
                f"script calls took {timed_run['script_wall_per_task'] * 1e6:.0f} us of wall "
                "time per task, call to reply (two calls), and the body's one INCR "
                f"{timed_run['incr_wall_per_task'] * 1e6:.0f} us"
            )
        extra = med("locked", "per_task") - med("nolock", "per_task")
        lines.append(f"  Redis commands the lock adds per task = {extra:.2f}")
        added = {k: per["locked"].get(k, 0.0) - per["nolock"].get(k, 0.0) for k in names}
        lines.append(
            "    by kind: "
            + ", ".join(
                f"{k} {d:+.2f}"
                for k, d in sorted(added.items(), key=lambda kv: -abs(kv[1]))
                if abs(d) >= 0.005
            )
        )
    lines.append(f"  total run time {monotonic() - started:.0f}s")
    print("\n".join(lines))
    if not args.no_json:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "pertask.json").write_text(
            json.dumps(
                {"args": vars(args), "runs": runs, "counted": counted, "timed": timed_run}, indent=1
            )
        )
        print("  results: bench/results/pertask.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
