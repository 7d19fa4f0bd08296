"""celery_redislock: a reentrant, fenced, self-renewing Redis lock for Celery users.

Core lock modules (``lock``, ``aio``, ``fencing``) never import Celery; the Celery
integration lives in :mod:`celery_redislock.celery` on top of them. Imported in a process
that has imported Celery already (``from celery import Celery`` first), it also loads the
``redislock_tasks`` setting's hook (:mod:`celery_redislock.celery.configured`).
"""

from __future__ import annotations

import sys

from ._core import DEFAULT_PREFIX, AsyncLeaseLost, LeaseLost, LockKeys
from ._errors import (
    LockConfigurationError,
    LockContendedError,
    LockForkedError,
    LockLostError,
    LockNotOwnedError,
    LockQuorumError,
    LockReplicationError,
    LockTimeoutError,
    RedisLockError,
)
from .aio import AsyncRedisLock
from .aio_redlock import AsyncRedLock
from .decorators import current_lock, locked
from .fencing import FencedResource
from .keys import KeyTemplate, LockKeyError
from .lock import RedisLock
from .ratelimit import AsyncRedisRateLimiter, RedisRateLimiter
from .redlock import RedLock
from .semaphore import AsyncRedisSemaphore, RedisSemaphore

__version__ = "0.1.0"

_CELERY_LAYER = {"LockedTask", "LockedRequest"}


def __getattr__(name: str) -> object:
    # The Celery layer is imported on first use only: the core never imports Celery.
    if name in _CELERY_LAYER:
        from .celery import (
            base,
            configured,  # noqa: F401  (the redislock_tasks setting)
            worker,
        )

        return getattr(base if name == "LockedTask" else worker, name)
    raise AttributeError(f"module 'celery_redislock' has no attribute {name!r}")


__all__ = [
    "AsyncLeaseLost",
    "AsyncRedLock",
    "AsyncRedisLock",
    "AsyncRedisRateLimiter",
    "AsyncRedisSemaphore",
    "DEFAULT_PREFIX",
    "FencedResource",
    "KeyTemplate",
    "LeaseLost",
    "LockConfigurationError",
    "LockContendedError",
    "LockForkedError",
    "LockKeyError",
    "LockKeys",
    "LockLostError",
    "LockNotOwnedError",
    "LockQuorumError",
    "LockReplicationError",
    "LockTimeoutError",
    "LockedRequest",
    "LockedTask",
    "RedLock",
    "RedisLock",
    "RedisLockError",
    "RedisRateLimiter",
    "RedisSemaphore",
    "current_lock",
    "locked",
    "__version__",
]

if "celery" in sys.modules:  # a Celery process: the redislock_tasks setting applies
    from .celery import configured as _configured  # noqa: F401
