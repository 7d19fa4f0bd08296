"""Account settlement with a real prefork Celery worker: no lock, three usual locks, LockedTask.

    .venv/bin/python -m bench.celery_settlement              # ~2-3 minutes on 2 cores
    .venv/bin/python -m bench.celery_settlement --repeat 3   # medians of 3 runs

Every task does a 20 ms non-atomic read-modify-write of an account balance (GET, sleep,
SET +1) and logs its section. Variants (columns): a. no lock; b. the Celery cookbook
recipe (non-blocking redis-py lock, ``self.retry(countdown=1)`` when held); c. a blocking
redis-py lock in the task; d. a blocking python-redis-lock in the task; e. ``LockedTask``
(requeue mode, default settings); f. ``LockedTask`` with ``lock_run_on=5`` (a releasing
process runs the account's parked tasks itself; ``SETTLE_RUN_ON`` sets the seconds).
Workloads: W1 100 tasks over 4 accounts (seeded
random); W2 200 tasks, a quarter on one hot account, the rest each on its own account.

``--broker`` puts the broker elsewhere than the locks' Redis database (``otherdb``: the
same server's database 1; ``amqp``: RabbitMQ on 127.0.0.1:5672 when one answers, on
queues of the run's own, deleted after it); several comma-separated brokers run one
after the other. W2's hot account gives the hot-key chain efficiency: its 50 tasks'
work (50 x 20 ms) divided by the span from its first section's start to its last one's
end.

Prints one table (rows: metric per workload; columns: variants) and a targets block;
writes bench/results/settlement.json. One private redis-server on a free loopback port
(broker, locks and balances) is started and stopped here by pid; each variant gets a
fresh queue and its own worker (``celery -A bench._settlement_app worker -P prefork -c 4``),
started in its own process group, stopped with SIGTERM and then ``os.killpg`` SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict, deque
from pathlib import Path
from typing import Any

import redis

from celery_redislock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("nolock", "recipe", "redispy", "prl", "locked", "runon")
LABELS = {
    "nolock": "a. no lock",
    "recipe": "b. recipe",
    "redispy": "c. redis-py",
    "prl": "d. prl",
    "locked": "e. LockedTask",
    "runon": "f. run on",
}
#: Every workload this benchmark knows; ``--workloads`` picks (``WORKLOADS``: this run's).
ALL_WORKLOADS = ("W1", "W2", "W3")
WORKLOADS: tuple[str, ...] = ("W1", "W2")
BROKERS = ("same", "otherdb", "amqp")
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
monotonic = time.monotonic


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- workloads


def workload(name: str, seed: int) -> list[str]:
    """The account (suffix) of each task, in publish order."""
    rng = random.Random(f"{seed}:{name}")
    if name == "W1":
        return [f"acct{rng.randrange(4)}" for _ in range(100)]
    if name == "W3":  # the speed issue's settlement: 120 over 6 accounts (20 each)
        accounts = [f"acct{i % 6}" for i in range(120)]
        rng.shuffle(accounts)
        return accounts
    hot = ["hot"] * 50
    own = [f"own{i}" for i in range(150)]
    tasks = hot + own
    rng.shuffle(tasks)
    return tasks


def ideal_of(accounts: list[str], work: float, concurrency: int) -> float:
    hottest = Counter(accounts).most_common(1)[0][1]
    return max(hottest * work, len(accounts) * work / concurrency)


def package_origin(module: Any) -> str:
    """Where the package under test comes from, without naming this machine's paths."""
    here = Path(module.__file__).resolve().parent
    return "this checkout" if here.parent == ROOT else "an installed copy"


def perfect_lock_bound(
    accounts: list[str],
    work: float,
    cost: float,
    concurrency: int,
    lookahead: int = 0,
    *,
    handed_cost: float | None = None,
) -> float:
    """Makespan of a *perfect* per-account lock on this queue order (computed, not run).

    The model: ``concurrency`` slots take messages in publish order (FIFO, as the
    worker fetches them); every task costs ``work`` plus ``cost`` (Celery's own per-task
    cost, measured by the no-lock run); a message whose account is locked is parked at
    no cost, and the slot that frees its lock runs it next, at once (zero hand-over
    time). Without ``lookahead`` no lock can do better on a FIFO queue: a task cannot
    start before a slot has fetched it, however early its account's lock is free. With
    ``lookahead`` (LockedTask's), a task started with nothing parked behind its lock
    takes its account's oldest message among the next ``lookahead`` still queued out of
    the queue, to run at its release, if no other account's chain of such moves is
    going on (one account at a time, as LockedTask does). ``handed_cost``: what a task
    handed its lock costs instead of ``cost`` (0: run on at once by the releasing slot).
    """
    return _perfect_lock(accounts, work, cost, concurrency, lookahead, handed_cost)[0]


