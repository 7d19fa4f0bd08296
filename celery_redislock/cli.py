"""Moved: ``celery -A proj redislock`` now lives in :mod:`celery_redislock.celery.cli`
(its nodes in ``.cli_nodes``, its printers in ``.cli_print``).

This module re-exports its names, so that ``celery_redislock.cli:redislock`` (the entry
point of an installation made before the move) keeps working.
"""

from __future__ import annotations

from .celery.cli import _glob as _glob
from .celery.cli import _lock_name as _lock_name
from .celery.cli import _prefix as _prefix
from .celery.cli import list_locks as list_locks
from .celery.cli import prefix_option as prefix_option
from .celery.cli import redislock as redislock
from .celery.cli import release as release
from .celery.cli import show as show
from .celery.cli import stats as stats
from .celery.cli_nodes import _merged as _merged
from .celery.cli_nodes import _Nodes as _Nodes
from .celery.cli_print import _owner_text as _owner_text
from .celery.cli_print import _print_lock as _print_lock
from .celery.cli_print import _shown as _shown
from .celery.inspection import describe_lock, text

_describe = describe_lock  # (their names before the move)
_text = text
