"""Compare celery_redislock's rate limiter with Dramatiq's, in one run, on one private server.

    .venv/bin/python -m bench.rates                 # ~1 minute on 2 cores
    .venv/bin/python -m bench.rates --duration 10   # a longer contended run
    .venv/bin/python -m bench.rates --libs ours     # without the peers (no dramatiq needed)

Columns: ``RedisRateLimiter`` (GCRA, one script), Dramatiq's ``WindowRateLimiter`` and
``BucketRateLimiter`` (its Redis backend), and the floor (a PING round trip). Scenarios
(see bench/README.md):

1. contended: ``--procs`` processes (8) call one limiter as fast as it allows for
   ``--duration`` seconds (4) at ``--rate`` per second (50; ours with ``--burst`` 5): what
   was admitted against what is allowed, the fullest windows against the bound, Redis
   commands and round trips per admitted call;
2. uncontended: one thread, a limit that never refuses: the cost of one acquire, against
   a PING round trip from the same client.

Prints one table, ratios and notes; writes bench/results/rates.json (``--no-json``: not).
Only a private redis-server on a free loopback port is used (started and stopped here by
pid); every worker is spawned here, ends by its own deadline, is joined with a timeout and
SIGKILLed by pid if it is still alive.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import redis

from celery_redislock.testing import RedisServer

from ._rate_workers import LABELS, LIBS, Limiter, client_for, contended_worker

RESULTS = Path(__file__).resolve().parent / "results"
#: The windows whose fullest count is shown (seconds).
WINDOWS = (0.1, 1.0)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def commandstats(client: redis.Redis) -> dict[str, int]:
    return {k: int(v["calls"]) for k, v in client.info("commandstats").items()}


def reap(procs: list[Any], timeout: float = 10.0) -> list[int]:
    """Join our own processes; SIGKILL (by pid) whichever did not end in time."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    killed = []
    for p in procs:
        if p.pid is not None and p.is_alive():
            killed.append(p.pid)
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    return killed


# --------------------------------------------------------------------------- windows


def fullest(stamps: list[int], width: float) -> int:
    """The most admissions in any window [t, t + width] (stamps in microseconds; two
    pointers over them, sorted)."""
    ordered = sorted(stamps)
    width_us = round(width * 1_000_000)
    best, first = 0, 0
    for last, stamp in enumerate(ordered):
        while stamp - ordered[first] > width_us:
            first += 1
        best = max(best, last - first + 1)
    return best


def worst_excess(stamps: list[int], burst: int, rate: int) -> float:
    """The most units over ``burst + rate * T`` in any window of any length T (windows
    whose ends are admissions: the fullest there are; stamps in microseconds); 0 when the
    bound always held."""
    ordered = sorted(stamps)
    worst = 0  # in millionths of a unit: exact integers
    for i, start in enumerate(ordered):
        for j in range(i, len(ordered)):
            over = (j - i + 1 - burst) * 1_000_000 - rate * (ordered[j] - start)
            worst = max(worst, over)
    return worst / 1_000_000


# --------------------------------------------------------------------------- scenario 1


