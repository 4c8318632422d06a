"""The GPU check's time budget: pure arithmetic, no clock (``now`` is passed in), no I/O.

The check has one total deadline (``--deadline``, 270 s by default, so that one
H100/H200 run ends well inside 5 minutes). Two decisions are made here:

- :func:`slot`: how long a stage may run. It gets at most its cap, and never
  so much that the required stages after it lose their floors or the cleanup
  its reserve. A stage whose slot would be below its own floor is not started
  (a required one then fails with "not run", an optional one is skipped).
- :func:`plan_rounds`: how many turns a backend run takes, from its first
  measured switch. A job announces its first restored turn (the switch the
  daemon made for it, and the verify and fill work of that turn) while it
  still holds the GPU, so nobody has gone further; the plan is the most turns
  that still fit the stage's slot, never fewer than those already started.
  A cuda-checkpoint toggle of 15 s (as reported for an H100) thus means one
  verified turn per job instead of a timeout.

:func:`crash_floor` sizes the crash check the same way, from the main run's turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SAFETY = 1.25  # measured turns are scaled by this: the first one is not the slowest one
TAIL_S = 10.0  # after the last turn: the jobs exit, the daemon stops, the logs are read
STARTUP_S = 8.0  # a daemon up and two jobs registered (python start, imports, cuInit)
DEFAULT_DEADLINE_S = 270.0
CLEANUP_RESERVE_S = 15.0  # kill grace, the NVML check that the GPU is empty, the JSON


@dataclass(frozen=True)
class StageSpec:
    """A stage of the check: at most ``cap_s``; not worth starting with less than ``floor_s``."""

    name: str
    cap_s: float
    floor_s: float
    required: bool = True  # skipping it for lack of time fails the check


@dataclass(frozen=True)
class Slot:
    """How long a stage may run; ``seconds`` is None when it is not started (``why`` says so)."""

    seconds: float | None
    why: str = ""


def slot(
    spec: StageSpec,
    *,
    now: float,
    deadline: float,
    later: Sequence[StageSpec] = (),
    reserve_s: float = CLEANUP_RESERVE_S,
    floor_s: float | None = None,
) -> Slot:
    """The time ``spec`` may take from ``now``, leaving the floors of the required ``later`` stages.

    ``floor_s`` overrides the spec's floor (a floor measured during the run, e.g. the crash check's).
    """
    floor = spec.floor_s if floor_s is None else floor_s
    kept = reserve_s + sum(s.floor_s for s in later if s.required)
    left = deadline - now - kept
    seconds = min(spec.cap_s, left)
    if seconds < floor:
        return Slot(
            None,
            f"needs about {floor:.0f}s but {max(left, 0.0):.0f}s are left of the {deadline - now:.0f}s to the "
            f"deadline (after {kept:.0f}s kept for the stages after it and the cleanup)",
        )
    return Slot(seconds)


@dataclass(frozen=True)
class FirstTurn:
    """The first turn of a run that came with a restore, as the job that had it measured it."""

    round: int  # the job's round (>= 1; round 0 only allocates)
    switch_s: float  # what the daemon spent parking the other job and restoring this one
    work_s: float  # the job's own verify and fill of that turn


@dataclass(frozen=True)
class RoundPlan:
    """The turns each job takes (``rounds``), and the arithmetic behind it."""

    rounds: int
    asked: int
    turn_s: float  # one turn, safety factor included
    needed_s: float  # estimated time from now to the end of the run with ``rounds``
    left_s: float
    why: str

    def to_dict(self) -> dict[str, object]:
        return {
            "rounds": self.rounds,
            "asked": self.asked,
            "turn_s": round(self.turn_s, 3),
            "needed_s": round(self.needed_s, 1),
            "left_s": round(self.left_s, 1),
            "why": self.why,
        }


def turns_left(first_round: int, rounds: int, jobs: int = 2) -> int:
    """Turns (slices of any job) still to come when a job announces its turn ``first_round``.

    Each job takes ``rounds + 1`` slices (slice 0 allocates). The announcing job
    has had ``first_round + 1`` of them, and every other job ``first_round``,
    since they take turns in order.
    """
    done = jobs * first_round + 1
    return max(0, jobs * (rounds + 1) - done)


def plan_rounds(
    first: FirstTurn,
    *,
    asked: int,
    left_s: float,
    jobs: int = 2,
    safety: float = SAFETY,
    tail_s: float = TAIL_S,
) -> RoundPlan:
    """The most rounds, at most ``asked``, whose remaining turns fit ``left_s``; never below ``first.round``.

    Raises ``ValueError`` for a first turn that is not a restored one (round < 1)
    or a request smaller than the turns already started.
    """
    if first.round < 1:
        raise ValueError(f"the first restored turn is round 1 or later, not {first.round}")
    if asked < first.round:
        raise ValueError(f"{asked} rounds asked, but the jobs are already at round {first.round}")
    turn = max(first.switch_s, 0.0) + max(first.work_s, 0.0)
    turn_s = turn * safety

    def needed(rounds: int) -> float:
        return turns_left(first.round, rounds, jobs) * turn_s + tail_s

    rounds = first.round
    for candidate in range(asked, first.round - 1, -1):
        if needed(candidate) <= left_s:
            rounds = candidate
            break
    if rounds == asked:
        why = f"all {asked} rounds fit"
    elif needed(rounds) <= left_s:
        why = (
            f"a turn takes about {turn_s:.1f}s here (switch {first.switch_s:.1f}s, work {first.work_s:.1f}s, "
            f"x{safety:g}); {rounds} of {asked} rounds fit the {left_s:.0f}s left"
        )
    else:
        why = (
            f"a turn takes about {turn_s:.1f}s here; not even the {rounds} rounds already started fit the "
            f"{left_s:.0f}s left, so the run ends with them"
        )
    return RoundPlan(rounds, asked, turn_s, needed(rounds), left_s, why)


def crash_floor(turn_s: float | None, *, default_s: float, jobs: int = 2, tail_s: float = TAIL_S) -> float:
    """Seconds the crash check needs at the least: one verified round per job, and a daemon restart.

    ``turn_s`` is a turn of the main cuda-checkpoint run (safety included); None
    when it never measured one, and then ``default_s``.
    """
    if turn_s is None:
        return default_s
    turns = jobs * 2  # slices 0 and 1 of each job
    return 2 * STARTUP_S + turns * turn_s + tail_s
