"""Moved: parking at delivery now lives in :mod:`celery_redislock.celery.parking`.

This module re-exports its names, so that ``celery_redislock.parking:strategy`` (the
``Strategy`` of tasks made before the move) keeps working.
"""

from __future__ import annotations

from .celery.parking import Parker as Parker
from .celery.parking import _parked_as as _parked_as
from .celery.parking import _same_redis as _same_redis
from .celery.parking import _writable as _writable
from .celery.parking import accept_handed_over as accept_handed_over
from .celery.parking import strategy as strategy
