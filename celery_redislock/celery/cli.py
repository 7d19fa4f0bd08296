"""``celery -A proj redislock``: see and release the locks of a Celery app.

::

    celery -A proj redislock ls [PATTERN] [--json]   held locks, limited keys in use, rate
                                                     keys with a deferred backlog
    celery -A proj redislock show NAME [--json]      one lock (or limited key): holders,
                                                     parked tasks, waiters; a rate key:
                                                     each limit's next free slot, backlog
    celery -A proj redislock release NAME [--yes]    force-release (asks first; logged)
    celery -A proj redislock release NAME --owner OWNER [--yes]
                                                     free one holder's permit of a limited
                                                     key, handed on to the first parked task
    celery -A proj redislock stats [--json]          acquires, contentions, re-queues, losses,
                                                     waits; limited tasks per task name

It reads the app's ``redislock_*`` settings (Redis URL, prefix) and only ever uses
``SCAN`` (never ``KEYS``), so it is safe against a production Redis. A limited key
(``lock_limit``: a semaphore) is a name of its own beside the lock of the same name:
``ls`` marks it, ``show`` shows either or both and says which; so is a rate key
(``lock_rate``), shown when it has a schedule or deferred runs. With ``redislock_urls``
(the quorum lock) ``ls`` and ``show`` ask every node and say on how many of them a lock
is held, and ``release`` force-releases on every node and prints what each one did
(limits are not offered on a quorum: no limited key is looked for there). A node that
cannot be reached is named, and the command exits 1; a bad NAME, PATTERN or
``--prefix`` is a usage error (exit 2). Everything read from Redis is taken as it
comes: names and owners are printed escaped, and fields that are not what the package
writes are left out.

The servers asked are :mod:`.cli_nodes`'s, the printing of ``show`` is :mod:`.cli_print`'s,
and the live views (``exporter``, ``top``) are in :mod:`.cli_ops`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options
from redis.exceptions import RedisError, ResponseError

from .. import metrics
from .._core import MAX_LIMIT, LockKeys, lease_ms, validate_prefix
from .._errors import LockConfigurationError
from .._keyspace import SemaphoreKeys, lock_key_pattern, stats_key
from ..lock import RedisLock
from .cli_nodes import _merged, _Nodes
from .cli_print import _due, _owner_text, _print_lock, _print_rate, _print_semaphore, _shown
from .clients import settings_for
from .handover import send_handed_over
from .inspection import (
    describe_latest,
    describe_limited,
    describe_lock,
    describe_rated,
    limited_names,
    limits_now,
    lock_line,
    permits,
    rated_names,
    read,
    text,
)
from .tasklock import TaskSemaphore

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ arguments


def _lock_name(_ctx: click.Context | None, param: click.Parameter, value: str) -> bytes:
    """A NAME (or PATTERN) as the bytes the command line gave."""
    if not value:
        raise click.BadParameter("must not be empty", param=param)
    try:
        # Arguments that are not UTF-8 arrive with their bytes smuggled as surrogates:
        # give those bytes back, so a lock named with any bytes can be reached.
        return os.fsencode(value)
    except UnicodeError:
        raise click.BadParameter(
            f"{value.encode('utf-8', 'backslashreplace').decode()!r} cannot be encoded: "
            f"give the name as UTF-8 text or bytes",
            param=param,
        ) from None


def _glob(_ctx: click.Context, param: click.Parameter, value: str) -> bytes:
    # Names are stored with '%', '{' and '}' escaped; so is the pattern (lock_key_pattern).
    return _lock_name(None, param, value)


def _prefix(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_prefix(value)
    except LockConfigurationError as exc:
        raise click.BadParameter(str(exc), param=param) from None


prefix_option = click.option(
    "--prefix",
    default=None,
    callback=_prefix,
    help="Key prefix (default: the app's redislock_prefix).",
)


# ------------------------------------------------------------------ commands


@click.group(name="redislock")
@click.pass_context
@handle_preload_options
def redislock(ctx: click.Context) -> None:
    """Inspect and release celery_redislock locks (uses the app's redislock_* settings)."""


@redislock.command(cls=CeleryCommand, name="ls")
@prefix_option
@click.argument("pattern", default="*", callback=_glob)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of a table.")
@click.pass_context
def list_locks(ctx: click.Context, prefix: str | None, pattern: bytes, as_json: bool) -> None:
    """List held locks, and limited keys in use, whose name matches PATTERN (a glob;
    default: all). A limited key (lock_limit) is marked KIND "limit"; its HOLDS are the
    permits held out of its limit, its TTL the shortest lease left among them. A rate key
    (lock_rate) with deferred runs is marked KIND "rate"; its PARKED are the runs
    deferred on it, its TTL when the first of them is due."""
    nodes = _Nodes(ctx.obj.app, prefix)
    # The prefix is matched literally: its glob characters are escaped.
    match = lock_key_pattern(nodes.prefix, pattern)

    def scan(client: Any) -> dict[str, dict[str, Any]]:
        found = {}
        for key in client.scan_iter(match=match, count=1000, _type="hash"):
            row = describe_lock(client, nodes.prefix, key)
            if row is not None:
                found[row["name"]] = row
        return found

    def scan_limited(client: Any) -> list[dict[str, Any]]:
        found = (
            describe_limited(client, nodes.prefix, n)
            for n in limited_names(client, nodes.prefix, pattern)
        )
        rows = [row for row in found if row is not None and (row["holders"] or row["parked"])]
        rated = (
            describe_rated(client, nodes.prefix, n)
            for n in rated_names(client, nodes.prefix, pattern)
        )
        return rows + [row for row in rated if row is not None and row["deferred"]]

    results = nodes.each(scan)
    views = [r if isinstance(r, dict) else {} for r in results]
    names = sorted({name for view in views for name in view})
    if nodes.is_quorum:
        rows = [_merged([view.get(n) for view in views], nodes.labels, nodes.quorum) for n in names]
        limited: list[Any] = []  # not offered on a quorum: not looked for
    else:
        rows = [views[0][name] for name in names]
        unreachable = any(isinstance(r, RedisError) for r in results)
        limited = [] if unreachable else nodes.each(scan_limited)
        rows += limited[0] if limited and isinstance(limited[0], list) else []
        rows.sort(key=lambda row: (row["name"], row["kind"]))
    if as_json:
        for row in rows:
            ctx.obj.echo(json.dumps(row, sort_keys=True))
    else:
        extra = f" {'NODES':>5}" if nodes.is_quorum else ""
        ctx.obj.echo(
            f"{'NAME':<40} {'KIND':<5} {'OWNER':<48} {'HOLDS':>5} {'TTL':>8} {'TOKEN':>7} "
            f"{'PARKED':>6}{extra}"
        )
        for row in rows:
            owner = ", ".join(_owner_text(o) for o in row.get("owners", ())) or "-"
            ttl = "none" if row.get("ttl") is None else f"{row['ttl']:.1f}s"
            token, holds, kind = row.get("token"), row.get("holds"), "lock"
            if row["kind"] == "semaphore":
                kind, holds = "limit", f"{row['holders']}/{row['limit'] or '?'}"
                ttl, token = ("-", "-") if not row["holders"] else (ttl, token or "-")
            elif row["kind"] == "rate":
                kind, holds, token, owner = "rate", "-", "-", "-"
                ttl = _due(row["head_due"])
            held = f" {len(row['held_on'])}/{len(nodes.clients):<3}" if nodes.is_quorum else ""
            parked = row["deferred"] if row["kind"] == "rate" else row["parked"]
            ctx.obj.echo(
                f"{_shown(row['name']):<40} {kind:<5} {owner:<48} {holds:>5} {ttl:>8} "
                f"{token:>7} {parked:>6}{held}"
            )
        in_use = sum(row["kind"] == "semaphore" for row in rows)
        rated = sum(row["kind"] == "rate" for row in rows)
        limited_text = f", {in_use} limited key(s) in use" if in_use else ""
        rated_text = f", {rated} rate key(s) with deferred runs" if rated else ""
        ctx.obj.echo(f"{len(rows) - in_use - rated} lock(s) held{limited_text}{rated_text}")
    if nodes.failed(ctx, results) or (limited and nodes.failed(ctx, limited)):
        ctx.exit(1)


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.argument("name", callback=_lock_name)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx: click.Context, prefix: str | None, name: bytes, as_json: bool) -> None:
    """Show lock NAME: owner, holds, TTL, token, parked tasks, waiting processes; or the
    limited key NAME (lock_limit): each holder's permit (holds, lease left, token), its
    limit, parked tasks with their limits, waiters; or the rate key NAME (lock_rate):
    each limit's next free slot, the runs deferred on it and when the first is due. A
    lock, a limited key and a rate key of one name are different things: each in use is
    shown, headed by what it is."""
    nodes = _Nodes(ctx.obj.app, prefix)
    keys = LockKeys.for_name(name, nodes.prefix)

    def look(client: Any) -> dict[str, Any]:
        found = describe_lock(client, nodes.prefix, keys.lock) or {
            "kind": "lock",
            "name": text(name),
            "owners": {},
            "holds": 0,
        }
        found["waiting_processes"], found["parked_tasks"] = lock_line(client, keys)
        latest = describe_latest(client, keys.latest)
        if latest is not None:
            found["latest"] = latest
        return found

    results = nodes.each(look)
    views = [r if isinstance(r, dict) else None for r in results]
    if nodes.is_quorum:
        held = [v if v is not None and v["owners"] else None for v in views]
        found: dict[str, Any] = (
            _merged(held, nodes.labels, nodes.quorum)
            if any(held)
            else {"kind": "lock", "name": text(name), "owners": {}, "holds": 0, "held_on": []}
        )
        found["quorum"] = nodes.quorum
        found["locked"] = len(found["held_on"]) >= nodes.quorum
        found["nodes"] = {
            label: view if view is not None else {"error": f"{type(r).__name__}: {r}"}
            for label, view, r in zip(nodes.labels, views, results)
        }
        found["waiting_processes"] = max((v["waiting_processes"] for v in views if v), default=0)
        found["parked_tasks"] = []
    elif views[0] is not None:
        found = views[0]
    else:
        found = {}
    limited = None
    if found and not nodes.is_quorum:  # (limits and rates are not offered on a quorum)
        limited = nodes.each(
            lambda client: describe_limited(client, nodes.prefix, name, detail=True)
        )
        rated = nodes.each(lambda client: describe_rated(client, nodes.prefix, name, detail=True))
    else:
        rated = None
    semaphore = limited[0] if limited and isinstance(limited[0], dict) else None
    if semaphore is not None:
        sem_latest = describe_latest(
            nodes.clients[0], SemaphoreKeys.for_name(name, nodes.prefix).line.latest
        )
        if sem_latest is not None:
            semaphore["latest"] = sem_latest
    rate = rated[0] if rated and isinstance(rated[0], dict) else None
    # The lock is shown unless only the limited key or the rate key is in use.
    lock_in_use = bool(found.get("owners") or found.get("parked_tasks"))
    lock_in_use = lock_in_use or bool(found.get("waiting_processes"))
    shown = [found] if found and (lock_in_use or (semaphore is None and rate is None)) else []
    shown += [row for row in (semaphore, rate) if row is not None]
    for row in shown:
        if as_json:
            ctx.obj.echo(json.dumps(row, sort_keys=True))
        elif row["kind"] == "semaphore":
            _print_semaphore(ctx, name, row)
        elif row["kind"] == "rate":
            _print_rate(ctx, name, row)
        else:
            _print_lock(ctx, name, row, nodes, headed=len(shown) > 1)
    if nodes.failed(ctx, results) or any(
        each and nodes.failed(ctx, each) for each in (limited, rated)
    ):
        ctx.exit(1)


