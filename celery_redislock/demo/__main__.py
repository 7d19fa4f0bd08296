"""Settle payments with a real Celery worker, without and with ``LockedTask``, side by side.

    python -m celery_redislock.demo                      # own redis-server, stopped after
    python -m celery_redislock.demo --redis-url redis://host:6379/0 --broker-url amqp://...

The demo starts a real prefork worker, publishes the same payments twice — first to a
task that updates balances with a plain read-modify-write, then to the same task under
``LockedTask(lock_key="account:{account}")`` — shows live progress, and prints a table:
lost updates, exact balances, how many tasks were parked behind their account's holder,
and the time taken against the ideal. Everything it writes lives under one random key
prefix and its own queue, and is deleted at the end; it stops every process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import redis


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m celery_redislock.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--redis-url", help="Redis for locks and balances (default: start one)")
    parser.add_argument("--broker-url", help="Celery broker (default: the Redis above)")
    parser.add_argument("--payments", type=int, default=300, help="payments to settle (300)")
    parser.add_argument("--accounts", type=int, default=5, help="accounts they go to (5)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker processes (4)")
    parser.add_argument("--work", type=float, default=0.02, help="seconds per settlement (0.02)")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the payments")
    parser.add_argument(
        "--external-worker",
        action="store_true",
        help="do not start a worker: one runs elsewhere (docker compose)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after (300 s)")
    args = parser.parse_args(argv)
    for name in ("payments", "accounts", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.work <= 0:
        parser.error("--work must be > 0")
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
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
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


def progress(label: str, done: int, total: int, started: float) -> None:
    width = 30
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    elapsed = time.monotonic() - started
    line = f"  {label:<18} [{bar}] {done:>4}/{total}  {elapsed:5.2f}s"
    # On a terminal the line redraws itself; in a log each update is its own line.
    sys.stdout.write("\r" + line if sys.stdout.isatty() else line + "\n")
    sys.stdout.flush()


def run_phase(
    label: str,
    task: Any,
    payments: list[tuple[int, int]],
    store: redis.Redis,
    done_key: str,
    timeout: float,
) -> float:
    started = time.monotonic()
    for payment_id, account in payments:
        task.delay(account, payment_id)
    interactive = sys.stdout.isatty()
    last_print = 0.0
    while True:
        done = int(store.get(done_key) or 0)
        now = time.monotonic()
        if interactive or now - last_print >= 1.0 or done >= len(payments):
            progress(label, done, len(payments), started)
            last_print = now
        if done >= len(payments):
            break
        if now - started > timeout:
            raise SystemExit(f"\n{label}: only {done}/{len(payments)} settled within {timeout}s")
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    if interactive:
        sys.stdout.write("\n")
    return elapsed


def outcome(
    store: redis.Redis,
    prefix: str,
    phase: str,
    payments: list[tuple[int, int]],
    amounts: dict[int, int],
    accounts: int,
) -> tuple[int, int]:
    """(lost updates, accounts whose balance is exact)."""
    lost = 0
    exact = 0
    for account in range(accounts):
        applied = set(json.loads(store.get(f"{prefix}{phase}:account:{account}") or "[]"))
        expected = {pid for pid, acct in payments if acct == account}
        lost += len(expected - applied)
        exact += sum(amounts[p] for p in applied) == sum(amounts[p] for p in expected)
    return lost, exact


def cleanup(store: redis.Redis, prefix: str, queue: str, broker_is_store: bool) -> int:
    removed = 0
    for key in store.scan_iter(match=f"{prefix}*", count=500):
        removed += int(store.delete(key))
    if broker_is_store:
        # The demo's own queues (and their hand-over twins) and kombu's bindings for them.
        for name in (queue, f"{queue}.redislock"):
            for key in (name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}"):
                removed += int(store.delete(key))
    return removed


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rng = random.Random(args.seed)
    payments = [(pid, rng.randrange(args.accounts)) for pid in range(args.payments)]
    amounts = {pid: rng.randrange(100, 10_000) for pid, _ in payments}
    hottest = Counter(acct for _, acct in payments).most_common(1)[0][1]
    ideal = max(hottest * args.work, args.payments * args.work / args.concurrency)
    run_id = secrets.token_hex(4)
    if args.external_worker:  # the worker elsewhere was started with the same DEMO_* settings
        prefix = os.environ.get("DEMO_PREFIX", "redislock-demo:")
        queue = os.environ.get("DEMO_QUEUE", "redislock-demo")
        args.work = float(os.environ.get("DEMO_WORK", args.work))
    else:
        prefix = f"redislock-demo:{run_id}:"
        queue = f"redislock-demo-{run_id}"

    with redis_for(args) as redis_url:
        broker_url = args.broker_url or redis_url
        env = {
            **os.environ,
            "DEMO_REDIS_URL": redis_url,
            "DEMO_BROKER_URL": broker_url,
            "DEMO_PREFIX": prefix,
            "DEMO_QUEUE": queue,
            "DEMO_WORK": str(args.work),
        }
        os.environ.update({k: v for k, v in env.items() if k.startswith("DEMO_")})
        from celery_redislock.demo import app as demo

        store = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
        worker = None if args.external_worker else start_worker(env, args.concurrency, queue, log)
        try:
            print(
                f"worker: prefork x{args.concurrency}; {args.payments} payments over "
                f"{args.accounts} accounts, {args.work * 1000:.0f} ms read-modify-write each"
            )
            if worker is not None:
                wait_ready(store, prefix, worker, log, 60)
            unlocked_time = run_phase(
                "without a lock",
                demo.settle_unlocked,
                payments,
                store,
                f"{prefix}unlocked:done",
                args.timeout,
            )
            locked_time = run_phase(
                "with LockedTask",
                demo.settle_locked,
                payments,
                store,
                f"{prefix}locked:done",
                args.timeout,
            )
            lost_u, exact_u = outcome(store, prefix, "unlocked", payments, amounts, args.accounts)
            lost_l, exact_l = outcome(store, prefix, "locked", payments, amounts, args.accounts)
            parked = demo.parked_count()
        finally:
            if worker is not None:
                stop_worker(worker)
            if os.environ.get("DEMO_SHOW_WORKER_LOG"):
                log.seek(0)
                sys.stdout.write(log.read().decode(errors="replace"))
            log.close()
            demo.app.close()
            removed = cleanup(store, prefix, queue, broker_url == redis_url)
            store.close()

    rows = [
        ("payments settled", f"{args.payments}", f"{args.payments}"),
        ("lost updates", f"{lost_u}", f"{lost_l}"),
        ("exact balances", f"{exact_u} / {args.accounts}", f"{exact_l} / {args.accounts}"),
        ("parked behind the holder", "-", f"{parked}"),
        ("time", f"{unlocked_time:.2f} s", f"{locked_time:.2f} s"),
        ("ideal (hottest account serial)", f"{ideal:.2f} s", f"{ideal:.2f} s"),
        ("time / ideal", f"{unlocked_time / ideal:.2f}x", f"{locked_time / ideal:.2f}x"),
    ]
    print()
    print(f"{'':32}{'without a lock':>18}{'with LockedTask':>18}")
    for label, left, right in rows:
        print(f"{label:32}{left:>18}{right:>18}")
    print(f"\ncleaned up {removed} demo keys; no demo process is left running")
    return 0 if lost_l == 0 and exact_l == args.accounts else 1


if __name__ == "__main__":
    raise SystemExit(main())
