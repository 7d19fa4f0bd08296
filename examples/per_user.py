"""Per-user serialisation: one user's tasks run one at a time; different users in parallel.

Worker:  celery -A examples.per_user worker -l info -c 4
Client:  python -m examples.per_user
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import redis
from celery import Celery

from celery_redislock import LockedTask, locked

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("examples.per_user", broker=REDIS_URL, backend=REDIS_URL)


@dataclass
class User:
    id: int
    email: str


@app.task(base=LockedTask, lock_key="user:{user_id}", on_contention="wait", lock_wait=30)
def rebuild_feed(user_id: int, full: bool = False) -> str:
    time.sleep(0.2)
    return f"feed of {user_id} rebuilt ({'full' if full else 'incremental'})"


# socket timeouts bound each call to a Redis that stops answering (docs/guarantees.md)
client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)


@locked(client, "user:{user.id}", ttl=10, hashed=True)
def export_profile(user: User) -> str:
    """Outside Celery the same key language works with ``locked``; hashed keys hide ids."""
    return f"{user.id}: {user.email}"


if __name__ == "__main__":
    results = [rebuild_feed.delay(i % 3, full=bool(i % 2)) for i in range(9)]
    print([r.get(timeout=60) for r in results])
    print(export_profile(User(1, "ada@example.com")))
