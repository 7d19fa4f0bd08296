"""Chaos-suite helpers: worker bodies (spawned processes), a swarm that runs and faults
them, and the analysis of their logs.

Every worker appends one JSON record per event to its own log file with a single
``os.write`` (so a record is on disk before the next step, even if the worker is
SIGKILLed right after). Times are ``time.monotonic()``: CLOCK_MONOTONIC is system-wide
on Linux, so times from different processes on this machine are comparable.

A critical section (one acquisition, with a fresh owner id, so every section has its own
fencing token) does::

    acquire -> "acq"
    admit(token) at the fenced resource; GET counter -> "enter" (token, value read)
    sleep a random hold time (the read-modify-write is deliberately not atomic)
    FencedResource.write(token, counter, value + 1) -> "write" (admitted: true/false/null)
    release -> "release" (ok true; false with the LockLostError reason; null "unconfirmed":
    Redis could not be reached, the release goes on in the background)

Admitting before reading makes the read-modify-write safe under fencing: once a newer
holder has admitted its token, an older holder's write is refused, and any older write
that got in before is visible to the newer holder's read.

Quorum variant (``quorum_ports``): the lock is a :class:`RedLock` over the redis-servers
on those ports (the lock nodes, which the scenarios fault), while the fenced resource
and the counter stay on the server on ``port`` (never faulted). A
:class:`LockQuorumError` from an acquire is logged ("quorum-error", with the failed
nodes) and the attempt retried; one from a release is logged as a failed release.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisError

from celery_redislock import (
    FencedResource,
    LockLostError,
    LockQuorumError,
    RedisLock,
    RedisLockError,
    RedLock,
    signals,
)

COUNTER = "chaos:counter"
RESOURCE = "chaos"
FAKE_TOKENS = "chaos:fake-token"  # only when the lock is deliberately defeated
BARRIER = "chaos:started"  # workers that started (``together``)
#: Faults that may end any holder's lease early (so a killed holder's interval is unproven):
#: a stalled server, killed connections, every connection dropped by a proxy, a restart.
SERVER_FAULTS = ("debug-sleep", "client-kill", "proxy-drop", "redis-restart")
#: Kinds of lock-node faults of the quorum variant (prefixes): any of them may end a
#: holder's lease early, since a hold granted by a bare majority of the nodes needs every
#: one of them (a killed holder's interval that overlaps one is unproven).
NODE_FAULTS = ("node-", "majority-")


def _now() -> float:
    return time.monotonic()


class EventLog:
    """Append-only JSON-lines file written with one os.write per record."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pid = os.getpid()

    def __call__(self, **record: Any) -> None:
        record["pid"] = self.pid
        os.write(self.fd, (json.dumps(record) + "\n").encode())


def _parse_counter(raw: bytes | None) -> tuple[int, str]:
    if raw is None:
        return 0, ""
    value, _, tag = raw.decode().partition("|")
    return int(value), tag


def _retrying(call: Any, *, within: float = 5.0) -> Any:
    """Call until it does not raise a RedisError (faults are transient), at most ``within`` s."""
    deadline = _now() + within
    while True:
        try:
            return call()
        except RedisError:
            if _now() >= deadline:
                raise
            time.sleep(0.02)


