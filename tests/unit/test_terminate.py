"""``celery_redislock.celery.terminate``: the slots that say which task each pool process
runs on, and the wrapped ``revoke`` / ``terminate`` commands, in one process (the real
worker's ``revoke(terminate=True)`` of a task run on: ``tests/celery/test_run_on_attack``)."""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

import pytest
from celery.worker import control
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redislock.celery import terminate
from celery_redislock.celery.terminate import RunningOn, _digest, terminate_running_on


class Pool:
    """A pool's ``terminate_job`` as Celery calls it: records the calls; ``fails``: pids
    whose call raises (a process that already went)."""

    def __init__(self, fails: tuple[int, ...] = (), pids: Any = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.fails = fails
        #: prefork's ``info["processes"]``: the pool's pids (None: not told)
        self.info = {} if pids is None else {"processes": pids}

    def terminate_job(self, pid: int, sig: int) -> None:
        if pid in self.fails:
            raise OSError("no such process")
        self.calls.append((pid, sig))


def _state(pool: Any) -> Any:
    return SimpleNamespace(consumer=SimpleNamespace(pool=pool))


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> RunningOn:
    found = RunningOn(slots=8)
    monkeypatch.setattr(terminate, "_table", found)
    monkeypatch.setattr(terminate, "_slot_of", (0, None))  # looked up again here
    return found


def test_a_slot_names_its_task_until_cleared(table: RunningOn) -> None:
    table.mark(0, 101, "a")
    table.mark(7, 107, "b")
    assert table.running(["a", "b", "c"]) == {"a": 101, "b": 107}
    table.clear(0)
    assert table.running(["a", "b"]) == {"b": 107}
    table.mark(7, 107, "c")  # the next task run on in that process
    assert table.running(["a", "b", "c"]) == {"c": 107}
    assert table.running([]) == {}


def test_a_slot_being_written_is_left_alone(table: RunningOn) -> None:
    table.mark(3, 103, "x")
    words = table._words
    words[3 * 4] += 1  # its sequence count odd: a write in progress, never finished here
    assert table.running(["x"]) == {}
    words[3 * 4] += 1
    assert table.running(["x"]) == {"x": 103}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_any_task_id_is_found_and_no_other(task_id: str, other: str) -> None:
    found = RunningOn(slots=2)
    found.mark(1, 55, task_id)  # surrogates, NULs, long ids: a digest, never an error
    assert found.running([task_id]) == {task_id: 55}
    if other != task_id:
        assert found.running([other]) == {}
    assert _digest(task_id) != (0, 0)


def test_terminating_ends_each_id_run_on_with_its_signal(table: RunningOn) -> None:
    table.mark(1, 201, "run-on")
    table.mark(2, 202, "other")
    pool = Pool()
    assert terminate_running_on(_state(pool), "run-on") == ["run-on"]
    assert terminate_running_on(_state(pool), ["run-on", "unknown"], "KILL") == ["run-on"]
    assert pool.calls == [(201, signal.SIGTERM), (201, signal.SIGKILL)]


def test_a_failed_terminate_is_not_reported_and_does_not_raise(table: RunningOn) -> None:
    table.mark(1, 301, "a")
    table.mark(2, 302, "b")
    pool = Pool(fails=(301,))
    assert terminate_running_on(_state(pool), ["a", "b"]) == ["b"]
    assert terminate_running_on(_state(pool), ["a"], "NOT-A-SIGNAL") == []
    assert terminate_running_on(SimpleNamespace(), ["b"]) == []  # no consumer: nothing
    assert pool.calls == [(302, signal.SIGTERM)]


def test_without_slots_nothing_is_looked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(terminate, "_table", None)
    pool = Pool()
    assert terminate_running_on(_state(pool), ["a"]) == []
    with terminate.running_on("a"):  # (a spawned pool process: no slot to write)
        pass
    assert pool.calls == []


@pytest.mark.parametrize("index", [None, -1, 8, True, "0"])
def test_a_process_without_a_slot_of_its_own_writes_none(
    table: RunningOn, monkeypatch: pytest.MonkeyPatch, index: Any
) -> None:
    import billiard.process

    monkeypatch.setattr(billiard.process, "current_process", lambda: SimpleNamespace(index=index))
    with terminate.running_on("a"):
        assert table.running(["a"]) == {}


def test_a_pool_process_writes_its_slot_for_the_run(
    table: RunningOn, monkeypatch: pytest.MonkeyPatch
) -> None:
    import billiard.process

    monkeypatch.setattr(billiard.process, "current_process", lambda: SimpleNamespace(index=5))
    with pytest.raises(SystemExit), terminate.running_on("a"):
        assert list(table.running(["a"])) == ["a"]
        raise SystemExit  # (its process is being ended): the slot is cleared on the way
    assert table.running(["a"]) == {}


def _revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kw: Any):
    return {"ok": "terminate: tasks unknown"} if terminate else {"ok": "flagged"}


