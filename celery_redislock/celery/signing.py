"""Signed parked messages: the workers re-publish only what a worker parked.

A parked task's message lives in Redis under the lock prefix until a release (or the
sweeper) hands the lock to it and sends the message again. Anyone who may write under
the prefix could write such a message, so every parked message carries an HMAC-SHA256
made with a key only the workers hold (``redislock_signing_key``), and nothing read back
from Redis is sent on, or run, unless it verifies:

* a parked **signature** (parked by a pool process) is the entry
  ``S<mac>\\n<signature JSON>``; the MAC covers the lock key it was parked under, its task
  id and the JSON (task name, arguments, options), byte for byte. The worker that sends
  it checks it first (:func:`open_signature`).
* a parked **broker envelope** (parked in the worker's main process) carries its MAC in
  the header ``redislock_parked`` (with the lock key it was parked under and the queue
  list it goes back to). The MAC covers the whole envelope except what the broker
  changes on the way (the delivery tag, kombu's ``redelivered`` flags). A hand-over
  script may push it back to its queue itself (Lua holds no key), so the worker that
  fetches it checks it before the task runs (:func:`check_envelope`).

This module holds the formats and the MACs; it reads no Redis and runs no task.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any

from kombu.utils import json as kombu_json

from ..settings import derive_key as derive_key  # the default key (the core reads it)

#: Header of a parked broker envelope: ``{"lock": <lock key>, "list": <queue list>,
#: "mac": <hex HMAC-SHA256>}``.
PARKED_HEADER = "redislock_parked"
#: First character of a signed parked signature entry (an envelope entry starts with "E").
SIGNED = "S"
_MAC_CHARS = 64  # hex digits of an HMAC-SHA256


class Refused(Exception):
    """A parked message that must not be sent on or run; ``str()`` says why."""


def _mac(key: bytes, kind: bytes, *parts: bytes) -> str:
    framed = b"".join(len(part).to_bytes(8, "big") + part for part in (kind, *parts))
    return hmac.new(key, framed, hashlib.sha256).hexdigest()


# ------------------------------------------------------------------ parked signatures


def task_id_of(owner: str) -> str:
    """The task id of a run's lock owner (``<task id>`` or ``<task id>~n<k>r<k>``, the
    form ``celery_redislock.celery.tasklock.run_owner`` gives a retry or a replacement)."""
    match = _RUN_SUFFIX.search(owner)
    return owner[: match.start()] if match else owner


_RUN_SUFFIX = re.compile(r"~(?:n\d+)?(?:r\d+)?$")


def sign_signature(key: bytes, lock_key: bytes, task_id: str, text: str) -> str:
    """The parked entry of the signature JSON ``text`` of ``task_id`` under ``lock_key``."""
    mac = _mac(key, b"signature", lock_key, task_id.encode("utf-8"), text.encode("utf-8"))
    return f"{SIGNED}{mac}\n{text}"


def open_signature(key: bytes, lock_key: bytes, task_id: bytes, entry: bytes) -> dict[str, Any]:
    """The signature of a parked entry, if a worker with ``key`` parked it for ``task_id``
    under ``lock_key``; else raises :class:`Refused`."""
    head, text = entry[: 2 + _MAC_CHARS], entry[2 + _MAC_CHARS :]
    if len(head) != 2 + _MAC_CHARS or head[:1] != SIGNED.encode() or head[-1:] != b"\n":
        raise Refused("not a signed parked message")
    expected = _mac(key, b"signature", lock_key, task_id, text)
    if not hmac.compare_digest(head[1:-1], expected.encode()):
        raise Refused("its signature does not verify (not parked by a worker with this key)")
    signature = kombu_json.loads(text)  # type: ignore[no-untyped-call]
    options = signature.get("options") if isinstance(signature, dict) else None
    if not isinstance(options, dict) or options.get("task_id") != task_id_of(task_id.decode()):
        raise Refused("its task id is not the one it was parked as")
    return signature  # type: ignore[no-any-return]


# ------------------------------------------------------------------ deferred calls

#: First character of a deferred call's entry (``celery_redislock.celery.deferral``).
DEFERRED = "D"


def sign_deferred(key: bytes, list_key: bytes, text: str) -> str:
    """The entry of a deferred call (``text``: its JSON) in the deferred list ``list_key``:
    ``D<mac>\\n<text>``. Its MAC is of another kind than a parked signature's: neither
    can be passed off as the other."""
    mac = _mac(key, b"deferred", list_key, text.encode("utf-8"))
    return f"{DEFERRED}{mac}\n{text}"


def open_deferred(key: bytes, list_key: bytes, entry: bytes) -> dict[str, Any]:
    """The JSON of a deferred call's entry, if a worker with ``key`` deferred it in
    ``list_key``; else raises :class:`Refused`."""
    head, text = entry[: 2 + _MAC_CHARS], entry[2 + _MAC_CHARS :]
    if len(head) != 2 + _MAC_CHARS or head[:1] != DEFERRED.encode() or head[-1:] != b"\n":
        raise Refused("not a signed deferred call")
    expected = _mac(key, b"deferred", list_key, text)
    if not hmac.compare_digest(head[1:-1], expected.encode()):
        raise Refused("its signature does not verify (not deferred by a worker with this key)")
    found = kombu_json.loads(text)  # type: ignore[no-untyped-call]
    if not isinstance(found, dict):
        raise Refused("not a deferred call")
    return found


# ------------------------------------------------------------------ parked envelopes


def _signed_form(envelope: Mapping[str, Any]) -> bytes:
    """What the MAC of an envelope covers: all of it, keys sorted, except its delivery
    tag (a hand-over fills it in), kombu's ``redelivered`` flags (set when an unacked
    message is restored) and the MAC itself."""
    headers = dict(envelope["headers"])
    headers.pop("redelivered", None)
    headers[PARKED_HEADER] = {k: v for k, v in headers[PARKED_HEADER].items() if k != "mac"}
    properties = dict(envelope["properties"])
    properties.pop("delivery_tag", None)
    info = dict(properties.get("delivery_info") or {})
    info.pop("redelivered", None)
    properties["delivery_info"] = info
    signed = {**envelope, "headers": headers, "properties": properties}
    text = kombu_json.dumps(signed, sort_keys=True, separators=(",", ":"))  # type: ignore[no-untyped-call]
    return str(text).encode("utf-8")


def sign_envelope(key: bytes, envelope: dict[str, Any], lock_key: bytes, queue_list: str) -> None:
    """Add the ``redislock_parked`` header to an envelope about to be parked (in place:
    ``envelope["headers"]`` must be the caller's own copy)."""
    parked = {"lock": lock_key.decode("utf-8"), "list": queue_list}
    envelope["headers"][PARKED_HEADER] = parked
    parked["mac"] = _mac(key, b"envelope", _signed_form(envelope))


def check_envelope(key: bytes, envelope: Any) -> tuple[str, str]:
    """The lock key and queue list an envelope was parked with, if a worker with ``key``
    parked it (as kombu decoded it); else raises :class:`Refused`."""
    if not isinstance(envelope, dict):
        raise Refused("not a broker envelope")
    headers = envelope.get("headers")
    parked = headers.get(PARKED_HEADER) if isinstance(headers, dict) else None
    if not isinstance(parked, dict) or not all(
        isinstance(parked.get(field), str) for field in ("lock", "list", "mac")
    ):
        raise Refused("it carries no signature (it was not parked by a worker)")
    if not isinstance(envelope.get("properties"), dict):
        raise Refused("not a broker envelope")
    try:
        expected = _mac(key, b"envelope", _signed_form(envelope))
    except (TypeError, ValueError) as exc:
        raise Refused(f"not a broker envelope ({exc})") from None
    if not hmac.compare_digest(parked["mac"].encode(), expected.encode()):
        raise Refused("its signature does not verify (not parked by a worker with this key)")
    return parked["lock"], parked["list"]
