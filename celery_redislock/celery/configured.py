"""Locking by configuration: the ``redislock_tasks`` setting.

Tasks that cannot take ``base=LockedTask`` (they come from a library, or already have a
base of their own) get the same lock from the app's configuration::

    import celery_redislock  # after celery: registers the hook below

    app.conf.redislock_tasks = {
        "billing.tasks.settle": {"lock_key": "account:{account_id}"},
        "reports.*": {"lock_key": None, "on_contention": "skip", "lock_hold": 300},
    }

How
===

For each registered task matched by an entry (:func:`settings.task_rules`: exact names and
``*`` globs, the first matching entry wins), the task *instance* (``app.tasks[name]``, the
object every reference to the task points at) gets a new class:
``type(name, (LockedTask, OriginalClass), {"name": ..., "run": ..., **options})``. It is a
``LockedTask`` in every respect (the same ``__call__``, ``Request``, ``Strategy``, option
validation at creation), and the original class's methods still run: ``LockedTask``'s
methods call ``super()``, so a base's own ``__call__`` runs inside the lock, its
``on_failure``/``after_return``/``before_start`` hooks are untouched. A base with its own
worker ``Request`` class gets a ``Request`` combining ``LockedRequest`` with it; a base with
its own ``Strategy`` cannot be combined (an error).

When
====

* When an app is finalized (``app.on_after_finalize``): producers, eager mode
  (``task_always_eager``), direct calls. Tasks registered later (a module imported after
  the app was finalized) are configured as they are registered.
* Again when a worker starts (``worker_init``: after the worker imported its task modules,
  before the pool forks and before the consumer reads ``task.Request``/``task.Strategy``).
  A bad entry stops the worker there (``LockConfigurationError`` naming the setting, the
  pattern and the option); an entry that matches no task is logged as a warning.

In a process that is not a worker, a bad entry is logged as an error and every task it
matches refuses to run (its calls raise the error): a configured task never runs without
its lock. A task that already has ``base=LockedTask`` keeps its own options; an entry
matching it is ignored for it, with a warning.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

from celery import Task
from celery import signals as celery_signals
from celery._state import _get_active_apps, connect_on_app_finalize
from celery.worker.request import Request
from celery.worker.strategy import default as default_strategy
from kombu.utils.imports import symbol_by_name

from .._errors import LockConfigurationError
from ..settings import TaskRule, pattern_regex, task_patterns, task_rules
from .base import LockedTask, has_locked_tasks
from .worker import LockedRequest, _check_settings_at_worker_start

log = logging.getLogger(__name__)

SETTING = "redislock_tasks"


@dataclass
class Configured:
    """What :func:`configure_tasks` did to an app's tasks."""

    #: task name -> the pattern of the entry that configured it
    configured: dict[str, str] = field(default_factory=dict)
    #: patterns that match no registered task
    unmatched: list[str] = field(default_factory=list)
    #: task names (base=LockedTask already) -> the pattern that matched them (ignored)
    own_base: dict[str, str] = field(default_factory=dict)
    #: the errors, in order (a task named by one refuses to run)
    errors: list[LockConfigurationError] = field(default_factory=list)


def configure_tasks(app: Any) -> Configured:
    """Apply the app's ``redislock_tasks`` to its registered tasks now (idempotent).

    Called when the app is finalized and when a worker starts; call it yourself only for
    tasks registered in ways Celery does not announce. Never raises for a bad entry: the
    errors are returned (and the tasks they concern refuse to run).
    """
    outcome = Configured()
    rules, error = _rules(app)
    if error is not None:
        outcome.errors.append(error)
    used: set[str] = set()
    for name, task in list(app.tasks.items()):
        rule = _configure(app, name, task, rules, error, outcome)
        if rule is not None:
            used.add(rule.pattern)
    if error is None:
        outcome.unmatched = [rule.pattern for rule in rules if rule.pattern not in used]
    return outcome


def _rules(app: Any) -> tuple[tuple[TaskRule, ...], LockConfigurationError | None]:
    """The app's rules; or, if the setting is bad, its error and rules for its patterns
    (the tasks they match refuse to run)."""
    try:
        return task_rules(app.conf), None
    except LockConfigurationError as exc:
        patterns = task_patterns(app.conf.get(SETTING))
        return tuple(TaskRule(p, {}, pattern_regex(p)) for p in patterns), exc


