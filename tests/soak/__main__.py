"""Entry point: ``python -m tests.soak`` (or ``./dev soak``); ``--help`` for the options."""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import __doc__ as DOC
from .locks import LockParams, PartResult, run_locks
from .settlements import SettleParams, run_settlements

#: The issue's figures (defaults) and the smoke preset (--quick).
FULL = {
    "acquisitions": 20_000,
    "processes": 8,
    "settlements": 1000,
    "accounts": 20,
    "workers": 2,
    "concurrency": 3,
    "minutes": 45.0,
}
QUICK = {
    "acquisitions": 150,
    "processes": 3,
    "settlements": 60,
    "accounts": 4,
    "workers": 1,
    "concurrency": 2,
    "minutes": 2.0,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m tests.soak",
        description=DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="the small preset (smoke test, < 30 s)")
    ap.add_argument("--parts", default="a,b", help="a (locks), b (settlements) or a,b (a,b)")
    ap.add_argument("--acquisitions", type=int, help="part A: fenced acquisitions (20000)")
    ap.add_argument("--processes", type=int, help="part A: contending processes (8)")
    ap.add_argument("--settlements", type=int, help="part B: settlement tasks (1000)")
    ap.add_argument("--accounts", type=int, help="part B: accounts (20)")
    ap.add_argument("--workers", type=int, help="part B: prefork celery workers (2)")
    ap.add_argument("--concurrency", type=int, help="part B: pool processes per worker (3)")
    ap.add_argument("--minutes", type=float, help="time bound of each part (45)")
    ap.add_argument("--seed", type=int, help="random seed (drawn and printed when not given)")
    ap.add_argument(
        "--defeat",
        action="store_true",
        help="self-test: run without the lock; the oracles must then report violations",
    )
    ap.add_argument("--keep-logs", metavar="DIR", help="keep the process and worker logs in DIR")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.part_list = [x.strip().lower() for x in args.parts.split(",") if x.strip()]
    if not args.part_list or set(args.part_list) - {"a", "b"}:
        ap.error(f"--parts: a, b or a,b; got {args.parts!r}")
    if args.processes < 2 or args.acquisitions < args.processes:
        ap.error("--processes must be >= 2 and --acquisitions >= --processes")
    if args.settlements < 2 or args.accounts < 1 or args.workers < 1 or args.concurrency < 1:
        ap.error("--settlements >= 2, --accounts, --workers and --concurrency >= 1")
    if args.minutes <= 0:
        ap.error("--minutes must be > 0")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 2**31)
    return args


def say(line: str) -> None:
    print(line, flush=True)


def table(results: list[PartResult]) -> list[str]:
    width = max((len(label) for r in results for label, _ in r.rows), default=40) + 2
    lines = []
    for r in results:
        lines.append(r.title)
        lines += [f"  {label:<{width}}{value}" for label, value in r.rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_root = Path(args.keep_logs or tempfile.mkdtemp(prefix="redislock-soak-"))
    log_root.mkdir(parents=True, exist_ok=True)
    import celery
    import redis

    import celery_redislock

    say(
        f"soak: seed {args.seed} (replay: --seed {args.seed}), {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, redis-py {redis.__version__}, Celery "
        f"{celery.__version__}, celery_redislock {celery_redislock.__version__}"
        + (", QUICK preset" if args.quick else "")
        + (", SELF-TEST WITHOUT A LOCK" if args.defeat else "")
    )
    started = time.monotonic()
    results: list[PartResult] = []
    if "a" in args.part_list:
        locks = LockParams(
            acquisitions=args.acquisitions, processes=args.processes, minutes=args.minutes,
            seed=args.seed, defeat="no-lock" if args.defeat else "",
        )  # fmt: skip
        if args.quick:
            locks.restarts, locks.downtime, locks.fault_gap = 1, (0.1, 0.4), (0.5, 1.2)
        (log_root / "locks").mkdir(exist_ok=True)
        results.append(run_locks(locks, log_root / "locks", say))
    if "b" in args.part_list:
        settle = SettleParams(
            settlements=args.settlements, accounts=args.accounts, workers=args.workers,
            concurrency=args.concurrency, minutes=args.minutes, seed=args.seed,
            defeat="no-lock" if args.defeat else "",
        )  # fmt: skip
        if args.quick:
            settle.kill_gap, settle.downtime, settle.visibility_timeout = (0.5, 1.5), (0.2, 0.5), 8
            settle.work = (0.01, 0.04)
        (log_root / "settlements").mkdir(exist_ok=True)
        results.append(run_settlements(settle, log_root / "settlements", say))
    violations = [(r.title, x) for r in results for x in r.violations]
    say("")
    for line in table(results):
        say(line)
    say("")
    for r in results:
        part = r.title[:1]
        for text in r.notes:
            say(f"NOTE [{part}] {text}")
        for text in r.violations[:25]:
            say(f"VIOLATION [{part}] {text}")
        if len(r.violations) > 25:
            say(f"... and {len(r.violations) - 25} more in part {part}")
        for text in r.evidence:
            say(f"EVIDENCE [{part}] {text}")
    verdict = "PASS" if not violations else "FAIL"
    say(
        f"soak {verdict}: {len(violations)} violations, seed {args.seed}, "
        f"{time.monotonic() - started:.0f}s"
    )
    if violations or args.keep_logs:
        say(f"logs kept in {log_root}")
    else:
        shutil.rmtree(log_root, ignore_errors=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
