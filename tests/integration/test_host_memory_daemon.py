"""Host memory for parked state, through a real daemon on simulated GPUs.

A park the host cannot hold is not started (``--host-memory-limit``, a cgroup's limit on a fake
``/proc`` and ``/sys``), a park that fails for lack of room on a small tmpfs leaves both jobs
usable, and a job whose method cannot be frozen joins no preempting group.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.config import DaemonConfig
from timesliced.core.slices import SlicePolicy
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.env import default_sim_dir
from timesliced.sim.layout import job_key
from timesliced.wire.park import ParkSpec

from ..helpers.processes import wait_for

MiB = 1 << 20
GiB = 1 << 30


def config(tmp_path: Path, **more: Any) -> DaemonConfig:
    return DaemonConfig(
        state_dir=tmp_path / "state",
        backend="sim",
        gpus=1,
        gpu_memory=64 * MiB,
        bandwidth=0,
        pid_poll_interval=0.1,
        host_memory_interval=0.1,
        **more,
    )


@pytest.fixture
def run_daemon(tmp_path: Path) -> Iterator[Any]:
    started: list[EmbeddedDaemon] = []

    def start(**more: Any) -> EmbeddedDaemon:
        embedded = EmbeddedDaemon(config(tmp_path, **more))
        embedded.start()
        started.append(embedded)
        return embedded

    yield start
    for d in started:
        d.stop()
        shutil.rmtree(default_sim_dir(d.config.state_dir), ignore_errors=True)


def client(daemon: EmbeddedDaemon, job: str, group: str = "g", **kw: Any) -> timesliced.Client:
    c = timesliced.Client(job=job, group=group, address=daemon.socket, gpus=[0], **kw)
    c.connect()
    return c


def job_of(c: timesliced.Client, job: str) -> dict[str, Any]:
    return next(j for j in c.status()["jobs"] if j["job"] == job)


def test_an_offload_job_joins_no_preempting_group(run_daemon: Any) -> None:
    daemon = run_daemon(slice_policies={"g": SlicePolicy(5.0, "preempt"), "w": SlicePolicy(5.0, "warn")})
    offload = ParkSpec("offload")
    with pytest.raises(errors.PreemptionUnsafe, match="cannot stop its GPU work first") as caught:
        client(daemon, "trainer", "g", park=offload, offloader=None)
    assert "Register it in a group whose slice action is warn, or park it with cuda-checkpoint" in str(caught.value)
    with client(daemon, "trainer", "w", park=offload, offloader=None) as c:  # a warning group takes it
        assert c.acquire().job == "trainer"
    with client(daemon, "sim-job", "g") as c:  # the simulated GPU freezes its pages: it may be preempted
        assert c.acquire().job == "sim-job"


def holder_with_bytes(daemon: EmbeddedDaemon, job: str, nbytes: int) -> tuple[timesliced.Client, Any, str]:
    """``job`` holds, fills ``nbytes`` of simulated memory and yields; returns it, its region and their checksum."""
    c = client(daemon, job)
    c.acquire()
    region = c.sim_alloc(nbytes)
    region.fill(job.encode())
    digest = region.checksum()
    c.release()
    return c, region, digest


def test_a_park_over_the_limit_is_refused_and_every_byte_stays(run_daemon: Any) -> None:
    daemon = run_daemon(host_memory_limit=1 * MiB)
    a, region, digest = holder_with_bytes(daemon, "a", 4 * MiB)
    with client(daemon, "proc", park=ParkSpec("offload"), offloader=None) as p:
        with pytest.raises(errors.InsufficientHostMemory) as caught:
            p.acquire(timeout=30)  # a must be parked for it (a process needs the GPU to itself)
        error = caught.value
        assert "insufficient host memory to park 'a' (4.0 MiB) for job 'proc' on node 0" in error.message
        assert "of a budget of 1.0 MiB" in error.message and "--host-memory-limit 1.0 MiB" in error.message
        assert error.details["needed"] == 4 * MiB and error.details["budget"] == 1 * MiB
        st = job_of(a, "a")
        assert st["location"] == "resident" and st["faulted"] is None and st["parked_bytes"] == 0
        status = a.status()
        (host,) = status["host"]
        assert host["limit"] == 1 * MiB and host["budget"] <= 1 * MiB and host["parked"] == 0
        assert status["host_memory"]["limit"] == 1 * MiB and status["host_memory"]["age_s"] is not None
    with a:
        a.acquire()  # its bytes never left the GPU: its next slice just works
        assert region.checksum() == digest
        a.release()


@pytest.mark.slow
@pytest.mark.parametrize("pool", [64 * MiB, 0])
def test_the_sims_pool_of_warm_buffers_is_in_status_counted_as_room_and_bounded(run_daemon: Any, pool: int) -> None:
    daemon = run_daemon(sim_pool=pool)  # a GPU of 64 MiB: two jobs of 40 MiB take turns
    a, region_a, digest_a = holder_with_bytes(daemon, "a", 40 * MiB)
    b, region_b, digest_b = holder_with_bytes(daemon, "b", 40 * MiB)  # a was parked for b
    a.acquire(timeout=30)  # b is parked, a restored: a's parked files are the pool's now
    assert region_a.checksum() == digest_a
    a.release()
    b.acquire(timeout=30)  # a's park writes into them; b's restore leaves its own
    assert region_b.checksum() == digest_b
    time.sleep(0.3)  # readings come every 0.1 s: wait for one taken after the switches

    def fresh() -> bool:
        age = b.status()["host_memory"]["age_s"]
        return age is not None and age < 0.1

    wait_for(fresh, timeout=10)
    doc = b.status()["host_memory"]
    b.release()
    a.close()
    b.close()
    held = doc["sim_pool"]["held"]
    assert doc["sim_pool"]["limit"] == pool
    assert held == (40 * MiB if pool else 0) and (doc["sim_pool"]["taken"] >= 1) == bool(pool)
    assert doc["tmpfs"] is not None
    assert doc["pools"][f"tmpfs:{doc['tmpfs']['path']}"] == doc["tmpfs"]["free"] + held  # the pool is room
    sim_dir = default_sim_dir(daemon.config.state_dir)
    kept = sim_dir / "parked" / job_key("b")  # b was restored last: its parked files stay there, the pool's
    assert sum(f.stat().st_size for folder in (sim_dir / "pool", kept) for f in folder.iterdir()) == held


def fake_host(root: Path, *, limit: int, used: int) -> None:
    """A fake /proc and /sys: plenty of host memory, the daemon's process in a cgroup v2 of ``limit``."""

    def write(path: str, text: str) -> None:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    write("/proc/meminfo", f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {48 * GiB // 1024} kB\n")
    write("/proc/self/mountinfo", "26 28 0:24 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    write("/proc/self/cgroup", "0::/jobs/timesliced\n")
    write("/sys/fs/cgroup/jobs/timesliced/memory.max", f"{limit}\n")
    write("/sys/fs/cgroup/jobs/timesliced/memory.current", f"{used}\n")
    write("/sys/fs/cgroup/jobs/timesliced/memory.stat", "inactive_file 0\n")


def test_a_cgroup_without_room_refuses_the_park_and_says_so(run_daemon: Any, tmp_path: Path) -> None:
    # The daemon writes a simulated job's parked files, so its cgroup is charged for them.
    root = tmp_path / "host"
    fake_host(root, limit=512 * MiB, used=510 * MiB)  # 2 MiB free
    daemon = run_daemon(host_root=root, host_memory_margin=0)
    a, region, digest = holder_with_bytes(daemon, "a", 4 * MiB)
    with client(daemon, "b") as b:
        with pytest.raises(errors.InsufficientHostMemory, match="cgroup:/jobs/timesliced on node 0") as caught:
            b.sim_alloc(62 * MiB)  # room for it means parking a, which the cgroup cannot hold
        assert "cgroup /jobs/timesliced: " in caught.value.message
        reading = b.status()["host_memory"]
        assert reading["cgroup"] is not None and reading["cgroup"]["limit"] == 512 * MiB
        assert reading["jobs"]["a"] == ["cgroup:/jobs/timesliced"]
        fake_host(root, limit=1 * GiB, used=0)  # the operator raised the limit
        wait_for(lambda: b.status()["host"][0]["pools"]["cgroup:/jobs/timesliced"]["budget"] > 100 * MiB)
        b.acquire()
        b.sim_alloc(62 * MiB)  # now a is parked to make room
        assert job_of(b, "a")["location"] == "parked" and job_of(b, "a")["parked_bytes"] == 4 * MiB
        b.release()
    with a:
        a.acquire()
        assert region.checksum() == digest


# --- a small tmpfs that fills during a park ------------------------------------------------------

SCENARIO = """
import json, os, sys, time
from pathlib import Path
import timesliced
from timesliced import errors
from timesliced.backends.sim import SimBackend
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.sim.layout import parked_dir

MiB = 1 << 20
sim_dir, state = Path(sys.argv[1]), Path(sys.argv[2])
config = DaemonConfig(state_dir=state, sim_dir=sim_dir / "sim", backend="sim", gpus=1, gpu_memory=64 * MiB,
                      bandwidth=20e6, pid_poll_interval=0.1, host_memory_interval=0.1, host_memory_margin=0)
out = {}
def client(job):
    c = timesliced.Client(job=job, group="g", address=str(config.resolved_socket()), gpus=[0])
    c.connect()
    return c
def job_of(c, job):
    return next(j for j in c.status()["jobs"] if j["job"] == job)

with EmbeddedDaemon(config) as daemon:
    b = client("b")
    b.acquire()
    rb = b.sim_alloc(40 * MiB); rb.fill(b"bbbb"); digest_b = rb.checksum()
    b.release()
    a = client("a")
    a.acquire()
    ra = a.sim_alloc(40 * MiB)  # b is parked to make room: 40 MiB of files on the tmpfs
    ra.fill(b"aaaa"); digest_a = ra.checksum()
    a.release()
    filler = sim_dir / "filler"
    def fill():
        with open(filler, "wb") as f:
            try:
                for _ in range(64):
                    f.write(b"f" * MiB)
            except OSError as exc:
                out["filler"] = exc.errno
    # Something else fills the tmpfs once the daemon has let a's park start, just before the
    # backend opens a's first parked file: the reading it admitted the park by is out of date.
    open_parked = SimBackend._open_parked
    def open_parked_after_a_fill(backend, folder, record, *, reserve):
        if folder == parked_dir(backend.root, "a") and "filled" not in out:
            out["filled"] = True
            fill()
        return open_parked(backend, folder, record, reserve=reserve)
    SimBackend._open_parked = open_parked_after_a_fill
    got = {}
    try:
        b.acquire(timeout=60)  # a must be parked for b
        got["granted"] = True
    except errors.TimeslicedError as exc:
        got["error"] = [exc.code, exc.message]
    SimBackend._open_parked = open_parked
    out["first"] = got
    out["a_after"] = {k: job_of(a, "a")[k] for k in ("location", "faulted", "park_refused")}
    out["group_after"] = next(g["state"] for g in a.status()["groups"] if g["group"] == "g")
    t0 = time.monotonic()
    try:
        b.acquire(timeout=30)  # the tmpfs is still full: told at once, and no park is tried
        out["second"] = "granted"
    except errors.TimeslicedError as exc:
        out["second"] = [exc.code, exc.message]
    out["second_s"] = time.monotonic() - t0
    a.acquire(timeout=30)  # a's bytes never left its GPU: its next slice just works
    out["a_intact"] = ra.checksum() == digest_a
    a.release()
    filler.unlink()  # the room comes back; the daemon's next reading sees it
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            b.acquire(timeout=30)
            break
        except errors.InsufficientHostMemory:
            time.sleep(0.2)
    out["b_intact"] = rb.checksum() == digest_b
    out["a_at_end"] = job_of(b, "a")["location"]
    b.release()
    a.close(); b.close()
print(json.dumps(out))
"""


def mount_prefix(target: Path) -> list[str] | None:
    """A command prefix that runs the rest in its own mount namespace with a 128 MiB tmpfs on ``target``."""
    mount = f'mount -t tmpfs -o size=128m tmpfs "{target}" && exec "$@"'
    for unshare in (["unshare", "-rm"], ["unshare", "-m"]):
        probe = subprocess.run([*unshare, "sh", "-c", mount, "sh", "true"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [*unshare, "sh", "-c", mount, "sh"]
    return None


@pytest.mark.slow
def test_a_snapshot_that_fills_a_small_tmpfs_leaves_both_jobs_usable(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs in a mount namespace of its own")
    shm = tmp_path / "shm"
    shm.mkdir()
    prefix = mount_prefix(shm)
    if prefix is None:
        pytest.skip("this machine lets no process mount a tmpfs in a namespace of its own")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(SCENARIO), str(shm), str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # The park of a failed for want of room: b, which needed it, was told so at once, naming the cause.
    code, message = out["first"]["error"]
    assert code == "insufficient_host_memory", message
    # (told by the restore that streamed into a's room, or by the plan that waited for a's park)
    assert "job 'a'" in message and "could not be parked" in message, message
    assert "no room for the parked copy of job 'a'" in message  # the backend's own words: ENOSPC on the tmpfs
    # a's state never left its GPU: not faulted, and the group is not shown as faulted either
    assert out["a_after"]["location"] == "resident" and out["a_after"]["faulted"] is None
    assert out["group_after"] != "faulted"
    code, message = out["second"]
    assert code == "insufficient_host_memory" and out["second_s"] < 5, out["second"]
    assert out["a_intact"] and out["b_intact"]  # both jobs usable: every byte of both is where it belongs
    assert out["a_at_end"] == "parked"  # once the room came back, the park was tried again and went through
