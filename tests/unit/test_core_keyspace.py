"""celery_redislock._keyspace: every Redis name, pinned byte for byte.

A running deployment's keys must never change: each name below is the literal the
package spelled where it was used before the keyspace module existed.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_redislock import _keyspace as ks
from celery_redislock._core import DEFAULT_PREFIX
from celery_redislock._core import LockKeys as CoreLockKeys
from celery_redislock._errors import LockConfigurationError

PREFIX = "redislock:"
NAME = "account:7"
OWNER = "t1"
L = b"redislock:{account:7}"


def test_the_default_prefix_is_unchanged() -> None:
    assert DEFAULT_PREFIX == ks.DEFAULT_PREFIX == "redislock:"
    assert CoreLockKeys is ks.LockKeys  # the old home re-exports it


def test_every_name_of_one_lock_is_pinned() -> None:
    keys = ks.LockKeys.for_name(NAME, PREFIX)
    assert keys == ks.LockKeys.for_name(NAME)  # the default prefix
    assert keys == ks.LockKeys.for_lock(L)
    assert ks.lock_key(NAME, PREFIX) == L
    assert keys.lock == b"redislock:{account:7}"
    assert keys.fence == b"redislock:{account:7}:fence"
    assert keys.channel == b"redislock:{account:7}:released"
    assert keys.waiters == b"redislock:{account:7}:waiters"
    assert keys.claims == b"redislock:{account:7}:claims"
    assert keys.wake == b"redislock:{account:7}:waiters:wake"
    assert keys.done(OWNER) == keys.done(b"t1") == b"redislock:{account:7}:done:t1"
    assert keys.kept(OWNER) == b"redislock:{account:7}:kept:t1"
    assert keys.void("ab12", OWNER) == b"redislock:{account:7}:void:ab12:t1"
    assert keys.parked == b"redislock:{account:7}:parked"
    assert keys.parked_messages == b"redislock:{account:7}:parked:messages"
    assert keys.parked_dispatched == b"redislock:{account:7}:parked:dispatched"
    assert keys.parked_unused == b"redislock:{account:7}:parked:unused"
    assert keys.grant_channel(b"g0f") == b"redislock:{account:7}:released:g0f"
    assert ks.grant_channel_tail(b"g0f") == b":g0f"


def test_every_name_of_one_semaphore_is_pinned() -> None:
    """A semaphore's names sit beside the lock's (``:sem``), never on them: a lock and a
    semaphore of one name share nothing, and every name keeps the ``{name}`` hash tag."""
    keys = ks.SemaphoreKeys.for_name(NAME, PREFIX)
    assert keys.line.lock == b"redislock:{account:7}:sem"
    assert keys.line.fence == b"redislock:{account:7}:sem:fence"
    assert keys.line.channel == b"redislock:{account:7}:sem:released"
    assert keys.line.waiters == b"redislock:{account:7}:sem:waiters"
    assert keys.line.claims == b"redislock:{account:7}:sem:claims"
    assert keys.line.wake == b"redislock:{account:7}:sem:waiters:wake"
    assert keys.permits == b"redislock:{account:7}:sem:permit:"
    assert keys.permit(OWNER) == b"redislock:{account:7}:sem:permit:t1"
    lock = ks.LockKeys.for_name(NAME, PREFIX)
    assert not {keys.line.lock, keys.line.fence, keys.line.channel} & {
        lock.lock,
        lock.fence,
        lock.channel,
    }


def test_every_name_of_one_rate_limiter_is_pinned() -> None:
    """A rate limiter's schedules sit beside the lock's (``:rate:<period in us>``), in the
    same hash tag, never on a lock's or a semaphore's names."""
    keys = ks.RateKeys.for_name(NAME, PREFIX)
    assert keys == ks.RateKeys.for_name(NAME)
    assert keys.schedules == b"redislock:{account:7}:rate:"
    assert keys.schedule(1_000_000) == b"redislock:{account:7}:rate:1000000"
    assert keys.schedule(3_600_000_000) == b"redislock:{account:7}:rate:3600000000"
    lock = ks.LockKeys.for_name(NAME, PREFIX)
    semaphore = ks.SemaphoreKeys.for_name(NAME, PREFIX)
    others = {*lock.release_keys(), *semaphore.line.release_keys(), semaphore.permits}
    assert not any(other.startswith(keys.schedules) for other in others)


def test_the_scripts_key_lists_are_pinned() -> None:
    keys = ks.LockKeys.for_name(NAME, PREFIX)
    assert keys.acquire_keys() == [
        L,
        L + b":fence",
        L + b":waiters",
        L + b":claims",
        L + b":waiters:wake",
    ]
    assert keys.release_keys() == [
        L,
        L + b":released",
        L + b":fence",
        L + b":waiters",
        L + b":claims",
        L + b":waiters:wake",
    ]
    assert keys.handoff_keys("t1") == [
        L,
        L + b":released",
        L + b":fence",
        L + b":parked",
        L + b":parked:messages",
        L + b":done:t1",
        L + b":parked:dispatched",
        L + b":waiters",
        L + b":claims",
        L + b":waiters:wake",
    ]
    assert keys.sweep_keys("redislock:parked") == [
        L,
        L + b":released",
        L + b":fence",
        L + b":parked",
        L + b":parked:messages",
        L + b":parked:unused",
        L + b":parked:dispatched",
        "redislock:parked",
    ]


def test_every_name_of_a_prefix_is_pinned() -> None:
    assert ks.parked_registry(PREFIX) == "redislock:parked"
    assert ks.lookahead_chain(PREFIX, "celery") == "redislock:lookahead:celery"
    assert ks.stats_key(PREFIX) == "redislock:stats"
    assert ks.probe_key(PREFIX, "abc") == "redislock:probe:abc"
    assert ks.resource_fence_key(PREFIX, "ledger") == "redislock:fence:ledger"
    assert ks.handoff_queue("celery") == "celery.redislock"
    assert ks.handoff_queue("celery.redislock") == "celery.redislock"
    assert ks.lock_key_pattern("a*b:", b"acc{1}%*") == rb"a\*b:{acc%7B1%7D%25*}"
    assert ks.semaphore_key_pattern("a*b:", b"acc{1}%*") == rb"a\*b:{acc%7B1%7D%25*}:sem"


def test_a_semaphore_is_found_by_its_holders_set_and_by_nothing_else() -> None:
    """The CLI finds limited keys by SCAN: only a key that round-trips names one."""
    keys = ks.SemaphoreKeys.for_name("a{b}%c", "p:")
    assert ks.semaphore_name(keys.line.lock, "p:") == b"a{b}%c"
    assert ks.SemaphoreKeys.for_key(keys.line.lock, "p:") == keys
    for other in (
        keys.permit("x"),  # a permit
        keys.line.fence,
        ks.lock_key("a", "p:"),  # a lock
        b"p:{a}:kept:x}:sem",  # a kept marker whose owner ends like a holders set
        b"p:{a{b}:sem",  # not escaped: written by no one here
        b"p:{}:sem",  # no name
        b"q:{a}:sem",  # another prefix
    ):
        assert ks.semaphore_name(other, "p:") is None, other
        assert ks.SemaphoreKeys.for_key(other, "p:") is None, other


def test_names_are_escaped_inside_the_hash_tag() -> None:
    keys = ks.LockKeys.for_name("a{b}%c", "p:")
    assert keys.lock == b"p:{a%7Bb%7D%25c}"
    assert ks.name_from_lock_key(keys.lock, "p:") == b"a{b}%c"
    assert ks.name_from_lock_key(b"other", "p:") is None


@pytest.mark.parametrize("bad", ["", b"", 7, None, "\udc80"])
def test_bad_names_are_refused(bad: object) -> None:
    with pytest.raises(LockConfigurationError):
        ks.LockKeys.for_name(bad)  # type: ignore[arg-type]


@given(st.binary(min_size=1), st.text(alphabet="abc:-_"))
def test_every_name_shares_the_lock_hash_tag(name: bytes, prefix: str) -> None:
    keys = ks.LockKeys.for_name(name, prefix)
    tag = keys.lock[len(prefix.encode()) :]
    schedule = ks.RateKeys.for_name(name, prefix).schedule(60_000_000)
    for other in [
        *keys.release_keys(),
        keys.done("x"),
        keys.void("n", "x"),
        keys.parked,
        schedule,
    ]:
        assert other.startswith(keys.lock)
        assert other[len(prefix.encode()) :].startswith(tag)
    assert ks.name_from_lock_key(keys.lock, prefix) == name
