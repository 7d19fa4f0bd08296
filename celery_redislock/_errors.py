"""The exception tree of celery_redislock.

::

    RedisLockError                      root of every error raised by this package
    ├── LockConfigurationError          bad argument or setting (also a ValueError)
    ├── LockKeyError (keys.py)          a lock_key that cannot be rendered for a call (ValueError)
    ├── MalformedReplyError (_replies.py)  a script's reply of a shape it cannot send (ValueError)
    ├── LockTimeoutError                not acquired within the timeout (also a TimeoutError)
    │   └── LockQuorumError             a quorum lock could not reach a majority of its nodes
    ├── LockContendedError              a task (or locked call) found its lock held and gave up
    ├── LockReplicationError            fewer replicas than min_replicas acknowledged an acquire
    └── LockNotOwnedError               releasing/extending a hold the caller does not have
        ├── LockLostError               the caller had the hold, but its lease was lost
        └── LockForkedError             a hold inherited over fork used in the child

Connection problems are not wrapped: redis-py's own ``redis.exceptions.ConnectionError``
and ``TimeoutError`` propagate, so existing retry policies keep working.
"""

from __future__ import annotations


def _show(name: str | bytes) -> str:
    return repr(name) if isinstance(name, bytes) else repr(str(name))


class RedisLockError(Exception):
    """Root of every error raised by celery_redislock."""


class LockConfigurationError(RedisLockError, ValueError):
    """An argument or setting has a value that is not allowed.

    The message names the argument or setting and says what is allowed.
    """


class _NamedLockError(RedisLockError):
    # name/owner are keyword-optional so result backends can rebuild the error from its
    # message alone (Celery serialises exceptions as type + message).
    def __init__(
        self, message: str, *, name: str | bytes | None = None, owner: str | None = None
    ) -> None:
        super().__init__(message)
        self.name = name
        self.owner = owner

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


class LockTimeoutError(_NamedLockError, TimeoutError):
    """The lock was not acquired within the allowed time."""


class LockQuorumError(LockTimeoutError):
    """A quorum lock could not reach a majority of its Redis nodes.

    ``failures`` maps each node that failed (``host:port``) to what went wrong.
    Contention is not this error: a majority answered, and another owner held it.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | bytes | None = None,
        owner: str | None = None,
        failures: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, name=name, owner=owner)
        self.failures = dict(failures or {})


class LockContendedError(_NamedLockError):
    """The lock was held by someone else and the contention policy gave up.

    Raised by ``LockedTask`` with ``on_contention="raise"``, when re-queues are
    exhausted, and by :func:`celery_redislock.locked` calls that time out.
    """


class LockNotOwnedError(_NamedLockError):
    """The caller does not hold the lock it tried to release or extend."""


class LockLostError(LockNotOwnedError):
    """The caller held the lock, but its lease is gone.

    ``reason`` says why: ``"expired"`` (the key is gone: it timed out, Redis lost it, or
    an operator force-released it), ``"stolen"`` (another owner holds it now),
    ``"unreachable"`` (Redis could not be reached before the local validity deadline),
    ``"deadline"`` (the local validity deadline passed without a renewal) or
    ``"unrenewable"`` (the watchdog could not renew this hold at all, and dropped it
    alone: a lease out of range, or an unexpected error; logged).
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | bytes | None = None,
        owner: str | None = None,
        reason: str = "expired",
    ) -> None:
        super().__init__(message, name=name, owner=owner)
        self.reason = reason


class LockForkedError(LockNotOwnedError):
    """A hold taken in a parent process was used in a forked child.

    A child neither renews nor releases its parent's holds; create the lock's work
    in the child, or release in the parent.
    """


class LockReplicationError(_NamedLockError):
    """Fewer replicas than ``min_replicas`` acknowledged an acquire (or extend) in time.

    The acquire gave back what it had taken before raising (owner-checked), so no lock
    is left behind. ``min_replicas``, ``acknowledged`` and ``timeout`` (seconds) say
    what was asked and what happened.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | bytes | None = None,
        owner: str | None = None,
        min_replicas: int = 0,
        acknowledged: int = 0,
        timeout: float = 0.0,
    ) -> None:
        super().__init__(message, name=name, owner=owner)
        self.min_replicas = min_replicas
        self.acknowledged = acknowledged
        self.timeout = timeout


def _rebuild(
    cls: type[RedisLockError], args: tuple[object, ...], state: dict[str, object]
) -> RedisLockError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


__all__ = [
    "LockConfigurationError",
    "LockContendedError",
    "LockForkedError",
    "LockLostError",
    "LockNotOwnedError",
    "LockReplicationError",
    "LockQuorumError",
    "LockTimeoutError",
    "RedisLockError",
]
