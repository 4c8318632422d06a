"""``packaging/slurm``: the batch script, the prolog and the epilog, run for real on one machine.

The batch script runs under bash with a fake ``srun`` and ``scontrol`` on the PATH
(``tests/helpers/fake_slurm.py``) and a fake 2-node allocation, ``127.0.0.[1-2]``: every "node" is
this machine, with its own state dir, its own peer address on loopback and a real ``timesliced
serve --slurm`` on the sim backend. Two tiny jobs take turns through the cluster; the script must
start one daemon per node with the allocation's nodes as peers, wait until each is ready before the
jobs start, and stop the daemons (SIGTERM, clean exits, sockets removed) once the jobs are done.

``shellcheck`` lints every script. Without it these tests skip, unless
``TIMESLICED_REQUIRE_SHELLCHECK=1`` (CI sets it), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from timesliced.bench.common import free_port

from ..helpers import fake_slurm
from ..helpers.processes import REPO, wait_for
from ..helpers.tools import required_tool

SLURM = REPO / "packaging" / "slurm"
SCRIPTS = sorted([*SLURM.glob("*.sh"), *SLURM.glob("*.sbatch")])
JOB_ID = "4242"
NODES = ["127.0.0.1", "127.0.0.2"]

# `timesliced` on the fake nodes: this checkout's CLI (the daemons and `timesliced run` alike).
SHIM = """\
#!{python}
import sys
sys.path.insert(0, {repo!r})
from timesliced.cli import main
raise SystemExit(main())
"""

# A job: three turns on the group "shared" through this node's daemon, then what it saw, as JSON.
TRAIN = """\
import json, os
import timesliced

with timesliced.Client(job={job!r}, group="shared") as client:
    fences = []
    for turn in range(3):
        grant = client.acquire(timeout=60)
        if turn == 0:
            client.sim_alloc(4 << 20).fill(b"x")
        fences.append(grant.fence)
        client.release()
    cluster = client.status()["cluster"]
