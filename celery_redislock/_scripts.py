"""The Lua scripts (one ``.lua`` file per operation, shipped as package data).

Each script is registered per client with ``register_script`` (EVALSHA, reloading
the script when the server answers NOSCRIPT), so a call is one round trip.
"""

from __future__ import annotations

import functools
import weakref
from importlib import resources
from typing import Any

SCRIPT_NAMES = ("acquire", "release", "renew", "fence", "park", "handoff", "sweep")


@functools.cache
def source(name: str) -> str:
    return (resources.files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


class Scripts:
    """The registered scripts of one client (sync or asyncio; redis-py picks the kind)."""

    def __init__(self, client: Any) -> None:
        self.acquire = client.register_script(source("acquire"))
        self.release = client.register_script(source("release"))
        self.renew = client.register_script(source("renew"))
        self.fence = client.register_script(source("fence"))
        self.park = client.register_script(source("park"))
        self.handoff = client.register_script(source("handoff"))
        self.sweep = client.register_script(source("sweep"))


_registered: weakref.WeakKeyDictionary[Any, Scripts] = weakref.WeakKeyDictionary()


def scripts_for(client: Any) -> Scripts:
    found = _registered.get(client)
    if found is None:
        found = _registered[client] = Scripts(client)
    return found
