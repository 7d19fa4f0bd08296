"""The worker process of bench/semaphores.py's hot key (spawned, so importable here).

It bounds its own lifetime: every wait has a timeout and the loop ends on a deadline.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ._semlibs import make
from ._workers import _sleep_until

monotonic = time.monotonic


def hot_worker(
    lib: str,
    url: str,
    name: str,
    limit: int,
    hold: float,
    work: float,
    timeout: float,
    duration: float,
    ready_q: Any,
    go: Any,
    start_at: Any,
    out_q: Any,
) -> None:
    """acquire -> hold -> release -> work, until start_at + duration; report every section
    as (t_attempt, t_acquired, t_release_called, t_release_returned) on the shared
    monotonic clock, and the acquires that timed out."""
    warnings.simplefilter("ignore")
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=15, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0)
        )
        sem = make(lib, client, name, limit, 10.0)
        warm = make(lib, client, f"{name}:warm:{os.getpid()}", limit, 10.0)
        assert warm.acquire(5.0)  # scripts, watchdog, connections: set up before the clock
        warm.release()
        ready_q.put(os.getpid())
        if not go.wait(60):
            out_q.put((os.getpid(), "error", "go not received"))
            return
        t_start = start_at.value
        t_end = t_start + duration
        _sleep_until(t_start)
        records: list[tuple[float, float, float, float]] = []
        timeouts = 0
        while True:
            t_attempt = monotonic()
            if t_attempt >= t_end:
                break
            if not sem.acquire(timeout):
                timeouts += 1
                continue
            t_acquired = monotonic()
            time.sleep(hold)
            t_release = monotonic()
            sem.release()
            records.append((t_attempt, t_acquired, t_release, monotonic()))
            if work:
                time.sleep(work)
        out_q.put((os.getpid(), records, timeouts))
    except Exception:
        out_q.put((os.getpid(), "error", traceback.format_exc()))
