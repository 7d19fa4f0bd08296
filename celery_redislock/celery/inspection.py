"""What Redis holds for a lock or a limited key, read for ``celery redislock``.

:func:`describe_lock` reads one lock hash, :func:`describe_limited` one limited key
(``lock_limit``: a semaphore's holders, their permits, its parked tasks and line),
:func:`limited_names` finds limited keys, :func:`limits_now` counts what is in use in
all of them; :func:`describe_rated` reads one rate key (``lock_rate``: each limit's
next free slot, the deferred backlog and its head), :func:`rated_names` finds the rate
keys with a deferred backlog. Everything read is taken as it comes: anyone who may
write the package's names may have written anything there, so a value of another type
reads as nothing, a field that is not what the scripts write is left out, and no read
raises for it (a connection error does). Names and owners are returned as text (bytes that are not
UTF-8 as backslash escapes): the CLI escapes them again for the terminal.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from .._core import CHAIN_FIELD, FENCE_FIELD, GRANT_FIELD, LIMIT_FIELD, LockKeys, server_clock_us
from .._keyspace import (
    RateKeys,
    SemaphoreKeys,
    deferred_key_pattern,
    deferred_registry,
    name_from_lock_key,
    parked_registry,
    rate_name_from_deferred,
    semaphore_key_pattern,
    semaphore_name,
)
from .envelope import ENVELOPE
from .signing import SIGNED

#: How many parked tasks and waiters ``show`` lists.
SHOWN = 21
#: Parked tasks read per command when they are counted by task name.
CHUNK = 500


def text(value: bytes | str) -> str:
    """``value`` as text (bytes that are not UTF-8 as backslash escapes)."""
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def read(client: Any, *commands: tuple[Any, ...]) -> list[Any]:
    """The answers to ``commands`` (``("llen", key)``, ...) in one round trip. A command
    refused for the type of what is there answers None; a connection error raises."""
    pipe = client.pipeline(transaction=False)
    for command, *args in commands:
        getattr(pipe, command)(*args)
    return [None if isinstance(a, ResponseError) else a for a in pipe.execute(False)]


def whole(value: Any) -> int | None:
    """A count, token or limit as the scripts write one (ASCII digits), else None."""
    if isinstance(value, bytes) and 0 < len(value) <= 19 and value.isdigit():
        return int(value)
    return None


def count(value: Any) -> int:
    """An integer a command answered (LLEN, PUBSUB NUMSUB), or 0 when it could not."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _ids(values: Any) -> list[bytes]:
    return [value for value in values or () if isinstance(value, bytes)]


# ------------------------------------------------------------------ locks


def describe_lock(client: Any, prefix: str, key: bytes) -> dict[str, Any] | None:
    """The lock whose hash is ``key``: owners and hold counts, lease left (``ttl``),
    token, parked count; None if it is not held (or ``key`` names no lock)."""
    name = name_from_lock_key(key, prefix)
    if name is None:
        return None
    fields, pttl, parked = read(
        client, ("hgetall", key), ("pttl", key), ("llen", LockKeys.for_lock(key).parked)
    )
    if not fields:
        return None
    reserved = (FENCE_FIELD.encode(), GRANT_FIELD.encode(), CHAIN_FIELD.encode())
    # Hold counts only: reserved fields, and any a later version may add, are skipped.
    owners = {
        text(k): n for k, v in fields.items() if k not in reserved and (n := whole(v)) is not None
    }
    return {
        "kind": "lock",
        "name": text(name),
        "owners": owners,
        "holds": sum(owners.values()),
        "ttl": None if not isinstance(pttl, int) or pttl < 0 else pttl / 1000.0,
        "token": whole(fields.get(FENCE_FIELD.encode())) or 0,
        "parked": count(parked),
    }


