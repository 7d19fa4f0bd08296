"""RedisSemaphore with real processes (issue 17, the primitive): at most N inside, and N
reached, with every section counted; holders SIGKILLed and SIGSTOPped mid-hold get their
permits back after their leases and no sooner; a stale holder's fenced write is refused.

What the sections did is recorded on a second private redis-server that the semaphore
never touches (the witness, ``_procs.WITNESS``): one atomic script per event counts the
holders inside and numbers the event in one sequence shared by all processes. The oracle
rebuilds how many were inside from that total order alone and checks it against the
witness's count at every event, so a lost or doubled record fails the test as well as an
overlap beyond the limit. Each section's recorded span lies inside its real hold (entry
after the acquire returned, exit before the release), so more than N in the records is
more than N holding.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import FencedResource, RedisSemaphore
from celery_redislock.testing import RedisServer

from .. import _procs
from .._support import blpop_within

NAME = "tenant"
LIMIT = 3
PROCESSES = 12


@pytest.fixture
def lock_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(retry=Retry(NoBackoff(), 0))
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def witness(redis_server_factory: Callable[..., RedisServer]) -> Iterator[redis.Redis]:
    """A second private server, for the records only: the semaphore never touches it."""
    client = redis_server_factory().client(retry=Retry(NoBackoff(), 0))
    yield client
    client.close()


def port_of(client: redis.Redis) -> int:
    return int(client.connection_pool.connection_kwargs["port"])


def permit_key(lock_client: redis.Redis, owner: str) -> bytes:
    return RedisSemaphore(lock_client, NAME, limit=LIMIT).semaphore_keys.permit(owner)


def assert_semaphore_empty(lock_client: redis.Redis) -> None:
    keys = RedisSemaphore(lock_client, NAME, limit=LIMIT).semaphore_keys
    assert lock_client.smembers(keys.line.lock) == set()
    assert lock_client.keys(keys.permits + b"*") == []


def reap(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGCONT)
            os.kill(process.pid, signal.SIGKILL)
        process.join(10)


# -- at most N inside, N reached, every section counted ------------------------------


@dataclass
class Section:
    pid: int
    token: int
    enter: int  # the witness's sequence numbers
    exit: int


def read_sections(witness: redis.Redis, prefix: str) -> list[Section]:
    """Pair each process's entries and exits (in its own order); check that the witness's
    count of holders at every event is the count the total order gives (complete records)."""
    events = [line.decode().split() for line in witness.lrange(f"{prefix}:log", 0, -1)]
    events.sort(key=lambda event: int(event[3]))
    assert [int(event[3]) for event in events] == list(range(1, len(events) + 1))
    inside = 0
    open_by_pid: dict[int, tuple[int, int]] = {}
    sections = []
    for kind, pid, token, seq, counted, _micros in events:
        if kind == "enter":
            inside += 1
            assert int(pid) not in open_by_pid, f"process {pid} entered twice"
            open_by_pid[int(pid)] = (int(token), int(seq))
        else:
            inside -= 1
            entered_token, entered = open_by_pid.pop(int(pid))
            assert entered_token == int(token)
            sections.append(Section(int(pid), int(token), entered, int(seq)))
        assert int(counted) == inside, f"event {seq}: witness counted {counted}, order {inside}"
    assert open_by_pid == {}, f"sections never left: {open_by_pid}"
    return sections


def most_inside(sections: list[Section]) -> int:
    """The most sections open at once, from the sequence numbers alone."""
    changes = sorted([(s.enter, +1) for s in sections] + [(s.exit, -1) for s in sections])
    inside = peak = 0
    for _seq, change in changes:
        inside += change
        peak = max(peak, inside)
    return peak


def hammer(
    lock_client: redis.Redis, witness: redis.Redis, iterations: int, hold: float
) -> list[Section]:
    prefix = "run"
    processes = [
        _procs.run(
            _procs.sem_sections,
            port_of(lock_client),
            port_of(witness),
            NAME,
            LIMIT,
            iterations,
            hold,
            prefix,
        )
        for _ in range(PROCESSES)
    ]
    try:
        for i in range(PROCESSES):  # all ready before any starts: they contend from the first
            assert blpop_within(witness, [f"{prefix}:ready"], 60) is not None, f"{i} ready"
        witness.rpush(f"{prefix}:go", *["go"] * PROCESSES)
        for process in processes:
            process.join(300)
        assert [p.exitcode for p in processes] == [0] * PROCESSES
    finally:
        reap(processes)
    pids = {p.pid for p in processes}
    reports = dict(line.decode().split() for line in witness.lrange(f"{prefix}:done", 0, -1))
    # Every process reported the sections it completed: all it was asked for.
    assert {int(pid) for pid in reports} == pids
    assert all(int(done) == iterations for done in reports.values())
    sections = read_sections(witness, prefix)
    # The records hold every section each process reported, and no other.
    assert len(sections) == PROCESSES * iterations
    for pid, done in reports.items():
        assert sum(1 for s in sections if s.pid == int(pid)) == int(done)
    assert len({s.token for s in sections}) == len(sections)  # a fresh token each
    return sections


def test_twelve_processes_at_limit_three_never_more_than_three_inside_and_three_reached(
    lock_client: redis.Redis, witness: redis.Redis
) -> None:
    sections = hammer(lock_client, witness, iterations=6, hold=0.015)
    assert most_inside(sections) == LIMIT  # never above the limit, and it was reached
    assert_semaphore_empty(lock_client)


@pytest.mark.slow
def test_twelve_processes_at_limit_three_long_run(
    lock_client: redis.Redis, witness: redis.Redis
) -> None:
    sections = hammer(lock_client, witness, iterations=60, hold=0.01)
    assert most_inside(sections) == LIMIT
    assert_semaphore_empty(lock_client)


# -- killed and paused holders -------------------------------------------------------


def kill_and_pause_round(
    lock_client: redis.Redis, witness: redis.Redis, round_: int, newer_than: int
) -> int:
    """Three holders (limit 3): one SIGKILLed, one SIGSTOPped, one alive (renewing). The
    killed one's lease is short, the paused one's long, so their permits come back in that
    order. Returns the newest token handed out in the round."""
    short, long_ = 0.6, 3.0
    owners = {"killed": short, "paused": long_, "alive": long_}
    report = {o: f"r{round_}:report:{o}" for o in owners}
    holders = {
        o: _procs.run(
            _procs.sem_lease_holder,
            port_of(lock_client),
            port_of(witness),
            NAME,
            f"{o}{round_}",
            ttl,
            report[o],
        )
        for o, ttl in owners.items()
    }
    paused_permit = permit_key(lock_client, f"paused{round_}")
    killed_permit = permit_key(lock_client, f"killed{round_}")
    try:
        ready = {o: json.loads(blpop_within(witness, [report[o]], 60)[1]) for o in owners}
        held_tokens = [r["token"] for r in ready.values()]
        assert len(set(held_tokens)) == 3 and min(held_tokens) > newer_than
        probe = RedisSemaphore(lock_client, NAME, limit=LIMIT, owner=f"probe{round_}")
        assert not probe.acquire(blocking=False)  # three held: full

        os.kill(holders["killed"].pid, signal.SIGKILL)
        os.kill(holders["paused"].pid, signal.SIGSTOP)
        # A permit comes back only when a lease runs out: neither holder can renew, delete
        # or re-create its permit now, so a permit key seen after the acquire returned was
        # there all through it.
        first = RedisSemaphore(lock_client, NAME, limit=LIMIT, ttl=10, owner=f"first{round_}")
        assert first.acquire(timeout=30)
        assert not (lock_client.exists(killed_permit) and lock_client.exists(paused_permit))
        assert not lock_client.exists(killed_permit)  # the short lease went first

        # While the paused holder's lease is valid, it and two others hold: no third other.
        assert not probe.acquire(blocking=False)
        assert lock_client.pttl(paused_permit) > 0, "the paused lease ran out before the probe"

        second = RedisSemaphore(lock_client, NAME, limit=LIMIT, ttl=10, owner=f"second{round_}")
        assert second.acquire(timeout=30)
        assert not lock_client.exists(paused_permit)  # after its lease, not sooner

        # Tokens strictly increase across permits: the newcomers' are above all three.
        assert first.token is not None and second.token is not None
        assert max(held_tokens) < first.token < second.token
        newest = second.token
        ledger = FencedResource(witness, "ledger")
        assert ledger.write(second.token, "ledger:value", f"second{round_}")

        os.kill(holders["paused"].pid, signal.SIGCONT)
        witness.rpush(f"{report['paused']}:go", "write")
        stale = json.loads(blpop_within(witness, [report["paused"]], 60)[1])
        assert stale["wrote"] is False  # refused: a newer token wrote
        assert stale["held"].startswith("lost") and stale["lost"] is True
        assert witness.get("ledger:value") == f"second{round_}".encode()
        assert ledger.highest() == second.token

        witness.rpush(f"{report['alive']}:go", "check")  # renewed all along: still holds
        alive = json.loads(blpop_within(witness, [report["alive"]], 60)[1])
        assert alive["held"] == "held" and alive["lost"] is False
        first.release()
        second.release()
        holders["paused"].join(30)
        holders["alive"].join(30)
        assert holders["paused"].exitcode == 0 and holders["alive"].exitcode == 0
        assert holders["killed"].exitcode == -signal.SIGKILL
        return newest
    finally:
        reap(list(holders.values()))


def test_killed_and_paused_holders_permits_come_back_after_their_leases_stale_write_refused(
    lock_client: redis.Redis, witness: redis.Redis
) -> None:
    kill_and_pause_round(lock_client, witness, 0, newer_than=0)
    assert_semaphore_empty(lock_client)


@pytest.mark.slow
def test_killed_and_paused_holders_round_after_round(
    lock_client: redis.Redis, witness: redis.Redis
) -> None:
    newest = 0
    for round_ in range(5):
        newest = kill_and_pause_round(lock_client, witness, round_, newer_than=newest)
        assert_semaphore_empty(lock_client)
