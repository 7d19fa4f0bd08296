"""At most N holders per name: :class:`RedisSemaphore` and :class:`AsyncRedisSemaphore`.

A semaphore is a lock's driver (``lock.SyncSingle``, ``aio.AsyncSingle``) given other
scripts, keys and a reply decoder: its acquire, wait, release, extend, loss and
watchdog are the lock's own code. What it adds (here, I/O-free, for both twins) is the
limit and where each holder's permit lives.

Guarantees with one Redis server (docs/guarantees.md, "Semaphores"):

* at most ``limit`` owners hold a permit while their leases are valid (the limit
  of the acquire that takes the permit; see :class:`RedisSemaphore`);
* each permit is a lease of its own, renewed by the batched watchdog; a holder that
  stops renewing loses its permit when its lease runs out, and no sooner;
* fencing tokens are strictly increasing per name, across all permits;
* a lost permit is reported (``lost``, ``on_lost``, ``ensure_held()``), never silent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from ._core import DEFAULT_PREFIX, LINE_MARGIN_MS, MAX_LIMIT, AsyncLeaseLost, LeaseLost, LockKeys
from ._errors import LockConfigurationError
from ._keyspace import SemaphoreKeys
from ._replies import decode_sem_acquire
from ._scripts import scripts_for
from ._single import SingleBase
from .aio import AsyncSingle
from .lock import SyncSingle


def validate_limit(limit: object) -> int:
    """``limit`` if it is an int from 1 to :data:`MAX_LIMIT` (not a bool); else
    :class:`LockConfigurationError` naming it."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise LockConfigurationError(
            f"limit must be an int from 1 to {MAX_LIMIT} (not a bool), got {limit!r}"
        )
    return limit


class SemaphoreBase(SingleBase[Any]):
    """What the two semaphores add to a lock's driver: the limit, the permits' keys."""

    #: A semaphore's waiters are granted a freed permit through the release channel
    #: (the owner id published), never directly: see docs/concepts.md.
    _direct_grants = False
    _decode_acquire = staticmethod(decode_sem_acquire)

    def __init__(
        self,
        client: Any,
        name: str | bytes,
        limit: int = 3,
        *,
        ttl: float = 30.0,
        owner: str | None = None,
        auto_renew: bool = True,
        blocking: bool = True,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        if isinstance(client, (list, tuple, set, frozenset)):
            raise LockConfigurationError(
                f"{type(self).__name__} takes one Redis client, got {len(client)} in a "
                f"{type(client).__name__}: a quorum semaphore (several masters, "
                f"redislock_urls) is not offered yet; use one Redis"
            )
        self.limit = validate_limit(limit)
        super().__init__(
            client,
            name,
            ttl=ttl,
            owner=owner,
            auto_renew=auto_renew,
            blocking=blocking,
            timeout=timeout,
            prefix=prefix,
        )
        self.semaphore_keys = SemaphoreKeys.for_name(name, self.prefix)
        #: The line, channel, fence and holders set, where a lock has its own.
        self.keys = self.semaphore_keys.line
        self._release_keys = tuple(self.keys.release_keys())
        self._release_tail = (self.limit, self.semaphore_keys.permits)

    def _attach(self, client: Any) -> None:
        self._scripts = cast(Any, scripts_for(client).semaphore)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} limit={self.limit!r} "
            f"ttl={self.ttl!r} owner={self.owner!r}>"
        )

    def _acquire_argv(self, owner: str, lease: int, line: bool) -> list[Any]:
        margin = LINE_MARGIN_MS if line else ""
        return [owner, lease, margin, self.limit, self.semaphore_keys.permits]

    def _hold_keys(self, owner: str) -> LockKeys:
        return dataclasses.replace(self.keys, lock=self.semaphore_keys.permit(owner))


class RedisSemaphore(SemaphoreBase, SyncSingle):
    """At most ``limit`` owners at once per name, on one Redis server; each holder's
    permit is reentrant, owner-checked, fenced and leased like a :class:`RedisLock`.

    Args:
        client: a ``redis.Redis`` client (one server: a list of clients, for a quorum,
            is refused with :class:`LockConfigurationError`: not offered yet).
        name: the semaphore's name (str or bytes, non-empty). A lock of the same name is
            another thing: they share nothing.
        limit: how many owners may hold a permit at once (an int >= 1). It is read at
            each acquire: callers may pass different limits for one name, and a permit
            is taken only while fewer than the acquiring caller's limit are held. A
            lowered limit takes effect as permits are released (none is taken back); a
            release hands its freed permit to the first waiter only while fewer than the
            releasing caller's limit are held.
        ttl, owner, auto_renew, blocking, timeout, prefix: as :class:`RedisLock`'s. An
            owner that holds a permit re-enters it (one more hold, same token).

    Methods and properties as :class:`RedisLock`'s: ``acquire``, ``release``,
    ``extend``, ``owned``, ``ensure_held``, ``lost``, ``token``, ``on_lost``, ``with``.
    Waiters are served first come, first served: a release hands its permit to the first
    waiter in line and wakes that waiter alone (its owner id on the release channel).
    """

    _signal_type = LeaseLost


class AsyncRedisSemaphore(SemaphoreBase, AsyncSingle):
    """:class:`RedisSemaphore` for ``redis.asyncio`` clients (owners as
    :class:`AsyncRedisLock`'s: the calling task by default)."""

    _signal_type = AsyncLeaseLost
