"""The broker's place re-probed in the background (``queuelists.Reprobe``) while the
worker's main loop needs that place for something else than parking: a hand-over the main
process runs itself (``LockedRequest._release_for_task``, for a revoked task or a dead
child) builds its push targets (``envelope.push_targets`` -> ``broker_answer`` ->
``place_of``). It must not wait for the background probe (it took the one-probe-at-a-time
lock before it looked at the window, and so waited up to the probe's socket timeouts):
while a re-probe runs on another thread, ``place_of`` answers None at once."""

from __future__ import annotations

import time
from types import SimpleNamespace

from celery import Celery

from celery_redislock.celery.envelope import push_targets
from celery_redislock.testing import RedisServer, free_port

from .._celery import silent_server
from .test_broker_db_attack import _consumer_parker, _window_over


def test_a_main_process_hand_over_does_not_wait_for_the_background_probe(
    redis_server: RedisServer, celery_broker: RedisServer
) -> None:
    """(``celery_broker``: the shared test app's task, whose lock options the Parker reads,
    is configured before its settings are first read and cached.)"""
    port = free_port()
    app = Celery("attack-reprobe-push-targets", broker=f"redis://127.0.0.1:{port}/0")
    app.conf.redislock_url = redis_server.url
    try:
        with _consumer_parker(app) as parker:  # (refused: a window)
            assert parker is not None and parker.reprobe is not None
            with silent_server(port):
                _window_over(app)
                assert parker.park(SimpleNamespace(headers={}, delivery_tag=1)) is False
                thread = parker.reprobe._thread
                assert thread is not None and thread.is_alive()  # (the probe waits)
                began = time.monotonic()
                push_targets(app)  # what the main process's hand-over asks first
                took = time.monotonic() - began
            parker.reprobe.join(15)
            assert took < 1.0, f"the main loop waited {took:.1f} s for the background probe"
    finally:
        app.close()


def test_a_child_forked_while_the_background_probe_runs_probes_for_itself(
    redis_server: RedisServer, celery_broker: RedisServer
) -> None:
    """A pool process forked (a replaced child) while the main process's re-probe runs
    must not inherit that re-probe as running: its ``place_of`` would answer "not known"
    for good. The child starts with no re-probes."""
    import os

    from celery_redislock.celery import queuelists

    port = free_port()
    app = Celery("attack-reprobe-fork", broker=f"redis://127.0.0.1:{port}/0")
    app.conf.redislock_url = redis_server.url
    try:
        with _consumer_parker(app) as parker:
            assert parker is not None and parker.reprobe is not None
            with silent_server(port):
                _window_over(app)
                parker.park(SimpleNamespace(headers={}, delivery_tag=1))
                assert parker.reprobe.probing_elsewhere()
                pid = os.fork()
                if pid == 0:  # the child: report through the exit code only
                    code = 1
                    try:
                        code = 0 if not queuelists._reprobes.get(app) else 3
                    finally:
                        os._exit(code)
                _, status = os.waitpid(pid, 0)
            parker.reprobe.join(15)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        app.close()
