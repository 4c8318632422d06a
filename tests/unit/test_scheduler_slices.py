"""Maximum slices (warn, preempt) and kept turns in the scheduler core."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timesliced.core.events import GrantLock, NotifyJob, RestoreJob, SnapshotJob
from timesliced.core.model import AUTO
from timesliced.core.slices import SlicePolicy

from ..helpers.harness import Harness, holding, kinds, one_grant, only


def waiting(h: Harness, job: str, group: str = "g") -> int:
    sid = h.register(job, group)
    h.acquire(sid)
    return sid


def test_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="maximum slice"):
        SlicePolicy(0)
    with pytest.raises(ValueError, match="'warn' or 'preempt'"):
        SlicePolicy(5, "kill")


def test_a_holder_alone_is_never_warned(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(5.0, "preempt", grace=1.0)})
    holding(h, "A", 10)
    assert h.s.next_deadline() is None
    h.timers(100.0)
    assert h.drain() == [] and h.holder() == "A"


def test_warn_once_when_others_wait_past_the_slice(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"g": SlicePolicy(5.0)})
    holding(h, "A", 10)
    h.advance(2.0)
    waiting(h, "B")
    assert h.s.next_deadline() == 5.0
    h.timers(5.0)
    (note,) = h.drain()
    assert isinstance(note, NotifyJob) and note.job == "A" and note.event == "slice_overdue"
    assert "maximum slice of 5 s" in str(note.data["reason"])
    assert h.s.next_deadline() is None  # warn only: nothing more happens
    h.timers(50.0)
    assert h.drain() == [] and h.holder() == "A"
    (group,) = h.s.describe(h.now)["groups"]
    assert group["overdue_s"] == 45.0 and group["max_slice_s"] == 5.0 and group["slice_action"] == "warn"


def test_a_waiter_that_comes_late_is_warned_for_at_once(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(5.0)})
    holding(h, "A")
    h.advance(30.0)
    waiting(h, "B")
    assert [n.event for n in only(h.drain(), NotifyJob)] == ["slice_overdue"]


def test_preempt_parks_the_holder_grants_the_next_and_queues_it_again(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(5.0, "preempt", grace=2.0)})
    a = holding(h, "A", 60)
    b = waiting(h, "B")
    h.timers(5.0)
    assert [n.event for n in only(h.drain(), NotifyJob)] == ["slice_overdue"]
    assert h.s.next_deadline() == 7.0
    h.timers(7.0)
    out = h.drain()
    notes = only(out, NotifyJob)
    assert [n.event for n in notes] == ["preempted"] and "queued again" in str(notes[0].data["reason"])
    (snap,) = only(out, SnapshotJob)
    assert snap.job == "A"
    assert one_grant(out).job == "B"  # B needs no memory: granted while A is parked
    h.finish(snap, nbytes=60)
    assert h.location("A") == "parked"
    queue = h.s.describe(h.now)["groups"][0]["queue"]
    assert [(w["job"], w["preempted"]) for w in queue] == [("A", True)]
    h.release(b)
    (restore,) = only(h.drain(), RestoreJob)
    h.finish(restore, nbytes=60)
    grant = one_grant(h.drain())
    assert grant.job == "A" and grant.tickets == ((a, AUTO),) and grant.restored
    assert h.s.jobs["A"].preemptions == 1 and h.s.groups["g"].preemptions == 1
    h.release(a)  # the slice ends as usual
    assert h.holder() is None


def test_a_holder_that_yields_within_the_grace_is_not_preempted(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(5.0, "preempt", grace=2.0)})
    a = holding(h, "A")
    waiting(h, "B")
    h.timers(6.0)
    h.release(a)
    assert one_grant(h.drain()).job == "B"
    h.timers(20.0)
    assert h.s.groups["g"].preemptions == 0 and h.drain() == []


def test_release_while_preempted_gives_up_the_turn(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(1.0, "preempt", grace=0.0)})
    a = holding(h, "A")
    waiting(h, "B")
    h.timers(1.0)
    (snap,) = only(h.drain(), SnapshotJob)
    h.finish(snap)
    assert h.release(a) == {"group": "g", "fence": 2, "held_s": 0.0, "preempted": True}
    assert h.s.groups["g"].queue == []


def test_preempted_job_that_asks_again_waits_on_the_same_place(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(1.0, "preempt", grace=0.0)})
    a = holding(h, "A")
    b = waiting(h, "B")
    h.timers(1.0)
    h.finish(only(h.drain(), SnapshotJob)[0])
    rid = h.acquire(a)
    (w,) = h.s.groups["g"].queue
    assert set(w.tickets) == {(a, AUTO), (a, rid)}
    h.release(b)
    h.finish(only(h.drain(), RestoreJob)[0])
    assert set(one_grant(h.drain()).tickets) == {(a, AUTO), (a, rid)}


def test_kept_turn_holds_the_group_until_its_job_asks_again(h: Harness) -> None:
    a = h.register("A")
    h.close(a)
    h.s.keep_turn("A", until=10.0, now=h.now)
    c = waiting(h, "C")
    assert h.drain() == [] and h.s.next_deadline() == 10.0
    a2 = h.register("A")
    h.acquire(a2)
    grant = one_grant(h.drain())
    assert grant.job == "A"
    h.release(a2)
    assert one_grant(h.drain()).job == "C"
    assert c


def test_kept_turn_lapses_at_its_deadline(h: Harness) -> None:
    a = h.register("A")
    h.close(a)
    h.s.keep_turn("A", until=10.0, now=h.now)
    waiting(h, "C")
    h.timers(9.9)
    assert h.drain() == []
    h.timers(10.0)
    assert one_grant(h.drain()).job == "C"
    assert kinds(h.drain()) == []


def test_kept_turn_of_a_job_that_exits_goes_with_it(h: Harness) -> None:
    from timesliced.core.events import JobExited

    a = h.register("A")
    h.close(a)
    h.s.keep_turn("A", until=10.0, now=h.now)
    waiting(h, "C")
    h.handle(JobExited("A"))
    assert only(h.drain(), GrantLock)[0].job == "C"


def test_one_job_may_have_only_so_many_acquires_waiting(h: Harness) -> None:
    from timesliced import errors
    from timesliced.core.events import AcquireRequested
    from timesliced.core.model import MAX_REQUESTS_PER_JOB

    holding(h, "A")
    b = h.register("B")
    for _ in range(MAX_REQUESTS_PER_JOB):
        h.acquire(b)
    h.fails(AcquireRequested(b, 10**6), errors.LimitExceeded, "already has 256 acquires waiting")
