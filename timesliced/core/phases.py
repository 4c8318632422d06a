"""Each job's GPU phases and the gaps between them, for the placement advisor (pure).

A phase is a slice: from a grant of the job's group to the release that ends it (or the
preemption, or the holder's last connection closing). A gap is the job's own time off the GPU:
from the end of a phase to its next acquire request, so time spent waiting in the queue is not
part of it (the grant is ``waited`` seconds after the request, and the request is what ends the
gap). A job's first phase has no gap before it; a preempted job asks again at once (its gap is 0).

The record is bounded: the last ``KEPT`` phase and gap lengths (the statistics are of those),
plus counts over the job's whole life. Memory is the most the job held on one GPU at the end of
any phase (the footprint the scheduler accounts; a real process's is measured by the daemon and
shown as ``measured`` instead).

Only ``figures`` writes these records, when a step commits, so they need no undo.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..util.stats import median, percentile
from ..wire import status as schema

KEPT = 256  # phase and gap lengths kept per job


@dataclass  # one per job: a plain dataclass, so the tests' snapshots read its fields
class Phases:
    busy: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))
    count: int = 0  # phases ended, ever
    gap_count: int = 0  # gaps measured, ever
    released_at: float | None = None  # when its last phase ended, while it has not asked again
    memory_peak: int = 0  # the most it held on one GPU at the end of a phase

    def began(self, requested_at: float) -> None:
        """A phase began; the job asked for it at ``requested_at`` (the grant minus its wait)."""
        if self.released_at is not None:
            self.gaps.append(max(0.0, requested_at - self.released_at))
            self.gap_count += 1
        self.released_at = None

    def ended(self, now: float, held_s: float, footprint: Mapping[int, int]) -> None:
        """A phase of ``held_s`` seconds ended at ``now``, with ``footprint`` (GPU -> bytes) resident."""
        self.busy.append(max(0.0, held_s))
        self.count += 1
        self.released_at = now
        self.memory_peak = max(self.memory_peak, max(footprint.values(), default=0))


def summary(p: Phases) -> schema.JobPhases:
    """The statistics of the kept phases, for the status document."""
    busy_mean = sum(p.busy) / len(p.busy) if p.busy else None
    gap_mean = sum(p.gaps) / len(p.gaps) if p.gaps else None
    duty = None
    if busy_mean is not None and gap_mean is not None and busy_mean + gap_mean > 0:
        duty = busy_mean / (busy_mean + gap_mean)
    return {
        "count": p.count,
        "gaps": p.gap_count,
        "busy_median_s": median(p.busy),
        "busy_p90_s": percentile(p.busy, 0.9),
        "busy_mean_s": busy_mean,
        "gap_median_s": median(p.gaps),
        "gap_p90_s": percentile(p.gaps, 0.9),
        "gap_mean_s": gap_mean,
        "own_duty": duty,
        "memory_peak_bytes": p.memory_peak,
    }
