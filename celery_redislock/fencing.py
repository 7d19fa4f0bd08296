"""Fencing: how a protected resource rejects a holder whose lease is gone.

A lease can expire while its holder is paused (GC, SIGSTOP, a slow disk); when it
wakes it still believes it holds the lock. Every first acquisition returns a
strictly increasing ``lock.token``; a resource that remembers the highest token it
has admitted and refuses smaller ones makes such a stale holder harmless.

For data in Redis use :class:`FencedResource` (one atomic script). For SQL, keep the
token beside the row and make the write conditional::

    UPDATE accounts SET balance = :balance, fence_token = :token
     WHERE id = :id AND fence_token <= :token;
    -- 0 rows updated: a newer holder has written; abort.
"""

from __future__ import annotations

from typing import Any

from ._core import DEFAULT_PREFIX, validate_prefix
from ._errors import LockConfigurationError
from ._scripts import scripts_for


class FencedResource:
    """A Redis-held resource that admits only the newest holder's fencing token.

    Args:
        client: redis-py client (sync). For asyncio, await :meth:`admit_async`.
        name: the resource's name; its highest token lives at ``<prefix>fence:<name>``.
    """

    def __init__(self, client: Any, name: str, *, prefix: str = DEFAULT_PREFIX) -> None:
        if not isinstance(name, str) or not name:
            raise LockConfigurationError(f"name must be a non-empty str, got {name!r}")
        self.client = client
        self.name = name
        self.key = f"{validate_prefix(prefix)}fence:{name}"

    @staticmethod
    def _check(token: object) -> int:
        if not isinstance(token, int) or isinstance(token, bool) or token < 1:
            raise LockConfigurationError(
                f"token must be a positive int (a lock's fencing token), got {token!r}"
            )
        return token

    def admit(self, token: int) -> bool:
        """True if ``token`` is at least the highest admitted so far (and record it)."""
        return bool(scripts_for(self.client).fence(keys=[self.key], args=[self._check(token)]))

    def write(self, token: int, key: str | bytes, value: Any) -> bool:
        """Atomically ``SET key value`` if ``token`` is admitted; False if it is stale."""
        return bool(
            scripts_for(self.client).fence(keys=[self.key, key], args=[self._check(token), value])
        )

    async def admit_async(self, token: int) -> bool:
        """:meth:`admit` for a ``redis.asyncio`` client."""
        script = scripts_for(self.client).fence
        return bool(await script(keys=[self.key], args=[self._check(token)]))

    async def write_async(self, token: int, key: str | bytes, value: Any) -> bool:
        """:meth:`write` for a ``redis.asyncio`` client."""
        return bool(
            await scripts_for(self.client).fence(
                keys=[self.key, key], args=[self._check(token), value]
            )
        )

    def highest(self) -> int:
        """The highest token admitted so far (0: none)."""
        value = self.client.get(self.key)
        return int(value or 0)
