"""One schema for the status document: a live daemon's status and every test fixture hold to it.

So the dashboard and metrics tests, which read hand-written documents, read what a daemon really
sends; a field added to the daemon and not to the schema (or the other way round) fails here.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from timesliced.client import Client
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.wire.status import Status, problems

from ..helpers.evolving_source import EvolvingSource
from ..helpers.processes import wait_for
from ..helpers.status_docs import dashboard_status, metrics_status

MiB = 1 << 20


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


def live(daemon: EmbeddedDaemon) -> Status:
    with Client("probe", "probe-group", address=daemon.socket) as probe:
        return probe.status()  # type: ignore[return-value]


def test_a_live_daemon_holds_to_the_schema_idle_and_busy(daemon: EmbeddedDaemon) -> None:
    assert problems(live(daemon)) == []
    a = Client("a", "pool", address=daemon.socket)
    b = Client("b", "pool", address=daemon.socket)
    try:
        region = a.sim_alloc(40 * MiB)
        b.sim_alloc(40 * MiB)  # two of them do not fit on a GPU of 64 MiB: a is parked for it
        a.acquire()  # a is restored, b parked
        waiter = threading.Thread(target=lambda: (b.acquire(timeout=30), b.release()))
        waiter.start()
        wait_for(lambda: any(g["queue"] for g in live(daemon)["groups"]))
        busy = live(daemon)  # a holder, a queue, memory on a GPU
        assert problems(busy) == []
        assert {j["job"] for j in busy["jobs"]} >= {"a", "b"} and busy["groups"]
        a.release()
        waiter.join(30)
        moved = live(daemon)  # jobs were parked and restored: moves and their figures
        assert problems(moved) == [] and moved["moves"]["recent"]
        a.sim_free(region)
    finally:
        a.close()
        b.close()
