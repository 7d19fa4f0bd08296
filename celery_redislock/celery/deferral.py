"""Rate limits for tasks (``lock_rate``): a run over its rate is deferred to its slot,
and each worker's drainer sends deferred runs again when their slots are due (and
debounced calls when their quiet period is over: ``celery.latest``).

::

    @app.task(base=LockedTask, lock_key="merchant:{merchant_id}", lock_limit=None,
              lock_rate="100/m")
    def charge(merchant_id, amount): ...

In the pool process, before any lock or permit is taken, :func:`admit_or_defer` runs
``rate_defer.lua`` once: a run is admitted at once (its slot booked) only if nobody is
deferred on its rate key and the rate admits it now; otherwise its signed message joins
the end of the key's deferred list, the key is registered in ``<prefix>deferred`` scored
by when its head is due, and the run ends with ``Ignore`` (its message acknowledged: the
entry in Redis is the task now). No worker slot waits.

The :class:`Drainer` (a thread of each worker's main process) sleeps until the earliest
score of the registry (at most :data:`MAX_SLEEP`), then runs ``rate_drain.lua`` for that
key: if the rate admits its head now, the head's slot is booked and the head is moved to
``<prefix>deferred:sending`` until the drainer has checked its signature and published
it (to ``<its queue>.redislock``, with :data:`BOOKED_HEADER`: the run skips the rate
check); the key is rescheduled at its next head's due time. Only a key's head is ever
looked at, so a backlog costs nothing per tick. A call taken for sending whose drainer
died before confirming it is sent again by any drainer after ``redislock_ttl``.

Where the lock Redis is not the broker's (``redislock_park_fallback``), nothing is kept
only in the lock Redis: a run over its rate books its slot ahead and is sent again
through the broker with a countdown to it, and the header.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import weakref
from typing import Any

from celery.exceptions import Ignore

from .. import signals
from .._core import lease_ms, server_clock_us
from .._keyspace import RateKeys, deferred_registry, deferred_sending
from .._rates import LONGEST_WAIT_US, Limit, script_args
from .._replies import (
    DRAIN_ADMITTED,
    DRAIN_PASSED,
    decode_rate,
    decode_rate_defer,
    decode_rate_drain,
    decode_rate_resend,
)
from .._scripts import scripts_for
from ..settings import LockOptions
from . import signing
from .clients import client_for, settings_for
from .contention import RATE_ADMITTED, RATE_BOOKED, _park_fallback
from .envelope import _dumps, _text
from .handover import _report_refused, publish_to_handoff_queue
from .latest import latest_prefixes, serve_debounced

log = logging.getLogger(__name__)

#: Header of a run whose rate slot is booked (a drained or rate-admitted run sent again):
#: it skips the rate check. Trusted for nothing else (docs/security.md).
BOOKED_HEADER = RATE_BOOKED
#: In-memory request attribute: this run was admitted by its rate (its re-queue or parked
#: copy keeps the slot).
ADMITTED_ATTR = RATE_ADMITTED
#: In-memory request attribute: when this run's rate slot was booked (µs since the epoch
#: on the Redis server's clock; 1: a producer's header said booked, but not when).
SLOT_ATTR = "redislock_rate_slot_us"
#: The longest the drainer sleeps between looks at the registry (new keys are seen then).
MAX_SLEEP = 1.0
#: Keys one drainer pass serves at most before it looks at the clock again.
MAX_PER_PASS = 1000
#: A deferred run's cost (every run counts for one) and burst (the limiter's default).
COST = 1
BURST = 1


def rate_pairs(limits: tuple[Limit, ...]) -> list[tuple[int, float]]:
    """The limits as ``(count, seconds)`` pairs, for a :class:`RedisRateLimiter`."""
    return [
        (limit.count, limit.period_us // 1_000_000)
        if limit.period_us % 1_000_000 == 0
        else (limit.count, limit.period_us / 1_000_000)
        for limit in limits
    ]


def _schedules(keys: RateKeys, limits: tuple[Limit, ...]) -> list[bytes]:
    return [keys.schedule(limit.period_us) for limit in limits]


def _limit_args(limits: tuple[Limit, ...]) -> list[int]:
    """Each limit's increment and tolerance (``script_args`` without the wait)."""
    return script_args(limits, BURST, COST, 0)[1:]


