"""The steps of a new era's rebuild from the nodes' reports (pure): ``Orchestrator.rebuild`` runs them in order.

1. ``merge_jobs``: each job, merged over the nodes that hold any of it (where its state lives).
2. ``adopt_jobs``: the groups and jobs, into the new scheduler.
3. ``adopt_sessions``: every node's sessions, registered again.
4. ``adopt_fences_and_holders``: the highest fence any node saw per group, and the holder under it.
5. ``settle_half_switched``: a job parked on some nodes and resident on others is parked everywhere.
6. ``queue_waiting``: kept turns and waiting acquires, in the order the previous leader queued them.

A report that does not fit (a job registered differently on two nodes, a holder that cannot hold)
is left out and named in the problems, for the log. The steps only ever touch the orchestrator
being built, which nobody else sees until the rebuild returns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import errors
from ..core.events import AcquireRequested, JobRegistered
from ..core.ids import global_gpu, global_session, gpu_slot
from ..core.location import Location
from .asks import WireError
from .messages import Failed, Notify
from .report import NodeReport, ReportedTurn, ReportedWait

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

Reports = dict[int, NodeReport]  # slot -> its report


@dataclass
class MergedJob:
    """One job as all the nodes that hold any of it report it (GPUs cluster-wide)."""

    group: str
    exclusive: bool
    freezes: bool = True
    priority: int = 0
    weight: float = 1.0
    locations: set[Location] = field(default_factory=set)
    footprint: dict[int, int] = field(default_factory=dict)
    resident: dict[int, int] = field(default_factory=dict)  # the footprint of its resident parts
    faulted: list[str] = field(default_factory=list)
    span: set[int] = field(default_factory=set)
    slots: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)


def merge_jobs(reports: Reports) -> tuple[dict[str, MergedJob], list[str]]:
    """Every reported job merged over its nodes, and the problems (a node's part that does not fit)."""
    merged: dict[str, MergedJob] = {}
    problems: list[str] = []
    for slot, report in sorted(reports.items()):
        for j in report.jobs:
            m = merged.setdefault(j.job, MergedJob(j.group, j.exclusive, j.freezes, j.priority, j.weight))
            if (m.group, m.exclusive, m.freezes, m.priority, m.weight) != (
                j.group,
                j.exclusive,
                j.freezes,
                j.priority,
                j.weight,
            ):
                problems.append(f"job {j.job!r} is registered differently on node {slot}; that node's part is left out")
                continue
            m.locations.add(j.location)
            for gpu, n in j.footprint.items():
                key = global_gpu(slot, gpu)
                m.footprint[key] = m.footprint.get(key, 0) + n
                if j.location is Location.RESIDENT:
                    m.resident[key] = m.resident.get(key, 0) + n
            if j.faulted:
                m.faulted.append(j.faulted)
            m.span.update(j.span)
            m.slots.add(slot)
            if j.gone:
                m.gone.add(slot)
    return merged, problems


def adopt_jobs(
    orch: Orchestrator, merged: dict[str, MergedJob], now: float, problems: list[str]
) -> dict[str, dict[int, int]]:
    """Groups and jobs into the scheduler; returns the half-switched jobs with all of their memory.

    A job parked on some nodes and resident on others counts what the GPUs hold now; the
    rest is its own again once ``settle_half_switched`` parked it everywhere.
    """
    sched, capacities = orch.scheduler, orch.scheduler.capacities
    settle: dict[str, dict[int, int]] = {}
    for name, m in merged.items():
        gpus = sorted(g for g in m.span if g in capacities)
        if not gpus:
            problems.append(f"job {name!r}: none of its group's GPUs reported; left out")
            continue
        if m.group in sched.groups:
            sched.extend_group(m.group, gpus)
        else:
            sched.adopt_group(m.group, tuple(gpus), now)
        orch.spans.setdefault(m.group, set()).update(gpu_slot(g) for g in m.span)
        location = Location.PARKED if m.locations == {Location.PARKED} else Location.RESIDENT
        footprint = {g: n for g, n in m.footprint.items() if g in capacities}
        if m.locations == {Location.PARKED, Location.RESIDENT}:
            settle[name] = footprint
            footprint = {g: n for g, n in m.resident.items() if g in capacities}
        sched.adopt_job(
            name, m.group, m.exclusive, location, footprint, "; ".join(m.faulted), m.freezes, m.priority, m.weight
        )
        orch.job_nodes[name] = set(m.slots)
        orch.gone[name] = set(m.gone)
    return settle


def adopt_sessions(orch: Orchestrator, reports: Reports, now: float, problems: list[str]) -> None:
    sched = orch.scheduler
    for slot, report in sorted(reports.items()):
        declared = {j.job: j for j in report.jobs}  # what each job declared on this node, registered again with it
        for s in report.sessions:
            job = sched.jobs.get(s.job)
            here = declared.get(s.job)
            if job is None:
                problems.append(f"session {slot}/{s.conn} of job {s.job!r} is left out")
                continue
            event = JobRegistered(
                global_session(slot, s.conn),
                job.name,
                job.group,
                None,
                s.pids,
                exclusive=job.exclusive,
                slot=slot,
                freezes=job.freezes,
                memory=None if here is None or here.memory is None else _global(slot, here.memory),
                memory_each=None if here is None else here.memory_each,
                priority=job.priority,
                weight=job.weight,
                party=s.party or "",
            )
            try:
                sched.handle(event, now)
            except errors.TimeslicedError as exc:
                problems.append(f"session {slot}/{s.conn} of job {s.job!r}: {exc.message}")


def adopt_fences_and_holders(orch: Orchestrator, reports: Reports, now: float, problems: list[str]) -> None:
    """Fences go on from the highest any node saw (or this leader gave); the holder under it keeps the group.

    Every other node that claims a holder of the group is told that its job lost the lock.
    """
    sched = orch.scheduler
    for name, fence in orch.fence_floor.items():
        if name in sched.groups:
            sched.raise_fence(name, fence)
    claims: dict[str, list[tuple[int, int, str, set[int]]]] = {}  # group -> (fence, slot, job, sessions)
    for slot, report in sorted(reports.items()):
        for name, fence in report.fences.items():
            if name in sched.groups:
                sched.raise_fence(name, fence)
        for h in report.holders:
            sessions = {global_session(slot, c) for c in h.conns}
            claims.setdefault(h.group, []).append((h.fence, slot, h.job, sessions))
    for name, held in claims.items():
        fence, _, holder, _ = max(held, key=lambda c: c[0])
        sessions = set().union(*(c[3] for c in held if c[0] == fence and c[2] == holder))
        why = _why_not_held(orch, name, holder)
        if why is None:
            try:
                sched.adopt_holder(name, holder, sessions & sched.jobs[holder].sessions, fence, now)
            except ValueError as exc:  # the scheduler's refusal: the job cannot hold (it changed nothing)
                why = str(exc)
        if why is not None:
            problems.append(f"holder {holder!r} of {name!r} is not adopted: {why}")
        lost = {"group": name, "reason": "the new leader found another holder or an inconsistent state"}
        for f, slot, other, _ in held:
            if why is not None or (f, other) != (fence, holder):
                orch.send(slot, Notify(orch.era, other, "lock_lost", lost))


def _why_not_held(orch: Orchestrator, group: str, job: str) -> str | None:
    if group not in orch.scheduler.groups:
        return f"no group {group!r} was reported with GPUs"
    if job not in orch.scheduler.jobs:
        return f"no job {job!r} was reported with GPUs"
    return None


def settle_half_switched(orch: Orchestrator, settle: dict[str, dict[int, int]], now: float) -> None:
    """Half-switched jobs are parked everywhere before anyone waits for them (but not one that holds)."""
    sched = orch.scheduler
    for name, whole in settle.items():
        if sched.groups[sched.jobs[name].group].holder != name:
            sched.settle(name, now, whole)


def queue_waiting(orch: Orchestrator, reports: Reports, now: float, problems: list[str]) -> None:
    """Waiting acquires in the order the previous leader queued them (then as they arrived), after
    the turns a restarted node kept for its jobs (the holder's first)."""
    sched = orch.scheduler
    places: list[tuple[bool, int, int, int, ReportedTurn | ReportedWait]] = []
    for slot, report in reports.items():
        entries: list[ReportedTurn | ReportedWait] = [*report.turns, *report.waiting]
        places.extend((w.seq is None, w.seq or 0, w.order, slot, w) for w in entries)
    for _, _, _, slot, w in sorted(places, key=lambda t: t[:4]):
        if isinstance(w, ReportedTurn):
            if w.job not in sched.jobs:
                problems.append(f"the turn of job {w.job!r} is not kept: no such job was reported with GPUs")
                continue
            try:
                sched.keep_turn(w.job, now + w.kept_for, now)
            except ValueError as exc:  # the scheduler's refusal (it changed nothing)
                problems.append(f"the turn of job {w.job!r} is not kept: {exc}")
            continue
        deadline = None if w.deadline_in is None else now + w.deadline_in
        try:
            sched.handle(AcquireRequested(global_session(slot, w.conn), w.rid, deadline, w.gang, w.members), now)
        except errors.TimeslicedError as exc:
            orch.send(slot, Failed(orch.era, w.conn, w.rid, WireError.of(exc)))


def _global(slot: int, memory: dict[int, int]) -> dict[int, int]:
    return {global_gpu(slot, g): n for g, n in memory.items()}
