"""The RESP2/RESP3 reader of the fault proxy (test tooling): one value, or one
request, at a time from a byte buffer; only what the proxy needs is decoded."""

from __future__ import annotations

from typing import Any


class Incomplete(Exception):
    """The buffer does not hold a whole value yet: read more, then parse again."""


def line_at(buf: bytes, pos: int) -> tuple[bytes, int]:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise Incomplete
    return buf[pos:end], end + 2


def parse(buf: bytes, pos: int = 0) -> tuple[Any, int]:
    """One RESP2/RESP3 value from ``buf`` at ``pos``: (value, position after it).

    Raises ``Incomplete`` when ``buf`` does not hold all of it yet. Aggregates come back
    as lists; scalars as bytes (or None); only what the proxy needs is decoded.
    """
    if pos >= len(buf):
        raise Incomplete
    kind = buf[pos : pos + 1]
    head, pos = line_at(buf, pos + 1)
    if kind in b"$!=":  # bulk string, blob error, verbatim string
        size = int(head)
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise Incomplete
        return buf[pos : pos + size], pos + size + 2
    if kind in b"*~>%|":  # array, set, push, map, attribute
        count = int(head)
        if count < 0:
            return None, pos
        if kind in b"%|":
            count *= 2
        items = []
        for _ in range(count):
            item, pos = parse(buf, pos)
            items.append(item)
        if kind == b"|":  # an attribute comes before the value it describes
            return parse(buf, pos)
        return (["__push__", *items] if kind == b">" else items), pos
    return head, pos  # + - : _ , # ( : one line


def parse_command(buf: bytes) -> tuple[list[bytes], int]:
    """One request (a RESP array of bulk strings, or an inline command) from ``buf``."""
    if buf.startswith(b"*"):
        value, end = parse(buf)
        return [bytes(v) for v in value or []], end
    text, end = line_at(buf, 0)
    return text.split(), end
