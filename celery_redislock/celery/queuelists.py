"""Where a Redis broker's queue lists are, as the locks' scripts reach them.

kombu's Redis transport keeps each queue in a list of the broker's database. When the
broker is the locks' server, a task parked at delivery (``parking``) is pushed back into
its queue list by the release that hands it the lock, in the same atomic step, and the
look-ahead (``lookahead``) moves a queued task of a busy lock ahead in that list. That
holds in the locks' own database and in any other database of the same server: a script
may ``SELECT`` another database for a command and select its own again after.

A queue list is therefore named, wherever the scripts and the workers pass it (a parked
envelope's entry and signature, the push targets, the look-ahead header), either as it is
(the broker in the locks' database) or as ``"<list>\\r<db>\\r<own>"``: list ``<list>`` in
database ``<db>`` of the locks' server, ``<own>`` the locks' database (``envelope.lua``'s
``list_call``; :func:`queue_call` for the worker's own reads and pushes).

Which it is, is found once per app and broker URL in a process (:func:`place_of`): a key
the locks' client writes under the locks' prefix is read back through the broker's URL
with the locks' database selected. Anything else (another server, a Sentinel or Cluster
client) is out of reach: no parking at delivery, the pool process parks. A probe that
fails (an error, not an answer) counts as out of reach for ``RETRY_AFTER`` seconds, then
runs again. Another database is reached only with ``redislock_queues_in_other_db`` (a
release before it would push such a list's message into the locks' database).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from typing import Any, NamedTuple

import redis
from billiard.exceptions import SoftTimeLimitExceeded

from .._keyspace import probe_key
from .._process import on_fork
from .._scripts import run, scripts_for
from .clients import client_for, settings_for

log = logging.getLogger(__name__)

#: Between a queue list's name and its database in a qualified name (never in a queue list
#: a worker qualifies).
SEP = "\r"


class Place(NamedTuple):
    """The broker's database and the locks' on one server."""

    db: int
    own: int

    def name(self, queue_list: str) -> str | None:
        """``queue_list`` as the scripts name it (None: it cannot be named so)."""
        if self.db == self.own:
            return queue_list
        if SEP in queue_list:
            return None
        return f"{queue_list}{SEP}{self.db}{SEP}{self.own}"


#: Per app: broker URI -> its place (None: out of reach), for answers the probe gave.
_places: weakref.WeakKeyDictionary[Any, dict[str, Place | None]] = weakref.WeakKeyDictionary()
#: Per app: broker URI -> when a probe that failed may run again (``time.monotonic``).
_retry_at: weakref.WeakKeyDictionary[Any, dict[str, float]] = weakref.WeakKeyDictionary()
#: Per app: the app's broker_url setting -> the URI of the connection it gives.
_uris: weakref.WeakKeyDictionary[Any, dict[Any, str]] = weakref.WeakKeyDictionary()
_mutex = threading.Lock()
#: One probe at a time in a process: a caller that comes while one runs waits for its
#: answer (a consumer starting decides its parking at delivery once, from it).
_probing = threading.Lock()
#: How many places probes have found in this process (push targets built before one was
#: found are built again: ``envelope.push_targets``).
found_count = 0
#: Seconds a probe that failed is not tried again (each try is a connection to the broker
#: and three commands on the locks: a parking or a rate deferral must not pay it each time).
RETRY_AFTER = 60.0


@on_fork
def _forked() -> None:
    """A child forked while another thread of its parent probed (the sweeper's, say)
    would find ``_probing`` held for good, and ``_mutex`` held for a moment: new ones."""
    global _mutex, _probing
    _mutex = threading.Lock()
    _probing = threading.Lock()
    # A re-probe's thread is not the child's: one copied as running would answer "not
    # known" for good there (``place_of``). The child probes for itself.
    _reprobes.clear()


def place_of(app: Any, uri: str) -> Place | None:
    """The place of the Redis broker at ``uri`` (with its password) relative to the app's
    locks, or None: out of reach (another server; an error reply, such as a database the
    broker's server does not have or a broker user refused the probe key; another database
    without ``redislock_queues_in_other_db``, not probed). Probed once per app and URI in a
    process; a probe that failed to get an answer (a connection error, a timeout) counts as
    None and runs again after ``RETRY_AFTER`` seconds. While a :class:`Reprobe` of it runs
    on another thread, None at once (the caller does not wait for it)."""
    if not uri.startswith(("redis://", "rediss://", "unix://")):
        return None
    with _mutex:
        known = _places.setdefault(app, {})
        if uri in known:
            return known[uri]
        reprobe = _reprobes.get(app, {}).get(uri)
    if reprobe is not None and reprobe.probing_elsewhere():
        return None  # (the worker's main loop: never waits for a background probe)
    with _probing:
        with _mutex:
            if uri in known:  # (found while this caller waited)
                return known[uri]
            retry = _retry_at.setdefault(app, {})
            again = retry.get(uri)
            if again is not None and time.monotonic() < again:
                return None
        try:
            found = _probe(app, uri)
        except SoftTimeLimitExceeded:
            # The task's time ran out, not the probe's: a window already over (the next
            # caller probes; push targets built meanwhile are built again at once).
            with _mutex:
                retry[uri] = time.monotonic()
            raise
        except Exception as exc:
            with _mutex:
                retry[uri] = time.monotonic() + RETRY_AFTER
            log.log(
                logging.WARNING if again is None else logging.DEBUG,
                "redislock: could not find whether the broker is the locks' Redis server "
                "(%s); taken as another server, asked again in %.0f s",
                exc,
                RETRY_AFTER,
            )
            return None
        global found_count
        with _mutex:
            known[uri] = found
            retry.pop(uri, None)
            found_count += found is not None
        return found


def broker_place(app: Any) -> Place | None:
    """:func:`place_of` the app's own broker (its ``broker_url``), or None; never raises
    (a pool process asks: it has no consumer connection to ask about)."""
    return broker_answer(app)[0]


def broker_answer(app: Any) -> tuple[Place | None, float | None]:
    """:func:`broker_place`, and with no place, when a probe of that broker that failed
    may run again (``time.monotonic``; None: no probe waits to be tried again). Push
    targets built while one waits are built again after it (``envelope.push_targets``)."""
    uri = None
    try:
        setting = app.conf.broker_url
        with _mutex:
            uri = _uris.setdefault(app, {}).get(setting)
        if uri is None:
            connection = app.connection_for_read()
            try:
                driver = connection.transport.driver_type
                uri = connection.as_uri(include_password=True) if driver == "redis" else ""
            finally:
                connection.release()
            with _mutex:
                _uris[app][setting] = uri
        place = place_of(app, uri) if uri else None
    except Exception:  # (a soft time limit in a probe too: its window is over already)
        log.debug("redislock: where the broker's queue lists are is not known", exc_info=True)
        place = None
    if place is not None or not uri:
        return place, None
    return None, retry_at(app, uri)


def retry_at(app: Any, uri: str) -> float | None:
    """When a failed probe of the broker at ``uri`` may run again (``time.monotonic``);
    None: no probe of it waits to be tried again (its place is known, or was never asked)."""
    with _mutex:
        return _retry_at.get(app, {}).get(uri)


class Reprobe:
    """A probe of the broker at ``uri`` that got no answer, asked again off the caller's
    thread once its window (``RETRY_AFTER``) is over: the worker's main loop, which parks at
    delivery, never waits for a broker that does not answer (up to the probe's 5 s socket
    timeouts). Shared by the callers of one app and URI (:func:`reprobe_for`): one probe
    thread at a time. Its answer is :func:`place_of`'s, kept where that keeps it."""

    def __init__(self, app: Any, uri: str) -> None:
        self._app = weakref.ref(app)
        self.uri = uri
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def answered(self) -> tuple[Place | None] | None:
        """(place,) once a probe answered (place None: out of reach for good); else None."""
        app = self._app()
        with _mutex:
            known = _places.get(app, {}) if app is not None else {}
            return (known[self.uri],) if self.uri in known else None

    def poll(self) -> tuple[Place | None] | None:
        """The answer, if a probe gave one; else None, and a probe started in the
        background if its window is over and none runs."""
        answer = self.answered()
        if answer is not None or self._thread is not None:
            return answer
        app = self._app()
        again = None if app is None else retry_at(app, self.uri)
        if app is None or (again is not None and time.monotonic() < again):
            return None
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="redislock-probe", daemon=True
                )
                self._thread.start()
        return None

    def probing_elsewhere(self) -> bool:
        """Whether this probe runs now, on another thread than the caller's."""
        thread = self._thread
        return thread is not None and thread is not threading.current_thread()

    def join(self, timeout: float | None = None) -> None:
        """Wait for a probe running now (tests)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        app = self._app()
        try:
            if app is not None:
                place_of(app, self.uri)  # (its own errors: no answer and a new window)
        except Exception:  # not the probe's: a new window all the same
            log.debug("redislock: could not probe the broker's place again", exc_info=True)
            with _mutex:
                _retry_at.setdefault(app, {})[self.uri] = time.monotonic() + RETRY_AFTER
        finally:
            self._thread = None


_reprobes: weakref.WeakKeyDictionary[Any, dict[str, Reprobe]] = weakref.WeakKeyDictionary()


def reprobe_for(app: Any, uri: str) -> Reprobe | None:
    """The app's :class:`Reprobe` of the broker at ``uri`` if a probe of it got no answer
    (its window runs), else None (its place is known, or it was never asked)."""
    if retry_at(app, uri) is None:
        return None
    with _mutex:
        reprobes = _reprobes.setdefault(app, {})
        found = reprobes.get(uri)
        if found is None:
            found = reprobes[uri] = Reprobe(app, uri)
        return found


def _probe(app: Any, uri: str) -> Place | None:
    locks = client_for(app)
    pool = getattr(locks, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return None  # a Cluster client, or one of a kind this does not know
    own = int(kwargs.get("db") or 0)
    broker_pool = redis.ConnectionPool.from_url(uri, socket_timeout=5, socket_connect_timeout=5)
    db = int(broker_pool.connection_kwargs.get("db") or 0)
    if db != own and not settings_for(app).queues_in_other_db:
        return None  # (whatever the server: another database is out of reach then)
    options = {**broker_pool.connection_kwargs, "db": own}
    kind = broker_pool.connection_class
    reader = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=kind, **options))
    probe = probe_key(settings_for(app).defaults.prefix, uuid.uuid4().hex)
    nonce = uuid.uuid4().hex
    try:
        locks.set(probe, nonce, px=10_000)
        try:
            same = reader.get(probe) == nonce.encode()
        except redis.ResponseError as exc:  # an answer: a database the broker's server lacks,
            same = False  # a broker user refused the key; this is no server to reach then
            log.warning("redislock: the broker is taken as another server (%s)", exc)
        finally:
            try:
                locks.delete(probe)
            except redis.RedisError:  # only tidying: the key expires, and the answer stands
                log.debug("redislock: could not delete the probe key %r", probe, exc_info=True)
    finally:
        reader.close()
        reader.connection_pool.disconnect()  # (a pool passed in is not closed with it)
        broker_pool.disconnect()
    return Place(db, own) if same else None


def queue_call(client: Any, command: str, queue_list: str, *args: Any) -> Any:
    """``command`` (``LRANGE``, ``LREM`` or ``RPUSH``) on the queue list named
    ``queue_list`` (:class:`Place`), sent by the locks' ``client``: as it is in the locks'
    database, through the ``queue`` script in another one (one round trip either way)."""
    if SEP not in queue_list:
        return client.execute_command(command, queue_list, *args)
    return run(client, scripts_for(client).queue, [queue_list], [command.lower(), *args])
