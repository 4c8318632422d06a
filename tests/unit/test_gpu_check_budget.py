"""The GPU check's time budget (tests/gpu/budget.py): stage slots, rounds planned from the first switch.

The last tests play a whole check on a model of an H100/H200 (stage durations,
a cuda-checkpoint toggle of T seconds) through the real planner, and show it
ends before the deadline with no stage running past its slot, from a fast
toggle up to the 15 s reported for an H100.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.gpu import budget, check
from tests.gpu.budget import FirstTurn, StageSpec, plan_rounds, slot, turns_left

# --- slots -------------------------------------------------------------------------------


def test_a_stage_gets_its_cap_when_time_is_plenty() -> None:
    got = slot(StageSpec("x", cap_s=60, floor_s=10), now=0, deadline=270, reserve_s=15)
    assert got.seconds == 60 and got.why == ""


def test_a_stage_leaves_the_floors_of_the_required_stages_after_it_and_the_reserve() -> None:
    later = [StageSpec("a", 100, 40), StageSpec("b", 100, 30), StageSpec("opt", 100, 50, required=False)]
    got = slot(StageSpec("x", cap_s=200, floor_s=10), now=100, deadline=270, later=later, reserve_s=15)
    assert got.seconds == 270 - 100 - 15 - 40 - 30  # the optional stage keeps nothing


@pytest.mark.parametrize("now", [200.0, 240.0, 300.0])
def test_a_stage_below_its_floor_is_not_started_and_says_why(now: float) -> None:
    got = slot(StageSpec("x", cap_s=60, floor_s=40), now=now, deadline=270, later=[StageSpec("a", 9, 20)])
    assert got.seconds is None
    assert "needs about 40s" in got.why and "left" in got.why


def test_a_measured_floor_overrides_the_specs() -> None:
    spec = StageSpec("crash", cap_s=90, floor_s=40, required=False)
    assert slot(spec, now=0, deadline=100, reserve_s=15).seconds == 85
    assert slot(spec, now=0, deadline=100, reserve_s=15, floor_s=120).seconds is None


def test_the_checks_stages_fit_the_default_deadline_with_every_floor() -> None:
    required = [s for s in check.STAGES.values() if s.required]
    assert sum(s.floor_s for s in required) + budget.CLEANUP_RESERVE_S < budget.DEFAULT_DEADLINE_S
    assert budget.DEFAULT_DEADLINE_S < 300  # one run of the check ends within 5 minutes


# --- turns and rounds ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first_round", "rounds", "jobs", "left"),
    [
        (1, 1, 2, 1),  # A announces at A1: only B1 is left
        (1, 10, 2, 19),
        (2, 2, 2, 1),  # A's first restore came at A2 (A1 was granted before B0)
        (1, 3, 3, 8),
        (3, 3, 2, 1),
    ],
)
def test_turns_left_after_the_announcement(first_round: int, rounds: int, jobs: int, left: int) -> None:
    assert turns_left(first_round, rounds, jobs) == left


def test_fast_switches_take_every_round_asked() -> None:
    plan = plan_rounds(FirstTurn(1, switch_s=0.3, work_s=0.5), asked=10, left_s=100)
    assert plan.rounds == 10 and plan.why == "all 10 rounds fit"
    assert plan.needed_s == pytest.approx(19 * 0.8 * budget.SAFETY + budget.TAIL_S)


def test_a_15s_toggle_plans_fewer_rounds_that_fit() -> None:
    # Two toggles per switch (park the other job, restore this one), 1 s of verify and fill.
    plan = plan_rounds(FirstTurn(1, switch_s=30, work_s=1), asked=10, left_s=97)
    assert plan.rounds == 1
    assert plan.needed_s <= plan.left_s
    assert "1 of 10 rounds fit" in plan.why


def test_the_plan_is_the_largest_that_fits() -> None:
    first = FirstTurn(1, switch_s=2.0, work_s=0.0)
    for left in [15.0, 30.0, 60.0, 80.0]:
        plan = plan_rounds(first, asked=50, left_s=left)
        assert plan.needed_s <= left
        bigger = turns_left(1, plan.rounds + 1) * plan.turn_s + budget.TAIL_S
        assert bigger > left, (left, plan)


def test_the_plan_never_goes_below_the_turns_already_started() -> None:
    plan = plan_rounds(FirstTurn(2, switch_s=60, work_s=1), asked=10, left_s=5)
    assert plan.rounds == 2
    assert plan.needed_s > plan.left_s and "not even" in plan.why


@pytest.mark.parametrize(
    ("first", "asked"),
    [(FirstTurn(0, 1.0, 1.0), 10), (FirstTurn(3, 1.0, 1.0), 2)],
)
def test_impossible_plans_raise(first: FirstTurn, asked: int) -> None:
    with pytest.raises(ValueError):
        plan_rounds(first, asked=asked, left_s=100)


def test_crash_floor_grows_with_the_measured_turn_and_defaults_without_one() -> None:
    assert budget.crash_floor(None, default_s=40) == 40
    assert budget.crash_floor(1.0, default_s=40) < budget.crash_floor(38.75, default_s=40)
    assert budget.crash_floor(38.75, default_s=40) == pytest.approx(2 * budget.STARTUP_S + 4 * 38.75 + budget.TAIL_S)


# --- a whole check on a model machine ------------------------------------------------------


@dataclass
class Machine:
    """How long things take on the model machine (seconds)."""

    toggle_s: float  # one cuda-checkpoint toggle (lock+checkpoint, or restore+unlock)
    install_s: float = 0.0
    offload_switch_s: float = 0.4
    work_s: float = 1.0  # a job's verify and fill of 4 GiB
    startup_s: float = 5.0
    end_s: float = 5.0
    fixed = {"preflight": 1.0, "cuda": 3.0, "pytest": 20.0, "ceiling": 8.0}


def run_backend_model(switch_s: float, first_park_s: float, slot_s: float, m: Machine, asked: int = 10) -> dict:
    """A backend stage on the model: when the first restored turn is announced, the plan; then the rest."""
    announce_at = m.startup_s + m.work_s + (first_park_s + m.work_s) + (switch_s + m.work_s)
    plan = plan_rounds(FirstTurn(1, switch_s, m.work_s), asked=asked, left_s=slot_s - announce_at)
    took = announce_at + turns_left(1, plan.rounds) * (switch_s + m.work_s) + m.end_s
    return {"plan": plan, "took": took, "timed_out": took > slot_s}


def play(m: Machine, deadline: float = budget.DEFAULT_DEADLINE_S) -> dict:
    """The check's stage order and slots (check.STAGES, check.Check.slot's rules) on the model machine."""
    order = ["preflight", "install", "cuda", "pytest", "ceiling", "cuda-checkpoint", "offload", "crash"]
    now, out = 0.0, {}
    durations = {**m.fixed, "install": m.install_s}
    for i, name in enumerate(order):
        spec = check.STAGES[name]
        later = [check.STAGES[n] for n in order[i + 1 :]]
        floor = None
        if name == "crash":
            floor = budget.crash_floor(out["cuda-checkpoint"]["plan"].turn_s, default_s=spec.floor_s)
        got = slot(spec, now=now, deadline=deadline, later=later, floor_s=floor)
        if got.seconds is None:
            out[name] = {"skipped": got.why}
            continue
        if name == "cuda-checkpoint":
            result = run_backend_model(2 * m.toggle_s, m.toggle_s, got.seconds, m)
        elif name == "offload":
            result = run_backend_model(m.offload_switch_s, m.offload_switch_s / 2, got.seconds, m)
        elif name == "crash":
            small = Machine(m.toggle_s, work_s=0.1)
            result = run_backend_model(2 * m.toggle_s, m.toggle_s, got.seconds - small.startup_s, small, asked=3)
            result["took"] += small.startup_s  # the daemon's restart
            result["timed_out"] = result["took"] > got.seconds
        else:
            result = {"took": min(durations[name], got.seconds), "timed_out": durations[name] > got.seconds}
        result["slot"] = got.seconds
        now += min(result["took"], got.seconds)
        out[name] = result
    out["total"] = now + 5.0  # the cleanup
    return out


@pytest.mark.parametrize("toggle_s", [0.2, 2.0, 5.0, 10.0, 15.0])
@pytest.mark.parametrize("install_s", [0.0, 60.0, 90.0])  # 90: pip failing offline for its whole slot
def test_the_whole_check_ends_in_time_without_a_stage_timing_out(toggle_s: float, install_s: float) -> None:
    got = play(Machine(toggle_s, install_s=install_s))
    assert got["total"] < budget.DEFAULT_DEADLINE_S, got
    for name in ("cuda-checkpoint", "offload"):
        assert "skipped" not in got[name], got[name]
        assert not got[name]["timed_out"], (name, got[name])
        assert got[name]["plan"].rounds >= 1
    if "skipped" not in got["crash"]:
        assert not got["crash"]["timed_out"], got["crash"]


def test_slower_toggles_mean_fewer_rounds_and_fast_ones_all_of_them() -> None:
    rounds = [play(Machine(t))["cuda-checkpoint"]["plan"].rounds for t in (0.2, 2.0, 5.0, 15.0)]
    assert rounds[0] == 10
    assert rounds == sorted(rounds, reverse=True)
    assert rounds[-1] == 1


def test_the_crash_check_is_skipped_when_a_15s_toggle_leaves_no_room_for_it() -> None:
    got = play(Machine(15.0))
    assert "skipped" in got["crash"] and "needs about" in got["crash"]["skipped"]
    assert "skipped" not in play(Machine(0.2))["crash"]


def test_the_model_catches_a_planner_that_ignores_the_clock() -> None:
    # The same model with the plan forced to every round asked: a 15 s toggle times out.
    m = Machine(15.0)
    announce_at = m.startup_s + m.work_s + (15.0 + m.work_s) + (30.0 + m.work_s)
    took = announce_at + turns_left(1, 10) * (30.0 + m.work_s) + m.end_s
    assert took > check.STAGES["cuda-checkpoint"].cap_s
