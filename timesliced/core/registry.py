"""Who is who in the scheduler: sessions belong to jobs, jobs to groups, groups span GPUs (pure)."""

from __future__ import annotations

from typing import Any

from .. import errors
from .events import JobRegistered, SessionId
from .ids import gpu_slot
from .model import Group, Job
from .undo import Fields, Journal

GPUS = Fields("gpus")
LAST_HOLDER = Fields("last_holder")


class Registry:
    """The scheduler's names: every group, every job and the session each connection registered."""

    def __init__(self, capacities: dict[int, int], journal: Journal) -> None:
        self.capacities = capacities  # the ledger's: the GPUs a group may span
        self.groups: dict[str, Group] = {}
        self.jobs: dict[str, Job] = {}
        self.sessions: dict[SessionId, str] = {}  # session -> job
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
        journal.keep_set(job.sessions)
        journal.keep_set(job.pids)
        journal.keep_key(self.sessions, ev.session)
        job.sessions.add(ev.session)
        job.pids.update(ev.pids)
        self.sessions[ev.session] = ev.job
        return {"job": job.name, "group": group.name, "gpus": list(group.gpus), "location": job.location.value}

    def add_group(self, name: str, gpus: tuple[int, ...], now: float) -> Group:
        group = Group(name, gpus, created_at=now)
        self._journal.keep_key(self.groups, name)
        self.groups[name] = group
        return group

    def add_job(self, job: Job) -> Job:
        self._journal.keep_key(self.jobs, job.name)
        self.jobs[job.name] = job
        return job

    def close(self, session: SessionId) -> Job | None:
        """Unbind ``session``; returns its job, or None if it registered none."""
        name = self.sessions.get(session)
        if name is None:
            return None
        job = self.jobs[name]
        self._journal.delete(self.sessions, session)
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
        for s in job.sessions:
            if s in self.sessions:
                journal.delete(self.sessions, s)

    def forget_group(self, name: str) -> Group:
        """Raises ``ValueError`` while the group has jobs."""
        if any(j.group == name for j in self.jobs.values()):
            raise ValueError(f"group {name!r} still has jobs")
        return self._journal.delete(self.groups, name)