def worker(
    port: int,
    name: str,
    ttl: float,
    first: int,
    end: int,
    log_path: str,
    hold_max: float,
    pause_max: float,
    seed: int,
    defeat: str = "",
    quorum_ports: tuple[int, ...] = (),
    node_timeout: float = 0.5,
    lifetime: float = 300.0,
    together: int = 0,
) -> None:
    """Complete items ``first..end-1`` in order, one critical section per attempt.

    An item is done when its fenced write is known to be admitted; otherwise (stale,
    aborted by a connection fault, outcome unknown) the item is tried again.

    ``defeat`` (only for the suite's self-test): "shared-owner" gives every worker the
    same owner (one shared reentrant hold), "no-lock" skips the lock altogether.

    ``quorum_ports``: take a :class:`RedLock` over these lock nodes (``node_timeout``)
    instead of a :class:`RedisLock` on ``port``, which then only holds the resource.

    ``lifetime``: give up (log "gave-up") after this many seconds.

    ``together``: start the work only once this many workers have started (a barrier in
    Redis, for at most 60 s): the self-test's few short sections must run side by side,
    not one worker after another as they are spawned.
    """
    rng = random.Random(seed)
    log = EventLog(log_path)
    pid = os.getpid()
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=5)
    fence = FencedResource(client, RESOURCE)
    nodes = [
        redis.Redis(host="127.0.0.1", port=p, socket_timeout=2, socket_connect_timeout=1)
        for p in quorum_ports
    ]
    if together:
        client.incr(BARRIER)
        ready_by = _now() + 60
        while int(client.get(BARRIER) or 0) < together and _now() < ready_by:
            time.sleep(0.005)
    log(ev="start", first=first, end=end, t=_now())
    item, seq = first, 0
    deadline = _now() + lifetime
    while item < end and _now() < deadline:
        seq += 1
        owner = "shared" if defeat == "shared-owner" else f"w{pid}.{seq}"
        lock: RedisLock | RedLock
        if nodes:
            lock = RedLock(nodes, name, ttl=ttl, owner=owner, node_timeout=node_timeout)
        else:
            lock = RedisLock(client, name, ttl=ttl, owner=owner)
        lock.on_lost(
            lambda _lock, error, o=owner: log(ev="lost", owner=o, reason=error.reason, t=_now())
        )
        if defeat == "no-lock":
            token = int(_retrying(lambda: client.incr(FAKE_TOKENS)))
        else:
            try:
                if not lock.acquire(timeout=5):
                    continue
            except RedisError as exc:  # e.g. a killed connection past redis-py's retries
                log(ev="acquire-error", error=repr(exc), t=_now())
                time.sleep(0.05)
                continue
            except LockQuorumError as exc:  # quorum variant: too few lock nodes answered
                log(ev="quorum-error", failed=sorted(exc.failures), error=str(exc), t=_now())
                time.sleep(0.05)
                continue
            token = lock.token or 0
        log(ev="acq", owner=owner, token=token, t=_now())
        done = _section(client, fence, log, rng, owner, token, item, hold_max)
        if defeat != "no-lock":
            _release(lock, log, owner, token)
        else:
            log(ev="release", owner=owner, token=token, ok=True, t=_now())
        if done:
            item += 1
        time.sleep(rng.uniform(0, pause_max))
    log(ev="finish" if item >= end else "gave-up", t=_now())
    client.close()
    for node in nodes:
        node.close()


def _section(
    client: Any,
    fence: FencedResource,
    log: EventLog,
    rng: random.Random,
    owner: str,
    token: int,
    item: int,
    hold_max: float,
) -> bool:
    t_enter = _now()
    try:
        admit = fence.admit(token)
        t_admit = _now()
        value, prev_tag = _parse_counter(client.get(COUNTER))
    except RedisError as exc:
        log(ev="abort", owner=owner, token=token, error=repr(exc), t=_now())
        return False
    log(
        ev="enter",
        owner=owner,
        token=token,
        item=item,
        read=value,
        admit=admit,
        t_enter=t_enter,
        t_admit=t_admit,
    )
    time.sleep(rng.uniform(0, hold_max))
    tag = f"{owner}:{token}:{item}"
    t_write = _now()
    admitted: bool | None
    broken = False  # the write met a broken connection (not a refusal by the fence)
    try:
        admitted = fence.write(token, COUNTER, f"{value + 1}|{tag}")
    except RedisError:
        broken = True
        # Did it land before the connection broke? The value carries the writer's tag.
        try:
            now_value, now_tag = _parse_counter(_retrying(lambda: client.get(COUNTER)))
        except RedisError:
            admitted = None
        else:
            if now_tag == tag:
                admitted = True
            elif (now_value, now_tag) == (value, prev_tag):
                admitted = False  # not written, and (still) nobody else wrote
            else:
                admitted = None  # overwritten since: unknown, left to the log analysis
    log(
        ev="write",
        owner=owner,
        token=token,
        admitted=admitted,
        broken=broken,
        t_write=t_write,
        t_exit=_now(),
    )
    return admitted is True


