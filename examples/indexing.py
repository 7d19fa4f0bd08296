"""Debounced indexing: a document edited many times in a burst is indexed once, with its
latest revision, once the edits have stopped for a moment — and at least every few
seconds while they go on. Rebuilding a user's search index keeps one run going and only
the newest pending request (``on_contention="replace"``).

Worker:  celery -A examples.indexing worker -l info -c 4
Client:  python -m examples.indexing
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery
from celery.result import AsyncResult

from celery_redislock import LockedTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("examples.indexing", broker=REDIS_URL, backend=REDIS_URL)
client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


@app.task(base=LockedTask, lock_key="doc:{doc_id}", lock_debounce=0.5, lock_debounce_max=5.0)
def reindex(doc_id: int, revision: int) -> str:
    """Runs once no newer edit of the document was sent for 0.5 s (at most 5 s after the
    first edit of a burst), with the newest revision."""
    client.rpush(f"examples:indexed:{doc_id}", revision)
    return f"doc {doc_id} indexed at revision {revision}"


@app.task(base=LockedTask, lock_key="user:{user_id}", on_contention="replace")
def rebuild_index(user_id: int, version: int) -> str:
    """One rebuild per user at a time, then one more with the newest version."""
    time.sleep(0.5)
    client.rpush(f"examples:rebuilt:{user_id}", version)
    return f"index of user {user_id} rebuilt at version {version}"


def _wait(results: list[AsyncResult]) -> list[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = [r.state for r in results]
        if all(s in ("SUCCESS", "SUPERSEDED") for s in states):
            return states
        time.sleep(0.1)
    raise SystemExit(f"not every call ended: {[r.state for r in results]}")


if __name__ == "__main__":
    for key in ("examples:indexed:7", "examples:rebuilt:42"):
        client.delete(key)
    edits = []
    for revision in range(1, 21):  # 20 edits in about 0.2 s
        edits.append(reindex.delay(7, revision))
        time.sleep(0.01)
    rebuilds = [rebuild_index.delay(42, version) for version in range(1, 11)]
    edit_states, rebuild_states = _wait(edits), _wait(rebuilds)
    ran, superseded = edit_states.count("SUCCESS"), edit_states.count("SUPERSEDED")
    print(f"20 edits: {ran} run, {superseded} superseded")
    print("indexed revisions:", [int(v) for v in client.lrange("examples:indexed:7", 0, -1)])
    print(
        f"10 rebuild requests: {rebuild_states.count('SUCCESS')} run, "
        f"{rebuild_states.count('SUPERSEDED')} superseded"
    )
    print("rebuilt versions:", [int(v) for v in client.lrange("examples:rebuilt:42", 0, -1)])
