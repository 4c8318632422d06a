"""A streamed unpark waiting for room ends when its connection goes, however the connection went.

The daemon relays room on the connection the unpark came on; once that connection is gone nobody can
grant more, so the wait must end (the job's regions stay parked, the directive fails and says why).
The connection may end at the daemon (its end is read) or be left by the client's core on bytes it
read or on a timer, here the daemon's closing error when the lease it announced expired: then the
socket is never read again, and only the core's ``Disconnect`` tells the shell.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

import timesliced
from timesliced import errors
from timesliced.client.directives import Rooms
from timesliced.client.session import ClientSession
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.daemon import serving

pytestmark = pytest.mark.slow

DIRECTIVE = 99


def wait_in_room(rooms: Rooms, connection: int) -> tuple[threading.Thread, list[str]]:
    """A streamed unpark's worker waiting for its next region's room; the list gets why the wait ended."""
    rooms.opened(connection, {"directive": DIRECTIVE, "room": {"0": 0}})  # what an ``offload`` unpark push does
    room = rooms.room(connection, DIRECTIVE)
    assert room is not None
    ended: list[str] = []

    def take() -> None:
        try:
            room.take(0, 1)
        except errors.BackendError as exc:
            ended.append(exc.message)

    t = threading.Thread(target=take, daemon=True)
    t.start()
    return t, ended


def end_connection(how: str, daemon: EmbeddedDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon stops, or (its pings silenced) the client's lease expires and the daemon closes with an error."""
    if how == "daemon_stops":
        daemon.stop()
        return
    send = ClientSession._send_untracked

    def quiet(self: ClientSession, op: str, args: dict[str, Any] | None, now: float) -> None:
        if op != "ping":
            send(self, op, args, now)

    monkeypatch.setattr(ClientSession, "_send_untracked", quiet)


@pytest.mark.parametrize("how", ["daemon_stops", "lease_expires"])
def test_a_sync_clients_room_ends_with_its_connection(how: str, tmp_path: Path, monkeypatch: Any) -> None:
    with serving(DaemonConfig(state_dir=tmp_path / "state", backend="sim", gpus=1, lease=1.0)) as daemon:
        client = timesliced.Client("a", "g", address=daemon.socket)
        try:
            client.connect()
            t, ended = wait_in_room(client._rooms, client._core.connection)
            end_connection(how, daemon, monkeypatch)
            t.join(10)
            if how == "lease_expires":
                assert daemon.daemon is not None and daemon.daemon.server.counters["leases_expired"] >= 1
            assert ended, "the streamed unpark still waits for room from a connection that is gone"
        finally:
            client.close()


@pytest.mark.parametrize("how", ["daemon_stops", "lease_expires"])
def test_an_async_clients_room_ends_with_its_connection(how: str, tmp_path: Path, monkeypatch: Any) -> None:
    with serving(DaemonConfig(state_dir=tmp_path / "state", backend="sim", gpus=1, lease=1.0)) as daemon:

        async def body() -> list[str]:
            client = timesliced.AsyncClient("a", "g", address=daemon.socket)
            try:
                await client.connect()
                t, ended = wait_in_room(client._rooms, client._core.connection)
                end_connection(how, daemon, monkeypatch)
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    if not t.is_alive():
                        break
                return ended
            finally:
                await client.close()

        assert asyncio.run(body()), "the streamed unpark still waits for room from a connection that is gone"
