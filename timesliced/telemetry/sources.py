"""Where GPU figures come from: NVML on real GPUs, the daemon's own figures on simulated ones.

:class:`GpuSource` is what the rest of telemetry sees of either, resolved once when
telemetry is built: its kind, why there is none, the devices, the driver's versions,
and how to take one sample.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..backends.base import DeviceInfo
from ..nvml import GpuSample, Nvml


class SourceKind(enum.Enum):
    NVML = "nvml"  # real GPUs: duty is NVML's utilization
    SIM = "sim"  # simulated GPUs: duty is lock-holding time, reported by the daemon
    NONE = "none"  # nothing to sample (``GpuSource.reason`` says why)


@dataclass(frozen=True)
class SimGpuSource:
    """The figures of simulated GPUs, which only the daemon knows.

    ``memory_used(gpu)`` returns the bytes allocated on ``gpu`` now (for the sim
    backend: capacity minus ``free_bytes(gpu)``); ``processes(gpu)``, if given,
    returns pid -> bytes on it. Both are called on the event loop (they read the
    daemon's own state), never in a thread, and must not block.

    Utilization is not simulated: the sim duty cycle is lock-holding time, fed
    through :meth:`Telemetry.record_held` / :meth:`Telemetry.record_busy`.
    """

    devices: tuple[DeviceInfo, ...]
    memory_used: Callable[[int], int]
    processes: Callable[[int], Mapping[int, int]] | None = None

    def sample(self) -> list[GpuSample]:
        out = []
        for d in self.devices:
            used = int(self.memory_used(d.index))
            procs = dict(self.processes(d.index)) if self.processes is not None else {}
            out.append(
                GpuSample(
                    index=d.index,
                    name=d.name,
                    uuid=d.uuid,
                    memory_total=d.capacity,
                    memory_used=used,
                    memory_free=max(d.capacity - used, 0),
                    utilization_gpu=None,
                    utilization_memory=None,
                    processes=procs,
                )
            )
        return out


@dataclass(frozen=True)
class GpuSource:
    """A source of GPU samples, resolved: build it with :meth:`of`.

    ``sample`` is None exactly when ``kind`` is ``NONE``. ``blocking``: ``sample``
    calls into a C library (NVML), so async code runs it in a worker thread.
    """

    kind: SourceKind
    reason: str = ""  # why the kind is NONE
    devices: tuple[DeviceInfo, ...] = ()
    driver: str | None = None  # the driver's version, as NVML reports it
    cuda: str | None = None  # the CUDA version the driver supports ("12.8")
    sample: Callable[[], list[GpuSample]] | None = None
    blocking: bool = False

    @classmethod
    def of(cls, source: Nvml | SimGpuSource | None) -> GpuSource:
        """An open :class:`~timesliced.nvml.Nvml`, a :class:`SimGpuSource`, or nothing.

        An ``Nvml`` that is not available is kind ``NONE`` with its reason. The
        ``Nvml`` stays its owner's to close; once closed, its samples are empty.
        """
        if isinstance(source, Nvml):
            if not source.available:
                return cls(SourceKind.NONE, source.reason)
            return cls(
                SourceKind.NVML,
                devices=tuple(source.devices()),
                driver=source.driver_version or None,
                cuda=source.cuda_version or None,
                sample=source.sample,
                blocking=True,
            )
        if isinstance(source, SimGpuSource):
            return cls(SourceKind.SIM, devices=source.devices, sample=source.sample)
        return cls(SourceKind.NONE, "no GPU source")
