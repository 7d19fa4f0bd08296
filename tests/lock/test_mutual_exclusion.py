"""Mutual exclusion with real processes: a non-atomic counter must come out exact."""

from __future__ import annotations

import redis

from celery_redislock.testing import RedisServer

from .. import _procs

PROCESSES = 8
ITERATIONS = 40


def test_eight_processes_never_overlap_and_lose_no_update(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    workers = [
        _procs.run(_procs.hammer, redis_server.port, "counter", ITERATIONS, "log")
        for _ in range(PROCESSES)
    ]
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0] * PROCESSES

    sections = []
    for raw in redis_client.lrange("log", 0, -1):
        pid, enter, leave, token = raw.decode().split()
        sections.append((float(enter), float(leave), int(pid), int(token)))
    # It saw every critical section it expected, from every process...
    assert len(sections) == PROCESSES * ITERATIONS
    assert len({pid for _, _, pid, _ in sections}) == PROCESSES
    # ...none of them overlapped another (CLOCK_MONOTONIC is shared by all processes)...
    sections.sort()
    overlaps = [(a, b) for a, b in zip(sections, sections[1:]) if b[0] < a[1]]
    assert overlaps == []
    # ...each holder had a fresh fencing token, increasing in the order they held it...
    tokens = [token for *_, token in sections]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    # ...and the read-modify-write counter lost no update.
    assert int(redis_client.get("counter:counter") or 0) == PROCESSES * ITERATIONS
    assert not redis_client.exists("redislock:{counter}")
