"""``timesliced serve --config FILE`` as a user runs it: a real daemon process with the file's settings
under the flags, and a declared group's GPUs and policy holding for real clients."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.client.sync import daemon_status
from timesliced.env import default_sim_dir

from ..helpers.processes import REPO, wait_for

pytestmark = pytest.mark.slow  # real daemon processes

MiB = 1 << 20

CONFIG = """
backend = "sim"
web = "off"
gpus = 3                      # the command line says 4
gpu_memory = "64MiB"
bandwidth = 0
state_dir = "state"           # relative to this file's directory
socket = "ts.sock"
host_memory_limit = "1GiB"
lease = 0

[groups.rl]
gpus = [1, 2]
policy = "priority"
aging = 600
max_slice = 300
"""


def serve(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "timesliced", "serve", *args], stderr=subprocess.PIPE, text=True, env=env
    )


def ready(sock: Path, proc: subprocess.Popen[str]) -> Any:
    """The daemon's status once it answers (it runs, or the test fails with what it said)."""
    found: list[Any] = []

    def answers() -> bool:
        if proc.poll() is not None:
            assert proc.stderr is not None
            raise AssertionError(f"the daemon exited {proc.returncode}: {proc.stderr.read()}")
        try:
            found.append(daemon_status(str(sock)))
        except errors.TimeslicedError:
            return False
        return True

    wait_for(answers, timeout=30, interval=0.05)
    return found[-1]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    config = tmp_path / "timesliced.toml"
    config.write_text(CONFIG, encoding="utf-8")
    proc = serve("--config", str(config), "--gpus", "4")
    sock = tmp_path / "ts.sock"
    try:
        yield sock, ready(sock, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert proc.stderr is not None
        proc.stderr.close()
        shutil.rmtree(default_sim_dir(tmp_path / "state"), ignore_errors=True)


def group_of(sock: Path, name: str) -> Any:
    return next(g for g in daemon_status(str(sock))["groups"] if g["group"] == name)


def test_serve_runs_with_the_file_s_settings_under_the_flags(daemon: tuple[Path, Any], tmp_path: Path) -> None:
    sock, status = daemon
    assert sock.exists()  # the file's socket, relative to the file's directory
    assert (tmp_path / "state").is_dir()
    assert [d["capacity"] for d in status["devices"]] == [64 * MiB] * 4  # the file's memory, the flag's count
    assert status["backend"] == "sim"
    (host,) = status["host"]
    assert host["limit"] == 1 << 30


def test_a_declared_group_gives_its_gpus_and_refuses_others(daemon: tuple[Path, Any]) -> None:
    sock, _ = daemon
    with timesliced.Client(job="a", group="rl", address=str(sock)) as a:  # names no GPUs: gets the group's
        a.acquire(timeout=30)
        group = group_of(sock, "rl")
        assert group["gpus"] == [1, 2] and group["holder"] == "a"
        assert (group["policy"], group["aging_s"], group["max_slice_s"]) == ("priority", 600.0, 300.0)
        a.release()
    with timesliced.Client(job="b", group="rl", address=str(sock), gpus=[2, 1]) as b:  # the same GPUs
        b.acquire(timeout=30)
        b.release()
    refused = pytest.raises(errors.GroupMismatch, match=r"declared on GPUs \[1, 2\] by the daemon's config file")
    with refused, timesliced.Client(job="c", group="rl", address=str(sock), gpus=[0]) as c:
        c.acquire(timeout=30)
    with timesliced.Client(job="d", group="other", address=str(sock), gpus=[0]) as d:  # not declared: as asked
        d.acquire(timeout=30)
        assert group_of(sock, "other")["gpus"] == [0] and group_of(sock, "other")["policy"] == "fifo"
        d.release()


def test_a_declared_group_s_policy_orders_its_waiters(daemon: tuple[Path, Any]) -> None:
    sock, _ = daemon
    granted: list[str] = []
    lock = threading.Lock()

    def wait_and_hold(client: timesliced.Client) -> None:
        client.acquire(timeout=60)
        with lock:
            granted.append(client.job)
        client.release()

    holder = timesliced.Client(job="holder", group="rl", address=str(sock))
    low = timesliced.Client(job="low", group="rl", address=str(sock), priority=0)
    high = timesliced.Client(job="high", group="rl", address=str(sock), priority=5)
    threads = []
    try:
        holder.acquire(timeout=30)
        for client, queued in ((low, 1), (high, 2)):  # low asks first, then high; each is seen queued
            threads.append(threading.Thread(target=wait_and_hold, args=(client,)))
            threads[-1].start()
            wait_for(lambda n=queued: len(group_of(sock, "rl")["queue"]) == n, timeout=30, interval=0.05)
        holder.release()
        for t in threads:
            t.join(60)
        # priority (the file's policy for rl): high goes before low, who asked first; fifo would be the reverse
        assert granted == ["high", "low"]
    finally:
        for client in (holder, low, high):
            client.close()


def test_serve_refuses_a_bad_file_and_a_group_on_gpus_the_node_lacks(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('gpus = 0\nweb = "off"\n[groups.rl]\ngpus = ["x"]\n', encoding="utf-8")
    proc = serve("--config", str(bad))
    assert proc.wait(30) == 1
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.stderr.close()
    assert f"{bad}: gpus: expected an integer >= 1, not 0" in err
    assert f"{bad}: groups.rl.gpus[0]: expected a GPU index (an integer >= 0), not 'x'" in err
    lacking = tmp_path / "lacking.toml"
    lacking.write_text(
        'backend = "sim"\nweb = "off"\ngpus = 2\ngpu_memory = "8MiB"\nstate_dir = "s"\n[groups.rl]\ngpus = [1, 5]\n',
        encoding="utf-8",
    )
    proc = serve("--config", str(lacking))
    try:
        assert proc.wait(30) == 1
        assert proc.stderr is not None
        assert "groups.rl.gpus: this node has no GPU [5] (it has [0, 1])" in proc.stderr.read()
        proc.stderr.close()
    finally:
        shutil.rmtree(default_sim_dir(tmp_path / "s"), ignore_errors=True)
