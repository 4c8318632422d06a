"""The scheduler core: groups, jobs, lock queues and GPU residency (pure).

No I/O, no asyncio, no clock: every input carries ``now`` and every output is
an effect for the shell to carry out (``drain()``). ``next_deadline()`` tells
the shell when to call ``handle_timers(now)``.

``Scheduler`` is the façade: it routes each input to the concerns that own its parts,
runs it as one step, and owns the effect buffer. The concerns, one module each:

- ``registry``: sessions, jobs and groups by name, and registration;
- ``queues``: each group's holder and queue of waiters, request deadlines, kept turns, gangs;
- ``policy``: who of a group's waiters goes next (``fifo``, ``priority``, ``fair``);
- ``ledger``: capacities, footprints, eviction plans, allocations waiting for snapshots;
- ``host``: the host memory parked state takes on each node, and the admission of parks against it;
- ``moves``: snapshots, restores and reclaims in flight, and every change of a job's location
  (through the table in ``location``);
- ``slices``: the maximum slice policies;
- ``arbiter``: who is granted next, and the switch that must happen first;
- ``figures``: counts and samples for ``describe`` (``status``);
- ``rebuild``: how a new cluster leader takes over what the nodes report.

A step either completes or changes nothing: before each write a concern notes in the step's
``undo.Journal`` what it is about to change, and a step that raises (a refused input, or a bug)
is rolled back from those notes; figures are counted, and effects kept, only once it completes.

Invariants (``check_invariants``), kept after every input:

- a group has at most one holding job, and that job is resident and not faulted;
- each group's queue holds a job at most once and, after its head (the choice of the
  group's queue policy, ``policy``), is in arrival order; a gang that waits has every member
  waiting and none holding (``queues``: gangs are granted whole, in one step);
  a faulted or exiting job never waits (its waiters are failed at once); a
  place without requests is a turn kept for a job whose daemon restarted, and
  it lapses at its deadline;
- a job that is parking or restoring has exactly one move in flight, and a
  job being reclaimed (exiting) never starts a move;
- fences grow strictly with every new grant of a group;
- on every GPU the bytes of jobs that occupy it (resident, parking, restoring)
  never exceed its capacity: a restore is started only once the memory is free;
- no park starts that the host's budget for parked state cannot hold (``host``);
- a group that nobody holds, is not switching and has a head with requests
  is waiting for something that moves on by itself (a holder, a move, a
  reclaim): a head that nothing under way will make room for is told why at
  once, so no waiter is ever left neither granted nor told.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

from .. import errors
from ..wire.status import SchedulerPicture
from . import invariants, status
from .anticipation import recent
from .arbiter import Arbiter
from .events import (
    AcquireRequested,
    AcquireWithdrawn,
    DrainRequested,
    Effect,
    Event,
    FaultCleared,
    ForceReleaseRequested,
    GrantLock,
    GroupsFrozen,
    HostMemoryRead,
    JobExited,
    JobRegistered,
    MemoryMeasured,
    MemoryReleased,
    MemoryRequested,
    MoveFinished,
    NotifyJob,
    ReclaimFinished,
    ReleaseRequested,
    SessionClosed,
    SessionId,
)
from .figures import Figures
from .host import HostLedger
from .ledger import MemoryLedger, PendingAlloc
from .location import Cause, Location
from .model import AUTO, Group, GroupState, Job
from .moves import Move, Moves
from .policy import QueuePolicies, QueuePolicy
from .queues import LockQueues
from .rebuild import Rebuild
from .registry import Registry
from .slices import SlicePolicies, SlicePolicy
from .undo import Fields, Journal

P = ParamSpec("P")
R = TypeVar("R")
FROZEN = Fields("_frozen")
FAULTED = Fields("faulted")
EXITING = Fields("exiting")
DRAINING = Fields("draining")
GAPS = Fields("gaps", "released_at")
MOVE_TIMES = Fields("move_times")


class Scheduler:
    """Decides who holds each group and what must move between device and host."""

    def __init__(
        self,
        capacities: dict[int, int],
        *,
        max_waiters: int = 1024,
        policies: dict[str, SlicePolicy] | None = None,
        memory_headroom: int = 0,
        prefetch: bool = True,
        stream_switches: bool = False,
        queue_policies: dict[str, QueuePolicy] | None = None,
        anticipate_s: float = 0.0,
    ) -> None:
        """``policies``: group -> its ``SlicePolicy``; ``queue_policies``: group -> its ``QueuePolicy``
        (default ``fifo``); in both the key ``"*"`` is every other group's.

        ``memory_headroom``: bytes kept free on each GPU of a job that declared its memory;
        ``prefetch``: restore a held group's head waiter into free room before its turn;
        ``stream_switches``: a restore that needs parked jobs' room starts with their snapshots,
        streaming into the room as it frees (``RestoreJob.streams_with``); ``anticipate_s``: keep a
        yielded holder's turn for at most this long when its gaps are shorter than a switch away and
        back (``anticipation``; 0: never). Raises ``ValueError`` for no GPUs or a negative headroom.
        """
        if not capacities:
            raise ValueError("a scheduler needs at least one GPU")
        self._journal = journal = Journal()
        self._effects: list[Effect] = []  # appended to in place: the concerns hold its ``append``
        emit = self._effects.append
        self.capacities = dict(capacities)
        self.registry = Registry(self.capacities, journal)
        self.groups, self.jobs, self.sessions = self.registry.groups, self.registry.jobs, self.registry.sessions
        self.figures = Figures()
        self.host = HostLedger(self.registry, journal)
        self.moves = Moves(self.registry, journal, emit)
        self.ledger = MemoryLedger(
            self.capacities, self.registry, self.host, journal, emit, self.moves.streams, memory_headroom
        )
        self.queues = LockQueues(self.registry, journal, emit, max_waiters)
        self.slices = SlicePolicies(dict(policies or {}))
        self.queue_policies = QueuePolicies(dict(queue_policies or {}))
        self.arbiter = Arbiter(
            self.registry,
            self.queues,
            self.ledger,
            self.moves,
            self.slices,
            self.figures,
            journal,
            emit,
            self.queue_policies,
            prefetch=prefetch,
            stream=stream_switches,
            anticipate_s=anticipate_s,
        )
        self._anticipating = anticipate_s > 0  # only then are gaps and move times kept (``anticipation``)
        self.arbiter.frozen = lambda: self._frozen
        self._rebuild = Rebuild(self.registry, self.ledger, self.queues, self.moves, journal)
        self._frozen: dict[str, str] = {}  # group -> why nothing may be granted in it now (GroupsFrozen)
        self._handlers: dict[type, Callable[[Any, float], Any]] = {
            JobRegistered: self._on_registered,
            SessionClosed: self._on_session_closed,
            AcquireRequested: self._on_acquire,
            AcquireWithdrawn: self._on_cancel,
            ReleaseRequested: self._on_release,
            MemoryRequested: self._on_memory_requested,
            MemoryReleased: self._on_memory_released,
            MoveFinished: self._on_move_finished,
            MemoryMeasured: self._on_memory_measured,
            JobExited: self._on_job_exited,
            ReclaimFinished: self._on_reclaim_finished,
            ForceReleaseRequested: self._on_force_release,
            DrainRequested: self._on_drain,
            GroupsFrozen: self._on_frozen,
            HostMemoryRead: self._on_host_read,
            FaultCleared: self._on_fault_cleared,
        }

    # --- shell interface -------------------------------------------------------------

    def handle(self, event: Event, now: float) -> Any:
        """Feed one event; returns its immediate result.

        Raises ``TimeslicedError`` for an input it refuses, ``ValueError`` for one that cannot be
        (a move that is not in flight, more memory freed than held). An event that raises, for
        those or for a bug, changes nothing and emits nothing.
        """
        return self._step(self._event, event, now)

    def _event(self, event: Event, now: float) -> Any:
        result = self._handlers[type(event)](event, now)
        self._advance(now)
        return result

    def _advance(self, now: float) -> None:
        """Advance every group until none acts: what one group did (a preemption, a grant, a waiter
        told why) may change what another, visited before it, waits for."""
        effects = self._effects
        for _ in range(len(self.groups) + 1):
            mark = len(effects)
            self.arbiter.advance_all(now, self._frozen)
            if len(effects) == mark or len(self.groups) < 2:
                return

    def handle_timers(self, now: float) -> None:
        """Expire every acquire whose deadline is at or before ``now``, and police slices."""
        self._step(self._on_timers, now)

    def next_deadline(self) -> float | None:
        """When ``handle_timers`` must run next: an acquire's deadline, a slice, a kept turn."""
        times = [t for g in self.groups.values() if (t := self._group_deadline(g)) is not None]
        if (t := self.queues.next_deadline()) is not None:
            times.append(t)
        return min(times, default=None)

    def drain(self) -> list[Effect]:
        out = self._effects.copy()
        self._effects.clear()
        return out

    def _step(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn`` as one step: all of it, or (when it raises) none of it."""
        mark = len(self._effects)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self._roll_back(mark)
            raise
        self._journal.commit()
        self.figures.commit()
        return result

    def _roll_back(self, mark: int) -> None:
        self._journal.rollback()
        self.figures.discard()
        del self._effects[mark:]

    def _group_deadline(self, g: Group) -> float | None:
        """When the group's holder is due a warning or a preemption, or a kept turn lapses."""
        kept = self.queues.kept_deadline(g)
        policy = self.slices.policy(g.name) if g.holder is not None else None
        due = policy.due(g) if policy is not None and self.queues.others_wait(g) else None
        if due is not None and g.overdue_since is not None and not self.jobs[g.holder or ""].freezes:
            due = None  # warned already, and never preempted: see Arbiter._police
        if kept is None or due is None:
            return due if kept is None else kept
        return min(kept, due)

    # --- queries ---------------------------------------------------------------------

    @property
    def policies(self) -> dict[str, SlicePolicy]:
        return self.slices.policies

    def policy(self, group: str) -> SlicePolicy | None:
        return self.slices.policy(group)

    def frozen(self, group: str) -> str | None:
        """Why ``group`` may grant nothing now, or None."""
        return self._frozen.get(group)

    def used(self, gpu: int) -> int:
        return self.ledger.used(gpu)

    def group_state(self, group: Group) -> GroupState:
        return status.group_state(self.registry, group)

    def job_of(self, session: SessionId) -> Job:
        """Raises ``NotRegistered``."""
        return self.registry.job_of(session)

    def describe(self, now: float) -> SchedulerPicture:
        """A plain-data picture of the scheduler for ``status`` and the dashboard (``wire.status``)."""
        return status.describe(
            self.registry, self.ledger, self.slices, self._frozen, now, self.queue_policies, self.queues.gangs
        )

    def check_invariants(self, now: float | None = None) -> None:
        """Raise ``AssertionError`` if any invariant is broken (used by tests).

        With ``now``, also that no free group's head is left waiting for nothing (``invariants.live``).
        """
        invariants.check(self.registry, self.ledger, self.moves, self.queues.gangs)
        if now is not None:
            invariants.live(self.registry, self.ledger, self._frozen, now)

    @property
    def _moves(self) -> dict[int, Move]:
        """The moves in flight by op (read by the cluster's tests)."""
        return self.moves.in_flight

    # --- rebuilding (a new cluster leader takes over what the nodes report), each call one step

    def add_devices(self, capacities: dict[int, int]) -> None:
        """GPUs of a node that joined; known GPUs keep their capacity."""
        self._step(self.ledger.add_devices, capacities)

    def adopt_group(self, name: str, gpus: tuple[int, ...], now: float) -> None:
        """Raises ``ValueError`` for a known group or GPUs the scheduler does not know."""
        self._step(self._rebuild.adopt_group, name, gpus, now)

    def extend_group(self, name: str, gpus: Iterable[int]) -> None:
        """The group also spans ``gpus`` (another node's, known GPUs only)."""
        self._step(self._rebuild.extend_group, name, gpus)

    def shrink_group(self, name: str, gpus: Iterable[int]) -> None:
        """The group keeps only ``gpus`` (the nodes where it still has jobs); never none."""
        self._step(self._rebuild.shrink_group, name, gpus)

    def forget_group(self, name: str) -> int:
        """Drop a group that has no jobs left; returns its fence (new grants must go above it)."""
        return self._step(self._rebuild.forget_group, name)

    def adopt_job(
        self,
        name: str,
        group: str,
        exclusive: bool,
        location: Location,
        footprint: dict[int, int],
        faulted: str = "",
        freezes: bool = True,
        priority: int = 0,
        weight: float = 1.0,
    ) -> None:
        """A job the nodes report, with where its state lives and what it holds on each GPU."""
        self._step(
            self._rebuild.adopt_job, name, group, exclusive, location, footprint, faulted, freezes, priority, weight
        )

    def adopt_holder(self, group: str, job: str, sessions: set[SessionId], fence: int, now: float) -> None:
        """``job`` holds ``group`` through ``sessions`` under ``fence`` (granted by an earlier leader)."""
        self._step(self._rebuild.adopt_holder, group, job, sessions, fence, now)

    def raise_fence(self, group: str, fence: int) -> None:
        """New grants of ``group`` get fences above ``fence`` (the highest any node has seen)."""
        self._step(self._rebuild.raise_fence, group, fence)

    def settle(self, name: str, now: float, footprint: dict[int, int]) -> None:
        """Park a job that some nodes hold resident and others parked (a switch cut short).

        It was adopted with the memory of its resident parts only (what the GPUs really
        hold); once parked everywhere it owns ``footprint``, its memory on every node.
        """
        self._step(self._rebuild.settle, name, now, footprint)

    def keep_turn(self, name: str, until: float, now: float) -> None:
        """Keep a place in its group's queue for job ``name`` until ``until``, with no request yet.

        A daemon that restarted knows who held or waited; their clients come back with new
        connections and ask again. Their places are kept (the group waits for them) until
        they do or the deadline passes.
        """
        self._step(self._rebuild.keep_turn, name, until, now)

    def carry_figures(self, old: Scheduler) -> None:
        """Take the figures (counts, times, samples) of groups and jobs that ``old`` also had.

        A leader that takes stock again within its term keeps them; state comes from the nodes.
        """
        self._step(self._rebuild.carry_figures, old.groups, old.jobs)

    # --- events ----------------------------------------------------------------------

    def _on_registered(self, ev: JobRegistered, now: float) -> dict[str, Any]:
        policy = self.slices.policy(ev.group)
        if not ev.freezes and ev.job not in self.jobs and policy is not None and policy.action == "preempt":
            raise errors.PreemptionUnsafe(
                f"group {ev.group!r} preempts a holder past its maximum slice of {policy.max_slice:g} s, and job "
                f"{ev.job!r} is parked by a method that cannot stop its GPU work first (offload, vllm, sglang): "
                "parking it without its yield would unmap memory under running kernels. Register it in a group "
                "whose slice action is warn, or park it with cuda-checkpoint"
            )
        return self.registry.register(ev, now)

    def _on_session_closed(self, ev: SessionClosed, now: float) -> None:
        job = self.registry.close(ev.session)
        if job is None:
            return
        group = self.groups[job.group]
        self.queues.drop_session(group, ev.session)
        self.ledger.forget_session(ev.session)
        if group.holder == job.name and self.queues.leave(group, ev.session):
            self.arbiter.yield_lock(group, now)

    def _on_acquire(self, ev: AcquireRequested, now: float) -> None:
        job = self.registry.job_of(ev.session)
        self._check_usable(job)
        group = self.groups[job.group]
        ticket = (ev.session, ev.request_id)
        if group.holder == job.name:
            if ev.gang is not None:
                raise errors.BadRequest(
                    f"job {job.name!r} holds group {group.name!r} already: a gang acquires groups its members "
                    "do not hold; release it first"
                )
            self.queues.join(group, ev.session)
            self._effects.append(GrantLock(group.name, job.name, group.fence, 0.0, 0.0, False, (ticket,), again=True))
            return
        if group.draining:
            raise errors.GroupDraining(f"group {group.name!r} is drained by an administrator; try again later")
        if self._anticipating:
            self._gap_ended(job, now)
        if ev.gang is not None:
            self.queues.end_kept_turn(group, job.name)
            self.queues.join_gang(group, job.name, ticket, ev.deadline, ev.gang, ev.members, now)
            return
        self.queues.enqueue(group, job.name, ticket, ev.deadline, now)

    def _gap_ended(self, job: Job, now: float) -> None:
        """``job`` asks again after releasing its group: the gap it took counts (``anticipation``)."""
        if job.released_at is not None:
            self._journal.fields(job, GAPS)
            job.gaps, job.released_at = recent(job.gaps, now - job.released_at), None

    def _on_cancel(self, ev: AcquireWithdrawn, now: float) -> dict[str, bool]:
        job = self.registry.job_of(ev.session)
        # False: already granted or failed, and the reply is on its way
        return {"cancelled": self.queues.withdraw(self.groups[job.group], (ev.session, ev.request_id))}

    def _on_release(self, ev: ReleaseRequested, now: float) -> dict[str, Any]:
        job = self.registry.job_of(ev.session)
        group = self.groups[job.group]
        if group.holder != job.name:
            requeued = self.queues.find(group, (ev.session, AUTO))
            if requeued is not None:
                # Preempted, and done before its turn came back: it no longer wants the lock.
                self.queues.drop(group, requeued, (ev.session, AUTO))
                return {"group": group.name, "fence": group.fence, "held_s": 0.0, "preempted": True}
            holder = f"job {group.holder!r}" if group.holder else "nobody"
            raise errors.NotHolder(f"job {job.name!r} does not hold group {group.name!r} ({holder} does)")
        if ev.session not in group.holder_sessions:
            raise errors.NotHolder(
                f"this connection does not hold group {group.name!r}: job {job.name!r} holds it through another"
            )
        held_s = now - group.held_since
        if self.queues.leave(group, ev.session):
            self.arbiter.yield_lock(group, now)
            if self._anticipating:
                self._journal.fields(job, GAPS)
                job.released_at = now
                self.arbiter.anticipate(group, job, now)
        return {"group": group.name, "fence": group.fence, "held_s": held_s}

    def _on_memory_requested(self, ev: MemoryRequested, now: float) -> None:
        if ev.nbytes < 0:
            raise ValueError(f"cannot allocate {ev.nbytes} bytes")
        job = self.registry.job_of(ev.session)
        group = self.groups[job.group]
        if ev.gpu not in group.gpus:
            raise errors.UnknownDevice(f"GPU {ev.gpu} is not in group {group.name!r} (GPUs {list(group.gpus)})")
        self._check_usable(job)
        if job.location is not Location.RESIDENT:
            raise errors.NotResident(f"job {job.name!r} is {job.location.value}; acquire the lock first")
        ticket, requested = (ev.session, ev.request_id), ev.requested or ev.nbytes
        if self.ledger.fits(ev.gpu, ev.nbytes):
            self.ledger.reserve(job, ev.gpu, ev.nbytes, requested, ticket)
            return
        leaving = self.moves.leaving(ev.gpu)
        # raises OutOfMemory, or InsufficientHostMemory when the parks would not fit the host
        victims = self.ledger.plan_request(job, ev.gpu, ev.nbytes, leaving, now)
        ops = {op for op, n in leaving.items() if n} | {self.moves.start(v, "snapshot", now) for v in victims}
        self.ledger.wait(PendingAlloc(ticket, job.name, ev.gpu, ev.nbytes, requested, ops))

    def _on_memory_released(self, ev: MemoryReleased, now: float) -> None:
        self.ledger.release(ev)

    def _on_memory_measured(self, ev: MemoryMeasured, now: float) -> None:
        """Raises ``ValueError`` for a negative figure; a job that is gone is passed over."""
        if any(n < 0 for n in ev.gpus.values()):
            raise ValueError(f"job {ev.job!r} cannot hold a negative number of bytes")
        job = self.jobs.get(ev.job)
        if job is not None:
            self.ledger.measured(job, {g: n for g, n in ev.gpus.items() if g in self.capacities})

    def _on_move_finished(self, ev: MoveFinished, now: float) -> None:
        move, cause = self.moves.finish(ev)  # raises ValueError for an unknown op
        job = self.jobs[move.job]
        group = self.groups[job.group]
        done = {Cause.SNAPSHOT_DONE: "snapshot", Cause.RESTORE_DONE: "restore"}.get(cause)
        self.figures.moved(group, job, ev.nbytes, done)
        if done is not None and self._anticipating:
            self._journal.fields(job, MOVE_TIMES)
            job.move_times = recent(job.move_times, ev.seconds if ev.seconds > 0 else now - move.started_at)
        if cause is Cause.SNAPSHOT_DONE:
            self.host.parked(job, ev.by_slot, ev.nbytes)
        elif cause in (Cause.RESTORE_DONE, Cause.RESTORE_UNKNOWN):
            self.host.unparked(job, now)
        failed = None
        if done is None and ev.intact and not ev.kept_memory:
            # Its state is whole where the move began: the job stays usable, and the move is tried again later.
            reason = f"{move.kind} failed: {ev.error or 'no reason given'}"
            if move.kind == "snapshot":
                self.host.refuse(job, reason, ev.code, now)
            data: dict[str, object] = {"job": job.name, "kind": move.kind, "reason": reason, "intact": True}
            self._effects.append(NotifyJob(job.name, "move_failed", data))
            if move.kind == "restore":
                failed = self._switch_error(job, reason, ev.code)
        elif done is None:
            self._fault(job, f"{move.kind} failed: {ev.error}")
        if job.exiting:
            self.moves.reclaim(job, now)
        self.arbiter.move_finished(ev.op, now, failed)
        self.ledger.retry(ev.op)

    def _switch_error(self, job: Job, reason: str, code: str) -> errors.TimeslicedError:
        message = (
            f"job {job.name!r} could not be restored ({reason}); its state is intact in host memory. Try again later"
        )
        if code == errors.InsufficientHostMemory.code:
            return errors.InsufficientHostMemory(message)
        return errors.SwitchFailed(message)

    def _on_job_exited(self, ev: JobExited, now: float) -> None:
        job = self.jobs.get(ev.job)
        if job is None or job.exiting:
            return
        self._journal.fields(job, EXITING)
        job.exiting = True
        self.host.freed(None, now)  # a job exited: a park refused a moment ago may go now
        group = self.groups[job.group]
        gone = errors.JobFaulted(f"job {job.name!r} exited")
        self.queues.fail_job(group, job.name, gone)
        # Answer its memory requests now: once reclaimed, a new job may take the same name.
        self.ledger.fail_job(job.name, gone)
        if group.holder == job.name:
            self.arbiter.yield_lock(group, now)
        if job.location in (Location.RESIDENT, Location.PARKED):
            self.moves.reclaim(job, now)
        # else: reclaimed when its move finishes

    def _on_reclaim_finished(self, ev: ReclaimFinished, now: float) -> None:
        move = self.moves.finish_reclaim(ev.op)  # raises ValueError for an unknown op
        self.host.unparked(self.jobs[move.job], now)  # its parked state is gone from its nodes' hosts
        self.registry.forget_job(move.job)
        self.moves.forgotten(move.job)

    def _on_force_release(self, ev: ForceReleaseRequested, now: float) -> dict[str, Any]:
        group = self.registry.group(ev.group)
        if group.holder is None:
            raise errors.NotHolder(f"nobody holds group {group.name!r}")
        job = group.holder
        self.arbiter.yield_lock(group, now)
        self._effects.append(
            NotifyJob(job, "lock_lost", {"group": group.name, "reason": "released by an administrator"})
        )
        return {"group": group.name, "released": job}

    def _on_drain(self, ev: DrainRequested, now: float) -> dict[str, Any]:
        group = self.registry.group(ev.group)
        self._journal.fields(group, DRAINING)
        group.draining = ev.on
        if ev.on:
            self.queues.fail_all(group, errors.GroupDraining(f"group {group.name!r} was drained by an administrator"))
        return {"group": group.name, "draining": group.draining, "holder": group.holder}

    def _on_frozen(self, ev: GroupsFrozen, now: float) -> None:
        self._journal.fields(self, FROZEN)
        self._frozen = dict(ev.reasons)

    def _on_host_read(self, ev: HostMemoryRead, now: float) -> None:
        """Raises ``ValueError`` for a negative limit."""
        self.host.read(ev.slot, ev.room, ev.limit, ev.pools, ev.members, ev.sizes, ev.source, now)

    def _on_fault_cleared(self, ev: FaultCleared, now: float) -> dict[str, Any]:
        """Raises ``UnknownJob``, ``BadRequest`` (not faulted, or on the move) or ``JobFaulted`` (exiting)."""
        job = self.jobs.get(ev.job)
        if job is None:
            raise errors.UnknownJob(f"no job {ev.job!r} (jobs: {', '.join(sorted(self.jobs)) or 'none'})")
        if not job.faulted:
            raise errors.BadRequest(f"job {job.name!r} is not faulted: there is nothing to resume")
        if job.exiting:
            raise errors.JobFaulted(f"job {job.name!r} exited; its state is being reclaimed")
        if job.location.moving:
            raise errors.BadRequest(f"job {job.name!r} is {job.location.value}; resume it once that move ends")
        reason = job.faulted
        self._journal.fields(job, FAULTED)
        job.faulted = ""
        self.host.clear(job)
        self._effects.append(NotifyJob(job.name, "resumed", {"job": job.name, "was": reason}))
        return {"job": job.name, "group": job.group, "location": job.location.value, "was": reason}

    def _on_timers(self, now: float) -> None:
        self.queues.expire(now)
        self._advance(now)

    def _fault(self, job: Job, reason: str) -> None:
        self._journal.fields(job, FAULTED)
        job.faulted = reason
        self._effects.append(NotifyJob(job.name, "faulted", {"job": job.name, "reason": reason}))
        # A faulted job is never granted again: tell its waiters now rather than when it reaches the head.
        self.queues.fail_job(
            self.groups[job.group], job.name, errors.JobFaulted(f"job {job.name!r} is faulted: {reason}")
        )

    def _check_usable(self, job: Job) -> None:
        if job.faulted:
            raise errors.JobFaulted(f"job {job.name!r} is faulted: {job.faulted}")
        if job.exiting:
            raise errors.JobFaulted(f"job {job.name!r} exited; its state is being reclaimed")
