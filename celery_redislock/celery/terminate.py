"""``revoke(id, terminate=True)`` of a task while it runs on: the worker's main process
finds the pool process that runs it, and ends that process as Celery ends a task's.

Celery terminates only the jobs its main process has a request for (``celery.worker.
control._revoke``). A task run on (:mod:`.runon`) has none: the releasing pool process
runs it from its parked message, so Celery replies ``terminate: tasks unknown`` and the
task would run to its end. Each pool process therefore tells, in memory shared with the
main process (made before the pool is forked, as :mod:`.revokes`), which task it runs on
now: a slot per pool process (billiard's process index), holding that process's pid and
a digest of the task id. The worker's ``revoke`` and ``terminate`` commands are wrapped:
after Celery's own, every id that a slot names is ended with the pool's
``terminate_job(pid, signal)``, the call Celery makes for its own requests (it ends only
a process of this pool). What follows is a death while running on (docs/concepts.md,
"Running on"): the worker's main process parks again every task that process ran on,
first in line, and the one revoked is then dropped as revoked where its hand-over comes
in; the releasing task, whose job died, is the job Celery saw end.

A slot is written by its one pool process under a sequence count (odd while it writes),
and read by the main process only when both counts around the read agree. As with
Celery's own terminate, a task that ends between that read and the signal leaves the
signal to the task its process started next (a run ended under it: run again from its
parked record, as after any death while running on). A slot whose process is no longer
one of the pool's (killed while it ran on: its slot never cleared) is passed over, its
pid not signalled. A spawned pool (no fork) has no slots: there, as before, the task
runs to its end.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import logging
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from celery.worker import control

from .. import _process

log = logging.getLogger(__name__)

#: Pool processes with a slot (billiard's process index below this): ``-c`` or
#: ``--autoscale`` up to this many.
SLOTS = 1024
#: Words of a slot: its sequence count, the pid, the task id's digest (two words).
_WORDS = 4
#: How many times a read retries a slot being written before it leaves it.
_READ_TRIES = 100

_table: RunningOn | None = None


def _digest(task_id: str) -> tuple[int, int]:
    """Two nonzero-together 64-bit words naming ``task_id`` (0, 0: an empty slot)."""
    raw = hashlib.blake2b(str(task_id).encode("utf-8", "surrogatepass"), digest_size=16).digest()
    high, low = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")
    return (high, low) if high or low else (0, 1)


class RunningOn:
    """The task each pool process runs on now, shared with the worker's main process."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self._words = multiprocessing.RawArray(ctypes.c_uint64, slots * _WORDS)

    def mark(self, index: int, pid: int, task_id: str) -> None:
        """In pool process ``index`` (one writer per slot): it runs ``task_id`` on now."""
        words, at = self._words, index * _WORDS
        high, low = _digest(task_id)
        count = words[at]
        words[at] = count + 1  # odd: being written
        words[at + 1] = pid
        words[at + 2] = high
        words[at + 3] = low
        words[at] = count + 2

    def clear(self, index: int) -> None:
        """In pool process ``index``: it runs nothing on now."""
        words, at = self._words, index * _WORDS
        count = words[at]
        words[at] = count + 1
        words[at + 2] = 0
        words[at + 3] = 0
        words[at] = count + 2

    def running(self, task_ids: Iterable[str]) -> dict[str, int]:
        """``task id -> pid`` of each of ``task_ids`` a pool process runs on now."""
        wanted = {_digest(task_id): task_id for task_id in task_ids}
        found: dict[str, int] = {}
        if not wanted:
            return found
        words = self._words
        for index in range(self.slots):
            at = index * _WORDS
            for _ in range(_READ_TRIES):
                count = words[at]
                if count & 1:
                    continue
                pid, digest = words[at + 1], (words[at + 2], words[at + 3])
                if words[at] == count:
                    break
            else:
                continue  # written all along: that process is busy changing tasks
            task_id = wanted.get(digest)
            if task_id is not None and pid:
                found[task_id] = int(pid)
        return found


#: ``(pid, slot)`` of the process that last looked its slot up (a forked child looks again).
_slot_of: tuple[int, int | None] = (0, None)


