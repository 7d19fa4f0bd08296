"""``SKIPPED`` and ``SUPERSEDED`` are ready states of Celery once the Celery layer is
imported (``celery_redislock.celery.ready``): in every place the installed Celery reads
its ready states, idempotently, every built-in state kept; ``.get()`` returns the stored
meta. In-process, with the in-memory cache result backend (no service)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
import uuid
from typing import Any

import celery.backends
import pytest
from celery import Celery, states
from celery.backends import base as backend_base
from celery.result import AsyncResult, GroupResult

from celery_redislock.celery.contention import SKIPPED
from celery_redislock.celery.latest import SUPERSEDED
from celery_redislock.celery.ready import (
    CELERY_READY_STATES,
    LOCK_READY_STATES,
    captured_ready_states,
    install_ready_states,
)

BUILT_IN = frozenset({states.SUCCESS, states.FAILURE, states.REVOKED})
READY = BUILT_IN | {SKIPPED, SUPERSEDED}


def _celery_modules() -> list[Any]:
    """Celery's result modules, and every result backend module that imports here."""
    found = [importlib.import_module(name) for name in ("celery.result", "celery.states")]
    for info in pkgutil.walk_packages(celery.backends.__path__, "celery.backends."):
        try:
            found.append(importlib.import_module(info.name))
        except Exception:  # an optional dependency missing (pymongo, boto3, ...)
            continue
    return found


def test_the_ready_states_are_celerys_and_ours_wherever_celery_reads_them() -> None:
    assert CELERY_READY_STATES == BUILT_IN and {SKIPPED, SUPERSEDED} == LOCK_READY_STATES
    assert states.READY_STATES == READY
    assert backend_base.Backend.READY_STATES == READY
    modules = _celery_modules()
    captured = {
        f"{module.__name__}.{name}": value
        for module in modules
        for name, value in captured_ready_states(module).items()
    }
    # The default arguments celery.backends.base captured at its import (group joins).
    assert {
        "celery.backends.base.BaseKeyValueStoreBackend._filter_ready",
        "celery.backends.base.BaseKeyValueStoreBackend._mget_to_results",
        "celery.backends.base.BaseKeyValueStoreBackend.get_many",
    } <= set(captured)
    assert {name: value for name, value in captured.items() if value != READY} == {}
    # Every backend class reads the extended class attribute (none has its own).
    backends = [
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, backend_base.Backend)
    ]
    assert len(backends) > 5
    assert {b.__name__: b.READY_STATES for b in backends if b.READY_STATES != READY} == {}
    # The others unchanged: SKIPPED and SUPERSEDED neither raise nor are unready.
    assert {states.RETRY, states.FAILURE, states.REVOKED} == states.EXCEPTION_STATES
    assert {states.FAILURE, states.REVOKED} == states.PROPAGATE_STATES
    assert not LOCK_READY_STATES & (states.UNREADY_STATES | states.EXCEPTION_STATES)


def test_installing_again_changes_nothing() -> None:
    def seen() -> list[Any]:
        found = [states.READY_STATES, backend_base.Backend.READY_STATES]
        return found + list(captured_ready_states(backend_base).values())

    before = seen()
    install_ready_states()
    install_ready_states()
    after = seen()
    assert len(after) == len(before) == 5
    assert all(a is b for a, b in zip(after, before, strict=True))


def test_importing_the_celery_layer_is_what_extends_them() -> None:
    """In a fresh interpreter: Celery's own ready states until the layer is imported (a
    ``LockedTask`` import), ours added then, also for a backend created before."""
    script = """if True:
        import json
        from celery import Celery, states
        app = Celery("fresh", backend="redis://127.0.0.1:1/0")
        backend = app.backend
        before = sorted(states.READY_STATES), sorted(backend.READY_STATES)
        import celery_redislock.task
        after = sorted(states.READY_STATES), sorted(backend.READY_STATES)
        print(json.dumps([before, after]))
    """
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    before, after = json.loads(out)
    assert before == [sorted(BUILT_IN)] * 2
    assert after == [sorted(READY)] * 2


@pytest.fixture
def app() -> Celery:
    return Celery(f"ready-{uuid.uuid4().hex}", backend="cache+memory://")


@pytest.mark.parametrize(
    ("state", "meta"),
    [
        (SUPERSEDED, {"lock": "user:7", "superseded_by": "b"}),
        (SUPERSEDED, {"lock": "user:7", "superseded_by": None}),
        (SKIPPED, {"lock": "nightly"}),
    ],
)
def test_get_returns_the_stored_meta(app: Celery, state: str, meta: dict[str, Any]) -> None:
    task_id = uuid.uuid4().hex
    result = AsyncResult(task_id, app=app)
    assert not result.ready()
    app.backend.store_result(task_id, meta, state)
    assert result.ready() and not result.successful() and not result.failed()
    assert result.get(timeout=30) == meta and result.state == state
    assert AsyncResult(task_id, app=app).get(timeout=30, propagate=True) == meta


def test_a_group_with_superseded_and_skipped_calls_joins(app: Celery) -> None:
    ids = [uuid.uuid4().hex for _ in range(4)]
    stored = [
        ({"lock": "k", "superseded_by": ids[2]}, SUPERSEDED),
        ({"lock": "k"}, SKIPPED),
        ("ran", states.SUCCESS),
        ({"lock": "k", "superseded_by": None}, SUPERSEDED),
    ]
    for task_id, (value, state) in zip(ids, stored, strict=True):
        app.backend.store_result(task_id, value, state)
    expected = [value for value, _ in stored]

    def fresh() -> GroupResult:
        return GroupResult(uuid.uuid4().hex, [AsyncResult(i, app=app) for i in ids], app=app)

    assert fresh().ready()
    assert fresh().join_native(timeout=30) == expected  # get_many (captured defaults)
    assert fresh().join(timeout=30) == expected  # each result's get
    assert fresh().get(timeout=30) == expected
    assert dict(app.backend.get_many(set(ids), timeout=30)).keys() == set(ids)


def test_a_failure_still_raises_and_pending_is_not_ready(app: Celery) -> None:
    failed, pending = uuid.uuid4().hex, uuid.uuid4().hex
    app.backend.mark_as_failure(failed, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        AsyncResult(failed, app=app).get(timeout=30)
    assert not AsyncResult(pending, app=app).ready()
