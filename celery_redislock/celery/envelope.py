"""The parked messages' formats.

A parked broker envelope (:func:`envelope_entry`), the parked task a hand-over or sweep
script's decoded reply names (:func:`_handed`), the queue lists and task names a hand-over script
may push an envelope to itself (:func:`push_targets`), and the lock key the task of a
broker envelope (as kombu decodes it) takes (:func:`envelope_lock_key`).
"""

from __future__ import annotations

import base64
import secrets
import time
import weakref
from typing import Any, NamedTuple

from kombu import compression, serialization
from kombu.utils import json as kombu_json

from .._core import LockKeys
from .._replies import Handed
from . import queuelists, signing
from .queuelists import SEP


class _Handed(NamedTuple):
    """A parked task a release (or the sweeper) just handed the lock to, whose message the
    worker checks and sends: :func:`deliver_handed_over`. Everything but ``lock_key`` was
    read back from Redis."""

    lock_key: bytes
    task_id: bytes
    message: bytes  # a signed parked signature, or a parked broker envelope
    tag: bytes = b""  # an envelope's delivery tag: "<placeholder>h<tag>"


#: First character of a parked broker envelope (a parked signature's is signing.SIGNED).
ENVELOPE = "E"
#: Start of the delivery-tag placeholder of a parked envelope, and so of the delivery tag
#: of every envelope a hand-over (or the sweeper) pushed back.
TAG_PREFIX = "rltag"


def envelope_entry(queue_list: str, envelope: dict[str, Any], lock_key: bytes, key: bytes) -> str:
    """A parked broker envelope: ``E<queue list>\\n<tag placeholder>\\n<envelope JSON>``.

    The envelope is the broker's own message (Redis transport), with a placeholder for
    its delivery tag, signed with ``key`` for ``lock_key`` and ``queue_list``
    (:func:`signing.sign_envelope`): whoever hands the lock over pushes it back to the head
    of ``queue_list`` with a new tag (``handoff.lua``, or the worker).
    ``envelope["headers"]`` and ``envelope["properties"]`` must be the caller's own copies.
    """
    placeholder = TAG_PREFIX + secrets.token_hex(8)  # letters and digits, unique
    envelope["properties"]["delivery_tag"] = placeholder
    signing.sign_envelope(key, envelope, lock_key, queue_list)
    return f"{ENVELOPE}{queue_list}\n{placeholder}\n{_dumps(envelope)}"


def push_targets(app: Any) -> tuple[str, str]:
    """Where a hand-over script may push a parked envelope itself (handoff.lua's ARGV[10]
    and ARGV[11]): the first-read lists of the queues this worker consumes (as
    :class:`parking.Parker` names them) and this app's ``LockedTask`` names, one a line.
    An envelope for another list or task comes back to the worker, which checks it.
    A list in another database of the locks' server is named as ``queuelists`` says."""
    queues = app.amqp.queues
    consumed = queues.consume_from or queues
    tasks = app.tasks
    found = _push_targets.get(app)
    # (built again when the queues consumed or the number of tasks change, when a probe
    # found a broker's place since, or once a failed probe may be tried again: a pool
    # process's releases are what asks it again there; the set of names compared as it
    # is, not sorted first; a release asks at every hand-over)
    if (
        found is not None
        and found[1] == len(tasks)
        and found[3] == queuelists.found_count
        and found[0] == consumed.keys()
        and (found[4] is None or time.monotonic() < found[4])
    ):
        return found[2]
    from .base import LockedTask  # (base imports this module)

    # (the count read first: a place found by another thread meanwhile builds them again)
    probed = queuelists.found_count
    # (another database of the locks' server: lists named so)
    place, retry = queuelists.broker_answer(app)

    names = sorted(consumed)
    options = app.conf.broker_transport_options or {}
    prefix = str(options.get("global_keyprefix") or "")
    first = (options.get("priority_steps") or [0])[0]
    after = f"{_PRIORITY_SEP}{first}" if first else ""  # kombu's _q_for_pri
    plain = [prefix + name + after for name in names]
    named = [place.name(q) if place is not None else q for q in plain if SEP not in q]
    lists = "\n".join(q for q in named if q is not None and "\n" not in q)
    locked = sorted(n for n, t in tasks.items() if isinstance(t, LockedTask) and "\n" not in n)
    targets = (lists, "\n".join(locked))
    _push_targets[app] = (frozenset(names), len(tasks), targets, probed, retry)
    return targets


_PushTargets = tuple[frozenset[str], int, tuple[str, str], int, float | None]
_push_targets: weakref.WeakKeyDictionary[Any, _PushTargets]
_push_targets = weakref.WeakKeyDictionary()
#: kombu's Redis transport: between a queue's name and its priority step in a list's name.
_PRIORITY_SEP = "\x06\x16"


def _handed(lock_key: bytes, handed: Handed | None) -> _Handed | None:
    """The parked task a hand-over or sweep script's decoded reply says to check and send
    (``_replies.decode_handoff``, ``decode_sweep``), under ``lock_key``."""
    if handed is None:
        return None
    return _Handed(lock_key, handed.task_id, handed.message, handed.tag)


def envelope_body(envelope: Any) -> Any:
    """A broker envelope's body as kombu hands it to Celery: base64-decoded when its
    ``body_encoding`` says so, decompressed when its ``compression`` header does."""
    headers, body = envelope["headers"], envelope["body"]
    if envelope["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    if headers.get("compression"):
        body = compression.decompress(body, headers["compression"])  # type: ignore[no-untyped-call]
    return body


def envelope_lock_key(app: Any, envelope: Any, accept: Any = None) -> bytes | None:
    """The lock key the task of a broker envelope (as kombu decodes it) takes: its
    arguments decoded and its ``lock_key`` rendered; None if it is not a ``LockedTask``'s
    message (task protocol 2, with a task id) or cannot be decoded or rendered here."""
    from .base import LockedTask  # (base imports this module)

    try:
        headers = envelope["headers"]
        task = app.tasks.get(headers.get("task"))
        if not isinstance(task, LockedTask) or not isinstance(headers.get("id"), str):
            return None
        body = envelope_body(envelope)
        if accept is None:
            accept = serialization.prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
        args, kwargs, _embed = serialization.loads(  # type: ignore[no-untyped-call]
            body, envelope["content-type"], envelope["content-encoding"], accept=accept
        )
        return task.run_key(args, kwargs)
    except Exception:
        return None


def LockKeysFor(name: str, prefix: str) -> bytes:
    return LockKeys.for_name(name, prefix).lock


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _dumps(value: Any) -> str:
    return str(kombu_json.dumps(value))  # type: ignore[no-untyped-call]


def _loads(text: str) -> dict[str, Any]:
    return dict(kombu_json.loads(text))  # type: ignore[no-untyped-call]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
