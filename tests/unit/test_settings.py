"""redislock_* settings and task options: validated once, errors naming the setting."""

from __future__ import annotations

import math

import pytest

from celery_redislock import LockConfigurationError
from celery_redislock.settings import LockOptions, LockSettings, task_overrides


def test_defaults_and_broker_fallback() -> None:
    settings = LockSettings.from_conf({"broker_url": "redis://127.0.0.1:6379/1"})
    assert settings.url == "redis://127.0.0.1:6379/1"
    assert "broker_url" in settings.url_source and "the broker is Redis" in settings.url_source
    assert settings.defaults == LockOptions()


def test_explicit_url_wins_over_the_broker() -> None:
    settings = LockSettings.from_conf(
        {"broker_url": "amqp://guest@localhost//", "redislock_url": "rediss://cache:6380/0"}
    )
    assert settings.url == "rediss://cache:6380/0" and settings.url_source == "redislock_url"


def test_missing_url_with_a_non_redis_broker_is_a_clear_error() -> None:
    with pytest.raises(LockConfigurationError, match="redislock_url is not set") as info:
        LockSettings.from_conf({"broker_url": "amqp://guest:secret@rabbit//"})
    assert "secret" not in str(info.value)  # credentials are not echoed


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("redislock_url", "http://x"),
        ("redislock_ttl", 0),
        ("redislock_ttl", math.nan),
        ("redislock_on_contention", "block"),
        ("redislock_wait", -1),
        ("redislock_wait_fallback", "skip"),
        ("redislock_max_requeues", -1),
        ("redislock_max_requeues", 1.5),
        ("redislock_requeue_backoff", (1.0,)),
        ("redislock_requeue_backoff", (5.0, 1.0)),
        ("redislock_requeue_exhausted", "retry"),
        ("redislock_release_on_retry", "yes"),
        ("redislock_prefix", "a{b"),
        ("redislock_done_ttl", 0),
        ("redislock_redis_options", ["socket_timeout"]),
        ("redislock_lookahead", -1),
        ("redislock_lookahead", 1001),
        ("redislock_lookahead", True),
        ("redislock_run_on", -1),
        ("redislock_run_on", 601),
        ("redislock_run_on", True),
        ("redislock_run_on", "5"),
        ("redislock_run_on", float("nan")),
        ("redislock_debounce", 0),
        ("redislock_debounce", -1),
        ("redislock_debounce", math.inf),
        ("redislock_debounce", math.nan),
        ("redislock_debounce", "2"),
        ("redislock_debounce", 4e7),
        ("redislock_debounce_max", 0),
        ("redislock_debounce_max", math.inf),
        ("redislock_debounce_max", 1.0),  # with no redislock_debounce to bound
    ],
)
def test_each_bad_setting_is_named(setting: str, value: object) -> None:
    conf = {"broker_url": "redis://localhost", setting: value}
    with pytest.raises(LockConfigurationError, match=setting):
        LockSettings.from_conf(conf)


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"redislock_debounce": 2.0, "redislock_debounce_max": 1.0}, "redislock_debounce_max"),
        ({"redislock_debounce": 2.0, "redislock_on_contention": "skip"}, "redislock_debounce"),
    ],
)
def test_last_call_wins_settings_are_checked_together(conf: dict[str, object], match: str) -> None:
    """redislock_debounce_max is at least redislock_debounce; a debounce goes with
    "replace" (or the default "requeue"): the error names the settings."""
    with pytest.raises(LockConfigurationError, match=match):
        LockSettings.from_conf({"broker_url": "redis://localhost", **conf})
    ok = {"broker_url": "redis://localhost", "redislock_debounce": 2.0}
    assert LockSettings.from_conf({**ok, "redislock_debounce_max": 2.0}).defaults.debounce_max == 2


def test_task_overrides_name_the_task_and_option() -> None:
    with pytest.raises(LockConfigurationError, match=r"task 'billing.settle': on_contention"):
        task_overrides({"on_contention": "sometimes"}, "billing.settle")
    with pytest.raises(LockConfigurationError, match=r"task 't': lock_hold"):
        task_overrides({"lock_hold": -3}, "t")
    with pytest.raises(LockConfigurationError, match=r"task 't': lock_lookahead .* 0 \(off\)"):
        task_overrides({"lock_lookahead": "all"}, "t")
    with pytest.raises(LockConfigurationError, match=r"task 't': lock_run_on .* 0 \(off\) to 600"):
        task_overrides({"lock_run_on": 7200}, "t")
    assert task_overrides({"lock_run_on": 2}, "t") == {"run_on": 2.0}
    found = task_overrides({"lock_ttl": 5, "lock_wait": 0, "on_contention": None}, "t")
    assert found == {"ttl": 5.0, "wait": 0.0}
    assert task_overrides({"lock_lookahead": 0}, "t") == {"lookahead": 0}
    assert LockOptions().lookahead == 64


