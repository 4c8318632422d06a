"""Random workloads against the scheduler core, checked against a small model.

A ``Run`` drives one scheduler with random sessions doing random things, moves
finishing in random order (some failing) and time advancing. The model keeps
what a client could observe (who waits in which order, who holds, what was
answered) and, after every step, the core must agree with it:

- ``check_invariants()`` holds;
- every ticket is answered at most once, never after it was cancelled, timed
  out or its session closed;
- new grants go to the head of the modelled queue (FIFO) and their fences
  strictly increase per group; ``again`` grants repeat the holder's fence;
- a holder past its maximum slice is warned, and in a ``preempt`` group it
  loses the lock and is queued again at the tail (its automatic request);
- the core's queues and holders equal the model's;
- no GPU is ever over capacity;
- no park starts that the host's budget cannot hold (readings of the host come
  in at random, some with a limit, a pool or measured sizes);
- moves fail of both kinds: with the job's state intact (the job stays usable,
  never faulted) and with it damaged (faulted until it exits or an operator
  resumes it);
- every waiter can be granted or has been told why: a free group's head waits
  only for jobs that move on by themselves (``check_invariants(now)``), and a
  waiter failed for want of room names a cause that is there;
- an input that raises changes nothing and emits nothing, and so does an input
  during which any call inside the core raises (a bug; ``FaultyRun``).

At the end the run is quiesced (every move finishes, holders yield, faulted
jobs exit): every queue must drain, so no group can get stuck.

The same driver runs under hypothesis (shrinkable choices) and as long seeded
runs that reach deeper states.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timesliced import errors
from timesliced.core.events import (
    AcquireRequested,
    AcquireWithdrawn,
    AllocateRegion,
    DrainRequested,
    Effect,
    Event,
    FailRequest,
    FaultCleared,
    ForceReleaseRequested,
    GrantLock,
    HostMemoryRead,
    JobExited,
    JobRegistered,
    MemoryMeasured,
    MemoryReleased,
    MemoryRequested,
    MoveFinished,
    NotifyJob,
    ReclaimFinished,
    ReclaimJob,
    ReleaseRequested,
    RestoreJob,
    SessionClosed,
    SnapshotJob,
    Ticket,
)
from timesliced.core.host import refused
from timesliced.core.location import Location
from timesliced.core.model import AUTO, Refuse
from timesliced.core.scheduler import Scheduler
from timesliced.core.slices import SlicePolicy
from timesliced.util.parse import exact_size

from ..helpers.harness import Fault, Faults, core_state

CAPACITIES = {0: 100, 1: 100, 2: 100}
GROUPS = {"g0": (0, 1), "g1": (1, 2), "g2": (0,)}  # g0 shares GPU 0 with g2 and GPU 1 with g1
JOBS = {"a": "g0", "b": "g0", "c": "g0", "j": "g0", "d": "g1", "e": "g1", "f": "g2", "h": "g2", "i": "g2"}
EXCLUSIVE = {"c", "e", "h"}  # parked whole like real processes; the rest account their memory
# Real processes too, that declare their memory on each of their GPUs: they may stay resident beside
# others, be prefetched while their group is held, and grow past their declaration (``MemoryMeasured``).
DECLARED = {"j": 30, "i": 45}
HEADROOM = 5
HOST_CODES = ["insufficient_host_memory", "park_refused", ""]  # what a failed move with its job intact says
MAX_WAITERS = 2  # g0 has four jobs: one holds, two wait, the fourth is refused
POLICIES = {"g0": SlicePolicy(1.0, "preempt", grace=0.5), "g1": SlicePolicy(3.0, "warn")}  # g2 has none


class Run:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.stream = rng.random() < 0.5  # half the runs stream their switches' restores into their snapshots' room
        self.s = Scheduler(
            CAPACITIES,
            max_waiters=MAX_WAITERS,
            policies=POLICIES,
            memory_headroom=HEADROOM,
            prefetch=True,
            stream_switches=self.stream,
        )
        self.prefetched = 0  # restores started while the group was held (prefetches)
        self.streamed = 0  # restores started together with their snapshots
        self.measured = 0
        self.now = 0.0
        self.next_sid = 1
        self.next_rid = 1
        self.sessions: dict[int, str | None] = {}  # open sessions -> registered job
        self.waiting: dict[str, dict[Ticket, float | None]] = {}  # job -> its waiting tickets -> deadline
        self.queues: dict[str, list[str]] = {}  # group -> waiting jobs in arrival order
        self.holders: dict[str, tuple[str, set[int]]] = {}  # group -> (job, sessions that acquired)
        self.fences: dict[str, int] = {}
        self.answered: set[Ticket] = set()
        self.dead: set[Ticket] = set()  # its session closed: never answered
        self.allocs: dict[Ticket, str] = {}  # memory requests not answered yet -> job
        self.moves: dict[int, str] = {}
        self.reclaims: dict[int, str] = {}
        self.grants = 0
        # what the current step expects
        self.cancelled: Ticket | None = None
        self.again: Ticket | None = None
        self.timers_ran = False
        self.restore_failed = False  # a restore failed this step: its waiter may be told so
        self.intact_failures = 0
        self.damaged_failures = 0
        self.told = 0  # waiters failed for want of room, with the cause named

    # --- plumbing ----------------------------------------------------------------------

    def snapshot_state(self) -> tuple[Any, ...]:
        return core_state(self.s, self.now)

    def feed(self, event: Event, expect: type[Exception] | None = None) -> Any:
        """Feed ``event``; if it raises, it must be ``expect`` and change nothing."""
        before = self.snapshot_state()
        try:
            result = self.s.handle(event, self.now)
        except (errors.TimeslicedError, ValueError) as exc:
            assert expect is not None and isinstance(exc, expect), (event, exc, expect)
            assert self.snapshot_state() == before, f"{event} raised {exc!r} but changed the scheduler"
            assert self.s.drain() == [], f"{event} raised {exc!r} but emitted effects"
            return exc
        assert expect is None, f"{event} should have raised {expect.__name__}"
        return result

    def job_of(self, sid: int) -> str | None:
        return self.sessions.get(sid)

    def group_of(self, job: str) -> str:
        return self.s.jobs[job].group

    def leave_queue(self, job: str, ticket: Ticket) -> None:
        tickets = self.waiting[job]
        del tickets[ticket]
        if not tickets:
            del self.waiting[job]
            self.queues[self.group_of(job)].remove(job)

    def ticket_job(self, ticket: Ticket) -> str | None:
        for job, tickets in self.waiting.items():
            if ticket in tickets:
                return job
        return None

    # --- steps ------------------------------------------------------------------------

    def step(self) -> None:
        self.cancelled = self.again = None
        self.timers_ran = self.restore_failed = False
        actions = [
            (self.register, 6),
            (self.acquire, 18),
            (self.cancel, 3),
            (self.release, 7),
            (self.close, 2),
            (self.alloc, 8),
            (self.free, 4),
            (self.exit, 2),
            (self.finish_move, 16),
            (self.finish_reclaim, 3),
            (self.tick, 6),
            (self.misuse, 1),
            (self.force_release, 1),
            (self.drain, 1),
            (self.read_host, 3),
            (self.resume, 1),
            (self.measure, 3),
        ]
        action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
        action()
        self.absorb(self.s.drain())
        self.check()

    def register(self) -> None:
        unbound = [sid for sid, job in self.sessions.items() if job is None]
        if unbound and self.rng.random() < 0.5:
            sid = self.rng.choice(unbound)
        elif self.sessions and self.rng.random() < 0.05:
            sid = self.rng.choice(list(self.sessions))  # maybe registered already
        else:
            sid = self.next_sid
            self.next_sid += 1
            self.sessions[sid] = None
        job = self.rng.choice(list(JOBS))
        group = JOBS[job]
        gpus = self.rng.choices([GROUPS[group], None, (2,)], [17, 2, 1])[0]
        expect: type[Exception] | None = None
        core_job = self.s.jobs.get(job)
        core_group = self.s.groups.get(group)
        if self.sessions[sid] is not None:
            expect = errors.AlreadyRegistered
        elif core_group is not None and gpus is not None and tuple(sorted(set(gpus))) != core_group.gpus:
            expect = errors.GroupMismatch
        elif core_job is not None and core_job.exiting:
            expect = errors.JobFaulted
        declared = DECLARED.get(job)
        event = JobRegistered(
            sid, job, group, gpus, (sid,), job in EXCLUSIVE or declared is not None, memory_each=declared
        )
        if self.feed(event, expect) is not None and expect is None:
            self.sessions[sid] = job

    def measure(self) -> None:
        """A reading of a job's device memory; the declared jobs may grow past their declaration."""
        if not self.s.jobs:
            return
        job = self.rng.choice(sorted(self.s.jobs))
        gpus = self.s.groups[self.s.jobs[job].group].gpus
        self.feed(MemoryMeasured(job, {g: self.rng.randint(0, 60) for g in gpus}))
        self.measured += 1

    def bound_session(self) -> int | None:
        """A registered session, mostly one whose job is neither faulted nor exiting."""
        bound = [sid for sid, job in self.sessions.items() if job is not None]
        usable = [sid for sid in bound if not (j := self.s.jobs[self.sessions[sid] or ""]).faulted and not j.exiting]
        if usable and self.rng.random() < 0.9:
            return self.rng.choice(usable)
        return self.rng.choice(bound) if bound else None

    def acquire(self) -> None:
        sid = self.bound_session()
        if sid is None:
            return
        job = self.job_of(sid)
        assert job is not None
        group = self.group_of(job)
        rid = self.next_rid
        self.next_rid += 1
        deadline = None if self.rng.random() < 0.5 else self.now + self.rng.uniform(0.1, 4.0)
        core = self.s.jobs[job]
        holder = self.holders.get(group)
        expect: type[Exception] | None = None
        if core.faulted or core.exiting:
            expect = errors.JobFaulted
        elif self.s.groups[group].draining and (holder is None or holder[0] != job):
            expect = errors.GroupDraining
        elif (
            (holder is None or holder[0] != job)
            and job not in self.queues.get(group, [])
            and len(self.queues.get(group, [])) >= MAX_WAITERS
        ):
            expect = errors.LimitExceeded
        self.feed(AcquireRequested(sid, rid, deadline), expect)
        if expect is not None:
            return
        if holder is not None and holder[0] == job:
            self.again = (sid, rid)
            return
        queue = self.queues.setdefault(group, [])
        if job not in queue:
            queue.append(job)
        self.waiting.setdefault(job, {})[(sid, rid)] = deadline

    def cancel(self) -> None:
        waiting = [t for tickets in self.waiting.values() for t in tickets]
        if waiting and self.rng.random() < 0.8:
            ticket = self.rng.choice(waiting)
        else:
            sid = self.bound_session()
            if sid is None:
                return
            ticket = (sid, self.rng.randrange(1, self.next_rid + 1))
        job = self.ticket_job(ticket)
        expect = errors.NotRegistered if self.job_of(ticket[0]) is None else None
        result = self.feed(AcquireWithdrawn(*ticket), expect)
        if expect is None:
            assert result == {"cancelled": job is not None}, (ticket, result)
            if job is not None:
                self.cancelled = ticket

    def release(self) -> None:
        holding = [sid for _, sessions in self.holders.values() for sid in sessions]
        sid = self.rng.choice(holding) if holding and self.rng.random() < 0.8 else self.bound_session()
        if sid is None:
            return
        job = self.job_of(sid)
        assert job is not None
        group = self.group_of(job)
        holder = self.holders.get(group)
        if holder is not None and holder[0] == job and sid in holder[1]:
            self.feed(ReleaseRequested(sid))
            holder[1].discard(sid)
            if not holder[1]:
                del self.holders[group]
        elif (sid, AUTO) in self.waiting.get(job, {}):  # preempted: it gives up its turn
            assert self.feed(ReleaseRequested(sid))["preempted"] is True
            self.leave_queue(job, (sid, AUTO))
        else:
            self.feed(ReleaseRequested(sid), errors.NotHolder)

    def close(self) -> None:
        if not self.sessions:
            return
        sid = self.rng.choice(list(self.sessions))
        self.feed(SessionClosed(sid))
        del self.sessions[sid]
        for job, tickets in list(self.waiting.items()):
            for ticket in [t for t in tickets if t[0] == sid]:
                self.dead.add(ticket)
                self.leave_queue(job, ticket)
        for ticket in [t for t in self.allocs if t[0] == sid]:
            self.dead.add(ticket)
            del self.allocs[ticket]
        for group, (_, sessions) in list(self.holders.items()):
            sessions.discard(sid)
            if not sessions:
                del self.holders[group]

    def alloc(self) -> None:
        sid = self.bound_session()
        if sid is None:
            return
        job = self.job_of(sid)
        assert job is not None
        core = self.s.jobs[job]
        gpus = self.s.groups[core.group].gpus
        gpu = self.rng.choice(gpus if self.rng.random() < 0.9 else list(CAPACITIES))
        nbytes = self.rng.randint(1, 70)
        streamed = {o for pair in self.s.moves.streams.values() for o in pair.outgoing}  # their room is taken
        leaving = sum(
            j.footprint.get(gpu, 0)
            for j in self.s.jobs.values()
            if j.location is Location.PARKING and j.name not in streamed
        )
        leaving -= sum(p.nbytes for p in self.s.ledger.pending if p.gpu == gpu)
        rid = self.next_rid
        self.next_rid += 1
        expect: type[Exception] | None = None
        if gpu not in gpus:
            expect = errors.UnknownDevice
        elif core.faulted or core.exiting:
            expect = errors.JobFaulted
        elif core.location is not Location.RESIDENT:
            expect = errors.NotResident
        elif nbytes > CAPACITIES[gpu] - self.s.used(gpu):
            victims = self.s.ledger.plan_evictions({gpu: nbytes - leaving}, {job}, self.now)
            if victims is None:
                expect = errors.OutOfMemory  # after parking idle jobs and waiting for those already parking
            elif isinstance(self.s.host.admit(victims, job, self.now, may_wait=False), Refuse):
                expect = errors.InsufficientHostMemory  # the parks it needs do not fit the host
        exc = self.feed(MemoryRequested(sid, rid, gpu, nbytes), expect)
        if expect is None:
            self.allocs[(sid, rid)] = job
        elif isinstance(exc, errors.OutOfMemory):
            assert f"GPU {gpu}: cannot allocate {exact_size(nbytes)} for job {job!r}" in str(exc)

    def free(self) -> None:
        owners = [(j.name, gpu, n) for j in self.s.jobs.values() for gpu, n in j.footprint.items() if n]
        if not owners:
            return
        job, gpu, n = self.rng.choice(owners)
        if self.rng.random() < 0.05:
            self.feed(MemoryReleased(job, gpu, n + 1), ValueError)
        else:
            self.feed(MemoryReleased(job, gpu, self.rng.randint(1, n)))

    def exit(self) -> None:
        if not self.s.jobs:
            return
        job = self.rng.choice(sorted(self.s.jobs))
        self.feed(JobExited(job))
        # its waiters are failed (checked in absorb); it loses the lock
        group = self.group_of(job)
        holder = self.holders.get(group)
        if holder is not None and holder[0] == job:
            del self.holders[group]

    def finish_move(self) -> None:
        if not self.moves:
            return
        op = self.rng.choice(sorted(self.moves))
        del self.moves[op]
        ok = self.rng.random() < 0.85
        intact = not ok and self.rng.random() < 0.6
        code = self.rng.choice(HOST_CODES) if intact else ""
        move = self.s.moves.in_flight[op]
        job = self.s.jobs[move.job]
        was_faulted = bool(job.faulted)
        nbytes = self.rng.randint(0, 100)
        error = "" if ok else "injected, state intact" if intact else "injected, state lost"
        self.feed(MoveFinished(op, ok, nbytes, self.rng.uniform(0, 1), error, intact=intact, code=code))
        if intact:
            self.intact_failures += 1
            assert bool(job.faulted) == was_faulted, f"{job.name} was faulted by a failure that left it intact"
            self.restore_failed = move.kind == "restore"
        elif not ok:
            self.damaged_failures += 1
            assert job.faulted, f"{job.name}'s state was lost, yet it is not faulted"

    def finish_reclaim(self) -> None:
        if not self.reclaims:
            return
        op = self.rng.choice(sorted(self.reclaims))
        job = self.reclaims.pop(op)
        self.feed(ReclaimFinished(op))
        for sid, name in self.sessions.items():
            if name == job:
                self.sessions[sid] = None  # the session may register again

    def tick(self) -> None:
        self.now += self.rng.uniform(0.0, 1.5)
        self.s.handle_timers(self.now)
        self.timers_ran = True

    def force_release(self) -> None:
        group = self.rng.choice([*GROUPS, "nowhere"])
        if group not in self.s.groups:
            self.feed(ForceReleaseRequested(group), errors.UnknownGroup)
        elif group not in self.holders:
            self.feed(ForceReleaseRequested(group), errors.NotHolder)
        else:
            self.feed(ForceReleaseRequested(group))
            del self.holders[group]

    def drain(self) -> None:
        group = self.rng.choice([*GROUPS, "nowhere"])
        on = self.rng.random() < 0.25  # mostly resumes: a drained group grants nothing
        self.feed(DrainRequested(group, on), None if group in self.s.groups else errors.UnknownGroup)

    def read_host(self) -> None:
        """The daemon's reading of the host: sometimes tight, sometimes with a limit, a pool or sizes."""
        room = self.rng.choice([0, 20, 60, 150, 1000])
        limit = self.rng.choice([None, None, 100, 250])
        names = sorted(JOBS)
        pools = {"cg": self.rng.choice([30, 90, 400])} if self.rng.random() < 0.3 else {}
        members = {n: ("cg",) for n in names if pools and self.rng.random() < 0.5}
        sizes = {n: self.rng.randint(0, 80) for n in sorted(EXCLUSIVE) if self.rng.random() < 0.5}
        self.feed(HostMemoryRead(0, room, limit, pools, members, sizes))

    def resume(self) -> None:
        faulted = [j.name for j in self.s.jobs.values() if j.faulted]
        if faulted and self.rng.random() < 0.8:
            name = self.rng.choice(faulted)
            job = self.s.jobs[name]
            expect: type[Exception] | None = errors.JobFaulted if job.exiting else None
            self.feed(FaultCleared(name), expect)
            if expect is None:
                assert not job.faulted
            return
        name = self.rng.choice([*JOBS, "nobody"])
        job = self.s.jobs.get(name)
        if job is None:
            self.feed(FaultCleared(name), errors.UnknownJob)
        elif not job.faulted:
            self.feed(FaultCleared(name), errors.BadRequest)

    def misuse(self) -> None:
        op = self.rng.choice([0, 10**9, *self.reclaims, *self.moves])
        if op in self.reclaims:
            self.feed(MoveFinished(op, True), ValueError)
        else:
            self.feed(ReclaimFinished(op), ValueError)

    # --- checking ----------------------------------------------------------------------

    def answer(self, ticket: Ticket) -> None:
        if ticket[1] == AUTO:  # the scheduler's own request for a preempted job: one per preemption
            return
        assert ticket not in self.answered, f"ticket {ticket} answered twice"
        assert ticket not in self.dead, f"ticket {ticket} answered after its session closed"
        self.answered.add(ticket)

    def absorb(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, GrantLock):
                self.absorb_grant(e)
            elif isinstance(e, FailRequest):
                self.answer(e.ticket)
                if e.ticket in self.allocs:
                    del self.allocs[e.ticket]
                    allowed = (errors.OutOfMemory, errors.NotResident, errors.JobFaulted)
                    assert isinstance(e.error, allowed), e
                    continue
                job = self.ticket_job(e.ticket)
                assert job is not None, f"failed a ticket that was not waiting: {e}"
                deadline = self.waiting[job][e.ticket]
                if isinstance(e.error, errors.AcquireCancelled):
                    assert e.ticket == self.cancelled, e
                elif isinstance(e.error, errors.AcquireTimeout):
                    assert self.timers_ran and deadline is not None and deadline <= self.now, (e, deadline)
                elif isinstance(e.error, errors.GroupDraining):
                    assert self.s.groups[self.group_of(job)].draining, e
                elif isinstance(e.error, (errors.InsufficientHostMemory, errors.SwitchFailed)):
                    self.check_told(e.error)
                else:
                    assert isinstance(e.error, errors.JobFaulted), e
                    core = self.s.jobs.get(job)
                    assert core is None or core.faulted or core.exiting, e
                self.leave_queue(job, e.ticket)
            elif isinstance(e, AllocateRegion):
                self.answer(e.ticket)
                assert self.allocs.pop(e.ticket) == e.job, e
                assert not self.s.jobs[e.job].exiting, e
            elif isinstance(e, (SnapshotJob, RestoreJob)):
                if isinstance(e, RestoreJob):
                    if e.op in self.s.moves.prefetches:
                        group = self.s.groups[self.s.jobs[e.job].group]
                        assert self.queues.get(group.name, [None])[0] == e.job, "prefetched a job that is not next"
                        assert group.holder is not None, "a prefetch while nobody holds the group"
                        self.prefetched += 1
                    self.streamed += bool(e.streams_with)
                assert e.op not in self.moves and e.op not in self.reclaims
                self.moves[e.op] = e.job
                if isinstance(e, SnapshotJob):
                    self.check_admitted(e.job)
            elif isinstance(e, ReclaimJob):
                assert e.op not in self.moves and e.op not in self.reclaims
                assert e.job not in self.reclaims.values(), f"{e.job} reclaimed twice"
                self.reclaims[e.op] = e.job
            elif isinstance(e, NotifyJob) and e.event in ("slice_overdue", "preempted"):
                group = str(e.data["group"])
                holder = self.holders.get(group)
                assert holder is not None and holder[0] == e.job, (e, holder)
                policy = POLICIES[group]
                assert float(e.data["held_s"]) >= policy.max_slice, e  # type: ignore[arg-type]
                if e.event == "preempted":
                    assert policy.action == "preempt", e
                    del self.holders[group]
                    self.queues.setdefault(group, []).append(e.job)
                    self.waiting[e.job] = {(sid, AUTO): None for sid in sorted(holder[1])}
            else:
                assert isinstance(e, NotifyJob) and e.event in ("faulted", "lock_lost", "move_failed", "resumed"), e

    def check_told(self, error: errors.TimeslicedError) -> None:
        """A waiter failed for want of room: the cause it names is there."""
        self.told += 1
        jobs = self.s.jobs.values()
        assert error.message.startswith(("insufficient host memory", "cannot make room", "job ")), error
        if isinstance(error, errors.InsufficientHostMemory):
            by_budget = bool(self.s.host.nodes) and error.message.startswith("insufficient host memory to park")
            by_failure = any(j.refusal is not None for j in jobs) or self.restore_failed
            assert by_budget or by_failure, error
        else:
            stuck = any(j.faulted or refused(j, self.now) is not None for j in jobs)
            assert stuck or self.restore_failed, error

    def check_admitted(self, job: str) -> None:
        """A park that starts fits the host's budget (with every other park under way)."""
        host = self.s.host
        for slot, node in host.nodes.items():
            if host.size(self.s.jobs[job], slot):
                held, reserved, _ = host.accounts(slot)
                assert held + reserved <= node.budget, f"park of {job} over the budget: {held} + {reserved} > {node}"

    def absorb_grant(self, e: GrantLock) -> None:
        assert e.tickets
        for ticket in e.tickets:
            self.answer(ticket)
            assert self.sessions.get(ticket[0]) == e.job, (e, self.sessions.get(ticket[0]))
        if e.again:
            assert e.tickets == (self.again,), e
            holder = self.holders[e.group]
            assert holder[0] == e.job and e.fence == self.fences[e.group], e
            assert not e.restored and e.switch_s == 0.0 and e.waited_s == 0.0
            holder[1].add(e.tickets[0][0])
            return
        assert e.group not in self.holders, f"{e} while {self.holders[e.group]} holds"
        queue = self.queues.get(e.group, [])
        assert queue and queue[0] == e.job, f"FIFO broken: granted {e.job}, queue {queue}"
        tickets = self.waiting.pop(e.job)
        assert set(e.tickets) == set(tickets), (e, tickets)
        assert all(d is None or d > self.now for d in tickets.values()), f"granted past its deadline: {e}"
        queue.pop(0)
        assert e.fence > self.fences.get(e.group, 0), f"fence did not grow: {e}"
        self.fences[e.group] = e.fence
        assert e.waited_s >= 0.0 and e.switch_s >= 0.0
        self.holders[e.group] = (e.job, {t[0] for t in e.tickets})
        self.grants += 1

    def check(self) -> None:
        s = self.s
        s.check_invariants(self.now)  # also: no free group's head is left waiting for nothing
        for name, group in s.groups.items():
            assert [w.job for w in group.queue] == self.queues.get(name, []), (name, group.queue, self.queues)
            for w in group.queue:
                assert w.tickets == self.waiting[w.job], (w, self.waiting[w.job])
            holder = self.holders.get(name)
            assert group.holder == (holder[0] if holder else None), (name, group.holder, holder)
            if holder is not None:
                assert group.holder_sessions == holder[1]
        for gpu, cap in CAPACITIES.items():
            # Each occupying job counts its footprint, a streamed pair its larger side; only growth that
            # measurement found in declared jobs (not a placement) may take a GPU past its capacity.
            used = sum(j.footprint.get(gpu, 0) for j in s.jobs.values() if j.location is not Location.PARKED)
            for pair in s.moves.streams.values():
                incoming = s.jobs[pair.incoming]
                out = sum(
                    s.jobs[o].footprint.get(gpu, 0)
                    for o in pair.outgoing
                    if o in s.jobs and s.jobs[o].location.occupies_device
                )
                used -= min(incoming.footprint.get(gpu, 0), out)
            grown = sum(
                max(0, j.footprint.get(gpu, 0) - j.declared.get(gpu, 0)) if j.placed else j.footprint.get(gpu, 0)
                for j in s.jobs.values()
                if j.declared and j.location is not Location.PARKED
            )
            assert used - grown <= cap, f"GPU {gpu} over capacity: {used} > {cap} ({grown} measured growth)"
        for op in s.moves.prefetches:  # a prefetch restores a declared job, never the holder of its group
            job = s.jobs[s.moves.in_flight[op].job]
            assert job.declared and s.groups[job.group].holder != job.name, job
        assert set(s.moves.in_flight) == set(self.moves) | set(self.reclaims)
        # time only moves together with handle_timers: nothing overdue is left waiting
        for tickets in self.waiting.values():
            assert all(d is None or d > self.now for d in tickets.values()), tickets
        assert {p.ticket for p in s.ledger.pending} == set(self.allocs)

    # --- the end ----------------------------------------------------------------------

    def quiesce(self) -> None:
        """Finish every move and reclaim, in random order, until nothing is in flight."""
        while self.moves or self.reclaims:
            if self.moves and (not self.reclaims or self.rng.random() < 0.7):
                op = self.rng.choice(sorted(self.moves))
                del self.moves[op]
                self.feed(MoveFinished(op, True))
            else:
                op = self.rng.choice(sorted(self.reclaims))
                job = self.reclaims.pop(op)
                self.feed(ReclaimFinished(op))
                for sid, name in self.sessions.items():
                    if name == job:
                        self.sessions[sid] = None
            self.cancelled = self.again = None
            self.timers_ran = self.restore_failed = False
            self.absorb(self.s.drain())
            self.check()

    def settle(self) -> None:
        """With nothing in flight, no group may be stuck; then everyone gets a turn."""
        self.quiesce()
        assert not self.allocs, self.allocs
        for group in self.s.groups.values():
            assert group.switch is None, group
            if group.queue and group.holder is None:
                head = self.s.jobs[group.queue[0].job]
                assert head.location in (Location.PARKED, Location.RESIDENT), head
                # nothing is in flight: only another group's holder may be in its way (check_invariants(now))
        for job in [j.name for j in self.s.jobs.values() if j.faulted and not j.exiting]:
            self.feed(JobExited(job))
            self.absorb(self.s.drain())
            self.check()
        for _ in range(4 * len(JOBS) + 4):
            self.quiesce()
            if not any(self.queues.values()):
                break
            for name, (_, sessions) in list(self.holders.items()):
                for sid in list(sessions):
                    self.feed(ReleaseRequested(sid))
                    sessions.discard(sid)
                del self.holders[name]
                self.absorb(self.s.drain())
                self.check()
        assert not any(self.queues.values()), f"queues never drained: {self.queues}"


