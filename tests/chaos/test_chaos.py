"""Chaos suite for the single-node lock: real processes, real faults, safety and liveness.

Safety is checked three ways in every scenario:

* a :class:`FencedResource` every holder writes through with its ``lock.token``: the
  admitted writes must come in token order, a write sent after a newer token was
  admitted must be refused, and a holder whose lease held until its release must
  never be refused;
* per-process logs of enter/exit times on the shared monotonic clock: no two
  intervals of holders with a valid lease may overlap (a holder SIGSTOPped or killed
  past its lease may overlap; its fenced writes must then be refused);
* counting: the counter every critical section increments (a deliberately
  non-atomic read-modify-write) equals the sections whose writes landed, and every
  work item is completed exactly once.

Liveness: all the work completes within a bound.

The seed of the random choices comes from ``REDISLOCK_CHAOS_SEED`` (or is drawn at
random); it is printed and is part of every assertion message, so a failure can be
replayed. One summary line per scenario is printed (``pytest -s`` shows it). The
``slow`` variants run longer with more faults: ``-m slow`` (deselected by default).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import redis

from celery_redislock import FencedResource, LockLostError, RedisLock
from celery_redislock.testing import RedisServer

from .. import _chaos
from .._chaos import Report, Swarm, analyse

DEBUG_ENABLED = ["--enable-debug-command", "local"]


@pytest.fixture
def seed() -> int:
    env = os.environ.get("REDISLOCK_CHAOS_SEED")
    value = int(env) if env else random.SystemRandom().randrange(1, 2**31)
    print(f"\n[chaos] REDISLOCK_CHAOS_SEED={value}")
    return value


@pytest.fixture
def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A private server per scenario (DEBUG allowed from loopback: scenario 4 uses it)."""
    return redis_server_factory(extra=DEBUG_ENABLED)


def summary(scenario: str, seed: int, report: Report, faults: str, elapsed: float) -> None:
    print(f"[chaos] {scenario}: seed={seed} {report.line()} faults: {faults} {elapsed:.1f}s")


def fault_counts(faults: list[_chaos.Fault]) -> str:
    counts: dict[str, int] = {}
    for fault in faults:
        counts[fault.kind] = counts.get(fault.kind, 0) + 1
    total = sum(counts.values())
    return f"{total} ({', '.join(f'{k}={n}' for k, n in sorted(counts.items())) or 'none'})"


def run_swarm(
    swarm: Swarm,
    seed: int,
    *,
    bound: float,
    inject: Callable[[Swarm, float], None] | None = None,
) -> tuple[Report, bool, float]:
    """Start the workers, run ``inject(swarm, deadline)``, wait for the work; analyse."""
    started = time.monotonic()
    try:
        swarm.start()
        if inject is not None:
            inject(swarm, started + bound)
        finished = swarm.wait(max(0.0, started + bound - time.monotonic()))
        counter_raw = swarm.admin.get(_chaos.COUNTER)
    finally:
        swarm.shutdown()
    elapsed = time.monotonic() - started
    report = analyse(
        swarm.log_paths(),
        counter_raw=counter_raw,
        expected_items=swarm.expected_items(),
        kills=swarm.kills,
        faults=swarm.faults,
    )
    return report, finished, elapsed


def assert_safe_and_live(
    swarm: Swarm, report: Report, finished: bool, seed: int, bound: float
) -> None:
    context = f"seed={seed} (replay: REDISLOCK_CHAOS_SEED={seed}); {report.line()}"
    assert report.violations == [], f"{context}; violations: {report.violations[:20]}"
    assert finished, f"{context}; the work did not complete within {bound}s"
    codes = swarm.exit_codes()
    assert all(code == 0 for code in codes.values()), f"{context}; exit codes {codes}"
    assert report.completed == len(swarm.expected_items()), context
    assert report.counter == report.completed + report.landed_unknown, context


