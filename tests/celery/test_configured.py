"""Locking by configuration (``redislock_tasks``): tasks that keep their own base get
``LockedTask``'s lock, in real ``celery worker`` processes and in eager mode; bad entries
stop the worker at start."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from celery import Celery, Task
from celery.worker.request import Request

from celery_redislock import LockConfigurationError, LockContendedError, RedisLock
from celery_redislock.celery.configured import configure_tasks
from celery_redislock.settings import task_rules
from celery_redislock.task import LockedRequest, LockedTask
from celery_redislock.testing import RedisServer

from .. import configured_app as cfg
from .._celery import CeleryProcess, wait_until, worker
from ..conftest import empty

APP = "tests.configured_app"


@pytest.fixture(scope="module")
def broker(celery_broker: RedisServer) -> Iterator[RedisServer]:
    empty(celery_broker)
    cfg.app.conf.update(broker_url=celery_broker.url, result_backend=celery_broker.url)
    cfg.URL = celery_broker.url
    cfg._r = None
    yield celery_broker
    cfg.app.close()


@pytest.fixture(scope="module")
def r(broker: RedisServer) -> Iterator[redis.Redis]:
    client = broker.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def configured_worker(
    broker: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryProcess]:
    log = tmp_path_factory.mktemp("configured") / "worker.log"
    proc = worker(broker.url, log, app=APP)
    yield proc
    proc.kill()


def sections(r: redis.Redis, name: str) -> list[tuple[str, int, bool, float, float]]:
    found = []
    for raw in r.lrange(f"sections:{name}", 0, -1):
        task_id, retries, owned, enter, leave = raw.decode().split()
        found.append((task_id, int(retries), owned == "True", float(enter), float(leave)))
    return found


OUTCOMES = ["ok", "fail", "retry", "ok", "fail", "retry"]


@pytest.mark.parametrize(
    ("task_name", "hooked"),
    [
        ("plain_work", False),  # configured, plain Task base
        ("based_work", True),  # configured, a base of its own
        ("locked_first", True),  # class T(LockedTask, HookedTask)
        ("hooked_first", True),  # class T(HookedTask, LockedTask)
    ],
)
def test_never_overlap_and_release_on_success_failure_and_retry(
    r: redis.Redis, configured_worker: CeleryProcess, task_name: str, hooked: bool
) -> None:
    task = getattr(cfg, task_name)
    name = f"n-{task_name}"
    results = [task.delay(name, 0.1, outcome) for outcome in OUTCOMES]
    for result in results:
        result.get(timeout=60, propagate=False)
    states = [result.state for result in results]
    assert states == ["SUCCESS", "FAILURE", "SUCCESS"] * 2

    seen = sections(r, name)
    runs = sorted((task_id, retries) for task_id, retries, *_ in seen)
    retried = [results[2].id, results[5].id]
    expected = sorted([(res.id, 0) for res in results] + [(tid, 1) for tid in retried])
    assert runs == expected  # each ran once, the retried ones twice
    assert all(owned for _, _, owned, _, _ in seen)  # always under its own lock
    spans = sorted((enter, leave) for *_, enter, leave in seen)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))  # never overlapped
    assert not r.exists("redislock:{job:" + name + "}")  # released every time
    assert f"{task.name}[" in configured_worker.text()
    if hooked:  # the base's own hooks ran too
        # after_return runs in the worker after the result is stored: result.get() may
        # return before the last one has run (Celery calls it for every run but the ones
        # that retried)
        def returned() -> int:
            return sum(h.startswith(b"after_return") for h in r.lrange(f"hooks:{name}", 0, -1))

        wait_until(lambda: returned() >= len(expected) - 2, timeout=30)
        hooks = [line.decode() for line in r.lrange(f"hooks:{name}", 0, -1)]
        calls = sum(h.startswith("call ") for h in hooks)
        if task_name == "hooked_first":  # its __call__ wraps LockedTask's: parked tries too
            assert calls >= len(expected)
        else:  # LockedTask first (as configuration composes): only runs under the lock
            assert calls == len(expected)
        assert sorted(h.split()[1] for h in hooks if h.startswith("on_failure")) == sorted(
            [results[1].id, results[4].id]
        )
        assert sorted(h.split()[1] for h in hooks if h.startswith("on_retry")) == sorted(retried)
        # (Celery calls after_return for every run but the ones that retried)
        assert sum(h.startswith("after_return") for h in hooks) == len(expected) - 2


def test_contention_parks_and_hands_over_like_locked_task(
    r: redis.Redis, configured_worker: CeleryProcess
) -> None:
    results = [cfg.based_work.delay("contended", 0.05) for _ in range(12)]
    for result in results:
        assert result.get(timeout=60) == "done"
    spans = sorted((enter, leave) for *_, enter, leave in sections(r, "contended"))
    assert len(spans) == 12
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
    text = configured_worker.text()
    assert "tests.configured_app.based_work[" in text
    assert "parked behind the holder of 'job:contended'" in text  # really contended
    assert not r.exists("redislock:{job:contended}")


def test_skip_when_held(r: redis.Redis, configured_worker: CeleryProcess) -> None:
    holder = RedisLock(r, "job:skipped", owner="someone else")
    assert holder.acquire(blocking=False)
    try:
        result = cfg.skip_work.delay("skipped")
        assert result.get(timeout=30) == {"lock": "job:skipped"}  # a ready state
        assert result.state == "SKIPPED" and result.ready()
    finally:
        holder.release()
    assert cfg.skip_work.delay("skipped").get(timeout=30) == "ran"


def test_replace_by_configuration_runs_the_first_and_the_newest(
    r: redis.Redis, configured_worker: CeleryProcess
) -> None:
    first = cfg.newest_work.delay("newest", "0", 0.8)
    wait_until(lambda: r.exists("redislock:{job:newest}"), what="the first run's lock")
    burst = [cfg.newest_work.delay("newest", str(i)) for i in range(1, 11)]
    assert first.get(timeout=30) == "0" and burst[-1].get(timeout=30) == "10"
    wait_until(lambda: all(c.state == "SUPERSEDED" for c in burst[:-1]), what="superseded")
    assert burst[0].get(timeout=30)["superseded_by"] in {c.id for c in burst[1:]}
    assert r.lrange("newest:newest", 0, -1) == [b"0", b"10"]
    wait_until(lambda: not r.exists("redislock:{job:newest}"), what="the lock released")


def test_worker_start_warns_of_an_unmatched_pattern(configured_worker: CeleryProcess) -> None:
    text = configured_worker.text()
    assert "redislock_tasks entry 'tests.configured_app.nothing.*' matches no registered task" in (
        text
    )


def test_only_matching_tasks_are_configured() -> None:
    outcome = configure_tasks(cfg.app)
    assert outcome.configured == {
        "tests.configured_app.plain_work": "tests.configured_app.plain_*",
        "tests.configured_app.based_work": "tests.configured_app.based_work",
        "tests.configured_app.skip_work": "tests.configured_app.skip_*",
        "tests.configured_app.newest_work": "tests.configured_app.newest_*",
    }
    assert outcome.unmatched == ["tests.configured_app.nothing.*"]
    assert not outcome.errors and not outcome.own_base
    assert not isinstance(cfg.unlocked, LockedTask)
    assert not isinstance(cfg.app.tasks["celery.chord_unlock"], LockedTask)


@pytest.mark.parametrize(
    ("kind", "option"),
    [("unknown", "'lock_tll'"), ("value", "lock_ttl must be"), ("argument", "nobody")],
)
def test_a_bad_entry_stops_the_worker_before_it_consumes(
    broker: RedisServer, r: redis.Redis, tmp_path: Path, kind: str, option: str
) -> None:
    queue = f"bad-{kind}"
    cfg.plain_work.apply_async(("bad",), queue=queue)
    assert r.llen(queue) == 1
    proc = CeleryProcess(
        ["worker", "-l", "info", "-c", "1", "-Q", queue, "--without-gossip", "--without-mingle"],
        url=broker.url,
        log=tmp_path / "w.log",
        env={"REDISLOCK_TEST_BAD_ENTRY": kind},
    )
    proc.app = APP
    proc.start()
    try:
        assert proc.process is not None
        proc.process.wait(60)
        text = proc.text()
        assert proc.process.returncode != 0, text
        assert "redislock_tasks['tests.configured_app.plain_work']" in text
        assert option in text
        assert "ready." not in text
        assert r.llen(queue) == 1  # nothing consumed
    finally:
        proc.stop()
        r.delete(queue)


def test_app_settings_are_checked_when_only_configured_tasks_lock(
    broker: RedisServer, tmp_path: Path
) -> None:
    """With no task of base=LockedTask, the worker-start checks of the redislock_* settings
    still run for the configured ones (a bad setting stops the worker)."""
    proc = CeleryProcess(
        ["worker", "-l", "info", "-c", "1", "-Q", "unused", "--without-gossip", "--without-mingle"],
        url=broker.url,
        log=tmp_path / "w.log",
        env={"REDISLOCK_TEST_ONLY_CONFIGURED": "1", "REDISLOCK_TEST_BAD_SETTING": "1"},
    )
    proc.app = APP
    proc.start()
    try:
        assert proc.process is not None
        proc.process.wait(60)
        text = proc.text()
        assert proc.process.returncode != 0, text
        assert "redislock_on_contention must be one of" in text
        assert "ready." not in text
    finally:
        proc.stop()


# ---------------------------------------------------------------- in-process: eager, direct


class Hooked(Task):  # type: ignore[misc]
    calls: ClassVar[list[str]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(f"call {self.name}")
        return super().__call__(*args, **kwargs)

    def after_return(self, status: str, *rest: Any) -> None:
        self.calls.append(f"after_return {self.name} {status}")


def eager_app(url: str, entries: Any) -> Celery:
    app = Celery("eager-configured", broker=url, backend=None, set_as_current=False)
    app.conf.update(task_always_eager=True, redislock_tasks=entries)
    return app


def test_eager_and_direct_calls_take_the_lock(broker: RedisServer, r: redis.Redis) -> None:
    app = eager_app(
        broker.url,
        [
            ("eager.skip*", {"lock_key": "job:{name}", "on_contention": "skip"}),
            ("eager.*", {"lock_key": "job:{name}", "lock_wait": 0.1}),
        ],
    )

    @app.task(bind=True, base=Hooked, name="eager.work")
    def work(self: Any, name: str) -> tuple[str, bool]:
        return self.lock.name, self.lock.owned()

    @app.task(name="eager.skipping")
    def skipping(name: str) -> str:
        return "ran"

    app.finalize()
    task = app.tasks["eager.work"]
    assert isinstance(task, LockedTask) and isinstance(task, Hooked)
    mro = type(task).__mro__
    assert mro[1] is LockedTask  # the lock's methods first, then the task's own class
    assert mro.index(LockedTask) < mro.index(type(task)._redislock_original) < mro.index(Hooked)
    Hooked.calls.clear()
    assert work.delay("e").get() == ("job:e", True)  # eager
    assert work("e") == ("job:e", True)  # direct
    assert Hooked.calls == ["call eager.work", "after_return eager.work SUCCESS", "call eager.work"]
    assert not r.exists("redislock:{job:e}")

    holder = RedisLock(r, "job:e", owner="someone else")
    assert holder.acquire(blocking=False)
    try:
        with pytest.raises(LockContendedError):
            work.delay("e").get()
        assert skipping("e") is None  # first matching entry: skip
    finally:
        holder.release()

    @app.task(name="eager.late")  # registered after the app was finalized
    def late(name: str) -> str:
        return "late"

    assert isinstance(app.tasks["eager.late"], LockedTask)
    assert late("e") == "late"


def test_composed_by_hand_in_either_order_eagerly(broker: RedisServer, r: redis.Redis) -> None:
    app = eager_app(broker.url, None)
    for order in ((LockedTask, Hooked), (Hooked, LockedTask)):
        base = type("Composed", order, {})

        @app.task(bind=True, base=base, lock_key="job:{name}", name=f"eager.{order[0].__name__}")
        def composed(self: Any, name: str) -> bool:
            return bool(self.lock.owned())

        Hooked.calls.clear()
        assert composed.delay("h").get() is True
        assert Hooked.calls[0] == f"call eager.{order[0].__name__}"
        assert not r.exists("redislock:{job:h}")


def test_an_own_locked_task_keeps_its_options_with_a_warning(
    broker: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    app = eager_app(broker.url, {"own.*": {"lock_key": "other:{name}"}})

    @app.task(bind=True, base=LockedTask, lock_key="mine:{name}", name="own.task")
    def own(self: Any, name: str) -> str:
        return str(self.lock.name)

    with caplog.at_level(logging.WARNING):
        app.finalize()
        outcome = configure_tasks(app)
    assert outcome.own_base == {"own.task": "own.*"} and not outcome.configured
    assert own("x") == "mine:x"
    assert "'own.task' matches redislock_tasks entry 'own.*' but has base=LockedTask" in (
        caplog.text
    )


def test_a_bad_entry_outside_a_worker_refuses_its_tasks(broker: RedisServer) -> None:
    app = eager_app(broker.url, {"bad.*": {"lock_key": "job:{nobody}"}})

    @app.task(name="bad.task")
    def bad(name: str) -> str:
        return "ran unlocked"

    @app.task(name="fine.task")
    def fine(name: str) -> str:
        return "fine"

    app.finalize()
    with pytest.raises(LockConfigurationError, match=r"redislock_tasks\['bad\.\*'\].*nobody"):
        bad("x")
    assert fine("x") == "fine"
    outcome = configure_tasks(app)
    assert len(outcome.errors) == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("billing.*", "redislock_tasks must be a dict"),
        ([("a", {}), ("b",)], "item 1"),
        ({3: {}}, "pattern 3 must be a non-empty str"),
        ({"a.*": "lock_key"}, "redislock_tasks['a.*'] must be a dict of LockedTask options"),
        ({"a": {"lock_tll": 3}}, "redislock_tasks['a']: unknown option 'lock_tll'"),
        ({"a": {"on_contention": "whenever"}}, "redislock_tasks['a']: option 'on_contention'"),
        ({"a": {"lock_hold": -1}}, "redislock_tasks['a']: option 'lock_hold'"),
        ({"a": {"lock_key": 3}}, "redislock_tasks['a']: option 'lock_key'"),
        ({"a": {"lock_key_hash": "yes"}}, "redislock_tasks['a']: option 'lock_key_hash'"),
    ],
)
def test_bad_settings_name_the_setting_pattern_and_option(value: Any, message: str) -> None:
    with pytest.raises(LockConfigurationError) as caught:
        task_rules({"redislock_tasks": value})
    assert message in str(caught.value)


def test_patterns_match_like_task_routes_first_entry_wins() -> None:
    rules = task_rules(
        {
            "redislock_tasks": [
                ("reports.daily", {"lock_hold": 300}),
                ("reports.*", {"on_contention": "skip"}),
                ("*", {}),
            ]
        }
    )

    def first(name: str) -> str | None:
        return next((rule.pattern for rule in rules if rule.matches(name)), None)

    assert first("reports.daily") == "reports.daily"
    assert first("reports.weekly.big") == "reports.*"
    assert first("reportsXdaily") == "*"
    assert first("celery.chord_unlock") is None  # a glob skips Celery's built-in tasks
    assert task_rules({"redislock_tasks": {"re?orts.[x]": {}}})[0].matches("re?orts.[x]")
    assert task_rules({}) == ()


class OwnRequest(Request):  # type: ignore[misc]
    """A base's own worker Request class."""


def test_a_base_with_its_own_request_or_strategy(broker: RedisServer) -> None:
    class WithRequest(Task):  # type: ignore[misc]
        Request = OwnRequest

    class WithStrategy(Task):  # type: ignore[misc]
        Strategy = "tests.celery.test_configured:eager_app"  # anything but Celery's default

    app = eager_app(broker.url, {"own.*": {"lock_key": "job:{name}"}})

    @app.task(base=WithRequest, name="own.request")
    def with_request(name: str) -> str:
        return name

    @app.task(base=WithStrategy, name="own.strategy")
    def with_strategy(name: str) -> str:
        return name

    app.finalize()
    request = app.tasks["own.request"].Request
    assert issubclass(request, LockedRequest) and issubclass(request, OwnRequest)
    outcome = configure_tasks(app)
    assert list(outcome.configured) == ["own.request"]
    assert len(outcome.errors) == 1
    assert "redislock_tasks['own.*']: task 'own.strategy'" in str(outcome.errors[0])
    assert "Strategy of its own" in str(outcome.errors[0])
