"""Telemetry as the daemon uses it: a GPU source, its sampler and the record of each GPU, put together."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from ..nvml import GpuSample, Nvml
from ..wire import status
from .duty import DutyWindow
from .gpus import GpuRecord
from .sampler import Sampler, SamplingLog
from .sources import GpuSource, SimGpuSource, SourceKind


class Telemetry:
    """Samples GPU figures every ``interval`` seconds and keeps duty windows per GPU.

    ``source`` is an :class:`~timesliced.nvml.Nvml` (real GPUs), a
    :class:`SimGpuSource`, or ``None``. An ``Nvml`` that is not available makes the
    source ``"none"`` with its reason. Telemetry does not close the ``Nvml``: its
    owner does, after :meth:`run` has ended.

    ``window`` is the span of ``duty_window`` in :meth:`describe`; windows keep
    ``history`` seconds. ``clock`` gives ``now`` for samples and for calls that
    leave it out; it must be the clock of the ``now`` values the daemon passes.

    The parts: ``source`` (a :class:`GpuSource`), ``gpus`` (the :class:`GpuRecord`
    of samples and windows), ``sampler`` (the loop) and ``trouble`` (its failures).
    """

    def __init__(
        self,
        source: Nvml | SimGpuSource | None = None,
        *,
        interval: float = 1.0,
        window: float = 60.0,
        history: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, not {interval}")
        if not window > 0:
            raise ValueError(f"window must be positive, not {window}")
        if history < window:
            raise ValueError(f"history ({history}) must be at least window ({window})")
        self.interval = interval
        self.window = window
        self.history = history
        self.clock = clock
        self.source = GpuSource.of(source)
        self.gpus = GpuRecord(
            self.source.devices,
            history=history,
            # Sampled sources may report a duty 2 samples apart after a stall; allow a few intervals.
            max_gap=max(5.0, 3 * interval),
            utilization_duty=self.source.kind is SourceKind.NVML,
        )
        self.trouble = SamplingLog(interval)
        self.sampler = Sampler(self.source, self.ingest, self.trouble, interval=interval, clock=clock)

    # --- running -----------------------------------------------------------------------

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled; returns at once without a source.

        A failing sample is logged (once per distinct error) and retried at the next
        tick; the previous figures stay in place, and :meth:`describe` shows the error.
        """
        await self.sampler.run()

    async def refresh(self) -> list[GpuSample]:
        """Take one sample now, feed it to the windows and return it. Raises what the source raised."""
        return await self.sampler.refresh()

    def ingest(self, samples: Sequence[GpuSample], now: float) -> None:
        """Take ``samples`` taken at ``now`` as the latest figures and feed them to the windows."""
        for problem in self.gpus.ingest(samples, now):
            self.trouble.warn_once(problem)
        self.trouble.succeeded()

    # --- simulated GPUs ----------------------------------------------------------------

    def record_busy(self, gpu: int, busy: bool, now: float | None = None) -> None:
        """Simulated GPUs: whether a lock holder holds ``gpu`` from ``now`` on.

        ``busy`` is whether *any* holder holds the GPU (when groups share a GPU, pass
        the OR). Repeating the current state is free, so the daemon may call this
        after every scheduler step. Ignored unless the source is ``"sim"``: real GPUs'
        duty comes from the driver. Raises ``ValueError`` for a GPU the source lacks.
        """
        if self.source.kind is SourceKind.SIM:
            self.gpus.set_busy(gpu, busy, self.clock() if now is None else now)

    def record_held(self, held: Collection[int], now: float | None = None) -> None:
        """Simulated GPUs: exactly the GPUs in ``held`` are held by a lock holder now."""
        if self.source.kind is SourceKind.SIM:
            self.gpus.set_held(held, self.clock() if now is None else now)

    # --- reading -----------------------------------------------------------------------

    @property
    def latest(self) -> dict[int, GpuSample]:
        """The latest sample of each GPU, by index."""
        return self.gpus.latest

    @property
    def error(self) -> str | None:
        """Why the latest sample failed; None once one succeeds."""
        return self.trouble.error

    def duty(self, gpu: int) -> DutyWindow:
        """The window of ``gpu`` (``KeyError`` if unknown)."""
        return self.gpus.window(gpu)

    def describe(self, now: float | None = None) -> status.Telemetry:
        """Plain data for the daemon's status and the dashboard (JSON- and msgpack-safe: string keys)."""
        t = self.clock() if now is None else now
        sampled_at = self.gpus.sampled_at
        return {
            "source": self.source.kind.value,
            "reason": self.source.reason or None,
            "driver": self.source.driver,
            "cuda": self.source.cuda,
            "interval_s": self.interval,
            "age_s": t - sampled_at if sampled_at is not None else None,
            "error": self.trouble.error,
            "gpus": self.gpus.describe(t, self.window),
        }
