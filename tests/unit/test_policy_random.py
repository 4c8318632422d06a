"""Random workloads under each queue policy, and random gangs: the bounds the policies state hold.

Per policy (``policy.py``): a waiter that arrived at ``t`` with window ``W`` is passed by no waiter
that arrived after ``t + W``, and after ``t + W`` at most ``N - 1`` grants of its group come before
its own (``N`` jobs). Gangs: members are granted in one step or not at all, and once arrivals stop
and holders keep releasing, every waiter, gang or single, is granted (no deadlock), also when
parties hold one group while they ask for another, and when a party always holds one of a
gang's groups (it is refused a second pass, ``GangWaiting``, rather than starve the gang).
Kept turns (``--anticipate``) under each policy: every waiter, not only the policy's choice, is
passed by at most one kept turn per wait. The harness checks ``check_invariants(now)`` after
every input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from timesliced import errors
from timesliced.core.arbiter import Arbiter
from timesliced.core.events import FailRequest, GrantLock
from timesliced.core.model import Gang, Group, Job
from timesliced.core.policy import QueuePolicy, Standing

from ..helpers.harness import Harness
from ..helpers.turns import check_turns

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A check shown to fail on broken code: examples from a fixed seed (it finds the fault in every run), no
# shrinking or example database (the failure is expected, and only whether it comes matters).
CAN_FAIL = settings(
    max_examples=300,
    deadline=None,
    database=None,
    report_multiple_bugs=False,
    phases=[Phase.generate],
    derandomize=True,
)


@dataclass
class Waiting:
    arrived: float
    window: float
    grants_after: int = 0  # grants of the group since arrived + window


def check_bound(policy: QueuePolicy, data: st.DataObject, jobs: int) -> None:
    h = Harness(queue_policies={"*": policy})
    names = [f"j{i}" for i in range(jobs)]
    sessions = {}
    for n in names:
        sessions[n] = h.register(
            n,
            priority=data.draw(st.integers(-2, 2), label=f"{n} priority"),
            weight=data.draw(st.sampled_from([0.5, 1.0, 3.0]), label=f"{n} weight"),
        )
    waiting: dict[str, Waiting] = {}
    holder: str | None = None

    def on_grants() -> None:
        nonlocal holder
        for e in h.drain():
            if not isinstance(e, GrantLock) or e.again:
                continue
            job = e.job
            mine = waiting.pop(job)
            for other, w in waiting.items():
                assert mine.arrived <= w.arrived + w.window, (
                    f"{job} (arrived {mine.arrived}) passed {other} (arrived {w.arrived}, window {w.window})"
                )
                if h.now >= w.arrived + w.window:
                    w.grants_after += 1
                    assert w.grants_after <= jobs - 1, f"{other} waited past its bound"
            holder = job

    for _ in range(data.draw(st.integers(10, 80), label="steps")):
        action = data.draw(st.sampled_from(["acquire", "release", "time", "cancel"]), label="action")
        if action == "time":
            h.advance(data.draw(st.sampled_from([0.0, 0.5, 3.0, 20.0]), label="dt"))
        elif action == "acquire":
            idle = [n for n in names if n != holder and n not in waiting]
            if idle:
                job = data.draw(st.sampled_from(idle), label="who")
                ctx = Standing.of(h.s.jobs.values())
                waiting[job] = Waiting(h.now, policy.window(h.s.jobs[job], ctx))
                h.acquire(sessions[job])
                on_grants()
        elif action == "release" and holder is not None:
            h.release(sessions[holder])
            holder = None
            on_grants()
        elif action == "cancel" and waiting:
            job = data.draw(st.sampled_from(sorted(waiting)), label="cancelled")
            rid = next(t[1] for w in h.s.groups["g"].queue if w.job == job for t in w.tickets)
            h.cancel(sessions[job], rid)
            del waiting[job]
            h.drain()
    while holder is not None:  # quiesce: everyone is granted in turn
        h.advance(1.0)
        h.release(sessions[holder])
        holder = None
        on_grants()
    assert not waiting and h.queue() == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy", [QueuePolicy("fifo"), QueuePolicy("priority", aging_s=2.0), QueuePolicy("fair", aging_s=5.0)]
)
@SETTINGS
@given(data=st.data())
def test_every_waiter_is_granted_within_its_policys_bound(policy: QueuePolicy, data: st.DataObject) -> None:
    check_bound(policy, data, jobs=data.draw(st.integers(2, 5), label="jobs"))


def test_the_bound_check_can_fail() -> None:
    """A policy that orders by priority yet claims a window of 0 is caught passing a waiter."""

    class Lying(QueuePolicy):
        def window(self, job: Any, ctx: Standing) -> float:
            return 0.0

    @settings(CAN_FAIL, max_examples=200)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check_bound(Lying("priority", aging_s=1000.0), data, jobs=3)

    with pytest.raises(AssertionError, match=r"passed|past its bound"):
        run()


KEPT_POLICIES = [QueuePolicy("priority", aging_s=1000.0), QueuePolicy("fair", aging_s=5.0)]
# About 1 example in 20 has a waiter come, and be chosen, after one a kept turn passed: enough to
# find the case nearly always (the examples are cheap).
KEPT_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@pytest.mark.parametrize("policy", KEPT_POLICIES, ids=lambda p: p.name)
@KEPT_SETTINGS
@given(data=st.data())
def test_every_waiter_is_passed_by_at_most_one_kept_turn_per_wait(policy: QueuePolicy, data: st.DataObject) -> None:
    """The policy may choose a waiter that came after one a kept turn passed: no turn is kept before
    the first one is granted (``Arbiter.anticipate``)."""
    check_turns(data, policy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", KEPT_POLICIES, ids=lambda p: p.name)
def test_the_kept_turn_check_sees_a_waiter_passed_twice(policy: QueuePolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were only the policy's choice looked at for a mark (as before), a waiter chosen later would let
    another turn be kept, and the check counts every waiter: it fails."""
    anticipate = Arbiter.anticipate

    def choice_only(self: Arbiter, group: Group, job: Job, now: float) -> None:
        chosen = self.next_waiter(group)
        hidden = [w for w in group.queue if w.delayed and w is not chosen]
        for w in hidden:
            w.delayed = False
        try:
            anticipate(self, group, job, now)
        finally:
            for w in hidden:
                w.delayed = True

    monkeypatch.setattr(Arbiter, "anticipate", choice_only)

    @CAN_FAIL
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check_turns(data, policy)

    with pytest.raises(AssertionError, match="kept waiting twice"):
        run()


