"""Sending the task a lock was handed to.

A release (or the sweeper) that hands a lock to a parked task returns that task's parked
message, read back from Redis: :func:`deliver_handed_over` checks it (signature, run,
lock) and sends it (:func:`publish_to_handoff_queue` for a parked signature, a push to
its queue list for a parked envelope), or refuses it (:func:`refuse_handed_over`) and
hands the lock on.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from kombu.utils import json as kombu_json

from .. import metrics, signals
from .._core import LockKeys
from .._keyspace import SemaphoreKeys, parked_under
from .._keyspace import handoff_queue as handoff_queue
from .._replies import decode_handoff
from .._scripts import scripts_for
from . import runon, signing
from .clients import client_for, settings_for
from .envelope import (
    ENVELOPE,
    TAG_PREFIX,
    _Handed,
    _handed,
    _text,
    envelope_lock_key,
    push_targets,
)
from .queuelists import queue_call
from .tasklock import request_owner, run_owner

log = logging.getLogger(__name__)


#: Refused parked messages one delivery gets past at most (each refusal hands the lock on
#: to the next parked task, whose message is checked in turn); the sweeper does the rest.
MAX_REFUSALS = 100


#: How a releasing process may take a checked parked message to run itself
#: (``runon.take``: handed; for an envelope its queue list and the envelope as kombu
#: decodes it, with its delivery tag as sent, for a signature b"" and the signature; how
#: to send it instead) -> taken.
RunHere = Callable[[_Handed, bytes, dict[str, Any], Callable[[], Any]], bool]


def deliver_handed_over(
    app: Any,
    handed: _Handed | None,
    lease: int,
    *,
    via: str = "release",
    run_here: RunHere | None = None,
) -> int:
    """:func:`send_handed_over`: 1 if a message was sent (or kept to run here), else 0."""
    found = send_handed_over(app, handed, lease, via=via, run_here=run_here)
    return 0 if found is None else 1


def send_handed_over(
    app: Any,
    handed: _Handed | None,
    lease: int,
    *,
    via: str = "release",
    run_here: RunHere | None = None,
) -> _Handed | None:
    """Check the message of the parked task a lock was handed to, then send it; returns
    the hand-over whose message was sent (``handed``, or a later parked task's after
    refusals), or None.

    Everything in it was read back from Redis, where anyone who may write the lock keys
    may have written it. It is sent only if a worker holding this app's signing key parked
    it, for this task id, under this lock, and (when the task is registered here) if its
    task is a ``LockedTask`` whose arguments take that lock. A parked signature is then
    published to ``<its queue>.redislock``, an envelope pushed to the read end of its queue
    list. Anything else is refused: not sent, reported (:func:`refuse_handed_over`), and its
    parked record removed, the lock handed on to the next parked task (``lease`` ms), whose
    message is checked in turn. Redis and publishing errors propagate.

    A message sent is announced with ``task_handed_over`` (``via``: who handed it on:
    ``release``, ``sweeper``, ``worker``, ``cli``). ``run_here`` may take a checked parked
    envelope instead, for the releasing process to run itself (``runon``; announced when
    it runs, with ``via`` ``run_on``).
    """
    for _ in range(MAX_REFUSALS):
        if handed is None:
            return None
        try:
            send, envelope = _checked(app, handed)
        except signing.Refused as exc:
            if run_here is not None:  # a run-on hand-over (count 1): a usual one first
                runon.unrun(app, handed, lease)
                run_here = None  # the hand-overs of a refusal are usual ones
            handed = refuse_handed_over(app, handed.lock_key, handed.task_id, str(exc), lease)
            continue
        if run_here is not None and run_here(handed, *envelope, send):
            return handed
        send()
        if signals.task_handed_over.receivers:
            task, queue = _named(handed.message)
            signals.task_handed_over.send(
                app, name=task, task_id=_text(handed.task_id), via=via, queue=queue
            )
        return handed
    if handed is not None:
        log.warning(
            "redislock: refused %d parked messages in a row under %r; the sweeper goes on",
            MAX_REFUSALS,
            _text(handed.lock_key),
        )
    return None


def _checked(app: Any, handed: _Handed) -> tuple[Callable[[], Any], tuple[bytes, dict[str, Any]]]:
    """How to send a handed-over task's message, once it is checked, and the message: for
    a parked envelope its queue list and the envelope (decoded; its delivery tag as sent),
    for a parked signature b"" and the signature; raises Refused."""
    key = settings_for(app).signing_key
    message = handed.message
    try:
        if message[:1] == signing.SIGNED.encode():
            signature = signing.open_signature(key, handed.lock_key, handed.task_id, message)
            options = signature.get("options") or {}
            run = run_owner(
                str(options.get("task_id")),
                options.get("retries"),
                options.get("replaced_task_nesting"),
            )
            if run != handed.task_id.decode():
                raise signing.Refused("its run is not the one it was parked as")
            _check_parked_under(app, signature.get("task"), handed.lock_key, signature)
            return functools.partial(publish_to_handoff_queue, app, signature), (b"", signature)
        if message[:1] == ENVELOPE.encode():
            queue_list, pushed, envelope = _checked_envelope(app, key, handed)
            push = functools.partial(
                queue_call, client_for(app), "RPUSH", queue_list.decode(), pushed
            )
            return push, (queue_list, envelope)
    except signing.Refused:
        raise
    except Exception as exc:  # undecodable: no worker parked it
        raise signing.Refused(f"not a parked message ({type(exc).__name__}: {exc})") from None
    raise signing.Refused("not a signed parked message")


def _named(message: bytes) -> tuple[str, str]:
    """The task and queue a parked message (checked already) names, for counting; ""
    for what it does not say."""
    try:
        if message[:1] == signing.SIGNED.encode():
            found = json.loads(message.split(b"\n", 1)[1])
            options = found.get("options") or {}
            task, queue = found.get("task"), options.get("queue") or options.get("routing_key")
        else:  # a broker envelope: its queue list, then its headers
            head, _placeholder, text = message[1:].split(b"\n", 2)
            task, queue = json.loads(text)["headers"].get("task"), _text(head)
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):
        return "", ""
    return (task if isinstance(task, str) else "", queue if isinstance(queue, str) else "")


def _checked_envelope(app: Any, key: bytes, handed: _Handed) -> tuple[bytes, bytes, dict[str, Any]]:
    head, placeholder, text = handed.message[1:].split(b"\n", 2)
    envelope = kombu_json.loads(text)  # type: ignore[no-untyped-call]
    if not isinstance(envelope, dict):
        raise signing.Refused("not a broker envelope")
    lock, queue_list = signing.check_envelope(key, envelope)
    if lock.encode() != handed.lock_key:
        raise signing.Refused(f"it was signed for another lock ({lock!r})")
    if queue_list.encode() != head:
        raise signing.Refused(f"it was signed for another queue list ({queue_list!r})")
    if request_owner(envelope["headers"]) != handed.task_id.decode():
        raise signing.Refused("its run is not the one it was parked as")
    tag = envelope["properties"].get("delivery_tag")
    once = text.count(placeholder) == 1  # where the tag goes, exactly
    if tag != placeholder.decode() or not tag.startswith(TAG_PREFIX) or not once:
        raise signing.Refused("its delivery tag is not its placeholder")
    _check_parked_under(app, envelope["headers"].get("task"), handed.lock_key, envelope)
    sent_tag = placeholder + b"h" + handed.tag
    envelope["properties"]["delivery_tag"] = sent_tag.decode()
    return head, text.replace(placeholder, sent_tag, 1), envelope


def _check_parked_under(app: Any, name: Any, lock_key: bytes, message: dict[str, Any]) -> None:
    """Refuse a message whose task is known here and is not a ``LockedTask`` whose
    arguments take ``lock_key`` (a task not registered in this worker is vouched for by
    its signature alone)."""
    from .base import LockedTask  # (base imports this module)

    task = app.tasks.get(name) if isinstance(name, str) else None
    if task is None:
        return
    if not isinstance(task, LockedTask):
        raise signing.Refused(f"{name!r} is not a LockedTask")
    if "headers" in message:  # a broker envelope
        rendered = envelope_lock_key(app, message)
    else:  # a signature
        rendered = task.run_key(message.get("args"), message.get("kwargs"))
    if rendered != lock_key:
        raise signing.Refused("its arguments do not take the lock it was parked under")


def refuse_handed_over(
    app: Any, lock_key: bytes, task_id: bytes, reason: str, lease: int
) -> _Handed | None:
    """Report a parked message that must not be sent, and take its hand-over back: the
    lock goes to the next parked task (returned, to be checked and sent in turn), and the
    refused task's parked records are removed, so the sweeper never sends it again."""
    _report_refused(app, lock_key, task_id, reason)
    scripts = scripts_for(client_for(app))
    semaphore = SemaphoreKeys.for_key(lock_key, _prefix_of(app, lock_key))
    if semaphore is None:
        keys = LockKeys.for_lock(lock_key).handoff_keys(task_id)
        args = [task_id, "unstarted", lease, 0, "", "", "", "", "", *push_targets(app)]
        reply = scripts.handoff(keys=keys, args=args)
    else:  # its limit: the one its parked tasks left (sem_handoff.lua)
        keys = semaphore.handoff_keys(task_id)
        args = [task_id, "unstarted", lease, 0, *push_targets(app), "", "", ""]
        reply = scripts.semaphore.handoff(keys=keys, args=[*args, semaphore.permits, ""])
    return _handed(lock_key, decode_handoff(reply).handed)


