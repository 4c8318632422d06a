"""Offload swaps with real job processes: a worker script, its trace, and the checks read from it.

Each worker is one job: an ``Offloader`` over ``HostDeviceMemory`` (paced to a bandwidth, so a copy
takes time) with ``regions`` regions of 2 MiB, registered with its memory declared, so that two jobs
on a GPU too small for both switch by a swap. Its fake device memory writes every ``map`` and
``unmap`` to a trace file (``time.monotonic()``, the same clock in every process here), between the
start and the end of each park and unpark. ``FAULT`` (JSON: the memory call, the how-manieth) makes
one call of the fake fail once, as a driver error would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .processes import python_env

REGION = 2 << 20  # the fake's mapping granularity: one region is one map

WORKER = r"""
import hashlib, json, os, sys, threading, time
import timesliced
from timesliced import errors
from timesliced.client.offload import HostDeviceMemory, Offloader

job, address, rounds, trace_path, regions, bandwidth, fault, device = sys.argv[1:9]
rounds, regions, bandwidth, fault = int(rounds), int(regions), float(bandwidth), json.loads(fault)
trace = open(trace_path, "a", buffering=1)
folder = os.path.dirname(trace_path)
lock = threading.Lock()

def note(event, gpu=0, nbytes=0):
    with lock:
        trace.write(f"{time.monotonic():.6f} {event} {gpu} {nbytes}\n")

if device == "cuda":  # a real GPU (tests/gpu): the same trace around the driver's map and unmap
    from timesliced.client.offload import CudaDeviceMemory as Base
else:
    Base = HostDeviceMemory

class Memory(Base):
    calls = {}
    def _maybe_fail(self, call):
        n = self.calls[call] = self.calls.get(call, 0) + 1
        if fault and fault[0] == call and fault[1] == n:
            raise errors.BackendError(f"injected failure of {call} #{n}")
    def map(self, va, nbytes):
        self._maybe_fail("map")
        super().map(va, nbytes)
        if device == "cuda":
            note("map", 0, nbytes)
    def unmap(self, va, nbytes):
        self._maybe_fail("unmap")
        super().unmap(va, nbytes)
        if device == "cuda":
            note("unmap", 0, nbytes)
    def copy_to_host_async(self, dst, va, nbytes):
        self._maybe_fail("copy_to_host")
        super().copy_to_host_async(dst, va, nbytes)

def pace(on):
    # The stand-in's bandwidth paces the moves only: the job's own reads and writes of its regions are free.
    if device != "cuda":
        memory.bandwidth = (bandwidth or None) if on else None

class Traced(Offloader):
    def park(self, tags=(), **kw):
        note("park-start")
        pace(True)
        try:
            return super().park(tags, **kw)
        finally:
            pace(False)
            note("park-end")
    def unpark(self, tags=(), **kw):
        note("unpark-start")
        pace(True)
        try:
            return super().unpark(tags, **kw)
        finally:
            pace(False)
            note("unpark-end")

memory = Memory() if device == "cuda" else Memory(gpus=1, trace=note)
off = Traced(memory, verify=True)
mine = [off.alloc(2 << 20, tag="weights") for _ in range(regions)]
expected, data_errors, restored, failures = {}, 0, 0, []

def check():
    global data_errors
    for r in mine:
        if r.name in expected and hashlib.sha256(r.read()).hexdigest() != expected[r.name]:
            data_errors += 1

client = timesliced.Client(job=job, group="g", address=address, park="offload", offloader=off,
                           memory=regions * (2 << 20), reconnect=60)
with client:
    while sum(j["group"] == "g" for j in client.status()["jobs"]) < 2:
        time.sleep(0.01)
    turns = 0
    while turns < rounds:
        try:
            grant = client.acquire(timeout=60)
        except errors.SwitchFailed as exc:
            failures.append(exc.message)
            break
        except errors.ConnectionLost as exc:  # a daemon restarting: the client reconnects on its own
            failures.append("lost: " + exc.message)
            time.sleep(0.2)
            continue
        try:
            restored += grant.restored
            check()
            for r in mine:
                r.write(os.urandom(r.nbytes))
                expected[r.name] = hashlib.sha256(r.read()).hexdigest()
            turns += 1
        finally:
            try:
                client.release()
            except errors.TimeslicedError as exc:
                failures.append("release: " + exc.message)
    def barrier(stage):  # both jobs reach ``stage``: the other's turns may swap this one out until then
        open(f"{folder}/{job}.{stage}", "w").close()
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(folder) if n.endswith("." + stage)]) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    barrier("finished")
    try:  # one more turn: every byte this job wrote is where it left it
        with client.slice(timeout=30):
            check()
    except errors.TimeslicedError as exc:
        failures.append("last: " + exc.message)
    barrier("checked")
print(json.dumps({"job": job, "data_errors": data_errors, "restored": restored, "failures": failures,
                  "resident": off.resident()}))
