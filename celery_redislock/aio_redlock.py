"""The asyncio twin of the quorum lock: :class:`AsyncRedLock` over ``redis.asyncio``.

Same arguments, rules and decisions as :class:`~celery_redislock.redlock.RedLock`
(shared through :mod:`celery_redislock._quorum_runtime`); this module drives the I/O
as asyncio tasks. Owners are asyncio tasks, as for
:class:`~celery_redislock.aio.AsyncRedisLock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ._async_waiting import async_subscriber_for
from ._base import AsyncContext, LockBase
from ._core import (
    DEFAULT_PREFIX,
    AsyncLeaseLost,
    Hold,
    LockKeys,
    decode_acquire,
    validate_prefix,
    wait_event,
)
from ._errors import LockQuorumError
from ._private_clients import aclose_private, bounded_client, private_clients
from ._quorum import (
    Decided,
    QuorumAcquire,
    Round,
    answered,
    decided_by,
    given_back,
    granted,
    renewed,
    tally_acquire,
    validate_nodes,
)
from ._quorum_runtime import (
    MultiWaiterBase,
    QuorumBase,
    majority_remaining,
    round_of,
)
from ._renewal import async_scheduler_for
from ._scripts import scripts_for
from .aio import AsyncCalls, Caller, task_owner

T = TypeVar("T")


class AsyncRedLock(QuorumBase, LockBase[AsyncLeaseLost], AsyncCalls, AsyncContext):
    """The asyncio twin of :class:`RedLock` over ``redis.asyncio`` clients (or URLs).

    Same arguments and rules; owners are asyncio tasks as for :class:`AsyncRedisLock`.
    A cancelled acquire gives back whatever its attempt took before re-raising.
    """

    _signal_type = AsyncLeaseLost
    _asyncio_clients = True

    def _default_owner(self) -> str:
        return task_owner()

    async def _round(
        self,
        call: Callable[[int], Awaitable[Any]],
        decided: Decided | None = None,
        tasks: list[asyncio.Future[Any]] | None = None,
    ) -> Round:
        """:meth:`RedLock._round` for asyncio. The requests are background tasks (pass
        ``tasks`` to see them even if the caller is cancelled): those in flight at the
        end finish by themselves, bounded by the nodes' socket timeout."""
        sources = [_background(call(i), self._in_flight) for i in range(len(self._fast))]
        if tasks is not None:
            tasks.extend(sources)
        deadline = time.monotonic() + self.node_timeout + 0.05
        pending: set[Any] = set(sources)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, pending = await asyncio.wait(
                pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            if pending and decided and decided(round_of(sources, self._labels)):
                break
        return round_of(sources, self._labels)

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
        outcome = await self._try(owner, lease_millis, renew, owner_task=task)
        if outcome is None:
            return True
        self._contended(owner)
        if not blocking:
            return False
        deadline = None if wait_limit is None else started + wait_limit
        async with _AsyncMultiWaiter(self.clients, self.keys.channel, owner) as waiter:
            while True:
                step = self._next_wait(outcome, deadline)
                if step is None:
                    return False
                pause, bound = step
                if pause:
                    await asyncio.sleep(pause)
                else:
                    await waiter.wait(bound)
                waiter.mark()
                outcome = await self._try(owner, lease_millis, renew, started, owner_task=task)
                if outcome is None:
                    return True

    async def _try(
        self,
        owner: str,
        lease: int,
        renew: bool,
        started: float | None = None,
        *,
        owner_task: asyncio.Task[Any] | None = None,
    ) -> QuorumAcquire | None:
        """One attempt on every node: None if acquired, else what the nodes said."""
        running, within = self._still_undoing(owner)
        if running:
            await asyncio.wait(running, timeout=within)
        fresh = self._begin_attempt(owner)
        sent_at = time.monotonic()
        keys, argv = self._numbered(owner, fresh, lease)
        sources: list[asyncio.Future[Any]] = []
        try:
            round_ = await self._round(
                lambda i: self._node_scripts[i].acquire(keys=keys, args=argv),
                decided_by(granted, self.quorum),
                sources,
            )
            try:
                outcome, acquired, write_back = self._settle_acquire(owner, round_, fresh)
            except LockQuorumError:
                self._undo(owner, fresh, sources)
                raise
            if write_back:
                acquired = await self._write_back(outcome.token)
        except asyncio.CancelledError:
            # Whatever reaches the nodes is given back, after it lands.
            self._undo(owner, fresh, sources)
            raise
        parts = self._take(owner, outcome, acquired, sent_at, lease, renew, started, owner_task)
        if parts is not None:
            for node, part in parts:
                scheduler = async_scheduler_for(self.clients[node])
                assert scheduler is not None
                scheduler.add(part)
            return None
        self._undo(owner, fresh, sources)
        return self._refused(outcome, acquired)

    async def _write_back(self, token: int) -> bool:
        keys = [self.keys.fence]
        round_ = await self._round(
            lambda i: self._node_scripts[i].fence(keys=keys, args=[token]),
            decided_by(answered, self.quorum),
        )
        return len(round_.answered()) >= self.quorum

    def _undo(self, owner: str, fresh: bool, sources: list[asyncio.Future[Any]]) -> None:
        """Give back what a failed or cancelled attempt took, in the background, once
        each node's acquire request has landed (or timed out): see :meth:`_undo_plan`."""
        keys = self.keys.release_keys()
        void, number, lifetime = self._void(owner)

        async def give_back_on(node: int, nodes: list[int], args: list[Any]) -> Any:
            if self._may_land(sources[node]):
                # Its acquire may still land: void it there first (then nothing is left).
                await self._fast[node].set(void, number, px=lifetime)
            if node in nodes:
                return await self._node_scripts[node].release(keys=keys, args=args)
            return None

        async def give_back() -> None:
            if not sources:
                return
            await asyncio.wait(sources, timeout=self.node_timeout * 2)
            outcome = tally_acquire(round_of(sources, self._labels).replies, decode_acquire)
            nodes, args = self._undo_plan(owner, outcome, fresh)
            await asyncio.gather(
                *(give_back_on(n, nodes, args) for n in range(len(sources))),
                return_exceptions=True,
            )

        self._track(owner, [_background(give_back(), self._in_flight)])

    async def _release(self, owner: str) -> None:
        hold = self._holds.get(owner)
        keys = self.keys.release_keys()
        args = self._release_args(owner, hold)
        valid = self._valid(hold)
        self._ack_releasing(hold, 1)
        try:
            round_ = await self._round(
                self._giving_back(owner, keys, args), decided_by(given_back, self.quorum)
            )
        finally:
            self._ack_releasing(hold, -1)
        self._settle_release(owner, hold, round_, valid)

    def _giving_back(
        self, owner: str, keys: list[Any], args: list[Any]
    ) -> Callable[[int], Awaitable[Any]]:
        """:meth:`RedLock._giving_back` for asyncio."""
        silent, (void, number, lifetime) = self._voids_first(owner, args)

        async def call(i: int) -> Any:
            if i in silent:
                await self._fast[i].set(void, number, px=lifetime)
            return await self._node_scripts[i].release(keys=keys, args=args)

        return call

    async def _extend(self, called: Caller, lease: int) -> None:
        owner = called.owner
        self._check_not_inherited(owner)
        sent_at = time.monotonic()
        keys = [self.keys.lock]
        round_ = await self._round(
            lambda i: self._node_scripts[i].renew(keys=keys, args=[owner, lease, ""]),
            decided_by(renewed, self.quorum),
        )
        self._settle_extend(owner, round_, lease, sent_at)

    def _unschedule(self, hold: Hold) -> None:
        group = self._groups.pop(id(hold), None)
        if group is None:
            return
        for node, part in group.parts:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to remove
                scheduler = async_scheduler_for(self.clients[node], create=False)
                if scheduler is not None:
                    scheduler.remove(part)

    async def _pttls(self) -> Round:
        async def one(i: int) -> int:
            return int(await self._fast[i].pttl(self.keys.lock))

        return await self._round(one)

    async def locked(self) -> bool:
        """Whether a majority of the nodes shows the lock held (by anyone)."""
        round_ = await self._pttls()
        return sum(1 for i in round_.answered() if round_.replies[i] != -2) >= self.quorum

    async def _owned(self, called: Caller) -> bool:
        owner = called.owner

        async def one(i: int) -> bool:
            return bool(await self._fast[i].hexists(self.keys.lock, owner))

        round_ = await self._round(one)
        return sum(1 for i in round_.answered() if round_.replies[i]) >= self.quorum

    async def remaining(self) -> float | None:
        """Seconds until fewer than a majority of the nodes hold the lock (None: not locked)."""
        return majority_remaining(await self._pttls(), self.quorum)

    @staticmethod
    async def force_release(
        clients: Sequence[Any], name: str | bytes, *, prefix: str = DEFAULT_PREFIX
    ) -> bool:
        """Operator's tool: delete the lock on every node whoever holds it; True if any
        had it (see ``RedLock.force_release``)."""
        keys = LockKeys.for_name(name, validate_prefix(prefix)).release_keys()
        deleted = False
        for client in validate_nodes(clients):
            node = (
                bounded_client(client, 1.0, asyncio_client=True)
                if isinstance(client, str)
                else client
            )
            with contextlib.suppress(Exception):
                deleted |= int(await scripts_for(node).release(keys=keys, args=["", "force"])) == 0
            if node is not client:
                await node.aclose()
        return deleted

    @property
    def _in_flight(self) -> set[asyncio.Future[Any]]:
        """This lock's node requests still running in the background (a release's slowest
        node, a cancelled acquire's give-back): :meth:`aclose` lets them land first."""
        found: set[asyncio.Future[Any]] | None = self.__dict__.get("_flying")
        if found is None:
            found = self.__dict__["_flying"] = set()
        return found

    async def aclose(self) -> None:
        """Close this lock's private per-node connections (the caller's clients stay
        open), once its node requests still in flight have landed (each bounded by the
        nodes' timeout: one closed under it would connect again, and stay open).
        Otherwise they are closed without waiting when the lock is collected."""
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=self.node_timeout * 2 + 0.1)
        failed: list[Exception] = []
        for client in private_clients(self._closer):  # each, whatever another's close raised
            try:
                await aclose_private(client)
            except Exception as exc:
                failed.append(exc)
        if failed:
            raise failed[0]


