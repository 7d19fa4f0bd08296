"""How leases are renewed: one watchdog thread per connection pool per process.

Every auto-renewed hold registers here. The thread sleeps until the earliest hold is
due (every ``lease / 3``, on the monotonic clock), then renews every hold that is due
within half an interval in batches of :data:`BATCH` keys per script call, all batches
pipelined into one round trip. 1,000 holds cost a handful of round trips per
interval, not 1,000, and never more than one thread.

Outcomes per hold:

* renewed: the local validity deadline moves to ``sent_at + lease - drift``;
* Redis says the key is gone or belongs to someone else: the hold is **lost**;
* the call fails (network): retried with jittered backoff until the hold's validity
  deadline; past it the hold is **lost** ("unreachable");
* the asyncio task or thread that owns the hold has ended: not renewed, **lost** ("abandoned");
* the hold cannot be renewed at all (a lease out of range, or an unexpected error while
  scheduling or renewing it): that hold alone is **lost** ("unrenewable") and dropped.
  The watchdog goes on renewing every other hold: no single hold stops it.

A lost hold is dropped from the schedule and reported through its lock (warning log,
``lock.lost`` set, ``on_lost`` callbacks). The thread exits when nothing is held.
Forked children start with an empty registry: they never renew their parent's holds.

A Redis Cluster client gets one watchdog per client (it has no single pool): its
private cluster client routes each per-slot batch to the node that owns the slot, in
one pipelined pass. A MOVED reply is followed by redis-py (one retry per command on the
new owner); whatever error remains counts as a failed renewal (retried until the
deadline), never as a success.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import Any, Sequence

from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from . import signals
from ._core import (
    MAX_SECONDS,
    RENEW_OK,
    Hold,
    backoff,
    batched,
    cancel_and_wait,
    hold_problem,
    loss_reason_from_renew,
    renew_args,
    wait_event,
)
from ._errors import LockReplicationError
from ._private_clients import bounded_client
from ._process import ProcessRegistry, current
from ._replies import renew_outcomes
from ._scripts import scripts_for

log = logging.getLogger(__name__)

#: Keys per renewal script call (one cluster slot per call in cluster mode).
BATCH = 100
#: Socket timeout of the watchdog's own connections: a stalled Redis cannot block
#: renewal (and so loss detection) for longer than this.
RENEW_SOCKET_TIMEOUT = 1.0
#: With nothing held, the watchdog thread exits after this long.
IDLE_EXIT = 1.0
#: After an error no hold could be blamed for, the watchdog pauses this long (seconds)
#: before it schedules again, rather than spin.
ERROR_PAUSE = 0.5
#: Longest WAIT a renewal pass sends for holds with ``min_replicas`` (ms): below the
#: watchdog's socket timeout; an unacknowledged renewal is retried until the deadline.
RENEW_WAIT_CAP_MS = 500

#: Holds whose renewals must reach replicas: hold -> (min_replicas, WAIT timeout in ms).
_replicated: weakref.WeakKeyDictionary[Hold, tuple[int, int]] = weakref.WeakKeyDictionary()


def require_replicas(hold: Hold, min_replicas: int, timeout_ms: int) -> None:
    """Renew ``hold`` only when ``min_replicas`` replicas acknowledge the renewal."""
    if min_replicas > 0:
        _replicated[hold] = (min_replicas, max(1, min(timeout_ms, RENEW_WAIT_CAP_MS)))


def _disconnect(client: Any) -> Any:
    """Close the watchdog's connections (an awaitable for asyncio clients)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return pool.disconnect()
    if hasattr(client, "disconnect_connection_pools"):  # sync cluster
        return client.disconnect_connection_pools()
    return client.aclose()  # asyncio cluster: re-initialises on next use


