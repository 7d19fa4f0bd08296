"""celery_redislock._replies: one decoder per script reply; a malformed reply is a clear
MalformedReplyError, never an IndexError/TypeError/ValueError of another kind."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_redislock._errors import RedisLockError
from celery_redislock._replies import (
    AcquireReply,
    Handed,
    HandoffReply,
    LatestReply,
    MalformedReplyError,
    RateReply,
    SweepReply,
    decode_acquire,
    decode_fence,
    decode_handoff,
    decode_latest,
    decode_latest_due,
    decode_park,
    decode_rate,
    decode_release,
    decode_renew,
    decode_renew_one,
    decode_sweep,
    renew_outcomes,
)


def test_acquire() -> None:
    assert decode_acquire([1, 7, 2]) == AcquireReply(True, token=7, hold_count=2)
    assert decode_acquire([0, 1234]) == AcquireReply(False, pttl=1234)
    assert decode_acquire([0, -1]) == AcquireReply(False, pttl=-1)
    assert decode_acquire([-1, 0]) == AcquireReply(False, finished=True)
    assert decode_acquire([2, 50]) == AcquireReply(False, pttl=50, running=True)
    assert decode_acquire((b"1", b"7", "2")) == AcquireReply(True, token=7, hold_count=2)


def test_park() -> None:
    assert decode_park([2, 0]) is None  # "behind": free, or this task id's
    assert decode_park([3, 40]) == AcquireReply(False, pttl=40, running=True)
    assert decode_park([1, 9, 1]) == AcquireReply(True, token=9, hold_count=1)
    assert decode_park([0, 10]) == AcquireReply(False, pttl=10)
    assert decode_park([-1, 0]) == AcquireReply(False, finished=True)


def test_latest() -> None:
    # Answered before the gate, as park's: this run finished, or another delivery holds it.
    assert decode_latest([-1, 0]) == LatestReply(AcquireReply(False, finished=True))
    assert decode_latest([3, 40]) == LatestReply(AcquireReply(False, pttl=40, running=True))
    taken = decode_latest([1, 9, 1, b"old", [b"old", b"me"]])
    assert taken == LatestReply(
        AcquireReply(True, token=9, hold_count=1), evicted=b"old", unreported=((b"old", b"me"),)
    )
    assert decode_latest([0, 10, None, None, []]) == LatestReply(AcquireReply(False, pttl=10))
    superseded = decode_latest([4, b"newer", None, None, [b"me", b"newer"]])
    assert superseded.superseded and superseded.superseded_by == b"newer"
    by_a_run = decode_latest([4, None, None, None, [b"me", b""]])
    assert by_a_run.superseded_by is None and by_a_run.unreported == ((b"me", None),)
    pending = decode_latest([5, 1500, None, b"older", []])
    assert pending.pending_ms == 1500 and pending.evicted == b"older"
    assert decode_latest_due([1, b"message", b"owner"]) == (1, 0, b"message", b"owner")
    assert decode_latest_due([0, 250]) == (0, 250, None, None)
    assert decode_latest_due([-1]) == (-1, 0, None, None)


def test_release_renew_fence() -> None:
    assert [decode_release(c) for c in (0, 3, -1, -2, -3, b"2")] == [0, 3, -1, -2, -3, 2]
    assert decode_renew([1, 0, -1], 3) == [1, 0, -1]
    assert decode_renew_one([1]) == 1
    error = ConnectionError("down")
    assert renew_outcomes(error, 2) == [error, error]
    assert renew_outcomes([1, -1], 2) == [1, -1]
    bad = renew_outcomes([1], 2)
    assert len(bad) == 2 and all(isinstance(b, MalformedReplyError) for b in bad)
    assert decode_fence(1) is True and decode_fence(0) is False


def test_handoff() -> None:
    assert decode_handoff([2]) == HandoffReply(2)
    assert decode_handoff([0]) == HandoffReply(0)
    assert decode_handoff([-3]) == HandoffReply(-3)
    assert decode_handoff([0, b"msg", b"id", 12]) == HandoffReply(
        0, handed=Handed(b"id", b"msg", b"12")
    )
    # An envelope pushed back to its queue by the script: named, nothing to send.
    assert decode_handoff([0, None, b"id"]) == HandoffReply(0, pushed=b"id")
    assert decode_handoff([0, None, b"id", 1]) == HandoffReply(0, pulled=b"id")
    # The releasing hold had expired: the lock still went to the next task.
    assert decode_handoff([-1, b"msg", b"id", 3]) == HandoffReply(
        -1, handed=Handed(b"id", b"msg", b"3")
    )
    assert decode_handoff([-1, None, b"id"]) == HandoffReply(-1, pushed=b"id")
    assert decode_handoff([-1, None, b"id", 1]) == HandoffReply(-1, pulled=b"id")


def test_sweep() -> None:
    assert decode_sweep([0]) == SweepReply(0)
    assert decode_sweep([-1]) == SweepReply(-1)
    assert decode_sweep([1, b"msg", b"id", b"5s123"]) == SweepReply(
        1, Handed(b"id", b"msg", b"5s123")
    )


def test_rate() -> None:
    assert decode_rate([1, 0, 1700], 0, 10**9) == RateReply(True, 0, 1700)
    assert decode_rate([1, 500, 1700], 500, 10**9) == RateReply(True, 500, 1700)
    assert decode_rate([b"0", b"501", b"1700"], 500, 10**9) == RateReply(False, 501, 1700)


DECODERS: dict[str, Callable[[Any], object]] = {
    "acquire": decode_acquire,
    "park": decode_park,
    "release": decode_release,
    "renew": lambda r: decode_renew(r, 2),
    "renew_one": decode_renew_one,
    "fence": decode_fence,
    "handoff": decode_handoff,
    "sweep": decode_sweep,
    "rate": lambda r: decode_rate(r, 500, 10**9),
    "latest": decode_latest,
    "latest_due": decode_latest_due,
}

MALFORMED: list[tuple[str, object]] = [
    ("latest", [1, 9, 1]),  # taken: the evicted id's place is missing
    ("latest", [0, 10]),  # parked: likewise
    ("latest", [4, 7, None, None, []]),  # superseded by a number, not a task id
    ("latest", [6, 0, None, None, []]),
    ("latest", [0, 10, None, None, [b"odd"]]),
    ("latest", [0, 10, None, None]),
    ("latest_due", [1, b"m"]),
    ("latest_due", [2]),
    ("latest_due", [0]),
    ("acquire", []),
    ("acquire", None),
    ("acquire", 1),
    ("acquire", [1]),  # a token of nil: the table stops there
    ("acquire", [1, 7]),
    ("acquire", [0]),
    ("acquire", [9, 0]),
    ("acquire", [True, 7, 1]),
    ("acquire", [b"x", 1]),
    ("acquire", [1, b"7.5", 1]),
    ("park", [2]),
    ("park", [2, 0, 0]),
    ("release", [0]),
    ("release", -4),
    ("release", b""),
    ("release", None),
    ("renew", [1]),
    ("renew", [1, 2]),
    ("renew", 1),
    ("renew_one", []),
    ("fence", 2),
    ("fence", [1]),
    ("handoff", []),
    ("handoff", [0, b"m"]),
    ("handoff", [1, b"m", b"id", 1]),
    ("handoff", [0, 5, b"id", 1]),
    ("handoff", [0, b"m", None, 1]),
    ("handoff", [0, b"m", b"id", None]),
    ("handoff", [0, b"m", b"id", 1, 1]),
    ("handoff", [-7]),
    ("handoff", [-2, b"m", b"id", 1]),
    ("sweep", [1]),
    ("sweep", [1, b"m", b"id"]),
    ("sweep", [2]),
    ("sweep", [0, b"m"]),
    ("sweep", [1, None, b"id", b"t"]),
    ("rate", [1, 0]),
    ("rate", [1, 0, 1700, 0]),
    ("rate", [2, 0, 1700]),
    ("rate", [1, -1, 1700]),
    ("rate", [1, 0, 0]),
    ("rate", [1, 501, 1700]),  # admitted further away than the call allowed
    ("rate", [0, 500, 1700]),  # refused although within the wait allowed
    ("rate", [0, 10**9 + 1, 1700]),  # further than any schedule reaches
    ("rate", [True, 0, 1700]),
]


@pytest.mark.parametrize(("script", "reply"), MALFORMED)
def test_malformed_replies_are_a_clear_error(script: str, reply: object) -> None:
    with pytest.raises(MalformedReplyError, match="malformed") as caught:
        DECODERS[script](reply)
    assert isinstance(caught.value, RedisLockError) and isinstance(caught.value, ValueError)


_atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.binary(max_size=30),
    st.text(max_size=30),
    st.sampled_from([b"1", b"0", b"-1", b"2", "3", b"12s40", b"\xff", "\U0001f600"]),
)
_replies = st.recursive(_atoms, lambda inner: st.lists(inner, max_size=6), max_leaves=12)


@given(st.sampled_from(sorted(DECODERS)), _replies)
def test_any_reply_decodes_or_raises_only_the_documented_error(script: str, reply: Any) -> None:
    with contextlib.suppress(MalformedReplyError):  # anything else fails the test
        DECODERS[script](reply)


@given(_replies, st.integers(min_value=0, max_value=4))
def test_renew_outcomes_never_raise(reply: Any, count: int) -> None:
    outcomes = renew_outcomes(reply, count)
    assert len(outcomes) == count
    assert all(isinstance(o, (int, Exception)) for o in outcomes)
