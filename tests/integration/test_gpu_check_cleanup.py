"""The GPU check ends clean (tests/gpu/procs.py, runner.py), shown with real dummy processes and no GPU.

Every process the check starts is in its own process group; the groups are
stopped on a normal end, a stop signal and the deadline, and even a SIGKILL of
the check takes its children along (PR_SET_PDEATHSIG). A rerun finds and
kills what an earlier run left behind by the marker in the environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu import procs
from tests.gpu.runner import problems
from tests.helpers.processes import REPO, wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# A child that starts a grandchild in its own process group, prints both PIDs, and ignores SIGTERM.
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(grandchild.pid, flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count: it holds no memory, GPU or other)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def children() -> Iterator[procs.Children]:
    kids = procs.Children(marker=f"test-{os.getpid()}-{time.monotonic_ns()}")
    yield kids
    kids.kill_all(0.5)


def first_line(path: Path, timeout: float = 10.0) -> str:
    wait_for(lambda: path.exists() and path.read_text().strip() != "", timeout)
    return path.read_text().split()[0]


def test_each_child_leads_its_own_process_group_and_carries_the_marker(
    children: procs.Children, tmp_path: Path
) -> None:
    a = children.spawn(SLEEPER)
    b = children.spawn(SLEEPER)
    assert os.getpgid(a.pid) == a.pid and os.getpgid(b.pid) == b.pid != os.getpgrp()
    wait_for(lambda: procs.marked().get(a.pid) == children.marker)
    # The shim has exec'd the real command: the PID is the sleeper's.
    wait_for(lambda: b"time.sleep(600)" in (Path("/proc") / str(a.pid) / "cmdline").read_bytes())
    assert sorted(children.groups()) == sorted([a.pid, b.pid])


def test_kill_all_stops_the_groups_with_their_grandchildren_even_past_sigterm(
    children: procs.Children, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with out.open("wb") as f:
        child = children.spawn([sys.executable, "-c", STUBBORN], stdout=f)
    grandchild = int(first_line(out))
    stopped = children.kill_all(grace=0.3)
    assert stopped == [child.pid]
    assert child.returncode == -signal.SIGKILL  # SIGTERM was ignored: SIGKILL after the grace
    wait_for(lambda: not alive(grandchild))
    assert children.groups() == [] and children.survivors() == []


def test_a_sigkilled_check_takes_its_children_with_it(tmp_path: Path) -> None:
    # A stand-in for check.py: starts a sleeper through Children, prints its PID, sleeps.
    out = tmp_path / "out"
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.gpu import procs
        kids = procs.Children()
        child = kids.spawn({SLEEPER!r})
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    with out.open("wb") as f:
        check = subprocess.Popen([sys.executable, "-c", code], stdout=f)
    try:
        child = int(first_line(out))
        wait_for(lambda: b"time.sleep(600)" in (Path("/proc") / str(child) / "cmdline").read_bytes())
        check.kill()  # SIGKILL: no cleanup code of the check runs
        check.wait(10)
        wait_for(lambda: not alive(child), timeout=10)
    finally:
        check.kill()
        check.wait(10)


def test_the_next_run_finds_what_an_earlier_run_left_and_kills_it(tmp_path: Path) -> None:
    # An "earlier run" whose owner is gone: a process with a marker naming a PID that has exited.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    env = {**os.environ, procs.MARKER: f"{gone.pid}:12345"}
    leftover = subprocess.Popen(SLEEPER, env=env, start_new_session=True)
    mine = procs.Children(marker=procs.own_marker())  # a live owner: never an orphan
    ours = mine.spawn(SLEEPER)
    try:
        wait_for(lambda: leftover.pid in procs.marked() and ours.pid in procs.marked())
        found = procs.orphans()
        assert leftover.pid in found and ours.pid not in found
        assert procs.kill_pids([leftover.pid]) == [leftover.pid]
        assert leftover.wait(10) == -signal.SIGKILL
    finally:
        leftover.kill()
        leftover.wait(10)
        mine.kill_all(0.5)


def test_only_the_owner_sweeps_by_marker(children: procs.Children) -> None:
    child = children.spawn(SLEEPER)
    wait_for(lambda: child.pid in procs.marked())
    assert not children.owner and children.sweep() == []  # given a marker: not the owner
    owner = procs.Children(marker=None)
    owner.marker = children.marker  # as if it had made this marker itself
    owner.owner = True
    assert owner.sweep() == [child.pid]
    assert child.wait(10) == -signal.SIGKILL


# --- a whole run, stopped by a signal or by its deadline ---------------------------------------

RUN = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from tests.gpu import procs, runner

    kids = procs.Children()

    def body(run):
        with run.stage("start", budget_s=5):
            pass
        with run.stage("work", budget_s=600):
            pids = [kids.spawn({sleeper!r}).pid for _ in range(3)]
            print("started " + " ".join(map(str, pids)), file=sys.stderr, flush=True)
            time.sleep(600)

    run = runner.Run(deadline_s=float(sys.argv[1]), children=kids, stages=["start", "work", "later"], reserve_s=0)
    sys.exit(run.execute(body))
    """
)


