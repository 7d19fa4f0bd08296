"""Attacks on the operator view (#21): the numbers the workers add to ``<prefix>stats``,
the exporter and ``redislock top`` under junk written under the prefix, and the alert
rules on counters as the exporter really serves them (a series appears at its first
count, not at 0). Real redis-server; the exporter's collector is read in process."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_redislock import metrics, series
from celery_redislock._core import LockKeys
from celery_redislock._keyspace import RateKeys, parked_registry
from celery_redislock.celery.contention import FIRST_TRY_HEADER
from celery_redislock.celery.envelope import ENVELOPE
from celery_redislock.celery.survey import survey
from celery_redislock.testing import RedisServer

from .._celery import ROOT
from .test_monitoring import run_cli

PREFIX = "redislock:"
RULES = ROOT / "monitoring" / "prometheus" / "alerts.yaml"


@pytest.fixture
def r() -> Any:
    with RedisServer() as server:
        client = server.client()
        client.url = server.url  # (for the CLI)
        yield client


def _scrape(client: Any, **kwargs: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One reading of the exporter's collector, parsed (histograms by their samples)."""
    parser = pytest.importorskip("prometheus_client.parser")
    from celery_redislock.celery.exporter import RedisLockCollector, exposition

    text = exposition(RedisLockCollector(client, PREFIX, interval=0, **kwargs))
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def _envelope(headers: dict[str, Any]) -> bytes:
    return (ENVELOPE + "\n{}\n" + json.dumps({"headers": headers})).encode()


def _park(client: Any, name: str, message: bytes, task_id: bytes = b"id-1") -> None:
    line = LockKeys.for_name(name)
    client.rpush(line.parked, task_id)
    client.hset(line.parked_messages, task_id, message)
    client.zadd(parked_registry(PREFIX), {line.lock: 0})


# ------------------------------------------------------------------ the workers' counts


def test_a_sum_of_seconds_that_adds_up_to_a_whole_number_is_still_added(r: Any) -> None:
    """A wait of 0.0 (a lock taken at once) after a fractional one: the sum's field
    already holds a fraction, and HINCRBY would be refused for it."""
    metrics.STATS.drain()
    labels = {"name": "t", "queue_name": "q", "kind": "lock"}
    waited = [0.25, 0.0, 2.0, 0.5]  # flushed one at a time: 0.0 and 2.0 are whole
    for seconds in waited:
        metrics._observe("task_wait_seconds", seconds, **labels)
        metrics.STATS.observe_wait(seconds)
        metrics.flush_to_redis(r, PREFIX, force=True)  # raised ResponseError before
    totals = metrics.numbers(r.hgetall(PREFIX + "stats"))
    assert totals[series.field("celery_redislock_task_wait_seconds_sum", labels)] == 2.75
    assert totals["wait_sum"] == 2.75
    rows = series.worker_samples(totals)["celery_redislock_task_wait_seconds"]
    ((_, (buckets, total)),) = rows
    assert buckets[-1] == ("+Inf", 4.0) and total == 2.75


def test_histogram_buckets_are_cumulative_and_the_count_is_the_inf_bucket(r: Any) -> None:
    metrics.STATS.drain()
    labels = {"name": "t", "queue_name": "q", "kind": "limit"}
    for seconds in (0.001, 0.3, 0.3, 7.0, 99999.0):
        metrics._observe("task_hold_seconds", seconds, **labels)
    metrics.flush_to_redis(r, PREFIX, force=True)
    scraped = _scrape(r)
    buckets = [
        (float(found["le"]), value)
        for found, value in scraped["celery_redislock_task_hold_seconds_bucket"]
    ]
    assert buckets == sorted(buckets)  # by bound, and the counts never go down
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert dict(buckets)[0.01] == 1 and dict(buckets)[0.5] == 3 and dict(buckets)[10.0] == 4
    assert buckets[-1] == (float("inf"), 5)
    assert scraped["celery_redislock_task_hold_seconds_count"][0][1] == 5
    assert len(buckets) == len(series.HOLD_BUCKETS) + 1


def test_a_stats_hash_deleted_and_counted_again_only_restarts_the_counters(r: Any) -> None:
    """Deleting <prefix>stats is a counter reset Prometheus' rate() handles (it restarts
    from 0); two exporters read the same totals (one hash), never different ones."""
    field = series.field(
        "celery_redislock_task_acquired_total", {"name": "t", "queue_name": "q", "kind": "lock"}
    )
    r.hset(PREFIX + "stats", field, 7)
    first, second = _scrape(r), _scrape(r)
    assert first["celery_redislock_task_acquired_total"] == [
        ({"name": "t", "queue_name": "q", "kind": "lock"}, 7.0)
    ]
    assert (
        first["celery_redislock_task_acquired_total"]
        == second["celery_redislock_task_acquired_total"]
    )
    r.delete(PREFIX + "stats")
    r.hincrby(PREFIX + "stats", field, 1)
    assert _scrape(r)["celery_redislock_task_acquired_total"][0][1] == 1.0


