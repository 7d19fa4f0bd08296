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

On Redis Cluster, :meth:`FencedResource.write`'s script touches two keys, the resource's
token key and ``key``, so both must hash to one slot: give the resource name a hash
tag and use the same tag in ``key`` (``FencedResource(client, "{ledger}")`` with
``key="{ledger}:balance"``). A ``key`` in another slot raises
:class:`LockConfigurationError` naming it, before any write.
"""

from __future__ import annotations

from typing import Any

from ._core import DEFAULT_PREFIX, validate_prefix
from ._errors import LockConfigurationError
from ._keyspace import resource_fence_key
from ._replies import decode_fence
from ._scripts import is_cluster, scripts_for


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
        self.key = resource_fence_key(validate_prefix(prefix), name)

    @staticmethod
    def _check(token: object) -> int:
        if not isinstance(token, int) or isinstance(token, bool) or token < 1:
            raise LockConfigurationError(
                f"token must be a positive int (a lock's fencing token), got {token!r}"
            )
        return token

    def admit(self, token: int) -> bool:
        """True if ``token`` is at least the highest admitted so far (and record it)."""
        return decode_fence(
            scripts_for(self.client).fence(keys=[self.key], args=[self._check(token)])
        )

    def _check_slot(self, key: str | bytes) -> None:
        """On a cluster, ``key`` must share the resource's slot (one script, one slot)."""
        if is_cluster(self.client) and self.client.keyslot(key) != self.client.keyslot(self.key):
            raise LockConfigurationError(
                f"key {key!r} is in another Redis Cluster slot than the fenced resource's "
                f"token key {self.key!r}; the check and the write must run in one script, "
                f"so give both the same hash tag, e.g. FencedResource(client, '{{ledger}}') "
                f"with key '{{ledger}}:balance'"
            )

    def write(self, token: int, key: str | bytes, value: Any) -> bool:
        """Atomically ``SET key value`` if ``token`` is admitted; False if it is stale.

        On Redis Cluster, ``key`` must hash to the resource's slot (a shared hash tag).
        """
        token = self._check(token)
        self._check_slot(key)
        return decode_fence(
            scripts_for(self.client).fence(keys=[self.key, key], args=[token, value])
        )

    async def admit_async(self, token: int) -> bool:
        """:meth:`admit` for a ``redis.asyncio`` client."""
        script = scripts_for(self.client).fence
        return decode_fence(await script(keys=[self.key], args=[self._check(token)]))

    async def write_async(self, token: int, key: str | bytes, value: Any) -> bool:
        """:meth:`write` for a ``redis.asyncio`` client."""
        token = self._check(token)
        self._check_slot(key)
        return decode_fence(
            await scripts_for(self.client).fence(keys=[self.key, key], args=[token, value])
        )

    def highest(self) -> int:
        """The highest token admitted so far (0: none)."""
        value = self.client.get(self.key)
        return int(value or 0)