def scenario_contended(
    ctx: Any, url: str, client: redis.Redis, lib: str, args: argparse.Namespace
) -> dict[str, Any]:
    name = f"bench:rate:{lib}"
    ready_q, out_q = ctx.Queue(), ctx.Queue()
    go, start_at = ctx.Event(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(
            target=contended_worker,
            args=(lib, url, name, args.rate, args.burst, args.poll_ms / 1000, ready_q, go,
                  start_at, args.duration, out_q),
            daemon=True,
        )
        for _ in range(args.procs)
    ]  # fmt: skip
    outs = []
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready_q.get(timeout=60)
        before = commandstats(client)
        start_at.value = time.time() + 0.3
        go.set()
        for _ in procs:
            outs.append(out_q.get(timeout=args.duration + 60))
        after = commandstats(client)
    finally:
        killed = reap(procs)
    errors = [o for o in outs if o[1] == "error"]
    if errors:
        raise RuntimeError(f"contended worker failed ({lib}):\n{errors[0][2]}")
    start_us = round(start_at.value * 1_000_000)
    end_us = start_us + round(args.duration * 1_000_000)
    stamps = [s for _pid, ss, _a, _r in outs for s in ss if start_us <= s <= end_us]
    attempts = sum(a for _pid, _s, a, _r in outs)
    requests = sum(r for _pid, _s, _a, r in outs)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    delta["cmdstat_info"] = delta.get("cmdstat_info", 0) - 1  # our own INFO
    commands = sum(v for v in delta.values() if v > 0)
    admitted = len(stamps)
    per = max(admitted, 1)
    result = {
        "admitted": admitted,
        "achieved_rate": admitted / args.duration,
        "bound_total": args.burst + args.rate * args.duration,
        "fullest": {str(w): fullest(stamps, w) for w in WINDOWS},
        "worst_excess": worst_excess(stamps, args.burst, args.rate),
        "commands_per_admitted": commands / per,
        "requests_per_admitted": requests / per,
        "attempts_per_admitted": attempts / per,
        "per_process": sorted(len(ss) for _pid, ss, _a, _r in outs),
        "fairness": min(len(ss) for _p, ss, _a, _r in outs)
        / max(1, max(len(ss) for _p, ss, _a, _r in outs)),
        "top_commands": sorted(
            ((k.removeprefix("cmdstat_"), v / per) for k, v in delta.items() if v > 0),
            key=lambda kv: -kv[1],
        )[:6],
        "killed": killed,
    }
    log(
        f"  contended {lib:7s} admitted {admitted} in {args.duration:g}s "
        f"(bound {result['bound_total']:g}); fullest 1 s {result['fullest']['1.0']}; "
        f"{result['commands_per_admitted']:.1f} cmds/admitted"
    )
    return result


# --------------------------------------------------------------------------- scenario 2


