"""The public surface: a curated, sorted __all__, and a core that never imports Celery."""

from __future__ import annotations

import subprocess
import sys

import celery_redislock


def test_all_is_sorted_and_every_name_resolves() -> None:
    names = [n for n in celery_redislock.__all__ if n != "__version__"]
    assert names == sorted(names)
    for name in celery_redislock.__all__:
        assert getattr(celery_redislock, name) is not None


def test_the_rate_limiters_are_public_from_the_package() -> None:
    from celery_redislock.ratelimit import AsyncRedisRateLimiter, RedisRateLimiter

    assert {"RedisRateLimiter", "AsyncRedisRateLimiter"} <= set(celery_redislock.__all__)
    assert celery_redislock.RedisRateLimiter is RedisRateLimiter
    assert celery_redislock.AsyncRedisRateLimiter is AsyncRedisRateLimiter


def test_core_modules_never_import_celery() -> None:
    code = (
        "import sys, celery_redislock, celery_redislock.lock, celery_redislock.aio, "
        "celery_redislock.keys, celery_redislock.settings, celery_redislock.fencing, "
        "celery_redislock.ratelimit; "
        "print(any(m == 'celery' or m.startswith('celery.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_celery_layer_loads_on_first_use() -> None:
    from celery_redislock.task import LockedTask

    assert celery_redislock.LockedTask is LockedTask
