"""Real client processes taking turns on simulated GPUs with real bytes."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.processes import spawn_python, wait_for

pytestmark = pytest.mark.slow  # the quick loop (-m "not slow") leaves these out

MiB = 1 << 20

WORKER = """
import json, sys, timesliced
job, address, rounds, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = timesliced.Client(job=job, group="shared", address=address, gpus=[0])
regions, expected, errors, restored = [], [], 0, 0
with client:
    for step in range(rounds):
        with client.slice() as grant:
            restored += grant.restored
            if not regions:
                regions = [client.sim_alloc(size // 2, gpu=0), client.sim_alloc(size // 2, gpu=0)]
            else:
                errors += sum(r.checksum() != e for r, e in zip(regions, expected))
            for i, r in enumerate(regions):
                r.fill(f"{job}/{step}/{i}".encode())
            expected = [r.checksum() for r in regions]
print(json.dumps({"job": job, "data_errors": errors, "restored": restored}))
"""


def test_two_processes_take_turns_and_every_byte_survives(daemon: EmbeddedDaemon) -> None:
    # 40 MiB each on a 64 MiB GPU: they never fit together, so every handover moves real bytes.
    procs = [spawn_python(WORKER, job, daemon.socket, "20", str(40 * MiB)) for job in ("a", "b")]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["data_errors"] for r in results] == [0, 0]
    assert sum(r["restored"] for r in results) >= 20  # most slices came back from host memory
    with timesliced.Client(job="observer", group="obs", address=daemon.socket, gpus=[1]) as c:
        group = next(g for g in c.status()["groups"] if g["group"] == "shared")
        assert group["fence"] == 40
        assert group["switches"] >= 20 and group["bytes_moved"] >= 20 * 80 * MiB


HOLDER = """
import sys, time, timesliced
client = timesliced.Client(job="doomed", group="shared", address=sys.argv[1], gpus=[0])
with client.slice():
    r = client.sim_alloc(32 << 20, gpu=0)
    r.fill(b"x")
    print("holding", flush=True)
    time.sleep(600)
"""


def test_killed_holder_loses_lock_and_memory_is_reclaimed(daemon: EmbeddedDaemon) -> None:
    holder = spawn_python(HOLDER, daemon.socket)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "holding"
    with timesliced.Client(job="next", group="shared", address=daemon.socket, gpus=[0]) as c:
        got: list[timesliced.Grant] = []
        t = threading.Thread(target=lambda: got.append(c.acquire()))
        t.start()
        wait_for(lambda: any(g["queue"] for g in c.status()["groups"]))
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        t.join(10)
        assert got and got[0].job == "next" and got[0].fence == 2
        # the dead job disappears and its 32 MiB come back
        wait_for(lambda: [j["job"] for j in c.status()["jobs"]] == ["next"])
        assert c.status()["devices"][0]["used"] == 0
        region = c.sim_alloc(60 * MiB, gpu=0)  # the whole GPU is ours again
        region.fill(b"y")
        c.release()
    holder.stdout.close()
    assert holder.stderr is not None
    holder.stderr.close()


def test_parked_region_cannot_be_touched_and_comes_back(daemon: EmbeddedDaemon) -> None:
    a = timesliced.Client(job="a", group="g", address=daemon.socket, gpus=[0])
    b = timesliced.Client(job="b", group="g", address=daemon.socket, gpus=[0])
    with a.slice():
        ra = a.sim_alloc(40 * MiB)
        ra.fill(b"precious")
        digest = ra.checksum()
    with b.slice():
        rb = b.sim_alloc(40 * MiB)  # does not fit next to a: a is parked to make room
        rb.fill(b"other")
        with pytest.raises(errors.NotResident, match="parked"):
            ra.read(16)
    with a.slice() as grant:
        assert grant.restored and grant.switch_s > 0
        assert ra.checksum() == digest
        with pytest.raises(errors.NotResident):
            rb.write(b"z")
        status = a.status()
        assert status["devices"][0]["jobs"]["b"]["location"] == "parked"
        assert status["devices"][0]["used"] <= 64 * MiB
    a.close()
    b.close()


def test_oom_names_who_holds_the_memory(daemon: EmbeddedDaemon) -> None:
    with timesliced.Client(job="a", group="g", address=daemon.socket, gpus=[0]) as a, a.slice():
        a.sim_alloc(40 * MiB)
        with pytest.raises(errors.OutOfMemory, match="free") as info:
            a.sim_alloc(40 * MiB)
        assert info.value.code == "out_of_memory"
        a.sim_alloc(24 * MiB)  # exactly the rest fits


def test_sim_free_returns_memory(daemon: EmbeddedDaemon) -> None:
    with timesliced.Client(job="a", group="g", address=daemon.socket, gpus=[0]) as a, a.slice():
        r = a.sim_alloc(40 * MiB)
        a.sim_free(r)
        assert a.status()["devices"][0]["used"] == 0
        with pytest.raises(errors.UnknownRegion):
            a.sim_free(r.region)
        a.sim_alloc(64 * MiB)


@pytest.mark.parametrize("stream", [True, False])
def test_bandwidth_model_sets_switch_time(tmp_path: object, stream: bool) -> None:
    # 16 MiB out and 16 MiB in at 1 GB/s each way: at least 16.8 ms streamed (both directions at
    # once), at least 33.6 ms one after the other.
    with EmbeddedDaemon(gpus=1, gpu_memory=24 * MiB, bandwidth=1e9, stream_switches=stream) as d:
        a = timesliced.Client(job="a", group="g", address=d.socket)
        b = timesliced.Client(job="b", group="g", address=d.socket)
        with a.slice():
            a.sim_alloc(16 * MiB).fill(b"a")
        with b.slice():
            b.sim_alloc(16 * MiB).fill(b"b")
        with a.slice() as grant:
            assert grant.restored and grant.switch_s >= (1 if stream else 2) * 16 * MiB / 1e9
        a.close()
        b.close()
