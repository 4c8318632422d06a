"""The scheduler core: groups, jobs, lock queues and GPU residency (pure).

No I/O, no asyncio, no clock: every input carries ``now`` and every output is
an effect for the shell to carry out (``drain()``). ``next_deadline()`` tells
the shell when to call ``handle_timers(now)``.

Invariants (``check_invariants``), kept after every input:

- a group has at most one holding job, and that job is resident and not faulted;
- each group's queue is in arrival order (FIFO) and holds a job at most once;
  a faulted or exiting job never waits (its waiters are failed at once); a
  place without requests is a turn kept for a job whose daemon restarted, and
  it lapses at its deadline;
- a job that is parking or restoring has exactly one move in flight, and a
  job being reclaimed (exiting) never starts a move;
- fences grow strictly with every new grant of a group;
- on every GPU the bytes of jobs that occupy it (resident, parking, restoring)
  never exceed its capacity: a restore is started only once the memory is free.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..util.stats import median, percentile
from .events import (
    AcquireRequested,
    AcquireWithdrawn,
    AllocateRegion,
    DrainRequested,
    Effect,
    Event,
    FailRequest,
    ForceReleaseRequested,
    GrantLock,
    GroupsFrozen,
    JobExited,
    JobRegistered,
    MemoryReleased,
    MemoryRequested,
    MoveFinished,
    NotifyJob,
    ReclaimFinished,
    ReclaimJob,
    ReleaseRequested,
    RestoreJob,
    SessionClosed,
    SessionId,
    SnapshotJob,
    Ticket,
)
from .ids import gpu_slot
from .location import Cause, Location, moved

RECENT = 512  # samples kept per group for medians and percentiles
MAX_REQUESTS_PER_JOB = 256  # acquires of one job waiting at once (each of its processes may wait)


class GroupState(enum.Enum):
    IDLE = "idle"  # nobody holds, no job of the group resident
    IDLE_YIELDED = "idle-yielded"  # nobody holds, the last holder is still resident
    LOCKED = "locked"
    SWITCHING = "switching"
    FAULTED = "faulted"  # nobody holds, and a job of the group is faulted: it needs an operator


AUTO = 0  # the request id of an acquire the scheduler made for a job (a preempted holder queued again)


@dataclass(frozen=True)
class SlicePolicy:
    """How long a holder may keep its group while others wait, and what happens then.

    Past ``max_slice`` the holder is warned (``slice_overdue``); with action
    ``preempt`` it is parked ``grace`` seconds later and queued again.
    """

    max_slice: float
    action: str = "warn"  # "warn" | "preempt"
    grace: float = 10.0

    def __post_init__(self) -> None:
        if not self.max_slice > 0 or not self.grace >= 0:
            raise ValueError("a maximum slice must be > 0 s and its grace >= 0 s")
        if self.action not in ("warn", "preempt"):
            raise ValueError(f"slice action must be 'warn' or 'preempt', not {self.action!r}")


@dataclass
class Waiter:
    """One job's place in a group's queue; several requests may wait on it."""

    job: str
    enqueued_at: float
    tickets: dict[Ticket, float | None] = field(default_factory=dict)  # ticket -> deadline
    kept_until: float | None = None  # a turn kept without requests (see ``keep_turn``) lapses then


@dataclass
class Job:
    name: str
    group: str
    sessions: set[SessionId] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)
    location: Location = Location.RESIDENT
    footprint: dict[int, int] = field(default_factory=dict)  # gpu -> bytes
    exclusive: bool = False  # see JobRegistered.exclusive
    faulted: str = ""  # why, if faulted
    exiting: bool = False
    last_granted: float = float("-inf")
    # figures
    slices: int = 0
    preemptions: int = 0
    restores: int = 0
    snapshots: int = 0
    gpu_seconds: float = 0.0
    bytes_moved: int = 0
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


@dataclass
class Switch:
    incoming: str
    started_at: float
    pending: set[int] = field(default_factory=set)  # snapshot / restore ops in flight
    restoring: bool = False


@dataclass
class Group:
    name: str
    gpus: tuple[int, ...]
    queue: list[Waiter] = field(default_factory=list)
    holder: str | None = None
    holder_sessions: set[SessionId] = field(default_factory=set)
    held_since: float = 0.0
    overdue_since: float | None = None  # when the holder was warned that its slice is over
    fence: int = 0
    switch: Switch | None = None
    last_holder: str | None = None
    # figures
    grants: int = 0
    switches: int = 0
    preemptions: int = 0
    bytes_moved: int = 0
    held_total_s: float = 0.0
    created_at: float = 0.0
    draining: bool = False
    deferred: int = 0  # times the head of the queue had to wait for memory or for a rival to leave
    blocked: str | None = None  # the head job while it waits that way
    switch_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    wait_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


@dataclass
class _PendingAlloc:
    ticket: Ticket
    job: str
    gpu: int
    nbytes: int
    requested: int
    ops: set[int]


@dataclass
class _Move:
    op: int
    job: str
    kind: str  # "snapshot" | "restore" | "reclaim"
    started_at: float


class Scheduler:
    """Decides who holds each group and what must move between device and host."""

    def __init__(
        self,
        capacities: dict[int, int],
        *,
        max_waiters: int = 1024,
        policies: dict[str, SlicePolicy] | None = None,
    ) -> None:
        """``policies``: group -> its ``SlicePolicy``; the key ``"*"`` is every other group's."""
        if not capacities:
            raise ValueError("a scheduler needs at least one GPU")
        self.capacities = dict(capacities)
        self.max_waiters = max_waiters
        self.policies = dict(policies or {})
        self.groups: dict[str, Group] = {}
        self.jobs: dict[str, Job] = {}
        self.sessions: dict[SessionId, str] = {}  # session -> job
        self._effects: list[Effect] = []
        self._moves: dict[int, _Move] = {}
        self._pending_allocs: list[_PendingAlloc] = []
        self._deadlines: list[tuple[float, Ticket]] = []  # heap, stale entries skipped lazily
        self._next_op = 1
        self._frozen: dict[str, str] = {}  # group -> why nothing may be granted in it now (GroupsFrozen)
        self._settled: dict[
            int, dict[int, int]
        ] = {}  # settle op -> the job's whole footprint  # group -> why nothing may be granted in it now
        self._handlers: dict[type, Callable[[Any, float], Any]] = {
            JobRegistered: self._on_registered,
            SessionClosed: self._on_session_closed,
            AcquireRequested: self._on_acquire,
            AcquireWithdrawn: self._on_cancel,
            ReleaseRequested: self._on_release,
            MemoryRequested: self._on_memory_requested,
            MemoryReleased: self._on_memory_released,
            MoveFinished: self._on_move_finished,
            JobExited: self._on_job_exited,
            ReclaimFinished: self._on_reclaim_finished,
            ForceReleaseRequested: self._on_force_release,
            DrainRequested: self._on_drain,
            GroupsFrozen: self._on_frozen,
        }

    # --- shell interface -------------------------------------------------------------

    def handle(self, event: Event, now: float) -> Any:
        """Feed one event; returns its immediate result, raises ``TimeslicedError``.

        An event that raises changes nothing.
        """
        result = self._handlers[type(event)](event, now)
        self._advance_all(now)
        return result

    def handle_timers(self, now: float) -> None:
        """Expire every acquire whose deadline is at or before ``now``."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, ticket = heapq.heappop(self._deadlines)
            waiter = self._waiter_of_ticket(ticket)
            deadline = waiter[1].tickets.get(ticket) if waiter else None
            if waiter is None or deadline is None or deadline > now:
                continue  # already granted, cancelled, gone, or asked again with a later deadline
            group, w = waiter
            self._drop_ticket(group, w, ticket)
            self._emit(FailRequest(ticket, errors.AcquireTimeout("the lock was not granted before the timeout")))
        for group in self.groups.values():
            for w in [w for w in group.queue if not w.tickets and w.kept_until is not None and w.kept_until <= now]:
                group.queue.remove(w)  # its job did not come back in time
        self._advance_all(now)

    def next_deadline(self) -> float | None:
        times = [t for g in self.groups.values() if (t := self._group_deadline(g)) is not None]
        while self._deadlines:
            deadline, ticket = self._deadlines[0]
            waiter = self._waiter_of_ticket(ticket)
            if waiter is not None and waiter[1].tickets.get(ticket) == deadline:
                times.append(deadline)
                break
            heapq.heappop(self._deadlines)
        return min(times, default=None)

    def _group_deadline(self, g: Group) -> float | None:
        """When the group's holder is due a warning or a preemption, or a kept turn lapses."""
        times = [w.kept_until for w in g.queue if not w.tickets and w.kept_until is not None]
        policy = self.policy(g.name)
        if policy is not None and g.holder is not None and self._others_wait(g):
            if g.overdue_since is None:
                times.append(g.held_since + policy.max_slice)
            elif policy.action == "preempt":
                times.append(g.overdue_since + policy.grace)
        return min(times, default=None)

    def policy(self, group: str) -> SlicePolicy | None:
        return self.policies.get(group, self.policies.get("*"))

    def drain(self) -> list[Effect]:
        out, self._effects = self._effects, []
        return out

    # --- rebuilding (a new cluster leader takes over what the nodes report) ------------

    def add_devices(self, capacities: dict[int, int]) -> None:
        """GPUs of a node that joined; known GPUs keep their capacity."""
        for gpu, cap in capacities.items():
            self.capacities.setdefault(gpu, cap)

    def adopt_group(self, name: str, gpus: tuple[int, ...], now: float) -> None:
        if name in self.groups or not gpus or not set(gpus) <= set(self.capacities):
            raise ValueError(f"group {name!r} cannot be adopted with GPUs {list(gpus)}")
        self.groups[name] = Group(name, tuple(sorted(gpus)), created_at=now)

    def extend_group(self, name: str, gpus: Iterable[int]) -> None:
        """The group also spans ``gpus`` (another node's, known GPUs only)."""
        group = self.groups[name]
        group.gpus = tuple(sorted(set(group.gpus) | (set(gpus) & set(self.capacities))))

    def shrink_group(self, name: str, gpus: Iterable[int]) -> None:
        """The group keeps only ``gpus`` (the nodes where it still has jobs); never none."""
        group = self.groups[name]
        kept = tuple(g for g in group.gpus if g in set(gpus))
        if kept:
            group.gpus = kept

    def forget_group(self, name: str) -> int:
        """Drop a group that has no jobs left; returns its fence (new grants must go above it)."""
        if any(j.group == name for j in self.jobs.values()):
            raise ValueError(f"group {name!r} still has jobs")
        return self.groups.pop(name).fence

    def adopt_job(
        self,
        name: str,
        group: str,
        exclusive: bool,
        location: Location,
        footprint: dict[int, int],
        faulted: str = "",
    ) -> None:
        """A job the nodes report, with where its state lives and what it holds on each GPU."""
        if name in self.jobs or group not in self.groups:
            raise ValueError(f"job {name!r} cannot be adopted into group {group!r}")
        if location not in (Location.RESIDENT, Location.PARKED):
            raise ValueError(f"a job is adopted resident or parked, not {location.value}")
        unknown = sorted(set(footprint) - set(self.capacities))
        if unknown:
            raise ValueError(f"job {name!r} holds memory on unknown GPUs {unknown}")
        job = Job(name, group, exclusive=exclusive, location=location, faulted=faulted)
        job.footprint = {gpu: n for gpu, n in footprint.items() if n}
        self.jobs[name] = job

    def adopt_holder(self, group: str, job: str, sessions: set[SessionId], fence: int, now: float) -> None:
        """``job`` holds ``group`` through ``sessions`` under ``fence`` (granted by an earlier leader)."""
        g, j = self.groups[group], self.jobs[job]
        if j.group != group or j.location is not Location.RESIDENT or j.faulted or not sessions <= j.sessions:
            raise ValueError(f"job {job!r} cannot hold group {group!r} ({j.location.value}, faulted={bool(j.faulted)})")
        g.holder, g.holder_sessions, g.held_since = job, set(sessions), now
        g.fence = max(g.fence, fence)

    def carry_figures(self, old: Scheduler) -> None:
        """Take the figures (counts, times, samples) of groups and jobs that ``old`` also had.

        A leader that takes stock again within its term keeps them; state comes from the nodes.
        """
        for name, g in self.groups.items():
            if (o := old.groups.get(name)) is not None:
                g.created_at, g.grants, g.switches, g.bytes_moved = o.created_at, o.grants, o.switches, o.bytes_moved
                g.held_total_s, g.deferred, g.preemptions = o.held_total_s, o.deferred, o.preemptions
                g.switch_times, g.wait_times = o.switch_times, o.wait_times
        for name, j in self.jobs.items():
            if (oj := old.jobs.get(name)) is not None:
                j.slices, j.restores, j.snapshots, j.gpu_seconds = oj.slices, oj.restores, oj.snapshots, oj.gpu_seconds
                j.bytes_moved, j.waits, j.last_granted = oj.bytes_moved, oj.waits, oj.last_granted
                j.preemptions = oj.preemptions

    def raise_fence(self, group: str, fence: int) -> None:
        """New grants of ``group`` get fences above ``fence`` (the highest any node has seen)."""
        g = self.groups[group]
        g.fence = max(g.fence, fence)

    def settle(self, name: str, now: float, footprint: dict[int, int]) -> None:
        """Park a job that some nodes hold resident and others parked (a switch cut short).

        It was adopted with the memory of its resident parts only (what the GPUs really
        hold); once parked everywhere it owns ``footprint``, its memory on every node.
        """
        job = self.jobs[name]
        if job.location is not Location.RESIDENT or self._holds(job):
            raise ValueError(f"job {name!r} cannot be settled: it is {job.location.value} or holds its group")
        op = self._start_move(job, "snapshot", now)
        self._settled[op] = dict(footprint)

    def keep_turn(self, name: str, until: float, now: float) -> None:
        """Keep a place in its group's queue for job ``name`` until ``until``, with no request yet.

        A daemon that restarted knows who held or waited; their clients come back with new
        connections and ask again. Their places are kept (the group waits for them) until
        they do or the deadline passes.
        """
        job = self.jobs[name]
        group = self.groups[job.group]
        if job.faulted or job.exiting or group.holder == name or any(w.job == name for w in group.queue):
            raise ValueError(f"job {name!r} cannot have a turn kept in group {group.name!r}")
        group.queue.append(Waiter(name, now, kept_until=until))

    # --- queries ---------------------------------------------------------------------

    def used(self, gpu: int) -> int:
        return sum(j.footprint.get(gpu, 0) for j in self.jobs.values() if j.location.occupies_device)

    def group_state(self, group: Group) -> GroupState:
        if group.switch is not None:
            return GroupState.SWITCHING
        if group.holder is not None:
            return GroupState.LOCKED
        if any(j.faulted and not j.exiting for j in self.jobs.values() if j.group == group.name):
            return GroupState.FAULTED
        last = self.jobs.get(group.last_holder or "")
        if last is not None and last.location is Location.RESIDENT and not last.faulted:
            return GroupState.IDLE_YIELDED
        return GroupState.IDLE

    def job_of(self, session: SessionId) -> Job:
        name = self.sessions.get(session)
        if name is None:
            raise errors.NotRegistered("register a job before using the lock")
        return self.jobs[name]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant is broken (used by tests)."""
        moving = {m.job: m for m in self._moves.values() if m.kind != "reclaim"}
        assert len(moving) == len([m for m in self._moves.values() if m.kind != "reclaim"]), "two moves of one job"
        for g in self.groups.values():
            if g.holder is not None:
                holder = self.jobs[g.holder]
                assert holder.group == g.name
                assert holder.location is Location.RESIDENT and not holder.faulted, (g.name, holder)
                assert not holder.exiting, f"exiting job {holder.name} holds {g.name}"
                assert g.holder_sessions and g.holder_sessions <= holder.sessions, (g.name, g.holder_sessions)
                assert g.switch is None
            else:
                assert not g.holder_sessions
            names = [w.job for w in g.queue]
            assert len(names) == len(set(names)), f"job queued twice in {g.name}: {names}"
            assert all(a.enqueued_at <= b.enqueued_at for a, b in itertools.pairwise(g.queue)), "not FIFO"
            assert all(w.tickets or w.kept_until is not None for w in g.queue), "empty waiter left in queue"
            assert g.holder not in names, "holder is also queued"
            for w in g.queue:
                job = self.jobs[w.job]
                assert job.group == g.name and not job.faulted and not job.exiting, (g.name, job)
                assert all(self.sessions.get(t[0]) == job.name for t in w.tickets), (g.name, w)
            if g.switch is not None:
                assert g.switch.pending, f"switch of {g.name} has nothing in flight"
                assert all(op in self._moves for op in g.switch.pending)
        for name, job in self.jobs.items():
            move = moving.get(name)
            if job.location is Location.PARKING:
                assert move is not None and move.kind == "snapshot", (name, move)
            elif job.location is Location.RESTORING:
                assert move is not None and move.kind == "restore", (name, move)
                g = self.groups[job.group]
                assert g.switch is not None and g.switch.incoming == name and g.switch.restoring, name
            else:
                assert move is None, (name, move)
        for m in self._moves.values():
            if m.kind == "reclaim":
                assert self.jobs[m.job].exiting
        for gpu, cap in self.capacities.items():
            assert self.used(gpu) <= cap, f"gpu {gpu} over capacity: {self.used(gpu)} > {cap}"
        for s, name in self.sessions.items():
            assert s in self.jobs[name].sessions
        for job in self.jobs.values():
            assert all(self.sessions.get(s) == job.name for s in job.sessions), job.name
            assert all(n >= 0 for n in job.footprint.values()), job.name

    # --- events ----------------------------------------------------------------------

    def _on_registered(self, ev: JobRegistered, now: float) -> dict[str, Any]:
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
        if job is not None and job.exclusive != ev.exclusive:
            raise errors.BadRequest(f"job {ev.job!r} is already registered with another parking method")
        if not node_gpus:
            raise errors.UnknownDevice("this node has no GPUs")
        if group is None:
            group = Group(ev.group, gpus or node_gpus, created_at=now)
            self.groups[ev.group] = group
        elif not here:
            group.gpus = tuple(sorted(group.gpus + (gpus or node_gpus)))
        if job is None:
            job = Job(ev.job, ev.group, exclusive=ev.exclusive)
            self.jobs[ev.job] = job
        job.sessions.add(ev.session)
        job.pids.update(ev.pids)
        self.sessions[ev.session] = ev.job
        return {"job": job.name, "group": group.name, "gpus": list(group.gpus), "location": job.location.value}

    def _on_session_closed(self, ev: SessionClosed, now: float) -> None:
        name = self.sessions.pop(ev.session, None)
        if name is None:
            return
        job = self.jobs[name]
        job.sessions.discard(ev.session)
        group = self.groups[job.group]
        for w in list(group.queue):
            for ticket in [t for t in w.tickets if t[0] == ev.session]:
                self._drop_ticket(group, w, ticket)
        self._pending_allocs = [p for p in self._pending_allocs if p.ticket[0] != ev.session]
        if group.holder == name:
            group.holder_sessions.discard(ev.session)
            if not group.holder_sessions:
                self._yield(group, now)

    def _on_acquire(self, ev: AcquireRequested, now: float) -> None:
        job = self.job_of(ev.session)
        self._check_usable(job)
        group = self.groups[job.group]
        ticket = (ev.session, ev.request_id)
        if group.draining and group.holder != job.name:
            raise errors.GroupDraining(f"group {group.name!r} is drained by an administrator; try again later")
        if group.holder == job.name:
            group.holder_sessions.add(ev.session)
            self._emit(GrantLock(group.name, job.name, group.fence, 0.0, 0.0, False, (ticket,), again=True))
            return
        waiter = next((w for w in group.queue if w.job == job.name), None)
        if waiter is None:
            if len(group.queue) >= self.max_waiters:
                raise errors.LimitExceeded(f"group {group.name!r} already has {self.max_waiters} waiting jobs")
            waiter = Waiter(job.name, now)
            group.queue.append(waiter)
        if len(waiter.tickets) >= MAX_REQUESTS_PER_JOB:
            raise errors.LimitExceeded(f"job {job.name!r} already has {MAX_REQUESTS_PER_JOB} acquires waiting")
        waiter.kept_until = None
        waiter.tickets[ticket] = ev.deadline
        if ev.deadline is not None:
            heapq.heappush(self._deadlines, (ev.deadline, ticket))

    def _on_cancel(self, ev: AcquireWithdrawn, now: float) -> dict[str, bool]:
        job = self.job_of(ev.session)
        group = self.groups[job.group]
        ticket = (ev.session, ev.request_id)
        for w in group.queue:
            if ticket in w.tickets:
                self._drop_ticket(group, w, ticket)
                self._emit(FailRequest(ticket, errors.AcquireCancelled("the acquire was cancelled")))
                return {"cancelled": True}
        return {"cancelled": False}  # already granted or failed: the reply is on its way

    def _on_release(self, ev: ReleaseRequested, now: float) -> dict[str, Any]:
        job = self.job_of(ev.session)
        group = self.groups[job.group]
        if group.holder == job.name and ev.session not in group.holder_sessions:
            raise errors.NotHolder(
                f"this connection does not hold group {group.name!r}: job {job.name!r} holds it through another"
            )
        requeued = next((w for w in group.queue if w.job == job.name and (ev.session, AUTO) in w.tickets), None)
        if group.holder != job.name and requeued is not None:
            # Preempted, and done before its turn came back: it no longer wants the lock.
            self._drop_ticket(group, requeued, (ev.session, AUTO))
            return {"group": group.name, "fence": group.fence, "held_s": 0.0, "preempted": True}
        if group.holder != job.name:
            holder = f"job {group.holder!r}" if group.holder else "nobody"
            raise errors.NotHolder(f"job {job.name!r} does not hold group {group.name!r} ({holder} does)")
        held_s = now - group.held_since
        group.holder_sessions.discard(ev.session)
        if not group.holder_sessions:
            self._yield(group, now)
        return {"group": group.name, "fence": group.fence, "held_s": held_s}

    def _on_memory_requested(self, ev: MemoryRequested, now: float) -> None:
        if ev.nbytes < 0:
            raise ValueError(f"cannot allocate {ev.nbytes} bytes")
        job = self.job_of(ev.session)
        group = self.groups[job.group]
        if ev.gpu not in group.gpus:
            raise errors.UnknownDevice(f"GPU {ev.gpu} is not in group {group.name!r} (GPUs {list(group.gpus)})")
        self._check_usable(job)
        if job.location is not Location.RESIDENT:
            raise errors.NotResident(f"job {job.name!r} is {job.location.value}; acquire the lock first")
        ticket = (ev.session, ev.request_id)
        cap = self.capacities[ev.gpu]
        if ev.nbytes > cap - self.used(ev.gpu):
            # Snapshots already on their way free memory too (another process of this job asked
            # first), less what the requests already waiting for them will take.
            leaving = {
                op: self.jobs[m.job].footprint.get(ev.gpu, 0) for op, m in self._moves.items() if m.kind == "snapshot"
            }
            waiting = sum(p.nbytes for p in self._pending_allocs if p.gpu == ev.gpu)
            need = ev.nbytes + waiting - sum(leaving.values())
            victims = self._plan_evictions({ev.gpu: need}, exclude={job.name})
            if victims is None:
                raise errors.OutOfMemory(self._oom_message(ev.gpu, ev.nbytes, job.name), gpu=ev.gpu)
            ops = {op for op, n in leaving.items() if n} | {self._start_move(v, "snapshot", now) for v in victims}
            self._pending_allocs.append(
                _PendingAlloc(ticket, job.name, ev.gpu, ev.nbytes, ev.requested or ev.nbytes, ops)
            )
            return
        self._reserve(job, ev.gpu, ev.nbytes, ev.requested or ev.nbytes, ticket)

    def _on_memory_released(self, ev: MemoryReleased, now: float) -> None:
        if ev.nbytes < 0:
            raise ValueError(f"cannot free {ev.nbytes} bytes")
        job = self.jobs.get(ev.job)
        if job is None:
            return
        left = job.footprint.get(ev.gpu, 0) - ev.nbytes
        if left < 0:
            raise ValueError(f"job {ev.job!r} frees more on GPU {ev.gpu} than it holds")
        if left:
            job.footprint[ev.gpu] = left
        else:
            job.footprint.pop(ev.gpu, None)

    def _on_move_finished(self, ev: MoveFinished, now: float) -> None:
        move = self._moves.get(ev.op)
        if move is None or move.kind == "reclaim":  # checked before popping: a raising event changes nothing
            raise ValueError(f"no snapshot or restore with op {ev.op}")
        job = self.jobs[move.job]
        if move.kind == "snapshot":
            # The backend keeps a failed snapshot resident: the memory stays taken.
            cause = Cause.SNAPSHOT_DONE if ev.ok else Cause.SNAPSHOT_FAILED
        elif ev.ok:
            cause = Cause.RESTORE_DONE
        else:
            # The backend keeps a failed restore parked and gives its pages back, unless
            # nobody knows (a node did not answer): then the memory counts as taken.
            cause = Cause.RESTORE_UNKNOWN if ev.kept_memory else Cause.RESTORE_FAILED
        location = moved(job.location, cause)
        del self._moves[ev.op]
        job.location = location
        job.bytes_moved += ev.nbytes
        group = self.groups[job.group]
        group.bytes_moved += ev.nbytes
        settled = self._settled.pop(ev.op, None)
        if cause is Cause.SNAPSHOT_DONE:
            job.snapshots += 1
            if settled is not None:
                job.footprint = {gpu: n for gpu, n in settled.items() if n}
        elif cause is Cause.RESTORE_DONE:
            job.restores += 1
        else:
            self._fault(job, f"{move.kind} failed: {ev.error}")
        if job.exiting:
            self._reclaim(job, now)
        for g in self.groups.values():
            if g.switch is not None and ev.op in g.switch.pending:
                g.switch.pending.discard(ev.op)
                if not g.switch.pending:
                    self._continue_switch(g, now)
        self._retry_allocs(ev.op)

    def _on_job_exited(self, ev: JobExited, now: float) -> None:
        job = self.jobs.get(ev.job)
        if job is None or job.exiting:
            return
        job.exiting = True
        group = self.groups[job.group]
        gone = errors.JobFaulted(f"job {job.name!r} exited")
        self._fail_waiters(job, gone)
        # Answer its memory requests now: once reclaimed, a new job may take the same name.
        for p in [p for p in self._pending_allocs if p.job == job.name]:
            self._pending_allocs.remove(p)
            self._emit(FailRequest(p.ticket, gone))
        if group.holder == job.name:
            self._yield(group, now)
        if job.location in (Location.RESIDENT, Location.PARKED):
            self._reclaim(job, now)
        # else: reclaimed when its move finishes

    def _on_reclaim_finished(self, ev: ReclaimFinished, now: float) -> None:
        move = self._moves.get(ev.op)
        if move is None or move.kind != "reclaim":  # checked before popping: a raising event changes nothing
            raise ValueError(f"no reclaim with op {ev.op}")
        del self._moves[ev.op]
        job = self.jobs.pop(move.job)
        for s in job.sessions:
            self.sessions.pop(s, None)
        group = self.groups[job.group]
        if group.last_holder == job.name:
            group.last_holder = None

    def _on_force_release(self, ev: ForceReleaseRequested, now: float) -> dict[str, Any]:
        group = self._group(ev.group)
        if group.holder is None:
            raise errors.NotHolder(f"nobody holds group {group.name!r}")
        job = group.holder
        self._yield(group, now)
        self._emit(NotifyJob(job, "lock_lost", {"group": group.name, "reason": "released by an administrator"}))
        return {"group": group.name, "released": job}

    def _on_drain(self, ev: DrainRequested, now: float) -> dict[str, Any]:
        group = self._group(ev.group)
        group.draining = ev.on
        if ev.on:
            drained = errors.GroupDraining(f"group {group.name!r} was drained by an administrator")
            for w in list(group.queue):
                for ticket in list(w.tickets):
                    self._drop_ticket(group, w, ticket)
                    self._emit(FailRequest(ticket, drained))
            group.queue = [w for w in group.queue if w.tickets]
        return {"group": group.name, "draining": group.draining, "holder": group.holder}

    def _on_frozen(self, ev: GroupsFrozen, now: float) -> None:
        self._frozen = dict(ev.reasons)

    def frozen(self, group: str) -> str | None:
        """Why ``group`` may grant nothing now, or None."""
        return self._frozen.get(group)

    def _group(self, name: str) -> Group:
        group = self.groups.get(name)
        if group is None:
            raise errors.UnknownGroup(f"no group {name!r} (groups: {', '.join(sorted(self.groups)) or 'none'})")
        return group

    # --- the lock --------------------------------------------------------------------

    def _yield(self, group: Group, now: float) -> None:
        assert group.holder is not None
        job = self.jobs[group.holder]
        held = now - group.held_since
        job.gpu_seconds += held * len(group.gpus)
        group.held_total_s += held
        group.last_holder = group.holder
        group.holder = None
        group.holder_sessions.clear()
        group.overdue_since = None

    def _advance_all(self, now: float) -> None:
        for group in self.groups.values():
            self._advance(group, now)

    def _advance(self, group: Group, now: float) -> None:
        """Grant the head of the queue, or start the switch it needs."""
        if group.name in self._frozen:
            return  # a node of the group is out of reach: nothing is granted or moved until it is back
        if group.holder is not None:
            self._police_slice(group, now)
        if group.holder is None and group.switch is None and group.queue and not group.draining:
            head = group.queue[0]
            if not head.tickets:
                return  # a kept turn: the group waits for its job to ask again (or the turn to lapse)
            job = self.jobs[head.job]  # never faulted or exiting: those leave the queue at once
            if job.location is not Location.RESIDENT and job.location is not Location.PARKED:
                return  # being parked by another group's switch; go on when that ends
            victims = self._plan_switch(job)
            if victims is None:
                if group.blocked != job.name:
                    group.blocked = job.name
                    group.deferred += 1
                return  # waits until memory frees up (a holder elsewhere yields, a job exits)
            group.blocked = None
            if not victims and job.location is Location.RESIDENT:
                self._grant(group, head, now, switch_s=0.0, restored=False, switched=False)
                return
            group.switch = Switch(job.name, now)
            for v in victims:
                group.switch.pending.add(self._start_move(v, "snapshot", now))
            if not group.switch.pending:
                self._continue_switch(group, now)

    def _others_wait(self, group: Group) -> bool:
        return any(w.tickets for w in group.queue) and not group.draining

    def _police_slice(self, group: Group, now: float) -> None:
        """Warn a holder past its maximum slice while others wait; preempt it after the grace."""
        policy = self.policy(group.name)
        assert group.holder is not None
        if policy is None or not self._others_wait(group) or now < group.held_since + policy.max_slice:
            return
        held = now - group.held_since
        data: dict[str, object] = {"group": group.name, "fence": group.fence, "held_s": held}
        data.update(max_slice_s=policy.max_slice, action=policy.action)
        if group.overdue_since is None:
            group.overdue_since = now
            why = f"held group {group.name!r} for {held:.1f} s, past its maximum slice of {policy.max_slice:g} s"
            if policy.action == "preempt":
                why += f"; it is parked in {policy.grace:g} s unless it yields"
            self._emit(NotifyJob(group.holder, "slice_overdue", {**data, "reason": why + " (others wait)"}))
        if policy.action == "preempt" and now >= group.overdue_since + policy.grace:
            self._preempt(group, now, data)

    def _preempt(self, group: Group, now: float, data: dict[str, object]) -> None:
        """Take the lock from a holder that kept it too long, park it, and queue it again."""
        assert group.holder is not None
        job = self.jobs[group.holder]
        sessions = set(group.holder_sessions)
        reason = (
            f"preempted: held group {group.name!r} for {data['held_s']:.1f} s, past its maximum slice of "
            f"{data['max_slice_s']:g} s, while others waited; queued again"
        )
        self._yield(group, now)
        group.preemptions += 1
        job.preemptions += 1
        self._emit(NotifyJob(job.name, "preempted", {**data, "reason": reason}))
        group.queue.append(Waiter(job.name, now, {(s, AUTO): None for s in sessions}))
        if job.location is Location.RESIDENT:
            self._start_move(job, "snapshot", now)  # its next GPU access waits until it is granted again

    def _continue_switch(self, group: Group, now: float) -> None:
        """All snapshots of the switch are done: restore, or re-plan, or give up."""
        switch = group.switch
        assert switch is not None
        job = self.jobs.get(switch.incoming)
        # The incoming job may have left the queue (cancel, timeout, closed session,
        # exit) while others were parked for it: restoring it now would only delay
        # the new head of the queue.
        wanted = bool(group.queue) and group.queue[0].job == switch.incoming
        if switch.restoring or not wanted or job is None or job.faulted:
            self._finish_switch(group, now)
            return
        victims = self._plan_switch(job)
        if victims is None:
            group.switch = None  # a victim faulted and still holds memory; wait for memory
            group.blocked = job.name
            group.deferred += 1
            return
        if victims:
            for v in victims:
                switch.pending.add(self._start_move(v, "snapshot", now))
            return
        if job.location is not Location.PARKED:
            self._finish_switch(group, now)  # resident all along: only others had to make room
            return
        switch.restoring = True
        switch.pending.add(self._start_move(job, "restore", now))

    def _plan_switch(self, job: Job) -> list[Job] | None:
        """The jobs to park before ``job`` may hold its group, or None to wait."""
        need = {gpu: n for gpu, n in job.footprint.items() if n} if job.location is Location.PARKED else {}
        victims = self._plan_evictions(need, exclude={job.name})
        rivals = self._exclusive_rivals(job)
        if victims is None or rivals is None:
            return None
        return victims + [r for r in rivals if r not in victims]

    def _exclusive_rivals(self, job: Job) -> list[Job] | None:
        """Resident jobs that must be parked because ``job`` or they need the GPUs to themselves.

        None when one of them cannot be parked now (it holds a lock or is on the
        move); faulted and exiting jobs are passed over: parking them is not possible.
        """
        gpus = set(self.groups[job.group].gpus)
        rivals: list[Job] = []
        for other in self.jobs.values():
            if other is job or not other.location.occupies_device or other.faulted or other.exiting:
                continue
            if not (job.exclusive or other.exclusive) or not gpus & set(self.groups[other.group].gpus):
                continue
            if not other.exclusive and not any(other.footprint.get(gpu) for gpu in gpus):
                continue  # a sim job with nothing on these GPUs
            busy = self._holds(other) or any(
                g.switch is not None and g.switch.incoming == other.name for g in self.groups.values()
            )
            if busy or other.location is not Location.RESIDENT:
                return None
            rivals.append(other)
        return sorted(rivals, key=lambda j: j.last_granted)

    def _finish_switch(self, group: Group, now: float) -> None:
        switch = group.switch
        assert switch is not None
        group.switch = None
        job = self.jobs.get(switch.incoming)
        if (
            job is not None
            and group.queue
            and group.queue[0].job == job.name
            and job.location is Location.RESIDENT
            and not job.faulted
        ):
            self._grant(
                group, group.queue[0], now, switch_s=now - switch.started_at, restored=switch.restoring, switched=True
            )

    def _grant(
        self, group: Group, waiter: Waiter, now: float, *, switch_s: float, restored: bool, switched: bool
    ) -> None:
        assert group.queue[0] is waiter
        group.queue.pop(0)
        job = self.jobs[waiter.job]
        group.fence += 1
        group.grants += 1
        group.holder = job.name
        group.holder_sessions = {s for s, _ in waiter.tickets}
        group.held_since = now
        waited = now - waiter.enqueued_at
        group.wait_times.append(waited)
        job.waits.append(waited)
        job.slices += 1
        job.last_granted = now
        if switched:
            group.switches += 1
            group.switch_times.append(switch_s)
        self._emit(
            GrantLock(
                group.name, job.name, group.fence, waited, switch_s, restored, tuple(waiter.tickets), switched=switched
            )
        )

    def _drop_ticket(self, group: Group, waiter: Waiter, ticket: Ticket) -> None:
        del waiter.tickets[ticket]
        if not waiter.tickets and group.blocked == waiter.job:
            group.blocked = None  # its next wait is a new one
        if not waiter.tickets:
            group.queue.remove(waiter)

    def _waiter_of_ticket(self, ticket: Ticket) -> tuple[Group, Waiter] | None:
        name = self.sessions.get(ticket[0])
        if name is None:
            return None
        group = self.groups[self.jobs[name].group]
        for w in group.queue:
            if ticket in w.tickets:
                return group, w
        return None

    # --- memory ----------------------------------------------------------------------

    def _plan_evictions(self, need: dict[int, int], exclude: set[str]) -> list[Job] | None:
        """Idle resident jobs to park so that ``need`` (gpu -> bytes) fits, or None.

        Holders, jobs on the move, faulted or exiting jobs and ``exclude`` are
        never evicted; among the rest the least recently granted go first.
        """
        holders = {g.holder for g in self.groups.values() if g.holder is not None}
        incoming = {g.switch.incoming for g in self.groups.values() if g.switch is not None}
        candidates = sorted(
            (
                j
                for j in self.jobs.values()
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

    def _reserve(self, job: Job, gpu: int, nbytes: int, requested: int, ticket: Ticket) -> None:
        job.footprint[gpu] = job.footprint.get(gpu, 0) + nbytes
        self._emit(AllocateRegion(ticket, job.name, gpu, nbytes, requested))

    def _retry_allocs(self, op: int) -> None:
        still: list[_PendingAlloc] = []
        for p in self._pending_allocs:
            p.ops.discard(op)
            if p.ops:
                still.append(p)
                continue
            job = self.jobs.get(p.job)
            if job is None or job.location is not Location.RESIDENT or job.faulted or job.exiting:
                self._emit(FailRequest(p.ticket, errors.NotResident(f"job {p.job!r} was parked while allocating")))
            elif p.nbytes > self.capacities[p.gpu] - self.used(p.gpu):
                self._emit(FailRequest(p.ticket, errors.OutOfMemory(self._oom_message(p.gpu, p.nbytes, p.job))))
            else:
                self._reserve(job, p.gpu, p.nbytes, p.requested, p.ticket)
        self._pending_allocs = still

    def _oom_message(self, gpu: int, nbytes: int, job: str) -> str:
        cap = self.capacities[gpu]
        others = sorted(
            f"{j.name} ({j.footprint[gpu]} B, {'holding' if self._holds(j) else j.location.value})"
            for j in self.jobs.values()
            if j.name != job and j.location.occupies_device and j.footprint.get(gpu)
        )
        return (
            f"GPU {gpu}: cannot allocate {nbytes} bytes for job {job!r}: {cap - self.used(gpu)} of {cap} bytes free"
            + (f"; also on it: {', '.join(others)}" if others else "")
        )

    def _holds(self, job: Job) -> bool:
        return self.groups[job.group].holder == job.name

    def _start_move(self, job: Job, kind: str, now: float) -> int:
        job.location = moved(job.location, Cause.SNAPSHOT_STARTED if kind == "snapshot" else Cause.RESTORE_STARTED)
        op = self._next_op
        self._next_op += 1
        self._moves[op] = _Move(op, job.name, kind, now)
        self._emit(SnapshotJob(op, job.name) if kind == "snapshot" else RestoreJob(op, job.name))
        return op

    def _reclaim(self, job: Job, now: float) -> None:
        op = self._next_op
        self._next_op += 1
        self._moves[op] = _Move(op, job.name, "reclaim", now)
        self._emit(ReclaimJob(op, job.name))

    def _fault(self, job: Job, reason: str) -> None:
        job.faulted = reason
        self._emit(NotifyJob(job.name, "faulted", {"job": job.name, "reason": reason}))
        # A faulted job is never granted again: tell its waiters now rather than when it reaches the head.
        self._fail_waiters(job, errors.JobFaulted(f"job {job.name!r} is faulted: {reason}"))

    def _fail_waiters(self, job: Job, error: errors.TimeslicedError) -> None:
        group = self.groups[job.group]
        for w in [w for w in group.queue if w.job == job.name]:
            for ticket in list(w.tickets):
                self._drop_ticket(group, w, ticket)
                self._emit(FailRequest(ticket, error))
            if w in group.queue:
                group.queue.remove(w)  # a kept turn

    def _check_usable(self, job: Job) -> None:
        if job.faulted:
            raise errors.JobFaulted(f"job {job.name!r} is faulted: {job.faulted}")
        if job.exiting:
            raise errors.JobFaulted(f"job {job.name!r} exited; its state is being reclaimed")

    def _emit(self, effect: Effect) -> None:
        self._effects.append(effect)

    # --- status ----------------------------------------------------------------------

    def describe(self, now: float) -> dict[str, Any]:
        """A plain-data picture of the scheduler for ``status`` and the dashboard."""
        return {
            "devices": [
                {
                    "index": gpu,
                    "capacity": cap,
                    "used": self.used(gpu),
                    "jobs": {
                        j.name: {"bytes": j.footprint[gpu], "location": j.location.value}
                        for j in self.jobs.values()
                        if j.footprint.get(gpu)
                    },
                }
                for gpu, cap in sorted(self.capacities.items())
            ],
            "groups": [self._describe_group(g, now) for g in self.groups.values()],
            "jobs": [
                {
                    "job": j.name,
                    "group": j.group,
                    "location": j.location.value,
                    "faulted": j.faulted or None,
                    "sessions": len(j.sessions),
                    "pids": sorted(j.pids),
                    "footprint": {str(k): v for k, v in sorted(j.footprint.items())},
                    "slices": j.slices,
                    "restores": j.restores,
                    "snapshots": j.snapshots,
                    "preemptions": j.preemptions,
                    "gpu_seconds": j.gpu_seconds + (self._held_for(j, now) * len(self.groups[j.group].gpus)),
                    "bytes_moved": j.bytes_moved,
                    "median_wait_s": median(j.waits),
                }
                for j in self.jobs.values()
            ],
        }

    def _held_for(self, job: Job, now: float) -> float:
        group = self.groups[job.group]
        return now - group.held_since if group.holder == job.name else 0.0

    def _describe_group(self, g: Group, now: float) -> dict[str, Any]:
        return {
            "group": g.name,
            "gpus": list(g.gpus),
            "state": self.group_state(g).value,
            "holder": g.holder,
            "held_s": now - g.held_since if g.holder else None,
            "fence": g.fence,
            "queue": [
                {
                    "job": w.job,
                    "waited_s": now - w.enqueued_at,
                    "requests": len(w.tickets),
                    "kept_for_s": None if w.tickets or w.kept_until is None else max(0.0, w.kept_until - now),
                    "preempted": any(t[1] == AUTO for t in w.tickets),
                }
                for w in g.queue
            ],
            "overdue_s": None if g.overdue_since is None else now - g.overdue_since,
            "max_slice_s": p.max_slice if (p := self.policy(g.name)) else None,
            "slice_action": p.action if p else None,
            "preemptions": g.preemptions,
            "switching_to": g.switch.incoming if g.switch else None,
            "draining": g.draining,
            "frozen": self._frozen.get(g.name),
            "deferred": g.deferred,
            "grants": g.grants,
            "switches": g.switches,
            "bytes_moved": g.bytes_moved,
            "median_switch_s": median(g.switch_times),
            "p95_switch_s": percentile(g.switch_times, 0.95),
            "median_wait_s": median(g.wait_times),
            "lock_duty": (g.held_total_s + (now - g.held_since if g.holder else 0.0)) / max(now - g.created_at, 1e-9),
        }
