"""The one fork rule (celery_redislock._process): a forked child rebuilds every per-process
value, runs the on_fork resets, and has a stamp of its own."""

from __future__ import annotations

import os
import warnings

from celery_redislock import _process
from celery_redislock._process import ProcessLocal, ProcessRegistry


class _Key:  # weakly referenceable
    pass


#: The pids that built the ProcessLocal's value.
_built: list[int] = []


def test_a_forked_child_rebuilds_every_per_process_value() -> None:
    local = ProcessLocal(lambda: _built.append(os.getpid()) or object())
    registry: ProcessRegistry[_Key, object] = ProcessRegistry()
    named: ProcessRegistry[str, object] = ProcessRegistry(weak=False)
    resets: list[int] = []
    reset = _process.on_fork(lambda: resets.append(os.getpid()))
    try:
        _forked_child_checks(local, registry, named, resets)
    finally:
        _process._callbacks.remove(reset)


def _forked_child_checks(
    local: ProcessLocal[object],
    registry: ProcessRegistry[_Key, object],
    named: ProcessRegistry[str, object],
    resets: list[int],
) -> None:
    built = _built
    key = _Key()
    parent = (local.get(), registry.get(key, object), named.get("x", object))
    stamp = _process.current()
    assert local.get() is parent[0] and registry.get(key, object) is parent[1]
    assert _process.is_current(stamp) and built == [os.getpid()]
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            code |= 1 if local.peek() is not None or registry.peek(key) is not None else 0
            code |= 2 if named.peek("x") is not None or list(named.items()) else 0
            code |= 4 if _process.is_current(stamp) or resets != [os.getpid()] else 0
            child = (local.get(), registry.get(key, object), named.get("x", object))
            code |= 8 if any(a is b for a, b in zip(child, parent)) else 0
            code |= 16 if built != [os.getppid(), os.getpid()] else 0
        except BaseException:
            code |= 32
        os.write(write, bytes([code]))
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    code = os.read(read, 1)
    os.close(read)
    assert code == b"\x00", f"child failures bitmask {code!r}"
    assert local.get() is parent[0] and resets == []  # the parent's are untouched
