"""Soak part B: settlements on real prefork workers whose pool processes are SIGKILLed.

``--settlements`` tasks (tests/soak/app.py ``settle``: LockedTask on ``account:{account}``,
acks_late + reject_on_worker_lost) over ``--accounts`` accounts are published at once to
``--workers`` prefork ``celery worker`` processes. Every few seconds a pool process is
SIGKILLed (one running a settlement when there is one); the broker's redis-server (AOF,
``appendfsync always``; broker, results and locks) is SIGKILLed and restarted when half
of the work is applied (``--restarts``: evenly spaced).

Oracles, from the ledger in a separate, never-faulted redis-server:

* every account's balance equals the sum of its settlements, and the sum of what the
  ledger says was applied to it;
* every task id sent was applied exactly once (nothing lost);
* a run that found its task applied already (``again``) is explained by the death of
  the applying process (SIGKILLed, or with its worker) before it moved on to another
  task; anything else is a second run of a finished task;
* no two runs of one task id overlapped in time;
* per account, no two runs overlapped while both leases were valid (``ensure_held()``
  passed after the write, or the run was SIGKILLed with no Redis restart meanwhile),
  and no write was fenced off while ``ensure_held()`` passed just before it;
* tokens were applied in strictly increasing order per account;
* at the end (after the broker's visibility timeout has had its chance to redeliver),
  no lock hash is left, no message queued or unacknowledged, no task parked.

A worker whose main process exits (kombu can fail to reconnect after the restart) is
restarted, as a supervisor would, after its orphaned pool processes are SIGKILLed; that
is reported as a note, and a stall (no settlement applied for the visibility timeout +
ttl + 60 s) or the ``--minutes`` bound ends the part with a violation. A stall whose
unapplied task ids no worker ever received, with nothing left queued, unacknowledged,
parked or locked, is put down to the broker transport (see ``_never_received``) as soon
as the visibility timeout + ttl + 5 s have passed without progress.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import redis
from redis.exceptions import RedisError

from celery_redislock._core import name_from_lock_key
from celery_redislock.testing import RedisServer

from .._celery import CeleryProcess
from .locks import PartResult, slash

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class SettleParams:
    settlements: int = 1000
    accounts: int = 20
    workers: int = 2
    concurrency: int = 3
    ttl: float = 5.0
    work: tuple[float, float] = (0.05, 0.25)
    kill_gap: tuple[float, float] = (1.0, 3.0)
    restarts: int = 1
    downtime: tuple[float, float] = (0.5, 2.0)
    visibility_timeout: float = 30.0
    minutes: float = 25.0
    seed: int = 1
    defeat: str = ""


@dataclass
class Run:
    id: str
    pid: int
    account: int
    token: int
    t_enter: float
    t_end: float | None = None
    t_write: float | None = None
    outcome: str | None = None
    held_before: bool | None = None
    held_after: bool | None = None
    t_kill: float | None = None  # the SIGKILL of its process that ended it
    t_crash: float | None = None  # when the death of its worker was seen (it died by then)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _state(broker: redis.Redis) -> dict[str, Any]:
    """What is left in the broker's Redis: lock hashes, queued/unacked messages, parked."""
    locks: dict[str, list[str]] = {}
    queued = 0
    parked: dict[str, list[str]] = {}  # parked-record key -> task ids (lock keys: registry)
    for key in broker.scan_iter(count=1000):
        kind = broker.type(key)
        if key.startswith(b"redislock:"):
            if kind == b"hash" and name_from_lock_key(key) is not None:
                owners = [k.decode() for k in broker.hkeys(key) if not k.startswith(b"__")]
                locks[key.decode()] = owners
            elif b"parked" in key and kind in (b"list", b"zset", b"hash"):
                members = (
                    broker.lrange(key, 0, -1)
                    if kind == b"list"
                    else broker.zrange(key, 0, -1)
                    if kind == b"zset"
                    else broker.hkeys(key)
                )
                if members:
                    parked[key.decode()] = [m.decode(errors="replace") for m in members]
        elif kind == b"list":
            queued += int(broker.llen(key))
    unacked = int(broker.hlen("unacked")) if broker.exists("unacked") else 0
    return {"locks": locks, "queued": queued, "unacked": unacked, "parked": parked}


