"""The ``redislock_*`` settings: read once from a Celery app's configuration and validated.

This module does not import Celery: it reads any mapping (``app.conf`` is one), so the
same rules check task attributes at decoration time and app settings at worker start.
Every duration is a number of seconds of at most ``_core.MAX_SECONDS`` (365 days).

Settings (task attributes of the same meaning override them per task):

* ``redislock_url`` — Redis for locks (``redis://``, ``rediss://``, ``unix://``); default:
  the broker URL when the broker is Redis, else an error at worker start.
* ``redislock_urls`` — a list of independent Redis masters (3 or 5): ``LockedTask`` then
  takes the quorum lock (:class:`~celery_redislock.RedLock`) over them instead; contended
  tasks are re-queued with a countdown (parking needs one Redis). Set this or
  ``redislock_url``, not both.
* ``redislock_node_timeout`` (``0.25``) — with ``redislock_urls``: per-node request timeout.
* ``redislock_redis_options`` (``{}``) — extra ``redis.Redis.from_url`` keyword arguments
  (pool size, timeouts, retry, keepalive, TLS files).
* ``redislock_prefix`` (``"redislock:"``) — key prefix of every lock.
* ``redislock_ttl`` (``30.0``, task: ``lock_ttl``) — lease in seconds, renewed while running.
* ``redislock_on_contention`` (``"requeue"``, task: ``on_contention``) — ``requeue``,
  ``wait``, ``skip``, ``raise`` or ``replace`` (last call wins: one running and the newest
  pending per key; docs/concepts.md, "Last call wins").
* ``redislock_debounce`` (``None``, task: ``lock_debounce``) — seconds of quiet: a call runs
  only once no newer call of its key has been sent for that long, with the newest call's
  arguments (each newer call supersedes the pending one). Implies ``replace``.
* ``redislock_debounce_max`` (``None``, task: ``lock_debounce_max``) — with a debounce, the
  longest a call waits from the oldest call it superseded (a stream of calls still runs at
  least that often); at least ``redislock_debounce``. Default: no bound.
* ``redislock_wait`` (``10.0``, task: ``lock_wait``) — how long ``wait`` blocks.
* ``redislock_wait_fallback`` (``"requeue"``) — after ``wait`` times out: ``requeue``/``raise``.
* ``redislock_max_requeues`` (``100``) — re-queues of one task before the exhausted action.
* ``redislock_requeue_backoff`` (``(0.05, 5.0)``) — (base, cap) of the jittered backoff.
* ``redislock_requeue_exhausted`` (``"fail"``) — ``fail`` (``LockContendedError``) or ``drop``.
* ``redislock_release_on_retry`` (``True``) — release when the task calls ``self.retry()``.
* ``redislock_lookahead`` (``64``, task: ``lock_lookahead``) — at a release that hands the
  lock to nobody, how many of the oldest messages of the task's queue to search for the next
  task of the same lock, which is then moved to the head of the queue holding the lock
  (requeue mode, where tasks are parked at delivery; ``0``: off). See docs/concepts.md.
* ``redislock_run_on`` (``0``, task: ``lock_run_on``) — seconds a worker process that
  releases a lock with tasks parked on it may go on running them itself, one after the
  other, instead of handing each over through the broker (the fastest hand-over of a hot
  key; ``0``: off). Taken only where it keeps Celery's rules: see docs/concepts.md,
  "Running on".
* ``redislock_limit`` (``1``, task: ``lock_limit``) — how many runs may hold one key at once:
  ``1`` is the mutex (a :class:`~celery_redislock.RedisLock` per key); an int ``N`` > 1, or a
  callable ``(args, kwargs) -> int`` computing it per call, takes one of N permits of a
  :class:`~celery_redislock.RedisSemaphore` per key instead (docs/concepts.md, "Limits").
  Not offered with ``redislock_urls``. On a task, ``lock_limit=None`` means no lock at all
  (a rate only: it needs ``lock_rate``).
* ``redislock_rate`` (``None``, task: ``lock_rate``) — at most this rate of runs per key:
  ``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"``, a ``(count, seconds)`` pair, or a list of them.
  A run over the rate is deferred to its slot (its worker slot given back) and delivered
  again when its slot is due, in arrival order per key. The key is the task's
  ``lock_rate_key`` template (default: its ``lock_key``). Not offered with
  ``redislock_urls`` (docs/concepts.md, "Rate limits for tasks").
* ``redislock_done_ttl`` (``86400.0``) — how long a finished task id is remembered (dedup).
* ``redislock_park_fallback`` (``"auto"``) — also keep a delayed copy of each parked task in
  the broker: ``"auto"`` does when the lock Redis is not the broker's Redis.
* ``redislock_park_at_delivery`` (``True``) — park contended messages in the worker's main
  process before dispatch, for keys that come again: the broker's own message where the
  broker is a Redis on the locks' server (no fallback copies), else the task's signature
  and its fallback copy, as a pool process parks them (``False``: pool processes park
  them, one round trip less per such message in the main loop).
* ``redislock_queues_in_other_db`` (``False``) — where the Redis broker is another database
  of the locks' server: park contended messages at delivery and let a release push the
  next one into its queue list there, as in the locks' own database (queue lists named
  ``"<list>\\r<db>\\r<own>"``, ``celery.queuelists``). Turn it on once every worker runs a
  release that has it: an older worker's release would push such a message into a list
  of that name in the locks' database, which nobody reads. ``False``: those brokers are
  treated as another server (signatures parked, with fallback copies).
* ``redislock_signing_key`` (derived from ``broker_url``) — the key the workers sign parked
  messages with and check them against before sending them on or running them (a ``str``
  or ``bytes`` of at least 16 bytes, the same on every worker). See docs/security.md.
* ``redislock_tasks`` (``None``) — locking by configuration: ``{pattern: options}`` (or a
  list of ``(pattern, options)`` pairs) giving every registered task whose name matches
  (exact, or a glob with ``*``; the first matching entry wins) the lock of
  ``base=LockedTask`` with those options (``lock_key``, ``on_contention``, ``lock_hold``,
  ...), without changing its base (:func:`task_rules`; applied by
  ``celery_redislock.celery.configured``).

Each value is checked by its validator in :mod:`celery_redislock._validators`; this module
puts them together: ``LockOptions``, ``LockSettings``, the task options and the
``redislock_tasks`` rules.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ._core import DEFAULT_PREFIX, seconds
from ._errors import LockConfigurationError
from ._nodes import check_distinct
from ._rates import Limit
from ._validators import MAX_LOOKAHEAD as MAX_LOOKAHEAD
from ._validators import (
    _backoff,
    _bool,
    _choice,
    _count,
    _hold,
    _lease,
    _limit,
    _lookahead,
    _prefix,
    _rate,
    _run_on,
)

CONTENTION_POLICIES = ("requeue", "wait", "skip", "raise", "replace")
WAIT_FALLBACKS = ("requeue", "raise")
EXHAUSTED_ACTIONS = ("fail", "drop")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class LockOptions:
    """Everything that decides how a task takes its lock (settings merged with task overrides)."""

    ttl: float = 30.0
    prefix: str = DEFAULT_PREFIX
    on_contention: str = "requeue"
    wait: float = 10.0
    wait_fallback: str = "requeue"
    max_requeues: int = 100
    requeue_backoff: tuple[float, float] = (0.05, 5.0)
    requeue_exhausted: str = "fail"
    release_on_retry: bool = True
    done_ttl: float = 86400.0
    hold: float = 0.0
    lookahead: int = 64
    #: Seconds a worker process may go on running the tasks parked on a lock it releases
    #: itself (docs/concepts.md, "Running on"); 0: off.
    run_on: float = 0.0
    #: 1: the mutex; an int N > 1 or a callable (args, kwargs) -> int: N permits per key.
    limit: Any = 1
    #: False: no lock and no permit (``lock_limit=None`` on a task with a rate).
    locked: bool = True
    #: The rate of runs per rate key (``lock_rate``), parsed; None: no rate.
    rate: tuple[Limit, ...] | None = None
    #: Last call wins (``lock_debounce``, ``lock_debounce_max``): seconds of quiet before
    #: a call runs (0: none), and the bound from the oldest superseded call (None: none).
    debounce: float = 0.0
    debounce_max: float | None = None

    @property
    def latest(self) -> bool:
        """Whether the newest call of a key wins (``replace``, or a debounce)."""
        return bool(self.locked and (self.on_contention == "replace" or self.debounce > 0))

    @property
    def limited(self) -> bool:
        """Whether runs take a permit of a semaphore (``lock_limit`` other than 1)."""
        return bool(self.locked and self.limit != 1)

    def merged(self, overrides: Mapping[str, Any]) -> LockOptions:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


class _AppSetting:
    """The default of ``LockedTask.lock_limit``: the app's ``redislock_limit`` (None on a
    task means no lock at all)."""

    def __repr__(self) -> str:
        return "APP_SETTING"


APP_SETTING: Any = _AppSetting()


#: option name -> (task attribute, setting name, validator)
_FIELDS: dict[str, tuple[str, str, Any]] = {
    "ttl": ("lock_ttl", "redislock_ttl", _lease),
    "prefix": ("lock_prefix", "redislock_prefix", lambda v, n: _prefix(v, n)),
    "on_contention": (
        "on_contention",
        "redislock_on_contention",
        lambda v, n: _choice(v, n, CONTENTION_POLICIES),
    ),
    "wait": ("lock_wait", "redislock_wait", lambda v, n: seconds(v, n, low=0.0)),
    "wait_fallback": (
        "lock_wait_fallback",
        "redislock_wait_fallback",
        lambda v, n: _choice(v, n, WAIT_FALLBACKS),
    ),
    "max_requeues": ("lock_max_requeues", "redislock_max_requeues", _count),
    "requeue_backoff": ("lock_requeue_backoff", "redislock_requeue_backoff", _backoff),
    "requeue_exhausted": (
        "lock_requeue_exhausted",
        "redislock_requeue_exhausted",
        lambda v, n: _choice(v, n, EXHAUSTED_ACTIONS),
    ),
    "release_on_retry": ("lock_release_on_retry", "redislock_release_on_retry", _bool),
    "done_ttl": ("lock_done_ttl", "redislock_done_ttl", _lease),
    "lookahead": ("lock_lookahead", "redislock_lookahead", _lookahead),
    "run_on": ("lock_run_on", "redislock_run_on", _run_on),
    "hold": ("lock_hold", None, _hold),  # type: ignore[dict-item]
    "limit": ("lock_limit", "redislock_limit", _limit),
    "rate": ("lock_rate", "redislock_rate", _rate),
    "debounce": ("lock_debounce", "redislock_debounce", lambda v, n: _lease(v, n)),
    "debounce_max": ("lock_debounce_max", "redislock_debounce_max", lambda v, n: _lease(v, n)),
}


def check_latest(
    options: LockOptions,
    where: str,
    *,
    own: Mapping[str, Any] | None = None,
    settings: bool = False,
) -> None:
    """The last-call-wins options agree: ``lock_debounce_max`` needs ``lock_debounce`` and
    is at least it; a debounce goes with ``on_contention`` ``"requeue"`` (the default) or
    ``"replace"`` only. ``where`` names the task or the settings in the error;
    ``settings``: the errors name the app's settings (``redislock_debounce``...), not the
    task options.

    ``own``: a task's own options, checked at decoration, when the app's settings are not
    known yet: what they may supply is checked at worker start (a task's bound over the
    app's ``redislock_debounce``, say)."""
    prefix = "redislock_" if settings else "lock_"
    debounce, bound, policy = f"{prefix}debounce", f"{prefix}debounce_max", "on_contention"
    if settings:
        policy = "redislock_on_contention"
    if own is not None and ("debounce" not in own or "debounce_max" not in own):
        options = replace(options, debounce_max=None)  # one of the two may be the app's
    if options.debounce_max is not None and options.debounce <= 0:
        raise LockConfigurationError(
            f"{where}: {bound} ({options.debounce_max}s) needs {debounce} (the "
            f"quiet period it bounds)"
        )
    if options.debounce_max is not None and options.debounce_max < options.debounce:
        raise LockConfigurationError(
            f"{where}: {bound} ({options.debounce_max}s) must be >= {debounce} "
            f"({options.debounce}s)"
        )
    if options.debounce > 0 and options.on_contention not in ("requeue", "replace"):
        raise LockConfigurationError(
            f"{where}: {debounce} goes with {policy} 'replace' (or the default "
            f"'requeue', which it makes 'replace'), got {policy}="
            f"{options.on_contention!r}"
        )
    if options.latest and not options.locked:
        raise LockConfigurationError(
            f"{where}: on_contention='replace' and lock_debounce need a lock (lock_limit=None "
            f"takes none)"
        )


def task_overrides(attributes: Mapping[str, Any], task_name: str) -> dict[str, Any]:
    """Validate a task's ``lock_*`` attributes; errors name the task and the option."""
    found: dict[str, Any] = {}
    for option, (attribute, _setting, check) in _FIELDS.items():
        value = attributes.get(attribute)
        if value is None:
            continue
        try:
            found[option] = check(value, attribute)
        except LockConfigurationError as exc:
            raise LockConfigurationError(f"task {task_name!r}: {exc}") from None
    return found


@dataclass(frozen=True)
class LockSettings:
    """The app-wide settings: where Redis is, and the default :class:`LockOptions`."""

    url: str
    url_source: str
    redis_options: Mapping[str, Any] = field(default_factory=dict)
    defaults: LockOptions = LockOptions()
    park_fallback: bool | str = "auto"
    park_at_delivery: bool = True
    #: Whether a Redis broker in another database of the locks' server is reached there
    #: (``redislock_queues_in_other_db``).
    queues_in_other_db: bool = False
    #: With ``redislock_urls``: the quorum's nodes (empty: one Redis at ``url``).
    urls: tuple[str, ...] = ()
    node_timeout: float = 0.25
    #: The key parked messages are signed with (``redislock_signing_key``, or derived
    #: from the broker URL), and where it came from.
    signing_key: bytes = field(default=b"", repr=False)
    signing_key_source: str = "redislock_signing_key"

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> LockSettings:
        """Read and validate ``redislock_*`` from a Celery ``app.conf`` (or any mapping)."""
        urls = _urls(conf)
        url, source = (urls[0], "redislock_urls") if urls else _url(conf)
        node_timeout = conf.get("redislock_node_timeout")
        node_timeout = (
            0.25 if node_timeout is None else seconds(node_timeout, "redislock_node_timeout")
        )
        options = conf.get("redislock_redis_options") or {}
        if not isinstance(options, Mapping):
            raise LockConfigurationError(
                f"redislock_redis_options must be a dict of redis.Redis.from_url keyword "
                f"arguments, got {options!r}"
            )
        values: dict[str, Any] = {}
        for option, (_attribute, setting, check) in _FIELDS.items():
            if setting is None:
                continue
            value = conf.get(setting)
            if value is not None:
                values[option] = check(value, setting)
        fallback = conf.get("redislock_park_fallback", "auto")
        if fallback not in ("auto", True, False) or (
            isinstance(fallback, int) and not isinstance(fallback, bool)
        ):
            raise LockConfigurationError(
                f"redislock_park_fallback must be 'auto', True or False, got {fallback!r}"
            )
        at_delivery = conf.get("redislock_park_at_delivery", True)
        if not isinstance(at_delivery, bool):
            raise LockConfigurationError(
                f"redislock_park_at_delivery must be True or False, got {at_delivery!r}"
            )
        other_db = conf.get("redislock_queues_in_other_db", False)
        if not isinstance(other_db, bool):
            raise LockConfigurationError(
                f"redislock_queues_in_other_db must be True or False, got {other_db!r}"
            )
        defaults = LockOptions(**values)
        if urls and defaults.rate is not None:
            raise LockConfigurationError(
                "redislock_rate is not offered with redislock_urls: a rate limiter over a "
                "quorum of masters is not built; use one Redis (redislock_url) for "
                "rate-limited tasks"
            )
        check_latest(defaults, "redislock settings", settings=True)
        if urls and defaults.latest:
            raise LockConfigurationError(
                "redislock_on_contention='replace' and redislock_debounce are not offered with "
                "redislock_urls: the pending call lives beside the lock on one Redis; use one "
                "Redis (redislock_url) for last-call-wins tasks"
            )
        if urls and defaults.limited:
            raise LockConfigurationError(
                "redislock_limit is not offered with redislock_urls: a quorum semaphore "
                "(at most N per key over several masters) is not built yet; use one Redis "
                "(redislock_url) for limited tasks"
            )
        if urls and node_timeout * 2 >= defaults.ttl:
            raise LockConfigurationError(
                f"redislock_node_timeout ({node_timeout}s) must be well below redislock_ttl "
                f"({defaults.ttl}s): a quorum attempt that takes longer than the lease can never "
                f"be valid (use at most ttl / 10)"
            )
        signing_key, key_source = _signing_key(conf)
        return cls(
            url=url,
            url_source=source,
            redis_options=dict(options),
            defaults=defaults,
            park_fallback=fallback,
            park_at_delivery=at_delivery,
            queues_in_other_db=other_db,
            urls=urls,
            node_timeout=node_timeout,
            signing_key=signing_key,
            signing_key_source=key_source,
        )


_DERIVE = b"celery_redislock signing key v1"


def derive_key(broker_url: str) -> bytes:
    """The default signing key: an HMAC of the broker URL, credentials included.

    Whoever knows the broker URL can derive it, but could publish any task to the broker
    anyway; whoever may only write the lock keys cannot, as long as the URL carries a
    secret (a password) they do not know.
    """
    return hmac.new(_DERIVE, broker_url.encode("utf-8"), hashlib.sha256).digest()


#: The shortest ``redislock_signing_key`` accepted, in bytes.
MIN_SIGNING_KEY = 16


def _signing_key(conf: Mapping[str, Any]) -> tuple[bytes, str]:
    """``redislock_signing_key`` as bytes, or the key derived from the broker URL."""
    key = conf.get("redislock_signing_key")
    if key is None:
        # Celery's own property also reads CELERY_BROKER_URL (celery -b); a plain mapping has none.
        broker = getattr(conf, "broker_url", None) or conf.get("broker_url") or ""
        return derive_key(str(broker)), "derived from broker_url"
    raw = key.encode("utf-8") if isinstance(key, str) else key
    if not isinstance(raw, bytes) or len(raw) < MIN_SIGNING_KEY:
        shown = f"{len(raw)} bytes" if isinstance(raw, bytes) else repr(type(key).__name__)
        raise LockConfigurationError(
            f"redislock_signing_key must be a str or bytes of at least {MIN_SIGNING_KEY} bytes, "
            f"the same on every worker (e.g. secrets.token_hex(32)), got {shown}"
        )
    return raw, "redislock_signing_key"


def _urls(conf: Mapping[str, Any]) -> tuple[str, ...]:
    urls = conf.get("redislock_urls")
    if urls is None:
        return ()
    allowed = ", ".join(REDIS_SCHEMES)
    if isinstance(urls, str) or not isinstance(urls, (list, tuple)) or not urls:
        raise LockConfigurationError(
            f"redislock_urls must be a non-empty list of Redis URLs (starting with {allowed}), "
            f"one per independent master (3 or 5 recommended), got {_redacted(urls)!r}"
        )
    for url in urls:
        if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
            raise LockConfigurationError(
                f"redislock_urls must hold Redis URLs starting with {allowed}, "
                f"got {_redacted(url)!r}"
            )
    check_distinct(list(urls), "redislock_urls")
    if conf.get("redislock_url") is not None:
        raise LockConfigurationError(
            "set redislock_urls (a quorum of masters) or redislock_url (one Redis), not both"
        )
    return tuple(urls)


def _url(conf: Mapping[str, Any]) -> tuple[str, str]:
    url = conf.get("redislock_url")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
            raise LockConfigurationError(
                f"redislock_url must be a Redis URL starting with {', '.join(REDIS_SCHEMES)}, "
                f"got {_redacted(url)!r}"
            )
        return url, "redislock_url"
    # The attribute, not conf.get(): it also sees CELERY_BROKER_URL and `celery -b`.
    broker = getattr(conf, "broker_url", None) or conf.get("broker_url")
    if isinstance(broker, str) and broker.startswith(REDIS_SCHEMES):
        return broker, "broker_url (redislock_url is not set; the broker is Redis)"
    shown = broker.split("@")[-1] if isinstance(broker, str) else broker
    raise LockConfigurationError(
        f"redislock_url is not set and the broker ({shown!r}) is not Redis: set "
        f"app.conf.redislock_url = 'redis://host:6379/0'"
    )


def _redacted(value: Any) -> Any:
    """A URL (or a list of them) as an error may show it: without a password."""
    if isinstance(value, (list, tuple)):
        return type(value)(_redacted(v) for v in value)
    if isinstance(value, str) and "@" in value and "://" in value:
        scheme, rest = value.split("://", 1)
        credentials, host = rest.rsplit("@", 1)
        user = credentials.split(":", 1)[0]
        return f"{scheme}://{user + ':' if user else ''}***@{host}"
    return value


# ------------------------------------------------------------------ redislock_tasks

#: The options a ``redislock_tasks`` entry may set: ``LockedTask``'s own attributes.
TASK_OPTIONS: tuple[str, ...] = (
    "lock_key",
    "lock_key_hash",
    "lock_rate_key",
    *(attribute for attribute, _setting, _check in _FIELDS.values()),
)


class TaskRule(NamedTuple):
    """One ``redislock_tasks`` entry: the task names it matches and its checked options."""

    pattern: str
    options: Mapping[str, Any]  # LockedTask attribute -> value (checked, None: the setting)
    regex: re.Pattern[str]

    def matches(self, task_name: str) -> bool:
        """Whether this entry applies to the task ``task_name``. A glob never matches
        Celery's built-in tasks (``celery.*``) unless the pattern starts with ``celery.``."""
        if (
            "*" in self.pattern
            and task_name.startswith("celery.")
            and not self.pattern.startswith("celery.")
        ):
            return False
        return self.regex.fullmatch(task_name) is not None


def task_rules(conf: Mapping[str, Any]) -> tuple[TaskRule, ...]:
    """Read and validate ``redislock_tasks``: ``{pattern: options}`` or a list of
    ``(pattern, options)`` pairs, in order (the first entry matching a task applies).

    A pattern is a task name, or a glob where ``*`` matches any characters (as in
    ``task_routes``). Options are ``LockedTask``'s attributes (:data:`TASK_OPTIONS`),
    checked as at decoration; a ``lock_key`` template is checked against each task's
    arguments when it is applied. Errors name the setting, the pattern and the option.
    """
    raw = conf.get("redislock_tasks")
    if raw is None:
        return ()
    shape = (
        "redislock_tasks must be a dict {task name or glob: {option: value}} or a list of "
        "(pattern, options) pairs"
    )
    items: list[tuple[Any, Any]]
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, (list, tuple)):
        items = []
        for index, item in enumerate(raw):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise LockConfigurationError(f"{shape}: item {index} is {item!r}")
            items.append((item[0], item[1]))
    else:
        raise LockConfigurationError(f"{shape}, got {raw!r}")
    rules = []
    for pattern, options in items:
        if not isinstance(pattern, str) or not pattern.strip():
            raise LockConfigurationError(
                f"redislock_tasks: pattern {pattern!r} must be a non-empty str (a task name, "
                f"or a glob with *)"
            )
        where = f"redislock_tasks[{pattern!r}]"
        if not isinstance(options, Mapping):
            raise LockConfigurationError(
                f"{where} must be a dict of LockedTask options such as "
                f"{{'lock_key': 'account:{{account_id}}'}}, got {options!r}"
            )
        checked: dict[str, Any] = {}
        for option, value in options.items():
            if option not in TASK_OPTIONS:
                raise LockConfigurationError(
                    f"{where}: unknown option {option!r} (options: {', '.join(TASK_OPTIONS)})"
                )
            try:
                checked[option] = _task_option(option, value)
            except LockConfigurationError as exc:
                raise LockConfigurationError(f"{where}: option {option!r}: {exc}") from None
        rules.append(TaskRule(pattern, checked, pattern_regex(pattern)))
    return tuple(rules)


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A ``redislock_tasks`` pattern as a regex: ``*`` matches any characters (dots too),
    everything else itself (as ``task_routes`` globs)."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))


