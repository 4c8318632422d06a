"""Streamed offload swaps: real job processes, a real daemon, the room traced in the fake device memory.

Two jobs of 16 MiB on a 24 MiB GPU cannot both be resident, so every switch parks one and restores
the other. With streamed switches the daemon runs the pair as one swap: the outgoing job frees its
regions one by one and the incoming job maps each only once the daemon relayed room for it. The
traces (``tests/helpers/offload_swap.py``) show the incoming maps start before the outgoing park
ends and never hold more than was freed; with streamed switches off the same check fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.daemon import serving
from ..helpers.offload_swap import read_trace, results, spawn_worker, streaming_problems, swaps

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


def job(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(j for j in doc["jobs"] if j["job"] == name)


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