def _prefix_of(app: Any, lock_key: bytes) -> str:
    """The prefix (of this app's LockedTasks) that ``lock_key`` is a run key under."""
    from .base import LockedTask  # (base imports this module)

    for task in app.tasks.values():
        if isinstance(task, LockedTask):
            prefix = task.lock_options().prefix
            if parked_under(lock_key, prefix) is not None:
                return str(prefix)
    return str(settings_for(app).defaults.prefix)


def _report_refused(app: Any, key: bytes, task_id: bytes | None, reason: str) -> None:
    shown_key, shown_id = _text(key), None if task_id is None else _text(task_id)
    log.error(
        "redislock: refused the parked message of task %r under %r: %s. It is not sent or "
        "run. Whoever may write the lock keys wrote it without the workers' signing key, or "
        "a worker with another redislock_signing_key parked it (docs/security.md)",
        shown_id,
        shown_key,
        reason,
    )
    signals.parked_rejected.send(app, key=shown_key, task_id=shown_id, reason=reason)
    try:  # now: the worker's main process (the sweeper, a fetch) flushes no other way
        metrics.flush_to_redis(client_for(app), settings_for(app).defaults.prefix, force=True)
    except Exception:  # stats are best effort
        log.debug("redislock: could not flush stats", exc_info=True)


def publish_to_handoff_queue(app: Any, message: dict[str, Any]) -> None:
    """Publish a parked task's signature to ``<its queue>.redislock``."""
    signature = app.signature(message)
    options = dict(signature.options)
    # A re-built request carries its queue, or (sent through a named exchange) its routing
    # key, which for Celery's direct exchanges is the queue's name.
    routing_key = options.pop("routing_key", None)
    options.pop("exchange", None)
    queue = options.pop("queue", None) or routing_key or app.conf.task_default_queue
    signature.options = options
    signature.apply_async(queue=handoff_queue(queue))
