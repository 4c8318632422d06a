"""The scheduler's invariants, checked by the tests after every step (pure)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from .host import HOLDS_HOST
from .ledger import MemoryLedger
from .location import Location
from .model import Gang, Wait
from .moves import Moves
from .registry import Registry


def check(registry: Registry, ledger: MemoryLedger, moves: Moves, gangs: Mapping[str, Gang] | None = None) -> None:
    """Raise ``AssertionError`` if any invariant is broken."""
    gangs = {} if gangs is None else gangs
    groups, jobs, sessions = registry.groups, registry.jobs, registry.sessions
    in_flight = moves.in_flight.values()
    moving = {m.job: m for m in in_flight if m.kind != "reclaim"}
    assert len(moving) == len([m for m in in_flight if m.kind != "reclaim"]), "two moves of one job"
    for g in groups.values():
        if g.holder is not None:
            holder = jobs[g.holder]
            assert holder.group == g.name
            assert holder.location is Location.RESIDENT and not holder.faulted, (g.name, holder)
            assert not holder.exiting, f"exiting job {holder.name} holds {g.name}"
            assert g.holder_sessions and g.holder_sessions <= holder.sessions, (g.name, g.holder_sessions)
            assert g.switch is None
        else:
            assert not g.holder_sessions
        names = [w.job for w in g.queue]
        assert len(names) == len(set(names)), f"job queued twice in {g.name}: {names}"
        # After the head (the policy's choice) the queue is in arrival order.
        assert all(a.seq < b.seq for a, b in itertools.pairwise(g.queue[1:])), "not in arrival order"
        for w in g.queue:
            if w.gang is not None:
                gang = gangs.get(w.gang)
                assert gang is not None, f"{w.job} waits in {g.name} for a gang that is gone: {w.gang}"
                assert len(w.tickets) == 1 and all(gang.members.get(t) == g.name for t in w.tickets), (g.name, w)
                assert gang.seq is None or w.seq == gang.seq, (g.name, w, gang)
        assert all(w.tickets or w.kept_until is not None for w in g.queue), "empty waiter left in queue"
        assert g.holder not in names, "holder is also queued"
        for w in g.queue:
            job = jobs[w.job]
            assert job.group == g.name and not job.faulted and not job.exiting, (g.name, job)
            assert all(sessions.get(t[0]) == job.name for t in w.tickets), (g.name, w)
        if g.switch is not None:
            assert g.switch.pending, f"switch of {g.name} has nothing in flight"
            assert all(op in moves.in_flight for op in g.switch.pending)
    for name, job in jobs.items():
        move = moving.get(name)
        if job.location is Location.PARKING:
            assert move is not None and move.kind == "snapshot", (name, move)
        elif job.location is Location.RESTORING:
            assert move is not None and move.kind == "restore", (name, move)
            g = groups[job.group]
            if move.op in moves.prefetches:
                assert g.holder is not None or g.switch is None or g.switch.incoming != name, name
                assert job.declared and job.exclusive, f"{name} is prefetched without a declaration"
            else:
                assert g.switch is not None and g.switch.incoming == name and g.switch.restoring, name
        else:
            assert move is None, (name, move)
    for m in in_flight:
        if m.kind == "reclaim":
            assert jobs[m.job].exiting
    assert not moves.prefetches - moves.in_flight.keys(), "a prefetch that is not in flight"
    for op, stream in moves.streams.items():
        incoming = jobs.get(stream.incoming)
        assert incoming is not None and incoming.location.occupies_device, (op, stream)
        assert any(o in jobs and jobs[o].location.occupies_device for o in stream.outgoing), (op, stream)
        if op in moves.in_flight:
            assert moves.in_flight[op].job == stream.incoming and moves.in_flight[op].kind == "restore"
    for name, gang in gangs.items():
        # All or nothing: while a gang waits, every member it has waits, none holds.
        assert gang.members and len(gang.members) <= gang.size, (name, gang)
        assert gang.seq is None or len(gang.members) == gang.size, f"gang {name} granted in part: {gang}"
        assert len(set(gang.members.values())) == len(gang.members), f"gang {name} twice in a group"
        # A party passes only a complete gang, in one of the groups it waits in (``Arbiter._passer``).
        assert not gang.passes or gang.seq is not None, f"gang {name} passed before it was complete"
        assert all(g in gang.members.values() for g, _ in gang.passes.values()), (name, gang.passes)
        # A pass whose acquire still waits is still that party's (one that stopped waiting was no pass).
        for party, (passed_in, seq) in gang.passes.items():
            place = next((w for w in groups[passed_in].queue if w.seq == seq), None)
            assert place is None or any(registry.parties.get(s) == party for s, _ in place.tickets), (
                f"gang {name}: party {party}'s pass in {passed_in} is kept by a place without its requests: {place}"
            )
        for ticket, group in gang.members.items():
            place = next((w for w in groups[group].queue if ticket in w.tickets), None)
            assert place is not None and place.gang == name, f"member {ticket} of gang {name} does not wait in {group}"
    # No GPU over capacity: each job counts its footprint, a streamed pair (a restore taking its
    # snapshots' room as it frees) the larger of its two sides (``ledger.used``). Only growth that
    # measurement found in declared jobs (``residency.growth``) may take a GPU past it, never a placement.
    for gpu, cap in ledger.capacities.items():
        used, grown = ledger.used(gpu), ledger.grown(gpu)
        assert used - grown <= cap, f"gpu {gpu} over capacity: {used} > {cap} ({grown} of it measured growth)"
    for s, name in sessions.items():
        assert s in jobs[name].sessions
    assert set(registry.parties) <= set(sessions) and all(registry.parties.values()), "parties"
    for job in jobs.values():
        assert all(sessions.get(s) == job.name for s in job.sessions), job.name
        assert all(n >= 0 for n in job.footprint.values()), job.name
        # the ledger's indexes (registry): every GPU a footprint counts on, every exclusive job
        assert all(job.name in registry.on_gpu.get(g, {}) for g, n in job.footprint.items() if n), (job.name, "on_gpu")
        assert (job.name in registry.exclusive) == job.exclusive, (job.name, "exclusive")
        assert (job.name in registry.sized) == (job.exclusive and bool(job.declared)), (job.name, "sized")
        assert not job.parked or job.location in HOLDS_HOST, (
            f"{job.name} is {job.location.value}, yet counts parked bytes"
        )
        assert all(n > 0 for n in job.parked.values()), job.name
    assert all(registry.jobs.get(n) is j for on in registry.on_gpu.values() for n, j in on.items()), "on_gpu"
    assert all(registry.jobs.get(n) is j for n, j in registry.exclusive.items()), "exclusive"
    assert all(registry.jobs.get(n) is j for n, j in registry.sized.items()), "sized"
    assert set(registry.rank) == set(jobs), "rank"
    refused = {n for n, j in jobs.items() if j.refusal is not None}
    assert refused <= set(ledger.host.refused_jobs), ("refused_jobs", refused - set(ledger.host.refused_jobs))


def live(registry: Registry, ledger: MemoryLedger, frozen: Mapping[str, str], now: float) -> None:
    """Raise ``AssertionError`` if a waiter is left neither granted nor told why.

    A group that is not frozen, not drained, held by nobody and not switching, whose head asks for
    the lock, must be waiting (``Wait``, recorded in ``blocked``) for jobs that move on by themselves:
    a holder (it yields, or its slice is policed), a job on the move, or one being reclaimed.
    Anything else (room that can be made now, or that nothing under way will make) would have been
    acted on: granted, switched to, or told why.
    """
    for g in registry.groups.values():
        if g.name in frozen or g.draining or g.holder is not None or g.switch is not None or not g.queue:
            continue
        head = g.queue[0]
        if not head.tickets:
            continue  # a kept turn: it lapses by itself
        if head.gang is not None:
            # A gang's member waits for the gang's other groups (or for its gang to be complete);
            # gangs that share a group are chosen in one order everywhere, so that wait ends.
            continue
        job = registry.jobs[head.job]
        if job.location.moving:
            continue  # parked by another group's switch: that move ends by itself
        plan = ledger.plan_room(job, now)
        assert isinstance(plan, Wait), f"group {g.name}: its head {job.name} could be acted on, yet waits: {plan}"
        assert plan.on, f"group {g.name}: {job.name} waits for nothing: {plan.why}"
        incoming = {x.switch.incoming for x in registry.groups.values() if x.switch is not None}
        for name in plan.on:
            other = registry.jobs[name]
            moves_on = registry.holds(other) or other.location.moving or other.exiting or name in incoming
            assert moves_on, f"group {g.name}: {job.name} waits for {name}, which will not move on by itself"
        assert g.blocked == job.name and g.waiting_for, f"group {g.name}: {job.name} waits without saying why"
