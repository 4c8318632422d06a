"""A step of the scheduler that fails half-way, of a bug, changes nothing.

Each scenario builds a scheduler, then one step that does a lot: an event whose handler writes,
and the grants and switches that follow. The step is run once to count the calls it makes into
the core's concerns (``conftest.Faults``); then, for every one of those calls in turn, a fresh
scheduler runs the same step with that call raising. The scheduler must come out as it went in
(groups, jobs, sessions, moves, pending allocations, deadlines, figures, effects), keep its
invariants, and run the step again as if nothing had happened. (One scenario is a call of the
rebuilding API, which runs as a step too.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from timesliced.core.events import (
    AcquireRequested,
    HostMemoryRead,
    JobExited,
    MemoryRequested,
    MoveFinished,
    ReleaseRequested,
    RestoreJob,
    SessionClosed,
    SnapshotJob,
)
from timesliced.core.policy import QueuePolicy
from timesliced.core.scheduler import Scheduler
from timesliced.core.slices import SlicePolicy
from timesliced.core.undo import Fields, Journal

from ..helpers.harness import Fault, Faults, Harness, holding, only, two_jobs_one_parked
from ..helpers.turns import kept, settle, three_jobs

Step = Callable[[Harness], Any]


def acquire_granted_at_once(h: Harness) -> Step:
    a = h.register("A")
    return lambda h: h.s.handle(AcquireRequested(a, 1, 5.0), h.now)


def acquire_that_parks_the_idle_holder(h: Harness) -> Step:
    a, b = two_jobs_one_parked(h)  # B holds 60, A is parked with 60
    h.release(b)
    h.drain()
    return lambda h: h.s.handle(AcquireRequested(a, 99, 10.0), h.now)  # A needs B's 60: B is parked


def release_to_a_parked_waiter(h: Harness) -> Step:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.drain()
    return lambda h: h.s.handle(ReleaseRequested(b), h.now)  # yields, then parks B for A


def memory_request_that_parks_idle_jobs(h: Harness) -> Step:
    a = holding(h, "A", 30)
    h.release(a)
    c = holding(h, "C", 30, group="other")
    h.release(c)
    b = holding(h, "B")
    return lambda h: h.s.handle(MemoryRequested(b, 50, 0, 90), h.now)  # parks A and C, then waits


def snapshot_done_so_the_switch_restores(h: Harness) -> Step:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.drain()
    h.release(b)
    (snap,) = only(h.drain(), SnapshotJob)
    return lambda h: h.s.handle(MoveFinished(snap.op, True, 60, 0.5), h.now)


def restore_done_so_the_waiter_is_granted(h: Harness) -> Step:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.release(b)
    (snap,) = only(h.drain(), SnapshotJob)
    h.finish(snap, nbytes=60)
    (restore,) = only(h.drain(), RestoreJob)
    h.advance(1.0)
    return lambda h: h.s.handle(MoveFinished(restore.op, True, 60, 1.0), h.now)


def snapshot_failed_so_the_job_is_faulted(h: Harness) -> Step:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.release(b)
    (snap,) = only(h.drain(), SnapshotJob)
    h.acquire(b)  # B waits behind A; its snapshot fails: faulted, its waiters fail
    return lambda h: h.s.handle(MoveFinished(snap.op, False, 0, 0.1, "the driver said no"), h.now)


def snapshot_done_so_a_waiting_allocation_is_made(h: Harness) -> Step:
    a = holding(h, "A", 60)
    h.release(a)
    b = holding(h, "B")
    h.alloc(b, 60)
    (snap,) = only(h.drain(), SnapshotJob)
    return lambda h: h.s.handle(MoveFinished(snap.op, True, 60, 0.5), h.now)


def holder_session_closed_with_waiters_and_an_allocation(h: Harness) -> Step:
    a = holding(h, "A", 60)
    h.release(a)
    b = holding(h, "B")
    h.alloc(b, 60)  # waits for A's snapshot
    c = h.register("C")
    h.acquire(c, deadline=50.0)
    h.drain()
    return lambda h: h.s.handle(SessionClosed(b), h.now)


def holder_exited_with_waiters_and_an_allocation(h: Harness) -> Step:
    a = holding(h, "A", 60)
    h.release(a)
    b = holding(h, "B")
    h.acquire(h.register("B"))  # a second session of B holds too
    h.alloc(b, 60)
    c = h.register("C")
    h.acquire(c)
    h.drain()
    return lambda h: h.s.handle(JobExited("B"), h.now)


def timers_expire_an_acquire_and_preempt_the_holder(h: Harness) -> Step:
    holding(h, "A", 60)
    b = h.register("B")
    h.acquire(b, deadline=3.0)
    c = h.register("C")
    h.acquire(c)
    h.drain()
    return lambda h: h.s.handle_timers(5.0)  # B times out; A is warned, preempted and parked; C is granted


def snapshot_failed_intact_so_the_waiter_is_told(h: Harness) -> Step:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.release(b)
    (snap,) = only(h.drain(), SnapshotJob)
    h.acquire(b)  # B waits behind A; its park fails, whole: it stays usable, A is told why and B granted
    code = "insufficient_host_memory"
    return lambda h: h.s.handle(MoveFinished(snap.op, False, 0, 0.1, "no space left", intact=True, code=code), h.now)


def a_host_reading_lets_a_refused_park_go(h: Harness) -> Step:
    _, b = two_jobs_one_parked(h)
    h.host(10)
    h.release(b)
    h.exit("A")  # A's reclaim will free room
    c = h.register("C", "x", exclusive=True)
    h.acquire(c)  # parking B fits once the reclaim is done: C waits for it
    h.acquire(h.register("D", "x"))
    h.drain()
    return lambda h: h.s.handle(HostMemoryRead(0, 500, None, {"cg": 400}, {"B": ("cg",)}, {"C": 5}), h.now)


def a_new_leader_settles_a_half_parked_job(h: Harness) -> Step:
    a = holding(h, "A", 40)
    h.release(a)
    return lambda h: h.s.settle("A", h.now, {0: 60})  # parked everywhere, it owns its whole footprint


def on_gpu(h: Harness, job: str, group: str, gpu: int, nbytes: int = 0, *, release: bool = False) -> int:
    """``job`` of ``group`` (on ``gpu`` alone) holds, with ``nbytes`` there; then yields if ``release``."""
    sid = h.register(job, group, (gpu,))
    h.acquire(sid)
    if nbytes:
        h.alloc(sid, nbytes, gpu)
    if release:
        h.release(sid)
    h.drain()
    return sid


def a_gang_completes_and_is_granted_whole(h: Harness) -> Step:
    """Both pools switch for the gang: the last member's acquire parks the idle rivals' state."""
    t, s = on_gpu(h, "trainer", "t", 0, 50, release=True), on_gpu(h, "sampler", "s", 1, 50, release=True)
    for group, gpu in (("t", 0), ("s", 1)):
        on_gpu(h, f"rival-{group}", group, gpu, 60, release=True)  # parks the member there
        for op in list(h.s.moves.in_flight):
            h.handle(MoveFinished(op, True, 50, 0.1))
        h.drain()
    h.acquire(t, gang="sync", members=2)
    return lambda h: h.s.handle(AcquireRequested(s, 99, 10.0, gang="sync", members=2), h.now)


def the_last_members_restore_grants_the_gang(h: Harness) -> Step:
    a_gang_completes_and_is_granted_whole(h)(h)
    h.s.check_invariants(h.now)
    for op in list(h.s.moves.in_flight):  # the rivals' parks: the members' restores start
        h.handle(MoveFinished(op, True, 60, 0.1))
    restores = sorted(h.s.moves.in_flight)
    assert len(restores) == 2 and h.holder("t") is None
    h.handle(MoveFinished(restores[0], True, 50, 0.1))
    h.drain()
    return lambda h: h.s.handle(MoveFinished(restores[1], True, 50, 0.1), h.now)


def a_gang_is_withdrawn_by_a_closed_session(h: Harness) -> Step:
    t, s = h.register("trainer", "t", (0,)), h.register("sampler", "s", (1,))
    on_gpu(h, "rival", "s", 1, 10)
    h.acquire(t, 5.0, gang="sync", members=2)
    h.acquire(s, gang="sync", members=2)
    return lambda h: h.s.handle(SessionClosed(t), h.now)


def a_release_under_priority_passes_the_first_waiter(h: Harness) -> Step:
    a = on_gpu(h, "A", "p", 0, 30)
    for job, prio in (("B", 0), ("C", 2)):
        h.acquire(h.register(job, "p", (0,), priority=prio))
    return lambda h: h.s.handle(ReleaseRequested(a), h.now)


def party_crossing_a_gang(h: Harness, ps: int | None = None) -> dict[str, int]:
    """Party P holds ``t``; gang G (``gt``, ``gs``) waits for ``t`` and keeps ``s``; ``ps``: P's session in
    ``s``, if registered already."""
    s = {
        "pt": h.register("pt", "t", (0,), party="P"),
        "ps": h.register("ps", "s", (1,), party="P") if ps is None else ps,
        "gt": h.register("gt", "t", (0,)),
        "gs": h.register("gs", "s", (1,)),
    }
    h.acquire(s["pt"])
    h.acquire(s["gt"], gang="G", members=2)
    h.acquire(s["gs"], gang="G", members=2)
    return s


def a_party_passes_a_waiting_gang(h: Harness) -> Step:
    s = party_crossing_a_gang(h)
    return lambda h: h.s.handle(AcquireRequested(s["ps"], 99, 10.0), h.now)


def a_partys_second_pass_of_a_gang_is_refused(h: Harness) -> Step:
    s = party_crossing_a_gang(h)
    h.acquire(s["ps"])
    h.release(s["pt"])
    return lambda h: h.s.handle(AcquireRequested(s["pt"], 99, 10.0), h.now)


def a_release_forgets_a_partys_pass_and_grants_the_gang(h: Harness) -> Step:
    s = party_crossing_a_gang(h)
    h.acquire(s["ps"])
    h.release(s["ps"])
    return lambda h: h.s.handle(ReleaseRequested(s["pt"]), h.now)  # P holds none of G's groups: G goes


def a_partys_passer_times_out_and_its_pass_is_forgotten(h: Harness) -> Step:
    """P's ``ps`` passes the gang in ``s`` and waits for room that ``x`` (another group, GPU 1) holds."""
    ps, x = h.register("ps", "s", (1,), party="P"), h.register("x", "x", (1,))
    h.acquire(ps)
    h.alloc(ps, 60, 1)
    h.release(ps)
    h.acquire(x)
    h.alloc(x, 60, 1)  # parks idle ``ps``
    (snap,) = only(h.drain(), SnapshotJob)
    h.finish(snap, nbytes=60)
    s = party_crossing_a_gang(h, ps)
    h.acquire(s["ps"], deadline=h.now + 5.0)
    assert h.s.queues.gangs["G"].passes and h.s.groups["s"].blocked == "ps"
    return lambda h: h.s.handle_timers(h.now + 5.0)