report = {{"job": {job!r}, "fences": fences, "members": cluster["members"], "leader": cluster["leader"]}}
# One write(2) of the whole line: the two jobs share the script's stdout, and a print() may write the
# line and its newline apart (unbuffered), letting the other job's line in between.
os.write(1, (json.dumps(report) + "\\n").encode())
"""


def shellcheck() -> str:
    return required_tool("shellcheck", "TIMESLICED_REQUIRE_SHELLCHECK", "apt-get install shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_finds_nothing(script: Path) -> None:
    result = subprocess.run([shellcheck(), "-x", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_would_catch_a_mistake(tmp_path: Path) -> None:
    """The lint can fail: the batch script with an unquoted expansion is refused."""
    broken = tmp_path / "broken.sbatch"
    text = (SLURM / "timesliced.sbatch").read_text()
    assert 'mkdir -p "$TIMESLICED_TMP"' in text
    broken.write_text(text.replace('mkdir -p "$TIMESLICED_TMP"', "mkdir -p $TIMESLICED_TMP"))
    result = subprocess.run([shellcheck(), str(broken)], capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "SC2086" in result.stdout


def test_the_scripts_are_executable_and_the_cleanup_is_one_function() -> None:
    assert {p.name for p in SCRIPTS} == {"timesliced.sbatch", "prolog.sh", "epilog.sh"}
    assert all(p.stat().st_mode & stat.S_IXUSR for p in SCRIPTS)

    def cleanup(path: Path) -> str:
        text = path.read_text()
        return text[text.index("# --- timesliced_cleanup") : text.index("# --- end of timesliced_cleanup")]

    assert cleanup(SLURM / "prolog.sh") == cleanup(SLURM / "epilog.sh")


# --- the batch script on a fake allocation --------------------------------------------------------


class Allocation:
    """A fake 2-node Slurm allocation in ``root``: PATH with fake srun/scontrol/timesliced, its env."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.submit = root / "submit"  # the batch script's working directory
        # Short: a socket path must fit AF_UNIX's 108 bytes, which pytest's tmp_path may not leave.
        self.tmp = Path(tempfile.mkdtemp(prefix="tsl-"))
        self.shm = root / "shm"
        self.log = root / "srun.jsonl"
        for d in (self.submit, self.shm):
            d.mkdir(parents=True)
        fake_slurm.install(self.bin, pythonpath=str(REPO))
        shim = self.bin / "timesliced"
        shim.write_text(SHIM.format(python=sys.executable, repo=str(REPO)))
        shim.chmod(0o755)
        python = self.bin / "python"
        python.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
        for job in ("rl", "sft"):
            (self.submit / f"train_{job}.py").write_text(TRAIN.format(job=job))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TIMESLICED"))}
        return {
            **env,
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
            "SLURM_JOB_NUM_NODES": "2",
            "FAKE_SLURM_LOG": str(self.log),
            "TIMESLICED_TMP": str(self.tmp),
            "TIMESLICED_SHM": str(self.shm),
            "TIMESLICED_PEER_PORT": str(free_port()),
            "TIMESLICED_PEER_BIND": "node",  # two "nodes" on one machine: each binds its own loopback address
            "TIMESLICED_SERVE_ARGS": "--backend sim --gpus 1 --gpu-memory 64MiB --bandwidth 0 --web off "
            "--election-timeout 0.2",
            "TIMESLICED_READY_TIMEOUT": "60",
            "TIMESLICED_PEER_TOKEN": "a-token-of-the-caller-0123456789",  # would clash with the script's
            **extra,
        }

    def run(self, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SLURM / "timesliced.sbatch")],
            cwd=self.submit,
            env=self.env(**extra),
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def kill_leftovers(self) -> None:
        """Whatever a failed test left running (each task's pid is in the fake srun's log)."""
        for event in self.events():
            for task in event.get("tasks", ()):
                try:
                    os.kill(task["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def allocation(tmp_path: Path) -> Iterator[Allocation]:
    fake = Allocation(tmp_path)
    yield fake
    fake.kill_leftovers()
    shutil.rmtree(fake.tmp, ignore_errors=True)


def steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per srun: its start event, plus ``status`` and ``signals`` and event ``order``s."""
    by_srun: dict[int, dict[str, Any]] = {}
    for order, event in enumerate(events):
        if event["event"] == "start":
            by_srun[event["srun"]] = {**event, "started": order, "signals": []}
        elif event["event"] == "signal":
            by_srun[event["srun"]]["signals"].append((order, event["signal"]))
        elif event["event"] == "exit":
            by_srun[event["srun"]].update(status=event["status"], ended=order)
    return sorted(by_srun.values(), key=lambda s: s["started"])


def by_role(all_steps: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The daemon step, the wait step and the member steps, told apart by the function each task runs.

    Not by start order: the daemon step starts in the background, so the wait step may log first.
    """

    def running(function: str) -> list[dict[str, Any]]:
        return [s for s in all_steps if s["command"][:2] == ["bash", "-c"] and f"; {function}" in s["command"][2]]

    (daemons,), (wait,) = running("timesliced_node_serve"), running("timesliced_node_wait")
    members = running("timesliced_node_run")
    assert len(all_steps) == 2 + len(members), all_steps
    return daemons, wait, members


@pytest.mark.slow
def test_the_batch_script_starts_a_daemon_per_node_waits_runs_the_jobs_and_stops_them(
    allocation: Allocation,
) -> None:
    result = allocation.run()
    assert result.returncode == 0, result.stdout + result.stderr
    daemons, wait, members = by_role(steps(allocation.events()))

    # One daemon per node of the allocation, as one overlapping step of a task per node.
    assert [t["node"] for t in daemons["tasks"]] == NODES
    assert daemons["options"]["ntasks-per-node"] == "1" and daemons["options"]["overlap"]
    assert daemons["options"]["output"] == "timesliced-%j-%N.log"
    for node in NODES:
        log = (allocation.submit / f"timesliced-{JOB_ID}-{node}.log").read_text()
        assert f"cluster of 2: node '{node}' listens for peers on {node}:" in log, log

    # Readiness is waited for on every node before any job starts, and every job ran on the first node.
    assert [t["node"] for t in wait["tasks"]] == NODES and wait["status"] == 0
    launched = sorted(m["command"][-4:] for m in members)  # the two start together: in either order
    assert launched == [["rl", "shared", "python", "train_rl.py"], ["sft", "shared", "python", "train_sft.py"]]
    assert all(m["started"] > wait["ended"] for m in members)
    assert all([t["node"] for t in m["tasks"]] == NODES[:1] and m["options"]["overlap"] for m in members)
    assert all(m["status"] == 0 for m in members)

    # The jobs took turns on one group of a cluster made of the allocation's nodes.
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["job"] for r in reports) == ["rl", "sft"]
    assert all(r["members"] == NODES and r["leader"] in NODES for r in reports)
    fences = [f for r in reports for f in r["fences"]]
    assert len(set(fences)) == 6  # six grants of one lock: no two jobs were given the same turn

    # Stopped once the jobs were done: SIGTERM forwarded to each daemon, which exited cleanly.
    assert [name for _, name in daemons["signals"]] == ["SIGTERM"]
    assert daemons["signals"][0][0] > max(m["ended"] for m in members)
    assert daemons["status"] == 0
    for node in NODES:
        state = allocation.tmp / f"timesliced-{JOB_ID}" / node
        assert not (state / "timesliced.sock").exists()  # a clean stop removes it
        assert (state / "daemon.pid").read_text().strip() == str(daemons["tasks"][NODES.index(node)]["pid"])
    assert "timesliced: daemons stopped" in result.stdout

    # A fresh token reached the daemons' step only, never as an argument; the caller's older-spelling
    # token, which would clash with it, was kept from the daemons and left to the other steps.
    assert daemons["tokens"] == ["TIMESLICED_TOKEN"]
    assert all(step["tokens"] == ["TIMESLICED_PEER_TOKEN"] for step in (wait, *members))
    assert not any("TOKEN" in word for step in (daemons, wait, *members) for word in step["argv"])


@pytest.mark.slow
def test_jobs_from_a_file_can_span_every_node(allocation: Allocation) -> None:
    """$TIMESLICED_JOBS replaces launch_jobs; member_everywhere puts a member of a job on each node."""
    jobs = allocation.submit / "jobs.sh"
    jobs.write_text(
        "launch_jobs() {\n"
        "\tmember_everywhere rl shared python train_rl.py\n"
        "\tmember_everywhere sft shared python train_sft.py\n"
        "}\n"
    )
    result = allocation.run(TIMESLICED_JOBS=str(jobs))
    assert result.returncode == 0, result.stdout + result.stderr
    daemons, wait, members = by_role(steps(allocation.events()))
    assert sorted(m["command"][-4:-2] for m in members) == [["rl", "shared"], ["sft", "shared"]]
    assert all([t["node"] for t in m["tasks"]] == NODES and m["started"] > wait["ended"] for m in members)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["job"] for r in reports) == ["rl", "rl", "sft", "sft"]  # a process of each on each node
    fences = {job: {f for r in reports if r["job"] == job for f in r["fences"]} for job in ("rl", "sft")}
    assert fences["rl"] and fences["sft"] and not fences["rl"] & fences["sft"]  # never the same turn
    assert [name for _, name in daemons["signals"]] == ["SIGTERM"] and daemons["status"] == 0


