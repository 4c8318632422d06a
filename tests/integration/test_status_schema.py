"""A live daemon's status holds to the status document's schema, idle, busy and after moves.

The test fixtures hold to the same schema (tests/unit/test_status_schema.py), so a field added to the
daemon and not to the schema or the fixtures (or the other way round) fails here or there.
"""

from __future__ import annotations

import threading

from timesliced.client import Client
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.wire.status import Status, problems

from ..helpers.processes import wait_for

MiB = 1 << 20


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
