"""A task's lock options, read from its class when the task is decorated: validated
(errors name the task and the option), merged into the overrides its runs use, and its key
templates (``lock_key``, ``lock_rate_key``) built against its ``run``'s signature.

The values themselves are checked by :func:`celery_redislock.settings.task_overrides`, as
the app's ``redislock_*`` settings are; :class:`~celery_redislock.LockedTask` calls
:func:`configure` from ``__init_subclass__``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from .._errors import LockConfigurationError
from ..keys import KeyTemplate
from ..settings import APP_SETTING, LockOptions, check_latest, task_overrides


def configure(cls: Any, run: Any, option_names: Iterable[str]) -> None:
    """Read and check the lock options of the task class ``cls`` (whose ``run`` is
    ``run``): set its ``_lock_overrides``, ``_lock_template`` and ``_rate_template``.

    ``option_names``: the ``lock_*`` attributes a task may set (``LockedTask``'s).

    Raises:
        LockConfigurationError: an option is invalid; the message names task and option.
    """

    name = str(cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}")
    attributes = {attr: getattr(cls, attr, None) for attr in option_names}
    attributes["on_contention"] = cls.on_contention
    unlocked = cls.lock_limit is None
    if cls.lock_limit is APP_SETTING:
        attributes["lock_limit"] = None
    overrides = task_overrides(attributes, name)
    if unlocked:
        if cls.lock_rate is None:
            raise LockConfigurationError(
                f"task {name!r}: lock_limit=None means no lock (a rate only), but the "
                f"task sets no lock_rate: set lock_rate, or lock_limit to an int"
            )
        overrides["locked"] = False
    cls._lock_overrides = overrides
    check_latest(LockOptions().merged(overrides), f"task {name!r}", own=overrides)
    if not isinstance(cls.lock_key_hash, bool):
        raise LockConfigurationError(
            f"task {name!r}: lock_key_hash must be True or False, got {cls.lock_key_hash!r}"
        )
    if isinstance(run, staticmethod):
        signature_of: Any = run.__func__
    else:  # bind=True: the first parameter is the task itself
        signature_of = functools.partial(run, None)
    cls._lock_template = KeyTemplate(
        cls.lock_key, signature_of, owner_name=name, option="lock_key", hashed=cls.lock_key_hash
    )
    if cls.lock_rate_key is None:
        cls._rate_template = cls._lock_template
    elif not isinstance(cls.lock_rate_key, str) and not callable(cls.lock_rate_key):
        raise LockConfigurationError(
            f"task {name!r}: lock_rate_key must be None (the lock_key), a template str "
            f"such as 'merchant:{{merchant_id}}', or a callable (args, kwargs) -> str; "
            f"got {cls.lock_rate_key!r}"
        )
    else:
        cls._rate_template = KeyTemplate(
            cls.lock_rate_key,
            signature_of,
            owner_name=name,
            option="lock_rate_key",
            hashed=cls.lock_key_hash,
        )
