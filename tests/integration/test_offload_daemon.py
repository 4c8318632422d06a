"""The offload method through a real daemon: directives over the client's connection.

The executors here keep their "device" bytes in plain buffers and record
every call, so the tests see exactly what the daemon asked of each process.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Sequence
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.wire.park import ParkSpec

from ..helpers.daemon import Raw
from ..helpers.processes import spawn_python, wait_for


class Recorder:
    """An executor with one region of real bytes: parked means moved to a host copy."""

    def __init__(self, nbytes: int = 1 << 20, *, fail: str = "", hang: threading.Event | None = None) -> None:
        self.device: bytearray | None = bytearray(range(256)) * (nbytes // 256)
        self.host: bytes | None = None
        self.calls: list[tuple[str, tuple[str, ...], bool]] = []
        self.fail = fail
        self.hang = hang

    def park(self, tags: Sequence[str] = (), *, verify: bool | None = None) -> dict[str, Any]:
        self.calls.append(("park", tuple(tags), bool(verify)))
        if self.hang is not None:
            self.hang.wait(10)
        if self.fail == "park":
            raise RuntimeError("copy engine fell over")
        if self.device is None:
            return {"nbytes": 0, "seconds": 0.0, "per_gpu": {}}
        self.host, self.device = bytes(self.device), None
        return {"nbytes": len(self.host), "seconds": 0.001, "per_gpu": {0: len(self.host)}}

    def unpark(self, tags: Sequence[str] = (), *, verify: bool | None = None) -> dict[str, Any]:
        self.calls.append(("unpark", tuple(tags), bool(verify)))
        if self.fail == "unpark":
            raise RuntimeError("no memory to map")
        if self.host is None:
            return {"nbytes": 0, "seconds": 0.0, "per_gpu": {}}
        self.device, self.host = bytearray(self.host), None
        return {"nbytes": len(self.device), "seconds": 0.001, "per_gpu": {0: len(self.device)}}

    @property
    def resident(self) -> bool:
        return self.device is not None


def offload_client(daemon: EmbeddedDaemon, job: str, executor: Any, **kw: Any) -> timesliced.Client:
    park = kw.pop("park", ParkSpec("offload", tags=("weights",)))
    c = timesliced.Client(job=job, group="g", address=daemon.socket, park=park, offloader=executor, **kw)
    c.connect()
    return c


def job_status(c: timesliced.Client, job: str) -> dict[str, Any]:
    return next(j for j in c.status()["jobs"] if j["job"] == job)


def test_jobs_take_turns_and_each_parks_its_own_regions(daemon: EmbeddedDaemon) -> None:
    ra, rb = Recorder(), Recorder()
    with offload_client(daemon, "a", ra) as a, offload_client(daemon, "b", rb) as b:
        first = a.acquire()
        # Both started resident; a holds, so b is parked first and a moved nothing itself.
        assert not first.restored and first.switch_s > 0
        assert rb.calls == [("park", ("weights",), False)] and not rb.resident and ra.resident
        got: list[timesliced.Grant] = []
        t = threading.Thread(target=lambda: got.append(b.acquire()))
        t.start()
        wait_for(lambda: job_status(a, "b")["location"] == "parked" and len(a.status()["groups"][0]["queue"]) == 1)
        a.release()
        t.join(10)
        assert got and got[0].restored and got[0].job == "b"
        assert ra.calls == [("park", ("weights",), False)] and not ra.resident
        assert rb.calls[-1] == ("unpark", ("weights",), False) and rb.resident
        assert bytes(rb.device or b"")[:256] == bytes(range(256))  # the bytes came back
        st = job_status(a, "b")
        assert st["location"] == "resident" and st["bytes_moved"] == 2 << 20
        b.release()


def test_a_failed_park_that_every_process_undid_leaves_the_job_usable_and_tells_the_waiter(
    daemon: EmbeddedDaemon,
) -> None:
    ra, rb = Recorder(), Recorder(fail="park")
    with offload_client(daemon, "a", ra) as a, offload_client(daemon, "b", rb) as b:
        with pytest.raises(errors.SwitchFailed, match="copy engine fell over"):
            a.acquire(timeout=10)  # b could not be parked: a is told why at once
        st = job_status(a, "b")
        assert st["location"] == "resident" and st["faulted"] is None
        assert "copy engine fell over" in st["park_refused"]
        assert [c[0] for c in rb.calls] == ["park", "unpark"] and rb.resident
        grant = b.acquire(timeout=5)  # b's bytes never left: its next slice just works
        assert not grant.restored and bytes(rb.device or b"")[:256] == bytes(range(256))
        b.release()


def test_a_failed_restore_that_every_process_undid_keeps_the_job_parked_and_retryable(
    daemon: EmbeddedDaemon,
) -> None:
    ra, rb = Recorder(), Recorder()
    with offload_client(daemon, "a", ra) as a, offload_client(daemon, "b", rb) as b:
        a.acquire()  # b is parked
        a.release()
        rb.fail = "unpark"
        with pytest.raises(errors.SwitchFailed, match=r"no memory to map.*intact in host memory"):
            b.acquire(timeout=10)
        st = job_status(a, "b")
        assert st["location"] == "parked" and st["faulted"] is None and rb.host is not None
        rb.fail = ""
        grant = b.acquire(timeout=10)
        assert grant.restored and bytes(rb.device or b"")[:256] == bytes(range(256))
        b.release()


def test_a_job_with_two_processes_parks_in_both_and_undoes_a_partial_park(daemon: EmbeddedDaemon) -> None:
    r1, r2, rb = Recorder(), Recorder(fail="park"), Recorder()
    with (
        offload_client(daemon, "a", r1) as a1,
        offload_client(daemon, "a", r2),
        offload_client(daemon, "b", rb) as b,
    ):
        # a must leave: rank 1 parks, rank 2 fails, so both are told to unpark again
        with pytest.raises(errors.SwitchFailed, match="copy engine fell over"):
            b.acquire(timeout=10)
        assert [c[0] for c in r1.calls] == ["park", "unpark"] and r1.resident
        assert [c[0] for c in r2.calls] == ["park", "unpark"] and r2.resident  # unparks whatever it had parked
        st = job_status(a1, "a")
        assert st["location"] == "resident" and st["faulted"] is None and st["park_refused"]


def test_a_park_whose_undo_fails_faults_the_job(daemon: EmbeddedDaemon) -> None:
    r1, r2, rb = Recorder(), Recorder(fail="park"), Recorder()
    r1.unpark = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))  # type: ignore[method-assign]
    with (
        offload_client(daemon, "a", r1) as a1,
        offload_client(daemon, "a", r2),
        offload_client(daemon, "b", rb) as b,
    ):
        grant = b.acquire(timeout=10)  # a's state is unknown: it is faulted, and b gets the GPUs
        assert grant.job == "b"
        faulted = job_status(a1, "a")["faulted"]
        assert "copy engine fell over" in faulted and "device lost" in faulted and "resume" in faulted
        b.release()


@pytest.mark.slow
def test_a_connection_that_closes_mid_park_faults_the_job(daemon: EmbeddedDaemon) -> None:
    hang = threading.Event()
    ra, rb = Recorder(), Recorder(hang=hang)
    with offload_client(daemon, "a", ra) as a:
        b = offload_client(daemon, "b", rb)
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(a.acquire()))
        t.start()
        wait_for(lambda: rb.calls != [])  # b is parking (and hangs there)
        b.close()
        hang.set()
        t.join(10)
        assert got and got[0].job == "a"  # b's connection is gone: a gets the GPUs
        assert "connection closed" in job_status(a, "b")["faulted"]


def test_a_client_without_an_executor_answers_with_nothing_moved(daemon: EmbeddedDaemon) -> None:
    ra = Recorder()
    with offload_client(daemon, "a", ra) as a, offload_client(daemon, "b", None) as b:
        b.acquire()
        assert ra.calls and not ra.resident
        b.release()
        a.acquire()
        st = job_status(a, "b")
        assert st["location"] == "parked" and st["bytes_moved"] == 0


def test_directive_answers_are_checked(daemon: EmbeddedDaemon) -> None:
    with offload_client(daemon, "a", Recorder()) as a:
        with pytest.raises(errors.BadRequest, match="no offload directive 99"):
            a._call("offload_done", {"directive": 99, "ok": True})
        assert a.acquire().job == "a"


@pytest.mark.parametrize(
    ("park", "error", "match"),
    [
        ({"method": "teleport"}, errors.BadRequest, "unknown parking method"),
        ({"method": "vllm"}, errors.BadRequest, "needs 'endpoints'"),
        ({"method": "vllm", "endpoints": ["ftp://x"]}, errors.BadRequest, "not an http"),
        ({"method": "vllm", "endpoints": ["http://x"], "level": 3}, errors.BadRequest, "'level'"),
        ({"method": "offload", "tags": [1]}, errors.BadRequest, "'tags'"),
        ({"method": "cuda-checkpoint"}, errors.BackendUnavailable, "not available on this node"),
        ("offload", errors.BadRequest, "must be a map"),
    ],
)
def test_bad_park_specs_are_refused(
    daemon: EmbeddedDaemon, park: Any, error: type[errors.TimeslicedError], match: str
) -> None:
    raw = Raw(daemon.socket)  # the client library refuses most of these itself: talk to the daemon directly
    try:
        raw.hello()
        reply = raw.call(1, "register", {"job": "x", "group": "g", "park": park})
    finally:
        raw.close()
    assert reply["ok"] is False and reply["error"]["code"] == error.code, reply
    assert re.search(match, reply["error"]["message"]), reply
    with timesliced.Client(job="x", group="g", address=daemon.socket) as ok:  # the daemon is unharmed
        assert ok.acquire().job == "x"


def test_a_job_keeps_its_parking_method(daemon: EmbeddedDaemon) -> None:
    with offload_client(daemon, "a", Recorder()):
        c = timesliced.Client(job="a", group="g", address=daemon.socket)  # sim, the daemon's default
        with pytest.raises(errors.BadRequest, match="already registered to be parked"):
            c.connect()


def test_sim_memory_is_only_for_sim_jobs(daemon: EmbeddedDaemon) -> None:
    with offload_client(daemon, "a", Recorder()) as a, pytest.raises(errors.BadRequest, match="no simulated memory"):
        a.sim_alloc(4096)


WORKLOAD = """
import hashlib, json, os, sys, time, timesliced
from timesliced.wire.park import ParkSpec
from timesliced.client.offload import HostDeviceMemory, Offloader

