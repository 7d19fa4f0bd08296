"""``celery -A proj redislock``: see and release the locks of a Celery app.

::

    celery -A proj redislock ls [PATTERN] [--json]   held locks: name, owner, holds, TTL, token
    celery -A proj redislock show NAME [--json]      one lock, its parked tasks and waiters
    celery -A proj redislock release NAME [--yes]    force-release (asks first; logged)
    celery -A proj redislock stats [--json]          acquires, contentions, re-queues, losses, waits

It reads the app's ``redislock_*`` settings (Redis URL, prefix) and only ever uses
``SCAN`` (never ``KEYS``), so it is safe against a production Redis.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from . import metrics
from ._core import CHAIN_FIELD, FENCE_FIELD, GRANT_FIELD, LockKeys, name_from_lock_key
from .lock import RedisLock
from .task import client_for, settings_for

log = logging.getLogger(__name__)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def _describe(client: Any, prefix: str, key: bytes) -> dict[str, Any] | None:
    name = name_from_lock_key(key, prefix)
    if name is None:
        return None
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(key)
    pipe.pttl(key)
    pipe.llen(key + b":parked")
    fields, pttl, parked = pipe.execute()
    if not fields:
        return None
    reserved = (FENCE_FIELD.encode(), GRANT_FIELD.encode(), CHAIN_FIELD.encode())
    # Hold counts only: reserved fields, and any a later version may add, are skipped.
    owners = {_text(k): int(v) for k, v in fields.items() if k not in reserved and v.isdigit()}
    return {
        "name": _text(name),
        "owners": owners,
        "holds": sum(owners.values()),
        "ttl": None if pttl < 0 else pttl / 1000.0,
        "token": int(fields.get(FENCE_FIELD.encode(), 0)),
        "parked": int(parked),
    }


def _owner_text(owner: str) -> str:
    # Thread/task owners are "<process id>:t<n>" / ":a<n>"; a Celery task's owner is its id.
    if ":" in owner and len(owner.split(":")[0]) == 32:
        return f"process {owner.split(':')[0][:8]}… {owner.split(':')[1]}"
    return f"task {owner}"


@click.group(name="redislock")
@click.pass_context
@handle_preload_options
def redislock(ctx: click.Context) -> None:
    """Inspect and release celery_redislock locks (uses the app's redislock_* settings)."""


@redislock.command(cls=CeleryCommand, name="ls")
@click.option("--prefix", default=None, help="Key prefix (default: the app's redislock_prefix).")
@click.argument("pattern", default="*")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of a table.")
@click.pass_context
def list_locks(ctx: click.Context, prefix: str | None, pattern: str, as_json: bool) -> None:
    """List held locks whose name matches PATTERN (a glob; default: all)."""
    app = ctx.obj.app
    prefix = prefix or settings_for(app).defaults.prefix
    client = client_for(app)
    rows = []
    for key in client.scan_iter(match=f"{prefix}{{{pattern}}}", count=1000, _type="hash"):
        found = _describe(client, prefix, key)
        if found is not None:
            rows.append(found)
    rows.sort(key=lambda row: row["name"])
    if as_json:
        for row in rows:
            ctx.obj.echo(json.dumps(row, sort_keys=True))
        return
    ctx.obj.echo(f"{'NAME':<40} {'OWNER':<48} {'HOLDS':>5} {'TTL':>8} {'TOKEN':>7} {'PARKED':>6}")
    for row in rows:
        owner = ", ".join(_owner_text(o) for o in row["owners"]) or "-"
        ttl = "none" if row["ttl"] is None else f"{row['ttl']:.1f}s"
        ctx.obj.echo(
            f"{row['name']:<40} {owner:<48} {row['holds']:>5} {ttl:>8} {row['token']:>7} "
            f"{row['parked']:>6}"
        )
    ctx.obj.echo(f"{len(rows)} lock(s) held")


@redislock.command(cls=CeleryCommand)
@click.option("--prefix", default=None, help="Key prefix (default: the app's redislock_prefix).")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx: click.Context, prefix: str | None, name: str, as_json: bool) -> None:
    """Show one lock: owner, holds, TTL, token, parked tasks, waiting processes."""
    app = ctx.obj.app
    prefix = prefix or settings_for(app).defaults.prefix
    client = client_for(app)
    keys = LockKeys.for_name(name, prefix)
    found = _describe(client, prefix, keys.lock) or {"name": name, "owners": {}, "holds": 0}
    found["waiting_processes"] = int(dict(client.pubsub_numsub(keys.channel))[keys.channel])
    found["parked_tasks"] = [_text(t) for t in client.lrange(keys.lock + b":parked", 0, 20)]
    if as_json:
        ctx.obj.echo(json.dumps(found, sort_keys=True))
        return
    if not found["owners"]:
        ctx.obj.echo(f"{name}: not locked")
    for owner, holds in found["owners"].items():
        ctx.obj.echo(f"{'owner':>18}: {_owner_text(owner)} ({holds} hold(s))")
    for field in ("ttl", "token", "parked", "waiting_processes"):
        if field in found:
            ctx.obj.echo(f"{field:>18}: {found[field]}")
    for task_id in found["parked_tasks"]:
        ctx.obj.echo(f"{'parked':>18}: task {task_id}")


@redislock.command(cls=CeleryCommand)
@click.option("--prefix", default=None, help="Key prefix (default: the app's redislock_prefix).")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release(ctx: click.Context, prefix: str | None, name: str, yes: bool) -> None:
    """Force-release lock NAME whoever holds it (its holder learns it lost the lease)."""
    app = ctx.obj.app
    prefix = prefix or settings_for(app).defaults.prefix
    client = client_for(app)
    found = _describe(client, prefix, LockKeys.for_name(name, prefix).lock)
    if found is None:
        ctx.obj.echo(f"{name}: not locked; nothing to release")
        return
    owners = ", ".join(_owner_text(o) for o in found["owners"])
    if not yes:
        click.confirm(f"Release {name!r} held by {owners}?", abort=True)
    released = RedisLock.force_release(client, name, prefix=prefix)
    log.warning("redislock: %r force-released from the CLI (was held by %s)", name, owners)
    ctx.obj.echo(f"{name}: {'released' if released else 'was already free'} (was held by {owners})")


@redislock.command(cls=CeleryCommand)
@click.option("--prefix", default=None, help="Key prefix (default: the app's redislock_prefix).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def stats(ctx: click.Context, prefix: str | None, as_json: bool) -> None:
    """Totals reported by LockedTask workers: acquires, contentions, re-queues, losses, waits."""
    app = ctx.obj.app
    prefix = prefix or settings_for(app).defaults.prefix
    raw = {_text(k): float(v) for k, v in client_for(app).hgetall(prefix + "stats").items()}
    summary: dict[str, Any] = {name: int(raw.get(name, 0)) for name in metrics.COUNTERS}
    for label, fraction in (("wait_p50", 0.5), ("wait_p95", 0.95), ("wait_p99", 0.99)):
        summary[label] = metrics.percentile(raw, fraction)
    if as_json:
        ctx.obj.echo(json.dumps(summary, sort_keys=True))
        return
    for name, value in summary.items():
        shown = "-" if value is None else (f"<= {value}s" if name.startswith("wait") else value)
        ctx.obj.echo(f"{name:>12}: {shown}")
