"""LockedTask checks that need no worker: decoration-time errors, eager mode, direct calls."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_redislock import LockConfigurationError, LockContendedError, LockKeyError, RedisLock
from celery_redislock.task import LockedTask
from celery_redislock.testing import RedisServer


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    app = Celery("inprocess", broker="memory://", backend="cache+memory://")
    app.conf.update(redislock_url=redis_server.url, redislock_wait=0.2, task_always_eager=True)
    app.finalize()  # tasks are created at decoration, as in a worker or after first use
    yield app
    app.close()


def test_a_placeholder_that_is_not_a_parameter_fails_at_decoration(app: Celery) -> None:
    with pytest.raises(LockConfigurationError, match=r"lock_key.*account_id") as info:

        @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
        def settle(acct: int, amount: int) -> None: ...

    assert "settle" in str(info.value)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("on_contention", "sometimes"),
        ("lock_ttl", 0),
        ("lock_wait", -1),
        ("lock_key", 42),
        ("lock_max_requeues", "many"),
        ("lock_hold", float("nan")),
        ("lock_key_hash", "yes"),
    ],
)
def test_bad_options_fail_at_decoration_naming_task_and_option(
    app: Celery, option: str, value: Any
) -> None:
    with pytest.raises(LockConfigurationError, match=option) as info:

        @app.task(shared=False, base=LockedTask, name="billing.settle", **{option: value})
        def settle(account_id: int) -> None: ...

    assert "billing.settle" in str(info.value)


def test_bound_tasks_skip_self_in_templates(app: Celery) -> None:
    @app.task(shared=False, bind=True, base=LockedTask, lock_key="user:{user_id}")
    def rebuild(self: Any, user_id: int, full: bool = False) -> str:
        return str(self.lock.token is not None)

    assert rebuild.lock_name((7,), {}) == rebuild.lock_name((), {"user_id": 7, "full": True})
    assert rebuild.delay(7).get() == "True"


def test_eager_and_direct_calls_take_the_lock_and_never_requeue(
    app: Celery, redis_server: RedisServer
) -> None:
    calls: list[int] = []

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int, amount: int) -> int:
        calls.append(amount)
        return amount

    assert settle.delay(7, 10).get() == 10  # eager
    assert settle(7, amount=20) == 20  # direct
    client = redis_server.client()
    RedisLock(client, "account:7", owner="someone-else", ttl=30).acquire()
    with pytest.raises(LockContendedError, match="never re-queue"):
        settle.delay(7, 30).get()
    with pytest.raises(LockContendedError):
        settle(7, 40)
    assert calls == [10, 20]
    assert not client.exists("redislock:{account:8}")


def test_skip_policy_returns_none_when_called_directly(
    app: Celery, redis_server: RedisServer
) -> None:
    @app.task(shared=False, base=LockedTask, on_contention="skip")
    def nightly() -> str:
        return "ran"

    assert nightly() == "ran"
    RedisLock(redis_server.client(), nightly.name, owner="other", ttl=30).acquire()
    assert nightly() is None


def test_a_value_that_cannot_be_rendered_raises_before_locking(app: Celery) -> None:
    @app.task(shared=False, base=LockedTask, lock_key="user:{user.id}")
    def greet(user: object) -> None: ...

    with pytest.raises(LockKeyError, match="user"):
        greet(object())


def test_a_missing_redis_url_is_a_clear_error_unless_the_broker_is_redis() -> None:
    app = Celery("nourl", broker="amqp://guest@127.0.0.1//")
    app.conf.task_always_eager = True

    @app.task(shared=False, base=LockedTask)
    def job() -> None: ...

    with pytest.raises(LockConfigurationError, match="redislock_url is not set"):
        job()


# ------------------------------------------------------------ nested direct and eager calls
#
# The rule these pin down: a direct or eager call is a plain function call made under the
# ownership of its caller. A nested direct or eager call on a key that an enclosing direct
# or eager call *of the same thread* already holds runs re-entrantly, as a nested call of
# the function would; it never waits for its own caller. Another thread's call on that key
# is excluded as before, and the nested call's end does not free the enclosing call's lock.


def held_by(client: Any, name: str) -> dict[bytes, bytes]:
    """The owners' hold counts of lock ``name`` (reserved fields left out)."""
    fields = client.hgetall(f"redislock:{{{name}}}")
    return {k: v for k, v in fields.items() if not k.startswith(b"__")}


