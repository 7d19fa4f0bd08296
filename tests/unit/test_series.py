"""The metrics vocabulary (``celery_redislock.series``): its names, and how the workers'
counts are stored in ``<prefix>stats`` and read back (anything else there left out)."""

from __future__ import annotations

import re

from celery_redislock import series


def test_names_sit_beside_celery_exporters_and_never_label_a_key() -> None:
    assert len(series.ALL_SERIES) == len(series.BY_NAME) >= 20
    for found in series.ALL_SERIES:
        assert re.fullmatch(r"celery_redislock_[a-z_]+", found.name)
        assert (found.type == series.COUNTER) == found.name.endswith("_total")
        assert not {"key", "lock", "task_id", "owner", "args"} & set(found.labels)
        if found.name.startswith("celery_redislock_task_"):
            assert found.labels[:2] == ("name", "queue_name")
        assert found.question.endswith("?") and found.help


def test_a_field_reads_back_as_its_series_and_labels() -> None:
    labels = {"name": "t", "queue_name": "q", "kind": "limit"}
    name = "celery_redislock_task_parked_total"
    assert series.parse_field(series.field(name, labels)) == (series.BY_NAME[name], "", labels)
    bucket = series.field("celery_redislock_task_wait_seconds_bucket", {**labels, "le": "0.5"})
    found = series.parse_field(bucket)
    assert found is not None and found[1:] == ("_bucket", {**labels, "le": "0.5"})


def test_what_is_not_a_field_of_the_vocabulary_is_left_out() -> None:
    labels = '{"kind":"lock","name":"t","queue_name":"q"}'
    for junk in (
        "acquired",  # the older counters of the same hash
        "limit_taken@t",
        "celery_redislock_task_parked_total",  # no labels
        "celery_redislock_task_parked_total{not json",
        'celery_redislock_task_parked_total{"name":"t"}',  # labels missing
        'celery_redislock_task_parked_total{"kind":"lock","name":1,"queue_name":"q"}',
        "celery_redislock_nothing_total" + labels,
        "celery_redislock_parked" + '{"kind":"lock","name":"t"}',  # a gauge: Redis's, not a count
        "celery_redislock_task_parked_total_bucket" + labels,  # a counter has no buckets
        "celery_redislock_task_wait_seconds_bucket" + labels[:-1] + ',"le":"0.3"}',  # no bound
    ):
        assert series.parse_field(junk) is None, junk


def test_histogram_buckets_are_cumulated_and_counts_never_negative() -> None:
    labels = {"name": "t", "queue_name": "q", "kind": "lock"}
    wait = "celery_redislock_task_wait_seconds"
    totals = {
        series.field(
            wait + "_bucket", {**labels, "le": series.bucket_bound(series.WAIT_BUCKETS, 0.004)}
        ): 2.0,
        series.field(
            wait + "_bucket", {**labels, "le": series.bucket_bound(series.WAIT_BUCKETS, 7.0)}
        ): 1.0,
        series.field(
            wait + "_bucket", {**labels, "le": series.bucket_bound(series.WAIT_BUCKETS, 1e9)}
        ): 1.0,
        series.field(wait + "_sum", labels): 9.5,
        series.field("celery_redislock_task_acquired_total", labels): -4.0,  # (junk)
        "acquired": 7.0,
    }
    samples = series.worker_samples(totals)
    ((found_labels, (buckets, total)),) = samples[wait]
    assert found_labels == labels and total == 9.5
    cumulative = dict(buckets)
    assert cumulative["0.005"] == 2 and cumulative["5.0"] == 2 and cumulative["10.0"] == 3
    assert cumulative["3600.0"] == 3 and cumulative["+Inf"] == 4
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)
    assert samples["celery_redislock_task_acquired_total"] == [(labels, 0.0)]


def test_a_runs_cached_fields_are_the_ones_observe_writes() -> None:
    from celery_redislock import _series_counts as counts
    from celery_redislock._keyvalues import _BYTE_TEXT, _pct

    labels = (("name", "t"), ("queue_name", "q"), ("kind", "lock"))
    fields = counts._fields_of("t", "q", "lock")
    assert fields.acquired == counts._field("celery_redislock_task_acquired_total", labels)
    wait = series.series("task_wait_seconds")
    for seconds in (0.0, -1.0, float("nan"), float("inf"), 1e9, *wait.buckets):
        for value in (seconds, seconds * 0.999, seconds * 1.001):
            bound = series.bucket_bound(wait.buckets, value)
            expected = counts._field(wait.name + "_bucket", (*labels, ("le", bound)))
            assert fields.wait.bucket(value) == expected
    assert fields.wait.sum == counts._field(wait.name + "_sum", labels)
    for text in ("a:b", "x y/%{}", "\x00\x7f~", "é:1", "\udc80"):  # (the translate fast path)
        assert _pct(text) == "".join(_BYTE_TEXT[b] for b in text.encode("utf-8", "surrogatepass"))
