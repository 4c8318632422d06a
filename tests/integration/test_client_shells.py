"""What both client shells must do whatever the connection is doing: follow the latest lease, keep acquire
timeouts, name a stale socket, and still wait for a daemon that really restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import timesliced
from timesliced import errors
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.env import default_sim_dir

from ..helpers.client_shells import SHELLS, Shell, shell_of, stale_socket
from ..helpers.processes import wait_for

MiB = 1 << 20
MARGIN_S = 2.0  # what "within T" allows on a loaded machine: T plus this


@pytest.fixture(params=SHELLS)
def shell(request: pytest.FixtureRequest) -> Iterator[Shell]:
    with shell_of(request.param) as made:
        yield made


@pytest.fixture
def config(tmp_path: Path) -> Iterator[DaemonConfig]:
    state = tmp_path / "state"
    yield DaemonConfig(state_dir=state, backend="sim", gpus=1, gpu_memory=8 * MiB, bandwidth=0)
    shutil.rmtree(default_sim_dir(state), ignore_errors=True)


@pytest.fixture
def socket_path(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "timesliced.sock")


class Elapsed:
    def __enter__(self) -> Elapsed:
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self.started


# --- the lease ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_lease_announced_after_a_reconnect_is_followed(config: DaemonConfig, shell: Shell) -> None:
    """A daemon restarted with a short lease keeps a reconnected client: it heartbeats at the new lease."""
    d = EmbeddedDaemon(config).start()  # the default lease of 30 s: a heartbeat every 10 s
    c = shell.client(d.socket, "a", connect=True)
    try:
        c.acquire()
        d.stop()
        d = EmbeddedDaemon(dataclasses.replace(config, lease=0.6)).start()
        c.ping()  # waits for the reconnection
        assert c.reconnects == 1 and c.lock.holding
        time.sleep(2.4)  # four leases of silence from the test's side
        counters = c.status()["counters"]
        assert counters.get("leases_expired", 0) == 0 and c.reconnects == 1
        (group,) = c.status()["groups"]
        assert group["holder"] == "a"  # never dropped, so never lost its hold
    finally:
        c.close()
        d.stop()


# --- acquire(timeout=T) raises within T, whatever the connection does -----------------------------------


@pytest.mark.slow
def test_an_acquire_with_a_timeout_raises_in_time_while_the_client_reconnects(
    config: DaemonConfig, shell: Shell
) -> None:
    d = EmbeddedDaemon(config).start()
    c = shell.client(d.socket, "a", connect=True)  # reconnect: the default 60 s
    d.stop()
    stale_socket(d.socket)  # as if it had been killed
    with Elapsed() as took, pytest.raises(errors.AcquireTimeout, match="reconnecting") as info:
        c.acquire(timeout=1.0)
    assert took.seconds < 1.0 + MARGIN_S
    assert "nothing listens" in str(info.value)
    d = EmbeddedDaemon(config).start()  # the reconnection went on meanwhile
    try:
        assert c.acquire(timeout=10).job == "a" and c.reconnects == 1
    finally:
        c.close()
        d.stop()


@pytest.mark.slow
def test_an_acquire_with_a_timeout_raises_in_time_when_the_daemon_never_answers(socket_path: str, shell: Shell) -> None:
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listens, never accepts: connecting works
    Path(socket_path).parent.mkdir(parents=True)
    mute.bind(socket_path)
    mute.listen(8)
    try:
        c = shell.client(socket_path, "a")
        with Elapsed() as took, pytest.raises(errors.ConnectionLost, match="has not answered 'hello'"):
            c.acquire(timeout=1.0)
        assert took.seconds < 1.0 + MARGIN_S
    finally:
        mute.close()


# --- a socket file with nothing listening ------------------------------------------------------------------


@pytest.mark.slow
def test_a_stale_socket_fails_a_new_client_within_its_acquire_timeout(socket_path: str, shell: Shell) -> None:
    stale_socket(socket_path)
    c = shell.client(socket_path, "a")  # reconnect: the default 60 s
    with Elapsed() as took, pytest.raises(errors.ConnectionLost) as info:
        c.acquire(timeout=1.5)
    assert took.seconds < 1.5 + MARGIN_S
    message = str(info.value)
    assert f"the socket {socket_path} exists but nothing listens on it (a daemon that died?)" in message
    assert f"start the daemon, or remove the stale socket file {socket_path}" in message


@pytest.mark.slow
def test_a_stale_socket_fails_a_new_client_within_reconnect(socket_path: str, shell: Shell) -> None:
    stale_socket(socket_path)
    c = shell.client(socket_path, "a", reconnect=1.0)
    with Elapsed() as took, pytest.raises(errors.ConnectionLost, match=r"within 1s: the socket .* exists but nothing"):
        c.connect()
    assert took.seconds < 1.0 + MARGIN_S
    with pytest.raises(errors.ConnectionLost, match="remove the stale socket file"):
        c.status()  # a later call tries afresh, and fails the same way


@pytest.mark.slow
def test_a_daemon_that_really_restarts_within_reconnect_is_waited_for(config: DaemonConfig, shell: Shell) -> None:
    stale_socket(config.resolved_socket())  # the daemon was killed; it comes back a second later
    started: list[EmbeddedDaemon] = []
    restarting = threading.Timer(1.0, lambda: started.append(EmbeddedDaemon(config).start()))
    restarting.start()
    try:
        c = shell.client(str(config.resolved_socket()), "a")
        with Elapsed() as took:
            grant = c.acquire(timeout=20)
        assert grant.job == "a" and took.seconds >= 0.9
        wait_for(lambda: bool(started))
        c.release()
    finally:
        restarting.join()
        for d in started:
            d.stop()


@pytest.mark.slow
def test_an_async_client_that_keeps_trying_leaves_its_event_loop_free(socket_path: str) -> None:
    """Refused attempts fail without ever suspending; the supervisor must still yield between them."""
    stale_socket(socket_path)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        c = timesliced.AsyncClient(job="a", group="g", address=socket_path, reconnect=1.5)
        connecting = asyncio.ensure_future(c.connect())
        gaps, last = [], loop.time()
        while not connecting.done():
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - last)
            last = loop.time()
        with pytest.raises(errors.ConnectionLost, match="nothing listens"):
            await connecting
        assert len(gaps) > 20 and max(gaps) < 0.5
        await c.close()

    asyncio.run(scenario())
