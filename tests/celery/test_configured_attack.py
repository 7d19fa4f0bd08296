"""Attacks on locking by configuration (``redislock_tasks``) as a demanding Celery user
would write tasks: shared tasks, autoretry, class-based tasks, keyword-only keys, bases with
their own ``__call__``/metaclass/``Request``, canvas, ``replace()``, every pool; the class
swap re-applied (late registration, reconfiguration); hostile entries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, Task, chain, chord, group

from celery_redislock import LockConfigurationError
from celery_redislock.celery.configured import configure_tasks
from celery_redislock.task import LockedRequest, LockedTask
from celery_redislock.testing import RedisServer

from .. import configured_attack_app as atk
from .._celery import CeleryProcess, worker
from ..conftest import empty

APP = "tests.configured_attack_app"
P = atk.P


@pytest.fixture(scope="module")
def broker(celery_broker: RedisServer) -> Iterator[RedisServer]:
    empty(celery_broker)
    atk.app.conf.update(broker_url=celery_broker.url, result_backend=celery_broker.url)
    atk.URL = celery_broker.url
    atk._r = None
    yield celery_broker
    atk.app.close()


@pytest.fixture(autouse=True)
def attack_app_is_current() -> None:
    """``@shared_task`` sends through the *current* app, and every ``Celery()`` made in
    an earlier test (or module) becomes current: without this, a shared task's message
    went to another app's broker once the whole suite ran (CI)."""
    atk.app.set_current()


@pytest.fixture(scope="module")
def r(broker: RedisServer) -> Iterator[redis.Redis]:
    client = broker.client()
    yield client
    client.close()


@pytest.fixture(scope="module", params=["prefork", "solo", "threads"])
def pool_worker(
    request: pytest.FixtureRequest, broker: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryProcess]:
    pool = request.param
    log = tmp_path_factory.mktemp(f"attack-{pool}") / "worker.log"
    proc = worker(broker.url, log, app=APP, pool=pool, concurrency=1 if pool == "solo" else 3)
    proc.pool = pool  # type: ignore[attr-defined]
    yield proc
    proc.kill()


def sections(r: redis.Redis, name: str) -> list[tuple[str, str, int, bool, str, float, float]]:
    found = []
    for raw in r.lrange(f"sections:{name}", 0, -1):
        task, task_id, retries, owned, lock, enter, leave = raw.decode().split()
        found.append(
            (task, task_id, int(retries), owned == "True", lock, float(enter), float(leave))
        )
    return found


def assert_serial(r: redis.Redis, name: str, lock: str, runs: int) -> None:
    seen = sections(r, name)
    assert len(seen) == runs, seen
    assert all(owned and held == lock for _, _, _, owned, held, _, _ in seen), seen
    spans = sorted((enter, leave) for *_, enter, leave in seen)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans  # never overlapped
    assert not r.exists("redislock:{" + lock + "}")  # released every time


KINDS = ["shared_work", "class_work", "direct_work", "meta_work", "dotted_work"]


def test_every_kind_of_task_locks_in_every_pool(r: redis.Redis, pool_worker: CeleryProcess) -> None:
    pool = pool_worker.pool  # type: ignore[attr-defined]
    results = []
    for kind in KINDS:
        task = getattr(atk, kind)
        results += [(kind, task.delay(f"{pool}-{kind}")) for _ in range(3)]
    results += [("account", atk.account_work.delay(account_id=7, amount=1.5)) for _ in range(3)]
    results += [("autoretry", atk.autoretry_work.delay(f"{pool}-autoretry")) for _ in range(2)]
    for _, result in results:
        result.get(timeout=60)
    for kind in KINDS:
        assert_serial(r, f"{pool}-{kind}", f"job:{pool}-{kind}", 3)
    seen_account = sections(r, "acct7")
    r.delete("sections:acct7")
    assert len(seen_account) == 3 and all(s[4] == "acct:7" and s[3] for s in seen_account)
    assert_serial(r, f"{pool}-autoretry", f"job:{pool}-autoretry", 6)  # each ran 3 times
    assert r.llen(f"hooks:{pool}-direct_work") == 3  # the base's own __call__ ran
    accepted = [line.decode().split()[0] for line in r.lrange("own-request", 0, -1)]
    r.delete("own-request")
    assert len(accepted) >= 3  # the dotted-string Request ran, combined with LockedRequest
    assert set(accepted) == {"LockedOwnRequest"}
    assert f"{P}meta_work[" in pool_worker.text()


