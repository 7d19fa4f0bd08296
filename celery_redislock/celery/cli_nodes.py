"""The Redis servers ``celery -A proj redislock`` asks: one, or the ``redislock_urls``
quorum, every node at once; and one lock as the quorum sees it from each node's view."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import click
from redis.exceptions import RedisError

from .._errors import LockConfigurationError
from .._nodes import node_label
from .._quorum import quorum_of
from .clients import client_for, quorum_clients_for, settings_for

T = TypeVar("T")


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
        "kind": "lock",
        "name": held[0]["name"],
        "owners": owners,
        "holds": sum(owners.values()),
        "ttl": None if ttl == float("inf") else ttl,
        "token": max(row["token"] for row in held),
        "parked": max(row["parked"] for row in held),
        "held_on": [label for label, row in zip(labels, rows) if row is not None],
        "quorum": quorum,
    }