def test_an_eager_delay_on_the_callers_own_key_runs_reentrantly(
    app: Celery, redis_client: Any
) -> None:
    client = redis_client
    seen: list[tuple[int, int]] = []

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int, depth: int) -> int:
        if depth:
            assert settle.delay(account_id, depth - 1).get(disable_sync_subtasks=False) == depth - 1
        seen.append((depth, len(held_by(client, f"account:{account_id}"))))
        return depth

    assert settle.delay(7, 2).get(disable_sync_subtasks=False) == 2
    # Every level ran, innermost first, each under the one lock, which stayed held until
    # the outermost call ended.
    assert seen == [(0, 1), (1, 1), (2, 1)]
    assert not client.exists("redislock:{account:7}")


def test_a_direct_call_nested_in_an_eager_run_on_its_key_runs_reentrantly(
    app: Celery, redis_client: Any
) -> None:
    calls: list[str] = []

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int, nested: bool) -> None:
        if nested:
            settle(account_id, False)  # a direct call from inside the eager run
        calls.append("nested" if not nested else "outer")

    settle.delay(7, True).get(disable_sync_subtasks=False)
    assert calls == ["nested", "outer"]


def test_a_direct_call_nested_in_a_direct_call_on_its_key_runs_reentrantly(
    app: Celery, redis_client: Any
) -> None:
    client = redis_client
    counts: list[dict[bytes, bytes]] = []

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int, nested: bool) -> None:
        if nested:
            settle(account_id, False)
        counts.append(held_by(client, "account:7"))

    settle(7, True)
    # One owner (the calling thread), two holds while nested, one after the nested end.
    assert [list(c.values()) for c in counts] == [[b"2"], [b"1"]]
    assert not client.exists("redislock:{account:7}")


def test_an_eager_delay_on_another_key_takes_that_lock(app: Celery, redis_client: Any) -> None:
    client = redis_client
    seen: dict[str, int] = {}

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int, then: int | None) -> None:
        if then is not None:
            settle.delay(then, None).get(disable_sync_subtasks=False)
        seen[f"account:{account_id}"] = len(held_by(client, "account:7")) + len(
            held_by(client, "account:8")
        )

    settle.delay(7, 8).get(disable_sync_subtasks=False)
    assert seen == {"account:8": 2, "account:7": 1}  # both held while the nested call ran


def test_another_locked_task_on_the_callers_key_runs_reentrantly_when_eager(
    app: Celery, redis_client: Any
) -> None:
    order: list[str] = []

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def refund(account_id: int) -> None:
        order.append("refund")

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int) -> None:
        refund.delay(account_id).get(disable_sync_subtasks=False)
        order.append("settle")

    settle.delay(7).get(disable_sync_subtasks=False)
    assert order == ["refund", "settle"]


def test_another_threads_eager_call_on_a_held_key_is_still_excluded(
    app: Celery, redis_client: Any
) -> None:
    outcome: list[BaseException | None] = []
    ran: list[int] = []

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int, spawn: bool) -> None:
        ran.append(account_id)
        if spawn:

            def other() -> None:
                try:
                    settle.delay(account_id, False).get(disable_sync_subtasks=False)
                    outcome.append(None)
                except Exception as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=other)
            thread.start()
            thread.join(10)

    settle.delay(7, True).get(disable_sync_subtasks=False)
    assert len(outcome) == 1 and isinstance(outcome[0], LockContendedError)
    assert ran == [7]  # the other thread's call never ran


def test_a_direct_call_of_another_locked_task_on_the_callers_key_runs_reentrantly(
    app: Celery, redis_client: Any
) -> None:
    order: list[str] = []

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def refund(account_id: int) -> None:
        order.append("refund")

    @app.task(shared=False, base=LockedTask, lock_key="account:{account_id}")
    def settle(account_id: int) -> None:
        refund(account_id)  # direct, from inside an eager run of another task
        order.append("settle")

    settle.delay(7).get(disable_sync_subtasks=False)
    assert order == ["refund", "settle"]
