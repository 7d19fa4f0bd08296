"""Faults at every round trip of a lock's life (issue 15).

A :class:`~celery_redislock.testing.FaultProxy` sits between owner A and a real
``redis-server``; A is walked through each step of a lock's life (acquire, re-entry,
a blocked acquire: joining the line, the wake-up, the grant; renewal, extend,
release of the last and of an inner hold, force_release) while one command of that
step is dropped, loses its reply, is delayed, stalls past the socket timeout (and
lands late), or meets a partition. Owner B contends on a direct connection. Every
case checks the three promises:

* **never two holders**: no section of B overlaps a section of A. A section runs from
  the acquire to the last moment its code was entitled to act (its last passed
  ``ensure_held()`` / ``lost`` check, or its release call); every expected section is
  seen, and tokens increase in the order sections start;
* **never a stuck lock**: once the fault is over, A's hold leaves Redis within the
  lease plus a margin (it is not renewed forever), and B gets the lock;
* **told**: a holder whose lease is lost learns it as a loss (``lock.lost``,
  ``LockLostError``), never as a silent vanishing; a holder that released is never
  told afterwards that it lost the lock.

Cases that fail because of a known bug of the lock core are strict xfails naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import redis
import redis.asyncio

from celery_redislock import (
    AsyncRedisLock,
    LockLostError,
    LockNotOwnedError,
    RedisLock,
    RedLock,
)
from celery_redislock._core import GRANT_MS, LockKeys, thread_owner
from celery_redislock._scripts import SCRIPT_NAMES, source
from celery_redislock.aio import aclose_background, task_owner
from celery_redislock.testing import Fault, FaultProxy, RedisServer

from .._support import wait_until

NAME = "walk"
KEYS = LockKeys.for_name(NAME)
#: The lease of every lock here (renewed every 0.2 s).
TTL = 0.6
#: A's socket timeout: a stall longer than this makes A give up.
SOCKET_TIMEOUT = 0.3
#: Under the socket timeout: the command is slow, not failed.
DELAY = 0.15
#: Over the socket timeout: A gives up, and the command reaches Redis late.
STALL = 0.45
#: A partition shorter than the lease (the hold can survive it).
SHORT_PARTITION = 0.25
#: A partition longer than the lease (the hold cannot).
LONG_PARTITION = 1.2
#: Scheduling slack on a loaded 2-core machine.
SLACK = 0.6
#: How often a holder checks that it still holds the lock.
STEP = 0.01
NETWORK = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

ISSUE_INNER = (
    "issue 15 #1: an inner release that fails on a connection error keeps its hold "
    "renewed after the outer block has released"
)
ISSUE_LATE = (
    "issue 15: a renewal hanging on a blackholed connection at the validity deadline "
    "delays lock.lost until its socket timeout, after another owner got in"
)
ISSUE_DEFERRED = (
    "issue 15 #1 fix: a release retried in the background (or landing late) releases "
    "the same owner's next hold"
)
ISSUE_RETRY = (
    "issue 15: redis-py re-sends a script whose reply was lost (its default retry); "
    "release and acquire are not idempotent"
)


# ----------------------------------------------------------------------- the record


@dataclass
class Section:
    """One critical section: from the acquire to the last moment its code could act."""

    owner: str
    token: int | None
    start: float
    last_ok: float
    #: How its code learnt the lock was gone (None: it ran to its release).
    told: str | None = None


@dataclass
class Record:
    sections: list[Section] = field(default_factory=list)
    mutex: threading.Lock = field(default_factory=threading.Lock)

    def open(self, owner: str, token: int | None) -> Section:
        now = time.monotonic()
        section = Section(owner, token, now, now)
        with self.mutex:
            self.sections.append(section)
        return section

    def of(self, owner: str) -> list[Section]:
        return [s for s in self.sections if s.owner == owner]

    def check(self, tolerance: float = 0.0, **expected: int) -> None:
        """Each owner had the expected number of sections; none overlapped another
        owner's (by more than ``tolerance`` seconds); tokens increase in the order
        sections started."""
        seen = {o: len(self.of(o)) for o in {s.owner for s in self.sections} | set(expected)}
        assert seen == {o: expected.get(o, 0) for o in seen}, self.sections
        ordered = sorted(self.sections, key=lambda s: s.start)
        for i, first in enumerate(ordered):
            for second in ordered[i + 1 :]:
                if first.owner != second.owner:
                    assert second.start >= first.last_ok - tolerance, (
                        f"{second.owner} entered {first.last_ok - second.start:.3f}s before "
                        f"{first.owner} last acted under the lock: {ordered}"
                    )
        tokens = [s.token for s in ordered if s.token is not None]
        assert tokens == sorted(set(tokens)), f"tokens out of order: {ordered}"


def work(lock: Any, section: Section, seconds: float, *, local_check: bool = True) -> bool:
    """Hold ``lock`` for ``seconds``, checking ``lost`` and ``ensure_held()`` every STEP:
    the section ends at the first sign of loss. False if it ended so.

    ``local_check=False``: watch ``lock.lost`` alone (code that relies on the watchdog's
    report, as a callback or a flag, rather than on the local deadline check)."""
    end = time.monotonic() + seconds
    while True:
        if lock.lost:
            section.told = f"lost ({lock.lost.reason})"
            return False
        try:
            if local_check:
                lock.ensure_held()
        except LockLostError as exc:
            section.told = f"LockLostError ({exc.reason})"
            return False
        except LockNotOwnedError:
            section.told = "LockNotOwnedError: the hold vanished without a loss report"
            return False
        section.last_ok = time.monotonic()
        if section.last_ok >= end:
            return True
        time.sleep(STEP)


async def awork(lock: AsyncRedisLock, section: Section, seconds: float) -> bool:
    """:func:`work` for the asyncio lock."""
    end = time.monotonic() + seconds
    while True:
        if lock.lost:
            section.told = f"lost ({lock.lost.reason})"
            return False
        try:
            lock.ensure_held()
        except LockLostError as exc:
            section.told = f"LockLostError ({exc.reason})"
            return False
        except LockNotOwnedError:
            section.told = "LockNotOwnedError: the hold vanished without a loss report"
            return False
        section.last_ok = time.monotonic()
        if section.last_ok >= end:
            return True
        await asyncio.sleep(STEP)


class Job:
    """A function run in a thread; ``join()`` returns its result or raises its error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # handed to join()
            self.error = exc

    def join(self, timeout: float = 15.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


# ----------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


class Walk:
    """One case: the proxy, owner A's clients through it, owner B's direct ones."""

    def __init__(self, server: RedisServer, proxy: FaultProxy) -> None:
        self.server = server
        self.proxy = proxy
        self.admin = server.client()
        preload(self.admin)
        self.record = Record()
        #: (owner, reason, when) of every loss reported to A's locks.
        self.losses: list[tuple[str, str, float]] = []
        self._clients: list[Any] = [self.admin]
        self.locks: list[Any] = []
        self._jobs: list[Job] = []

    def client(self, retry: bool = False) -> redis.Redis:
        """A client through the proxy: small timeouts; redis-py's default retries or none."""
        options: dict[str, Any] = {} if retry else {"retry": None}
        client = self.proxy.client(
            socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT, **options
        )
        self._clients.append(client)
        return client

    def direct(self) -> redis.Redis:
        client = self.server.client(socket_timeout=2.0)
        self._clients.append(client)
        return client

    def lock(self, client: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("ttl", TTL)
        lock = (AsyncRedisLock if isinstance(client, redis.asyncio.Redis) else RedisLock)(
            client, NAME, **kwargs
        )
        lock.on_lost(lambda _lock, error: self.losses.append((error.owner, error.reason, now())))
        self.locks.append(lock)
        return lock

    def inject(self, action: str, on: Any, *, nth: int = 1, seconds: float | None = None) -> Fault:
        if seconds is None:
            seconds = {"delay": DELAY, "stall": STALL, "refuse": SHORT_PARTITION}.get(action)
        return self.proxy.inject(action, on, nth=nth, seconds=seconds)

    def keep(self, thing: Any) -> Any:
        """Close this client, or this lock's renewals, at the end of the case."""
        (self.locks if isinstance(thing, (RedisLock, RedLock)) else self._clients).append(thing)
        return thing

    def spawn(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        self._jobs.append(job)
        return job

    def contender(self, owner: str = "B", *, timeout: float = 6.0, hold: float = 0.05) -> Job:
        """Owner B on a direct connection: a blocking acquire, a short section, release."""

        def run() -> Section | None:
            lock = RedisLock(self.direct(), NAME, ttl=TTL, owner=owner)
            self.locks.append(lock)
            if not lock.acquire(timeout=timeout):
                return None
            section = self.record.open(owner, lock.token)
            work(lock, section, hold)
            lock.release()
            return section

        return self.spawn(run)

    def in_line(self, count: int = 1, within: float = 3.0) -> None:
        """Wait until ``count`` waiters are in the lock's line."""
        deadline = now() + within
        while int(self.admin.llen(KEYS.waiters)) < count:
            assert now() < deadline, "the waiter never joined the line"
            time.sleep(0.005)

    def gone(self, owner: str, by: float) -> None:
        """Never a stuck lock: ``owner``'s hold and place in line leave Redis by ``by``
        (monotonic). Gone is final: a renewal never recreates a key, and a late command
        has landed by the time a case calls this (see :func:`_finish_fault`)."""
        while self.admin.hexists(KEYS.lock, owner) or self.admin.zscore(KEYS.claims, owner):
            pttl = self.admin.pttl(KEYS.lock)
            assert now() < by, (
                f"{owner}'s hold is still in Redis at the bound "
                f"(lock pttl {pttl} ms, hold count {self.admin.hget(KEYS.lock, owner)!r}): "
                f"it is being renewed"
            )
            time.sleep(0.01)

    def lost(self, owner: str, *, wait: float = 0.0) -> list[str]:
        """The losses reported to ``owner``'s locks (waiting up to ``wait`` s for one:
        ``lock.lost`` is set a moment before the callbacks run)."""
        deadline = now() + wait
        while True:
            found = [reason for who, reason, _ in self.losses if who == owner]
            if found or now() >= deadline:
                return found
            time.sleep(0.005)

    def close(self) -> None:
        for lock in self.locks:
            if not isinstance(lock, AsyncRedisLock):  # closed in their event loop
                lock.close()  # a hold a bug keeps renewing must not outlive its case
        for job in self._jobs:
            job.thread.join(15)
        for client in self._clients:
            client.close()


def now() -> float:
    return time.monotonic()


def preload(admin: redis.Redis) -> None:
    """Empty one of this module's servers and cache the scripts there (a NOSCRIPT
    reply and its retry would count as two commands)."""
    admin.flushall()
    for name in SCRIPT_NAMES:
        admin.script_load(source(name))


@pytest.fixture
def walk(server: RedisServer) -> Iterator[Walk]:
    with FaultProxy(server) as proxy:
        case = Walk(server, proxy)
        try:
            yield case
        finally:
            case.close()


def attempt(call: Callable[[], Any]) -> Any:
    """``call()``'s result, or the redis network error it raised."""
    try:
        return call()
    except NETWORK as exc:
        return exc


# ----------------------------------------------------------------------- the proxy itself


def test_the_proxy_knows_commands_and_scripts_and_counts_them(walk: Walk) -> None:
    client = walk.client()
    lock = walk.lock(client, owner="A", auto_renew=False)
    assert lock.acquire() and lock.acquire()
    lock.release()
    lock.release()
    RedisLock.force_release(client, NAME)
    assert walk.proxy.count("acquire") == 2
    assert walk.proxy.count("release") == 3
    assert walk.proxy.count("release:one") == 2 and walk.proxy.count("release:force") == 1
    assert walk.proxy.count("EVALSHA") == 5 and walk.proxy.count("renew") == 0
    evalsha = next(c for c in walk.proxy.log if c.script == "acquire")
    assert evalsha.keys[0] == KEYS.lock and evalsha.argv[0] == b"A"


@pytest.mark.parametrize("action", ["drop", "drop_reply", "delay", "stall", "refuse"])
def test_each_fault_does_what_it_says(walk: Walk, action: str) -> None:
    client = walk.client()
    fault = walk.inject(action, "SET", nth=2)
    client.set("k", "1")
    started = now()
    outcome = attempt(lambda: client.set("k", "2"))
    took = now() - started
    assert fault.fired.is_set() and fault.command is not None
    assert fault.command.args == [b"k", b"2"]
    value = walk.admin.get("k")
    if action == "drop":
        assert isinstance(outcome, redis.exceptions.ConnectionError) and value == b"1"
    elif action == "drop_reply":
        assert isinstance(outcome, redis.exceptions.ConnectionError) and value == b"2"
    elif action == "delay":
        assert outcome is True and took >= DELAY and value == b"2"
    elif action == "stall":
        assert isinstance(outcome, redis.exceptions.TimeoutError) and value == b"1"
        assert fault.over.wait(5)
        deadline = now() + 2
        while walk.admin.get("k") != b"2":  # it lands late
            assert now() < deadline
            time.sleep(0.01)
    else:
        assert isinstance(outcome, redis.exceptions.ConnectionError) and value == b"1"
        assert isinstance(attempt(lambda: client.get("k")), redis.exceptions.ConnectionError)
        time.sleep(SHORT_PARTITION)
        assert client.get("k") == b"1"  # healed
    assert walk.proxy.count("SET") == (2 if action in ("drop_reply", "delay", "stall") else 1)


def test_a_stall_holds_the_connection_until_resumed(walk: Walk) -> None:
    client = walk.keep(walk.proxy.client(retry=None))
    slow = walk.keep(walk.proxy.client(socket_timeout=5.0, retry=None))
    fault = walk.inject("stall", "GET", seconds=None)
    job = walk.spawn(lambda: slow.get("k"))
    assert fault.fired.wait(5)
    assert client.set("k", "v")  # other connections flow
    time.sleep(0.1)
    assert job.thread.is_alive()
    walk.proxy.resume()
    assert job.join() == b"v" and fault.over.is_set()


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_pushed_message_can_be_dropped(walk: Walk, protocol: int) -> None:
    client = walk.keep(walk.proxy.client(retry=None, protocol=protocol))
    walk.inject("drop_reply", "GET")
    with pytest.raises(redis.exceptions.ConnectionError):
        client.get("k")  # the reply was matched to its command, and cut
    assert client.get("k") is None
    subscriber = client.pubsub()
    subscriber.subscribe("ch")
    assert subscriber.get_message(timeout=1)["type"] == "subscribe"  # type: ignore[index]
    fault = walk.inject("drop", "message")
    walk.admin.publish("ch", "hello")
    assert fault.fired.wait(5)
    with pytest.raises(redis.exceptions.ConnectionError):
        subscriber.get_message(timeout=1)
    subscriber.close()


def test_closing_the_proxy_leaves_no_thread_behind(server: RedisServer) -> None:
    before = {t for t in threading.enumerate() if t.name.startswith("faultproxy")}
    with FaultProxy(server) as proxy:
        client = proxy.client(retry=None)
        proxy.inject("stall", "PING", nth=2, seconds=None)
        client.ping()
        job = Job(lambda: attempt(client.ping))
        time.sleep(0.05)
    assert isinstance(job.join(), redis.exceptions.ConnectionError)
    client.close()
    after = {t for t in threading.enumerate() if t.name.startswith("faultproxy")}
    assert after == before == set()


def test_the_record_catches_an_overlap_a_missing_section_and_a_stale_token() -> None:
    record = Record()
    a = record.open("A", 2)
    b = record.open("B", 1)
    a.last_ok = b.start + 0.01  # A acted after B entered
    with pytest.raises(AssertionError, match="B entered"):
        record.check(A=1, B=1)
    with pytest.raises(AssertionError):
        record.check(A=1, B=2)
    a.last_ok = a.start
    with pytest.raises(AssertionError, match="tokens out of order"):
        record.check(A=1, B=1)


# ----------------------------------------------------------------------- the walk
#
# Each case: (step, fault, redis-py retries on). redis-py's default client re-sends a
# command that failed on a connection error (8.1: up to 10 times, with backoff); the
# lock's scripts go to a pooled connection directly (``_scripts.run``) and are never
# re-sent, so a script's call fails alike with retries on or off: the retry cases show it.


def case(step: str, action: str, retry: bool = False, *, xfail: str | None = None) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    name = f"{step}-{action}-{'retry' if retry else 'noretry'}"
    return pytest.param(step, action, retry, id=name, marks=marks)


#: Whether A's call fails (its script is never re-sent).
FAILS = {"drop": True, "drop_reply": True, "delay": False, "stall": True, "refuse": True}


def _finish_fault(fault: Fault) -> float:
    """Wait until the fault is over (a stall's command has landed, a partition has
    healed); returns when."""
    assert fault.over.wait(10), f"{fault} never ended"
    ends_at = fault.ends_at
    if fault.action in ("refuse", "blackhole") and ends_at is not None:
        time.sleep(max(0.0, ends_at - now()))
    elif fault.action in ("delay", "stall"):
        time.sleep(0.02)  # sent on: let Redis run it
    return now()


ACQUIRE_CASES = [
    case("acquire", "drop"),
    case("acquire", "drop", retry=True),
    case("acquire", "drop_reply"),
    case("acquire", "delay"),
    case("acquire", "stall"),
    case("acquire", "stall", retry=True),
    case("acquire", "refuse"),
]


@pytest.mark.parametrize(("step", "action", "retry"), ACQUIRE_CASES)
def test_uncontended_acquire(walk: Walk, step: str, action: str, retry: bool) -> None:
    a = walk.lock(walk.client(retry), owner="A")
    fault = walk.inject(action, "acquire")
    outcome = attempt(lambda: a.acquire(blocking=False))
    assert fault.fired.is_set()
    b = walk.contender()
    told_lost = False  # A was told its hold was lost (the only loss it may be told of)
    if FAILS[action]:
        assert isinstance(outcome, NETWORK)
    else:
        assert outcome is True
        section = walk.record.open("A", a.token)
        kept = work(a, section, 0.2)
        # redis-py's retries can outlast the lease: A cannot tell when the attempt that
        # succeeded was sent, so it counts the lease from the first and is told at once.
        assert kept or section.told == "LockLostError (deadline)", section.told
        told_lost = not kept
        a.release()
    settled = _finish_fault(fault)
    b_section = b.join()
    assert b_section is not None, "B never got the lock"
    # A hold A does not know of (its reply lost, or re-sent by redis-py) is never
    # renewed: it ends with its lease.
    assert b_section.start <= settled + TTL + SLACK
    walk.gone("A", by=settled + TTL + SLACK)
    walk.record.check(A=0 if isinstance(outcome, Exception) else 1, B=1)
    # Exactly the loss A was told of, or none: decided by what A saw, not by a clock.
    assert len(walk.lost("A", wait=1.0 if told_lost else 0.0)) == (1 if told_lost else 0)


REENTRY_CASES = [
    case("reentry", "drop"),
    case("reentry", "drop_reply"),
    case("reentry", "stall"),
]


@pytest.mark.parametrize(("step", "action", "retry"), REENTRY_CASES)
def test_reentry(walk: Walk, step: str, action: str, retry: bool) -> None:
    """``with lock: with lock: ...`` where the inner acquire meets the fault."""
    a = walk.lock(walk.client(retry), owner="A")
    assert a.acquire()
    section = walk.record.open("A", a.token)
    b = walk.contender()
    walk.in_line()
    fault = walk.inject(action, "acquire")
    inner = attempt(a.acquire)
    if FAILS[action]:
        assert isinstance(inner, NETWORK) and a.hold_count == 1
    else:
        assert inner is True and a.hold_count == 2
        assert work(a, section, 0.1), section.told
        a.release()
    assert work(a, section, 0.05), section.told
    a.release()
    settled = _finish_fault(fault)
    assert b.join() is not None
    walk.gone("A", by=settled + TTL + SLACK)
    walk.record.check(A=1, B=1)
    assert walk.lost("A") == []


BLOCKED_CASES = [
    case("join", "drop"),
    case("join", "drop", retry=True),
    case("join", "drop_reply"),
    case("join", "stall"),
    case("subscribe", "drop"),
    case("subscribe", "delay"),
    case("wake-up", "drop"),
    case("wake-up", "delay"),
    case("wake-up", "stall"),
    case("grant", "drop"),
    case("grant", "drop_reply"),
    case("grant", "stall"),
]


@pytest.mark.parametrize(("step", "action", "retry"), BLOCKED_CASES)
def test_blocked_acquire(walk: Walk, step: str, action: str, retry: bool) -> None:
    """B holds; A blocks (joins the line, is woken by B's release, takes the lock).

    A waits with its thread as owner (a direct grant: no round trip after the
    wake-up), except for the "grant" step, where an explicit owner takes the lock
    B's release handed it with one more acquire.
    """
    holder = walk.keep(RedisLock(walk.direct(), NAME, ttl=2.0, owner="B", auto_renew=False))
    assert holder.acquire()
    b_section = walk.record.open("B", holder.token)
    explicit = step == "grant"
    a = walk.lock(walk.client(retry), owner="A" if explicit else None)
    owner: list[str] = []
    on = {"join": "acquire", "subscribe": "SUBSCRIBE", "wake-up": "message", "grant": "acquire"}
    fault = walk.inject(action, on[step], nth={"join": 2, "grant": 3}.get(step, 1))

    def wait() -> Any:
        owner.append("A" if explicit else thread_owner())
        outcome = attempt(lambda: a.acquire(timeout=4))
        if outcome is True:
            section = walk.record.open("A", a.token)
            assert work(a, section, 0.05), section.told
            a.release()
        return outcome

    job = walk.spawn(wait)
    if step in ("join", "subscribe"):
        assert fault.fired.wait(5)
    time.sleep(0.2)
    assert work(holder, b_section, 0.0)
    released = now()
    holder.release()
    outcome = job.join()
    settled = max(released, _finish_fault(fault))
    fails = FAILS[action] and step in ("join", "grant")
    if fails:
        assert isinstance(outcome, NETWORK)
    else:
        assert outcome is True
        if step == "grant" or (step, action) == ("wake-up", "drop"):
            # A try, a join, and a take-up: of a grant to an explicit owner, or of a
            # direct grant whose message was lost.
            assert walk.proxy.count("acquire") >= 3
        a_section = walk.record.of("A")[0]
        # Woken by the release (or, its wake-up lost, by its own re-check within the
        # lease B had left when A last tried), not by a lapse of the line.
        assert a_section.start - released <= TTL + SLACK
    assert fault.fired.is_set()
    # A place in line or a grant A no longer waits for lapses: a grant after GRANT_MS.
    walk.gone(owner[0], by=settled + GRANT_MS / 1000 + SLACK)
    walk.record.check(A=0 if fails else 1, B=1)
    assert walk.lost(owner[0]) == []


BOX_CASES = [
    case("box", "drop"),
    case("box", "drop_reply"),
    case("box", "delay"),
    case("box", "stall"),
]
#: A's socket timeout in the box cases: long enough for a lone waiter to read its own
#: grant (``_lone_waiter.BOX_MIN_TIMEOUT``); a box read lasts at most 0.25 s less.
BOX_SOCKET_TIMEOUT = 1.6


@pytest.mark.parametrize(("step", "action", "retry"), BOX_CASES)
def test_boxed_wait(walk: Walk, step: str, action: str, retry: bool) -> None:
    """B holds; A, its pool's lone waiter, blocks on its grant box (BLPOP) when the fault
    meets that read, then B releases. A read that fails or stalls past A's socket
    timeout sends the rest of A's wait to the subscriber; a grant popped by a read whose
    reply is lost is taken up by A's next attempt. Either way A gets the lock once, with
    no overlap, and leaves nothing behind."""
    holder = walk.keep(RedisLock(walk.direct(), NAME, ttl=2.0, owner="B", auto_renew=False))
    assert holder.acquire()
    b_section = walk.record.open("B", holder.token)
    client = walk.keep(
        walk.proxy.client(socket_timeout=BOX_SOCKET_TIMEOUT, socket_connect_timeout=0.3, retry=None)
    )
    a = walk.lock(client)
    owner: list[str] = []
    fault = walk.inject(action, "BLPOP", seconds={"stall": BOX_SOCKET_TIMEOUT + 0.3}.get(action))

    def wait() -> Any:
        owner.append(thread_owner())
        outcome = attempt(lambda: a.acquire(timeout=6))
        if outcome is True:
            section = walk.record.open("A", a.token)
            assert work(a, section, 0.05), section.told
            a.release()
        return outcome

    job = walk.spawn(wait)
    assert fault.fired.wait(5)
    time.sleep(0.2)
    assert work(holder, b_section, 0.0)
    released = now()
    holder.release()
    outcome = job.join()
    settled = max(released, _finish_fault(fault))
    assert outcome is True
    a_section = walk.record.of("A")[0]
    # Woken by the grant (or by its own re-check within the lease B had left), never
    # by a lapse of the line.
    assert a_section.start - released <= 2.0 + SLACK
    walk.gone(owner[0], by=settled + GRANT_MS / 1000 + SLACK)
    walk.record.check(A=1, B=1)
    assert walk.lost(owner[0]) == []


#: The renewal cases' lease: renewed every 0.3 s, so a renewal that stalls past the
#: watchdog's socket timeout (A's, 0.3 s) is retried well inside the lease.
RENEW_TTL = 0.9

RENEWAL_CASES = [
    case("renewal", "drop"),
    case("renewal", "stall"),
    case("renewal", "refuse"),
    case("renewal", "refuse-long"),
    case("renewal", "blackhole-long", xfail=ISSUE_LATE),
]
#: A's report of a loss comes from its watchdog thread, at the validity deadline; the
#: lease's drift allowance (1% + 2 ms: 11 ms here) is all that separates the deadline
#: from the key's expiry in Redis, so the report may trail B's entry by a thread's
#: scheduling delay.
REPORT_TOLERANCE = 0.05


@pytest.mark.parametrize(("step", "action", "retry"), RENEWAL_CASES)
def test_watchdog_renewal(walk: Walk, step: str, action: str, retry: bool) -> None:
    """A holds while its watchdog's first renewal meets the fault; B waits. A short
    fault costs nothing; a partition past the lease is a loss A is told of before B
    gets in: by ``ensure_held()`` when Redis refuses connections, and by ``lock.lost``
    alone when the network swallows packets (the renewal in flight at the deadline
    hangs; A's socket timeout is then the watchdog's own cap, 1 s)."""
    long = action.endswith("-long")
    blackhole = action == "blackhole-long"
    client = walk.client(retry)
    if blackhole:
        client = walk.keep(walk.proxy.client(socket_timeout=1.0, retry=None))
    a = walk.lock(client, owner="A", ttl=RENEW_TTL)
    assert a.acquire()
    section = walk.record.open("A", a.token)
    b = walk.contender()
    kind = action.removesuffix("-long")
    fault = walk.inject(kind, "renew", seconds=LONG_PARTITION if long else None)
    # Past the deadline the first renewal was to move (or until told).
    kept = work(a, section, 2.0 if long else 1.0, local_check=not blackhole)
    assert fault.fired.is_set()
    if long:
        assert not kept and section.told is not None
        reasons = walk.lost("A", wait=1.0)
        assert len(reasons) == 1 and (blackhole or reasons[0] in ("unreachable", "deadline"))
        _finish_fault(fault)
        with pytest.raises(LockLostError):
            a.release()
    else:
        assert kept, section.told
        a.release()
        assert walk.lost("A") == []
    assert b.join() is not None
    walk.gone("A", by=_finish_fault(fault) + RENEW_TTL + SLACK)
    walk.record.check(A=1, B=1, tolerance=REPORT_TOLERANCE if blackhole else 0.0)


EXTEND_CASES = [
    case("extend", "drop"),
    case("extend", "drop_reply"),
    case("extend", "stall"),
]


@pytest.mark.parametrize(("step", "action", "retry"), EXTEND_CASES)
def test_extend(walk: Walk, step: str, action: str, retry: bool) -> None:
    """A holds a fixed lease (no watchdog) and extends it; whatever the fault, A never
    believes in more lease than Redis gives it."""
    a = walk.lock(walk.client(retry), owner="A", auto_renew=False)
    assert a.acquire()
    section = walk.record.open("A", a.token)
    b = walk.contender()
    assert work(a, section, 0.2)
    fault = walk.inject(action, "renew")
    extended = attempt(lambda: a.extend(2 * TTL))
    assert fault.fired.is_set()
    assert isinstance(extended, NETWORK) == (FAILS[action])
    kept = work(a, section, 0.5)  # past the first lease, inside the extended one
    assert kept == (extended is None), section.told
    try:
        a.release()
    except LockLostError:
        assert not kept  # its lease ran out before the release: told so again
    assert b.join() is not None
    walk.gone("A", by=_finish_fault(fault) + 2 * TTL + SLACK)
    walk.record.check(A=1, B=1)


RELEASE_CASES = [
    case("release", "drop"),
    case("release", "drop", retry=True),
    case("release", "drop_reply"),
    case("release", "drop_reply", retry=True),
    case("release", "delay"),
    case("release", "stall"),
    case("release", "stall", retry=True),
    case("release", "refuse"),
]


@pytest.mark.parametrize(("step", "action", "retry"), RELEASE_CASES)
def test_release_of_the_last_hold(walk: Walk, step: str, action: str, retry: bool) -> None:
    """A releases its only hold while B waits in line.

    A release that reaches Redis hands the lock to B at once. One that cannot returns
    all the same and must not keep the lock: A stops renewing it (and retries the
    release in the background), so it is B's within a lease. Either way A, having
    released, is never told afterwards that it lost the lock.
    """
    a = walk.lock(walk.client(retry), owner="A")
    assert a.acquire()
    section = walk.record.open("A", a.token)
    b = walk.contender()
    walk.in_line()
    assert work(a, section, 0.15)
    fault = walk.inject(action, "release")
    released = now()
    try:
        outcome = attempt(a.release)
    except LockLostError as exc:
        sent = walk.proxy.count("release")
        raise AssertionError(f"A's release ran ({sent} sent), yet raised {exc!r}") from exc
    assert fault.fired.is_set()
    assert outcome is None, outcome  # the last hold's release returns, reached or not
    settled = _finish_fault(fault)
    walk.gone("A", by=max(released + TTL, settled) + SLACK)
    assert b.join() is not None
    if FAILS[action]:
        time.sleep(TTL / 2)  # a renewal that outlived the failed release reports by now
    assert walk.lost("A") == [], "A released, then was told it lost the lock"
    walk.record.check(A=1, B=1)


@pytest.mark.parametrize("action", ["drop_reply", "stall"])
def test_a_release_retried_in_the_background_spares_the_owners_next_hold(
    walk: Walk, action: str
) -> None:
    """A's release does not come back (its reply is lost, or it stalls): it returns and
    is retried in the background. A takes the lock again at once (a new hold of the
    same owner). Neither the retry nor the late original may release that new hold: B
    must not get in while A works under it."""
    a = walk.lock(walk.client(), owner="A", ttl=2.0)
    assert a.acquire()
    walk.inject(action, "release")
    a.release()
    assert a.acquire(blocking=False)
    section = walk.record.open("A", a.token)
    b = walk.contender()
    work(a, section, 1.0)
    with contextlib.suppress(LockLostError):
        a.release()
    assert b.join() is not None
    walk.record.check(A=1, B=1)


INNER_RELEASE_CASES = [
    case("inner-release", "drop"),
    case("inner-release", "drop_reply"),
    case("inner-release", "drop_reply", retry=True),
    case("inner-release", "stall"),
]


@pytest.mark.parametrize(("step", "action", "retry"), INNER_RELEASE_CASES)
def test_release_of_an_inner_hold(walk: Walk, step: str, action: str, retry: bool) -> None:
    """``with lock: (with lock: ...) ; more work``: the inner release meets the fault.

    If it fails, the error leaves both blocks (the outer release runs). If it returns,
    the outer block goes on working under the lock: it must still hold it, or be told.
    """
    a = walk.lock(walk.client(retry), owner="A")
    assert a.acquire() and a.acquire()
    section = walk.record.open("A", a.token)
    b = walk.contender()
    walk.in_line()
    assert work(a, section, 0.1)
    fault = walk.inject(action, "release")
    inner = attempt(a.release)
    assert fault.fired.is_set()
    if FAILS[action]:
        assert isinstance(inner, NETWORK)
    else:
        assert inner is None
        work(a, section, 0.3)
        assert section.told is None or section.told.startswith(("lost", "LockLostError")), (
            section.told
        )
    released = now()
    outer = attempt(a.release)
    assert outer is None, outer
    settled = _finish_fault(fault)
    walk.gone("A", by=max(released + TTL, settled) + SLACK)
    assert b.join() is not None
    if inner is not None:
        time.sleep(TTL / 2)  # a renewal that outlived the failed release reports by now
    assert walk.lost("A") == [], "A released, then was told it lost the lock"
    walk.record.check(A=1, B=1)


FORCE_CASES = [
    case("force-release", "drop"),
    case("force-release", "drop_reply"),
    case("force-release", "stall"),
]


@pytest.mark.parametrize(("step", "action", "retry"), FORCE_CASES)
def test_force_release(walk: Walk, step: str, action: str, retry: bool) -> None:
    """An operator force-releases A's lock through the proxy. Whenever it lands, A is
    told within a renewal interval, and B's token is newer than A's: a fenced resource
    refuses A's writes (the overlap itself is what force_release means)."""
    a = walk.lock(walk.client(retry), owner="A")
    assert a.acquire()
    section = walk.record.open("A", a.token)
    b = walk.contender(hold=0.2)
    walk.in_line()
    fault = walk.inject(action, "release:force")
    forced = attempt(lambda: RedisLock.force_release(walk.client(retry), NAME))
    assert fault.fired.is_set()
    assert isinstance(forced, NETWORK) == (FAILS[action])
    landed = _finish_fault(fault)
    kept = work(a, section, TTL)
    if action == "drop":
        assert kept and walk.lost("A") == []
        a.release()
    b_section = b.join()
    if action != "drop":
        assert not kept and walk.lost("A", wait=1.0) in (["expired"], ["stolen"]), walk.losses
        told_at = next(at for who, _, at in walk.losses if who == "A")
        assert told_at - landed <= TTL / 3 + SLACK
    assert b_section is not None and b_section.token is not None
    assert a.token is None or b_section.token > a.token
    assert b_section.token > section.token  # type: ignore[operator]
    walk.gone("A", by=landed + TTL + SLACK)


# ----------------------------------------------------------------------- asyncio


ASYNC_CASES = [
    case("acquire", "drop"),
    case("wake-up", "drop"),
    case("renewal", "partition"),
    case("release", "drop"),
    case("release", "drop_reply"),
]


@pytest.mark.parametrize(("step", "action", "retry"), ASYNC_CASES)
async def test_asyncio_lock(walk: Walk, step: str, action: str, retry: bool) -> None:
    client = walk.proxy.async_client(
        socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT, retry=None
    )
    try:
        await _async_walk(walk, client, step, action)
    finally:
        for lock in walk.locks:
            if isinstance(lock, AsyncRedisLock):
                lock.close()  # in its event loop
        await aclose_background(client)
        await client.aclose()


async def _async_walk(walk: Walk, client: Any, step: str, action: str) -> None:
    a = walk.lock(client, owner=None if step == "wake-up" else "A")
    owner = "A"
    if step == "acquire":
        fault = walk.inject(action, "acquire")
        outcome = await _aattempt(a.acquire(blocking=False))
        assert isinstance(outcome, NETWORK)
        b = walk.contender()
        settled = await asyncio.to_thread(_finish_fault, fault)
        assert await asyncio.to_thread(b.join) is not None
        walk.record.check(B=1)
    elif step == "wake-up":
        holder = walk.keep(RedisLock(walk.direct(), NAME, ttl=2.0, owner="B", auto_renew=False))
        assert holder.acquire()
        b_section = walk.record.open("B", holder.token)
        fault = walk.inject(action, "message")

        async def wait() -> Section:  # A's owner: this asyncio task
            owners.append(task_owner())
            assert await a.acquire(timeout=4)
            section = walk.record.open("A", a.token)
            assert await awork(a, section, 0.05), section.told
            await a.release()
            return section

        owners: list[str] = []
        waiting = asyncio.ensure_future(wait())
        await asyncio.sleep(0.2)
        assert work(holder, b_section, 0.0)
        released = now()
        holder.release()
        section = await waiting
        assert section.start - released <= TTL + SLACK
        settled = await asyncio.to_thread(_finish_fault, fault)
        owner = owners[0]
        walk.record.check(A=1, B=1)
    elif step == "renewal":
        assert await a.acquire()
        section = walk.record.open("A", a.token)
        b = walk.contender()
        fault = walk.inject("refuse", "renew", nth=2, seconds=LONG_PARTITION)
        assert not await awork(a, section, 4 * TTL)
        await asyncio.sleep(0.05)  # lock.lost is set a moment before the callbacks run
        assert walk.lost("A") in (["unreachable"], ["deadline"]), walk.losses
        settled = await asyncio.to_thread(_finish_fault, fault)
        assert await asyncio.to_thread(b.join) is not None
        walk.record.check(A=1, B=1)
    else:  # release
        assert await a.acquire()
        section = walk.record.open("A", a.token)
        b = walk.contender()
        await asyncio.to_thread(walk.in_line)
        assert await awork(a, section, 0.15)
        fault = walk.inject(action, "release")
        outcome = await _aattempt(a.release())
        assert outcome is None, outcome  # the last hold's release returns, reached or not
        settled = await asyncio.to_thread(_finish_fault, fault)
        await asyncio.to_thread(walk.gone, "A", settled + TTL + SLACK)
        assert await asyncio.to_thread(b.join) is not None
        await asyncio.sleep(TTL / 2)
        assert walk.lost("A") == [], "A released, then was told it lost the lock"
        walk.record.check(A=1, B=1)
    assert fault.fired.is_set()
    await asyncio.to_thread(walk.gone, owner, settled + TTL + SLACK)


async def _aattempt(call: Any) -> Any:
    try:
        return await call
    except NETWORK as exc:
        return exc


# ----------------------------------------------------------------------- the quorum lock


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[RedisServer]]:
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    for started in servers:
        started.cleanup()


QUORUM_CASES = [
    case("acquire", "drop"),
    case("acquire", "stall"),
    case("release", "drop"),
    case("release", "drop_reply"),
    case("release", "stall"),
]


@pytest.mark.parametrize(("step", "action", "retry"), QUORUM_CASES)
def test_quorum_lock_with_one_node_faulted(
    nodes: list[RedisServer], step: str, action: str, retry: bool
) -> None:
    """RedLock over three nodes, node 0 behind the proxy: one node's fault costs
    nothing (two of three decide), and its share of the lock ends with the lease."""
    admins = [n.client() for n in nodes]
    for admin in admins:
        preload(admin)
    record = Record()
    with FaultProxy(nodes[0]) as proxy:
        faulted = proxy.client(socket_timeout=SOCKET_TIMEOUT, retry=None)
        others = [n.client(socket_timeout=1.0) for n in nodes[1:]]
        a = RedLock([faulted, *others], NAME, ttl=TTL, owner="A", node_timeout=0.1)
        b_clients = [n.client(socket_timeout=1.0) for n in nodes]
        b = RedLock(b_clients, NAME, ttl=TTL, owner="B", node_timeout=0.1)
        try:
            if step == "release":
                assert a.acquire()
            fault = proxy.inject(action, step, seconds=STALL if action == "stall" else None)
            if step == "acquire":
                assert a.acquire(timeout=2)
            section = record.open("A", a.token)
            assert work(a, section, 0.2)
            b_job = Job(lambda: b.acquire(timeout=5))
            released = now()
            a.release()  # two of three nodes decide
            assert fault.fired.wait(5)  # node 0's share may land a moment later
            assert b_job.join() is True
            b_section = record.open("B", b.token)
            assert b_section.start - released <= SLACK
            work(b, b_section, 0.05)
            b.release()
            settled = _finish_fault(fault)
            deadline = settled + TTL + SLACK
            while any(c.hexists(KEYS.lock, "A") for c in admins):
                assert now() < deadline, "A's share of the lock outlived its lease on a node"
                time.sleep(0.01)
            record.check(A=1, B=1)
            assert not a.lost
        finally:
            for lock in (a, b):
                lock.close()
            for client in (faulted, *others, *b_clients, *admins):
                client.close()


# ----------------------------------------------------------------------- restarts


@pytest.mark.parametrize("aof", [True, False], ids=["aof-always", "no-persistence"])
def test_redis_restarted_under_a_held_lock(redis_server_factory: Any, aof: bool) -> None:
    """SIGKILL and restart while A holds. With AOF (appendfsync always) the hold and the
    token counter survive: A keeps the lock, B waits, B's token is newer. Without
    persistence the hold is gone: A is told within a renewal interval, and the token
    counter starts again (tokens go backwards: fence against a resource that survives)."""
    server = redis_server_factory(appendonly=aof, appendfsync="always")
    a_client = server.client(socket_timeout=SOCKET_TIMEOUT, retry=None)
    b_client = server.client(socket_timeout=1.0)
    a = RedisLock(a_client, NAME, ttl=1.5, owner="A")
    b = RedisLock(b_client, NAME, ttl=1.5, owner="B")
    losses: list[tuple[str, float]] = []
    a.on_lost(lambda _lock, error: losses.append((str(error.reason), now())))
    record = Record()
    try:
        assert a.acquire()
        section = record.open("A", a.token)
        server.restart()
        restarted = now()
        b_job = Job(lambda: b.acquire(timeout=5))
        kept = work(a, section, 1.0)
        if aof:
            assert kept and not losses
            a.release()
        else:
            assert not kept
            # The watchdog sets ``lost`` before it runs the on_lost callbacks (after its
            # signal and log): the section may end before the callback has run.
            wait_until(lambda: losses, timeout=5, what="the on_lost callback")
            assert [reason for reason, _ in losses] in (["expired"], ["stolen"])
            assert losses[0][1] - restarted <= 0.5 + SLACK
        assert b_job.join() is True
        b_section = record.open("B", b.token)
        b.release()
        if aof:
            assert b_section.token > section.token  # type: ignore[operator]
            record.check(A=1, B=1)
        else:
            assert b_section.token == 1  # the counter started again
    finally:
        a.close()
        b.close()
        a_client.close()
        b_client.close()


@pytest.mark.parametrize("aof", [True, False], ids=["aof-always", "no-persistence"])
def test_a_release_while_redis_is_down(redis_server_factory: Any, aof: bool) -> None:
    """A releases while Redis is down (longer than redis-py's retries, shorter than the
    lease). The release returns; once Redis is back, A's hold ends (released in the
    background, or by its lease), it is not renewed, and A is not told it lost a lock
    it released. With AOF the hold survived the restart: only that release frees it."""
    server = redis_server_factory(appendonly=aof, appendfsync="always")
    admin = server.client()
    client = server.client(socket_timeout=SOCKET_TIMEOUT, retry=None)
    a = RedisLock(client, NAME, ttl=1.0, owner="A")
    losses: list[str] = []
    a.on_lost(lambda _lock, error: losses.append(str(error.reason)))
    try:
        assert a.acquire()
        server.kill()
        a.release()  # Redis is down: retried in the background
        assert a.hold_count == 0
        time.sleep(0.2)
        server.start(server.port)
        back = now()
        deadline = back + 1.0 + SLACK
        while admin.hexists(KEYS.lock, "A"):
            assert now() < deadline, (
                f"A's released hold is still renewed (pttl {admin.pttl(KEYS.lock)} ms)"
            )
            time.sleep(0.02)
        time.sleep(0.6)
        assert losses == [], "A released, then was told it lost the lock"
    finally:
        a.close()
        client.close()
        admin.close()


def test_tokens_never_go_backwards_across_restarts_with_aof(redis_server_factory: Any) -> None:
    """appendfsync always: every acknowledged token increment survives a SIGKILL."""
    server = redis_server_factory(appendonly=True, appendfsync="always")
    client = server.client(socket_timeout=1.0)  # redis-py's retries reconnect after a restart
    lock = RedisLock(client, NAME, ttl=1.0, owner="A", auto_renew=False)
    tokens: list[int] = []
    try:
        for _ in range(3):
            assert lock.acquire()
            tokens.append(int(lock.token))  # type: ignore[arg-type]
            lock.release()
            server.restart()
        assert lock.acquire()
        tokens.append(int(lock.token))  # type: ignore[arg-type]
        lock.release()
        assert tokens == [1, 2, 3, 4]
    finally:
        lock.close()
        client.close()


# ----------------------------------------------------------------------- found bugs, pinned


def test_a_script_whose_reply_was_lost_is_not_re_sent_by_a_retrying_client(walk: Walk) -> None:
    """The acquire ran and its reply was lost, on a client with redis-py's default
    retries (which re-sent it before: a re-entry, count 2, told 1, and the release that
    followed left the lock held, unrenewed, for a whole lease). Now the scripts go to a
    pooled connection directly: the call raises, the script ran once, and the hold A does
    not know of ends with its lease; A's next acquire and release leave nothing held."""
    a = walk.lock(walk.client(retry=True), owner="A", ttl=3.0)
    walk.inject("drop_reply", "acquire")
    assert isinstance(attempt(lambda: a.acquire()), NETWORK)
    assert walk.proxy.count("acquire") == 1  # ran once: not re-sent
    assert a.hold_count == 0
    assert walk.admin.exists(KEYS.lock)  # the unknown hold, with its lease
    assert 0 < walk.admin.pttl(KEYS.lock) <= 3000
    walk.gone("A", by=now() + 3.0 + SLACK)
    assert a.acquire(blocking=False) and a.hold_count == 1
    a.release()
    assert not walk.admin.exists(KEYS.lock)
