"""A job's location changes only through the table in ``core/location.py``.

Table-driven: every (location, cause) pair the table allows goes where it says, every other pair
raises ``IllegalTransition``; raised inside a step of the scheduler, it leaves the scheduler as
it was. A walk over the core's source keeps every assignment of a location in one function.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from timesliced.core.events import JobRegistered, SnapshotJob
from timesliced.core.location import TRANSITIONS, Cause, IllegalTransition, Location, moved

from ..helpers.harness import Harness, holding, only

PAIRS = list(itertools.product(Location, Cause))
ILLEGAL = [(loc, cause) for loc, cause in PAIRS if (loc, cause) not in TRANSITIONS]


def test_the_table_covers_every_location_and_refuses_the_rest() -> None:
    assert len(ILLEGAL) == len(PAIRS) - len(TRANSITIONS) > 0
    assert {loc for loc, _ in TRANSITIONS} == set(Location)  # every location can be left or kept


@pytest.mark.parametrize(("location", "cause"), list(TRANSITIONS))
def test_an_allowed_transition_goes_where_the_table_says(location: Location, cause: Cause) -> None:
    assert moved(location, cause) is TRANSITIONS[(location, cause)]


@pytest.mark.parametrize(("location", "cause"), ILLEGAL)
def test_a_transition_the_table_does_not_allow_raises(location: Location, cause: Cause) -> None:
    with pytest.raises(IllegalTransition, match=f"a job that is {location.value} cannot have its {cause.value}"):
        moved(location, cause)


def job_at(h: Harness, location: Location) -> str:
    """A job "A" at ``location``, reached by ordinary inputs; effects drained."""
    a = holding(h, "A", 60)
    if location is Location.RESIDENT:
        return "A"
    h.release(a)
    b = h.register("B")
    h.acquire(b)
    h.alloc(b, 60)  # parks the idle A
    (snap,) = only(h.drain(), SnapshotJob)
    if location is Location.PARKING:
        return "A"
    h.finish(snap, nbytes=60)
    h.free("B", 60)
    if location is Location.PARKED:
        h.drain()
        return "A"
    h.release(b)
    h.acquire(a)  # restores A
    h.drain()
    assert h.location("A") == "restoring"
    return "A"


@pytest.mark.parametrize(("location", "cause"), ILLEGAL)
def test_an_illegal_transition_inside_a_step_changes_nothing(
    h: Harness, monkeypatch: pytest.MonkeyPatch, location: Location, cause: Cause
) -> None:
    """A bug that asks for a change the table refuses, after the step has written elsewhere."""
    name = job_at(h, location)
    job = h.s.jobs[name]
    advance_all: Callable[..., None] = h.s.arbiter.advance_all

    def buggy(now: float, frozen: dict[str, str]) -> None:
        advance_all(now, frozen)
        h.s.moves.relocate(job, cause)

    monkeypatch.setattr(h.s.arbiter, "advance_all", buggy)
    # the registration writes a job, a session and a group before the advance runs
    h.fails(JobRegistered(h.session(), "C", "other", None, (7,)), IllegalTransition)
    assert job.location is location and "C" not in h.s.jobs


def location_writes(source: str, module: str) -> set[str]:
    """Where ``source`` assigns a ``.location`` or names the field to write it (``setattr``, ``Fields``)."""
    found: set[str] = set()

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inside = f"{module}:{child.name}" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            if any(isinstance(t, ast.Attribute) and t.attr == "location" for tg in targets for t in ast.walk(tg)):
                found.add(inside)
            if isinstance(child, ast.Call) and any(
                isinstance(a, ast.Constant) and a.value == "location" for a in child.args
            ):
                found.add(f"{inside} (by name)")
            visit(child, inside)

    visit(ast.parse(source), f"{module}:<module>")
    return found


def test_only_moves_relocate_assigns_a_location() -> None:
    """Every write of a job's location in the scheduler's modules is ``Moves.relocate`` (and its undo note)."""
    core = Path(__file__).resolve().parents[2] / "timesliced" / "core"
    found = set().union(*(location_writes(p.read_text(), p.name) for p in sorted(core.glob("*.py"))))
    assert found == {"moves.py:relocate", "moves.py:<module> (by name)"}, found


def test_the_walker_sees_a_location_written_elsewhere() -> None:
    source = (
        "def f(job):\n    job.location = Location.PARKED\n"
        "def g(job):\n    setattr(job, 'location', x)\n"
        "def h(a, b):\n    a.x, b.location = 1, 2\n"
        "def k(job):\n    return Job('a', 'g', location=Location.PARKED)\n"  # a new job: no write
    )
    assert location_writes(source, "m.py") == {"m.py:f", "m.py:g (by name)", "m.py:h"}