def perfect_hot_efficiency(
    accounts: list[str], work: float, cost: float, concurrency: int, lookahead: int = 0
) -> float:
    """The hot account's efficiency (its work / its span) under :func:`perfect_lock_bound`'s
    model with free hand-overs: the most a lock can reach on this queue order."""
    return _perfect_lock(accounts, work, cost, concurrency, lookahead, 0.0)[1]


def _perfect_lock(
    accounts: list[str],
    work: float,
    cost: float,
    concurrency: int,
    lookahead: int,
    handed_cost: float | None,
) -> tuple[float, float]:
    queue = deque(accounts)
    parked: dict[str, int] = Counter()
    lock_until: dict[str, float] = {}
    slots = [(0.0, i) for i in range(concurrency)]
    chain = ""  # the account whose next messages are being moved ahead
    end = 0.0
    hot = Counter(accounts).most_common(1)[0][0] if accounts else ""
    hot_starts: list[float] = []
    hot_end = 0.0
    while queue or any(parked.values()):
        now, slot = heapq.heappop(slots)
        ready = [(lock_until[a], a) for a, n in parked.items() if n and lock_until[a] <= now]
        this_cost = cost
        if ready:
            account = min(ready)[1]
            parked[account] -= 1
            this_cost = cost if handed_cost is None else handed_cost
        else:
            account = ""
            while queue:
                candidate = queue.popleft()
                if lock_until.get(candidate, 0.0) > now:
                    parked[candidate] += 1  # parked: the slot takes the next message
                    continue
                account = candidate
                break
            if not account:  # only parked tasks left: this slot idles until a release
                waits = [lock_until[a] for a, n in parked.items() if n]
                heapq.heappush(slots, (max(now, min(waits)), slot))
                continue
        finish = now + this_cost + work
        lock_until[account] = finish
        end = max(end, finish)
        if account == hot:
            hot_starts.append(now + this_cost)
            hot_end = max(hot_end, finish)
        heapq.heappush(slots, (finish, slot))
        if lookahead and not parked[account] and chain in ("", account):
            chain = ""
            for i, candidate in enumerate(itertools.islice(queue, lookahead)):
                if candidate == account:
                    del queue[i]
                    parked[account] += 1
                    chain = account
                    break
    span = hot_end - min(hot_starts) if hot_starts else 0.0
    return end, (len(hot_starts) * work / span if span > 0 else 0.0)


# --------------------------------------------------------------------------- the worker


class Worker:
    """``celery worker`` for one variant on its own queue; its own session, killed by pgid.
    The other Celery benchmarks start theirs with it too (``app``, ``queue``, ``tag``)."""

    def __init__(
        self,
        variant: str,
        env: dict[str, str],
        args: argparse.Namespace,
        *,
        app: str = "bench._settlement_app",
        queue: str | None = None,
        tag: str = "settle",
    ) -> None:
        self.variant = variant
        self.log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix=f"{tag}-{variant}-", suffix=".log", delete=False
        )
        queue = queue or env["SETTLE_QUEUE"]
        command = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "-P", "prefork", "-c", str(args.concurrency),
            "-Q", queue, "-n", f"{tag}-{variant}-{secrets.token_hex(3)}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", args.log_level,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: os.killpg reaches the children
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def text(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def stop(self, keep_log: Path | None = None) -> None:
        proc = self.process
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # children left by the main process
            os.killpg(proc.pid, signal.SIGKILL)
        self.log_file.close()
        if keep_log is not None:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            keep_log.write_text(self.text())
        os.unlink(self.log_file.name)


# --------------------------------------------------------------------------- one run


def publish(
    task: Any, run: str, accounts: list[str], queue: str, broker: str
) -> tuple[float, float]:
    """Publish every task through one producer: (first publish's time, last one's end)."""
    app = task.app
    first = 0.0
    with app.connection_for_write(broker) as conn:
        producer = app.amqp.Producer(conn)
        for i, account in enumerate(accounts):
            if i == 0:
                first = monotonic()
            task.apply_async((run, f"{run}:{account}"), queue=queue, producer=producer)
    return first, monotonic()


def broker_url(broker: str, url: str) -> str:
    """The broker URL of a ``--broker`` choice, the locks being on ``url`` (database 0)."""
    if broker == "same":
        return url
    if broker == "otherdb":
        return url.rsplit("/", 1)[0] + "/1"
    return AMQP_URL


def amqp_reachable() -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5672), 1):
        return True
    return False


