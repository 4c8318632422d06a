"""``timesliced bench load`` as a user runs it: a daemon process and job processes, briefly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from timesliced.bench.load import DaemonSample, ProcessSample, failed, lost_fences, summarize

from ..helpers.processes import REPO

MiB = 1 << 20
KEYS = {
    "clients",
    "groups",
    "seconds",
    "ops_per_s",
    "p50_ms",
    "p99_ms",
    "errors",
    "data_errors",
    "lost_grants",
    "double_grants",
    "switches",
    "daemon_cpu_s",
    "rss_start_mb",
    "rss_end_mb",
    "rss_anon_start_mb",
    "rss_anon_end_mb",
}


@pytest.mark.slow
def test_bench_load_runs_jobs_without_losing_a_grant_or_a_byte() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["bench", "load", "--clients", "8", "--groups", "2", "--seconds", "3", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "timesliced", *args], capture_output=True, text=True, timeout=90, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout)
    assert figures.keys() >= KEYS
    assert (figures["clients"], figures["groups"], figures["seconds"]) == (8, 2, 3.0)
    failures = {k: figures[k] for k in ("errors", "data_errors", "lost_grants", "double_grants")}
    assert failures == dict.fromkeys(failures, 0), figures["error_messages"]
    assert figures["ops_per_s"] > 0 and figures["p99_ms"] >= figures["p50_ms"] > 0
    # four jobs per group and room for two on each GPU: grants have to move state
    assert figures["switches"] > 0 and figures["restored_grants"] > 0
    assert figures["rss_start_mb"] > 0 and figures["rss_end_mb"] > 0


def test_bench_load_refuses_fewer_clients_than_groups() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["bench", "load", "--clients", "2", "--groups", "3"]
    result = subprocess.run(
        [sys.executable, "-m", "timesliced", *args], capture_output=True, text=True, timeout=30, env=env
    )
    assert result.returncode != 0
    assert "at least one client per group" in result.stderr


def grant(job: str, fence: int, start: float, end: float, group: str = "g") -> dict[str, object]:
    return {
        "job": job,
        "group": group,
        "term": 0,
        "fence": fence,
        "restored": True,
        "switch_s": 0.002,
        "asked": start - 0.01,
        "start": start,
        "end": end,
        "released": end + 0.001,
        "warmup": False,
    }


def sample(cpu_s: float, fences: dict[str, int]) -> DaemonSample:
    return DaemonSample(ProcessSample(cpu_s, 40 * MiB, 30 * MiB), fences, dict.fromkeys(fences, 0))


def test_summary_counts_each_kind_of_failure() -> None:
    # fence 3 of group g was granted to nobody that logged it; b overlaps a's hold
    grants = [grant("a", 1, 1.0, 1.5), grant("b", 2, 1.2, 1.8), grant("a", 4, 2.0, 2.5)]
    summaries = [
        {"job": "a", "rounds": 2, "errors": 1, "data_errors": 2, "stuck": 0, "messages": ["NotHolder: x"]},
        {"job": "b", "rounds": 1, "errors": 0, "data_errors": 0, "stuck": 1, "messages": []},
        None,  # killed, or crashed
    ]
    figures = summarize(grants, summaries, sample(1.0, {"g": 4}), sample(2.0, {"g": 4}), 0.5, ["job 2 died"])
    assert (figures["errors"], figures["data_errors"], figures["double_grants"]) == (1, 2, 1)
    assert figures["lost_grants"] == 1 + 1 + 1  # the fence gap, the stuck acquire, the silent job
    assert figures["ops"] == 3 and figures["daemon_cpu_s"] == 1.0
    assert figures["error_messages"] == ["NotHolder: x", "job 2 died"]
    assert failed(figures)


def test_a_clean_summary_has_not_failed() -> None:
    grants = [grant("a", 1, 1.0, 1.5), grant("b", 2, 1.6, 1.8), grant("c", 1, 1.0, 1.2, group="h")]
    summaries = [{"job": j, "rounds": 1, "errors": 0, "data_errors": 0, "stuck": 0, "messages": []} for j in "abc"]
    figures = summarize(grants, summaries, sample(1.0, {"g": 1, "h": 0}), sample(1.5, {"g": 2, "h": 1}), 0.5)
    assert figures["lost_grants"] == figures["double_grants"] == 0
    assert not failed(figures)


def test_lost_fences_are_those_nobody_logged() -> None:
    grants = [grant("a", 1, 1.0, 1.1), grant("a", 3, 1.2, 1.3), grant("a", 5, 1.4, 1.5, group="h")]
    assert lost_fences(grants, {"g": 3, "h": 5, "idle": 0}) == 1 + 4
    assert lost_fences(grants, {"g": 1}) == 0
