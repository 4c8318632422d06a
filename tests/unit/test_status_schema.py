"""The status document's schema and its checker, and the test fixtures that must hold to it.

A live daemon's status is held to the same schema in tests/integration/test_status_schema.py, so the
dashboard and metrics tests, which read hand-written documents, read what a daemon really sends.
"""

from __future__ import annotations

from typing import Any

import pytest

from timesliced.wire.status import problems

from ..helpers.evolving_source import EvolvingSource
from ..helpers.status_docs import dashboard_status, metrics_status


def test_the_checker_finds_every_kind_of_difference() -> None:
    doc: Any = dashboard_status()
    assert problems(doc) == []
    del doc["node"]
    doc["extra"] = 1
    doc["pid"] = "1234"
    doc["groups"][0]["holder"] = 7
    doc["groups"][0]["queue"][0]["waited_s"] = True  # a bool is not a number here
    doc["devices"][0]["jobs"]["rl-math"] = []
    doc["counters"]["accepted"] = 1.5
    assert sorted(problems(doc)) == [
        "status.counters.accepted: expected int, got float",
        "status.devices[0].jobs['rl-math']: expected an object, got list",
        "status.groups[0].holder: expected str or null, got int",
        "status.groups[0].queue[0].waited_s: expected float, got bool",
        "status.pid: expected int, got str",
        "status: missing 'node'",
        "status: unknown key 'extra'",
    ]


@pytest.mark.parametrize(
    "fixture",
    [dashboard_status, metrics_status, lambda: EvolvingSource().status(), lambda: EvolvingSource(frozen=True).status()],
    ids=["dashboard", "metrics", "browser", "browser-frozen"],
)
def test_every_fixture_holds_to_the_schema(fixture: Any) -> None:
    assert problems(fixture()) == []
