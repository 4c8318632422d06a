"""What telemetry knows of each GPU: its latest sample and its duty window (pure: every call takes ``now``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..backends.base import DeviceInfo
from ..nvml import GpuSample
from ..wire import status
from .duty import DutyWindow


class GpuRecord:
    """The latest sample of each GPU, and a :class:`DutyWindow` per GPU.

    Duty comes one of two ways, chosen at construction: from the samples'
    utilization (``utilization_duty``: real GPUs), or from the busy / idle
    transitions the caller reports with :meth:`set_busy` / :meth:`set_held`
    (simulated GPUs, whose duty is lock-holding time).

    Invariant: every GPU among ``devices`` or in ``latest`` has a window; a GPU
    that a sample reports without being among ``devices`` gets one when first seen.
    """

    def __init__(
        self,
        devices: Sequence[DeviceInfo] = (),
        *,
        history: float = 600.0,
        max_gap: float = 5.0,
        utilization_duty: bool = False,
    ) -> None:
        self.devices: dict[int, DeviceInfo] = {d.index: d for d in devices}
        self.history = history
        self.max_gap = max_gap
        self.utilization_duty = utilization_duty
        self._windows = {i: DutyWindow(history=history, max_gap=max_gap) for i in self.devices}
        self.latest: dict[int, GpuSample] = {}
        self.sampled_at: float | None = None

    # --- inputs ------------------------------------------------------------------------

    def ingest(self, samples: Sequence[GpuSample], now: float) -> list[str]:
        """Take ``samples`` taken at ``now`` as the latest figures and feed them to the windows.

        Returns the problems the samples report, one line per query that failed
        (``"GPU 1: utilization: Not Supported"``). Raises ``ValueError`` when
        ``now`` is before the previous sample's time.
        """
        problems: list[str] = []
        for s in samples:
            w = self._window(s.index)
            if s.memory_used is not None:
                w.set_memory(s.memory_used, now)
            if s.utilization_gpu is not None and self.utilization_duty:
                # NVML reports whole percents; clamp in case a driver strays outside 0..100.
                w.observe(min(max(s.utilization_gpu, 0), 100) / 100, now)
            problems.extend(f"GPU {s.index}: {problem}" for problem in s.errors)
        self.latest = {s.index: s for s in samples}
        self.sampled_at = now
        return problems

    def set_busy(self, gpu: int, busy: bool, now: float) -> None:
        """Whether a lock holder holds ``gpu`` from ``now`` on; repeating the current state is free.

        Raises ``ValueError`` for a GPU the record lacks.
        """
        w = self._windows.get(gpu)
        if w is None:
            raise ValueError(f"no simulated GPU {gpu}")
        # The daemon's ``now`` and the clock of telemetry may be read a hair apart (some event
        # loops cache their time per pass); a transition never moves the record backwards.
        w.set_busy(busy, now if w.fed_at is None else max(now, w.fed_at))

    def set_held(self, held: Collection[int], now: float) -> None:
        """Exactly the GPUs in ``held`` are held by a lock holder from ``now`` on."""
        for gpu in self._windows:
            self.set_busy(gpu, gpu in held, now)

    # --- reading -----------------------------------------------------------------------

    def window(self, gpu: int) -> DutyWindow:
        """The window of ``gpu`` (``KeyError`` if unknown)."""
        return self._windows[gpu]

    def describe(self, now: float, window: float) -> list[status.GpuTelemetry]:
        """Plain data per GPU, by index, with the mean duty over ``window`` seconds (string keys only)."""
        gpus: list[status.GpuTelemetry] = []
        for index in sorted(set(self.devices) | set(self.latest)):
            info = self.devices.get(index)
            s = self.latest.get(index)
            w = self._windows[index]
            gpus.append(
                {
                    "index": index,
                    "name": s.name if s else (info.name if info else ""),
                    "uuid": s.uuid if s else (info.uuid if info else ""),
                    "memory_total": s.memory_total if s else (info.capacity if info else None),
                    "memory_used": s.memory_used if s else None,
                    "memory_free": s.memory_free if s else None,
                    "utilization_gpu": s.utilization_gpu if s else None,
                    "utilization_memory": s.utilization_memory if s else None,
                    "duty_now": w.duty_now(now),
                    "duty_window": w.mean_duty(now, window),
                    "window_s": window,
                    "processes": {str(pid): n for pid, n in sorted(s.processes.items())} if s else {},
                    "errors": list(s.errors) if s else [],
                }
            )
        return gpus

    # --- internals ---------------------------------------------------------------------

    def _window(self, gpu: int) -> DutyWindow:
        w = self._windows.get(gpu)
        if w is None:
            w = self._windows[gpu] = DutyWindow(history=self.history, max_gap=self.max_gap)
        return w
