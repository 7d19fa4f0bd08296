"""docker/: the worker image and the Compose stack.

The structure checks need no Docker engine (PyYAML, plain text, and ``docker compose
config`` when the Compose plugin is installed: it only parses). The smoke test builds and
runs the stack and is skipped unless ``docker info`` succeeds.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"

CELERY_SERVICES = (
    "worker",
    "nightly-worker",
    "beat",
    "demo-worker",
    "demo",
    "exporter",
    "demo-exporter",
    "nightly-exporter",
)
MONITORING = ROOT / "monitoring"
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
GRAFANA_PROVISIONING = DOCKER / "grafana" / "provisioning"
DEMO_COMMAND = [
    "python",
    "-m",
    "celery_redislock.demo",
    "--redis-url",
    "redis://redis:6379/0",
    "--broker-url",
    "redis://redis:6379/0",
    "--external-worker",
    "--hot-calls",
    "120",
]


@functools.cache
def _docker(*args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str] | None:
    """``docker *args``; None when the CLI is missing, hangs or fails to start."""
    try:
        return subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _docker_engine_reachable() -> bool:
    """``docker info`` answers (a daemon is reachable); False on any failure."""
    result = _docker("info", timeout=5.0)
    return result is not None and result.returncode == 0


def _docker_compose_available() -> bool:
    """The Compose v2 CLI plugin is installed (no engine needed)."""
    result = _docker("compose", "version", timeout=5.0)
    return result is not None and result.returncode == 0


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    yaml = pytest.importorskip(
        "yaml", reason="PyYAML is needed to parse docker/compose.yaml: add it to the test extras"
    )
    data = yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the `<<: *app` merges
    assert isinstance(data, dict)
    return data


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        instructions.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    assert not pending, "the Dockerfile ends with a continuation line"
    return instructions


def _exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list), arguments
    return [str(part) for part in value]


# -- compose.yaml, parsed -------------------------------------------------------------


def test_compose_services_and_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "worker", "beat", "demo"} <= set(services)
    redis = services["redis"]
    assert str(redis["image"]).split(":")[0] == "redis" and str(redis["image"]).endswith(":7")
    command = redis["command"]
    # No persistence: snapshots off, AOF off.
    assert command[:1] == ["redis-server"]
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--appendonly") + 1] == "no"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "profiles" not in redis


@pytest.mark.parametrize("name", CELERY_SERVICES)
def test_compose_celery_services_use_the_image_built_from_the_repo_root(
    compose: dict[str, Any], name: str
) -> None:
    service = compose["services"][name]
    build = service["build"]
    context = (COMPOSE.parent / build["context"]).resolve()  # relative to the compose file
    assert context == ROOT
    assert build["dockerfile"] == "docker/Dockerfile"  # relative to the context
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE
    assert service["image"] == compose["services"]["worker"]["image"]
    assert service["depends_on"]["redis"] == {"condition": "service_healthy"}


def test_compose_worker_runs_the_payments_example(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    command = worker["command"]
    assert command[:4] == ["celery", "-A", "examples.payments", "worker"]
    assert worker["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert "profiles" not in worker
    # The image's default command is the same worker.
    cmd = [args for keyword, args in _dockerfile_instructions() if keyword == "CMD"]
    assert cmd and _exec_form(cmd[-1]) == command


def test_compose_nightly_services_run_the_nightly_example(compose: dict[str, Any]) -> None:
    services = compose["services"]
    beat = services["beat"]
    assert beat["command"][:4] == ["celery", "-A", "examples.nightly", "beat"]
    nightly_workers = [
        service
        for service in services.values()
        if service.get("command", [])[:4] == ["celery", "-A", "examples.nightly", "worker"]
    ]
    assert nightly_workers, "beat's tasks need a worker of the nightly app"
    # Both example apps use Celery's default queue: the nightly app gets its own database
    # so neither worker receives the other's (unregistered) tasks.
    nightly_urls = {beat["environment"]["REDIS_URL"]}
    nightly_urls |= {service["environment"]["REDIS_URL"] for service in nightly_workers}
    assert len(nightly_urls) == 1
    assert nightly_urls != {services["worker"]["environment"]["REDIS_URL"]}
    for service in (beat, *nightly_workers):
        assert "profiles" not in service


def test_compose_demo_is_in_a_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    demo = services["demo"]
    assert demo["profiles"] == ["demo"]
    assert demo["command"] == DEMO_COMMAND
    assert demo["depends_on"]["redis"] == {"condition": "service_healthy"}
    # --external-worker: the demo's tasks (their own app and queue) need a worker of the
    # demo app, in the same profile, on the URLs the demo is given.
    worker = services["demo-worker"]
    assert "demo-worker" in demo["depends_on"]
    assert worker["profiles"] == ["demo"]
    assert worker["command"][:4] == ["celery", "-A", "celery_redislock.demo.app", "worker"]
    redis_url = DEMO_COMMAND[DEMO_COMMAND.index("--redis-url") + 1]
    broker_url = DEMO_COMMAND[DEMO_COMMAND.index("--broker-url") + 1]
    # The demo app is configured from DEMO_* at import: both sides must agree.
    assert demo["environment"] == worker["environment"]
    assert demo["environment"]["DEMO_REDIS_URL"] == redis_url
    assert demo["environment"]["DEMO_BROKER_URL"] == broker_url


def test_compose_demo_runs_every_scene_and_keeps_the_rate_backlog_up_for_a_scrape(
    compose: dict[str, Any],
) -> None:
    """The dashboard's rate and last-call-wins panels fill from the merchants and reindex
    scenes: the demo runs them all (no --scene), with the settings its worker has, and the
    merchants scene's deferred backlog outlasts two scrapes (the *Deferred now* gauge)."""
    yaml = pytest.importorskip("yaml")
    from celery_redislock._rates import parse_rates
    from celery_redislock.demo.__main__ import SCENES, parse

    demo = compose["services"]["demo"]
    args = parse(DEMO_COMMAND[3:])
    assert args.scene == "all" and {"merchants", "reindex"} <= set(SCENES)
    env = demo["environment"]
    assert {"DEMO_RATE", "DEMO_DEBOUNCE", "DEMO_LIMIT"} <= set(env)
    limit = parse_rates(env["DEMO_RATE"])[0]
    assert float(env["DEMO_DEBOUNCE"]) > 0
    backlog = (args.hot_calls - 1) * limit.period_us / limit.count / 1_000_000
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["global"]["scrape_interval"]
    assert scrape.endswith("s")
    assert backlog >= 2 * float(scrape[:-1]), (backlog, scrape)


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts: where in the container -> the host path (resolved)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = str(volume).split(":")
        found[target] = (COMPOSE.parent / source).resolve()
    return found


