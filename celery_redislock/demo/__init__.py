"""The live demo: ``python -m celery_redislock.demo`` (or ``./dev demo``)."""
