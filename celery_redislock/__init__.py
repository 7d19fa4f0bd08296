"""celery_redislock: a reentrant, fenced, self-renewing Redis lock for Celery users.

Core lock modules (``lock``, ``aio``, ``fencing``) never import Celery; the Celery
integration lives in :mod:`celery_redislock.task` on top of them.
"""

from __future__ import annotations

from ._core import DEFAULT_PREFIX, AsyncLeaseLost, LeaseLost, LockKeys
from ._errors import (
    LockConfigurationError,
    LockForkedError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
    RedisLockError,
)
from .aio import AsyncRedisLock
from .fencing import FencedResource
from .lock import RedisLock

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PREFIX",
    "AsyncLeaseLost",
    "AsyncRedisLock",
    "FencedResource",
    "LeaseLost",
    "LockConfigurationError",
    "LockForkedError",
    "LockKeys",
    "LockLostError",
    "LockNotOwnedError",
    "LockTimeoutError",
    "RedisLock",
    "RedisLockError",
    "__version__",
]
