"""The simulated GPU with other processes: clients that map its memory, and a daemon killed mid-move."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from timesliced.sim.layout import RegionInfo, job_key

from ..helpers.sims import PAGE, REPO, Sims, blake


def run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_client_in_another_process_writes_real_shared_bytes(sims: Sims) -> None:
    b = sims.backend()
    info = b.alloc("a", 0, 3 * PAGE + 11)
    script = """
        import json, sys
        from timesliced import errors
        from timesliced.sim.layout import RegionInfo
        from timesliced.sim.region import SimRegion
        with SimRegion.open(RegionInfo.from_wire(json.loads(sys.argv[1]))) as r:
            if sys.argv[2] == "write":
                r.fill(b"child!")
                r.write(b"MARK", 1000)
                print(r.checksum())
            else:
                try:
                    r.read(4, 1000)
                except errors.NotResident as exc:
                    print("NotResident:", exc)
    """
    wire = json.dumps(info.to_wire())
    done = run_child(script, wire, "write")
    assert done.returncode == 0, done.stderr
    expected = bytearray((b"child!" * info.nbytes)[: info.nbytes])
    expected[1000:1004] = b"MARK"
    r = sims.open(info)
    assert r.read() == expected and done.stdout.strip() == blake(expected)

    asyncio.run(b.snapshot("a"))
    done = run_child(script, wire, "read")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("NotResident:") and "parked in host memory" in done.stdout


@pytest.mark.slow
def test_a_reader_in_another_process_never_sees_a_torn_table(sims: Sims) -> None:
    b = sims.backend(capacity=256 * PAGE)
    info = b.alloc("a", 0, 3 * PAGE)
    watched = sims.open(info)
    watched.fill(b"steady")
    digest = watched.checksum()
    script = """
        import json, sys, time
        from timesliced.sim.layout import RegionInfo
        from timesliced.sim.region import SimRegion
        with SimRegion.open(RegionInfo.from_wire(json.loads(sys.argv[1]))) as r:
            print("ready", flush=True)
            reads, end = 0, time.monotonic() + float(sys.argv[2])
            while time.monotonic() < end:
                assert r.read(6) == b"steady"
                assert r.checksum() == sys.argv[3]
                reads += 1
            print(reads)
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", textwrap.dedent(script), json.dumps(info.to_wire()), "0.6", digest]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        churn = 0
        while child.poll() is None:  # reshape the job's table as fast as we can while the child reads
            regions = [b.alloc("a", 0, PAGE) for _ in range(20)]
            for info in regions:
                b.free("a", info.region)
            churn += 1
        out, err = child.communicate()
    assert child.returncode == 0, err
    assert int(out) > 0 and churn > 0, (out, churn)


CRASH_CHILD = """
    import asyncio, json, os, signal, sys
    from timesliced.backends.sim import SimBackend
    from timesliced.sim.region import SimRegion
    root, mode = sys.argv[1], sys.argv[2]
    b = SimBackend(root, gpus=2, capacity=32 * 65536, page_size=65536, bandwidth=0)
    out = {}
    def make(job, gpu, n, pattern):
        info = b.alloc(job, gpu, n)
        with SimRegion.open(info) as r:
            r.fill(pattern)
            out[f"{job}/{info.region}"] = [info.to_wire(), r.checksum()]
    if mode == "after-snapshot":
        make("parked-job", 0, 5 * 65536 + 1, b"p0")
        make("parked-job", 1, 3 * 65536, b"p1")
        asyncio.run(b.snapshot("parked-job"))
        make("live-job", 0, 4 * 65536, b"live")
        print(json.dumps(out), flush=True)
    else:  # kill it in the middle of a move
        make("moving-job", 0, 24 * 65536, b"mv")
        if mode == "mid-restore":
            asyncio.run(b.snapshot("moving-job"))
        b.bandwidth = 6e6  # 1.5 MiB now takes about a quarter of a second to move
        print(json.dumps(out), flush=True)
        asyncio.run((b.snapshot if mode == "mid-snapshot" else b.restore)("moving-job"))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_parked_and_resident_jobs_survive_a_killed_daemon(sims: Sims, root: Path) -> None:
    done = run_child(CRASH_CHILD, str(root), "after-snapshot")
    assert done.returncode == -signal.SIGKILL, done.stderr
    regions = {k: (RegionInfo.from_wire(w), digest) for k, (w, digest) in json.loads(done.stdout).items()}
    strays = [
        root / "parked" / job_key("parked-job") / "9.bin.tmp",
        root / "parked" / job_key("live-job") / "1.bin",
        root / "parked" / "gone-1234",
        root / "jobs" / "half.ctl.tmp",
    ]
    strays[2].mkdir()
    for path in strays[:2] + strays[3:]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"partial")

    b = sims.backend()
    assert b.recovered_jobs() == {
        "parked-job": ("parked", {0: 6 * PAGE, 1: 3 * PAGE}),
        "live-job": ("resident", {0: 4 * PAGE}),
    }
    assert not any(p.exists() for p in strays)
    assert b.free_bytes(0) == 28 * PAGE and b.free_bytes(1) == 32 * PAGE
    assert sims.open(regions["live-job/1"][0]).checksum() == regions["live-job/1"][1]
    asyncio.run(b.restore("parked-job"))
    for key in ("parked-job/1", "parked-job/2"):
        info, digest = regions[key]
        assert sims.open(info).checksum() == digest
    assert b.alloc("live-job", 0, PAGE).region == 2  # region ids carry on where they were


@pytest.mark.parametrize("mode", ["mid-snapshot", "mid-restore"])
def test_a_daemon_killed_mid_move_leaves_one_complete_copy(sims: Sims, root: Path, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", textwrap.dedent(CRASH_CHILD), str(root), mode]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None and child.stderr is not None
        line = child.stdout.readline()  # printed just before the move starts
        time.sleep(0.1)
        child.kill()
        _, err = child.communicate()
    assert line, err
    wire, digest = json.loads(line)["moving-job/1"]
    info = RegionInfo.from_wire(wire)

    b = sims.backend()
    state, footprint = b.recovered_jobs()["moving-job"]
    assert state in ("resident", "parked") and footprint == {0: 24 * PAGE}
    assert b.free_bytes(0) == (8 if state == "resident" else 32) * PAGE
    assert not list((root / "parked").rglob("*.tmp"))
    if state == "parked":
        asyncio.run(b.restore("moving-job"))
    assert sims.open(info).checksum() == digest
