"""Whose processes a connection may register, with real processes; the delay of wrong admin tokens.

``checked_pids`` is tested with a non-root peer and real processes whatever user runs the
tests: as root, the processes are started as uid 1000 (the peer's user); otherwise as the
current user.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from timesliced import errors
from timesliced.daemon.authz import checked_pids
from timesliced.daemon.server import Peer
from timesliced.dashboard import admin, make_app
from timesliced.util.processes import descends_from, owner_uid

TOKEN = "a-token-of-the-deployment-0f3c9e"
OTHER_USER = 1000  # the peer's user when the tests run as root
NOT_A_PID = (1 << 22) + 12345


@pytest.fixture
def tree() -> Iterator[tuple[int, int, int, int]]:
    """(user, peer, its child, a stranger's sleep): real processes of one non-root user.

    The peer is a shell with a sleeping child; the stranger is a sleep of the same user that
    does not descend from the peer.
    """
    root = os.geteuid() == 0
    user = OTHER_USER if root else os.getuid()
    as_user: dict[str, Any] = {"user": user, "group": user, "extra_groups": []} if root else {}
    peer = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True, cwd="/", **as_user
    )
    stranger = subprocess.Popen(["sleep", "60"], cwd="/", **as_user)
    pids = [stranger.pid, peer.pid]
    try:
        assert peer.stdout is not None
        child = int(peer.stdout.readline())
        pids.insert(0, child)
        deadline = time.monotonic() + 10
        while owner_uid(child) != user or owner_uid(stranger.pid) != user:  # exec'd and set up
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield user, peer.pid, child, stranger.pid
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in (peer, stranger):
            proc.wait(timeout=30)
        if peer.stdout is not None:
            peer.stdout.close()


def test_descends_from_follows_parents(tree: tuple[int, int, int, int]) -> None:
    _, peer, child, stranger = tree
    assert descends_from(child, peer)
    assert descends_from(child, os.getpid()) and descends_from(peer, os.getpid())
    assert not descends_from(peer, child)
    assert not descends_from(stranger, peer)
    assert not descends_from(peer, peer)
    assert not descends_from(NOT_A_PID, peer)


def test_a_non_root_peer_registers_only_its_own_process_tree(tree: tuple[int, int, int, int]) -> None:
    user, peer_pid, child, stranger = tree
    peer = Peer("unix", pid=peer_pid, uid=user)
    assert checked_pids([peer_pid], peer) == {peer_pid}
    assert checked_pids([peer_pid, child], peer) == {peer_pid, child}
    with pytest.raises(errors.PermissionDenied, match=f"process {stranger} is not a descendant of .* {peer_pid}"):
        checked_pids([stranger], peer)
    with pytest.raises(errors.PermissionDenied, match="not a descendant"):
        checked_pids([peer_pid, child, stranger], peer)  # one process too many refuses the lot
    others = [pid for pid in (os.getpid(), os.getppid()) if pid > 1 and owner_uid(pid) not in (None, user)]
    for pid in others:  # another user's process: the older check still says so first
        with pytest.raises(errors.PermissionDenied, match="belongs to another user"):
            checked_pids([pid], peer)
    with pytest.raises(errors.BadRequest, match="no process"):
        checked_pids([(1 << 22) - 1], peer)
    # root may register any process; over TCP the PIDs are another machine's and are ignored
    assert checked_pids([stranger], Peer("unix", pid=peer_pid, uid=0)) == {peer_pid, stranger}
    assert checked_pids([stranger], Peer("tcp")) == set()


class _Source:
    def status(self) -> dict[str, Any]:
        return {}

    def timeline(self, window_s: float) -> dict[str, Any]:
        return {}

    def events(self, after: int, limit: int) -> list[dict[str, Any]]:
        return []

    def force_release(self, group: str) -> dict[str, Any]:
        return {"group": group, "released": "a"}

    def drain(self, group: str, on: bool) -> dict[str, Any]:
        return {"group": group, "draining": on}

    def resume(self, group: str) -> dict[str, Any]:
        return {"group": group, "draining": False, "resumed": [], "still_faulted": {}}

    def resume_job(self, job: str) -> dict[str, Any]:
        return {"job": job}

    def ready(self) -> bool:
        return True


@pytest.mark.slow
def test_wrong_admin_tokens_are_answered_one_at_a_time_after_a_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "WRONG_TOKEN_DELAY_S", 0.3)

    async def main() -> None:
        async with TestClient(TestServer(make_app(_Source(), admin_token=TOKEN))) as client:

            async def post(token: str) -> tuple[int, float]:
                response = await client.post("/api/v1/groups/g/release", headers={"Authorization": f"Bearer {token}"})
                return response.status, time.monotonic()

            start = time.monotonic()
            wrong = [asyncio.ensure_future(post("wrong-token-0123456789")) for _ in range(2)]
            await asyncio.sleep(0.05)  # both guesses are waiting
            right = asyncio.ensure_future(post(TOKEN))
            done, _ = await asyncio.wait([right, *wrong], return_when=asyncio.FIRST_COMPLETED)
            assert right in done, "the right token waited behind wrong ones"
            assert right.result()[0] == 200
            results = [await w for w in wrong]
            assert [status for status, _ in results] == [403, 403]
            assert max(t for _, t in results) - start >= 2 * 0.3  # served one after the other
            response = await client.get("/api/v1/admin", headers={"Authorization": "Bearer wrong-token-0123456789"})
            assert (await response.json())["authorized"] is False  # the state endpoint is no faster oracle
            assert time.monotonic() - start >= 3 * 0.3

    asyncio.run(main())