def _release(lock: RedisLock | RedLock, log: EventLog, owner: str, token: int) -> None:
    deferred: list[object] = []

    def on_failed(sender: object, **kwargs: object) -> None:
        deferred.append(kwargs.get("error"))

    # A last hold's release that cannot reach Redis does not raise: the hold stops being
    # renewed and the release goes on in the background (lock_release_failed is sent).
    # Whether Redis still had the hold is then unknown ("ok": None), not confirmed.
    signals.lock_release_failed.connect(on_failed, sender=lock)
    try:
        _release_once(lock, log, owner, token, deferred)
    finally:
        signals.lock_release_failed.disconnect(on_failed, sender=lock)


def _release_once(
    lock: RedisLock | RedLock, log: EventLog, owner: str, token: int, deferred: list[object]
) -> None:
    failed = False
    deadline = _now() + 10
    while True:
        try:
            lock.release()
            if deferred:
                log(ev="release", owner=owner, token=token, ok=None, reason="unconfirmed", t=_now())
            else:
                log(ev="release", owner=owner, token=token, ok=True, t=_now())
            return
        except LockLostError as exc:
            # After a failed attempt the first one may have released (reply lost): unknown.
            reason = "ambiguous" if failed else (exc.reason or "lost")
            log(ev="release", owner=owner, token=token, ok=False, reason=reason, t=_now())
            return
        except RedisLockError as exc:  # not owned (after an ambiguous acquire, say)
            log(ev="release", owner=owner, token=token, ok=False, reason=repr(exc), t=_now())
            return
        except RedisError:
            failed = True
            if _now() > deadline:
                log(ev="release", owner=owner, token=token, ok=False, reason="gave up", t=_now())
                return
            time.sleep(0.05)


# ----------------------------------------------------------------------------- the swarm


@dataclass
class Fault:
    kind: str
    t0: float
    t1: float
    pid: int | None = None
    detail: str = ""


@dataclass
class _Member:
    process: Any
    slot: int
    gen: int
    log_path: str
    first: int


