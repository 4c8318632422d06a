"""The seam between the node agent and the ways of parking GPU state.

A *backend* parks and restores one job's device state. The daemon keeps one
backend per method (``sim``, ``cuda-checkpoint``, ``offload``, ``vllm``,
``sglang``); each job says at registration which method parks it, with the
method's options in a :class:`ParkSpec`. The daemon bounds every call with a
timeout; backends raise :class:`timesliced.errors.BackendError` (or another
``TimeslicedError``) when an operation fails and leave the job where it was:
a failed snapshot leaves it resident, a failed restore leaves it parked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..wire.park import ParkSpec


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as the scheduler sees it."""

    index: int
    capacity: int  # bytes
    name: str
    uuid: str = ""


@dataclass(frozen=True)
class JobTarget:
    """What a backend needs to know about the job it moves."""

    name: str
    gpus: tuple[int, ...]
    pids: tuple[int, ...]  # the job's registered processes on this node
    park: ParkSpec


@dataclass(frozen=True)
class MoveResult:
    """What one snapshot or restore moved and how long it took.

    ``footprint`` (gpu -> bytes) is the device memory the job holds when
    resident, where the backend could measure it; the scheduler plans with it.
    """

    nbytes: int
    seconds: float
    footprint: dict[int, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SwapResult:
    """How each half of a swap ended: a :class:`MoveResult`, or the error it failed with.

    ``park`` is the outgoing job's snapshot (its bytes went to the host), ``restore`` the incoming
    job's (its bytes went to the device). Each half's error follows the rules of a lone snapshot or
    restore: one that says the state is intact (``errors.state_intact``) left that job where it was.
    """

    park: MoveResult | Exception
    restore: MoveResult | Exception

    @property
    def to_host_gbps(self) -> float | None:
        return self.park.gbps if isinstance(self.park, MoveResult) else None

    @property
    def to_device_gbps(self) -> float | None:
        return self.restore.gbps if isinstance(self.restore, MoveResult) else None


class Swapper(Protocol):
    """A backend that can stream a park and a restore at once (optional; see ``daemon.moves.Mover.swap``)."""

    async def swap(self, out: JobTarget, in_: JobTarget) -> SwapResult:
        """Park ``out`` and restore ``in_`` at the same time, the restore taking the room the park frees.

        Both directions of the host link are used at once. Each job ends wholly resident or wholly
        parked (or faulted, as a lone move would leave it); a cancelled swap leaves each job as the
        backend's ``job_state`` then says. Raises only for misuse (``ValueError``) and for a swap that
        did not start (a ``StateIntact`` error: both jobs are where they were).
        """
        ...


def job_name(job: JobTarget | str) -> str:
    """Backends that keep their own records (sim) also take a bare job name."""
    return job if isinstance(job, str) else job.name


class Backend(Protocol):
    @property
    def name(self) -> str:
        """The method's name, as jobs ask for it (``sim``, ``offload``, ...)."""
        ...

    async def snapshot(self, job: JobTarget) -> MoveResult:
        """Copy ``job``'s device state to host memory and free its device memory."""
        ...

    async def restore(self, job: JobTarget) -> MoveResult:
        """Copy ``job``'s parked state back onto its devices."""
        ...

    async def reclaim(self, job: JobTarget) -> None:
        """Forget ``job``: free what the backend holds for it (parked copies, handles)."""
        ...

    async def aclose(self) -> None:
        """Release the backend's own resources (sessions, threads); parked state stays where it is."""
        ...


class GpuMemory(Protocol):
    """Live device memory figures, as the driver reports them (NVML on real GPUs)."""

    def free_bytes(self, gpu: int) -> int:
        """Free device memory on ``gpu`` now."""
        ...

    def process_memory(self) -> dict[int, dict[int, int]]:
        """pid -> {gpu -> bytes} for every process that holds device memory now."""
        ...
