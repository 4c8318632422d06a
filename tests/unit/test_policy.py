"""Queue policies: every decision of ``fifo``, ``priority`` and ``fair``, aging, and what the log hears."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timesliced import errors
from timesliced.core.events import GrantLock, JobRegistered, NotifyJob
from timesliced.core.policy import QueuePolicy

from ..helpers.harness import Harness

Make = Callable[..., Harness]


def granted(h: Harness) -> list[str]:
    return [e.job for e in h.drain() if isinstance(e, GrantLock)]


def contend(h: Harness, waiters: list[tuple[str, int, float]], *, gap: float = 1.0) -> dict[str, int]:
    """``H`` holds; then each (job, priority, weight) registers and asks, ``gap`` s apart."""
    sessions = {"H": h.register("H")}
    h.acquire(sessions["H"])
    for job, priority, weight in waiters:
        sessions[job] = h.register(job, priority=priority, weight=weight)
        h.advance(gap)
        h.acquire(sessions[job])
    h.drain()
    return sessions


def order(h: Harness, sessions: dict[str, int], holder: str = "H") -> list[str]:
    """Release holder after holder until nobody waits; the jobs in the order they were granted."""
    out: list[str] = []
    while True:
        h.advance(1.0)
        h.release(sessions[holder])
        now = granted(h)
        if not now:
            return out
        (holder,) = now
        out.append(holder)


def test_fifo_is_the_default_and_arrival_order(harness: Make) -> None:
    h = harness()
    s = contend(h, [("A", 0, 1.0), ("B", 5, 1.0), ("C", 9, 1.0)])
    assert order(h, s) == ["A", "B", "C"]
    assert h.s.describe(h.now)["groups"][0]["policy"] == "fifo"


@pytest.mark.parametrize(
    ("waiters", "expected"),
    [
        ([("A", 0, 1.0), ("B", 5, 1.0), ("C", 9, 1.0)], ["C", "B", "A"]),  # higher first
        ([("A", 1, 1.0), ("B", 1, 1.0), ("C", 1, 1.0)], ["A", "B", "C"]),  # FIFO among equals
        ([("A", 0, 1.0), ("B", 2, 1.0), ("C", 2, 1.0)], ["B", "C", "A"]),
        ([("A", -3, 1.0), ("B", 0, 1.0)], ["B", "A"]),  # negative priorities are fine
    ],
)
def test_priority_orders_by_priority_then_arrival(
    harness: Make, waiters: list[tuple[str, int, float]], expected: list[str]
) -> None:
    h = harness(queue_policies={"*": QueuePolicy("priority", aging_s=1000.0)})
    assert order(h, contend(h, waiters)) == expected


def test_priority_ages_a_long_waiter_past_a_newer_higher_one(harness: Make) -> None:
    """With aging 10 s a level, A (priority 0) waiting 25 s goes before B (priority 2) waiting 1 s,
    but not before C (priority 3): 25 - 30 < 1 - 0."""
    h = harness(queue_policies={"g": QueuePolicy("priority", aging_s=10.0)})
    s = {"H": h.register("H"), "A": h.register("A"), "B": h.register("B", priority=2)}
    s["C"] = h.register("C", priority=3)
    h.acquire(s["H"])
    h.acquire(s["A"])
    h.advance(24.0)
    h.acquire(s["C"])
    h.acquire(s["B"])
    h.advance(1.0)
    h.drain()
    assert order(h, s) == ["C", "A", "B"]


def test_priority_within_its_window_and_past_it(harness: Make) -> None:
    """A newcomer one level up passes a waiter only within ``aging_s`` of the waiter's arrival."""
    for gap, expected in ((9.0, ["B", "A"]), (11.0, ["A", "B"])):
        h = harness(queue_policies={"*": QueuePolicy("priority", aging_s=10.0)})
        s = {"H": h.register("H"), "A": h.register("A"), "B": h.register("B", priority=1)}
        h.acquire(s["H"])
        h.acquire(s["A"])
        h.advance(gap)
        h.acquire(s["B"])
        h.drain()
        assert order(h, s) == expected, gap


def test_fair_goes_to_the_job_furthest_below_its_share(harness: Make) -> None:
    """A held 6 s (weight 2: 3 s per weight), B held 4 s (weight 1: 4 s): A goes first."""
    h = harness(queue_policies={"*": QueuePolicy("fair", aging_s=100.0)})
    a, b, c = h.register("A", weight=2.0), h.register("B"), h.register("C")
    for s, held in ((a, 6.0), (b, 4.0)):
        h.acquire(s)
        h.advance(held)
        h.release(s)
    h.acquire(c)
    h.acquire(b)
    h.advance(0.5)
    h.acquire(a)
    h.drain()
    assert h.s.jobs["A"].held_s == 6.0 and h.s.jobs["B"].held_s == 4.0
    assert order(h, {"A": a, "B": b, "C": c}, holder="C") == ["A", "B"]


