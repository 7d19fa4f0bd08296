"""Moved: the MACs of parked messages now live in :mod:`celery_redislock.celery.signing`
(``derive_key``, the default key, in :mod:`celery_redislock.settings`).

This module re-exports their names.
"""

from __future__ import annotations

from .celery.signing import _MAC_CHARS as _MAC_CHARS
from .celery.signing import _RUN_SUFFIX as _RUN_SUFFIX
from .celery.signing import PARKED_HEADER as PARKED_HEADER
from .celery.signing import SIGNED as SIGNED
from .celery.signing import Refused as Refused
from .celery.signing import _mac as _mac
from .celery.signing import _signed_form as _signed_form
from .celery.signing import check_envelope as check_envelope
from .celery.signing import open_signature as open_signature
from .celery.signing import sign_envelope as sign_envelope
from .celery.signing import sign_signature as sign_signature
from .celery.signing import task_id_of as task_id_of
from .settings import _DERIVE as _DERIVE
from .settings import derive_key as derive_key
