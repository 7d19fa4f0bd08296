"""Property-based tests (Hypothesis): whatever a caller passes, only documented outcomes.

* durations, for every argument and setting that takes one: accepted (and the lock then
  works against a real redis-server, and nothing stays held after release), or a
  ``LockConfigurationError`` naming the argument, with nothing written to Redis;
* lock names (str or bytes, braces, ``%``, any Unicode, empty): usable and mapped back
  by ``name_from_lock_key``, or refused with ``LockConfigurationError``;
* key templates: ``LockConfigurationError`` when defined, ``LockKeyError`` when rendered,
  nothing else; equal calls render equal keys, different values different keys;
* ``LockSettings.from_conf`` on any mapping: settings, or ``LockConfigurationError``.

One redis-server serves the module; each example starts from an empty database.
"""

from __future__ import annotations

import asyncio
import decimal
import math
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_redislock import (
    AsyncRedisLock,
    KeyTemplate,
    LockConfigurationError,
    LockKeyError,
    LockLostError,
    RedisLock,
    RedLock,
    locked,
)
from celery_redislock._core import MAX_SECONDS, LockKeys, name_from_lock_key
from celery_redislock.aio import aclose_background
from celery_redislock.settings import LockSettings, task_overrides
from celery_redislock.testing import RedisServer

#: Modest example counts and no deadline: the whole module stays well under 30 s on a
#: loaded two-core machine.
FEW = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
SOME = settings(FEW, max_examples=100)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


@pytest.fixture(scope="module")
def client(server: RedisServer) -> Iterator[redis.Redis]:
    connection = server.client()
    yield connection
    connection.close()


def fresh(client: redis.Redis) -> redis.Redis:
    client.flushall()  # this module's own server
    return client


# ------------------------------------------------------------------ durations

#: Edge values: the bounds, just past them, what used to break (1e12, sys.maxsize, 1e16),
#: what is not a number at all.
EDGES = [
    0,
    0.0,
    -0.0,
    -1,
    0.0004,
    0.001,
    0.0015,
    1,
    MAX_SECONDS,
    float(MAX_SECONDS),
    MAX_SECONDS + 0.001,
    MAX_SECONDS + 1,
    1e12,
    1e16,
    sys.maxsize,
    10**400,
    math.inf,
    -math.inf,
    math.nan,
    True,
    False,
    None,
    "30",
    b"30",
    [30],
    decimal.Decimal("30"),
]

durations = st.one_of(
    st.sampled_from(EDGES),
    st.floats(min_value=0.001, max_value=MAX_SECONDS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=3),
)


def is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not (isinstance(value, float) and not math.isfinite(value))


def accepted(value: object, low: float, *, rounded: bool = False) -> bool | None:
    """The documented rule: a number from ``low`` to 365 days. None: either outcome is
    right (a lease is rounded to whole milliseconds, so 0.0006 s is 1 ms)."""
    if not is_number(value) or value > MAX_SECONDS:  # type: ignore[operator]
        return False
    if value >= low:  # type: ignore[operator]
        return True
    return None if rounded and value >= low / 2 else False  # type: ignore[operator]


def lease_ok(value: object) -> bool | None:
    return accepted(value, 0.001, rounded=True)


def check(value: object, low: float, argument: str, attempt: Any, *, rounded: bool = False) -> Any:
    """Run ``attempt``; it must succeed when ``value`` is allowed, and otherwise raise a
    LockConfigurationError that names ``argument`` and the upper bound."""
    expected = accepted(value, low, rounded=rounded)
    try:
        result = attempt()
    except LockConfigurationError as exc:
        event("refused")
        assert expected is not True, f"{value!r} refused: {exc}"
        assert str(exc).startswith(argument) and str(MAX_SECONDS) in str(exc), str(exc)
        return None
    assert expected is not False, f"{value!r} accepted as {argument}"
    event("accepted")
    return result


