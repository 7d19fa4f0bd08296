"""The I/O-free rules: validation, key layout, owners, replies, deadlines (no Redis needed)."""

from __future__ import annotations

import math
import random
import threading

import pytest
from redis.crc import key_slot

from celery_redislock import LockConfigurationError, LockKeys
from celery_redislock._core import (
    AcquireReply,
    backoff,
    decode_acquire,
    drift_ms,
    lease_ms,
    name_from_lock_key,
    optional_seconds,
    thread_owner,
    validate_owner,
    validate_prefix,
    validity_deadline,
    wait_bound,
)


@pytest.mark.parametrize("value", [0, -1, 0.0004, math.nan, math.inf, None, True, "30", [1]])
def test_lease_must_be_at_least_one_millisecond(value: object) -> None:
    with pytest.raises(LockConfigurationError, match="ttl") as info:
        lease_ms(value, "ttl")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("seconds", "millis"), [(30, 30000), (0.001, 1), (1.5, 1500), (0.0015, 2)])
def test_lease_converts_seconds_to_milliseconds(seconds: float, millis: int) -> None:
    assert lease_ms(seconds, "ttl") == millis


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, "1", False])
def test_timeout_rejects_what_is_not_a_duration(value: object) -> None:
    with pytest.raises(LockConfigurationError, match="timeout"):
        optional_seconds(value, "timeout")


def test_timeout_allows_none_and_zero() -> None:
    assert optional_seconds(None, "timeout") is None
    assert optional_seconds(0, "timeout") == 0.0


@pytest.mark.parametrize("owner", ["", 5, b"x", "__fence__", "__grant__", "__chain__", "__limit__"])
def test_owner_must_be_a_nonempty_str_and_not_the_token_field(owner: object) -> None:
    with pytest.raises(LockConfigurationError, match="owner"):
        validate_owner(owner)


@pytest.mark.parametrize("prefix", ["a{", "}b", 3])
def test_prefix_cannot_move_the_hash_tag(prefix: object) -> None:
    with pytest.raises(LockConfigurationError, match="prefix"):
        validate_prefix(prefix)


@pytest.mark.parametrize(
    "name", ["account:7", b"\x00\xffbin", "}", "{", "a}b{c", "%7D", "ünïcode", "x" * 500]
)
def test_all_keys_of_a_lock_share_one_cluster_slot(name: str | bytes) -> None:
    keys = LockKeys.for_name(name)
    assert key_slot(keys.lock) == key_slot(keys.fence) == key_slot(keys.channel)
    encoded = name.encode() if isinstance(name, str) else name
    assert name_from_lock_key(keys.lock) == encoded


def test_distinct_names_never_share_keys() -> None:
    names = ["}", "%7D", "%257D", "{", "%7B", "a", "a}", "a%7D"]
    locks = {LockKeys.for_name(n).lock for n in names}
    assert len(locks) == len(names)


@pytest.mark.parametrize("name", ["", b"", 7, None])
def test_name_must_be_nonempty_str_or_bytes(name: object) -> None:
    with pytest.raises(LockConfigurationError, match="name"):
        LockKeys.for_name(name)  # type: ignore[arg-type]


def test_key_layout_uses_prefix_and_hash_tag() -> None:
    keys = LockKeys.for_name("user:1", prefix="app:")
    assert keys.lock == b"app:{user:1}"
    assert keys.fence == b"app:{user:1}:fence"
    assert keys.channel == b"app:{user:1}:released"


def test_each_thread_is_its_own_owner_and_keeps_it() -> None:
    seen: list[str] = []
    first = thread_owner()
    assert thread_owner() == first
    threads = [threading.Thread(target=lambda: seen.append(thread_owner())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen) | {first}) == 9
    process_part = first.split(":")[0]
    assert len(process_part) == 32 and int(process_part, 16) >= 0  # 128 random bits


def test_reply_decoding() -> None:
    assert decode_acquire([1, 7, 2]) == AcquireReply(True, token=7, hold_count=2)
    assert decode_acquire([0, 1234]) == AcquireReply(False, pttl=1234)


def test_validity_deadline_subtracts_drift() -> None:
    assert drift_ms(1000) == pytest.approx(12.0)
    assert validity_deadline(100.0, 1000) == pytest.approx(100.988)


def test_wait_is_bounded_by_the_holders_lease_and_the_callers_timeout() -> None:
    assert wait_bound(500, None) == pytest.approx(0.501)
    assert wait_bound(500, 0.1) == pytest.approx(0.1)
    assert wait_bound(-2, 3.0) == 0.0
    assert wait_bound(-1, None) > 0
    assert wait_bound(500, -1.0) == 0.0


def test_backoff_stays_within_its_bounds() -> None:
    rng = random.Random(1)
    for attempt in range(40):
        delay = backoff(attempt, base=0.02, cap=0.5, rng=rng)
        assert 0.01 <= delay <= 0.5


def test_errors_survive_pickling_and_rebuilding_from_their_message() -> None:
    import pickle

    from celery_redislock import LockContendedError, LockLostError

    lost = LockLostError("gone", name="job", owner="o", reason="stolen")
    again = pickle.loads(pickle.dumps(lost))
    assert (type(again), again.args, again.name, again.owner, again.reason) == (
        LockLostError,
        ("gone",),
        "job",
        "o",
        "stolen",
    )
    assert str(LockContendedError("held")) == "held"  # a backend rebuilds it from the message


def test_server_clock_us_reads_a_time_reply() -> None:
    """A ``TIME`` reply (seconds, microseconds; bytes or ints as the client decodes them)
    in whole microseconds: the one reading of the server's clock outside the scripts."""
    from celery_redislock._core import server_clock_us

    assert server_clock_us((b"1700000000", b"000123")) == 1_700_000_000_000_123
    assert server_clock_us([1_700_000_000, 999_999]) == 1_700_000_000_999_999
    assert server_clock_us((1_700_000_000, 999_999)) // 1000 == 1_700_000_000_999
