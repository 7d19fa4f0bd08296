"""Every Redis name this package uses, spelled in one place (I/O-free).

One lock's names all share its ``{name}`` hash tag (one cluster slot); ``<L>`` is the
lock hash's key ``<prefix>{<name>}``:

==================================  =====================================================
``<L>``                             the lock hash (owner -> hold count, and the reserved
                                    fields ``__fence__``, ``__grant__``, ``__chain__``)
``<L>:fence``                       the fencing counter (never expires)
``<L>:released``                    the pub/sub channel a release is announced on
``<L>:released:<grant id>``         one subscriber's direct-grant channel (``_waiting``)
``<L>:released:L<hex>``             a lone waiter's box: its direct grant (a list, BLPOP)
``<L>:waiters``                     blocked acquires in arrival order (a list)
``<L>:claims``                      how long each waiter's place in line is kept (zset)
``<L>:waiters:wake``                waiters' wake ids for direct grants (a hash)
``<L>:void:<nonce>:<owner>``        a quorum lock's record of the attempts of one owner
                                    that must not take the lock if they land late
``<L>:done:<owner>``                a task run's "done" marker
``<L>:kept:<owner>``                a hold kept across ``self.retry()`` for that run
``<L>:parked``                      the parked task ids, oldest first (a list)
``<L>:parked:messages``             parked task id -> its message (a hash)
``<L>:parked:dispatched``           handed-over task id -> when (a hash)
``<L>:parked:unused``               the sweep script's unused slot (never written)
``<L>:parked:limit``                a semaphore's: parked task id -> its limit (a hash)
``<L>:latest``                      "last call wins" (``on_contention="replace"``,
                                    ``lock_debounce``): the key's pending call and the
                                    newest call that started (a hash; ``celery.latest``)
==================================  =====================================================

A semaphore of the same name (:class:`SemaphoreKeys`) lives beside the lock, under
``<S>`` = ``<L>:sem``; its line, channel and fence are named as a lock's, after ``<S>``:

==================================  =====================================================
``<S>``                             the holders: owners that hold a permit (a set)
``<S>:permit:<owner>``              that owner's permit: a hash of a lock hash's shape
                                    (owner -> hold count, ``__fence__``) with its lease
``<S>:fence``                       the fencing counter of all its permits
``<S>:released``                    the channel a freed permit is announced on
``<S>:waiters``, ``<S>:claims``,    its line of waiters, as a lock's
``<S>:waiters:wake``
``<S>:done:<owner>``,               a limited task's run's markers and parked tasks, as a
``<S>:kept:<owner>``, ``<S>:parked``  lock's (``<S>`` stands for the semaphore where the
... ``<S>:parked:limit``            sweeper's registry and parked messages name a lock)
==================================  =====================================================

A rate limiter of the same name (:class:`RateKeys`) keeps one schedule per limit beside
the lock, in the same hash tag:

==================================  =====================================================
``<L>:rate:<period us>``            the schedule of its limit over that period (in
                                    microseconds: ``:rate:1000000`` for ``"N/s"``): the
                                    theoretical arrival time, a whole number of
                                    microseconds on the server's clock; it expires once
                                    that time has passed
``<L>:rate:deferred``               a rate-limited task's deferred calls on that name, in
                                    arrival order (a list of signed entries)
==================================  =====================================================

Names of a prefix, not of one lock:

==================================  =====================================================
``<prefix>parked``                  the sweeper's registry: locks with parked tasks (zset)
``<prefix>lookahead:<queue list>``  the lock whose tasks look-ahead moves ahead in a list
``<prefix>deferred``                the drainers' registry: deferred lists, scored by when
                                    their head is due (ms on the server's clock; a zset)
``<prefix>debounce``                the drainers' registry of debounced calls: ``<L>:latest``
                                    keys scored by when their pending call is due (ms on
                                    the server's clock; a zset)
``<prefix>deferred:sending``        deferred calls taken for sending and not yet confirmed
                                    sent: ``<deferred list>\n<entry>``, scored by when
                                    taken (ms; a zset)
``<prefix>stats``                   the counters ``celery redislock stats`` reads (hash)
``<prefix>probe:<nonce>``           the parking probe: do the locks and the broker share
                                    a Redis?
``<prefix>fence:<name>``            a :class:`~celery_redislock.FencedResource`'s highest
                                    admitted token
``<queue>.redislock``               the queue a task handed its lock is published to
==================================  =====================================================

The byte values are a running deployment's keys: ``tests/unit/test_core_keyspace.py`` pins them.
The Lua scripts get every name as a KEYS entry (the direct-grant channel is the one they
build, from the release channel and the wake id's subscriber part).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._errors import LockConfigurationError

DEFAULT_PREFIX = "redislock:"

#: Suffixes of one lock's names, after the lock hash's key.
_FENCE = b":fence"
_CHANNEL = b":released"
_WAITERS = b":waiters"
_CLAIMS = b":claims"
_WAKE = b":waiters:wake"
_VOID = b":void:"
_DONE = b":done:"
_KEPT = b":kept:"
_PARKED = b":parked"
_PARKED_MESSAGES = b":parked:messages"
_PARKED_DISPATCHED = b":parked:dispatched"
_PARKED_UNUSED = b":parked:unused"
_PARKED_LIMIT = b":parked:limit"
_LATEST = b":latest"
_SEMAPHORE = b":sem"
_PERMIT = b":permit:"
_RATE = b":rate:"
_DEFERRED = b"deferred"
#: Handed-over tasks go to this queue (``<queue>.redislock``).
HANDOFF_QUEUE_SUFFIX = ".redislock"


def escape_name(name: bytes) -> bytes:
    """A lock name as it stands inside the hash tag.

    '{' and '}' inside the hash tag would end it early and could split one lock's keys
    across cluster slots; '%' is escaped too so the mapping stays one-to-one.
    """
    return name.replace(b"%", b"%25").replace(b"{", b"%7B").replace(b"}", b"%7D")


def _name_bytes(name: str | bytes) -> bytes:
    if isinstance(name, str):
        try:
            raw = name.encode("utf-8")
        except UnicodeEncodeError:
            raise LockConfigurationError(
                f"name must be bytes or a str that encodes as UTF-8, got {name!r}"
            ) from None
    elif isinstance(name, bytes):
        raw = name
    else:
        raise LockConfigurationError(f"name must be str or bytes, got {type(name).__name__}")
    if not raw:
        raise LockConfigurationError("name must not be empty")
    return raw


def _part(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass(frozen=True)
class LockKeys:
    """Every Redis name one lock uses; all share the ``{name}`` hash tag (one cluster slot).

    ``<prefix>{<name>}``          the lock hash (owner -> hold count, plus the token field)
    ``<prefix>{<name>}:fence``    the fencing counter (never expires)
    ``<prefix>{<name>}:released`` the pub/sub channel a release is announced on
    ``<prefix>{<name>}:waiters``  blocked acquires in arrival order (a list)
    ``<prefix>{<name>}:claims``   how long each waiter's place in line is kept (a sorted set)
    ``<prefix>{<name>}:waiters:wake``  waiters' wake ids for direct grants (a hash)

    The other names beside the lock (a task's done marker, its parked tasks, a quorum
    lock's void records, ...) are methods and properties: see the module's table.
    """

    lock: bytes
    fence: bytes
    channel: bytes
    waiters: bytes
    claims: bytes
    wake: bytes

    @classmethod
    def for_name(cls, name: str | bytes, prefix: str = DEFAULT_PREFIX) -> LockKeys:
        return cls.for_lock(lock_key(name, prefix))

    @classmethod
    def for_lock(cls, lock: bytes) -> LockKeys:
        """The names of the lock whose hash is ``lock`` (a key :func:`lock_key` built)."""
        # (positional: a frozen dataclass's keyword call costs more, once per lock object)
        fence, channel, waiters = lock + _FENCE, lock + _CHANNEL, lock + _WAITERS
        return cls(lock, fence, channel, waiters, lock + _CLAIMS, lock + _WAKE)

    def acquire_keys(self) -> list[bytes]:
        """KEYS of acquire.lua (and of the lock part of park.lua), in order."""
        return [self.lock, self.fence, self.waiters, self.claims, self.wake]

    def release_keys(self) -> list[bytes]:
        """KEYS of release.lua, in order."""
        return [self.lock, self.channel, self.fence, self.waiters, self.claims, self.wake]

    # -- beside the lock: the Celery layer's and the quorum lock's ----------------------

    def done(self, owner: str | bytes) -> bytes:
        """``owner``'s "done" marker (a task run that finished under this lock)."""
        return self.lock + _DONE + _part(owner)

    def kept(self, owner: str | bytes) -> bytes:
        """The marker of a hold kept across ``self.retry()`` for the run ``owner``."""
        return self.lock + _KEPT + _part(owner)

    def void(self, nonce: str | bytes, owner: str | bytes) -> bytes:
        """The void record of ``owner``'s attempts from the quorum lock object ``nonce``."""
        return self.lock + _VOID + _part(nonce) + b":" + _part(owner)

    @property
    def parked(self) -> bytes:
        """The parked task ids, oldest first (a list)."""
        return self.lock + _PARKED

    @property
    def parked_messages(self) -> bytes:
        """Parked task id -> its message (a hash)."""
        return self.lock + _PARKED_MESSAGES

    @property
    def parked_dispatched(self) -> bytes:
        """Handed-over task id -> when it was handed the lock (a hash)."""
        return self.lock + _PARKED_DISPATCHED

    @property
    def parked_unused(self) -> bytes:
        """sweep.lua's KEYS[6] (the done marker's slot in handoff.lua): never written."""
        return self.lock + _PARKED_UNUSED

    @property
    def latest(self) -> bytes:
        """ "Last call wins": the key's pending call and newest started call (a hash)."""
        return self.lock + _LATEST

    @property
    def parked_limit(self) -> bytes:
        """A semaphore's (``<S>``): parked task id -> the limit it parked with (a hash)."""
        return self.lock + _PARKED_LIMIT

    def grant_channel(self, grant_id: bytes) -> bytes:
        """The direct-grant channel of the subscriber ``grant_id``."""
        return self.channel + grant_channel_tail(grant_id)

    def handoff_keys(self, task_id: str | bytes) -> list[bytes | str]:
        """KEYS 1-10 of handoff.lua for the releasing task ``task_id`` (a look-ahead's
        four follow: queue list, registry, chain, the next task's done marker)."""
        return [
            self.lock,
            self.channel,
            self.fence,
            self.parked,
            self.parked_messages,
            self.done(task_id),
            self.parked_dispatched,
            self.waiters,
            self.claims,
            self.wake,
        ]

    def sweep_keys(self, registry: str) -> list[bytes | str]:
        """KEYS of sweep.lua; ``registry``: :func:`parked_registry`."""
        return [
            self.lock,
            self.channel,
            self.fence,
            self.parked,
            self.parked_messages,
            self.parked_unused,
            self.parked_dispatched,
            registry,
        ]


@dataclass(frozen=True)
class SemaphoreKeys:
    """Every Redis name one semaphore uses (all in its ``{name}`` hash tag).

    ``line``: its holders set, fence, channel and line as a :class:`LockKeys` (``.lock``
    is the holders set); ``permits``: what its permit keys start with (the scripts add
    the owner: :meth:`permit`).
    """

    line: LockKeys
    permits: bytes

    @classmethod
    def for_name(cls, name: str | bytes, prefix: str = DEFAULT_PREFIX) -> SemaphoreKeys:
        base = lock_key(name, prefix) + _SEMAPHORE
        return cls(line=LockKeys.for_lock(base), permits=base + _PERMIT)

    @classmethod
    def for_key(cls, key: bytes, prefix: str = DEFAULT_PREFIX) -> SemaphoreKeys | None:
        """The semaphore whose holders set is ``key`` (``<S>``, the key a limited task is
        parked under); None for any other key, a lock's included."""
        name = semaphore_name(key, prefix)
        return None if name is None else cls.for_name(name, prefix)

    def permit(self, owner: str | bytes) -> bytes:
        """``owner``'s permit: the hash its hold lives in (and the watchdog renews)."""
        return self.permits + _part(owner)

    def park_keys(self, done: bytes, registry: str) -> list[bytes | str]:
        """KEYS of sem_park.lua for the run whose done marker is ``done``."""
        line = self.line
        return [
            line.lock,
            line.fence,
            done,
            line.parked,
            line.parked_messages,
            line.parked_dispatched,
            line.waiters,
            line.claims,
            line.wake,
            line.parked_limit,
            registry,
        ]

    def handoff_keys(self, task_id: str | bytes) -> list[bytes | str]:
        """KEYS of sem_handoff.lua for the releasing run ``task_id``."""
        return [*self.line.handoff_keys(task_id), self.line.parked_limit]

    def sweep_keys(self, registry: str) -> list[bytes | str]:
        """KEYS of sem_sweep.lua; ``registry``: :func:`parked_registry`."""
        keys = self.line.sweep_keys(registry)
        keys[5] = self.line.parked_limit
        return keys


def run_key(name: str | bytes, prefix: str = DEFAULT_PREFIX, *, limited: bool = False) -> bytes:
    """The key a task's run holds, is parked under, and its parked messages are signed
    for: the lock hash's, or with ``limited`` (``lock_limit``) its semaphore's holders set."""
    if limited:
        return SemaphoreKeys.for_name(name, prefix).line.lock
    return lock_key(name, prefix)


def parked_under(key: bytes, prefix: str = DEFAULT_PREFIX) -> LockKeys | SemaphoreKeys | None:
    """The lock or semaphore whose :func:`run_key` is ``key`` (a registry member, a parked
    message's lock), under ``prefix``; None if it is neither (anyone who may write the
    registry may have written it)."""
    semaphore = SemaphoreKeys.for_key(key, prefix)
    if semaphore is not None:
        return semaphore
    name = name_from_lock_key(key, prefix)
    if name is None or lock_key(name, prefix) != key:
        return None
    return LockKeys.for_lock(key)


@dataclass(frozen=True)
class RateKeys:
    """Every Redis name one rate limiter uses: a schedule per limit, named by the limit's
    period, all in the name's ``{name}`` hash tag (one cluster slot). Limiters of one name
    with the same period share that schedule, whatever their counts."""

    schedules: bytes

    @classmethod
    def for_name(cls, name: str | bytes, prefix: str = DEFAULT_PREFIX) -> RateKeys:
        return cls(schedules=lock_key(name, prefix) + _RATE)

    def schedule(self, period_us: int) -> bytes:
        """The schedule of the limit over ``period_us`` microseconds."""
        return self.schedules + str(period_us).encode()

    @property
    def deferred(self) -> bytes:
        """A rate-limited task's deferred calls on this name, oldest first (a list)."""
        return self.schedules + _DEFERRED

    @classmethod
    def for_deferred(cls, key: bytes, prefix: str = DEFAULT_PREFIX) -> RateKeys | None:
        """The limiter whose deferred list is ``key`` (a drainers' registry member), under
        ``prefix``; None for any other key (anyone who may write the registry may have
        written it)."""
        tail = _RATE + _DEFERRED
        if not key.endswith(tail):
            return None
        name = name_from_lock_key(key[: -len(tail)], prefix)
        if name is None:
            return None
        found = cls.for_name(name, prefix)
        return found if found.deferred == key else None

    @property
    def schedule_pattern(self) -> bytes:
        """A SCAN ``MATCH`` pattern for this name's schedules (and, to be filtered out
        by :meth:`period_of`, its deferred list)."""
        return _glob_literal(self.schedules) + b"*"

    def period_of(self, key: bytes) -> int | None:
        """The period (µs) of the limit whose schedule is ``key``; None for any other key."""
        tail = key[len(self.schedules) :] if key.startswith(self.schedules) else b""
        if not tail.isdigit() or len(tail) > 19 or tail[:1] == b"0":
            return None
        return int(tail)


def rate_name_from_deferred(key: bytes, prefix: str = DEFAULT_PREFIX) -> bytes | None:
    """The rate key's name whose deferred list is ``key``; None for any other key."""
    found = RateKeys.for_deferred(key, prefix)
    if found is None:
        return None
    return name_from_lock_key(key[: -len(_RATE + _DEFERRED)], prefix)


def deferred_key_pattern(prefix: str, pattern: bytes) -> bytes:
    """A ``MATCH`` pattern for the deferred lists of the rate keys whose name matches the
    glob ``pattern`` (escaped as :func:`lock_key_pattern` escapes it)."""
    return lock_key_pattern(prefix, pattern) + _RATE + _DEFERRED


def _glob_literal(value: bytes) -> bytes:
    """``value`` as a glob that matches only itself."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", value)


def lock_key(name: str | bytes, prefix: str = DEFAULT_PREFIX) -> bytes:
    """The lock hash's key: ``<prefix>{<name, escaped>}`` (the prefix checked: a brace in
    it would move the cluster hash tag, and the lock's keys would land in other slots)."""
    return validate_prefix(prefix).encode("utf-8") + b"{" + escape_name(_name_bytes(name)) + b"}"


def validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix or not _encodes(prefix):
        raise LockConfigurationError(
            f"prefix must be a str without '{{' or '}}' (they would move the cluster hash tag) "
            f"that encodes as UTF-8, got {prefix!r}"
        )
    return prefix


def _encodes(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def name_from_lock_key(key: bytes, prefix: str = DEFAULT_PREFIX) -> bytes | None:
    """Inverse of :meth:`LockKeys.for_name` for a lock hash key; None for other keys."""
    head = prefix.encode("utf-8") + b"{"
    if not key.startswith(head) or not key.endswith(b"}"):
        return None
    inner = key[len(head) : -1]
    return inner.replace(b"%7D", b"}").replace(b"%7B", b"{").replace(b"%25", b"%")


def lock_key_pattern(prefix: str, pattern: bytes) -> bytes:
    """A SCAN ``MATCH`` pattern for the lock hashes whose name matches the glob
    ``pattern``: the prefix matched literally (its glob characters escaped), the
    pattern escaped as names are (:func:`escape_name`)."""
    return _glob_literal(prefix.encode()) + b"{" + escape_name(pattern) + b"}"


def semaphore_name(key: bytes, prefix: str = DEFAULT_PREFIX) -> bytes | None:
    """The name of the semaphore whose holders set is ``key`` (``<S>``); None for any
    other key (a lock's, or one that does not round-trip: not written by this package)."""
    if not key.endswith(_SEMAPHORE):
        return None
    name = name_from_lock_key(key[: -len(_SEMAPHORE)], prefix)
    if name is None or not name or lock_key(name, prefix) + _SEMAPHORE != key:
        return None
    return name


def semaphore_key_pattern(prefix: str, pattern: bytes) -> bytes:
    """A SCAN ``MATCH`` pattern for the holders sets (``<S>``) of the semaphores whose
    name matches the glob ``pattern`` (escaped as :func:`lock_key_pattern` escapes it)."""
    return lock_key_pattern(prefix, pattern) + _SEMAPHORE


def grant_channel_tail(grant_id: bytes) -> bytes:
    """What a subscriber's direct-grant channel adds to a lock's release channel."""
    return b":" + grant_id


def parked_registry(prefix: str) -> str:
    """The sweeper's registry: lock keys with parked or handed-over tasks (a zset)."""
    return prefix + "parked"


def deferred_registry(prefix: str) -> str:
    """The drainers' registry: deferred lists, scored by when their head is due (a zset)."""
    return prefix + "deferred"


def debounce_registry(prefix: str) -> str:
    """The drainers' registry of debounced calls: ``<L>:latest`` keys scored by when their
    pending call is due (a zset)."""
    return prefix + "debounce"


def latest_run_key(key: bytes) -> bytes | None:
    """The run key whose ``:latest`` hash ``key`` is (a debounce registry member), or
    None if it is not one (anyone who may write the registry may have written it)."""
    return key[: -len(_LATEST)] if key.endswith(_LATEST) and len(key) > len(_LATEST) else None


def deferred_sending(prefix: str) -> str:
    """Deferred calls taken for sending, not yet confirmed sent (a zset)."""
    return prefix + "deferred:sending"


def lookahead_chain(prefix: str, queue_list: str) -> str:
    """The key naming the one lock whose tasks look-ahead moves ahead in ``queue_list``."""
    return f"{prefix}lookahead:{queue_list}"


def stats_key(prefix: str) -> str:
    """The counters every process adds to, and ``celery redislock stats`` reads."""
    return prefix + "stats"


def probe_key(prefix: str, nonce: str) -> str:
    """The parking probe's key: written by the lock client, read by the broker's."""
    return f"{prefix}probe:{nonce}"


def resource_fence_key(prefix: str, name: str) -> str:
    """A ``FencedResource``'s highest admitted token."""
    return f"{prefix}fence:{name}"


def handoff_queue(queue: str) -> str:
    """The queue a task handed its lock is published to: ``<queue>.redislock``."""
    return queue if queue.endswith(HANDOFF_QUEUE_SUFFIX) else queue + HANDOFF_QUEUE_SUFFIX
