"""Quorum locks side by side: celery_redislock's RedLock and pottery's Redlock on 3 masters.

    python -m bench.quorum [--cycles 2000] [--stalled-reps 20]

Three private redis-server processes on loopback (never a server this did not start);
one run measures both libraries on the same servers and prints one table:

1. uncontended acquire+release cycles per second (one process, one thread);
2. acquire+release latency with one of the three masters stalled (SIGSTOP): a quorum
   lock should keep working, at the cost of its per-node timeout;
3. the time an acquire takes to give up when two of three masters are stalled, and
   what it reports.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import time
import warnings
from typing import Any

import redis

from celery_redislock import LockQuorumError, RedLock
from celery_redislock.testing import RedisServer

LIBS = ("ours", "pottery")
LABELS = {"ours": "celery_redislock RedLock", "pottery": "pottery Redlock"}
NODE_TIMEOUT = 0.1


def make(lib: str, clients: list[redis.Redis], name: str, ttl: float) -> Any:
    if lib == "ours":
        return RedLock(clients, name, ttl=ttl, node_timeout=NODE_TIMEOUT, auto_renew=False)
    from pottery import Redlock

    return Redlock(key=name, masters=set(clients), auto_release_time=ttl)


def cycle(lock: Any) -> bool:
    if not lock.acquire(blocking=False):
        return False
    lock.release()
    return True


def uncontended(lib: str, clients: list[redis.Redis], cycles: int) -> float:
    best = 0.0
    for attempt in range(3):
        lock = make(lib, clients, f"bench:q:unc:{lib}:{attempt}", 30.0)
        for _ in range(max(50, cycles // 10)):
            assert cycle(lock)
        started = time.perf_counter()
        for _ in range(cycles):
            cycle(lock)
        best = max(best, cycles / (time.perf_counter() - started))
    return best


def stalled(lib: str, clients: list[redis.Redis], node: RedisServer, reps: int) -> dict[str, Any]:
    times: list[float] = []
    ok = 0
    node.signal(signal.SIGSTOP)
    try:
        for i in range(reps):
            lock = make(lib, clients, f"bench:q:stall:{lib}:{i}", 10.0)
            started = time.perf_counter()
            with contextlib.suppress(Exception):  # a library that raises: a failed cycle
                ok += cycle(lock)
            times.append(time.perf_counter() - started)
    finally:
        node.signal(signal.SIGCONT)
    return {"ok": ok, "reps": reps, "p50": statistics.median(times), "max": max(times)}


def majority_down(lib: str, clients: list[redis.Redis], nodes: list[RedisServer]) -> dict[str, Any]:
    for node in nodes:
        node.signal(signal.SIGSTOP)
    try:
        lock = make(lib, clients, f"bench:q:down:{lib}", 10.0)
        started = time.perf_counter()
        try:
            got = lock.acquire(blocking=False)
            outcome = "acquired (!)" if got else "returned False"
        except LockQuorumError as exc:
            outcome = f"LockQuorumError naming {len(exc.failures)} nodes"
        except Exception as exc:  # whatever the library raises
            outcome = type(exc).__name__
        return {"seconds": time.perf_counter() - started, "outcome": outcome}
    finally:
        for node in nodes:
            node.signal(signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=2000, help="timed uncontended cycles")
    parser.add_argument("--stalled-reps", type=int, default=20, help="cycles with a node stalled")
    parser.add_argument("--libs", default=",".join(LIBS), help="comma list from ours,pottery")
    args = parser.parse_args(argv)
    libs = [x for x in args.libs.split(",") if x]
    warnings.simplefilter("ignore")
    servers = [RedisServer().start() for _ in range(3)]
    os.environ["REDIS_URL"] = servers[0].url  # pottery's import-time default: ours, never 6379
    rows: dict[str, dict[str, Any]] = {}
    try:
        clients = [s.client(socket_timeout=1, socket_connect_timeout=1) for s in servers]
        for lib in libs:
            rows[lib] = {
                "uncontended": uncontended(lib, clients, args.cycles),
                "stalled": stalled(lib, clients, servers[1], args.stalled_reps),
                "down": majority_down(lib, clients, servers[1:]),
            }
            for client in clients:  # connections to stalled servers may be half-read
                client.connection_pool.disconnect()
    finally:
        for server in servers:
            server.cleanup()
    width = 30
    head = "".join(f"{LABELS[lib]:>{width}}" for lib in libs)
    out = [
        "",
        f"Quorum locks on 3 masters: redis-server on loopback, {os.cpu_count()} CPUs, Python "
        f"{sys.version.split()[0]}, redis-py {redis.__version__} (ours: node_timeout "
        f"{NODE_TIMEOUT}s)",
        "",
        f"{'':44}{head}",
        "-" * (44 + width * len(libs)),
    ]

    def row(label: str, cell: Any) -> None:
        out.append(f"{label:44}" + "".join(f"{cell(rows[lib]):>{width}}" for lib in libs))

    row("1 uncontended acquire+release /s", lambda r: f"{r['uncontended']:.0f}")
    row(
        "2 one of 3 stalled: cycles that worked",
        lambda r: f"{r['stalled']['ok']}/{r['stalled']['reps']}",
    )
    row("2 one of 3 stalled: cycle p50 ms", lambda r: f"{r['stalled']['p50'] * 1e3:.1f}")
    row("2 one of 3 stalled: cycle max ms", lambda r: f"{r['stalled']['max'] * 1e3:.1f}")
    row("3 two of 3 stalled: time to give up ms", lambda r: f"{r['down']['seconds'] * 1e3:.0f}")
    row("3 two of 3 stalled: outcome", lambda r: r["down"]["outcome"])
    if "ours" in rows and "pottery" in rows:
        ratio = rows["ours"]["uncontended"] / rows["pottery"]["uncontended"]
        out += ["", f"uncontended ours / pottery = {ratio:.2f}x"]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