def _slot() -> int | None:
    """This pool process's slot (its billiard process index), if it has one; looked up
    once per process."""
    global _slot_of
    pid = _process.current()
    if _slot_of[0] == pid:
        return _slot_of[1]
    index: Any = None
    try:
        from billiard.process import current_process

        index = getattr(current_process(), "index", None)
    except Exception:
        index = None
    table = _table
    ok = isinstance(index, int) and not isinstance(index, bool)
    found = index if table is not None and ok and 0 <= index < table.slots else None
    _slot_of = (pid, found)
    return found


@contextmanager
def running_on(task_id: str) -> Iterator[None]:
    """In a pool process: ``task_id`` runs on here for the block (its slot says so)."""
    table = _table
    index = None if table is None else _slot()
    if table is None or index is None:
        yield
        return
    table.mark(index, _process.current(), task_id)
    try:
        yield
    finally:
        table.clear(index)


def follow(**_: Any) -> None:
    """``worker_init`` (the main process, before the pool is forked): make the slots and
    wrap Celery's ``revoke`` and ``terminate`` commands; once per process."""
    global _table
    if _table is None:
        _table = RunningOn()
    panel = control.Panel.data
    for name in ("revoke", "terminate"):
        celery_s = panel.get(name)
        if celery_s is not None and not getattr(celery_s, "redislock_terminate", False):
            panel[name] = _wrapped(celery_s)


def _wrapped(celery_s: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(celery_s)

    def command(state: Any, *args: Any, **kwargs: Any) -> Any:
        reply = celery_s(state, *args, **kwargs)
        try:
            bound = signature.bind(state, *args, **kwargs).arguments
        except TypeError:
            return reply
        # ``revoke`` terminates when asked to; ``terminate`` (no such argument) always.
        if "terminate" in signature.parameters and not bound.get("terminate"):
            return reply
        ended = terminate_running_on(state, bound.get("task_id"), bound.get("signal"))
        if not ended:
            return reply
        said = reply.get("ok") if isinstance(reply, dict) else None
        if said == "terminate: tasks unknown" or not isinstance(said, str):
            return {"ok": f"terminate: {', '.join(ended)}"}
        return {**reply, "ok": f"{said}, {', '.join(ended)}"}

    command.__doc__ = celery_s.__doc__
    command.__name__ = getattr(celery_s, "__name__", "revoke")
    command.redislock_terminate = True  # type: ignore[attr-defined]
    return command


def terminate_running_on(state: Any, task_ids: Any, signal: Any = None) -> list[str]:
    """End the pool process of each of ``task_ids`` that a pool process runs on now, with
    ``signal`` (Celery's default: ``TERM``); the ids ended, in order. Never raises."""
    if _table is None:
        return []
    from billiard.common import TERM_SIGNAME
    from celery.platforms import signals as celery_signals
    from celery.utils.functional import maybe_list

    try:
        ids = sorted({str(task_id) for task_id in maybe_list(task_ids) or []})
        found = _table.running(ids)
        if not found:
            return []
        signum = celery_signals.signum(signal or TERM_SIGNAME)
        pool = state.consumer.pool
        alive = _pool_pids(pool)
    except Exception:
        log.warning("redislock: could not look for tasks run on to terminate", exc_info=True)
        return []
    ended = []
    for task_id in ids:
        pid = found.get(task_id)
        if pid is None:
            continue
        if alive is not None and pid not in alive:
            # A slot its process never cleared (killed while it ran on): that task's end
            # is the process's death, handled already; nothing to end, nothing to say.
            log.debug("redislock: %s ran on in pool process %d, gone", task_id, pid)
            continue
        log.info(
            "redislock: terminating %s (%s): it runs on in pool process %d", task_id, signum, pid
        )
        try:
            pool.terminate_job(pid, signum)
        except Exception:
            log.warning("redislock: could not terminate %s (pid %d)", task_id, pid, exc_info=True)
            continue
        ended.append(task_id)
    return ended


def _pool_pids(pool: Any) -> set[int] | None:
    """The pids of the pool's processes (prefork's ``info``), None if it does not say."""
    try:
        pids = pool.info.get("processes")
    except Exception:
        return None
    if not isinstance(pids, (list, tuple)):
        return None
    return {pid for pid in pids if isinstance(pid, int)}