def lock_line(client: Any, keys: LockKeys) -> tuple[int, list[str]]:
    """How many processes wait on the lock, and the first :data:`SHOWN` parked task ids.

    A process's waiters subscribe to the lock's release channel, except its lone waiter
    (``_lone_waiter``: one per connection pool), which blocks on its box and subscribes to
    nothing: counted by its wake id (a box's, ``L...``) while its place in line is kept. A
    process with both on one lock counts twice."""
    numsub = dict(client.pubsub_numsub(keys.channel))
    parked, clock, wake = read(
        client, ("lrange", keys.parked, 0, SHOWN - 1), ("time",), ("hgetall", keys.wake)
    )
    boxed = [
        owner
        for owner, wake_id in (wake or {}).items()
        if isinstance(wake_id, bytes) and wake_id.startswith(b"L")
    ]
    lone = 0
    if boxed and clock:
        now_ms = server_clock_us(clock) // 1000
        kept = read(client, *(("zscore", keys.claims, owner) for owner in boxed))
        lone = sum(1 for until in kept if isinstance(until, float) and until >= now_ms)
    return count(numsub.get(keys.channel)) + lone, [text(t) for t in _ids(parked)]


# ------------------------------------------------------------------ limited keys


class Permit(NamedTuple):
    """One holder's permit of a limited key, as Redis has it."""

    owner: bytes
    holds: int  # 0: handed over (or granted) and not taken up yet
    ttl: float | None  # lease left (s); None: no expiry
    token: int | None
    limit: int | None  # the limit it was taken under


def permits(client: Any, keys: SemaphoreKeys) -> list[Permit]:
    """The permits of the key's holders that still exist: the ones the scripts count
    as held (``sem.lua``'s live_permits), by owner."""
    (members,) = read(client, ("smembers", keys.line.lock))
    owners = sorted(_ids(members))
    commands: list[tuple[Any, ...]] = []
    for owner in owners:
        commands += [("hgetall", keys.permit(owner)), ("pttl", keys.permit(owner))]
    found = read(client, *commands) if owners else []
    held = []
    for owner, fields, pttl in zip(owners, found[::2], found[1::2]):
        if not isinstance(pttl, int) or pttl == -2:
            continue  # its lease ran out (the next script drops it from the set)
        fields = fields if isinstance(fields, dict) else {}
        held.append(
            Permit(
                owner=owner,
                holds=whole(fields.get(owner)) or 0,
                ttl=None if pttl < 0 else pttl / 1000.0,
                token=whole(fields.get(FENCE_FIELD.encode())),
                limit=whole(fields.get(LIMIT_FIELD.encode())) or None,
            )
        )
    return held


def describe_limited(
    client: Any, prefix: str, name: bytes, *, detail: bool = False
) -> dict[str, Any] | None:
    """The limited key ``name``: its holders (``owners``: hold counts; ``holders``: how
    many permits are held), ``limit`` (the largest its permits were taken under, or else
    its first parked tasks'), the shortest lease left (``ttl``), the largest ``token``, how
    many tasks are ``parked`` and ``waiting`` in line. With ``detail`` (``show``), each
    permit, the first parked tasks with their limits, the first waiters, and the
    processes waiting. None when nothing of it is there."""
    keys = SemaphoreKeys.for_name(name, prefix)
    line = keys.line
    parked, waiting, first_parked, waiters = read(
        client,
        ("llen", line.parked),
        ("llen", line.waiters),
        ("lrange", line.parked, 0, SHOWN - 1),
        ("lrange", line.waiters, 0, SHOWN - 1),
    )
    held, parked, waiting = permits(client, keys), count(parked), count(waiting)
    if not held and not parked and not waiting:
        return None
    parked_ids = _ids(first_parked)
    found = read(client, ("hmget", line.parked_limit, parked_ids)) if parked_ids else [[]]
    parked_limits = [whole(limit) for limit in found[0] or []] + [None] * len(parked_ids)
    limits = [p.limit for p in held if p.limit]
    if not limits:  # no permit says: the limits its first parked tasks left
        limits = [n for n in parked_limits if n]
    ttls = [p.ttl for p in held if p.ttl is not None]
    tokens = [p.token for p in held if p.token is not None]
    row: dict[str, Any] = {
        "kind": "semaphore",
        "name": text(name),
        "owners": {text(p.owner): p.holds for p in held},
        "holders": len(held),
        "holds": sum(p.holds for p in held),
        "limit": max(limits, default=None),
        "ttl": min(ttls, default=None),
        "token": max(tokens, default=None),
        "parked": parked,
        "waiting": waiting,
    }
    if detail:
        row["permits"] = [{**p._asdict(), "owner": text(p.owner)} for p in held]
        row["parked_tasks"] = [
            {"task": text(task_id), "limit": limit or None}
            for task_id, limit in zip(parked_ids, parked_limits)
        ]
        row["waiters"] = [text(owner) for owner in _ids(waiters)]
        numsub = dict(client.pubsub_numsub(line.channel))
        row["waiting_processes"] = count(numsub.get(line.channel))
    return row


