"""What the two locks on one Redis share: :class:`RedisLock` and :class:`AsyncRedisLock`.

Their constructor, what an acquire or extend reply means for them, and the
``min_replicas`` check (a ``WAIT`` in the same round trip as the script). All of it
I/O-free: :mod:`celery_redislock.lock` and :mod:`celery_redislock.aio` only send the
commands and pass the replies here, so the twins decide alike.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from redis.exceptions import NoScriptError

from ._base import LockBase, Signal
from ._core import (
    AcquireReply,
    Hold,
    LockKeys,
    OwnerFinished,
    OwnerRunning,
    abandoned_waits,
    decode_acquire,
    validate_prefix,
    wait_bound,
)
from ._errors import LockReplicationError
from ._renewal import require_replicas
from ._scripts import scripts_for

log = logging.getLogger(__name__)


class SingleBase(LockBase[Signal]):
    """State and decisions of a lock on one Redis (sync or asyncio)."""

    #: How an acquire script's reply is read (a semaphore's has a decoder of its own).
    _decode_acquire = staticmethod(decode_acquire)
    _fenced_renewals = True
    #: Whether this lock's last blocked acquire was refused at first: a hint, shared by
    #: whoever uses the lock object. The next blocked acquire then joins the line with its
    #: first attempt (it would most likely be refused alone): one round trip less per
    #: contended acquire. An attempt that finds the lock free after all clears it.
    _expect_wait = False

    def _attach(self, client: Any) -> None:
        self._scripts = scripts_for(client)

    # -- acquire ---------------------------------------------------------------

    @property
    def _first_in_line(self) -> bool:
        """Whether a blocked acquire of this lock may join the line with its first attempt
        (:attr:`_expect_wait`): a plain lock's (acquire.lua's mode "first"), not a
        semaphore's or a task's, whose attempts give their own modes (``_acquire_argv``)."""
        return type(self)._acquire_argv is LockBase._acquire_argv

    def _joins_line_first(self, blocking: bool, owner: str) -> bool:
        """Whether this blocked acquire joins the line with its first attempt (see
        :attr:`_expect_wait`): not while a wait of this owner whose leave failed may still
        be granted the lock (that attempt names the abandoned wait, ``_with_wake``)."""
        if not (blocking and self._expect_wait):
            return False
        return not abandoned_waits or abandoned_waits.get(self.keys.lock, owner) is None

    def _answered_in_line(self, owner: str, first: bool, taken: bool) -> None:
        """After an attempt in line: the hint kept up to date, and a refused first attempt
        (a blocked acquire that joined the line at once) counted as the acquire's
        contention, as a refused try alone is."""
        if taken:
            if first:  # free after all: the next acquire tries alone
                self._expect_wait = False
            return
        if first:
            self._contended(owner)
        self._expect_wait = self._first_in_line

    def _attempt_argv(
        self, owner: str, lease: int, line: bool, wake: bytes | None, first: bool
    ) -> list[Any]:
        """acquire.lua's ARGV for one attempt; ``first``: a blocked acquire's first attempt,
        made in line (mode "first": a hold of the owner is a re-entry, not a grant to it)."""
        argv = self._acquire_argv(owner, lease, line)
        if first:
            argv = [*argv, *("",) * (4 - len(argv)), "first"]
        return self._with_wake(owner, argv, wake)

    def _refused_wait(self, reply: AcquireReply) -> int:
        """An attempt Redis refused: ms to wait at most (the holder's lease). Raises
        :class:`OwnerFinished` / :class:`OwnerRunning` for a task lock's owner."""
        if reply.finished:
            raise OwnerFinished(self.name)
        if reply.running:
            raise OwnerRunning(self.name)
        return reply.pttl

    def _held(
        self,
        owner: str,
        reply: AcquireReply,
        sent_at: float,
        lease: int,
        renew: bool,
        started: float | None,
        owner_task: Any,
    ) -> Hold | None:
        """Record a granted (and, with ``min_replicas``, acknowledged) attempt; returns
        the new hold the watchdog must now renew (None: nothing to add)."""
        hold, is_new = self._record_acquired(
            owner, reply, sent_at, lease, renew, started, owner_task
        )
        if is_new and renew:
            require_replicas(hold, self.min_replicas, self._replica_timeout_ms)
            return hold
        return None

    def _wait_for(self, pttl: int, deadline: float | None) -> float | None:
        """How long a blocked acquire waits before its next attempt (``pttl``: the
        holder's lease); None when its time is up."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        return wait_bound(pttl, remaining)

    def _extend_args(self, owner: str, lease: int) -> list[Any]:
        """renew.lua's ARGV for ``extend()``: the owner's holding by its token, if held."""
        hold = self._holds.get(owner)
        return [owner, lease, "" if hold is None else hold.token]

    def _leave_args(self, owner: str, grant_name: bytes | None) -> Sequence[Any]:
        """release.lua's ARGV to leave the line (and pass on a lock granted meanwhile,
        directly to the wait ``grant_name``)."""
        args: list[Any] = [owner, "leave"] if grant_name is None else [owner, "leave", grant_name]
        return self._with_tail(args)

    def _give_back_failed(self, exc: BaseException) -> None:
        log.warning("redislock: could not give back unreplicated %r: %r", self.name, exc)

    # -- min_replicas ----------------------------------------------------------

    def _replicated_pipeline(self, pipe: Any, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """Queue ``script`` then ``WAIT min_replicas timeout`` on one pipeline (one round trip).

        WAIT cannot run inside Lua, so it follows the script on the same connection: it
        counts the replicas that hold every write made on that connection so far.
        """
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        pipe.execute_command("WAIT", self.min_replicas, self._replica_timeout_ms)
        return pipe

    @staticmethod
    def _reload_first(reply: Any, attempt: int) -> bool:
        """Whether a replicated pipeline's script must be loaded and the pipeline sent
        again (NOSCRIPT on the first attempt); raises any other script error."""
        if isinstance(reply, NoScriptError) and attempt == 0:
            return True
        if isinstance(reply, Exception):
            raise reply
        return False

    def _unreplicated(self, acks: Any) -> bool:
        """True when a WAIT reply does not meet min_replicas (or WAIT failed)."""
        return isinstance(acks, Exception) or int(acks) < self.min_replicas

    def _extend_unreplicated(self, code: int, acks: Any) -> bool:
        """Whether an extend Redis accepted (``code`` 1) missed its replicas."""
        return bool(self.min_replicas) and code == 1 and self._unreplicated(acks)

    @staticmethod
    def _replica_count(info: Any) -> int | None:
        """The connected replicas an ``INFO replication`` reply reports (None: unknown)."""
        try:
            return int(info.get("connected_slaves", 0))
        except (ValueError, TypeError, AttributeError):
            return None

    def _replication_error(
        self, acks: Any, what: str, owner: str, connected: int | None
    ) -> LockReplicationError:
        acknowledged = 0 if isinstance(acks, Exception) else int(acks)
        if isinstance(acks, Exception):
            detail = f"WAIT is unavailable on this server ({acks}); min_replicas cannot be met"
        else:
            detail = (
                f"only {acknowledged} acknowledged within replica_timeout={self.replica_timeout}s"
            )
            if connected is not None and connected < self.min_replicas:
                detail += f" (the server reports {connected} connected replicas)"
        undone = "it was given back" if what == "acquire" else "its lease was not renewed"
        return LockReplicationError(
            f"lock {self.name!r}: {what} needs min_replicas={self.min_replicas} replicas to "
            f"acknowledge it, but {detail}; {undone}",
            name=self.name,
            owner=owner,
            min_replicas=self.min_replicas,
            acknowledged=acknowledged,
            timeout=self.replica_timeout,
        )

    # -- queries ---------------------------------------------------------------

    @staticmethod
    def _seconds_left(pttl: int) -> float | None:
        """``remaining()`` from a PTTL reply."""
        if pttl == -2:
            return None
        return float("inf") if pttl == -1 else pttl / 1000.0

    @staticmethod
    def _force_keys(name: str | bytes, prefix: str) -> list[bytes]:
        """release.lua's KEYS for ``force_release`` (ARGV ``["", "force"]``)."""
        return LockKeys.for_name(name, validate_prefix(prefix)).release_keys()
