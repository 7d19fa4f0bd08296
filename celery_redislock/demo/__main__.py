"""Four scenes with a real Celery worker, each without and with ``LockedTask``, side by side.

    python -m celery_redislock.demo                      # own redis-server, stopped after
    python -m celery_redislock.demo --scene tenants      # one scene (payments, tenants,
                                                         # merchants or reindex)
    python -m celery_redislock.demo --redis-url redis://host:6379/0 --broker-url amqp://...

The demo starts a real prefork worker and runs its scenes on it, showing live progress:

payments   the same payments published twice, first to a task that updates balances
           with a plain read-modify-write, then to the same task under
           LockedTask(lock_key="account:{account}"); the table shows lost updates,
           exact balances, how many tasks were parked behind their account's holder,
           and the time taken against the ideal.
tenants    a hot tenant floods the pool and small tenants send a few jobs just after
           it, first as a plain task, then under LockedTask(lock_key="tenant:{tenant}",
           lock_limit=2, or --limit); the table shows each tenant's wait (median and
           max) and the most of its jobs seen running at once.
merchants  a partner API allows N calls a second per merchant (--rate, 10/s); a hot
           merchant sends a burst and small merchants a few calls, first as a plain
           task, then under LockedTask(lock_key="merchant:{merchant}", lock_limit=None,
           lock_rate=...); the table shows each merchant's busiest second, the calls the
           partner would refuse, the longest wait and how many calls were deferred to
           their slot (none dropped).
reindex    "rebuild the search index for a user": each user sends a rebuild and, while it
           is taken up, a burst of newer ones, as a plain task, with
           on_contention="replace" and with lock_debounce (--debounce, 0.5 s); the table
           shows the versions each user's rebuilds ran (replace: the first and the
           newest; debounce: the newest) and the version its index ends at.

Everything it writes lives under one random key prefix and its own queue, and is deleted
at the end; it stops every process it started. With ``--external-worker`` the prefix is
the worker's (``DEMO_PREFIX``), and the counts the worker adds to ``<prefix>lock:stats``
(the stats hash under the demo app's lock prefix) stay:
an exporter watching the worker (docker compose) serves them, and they only go up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import redis

from .._keyspace import stats_key
from . import merchants, payments, reindex, tenants

SCENES = {
    "payments": payments.run,
    "tenants": tenants.run,
    "merchants": merchants.run,
    "reindex": reindex.run,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m celery_redislock.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--redis-url", help="Redis for locks and balances (default: start one)")
    parser.add_argument("--broker-url", help="Celery broker (default: the Redis above)")
    parser.add_argument(
        "--scene", choices=["all", *SCENES], default="all", help="the scene to run (all)"
    )
    parser.add_argument("--payments", type=int, default=300, help="payments to settle (300)")
    parser.add_argument("--accounts", type=int, default=5, help="accounts they go to (5)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker processes (4)")
    parser.add_argument("--work", type=float, default=0.02, help="seconds per settlement (0.02)")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the payments")
    parser.add_argument("--limit", type=int, default=2, help="tenants: lock_limit per tenant (2)")
    parser.add_argument("--hot-jobs", type=int, default=40, help="tenants: the hot one's jobs (40)")
    parser.add_argument("--small-tenants", type=int, default=4, help="tenants: small ones (4)")
    parser.add_argument("--small-jobs", type=int, default=3, help="tenants: jobs per small one (3)")
    parser.add_argument(
        "--tenant-work", type=float, default=0.2, help="tenants: seconds per job (0.2)"
    )
    parser.add_argument(
        "--rate", default="10/s", help="merchants: lock_rate per merchant, N/s, N/m ... (10/s)"
    )
    parser.add_argument("--hot-calls", type=int, default=30, help="merchants: the hot one's (30)")
    parser.add_argument("--small-merchants", type=int, default=2, help="merchants: small ones (2)")
    parser.add_argument("--small-calls", type=int, default=3, help="merchants: per small one (3)")
    parser.add_argument(
        "--call-work", type=float, default=0.05, help="merchants: seconds per call (0.05)"
    )
    parser.add_argument("--users", type=int, default=2, help="reindex: users (2)")
    parser.add_argument(
        "--rebuilds", type=int, default=6, help="reindex: rebuild calls per user (6)"
    )
    parser.add_argument(
        "--rebuild-work", type=float, default=0.5, help="reindex: seconds per rebuild (0.5)"
    )
    parser.add_argument(
        "--debounce", type=float, default=0.5, help="reindex: lock_debounce in seconds (0.5)"
    )
    parser.add_argument(
        "--external-worker",
        action="store_true",
        help="do not start a worker: one runs elsewhere (docker compose)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after (300 s)")
    args = parser.parse_args(argv)
    for name in (
        "payments", "accounts", "concurrency", "limit", "hot_jobs", "small_tenants", "small_jobs",
        "hot_calls", "small_merchants", "small_calls", "users",
    ):  # fmt: skip
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rebuilds < 2:
        parser.error("--rebuilds must be at least 2 (a first call and a newer one)")
    for name in ("work", "tenant_work", "call_work", "rebuild_work", "debounce"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    from celery_redislock import LockConfigurationError
    from celery_redislock._rates import parse_rates

    try:
        if len(parse_rates(args.rate, "--rate")) != 1:
            parser.error("--rate must be one rate, such as 10/s")
    except LockConfigurationError as exc:
        parser.error(str(exc))
    return args


@contextlib.contextmanager
def redis_for(args: argparse.Namespace) -> Iterator[str]:
    if args.redis_url:
        yield args.redis_url
        return
    from celery_redislock.testing import RedisServer

    with RedisServer() as server:
        print(f"started redis-server on {server.url} (pid {server.pid}); it is stopped at the end")
        yield server.url


def start_worker(
    env: dict[str, str], concurrency: int, queue: str, log: Any
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "celery", "-A", "celery_redislock.demo.app", "worker",
        "-P", "prefork", "-c", str(concurrency), "-Q", queue, "-l", "warning",
        "-n", f"demo-{secrets.token_hex(3)}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
    )


def stop_worker(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def wait_ready(
    store: redis.Redis,
    prefix: str,
    process: subprocess.Popen[bytes] | None,
    log: Any,
    timeout: float,
) -> None:
    """Wait for the worker's ready mark (no remote-control ping: it leaves broker state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            log.seek(0)
            err = log.read().decode(errors="replace")
            raise SystemExit(f"the worker exited ({process.returncode}):\n{err[-3000:]}")
        if store.exists(f"{prefix}worker-ready"):
            return
        time.sleep(0.1)
    raise SystemExit("no worker answered within the timeout")


