"""celery_redislock._rates: the rate language, and the whole microseconds each limit asks
of rate.lua for a call, rounded so that the bound holds exactly (no Redis: the script's
decision is ``tests/_gcra.ScheduleModel``, which the tests on Redis hold the script to)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redislock._errors import LockConfigurationError
from celery_redislock._rates import (
    MAX_US,
    Limit,
    acquire_wait_us,
    parse_rates,
    reserve_wait_us,
    script_args,
    validate_burst,
    validate_cost,
)

from .._gcra import ScheduleModel, excess


def test_each_form_and_its_text() -> None:
    assert parse_rates("100/m") == (Limit(100, 60_000_000),)
    assert parse_rates((3, 0.5)) == parse_rates([3, 0.5]) == (Limit(3, 500_000),)
    assert parse_rates(["5/s", (1000, 3600)]) == (Limit(5, 1_000_000), Limit(1000, 3_600_000_000))
    assert [str(limit) for limit in parse_rates(["5/s", "2/m", "3/h", "4/d", (3, 0.5)])] == [
        "5/s",
        "2/m",
        "3/h",
        "4/d",
        "(3, 0.5)",
    ]
    assert str(Limit(7, 60_000_000)) == "7/m"  # a pair over a unit reads as the unit


def test_the_fractions_are_settled_against_admitting_more() -> None:
    three = Limit(3, 1_000_000)  # 333,333.33 us apart
    assert three.increment_us(1) == 333_334  # rounded up
    assert three.increment_us(3) == 1_000_000
    assert three.tolerance_us(4, 1) == 1_333_333  # rounded down
    # ... unless the call itself is the burst: an idle limit must still admit it.
    assert three.tolerance_us(1, 1) == 333_334
    assert three.tolerance_us(2, 2) == 666_667
    fast = Limit(2**31 - 1, 1_000_000)  # under 1 us apart: a call counts at least 1 us
    assert fast.increment_us(1) == 1
    assert fast.max_burst() == 2**31 - 1
    assert Limit(1, 86_400_000_000).max_burst() == 365
    assert script_args((three, Limit(1, 500_000)), 4, 3, 0) == [
        0,
        1_000_000,
        1_333_333,
        1_500_000,
        2_000_000,
    ]


def test_waits_in_microseconds() -> None:
    assert acquire_wait_us(False, None) == acquire_wait_us(False, 5) == 0
    assert acquire_wait_us(True, None) == reserve_wait_us(None) == MAX_US
    assert acquire_wait_us(True, 2.5) == reserve_wait_us(2.5) == 2_500_000
    assert reserve_wait_us(0.000001) == 1
    for bad in (-1, "1", float("inf")):
        with pytest.raises(LockConfigurationError):
            reserve_wait_us(bad)


@pytest.mark.parametrize(
    ("burst", "cost"), [(0, 1), (True, 1), (2**31, 1), (366, 1), (5, 0), (5, 6), (5, True)]
)
def test_burst_and_cost_bounds(burst: Any, cost: Any) -> None:
    limits = parse_rates(["10/s", "1/d"])
    with pytest.raises(LockConfigurationError, match=r"^(burst|cost) must be an int from 1 to"):
        validate_cost(cost, validate_burst(burst, limits))


_limits = st.lists(
    st.builds(
        Limit,
        st.one_of(
            st.integers(min_value=1, max_value=12), st.integers(max_value=10**6, min_value=1)
        ),
        st.sampled_from([1_000, 1_500, 333_333, 1_000_000, 7_000_000, 60_000_000]),
    ),
    min_size=1,
    max_size=3,
    unique_by=lambda limit: limit.period_us,
)


@settings(max_examples=400, deadline=None)
@given(
    limits=_limits,
    burst=st.integers(min_value=1, max_value=20),
    steps=st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=20),  # cost (at most the burst)
            st.one_of(st.just("due"), st.integers(min_value=0, max_value=3_000_000)),  # gap
            st.sampled_from([0, 1, 1_000, None]),  # max wait in us (None: any)
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_no_timing_of_calls_gets_more_than_the_bound(
    limits: list[Limit], burst: int, steps: list[tuple[int, Any, int | None]]
) -> None:
    """Calls at the very microsecond they become due, bookings, costs and odd intervals:
    in every window, per limit, at most burst + rate * T units (exactly)."""
    limits = [limit for limit in limits if limit.max_burst() >= burst] or [Limit(1, 1_000)]
    model = ScheduleModel(limits, burst)
    now, due, admitted = 10**15, 10**15, []
    for cost, gap, max_wait in steps:
        cost = min(cost, burst)
        now = max(now, due) if gap == "due" else now + gap
        ok, wait = model.call(now, cost, MAX_US if max_wait is None else max_wait)
        due = now + wait
        if ok:
            admitted.append((due, cost))
        else:
            assert wait > 0
    for limit in limits:
        assert excess(admitted, burst, limit) == []


def test_the_oracle_sees_one_unit_too_many() -> None:
    limit = Limit(3, 1_000_000)
    assert excess([(0, 3), (666_666, 3)], 4, limit) != []  # 6 > 4 + 3 * 0.666666
    assert excess([(0, 3), (666_667, 3)], 4, limit) == []
    assert excess([(5, 1), (5, 1)], 1, limit) != []  # two at one moment, burst 1
