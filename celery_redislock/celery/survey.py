"""What every busy key holds right now, read from Redis in one pass: for ``redislock top``
and the exporter's gauges (``redislock exporter``).

:func:`survey` finds the held locks (SCAN of the lock hashes), the locks and limited keys
with parked tasks (the sweeper's registry), the limited keys in use (their holders sets)
and the rate keys with deferred runs (the drainers' registry), and reads each with
:mod:`.inspection`: holders, permits in use out of the limit, parked runs by the task
their message names, deferred runs, and the oldest wait where Redis keeps its start (a
limited run's first try, carried in its parked message; a deferred run's deferral).
Everything read is taken as it comes (:mod:`.inspection`); it only reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.exceptions import RedisError, ResponseError

from .._core import LockKeys, server_clock_us
from .._keyspace import (
    RateKeys,
    SemaphoreKeys,
    debounce_registry,
    latest_run_key,
    lock_key_pattern,
    name_from_lock_key,
    parked_registry,
    parked_under,
    semaphore_name,
)
from .contention import FIRST_TRY_HEADER
from .envelope import ENVELOPE
from .inspection import (
    CHUNK,
    describe_limited,
    describe_lock,
    describe_rated,
    limited_names,
    parked_task_name,
    rated_names,
    read,
    text,
    whole,
)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _each_key(name: Any) -> Any:
    """Read one key: what is there that the package never writes (a hold count of
    thousands of digits, a time too large for a float...) leaves that key out, never the
    survey; a Redis error still ends it."""
    try:
        yield
    except RedisError:
        raise
    except Exception:
        log.debug("redislock: left out %r: not as the package writes it", name, exc_info=True)


@dataclass
class KeyState:
    """One busy key: a lock, a limited key (``limit``) or a rate key (``rate``)."""

    name: str
    kind: str
    holders: int = 0
    limit: int | None = None
    owners: list[str] = field(default_factory=list)
    parked: int = 0
    parked_by_task: dict[str, int] = field(default_factory=dict)
    deferred: int = 0
    deferred_task: str | None = None
    waiting: int = 0
    ttl: float | None = None
    token: int | None = None
    head_due: float | None = None
    oldest_wait: float | None = None

    @property
    def heat(self) -> tuple[int, int]:
        """How hot it is: work waiting on it first, then its holders."""
        return (self.parked + self.deferred + self.waiting, self.holders)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Survey:
    """Every busy key at one moment (``now``: the Redis server's clock, in seconds)."""

    now: float
    keys: list[KeyState]

    def hottest(self, count: int | None = None) -> list[KeyState]:
        ranked = sorted(self.keys, key=lambda k: (k.heat, k.name), reverse=True)
        ranked.sort(key=lambda k: k.heat, reverse=True)
        return ranked if count is None else ranked[:count]


def _parked_line(
    client: Any, line: LockKeys, now: float
) -> tuple[int, dict[str, int], float | None]:
    """How many runs are parked on ``line``, by task name, and the oldest one's wait
    when its message says when it first tried (a limited run's)."""
    found: dict[str, int] = {}
    oldest: float | None = None
    start = total = 0
    while True:
        (ids,) = read(client, ("lrange", line.parked, start, start + CHUNK - 1))
        ids = [i for i in ids or () if isinstance(i, bytes)]
        if not ids:
            return total, found, oldest
        (messages,) = read(client, ("hmget", line.parked_messages, ids))
        for message in messages or ():
            if not isinstance(message, bytes):
                continue
            total += 1
            task = parked_task_name(message)
            found[task] = found.get(task, 0) + 1
            tried = _first_try(message)
            if tried is not None and tried <= now:
                oldest = max(oldest or 0.0, now - tried)
        start += CHUNK


def _first_try(message: bytes) -> float | None:
    """A parked broker envelope's first-try header (a limited run's), else None."""
    try:
        if message[:1] != ENVELOPE.encode():
            return None
        headers = json.loads(message.split(b"\n", 2)[2])["headers"]
        value = headers.get(FIRST_TRY_HEADER)
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):
        return None
    return _time(value)