def _booked(request: Any) -> int:
    """The booked slot's time (µs, server clock; 1: unknown) a run's header carries, or 0."""
    headers = request.headers or {}
    value = headers.get(BOOKED_HEADER) or getattr(request, BOOKED_HEADER, None)
    if isinstance(value, bool) or not isinstance(value, int):
        return 1 if value else 0
    return max(value, 1)


def admit_or_defer(
    task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: LockOptions
) -> None:
    """Return if this run may go on (admitted now, or its slot was booked before);
    else defer it to its slot and raise ``Ignore``. Redis errors propagate (the run has
    taken nothing)."""
    limits = options.rate
    assert limits is not None
    booked = _booked(request)
    if booked:
        setattr(request, ADMITTED_ATTR, True)
        setattr(request, SLOT_ATTR, booked)
        return
    app = task.app
    name = task.rate_name(args, kwargs)
    keys = RateKeys.for_name(name, options.prefix)
    client = client_for(app)
    signature = task.signature_from_request(
        request, args, kwargs, headers=dict(request.headers or {})
    )
    if _park_fallback(app):
        _defer_through_broker(task, request, client, keys, limits, signature, name)
        return
    text = _dumps(
        {
            "signature": dict(signature),
            "limits": [[limit.count, limit.period_us] for limit in limits],
            "deferred_at": time.time(),
        }
    )
    entry = signing.sign_deferred(settings_for(app).signing_key, keys.deferred, text)
    script = scripts_for(client).rate_defer
    reply = script(
        keys=[keys.deferred, deferred_registry(options.prefix), *_schedules(keys, limits)],
        args=[entry, *_limit_args(limits)],
    )
    wait, slot_us = decode_rate_defer(reply)
    if wait is None:
        setattr(request, ADMITTED_ATTR, True)
        setattr(request, SLOT_ATTR, slot_us)
        signals.task_rate_admitted.send(task, name=name, task_id=request.id, delay=0.0)
        return
    signals.task_deferred.send(task, name=name, task_id=request.id)
    log.info(
        "redislock: %s[%s] deferred to its slot on rate key %r (%s)",
        task.name,
        request.id,
        name,
        "behind others" if wait < 0 else f"due in {wait / 1_000_000:.3f}s",
    )
    raise Ignore()