def scenario_uncontended(client: redis.Redis, libs: list[str], calls: int) -> dict[str, float]:
    """Microseconds per call, best of 3 interleaved rounds; the floor is a PING."""
    most = 2**31 - 1  # ours: a limit that never refuses (each call advances it by 1 us)
    limiters = {lib: Limiter(lib, client, f"bench:rate:unc:{lib}", most, most) for lib in libs}
    best: dict[str, float] = {}
    for _round in range(3):
        for lib in [*libs, "floor"]:
            call = client.ping if lib == "floor" else limiters[lib].try_once
            for _ in range(max(100, calls // 10)):
                assert call()
            started = time.perf_counter()
            for _ in range(calls):
                call()
            micros = (time.perf_counter() - started) / calls * 1e6
            best[lib] = min(best.get(lib, float("inf")), micros)
            log(f"  uncontended {lib:7s} {micros:8.1f} us/call")
    return best


# --------------------------------------------------------------------------- report


def build_table(cols: list[str], r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    con, unc = r.get("contended", {}), r.get("uncontended", {})
    rows: list[tuple[str, dict[str, str]]] = []

    def row(label: str, value: Any) -> None:
        rows.append((label, {c: value(c) for c in cols}))

    def cget(key: str, spec: str) -> Any:
        return lambda c: format(con[c][key], spec) if c in con else "-"

    if con:
        d, rate, burst = args.duration, args.rate, args.burst
        row(f"1 admitted in {d:g} s", cget("admitted", "d"))
        row(f"1 achieved rate /s (allowed {rate})", cget("achieved_rate", ".1f"))
        for w in WINDOWS:
            bound = burst + rate * w
            row(
                f"1 fullest {w:g} s window (bound {bound:g})",
                lambda c, w=w: str(con[c]["fullest"][str(w)]) if c in con else "-",
            )
        row(f"1 worst units over {burst} + {rate}*T, any T", cget("worst_excess", ".0f"))
        row("1 Redis commands per admitted call", cget("commands_per_admitted", ".1f"))
        row("1 round trips per admitted call", cget("requests_per_admitted", ".1f"))
        row("1 attempts per admitted call", cget("attempts_per_admitted", ".1f"))
        row("1 fairness min/max per process", cget("fairness", ".2f"))
    if unc:
        row("2 uncontended acquire us/call", lambda c: format(unc[c], ".1f") if c in unc else "-")
    width0 = max(len(label) for label, _ in rows) + 2
    widths = [max(len(LABELS[c]), *(len(v[c]) for _, v in rows)) + 2 for c in cols]
    lines = ["".ljust(width0) + "".join(LABELS[c].rjust(w) for c, w in zip(cols, widths))]
    lines.append("-" * len(lines[0]))
    for label, values in rows:
        lines.append(
            label.ljust(width0) + "".join(values[c].rjust(w) for c, w in zip(cols, widths))
        )
    return lines


def ratio_lines(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    con, unc = r.get("contended", {}), r.get("uncontended", {})
    out = []
    if "ours" in con:
        ours = con["ours"]
        share = ours["admitted"] / ours["bound_total"]
        label = "ours admitted / its bound (burst + rate*D)"
        out.append(f"contended    {label:<44s} = {share:.3f}")
        for peer in (c for c in con if c != "ours"):
            label = f"{LABELS[peer]} fullest 1 s / its limit ({args.rate})"
            cost = con[peer]["commands_per_admitted"] / ours["commands_per_admitted"]
            out.append(
                f"contended    {label:<44s} = {con[peer]['fullest']['1.0'] / args.rate:.2f}x"
            )
            label = f"{LABELS[peer]} commands per admitted / ours"
            out.append(f"contended    {label:<44s} = {cost:.1f}x")
    if "ours" in unc:
        floor = unc["ours"] / unc["floor"]
        out.append(f"uncontended  {'ours / floor (PING)':<44s} = {floor:.2f}x")
        for peer in (c for c in unc if c not in ("ours", "floor")):
            label = f"ours / {LABELS[peer]}"
            out.append(f"uncontended  {label:<44s} = {unc['ours'] / unc[peer]:.2f}x")
    return out


def note_lines(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out = [
        f"{args.procs} processes, {args.rate}/s, ours burst {args.burst}; Dramatiq polls every "
        f"{args.poll_ms:g} ms when refused (its limiters do not wait); times: the server's "
        "clock for ours (the slot), the callers' wall clock for Dramatiq (the same clock here)",
    ]
    for lib, res in r.get("contended", {}).items():
        out.append(
            f"{LABELS[lib]}: per process {res['per_process']}; per admitted: "
            + ", ".join(f"{k} {v:.1f}" for k, v in res["top_commands"])
        )
        if res["killed"]:
            out.append(f"  {lib}: killed {res['killed']}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.rates", description=__doc__.split("\n")[0])
    ap.add_argument("--libs", default=",".join(LIBS), help=f"comma list from {','.join(LIBS)}")
    ap.add_argument("--scenarios", default="1,2", help="comma list of scenarios to run")
    ap.add_argument("--procs", type=int, default=8, help="1: worker processes")
    ap.add_argument("--duration", type=float, default=4.0, help="1: seconds per library")
    ap.add_argument("--rate", type=int, default=50, help="1: the allowed rate per second")
    ap.add_argument("--burst", type=int, default=5, help="1: our burst")
    ap.add_argument("--poll-ms", type=float, default=10.0, help="1: Dramatiq's retry interval")
    ap.add_argument("--calls", type=int, default=3000, help="2: timed calls per library")
    ap.add_argument("--no-json", action="store_true", help="do not write rates.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    unknown = [x for x in libs if x not in LIBS]
    if unknown:
        raise SystemExit(f"unknown libs {unknown}; choose from {LIBS}")
    scenarios = {int(x) for x in args.scenarios.split(",") if x.strip()}
    warnings.simplefilter("ignore")
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {}
    with RedisServer() as server:
        client = client_for(server.url)
        log(f"private redis-server {client.info('server')['redis_version']} at {server.url}")
        for lib in libs:  # load our script once: no run pays NOSCRIPT
            Limiter(lib, client, f"bench:rate:warm:{lib}", 10, 1).try_once()
        if 1 in scenarios:
            log("scenario 1: contended")
            results["contended"] = {
                lib: scenario_contended(ctx, server.url, client, lib, args) for lib in libs
            }
        if 2 in scenarios:
            log("scenario 2: uncontended")
            results["uncontended"] = scenario_uncontended(client, libs, args.calls)
        client.close()
    cols = [*libs, "floor"] if "uncontended" in results else libs
    lines = [*build_table(cols, results, args), "", "Ratios:", *ratio_lines(results, args)]
    lines += ["", "Notes:", *note_lines(results, args)]
    print("\n".join(lines))
    if not args.no_json:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "rates.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
        print("  json: bench/results/rates.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