def start_run(tmp_path: Path, deadline: float) -> tuple[subprocess.Popen[bytes], list[int], Path]:
    script = tmp_path / "run.py"
    script.write_text(RUN.format(repo=str(REPO), sleeper=SLEEPER))
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen([sys.executable, str(script), str(deadline)], stdout=o, stderr=e)
    wait_for(lambda: "started" in err.read_text(), timeout=20)
    pids = [int(p) for p in err.read_text().split("started", 1)[1].split()[:3]]
    assert all(alive(p) for p in pids)
    return proc, pids, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_stops_every_group_and_prints_the_document(tmp_path: Path, sig: int) -> None:
    proc, pids, out = start_run(tmp_path, deadline=120)
    try:
        proc.send_signal(sig)
        assert proc.wait(30) == 1
    finally:
        proc.kill()
        proc.wait(10)
    doc = json.loads(out.read_text())
    assert problems(doc) == []
    name = signal.Signals(sig).name
    assert doc["stage"] == "work" and doc["error"] == f"interrupted by {name}: the check stopped here"
    assert doc["stages"]["start"]["ok"] is True
    assert "not reached" in doc["stages"]["later"]["skipped"]
    assert doc["stages"]["cleanup"]["ok"] is True and sorted(doc["stages"]["cleanup"]["stopped_groups"]) == pids
    assert doc["signals"] == [name]
    assert not any(alive(p) for p in pids)


@pytest.mark.slow
def test_the_deadline_stops_a_stage_that_never_ends(tmp_path: Path) -> None:
    proc, pids, out = start_run(tmp_path, deadline=3)
    try:
        assert proc.wait(30) == 1
    finally:
        proc.kill()
        proc.wait(10)
    doc = json.loads(out.read_text())
    assert problems(doc) == []
    assert doc["stage"] == "work" and doc["error"] == "cut short: the check's deadline passed"
    assert doc["stages"]["cleanup"]["by"] == "watchdog"
    assert not any(alive(p) for p in pids)


# --- check.sh without a GPU ----------------------------------------------------------------


def test_check_sh_without_a_gpu_fails_fast_and_clearly_with_python3_only(tmp_path: Path) -> None:
    # A PATH with python3 and the few tools check.sh uses, and no `python`, `pip` or nvidia-smi.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    for tool in ("dirname", "timeout"):
        found = next((Path(d) / tool for d in ("/usr/bin", "/bin") if (Path(d) / tool).exists()), None)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "LD_LIBRARY_PATH": "/nonexistent"}
    if os.path.exists("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"):
        pytest.skip("this machine has an NVIDIA driver")
    done = subprocess.run(
        ["/bin/bash", str(REPO / "tests" / "gpu" / "check.sh"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    doc = json.loads(lines[0])
    assert problems(doc) == []
    assert doc["ok"] is False and doc["stage"] == "preflight" and doc["error"].startswith("no GPU: ")
    assert "libnvidia-ml.so.1" in doc["error"]
    assert doc["stages"]["preflight"]["ok"] is False and doc["stages"]["cleanup"]["ok"] is True
    assert doc["stages"]["install"]["ok"] is None  # nothing was installed on a machine without a GPU
