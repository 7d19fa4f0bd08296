"""Per-process state, and the one fork rule.

What belongs to one process (threads, sockets, subscribers, watchdogs, executors,
counts not yet flushed, clients made for it) is kept here, never in a plain module
global: a forked child must not use its parent's connections or wait on threads that did
not come along. One ``os.register_at_fork`` hook, below, makes every such thing new in
the child:

* :class:`ProcessLocal` (one value) and :class:`ProcessRegistry` (a value per key) are
  emptied; the child builds its own on first use;
* :func:`on_fork` callbacks run, for objects others keep a reference to (``metrics.STATS``,
  the abandoned waits): they reset themselves in place.

An object stamped with :func:`current` when it was made (a hold, a cached watchdog)
tells whether it was made in this process: :func:`is_current`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Generic, Iterator, TypeVar

__all__ = ["ProcessLocal", "ProcessRegistry", "current", "is_current", "on_fork"]

log = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
F = TypeVar("F", bound=Callable[[], object])

#: This process's stamp: its id as of the last fork (renewed by the hook, not read from
#: the system at every check).
_current = os.getpid()
_locals: list[ProcessLocal[Any] | ProcessRegistry[Any, Any]] = []
_callbacks: list[Callable[[], object]] = []


def current() -> int:
    """The stamp of this process (its pid): different in every forked child."""
    return _current


def is_current(stamp: int) -> bool:
    """Whether ``stamp`` (a :func:`current` value) was taken in this process."""
    return stamp == _current


def on_fork(callback: F) -> F:
    """Run ``callback`` in every forked child (after the process-local values are gone);
    for state that must stay the same object, reset in place. Usable as a decorator."""
    _callbacks.append(callback)
    return callback


class ProcessLocal(Generic[T]):
    """One value per process, built by ``factory`` on first use (a forked child builds its
    own: it never sees its parent's)."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._forget()
        _locals.append(self)

    def _forget(self) -> None:
        self._mutex = threading.Lock()
        self._value: T | None = None
        self._built = False

    def get(self) -> T:
        """This process's value (built now if it has none yet)."""
        if not self._built:
            with self._mutex:
                if not self._built:
                    self._value = self._factory()
                    self._built = True
        return self._value  # type: ignore[return-value]

    def peek(self) -> T | None:
        """This process's value if it was built, else None (nothing is built)."""
        return self._value if self._built else None


class ProcessRegistry(Generic[K, V]):
    """A value per key and process, built on first use under the registry's mutex (a
    forked child starts empty). Keys are held weakly unless ``weak`` is False: a key that
    is gone (a connection pool, an app, an event loop) takes its value with it."""

    def __init__(self, *, weak: bool = True) -> None:
        self._weak = weak
        self._forget()
        _locals.append(self)

    def _forget(self) -> None:
        self._mutex = threading.Lock()
        self._values: dict[K, V] | weakref.WeakKeyDictionary[K, V] = (
            weakref.WeakKeyDictionary() if self._weak else {}
        )

    def get(self, key: K, build: Callable[[], V]) -> V:
        """The value of ``key`` in this process: built by ``build`` if there is none."""
        with self._mutex:
            found = self._values.get(key)
            if found is None:
                found = self._values[key] = build()
            return found

    def peek(self, key: K) -> V | None:
        """The value of ``key`` if this process has one (nothing is built)."""
        return self._values.get(key)

    def items(self) -> Iterator[tuple[K, V]]:
        """This process's (key, value) pairs, as they are now."""
        with self._mutex:
            return iter(list(self._values.items()))


def _after_fork_in_child() -> None:
    global _current
    _current = os.getpid()
    for local in _locals:
        local._forget()
    for callback in _callbacks:
        try:
            callback()
        except Exception:  # one callback's failure must not leave the others' state shared
            log.exception("redislock: a fork callback failed: %r", callback)


os.register_at_fork(after_in_child=_after_fork_in_child)