def lock_key_gone(client: redis.Redis, lock: Any) -> bool:
    return client.exists(lock.keys.lock) == 0


def use(client: redis.Redis, lock: RedisLock, lease_seconds: float, **acquire: Any) -> None:
    """Take and give back ``lock``; only a lease too short to outlive the round trips may
    be lost on the way. Nothing stays held."""
    assert lock.acquire(blocking=False, **acquire)
    try:
        lock.release()
    except LockLostError:
        assert lease_seconds < 1.0
    assert lock_key_gone(client, lock)


@SOME
@given(ttl=durations)
def test_lock_ttl(client: redis.Redis, ttl: Any) -> None:
    fresh(client)
    lock = check(
        ttl, 0.001, "ttl", lambda: RedisLock(client, "job", ttl=ttl, auto_renew=False), rounded=True
    )
    if lock is None:
        assert client.dbsize() == 0
    else:
        use(client, lock, ttl)


@SOME
@given(lease=durations)
def test_acquire_lease(client: redis.Redis, lease: Any) -> None:
    lock = RedisLock(fresh(client), "job", ttl=30)
    if lease is None:  # the lock's ttl, renewed
        use(client, lock, 30, lease=None)
    elif check(
        lease, 0.001, "lease", lambda: lock.acquire(blocking=False, lease=lease), rounded=True
    ):
        try:
            lock.release()
        except LockLostError:
            assert lease < 1.0
    assert lock_key_gone(client, lock) and lock.hold_count == 0
    assert client.dbsize() <= 1  # the fence counter, when it was taken


@FEW
@given(ttl=durations)
def test_extend(client: redis.Redis, ttl: Any) -> None:
    lock = RedisLock(fresh(client), "job", ttl=30, auto_renew=False)
    assert lock.acquire()
    before = client.execute_command("PEXPIRETIME", lock.keys.lock)
    if check(ttl, 0.001, "ttl", lambda: lock.extend(ttl) or True, rounded=True):
        assert client.pttl(lock.keys.lock) <= round(ttl * 1000)
    else:
        assert client.execute_command("PEXPIRETIME", lock.keys.lock) == before
    try:
        lock.release()
    except LockLostError:
        assert ttl < 1.0
    assert lock_key_gone(client, lock)


@SOME
@given(timeout=durations)
def test_acquire_timeout(client: redis.Redis, timeout: Any) -> None:
    lock = RedisLock(fresh(client), "job", auto_renew=False)
    if timeout is None or check(timeout, 0, "timeout", lambda: lock.acquire(timeout=timeout)):
        if timeout is None:
            assert lock.acquire(timeout=None)
        lock.release()
    else:
        assert client.dbsize() == 0
    assert lock_key_gone(client, lock)


@FEW
@given(timeout=durations, replica_timeout=durations)
def test_constructor_timeouts(client: redis.Redis, timeout: Any, replica_timeout: Any) -> None:
    fresh(client)
    made = timeout is None or check(
        timeout, 0, "timeout", lambda: RedisLock(client, "job", timeout=timeout)
    )
    if made:
        lock = check(
            replica_timeout,
            0.001,
            "replica_timeout",
            lambda: RedisLock(client, "job", timeout=timeout, replica_timeout=replica_timeout),
            rounded=True,
        )
        if lock is not None:
            with lock:
                assert lock.owned()
            assert lock_key_gone(client, lock)
    assert client.dbsize() <= 1


