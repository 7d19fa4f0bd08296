"""Releases that could not reach Redis, retried in the background.

A release that fails on the network (Redis restarting, failing over, partitioned) must
not leave the lock renewed: the hold stops renewing at once, so its lease runs out by
itself, and the release is handed here. One thread per process (sync locks), or one task
per release on the event loop (asyncio locks), tries it again with backoff until Redis
answers, or until the attempt's deadline passes (for a lock, the hold's validity
deadline: after it the lease may be gone and the owner may hold the lock afresh, which a
late release must not touch).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Callable

from redis.exceptions import ConnectionError, TimeoutError

from ._process import ProcessLocal

log = logging.getLogger("celery_redislock")

#: What a deferred release retries on: Redis not answering. Anything else (the hold is
#: gone, a script error) ends the retries.
UNREACHABLE = (ConnectionError, TimeoutError, OSError)
FIRST_DELAY = 0.2
MAX_DELAY = 5.0


def _retry_release_args(owner: str, token: int) -> list[str]:
    """release.lua's ARGV for the retry of a lock's last-hold release: one hold, of the
    holding with this fencing token only. The release being retried may have landed (its
    reply lost) and the owner may have taken the lock afresh since: that new holding has
    a newer token, and the retry leaves it alone."""
    return [owner, "one", "", "", "", str(token)]


def _delay(attempt: int) -> float:
    return float(min(MAX_DELAY, FIRST_DELAY * 2 ** min(attempt, 10)))


@dataclass(order=True)
class _Item:
    due: float
    until: float = field(compare=False)
    what: str = field(compare=False)
    attempt_fn: Callable[[], object] = field(compare=False)
    attempts: int = field(default=0, compare=False)
    #: (lock key, owner): a new acquire of that owner on that lock cancels the retry.
    key: tuple[bytes, str] | None = field(default=None, compare=False)


class DeferredReleases:
    """This process's background retries of unconfirmed releases (sync locks)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[_Item] = []
        self._thread: threading.Thread | None = None
        self._busy = 0

    def add(
        self,
        what: str,
        attempt: Callable[[], object],
        until: float,
        key: tuple[bytes, str] | None = None,
    ) -> None:
        """Retry ``attempt()`` until it returns (or raises other than unreachable), or
        until the monotonic time ``until``. ``what`` names it in logs; ``key`` (lock key,
        owner) lets :meth:`cancel` drop it."""
        with self._cond:
            item = _Item(time.monotonic() + FIRST_DELAY, until, what, attempt, key=key)
            self._items.append(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="redislock-deferred-release", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def cancel(self, lock_key: bytes, owner: str) -> None:
        """The owner acquired the lock again: drop its pending release of it. The release
        may have landed (the owner then holds the lock afresh, which a retry must not
        give back), or may still land late (then it gives back the count it was meant
        to, and the owner's new hold is the re-entry on top); if it never lands, the
        count it kept ends with the lease. Cheap when nothing is pending."""
        if not self._items:
            return
        with self._cond:
            self._items = [i for i in self._items if i.key != (lock_key, owner)]

    def pending(self) -> int:
        """How many releases are still being retried (including one in progress)."""
        with self._cond:
            return len(self._items) + self._busy

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is pending (for tests and shutdown); True if so."""
        end = time.monotonic() + timeout
        while self.pending():
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._items:
                        self._cond.wait(60.0)
                        if not self._items:
                            self._thread = None
                            return
                        continue
                    self._items.sort()
                    wait = self._items[0].due - time.monotonic()
                    if wait <= 0:
                        item = self._items.pop(0)
                        self._busy += 1
                        break
                    self._cond.wait(wait)
            try:
                again = self._attempt(item)
            finally:
                with self._cond:
                    self._busy -= 1
                    if again:
                        self._items.append(item)

    @staticmethod
    def _attempt(item: _Item) -> bool:
        """One try; True to try again later."""
        try:
            item.attempt_fn()
        except UNREACHABLE as exc:
            item.attempts += 1
            item.due = time.monotonic() + _delay(item.attempts)
            if item.due < item.until:
                return True
            log.warning(
                "redislock: gave up releasing %s after %d attempts (%r); its lease ends it",
                item.what,
                item.attempts,
                exc,
            )
            return False
        except Exception:
            log.warning("redislock: deferred release of %s failed", item.what, exc_info=True)
            return False
        log.info("redislock: released %s after Redis came back", item.what)
        return False


#: This process's retrier (a forked child never retries its parent's releases).
_deferred = ProcessLocal(DeferredReleases)


def cancel_deferred(lock_key: bytes, owner: str) -> None:
    """Drop this process's pending release of ``lock_key`` by ``owner`` (sync or asyncio),
    if any: the owner just acquired it again."""
    found = _deferred.peek()
    if found is not None and found._items:
        found.cancel(lock_key, owner)
    if _async_tasks:
        cancel_async(lock_key, owner)


def deferred_releases() -> DeferredReleases:
    """This process's retrier (a new one after a fork: a child never retries its parent's)."""
    return _deferred.get()


_async_tasks: dict[asyncio.Task[None], tuple[bytes, str] | None] = {}


def cancel_async(lock_key: bytes, owner: str) -> None:
    """The asyncio counterpart of :meth:`DeferredReleases.cancel`."""
    if not _async_tasks:
        return
    for task, key in list(_async_tasks.items()):
        if key == (lock_key, owner):
            task.cancel()


def defer_async(
    what: str,
    attempt: Callable[[], Awaitable[object]],
    until: float,
    key: tuple[bytes, str] | None = None,
) -> None:
    """The asyncio counterpart of :meth:`DeferredReleases.add`: a task on the running loop."""

    async def retry() -> None:
        attempts = 0
        while True:
            await asyncio.sleep(_delay(attempts))
            try:
                await attempt()
            except UNREACHABLE as exc:
                attempts += 1
                if time.monotonic() + _delay(attempts) >= until:
                    log.warning(
                        "redislock: gave up releasing %s after %d attempts (%r); its lease ends it",
                        what,
                        attempts,
                        exc,
                    )
                    return
                continue
            except Exception:
                log.warning("redislock: deferred release of %s failed", what, exc_info=True)
                return
            log.info("redislock: released %s after Redis came back", what)
            return

    task = asyncio.get_running_loop().create_task(retry())
    _async_tasks[task] = key
    task.add_done_callback(lambda done: _async_tasks.pop(done, None))


def pending_async() -> int:
    """How many asyncio deferred releases are still running (all loops)."""
    return sum(1 for task in _async_tasks if not task.done())
