"""``timesliced advise`` against a real daemon: jobs with different phases, then the advice as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from timesliced.client import Client
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.wire.status import problems

from ..helpers.processes import REPO

pytestmark = pytest.mark.slow  # a few seconds of jobs taking turns

MiB = 1 << 20
PHASES = 8


def advise(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "timesliced", "advise", "--address", address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def run_job(address: str, job: str, gpus: list[int], busy: float, gap: float, errors: list[BaseException]) -> None:
    """A job that holds its group ``busy`` seconds, then computes alone ``gap`` seconds, PHASES times."""
    try:
        with Client(job, f"g-{job}", address=address, gpus=gpus) as c:
            c.sim_alloc(8 * MiB, gpu=gpus[0])
            for _ in range(PHASES + 1):
                c.acquire(timeout=30)
                time.sleep(busy)
                c.release()
                time.sleep(gap)
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_advise_pairs_the_jobs_whose_phases_interleave(daemon: EmbeddedDaemon) -> None:
    address = str(daemon.socket)
    early = advise(address, "--json")
    assert early.returncode == 1 and "not enough history" in early.stderr and "run the jobs longer" in early.stderr

    errors: list[BaseException] = []
    jobs = {"rl-a": ([0], 0.02, 0.10), "sft-b": ([1], 0.02, 0.08), "busy": ([1], 0.15, 0.0)}
    threads = [threading.Thread(target=run_job, args=(address, name, *spec, errors)) for name, spec in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors

    result = advise(address, "--json")
    assert result.returncode == 0, result.stderr
    advice = json.loads(result.stdout)
    assert advice["message"] is None and advice["missing"] == [] and advice["exact"]
    by_job = {j["job"]: j for j in advice["jobs"]}
    assert set(by_job) == set(jobs)
    assert by_job["busy"]["duty"] > 0.9 > 0.5 > by_job["rl-a"]["duty"]
    groups = sorted(sorted(g["jobs"]) for g in advice["suggested"])
    assert groups == [["busy"], ["rl-a", "sft-b"]]
    for g in advice["suggested"]:
        assert set(g) >= {"jobs", "gpus", "predicted_duty", "predicted_makespan_s", "reason"}
        assert g["gpus"] == 1 and g["reason"] and 0 < g["predicted_duty"] <= 1
    assert {tuple(g["jobs"]) for g in advice["current"]["groups"]} == {("rl-a",), ("sft-b",), ("busy",)}

    text = advise(address)
    assert text.returncode == 0 and "SUGGESTED" in text.stdout and "rl-a + sft-b" in text.stdout

    with Client("probe", "probe-group", address=address) as probe:
        status = probe.status()
    assert problems(status) == []
    phases = {j["job"]: j["phases"] for j in status["jobs"]}
    assert phases["rl-a"]["count"] == PHASES + 1 and phases["rl-a"]["gaps"] == PHASES
    assert phases["rl-a"]["memory_peak_bytes"] == 8 * MiB
