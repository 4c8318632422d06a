"""Kept turns (``--anticipate``) driven through the core harness: moves carried out, and a random
workload whose bound is checked for every waiter (``tests/unit/test_anticipation.py``,
``tests/unit/test_policy_random.py``)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from timesliced.core.events import GrantLock, MemoryRequested, NotifyJob, RestoreJob, SnapshotJob
from timesliced.core.policy import QueuePolicy
from timesliced.core.scheduler import Scheduler

from .harness import Harness, only

MOVE_S = 0.5  # every move takes this long: a switch away and back costs 2 x (0.5 + 0.5) = 2 s


def anticipating(anticipate_s: float = 5.0, capacity: int = 100, policy: QueuePolicy | None = None) -> Harness:
    """One GPU of ``capacity`` bytes, turns kept for at most ``anticipate_s``, ``policy`` in every group."""
    h = Harness({0: capacity})
    policies = None if policy is None else {"*": policy}
    h.s = Scheduler({0: capacity}, anticipate_s=anticipate_s, queue_policies=policies)
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


def kept(effects: list[Any]) -> list[NotifyJob]:
    """The notices of turns kept for a holder that yielded."""
    return [e for e in only(effects, NotifyJob) if e.event == "policy" and "kept_s" in e.data]


def three_jobs(h: Harness, c_priority: int = 0, gap_s: float = 0.1) -> dict[str, int]:
    """A, B and C in group ``g``, each using 60 of GPU 0 (every hand-off parks), B and C taking turns
    with A, which asks again ``gap_s`` after each is granted, with no turn kept meanwhile: A's gaps and
    everyone's move times are measured. A holds at the end."""
    s = {
        "A": h.register("A", "g", (0,)),
        "B": h.register("B", "g", (0,)),
        "C": h.register("C", "g", (0,), priority=c_priority),
    }
    for job in s:
        h.acquire(s[job])
        settle(h)
        h.handle(MemoryRequested(s[job], h.rid(), 0, 60))  # 60 + 60 > 100: every hand-off parks
        h.release(s[job])
        settle(h)
    keep_s, h.s.arbiter._anticipate_s = h.s.arbiter._anticipate_s, 0.0
    h.acquire(s["A"])
    settle(h)
    for other in ("B", "C", "B", "C"):
        h.acquire(s[other])
        h.advance(1.0)
        h.release(s["A"])
        settle(h)
        h.advance(gap_s)
        h.acquire(s["A"])
        h.advance(1.0)
        h.release(s[other])
        settle(h)
    h.s.arbiter._anticipate_s = keep_s
    assert h.holder() == "A"
    return s


def check_turns(data: st.DataObject, policy: QueuePolicy | None = None) -> int:
    """Random turns of three jobs that cannot share the GPU, under ``policy`` (fifo if None): a kept
    turn passes each waiter at most once per wait, every waiter that asks when it is kept, not only
    the one the notice names (the policy's choice), and every waiter that asks later, before the
    holder it was kept for is granted again; the invariants hold after every input (the harness
    checks); and once arrivals stop everyone is granted. Returns how many turns were kept."""
    h = anticipating(data.draw(st.sampled_from([0.3, 5.0]), label="anticipate"), policy=policy)
    keeps = 0
    s = {
        j: h.register(
            j,
            "g",
            (0,),
            priority=data.draw(st.integers(0, 1), label=f"{j} priority") if policy is not None else 0,
            weight=data.draw(st.sampled_from([0.5, 1.0, 3.0]), label=f"{j} weight") if policy is not None else 1.0,
        )
        for j in "ABC"
    }
    for job in s:
        h.acquire(s[job])
        settle(h)
        h.handle(MemoryRequested(s[job], h.rid(), 0, 60))
        h.release(s[job])
        settle(h)
    waiting: dict[str, int] = {}  # job -> how often a kept turn passed it in this wait
    holding: set[str] = set()
    # The holder of the last turn kept, and who waited then (passed at the notice), until the next grant.
    kept_for: tuple[str, set[str]] | None = None

    def passed(job: str) -> None:
        waiting[job] += 1
        assert waiting[job] <= 1, f"{job} was kept waiting twice in one wait"

    def observe(effects: list[Any]) -> None:
        nonlocal keeps, kept_for
        for e in effects:  # in order: a waiter granted before a turn is kept is not passed by it
            if isinstance(e, GrantLock) and not e.again:
                if kept_for is not None:
                    holder, counted = kept_for
                    kept_for = None
                    # No waiter here leaves unanswered, so the first grant after a notice is that
                    # holder's only when its kept turn is granted (a turn that lapses switches to a
                    # waiter first): it goes before every waiter that asked since, too.
                    if e.job == holder:
                        for job in [j for j in waiting if j not in counted]:
                            passed(job)
                holding.add(e.job)
                waiting.pop(e.job, None)
            elif isinstance(e, NotifyJob) and e.event == "policy" and "kept_s" in e.data:
                keeps += 1
                assert str(e.data["passed"]) in waiting, (e, waiting)
                kept_for = (e.job, set(waiting))
                for job in waiting:  # a kept turn goes before every waiter that asks
                    passed(job)

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