class _SchedulerBase:
    """What to renew when, and what each reply means; the twins only do the I/O."""

    #: Whether the watchdog's clients are redis.asyncio's.
    _asyncio_client = False

    def __init__(self, client: Any) -> None:
        # A private pool with bounded timeouts, so a user's exhausted or timeout-less pool
        # cannot stall the watchdog; one attempt per renewal (it retries by itself, until
        # the deadline).
        self._client = bounded_client(
            client, RENEW_SOCKET_TIMEOUT, asyncio_client=self._asyncio_client, max_connections=2
        )
        #: Whether the watchdog's client is private (closed when idle) or the user's.
        self._private = self._client is not client
        self._scripts = scripts_for(self._client)
        self._holds: dict[int, Hold] = {}
        #: When the watchdog next wakes by itself; an added hold due later needs no wake-up.
        self._wake_at = float("inf")
        #: The process it renews for (:func:`._process.current`).
        self.pid = current()
        #: Round trips made (one per pipelined renewal pass); read by benchmarks and tests.
        self.round_trips = 0

    def __len__(self) -> int:
        return len(self._holds)

    def _next_wait(self) -> tuple[float | None, list[Hold]]:
        """(seconds until the earliest hold is due, []) or (0, holds due now).

        Holds due within half their interval ride along, so holds taken at different
        times settle into shared passes instead of one round trip each.
        """
        if not self._holds:
            self._wake_at = float("inf")
            return None, []
        now = time.monotonic()
        first = min(h.next_due for h in self._holds.values())
        if not first <= now + MAX_SECONDS:  # no hold made by a lock is due that late
            raise ValueError(f"a hold is due at {first!r}, not within {MAX_SECONDS} s")
        if first > now:
            self._wake_at = first
            return first - now, []
        self._wake_at = now
        return 0.0, [h for h in self._holds.values() if h.next_due <= now + h.renew_interval / 2]

    def _drop_unrenewable(self, holds: Sequence[Hold], error: BaseException | None = None) -> int:
        """Drop the holds the watchdog cannot renew, each reported lost; returns how many.

        With ``error`` (scheduling raised it), every hold is checked; without, only the
        holds about to be renewed.
        """
        now = time.monotonic()
        dropped = 0
        for hold in list(holds):
            problem = hold_problem(hold, now)
            if problem is not None:
                self._give_up(hold, problem if error is None else f"{problem} ({error!r})")
                dropped += 1
        if error is not None and not dropped:
            log.error("redislock: the watchdog's schedule failed (%r); retrying", error)
        return dropped

    def _give_up(self, hold: Hold, why: str) -> None:
        """Stop renewing ``hold`` and report it lost ("unrenewable")."""
        self._holds.pop(id(hold), None)
        log.error(
            "redislock: the watchdog stops renewing %r (owner %s): %s",
            getattr(getattr(hold, "keys", None), "lock", hold),
            getattr(hold, "owner", None),
            why,
        )
        try:
            hold.mark_lost("unrenewable")
        except Exception:
            log.exception("redislock: reporting the loss of %r failed", hold)

    def _pipeline(self, holds: Sequence[Hold]) -> tuple[Any, list[Sequence[Hold]]]:
        if self._drop_unrenewable(holds):
            holds = [h for h in holds if id(h) in self._holds]
        pipe = self._client.pipeline(transaction=False)
        chunks: list[Sequence[Hold]] = []
        for group in _by_slot(self._client, holds):
            for chunk in batched(group, BATCH):
                keys, args = renew_args(chunk)
                # execute_command, not pipe.evalsha: redis-py's cluster pipeline blocks the
                # evalsha method, but routes the command by its keys' slot like any other.
                pipe.execute_command("EVALSHA", self._scripts.renew.sha, len(keys), *keys, *args)
                chunks.append(chunk)
        needs = [r for r in (_replicated.get(h) for h in holds) if r is not None]
        if needs:
            # WAIT after the scripts, on the same connection: it counts the replicas
            # that hold every renewal above (WAIT cannot run inside Lua).
            pipe.execute_command("WAIT", max(k for k, _ in needs), max(ms for _, ms in needs))
        self.round_trips += 1
        return pipe, chunks

    def _apply(self, chunks: list[Sequence[Hold]], replies: list[Any], sent_at: float) -> None:
        renewed = 0
        acks = replies[len(chunks)] if len(replies) > len(chunks) else None
        for chunk, reply in zip(chunks, replies):
            for hold, code in zip(chunk, renew_outcomes(reply, len(chunk))):
                if id(hold) not in self._holds:
                    continue  # released (or closed) while the renewal was in flight
                if isinstance(code, Exception):
                    self._failed([hold], code)
                elif code == RENEW_OK:
                    needed = _replicated.get(hold)
                    if needed is not None and (
                        acks is None or isinstance(acks, Exception) or int(acks) < needed[0]
                    ):
                        # Renewed on the master only: the deadline does not move.
                        self._failed([hold], _unreplicated(needed[0], acks))
                        continue
                    hold.renewed(sent_at)
                    renewed += 1
                elif hold.releasing:
                    # A release crossed this renewal: its own reply says whether the hold
                    # was given back or had been lost before.
                    self._holds.pop(id(hold), None)
                else:
                    self._holds.pop(id(hold), None)
                    hold.mark_lost(loss_reason_from_renew(code))
        if renewed and signals.lock_renewed.receivers:
            signals.lock_renewed.send(self, count=renewed)

    def _drop_abandoned(self, holds: Sequence[Hold]) -> list[Hold]:
        """Stop renewing holds whose owning asyncio task or thread has ended (nobody can release
        them: see ``Hold.abandoned``); they are lost, reason "abandoned", and expire
        with their lease. Returns the others."""
        kept = []
        for hold in holds:
            if hold.abandoned():
                self._holds.pop(id(hold), None)
                hold.mark_lost("abandoned")
            else:
                kept.append(hold)
        return kept

    def _failed(self, holds: Sequence[Hold], exc: BaseException) -> None:
        now = time.monotonic()
        for hold in holds:
            if id(hold) not in self._holds or hold.releasing:
                continue
            if hold.past_deadline(now):
                self._holds.pop(id(hold), None)
                hold.mark_lost("unreachable")
                continue
            hold.failures += 1
            delay = backoff(hold.failures, base=0.02, cap=max(0.05, hold.renew_interval / 2))
            hold.next_due = min(now + delay, hold.deadline)
            if signals.lock_renewal_failed.receivers:
                signals.lock_renewal_failed.send(
                    self, key=hold.keys.lock, owner=hold.owner, error=exc, failures=hold.failures
                )
            log.info(
                "redislock: renewing %r failed (%r); retry %d in %.3fs, lease valid for %.3fs",
                hold.keys.lock,
                exc,
                hold.failures,
                delay,
                hold.deadline - now,
            )


