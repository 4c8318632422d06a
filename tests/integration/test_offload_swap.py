"""Streamed offload swaps: real job processes, a real daemon, the room traced in the fake device memory.

Two jobs of 16 MiB on a 24 MiB GPU cannot both be resident, so every switch parks one and restores
the other. With streamed switches the daemon runs the pair as one swap: the outgoing job frees its
regions one by one and the incoming job maps each only once the daemon relayed room for it. The
traces (``tests/helpers/offload_swap.py``) show the incoming maps start before the outgoing park
ends and never hold more than was freed; with streamed switches off the same check fails.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.client_shells import SHELLS, shell_of
from ..helpers.daemon import serving
from ..helpers.offload_swap import TracedJob, read_trace, results, serve, spawn_worker, streaming_problems, swaps
from ..helpers.processes import wait_for

pytestmark = pytest.mark.slow

MiB = 1 << 20


def config(tmp_path: Path, **kw: Any) -> DaemonConfig:
    return DaemonConfig(
        state_dir=tmp_path / "state",
        backend="sim",
        gpus=1,
        gpu_memory=24 * MiB,
        memory_headroom=0,
        bandwidth=0,
        pid_poll_interval=0.1,
        **kw,
    )


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[EmbeddedDaemon]:
    with serving(config(tmp_path)) as d:
        yield d


def status(daemon: EmbeddedDaemon) -> dict[str, Any]:
    with timesliced.Client(job="observer", group="obs", address=daemon.socket) as c:
        return c.status()


@pytest.mark.parametrize("stream", [True, False])
def test_a_switch_streams_the_restore_into_the_room_the_park_frees(tmp_path: Path, stream: bool) -> None:
    with serving(config(tmp_path, stream_switches=stream)) as daemon:
        procs = [spawn_worker(name, daemon.socket, tmp_path / f"{name}.trace") for name in ("a", "b")]
        outs = results(procs)
        doc = status(daemon)
    assert [o["data_errors"] for o in outs] == [0, 0] and [o["failures"] for o in outs] == [[], []]
    a, b = read_trace(tmp_path / "a.trace"), read_trace(tmp_path / "b.trace")
    pairs = swaps(a, b) + swaps(b, a)
    if stream:
        assert len(pairs) >= 3, pairs  # a, b, a, b ...: every switch after the first park is a swap
        for park, unpark in pairs:
            assert streaming_problems(park, unpark) == []
        recent = [m for m in doc["moves"]["recent"] if m["swap_with"]]
        assert {m["direction"] for m in recent} == {"to_host", "to_device"}
        assert all(m["gbps"] > 0 for m in recent)
        assert all(j["median_to_host_gbps"] and j["median_to_device_gbps"] for j in doc["moves"]["jobs"].values())
    else:  # park, then restore: the check that passes above fails on every switch here
        restores = [d for d in a + b if d.kind == "unpark" and d.events]
        assert len(restores) >= 3
        for unpark in restores:
            park = next(d for d in a + b if d.kind == "park" and d.events and d.end <= unpark.start + 0.05)
            assert streaming_problems(park, unpark)
        assert not any(m["swap_with"] for m in doc["moves"]["recent"])


# --- failure rules -----------------------------------------------------------------------------------
# Every park after the first is one side of a swap; a job's memory calls count from its start: its
# allocation maps 8 regions, each park copies and unmaps 8, each unpark maps 8. Each worker ends with
# one more turn that checks its bytes: a job that turn was granted to was not left faulted (the
# daemon may have forgotten the jobs by the time the test reads its status: their processes are gone).


def run_pair(tmp_path: Path, fault: dict[str, tuple[str, int]]) -> tuple[dict[str, Any], ...]:
    with serving(config(tmp_path)) as daemon:
        procs = [
            spawn_worker(name, daemon.socket, tmp_path / f"{name}.trace", fault=fault.get(name)) for name in ("a", "b")
        ]
        outs = results(procs)
        doc = status(daemon)
    return outs[0], outs[1], doc


def test_a_park_that_fails_after_passing_room_on_is_finished_and_the_restore_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, _ = run_pair(tmp_path, {"a": ("unmap", 10)})  # its second park: one region freed and passed on
    assert [a["data_errors"], b["data_errors"]] == [0, 0]
    assert [a["failures"], b["failures"]] == [[], []]  # every turn granted, the last ones too
    assert "finishing the park" in caplog.text and "injected failure of unmap #10" in caplog.text


def test_a_park_that_fails_before_passing_room_on_is_undone_and_the_restore_called_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, _ = run_pair(tmp_path, {"a": ("copy_to_host", 9)})  # its second park's first copy: nothing freed
    assert [a["data_errors"], b["data_errors"]] == [0, 0]
    assert a["failures"] == []  # a ran on, resident, and its last turn found its bytes
    first = b["failures"][0]
    assert "was called off" in first and "could not be parked" in first and "copy_to_host #9" in first
    assert "intact in host memory" in first
    assert "every process undid its part, so the job runs on, resident" in caplog.text


def test_a_restore_that_fails_is_undone_while_the_park_goes_on(tmp_path: Path) -> None:
    a, b, doc = run_pair(tmp_path, {"b": ("map", 9)})  # its first unpark's first map
    assert [a["data_errors"], b["data_errors"]] == [0, 0]
    assert a["failures"] == []
    assert len(b["failures"]) == 1 and "injected failure of map #9" in b["failures"][0]  # its last turn was granted
    assert "intact in host memory" in b["failures"][0]
    snapshots = [m for m in doc["moves"]["recent"] if m["kind"] == "snapshot" and m["job"] == "a" and m["swap_with"]]
    assert snapshots  # a's side of the failed swap stood


def mid_park(trace: Path) -> bool:
    """The job is part way through a park that frees room (a swap's outgoing side)."""
    if not trace.exists():
        return False
    lines = trace.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.split()[1] == "park-start"]
    if len(starts) < 2:  # the first park may be a lone one
        return False
    tail = [line.split()[1] for line in lines[starts[-1] :]]
    return "park-end" not in tail and tail.count("unmap") >= 2