def a_kept_holder_back_passes_who_asked_since(h: Harness) -> Step:
    """A's turn is kept (B waits), and C asks meanwhile: A's acquire is granted from its turn, and
    marks C."""
    h.s = Scheduler({0: 100}, anticipate_s=5.0)
    s = three_jobs(h)
    h.acquire(s["B"])
    h.advance(1.0)
    h.release(s["A"])
    assert kept(settle(h))
    h.acquire(s["C"])
    h.advance(0.1)
    return lambda h: h.s.handle(AcquireRequested(s["A"], 99, None), h.now)


for _gang in (
    a_gang_completes_and_is_granted_whole,
    the_last_members_restore_grants_the_gang,
    a_gang_is_withdrawn_by_a_closed_session,
    a_party_passes_a_waiting_gang,
    a_partys_second_pass_of_a_gang_is_refused,
    a_release_forgets_a_partys_pass_and_grants_the_gang,
    a_partys_passer_times_out_and_its_pass_is_forgotten,
):
    _gang.capacities = {0: 100, 1: 100}  # type: ignore[attr-defined]
a_release_under_priority_passes_the_first_waiter.queue_policies = {"*": QueuePolicy("priority")}  # type: ignore[attr-defined]


SCENARIOS: list[Callable[[Harness], Step]] = [
    acquire_granted_at_once,
    acquire_that_parks_the_idle_holder,
    release_to_a_parked_waiter,
    memory_request_that_parks_idle_jobs,
    snapshot_done_so_the_switch_restores,
    restore_done_so_the_waiter_is_granted,
    snapshot_failed_so_the_job_is_faulted,
    snapshot_done_so_a_waiting_allocation_is_made,
    snapshot_failed_intact_so_the_waiter_is_told,
    a_host_reading_lets_a_refused_park_go,
    holder_session_closed_with_waiters_and_an_allocation,
    holder_exited_with_waiters_and_an_allocation,
    timers_expire_an_acquire_and_preempt_the_holder,
    a_new_leader_settles_a_half_parked_job,
    a_gang_completes_and_is_granted_whole,
    the_last_members_restore_grants_the_gang,
    a_gang_is_withdrawn_by_a_closed_session,
    a_release_under_priority_passes_the_first_waiter,
    a_party_passes_a_waiting_gang,
    a_partys_second_pass_of_a_gang_is_refused,
    a_release_forgets_a_partys_pass_and_grants_the_gang,
    a_partys_passer_times_out_and_its_pass_is_forgotten,
    a_kept_holder_back_passes_who_asked_since,
]
POLICIES = {"*": SlicePolicy(4.0, "preempt", grace=0.0)}