@pytest.mark.slow
def test_a_daemon_that_cannot_start_fails_the_script_at_once(allocation: Allocation) -> None:
    result = allocation.run(TIMESLICED_SERVE_ARGS="--backend sim --gpus 0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "exited before it was ready" in result.stderr
    daemons, wait, members = by_role(steps(allocation.events()))
    assert members == []  # no job was launched
    assert daemons["status"] != 0 and wait["status"] != 0
    log = (allocation.submit / f"timesliced-{JOB_ID}-127.0.0.1.log").read_text()
    assert "--gpus must be at least 1" in log


def test_a_bad_setting_is_refused_before_anything_starts(allocation: Allocation) -> None:
    result = allocation.run(TIMESLICED_PEER_BIND="everywhere")
    assert result.returncode == 2
    assert "TIMESLICED_PEER_BIND must be all or node, not 'everywhere'" in result.stderr
    assert allocation.events() == []


def test_outside_slurm_the_script_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    result = subprocess.run(
        ["bash", str(SLURM / "timesliced.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0 and "run this script with sbatch" in result.stderr


# --- prolog and epilog ------------------------------------------------------------------------------


def run_script(name: str, tmp: Path, shm: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    settings = {"SLURM_JOB_ID": JOB_ID, "SLURM_JOB_UID": str(os.getuid()), "SLURMD_NODENAME": "n1"}
    return subprocess.run(
        ["bash", str(SLURM / name)],
        env={**base, **settings, "TIMESLICED_TMP": str(tmp), "TIMESLICED_SHM": str(shm), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def node_dirs(tmp_path: Path) -> tuple[Path, Path]:
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    return tmp, shm


def leftovers(tmp: Path, shm: Path, job: str) -> Path:
    """What a daemon of ``job`` that was killed leaves: a state dir with files, simulated GPU memory."""
    state = tmp / f"timesliced-{job}" / "n1"
    state.mkdir(parents=True)
    (state / "journal.json").write_text("{}")
    (shm / f"timesliced-{job}-n1").mkdir()
    (shm / f"timesliced-{job}-n1" / "gpu0").write_bytes(b"\0" * 4096)
    return state


def test_the_prolog_leaves_a_fresh_private_state_dir(node_dirs: tuple[Path, Path]) -> None:
    tmp, shm = node_dirs
    leftovers(tmp, shm, JOB_ID)  # an earlier run of this job id (a requeue)
    other = leftovers(tmp, shm, "77")  # another job's, which must stay
    result = run_script("prolog.sh", tmp, shm)
    assert result.returncode == 0, result.stderr
    base = tmp / f"timesliced-{JOB_ID}"
    assert list(base.iterdir()) == []
    assert stat.S_IMODE(base.stat().st_mode) == 0o700 and base.stat().st_uid == os.getuid()
    assert list(shm.iterdir()) == [shm / "timesliced-77-n1"]
    assert (other / "journal.json").exists()


def test_the_prolog_and_epilog_leave_an_odd_job_id_alone(node_dirs: tuple[Path, Path]) -> None:
    tmp, shm = node_dirs
    (tmp / "timesliced-*").mkdir()
    for script in ("prolog.sh", "epilog.sh"):
        result = run_script(script, tmp, shm, SLURM_JOB_ID="*")
        assert result.returncode == 0 and "unexpected SLURM_JOB_ID" in result.stderr
    assert (tmp / "timesliced-*").exists()


@pytest.mark.slow
def test_the_epilog_stops_a_leftover_daemon_and_removes_its_files(node_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    tmp, shm = node_dirs
    state = tmp / f"timesliced-{JOB_ID}" / "n1"
    state.mkdir(parents=True)
    sim = shm / f"timesliced-{JOB_ID}-n1"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    serve = ["serve", "--backend", "sim", "--gpus", "1", "--gpu-memory", "16MiB", "--web", "off"]
    daemon = subprocess.Popen(
        [sys.executable, "-m", "timesliced", *serve, "--state-dir", str(state), "--sim-dir", str(sim)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Not a daemon, though its pid file says so: the epilog must leave it alone (a reused pid).
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        wait_for(lambda: (state / "timesliced.sock").exists(), timeout=30)
        (state / "daemon.pid").write_text(f"{daemon.pid}\n")
        (tmp / f"timesliced-{JOB_ID}" / "n2").mkdir()
        (tmp / f"timesliced-{JOB_ID}" / "n2" / "daemon.pid").write_text(f"{stranger.pid}\n")
        result = run_script("epilog.sh", tmp, shm)
        assert result.returncode == 0, result.stderr
        assert f"stopping the daemon {daemon.pid}" in result.stderr
        assert daemon.wait(timeout=30) == 0  # SIGTERM: a clean stop
        assert stranger.poll() is None
        assert not (tmp / f"timesliced-{JOB_ID}").exists() and not sim.exists()
    finally:
        for p in (daemon, stranger):
            if p.poll() is None:
                p.kill()
            p.wait()
        if daemon.stderr is not None:
            daemon.stderr.close()


def test_the_epilog_with_nothing_left_is_a_no_op(node_dirs: tuple[Path, Path]) -> None:
    tmp, shm = node_dirs
    result = run_script("epilog.sh", tmp, shm)
    assert result.returncode == 0, result.stderr
    assert list(tmp.iterdir()) == [] and list(shm.iterdir()) == []


def test_the_sbatch_help_names_every_setting_it_reads() -> None:
    """Every TIMESLICED_* variable the batch script reads is described in its header."""
    text = (SLURM / "timesliced.sbatch").read_text()
    header = text[: text.index("#SBATCH")]
    body = text[text.index("#SBATCH") :]
    read = set(re.findall(r"\$\{(TIMESLICED_[A-Z_]+)[:}]", body)) - {"TIMESLICED_TOKEN"}
    missing = sorted(name for name in read if f"#   {name}" not in header)
    assert missing == [], textwrap.shorten(header, 200)


# --- the fake itself --------------------------------------------------------------------------------


def test_the_fake_srun_places_tasks_and_refuses_what_srun_refuses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", JOB_ID)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    assert fake_slurm.plan({"nodes": "2", "ntasks": "2", "ntasks-per-node": "1"}) == ["n1", "n2"]
    assert fake_slurm.plan({"nodes": "1", "ntasks": "1", "nodelist": "n3"}) == ["n3"]
    assert fake_slurm.plan({"nodes": "2", "ntasks": "4", "ntasks-per-node": "2"}) == ["n1", "n1", "n2", "n2"]
    refused = [
        {"nodelist": "n9"},  # not in the allocation
        {"nodes": "2", "ntasks": "3", "ntasks-per-node": "1"},  # more tasks than room
        {"nodes": "4"},  # more nodes than the allocation
    ]
    for options in refused:
        with pytest.raises(SystemExit):
            fake_slurm.plan(options)
    with pytest.raises(SystemExit):
        fake_slurm.parse(["--mpi=pmix", "true"])  # an option the fake does not model
    assert fake_slurm.parse(["--overlap", "-N", "2", "--output=x", "cmd", "-N", "9"]) == (
        {"overlap": True, "nodes": "2", "output": "x"},
        ["cmd", "-N", "9"],
    )
    assert fake_slurm.scontrol(["show", "hostnames"]) == 0
    assert capsys.readouterr().out.split() == ["n1", "n2", "n3"]
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(SystemExit):
        fake_slurm.plan({})
