"""The contended hand-over, part by part: where ours spends what the one-token floor does not.

Two measurements, in one run, on one private ``redis-server``:

1. **Inside the processes.** ``--procs`` processes take turns on one lock (``--hold-ms`` in,
   ``--work-ms`` out), first with ``RedisLock`` and then with the one-token floor (a list
   holding one token: acquire ``BLPOP``, release ``LPUSH``), ``--rounds`` times in turn.
   Each hand-over is timed on the machine's monotonic clock, shared by the processes:
   the holder's release call, the moment the waiter's blocking read returned (ours: its
   box read, ``BLPOP`` on a list of its own, see ``celery_redislock._lone_waiter``; timed
   by wrapping ``_lone_waiter.pop_box`` in the benchmark's processes only), and the
   waiter's acquire returning. Hand-overs whose waiter did not wake on its box (a
   subscriber wake-up, a retry) are counted apart and left out of the parts.
2. **On the server.** ``INFO commandstats`` around each of ``--calls`` calls: the release
   that grants the lock to a waiter's box, a release with nobody in line, an uncontended
   acquire, a no-op script (``return 1``), one ``redis.call`` inside a script, and
   ``LPUSH``; the per-call cost of a script is what bounds the grant's server time.

Ratios are within the run: compare them, not the absolute times, across machines.

    python -m bench.handoff_parts                 # ~30 s
    python -m bench.handoff_parts --rounds 5 --duration 4
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing as mp
import statistics
import sys
import time
import warnings
from typing import Any

import redis

from celery_redislock.testing import RedisServer

from ._libs import seed_token

mono = time.monotonic_ns


def _worker(
    lib: str,
    url: str,
    name: str,
    hold: float,
    work: float,
    start_at: float,
    duration: float,
    out: Any,
) -> None:
    """Take turns on ``name`` until ``start_at + duration``; report each section's times."""
    warnings.simplefilter("ignore")
    client = redis.Redis.from_url(url, socket_timeout=15)
    marks: dict[str, int] = {}
    if lib == "ours":
        from celery_redislock import RedisLock, _lone_waiter

        untimed = _lone_waiter.pop_box

        def pop_box(*args: Any, **kwargs: Any) -> Any:
            reply = untimed(*args, **kwargs)
            marks["pop"] = mono()
            return reply

        _lone_waiter.pop_box = pop_box  # type: ignore[assignment]
        lock = RedisLock(client, name, ttl=10)

        def acquire() -> bool:
            return lock.acquire(timeout=5)

        release = lock.release
    else:

        def acquire() -> bool:
            found = client.blpop([name], timeout=5)
            marks["pop"] = mono()
            return found is not None

        def release() -> None:
            client.lpush(name, "token")

    client.ping()
    while time.time() < start_at:
        time.sleep(0.001)
    end = start_at + duration
    records = []
    while time.time() < end:
        marks.clear()
        if not acquire():
            continue
        acquired = mono()
        popped = marks.get("pop")
        time.sleep(hold)
        released = mono()
        release()
        records.append((acquired, released, popped))
        time.sleep(work)
    out.put(records)


def _round(ctx: Any, lib: str, url: str, args: argparse.Namespace, n: int) -> dict[str, Any]:
    name = f"parts:{lib}:{n}"
    if lib == "token":
        seed_token(redis.Redis.from_url(url), name)
    out = ctx.Queue()
    start_at = time.time() + 1.5
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                lib,
                url,
                name,
                args.hold_ms / 1000,
                args.work_ms / 1000,
                start_at,
                args.duration,
                out,
            ),
        )
        for _ in range(args.procs)
    ]
    for p in procs:
        p.start()
    records = [r for _ in procs for r in out.get(timeout=args.duration + 60)]
    for p in procs:
        p.join(10)
    # No overlap: by the clock all processes share, each section starts after the one
    # before it began to release.
    ordered = sorted(records)
    overlaps = sum(1 for a, b in zip(ordered, ordered[1:]) if b[0] <= a[1])
    releases = sorted(r[1] for r in records)
    parts: dict[str, list[float]] = {"gap": [], "release -> pop": [], "pop -> acquired": []}
    apart = 0
    for acquired, _, popped in records:
        i = bisect.bisect_left(releases, acquired) - 1
        if i < 0:
            continue  # the first section of the round
        released = releases[i]
        if popped is None or not released < popped <= acquired:
            apart += 1
            continue
        parts["gap"].append((acquired - released) / 1000)
        parts["release -> pop"].append((popped - released) / 1000)
        parts["pop -> acquired"].append((acquired - popped) / 1000)
    return {"sections": len(records), "apart": apart, "parts": parts, "overlaps": overlaps}


