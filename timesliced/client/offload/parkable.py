"""What every offload executor is: the :class:`Parkable` protocol and the figures of a move, :class:`MoveStats`.

An executor parks and unparks the memory a workload registered with it, by
tag: :class:`~.regions.Offloader` raw device regions,
:class:`~.torch_state.TorchOffload` torch tensors, and
:class:`~.combined.CombinedOffload` several of them as one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol


def add_per_gpu(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    """Bytes per GPU of ``a`` and ``b`` together."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


@dataclass
class MoveStats:
    """What one park or unpark did.

    ``nbytes`` were copied in ``copy_seconds`` (issue of the first copy to
    the end of the last), ``seconds`` is the whole operation (host buffer
    allocation, unmapping, verification included). ``regions`` moved
    (regions, or torch storages), ``skipped`` were already where they were
    asked to go. ``per_gpu``: bytes moved per GPU; ``resident``: device bytes
    the executor holds per GPU after the operation; ``footprint``: what it
    holds when everything is resident. GPUs are the node's numbers (NVML
    indices, the daemon's), not the process's CUDA ordinals
    (:mod:`timesliced.client.gpus`).
    """

    op: str
    nbytes: int = 0
    seconds: float = 0.0
    copy_seconds: float = 0.0
    regions: int = 0
    skipped: int = 0
    verified: bool = False
    per_gpu: dict[int, int] = field(default_factory=dict)
    resident: dict[int, int] = field(default_factory=dict)
    footprint: dict[int, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Achieved copy bandwidth in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    def merged(self, other: MoveStats) -> MoveStats:
        """The figures of two executors that ran the same directive one after the other."""
        if other.op != self.op:
            raise ValueError(f"cannot merge {self.op} and {other.op} figures")
        return MoveStats(
            op=self.op,
            nbytes=self.nbytes + other.nbytes,
            seconds=self.seconds + other.seconds,
            copy_seconds=self.copy_seconds + other.copy_seconds,
            regions=self.regions + other.regions,
            skipped=self.skipped + other.skipped,
            verified=self.verified and other.verified,
            per_gpu=add_per_gpu(self.per_gpu, other.per_gpu),
            resident=add_per_gpu(self.resident, other.resident),
            footprint=add_per_gpu(self.footprint, other.footprint),
        )

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack-able data (GPU indices as string keys)."""

        def gpus(d: dict[int, int]) -> dict[str, int]:
            return {str(k): v for k, v in sorted(d.items())}

        return {
            "op": self.op,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
            "copy_seconds": self.copy_seconds,
            "gbps": self.gbps,
            "regions": self.regions,
            "skipped": self.skipped,
            "verified": self.verified,
            "per_gpu": gpus(self.per_gpu),
            "resident": gpus(self.resident),
            "footprint": gpus(self.footprint),
        }


class Parkable(Protocol):
    """An in-process executor of park / unpark directives (``Offloader``, ``TorchOffload``)."""

    def tags(self) -> set[str]:
        """The tags that have something registered."""
        ...

    def park(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        """Copy the tagged memory (all if ``tags`` is empty) to host and free it on the device."""
        ...

    def unpark(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        """Bring parked tagged memory (all if ``tags`` is empty) back onto the device."""
        ...

    def footprint(self) -> dict[int, int]:
        """Device bytes per GPU when everything is resident."""
        ...

    def resident(self) -> dict[int, int]:
        """Device bytes per GPU held now."""
        ...


def tag_set(tags: Iterable[str]) -> set[str]:
    """``tags`` as a set; a lone string is one tag, not its characters."""
    return {tags} if isinstance(tags, str) else set(tags)
