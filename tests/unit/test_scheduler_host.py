"""Host memory for parked state, failed moves that leave a job whole, preemption only where safe (pure core).

The scheduler admits every park against the host's budget (``HostMemoryRead``, ``core/host.py``); a
move that fails with the job's state intact (``MoveFinished.intact``) leaves the job usable and tells
the waiter that needed it why; only a damaged or unknown state faults a job, and an operator's
``FaultCleared`` resumes it; a job whose parking method cannot freeze it joins no preempting group.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timesliced import errors
from timesliced.core.events import (
    AcquireRequested,
    FailRequest,
    FaultCleared,
    GrantLock,
    HostMemoryRead,
    JobRegistered,
    MemoryRequested,
    NotifyJob,
    RestoreJob,
    SnapshotJob,
)
from timesliced.core.location import Location
from timesliced.core.model import AUTO, PARK_RETRY_S
from timesliced.core.slices import SlicePolicy

from ..helpers.harness import Harness, holding, kinds, one_grant, only, two_jobs_one_parked

HOST_FULL = errors.InsufficientHostMemory.code


def idle_with(h: Harness, job: str, nbytes: int, group: str = "g") -> int:
    """``job`` holds ``nbytes`` of GPU 0, resident and idle."""
    sid = holding(h, job, nbytes, group=group)
    h.release(sid)
    return sid


def refused_by_budget(h: Harness) -> tuple[int, int, int]:
    """A parked (60 measured), B resident and idle with 60, a budget of 70: parking B for C does not fit."""
    a, b = two_jobs_one_parked(h)
    h.release(b)
    h.host(10)  # parked state takes 60 already: the budget is 70
    c = h.register("C", "x", exclusive=True)
    return a, b, c


# --- admission -----------------------------------------------------------------------------------


def test_a_park_that_does_not_fit_the_budget_is_not_started_and_its_waiter_is_told(h: Harness) -> None:
    _, b, c = refused_by_budget(h)
    rc = h.acquire(c)
    (fail,) = h.drain()
    assert isinstance(fail, FailRequest) and fail.ticket == (c, rc)
    error = fail.error
    assert isinstance(error, errors.InsufficientHostMemory) and error.code == "insufficient_host_memory"
    assert error.message.startswith(
        "insufficient host memory to park 'B' (60 B) for job 'C' on node 0: it needs 60 B, parked state there "
        "takes 60 B of a budget of 70 B (as last read), so 10 B is free. Free host memory there"
    )
    assert error.details == {
        "node": 0,
        "needed": 60,
        "budget": 70,
        "parked": 60,
        "reserved": 0,
        "freeing": 0,
        "pool": None,
    }
    # nothing moved: B's bytes are where they were, A's parked state too, and both are usable
    assert (h.location("A"), h.location("B"), h.used()) == ("parked", "resident", 60)
    assert not h.s.jobs["A"].faulted and not h.s.jobs["B"].faulted and h.queue("x") == []
    picture = h.s.describe(h.now)
    assert picture["host"] == [
        {
            "slot": 0,
            "budget": 70,
            "limit": None,
            "room": 10,
            "parked": 60,
            "reserved": 0,
            "freeing": 0,
            "read_s_ago": 0.0,
            "pools": {},
            "source": {},
        }
    ]
    assert {j["job"]: j["parked_bytes"] for j in picture["jobs"]} == {"A": 60, "B": 0, "C": 0}
    h.acquire(b)  # C, a process that never ran, makes way (nothing of it to hold in host memory)
    (snap,) = h.drain()
    assert snap.job == "C"
    h.finish(snap)
    assert one_grant(h.drain()).job == "B"


def test_the_operators_limit_caps_the_budget(h: Harness) -> None:
    idle_with(h, "A", 60)
    h.host(1000, limit=50)
    c = h.register("C", "x", exclusive=True)
    h.acquire(c)
    (fail,) = h.drain()
    assert isinstance(fail.error, errors.InsufficientHostMemory)
    assert "of a budget of 50 B (as last read; --host-memory-limit 50 B)" in fail.error.message
    h.host(1000, limit=60)  # the limit is raised: it fits exactly
    h.acquire(c)
    assert kinds(h.drain()) == ["SnapshotJob"]


def test_a_waiter_waits_while_a_reclaim_under_way_frees_the_room(h: Harness) -> None:
    _, _, c = refused_by_budget(h)
    h.exit("A")  # A's parked state is being reclaimed: it frees 60
    (reclaim,) = h.drain()
    rc = h.acquire(c)
    assert h.drain() == []  # it would fit once the reclaim ends: C waits, and says what for
    (group,) = [g for g in h.s.describe(h.now)["groups"] if g["group"] == "x"]
    assert group["waiting_for"] == "host memory: waiting for restores and reclaims of A"
    assert h.s.describe(h.now)["host"][0]["freeing"] == 60
    h.reclaimed(reclaim)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "B")
    h.finish(snap, nbytes=60)
    assert one_grant(h.drain()).tickets == ((c, rc),)


def test_a_park_under_way_is_reserved_at_its_expected_size(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100, 1: 100})
    idle_with(h, "A", 40)
    b = holding(h, "B", group="y", gpu=1)
    h.alloc(b, 40, gpu=1)
    h.drain()
    h.release(b)
    h.host(70)
    c = h.register("C", "x", gpus=(0,), exclusive=True)
    h.acquire(c)
    (snap,) = h.drain()
    assert snap.job == "A" and h.s.describe(h.now)["host"][0]["reserved"] == 40
    d = h.register("D", "z", gpus=(1,), exclusive=True)
    rd = h.acquire(d)  # B's 40 would fit alone, not beside A's park under way
    (fail,) = h.drain()
    assert fail.ticket == (d, rd) and "parks under way 40 B" in fail.error.message


def test_a_pool_of_its_own_refuses_a_park_the_node_could_hold(h: Harness) -> None:
    idle_with(h, "A", 60)
    members = {"A": ("cgroup:/jobs/a",)}
    source = {"cgroup:/jobs/a": "cgroup /jobs/a: 1.0 GiB limit, 1023.9 MiB used"}
    h.host(10_000, pools={"cgroup:/jobs/a": 30}, members=members, source=source)
    c = h.register("C", "x", exclusive=True)
    h.acquire(c)
    (fail,) = h.drain()
    assert "to park 'A' (60 B) for job 'C' on cgroup:/jobs/a on node 0" in fail.error.message
    assert "of a budget of 30 B (cgroup /jobs/a: 1.0 GiB limit, 1023.9 MiB used)" in fail.error.message
    assert fail.error.details["pool"] == "cgroup:/jobs/a"
    assert h.s.describe(h.now)["host"][0]["pools"] == {"cgroup:/jobs/a": {"budget": 30, "parked": 0}}


def test_a_process_parks_at_the_size_the_daemon_measured(h: Harness) -> None:
    a = h.register("A", exclusive=True)
    h.acquire(a)
    h.drain()
    h.release(a)
    h.host(50, sizes={"A": 80})  # its device memory, as NVML counts it: the scheduler does not allocate it
    b = h.register("B", "x", exclusive=True)
    h.acquire(b)
    (fail,) = h.drain()
    assert "to park 'A' (80 B)" in fail.error.message
    h.host(50, sizes={"A": 50})
    h.acquire(b)
    (snap,) = h.drain()
    h.finish(snap, nbytes=45)  # what the snapshot measured is what the parked state takes
    assert one_grant(h.drain()).job == "B"
    assert h.s.jobs["A"].parked == {0: 45} and h.s.describe(h.now)["host"][0]["parked"] == 45


def test_without_a_reading_nothing_is_refused(h: Harness) -> None:
    idle_with(h, "A", 60)
    c = h.register("C", "x", exclusive=True)
    h.acquire(c)
    assert kinds(h.drain()) == ["SnapshotJob"]
    assert h.s.describe(h.now)["host"] == []


def test_a_memory_request_whose_parks_do_not_fit_is_refused_unchanged(h: Harness) -> None:
    idle_with(h, "A", 60)
    h.host(10)
    b = holding(h, "B", group="x")
    h.fails(MemoryRequested(b, 77, 0, 60), errors.InsufficientHostMemory, "to park 'A' \\(60 B\\) for job 'B'")


def test_a_reading_that_fixes_the_budget_counts_what_is_parked(h: Harness) -> None:
    two_jobs_one_parked(h)
    h.host(25)
    assert h.s.describe(h.now)["host"][0]["budget"] == 85
    h.fails(HostMemoryRead(0, 10, -1), ValueError, "cannot be negative")


def test_a_switch_parks_before_its_restore_gives_host_memory_back(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    h.host(0)  # a budget of 60, all of it A's parked state
    ra = h.acquire(a)
    h.release(b)  # B must be parked before A can come back, and for a while both are in host memory
    (fail,) = h.drain()
    assert fail.ticket == (a, ra) and isinstance(fail.error, errors.InsufficientHostMemory)
    h.host(60)
    ra = h.acquire(a)
    (snap,) = h.drain()
    h.finish(snap, nbytes=60)
    assert h.s.describe(h.now)["host"][0]["parked"] == 120
    (restore,) = h.drain()
    assert h.s.describe(h.now)["host"][0]["freeing"] == 60
    h.finish(restore)
    assert one_grant(h.drain()).tickets == ((a, ra),)
    assert h.s.describe(h.now)["host"][0]["parked"] == 60


# --- a failed park that leaves the job whole ---------------------------------------------------------


def park_fails_intact(h: Harness) -> tuple[int, int, int]:
    """A (60, idle) must be parked for B (exclusive); the snapshot fails for lack of host space."""
    a = idle_with(h, "A", 60)
    b = h.register("B", "x", exclusive=True)
    rb = h.acquire(b)
    (snap,) = h.drain()
    h.finish(snap, ok=False, error="no space left on device", intact=True, code=HOST_FULL)
    return a, b, rb


def test_a_park_that_fails_intact_leaves_the_job_usable_and_tells_the_waiter(h: Harness) -> None:
    a, b, rb = park_fails_intact(h)
    notify, fail = h.drain()
    assert notify == NotifyJob(
        "A",
        "move_failed",
        {"job": "A", "kind": "snapshot", "reason": "snapshot failed: no space left on device", "intact": True},
    )
    assert fail.ticket == (b, rb) and isinstance(fail.error, errors.InsufficientHostMemory)
    assert "job 'A' shares its GPUs and could not be parked a moment ago (snapshot failed: no space" in str(fail.error)
    # A's bytes never left the GPU: it is resident, not faulted, and its next slice just works
    assert h.location("A") == "resident" and not h.s.jobs["A"].faulted and h.used() == 60
    assert h.group_state("g") == "idle-yielded" and h.group_state("x") == "idle"
    assert h.s.describe(h.now)["jobs"][0]["park_refused"] == "snapshot failed: no space left on device"
    h.acquire(a)  # B (a process that never ran) makes way for it
    (snap,) = h.drain()
    assert snap.job == "B"
    h.finish(snap)
    assert one_grant(h.drain()).job == "A"


def test_a_refused_park_is_not_retried_until_its_cause_may_have_gone(h: Harness) -> None:
    _, b, _ = park_fails_intact(h)
    h.drain()
    rb = h.acquire(b)  # at once again: the same cause, told at once, and no park is tried
    (fail,) = h.drain()
    assert fail.ticket == (b, rb) and isinstance(fail.error, errors.InsufficientHostMemory)
    h.host(10)
    h.host(5)  # less room than before: nothing came free
    h.acquire(b)
    assert kinds(h.drain()) == ["FailRequest"]
    h.host(500)  # host memory came free on its node: the next attempt parks again
    h.acquire(b)
    assert kinds(h.drain()) == ["SnapshotJob"]


def test_a_refused_park_is_retried_after_a_while(h: Harness) -> None:
    _, b, _ = park_fails_intact(h)
    h.drain()
    h.advance(PARK_RETRY_S)
    h.acquire(b)
    assert kinds(h.drain()) == ["SnapshotJob"]


def test_a_job_exiting_lets_refused_parks_be_retried(h: Harness) -> None:
    _, b, _ = park_fails_intact(h)
    h.drain()
    h.register("Z", "z")
    h.exit("Z")
    h.drain()
    h.acquire(b)
    assert kinds(h.drain()) == ["SnapshotJob"]


def test_a_park_failure_without_a_code_is_a_switch_failure(h: Harness) -> None:
    idle_with(h, "A", 60)
    b = h.register("B", "x", exclusive=True)
    rb = h.acquire(b)
    (snap,) = h.drain()
    h.finish(snap, ok=False, error="the process did not reach a safe point in 10 s", intact=True)
    _, fail = h.drain()
    assert fail.ticket == (b, rb) and isinstance(fail.error, errors.SwitchFailed)
    assert "did not reach a safe point" in fail.error.message and not h.s.jobs["A"].faulted
    assert h.s.jobs["A"].refusal is not None and h.s.jobs["A"].refusal.code == "park_refused"


def test_a_victim_refused_for_memory_is_passed_over_for_another(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100})
    idle_with(h, "A", 40)
    idle_with(h, "B", 40, group="y")
    c = holding(h, "C", group="x")
    h.alloc(c, 60)  # parks A (least recently granted) to make room
    (snap,) = h.drain()
    assert snap.job == "A"
    h.finish(snap, ok=False, error="no space left on device", intact=True, code=HOST_FULL)
    effects = h.drain()
    assert [type(e.error) for e in only(effects, FailRequest)] == [errors.OutOfMemory]
    rid = h.alloc(c, 30)  # A's park is refused for now: B goes instead
    (snap,) = h.drain()
    assert snap.job == "B"
    h.finish(snap, nbytes=40)
    (alloc,) = h.drain()
    assert alloc.ticket == (c, rid)


def test_a_restore_that_fails_intact_leaves_the_job_parked_and_tells_its_waiter(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    ra = h.acquire(a)
    h.release(b)
    (snap,) = h.drain()
    h.finish(snap, nbytes=60)
    (restore,) = h.drain()
    h.finish(restore, ok=False, error="the GPU has 10 B free", intact=True, code="insufficient_memory")
    notify, fail = h.drain()
    assert notify.event == "move_failed" and fail.ticket == (a, ra)
    assert isinstance(fail.error, errors.SwitchFailed) and "intact in host memory" in fail.error.message
    assert h.location("A") == "parked" and not h.s.jobs["A"].faulted and h.s.jobs["A"].parked == {0: 60}
    assert h.group_state() == "idle"
    h.acquire(a)  # its own next acquire tries again
    (restore,) = h.drain()
    assert isinstance(restore, RestoreJob)
    h.finish(restore)
    assert one_grant(h.drain()).job == "A" and h.s.jobs["A"].parked == {}


def test_a_failed_move_of_unknown_outcome_still_faults(h: Harness) -> None:
    idle_with(h, "A", 60)
    b = h.register("B", "x", exclusive=True)
    h.acquire(b)
    (snap,) = h.drain()
    h.finish(snap, ok=False, error="timed out")
    faulted, grant = h.drain()
    assert faulted.event == "faulted" and grant.job == "B"  # a faulted rival is passed over, as before
    assert h.s.jobs["A"].faulted == "snapshot failed: timed out" and h.group_state("g") == "faulted"
    assert h.s.jobs["A"].refusal is None


# --- the operator's resume -----------------------------------------------------------------------


def test_resume_clears_a_fault_and_the_job_is_parked_and_granted_again(h: Harness) -> None:
    a, b = two_jobs_one_parked(h)
    h.release(b)
    ra = h.acquire(a)
    (snap,) = h.drain()
    h.finish(snap, ok=False, error="timed out")
    _, fail = h.drain()
    assert fail.ticket == (a, ra) and h.s.jobs["B"].faulted and h.group_state() == "faulted"
    assert h.resume("B") == {"job": "B", "group": "g", "location": "resident", "was": "snapshot failed: timed out"}
    assert h.drain() == [NotifyJob("B", "resumed", {"job": "B", "was": "snapshot failed: timed out"})]
    assert h.group_state() == "idle-yielded"
    ra = h.acquire(a)
    (snap,) = h.drain()
    assert snap.job == "B"
    h.finish(snap, nbytes=60)
    (restore,) = h.drain()
    h.finish(restore)
    assert one_grant(h.drain()).tickets == ((a, ra),)


def test_resume_refuses_what_it_cannot_resume(h: Harness) -> None:
    h.fails(FaultCleared("nobody"), errors.UnknownJob, "no job 'nobody'")
    idle_with(h, "A", 10)
    h.fails(FaultCleared("A"), errors.BadRequest, "is not faulted")
    b = h.register("B", "x", exclusive=True)
    h.acquire(b)
    (snap,) = h.drain()
    h.finish(snap, ok=False, error="lost")
    h.drain()
    h.exit("A")
    h.fails(FaultCleared("A"), errors.JobFaulted, "exited")


# --- preemption only where the method freezes the job ----------------------------------------------


PREEMPT = {"g": SlicePolicy(1.0, "preempt", grace=0.0), "w": SlicePolicy(1.0, "warn")}


def test_a_job_that_cannot_be_frozen_joins_no_preempting_group(harness: Callable[..., Harness]) -> None:
    h = harness(policies=PREEMPT)
    error = h.fails(JobRegistered(1, "offload", "g", None, (), True, freezes=False), errors.PreemptionUnsafe)
    assert error.code == "preempt_unsafe"
    assert error.message.startswith(
        "group 'g' preempts a holder past its maximum slice of 1 s, and job 'offload' is parked by a method "
        "that cannot stop its GPU work first"
    )
    assert "Register it in a group whose slice action is warn, or park it with cuda-checkpoint" in error.message
    h.register("offload", "w", exclusive=True, freezes=False)  # a warning group takes it
    h.register("frozen", "g", exclusive=True)  # cuda-checkpoint locks its process first: preemptible
    h.fails(JobRegistered(9, "offload", "w", None, (), True), errors.BadRequest, "another parking method")


def test_the_policy_for_every_group_counts_too(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(5.0, "preempt"), "w": SlicePolicy(5.0, "warn")})
    h.fails(JobRegistered(1, "e", "any", None, (), True, freezes=False), errors.PreemptionUnsafe, "'any' preempts")
    h.register("e", "w", exclusive=True, freezes=False)


def test_an_adopted_holder_that_cannot_be_frozen_is_only_warned(harness: Callable[..., Harness]) -> None:
    h = harness(policies=PREEMPT)
    h.s.adopt_group("g", (0,), h.now)
    h.s.adopt_job("e", "g", True, Location.RESIDENT, {}, freezes=False)  # an earlier leader let it in
    e = h.session()
    h.s.handle(JobRegistered(e, "e", "g", None, (), True, freezes=False), h.now)
    h.acquire(e)
    h.drain()
    b = h.register("B")
    h.acquire(b)
    h.timers(2.0)
    (warned,) = h.drain()
    assert warned.event == "slice_overdue" and warned.data["action"] == "warn"
    assert "cannot be preempted safely, so it is only warned" in str(warned.data["reason"])
    assert h.s.next_deadline() is None  # and no timer is left due: the grace would otherwise spin the shell
    h.timers(10.0)
    assert h.drain() == [] and h.holder() == "e"


def test_a_preempted_holder_whose_park_does_not_fit_stays_resident(harness: Callable[..., Harness]) -> None:
    h = harness(policies=PREEMPT)
    a = holding(h, "A", 60)
    h.host(10)
    b = h.register("B", exclusive=True)
    rb = h.acquire(b)
    h.timers(1.0)
    effects = h.drain()
    assert [type(e).__name__ for e in effects] == ["NotifyJob", "NotifyJob", "FailRequest", "SnapshotJob"]
    assert [e.event for e in effects[:2]] == ["slice_overdue", "preempted"]
    fail, snap = effects[2:]
    assert fail.ticket == (b, rb) and isinstance(fail.error, errors.InsufficientHostMemory)
    # A was never parked (its park did not fit): its turn comes back as it is, once B (never run) made way
    assert snap.job == "B" and h.location("A") == "resident" and h.used() == 60
    h.finish(snap)
    grant = one_grant(h.drain())
    assert isinstance(grant, GrantLock) and grant.job == "A" and grant.tickets == ((a, AUTO),)


# --- the model: a wedge cannot hide -----------------------------------------------------------------


def test_the_liveness_check_catches_a_waiter_left_for_nothing(h: Harness) -> None:
    """The check itself can fail: a head blocked while nothing is in its way is caught."""
    a = holding(h, "A")
    b = h.register("B")
    h.acquire(b)
    group = h.s.groups["g"]
    group.holder, group.holder_sessions = None, set()  # what a bug that forgot to grant would leave
    with pytest.raises(AssertionError, match="could be acted on, yet waits"):
        h.s.check_invariants(h.now)
    del a


def test_an_exclusive_job_waits_for_a_rival_that_holds(h: Harness) -> None:
    holding(h, "A", 10, group="y")
    b = h.register("B", exclusive=True)
    h.acquire(b)
    assert h.drain() == []
    assert h.s.describe(h.now)["groups"][1]["waiting_for"] == (
        "GPUs shared with A, which holds a lock or is on the move"
    )
    h.s.check_invariants(h.now)


def test_acquire_of_a_job_is_unaffected_by_other_nodes_budgets(h: Harness) -> None:
    idle_with(h, "A", 60)
    h.host(0, slot=1)  # a node this job has nothing on
    c = h.register("C", "x", exclusive=True)
    h.acquire(c)
    assert kinds(h.drain()) == ["SnapshotJob"]
    h.fails(AcquireRequested(99, 1), errors.NotRegistered)