# ------------------------------------------------------------------ seeded zeros


def test_trouble_counters_are_served_at_0_before_their_first_count(r: Any) -> None:
    """increase() does not count a series' first sample: a counter that appears at 1
    (the exporter serves only what the hash has) never fires an alert '> 0'. The
    exporter serves 0 for the trouble counters of every task it has seen."""
    task = {"name": "t", "queue_name": "q"}
    r.hset(
        PREFIX + "stats",
        mapping={
            series.field("celery_redislock_task_acquired_total", {**task, "kind": "lock"}): 3,
            series.field("celery_redislock_task_acquired_total", {**task, "kind": "rate"}): 3,
            series.field("celery_redislock_task_parked_total", {**task, "kind": "lock"}): 1,
        },
    )
    scraped = _scrape(r)
    assert scraped["celery_redislock_parked_rejected_total"] == [({}, 0.0)]
    lost = scraped["celery_redislock_task_lease_lost_total"]
    reasons = {found["reason"] for found, value in lost if value == 0 and found["kind"] == "lock"}
    assert reasons == {*series.REASONS, "other"}
    assert {found["kind"] for found, _ in lost} == {"lock"}  # no rate: a rate holds no lease
    for name in ("renewal_failures", "release_failed"):
        rows = scraped[f"celery_redislock_task_{name}_total"]
        assert rows == [({**task, "kind": "lock"}, 0.0)]
    sweeper = [
        (found, v)
        for found, v in scraped["celery_redislock_task_handed_over_total"]
        if found["via"] == "sweeper"
    ]
    assert sweeper == [({**task, "via": "sweeper"}, 0.0)]
    # A real count is served as it is, never as a seeded 0.
    r.hset(PREFIX + "stats", series.field(
        "celery_redislock_task_lease_lost_total", {**task, "kind": "lock", "reason": "stolen"}
    ), 2)  # fmt: skip
    lost = _scrape(r)["celery_redislock_task_lease_lost_total"]
    assert [v for found, v in lost if found["reason"] == "stolen"] == [2.0]


# ------------------------------------------------------------------ junk under the prefix


def _junk(client: Any) -> None:
    """What the package never writes, where the survey reads: a hold count of 5000
    digits (int() refuses it), first-try and deferral times too large for a float, a
    stats hash with fields that are not numbers, and keys of the wrong type."""
    client.hset(LockKeys.for_name("junk-digits").lock, "owner", "9" * 5000)
    _park(client, "junk-first-try", _envelope({"task": "t.a", FIRST_TRY_HEADER: 10**400}))
    rate = RateKeys.for_name("junk-rate", PREFIX)
    client.rpush(rate.deferred, b"x\n" + json.dumps({"deferred_at": 10**400}).encode())
    client.hset(PREFIX + "stats", mapping={"acquired": "many", b"\xff\xfe": 1, "x{": "nan"})
    client.set(LockKeys.for_name("junk-string").parked, "not a list")
    client.set(parked_registry(PREFIX) + ":x", "x")


def _good(client: Any) -> None:
    client.hset(LockKeys.for_name("good").lock, "run-1", 1)
    client.pexpire(LockKeys.for_name("good").lock, 60_000)
    client.hset(
        PREFIX + "stats",
        series.field(
            "celery_redislock_task_acquired_total", {"name": "t", "queue_name": "q", "kind": "lock"}
        ),
        5,
    )


def test_junk_under_the_prefix_leaves_out_its_key_never_the_survey(r: Any) -> None:
    _junk(r)
    _good(r)
    state = survey(r, PREFIX)  # raised ValueError / OverflowError before
    names = {key.name for key in state.keys}
    assert "good" in names and "junk-digits" not in names
    first_try = [k for k in state.keys if "junk-first-try" in k.name]
    assert [(k.parked, k.parked_by_task, k.oldest_wait) for k in first_try] == [
        (1, {"t.a": 1}, None)
    ]
    scraped = _scrape(r)
    assert scraped["celery_redislock_exporter_redis_up"] == [({}, 1.0)]
    assert scraped["celery_redislock_held"] == [({"kind": "lock"}, 1.0), ({"kind": "limit"}, 0.0)]
    assert ({"name": "t", "queue_name": "q", "kind": "lock"}, 5.0) in scraped[
        "celery_redislock_task_acquired_total"
    ]


