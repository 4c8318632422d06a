"""The scheduler core, one transition at a time.

Moves (snapshots, restores) are driven by hand: a test reads the effects the
core drained and feeds ``MoveFinished`` for the ops it chooses, in the order it
chooses. The harness checks the core's invariants after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from timesliced import errors
from timesliced.core.events import (
    AcquireRequested,
    AcquireWithdrawn,
    AllocateRegion,
    DrainRequested,
    FailRequest,
    ForceReleaseRequested,
    GrantLock,
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
    SnapshotJob,
)
from timesliced.core.scheduler import Scheduler

from ..helpers.harness import Harness, holding, kinds, one_grant, only, two_jobs_one_parked

# --- registration ------------------------------------------------------------------------


def test_register_new_group_takes_every_gpu(harness: Callable[..., Harness]) -> None:
    h = harness({0: 10, 1: 10, 2: 10})
    result = h.handle(JobRegistered(1, "A", "g", None, (11, 12)))
    assert result == {"job": "A", "group": "g", "gpus": [0, 1, 2], "location": "resident"}
    assert h.drain() == []
    assert h.group_state() == "idle"


def test_register_explicit_gpus_sorted_and_deduplicated(harness: Callable[..., Harness]) -> None:
    h = harness({0: 10, 1: 10, 2: 10})
    result = h.handle(JobRegistered(1, "A", "g", (2, 0, 2), ()))
    assert result["gpus"] == [0, 2]
    # a later job may name the same GPUs in another order, or none at all
    h.handle(JobRegistered(2, "B", "g", (0, 2), ()))
    h.handle(JobRegistered(3, "C", "g", None, ()))
    assert h.s.groups["g"].gpus == (0, 2)


def test_second_session_joins_job_and_adds_pids(h: Harness) -> None:
    h.handle(JobRegistered(1, "A", "g", None, (5,)))
    h.handle(JobRegistered(2, "A", "g", None, (6,)))
    assert h.s.jobs["A"].sessions == {1, 2}
    assert h.s.jobs["A"].pids == {5, 6}


@pytest.mark.parametrize(
    ("event", "error", "match"),
    [
        (JobRegistered(1, "A", "g", None), errors.AlreadyRegistered, "already registered job 'A'"),
        (JobRegistered(1, "B", "g", None), errors.AlreadyRegistered, "already registered"),
        (JobRegistered(9, "X", "g", (1,)), errors.GroupMismatch, r"has GPUs \[0\], not \[1\]"),
        (JobRegistered(9, "A", "other", None), errors.GroupMismatch, "belongs to group 'g'"),
        (JobRegistered(9, "X", "new", (0, 7)), errors.UnknownDevice, r"no GPU \[7\]"),
        (JobRegistered(9, "X", "new", ()), errors.BadRequest, "at least one GPU"),
    ],
)
def test_register_errors_change_nothing(
    harness: Callable[..., Harness], event: JobRegistered, error: type[Exception], match: str
) -> None:
    h = harness({0: 10, 1: 10})
    h.handle(JobRegistered(1, "A", "g", (0,)))
    h.fails(event, error, match)


@pytest.mark.parametrize(
    "event",
    [
        AcquireRequested(42, 1),
        AcquireWithdrawn(42, 1),
        ReleaseRequested(42),
        MemoryRequested(42, 1, 0, 10),
    ],
    ids=lambda e: type(e).__name__,
)
def test_unregistered_session_is_refused(h: Harness, event: Any) -> None:
    h.register("A")
    err = h.fails(event, errors.NotRegistered)
    assert err.code == "not_registered"


def test_unknown_session_closing_is_harmless(h: Harness) -> None:
    h.close(42)
    assert h.drain() == []


def test_scheduler_needs_a_gpu() -> None:
    with pytest.raises(ValueError):
        Scheduler({})


# --- the lock: acquire and yield ---------------------------------------------------------


def test_first_acquire_is_granted_at_once(h: Harness) -> None:
    a = h.register("A")
    h.advance(3.0)
    rid = h.acquire(a)
    assert h.drain() == [GrantLock("g", "A", 1, 0.0, 0.0, False, ((a, rid),))]
    assert h.holder() == "A"
    assert h.group_state() == "locked"


def test_holder_reacquire_gets_again_grant_with_same_fence(h: Harness) -> None:
    a = holding(h, "A")
    a2 = h.register("A")  # a second process of the same job
    rid = h.acquire(a2)
    assert h.drain() == [GrantLock("g", "A", 1, 0.0, 0.0, False, ((a2, rid),), again=True)]
    rid = h.acquire(a)
    assert h.drain() == [GrantLock("g", "A", 1, 0.0, 0.0, False, ((a, rid),), again=True)]
    # the lock is held until every session that acquired it yields
    h.release(a)
    assert h.holder() == "A"
    h.release(a2)
    assert h.holder() is None


def test_queued_job_acquiring_again_keeps_its_place(h: Harness) -> None:
    a = holding(h, "A")
    b = h.register("B")
    c = h.register("C")
    b1 = h.acquire(b)
    c1 = h.acquire(c)
    h.advance(1.0)
    b2 = h.acquire(b)
    assert h.queue() == ["B", "C"]
    assert h.s.groups["g"].queue[0].enqueued_at == 0.0
    assert h.drain() == []
    h.release(a)
    grant = one_grant(h.drain())
    assert grant.job == "B" and set(grant.tickets) == {(b, b1), (b, b2)}
    assert grant.fence == 2 and grant.waited_s == 1.0 and not grant.restored
    assert h.queue() == ["C"]
    assert (c, c1) in h.s.groups["g"].queue[0].tickets


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ("nobody", r"\(nobody does\)"),
        ("other", r"\(job .A. does\)"),
        ("waiting", r"\(job .A. does\)"),
        ("other-session", "this connection does not hold group 'g': job 'A' holds it through another"),
    ],
)
def test_only_the_holder_can_yield(h: Harness, setup: str, match: str) -> None:
    a = h.register("A")
    b = h.register("B")
    if setup != "nobody":
        h.acquire(a)
    if setup == "waiting":
        h.acquire(b)
    who = h.register("A") if setup == "other-session" else b
    h.drain()
    err = h.fails(ReleaseRequested(who), errors.NotHolder, match)
    assert err.code == "not_holder"


def test_yield_with_nobody_waiting_moves_nothing(h: Harness) -> None:
    a = holding(h, "A", 60)
    h.advance(2.0)
    assert h.release(a) == {"group": "g", "fence": 1, "held_s": 2.0}
    assert h.drain() == []
    assert h.group_state() == "idle-yielded"
    assert h.location("A") == "resident" and h.used() == 60
    h.advance(1.0)
    rid = h.acquire(a)
    assert h.drain() == [GrantLock("g", "A", 2, 0.0, 0.0, False, ((a, rid),))]


def test_yield_to_a_waiter_that_is_resident_needs_no_move(h: Harness) -> None:
    a = holding(h, "A", 30)
    b = h.register("B")
    h.advance(1.0)
    rid = h.acquire(b)
    h.advance(2.0)
    h.release(a)
    assert h.drain() == [GrantLock("g", "B", 2, 2.0, 0.0, False, ((b, rid),))]


def test_switch_snapshots_outgoing_then_restores_incoming(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)  # B holds 60, A parked with 60
    h.advance(1.0)
    rid = h.acquire(a)
    assert h.drain() == []
    assert h.queue() == ["A"]
    h.advance(1.0)
    h.release(b)
    effects = h.drain()
    (snap,) = effects
    assert snap == SnapshotJob(snap.op, "B")
    assert h.group_state() == "switching"
    assert h.location("B") == "parking" and h.used() == 60
    h.advance(0.5)
    h.finish(snap, nbytes=60)
    (restore,) = h.drain()
    assert restore == RestoreJob(restore.op, "A")
    assert h.location("B") == "parked" and h.location("A") == "restoring" and h.used() == 60
    h.advance(0.25)
    h.finish(restore, nbytes=60)
    assert h.drain() == [GrantLock("g", "A", 3, 1.75, 0.75, True, ((a, rid),))]
    assert h.location("A") == "resident" and h.holder() == "A"
    group = h.s.describe(h.now)["groups"][0]
    assert group["switches"] == 1 and group["bytes_moved"] == 180 and group["median_switch_s"] == 0.75


def test_switch_keeps_both_resident_when_both_fit(h: Harness) -> None:
    a, b = two_jobs_one_parked(h, a_bytes=30, b_bytes=80)  # parking A was needed for B's 80
    h.free("B", 40)  # B is down to 40: A's 30 fits next to it
    h.acquire(a)
    h.release(b)
    (restore,) = h.drain()
    assert restore == RestoreJob(restore.op, "A")
    h.finish(restore)
    grant = one_grant(h.drain())
    assert grant.job == "A" and grant.restored
    assert h.location("B") == "resident" and h.used() == 70


def test_every_snapshot_finishes_before_the_restore(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100})
    # C is parked with 90; A and B sit idle with 40 each.
    c = holding(h, "C", 90)
    h.release(c)
    h.advance(1.0)
    a = holding(h, "A")
    h.alloc(a, 40)
    (snap_c,) = only(h.drain(), SnapshotJob)
    h.finish(snap_c)
    h.drain()
    h.release(a)
    h.advance(1.0)
    b = holding(h, "B", 40)
    h.release(b)
    assert [h.location(j) for j in "ABC"] == ["resident", "resident", "parked"]
    h.acquire(c)
    effects = h.drain()
    assert kinds(effects) == ["SnapshotJob", "SnapshotJob"]
    assert [e.job for e in effects] == ["A", "B"]  # least recently granted first
    h.finish(effects[1])
    assert h.drain() == []  # A is still being parked: no restore yet
    h.finish(effects[0])
    (restore,) = h.drain()
    assert restore == RestoreJob(restore.op, "C")
    h.finish(restore)
    assert one_grant(h.drain()).job == "C"


def test_fences_grow_with_every_new_grant(h: Harness) -> None:
    a = h.register("A")
    b = h.register("B")
    fences = []
    for _ in range(3):
        h.acquire(a)
        h.acquire(b)
        h.release(a)
        h.release(b)
        fences += [g.fence for g in only(h.drain(), GrantLock)]
    assert fences == [1, 2, 3, 4, 5, 6]


def test_waiters_are_served_in_arrival_order(h: Harness) -> None:
    sessions = {name: h.register(name) for name in "ABCD"}
    for name in "ABCD":
        h.acquire(sessions[name])
    order = []
    for _ in range(4):
        grant = one_grant(h.drain())
        order.append(grant.job)
        h.release(sessions[grant.job])
    assert order == ["A", "B", "C", "D"]
    assert h.group_state() == "idle-yielded"


def test_max_waiters(harness: Callable[..., Harness]) -> None:
    h = harness(max_waiters=1)
    holding(h, "A")
    b = h.register("B")
    c = h.register("C")
    h.acquire(b)
    h.acquire(b)  # a job already waiting does not count twice
    err = h.fails(AcquireRequested(c, 99), errors.LimitExceeded, "already has 1 waiting jobs")
    assert err.code == "limit_exceeded"


# --- leaving the queue ---------------------------------------------------------------------


def test_cancel_a_waiting_acquire(h: Harness) -> None:
    holding(h, "A")
    b = h.register("B")
    r1 = h.acquire(b)
    r2 = h.acquire(b)
    assert h.cancel(b, r1) == {"cancelled": True}
    (fail,) = h.drain()
    assert isinstance(fail, FailRequest) and fail.ticket == (b, r1)
    assert isinstance(fail.error, errors.AcquireCancelled)
    assert h.queue() == ["B"]  # still waiting through r2
    assert h.cancel(b, r2) == {"cancelled": True}
    assert h.queue() == []
    assert h.cancel(b, r2) == {"cancelled": False}  # already answered
    assert kinds(h.drain()) == ["FailRequest"]


def test_cancel_after_grant_is_a_no_op(h: Harness) -> None:
    a = h.register("A")
    rid = h.acquire(a)
    h.drain()
    assert h.cancel(a, rid) == {"cancelled": False}
    assert h.drain() == [] and h.holder() == "A"


def test_acquire_timeout(h: Harness) -> None:
    holding(h, "A")
    b = h.register("B")
    c = h.register("C")
    rb = h.acquire(b, deadline=5.0)
    rc = h.acquire(c, deadline=3.0)
    assert h.s.next_deadline() == 3.0
    h.timers(2.9)
    assert h.drain() == []
    h.timers(3.0)
    (fail,) = h.drain()
    assert fail == FailRequest((c, rc), fail.error) and isinstance(fail.error, errors.AcquireTimeout)
    assert h.queue() == ["B"]
    assert h.s.next_deadline() == 5.0
    # asking again on the same request with a later deadline moves the deadline
    h.handle(AcquireRequested(b, rb, 8.0))
    h.timers(6.0)
    assert h.drain() == [] and h.queue() == ["B"]
    assert h.s.next_deadline() == 8.0
    h.handle(AcquireRequested(b, rb, None))
    h.timers(100.0)
    assert h.drain() == [] and h.queue() == ["B"]
    assert h.s.next_deadline() is None


def test_a_granted_acquire_never_times_out(h: Harness) -> None:
    a = h.register("A")
    h.acquire(a, deadline=1.0)
    assert one_grant(h.drain()).job == "A"
    assert h.s.next_deadline() is None
    h.timers(5.0)
    assert h.drain() == [] and h.holder() == "A"


def test_waiter_session_closed_leaves_queue(h: Harness) -> None:
    a = holding(h, "A")
    b = h.register("B")
    c = h.register("C")
    h.acquire(b, deadline=10.0)
    rc = h.acquire(c)
    h.close(b)
    assert h.drain() == [] and h.queue() == ["C"]
    assert h.s.next_deadline() is None
    h.release(a)
    assert one_grant(h.drain()).tickets == ((c, rc),)


LEAVE_WAYS = ["cancel", "timeout", "close", "exit"]


def _leave(h: Harness, how: str, sid: int, rid: int, job: str) -> None:
    if how == "cancel":
        h.cancel(sid, rid)
    elif how == "timeout":
        h.timers(h.s.groups["g"].queue[0].tickets[(sid, rid)] or 0.0)
    elif how == "close":
        h.close(sid)
    else:
        h.exit(job)


@pytest.mark.parametrize("how", LEAVE_WAYS)
@pytest.mark.parametrize("phase", ["snapshot", "restore"])
def test_waiter_leaving_mid_switch_is_never_granted(h: Harness, how: str, phase: str) -> None:
    a, b = two_jobs_one_parked(h)  # B holds, A parked
    rid = h.acquire(a, deadline=50.0)
    c = h.register("C")
    rc = h.acquire(c)
    h.release(b)
    (snap,) = h.drain()
    if phase == "restore":
        h.finish(snap)
        (restore,) = h.drain()
        assert restore.job == "A"
    _leave(h, how, a, rid, "A")
    effects = h.drain()
    if how in ("cancel", "timeout", "exit"):
        (fail,) = only(effects, FailRequest)
        assert fail.ticket == (a, rid)
        expected = {"cancel": errors.AcquireCancelled, "timeout": errors.AcquireTimeout, "exit": errors.JobFaulted}
        assert isinstance(fail.error, expected[how])
    else:
        assert only(effects, FailRequest) == []
    assert h.queue() == ["C"]
    assert only(effects, GrantLock) == []  # the switch in flight still blocks the group
    if phase == "snapshot":
        h.finish(snap)
    else:
        h.finish(restore)
    effects += h.drain()
    # A is not restored for nobody: C, resident all along, is granted at once
    assert only(effects, RestoreJob) == []
    grants = only(effects, GrantLock)
    assert [(g.job, g.tickets, g.restored) for g in grants] == [("C", ((c, rc),), False)]
    expected_location = {"snapshot": "parked", "restore": "resident"}[phase]
    if how == "exit":
        (reclaim,) = only(effects, ReclaimJob)
        h.reclaimed(reclaim)
        assert "A" not in h.s.jobs
    else:
        assert h.location("A") == expected_location


def test_reacquire_after_cancel_mid_switch_goes_to_the_back(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    rid = h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.cancel(a, rid)
    c = h.register("C")
    rc = h.acquire(c)
    r2 = h.acquire(a)  # A asks again: behind C
    assert h.queue() == ["C", "A"]
    assert kinds(h.drain()) == ["FailRequest"]
    h.finish(snap)
    assert one_grant(h.drain()).tickets == ((c, rc),)
    h.release(c)
    (restore,) = h.drain()
    assert restore.job == "A"
    h.finish(restore)
    grant = one_grant(h.drain())
    assert grant.tickets == ((a, r2),) and grant.restored


def test_reacquire_mid_switch_as_the_only_waiter_is_restored(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    rid = h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.cancel(a, rid)
    r2 = h.acquire(a)
    h.drain()
    h.finish(snap)
    (restore,) = h.drain()
    h.finish(restore)
    grant = one_grant(h.drain())
    assert grant.tickets == ((a, r2),) and grant.restored


# --- the holder goes away ----------------------------------------------------------------


def test_holder_session_closed_loses_the_lock(h: Harness) -> None:
    a = holding(h, "A")
    b = h.register("B")
    rb = h.acquire(b)
    h.advance(1.0)
    h.close(a)
    assert h.drain() == [GrantLock("g", "B", 2, 1.0, 0.0, False, ((b, rb),))]
    assert h.s.jobs["A"].sessions == set()
    assert h.location("A") == "resident"  # the job lives on, without the lock


def test_holder_with_two_sessions_keeps_the_lock_until_both_close(h: Harness) -> None:
    a1 = holding(h, "A")
    a2 = h.register("A")
    h.acquire(a2)
    h.drain()
    h.close(a1)
    assert h.holder() == "A"
    h.close(a2)
    assert h.holder() is None and h.group_state() == "idle-yielded"


def test_holder_process_exit(h: Harness) -> None:
    a = holding(h, "A", 50)
    b = h.register("B")
    rb = h.acquire(b)
    h.exit("A")
    effects = h.drain()
    assert kinds(effects) == ["ReclaimJob", "GrantLock"]
    reclaim, grant = effects
    assert reclaim.job == "A" and grant.tickets == ((b, rb),)
    assert h.used() == 50  # the memory is freed once the reclaim is done
    h.exit("A")  # twice is harmless
    assert h.drain() == []
    h.reclaimed(reclaim)
    assert "A" not in h.s.jobs and h.used() == 0
    h.fails(AcquireRequested(a, 99), errors.NotRegistered)
    h.fails(ReclaimFinished(reclaim.op), ValueError)
    h.exit("nobody")  # unknown jobs are ignored
    # the name can be used again
    h.handle(JobRegistered(a, "A", "g", None))


def test_exiting_job_is_refused_until_reclaimed(h: Harness) -> None:
    a = holding(h, "A", 50)
    h.release(a)
    h.exit("A")
    (reclaim,) = h.drain()
    h.fails(AcquireRequested(a, 99), errors.JobFaulted, "exited")
    h.fails(MemoryRequested(a, 99, 0, 1), errors.JobFaulted, "exited")
    h.fails(JobRegistered(77, "A", "g", None), errors.JobFaulted, "torn down")
    h.reclaimed(reclaim)
    assert h.used() == 0
    h.handle(JobRegistered(77, "A", "g", None))


def test_exiting_job_is_never_parked(h: Harness) -> None:
    a = holding(h, "A", 50)
    h.release(a)
    h.exit("A")
    (reclaim,) = h.drain()
    b = holding(h, "B")
    err = h.fails(MemoryRequested(b, 99, 0, 60), errors.OutOfMemory)
    assert "A (50 B, resident)" in str(err)
    h.reclaimed(reclaim)
    h.alloc(b, 60)
    assert kinds(h.drain()) == ["AllocateRegion"]


def test_exit_of_a_job_being_parked_reclaims_after_the_snapshot(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.exit("B")
    assert h.drain() == []  # B is on the move: reclaim once the snapshot ends
    h.finish(snap)
    effects = h.drain()
    assert kinds(effects) == ["ReclaimJob", "RestoreJob"]


def test_exit_of_the_incoming_job_while_it_is_restored(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.finish(snap)
    (restore,) = h.drain()
    h.exit("A")
    (fail,) = h.drain()
    assert isinstance(fail, FailRequest) and isinstance(fail.error, errors.JobFaulted)
    h.finish(restore)
    (reclaim,) = h.drain()
    assert reclaim == ReclaimJob(reclaim.op, "A")
    assert h.holder() is None
    h.reclaimed(reclaim)
    assert h.used() == 0


def test_exit_of_the_incoming_job_before_its_restore(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.exit("A")
    fail, reclaim = h.drain()
    assert isinstance(fail, FailRequest) and isinstance(reclaim, ReclaimJob)
    h.reclaimed(reclaim)  # gone before the snapshot made room for it
    h.finish(snap)
    assert h.drain() == [] and h.group_state() == "idle"


# --- memory ----------------------------------------------------------------------------------


def test_memory_that_fits_is_reserved(h: Harness) -> None:
    a = holding(h, "A")
    rid = h.alloc(a, 40)
    assert h.drain() == [AllocateRegion((a, rid), "A", 0, 40, 40)]
    assert h.used() == 40
    h.free("A", 15)
    assert h.s.jobs["A"].footprint == {0: 25}
    h.free("A", 25)
    assert h.s.jobs["A"].footprint == {}
    h.free("nobody", 25)  # a job that is gone: ignored


def test_memory_requests_do_not_need_the_lock(h: Harness) -> None:
    holding(h, "A")
    b = h.register("B")
    rid = h.alloc(b, 10)
    assert h.drain() == [AllocateRegion((b, rid), "B", 0, 10, 10)]


def test_memory_parks_least_recently_granted_idle_job(h: Harness) -> None:
    a = holding(h, "A", 30)
    h.release(a)
    h.advance(1.0)
    b = holding(h, "B", 30)
    h.release(b)
    h.advance(1.0)
    h.acquire(a)  # A was granted again: B is now the least recently granted
    h.release(a)
    h.advance(1.0)
    c = holding(h, "C", 30)
    rid = h.alloc(c, 20)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "B")
    h.finish(snap, nbytes=30)
    assert h.drain() == [AllocateRegion((c, rid), "C", 0, 20, 20)]
    assert h.location("B") == "parked" and h.location("A") == "resident"
    assert h.used() == 80


def test_memory_waits_for_a_snapshot_already_on_its_way(h: Harness) -> None:
    # Two processes of B ask for memory at once (ranks of one job): the first request parks A;
    # the second must wait for that snapshot rather than fail while A is still leaving.
    a = holding(h, "A", 70)
    h.release(a)
    b1 = h.register("B")
    b2 = h.register("B")
    h.acquire(b1)
    h.drain()
    h.alloc(b1, 40)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "A")
    h.alloc(b2, 40)  # 30 free while A leaves, 100 once it is parked
    assert h.drain() == []
    h.finish(snap, nbytes=70)
    assert [e.ticket[0] for e in only(h.drain(), AllocateRegion)] == [b1, b2]
    assert h.used() == 80
    h.fails(MemoryRequested(b2, 99, 0, 21), errors.OutOfMemory)  # 20 left, nothing else to park


def test_memory_parks_several_and_skips_jobs_not_on_that_gpu(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100, 1: 100})
    a = holding(h, "A", 40, gpu=0)
    h.release(a)
    b = holding(h, "B", 90, gpu=1)  # on the other GPU: parking it frees nothing on GPU 0
    h.release(b)
    c = holding(h, "C", 30, gpu=0)
    h.release(c)
    d = holding(h, "D")
    rid = h.alloc(d, 90, gpu=0)
    effects = h.drain()
    assert [(type(e).__name__, e.job) for e in effects] == [("SnapshotJob", "A"), ("SnapshotJob", "C")]
    h.finish(effects[0])
    assert h.drain() == []
    h.finish(effects[1])
    assert h.drain() == [AllocateRegion((d, rid), "D", 0, 90, 90)]
    assert h.location("B") == "resident"


def test_requested_size_travels_with_the_reservation_also_when_deferred(h: Harness) -> None:
    a = holding(h, "A", 30)
    h.release(a)
    h.advance(1.0)
    b = holding(h, "B")
    rid = h.rid()
    h.handle(MemoryRequested(b, rid, 0, 40, requested=33))  # the ledger counts 40 (whole pages)
    assert h.drain() == [AllocateRegion((b, rid), "B", 0, 40, 33)]
    rid = h.rid()
    h.handle(MemoryRequested(b, rid, 0, 40, requested=37))  # only fits once A is parked
    (snap,) = h.drain()
    h.finish(snap, nbytes=30)
    assert h.drain() == [AllocateRegion((b, rid), "B", 0, 40, 37)]
    assert h.used() == 80


@pytest.mark.parametrize("blocker", ["holder", "moving", "faulted"])
def test_memory_never_parks_holders_moving_or_faulted_jobs(harness: Callable[..., Harness], blocker: str) -> None:
    h = harness({0: 100})
    if blocker == "holder":
        holding(h, "X", 70, group="other")
    elif blocker == "moving":
        x = holding(h, "X", 70, group="other")
        h.release(x)
        y = holding(h, "Y", group="third")
        h.alloc(y, 40)
        (snap,) = h.drain()
        assert snap.job == "X" and h.location("X") == "parking"
    else:
        x = holding(h, "X", 70, group="other")
        h.release(x)
        y = holding(h, "Y", group="third")
        h.alloc(y, 40)
        (snap,) = h.drain()
        h.finish(snap, ok=False, error="boom")
        effects = h.drain()
        assert kinds(effects) == ["NotifyJob", "FailRequest"]
        assert effects[0] == NotifyJob("X", "faulted", {"job": "X", "reason": "snapshot failed: boom"})
        assert isinstance(effects[1].error, errors.OutOfMemory)
        assert h.s.jobs["X"].faulted and h.used() == 70  # the failed snapshot keeps its memory
    z = holding(h, "Z")
    # moving: X's 70 bytes are on their way out, but Y waits for 40 of them
    n = 70 if blocker == "moving" else 50
    err = h.fails(MemoryRequested(z, 99, 0, n), errors.OutOfMemory)
    assert err.details == {"gpu": 0}
    message = str(err)
    assert f"GPU 0: cannot allocate {n} B for job 'Z': 30 B of 100 B free" in message
    expected = {"holder": "X (70 B, holding)", "moving": "X (70 B, parking)", "faulted": "X (70 B, resident)"}[blocker]
    assert expected in message


def test_memory_larger_than_the_gpu(h: Harness) -> None:
    a = holding(h, "A")
    err = h.fails(MemoryRequested(a, 99, 0, 101), errors.OutOfMemory, "cannot allocate 101 B ")
    assert "also on it" not in str(err)


@pytest.mark.parametrize(
    ("state", "gpu", "error", "match"),
    [
        ("parked", 0, errors.NotResident, "is parked; acquire the lock first"),
        ("resident", 3, errors.UnknownDevice, r"GPU 3 is not in group 'g'"),
        ("faulted", 0, errors.JobFaulted, "is faulted: restore failed: bad"),
    ],
)
def test_memory_request_errors(h: Harness, state: str, gpu: int, error: type[Exception], match: str) -> None:
    a, b = two_jobs_one_parked(h)  # A parked
    if state == "resident":
        h.fails(MemoryRequested(b, 99, gpu, 1), error, match)
        return
    if state == "faulted":
        h.free("B", 60)
        h.acquire(a)
        h.release(b)
        (restore,) = h.drain()
        h.finish(restore, ok=False, error="bad")
        h.drain()
    h.fails(MemoryRequested(a, 99, gpu, 1), error, match)


@pytest.mark.parametrize(
    ("event", "match"),
    [
        (MemoryRequested(1, 99, 0, -1), "cannot allocate -1"),
        (MemoryReleased("A", 0, -1), "cannot free -1"),
        (MemoryReleased("A", 0, 41), "frees more on GPU 0 than it holds"),
        (MoveFinished(12345, True), "no snapshot or restore with op 12345"),
        (ReclaimFinished(12345), "no reclaim with op 12345"),
    ],
)
def test_misuse_raises_value_error_and_changes_nothing(h: Harness, event: Any, match: str) -> None:
    holding(h, "A", 40)
    h.fails(event, ValueError, match)


def test_move_and_reclaim_ops_are_not_interchangeable(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.fails(ReclaimFinished(snap.op), ValueError)
    h.register("C", "other")
    h.exit("C")
    (reclaim,) = h.drain()
    h.fails(MoveFinished(reclaim.op, True), ValueError)
    # both still complete normally afterwards
    h.reclaimed(reclaim)
    h.finish(snap)
    assert kinds(h.drain()) == ["RestoreJob"]


def test_pending_memory_request_fails_if_its_job_is_parked_meanwhile(h: Harness) -> None:
    a = holding(h, "A", 40)
    h.release(a)
    h.advance(1.0)
    x = holding(h, "X", 50, group="x")
    h.release(x)
    h.advance(1.0)
    b = holding(h, "B", 10)
    h.release(b)
    h.advance(1.0)
    c = holding(h, "C", group="c")
    h.alloc(c, 30)  # parks A, the least recently granted
    (snap,) = h.drain()
    assert snap.job == "A"
    h.finish(snap)
    h.drain()
    h.release(c)
    h.advance(1.0)
    # B (idle, not holding) asks for 45: X must go
    rid = h.alloc(b, 45)
    (snap_x,) = h.drain()
    assert snap_x.job == "X"
    # meanwhile A wants its turn back and needs 40: B and C go for it
    h.acquire(a)
    effects = h.drain()
    assert [(type(e).__name__, e.job) for e in effects] == [("SnapshotJob", "B"), ("SnapshotJob", "C")]
    h.finish(snap_x)
    (fail,) = h.drain()
    assert fail.ticket == (b, rid) and isinstance(fail.error, errors.NotResident)
    for snap in effects:
        h.finish(snap)
    (restore,) = h.drain()
    assert restore.job == "A"
    h.finish(restore)
    assert one_grant(h.drain()).job == "A"


def test_pending_memory_request_dropped_with_its_session(h: Harness) -> None:
    a = holding(h, "A", 60)
    h.release(a)
    b = h.register("B")
    h.alloc(b, 60)
    (snap,) = h.drain()
    h.close(b)
    h.finish(snap)
    assert h.drain() == []
    assert h.used() == 0


def test_pending_memory_request_of_an_exiting_job_fails(h: Harness) -> None:
    a = holding(h, "A", 60)
    h.release(a)
    b = h.register("B")
    rid = h.alloc(b, 60)
    (snap,) = h.drain()
    h.exit("B")
    fail, reclaim = h.drain()
    assert fail.ticket == (b, rid) and isinstance(fail.error, errors.JobFaulted)
    assert isinstance(reclaim, ReclaimJob)
    h.reclaimed(reclaim)
    h.register("B")  # a new job of the same name: the old request is not its own
    h.finish(snap)
    assert h.drain() == [] and h.used() == 0


def test_a_victim_whose_snapshot_faults_it_is_named_to_the_incoming_at_once(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    ra = h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.finish(snap, ok=False, error="driver says no")
    faulted, fail = h.drain()
    assert faulted == NotifyJob("B", "faulted", {"job": "B", "reason": "snapshot failed: driver says no"})
    # B keeps the memory A needs, and nothing under way will free it: A is told so now, not at its timeout
    assert fail.ticket == (a, ra) and isinstance(fail.error, errors.SwitchFailed)
    assert "job 'B' keeps 60 B on GPU 0 and is faulted (snapshot failed: driver says no)" in fail.error.message
    assert h.location("B") == "resident" and h.s.jobs["B"].faulted
    assert h.queue() == [] and h.group_state() == "faulted"  # B is stuck where it is: an operator must look
    h.fails(AcquireRequested(b, 99), errors.JobFaulted, "snapshot failed: driver says no")
    again = h.acquire(a)  # and so is every later attempt, as long as B is stuck
    (fail,) = h.drain()
    assert fail.ticket == (a, again) and isinstance(fail.error, errors.SwitchFailed)
    # once the faulted job is gone, the waiter gets its turn
    h.exit("B")
    (reclaim,) = h.drain()
    h.reclaimed(reclaim)
    ra = h.acquire(a)
    (restore,) = h.drain()
    h.finish(restore)
    assert one_grant(h.drain()).tickets == ((a, ra),)


def test_failed_snapshot_fails_the_victims_own_waiters(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100})
    x = holding(h, "X", 60, group="x")
    h.release(x)
    holding(h, "Y", group="x")  # Y holds group x; X waits behind it
    rx = h.acquire(x)
    a = holding(h, "A")
    h.alloc(a, 60)
    (snap,) = h.drain()
    assert snap.job == "X"
    h.finish(snap, ok=False)
    effects = h.drain()
    fails = only(effects, FailRequest)
    assert [type(f.error) for f in fails] == [errors.JobFaulted, errors.OutOfMemory]
    assert fails[0].ticket == (x, rx)
    assert h.queue("x") == []


def test_failed_restore_faults_the_incoming_job(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    ra1 = h.acquire(a)
    a2 = h.register("A")
    ra2 = h.acquire(a2)
    c = h.register("C")
    rc = h.acquire(c)
    h.release(b)
    (snap,) = h.drain()
    h.finish(snap)
    (restore,) = h.drain()
    h.finish(restore, ok=False, error="lost")
    effects = h.drain()
    notify, *fails, grant = effects
    assert notify == NotifyJob("A", "faulted", {"job": "A", "reason": "restore failed: lost"})
    assert {f.ticket for f in fails} == {(a, ra1), (a2, ra2)}
    assert all(isinstance(f.error, errors.JobFaulted) for f in fails)
    assert isinstance(grant, GrantLock) and grant.job == "C" and grant.tickets == ((c, rc),)
    assert h.location("A") == "parked" and h.used() == 0  # a failed restore gives its pages back
    h.fails(AcquireRequested(a, 99), errors.JobFaulted, "restore failed: lost")
    assert h.group_state("g") == "locked"


def test_restore_waits_for_memory_held_by_another_groups_holder(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100})
    a, b = two_jobs_one_parked(h, a_bytes=60, b_bytes=60)
    h.free("B", 60)
    h.release(b)
    x = holding(h, "X", 50, group="x")  # another group, same GPU, holding
    h.acquire(a)
    assert h.drain() == [] and h.queue() == ["A"] and h.group_state() == "idle-yielded"
    h.release(x)  # X is idle now: it can be parked for A
    (snap,) = h.drain()
    assert snap.job == "X"
    h.finish(snap)
    (restore,) = h.drain()
    h.finish(restore)
    assert one_grant(h.drain()).job == "A"


def test_memory_released_lets_a_waiting_restore_start(h: Harness) -> None:
    a, b = two_jobs_one_parked(h, a_bytes=60, b_bytes=60)
    h.free("B", 60)
    holding(h, "X", 50, group="x")  # another group, same GPU, holding: never parked
    h.acquire(a)
    h.release(b)
    assert h.drain() == [] and h.queue() == ["A"]
    h.free("X", 20)
    (restore,) = h.drain()
    assert restore.job == "A"
    h.finish(restore)
    assert one_grant(h.drain()).job == "A"


def test_group_sharing_gpus_with_another(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100, 1: 100})
    a = h.register("A", "left", (0, 1))
    b = h.register("B", "right", (1,))
    h.acquire(a)
    h.acquire(b)
    assert {g.job for g in only(h.drain(), GrantLock)} == {"A", "B"}  # one lock per group
    h.alloc(a, 70, gpu=1)
    h.alloc(b, 30, gpu=1)
    assert kinds(h.drain()) == ["AllocateRegion", "AllocateRegion"]
    h.fails(MemoryRequested(b, 99, 1, 1), errors.OutOfMemory, "A \\(70 B, holding\\)")
    h.fails(MemoryRequested(b, 99, 0, 1), errors.UnknownDevice)


# --- status --------------------------------------------------------------------------------


def test_describe(h: Harness) -> None:
    a = holding(h, "A", 10)
    b = h.register("B")
    h.acquire(b)
    h.advance(4.0)
    picture = h.s.describe(h.now)
    (group,) = picture["groups"]
    assert group["holder"] == "A" and group["held_s"] == 4.0 and group["state"] == "locked"
    assert group["queue"] == [
        {
            "job": "B",
            "waited_s": 4.0,
            "requests": 1,
            "kept_for_s": None,
            "preempted": False,
            "priority": 0,
            "weight": 1.0,
            "share_s": 0.0,
            "effective_priority": None,
            "gang": None,
        }
    ]
    assert group["policy"] == "fifo"
    assert group["lock_duty"] == 1.0
    (device,) = picture["devices"]
    assert device == {"index": 0, "capacity": 100, "used": 10, "jobs": {"A": {"bytes": 10, "location": "resident"}}}
    jobs = {j["job"]: j for j in picture["jobs"]}
    assert jobs["A"]["gpu_seconds"] == 4.0 and jobs["A"]["slices"] == 1
    h.release(a)
    h.drain()
    assert h.s.describe(h.now)["groups"][0]["median_wait_s"] == 2.0  # waits of 0 and 4


def test_handle_timers_with_nothing_due(h: Harness) -> None:
    assert h.s.next_deadline() is None
    h.timers(10.0)
    assert h.drain() == []


def test_closing_a_session_twice_is_harmless(h: Harness) -> None:
    a = holding(h, "A")
    h.close(a)
    h.handle(SessionClosed(a))
    assert h.drain() == [] and h.holder() is None
    h.fails(ReleaseRequested(a), errors.NotRegistered)
    # the session id may register again afterwards
    h.handle(JobRegistered(a, "A", "g", None))


def test_exit_of_a_parked_job(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    h.exit("A")
    (reclaim,) = h.drain()
    h.reclaimed(reclaim)
    assert sorted(h.s.jobs) == ["B"]
    assert h.s.sessions == {b: "B"}
    h.fails(AcquireRequested(a, 99), errors.NotRegistered)


def test_job_exited_event_of_an_unknown_job(h: Harness) -> None:
    h.handle(JobExited("ghost"))
    assert h.drain() == []


def test_switch_replans_when_memory_was_taken_meanwhile(h: Harness) -> None:
    a, b = two_jobs_one_parked(h, a_bytes=50, b_bytes=90)
    h.free("B", 50)  # B keeps 40
    h.advance(1.0)
    z = holding(h, "Z", 20, group="z")
    h.release(z)
    y = holding(h, "Y", group="y")
    ra = h.acquire(a)
    h.release(b)  # A needs 50, 40 are free: parking B (granted longest ago) is enough
    (snap_b,) = h.drain()
    assert snap_b.job == "B"
    h.alloc(y, 40)  # ... but Y, holding another group, takes the free 40 meanwhile
    assert kinds(h.drain()) == ["AllocateRegion"]
    h.finish(snap_b)
    (snap_z,) = h.drain()  # so the switch parks Z too before it restores
    assert snap_z.job == "Z"
    h.finish(snap_z)
    (restore,) = h.drain()
    assert restore.job == "A"
    h.finish(restore)
    grant = one_grant(h.drain())
    assert grant.tickets == ((a, ra),) and grant.restored
    assert h.used() == 90


def test_head_being_parked_elsewhere_waits_for_its_snapshot(h: Harness) -> None:
    a = holding(h, "A", 40)
    h.release(a)
    b = holding(h, "B")
    ra = h.acquire(a)  # A waits, resident
    x = holding(h, "X", group="x")
    h.alloc(x, 90)  # parks A, idle in the queue
    (snap,) = h.drain()
    assert snap.job == "A"
    h.release(b)
    assert h.drain() == [] and h.queue() == ["A"]  # A is on the move: nothing to decide yet
    h.finish(snap)
    effects = h.drain()
    assert kinds(effects) == ["AllocateRegion"]  # A's 40 went to X; A waits for memory
    h.release(x)  # X is idle now: it makes room for A
    (snap_x,) = h.drain()
    assert snap_x.job == "X"
    h.finish(snap_x)
    (restore,) = h.drain()
    assert restore.job == "A"
    h.finish(restore)
    assert one_grant(h.drain()).tickets == ((a, ra),)


def test_grant_info_is_what_the_client_sees() -> None:
    grant = GrantLock("g", "A", 3, 1.5, 0.5, True, ((1, 2),), again=False)
    assert grant.info() == {"group": "g", "job": "A", "fence": 3, "waited_s": 1.5, "switch_s": 0.5, "restored": True}


def test_switch_across_gpus_parks_only_what_frees_memory_where_short(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100, 1: 100})
    p = holding(h, "P", 20, group="p", gpu=1)  # idle longest, but only on GPU 1, where room is left
    h.release(p)
    h.advance(1.0)
    a = holding(h, "A", 50, gpu=0)
    h.alloc(a, 50, gpu=1)
    h.drain()
    h.release(a)
    h.advance(1.0)
    b = holding(h, "B")
    h.alloc(b, 60, gpu=0)
    (snap_a,) = h.drain()
    h.finish(snap_a)
    h.drain()
    ra = h.acquire(a)
    h.release(b)  # A needs 50 on GPU 0 (40 free) and 50 on GPU 1 (80 free)
    (snap,) = h.drain()
    assert snap.job == "B"
    h.finish(snap)
    (restore,) = h.drain()
    h.finish(restore)
    assert one_grant(h.drain()).tickets == ((a, ra),)
    assert h.location("P") == "resident" and (h.used(0), h.used(1)) == (50, 70)


# --- exclusive jobs (real processes: parked whole, their memory unknown to the core) ---------


def test_exclusive_incoming_parks_the_resident_rival_first(h: Harness) -> None:
    a = h.register("A", exclusive=True)
    b = h.register("B", exclusive=True)
    rid = h.acquire(a)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "B")  # both started resident; the holder gets the GPU to itself
    h.advance(0.5)
    h.finish(snap, nbytes=7)
    assert h.drain() == [GrantLock("g", "A", 1, 0.5, 0.5, False, ((a, rid),))]
    assert h.s.describe(h.now)["groups"][0]["switches"] == 1
    h.acquire(b)
    h.release(a)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "A")
    h.finish(snap)
    (restore,) = h.drain()
    assert restore == RestoreJob(restore.op, "B")
    h.finish(restore)
    grant = one_grant(h.drain())
    assert grant.job == "B" and grant.restored
    h.release(b)
    h.acquire(b)
    assert one_grant(h.drain()).restored is False  # nobody else waited: nothing moved


def test_exclusive_jobs_on_other_gpus_stay_resident(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100, 1: 100})
    a = h.register("A", "g0", (0,), exclusive=True)
    b = h.register("B", "g1", (1,), exclusive=True)
    h.acquire(a)
    h.acquire(b)
    grants = h.drain()
    assert [g.job for g in grants] == ["A", "B"] and not any(g.restored for g in grants)


def test_exclusive_rival_that_holds_another_group_makes_the_waiter_wait(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100, 1: 100})
    a = h.register("A", "wide", (0, 1), exclusive=True)
    h.acquire(a)
    h.drain()
    b = h.register("B", "narrow", (1,), exclusive=True)
    h.acquire(b)
    assert h.drain() == [] and h.queue("narrow") == ["B"]
    h.release(a)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "A")
    h.finish(snap)
    assert one_grant(h.drain()).job == "B"


def test_exclusive_job_parks_sim_jobs_with_memory_on_its_gpus(h: Harness) -> None:
    a = h.register("A")
    h.alloc(a, 10)
    h.drain()
    b = h.register("B", "other", exclusive=True)
    h.acquire(b)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "A")
    h.finish(snap, nbytes=10)
    assert one_grant(h.drain()).job == "B"


def test_faulted_exclusive_rival_does_not_block(h: Harness) -> None:
    a = h.register("A", exclusive=True)
    h.register("B", exclusive=True)
    h.acquire(a)
    (snap,) = h.drain()
    h.finish(snap, ok=False, error="lock timed out")
    assert h.s.jobs["B"].faulted and h.location("B") == "resident"
    grant = one_grant([e for e in h.drain() if isinstance(e, GrantLock)])
    assert grant.job == "A"


def test_a_job_cannot_change_its_parking_kind(h: Harness) -> None:
    h.register("A", exclusive=True)
    h.fails(JobRegistered(h.session(), "A", "g", None, (), False), errors.BadRequest, "another parking method")


# --- administrator actions ---------------------------------------------------------------------


def test_force_release_takes_the_lock_from_a_stuck_holder(h: Harness) -> None:
    a = holding(h, "A")
    b = h.register("B")
    rid = h.acquire(b)
    h.advance(3.0)
    assert h.handle(ForceReleaseRequested("g")) == {"group": "g", "released": "A"}
    effects = h.drain()
    assert NotifyJob("A", "lock_lost", {"group": "g", "reason": "released by an administrator"}) in effects
    assert one_grant(effects) == GrantLock("g", "B", 2, 3.0, 0.0, False, ((b, rid),))
    h.fails(ReleaseRequested(a), errors.NotHolder, "does not hold")  # A's own release now finds nothing
    assert h.s.describe(h.now)["jobs"][0]["gpu_seconds"] == 3.0  # A's slice ended at the forced release


@pytest.mark.parametrize(
    ("event", "error", "match"),
    [
        (ForceReleaseRequested("nope"), errors.UnknownGroup, "no group 'nope'"),
        (ForceReleaseRequested("g"), errors.NotHolder, "nobody holds group 'g'"),
        (DrainRequested("nope", True), errors.UnknownGroup, "no group 'nope'"),
    ],
)
def test_admin_errors_change_nothing(h: Harness, event: Any, error: type[Exception], match: str) -> None:
    h.register("A")
    h.fails(event, error, match)


def test_drain_fails_the_waiters_refuses_new_ones_and_resume_grants_again(h: Harness) -> None:
    a = holding(h, "A")
    b = h.register("B")
    rid = h.acquire(b)
    assert h.handle(DrainRequested("g", True)) == {"group": "g", "draining": True, "holder": "A"}
    (fail,) = h.drain()
    assert isinstance(fail, FailRequest) and fail.ticket == (b, rid)
    assert isinstance(fail.error, errors.GroupDraining)
    h.fails(AcquireRequested(b, 99, None), errors.GroupDraining, "drained")
    h.acquire(a)
    assert one_grant(h.drain()).again  # the holder keeps its lock meanwhile
    h.release(a)
    assert h.holder() is None and h.drain() == []
    assert h.s.describe(h.now)["groups"][0]["draining"] is True
    h.handle(DrainRequested("g", False))
    rid = h.acquire(b)
    assert one_grant(h.drain()).job == "B"


def test_a_drained_group_keeps_its_queue_empty_until_resumed(h: Harness) -> None:
    h.register("A")
    h.handle(DrainRequested("g", True))
    b = h.register("B")
    h.fails(AcquireRequested(b, 7, None), errors.GroupDraining)
    h.handle(DrainRequested("g", False))
    h.acquire(b)
    assert one_grant(h.drain()).job == "B"


def test_deferred_counts_each_wait_for_memory_once(h: Harness) -> None:
    a = holding(h, "A", 60)
    h.release(a)
    c = holding(h, "C", group="other")
    h.alloc(c, 60)  # parks the idle A to make room
    (snap,) = h.drain()
    h.finish(snap, nbytes=60)
    h.drain()
    h.acquire(a)  # A needs its 60 back, but C holds its lock and its memory: A must wait
    assert h.drain() == []
    assert h.s.describe(h.now)["groups"][0]["deferred"] == 1  # counted once, however often it is retried
    h.release(c)
    (snap,) = h.drain()
    h.finish(snap, nbytes=60)
    (restore,) = h.drain()
    h.finish(restore, nbytes=60)
    assert one_grant(h.drain()).job == "A"
    assert h.s.describe(h.now)["groups"][0]["deferred"] == 1


def test_group_states(h: Harness) -> None:
    a = h.register("A")
    assert h.group_state() == "idle"
    h.acquire(a)
    assert h.group_state() == "locked"
    h.release(a)
    assert h.group_state() == "idle-yielded"  # A stays resident
    b = h.register("B", exclusive=True)
    h.acquire(b)
    assert h.group_state() == "locked"  # A held no memory: nothing to park
    h.release(b)
    c = h.register("C", exclusive=True)
    h.acquire(c)
    (snap,) = h.drain()[-1:]
    assert h.group_state() == "switching"
    h.finish(snap, ok=False, error="the driver said no")
    assert h.group_state() == "locked"  # C got the GPUs all the same
    h.release(c)
    assert h.group_state() == "faulted"  # B is stuck on the GPU: an operator must look