def _time(value: Any) -> float | None:
    """A wall-clock time as the package writes one (a finite number > 0), else None (an
    integer too large for a float, as JSON may carry, included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def _deferred_at(entry: Any) -> float | None:
    """When a deferred entry was deferred (wall clock), else None."""
    try:
        value = json.loads(entry.split(b"\n", 1)[1]).get("deferred_at")
    except (ValueError, IndexError, TypeError, AttributeError):
        return None
    return _time(value)


def survey(client: Any, prefix: str) -> Survey:
    """Every busy key under ``prefix`` now (see the module docstring). Redis errors
    propagate; what is not as the package writes it is left out."""
    now = server_clock_us(client.time()) / 1_000_000
    keys: dict[tuple[str, str], KeyState] = {}
    locks: set[bytes] = set(
        k
        for k in client.scan_iter(match=lock_key_pattern(prefix, b"*"), count=1000, _type="hash")
        if isinstance(k, bytes)
    )
    with contextlib.suppress(ResponseError):  # (not a sorted set: no registry to read)
        for member, _ in client.zscan_iter(parked_registry(prefix)):
            if isinstance(member, bytes) and isinstance(parked_under(member, prefix), LockKeys):
                locks.add(member)
    for key in sorted(locks):
        with _each_key(key):
            state = _lock_state(client, prefix, key, now)
            if state is not None:
                keys[(state.name, "lock")] = state
    for name in limited_names(client, prefix, b"*"):
        with _each_key(name):
            state = _limited_state(client, prefix, name, now)
            if state is not None:
                keys[(state.name, "limit")] = state
    for name in rated_names(client, prefix, b"*"):
        with _each_key(name):
            state = _rated_state(client, prefix, name, now)
            if state is not None:
                keys[(state.name, "rate")] = state
    # A set: ZSCAN may return a member more than once (a rehash during the scan), and a
    # member counted twice would count its call as two deferred ones.
    debounced: set[Any] = set()
    with contextlib.suppress(ResponseError):  # (not a sorted set: no registry to read)
        debounced.update(member for member, _ in client.zscan_iter(debounce_registry(prefix)))
    for member in sorted(debounced, key=repr):
        with _each_key(member):
            _debounced(client, prefix, member, now, keys)
    return Survey(now=now, keys=list(keys.values()))


def _debounced(
    client: Any, prefix: str, member: Any, now: float, keys: dict[tuple[str, str], KeyState]
) -> None:
    """A debounced call waiting for its quiet period to end (``lock_debounce``): counted as
    deferred on its lock or limited key, due when its quiet period ends."""
    run_key = latest_run_key(member) if isinstance(member, bytes) else None
    under = parked_under(run_key, prefix) if run_key is not None else None
    if run_key is None or under is None:
        return
    ((due, message),) = read(client, ("hmget", member, "pd", "pm"))
    due_ms = whole(due)
    if not due_ms:
        return  # (no call waits for its quiet period: it waits for the lock, parked)
    kind = "limit" if isinstance(under, SemaphoreKeys) else "lock"
    found = (
        semaphore_name(run_key, prefix) if kind == "limit" else name_from_lock_key(run_key, prefix)
    )
    if found is None:
        return
    name = text(found)
    state = keys.get((name, kind))
    if state is None:
        state = keys[(name, kind)] = KeyState(
            name=name, kind=kind, limit=1 if kind == "lock" else None
        )
    state.deferred += 1
    state.deferred_task = parked_task_name(message) if isinstance(message, bytes) else "?"
    wait = due_ms / 1000 - now
    state.head_due = wait if state.head_due is None else min(state.head_due, wait)


def _lock_state(client: Any, prefix: str, key: bytes, now: float) -> KeyState | None:
    row = describe_lock(client, prefix, key)
    parked, by_task, oldest = 0, dict[str, int](), None
    if row is None or row["parked"]:  # (held with nothing parked: no more to read)
        parked, by_task, oldest = _parked_line(client, LockKeys.for_lock(key), now)
    if row is None and not parked:
        return None
    if row is None:
        row = {"name": text(key), "owners": {}, "ttl": None, "token": None}
    state = KeyState(
        name=row["name"],
        kind="lock",
        holders=len(row["owners"]),
        limit=1,
        owners=sorted(row["owners"]),
        parked=parked,
        parked_by_task=by_task,
        ttl=row["ttl"],
        token=row["token"] or None,
        oldest_wait=oldest,
    )
    return state if state.holders or state.parked else None


def _limited_state(client: Any, prefix: str, name: bytes, now: float) -> KeyState | None:
    found = describe_limited(client, prefix, name)
    if found is None:
        return None
    line = SemaphoreKeys.for_name(name, prefix).line
    parked, by_task, oldest = _parked_line(client, line, now)
    state = KeyState(
        name=found["name"],
        kind="limit",
        holders=found["holders"],
        limit=found["limit"],
        owners=sorted(found["owners"]),
        parked=parked,
        parked_by_task=by_task,
        waiting=found["waiting"],
        ttl=found["ttl"],
        token=found["token"],
        oldest_wait=oldest,
    )
    return state if state.holders or state.parked or state.waiting else None


def _rated_state(client: Any, prefix: str, name: bytes, now: float) -> KeyState | None:
    found = describe_rated(client, prefix, name)
    if found is None or not found["deferred"]:
        return None
    (head,) = read(client, ("lindex", RateKeys.for_name(name, prefix).deferred, 0))
    deferred_at = _deferred_at(head) if isinstance(head, bytes) else None
    return KeyState(
        name=found["name"],
        kind="rate",
        deferred=found["deferred"],
        deferred_task=found["head_task_name"],
        head_due=found["head_due"],
        oldest_wait=None if deferred_at is None else max(0.0, now - deferred_at),
    )
