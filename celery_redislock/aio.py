"""The asyncio twin: :class:`AsyncRedisLock` over ``redis.asyncio``.

Same methods, arguments, scripts, errors and guarantees as
:class:`celery_redislock.RedisLock`; the I/O is awaited. Differences:

* the default owner is the calling **asyncio task** (tracked with a context
  variable), so two coroutines on one thread are different owners unless they pass
  the same explicit ``owner=``. ``acquire``, ``release``, ``extend`` and ``owned`` resolve
  it when *called*, not when their coroutine runs: ``asyncio.wait_for(lock.acquire(),
  5)`` (which runs the acquire in a task of its own before Python 3.12),
  ``create_task``, ``gather`` and ``shield`` acquire for the task that called
  ``acquire()``, and that task's ``release()`` matches. Acquires of one such owner on
  one lock take turns (:class:`OwnerTurns`), and a hold whose task has ended is no
  longer renewed (it is reported lost, reason ``"abandoned"``);
* renewal runs as one asyncio task per connection pool per event loop, and waiters
  are woken by one reader task per pool per loop;
* cancellation is safe: a cancelled ``acquire`` whose command already reached Redis
  gives the hold back before the ``CancelledError`` propagates, and a cancelled
  ``release`` finishes (or, if Redis is unreachable, keeps the hold recorded so the
  release can be retried).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import weakref
from collections import deque
from typing import Any, Awaitable, Callable, Coroutine, NamedTuple, TypeVar

from redis.exceptions import RedisError

from ._async_waiting import async_subscribers_of, async_waiter_for
from ._base import AsyncContext
from ._core import (
    DEFAULT_PREFIX,
    AsyncLeaseLost,
    Hold,
    LockKeys,
    lease_ms,
    new_owner_suffix,
    process_id,
    thread_owner,
)
from ._deferred import UNREACHABLE, defer_async
from ._renewal import AsyncRenewalScheduler, async_scheduler_for
from ._replies import decode_release, decode_renew_one
from ._scripts import run_async, scripts_for
from ._single import SingleBase

T = TypeVar("T")
log = logging.getLogger(__name__)

_task_owner: contextvars.ContextVar[tuple[weakref.ref[asyncio.Task[Any]], str] | None]
_task_owner = contextvars.ContextVar("celery_redislock_task_owner", default=None)


def _scheduler(client: Any) -> AsyncRenewalScheduler:
    found = async_scheduler_for(client)
    assert found is not None
    return found


def task_owner() -> str:
    """Owner id of the calling asyncio task (child tasks get their own, not the
    parent's), or of the calling thread outside any task."""
    return caller(None).owner


class Caller(NamedTuple):
    """Who calls an owner-checked method: the owner id, and the asyncio task a default
    owner names (None for an explicit owner, or a thread's owner outside any task)."""

    owner: str
    task: asyncio.Task[Any] | None


def caller(explicit: str | None) -> Caller:
    """Who calls now: ``explicit`` if given, else the calling asyncio task, or the
    calling thread when no task is running (say, ``run_coroutine_threadsafe`` from a
    thread: its acquire and its release then match)."""
    if explicit is not None:
        return Caller(explicit, None)
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        task = None
    if task is None:
        return Caller(thread_owner(), None)
    current = _task_owner.get()
    if current is not None and current[0]() is task:
        return Caller(current[1], task)
    owner = f"{process_id()}:a{new_owner_suffix()}"
    _task_owner.set((weakref.ref(task), owner))
    return Caller(owner, task)


class OwnerTurns:
    """Acquires of one default owner on one lock name take turns in this process.

    A task runs one ``acquire`` at a time unless it hands them to other tasks
    (``gather(lock.acquire(), lock.acquire())``, ``create_task``). One at a time keeps
    what the acquire script and the hold table rely on: an owner waiting for a lock
    does not hold it, and its acquires' replies are applied in the order Redis made
    them. Turns are granted first come, first served; waiting for one costs no I/O.
    """

    def __init__(self) -> None:
        #: (lock key, owner) -> acquires waiting for their turn; present while one runs.
        self._lines: dict[tuple[bytes, str], deque[asyncio.Future[None]]] = {}

    async def run(
        self,
        key: tuple[bytes, str],
        blocking: bool,
        wait_limit: float | None,
        acquire: Callable[[float | None], Awaitable[bool]],
    ) -> bool:
        """Run ``acquire(remaining wait limit)`` in ``key``'s turn. False, with nothing
        sent, if the turn does not come within ``wait_limit`` (``blocking=False``: if
        another acquire of the owner is running)."""
        started = time.monotonic()
        if not await self._enter(key, wait_limit if blocking else 0.0):
            return False
        try:
            if wait_limit is not None:
                wait_limit = max(0.0, wait_limit - (time.monotonic() - started))
            return await acquire(wait_limit)
        finally:
            self._leave(key)

    async def _enter(self, key: tuple[bytes, str], timeout: float | None) -> bool:
        line = self._lines.get(key)
        if line is None:
            self._lines[key] = deque()
            return True
        if timeout is not None and timeout <= 0:
            return False
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.append(turn)
        try:
            done, _ = await asyncio.wait({turn}, timeout=timeout)
        except BaseException:
            if turn.done():  # granted as the cancellation came: pass it on
                self._leave(key)
            else:
                line.remove(turn)
            raise
        if not done:
            line.remove(turn)
            return False
        return True

    def _leave(self, key: tuple[bytes, str]) -> None:
        line = self._lines[key]
        if line:
            line.popleft().set_result(None)
        else:
            del self._lines[key]


owner_turns = OwnerTurns()


async def _to_completion(awaitable: Awaitable[T]) -> tuple[asyncio.Future[T], BaseException | None]:
    """Await ``awaitable`` to its end even if the caller is cancelled meanwhile.

    Returns the finished future and the CancelledError that arrived (if any), so the
    caller can record what Redis actually did before re-raising the cancellation.
    """
    future = asyncio.ensure_future(awaitable)
    cancelled: BaseException | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            if future.cancelled():
                raise
            cancelled = exc
        except Exception:
            break
    return future, cancelled


async def to_completion(awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` to its end even if the caller is cancelled meanwhile, then
    re-raise that cancellation (or return its result)."""
    future, cancelled = await _to_completion(awaitable)
    if cancelled is not None:
        raise cancelled
    return future.result()


class AsyncCalls:
    """The public calls of the asyncio locks (:class:`AsyncRedisLock`, ``AsyncRedLock``):
    each checks its arguments and resolves its owner (:func:`caller`) when called, then
    returns the coroutine that runs it; a default owner's acquires take turns.

    A lock supplies ``_acquire_as``, ``_release``, ``_extend`` and ``_owned``; the
    attributes and checks below come from :class:`~celery_redislock._base.LockBase`,
    which precedes this class in the lock's bases.
    """

    owner: str | None
    keys: LockKeys

    def _acquire_args(
        self, blocking: object, timeout: object, lease: object
    ) -> tuple[float | None, int, bool]:
        raise NotImplementedError

    def _check_not_inherited(self, owner: str) -> None:
        raise NotImplementedError

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, lease: float | None = None
    ) -> Coroutine[Any, Any, bool]:
        """Take the lock (or re-enter it); True on success. See :meth:`RedisLock.acquire`.

        The arguments are checked and the owner resolved when ``acquire()`` is called,
        in the calling task: the coroutine acquires for that task wherever it runs
        (``wait_for``, ``create_task``, ``gather``, ``shield``). Concurrent acquires of
        one default owner on this lock take turns (see :class:`OwnerTurns`).
        """
        wait_limit, lease_millis, renew = self._acquire_args(blocking, timeout, lease)
        return self._acquire(caller(self.owner), blocking, wait_limit, lease_millis, renew)

    async def _acquire(
        self,
        called: Caller,
        blocking: bool,
        wait_limit: float | None,
        lease_millis: int,
        renew: bool,
    ) -> bool:
        owner, task = called

        def attempt(limit: float | None) -> Awaitable[bool]:
            return self._acquire_as(owner, task, blocking, limit, lease_millis, renew)

        if self.owner is not None:  # an explicit owner may be shared: no turns
            return await attempt(wait_limit)
        return await owner_turns.run((self.keys.lock, owner), blocking, wait_limit, attempt)

    async def _acquire_as(
        self,
        owner: str,
        task: asyncio.Task[Any] | None,
        blocking: bool,
        wait_limit: float | None,
        lease_millis: int,
        renew: bool,
    ) -> bool:
        raise NotImplementedError

    def release(self) -> Coroutine[Any, Any, None]:
        """Give back one hold of the calling owner (resolved when called, as by
        :meth:`acquire`). See :meth:`RedisLock.release`. A cancelled release still
        completes (and is recorded) before the cancellation goes on."""
        return self._release_for(caller(self.owner))

    async def _release_for(self, called: Caller) -> None:
        owner = called.owner
        self._check_not_inherited(owner)
        await to_completion(self._release(owner))

    async def _release(self, owner: str) -> None:
        raise NotImplementedError

    def extend(self, ttl: float) -> Coroutine[Any, Any, None]:
        """Replace the calling owner's lease with ``ttl`` seconds. See :meth:`RedisLock.extend`."""
        return self._extend(caller(self.owner), lease_ms(ttl, "ttl"))

    async def _extend(self, called: Caller, lease: int) -> None:
        raise NotImplementedError

    def owned(self) -> Coroutine[Any, Any, bool]:
        """Whether the calling owner holds the lock (server-side)."""
        return self._owned(caller(self.owner))

    async def _owned(self, called: Caller) -> bool:
        raise NotImplementedError


async def aclose_background(client: Any) -> None:
    """Stop this event loop's subscriber and watchdog tasks for ``client``.

    They stop by themselves a moment after the last wait or hold ends; call this
    before closing the client or the loop sooner (tests, shutdown hooks). Holds still
    held stop being renewed and expire after their lease.
    """
    for subscriber in async_subscribers_of(client):
        await subscriber.aclose()
    scheduler = async_scheduler_for(client, create=False)
    if scheduler is not None:
        await scheduler.aclose()


class AsyncSingle(SingleBase[AsyncLeaseLost], AsyncCalls, AsyncContext):
    """The asyncio driver of a lock on one Redis: :class:`AsyncRedisLock`, and
    :class:`~celery_redislock.AsyncRedisSemaphore` (see ``lock.SyncSingle``)."""

    _signal_type = AsyncLeaseLost

    def _default_owner(self) -> str:
        return task_owner()

    def _renewals(self) -> AsyncRenewalScheduler:
        return _scheduler(self.client)

    def _unschedule(self, hold: Hold) -> None:
        if hold.renew:
            _scheduler(self.client).remove(hold)

    async def _acquire_as(
        self,
        owner: str,
        task: asyncio.Task[Any] | None,
        blocking: bool,
        wait_limit: float | None,
        lease_millis: int,
        renew: bool,
    ) -> bool:
        started = time.monotonic()
        in_line_first = self._joins_line_first(blocking, owner)  # as RedisLock.acquire's
        if not in_line_first:
            if await self._try(owner, lease_millis, renew, owner_task=task) is True:
                return True
            self._contended(owner)
            if not blocking:
                return False
        deadline = None if wait_limit is None else time.monotonic() + wait_limit
        acquired = False
        async with async_waiter_for(self.client, self.keys.channel, owner, wait_limit) as waiter:
            direct = self._direct(renew) and waiter.direct
            pttl = 0  # the holder's lease at the last attempt (how long our place is kept)
            try:
                while True:
                    sent_at = time.monotonic()
                    wake = waiter.next_wake_id() if direct else None
                    outcome = await self._try(
                        owner,
                        lease_millis,
                        renew,
                        started,
                        line=True,
                        wake=wake,
                        owner_task=task,
                        first=in_line_first,
                    )
                    self._answered_in_line(owner, in_line_first, outcome is True)
                    in_line_first = False
                    if outcome is True:
                        acquired = True
                        return True
                    pttl = outcome
                    bound = self._wait_for(outcome, deadline)
                    if bound is None:
                        return False
                    # A direct grant's hold is built before the wait, not after waking.
                    grant = self._grant_hold(owner, sent_at, lease_millis, task) if direct else None
                    await waiter.wait(bound)
                    token = waiter.take_grant()
                    if (
                        token is not None
                        and grant is not None
                        and self._take_grant(grant, token, started)
                    ):
                        acquired = True
                        return True
            finally:
                if not acquired:  # also when cancelled: leaving must reach Redis
                    await _to_completion(
                        self._leave_line(owner, waiter.grant_name if direct else None, pttl)
                    )

    async def _leave_line(self, owner: str, grant_name: bytes | None = None, pttl: int = 0) -> None:
        try:
            await self._scripts.release(
                keys=self.keys.release_keys(), args=self._leave_args(owner, grant_name)
            )
        except RedisError:  # the place lapses LINE_MARGIN_MS past the lease
            self._abandoned(owner, grant_name, pttl)

    async def _try(
        self,
        owner: str,
        lease: int,
        renew: bool,
        started: float | None = None,
        *,
        line: bool = False,
        wake: bytes | None = None,
        first: bool = False,
        owner_task: asyncio.Task[Any] | None = None,
    ) -> bool | int:
        sent_at = time.monotonic()
        argv = self._attempt_argv(owner, lease, line, wake, first)
        if self.min_replicas:
            call = self._replicated(self._scripts.acquire, self._acquire_keys(), argv)
        else:
            keys = self._acquire_keys()
            call = self._plain(run_async(self.client, self._scripts.acquire, keys, argv))
        future, cancelled = await _to_completion(call)
        if cancelled is not None and future.exception() is not None:
            raise cancelled
        raw, acks = future.result()
        reply = self._decode_acquire(raw)
        if not reply.acquired:
            if cancelled is not None:
                raise cancelled
            return self._refused_wait(reply)
        if self.min_replicas and self._unreplicated(acks):
            await _to_completion(self._give_back(owner))
            connected = await self._connected_replicas() if cancelled is None else None
            error = self._replication_error(acks, "acquire", owner, connected)
            raise cancelled if cancelled is not None else error
        hold = self._held(owner, reply, sent_at, lease, renew, started, owner_task)
        if hold is not None:
            _scheduler(self.client).add(hold)
        if cancelled is not None:
            # Redis granted it, but our caller is gone: give it straight back.
            await _to_completion(self._release(owner))
            raise cancelled
        return True

    @staticmethod
    async def _plain(call: Awaitable[Any]) -> tuple[Any, Any]:
        return await call, None

    async def _replicated(self, script: Any, keys: list[Any], args: list[Any]) -> tuple[Any, Any]:
        """(script reply, WAIT reply) in one round trip (the script reloaded on NOSCRIPT)."""
        for attempt in range(2):
            pipe = self._replicated_pipeline(self.client.pipeline(False), script, keys, args)
            reply, acks = await pipe.execute(raise_on_error=False)
            if self._reload_first(reply, attempt):
                await self.client.script_load(script.script)
                continue
            return reply, acks
        raise AssertionError("unreachable")  # pragma: no cover

    async def _give_back(self, owner: str) -> None:
        """Undo an acquire the replicas did not acknowledge (owner-checked, one hold)."""
        try:
            await self._scripts.release(keys=self.keys.release_keys(), args=[owner])
        except RedisError as exc:  # the hold's lease ends it
            self._give_back_failed(exc)

    async def _connected_replicas(self) -> int | None:
        try:
            return self._replica_count(await self.client.info("replication"))
        except RedisError:
            return None

    async def _release(self, owner: str) -> None:
        hold = self._holds.get(owner)
        if hold is not None:
            hold.releasing += 1
        try:
            code = decode_release(
                await run_async(
                    self.client, self._scripts.release, self._release_keys, self._with_tail([owner])
                )
            )
        except UNREACHABLE as exc:
            retry = self._release_unreachable(owner, hold, exc)
            if retry is None:
                return
            what, retry_args = retry
            assert hold is not None
            defer_async(
                what,
                lambda: run_async(
                    self.client, self._scripts.release, self._release_keys, retry_args
                ),
                until=hold.deadline,
                key=(self.keys.lock, owner),
            )
            return
        finally:
            if hold is not None:
                hold.releasing -= 1
        self._record_released(owner, code)

    async def _extend(self, called: Caller, lease: int) -> None:
        owner = called.owner
        self._check_not_inherited(owner)
        sent_at = time.monotonic()
        if self.min_replicas:
            codes, acks = await self._replicated(
                self._scripts.renew, [self._hold_keys(owner).lock], self._extend_args(owner, lease)
            )
            if self._extend_unreplicated(decode_renew_one(codes), acks):
                connected = await self._connected_replicas()
                raise self._replication_error(acks, "extend", owner, connected)
        else:
            codes = await self._scripts.renew(
                keys=[self._hold_keys(owner).lock], args=self._extend_args(owner, lease)
            )
        self._record_extended(owner, decode_renew_one(codes), lease, sent_at)

    async def _owned(self, called: Caller) -> bool:
        owner = called.owner
        return bool(await self.client.hexists(self._hold_keys(owner).lock, owner))


class AsyncRedisLock(AsyncSingle):
    """A reentrant, owner-checked, fenced lock on a ``redis.asyncio`` client.

    See :class:`celery_redislock.RedisLock` for the arguments and guarantees.
    """

    async def locked(self) -> bool:
        """Whether anyone holds the lock (server-side)."""
        return bool(await self.client.exists(self.keys.lock))

    async def remaining(self) -> float | None:
        """Seconds left on the current lease, whoever holds it (None: not locked)."""
        return self._seconds_left(int(await self.client.pttl(self.keys.lock)))

    @staticmethod
    async def force_release(
        client: Any, name: str | bytes, *, prefix: str = DEFAULT_PREFIX
    ) -> bool:
        """Operator's tool: delete the lock whoever holds it (see ``RedisLock.force_release``)."""
        keys = AsyncRedisLock._force_keys(name, prefix)
        code = await scripts_for(client).release(keys=keys, args=["", "force"])
        return decode_release(code) == 0
