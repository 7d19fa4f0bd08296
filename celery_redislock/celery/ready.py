"""``SKIPPED`` and ``SUPERSEDED`` as Celery *ready* states.

A call skipped (``on_contention="skip"``) or superseded (``on_contention="replace"``,
``lock_debounce``) never runs: its result state is the end of it. Celery has no API to
declare a custom state final, and knows only ``SUCCESS``, ``FAILURE`` and ``REVOKED`` as
ready: ``AsyncResult.get()`` on any other state waits for ever, ``ready()`` is False, and a
group holding such a call never joins. :func:`install_ready_states` adds the two states to
the ready states in every place Celery reads them:

* ``celery.states.READY_STATES`` (a module global, read at call time by
  ``AsyncResult.get`` / ``_maybe_set_cache``, the result consumers of the Redis and RPC
  backends, ``Backend.wait_for`` of the polling backends, the worker's revoke, events);
* ``celery.backends.base.Backend.READY_STATES`` (a class attribute: ``AsyncResult.ready``,
  ``date_done`` of a stored result);
* the ``READY_STATES`` default argument Celery's backend methods captured when
  ``celery.backends.base`` was imported (``_filter_ready``, ``_mget_to_results``,
  ``get_many``: group ``join_native``, ``GroupResult.get``).

It is called once when the Celery layer (:mod:`celery_redislock.celery`) is first imported
(any ``LockedTask`` import does, and ``import celery_redislock`` after Celery), and is
idempotent. Every built-in ready state is kept; the exception and propagate states are not
touched, so ``.get()`` *returns* the stored meta of such a call (it does not raise):
``{"lock": name}`` for ``SKIPPED``, ``{"lock": name, "superseded_by": <task id or None>}``
for ``SUPERSEDED``.
"""

from __future__ import annotations

import inspect
from typing import Any

from celery import states
from celery.backends import base as backend_base

from .contention import SKIPPED
from .latest import SUPERSEDED

#: The states this package adds to Celery's ready states.
LOCK_READY_STATES = frozenset({SKIPPED, SUPERSEDED})
#: Celery's own ready states (``SUCCESS``, ``FAILURE``, ``REVOKED``), without ours.
CELERY_READY_STATES = frozenset(states.READY_STATES - LOCK_READY_STATES)
#: The parameter name under which Celery's backend methods capture the ready states.
_PARAMETER = "READY_STATES"


def _extended(value: Any) -> Any:
    """``value`` with :data:`LOCK_READY_STATES` added (itself when it has them)."""
    if value >= LOCK_READY_STATES:
        return value
    return frozenset(value) | LOCK_READY_STATES


def _defaults(member: Any) -> tuple[Any, dict[str, Any]]:
    """The function of ``member`` (a function, static or class method; else None) and its
    default arguments by parameter name."""
    function = getattr(member, "__func__", member)
    code = getattr(function, "__code__", None)
    if code is None:
        return None, {}
    defaults = getattr(function, "__defaults__", None) or ()
    positional = code.co_varnames[: code.co_argcount]
    found = dict(zip(positional[len(positional) - len(defaults) :], defaults, strict=True))
    found.update(getattr(function, "__kwdefaults__", None) or {})
    return function, found


def _members(module: Any) -> list[tuple[str, Any]]:
    """The functions of ``module`` and its classes' members, by (``Class.``)name."""
    found: list[tuple[str, Any]] = []
    for name, value in vars(module).items():
        if getattr(value, "__module__", None) != module.__name__:
            continue  # imported from elsewhere (its own module is looked at there)
        if inspect.isclass(value):
            found.extend((f"{name}.{attr}", member) for attr, member in vars(value).items())
        else:
            found.append((name, value))
    return found


def captured_ready_states(module: Any) -> dict[str, Any]:
    """The ``READY_STATES`` default arguments of ``module``'s functions and of its classes'
    methods, by (``Class.``)name."""
    found = {}
    for name, member in _members(module):
        defaults = _defaults(member)[1]
        if _PARAMETER in defaults:
            found[name] = defaults[_PARAMETER]
    return found


def _extend_defaults(member: Any) -> None:
    """Extend the ``READY_STATES`` default argument of ``member``, if it has one."""
    function, defaults = _defaults(member)
    if _PARAMETER not in defaults:
        return
    kwdefaults = getattr(function, "__kwdefaults__", None)
    if kwdefaults and _PARAMETER in kwdefaults:
        kwdefaults[_PARAMETER] = _extended(kwdefaults[_PARAMETER])
        return
    code = function.__code__
    positional = code.co_varnames[: code.co_argcount]
    names = positional[len(positional) - len(function.__defaults__) :]
    function.__defaults__ = tuple(
        _extended(value) if name == _PARAMETER else value
        for name, value in zip(names, function.__defaults__, strict=True)
    )


def install_ready_states() -> None:
    """Make ``SKIPPED`` and ``SUPERSEDED`` ready states of Celery, in this process
    (idempotent; every built-in ready state kept)."""
    states.READY_STATES = _extended(states.READY_STATES)
    backend = backend_base.Backend
    backend.READY_STATES = _extended(backend.READY_STATES)
    for _name, member in _members(backend_base):
        _extend_defaults(member)
