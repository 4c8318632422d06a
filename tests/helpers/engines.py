"""What the engine backend tests share: started fakes with a backend, job targets, waiting and raising."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

from tests.fakes.engines import FakeEngine
from timesliced import errors
from timesliced.backends.base import JobTarget
from timesliced.backends.engines import EngineBackend, VllmBackend
from timesliced.wire.park import ParkSpec

T = TypeVar("T")
F = TypeVar("F", bound=FakeEngine)

SLEEP = "/sleep?level=1&mode=wait"  # what parking a vLLM job at level 1 sends first
SGLANG_PARK = ["/pause_generation", "/flush_cache", "/release_memory_occupation"]
SGLANG_UNPARK = ["/resume_memory_occupation", "/continue_generation"]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def rig(
    fake: Callable[[], F], n: int = 1, backend: type[EngineBackend] = VllmBackend, **settings: Any
) -> AsyncIterator[tuple[EngineBackend, list[F]]]:
    """``n`` started fakes and a backend, all stopped and closed at the end."""
    fakes = [fake() for _ in range(n)]
    b = backend(**settings)
    try:
        for f in fakes:
            await f.start()
        yield b, fakes
    finally:
        await b.aclose()
        for f in fakes:
            await f.stop()


def target(
    fakes: list[Any],
    method: str = "vllm",
    *,
    tags: tuple[str, ...] = (),
    level: int = 1,
    reloads_weights: bool = False,
    **kw: Any,
) -> JobTarget:
    return JobTarget(
        kw.get("name", "j"),
        kw.get("gpus", (0,)),
        kw.get("pids", ()),
        ParkSpec(method, tuple(f.url for f in fakes), tags, level, reloads_weights),
    )


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a condition the test drives towards; the bound only keeps a broken test from hanging."""

    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


async def raises(
    cls: type[errors.TimeslicedError], aw: Awaitable[Any], match: str | None = None
) -> errors.TimeslicedError:
    with pytest.raises(cls, match=match) as info:
        await aw
    return info.value


async def refused(
    cause: type[errors.TimeslicedError], aw: Awaitable[Any], match: str | None = None
) -> errors.TimeslicedError:
    """A move that failed with ``cause`` (the replicas' error) and left every replica where it began."""
    err = await raises(errors.BackendError, aw, match)
    assert errors.state_intact(err), f"the move faults the job, it was not refused: {err!r}"
    assert isinstance(err, errors.ParkRefused | errors.RestoreRefused) and err.details["cause"] == cause.code
    return err