def delete_queues(broker: str, names: list[str]) -> None:
    """Delete the run's own queues (and, on RabbitMQ, their exchanges) from the broker."""
    if not broker.startswith("amqp"):
        client = redis.Redis.from_url(broker)
        client.delete(*names)
        client.close()
        return
    from kombu import Connection

    with Connection(broker, connect_timeout=5) as conn:
        for name in names:
            for delete in (conn.default_channel.queue_delete, conn.default_channel.exchange_delete):
                try:
                    delete(name)
                except Exception:  # absent: a fresh channel for the next name
                    conn.release()
                    conn.connect()


def wait_done(
    store: redis.Redis, sa: Any, run: str, n: int, worker: Worker, timeout: float
) -> bool:
    deadline = monotonic() + timeout
    while monotonic() < deadline:
        if int(store.get(sa.done_key(run)) or 0) >= n:
            return True
        if not worker.alive():
            raise SystemExit(f"the {worker.variant} worker exited:\n{worker.text()[-3000:]}")
        time.sleep(0.02)
    return False


def analyse(
    store: redis.Redis,
    sa: Any,
    run: str,
    accounts: list[str],
    t0: float,
    work: float,
    concurrency: int,
    complete: bool,
) -> dict[str, Any]:
    sections: dict[str, list[tuple[float, float]]] = defaultdict(list)
    by_pid: dict[str, list[tuple[float, float]]] = defaultdict(list)
    pid_of: dict[tuple[str, float], str] = {}
    for raw in store.lrange(sa.log_key(run), 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        name, entered, left, pid = text.split("|")
        sections[name.split(":", 1)[1]].append((float(entered), float(left)))
        by_pid[pid].append((float(entered), float(left)))
        pid_of[(name.split(":", 1)[1], float(entered))] = pid
    # A pool process's time between its sections: Celery's per-task cost, plus any wait
    # for a task it could run (and, with a lock, the lock's own cost).
    slot_gaps = [
        nxt[0] - cur[1]
        for secs in by_pid.values()
        for cur, nxt in zip(sorted(secs), sorted(secs)[1:])
    ]
    expected = Counter(accounts)
    lost = 0
    extra = 0
    for account, count in expected.items():
        actual = int(store.get(sa.balance_key(f"{run}:{account}")) or 0)
        lost += max(0, count - actual)
        extra += max(0, actual - count)
    overlaps = 0
    gaps: list[float] = []
    for secs in sections.values():
        secs.sort()
        for i, (_enter, leave) in enumerate(secs):
            j = i + 1
            while j < len(secs) and secs[j][0] < leave:
                overlaps += 1
                j += 1
            if i + 1 < len(secs) and secs[i + 1][0] >= leave:
                gaps.append(secs[i + 1][0] - leave)
    leaves = [leave for secs in sections.values() for _e, leave in secs]
    unrelated = [leave for a, secs in sections.items() if a.startswith("own") for _e, leave in secs]
    hot = max(expected, key=lambda a: expected[a])
    hot_secs = sections.get(hot, [])
    hot_pids = [pid_of[(hot, enter)] for enter, _leave in sorted(hot_secs)]
    makespan = (max(leaves) - t0) if complete and leaves else None
    ideal = ideal_of(accounts, work, concurrency)
    return {
        "tasks": len(accounts),
        "completed": sum(len(s) for s in sections.values()),
        "complete": complete,
        "makespan": makespan,
        "ideal": ideal,
        "ratio": None if makespan is None else makespan / ideal,
        "lost": lost,
        "extra": extra,
        "overlaps": overlaps,
        "gap_p50_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "slot_gap_p50_ms": statistics.median(slot_gaps) * 1e3 if slot_gaps else None,
        "slot_gap_mean_ms": statistics.fmean(slot_gaps) * 1e3 if slot_gaps else None,
        "gap_p90_ms": (statistics.quantiles(gaps, n=10)[-1] * 1e3 if len(gaps) >= 2 else None),
        "hot_first_enter": (hot_secs[0][0] - t0) if hot_secs else None,
        "hot_span": (hot_secs[-1][1] - hot_secs[0][0]) if hot_secs else None,
        # the hot-key chain efficiency: the hot account's work over its span (1.0: back to back)
        "hot_efficiency": (
            expected[hot] * work / (hot_secs[-1][1] - hot_secs[0][0])
            if complete and len(hot_secs) == expected[hot] and expected[hot] > 1
            else None
        ),
        "unrelated_done": (max(unrelated) - t0) if unrelated and complete else None,
        # the hot account's sections as measured (GET, the sleep, SET: more than the work)
        "hot_section_ms": (
            statistics.fmean(leave - enter for enter, leave in hot_secs) * 1e3 if hot_secs else None
        ),
        # the share of its span its sections took: the efficiency with the hand-overs' gaps
        # alone counted against it (not the sections' own Redis calls and sleep overshoot)
        "hot_busy": (
            sum(leave - enter for enter, leave in hot_secs) / (hot_secs[-1][1] - hot_secs[0][0])
            if complete and len(hot_secs) == expected[hot] and expected[hot] > 1
            else None
        ),
        # of the hot account's hand-overs, the share whose next section ran in the same
        # pool process (run on, or that process's next task by chance)
        "hot_same_process": (
            100.0 * sum(a == b for a, b in zip(hot_pids, hot_pids[1:])) / (len(hot_pids) - 1)
            if len(hot_pids) > 1
            else None
        ),
        # the hot account's sections, from its first one's start (s): the timeline plot
        HOT_SECTIONS: [(e - hot_secs[0][0], leave - hot_secs[0][0]) for e, leave in hot_secs],
    }


def run_variant(
    variant: str,
    url: str,
    store: redis.Redis,
    sa: Any,
    args: argparse.Namespace,
    repeat: int,
    broker: str,
) -> dict[str, Any]:
    token = secrets.token_hex(3)
    queue = f"settle-{variant}-{token}"
    env = {
        **os.environ,
        "SETTLE_URL": url,
        "SETTLE_BROKER": broker,
        "SETTLE_PREFIX": sa.PREFIX,
        "SETTLE_QUEUE": queue,
        "SETTLE_WORK": str(args.work),
        "SETTLE_PREFETCH": str(args.prefetch),
        "SETTLE_LOOKAHEAD": "" if args.lookahead is None else str(args.lookahead),
        "SETTLE_TASKS": variant,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    parts_file = None
    if args.parts and variant in ("locked", "runon") and "W2" in WORKLOADS:
        parts_file = Path(tempfile.mkdtemp(prefix="settle-parts-")) / "events"
        env["SETTLE_PARTS"] = str(parts_file)
    task = sa.TASKS[variant]
    worker = Worker(variant, env, args)
    out: dict[str, Any] = {}
    try:
        # Warm-up (also the readiness check): every child imports, connects and loads its
        # scripts; a contended group loads the contended paths (park/hand-over, waits).
        run = f"{token}-warm"
        warm = [f"w{i}" for i in range(2 * args.concurrency)] + ["wc"] * (2 * args.concurrency)
        publish(task, run, warm, queue, broker)
        if not wait_done(store, sa, run, len(warm), worker, args.start_timeout):
            raise SystemExit(
                f"{variant}: warm-up not done in {args.start_timeout}s:\n{worker.text()[-3000:]}"
            )
        time.sleep(0.3)
        for name in WORKLOADS:
            accounts = workload(name, args.seed)
            run = f"{token}-{name}"
            parked0 = int(store.get(sa.parked_key()) or 0)
            t0, t_published = publish(task, run, accounts, queue, broker)
            complete = wait_done(store, sa, run, len(accounts), worker, args.timeout)
            time.sleep(0.05)
            res = analyse(store, sa, run, accounts, t0, args.work, args.concurrency, complete)
            res["publish_s"] = t_published - t0
            res["parked"] = int(store.get(sa.parked_key()) or 0) - parked0
            res["retries"] = int(store.get(sa.retries_key(run)) or 0)
            out[name] = res
            ratio = "timeout" if res["ratio"] is None else f"{res['ratio']:.2f}x"
            log(
                f"  [{repeat + 1}] {LABELS[variant]:14s} {name}: "
                f"{res['completed']}/{len(accounts)} done, makespan/ideal {ratio}, "
                f"lost {res['lost']}, overlaps {res['overlaps']}, "
                f"parked {res['parked']}, retries {res['retries']}"
            )
            if not complete:
                log(f"  {variant} {name} did not finish within {args.timeout}s; skipping the rest")
                break
            time.sleep(0.3)
    finally:
        keep = None
        if args.keep_logs:
            keep = Path(args.keep_logs) / f"{variant}-r{repeat + 1}.log"
        worker.stop(keep)
        if parts_file is not None:
            print_parts(parts_file, f"{token}-W2:hot", variant, broker, repeat)
        names = [queue, f"{queue}.redislock"]
        # (LockedTask's fallback copies' queue)
        if variant in ("locked", "runon") and broker.startswith("amqp"):
            from celery_redislock.celery.contention import DELAY_QUEUE_PREFIX, _delay_ms

            delay = _delay_ms(task._fallback_delay(task.lock_options()))
            names.append(f"{DELAY_QUEUE_PREFIX}{delay}.{queue}")
        delete_queues(broker, names)
    return out


def print_parts(path: Path, hot: str, variant: str, broker: str, repeat: int) -> None:
    """``--parts``: the hot account's hand-overs, step by step, by kind."""
    from bench import _handover_parts as hp

    try:
        found, counts = hp.parts(path, hot) if path.exists() else ({}, {})
        tails = hp.parts(path, hot, 0.9)[0] if path.exists() else {}
    except Exception as exc:  # (a measurement's report: the run and its clean-up go on)
        log(
            f"  [{repeat + 1}] {LABELS[variant]} W2: the hand-over parts could not be read: {exc!r}"
        )
        return
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    where = broker.split("@")[-1]
    for kind, steps in hp.KINDS.items():
        medians = found.get(kind)
        if not medians:
            continue
        log(
            f"  [{repeat + 1}] {LABELS[variant]} W2: a hand-over {kind}, part by part "
            f"({int(medians['hand-overs'])} of them, ms, median and p90; broker {where}):"
        )
        tail = tails.get(kind, {})
        for label, what in steps:
            if label in medians:  # (a step not recorded in this run: left out)
                p90 = tail.get(label, math.nan)
                log(f"      {label:38s} {medians[label]:6.2f} {p90:6.2f}   {what}")
    left = ", ".join(f"{why} {n}" for why, n in counts.items() if n)
    if left:
        log(f"  [{repeat + 1}] {LABELS[variant]} W2: gaps left out of the parts: {left}")


# --------------------------------------------------------------------------- report


def median_of(runs: list[dict[str, Any]], variant: str, wl: str, key: str) -> Any:
    values = [r[variant][wl][key] for r in runs if wl in r.get(variant, {})]
    values = [v for v in values if v is not None]
    if not values:
        return None
    if isinstance(values[0], bool):
        return all(values)
    return statistics.median(values)


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec)


def build_table(med: dict[str, dict[str, dict[str, Any]]], variants: list[str]) -> list[str]:
    width = 14
    lines = [f"{'':38}" + "".join(f"{LABELS[v]:>{width}}" for v in variants)]
    rows = [
        ("makespan (s)", "makespan", ".2f", ""),
        ("ideal (s)", "ideal", ".2f", ""),
        ("makespan / ideal", "ratio", ".2f", "x"),
        ("lost updates", "lost", ".0f", ""),
        ("overlapping sections", "overlaps", ".0f", ""),
        ("parked (e) / retries (b)", None, ".0f", ""),
        ("same-account gap p50 (ms)", "gap_p50_ms", ".1f", ""),
        ("same-account gap p90 (ms)", "gap_p90_ms", ".1f", ""),
        ("a slot between sections p50 (ms)", "slot_gap_p50_ms", ".1f", ""),
        ("a slot between sections mean (ms)", "slot_gap_mean_ms", ".1f", ""),
    ]
    descriptions = {
        "W1": "W1 100 tasks / 4 accounts",
        "W2": "W2 200 tasks, 50 on a hot account",
        "W3": "W3 120 tasks / 6 accounts",
    }
    for wl in WORKLOADS:
        lines.append(descriptions[wl])
        wl_rows = list(rows)
        if wl == "W2":
            wl_rows.append(("last unrelated task done (s)", "unrelated_done", ".2f", ""))
            wl_rows.append(("hot key: 50 x work / its span", "hot_efficiency", ".2f", ""))
            wl_rows.append(("hot key: its sections / its span", "hot_busy", ".2f", ""))
            wl_rows.append(("hot key: a section as measured (ms)", "hot_section_ms", ".1f", ""))
            wl_rows.append(("hot key: next in the same process %", "hot_same_process", ".0f", ""))
        for label, key, spec, suffix in wl_rows:
            cells = []
            for v in variants:
                m = med.get(v, {}).get(wl)
                if m is None:
                    cells.append("n/a")
                    continue
                if key is None:
                    value = (
                        m["parked"]
                        if v in ("locked", "runon")
                        else m["retries"]
                        if v == "recipe"
                        else None
                    )
                    cells.append(fmt(value, spec))
                elif key in ("makespan", "ratio") and not m["complete"]:
                    cells.append("timeout")
                else:
                    text = "-" if v == "nolock" and key.startswith("gap") else fmt(m[key], spec)
                    cells.append(text + suffix if text != "-" else text)
            lines.append(f"  {label:36}" + "".join(f"{c:>{width}}" for c in cells))
    return lines


def target_lines(med: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    def ratio(v: str, wl: str) -> str:
        m = med.get(v, {}).get(wl)
        if m is None:
            return "n/a"
        return "timeout" if m["ratio"] is None else f"{m['ratio']:.2f}x"

    lines = []
    for wl in WORKLOADS:
        m = med.get("locked", {}).get(wl)
        verdict = ""
        if m is not None and m["ratio"] is not None:
            verdict = "  (met)" if m["ratio"] <= 1.2 else "  (NOT met)"
        lines.append(
            f"LockedTask makespan/ideal {wl}: {ratio('locked', wl)}   target <= 1.20x{verdict}"
        )
    for wl in WORKLOADS:
        lines.append(
            f"for comparison {wl}: recipe {ratio('recipe', wl)}, redis-py blocking "
            f"{ratio('redispy', wl)}, python-redis-lock blocking {ratio('prl', wl)}"
        )
    lines.append(
        "floor (no lock; Celery's own per-task overhead here): "
        + ", ".join(f"{wl} {ratio('nolock', wl)}" for wl in WORKLOADS)
    )
    for variant, label in (("locked", "LockedTask"), ("runon", "LockedTask run on")):
        against = []
        for wl in WORKLOADS:
            locked = med.get(variant, {}).get(wl, {}).get("makespan")
            plain = med.get("nolock", {}).get(wl, {}).get("makespan")
            if locked and plain:
                against.append(f"{wl} {locked / plain:.2f}x")
        if against:
            lines.append(
                f"{label} makespan / the same workload without a lock: "
                + ", ".join(against)
                + "   (W3 target <= 1.05x)"
            )
    bounds, ahead, hot = [], [], []
    lookahead = 64 if args.lookahead is None else args.lookahead
    for wl in WORKLOADS:
        m = med.get("nolock", {}).get(wl)
        if m is None or m["makespan"] is None:
            continue
        accounts = workload(wl, args.seed)
        # Celery's per-task cost here, from the no-lock run (FIFO, every slot always busy).
        cost = max(0.0, m["makespan"] * args.concurrency / len(accounts) - args.work)
        bound = perfect_lock_bound(accounts, args.work, cost, args.concurrency)
        ideal = ideal_of(accounts, args.work, args.concurrency)
        bounds.append(f"{wl} {bound / ideal:.2f}x ({cost * 1e3:.1f} ms per task)")
        if lookahead:
            bound = perfect_lock_bound(accounts, args.work, cost, args.concurrency, lookahead)
            ahead.append(f"{wl} {bound / ideal:.2f}x")
        if wl == "W2":
            plain = perfect_hot_efficiency(accounts, args.work, cost, args.concurrency)
            looked = perfect_hot_efficiency(accounts, args.work, cost, args.concurrency, 64)
            hot.append(f"{wl} {plain:.2f} without look-ahead, {looked:.2f} with")
    if bounds:
        lines.append(
            "perfect lock on this queue order (computed: FIFO fetch, the no-lock run's "
            "per-task cost, zero hand-over time): " + ", ".join(bounds)
        )
    if ahead:
        lines.append(
            f"  the same with LockedTask's look-ahead of {lookahead} messages: " + ", ".join(ahead)
        )
    if hot:
        lines.append(
            "hot key efficiency of a perfect lock on this queue order (computed: hand-overs "
            "free, every other task the no-lock run's cost): " + ", ".join(hot)
        )
    return lines


#: The key of a workload's result holding the hot account's sections (not a median).
HOT_SECTIONS = "hot_sections"


def plot_hot_key(
    timelines: dict[str, list[tuple[float, float]]],
    meds: dict[str, Any],
    work: float,
    path: Path,
) -> bool:
    """The hot account's sections of W2 (first run), one row per broker: each bar a task's
    section, each white gap a hand-over as the work sees it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return False
    labels = {"same": "broker in the locks' db", "otherdb": "broker in db 1", "amqp": "RabbitMQ"}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(timelines)))
    for row, (broker, sections) in enumerate(timelines.items()):
        bars = [(enter * 1e3, (leave - enter) * 1e3) for enter, leave in sections]
        ax.broken_barh(bars, (row - 0.35, 0.7), facecolors="tab:blue")
        eff = meds.get(broker, {}).get("locked", {}).get("W2", {}).get("hot_efficiency")
        end = sections[-1][1] * 1e3 if sections else 0.0
        note = f"efficiency {eff:.2f}" if eff is not None else ""
        ax.text(end + 10, row, note, va="center", fontsize=8)
    ax.set_yticks(range(len(timelines)), [labels.get(b, b) for b in timelines])
    ax.set_xlabel(
        f"ms since the hot account's first section (50 tasks x {work * 1e3:.0f} ms; "
        "gaps are hand-overs)"
    )
    ax.set_title("W2: the hot account's sections with LockedTask")
    ax.invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def publish_times(runs: list[dict[str, Any]]) -> str:
    parts = []
    for wl in WORKLOADS:
        values = [r[v][wl]["publish_s"] for r in runs for v in r if wl in r[v]]
        if values:
            parts.append(f"{wl} {statistics.median(values):.2f} s")
    return ", ".join(parts)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.celery_settlement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per variant; medians (1)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {VARIANTS}")
    ap.add_argument(
        "--workloads",
        default="W1,W2",
        help="comma list from W1 (100 tasks / 4 accounts), W2 (200, 50 on a hot account), "
        "W3 (120 / 6 accounts: with --concurrency 3 --work 0.03, the speed issue's); W1,W2",
    )
    ap.add_argument("--concurrency", type=int, default=4, help="worker processes (4)")
    ap.add_argument("--work", type=float, default=0.02, help="seconds per section (0.02)")
    ap.add_argument("--prefetch", type=int, default=1, help="worker_prefetch_multiplier (1)")
    ap.add_argument(
        "--lookahead", type=int, help="redislock_lookahead for LockedTask (package default)"
    )
    ap.add_argument(
        "--broker",
        default="same",
        help="comma list of same (the locks' database), otherdb (database 1), amqp "
        "(RabbitMQ on 127.0.0.1:5672); one run of every variant per broker (same)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240.0, help="per workload (240 s)")
    ap.add_argument("--start-timeout", type=float, default=60.0, help="worker start + warm-up")
    ap.add_argument("--log-level", default="warning", help="worker log level (warning)")
    ap.add_argument("--keep-logs", metavar="DIR", help="keep each worker's log in DIR")
    ap.add_argument(
        "--parts",
        action="store_true",
        help="time W2's hot-key hand-overs part by part inside the worker (LockedTask, run on)",
    )
    ap.add_argument("--no-json", action="store_true", help="do not write settlement.json")
    ap.add_argument("--no-plot", action="store_true", help="do not draw bench/results/hotkey.png")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.concurrency < 1 or args.work <= 0:
        ap.error("--repeat and --concurrency must be >= 1, --work > 0")
    args.broker_list = [b.strip() for b in args.broker.split(",") if b.strip()]
    if not args.broker_list or any(b not in BROKERS for b in args.broker_list):
        ap.error(f"--broker: a comma list of {BROKERS}")
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workload_list or any(w not in ALL_WORKLOADS for w in args.workload_list):
        raise SystemExit(f"--workloads: a comma list from {', '.join(ALL_WORKLOADS)}")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.parts and (
        "W2" not in args.workload_list or not {"locked", "runon"} & set(args.variant_list)
    ):
        ap.error(
            "--parts times W2's hot key: it needs W2 in --workloads, locked or runon in --variants"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    global WORKLOADS
    args = parse_args(argv)
    WORKLOADS = tuple(args.workload_list)
    started = monotonic()
    load_before = os.getloadavg()
    by_broker: dict[str, list[dict[str, Any]]] = {}
    with RedisServer() as server:
        url = server.url
        prefix = f"settle:{secrets.token_hex(3)}:"
        os.environ.update({"SETTLE_URL": url, "SETTLE_PREFIX": prefix})
        os.environ.pop("SETTLE_TASKS", None)
        from bench import _settlement_app as sa  # reads SETTLE_* at import: after the server

        store = server.client()
        version = store.info("server")["redis_version"]
        log(f"private redis-server {version} at {url} (pid {server.pid})")
        try:
            for broker in args.broker_list:
                if broker == "amqp" and not amqp_reachable():
                    log("  amqp: nothing answers on 127.0.0.1:5672; skipped")
                    continue
                log(f"broker: {broker} ({broker_url(broker, url).split('@')[-1]})")
                runs = by_broker.setdefault(broker, [])
                for rep in range(args.repeat):
                    results: dict[str, Any] = {}
                    for variant in args.variant_list:
                        results[variant] = run_variant(
                            variant, url, store, sa, args, rep, broker_url(broker, url)
                        )
                    runs.append(results)
        finally:
            sa.app.close()
            store.close()
    elapsed = monotonic() - started
    load_after = os.getloadavg()

    import celery

    import celery_redislock

    meds: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    where = {
        "same": "broker + locks in one database of one private redis-server",
        "otherdb": "locks in database 0, broker in database 1 of one private redis-server",
        "amqp": "locks on a private redis-server, broker RabbitMQ on 127.0.0.1:5672",
    }
    lines: list[str] = []
    for broker, runs in by_broker.items():
        med: dict[str, dict[str, dict[str, Any]]] = {}
        for v in args.variant_list:
            for wl in WORKLOADS:
                if not any(wl in r.get(v, {}) for r in runs):
                    continue
                keys = runs[0][v].get(wl, next(r[v][wl] for r in runs if wl in r[v])).keys()
                keys = [k for k in keys if k != HOT_SECTIONS]
                med.setdefault(v, {})[wl] = {k: median_of(runs, v, wl, k) for k in keys}
                med[v][wl]["complete"] = all(r[v][wl]["complete"] for r in runs if wl in r[v])
                if not med[v][wl]["complete"]:
                    med[v][wl]["ratio"] = med[v][wl]["makespan"] = None
        meds[broker] = med
        lines += [
            "",
            f"Celery settlement: prefork worker x{args.concurrency}, {args.work * 1e3:.0f} ms "
            f"read-modify-write per task, prefetch multiplier {args.prefetch}, acks_late; "
            f"{where[broker]} (redis-server {version}); {os.cpu_count()} CPUs, "
            f"Python {sys.version.split()[0]}, Celery {celery.__version__}, redis-py "
            f"{redis.__version__}; "
            + (f"median of {args.repeat} runs" if args.repeat > 1 else "1 run"),
            "",
            *build_table(med, args.variant_list),
            "",
            "Targets:",
            *("  " + x for x in target_lines(med, args)),
            f"  publishing took {publish_times(runs)} (median over variants; part of the makespan)",
        ]
    effs = [
        f"{broker} {fmt(m.get('locked', {}).get('W2', {}).get('hot_efficiency'), '.2f')}"
        + (
            f" (run on {fmt(m['runon']['W2'].get('hot_efficiency'), '.2f')})"
            if "W2" in m.get("runon", {})
            else ""
        )
        for broker, m in meds.items()
    ]
    floors = []
    for broker, m in meds.items():
        plain = m.get("nolock", {}).get("W2")
        if plain is None or plain.get("makespan") is None:
            continue
        # A hand-over costs at least one task's own Celery cost (the releasing slot's ack,
        # the next fetch, the dispatch): the no-lock run's, at best, between two sections.
        tasks = len(workload("W2", args.seed))
        cost = max(0.0, plain["makespan"] * args.concurrency / tasks - args.work)
        floors.append(f"{broker} {args.work / (args.work + cost):.2f} ({cost * 1e3:.1f} ms)")
    lines += [
        "",
        "Hot-key chain efficiency (W2, LockedTask: 50 x work / the hot account's span; "
        "targets >= 0.92 same database, >= 0.88 elsewhere): " + ", ".join(effs),
    ]
    if floors:
        lines.append(
            "  the most a chain through Celery can reach here: work / (work + Celery's own "
            "per-task cost, from the no-lock run): " + ", ".join(floors)
        )
    lines += [
        "",
        "Notes:",
        "  makespan = first publish -> last section's end; ideal = max(hottest account's tasks"
        f" x {args.work:g} s, tasks x {args.work:g} s / {args.concurrency})",
        f"  package: celery_redislock from {package_origin(celery_redislock)}; "
        "load average (1 min) "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (other jobs on the box add noise)",
        "  same-account gap = next section's start - previous section's end on one account "
        "(hand-over time as the work sees it; not shown without a lock, where sections overlap)",
        f"  total run time {elapsed:.0f}s",
    ]
    if not args.no_plot:
        timelines = {
            broker: runs[0]["locked"]["W2"][HOT_SECTIONS]
            for broker, runs in by_broker.items()
            if runs and "W2" in runs[0].get("locked", {})
        }
        if timelines and plot_hot_key(timelines, meds, args.work, RESULTS / "hotkey.png"):
            lines.append("  plot: bench/results/hotkey.png (the hot account's sections, W2)")
    print("\n".join(lines))
    first = next(iter(by_broker), "same")
    med = meds.get(first, {})
    runs = by_broker.get(first, [])
    if not args.no_json:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = {
            "elapsed_s": elapsed,
            "args": {
                k: v for k, v in vars(args).items() if k not in ("variant_list", "broker_list")
            },
            "variants": args.variant_list,
            "package": package_origin(celery_redislock),
            "loadavg": {"before": load_before, "after": load_after},
            "median": med,
            "runs": runs,
            "by_broker": {b: {"median": meds[b], "runs": by_broker[b]} for b in by_broker},
        }
        (RESULTS / "settlement.json").write_text(json.dumps(out, indent=1))
        print("  results: bench/results/settlement.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