def test_compose_exporters_serve_each_apps_series(compose: dict[str, Any]) -> None:
    services = compose["services"]
    apps = {}
    for name in ("exporter", "demo-exporter", "nightly-exporter"):
        service = services[name]
        command = service["command"]
        assert command[:2] == ["celery", "-A"] and command[3:5] == ["redislock", "exporter"]
        assert command[command.index("--port") + 1] == "9818"
        assert "profiles" not in service
        apps[command[2]] = service["environment"]
    # The same apps, configured as their workers are.
    assert apps["examples.payments"] == services["worker"]["environment"]
    assert apps["celery_redislock.demo.app"] == services["demo-worker"]["environment"]
    assert apps["examples.nightly"] == services["nightly-worker"]["environment"]


def test_compose_prometheus_scrapes_the_exporters_with_the_alert_rules(
    compose: dict[str, Any],
) -> None:
    yaml = pytest.importorskip("yaml")
    prometheus = compose["services"]["prometheus"]
    assert "profiles" not in prometheus
    mounts = _mounts(prometheus)
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    assert mounts["/etc/prometheus/alerts.yaml"] == MONITORING / "prometheus" / "alerts.yaml"
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yaml"]
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    exporters = {"exporter", "demo-exporter", "nightly-exporter"}
    assert targets == {f"{name}:9818" for name in exporters}
    assert exporters <= set(prometheus["depends_on"])