class Swarm:
    """Worker processes contending on one lock, each slot owning a range of items.

    A killed worker is replaced by one that starts at the slot's first item not known
    to be done. Every process is SIGCONTed, SIGKILLed and joined by pid in
    :meth:`shutdown`.
    """

    def __init__(
        self,
        port: int,
        name: str,
        log_dir: Path,
        *,
        slots: int,
        items: int,
        ttl: float,
        hold_max: float,
        pause_max: float,
        seed: int,
        defeat: str = "",
        quorum_ports: tuple[int, ...] = (),
        node_timeout: float = 0.5,
        lifetime: float = 300.0,
        together: bool = False,
    ) -> None:
        #: The first workers start their work together (:func:`worker`'s ``together``).
        self.together = together
        self.port = port
        self.name = name
        self.log_dir = log_dir
        self.slots = slots
        self.items = items
        self.ttl = ttl
        self.hold_max = hold_max
        self.pause_max = pause_max
        self.seed = seed
        self.defeat = defeat
        self.lifetime = lifetime
        self.members: dict[int, _Member] = {}
        self.finished: dict[int, _Member] = {}
        self.kills: dict[int, float] = {}
        self.faults: list[Fault] = []
        self.admin: Any = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
        self.lock_key = RedisLock(self.admin, name).keys.lock
        #: Quorum variant: the lock nodes (faulted: short timeouts for the holder lookup).
        self.quorum_ports = tuple(quorum_ports)
        self.node_timeout = node_timeout
        self.node_admins: list[Any] = [
            redis.Redis(host="127.0.0.1", port=p, socket_timeout=0.2, socket_connect_timeout=0.2)
            for p in self.quorum_ports
        ]
        self._ctx = multiprocessing.get_context("spawn")
        self._gens = [0] * slots
        #: How many fault victims were holding the lock when chosen.
        self.victims_holding = 0

    def expected_items(self) -> list[int]:
        return list(range(self.slots * self.items))

    def start(self) -> None:
        if self.together:
            self.admin.delete(BARRIER)
        for slot in range(self.slots):
            self._spawn(slot, slot * self.items)

    def _spawn(self, slot: int, first: int) -> None:
        gen = self._gens[slot] = self._gens[slot] + 1
        log_path = str(self.log_dir / f"slot{slot}-gen{gen}.log")
        end = (slot + 1) * self.items
        seed = self.seed * 1000 + slot * 37 + gen
        args = (self.port, self.name, self.ttl, first, end, log_path)
        args += (self.hold_max, self.pause_max, seed, self.defeat)  # type: ignore[assignment]
        if self.quorum_ports:
            ports = self.quorum_ports
            if self.defeat == "split-nodes":  # self-test: each slot its own one-node "quorum"
                ports = (ports[slot % len(ports)],)
            args += (ports, self.node_timeout)  # type: ignore[assignment]
        kwargs: dict[str, Any] = {"lifetime": self.lifetime}
        if self.together and gen == 1:
            kwargs["together"] = self.slots
        process = self._ctx.Process(target=worker, args=args, kwargs=kwargs, daemon=True)
        process.start()
        assert process.pid is not None
        self.members[process.pid] = _Member(process, slot, gen, log_path, first)

    def reap(self) -> None:
        """Move exited workers to ``finished``."""
        for pid, member in list(self.members.items()):
            if not member.process.is_alive():
                member.process.join(1)
                self.finished[pid] = self.members.pop(pid)

    def alive(self) -> bool:
        self.reap()
        return bool(self.members)

    def holder_pid(self) -> int | None:
        """The live worker named as owner in the lock hash now (None: free or unknown).

        Quorum variant: as shown by the first lock node that answers.
        """
        for admin in self.node_admins or [self.admin]:
            try:
                fields = admin.hkeys(self.lock_key)
            except RedisError:
                continue
            for raw in fields:
                owner = raw.decode() if isinstance(raw, bytes) else str(raw)
                if owner.startswith("w"):
                    pid = int(owner[1:].split(".")[0])
                    if pid in self.members:
                        return pid
        return None

    def victim(self, rng: random.Random) -> int | None:
        """The holder (waiting up to 0.5 s for one), else a random live worker."""
        self.reap()
        for _ in range(50):
            pid = self.holder_pid()
            if pid is not None:
                self.victims_holding += 1
                return pid
            time.sleep(0.01)
        return rng.choice(sorted(self.members)) if self.members else None

    def kill(self, pid: int) -> None:
        """SIGKILL a worker, reap it, and start its replacement."""
        member = self.members.pop(pid)
        t0 = _now()
        os.kill(pid, signal.SIGCONT)  # harmless if running; a stopped one must die too
        os.kill(pid, signal.SIGKILL)
        member.process.join(10)
        t1 = _now()
        self.kills[pid] = t1
        self.faults.append(Fault("sigkill", t0, t1, pid))
        self.finished[pid] = member
        # "write" records carry no item: find them through the "enter" records.
        entered = {
            r["token"]: r["item"] for r in _read_log(member.log_path) if r.get("ev") == "enter"
        }
        done = [
            entered[r["token"]]
            for r in _read_log(member.log_path)
            if r.get("ev") == "write" and r.get("admitted") is True and r["token"] in entered
        ]
        next_item = max(done) + 1 if done else member.first
        if next_item < (member.slot + 1) * self.items:
            self._spawn(member.slot, next_item)

    def stop(self, pid: int, seconds: float, kind: str) -> None:
        t0 = _now()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        self.faults.append(Fault(kind, t0, _now(), pid, f"{seconds:.3f}s"))

    def client_kill(self, rng: random.Random) -> None:
        t0 = _now()
        if rng.random() < 0.4:
            killed = int(self.admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
            detail = f"pubsub x{killed}"
        else:
            me = int(self.admin.client_id())
            ids = [int(c["id"]) for c in self.admin.client_list() if int(c["id"]) != me]
            chosen = rng.sample(ids, k=min(len(ids), rng.randint(1, 3)))
            killed = 0
            for cid in chosen:
                killed += int(self.admin.execute_command("CLIENT", "KILL", "ID", cid))
            detail = f"normal x{killed}"
        self.faults.append(Fault("client-kill", t0, _now(), None, detail))

    def debug_sleep(self, seconds: float) -> None:
        t0 = _now()
        self.admin.execute_command("DEBUG", "SLEEP", f"{seconds:.3f}")
        self.faults.append(Fault("debug-sleep", t0, _now(), None, f"{seconds:.3f}s"))

    def wait(self, bound: float) -> bool:
        """Wait until every worker has exited (True) or ``bound`` seconds pass (False)."""
        deadline = _now() + bound
        while self.alive():
            if _now() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def shutdown(self) -> None:
        for pid, member in list(self.members.items()):
            if member.process.is_alive():
                for signum in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        break
            member.process.join(10)
            self.finished[pid] = self.members.pop(pid)
        self.admin.close()
        for admin in self.node_admins:
            admin.close()

    def log_paths(self) -> list[str]:
        return [m.log_path for m in [*self.finished.values(), *self.members.values()]]

    def exit_codes(self) -> dict[int, int | None]:
        return {
            pid: m.process.exitcode for pid, m in self.finished.items() if pid not in self.kills
        }


def _read_log(path: str) -> list[dict[str, Any]]:
    records = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # a record cut short by SIGKILL
            records.append(json.loads(line))
    return records


# ----------------------------------------------------------------------------- analysis


@dataclass
class Section:
    pid: int
    owner: str
    token: int
    item: int | None = None
    read: int | None = None
    admit: bool | None = None
    t_enter: float | None = None
    t_admit: float | None = None
    t_write: float | None = None
    t_exit: float | None = None
    written: bool = False  # a "write" record exists
    admitted: bool | None = None
    #: The write met a broken connection, and did not land (admitted False): not a refusal.
    broken: bool = False
    released: bool = False  # a "release" record exists
    release_ok: bool | None = None
    release_reason: str | None = None
    lost_reason: str | None = None


@dataclass
class Report:
    acquisitions: int = 0
    sections: int = 0  # sections that read the counter ("enter")
    completed: int = 0  # known admitted writes
    rejected: int = 0  # fenced writes refused as stale
    unknown: int = 0  # write outcome unknown (killed in flight, broken connection)
    landed_unknown: int = 0  # of those, writes the counter shows did land
    lost_reports: int = 0  # on_lost callbacks run
    lost_releases: int = 0  # releases that raised LockLostError
    intervals: int = 0  # valid-lease intervals checked for overlap
    counter: int = 0
    violations: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"acquisitions={self.acquisitions} sections={self.sections} "
            f"completed={self.completed} rejected_stale={self.rejected} "
            f"unknown={self.unknown} (landed {self.landed_unknown}) "
            f"lost_reports={self.lost_reports} lost_releases={self.lost_releases} "
            f"valid_intervals={self.intervals} counter={self.counter} "
            f"violations={len(self.violations)}"
        )


