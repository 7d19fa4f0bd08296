"""The broker's place re-probed in the background (``queuelists.Reprobe``) while the
worker's main loop needs that place for something else than parking: a hand-over the main
process runs itself (``LockedRequest._release_for_task``, for a revoked task or a dead
child) builds its push targets (``envelope.push_targets`` -> ``broker_answer`` ->
``place_of``). It must not wait for the background probe (it took the one-probe-at-a-time
lock before it looked at the window, and so waited up to the probe's socket timeouts):
while a re-probe runs on another thread, ``place_of`` answers None at once."""

from __future__ import annotations

import os

from celery_redislock.celery import queuelists
from celery_redislock.celery.envelope import push_targets
from celery_redislock.testing import RedisServer

from .test_broker_db_attack import stalled_reprobe


def test_a_main_process_hand_over_does_not_wait_for_the_background_probe(
    redis_server: RedisServer, celery_broker: RedisServer
) -> None:
    """Push targets are built while the probe waits for its reply, without its place, and
    without its answer: the failed probe's new window is not there yet when they return,
    so they did not wait for it. (``celery_broker``: the shared test app's task, whose lock
    options the Parker reads, is configured before its settings are first read and cached.)"""
    with stalled_reprobe(redis_server.url, "attack-reprobe-push-targets") as (app, parker):
        assert parker.reprobe is not None
        lists, _tasks = push_targets(app)  # what the main process's hand-over asks first
        assert queuelists.retry_at(app, parker.reprobe.uri) == 0.0  # (the old window)
        assert parker.reprobe.probing_elsewhere()  # (still waiting for its reply)
        assert "\r" not in lists  # (no place: only the locks' database's lists named)
    again = queuelists.retry_at(app, parker.reprobe.uri)
    assert again is not None and again > 0.0  # (then the probe failed: a new window)


def test_a_child_forked_while_the_background_probe_runs_probes_for_itself(
    redis_server: RedisServer, celery_broker: RedisServer
) -> None:
    """A pool process forked (a replaced child) while the main process's re-probe runs
    must not inherit that re-probe as running: its ``place_of`` would answer "not known"
    for good. The child starts with no re-probes."""
    with stalled_reprobe(redis_server.url, "attack-reprobe-fork") as (app, _parker):
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            code = 1
            try:
                code = 0 if not queuelists._reprobes.get(app) else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
