"""I/O-free: how one argument value is written in a lock key: the canonical, typed form
that :mod:`celery_redislock.keys` renders template placeholders with (the table of forms is
in its docstring).

Different values of the supported types (or equal values of different types, such as
``1``, ``1.0`` and ``True``) are written differently, and every written value uses only
the characters of ``_VALUE_ALPHABET``, so a template can tell where a value ends.
"""

from __future__ import annotations

import decimal
import json
import math
import re
import uuid

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_BYTE_TEXT = tuple(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in range(256))
_ASCII_TEXT = {b: _BYTE_TEXT[b] for b in range(128) if b not in _UNRESERVED}
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]*")
_INT_LIKE = re.compile(r"-?[0-9]+")
#: Every character an encoded value can contain. A separator between two placeholders
#: needs a character outside this set for the key to be parsed back unambiguously.
_VALUE_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-%~'")


class _Unencodable(Exception):
    """Internal: a value has no canonical key form; the message says what and where."""


def _pct(text: str) -> str:
    """Percent-encode every UTF-8 byte outside ``A-Z a-z 0-9 _ . -`` (hex in upper case).

    Lone surrogates are encoded with ``surrogatepass``, which keeps the mapping one-to-one.
    """
    if _PLAIN.fullmatch(text):
        return text
    if text.isascii():  # one byte per character: the same text, translated in one call
        return text.translate(_ASCII_TEXT)
    return "".join([_BYTE_TEXT[b] for b in text.encode("utf-8", "surrogatepass")])


def _encode_str(value: str) -> str:
    text = _pct(str.__str__(value))  # str.__str__: a str subclass/enum writes its data
    if not text or _INT_LIKE.fullmatch(text):
        return "'" + text
    return text


def _json_float(value: float) -> str:
    if math.isfinite(value):
        return float.__repr__(value)
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _canonical(value: object, active: set[int]) -> str:
    """Canonical JSON of ``value``; equal to ``json.dumps(value, sort_keys=True,
    separators=(",", ":"), ensure_ascii=False)`` for plain JSON data.

    Two extensions keep different values apart where JSON would merge them: a tuple is
    written ``(a,b)`` (a list stays ``[a,b]``), and a dict key that is not a ``str`` is
    written in its typed form (``{1:…}`` vs ``{"1":…}``); such keys sort after str keys.
    """
    if isinstance(value, str):
        return json.dumps(str.__str__(value), ensure_ascii=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, (list, tuple, dict)):
        marker = id(value)
        if marker in active:
            raise _Unencodable("containing a circular reference")
        active.add(marker)
        try:
            if isinstance(value, dict):
                items: list[tuple[tuple[int, str], str]] = []
                for key, item in value.items():
                    if isinstance(key, str):
                        order = (0, str.__str__(key))
                        text = json.dumps(order[1], ensure_ascii=False)
                    else:
                        text = _canonical(key, active)
                        order = (1, text)
                    items.append((order, text + ":" + _canonical(item, active)))
                items.sort(key=lambda pair: pair[0])
                return "{" + ",".join(text for _, text in items) + "}"
            inner = ",".join([_canonical(item, active) for item in value])
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        finally:
            active.discard(marker)
    raise _Unencodable(
        f"containing a value of type {type(value).__qualname__}, which has no canonical key form"
    )


def _encode(value: object) -> str:
    """Write one argument value in its canonical, typed key form.

    Guarantee: for values of the supported types, different values (or equal values of
    different types, such as ``1``/``1.0``/``True``) give different strings, and every
    string uses only characters of ``_VALUE_ALPHABET``.

    Raises:
        _Unencodable: the value (or something inside it) has no canonical form.
    """
    # bool is tested before int: it is an int subclass.
    if isinstance(value, str):
        return _encode_str(value)
    if isinstance(value, bool):
        return "~true" if value else "~false"
    if isinstance(value, int):
        return int.__repr__(value)
    if value is None:
        return "~none"
    if isinstance(value, float):
        return "~f" + _pct(float.__repr__(value))
    if isinstance(value, uuid.UUID):
        return "~u" + uuid.UUID.__str__(value)
    if isinstance(value, decimal.Decimal):
        return "~d" + _pct(decimal.Decimal.__str__(value))
    if isinstance(value, (bytes, bytearray)):
        return "~b" + value.hex()
    if isinstance(value, (list, tuple, dict)):
        return "~j" + _pct(_canonical(value, set()))
    raise _Unencodable("which has no canonical key form")
