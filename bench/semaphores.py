"""Compare celery_redislock.RedisSemaphore with other Redis semaphores, in one run, on one
private server.

    .venv/bin/python -m bench.semaphores             # ~1-2 minutes on 2 cores
    .venv/bin/python -m bench.semaphores --scale 3   # longer runs, more samples

Columns (bench/_semlibs.py): ours; Dramatiq's ConcurrentRateLimiter (RedisBackend) and
Redis in Action's "fair semaphore" (a ZSET of holders + a counter, on plain redis-py), each
waiting by sleep-polling at 10 ms and at 1 ms; for the uncontended row also our mutex
RedisLock and the floor of two PING round trips.

Scenarios (see bench/README.md): 1 uncontended acquire+release pairs/s; 2 a hot key at
limit N (default 3) hammered by several processes holding each permit for a fixed time:
throughput against the floor N / section time, hand-off gap, wait, fairness, order of
service, Redis commands per acquisition, and the most holders seen at once (never above
N for a correct semaphore). Prints one table, ratios and notes; writes
bench/results/semaphores.json.

Only a private redis-server on a free loopback port is used (started and stopped here by
pid); every worker process is spawned here, bounded in time, joined with a timeout and
SIGKILLed by pid if it is still alive.
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock.testing import RedisServer

from . import _semworkers
from ._semlibs import LABELS, LIBS, POLL_MS, make
from .locks import commandstats, fmt, log, pct, reap

monotonic = time.monotonic
RESULTS = Path(__file__).resolve().parent / "results"
Record = tuple[float, float, float, float, int]  # attempt, acquired, release call, returned, pid


# --------------------------------------------------------------------------- scenario 1


def scenario_uncontended(
    client: redis.Redis, libs: list[str], limit: int, cycles: int
) -> dict[str, float]:
    """acquire+release pairs/s in one thread, no one else on the key; best of 3
    interleaved rounds."""
    order = [*libs, "mutex", "floor"]
    if "ours" in libs:
        order.append("ours_norenew")  # diagnostic: what handing the permit to the watchdog costs
    best: dict[str, float] = {}
    warm = max(50, cycles // 10)
    for _round in range(3):
        for lib in order:
            sem = make(lib, client, f"bench:sem:unc:{lib}", limit, 30.0)
            for _ in range(warm):
                assert sem.acquire(5.0)
                sem.release()
            t0 = time.perf_counter()
            for _ in range(cycles):
                sem.acquire(5.0)
                sem.release()
            rate = cycles / (time.perf_counter() - t0)
            best[lib] = max(best.get(lib, 0.0), rate)
            log(f"  uncontended {lib:14s} {rate:9.0f} pairs/s")
    return best


# --------------------------------------------------------------------------- scenario 2


def most_at_once(records: list[Record]) -> int:
    """The most sections [acquired, release call] open at once (an exit before an entry
    at the same instant). Each lies inside its real hold, so above N is a real breach."""
    changes = sorted([(r[1], 1) for r in records] + [(r[2], -1) for r in records])
    inside = peak = 0
    for _t, change in changes:
        inside += change
        peak = max(peak, inside)
    return peak


def handoff_gaps(records: list[Record], limit: int) -> tuple[list[float], int]:
    """Hand-off gaps and the number of hand-offs.

    With at most ``limit`` holders, the k-th acquisition (in time order, from 0) needs
    k - limit + 1 releases before it: it takes the permit the (k - limit)-th release call
    gave back. The gap is its acquire's return minus that release call, counted when the
    acquirer was already trying then (a waiter was there to take the permit)."""
    acquisitions = sorted(records, key=lambda r: r[1])
    releases = sorted(r[2] for r in records)
    gaps = []
    handoffs = 0
    for k in range(limit, len(acquisitions)):
        handoffs += 1
        freed = releases[k - limit]
        if acquisitions[k][0] < freed:
            gaps.append(acquisitions[k][1] - freed)
    return gaps, handoffs


#: Differences in arrival or service smaller than this are not counted as out of order.
ORDER_MARGIN = 0.005


def overtakes(records: list[Record], margin: float = ORDER_MARGIN) -> int:
    """Acquisitions served over ``margin`` before a waiter that had started trying over
    ``margin`` earlier (first come, first served would not). The margin keeps out what
    the client's clock cannot order: its attempt time is not the moment its request
    reached Redis, nor is its acquire's return the moment it was granted (waiters granted
    by releases a millisecond apart wake in either order on a busy machine)."""
    by_attempt = sorted(records)
    attempts = [r[0] for r in by_attempt]
    latest_served: list[float] = []  # prefix maximum of acquire times, by attempt time
    for r in by_attempt:
        latest_served.append(max(r[1], latest_served[-1] if latest_served else r[1]))
    count = 0
    for r in by_attempt:
        earlier = bisect.bisect_left(attempts, r[0] - margin)
        if earlier and latest_served[earlier - 1] > r[1] + margin:
            count += 1
    return count


def analyze_hot(
    outs: list[tuple[int, list[tuple[float, float, float, float]], int]],
    limit: int,
    t_start: float,
    duration: float,
    floor: float,
) -> dict[str, Any]:
    records: list[Record] = [(*r, pid) for pid, rs, _t in outs for r in rs]
    per_process = [len(rs) for _pid, rs, _t in outs]
    in_window = sum(1 for r in records if t_start <= r[1] <= t_start + duration)
    gaps, handoffs = handoff_gaps(records, limit)
    waits = [r[1] - r[0] for r in records]
    sections = [r[2] - r[1] for r in records]
    throughput = in_window / duration
    return {
        "acquisitions": len(records),
        "throughput": throughput,
        "of_floor": throughput / floor,
        "per_process": per_process,
        "fairness": min(per_process) / max(per_process) if max(per_process, default=0) else 0.0,
        "most_at_once": most_at_once(records),
        "gaps": gaps,
        "gap_median": pct(gaps, 0.5),
        "gap_p99": pct(gaps, 0.99),
        "waited_share": len(gaps) / handoffs if handoffs else float("nan"),
        "section_mean": sum(sections) / len(sections) if sections else float("nan"),
        "wait_median": pct(waits, 0.5),
        "wait_p99": pct(waits, 0.99),
        "wait_max": max(waits, default=float("nan")),
        "overtakes": overtakes(records) / len(records) if records else float("nan"),
        "timeouts": sum(t for _p, _r, t in outs),
    }


def scenario_hot(
    ctx: Any,
    url: str,
    probe: redis.Redis,
    libs: list[str],
    limit: int,
    procs: int,
    duration: float,
    hold: float,
    work: float,
) -> dict[str, Any]:
    floor = min(limit / hold, procs / (hold + work))
    results: dict[str, Any] = {}
    for lib in libs:
        name = f"bench:sem:hot:{lib}"
        ready_q, out_q = ctx.Queue(), ctx.Queue()
        go = ctx.Event()
        start_at = ctx.Value("d", 0.0)
        workers = [
            ctx.Process(
                target=_semworkers.hot_worker,
                args=(lib, url, name, limit, hold, work, 30.0, duration, ready_q, go, start_at),
                kwargs={"out_q": out_q},
                daemon=True,
            )
            for _ in range(procs)
        ]
        outs = []
        try:
            for w in workers:
                w.start()
            for _ in workers:
                ready_q.get(timeout=60)
            before = commandstats(probe)
            start_at.value = monotonic() + 0.2
            go.set()
            for _ in workers:
                outs.append(out_q.get(timeout=duration + 90))
            after = commandstats(probe)
        finally:
            killed = reap(workers)
        errors = [o for o in outs if o[1] == "error"]
        if errors:
            raise RuntimeError(f"hot-key worker failed ({lib}):\n{errors[0][2]}")
        res = analyze_hot(outs, limit, start_at.value, duration, floor)
        commands = sum(
            calls - before.get(k, 0) for k, calls in after.items() if k != "cmdstat_info"
        )
        res["commands_per_acquisition"] = commands / max(1, res["acquisitions"])
        res["killed"] = killed
        results[lib] = res
        log(
            f"  hot key {lib:14s} {res['throughput']:6.1f} acq/s ({res['of_floor']:.2f} of "
            f"floor)  gap median {res['gap_median'] * 1e3:6.2f} ms p99 "
            f"{res['gap_p99'] * 1e3:7.2f} ms  at once {res['most_at_once']}  "
            f"per-process {res['per_process']}"
        )
    return results


# --------------------------------------------------------------------------- report


def build_table(cols: list[str], r: dict[str, Any], limit: int) -> list[str]:
    rows: list[tuple[str, dict[str, str]]] = []

    def row(label: str, getter: Any) -> None:
        rows.append((label, {c: getter(c) for c in cols}))

    unc = r.get("uncontended", {})
    hot = r.get("hot", {})
    if unc:
        row("1 uncontended acquire+release /s", lambda c: fmt(unc.get(c, "-"), ".0f"))
        row(
            "1 us per acquire+release",
            lambda c: fmt(1e6 / unc[c], ".0f") if c in unc else "-",
        )
    if hot:

        def hget(key: str, spec: str, scale: float = 1.0) -> Any:
            return lambda c: fmt(hot[c][key] * scale, spec) if c in hot else "-"

        row("2 hot key throughput acq/s", hget("throughput", ".1f"))
        row("2 throughput / floor (N / section)", hget("of_floor", ".2f"))
        row("2 section as measured, mean ms", hget("section_mean", ".2f", 1e3))
        row("2 hand-off gap median ms", hget("gap_median", ".2f", 1e3))
        row("2 hand-off gap p99 ms", hget("gap_p99", ".2f", 1e3))
        row("2 hand-offs to a waiter %", hget("waited_share", ".0f", 100))
        row("2 wait for a permit median ms", hget("wait_median", ".1f", 1e3))
        row("2 wait for a permit p99 ms", hget("wait_p99", ".1f", 1e3))
        row("2 wait for a permit max ms", hget("wait_max", ".1f", 1e3))
        row("2 fairness min/max per process", hget("fairness", ".2f"))
        row("2 served before an earlier waiter %", hget("overtakes", ".1f", 100))
        row("2 Redis commands per acquisition", hget("commands_per_acquisition", ".1f"))
        row(
            f"2 most holders at once (limit {limit})",
            lambda c: str(hot[c]["most_at_once"]) if c in hot else "-",
        )
        row("2 acquire timeouts", lambda c: str(hot[c]["timeouts"]) if c in hot else "-")
    width0 = max(len(label) for label, _ in rows) + 2
    widths = [max(len(LABELS[c]), *(len(v[c]) for _, v in rows)) + 2 for c in cols]
    lines = ["".ljust(width0) + "".join(LABELS[c].rjust(w) for c, w in zip(cols, widths))]
    lines.append("-" * len(lines[0]))
    for label, values in rows:
        lines.append(
            label.ljust(width0) + "".join(values[c].rjust(w) for c, w in zip(cols, widths))
        )
    return lines


def ratio_lines(r: dict[str, Any], libs: list[str], limit: int, floor: float) -> list[str]:
    out = []
    unc = r.get("uncontended", {})
    if unc:
        if "ours" in unc:
            out.append(
                f"uncontended  RedisSemaphore pair / RedisLock pair  = "
                f"{unc['mutex'] / unc['ours']:.2f}x the time"
            )
        for lib in libs:
            out.append(
                f"uncontended  {LABELS[lib]:20s} / floor (2 PING) = "
                f"{unc['floor'] / unc[lib]:.2f}x the time"
            )
        out.append(
            f"uncontended  RedisLock (mutex)    / floor (2 PING) = "
            f"{unc['floor'] / unc['mutex']:.2f}x the time"
        )
        if "ours_norenew" in unc:
            out.append(
                f"uncontended  RedisSemaphore auto_renew=False      = {unc['ours_norenew']:.0f}/s "
                f"({unc['floor'] / unc['ours_norenew']:.2f}x floor; diagnostic, not in table)"
            )
    hot = r.get("hot", {})
    if hot:
        out.append(f"hot key      floor = limit {limit} / section = {floor:.1f} acq/s")
        for lib in libs:
            if lib in hot:
                over = hot[lib]["most_at_once"] > limit
                out.append(
                    f"hot key      {LABELS[lib]:20s} throughput / floor = "
                    f"{hot[lib]['of_floor']:.2f}"
                    + (
                        f" (let {hot[lib]['most_at_once']} in at once: not comparable)"
                        if over
                        else ""
                    )
                )
        # A peer that let more than N in is not a semaphore to race against.
        peers = [p for p in libs if p != "ours" and p in hot and hot[p]["most_at_once"] <= limit]
        if "ours" in hot and peers:
            for key, what in (("gap_median", "median"), ("gap_p99", "p99")):
                best = min(peers, key=lambda p: hot[p][key])
                out.append(
                    f"hot key      {what:6s} gap ours / best peer = "
                    f"{hot['ours'][key] / hot[best][key]:.2f}x  ({hot['ours'][key] * 1e3:.2f} "
                    f"ms vs {LABELS[best]} {hot[best][key] * 1e3:.2f} ms)"
                )
            best = min(peers, key=lambda p: hot[p]["wait_p99"])
            out.append(
                f"hot key      p99 wait ours / best peer = "
                f"{hot['ours']['wait_p99'] / hot[best]['wait_p99']:.2f}x  "
                f"({LABELS[best]})"
            )
        out.append(
            "hot key      most holders at once = "
            + ", ".join(f"{LABELS[c]} {hot[c]['most_at_once']}" for c in hot)
        )
    return out


def note_lines(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out = [
        f"hot key: {args.procs} processes, limit {args.limit}, section {args.hold_ms:g} ms, "
        f"{args.work_ms:g} ms outside, {args.duration:.1f}s per column; pollers sleep "
        + ", ".join(f"{LABELS[k]} {v:g} ms" for k, v in POLL_MS.items())
        + " between tries",
        "hand-off gap: the k-th acquisition returned minus the (k-N)-th release call "
        "(the one that made room), when the acquirer was already trying then",
        f"served before an earlier waiter: differences under {ORDER_MARGIN * 1e3:g} ms "
        "in arrival or service are not counted",
        "Redis commands per acquisition: INFO commandstats (Redis 7 counts the commands "
        "a script runs, and each command of a MULTI/EXEC)",
    ]
    for c, res in r.get("hot", {}).items():
        if res["timeouts"] or res["killed"]:
            out.append(f"hot key {c}: {res['timeouts']} acquire timeouts, killed {res['killed']}")
    out.append(f"load average at the end {os.getloadavg()[0]:.2f} (1 min)")
    return out


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.semaphores", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply cycles and durations")
    ap.add_argument("--scenarios", default="1,2", help="comma list of scenarios to run")
    ap.add_argument("--libs", default=",".join(LIBS), help=f"comma list from {','.join(LIBS)}")
    ap.add_argument("--limit", type=int, default=3, help="the semaphore's limit N")
    ap.add_argument("--cycles", type=int, default=3000, help="1: timed pairs per column")
    ap.add_argument("--procs", type=int, default=6, help="2: worker processes")
    ap.add_argument("--duration", type=float, default=3.0, help="2: seconds per column")
    ap.add_argument("--hold-ms", type=float, default=20.0, help="2: section time")
    ap.add_argument("--work-ms", type=float, default=0.0, help="2: time outside, per loop")
    ap.add_argument("--no-json", action="store_true", help="do not write semaphores.json")
    args = ap.parse_args(argv)
    args.cycles = max(100, int(args.cycles * args.scale))
    args.duration = max(0.5, args.duration * args.scale)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scenarios = {int(x) for x in args.scenarios.split(",") if x.strip()}
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    unknown = [x for x in libs if x not in LIBS]
    if unknown:
        raise SystemExit(f"unknown libs {unknown}; choose from {LIBS}")
    hold, work = args.hold_ms / 1e3, args.work_ms / 1e3
    floor = min(args.limit / hold, args.procs / (hold + work))
    warnings.simplefilter("ignore")
    ctx = mp.get_context("spawn")
    started = monotonic()
    results: dict[str, Any] = {}
    with RedisServer() as server:
        client = server.client(retry=Retry(NoBackoff(), 0))  # lock scripts: never re-sent
        probe = server.client()
        version = client.info("server")["redis_version"]
        log(f"private redis-server {version} at {server.url} (pid {server.pid})")
        if 1 in scenarios:
            log(f"scenario 1: uncontended ({args.cycles} pairs, best of 3 rounds)")
            results["uncontended"] = scenario_uncontended(client, libs, args.limit, args.cycles)
        if 2 in scenarios:
            log(
                f"scenario 2: hot key (limit {args.limit}, {args.procs} processes, "
                f"{args.hold_ms:g} ms sections, {args.duration:.1f}s each)"
            )
            results["hot"] = scenario_hot(
                ctx, server.url, probe, libs, args.limit, args.procs, args.duration, hold, work
            )
        client.close()
        probe.close()
    elapsed = monotonic() - started

    cols = [*libs, *(("mutex", "floor") if 1 in scenarios else ())]
    lines = [
        "",
        f"Redis semaphore comparison: redis-server {version} on loopback, {os.cpu_count()} "
        f"CPUs, Python {sys.version.split()[0]}, redis-py {redis.__version__}",
        "",
        *build_table(cols, results, args.limit),
        "",
        "Ratios:",
        *("  " + x for x in ratio_lines(results, libs, args.limit, floor)),
        "",
        "Notes:",
        *("  " + x for x in note_lines(results, args)),
        f"  total run time {elapsed:.0f}s",
    ]
    print("\n".join(lines))
    if args.no_json:
        return 0
    slim = json.loads(json.dumps(results, default=str))
    for res in slim.get("hot", {}).values():
        res["gaps_ms"] = [round(g * 1e3, 4) for g in res.pop("gaps")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "semaphores.json").write_text(
        json.dumps({"elapsed_s": elapsed, "args": vars(args), **slim}, indent=1)
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except queue.Empty:
        log("a worker did not report in time (all started processes were reaped)")
        sys.exit(1)
