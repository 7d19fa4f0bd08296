"""Look-ahead: while a task handed its lock through a queue list runs, its process
searches that list for the next queued task of the same lock (decoding kombu's messages),
which the task's release then hands the lock to and moves ahead.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import redis
from kombu import serialization
from kombu.utils import json as kombu_json

from .._core import lease_ms
from .._keyspace import lookahead_chain as lookahead_chain
from .._process import ProcessLocal
from .clients import settings_for
from .envelope import _bytes, envelope_entry, envelope_lock_key
from .queuelists import SEP, queue_call
from .tasklock import TaskLock, request_owner

log = logging.getLogger(__name__)


#: Header the worker's main process sets (in memory, never published) on a message that was
#: handed its lock through a queue list: the list its release searches (look-ahead).
LOOKAHEAD_HEADER = "redislock_lookahead"


class _Pull(NamedTuple):
    """The next queued task of a lock (look-ahead): its message, as found in its list;
    ``task_id`` "" when none was found (the release ends the lock's look-ahead chain)."""

    queue_list: str
    chain: str  # the queue list's look-ahead chain key (handoff.lua)
    task_id: str = ""  # "" (none found, or the search had not finished)
    raw: bytes = b""
    entry: str = ""  # the message as a parked envelope (envelope_entry)
    keep_ms: int = 0  # lifetime of its parked records (the parking lifetime)
    reach: int = 0  # how far from the read end the release looks for it (handoff.lua)


#: Messages one look-ahead read fetches (the next read, if any, fetches as many more).
LOOKAHEAD_CHUNK = 16
#: Bytes of messages one look-ahead search reads at most (it stops after the read that
#: reaches this).
LOOKAHEAD_BYTES = 1 << 20
#: This process's one look-ahead thread (a new one after a fork).
_lookahead_executor = ProcessLocal(
    lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="redislock-lookahead")
)


def _lookahead_thread() -> ThreadPoolExecutor:
    """This process's one look-ahead thread (a new one after a fork)."""
    return _lookahead_executor.get()


def _next_queued(
    app: Any, lock: TaskLock, queue_list: str, limit: int, keep_for: float
) -> _Pull | None:
    """The oldest message among the ``limit`` next to be read from ``queue_list`` whose task
    takes ``lock`` (requeue mode), if no task is parked behind the lock already (None);
    else a :class:`_Pull` without a task (the release ends this lock's look-ahead chain,
    if it has one). Whether another lock's chain holds the list is the release's to say.

    kombu's Redis transport pushes messages on the left of a queue's list and reads them
    from the right: the right end is the oldest. One round trip reads the parked count and
    the first chunk; most hot locks have their next task in it.
    """
    try:
        return _search_queue(app, lock, queue_list, limit, lease_ms(keep_for, "parking lifetime"))
    except redis.exceptions.ResponseError as exc:
        if not _denied(exc):
            raise
        _lookahead_denied.add(queue_list)
        log.warning(
            "redislock: look-ahead is off for queue list %r in this process: the locks' Redis "
            "user lacks a permission it needs (%s); grant it +lrange on the queue lists",
            queue_list,
            exc,
        )
        return None


#: Queue lists the locks' Redis user may not read (this process stops searching them).
_lookahead_denied: set[str] = set()


def _denied(exc: redis.exceptions.ResponseError) -> bool:
    """Whether ``exc`` says the locks' Redis user may not run a command or reach a key: a
    NOPERM error, or (Redis 7.0, from a script) a plain ERR saying the user can't run it."""
    return isinstance(exc, redis.exceptions.NoPermissionError) or (
        "user executing the script can't" in str(exc)  # run this command / access a key
    )


def _search_queue(
    app: Any, lock: TaskLock, queue_list: str, limit: int, keep_ms: int
) -> _Pull | None:
    accept = serialization.prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    chain = lookahead_chain(lock.prefix, queue_list)
    nothing = _Pull(queue_list, chain)
    signing_key = settings_for(app).signing_key
    start = read = 0
    while start < limit and read < LOOKAHEAD_BYTES:
        end = min(start + LOOKAHEAD_CHUNK, limit)
        if start == 0 and SEP not in queue_list:
            pipe = lock.client.pipeline(transaction=False)
            pipe.llen(lock.parked)
            pipe.lrange(queue_list, -end, -1)
            parked, raws = pipe.execute()
            if parked:
                return None  # the release hands the lock to a parked task
        else:  # (a list in another database: read through the queue script)
            if start == 0 and lock.client.llen(lock.parked):
                return None
            raws = queue_call(lock.client, "LRANGE", queue_list, -end, -start - 1)
        for position, raw in enumerate(map(_bytes, reversed(raws)), start):  # oldest first
            read += len(raw)
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            lock_key = _lock_of.get(digest, b"")
            if lock_key == b"":  # not seen by this process yet: decode it
                lock_key = _lock_of[digest] = _lock_key_of(app, raw, accept)
                if len(_lock_of) > LOOKAHEAD_CACHE:
                    del _lock_of[next(iter(_lock_of))]  # the oldest entry
            if lock_key == lock.keys.lock:
                envelope = kombu_json.loads(raw)  # type: ignore[no-untyped-call]
                headers = envelope["headers"]
                headers.pop(LOOKAHEAD_HEADER, None)
                queued_owner = request_owner(headers)
                if queued_owner != lock.owner:
                    entry = envelope_entry(queue_list, envelope, lock.keys.lock, signing_key)
                    reach = position + 1 + QUEUE_REACH
                    return _Pull(queue_list, chain, queued_owner, raw, entry, keep_ms, reach)
        if len(raws) < end - start:
            return nothing  # the whole list was read
        start = end
    return nothing


#: How far from a queue list's read end the hand-over scripts look for a message (LPOS
#: MAXLEN), so that one fetched meanwhile never costs a scan of a long backlog: a
#: look-ahead release, this much farther than where its search found the message (hand-overs
#: pushed to the read end meanwhile move it back; beyond that it stays in its turn), and
#: the sweeper, for an envelope a hand-over pushed (beyond that it is sent again).
QUEUE_REACH = 1000

#: Queued messages whose lock this process knows (digest of the message -> lock key or
#: None), so that each message is decoded once however many look-ahead searches read it.
_lock_of: dict[bytes, bytes | None] = {}
LOOKAHEAD_CACHE = 4096


def _lock_key_of(app: Any, raw: bytes, accept: Any) -> bytes | None:
    """The lock key the task of the broker envelope ``raw`` takes, if it takes one in
    requeue mode and could be parked at delivery (task protocol 2, a task id, no ``eta``
    or ``expires``); else None."""
    from .base import LockedTask  # (base imports this module)

    try:
        envelope = kombu_json.loads(raw)  # type: ignore[no-untyped-call]
        headers = envelope["headers"]
        task = app.tasks.get(headers.get("task"))
        if (
            not isinstance(task, LockedTask)
            or headers.get("eta")
            or headers.get("expires")
            or task.lock_options().on_contention != "requeue"
        ):
            return None
    except Exception:  # not a message this look-ahead understands: leave it in its turn
        return None
    return envelope_lock_key(app, envelope, accept)
