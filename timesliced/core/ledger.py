"""The memory ledger: what each GPU holds, and who must leave it for whom (pure).

Every job that occupies a device (all but ``parked``) counts its footprint on each GPU, so a
restore starts only once its memory is free and no GPU is ever over capacity. A memory request
that does not fit parks idle jobs first and waits for their snapshots (a pending allocation).
Every plan of parks is admitted against the host's budget for parked state (``host``) first.

Residency (``residency``): a real job that declared nothing has its GPUs to itself (``rivals``);
one that declared its memory is planned by its footprint, with ``headroom`` bytes kept free on
each of its GPUs on top: a parked one is restored where footprint plus headroom fit (parking
the least recently granted idle jobs only where room is short), and a resident one is granted
where nothing moves, unless measured growth left its GPUs short of the headroom, when others park.
A restore that streams into its snapshots' room (``moves.Stream``) counts, with them, the larger
of the two footprints on each GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import errors
from ..util.parse import exact_size, human_size
from .events import AllocateRegion, Effect, FailRequest, MemoryReleased, SessionId, Ticket
from .host import HostLedger, refused
from .location import Location
from .model import PARK_RETRY_S, Job, Refuse, Wait
from .moves import Stream
from .registry import Registry
from .residency import alone, growth, planned, sized
from .undo import Fields, Journal

PEAK = Fields("peak")
FOOTPRINT = Fields("footprint")


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
        self,
        capacities: dict[int, int],
        registry: Registry,
        host: HostLedger,
        journal: Journal,
        emit: Callable[[Effect], None],
        streams: dict[int, Stream],
        headroom: int = 0,
    ) -> None:
        """``streams``: the pairs of ``Moves`` (a restore streaming into snapshots' room), read to count
        them; ``headroom``: bytes kept free on each GPU of a job that declared its memory."""
        if headroom < 0:
            raise ValueError(f"the memory headroom must be at least 0 bytes, not {headroom}")
        self.capacities = capacities
        self.headroom = headroom
        self.streams = streams
        self.host = host
        self.pending: list[PendingAlloc] = []
        self._registry = registry
        self._journal = journal
        self._emit = emit

    # --- what the GPUs hold ----------------------------------------------------------

    def used(self, gpu: int) -> int:
        """The bytes the jobs that occupy ``gpu`` count there; a streamed pair counts its larger side."""
        jobs = self._registry.jobs
        here = self._registry.on_gpu.get(gpu, {}).values()
        total = sum(j.footprint.get(gpu, 0) for j in here if j.location.occupies_device)
        for stream in self.streams.values():
            incoming = jobs.get(stream.incoming)
            if incoming is None or not incoming.location.occupies_device:
                continue
            out = sum(
                jobs[o].footprint.get(gpu, 0) for o in stream.outgoing if o in jobs and jobs[o].location.occupies_device
            )
            total -= min(incoming.footprint.get(gpu, 0), out)
        return total

    def grown(self, gpu: int) -> int:
        """What measurement (not a placement) added on ``gpu``: resident jobs measured past their declaration."""
        here = self._registry.on_gpu.get(gpu, {}).values()
        return sum(growth(j, gpu) for j in here if j.location.occupies_device)

    def need(self, job: Job) -> dict[int, int]:
        """gpu -> the free bytes ``job`` needs before it holds its group (``plan_room``).

        A parked job needs its footprint, plus the headroom if it declared its memory (capped at
        the GPU, so a job that fits alone is never refused for the headroom). A resident job that
        declared needs the headroom free where measured growth left less (others park); any
        other resident job needs nothing.
        """
        caps = self.capacities
        if job.location is Location.PARKED:
            pad = self.headroom if sized(job) else 0
            return {gpu: n if n > caps[gpu] else min(n + pad, caps[gpu]) for gpu, n in job.footprint.items() if n}
        if sized(job) and job.location is Location.RESIDENT:
            short = {}
            for gpu, own in job.footprint.items():
                want = max(0, min(self.headroom, caps[gpu] - own))
                if caps[gpu] - self.used(gpu) < want:
                    short[gpu] = want
            return short
        return {}

    def prefetchable(self, job: Job, now: float) -> bool:
        """``job`` (parked, declared) may be restored now into free room beside everyone resident.

        Only room that is free: every GPU keeps the headroom after it, nobody is parked for it,
        and no job that must have its GPUs to itself shares them.
        """
        if not sized(job) or job.location is not Location.PARKED or job.faulted or job.exiting:
            return False
        caps = self.capacities
        if any(n + self.headroom > caps[gpu] - self.used(gpu) for gpu, n in job.footprint.items() if n):
            return False
        return self.rivals(job, now) == []

    def fits(self, gpu: int, nbytes: int) -> bool:
        return nbytes <= self.capacities[gpu] - self.used(gpu)

    def add_devices(self, capacities: dict[int, int]) -> None:
        """GPUs of a node that joined; known GPUs keep their capacity."""
        for gpu, cap in capacities.items():
            if gpu not in self.capacities:
                self._journal.keep_key(self.capacities, gpu)
                self.capacities[gpu] = cap

    # --- making room -----------------------------------------------------------------

    def plan_room(self, job: Job, now: float) -> list[Job] | Wait | Refuse:
        """The jobs to park before ``job`` may hold its group; or why it waits, or why it cannot be.

        ``Wait``: something in the way moves on by itself (a holder yields, a move ends, a reclaim
        frees host memory). ``Refuse``: nothing under way will make the room (a faulted job keeps
        the memory, a park failed or does not fit the host's budget), so the waiter is told now.
        """
        need = self.need(job)
        victims = self.plan_evictions(need, {job.name}, now) if need else []
        if victims is None:
            return self._no_room(job, need, now)
        rivals = self.rivals(job, now)
        if not isinstance(rivals, list):
            return rivals
        parks = victims + [r for r in rivals if r not in victims]
        verdict = self.host.admit(parks, job.name, now)
        return parks if verdict is None else verdict

    def plan_evictions(self, need: dict[int, int], exclude: set[str], now: float) -> list[Job] | None:
        """Idle resident jobs to park so that ``need`` (gpu -> bytes) fits, or None.

        Holders, jobs on the move, faulted or exiting jobs, jobs whose park was refused a moment
        ago and ``exclude`` are never evicted; among the rest the least recently granted go first.
        """
        registry = self._registry

        def busy(j: Job) -> bool:
            # A job holds, or is the incoming job of a switch of, its own group only (``invariants``). A
            # switch may still name a job that exited; a job registered since under that name, in another
            # group, is not that switch's and may be parked.
            switch = registry.groups[j.group].switch
            return registry.holds(j) or (switch is not None and switch.incoming == j.name)

        candidates = sorted(
            (
                j
                for j in registry.with_memory_on(need)
                if j.location is Location.RESIDENT
                and not j.faulted
                # an exiting job is being reclaimed: parking it would race the reclaim
                and not j.exiting
                and refused(j, now) is None
                and j.name not in exclude
                and not busy(j)
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

    def _no_room(self, job: Job, need: dict[int, int], now: float) -> Wait | Refuse:
        """Why ``need`` cannot be made room for on the GPUs now: a wait for what moves on, or a refusal."""
        registry = self._registry
        groups = registry.groups.values()
        incoming = {g.switch.incoming for g in groups if g.switch is not None}
        moving: set[str] = set()
        stuck: list[str] = []
        hosts_full = False
        for gpu, n in sorted(need.items()):
            if n <= self.capacities[gpu] - self.used(gpu):
                continue
            for other in registry.jobs.values():
                held = other.footprint.get(gpu, 0)
                if other is job or not held or not other.location.occupies_device:
                    continue
                what = f"job {other.name!r} keeps {human_size(held)} on GPU {gpu}"
                refusal = refused(other, now)
                if registry.holds(other) or other.location.moving or other.exiting or other.name in incoming:
                    moving.add(other.name)
                elif other.faulted:
                    stuck.append(
                        f"{what} and is faulted ({other.faulted}): an administrator resumes it once its cause "
                        "is gone, or it exits"
                    )
                elif refusal is not None:
                    hosts_full |= refusal.code == errors.InsufficientHostMemory.code
                    stuck.append(f"{what} and could not be parked a moment ago ({refusal.reason})")
        if moving:
            short = ", ".join(f"GPU {g}" for g, n in sorted(need.items()) if n > self.capacities[g] - self.used(g))
            return Wait(f"memory on {short}: waiting for {', '.join(sorted(moving))}", frozenset(moving))
        why = "; ".join(stuck) or "its GPUs do not have the memory it needs"
        message = f"cannot make room for job {job.name!r}: {why}. Try again later"
        error: errors.TimeslicedError = (
            errors.InsufficientHostMemory(message) if hosts_full else errors.SwitchFailed(message)
        )
        return Refuse(error)

    def rivals(self, job: Job, now: float) -> list[Job] | Wait | Refuse:
        """Resident jobs that must be parked because ``job`` or they need the GPUs to themselves.

        ``Wait`` when one of them cannot be parked now (it holds a lock or is on the move), ``Refuse``
        when one's park failed a moment ago with its state intact; faulted and exiting jobs are
        passed over: parking them is not possible.
        """
        registry = self._registry
        gpus = set(registry.groups[job.group].gpus)
        rivals: list[Job] = []
        busy: set[str] = set()
        # Only an exclusive job, or (for an exclusive ``job``) one with memory on its GPUs, can be a rival.
        others = dict(registry.exclusive)
        if job.exclusive:
            others.update((j.name, j) for j in registry.with_memory_on(gpus))
        for other in sorted(others.values(), key=lambda j: registry.rank[j.name]):
            if other is job or not other.location.occupies_device or other.faulted or other.exiting:
                continue
            if not (alone(job) or alone(other)) or not gpus & set(registry.groups[other.group].gpus):
                continue
            if not alone(other) and not any(other.footprint.get(gpu) for gpu in gpus):
                continue  # a sim job, or one that declared its memory, with nothing on these GPUs
            switching = any(g.switch is not None and g.switch.incoming == other.name for g in registry.groups.values())
            if registry.holds(other) or switching or other.location is not Location.RESIDENT:
                busy.add(other.name)
                continue
            refusal = refused(other, now)
            if refusal is not None:
                message = (
                    f"cannot make room for job {job.name!r}: job {other.name!r} shares its GPUs and could not be "
                    f"parked a moment ago ({refusal.reason}); it is tried again within {PARK_RETRY_S:g} s, or "
                    "sooner once host memory frees up or a job exits. Try again later"
                )
                if refusal.code == errors.InsufficientHostMemory.code:
                    return Refuse(errors.InsufficientHostMemory(message))
                return Refuse(errors.SwitchFailed(message))
            rivals.append(other)
        if busy:
            return Wait(
                f"GPUs shared with {', '.join(sorted(busy))}, which holds a lock or is on the move", frozenset(busy)
            )
        return sorted(rivals, key=lambda j: j.last_granted)

    # --- memory requests -------------------------------------------------------------

    def plan_request(self, job: Job, gpu: int, nbytes: int, leaving: dict[int, int], now: float) -> list[Job]:
        """The idle jobs to park so that ``nbytes`` more fit on ``gpu`` for ``job``.

        ``leaving``: the snapshots already on their way (another process of this job asked first)
        and what each frees on ``gpu``, less what the requests already waiting for them take.
        Raises ``OutOfMemory``, or ``InsufficientHostMemory`` when the parks would not fit the host.
        """
        waiting = sum(p.nbytes for p in self.pending if p.gpu == gpu)
        need = nbytes + waiting - sum(leaving.values())
        victims = self.plan_evictions({gpu: need}, {job.name}, now)
        if victims is None:
            raise errors.OutOfMemory(self.oom_message(gpu, nbytes, job.name), gpu=gpu)
        verdict = self.host.admit(victims, job.name, now, may_wait=False)
        if isinstance(verdict, Refuse):
            raise verdict.error
        return victims

    def reserve(self, job: Job, gpu: int, nbytes: int, requested: int, ticket: Ticket) -> None:
        """``nbytes`` more of ``gpu`` are ``job``'s: the shell allocates them and answers ``ticket``."""
        self._registry.note_memory(job, (gpu,))
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
        if sized(job):
            left = max(left, planned(job.declared, job.peak).get(ev.gpu, 0))  # never below what it declared
        self._journal.keep_dict(job.footprint)
        if left:
            job.footprint[ev.gpu] = left
        else:
            job.footprint.pop(ev.gpu, None)

    def oom_message(self, gpu: int, nbytes: int, job: str) -> str:
        cap = self.capacities[gpu]
        others = sorted(
            f"{j.name} ({human_size(j.footprint[gpu])}, {'holding' if self._registry.holds(j) else j.location.value})"
            for j in self._registry.jobs.values()
            if j.name != job and j.location.occupies_device and j.footprint.get(gpu)
        )
        return (
            f"GPU {gpu}: cannot allocate {exact_size(nbytes)} for job {job!r}: {human_size(cap - self.used(gpu))} of "
            f"{human_size(cap)} free" + (f"; also on it: {', '.join(others)}" if others else "")
        )

    def measured(self, job: Job, gpus: dict[int, int]) -> None:
        """``job`` was seen to hold ``gpus`` (gpu -> bytes): keep its peak, and plan a declared job with it."""
        if all(job.peak.get(g, 0) >= n for g, n in gpus.items()):
            return
        self._journal.fields(job, PEAK)
        job.peak = {**job.peak, **{g: n for g, n in gpus.items() if n > job.peak.get(g, 0)}}
        if sized(job):
            # A declared job counts at least its declaration and its peak; what it allocated stays counted too.
            floor = planned(job.declared, job.peak)
            self._journal.fields(job, FOOTPRINT)
            job.footprint = {g: max(job.footprint.get(g, 0), n) for g, n in floor.items()} | {
                g: n for g, n in job.footprint.items() if g not in floor and n
            }
            self._registry.note_memory(job, job.footprint)

    def on(self, gpus: Iterable[int]) -> dict[int, int]:
        """Capacities of ``gpus`` that the ledger knows."""
        return {gpu: self.capacities[gpu] for gpu in gpus if gpu in self.capacities}