def test_canvas_over_one_key(r: redis.Redis, broker: RedisServer, tmp_path: Path) -> None:
    """Group, chain, chord of .si() signatures over one key, replace() with a task of the
    same key, a countdown; on an autoscaling worker (pool processes forked after start)."""
    extra = ["--autoscale=3,1"]
    proc = worker(broker.url, tmp_path / "w.log", app=APP, name="w2", extra=extra)
    try:
        work = atk.shared_work
        group(work.si("canvas-g", 0.05) for _ in range(5)).apply_async().get(timeout=60)
        steps = (work.si("canvas-c"), atk.class_work.si("canvas-c"), work.si("canvas-c"))
        assert chain(*steps).apply_async().get(timeout=60) == "shared"
        chord([work.si("canvas-d", 0.05) for _ in range(3)])(work.si("canvas-d")).get(timeout=60)
        atk.replacing_work.delay("canvas-r").get(timeout=60)
        assert work.apply_async(("canvas-e",), countdown=0.5).get(timeout=60) == "shared"
        assert_serial(r, "canvas-g", "job:canvas-g", 5)
        assert_serial(r, "canvas-c", "job:canvas-c", 3)
        assert_serial(r, "canvas-d", "job:canvas-d", 4)
        assert_serial(r, "canvas-r", "job:canvas-r", 2)  # replacing_work, then shared_work
        assert_serial(r, "canvas-e", "job:canvas-e", 1)
        inspect = atk.app.control.inspect(timeout=30, destination=["w2@localhost"], limit=1)
        names = (inspect.registered() or {})["w2@localhost"]
        assert f"{P}class_work" in names and f"{P}meta_work" in names
        assert "succeeded" in proc.text()  # (the module's last pool worker consumes too)
    finally:
        proc.kill()


# ---------------------------------------------------------------- in-process: re-applying


def eager_app(url: str, entries: Any) -> Celery:
    app = Celery("attack-eager", broker=url, backend=None, set_as_current=False)
    app.conf.update(task_always_eager=True, redislock_tasks=entries)
    return app


def lock_name(task: Any) -> str | None:
    lock = task.lock if isinstance(task, LockedTask) else None
    return None if lock is None else str(lock.name)


def test_a_late_task_reconfigured_still_runs(broker: RedisServer) -> None:
    """A task registered after finalization is swapped before Celery binds it (its bound
    state lands on the swapped class); a later configure_tasks (worker start) with another
    entry must keep it runnable, not lose its request stack."""
    app = eager_app(broker.url, {"late.*": {"lock_key": "job:{name}"}})
    app.finalize()

    @app.task(bind=True, name="late.decorated")
    def decorated(self: Any, name: str) -> str | None:
        return lock_name(self)

    class Old(Task):  # type: ignore[misc]
        name = "late.class"

        def run(self, name: str) -> str | None:
            return lock_name(self)

    registered = app.register_task(Old())
    for task in (decorated, registered):
        assert task("a") == "job:a"
    app.conf.redislock_tasks = {"late.*": {"lock_key": "other:{name}"}}
    assert set(configure_tasks(app).configured) == {"late.decorated", "late.class"}
    for task in (decorated, registered):
        assert task("a") == "other:a"  # direct
        assert task.delay("a").get() == "other:a"  # eager


def test_an_entry_removed_unlocks_its_tasks(broker: RedisServer) -> None:
    """configure_tasks applies the setting as it is now: a task no entry matches any more
    gets its own class back (not the stale lock of the removed entry)."""
    app = eager_app(broker.url, {"gone.*": {"lock_key": "job:{name}"}})

    @app.task(bind=True, name="gone.task")
    def gone(self: Any, name: str) -> str | None:
        return lock_name(self)

    app.finalize()
    original = type(app.tasks["gone.task"])._redislock_original
    assert gone("a") == "job:a"
    app.conf.redislock_tasks = {"other.*": {}}
    configure_tasks(app)
    assert type(app.tasks["gone.task"]) is original
    assert gone("a") is None
    app.conf.redislock_tasks = {"gone.*": {"lock_key": "again:{name}"}}
    configure_tasks(app)
    assert gone("a") == "again:a"


def test_a_bad_setting_fixed_unrefuses_its_tasks(broker: RedisServer) -> None:
    """A task refused because the setting was bad runs (locked) once the setting is fixed,
    even when its own entry has no options."""
    app = eager_app(broker.url, {"fix.*": {}, "other": {"lock_tll": 1}})

    @app.task(bind=True, name="fix.task")
    def fix(self: Any) -> str | None:
        return lock_name(self)

    app.finalize()
    with pytest.raises(LockConfigurationError, match="lock_tll"):
        fix()
    app.conf.redislock_tasks = {"fix.*": {}}
    outcome = configure_tasks(app)
    assert outcome.errors == [] and outcome.configured == {"fix.task": "fix.*"}
    assert fix() == "fix.task"  # lock_key None: one lock per task, named after it


