"""Every Lua script's reply, decoded in one place (I/O-free).

One small decoder per script (``lua/<script>.lua``'s header says what it returns). What
Redis sends back is not trusted: anyone who can write the server (or a proxy, or a
script of another version) can make it answer anything. A reply of the wrong shape
raises :class:`MalformedReplyError`, naming the script and what was wrong — never an
``IndexError`` or ``ValueError`` from deep inside a caller.

A number is a Lua integer: redis-py gives it as an ``int`` (``bool`` is refused), or as
decimal ``bytes``/``str`` from a client that decodes responses. A string is ``bytes``
(or ``str``). A Lua ``false`` inside a table comes back as ``None``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from ._errors import RedisLockError


class MalformedReplyError(RedisLockError, ValueError):
    """A script's reply does not have the shape that script can send back."""


def _malformed(script: str, reply: object, why: str) -> MalformedReplyError:
    shown = repr(reply)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return MalformedReplyError(f"malformed {script}.lua reply ({why}): {shown}")


def _number(value: object, script: str, reply: object, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (bytes, str)):
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        body = text[1:] if text[:1] == "-" else text
        if body.isascii() and body.isdigit() and len(body) <= 20:
            return int(text)
    raise _malformed(script, reply, f"{what} is not an integer")


def _table(reply: object, script: str, low: int, high: int) -> Sequence[Any]:
    if not isinstance(reply, (list, tuple)):
        raise _malformed(script, reply, "not an array")
    if not low <= len(reply) <= high:
        raise _malformed(script, reply, f"{len(reply)} elements, expected {low} to {high}")
    return reply


