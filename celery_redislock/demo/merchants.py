"""The merchants scene: calls to a partner API that allows N calls per period per
merchant, without and with ``lock_rate``.

A hot merchant sends a burst of calls, and a few small merchants send theirs just after
it. Without a rate the pool calls the partner as fast as it can, far over the quota.
Under ``LockedTask(lock_key="merchant:{merchant}", lock_limit=None, lock_rate="N/s")``
each merchant's calls are spaced at its rate: a call over the rate is deferred to its
slot in Redis (its worker slot given back, nothing dropped) and sent again by the
worker's drainer when the slot is due; the small merchants' calls are not behind the hot
one's backlog.

The table gives each merchant's calls, the most of them in any one period, how many of
them the partner would refuse (each call that finds N of the merchant's calls in the
period before it), and the longest wait (sent to started), from the recorded runs. Under
``lock_rate`` the calls are counted at the slots the rate booked for them (a run starts a
few milliseconds after its slot; the table gives the longest such delay); without it,
when they started. The closing line is computed from those numbers. The scene fails (exit
status 1) when a call did not run exactly once, or a merchant's booked slots hold more
than N calls in a period.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import redis

from .._rates import parse_rates
from ._run import send_and_follow

HOT = "hot"


@dataclass(frozen=True)
class Call:
    """One run of a call, as the worker recorded it (``time.time()`` seconds; the slot
    its rate booked, µs on the Redis server's clock, or None without a rate)."""

    merchant: str
    call: int
    sent: float
    started: float
    ended: float
    slot_us: int | None

    @property
    def wait(self) -> float:
        return self.started - self.sent

    @property
    def moment_us(self) -> int:
        """When the call counts against the quota: its booked slot, else its start."""
        return self.slot_us if self.slot_us is not None else round(self.started * 1_000_000)


@dataclass(frozen=True)
class Stats:
    """A merchant's calls: how many, the most in one period, refused, longest wait."""

    calls: int
    most_in_period: int
    refused: int
    wait_max: float


def most_in_period(moments_us: Sequence[int], period_us: int) -> int:
    """The most moments in any window ``[t, t + period)``."""
    ordered = sorted(moments_us)
    most = 0
    first = 0
    for last, moment in enumerate(ordered):
        while ordered[first] <= moment - period_us:
            first += 1
        most = max(most, last - first + 1)
    return most


def refused(moments_us: Sequence[int], quota: int, period_us: int) -> int:
    """How many calls a partner allowing ``quota`` per period would refuse: each call
    that finds ``quota`` accepted calls in the period before it (a refused call is not
    counted against the quota)."""
    accepted: list[int] = []
    count = 0
    for moment in sorted(moments_us):
        recent = [m for m in accepted if m > moment - period_us]
        if len(recent) >= quota:
            count += 1
        else:
            accepted.append(moment)
    return count


def small_merchants(count: int) -> list[str]:
    return [f"small-{i + 1}" for i in range(count)]


def calls(hot_calls: int, small: list[str], small_calls: int) -> list[tuple[str, int]]:
    """Every call in the order it is sent: the hot burst, then the small ones in turn."""
    burst = [(HOT, call) for call in range(hot_calls)]
    return burst + [(merchant, call) for call in range(small_calls) for merchant in small]


def miscounted(runs: Sequence[Call], sent: Sequence[tuple[str, int]]) -> list[str]:
    """Calls that did not run exactly once, runs of calls never sent; empty when fine."""
    counts = Counter((r.merchant, r.call) for r in runs)
    problems = [
        f"{merchant} call {call} ran {counts[merchant, call]} times"
        for merchant, call in sent
        if counts[merchant, call] != 1
    ]
    unknown = set(counts) - set(sent)
    problems += [
        f"{merchant} call {call} ran but was never sent" for merchant, call in sorted(unknown)
    ]
    return problems


def by_merchant(
    runs: Sequence[Call], merchants: list[str], quota: int, period_us: int
) -> dict[str, Stats]:
    stats = {}
    for merchant in merchants:
        group = [r for r in runs if r.merchant == merchant]
        if group:
            moments = [r.moment_us for r in group]
            stats[merchant] = Stats(
                len(group),
                most_in_period(moments, period_us),
                refused(moments, quota, period_us),
                max(r.wait for r in group),
            )
    return stats


def _seconds(value: float) -> str:
    return f"{value:.2f} s"


_UNITS = (
    ("day", "1 d", 86400),
    ("hour", "1 h", 3600),
    ("minute", "1 min", 60),
    ("second", "1 s", 1),
)


def period_words(period_us: int) -> tuple[str, str]:
    """The period in words and as a column's unit: ("second", "1 s")."""
    for word, short, seconds in _UNITS:
        if period_us == seconds * 1_000_000:
            return word, short
    return f"{period_us / 1_000_000:g} s", f"{period_us / 1_000_000:g} s"


def conclusion(
    without: dict[str, Stats],
    rated: dict[str, Stats],
    rate: str,
    quota: int,
    ran_once: int,
    total: int,
    deferred: int,
) -> str:
    """One line, computed from both runs' numbers."""
    hot_before, hot_after = without[HOT], rated[HOT]
    refused_before = sum(s.refused for s in without.values())
    refused_after = sum(s.refused for s in rated.values())
    small = [m for m in without if m != HOT and m in rated]
    line = (
        f"lock_rate={rate}: the hot merchant's busiest period went from "
        f"{hot_before.most_in_period} calls to {hot_after.most_in_period} (quota {quota}), "
        f"calls over the quota {refused_before} -> {refused_after}; "
        f"{ran_once} of {total} calls ran once, {deferred} deferred to their slot"
    )
    if small:
        before = max(without[m].wait_max for m in small)
        after = max(rated[m].wait_max for m in small)
        line += (
            f"; the small merchants' longest wait {_seconds(before)} -> {_seconds(after)} "
            f"(the hot merchant's {_seconds(hot_after.wait_max)})"
        )
    return line + "."


@dataclass(frozen=True)
class Outcome:
    label: str
    stats: dict[str, Stats]
    ran_once: int
    seconds: float
    late_max: float | None  # the longest a run started after its booked slot


def _send(task: Any, sent: list[tuple[str, int]], work: float) -> None:
    for merchant, call in sent:
        task.delay(merchant, call, time.time(), work)


def _runs(store: redis.Redis, key: str) -> list[Call]:
    return [Call(*json.loads(line)) for line in store.lrange(key, 0, -1)]


def _print_table(
    without: Outcome,
    rated: Outcome,
    merchants: list[str],
    sent: list[tuple[str, int]],
    deferred: int,
    period: str,
) -> None:
    print()
    print(f"{'':17}{without.label:>30}{rated.label:>30}")
    column = f"{'in ' + period:>10}{'refused':>10}{'max wait':>10}"
    print(f"{'merchant':<11}{'calls':>6}{column}{column}")
    for merchant in merchants:
        calls_sent = sum(1 for m, _ in sent if m == merchant)
        cells = ""
        for outcome in (without, rated):
            row = outcome.stats.get(merchant)
            if row is None:  # none of its calls ran: reported as a failure
                cells += f"{'-':>10}{'-':>10}{'-':>10}"
                continue
            cells += f"{row.most_in_period:>10}{row.refused:>10}{_seconds(row.wait_max):>10}"
        print(f"{merchant:<11}{calls_sent:>6}{cells}")
    late = "-" if rated.late_max is None else _seconds(rated.late_max)
    for label, left, right in (
        ("calls run once", f"{without.ran_once} / {len(sent)}", f"{rated.ran_once} / {len(sent)}"),
        ("deferred", "-", str(deferred)),
        ("start after slot", "-", late),
        ("time", _seconds(without.seconds), _seconds(rated.seconds)),
    ):
        print(f"{label:17}{left:>30}{right:>30}")


def run(args: argparse.Namespace, store: redis.Redis, demo: ModuleType) -> bool:
    """Run the scene and print its table; True when every call ran once in both runs and
    no merchant's booked slots hold more than the rate allows in a period."""
    rate: str = demo.RATE
    limit = parse_rates(rate, "--rate")[0]
    quota, period_us = limit.count, limit.period_us
    per, period = period_words(period_us)
    small = small_merchants(args.small_merchants)
    merchants = [HOT, *small]
    sent = calls(args.hot_calls, small, args.small_calls)
    print(
        f"\nmerchants: a partner API allows {quota} calls a {per} per merchant; the hot one "
        f"sends {args.hot_calls} calls, then {len(small)} small ones {args.small_calls} each, "
        f"{args.call_work * 1000:.0f} ms per call\n(in {period}: the most calls in one {per}; "
        f"refused: calls over the quota; wait: sent -> started)"
    )
    outcomes = []
    problems: list[str] = []
    for phase, label, task in (
        ("unrated", "without lock_rate", demo.partner_call),
        ("rated", f"lock_rate={rate}", demo.partner_call_rated),
    ):
        seconds = send_and_follow(
            label,
            functools.partial(_send, task, sent, args.call_work),
            len(sent),
            store,
            demo.merchant_done_key(phase),
            args.timeout,
        )
        runs = _runs(store, demo.merchant_runs_key(phase))
        counts = Counter((r.merchant, r.call) for r in runs)
        ran_once = sum(counts[call] == 1 for call in sent)
        late = [r.started - r.slot_us / 1_000_000 for r in runs if r.slot_us is not None]
        if phase == "rated" and len(late) != len(runs):
            problems.append(f"{label}: {len(runs) - len(late)} runs without a booked slot")
        outcomes.append(
            Outcome(
                label,
                by_merchant(runs, merchants, quota, period_us),
                ran_once,
                seconds,
                max(late) if late else None,
            )
        )
        problems += [f"{label}: {problem}" for problem in miscounted(runs, sent)]
    without, rated = outcomes
    problems += [
        f"{rated.label}: {merchant} had {row.most_in_period} calls in {period}"
        for merchant, row in rated.stats.items()
        if row.most_in_period > quota
    ]
    deferred = demo.deferred_count(demo.partner_call_rated)
    _print_table(without, rated, merchants, sent, deferred, period)
    if HOT in without.stats and HOT in rated.stats:
        print()
        print(
            conclusion(without.stats, rated.stats, rate, quota, rated.ran_once, len(sent), deferred)
        )
    for problem in problems:
        print(f"FAILED: {problem}")
    return not problems
