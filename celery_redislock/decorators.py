"""``locked``: the same key language as ``LockedTask``, for plain functions outside Celery.

::

    from celery_redislock import locked

    @locked(client, "account:{account_id}", ttl=30, timeout=10)
    def settle(account_id, amount): ...

    @locked(async_client, "user:{user.id}", on_timeout="skip")
    async def rebuild(user): ...            # coroutine functions get AsyncRedisLock

Each call renders the key from its arguments (see :mod:`celery_redislock.keys`), takes the
lock (waiting up to ``timeout``, woken by the holder's release), runs the function and
releases the lock however the call ends. The lock's owner is the calling thread (or
asyncio task). Inside the call, :func:`current_lock` returns the lock (for its fencing
token and ``ensure_held()``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import time
from typing import Any, Callable, TypeVar, cast

from ._core import DEFAULT_PREFIX, lease_ms, optional_seconds, seconds, validate_prefix
from ._errors import LockConfigurationError, LockContendedError
from .aio import AsyncRedisLock
from .keys import KeyTemplate
from .lock import RedisLock

F = TypeVar("F", bound=Callable[..., Any])
ON_TIMEOUT = ("raise", "skip")

_current: contextvars.ContextVar[RedisLock | AsyncRedisLock | None] = contextvars.ContextVar(
    "celery_redislock_current_lock", default=None
)


def current_lock() -> RedisLock | AsyncRedisLock | None:
    """The lock held by the innermost ``@locked`` call running in this context, if any."""
    return _current.get()


def locked(
    client: Any,
    key: str | Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None,
    *,
    ttl: float = 30.0,
    timeout: float | None = None,
    blocking: bool = True,
    retries: int = 0,
    retry_delay: float = 0.1,
    on_timeout: str = "raise",
    prefix: str = DEFAULT_PREFIX,
    hashed: bool = False,
) -> Callable[[F], F]:
    """Decorate a function (or coroutine function) to run under a Redis lock.

    Args:
        client: ``redis.Redis`` for plain functions, ``redis.asyncio.Redis`` for coroutines.
        key: template over the function's parameters, a callable ``(args, kwargs) -> str``,
            or None for one lock per function.
        ttl: lease in seconds, renewed while the call runs.
        timeout: how long one attempt waits for the lock (None: forever).
        blocking: False makes each attempt a single try.
        retries: further attempts after a timed-out one, ``retry_delay`` seconds apart.
        on_timeout: ``"raise"`` (:class:`LockContendedError`) or ``"skip"`` (return None
            without calling).
        prefix: key prefix; hashed: hide argument values in key names.

    Every argument is checked here, at decoration time.
    """
    lease_ms(ttl, "ttl")
    optional_seconds(timeout, "timeout")
    seconds(retry_delay, "retry_delay", low=0.0)
    validate_prefix(prefix)
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise LockConfigurationError(f"retries must be an int >= 0, got {retries!r}")
    if on_timeout not in ON_TIMEOUT:
        raise LockConfigurationError(f"on_timeout must be 'raise' or 'skip', got {on_timeout!r}")
    if not isinstance(blocking, bool):
        raise LockConfigurationError(f"blocking must be True or False, got {blocking!r}")

    def decorate(func: F) -> F:
        name = f"{func.__module__}.{func.__qualname__}"
        template = KeyTemplate(key, func, owner_name=name, option="key", hashed=hashed)

        def contended(lock_name: str) -> None:
            if on_timeout == "raise":
                raise LockContendedError(
                    f"{name}: lock {lock_name!r} is held by another owner "
                    f"(waited {timeout}s x {retries + 1} attempts)",
                    name=lock_name,
                )

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                lock_name = template.render(args, kwargs)
                lock = AsyncRedisLock(client, lock_name, ttl=ttl, prefix=prefix)
                for attempt in range(retries + 1):
                    if await lock.acquire(blocking, timeout):
                        break
                    if attempt < retries:
                        await asyncio.sleep(retry_delay)
                else:
                    contended(lock_name)
                    return None
                token = _current.set(lock)
                try:
                    return await func(*args, **kwargs)
                finally:
                    _current.reset(token)
                    await lock.release()

            return cast(F, run_async)

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            lock_name = template.render(args, kwargs)
            lock = RedisLock(client, lock_name, ttl=ttl, prefix=prefix)
            for attempt in range(retries + 1):
                if lock.acquire(blocking, timeout):
                    break
                if attempt < retries:
                    time.sleep(retry_delay)
            else:
                contended(lock_name)
                return None
            token = _current.set(lock)
            try:
                return func(*args, **kwargs)
            finally:
                _current.reset(token)
                lock.release()

        return cast(F, run)

    return decorate