class RenewalScheduler(_SchedulerBase):
    """The watchdog thread of one connection pool in one process (see the module docstring)."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, hold: Hold, renew_by: float | None = None) -> None:
        """Renew ``hold`` from now on; ``renew_by``: the watchdog need not wake for it
        if it wakes by then anyway (a thread switch saved on a lock's hot path)."""
        with self._cond:
            self._holds[id(hold)] = hold
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="redislock-watchdog", daemon=True
                )
                self._thread.start()
            elif hold.next_due < self._wake_at and (renew_by is None or self._wake_at > renew_by):
                self._cond.notify()  # due before the watchdog would wake by itself

    def remove(self, hold: Hold) -> None:
        # No wake-up as a rule: the watchdog finds one hold fewer when it next wakes. Only
        # when the last hold goes and that wake is far off, wake it to start its idle exit.
        with self._cond:
            self._holds.pop(id(hold), None)
            if not self._holds and self._wake_at - time.monotonic() > IDLE_EXIT:
                self._cond.notify()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                try:
                    due = self._sleep_until_due()
                except Exception as exc:  # a hold that cannot be scheduled: drop it alone
                    if not self._drop_unrenewable(list(self._holds.values()), exc):
                        self._cond.wait(ERROR_PAUSE)
                    continue
                if not due:
                    self._thread = None
                    if self._private:
                        _disconnect(self._client)
                    return
            try:
                self._renew(due)
            except Exception as exc:  # not Redis's (those are retried): find the hold
                self._renew_one_by_one(due, exc)

    def _sleep_until_due(self) -> list[Hold]:
        """Wait (holding ``_cond``) until holds are due; [] when idle long enough to exit."""
        wait, due = self._next_wait()
        while not due:
            if wait is None:
                # Linger briefly: a lock taken and released in a loop should
                # not cost a thread start per acquisition.
                self._wake_at = time.monotonic() + IDLE_EXIT
                self._cond.wait(IDLE_EXIT)
                wait, due = self._next_wait()
                if wait is None:
                    return []
                continue
            self._cond.wait(wait)
            wait, due = self._next_wait()
        return due

    def _renew_one_by_one(self, holds: Sequence[Hold], error: BaseException) -> None:
        """After a pass raised ``error``: renew each hold alone; one that raises is lost."""
        log.error("redislock: renewing %d holds raised %r; renewing each alone", len(holds), error)
        for hold in holds:
            if id(hold) not in self._holds:
                continue  # released (or dropped) meanwhile
            try:
                self._renew([hold])
            except Exception as exc:
                with self._cond:
                    self._give_up(hold, f"renewing it raised {exc!r}")

    def _renew(self, holds: Sequence[Hold]) -> None:
        with self._cond:
            holds = self._drop_abandoned(holds)
        if not holds:
            return
        sent_at = time.monotonic()
        try:
            with self._cond:
                pipe, chunks = self._pipeline(holds)
            replies = pipe.execute(raise_on_error=False)
            if any(isinstance(r, NoScriptError) for r in replies):
                self._client.script_load(self._scripts.renew.script)
                with self._cond:
                    pipe, chunks = self._pipeline(holds)
                replies = pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException) as exc:
            with self._cond:
                self._failed(holds, exc)
            return
        with self._cond:
            self._apply(chunks, replies, sent_at)


