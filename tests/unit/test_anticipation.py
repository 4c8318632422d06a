"""Switch-cost awareness in the core: a yielded holder's turn is kept when it comes back before a switch pays."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from timesliced.core.events import GrantLock, MemoryRequested, SnapshotJob
from timesliced.core.model import Group, Waiter
from timesliced.core.policy import QueuePolicy
from timesliced.core.queues import LockQueues
from timesliced.core.scheduler import Scheduler

from ..helpers.harness import Harness, only
from ..helpers.turns import MOVE_S, anticipating, check_turns, kept, settle, three_jobs

GAP_S = 0.1  # A's own time off the GPU between its phases, after the switch (1 s): gaps of 1.1 s


harness = anticipating


def grants(effects: list[Any]) -> list[str]:
    return [e.job for e in only(effects, GrantLock) if not e.again]


def two_jobs(h: Harness, nbytes: int = 60) -> dict[str, int]:
    """A and B in group ``g``, each using ``nbytes`` of GPU 0 (60 + 60 do not fit: a switch parks)."""
    s = {"A": h.register("A", "g", (0,)), "B": h.register("B", "g", (0,))}
    for job in ("A", "B"):
        h.acquire(s[job])
        settle(h)
        h.handle(MemoryRequested(s[job], h.rid(), 0, nbytes))
        settle(h)
        h.release(s[job])
        settle(h)
    return s


def warm(h: Harness, s: dict[str, int], rounds: int = 4, gap_s: float = GAP_S) -> None:
    """A and B take turns, A asking again ``gap_s`` after B is granted (its gap: the switch and
    ``gap_s``), so its gaps and both jobs' move times are measured, with no turn kept meanwhile; A
    holds at the end."""
    keep_s, h.s.arbiter._anticipate_s = h.s.arbiter._anticipate_s, 0.0
    h.acquire(s["A"])
    settle(h)
    for _ in range(rounds):
        h.acquire(s["B"])
        h.advance(1.0)
        h.release(s["A"])
        settle(h)  # the switch to B: A parked, B restored
        h.advance(gap_s)
        h.acquire(s["A"])
        h.advance(1.0)
        h.release(s["B"])
        settle(h)
    assert h.holder() == "A"
    h.s.arbiter._anticipate_s = keep_s


def test_a_holder_back_sooner_than_a_switch_keeps_its_turn() -> None:
    h = harness()
    s = two_jobs(h)
    warm(h, s)
    assert h.s.jobs["A"].gaps[-3:] == pytest.approx((2 * MOVE_S + GAP_S,) * 3)
    h.acquire(s["B"])  # B waits while A computes
    h.advance(1.0)
    h.release(s["A"])
    effects = settle(h)
    assert not only(effects, SnapshotJob) and grants(effects) == []  # nothing moves: A's turn is kept
    (notice,) = kept(effects)
    assert notice.job == "A" and notice.data["passed"] == "B" and 1.5 < float(str(notice.data["kept_s"])) < 5.0
    assert "typical gap is 1.100 s" in str(notice.data["reason"])
    assert h.queue() == ["A", "B"] and h.s.groups["g"].queue[0].anticipated
    h.advance(GAP_S)
    h.acquire(s["A"])
    effects = settle(h)
    (grant,) = only(effects, GrantLock)  # back within the window: granted with nothing moved
    assert (grant.job, grant.restored, grant.switch_s, grant.waited_s) == ("A", False, 0.0, 0.0)
    h.advance(1.0)
    h.release(s["A"])  # B was kept waiting once already: this time it is switched to
    effects = settle(h)
    assert kept(effects) == [] and [e.job for e in only(effects, SnapshotJob)] == ["A"] and grants(effects) == ["B"]


def test_a_kept_turn_lapses_and_the_switch_goes_ahead() -> None:
    h = harness(anticipate_s=0.8)
    s = two_jobs(h)
    warm(h, s)
    h.acquire(s["B"])
    h.release(s["A"])
    (notice,) = kept(settle(h))
    assert notice.data["kept_s"] == pytest.approx(0.8)  # capped by --anticipate
    assert h.s.next_deadline() == pytest.approx(h.now + 0.8)
    h.timers(h.now + 0.8)
    effects = settle(h)
    assert [e.job for e in only(effects, SnapshotJob)] == ["A"] and grants(effects) == ["B"]


@pytest.mark.parametrize(
    ("case", "anticipate_s", "nbytes", "gap_s", "rounds"),
    [
        ("off", 0.0, 60, GAP_S, 4),
        ("a gap longer than the switch", 5.0, 60, 3.0, 4),
        ("too few gaps measured", 5.0, 60, GAP_S, 1),  # 2 < anticipation.MIN_SAMPLES
        ("a handoff that moves nothing", 5.0, 40, GAP_S, 4),
    ],
)
def test_no_turn_is_kept(case: str, anticipate_s: float, nbytes: int, gap_s: float, rounds: int) -> None:
    h = harness(anticipate_s)
    s = two_jobs(h, nbytes)
    warm(h, s, rounds, gap_s)
    h.acquire(s["B"])
    h.release(s["A"])
    effects = settle(h)
    assert kept(effects) == [] and grants(effects) == ["B"], case


def test_a_kept_holder_may_ask_as_a_gang_member() -> None:
    h = Harness({0: 100, 1: 100})
    h.s = Scheduler({0: 100, 1: 100}, anticipate_s=5.0)
    s = two_jobs(h)
    warm(h, s)
    other = h.register("S", "s", (1,))
    h.acquire(s["B"])
    h.release(s["A"])
    assert kept(settle(h))
    h.acquire(s["A"], gang="sync", members=2)  # its kept turn goes; it waits as the gang's member, after B
    h.acquire(other, gang="sync", members=2)
    assert grants(settle(h)) == ["B"]
    h.release(s["B"])
    assert sorted(grants(settle(h))) == ["A", "S"]


def test_under_priority_a_waiter_passed_by_a_kept_turn_is_not_passed_by_another() -> None:
    """B is passed by A's kept turn; C, of a higher priority, asks while A holds again, so A's next
    yield finds the policy's choice C unmarked: yet B, passed once in this wait, still waits, so no
    turn is kept and A is switched out."""
    h = anticipating(policy=QueuePolicy("priority", aging_s=1000.0))
    s = three_jobs(h, c_priority=1)
    h.acquire(s["B"])
    h.advance(1.0)
    h.release(s["A"])
    assert [e.data["passed"] for e in kept(settle(h))] == ["B"]
    h.advance(GAP_S)
    h.acquire(s["A"])
    assert grants(settle(h)) == ["A"]  # back within the window
    h.acquire(s["C"])
    h.advance(1.0)
    h.release(s["A"])
    effects = settle(h)
    assert kept(effects) == [] and [e.job for e in only(effects, SnapshotJob)] == ["A"]
    assert grants(effects) == ["C"] and h.queue() == ["B"]  # C by priority; B next, passed by one kept turn


def test_a_waiter_that_asks_while_a_turn_is_kept_is_passed_by_it_once() -> None:
    """C asks while A's turn is kept, and A, back within the window, goes before it: C is marked then
    (not only B, there when the turn was kept), so once B is gone no turn is kept for A before C."""
    h = anticipating()  # fifo
    s = three_jobs(h)
    b_rid = h.acquire(s["B"])
    h.advance(1.0)
    h.release(s["A"])
    assert [e.data["passed"] for e in kept(settle(h))] == ["B"]  # B marked
    h.acquire(s["C"])  # while A's turn is kept
    assert [(w.job, w.delayed) for w in h.s.groups["g"].queue] == [("A", False), ("B", True), ("C", False)]
    h.advance(GAP_S)
    h.acquire(s["A"])
    assert grants(settle(h)) == ["A"]  # its kept turn: it goes before C, who asked first
    assert [(w.job, w.delayed) for w in h.s.groups["g"].queue] == [("B", True), ("C", True)]
    h.cancel(s["B"], b_rid)  # B stops waiting: C, marked too, still stops a second kept turn
    settle(h)
    h.advance(1.0)
    h.release(s["A"])
    effects = settle(h)
    assert kept(effects) == [] and [e.job for e in only(effects, SnapshotJob)] == ["A"] and grants(effects) == ["C"]


def test_a_kept_turn_that_lapses_marks_nobody_who_asked_since() -> None:
    """A kept turn that lapses passes nobody who asked during it: the switch goes to the head, and
    C, who asked meanwhile, may yet be passed by one kept turn in its wait."""
    h = anticipating(anticipate_s=0.8)
    s = three_jobs(h)
    h.acquire(s["B"])
    h.release(s["A"])
    assert [e.data["passed"] for e in kept(settle(h))] == ["B"]
    h.acquire(s["C"])
    h.timers(h.now + 0.8)
    effects = settle(h)
    assert grants(effects) == ["B"] and [(w.job, w.delayed) for w in h.s.groups["g"].queue] == [("C", False)]


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_waiter_is_kept_waiting_at_most_once_and_everyone_is_granted(data: st.DataObject) -> None:
    check_turns(data)


def test_the_turn_check_keeps_turns_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random turns do keep turns; were waiters not marked, one would be kept waiting twice."""
    seen: list[int] = []

    @settings(max_examples=80, deadline=None, database=None, phases=[Phase.generate], derandomize=True)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        seen.append(check_turns(data))

    run()
    assert sum(seen) > 0
    monkeypatch.setattr(Waiter, "delayed", property(lambda self: False, lambda self, value: None))
    with pytest.raises(AssertionError, match="kept waiting twice"):
        run()


def test_the_turn_check_counts_who_asks_while_a_turn_is_kept_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were only the waiters there when a turn is kept marked (as before), one that asked during the
    window, passed when the holder came back, would be passed by a second kept turn: the check
    counts it, and fails."""
    grant = LockQueues.grant

    def grant_marking_nobody(self: LockQueues, group: Group, now: float) -> Waiter:
        group.queue[0].anticipated = False  # popped next: the flag tells only ``grant`` to mark
        return grant(self, group, now)

    monkeypatch.setattr(LockQueues, "grant", grant_marking_nobody)

    @settings(max_examples=300, deadline=None, database=None, phases=[Phase.generate], derandomize=True)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check_turns(data)

    with pytest.raises(AssertionError, match="kept waiting twice"):
        run()
