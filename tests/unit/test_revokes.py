"""The revoked-id filter a worker's main process shares with its pool processes
(``celery.revokes``): every id added is found for at least ``expires`` seconds, in a
forked child too; ids never added are rarely found; Celery's own revoked set behaves as
before (its times kept when another set is merged)."""

from __future__ import annotations

import os
import time

import pytest
from celery.utils.collections import LimitedSet
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redislock.celery import revokes
from celery_redislock.celery.revokes import RevokedIds


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=60), min_size=1, max_size=200, unique=True))
def test_every_id_added_is_found(ids: list[str]) -> None:
    found = RevokedIds(3600)
    for task_id in ids:
        found.add(task_id)
    assert all(task_id in found for task_id in ids)


def test_ids_never_added_are_rarely_found() -> None:
    found = RevokedIds(3600)
    for n in range(1000):
        found.add(f"revoked-{n}")
    false = sum(f"other-{n}" in found for n in range(20_000))
    assert false <= 2  # about 2e-7 each with 1,000 ids


def test_an_id_is_kept_one_to_two_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(revokes.time, "monotonic", lambda: now[0])
    found = RevokedIds(10)
    found.add("a")  # turn 100
    now[0] = 1019.9  # turn 101: still kept
    assert "a" in found
    found.add("b")  # into the other filter
    now[0] = 1020.0  # turn 102: "a"'s filter is two turns old, "b"'s one
    assert "a" not in found and "b" in found
    found.add("c")  # turn 102 empties "a"'s filter and takes it
    assert "a" not in found and "b" in found and "c" in found
    now[0] = 1035.0  # turn 103
    assert "b" not in found and "c" in found


def test_a_forked_child_sees_ids_added_after_the_fork() -> None:
    found = RevokedIds(3600)
    read, write = os.pipe()
    back_read, back_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits for the parent's add, then answers what it finds
        try:
            os.read(read, 1)
            os.write(back_write, b"1" if "later" in found and "never" not in found else b"0")
        finally:
            os._exit(0)
    try:
        found.add("later")
        os.write(write, b"x")
        assert os.read(back_read, 1) == b"1"
    finally:
        os.waitpid(pid, 0)
        for fd in (read, write, back_read, back_write):
            os.close(fd)


