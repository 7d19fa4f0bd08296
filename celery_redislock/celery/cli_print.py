"""How ``celery -A proj redislock`` prints what Redis holds: names and owners escaped
for a terminal, and the ``show`` views of a lock, a limited key and a rate key (the
commands themselves are in :mod:`.cli`)."""

from __future__ import annotations

from typing import Any

import click

from .cli_nodes import _Nodes
from .inspection import text


def _shown(value: bytes | str) -> str:
    """``value`` for a terminal: control characters (an escape sequence in a lock name
    or owner read from Redis) are printed escaped, never sent as they are."""
    as_text = text(value)
    if as_text.isprintable():
        return as_text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in as_text)


def _owner_text(owner: str) -> str:
    # Thread/task owners are "<process id>:t<n>" / ":a<n>"; a Celery task's owner is its id.
    if ":" in owner and len(owner.split(":")[0]) == 32:
        return f"process {owner.split(':')[0][:8]}… {_shown(owner.split(':')[1])}"
    return f"task {_shown(owner)}"


def _print_lock(
    ctx: click.Context, name: bytes, found: dict[str, Any], nodes: _Nodes, *, headed: bool
) -> None:
    if nodes.is_quorum:
        ctx.obj.echo(
            f"{_shown(name)}: held on {len(found['held_on'])} of {len(nodes.clients)} nodes "
            f"(a majority is {nodes.quorum}): {'locked' if found['locked'] else 'not locked'}"
        )
    elif not found["owners"]:
        ctx.obj.echo(
            f"{_shown(name)} (lock): not locked" if headed else f"{_shown(name)}: not locked"
        )
    elif headed:
        ctx.obj.echo(f"{_shown(name)} (lock): locked")
    for owner, holds in found["owners"].items():
        ctx.obj.echo(f"{'owner':>18}: {_owner_text(owner)} ({holds} hold(s))")
    for field in ("ttl", "token", "parked", "waiting_processes"):
        if field in found:
            ctx.obj.echo(f"{field:>18}: {found[field]}")
    for task_id in found["parked_tasks"]:
        ctx.obj.echo(f"{'parked':>18}: task {_shown(task_id)}")
    _print_latest(ctx, found)
    for label, view in found.get("nodes", {}).items():
        if "error" in view:
            state = "unreachable"
        elif view["owners"]:
            owners = ", ".join(_owner_text(o) for o in view["owners"])
            ttl = "none" if view["ttl"] is None else f"{view['ttl']:.1f}s"
            state = f"held by {owners}, ttl {ttl}, token {view['token']}"
        else:
            state = "not locked"
        ctx.obj.echo(f"{'node ' + label:>18}: {state}")


def _print_semaphore(ctx: click.Context, name: bytes, found: dict[str, Any]) -> None:
    limit = found["limit"]
    ctx.obj.echo(
        f"{_shown(name)} (limited key): {found['holders']} of {limit or '?'} permit(s) held"
    )
    for permit in found["permits"]:
        ttl = "no expiry" if permit["ttl"] is None else f"lease left {permit['ttl']:.1f}s"
        holds = f"{permit['holds']} hold(s)"
        if not permit["holds"]:
            holds += ": handed over, not taken up yet"
        token = "-" if permit["token"] is None else permit["token"]
        ctx.obj.echo(f"{'holder':>18}: {_shown(permit['owner'])} ({holds}), {ttl}, token {token}")
    ctx.obj.echo(f"{'limit':>18}: {limit or 'unknown'}")
    ctx.obj.echo(f"{'parked':>18}: {found['parked']}")
    for task in found["parked_tasks"]:
        ctx.obj.echo(f"{'parked':>18}: task {_shown(task['task'])} (limit {task['limit'] or '?'})")
    ctx.obj.echo(f"{'waiting':>18}: {found['waiting']}")
    for owner in found["waiters"]:
        ctx.obj.echo(f"{'waiter':>18}: {_shown(owner)}")
    ctx.obj.echo(f"{'waiting_processes':>18}: {found['waiting_processes']}")
    _print_latest(ctx, found)


def _print_latest(ctx: click.Context, found: dict[str, Any]) -> None:
    """A last-call-wins key's pending call and newest started call, if any."""
    latest = found.get("latest") or {}
    pending = latest.get("pending")
    if pending:
        due = pending["due_in"]
        when = "waits for the lock" if due is None else f"due in {due:.3f}s (debounce)"
        ctx.obj.echo(f"{'pending call':>18}: task {_shown(pending['task'])}, {when}")
    started = latest.get("newest_started")
    if started:
        ctx.obj.echo(f"{'newest started':>18}: task {_shown(started['task'])}")


def _due(seconds: float | None) -> str:
    """When a deferred head is due, for a table cell."""
    if seconds is None:
        return "?"
    return "due" if seconds <= 0 else f"{seconds:.1f}s"


def _print_rate(ctx: click.Context, name: bytes, found: dict[str, Any]) -> None:
    ctx.obj.echo(f"{_shown(name)} (rate key): {found['deferred']} run(s) deferred")
    for limit in found["limits"]:
        period = f"{limit['period']:g}s"
        rate = f"{limit['count']}/{period}" if limit["count"] else f"?/{period}"
        if limit["next_free"] is None:
            slot = "unreadable (read as full: the burst just spent)"
        elif limit["next_free"] == 0:
            slot = "now"
        else:
            slot = f"in {limit['next_free']:.3f}s"
        ctx.obj.echo(f"{'limit ' + rate:>18}: next free slot {slot}")
    ctx.obj.echo(f"{'deferred':>18}: {found['deferred']}")
    if found["deferred"] or found["head_due"] is not None:
        due = found["head_due"]
        if due is None:
            when = "not scheduled (the drainers' registry does not list it)"
        else:
            when = f"due in {due:.3f}s" if due > 0 else f"due now (overdue {-due:.3f}s)"
        task = found["head_task"]
        named = f"task {_shown(task)}" if task else "unreadable entry"
        if found["head_task_name"]:
            named += f" ({_shown(found['head_task_name'])})"
        ctx.obj.echo(f"{'head':>18}: {named}, {when}")
