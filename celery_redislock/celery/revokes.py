"""The task ids a worker's main process was told are revoked, where its pool processes see
them: a filter in shared memory, made before the pool is forked.

Celery keeps revoked ids in the worker's main process (``celery.worker.state.revoked``),
which checks each message against them before a pool process gets it. A task run on
(:mod:`.runon`) never passes through the main process: its parked message comes back to
the releasing pool process, which must not run a task revoked while it waited. Every id
Celery adds to its set here (``celery control revoke``, ids merged from other workers at
start, a ``--statedb``) is added to this filter too, and a pool process asks
:func:`maybe_revoked` before it runs a task on. The answer is True for every id added
within the last ``REVOKE_EXPIRES`` seconds at least (Celery forgets revoked ids after
that long too), and now and then for another id (a Bloom filter's false positive: that
task is then handed over through the broker, where the main process decides).

Two filters of ``BITS`` bits take turns: ids go to the current one, which is emptied when
its turn comes again, so an id is remembered for one to two turns of ``REVOKE_EXPIRES``
(for good where that is 0, as Celery's set then keeps them). The turns follow
``time.monotonic``, as Celery's set stamps its ids (the same clock in every process of the
host): a step of the wall clock forgets nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

from celery.worker import state as worker_state

log = logging.getLogger(__name__)

#: Bits per filter (64 KiB): about 2e-7 false positives with 1,000 ids remembered, 1.5%
#: with Celery's most (50,000).
BITS = 1 << 19
HASHES = 3


class RevokedIds:
    """Shared revoked-id filters: one writer (the worker's main process), readers in its
    forked pool processes. ``expires``: seconds an id is remembered at least (0: for
    good, one turn that never ends)."""

    def __init__(self, expires: float) -> None:
        try:
            seconds = float(expires)
        except (TypeError, ValueError):
            seconds = math.nan
        # Not a positive finite number (0, NaN, negative, infinite, not a number): ids are
        # kept for good, the safe side (a NaN turn would raise inside Celery's revoke).
        self.expires = max(seconds, 1.0) if 0 < seconds < math.inf else math.inf
        self._bits = [multiprocessing.RawArray(ctypes.c_uint8, BITS // 8) for _ in range(2)]
        #: The turn (``time // expires``) each filter holds the ids of.
        self._turns = multiprocessing.RawArray(ctypes.c_long, [-2, -2])

    @staticmethod
    def _places(task_id: str) -> list[int]:
        digest = hashlib.blake2b(task_id.encode(), digest_size=4 * HASHES).digest()
        return [int.from_bytes(digest[4 * i : 4 * i + 4], "big") % BITS for i in range(HASHES)]

    def add(self, task_id: str) -> None:
        turn = int(time.monotonic() // self.expires)
        index = turn % 2
        bits = self._bits[index]
        if self._turns[index] != turn:  # its turn again: the ids of two turns ago go
            ctypes.memset(bits, 0, BITS // 8)
            self._turns[index] = turn
        for place in self._places(task_id):
            bits[place >> 3] |= 1 << (place & 7)

    def __contains__(self, task_id: str) -> bool:
        turn = int(time.monotonic() // self.expires)
        places = self._places(task_id)
        for index in (0, 1):
            if self._turns[index] in (turn, turn - 1):
                bits = self._bits[index]
                if all(bits[place >> 3] & (1 << (place & 7)) for place in places):
                    return True
        return False


#: This worker's filter (None outside a worker: nothing is run on there).
_revoked: RevokedIds | None = None


def maybe_revoked(task_id: str) -> bool:
    """Whether the worker's main process may have been told ``task_id`` is revoked (a pool
    process asks before it runs a task on). True also where no filter was made: a process
    that is not a forked child of a worker's main process cannot tell."""
    return _revoked is None or task_id in _revoked


def followed() -> bool:
    """Whether this process sees the filter: a worker's main process or its forked child
    (not a pool process started with ``spawn``, which could run no task on)."""
    return _revoked is not None


def follow(**_: Any) -> None:
    """``worker_init`` (the main process, before the pool is forked): make the filter and
    add to it every id Celery's revoked set gets from now on, and those it has; once."""
    global _revoked
    if _revoked is not None:
        return
    revoked = worker_state.revoked
    expires = getattr(revoked, "expires", worker_state.REVOKE_EXPIRES)
    found = RevokedIds(expires or 0)  # (0: Celery's set forgets ids only once full)
    celery_s = revoked.update

    def update(other: Any) -> None:
        # Celery's set takes another LimitedSet (its times kept), a dict or any iterable
        # of ids; each of them iterates over ids. Only a one-pass iterator is read first.
        if isinstance(other, Iterator):
            other = list(other)
        celery_s(other)
        for task_id in other or ():
            found.add(str(task_id))

    for task_id in list(revoked):
        found.add(str(task_id))
    revoked.update = update  # (an instance attribute: Celery looks it up on each call)
    _revoked = found
