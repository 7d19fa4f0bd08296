"""``celery -A proj redislock exporter`` and ``redislock top``: watching the keys live.

::

    celery -A proj redislock exporter [--port 9818] [--addr 0.0.0.0] [--interval 5] [--once]
                                            Prometheus series for the whole deployment
    celery -A proj redislock top [--interval 2] [--count 20] [--once] [--json]
                                            the hottest keys, refreshing like top

Both use the app's ``redislock_*`` settings, as the other sub-commands do
(:mod:`.cli`), and only read. ``exporter`` is the one process that reads the gauges of
what is parked, deferred and held now (:mod:`.exporter`); ``top`` reads the same survey
(:mod:`.survey`) and draws it with rich (:mod:`.top`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
from celery.bin.base import CeleryCommand
from redis.exceptions import RedisError

from .cli import prefix_option, redislock
from .cli_nodes import _Nodes
from .exporter import DEFAULT_PORT, RedisLockCollector, exposition, serve
from .survey import survey
from .top import snapshot, table


def _positive(_ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not value > 0:
        raise click.BadParameter("must be more than 0", param=param)
    return value


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--interval",
    type=float,
    default=5.0,
    show_default=True,
    callback=_positive,
    help="Read Redis at most once per this many seconds (scrapes between are served the "
    "last reading).",
)
@click.option("--once", is_flag=True, help="Print one reading (text format) and exit.")
@click.pass_context
def exporter(
    ctx: click.Context, prefix: str | None, port: int, addr: str, interval: float, once: bool
) -> None:
    """Serve every celery_redislock_* series on /metrics for Prometheus: the workers'
    counts (per task name and queue) and what is parked, deferred and held now. Run
    one per deployment (docs/metrics.md)."""
    nodes = _Nodes(ctx.obj.app, prefix)
    try:
        collector = RedisLockCollector(
            nodes.clients[0], nodes.prefix, interval=interval, gauges=not nodes.is_quorum
        )
        if once:
            ctx.obj.echo(exposition(collector).rstrip("\n"))
            return
        serve(collector, port, addr)
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    ctx.obj.echo(f"redislock exporter: serving http://{addr}:{port}/metrics (Ctrl-C stops)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return


@redislock.command(cls=CeleryCommand)
@prefix_option
@click.option(
    "--interval", type=float, default=2.0, show_default=True, callback=_positive,
    help="Seconds between refreshes.",
)  # fmt: skip
@click.option("--count", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--once", is_flag=True, help="Draw one frame and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@click.pass_context
def top(
    ctx: click.Context,
    prefix: str | None,
    interval: float,
    count: int,
    once: bool,
    as_json: bool,
) -> None:
    """The hottest keys now, refreshing like top: holders (permits in use out of the
    limit), parked, deferred and waiting runs, the oldest wait, the lease left, and the
    tasks parked on each. Not on a quorum (redislock_urls)."""
    nodes = _Nodes(ctx.obj.app, prefix)
    if nodes.is_quorum:
        raise click.UsageError("top reads one Redis: it is not offered with redislock_urls")
    client = nodes.clients[0]

    def frame() -> dict[str, Any]:
        try:
            return snapshot(survey(client, nodes.prefix), count)
        except RedisError as exc:
            raise click.ClickException(
                f"{nodes.labels[0]}: unreachable ({type(exc).__name__}: {exc})"
            ) from None

    if as_json:
        ctx.obj.echo(json.dumps(frame(), sort_keys=True))
        return
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise click.ClickException(
            "redislock top needs rich: pip install 'celery_redislock[top]' (or use --json)"
        ) from None
    console = Console()
    title = f"redislock top: {nodes.labels[0]} prefix {nodes.prefix!r}"
    if once:
        console.print(table(frame(), title=title))
        return
    try:
        with Live(table(frame(), title=title), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(table(frame(), title=title), refresh=True)
    except KeyboardInterrupt:
        return
