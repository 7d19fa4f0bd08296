"""At most a rate per name, across every process: :class:`RedisRateLimiter` and
:class:`AsyncRedisRateLimiter`.

::

    limiter = RedisRateLimiter(client, "merchant:7", rate="100/m", burst=10)
    limiter.acquire()                   # blocks until admitted; True
    limiter.acquire(blocking=False)     # False at once when over the limit
    limiter.acquire(timeout=2.0)        # False at once if not admitted within 2 s
    limiter.acquire(cost=5)             # a call that counts as five
    slot = limiter.reserve()            # book the next slot without waiting for it
    slot.wait                           # seconds until it is due (0.0: now)

One Lua script (``lua/rate.lua``, GCRA) decides each call on the Redis server's clock, over
every limit of the name at once: a call is admitted only when all its limits admit it.
A blocked ``acquire`` books its slot in that one round trip and sleeps until the slot is
due; it never polls. There is nothing to release and no lease: a limiter keeps no state
of its own (share one object between threads freely), and its keys in Redis expire once
idle.

Guarantee with one Redis server (docs/guarantees.md, "Rate limiters"): in any window of
length T, at most ``burst + rate * T`` units are admitted, across all processes and hosts
that share the Redis, for each limit. The twins share every decision
(:class:`RateLimiterBase`, and :mod:`celery_redislock._rates` for the arithmetic); each
only sends the script and sleeps its own way.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple

from ._errors import LockConfigurationError
from ._keyspace import DEFAULT_PREFIX, RateKeys, validate_prefix
from ._rates import (
    DEFAULT_BURST,
    LONGEST_WAIT_US,
    Limit,
    Rate,
    acquire_wait_us,
    parse_rates,
    reserve_wait_us,
    script_args,
    validate_burst,
    validate_cost,
)
from ._replies import decode_rate
from ._scripts import run, run_async, scripts_for


class RateSlot(NamedTuple):
    """What :meth:`RedisRateLimiter.reserve` got: a slot booked, or the wait for one."""

    #: True: the slot is the caller's; the call may proceed once ``wait`` has passed.
    #: False: nothing was taken.
    admitted: bool
    #: Seconds from the decision until the slot is due (0.0: due at once). Refused: until
    #: a call would be admitted at once, if nobody else takes the slot meanwhile.
    wait: float
    #: When the slot is due by the Redis server's clock (``TIME``), in microseconds since
    #: the epoch.
    due_us: int


class RateLimiterBase:
    """What the two rate limiters share: their arguments, keys and every decision."""

    def __init__(
        self,
        client: Any,
        name: str | bytes,
        rate: Rate,
        *,
        burst: int = DEFAULT_BURST,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        if client is None:
            raise LockConfigurationError("client must be a redis-py client, got None")
        if isinstance(client, (list, tuple, set, frozenset)):
            raise LockConfigurationError(
                f"{type(self).__name__} takes one Redis client, got {len(client)} in a "
                f"{type(client).__name__}: a rate limiter over a quorum of masters is not "
                f"offered; use one Redis"
            )
        self.client = client
        self.name = name
        self.prefix = validate_prefix(prefix)
        self.keys = RateKeys.for_name(name, self.prefix)
        #: The limits, parsed from ``rate`` (in the order given).
        self.limits: tuple[Limit, ...] = parse_rates(rate)
        self.burst = validate_burst(burst, self.limits)
        #: rate.lua's KEYS: each limit's schedule, in the order of ``limits``.
        self._schedules = tuple(self.keys.schedule(limit.period_us) for limit in self.limits)
        self._script = scripts_for(client).rate

    @property
    def rate(self) -> tuple[str, ...]:
        """The limits as text (``"100/m"``, ``"(3, 0.5)"``)."""
        return tuple(str(limit) for limit in self.limits)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} rate={list(self.rate)!r} "
            f"burst={self.burst!r}>"
        )

    def _args(self, cost: object, max_wait_us: int) -> list[int]:
        return script_args(self.limits, self.burst, validate_cost(cost, self.burst), max_wait_us)

    @staticmethod
    def _slot(reply: Any, max_wait_us: int) -> RateSlot:
        decoded = decode_rate(reply, max_wait_us, LONGEST_WAIT_US)
        return RateSlot(
            decoded.admitted, decoded.wait_us / 1_000_000, decoded.now_us + decoded.wait_us
        )


class RedisRateLimiter(RateLimiterBase):
    """At most ``rate`` per name across every process that shares the Redis (GCRA).

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client (one server; a
            list of clients is refused: not offered).
        name: the limiter's name (str or bytes, non-empty). Limiters of one name share
            their limits' schedules (one per period); a lock or semaphore of that name is
            another thing and shares nothing with it.
        rate: ``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"``, a ``(count, seconds)`` pair, or a
            list of these over different periods (``["5/s", "1000/h"]``): a call is
            admitted only when every limit admits it, atomically.
        burst: how many units may go at once after an idle spell (an int >= 1; the same
            for every limit). The default, 1, spaces calls evenly at the rate, never two
            closer than ``1/rate``: the tightest bound (``1 + rate * T`` in any window T),
            the one a partner's quota usually means. A larger burst lets idle time be
            spent at once, and lets that much more through in a short window.
        prefix: the key prefix (as a lock's).

    In any window of length T, at most ``burst + count * T / period`` units are admitted
    per limit, whatever the number of processes and hosts (see docs/guarantees.md).
    Nothing is written to Redis until a call is made, and every argument is checked
    first: a bad one raises :class:`LockConfigurationError`.
    """

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, cost: int = 1
    ) -> bool:
        """Be admitted: True once the call's slot is due, False if it cannot be in time.

        Args:
            blocking: wait for a slot (False: admitted only if one is due at once).
            timeout: the longest to wait for a slot, in seconds (None: no limit, but no
                slot is booked more than 365 days ahead).
            cost: how many units the call counts for (an int from 1 to ``burst``).

        A blocked call books its slot in the one round trip that finds it, then sleeps
        until the slot is due (no polling). A slot further than ``timeout`` is not
        booked: the call returns False at once, having taken nothing. A sleep
        interrupted (an exception in the waiting thread) leaves its slot unused: fewer
        calls are admitted, never more.
        """
        max_wait = acquire_wait_us(blocking, timeout)
        args = self._args(cost, max_wait)
        slot = self._slot(run(self.client, self._script, self._schedules, args), max_wait)
        if slot.admitted and slot.wait > 0:
            time.sleep(slot.wait)
        return slot.admitted

    def reserve(self, cost: int = 1, *, max_wait: float | None = None) -> RateSlot:
        """Book the call's slot without waiting for it: one round trip, no sleep.

        Args:
            cost: as ``acquire``'s.
            max_wait: the furthest slot to book, in seconds from now (None: up to 365
                days; 0: only a slot due at once).

        Returns a :class:`RateSlot`: ``admitted`` with the ``wait`` until it is due (the
        caller must not start before then: the slot counts from its due time), or not
        admitted (nothing taken) with the ``wait`` until a call would be admitted at
        once. This is how a caller that must not block (a task deferring itself to its
        slot) asks "when is my turn?": a booked slot is kept in the schedule, in
        arrival order, with no further round trip. A booked slot that goes unused is
        lost to everyone: fewer calls are admitted, never more.
        """
        max_wait_us = reserve_wait_us(max_wait)
        args = self._args(cost, max_wait_us)
        return self._slot(run(self.client, self._script, self._schedules, args), max_wait_us)


class AsyncRedisRateLimiter(RateLimiterBase):
    """:class:`RedisRateLimiter` for ``redis.asyncio`` clients: the same arguments,
    decisions and guarantee; ``acquire`` and ``reserve`` are awaited. A cancelled
    ``acquire`` whose command reached Redis, or whose sleep was cancelled, leaves its
    slot unused (fewer admitted, never more)."""

    async def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, cost: int = 1
    ) -> bool:
        """:meth:`RedisRateLimiter.acquire`; the wait is an ``asyncio.sleep``."""
        max_wait = acquire_wait_us(blocking, timeout)
        args = self._args(cost, max_wait)
        reply = await run_async(self.client, self._script, self._schedules, args)
        slot = self._slot(reply, max_wait)
        if slot.admitted and slot.wait > 0:
            await asyncio.sleep(slot.wait)
        return slot.admitted

    async def reserve(self, cost: int = 1, *, max_wait: float | None = None) -> RateSlot:
        """:meth:`RedisRateLimiter.reserve`."""
        max_wait_us = reserve_wait_us(max_wait)
        args = self._args(cost, max_wait_us)
        reply = await run_async(self.client, self._script, self._schedules, args)
        return self._slot(reply, max_wait_us)
