"""The reindex scene: "rebuild the search index for a user", sent in bursts, without and
with last call wins.

Each user sends a rebuild call (version 0), and once the worker has taken it up (running,
or waiting for quiet under ``lock_debounce``) a burst of newer ones (versions 1, 2, ...).
As a plain task every call runs: a rebuild per call, most of them of versions already
out of date. Under ``LockedTask(lock_key="user:{user}", on_contention="replace")`` a call
that finds its user's rebuild running becomes the pending call, a newer one takes its
place (the older ends as ``SUPERSEDED``), and the release hands the lock to the newest:
the first and the newest run. Under ``lock_debounce=D`` every call waits for D seconds of
quiet on its key, each newer call superseding the one before: the newest runs, once.

The table gives each user's calls, the versions that ran (in the order they started) and
the version its index ended at, from the recorded runs and the package's
``task_superseded`` signal. The closing line is computed from those numbers. The scene
fails (exit status 1) when a call was neither run once nor superseded once, or, under last
call wins, the newest version did not run last or an older version ran after a newer one.
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

from ._run import send_and_follow

EVERY = "every"
LAST_WINS = ("replace", "debounce")


@dataclass(frozen=True)
class Rebuild:
    """One run, as the worker recorded it (``time.time()`` seconds)."""

    user: str
    version: int
    task_id: str
    started: float
    ended: float


@dataclass(frozen=True)
class UserRow:
    """A user's calls, the versions that ran in start order, its index's last version."""

    calls: int
    ran: tuple[int, ...]
    index: int | None


@dataclass(frozen=True)
class Outcome:
    phase: str
    label: str
    rows: dict[str, UserRow]
    accounted: int  # calls that ran once or were superseded once, never both
    superseded: int
    seconds: float


def users(count: int) -> list[str]:
    return [f"user-{i + 1}" for i in range(count)]


def versions_text(ran: Sequence[int]) -> str:
    """``0..7`` for a run of consecutive versions (three or more), else ``0,7``."""
    if not ran:
        return "-"
    if len(ran) >= 3 and list(ran) == list(range(ran[0], ran[0] + len(ran))):
        return f"{ran[0]}..{ran[-1]}"
    return ",".join(str(v) for v in ran)


def account(
    runs: Sequence[Rebuild],
    superseded: set[str],
    sent: dict[str, tuple[str, int]],
    last_wins: bool,
) -> tuple[int, list[str]]:
    """(calls run once or superseded once, never both; what is wrong). Under last call
    wins, each user's newest version must run last and no older one after a newer."""
    counts = Counter(r.task_id for r in runs)
    problems = []
    accounted = 0
    for task_id, (user, version) in sent.items():
        times, gone = counts[task_id], task_id in superseded
        if (times, gone) in ((1, False), (0, True)):
            accounted += 1
        else:
            state = f"ran {times} times" + (" and was superseded" if gone else "")
            problems.append(f"{user} version {version} {state}")
    problems += [f"a run of {r.task_id} that was never sent" for r in runs if r.task_id not in sent]
    problems += [f"{task_id} superseded but never sent" for task_id in superseded - set(sent)]
    if last_wins:
        newest: dict[str, int] = {}
        for user, version in sent.values():
            newest[user] = max(version, newest.get(user, version))
        for user, last in newest.items():
            ran: list[int] = [
                r.version for r in sorted(runs, key=lambda r: r.started) if r.user == user
            ]
            if not ran or ran[-1] != last:
                problems.append(f"{user}: the newest version {last} did not run last ({ran})")
            if ran != sorted(ran):
                problems.append(f"{user}: an older version ran after a newer one ({ran})")
    return accounted, problems


def rows_for(
    runs: Sequence[Rebuild], names: list[str], calls: int, index: dict[str, int | None]
) -> dict[str, UserRow]:
    ordered = sorted(runs, key=lambda r: r.started)
    return {
        user: UserRow(calls, tuple(r.version for r in ordered if r.user == user), index[user])
        for user in names
    }


def _describe(rows: dict[str, UserRow], calls: int) -> str:
    if all(row.ran == (0, calls - 1) for row in rows.values()):
        return "the first and the newest of each burst"
    if all(row.ran == (calls - 1,) for row in rows.values()):
        return "only the newest of each burst"
    return "; ".join(f"{user}: {versions_text(row.ran)}" for user, row in rows.items())