def test_following_celery_s_set_keeps_its_behaviour(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids Celery adds (a list, a generator, another LimitedSet with its times, a dict)
    reach the filter, and Celery's set gets what it would have got without it."""
    from celery.worker import state

    revoked = LimitedSet(maxlen=100, expires=3600)
    revoked.add("before")
    monkeypatch.setattr(state, "revoked", revoked)
    monkeypatch.setattr(revokes, "_revoked", None)
    revokes.follow()
    try:
        assert revokes.maybe_revoked("before")
        revoked.update(["a", "b"])
        revoked.update(task_id for task_id in ("c",))
        other = LimitedSet(maxlen=100, expires=3600)
        other.add("d", now=time.time() - 100)
        revoked.update(other)
        revoked.update({"e": time.time()})
        for task_id in ("a", "b", "c", "d", "e"):
            assert task_id in revoked and revokes.maybe_revoked(task_id), task_id
        assert revoked._data["d"][0] == other._data["d"][0]  # its time kept
        assert not revokes.maybe_revoked("never-revoked")
        revokes.follow()  # once per process: not wrapped twice
        revoked.update(["f"])
        assert revokes.maybe_revoked("f") and "f" in revoked
    finally:
        monkeypatch.setattr(revokes, "_revoked", None)


def test_outside_a_worker_every_id_counts_as_maybe_revoked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(revokes, "_revoked", None)
    assert revokes.maybe_revoked("anything")


def test_a_wall_clock_step_back_forgets_no_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """The turns follow the clock Celery's set is stamped with (``time.monotonic``, the
    same in every process of the host), not the wall clock: an NTP or manual step of
    ``time.time`` (hours back, as a clock set ahead is corrected) forgets no id Celery
    still has, and never empties the filter that holds them."""
    wall = [1_000_000.0]
    monkeypatch.setattr(revokes.time, "time", lambda: wall[0])
    found = RevokedIds(10)
    found.add("a")
    wall[0] -= 3 * 3600  # the wall clock stepped back
    assert "a" in found
    found.add("b")
    assert "a" in found and "b" in found
    wall[0] += 6 * 3600  # and forward again (a host resumed from suspend, say)
    assert "a" in found and "b" in found


def test_ids_celery_never_forgets_are_never_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CELERY_WORKER_REVOKE_EXPIRES=0``: Celery's set keeps its ids until it is full
    (no expiry by time); so does the filter, not for one to two seconds."""
    from celery.worker import state

    now = [5000.0]
    for clock in ("monotonic", "time"):  # (whichever the turns follow)
        monkeypatch.setattr(revokes.time, clock, lambda: now[0])
    revoked = LimitedSet(maxlen=100, expires=0)
    monkeypatch.setattr(state, "revoked", revoked)
    monkeypatch.setattr(state, "REVOKE_EXPIRES", 0.0)
    monkeypatch.setattr(revokes, "_revoked", None)
    revokes.follow()
    try:
        revoked.update(["kept"])
        now[0] += 3 * 86400
        revoked.update(["later"])  # (an add in a later turn empties an expired filter)
        assert "kept" in revoked and revokes.maybe_revoked("kept")
        assert revokes.maybe_revoked("later")
    finally:
        monkeypatch.setattr(revokes, "_revoked", None)


def test_a_process_with_no_filter_asks_for_no_run_on_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool process that is not a forked child of a worker's main process (a pool
    started with ``--pool-start-method spawn``) has no filter: it could never run on a
    task handed to it, so its releases ask for none (``runon.allowed``: a plain hand-over,
    not a run-on one it would then make usual, a round trip more, each time)."""
    import redis
    from celery import Celery

    from celery_redislock.celery import runon
    from celery_redislock.celery.tasklock import TaskLock
    from celery_redislock.task import LockedTask

    app = Celery("revokes_allowed", broker="redis://127.0.0.1:1/0")
    app.conf.redislock_run_on = 5

    @app.task(name="plain", base=LockedTask, lock_key="k:{x}", shared=False)
    def plain(x: int) -> int:
        return x

    app.finalize()
    options = plain.lock_options()
    client = redis.Redis(port=1)
    lock = TaskLock(client, "k:1", task_id="t1", options=options)
    monkeypatch.setattr(runon, "_remote", None)
    monkeypatch.setattr(runon, "_events_on", False)
    plain.push_request(id="t1", is_eager=False, called_directly=False, timelimit=None)
    try:
        monkeypatch.setattr(revokes, "_revoked", RevokedIds(60))
        assert runon.allowed(plain, lock, options)  # (a forked pool process)
        monkeypatch.setattr(revokes, "_revoked", None)
        assert not runon.allowed(plain, lock, options)
    finally:
        plain.pop_request()
        client.close()


@pytest.mark.parametrize("expires", [float("nan"), -5.0, float("inf"), 0, None, "soon", 1e308])
def test_an_expiry_that_is_not_a_positive_number_keeps_ids_and_never_raises(
    monkeypatch: pytest.MonkeyPatch, expires: object
) -> None:
    """``CELERY_WORKER_REVOKE_EXPIRES`` parsed to NaN (or negative, infinite, not a number):
    an add raised inside Celery's revoke (the id then missing from the filter, and the
    task run on). Such a value keeps ids for good; a huge one is a turn that never ends."""
    now = [5000.0]
    monkeypatch.setattr(revokes.time, "monotonic", lambda: now[0])
    found = RevokedIds(expires)  # type: ignore[arg-type]
    found.add("revoked")
    now[0] += 10 * 365 * 86400
    assert "revoked" in found and "other" not in found