# ----------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("defeat", ["shared-owner", "no-lock"])
def test_the_checks_catch_a_defeated_lock(
    server: RedisServer, tmp_path: Path, seed: int, defeat: str
) -> None:
    """Honesty: with the lock defeated (one shared hold for all, or no lock at all), the
    same analysis must find violations: overlaps, lost updates or fenced-off holders."""
    swarm = Swarm(
        server.port, "defeated", tmp_path, slots=3, items=6, ttl=1.0,
        hold_max=0.03, pause_max=0.005, seed=seed, defeat=defeat, together=True,
    )  # fmt: skip
    report, finished, elapsed = run_swarm(swarm, seed, bound=40)
    summary(f"self-test defeat={defeat}", seed, report, "none", elapsed)
    assert finished, f"seed={seed}: {report.line()}"
    assert report.violations, f"seed={seed}: a defeated lock went unnoticed: {report.line()}"
    assert any(v.startswith("overlap") for v in report.violations), report.violations[:5]


# ----------------------------------------------------------------------------- scenario 1


def kill_holders(kills: int, rng: random.Random) -> Callable[[Swarm, float], None]:
    def inject(swarm: Swarm, deadline: float) -> None:
        done = 0
        while done < kills and swarm.alive() and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.3, 0.8))
            for _ in range(50):  # catch a moment when a worker holds the lock
                pid = swarm.holder_pid()
                if pid is not None:
                    break
                time.sleep(0.01)
            if pid is not None:
                swarm.kill(pid)
                done += 1

    return inject


def scenario_kills(
    server: RedisServer, tmp_path: Path, seed: int, *, slots: int, items: int, kills: int,
    bound: float, label: str,
) -> None:  # fmt: skip
    rng = random.Random(seed)
    swarm = Swarm(
        server.port, "contended", tmp_path, slots=slots, items=items, ttl=0.6,
        hold_max=0.03, pause_max=0.01, seed=seed,
    )  # fmt: skip
    report, finished, elapsed = run_swarm(swarm, seed, bound=bound, inject=kill_holders(kills, rng))
    summary(label, seed, report, fault_counts(swarm.faults), elapsed)
    assert_safe_and_live(swarm, report, finished, seed, bound)
    assert len(swarm.kills) == kills, f"seed={seed}: only {len(swarm.kills)} kills happened"


def test_sigkilled_holders_never_let_two_in(server: RedisServer, tmp_path: Path, seed: int) -> None:
    scenario_kills(server, tmp_path, seed, slots=6, items=20, kills=5, bound=45, label="1 sigkill")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkilled_holders_never_let_two_in_long(
    request: pytest.FixtureRequest, server: RedisServer, tmp_path: Path, seed: int
) -> None:
    scenario_kills(
        server, tmp_path, seed, slots=8, items=60, kills=40, bound=400, label="1 sigkill (slow)"
    )


# ----------------------------------------------------------------------------- scenario 2


def _blpop_json(client: redis.Redis, key: str, timeout: float) -> dict[str, Any]:
    item = client.blpop([key], timeout=timeout)
    assert item is not None, f"no report on {key} within {timeout}s"
    return dict(json.loads(item[1]))


def _stop_kill_join(process: Any) -> None:
    if process.is_alive():
        os.kill(process.pid, signal.SIGCONT)
        os.kill(process.pid, signal.SIGKILL)
    process.join(10)


