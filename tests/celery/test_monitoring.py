"""The dashboard, the alert rules, ``redislock exporter`` and ``redislock top`` against a
real run: a real ``celery worker`` (prefork) on a private redis-server, driven through
every feature the dashboard and alerts watch.

The series the dashboard and the rules use are not listed here: they are read from
their PromQL (:func:`metric_names`), and each must be produced by the run, as
``celery -A tests.monitoring_app redislock exporter --once`` serves it. A feature added
to the package adds its panel or rule, and a scenario to :data:`LIVE` or :data:`AFTER`
that makes the run produce its series (see :data:`AWAITING_SENDER` for the ones whose
senders are not in yet).
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from celery_redislock import series
from celery_redislock._core import LockKeys
from celery_redislock._keyspace import RateKeys, SemaphoreKeys, parked_registry
from celery_redislock.testing import RedisServer

from .. import monitoring_app as mon
from .._celery import ROOT, CeleryProcess, wait_until, worker

DASHBOARD = ROOT / "monitoring" / "grafana" / "celery-redislock.json"
RULES = ROOT / "monitoring" / "prometheus" / "alerts.yaml"
METRICS_DOC = ROOT / "docs" / "metrics.md"

#: Series the dashboard or the rules use whose senders are not in the package yet, so no
#: run can produce them: what will send each. The test fails as soon as the run produces
#: one (take it out of here then): this list only shrinks.
AWAITING_SENDER: dict[str, str] = {}


# ------------------------------------------------------------------ PromQL


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-z]*|[A-Za-z_:][A-Za-z0-9_:]*|\S")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions or
    aggregations (followed by ``(``), keywords, label names (in ``{...}``, ``by (...)``),
    durations (in ``[...]``), numbers, strings, or Grafana variables."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers (strings already blanked)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\boffset\s+\S+", " ", text)
    tokens = _TOKEN.findall(text)
    names = set()
    for index, token in enumerate(tokens):
        if not re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token) or token.lower() in _KEYWORDS:
            continue
        following = tokens[index + 1] if index + 1 < len(tokens) else ""
        previous = tokens[index - 1] if index else ""
        if following == "(" or previous == "$":
            continue
        names.add(token)
    return names


def dashboard_expressions() -> list[str]:
    found: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend(t["expr"] for t in panel.get("targets", ()) if t.get("expr"))
            walk(panel.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text())
    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            text = query["query"] if isinstance(query, dict) else query
            inner = re.fullmatch(r"label_values\((\w+),\s*\w+\)", text)
            assert inner, f"a variable query this test cannot read: {text!r}"
            found.append(inner.group(1))
    return found


def rule_expressions() -> list[str]:
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def series_of(metric: str) -> str | None:
    """The vocabulary's series a metric name (or a histogram's sample name) belongs to."""
    if metric in series.BY_NAME:
        return metric
    for suffix in ("_bucket", "_sum", "_count"):
        base = metric[: -len(suffix)]
        found = series.BY_NAME.get(base) if metric.endswith(suffix) else None
        if found is not None and found.type == series.HISTOGRAM:
            return base
    return None


def test_metric_names_are_read_from_promql_and_nothing_else() -> None:
    expr = (
        'sum by (name, le) (rate(a_total{name=~"$name",x="by(y)"}[$__rate_interval] offset 5m))'
        " / on (kind) group_left() b:recorded > 3 * histogram_quantile(0.99, c_bucket[1h])"
        " and bool d unless absent(e) or 1e3 > 2"
    )
    assert metric_names(expr) == {"a_total", "b:recorded", "c_bucket", "d", "e"}


def test_the_dashboard_and_the_rules_use_only_the_vocabulary() -> None:
    dashboard = dashboard_expressions()
    rules = rule_expressions()
    assert len(dashboard) >= 20 and len(rules) >= 8  # the parsers saw them all
    for expr in dashboard + rules:
        names = metric_names(expr)
        assert names, f"no series in {expr!r}"
        unknown = {n for n in names if series_of(n) is None}
        assert not unknown, f"{expr!r} uses series the package does not export: {unknown}"


def test_every_series_is_documented_with_its_question() -> None:
    doc = METRICS_DOC.read_text()
    for found in series.ALL_SERIES:
        assert f"`{found.name}`" in doc, f"{found.name} is not in docs/metrics.md"
        assert found.question in doc, f"{found.name}'s question is not in docs/metrics.md"


def test_each_series_row_of_the_doc_is_the_vocabulary_s() -> None:
    """docs/metrics.md's tables say what the exporter's HELP says: type, labels, question
    and what it counts, as in celery_redislock.series (the one place they are written)."""
    rows = {}
    for line in METRICS_DOC.read_text().splitlines():
        if line.startswith("| `" + series.NAMESPACE):
            name, *cells = (cell.strip() for cell in line.strip().strip("|").split("|"))
            rows[name.strip("`")] = cells
    assert set(rows) == set(series.BY_NAME)
    for found in series.ALL_SERIES:
        labels = ", ".join(f"`{label}`" for label in found.labels) or "—"
        assert rows[found.name] == [found.type, labels, found.question, found.help], found.name


_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _blank(expr: str) -> str:
    """``expr`` with each string's text blanked (its length kept): no brace, comma or
    ``=`` inside a string is read as PromQL."""
    return _STRING.sub(lambda m: m.group()[0] + "x" * (len(m.group()) - 2) + m.group()[-1], expr)


def _labels_of(metric: str) -> set[str]:
    name = series_of(metric)
    assert name is not None, metric
    return set(series.BY_NAME[name].labels) | ({"le"} if metric.endswith("_bucket") else set())


def test_the_dashboard_and_the_rules_use_only_the_labels_their_series_carry() -> None:
    """A matcher or a grouping on a label its series lacks selects or groups nothing (a
    queue filter on a gauge would empty its panel once a queue is picked)."""
    checked = 0
    for expr in dashboard_expressions() + rule_expressions():
        text = _blank(expr)
        for metric, matchers in _SELECTOR.findall(text):
            used, carries = set(_MATCHER.findall(matchers)), _labels_of(metric)
            assert used <= carries, f"{expr!r}: {metric} has no {used - carries}"
            checked += len(used)
        carried = set().union(*(_labels_of(n) for n in metric_names(expr)))
        for group in _GROUPS.findall(text):
            used = {label.strip() for label in group.split(",") if label.strip()}
            assert used <= carried, f"{expr!r}: no series of it has {used - carried}"
            checked += len(used)
    assert checked >= 50  # (the parsers saw them)


def test_the_label_checks_read_matchers_and_groupings() -> None:
    expr = 'sum by (name, le) (rate(a_total{name=~"$name",x="by(y)"}[5m]))'
    text = _blank(expr)
    assert _SELECTOR.findall(text) == [("a_total", 'name=~"xxxxx",x="xxxxx"')]
    assert _MATCHER.findall(_SELECTOR.findall(text)[0][1]) == ["name", "x"]
    assert _GROUPS.findall(text) == ["name, le"]


def _promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


@pytest.mark.skipif(
    _promtool() is None,
    reason="promtool not found (set PROMTOOL; ./dev test takes it from Debian's prometheus "
    "package where apt-get can): rules not checked",
)
def test_promtool_accepts_the_rules_and_the_dashboards_queries() -> None:
    promtool = _promtool()
    assert promtool is not None
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The dashboard's queries, as recording rules (Grafana's variables given values).
    yaml = pytest.importorskip("yaml")
    rules = []
    for index, expr in enumerate(dashboard_expressions()):
        text = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
        text = re.sub(r"\$\w+", ".*", text)
        rules.append({"record": f"dashboard:query_{index}", "expr": text})
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "dashboard-queries.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        checked = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.skipif(
    _promtool() is None,
    reason="promtool not found (set PROMTOOL; ./dev test takes it from Debian's prometheus "
    "package where apt-get can): alerts not run",
)
def test_each_alert_fires_on_what_should_fire_it_and_not_before() -> None:
    """monitoring/prometheus/alerts.test.yaml: promtool's unit tests of the rules."""
    promtool = _promtool()
    assert promtool is not None
    tests = RULES.with_name("alerts.test.yaml")
    checked = subprocess.run(
        [promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    yaml = pytest.importorskip("yaml")
    tested = {
        case["alertname"]
        for group in yaml.safe_load(tests.read_text())["tests"]
        for case in group["alert_rule_test"]
        if case["exp_alerts"]
    }
    rules = yaml.safe_load(RULES.read_text())
    assert tested == {r["alert"] for g in rules["groups"] for r in g["rules"]}  # every alert


# ------------------------------------------------------------------ the real run


@dataclass
class Run:
    """What the module's real run saw."""

    live: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    after: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    top_json: dict[str, Any] = field(default_factory=dict)
    top_frame: str = ""
    results: dict[str, Any] = field(default_factory=dict)

    def produced(self) -> set[str]:
        """The series the run served; a counter only with a count (the exporter serves
        the trouble counters at 0 before their first count: that is not producing them)."""
        return {
            name
            for scrape in (self.live, self.after)
            for name, rows in scrape.items()
            if rows and (series.BY_NAME[name].type != series.COUNTER or any(v > 0 for _, v in rows))
        }

    def value(self, scrape: str, series_name: str, **labels: str) -> float:
        rows = getattr(self, scrape).get(series_name, [])
        return sum(v for found, v in rows if labels.items() <= found.items())


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.monitoring_app redislock ARGS`` against ``url``, as run."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.monitoring_app", "redislock", *args],
        cwd=ROOT,
        env={**os.environ, "REDISLOCK_TEST_URL": url, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _cli(url: str, *args: str) -> str:
    done = run_cli(url, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``redislock exporter --once``, parsed: per series, its samples' labels and values
    (a histogram's by its ``_count`` samples)."""
    parser = pytest.importorskip("prometheus_client.parser")
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in parser.text_string_to_metric_families(_cli(url, "exporter", "--once")):
        for sample in family.samples:
            name = series_of(sample.name)
            if name is None or sample.name.endswith(("_bucket", "_sum")):
                continue
            found.setdefault(name, []).append((dict(sample.labels), sample.value))
    return found


Scenario = Callable[[Any], dict[str, Any]]


def _contention(r: Any) -> dict[str, Any]:
    """A held lock with a run parked behind it; a limited key's two permits held with a
    run parked; a rate key with runs deferred. Returns the results, once all is seen."""
    lock, limit = LockKeys.for_name("mon-lock:k"), SemaphoreKeys.for_name("mon-limit:k")
    sent = {"hold": [mon.hold.delay("k", "gate")]}
    wait_until(lambda: r.exists(lock.lock))
    sent["hold"].append(mon.hold.delay("k", "gate"))
    sent["limited"] = [mon.limited.delay("k", "gate") for _ in range(2)]
    wait_until(lambda: r.scard(limit.line.lock) == 2)
    sent["limited"].append(mon.limited.delay("k", "gate"))
    sent["rated"] = [mon.rated.delay("k") for _ in range(3)]
    wait_until(lambda: r.llen(lock.parked) == 1 and r.llen(limit.line.parked) == 1)
    wait_until(lambda: r.llen(RateKeys.for_name("mon-rate:k").deferred) >= 1)
    return sent


def _trouble(r: Any) -> dict[str, Any]:
    """A lease lost, renewals (and then the release) failing, a holder that vanished
    (the sweeper hands its key on), a parked message nobody signed (refused), a run that
    waited for its lock and was re-queued."""
    sent = {"lose": [mon.lose.delay("k")], "unrenewable": [mon.unrenewable.delay("k")]}
    sweep = LockKeys.for_name("mon-sweep:k")
    sent["abandon"] = [mon.abandon.delay("k", "holder")]
    wait_until(lambda: r.exists(sweep.lock))
    sent["abandon"].append(mon.abandon.delay("k", "waiter"))
    forged = LockKeys.for_name("mon-forged:k")
    r.rpush(forged.parked, b"forged-id")
    r.hset(forged.parked_messages, b"forged-id", b"not a message any worker parked")
    r.zadd(parked_registry("redislock:"), {forged.lock: 0})
    wait_until(lambda: not r.llen(forged.parked))  # the sweeper refused it
    waiting = LockKeys.for_name("mon-wait:k")
    sent["waiting"] = [mon.waiting.delay("k", "gate-wait")]
    wait_until(lambda: r.exists(waiting.lock))
    sent["waiting"].append(mon.waiting.delay("k", "gate-wait"))
    wait_until(lambda: r.exists(mon.REQUEUED))  # it waited, then was re-queued
    r.set("gate-wait", 1)
    return sent


def _last_calls(r: Any) -> dict[str, Any]:
    """Last call wins (a call superseded by a newer one, debounced calls), a run skipped
    (``on_contention="skip"``), and a finished run's message delivered again (ignored)."""
    first = mon.newest.delay("k", "first", "gate-newest")
    wait_until(lambda: r.exists(LockKeys.for_name("mon-newest:k").lock))
    older, newer = (mon.newest.delay("k", tag) for tag in ("older", "newer"))
    wait_until(lambda: older.state == "SUPERSEDED")
    r.set("gate-newest", 1)
    quiet = [mon.quiet.delay("k", tag) for tag in ("a", "b")]
    holder = mon.skipping.delay("k", "gate-skip")
    wait_until(lambda: r.exists(LockKeys.for_name("mon-skip:k").lock))
    skipped = mon.skipping.delay("k", "gate-skip")
    wait_until(lambda: skipped.state == "SKIPPED")
    r.set("gate-skip", 1)
    assert newer.get(timeout=30) == "newer"
    mon.newest.apply_async(("k", "newer"), task_id=newer.id)  # a copy of a finished run
    wait_until(lambda: quiet[0].state == "SUPERSEDED" and quiet[1].state == "SUCCESS")
    wait_until(  # the copy ignored (counted once the worker flushes its counts)
        lambda: any(b"duplicate_ignored" in field for field in r.hkeys("redislock:stats")),
        what="the copy of a finished run ignored",
    )
    return {"newest": [first, newer], "quiet": [quiet[1]], "skipping": [holder]}


#: Scenarios run while the exporter and top look (the gauges of what is held, parked and
#: deferred now); each returns the results of the tasks it sent, by task.
LIVE: list[Scenario] = [_contention]
#: Scenarios run after the gate opens (counters).
AFTER: list[Scenario] = [_trouble, _last_calls]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    pytest.importorskip("prometheus_client")
    log = tmp_path_factory.mktemp("monitoring") / "worker.log"
    run = Run()
    with RedisServer() as server:
        mon.app.conf.update(broker_url=server.url, result_backend=server.url)
        mon.URL, mon._client = server.url, None
        r = server.client()
        proc: CeleryProcess = worker(
            server.url, log, app="tests.monitoring_app", extra=["-Q", mon.QUEUE]
        )
        try:
            for scenario in LIVE:
                run.results.update(scenario(r))
            run.live = _scrape(server.url)
            run.top_json = json.loads(_cli(server.url, "top", "--json"))
            run.top_frame = _cli(server.url, "top", "--once")
            r.set("gate", 1)
            for scenario in AFTER:
                run.results.update(scenario(r))
            outcomes = {}
            for task, results in run.results.items():
                outcomes[task] = [_outcome(result) for result in results]
            run.results = outcomes
        finally:
            proc.stop()  # a warm shutdown: every process flushes its last counts
        run.after = _scrape(server.url)
        # The scenarios' AsyncResults, collected while their result backend is up: one
        # collected later would have Celery retry the stopped server inside another test.
        gc.collect()
        mon.app.close()
    yield run


def test_the_exporter_serves_its_series_over_http(tmp_path: Path) -> None:
    """``redislock exporter`` as Prometheus scrapes it: /metrics on its port."""
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with RedisServer() as server:
        server.client().hset("redislock:stats", series.field(
            "celery_redislock_task_acquired_total",
            {"name": "t", "queue_name": "q", "kind": "lock"},
        ), 3)  # fmt: skip
        log = tmp_path / "exporter.log"
        args = ["exporter", "--addr", "127.0.0.1", "--port", str(port), "--interval", "0.1"]
        proc = CeleryProcess(["redislock", *args], url=server.url, log=log)
        proc.app = "tests.monitoring_app"
        proc.start()
        try:
            proc.wait_for_log("serving http://127.0.0.1")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as got:
                body = got.read().decode()
        finally:
            proc.kill()
    wanted = 'celery_redislock_task_acquired_total{kind="lock",name="t",queue_name="q"} 3.0'
    assert wanted in body
    assert "celery_redislock_exporter_redis_up 1.0" in body


def _outcome(result: Any) -> Any:
    try:
        return result.get(timeout=30)
    except Exception as exc:
        return type(exc).__name__


def test_every_series_the_dashboard_and_rules_use_is_produced_by_a_real_run(
    real_run: Run,
) -> None:
    used = {
        series_of(n)
        for expr in dashboard_expressions() + rule_expressions()
        for n in metric_names(expr)
    }
    assert len(used) >= 15  # (the parser saw them)
    produced = real_run.produced()
    missing = used - produced - set(AWAITING_SENDER)
    assert not missing, f"used by the dashboard or rules, not produced by the run: {missing}"
    arrived = produced & set(AWAITING_SENDER)
    assert not arrived, f"now produced: take them out of AWAITING_SENDER: {arrived}"
    assert set(AWAITING_SENDER) <= used  # (nothing waits that nothing uses)


def test_the_run_ended_as_each_scenario_says(real_run: Run) -> None:
    assert real_run.results == {
        "hold": ["k", "k"],
        "limited": ["k", "k", "k"],
        "rated": ["k", "k", "k"],
        "lose": ["LockLostError"],
        "unrenewable": ["LockLostError"],
        "abandon": ["LockLostError", "waiter"],
        "waiting": ["k", "k"],
        "newest": ["first", "newer"],
        "quiet": ["b"],
        "skipping": ["k"],
    }


def test_the_gauges_show_what_is_held_parked_and_deferred_while_it_is(real_run: Run) -> None:
    live = "live"
    hold, limited, rated = (f"tests.monitoring_app.{t}" for t in ("hold", "limited", "rated"))
    assert real_run.value(live, "celery_redislock_parked", name=hold, kind="lock") == 1
    assert real_run.value(live, "celery_redislock_parked", name=limited, kind="limit") == 1
    assert real_run.value(live, "celery_redislock_deferred", name=rated) >= 1
    assert real_run.value(live, "celery_redislock_held", kind="lock") == 1
    assert real_run.value(live, "celery_redislock_held", kind="limit") == 2
    for kind in series.KINDS:
        assert real_run.value(live, "celery_redislock_keys_in_use", kind=kind) == 1
    assert real_run.value(live, "celery_redislock_exporter_redis_up") == 1
    # Once everything ran, nothing is parked, deferred or held.
    assert real_run.value("after", "celery_redislock_parked") == 0
    assert real_run.value("after", "celery_redislock_deferred") == 0
    assert real_run.value("after", "celery_redislock_held") == 0


def test_the_counters_count_each_outcome_per_task_and_queue(real_run: Run) -> None:
    after, queue = "after", mon.QUEUE

    def task(name: str) -> str:
        return f"tests.monitoring_app.{name}"

    acquired = "celery_redislock_task_acquired_total"
    assert real_run.value(after, acquired, name=task("hold"), kind="lock", queue_name=queue) == 2
    assert real_run.value(after, acquired, name=task("limited"), kind="limit") == 3
    assert real_run.value(after, acquired, name=task("rated"), kind="rate") == 1
    assert real_run.value(after, "celery_redislock_task_deferred_total", name=task("rated")) == 2
    assert real_run.value(after, "celery_redislock_task_undeferred_total", name=task("rated")) == 2
    parked = "celery_redislock_task_parked_total"
    assert real_run.value(after, parked, name=task("hold"), kind="lock", queue_name=queue) == 1
    assert real_run.value(after, parked, name=task("limited"), kind="limit") == 1
    handed = "celery_redislock_task_handed_over_total"
    assert real_run.value(after, handed, name=task("hold"), via="release") == 1
    assert real_run.value(after, handed, name=task("limited"), via="release") == 1
    assert real_run.value(after, handed, name=task("abandon"), via="sweeper") == 1
    lost = "celery_redislock_task_lease_lost_total"
    assert real_run.value(after, lost, name=task("lose"), reason="expired") == 1
    assert real_run.value(after, lost, name=task("unrenewable"), reason="unreachable") == 1
    failures = "celery_redislock_task_renewal_failures_total"
    assert real_run.value(after, failures, name=task("unrenewable"), queue_name=queue) >= 1
    assert real_run.value(after, "celery_redislock_parked_rejected_total") == 1
    release_failed = "celery_redislock_task_release_failed_total"
    assert real_run.value(after, release_failed, name=task("unrenewable")) == 1
    requeued = "celery_redislock_task_requeued_total"
    assert real_run.value(after, requeued, name=task("waiting"), kind="lock") >= 1
    waits = "celery_redislock_task_wait_seconds"
    assert real_run.value(after, waits, name=task("limited"), kind="limit") == 3  # (counts)
    holds = "celery_redislock_task_hold_seconds"
    assert real_run.value(after, holds, name=task("hold"), kind="lock") == 2
    # No label carries a lock key or an argument.
    for rows in real_run.after.values():
        for labels, _ in rows:
            assert not any("mon-" in value or value == "k" for value in labels.values()), labels


def test_top_json_ranks_the_busy_keys_with_their_holders_parked_and_deferred(
    real_run: Run,
) -> None:
    found = real_run.top_json
    keys = {(key["name"], key["kind"]): key for key in found["keys"]}
    assert set(keys) == {("mon-lock:k", "lock"), ("mon-limit:k", "limit"), ("mon-rate:k", "rate")}
    lock, limit, rate = (
        keys["mon-lock:k", "lock"],
        keys["mon-limit:k", "limit"],
        keys["mon-rate:k", "rate"],
    )
    assert (lock["holders"], lock["limit"], lock["parked"]) == (1, 1, 1)
    assert lock["parked_by_task"] == {"tests.monitoring_app.hold": 1}
    assert (limit["holders"], limit["limit"], limit["parked"]) == (2, 2, 1)
    assert limit["parked_by_task"] == {"tests.monitoring_app.limited": 1}
    assert limit["oldest_wait"] is not None and limit["oldest_wait"] >= 0
    assert rate["deferred"] >= 1 and rate["deferred_task"] == "tests.monitoring_app.rated"
    assert rate["oldest_wait"] is not None and rate["head_due"] is not None
    heat = [k["parked"] + k["deferred"] + k["waiting"] for k in found["keys"]]
    assert heat == sorted(heat, reverse=True)
    totals = found["totals"]
    assert (totals["keys"], totals["locks_held"], totals["permits_held"], totals["parked"]) == (
        3,
        1,
        2,
        2,
    )


def test_top_once_draws_one_frame_of_the_same_keys(real_run: Run) -> None:
    frame = real_run.top_frame
    for text in ("mon-lock:k", "mon-limit:k", "mon-rate:k", "2/2", "1/1", "3 busy key(s)"):
        assert text in frame, frame
    assert "\x1b" not in frame  # (not a terminal: no escape codes)