def test_compose_grafana_provisions_the_dashboard_and_prometheus(compose: dict[str, Any]) -> None:
    yaml = pytest.importorskip("yaml")
    grafana = compose["services"]["grafana"]
    assert "profiles" not in grafana
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == GRAFANA_PROVISIONING
    dashboards = mounts["/var/lib/grafana/dashboards"]
    assert dashboards == MONITORING / "grafana"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).relative_to("/var/lib/grafana/dashboards")).is_file()
    provider = yaml.safe_load(
        (GRAFANA_PROVISIONING / "dashboards" / "celery-redislock.yaml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    (datasource,) = source["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in grafana["depends_on"]
    # The dashboard picks its data source by a variable (no uid of one installation).
    dashboard = json.loads((dashboards / "celery-redislock.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


@pytest.mark.skipif(
    not _docker_compose_available(),
    reason="the `docker compose` plugin is not installed: `docker compose config` not run",
)
def test_compose_config_accepts_the_file() -> None:
    """``docker compose config`` only parses and resolves: no engine needed."""
    result = _docker(
        "compose",
        "-f",
        str(COMPOSE),
        "--profile",
        "demo",
        "config",
        "--format",
        "json",
        timeout=60.0,
    )
    assert result is not None
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert {"redis", "worker", "beat", "demo"} <= set(services)
    worker = services["worker"]
    assert Path(worker["build"]["context"]).resolve() == ROOT
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "examples.payments" in worker["command"]
    assert services["demo"]["profiles"] == ["demo"]


# -- Dockerfile, as text --------------------------------------------------------------


def test_dockerfile_installs_the_package_and_copies_the_examples() -> None:
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    copies = [shlex.split(args) for keyword, args in instructions if keyword == "COPY"]
    sources = {source.rstrip("/") for copy in copies for source in copy[:-1]}
    assert {"pyproject.toml", "README.md", "celery_redislock", "examples"} <= sources
    assert "." not in sources  # only what the image needs, not the whole repository
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository root"
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert "pip install" in runs
    extras = re.search(r"/tmp/src\[([\w,]+)\]", runs)
    assert extras, runs
    # the exporter (prometheus) and top (rich) run from the same image
    assert {"celery", "hiredis", "prometheus", "top"} <= set(extras.group(1).split(","))
    # The Dockerfile-specific ignore file must let every copied path through.
    allowed = {
        line[1:].strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    assert sources <= allowed


def test_dockerfile_runs_as_a_non_root_user() -> None:
    instructions = _dockerfile_instructions()
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users, "no USER instruction: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    # USER comes after the last RUN (installs need root) and before the CMD.
    keywords = [keyword for keyword, _ in instructions]

    def last(keyword: str) -> int:
        return len(keywords) - 1 - keywords[::-1].index(keyword)

    assert last("USER") > last("RUN")
    assert last("CMD") > last("USER")


def test_the_installed_package_includes_every_subpackage() -> None:
    """The image installs the package (not an editable checkout): a subpackage missing
    from pyproject's setuptools ``packages`` list is missing from the image."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = config.get("packages")
    if not isinstance(packages, list):
        pytest.skip("packages are discovered (packages.find), not listed")
    source = ROOT / "celery_redislock"
    subpackages = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for name in ("__init__.py", "__main__.py")
        for path in source.rglob(name)
        if "__pycache__" not in path.parts
    }
    missing = sorted(subpackages - set(packages))
    assert not missing, f"not in [tool.setuptools] packages, so not installed: {missing}"


# -- the stack, with an engine --------------------------------------------------------


@pytest.mark.skipif(
    not _docker_compose_available(),
    reason="the `docker compose` plugin is not installed: the compose smoke test needs it",
)
@pytest.mark.skipif(
    not _docker_engine_reachable(),
    reason="no Docker engine reachable (docker info failed): the compose smoke test needs one",
)
@pytest.mark.timeout(1500)
def test_compose_stack_settles_payments() -> None:
    """Two payments workers and the payments client: every balance equals its sum."""
    project = f"redislock-test-{uuid.uuid4().hex[:8]}"  # a fresh stack: balances from 0
    base = ["docker", "compose", "-f", str(COMPOSE), "-p", project]

    def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    try:
        up = run(
            "up",
            "--build",
            "--detach",
            "--wait",
            "--wait-timeout",
            "300",
            "--scale",
            "worker=2",
            "redis",
            "worker",
            timeout=900,
        )
        assert up.returncode == 0, up.stderr[-3000:]
        client = run("exec", "-T", "worker", "python", "-m", "examples.payments", timeout=400)
        logs = run("logs", "--no-color", "worker", timeout=60).stdout
        assert client.returncode == 0, client.stderr[-3000:] + logs[-3000:]
    finally:
        run("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=120)
    lines = client.stdout.strip().splitlines()
    assert len(lines) == 4, client.stdout
    for line in lines:
        _account, balance, _, _, expected = line.replace("b'", "").replace("'", "").split()
        assert int(balance) == int(expected), line


@pytest.mark.skipif(
    not _docker_compose_available(),
    reason="the `docker compose` plugin is not installed: the monitoring smoke test needs it",
)
@pytest.mark.skipif(
    not _docker_engine_reachable(),
    reason="no Docker engine reachable (docker info failed): the monitoring smoke test needs one",
)
@pytest.mark.timeout(1500)
def test_compose_dashboard_fills_while_the_payments_run() -> None:
    """The payments run; Prometheus then has the exporter's series, and Grafana serves
    the provisioned dashboard."""
    project = f"redislock-test-{uuid.uuid4().hex[:8]}"
    base = ["docker", "compose", "-f", str(COMPOSE), "-p", project]

    def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    def query(expr: str) -> list[Any]:
        url = f"http://localhost:9090/api/v1/query?query={expr}"
        found = run("exec", "-T", "prometheus", "wget", "-qO-", url, timeout=60)
        if found.returncode != 0:
            return []
        return list(json.loads(found.stdout)["data"]["result"])

    try:
        services = ("redis", "worker", "exporter", "demo-exporter", "prometheus", "grafana")
        up = run("up", "--build", "--detach", "--wait", "--wait-timeout", "300", *services,
                 timeout=900)  # fmt: skip
        assert up.returncode == 0, up.stderr[-3000:]
        client = run("exec", "-T", "worker", "python", "-m", "examples.payments", timeout=400)
        assert client.returncode == 0, client.stderr[-3000:]
        deadline = time.monotonic() + 120
        acquired: list[Any] = []
        while time.monotonic() < deadline and not acquired:
            acquired = query("celery_redislock_task_acquired_total")
            time.sleep(2)
        assert acquired, "Prometheus has no celery_redislock_task_acquired_total"
        assert {r["metric"]["name"] for r in acquired} == {"examples.payments.settle"}
        dashboard = run(
            "exec", "-T", "grafana", "wget", "-qO-",
            "http://localhost:3000/api/dashboards/uid/celery-redislock", timeout=60,
        )  # fmt: skip
        assert dashboard.returncode == 0, dashboard.stderr
        assert json.loads(dashboard.stdout)["dashboard"]["uid"] == "celery-redislock"
    finally:
        run("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=120)