def _server_times(client: redis.Redis, calls: int) -> dict[str, float]:
    """Server µs per call (INFO commandstats), each kind measured alone."""
    from celery_redislock._keyspace import LockKeys
    from celery_redislock._scripts import scripts_for

    scripts = scripts_for(client)
    for script in (scripts.acquire, scripts.release):
        client.script_load(script.script)
    noop = client.script_load("return 1")
    one_call = client.script_load("redis.call('exists', KEYS[1]) return 1")
    keys = LockKeys.for_name("parts:server")
    box = b"L0123456789abcdef"

    def evalsha(sha: str, k: list[Any], a: list[Any]) -> Any:
        return client.evalsha(sha, len(k), *k, *a)

    def clear() -> None:
        client.delete(keys.lock, keys.waiters, keys.claims, keys.wake, keys.channel + b":" + box)

    def in_line(i: int) -> None:
        clear()
        evalsha(scripts.acquire.sha, keys.acquire_keys(), ["A", 10000])
        wake = box + b":7.%d" % i
        evalsha(scripts.acquire.sha, keys.acquire_keys(), ["B", 10000, 300, "", "first", wake])

    def held(i: int) -> None:
        clear()
        evalsha(scripts.acquire.sha, keys.acquire_keys(), ["A", 10000])

    kinds = [
        (
            "release granting to a box",
            in_line,
            lambda i: evalsha(scripts.release.sha, keys.release_keys(), ["A"]),
        ),
        (
            "release, nobody in line",
            held,
            lambda i: evalsha(scripts.release.sha, keys.release_keys(), ["A"]),
        ),
        (
            "acquire, free",
            lambda i: clear(),
            lambda i: evalsha(scripts.acquire.sha, keys.acquire_keys(), ["A", 10000]),
        ),
        ("script: return 1", lambda i: None, lambda i: evalsha(noop, [], [])),
        ("script: one redis.call", lambda i: None, lambda i: evalsha(one_call, [keys.lock], [])),
    ]
    found: dict[str, float] = {}
    for label, setup, call in kinds:
        used = spent = 0
        for i in range(calls):
            setup(i)
            before = client.info("commandstats").get("cmdstat_evalsha", {})
            call(i)
            after = client.info("commandstats")["cmdstat_evalsha"]
            used += after["calls"] - before.get("calls", 0)
            spent += after["usec"] - before.get("usec", 0)
        found[label] = spent / max(used, 1)
    client.config_resetstat()
    for _ in range(calls):
        client.lpush("parts:lpush", "t")
        client.lpop("parts:lpush")
    found["LPUSH"] = float(client.info("commandstats")["cmdstat_lpush"]["usec_per_call"])
    clear()
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.handoff_parts", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--procs", type=int, default=4, help="processes taking turns (4)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per round and kind (3)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="rounds of ours and the floor in turn (3)"
    )
    ap.add_argument("--hold-ms", type=float, default=1.0, help="time in the lock (1 ms)")
    ap.add_argument("--work-ms", type=float, default=1.0, help="time out of the lock (1 ms)")
    ap.add_argument("--calls", type=int, default=1000, help="calls per kind on the server (1000)")
    args = ap.parse_args(argv)
    if not (1 <= args.procs <= 16 and 0 < args.duration <= 60 and 1 <= args.rounds <= 20):
        ap.error("--procs 1 to 16, --duration up to 60 s, --rounds 1 to 20")
    if not 10 <= args.calls <= 100_000:
        ap.error("--calls 10 to 100000")
    if not (0 <= args.hold_ms <= 1000 and 0 <= args.work_ms <= 1000):
        ap.error("--hold-ms and --work-ms 0 to 1000")
    ctx = mp.get_context("spawn")
    with RedisServer() as server:
        client = server.client()
        version = client.info("server")["redis_version"]
        print(
            f"private redis-server {version} (pid {server.pid}); {args.procs} processes, "
            f"{args.hold_ms} ms in, {args.work_ms} ms out",
            flush=True,
        )
        medians: dict[str, dict[str, list[float]]] = {"ours": {}, "token": {}}
        apart = {"ours": 0, "token": 0}
        overlaps = {"ours": 0, "token": 0}
        sections = {"ours": 0, "token": 0}
        for n in range(args.rounds):
            for lib in ("ours", "token"):
                found = _round(ctx, lib, server.url, args, n)
                apart[lib] += found["apart"]
                overlaps[lib] += found["overlaps"]
                sections[lib] += found["sections"]
                line = []
                for part, values in found["parts"].items():
                    if values:
                        medians[lib].setdefault(part, []).append(statistics.median(values))
                        line.append(f"{part} {statistics.median(values):6.1f}")
                print(
                    f"  round {n + 1} {lib:5s} sections {found['sections']:5d}  "
                    + "  ".join(line)
                    + " us (medians)",
                    flush=True,
                )
        server_us = _server_times(client, args.calls)
    print("\nThe contended hand-over, part by part (median of the rounds' medians, us):\n")
    print(f"  {'part':18s} {'ours':>8s} {'token floor':>12s} {'ours - floor':>13s}")
    for part in ("release -> pop", "pop -> acquired", "gap"):
        ours = statistics.median(medians["ours"].get(part) or [float("nan")])
        floor = statistics.median(medians["token"].get(part) or [float("nan")])
        print(f"  {part:18s} {ours:8.1f} {floor:12.1f} {ours - floor:13.1f}")
    gaps = [o / t for o, t in zip(medians["ours"].get("gap", []), medians["token"].get("gap", []))]
    if gaps:
        print(
            "\n  median gap / token floor, within each round: "
            + ", ".join(f"{g:.2f}" for g in gaps)
            + f" (median {statistics.median(gaps):.2f}; target <= 1.25)"
        )
    print(
        f"  hand-overs left out (not a wake-up on the box): ours {apart['ours']}, "
        f"token {apart['token']}"
    )
    print(
        f"  sections: ours {sections['ours']}, token {sections['token']}; overlapping "
        f"sections: ours {overlaps['ours']}, token {overlaps['token']}"
    )
    print("\nServer time per call (INFO commandstats), us:\n")
    for label, us in server_us.items():
        print(f"  {label:28s} {us:6.2f}")
    grant, lpush = server_us["release granting to a box"], server_us["LPUSH"]
    per_call = server_us["script: one redis.call"] - server_us["script: return 1"]
    own = server_us["script: return 1"]
    print(
        f"\n  the grant's server time over LPUSH: {grant - lpush:.1f} us; a script's own cost "
        f"{own:.1f} us, each redis.call in it about {per_call:.1f} us"
    )
    return 1 if overlaps["ours"] or not sections["ours"] or not sections["token"] else 0


if __name__ == "__main__":
    sys.exit(main())
