"""``kill -9`` of the daemon at every step of a switch, then a restart: nothing is lost.

Two job processes take turns on one simulated GPU too small for both, so every
switch parks one job and restores the other. The daemon kills itself with
SIGKILL at a chosen step (``$TIMESLICED_CRASH_AT``): before, in the middle of or
after a snapshot or a restore, or as a grant is made. A new daemon starts on the
same state directory. The jobs must reconnect on their own, find every byte they
wrote, and go on taking turns; no two grants may overlap; once the jobs exit, no
parked state is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from timesliced.bench.cluster import spawn_worker
from timesliced.bench.common import double_grants, read_grants
from timesliced.client.sync import daemon_status
from timesliced.config import CRASH_POINTS

pytestmark = pytest.mark.slow

SIZE = 20 << 20  # two of these do not fit on the 32 MiB GPU: every switch moves one
BANDWIDTH = "100000000"  # 100 MB/s: a move takes ~0.2 s, so a crash 50 ms in lands in the middle of it


class Daemon:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "timesliced.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, crash_at: str = "") -> None:
        cmd = [
            sys.executable, "-m", "timesliced", "serve", "--backend", "sim", "--web", "off",
            "--gpus", "1", "--gpu-memory", "32MiB", "--bandwidth", BANDWIDTH,
            "--state-dir", str(self.root), "--sim-dir", str(self.root / "sim"), "--log-level", "INFO",
        ]  # fmt: skip
        env = {**os.environ, "TIMESLICED_CRASH_AT": crash_at}
        with open(self.root / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                daemon_status(self.socket, timeout=2)
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not start: {self.log()[-3000:]}") from None
                time.sleep(0.05)

    def wait_dead(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return (self.root / "daemon.log").read_text(errors="replace")


@pytest.fixture
def daemon(tmp_path: Path) -> Daemon:
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_kill_9_at_each_step_of_a_switch(daemon: Daemon, tmp_path: Path, point: str) -> None:
    # A grant is killed once the jobs took turns (the very first one precedes any journal).
    daemon.start(crash_at=f"{point}@4" if point == "at-grant" else point)
    logs = {job: tmp_path / f"{job}.jsonl" for job in ("A", "B")}
    workers = {job: spawn_worker(job, "g", daemon.socket, 5.0, SIZE, log) for job, log in logs.items()}
    try:
        assert daemon.wait_dead(timeout=30) == -signal.SIGKILL, daemon.log()[-3000:]
        killed_at = time.monotonic()
        assert f"crash point {point}" in daemon.log()
        daemon.start()
        results = {}
        for job, proc in workers.items():
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
            results[job] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = daemon.log()
    assert "took up job" in log, log[-3000:]
    for job, result in results.items():
        assert "lost" not in result, (job, result, log[-3000:])
        assert result["data_errors"] == 0, (job, result)
    grants = read_grants(*logs.values())
    assert double_grants(grants) == 0
    after = {g["job"] for g in grants if g["start"] > killed_at}
    assert after == {"A", "B"}, f"both jobs take turns again after the restart: {after}"
    # The jobs exited: their state is reclaimed, nothing stays parked with nobody to restore it.
    deadline = time.monotonic() + 10
    while daemon_status(daemon.socket)["jobs"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon_status(daemon.socket)["jobs"] == []
    assert not any((tmp_path / "sim" / "parked").iterdir())