def _owner_arg(ctx: click.Context, param: click.Parameter, value: str | None) -> bytes | None:
    return None if value is None else _lock_name(ctx, param, value)


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.argument("name", callback=_lock_name)
@click.option(
    "--owner",
    default=None,
    callback=_owner_arg,
    help="Free this holder's permit of the limited key NAME (lock_limit) instead.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release(
    ctx: click.Context, prefix: str | None, name: bytes, owner: bytes | None, yes: bool
) -> None:
    """Force-release lock NAME whoever holds it (its holder learns it lost the lease).

    With redislock_urls, on every node; each node's outcome is printed (released, not
    locked, unreachable), and the exit status is 1 if a node could not be reached.

    With --owner OWNER, free that one holder's permit of the limited key NAME instead,
    and hand it on to the first parked task (or waiter) as a dying worker's release does:
    the parked task's message is checked and sent. OWNER is as `show NAME` prints it.
    """
    nodes = _Nodes(ctx.obj.app, prefix)
    if owner is not None:
        if nodes.is_quorum:
            raise click.UsageError(
                "--owner frees a permit of a limited key (lock_limit), and limits are not "
                "offered with redislock_urls: there is none on a quorum"
            )
        _free_permit(ctx, nodes, name, owner, yes)
        return
    key = LockKeys.for_name(name, nodes.prefix).lock
    found = nodes.each(lambda client: describe_lock(client, nodes.prefix, key))
    held = [row for row in found if isinstance(row, dict)]
    if not held:
        if nodes.failed(ctx, found):
            ctx.obj.echo(f"{_shown(name)}: not locked on the nodes that answered")
            ctx.exit(1)
        ctx.obj.echo(f"{_shown(name)}: not locked; nothing to release")
        if not nodes.is_quorum:
            semaphore = nodes.each(lambda client: describe_limited(client, nodes.prefix, name))
            if isinstance(semaphore[0], dict) and semaphore[0]["holders"]:
                ctx.obj.echo(
                    f"{_shown(name)} is a limited key with {semaphore[0]['holders']} holder(s): "
                    f"free one holder's permit with --owner OWNER (see: show NAME)"
                )
        return
    owners = ", ".join(_owner_text(o) for o in dict.fromkeys(o for r in held for o in r["owners"]))
    if not yes:
        click.confirm(f"Release '{_shown(name)}' held by {owners}?", abort=True)
    outcome = nodes.each(lambda client: RedisLock.force_release(client, name, prefix=nodes.prefix))
    released = [label for label, done in zip(nodes.labels, outcome) if done is True]
    log.warning(
        "redislock: %r force-released from the CLI on %s (was held by %s)",
        text(name),
        ", ".join(released) or "no node",
        owners,
    )
    if not nodes.is_quorum:
        if not nodes.failed(ctx, outcome):
            state = "released" if outcome[0] else "was already free"
            ctx.obj.echo(f"{_shown(name)}: {state} (was held by {owners})")
        else:
            ctx.exit(1)
        return
    for label, done in zip(nodes.labels, outcome):
        if isinstance(done, RedisError):
            state = f"unreachable ({type(done).__name__}: {done})"
        else:
            state = "released" if done else "not locked"
        ctx.obj.echo(f"{label}: {state}")
    ctx.obj.echo(
        f"{_shown(name)}: released on {len(released)} of {len(nodes.clients)} nodes "
        f"(was held by {owners})"
    )
    if any(isinstance(done, RedisError) for done in outcome):
        ctx.exit(1)


