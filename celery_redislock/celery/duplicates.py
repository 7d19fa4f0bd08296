"""A delivery of a run that has already finished (its done marker is in the locks' Redis)
is not run again, wherever it is found out.

A pool process finds it out with the run's acquire (``acquire.lua`` answers "done"). The
worker's main process finds it out at delivery, before any pool process is taken, for:

- a **fallback copy back from its RabbitMQ delay queue** (``contention.delay_queue``:
  RabbitMQ's dead-letter headers say so): a parked task's copy comes back after its
  delay, most often long after the hand-over ran the task. Dispatched, each one cost a
  pool process's whole round of Celery's per-message work to be found done; here it costs
  the main loop one ``EXISTS`` of the run's done marker;
- any message the check at delivery (``parking``) parks behind a holder and the park
  script finds done (a duplicate of a finished run while its key is busy).

Either way the message is logged and signalled as a pool process would (``task_duplicate``,
from the main process there, with the request a pool process would have run it with as
the task's request: receivers, the series' ``queue_name`` among them, read it there), then
acknowledged without running. The done marker is read with the same trust as the
acquire's (docs/security.md): whoever may write the lock keys can make a run look
finished, to a pool process as to the main process.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import signals
from ..settings import LockOptions
from .contention import DEAD_LETTER_HEADERS, _request
from .tasklock import PARKABLE, request_owner

log = logging.getLogger(__name__)


def ignored(task: Any, name: str, task_id: Any, *, message: Any = None) -> None:
    """Log and signal a delivery of a finished run of ``task`` under lock ``name``, which the
    caller drops (a pool process: ``Ignore``; the main process: it acks the message).

    ``message``: the broker's message, where the worker's main process drops it: the
    request a pool process would have run it with (``contention._request``) is the task's
    request while the signal is sent (there is none there otherwise: a receiver would
    find no id, queue or headers)."""
    log.info(
        "redislock: %s[%s] already finished under %r; duplicate delivery ignored%s",
        task.name,
        task_id,
        name,
        "" if message is None else " at delivery",
    )
    if message is None:
        signals.task_duplicate.send(task, name=name, task_id=task_id)
        return
    args, kwargs, embed = message.decode()  # (kombu keeps the decoded body: no second decoding)
    task.request_stack.push(_request(message, message.headers or {}, args, kwargs, embed))
    try:
        signals.task_duplicate.send(task, name=name, task_id=task_id)
    finally:
        task.request_stack.pop()


def finished_copy(task: Any, message: Any, headers: dict[str, Any], options: LockOptions) -> bool:
    """Whether ``message`` (of ``task``, a ``LockedTask``) is a copy back from a delay queue
    (``x-death``) of a run that has finished: then it is :func:`ignored` (the caller acks
    it). One round trip, for dead-lettered messages only; a bad body raises (the caller
    delivers the message: its pool process fails it as before)."""
    if DEAD_LETTER_HEADERS[0] not in headers:
        return False
    args, kwargs, _embed = message.decode()
    lock = task.run_lock(args, kwargs, request_owner(headers), options)
    if not isinstance(lock, PARKABLE) or not lock.client.exists(lock.done_key):
        return False
    ignored(task, str(lock.name), headers.get("id"), message=message)
    return True