def outcome(h: Harness, step: Step, faults: Faults) -> tuple[tuple[Any, ...], int]:
    """What the step returns, leaves and emits; and how many calls it made."""
    result = step(h)
    calls = faults.calls
    h.s.check_invariants()
    return (result, h.state(), repr(h.drain())), calls  # repr: errors compare by identity


def run_with_faults(
    harness: Callable[..., Harness], faults: Faults, scenario: Callable[[Harness], Step]
) -> tuple[list[str], set[str]]:
    """Fail the scenario's step at each of its calls in turn: what went wrong, and where the faults hit."""

    def build() -> tuple[Harness, Step]:
        capacities = getattr(scenario, "capacities", {0: 100})
        h = harness(capacities, policies=POLICIES, queue_policies=getattr(scenario, "queue_policies", None))
        step = scenario(h)
        h.drain()
        return h, step

    h, step = build()
    faults.arm(None)
    expected, calls = outcome(h, step, faults)
    assert calls >= 10 and expected[2], "the step should do some work"
    wrong, where = [], set()
    for at in range(1, calls + 1):
        h, step = build()
        before = h.state()
        faults.arm(at)
        with pytest.raises(Fault):
            step(h)
        fault = f"a fault at call {at} of {calls} ({faults.where})"
        where.add(faults.where)
        if h.state() != before:
            wrong.append(f"{fault} changed the scheduler")
        elif h.drain():
            wrong.append(f"{fault} left effects")
        else:
            h.s.check_invariants()
            faults.arm(None)
            if outcome(h, step, faults)[0] != expected:
                wrong.append(f"after {fault} the step went otherwise")
    return wrong, where


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_a_step_that_fails_at_any_call_changes_nothing(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch, scenario: Callable[[Harness], Step]
) -> None:
    wrong, where = run_with_faults(harness, Faults(monkeypatch), scenario)
    assert not wrong, "\n".join(wrong)
    # the faults hit several concerns and the journal's own notes, not just one place
    touched = {w.split(".")[0] for w in where}
    assert len(touched) >= 3 and "Journal" in touched, touched


def test_the_check_sees_a_write_that_was_not_noted(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check itself can fail: with the holder written unnoted, a fault after the grant shows."""
    faults = Faults(monkeypatch)
    noted = Journal.fields

    def forgetful(self: Journal, obj: object, fields: Fields) -> None:
        if "holder" not in fields.names:
            noted(self, obj, fields)

    monkeypatch.setattr(Journal, "fields", forgetful)
    wrong, _ = run_with_faults(harness, faults, acquire_granted_at_once)
    assert any("changed the scheduler" in w for w in wrong), wrong


def test_a_refused_input_still_changes_nothing_with_every_call_wrapped(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from timesliced import errors

    a = holding(h, "A")
    Faults(monkeypatch).arm(None)
    h.fails(ReleaseRequested(h.register("B")), errors.NotHolder)
    h.release(a)