def _free_permit(ctx: click.Context, nodes: _Nodes, name: bytes, owner: bytes, yes: bool) -> None:
    """``release NAME --owner OWNER``: free OWNER's permit, handing it on (sem_handoff.lua,
    mode "all", as ``LockedRequest`` does for a task whose process died), then check and
    send the message of the parked task it was handed to."""
    app = ctx.obj.app
    client = nodes.clients[0]
    keys = SemaphoreKeys.for_name(name, nodes.prefix)
    try:
        permit = next((p for p in permits(client, keys) if p.owner == owner), None)
    except RedisError as exc:
        ctx.obj.error(f"{nodes.labels[0]}: unreachable ({type(exc).__name__}: {exc})")
        ctx.exit(1)
    if permit is None:
        ctx.obj.echo(f"{_shown(name)}: {_shown(owner)} holds no permit of it; nothing to release")
        return
    if not yes:
        click.confirm(
            f"Free the permit of {_shown(owner)} on limited key '{_shown(name)}' "
            f"({permit.holds} hold(s), token {permit.token}) and hand it on?",
            abort=True,
        )
    options = dataclasses.replace(settings_for(app).defaults, prefix=nodes.prefix)
    # The limit it was taken under: a waiter is granted the freed permit only below it
    # (1 if unknown: then only when nothing else is held). The run's own names are not
    # used (handoff() names the owner, which may be anything Redis holds).
    limit = min(permit.limit or 1, MAX_LIMIT)
    lock = TaskSemaphore(client, name, task_id="cli", options=options, limit=limit)
    # No queue list for the script to push a parked envelope to itself: its message comes
    # back here, to be checked and sent (send_handed_over), so the task can be named.
    lock.push_to = ("", "")
    lease = lease_ms(options.ttl, "redislock_ttl")
    try:
        handoff = lock.handoff(owner, "all", None)
        handed = lock.handed(handoff)
    except RedisError as exc:  # (refused: a script error, e.g. on a key of another type)
        state = "refused" if isinstance(exc, ResponseError) else "unreachable"
        ctx.obj.error(f"{nodes.labels[0]}: {state} ({type(exc).__name__}: {exc})")
        ctx.exit(1)
    freed = handoff.code == 0
    log.warning(
        "redislock: the permit of %r on limited key %r was freed from the CLI%s",
        text(owner),
        text(name),
        "" if freed else " (it was already gone)",
    )
    state = "freed" if freed else "was already free"
    ctx.obj.echo(f"{_shown(name)}: the permit of {_shown(owner)} {state}")
    if handed is None:
        return
    try:
        sent = send_handed_over(app, handed, lease, via="cli")
    except Exception as exc:  # the sweeper sends it again once the hand-over is stale
        ctx.obj.error(
            f"{_shown(name)}: handed on to parked task {_shown(handed.task_id)}, whose message "
            f"could not be sent ({type(exc).__name__}: {exc}); the workers' sweeper sends it"
        )
        ctx.exit(1)
    if sent is None:
        ctx.obj.echo(
            f"{_shown(name)}: the parked tasks it was handed to were refused (see the log)"
        )
    else:
        ctx.obj.echo(f"{_shown(name)}: handed on to parked task {_shown(sent.task_id)}")


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def stats(ctx: click.Context, prefix: str | None, as_json: bool) -> None:
    """Totals reported by LockedTask workers: acquires, contentions, re-queues, losses, waits.

    Limited tasks (lock_limit), per task name: runs that took a permit, deferrals (parked,
    re-queued), the wait for a permit; and, read from Redis now, the permits held and the
    tasks parked (by task name) in the limited keys (not on a quorum: no limits there).
    With redislock_urls, workers report to the first node, which this reads.
    """
    nodes = _Nodes(ctx.obj.app, prefix)
    client = nodes.clients[0]
    try:
        (found,) = read(client, ("hgetall", stats_key(nodes.prefix)))
        now = None if nodes.is_quorum else limits_now(client, nodes.prefix)
    except RedisError as exc:
        raise click.ClickException(
            f"{nodes.labels[0]}: unreachable ({type(exc).__name__}: {exc})"
        ) from None
    totals = metrics.numbers(found if isinstance(found, dict) else {})
    summary: dict[str, Any] = {name: int(totals.get(name, 0)) for name in metrics.COUNTERS}
    for label, fraction in (("wait_p50", 0.5), ("wait_p95", 0.95), ("wait_p99", 0.99)):
        summary[label] = metrics.percentile(totals, fraction)
    limits = metrics.limit_summary(totals)
    if now is not None:
        keys_in_use, held, parked = now
        for task, count in parked.items():
            limits.setdefault(task, _no_counts())["parked_now"] = count
        for row in limits.values():
            row.setdefault("parked_now", 0)
        summary["limited_keys_now"], summary["permits_held_now"] = keys_in_use, held
    summary["limits"] = dict(sorted(limits.items()))
    if as_json:
        ctx.obj.echo(json.dumps(summary, sort_keys=True))
        return
    for name, value in summary.items():
        if name in ("limits", "limited_keys_now", "permits_held_now"):
            continue
        shown = "-" if value is None else (f"<= {value}s" if name.startswith("wait") else value)
        ctx.obj.echo(f"{name:>12}: {shown}")
    if now is not None:
        ctx.obj.echo(
            f"limited keys (lock_limit): {summary['limited_keys_now']} in use, "
            f"{summary['permits_held_now']} permit(s) held now"
        )
    for task, row in summary["limits"].items():
        waits = " ".join(
            f"{label[5:]} {'-' if row[label] is None else f'<= {row[label]}s'}"
            for label in ("wait_p50", "wait_p95", "wait_p99")
        )
        parked_now = f", parked now {row['parked_now']}" if "parked_now" in row else ""
        ctx.obj.echo(
            f"  {_shown(task)}: taken {row['taken']}, deferred {row['deferred']} "
            f"(parked {row['parked']}, re-queued {row['requeued']}){parked_now}; wait {waits}"
        )


def _no_counts() -> dict[str, Any]:
    """A limited task's stats row before any worker reported on it."""
    row: dict[str, Any] = dict.fromkeys(("taken", "parked", "requeued", "deferred"), 0)
    row.update(dict.fromkeys(("wait_p50", "wait_p95", "wait_p99")))
    return row


# The live views (exporter, top) are commands of this group, kept in a module of their own.
from . import cli_ops as cli_ops  # noqa: E402