def limited_names(client: Any, prefix: str, pattern: bytes) -> list[bytes]:
    """The names of the limited keys whose name matches the glob ``pattern``: those
    with a holders set (SCAN), and those with parked tasks (the sweeper's registry,
    ZSCAN): a key whose permits all ran out may still have tasks parked."""
    match = semaphore_key_pattern(prefix, pattern)
    keys = set(client.scan_iter(match=match, count=1000, _type="set"))
    with contextlib.suppress(ResponseError):  # (not a sorted set: no registry to read)
        keys.update(m for m, _ in client.zscan_iter(parked_registry(prefix), match=match))
    names = (semaphore_name(key, prefix) for key in keys if isinstance(key, bytes))
    return sorted({name for name in names if name is not None})


def parked_task_name(message: Any) -> str:
    """The task a parked message names (not verified: for counting), or "?"."""
    try:
        if message[:1] == SIGNED.encode():
            task = json.loads(message.split(b"\n", 1)[1]).get("task")
        elif message[:1] == ENVELOPE.encode():
            task = json.loads(message.split(b"\n", 2)[2])["headers"].get("task")
        else:
            return "?"
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):
        return "?"
    return task if isinstance(task, str) and task else "?"


def parked_by_task(client: Any, keys: SemaphoreKeys) -> dict[str, int]:
    """The tasks parked behind a limited key, by task name (:func:`parked_task_name`);
    read :data:`CHUNK` at a time (an id whose message is gone is not parked)."""
    line, start = keys.line, 0
    found: dict[str, int] = {}
    while True:
        (ids,) = read(client, ("lrange", line.parked, start, start + CHUNK - 1))
        ids = _ids(ids)
        if not ids:
            return found
        (messages,) = read(client, ("hmget", line.parked_messages, ids))
        for message in _ids(messages):
            task = parked_task_name(message)
            found[task] = found.get(task, 0) + 1
        start += CHUNK


def limits_now(client: Any, prefix: str) -> tuple[int, int, dict[str, int]]:
    """The limited keys in use now, the permits held in them, and the tasks parked
    behind them by task name."""
    keys_in_use = held = 0
    parked: dict[str, int] = {}
    for name in limited_names(client, prefix, b"*"):
        keys = SemaphoreKeys.for_name(name, prefix)
        held_here, by_task = len(permits(client, keys)), parked_by_task(client, keys)
        for task, number in by_task.items():
            parked[task] = parked.get(task, 0) + number
        held += held_here
        keys_in_use += bool(held_here or by_task)
    return keys_in_use, held, parked


# ------------------------------------------------------------------ rate keys


def deferred_call(entry: Any) -> tuple[str | None, str | None, dict[int, int]]:
    """A deferred entry's task id, task name and limits (period in µs: count), read as it
    comes (not verified: for showing); what cannot be read is None (or left out)."""
    try:
        found = json.loads(entry.split(b"\n", 1)[1])
        signature = found["signature"]
        task_id = signature["options"].get("task_id")
        task = signature.get("task")
        limits = {
            int(period): int(number)
            for number, period in found.get("limits") or ()
            if isinstance(number, int) and isinstance(period, int) and number > 0 and period > 0
        }
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):
        return None, None, {}
    return (
        task_id if isinstance(task_id, str) else None,
        task if isinstance(task, str) else None,
        limits,
    )