job, address, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
tags = tuple(sys.argv[4].split(",")) if sys.argv[4] else ()
memory = HostDeviceMemory(gpus=1)
off = Offloader(memory, verify=True)
base = off.alloc(4 << 20, tag="weights")
lora = off.alloc(1 << 20, tag="lora")
pointers = (base.ptr, lora.ptr)
client = timesliced.Client(job=job, group="g", address=address, park=ParkSpec("offload", tags=tags), offloader=off)
expected, data_errors, restored = {}, 0, 0
with client:
    while sum(j["group"] == "g" for j in client.status()["jobs"]) < 2:
        time.sleep(0.01)  # both jobs take part from the first turn, however slowly the other one starts
    for step in range(rounds):
        with client.slice() as grant:
            restored += grant.restored
            for r in (base, lora):
                if r.name in expected and hashlib.sha256(r.read()).hexdigest() != expected[r.name]:
                    data_errors += 1
                r.write(os.urandom(r.nbytes))
                expected[r.name] = hashlib.sha256(r.read()).hexdigest()
print(json.dumps({"job": job, "data_errors": data_errors, "restored": restored,
                  "pointers_stable": pointers == (base.ptr, lora.ptr)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("tags", "parked_bytes"), [("", 5 << 20), ("lora", 1 << 20)])
def test_processes_offload_their_regions_and_every_byte_survives(
    daemon: EmbeddedDaemon, tags: str, parked_bytes: int
) -> None:
    procs = [spawn_python(WORKLOAD, job, daemon.socket, "8", tags) for job in ("a", "b")]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["data_errors"] for r in results] == [0, 0]
    assert all(r["pointers_stable"] for r in results)
    assert sum(r["restored"] for r in results) >= 8  # most turns came back from host memory
    with timesliced.Client(job="observer", group="obs", address=daemon.socket, gpus=[1]) as c:
        status = c.status()
        group = next(g for g in status["groups"] if g["group"] == "g")
        assert group["switches"] >= 8
        # Each switch moves exactly the tagged regions, out and back in.
        assert group["bytes_moved"] % parked_bytes == 0 and group["bytes_moved"] >= 16 * parked_bytes
        moves = status["moves"]
        assert moves and all(m["nbytes"] == parked_bytes for m in moves["recent"] if m["nbytes"])


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ({"ok": 1}, "'ok' must be true or false"),
        ({"ok": True, "nbytes": -1}, "'nbytes'"),
        ({"ok": True, "nbytes": "many"}, "'nbytes'"),
        ({"ok": True, "nbytes": 1, "footprint": {"7": 1}}, "GPU '7'"),
        ({"ok": True, "nbytes": 1, "footprint": {"0": -5}}, "non-negative"),
        ({"ok": True, "nbytes": 1, "footprint": [1]}, "'footprint'"),
    ],
)
def test_bad_offload_answers_are_refused_and_the_daemon_goes_on(
    daemon: EmbeddedDaemon, answer: dict[str, Any], match: str
) -> None:
    class Liar(Recorder):
        """Answers every directive by hand, with ``answer``, before the real answer goes out."""

        def park(self, tags: Sequence[str] = (), *, verify: bool | None = None) -> dict[str, Any]:
            with pytest.raises(errors.BadRequest, match=match):
                liar_client._call("offload_done", {"directive": self.pending(), **answer})
            return super().park(tags, verify=verify)

        def pending(self) -> int:
            return daemon.daemon.directives.last if daemon.daemon else -1

    liar = Liar()
    with offload_client(daemon, "liar", liar) as liar_client, offload_client(daemon, "b", Recorder()) as b:
        assert b.acquire(timeout=10).job == "b"  # parking the liar went through with its real answer
        assert job_status(b, "liar")["location"] == "parked" and not job_status(b, "liar")["faulted"]


