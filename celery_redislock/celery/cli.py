"""``celery -A proj redislock``: see and release the locks of a Celery app.

::

    celery -A proj redislock ls [PATTERN] [--json]   held locks: name, owner, holds, TTL, token
    celery -A proj redislock show NAME [--json]      one lock, its parked tasks and waiters
    celery -A proj redislock release NAME [--yes]    force-release (asks first; logged)
    celery -A proj redislock stats [--json]          acquires, contentions, re-queues, losses, waits

It reads the app's ``redislock_*`` settings (Redis URL, prefix) and only ever uses
``SCAN`` (never ``KEYS``), so it is safe against a production Redis. With
``redislock_urls`` (the quorum lock) ``ls`` and ``show`` ask every node and say on how
many of them a lock is held, and ``release`` force-releases on every node and prints
what each one did. A node that cannot be reached is named, and the command exits 1;
a bad NAME, PATTERN or ``--prefix`` is a usage error (exit 2).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import click
from celery.bin.base import CeleryCommand, handle_preload_options
from redis.exceptions import RedisError

from .. import metrics
from .._core import (
    CHAIN_FIELD,
    FENCE_FIELD,
    GRANT_FIELD,
    LockKeys,
    name_from_lock_key,
    validate_prefix,
)
from .._errors import LockConfigurationError
from .._keyspace import lock_key_pattern, stats_key
from .._nodes import node_label
from .._quorum import quorum_of
from ..lock import RedisLock
from .clients import client_for, quorum_clients_for, settings_for

log = logging.getLogger(__name__)
T = TypeVar("T")


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value


def _shown(value: bytes | str) -> str:
    """``value`` for a terminal: control characters (an escape sequence in a lock name
    or owner read from Redis) are printed escaped, never sent as they are."""
    text = _text(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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


# ------------------------------------------------------------------ nodes


class _Nodes:
    """The Redis servers holding the app's locks: one, or the ``redislock_urls`` quorum."""

    def __init__(self, app: Any, prefix: str | None) -> None:
        try:
            settings = settings_for(app)
            clients = quorum_clients_for(app) if settings.urls else [client_for(app)]
        except LockConfigurationError as exc:
            raise click.ClickException(str(exc)) from None
        self.prefix: str = settings.defaults.prefix if prefix is None else prefix
        self.is_quorum = bool(settings.urls)
        self.clients = clients
        self.labels = [node_label(c) for c in clients]
        self.quorum = quorum_of(len(clients))

    def each(self, call: Callable[[Any], T]) -> list[T | RedisError]:
        """``call(client)`` on every node at once: its result, or the Redis error it raised."""

        def one(client: Any) -> T | RedisError:
            try:
                return call(client)
            except RedisError as exc:
                return exc

        if len(self.clients) == 1:
            return [one(self.clients[0])]
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            return list(pool.map(one, self.clients))

    def failed(self, ctx: click.Context, results: list[Any]) -> bool:
        """Say which nodes could not be reached (on stderr); True if any."""
        failures = [
            (label, r) for label, r in zip(self.labels, results) if isinstance(r, RedisError)
        ]
        for label, exc in failures:
            ctx.obj.error(f"{label}: unreachable ({type(exc).__name__}: {exc})")
        return bool(failures)


def _describe(client: Any, prefix: str, key: bytes) -> dict[str, Any] | None:
    name = name_from_lock_key(key, prefix)
    if name is None:
        return None
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(key)
    pipe.pttl(key)
    pipe.llen(LockKeys.for_lock(key).parked)
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