def _configure(
    app: Any,
    name: str,
    task: Any,
    rules: tuple[TaskRule, ...],
    error: LockConfigurationError | None,
    outcome: Configured,
) -> TaskRule | None:
    """Give ``task`` the class of the first rule matching it; the rule, or None. With
    ``error`` (the setting is bad), a matching task gets a class refusing to run."""
    if not isinstance(task, Task):
        return None
    rule = next((rule for rule in rules if rule.matches(name)), None)
    current = type(task)
    original = current.__dict__.get("_redislock_original", current)
    if rule is None:
        if original is not current and error is None:  # its entry was removed: its own
            task.__class__ = original  # class again (a bad setting never unlocks a task)
        return None
    if issubclass(original, LockedTask):
        outcome.own_base[name] = rule.pattern
        _warn_own_base(app, name, rule.pattern)
        return rule
    if not original.__bound__:
        # Registered after finalization: Celery binds the task only after this swap, so
        # its bound state (request stack, annotations, config defaults) would land on the
        # swapped class and be lost by a later swap. Bind its own class first.
        original.bind(app)
    if error is not None:  # no rule to remember: the fixed setting's rule must apply
        task.__class__ = _refusing_class(original, None, error)
        return rule
    if current.__dict__.get("_redislock_rule") == rule:
        if current.__dict__.get("_redislock_error") is not None:
            outcome.errors.append(current._redislock_error)
        else:
            outcome.configured[name] = rule.pattern
        return rule
    try:
        task.__class__ = locked_class(original, name, rule)
        outcome.configured[name] = rule.pattern
    except LockConfigurationError as exc:
        outcome.errors.append(exc)
        task.__class__ = _refusing_class(original, rule, exc)
    return rule


def locked_class(original: type, name: str, rule: TaskRule) -> type:
    """The class of task ``name`` (of class ``original``) under ``rule``: a ``LockedTask``
    subclass of ``original``. Raises LockConfigurationError naming the setting, the
    pattern, the task and the option."""
    where = f"{SETTING}[{rule.pattern!r}]"
    run = _run_of(original)
    if run is None:
        raise LockConfigurationError(f"{where}: task {name!r} has no run method to lock")
    namespace: dict[str, Any] = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
        "name": name,
        "run": run,
        "_redislock_original": original,
        "_redislock_rule": rule,
        **rule.options,
    }
    annotations = vars(original).get("__annotations__")  # Celery's, from the function
    if annotations is not None:
        namespace["__annotations__"] = annotations
    request = _request_for(original, where, name)
    if request is not None:
        namespace["Request"] = request
    _check_strategy(original, where, name)
    try:
        return type(original.__name__, (LockedTask, original), namespace)
    except LockConfigurationError as exc:  # LockedTask's own checks, naming task and option
        raise LockConfigurationError(f"{where}: {exc}") from None
    except Exception as exc:  # no consistent MRO, a layout conflict, the base's own
        # __init_subclass__ or metaclass refusing the subclass: never left unlocked
        raise LockConfigurationError(
            f"{where}: task {name!r}: its class {original.__qualname__} cannot be combined "
            f"with LockedTask ({type(exc).__name__}: {exc})"
        ) from None


def _run_of(original: type) -> Any:
    """``run`` as the task's class defines it (a staticmethod for ``bind=False``)."""
    for klass in original.__mro__:
        if klass is Task:
            return None
        if "run" in klass.__dict__:
            return klass.__dict__["run"]
    return None


_combined_requests: dict[type, type] = {}


def _request_for(original: type, where: str, name: str) -> Any:
    """The worker ``Request`` class for a configured task: LockedTask's, or, if the task's
    base has a ``Request`` of its own, one combining ``LockedRequest`` with it (None:
    LockedTask's)."""
    spec = getattr(original, "Request", None)
    if spec is None:
        return None
    try:
        found = symbol_by_name(spec)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise LockConfigurationError(
            f"{where}: task {name!r}: its Request {spec!r} cannot be imported ({exc})"
        ) from None
    if not isinstance(found, type) or found is Request:
        return None
    if issubclass(found, LockedRequest):
        return found
    if not issubclass(found, Request):
        raise LockConfigurationError(
            f"{where}: task {name!r}: its Request {spec!r} is not a celery Request class"
        )
    combined = _combined_requests.get(found)
    if combined is None:
        combined = type(f"Locked{found.__name__}", (LockedRequest, found), {"__module__": __name__})
        _combined_requests[found] = combined
    return combined


