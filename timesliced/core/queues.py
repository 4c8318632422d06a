"""Each group's lock: its holder, and its FIFO of waiting jobs with their requests (pure).

A job waits at most once per group (one ``Waiter``), with every request (ticket) its sessions
made; a request may carry a deadline, kept in one heap for all groups whose stale entries are
skipped lazily. A place without requests is a turn kept for a job whose daemon restarted: the
group grants nobody behind it until the job asks again, or the place lapses.

Every place gets the next number of one sequence shared by all groups (``seq``): the queue after
its head is in that order, and the head is the one the group's policy chose (``promote``). A gang
(``Gang``) waits in each of its groups as one member's place; its members wait apart until all
have asked, then move to the tails of their queues under one number, so every group orders gangs
alike. A member that stops waiting (cancelled, timed out, failed, its session closed) withdraws
the whole gang: the others fail with ``AcquireCancelled``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from .. import errors
from .events import Effect, FailRequest, SessionId, Ticket
from .model import AUTO, MAX_REQUESTS_PER_JOB, Gang, Group, Waiter
from .registry import Registry
from .undo import Fields, Journal

LOCK = Fields("holder", "holder_sessions", "held_since", "overdue_since", "fence", "last_holder")
BLOCKED = Fields("blocked", "waiting_for")
KEPT = Fields("kept_until", "enqueued_at")
SEQ = Fields("seq")
FORMED = Fields("seq", "formed_at")
PLACE = Fields("seq")
DELAYED = Fields("delayed")
MAX_GANG = 64  # members of one gang


class LockQueues:
    """Who holds each group, who waits for it in which order, and until when."""

    def __init__(self, registry: Registry, journal: Journal, emit: Callable[[Effect], None], max_waiters: int) -> None:
        self.max_waiters = max_waiters
        self.deadlines: list[tuple[float, Ticket]] = []  # heap
        self.seq = 0  # the last number given to a place (noted: a step rolled back gives none)
        self.gangs: dict[str, Gang] = {}  # gangs with members waiting
        self._registry = registry
        self._journal = journal
        self._emit = emit

    # --- the holder ------------------------------------------------------------------

    def grant(self, group: Group, now: float) -> Waiter:
        """The head of the queue holds the group from ``now``, under a new fence; returns its place."""
        journal = self._journal
        journal.keep_list(group.queue)
        journal.fields(group, LOCK)
        waiter = group.queue.pop(0)
        if waiter.anticipated:  # a kept turn goes before every waiter that asks, also those that came during it
            self._passed_by_kept_turn(group)
        if waiter.gang is not None:
            gang = self.gangs[waiter.gang]
            journal.keep_dict(gang.members)
            for ticket in waiter.tickets:
                gang.members.pop(ticket, None)
            if not gang.members:
                journal.delete(self.gangs, gang.name)  # every member holds: the gang is done
        group.fence += 1
        group.holder = waiter.job
        group.holder_sessions = {s for s, _ in waiter.tickets}
        group.held_since = now
        return waiter

    def join(self, group: Group, session: SessionId) -> None:
        """Another session of the holder acquires: it holds too."""
        self._journal.keep_set(group.holder_sessions)
        group.holder_sessions.add(session)

    def leave(self, group: Group, session: SessionId) -> bool:
        """``session`` of the holder lets go; True when none of its sessions holds any more."""
        self._journal.keep_set(group.holder_sessions)
        group.holder_sessions.discard(session)
        return not group.holder_sessions

    def vacate(self, group: Group) -> None:
        """Nobody holds the group any more (the holder stays its last holder)."""
        self._journal.fields(group, LOCK)
        group.last_holder = group.holder
        group.holder = None
        group.holder_sessions = set()
        group.overdue_since = None

    # --- waiting ---------------------------------------------------------------------

    def waiter(self, group: Group, job: str) -> Waiter | None:
        return next((w for w in group.queue if w.job == job), None)

    def find(self, group: Group, ticket: Ticket) -> Waiter | None:
        return next((w for w in group.queue if ticket in w.tickets), None)

    def next_seq(self) -> int:
        self._journal.fields(self, SEQ)
        self.seq += 1
        return self.seq

    def enqueue(
        self, group: Group, job: str, ticket: Ticket, deadline: float | None, now: float, gang: str | None = None
    ) -> Waiter:
        """``ticket`` of ``job`` waits (at the tail, unless the job waits already); returns its place.

        Raises ``LimitExceeded``, or ``BadRequest`` when a gang member's job waits already, or a
        request of a job whose place is a gang member's.
        """
        waiter = self.waiter(group, job)
        journal = self._journal
        if waiter is not None and (gang is not None or waiter.gang is not None):
            raise errors.BadRequest(
                f"job {job!r} already waits for group {group.name!r}"
                + (f" as a member of gang {waiter.gang!r}" if waiter.gang is not None else "")
                + ": a gang member's acquire cannot share its place with another acquire; wait for the first"
            )
        if waiter is None:
            if len(group.queue) >= self.max_waiters:
                raise errors.LimitExceeded(f"group {group.name!r} already has {self.max_waiters} waiting jobs")
            waiter = Waiter(job, now, seq=self.next_seq(), gang=gang)
            journal.keep_list(group.queue)
            group.queue.append(waiter)
        else:
            if len(waiter.tickets) >= MAX_REQUESTS_PER_JOB:
                raise errors.LimitExceeded(f"job {job!r} already has {MAX_REQUESTS_PER_JOB} acquires waiting")
            journal.keep_dict(waiter.tickets)
            journal.fields(waiter, KEPT)
            if waiter.anticipated and not waiter.tickets:
                waiter.enqueued_at = now  # the holder kept for asks again: its wait starts now
        waiter.kept_until = None
        waiter.tickets[ticket] = deadline
        if deadline is not None:
            journal.push(self.deadlines, (deadline, ticket))
        return waiter

    def promote(self, group: Group, waiter: Waiter) -> bool:
        """``waiter`` (the policy's choice) becomes the head; the others stay in arrival order.

        Returns True if the head changed.
        """
        queue = group.queue
        if queue[0] is waiter:
            return False
        self._journal.keep_list(queue)
        rest = sorted((w for w in queue if w is not waiter), key=lambda w: w.seq)
        queue[:] = [waiter, *rest]
        return True

    def requeue(self, group: Group, job: str, sessions: Iterable[SessionId], now: float) -> None:
        """A preempted holder waits again at the tail, with a request (``AUTO``) on each of its sessions.

        In session order: nothing the scheduler puts out may depend on the order of a set.
        """
        seq = self.next_seq()
        self._journal.keep_list(group.queue)
        group.queue.append(Waiter(job, now, {(s, AUTO): None for s in sorted(sessions)}, seq=seq))

    def keep_turn(self, group: Group, job: str, until: float, now: float) -> None:
        """A place for ``job`` without requests, kept until ``until``."""
        seq = self.next_seq()
        self._journal.keep_list(group.queue)
        group.queue.append(Waiter(job, now, kept_until=until, seq=seq))

    def keep_for_holder(self, group: Group, job: str, until: float, now: float) -> None:
        """A turn for ``job``, which just yielded, at the head until ``until`` (``core/anticipation.py``).

        Every waiter that asks now is marked ``delayed``: none of them is kept waiting so again. So
        is every waiter that asks when the turn is granted (``grant``): it asked while the turn was
        kept, and its holder goes before it.
        """
        self._passed_by_kept_turn(group)
        seq = self.next_seq()
        self._journal.keep_list(group.queue)
        group.queue.insert(0, Waiter(job, now, kept_until=until, seq=seq, anticipated=True))

    def _passed_by_kept_turn(self, group: Group) -> None:
        """Every waiter of ``group`` that asks now is passed by a kept turn: it is marked ``delayed``."""
        journal = self._journal
        for w in group.queue:
            if w.tickets and not w.delayed:
                journal.fields(w, DELAYED)
                w.delayed = True

    def end_kept_turn(self, group: Group, job: str) -> None:
        """``job``'s turn kept without requests, if any, goes (it asks as a gang member instead)."""
        waiter = self.waiter(group, job)
        if waiter is not None and not waiter.tickets:
            self._journal.keep_list(group.queue)
            group.queue.remove(waiter)

    def drop(self, group: Group, waiter: Waiter, ticket: Ticket) -> None:
        """``ticket`` no longer waits, and is not answered; a place left without requests goes."""
        journal = self._journal
        journal.keep_dict(waiter.tickets)
        del waiter.tickets[ticket]
        if not waiter.tickets:
            if group.blocked == waiter.job:
                journal.fields(group, BLOCKED)
                group.blocked = group.waiting_for = None  # its next wait is a new one
            journal.keep_list(group.queue)
            group.queue.remove(waiter)
        if waiter.gang is not None:
            self._withdraw_gang(waiter.gang)
        elif self.gangs:
            self._forget_pass(group, waiter)

    def fail(self, group: Group, waiter: Waiter, ticket: Ticket, error: errors.TimeslicedError) -> None:
        self.drop(group, waiter, ticket)
        self._emit(FailRequest(ticket, error))

    def withdraw(self, group: Group, ticket: Ticket) -> bool:
        """Cancel ``ticket`` if it still waits (it is answered ``AcquireCancelled``); False if it does not."""
        waiter = self.find(group, ticket)
        if waiter is None:
            return False
        self.fail(group, waiter, ticket, errors.AcquireCancelled("the acquire was cancelled"))
        return True

    def drop_session(self, group: Group, session: SessionId) -> None:
        """Every request of ``session`` (closed: nobody to answer) stops waiting."""
        for w in list(group.queue):
            for ticket in [t for t in w.tickets if t[0] == session]:
                self.drop(group, w, ticket)

    def fail_job(self, group: Group, job: str, error: errors.TimeslicedError) -> None:
        """``job`` leaves the queue: each of its requests fails with ``error``; a kept turn goes."""
        for w in [w for w in group.queue if w.job == job]:
            for ticket in list(w.tickets):
                self.fail(group, w, ticket, error)
            if w in group.queue:
                self._journal.keep_list(group.queue)
                group.queue.remove(w)  # a kept turn

    def fail_all(self, group: Group, error: errors.TimeslicedError) -> None:
        """Everyone leaves the queue; each request fails with ``error``."""
        for w in list(group.queue):
            for ticket in list(w.tickets):
                self.fail(group, w, ticket, error)
        if group.queue:
            self._journal.keep_list(group.queue)
            group.queue.clear()  # kept turns

    def others_wait(self, group: Group) -> bool:
        """Somebody asks for the group (a kept turn does not, nor a gang not yet complete) and may be granted."""
        gangs = self.gangs
        return not group.draining and any(
            w.tickets and (w.gang is None or gangs[w.gang].seq is not None) for w in group.queue
        )

    # --- gangs -----------------------------------------------------------------------

    def join_gang(
        self, group: Group, job: str, ticket: Ticket, deadline: float | None, name: str, size: int, now: float
    ) -> None:
        """``ticket`` of ``job`` waits in ``group`` as a member of gang ``name`` of ``size``.

        The member waits apart until the gang is complete; then every member moves to the tail
        of its queue under one number. Raises ``BadRequest`` (a bad size, a gang complete
        already or of another size, a second member in one group, groups that share GPUs)
        or ``LimitExceeded`` before anything changes.
        """
        if not 1 <= size <= MAX_GANG:
            raise errors.BadRequest(f"a gang has 1 to {MAX_GANG} members, not {size}")
        gang = self.gangs.get(name)
        if gang is not None:
            if gang.seq is not None:
                raise errors.BadRequest(f"gang {name!r} is complete already; acquire with a new gang id")
            if gang.size != size:
                raise errors.BadRequest(
                    f"gang {name!r} has {gang.size} members, not {size}: give every member the same"
                )
            if group.name in gang.members.values():
                raise errors.BadRequest(
                    f"gang {name!r} already has a member in group {group.name!r}: each member acquires another group"
                )
            groups = self._registry.groups
            shared = sorted({g for other in gang.members.values() for g in groups[other].gpus} & set(group.gpus))
            if shared:
                raise errors.BadRequest(
                    f"group {group.name!r} shares GPUs {shared} with another group of gang {name!r}: its members "
                    "could never be resident together; gang groups on separate GPUs"
                )
        journal = self._journal
        if gang is None:
            gang = Gang(name, size)
            journal.keep_key(self.gangs, name)
            self.gangs[name] = gang
        self.enqueue(group, job, ticket, deadline, now, gang=name)
        journal.keep_dict(gang.members)
        gang.members[ticket] = group.name
        if len(gang.members) < size:
            return
        journal.fields(gang, FORMED)
        gang.seq, gang.formed_at = self.next_seq(), now
        for t, g in sorted(gang.members.items(), key=lambda m: m[1]):
            q = self._registry.groups[g]
            member = self.find(q, t)
            assert member is not None
            journal.keep_list(q.queue)
            journal.fields(member, PLACE)
            q.queue.remove(member)
            member.seq = gang.seq
            q.queue.append(member)

    def _withdraw_gang(self, name: str) -> None:
        """A member stopped waiting: the others fail (a gang is granted whole or not at all)."""
        gang = self.gangs.get(name)
        if gang is None:
            return  # withdrawn already, or done
        self._journal.delete(self.gangs, name)
        error = errors.AcquireCancelled(
            f"another member of gang {name!r} stopped waiting (cancelled, timed out, refused or disconnected), "
            "so the gang is withdrawn: acquire the whole gang again"
        )
        for ticket, g in sorted(gang.members.items(), key=lambda m: (m[1], m[0])):
            group = self._registry.groups.get(g)
            waiter = self.find(group, ticket) if group is not None else None
            if group is not None and waiter is not None:
                self.fail(group, waiter, ticket, error)

    def _forget_pass(self, group: Group, waiter: Waiter) -> None:
        """A request of ``waiter`` stopped waiting unanswered: a gang's pass that ``waiter`` was chosen
        for, of a party none of whose requests it still has, was never taken, so it goes.

        A pass is counted when its acquire is chosen (``Arbiter._choose``), before it may wait for
        room or for its restore; the party's next acquire would be refused (``GangWaiting``) for a
        pass it never made. Forgetting it costs the gang nothing: while the party holds another of
        the gang's groups, the gang cannot be granted anyway, however often the party asks again.
        """
        place = (group.name, waiter.seq)
        parties = self._registry.parties
        for gang in self.gangs.values():
            if not gang.passes:
                continue
            for party in [p for p, at in gang.passes.items() if at == place]:
                if not any(parties.get(s) == party for s, _ in waiter.tickets):
                    self._journal.delete(gang.passes, party)

    # --- time ------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Fail every request whose deadline is at or before ``now``; drop the kept turns that lapsed."""
        heap, journal = self.deadlines, self._journal
        while heap and heap[0][0] <= now:
            _, ticket = journal.pop(heap)
            found = self._waiting(ticket)
            deadline = found[1].tickets.get(ticket) if found else None
            if found is None or deadline is None or deadline > now:
                continue  # already granted, cancelled, gone, or asked again with a later deadline
            group, w = found
            self.fail(group, w, ticket, errors.AcquireTimeout("the lock was not granted before the timeout"))
        for group in self._registry.groups.values():
            lapsed = [w for w in group.queue if not w.tickets and w.kept_until is not None and w.kept_until <= now]
            if lapsed:
                journal.keep_list(group.queue)
                for w in lapsed:
                    group.queue.remove(w)  # its job did not come back in time

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request that still waits.

        Not a step: the stale entries it skips leave the heap unnoted, which changes nothing
        that a step could see.
        """
        heap = self.deadlines
        while heap:
            deadline, ticket = heap[0]
            found = self._waiting(ticket)
            if found is not None and found[1].tickets.get(ticket) == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def kept_deadline(self, group: Group) -> float | None:
        """When the first of the group's kept turns lapses."""
        if not group.queue:
            return None
        return min((w.kept_until for w in group.queue if not w.tickets and w.kept_until is not None), default=None)

    def _waiting(self, ticket: Ticket) -> tuple[Group, Waiter] | None:
        registry = self._registry
        name = registry.sessions.get(ticket[0])
        if name is None:
            return None
        group = registry.groups[registry.jobs[name].group]
        waiter = self.find(group, ticket)
        return None if waiter is None else (group, waiter)