def cleanup(
    store: redis.Redis, prefix: str, queue: str, broker_is_store: bool, keep: tuple[str, ...] = ()
) -> int:
    """Delete the demo's keys (but those in ``keep``) and its queues; how many were deleted."""
    removed = 0
    kept = {name.encode() for name in keep}
    for key in store.scan_iter(match=f"{prefix}*", count=500):
        if key not in kept:
            removed += int(store.delete(key))
    if broker_is_store:
        # The demo's own queues (and their hand-over twins) and kombu's bindings for them.
        for name in (queue, f"{queue}.redislock"):
            for key in (name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}"):
                removed += int(store.delete(key))
    return removed


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run_id = secrets.token_hex(4)
    if args.external_worker:  # the worker elsewhere was started with the same DEMO_* settings
        prefix = os.environ.get("DEMO_PREFIX", "redislock-demo:")
        queue = os.environ.get("DEMO_QUEUE", "redislock-demo")
        args.work = float(os.environ.get("DEMO_WORK", args.work))
        args.limit = int(os.environ.get("DEMO_LIMIT", args.limit))
        args.rate = os.environ.get("DEMO_RATE", args.rate)
        args.debounce = float(os.environ.get("DEMO_DEBOUNCE", args.debounce))
    else:
        prefix = f"redislock-demo:{run_id}:"
        queue = f"redislock-demo-{run_id}"
    scenes = list(SCENES) if args.scene == "all" else [args.scene]

    with redis_for(args) as redis_url:
        broker_url = args.broker_url or redis_url
        env = {
            **os.environ,
            "DEMO_REDIS_URL": redis_url,
            "DEMO_BROKER_URL": broker_url,
            "DEMO_PREFIX": prefix,
            "DEMO_QUEUE": queue,
            "DEMO_WORK": str(args.work),
            "DEMO_LIMIT": str(args.limit),
            "DEMO_RATE": args.rate,
            "DEMO_DEBOUNCE": str(args.debounce),
        }
        os.environ.update({k: v for k, v in env.items() if k.startswith("DEMO_")})
        from celery_redislock.demo import app as demo

        store = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
        worker = None if args.external_worker else start_worker(env, args.concurrency, queue, log)
        try:
            print(f"worker: prefork x{args.concurrency}; scenes: {', '.join(scenes)}")
            if worker is not None:
                wait_ready(store, prefix, worker, log, 60)
            passed = [SCENES[scene](args, store, demo) for scene in scenes]
        finally:
            if worker is not None:
                stop_worker(worker)
            if os.environ.get("DEMO_SHOW_WORKER_LOG"):
                log.seek(0)
                sys.stdout.write(log.read().decode(errors="replace"))
            log.close()
            demo.app.close()
            # A worker elsewhere keeps counting into <lock prefix>stats for its exporter:
            # deleting it would reset the counters Prometheus scrapes after every run.
            lock_stats = stats_key(demo.app.conf.redislock_prefix)  # <prefix>lock:stats
            keep = (lock_stats,) if args.external_worker else ()
            removed = cleanup(store, prefix, queue, broker_url == redis_url, keep)
            store.close()

    print(f"\ncleaned up {removed} demo keys; no demo process is left running")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