@FEW
@given(ttl=durations, node_timeout=durations, retry_delay=durations)
def test_quorum_lock_durations(
    client: redis.Redis, ttl: Any, node_timeout: Any, retry_delay: Any
) -> None:
    fresh(client)
    per_node = 0.25 if node_timeout is None else node_timeout  # None: the default
    assume(lease_ok(ttl) is not None)
    # What must be refused, in the order the constructor checks it.
    if not lease_ok(ttl):
        refusal = "ttl must be"
    elif not accepted(per_node, 0.001):
        refusal = "node_timeout must be"
    elif per_node * 2 >= ttl:
        refusal = "node_timeout ("  # ... must be well below ttl
    elif not accepted(retry_delay, 0):
        refusal = "retry_delay must be"
    else:
        refusal = ""
    try:
        lock = RedLock(
            [client],
            "job",
            ttl=ttl,
            node_timeout=node_timeout,
            retry_delay=retry_delay,
            auto_renew=False,
        )
    except LockConfigurationError as exc:
        assert refusal and str(exc).startswith(refusal), str(exc)
        assert client.dbsize() == 0
        return
    assert not refusal
    if per_node >= 0.5 and ttl >= 5:  # room for the round trips on a loaded machine
        assert lock.acquire(blocking=False)
        lock.release()
        assert lock_key_gone(client, lock)
    assert client.dbsize() <= 1


@FEW
@given(node_timeout=st.floats(min_value=0.001, max_value=100))
def test_quorum_node_timeout_must_be_well_below_the_ttl(
    client: redis.Redis, node_timeout: float
) -> None:
    fresh(client)
    if node_timeout * 2 >= 30:
        with pytest.raises(LockConfigurationError, match=r"^node_timeout .* well below ttl"):
            RedLock([client], "job", ttl=30, node_timeout=node_timeout)
    else:
        RedLock([client], "job", ttl=30, node_timeout=node_timeout)
    assert client.dbsize() == 0


@FEW
@given(ttl=durations, lease=durations)
def test_asyncio_lock_ttl_and_lease(
    server: RedisServer, client: redis.Redis, ttl: Any, lease: Any
) -> None:
    fresh(client)

    async def run() -> None:
        connection = aioredis.Redis(port=server.port)
        try:
            lock = check(
                ttl, 0.001, "ttl", lambda: AsyncRedisLock(connection, "job", ttl=ttl), rounded=True
            )
            if lock is None:
                return
            try:
                taken = await lock.acquire(blocking=False, lease=lease)
            except LockConfigurationError as exc:
                assert lease is not None and lease_ok(lease) is not True
                assert str(exc).startswith("lease must be")
            else:
                assert taken and (lease is None or lease_ok(lease) is not False)
                try:
                    await lock.release()
                except LockLostError:
                    assert (ttl if lease is None else lease) < 1.0
            assert lock_key_gone(client, lock)
        finally:
            await aclose_background(connection)
            await connection.aclose()

    asyncio.run(run())
    assert client.dbsize() <= 1


@FEW
@given(ttl=durations, timeout=durations, retry_delay=durations)
def test_locked_decorator_durations(
    client: redis.Redis, ttl: Any, timeout: Any, retry_delay: Any
) -> None:
    fresh(client)

    def decorate() -> Any:
        return locked(client, "job:{n}", ttl=ttl, timeout=timeout, retry_delay=retry_delay)

    assume(lease_ok(ttl) is not None)
    expected = [lease_ok(ttl), timeout is None or accepted(timeout, 0), accepted(retry_delay, 0)]
    try:
        decorator = decorate()
    except LockConfigurationError as exc:
        named = [
            str(exc).startswith(f"{name} must be") for name in ("ttl", "timeout", "retry_delay")
        ]
        first_bad = next(i for i, ok in enumerate(expected) if ok is not True)
        assert named[first_bad], str(exc)
        assert client.dbsize() == 0
        return
    assert all(ok is not False for ok in expected)

    @decorator
    def job(n: int) -> int:
        return n * 2

    try:
        assert job(21) == 42
    except LockLostError:
        assert ttl < 1.0  # a lease shorter than the call
    assert client.exists(LockKeys.for_name("job:21").lock) == 0