def _terminate(state: Any, signal: Any, task_id: Any, **kwargs: Any) -> Any:
    return _revoke(state, task_id, terminate=True, signal=signal)


def test_the_wrapped_commands_add_what_they_ended_to_celery_s_reply(table: RunningOn) -> None:
    table.mark(0, 401, "r")
    pool = Pool()
    revoke, term = terminate._wrapped(_revoke), terminate._wrapped(_terminate)
    assert revoke(_state(pool), task_id=["r"]) == {"ok": "flagged"}  # no terminate: as is
    assert pool.calls == []
    assert revoke(_state(pool), task_id=["r"], terminate=True) == {"ok": "terminate: r"}
    assert term(_state(pool), signal="KILL", task_id=["r"]) == {"ok": "terminate: r"}
    assert term(_state(pool), "KILL", "other") == {"ok": "terminate: tasks unknown"}

    def celery_ended_one(state: Any, task_id: Any, terminate: bool = False, **kw: Any) -> Any:
        return {"ok": "terminate: c"}

    assert terminate._wrapped(celery_ended_one)(_state(pool), ["c", "r"], True) == {
        "ok": "terminate: c, r"
    }
    assert pool.calls == [(401, signal.SIGTERM), (401, signal.SIGKILL), (401, signal.SIGTERM)]


def test_follow_wraps_celery_s_commands_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(terminate, "_table", None)
    for name in ("revoke", "terminate"):
        monkeypatch.setitem(control.Panel.data, name, control.Panel.data[name])
    celery_s = dict(control.Panel.data)
    terminate.follow()
    terminate.follow()
    for name in ("revoke", "terminate"):
        wrapped = control.Panel.data[name]
        assert wrapped is not celery_s[name] and wrapped.redislock_terminate
        assert wrapped.__name__ == name
    assert isinstance(terminate._table, RunningOn)


def test_a_slot_of_a_process_no_longer_in_the_pool_ends_nothing(table: RunningOn) -> None:
    """A process killed while it ran on never cleared its slot: a revoke of that task
    later must not signal that pid (another process may have it now) nor say it ended."""
    table.mark(1, 501, "died")
    table.mark(2, 502, "alive")
    pool = Pool(pids=[502, 503])
    assert terminate_running_on(_state(pool), ["died", "alive"]) == ["alive"]
    assert pool.calls == [(502, signal.SIGTERM)]
    odd = Pool(pids="not a list")  # a pool that tells nothing usable: not filtered
    assert terminate_running_on(_state(odd), ["died"]) == ["died"]


def test_the_slot_is_looked_up_once_per_process(
    table: RunningOn, monkeypatch: pytest.MonkeyPatch
) -> None:
    import billiard.process

    looked: list[int] = []

    def current() -> Any:
        looked.append(1)
        return SimpleNamespace(index=2)

    monkeypatch.setattr(billiard.process, "current_process", current)
    for _ in range(3):
        with terminate.running_on("a"):
            assert table.running(["a"]) == {"a": terminate._process.current()}
    assert looked == [1]
    monkeypatch.setattr(terminate, "_slot_of", (-1, 5))  # another pid's (a forked child)
    with terminate.running_on("b"):
        assert list(table.running(["b"])) == ["b"]
    assert looked == [1, 1]
