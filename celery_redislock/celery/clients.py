"""Per-app state: an app's ``redislock_*`` settings, read once, and its Redis clients
(the one lock Redis, or one per ``redislock_urls`` node), one set per process: a process
forked after they were made gets its own.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import redis

from .._process import ProcessRegistry
from ..settings import LockSettings

log = logging.getLogger(__name__)


_settings: weakref.WeakKeyDictionary[Any, LockSettings] = weakref.WeakKeyDictionary()
#: Per app, this process's client (a forked child makes its own).
_clients: ProcessRegistry[Any, redis.Redis] = ProcessRegistry()


def settings_for(app: Any) -> LockSettings:
    """The app's validated ``redislock_*`` settings (read once per app)."""
    found = _settings.get(app)
    if found is None:
        found = _settings[app] = LockSettings.from_conf(app.conf)
        log.debug("redislock: using Redis from %s", found.url_source)
    return found


def client_for(app: Any) -> redis.Redis:
    """The Redis client for the app's locks, one per process (new after a fork)."""
    found = _clients.peek(app)
    if found is None:  # (built outside the registry's mutex: reading settings may log)
        settings = settings_for(app)
        found = _clients.get(app, lambda: redis.Redis.from_url(settings.url, **_options(settings)))
    return found


#: Per app, this process's clients of the ``redislock_urls`` nodes.
_quorum_clients: ProcessRegistry[Any, list[redis.Redis]] = ProcessRegistry()


def quorum_clients_for(app: Any) -> list[redis.Redis]:
    """One client per ``redislock_urls`` node, one set per process (new after a fork)."""
    found = _quorum_clients.peek(app)
    if found is None:
        settings = settings_for(app)
        options = _options(settings)
        found = _quorum_clients.get(
            app, lambda: [redis.Redis.from_url(url, **options) for url in settings.urls]
        )
    return found


def _options(settings: LockSettings) -> dict[str, Any]:
    """The options of the app's clients: bounded by default, the app's own on top."""
    options: dict[str, Any] = {
        "socket_timeout": 10.0,
        "socket_connect_timeout": 10.0,
        "health_check_interval": 30,
    }
    options.update(settings.redis_options)
    return options