def _string(value: object, script: str, reply: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    raise _malformed(script, reply, f"{what} is not a string")


def _tag(value: object, script: str, reply: object) -> bytes:
    """A delivery tag's suffix: a token (a number) or ``<token>s<ms>`` (a string)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    return _string(value, script, reply, "the tag")


# --------------------------------------------------------------------- acquire, park


class AcquireReply(NamedTuple):
    """acquire.lua's reply, decoded (a named tuple: built once per attempt, on the hot path)."""

    acquired: bool
    token: int = 0
    hold_count: int = 0
    #: Milliseconds left on another owner's lease (-1: the key has no expiry; -2: just vanished).
    pttl: int = 0
    #: The owner's "done" marker exists: it already finished its work under this lock.
    finished: bool = False
    #: A task run's attempt found its own owner holding the lock (another delivery of
    #: the same run is running): nothing was changed.
    running: bool = False


def decode_acquire(reply: Any, script: str = "acquire") -> AcquireReply:
    """acquire.lua: ``{1, token, count}`` taken, ``{0, ms}`` not taken, ``{-1, 0}`` done,
    ``{2, ms}`` this run holds it; park.lua's ``{3, ms}`` is read as ``{2, ms}``."""
    if reply.__class__ is list and len(reply) == 3:  # taken, as a rule: checked as below
        code, token, count = reply
        exact = code.__class__ is int and token.__class__ is int and count.__class__ is int
        if exact and code == 1:
            return AcquireReply(True, token, count)
    if not isinstance(reply, (list, tuple)) or not reply:
        raise _malformed(script, reply, "not a non-empty array")
    code = _number(reply[0], script, reply, "the code")
    if code == 1:
        _table(reply, script, 3, 3)
        token = _number(reply[1], script, reply, "the token")
        count = _number(reply[2], script, reply, "the hold count")
        return AcquireReply(True, token=token, hold_count=count)
    _table(reply, script, 2, 2)
    if code == -1:
        return AcquireReply(False, finished=True)
    pttl = _number(reply[1], script, reply, "the wait")
    if code in (2, 3):  # acquire.lua "task" / park.lua: this owner holds it already
        return AcquireReply(False, pttl=pttl, running=True)
    if code == 0:
        return AcquireReply(False, pttl=pttl)
    raise _malformed(script, reply, f"unknown code {code}")


def decode_sem_acquire(reply: Any, script: str = "sem_acquire") -> AcquireReply:
    """sem_acquire.lua: ``{1, token, count}`` taken or re-entered, ``{0, ms}`` refused."""
    decoded = decode_acquire(reply, script)
    if decoded.finished or decoded.running:
        raise _malformed(script, reply, "a code only acquire.lua sends")
    return decoded


def decode_park(reply: Any) -> AcquireReply | None:
    """park.lua: as :func:`decode_acquire`, and ``{2, 0}`` (with "behind": the lock is
    free or this task id's) is None."""
    is_table = isinstance(reply, (list, tuple)) and bool(reply)
    if is_table and _number(reply[0], "park", reply, "the code") == 2:
        _table(reply, "park", 2, 2)
        return None
    return decode_acquire(reply, "park")


class LatestReply(NamedTuple):
    """park.lua / sem_park.lua with "last call wins" (latest.lua), decoded."""

    #: As :func:`decode_park`'s (None: never, "behind" is not used with it); for
    #: ``superseded`` and ``pending_ms`` an AcquireReply that did not acquire.
    park: AcquireReply
    #: This call ended without running: a newer call (its task id; None: unknown) took
    #: its key.
    superseded: bool = False
    superseded_by: bytes | None = None
    #: This call is its key's pending call until due, in this many ms (debounce); None: not.
    pending_ms: int | None = None
    #: The task id of the older pending call this call took the place of, if any.
    evicted: bytes | None = None
    #: Superseded calls not yet recorded as such (this one's and the evicted one's
    #: included): (task id, the task id of the call that superseded it, or None).
    unreported: tuple[tuple[bytes, bytes | None], ...] = ()


def decode_latest(reply: Any, script: str = "park") -> LatestReply:
    """park.lua (sem_park.lua) with latest.lua: ``{-1, 0}`` (this run finished) and
    ``{3, ms}`` (another delivery of it holds the lock) as park's, answered before the
    gate; park's other replies with a 4th element (the evicted task id, or nil) and a 5th
    (the superseded calls not yet recorded: a flat list of task id, newer task id or "");
    and ``{4, task id or nil}`` superseded, ``{5, ms}`` pending until due (each with a nil
    3rd element, the 4th and the 5th)."""
    table = _table(reply, script, 2, 5)
    code = _number(table[0], script, reply, "the code")
    if len(table) == 2:  # answered before the gate: this run finished, or holds it
        if code not in (-1, 3):
            raise _malformed(script, reply, f"code {code} needs 4 elements")
        return LatestReply(decode_acquire(list(table), script))
    _table(reply, script, 5, 5)
    evicted = None if table[3] is None else _string(table[3], script, reply, "the evicted id")
    listed = _table(table[4], script, 0, 64) if table[4] is not None else []
    if len(listed) % 2:
        raise _malformed(script, reply, "the unrecorded calls are not pairs")
    unreported = tuple(
        (
            _string(listed[i], script, reply, "an unrecorded id"),
            _string(listed[i + 1], script, reply, "its newer id") or None,
        )
        for i in range(0, len(listed), 2)
    )
    if code == 4:
        by = None if table[1] is None else _string(table[1], script, reply, "the newer id")
        return LatestReply(AcquireReply(False), True, by, evicted=evicted, unreported=unreported)
    if code == 5:
        wait = _number(table[1], script, reply, "the wait")
        pending = max(wait, 0)
        return LatestReply(
            AcquireReply(False), pending_ms=pending, evicted=evicted, unreported=unreported
        )
    if code == 1:
        park = decode_acquire(list(table[:3]), script)
    else:
        park = decode_acquire([table[0], table[1]], script)
    return LatestReply(park, evicted=evicted, unreported=unreported)


#: latest_due.lua's codes.
DUE_SEND, DUE_LATER, DUE_NONE = 1, 0, -1


def decode_latest_due(reply: Any) -> tuple[int, int, bytes | None, bytes | None]:
    """latest_due.lua: (code, ms until the next look, message, owner)."""
    if not isinstance(reply, (list, tuple)) or not reply:
        raise _malformed("latest_due", reply, "not a non-empty array")
    code = _number(reply[0], "latest_due", reply, "the code")
    if code == DUE_NONE:
        _table(reply, "latest_due", 1, 1)
        return code, 0, None, None
    if code == DUE_LATER:
        _table(reply, "latest_due", 2, 2)
        return code, _number(reply[1], "latest_due", reply, "the wait"), None, None
    if code == DUE_SEND:
        _table(reply, "latest_due", 3, 3)
        message = _string(reply[1], "latest_due", reply, "the message")
        return code, 0, message, _string(reply[2], "latest_due", reply, "the owner")
    raise _malformed("latest_due", reply, f"unknown code {code}")


# --------------------------------------------------------------------- release, renew, fence

#: The codes release.lua answers besides a count of holds left (n >= 0).
RELEASE_CODES = (-1, -2, -3)


def decode_release(reply: Any) -> int:
    """release.lua: n >= 0 holds left; -1 expired, -2 another owner's, -3 held nothing."""
    code = _number(reply, "release", reply, "the reply")
    if code < 0 and code not in RELEASE_CODES:
        raise _malformed("release", reply, f"unknown code {code}")
    return code


#: renew.lua's codes: 1 renewed, 0 the key is gone, -1 another owner's.
RENEW_CODES = (1, 0, -1)


def decode_renew(reply: Any, count: int) -> list[int]:
    """renew.lua for ``count`` holds: one code per hold (:data:`RENEW_CODES`)."""
    table = _table(reply, "renew", count, count)
    codes = [_number(code, "renew", reply, "a code") for code in table]
    if any(code not in RENEW_CODES for code in codes):
        raise _malformed("renew", reply, "a code is not 1, 0 or -1")
    return codes


def decode_renew_one(reply: Any) -> int:
    """renew.lua for one hold: its code (:data:`RENEW_CODES`)."""
    (code,) = decode_renew(reply, 1)
    return code


def renew_outcomes(reply: Any, count: int) -> list[int | Exception]:
    """A watchdog batch's renew.lua reply (from a pipeline that does not raise): one code
    per hold, or the error each of them failed with (the reply's, or a malformed reply's)."""
    if isinstance(reply, Exception):
        return [reply] * count
    try:
        return list(decode_renew(reply, count))
    except MalformedReplyError as exc:
        return [exc] * count


def decode_fence(reply: Any) -> bool:
    """fence.lua: whether the token was admitted (1) or refused as stale (0)."""
    code = _number(reply, "fence", reply, "the reply")
    if code not in (0, 1):
        raise _malformed("fence", reply, f"unknown code {code}")
    return code == 1


# --------------------------------------------------------------------- rate


class RateReply(NamedTuple):
    """rate.lua's reply, decoded."""

    #: The call was admitted: its slot is ``wait_us`` after ``now_us``.
    admitted: bool
    #: Admitted: microseconds until its slot (0: now). Refused: until it would be admitted.
    wait_us: int
    #: The server's clock when the script ran (microseconds since the epoch, from TIME).
    now_us: int


def decode_rate(reply: Any, max_wait_us: int, longest_us: int) -> RateReply:
    """rate.lua: ``{1, wait, now}`` admitted, ``{0, wait, now}`` refused. The wait must
    match the decision (admitted: at most ``max_wait_us``, the most the call allowed;
    refused: more) and be at most ``longest_us`` (no schedule reaches further)."""
    table = _table(reply, "rate", 3, 3)
    code = _number(table[0], "rate", reply, "the code")
    wait = _number(table[1], "rate", reply, "the wait")
    now = _number(table[2], "rate", reply, "the server time")
    if code not in (0, 1):
        raise _malformed("rate", reply, f"unknown code {code}")
    if not 0 <= wait <= longest_us or now <= 0:
        raise _malformed("rate", reply, "the wait or the server time is out of range")
    if (wait <= max_wait_us) != (code == 1):
        raise _malformed(
            "rate", reply, f"the wait does not match the code (max wait {max_wait_us})"
        )
    return RateReply(code == 1, wait, now)


# --------------------------------------------------------------------- handoff, sweep


def decode_rate_defer(reply: Any) -> tuple[int | None, int]:
    """rate_defer.lua's reply: (None, when its slot was booked in µs on the server's
    clock) if admitted at once, else (the wait in microseconds until the deferred list's
    head is due, -1: the call joined a line; 0)."""
    table = _table(reply, "rate_defer", 2, 3)
    code = _number(table[0], "rate_defer", reply, "the code")
    wait = _number(table[1], "rate_defer", reply, "the wait")
    if code == 1 and wait == 0 and len(table) == 3:
        return None, _number(table[2], "rate_defer", reply, "the time")
    if code != 0 or wait < -1 or len(table) != 2:
        raise _malformed("rate_defer", reply, "not a code it sends")
    return wait, 0


#: rate_drain.lua's codes.
DRAIN_EMPTY, DRAIN_CHANGED, DRAIN_NOT_DUE, DRAIN_DROPPED, DRAIN_ADMITTED, DRAIN_PASSED = range(6)


def decode_rate_drain(reply: Any) -> tuple[int, int]:
    """rate_drain.lua's reply: (code, the wait in microseconds when not due, or when the
    slot was booked in µs on the server's clock when admitted; else 0)."""
    table = _table(reply, "rate_drain", 1, 2)
    code = _number(table[0], "rate_drain", reply, "the code")
    if code in (DRAIN_NOT_DUE, DRAIN_ADMITTED, DRAIN_PASSED) and len(table) == 2:
        value = _number(table[1], "rate_drain", reply, "the wait or time")
        if value >= 0:
            return code, value
    elif code in (DRAIN_EMPTY, DRAIN_CHANGED, DRAIN_DROPPED) and len(table) == 1:
        return code, 0
    raise _malformed("rate_drain", reply, "not a code it sends")


def decode_rate_resend(reply: Any) -> bool:
    """rate_resend.lua's reply: whether the caller claimed the call to send it again."""
    code = _number(reply, "rate_resend", reply, "the reply")
    if code not in (0, 1):
        raise _malformed("rate_resend", reply, "not 0 or 1")
    return code == 1


class Handed(NamedTuple):
    """A parked task a script handed the lock to: its message to check and send."""

    task_id: bytes
    message: bytes  # a signed parked signature, or a parked broker envelope
    tag: bytes = b""  # an envelope's delivery tag suffix: "<placeholder>h<tag>"


class HandoffReply(NamedTuple):
    """handoff.lua's reply."""

    #: n > 0 holds left, 0 released (or handed over), -1 expired (a parked or queued task
    #: may still have been handed the lock), -2 another owner's or holding's, -3 not
    #: handed to it ("unstarted").
    code: int
    #: The parked task handed the lock, whose message the worker checks and sends.
    handed: Handed | None = None
    #: The look-ahead's queued task handed the lock (its message moved, nothing to send).
    pulled: bytes | None = None
    #: The parked task handed the lock whose envelope the script pushed back to its queue
    #: itself (nothing to send).
    pushed: bytes | None = None


def _absent(value: object) -> bool:
    return value is None or value is False


def decode_handoff(reply: Any) -> HandoffReply:
    """handoff.lua: ``{n}``; ``{c, message, task id, token}`` handed over (send it);
    ``{c, nil, task id}`` handed over, its envelope pushed back; ``{c, nil, task id, 1}``
    handed to the look-ahead's queued task. ``c``: 0 released, or -1 when the releasing
    hold had expired (the lock still goes to the next task)."""
    table = _table(reply, "handoff", 1, 4)
    code = _number(table[0], "handoff", reply, "the code")
    if code < 0 and code not in RELEASE_CODES:
        raise _malformed("handoff", reply, f"unknown code {code}")
    if len(table) == 1:
        return HandoffReply(code)
    if code not in (0, -1) or len(table) < 3:
        raise _malformed("handoff", reply, "a hand-over without a task id")
    task_id = _string(table[2], "handoff", reply, "the task id")
    if _absent(table[1]):
        if len(table) == 4:
            return HandoffReply(code, pulled=task_id)
        return HandoffReply(code, pushed=task_id)
    message = _string(table[1], "handoff", reply, "the message")
    tag = _tag(table[3], "handoff", reply) if len(table) == 4 else b""
    return HandoffReply(code, handed=Handed(task_id, message, tag))


class SweepReply(NamedTuple):
    """sweep.lua's reply."""

    #: 0 nothing to do, -1 nothing parked or dispatched (forget the lock), 1 send ``handed``.
    code: int
    handed: Handed | None = None


def decode_sweep(reply: Any) -> SweepReply:
    """sweep.lua: ``{0}``, ``{-1}``, or ``{1, message, task id, tag}``."""
    table = _table(reply, "sweep", 1, 4)
    code = _number(table[0], "sweep", reply, "the code")
    if code in (0, -1) and len(table) == 1:
        return SweepReply(code)
    if code != 1 or len(table) != 4:
        raise _malformed("sweep", reply, "not {0}, {-1} or {1, message, task id, tag}")
    message = _string(table[1], "sweep", reply, "the message")
    task_id = _string(table[2], "sweep", reply, "the task id")
    return SweepReply(1, Handed(task_id, message, _tag(table[3], "sweep", reply)))


def decode_box(reply: Any) -> tuple[bytes, int | None] | None:
    """A lone waiter's box read (BLPOP ``<box>``, ``_lone_waiter``): None if it timed out;
    else (nonce, token) of the direct grant ``<token>:<nonce>`` pushed there, the token
    None for anything else (a grant the usual way pushes the owner id; a prefix writer
    can push anything). Never raises: what a box holds only ever makes its waiter retry."""
    if not isinstance(reply, list) or len(reply) != 2 or not isinstance(reply[1], bytes):
        return None
    token, _, nonce = reply[1].partition(b":")
    return nonce, (int(token) if token.isdigit() else None)