def _defer_through_broker(
    task: Any,
    request: Any,
    client: Any,
    keys: RateKeys,
    limits: tuple[Limit, ...],
    signature: Any,
    name: str,
) -> None:
    """Book the run's slot (however far) and, if it is not due now, send the run again
    with a countdown to it and :data:`BOOKED_HEADER`; the broker holds it meanwhile."""
    args = script_args(limits, BURST, COST, LONGEST_WAIT_US // 3)
    reply = scripts_for(client).rate(keys=_schedules(keys, limits), args=args)
    slot = decode_rate(reply, args[0], LONGEST_WAIT_US)
    if slot.admitted and slot.wait_us == 0:
        setattr(request, ADMITTED_ATTR, True)
        setattr(request, SLOT_ATTR, slot.now_us)
        signals.task_rate_admitted.send(task, name=name, task_id=request.id, delay=0.0)
        return
    if slot.admitted:  # (else: further than any slot is booked; checked again then)
        booked_at = slot.now_us + slot.wait_us
        signature.options.setdefault("headers", {})[BOOKED_HEADER] = booked_at
    task._publish(signature, countdown=slot.wait_us / 1_000_000)
    signals.task_deferred.send(task, name=name, task_id=request.id)
    raise Ignore()


# ----------------------------------------------------------------------------- drainer


class Drainer(threading.Thread):
    """The worker main process's thread that sends deferred runs when their slots come.

    Several drainers (one per worker) at once are safe: each step acts on a key's head
    in one atomic script, and only the drainer whose script moved the head sends it.
    """

    def __init__(
        self,
        app: Any,
        prefixes: list[str] | None = None,
        debounce_prefixes: list[str] | None = None,
    ) -> None:
        """``prefixes``: where deferred runs are drained (default: the prefixes of the
        app's rate-limited tasks); ``debounce_prefixes``: where due debounced calls are
        sent (default: the app's debounced tasks' prefixes, or none when ``prefixes`` is
        given: a drainer told where to drain does only that)."""
        super().__init__(name="redislock-drainer", daemon=True)
        from .base import LockedTask  # (base imports this module)

        self.app = app
        self.stopping = threading.Event()
        settings = settings_for(app)
        self.stale_ms = lease_ms(settings.defaults.ttl, "redislock_ttl")
        self.prefixes = prefixes or sorted(
            {
                t.lock_options().prefix
                for t in app.tasks.values()
                if isinstance(t, LockedTask) and t.lock_options().rate is not None
            }
        )
        #: The prefixes of debounced tasks, whose pending calls it sends when due.
        found, self.debounce_look = latest_prefixes(app)
        if debounce_prefixes is not None:
            found = debounce_prefixes
        elif prefixes is not None:
            found = []
        self.debounce_prefixes = found

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                delay = self.drain_once()
            except Exception:
                log.exception("redislock: draining deferred tasks failed; retrying")
                delay = MAX_SLEEP
            self.stopping.wait(delay)

    def drain_once(self) -> float:
        """Send every deferred run whose slot is due; the seconds until the next is due
        (at most :data:`MAX_SLEEP`)."""
        client = client_for(self.app)
        sleep = MAX_SLEEP
        for prefix in self.debounce_prefixes:
            look = self.debounce_look
            sleep = min(sleep, serve_debounced(self.app, client, prefix, self.stale_ms, look))
        for prefix in self.prefixes:
            self._resend_stale(client, prefix)
            registry = deferred_registry(prefix)
            for _ in range(MAX_PER_PASS):
                pipe = client.pipeline(transaction=False)
                pipe.time()
                pipe.zrange(registry, 0, 0, withscores=True)
                pipe.zrange(registry, -1, -1, withscores=True)
                clock, earliest, latest = pipe.execute()
                if not earliest:
                    break
                member, score = earliest[0]
                now_ms = server_clock_us(clock) / 1000
                if latest and latest[0][1] > now_ms + LONGEST_WAIT_US / 1000:
                    # A score no head can be due at (junk: whoever may write the prefix
                    # wrote it): served now, the drain script reschedules it as it is.
                    self.serve(client, prefix, latest[0][0])
                if score > now_ms:
                    sleep = min(sleep, (score - now_ms) / 1000)
                    break
                self.serve(client, prefix, member)
            else:
                sleep = 0.0
        return max(sleep, 0.0)

    def serve(self, client: Any, prefix: str, member: bytes) -> int:
        """Serve the deferred list ``member``'s head if it is due: 1 if one was sent."""
        scripts = scripts_for(client)
        registry, sending = deferred_registry(prefix), deferred_sending(prefix)
        keys = RateKeys.for_deferred(member, prefix)
        if keys is None:
            client.zrem(registry, member)
            _report_refused(self.app, member, None, "not a deferred list of this prefix")
            return 0
        try:
            head = client.lindex(member, 0)
        except Exception:  # not a list: the script takes it out of the registry
            head = None
        if head is None:
            scripts.rate_drain(keys=[member, registry, sending], args=[b"", "drop"])
            return 0
        try:
            found, limits = self._opened(keys, head)
        except signing.Refused as exc:
            scripts.rate_drain(keys=[member, registry, sending], args=[head, "drop"])
            _report_refused(self.app, member, None, f"a deferred call: {exc}")
            return 0
        # A run that expired while it waited books no slot: it is sent on without one, and
        # its worker drops it (REVOKED) as Celery drops any expired message.
        mode = "pass" if _expired(found["signature"]) else "admit"
        reply = scripts.rate_drain(
            keys=[member, registry, sending, *_schedules(keys, limits)],
            args=[head, mode, *_limit_args(limits)],
        )
        code, slot_us = decode_rate_drain(reply)
        if code not in (DRAIN_ADMITTED, DRAIN_PASSED):  # not due, or another drainer took it
            return 0
        self._send(found, slot_us if code == DRAIN_ADMITTED else None)
        client.zrem(sending, member + b"\n" + head)
        return 1

    def _opened(self, keys: RateKeys, entry: bytes) -> tuple[dict[str, Any], tuple[Limit, ...]]:
        """A deferred entry's JSON and limits, checked; raises Refused."""
        try:
            found = signing.open_deferred(settings_for(self.app).signing_key, keys.deferred, entry)
            signature = found["signature"]
            limits = tuple(Limit(int(c), int(p)) for c, p in found["limits"])
            if not limits or any(limit.count < 1 or limit.period_us < 1 for limit in limits):
                raise signing.Refused("its limits are not limits")
            options = signature["options"]
            if not isinstance(options.get("task_id"), str):
                raise signing.Refused("it names no task id")
        except signing.Refused:
            raise
        except Exception as exc:
            raise signing.Refused(f"not a deferred call ({type(exc).__name__}: {exc})") from None
        self._check_task(signature, keys)
        return found, limits

    def _check_task(self, signature: dict[str, Any], keys: RateKeys) -> None:
        """Refuse a call whose task is known here and does not take this rate key (a
        task not registered in this worker is vouched for by its signature alone)."""
        from .base import LockedTask  # (base imports this module)

        name = signature.get("task")
        task = self.app.tasks.get(name) if isinstance(name, str) else None
        if task is None:
            return
        if not isinstance(task, LockedTask) or task.lock_options().rate is None:
            raise signing.Refused(f"{name!r} is not a rate-limited LockedTask")
        prefix = task.lock_options().prefix
        rendered = RateKeys.for_name(
            task.rate_name(signature.get("args"), signature.get("kwargs")), prefix
        )
        if rendered.deferred != keys.deferred:
            raise signing.Refused("its arguments do not take the rate key it was deferred on")

    def _send(self, found: dict[str, Any], slot_us: int | None = 1) -> None:
        """Publish a drained run, with its booked slot (None: not booked, rate-checked
        again if it runs at all)."""
        signature = dict(found["signature"])
        options = dict(signature.get("options") or {})
        headers = dict(options.get("headers") or {})
        if slot_us is None:
            headers.pop(BOOKED_HEADER, None)
        else:
            headers[BOOKED_HEADER] = slot_us
        options["headers"] = headers
        signature["options"] = options
        publish_to_handoff_queue(self.app, signature)
        deferred_at = found.get("deferred_at")
        delay = time.time() - deferred_at if isinstance(deferred_at, (int, float)) else 0.0
        signals.task_undeferred.send(
            self.app.tasks.get(signature.get("task")) or self.app,
            name=str(signature.get("task")),
            task_id=options.get("task_id"),
            delay=max(delay, 0.0),
        )

    def _resend_stale(self, client: Any, prefix: str) -> int:
        """Send again the calls taken for sending whose drainer never confirmed them."""
        sending = deferred_sending(prefix)
        before = server_clock_us(client.time()) // 1000 - self.stale_ms
        sent = 0
        for member in client.zrangebyscore(sending, "-inf", before, start=0, num=10):
            if not decode_rate_resend(
                scripts_for(client).rate_resend(keys=[sending], args=[member, self.stale_ms])
            ):
                continue
            parts = member.rsplit(b"\n", 2)
            list_key = parts[0] if len(parts) == 3 else b""
            keys = RateKeys.for_deferred(list_key, prefix)
            try:
                if keys is None:
                    raise signing.Refused("not a deferred list of this prefix")
                found, _limits = self._opened(keys, member[len(list_key) + 1 :])
            except signing.Refused as exc:
                client.zrem(sending, member)
                _report_refused(self.app, list_key, None, f"a deferred call: {exc}")
                continue
            log.warning(
                "redislock: sending again a deferred run of %r whose drainer stopped",
                _text(list_key),
            )
            self._send(found)
            client.zrem(sending, member)
            sent += 1
        return sent


_drainers: weakref.WeakKeyDictionary[Any, Drainer] = weakref.WeakKeyDictionary()


def _expired(signature: Any) -> bool:
    """Whether a deferred run's ``expires`` (an ISO 8601 time, or seconds since the epoch
    as Celery may write it) has passed on this host's clock; False when it has none or it
    cannot be read (the receiving worker decides)."""
    options = signature.get("options") if isinstance(signature, dict) else None
    expires = options.get("expires") if isinstance(options, dict) else None
    try:
        if isinstance(expires, str):
            when = datetime.datetime.fromisoformat(expires)
            if when.tzinfo is None:
                when = when.replace(tzinfo=datetime.timezone.utc)
            return when.timestamp() < time.time()
        if isinstance(expires, (int, float)) and not isinstance(expires, bool):
            return float(expires) < time.time()
    except (ValueError, OverflowError, OSError):
        return False
    return False
