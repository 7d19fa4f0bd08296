"""Remote control of the hand-over queues: a task queue ``q`` added to a worker by
``celery control add_consumer q`` brings ``q.redislock`` along (as the worker's start
does for its queues), ``cancel_consumer q`` stops both, and the hand-over queues are
added, cancelled and listed (``inspect active_queues``) where they are consumed: on the
hand-over channel's consumer (``handoff_channel``, RabbitMQ) when the worker has one,
else on Celery's task consumer.

A worker that had no hand-over queue at its consumer's last start (it consumed no queue:
``-X`` of every one, or ``cancel_consumer`` of each, then a reconnect) has no hand-over
consumer: the first hand-over queue added then gets one, set up by the hand-over
channel's own step as at a start (:func:`_own_consumer_for`), not a place on Celery's
task consumer, whose prefetch window would then count its handed tasks.

Celery's commands call the worker consumer's ``add_task_queue`` / ``cancel_task_queue``
and list its task consumer's queues; :func:`take_queues_along` wraps the two methods of
one consumer, :func:`list_handoff_queues` the listing (once per process).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import control

from .._keyspace import HANDOFF_QUEUE_SUFFIX, handoff_queue
from .base import has_locked_tasks

log = logging.getLogger(__name__)


def take_queues_along(c: Any) -> None:
    """Wrap the worker consumer ``c``'s ``add_task_queue`` and ``cancel_task_queue``: a
    task queue's hand-over queue goes along, and a hand-over queue is added to or
    cancelled on ``c.redislock_handoff_consumer`` when it is set."""
    add, cancel = c.add_task_queue, c.cancel_task_queue

    def add_task_queue(queue: str, *args: Any, **kwargs: Any) -> None:
        if not queue.endswith(HANDOFF_QUEUE_SUFFIX):
            add(queue, *args, **kwargs)
            if not has_locked_tasks(c.app):
                return
            queue, args, kwargs = handoff_queue(queue), (), {}
        own = getattr(c, "redislock_handoff_consumer", None)
        if own is None:
            if not _own_consumer_for(c, queue):
                add(queue, *args, **kwargs)
                return
        elif own.consuming_from(queue):
            return
        else:
            queues = c.app.amqp.queues
            own.add_queue(queues.select_add(queues.get(queue, queue)))
            own.consume()
        log.info("redislock: started consuming from %s on the hand-over channel", queue)

    def cancel_task_queue(queue: str) -> None:
        names = [queue]
        if not queue.endswith(HANDOFF_QUEUE_SUFFIX) and has_locked_tasks(c.app):
            names.append(handoff_queue(queue))
        for name in names:
            cancel(name)  # (deselected for the consumer's next start, and off Celery's)
            own = getattr(c, "redislock_handoff_consumer", None)
            if own is not None:
                own.cancel_by_queue(name)

    c.add_task_queue, c.cancel_task_queue = add_task_queue, cancel_task_queue


def _own_consumer_for(c: Any, queue: str) -> bool:
    """Consume the hand-over queue ``queue`` on a hand-over consumer of its own, the worker
    consumer ``c`` having none: its step's start sets one up for it (with the reconnects,
    cancels and listing of one set up at a start; ``queue`` is consumed from the next
    start on too); False where the step would not (not an AMQP broker, no step, or
    hand-over queues on Celery's consumer already: the step's channel failed there, they
    stay together). Called on the consumer's loop, which runs: consumed at once."""
    from .handoff_channel import HandoffChannel  # (which imports this module)

    consumer, connection = getattr(c, "task_consumer", None), getattr(c, "connection", None)
    step = next((s for s in getattr(c, "steps", ()) if isinstance(s, HandoffChannel)), None)
    if step is None or consumer is None or connection is None:
        return False
    if connection.transport.driver_type != "amqp":
        return False
    if any(q.name.endswith(HANDOFF_QUEUE_SUFFIX) for q in consumer.queues):
        return False
    queues = c.app.amqp.queues
    # On Celery's consumer, not consumed: the step moves it to a channel of its own.
    consumer.add_queue(queues.select_add(queues.get(queue, queue)))
    step.start(c)
    consumer.consume()  # (the step's consumer too: the step hooks this; or back on Celery's)
    return getattr(c, "redislock_handoff_consumer", None) is not None


def list_handoff_queues() -> None:
    """``inspect active_queues`` (Celery's command, which lists the task consumer's
    queues) lists the hand-over channel's queues too; once per process."""
    panel = control.Panel.data
    celery_s = panel.get("active_queues")
    if celery_s is None or getattr(celery_s, "redislock", False):
        return

    def active_queues(state: Any) -> list[Any]:
        queues = list(celery_s(state))
        own = getattr(state.consumer, "redislock_handoff_consumer", None)
        if own is not None:
            names = {queue.get("name") for queue in queues}
            queues += [dict(q.as_dict(recurse=True)) for q in own.queues if q.name not in names]
        return queues

    active_queues.__doc__ = celery_s.__doc__
    active_queues.redislock = True  # type: ignore[attr-defined]
    control.inspect_command(name="active_queues")(active_queues)
