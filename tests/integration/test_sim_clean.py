"""What a killed daemon leaves of the simulated GPU, and how it goes: the next start, or ``timesliced sim clean``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import timesliced
from timesliced.env import default_sim_dir
from timesliced.sim.clean import clean

from ..helpers.processes import REPO, wait_for

MiB = 1 << 20


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "timesliced", *args], capture_output=True, text=True, timeout=60, env=env
    )


class Served:
    """``timesliced serve`` on simulated GPUs, as a process that a test may kill."""

    def __init__(self, root: Path) -> None:
        self.state, self.sock = root / "state", str(root / "ts.sock")
        self.sim = default_sim_dir(self.state)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["serve", "--web", "off", "--backend", "sim", "--state-dir", str(self.state), "--socket", self.sock]
        args += ["--gpus", "1", "--gpu-memory", "32MiB", "--bandwidth", "0"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "timesliced", *args], stderr=subprocess.DEVNULL, env=env)
        wait_for(lambda: cli("status", "--address", self.sock).returncode == 0, timeout=30, interval=0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    daemon = Served(tmp_path)
    yield daemon
    if daemon.proc is not None and daemon.proc.poll() is None:
        daemon.proc.kill()
        daemon.proc.wait(10)
    shutil.rmtree(daemon.sim, ignore_errors=True)


def leave_state(daemon: Served) -> None:
    """Two jobs with simulated memory, one of them parked, then the daemon killed with SIGKILL."""
    daemon.start()
    a = timesliced.Client(job="a", group="g", address=daemon.sock)
    b = timesliced.Client(job="b", group="g", address=daemon.sock)
    with a.slice():
        a.sim_alloc(20 * MiB).close()
    with b.slice():
        b.sim_alloc(20 * MiB).close()  # parks a: its region goes to a file
    a.close()
    b.close()
    daemon.kill()


@pytest.mark.slow
def test_a_killed_daemon_leaves_its_state_and_sim_clean_removes_it(served: Served) -> None:
    leave_state(served)
    # What a daemon killed outright leaves on tmpfs: the arena, a control file per job, a's parked copy.
    assert (served.sim / "gpu0.arena").is_file()
    assert len(list((served.sim / "jobs").glob("*.ctl"))) == 2
    assert len(list((served.sim / "parked").glob("*/*.bin"))) == 1
    done = cli("sim", "clean", "--state-dir", str(served.state))
    assert done.returncode == 0, done.stderr
    assert f"removed the simulated GPU state at {served.sim}: 2 job(s), 1 parked region(s)" in done.stdout
    assert "MiB of memory" in done.stdout  # b's 20 MiB resident in the arena and a's parked 20 MiB
    assert not served.sim.exists()
    again = cli("sim", "clean", "--state-dir", str(served.state))
    assert again.returncode == 0 and "nothing to clean" in again.stdout


@pytest.mark.slow
def test_sim_clean_refuses_while_a_daemon_runs(served: Served) -> None:
    served.start()
    with timesliced.Client(job="a", group="g", address=served.sock) as a, a.slice():
        region = a.sim_alloc(4 * MiB)
        refused = cli("sim", "clean", "--sim-dir", str(served.sim))
        assert refused.returncode == 1
        assert (
            refused.stderr.count("\n") == 1 and "in use by a running daemon; stop that daemon first" in refused.stderr
        )
        region.fill(b"still here")  # nothing was removed under the running daemon
        assert (served.sim / "jobs").is_dir() and (served.sim / "gpu0.arena").is_file()
        region.close()


@pytest.mark.slow
def test_the_next_daemon_gives_back_state_that_no_journal_owns(served: Served) -> None:
    leave_state(served)
    for journal in served.state.glob("journal.*"):
        journal.unlink()  # the state dir was wiped, the tmpfs was not
    served.start()
    # Taken up before the daemon serves: no job of a journal owns the state, so it is reclaimed.
    assert list((served.sim / "jobs").glob("*.ctl")) == []
    assert list((served.sim / "parked").glob("*/*.bin")) == []
    with timesliced.Client(job="a", group="g", address=served.sock) as a, a.slice():
        assert [j["job"] for j in a.status()["jobs"]] == ["a"]
        a.sim_alloc(32 * MiB).close()  # the whole GPU: b's resident pages were given back at the start


@pytest.mark.slow
def test_a_journal_that_cannot_be_read_keeps_the_state_it_may_own(served: Served) -> None:
    leave_state(served)
    journals = list(served.state.glob("journal.*"))
    assert journals
    for journal in journals:
        journal.write_bytes(b"written by some other release")  # there, but not readable by this one
    served.start()
    # a's parked copy may be its only one: nothing is reclaimed while the journal is there
    assert len(list((served.sim / "jobs").glob("*.ctl"))) == 2
    assert len(list((served.sim / "parked").glob("*/*.bin"))) == 1


def test_clean_leaves_what_is_not_the_simulated_gpus(tmp_path: Path) -> None:
    root = tmp_path / "sim"
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "a-0123.ctl").write_bytes(b"x")
    (root / "gpu0.arena").write_bytes(b"\0" * 4096)
    (root / "daemon.lock").touch()
    (root / "notes.txt").write_text("mine")
    done = clean(root)
    assert (done.existed, done.jobs, done.kept) == (True, 1, ("notes.txt",))
    assert sorted(p.name for p in root.iterdir()) == ["daemon.lock", "notes.txt"]  # the rest went
    (root / "notes.txt").unlink()
    assert clean(root).kept == () and not root.exists()
    assert not clean(root).existed


def test_an_os_error_while_cleaning_is_a_backend_error_that_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "sim"
    (root / "jobs").mkdir(parents=True)

    def refuse(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(39, "Directory not empty", str(path))  # a daemon starting meanwhile wrote into it

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.raises(timesliced.errors.BackendError, match="run `timesliced sim clean` again") as caught:
        clean(root)
    assert "Directory not empty" in caught.value.message and str(root) in caught.value.message
