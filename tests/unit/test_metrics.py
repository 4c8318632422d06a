"""The daemon's Prometheus metrics, scraped and parsed back as a Prometheus server would."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from timesliced.metrics import BUCKETS, Metrics

from ..helpers import status_docs

Labels = frozenset[tuple[str, str]]

# A status document as Daemon.status() returns it: one group of two GPUs held by sft-chat
# with two jobs queued, rl-math parked.
STATUS = status_docs.metrics_status()

# Every series the status document above must give, and nothing else.
EXPECTED_STATUS_SERIES: dict[str, dict[Labels, float]] = {
    "timesliced_info": {frozenset({("node", "vm"), ("version", "0.1.0"), ("backend", "sim")}): 1.0},
    "timesliced_connections": {frozenset(): 3.0},
    "timesliced_uptime_seconds": {frozenset(): 12.5},
    "timesliced_connection_events_total": {
        frozenset({("event", "accepted")}): 3.0,
        frozenset({("event", "refused")}): 0.0,
        frozenset({("event", "protocol_errors")}): 0.0,
        frozenset({("event", "internal_errors")}): 0.0,
        frozenset({("event", "auth_failures")}): 0.0,
        frozenset({("event", "leases_expired")}): 0.0,
    },
    "timesliced_group_queue_depth": {frozenset({("group", "pool")}): 2.0},
    "timesliced_group_holder": {frozenset({("group", "pool"), ("job", "sft-chat")}): 1.0},
    "timesliced_group_state": {
        frozenset({("group", "pool"), ("state", "idle")}): 0.0,
        frozenset({("group", "pool"), ("state", "idle-yielded")}): 0.0,
        frozenset({("group", "pool"), ("state", "locked")}): 1.0,
        frozenset({("group", "pool"), ("state", "switching")}): 0.0,
        frozenset({("group", "pool"), ("state", "faulted")}): 0.0,
    },
    "timesliced_group_fence": {frozenset({("group", "pool")}): 2.0},
    "timesliced_group_draining": {frozenset({("group", "pool")}): 0.0},
    "timesliced_group_grants_total": {frozenset({("group", "pool")}): 2.0},
    "timesliced_group_switches_total": {frozenset({("group", "pool")}): 0.0},
    "timesliced_group_bytes_moved_total": {frozenset({("group", "pool")}): 41943040.0},
    "timesliced_group_deferred_snapshots_total": {frozenset({("group", "pool")}): 1.0},
    "timesliced_group_preemptions_total": {frozenset({("group", "pool")}): 0.0},
    "timesliced_gpu_duty_ratio": {frozenset({("gpu", "0")}): 1.0, frozenset({("gpu", "1")}): 0.0},
    "timesliced_gpu_duty_window_ratio": {frozenset({("gpu", "0")}): 0.75, frozenset({("gpu", "1")}): 0.5},
    "timesliced_gpu_memory_used_bytes": {frozenset({("gpu", "0")}): 50331648.0, frozenset({("gpu", "1")}): 0.0},
    "timesliced_gpu_memory_total_bytes": {
        frozenset({("gpu", "0")}): 67108864.0,
        frozenset({("gpu", "1")}): 67108864.0,
    },
    "timesliced_job_gpu_seconds_total": {
        frozenset({("job", "rl-math"), ("group", "pool")}): 0.25,
        frozenset({("job", "sft-chat"), ("group", "pool")}): 0.75,
        frozenset({("job", "rl-code"), ("group", "pool")}): 0.0,
    },
    "timesliced_job_bytes_moved_total": {
        frozenset({("job", "rl-math")}): 41943040.0,
        frozenset({("job", "sft-chat")}): 0.0,
        frozenset({("job", "rl-code")}): 0.0,
    },
    "timesliced_job_location": {
        frozenset({("job", job), ("location", loc)}): 1.0 if loc == where else 0.0
        for job, where in (("rl-math", "parked"), ("sft-chat", "resident"), ("rl-code", "resident"))
        for loc in ("resident", "parking", "parked", "restoring")
    },
    "timesliced_job_faulted": {
        frozenset({("job", "rl-math")}): 0.0,
        frozenset({("job", "sft-chat")}): 0.0,
        frozenset({("job", "rl-code")}): 1.0,
    },
    "timesliced_job_parked_bytes": {
        frozenset({("job", "rl-math")}): 41943040.0,
        frozenset({("job", "sft-chat")}): 0.0,
        frozenset({("job", "rl-code")}): 0.0,
    },
    "timesliced_job_park_refused": {
        frozenset({("job", "rl-math")}): 0.0,
        frozenset({("job", "sft-chat")}): 0.0,
        frozenset({("job", "rl-code")}): 0.0,
    },
    "timesliced_host_budget_bytes": {frozenset({("node", "vm")}): float(1 << 30)},
    "timesliced_host_parked_bytes": {frozenset({("node", "vm")}): 41943040.0},
    "timesliced_host_reserved_bytes": {frozenset({("node", "vm")}): 0.0},
    "timesliced_host_room_bytes": {frozenset({("node", "vm")}): float((1 << 30) - 41943040)},
    "timesliced_job_series_dropped": {frozenset(): 0.0},
}

# Families of the live observations; a Metrics without observations shows only the error counter.
LIVE = (
    "timesliced_acquire_wait_seconds",
    "timesliced_switch_duration_seconds",
    "timesliced_move_duration_seconds",
    "timesliced_move_bytes",
    "timesliced_status_errors",
)


def scrape(metrics: Metrics, accept: str | None = None) -> dict[str, dict[Labels, float]]:
    """Every sample of one text-format scrape: name -> {label set: value}, ``_created`` left out."""
    body, content_type = metrics.render(accept)
    assert content_type.startswith("text/plain; version=0.0.4")
    series: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                labels = frozenset(s.labels.items())
                assert labels not in series.setdefault(s.name, {}), f"duplicate series {s.name}{s.labels}"
                series[s.name][labels] = s.value
    return series


def status_part(series: dict[str, dict[Labels, float]]) -> dict[str, dict[Labels, float]]:
    return {name: v for name, v in series.items() if not name.startswith(LIVE)}


def provider(doc: dict[str, Any]) -> Any:
    return lambda: doc


def test_every_status_family_and_label_set() -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    series = scrape(metrics)
    assert status_part(series) == EXPECTED_STATUS_SERIES
    assert series["timesliced_status_errors_total"] == {frozenset(): 0.0}


def test_families_carry_prometheus_types() -> None:
    body, _ = Metrics(provider(STATUS), node="vm").render(None)
    types = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert types["timesliced_group_grants"] == "counter"
    assert types["timesliced_job_gpu_seconds"] == "counter"
    assert types["timesliced_group_queue_depth"] == "gauge"
    assert types["timesliced_gpu_duty_ratio"] == "gauge"
    assert types["timesliced_acquire_wait_seconds"] == "histogram"


def test_the_status_is_read_once_per_scrape_and_never_at_construction() -> None:
    calls = []

    def status() -> dict[str, Any]:
        calls.append(1)
        return STATUS

    metrics = Metrics(status, node="vm")
    assert calls == []
    metrics.render(None)
    assert len(calls) == 1


def test_an_idle_group_has_no_holder_and_reads_draining_and_deferred() -> None:
    doc = copy.deepcopy(STATUS)
    doc["groups"][0].update(state="idle", holder=None, queue=[], draining=True, deferred=7)
    series = scrape(Metrics(provider(doc), node="vm"))
    assert "timesliced_group_holder" not in series
    assert series["timesliced_group_queue_depth"] == {frozenset({("group", "pool")}): 0.0}
    assert series["timesliced_group_state"][frozenset({("group", "pool"), ("state", "idle")})] == 1.0
    assert sum(series["timesliced_group_state"].values()) == 1.0
    assert series["timesliced_group_draining"] == {frozenset({("group", "pool")}): 1.0}
    assert series["timesliced_group_deferred_snapshots_total"] == {frozenset({("group", "pool")}): 7.0}


def test_a_holder_past_its_maximum_slice_and_preemptions_are_exported() -> None:
    doc = copy.deepcopy(STATUS)
    doc["groups"][0].update(overdue_s=4.5, preemptions=3)
    doc["counters"] = {**doc["counters"], "auth_failures": 2, "leases_expired": 1}
    series = scrape(Metrics(provider(doc), node="vm"))
    assert series["timesliced_group_overdue_seconds"] == {frozenset({("group", "pool")}): 4.5}
    assert series["timesliced_group_preemptions_total"] == {frozenset({("group", "pool")}): 3.0}
    events = series["timesliced_connection_events_total"]
    assert events[frozenset({("event", "auth_failures")})] == 2.0
    assert events[frozenset({("event", "leases_expired")})] == 1.0


def test_groups_without_draining_or_deferred_read_as_zero() -> None:
    doc = copy.deepcopy(STATUS)
    del doc["groups"][0]["draining"], doc["groups"][0]["deferred"]
    series = scrape(Metrics(provider(doc), node="vm"))
    assert series["timesliced_group_draining"] == {frozenset({("group", "pool")}): 0.0}
    assert series["timesliced_group_deferred_snapshots_total"] == {frozenset({("group", "pool")}): 0.0}


def test_a_state_or_location_this_module_does_not_know_still_shows() -> None:
    doc = copy.deepcopy(STATUS)
    doc["groups"][0]["state"] = "frozen"
    doc["jobs"][0]["location"] = "elsewhere"
    series = scrape(Metrics(provider(doc), node="vm"))
    assert series["timesliced_group_state"][frozenset({("group", "pool"), ("state", "frozen")})] == 1.0
    assert sum(series["timesliced_group_state"].values()) == 1.0
    rl_math = {k: v for k, v in series["timesliced_job_location"].items() if ("job", "rl-math") in k}
    assert rl_math[frozenset({("job", "rl-math"), ("location", "elsewhere")})] == 1.0
    assert sum(rl_math.values()) == 1.0


def test_without_telemetry_the_devices_give_memory_and_no_duty() -> None:
    doc = copy.deepcopy(STATUS)
    doc["telemetry"] = None
    series = scrape(Metrics(provider(doc), node="vm"))
    assert "timesliced_gpu_duty_ratio" not in series
    assert "timesliced_gpu_duty_window_ratio" not in series
    assert series["timesliced_gpu_memory_used_bytes"] == {
        frozenset({("gpu", "0")}): 41943040.0,
        frozenset({("gpu", "1")}): 0.0,
    }
    assert series["timesliced_gpu_memory_total_bytes"] == {
        frozenset({("gpu", "0")}): 67108864.0,
        frozenset({("gpu", "1")}): 67108864.0,
    }


def test_a_gpu_only_telemetry_knows_still_shows() -> None:
    doc = copy.deepcopy(STATUS)
    doc["devices"] = doc["devices"][:1]
    series = scrape(Metrics(provider(doc), node="vm"))
    # GPU 1 has no device entry and no memory sample: duty only, and no made-up memory figure.
    assert series["timesliced_gpu_duty_ratio"][frozenset({("gpu", "1")})] == 0.0
    assert frozenset({("gpu", "1")}) not in series["timesliced_gpu_memory_used_bytes"]
    assert series["timesliced_gpu_memory_total_bytes"][frozenset({("gpu", "1")})] == 67108864.0


def test_grants_fill_the_wait_and_switch_histograms() -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    metrics.observe_grant("pool", 0.0, 0.0, switched=False)
    metrics.observe_grant("pool", 0.3, 2.0, switched=True)
    metrics.observe_grant("pool", 700.0, 0.004, switched=True)
    metrics.observe_grant("other", 0.02, 9.0, switched=False)
    series = scrape(metrics)

    pool, other = frozenset({("group", "pool")}), frozenset({("group", "other")})
    assert series["timesliced_acquire_wait_seconds_count"] == {pool: 3.0, other: 1.0}
    assert series["timesliced_acquire_wait_seconds_sum"][pool] == pytest.approx(700.3)
    assert series["timesliced_switch_duration_seconds_count"] == {pool: 2.0}  # unswitched grants are not switches
    assert series["timesliced_switch_duration_seconds_sum"][pool] == pytest.approx(2.004)

    wait = buckets(series, "timesliced_acquire_wait_seconds", pool)
    assert wait[0.001] == 1.0  # the grant that never waited
    assert wait[0.25] == 1.0
    assert wait[0.5] == 2.0
    assert wait[600.0] == 2.0  # 700 s is past the last finite bucket
    assert wait[math.inf] == 3.0
    switch = buckets(series, "timesliced_switch_duration_seconds", pool)
    assert switch[0.0025] == 0.0
    assert switch[0.005] == 1.0
    assert switch[1.0] == 1.0
    assert switch[2.5] == 2.0


def test_moves_fill_the_move_histogram_and_byte_counter() -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    metrics.observe_move("snapshot", "sim", 41943040, 0.075)
    metrics.observe_move("snapshot", "sim", 1000, 0.02)
    metrics.observe_move("restore", "cuda-checkpoint", 2**30, 12.0)
    series = scrape(metrics)

    snap = frozenset({("kind", "snapshot"), ("method", "sim")})
    restore = frozenset({("kind", "restore"), ("method", "cuda-checkpoint")})
    assert series["timesliced_move_duration_seconds_count"] == {snap: 2.0, restore: 1.0}
    assert series["timesliced_move_duration_seconds_sum"][snap] == pytest.approx(0.095)
    assert series["timesliced_move_bytes_total"] == {snap: 41944040.0, restore: float(2**30)}
    b = buckets(series, "timesliced_move_duration_seconds", snap)
    assert (b[0.01], b[0.025], b[0.05], b[0.1]) == (0.0, 1.0, 1.0, 2.0)
    assert buckets(series, "timesliced_move_duration_seconds", restore)[10.0] == 0.0
    assert buckets(series, "timesliced_move_duration_seconds", restore)[30.0] == 1.0


def test_histograms_use_the_buckets_from_a_millisecond_to_ten_minutes() -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    metrics.observe_grant("pool", 1.0, 1.0, switched=True)
    metrics.observe_move("restore", "offload", 1, 1.0)
    series = scrape(metrics)
    expected = [*BUCKETS, math.inf]
    assert expected[0] == 0.001 and expected[-2] == 600
    for name, labels in (
        ("timesliced_acquire_wait_seconds", frozenset({("group", "pool")})),
        ("timesliced_switch_duration_seconds", frozenset({("group", "pool")})),
        ("timesliced_move_duration_seconds", frozenset({("kind", "restore"), ("method", "offload")})),
    ):
        assert sorted(buckets(series, name, labels)) == expected


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.observe_grant("pool", -0.1, 0.0, switched=False), "waited_s"),
        (lambda m: m.observe_grant("pool", math.nan, 0.0, switched=False), "waited_s"),
        (lambda m: m.observe_grant("pool", 0.0, math.inf, switched=True), "switch_s"),
        (lambda m: m.observe_move("park", "sim", 1, 0.1), "kind"),
        (lambda m: m.observe_move("snapshot", "", 1, 0.1), "method"),
        (lambda m: m.observe_move("snapshot", "sim", -1, 0.1), "nbytes"),
        (lambda m: m.observe_move("restore", "sim", 1, -0.1), "seconds"),
    ],
)
def test_bad_observations_raise_and_record_nothing(call: Any, match: str) -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    with pytest.raises(ValueError, match=match):
        call(metrics)
    series = scrape(metrics)
    assert not any(name.startswith(LIVE[:4]) for name in series)


def test_an_unswitched_grant_ignores_its_switch_time() -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    metrics.observe_grant("pool", 0.1, math.nan, switched=False)
    series = scrape(metrics)
    assert series["timesliced_acquire_wait_seconds_count"] == {frozenset({("group", "pool")}): 1.0}
    assert "timesliced_switch_duration_seconds_count" not in series


def test_two_daemons_do_not_share_series() -> None:
    other = copy.deepcopy(STATUS)
    other["groups"][0]["group"] = "solo"
    for job in other["jobs"]:
        job["group"] = "solo"
    a = Metrics(provider(STATUS), node="a")
    b = Metrics(provider(other), node="b")
    assert a.registry is not b.registry
    a.observe_grant("pool", 0.5, 0.0, switched=False)
    a.observe_move("snapshot", "sim", 10, 0.1)

    sa, sb = scrape(a), scrape(b)
    assert sa["timesliced_acquire_wait_seconds_count"] == {frozenset({("group", "pool")}): 1.0}
    assert "timesliced_acquire_wait_seconds_count" not in sb
    assert "timesliced_move_bytes_total" not in sb
    assert set(sa["timesliced_info"]) == {frozenset({("node", "a"), ("version", "0.1.0"), ("backend", "sim")})}
    assert set(sb["timesliced_info"]) == {frozenset({("node", "b"), ("version", "0.1.0"), ("backend", "sim")})}
    assert set(sb["timesliced_group_queue_depth"]) == {frozenset({("group", "solo")})}


def test_a_failing_status_leaves_the_live_series_and_counts_itself(caplog: pytest.LogCaptureFixture) -> None:
    broken = True

    def status() -> dict[str, Any]:
        if broken:
            raise RuntimeError("scheduler exploded")
        return STATUS

    metrics = Metrics(status, node="vm")
    metrics.observe_grant("pool", 0.2, 0.1, switched=True)
    metrics.observe_move("restore", "vllm", 5, 0.3)
    with caplog.at_level(logging.DEBUG, logger="timesliced.metrics"):
        first, second = scrape(metrics), scrape(metrics)
    for series in (first, second):
        assert status_part(series) == {}
        assert series["timesliced_acquire_wait_seconds_count"] == {frozenset({("group", "pool")}): 1.0}
        assert series["timesliced_switch_duration_seconds_count"] == {frozenset({("group", "pool")}): 1.0}
        assert series["timesliced_move_duration_seconds_count"] == {
            frozenset({("kind", "restore"), ("method", "vllm")}): 1.0
        }
    # The failing scrape already counts itself.
    assert first["timesliced_status_errors_total"] == {frozenset(): 1.0}
    assert second["timesliced_status_errors_total"] == {frozenset(): 2.0}
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1, "a run of failing scrapes is logged once"
    assert errors[0].exc_info is not None and "scheduler exploded" in str(errors[0].exc_info[1])

    broken = False
    assert status_part(scrape(metrics)) == EXPECTED_STATUS_SERIES


def test_a_malformed_status_yields_nothing_rather_than_half_a_picture() -> None:
    doc = copy.deepcopy(STATUS)
    del doc["jobs"][2]["location"]  # the last thing read: every family before it was already built
    metrics = Metrics(provider(doc), node="vm")
    series = scrape(metrics)
    assert status_part(series) == {}
    assert series["timesliced_status_errors_total"] == {frozenset(): 1.0}


def test_the_job_cap_keeps_the_first_jobs_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics(provider(STATUS), node="vm", max_jobs=2)
    with caplog.at_level(logging.WARNING, logger="timesliced.metrics"):
        series = scrape(metrics)
        scrape(metrics)
    kept = {frozenset({("job", "rl-math")}), frozenset({("job", "sft-chat")})}
    assert set(series["timesliced_job_bytes_moved_total"]) == kept
    assert set(series["timesliced_job_faulted"]) == kept
    assert {dict(k)["job"] for k in series["timesliced_job_gpu_seconds_total"]} == {"rl-math", "sft-chat"}
    assert {dict(k)["job"] for k in series["timesliced_job_location"]} == {"rl-math", "sft-chat"}
    assert series["timesliced_job_series_dropped"] == {frozenset(): 1.0}
    # Per-group series are not jobs' and are not capped: the holder beyond the cap still shows.
    assert series["timesliced_group_holder"] == {frozenset({("group", "pool"), ("job", "sft-chat")}): 1.0}
    assert [r.getMessage() for r in caplog.records] == [
        "metrics: 1 jobs exceed the cap of 2 job series; their series are left out"
    ]


def test_the_job_cap_warns_again_after_going_back_under_it(caplog: pytest.LogCaptureFixture) -> None:
    doc = copy.deepcopy(STATUS)
    metrics = Metrics(provider(doc), node="vm", max_jobs=2)
    with caplog.at_level(logging.WARNING, logger="timesliced.metrics"):
        scrape(metrics)
        gone = doc["jobs"].pop()
        assert scrape(metrics)["timesliced_job_series_dropped"] == {frozenset(): 0.0}
        doc["jobs"].append(gone)
        scrape(metrics)
    assert len(caplog.records) == 2


def test_a_zero_job_cap_exposes_no_job_series() -> None:
    series = scrape(Metrics(provider(STATUS), node="vm", max_jobs=0))
    assert not any(name.startswith("timesliced_job_") and name != "timesliced_job_series_dropped" for name in series)
    assert series["timesliced_job_series_dropped"] == {frozenset(): 3.0}


def test_a_negative_job_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_jobs"):
        Metrics(provider(STATUS), node="vm", max_jobs=-1)


def test_a_limit_a_refused_park_and_a_follower_without_figures() -> None:
    status = copy.deepcopy(STATUS)
    status["host"][0]["limit"] = 1 << 29
    status["jobs"][1]["park_refused"] = "snapshot failed: no space left on device"
    del status["jobs"][2]["parked_bytes"], status["jobs"][2]["park_refused"]  # as a follower shows its jobs
    series = scrape(Metrics(lambda: status, node="vm"))
    assert series["timesliced_host_limit_bytes"] == {frozenset({("node", "vm")}): float(1 << 29)}
    assert series["timesliced_job_park_refused"][frozenset({("job", "sft-chat")})] == 1.0
    assert frozenset({("job", "rl-code")}) not in series["timesliced_job_parked_bytes"]


def test_a_node_beyond_the_members_shows_by_its_slot() -> None:
    status = copy.deepcopy(STATUS)
    status["host"][0]["slot"] = 3
    series = scrape(Metrics(lambda: status, node="vm"))
    assert set(series["timesliced_host_budget_bytes"]) == {frozenset({("node", "3")})}


def test_forgetting_a_group_drops_its_live_series() -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    metrics.observe_grant("pool", 0.1, 0.2, switched=True)
    metrics.observe_grant("gone", 0.1, 0.2, switched=True)
    metrics.forget_group("gone")
    metrics.forget_group("never-existed")
    series = scrape(metrics)
    assert set(series["timesliced_acquire_wait_seconds_count"]) == {frozenset({("group", "pool")})}
    assert set(series["timesliced_switch_duration_seconds_count"]) == {frozenset({("group", "pool")})}


@pytest.mark.parametrize("accept", [None, "", "text/plain", "*/*", "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"])
def test_plain_text_unless_openmetrics_is_asked_for(accept: str | None) -> None:
    body, content_type = Metrics(provider(STATUS), node="vm").render(accept)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert not body.endswith(b"# EOF\n")


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text",
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
        "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1",
    ],
)
def test_openmetrics_when_asked_for(accept: str) -> None:
    metrics = Metrics(provider(STATUS), node="vm")
    metrics.observe_grant("pool", 0.3, 0.0, switched=False)
    body, content_type = metrics.render(accept)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")
    families = {f.name: f for f in parse_openmetrics(body.decode())}
    assert families["timesliced"].type == "info"
    assert families["timesliced_group_grants"].type == "counter"
    assert families["timesliced_acquire_wait_seconds"].type == "histogram"
    count = [s for s in families["timesliced_acquire_wait_seconds"].samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in count] == [({"group": "pool"}, 1.0)]


def buckets(series: dict[str, dict[Labels, float]], name: str, labels: Labels) -> dict[float, float]:
    """The cumulative bucket counts of one histogram series, by upper bound."""
    out = {}
    for key, value in series[name + "_bucket"].items():
        d = dict(key)
        le = d.pop("le")
        if frozenset(d.items()) == labels:
            out[float(le)] = value
    return out


def test_a_job_over_its_declaration_shows_by_how_much() -> None:
    status = copy.deepcopy(STATUS)
    status["jobs"][1]["declared"] = {"0": 30 << 20}
    status["jobs"][1]["over_declared_bytes"] = 10 << 20
    series = scrape(Metrics(lambda: status, node="vm"))
    # only jobs that declared their memory have the series
    assert series["timesliced_job_over_declared_bytes"] == {frozenset({("job", "sft-chat")}): float(10 << 20)}


def test_the_sim_pool_shows_where_the_node_has_a_simulated_gpu() -> None:
    assert "timesliced_sim_pool_bytes" not in scrape(Metrics(provider(STATUS), node="vm"))
    status = copy.deepcopy(STATUS)
    status["host_memory"]["sim_pool"] = {"held": 3 << 20, "limit": 1 << 30, "taken": 4, "missed": 1}
    series = scrape(Metrics(lambda: status, node="vm"))
    assert series["timesliced_sim_pool_bytes"] == {frozenset(): float(3 << 20)}
    assert series["timesliced_sim_pool_limit_bytes"] == {frozenset(): float(1 << 30)}


def test_memory_a_parked_job_holds_on_a_simulated_gpu_shows_per_job() -> None:
    assert "timesliced_sim_held_bytes" not in scrape(Metrics(provider(STATUS), node="vm"))
    status = copy.deepcopy(STATUS)
    status["parking"]["sim_held"] = {
        "a": {"bytes": 4 << 20, "unfinished": False},
        "b": {"bytes": 0, "unfinished": True},
    }
    series = scrape(Metrics(lambda: status, node="vm"))
    assert series["timesliced_sim_held_bytes"] == {
        frozenset({("job", "a"), ("unfinished", "false")}): float(4 << 20),
        frozenset({("job", "b"), ("unfinished", "true")}): 0.0,
    }
