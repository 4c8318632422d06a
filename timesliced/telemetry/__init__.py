"""GPU telemetry: duty cycles, memory over time and the bytes each move of a job moved.

Parts that keep no clock (every call takes ``now``):

- :mod:`.duty`: :class:`DutyWindow`, one GPU's duty cycle and memory over a sliding window.
- :mod:`.gpus`: :class:`GpuRecord`, the latest sample and the duty window of every GPU.
- :mod:`.moves`: :class:`MoveLog`, the recent snapshots and restores, with per-job summaries.

The shell:

- :mod:`.sources`: :class:`GpuSource`, resolved from an open :class:`~timesliced.nvml.Nvml`
  (real GPUs: duty is NVML's utilization) or a :class:`SimGpuSource` (simulated GPUs:
  memory comes from the daemon's own figures, and duty is the fraction of time a lock
  holder held the GPU, which the daemon reports with :meth:`Telemetry.record_held`).
- :mod:`.sampler`: :class:`Sampler`, the asyncio loop that reads the source every
  ``interval`` seconds (NVML in a worker thread, so the event loop never blocks), and
  :class:`SamplingLog`, its failures.
- :mod:`.root`: :class:`Telemetry`, the parts put together for the daemon.

All times are on one monotonic clock (``time.monotonic``, which is also what the
default asyncio loop's ``loop.time()`` reads).
"""

from .duty import DutyWindow
from .gpus import GpuRecord
from .moves import JobMoves, MoveKind, MoveLog, MoveRecord
from .root import Telemetry
from .sampler import Sampler, SamplingLog
from .sources import GpuSource, SimGpuSource, SourceKind

__all__ = [
    "DutyWindow",
    "GpuRecord",
    "GpuSource",
    "JobMoves",
    "MoveKind",
    "MoveLog",
    "MoveRecord",
    "Sampler",
    "SamplingLog",
    "SimGpuSource",
    "SourceKind",
    "Telemetry",
]
