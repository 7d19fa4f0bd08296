"""RedisRateLimiter / AsyncRedisRateLimiter on a real redis-server (issue 18, the
primitive): at most ``burst + rate * T`` units in any window of length T, for every limit
of a name at once, decided by one script on the server's clock; blocked callers sleep to
their slot; nothing is written for a bad argument; junk in a schedule never lets more in.

The oracle of every bound test is ``tests/_gcra.excess``: it looks at every window whose
ends are admissions (the fullest windows there are) and counts every admission it was
given. Whatever the timing, the script must answer as ``tests/_gcra.ScheduleModel`` does
(whose arithmetic the unit tests hold to the bound at adversarial moments).
"""

from __future__ import annotations

import asyncio
import itertools
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.cluster import RedisCluster

from celery_redislock import (
    AsyncRedisRateLimiter,
    LockConfigurationError,
    RedisRateLimiter,
    ratelimit,
)
from celery_redislock._keyspace import RateKeys
from celery_redislock._rates import MAX_US, RATE_FORMS
from celery_redislock._scripts import scripts_for
from celery_redislock.aio import aclose_background
from celery_redislock.testing import RedisClusterServers, RedisServer

from .. import _procs
from .._gcra import ScheduleModel, excess
from .._support import wait_until

CLASSES = [RedisRateLimiter, AsyncRedisRateLimiter]
_names = itertools.count()


def fresh(stem: str = "r") -> str:
    """A name no earlier example used (Hypothesis runs many in one test)."""
    return f"{stem}:{next(_names)}"