def scenario_paused_holder(server: RedisServer, seed: int, *, ttl: float, label: str) -> None:
    rng = random.Random(seed)
    client = server.client()
    run = _chaos_run()
    first = run(_chaos.paused_writer, server.port, "payment", ttl, "report:first")
    second = None
    started = time.monotonic()
    try:
        ready = _blpop_json(client, "report:first", 20)
        second = run(_chaos.second_holder, server.port, "payment", "report:second", "go:second")
        time.sleep(2 * ttl + 0.5)  # several leases: the watchdog keeps the first holder in
        ctx = f"seed={seed} (replay: REDISLOCK_CHAOS_SEED={seed})"
        assert client.llen("report:second") == 0, f"{ctx}: the second got in while renewed"
        lock_key = RedisLock(client, "payment").keys.lock
        assert client.hexists(lock_key, "first"), ctx

        os.kill(first.pid, signal.SIGSTOP)  # at a random point of its write loop
        t_stop = time.monotonic()
        got = _blpop_json(client, "report:second", ttl + 10)
        pause = max(0.0, t_stop + ttl * rng.uniform(1.5, 2.5) - time.monotonic())
        time.sleep(pause)  # stay stopped well past the lease
        os.kill(first.pid, signal.SIGCONT)
        t_cont = time.monotonic()
        done = _blpop_json(client, "report:first", 20)
        second_count = client.hget(lock_key, "second")  # after the stale release
        client.rpush("go:second", "release")
        released = _blpop_json(client, "report:second", 20)
    finally:
        for process in (first, second):
            if process is not None:
                _stop_kill_join(process)
    elapsed = time.monotonic() - started

    writes = [(t0, t1, ok) for t0, t1, ok in done["writes"]]
    admitted_first = [w for w in writes if w[2]]
    stale = [w for w in writes if w[0] > got["t_admit"] and w[2]]
    violations = []
    if stale:
        violations.append(f"{len(stale)} writes of the paused holder admitted after the newer")
    if not writes or writes[-1][2]:
        violations.append("the resumed holder was never fenced off")
    # Interval check: the first holder's [enter, exit] overlaps the second's; allowed only
    # because the first had lost its lease (its release says so).
    overlap = ready["t_enter"] < got["t_enter"] < done["t_exit"]
    if overlap and not done["release"].startswith("LockLostError"):
        violations.append("two holders overlapped and both releases claim a valid lease")
    if released["release"] != "ok":
        violations.append(f"the second holder's lease did not survive: {released['release']}")
    report = Report(
        acquisitions=2, sections=2, completed=1 + (1 if got["wrote"] else 0),
        rejected=1, lost_reports=len(done["callbacks"]),
        lost_releases=1 if done["release"].startswith("LockLostError") else 0,
        intervals=1, violations=violations,
    )  # fmt: skip
    faults = f"1 (sigstop {t_cont - t_stop:.2f}s = {(t_cont - t_stop) / ttl:.1f} leases)"
    summary(label, seed, report, faults, elapsed)

    ctx = f"seed={seed} (replay: REDISLOCK_CHAOS_SEED={seed}); {report.line()}; {done}; {got}"
    assert violations == [], ctx
    assert got["ok"] and got["admit"] and got["wrote"], ctx
    assert got["token"] > ready["token"], ctx
    assert got["t_enter"] > t_stop, ctx
    assert got["t_enter"] - t_stop < ttl + 3, f"{ctx}: the waiter was slow to take over"
    assert len(admitted_first) == len(writes) - 1, ctx  # only the last write was refused
    assert done["writes"][-1][0] > t_cont or done["writes"][-1][1] > t_cont, ctx
    assert done["signalled"] and done["reason"] == "stolen", ctx
    assert done["callbacks"] == ["stolen"], ctx
    assert done["ensure"] == "raised stolen", ctx
    assert done["release"] == "LockLostError stolen", ctx
    assert client.get("ledger:value") == b"second", ctx
    assert second_count == b"1", f"{ctx}: the stale release touched the new hold"
    assert FencedResource(client, "ledger").highest() == got["token"], ctx
    client.close()


