"""Per-app state: an app's ``redislock_*`` settings, read once, and its Redis clients
(the one lock Redis, or one per ``redislock_urls`` node), one set per process: a process
forked after they were made gets its own.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import redis

from ..settings import LockSettings

log = logging.getLogger(__name__)


_settings: weakref.WeakKeyDictionary[Any, LockSettings] = weakref.WeakKeyDictionary()
_clients: weakref.WeakKeyDictionary[Any, tuple[int, redis.Redis]] = weakref.WeakKeyDictionary()


def settings_for(app: Any) -> LockSettings:
    """The app's validated ``redislock_*`` settings (read once per app)."""
    found = _settings.get(app)
    if found is None:
        found = _settings[app] = LockSettings.from_conf(app.conf)
        log.debug("redislock: using Redis from %s", found.url_source)
    return found


def client_for(app: Any) -> redis.Redis:
    """The Redis client for the app's locks, one per process (new after a fork)."""
    found = _clients.get(app)
    if found is None or found[0] != os.getpid():
        settings = settings_for(app)
        options = {
            "socket_timeout": 10.0,
            "socket_connect_timeout": 10.0,
            "health_check_interval": 30,
        }
        options.update(settings.redis_options)
        found = _clients[app] = (os.getpid(), redis.Redis.from_url(settings.url, **options))
    return found[1]


_quorum_clients: weakref.WeakKeyDictionary[Any, tuple[int, list[redis.Redis]]]
_quorum_clients = weakref.WeakKeyDictionary()


def quorum_clients_for(app: Any) -> list[redis.Redis]:
    """One client per ``redislock_urls`` node, one set per process (new after a fork)."""
    found = _quorum_clients.get(app)
    if found is None or found[0] != os.getpid():
        settings = settings_for(app)
        options: dict[str, Any] = {
            "socket_timeout": 10.0,
            "socket_connect_timeout": 10.0,
            "health_check_interval": 30,
        }
        options.update(settings.redis_options)
        clients = [redis.Redis.from_url(url, **options) for url in settings.urls]
        found = _quorum_clients[app] = (os.getpid(), clients)
    return found[1]