GROUPS = ("a", "b", "c")


@pytest.mark.slow
@SETTINGS
@given(data=st.data())
def test_gangs_never_deadlock_and_are_granted_whole(data: st.DataObject) -> None:
    policy = data.draw(st.sampled_from(["fifo", "priority", "fair"]), label="policy")
    h = Harness({0: 100, 1: 100, 2: 100}, queue_policies={"*": QueuePolicy(policy, aging_s=1000.0)})
    sessions: dict[str, int] = {}
    group_of: dict[str, str] = {}
    for i, g in enumerate(GROUPS):
        for k in range(3):
            name = f"{g}{k}"
            sessions[name] = h.register(name, g, (i,), priority=data.draw(st.sampled_from([0, 5]), label="prio"))
            group_of[name] = g
    busy: set[str] = set()  # jobs that wait or hold
    holding: set[str] = set()
    gang_of: dict[str, str] = {}  # job -> gang, while it waits as a member
    gangs: dict[str, set[str]] = {}
    tickets: dict[str, int] = {}
    n = 0

    def settle() -> None:
        effects = h.drain()
        granted = {e.job for e in effects if isinstance(e, GrantLock) and not e.again}
        failed = {h.s.sessions.get(e.ticket[0]) for e in effects if isinstance(e, FailRequest)}
        for gang, members in list(gangs.items()):
            got = members & granted
            assert not got or got == members, f"gang {gang} granted in part: {got} of {members}"
            gone = members & failed
            if got or gone:
                assert not gone or gone == members, f"gang {gang} withdrawn in part: {gone} of {members}"
                del gangs[gang]
                for m in members:
                    gang_of.pop(m, None)
        holding.update(granted)
        for job in failed:
            if job is not None:
                busy.discard(job)

    for _ in range(data.draw(st.integers(5, 60), label="steps")):
        action = data.draw(st.sampled_from(["single", "gang", "release", "time", "cancel"]), label="action")
        idle = [j for j in sessions if j not in busy]
        if action == "single" and idle:
            job = data.draw(st.sampled_from(idle), label="single")
            busy.add(job)
            tickets[job] = h.acquire(sessions[job])
        elif action == "gang":
            size = data.draw(st.integers(2, 3), label="size")
            groups = data.draw(st.permutations(GROUPS), label="groups")[:size]
            members = []
            for g in groups:
                free = [j for j in idle if group_of[j] == g]
                if free:
                    members.append(data.draw(st.sampled_from(free), label="member"))
            if len(members) < 2:
                continue
            n += 1
            gang = f"G{n}"
            gangs[gang] = set(members)
            for m in data.draw(st.permutations(members), label="arrival"):
                busy.add(m)
                gang_of[m] = gang
                tickets[m] = h.acquire(sessions[m], gang=gang, members=len(members))
                if data.draw(st.booleans(), label="interleave"):
                    settle()
                    if holding:
                        out = data.draw(st.sampled_from(sorted(holding)), label="releases meanwhile")
                        h.release(sessions[out])
                        holding.discard(out)
                        busy.discard(out)
        elif action == "release" and holding:
            job = data.draw(st.sampled_from(sorted(holding)), label="release")
            h.release(sessions[job])
            holding.discard(job)
            busy.discard(job)
        elif action == "time":
            h.advance(data.draw(st.sampled_from([0.5, 4.0]), label="dt"))
        elif action == "cancel":
            waiting = sorted(j for j in busy if j not in holding)
            if waiting:
                job = data.draw(st.sampled_from(waiting), label="cancel")
                try:
                    h.cancel(sessions[job], tickets[job])
                except errors.TimeslicedError:
                    pass
                busy.discard(job)
        settle()
    # Complete every gang still missing members, then keep releasing: everyone must be granted.
    for _ in range(100):
        settle()
        if not holding:
            break
        for job in sorted(holding):
            h.advance(1.0)
            h.release(sessions[job])
            holding.discard(job)
            busy.discard(job)
        settle()
    pending = {g: m for g, m in h.s.queues.gangs.items() if m.seq is None}
    assert all(not h.s.groups[g].queue or all(w.gang in pending for w in h.s.groups[g].queue) for g in GROUPS), (
        "deadlock: waiters left that could be granted",
        {g: [(w.job, w.gang) for w in h.s.groups[g].queue] for g in GROUPS},
    )


