"""Moved: the Celery integration now lives in :mod:`celery_redislock.celery`, one module
per job (its docstring has the map); ``LockedTask`` and its usage guide are in
:mod:`celery_redislock.celery.base`.

This module re-exports the names it used to define, so that ``celery_redislock.task:X``
paths (``LockedTask``, ``LockedRequest``, ...) keep working. New code imports
``LockedTask`` from :mod:`celery_redislock`.
"""

from __future__ import annotations

from .celery.base import LockedTask as LockedTask
from .celery.clients import _clients as _clients
from .celery.clients import _quorum_clients as _quorum_clients
from .celery.clients import _settings as _settings
from .celery.clients import client_for as client_for
from .celery.clients import quorum_clients_for as quorum_clients_for
from .celery.clients import settings_for as settings_for
from .celery.contention import REQUEUE_HEADER as REQUEUE_HEADER
from .celery.contention import SKIPPED as SKIPPED
from .celery.contention import _Call as _Call
from .celery.contention import _park_fallback as _park_fallback
from .celery.contention import _rng as _rng
from .celery.contention import _visibility_timeout as _visibility_timeout
from .celery.direct import _current_execution as _current_execution
from .celery.envelope import _PRIORITY_SEP as _PRIORITY_SEP
from .celery.envelope import ENVELOPE as ENVELOPE
from .celery.envelope import TAG_PREFIX as TAG_PREFIX
from .celery.envelope import LockKeysFor as LockKeysFor
from .celery.envelope import _bytes as _bytes
from .celery.envelope import _dumps as _dumps
from .celery.envelope import _Handed as _Handed
from .celery.envelope import _handed as _handed
from .celery.envelope import _loads as _loads
from .celery.envelope import _push_targets as _push_targets
from .celery.envelope import _text as _text
from .celery.envelope import envelope_entry as envelope_entry
from .celery.envelope import envelope_lock_key as envelope_lock_key
from .celery.envelope import push_targets as push_targets
from .celery.finish import _claim_kept_hold as _claim_kept_hold
from .celery.finish import _finish_later as _finish_later
from .celery.finish import _finish_quietly as _finish_quietly
from .celery.finish import _kept_hold_marker as _kept_hold_marker
from .celery.finish import _mark_kept_hold as _mark_kept_hold
from .celery.finish import _nesting as _nesting
from .celery.handover import MAX_REFUSALS as MAX_REFUSALS
from .celery.handover import _check_parked_under as _check_parked_under
from .celery.handover import _checked as _checked
from .celery.handover import _checked_envelope as _checked_envelope
from .celery.handover import _report_refused as _report_refused
from .celery.handover import deliver_handed_over as deliver_handed_over
from .celery.handover import handoff_queue as handoff_queue
from .celery.handover import publish_to_handoff_queue as publish_to_handoff_queue
from .celery.handover import refuse_handed_over as refuse_handed_over
from .celery.lookahead import LOOKAHEAD_BYTES as LOOKAHEAD_BYTES
from .celery.lookahead import LOOKAHEAD_CACHE as LOOKAHEAD_CACHE
from .celery.lookahead import LOOKAHEAD_CHUNK as LOOKAHEAD_CHUNK
from .celery.lookahead import LOOKAHEAD_HEADER as LOOKAHEAD_HEADER
from .celery.lookahead import QUEUE_REACH as QUEUE_REACH
from .celery.lookahead import _lock_key_of as _lock_key_of
from .celery.lookahead import _lock_of as _lock_of
from .celery.lookahead import _lookahead_denied as _lookahead_denied
from .celery.lookahead import _lookahead_thread as _lookahead_thread
from .celery.lookahead import _next_queued as _next_queued
from .celery.lookahead import _Pull as _Pull
from .celery.lookahead import _search_queue as _search_queue
from .celery.lookahead import lookahead_chain as lookahead_chain
from .celery.sweeper import Sweeper as Sweeper
from .celery.sweeper import _sweepers as _sweepers
from .celery.tasklock import AnyTaskLock as AnyTaskLock
from .celery.tasklock import QuorumTaskLock as QuorumTaskLock
from .celery.tasklock import TaskLock as TaskLock
from .celery.tasklock import _task_argv as _task_argv
from .celery.tasklock import request_owner as request_owner
from .celery.tasklock import run_owner as run_owner
from .celery.tasklock import task_lock as task_lock
from .celery.worker import _CHILD_DIED as _CHILD_DIED
from .celery.worker import LockedRequest as LockedRequest
from .celery.worker import _check_settings_at_worker_start as _check_settings_at_worker_start
from .celery.worker import _consume_handoff_queues as _consume_handoff_queues
from .celery.worker import _flush_stats_at_exit as _flush_stats_at_exit
from .celery.worker import _has_password as _has_password
from .celery.worker import _start_sweeper as _start_sweeper
from .celery.worker import _stop_sweeper as _stop_sweeper