def conclusion(outcomes: Sequence[Outcome], calls: int) -> str:
    """One line, computed from the runs' numbers."""
    every = next(o for o in outcomes if o.phase == EVERY)
    total = len(every.rows) * calls
    runs = {o.phase: sum(len(row.ran) for row in o.rows.values()) for o in outcomes}
    parts = [f"{total} calls: the {every.label} ran {runs[EVERY]} rebuilds"]
    for outcome in outcomes:
        if outcome.phase != EVERY:
            parts.append(
                f"{outcome.label} ran {runs[outcome.phase]} "
                f"({_describe(outcome.rows, calls)}), {outcome.superseded} superseded"
            )
    stale = {o.label: sum(row.index != calls - 1 for row in o.rows.values()) for o in outcomes}
    if not any(stale.values()):
        parts.append("every index ended at its newest version in every run")
    else:
        parts += [
            f"with the {label}, {count} of {len(every.rows)} indexes ended at an older version"
            if label == every.label
            else f"with {label}, {count} of {len(every.rows)} indexes ended at an older version"
            for label, count in stale.items()
            if count
        ]
    return "; ".join(parts) + "."


def _send_bursts(
    task: Any,
    names: list[str],
    calls: int,
    work: float,
    store: redis.Redis,
    received_key: str,
    sent: dict[str, tuple[str, int]],
    timeout: float,
) -> None:
    """Version 0 for every user; once the worker has taken up each (its run started, or it
    waits for quiet), the newer versions, in turn."""
    first = {task.delay(user, 0, work).id: (user, 0) for user in names}
    sent.update(first)
    deadline = time.monotonic() + timeout
    while not all(store.sismember(received_key, task_id) for task_id in first):
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not take up the first calls in time")
        time.sleep(0.01)
    for version in range(1, calls):
        for user in names:
            sent[task.delay(user, version, work).id] = (user, version)


def _runs(store: redis.Redis, key: str) -> list[Rebuild]:
    return [Rebuild(*json.loads(line)) for line in store.lrange(key, 0, -1)]


def _print_table(outcomes: Sequence[Outcome], names: list[str], calls: int) -> None:
    width = 25
    print()
    print(f"{'':17}" + "".join(f"{o.label:>{width}}" for o in outcomes))
    column = f"{'ran':>17}{'index':>8}"
    print(f"{'user':<11}{'calls':>6}" + column * len(outcomes))
    for user in names:
        cells = ""
        for outcome in outcomes:
            row = outcome.rows[user]
            index = "-" if row.index is None else str(row.index)
            cells += f"{versions_text(row.ran):>17}{index:>8}"
        print(f"{user:<11}{calls:>6}{cells}")
    total = len(names) * calls
    summary = (
        ("calls accounted", [f"{o.accounted} / {total}" for o in outcomes]),
        ("superseded", ["-" if o.phase == EVERY else str(o.superseded) for o in outcomes]),
        ("rebuilds run", [str(sum(len(r.ran) for r in o.rows.values())) for o in outcomes]),
        ("time", [f"{o.seconds:.2f} s" for o in outcomes]),
    )
    for label, values in summary:
        print(f"{label:17}" + "".join(f"{value:>{width}}" for value in values))


def run(args: argparse.Namespace, store: redis.Redis, demo: ModuleType) -> bool:
    """Run the scene and print its table; True when every call ran once or was superseded
    once in each run, and under last call wins each user's runs end at its newest call."""
    names = users(args.users)
    calls = args.rebuilds
    print(
        f"\nreindex: {len(names)} users each send a rebuild of their search index, then "
        f"{calls - 1} more while it is taken up, {args.rebuild_work * 1000:.0f} ms per "
        f"rebuild\n(ran: the versions rebuilt, in order; index: the version it ends at)"
    )
    outcomes = []
    problems: list[str] = []
    for phase, label, task in (
        (EVERY, "plain task", demo.reindex),
        ("replace", 'on_contention="replace"', demo.reindex_replace),
        ("debounce", f"lock_debounce={demo.DEBOUNCE:g}", demo.reindex_debounce),
    ):
        sent: dict[str, tuple[str, int]] = {}
        seconds = send_and_follow(
            {EVERY: "plain task", "replace": "replace"}.get(phase, "lock_debounce"),
            functools.partial(
                _send_bursts,
                task,
                names,
                calls,
                args.rebuild_work,
                store,
                demo.reindex_received_key(phase),
                sent,
                args.timeout,
            ),
            len(names) * calls,
            store,
            demo.reindex_done_key(phase),
            args.timeout,
        )
        runs = _runs(store, demo.reindex_runs_key(phase))
        superseded = {
            m.decode() if isinstance(m, bytes) else m
            for m in store.smembers(demo.reindex_superseded_key(phase))
        }
        accounted, wrong = account(runs, superseded, sent, phase in LAST_WINS)
        index = {}
        for user in names:
            value = store.get(demo.reindex_index_key(phase, user))
            index[user] = None if value is None else int(value)
        rows = rows_for(runs, names, calls, index)
        outcomes.append(Outcome(phase, label, rows, accounted, len(superseded), seconds))
        problems += [f"{label}: {problem}" for problem in wrong]
    _print_table(outcomes, names, calls)
    print()
    print(conclusion(outcomes, calls))
    for problem in problems:
        print(f"FAILED: {problem}")
    return not problems