def test_overrides_merge_over_app_defaults() -> None:
    defaults = LockOptions(ttl=60.0, on_contention="wait")
    merged = defaults.merged({"ttl": 5.0})
    assert merged.ttl == 5.0 and merged.on_contention == "wait"


def test_park_fallback_accepts_auto_true_false_only() -> None:
    conf = {"broker_url": "redis://localhost"}
    assert LockSettings.from_conf(conf).park_fallback == "auto"
    assert LockSettings.from_conf({**conf, "redislock_park_fallback": False}).park_fallback is False
    with pytest.raises(LockConfigurationError, match="redislock_park_fallback"):
        LockSettings.from_conf({**conf, "redislock_park_fallback": "false"})


def test_park_at_delivery_is_a_bool() -> None:
    conf = {"broker_url": "redis://localhost"}
    assert LockSettings.from_conf(conf).park_at_delivery is True
    off = {**conf, "redislock_park_at_delivery": False}
    assert LockSettings.from_conf(off).park_at_delivery is False
    with pytest.raises(LockConfigurationError, match="redislock_park_at_delivery"):
        LockSettings.from_conf({**conf, "redislock_park_at_delivery": "no"})


@pytest.mark.parametrize("bad", ["yes", 1, 0, "True"])
def test_queues_in_other_db_is_a_bool_off_by_default(bad: object) -> None:
    conf = {"broker_url": "redis://localhost"}
    assert LockSettings.from_conf(conf).queues_in_other_db is False
    on = {**conf, "redislock_queues_in_other_db": True}
    assert LockSettings.from_conf(on).queues_in_other_db is True
    with pytest.raises(LockConfigurationError, match=r"queues_in_other_db.*True or False"):
        LockSettings.from_conf({**conf, "redislock_queues_in_other_db": bad})


@pytest.mark.parametrize(
    ("urls", "match"),
    [
        ("redis://a:1", "non-empty list"),
        ([], "non-empty list"),
        (["redis://a:1", "http://b:2"], "http://b:2"),
        (["redis://a:1", "redis://a:1"], "twice"),
        (["redis://a:1", "redis://b:1/0", "redis://A:1/2"], "[0] (a:1) and redislock_urls[2]"),
        (["redis://localhost:7", "redis://b:1", "redis://127.0.0.1:7"], "both reach 127.0.0.1:7"),
        (["redis://:secret@[::ffff:127.0.0.1]:7", "rediss://127.0.0.1:7"], "twice"),
        (["unix:///run/redis.sock", "unix:///run/../run/redis.sock?db=1"], "unix:/run/redis.sock"),
        (["redis://a:1", "redis://a:port"], "redislock_urls[1] is not a Redis URL"),
    ],
)
def test_quorum_urls_are_validated(urls: object, match: str) -> None:
    with pytest.raises(LockConfigurationError, match="redislock_urls") as caught:
        LockSettings.from_conf({"redislock_urls": urls})
    assert match in str(caught.value)
    assert "secret" not in str(caught.value)


def test_quorum_urls_exclude_a_single_url_and_are_used() -> None:
    with pytest.raises(LockConfigurationError, match="not both"):
        LockSettings.from_conf({"redislock_urls": ["redis://a:1"], "redislock_url": "redis://b:2"})
    settings = LockSettings.from_conf(
        {"redislock_urls": ["redis://a:1", "redis://b:2", "redis://c:3"], "broker_url": "amqp://"}
    )
    assert settings.urls == ("redis://a:1", "redis://b:2", "redis://c:3")
    assert settings.url_source == "redislock_urls"
    with pytest.raises(LockConfigurationError, match="redislock_node_timeout"):
        LockSettings.from_conf({"redislock_urls": ["redis://a:1"], "redislock_node_timeout": 0})


def test_a_broker_from_the_environment_is_the_locks_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CELERY_BROKER_URL (or `celery -b`) sets the broker without `broker_url` in the
    conf; the locks' URL used to fail with "the broker (None) is not Redis"."""
    from celery import Celery

    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/3")
    app = Celery("env-broker")
    settings = LockSettings.from_conf(app.conf)
    assert settings.url == "redis://127.0.0.1:1/3"
    assert settings.url_source.startswith("broker_url")


@pytest.mark.parametrize(
    "conf",
    [
        {"redislock_url": "http://user:s3cret@host:6379/0"},
        {"redislock_urls": ["redis://:s3cret@h1:1/0", "http://:s3cret@h2:1/0"]},
        {"redislock_urls": "redis://:s3cret@h1:1/0"},
    ],
)
def test_errors_never_show_a_password(conf: dict[str, object]) -> None:
    with pytest.raises(LockConfigurationError) as error:
        LockSettings.from_conf({"broker_url": "redis://127.0.0.1:1/0", **conf})
    assert "s3cret" not in str(error.value) and "***" in str(error.value)