def load_sections(paths: list[str]) -> tuple[dict[int, Section], int, int]:
    """Sections by token, plus the number of acquisitions and of on_lost reports."""
    sections: dict[int, Section] = {}
    acquisitions = lost = 0
    by_owner: dict[tuple[int, str], Section] = {}
    for path in paths:
        for r in _read_log(path):
            ev = r.get("ev")
            if ev == "acq":
                acquisitions += 1
                # Keyed by (pid, owner): a defeated lock hands out equal tokens.
                section = Section(r["pid"], r["owner"], r["token"])
                by_owner[(r["pid"], r["owner"])] = section
                sections[len(sections)] = section
            elif ev == "lost":
                lost += 1
                found = by_owner.get((r["pid"], r["owner"]))
                if found is not None:
                    found.lost_reason = r["reason"]
            elif ev in ("enter", "write", "release"):
                s = by_owner[(r["pid"], r["owner"])]
                if ev == "enter":
                    s.item, s.read, s.admit = r["item"], r["read"], r["admit"]
                    s.t_enter, s.t_admit = r["t_enter"], r["t_admit"]
                elif ev == "write":
                    s.written, s.admitted = True, r["admitted"]
                    s.broken = bool(r.get("broken"))
                    s.t_write, s.t_exit = r["t_write"], r["t_exit"]
                else:
                    s.released, s.release_ok = True, r["ok"]
                    s.release_reason = r.get("reason")
    return sections, acquisitions, lost