def check_parties(policy: str, data: st.DataObject) -> None:
    """Two parties, each holding its first group while it asks for its second (every party in one
    order), among single acquires and gangs of both groups: once arrivals stop and holders release,
    everyone is granted. Without the party rule (``Arbiter._passer``) a gang that keeps a party's
    second group while it waits for the first deadlocks with that party."""
    h = Harness({0: 100, 1: 100}, queue_policies={"*": QueuePolicy(policy, aging_s=1000.0)})
    first, second = data.draw(st.permutations(["t", "s"]), label="order")
    gpus = {"t": (0,), "s": (1,)}
    party = {p: {g: h.register(f"{p}-{g}", g, gpus[g], party=p) for g in gpus} for p in ("P1", "P2")}
    loners = {f"x{k}-{g}": h.register(f"x{k}-{g}", g, gpus[g]) for k in range(3) for g in gpus}
    sessions = {f"{p}-{g}": s for p, by in party.items() for g, s in by.items()} | loners
    busy: set[str] = set()  # jobs that wait or hold
    holding: set[str] = set()
    gangs = 0

    def settle() -> None:
        effects = h.drain()
        assert not [e for e in effects if isinstance(e, FailRequest)], effects
        holding.update(e.job for e in effects if isinstance(e, GrantLock) and not e.again)

    def ask(job: str, **gang: Any) -> None:
        busy.add(job)
        h.acquire(sessions[job], **gang)

    def release(*jobs: str) -> None:
        for job in jobs:
            h.release(sessions[job])
            holding.discard(job)
            busy.discard(job)

    def step_parties() -> None:
        for p in sorted(party):
            a, b = f"{p}-{first}", f"{p}-{second}"
            if a in holding and b not in busy:
                ask(b)  # holds its first group while it asks for its second
            elif a in holding and b in holding:
                release(b, a)

    for _ in range(data.draw(st.integers(5, 50), label="steps")):
        action = data.draw(st.sampled_from(["party", "next", "single", "gang", "release", "time"]), label="action")
        idle = sorted(j for j in loners if j not in busy)
        if action == "party":
            p = data.draw(st.sampled_from(sorted(party)), label="party")
            if not any(j.startswith(p) and j in busy for j in sessions):
                ask(f"{p}-{first}")
        elif action == "next":
            step_parties()
        elif action == "single" and idle:
            ask(data.draw(st.sampled_from(idle), label="single"))
        elif action == "gang":
            members = [next((j for j in idle if j.endswith(f"-{g}")), None) for g in gpus]
            if None not in members:
                gangs += 1
                for m in data.draw(st.permutations(members), label="arrival"):
                    assert m is not None
                    ask(m, gang=f"G{gangs}", members=2)
        elif action == "release":
            done = sorted(j for j in holding if j in loners)
            if done:
                release(data.draw(st.sampled_from(done), label="release"))
        else:
            h.advance(data.draw(st.sampled_from([0.5, 4.0]), label="dt"))
        settle()
    for _ in range(100):  # arrivals stop: parties go on, everyone else lets go
        settle()
        if not busy:
            break
        h.advance(1.0)
        step_parties()
        release(*sorted(j for j in holding if j in loners))
        settle()
    assert not busy, ("deadlock: waiters left", {g: [(w.job, w.gang) for w in h.s.groups[g].queue] for g in gpus})


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fifo", "priority", "fair"])
@SETTINGS
@given(data=st.data())
def test_parties_that_hold_and_ask_never_deadlock_with_gangs(policy: str, data: st.DataObject) -> None:
    check_parties(policy, data)


