"""A lone blocked acquire reads its own grant: BLPOP on its box (``_lone_waiter.BoxWaiter``).

Real redis-server processes (the session's, flushed, and private ones for ACL users).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_redislock import RedisLock, _lone_waiter, _waiting
from celery_redislock.testing import RedisServer

from .._support import wait_until


def blocked_pops(admin: redis.Redis) -> int:
    """Clients blocked in BLPOP now."""
    return sum(1 for c in admin.client_list() if c.get("cmd") == "blpop" and "b" in c["flags"])


def numsub(admin: redis.Redis, channel: bytes) -> int:
    return int(admin.pubsub_numsub(channel)[0][1])


def waiting_thread(lock: RedisLock, timeout: float = 20) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread (a new owner) that waits for ``lock``'s name and releases it at once; its
    outcome in the dict."""
    result: dict[str, Any] = {}

    def body() -> None:
        waiter = RedisLock(lock.client, lock.name, ttl=30)
        result["ok"] = waiter.acquire(timeout=timeout)
        result["at"] = time.monotonic()
        result["token"] = waiter.token
        if result["ok"]:
            waiter.release()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, result


def test_a_lone_waiter_reads_its_grant_from_its_box_without_a_subscriber(
    redis_client: redis.Redis,
) -> None:
    holder = RedisLock(redis_client, "lone:a", ttl=30)
    assert holder.acquire()
    thread, result = waiting_thread(holder)
    wait_until(lambda: blocked_pops(redis_client) == 1, what="the waiter blocked on its box")
    # No subscriber connection, no subscription: the waiter reads its grant itself.
    assert _waiting.subscriber_for(redis_client).connections == 0
    assert numsub(redis_client, holder.keys.channel) == 0
    token = holder.token
    assert token is not None
    released = time.monotonic()
    holder.release()  # a 30 s lease: only the grant can wake the waiter now
    thread.join(10)
    assert result["ok"] and result["at"] - released < 5.0
    assert result["token"] == token + 1  # the grant's fencing token, taken as the hold's
    assert not holder.locked()
    # The grant was popped: no box left behind; the pool's box is free for the next wait.
    assert redis_client.keys("*:released:L*") == []
    assert not _lone_waiter._pool_box(redis_client.connection_pool).busy


def test_two_waiters_in_a_process_one_boxed_one_subscribed_both_served_in_order(
    redis_client: redis.Redis,
) -> None:
    holder = RedisLock(redis_client, "lone:two", ttl=30)
    assert holder.acquire()
    first, first_result = waiting_thread(holder)
    wait_until(lambda: blocked_pops(redis_client) == 1, what="the first on its box")
    second, second_result = waiting_thread(holder)
    wait_until(lambda: numsub(redis_client, holder.keys.channel) == 1, what="second subscribed")
    wait_until(lambda: redis_client.llen(holder.keys.waiters) == 2, what="both in line")
    holder.release()
    first.join(10)
    second.join(10)  # the first's release hands it to the subscribed one, directly
    assert first_result["ok"] and second_result["ok"]
    assert second_result["at"] >= first_result["at"]
    assert second_result["token"] == first_result["token"] + 1
    assert not holder.locked()


def test_a_boxed_waiter_that_times_out_leaves_the_line_and_frees_the_box(
    redis_client: redis.Redis,
) -> None:
    holder = RedisLock(redis_client, "lone:timeout", ttl=30)
    assert holder.acquire()
    waiter = RedisLock(redis_client, "lone:timeout", ttl=30, auto_renew=True)
    started = time.monotonic()
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(waiter.acquire(timeout=0.5)))
    thread.start()
    thread.join(10)
    assert outcome == [False] and time.monotonic() - started < 5
    assert redis_client.llen(holder.keys.waiters) == 0
    assert not _lone_waiter._pool_box(redis_client.connection_pool).busy
    holder.release()
    assert not holder.locked()  # nobody in line: released, not granted


def test_junk_in_a_box_is_not_taken_for_a_grant(redis_client: redis.Redis) -> None:
    """Anyone who may write under the prefix may push into a box: a value that does not
    answer the waiter's latest attempt (junk, a forged token, a stale nonce) only makes it
    try again; the hold it gets is the real grant's."""
    holder = RedisLock(redis_client, "lone:junk", ttl=30)
    assert holder.acquire()
    thread, result = waiting_thread(holder)
    wait_until(lambda: blocked_pops(redis_client) == 1, what="the waiter blocked on its box")
    wake = redis_client.hgetall(holder.keys.wake)
    (wake_id,) = wake.values()  # "<box id>:<wait>.<attempt>:<lease>"
    box_id, nonce, _lease = wake_id.split(b":")
    box = holder.keys.channel + b":" + box_id
    for junk in (b"garbage", b"999999:" + nonce + b"0", b"x:" + nonce, b"999999:0.1", b""):
        redis_client.rpush(box, junk)
        wait_until(lambda: blocked_pops(redis_client) == 1, what="the waiter back on its box")
    assert "ok" not in result and holder.owned()
    token = holder.token
    assert token is not None
    holder.release()
    thread.join(10)
    assert result["ok"] and result["token"] == token + 1
    assert not holder.locked()