def task_patterns(raw: Any) -> list[str]:
    """The str patterns of a ``redislock_tasks`` value, however malformed the rest of it
    (a bad setting's tasks are refused, not run unlocked)."""
    if isinstance(raw, Mapping):
        keys: list[Any] = list(raw)
    elif isinstance(raw, (list, tuple)):
        keys = [item[0] for item in raw if isinstance(item, (list, tuple)) and item]
    else:
        keys = []
    return [key for key in keys if isinstance(key, str) and key.strip()]


def _task_option(option: str, value: Any) -> Any:
    """One ``redislock_tasks`` option's value, checked as ``LockedTask`` checks its attribute
    (a ``lock_key`` template against the task's arguments is checked when applied)."""
    if value is None:
        # As on LockedTask: the app's setting (lock_key: one lock per task; lock_limit:
        # no lock, a rate only; lock_rate_key: the lock_key).
        return None
    if option in ("lock_key", "lock_rate_key"):
        if not isinstance(value, str) and not callable(value):
            raise LockConfigurationError(
                f"{option} must be None (one lock per task), a template str such as "
                f"'account:{{account_id}}', or a callable (args, kwargs) -> str; got {value!r}"
            )
        return value
    if option == "lock_key_hash":
        return _bool(value, option)
    for attribute, _setting, check in _FIELDS.values():
        if attribute == option:
            check(value, attribute)
            return value  # the task's own attribute: LockedTask checks it again
    raise LockConfigurationError(f"unknown option {option!r}")  # pragma: no cover