def analyse(
    paths: list[str],
    *,
    counter_raw: bytes | None,
    expected_items: list[int],
    kills: dict[int, float],
    faults: list[Fault],
) -> Report:
    """Check safety (no two valid holders, fencing, no lost update) and completeness."""
    sections, acquisitions, lost = load_sections(paths)
    report = Report(acquisitions=acquisitions, lost_reports=lost)
    final, _ = _parse_counter(counter_raw)
    report.counter = final
    v = report.violations
    entered = [s for s in sections.values() if s.read is not None]
    report.sections = len(entered)
    known = [s for s in entered if s.admitted is True]
    report.completed = len(known)
    report.rejected = sum(1 for s in entered if s.admitted is False and not s.broken)
    unknown = [s for s in entered if s.admitted is None]
    report.unknown = len(unknown)
    report.lost_releases = sum(1 for s in sections.values() if s.release_ok is False)

    # (1) The counter chain: every admitted write read a distinct value (no lost update),
    # and every increment the counter shows is accounted for by some section.
    reads: dict[int, Section] = {}
    for s in known:
        assert s.read is not None
        if s.read in reads:
            other = reads[s.read]
            v.append(
                f"lost update: tokens {other.token} (pid {other.pid}) and {s.token} "
                f"(pid {s.pid}) both read {s.read} and both writes were admitted"
            )
        else:
            reads[s.read] = s
        if s.read >= final:
            v.append(f"token {s.token} wrote {s.read + 1} but the counter ends at {final}")
    chain: dict[int, Section] = dict(reads)
    for gap in sorted(set(range(final)) - set(reads)):
        candidates = [s for s in unknown if s.read == gap]
        if not candidates:
            v.append(f"the counter went from {gap} to {gap + 1} by no known section")
        else:
            chain[gap] = candidates[0]
            report.landed_unknown += 1
    if final != report.completed + report.landed_unknown and not v:
        v.append(
            f"counter {final} != completed {report.completed} + landed {report.landed_unknown}"
        )

    # (2) Fenced writes were admitted in token order.
    previous: Section | None = None
    for value in sorted(chain):
        s = chain[value]
        if previous is not None and s.token <= previous.token:
            v.append(
                f"admitted out of token order: token {s.token} wrote {value + 1} after "
                f"token {previous.token} wrote {value}"
            )
        previous = s

    # (3) No write admitted after a newer token was admitted (a taken-over holder's write).
    admits = sorted(
        (s.t_admit, s.token) for s in entered if s.admit is True and s.t_admit is not None
    )
    admit_times = [t for t, _ in admits]
    highest = list(itertools.accumulate((tok for _, tok in admits), max))  # by time, so far
    for s in known:
        assert s.t_write is not None
        before = bisect.bisect_left(admit_times, s.t_write)  # admits at t < t_write
        if before and highest[before - 1] > s.token:
            newer = [tok for t, tok in admits[:before] if tok > s.token]
            v.append(
                f"stale write admitted: token {s.token} (pid {s.pid}) wrote after token "
                f"{min(newer)} had been admitted"
            )

    # (4) A holder whose lease was intact to its release must never be fenced off. A write
    # that met a broken connection and did not land was not fenced off: the fence never
    # answered it (the soak found this false positive: a proxy drop during the write).
    for s in entered:
        if s.admitted is False and not s.broken and s.release_ok is True:
            v.append(
                f"token {s.token} (pid {s.pid}) was fenced off although its lease held "
                f"until its release: a newer holder overlapped a valid lease"
            )

    # (5) No two valid-lease intervals overlap.
    intervals = _valid_intervals(entered, kills, faults)
    report.intervals = len(intervals)
    intervals.sort()
    latest: tuple[float, float, Section] | None = None
    for start, end, s in intervals:
        if latest is not None and start < latest[1]:
            o = latest[2]
            v.append(
                f"overlap: token {s.token} (pid {s.pid}) entered {latest[1] - start:.4f}s "
                f"before token {o.token} (pid {o.pid}) left, both with valid leases"
            )
        if latest is None or end > latest[1]:
            latest = (start, end, s)

    # (6) Every item was completed exactly once (as far as known writes tell).
    done = sorted(s.item for s in known if s.item is not None)
    if done != sorted(expected_items):
        missing = sorted(set(expected_items) - set(done))
        twice = sorted(i for i, n in collections.Counter(done).items() if n > 1)
        v.append(
            f"items completed {len(done)} != expected {len(expected_items)} "
            f"(missing {missing[:10]}, done twice {twice[:10]})"
        )
    return report


