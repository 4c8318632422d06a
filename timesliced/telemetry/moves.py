"""The recent snapshots and restores of this node's jobs, with per-job summaries (pure)."""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass

from ..util.stats import median
from ..wire import status


class MoveKind(enum.Enum):
    SNAPSHOT = "snapshot"
    RESTORE = "restore"

    @property
    def direction(self) -> str:
        """Which way over the host link the move copies: a snapshot to the host, a restore to the device."""
        return "to_host" if self is MoveKind.SNAPSHOT else "to_device"


@dataclass(frozen=True)
class MoveRecord:
    """One snapshot or restore of one job on this node."""

    at: float
    job: str
    kind: MoveKind
    nbytes: int
    seconds: float
    swap_with: str | None = None  # the job moved the other way at the same time (a swap)

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second; 0 for a move that took no measurable time."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> status.MoveEntry:
        return {
            "at": self.at,
            "job": self.job,
            "kind": self.kind.value,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "direction": self.kind.direction,
            "swap_with": self.swap_with,
        }


@dataclass(frozen=True)
class JobMoves:
    """What the snapshots and restores of one job added up to.

    Counts and totals cover every move recorded since the job was first seen;
    ``median_gbps`` covers the moves still in the log that moved bytes in
    measurable time (None when there are none), and so do the medians of
    each direction: ``median_to_host_gbps`` of the snapshots, ``median_to_device_gbps``
    of the restores.
    """

    count: int
    snapshots: int
    restores: int
    nbytes: int
    seconds: float
    median_gbps: float | None
    median_to_host_gbps: float | None = None
    median_to_device_gbps: float | None = None

    def to_dict(self) -> status.JobMoves:
        return {
            "count": self.count,
            "snapshots": self.snapshots,
            "restores": self.restores,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
            "median_gbps": self.median_gbps,
            "median_to_host_gbps": self.median_to_host_gbps,
            "median_to_device_gbps": self.median_to_device_gbps,
        }


@dataclass
class _Totals:
    count: int = 0
    snapshots: int = 0
    restores: int = 0
    nbytes: int = 0
    seconds: float = 0.0


class MoveLog:
    """The latest ``maxlen`` moves, and running totals for at most ``max_jobs`` jobs (least recent dropped)."""

    def __init__(self, maxlen: int = 1024, max_jobs: int = 256) -> None:
        if maxlen < 1 or max_jobs < 1:
            raise ValueError(f"maxlen and max_jobs must be >= 1, not {maxlen} and {max_jobs}")
        self._records: deque[MoveRecord] = deque(maxlen=maxlen)
        self._totals: OrderedDict[str, _Totals] = OrderedDict()  # least recently moved first
        self._max_jobs = max_jobs

    def record(
        self, job: str, kind: MoveKind | str, nbytes: int, seconds: float, now: float, *, swap_with: str | None = None
    ) -> MoveRecord:
        """Log that ``kind`` ("snapshot" / "restore") of ``job`` moved ``nbytes`` in ``seconds``, ending at ``now``.

        ``swap_with``: the job that moved the other way at the same time, when the move was one
        direction of a swap.
        """
        kind = MoveKind(kind)
        if nbytes < 0 or seconds < 0:
            raise ValueError(f"nbytes and seconds must be >= 0, not {nbytes} and {seconds}")
        rec = MoveRecord(now, job, kind, int(nbytes), float(seconds), swap_with)
        self._records.append(rec)
        totals = self._totals.pop(job, None) or _Totals()
        totals.count += 1
        if kind is MoveKind.SNAPSHOT:
            totals.snapshots += 1
        else:
            totals.restores += 1
        totals.nbytes += rec.nbytes
        totals.seconds += rec.seconds
        self._totals[job] = totals
        while len(self._totals) > self._max_jobs:
            self._totals.popitem(last=False)
        return rec

    def forget(self, job: str) -> None:
        """Drop ``job``'s totals and records (a job that left for good)."""
        self._totals.pop(job, None)
        kept = [r for r in self._records if r.job != job]
        self._records.clear()
        self._records.extend(kept)

    def recent(self, job: str | None = None, limit: int | None = None) -> list[MoveRecord]:
        """The logged moves, oldest first, of ``job`` or of all jobs; the last ``limit`` only if given."""
        out = [r for r in self._records if job is None or r.job == job]
        if limit is None:
            return out
        return out[-limit:] if limit > 0 else []

    def summary(self, job: str) -> JobMoves | None:
        totals = self._totals.get(job)
        if totals is None:
            return None
        timed = [r for r in self._records if r.job == job and r.nbytes > 0 and r.seconds > 0]

        def rates(kinds: tuple[MoveKind, ...]) -> float | None:
            return median(sorted(r.gbps for r in timed if r.kind in kinds))

        return JobMoves(
            totals.count,
            totals.snapshots,
            totals.restores,
            totals.nbytes,
            totals.seconds,
            rates((MoveKind.SNAPSHOT, MoveKind.RESTORE)),
            rates((MoveKind.SNAPSHOT,)),
            rates((MoveKind.RESTORE,)),
        )

    def summaries(self) -> dict[str, JobMoves]:
        out = {}
        for job in self._totals:
            s = self.summary(job)
            if s is not None:
                out[job] = s
        return out

    def describe(self, limit: int = 50) -> status.MovesLog:
        """Plain data: the last ``limit`` moves and every job's summary."""
        return {
            "recent": [r.to_dict() for r in self.recent(limit=limit)],
            "jobs": {job: s.to_dict() for job, s in self.summaries().items()},
        }
