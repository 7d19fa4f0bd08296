"""A hot key's hand-over, part by part, from timestamps inside the worker's processes
(``bench.celery_settlement --parts``).

With ``SETTLE_PARTS=<file>`` the settlement app's worker records, in every process, on
the system-wide monotonic clock: each section (start, end), each ``TaskLock.finish`` (the
release and what surrounds it), each lock script call, each ``task_prerun`` and
``task_postrun``, and in the worker's main process each check of a pushed envelope
(``parking.accept_handed_over``: the first step of a hand-over there), and each task
handed over (``task_handed_over``: run on, or sent). Each process
appends its records to the file when it exits. :func:`parts` then splits every gap
between two sections of the hot account into its steps, as the work sees them.
"""

from __future__ import annotations

import atexit
import math
import os
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

_events: list[str] = []
_mutex = threading.Lock()
monotonic = time.monotonic


def _record(kind: str, name: Any, start: float, end: float = 0.0) -> None:
    _events.append(f"{os.getpid()} {kind} {name} {start!r} {end!r}")


def _dump(path: str) -> None:
    with _mutex:  # (records appended meanwhile stay for the next dump)
        lines = _events[:]
        del _events[: len(lines)]
    if lines:
        with open(path, "a", encoding="utf-8") as out:
            out.write("".join(line + "\n" for line in lines))


def install(path: str, app_module: Any) -> None:
    """Record the parts in this process (and the pool processes it forks)."""
    from celery import signals

    from celery_redislock import _scripts
    from celery_redislock import lock as core_lock
    from celery_redislock import signals as lock_signals
    from celery_redislock.celery import parking, tasklock

    accept = parking.accept_handed_over

    def timed_accept(task: Any, app: Any, message: Any) -> bool:
        started = monotonic()
        try:
            return accept(task, app, message)
        finally:
            _record("accept", message.headers.get("id"), started, monotonic())

    parking.accept_handed_over = timed_accept
    park = parking.Parker.park

    def timed_park(self: Any, message: Any) -> bool:
        # The main process has a message (every message of a task parked at delivery).
        started = monotonic()
        try:
            return park(self, message)
        finally:
            _record("received", (message.headers or {}).get("id"), started, monotonic())

    parking.Parker.park = timed_park  # type: ignore[method-assign]
    finish = tasklock.TaskLock.finish

    def timed_finish(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = monotonic()
        try:
            return finish(self, *args, **kwargs)
        finally:
            _record("finish", "-", started, monotonic())

    tasklock.TaskLock.finish = timed_finish  # type: ignore[method-assign]
    script_run = _scripts.run

    def timed_run(*args: Any, **kwargs: Any) -> Any:
        started = monotonic()
        try:
            return script_run(*args, **kwargs)
        finally:
            _record("script", "-", started, monotonic())

    core_lock.run = tasklock.run = timed_run  # type: ignore[attr-defined]
    section = app_module._section

    def timed_section(run: str, account: str) -> None:
        started = monotonic()
        section(run, account)
        _record("section", account, started, monotonic())

    app_module._section = timed_section

    def prerun(task_id: Any = None, **_: Any) -> None:
        _record("prerun", task_id, monotonic())

    def postrun(task_id: Any = None, **_: Any) -> None:
        _record("postrun", task_id, monotonic())

    def handed(sender: Any = None, task_id: Any = None, via: Any = None, **_: Any) -> None:
        # (the run's lock owner: its task id, and "~..." for a retry or a replacement)
        run = str(task_id or "-").split("~")[0]
        _record("runon" if via == "run_on" else "sent", run, monotonic())

    lock_signals.task_handed_over.connect(handed)
    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)
    signals.worker_process_shutdown.connect(lambda **_: _dump(path), weak=False)
    atexit.register(_dump, path)


#: The steps of a hand-over, in order, as :func:`parts` names them.
STEPS = (
    ("section end -> release call", "the task's return (its log write is in the section)"),
    ("release (TaskLock.finish)", "the release and its Python"),
    ("  the release's script call", "call to reply"),
    ("release end -> main process has it", "result to the main process, ack, fetch"),
    ("main process: the envelope's check", "signature, lock key (accept_handed_over)"),
    ("check -> task_prerun", "dispatch to a pool process, Celery's tracer"),
    ("task_prerun -> section", "LockedTask's acquire and Python"),
    ("  the acquire's script call", "call to reply"),
    ("gap", "next section's start - previous one's end"),
)
#: The steps of a run-on hand-over (the next task run by the releasing process itself).
RUN_ON_STEPS = (
    ("section end -> release call", "the task's return (its log write is in the section)"),
    ("release (TaskLock.finish)", "the release and its Python"),
    ("  the release's script call", "call to reply"),
    (
        "release end -> task_prerun",
        "the releasing trace's end, the message's check, the next trace",
    ),
    ("task_prerun -> section", "LockedTask's acquire (no round trip) and Python"),
    ("gap", "next section's start - previous one's end"),
)