def _check_strategy(original: type, where: str, name: str) -> None:
    spec = getattr(original, "Strategy", None)
    if spec in (None, Task.Strategy, LockedTask.Strategy):
        return
    try:
        found = symbol_by_name(spec)  # type: ignore[no-untyped-call]
    except Exception:
        found = None
    if found is default_strategy:
        return
    raise LockConfigurationError(
        f"{where}: task {name!r}: its base sets a Strategy of its own ({spec!r}), which "
        f"cannot be combined with LockedTask's parking strategy"
    )


def _refusing_class(original: type, rule: TaskRule | None, error: LockConfigurationError) -> type:
    """A class for a task whose entry is bad: every call raises the error (never unlocked)."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise LockConfigurationError(str(error))

    namespace = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
        "__call__": __call__,
        "_redislock_original": original,
        "_redislock_rule": rule,
        "_redislock_error": error,
    }
    return type(original.__name__, (original,), namespace)


_warned: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _warn_own_base(app: Any, name: str, pattern: str) -> None:
    warned = _warned.setdefault(app, set())
    if name in warned:
        return
    warned.add(name)
    log.warning(
        "redislock: task %r matches %s entry %r but has base=LockedTask already: its own "
        "lock options apply, the entry is ignored for it",
        name,
        SETTING,
        pattern,
    )


# ------------------------------------------------------------------ when


def _log_errors(outcome: Configured) -> None:
    for exc in outcome.errors:
        log.error("celery_redislock: %s (the tasks it names refuse to run)", exc)


def _after_finalize(sender: Any = None, **_: Any) -> None:
    app = sender
    if app is None or app.conf.get(SETTING) is None:
        return
    _log_errors(configure_tasks(app))
    _watch_registrations(app)


def _on_app_finalize(app: Any) -> None:
    """Every app, as it is finalized: configure its tasks once they are all registered."""
    app.on_after_finalize.connect(_after_finalize, weak=False, dispatch_uid="redislock_tasks")


class _Registering:
    """Mixed into an app's task registry (``app._tasks``) after it is finalized: a task
    registered later (a module imported after the finalization) is configured at once."""

    _redislock_app: Any

    def __setitem__(self, name: str, task: Any) -> None:
        super().__setitem__(name, task)  # type: ignore[misc]
        app = self._redislock_app()
        if app is None:
            return
        rules, error = _rules(app)
        outcome = Configured()
        _configure(app, name, task, rules, error, outcome)
        _log_errors(outcome)


_registries: dict[type, type] = {}


def _watch_registrations(app: Any) -> None:
    registry = app._tasks
    kind = type(registry)
    if isinstance(registry, _Registering) or not issubclass(kind, dict):
        return
    watching = _registries.get(kind)
    if watching is None:
        watching = _registries[kind] = type(kind.__name__, (_Registering, kind), {})
    try:
        registry.__class__ = watching
        registry._redislock_app = weakref.ref(app)
    except TypeError:  # a registry whose class cannot be swapped: worker start still applies
        log.debug("redislock: cannot watch %r for new tasks", registry)


def _at_worker_start(sender: Any = None, **_: Any) -> None:
    """Before the worker consumes anything: configure its tasks, or stop it."""
    app = getattr(sender, "app", None)
    if app is None or app.conf.get(SETTING) is None:
        return
    had_locked = has_locked_tasks(app)
    try:
        outcome = configure_tasks(app)
    except Exception as failure:  # Celery would log and swallow it: the worker would run
        log.critical("celery_redislock: %s could not be applied", SETTING, exc_info=True)
        raise SystemExit(
            f"celery_redislock: {SETTING} could not be applied ({failure!r})"
        ) from None
    if outcome.errors:
        for exc in outcome.errors:
            log.critical("celery_redislock: %s", exc)
        # Celery logs and swallows Exceptions from signal receivers; SystemExit stops the
        # worker here, before it takes a single task.
        raise SystemExit(f"celery_redislock: {outcome.errors[0]}")
    for pattern in outcome.unmatched:
        log.warning(
            "redislock: %s entry %r matches no registered task (check the task names)",
            SETTING,
            pattern,
        )
    if outcome.configured:
        log.info(
            "redislock: locked by %s: %s",
            SETTING,
            ", ".join(f"{name} ({entry})" for name, entry in sorted(outcome.configured.items())),
        )
        if not had_locked:  # task.py's own check ran before and found no LockedTask
            _check_settings_at_worker_start(sender)


def _install() -> None:
    connect_on_app_finalize(_on_app_finalize)
    # Connected after task.py's receiver (imported above): that one runs first.
    celery_signals.worker_init.connect(_at_worker_start, weak=False)
    for app in list(_get_active_apps()):  # apps finalized before this module was imported
        if app.finalized:
            _after_finalize(app)


_install()
