"""The daemon's shell for a swap: streamed through a backend that can, snapshot-then-restore otherwise."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest

from timesliced import errors
from timesliced.backends.base import JobTarget, MoveResult
from timesliced.cluster.effects import RunMove
from timesliced.daemon.crash import CrashPoints
from timesliced.daemon.moves import Mover
from timesliced.sim.region import SimRegion
from timesliced.telemetry import MoveLog
from timesliced.wire.park import ParkSpec

from ..helpers.sims import PAGE, Sims


class NoSwap:
    """A backend without ``swap``: the sim's snapshot and restore only."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.calls = inner, "plain", []

    async def snapshot(self, job: JobTarget) -> MoveResult:
        self.calls.append(("snapshot", job.name))
        result: MoveResult = await self.inner.snapshot(job)
        return result

    async def restore(self, job: JobTarget) -> MoveResult:
        self.calls.append(("restore", job.name))
        result: MoveResult = await self.inner.restore(job)
        return result


def mover(backend: Any, op_timeout: float = 30.0) -> tuple[Mover, MoveLog, list[tuple[Any, ...]]]:
    log = MoveLog()
    observed: list[tuple[Any, ...]] = []
    metrics = SimpleNamespace(observe_move=lambda *a: observed.append(a))
    parking = SimpleNamespace(backend=lambda method: backend)
    jobs = SimpleNamespace(measured={}, forget=lambda job: None)
    m = Mover(
        parking,  # type: ignore[arg-type]
        jobs,  # type: ignore[arg-type]
        op_timeout=op_timeout,
        crash=CrashPoints({}),
        log_of_moves=log,
        metrics=metrics,  # type: ignore[arg-type]
        history=SimpleNamespace(record=lambda *a, **k: None),  # type: ignore[arg-type]
        clock=lambda: 5.0,
    )
    return m, log, observed


def target(job: str) -> JobTarget:
    return JobTarget(job, (0,), (), ParkSpec("sim"))


def setup(sims: Sims, **settings: Any) -> tuple[Any, bytes]:
    """gpu 0 of 32 pages: "a" (20 pages) resident, "b" (24 pages) parked: b needs a's room."""
    b = sims.backend(**settings)
    data = random.Random(1).randbytes(24 * PAGE)
    info = b.alloc("b", 0, len(data))
    sims.open(info).write(data)
    asyncio.run(b.snapshot("b"))
    b.alloc("a", 0, 20 * PAGE)
    return b, data


def run_swap(m: Mover) -> dict[tuple[int, int, int], tuple[Any, ...]]:
    heard: dict[tuple[int, int, int], tuple[Any, ...]] = {}

    def finished(key: tuple[int, int, int], *rest: Any) -> None:
        assert key not in heard  # exactly once each
        heard[key] = rest

    asyncio.run(m.swap(RunMove((1, 1, 1), "snapshot", "a"), RunMove((1, 1, 2), "restore", "b"), target, finished))
    return heard


def test_a_swap_streams_through_a_backend_that_can(sims: Sims) -> None:
    b, data = setup(sims)
    m, log, observed = mover(b)
    heard = run_swap(m)
    assert heard[(1, 1, 1)][:2] == (True, 20 * PAGE) and heard[(1, 1, 2)][:2] == (True, 24 * PAGE)
    with SimRegion.open(b.regions("b")[0]) as region:
        assert region.read() == data
    park, restore = log.recent()
    assert (park.job, park.kind.value, park.swap_with) == ("a", "snapshot", "b")
    assert (restore.job, restore.kind.value, restore.swap_with) == ("b", "restore", "a")
    assert restore.to_dict()["direction"] == "to_device" and [o[0] for o in observed] == ["snapshot", "restore"]


def test_a_backend_without_swap_moves_one_after_the_other(sims: Sims) -> None:
    b, _ = setup(sims)
    plain = NoSwap(b)
    m, log, _ = mover(plain)
    heard = run_swap(m)
    assert plain.calls == [("snapshot", "a"), ("restore", "b")]
    assert heard[(1, 1, 1)][0] and heard[(1, 1, 2)][0] and all(r.swap_with is None for r in log.recent())


def test_each_half_of_a_swap_hears_its_own_failure(sims: Sims) -> None:
    b, _ = setup(sims)
    b.alloc("c", 0, 9 * PAGE)  # b no longer fits even once a is parked: nothing moves
    m, log, _ = mover(b)
    heard = run_swap(m)
    for key in ((1, 1, 1), (1, 1, 2)):
        ok, _, _, reason, intact, code = heard[key]
        assert not ok and intact and code == errors.RestoreRefused.code and "both jobs stay" in reason
    assert log.recent() == [] and b.job_state("a") == "resident"


def test_a_swap_past_the_op_timeout_fails_both_halves_as_unknown(sims: Sims) -> None:
    b, _ = setup(sims, bandwidth=2e6)  # 1.3 MB each way: about 0.65 s
    m, _, _ = mover(b, op_timeout=0.05)
    heard = run_swap(m)
    assert len(heard) == 2 and all(
        not ok and not intact and "timed out" in why for ok, _, _, why, intact, _ in heard.values()
    )
    asyncio.run(b.reclaim("a"))  # waits for the worker to wind up


def test_a_swap_is_a_snapshot_and_a_restore(sims: Sims) -> None:
    m, _, _ = mover(sims.backend())
    with pytest.raises(ValueError, match="a snapshot and a restore"):
        asyncio.run(m.swap(RunMove((1, 1, 1), "restore", "a"), RunMove((1, 1, 2), "snapshot", "b"), target, print))


def test_a_swap_whose_park_could_not_start_refuses_its_restore_with_the_same_cause() -> None:
    from timesliced.daemon.moves import _needed_room

    short = _needed_room("a", errors.InsufficientHostMemory("no room for the parked copy of job 'a'"))
    assert isinstance(short, errors.InsufficientHostMemory) and errors.state_intact(short)
    assert "job 'a', whose room it streams into, could not be parked (no room" in short.message
    refused = _needed_room("a", errors.ParkRefused("the engine said no"))
    assert type(refused) is errors.RestoreRefused and "the engine said no" in refused.message
    unknown = TimeoutError()
    assert _needed_room("a", unknown) is unknown  # not refused: the swap's own failure, state unknown
