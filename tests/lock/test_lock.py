"""RedisLock against a real redis-server: ownership, reentrancy, tokens, waiting, errors."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import (
    LockConfigurationError,
    LockNotOwnedError,
    LockTimeoutError,
    RedisLock,
    RedisLockError,
)
from celery_redislock import _scripts as scripts_module
from celery_redislock._scripts import scripts_for
from celery_redislock.testing import RedisServer

from .. import _procs


def in_thread(fn, *args):  # type: ignore[no-untyped-def]
    """Run ``fn`` in a new thread (a different default owner) and return its result."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(30)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def test_acquire_release_round_trip(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job")
    assert not lock.locked()
    assert lock.acquire()
    assert lock.locked() and lock.owned()
    assert lock.hold_count == 1
    assert lock.token == 1
    lock.release()
    assert not lock.locked()
    assert lock.hold_count == 0 and lock.token is None
    assert redis_client.keys("*") == [b"redislock:{job}:fence"]  # only the counter stays


def test_reentrant_holds_need_one_release_each(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job")
    assert lock.acquire() and lock.acquire() and lock.acquire()
    assert lock.hold_count == 3
    assert redis_client.hget(lock.keys.lock, lock._current_owner()) == b"3"
    token = lock.token
    lock.release()
    lock.release()
    assert lock.locked() and lock.hold_count == 1 and lock.token == token
    assert in_thread(lambda: RedisLock(redis_client, "job").acquire(blocking=False)) is False
    lock.release()
    assert not lock.locked()


def test_other_thread_is_another_owner_and_cannot_release(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job")
    lock.acquire()
    with pytest.raises(LockNotOwnedError, match="'job'") as info:
        in_thread(lock.release)
    assert "another owner holds it" in str(info.value)
    assert lock.owned() and lock.hold_count == 1
    lock.release()


def test_release_when_not_locked_raises_and_changes_nothing(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job")
    with pytest.raises(LockNotOwnedError) as info:
        lock.release()
    assert info.value.name == "job" and info.value.owner
    assert isinstance(info.value, RedisLockError)


def test_release_reports_how_the_hold_ended_and_touches_nothing_else(
    redis_client: redis.Redis,
) -> None:
    lock = RedisLock(redis_client, "job", auto_renew=False)
    keys = lock.keys.release_keys()
    release = scripts_for(redis_client).release
    assert release(keys=keys, args=["nobody"]) == -1  # not locked
    lock.acquire()
    assert release(keys=keys, args=["nobody"]) == -2  # another owner holds it
    assert release(keys=keys, args=["nobody", "all"]) == -2
    assert release(keys=keys, args=["nobody", "hold", 5000]) == -2
    assert lock.owned() and redis_client.pttl(lock.keys.lock) > 20_000
    lock.release()
    assert not lock.locked()


def test_a_flushed_script_cache_is_reloaded_by_acquire_and_release(
    redis_client: redis.Redis,
) -> None:
    lock = RedisLock(redis_client, "job")
    redis_client.script_flush()
    assert lock.acquire(blocking=False)
    redis_client.script_flush()
    lock.release()
    assert not lock.locked()


def test_explicit_owner_hands_a_hold_across_threads(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job", owner="task-42")
    lock.acquire()
    assert in_thread(lambda: RedisLock(redis_client, "job", owner="task-42").owned()) is True
    in_thread(lambda: RedisLock(redis_client, "job", owner="task-42").release())
    assert not lock.locked()


def test_explicit_owner_hands_a_hold_across_processes(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    holder = _procs.run(_procs.hold_then_report, redis_server.port, "job", 30.0, "task-7", "ready")
    try:
        assert redis_client.blpop(["ready"], timeout=20) is not None
        _procs.run(_procs.release_as, redis_server.port, "job", "task-7", "result").join(20)
        assert redis_client.lpop("result") == b"released"
        assert not redis_client.exists("redislock:{job}")
    finally:
        _procs.sigkill(holder)


def test_release_by_wrong_explicit_owner_is_refused(redis_client: redis.Redis) -> None:
    RedisLock(redis_client, "job", owner="a").acquire()
    with pytest.raises(LockNotOwnedError):
        RedisLock(redis_client, "job", owner="b").release()
    assert RedisLock(redis_client, "job", owner="a").owned()


def test_tokens_strictly_increase_across_holders(redis_client: redis.Redis) -> None:
    tokens = []
    for i in range(5):
        lock = RedisLock(redis_client, "job", owner=f"owner-{i}")
        lock.acquire()
        lock.acquire()  # re-entry keeps the token
        tokens.append(lock.token)
        lock.release()
        lock.release()
    assert tokens == sorted(set(tokens)) and len(tokens) == 5


def test_tokens_survive_expiry_of_the_lock_key(redis_client: redis.Redis) -> None:
    first = RedisLock(redis_client, "job", ttl=0.05, auto_renew=False)
    first.acquire()
    token = first.token
    time.sleep(0.1)
    second = RedisLock(redis_client, "job", owner="next")
    second.acquire()
    assert second.token is not None and token is not None and second.token > token


def test_non_blocking_and_timed_out_acquires_return_false(redis_client: redis.Redis) -> None:
    RedisLock(redis_client, "job", owner="holder").acquire()
    waiter = RedisLock(redis_client, "job", owner="waiter")
    assert waiter.acquire(blocking=False) is False
    assert waiter.acquire(timeout=0.2) is False
    assert waiter.hold_count == 0


def test_context_manager_raises_lock_timeout_error(redis_client: redis.Redis) -> None:
    RedisLock(redis_client, "job", owner="holder").acquire()
    with pytest.raises(LockTimeoutError, match="'job'") as info:
        with RedisLock(redis_client, "job", owner="waiter", timeout=0.1):
            pytest.fail("body must not run")
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(LockTimeoutError, match="non-blocking"):
        with RedisLock(redis_client, "job", owner="waiter", blocking=False):
            pytest.fail("body must not run")


def test_context_manager_releases_on_exception(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job")
    with pytest.raises(KeyError), lock:
        assert lock.owned()
        raise KeyError("boom")
    assert not lock.locked()


def test_waiter_is_woken_by_release_not_by_expiry(redis_client: redis.Redis) -> None:
    holder = RedisLock(redis_client, "job", ttl=60, auto_renew=False)
    holder.acquire()
    result: list[bool] = []
    waiter = threading.Thread(
        target=lambda: result.append(RedisLock(redis_client, "job").acquire(timeout=20))
    )
    waiter.start()
    time.sleep(0.3)
    assert result == []  # still waiting: the holder has 60 s left
    holder.release()
    waiter.join(20)
    # Acquired long before the 60 s lease could have expired: only the release can have woken it.
    assert result == [True]


def test_waiter_acquires_after_a_killed_holders_lease_expires(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    holder = _procs.run(_procs.hold_then_report, redis_server.port, "job", 1.0, None, "ready")
    ready = redis_client.blpop(["ready"], timeout=20)
    assert ready is not None
    _procs.sigkill(holder)  # no release will ever be published
    lock = RedisLock(redis_client, "job")
    assert lock.acquire(timeout=15)
    assert lock.token == int(ready[1]) + 1


def test_one_release_wakes_one_waiter_per_process(redis_client: redis.Redis) -> None:
    holder = RedisLock(redis_client, "job", ttl=60, auto_renew=False)
    holder.acquire()
    results: list[bool] = []
    go = threading.Event()

    def wait_then_pass_on() -> None:
        lock = RedisLock(redis_client, "job", ttl=60, auto_renew=False)
        ok = lock.acquire(timeout=30)
        results.append(ok)
        if ok:
            go.wait(30)
            lock.release()  # wakes the next waiter

    waiters = [threading.Thread(target=wait_then_pass_on) for _ in range(5)]
    for w in waiters:
        w.start()
    time.sleep(0.5)  # all five subscribed and asleep
    redis_client.config_resetstat()
    holder.release()
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    evalsha_calls = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    # The release itself, then exactly one woken waiter's attempt: no herd of five.
    assert results == [True]
    assert evalsha_calls == 2
    go.set()  # each winner releases in turn and wakes the next
    for w in waiters:
        w.join(30)
    assert results == [True] * 5


def test_many_waited_locks_share_one_subscriber_connection(redis_client: redis.Redis) -> None:
    holders = [RedisLock(redis_client, f"job-{i}", ttl=60, auto_renew=False) for i in range(20)]
    for h in holders:
        h.acquire()
    before = {c["id"] for c in redis_client.client_list() if int(c.get("sub", 0)) > 0}
    results: list[bool] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                RedisLock(redis_client, f"job-{i}", owner=f"w{i}").acquire(timeout=30)
            )
        )
        for i in range(20)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    subscribers = [
        c for c in redis_client.client_list() if int(c.get("sub", 0)) > 0 and c["id"] not in before
    ]
    assert len(subscribers) == 1
    # Two channels per lock: its release channel, and this process's direct-grant channel.
    assert int(subscribers[0]["sub"]) == 2 * 20
    for h in holders:
        h.release()
    for t in threads:
        t.join(30)
    assert results == [True] * 20


def test_extend_replaces_the_ttl_and_is_owner_checked(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job", ttl=5, auto_renew=False)
    lock.acquire()
    lock.extend(100)
    remaining = lock.remaining()
    assert remaining is not None and 90 < remaining <= 100
    lock.extend(1)  # replaces, does not add
    remaining = lock.remaining()
    assert remaining is not None and remaining <= 1
    with pytest.raises(LockNotOwnedError):
        RedisLock(redis_client, "job", owner="other").extend(10)


def test_extend_never_resurrects_an_expired_lock(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job", ttl=0.05, auto_renew=False)
    lock.acquire()
    time.sleep(0.1)
    with pytest.raises(LockNotOwnedError):
        lock.extend(10)
    assert not redis_client.exists(lock.keys.lock)


def test_remaining_reports_server_side_ttl(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job", ttl=10)
    assert lock.remaining() is None
    lock.acquire()
    remaining = lock.remaining()
    assert remaining is not None and 0 < remaining <= 10
    redis_client.persist(lock.keys.lock)
    assert lock.remaining() == math.inf


def test_force_release_evicts_any_holder_and_wakes_waiters(redis_client: redis.Redis) -> None:
    RedisLock(redis_client, "job", ttl=60, owner="stuck").acquire()
    result: list[bool] = []
    waiter = threading.Thread(
        target=lambda: result.append(RedisLock(redis_client, "job").acquire(timeout=20))
    )
    waiter.start()
    time.sleep(0.3)
    assert RedisLock.force_release(redis_client, "job") is True
    waiter.join(20)
    assert result == [True]
    assert RedisLock.force_release(redis_client, "nothing-here") is False


def test_a_release_that_cannot_reach_redis_stops_renewing_and_is_retried(
    redis_server_factory,  # type: ignore[no-untyped-def]
) -> None:
    """Redis unreachable at release (longer than the client's retries, shorter than the
    lease): the hold used to stay with the watchdog and be renewed for ever once Redis was
    back. Now the release returns, the hold stops renewing at once, ``lock_release_failed``
    is sent, and the release is retried in the background when Redis answers again."""
    from celery_redislock import signals
    from celery_redislock._deferred import deferred_releases

    server = redis_server_factory()
    client = server.client(socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    lock = RedisLock(client, "job", ttl=3)
    failed: list[str] = []
    receiver = signals.lock_release_failed.connect(lambda sender, owner, **_: failed.append(owner))
    try:
        lock.acquire()
        scheduler = lock._scheduler()
        assert len(scheduler) == 1
        server.signal(19)  # SIGSTOP: the release cannot get an answer
        try:
            lock.release()  # does not raise
            assert lock.hold_count == 0 and len(scheduler) == 0  # no longer renewed
            assert failed == [lock._current_owner()]
        finally:
            server.signal(18)  # SIGCONT
        assert deferred_releases().wait_idle(5.0)
        assert not client.exists(lock.keys.lock)  # released soon, not after the lease
        assert lock.acquire(blocking=False)  # and free for anyone, this owner included
        lock.release()
    finally:
        signals.lock_release_failed.disconnect(receiver)


def test_an_outage_past_the_lease_leaves_nothing_renewed(
    redis_server_factory,  # type: ignore[no-untyped-def]
) -> None:
    """The background release gives up at the hold's validity deadline (after it the
    lease may have ended and the owner may hold the lock afresh); the lease ends the lock
    and nothing renews it."""
    from celery_redislock._deferred import deferred_releases

    server = redis_server_factory()
    client = server.client(socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
    lock = RedisLock(client, "job", ttl=1.0)
    lock.acquire()
    server.signal(19)
    try:
        lock.release()
        assert deferred_releases().wait_idle(3.0)  # gave up: past the deadline
    finally:
        server.signal(18)
    # The release sent while stopped may run on resume; if it did not, the lease ends it.
    deadline = time.monotonic() + 2.0
    while client.exists(lock.keys.lock) and time.monotonic() < deadline:
        assert client.pttl(lock.keys.lock) <= 1000  # never renewed
        time.sleep(0.05)
    assert not client.exists(lock.keys.lock)


def test_an_inner_release_that_fails_stops_renewing_the_hold(
    redis_server_factory,  # type: ignore[no-untyped-def]
) -> None:
    """``with lock: with lock:`` whose inner release cannot reach Redis: the error leaves
    both blocks, and the outer release gives back one hold. Whether the inner release
    landed is unknown, so the hold used to stay renewed for ever by a count nobody would
    give back. Now the inner hold counts as given back, the hold stops renewing at once,
    and its lease ends whatever Redis kept of it; nothing is reported lost."""
    server = redis_server_factory()
    client = server.client(socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    lock = RedisLock(client, "job", ttl=1.0)
    with pytest.raises(redis.exceptions.TimeoutError):
        with lock:
            with lock:
                server.signal(19)  # SIGSTOP: the inner release gets no answer
                try:
                    pass
                finally:
                    threading.Timer(0.5, lambda: server.signal(18)).start()  # SIGCONT
    assert not lock.lost and lock.hold_count == 0
    assert len(lock._scheduler()) == 0  # not renewed
    deadline = time.monotonic() + 3.0
    while client.exists(lock.keys.lock) and time.monotonic() < deadline:
        assert client.pttl(lock.keys.lock) <= 1000  # never renewed
        time.sleep(0.05)
    assert not client.exists(lock.keys.lock)


def test_a_background_release_never_touches_the_owners_next_holding(
    redis_server: RedisServer,
) -> None:
    """The release's reply is lost after it landed; the owner takes the lock again at
    once. The retry of the first release used to give back that new holding (same owner):
    another owner got in while this one still believed it held the lock."""
    from celery_redislock._deferred import deferred_releases
    from celery_redislock.testing import FaultProxy

    with FaultProxy(redis_server) as proxy:
        client = redis.Redis(
            host="127.0.0.1", port=proxy.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        direct = redis_server.client()
        lock = RedisLock(client, "job:again", ttl=5)
        lock.acquire()
        lock.release()  # the scripts are loaded: the fault hits the release itself
        lock.acquire()
        first = lock.token
        proxy.inject("drop_reply", "release")
        lock.release()  # landed; its reply lost: retried in the background
        assert lock.acquire(blocking=False)  # the same owner, afresh
        assert lock.token != first
        assert deferred_releases().wait_idle(5.0)
        assert direct.hget(lock.keys.lock, lock._current_owner()) == b"1"
        lock.ensure_held()
        lock.release()
        client.close()
        direct.close()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"ttl": 0}, "ttl"),
        ({"ttl": -5}, "ttl"),
        ({"ttl": math.nan}, "ttl"),
        ({"ttl": None}, "ttl"),
        ({"owner": ""}, "owner"),
        ({"timeout": -1}, "timeout"),
        ({"prefix": "x{"}, "prefix"),
        ({"auto_renew": "yes"}, "auto_renew"),
    ],
)
def test_bad_arguments_are_refused_at_construction(
    redis_client: redis.Redis, kwargs: dict[str, object], argument: str
) -> None:
    with pytest.raises(LockConfigurationError, match=argument):
        RedisLock(redis_client, "job", **kwargs)  # type: ignore[arg-type]


#: acquire() arguments every lock refuses (``LockConfigurationError`` naming the argument,
#: nothing sent), as strictly as the constructor's: (kwargs, the argument named).
BAD_ACQUIRE_CALLS: list[tuple[dict[str, Any], str]] = [
    ({"blocking": "no"}, "blocking"),  # a non-empty string is truthy: it would block
    ({"blocking": 0}, "blocking"),
    ({"blocking": None}, "blocking"),
    ({"timeout": -1}, "timeout"),
    ({"timeout": math.nan}, "timeout"),
    ({"timeout": math.inf}, "timeout"),
    ({"timeout": "5"}, "timeout"),
    ({"timeout": True}, "timeout"),
    ({"lease": 0}, "lease"),
    ({"lease": -1}, "lease"),
    ({"lease": math.nan}, "lease"),
    ({"lease": "10"}, "lease"),
    ({"lease": True}, "lease"),
]


class _CountingConnection(redis.Connection):
    """Counts what its connections send (this client's alone: the session's server is
    shared, and another test's watchdog may run a renewal there at any time)."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _CountingConnection.sent += 1
        super().send_packed_command(command, check_health)


@pytest.mark.parametrize(("kwargs", "argument"), BAD_ACQUIRE_CALLS)
def test_bad_acquire_arguments_are_refused_before_any_io(
    redis_server: RedisServer, kwargs: dict[str, Any], argument: str
) -> None:
    pool = redis.ConnectionPool(port=redis_server.port, connection_class=_CountingConnection)
    client = redis.Redis(connection_pool=pool)
    try:
        lock = RedisLock(client, f"job-{argument}")
        _CountingConnection.sent = 0
        with pytest.raises(LockConfigurationError, match=f"^{argument} must"):
            lock.acquire(**kwargs)
        assert _CountingConnection.sent == 0
        assert not lock.locked()
    finally:
        client.close()
        pool.disconnect()


def test_bad_call_arguments_are_refused_before_any_io(redis_client: redis.Redis) -> None:
    lock = RedisLock(redis_client, "job")
    with pytest.raises(LockConfigurationError, match="ttl"):
        lock.extend(math.inf)
    assert not lock.locked()


def test_scripts_refuse_a_non_positive_lease_themselves(redis_client: redis.Redis) -> None:
    scripts = scripts_for(redis_client)
    for lease in (0, -1, "abc"):
        with pytest.raises(redis.exceptions.ResponseError, match="lease"):
            scripts.acquire(keys=["redislock:{x}", "redislock:{x}:fence"], args=["o", lease])
    assert not redis_client.exists("redislock:{x}")


def test_bytes_and_odd_names_work(redis_client: redis.Redis) -> None:
    for name in (b"\x00\xff", "a}b{", "ünï"):
        lock = RedisLock(redis_client, name)
        with lock:
            assert lock.owned()
        assert not lock.locked()


def test_waiting_never_exhausts_the_connection_pool(redis_server: RedisServer) -> None:
    """Regression: each subscriber (re)connect once took a pool slot for good."""
    from celery_redislock._waiting import subscriber_for

    client = redis_server.client(max_connections=6)
    for i in range(12):  # more subscriber connections over time than the pool allows
        holder = RedisLock(client, f"slot-{i}", owner="holder", ttl=30, auto_renew=False)
        holder.acquire()
        waiter = RedisLock(client, f"slot-{i}", owner="waiter", ttl=30, auto_renew=False)
        result: list[bool] = []
        thread = threading.Thread(
            target=lambda w=waiter, out=result: out.append(w.acquire(timeout=10))
        )
        thread.start()
        subscriber = subscriber_for(client)
        deadline = time.monotonic() + 5
        channel = None
        while time.monotonic() < deadline:
            channel = subscriber._channels.get(waiter.keys.channel)
            if channel is not None and channel.confirmed.is_set():
                break
            time.sleep(0.01)
        assert channel is not None and channel.confirmed.is_set(), f"not subscribed at wait {i}"
        holder.release()
        thread.join(15)
        assert result == [True]
        waiter.release()
        with subscriber._mutex:
            subscriber._drop_connection_locked()  # the next wait connects afresh
    assert client.ping()


def test_waiters_are_served_first_come_first_served(redis_client: redis.Redis) -> None:
    holder = RedisLock(redis_client, "line", ttl=60, auto_renew=False, owner="holder")
    holder.acquire()
    order: list[int] = []

    def wait(i: int) -> None:
        lock = RedisLock(redis_client, "line", ttl=60, auto_renew=False, owner=f"w{i}")
        assert lock.acquire(timeout=30)
        order.append(i)
        lock.release()  # hands the lock to the next in line

    threads = []
    for i in range(6):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 5  # each joins the line before the next arrives
        while redis_client.llen(holder.keys.waiters) < i + 1 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert redis_client.llen(holder.keys.waiters) == 6
    redis_client.config_resetstat()
    holder.release()
    for t in threads:
        t.join(30)
    assert order == list(range(6))  # in arrival order
    calls = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    # Per hand-off the next waiter takes the lock and releases it (2 calls): no herd of
    # retries (a herd would cost every remaining waiter a retry per hand-off, 15 more).
    assert 1 + 6 * 2 <= calls < 1 + 6 * 2 + 3
    assert not redis_client.exists(holder.keys.waiters, holder.keys.claims)


def test_a_timed_out_waiter_leaves_the_line(redis_client: redis.Redis) -> None:
    RedisLock(redis_client, "line", ttl=60, owner="holder").acquire()
    keys = RedisLock(redis_client, "line").keys
    assert RedisLock(redis_client, "line", owner="impatient").acquire(timeout=0.2) is False
    assert redis_client.llen(keys.waiters) == 0 and redis_client.zcard(keys.claims) == 0


def test_a_dead_waiter_does_not_stall_the_line(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    holder = RedisLock(redis_client, "line", ttl=60, auto_renew=False, owner="holder")
    holder.acquire()
    doomed = _procs.run(_procs.wait_in_line, redis_server.port, "line")
    deadline = time.monotonic() + 20
    while redis_client.llen(holder.keys.waiters) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    _procs.sigkill(doomed)  # first in line, and gone
    result: list[bool] = []
    live = threading.Thread(
        target=lambda: result.append(
            RedisLock(redis_client, "line", owner="live", auto_renew=False).acquire(timeout=10)
        )
    )
    live.start()
    time.sleep(0.3)
    holder.release()  # granted to the dead waiter first: it never takes it
    live.join(20)
    # The grant lapsed (2 s) and the live waiter got the lock within its 10 s timeout.
    # The dead waiter was granted it directly, which the live waiter's process is not
    # told of: it re-checked on its own within 5 s (the cap on every wait). Without that
    # it would sleep until the holder's 60 s lease could have ended, and time out.
    assert result == [True]
    assert redis_client.hget(holder.keys.lock, "live") == b"1"


def test_a_release_grants_the_first_waiter_directly(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewed waiter is handed the lock by the release itself: only its process is
    told (nothing on the lock's broadcast channel), with the fencing token, and it holds
    the lock without another round trip. The grant's short lease is then lengthened by
    the watchdog; re-entries count as usual, also through another lock object."""
    holder = RedisLock(redis_client, "direct", ttl=60, auto_renew=False, owner="holder")
    holder.acquire()
    keys = holder.keys
    watch = redis_client.pubsub()
    watch.subscribe(keys.channel)
    assert watch.get_message(timeout=5)["type"] == "subscribe"
    got: list[Any] = []
    counts: list[bytes | None] = []
    checked = threading.Event()

    def waiter_thread() -> None:  # the default owner: this thread
        waiter = RedisLock(redis_client, "direct", ttl=30)
        got.append(waiter.acquire(timeout=20))
        got.append(waiter.token)
        owner = waiter._current_owner()
        got.append(owner)
        if not checked.wait(20):  # the test failed before: stop here, not in a later test
            return
        waiter.ensure_held()
        inner = RedisLock(redis_client, "direct", ttl=30)  # re-entry via another object
        got.append(inner.acquire(blocking=False))
        counts.append(redis_client.hget(keys.lock, owner))
        inner.release()
        counts.append(redis_client.hget(keys.lock, owner))
        waiter.release()
        got.append(bool(waiter.lost))

    thread = threading.Thread(target=waiter_thread)
    thread.start()
    wake_key = keys.waiters + b":wake"
    deadline = time.monotonic() + 10
    while not redis_client.hlen(wake_key) and time.monotonic() < deadline:
        time.sleep(0.01)
    (wake_id,) = redis_client.hvals(wake_key)
    assert wake_id.endswith(b":30000")  # the wake id, and the lease
    # Every script run from now on, by name (the watchdog's renewals of the grant too).
    scripts = scripts_for(redis_client)
    names = {getattr(scripts, n).sha: n for n in ("acquire", "release", "renew", "fence")}
    ran: list[str] = []
    run_direct = scripts_module._run_direct

    def spy(pool: Any, script: Any, keys: Any, args: Any) -> Any:
        ran.append(names.get(script.sha, "other"))
        return run_direct(pool, script, keys, args)

    monkeypatch.setattr(scripts_module, "_run_direct", spy)
    holder.release()
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    acquired, token, owner = got[:3]
    assert acquired is True
    # The release; the waiter took nothing afterwards (only the watchdog may have renewed
    # the grant's short lease meanwhile).
    assert [name for name in ran if name != "renew"] == ["release"], ran
    assert token == int(redis_client.get(keys.fence))
    assert redis_client.hget(keys.lock, owner) == b"1"  # taken for it by the release
    assert 0 < redis_client.pttl(keys.lock) <= 2000
    assert watch.get_message(timeout=0.3) is None  # no other process was woken
    watch.close()
    # The watchdog gives the hold its full lease well before the grant's 2 s end.
    while redis_client.pttl(keys.lock) <= 2000 and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    assert redis_client.pttl(keys.lock) > 20000
    checked.set()
    thread.join(20)
    assert got[3:] == [True, False]  # the inner acquire; the hold never lost
    assert counts == [b"2", b"1"]  # Redis counted both holds; the outer one stayed
    assert redis_client.exists(keys.lock) == 0


def test_an_explicit_owner_is_not_granted_directly(redis_client: redis.Redis) -> None:
    """An explicit owner may be shared by waits in other threads or processes, each of
    which would take one direct grant as its own: it is granted the usual way."""
    holder = RedisLock(redis_client, "explicit", ttl=60, auto_renew=False, owner="holder")
    holder.acquire()
    waiter = RedisLock(redis_client, "explicit", ttl=30, owner="shared")
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=20)))
    thread.start()
    deadline = time.monotonic() + 10
    while not redis_client.llen(holder.keys.waiters) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not redis_client.exists(holder.keys.waiters + b":wake")  # no wake id left
    holder.release()
    thread.join(20)
    assert got == [True]
    waiter.release()


def test_only_a_grant_answering_the_latest_attempt_counts() -> None:
    """Grants name the attempt (``<wait>.<attempt>``, new for every attempt): a late
    message for an earlier attempt, or an earlier wait of the same owner, cannot pass
    for a grant, since only a grant to the latest attempt can be dated from it."""
    from celery_redislock._waiting import Subscriber, Waiter, _Channel

    subscriber = Subscriber(redis.ConnectionPool())
    earlier = Waiter(subscriber, b"ch", "owner")
    current = Waiter(subscriber, b"ch", "owner")
    channel = _Channel()
    channel.waiters.append(current)
    assert earlier.next_wake_id() == subscriber.grant_id + b":" + earlier.wait_id + b".1"
    first = current.next_wake_id().split(b":")[1]
    channel.grant(b"41:" + earlier.nonce)  # another wait
    assert current.granted is None and not current.kicked
    channel.grant(b"42:" + first)  # this wait's first attempt...
    current.next_wake_id()  # ...read only after the second attempt went out
    assert current.take_grant() is None
    channel.grant(b"43:" + first)  # and arriving even later
    assert current.granted is None
    channel.grant(b"44:" + current.nonce)
    assert current.take_grant() == 44 and current.kicked
    assert current.take_grant() is None


def test_a_grant_too_old_to_trust_is_taken_up_with_a_round_trip(
    redis_client: redis.Redis,
) -> None:
    """The waiter can only date a grant from its own last attempt: when that was long
    enough ago that the grant's lease may be nearly over, it takes the lock with a
    round trip (which also sets the full lease) instead."""
    lock = RedisLock(redis_client, "stale-grant", ttl=30, owner="w")
    stale = lock._grant_hold("w", time.monotonic() - 1.5, 30000)
    assert lock._take_grant(stale, 1, time.monotonic()) is False
    assert lock.token is None
    fresh = lock._grant_hold("w", time.monotonic(), 30000)
    assert lock._take_grant(fresh, 7, time.monotonic()) is True
    assert lock.token == 7
    # The hold built before the wait is the one recorded: its lease dated from the attempt.
    assert lock._holds["w"] is fresh and fresh.count == 1 and not fresh.lost
    assert lock._take_grant(lock._grant_hold("w", time.monotonic(), 30000), 8, 0.0) is False
    assert lock.token == 7  # held already: a second grant is not counted over it
    lock.close()  # no such lock in Redis: stop the watchdog's renewals of it


def test_a_direct_grant_is_counted_once_by_its_own_attempt_and_passed_on_by_its_leave(
    redis_client: redis.Redis,
) -> None:
    """The two races of a direct grant, at the script level: the waiter's own attempt
    crossing the grant's message takes the grant without counting it again (another
    attempt of the same owner re-enters), and the waiter leaving (timed out, cancelled)
    passes a grant it never saw to the next in line."""
    lock = RedisLock(redis_client, "crossed", ttl=30, owner="holder")
    scripts, keys = scripts_for(redis_client), lock.keys
    acquire_keys = [keys.lock, keys.fence, keys.waiters, keys.claims, keys.wake]

    def attempt(owner: str, wake: str = "") -> list[int]:
        argv = [owner, 30000, 2000, "", "", wake] if wake else [owner, 30000, 2000]
        return [int(x) for x in scripts.acquire(keys=acquire_keys, args=argv)]

    assert lock.acquire()
    assert attempt("w", "gsub:7.1")[0] == 0  # in line, with its wake id
    assert attempt("next")[0] == 0
    lock.release()  # granted directly to "w" (count 1), "next" still in line
    assert redis_client.hget(keys.lock, "w") == b"1"
    assert attempt("w", "gsub:7.2")[:3:2] == [1, 1]  # its wait's next attempt: one hold
    assert attempt("w")[:3:2] == [1, 2]  # any other: a re-entry
    assert scripts.release(keys=keys.release_keys(), args=["w", "all"]) == 0
    # Granted to "next" with a round trip to come (no wake id): count 0.
    assert redis_client.hget(keys.lock, "next") == b"0"
    assert scripts.release(keys=keys.release_keys(), args=["next", "leave"]) == 0
    # Now a direct grant that its waiter leaves without having seen it.
    assert lock.acquire()
    assert attempt("w2", "gsub:8.1")[0] == 0
    assert attempt("last")[0] == 0
    lock.release()
    assert redis_client.hget(keys.lock, "w2") == b"1"
    assert (
        scripts.release(keys=keys.release_keys(), args=["w2", "leave", "gsub:9"]) == -3
    )  # not its wait
    assert redis_client.hget(keys.lock, "w2") == b"1"
    assert scripts.release(keys=keys.release_keys(), args=["w2", "leave", "gsub:8"]) == 0
    assert not redis_client.hexists(keys.lock, "w2")
    assert redis_client.hget(keys.lock, "last") == b"0"  # passed on down the line
    # A wake id left in line is dropped when the owner joins again without one (a wait
    # with a fixed lease): a release must not send that wait's grant to a dead nonce.
    assert scripts.release(keys=keys.release_keys(), args=["last", "leave"]) == 0
    assert lock.acquire()
    assert attempt("w3", "gsub:9.1")[0] == 0
    assert redis_client.hexists(keys.waiters + b":wake", "w3")
    assert attempt("w3")[0] == 0
    assert not redis_client.hexists(keys.waiters + b":wake", "w3")
    lock.release()
    assert redis_client.hget(keys.lock, "w3") == b"0"  # granted the usual way


def test_a_direct_grant_to_a_wait_whose_leave_failed_is_not_counted_twice(
    redis_client: redis.Redis,
) -> None:
    """A blocked acquire times out and its leave fails (a Redis error): its place may
    still be granted to it directly. The same thread's next acquire of that lock, from
    any lock object, takes such a grant as its one hold, not as a re-entry on top of it
    (which would leave a hold behind its release)."""
    holder = RedisLock(redis_client, "abandoned", ttl=60, auto_renew=False, owner="holder")
    holder.acquire()
    keys = holder.keys
    real = scripts_for(redis_client)

    class FailingLeave:  # the scripts, but "leave" fails as on a broken connection
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def release(self, keys: Any, args: Any) -> Any:
            if len(args) > 1 and args[1] == "leave":
                raise redis.ConnectionError("connection lost (test)")
            return real.release(keys=keys, args=args)

    outcome: list[Any] = []

    def thread_body() -> None:
        waiter = RedisLock(redis_client, "abandoned", ttl=30)
        waiter._scripts = FailingLeave()
        outcome.append(waiter.acquire(timeout=0.5))  # times out; the leave fails
        outcome.append(waiter._current_owner())
        go.wait(20)
        again = RedisLock(redis_client, "abandoned", ttl=30)  # another object
        outcome.append(again.acquire(blocking=False))
        outcome.append(redis_client.hget(keys.lock, outcome[1]))
        again.release()
        outcome.append(redis_client.exists(keys.lock))

    go = threading.Event()
    thread = threading.Thread(target=thread_body)
    thread.start()
    deadline = time.monotonic() + 10
    while len(outcome) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outcome[0] is False
    assert redis_client.llen(keys.waiters) == 1  # still in line: the leave never landed
    holder.release()  # granted directly to the abandoned wait
    assert redis_client.hget(keys.lock, outcome[1]) == b"1"
    go.set()
    thread.join(20)
    assert outcome[2:] == [True, b"1", 0]  # one hold, and nothing left after its release


def test_abandoned_waits_expire() -> None:
    from celery_redislock._core import AbandonedWaits

    waits = AbandonedWaits()
    assert not waits
    waits.add(b"k", "o", b"g1:5", time.monotonic() + 60)
    waits.add(b"k", "gone", b"g1:6", time.monotonic() - 1)
    assert waits.get(b"k", "o") == b"g1:5"
    assert waits.get(b"k", "gone") is None
    assert waits.get(b"other", "o") is None


def test_a_hold_whose_thread_ended_is_not_renewed_for_ever(redis_client: redis.Redis) -> None:
    """A thread that takes a lock (default owner) and exits without releasing: nobody can
    release it any more, so the watchdog stops renewing it (lost, "abandoned") and the
    lease ends it. It used to be renewed until the process exited."""
    lock = RedisLock(redis_client, "job:orphan", ttl=0.6)
    kept = RedisLock(redis_client, "job:kept", ttl=0.6, owner="explicit")
    started = threading.Thread(target=lock.acquire)
    started.start()
    started.join()
    assert kept.acquire()
    deadline = time.monotonic() + 3.0
    while redis_client.exists(lock.keys.lock) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not redis_client.exists(lock.keys.lock)  # expired, not renewed
    assert redis_client.exists(kept.keys.lock)  # an explicit owner's hold is still renewed
    kept.release()


def test_concurrent_acquires_of_one_explicit_owner_keep_the_counts_right(
    redis_client: redis.Redis,
) -> None:
    """Threads sharing an explicit owner on one lock object: replies can be handled out of
    order, and a count of 1 with the hold's own token used to be taken for an expired hold
    (a false "expired" loss, and a local count that drifted from Redis's)."""
    lock = RedisLock(redis_client, "job:shared", ttl=30, owner="shared")
    for _ in range(10):
        threads = [threading.Thread(target=lock.acquire) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not lock.lost
        assert lock.hold_count == int(redis_client.hget(lock.keys.lock, "shared")) == 8
        for _ in range(8):
            lock.release()
        assert not redis_client.exists(lock.keys.lock)


def test_a_short_timeout_bounds_the_wait_for_the_subscription(redis_client: redis.Redis) -> None:
    """acquire(timeout=0.1) on a held lock used to wait up to 1 s (CONFIRM_WAIT) for its
    subscription to be confirmed before its first wait, whatever its timeout: the wait is
    now bounded by the acquire's remaining timeout."""
    from celery_redislock._waiting import CONFIRM_WAIT, waiter_for

    assert waiter_for(redis_client, b"ch", "o").confirm_wait == CONFIRM_WAIT
    assert waiter_for(redis_client, b"ch", "o", 0.05).confirm_wait == 0.05
    assert waiter_for(redis_client, b"ch", "o", 30.0).confirm_wait == CONFIRM_WAIT
    holder = RedisLock(redis_client, "job:short", ttl=30, owner="holder")
    holder.acquire()
    try:
        assert not RedisLock(redis_client, "job:short", ttl=30).acquire(timeout=0.1)
    finally:
        holder.release()