def test_a_box_read_is_cut_below_the_socket_timeout(redis_server: RedisServer) -> None:
    client = redis_server.client(socket_timeout=1.5)
    try:
        client.flushall()
        holder = RedisLock(client, "lone:slices", ttl=30)
        assert holder.acquire()
        thread, result = waiting_thread(holder)
        wait_until(lambda: blocked_pops(client) == 1, what="the waiter blocked on its box")
        time.sleep(3.5)  # more than two socket timeouts: each read ends before its own
        assert thread.is_alive() and "ok" not in result
        holder.release()
        thread.join(10)
        assert result["ok"]
    finally:
        client.close()


@pytest.mark.parametrize(
    "make_client",
    [
        lambda server: server.client(socket_timeout=0.5),  # too short to wait in
        lambda server: redis.Redis(
            connection_pool=redis.ConnectionPool(port=server.port, max_connections=4)
        ),  # too few connections to keep one
    ],
    ids=["short-socket-timeout", "small-pool"],
)
def test_pools_that_cannot_spare_a_connection_wait_through_the_subscriber(
    redis_server: RedisServer, make_client: Callable[[RedisServer], redis.Redis]
) -> None:
    client = make_client(redis_server)
    try:
        client.flushall()
        holder = RedisLock(client, "lone:sub", ttl=30)
        assert holder.acquire()
        thread, result = waiting_thread(holder)
        wait_until(lambda: numsub(client, holder.keys.channel) == 1, what="subscribed")
        assert blocked_pops(client) == 0
        holder.release()
        thread.join(10)
        assert result["ok"]
    finally:
        client.close()