def _valid_intervals(
    entered: list[Section], kills: dict[int, float], faults: list[Fault]
) -> list[tuple[float, float, Section]]:
    """Intervals [enter, exit] of sections whose lease provably held throughout.

    Released normally: Redis still had the owner's hold at the release, so the hold was
    continuous (an expired hold cannot come back under the same fresh owner id).
    Killed in flight: valid up to the kill if nothing but the kill disturbed it (no
    SIGSTOP of that worker, no server sleep, no killed connection meanwhile). A section
    that logged its exit before the kill ends there: the kill may have come while its
    release was landing, or just after (the lock handed on, the "release" record not yet
    written), and the next holder's section may start at once.
    """
    out = []
    for s in entered:
        assert s.t_enter is not None
        if s.release_ok is True and s.t_exit is not None:
            out.append((s.t_enter, s.t_exit, s))
        elif not s.released and s.pid in kills:
            t_kill = kills[s.pid]
            disturbed = any(
                f.t1 >= s.t_enter
                and f.t0 <= t_kill
                and (
                    f.kind in SERVER_FAULTS
                    or f.kind.startswith(NODE_FAULTS)
                    or (f.pid == s.pid and "stop" in f.kind)
                )
                for f in faults
            )
            if not disturbed:
                end = t_kill if s.t_exit is None else min(s.t_exit, t_kill)
                out.append((s.t_enter, end, s))
    return out


# ----------------------------------------------------------------------------- two holders


def _push(client: Any, key: str, **record: Any) -> None:
    client.rpush(key, json.dumps(record))


def paused_writer(port: int, name: str, ttl: float, report_key: str) -> None:
    """Hold (watchdog on) and keep writing through the fence every 20 ms without checking
    the lock, as work does that is unaware of a pause; stop at the first rejected write,
    then report what the holder sees."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    lock = RedisLock(client, name, ttl=ttl, owner="first")
    callbacks: list[str] = []
    lock.on_lost(lambda _lock, error: callbacks.append(str(error.reason)))
    assert lock.acquire(timeout=5)
    token = lock.token
    assert token is not None
    fence = FencedResource(client, "ledger")
    t_enter = _now()
    admitted = fence.admit(token)
    _push(client, report_key, ev="ready", token=token, t_enter=t_enter, admit=admitted)
    writes: list[tuple[float, float, bool]] = []
    deadline = _now() + 30
    while _now() < deadline:
        t0 = _now()
        ok = fence.write(token, "ledger:value", f"first-{len(writes)}")
        writes.append((t0, _now(), ok))
        if not ok:
            break
        time.sleep(0.02)
    lost_at_rejection = bool(lock.lost)
    signalled = lock.lost.wait(5)
    try:
        lock.ensure_held()
        ensure = "passed"
    except LockLostError as exc:
        ensure = f"raised {exc.reason}"
    t_exit = _now()
    try:
        lock.release()
        release = "ok"
    except LockLostError as exc:
        release = f"LockLostError {exc.reason}"
    _push(
        client,
        report_key,
        ev="done",
        writes=writes,
        lost_at_rejection=lost_at_rejection,
        signalled=signalled,
        reason=lock.lost.reason,
        callbacks=callbacks,
        ensure=ensure,
        release=release,
        t_exit=t_exit,
    )


def second_holder(port: int, name: str, report_key: str, control_key: str) -> None:
    """Block in acquire until the first holder's lease is gone; write; hold until told."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
    lock = RedisLock(client, name, ttl=30, owner="second", auto_renew=False)
    t_call = _now()
    ok = lock.acquire(timeout=20)
    t_enter = _now()
    token = lock.token or 0
    fence = FencedResource(client, "ledger")
    admit = fence.admit(token) if ok else False
    t_admit = _now()
    wrote = fence.write(token, "ledger:value", "second") if ok else False
    _push(
        client,
        report_key,
        ev="acquired",
        ok=ok,
        token=token,
        t_call=t_call,
        t_enter=t_enter,
        t_admit=t_admit,
        admit=admit,
        wrote=wrote,
    )
    client.blpop([control_key], timeout=30)
    t_exit = _now()
    try:
        lock.release()
        release = "ok"
    except RedisLockError as exc:
        release = f"{type(exc).__name__} {exc}"
    _push(client, report_key, ev="released", release=release, t_exit=t_exit)
