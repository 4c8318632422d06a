"""``timesliced bench workload --quick --json`` as a user runs it, on a tiny scenario: every mode runs,
no byte is lost and no two jobs hold a GPU at once. Never speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..helpers.processes import REPO

pytestmark = pytest.mark.slow

# Any two of the three trainer-side states fit on the trainer GPU (10 MiB), all three do not.
TINY = """
[gpus]
memory_gb = 40.0
bandwidth_gbps = 25.0
[scale]
seconds_per_minute = 1.0
mib_per_gb = 0.25
[quick]
seconds_per_minute = 0.05
iterations = 1.0

[[jobs]]
name = "rl-a"
kind = "rl"
iterations = 2
rollout_min = 4.0
reward_min = 1.0
train_min = 2.0
sync_min = 1.0
trainer_gb = 16.0
sampler_gb = 12.0
weights_gb = 4.0

[[jobs]]
name = "rl-b"
kind = "rl"
iterations = 2
rollout_min = 3.0
reward_min = 1.0
train_min = 2.0
sync_min = 1.0
trainer_gb = 16.0
sampler_gb = 12.0
weights_gb = 4.0

[[jobs]]
name = "sft"
kind = "sft"
iterations = 6
train_min = 1.0
load_min = 0.5
trainer_gb = 16.0
"""

MODE_KEYS = {
    "makespan_s",
    "gpu_hours",
    "duty",
    "switches",
    "bytes_moved",
    "median_switch_s",
    "median_wait_s",
    "data_errors",
    "overlaps",
    "timeline",
}
WORKERS = {"rl-a-sampler", "rl-a-trainer", "rl-b-sampler", "rl-b-trainer", "sft-trainer"}


def artifacts(tmp_path: Path) -> Path:
    where = os.environ.get("TIMESLICED_ARTIFACTS")
    path = Path(where) if where else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def two_jobs_at_once(timeline: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """Slices of different jobs on one GPU that overlap in time (checked here, apart from the harness's count)."""
    found = []
    for i, a in enumerate(timeline):
        for b in timeline[i + 1 :]:
            if a["gpu"] == b["gpu"] and a["job"] != b["job"] and a["start"] < b["end"] and b["start"] < a["end"]:
                found.append((a["job"], b["job"], a["gpu"]))
    return found


def test_two_jobs_at_once_finds_an_overlap() -> None:
    a = {"job": "x", "gpu": 0, "start": 0.0, "end": 1.0}
    assert two_jobs_at_once([a, {**a, "job": "y", "start": 0.5}]) == [("x", "y", 0)]
    assert two_jobs_at_once([a, {**a, "job": "y", "start": 1.0, "end": 2.0}, {**a, "gpu": 1, "job": "z"}]) == []


def workload_json(*args: str) -> dict[str, Any]:
    """``timesliced bench workload ARGS`` in a fresh interpreter; its ``--json`` report."""
    result = subprocess.run(
        [sys.executable, "-m", "timesliced", "bench", "workload", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_bench_workload_quick_runs_every_mode_without_losing_a_byte(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    png = artifacts(tmp_path) / "bench-workload.png"
    png.unlink(missing_ok=True)
    args = ["--scenario", str(scenario), "--quick", "--plot", str(png)]
    report = workload_json(*args)
    assert set(report["modes"]) == {"dedicated", "serial", "reference", "timesliced"}
    assert report["lower_bound_s"] == pytest.approx(0.05 * max(2 * 2 * 3 + 6, 2 * (5 + 4), 2 * 8))
    for name, mode in report["modes"].items():
        assert mode.keys() >= MODE_KEYS, name
        assert mode["data_errors"] == 0, (name, mode["error_notes"])
        assert mode["overlaps"] == 0 and two_jobs_at_once(mode["timeline"]) == [], name
        ran = {s["job"] for s in mode["timeline"]}
        assert ran == WORKERS, name
        phases = sorted(s["phase"] for s in mode["timeline"] if s["job"] == "rl-a-trainer")
        assert phases == ["sync", "sync", "train", "train"], name  # every phase of every iteration
        assert mode["makespan_s"] > 0 and mode["gpu_hours"] > 0
        assert len(mode["duty"]) == (5 if name == "dedicated" else 2)
        assert all(0 < d <= 1 for d in mode["duty"].values()), (name, mode["duty"])
    # the trainer GPU cannot hold all three trainer-side states: sharing it moves bytes
    assert report["modes"]["timesliced"]["bytes_moved"] > 0
    assert report["modes"]["dedicated"]["bytes_moved"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # matplotlib comes with the test extra


@pytest.mark.slow
def test_bench_workload_runs_the_packaged_short_gaps_scenario_with_anticipation() -> None:
    args = ["--scenario", "short-gaps", "--quick", "--modes", "timesliced,anticipating"]
    report = workload_json(*args)
    assert report["scenario"] == "the packaged scenario (short-gaps.toml)"
    assert set(report["modes"]) == {"timesliced", "anticipating"}
    for name, mode in report["modes"].items():
        assert mode["data_errors"] == 0 and mode["overlaps"] == 0, (name, mode["error_notes"])
        assert {s["job"] for s in mode["timeline"]} == {"sft-a-trainer", "sft-b-trainer"}, name
