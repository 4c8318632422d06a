"""The sampling loop: read a GPU source every ``interval`` seconds, off the event loop when it blocks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from ..nvml import GpuSample
from .sources import GpuSource

log = logging.getLogger(__name__)

_MAX_LOGGED = 256  # distinct messages remembered for log-once; beyond that they are logged again


class SamplingLog:
    """Trouble with sampling: why the latest sample failed, and warnings logged once each.

    Sampling retries every ``interval`` seconds, so trouble that lasts would log
    the same line at every tick: each distinct message is logged once instead.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.error: str | None = None  # why the latest sample failed; None once one succeeds
        self._logged: set[str] = set()

    def failed(self, exc: Exception) -> None:
        """A sample raised ``exc``: it is the ``error`` until a sample succeeds."""
        self.error = f"{exc.__class__.__name__}: {exc}"
        self.warn_once(f"GPU sampling failed: {self.error}", exc)

    def succeeded(self) -> None:
        """A sample came in: the error, if any, is over."""
        if self.error is not None:
            log.info("GPU sampling works again")
            self.error = None

    def warn_once(self, message: str, exc: Exception | None = None) -> None:
        if message in self._logged:
            return
        if len(self._logged) >= _MAX_LOGGED:
            self._logged.clear()
        self._logged.add(message)
        log.warning("%s (logged once; retrying every %.3gs)", message, self.interval, exc_info=exc)


class Sampler:
    """Reads ``source`` every ``interval`` seconds and hands each sample to ``ingest``.

    ``ingest(samples, now)`` gets the samples and the ``clock()`` time they came
    in. A blocking source (NVML) is read in a worker thread, so the event loop
    never waits on the driver; the simulated source is read on the loop.
    Failures go to ``trouble``.
    """

    def __init__(
        self,
        source: GpuSource,
        ingest: Callable[[Sequence[GpuSample], float], None],
        trouble: SamplingLog,
        *,
        interval: float,
        clock: Callable[[], float],
    ) -> None:
        self.source = source
        self.interval = interval
        self._ingest = ingest
        self._trouble = trouble
        self._clock = clock

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled; returns at once without a source.

        A failing sample is logged (once per distinct error) and retried at the
        next tick; the previous figures stay in place.
        """
        if self.source.sample is None:
            log.info("GPU telemetry is off: %s", self.source.reason)
            return
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a sampling failure never stops telemetry; cancellation passes
                self._trouble.failed(exc)
            next_at += self.interval
            now = loop.time()
            if next_at < now:  # a slow sample: skip the ticks it missed rather than catch up
                next_at = now + self.interval
            await asyncio.sleep(next_at - now)

    async def refresh(self) -> list[GpuSample]:
        """Take one sample now, hand it to ``ingest`` and return it; [] without a source.

        Raises what the source (or ``ingest``) raised.
        """
        read = self.source.sample
        if read is None:
            return []
        samples = await asyncio.to_thread(read) if self.source.blocking else read()
        self._ingest(samples, self._clock())
        return samples