#: setting or task option -> (lowest value, whether it is a lease rounded to milliseconds)
DURATION_SETTINGS = {
    "redislock_ttl": (0.001, True),
    "redislock_wait": (0, False),
    "redislock_done_ttl": (0.001, True),
    "redislock_node_timeout": (0.001, False),
}
DURATION_OPTIONS = {
    "lock_ttl": (0.001, True),
    "lock_wait": (0, False),
    "lock_done_ttl": (0.001, True),
}


@SOME
@given(setting=st.sampled_from(sorted(DURATION_SETTINGS)), value=durations)
def test_duration_settings(setting: str, value: Any) -> None:
    if value is None:
        return  # None: the default applies
    conf = {"broker_url": "redis://localhost", setting: value}
    low, rounded = DURATION_SETTINGS[setting]
    found = check(value, low, setting, lambda: LockSettings.from_conf(conf), rounded=rounded)
    if found is not None:
        used = {
            "redislock_ttl": found.defaults.ttl,
            "redislock_wait": found.defaults.wait,
            "redislock_done_ttl": found.defaults.done_ttl,
            "redislock_node_timeout": found.node_timeout,
        }
        assert used[setting] == float(value)


@SOME
@given(option=st.sampled_from(sorted(DURATION_OPTIONS)), value=durations)
def test_duration_task_options(option: str, value: Any) -> None:
    if value is None:
        return  # None: the app's setting applies
    low, rounded = DURATION_OPTIONS[option]
    found = check(
        value,
        low,
        f"task 't': {option}",
        lambda: task_overrides({option: value}, "t"),
        rounded=rounded,
    )
    assert found is None or list(found.values()) == [float(value)]


@SOME
@given(hold=durations)
def test_lock_hold(hold: Any) -> None:
    try:
        found = task_overrides({"lock_hold": hold}, "t")
    except LockConfigurationError as exc:
        assert hold is not None and not (is_number(hold) and hold == 0)
        assert lease_ok(hold) is not True
        assert str(exc).startswith("task 't': lock_hold must be 0 (release at once) or a number")
        return
    if hold is not None:
        assert found["hold"] == (0 if hold == 0 else float(hold))
        assert found["hold"] == 0 or lease_ok(hold) is not False


@SOME
@given(base=durations, cap=durations)
def test_requeue_backoff(base: Any, cap: Any) -> None:
    conf = {"broker_url": "redis://localhost", "redislock_requeue_backoff": (base, cap)}
    try:
        found = LockSettings.from_conf(conf).defaults.requeue_backoff
    except LockConfigurationError as exc:
        assert str(exc).startswith("redislock_requeue_backoff")
        assert not (accepted(base, 0.001) and accepted(cap, 0.001) and cap >= base)
        return
    assert accepted(base, 0.001) and accepted(cap, 0.001) and cap >= base
    assert found == (float(base), float(cap))


# ------------------------------------------------------------------ lock names

names = st.one_of(
    st.text(max_size=12),
    st.text(alphabet="{}%7BDd25:a", max_size=12),
    st.binary(max_size=12),
    st.sampled_from(
        ["", b"", "{", "}", "%", "%7B", "%257D", "{a}", "\x00", "\ud800", "é", b"\xff"]
    ),
)
prefixes = st.one_of(st.just("redislock:"), st.text(max_size=6), st.sampled_from(["a{", "}"]))


def usable_prefix(prefix: str) -> bool:
    """The documented prefix rule: no brace (it would move the cluster hash tag), UTF-8."""
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "{" not in prefix and "}" not in prefix


def raw(name: str | bytes) -> bytes | None:
    """The name's bytes, or None when the documented rules refuse it."""
    if isinstance(name, str):
        try:
            name = name.encode("utf-8")
        except UnicodeEncodeError:
            return None
    return name or None


