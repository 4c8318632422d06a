"""Who in a group's queue is granted next: the queue policies (pure).

Each group has one policy, set on the daemon (``--policy GROUP=NAME``; default ``fifo``). A policy
ranks the waiters by a *virtual arrival*: the time the waiter joined the queue plus an offset the
policy gives its job, never negative and never above the policy's window ``W`` for that job. The
least virtual arrival goes first; equal ones in arrival order.

- ``fifo``: offset 0, so arrival order (``W`` = 0): the reference behaviour.
- ``priority``: offset ``(pmax - p) * aging_s``, ``p`` the job's priority and ``pmax`` the highest
  of its group's jobs: higher priority first, arrival order among equals, and each ``aging_s``
  seconds waited is worth one level (``W`` = ``(pmax - p) * aging_s``).
- ``fair``: offset ``min(s - smin, aging_s)``, ``s`` the seconds the job held its group divided by
  its weight and ``smin`` the least of its group's jobs: the job furthest below its share first; a
  second waited offsets a second of weighted hold, up to ``aging_s`` (``W`` = ``aging_s``).

The bound every policy keeps (tests/unit/test_policy_random.py checks it): a waiter that arrived
at ``t`` is passed by no waiter that arrives after ``t + W`` (its virtual arrival is later), and
since each job waits at most once per group, after ``t + W`` at most ``N - 1`` grants of the group
(``N`` its jobs) come before its own, as long as holders release. Two exceptions, both bounded by
what they wait for: a switch already under way for an earlier choice is finished first, and a kept
turn (a restarted daemon's place) is a candidate like any waiter: chosen, the group waits for it.

A preempted holder is queued again at the tail with a new arrival: under ``priority`` it goes
before lower priorities at once; under ``fair`` its larger share puts it behind those below theirs.

Gangs (``gangs.py``): a gang's members rank in their groups at the moment the gang was complete,
and among gangs that share a group only the one that was complete first is a candidate, so every
group orders gangs alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .model import Gang, Group, Job, Waiter

POLICY_NAMES = ("fifo", "priority", "fair")
AGING_S = 60.0  # default: one priority level, or one second of weighted hold, per minute waited


@dataclass(frozen=True)
class QueuePolicy:
    """How a group orders its waiters. Raises ``ValueError`` for an unknown name or ``aging_s <= 0``."""

    name: str = "fifo"
    aging_s: float = AGING_S

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"queue policy must be one of {', '.join(POLICY_NAMES)}, not {self.name!r}")
        if not self.aging_s > 0:
            raise ValueError(f"a queue policy's aging must be > 0 s, not {self.aging_s!r}")

    def offset(self, job: Job, ctx: Standing) -> float:
        """Seconds added to ``job``'s arrival (0 <= offset <= ``window(job, ctx)``)."""
        if self.name == "priority":
            return (ctx.pmax - job.priority) * self.aging_s
        if self.name == "fair":
            return min(share(job) - ctx.smin, self.aging_s)
        return 0.0

    def window(self, job: Job, ctx: Standing) -> float:
        """``W``: after its arrival plus this, no newcomer is put before ``job``'s waiter."""
        if self.name == "priority":
            return (ctx.pmax - job.priority) * self.aging_s
        return self.aging_s if self.name == "fair" else 0.0


@dataclass(frozen=True)
class Standing:
    """What a group's jobs stand at now: the highest priority and the least weighted hold."""

    pmax: int
    smin: float

    @staticmethod
    def of(jobs: Iterable[Job]) -> Standing:
        listed = list(jobs)
        return Standing(
            max((j.priority for j in listed), default=0),
            min((share(j) for j in listed), default=0.0),
        )


def share(job: Job) -> float:
    """Seconds held per unit of weight."""
    return job.held_s / job.weight


class QueuePolicies:
    """The queue policy of each group (``"*"``: every other group's; else ``fifo``)."""

    def __init__(self, policies: Mapping[str, QueuePolicy]) -> None:
        self.policies = dict(policies)

    def policy(self, group: str) -> QueuePolicy:
        return self.policies.get(group) or self.policies.get("*") or FIFO


FIFO = QueuePolicy()


def candidates(group: Group, gangs: Mapping[str, Gang]) -> list[Waiter]:
    """The waiters that may be chosen: all but members of gangs not yet complete, and of gangs
    that became complete after another one waiting in this group."""
    formed = [w.seq for w in group.queue if w.gang is not None and gangs[w.gang].seq is not None]
    first = min(formed, default=None)
    return [w for w in group.queue if w.gang is None or (gangs[w.gang].seq is not None and w.seq == first)]


def arrival(waiter: Waiter, gangs: Mapping[str, Gang]) -> float:
    """When ``waiter`` joined the queue as far as the policy is concerned (a gang: when it was complete)."""
    return gangs[waiter.gang].formed_at if waiter.gang is not None else waiter.enqueued_at


def choose(
    policy: QueuePolicy, group: Group, jobs: Mapping[str, Job], gangs: Mapping[str, Gang]
) -> tuple[Waiter | None, Waiter | None]:
    """The waiter ``policy`` grants next, and the one ``fifo`` would have (None: no candidate)."""
    cands = candidates(group, gangs)
    if not cands:
        return None, None
    first = min(cands, key=lambda w: w.seq)
    if policy.name == "fifo":
        return first, first
    ctx = Standing.of(j for j in jobs.values() if j.group == group.name and not j.exiting)
    best = min(cands, key=lambda w: (arrival(w, gangs) + policy.offset(jobs[w.job], ctx), w.seq))
    return best, first


def why(policy: QueuePolicy, chosen: Job, fifo: Job, ctx: Standing) -> str:
    """Why ``policy`` chose ``chosen`` over ``fifo``'s choice (for the event log)."""
    if policy.name == "priority":
        return f"priority: {chosen.name!r} (priority {chosen.priority}) before {fifo.name!r} (priority {fifo.priority})"
    return (
        f"fair: {chosen.name!r} ({share(chosen):.3f} s held per weight) before {fifo.name!r} "
        f"({share(fifo):.3f} s held per weight)"
    )