class FaultyRun(Run):
    """A run in which some inputs first fail at a random call inside the core, then go in for real."""

    def __init__(self, rng: random.Random, faults: Faults) -> None:
        super().__init__(rng)
        self.faults = faults
        self.injected = 0

    def attempt(self, step: Any) -> tuple[bool, Any]:
        """Try ``step`` with a fault armed: (True, its result) if it completed before the fault came."""
        before, pending = self.snapshot_state(), list(self.s._effects)
        self.faults.arm(self.rng.randint(1, 30))
        try:
            result = step()
        except Fault:
            self.injected += 1
            assert self.snapshot_state() == before, f"a fault ({self.faults.where}) changed the scheduler"
            assert self.s._effects == pending, f"a fault ({self.faults.where}) left effects"
            self.s.check_invariants()
            return False, None
        except (errors.TimeslicedError, ValueError):
            return False, None  # refused before the fault came: it changed nothing (checked when fed again)
        finally:
            self.faults.arm(None)
        return True, result

    def feed(self, event: Event, expect: type[Exception] | None = None) -> Any:
        if self.rng.random() < 0.5:
            done, result = self.attempt(lambda: self.s.handle(event, self.now))
            if done:
                assert expect is None, f"{event} should have raised {expect.__name__}"
                return result
        return super().feed(event, expect)

    def tick(self) -> None:
        self.now += self.rng.uniform(0.0, 1.5)
        if not self.attempt(lambda: self.s.handle_timers(self.now))[0]:
            self.s.handle_timers(self.now)
        self.timers_ran = True