def _merged(rows: list[dict[str, Any] | None], labels: list[str], quorum: int) -> dict[str, Any]:
    """One lock as the quorum sees it, from each node's view (None: not held there).

    ``ttl`` is how long a majority of the nodes still holds it (as ``RedLock.remaining``),
    or, held on fewer, how long the longest-lived of them does; ``owners`` lists everyone
    holding it on some node, with their largest hold count.
    """
    held = [row for row in rows if row is not None]
    owners: dict[str, int] = {}
    for row in held:
        for owner, holds in row["owners"].items():
            owners[owner] = max(owners.get(owner, 0), holds)
    ttls = sorted((float("inf") if r["ttl"] is None else r["ttl"] for r in held), reverse=True)
    ttl = ttls[min(quorum, len(ttls)) - 1]
    return {
        "name": held[0]["name"],
        "owners": owners,
        "holds": sum(owners.values()),
        "ttl": None if ttl == float("inf") else ttl,
        "token": max(row["token"] for row in held),
        "parked": max(row["parked"] for row in held),
        "held_on": [label for label, row in zip(labels, rows) if row is not None],
        "quorum": quorum,
    }


def _owner_text(owner: str) -> str:
    # Thread/task owners are "<process id>:t<n>" / ":a<n>"; a Celery task's owner is its id.
    if ":" in owner and len(owner.split(":")[0]) == 32:
        return f"process {owner.split(':')[0][:8]}… {_shown(owner.split(':')[1])}"
    return f"task {_shown(owner)}"


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
    """List held locks whose name matches PATTERN (a glob; default: all)."""
    nodes = _Nodes(ctx.obj.app, prefix)
    # The prefix is matched literally: its glob characters are escaped.
    match = lock_key_pattern(nodes.prefix, pattern)

    def scan(client: Any) -> dict[str, dict[str, Any]]:
        found = {}
        for key in client.scan_iter(match=match, count=1000, _type="hash"):
            row = _describe(client, nodes.prefix, key)
            if row is not None:
                found[row["name"]] = row
        return found

    results = nodes.each(scan)
    views = [r if isinstance(r, dict) else {} for r in results]
    names = sorted({name for view in views for name in view})
    if nodes.is_quorum:
        rows = [_merged([view.get(n) for view in views], nodes.labels, nodes.quorum) for n in names]
    else:
        rows = [views[0][name] for name in names]
    if as_json:
        for row in rows:
            ctx.obj.echo(json.dumps(row, sort_keys=True))
    else:
        extra = f" {'NODES':>5}" if nodes.is_quorum else ""
        ctx.obj.echo(
            f"{'NAME':<40} {'OWNER':<48} {'HOLDS':>5} {'TTL':>8} {'TOKEN':>7} {'PARKED':>6}{extra}"
        )
        for row in rows:
            owner = ", ".join(_owner_text(o) for o in row["owners"]) or "-"
            ttl = "none" if row["ttl"] is None else f"{row['ttl']:.1f}s"
            held = f" {len(row['held_on'])}/{len(nodes.clients):<3}" if nodes.is_quorum else ""
            ctx.obj.echo(
                f"{_shown(row['name']):<40} {owner:<48} {row['holds']:>5} {ttl:>8} "
                f"{row['token']:>7} {row['parked']:>6}{held}"
            )
        ctx.obj.echo(f"{len(rows)} lock(s) held")
    if nodes.failed(ctx, results):
        ctx.exit(1)


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.argument("name", callback=_lock_name)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx: click.Context, prefix: str | None, name: bytes, as_json: bool) -> None:
    """Show one lock: owner, holds, TTL, token, parked tasks, waiting processes."""
    nodes = _Nodes(ctx.obj.app, prefix)
    keys = LockKeys.for_name(name, nodes.prefix)

    def look(client: Any) -> dict[str, Any]:
        found = _describe(client, nodes.prefix, keys.lock) or {
            "name": _text(name),
            "owners": {},
            "holds": 0,
        }
        found["waiting_processes"] = int(dict(client.pubsub_numsub(keys.channel))[keys.channel])
        found["parked_tasks"] = [_text(t) for t in client.lrange(keys.parked, 0, 20)]
        return found

    results = nodes.each(look)
    views = [r if isinstance(r, dict) else None for r in results]
    if nodes.is_quorum:
        held = [v if v is not None and v["owners"] else None for v in views]
        found: dict[str, Any] = (
            _merged(held, nodes.labels, nodes.quorum)
            if any(held)
            else {"name": _text(name), "owners": {}, "holds": 0, "held_on": []}
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
    if as_json and found:
        ctx.obj.echo(json.dumps(found, sort_keys=True))
    elif found:
        _print_lock(ctx, name, found, nodes)
    if nodes.failed(ctx, results):
        ctx.exit(1)


def _print_lock(ctx: click.Context, name: bytes, found: dict[str, Any], nodes: _Nodes) -> None:
    if nodes.is_quorum:
        ctx.obj.echo(
            f"{_shown(name)}: held on {len(found['held_on'])} of {len(nodes.clients)} nodes "
            f"(a majority is {nodes.quorum}): {'locked' if found['locked'] else 'not locked'}"
        )
    elif not found["owners"]:
        ctx.obj.echo(f"{_shown(name)}: not locked")
    for owner, holds in found["owners"].items():
        ctx.obj.echo(f"{'owner':>18}: {_owner_text(owner)} ({holds} hold(s))")
    for field in ("ttl", "token", "parked", "waiting_processes"):
        if field in found:
            ctx.obj.echo(f"{field:>18}: {found[field]}")
    for task_id in found["parked_tasks"]:
        ctx.obj.echo(f"{'parked':>18}: task {_shown(task_id)}")
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


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.argument("name", callback=_lock_name)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release(ctx: click.Context, prefix: str | None, name: bytes, yes: bool) -> None:
    """Force-release lock NAME whoever holds it (its holder learns it lost the lease).

    With redislock_urls, on every node; each node's outcome is printed (released, not
    locked, unreachable), and the exit status is 1 if a node could not be reached.
    """
    nodes = _Nodes(ctx.obj.app, prefix)
    key = LockKeys.for_name(name, nodes.prefix).lock
    found = nodes.each(lambda client: _describe(client, nodes.prefix, key))
    held = [row for row in found if isinstance(row, dict)]
    if not held:
        if nodes.failed(ctx, found):
            ctx.obj.echo(f"{_shown(name)}: not locked on the nodes that answered")
            ctx.exit(1)
        ctx.obj.echo(f"{_shown(name)}: not locked; nothing to release")
        return
    owners = ", ".join(_owner_text(o) for o in dict.fromkeys(o for r in held for o in r["owners"]))
    if not yes:
        click.confirm(f"Release '{_shown(name)}' held by {owners}?", abort=True)
    outcome = nodes.each(lambda client: RedisLock.force_release(client, name, prefix=nodes.prefix))
    released = [label for label, done in zip(nodes.labels, outcome) if done is True]
    log.warning(
        "redislock: %r force-released from the CLI on %s (was held by %s)",
        _text(name),
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


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def stats(ctx: click.Context, prefix: str | None, as_json: bool) -> None:
    """Totals reported by LockedTask workers: acquires, contentions, re-queues, losses, waits.

    With redislock_urls, workers report to the first node, which this reads.
    """
    nodes = _Nodes(ctx.obj.app, prefix)
    try:
        found = nodes.clients[0].hgetall(stats_key(nodes.prefix))
    except RedisError as exc:
        raise click.ClickException(
            f"{nodes.labels[0]}: unreachable ({type(exc).__name__}: {exc})"
        ) from None
    raw = {_text(k): float(v) for k, v in found.items()}
    summary: dict[str, Any] = {name: int(raw.get(name, 0)) for name in metrics.COUNTERS}
    for label, fraction in (("wait_p50", 0.5), ("wait_p95", 0.95), ("wait_p99", 0.99)):
        summary[label] = metrics.percentile(raw, fraction)
    if as_json:
        ctx.obj.echo(json.dumps(summary, sort_keys=True))
        return
    for name, value in summary.items():
        shown = "-" if value is None else (f"<= {value}s" if name.startswith("wait") else value)
        ctx.obj.echo(f"{name:>12}: {shown}")
