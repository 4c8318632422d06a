"""Each group's lock: its holder, and its FIFO of waiting jobs with their requests (pure).

A job waits at most once per group (one ``Waiter``), with every request (ticket) its sessions
made; a request may carry a deadline, kept in one heap for all groups whose stale entries are
skipped lazily. A place without requests is a turn kept for a job whose daemon restarted: the
group grants nobody behind it until the job asks again, or the place lapses.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from .. import errors
from .events import Effect, FailRequest, SessionId, Ticket
from .model import AUTO, MAX_REQUESTS_PER_JOB, Group, Waiter
from .registry import Registry
from .undo import Fields, Journal

LOCK = Fields("holder", "holder_sessions", "held_since", "overdue_since", "fence", "last_holder")
BLOCKED = Fields("blocked", "waiting_for")
KEPT = Fields("kept_until")


class LockQueues:
    """Who holds each group, who waits for it in which order, and until when."""

    def __init__(self, registry: Registry, journal: Journal, emit: Callable[[Effect], None], max_waiters: int) -> None:
        self.max_waiters = max_waiters
        self.deadlines: list[tuple[float, Ticket]] = []  # heap
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

    def enqueue(self, group: Group, job: str, ticket: Ticket, deadline: float | None, now: float) -> None:
        """``ticket`` of ``job`` waits (at the tail, unless the job waits already); raises ``LimitExceeded``."""
        waiter = self.waiter(group, job)
        journal = self._journal
        if waiter is None:
            if len(group.queue) >= self.max_waiters:
                raise errors.LimitExceeded(f"group {group.name!r} already has {self.max_waiters} waiting jobs")
            waiter = Waiter(job, now)
            journal.keep_list(group.queue)
            group.queue.append(waiter)
        else:
            if len(waiter.tickets) >= MAX_REQUESTS_PER_JOB:
                raise errors.LimitExceeded(f"job {job!r} already has {MAX_REQUESTS_PER_JOB} acquires waiting")
            journal.keep_dict(waiter.tickets)
            journal.fields(waiter, KEPT)
        waiter.kept_until = None
        waiter.tickets[ticket] = deadline
        if deadline is not None:
            journal.push(self.deadlines, (deadline, ticket))

    def requeue(self, group: Group, job: str, sessions: Iterable[SessionId], now: float) -> None:
        """A preempted holder waits again at the tail, with a request (``AUTO``) on each of its sessions.

        In session order: nothing the scheduler puts out may depend on the order of a set.
        """
        self._journal.keep_list(group.queue)
        group.queue.append(Waiter(job, now, {(s, AUTO): None for s in sorted(sessions)}))

    def keep_turn(self, group: Group, job: str, until: float, now: float) -> None:
        """A place for ``job`` without requests, kept until ``until``."""
        self._journal.keep_list(group.queue)
        group.queue.append(Waiter(job, now, kept_until=until))

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
        """Somebody asks for the group (a kept turn does not) and may be granted."""
        return not group.draining and any(w.tickets for w in group.queue)

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
