"""Leases (heartbeats, quiet clients lose the lock) and maximum slices (warn, preempt) on a real daemon."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.config import DaemonConfig
from timesliced.core.slices import SlicePolicy
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.env import default_sim_dir

from ..helpers.client_shells import SHELLS, Shell, shell_of
from ..helpers.daemon import Raw
from ..helpers.processes import wait_for

MiB = 1 << 20


def start(tmp_path: Path, **overrides: Any) -> EmbeddedDaemon:
    settings: dict[str, Any] = {"backend": "sim", "gpus": 1, "gpu_memory": 8 * MiB, "bandwidth": 0}
    config = DaemonConfig(state_dir=tmp_path / "state", **{**settings, **overrides})
    return EmbeddedDaemon(config).start()


@pytest.fixture
def stop_later(tmp_path: Path) -> Iterator[list[EmbeddedDaemon]]:
    started: list[EmbeddedDaemon] = []
    yield started
    for d in started:
        d.stop()
    shutil.rmtree(default_sim_dir(tmp_path / "state"), ignore_errors=True)


@pytest.fixture(params=SHELLS)
def shell(request: pytest.FixtureRequest) -> Iterator[Shell]:
    with shell_of(request.param) as made:
        yield made


def group(c: Any) -> dict[str, Any]:
    (g,) = c.status()["groups"]
    return g  # type: ignore[no-any-return]


def history(d: EmbeddedDaemon) -> list[tuple[str, str | None]]:
    """What the dashboard's timeline shows: (kind, job) of every event."""
    assert d.daemon is not None
    return [(e.kind, e.job) for e in d.daemon.history.events]


@pytest.mark.slow
def test_preempted_holder_is_parked_and_its_access_waits_for_the_lock(
    tmp_path: Path, stop_later: list[EmbeddedDaemon], shell: Shell
) -> None:
    d = start(tmp_path, slice_policies={"*": SlicePolicy(0.3, "preempt", grace=0.2)})
    stop_later.append(d)
    pushes: list[tuple[str, dict[str, Any]]] = []
    a = shell.client(d.socket, "a", on_push=lambda e, data: pushes.append((e, data)))
    b = timesliced.Client(job="b", group="g", address=d.socket)
    a.acquire()
    region = a.sim_alloc(6 * MiB)
    region.fill(b"mine")
    before = region.checksum()
    started = time.monotonic()
    grant = b.acquire(timeout=10)  # a never yields: it is preempted after 0.3 + 0.2 s
    assert grant.job == "b" and time.monotonic() - started >= 0.4
    # The push changes a's state in its core before its callback runs (outside the client's lock): wait for both.
    wait_for(lambda: a.preempted is not None and len(pushes) >= 2)
    assert "maximum slice of 0.3 s" in a.preempted
    assert [e for e, _ in pushes][:2] == ["slice_overdue", "preempted"]
    assert [w["job"] for w in group(b)["queue"]] == ["a"] and group(b)["queue"][0]["preempted"]
    other = b.sim_alloc(6 * MiB)  # fits: a's bytes are parked
    other.fill(b"theirs")
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.append(region.checksum()))
    reader.start()  # a's next access waits while it is preempted...
    time.sleep(0.3)
    assert not seen
    b.release()  # ...until it is granted again, automatically
    reader.join(10)
    assert seen == [before]
    wait_for(lambda: pushes[-1][0] == "granted")
    assert a.preempted is None and ("granted", pushes[-1][1]) == pushes[-1]
    assert a.release()["group"] == "g"
    assert group(b)["preemptions"] == 1
    assert ("slice_overdue", "a") in history(d) and ("preempted", "a") in history(d)
    a.close()
    b.close()


def test_preempted_access_raises_by_policy(tmp_path: Path, stop_later: list[EmbeddedDaemon], shell: Shell) -> None:
    d = start(tmp_path, slice_policies={"g": SlicePolicy(0.2, "preempt", grace=0.0)})
    stop_later.append(d)
    a = shell.client(d.socket, "a", parked_access="raise")
    b = timesliced.Client(job="b", group="g", address=d.socket)
    a.acquire()
    region = a.sim_alloc(MiB)
    b.acquire(timeout=10)
    wait_for(lambda: a.preempted is not None)
    wait_for(lambda: next(j for j in b.status()["jobs"] if j["job"] == "a")["location"] == "parked")
    with pytest.raises(errors.NotResident):
        region.read(4)
    assert a.release()["preempted"] is True  # done before its turn came back: it gives the turn up
    assert group(b)["queue"] == []
    a.close()
    b.close()


@pytest.mark.slow
def test_warn_only_tells_the_holder_and_keeps_it(
    tmp_path: Path, stop_later: list[EmbeddedDaemon], shell: Shell
) -> None:
    d = start(tmp_path, slice_policies={"*": SlicePolicy(0.2, "warn")})
    stop_later.append(d)
    pushes: list[str] = []
    a = shell.client(d.socket, "a", on_push=lambda e, _: pushes.append(e))
    b = timesliced.Client(job="b", group="g", address=d.socket)
    a.acquire()
    with pytest.raises(errors.AcquireTimeout):
        b.acquire(timeout=0.6)
    assert pushes == ["slice_overdue"]
    assert group(a)["holder"] == "a" and group(a)["overdue_s"] > 0
    a.close()
    b.close()


@pytest.mark.slow
def test_a_quiet_holder_loses_the_lock_after_its_lease(
    tmp_path: Path, stop_later: list[EmbeddedDaemon], shell: Shell
) -> None:
    d = start(tmp_path, lease=0.5)
    stop_later.append(d)
    quiet = Raw(d.socket)
    reply = quiet.call(1, "hello", {"version": 1, "role": "client"})
    assert reply["result"]["lease_s"] == 0.5
    assert quiet.call(2, "register", {"job": "quiet", "group": "g", "pids": []})["ok"]
    assert quiet.call(3, "acquire", {})["ok"]  # holds, then never speaks again
    b = shell.client(d.socket, "b")
    started = time.monotonic()
    assert b.acquire(timeout=10).job == "b"
    assert time.monotonic() - started >= 0.4
    closing = quiet.recv()
    assert (
        closing is not None and closing["error"]["code"] == "connection_lost" and "lease" in closing["error"]["message"]
    )
    assert quiet.closed()
    quiet.close()
    assert b.status()["counters"]["leases_expired"] == 1
    b.close()


@pytest.mark.slow
def test_a_client_that_heartbeats_keeps_its_lock(
    tmp_path: Path, stop_later: list[EmbeddedDaemon], shell: Shell
) -> None:
    d = start(tmp_path, lease=0.3)
    stop_later.append(d)
    a = shell.client(d.socket, "a")
    b = timesliced.Client(job="b", group="g", address=d.socket)
    a.acquire()
    with pytest.raises(errors.AcquireTimeout):
        b.acquire(timeout=1.2)  # four leases: a's heartbeats keep it
    assert group(a)["holder"] == "a"
    assert a.status()["counters"].get("leases_expired", 0) == 0
    a.close()
    b.close()