class AsyncRenewalScheduler(_SchedulerBase):
    """The watchdog task of one ``redis.asyncio`` connection pool in one event loop."""

    _asyncio_client = True

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, hold: Hold, renew_by: float | None = None) -> None:
        """See :meth:`RenewalScheduler.add`."""
        self._holds[id(hold)] = hold
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif hold.next_due < self._wake_at and (renew_by is None or self._wake_at > renew_by):
            self._wake.set()

    def remove(self, hold: Hold) -> None:
        self._holds.pop(id(hold), None)
        if not self._holds and self._wake_at - time.monotonic() > IDLE_EXIT:
            self._wake.set()

    @property
    def running(self) -> bool:
        return self._task is not None

    async def aclose(self) -> None:
        """Stop renewing (held locks then expire after their lease) and close connections."""
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        try:
            while True:
                try:
                    wait, due = self._next_wait()
                except Exception as exc:  # a hold that cannot be scheduled: drop it alone
                    if not self._drop_unrenewable(list(self._holds.values()), exc):
                        await asyncio.sleep(ERROR_PAUSE)
                    continue
                if wait is None:
                    self._wake.clear()
                    self._wake_at = time.monotonic() + IDLE_EXIT
                    if not await wait_event(self._wake, IDLE_EXIT) and not self._holds:
                        return
                    continue
                if not due:
                    self._wake.clear()
                    await wait_event(self._wake, wait)
                    continue
                try:
                    await self._renew(due)
                except Exception as exc:  # not Redis's (those are retried): find the hold
                    await self._renew_one_by_one(due, exc)
        finally:
            self._task = None
            if self._private:
                await _disconnect(self._client)

    async def _renew_one_by_one(self, holds: Sequence[Hold], error: BaseException) -> None:
        """See :meth:`RenewalScheduler._renew_one_by_one`."""
        log.error("redislock: renewing %d holds raised %r; renewing each alone", len(holds), error)
        for hold in holds:
            if id(hold) not in self._holds:
                continue  # released (or dropped) meanwhile
            try:
                await self._renew([hold])
            except Exception as exc:
                self._give_up(hold, f"renewing it raised {exc!r}")

    async def _renew(self, holds: Sequence[Hold]) -> None:
        holds = self._drop_abandoned(holds)
        if not holds:
            return
        sent_at = time.monotonic()
        try:
            pipe, chunks = self._pipeline(holds)
            replies = await pipe.execute(raise_on_error=False)
            if any(isinstance(r, NoScriptError) for r in replies):
                await self._client.script_load(self._scripts.renew.script)
                pipe, chunks = self._pipeline(holds)
                replies = await pipe.execute(raise_on_error=False)
        except (RedisError, RedisClusterException) as exc:
            self._failed(holds, exc)
            return
        self._apply(chunks, replies, sent_at)


def _unreplicated(min_replicas: int, acks: Any) -> LockReplicationError:
    got = acks if isinstance(acks, Exception) else f"{acks} acknowledged"
    return LockReplicationError(f"renewal needs {min_replicas} replicas; {got}")


def _by_slot(client: Any, holds: Sequence[Hold]) -> list[list[Hold]]:
    """One group per cluster slot for cluster clients (a script's keys share a slot)."""
    keyslot = getattr(client, "keyslot", None)
    if keyslot is None:
        return [list(holds)]
    groups: dict[int, list[Hold]] = {}
    for hold in holds:
        groups.setdefault(keyslot(hold.keys.lock), []).append(hold)
    return list(groups.values())


#: Per connection pool (or cluster client), this process's watchdog (none in a forked child).
_schedulers: ProcessRegistry[Any, RenewalScheduler] = ProcessRegistry()


def scheduler_for(client: Any) -> RenewalScheduler:
    """The watchdog shared by every lock on ``client``'s connection pool in this process."""
    key = getattr(client, "connection_pool", client)
    found = _schedulers.peek(key)  # (made already, as a rule: no mutex then)
    return found if found is not None else _schedulers.get(key, lambda: RenewalScheduler(client))


_PerLoop = weakref.WeakKeyDictionary[Any, AsyncRenewalScheduler]
#: Event loop -> connection pool -> its watchdog task, in this process.
_async_schedulers: ProcessRegistry[Any, _PerLoop] = ProcessRegistry()


def async_scheduler_for(client: Any, *, create: bool = True) -> AsyncRenewalScheduler | None:
    """The watchdog task shared by every asyncio lock on ``client``'s pool in this loop."""
    per_loop = _async_schedulers.get(asyncio.get_running_loop(), weakref.WeakKeyDictionary)
    key = getattr(client, "connection_pool", client)
    found = per_loop.get(key)
    if found is None and create:
        found = per_loop[key] = AsyncRenewalScheduler(client)
    return found
