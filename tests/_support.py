"""What every kind of test shares: the one ``wait_until``."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.05,
    *,
    what: str = "",
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``predicate`` until it returns something true (returned), or fail after
    ``timeout`` seconds naming ``what``. Exceptions of the types in ``ignore`` (a server
    still restarting, say) count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout}s: {what or predicate}")
        time.sleep(interval)


def blpop_within(client: Any, keys: list[str], timeout: float) -> Any:
    """BLPOP ``keys`` for up to ``timeout`` seconds (the reply, or None), in BLPOPs of 1 s:
    one BLPOP as long as ``timeout`` would need a socket timeout longer than it, and the
    tests' clients give up on a socket read after a few seconds (redis-py raises
    TimeoutError then, however long the BLPOP was meant to wait)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = client.blpop(keys, timeout=1)
        if reply is not None or time.monotonic() >= deadline:
            return reply