@SOME
@given(name=names, prefix=prefixes)
def test_names_round_trip_or_are_refused(name: str | bytes, prefix: str) -> None:
    try:
        keys = LockKeys.for_name(name, prefix)
    except LockConfigurationError as exc:
        if str(exc).startswith("prefix must"):  # found by this test: "{}" split the slots
            assert not usable_prefix(prefix), str(exc)
            return
        assert raw(name) is None, str(exc)
        assert str(exc).startswith("name must")
        return
    assert usable_prefix(prefix)
    assert raw(name) is not None
    assert name_from_lock_key(keys.lock, prefix) == raw(name)
    for other in (keys.fence, keys.channel, keys.waiters, keys.claims):
        assert name_from_lock_key(other, prefix) is None
    assert len({key_slot(k) for k in (keys.lock, keys.fence, keys.channel, keys.waiters)}) == 1


usable_names = names.filter(lambda name: raw(name) is not None)


@SOME
@given(first=usable_names, second=usable_names)
def test_different_names_never_share_a_key(first: str | bytes, second: str | bytes) -> None:
    assume(raw(first) != raw(second))
    assert LockKeys.for_name(first).lock != LockKeys.for_name(second).lock


@SOME
@given(name=names, prefix=prefixes)
def test_any_name_locks_or_is_refused_before_any_write(
    client: redis.Redis, name: str | bytes, prefix: str
) -> None:
    fresh(client)
    try:
        lock = RedisLock(client, name, prefix=prefix, auto_renew=False)
    except LockConfigurationError as exc:
        assert raw(name) is None or not usable_prefix(prefix), str(exc)
        assert client.dbsize() == 0
        return
    with lock:
        found = [k for k in client.keys("*") if name_from_lock_key(k, prefix) is not None]
        assert [name_from_lock_key(k, prefix) for k in found] == [raw(name)]
        assert lock.owned()
    assert lock_key_gone(client, lock) and not lock.locked()


# ------------------------------------------------------------------ key templates


def job(account: Any, amount: Any = 0, *rest: Any, note: Any = None, **extra: Any) -> None:
    """The keyed function: positional, default, *args, keyword-only and **kwargs."""


def fixed(account: Any, amount: Any) -> None:
    """A keyed function without **kwargs: unknown placeholders are refused."""


template_parts = st.lists(
    st.sampled_from(
        [
            "{account}",
            "{amount}",
            "{note}",
            "{rest}",
            "{extra}",
            "{other}",
            "{account.real}",
            "{account[0]}",
            "{account[k]}",
            "{amount.x.y}",
            "{0}",
            "{}",
            "{account!r}",
            "{account:>3}",
            ":",
            "-",
            "k",
            "{{",
            "}}",
            "{",
            "}",
        ]
    ),
    max_size=4,
).map("".join)
templates = st.one_of(st.text(alphabet="{}[]._:!0 ab", max_size=14), template_parts)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["", "7", "\ud800", "a:b"]),
    st.binary(max_size=4),
    st.uuids(),
    st.decimals(allow_nan=True),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), inner, max_size=3),
    ),
    max_leaves=6,
) | st.sampled_from([{1, 2}, object(), range(3), 1j])


