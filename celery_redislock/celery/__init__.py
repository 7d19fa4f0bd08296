"""The Celery layer of celery_redislock."""