def test_a_process_killed_mid_swap_faults_its_job_and_the_other_is_restored(tmp_path: Path) -> None:
    with serving(config(tmp_path)) as daemon:
        procs = [
            spawn_worker(name, daemon.socket, tmp_path / f"{name}.trace", rounds=4, bandwidth=10e6)
            for name in ("a", "b")
        ]
        try:
            wait_for(lambda: mid_park(tmp_path / "a.trace"), timeout=60, interval=0.005)
        finally:
            procs[0].kill()
        procs[0].communicate(timeout=10)
        for stage in ("finished", "checked"):  # the barriers of the job that is gone
            (tmp_path / f"a.{stage}").touch()
        (b,) = results(procs[1:])
        doc = status(daemon)
    assert b["data_errors"] == 0 and b["failures"] == []
    assert b["resident"] == {"0": 16 * MiB}
    assert all(j["job"] != "a" or j["faulted"] for j in doc["jobs"])  # faulted, or forgotten once seen gone


@pytest.mark.parametrize("point", ["before-restore", "mid-restore"])
def test_a_daemon_killed_mid_swap_loses_no_byte(tmp_path: Path, point: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    daemon = serve(state, crash_at=point)
    socket = str(state / "timesliced.sock")
    procs = [spawn_worker(name, socket, tmp_path / f"{name}.trace", rounds=3, bandwidth=10e6) for name in "ab"]
    try:
        assert daemon.wait(60) == -9  # killed as the first swap ran
        daemon = serve(state)  # the same state: it takes both jobs up and the clients reconnect
        a, b = results(procs, timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
        daemon.terminate()
        daemon.wait(10)
    assert [a["data_errors"], b["data_errors"]] == [0, 0], (a, b)
    assert all(f.startswith("lost: ") for f in a["failures"] + b["failures"]), (a, b)
    log = (state / "daemon.log").read_text()
    assert f"crash point {point}" in log  # the first restore is the first swap: the daemon died as it began or in it
    assert "took up job 'a' from the last run: parked" in log and "took up job 'b' from the last run: parked" in log
    assert "swapped with" in log.split("crash point")[1]  # and swaps went on after the restart


@pytest.mark.parametrize("kind", SHELLS)
def test_both_client_shells_stream_a_swap(tmp_path: Path, kind: str) -> None:
    """The same swap in this process, each job on the shell under test: the async one relays from its loop."""
    out, in_ = TracedJob(), TracedJob()
    with serving(config(tmp_path)) as daemon, shell_of(kind) as shell:
        a = shell.client(daemon.socket, "a", park="offload", offloader=out, memory=16 * MiB, connect=True)
        b = shell.client(daemon.socket, "b", park="offload", offloader=in_, memory=16 * MiB, connect=True)
        a.acquire(timeout=10)  # b is parked for it
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(b.acquire(timeout=30)))
        waiter.start()
        wait_for(lambda: len(next(g for g in a.status()["groups"] if g["group"] == "g")["queue"]) == 1)
        a.release()
        waiter.join(30)
        assert got and got[0].restored
        b.release()
    pairs = swaps(out.directives, in_.directives)
    assert len(pairs) == 1 and streaming_problems(*pairs[0]) == []