def typed(value: Any) -> Any:
    """What a rendered key must tell apart: type and value, all the way down."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(typed(v) for v in value))
    if isinstance(value, dict):
        return ("dict", frozenset((typed(k), typed(v)) for k, v in value.items()))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, decimal.Decimal):
        return ("decimal", str(value))
    return (type(value).__name__, value)


@SOME
@given(spec=templates, hashed=st.booleans(), with_kwargs=st.booleans())
def test_templates_are_refused_only_with_a_configuration_error(
    spec: str, hashed: bool, with_kwargs: bool
) -> None:
    try:
        KeyTemplate(spec, job if with_kwargs else fixed, owner_name="t", hashed=hashed)
    except LockConfigurationError as exc:
        assert str(exc).startswith("t: lock_key=")


@SOME
@given(
    spec=template_parts,
    args=st.lists(values, max_size=3),
    kwargs=st.dictionaries(st.sampled_from(["account", "amount", "note", "other", "zz"]), values),
)
def test_rendering_fails_only_with_a_key_error(
    spec: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    try:
        template = KeyTemplate(spec, job, owner_name="t")
    except LockConfigurationError:
        assume(False)
        return
    try:
        key = template.render(args, kwargs)
    except LockKeyError as exc:
        assert exc.owner == "t" and exc.option == "lock_key"
        return
    assert isinstance(key, str) and key
    assert template.render(list(args), dict(kwargs)) == key


@SOME
@given(first=st.tuples(values, values), second=st.tuples(values, values), hashed=st.booleans())
def test_a_template_keys_equal_calls_alike_and_different_values_apart(
    first: tuple[Any, Any], second: tuple[Any, Any], hashed: bool
) -> None:
    template = KeyTemplate("acct:{account}:{amount}", job, owner_name="t", hashed=hashed)
    try:
        keys = [template.render(call, {}) for call in (first, second)]
    except LockKeyError:
        return
    # However the arguments are passed, the same values give the same key.
    assert template.render((), {"account": first[0], "amount": first[1]}) == keys[0]
    if typed(first) != typed(second):
        assert keys[0] != keys[1]
    else:
        assert keys[0] == keys[1]


# ------------------------------------------------------------------ settings

SETTING_NAMES = [
    "broker_url",
    "redislock_url",
    "redislock_urls",
    "redislock_node_timeout",
    "redislock_redis_options",
    "redislock_prefix",
    "redislock_ttl",
    "redislock_on_contention",
    "redislock_wait",
    "redislock_wait_fallback",
    "redislock_max_requeues",
    "redislock_requeue_backoff",
    "redislock_requeue_exhausted",
    "redislock_release_on_retry",
    "redislock_lookahead",
    "redislock_run_on",
    "redislock_done_ttl",
    "redislock_park_fallback",
    "redislock_park_at_delivery",
    "redislock_queues_in_other_db",
    "redislock_unknown",
]
setting_values = st.one_of(
    durations,
    st.sampled_from(
        [
            "redis://localhost:6379/0",
            "rediss://h/1",
            "unix:///tmp/r.sock",
            "amqp://guest@h//",
            "redis://",
            "requeue",
            "wait",
            "skip",
            "raise",
            "fail",
            "drop",
            "auto",
            "p:",
            "a{b",
            "",
        ]
    ),
    st.lists(st.sampled_from(["redis://a", "redis://b", "redis://a", 3, None]), max_size=4),
    st.tuples(durations, durations),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.booleans(),
    st.integers(),
)


@settings(SOME, max_examples=300)
@given(conf=st.dictionaries(st.sampled_from(SETTING_NAMES), setting_values))
def test_any_settings_give_settings_or_a_configuration_error(conf: dict[str, Any]) -> None:
    try:
        found = LockSettings.from_conf(conf)
    except LockConfigurationError:
        return
    options = found.defaults
    for seconds in (
        options.run_on,
        options.ttl,
        options.wait,
        options.done_ttl,
        found.node_timeout,
        *options.requeue_backoff,
    ):
        assert 0 <= seconds <= MAX_SECONDS


@settings(SOME, max_examples=200)
@given(
    attributes=st.dictionaries(
        st.sampled_from(
            [
                "lock_ttl",
                "lock_prefix",
                "on_contention",
                "lock_wait",
                "lock_wait_fallback",
                "lock_max_requeues",
                "lock_requeue_backoff",
                "lock_requeue_exhausted",
                "lock_release_on_retry",
                "lock_done_ttl",
                "lock_hold",
                "lock_lookahead",
                "lock_run_on",
            ]
        ),
        setting_values,
    )
)
def test_any_task_options_give_overrides_or_a_configuration_error(
    attributes: dict[str, Any],
) -> None:
    try:
        task_overrides(attributes, "t")
    except LockConfigurationError as exc:
        assert str(exc).startswith("task 't': ")