def _chaos_run() -> Callable[..., Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")

    def run(target: Any, *args: Any) -> Any:
        process = ctx.Process(target=target, args=args, daemon=True)
        process.start()
        return process

    return run


def test_a_paused_holder_is_fenced_off_and_touches_nothing_of_the_new_holder(
    server: RedisServer, seed: int
) -> None:
    scenario_paused_holder(server, seed, ttl=0.5, label="2 sigstop")


# ----------------------------------------------------------------------------- scenario 3


def scenario_renewal_kills(server: RedisServer, seed: int, *, leases: int, label: str) -> None:
    """Kill the watchdog's private connections again and again while a holder works: the
    hold must survive (renewed past many leases) or its loss be reported; at no sample may
    the holder believe it holds (``ensure_held()`` passes) while Redis says otherwise, and
    no other owner may get in while it believes so."""
    rng = random.Random(seed)
    ttl = 0.5
    admin: Any = server.client()
    holder_client, thief_client = server.client(), server.client()
    ours = {int(c.client_id()) for c in (admin, holder_client, thief_client)}
    lock = RedisLock(holder_client, "renewed", ttl=ttl, owner="holder")
    thief = RedisLock(thief_client, "renewed", ttl=5, owner="thief", auto_renew=False)
    losses: list[str] = []
    lock.on_lost(lambda _lock, error: losses.append(str(error.reason)))
    started = time.monotonic()
    assert lock.acquire(timeout=5)
    token = lock.token
    kills = samples = stolen = 0
    violations: list[str] = []
    try:
        end = time.monotonic() + leases * ttl
        while time.monotonic() < end:
            for entry in admin.client_list():
                if int(entry["id"]) not in ours:  # the watchdog's connections
                    kills += int(admin.execute_command("CLIENT", "KILL", "ID", entry["id"]))
            for _ in range(rng.randint(1, 10)):
                time.sleep(0.02)
                samples += 1
                on_server = bool(admin.hexists(lock.keys.lock, "holder"))
                if thief.acquire(blocking=False):
                    stolen += 1
                    thief.release()
                    on_server = False
                try:
                    lock.ensure_held()
                    believes = True
                except LockLostError:
                    believes = False
                if believes and not on_server:
                    violations.append(f"silent hold at +{time.monotonic() - started:.3f}s")
        survived = not lock.lost and bool(admin.hexists(lock.keys.lock, "holder"))
        if survived:
            assert lock.token == token
            lock.release()
        else:
            with pytest.raises(LockLostError):
                lock.release()
    finally:
        for c in (admin, holder_client, thief_client):
            c.close()
    elapsed = time.monotonic() - started
    report = Report(
        acquisitions=1 + stolen, sections=1, completed=1 if survived else 0,
        lost_reports=len(losses), violations=violations,
    )  # fmt: skip
    outcome = "hold survived" if survived else f"loss reported ({losses})"
    summary(
        label, seed, report, f"{kills} (client-kill of renewal connections); {outcome}", elapsed
    )
    ctx = f"seed={seed} (replay: REDISLOCK_CHAOS_SEED={seed}); {report.line()}; {outcome}"
    assert violations == [], f"{ctx}: {violations[:10]}"
    assert kills >= leases // 2, f"{ctx}: only {kills} renewal connections were killed"
    assert survived or losses, f"{ctx}: the hold was lost and nobody was told"
    assert stolen == 0 or losses, f"{ctx}: another owner got in without a reported loss"


def test_killed_renewal_connections_recover_or_report(server: RedisServer, seed: int) -> None:
    scenario_renewal_kills(server, seed, leases=8, label="3a renewal client-kill")


def scenario_subscriber_kills(
    server: RedisServer, seed: int, *, gaps: list[float], label: str
) -> None:
    """A waiter blocked behind a long lease (ttl 30 s) has its subscriber connection killed
    ``gap`` seconds before the holder releases (after 1 s): it must still take the lock
    promptly, never sleep through the release until the lease would have run out."""
    rng = random.Random(seed)
    admin: Any = server.client()
    holder_client, waiter_client = server.client(), server.client()
    keys = RedisLock(admin, "waited").keys
    latencies: list[float] = []
    kills = 0
    violations: list[str] = []
    started = time.monotonic()
    rng.shuffle(gaps)
    try:
        for round_, gap in enumerate(gaps):
            holder = RedisLock(
                holder_client, "waited", ttl=30, owner=f"holder-{round_}", auto_renew=False
            )
            assert holder.acquire(blocking=False)
            result: dict[str, Any] = {}

            def wait(round_: int = round_, result: dict[str, Any] = result) -> None:
                waiter = RedisLock(waiter_client, "waited", ttl=30, owner=f"waiter-{round_}")
                result["ok"] = waiter.acquire(timeout=20)
                result["t"] = time.monotonic()
                if result["ok"]:
                    waiter.release()

            thread = threading.Thread(target=wait)
            thread.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # subscribed and in line
                subscribed = admin.pubsub_numsub(keys.channel)[0][1]
                if subscribed and admin.llen(keys.waiters):
                    break
                time.sleep(0.01)
            t_ready = time.monotonic()
            time.sleep(max(0.0, 1.0 - gap))
            killed = int(admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
            kills += killed
            time.sleep(gap)
            t_release = time.monotonic()
            holder.release()
            thread.join(25)
            if not result.get("ok"):
                violations.append(f"gap {gap}: the waiter never acquired ({result})")
                continue
            latency = result["t"] - t_release
            latencies.append(latency)
            if killed < 1:
                violations.append(f"gap {gap}: no subscriber connection to kill")
            if latency > 10:
                violations.append(f"gap {gap}: acquired {latency:.2f}s after the release")
            assert t_ready > 0
    finally:
        for c in (admin, holder_client, waiter_client):
            c.close()
    elapsed = time.monotonic() - started
    report = Report(acquisitions=2 * len(latencies), violations=violations)
    worst = max(latencies, default=float("nan"))
    faults = f"{kills} (client-kill type pubsub); worst wake latency {worst * 1000:.0f} ms"
    summary(label, seed, report, faults, elapsed)
    ctx = f"seed={seed} (replay: REDISLOCK_CHAOS_SEED={seed}); latencies {latencies}"
    assert violations == [], f"{ctx}: {violations}"


def test_a_waiter_whose_subscriber_is_killed_still_takes_the_lock_promptly(
    server: RedisServer, seed: int
) -> None:
    scenario_subscriber_kills(
        server, seed, gaps=[0.0, 0.002, 0.02, 0.2, 0.6], label="3b subscriber client-kill"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_connection_kills_long(
    request: pytest.FixtureRequest, server: RedisServer, seed: int
) -> None:
    scenario_renewal_kills(server, seed, leases=120, label="3a renewal client-kill (slow)")
    gaps = [random.Random(seed + i).uniform(0, 0.9) for i in range(40)] + [0.0] * 10
    scenario_subscriber_kills(server, seed, gaps=gaps, label="3b subscriber client-kill (slow)")


# ----------------------------------------------------------------------------- scenario 4

FAULT_WEIGHTS = {
    "sigkill": 2,
    "stop-brief": 2,
    "stop-past-lease": 2,
    "client-kill": 3,
    "debug-sleep": 2,
}


def random_faults(
    faults: int, rng: random.Random, ttl: float, budget: float
) -> Callable[[Swarm, float], None]:
    kinds = list(FAULT_WEIGHTS)
    weights = [FAULT_WEIGHTS[k] for k in kinds]

    def inject(swarm: Swarm, deadline: float) -> None:
        stop_at = min(deadline, time.monotonic() + budget)
        while swarm.alive() and len(swarm.faults) < faults and time.monotonic() < stop_at:
            time.sleep(rng.uniform(0.05, 0.4))
            kind = rng.choices(kinds, weights)[0]
            if kind == "client-kill":
                swarm.client_kill(rng)
            elif kind == "debug-sleep":
                swarm.debug_sleep(ttl * rng.uniform(0.1, 0.4))
            else:
                pid = swarm.victim(rng)
                if pid is None:
                    continue
                if kind == "sigkill":
                    swarm.kill(pid)
                elif kind == "stop-brief":
                    swarm.stop(pid, ttl * rng.uniform(0.05, 0.3), kind)
                else:
                    swarm.stop(pid, ttl * rng.uniform(1.3, 2.2), kind)

    return inject


def scenario_fault_schedule(
    server: RedisServer, tmp_path: Path, seed: int, *, slots: int, items: int, faults: int,
    budget: float, bound: float, label: str,
) -> None:  # fmt: skip
    rng = random.Random(seed)
    ttl = 0.6
    swarm = Swarm(
        server.port, "faulted", tmp_path, slots=slots, items=items, ttl=ttl,
        hold_max=0.03, pause_max=0.01, seed=seed,
    )  # fmt: skip
    inject = random_faults(faults, rng, ttl, budget)
    report, finished, elapsed = run_swarm(swarm, seed, bound=bound, inject=inject)
    victims = f"; {swarm.victims_holding} process faults hit a holder"
    summary(label, seed, report, fault_counts(swarm.faults) + victims, elapsed)
    assert_safe_and_live(swarm, report, finished, seed, bound)
    assert len(swarm.faults) >= faults // 2, (
        f"seed={seed}: only {len(swarm.faults)} faults injected before the work ran out"
    )


@pytest.mark.slow  # the default suite's random faults on this lock: the quick soak's part A
def test_a_seeded_random_fault_schedule_keeps_the_lock_safe_and_live(
    server: RedisServer, tmp_path: Path, seed: int
) -> None:
    scenario_fault_schedule(
        server, tmp_path, seed, slots=5, items=100, faults=30, budget=18, bound=60,
        label="4 random faults",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_seeded_random_fault_schedule_long(
    request: pytest.FixtureRequest, server: RedisServer, tmp_path: Path, seed: int
) -> None:
    scenario_fault_schedule(
        server, tmp_path, seed, slots=8, items=400, faults=400, budget=300, bound=700,
        label="4 random faults (slow)",
    )  # fmt: skip
