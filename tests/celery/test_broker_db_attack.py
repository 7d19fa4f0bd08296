"""Attacks on the queue lists in another database (``celery.queuelists``): a probe that
fails is not run at every parking, nor left open, nor kept in the push targets; an older
release is never handed a list name it does not know."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import redis
from celery import Celery

from celery_redislock import LockConfigurationError
from celery_redislock.celery import envelope, queuelists
from celery_redislock.celery.clients import _settings, client_for, settings_for
from celery_redislock.celery.contention import _park_fallback
from celery_redislock.celery.envelope import push_targets
from celery_redislock.celery.lookahead import _lookahead_denied, _next_queued
from celery_redislock.celery.parking import Parker
from celery_redislock.celery.queuelists import Place, broker_place, place_of
from celery_redislock.celery.tasklock import TaskLock
from celery_redislock.testing import RedisServer, free_port

from .. import celery_app as ca
from .._celery import silent_server
from .test_broker_db import broker_db1 as broker_db1


@pytest.fixture(autouse=True)
def _collect_leaked_probe_connections() -> Iterator[None]:
    """Connections left for the collector (these apps' lock clients) are collected here,
    not in a later test, whose ResourceWarning would fail it."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def _db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}"


def _stat(client: redis.Redis, section: str, name: str) -> int:
    return int(client.info(section).get(name, 0))


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture
def two_servers(redis_server_factory: Any) -> Iterator[tuple[RedisServer, RedisServer]]:
    """The locks' server, and a broker on another server that has only database 0 (a
    managed Redis, say): the probe's SELECT of the locks' database fails there."""
    locks = redis_server_factory()
    broker = redis_server_factory(extra=["--databases", "1"])
    yield locks, broker


def test_a_probe_that_raises_is_not_run_again_at_every_parking(
    two_servers: tuple[RedisServer, RedisServer],
) -> None:
    """contention._park_fallback runs at every parking in a pool process (and at every rate
    deferral) and asks broker_place each time. A probe that fails for a lasting reason
    must not be run again each time (a new TCP connection to the broker plus SET/GET/DEL on
    the locks per contended task): here the locks are in database 2 of their server and the
    broker is another server with one database (SELECT 2 fails: an error reply, which is an
    answer, kept for good; a probe without an answer is the next test's)."""
    locks, broker = two_servers
    app = Celery("attack-reprobe", broker=broker.url)
    app.conf.redislock_url = _db(locks.url, 2)
    app.conf.redislock_queues_in_other_db = True
    b, lk = broker.client(), locks.client()
    try:
        connections, sets = _stat(b, "stats", "total_connections_received"), _calls(lk, "set")
        for _ in range(20):
            assert _park_fallback(app) is True  # another server: copies are right
        probes = _stat(b, "stats", "total_connections_received") - connections
        written = _calls(lk, "set") - sets
        assert probes <= 1 and written <= 1, f"{probes} probe connections, {written} SETs"
    finally:
        b.close()
        lk.close()
        app.close()


def _window_over(app: Any) -> None:
    """End the retry windows of the app's failed probes now (as RETRY_AFTER passing would:
    a test need not race a short window on a loaded machine)."""
    for uri in queuelists._retry_at.get(app, {}):
        queuelists._retry_at[app][uri] = 0.0
    cached = envelope._push_targets.get(app)
    if cached is not None and cached[4] is not None:  # (the time it was built to wait for)
        envelope._push_targets[app] = (*cached[:4], 0.0)


@pytest.fixture(autouse=True)
def _shared_app_configured(celery_broker: RedisServer) -> None:
    """The shared test app (whose task ``_consumer_parker`` reads the lock options of) is
    configured before any test here first reads and caches its settings: a later test
    file of the same process would otherwise find them made for the default URL."""


@contextlib.contextmanager
def _consumer_parker(app: Any) -> Iterator[Parker | None]:
    """``Parker.for_consumer`` for ``hold_for`` with a consumer whose connection is the
    app's broker's (released after)."""
    controller = SimpleNamespace(state=SimpleNamespace(revoked=set()), max_concurrency=4)
    consumer = SimpleNamespace(connection=app.connection_for_read(), controller=controller)
    try:
        yield Parker.for_consumer(ca.hold_for, app, consumer)
    finally:
        consumer.connection.release()


@pytest.fixture
def broker_user(redis_server_factory: Any) -> Iterator[Any]:
    """``broker_user(user, *rules)``: a new server's admin client, and an app whose broker
    is its database 1 as ACL ``user`` (``rules`` besides all commands and channels), its
    locks database 0 with the setting on; both closed after the test."""
    made: list[tuple[redis.Redis, Celery]] = []

    def make(user: str, *rules: str) -> tuple[redis.Redis, Celery]:
        server = redis_server_factory()
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", user, *rules, ">pw", "&*", "+@all")
        url = _db(server.url, 1).replace("://", f"://{user}:pw@")
        app = Celery(f"attack-{user}", broker=url)
        app.conf.redislock_url = server.url
        app.conf.redislock_queues_in_other_db = True
        made.append((admin, app))
        return admin, app

    yield make
    for admin, app in made:
        admin.close()
        app.close()


def test_push_targets_follow_the_place_once_a_failed_probe_succeeds(
    broker_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """envelope.push_targets caches its lists per app. Built while a probe had failed (a
    timeout, a broker user briefly disabled) they name "celery" in the locks' database;
    once a probe succeeds, _park_fallback and Parker go on with Place(1, 0) and park
    envelopes for "celery\\r1\\r0", and the push targets must follow: else no release in
    that process pushes a parked envelope itself (each comes back to the worker: a round
    trip more per hand-over) and run-on (runon._next_of checks the list against
    push_targets) never applies there. Another probe's place, found in the process, builds
    them again."""
    admin, app = broker_user("brk", "off", "~*")
    monkeypatch.setattr(queuelists, "RETRY_AFTER", 0.0)  # (a failed probe: tried again)
    first = push_targets(app)[0]  # the probe cannot log in (a user disabled): no place
    assert first == "celery"
    admin.execute_command("ACL", "SETUSER", "brk", "on")
    assert broker_place(app) == Place(1, 0)  # probed again: found now
    assert not _park_fallback(app)  # and parking goes on with qualified names
    assert push_targets(app)[0] == Place(1, 0).name("celery")


def test_a_release_alone_asks_again_once_a_failed_probe_may_be_tried_again(
    broker_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool process's releases ask push_targets only (TaskLock.push_to): with fallback
    copies off and no rate, nothing else there would ever run the probe again. Push targets
    built while a failed probe waits are built again (and the probe run) once it may be
    tried again, and not before: a release within the window costs no probe."""
    admin, app = broker_user("brk", "off", "~*")
    app.conf.redislock_park_fallback = False
    assert push_targets(app)[0] == "celery"  # the probe cannot log in: no place
    admin.execute_command("ACL", "SETUSER", "brk", "on")
    sets = _calls(admin, "set")
    for _ in range(20):  # within the window: the cached lists, no probe
        assert push_targets(app)[0] == "celery"
    assert _calls(admin, "set") == sets
    _window_over(app)
    assert push_targets(app)[0] == Place(1, 0).name("celery")  # probed again, found
    assert _calls(admin, "set") == sets + 1
    for _ in range(5):  # an answer now: kept, no more probes
        assert push_targets(app)[0] == Place(1, 0).name("celery")
    assert _calls(admin, "set") == sets + 1


def test_push_targets_built_while_another_thread_finds_the_place_are_built_again(
    broker_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread's push_targets gets no place (a failed probe's window), and before it
    stores its lists another thread's probe finds the place: the lists it stores name the
    plain list, and must not be kept under the count that says a place was found."""
    _, app = broker_user("brk", "on", "~*")
    found = queuelists.broker_answer

    def none_while_another_thread_finds_it(app_: Any) -> Any:
        other = threading.Thread(target=found, args=(app_,))
        other.start()
        other.join()
        return None, time.monotonic() + 60  # this thread's answer, from before the probe

    monkeypatch.setattr(queuelists, "broker_answer", none_while_another_thread_finds_it)
    assert push_targets(app)[0] == "celery"
    monkeypatch.setattr(queuelists, "broker_answer", found)
    assert push_targets(app)[0] == Place(1, 0).name("celery")


def test_a_probe_without_an_answer_is_tried_again_after_its_window_and_only_then(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker that does not answer (nothing listens on its port: a connection error) is
    taken as another server for RETRY_AFTER, at no cost per parking, then probed again."""
    app = Celery("attack-no-answer", broker=f"redis://127.0.0.1:{free_port()}/0")
    app.conf.redislock_url = redis_server.url
    locks = redis_server.client()
    try:
        sets = _calls(locks, "set")
        for _ in range(20):
            assert _park_fallback(app) is True  # another server, as far as can be told
        assert _calls(locks, "set") == sets + 1  # one probe key: one probe
        _window_over(app)
        assert _park_fallback(app) is True
        assert _calls(locks, "set") == sets + 2  # its window over: probed again, once
        assert queuelists.broker_answer(app)[1] is not None  # a new window
    finally:
        locks.close()
        app.close()


def test_callers_that_come_while_a_probe_runs_wait_for_its_answer(
    broker_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads asking while a probe runs (a pool process's release and its look-ahead, the
    sweeper) wait for it and take its answer: one probe, the same place for all."""
    _, app = broker_user("wait", "on", "~*")
    probe, probes = queuelists._probe, []

    def slow_probe(app_: Any, uri: str) -> Any:
        probes.append(uri)
        time.sleep(0.3)
        return probe(app_, uri)

    monkeypatch.setattr(queuelists, "_probe", slow_probe)
    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(broker_place(app))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert answers == [Place(1, 0)] * 4 and len(probes) == 1, (answers, probes)


def _probe_in_child(app: Any, uri: str, out: Any) -> None:
    started = time.monotonic()
    place_of(app, uri)
    out.put(time.monotonic() - started)


def test_a_child_forked_while_a_thread_probes_does_not_wait_for_that_probe(
    broker_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefork child forked while another thread of its parent probes (the sweeper's
    refusal path, say) inherits the probe's lock held by a thread it does not have: its own
    first probe must not wait for it for ever."""
    _, app = broker_user("forked", "on", "~*")
    uri = app.conf.broker_url
    probe, probing = queuelists._probe, threading.Event()

    def slow_probe(app_: Any, uri_: str) -> Any:
        probing.set()
        time.sleep(1.0)
        return probe(app_, uri_)

    monkeypatch.setattr(queuelists, "_probe", slow_probe)
    parent = threading.Thread(target=place_of, args=(app, uri))
    parent.start()
    assert probing.wait(10)  # the parent's thread is probing now, the probe's lock held
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_probe_in_child, args=(app, uri, out))
    try:
        child.start()
        child.join(15)
        alive = child.is_alive()
        if alive:
            child.kill()
            child.join()
        assert not alive and child.exitcode == 0, "the child waited on its parent's probe"
        assert out.get(timeout=1) < 10
    finally:
        parent.join(10)


def test_a_broker_user_refused_the_probe_key_is_an_answer_not_asked_again(
    broker_user: Any,
) -> None:
    """A broker user confined to the broker's keys (NOPERM on the probe key) is an answer
    (another server, as far as this process can tell), kept: no probe per parking, one
    warning; a probe of another database is not even made with the setting off."""
    admin, app = broker_user("conf", "on", "~celery*")
    off = Celery("attack-not-probed", broker=_db(app.conf.redislock_url, 1))
    off.conf.redislock_url = app.conf.redislock_url
    try:
        before = _stat(admin, "stats", "total_connections_received")
        for _ in range(5):
            assert broker_place(app) is None and _park_fallback(app) is True
            assert broker_place(off) is None and _park_fallback(off) is True
        probes = _stat(admin, "stats", "total_connections_received") - before
        assert probes <= 2, f"{probes} connections"  # the lock client's, one probe's
        assert _calls(admin, "set") == 1  # one probe key, for the app with the setting
    finally:
        off.close()


def test_by_default_no_list_of_another_database_is_named(
    broker: RedisServer, broker_db1: Celery
) -> None:
    """A worker of the release before ``redislock_queues_in_other_db`` that releases a lock
    whose parked envelope names "<list>\\r1\\r0" pushes it, as it always did, to a key of
    that name in the locks' database, which nobody reads (the task stalls until a sweep,
    or for good with an old sweeper). So by default nothing names such a list: the broker in
    database 1 is as another server, as that release takes it (the setting is turned on
    once every worker runs a release that has it)."""
    app = Celery("default-off", broker=_db(broker.url, 1))
    app.conf.redislock_url = broker.url
    try:
        assert broker_place(app) is None
        assert _park_fallback(app) is True
        assert "\r" not in push_targets(app)[0]
        with _consumer_parker(app) as parker:
            # It parks signatures, as pool processes do: no envelope names a list.
            assert parker is not None and not parker.envelopes and parker.place is None
        app.conf.redislock_queues_in_other_db = "yes"
        _settings.pop(app, None)
        with pytest.raises(LockConfigurationError, match="redislock_queues_in_other_db"):
            settings_for(app)
    finally:
        app.close()


def test_a_probe_closes_its_connection(redis_server_factory: Any) -> None:
    """queuelists._probe reads through ``redis.Redis(connection_pool=ConnectionPool(...))``;
    ``reader.close()`` does not disconnect a pool it was given, so the probe disconnects it
    itself: no connection to the broker is left open until the collector runs (a
    ResourceWarning then)."""
    server = redis_server_factory()
    app = Celery("attack-probe-leak", broker=_db(server.url, 1))
    app.conf.redislock_url = server.url
    app.conf.redislock_queues_in_other_db = True
    watcher = server.client()
    try:
        client_for(app).ping()
        before = int(watcher.info("clients")["connected_clients"])
        assert place_of(app, _db(server.url, 1)) == Place(1, 0)
        after = int(watcher.info("clients")["connected_clients"])
        assert after == before, f"{after - before} connection(s) left open by the probe"
    finally:
        watcher.close()
        app.close()


def test_a_look_ahead_in_another_database_the_user_may_not_read_is_turned_off(
    broker: RedisServer, broker_db1: Celery, caplog: Any
) -> None:
    """In another database the look-ahead reads through a script (``queue.lua``), and a
    script's denied command is a plain ``ERR The user executing the script can't run this
    command...`` on Redis 7.0, not NOPERM: it is taken as the denial it is (look-ahead off
    for that list in this process, the release goes on), not as a failed release."""
    admin = broker.client()
    queue = "db1-lookahead-acl"
    admin.execute_command("ACL", "SETUSER", "noread1", "on", ">pw", "~*", "&*", "+@all", "-lrange")
    port = broker.url.rsplit(":", 1)[1].split("/")[0]
    user = redis.Redis.from_url(f"redis://noread1:pw@127.0.0.1:{port}/0")
    spec = f"{queue}\r1\r0"
    try:
        lock = TaskLock(user, "job:acl-db1", task_id="holder", options=ca.hold_for.lock_options())
        assert lock.take() is True
        broker_db1.send_task(ca.hold_for.name, args=("acl-db1", 0.01), queue=queue)
        assert _next_queued(ca.app, lock, spec, 64, 60) is None
        assert f"look-ahead is off for queue list {spec!r}" in caplog.text
        assert spec in _lookahead_denied
        lock.finish(hold=0, done_ttl=60)
        assert not admin.exists("redislock:{job:acl-db1}")
    finally:
        _lookahead_denied.discard(spec)
        user.close()
        admin.execute_command("ACL", "DELUSER", "noread1")
        admin.close()
        redis.Redis.from_url(_db(broker.url, 1)).delete(queue)


def test_a_soft_time_limit_during_a_probe_is_the_task_s_not_a_failed_probe(
    broker_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """billiard's SoftTimeLimitExceeded (an Exception) raised in a pool process while it
    probes is the task's time running out, not the probe's failure: place_of lets it go on
    up with no 60 s window, and push targets built then (broker_place, on a release's path,
    gives None for it) are built again at the next release, which probes again."""
    from billiard.exceptions import SoftTimeLimitExceeded

    _, app = broker_user("soft", "on", "~*")
    uri = app.conf.broker_url
    probe = queuelists._probe

    def out_of_time(app_: Any, uri_: str) -> Any:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(queuelists, "_probe", out_of_time)
    with pytest.raises(SoftTimeLimitExceeded):
        place_of(app, uri)
    assert push_targets(app)[0] == "celery"  # (broker_place: None, nothing raised)
    monkeypatch.setattr(queuelists, "_probe", probe)
    assert push_targets(app)[0] == Place(1, 0).name("celery")  # probed again at once


def test_a_failed_probe_of_another_uri_does_not_rebuild_the_push_targets_each_time(
    broker_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the app's own broker's retry window rebuilds its push targets: one of another
    URI (a consumer's, a broker gone) that has passed and is never probed again must not
    make every release build them again. The app's broker here answered (a user refused
    the probe key: another server, kept)."""
    _, app = broker_user("own", "on", "~celery*")
    monkeypatch.setattr(queuelists, "RETRY_AFTER", 0.0)
    assert place_of(app, f"redis://127.0.0.1:{free_port()}/1") is None  # no answer there
    built = []
    found = queuelists.broker_answer

    def counted(app_: Any) -> Any:
        built.append(1)
        return found(app_)

    assert push_targets(app)[0] == "celery"
    monkeypatch.setattr(queuelists, "broker_answer", counted)
    for _ in range(5):
        assert push_targets(app)[0] == "celery"
    assert not built, f"built again {len(built)} times"


@pytest.mark.parametrize("action", ["drop", "drop_reply"])
@pytest.mark.parametrize("step", ["SET", "GET", "DEL"])
def test_a_probe_cut_at_any_round_trip_raises_nothing_and_leaves_nothing_for_good(
    redis_server_factory: Any, step: str, action: str
) -> None:
    """The probe's round trips (the locks' SET of the probe key, the broker-side GET, the
    locks' DEL), each cut before it runs or before its reply: the caller gets no place and
    a window (then asked again), never an exception, except for a cut DEL: the answer was
    read, and a worker's consumer, which decides parking at delivery once, must not lose it
    to the tidying; a probe key left behind expires; and once a window is over, a probe
    finds the place."""
    from celery_redislock._faultproxy import FaultProxy

    server = redis_server_factory()
    with FaultProxy(server) as proxy:
        app = Celery("attack-cut-probe", broker=f"redis://127.0.0.1:{proxy.port}/1")
        app.conf.redislock_url = f"redis://127.0.0.1:{proxy.port}/0"
        app.conf.redislock_queues_in_other_db = True
        admin = server.client()
        try:
            fault = proxy.inject(action, step)
            place, retry = queuelists.broker_answer(app)
            assert fault.fired.is_set(), fault
            if step == "DEL":  # only the probe key's tidying: the answer stands
                assert (place, retry) == (Place(1, 0), None)
            else:
                assert place is None and retry is not None, (place, retry)
            prefix = settings_for(app).defaults.prefix
            for key in admin.scan_iter(match=f"{prefix}probe:*"):
                assert 0 < admin.pttl(key) <= 10_000, key  # (it expires)
            _window_over(app)
            assert queuelists.broker_answer(app) == (Place(1, 0), None)
        finally:
            admin.close()
            app.close()


def test_a_consumer_started_while_the_probe_failed_parks_envelopes_once_it_succeeds(
    broker_user: Any,
) -> None:
    """A consumer decides how it parks at delivery when it starts (``Parker.for_consumer``).
    Started while the probe of its broker's place got no answer (a broker user briefly
    disabled), it parks signatures with fallback copies, as for another server; it must
    not stay so until the worker restarts: once the probe may run again and finds the
    place, it parks the broker's own messages. Within the window no probe is made."""
    admin, app = broker_user("brk", "off", "~*")
    with _consumer_parker(app) as parker:
        assert parker is not None and not parker.envelopes and parker.place is None
        assert parker.reprobe is not None  # (the failed probe's window)
        admin.execute_command("ACL", "SETUSER", "brk", "on")
        message = SimpleNamespace(headers={}, delivery_tag=1)
        sets = _calls(admin, "set")
        for _ in range(20):  # within the window: no probe, signatures still
            assert parker.park(message) is False
        assert _calls(admin, "set") == sets and not parker.envelopes
        _window_over(app)
        reprobe = parker.reprobe
        assert parker.park(message) is False  # (not a task message: delivered)
        reprobe.join(10)  # the probe runs in the background; the next message sees it
        assert not parker.envelopes  # (this message went before the answer)
        assert parker.park(message) is False
        assert parker.envelopes and parker.place == Place(1, 0) and parker.reprobe is None
        assert _calls(admin, "set") == sets + 1  # one probe
        for _ in range(5):
            parker.park(message)
        assert _calls(admin, "set") == sets + 1  # found: never probed again


def test_a_consumer_whose_probe_was_answered_is_not_probed_again(broker_user: Any) -> None:
    """A probe answered (a broker user confined to its own keys: NOPERM on the probe key,
    an answer) is kept: its consumer parks signatures and never probes again."""
    _admin, app = broker_user("conf", "on", "~celery*")
    with _consumer_parker(app) as parker:
        assert parker is not None and not parker.envelopes and parker.reprobe is None


def test_a_consumer_whose_broker_does_not_answer_the_probe_again_keeps_parking(
    redis_server: RedisServer,
) -> None:
    """The re-probe's round trips fail (nothing listens on the broker's port): the Parker
    does not raise, keeps parking signatures, and asks again only after a new window; the
    messages in between cost no probe."""
    app = Celery("attack-reprobe-no-answer", broker=f"redis://127.0.0.1:{free_port()}/0")
    app.conf.redislock_url = redis_server.url
    locks = redis_server.client()
    try:
        with _consumer_parker(app) as parker:
            assert parker is not None and not parker.envelopes and parker.reprobe is not None
            message = SimpleNamespace(headers={}, delivery_tag=1)
            sets = _calls(locks, "set")
            _window_over(app)
            assert parker.park(message) is False  # probed again: no answer, nothing raised
            parker.reprobe.join(10)
            assert _calls(locks, "set") == sets + 1
            again = queuelists.retry_at(app, parker.reprobe.uri)
            assert again is not None and again > time.monotonic()  # (a new window)
            assert parker.park(message) is False
            assert parker.reprobe is not None and parker.reprobe.answered() is None
            assert not parker.envelopes and parker.place is None
            for _ in range(20):  # within the new window: no probe
                assert parker.park(message) is False
            assert _calls(locks, "set") == sets + 1
    finally:
        locks.close()
        app.close()


@contextlib.contextmanager
def stalled_reprobe(locks_url: str, name: str) -> Iterator[tuple[Celery, Parker]]:
    """An app whose Redis broker refused the consumer's first probe (a window), and its
    consumer's Parker, whose first delivery after the window has started the re-probe in
    the background against a broker that takes the connection and never replies: the
    probe waits for its reply while the caller's block runs; at the block's end the
    broker's connections close (the probe's read fails: a new window) and it is joined."""
    port = free_port()
    app = Celery(name, broker=f"redis://127.0.0.1:{port}/0")
    app.conf.redislock_url = locks_url
    try:
        with _consumer_parker(app) as parker:  # (refused: a window)
            assert parker is not None and parker.reprobe is not None
            try:
                with silent_server(port):
                    _window_over(app)
                    assert parker.park(SimpleNamespace(headers={}, delivery_tag=1)) is False
                    assert parker.reprobe.probing_elsewhere()  # park did not wait for it
                    yield app, parker
            finally:
                parker.reprobe.join(15)
    finally:
        app.close()


def test_a_reprobe_that_gets_no_reply_does_not_hold_up_delivery(
    redis_server: RedisServer,
) -> None:
    """The re-probe runs in the worker's main loop's Parker: a broker that takes the
    probe's connection and never replies would hold every delivery up to the probe's
    socket timeouts (5 s each). The probe runs on a thread of its own: ``park`` returns
    while it still waits for its reply; once the reply fails, a new window, no answer."""
    with stalled_reprobe(redis_server.url, "attack-reprobe-stall") as (app, parker):
        assert parker.reprobe is not None
        reprobe, thread = parker.reprobe, parker.reprobe._thread
        message = SimpleNamespace(headers={}, delivery_tag=1)
        for _ in range(20):
            assert parker.park(message) is False  # one probe, not one per message
        assert reprobe._thread is thread
    assert reprobe._thread is None and reprobe.answered() is None
    again = queuelists.retry_at(app, reprobe.uri)
    assert again is not None and again > time.monotonic()
    assert not parker.envelopes