def _quiet(state: dict[str, Any]) -> bool:
    return not state["locks"] and not state["queued"] and not state["unacked"]


def _group(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (a worker's session: its pool processes,
    also once orphaned by the worker's death)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


class Workers:
    """The prefork workers, each in its own session; a dead one is restarted, as a
    supervisor would (its orphaned pool processes are SIGKILLed first, as systemd does)."""

    def __init__(self, p: SettleParams, broker_url: str, ledger_url: str, log_dir: Path):
        self.p = p
        self.url = broker_url
        self.log_dir = log_dir
        self.env = {
            "SOAK_BROKER_URL": broker_url,
            "SOAK_LEDGER_URL": ledger_url,
            "SOAK_TTL": str(p.ttl),
            "SOAK_VT": str(p.visibility_timeout),
            "SOAK_RUN_ON": os.environ.get("SOAK_RUN_ON", ""),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.procs: list[CeleryProcess] = [self._new(i, 1) for i in range(p.workers)]
        self.all: list[CeleryProcess] = list(self.procs)
        #: (worker, exit status, the log's last CRITICAL/ERROR line, when) per death.
        self.deaths: list[tuple[str, int | None, str, float]] = []
        #: Pool process -> index of its worker, as last seen.
        self.pool_of: dict[int, int] = {}

    def _new(self, index: int, gen: int) -> CeleryProcess:
        args = [
            "worker", "-P", "prefork", "-c", str(self.p.concurrency), "-l", "info",
            "-n", f"soak{index}@localhost",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        log = self.log_dir / f"worker{index}.{gen}.log"
        proc = CeleryProcess(args, url=self.url, log=log, env=self.env)
        proc.app = "tests.soak.app"
        return proc

    def start(self) -> None:
        for proc in self.procs:
            proc.start()
        for proc in self.procs:
            proc.wait_for_log("ready.", timeout=90)

    def children(self) -> list[int]:
        """The pool processes of the running workers (each remembered as its worker's)."""
        found = []
        for index, proc in enumerate(self.procs):
            for pid in _children(proc.pid):
                self.pool_of[pid] = index
                found.append(pid)
        return found

    def restart_dead(self, crashes: list[tuple[int, float]]) -> list[str]:
        """Restart every worker whose main process exited; what happened, one line each.

        Its pool processes, dead with it or SIGKILLed now if orphaned, go to ``crashes``.
        """
        notes = []
        self.children()
        for index, proc in enumerate(self.procs):
            assert proc.process is not None
            code = proc.process.poll()
            if code is None:
                continue
            orphans = _group(proc.pid)
            for pid in orphans:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            now = time.monotonic()
            pool = {pid for pid, i in self.pool_of.items() if i == index} | set(orphans)
            crashes += [(pid, now) for pid in sorted(pool)]
            for pid in pool:
                self.pool_of.pop(pid, None)
            lines = [x for x in proc.text().splitlines() if "CRITICAL/" in x or "ERROR/" in x]
            why = lines[-1][:300] if lines else "(nothing logged)"
            self.deaths.append((f"soak{index}", code, why, time.monotonic()))
            fresh = self._new(index, len([d for d in self.deaths if d[0] == f"soak{index}"]) + 1)
            fresh.start()
            fresh.wait_for_log("ready.", timeout=90)
            self.procs[index] = fresh
            self.all.append(fresh)
            notes.append(
                f"worker soak{index} exited ({code}); {len(orphans)} orphaned pool processes "
                f"SIGKILLed; restarted. Its last error: {why}"
            )
        return notes

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.stop(timeout=30)


def run_settlements(p: SettleParams, log_dir: Path, say: Callable[[str], None]) -> PartResult:
    result = PartResult("B. settlements on prefork workers")
    rng = random.Random(p.seed)
    payments = [(rng.randrange(p.accounts), rng.randrange(1, 100)) for _ in range(p.settlements)]
    bound = p.minutes * 60
    broker_server = RedisServer(appendonly=True, appendfsync="always").start()
    ledger_server = RedisServer().start()
    os.environ["SOAK_BROKER_URL"] = broker_server.url  # read by tests.soak.app at import
    os.environ["SOAK_LEDGER_URL"] = ledger_server.url
    os.environ["SOAK_VT"] = str(p.visibility_timeout)
    from . import app as soak_app  # after the servers: its URLs come from the environment

    soak_app.app.conf.update(broker_url=broker_server.url, result_backend=broker_server.url)
    task = soak_app.settle_unlocked if p.defeat else soak_app.settle
    ledger = ledger_server.client()
    broker = broker_server.client(socket_timeout=5, socket_connect_timeout=2)
    workers = Workers(p, broker_server.url, ledger_server.url, log_dir)
    kills: list[tuple[int, float]] = []  # pool processes the soak SIGKILLed
    crashes: list[tuple[int, float]] = []  # pool processes of a worker that died
    restarts: list[tuple[float, float]] = []
    sent: dict[str, tuple[int, int]] = {}
    transport_lost: list[str] = []
    end_state: dict[str, Any] = {}
    quiet = complete = False
    say(
        f"[B] {p.settlements} settlements over {p.accounts} accounts on {p.workers} prefork "
        f"workers x {p.concurrency}, lock ttl {p.ttl}s, visibility timeout "
        f"{p.visibility_timeout:g}s, {p.restarts} broker restart(s), seed {p.seed}"
        + (" -- SELF-TEST WITHOUT A LOCK" if p.defeat else "")
    )
    started = time.monotonic()
    deadline = started + bound
    try:
        workers.start()
        say(f"[B] workers ready after {time.monotonic() - started:.1f}s; publishing")
        with soak_app.app.producer_or_acquire() as producer:
            for account, amount in payments:
                work = round(rng.uniform(*p.work), 3)
                res = task.apply_async((account, amount, work), producer=producer)
                sent[res.id] = (account, amount)
        restart_at = [p.settlements * (k + 1) // (p.restarts + 1) for k in range(p.restarts)]
        next_kill = time.monotonic() + rng.uniform(*p.kill_gap)
        next_report = time.monotonic() + 10
        stall = p.visibility_timeout + p.ttl + 60  # no task applied for this long: stuck
        # Past any redelivery the broker still owes (the visibility timeout) and any lease:
        # from then on, a stall that _never_received explains is put down to the transport
        # at once (looked at once a second), not after the whole stall bound.
        owed = p.visibility_timeout + p.ttl + 5
        progress_at, last_applied, looked_at = time.monotonic(), -1, 0.0
        while True:
            now = time.monotonic()
            applied = int(ledger.hlen(soak_app.APPLIED))
            if applied >= p.settlements:
                complete = True
                break
            if now >= deadline:
                break
            if applied != last_applied:
                progress_at, last_applied = now, applied
            elif now - progress_at > owed and (now - looked_at >= 1.0 or now - progress_at > stall):
                looked_at = now
                never = _never_received(workers, ledger, soak_app, sent, broker, restarts)
                if never:
                    # Lost by the broker transport, not by the lock: see _never_received.
                    transport_lost.extend(never)
                    complete = True
                    break
            if now - progress_at > stall:
                result.violations.append(
                    f"stalled: no settlement applied for {stall:.0f}s, at {applied}/"
                    f"{p.settlements}; state: {_state_text(broker)}"
                )
                break
            for note in workers.restart_dead(crashes):
                say(f"[B] {note}")
                result.notes.append(note)
            if restart_at and applied >= restart_at[0]:
                restart_at.pop(0)
                t0 = time.monotonic()
                broker_server.kill()
                down = rng.uniform(*p.downtime)
                time.sleep(down)
                broker_server.start(broker_server.port)
                restarts.append((t0, time.monotonic()))
                say(f"[B] broker redis-server restarted at {applied} applied ({down:.2f}s down)")
            if now >= next_kill:
                next_kill = now + rng.uniform(*p.kill_gap)
                victim = _victim(workers, ledger, rng)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    kills.append((victim, time.monotonic()))
                    ledger.hdel(soak_app.RUNNING, str(victim))
            if now >= next_report:
                next_report = now + 10
                say(_progress(ledger, soak_app, started, applied, p, kills, restarts))
            time.sleep(0.05)
        say(
            f"[B] {int(ledger.hlen(soak_app.APPLIED))}/{p.settlements} applied after "
            f"{time.monotonic() - started:.0f}s ({len(kills)} SIGKILLs); waiting for the "
            f"workers to go quiet (up to the visibility timeout + ttl + 30 s)"
        )
        # Let every redelivery the broker still owes happen (a finished task must not run
        # again), and every lock be released.
        wait = p.visibility_timeout + p.ttl + 30 if complete else 5.0
        quiet_until = time.monotonic() + wait
        settle_for = 3.0
        quiet_since: float | None = None
        while time.monotonic() < min(quiet_until, deadline + 60):
            try:
                end_state = _state(broker)
            except RedisError:
                time.sleep(0.5)
                continue
            if _quiet(end_state):
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= settle_for:
                    quiet = True
                    break
            else:
                quiet_since = None
            time.sleep(0.25)
        with contextlib.suppress(RedisError):
            end_state = _state(broker)
            if end_state["locks"]:  # who keeps them? sample their leases twice
                end_state["lock_details"] = _lock_details(broker, list(end_state["locks"]))
        metas, failed = _result_states(broker, list(sent))
    finally:
        workers.stop()
        soak_app.app.close()
    try:
        result.elapsed = time.monotonic() - started
        _analyse(
            p, result, ledger, soak_app, sent, kills, crashes, restarts, end_state, quiet, complete,
            transport_lost,
        )  # fmt: skip
        logs = [proc.text() for proc in workers.all]
        result.rows += _log_rows(logs, metas)
        result.rows.append(
            ("worker main processes that died (restarted)", slash(len(workers.deaths)))
        )
        if failed:
            kinds = Counter(text.split(":")[0] for text in failed.values())
            result.notes.append(
                f"{len(failed)} tasks end as FAILURE in the result backend although the "
                f"ledger applied each exactly once ({dict(kinds)}): "
                + ", ".join(f"{t} ({e})" for t, e in list(failed.items())[:5])
            )
        _evidence(result, logs, log_dir)
        result.rows.append(("violations", str(len(result.violations))))
        result.rows.append(("elapsed", f"{result.elapsed:.0f}s"))
    finally:
        ledger.close()
        broker.close()
        broker_server.cleanup()
        ledger_server.cleanup()
    return result


def _never_received(
    workers: Any,
    ledger: redis.Redis,
    soak_app: Any,
    sent: dict[str, tuple[int, int]],
    broker: redis.Redis,
    restarts: list[tuple[float, float]],
) -> list[str]:
    """The unapplied task ids that no worker ever received, if they explain a stall.

    kombu's Redis transport pops a message (BRPOP) and then, in another command, records
    it as unacknowledged: when the broker's redis-server is SIGKILLed between the two (or
    before the popped message reaches the worker), the message is in neither place and
    no worker ever logs it ("received", or this package's "parked ... before dispatch").
    Such a task never reached the lock. Only when every unapplied task id is such a one,
    after a broker restart, with nothing queued, unacknowledged, parked or locked, is
    the stall put down to the transport; otherwise it stays a violation.
    """
    applied = {k.decode() for k in ledger.hkeys(soak_app.APPLIED)}
    missing = [t for t in sent if t not in applied]
    if not missing or not restarts:
        return []
    try:
        state = _state(broker)
    except RedisError:
        return []
    if not _quiet(state) or state["parked"]:
        return []
    text = "\n".join(proc.text() for proc in workers.all)
    if any(task_id in text for task_id in missing):
        return []
    return missing


def _lock_details(broker: redis.Redis, keys: list[str]) -> dict[str, str]:
    """Each lock's fields and its remaining lease now and 1 s later (renewed if it grew)."""
    first = {key: broker.pttl(key) for key in keys}
    time.sleep(1.0)
    out = {}
    for key in keys:
        fields = {k.decode(): v.decode() for k, v in broker.hgetall(key).items()}
        out[key] = f"fields {fields}, pttl {first[key]} ms then {broker.pttl(key)} ms 1 s later"
    return out


def _state_text(broker: redis.Redis) -> str:
    try:
        state = _state(broker)
    except RedisError as exc:
        return f"unreadable ({exc})"
    return (
        f"locks held {state['locks']}, {state['queued']} queued, {state['unacked']} unacked, "
        f"parked records {state['parked']}"
    )


def _evidence(result: PartResult, logs: list[str], log_dir: Path) -> None:
    """The workers' log lines about every task id a violation names (evidence.txt)."""
    ids: list[str] = []
    for text in [*result.violations, *result.notes]:
        for word in text.replace("'", " ").replace(",", " ").replace("[", " ").split():
            if len(word) == 36 and word.count("-") == 4 and word not in ids:
                ids.append(word)
    if not ids:
        return
    lines = [line for text in logs for line in text.splitlines()]
    out = []
    for task_id in ids:
        out.append(f"== {task_id}")
        out += [line for line in lines if task_id in line]
    path = log_dir / "evidence.txt"
    path.write_text("\n".join(out) + "\n")
    for task_id in ids[:6]:
        about = [line for line in lines if task_id in line][:6]
        result.evidence.append(f"{task_id}: {len(about)} log lines" + ("" if about else " (none)"))
        result.evidence += ["    " + line[:240] for line in about]
    result.evidence.append(f"all log lines of the {len(ids)} task ids named: {path}")


def _victim(workers: Workers, ledger: redis.Redis, rng: random.Random) -> int | None:
    """A pool process of our workers: mostly one that is running a settlement."""
    children = set(workers.children())
    if not children:
        return None
    running = [int(pid) for pid in ledger.hkeys("soak:running")]
    busy = sorted(children.intersection(running))
    if busy and rng.random() < 0.8:
        return rng.choice(busy)
    return rng.choice(sorted(children))


def _progress(
    ledger: redis.Redis,
    soak_app: Any,
    started: float,
    applied: int,
    p: SettleParams,
    kills: list[tuple[int, float]],
    restarts: list[tuple[float, float]],
) -> str:
    stats = {k.decode(): int(v) for k, v in ledger.hgetall(soak_app.STATS).items()}
    return (
        f"[B] {time.monotonic() - started:5.0f}s applied {applied}/{p.settlements} "
        f"runs {ledger.llen(soak_app.EVENTS) // 2} again {stats.get('again', 0)} "
        f"stale {stats.get('stale', 0)} SIGKILLs {len(kills)} restarts {len(restarts)}"
    )


def _result_states(broker: redis.Redis, ids: list[str]) -> tuple[Counter[str], dict[str, str]]:
    """Final states in the result backend, and the exception of each failed task."""
    states: Counter[str] = Counter()
    failed: dict[str, str] = {}
    try:
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            for task_id, raw in zip(chunk, broker.mget([f"celery-task-meta-{t}" for t in chunk])):
                meta = json.loads(raw) if raw else {"status": "no result"}
                states[meta["status"]] += 1
                if meta["status"] == "FAILURE":
                    exc = meta.get("result") or {}
                    failed[task_id] = f"{exc.get('exc_type')}: {exc.get('exc_message')}"[:200]
    except RedisError as exc:
        states[f"unreadable ({type(exc).__name__})"] += len(ids) - sum(states.values())
    return states, failed


def _log_rows(logs: list[str], metas: Counter[str]) -> list[tuple[str, str]]:
    text = "\n".join(logs)
    lost = text.count("WorkerLostError")
    lock_lost = text.count("LockLostError")
    conn = text.count("Connection to broker lost")
    errors = sum(1 for line in text.splitlines() if "ERROR/" in line)
    # Why a task that did its work can still end as FAILURE: Celery could not store its
    # success (the result backend is on the restarted Redis), or its release failed.
    unstored = text.count("in mark_as_done")
    unreleased = text.count("redislock: could not release lock")
    released_later = text.count("after Redis came back")
    return [
        ("task results (result backend)", ", ".join(f"{k} {n}" for k, n in metas.most_common())),
        (
            "worker logs: WorkerLostError / LockLostError / broker connection lost / ERROR lines",
            slash(lost, lock_lost, conn, errors),
        ),
        (
            "worker logs: success not stored (mark_as_done raised) / release failed / "
            "released after Redis came back",
            slash(unstored, unreleased, released_later),
        ),
    ]


def _analyse(
    p: SettleParams,
    result: PartResult,
    ledger: redis.Redis,
    soak_app: Any,
    sent: dict[str, tuple[int, int]],
    kills: list[tuple[int, float]],
    crashes: list[tuple[int, float]],
    restarts: list[tuple[float, float]],
    end_state: dict[str, Any],
    quiet: bool,
    complete: bool,
    transport_lost: list[str],
) -> None:
    v = result.violations
    if transport_lost:
        result.notes.append(
            f"{len(transport_lost)} task ids were never received by any worker: the broker's "
            f"redis-server was SIGKILLed while kombu's Redis transport had popped the "
            f"message (BRPOP) and not yet recorded it as unacknowledged, a window of the "
            f"transport this package cannot close (docs/guarantees.md, 'Broker'); not "
            f"counted as lost by the lock: {transport_lost}"
        )
    if complete and len(restarts) < p.restarts:
        v.append(f"only {len(restarts)} of {p.restarts} broker restarts happened")
    if not complete:
        v.append(
            f"only {ledger.hlen(soak_app.APPLIED)}/{len(sent)} settlements applied within "
            f"{p.minutes:g} minutes"
        )
    # The runs, from their events.
    runs: list[Run] = []
    open_runs: dict[tuple[str, int, int], Run] = {}
    for raw in ledger.lrange(soak_app.EVENTS, 0, -1):
        e = json.loads(raw)
        key = (e["id"], e["pid"], e["token"])
        if e["ev"] == "start":
            run = Run(e["id"], e["pid"], e["account"], e["token"], e["t"])
            runs.append(run)
            open_runs[key] = run
        else:
            found = open_runs.pop(key, None)
            if found is None:
                v.append(f"an end without a start: {e}")
                continue
            found.t_end, found.t_write, found.outcome = e["t"], e["t_write"], e["outcome"]
            found.held_before, found.held_after = e["held_before"], e["held_after"]
    kills_by_pid: dict[int, list[float]] = defaultdict(list)
    for pid, t in kills:
        kills_by_pid[pid].append(t)
    crashes_by_pid: dict[int, list[float]] = defaultdict(list)
    for pid, t in crashes:
        crashes_by_pid[pid].append(t)
    runs_by_pid: dict[int, list[Run]] = defaultdict(list)
    for run in runs:
        runs_by_pid[run.pid].append(run)
    vanished = []
    crashed_runs = 0
    for run in runs:
        if run.t_end is None:
            after = [t for t in kills_by_pid.get(run.pid, []) if t >= run.t_enter]
            if after:
                run.t_kill = min(after)
            elif any(t >= run.t_enter for t in crashes_by_pid.get(run.pid, [])):
                run.t_crash = min(t for t in crashes_by_pid[run.pid] if t >= run.t_enter)
                crashed_runs += 1  # died with its worker: exactly when is unknown
            else:
                vanished.append(run)
    for run in vanished[:10]:
        v.append(
            f"run of {run.id} (pid {run.pid}, account {run.account}, token {run.token}) "
            f"started and never ended, and its process was neither SIGKILLed by the soak "
            f"nor part of a worker that died"
        )
    if len(vanished) > 10:
        v.append(f"... {len(vanished) - 10} more runs vanished")

    # Ledger: balances, applied exactly once, nothing lost.
    applied = {k.decode(): json.loads(raw) for k, raw in ledger.hgetall(soak_app.APPLIED).items()}
    unknown = sorted(set(applied) - set(sent))
    missing = sorted(set(sent) - set(applied) - set(transport_lost))
    if unknown:
        v.append(f"{len(unknown)} task ids applied that were never sent: {unknown[:5]}")
    if missing:
        v.append(f"{len(missing)} task ids sent but never applied (lost): {missing[:10]}")
    expected: dict[int, int] = defaultdict(int)
    for task_id, (account, amount) in sent.items():
        if task_id not in transport_lost:
            expected[account] += amount
    from_ledger: dict[int, int] = defaultdict(int)
    for record in applied.values():
        from_ledger[record["account"]] += record["amount"]
    wrong = []
    for account in range(p.accounts):
        balance = int(ledger.get(soak_app.balance_key(account)) or 0)
        if balance != expected[account] or balance != from_ledger[account]:
            wrong.append(account)
            v.append(
                f"account {account}: balance {balance}, expected {expected[account]} "
                f"(sum of its settlements), ledger says {from_ledger[account]} applied"
            )

    # "again": a second run of an applied task, explained by a SIGKILL of the applier?
    agains = [r for r in runs if r.outcome == "again"]
    explained = by_crash = 0
    for run in agains:
        first = applied.get(run.id)
        if first is None:
            continue
        if _killed_before_moving_on(first, kills_by_pid, runs_by_pid):
            explained += 1
            continue
        if _killed_before_moving_on(first, crashes_by_pid, runs_by_pid):
            by_crash += 1
            continue
        around = [
            f"restart {t0 - first['t_write']:+.2f}s..{t1 - first['t_write']:+.2f}s"
            for t0, t1 in restarts
        ]
        v.append(
            f"task {run.id} (account {run.account}) ran again in pid {run.pid} (token "
            f"{run.token}) after pid {first['pid']} had applied it (token {first['token']}) "
            f"and neither died nor was killed before its next task; relative to that write: "
            f"{', '.join(around) or 'no restart'}"
        )

    # Two runs of one task id at once.
    by_id: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_id[run.id].append(run)
    concurrent = 0
    for task_id, group in by_id.items():
        group.sort(key=lambda r: r.t_enter)
        for a, b in zip(group, group[1:]):
            end = next((t for t in (a.t_end, a.t_kill, a.t_crash) if t is not None), None)
            if end is None or b.t_enter < end:
                concurrent += 1
                v.append(
                    f"two runs of task {task_id} at once: pid {a.pid} (token {a.token}, "
                    f"{a.t_enter:.3f}..{end}) and pid {b.pid} (token {b.token}, from "
                    f"{b.t_enter:.3f})"
                )

    # Mutual exclusion per account while leases are valid; fenced off while valid.
    intervals: dict[int, list[tuple[float, float, Run]]] = defaultdict(list)
    for run in runs:
        if run.t_end is not None and run.held_after is not False:
            intervals[run.account].append((run.t_enter, run.t_end, run))
        elif run.t_end is None and run.t_kill is not None:
            disturbed = any(t1 >= run.t_enter and t0 <= run.t_kill for t0, t1 in restarts)
            if not disturbed:
                intervals[run.account].append((run.t_enter, run.t_kill, run))
    overlaps = 0
    checked = 0
    for account, spans in intervals.items():
        spans.sort(key=lambda s: (s[0], s[1]))
        checked += len(spans)
        latest: tuple[float, float, Run] | None = None
        for start, end, run in spans:
            if latest is not None and start < latest[1]:
                overlaps += 1
                if overlaps <= 20:
                    o = latest[2]
                    v.append(
                        f"overlap on account {account}: {run.id} (pid {run.pid}, token "
                        f"{run.token}) entered {latest[1] - start:.4f}s before {o.id} (pid "
                        f"{o.pid}, token {o.token}) left, both with valid leases"
                    )
            if latest is None or end > latest[1]:
                latest = (start, end, run)
    stale = [r for r in runs if r.outcome == "stale"]
    fenced_valid = [r for r in stale if r.held_before is not False]
    for run in fenced_valid[:10]:
        v.append(
            f"{run.id} (pid {run.pid}, account {run.account}, token {run.token}) was fenced "
            f"off although ensure_held() passed just before its write"
        )

    # Tokens applied in strictly increasing order per account.
    last: dict[int, int] = {}
    out_of_order = 0
    for raw in ledger.lrange(soak_app.APPLY_LOG, 0, -1):
        account_s, token_s, task_id = raw.decode().split()
        account, token = int(account_s), int(token_s)
        if token <= last.get(account, 0):
            out_of_order += 1
            v.append(
                f"account {account}: {task_id} applied with token {token} after token "
                f"{last[account]} (a stale write accepted, or a token issued twice)"
            )
        last[account] = max(token, last.get(account, 0))

    # The end state.
    if not quiet:
        v.append(
            f"not quiet at the end: locks held {end_state.get('locks')}, "
            f"{end_state.get('queued')} messages queued, {end_state.get('unacked')} unacked"
        )
        for key, text in end_state.get("lock_details", {}).items():
            v.append(f"{key} left held: {text}; parked records {end_state.get('parked')}")
    # Parked records left behind: of a task never applied, a lost task (a violation); of
    # a finished one, litter the parking lifetime clears (a note).
    for key, members in end_state.get("parked", {}).items():
        waiting = [m for m in members if m in sent and m not in applied]
        finished = [m for m in members if m in applied]
        if waiting:
            v.append(f"{key} still holds {len(waiting)} tasks never applied: {waiting[:5]}")
        if finished or len(waiting) + len(finished) < len(members):
            result.notes.append(
                f"left in {key} at the end: {len(finished)} finished tasks"
                + (f", other entries {[m for m in members if m not in sent][:3]}"
                   if len(waiting) + len(finished) < len(members) else "")
            )  # fmt: skip

    outcomes = Counter(r.outcome or "killed" for r in runs)
    killed_runs = sum(1 for r in runs if r.t_kill is not None)
    end = end_state
    result.rows = [
        ("settlements sent / accounts", slash(len(sent), p.accounts)),
        ("task ids applied exactly once / lost / applied but never sent",
         slash(len(set(applied) & set(sent)), len(missing), len(unknown))),
        ("task ids never received by a worker (lost by the broker transport at its SIGKILL)",
         slash(len(transport_lost))),
        ("accounts with an exact balance", slash(p.accounts - len(wrong), p.accounts)),
        ("runs started (start records)", slash(len(runs))),
        ("runs: applied / again (applied before) / stale / SIGKILLed / died with their worker",
         slash(outcomes["applied"], outcomes["again"], outcomes["stale"], killed_runs,
               crashed_runs)),
        ("again runs after a SIGKILL of the applier / its worker's death / of all",
         slash(explained, by_crash, len(agains))),
        ("two runs of one task id at once", slash(concurrent)),
        ("overlaps of valid leases on an account (intervals checked)", f"{overlaps} ({checked})"),
        ("writes fenced off while ensure_held() passed", slash(len(fenced_valid))),
        ("stale writes accepted (token order per account)", slash(out_of_order)),
        ("SIGKILLs of pool processes / broker restarts", slash(len(kills), len(restarts))),
        ("left at the end: lock hashes / queued / unacked / parked",
         slash(len(end.get("locks", {})), end.get("queued", "?"), end.get("unacked", "?"),
               sum(len(x) for x in end.get("parked", {}).values()))),
    ]  # fmt: skip


def _killed_before_moving_on(
    first: dict[str, Any],
    kills_by_pid: dict[int, list[float]],
    runs_by_pid: dict[int, list[Run]],
) -> bool:
    """Was the applying process SIGKILLed after its write and before its next run began?"""
    pid, t_write = first["pid"], first["t_write"]
    next_starts = [r.t_enter for r in runs_by_pid.get(pid, []) if r.t_enter > t_write]
    moved_on = min(next_starts, default=float("inf"))
    return any(t_write <= t <= moved_on for t in kills_by_pid.get(pid, []))
