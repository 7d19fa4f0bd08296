"""``celery -A proj redislock top``: the hottest keys now, as a table that refreshes.

:func:`snapshot` ranks the keys of a :class:`~.survey.Survey` by the work waiting on
them (parked, deferred, waiting) and then their holders, and gives the totals; it is
what ``--json`` prints. :func:`table` draws one frame of it with `rich
<https://rich.readthedocs.io>`_ (the ``top`` extra), which ``top`` refreshes in place
(``rich.live``) every ``--interval`` seconds until interrupted. Names and owners read
from Redis are shown as text, never as terminal control sequences.
"""

from __future__ import annotations

from typing import Any

from .survey import Survey


def snapshot(state: Survey, count: int) -> dict[str, Any]:
    """The ``count`` hottest keys and the totals over every busy key, as plain data."""
    keys = state.hottest()
    totals: dict[str, Any] = {
        "keys": len(keys),
        "locks_held": sum(k.holders for k in keys if k.kind == "lock"),
        "permits_held": sum(k.holders for k in keys if k.kind == "limit"),
        "parked": sum(k.parked for k in keys),
        "deferred": sum(k.deferred for k in keys),
        "waiting": sum(k.waiting for k in keys),
    }
    waits = [k.oldest_wait for k in keys if k.oldest_wait is not None]
    totals["oldest_wait"] = max(waits, default=None)
    return {
        "now": state.now,
        "totals": totals,
        "keys": [key.as_dict() for key in keys[:count]],
    }


def _rich() -> Any:
    try:
        import rich.box
        import rich.table
        import rich.text
    except ImportError as exc:
        raise ImportError(
            "redislock top needs rich: pip install 'celery_redislock[top]' (or use --json)"
        ) from exc
    return rich


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 120:
        return f"{value / 60:.1f}m"
    return f"{value:.1f}s"


def _shown(value: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)


def table(found: dict[str, Any], *, title: str = "") -> Any:
    """One frame: a ``rich`` table of :func:`snapshot`'s keys, its totals as caption."""
    rich = _rich()
    totals = found["totals"]
    caption = (
        f"{totals['keys']} busy key(s): {totals['locks_held']} lock(s) held, "
        f"{totals['permits_held']} permit(s) held, {totals['parked']} parked, "
        f"{totals['deferred']} deferred, {totals['waiting']} waiting; "
        f"oldest wait {_seconds(totals['oldest_wait'])}"
    )
    waiting = any(key["waiting"] for key in found["keys"])  # (blocking waiters: rare)
    grid = rich.table.Table(
        title=title or None, caption=caption, expand=False, box=rich.box.SIMPLE_HEAD
    )
    columns = ["KEY", "KIND", "HELD", "PARKED", "DEFERRED"]
    columns += ["WAITING"] * waiting + ["OLDEST", "LEASE", "TASKS"]
    for header in columns:
        folds = header in ("KEY", "TASKS")  # (folded, never cut short)
        grid.add_column(
            header,
            justify="left" if folds or header == "KIND" else "right",
            no_wrap=not folds,
            overflow="fold" if folds else "ellipsis",
            min_width=8 if folds else len(header),
        )
    for key in found["keys"]:
        if key["kind"] == "rate":
            holders = "-"
            due = key["head_due"]
            lease = "-" if due is None else ("due" if due <= 0 else f"in {due:.1f}s")
            tasks = key["deferred_task"] or "?"
        else:
            holders = f"{key['holders']}/{key['limit'] or '?'}"
            lease = _seconds(key["ttl"]) if key["holders"] else "-"
            tasks = ", ".join(
                f"{task} {n}"
                for task, n in sorted(key["parked_by_task"].items(), key=lambda kv: -kv[1])
            )
        cells = [
            rich.text.Text(_shown(key["name"])),
            key["kind"],
            holders,
            str(key["parked"]),
            str(key["deferred"]),
            *([str(key["waiting"])] if waiting else []),
            _seconds(key["oldest_wait"]),
            lease,
            rich.text.Text(_shown(tasks) if tasks else "-"),
        ]
        grid.add_row(*cells)
    return grid
