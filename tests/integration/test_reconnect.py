"""Clients ride out a daemon restart: they reconnect, the holder gets the lock back first, waiters keep waiting."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import timesliced
from timesliced.client.sync import daemon_status
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.daemon.journal import Journal
from timesliced.env import default_sim_dir

from ..helpers.client_shells import SHELLS, Shell, shell_of
from ..helpers.processes import wait_for

MiB = 1 << 20


@pytest.fixture
def config(tmp_path: Path) -> Iterator[DaemonConfig]:
    state = tmp_path / "state"
    yield DaemonConfig(state_dir=state, backend="sim", gpus=1, gpu_memory=8 * MiB, bandwidth=0)
    shutil.rmtree(default_sim_dir(state), ignore_errors=True)


@pytest.fixture(params=SHELLS)
def shell(request: pytest.FixtureRequest) -> Iterator[Shell]:
    with shell_of(request.param) as made:
        yield made


def restart(old: EmbeddedDaemon, config: DaemonConfig) -> EmbeddedDaemon:
    old.stop()
    return EmbeddedDaemon(config).start()


def test_holder_gets_the_lock_back_first_and_the_waiter_keeps_waiting(config: DaemonConfig, shell: Shell) -> None:
    d = EmbeddedDaemon(config).start()
    a = shell.client(d.socket, "a")
    b = shell.client(d.socket, "b")
    try:
        a.acquire()
        region = a.sim_alloc(6 * MiB)
        region.fill(b"before the restart")
        expected = region.checksum()
        order: list[str] = []
        waiter = threading.Thread(target=lambda: (b.acquire(timeout=30), order.append("b granted")))
        waiter.start()
        wait_for(lambda: [w["job"] for w in a.status()["groups"][0]["queue"]] == ["b"])
        d = restart(d, config)
        assert region.checksum() == expected  # the holder's bytes stayed resident through the restart
        order.append("a releases")
        a.release()  # waits for the reconnection, which takes the lock back first
        waiter.join(30)
        assert order == ["a releases", "b granted"]
        assert a.reconnects == 1 and b.reconnects == 1
        (group,) = b.status()["groups"]
        assert group["holder"] == "b"
        b.sim_alloc(6 * MiB)  # room for it: a is parked
        b.release()
        assert a.acquire(timeout=10).restored  # a was parked for b: its bytes come back
        assert region.checksum() == expected
        a.release()
    finally:
        a.close()
        b.close()
        d.stop()


def test_requests_made_while_reconnecting_wait_and_keep_their_order(config: DaemonConfig, shell: Shell) -> None:
    d = EmbeddedDaemon(config).start()
    c = shell.client(d.socket, "a", connect=True)
    try:
        c.acquire()
        d.stop()
        results: list[str] = []
        restarting = threading.Thread(target=lambda: results.append(str(c.release()["group"])))
        restarting.start()  # made while the daemon is gone
        time.sleep(0.3)
        d = EmbeddedDaemon(config).start()
        restarting.join(30)
        assert results == ["g"] and c.reconnects == 1 and not c.lock.holding
        (group,) = c.status()["groups"]
        assert group["holder"] is None
    finally:
        c.close()
        d.stop()


def test_without_reconnect_a_lost_daemon_is_an_error(config: DaemonConfig, shell: Shell) -> None:
    d = EmbeddedDaemon(config).start()
    a = shell.client(d.socket, "a", reconnect=0)
    a.acquire()
    d.stop()
    with pytest.raises(timesliced.errors.ConnectionLost):
        a.release()
    with pytest.raises(timesliced.errors.ConnectionLost):
        a.status()  # lost until closed
    a.close()


def test_simulated_state_that_no_journaled_job_owns_is_reclaimed(config: DaemonConfig) -> None:
    d = EmbeddedDaemon(config).start()
    c = timesliced.Client(job="x", group="g", address=d.socket, reconnect=0)
    c.acquire()
    c.sim_alloc(MiB)
    c.release()
    d.stop()
    c.close()
    # As if the last run died while reclaiming x: its journal no longer lists it.
    journal = Journal(config.state_dir)
    assert journal.load() is not None
    journal.save({"jobs": [], "turns": {}, "fences": {}, "park": {}})
    journal.close()
    d = EmbeddedDaemon(config).start()
    try:
        assert daemon_status(d.socket)["jobs"] == []
        assert not list((config.resolved_sim_dir() / "jobs").glob("*.ctl"))
    finally:
        d.stop()
