"""A Celery app for ``tests.test_configured_attack``: tasks locked by ``redislock_tasks``
that a demanding user would write: ``@shared_task``, ``autoretry_for`` with
``retry_backoff``, a class-based task registered with ``app.register_task``, keyword-only
annotated arguments named by the key, a base whose ``__call__`` calls ``self.run``
directly, a base with a metaclass and ``__init_subclass__``, a base whose ``Request`` is a
dotted string, and a task that ``replace()``s itself. Every body records its section.

``app.register_task`` finalizes the app: the tasks above it are configured at finalization,
the ones below it as they are registered (the hooked registry)."""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import redis
from celery import Celery, Task, current_task, shared_task

import celery_redislock  # noqa: F401  (after celery: the redislock_tasks hook)

URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6399/0")
P = "tests.configured_attack_app."

app = Celery("redislock_configured_attack", broker=URL, backend=URL)
app.conf.update(
    redislock_ttl=30.0,
    redislock_requeue_backoff=(0.02, 0.5),
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    result_expires=600,
    worker_hijack_root_logger=False,
    redislock_tasks=[
        (P + "account_*", {"lock_key": "acct:{account_id}"}),
        (P + "*", {"lock_key": "job:{name}"}),
    ],
)

_r: redis.Redis | None = None


def r() -> redis.Redis:
    global _r
    if _r is None:
        _r = redis.Redis.from_url(URL)
    return _r


def section(name: str, seconds: float = 0.02) -> None:
    """Record who ran when, under which lock, owned or not."""
    task = current_task
    lock = getattr(task, "lock", None)
    owned = lock is not None and lock.owned()
    lock_name = lock.name if lock is not None else "-"
    enter = time.monotonic()
    time.sleep(seconds)
    leave = time.monotonic()
    r().rpush(
        f"sections:{name}",
        f"{task.name} {task.request.id} {task.request.retries} {owned} {lock_name} "
        f"{enter!r} {leave!r}",
    )


@shared_task(name=P + "shared_work")
def shared_work(name: str, seconds: float = 0.02) -> str:
    section(name, seconds)
    return "shared"


@app.task(
    bind=True, autoretry_for=(KeyError,), retry_backoff=True, retry_backoff_max=1, max_retries=3
)
def autoretry_work(self: Any, name: str) -> int:
    section(name)
    if self.request.retries < 2:
        raise KeyError("once more")
    return int(self.request.retries)


@app.task
def account_work(*, account_id: int, amount: float = 0.0, note: str | None = None) -> str:
    section(f"acct{account_id}")
    return "account"


class Picky(Task):  # type: ignore[misc]
    """A base whose __init_subclass__ refuses subclasses that set lock options."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "lock_key" in cls.__dict__:
            raise ValueError("Picky: no lock_key here")


if os.environ.get("REDISLOCK_TEST_PICKY"):  # a base that cannot be combined

    @app.task(base=Picky)
    def picky_work(name: str) -> str:
        section(name)
        return "picky"


class ClassWork(Task):  # type: ignore[misc]
    """An old-style class-based task."""

    name = P + "class_work"

    def run(self, name: str) -> str:
        section(name)
        return "class"


class_work = app.register_task(ClassWork())


class DirectCall(Task):  # type: ignore[misc]
    """A base whose __call__ calls self.run itself (not super().__call__)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r().rpush(f"hooks:{args[0]}", "direct")
        return self.run(*args, **kwargs)


@app.task(bind=True, base=DirectCall)
def direct_work(self: Any, name: str) -> str:
    section(name)
    return "direct"


class Meta(type(Task)):  # type: ignore[misc]
    made: ClassVar[list[type]] = []

    def __init__(cls, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Meta.made.append(cls)


class MetaBase(Task, metaclass=Meta):  # type: ignore[misc]
    subclasses: ClassVar[list[type]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        MetaBase.subclasses.append(cls)


@app.task(base=MetaBase)
def meta_work(name: str) -> str:
    section(name)
    return "meta"


class DottedRequest(Task):  # type: ignore[misc]
    Request = "tests.configured_attack_app:OwnRequest"


from celery.worker.request import Request  # noqa: E402


class OwnRequest(Request):  # type: ignore[misc]
    """A base's own worker Request, named by a dotted string."""

    def on_accepted(self, *args: Any, **kwargs: Any) -> Any:
        r().rpush("own-request", f"{type(self).__mro__[1].__name__} {self.id}")
        return super().on_accepted(*args, **kwargs)


@app.task(base=DottedRequest)
def dotted_work(name: str) -> str:
    section(name)
    return "dotted"


@app.task(bind=True)
def replacing_work(self: Any, name: str) -> Any:
    section(name)
    return self.replace(shared_work.si(name))