#: The steps of a hand-over whose task the releasing worker published (a signature
#: parked by a pool process: RabbitMQ, another server; no envelope for the main process to
#: check before dispatch).
PUBLISHED_STEPS = (
    ("section end -> release call", "the task's return (its log write is in the section)"),
    ("release (TaskLock.finish)", "the release and its Python"),
    ("  the release's script call", "call to reply"),
    ("release end -> task_prerun", "publish, ack, fetch, dispatch, Celery's tracer"),
    ("  release end -> main process has it", "publish, fetch (parking at delivery's check)"),
    ("  main process has it -> task_prerun", "the result, ack, dispatch, Celery's tracer"),
    ("task_prerun -> section", "LockedTask's acquire and Python"),
    ("  the acquire's script call", "call to reply"),
    ("gap", "next section's start - previous one's end"),
)
#: The kinds of hand-over :func:`parts` tells apart, in this order, and their steps.
KINDS = {"through the broker": STEPS, "published": PUBLISHED_STEPS, "run on": RUN_ON_STEPS}
_Event = tuple[float, float, str, str, str]


def parts(
    path: Path, hot_suffix: str, quantile: float = 0.5
) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Median ms (or another ``quantile``, 0.9 for the p90) of each step over the
    hand-overs of the account whose name ends with ``hot_suffix``, from the records at
    ``path``, by kind (:data:`KINDS`): a pushed envelope the main process checked
    (:data:`STEPS`), a published task (:data:`PUBLISHED_STEPS`) and run on
    (:data:`RUN_ON_STEPS`), each with its count (``"hand-overs"``; a kind with none is
    left out); and how many gaps were left out, and why (``counts``): a next task the lock
    was not handed to (it found the lock free), records missing, or lines that do not
    parse (a process killed while writing). A run whose main process lost its records
    (killed before it wrote them) shows its pushed hand-overs as published: no check
    recorded."""
    events: list[_Event] = []
    counts = {"not handed over": 0, "records missing": 0, "bad lines": 0}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            pid, kind, name, start, end = line.split()
            events.append((float(start), float(end), kind, name, pid))
        except ValueError:
            counts["bad lines"] += 1
    events.sort()
    by_pid: dict[str, list[_Event]] = defaultdict(list)
    for event in events:
        by_pid[event[4]].append(event)
    checked = {e[3]: e for e in events if e[2] == "accept"}
    received = {e[3]: e for e in events if e[2] == "received"}  # (the last, if several)
    handed = {e[3]: e[2] for e in events if e[2] in ("runon", "sent")}
    hot = [e for e in events if e[2] == "section" and e[3].endswith(hot_suffix)]
    found: dict[str, dict[str, list[float]]] = {kind: defaultdict(list) for kind in KINDS}
    for before, after in zip(hot, hot[1:]):
        tail = [e for e in by_pid[before[4]] if e[0] >= before[1]][:8]
        release = next((e for e in tail if e[2] == "finish"), None)
        head = [e for e in by_pid[after[4]] if e[0] <= after[0]][-8:]
        prerun = next((e for e in reversed(head) if e[2] == "prerun"), None)
        if release is None or prerun is None or release[1] > prerun[0]:
            counts["records missing"] += 1
            continue
        how = handed.get(prerun[3])
        check = checked.get(prerun[3])
        if check is None and how is None:
            counts["not handed over"] += 1
            continue
        calls = sum(
            e[1] - e[0] for e in tail if e[2] == "script" and release[0] <= e[0] <= release[1]
        )
        acquire = sum(e[1] - e[0] for e in head if e[2] == "script" and e[0] >= prerun[0])
        ends = (release[0] - before[1], release[1] - release[0], calls)
        gap = after[0] - before[1]
        if how == "runon":
            kind = "run on"
            steps: tuple[float, ...] = (*ends, prerun[0] - release[1], after[0] - prerun[0], gap)
        elif check is not None:
            kind = "through the broker"
            steps = (
                *ends,
                check[0] - release[1],
                check[1] - check[0],
                prerun[0] - check[1],
                after[0] - prerun[0],
                acquire,
                gap,
            )
        else:
            kind = "published"
            got = received.get(prerun[3])
            # (received: the main process had it; not recorded without parking at delivery)
            split = (got[0] - release[1], prerun[0] - got[0]) if got else (math.nan,) * 2
            steps = (*ends, prerun[0] - release[1], *split, after[0] - prerun[0], acquire, gap)
        for (label, _), seconds in zip(KINDS[kind], steps):
            if not math.isnan(seconds):
                found[kind][label].append(seconds * 1e3)
    medians = {kind: _medians(found[kind], quantile) for kind in KINDS}
    return {kind: m for kind, m in medians.items() if m}, counts


def _medians(found: dict[str, list[float]], quantile: float = 0.5) -> dict[str, float]:
    if not found:
        return {}
    medians = {label: _quantile(values, quantile) for label, values in found.items()}
    medians["hand-overs"] = float(len(found["gap"]))
    return medians


def _quantile(values: list[float], quantile: float) -> float:
    """The median (``quantile`` 0.5), else the nearest-rank quantile of ``values``."""
    if quantile == 0.5:
        return statistics.median(values)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(quantile * len(ordered)) - 1))]
