"""Switch-cost awareness in the core: a yielded holder's turn is kept when it comes back before a switch pays."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from timesliced.core.events import GrantLock, MemoryRequested, NotifyJob, RestoreJob, SnapshotJob
from timesliced.core.model import Waiter
from timesliced.core.scheduler import Scheduler

from ..helpers.harness import Harness, only

MOVE_S = 0.5  # every move takes this long: a switch away and back costs 2 x (0.5 + 0.5) = 2 s
GAP_S = 0.1  # A's own time off the GPU between its phases, after the switch (1 s): gaps of 1.1 s


def harness(anticipate_s: float = 5.0, capacity: int = 100) -> Harness:
    h = Harness({0: capacity})
    h.s = Scheduler({0: capacity}, anticipate_s=anticipate_s)
    return h


def settle(h: Harness) -> list[Any]:
    """Carry out every move the scheduler asks for, each taking ``MOVE_S``; the effects seen."""
    seen: list[Any] = []
    while effects := h.drain():
        seen += effects
        for e in effects:
            if isinstance(e, (SnapshotJob, RestoreJob)):
                h.advance(MOVE_S)
                h.finish(e)
    return seen


def grants(effects: list[Any]) -> list[str]:
    return [e.job for e in only(effects, GrantLock) if not e.again]


def kept(effects: list[Any]) -> list[NotifyJob]:
    return [e for e in only(effects, NotifyJob) if e.event == "policy" and "kept_s" in e.data]


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


def check_turns(data: st.DataObject) -> int:
    """Random turns of three jobs that cannot share the GPU: a kept turn passes each waiter at most
    once per wait, the invariants hold after every input (the harness checks), and once arrivals stop
    everyone is granted. Returns how many turns were kept."""
    h = harness(anticipate_s=data.draw(st.sampled_from([0.3, 5.0]), label="anticipate"))
    keeps = 0
    s = {j: h.register(j, "g", (0,)) for j in "ABC"}
    for job in s:
        h.acquire(s[job])
        settle(h)
        h.handle(MemoryRequested(s[job], h.rid(), 0, 60))
        h.release(s[job])
        settle(h)
    waiting: dict[str, int] = {}  # job -> how often a kept turn passed it in this wait
    holding: set[str] = set()

    def observe(effects: list[Any]) -> None:
        nonlocal keeps
        for e in kept(effects):
            keeps += 1
            passed = str(e.data["passed"])
            waiting[passed] += 1
            assert waiting[passed] <= 1, f"{passed} was kept waiting twice in one wait"
        for job in grants(effects):
            holding.add(job)
            waiting.pop(job, None)

    for _ in range(data.draw(st.integers(10, 60), label="steps")):
        action = data.draw(st.sampled_from(["acquire", "release", "time"]), label="action")
        idle = sorted(j for j in s if j not in waiting and j not in holding)
        if action == "acquire" and idle:
            job = data.draw(st.sampled_from(idle), label="who")
            waiting[job] = 0
            h.acquire(s[job])
        elif action == "release" and holding:
            job = data.draw(st.sampled_from(sorted(holding)), label="releases")
            holding.discard(job)
            h.release(s[job])
        else:
            h.advance(data.draw(st.sampled_from([0.05, 0.2, 1.0]), label="dt"))
            h.timers()
        observe(settle(h))
    for _ in range(50):  # arrivals stop: holders release, kept turns lapse
        for job in sorted(holding):
            holding.discard(job)
            h.release(s[job])
        observe(settle(h))
        h.advance(1.0)
        h.timers()
        observe(settle(h))
        if not waiting and not holding:
            break
    assert not waiting and not holding, (waiting, holding, h.queue())
    return keeps


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_waiter_is_kept_waiting_at_most_once_and_everyone_is_granted(data: st.DataObject) -> None:
    check_turns(data)


def test_the_turn_check_keeps_turns_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random turns do keep turns; were waiters not marked, one would be kept waiting twice."""
    seen: list[int] = []

    @settings(max_examples=80, deadline=None, database=None, phases=[Phase.generate])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        seen.append(check_turns(data))

    run()
    assert sum(seen) > 0
    monkeypatch.setattr(Waiter, "delayed", property(lambda self: False, lambda self, value: None))
    with pytest.raises(AssertionError, match="kept waiting twice"):
        run()