"""


def spawn_worker(
    job: str,
    address: str,
    trace: Path,
    *,
    rounds: int = 3,
    regions: int = 8,
    bandwidth: float = 100e6,
    fault: tuple[str, int] | None = None,
    device: str = "host",
) -> subprocess.Popen[str]:
    """One job (``WORKER``); ``device``: ``host`` (the CPU stand-in, paced to ``bandwidth``) or ``cuda`` (GPU 0)."""
    args = (job, address, str(rounds), str(trace), str(regions), str(bandwidth), json.dumps(fault or []), device)
    # The checkout first, and whatever the path held (the GPU check's own dependencies are there).
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
    )


@dataclass
class Directive:
    """One park or unpark of a worker, from its trace: its span and the room it mapped or freed."""

    kind: str  # park | unpark
    start: float
    end: float = 0.0
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (time, map | unmap, bytes)


def read_trace(path: Path) -> list[Directive]:
    out: list[Directive] = []
    current: Directive | None = None
    for line in path.read_text().splitlines():
        t, event, _gpu, nbytes = line.split()
        if event in ("park-start", "unpark-start"):
            current = Directive(event.split("-")[0], float(t))
        elif event in ("park-end", "unpark-end") and current is not None:
            current.end = float(t)
            out.append(current)
            current = None
        elif current is not None:
            current.events.append((float(t), event, int(nbytes)))
    return out


def swaps(out_trace: list[Directive], in_trace: list[Directive]) -> list[tuple[Directive, Directive]]:
    """(park, unpark) pairs of the two jobs that moved bytes at overlapping times."""
    pairs = []
    for unpark in (d for d in in_trace if d.kind == "unpark" and d.events):
        for park in (d for d in out_trace if d.kind == "park" and d.events):
            if park.start < unpark.end and unpark.start < park.end:
                pairs.append((park, unpark))
    return pairs


def streaming_problems(park: Directive, unpark: Directive, room: int = 0) -> list[str]:
    """What shows that ``unpark`` did not stream into ``park``'s room (empty: it did).

    It streamed when its first map came before the park's last unmap, and at every map it held no
    more than ``room`` (the free room it was given) plus what the park had unmapped by then.
    """
    problems = []
    maps = [(t, n) for t, e, n in unpark.events if e == "map"]
    unmaps = [(t, n) for t, e, n in park.events if e == "unmap"]
    if not maps or not unmaps:
        return ["nothing was mapped or unmapped"]
    if maps[0][0] >= unmaps[-1][0]:
        problems.append(f"the first map came {maps[0][0] - unmaps[-1][0]:.3f} s after the park's last unmap")
    held = 0
    for t, n in maps:
        held += n
        freed = sum(m for u, m in unmaps if u <= t)
        if held > room + freed:
            problems.append(f"at {t:.6f} the unpark held {held} bytes, past {room} free + {freed} freed")
    return problems


def results(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr[-4000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def serve(state: Path, crash_at: str = "") -> subprocess.Popen[bytes]:
    """``timesliced serve`` on ``state`` (one 24 MiB simulated GPU, no headroom); returns once it answers."""
    from timesliced.bench.common import answers

    cmd = [
        sys.executable, "-m", "timesliced", "serve", "--backend", "sim", "--web", "off", "--gpus", "1",
        "--gpu-memory", "24MiB", "--memory-headroom", "0", "--state-dir", str(state),
        "--socket", str(state / "timesliced.sock"), "--log-level", "INFO",
    ]  # fmt: skip
    env = {**os.environ, "TIMESLICED_CRASH_AT": crash_at}
    with open(state / "daemon.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while not answers(str(state / "timesliced.sock")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError((state / "daemon.log").read_text()[-3000:])
        time.sleep(0.05)
    return proc


class TracedJob:
    """An in-process job's executor: an ``Offloader`` over a paced, traced ``HostDeviceMemory``, its directives kept.

    ``directives`` holds what ``read_trace`` gives for a worker, so the same checks read it.
    """

    streams = True  # it forwards the streamed arguments to its Offloader

    def __init__(self, regions: int = 8, bandwidth: float = 100e6) -> None:
        from timesliced.client.offload import HostDeviceMemory, Offloader

        self.bandwidth = bandwidth
        self.directives: list[Directive] = []
        self._current: Directive | None = None
        self.memory = HostDeviceMemory(gpus=1, trace=self._note)
        self.off = Offloader(self.memory)
        self.regions = [self.off.alloc(REGION, tag="weights") for _ in range(regions)]

    def _note(self, event: str, gpu: int, nbytes: int) -> None:
        if self._current is not None:
            self._current.events.append((time.monotonic(), event, nbytes))

    def _traced(self, kind: str, move: Any, tags: Any, kw: dict[str, Any]) -> Any:
        self._current = Directive(kind, time.monotonic())
        self.memory.bandwidth = self.bandwidth
        try:
            return move(tags, **kw)
        finally:
            self.memory.bandwidth = None
            self._current.end = time.monotonic()
            self.directives.append(self._current)
            self._current = None

    def park(self, tags: Any = (), **kw: Any) -> Any:
        return self._traced("park", self.off.park, tags, kw)

    def unpark(self, tags: Any = (), **kw: Any) -> Any:
        return self._traced("unpark", self.off.unpark, tags, kw)