def test_the_party_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the party rule, a gang and a party that holds one of its groups deadlock."""
    monkeypatch.setattr(Arbiter, "_passer", lambda self, group, gang: None)

    @CAN_FAIL
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check_parties("fifo", data)

    with pytest.raises(AssertionError, match="deadlock"):
        run()


def check_alternating(policy: str, data: st.DataObject) -> int:
    """Party P hands its two groups back and forth, always holding one while it asks for the other
    (an RL run's trainer and sampler as one party), among single acquires and gangs of both groups.
    P's only refusals are ``GangWaiting``, after which it lets go of what it holds, as the error says;
    and even though P never stops, once other arrivals stop every other waiter, gang or single, is
    granted: P passes a gang at most once while it holds one of the gang's groups. Returns how many
    times P was refused."""
    h = Harness({0: 100, 1: 100}, queue_policies={"*": QueuePolicy(policy, aging_s=1000.0)})
    gpus = {"t": (0,), "s": (1,)}
    party = {g: h.register(f"P-{g}", g, gpus[g], party="P") for g in gpus}
    loners = {f"x{k}-{g}": h.register(f"x{k}-{g}", g, gpus[g]) for k in range(3) for g in gpus}
    sessions = {f"P-{g}": sid for g, sid in party.items()} | loners
    other = {"P-t": "P-s", "P-s": "P-t"}
    busy: set[str] = set()  # loners that wait or hold
    holding: set[str] = set()  # loners that hold
    held: list[str] = []  # P's jobs that hold, the longest held first
    asking: list[str] = []  # P's job that waits
    refused = 0
    gangs = 0

    def settle() -> None:
        nonlocal refused
        for e in h.drain():
            if isinstance(e, GrantLock) and not e.again:
                if e.job in asking:
                    asking.remove(e.job)
                    held.append(e.job)
                else:
                    holding.add(e.job)
            elif isinstance(e, FailRequest):
                job = h.s.sessions.get(e.ticket[0])
                assert job in asking and isinstance(e.error, errors.GangWaiting), e
                refused += 1
                asking.remove(job)
                for j in list(held):  # let go, as the error says
                    held.remove(j)
                    h.release(sessions[j])

    def step_party() -> None:
        if asking:
            return
        if len(held) == 2:
            first = held.pop(0)
            h.release(sessions[first])  # let the longest held go, keep the other
        elif held:
            asking.append(other[held[0]])  # hold one, ask for the other
            h.acquire(sessions[asking[0]])
        else:
            asking.append("P-t")
            h.acquire(sessions["P-t"])

    def release(job: str) -> None:
        h.release(sessions[job])
        holding.discard(job)
        busy.discard(job)

    for _ in range(data.draw(st.integers(5, 50), label="steps")):
        action = data.draw(st.sampled_from(["party", "party", "single", "gang", "release", "time"]), label="action")
        idle = sorted(j for j in loners if j not in busy)
        if action == "party":
            step_party()
        elif action == "single" and idle:
            job = data.draw(st.sampled_from(idle), label="single")
            busy.add(job)
            h.acquire(sessions[job])
        elif action == "gang":
            members = [next((j for j in idle if j.endswith(f"-{g}")), None) for g in gpus]
            if None not in members:
                gangs += 1
                for m in data.draw(st.permutations(members), label="arrival"):
                    assert m is not None
                    busy.add(m)
                    h.acquire(sessions[m], gang=f"G{gangs}", members=2)
        elif action == "release" and holding:
            release(data.draw(st.sampled_from(sorted(holding)), label="release"))
        else:
            h.advance(data.draw(st.sampled_from([0.5, 4.0]), label="dt"))
        settle()
    for _ in range(100):  # other arrivals stop: P goes on handing its groups over, loners let go
        settle()
        if not busy:
            break
        h.advance(1.0)
        step_party()
        settle()
        for job in sorted(holding):
            release(job)
        settle()
    assert not busy, ("a waiter starves", {g: [(w.job, w.gang) for w in h.s.groups[g].queue] for g in gpus})
    return refused


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fifo", "priority", "fair"])
@SETTINGS
@given(data=st.data())
def test_a_party_that_always_holds_one_group_never_starves_a_gang(policy: str, data: st.DataObject) -> None:
    check_alternating(policy, data)


@pytest.mark.slow
def test_the_alternating_check_refuses_and_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """P is refused in the random hand-offs; were every pass a first one (passes not kept), P would
    pass a gang every time it asks: the gang starves, and the check sees it."""
    refused: list[int] = []

    @CAN_FAIL
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        refused.append(check_alternating("fifo", data))

    run()
    assert sum(refused) > 0
    monkeypatch.setattr(Gang, "passes", property(lambda self: {}, lambda self, value: None), raising=False)
    with pytest.raises(AssertionError, match="starves"):
        run()
