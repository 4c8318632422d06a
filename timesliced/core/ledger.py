"""The memory ledger: what each GPU holds, and who must leave it for whom (pure).

Every job that occupies a device (all but ``parked``) counts its footprint on each GPU, so a
restore starts only once its memory is free and no GPU is ever over capacity. A memory request
that does not fit parks idle jobs first and waits for their snapshots (a pending allocation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import errors
from .events import AllocateRegion, Effect, FailRequest, MemoryReleased, SessionId, Ticket
from .location import Location
from .model import Job
from .registry import Registry
from .undo import Journal


@dataclass
class PendingAlloc:
    """A memory request waiting for the snapshots (``ops``) that make room for it."""

    ticket: Ticket
    job: str
    gpu: int
    nbytes: int
    requested: int
    ops: set[int]


class MemoryLedger:
    """Capacities, footprints, and the plans that make room on the GPUs."""

    def __init__(
        self, capacities: dict[int, int], registry: Registry, journal: Journal, emit: Callable[[Effect], None]
    ) -> None:
        self.capacities = capacities
        self.pending: list[PendingAlloc] = []
        self._registry = registry
        self._journal = journal
        self._emit = emit

    # --- what the GPUs hold ----------------------------------------------------------

    def used(self, gpu: int) -> int:
        return sum(j.footprint.get(gpu, 0) for j in self._registry.jobs.values() if j.location.occupies_device)

    def fits(self, gpu: int, nbytes: int) -> bool:
        return nbytes <= self.capacities[gpu] - self.used(gpu)

    def add_devices(self, capacities: dict[int, int]) -> None:
        """GPUs of a node that joined; known GPUs keep their capacity."""
        for gpu, cap in capacities.items():
            if gpu not in self.capacities:
                self._journal.keep_key(self.capacities, gpu)
                self.capacities[gpu] = cap

    # --- making room -----------------------------------------------------------------

    def plan_room(self, job: Job) -> list[Job] | None:
        """The jobs to park before ``job`` may hold its group, or None to wait."""
        need = {gpu: n for gpu, n in job.footprint.items() if n} if job.location is Location.PARKED else {}
        victims = self.plan_evictions(need, exclude={job.name}) if need else []
        rivals = self.rivals(job)
        if victims is None or rivals is None:
            return None
        return victims + [r for r in rivals if r not in victims]

    def plan_evictions(self, need: dict[int, int], exclude: set[str]) -> list[Job] | None:
        """Idle resident jobs to park so that ``need`` (gpu -> bytes) fits, or None.

        Holders, jobs on the move, faulted or exiting jobs and ``exclude`` are
        never evicted; among the rest the least recently granted go first.
        """
        groups = self._registry.groups.values()
        holders = {g.holder for g in groups if g.holder is not None}
        incoming = {g.switch.incoming for g in groups if g.switch is not None}
        candidates = sorted(
            (
                j
                for j in self._registry.jobs.values()
                if j.location is Location.RESIDENT
                and not j.faulted
                # an exiting job is being reclaimed: parking it would race the reclaim
                and not j.exiting
                and j.name not in exclude | holders | incoming
                and any(j.footprint.get(gpu, 0) for gpu in need)
            ),
            key=lambda j: j.last_granted,
        )
        free = {gpu: self.capacities[gpu] - self.used(gpu) for gpu in need}
        victims: list[Job] = []
        for victim in candidates:
            if all(free[gpu] >= n for gpu, n in need.items()):
                break
            if all(free[gpu] >= n or not victim.footprint.get(gpu) for gpu, n in need.items()):
                continue  # frees nothing where it is short
            victims.append(victim)
            for gpu in need:
                free[gpu] += victim.footprint.get(gpu, 0)
        if all(free[gpu] >= n for gpu, n in need.items()):
            return victims
        return None

    def rivals(self, job: Job) -> list[Job] | None:
        """Resident jobs that must be parked because ``job`` or they need the GPUs to themselves.

        None when one of them cannot be parked now (it holds a lock or is on the
        move); faulted and exiting jobs are passed over: parking them is not possible.
        """
        registry = self._registry
        gpus = set(registry.groups[job.group].gpus)
        rivals: list[Job] = []
        for other in registry.jobs.values():
            if other is job or not other.location.occupies_device or other.faulted or other.exiting:
                continue
            if not (job.exclusive or other.exclusive) or not gpus & set(registry.groups[other.group].gpus):
                continue
            if not other.exclusive and not any(other.footprint.get(gpu) for gpu in gpus):
                continue  # a sim job with nothing on these GPUs
            busy = registry.holds(other) or any(
                g.switch is not None and g.switch.incoming == other.name for g in registry.groups.values()
            )
            if busy or other.location is not Location.RESIDENT:
                return None
            rivals.append(other)
        return sorted(rivals, key=lambda j: j.last_granted)

    # --- memory requests -------------------------------------------------------------

    def plan_request(self, job: Job, gpu: int, nbytes: int, leaving: dict[int, int]) -> list[Job]:
        """The idle jobs to park so that ``nbytes`` more fit on ``gpu`` for ``job``; raises ``OutOfMemory``.

        ``leaving``: the snapshots already on their way (another process of this job asked first)
        and what each frees on ``gpu``, less what the requests already waiting for them take.
        """
        waiting = sum(p.nbytes for p in self.pending if p.gpu == gpu)
        need = nbytes + waiting - sum(leaving.values())
        victims = self.plan_evictions({gpu: need}, exclude={job.name})
        if victims is None:
            raise errors.OutOfMemory(self.oom_message(gpu, nbytes, job.name), gpu=gpu)
        return victims

    def reserve(self, job: Job, gpu: int, nbytes: int, requested: int, ticket: Ticket) -> None:
        """``nbytes`` more of ``gpu`` are ``job``'s: the shell allocates them and answers ``ticket``."""
        self._journal.keep_dict(job.footprint)
        job.footprint[gpu] = job.footprint.get(gpu, 0) + nbytes
        self._emit(AllocateRegion(ticket, job.name, gpu, nbytes, requested))

    def wait(self, alloc: PendingAlloc) -> None:
        self._journal.keep_list(self.pending)
        self.pending.append(alloc)

    def retry(self, op: int) -> None:
        """Move ``op`` ended: the requests that waited for it alone are answered now."""
        if not self.pending:
            return
        journal = self._journal
        journal.keep_list(self.pending)
        still: list[PendingAlloc] = []
        for p in self.pending:
            if op in p.ops:
                journal.keep_set(p.ops)
                p.ops.discard(op)
            if p.ops:
                still.append(p)
                continue
            job = self._registry.jobs.get(p.job)
            if job is None or job.location is not Location.RESIDENT or job.faulted or job.exiting:
                self._emit(FailRequest(p.ticket, errors.NotResident(f"job {p.job!r} was parked while allocating")))
            elif not self.fits(p.gpu, p.nbytes):
                self._emit(FailRequest(p.ticket, errors.OutOfMemory(self.oom_message(p.gpu, p.nbytes, p.job))))
            else:
                self.reserve(job, p.gpu, p.nbytes, p.requested, p.ticket)
        self.pending[:] = still

    def forget_session(self, session: SessionId) -> None:
        """The requests of a closed session are dropped unanswered."""
        if any(p.ticket[0] == session for p in self.pending):
            self._journal.keep_list(self.pending)
            self.pending[:] = [p for p in self.pending if p.ticket[0] != session]

    def fail_job(self, job: str, error: errors.TimeslicedError) -> None:
        """The job's waiting requests fail with ``error``."""
        mine = [p for p in self.pending if p.job == job]
        if mine:
            self._journal.keep_list(self.pending)
            for p in mine:
                self.pending.remove(p)
                self._emit(FailRequest(p.ticket, error))

    def release(self, ev: MemoryReleased) -> None:
        """The job freed ``ev.nbytes`` of ``ev.gpu``; raises ``ValueError`` for more than it holds."""
        if ev.nbytes < 0:
            raise ValueError(f"cannot free {ev.nbytes} bytes")
        job = self._registry.jobs.get(ev.job)
        if job is None:
            return
        left = job.footprint.get(ev.gpu, 0) - ev.nbytes
        if left < 0:
            raise ValueError(f"job {ev.job!r} frees more on GPU {ev.gpu} than it holds")
        self._journal.keep_dict(job.footprint)
        if left:
            job.footprint[ev.gpu] = left
        else:
            job.footprint.pop(ev.gpu, None)

    def oom_message(self, gpu: int, nbytes: int, job: str) -> str:
        cap = self.capacities[gpu]
        others = sorted(
            f"{j.name} ({j.footprint[gpu]} B, {'holding' if self._registry.holds(j) else j.location.value})"
            for j in self._registry.jobs.values()
            if j.name != job and j.location.occupies_device and j.footprint.get(gpu)
        )
        return (
            f"GPU {gpu}: cannot allocate {nbytes} bytes for job {job!r}: {cap - self.used(gpu)} of {cap} bytes free"
            + (f"; also on it: {', '.join(others)}" if others else "")
        )

    def on(self, gpus: Iterable[int]) -> dict[int, int]:
        """Capacities of ``gpus`` that the ledger knows."""
        return {gpu: self.capacities[gpu] for gpu in gpus if gpu in self.capacities}
