"""Which jobs may share a GPU, and how much room each is planned with (pure).

A job whose memory the scheduler does not allocate (``exclusive``: a real process) and that
declared nothing has its GPUs to itself when granted (``alone``). One that declared its memory
per GPU (``sized``) is planned like a simulated job: by its footprint, the larger of what it
declared and the peak it was measured to hold, so jobs whose footprints (plus the headroom) fit a
GPU stay resident together and a handoff between them moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import Job


@dataclass(frozen=True)
class Options:
    """How the scheduler plans residency (see ``Scheduler``): headroom kept free beside declared jobs,
    prefetch of the next waiter, streamed switches, and how long a yielded holder's turn may be kept."""

    memory_headroom: int = 0
    prefetch: bool = True
    stream_switches: bool = False
    anticipate_s: float = 0.0


def alone(job: Job) -> bool:
    """The job must have its GPUs to itself (today's rule for every real job that declared nothing)."""
    return job.exclusive and not job.declared


def sized(job: Job) -> bool:
    """A real job planned by its declared (or measured, if larger) memory."""
    return job.exclusive and bool(job.declared)


def planned(declared: dict[int, int], peak: dict[int, int]) -> dict[int, int]:
    """The footprint a sized job is planned with: per GPU, the larger of its declaration and its peak."""
    return {
        gpu: n for gpu in sorted(declared.keys() | peak.keys()) if (n := max(declared.get(gpu, 0), peak.get(gpu, 0)))
    }


def over_declared(job: Job) -> dict[int, int]:
    """gpu -> bytes the job was measured to hold past its declaration (only for jobs that declared)."""
    if not job.declared:
        return {}
    return {gpu: n - job.declared.get(gpu, 0) for gpu, n in job.peak.items() if n > job.declared.get(gpu, 0)}


def growth(job: Job, gpu: int) -> int:
    """What measurement or the job's own start, not a placement of the scheduler, put on ``gpu``.

    The core never places a job where its footprint does not fit; a resident job measured past its
    declaration may still push a GPU's sum over capacity (a fact the shell reports). The next
    plan on that GPU parks to bring it back under (``ledger.plan_room``).
    """
    if not sized(job):
        return 0
    if not job.placed:
        return job.footprint.get(gpu, 0)  # it started resident by itself, before any plan of the scheduler's
    return max(0, job.footprint.get(gpu, 0) - job.declared.get(gpu, 0))