def test_the_counters_are_served_when_the_survey_fails(
    r: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A survey that fails for anything but Redis (a bug, junk it did not expect) costs
    the gauges of that scrape, not the counters: series that vanish break rate()."""
    from celery_redislock.celery import exporter

    def broken(*_: Any) -> Any:
        raise ValueError("junk")

    _good(r)
    monkeypatch.setattr(exporter, "survey", broken)
    scraped = _scrape(r)
    assert scraped["celery_redislock_task_acquired_total"][0][1] == 5.0
    assert scraped["celery_redislock_exporter_redis_up"] == [({}, 1.0)]
    assert "celery_redislock_held" not in scraped


def test_a_redis_that_is_down_is_said_by_redis_up_and_top_says_it_plainly() -> None:
    with RedisServer() as server:
        client, url = server.client(), server.url
    scraped = _scrape(client)  # (the server is gone)
    assert scraped["celery_redislock_exporter_redis_up"] == [({}, 0.0)]
    assert not any(name.endswith("_total") for name in scraped)
    for args in (("top", "--json"), ("top", "--once"), ("exporter", "--once")):
        done = run_cli(url, *args)
        if args[0] == "exporter":
            assert done.returncode == 0, done.stderr
            assert "celery_redislock_exporter_redis_up 0.0" in done.stdout
        else:
            assert done.returncode == 1 and "unreachable" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr


def test_top_on_an_empty_redis_and_on_junk(r: Any) -> None:
    empty = run_cli(r.url, "top", "--json")
    assert empty.returncode == 0, empty.stderr
    assert (
        json.loads(empty.stdout)["keys"] == [] and json.loads(empty.stdout)["totals"]["keys"] == 0
    )
    assert run_cli(r.url, "top", "--once").returncode == 0
    _junk(r)
    _good(r)
    _park(r, "good", _envelope({"task": "t.\x1b[2Jcleared"}))
    found = run_cli(r.url, "top", "--json")
    assert found.returncode == 0, found.stderr
    keys = {key["name"]: key for key in json.loads(found.stdout)["keys"]}
    assert keys["good"]["holders"] == 1 and keys["good"]["parked"] == 1
    frame = run_cli(r.url, "top", "--once")
    assert frame.returncode == 0, frame.stderr
    assert "good" in frame.stdout and "\x1b[2J" not in frame.stdout


def test_the_last_counts_of_a_process_reach_redis_while_it_is_idle(r: Any) -> None:
    import time

    metrics.keep_flushing()  # (as a worker process does at its start)
    metrics.STATS.drain()
    metrics.flush_to_redis(r, PREFIX, force=True)  # a run ended: flushed
    metrics._count("task_lease_lost_total", name="t", queue_name="q", kind="lock", reason="expired")
    metrics.flush_to_redis(r, PREFIX)  # the next run ended within the second: not due
    deadline = time.monotonic() + 5  # (then the process idles: nothing more calls it)
    while time.monotonic() < deadline and not r.exists(PREFIX + "stats"):
        time.sleep(0.1)
    try:
        assert r.exists(PREFIX + "stats"), "the lease lost is still only in the process"
    finally:
        metrics.keep_flushing(False)  # (this test process's other tests count on their own)
        metrics.STATS.drain()


def test_ls_and_show_read_a_hold_count_of_thousands_of_digits(broker: Any) -> None:
    """Junk under the prefix (a hold count no script writes) is left out of ``show`` and
    ``ls``, never a traceback."""
    from celery.bin.celery import celery as celery_command
    from click.testing import CliRunner

    r = broker.client()
    r.hset(b"redislock:{junk:digits}", mapping={"someone": "9" * 5000, "__fence__": "3"})
    r.pexpire(b"redislock:{junk:digits}", 60_000)
    try:
        for args in (["ls"], ["show", "junk:digits"]):
            found = CliRunner().invoke(
                celery_command, ["-A", "tests.celery_app", "redislock", *args]
            )
            assert found.exception is None or isinstance(found.exception, SystemExit), found.output
            assert "Traceback" not in found.output
    finally:
        r.delete(b"redislock:{junk:digits}")


def test_a_debounced_call_waiting_for_quiet_shows_as_deferred_on_its_key(r: Any) -> None:
    """A last-call-wins key whose pending call waits for its quiet period (lock_debounce):
    top and the exporter count it as deferred on the key, due when the quiet period ends;
    one waiting for the lock (pd 0) is parked, not deferred; junk in the registry is
    left out."""
    from celery_redislock._keyspace import debounce_registry

    latest = LockKeys.for_name("mon-debounced:k").latest
    waiting = LockKeys.for_name("mon-debounced:parked").latest
    seconds, _ = r.time()
    message = "S" + "0" * 64 + "\n" + json.dumps({"task": "tests.debounced", "args": []})
    r.hset(latest, mapping={"p": "c1", "pt": "c1", "pd": (seconds + 5) * 1000, "pm": message})
    r.hset(waiting, mapping={"p": "c2", "pt": "c2", "pd": "0"})
    r.zadd(debounce_registry(PREFIX), {latest: 1, waiting: 1, b"junk": 1})
    found = {state.name: state for state in survey(r, PREFIX).keys}
    assert set(found) == {"mon-debounced:k"}, found
    state = found["mon-debounced:k"]
    assert (state.kind, state.deferred, state.deferred_task) == ("lock", 1, "tests.debounced")
    assert state.head_due is not None and 3 < state.head_due <= 5
    scraped = _scrape(r)
    assert ({"name": "tests.debounced"}, 1.0) in scraped["celery_redislock_deferred"]
