"""Compare celery_redislock.RedisLock with other Redis locks, in one run, on one private server.

    .venv/bin/python -m bench.locks            # ~2-3 minutes on 2 cores
    .venv/bin/python -m bench.locks --scale 3  # longer runs, more samples

Scenarios (see bench/README.md): 1 uncontended cycles/s, 2 contended hand-off (4
processes), 3 dead holder (SIGKILLed, lease expiry -> waiter), 4 many waiters (100
threads over 4 processes: Redis commands and connections per hand-off), 5 renewal
cost (1,000 and 10,000 held locks). Prints one table, ratios and notes; writes
bench/results/handoff.png and bench/results/results.json.

Only a private redis-server on a free loopback port is used (started and stopped here
by pid); every worker process is spawned here, bounded in time, joined with a timeout
and SIGKILLed by pid if it is still alive.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import redis

from celery_redislock.testing import RedisServer

from . import _workers as W
from ._libs import LABELS, LIBS, make, seed_token

monotonic = time.monotonic
RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- helpers


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (q in [0, 1]); nan for no data."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def reap(procs: list[Any], timeout: float = 10.0) -> list[int]:
    """Join our own processes; SIGKILL (by pid) whichever did not end in time."""
    deadline = monotonic() + timeout
    killed = []
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.1, deadline - monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            killed.append(p.pid)
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    return killed


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {k: int(v["calls"]) for k, v in client.info("commandstats").items()}


def connected(client: redis.Redis) -> int:
    return int(client.info("clients")["connected_clients"])


# --------------------------------------------------------------------------- scenario 1


def scenario_uncontended(client: redis.Redis, libs: list[str], cycles: int) -> dict[str, Any]:
    """acquire+release cycles/s in one process, one thread; best of 3 interleaved rounds."""
    order = [*libs, "floor"]
    if "ours" in libs:
        order.append("ours_norenew")  # diagnostic: how much the watchdog hand-off costs
    best: dict[str, float] = {}
    warm = max(200, cycles // 10)
    for _round in range(3):
        for lib in order:
            real = "ours" if lib == "ours_norenew" else lib
            lk = make(real, client, f"bench:unc:{lib}", 30.0, renew=lib != "ours_norenew")
            for _ in range(warm):
                assert lk.acquire(5.0)
                lk.release()
            t0 = time.perf_counter()
            for _ in range(cycles):
                lk.acquire(5.0)
                lk.release()
            rate = cycles / (time.perf_counter() - t0)
            best[lib] = max(best.get(lib, 0.0), rate)
            log(f"  uncontended {lib:13s} {rate:9.0f} cycles/s")
    return best


# --------------------------------------------------------------------------- scenario 2


def analyze_contended(
    outs: list[tuple[int, list[tuple[float, float, float, float]], int]],
    t_start: float,
    duration: float,
) -> dict[str, Any]:
    recs = sorted(
        (t_acq, t_rel, t_att, t_rel_end, pid)
        for pid, rs, _f in outs
        for (t_att, t_acq, t_rel, t_rel_end) in rs
    )
    per_proc = [len(rs) for _pid, rs, _f in outs]
    overlaps = 0
    for i, (_acq, rel, *_rest) in enumerate(recs):
        j = i + 1
        while j < len(recs) and recs[j][0] < rel:
            overlaps += 1
            j += 1
    gaps: list[float] = []
    same_proc = 0
    handoffs = 0
    for prev, cur in zip(recs, recs[1:]):
        handoffs += 1
        if cur[4] == prev[4]:
            same_proc += 1
        if cur[2] < prev[1]:  # the next acquirer was already trying when prev released
            gaps.append(cur[0] - prev[1])
    in_window = sum(1 for r in recs if r[0] <= t_start + duration)
    return {
        "acquisitions": len(recs),
        "throughput": in_window / duration,
        "per_proc": per_proc,
        "fairness": (min(per_proc) / max(per_proc)) if per_proc and max(per_proc) else 0.0,
        "overlaps": overlaps,
        "gaps": gaps,
        "gap_median": pct(gaps, 0.5),
        "gap_p99": pct(gaps, 0.99),
        "waited_share": len(gaps) / handoffs if handoffs else float("nan"),
        "same_proc_share": same_proc / handoffs if handoffs else float("nan"),
        "timeouts": sum(f for _p, _r, f in outs),
    }


def scenario_contended(
    ctx: Any,
    url: str,
    libs: list[str],
    procs: int,
    duration: float,
    hold: float,
    work: float,
    rounds: int = 1,
) -> dict[str, Any]:
    """Every library and the one-token floor in turn, ``rounds`` times (each round in
    another order): a library's gaps pooled over its rounds, and each round's median and
    p99 kept, so a ratio can be taken within a round (the machine drifts between runs)."""
    order = [*libs, "token"]  # the one-token hand-off floor, in the same harness and run
    per_round: list[dict[str, Any]] = []
    for turn in range(rounds):
        shift = turn % len(order)
        per_round.append(
            _contended_round(ctx, url, order[shift:] + order[:shift], procs, duration, hold, work)
        )
    results: dict[str, Any] = {}
    for lib in order:
        runs = [r[lib] for r in per_round]
        merged = dict(runs[0])
        for key in ("acquisitions", "overlaps", "timeouts"):
            merged[key] = sum(r[key] for r in runs)
        merged["killed"] = [pid for r in runs for pid in r["killed"]]
        merged["gaps"] = [g for r in runs for g in r["gaps"]]
        merged["gap_median"] = pct(merged["gaps"], 0.5)
        merged["gap_p99"] = pct(merged["gaps"], 0.99)
        merged["per_proc"] = [sum(c) for c in zip(*(r["per_proc"] for r in runs))]
        for key in ("throughput", "fairness", "waited_share", "same_proc_share"):
            merged[key] = statistics.median(r[key] for r in runs)
        merged["rounds"] = [{"gap_median": r["gap_median"], "gap_p99": r["gap_p99"]} for r in runs]
        results[lib] = merged
    return results


def _contended_round(
    ctx: Any, url: str, order: list[str], procs: int, duration: float, hold: float, work: float
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for lib in order:
        name = f"bench:cont:{lib}"
        if lib == "token":
            seeder = redis.Redis.from_url(url)
            seed_token(seeder, name)
            seeder.close()
        ready_q, out_q = ctx.Queue(), ctx.Queue()
        go = ctx.Event()
        start_at = ctx.Value("d", 0.0)
        ps = [
            ctx.Process(
                target=W.contended_worker,
                args=(
                    lib,
                    url,
                    name,
                    10.0,
                    hold,
                    work,
                    5.0,
                    duration,
                    ready_q,
                    go,
                    start_at,
                    out_q,
                ),
                daemon=True,
            )
            for _ in range(procs)
        ]
        outs = []
        try:
            for p in ps:
                p.start()
            for _ in ps:
                ready_q.get(timeout=60)
            start_at.value = monotonic() + 0.2
            go.set()
            for _ in ps:
                outs.append(out_q.get(timeout=duration + 60))
        finally:
            killed = reap(ps)
        errors = [o for o in outs if o[1] == "error"]
        if errors:
            raise RuntimeError(f"contended worker failed ({lib}):\n{errors[0][2]}")
        res = analyze_contended(outs, start_at.value, duration)
        res["killed"] = killed
        results[lib] = res
        log(
            f"  contended {lib:13s} {res['throughput']:7.0f} acq/s  gap median "
            f"{res['gap_median'] * 1e3:7.3f} ms  p99 {res['gap_p99'] * 1e3:8.3f} ms  "
            f"fair {res['fairness']:.2f}  overlaps {res['overlaps']}  per-proc {res['per_proc']}"
        )
    return results


# --------------------------------------------------------------------------- scenario 3


def scenario_dead_holder(
    ctx: Any, url: str, libs: list[str], reps: int, ttl: float = 1.0
) -> dict[str, Any]:
    """A holder SIGKILLed mid-lease; delay from its lease's expiry to a blocked waiter's acquire.

    Timeline per repetition (T = holder's acquire returned): the waiter starts its
    blocking acquire at T+0.25 s, the holder is SIGKILLed at T+0.5 s, the lease
    expires at T+ttl; delay = waiter's acquire - (T + ttl).
    """
    wait_offset, kill_offset = 0.25, 0.5
    results: dict[str, Any] = {}
    for lib in libs:
        name = f"bench:dead:{lib}"
        # python-redis-lock: a timeout must be <= expire (1 s) without renewal and could give
        # up before the lease ends, so its waiter blocks without one (BLPOP re-armed every expire).
        wait_timeout = None if lib == "prl" else 5.0
        h_go = [ctx.Event() for _ in range(reps)]
        h_q, w_cmd, w_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        holders = [
            ctx.Process(target=W.dead_holder, args=(lib, url, name, ttl, h_go[i], h_q), daemon=True)
            for i in range(reps)
        ]
        waiter = ctx.Process(
            target=W.dead_waiter, args=(lib, url, name, ttl, wait_timeout, w_cmd, w_q), daemon=True
        )
        delays: list[float] = []
        failures = 0
        try:
            for p in [*holders, waiter]:
                p.start()
            for _ in holders:
                msg = h_q.get(timeout=60)
                if msg[0] != "ready":
                    raise RuntimeError(f"dead holder ({lib}): {msg}")
            msg = w_q.get(timeout=60)
            if msg[0] != "ready":
                raise RuntimeError(f"dead waiter ({lib}): {msg}")
            for i, holder in enumerate(holders):
                h_go[i].set()
                msg = h_q.get(timeout=15)
                if msg[0] != "acquired" or not msg[2]:
                    raise RuntimeError(f"dead holder ({lib}) did not acquire: {msg}")
                t_acq = msg[4]
                w_cmd.put(t_acq + wait_offset)
                msg = w_q.get(timeout=15)
                if msg[0] != "waiting":
                    raise RuntimeError(f"dead waiter ({lib}): {msg}")
                W._sleep_until(t_acq + kill_offset)
                os.kill(holder.pid, signal.SIGKILL)
                holder.join(5)
                msg = w_q.get(timeout=ttl + 20)
                if msg[0] != "acquired":
                    raise RuntimeError(f"dead waiter ({lib}): {msg}")
                if not msg[1]:
                    failures += 1
                    continue
                delays.append(msg[3] - (t_acq + ttl))
            w_cmd.put(None)
        finally:
            killed = reap([*holders, waiter])
        results[lib] = {
            "delays": delays,
            "median": pct(delays, 0.5),
            "failures": failures,
            "killed_at_end": killed,
        }
        log(
            f"  dead holder {lib:13s} delays after expiry (ms): "
            f"{[round(d * 1e3, 1) for d in delays]}  failures {failures}"
        )
    return results


# --------------------------------------------------------------------------- scenario 4


def scenario_many_waiters(
    ctx: Any,
    url: str,
    probe: redis.Redis,
    libs: list[str],
    procs: int,
    waiters: int,
    handoffs: int,
    max_seconds: float,
) -> dict[str, Any]:
    """``waiters`` threads over ``procs`` processes cycling on one lock.

    Measured in a steady-state window (after 50 hand-offs or 2 s of warm-up): Redis
    commands per hand-off from INFO commandstats deltas (every call Redis counts,
    including commands run inside Lua scripts; our own INFO calls excluded), requests
    the clients wrote (one per command or pipeline, counted in the workers' connection
    class) and the peak rise of connected_clients over the baseline taken before the
    workers started. Waiters arrive 1 ms apart (100 waiters over ~0.1 s), not in one
    burst, so the connection count is what steady waiting needs, not a start-up spike.
    """
    results: dict[str, Any] = {}
    per = [waiters // procs + (1 if i < waiters % procs else 0) for i in range(procs)]
    hold = work = 0.001
    for lib in libs:
        name = f"bench:many:{lib}"
        ready_q, out_q = ctx.Queue(), ctx.Queue()
        go, stop = ctx.Event(), ctx.Event()
        counter = ctx.Value("q", 0)
        requests = ctx.Array("q", procs, lock=False)  # requests written, one slot per process
        base_conns = connected(probe)
        ps = [
            ctx.Process(
                target=W.many_worker,
                args=(
                    lib,
                    url,
                    name,
                    10.0,
                    per[i],
                    hold,
                    work,
                    2.0,
                    max_seconds,
                    ready_q,
                    go,
                    stop,
                    counter,
                    requests,
                    i,
                    procs,
                    out_q,
                ),
                daemon=True,
            )
            for i in range(procs)
        ]
        outs = []
        peak = base_conns
        try:
            for p in ps:
                p.start()
            for _ in ps:
                ready_q.get(timeout=60)
            go.set()
            t_go = monotonic()
            while counter.value < 50 and monotonic() - t_go < 2.0:
                time.sleep(0.01)
                peak = max(peak, connected(probe))
            c0, s0, t0 = counter.value, commandstats(probe), monotonic()
            q0 = sum(requests[:])
            next_sample = t0
            while counter.value - c0 < handoffs and monotonic() - t0 < max_seconds:
                time.sleep(0.005)
                if monotonic() >= next_sample:
                    peak = max(peak, connected(probe))
                    next_sample = monotonic() + 0.1
            c1, s1, t1 = counter.value, commandstats(probe), monotonic()
            q1 = sum(requests[:])
            peak = max(peak, connected(probe))
            stop.set()
            for _ in ps:
                outs.append(out_q.get(timeout=max_seconds + 60))
        finally:
            stop.set()
            killed = reap(ps, timeout=30)
        errors = [o for o in outs if o[1] == "error"]
        if errors:
            raise RuntimeError(f"many-waiters worker failed ({lib}):\n{errors[0][2]}")
        n = c1 - c0
        delta = {k: s1.get(k, 0) - s0.get(k, 0) for k in s1}
        delta = {k: v for k, v in delta.items() if v and not k.startswith("cmdstat_info")}
        total = sum(delta.values())
        evals = sum(v for k, v in delta.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
        top = sorted(delta.items(), key=lambda kv: -kv[1])[:6]
        results[lib] = {
            "handoffs": n,
            "seconds": t1 - t0,
            "rate": n / (t1 - t0) if t1 > t0 else 0.0,
            "cmds_per_handoff": total / n if n else float("nan"),
            "evals_per_handoff": evals / n if n else float("nan"),
            "requests_per_handoff": (q1 - q0) / n if n else float("nan"),
            "top": [(k.removeprefix("cmdstat_"), v / n if n else 0) for k, v in top],
            "connections": peak - base_conns,
            "timeouts": sum(o[2] for o in outs),
            "stuck_threads": sum(o[3] for o in outs),
            "thread_errors": [e for o in outs for e in o[4]],
            "killed": killed,
        }
        r = results[lib]
        log(
            f"  many waiters {lib:13s} {n} hand-offs in {r['seconds']:.2f}s  "
            f"cmds/hand-off {r['cmds_per_handoff']:.1f}  conns +{r['connections']}  "
            f"top {[(k, round(v, 2)) for k, v in r['top']]}"
        )
        # Let the previous library's connections close before the next baseline.
        end = monotonic() + 5
        while connected(probe) > base_conns and monotonic() < end:
            time.sleep(0.1)
    return results


# --------------------------------------------------------------------------- scenario 5


def scenario_renewal(
    ctx: Any, url: str, counts: list[int], hold_s: float, ttl: float = 3.0, prl_max: int = 1000
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    runs = [("ours", n) for n in counts] + [("prl", n) for n in counts if n <= prl_max]
    for lib, n in runs:
        out_q = ctx.Queue()
        p = ctx.Process(
            target=W.renewal_worker, args=(lib, url, n, ttl, hold_s, out_q), daemon=True
        )
        try:
            p.start()
            res = out_q.get(timeout=hold_s + 30 + n / 200)
        finally:
            reap([p], timeout=20)
        if "error" in res:
            raise RuntimeError(f"renewal worker failed ({lib}, {n}):\n{res['error']}")
        res["cpu_share"] = res["cpu"] / res["wall"]
        results[f"{lib}:{n}"] = res
        log(
            f"  renewal {lib:5s} {n:6d} locks: {res['rt_per_interval']:.2f} round trips/interval, "
            f"{res['evalsha_per_interval']:.1f} EVALSHA/interval, "
            f"CPU {res['cpu_share'] * 100:.1f}%, "
            f"lost {res['lost']}, spurious loss reports {res['spurious_loss_reports']}, "
            f"threads {res['threads']}, acquire {res['acquire_s']:.1f}s, "
            f"release {res['release_s']:.1f}s"
        )
    return results


# --------------------------------------------------------------------------- report


def fmt(v: Any, spec: str) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and v != v:
        return "n/a"
    return format(v, spec)


def build_table(cols: list[str], r: dict[str, Any], renew_counts: list[int]) -> list[str]:
    rows: list[tuple[str, dict[str, str]]] = []

    def row(label: str, getter: Any) -> None:
        rows.append((label, {c: getter(c) for c in cols}))

    unc = r.get("uncontended", {})
    con = r.get("contended", {})
    dead = r.get("dead", {})
    many = r.get("many", {})
    ren = r.get("renewal", {})
    if unc:
        row(
            "1 uncontended acquire+release /s",
            lambda c: fmt(unc.get(c), ".0f") if c != "token" else "-",
        )
    if con:

        def cget(key: str, spec: str, scale: float = 1.0) -> Any:
            return lambda c: fmt(con[c][key] * scale, spec) if c in con else "-"

        row("2 contended throughput acq/s", cget("throughput", ".0f"))
        row("2 hand-off gap median ms", cget("gap_median", ".3f", 1e3))
        row("2 hand-off gap p99 ms", cget("gap_p99", ".3f", 1e3))
        row("2 hand-offs to a waiter %", cget("waited_share", ".0f", 100))
        row("2 same-process re-acquire %", cget("same_proc_share", ".0f", 100))
        row("2 fairness min/max per process", cget("fairness", ".2f"))
        row("2 overlapping sections", lambda c: str(con[c]["overlaps"]) if c in con else "-")
    if dead:
        row(
            "3 dead holder: expiry->acquire ms (med)",
            lambda c: fmt(dead[c]["median"] * 1e3, ".1f") if c in dead else "-",
        )
    if many:

        def mget(key: str, spec: str) -> Any:
            return lambda c: fmt(many[c][key], spec) if c in many else "-"

        row("4 100 waiters: hand-offs/s", mget("rate", ".0f"))
        row("4 Redis cmds per hand-off (all)", mget("cmds_per_handoff", ".1f"))
        row("4   of which EVAL/EVALSHA", mget("evals_per_handoff", ".1f"))
        row("4 client requests sent per hand-off", mget("requests_per_handoff", ".1f"))
        row("4 connections used (peak delta)", mget("connections", "d"))
    for n in renew_counts:
        label = f"{n // 1000}k" if n % 1000 == 0 else str(n)

        def rget(key: str, spec: str, scale: float = 1.0, n: int = n) -> Any:
            def get(c: str) -> str:
                res = ren.get(f"{c}:{n}")
                if res is None:
                    if c == "prl":
                        return "thread/lock" if n > 1000 else "n/a"
                    return "n/a" if c not in ("floor", "token") else "-"
                return fmt(res[key] * scale if scale != 1.0 else res[key], spec)

            return get

        if ren:
            row(f"5 renew {label}: round trips per ttl/3", rget("rt_per_interval", ".2f"))
            row(f"5 renew {label}: EVALSHA per ttl/3", rget("evalsha_per_interval", ".1f"))
            row(f"5 renew {label}: renewal CPU % of 1 core", rget("cpu_share", ".2f", 100))
            row(f"5 renew {label}: renewal threads", rget("threads", "d"))
            row(f"5 renew {label}: connections (delta)", rget("connections", "d"))
            row(f"5 renew {label}: leases lost", rget("lost", "d"))
            row(
                f"5 renew {label}: loss reports on clean release",
                rget("spurious_loss_reports", "d"),
            )
            row(f"5 renew {label}: time to take the locks s", rget("acquire_s", ".2f"))

    width0 = max(len(label) for label, _ in rows) + 2
    widths = [max(len(LABELS[c]), *(len(v[c]) for _, v in rows)) + 2 for c in cols]
    lines = ["".ljust(width0) + "".join(LABELS[c].rjust(w) for c, w in zip(cols, widths))]
    lines.append("-" * len(lines[0]))
    for label, vals in rows:
        lines.append(label.ljust(width0) + "".join(vals[c].rjust(w) for c, w in zip(cols, widths)))
    return lines


def ratio_lines(r: dict[str, Any], libs: list[str]) -> list[str]:
    out = []
    peers = [c for c in libs if c != "ours"]
    unc = r.get("uncontended", {})
    if "ours" in unc:
        if "redispy" in unc:
            out.append(
                f"uncontended  ours / redis-py default        = {unc['ours'] / unc['redispy']:.2f}x"
            )
        out.append(
            f"uncontended  ours / floor (2 no-op EVALSHA)  = {unc['ours'] / unc['floor']:.2f}x"
        )
        if "ours_norenew" in unc:
            out.append(
                f"uncontended  ours auto_renew=False           = {unc['ours_norenew']:.0f}/s "
                f"({unc['ours_norenew'] / unc['floor']:.2f}x floor; diagnostic, not in table)"
            )
    con = r.get("contended", {})
    if "ours" in con and any(p in con for p in peers):
        for key, what in (("gap_median", "median"), ("gap_p99", "p99")):
            best = min((p for p in peers if p in con), key=lambda p: con[p][key])
            out.append(
                f"contended    {what:6s} gap ours / best peer      = "
                f"{con['ours'][key] / con[best][key]:.2f}x  "
                f"({con['ours'][key] * 1e3:.3f} ms vs {LABELS[best]} {con[best][key] * 1e3:.3f} ms)"
            )
        if "token" in con:
            for key, what in (("gap_median", "median"), ("gap_p99", "p99")):
                floor = con["token"][key]
                out.append(
                    f"contended    {what:6s} gap / token floor       = "
                    + ", ".join(f"{c} {con[c][key] / floor:.2f}x" for c in libs if c in con)
                    + f"  (floor {floor * 1e3:.3f} ms)"
                )
            for key, what in (("gap_median", "median"), ("gap_p99", "p99")):
                out.append(
                    f"contended    {what:6s} gap / token floor, within each round = "
                    + "; ".join(
                        f"{c} "
                        + ", ".join(
                            f"{mine[key] / floor[key]:.2f}"
                            for mine, floor in zip(con[c]["rounds"], con["token"]["rounds"])
                        )
                        + f" (median {_round_ratio(con, c, key):.2f})"
                        for c in libs
                        if c in con
                    )
                )
        best = max((p for p in peers if p in con), key=lambda p: con[p]["fairness"])
        out.append(
            f"contended    fairness ours                   = {con['ours']['fairness']:.2f} "
            f"(best peer {LABELS[best]} {con[best]['fairness']:.2f})"
        )
        out.append(
            "contended    overlaps (all libraries)        = "
            + ", ".join(f"{c} {con[c]['overlaps']}" for c in con)
        )
    dead = r.get("dead", {})
    if "ours" in dead:
        peer_d = {p: dead[p]["median"] for p in peers if p in dead}
        best = min(peer_d, key=peer_d.__getitem__) if peer_d else None
        extra = f" (best peer {LABELS[best]} {peer_d[best] * 1e3:.1f} ms)" if best else ""
        out.append(
            f"dead holder  ours delay after expiry         = "
            f"{dead['ours']['median'] * 1e3:.1f} ms{extra}"
        )
    ren = r.get("renewal", {})
    if "ours:1000" in ren:
        o = ren["ours:1000"]
        line = (
            f"renewal 1k   ours round trips per interval   = {o['rt_per_interval']:.2f} "
            f"({o['evalsha_per_interval']:.1f} EVALSHA)"
        )
        if "prl:1000" in ren:
            line += (
                f"; python-redis-lock {ren['prl:1000']['rt_per_interval']:.0f} round trips per 1 s"
            )
        out.append(line)
    return out


def _round_ratio(con: dict[str, Any], lib: str, key: str) -> float:
    """The median over the rounds of ``lib``'s ``key`` over the token floor's in that round."""
    return statistics.median(
        mine[key] / floor[key] for mine, floor in zip(con[lib]["rounds"], con["token"]["rounds"])
    )


def note_lines(r: dict[str, Any]) -> list[str]:
    out = []
    con = r.get("contended", {})
    for c, res in con.items():
        if res["timeouts"] or res["killed"]:
            out.append(f"contended {c}: {res['timeouts']} acquire timeouts, killed {res['killed']}")
    many = r.get("many", {})
    for c, res in many.items():
        out.append(
            f"many waiters {LABELS[c]}: {res['handoffs']} hand-offs in {res['seconds']:.2f}s; "
            f"per hand-off: " + ", ".join(f"{k} {v:.2f}" for k, v in res["top"])
        )
        if res["timeouts"] or res["stuck_threads"] or res["thread_errors"] or res["killed"]:
            out.append(
                f"  {c}: {res['timeouts']} acquire timeouts (2 s), {res['stuck_threads']} stuck "
                f"threads, killed {res['killed']}, errors {res['thread_errors'][:1]}"
            )
    dead = r.get("dead", {})
    for c, res in dead.items():
        if res["failures"]:
            out.append(f"dead holder {c}: {res['failures']} waiter acquires timed out")
    ren = r.get("renewal", {})
    for k, res in ren.items():
        out.append(
            f"renewal {k}: took {res['n']} locks in {res['acquire_s']:.1f}s, released in "
            f"{res['release_s']:.1f}s; measured {res['wall']:.1f}s; renewal-thread errors "
            f"{res['thread_errors']} {res['thread_error_sample']}; "
            f"release errors {res['release_errors']}"
        )
        if res.get("pass_gaps"):
            out.append(f"  renewal passes {k}: gaps between passes (s) {res['pass_gaps'][:8]}")
    return out


def plot(contended: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for lib, res in contended.items():
        gaps = sorted(g * 1e3 for g in res["gaps"] if g > 0)
        if not gaps:
            continue
        ys = [(i + 1) / len(gaps) for i in range(len(gaps))]
        ax.step(gaps, ys, where="post", label=f"{LABELS[lib]} (n={len(gaps)})")
    ax.set_xscale("log")
    ax.set_xlabel("hand-off gap: release call -> next waiter's acquire returned (ms, log)")
    ax.set_ylabel("fraction of hand-offs to a waiter")
    ax.set_title("Contended hand-off gap CDF (4 processes, 1 ms hold, 1 ms work)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.locks", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply cycles, contended duration, hand-offs and renewal hold (default 1)",
    )
    ap.add_argument("--scenarios", default="1,2,3,4,5", help="comma list of scenarios to run")
    ap.add_argument("--libs", default=",".join(LIBS), help=f"comma list from {','.join(LIBS)}")
    ap.add_argument("--cycles", type=int, default=3000, help="1: timed cycles per library")
    ap.add_argument("--procs", type=int, default=4, help="2/4: worker processes")
    ap.add_argument("--duration", type=float, default=3.0, help="2: seconds per library")
    ap.add_argument("--rounds", type=int, default=3, help="2: rounds of every library in turn (3)")
    ap.add_argument("--hold-ms", type=float, default=1.0, help="2: hold time in the lock")
    ap.add_argument("--work-ms", type=float, default=1.0, help="2: work time outside the lock")
    ap.add_argument("--dead-reps", type=int, default=3, help="3: repetitions per library")
    ap.add_argument("--waiters", type=int, default=100, help="4: waiter threads in all")
    ap.add_argument("--handoffs", type=int, default=200, help="4: measured hand-offs")
    ap.add_argument("--many-seconds", type=float, default=10.0, help="4: time cap per library")
    ap.add_argument("--renew-locks", default="1000,10000", help="5: comma list of lock counts")
    ap.add_argument("--renew-hold", type=float, default=4.0, help="5: seconds held (ttl 3 s)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-json", action="store_true", help="do not write results.json")
    args = ap.parse_args(argv)
    s = args.scale
    args.cycles = max(100, int(args.cycles * s))
    args.duration = max(0.5, args.duration * s)
    args.handoffs = max(20, int(args.handoffs * s))
    args.many_seconds = max(2.0, args.many_seconds * s)
    args.renew_hold = max(2.0, args.renew_hold * s)
    args.dead_reps = max(1, round(args.dead_reps * max(1.0, s)))
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scen = {int(x) for x in args.scenarios.split(",") if x.strip()}
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    unknown = [x for x in libs if x not in LIBS]
    if unknown:
        raise SystemExit(f"unknown libs {unknown}; choose from {LIBS}")
    renew_counts = [int(x) for x in args.renew_locks.split(",") if x.strip()]
    warnings.simplefilter("ignore")
    ctx = mp.get_context("spawn")
    started = monotonic()
    results: dict[str, Any] = {}
    with RedisServer() as server:
        url = server.url
        # pottery builds a default client from REDIS_URL at import; point it at ours, never 6379.
        os.environ["REDIS_URL"] = url
        client = server.client()
        probe = server.client()
        version = client.info("server")["redis_version"]
        log(f"private redis-server {version} at {url} (pid {server.pid})")
        for lib in libs:  # load every library's scripts once, so no run pays NOSCRIPT
            lk = make(lib, client, f"bench:warm:{lib}", 10.0)
            assert lk.acquire(5.0)
            if lib == "ours":
                lk.lock.extend(10.0)  # loads the renew script the watchdog uses
            lk.release()
        if 1 in scen:
            log("scenario 1: uncontended")
            results["uncontended"] = scenario_uncontended(client, libs, args.cycles)
        if 2 in scen:
            log(
                f"scenario 2: contended hand-off "
                f"({args.procs} processes, {args.duration:.1f}s each, {args.rounds} rounds)"
            )
            results["contended"] = scenario_contended(
                ctx,
                url,
                libs,
                args.procs,
                args.duration,
                args.hold_ms / 1e3,
                args.work_ms / 1e3,
                args.rounds,
            )
        if 3 in scen:
            log(f"scenario 3: dead holder ({args.dead_reps} repetitions, ttl 1 s)")
            results["dead"] = scenario_dead_holder(ctx, url, libs, args.dead_reps)
        if 4 in scen:
            log(f"scenario 4: {args.waiters} waiters over {args.procs} processes")
            results["many"] = scenario_many_waiters(
                ctx, url, probe, libs, args.procs, args.waiters, args.handoffs, args.many_seconds
            )
        if 5 in scen:
            log(f"scenario 5: renewal cost ({renew_counts} locks, ttl 3 s, {args.renew_hold:.0f}s)")
            results["renewal"] = scenario_renewal(
                ctx, url, renew_counts, args.renew_hold, prl_max=1000 if "prl" in libs else 0
            )
        client.close()
        probe.close()
    elapsed = monotonic() - started

    cols = [*libs, "floor", *(["token"] if "contended" in results else [])]
    lines = [
        "",
        f"Redis lock comparison: redis-server {version} on loopback, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}, redis-py {redis.__version__}",
        "",
        *build_table(cols, results, renew_counts if 5 in scen else []),
        "",
        "Ratios:",
        *("  " + x for x in ratio_lines(results, libs)),
        "",
        "Notes:",
        *("  " + x for x in note_lines(results)),
        f"  total run time {elapsed:.0f}s",
    ]
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    if (
        "contended" in results
        and not args.no_plot
        and plot(results["contended"], RESULTS / "handoff.png")
    ):
        print("  plot: bench/results/handoff.png")
    if args.no_json:
        return 0
    slim = json.loads(json.dumps(results, default=str))
    for res in slim.get("contended", {}).values():
        res["gaps_ms"] = [round(g * 1e3, 4) for g in res.pop("gaps")]
    (RESULTS / "results.json").write_text(json.dumps({"elapsed_s": elapsed, **slim}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except queue.Empty:
        log("a worker did not report in time (all started processes were reaped)")
        sys.exit(1)
