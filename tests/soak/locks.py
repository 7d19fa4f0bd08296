"""Soak part A: fenced acquisitions of one lock under process, connection and server faults.

The processes are the chaos suite's workers (tests/_chaos.py): each critical section
takes the lock with a fresh owner, admits its token at a :class:`FencedResource`, does a
non-atomic read-modify-write of a counter through it, and releases; every event is
logged to a per-process file. They reach Redis through a :class:`DropProxy`; the
controller's own connection goes straight to the server. Faults, at random intervals:

* ``sigkill``: SIGKILL a process (the holder when there is one); a replacement starts
  at the first item its slot has not completed;
* ``stop-brief`` / ``stop-past-lease``: SIGSTOP a process (the holder when there is
  one) for a fraction of the lease or past it, then SIGCONT;
* ``proxy-drop``: cut every client connection at the proxy;
* ``redis-restart``: SIGKILL the redis-server (AOF, ``appendfsync always``) and start it
  again on the same port, at evenly spaced points of the work.

Oracles: the chaos suite's analysis (stale writes admitted, overlapping valid-lease
intervals, lost updates, token order, every item completed), plus progress: every slot
that still had work acquired the lock in every phase between restarts that lasted 30 s
or more.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from redis.exceptions import RedisError

from celery_redislock._core import LockKeys
from celery_redislock.testing import RedisServer

from .. import _chaos
from .._chaos import Fault, Swarm, analyse
from .proxy import DropProxy

LOCK_NAME = "soak"

#: A phase between restarts shorter than this is not judged for every slot's progress.
MIN_PHASE = 30.0

#: Relative weights of the random faults (restarts are scheduled, not drawn).
WEIGHTS = {"sigkill": 2, "stop-brief": 3, "stop-past-lease": 2, "proxy-drop": 3}


@dataclass
class LockParams:
    acquisitions: int = 20_000
    processes: int = 8
    ttl: float = 1.0
    hold_max: float = 0.01
    pause_max: float = 0.002
    restarts: int = 2
    downtime: tuple[float, float] = (0.2, 1.5)
    fault_gap: tuple[float, float] = (0.25, 1.0)
    minutes: float = 25.0
    seed: int = 1
    defeat: str = ""


@dataclass
class PartResult:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    #: What is worth knowing but breaks no guarantee of the lock (e.g. a worker crash).
    notes: list[str] = field(default_factory=list)
    #: Log lines about the task ids that violations name.
    evidence: list[str] = field(default_factory=list)
    elapsed: float = 0.0


def slash(*values: object) -> str:
    """Table cell: the values joined by " / " (the label names them in the same order)."""
    return " / ".join(str(x) for x in values)


def _counter(admin: object) -> int | None:
    try:
        raw = admin.get(_chaos.COUNTER)  # type: ignore[attr-defined]
    except RedisError:
        return None
    return _chaos._parse_counter(raw)[0]


def _tokens(admin: object, key: bytes) -> int | None:
    try:
        return int(admin.get(key) or 0)  # type: ignore[attr-defined]
    except RedisError:
        return None


def run_locks(p: LockParams, log_dir: Path, say: Callable[[str], None]) -> PartResult:
    result = PartResult("A. fenced acquisitions")
    rng = random.Random(p.seed)
    items = math.ceil(p.acquisitions / p.processes)
    total = items * p.processes
    bound = p.minutes * 60
    server = RedisServer(appendonly=True, appendfsync="always").start()
    proxy = DropProxy(server.port).start()
    swarm = Swarm(
        proxy.port, LOCK_NAME, log_dir, slots=p.processes, items=items, ttl=p.ttl,
        hold_max=p.hold_max, pause_max=p.pause_max, seed=p.seed, defeat=p.defeat,
        lifetime=bound,
    )  # fmt: skip
    swarm.admin.close()
    swarm.admin = server.client(socket_timeout=2, socket_connect_timeout=1)  # not proxied
    fence_key = LockKeys.for_name(LOCK_NAME).fence
    restart_at = [total * (k + 1) // (p.restarts + 1) for k in range(p.restarts)]
    restarts: list[Fault] = []
    kinds = list(WEIGHTS)
    weights = [WEIGHTS[k] for k in kinds]
    first_kinds = rng.sample(kinds, len(kinds))
    say(
        f"[A] {p.processes} processes x {items} sections (>= {total} fenced acquisitions), "
        f"ttl {p.ttl}s, AOF appendfsync always, {p.restarts} restart(s), seed {p.seed}"
    )
    started = time.monotonic()
    deadline = started + bound
    finished = False
    counter_raw: bytes | None = None
    # The processes' own warnings (lost leases, reconnections) go to a file, not the table.
    stderr_path = log_dir / "processes.stderr"
    saved_stderr = os.dup(2)
    sys.stderr.flush()
    with stderr_path.open("ab") as sink:
        os.dup2(sink.fileno(), 2)
    stops = Stops(swarm)
    try:
        swarm.start()
        next_report = started + 10
        while True:
            stops.wake_due()
            if not swarm.alive():
                finished = True
                break
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_report:
                next_report = now + 10
                say(_progress(swarm, started, total, fence_key, proxy))
            gap = rng.uniform(*p.fault_gap) if not first_kinds else rng.uniform(0.05, 0.15)
            time.sleep(min(gap, max(0.01, stops.next_due() - now)))
            stops.wake_due()
            done = _counter(swarm.admin)
            if restart_at and done is not None and done >= restart_at[0]:
                restart_at.pop(0)
                t0 = time.monotonic()
                server.kill()
                down = rng.uniform(*p.downtime)
                time.sleep(down)
                server.start(server.port)
                fault = Fault("redis-restart", t0, time.monotonic(), None, f"{down:.2f}s down")
                swarm.faults.append(fault)
                restarts.append(fault)
                say(f"[A] redis-server restarted at {done}/{total} sections ({down:.2f}s down)")
                continue
            # Every kind once first (in a random order), so a short run sees each of them.
            kind = first_kinds.pop() if first_kinds else rng.choices(kinds, weights)[0]
            if kind == "proxy-drop":
                t0 = time.monotonic()
                cut = proxy.drop()
                swarm.faults.append(Fault(kind, t0, time.monotonic(), None, f"{cut} conns"))
                continue
            pid = swarm.victim(rng)
            if pid is not None and kind != "sigkill" and pid in stops.until:
                running = sorted(set(swarm.members) - set(stops.until))  # stop another
                pid = rng.choice(running) if running else None
            if pid is None:
                if len(first_kinds) < len(kinds) and kind not in first_kinds:
                    first_kinds.append(kind)  # not done yet: next time
                continue
            if kind == "sigkill":
                stops.wake(pid)  # a stopped process dies too; its pause ends here
                swarm.kill(pid)
            else:
                span = (0.05, 0.3) if kind == "stop-brief" else (1.3, 2.2)
                stops.stop(pid, p.ttl * rng.uniform(*span), kind)
        stops.wake_all()
        for _ in range(50):
            try:
                counter_raw = swarm.admin.get(_chaos.COUNTER)
                break
            except RedisError:
                time.sleep(0.1)
        tokens = _tokens(swarm.admin, fence_key)
    finally:
        stops.wake_all()
        swarm.shutdown()
        proxy.close()
        server.cleanup()
        sys.stderr.flush()
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
    result.elapsed = time.monotonic() - started
    say(f"[A] work {'done' if finished else 'NOT done'} in {result.elapsed:.0f}s; analysing")

    report = analyse(
        swarm.log_paths(),
        counter_raw=counter_raw,
        expected_items=swarm.expected_items(),
        kills=swarm.kills,
        faults=swarm.faults,
    )
    v = result.violations
    v.extend(report.violations)
    if not finished:
        v.append(f"the work did not complete within {p.minutes:g} minutes")
    codes = swarm.exit_codes()
    bad = {pid: code for pid, code in codes.items() if code != 0}
    if bad:
        v.append(f"processes exited abnormally: {dict(list(bad.items())[:10])}")
    members = [*swarm.finished.values(), *swarm.members.values()]
    slot_of = {m.log_path: m.slot for m in members}
    acq_times: dict[int, list[float]] = {slot: [] for slot in range(p.processes)}
    finish_at: dict[int, float] = {}
    gave_up = 0
    for path, slot in slot_of.items():
        for r in _chaos._read_log(path):
            if r.get("ev") == "acq":
                acq_times[slot].append(r["t"])
            elif r.get("ev") == "finish":
                finish_at[slot] = r["t"]
            elif r.get("ev") == "gave-up":
                gave_up += 1
    if len(restarts) < p.restarts:
        v.append(f"only {len(restarts)} of {p.restarts} restarts happened before the work ran out")
    if gave_up:
        v.append(f"{gave_up} processes gave up (lifetime over) before completing their items")
    # Phases: between restarts. A slot with work left at a phase's start must acquire in
    # it, if the phase is long enough to tell: a few faults in a row (a SIGSTOP past the
    # lease, a killed waiter's place lapsing) can keep one slot out for seconds.
    ends = [started, *(x for f in restarts for x in (f.t0, f.t1)), started + result.elapsed]
    phases = [(ends[i], ends[i + 1]) for i in range(0, len(ends), 2)]
    per_phase_min: list[str] = []
    for index, (a, b) in enumerate(phases):
        counts = []
        for slot, times in acq_times.items():
            if finish_at.get(slot, math.inf) < a:
                continue
            n = sum(1 for t in times if a <= t < b)
            counts.append(n)
            if n == 0 and b - a >= MIN_PHASE:
                v.append(f"slot {slot} made no acquisition in phase {index + 1} ({b - a:.1f}s)")
        judged = "" if b - a >= MIN_PHASE else f" (not judged: {b - a:.0f}s)"
        per_phase_min.append(f"{min(counts, default=0)}{judged}")
    # The longest any slot waited between two of its acquisitions (or from its start).
    longest = 0.0
    for times in acq_times.values():
        marks = sorted([started, *times])
        longest = max([longest, *(y - x for x, y in zip(marks, marks[1:]))])

    kinds_seen: dict[str, int] = {}
    for f in swarm.faults:
        kinds_seen[f.kind] = kinds_seen.get(f.kind, 0) + 1
    replaced = sum(1 for m in members if m.gen > 1)
    stale_accepted = sum(
        1 for x in report.violations if x.startswith(("stale write admitted", "admitted out of"))
    )
    overlaps = sum(
        1 for x in report.violations if x.startswith("overlap") or "fenced off although" in x
    )
    lost_updates = sum(1 for x in report.violations if x.startswith("lost update"))
    items_done = report.completed
    per_slot = [len(t) for t in acq_times.values()]
    fault_kinds = ("sigkill", "stop-brief", "stop-past-lease", "proxy-drop", "redis-restart")
    r = report
    result.rows = [
        ("processes (slots) / started in all / replacements",
         slash(p.processes, len(members), replaced)),
        ("fenced acquisitions (acquired sections / tokens issued)", slash(r.acquisitions, tokens)),
        ("acquisitions per slot (min / max)", slash(min(per_slot), max(per_slot))),
        ("longest a slot went without acquiring", f"{longest:.1f}s"),
        ("acquisitions per slot per phase (min over slots, each phase)", slash(*per_phase_min)),
        ("sections entered", slash(r.sections)),
        ("fenced writes admitted / stale rejected / outcome unknown (landed)",
         f"{slash(r.completed, r.rejected, r.unknown)} ({r.landed_unknown})"),
        ("stale writes accepted", slash(stale_accepted)),
        ("overlaps of valid leases (intervals checked)", f"{overlaps} ({r.intervals})"),
        ("lost updates", slash(lost_updates)),
        ("expected sections completed", slash(items_done, total)),
        ("counter at the end", slash(r.counter)),
        ("lost-lease reports / releases that found the lease lost",
         slash(r.lost_reports, r.lost_releases)),
        ("warnings logged by the processes (lost lease / reconnect)", _warnings(stderr_path)),
        ("faults: " + " / ".join(fault_kinds), slash(*(kinds_seen.get(k, 0) for k in fault_kinds))),
        ("faults that hit the holder / connections accepted by the proxy",
         slash(swarm.victims_holding, proxy.accepted)),
        ("violations", slash(len(v))),
        ("elapsed", f"{result.elapsed:.0f}s"),
    ]  # fmt: skip
    return result


class Stops:
    """SIGSTOPped processes, each SIGCONTed when its pause is over (without blocking the
    fault loop: pauses overlap each other and the other faults)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.until: dict[int, tuple[float, float, str]] = {}  # pid -> (t0, until, kind)

    def stop(self, pid: int, seconds: float, kind: str) -> None:
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        self.until[pid] = (t0, t0 + seconds, kind)

    def next_due(self) -> float:
        return min((u for _, u, _ in self.until.values()), default=math.inf)

    def wake(self, pid: int) -> None:
        found = self.until.pop(pid, None)
        if found is None:
            return
        t0, _, kind = found
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        t1 = time.monotonic()
        self.swarm.faults.append(Fault(kind, t0, t1, pid, f"{t1 - t0:.3f}s"))

    def wake_due(self) -> None:
        now = time.monotonic()
        for pid in [pid for pid, (_, u, _) in self.until.items() if u <= now]:
            self.wake(pid)

    def wake_all(self) -> None:
        for pid in list(self.until):
            self.wake(pid)


def _progress(swarm: Swarm, started: float, total: int, fence_key: bytes, proxy: DropProxy) -> str:
    done = _counter(swarm.admin)
    tokens = _tokens(swarm.admin, fence_key)
    kinds: dict[str, int] = {}
    for f in swarm.faults:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    faults = " ".join(f"{k}={n}" for k, n in sorted(kinds.items())) or "none"
    return (
        f"[A] {time.monotonic() - started:5.0f}s sections {done if done is not None else '?'}"
        f"/{total} tokens {tokens if tokens is not None else '?'} "
        f"processes {len(swarm.members)} faults: {faults}"
    )


def _warnings(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "?"
    return f"{text.count('redislock: lost lock')} / {text.count('connection lost')}"