def test_a_user_without_blpop_waits_through_the_subscriber_after_one_refusal(
    redis_server_factory: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory()
    admin = server.client()
    from .test_security import LOCK_COMMANDS, PASSWORD, acl_rules, denials, set_user

    set_user(admin, "no-blpop", acl_rules(tuple(c for c in LOCK_COMMANDS if c != "blpop")))
    client = redis.Redis(port=server.port, username="no-blpop", password=PASSWORD)
    try:
        caplog.set_level(logging.WARNING, logger="celery_redislock")
        for round_ in range(2):
            holder = RedisLock(client, f"acl:{round_}", ttl=30)
            assert holder.acquire()
            thread, result = waiting_thread(holder)
            channel = holder.keys.channel
            wait_until(lambda ch=channel: numsub(admin, ch) == 1, what="subscribed")
            holder.release()
            thread.join(10)
            assert result["ok"]
        refused = [e for e in denials(admin, "no-blpop") if e["object"] == "blpop"]
        assert len(refused) == 1 and refused[0]["count"] == 1  # tried once, by the first wait
        assert sum("refused BLPOP" in r.getMessage() for r in caplog.records) == 1
    finally:
        client.close()
        admin.close()


def test_a_task_lock_hand_over_to_a_boxed_waiter_wakes_it_through_its_box(
    redis_client: redis.Redis,
) -> None:
    """A ``LockedTask``'s release (handoff.lua) grants the usual way: count 0, the
    waiter's owner id published on the lock's channel, which a boxed waiter does not
    hear. Its box is told too, so it takes up that grant (its token) before the grant
    lapses, not at its own re-check 5 s later (a free lock then, with a new token)."""
    from celery_redislock.celery.tasklock import TaskLock
    from celery_redislock.settings import LockOptions

    task = TaskLock(redis_client, "lone:task", task_id="t1", options=LockOptions(ttl=30))
    try:
        assert task.take() is True
        thread, result = waiting_thread(RedisLock(redis_client, "lone:task", ttl=30))
        wait_until(lambda: blocked_pops(redis_client) == 1, what="the waiter blocked on its box")
        wait_until(lambda: redis_client.llen(task.keys.waiters) == 1, what="the waiter in line")
        token = task.token
        assert token is not None
        assert task.finish(hold=0, done_ttl=None) is None  # handed to the waiter in line
        thread.join(10)
        assert result["ok"] and result["token"] == token + 1  # the hand-over's grant
        assert not task.locked()
        assert redis_client.keys("*:released:L*") == []
    finally:
        task.close()


@pytest.mark.parametrize(
    "options",
    [{}, {"decode_responses": True}, {"protocol": 3}, {"protocol": 3, "decode_responses": True}],
    ids=["resp2", "resp2-decoded", "resp3", "resp3-decoded"],
)
def test_a_boxed_waiter_takes_its_grant_without_a_round_trip_whatever_the_decoding(
    redis_server: RedisServer, options: dict[str, Any]
) -> None:
    """The grant read from the box counts as acquired as it is (one script call for the
    whole hand-over: the holder's release), decoded replies and RESP3 included."""
    client = redis.Redis(port=redis_server.port, socket_timeout=5, **options)
    try:
        client.flushall()
        holder = RedisLock(client, "lone:decode", ttl=30)
        assert holder.acquire()
        holder.release()  # the scripts loaded: every call below is one EVALSHA
        assert holder.acquire()
        taken, done = threading.Event(), threading.Event()
        result: dict[str, Any] = {}

        def body() -> None:
            waiter = RedisLock(client, "lone:decode", ttl=30)
            result["ok"] = waiter.acquire(timeout=20)
            taken.set()
            done.wait(10)
            if result["ok"]:
                waiter.release()

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        wait_until(lambda: blocked_pops(client) == 1, what="the waiter blocked on its box")
        client.config_resetstat()
        holder.release()
        assert taken.wait(10) and result["ok"]
        calls = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        done.set()
        thread.join(10)
        assert calls == 1  # the release alone: the waiter made no attempt after it
        assert not holder.locked()
    finally:
        client.close()


def test_a_wait_cut_by_a_partition_after_its_fallback_leaves_its_box_grant_to_the_next_acquire(
    redis_server: RedisServer,
) -> None:
    """A's box read fails (its client partitioned: connections closed, new ones refused),
    and so do the retry through the subscriber and the leave: the acquire raises, and the
    process remembers the wait (``AbandonedWaits``). Its place in line still names the
    box, so B's release, after the partition, grants the lock to the box. A's next
    acquire must take that grant as its one hold (not re-enter on top of it): after A's
    release the lock is free, not held by A's owner for a whole lease."""
    from celery_redislock.testing import FaultProxy

    admin = redis_server.client()
    admin.flushall()
    with FaultProxy(redis_server) as proxy:
        holder = RedisLock(
            redis_server.client(socket_timeout=2), "lone:cut", ttl=8, owner="B", auto_renew=False
        )
        assert holder.acquire()
        client = proxy.client(socket_timeout=1.6, socket_connect_timeout=0.3, retry=None)
        a = RedisLock(client, "lone:cut", ttl=30)
        outcome: dict[str, Any] = {}
        again = threading.Event()

        def body() -> None:
            try:
                outcome["first"] = a.acquire(timeout=10)
            except redis.ConnectionError as exc:
                outcome["first"] = exc
            again.wait(20)
            outcome["second"] = a.acquire(timeout=10)
            outcome["held"] = admin.hgetall(a.keys.lock)
            a.release()

        thread = threading.Thread(target=body, daemon=True)
        try:
            thread.start()
            wait_until(lambda: blocked_pops(admin) == 1, what="A blocked on its box")
            # A's next box read (each lasts < 1 s) partitions A's client for 1.5 s.
            fault = proxy.inject("refuse", "BLPOP", seconds=1.5)
            assert fault.fired.wait(5)
            wait_until(lambda: "first" in outcome, what="A's acquire cut")
            assert isinstance(outcome["first"], redis.ConnectionError)
            ends_at = fault.ends_at
            assert ends_at is not None
            wait_until(lambda: time.monotonic() > ends_at, timeout=5, what="the partition healed")
            holder.release()  # A's place is kept: granted to the wait it names, A's box
            assert admin.hget(holder.keys.lock, "__grant__").startswith(b"L")
            again.set()
            thread.join(20)
            assert outcome["second"] is True
            (count,) = [v for k, v in outcome["held"].items() if not k.startswith(b"__")]
            assert count == b"1"  # the grant taken as the hold, not re-entered
            assert not admin.exists(holder.keys.lock)  # released: free, not held on
        finally:
            again.set()
            a.close()
            holder.close()
            client.close()
    admin.close()


def test_a_box_of_another_type_costs_the_waiter_its_wake_up_not_the_release(
    redis_client: redis.Redis,
) -> None:
    """A prefix writer puts a string where a waiter's box belongs: the release still
    succeeds (the push is the only thing that fails), and the waiter, not woken, takes
    the lock granted to it at its own re-check."""
    holder = RedisLock(redis_client, "lone:wrongtype", ttl=30)
    assert holder.acquire(lease=1.0)  # the waiter's wait is bounded by this lease
    thread, result = waiting_thread(holder)
    wait_until(lambda: blocked_pops(redis_client) == 1, what="the waiter blocked on its box")
    (wake_id,) = redis_client.hgetall(holder.keys.wake).values()
    box = holder.keys.channel + b":" + wake_id.split(b":")[0]
    redis_client.set(box, "not a list")
    token = holder.token
    assert token is not None
    holder.release()  # must not raise
    thread.join(10)
    assert result["ok"] and result["token"] == token + 1  # the grant, taken at the re-check
    assert not holder.locked()


def test_a_short_box_wait_ends_on_the_clients_clock_and_leaves_nothing_blocked(
    redis_client: redis.Redis,
) -> None:
    """A box read shorter than a second is ended by the client (the server would end it
    on its next tick): its connection goes with the pending BLPOP, and the pool serves
    the next wait."""
    holder = RedisLock(redis_client, "lone:short", ttl=30)
    assert holder.acquire()
    outcome: list[bool] = []

    def body() -> None:
        waiter = RedisLock(redis_client, holder.name, ttl=30)
        outcome.extend(waiter.acquire(timeout=t) for t in (0.01, 0.05, 0.3))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert outcome == [False, False, False]
    wait_until(lambda: blocked_pops(redis_client) == 0, what="no BLPOP left pending")
    assert redis_client.llen(holder.keys.waiters) == 0
    thread, result = waiting_thread(holder)
    wait_until(lambda: blocked_pops(redis_client) == 1, what="the next waiter on its box")
    holder.release()
    thread.join(10)
    assert result["ok"]


def test_show_counts_a_process_whose_lone_waiter_waits_on_its_box(
    redis_client: redis.Redis,
) -> None:
    """``redislock show``'s ``waiting_processes`` (processes with a blocked acquire on the
    lock) counts a process whose only waiter reads its box: it subscribes to nothing."""
    from celery_redislock.celery.inspection import lock_line

    holder = RedisLock(redis_client, "lone:shown", ttl=30)
    assert holder.acquire()
    assert lock_line(redis_client, holder.keys)[0] == 0
    thread, result = waiting_thread(holder)
    wait_until(lambda: blocked_pops(redis_client) == 1, what="the waiter blocked on its box")
    assert numsub(redis_client, holder.keys.channel) == 0
    assert lock_line(redis_client, holder.keys)[0] == 1
    second, second_result = waiting_thread(holder)  # (another process's, as Redis sees it)
    wait_until(lambda: numsub(redis_client, holder.keys.channel) == 1, what="second subscribed")
    wait_until(lambda: redis_client.llen(holder.keys.waiters) == 2, what="both in line")
    assert lock_line(redis_client, holder.keys)[0] == 2
    holder.release()
    thread.join(10)
    second.join(10)
    assert result["ok"] and second_result["ok"]
    # A box wake id left behind by a waiter whose place lapsed (it died in line) counts
    # no more: only places still kept do (the subscription lingers a while: counted).
    before = lock_line(redis_client, holder.keys)[0]
    redis_client.hset(holder.keys.wake, "dead-owner", b"L0123456789abcdef:1.1:30000")
    assert lock_line(redis_client, holder.keys)[0] == before
    redis_client.zadd(holder.keys.claims, {"dead-owner": 1})  # lapsed long ago
    assert lock_line(redis_client, holder.keys)[0] == before


def test_a_box_of_another_type_at_the_read_sends_the_wait_to_the_subscriber(
    redis_client: redis.Redis,
) -> None:
    """A prefix writer puts a string where the waiter's box is (its name is in the line's
    wake ids): the BLPOP is refused (WRONGTYPE), and the wait goes on through the
    subscriber instead of raising out of acquire."""
    channel = RedisLock(redis_client, "lone:wrong-at-read").keys.channel
    waiter = _lone_waiter.waiter_for(redis_client, channel, "me", 5.0, lone=True)
    assert isinstance(waiter, _lone_waiter.BoxWaiter)
    with waiter:
        redis_client.set(waiter.box, "not a list")
        waiter.next_wake_id()
        assert waiter.wait(0.5) is True  # retry now, as a waiter of the subscriber
        assert waiter._fallback is not None
        assert waiter.next_wake_id().startswith(b"g")  # the subscriber's grant id
    assert not _lone_waiter._pool_box(redis_client.connection_pool).busy
