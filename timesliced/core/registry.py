"""Who is who in the scheduler: sessions belong to jobs, jobs to groups, groups span GPUs (pure)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from .. import errors
from ..util.parse import exact_size
from .events import JobRegistered, SessionId
from .ids import gpu_slot
from .model import Group, Job
from .residency import planned
from .undo import Fields, Journal

GPUS = Fields("gpus")
DECLARED = Fields("declared")
FOOTPRINT = Fields("footprint")
LAST_HOLDER = Fields("last_holder")


class Registry:
    """The scheduler's names: every group, every job and the session each connection registered."""

    def __init__(self, capacities: dict[int, int], journal: Journal) -> None:
        self.capacities = capacities  # the ledger's: the GPUs a group may span
        self.groups: dict[str, Group] = {}
        self.jobs: dict[str, Job] = {}
        self.sessions: dict[SessionId, str] = {}  # session -> job
        self.parties: dict[SessionId, str] = {}  # session -> the party it acts for (JobRegistered.party), if named
        # Indexes, so that the ledger's scans are proportional to a GPU's jobs, not to every job
        # (journaled like the rest; ``invariants.check`` holds them to ``jobs``):
        self.on_gpu: dict[int, dict[str, Job]] = {}  # gpu -> every job with memory counted there (and maybe more)
        self.exclusive: dict[str, Job] = {}  # the jobs registered ``exclusive``
        self.sized: dict[str, Job] = {}  # the exclusive jobs that declared their memory (``residency.sized``)
        self.rank: dict[str, int] = {}  # job -> its place in ``jobs``: sorting by it keeps the order of a scan
        self._ranks = itertools.count()
        self._journal = journal

    def job_of(self, session: SessionId) -> Job:
        """The job ``session`` registered; raises ``NotRegistered``."""
        name = self.sessions.get(session)
        if name is None:
            raise errors.NotRegistered("register a job before using the lock")
        return self.jobs[name]

    def group(self, name: str) -> Group:
        """Raises ``UnknownGroup``."""
        group = self.groups.get(name)
        if group is None:
            raise errors.UnknownGroup(f"no group {name!r} (groups: {', '.join(sorted(self.groups)) or 'none'})")
        return group

    def holds(self, job: Job) -> bool:
        return self.groups[job.group].holder == job.name

    def register(self, ev: JobRegistered, now: float) -> dict[str, Any]:
        """Bind ``ev.session`` to its job, creating the job and its group as needed.

        Raises ``AlreadyRegistered``, ``BadRequest``, ``UnknownDevice``, ``GroupMismatch`` or
        ``JobFaulted`` (a job being torn down) before anything changes.
        """
        if ev.session in self.sessions:
            raise errors.AlreadyRegistered(f"this connection already registered job {self.sessions[ev.session]!r}")
        node_gpus = tuple(sorted(g for g in self.capacities if gpu_slot(g) == ev.slot))
        if ev.gpus is not None:
            if not ev.gpus:
                raise errors.BadRequest("a group needs at least one GPU")
            unknown = sorted(set(ev.gpus) - set(node_gpus))
            if unknown:
                raise errors.UnknownDevice(f"no GPU {unknown} on this node (it has {list(node_gpus)})")
        group = self.groups.get(ev.group)
        gpus = tuple(sorted(set(ev.gpus))) if ev.gpus is not None else None
        # A group may span nodes: on each node it has one set of GPUs, fixed by its first registration there.
        here = tuple(g for g in group.gpus if gpu_slot(g) == ev.slot) if group is not None else ()
        if here and gpus is not None and gpus != here:
            raise errors.GroupMismatch(f"group {ev.group!r} has GPUs {list(here)}, not {list(gpus)}")
        job = self.jobs.get(ev.job)
        if job is not None and job.group != ev.group:
            raise errors.GroupMismatch(f"job {ev.job!r} belongs to group {job.group!r}, not {ev.group!r}")
        if job is not None and job.exiting:
            raise errors.JobFaulted(f"job {ev.job!r} is being torn down; register again shortly")
        if job is not None and (job.exclusive, job.freezes) != (ev.exclusive, ev.freezes):
            raise errors.BadRequest(f"job {ev.job!r} is already registered with another parking method")
        if not node_gpus:
            raise errors.UnknownDevice("this node has no GPUs")
        memory = declared_memory(ev, here or gpus or node_gpus)
        self._check_memory(ev.job, memory, job, here or gpus or node_gpus)
        if not 0 < ev.weight < float("inf"):  # NaN fails both
            raise errors.BadRequest(f"a job's weight must be a positive number, not {ev.weight!r}")
        journal = self._journal
        if group is None:
            group = self.add_group(ev.group, gpus or node_gpus, now)
        elif not here:
            journal.fields(group, GPUS)
            group.gpus = tuple(sorted(group.gpus + (gpus or node_gpus)))
        if job is None:
            job = self.add_job(
                Job(
                    ev.job, ev.group, exclusive=ev.exclusive, freezes=ev.freezes, priority=ev.priority, weight=ev.weight
                )
            )
        # else: the job's first registration fixed its priority and weight (its other processes need not repeat them)
        if memory and any(job.declared.get(g) != n for g, n in memory.items()):
            journal.fields(job, DECLARED)
            job.declared = {**job.declared, **{g: n for g, n in memory.items() if n}}
            if job.exclusive and job.declared and job.name not in self.sized:
                journal.keep_key(self.sized, job.name)
                self.sized[job.name] = job
            if job.exclusive:
                journal.fields(job, FOOTPRINT)
                job.footprint = planned(job.declared, job.peak)
                self.note_memory(job, job.footprint)
        journal.keep_set(job.sessions)
        journal.keep_set(job.pids)
        journal.keep_key(self.sessions, ev.session)
        job.sessions.add(ev.session)
        job.pids.update(ev.pids)
        self.sessions[ev.session] = ev.job
        if ev.party:
            journal.keep_key(self.parties, ev.session)
            self.parties[ev.session] = ev.party
        return {"job": job.name, "group": group.name, "gpus": list(group.gpus), "location": job.location.value}

    def _check_memory(self, name: str, memory: dict[int, int] | None, job: Job | None, gpus: tuple[int, ...]) -> None:
        """Raises ``BadRequest`` for a declaration of GPUs outside the job's, past a GPU's capacity,
        or that disagrees with what the job declared before."""
        if memory is None:
            return
        for gpu, n in sorted(memory.items()):
            if gpu not in gpus:
                raise errors.BadRequest(
                    f"job {name!r} declares memory on GPU {gpu}, which is not one of its GPUs {list(gpus)}; "
                    "declare memory only for the GPUs it registers"
                )
            if n < 0 or n > self.capacities[gpu]:
                raise errors.BadRequest(
                    f"job {name!r} declares {exact_size(n)} on GPU {gpu}, which has "
                    f"{exact_size(self.capacities[gpu])}; "
                    "declare at most the GPU's memory"
                )
        if job is None:
            return
        if job.sessions and not job.declared:
            raise errors.BadRequest(
                f"job {name!r} is already registered without a memory declaration; register every "
                "connection of a job with the same memory"
            )
        clash = sorted(g for g, n in memory.items() if g in job.declared and job.declared[g] != n)
        if clash:
            raise errors.BadRequest(
                f"job {name!r} already declared {exact_size(job.declared[clash[0]])} on GPU {clash[0]}, not "
                f"{exact_size(memory[clash[0]])}; register every connection of a job with the same memory"
            )

    def add_group(self, name: str, gpus: tuple[int, ...], now: float) -> Group:
        group = Group(name, gpus, created_at=now)
        self._journal.keep_key(self.groups, name)
        self.groups[name] = group
        return group

    def add_job(self, job: Job) -> Job:
        journal = self._journal
        journal.keep_key(self.jobs, job.name)
        journal.keep_key(self.rank, job.name)
        self.jobs[job.name] = job
        self.rank[job.name] = next(self._ranks)
        if job.exclusive:
            journal.keep_key(self.exclusive, job.name)
            self.exclusive[job.name] = job
        self.note_memory(job, job.footprint)
        return job

    def note_memory(self, job: Job, gpus: Iterable[int]) -> None:
        """``job`` may count memory on ``gpus`` from now on: call it before any footprint gains a GPU."""
        for gpu in gpus:
            jobs = self.on_gpu.setdefault(gpu, {})
            if job.name not in jobs:
                self._journal.keep_key(jobs, job.name)
                jobs[job.name] = job

    def with_memory_on(self, gpus: Iterable[int]) -> list[Job]:
        """The jobs that may count memory on any of ``gpus`` (a superset of those that do), in the order of ``jobs``."""
        found: dict[str, Job] = {}
        for gpu in gpus:
            found.update(self.on_gpu.get(gpu, {}))
        return sorted(found.values(), key=lambda j: self.rank[j.name])

    def close(self, session: SessionId) -> Job | None:
        """Unbind ``session``; returns its job, or None if it registered none."""
        name = self.sessions.get(session)
        if name is None:
            return None
        job = self.jobs[name]
        self._journal.delete(self.sessions, session)
        if session in self.parties:
            self._journal.delete(self.parties, session)
        self._journal.keep_set(job.sessions)
        job.sessions.discard(session)
        return job

    def forget_job(self, name: str) -> None:
        """The job's state is gone: its name and its sessions' are free again."""
        job = self.jobs[name]
        group = self.groups[job.group]
        journal = self._journal
        if group.last_holder == name:
            journal.fields(group, LAST_HOLDER)
            group.last_holder = None
        journal.delete(self.jobs, name)
        journal.delete(self.rank, name)
        if name in self.exclusive:
            journal.delete(self.exclusive, name)
        if name in self.sized:
            journal.delete(self.sized, name)
        for jobs in self.on_gpu.values():
            if name in jobs:
                journal.delete(jobs, name)
        for s in job.sessions:
            if s in self.sessions:
                journal.delete(self.sessions, s)
            if s in self.parties:
                journal.delete(self.parties, s)

    def forget_group(self, name: str) -> Group:
        """Raises ``ValueError`` while the group has jobs."""
        if any(j.group == name for j in self.jobs.values()):
            raise ValueError(f"group {name!r} still has jobs")
        return self._journal.delete(self.groups, name)


