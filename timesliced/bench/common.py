"""What the benchmark programs share: a daemon process, free ports, grant logs and printing figures."""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..env import default_sim_dir


class DaemonProcess:
    """``timesliced serve`` as a child process on a fresh state dir."""

    def __init__(self, *extra: str) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="timesliced-bench-"))
        self.socket = str(self.state / "timesliced.sock")
        cmd = [sys.executable, "-m", "timesliced", "serve", "--backend", "sim", "--state-dir", str(self.state)]
        cmd += ["--log-level", "WARNING", "--web", "off"]
        self.proc = subprocess.Popen([*cmd, "--socket", self.socket, *extra])
        deadline = time.monotonic() + 30
        while not answers(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the benchmark daemon did not start")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(default_sim_dir(self.state), ignore_errors=True)
        shutil.rmtree(self.state, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answers(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_grants(*logs: Path) -> list[dict[str, Any]]:
    grants = []
    for log in logs:
        if log.exists():
            grants += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return sorted(grants, key=lambda g: g["start"])


def double_grants(grants: list[dict[str, Any]]) -> int:
    """Pairs of different jobs whose held intervals of one group overlap, or (term, fence) reused by another job."""
    bad = 0
    by_group: dict[str, list[dict[str, Any]]] = {}
    for g in grants:
        by_group.setdefault(g["group"], []).append(g)
    for held in by_group.values():
        owner: dict[tuple[int, int], str] = {}
        for g in held:
            stamp = (g["term"], g["fence"])
            if owner.setdefault(stamp, g["job"]) != g["job"]:
                bad += 1
        for a, b in itertools.pairwise(held):
            if a["job"] != b["job"] and b["start"] < a["end"]:
                bad += 1
    return bad


def print_figures(figures: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(figures, indent=2))
        return
    for key, value in figures.items():
        print(f"{key:>22}: {value:.4f}" if isinstance(value, float) else f"{key:>22}: {value}")
