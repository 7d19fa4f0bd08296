"""A periodic job that runs once per period, even with two beat schedulers running.

Worker:  celery -A examples.nightly worker -l info
Beats:   celery -A examples.nightly beat -s /tmp/beat-a   (and again with -s /tmp/beat-b)

Both beats send ``nightly_report`` every period; the first run takes the lock and keeps
it ``lock_hold`` seconds after finishing, so the second delivery finds it held and is
skipped (recorded as SKIPPED).
"""

from __future__ import annotations

import os

from celery import Celery

from celery_redislock import LockedTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("examples.nightly", broker=REDIS_URL, backend=REDIS_URL)
app.conf.beat_schedule = {
    "nightly-report": {"task": "examples.nightly.nightly_report", "schedule": 60.0}
}


@app.task(base=LockedTask, on_contention="skip", lock_hold=50.0)
def nightly_report() -> str:
    return "report built"
