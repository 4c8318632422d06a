"""The seam between the node agent and a way of parking GPU state.

The node agent drives every backend through this interface and bounds every
call with a timeout; backends raise ``timesliced.errors.BackendError`` (or a
subclass of ``TimeslicedError``) when an operation fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as the scheduler sees it."""

    index: int
    capacity: int  # bytes
    name: str


@dataclass(frozen=True)
class MoveResult:
    """What one snapshot or restore moved and how long it took."""

    nbytes: int
    seconds: float


class Backend(Protocol):
    name: str

    def devices(self) -> list[DeviceInfo]:
        """The devices this backend manages, in index order."""
        ...

    async def snapshot(self, job: str) -> MoveResult:
        """Copy ``job``'s device state to host memory and free its device memory."""
        ...

    async def restore(self, job: str) -> MoveResult:
        """Copy ``job``'s parked state back onto its devices."""
        ...

    async def reclaim(self, job: str) -> None:
        """Forget ``job``: free its device memory and drop any parked state."""
        ...

    def close(self) -> None:
        """Release the backend's own resources; parked state stays where it is."""
        ...