def run(rng: random.Random, steps: int) -> Run:
    r = Run(rng)
    for _ in range(steps):
        r.step()
    r.settle()
    return r


@pytest.mark.slow
def test_the_model_sees_failures_of_both_kinds_and_waiters_told_why() -> None:
    """The runs reach what they are meant to check: intact and damaged failures, and waiters told why."""
    runs = [run(random.Random(seed), 2500) for seed in range(4)]
    assert sum(r.intact_failures for r in runs) >= 10 and sum(r.damaged_failures for r in runs) >= 5
    assert sum(r.told for r in runs) >= 50
    assert sum(r.prefetched for r in runs) >= 2 and sum(r.streamed for r in runs) >= 5  # residency is reached


@pytest.mark.slow
@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(rng=st.randoms(use_true_random=False), steps=st.integers(1, 60))
def test_random_workloads(rng: random.Random, steps: int) -> None:
    run(rng, steps)


@pytest.mark.parametrize("seed", range(16))
def test_long_seeded_runs(seed: int) -> None:
    r = run(random.Random(seed), 2500)
    assert r.grants > 50  # the run did real work


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_faults_at_random_calls_change_nothing(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    r = FaultyRun(random.Random(seed), Faults(monkeypatch))
    for _ in range(3000):
        r.step()
    r.settle()
    assert r.injected > 200 and r.grants > 50  # faults hit, and the run did real work all the same