def _seconds(value: Any, now_ms: float) -> float | None:
    """A registry score (ms on the server's clock) as seconds from now, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return round((value - now_ms) / 1000.0, 3)


def describe_rated(
    client: Any, prefix: str, name: bytes, *, detail: bool = False
) -> dict[str, Any] | None:
    """The rate key ``name`` (``lock_rate``): how many runs are ``deferred`` on it, when
    its head is due (``head_due``: seconds from now on the server's clock, negative when
    overdue; None if the drainers' registry does not list it) and which task it is. With
    ``detail`` (``show``), each limit's schedule (found by SCAN): its period, its count
    when the head names it, and its next free slot for a run (burst 1, as tasks take
    them: seconds from now, 0 when free now; None when the schedule is not a number the
    scripts wrote, which they read as full). None when nothing of it is there."""
    keys = RateKeys.for_name(name, prefix)
    schedules: list[tuple[int, bytes]] = []
    if detail:
        for key in client.scan_iter(match=keys.schedule_pattern, count=1000, _type="string"):
            period = keys.period_of(key) if isinstance(key, bytes) else None
            if period is not None:
                schedules.append((period, key))
        schedules.sort()
    clock, backlog, due, head, *values = read(
        client,
        ("time",),
        ("llen", keys.deferred),
        ("zscore", deferred_registry(prefix), keys.deferred),
        ("lindex", keys.deferred, 0),
        *(("get", key) for _, key in schedules),
    )
    backlog = count(backlog)
    if not backlog and due is None and not schedules:
        return None
    now_us = server_clock_us(clock)
    task_id, task, counts = deferred_call(head) if isinstance(head, bytes) else (None, None, {})
    row: dict[str, Any] = {
        "kind": "rate",
        "name": text(name),
        "deferred": backlog,
        "head_due": _seconds(due, now_us / 1000.0),
        "head_task": task_id,
        "head_task_name": task,
    }
    if detail:
        limits = []
        for (period, _key), value in zip(schedules, values):
            tat = whole(value)
            limits.append(
                {
                    "period": period / 1_000_000,
                    "count": counts.get(period),
                    "next_free": None if tat is None else max(tat - now_us, 0) / 1_000_000,
                }
            )
        row["limits"] = limits
    return row


def rated_names(client: Any, prefix: str, pattern: bytes) -> list[bytes]:
    """The names of the rate keys with a deferred backlog whose name matches the glob
    ``pattern``, as the drainers' registry lists them (ZSCAN)."""
    match = deferred_key_pattern(prefix, pattern)
    found: set[bytes] = set()
    with contextlib.suppress(ResponseError):  # (not a sorted set: no registry to read)
        for member, _ in client.zscan_iter(deferred_registry(prefix), match=match):
            name = rate_name_from_deferred(member, prefix) if isinstance(member, bytes) else None
            if name:
                found.add(name)
    return sorted(found)


def describe_latest(client: Any, key: bytes) -> dict[str, Any] | None:
    """A last-call-wins key's ``:latest`` hash ``key`` (``celery.latest``): its pending call
    (task id, sent time, when due: seconds from now, None once it waits for the lock) and
    the newest call that started (task id, sent time); None when it holds neither. Junk
    fields (anyone who may write the prefix) read as missing."""
    try:
        fields, clock = read(client, ("hmget", key, "pt", "ps", "pd", "st", "s"), ("time",))
    except Exception:  # not a hash: nothing to show
        return None
    pending, sent, due, started, started_sent = (fields or [None] * 5)[:5]
    now_ms = server_clock_us(clock) // 1000
    due_ms = whole(due)
    row: dict[str, Any] = {}

    def at(micros: Any) -> float | None:
        value = whole(micros)
        return None if value is None else value / 1_000_000

    if pending is not None:
        row["pending"] = {
            "task": text(pending),
            "sent": at(sent),
            "due_in": None if not due_ms else max(due_ms - now_ms, 0) / 1000,
        }
    if started is not None:
        row["newest_started"] = {"task": text(started), "sent": at(started_sent)}
    return row or None
