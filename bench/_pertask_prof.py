import cProfile, os, pstats
from celery import signals
from bench._pertask_app import *  # noqa
from bench._pertask_app import app, TASKS  # noqa

_p = {}


@signals.worker_process_init.connect
def _on(**kw):
    _p["p"] = cProfile.Profile()
    _p["p"].enable()


@signals.worker_process_shutdown.connect
def _off(**kw):
    p = _p.get("p")
    if p:
        p.disable()
        p.dump_stats(f"/tmp/prof/pool-{os.environ.get('PROFTAG', 'x')}-{os.getpid()}.prof")


@signals.worker_init.connect
def _mon(**kw):
    _p["m"] = cProfile.Profile()
    _p["m"].enable()


@signals.worker_shutdown.connect
def _moff(**kw):
    p = _p.get("m")
    if p:
        p.disable()
        p.dump_stats(f"/tmp/prof/main-{os.environ.get('PROFTAG', 'x')}-{os.getpid()}.prof")
