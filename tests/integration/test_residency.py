"""Co-residency end to end: a real daemon, real sim clients that declare their memory (``memory=``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.daemon import serving

MiB = 1 << 20


@contextmanager
def started(tmp_path: Path, **kw: Any) -> Iterator[EmbeddedDaemon]:
    """A daemon on one 64 MiB simulated GPU for the block; its simulated GPU's files go with it."""
    config = DaemonConfig(
        state_dir=tmp_path / "state",
        backend="sim",
        gpus=1,
        gpu_memory=64 * MiB,
        bandwidth=0,
        pid_poll_interval=0.1,
        memory_headroom=4 * MiB,
        **kw,
    )
    with serving(config) as daemon:
        yield daemon


def hand_off(daemon: EmbeddedDaemon) -> tuple[Any, Any, dict[str, Any]]:
    """a holds with 8 MiB, b waits with 8 MiB; a yields. Returns b's grant, then a's again, and the status."""
    with (
        timesliced.Client(job="a", group="g", address=daemon.socket, memory="8MiB") as a,
        timesliced.Client(job="b", group="g", address=daemon.socket, memory={0: 8 * MiB}) as b,
    ):
        a.acquire()
        a.sim_alloc(8 * MiB)
        a.release()
        b.acquire()
        b.sim_alloc(8 * MiB)
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(a.acquire(timeout=10)))
        waiter.start()
        b.release()
        waiter.join(10)
        (a_grant,) = got
        st = a.status()
        a.release()
        return b, a_grant, st


def test_two_declared_jobs_hand_off_without_moving(tmp_path: Path) -> None:
    with started(tmp_path) as daemon:
        _, grant, st = hand_off(daemon)
        assert grant.restored is False  # b's memory and a's fit together: nothing moved
        jobs = {j["job"]: j for j in st["jobs"]}
        assert {j["location"] for j in jobs.values()} == {"resident"}
        assert sum(j["bytes_moved"] for j in jobs.values()) == 0
        assert jobs["a"]["declared"] == {"0": 8 * MiB} and jobs["b"]["declared"] == {"0": 8 * MiB}
        assert jobs["a"]["over_declared_bytes"] == 0


def test_park_every_handoff_parks_even_when_both_fit(tmp_path: Path) -> None:
    """The comparison mode: the same workload moves at every handoff (so the test above can fail)."""
    with started(tmp_path, park_every_handoff=True) as daemon:
        _, grant, st = hand_off(daemon)
        assert grant.restored is True
        assert sum(j["bytes_moved"] for j in st["jobs"]) > 0


def test_a_wrong_declaration_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with started(tmp_path) as daemon:
        with pytest.raises(ValueError, match="size"):
            timesliced.Client(job="a", group="g", address=daemon.socket, memory="lots")
        c = timesliced.Client(job="a", group="g", address=daemon.socket, memory={3: "1GiB"})
        with pytest.raises(errors.BadRequest, match="GPU 3"):
            c.connect()
        c.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_switch_that_needs_the_outgoing_jobs_room_swaps_both_ways_at_once(tmp_path: Path, stream: bool) -> None:
    """Two 40 MiB sim jobs on a 64 MiB GPU: each handoff parks one to restore the other, in one swap."""
    with started(tmp_path, stream_switches=stream) as daemon:
        with (
            timesliced.Client(job="a", group="g", address=daemon.socket) as a,
            timesliced.Client(job="b", group="g", address=daemon.socket) as b,
        ):
            regions, sums = {}, {}
            for name, client in (("a", a), ("b", b)):  # b's first grant parks a: a snapshot alone
                client.acquire(timeout=10)
                regions[name] = client.sim_alloc(40 * MiB)
                regions[name].fill(name.encode())
                sums[name] = regions[name].checksum()
                client.release()
            grant = a.acquire(timeout=10)  # park b, restore a: the pair streams
            assert grant.restored and regions["a"].checksum() == sums["a"]
            a.release()
            recent = a.status()["moves"]["recent"]
        swapped = [(r["job"], r["kind"], r["swap_with"]) for r in recent if r["swap_with"]]
        if stream:
            assert sorted(swapped) == [("a", "restore", "b"), ("b", "snapshot", "a")]
            assert {r["direction"] for r in recent if r["swap_with"]} == {"to_host", "to_device"}
        else:
            assert swapped == []  # the same switch as a snapshot, then a restore
