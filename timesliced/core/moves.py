"""Snapshots, restores and reclaims in flight, and the one place a job's location changes (pure).

Every change of ``Job.location`` is ``Moves.relocate``: it asks ``location.moved`` for the new
location, which raises ``IllegalTransition`` before anything changes when the table does not
allow it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .events import Effect, MoveFinished, ReclaimJob, RestoreJob, SnapshotJob
from .location import Cause, Location, moved
from .model import Job
from .registry import Registry
from .undo import Fields, Journal

LOCATION = Fields("location")
FOOTPRINT = Fields("footprint")
NEXT_OP = Fields("next_op")
PLACED = Fields("placed")


@dataclass(frozen=True)
class Stream:
    """A restore that streams into the room its snapshots (``ops``, of ``outgoing``) free, as they free it.

    Accounting (``ledger.used``): while the incoming job and any outgoing one both occupy a GPU,
    the pair counts the larger of the two footprints there, not their sum: the incoming job's
    bytes take the outgoing job's room as it frees. The record lasts until the incoming job is
    parked again, or every outgoing job is parked (or gone); then each counts as itself.
    """

    incoming: str
    outgoing: tuple[str, ...]
    ops: tuple[int, ...]


@dataclass
class Move:
    op: int
    job: str
    kind: str  # "snapshot" | "restore" | "reclaim"
    started_at: float


class Moves:
    """What is on its way between device and host, by op."""

    def __init__(self, registry: Registry, journal: Journal, emit: Callable[[Effect], None]) -> None:
        self.in_flight: dict[int, Move] = {}
        self.next_op = 1
        self.settled: dict[int, dict[int, int]] = {}  # settle op -> the job's whole footprint once parked
        self.streams: dict[int, Stream] = {}  # streamed restore op -> its pair (read by the ledger)
        self.prefetches: set[int] = set()  # restores of a head waiter started while its group is held
        self.declined: set[str] = set()  # jobs whose prefetch failed: not prefetched again until granted
        self._registry = registry
        self._journal = journal
        self._emit = emit

    def start(self, job: Job, kind: str, now: float) -> int:
        """Start parking (``"snapshot"``) or restoring ``job``; returns the op.

        Raises ``IllegalTransition`` (a bug in the caller) before anything changes.
        """
        self.relocate(job, Cause.SNAPSHOT_STARTED if kind == "snapshot" else Cause.RESTORE_STARTED)
        op = self._add(job, kind, now)
        self._emit(SnapshotJob(op, job.name) if kind == "snapshot" else RestoreJob(op, job.name))
        return op

    def stream(self, job: Job, snapshots: dict[int, Job], now: float) -> int:
        """Restore ``job`` into the room of ``snapshots`` (op -> the job it parks), started just now.

        Raises ``IllegalTransition`` (a bug in the caller) before anything changes.
        """
        self.relocate(job, Cause.RESTORE_STARTED)
        op = self._add(job, "restore", now)
        ops = tuple(sorted(snapshots))
        self._journal.keep_key(self.streams, op)
        self.streams[op] = Stream(job.name, tuple(snapshots[o].name for o in ops), ops)
        self._emit(RestoreJob(op, job.name, streams_with=ops))
        return op

    def prefetch(self, job: Job, now: float) -> int:
        """Restore ``job``, the head waiter of a held group, into free room; raises ``IllegalTransition``."""
        op = self.start(job, "restore", now)
        self._journal.keep_set(self.prefetches)
        self.prefetches.add(op)
        return op

    def granted(self, job: Job) -> None:
        """``job`` was granted: a prefetch that failed before may be tried again at its next wait."""
        if job.name in self.declined:
            self._journal.keep_set(self.declined)
            self.declined.discard(job.name)

    def reclaim(self, job: Job, now: float) -> int:
        """Drop the state of ``job``, whose processes are gone."""
        op = self._add(job, "reclaim", now)
        self._emit(ReclaimJob(op, job.name))
        return op

    def settle(self, job: Job, footprint: dict[int, int], now: float) -> int:
        """Park ``job``; once parked it owns ``footprint`` (its memory on every node)."""
        op = self.start(job, "snapshot", now)
        self._journal.keep_key(self.settled, op)
        self.settled[op] = dict(footprint)
        return op

    def finish(self, ev: MoveFinished) -> tuple[Move, Cause]:
        """The snapshot or restore ``ev.op`` ended; returns it and what it did to its job's location.

        Raises ``ValueError`` for an op that is no snapshot or restore in flight.
        """
        move = self.in_flight.get(ev.op)
        if move is None or move.kind == "reclaim":
            raise ValueError(f"no snapshot or restore with op {ev.op}")
        job = self._registry.jobs[move.job]
        if move.kind == "snapshot":
            # The backend keeps a failed snapshot resident: the memory stays taken.
            cause = Cause.SNAPSHOT_DONE if ev.ok else Cause.SNAPSHOT_FAILED
        elif ev.ok:
            cause = Cause.RESTORE_DONE
        else:
            # The backend keeps a failed restore parked and gives its pages back, unless
            # nobody knows (a node did not answer): then the memory counts as taken.
            cause = Cause.RESTORE_UNKNOWN if ev.kept_memory else Cause.RESTORE_FAILED
        self.relocate(job, cause)
        journal = self._journal
        journal.delete(self.in_flight, ev.op)
        if ev.op in self.prefetches:
            journal.keep_set(self.prefetches)
            self.prefetches.discard(ev.op)
            if not ev.ok:
                journal.keep_set(self.declined)
                self.declined.add(job.name)
        self.dissolve()
        if ev.op in self.settled:
            settled = journal.delete(self.settled, ev.op)
            if cause is Cause.SNAPSHOT_DONE:
                journal.fields(job, FOOTPRINT)
                job.footprint = {gpu: n for gpu, n in settled.items() if n}
        return move, cause

    def finish_reclaim(self, op: int) -> Move:
        """Raises ``ValueError`` for an op that is no reclaim in flight."""
        move = self.in_flight.get(op)
        if move is None or move.kind != "reclaim":
            raise ValueError(f"no reclaim with op {op}")
        self._journal.delete(self.in_flight, op)
        return move

    def dissolve(self) -> None:
        """Drop the pairs whose incoming job is parked again, or whose outgoing jobs are all parked or gone."""
        jobs = self._registry.jobs
        for op, s in list(self.streams.items()):
            incoming = jobs.get(s.incoming)
            if (
                incoming is None
                or not incoming.location.occupies_device
                or not any(o in jobs and jobs[o].location.occupies_device for o in s.outgoing)
            ):
                self._journal.delete(self.streams, op)

    def forgotten(self, name: str) -> None:
        """Job ``name`` is gone: its pairs and its refused prefetch go too."""
        self.dissolve()
        if name in self.declined:
            self._journal.keep_set(self.declined)
            self.declined.discard(name)

    def leaving(self, gpu: int) -> dict[int, int]:
        """The snapshots in flight, and what each frees on ``gpu`` once done.

        A snapshot that a restore streams into frees nothing for anyone else: its room is taken.
        """
        jobs = self._registry.jobs
        streamed = {o for s in self.streams.values() for o in s.ops}
        return {
            op: jobs[m.job].footprint.get(gpu, 0)
            for op, m in self.in_flight.items()
            if m.kind == "snapshot" and op not in streamed
        }

    def _add(self, job: Job, kind: str, now: float) -> int:
        journal = self._journal
        if kind == "restore" and not job.placed:
            journal.fields(job, PLACED)
            job.placed = True  # restored where a plan made room
        op = self.next_op
        journal.fields(self, NEXT_OP)
        journal.keep_key(self.in_flight, op)
        self.next_op += 1
        self.in_flight[op] = Move(op, job.name, kind, now)
        return op

    def relocate(self, job: Job, cause: Cause) -> Location:
        """Change ``job``'s location for ``cause``: the one assignment of a location there is.

        Raises ``IllegalTransition`` before anything changes when the table does not allow it.
        """
        location = moved(job.location, cause)
        self._journal.fields(job, LOCATION)
        job.location = location
        return location
