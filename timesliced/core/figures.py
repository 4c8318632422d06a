"""What the scheduler counts for ``describe``, the metrics and the dashboard (pure).

The figures are the fields under "figures" of ``Group`` and ``Job``; only this module writes
them. They never steer a decision (the order of eviction is ``Job.last_granted``, scheduling
state), and they are counted when the step that produced them commits: a step that raises
counts nothing, so a figure needs no undo (a bounded sample, once appended, could not be taken
back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .model import Group, Job

GROUP_FIGURES = (
    "created_at",
    "grants",
    "switches",
    "preemptions",
    "bytes_moved",
    "held_total_s",
    "deferred",
    "switch_times",
    "wait_times",
)
JOB_FIGURES = (
    "slices",
    "preemptions",
    "restores",
    "snapshots",
    "gpu_seconds",
    "bytes_moved",
    "waits",
    "phases",
)


class Figures:
    """Counts grants, slices, switches, moves and waits, once the step under way commits."""

    def __init__(self) -> None:
        self._later: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def granted(self, group: Group, job: Job, waited: float, switch_s: float | None) -> None:
        """A grant after ``waited`` seconds in the queue; ``switch_s``: how long its switch took, if any.

        Called as the grant is made, when ``group.held_since`` is the grant's time: the job asked
        ``waited`` seconds before it (read now, since a later grant in the same step moves it).
        """
        requested_at = group.held_since - waited
        self._later.append((_granted, (group, job, waited, switch_s, requested_at)))

    def held(self, group: Group, job: Job, held_s: float, gpus: int) -> None:
        """A slice of ``held_s`` seconds on ``gpus`` GPUs ended (now: it began at ``group.held_since``)."""
        ended_at = group.held_since + held_s
        self._later.append((_held, (group, job, held_s, gpus, ended_at, dict(job.footprint))))

    def moved(self, group: Group, job: Job, nbytes: int, done: str | None) -> None:
        """A move of ``nbytes`` ended; ``done``: ``"snapshot"`` or ``"restore"`` if it succeeded."""
        self._later.append((_moved, (group, job, nbytes, done)))

    def preempted(self, group: Group, job: Job) -> None:
        self._later.append((_preempted, (group, job)))

    def deferred(self, group: Group) -> None:
        """The head of the group's queue began to wait for memory or for a rival to leave."""
        self._later.append((_deferred, (group,)))

    def commit(self) -> None:
        """Count everything the step recorded (plain arithmetic on records that exist)."""
        if self._later:
            for count, args in self._later:
                count(*args)
            self._later.clear()

    def discard(self) -> None:
        """The step raised: count nothing of it."""
        self._later.clear()


def carry(into: Group | Job, old: Group | Job) -> None:
    """``old``'s figures (of the same group or job under an earlier leader) become ``into``'s."""
    for name in GROUP_FIGURES if isinstance(into, Group) else (*JOB_FIGURES, "last_granted"):
        setattr(into, name, getattr(old, name))


def _granted(group: Group, job: Job, waited: float, switch_s: float | None, requested_at: float) -> None:
    job.phases.began(requested_at)
    group.grants += 1
    group.wait_times.append(waited)
    job.waits.append(waited)
    job.slices += 1
    if switch_s is not None:
        group.switches += 1
        group.switch_times.append(switch_s)


def _held(group: Group, job: Job, held_s: float, gpus: int, ended_at: float, footprint: dict[int, int]) -> None:
    job.phases.ended(ended_at, held_s, footprint)
    job.gpu_seconds += held_s * gpus
    group.held_total_s += held_s


def _moved(group: Group, job: Job, nbytes: int, done: str | None) -> None:
    job.bytes_moved += nbytes
    group.bytes_moved += nbytes
    if done == "snapshot":
        job.snapshots += 1
    elif done == "restore":
        job.restores += 1


def _preempted(group: Group, job: Job) -> None:
    group.preemptions += 1
    job.preemptions += 1


def _deferred(group: Group) -> None:
    group.deferred += 1