def declared_gpus(
    declared: Mapping[str, tuple[int, ...]], group: str, asked: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    """The GPUs a registration in ``group`` asks for on its node, once the node's declared groups are applied.

    ``declared``: group -> its GPUs on this node (the daemon's config file). A declared group gives its
    GPUs to a registration that names none; one that names others is refused with ``GroupMismatch``. A
    group that is not declared keeps what was asked (its first registration fixes its GPUs).
    """
    gpus = declared.get(group)
    if gpus is None:
        return asked
    if asked is not None and tuple(sorted(set(asked))) != tuple(sorted(gpus)):
        raise errors.GroupMismatch(
            f"group {group!r} is declared on GPUs {sorted(gpus)} by the daemon's config file, not "
            f"{sorted(set(asked))}; ask for those GPUs, or for none (a client that names none gets the group's)"
        )
    return tuple(sorted(gpus))


def declared_memory(ev: JobRegistered, gpus: tuple[int, ...]) -> dict[int, int] | None:
    """What ``ev`` declares per GPU, ``memory_each`` spread over ``gpus`` (``memory`` on top); None: nothing."""
    if ev.memory is None and ev.memory_each is None:
        return None
    each = {gpu: ev.memory_each for gpu in gpus} if ev.memory_each is not None else {}
    return {**each, **(ev.memory or {})}
