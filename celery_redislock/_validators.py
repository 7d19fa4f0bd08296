"""I/O-free: the checks of one ``redislock_*`` setting's or task option's value
(durations, choices, counts, the look-ahead, limits, rates, the backoff pair, the key
prefix), used by :mod:`celery_redislock.settings`. Each takes the value and the name to
put in its error (:class:`~celery_redislock.LockConfigurationError`), and returns the
value as it is used.
"""

from __future__ import annotations

from typing import Any

from ._core import MAX_LIMIT, duration_error, lease_ms, seconds, validate_prefix
from ._errors import LockConfigurationError
from ._rates import Limit, parse_rates


def _lease(value: object, name: str) -> float:
    """A duration Redis keeps a key for (``ttl``, ``done_ttl``): 1 ms to 365 days."""
    lease_ms(value, name)
    return float(value)  # type: ignore[arg-type]


def _hold(value: object, name: str) -> float:
    """``lock_hold``: 0 (release at once) or a lease."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    try:
        return _lease(value, name)
    except LockConfigurationError:
        raise duration_error(name, value, alternative="0 (release at once)") from None


def _choice(value: object, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise LockConfigurationError(
            f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        )
    return str(value)


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise LockConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def _count(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LockConfigurationError(f"{name} must be an int >= 0, got {value!r}")
    return value


#: Upper bound of ``redislock_lookahead``: each message searched is decoded at a release.
MAX_LOOKAHEAD = 1000


def _lookahead(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOOKAHEAD:
        raise LockConfigurationError(
            f"{name} must be an int from 0 (off) to {MAX_LOOKAHEAD} (messages searched), "
            f"got {value!r}"
        )
    return value


#: Upper bound of ``redislock_run_on``: a worker process runs parked tasks after its own
#: for at most this long before it hands the rest over through the broker (the releasing
#: task's message stays unacknowledged meanwhile, with ``acks_late``: well within
#: RabbitMQ's default ``consumer_timeout`` of 30 minutes).
MAX_RUN_ON = 600.0


def _run_on(value: object, name: str) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not 0 <= value <= MAX_RUN_ON
    ):
        raise LockConfigurationError(
            f"{name} must be a number of seconds from 0 (off) to {MAX_RUN_ON:g}, got {value!r}"
        )
    return float(value)


def _limit(value: object, name: str) -> Any:
    """``lock_limit``: an int from 1 to ``MAX_LIMIT`` (2**31 - 1), or a
    callable ``(args, kwargs) -> int`` (its value checked at each call)."""
    if callable(value) and not isinstance(value, type):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise LockConfigurationError(
            f"{name} must be an int from 1 (one at a time) to {MAX_LIMIT}, or a callable "
            f"(args, kwargs) -> int; got {value!r}"
        )
    return value


def _rate(value: object, name: str) -> tuple[Limit, ...]:
    """``lock_rate``: one rate or a list of them (``_rates.RATE_FORMS``), parsed."""
    return parse_rates(value, name)


def _backoff(value: object, name: str) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise LockConfigurationError(f"{name} must be a (base, cap) pair of seconds, got {value!r}")
    base, cap = seconds(value[0], f"{name}[0]"), seconds(value[1], f"{name}[1]")
    if cap < base:
        raise LockConfigurationError(f"{name}: cap ({cap}) must be >= base ({base})")
    return base, cap


def _prefix(value: object, name: str) -> str:
    try:
        return validate_prefix(value)
    except LockConfigurationError as exc:
        raise LockConfigurationError(f"{name}: {exc}") from None
