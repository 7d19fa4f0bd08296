"""The rate language, and what each limit asks of ``rate.lua`` for one call (I/O-free).

``rate=`` is ``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"``, a ``(count, seconds)`` pair, or a
list of these over different periods. A limit of N per period P spaces its units P/N
apart (its *interval*); with a burst of B, at most ``B + N * T / P`` units are admitted in
any window of length T (docs/guarantees.md, "Rate limiters").

``rate.lua`` keeps each limit's schedule in whole microseconds. The fractions are settled
here, in exact integer arithmetic, always on the side of admitting less:

* a call of cost c advances a schedule by its *increment*, ``ceil(c * P / N)`` µs (a call
  never counts for less than it is; for more by under 1 µs);
* it is admitted while the schedule is at most its *tolerance* ahead of the server's
  clock: ``floor(B * P / N)`` µs, or the increment itself if that is more (so a call of
  cost B is admitted on an idle limit even when B * P / N is not a whole number).

Every value is refused outside its range with a :class:`LockConfigurationError` that
names the argument and what is allowed, before anything is sent to Redis.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence, Tuple, Union

from ._core import MAX_SECONDS, MIN_SECONDS, optional_seconds
from ._errors import LockConfigurationError

#: Seconds in each unit of the ``"N/<unit>"`` form.
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: The largest count of a limit, and the largest burst.
MAX_COUNT = 2**31 - 1
MAX_BURST = 2**31 - 1
#: The most limits one limiter may have (each is one key the script reads and writes).
MAX_LIMITS = 8
#: The longest duration anything here may reach, in microseconds: a limit's burst (its
#: tolerance), a wait allowed for a slot. ``lua/args.lua``'s ``MAX_US`` is the same number.
MAX_US = MAX_SECONDS * 1_000_000
#: The longest wait ``rate.lua`` can answer: a schedule is read up to ``2 * MAX_US`` ahead,
#: and a wait adds one increment to it.
LONGEST_WAIT_US = 3 * MAX_US
#: The default burst: see :class:`celery_redislock.RedisRateLimiter`.
DEFAULT_BURST = 1

RATE_FORMS = (
    f'"N/s", "N/m", "N/h" or "N/d" (N a whole number from 1 to {MAX_COUNT}), a (count, '
    f"seconds) pair (count as N; seconds a number from {MIN_SECONDS:g} to {MAX_SECONDS}), "
    f"or a non-empty list of up to {MAX_LIMITS} of these, each over a different period"
)

#: What ``rate=`` may be (checked at run time by :func:`parse_rates`, whatever its type).
OneRate = Union[str, Tuple[int, float]]
Rate = Union[OneRate, Sequence[OneRate]]

_STRING_FORM = re.compile(r"([0-9]+)/([smhd])", re.ASCII)


@dataclass(frozen=True)
class Limit:
    """One limit: ``count`` units per ``period_us`` microseconds."""

    count: int
    period_us: int

    def __str__(self) -> str:
        for unit, seconds in UNIT_SECONDS.items():
            if self.period_us == seconds * 1_000_000:
                return f"{self.count}/{unit}"
        return f"({self.count}, {self.period_us / 1_000_000:g})"

    def increment_us(self, cost: int) -> int:
        """How far a call of ``cost`` advances the schedule: ``ceil(cost * P / N)`` µs."""
        return -(-cost * self.period_us // self.count)

    def tolerance_us(self, burst: int, cost: int) -> int:
        """How far ahead of the clock the schedule may be for the call to be admitted."""
        return max(burst * self.period_us // self.count, self.increment_us(cost))

    def max_burst(self) -> int:
        """The largest burst whose tolerance stays within :data:`MAX_US`."""
        return min(MAX_BURST, MAX_US * self.count // self.period_us)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rate_error(argument: str, why: str, value: object) -> LockConfigurationError:
    return LockConfigurationError(f"{argument} {why}, got {value!r}; a rate is {RATE_FORMS}")


def _looks_like_pair(value: object) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and not any(isinstance(item, (str, bytes, tuple, list)) for item in value)
    )


def _count(count: object, argument: str, value: object) -> int:
    if not _is_int(count) or not 1 <= count <= MAX_COUNT:  # type: ignore[operator]
        raise _rate_error(
            argument, f"has a count that is not a whole number from 1 to {MAX_COUNT}", value
        )
    return count  # type: ignore[return-value]


def _string_limit(item: str, argument: str) -> Limit:
    match = _STRING_FORM.fullmatch(item)
    if match is None:
        raise _rate_error(argument, "is not of a form it may take", item)
    digits, unit = match.groups()
    # A count of more than 12 digits is out of range whatever it is (and int() of a very
    # long one is itself an error).
    count = int(digits) if len(digits) <= 12 else MAX_COUNT + 1
    return Limit(_count(count, argument, item), UNIT_SECONDS[unit] * 1_000_000)


def _pair_limit(item: Sequence[Any], argument: str) -> Limit:
    count = _count(item[0], argument, item)
    seconds = item[1]
    number = _is_int(seconds) or (isinstance(seconds, float) and math.isfinite(seconds))
    # Compared as given, never converted first: float() of a huge int overflows.
    if not number or not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise _rate_error(
            argument,
            f"has a period that is not a number of seconds from {MIN_SECONDS:g} to "
            f"{MAX_SECONDS} (365 days)",
            item,
        )
    period_us = seconds * 1_000_000 if _is_int(seconds) else round(seconds * 1_000_000)
    return Limit(count, period_us)


def _limit(item: object, argument: str) -> Limit:
    if isinstance(item, str):
        return _string_limit(item, argument)
    if _looks_like_pair(item):
        return _pair_limit(item, argument)  # type: ignore[arg-type]
    raise _rate_error(argument, "is not of a form it may take", item)


def parse_rates(rate: object, argument: str = "rate") -> tuple[Limit, ...]:
    """The limits ``rate`` stands for (one, or several over different periods)."""
    if isinstance(rate, str) or _looks_like_pair(rate):
        items: list[Any] = [rate]
    elif isinstance(rate, (list, tuple)):
        items = list(rate)
        if not 1 <= len(items) <= MAX_LIMITS:
            raise _rate_error(argument, f"has {len(items)} limits, not 1 to {MAX_LIMITS}", rate)
    else:
        raise _rate_error(argument, "is not of a form it may take", rate)
    limits = tuple(_limit(item, argument) for item in items)
    periods = [limit.period_us for limit in limits]
    if len(set(periods)) != len(periods):
        raise _rate_error(
            argument, "has two limits over the same period (keep the lower count)", rate
        )
    return limits


def validate_burst(burst: object, limits: tuple[Limit, ...]) -> int:
    """``burst`` if it is a whole number from 1 to what every limit allows (a burst may
    span at most :data:`MAX_SECONDS` of each limit's rate)."""
    allowed = min(limit.max_burst() for limit in limits)
    if not _is_int(burst) or not 1 <= burst <= allowed:  # type: ignore[operator]
        shown = ", ".join(str(limit) for limit in limits)
        raise LockConfigurationError(
            f"burst must be an int from 1 to {allowed} (not a bool; at most {MAX_BURST}, and "
            f"at most {MAX_SECONDS} s (365 days) of the rate {shown}), got {burst!r}"
        )
    return burst  # type: ignore[return-value]


def validate_cost(cost: object, burst: int) -> int:
    """``cost`` if it is a whole number from 1 to the burst (a larger call could never be
    admitted)."""
    if not _is_int(cost) or not 1 <= cost <= burst:  # type: ignore[operator]
        raise LockConfigurationError(
            f"cost must be an int from 1 to the limiter's burst ({burst}) (not a bool), "
            f"got {cost!r}"
        )
    return cost  # type: ignore[return-value]


def wait_us(seconds: float | None) -> int:
    """A wait allowed for a slot, in microseconds (the nearest whole one); None: as long as
    any (:data:`MAX_US`)."""
    return MAX_US if seconds is None else round(seconds * 1_000_000)


def acquire_wait_us(blocking: object, timeout: object) -> int:
    """``acquire()``'s wait for a slot in microseconds: 0 when not blocking, else its
    ``timeout`` (None: as long as any)."""
    if not isinstance(blocking, bool):
        raise LockConfigurationError(f"blocking must be True or False, got {blocking!r}")
    limit = optional_seconds(timeout, "timeout")
    return wait_us(limit) if blocking else 0


def reserve_wait_us(max_wait: object) -> int:
    """``reserve()``'s ``max_wait`` in microseconds (None: as long as any)."""
    return wait_us(optional_seconds(max_wait, "max_wait"))


def script_args(limits: tuple[Limit, ...], burst: int, cost: int, max_wait_us: int) -> list[int]:
    """``rate.lua``'s ARGV for one call: the wait allowed, then each limit's increment and
    tolerance (KEYS: the limits' schedules, in the same order)."""
    args = [max_wait_us]
    for limit in limits:
        args.append(limit.increment_us(cost))
        args.append(limit.tolerance_us(burst, cost))
    return args