_background_tasks: set[asyncio.Future[Any]] = set()


def _background(
    awaitable: Awaitable[T], mine: set[asyncio.Future[Any]] | None = None
) -> asyncio.Future[T]:
    """Run ``awaitable`` as a task that is kept alive and whose error is collected (and,
    while it runs, in ``mine``: a lock's own requests in flight)."""
    task = asyncio.ensure_future(awaitable)
    _background_tasks.add(task)
    task.add_done_callback(_collected)
    if mine is not None:
        mine.add(task)
        task.add_done_callback(mine.discard)
    return task


def _collected(task: asyncio.Future[Any]) -> None:
    _background_tasks.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a late node failure is not an unhandled error


class _AsyncMultiWaiter(MultiWaiterBase):
    """:class:`MultiWaiterBase` for asyncio: each node's subscription is made in a
    background task."""

    def __init__(self, clients: Sequence[Any], channel: bytes, owner: str) -> None:
        super().__init__(clients, channel, owner)
        self._event: asyncio.Event = asyncio.Event()

    async def __aenter__(self) -> _AsyncMultiWaiter:
        for client in self._clients:
            _background(self._subscribe(client))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exit()

    async def _subscribe(self, client: Any) -> None:
        subscriber = async_subscriber_for(client)
        assert subscriber is not None
        waiter = self._waiter_of(subscriber)
        waiter._channel = await subscriber._register(self._channel, waiter)
        self._adopt(subscriber, waiter)

    async def wait(self, timeout: float) -> bool:
        timeout = self._bound(timeout)
        woken = self._event.is_set() or (timeout > 0 and await wait_event(self._event, timeout))
        self._rearm()
        return woken