def test_fair_shares_converge_to_the_weights(harness: Make) -> None:
    """Three jobs that always ask again at once, weights 2:1:1, one-second slices: held time comes
    out 2:1:1 (a holder is not waiting when it releases, so a job can get at most every other slice)."""
    h = harness(queue_policies={"*": QueuePolicy("fair")})
    s = {"A": h.register("A", weight=2.0), "B": h.register("B"), "C": h.register("C")}
    for job in s:
        h.acquire(s[job])
    (holder,) = granted(h)
    for _ in range(400):
        h.advance(1.0)
        h.release(s[holder])
        h.acquire(s[holder])
        (holder,) = granted(h)
    held = {job: h.s.jobs[job].held_s for job in s}
    assert 1.9 < held["A"] / held["B"] < 2.1 and 0.9 < held["B"] / held["C"] < 1.1, held


def test_fair_aging_caps_what_a_share_costs(harness: Make) -> None:
    """B held 50 s more than A; with aging 10 s, A passes B only if it came within 10 s of B."""
    for gap, expected in ((5.0, ["A", "B"]), (15.0, ["B", "A"])):
        h = harness(queue_policies={"*": QueuePolicy("fair", aging_s=10.0)})
        s = {"H": h.register("H"), "A": h.register("A"), "B": h.register("B")}
        h.acquire(s["B"])
        h.advance(50.0)
        h.release(s["B"])
        h.acquire(s["H"])
        h.acquire(s["B"])
        h.advance(gap)
        h.acquire(s["A"])
        h.drain()
        assert order(h, s) == expected, gap


def test_a_choice_other_than_arrival_order_is_logged(harness: Make) -> None:
    h = harness(queue_policies={"*": QueuePolicy("priority")})
    s = contend(h, [("A", 0, 1.0), ("B", 1, 1.0)])
    h.release(s["H"])
    effects = h.drain()
    (note,) = [e for e in effects if isinstance(e, NotifyJob)]
    assert note.job == "B" and note.event == "policy"
    assert note.data["passed"] == "A" and note.data["policy"] == "priority" and "priority 1" in str(note.data["reason"])
    h.release(s["B"])
    assert not [e for e in h.drain() if isinstance(e, NotifyJob)]  # A was first anyway: nothing to log


def test_status_shows_policy_and_each_waiters_standing(harness: Make) -> None:
    h = harness(queue_policies={"g": QueuePolicy("priority", aging_s=10.0)})
    contend(h, [("A", 0, 2.0), ("B", 3, 1.0)])
    h.advance(5.0)
    (group,) = h.s.describe(h.now)["groups"]
    assert group["policy"] == "priority" and group["aging_s"] == 10.0
    places = {p["job"]: p for p in group["queue"]}
    assert places["A"]["effective_priority"] == pytest.approx(0.0 + 6.0 / 10.0)
    assert places["B"]["effective_priority"] == pytest.approx(3.0 + 5.0 / 10.0)
    assert places["A"]["weight"] == 2.0 and places["B"]["priority"] == 3


def test_policies_per_group(harness: Make) -> None:
    h = harness({0: 100, 1: 100}, queue_policies={"p": QueuePolicy("priority"), "*": QueuePolicy("fifo")})
    for group, gpu in (("p", 0), ("f", 1)):
        sessions = {"H": h.register(f"H{group}", group, (gpu,))}
        h.acquire(sessions["H"])
        for job, prio in (("A", 0), ("B", 1)):
            sessions[job] = h.register(f"{job}{group}", group, (gpu,), priority=prio)
            h.acquire(sessions[job])
        h.drain()
        h.release(sessions["H"])
        assert granted(h) == [f"{'B' if group == 'p' else 'A'}{group}"]


def test_a_preempted_holder_under_priority_keeps_its_rank(harness: Make) -> None:
    """Queued again at the tail, a higher-priority holder still goes before lower priorities: under
    ``priority`` a maximum slice shares the group among equals, and aging bounds the others' wait."""
    from timesliced.core.events import RestoreJob, SnapshotJob
    from timesliced.core.slices import SlicePolicy

    h = harness(policies={"*": SlicePolicy(5.0, "preempt", grace=0.0)}, queue_policies={"*": QueuePolicy("priority")})
    hi, lo = h.register("HI", priority=5), h.register("LO")
    h.alloc(hi, 10)
    h.acquire(hi)
    h.acquire(lo)
    h.drain()
    h.timers(5.0)  # preempted: parked, queued again with its automatic request
    assert h.holder() is None and h.queue() == ["HI", "LO"]
    (snap,) = [e for e in h.drain() if isinstance(e, SnapshotJob)]
    h.finish(snap, nbytes=10)
    (restore,) = [e for e in h.drain() if isinstance(e, RestoreJob)]
    h.finish(restore, nbytes=10)
    assert h.holder() == "HI" and h.queue() == ["LO"]


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_weight_must_be_positive(h: Harness, weight: float) -> None:
    h.fails(JobRegistered(1, "A", "g", None, weight=weight), errors.BadRequest, "weight")


def test_a_job_keeps_the_priority_of_its_first_registration(h: Harness) -> None:
    h.register("A", priority=4, weight=2.0)
    h.register("A")
    assert (h.s.jobs["A"].priority, h.s.jobs["A"].weight) == (4, 2.0)


@pytest.mark.parametrize(("name", "aging"), [("lottery", 60.0), ("fair", 0.0), ("priority", -1.0)])
def test_a_bad_policy_is_refused(name: str, aging: float) -> None:
    with pytest.raises(ValueError, match="queue policy"):
        QueuePolicy(name, aging)
