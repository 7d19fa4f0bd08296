"""Code that runs in spawned worker processes (importable, so spawn can find it).

Every worker bounds its own lifetime: all waits have timeouts, loops end on a deadline
or a stop event, and threads are daemons joined with a timeout.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings
from typing import Any

import redis

from ._libs import hold_lease, make

monotonic = time.monotonic


def _client(url: str, **kwargs: Any) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=15, socket_connect_timeout=5, **kwargs)


class CountingConnection(redis.Connection):
    """Counts requests written (a command, or a whole pipeline) into a shared slot."""

    slot: Any = None  # (shared array, index, thread lock)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        slot = CountingConnection.slot
        if slot is not None:
            with slot[2]:
                slot[0][slot[1]] += 1
        super().send_packed_command(command, check_health)


def _sleep_until(t: float) -> None:
    while True:
        left = t - monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


# --------------------------------------------------------------------------- scenario 2


def contended_worker(
    lib: str,
    url: str,
    name: str,
    ttl: float,
    hold: float,
    work: float,
    timeout: float,
    duration: float,
    ready_q: Any,
    go: Any,
    start_at: Any,
    out_q: Any,
) -> None:
    """acquire -> hold -> release -> work, until start_at + duration; report every section."""
    warnings.simplefilter("ignore")
    try:
        client = _client(url)
        lock = make(lib, client, name, ttl)
        client.ping()
        ready_q.put(os.getpid())
        if not go.wait(60):
            out_q.put((os.getpid(), "error", "go not received"))
            return
        t_start = start_at.value
        t_end = t_start + duration
        _sleep_until(t_start)
        recs: list[tuple[float, float, float, float]] = []
        fails = 0
        while True:
            t_att = monotonic()
            if t_att >= t_end:
                break
            if not lock.acquire(timeout):
                fails += 1
                continue
            t_acq = monotonic()
            time.sleep(hold)
            t_rel = monotonic()
            lock.release()
            t_rel_end = monotonic()
            recs.append((t_att, t_acq, t_rel, t_rel_end))
            time.sleep(work)
        out_q.put((os.getpid(), recs, fails))
    except Exception:
        out_q.put((os.getpid(), "error", traceback.format_exc()))


# --------------------------------------------------------------------------- scenario 3


def dead_holder(lib: str, url: str, name: str, ttl: float, go: Any, out_q: Any) -> None:
    """Take the lock with a non-renewed lease of ``ttl``, report, then wait to be SIGKILLed."""
    warnings.simplefilter("ignore")
    try:
        client = _client(url)
        lock = hold_lease(lib, client, name, ttl)
        client.ping()
        out_q.put(("ready", os.getpid()))
        if not go.wait(120):
            return
        t_before = monotonic()
        ok = lock.try_acquire()
        t_after = monotonic()
        out_q.put(("acquired", os.getpid(), ok, t_before, t_after))
        time.sleep(30)  # the parent SIGKILLs us long before this; bounded regardless
    except Exception:
        out_q.put(("error", os.getpid(), traceback.format_exc()))


def dead_waiter(
    lib: str, url: str, name: str, ttl: float, timeout: float | None, cmd_q: Any, out_q: Any
) -> None:
    """For each command (start_at): start a blocking acquire at start_at, report, release."""
    warnings.simplefilter("ignore")
    try:
        client = _client(url)
        lock = make(lib, client, name, ttl)
        client.ping()
        out_q.put(("ready", os.getpid()))
        while True:
            cmd = cmd_q.get(timeout=120)
            if cmd is None:
                return
            _sleep_until(cmd)
            t_att = monotonic()
            out_q.put(("waiting", t_att))
            ok = lock.acquire(timeout)
            t_acq = monotonic()
            if ok:
                lock.release()
            out_q.put(("acquired", ok, t_att, t_acq))
    except Exception:
        out_q.put(("error", os.getpid(), traceback.format_exc()))


# --------------------------------------------------------------------------- scenario 4


def many_worker(
    lib: str,
    url: str,
    name: str,
    ttl: float,
    nthreads: int,
    hold: float,
    work: float,
    timeout: float,
    max_seconds: float,
    ready_q: Any,
    go: Any,
    stop: Any,
    counter: Any,
    requests: Any,
    slot: int,
    nprocs: int,
    out_q: Any,
) -> None:
    """``nthreads`` threads, each: acquire -> count -> hold -> release -> work, until stop."""
    warnings.simplefilter("ignore")
    try:
        CountingConnection.slot = (requests, slot, threading.Lock())
        client = _client(url, connection_class=CountingConnection)
        locks = [make(lib, client, name, ttl) for _ in range(nthreads)]
        client.ping()
        done = [0] * nthreads
        fails = [0] * nthreads
        errors: list[str] = []

        def run(i: int) -> None:
            lk = locks[i]
            try:
                if not go.wait(60):
                    return
                # arrivals spread over ~0.1 s (thread i of process `slot`), not one burst
                time.sleep((i * nprocs + slot) * 0.001)
                while not stop.is_set():
                    if not lk.acquire(timeout):
                        fails[i] += 1
                        continue
                    with counter.get_lock():
                        counter.value += 1
                    time.sleep(hold)
                    lk.release()
                    done[i] += 1
                    time.sleep(work)
            except Exception:
                errors.append(traceback.format_exc())

        threads = [
            threading.Thread(target=run, args=(i,), daemon=True, name=f"waiter-{i}")
            for i in range(nthreads)
        ]
        for t in threads:
            t.start()
        ready_q.put(os.getpid())
        go.wait(60)
        deadline = monotonic() + max_seconds + 30
        for t in threads:
            t.join(max(0.0, deadline - monotonic()))
        alive = sum(t.is_alive() for t in threads)
        out_q.put((os.getpid(), sum(done), sum(fails), alive, errors[:3]))
    except Exception:
        out_q.put((os.getpid(), "error", traceback.format_exc()))


# --------------------------------------------------------------------------- scenario 5


def _task_cpu(tid: int) -> float:
    """utime + stime of one thread of this process, in seconds (from /proc)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the comm field: state is fields[0]; utime/stime are stat fields 14/15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def renewal_worker(lib: str, url: str, n: int, ttl: float, hold_s: float, out_q: Any) -> None:
    """Hold ``n`` auto-renewed locks for ``hold_s`` seconds; report renewal round trips and CPU.

    For celery_redislock the main thread polls ``scheduler.round_trips`` every 2 ms
    during the hold, so renewal passes per ``ttl/3`` come from the first to the last
    pass seen (no window-edge rounding); the watchdog thread's CPU comes from
    /proc/self/task/<tid>/stat. Loss reports (``on_lost``) are counted per phase:
    during the hold (real losses) and during the release loop for locks whose
    release() then succeeded (spurious reports).
    """
    warnings.simplefilter("ignore")
    try:
        # python-redis-lock renews with one thread per lock, all on the client's pool;
        # redis-py's default pool stops at 100 connections (MaxConnectionsError), so give
        # it room for every lock (what a user holding that many would have to do).
        client = _client(url, max_connections=n + 10) if lib == "prl" else _client(url)
        thread_errors: list[str] = []

        def hook(args: Any) -> None:  # a renewal thread died (python-redis-lock raises there)
            thread_errors.append(f"{args.exc_type.__name__}: {args.exc_value}")

        threading.excepthook = hook
        probe = _client(url)
        base_conns = int(probe.info("clients")["connected_clients"])
        locks: list[Any] = []
        phase = ["acquire"]
        reports: list[tuple[str, Any]] = []  # (phase, lock name) per on_lost callback
        t0 = monotonic()
        if lib == "ours":
            from celery_redislock import RedisLock
            from celery_redislock._renewal import scheduler_for

            def on_lost(lock: Any, _err: Any) -> None:
                reports.append((phase[0], lock.name))

            for i in range(n):
                lk = RedisLock(client, f"bench:renew:{n}:{i}", ttl=ttl)
                lk.on_lost(on_lost)
                if not lk.acquire(blocking=False):
                    raise RuntimeError("could not take a fresh lock")
                locks.append(lk)
            sched = scheduler_for(client)
            tids = [t.native_id for t in threading.enumerate() if t.name == "redislock-watchdog"]
            if len(tids) != 1:
                raise RuntimeError(f"expected one watchdog thread, found {len(tids)}")
            tid = tids[0]

            def cpu() -> float:
                return _task_cpu(tid)

            threads_used = 1
        elif lib == "prl":
            import redis_lock

            for i in range(n):
                lk = redis_lock.Lock(
                    client, f"bench:renew:{n}:{i}", expire=int(ttl), auto_renewal=True
                )
                if not lk.acquire(blocking=False):
                    raise RuntimeError("could not take a fresh lock")
                locks.append(lk)
            main_tid = threading.main_thread().native_id

            def cpu() -> float:
                # every thread but the (sleeping) main one is a renewal thread
                return time.process_time() - _task_cpu(main_tid)

            threads_used = threading.active_count() - 1
        else:
            raise ValueError(lib)
        acquire_s = monotonic() - t0
        phase[0] = "hold"
        if lib == "ours":
            # Holds taken over a long acquire loop are renewed in several passes until the
            # scheduler merges them; measure the steady state, from the second pass after.
            seen, settle_end = sched.round_trips, monotonic() + 3 * ttl
            while sched.round_trips < seen + 2 and monotonic() < settle_end:
                time.sleep(0.002)
            # round_trips counts a pass when its pipeline is built: let that pass's
            # EVALSHAs reach Redis before the snapshot, so they are not counted twice.
            time.sleep(0.2)
        ev0, cpu0, w0 = _evalsha_calls(probe), cpu(), monotonic()
        pass_times: list[float] = []
        rt0 = rt1 = 0
        if lib == "ours":
            rt0 = last = sched.round_trips
            while monotonic() - w0 < hold_s:
                time.sleep(0.002)
                now_rt = sched.round_trips
                if now_rt != last:
                    pass_times.extend([monotonic()] * (now_rt - last))
                    last = now_rt
            rt1 = sched.round_trips
        else:
            time.sleep(hold_s)
        ev1, cpu1, w1 = _evalsha_calls(probe), cpu(), monotonic()
        conns = int(probe.info("clients")["connected_clients"]) - base_conns
        if lib == "ours":
            lost_hold = len({name for ph, name in reports if ph != "release"})
        else:
            lost_hold = sum(1 for lk in locks if probe.get(lk._name) != lk.id.encode())
        phase[0] = "release"
        t1 = monotonic()
        release_errors = 0
        failed: set[Any] = set()
        for lk in locks:
            try:
                lk.release()
            except Exception:
                release_errors += 1
                failed.add(getattr(lk, "name", None))
        release_s = monotonic() - t1
        time.sleep(0.2)  # let a renewal pass that raced the last releases report
        spurious = len({name for ph, name in reports if ph == "release" and name not in failed})
        interval = ttl / 3
        if lib == "ours":
            if len(pass_times) >= 2:
                passes = (len(pass_times) - 1) / ((pass_times[-1] - pass_times[0]) / interval)
            else:
                passes = (rt1 - rt0) / ((w1 - w0) / interval)
            evalsha_per_pass = (ev1 - ev0) / (rt1 - rt0) if rt1 > rt0 else float("nan")
            rt_per_interval = passes
            evalsha_per_interval = passes * evalsha_per_pass
        else:
            # one EVALSHA (one round trip) per extend; every thread renews on its own
            rt_per_interval = evalsha_per_interval = (ev1 - ev0) / ((w1 - w0) / interval)
        out_q.put(
            {
                "lib": lib,
                "n": n,
                "wall": w1 - w0,
                "rt_per_interval": rt_per_interval,
                "evalsha_per_interval": evalsha_per_interval,
                "evalsha": ev1 - ev0,
                "pass_gaps": [round(b - a, 3) for a, b in zip(pass_times, pass_times[1:])],
                "cpu": cpu1 - cpu0,
                # a release that raises means the lease was already gone (both libraries raise)
                "lost": max(lost_hold, release_errors),
                "lost_during_hold": lost_hold,
                "spurious_loss_reports": spurious if lib == "ours" else None,
                "threads": threads_used,
                "connections": conns,
                "thread_errors": len(thread_errors),
                "thread_error_sample": thread_errors[:1],
                "release_errors": release_errors,
                "acquire_s": acquire_s,
                "release_s": release_s,
            }
        )
    except Exception:
        out_q.put({"lib": lib, "n": n, "error": traceback.format_exc()})
