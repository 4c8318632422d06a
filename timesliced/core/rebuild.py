"""How a new cluster leader rebuilds the scheduler from what the nodes report (pure).

The leader adopts groups and jobs as the nodes describe them, then the holders under the fences
they saw, settles the jobs a switch left half parked, and keeps the turns of restarted nodes'
jobs; finally it carries the figures of its previous scheduler over. Misuse raises
``ValueError`` (or ``KeyError`` for an unknown name) before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterable

from .events import SessionId
from .figures import GROUP_FIGURES, JOB_FIGURES, carry
from .ledger import MemoryLedger
from .location import Location
from .model import Group, Job
from .moves import Moves
from .queues import LockQueues
from .registry import GPUS, Registry
from .undo import Fields, Journal

FENCE = Fields("fence")
HOLDER = Fields("holder", "holder_sessions", "held_since", "fence")
CARRIED_BY_GROUPS = Fields(*GROUP_FIGURES)
CARRIED_BY_JOBS = Fields(*JOB_FIGURES, "last_granted", "held_s")
ADOPTABLE = (Location.RESIDENT, Location.PARKED)  # where a job's state may be found between two switches


class Rebuild:
    """The rebuilding API of ``Scheduler`` (which runs each call as one step)."""

    def __init__(
        self, registry: Registry, ledger: MemoryLedger, queues: LockQueues, moves: Moves, journal: Journal
    ) -> None:
        self._registry = registry
        self._ledger = ledger
        self._queues = queues
        self._moves = moves
        self._journal = journal

    def adopt_group(self, name: str, gpus: tuple[int, ...], now: float) -> None:
        registry = self._registry
        if name in registry.groups or not gpus or not set(gpus) <= set(self._ledger.capacities):
            raise ValueError(f"group {name!r} cannot be adopted with GPUs {list(gpus)}")
        registry.add_group(name, tuple(sorted(gpus)), now)

    def extend_group(self, name: str, gpus: Iterable[int]) -> None:
        group = self._registry.groups[name]
        self._journal.fields(group, GPUS)
        group.gpus = tuple(sorted(set(group.gpus) | (set(gpus) & set(self._ledger.capacities))))

    def shrink_group(self, name: str, gpus: Iterable[int]) -> None:
        group = self._registry.groups[name]
        wanted = set(gpus)
        kept = tuple(g for g in group.gpus if g in wanted)
        if kept:
            self._journal.fields(group, GPUS)
            group.gpus = kept

    def forget_group(self, name: str) -> int:
        return self._registry.forget_group(name).fence

    def adopt_job(
        self,
        name: str,
        group: str,
        exclusive: bool,
        location: Location,
        footprint: dict[int, int],
        faulted: str,
        freezes: bool = True,
        priority: int = 0,
        weight: float = 1.0,
    ) -> None:
        registry = self._registry
        if name in registry.jobs or group not in registry.groups:
            raise ValueError(f"job {name!r} cannot be adopted into group {group!r}")
        if location not in ADOPTABLE:
            # A job comes into being here, at a location it was reported at: no transition of the table.
            raise ValueError(f"a job is adopted resident or parked, not {location.value}")
        unknown = sorted(set(footprint) - set(self._ledger.capacities))
        if unknown:
            raise ValueError(f"job {name!r} holds memory on unknown GPUs {unknown}")
        if not 0 < weight < float("inf"):
            raise ValueError(f"job {name!r} cannot be adopted with weight {weight!r}")
        job = Job(
            name,
            group,
            exclusive=exclusive,
            location=location,
            faulted=faulted,
            freezes=freezes,
            priority=priority,
            weight=weight,
        )
        job.footprint = {gpu: n for gpu, n in footprint.items() if n}
        registry.add_job(job)

    def adopt_holder(self, group: str, job: str, sessions: set[SessionId], fence: int, now: float) -> None:
        g, j = self._registry.groups[group], self._registry.jobs[job]
        if j.group != group or j.location is not Location.RESIDENT or j.faulted or not sessions <= j.sessions:
            raise ValueError(f"job {job!r} cannot hold group {group!r} ({j.location.value}, faulted={bool(j.faulted)})")
        self._journal.fields(g, HOLDER)
        g.holder, g.holder_sessions, g.held_since = job, set(sessions), now
        g.fence = max(g.fence, fence)

    def raise_fence(self, group: str, fence: int) -> None:
        g = self._registry.groups[group]
        self._journal.fields(g, FENCE)
        g.fence = max(g.fence, fence)

    def settle(self, name: str, now: float, footprint: dict[int, int]) -> None:
        job = self._registry.jobs[name]
        if job.location is not Location.RESIDENT or self._registry.holds(job):
            raise ValueError(f"job {name!r} cannot be settled: it is {job.location.value} or holds its group")
        self._registry.note_memory(job, footprint)  # its footprint once parked
        self._moves.settle(job, footprint, now)

    def keep_turn(self, name: str, until: float, now: float) -> None:
        job = self._registry.jobs[name]
        group = self._registry.groups[job.group]
        if job.faulted or job.exiting or group.holder == name or self._queues.waiter(group, name) is not None:
            raise ValueError(f"job {name!r} cannot have a turn kept in group {group.name!r}")
        self._queues.keep_turn(group, name, until, now)

    def carry_figures(self, old_groups: dict[str, Group], old_jobs: dict[str, Job]) -> None:
        for name, g in self._registry.groups.items():
            if (o := old_groups.get(name)) is not None:
                self._journal.fields(g, CARRIED_BY_GROUPS)
                carry(g, o)
        for name, j in self._registry.jobs.items():
            if (oj := old_jobs.get(name)) is not None:
                self._journal.fields(j, CARRIED_BY_JOBS)
                carry(j, oj)
                j.held_s = oj.held_s  # what ``fair`` decides by goes on within the leader's term