def test_a_second_app_and_finalize_twice(broker: RedisServer) -> None:
    """A shared task is configured in the app whose setting matches it only; finalizing
    again changes nothing; the swapped class keeps its Celery identity."""
    locked = eager_app(broker.url, {P + "shared_*": {"lock_key": "job:{name}"}})
    plain = eager_app(broker.url, None)
    locked.finalize()
    plain.finalize()
    first = locked.tasks[P + "shared_work"]
    swapped = type(first)
    locked.finalize()
    configure_tasks(locked)
    assert locked.tasks[P + "shared_work"] is first and type(first) is swapped
    assert isinstance(first, LockedTask) and not isinstance(
        plain.tasks[P + "shared_work"], LockedTask
    )
    assert first.name == P + "shared_work" and first.app is locked
    assert swapped.__qualname__ == swapped._redislock_original.__qualname__


def test_the_swapped_classes_keep_their_metaclass_hooks_and_request(broker: RedisServer) -> None:
    configure_tasks(atk.app)
    meta = atk.app.tasks[P + "meta_work"]
    assert type(type(meta)) is atk.Meta and isinstance(meta, (LockedTask, atk.MetaBase))
    swapped = type(meta)
    for made in (atk.Meta.made, atk.MetaBase.subclasses):  # metaclass and hook ran for both
        assert swapped in made and swapped._redislock_original in made
    request = atk.app.tasks[P + "dotted_work"].Request
    assert issubclass(request, LockedRequest) and issubclass(request, atk.OwnRequest)
    for kind in ("class_work", "account_work", "autoretry_work", "direct_work"):
        assert isinstance(atk.app.tasks[P + kind], LockedTask), kind


@pytest.mark.hypothesis  # its @given is inner: marked so conftest keeps the collector off
def test_validation_names_the_setting_for_any_value() -> None:
    """Hypothesis: whatever redislock_tasks holds, reading it either succeeds or raises a
    LockConfigurationError naming the setting (and the pattern, when it is a str)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from celery_redislock.settings import TASK_OPTIONS, task_rules

    values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(),
        st.text(max_size=8),
        st.tuples(st.floats(), st.floats()),
        st.lists(st.integers(), max_size=3),
        st.just(lambda args, kwargs: "k"),
        st.just(10**400),
    )
    options = st.dictionaries(st.one_of(st.sampled_from(TASK_OPTIONS), st.text(max_size=6)), values)
    patterns = st.one_of(st.text(max_size=8), st.integers(), st.none())
    entries = st.one_of(
        st.dictionaries(patterns, st.one_of(options, values), max_size=3),
        st.lists(st.tuples(patterns, options), max_size=3),
        values,
    )

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(entries)
    def check(value: Any) -> None:
        try:
            task_rules({"redislock_tasks": value})
        except LockConfigurationError as exc:
            message = str(exc)
            if message.startswith("redislock_tasks["):  # an entry's options: its pattern
                patterns = value if isinstance(value, dict) else dict(value)
                assert any(message.startswith(f"redislock_tasks[{p!r}]") for p in patterns)
            else:  # the setting's shape, or a pattern that is not a str
                assert message.startswith(("redislock_tasks must be", "redislock_tasks: pattern"))

    check()


def test_a_base_refusing_the_subclass_is_an_error_not_unlocked(broker: RedisServer) -> None:
    """A base whose __init_subclass__ (or metaclass) raises anything while the locked
    class is made: the task refuses to run (it never runs unlocked), the error names
    setting, pattern and task."""
    app = eager_app(broker.url, {"p.*": {"lock_key": "job:{name}"}})

    @app.task(base=atk.Picky, name="p.picky")
    def picky(name: str) -> str:
        return "ran unlocked"

    app.finalize()
    message = r"redislock_tasks\['p\.\*'\]: task 'p\.picky'.*ValueError: Picky"
    with pytest.raises(LockConfigurationError, match=message):
        picky("x")
    assert len(configure_tasks(app).errors) == 1


def test_a_base_refusing_the_subclass_stops_the_worker(
    broker: RedisServer, r: redis.Redis, tmp_path: Path
) -> None:
    queue = "attack-picky"
    atk.shared_work.apply_async(("picky",), queue=queue)
    proc = CeleryProcess(
        ["worker", "-l", "info", "-c", "1", "-Q", queue, "--without-gossip", "--without-mingle"],
        url=broker.url,
        log=tmp_path / "w.log",
        env={"REDISLOCK_TEST_PICKY": "1"},
    )
    proc.app = APP
    proc.start()
    try:
        assert proc.process is not None
        proc.process.wait(60)
        text = proc.text()
        assert proc.process.returncode != 0, text
        assert f"redislock_tasks['{P}*']: task '{P}picky_work'" in text
        assert "ready." not in text
        assert r.llen(queue) == 1  # nothing consumed
    finally:
        proc.stop()
        r.delete(queue)
