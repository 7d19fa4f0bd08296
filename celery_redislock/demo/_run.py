"""What the demo's scenes share: send a batch of tasks and follow it until all have run."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import redis


def progress(label: str, done: int, total: int, started: float) -> None:
    width = 30
    filled = int(width * done / total)
    bar = "#" * filled + "." * (width - filled)
    elapsed = time.monotonic() - started
    line = f"  {label:<18} [{bar}] {done:>4}/{total}  {elapsed:5.2f}s"
    # On a terminal the line redraws itself; in a log each update is its own line.
    sys.stdout.write("\r" + line if sys.stdout.isatty() else line + "\n")
    sys.stdout.flush()


def send_and_follow(
    label: str,
    send: Callable[[], None],
    total: int,
    store: redis.Redis,
    done_key: str,
    timeout: float,
) -> float:
    """Call ``send``, then wait until the counter at ``done_key`` reaches ``total``.

    Returns the seconds from the first send to the last task's end; exits the demo when
    ``timeout`` passes first.
    """
    started = time.monotonic()
    send()
    interactive = sys.stdout.isatty()
    last_print = 0.0
    while True:
        done = int(store.get(done_key) or 0)
        now = time.monotonic()
        if interactive or now - last_print >= 1.0 or done >= total:
            progress(label, done, total, started)
            last_print = now
        if done >= total:
            break
        if now - started > timeout:
            raise SystemExit(f"\n{label}: only {done}/{total} done within {timeout}s")
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    if interactive:
        sys.stdout.write("\n")
    return elapsed