@pytest.fixture(scope="module")
def own_server() -> Iterator[RedisServer]:
    """A server of this module's own: no other test's background threads (watchdogs,
    retried releases) send it anything, so the command counts these tests assert on
    are theirs alone."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def client(own_server: RedisServer) -> Iterator[redis.Redis]:
    c = own_server.client()
    c.flushall()
    yield c
    c.close()


@pytest_asyncio.fixture
async def aclient(own_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis(port=own_server.port)
    await c.flushall()
    yield c
    await aclose_background(c)
    await c.aclose()


def evalsha_calls(client: Any) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0))


def server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def schedule(client: redis.Redis, name: str, limit: str = "1/s") -> bytes:
    """The key of ``name``'s limit over the period of ``limit`` (the keyspace's name)."""
    from celery_redislock._rates import parse_rates

    (parsed,) = parse_rates(limit)
    return RateKeys.for_name(name).schedule(parsed.period_us)


# -- configuration -----------------------------------------------------------------

BAD_RATES: list[object] = [
    "",
    "100",
    "100/x",
    "100/S",
    "100 / m",
    "1.5/s",
    "-1/s",
    "0/s",
    f"{2**31}/s",
    "9" * 5000 + "/s",
    "\uff11/s",  # a full-width digit one: not ASCII
    100,
    1.5,
    None,
    True,
    b"10/s",
    (0, 1),
    (1, 0),
    (1, 0.0005),
    (1, -1),
    (1, 365 * 24 * 3600 + 1),
    (1, float("inf")),
    (1, float("nan")),
    (True, 1),
    (1, True),
    (1.5, 1),
    (1, "1"),
    (1, 2, 3),
    [],
    ["5/s", "10/s"],  # two limits over one period
    ["1/s", (3, 1)],
    ["5/s"] * 9,
    [["5/s"]],
    {"5/s"},
]


@pytest.mark.parametrize("rate", BAD_RATES, ids=repr)
@pytest.mark.parametrize("cls", CLASSES)
def test_a_bad_rate_is_refused_naming_it_and_the_forms_writing_nothing(
    client: redis.Redis, cls: type, rate: object
) -> None:
    with pytest.raises(LockConfigurationError) as caught:
        cls(client, "r", rate)
    message = str(caught.value)
    assert message.startswith("rate ") and RATE_FORMS in message
    assert isinstance(caught.value, ValueError)
    assert client.dbsize() == 0


@pytest.mark.parametrize(
    ("rate", "burst"),
    [
        ("5/s", 0),
        ("5/s", -1),
        ("5/s", True),
        ("5/s", 1.0),
        ("5/s", "2"),
        ("5/s", None),
        ("5/s", 2**31),
        ("1/d", 366),  # a burst spanning more than 365 days of the rate
        (["100/s", "1/d"], 366),
    ],
)
@pytest.mark.parametrize("cls", CLASSES)
def test_a_bad_burst_is_refused_with_its_range(
    client: redis.Redis, cls: type, rate: object, burst: object
) -> None:
    with pytest.raises(LockConfigurationError, match=r"^burst must be an int from 1 to \d+"):
        cls(client, "r", rate, burst=burst)
    assert client.dbsize() == 0


def test_the_largest_values_are_accepted_and_work(client: redis.Redis) -> None:
    most = 2**31 - 1
    fastest = RedisRateLimiter(client, "fast", f"{most}/m", burst=most)
    assert fastest.acquire(blocking=False, cost=most)  # the whole burst at once
    assert fastest.acquire(blocking=False, cost=most) is False  # a minute of it later
    daily = RedisRateLimiter(client, "daily", "1/d", burst=365)
    assert daily.acquire(blocking=False, cost=365)
    slot = daily.reserve(max_wait=0)
    assert not slot.admitted and 86399 < slot.wait <= 86400
    slow = RedisRateLimiter(client, "slow", (1, 365 * 24 * 3600))
    assert slow.acquire(blocking=False) and not slow.acquire(blocking=False)


@pytest.mark.parametrize("cost", [0, -1, 6, True, 1.0, "1", None])
@pytest.mark.parametrize("cls", CLASSES)
async def test_a_bad_cost_is_refused_before_anything_is_sent(
    client: redis.Redis, cls: type, cost: object
) -> None:
    limiter = cls(client, "r", "5/s", burst=5)
    calls = evalsha_calls(client)
    for call in (lambda: limiter.acquire(cost=cost), lambda: limiter.reserve(cost)):
        with pytest.raises(LockConfigurationError, match=r"^cost must be an int from 1 to .*\(5\)"):
            await settle(call())
    assert evalsha_calls(client) == calls and client.dbsize() == 0


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"blocking": "no"}, "blocking"),
        ({"blocking": None}, "blocking"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": 365 * 24 * 3600 + 1}, "timeout"),
        ({"timeout": "1"}, "timeout"),
    ],
)
@pytest.mark.parametrize("cls", CLASSES)
async def test_bad_acquire_arguments_are_refused_before_anything_is_sent(
    client: redis.Redis, cls: type, arguments: dict[str, Any], named: str
) -> None:
    limiter = cls(client, "r", "5/s")
    with pytest.raises(LockConfigurationError, match=f"^{named} must be"):
        await settle(limiter.acquire(**arguments))
    with pytest.raises(LockConfigurationError, match=r"^max_wait must be"):
        await settle(limiter.reserve(max_wait=arguments.get("timeout", -1)))
    assert client.dbsize() == 0


@pytest.mark.parametrize("cls", CLASSES)
def test_a_quorum_or_no_client_is_refused(client: redis.Redis, cls: type) -> None:
    with pytest.raises(LockConfigurationError, match="quorum of masters is not offered"):
        cls([client, client, client], "r", "5/s")
    with pytest.raises(LockConfigurationError, match="client must be"):
        cls(None, "r", "5/s")
    with pytest.raises(LockConfigurationError, match="name"):
        cls(client, "", "5/s")
    with pytest.raises(LockConfigurationError, match="prefix"):
        cls(client, "r", "5/s", prefix="{x}")
    assert client.dbsize() == 0


def test_the_forms_of_a_rate(client: redis.Redis) -> None:
    def limits(rate: object) -> list[tuple[int, int]]:
        parsed = RedisRateLimiter(client, "r", rate).limits
        return [(limit.count, limit.period_us) for limit in parsed]

    assert limits("100/m") == [(100, 60_000_000)]
    assert limits("7/s") == limits((7, 1)) == limits([7, 1.0]) == [(7, 1_000_000)]
    assert limits("3/h") == [(3, 3_600_000_000)] and limits("2/d") == [(2, 86_400_000_000)]
    assert limits((3, 0.5)) == [(3, 500_000)]
    assert limits(["5/s", (1000, 3600)]) == [(5, 1_000_000), (1000, 3_600_000_000)]
    assert limits(("5/s", "1000/h")) == [(5, 1_000_000), (1000, 3_600_000_000)]
    limiter = RedisRateLimiter(client, "r", ["5/s", (3, 0.5)], burst=2)
    assert limiter.rate == ("5/s", "(3, 0.5)")
    assert repr(limiter) == "<RedisRateLimiter name='r' rate=['5/s', '(3, 0.5)'] burst=2>"
    assert RedisRateLimiter(client, "r", "5/s").burst == 1  # the default
    assert client.dbsize() == 0  # building a limiter writes nothing


_text_rates = st.one_of(
    st.text(max_size=12),
    st.builds(
        "{}/{}".format,
        st.integers(min_value=-3, max_value=2**34),
        st.sampled_from(["s", "m", "h", "d", "S", "x", ""]),
    ),
)
_numbers = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
_pairs = st.tuples(_numbers, _numbers)
_rates = st.one_of(
    _text_rates, _pairs, _numbers, st.lists(st.one_of(_text_rates, _pairs), max_size=10)
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rate=_rates, burst=_numbers, cost=_numbers, wait=_numbers)
def test_any_arguments_work_or_raise_only_a_configuration_error_writing_nothing(
    client: redis.Redis, rate: object, burst: object, cost: object, wait: object
) -> None:
    """Whatever the values: the limiter works, or a LockConfigurationError naming the
    argument is raised before anything is written. A reserve never sleeps, and acquire is
    not blocking here, so nothing waits."""
    name = fresh()
    before = set(client.keys("*"))
    calls = evalsha_calls(client)
    try:
        limiter = RedisRateLimiter(client, name, rate, burst=burst)  # type: ignore[arg-type]
        limiter.reserve(cost, max_wait=wait)  # type: ignore[arg-type]
        limiter.acquire(blocking=False, timeout=wait, cost=cost)  # type: ignore[arg-type]
    except LockConfigurationError as exc:
        assert str(exc).split()[0] in {"rate", "burst", "cost", "max_wait", "timeout"}
        # reserve() and acquire() check the same values alike: an error comes first.
        assert evalsha_calls(client) == calls
        # No key written; an earlier example's rate key may expire meanwhile, so only new
        # keys count.
        assert set(client.keys("*")) - before == set()


# -- the script checks its arguments before any write ------------------------------

BAD_SCRIPT_ARGS = [
    ([], "rate takes"),  # no max wait
    (["0", "1"], "rate takes"),  # a tolerance missing
    (["0", "1", "1", "1"], "rate takes"),  # one key, two limits
    (["-1", "1", "1"], "max wait"),
    (["x", "1", "1"], "max wait"),
    ([str(MAX_US + 1), "1", "1"], "max wait"),
    (["0", "0", "1"], "increment"),
    (["0", "1.5", "2"], "increment"),
    (["0", str(MAX_US + 1), str(MAX_US + 1)], "increment"),
    (["0", "5", "4"], "tolerance"),  # less than the increment
    (["0", "5", str(MAX_US + 1)], "tolerance"),
    (["0", "5", "1e6"], "tolerance"),
]


@pytest.mark.parametrize(("args", "complaint"), BAD_SCRIPT_ARGS)
def test_the_script_refuses_bad_arguments_before_any_write(
    client: redis.Redis, args: list[str], complaint: str
) -> None:
    key = schedule(client, "r")
    client.set(key, "junk")  # a junk schedule would be rewritten by a run that got that far
    with pytest.raises(redis.ResponseError, match=complaint) as caught:
        scripts_for(client).rate(keys=[key], args=args)
    assert "redislock:" in str(caught.value)
    assert client.get(key) == b"junk" and client.pttl(key) == -1
    with pytest.raises(redis.ResponseError, match="rate takes"):
        scripts_for(client).rate(keys=[], args=["0"])


# -- admission ---------------------------------------------------------------------


def test_a_burst_goes_at_once_then_calls_are_one_interval_apart(client: redis.Redis) -> None:
    # 5 a minute: 12 s apart, so that no pause of this machine between calls matters.
    limiter = RedisRateLimiter(client, "r", "5/m", burst=5)
    slots = [limiter.reserve(max_wait=0) for _ in range(5)]
    assert all(slot.admitted and slot.wait == 0.0 for slot in slots)
    refused = limiter.reserve(max_wait=0)
    assert not refused.admitted and 0 < refused.wait <= 12
    # The sixth is due one interval after the first, by the server's clock.
    assert refused.due_us == slots[0].due_us + 12_000_000
    booked = [limiter.reserve() for _ in range(3)]
    offsets = [slot.due_us - slots[0].due_us for slot in booked]
    assert offsets == [12_000_000, 24_000_000, 36_000_000]
    assert all(slot.admitted for slot in booked)
    assert not limiter.acquire(blocking=False)


def test_a_blocked_acquire_sleeps_to_its_slot_in_one_round_trip(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_time.sleep(seconds)

    real_time = ratelimit.time
    monkeypatch.setattr(ratelimit, "time", types.SimpleNamespace(sleep=sleep))
    limiter = RedisRateLimiter(client, "r", "4/s")
    assert limiter.acquire() and slept == []  # due at once: no sleep
    due = limiter.reserve(max_wait=0)
    assert not due.admitted
    calls = evalsha_calls(client)
    assert limiter.acquire()
    assert evalsha_calls(client) == calls + 1  # booked in one round trip, never polled
    assert len(slept) == 1 and 0 < slept[0] <= due.wait
    assert server_us(client) >= due.due_us  # returned no earlier than its slot


def test_a_timeout_shorter_than_the_wait_returns_false_at_once_taking_nothing(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(ratelimit, "time", types.SimpleNamespace(sleep=slept.append))
    limiter = RedisRateLimiter(client, "r", "1/m")
    assert limiter.acquire()
    key = schedule(client, "r", "1/m")
    before = client.get(key)
    calls = evalsha_calls(client)
    assert limiter.acquire(timeout=30) is False  # the slot is 60 s away
    assert limiter.acquire(blocking=False) is False
    assert limiter.acquire(blocking=False, timeout=100) is False  # not blocking: one try
    assert slept == [] and evalsha_calls(client) == calls + 3
    assert client.get(key) == before  # nothing booked
    assert limiter.acquire(timeout=61)  # within the timeout: booked, then slept to
    assert len(slept) == 1 and 59 < slept[0] <= 60


def test_cost_counts_for_as_many_units(client: redis.Redis) -> None:
    limiter = RedisRateLimiter(client, "r", "10/m", burst=4)  # 6 s apart
    first = limiter.reserve(cost=4, max_wait=0)  # the whole burst at once, on an idle limit
    assert first.admitted and first.wait == 0.0
    second = limiter.reserve(cost=3)
    assert second.admitted and second.due_us == first.due_us + 18_000_000
    third = limiter.reserve(cost=1)
    assert third.due_us == second.due_us + 6_000_000
    # A call of cost 4 that is not a whole number of intervals' burst still fits an idle
    # limit: (3 per second, burst 2: 666,666.67 us, and an increment of 666,667 us).
    odd = RedisRateLimiter(client, "odd", "3/s", burst=2)
    assert odd.reserve(cost=2, max_wait=0).admitted


def test_a_booked_slot_is_never_early_by_a_fraction_of_a_microsecond(
    client: redis.Redis,
) -> None:
    """3 per 10 s, burst 4, calls of cost 3: the second is due 6,666,666.67 us after the
    first; it is booked at 6,666,667 (a tolerance rounded up would have let it in at
    6,666,666: 6 units in a window that allows 5.9999998)."""
    limiter = RedisRateLimiter(client, "r", (3, 10), burst=4)
    first, second = limiter.reserve(3), limiter.reserve(3)
    assert first.admitted and second.admitted
    assert second.due_us - first.due_us == 6_666_667


def test_several_limits_admit_only_when_all_do_and_atomically(client: redis.Redis) -> None:
    limiter = RedisRateLimiter(client, "r", ["10/m", (1, 30)], burst=2)
    fast, slow = schedule(client, "r", "10/m"), RateKeys.for_name("r").schedule(30_000_000)
    first = limiter.reserve(max_wait=0)
    assert first.admitted and limiter.reserve(max_wait=0).admitted
    before = (client.get(fast), client.get(slow))
    refused = limiter.reserve(max_wait=0)
    # Over 10 a minute with burst 2 the third is due 6 s after the first, over one per 30 s
    # 30 s after: refused by the slower limit; the faster one lost nothing.
    assert not refused.admitted and refused.due_us == first.due_us + 30_000_000
    assert (client.get(fast), client.get(slow)) == before
    booked = limiter.reserve()
    assert booked.admitted and booked.due_us == refused.due_us
    # Every limit moved past the slot: the faster from the slot, the slower from its TAT.
    assert int(client.get(fast) or 0) == booked.due_us + 6_000_000
    assert int(client.get(slow) or 0) == first.due_us + 90_000_000


def test_limiters_of_one_name_share_a_period_and_other_names_are_apart(
    client: redis.Redis,
) -> None:
    a = RedisRateLimiter(client, "shared", "1/m")
    b = RedisRateLimiter(client, "shared", "2/m")  # the same period: one schedule
    other = RedisRateLimiter(client, "other", "1/m")
    prefixed = RedisRateLimiter(client, "shared", "1/m", prefix="elsewhere:")
    assert a.acquire(blocking=False)
    assert not b.acquire(blocking=False)
    assert other.acquire(blocking=False) and prefixed.acquire(blocking=False)
    assert sorted(client.keys("*")) == sorted(
        [
            RateKeys.for_name("shared").schedule(60_000_000),
            RateKeys.for_name("other").schedule(60_000_000),
            RateKeys.for_name("shared", "elsewhere:").schedule(60_000_000),
        ]
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    limits=st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=40),
            st.sampled_from([0.003, 0.05, 0.1, 0.3, 1, 7, 3600]),
        ),
        min_size=1,
        max_size=3,
        unique_by=lambda pair: pair[1],
    ),
    burst=st.integers(min_value=1, max_value=6),
    calls=st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=6),
            st.sampled_from([0, 0.000001, 0.002, 0.05, 1.0, None]),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_any_calls_keep_every_limit_within_its_bound(
    client: redis.Redis,
    limits: list[tuple[int, float]],
    burst: int,
    calls: list[tuple[int, float | None]],
) -> None:
    """Odd intervals (3 per 0.1 s: 33,333.3 us), costs, and slots booked ahead or refused:
    in every window, per limit, at most burst + rate * T units; a refusal's wait is more
    than the call allowed, an admission's no more; and every answer is the model's, at
    the server time the script read."""
    limiter = RedisRateLimiter(client, fresh(), limits, burst=burst)
    model = ScheduleModel(limiter.limits, burst)
    admitted: list[tuple[int, int]] = []
    for cost, max_wait in calls:
        cost = min(cost, burst)
        slot = limiter.reserve(cost, max_wait=max_wait)
        wait_us = round(slot.wait * 1_000_000)
        allowed = MAX_US if max_wait is None else round(max_wait * 1_000_000)
        assert slot.admitted == (wait_us <= allowed)
        assert model.call(slot.due_us - wait_us, cost, allowed) == (slot.admitted, wait_us)
        if slot.admitted:
            admitted.append((slot.due_us, cost))
    assert admitted  # the first call of an idle limiter is always admitted
    for limit in limiter.limits:
        assert excess(admitted, burst, limit) == []


# -- keys expire once idle ---------------------------------------------------------


def test_a_schedule_expires_once_its_time_has_passed(client: redis.Redis) -> None:
    limiter = RedisRateLimiter(client, "r", ["10/s", (1, 0.3)], burst=2)
    assert limiter.acquire(blocking=False)
    fast, slow = schedule(client, "r", "10/s"), RateKeys.for_name("r").schedule(300_000)
    now = server_us(client)
    for key in (fast, slow):
        due = int(client.get(key) or 0)
        assert 0 < client.pttl(key) <= (due - now) // 1000 + 3  # its TAT, and a ms more
    wait_until(lambda: client.dbsize() == 0, timeout=10, what="the idle schedules to expire")
    # Gone means idle: the whole burst again.
    assert limiter.reserve(max_wait=0).admitted


def test_a_slot_booked_far_ahead_keeps_its_schedule_until_then(client: redis.Redis) -> None:
    limiter = RedisRateLimiter(client, "r", "1/h")
    assert limiter.reserve().wait == 0.0
    ahead = limiter.reserve()
    assert ahead.admitted and ahead.wait > 3599
    assert client.pttl(schedule(client, "r", "1/h")) > 2 * 3599 * 1000


# -- hostile data ------------------------------------------------------------------

JUNK: list[Any] = [
    b"junk",
    b"",
    b"-5",
    b"1.5",
    b"1e20",
    b"99999999999999999999",
    b" 5",
    b"0x10",
    "far",  # a TAT far beyond any a call can book (100 years from now)
    "hash",
    "list",
]


def plant(client: redis.Redis, key: bytes, junk: Any) -> None:
    client.delete(key)
    if junk == "far":
        client.set(key, server_us(client) + 100 * 365 * 86400 * 1_000_000)
    elif junk == "hash":
        client.hset(key, "tat", "1")
    elif junk == "list":
        client.rpush(key, "1")
    else:
        client.set(key, junk)


@pytest.mark.parametrize("junk", JUNK, ids=repr)
def test_a_junk_schedule_reads_as_a_spent_burst_never_as_room(
    client: redis.Redis, junk: Any
) -> None:
    """A schedule holding anything but a TAT within reach is read as full (the burst just
    spent), rewritten, and the limiter goes on: the next call is due one interval later.
    Never an error, never a fresh burst, never a wait for ever."""
    limiter = RedisRateLimiter(client, "r", "50/s", burst=5)
    key = schedule(client, "r", "50/s")
    admitted = [(limiter.reserve(max_wait=0).due_us, 1) for _ in range(3)]
    plant(client, key, junk)
    refused = limiter.reserve(max_wait=0)
    assert not refused.admitted and refused.wait == 0.02  # one interval: no room at all
    repaired = int(client.get(key) or 0)
    assert repaired == refused.due_us - 20_000 + 100_000  # now + tolerance
    assert 0 < client.pttl(key) <= 102
    for _ in range(20):
        slot = limiter.reserve()
        assert slot.admitted
        admitted.append((slot.due_us, 1))
    assert admitted[3][0] == refused.due_us
    assert excess(admitted, 5, limiter.limits[0]) == []


def test_a_schedule_far_ahead_but_within_reach_is_honoured(client: redis.Redis) -> None:
    limiter = RedisRateLimiter(client, "r", "1/s")
    key = schedule(client, "r", "1/s")
    tat = server_us(client) + 86400 * 1_000_000
    client.set(key, tat)  # as if a day of slots had been booked
    refused = limiter.reserve(max_wait=0)
    assert not refused.admitted and refused.due_us == tat  # TAT + 1 s - 1 s
    assert client.get(key) == str(tat).encode()
    assert not limiter.acquire(timeout=5)


def test_a_schedule_without_expiry_gets_one(client: redis.Redis) -> None:
    limiter = RedisRateLimiter(client, "r", "10/s")
    key = schedule(client, "r", "10/s")
    client.set(key, "5")  # long past: idle
    assert limiter.reserve(max_wait=0).admitted
    assert 0 < client.pttl(key) <= 101


# -- asyncio -----------------------------------------------------------------------


async def settle(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


async def story(limiter: Any) -> list[Any]:
    """One story, told to either twin: what each step showed (times relative to the first
    admission, on the server's clock; 1 a minute, so no step can drift into another slot)."""
    seen: list[Any] = []
    first = await settle(limiter.reserve(max_wait=0))
    seen.append(("first", first.admitted, first.wait))
    more = [await settle(limiter.reserve(max_wait=0)) for _ in range(3)]
    seen.append(
        ("burst", [(s.admitted, s.wait if s.admitted else s.due_us - first.due_us) for s in more])
    )
    seen.append(("no block", await settle(limiter.acquire(blocking=False))))
    seen.append(("timeout", await settle(limiter.acquire(timeout=1))))
    booked = await settle(limiter.reserve())
    seen.append(("booked", booked.admitted, booked.due_us - first.due_us))
    heavy = await settle(limiter.reserve(2, max_wait=0))
    seen.append(("heavy", heavy.admitted, heavy.due_us - first.due_us))
    return seen


async def test_the_twins_tell_the_same_story(client: redis.Redis, aclient: aioredis.Redis) -> None:
    sync = await story(RedisRateLimiter(client, "sync", "1/m", burst=3))
    aio = await story(AsyncRedisRateLimiter(aclient, "aio", "1/m", burst=3))
    assert sync == aio
    assert sync == [
        ("first", True, 0.0),
        ("burst", [(True, 0.0), (True, 0.0), (False, 60_000_000)]),
        ("no block", False),
        ("timeout", False),
        ("booked", True, 60_000_000),
        ("heavy", False, 180_000_000),  # a minute per unit after the booked one
    ]


async def test_async_acquire_sleeps_to_its_slot(
    client: redis.Redis, aclient: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(seconds)

    monkeypatch.setattr(ratelimit, "asyncio", types.SimpleNamespace(sleep=sleep))
    limiter = AsyncRedisRateLimiter(aclient, "r", "4/s")
    assert await limiter.acquire() and slept == []
    due = await limiter.reserve(max_wait=0)
    calls = evalsha_calls(client)
    assert await limiter.acquire()
    assert evalsha_calls(client) == calls + 1
    assert len(slept) == 1 and 0 < slept[0] <= due.wait
    assert server_us(client) >= due.due_us
    assert await limiter.acquire(timeout=0.01) is False and len(slept) == 1


async def test_a_cancelled_async_acquire_leaves_its_slot_unused(
    aclient: aioredis.Redis,
) -> None:
    limiter = AsyncRedisRateLimiter(aclient, "r", "1/m")
    assert await limiter.acquire()
    waiting = asyncio.ensure_future(limiter.acquire())
    booked = await aclient.get(RateKeys.for_name("r").schedule(60_000_000))
    while await aclient.get(RateKeys.for_name("r").schedule(60_000_000)) == booked:
        await asyncio.sleep(0.01)  # until its slot is booked (a minute ahead)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    after = await limiter.reserve(max_wait=0)
    assert not after.admitted and after.wait > 60  # the cancelled slot stays spent


# -- Redis Cluster -----------------------------------------------------------------


@pytest.fixture
def cluster(redis_cluster: RedisClusterServers) -> Iterator[RedisCluster]:
    redis_cluster.flushall()  # only the servers this module started
    c = redis_cluster.client()
    yield c
    c.close()


def names_on_every_node(client: RedisCluster) -> list[str]:
    found: dict[str, str] = {}
    for i in itertools.count():
        name = f"merchant:{i}"
        node = client.get_node_from_key(RateKeys.for_name(name).schedule(1)).name
        found.setdefault(node, name)
        if len(found) == 3:
            return list(found.values())
    raise AssertionError("unreachable")


def test_several_limits_on_every_node_of_a_cluster(cluster: RedisCluster) -> None:
    for name in names_on_every_node(cluster):
        limiter = RedisRateLimiter(cluster, name, ["20/s", (3, 0.5)], burst=2)
        admitted = []
        for _ in range(8):
            slot = limiter.reserve()
            assert slot.admitted
            admitted.append((slot.due_us, 1))
        for limit in limiter.limits:
            assert excess(admitted, 2, limit) == []
        assert not limiter.acquire(blocking=False)
        keys = [RateKeys.for_name(name).schedule(p) for p in (1_000_000, 500_000)]
        assert len({cluster.keyslot(key) for key in keys}) == 1  # one slot: one script
        assert all(cluster.exists(key) for key in keys)


def test_async_limiter_on_a_cluster(redis_cluster: RedisClusterServers) -> None:
    async def main() -> None:
        client = redis_cluster.async_client()
        try:
            limiter = AsyncRedisRateLimiter(client, "merchant:a", ["1/m", "10/h"], burst=2)
            assert await limiter.acquire(blocking=False)
            assert await limiter.acquire(blocking=False)
            assert not await limiter.acquire(blocking=False)
            refused = await limiter.reserve(max_wait=0)
            assert not refused.admitted and 359 < refused.wait <= 360  # 10/h: 6 min apart
        finally:
            await client.aclose()

    redis_cluster.flushall()
    asyncio.run(main())


# -- real processes ----------------------------------------------------------------


def run_processes(server: RedisServer, seconds: float, processes: int = 8) -> None:
    """``processes`` processes admitted by one limiter ("50/s", burst 5) as fast as it
    allows for ``seconds``: every window within the bound, and no fewer than 98 % of the
    bound over the whole run (the limiter does not under-admit either)."""
    client = server.client()
    client.flushall()
    rate, burst = "50/s", 5
    procs = [
        _procs.run(_procs.rate_hammer, server.port, "merchant", rate, burst, "go", "log")
        for _ in range(processes)
    ]
    try:
        for _ in procs:
            assert client.blpop(["log:ready"], 120) is not None
        end_us = server_us(client) + int(seconds * 1_000_000)
        client.rpush("go", *[end_us] * processes)
        counts = [client.blpop(["log:done"], seconds + 60) for _ in procs]
        for process in procs:
            process.join(30)
            assert process.exitcode == 0
    finally:
        for process in procs:
            if process.is_alive():
                _procs.sigkill(process)
    reported = sum(int(entry[1]) for entry in counts if entry is not None)
    dues = [int(due) for due in client.lrange("log", 0, -1)]
    assert len(dues) == reported  # every admission counted
    (limit,) = RedisRateLimiter(client, "merchant", rate, burst=burst).limits
    assert excess([(due, 1) for due in dues], burst, limit) == []
    start = min(dues)
    bound = burst + limit.count * (end_us - start) / limit.period_us
    assert bound * 0.98 <= len(dues) <= bound
    client.close()


def test_eight_processes_stay_within_the_bound_and_reach_it(redis_server: RedisServer) -> None:
    run_processes(redis_server, 4.0)


@pytest.mark.slow
def test_eight_processes_for_ten_seconds(redis_server: RedisServer) -> None:
    run_processes(redis_server, 10.0)
