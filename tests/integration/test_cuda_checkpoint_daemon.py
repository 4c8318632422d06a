"""cuda-checkpoint jobs through a real daemon, over the fake driver.

The jobs are real processes (their PIDs are registered and watched); their
"device memory" and checkpoint states live in the fake driver, which is
plugged in at the same seam as the real one.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.backends.base import DeviceInfo
from timesliced.backends.cuda_checkpoint import GPU_DELTA, PER_PROCESS, CudaCheckpointBackend
from timesliced.backends.offload import Direct, OffloadBackend
from timesliced.config import DaemonConfig
from timesliced.core.model import PARK_RETRY_S
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.daemon.parking import Parking
from timesliced.wire import status as schema

from ..fakes.cuda_driver import CHECKPOINTED, RUNNING, FakeCheckpointDriver, FakeGpuMemory
from ..helpers.processes import wait_for

GiB = 1 << 30


class Node:
    """One fake GPU (16 GiB by default) and a daemon whose default method is cuda-checkpoint."""

    def __init__(self, memory: FakeGpuMemory | None = None, *, footprints: str = PER_PROCESS) -> None:
        self.memory = memory or FakeGpuMemory({0: 16 * GiB})
        self.driver = FakeCheckpointDriver(self.memory)
        self.driver.init()
        self.footprints = footprints
        self.procs: list[subprocess.Popen[bytes]] = []

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()

    def parking(self, direct: Direct) -> Parking:
        # The process tree comes from the fake too: here every job process is a child of the
        # test process, which also registers (as the client) for every job.
        backend = CudaCheckpointBackend(
            self.driver,
            self.memory,
            lock_timeout=1.0,
            restore_margin=0,
            footprints=self.footprints,
            descendants=self.driver.descendants,
        )
        return Parking(
            "cuda-checkpoint",
            "test",
            [DeviceInfo(0, 16 * GiB, "fake-gpu0")],
            "nvml",
            {"cuda-checkpoint": backend, "offload": OffloadBackend(direct)},
        )

    def process(self, gib: float) -> int:
        """A real process that the fake driver sees holding ``gib`` GiB on GPU 0."""
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.procs.append(proc)
        self.driver.add_process(proc.pid, {0: int(gib * GiB)})
        return proc.pid


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def job(daemon: EmbeddedDaemon, name: str, pid: int) -> timesliced.Client:
    c = timesliced.Client(job=name, group="g", address=daemon.socket, pids=[pid])
    c.connect()
    return c


def status_of(c: timesliced.Client, name: str) -> dict[str, Any]:
    return next(j for j in c.status()["jobs"] if j["job"] == name)


def test_two_processes_take_turns_through_the_driver(node: Node) -> None:
    pa, pb = node.process(6), node.process(6)
    with EmbeddedDaemon(gpus=1, parking=node.parking) as d, job(d, "a", pa) as a, job(d, "b", pb) as b:
        first = a.acquire()
        assert first.job == "a" and not first.restored
        assert node.driver.state(pb) == CHECKPOINTED and node.driver.state(pa) == RUNNING
        assert node.memory.free_bytes(0) == 10 * GiB  # b's 6 GiB went to host memory
        got: list[timesliced.Grant] = []
        t = threading.Thread(target=lambda: got.append(b.acquire()))
        t.start()
        wait_for(lambda: len(a.status()["groups"][0]["queue"]) == 1)
        a.release()
        t.join(10)
        assert got and got[0].restored
        assert node.driver.state(pa) == CHECKPOINTED and node.driver.state(pb) == RUNNING
        ops = [(c.op, c.pid) for c in node.driver.calls]
        assert ops.index(("checkpoint", pa)) < ops.index(("restore", pb)) < ops.index(("unlock", pb))
        st = status_of(a, "a")
        assert st["park"] == "cuda-checkpoint" and st["location"] == "parked" and st["measured"] == {"0": 6 * GiB}
        moves = a.status()["moves"]["recent"]
        assert {m["kind"] for m in moves} == {"snapshot", "restore"} and all(m["nbytes"] == 6 * GiB for m in moves)


def test_a_restore_without_room_is_refused_never_attempted_and_the_job_stays_usable(node: Node) -> None:
    pa, pb = node.process(6), node.process(7)
    with EmbeddedDaemon(gpus=1, parking=node.parking) as d, job(d, "a", pa) as a, job(d, "b", pb) as b:
        a.acquire()  # b is parked
        a.release()
        outsider = node.process(9.5)  # a process timesliced does not manage takes most of the room
        # Parking a frees 6 GiB, which leaves 6.5 GiB: b needs 7. The waiter is told so at once.
        with pytest.raises(errors.SwitchFailed, match=r"could not be restored.*6.5 GiB free.*7.0 GiB.*intact"):
            b.acquire(timeout=10)
        assert status_of(a, "b")["faulted"] is None  # its state is whole in host memory: not faulted
        assert not [c for c in node.driver.calls if c.op == "restore" and c.pid == pb]
        assert node.driver.state(pb) == CHECKPOINTED  # b's state is safe where it was
        node.driver.exit(outsider)  # the room is back
        grant = b.acquire(timeout=30)  # and b's next slice just works
        assert grant.restored and node.driver.state(pb) == RUNNING


@pytest.mark.slow
def test_a_lock_that_times_out_leaves_the_job_running_and_usable(node: Node) -> None:
    pa, pb = node.process(6), node.process(6)
    draining = node.driver.busy(pb)  # b's GPU work does not drain: its lock times out
    with EmbeddedDaemon(gpus=1, parking=node.parking) as d, job(d, "a", pa) as a, job(d, "b", pb) as b:
        with pytest.raises(errors.SwitchFailed, match=rf"cuCheckpointProcessLock\(pid {pb}\) timed out"):
            a.acquire(timeout=10)  # a needs the GPU b holds, and is told why at once
        assert status_of(a, "b")["faulted"] is None and node.driver.state(pb) == RUNNING
        assert b.acquire(timeout=10).job == "b"  # b was never harmed: its slice just works
        b.release()
        draining.set()  # b's work drained; the refusal lapses (PARK_RETRY_S) and the next park goes through
        assert status_of(a, "b")["park_refused"]
        wait_for(lambda: status_of(a, "b")["park_refused"] is None, timeout=PARK_RETRY_S + 5)
        assert a.acquire(timeout=30).job == "a" and node.driver.state(pb) == CHECKPOINTED


def test_a_restarted_daemon_takes_up_checkpointed_and_running_jobs(node: Node, tmp_path: Path) -> None:
    pa, pb = node.process(6), node.process(6)
    config = DaemonConfig(state_dir=tmp_path / "state", backend="cuda-checkpoint", gpus=1)
    d = EmbeddedDaemon(config, parking=node.parking).start()
    a, b = job(d, "a", pa), job(d, "b", pb)
    try:
        a.acquire()  # b is checkpointed to make room
        assert node.driver.state(pb) == CHECKPOINTED
        d.stop()
        d = EmbeddedDaemon(config, parking=node.parking).start()  # a new backend: it knows nothing yet
        a.release()  # a's client reconnected and got its lock back first
        assert a.reconnects == 1
        jobs = {j["job"]: j["location"] for j in a.status()["jobs"]}
        assert jobs == {"a": "resident", "b": "parked"}  # as the driver says
        grant = b.acquire(timeout=10)
        assert grant.restored and node.driver.state(pb) == RUNNING and node.driver.state(pa) == CHECKPOINTED
        assert node.memory.held(pb) == {0: 6 * GiB}
    finally:
        a.close()
        b.close()
        d.stop()


def test_a_daemon_in_a_container_parks_by_the_driver_and_weighs_by_the_gpu() -> None:
    # NVML reports host PIDs (here: ours + 40000), and another container's process has host PID
    # equal to one of our jobs' PIDs: only the driver's answer and the GPU's drop are trusted.
    memory = FakeGpuMemory({0: 16 * GiB}, reserved={0: 400 << 20}, pid_offset=40_000)
    n = Node(memory, footprints=GPU_DELTA)
    try:
        pa, pb = n.process(6), n.process(5)
        memory.outsider(pa, {0: 1 * GiB})
        with EmbeddedDaemon(gpus=1, parking=n.parking) as d, job(d, "a", pa) as a, job(d, "b", pb) as b:
            a.acquire()  # b is parked to make room
            assert n.driver.state(pb) == CHECKPOINTED and n.driver.state(pa) == RUNNING
            a.release()
            grant = b.acquire(timeout=10)
            assert grant.restored and n.driver.state(pa) == CHECKPOINTED and n.driver.state(pb) == RUNNING
            doc = b.status()
            assert schema.problems(doc) == []
            assert doc["parking"]["checkpoint"]["footprints"] == "gpu-delta"
            assert status_of(b, "a")["measured"] == {"0": 6 * GiB}  # the outsider's 1 GiB is not a's
    finally:
        n.close()
