"""LockedTask checks that need no worker: decoration-time errors, eager mode, direct calls."""

from __future__ import annotations

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
