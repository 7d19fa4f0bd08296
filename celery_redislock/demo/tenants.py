"""The tenants scene: a hot tenant and small ones on one worker pool, without and with
``lock_limit``.

The hot tenant floods the queue with jobs, and a few small tenants send theirs just
after it. Without a limit the pool serves the queue in order, so every small job waits
behind the whole flood. Under ``LockedTask(lock_key="tenant:{tenant}", lock_limit=N)``
the hot tenant runs at most N jobs at once; its other jobs are parked without holding a
worker process, so the small tenants' jobs start on the free processes, and the hot
backlog drains N at a time. Both runs send the same job body. The baseline is that body
as a plain task: a ``LockedTask`` without ``lock_limit`` is a mutex per tenant (a limit
of 1), not the absence of a limit.

The table gives each tenant's wait (sent to started: median and max) and the most of its
jobs seen running at once, from the recorded start and end of every run. The closing
line is computed from those numbers. The scene fails (exit status 1) when a job did not
run exactly once, or a tenant ran more jobs at once than the limit allows.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import redis

from ._run import send_and_follow

HOT = "hot"
ALL_SMALL = "all small"


@dataclass(frozen=True)
class Run:
    """One run of a job, as the worker recorded it (``time.time()`` seconds)."""

    tenant: str
    job: int
    sent: float
    started: float
    ended: float

    @property
    def wait(self) -> float:
        return self.started - self.sent


@dataclass(frozen=True)
class Stats:
    """A group of runs: how many, their median and longest wait, the most at once."""

    runs: int
    wait_p50: float
    wait_max: float
    at_once: int


def most_at_once(runs: Sequence[Run]) -> int:
    """The most runs open at one instant; a run that ends as another starts is not counted
    with it (a released permit is taken up after its holder's end was recorded)."""
    events = sorted([(r.started, 1) for r in runs] + [(r.ended, -1) for r in runs])
    most = inside = 0
    for _at, step in events:
        inside += step
        most = max(most, inside)
    return most


def summarize(runs: Sequence[Run]) -> Stats:
    waits = [r.wait for r in runs]
    return Stats(len(runs), statistics.median(waits), max(waits), most_at_once(runs))


def small_tenants(count: int) -> list[str]:
    return [f"small-{i + 1}" for i in range(count)]


def jobs(hot_jobs: int, small: list[str], small_jobs: int) -> list[tuple[str, int]]:
    """Every job in the order it is sent: the hot flood, then the small tenants' in turn."""
    flood = [(HOT, job) for job in range(hot_jobs)]
    return flood + [(tenant, job) for job in range(small_jobs) for tenant in small]


def miscounted(runs: Sequence[Run], sent: Sequence[tuple[str, int]]) -> list[str]:
    """What is wrong with the runs' count: jobs that did not run exactly once, runs of
    jobs never sent. Empty when every job ran once."""
    counts = Counter((r.tenant, r.job) for r in runs)
    problems = [
        f"{tenant} job {job} ran {counts[tenant, job]} times"
        for tenant, job in sent
        if counts[tenant, job] != 1
    ]
    unknown = set(counts) - set(sent)
    problems += [f"{tenant} job {job} ran but was never sent" for tenant, job in sorted(unknown)]
    return problems


def by_tenant(runs: Sequence[Run], small: list[str]) -> dict[str, Stats]:
    """Stats per tenant (hot, each small one) and for the small tenants together."""
    groups = {tenant: [r for r in runs if r.tenant == tenant] for tenant in [HOT, *small]}
    groups[ALL_SMALL] = [r for r in runs if r.tenant in small]
    return {name: summarize(group) for name, group in groups.items() if group}


def _seconds(value: float) -> str:
    return f"{value:.2f} s"


def _moved(before: float, after: float) -> str:
    """How a wait changed, judged on its two printed values."""
    if _seconds(before) == _seconds(after):
        return f"stayed at {_seconds(after)}"
    change = f"{_seconds(before)} -> {_seconds(after)}"
    if after >= before:
        return f"rose {change}"
    ratio = before / after if after > 0 else float("inf")
    return f"fell {change} ({ratio:.1f}x shorter)" if ratio >= 1.5 else f"fell {change}"


def conclusion(without: dict[str, Stats], limited: dict[str, Stats], limit: int) -> str:
    """One line, computed from both runs' numbers."""
    small_before, small_after = without[ALL_SMALL], limited[ALL_SMALL]
    hot_before, hot_after = without[HOT], limited[HOT]
    return (
        f"lock_limit={limit}: the small tenants' median wait "
        f"{_moved(small_before.wait_p50, small_after.wait_p50)}; the hot tenant's "
        f"{_moved(hot_before.wait_p50, hot_after.wait_p50)}, running at most "
        f"{hot_after.at_once} at once ({hot_before.at_once} without)."
    )


@dataclass(frozen=True)
class Outcome:
    """One run of the scene: its label, stats per tenant, jobs run exactly once, seconds."""

    label: str
    stats: dict[str, Stats]
    ran_once: int
    seconds: float


def _send(task: Any, sent: list[tuple[str, int]], work: float) -> None:
    for tenant, job in sent:
        task.delay(tenant, job, time.time(), work)


def _runs(store: redis.Redis, key: str) -> list[Run]:
    return [Run(*json.loads(line)) for line in store.lrange(key, 0, -1)]


def _print_table(
    without: Outcome, limited: Outcome, small: list[str], sent: list[tuple[str, int]], parked: int
) -> None:
    print()
    print(f"{'':17}{without.label:>30}{limited.label:>30}")
    column = f"{'p50 wait':>11}{'max wait':>10}{'at once':>9}"
    print(f"{'tenant':<11}{'jobs':>6}{column}{column}")
    for tenant in [HOT, *small, ALL_SMALL]:
        jobs_sent = sum(1 for t, _ in sent if t == tenant or (tenant == ALL_SMALL and t != HOT))
        cells = ""
        for outcome in (without, limited):
            row = outcome.stats.get(tenant)
            if row is None:  # none of its jobs ran: reported as a failure
                cells += f"{'-':>11}{'-':>10}{'-':>9}"
                continue
            at_once = "-" if tenant == ALL_SMALL else str(row.at_once)
            cells += f"{_seconds(row.wait_p50):>11}{_seconds(row.wait_max):>10}{at_once:>9}"
        print(f"{tenant:<11}{jobs_sent:>6}{cells}")
    for label, left, right in (
        ("jobs run once", f"{without.ran_once} / {len(sent)}", f"{limited.ran_once} / {len(sent)}"),
        ("parked", "-", str(parked)),
        ("time", _seconds(without.seconds), _seconds(limited.seconds)),
    ):
        print(f"{label:17}{left:>30}{right:>30}")


def run(args: argparse.Namespace, store: redis.Redis, demo: ModuleType) -> bool:
    """Run the scene and print its table; True when every job ran once in both runs and
    no tenant ran more than the limit at once under it."""
    limit: int = demo.LIMIT
    small = small_tenants(args.small_tenants)
    sent = jobs(args.hot_jobs, small, args.small_jobs)
    print(
        f"\ntenants: a hot tenant sends {args.hot_jobs} jobs, then {len(small)} small ones "
        f"{args.small_jobs} each, {args.tenant_work * 1000:.0f} ms per job (wait: sent -> started)"
    )
    outcomes = []
    problems: list[str] = []
    for phase, label, task in (
        ("unlimited", "without lock_limit", demo.tenant_job),
        ("limited", f"lock_limit={limit}", demo.tenant_job_limited),
    ):
        seconds = send_and_follow(
            label,
            functools.partial(_send, task, sent, args.tenant_work),
            len(sent),
            store,
            demo.tenant_done_key(phase),
            args.timeout,
        )
        runs = _runs(store, demo.tenant_runs_key(phase))
        counts = Counter((r.tenant, r.job) for r in runs)
        ran_once = sum(counts[job] == 1 for job in sent)
        outcomes.append(Outcome(label, by_tenant(runs, small), ran_once, seconds))
        problems += [f"{label}: {problem}" for problem in miscounted(runs, sent)]
    without, limited = outcomes
    problems += [
        f"{limited.label}: {tenant} ran {row.at_once} at once"
        for tenant, row in limited.stats.items()
        if tenant != ALL_SMALL and row.at_once > limit
    ]
    _print_table(without, limited, small, sent, demo.parked_count(demo.tenant_job_limited))
    if all({HOT, ALL_SMALL} <= set(outcome.stats) for outcome in outcomes):
        print()
        print(conclusion(without.stats, limited.stats, limit))
    for problem in problems:
        print(f"FAILED: {problem}")
    return not problems
