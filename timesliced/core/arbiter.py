"""Who holds each group next, and the switch that must happen first (pure).

After every input the arbiter looks at each group that is not frozen: a holder past its slice
is warned or preempted; a free group grants the head of its queue at once, or starts a switch
(park the jobs in its way, then restore it) and grants it when the switch's moves are done. A
head that cannot be made room for now waits, counted once as deferred.

The head is the group's queue policy's choice (``policy.py``), made whenever the group is free
and not switching; a choice that differs from arrival order is told to its job (``policy``
notice, in the event log). A gang member's group, its switch done, waits until every group of
the gang can grant its member, and then all are granted in one step (``gangs``); the one single
acquire let before it is a party's that holds another of the gang's groups (``_passer``), once
until that party lets all of the gang's groups go: a second is refused (``GangWaiting``). An
acquire let before the gang that stops waiting before its grant was no pass (``LockQueues.drop``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..errors import GangWaiting, TimeslicedError
from . import anticipation
from . import policy as queue_policy
from .events import Effect, GrantLock, NotifyJob
from .figures import Figures
from .ledger import MemoryLedger
from .location import Location
from .model import Gang, Group, Job, Refuse, Switch, Wait, Waiter
from .moves import Moves
from .policy import QueuePolicies, Standing
from .queues import BLOCKED, LockQueues
from .registry import Registry
from .residency import sized
from .slices import SlicePolicies
from .undo import Fields, Journal

SWITCH = Fields("switch")
OVERDUE = Fields("overdue_since")
LAST_GRANTED = Fields("last_granted", "placed")
RESTORING = Fields("restoring")
HELD = Fields("held_s")
READY = Fields("ready")


class Arbiter:
    """Grants the groups' locks in queue order, moving job state out of the way first."""

    def __init__(
        self,
        registry: Registry,
        queues: LockQueues,
        ledger: MemoryLedger,
        moves: Moves,
        slices: SlicePolicies,
        figures: Figures,
        journal: Journal,
        emit: Callable[[Effect], None],
        policies: QueuePolicies | None = None,
        *,
        prefetch: bool = True,
        stream: bool = False,
        anticipate_s: float = 0.0,
    ) -> None:
        """``policies``: each group's queue policy; ``prefetch``: restore a held group's next waiter into
        free room (``_prefetch``); ``stream``: start a switch's restore with the snapshots that make its
        room (``_start_switch``); ``anticipate_s``: keep a yielded holder's turn for at most this long
        when it will be back before a switch would pay (``anticipate``; 0: never)."""
        self.policies = policies or QueuePolicies({})
        # The scheduler's frozen groups, read when a gang's grant looks at its other groups.
        self.frozen: Callable[[], Mapping[str, str]] = dict
        self._prefetching = prefetch
        self._streaming = stream
        self._anticipate_s = anticipate_s
        self._registry = registry
        self._queues = queues
        self._ledger = ledger
        self._moves = moves
        self._slices = slices
        self._figures = figures
        self._journal = journal
        self._emit = emit

    def advance_all(self, now: float, frozen: Mapping[str, str]) -> None:
        """Advance every group but the ``frozen`` ones (a node they span is out of reach)."""
        policy = self._slices.policy
        # Only a group that can act is visited (so a step costs what those cost, not every group):
        # ``advance`` does nothing for one without a queue, one whose switch is under way, or one
        # whose holder no slice policy polices and whose next waiter is not to be prefetched. With no
        # slice policy and no job that declared its memory, no held group can act: this loop runs
        # after every input, over every group, so it asks that once rather than per held group.
        held_may_act = bool(self._slices.policies) or (self._prefetching and bool(self._registry.sized))
        for group in self._registry.groups.values():
            if not group.queue:
                continue
            if group.holder is None:
                if group.switch is None and group.name not in frozen:
                    self.advance(group, now)
            elif (
                held_may_act
                and group.name not in frozen
                and (policy(group.name) is not None or self._may_prefetch(group))
            ):
                self.advance(group, now)

    def advance(self, group: Group, now: float) -> None:
        """Police the holder's slice, or grant the head of the queue, or start the switch it needs.

        A head that cannot be made room for, with nothing under way that would change it, is told
        why (its requests fail) and the next one is looked at.
        """
        if group.holder is not None:
            self._police(group, now)
            if group.holder is not None:
                self._prefetch(group, now)
        while group.holder is None and group.switch is None and group.queue and not group.draining:
            head = self._choose(group)
            if head is None:
                return  # only members of gangs not yet complete wait
            if not head.tickets:
                return  # a kept turn: the group waits for its job to ask again (or the turn to lapse)
            job = self._registry.jobs[head.job]  # never faulted or exiting: those leave the queue at once
            if job.location is not Location.RESIDENT and job.location is not Location.PARKED:
                return  # being parked by another group's switch; go on when that ends
            plan = self._ledger.plan_room(job, now)
            if isinstance(plan, Wait):
                self._block(group, job.name, plan.why)
                return  # waits until memory frees up (a holder elsewhere yields, a move ends, a job exits)
            if isinstance(plan, Refuse):
                self._refuse(group, plan.error)
                continue
            self._unblock(group)
            if not plan and job.location is Location.RESIDENT:
                self._grant(group, now, switch_s=0.0, restored=False, switched=False)
                return
            self._start_switch(group, job, plan, now)
            return

    def _may_prefetch(self, group: Group) -> bool:
        """Cheaply, whether ``_prefetch`` could restore anyone of held ``group`` now (False: it would not)."""
        if not self._prefetching or not self._registry.sized:
            return False  # only a job that declared its memory is ever prefetched
        if self.policies.policy(group.name).name != "fifo" or self._queues.gangs:
            return True  # the policy's choice costs a look at every waiter: leave it to ``_prefetch``
        job = self._registry.jobs.get(group.queue[0].job)
        return job is not None and job.location is Location.PARKED and sized(job)

    def next_waiter(self, group: Group) -> Waiter | None:
        """The waiter the group's policy would grant next once it is free: the one a prefetch restores
        ahead of its turn (a guess, read without promoting it: waiting may change the choice)."""
        policy = self.policies.policy(group.name)
        if policy.name == "fifo" and not self._queues.gangs:
            return group.queue[0] if group.queue else None
        chosen, _ = queue_policy.choose(policy, group, self._registry.jobs, self._queues.gangs)
        return chosen

    def _prefetch(self, group: Group, now: float) -> None:
        """While the holder computes, restore the next waiter if it fits beside everyone resident.

        Only into free room (the headroom kept, nobody parked for it, never the holder), only the
        next waiter, only a job that declared its memory, and not again after a prefetch of it
        failed until it is granted. A prefetched job that is then not granted stays resident until
        its room is needed (it is idle and resident: the next plan may park it).
        """
        if not self._prefetching or group.switch is not None or group.draining:
            return
        head = self.next_waiter(group)
        if head is None or not head.tickets or head.job in self._moves.declined:
            return
        job = self._registry.jobs[head.job]
        if self._ledger.prefetchable(job, now):
            self._moves.prefetch(job, now)

    def _start_switch(self, group: Group, job: Job, plan: list[Job], now: float) -> None:
        """Park ``plan`` for ``job``; with streaming, restore ``job`` into their room at once.

        Streamed, the restore's bytes take each GPU's room as the snapshots free it (``moves.Stream``
        counts the pair's larger side), so the switch ends after the longer of the two copies
        instead of their sum. Only a parked job whose plan parks others streams.
        """
        switch = Switch(job.name, now)
        snapshots = {self._moves.start(v, "snapshot", now): v for v in plan}
        switch.pending.update(snapshots)
        if snapshots and self._streaming and job.location is Location.PARKED:
            switch.pending.add(self._moves.stream(job, snapshots, now))
            switch.restoring = True
        self._journal.fields(group, SWITCH)
        group.switch = switch
        if not switch.pending:
            self._continue(group, now)

    def yield_lock(self, group: Group, now: float) -> None:
        """The holder's slice ends now."""
        assert group.holder is not None
        job = self._registry.jobs[group.holder]
        self._figures.held(group, job, now - group.held_since, len(group.gpus))
        self._journal.fields(job, HELD)
        job.held_s += now - group.held_since  # what ``fair`` decides by
        self._queues.vacate(group)
        if self._queues.gangs:
            self._forget_passes(group)

    def anticipate(self, group: Group, job: Job, now: float) -> None:
        """``job`` just yielded ``group``: keep its turn if it will be back before a switch would pay.

        Only when the group's next waiter needs ``job`` parked, no waiter that asks has been kept
        waiting so in its wait (``Waiter.delayed``: the policy's choice may be a waiter that came
        since, and the one passed before would be passed again), and no gang waits in the group
        (``core/anticipation.py``). The decision is told to ``job`` as a ``policy`` notice (the
        event log has it).
        """
        if self._anticipate_s <= 0 or group.draining or group.name in self.frozen():
            return
        if not self._queues.others_wait(group):
            return
        if any(w.gang is not None or (w.delayed and w.tickets) for w in group.queue):
            return
        head = self.next_waiter(group)
        if head is None or not head.tickets:
            return
        incoming = self._registry.jobs[head.job]
        if incoming.location is not Location.RESIDENT and incoming.location is not Location.PARKED:
            return
        plan = self._ledger.plan_room(incoming, now)
        keep = anticipation.decide(job, incoming, plan, now, self._anticipate_s) if isinstance(plan, list) else None
        if keep is None:
            return
        self._queues.keep_for_holder(group, job.name, keep.until, now)
        reason = (
            f"kept for {job.name!r} until it asks again, at most {keep.until - now:.3f} s: its typical gap is "
            f"{keep.gap_s:.3f} s, and parking it for {incoming.name!r} and coming back would take {keep.switch_s:.3f} s"
        )
        data = {"group": group.name, "policy": self.policies.policy(group.name).name, "passed": incoming.name}
        self._emit(NotifyJob(job.name, "policy", {**data, "kept_s": keep.until - now, "reason": reason}))

    def move_finished(self, op: int, now: float, failed: TimeslicedError | None = None) -> None:
        """Move ``op`` ended: a switch that waited for it alone goes on.

        ``failed``: the switch's own restore failed, and this is why; its waiter is told so (a
        parked job is not restored again in the same wait: that would fail the same way).
        """
        for g in self._registry.groups.values():
            switch = g.switch
            if switch is not None and op in switch.pending:
                self._journal.keep_set(switch.pending)
                switch.pending.discard(op)
                if failed is not None and switch.restoring and g.queue and g.queue[0].job == switch.incoming:
                    self._refuse(g, failed)
                if not switch.pending:
                    self._continue(g, now)

    # --- slices ----------------------------------------------------------------------

    def _police(self, group: Group, now: float) -> None:
        """Warn a holder past its maximum slice while others wait; preempt it after the grace."""
        policy = self._slices.policy(group.name)
        if policy is None or not self._queues.others_wait(group):
            return
        overdue = policy.check(group, now)
        if overdue is None:
            return
        assert group.holder is not None
        holder = self._registry.jobs[group.holder]
        if overdue.warning is not None:
            self._journal.fields(group, OVERDUE)
            group.overdue_since = now
            warning = overdue.warning
            if not holder.freezes and policy.action == "preempt":
                # Registration refuses such a job in a preempting group; one adopted from an earlier
                # leader with other policies is only warned: parking it would unmap memory under its kernels.
                warning = {
                    **warning,
                    "action": "warn",
                    "reason": f"{warning['reason']}; its parking method cannot "
                    "be preempted safely, so it is only warned",
                }
            self._emit(NotifyJob(group.holder, "slice_overdue", warning))
        if overdue.preempt is not None and holder.freezes:
            self._preempt(group, now, {**overdue.data, "reason": overdue.preempt})

    def _preempt(self, group: Group, now: float, data: dict[str, object]) -> None:
        """Take the lock from a holder that kept it too long, park it, and queue it again.

        Its park starts only if the host can hold it: otherwise it stays resident (the waiter that
        needs the room is told why when its turn comes).
        """
        assert group.holder is not None
        job = self._registry.jobs[group.holder]
        sessions = set(group.holder_sessions)
        self.yield_lock(group, now)
        self._figures.preempted(group, job)
        self._emit(NotifyJob(job.name, "preempted", data))
        self._queues.requeue(group, job.name, sessions, now)
        if job.location is Location.RESIDENT and self._ledger.host.admit([job], job.name, now, may_wait=False) is None:
            self._moves.start(job, "snapshot", now)  # its next GPU access waits until it is granted again

    # --- switches --------------------------------------------------------------------

    def _block(self, group: Group, job: str, why: str) -> None:
        if group.blocked != job or group.waiting_for != why:
            self._journal.fields(group, BLOCKED)
            if group.blocked != job:
                self._figures.deferred(group)
            group.blocked, group.waiting_for = job, why

    def _unblock(self, group: Group) -> None:
        if group.blocked is not None:
            self._journal.fields(group, BLOCKED)
            group.blocked = group.waiting_for = None

    def _refuse(self, group: Group, error: TimeslicedError) -> None:
        """The head of the queue cannot be made room for: each of its requests fails with ``error``."""
        self._unblock(group)
        head = group.queue[0]
        for ticket in list(head.tickets):
            self._queues.fail(group, head, ticket, error)

    def _continue(self, group: Group, now: float) -> None:
        """All snapshots of the switch are done: restore, or re-plan, or give up."""
        switch = group.switch
        assert switch is not None
        job = self._registry.jobs.get(switch.incoming)
        # The incoming job may have left the queue (cancel, timeout, closed session,
        # exit) while others were parked for it: restoring it now would only delay
        # the new head of the queue.
        wanted = bool(group.queue) and group.queue[0].job == switch.incoming
        if switch.restoring or not wanted or job is None or job.faulted:
            self._finish(group, now)
            return
        victims = self._ledger.plan_room(job, now)
        if isinstance(victims, (Wait, Refuse)):
            self._journal.fields(group, SWITCH)
            group.switch = None
            if isinstance(victims, Wait):
                self._block(group, job.name, victims.why)  # waits until what is in its way moves on
            else:
                self._refuse(group, victims.error)  # a victim's park failed, or it faulted and keeps its memory
            return
        if victims:
            self._journal.keep_set(switch.pending)
            for v in victims:
                switch.pending.add(self._moves.start(v, "snapshot", now))
            return
        if job.location is not Location.PARKED:
            self._finish(group, now)  # resident all along: only others had to make room
            return
        op = self._moves.start(job, "restore", now)
        self._journal.fields(switch, RESTORING)
        self._journal.keep_set(switch.pending)
        switch.restoring = True
        switch.pending.add(op)

    def _finish(self, group: Group, now: float) -> None:
        switch = group.switch
        assert switch is not None
        self._journal.fields(group, SWITCH)
        group.switch = None
        job = self._registry.jobs.get(switch.incoming)
        if (
            job is not None
            and group.queue
            and group.queue[0].job == job.name
            and job.location is Location.RESIDENT
            and not job.faulted
        ):
            self._grant(group, now, switch_s=now - switch.started_at, restored=switch.restoring, switched=True)

    # --- who is next ---------------------------------------------------------------------

    def _choose(self, group: Group) -> Waiter | None:
        """The group's policy's choice, made its head; a choice other than arrival order is told."""
        registry, queues = self._registry, self._queues
        if group.queue[0].anticipated:
            return group.queue[0]  # a turn kept for the holder that yielded: nobody goes before it
        policy = self.policies.policy(group.name)
        if policy.name == "fifo" and not queues.gangs:
            return group.queue[0]  # arrival order, and nothing waits apart: the head it always was
        while True:
            chosen, first = queue_policy.choose(policy, group, registry.jobs, queues.gangs)
            if chosen is None or first is None:
                return None
            if chosen.gang is None or (passer := self._passer(group, chosen.gang)) is None:
                break
            waiter, held, party = passer
            gang = queues.gangs[chosen.gang]
            passed = gang.passes.get(party)
            if passed is not None and passed != (group.name, waiter.seq):
                self._refuse_pass(group, waiter, held, party, gang, chosen)
                continue  # its party's requests are gone: choose again
            if passed is None:
                self._journal.keep_key(gang.passes, party)
                gang.passes[party] = (group.name, waiter.seq)
            if queues.promote(group, waiter):
                why = f"its party holds group {held!r}, which gang {gang.name!r} waits for: behind the gang, it would"
                self._tell_chosen(group, waiter, chosen, f"{why} never let that group go", gang=gang.name)
            return waiter
        if queues.promote(group, chosen) and chosen is not first:
            jobs = registry.jobs
            ctx = Standing.of(j for j in jobs.values() if j.group == group.name and not j.exiting)
            self._tell_chosen(group, chosen, first, queue_policy.why(policy, jobs[chosen.job], jobs[first.job], ctx))
        return chosen

    def _tell_chosen(self, group: Group, chosen: Waiter, passed: Waiter, reason: str, **more: object) -> None:
        """``chosen`` goes before ``passed``, who arrived first: its job is told why (the event log has it)."""
        data = {"group": group.name, "policy": self.policies.policy(group.name).name, "passed": passed.job, **more}
        self._emit(NotifyJob(chosen.job, "policy", {**data, "reason": reason}))

    def _passer(self, group: Group, gang_name: str) -> tuple[Waiter, str, str] | None:
        """A single acquire in ``group`` that goes before gang ``gang_name``, the group it is let by for,
        and its party.

        A gang takes its groups only together, and holds a free one while it waits for the rest. A
        party (a process, or processes named as one: ``JobRegistered.party``) that holds another of
        the gang's groups and now asks for this one by a single acquire would wait for the gang, which
        waits for the party: neither would ever go on. So the first such acquire goes first; the gang
        keeps its place and goes on once the party lets both groups go. Gangs and parties that ask for
        groups in one order cannot deadlock this way; a party that holds one group while it asks for
        another is the only wait a gang is passed for.

        Once per party until it lets all of the gang's groups go (``Gang.passes``, which ``_choose``
        keeps): a party that passes again while it still holds one of them, every time it asks for
        the other, would keep the gang waiting for ever, so that second pass is refused
        (``_refuse_pass``). A party's pass is forgotten when a group it held is let go and it holds
        none of the gang's groups (``_forget_passes``; not when only some of a holder's sessions
        let go, which can only refuse more), when the acquire that made it stops waiting before it
        is granted (timed out, cancelled or its session closed while it waited for room: it never
        went before the gang, ``LockQueues.drop``), and all passes go with the gang when it is
        granted or withdrawn. They are not rebuilt by a new leader (the nodes ask for their gangs anew): after
        a leader change a party may pass a gang once more.
        """
        parties = self._registry.parties
        if not parties:
            return None
        groups = self._registry.groups
        holding: dict[str, str] = {}  # party -> a group of the gang it holds
        for g in sorted(set(self._queues.gangs[gang_name].members.values()) - {group.name}):
            for s in groups[g].holder_sessions:
                if s in parties:
                    holding.setdefault(parties[s], g)
        if not holding:
            return None
        for w in sorted((w for w in group.queue if w.gang is None and w.tickets), key=lambda w: w.seq):
            for s, _ in w.tickets:
                party = parties.get(s)
                if party is not None and party in holding:
                    return w, holding[party], party
        return None

    def _forget_passes(self, group: Group) -> None:
        """``group`` was let go: a party that passed a gang waiting in it, and now holds none of that
        gang's groups, did let them all go, so its next pass is not the endless one (``_passer``)."""
        parties, groups = self._registry.parties, self._registry.groups
        for gang in self._queues.gangs.values():
            if not gang.passes or group.name not in gang.members.values():
                continue
            holding = {parties.get(s) for g in set(gang.members.values()) for s in groups[g].holder_sessions}
            gone = [p for p in gang.passes if p not in holding]
            if gone:
                self._journal.keep_dict(gang.passes)
                for p in gone:
                    del gang.passes[p]

    def _refuse_pass(self, group: Group, waiter: Waiter, held: str, party: str, gang: Gang, member: Waiter) -> None:
        """``party`` passed ``gang`` and, holding one of its groups ever since, would pass it again with
        ``waiter``: each of the party's requests of ``waiter`` fails with ``GangWaiting`` (behind the gang
        it would deadlock), told to its job as a ``policy`` notice too (the event log has it)."""
        groups = sorted(set(gang.members.values()))
        before, _ = gang.passes[party]
        error = GangWaiting(
            f"job {waiter.job!r} asked for group {group.name!r} while its party {party!r} holds group {held!r}, "
            f"and gang {gang.name!r} waits for groups {', '.join(groups)}: the party went before this gang "
            f"once already (in group {before!r}) and has held one of its groups since: going again would keep "
            f"the gang waiting for as long as the party holds one of them. Release group {held!r} before asking "
            f"for {group.name!r} again, or acquire both groups together as a gang (timesliced.gang(...))",
            job=waiter.job,
            group=group.name,
            held=held,
            party=party,
            gang=gang.name,
            gang_groups=groups,
        )
        parties = self._registry.parties
        mine = [t for t in waiter.tickets if parties.get(t[0]) == party]
        notice: dict[str, object] = {
            "group": group.name,
            "policy": self.policies.policy(group.name).name,
            "passed": member.job,
            "gang": gang.name,
            "refused": error.code,
            "reason": error.message,
        }
        self._emit(NotifyJob(waiter.job, "policy", notice))
        for ticket in mine:
            self._queues.fail(group, waiter, ticket, error)

    def _grant(self, group: Group, now: float, *, switch_s: float, restored: bool, switched: bool) -> None:
        head = group.queue[0]
        if head.gang is not None:
            self._grant_gang(group, self._queues.gangs[head.gang], now, (switch_s, restored, switched))
            return
        self._grant_one(group, now, switch_s=switch_s, restored=restored, switched=switched)

    def _grant_gang(self, group: Group, gang: Gang, now: float, done: tuple[float, bool, bool]) -> None:
        """``group``'s member is ready: grant every member if every group can, else wait for the rest.

        A group can when it is free, not frozen or drained, its head is the gang's member (the
        policy chose it), and the member is resident with nothing in its way.
        """
        if done[2] or group.name not in gang.ready:  # a switch's figures stay until the grant
            self._journal.fields(gang, READY)
            gang.ready = {**gang.ready, group.name: done}
        groups = self._registry.groups
        waiting = sorted(g for t, g in gang.members.items() if not self._member_ready(groups[g], t, gang, now))
        if waiting:
            why = f"gang {gang.name!r}: waiting for group{'s' if len(waiting) > 1 else ''} {', '.join(waiting)}"
            self._block(group, group.queue[0].job, why)
            return
        for g in sorted(set(gang.members.values())):
            member = groups[g]
            self._unblock(member)
            switch_s, restored, switched = gang.ready.get(g, (0.0, False, False))
            self._grant_one(member, now, switch_s=switch_s, restored=restored, switched=switched)

    def _member_ready(self, group: Group, ticket: tuple[int, int], gang: Gang, now: float) -> bool:
        if group.holder is not None or group.switch is not None or group.draining or group.name in self.frozen():
            return False
        if not group.queue or ticket not in group.queue[0].tickets or group.name not in gang.ready:
            return False
        job = self._registry.jobs[group.queue[0].job]
        if job.location is not Location.RESIDENT or job.faulted:
            return False
        plan = self._ledger.plan_room(job, now)
        return isinstance(plan, list) and not plan

    def _grant_one(self, group: Group, now: float, *, switch_s: float, restored: bool, switched: bool) -> None:
        waiter = self._queues.grant(group, now)
        job = self._registry.jobs[waiter.job]
        self._journal.fields(job, LAST_GRANTED)
        job.last_granted = now
        job.placed = True
        self._moves.granted(job)
        waited = now - waiter.enqueued_at
        self._figures.granted(group, job, waited, switch_s if switched else None)
        self._emit(
            GrantLock(
                group.name, job.name, group.fence, waited, switch_s, restored, tuple(waiter.tickets), switched=switched
            )
        )
