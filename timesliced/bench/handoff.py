"""``timesliced bench ...``: benchmark programs that print figures.

``handoff`` runs a real daemon process and real client processes. Jobs hold
no device memory, so a handoff is pure lock traffic: the time from one job's
release to the next job's acquire returning. Clocks are compared across
processes with ``time.perf_counter`` (CLOCK_MONOTONIC on Linux).

Two floors are measured in the same run: a raw Unix-socket round trip, and the
same job processes against a server that does nothing but hand one lock over
(``noop_lock_server``), so what the daemon's own work adds is its own figure.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client.codec import Grant
from ..util.stats import percentile
from ..wire.codec import FrameDecoder, encode
from ..wire.messages import PROTOCOL_VERSION
from .common import DaemonProcess

GROUP = "bench"


# --- workers (run in their own processes) --------------------------------------------


def handoff_worker(address: str, job: str, jobs: int, rounds: int, hold_s: float, gap_s: float = 0.0) -> dict[str, Any]:
    from ..client import Client

    with Client(job=job, group=GROUP, address=address) as client:
        while len(client.status()["jobs"]) < jobs:  # start together
            time.sleep(0.01)
        slices = []
        for _ in range(rounds):
            grant: Grant = client.acquire()
            acquired = time.perf_counter()
            time.sleep(hold_s)  # lets the other jobs queue up, so every release hands over
            released = time.perf_counter()
            client.release()
            slices.append((acquired, released, grant.fence))
            if gap_s:
                time.sleep(gap_s)  # the job's work between two slices, off the GPU
    return {"job": job, "slices": slices}


def uncontended_worker(address: str, rounds: int, hold_s: float = 0.001) -> dict[str, Any]:
    from ..client import Client

    with Client(job="solo", group=f"{GROUP}-solo", address=address) as client:
        client.acquire()
        client.release()
        start = time.perf_counter()
        for _ in range(rounds):
            client.acquire()
            client.release()
        elapsed = time.perf_counter() - start
        pings = []
        for _ in range(min(rounds, 2000)):
            t = time.perf_counter()
            client.ping()
            pings.append(time.perf_counter() - t)
        # A handoff follows a hold: the daemon and the waiter sat idle for it, and an idle CPU (a VM's
        # above all) takes longer to wake. The same round trip after the same idle time, for comparison.
        idle = []
        for _ in range(min(rounds, 1000)):
            time.sleep(hold_s)
            t = time.perf_counter()
            client.ping()
            idle.append(time.perf_counter() - t)
    return {
        "acquire_release_per_s": rounds / elapsed,
        "ping_rtt_p50_ms": (percentile(pings, 0.5) or 0.0) * 1000,
        "ping_after_idle_p50_ms": (percentile(idle, 0.5) or 0.0) * 1000,
    }


class RawClient:
    """The least a client of the daemon's protocol can be: one blocking socket, a request, its answer.

    No reader thread, heartbeat, reconnection, timeout or push handling: the floor a handoff could reach
    with a client that does nothing else, for comparison with ``Client``.
    """

    def __init__(self, address: str, job: str, group: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(address)
        self.decoder = FrameDecoder()
        self.answers: list[dict[str, Any]] = []
        self.rid = 0
        self.call("hello", {"version": PROTOCOL_VERSION})
        self.call("register", {"job": job, "group": group, "pids": [os.getpid()]})

    def call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        self.rid += 1
        self.sock.sendall(encode({"id": self.rid, "op": op, "args": args or {}}))
        while True:
            while not self.answers:
                data = self.sock.recv(1 << 16)
                if not data:
                    raise ConnectionError(f"the server closed the connection during {op!r}")
                self.answers += self.decoder.feed(data)
            answer = self.answers.pop(0)
            if answer.get("id") == self.rid:  # pushes and stray answers are dropped
                if not answer.get("ok"):
                    raise RuntimeError(f"{op!r} failed: {answer.get('error')}")
                return answer.get("result")

    def close(self) -> None:
        self.sock.close()


def raw_handoff_worker(
    address: str, job: str, jobs: int, rounds: int, hold_s: float, gap_s: float = 0.0
) -> dict[str, Any]:
    client = RawClient(address, job, GROUP)
    try:
        while len(client.call("status")["jobs"]) < jobs:
            time.sleep(0.01)
        slices = []
        for _ in range(rounds):
            grant = client.call("acquire")
            acquired = time.perf_counter()
            time.sleep(hold_s)
            released = time.perf_counter()
            client.call("release")
            slices.append((acquired, released, grant["fence"]))
            if gap_s:
                time.sleep(gap_s)
    finally:
        client.close()
    return {"job": job, "slices": slices}


def raw_uncontended_worker(address: str, rounds: int, hold_s: float = 0.001) -> dict[str, Any]:
    client = RawClient(address, "solo", f"{GROUP}-solo")
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            client.call("acquire")
            client.call("release")
        elapsed = time.perf_counter() - start
        pings = []
        for _ in range(min(rounds, 2000)):
            t = time.perf_counter()
            client.call("ping")
            pings.append(time.perf_counter() - t)
    finally:
        client.close()
    p50 = (percentile(pings, 0.5) or 0.0) * 1000
    return {"acquire_release_per_s": rounds / elapsed, "ping_rtt_p50_ms": p50, "ping_after_idle_p50_ms": p50}


WORKERS: dict[str, Callable[..., dict[str, Any]]] = {
    "handoff": handoff_worker,
    "uncontended": uncontended_worker,
    "raw-handoff": raw_handoff_worker,
    "raw-uncontended": raw_uncontended_worker,
}


def echo_server(path: str) -> None:
    """Echo bytes on a Unix socket: the floor any request/reply can reach."""
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)


@dataclass
class _Lock:
    """The one lock of ``noop_lock_server``: its holder, the queue (a connection and its acquire's id), the jobs."""

    holder: _NoopClient | None = None
    queue: list[tuple[_NoopClient, int]] = field(default_factory=list)
    fence: int = 0
    jobs: dict[str, None] = field(default_factory=dict)

    def hand_over(self) -> None:
        self.holder = None
        if self.queue:
            waiter, rid = self.queue.pop(0)
            waiter.grant(rid)


class _NoopClient(asyncio.Protocol):
    """One connection to ``noop_lock_server``: answers what the job processes ask, in the daemon's protocol."""

    def __init__(self, lock: _Lock) -> None:
        self.lock, self.decoder, self.job = lock, FrameDecoder(), ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lock.queue = [(c, rid) for c, rid in self.lock.queue if c is not self]
        if self.lock.holder is self:
            self.lock.hand_over()

    def data_received(self, data: bytes) -> None:
        lock = self.lock
        for message in self.decoder.feed(data):
            rid, op, args = message["id"], message["op"], message.get("args", {})
            if op == "hello":
                self.reply(rid, {"version": PROTOCOL_VERSION, "node": "noop", "backend": "none", "session": id(self)})
            elif op == "register":
                self.job = args["job"]
                lock.jobs[self.job] = None
                self.reply(rid, {"job": self.job, "group": args["group"], "gpus": [0], "session": id(self)})
            elif op == "status":
                self.reply(rid, {"jobs": [{"name": job} for job in lock.jobs]})
            elif op == "acquire":
                if lock.holder is None:
                    self.grant(rid)
                else:
                    lock.queue.append((self, rid))
            elif op == "release":
                lock.hand_over()  # the next holder first, as the daemon does
                self.reply(rid, {"group": GROUP, "fence": lock.fence, "held_s": 0.0})
            else:  # ping, and the client's heartbeats
                self.reply(rid, {})

    def grant(self, rid: int) -> None:
        self.lock.holder = self
        self.lock.fence += 1
        grant = {"waited_s": 0.0, "switch_s": 0.0, "restored": False, "term": 1}
        self.reply(rid, {"group": GROUP, "job": self.job, "fence": self.lock.fence, **grant})

    def reply(self, rid: int, result: dict[str, Any]) -> None:
        self.transport.write(encode({"id": rid, "ok": True, "result": result}))


def noop_lock_server(path: str) -> None:
    """A server that does nothing but hand one lock over, first come first served, in the daemon's protocol.

    The same job processes against it give the floor of a handoff with this client: what the client,
    the kernel and the machine cost. The daemon's own work is what its handoff adds to that.
    """

    async def serve() -> None:
        lock = _Lock()
        server = await asyncio.get_running_loop().create_unix_server(lambda: _NoopClient(lock), path=path)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def loopback_rtt(rounds: int) -> float:
    path = os.path.join(tempfile.mkdtemp(prefix="timesliced-echo-"), "echo.sock")
    server = subprocess.Popen(
        [sys.executable, "-m", "timesliced.bench.handoff", "--echo", path], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()
        samples = []
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            message = b"x" * 48  # about the size of an acquire frame
            for _ in range(rounds):
                t = time.perf_counter()
                s.sendall(message)
                got = 0
                while got < len(message):
                    got += len(s.recv(4096))
                samples.append(time.perf_counter() - t)
        return (percentile(samples, 0.5) or 0.0) * 1000
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


# --- the benchmark -------------------------------------------------------------------


def _run_worker(*args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "timesliced.bench.handoff", "--worker", json.dumps(args)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed with exit code {proc.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def run_handoff(
    rounds: int = 2000, jobs: int = 2, hold_s: float = 0.001, nodes: int = 1, gap_s: float = 0.0
) -> dict[str, Any]:
    """Handoff latency, uncontended acquire+release rate and the loopback floor.

    ``nodes > 1``: a cluster of that many daemons on loopback, with the job processes on a
    follower, so every acquire and release is forwarded to the leader on another daemon.
    ``gap_s``: each job waits that long after its release before it asks again (its work off the
    GPU); below ``hold_s``, so that the others still queue behind every holder. Raises ``ValueError``.
    """
    if jobs < 2 or rounds < 10:
        raise ValueError("need at least 2 jobs and 10 rounds")
    if not 0 <= gap_s < hold_s:
        raise ValueError(
            f"the gap must be at least 0 and below the hold ({hold_s * 1000:g} ms), so that every release hands over"
        )
    if nodes > 1:
        from .cluster import LocalCluster

        with tempfile.TemporaryDirectory(prefix="timesliced-bench-") as tmp, LocalCluster(Path(tmp), nodes) as cluster:
            cluster.start_all()
            leader = cluster.leader()
            follower = next(n for n in cluster.names if n != leader)
            figures = _measure_handoff(str(cluster.socket(follower)), rounds, jobs, hold_s, gap_s)
        return {"nodes": nodes, "leader": leader, "clients_on": follower, **figures}
    with DaemonProcess("--gpus", "1", "--gpu-memory", "64MiB") as daemon:
        return {"nodes": 1, **_measure_handoff(daemon.socket, rounds, jobs, hold_s, gap_s)}


def _measure_handoff(address: str, rounds: int, jobs: int, hold_s: float, gap_s: float) -> dict[str, Any]:
    handoffs, fences, solo = _handoffs(address, rounds, jobs, hold_s, gap_s)
    raw_handoffs, _, raw_solo = _handoffs(address, rounds, jobs, hold_s, gap_s, raw=True)
    with _noop_server() as noop:
        noop_handoffs, _, noop_solo = _handoffs(noop, rounds, jobs, hold_s, gap_s)
        raw_noop_handoffs, _, raw_noop_solo = _handoffs(noop, rounds, jobs, hold_s, gap_s, raw=True)
    floor = loopback_rtt(min(rounds, 5000))
    p50 = percentile(handoffs, 0.5) or 0.0
    figures = {
        "jobs": jobs,
        "hold_ms": hold_s * 1000,
        "gap_ms": gap_s * 1000,
        "rounds": len(fences),
        "handoffs": len(handoffs),
        "handoff_p50_ms": p50,
        "handoff_p99_ms": percentile(handoffs, 0.99),
        "handoff_max_ms": max(handoffs),
        "acquire_release_per_s": solo["acquire_release_per_s"],
        "ping_rtt_p50_ms": solo["ping_rtt_p50_ms"],
        "handoff_over_ping": p50 / solo["ping_rtt_p50_ms"],
        "ping_after_idle_p50_ms": solo["ping_after_idle_p50_ms"],
        "handoff_over_ping_after_idle": p50 / solo["ping_after_idle_p50_ms"],
        "loopback_rtt_p50_ms": floor,
        "handoff_over_loopback": p50 / floor,
        "fences_strictly_increasing": all(b > a for a, b in itertools.pairwise(fences)),
    }
    for prefix, got, pinged in (
        ("noop_", noop_handoffs, noop_solo),
        ("raw_", raw_handoffs, raw_solo),
        ("raw_noop_", raw_noop_handoffs, raw_noop_solo),
    ):
        other = percentile(got, 0.5) or 0.0
        figures[f"{prefix}handoff_p50_ms"] = other
        figures[f"{prefix}ping_rtt_p50_ms"] = pinged["ping_rtt_p50_ms"]
        figures[f"{prefix}handoff_over_ping"] = other / pinged["ping_rtt_p50_ms"]
    figures["handoff_over_noop"] = p50 / figures["noop_handoff_p50_ms"]
    return figures


def _handoffs(
    address: str, rounds: int, jobs: int, hold_s: float, gap_s: float, *, raw: bool = False
) -> tuple[list[float], list[int], dict[str, Any]]:
    """The jobs' handoffs (ms) through the lock at ``address``, every grant's fence in order, and the solo figures.

    ``raw``: the job processes use ``RawClient`` rather than ``Client``.
    """
    kind = "raw-" if raw else ""
    per_job = max(1, rounds // jobs)
    procs = [_run_worker(f"{kind}handoff", address, f"job-{i}", jobs, per_job, hold_s, gap_s) for i in range(jobs)]
    records = [_result(p) for p in procs]
    solo = _result(_run_worker(f"{kind}uncontended", address, rounds, hold_s))
    slices = sorted((acq, rel, fence, r["job"]) for r in records for acq, rel, fence in r["slices"])
    handoffs = [
        (nxt[0] - prev[1]) * 1000
        for prev, nxt in itertools.pairwise(slices)
        if nxt[3] != prev[3] and nxt[2] == prev[2] + 1
    ]
    if not handoffs:
        raise RuntimeError(f"the jobs never handed the lock to each other at {address}: no handoff to measure")
    return handoffs, [s[2] for s in slices], solo


@contextmanager
def _noop_server() -> Iterator[str]:
    """``with _noop_server() as address:`` a ``noop_lock_server`` process listening there."""
    folder = tempfile.mkdtemp(prefix="timesliced-noop-")
    path = os.path.join(folder, "noop.sock")
    proc = subprocess.Popen([sys.executable, "-m", "timesliced.bench.handoff", "--noop", path], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            raise RuntimeError("the no-op lock server did not start")
        yield path
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)


def format_handoff(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"handoff between {r['jobs']} jobs over {r['rounds']} slices ({r['handoffs']} handoffs)"
            + (f" on a follower of a {r['nodes']}-daemon cluster" if r["nodes"] > 1 else "")
            + (f", each job {r['gap_ms']:g} ms off the lock between slices" if r["gap_ms"] else ""),
            f"  release -> next acquire returns   p50 {r['handoff_p50_ms']:.3f} ms   "
            f"p99 {r['handoff_p99_ms']:.3f} ms   max {r['handoff_max_ms']:.3f} ms",
            f"  uncontended acquire+release       {r['acquire_release_per_s']:.0f} /s",
            f"  daemon ping round trip            p50 {r['ping_rtt_p50_ms']:.3f} ms   "
            f"(handoff p50 / ping p50 {r['handoff_over_ping']:.2f}x)",
            f"  {'ping after ' + format(r['hold_ms'], 'g') + ' ms idle':<34}p50 "
            f"{r['ping_after_idle_p50_ms']:.3f} ms   "
            f"(handoff p50 / it {r['handoff_over_ping_after_idle']:.2f}x)",
            "  handoff p50 / ping p50 by client and server, same run:",
            f"    {'':<20}{'this daemon':<30}a no-op lock server",
            _pair_line("timesliced client", r, "", "noop_"),
            _pair_line("raw socket client", r, "raw_", "raw_noop_"),
            f"    (the daemon's own work: handoff {r['handoff_over_noop']:.2f}x the no-op server's, same client)",
            f"  raw loopback round trip (floor)   p50 {r['loopback_rtt_p50_ms']:.3f} ms",
            f"  handoff p50 / loopback p50        {r['handoff_over_loopback']:.1f}x",
        ]
    )


def _pair_line(label: str, r: dict[str, Any], here: str, noop: str) -> str:
    def cell(p: str) -> str:
        return f"{r[p + 'handoff_p50_ms']:.3f} / {r[p + 'ping_rtt_p50_ms']:.3f} ms {r[p + 'handoff_over_ping']:.2f}x"

    return f"    {label:<20}{cell(here):<30}{cell(noop)}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--echo":
        echo_server(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--noop":
        noop_lock_server(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker":
        kind, *rest = json.loads(sys.argv[2])
        print(json.dumps(WORKERS[kind](*rest)))
    else:
        raise SystemExit("usage: timesliced bench handoff")
