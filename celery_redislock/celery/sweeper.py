"""The sweeper: the worker main process's thread that serves parked tasks whose holder
or hand-over was lost."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from .. import metrics
from .._core import MIN_SECONDS, LockKeys, lease_ms
from .._keyspace import SemaphoreKeys, parked_registry, parked_under
from .._replies import decode_sweep
from .._scripts import scripts_for
from .base import LockedTask
from .clients import client_for, settings_for
from .envelope import _Handed, _handed, _text
from .handover import _report_refused, deliver_handed_over
from .lookahead import QUEUE_REACH

log = logging.getLogger(__name__)


class Sweeper(threading.Thread):
    """The worker main process's safety net for parked tasks.

    Every few seconds, for each lock with parked tasks: if its holder vanished without
    releasing (lease expired), hand the lock to the next parked task; if a handed-over
    task's message never started it (the releasing worker died before publishing), publish
    it again. Several workers sweeping at once is safe: each step is one atomic script.
    """

    def __init__(self, app: Any) -> None:
        super().__init__(name="redislock-sweeper", daemon=True)
        self.app = app
        self.stopping = threading.Event()
        settings = settings_for(app)
        self.ttl = settings.defaults.ttl
        self.interval = max(0.5, min(self.ttl / 6, 5.0))
        self.prefixes = sorted(
            {t.lock_options().prefix for t in app.tasks.values() if isinstance(t, LockedTask)}
        )

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.sweep_once()
            except Exception:
                log.exception("redislock: sweeping parked tasks failed; retrying")
            try:  # the main process's counts (parked at delivery): flushed no other way
                metrics.flush_to_redis(client_for(self.app), settings_for(self.app).defaults.prefix)
            except Exception:  # stats are best effort
                log.debug("redislock: could not flush stats", exc_info=True)

    def sweep_once(self) -> int:
        """One pass; returns how many messages it published."""
        client = client_for(self.app)
        scripts = scripts_for(client)
        published = 0
        for prefix in self.prefixes:
            registry = parked_registry(prefix)
            members: list[bytes] = list(client.zrange(registry, 0, -1))  # type: ignore[arg-type]
            for lock_key in members:
                keys = parked_under(lock_key, prefix)
                if keys is None:
                    # Anyone who may write the registry may have written it: no lock's keys.
                    client.zrem(registry, lock_key)
                    _report_refused(self.app, lock_key, None, "not a lock key of this prefix")
                    continue
                try:
                    if isinstance(keys, SemaphoreKeys):
                        published += self._sweep_semaphore(client, scripts, registry, keys)
                    else:
                        published += self._sweep_lock(client, scripts, registry, lock_key)
                except Exception:  # one bad lock does not stop the pass
                    log.exception("redislock: sweeping %r failed; retrying next pass", lock_key)
        return published

    def _sweep_args(self) -> list[Any]:
        stale = lease_ms(max(self.ttl / 2, MIN_SECONDS), "stale")
        return [lease_ms(self.ttl, "redislock_ttl"), stale, QUEUE_REACH]

    def _own_db(self, client: Any) -> str:
        """The locks' database, as the sweep scripts take it (``parked.lua``'s
        ``resend_stale``): "" where the client does not say."""
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
        return str(int(kwargs.get("db") or 0)) if isinstance(kwargs, dict) else ""

    def _sweep_lock(self, client: Any, scripts: Any, registry: str, lock_key: bytes) -> int:
        keys, args = LockKeys.for_lock(lock_key).sweep_keys(registry), self._sweep_args()
        # A run-on task whose hold is gone without its run's end goes back to the line this
        # long after the sweeper first sees it (sweep.lua): the background retries of a
        # release that could not reach Redis (max(60 s, 2 x lock_ttl)) land first.
        args.append(lease_ms(max(RUN_ON_GRACE, 2 * self.ttl), "run-on grace"))
        args.append(self._own_db(client))
        handed = decode_sweep(scripts.sweep(keys=keys, args=args)).handed
        return self._send(_handed(lock_key, handed), args[0])

    def _sweep_semaphore(
        self, client: Any, scripts: Any, registry: str, semaphore: SemaphoreKeys
    ) -> int:
        """A semaphore may have several permits free at once (a raised limit, several
        holders gone): one script run hands out one, so it runs again while it does. The
        messages are sent last first: each goes to the read end of its queue, so the first
        parked is the first fetched."""
        keys = semaphore.sweep_keys(registry)
        args = [*self._sweep_args(), semaphore.permits, self._own_db(client)]
        found = []
        for _ in range(MAX_HANDED_PER_PASS):
            handed = decode_sweep(scripts.semaphore.sweep(keys=keys, args=args)).handed
            if handed is None:
                break
            found.append(_handed(semaphore.line.lock, handed))
        return sum(self._send(handed, args[0]) for handed in reversed(found))

    def _send(self, handed: _Handed | None, lease: int) -> int:
        if handed is None:
            return 0
        log.warning(
            "redislock: sweeper hands %r to parked task %r (holder or hand-over lost)",
            handed.lock_key,
            _text(handed.task_id),
        )
        return deliver_handed_over(self.app, handed, lease, via="sweeper")


#: The least time (s) a run-on task's hold is seen gone before it is parked again.
RUN_ON_GRACE = 60.0

#: Hand-overs one pass makes per semaphore at most (the next pass goes on).
MAX_HANDED_PER_PASS = 100


_sweepers: weakref.WeakKeyDictionary[Any, Sweeper] = weakref.WeakKeyDictionary()