def test_a_rank_that_disconnects_mid_park_gets_the_others_undone(daemon: EmbeddedDaemon) -> None:
    hang = threading.Event()
    r1, r2 = Recorder(), Recorder(hang=hang)
    with offload_client(daemon, "a", r1) as a1, offload_client(daemon, "b", Recorder()) as b:
        a2 = offload_client(daemon, "a", r2)
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(b.acquire(timeout=20)))
        t.start()
        wait_for(lambda: r2.calls != [] and r1.calls != [])  # both ranks were told to park; rank 2 hangs
        assert a2._sock is not None
        a2._sock.shutdown(socket.SHUT_RDWR)  # rank 2's connection drops mid-park
        hang.set()
        a2.close()
        t.join(20)
        assert got and got[0].job == "b"
        wait_for(lambda: [c[0] for c in r1.calls] == ["park", "unpark"])  # rank 1 was brought back
        assert r1.resident
        assert "connection closed" in job_status(a1, "a")["faulted"]


def test_an_offloaded_job_is_restored_after_a_daemon_restart(daemon: EmbeddedDaemon) -> None:
    ra, rb = Recorder(), Recorder()
    a, b = offload_client(daemon, "a", ra), offload_client(daemon, "b", rb)
    a.acquire()  # b is parked: its bytes are in its own process, which outlives the daemon
    assert not rb.resident
    daemon.stop()
    restarted = EmbeddedDaemon(daemon.config).start()
    try:
        a.release()  # a reconnected, got its lock back first (nothing moved), and yields
        assert ra.calls == [] and a.reconnects == 1
        grant = b.acquire(timeout=10)  # the journal said b is parked: it is unparked over its new connection
        assert grant.restored and rb.resident and bytes(rb.device or b"")[:256] == bytes(range(256))
        assert rb.calls[-1] == ("unpark", ("weights",), False) and not ra.resident
    finally:
        a.close()
        b.close()
        restarted.stop()


def test_footprints_reach_the_daemon_in_the_nodes_gpu_numbers(daemon: EmbeddedDaemon) -> None:
    """A job whose only device is the node's GPU 1 (as under CUDA_VISIBLE_DEVICES=1) reports GPU 1, not 0."""
    from timesliced.client.gpus import GpuNumbering
    from timesliced.client.offload import HostDeviceMemory, Offloader

    memory = HostDeviceMemory(gpus=1, granularity=1 << 16, numbering=GpuNumbering((1,)))
    off = Offloader(memory)
    region = off.alloc(3 << 16, tag="weights")
    region.write(b"w" * region.nbytes)
    assert region.gpu == 0 and region.node_gpu == 1
    with (
        offload_client(daemon, "a", off, gpus=[1]) as a,
        offload_client(daemon, "b", Recorder(), gpus=[1]) as b,
    ):
        assert b.acquire(timeout=10).job == "b"  # a is parked to make room: its executor reports what it moved
        assert not region.resident
        st = job_status(b, "a")
        assert st["location"] == "parked" and st["measured"] == {"1": 3 << 16}
        b.release()
        a.acquire(timeout=10)
        assert region.resident and region.read() == b"w" * region.nbytes
        a.release()
