"""Authentication and authorization pieces on their own: token proofs, token reading, process trees.

``checked_pids`` is tested with a non-root peer and real processes whatever user runs the
tests: as root, the processes are started as uid 1000 (the peer's user); otherwise as the
current user. The daemon end to end is in tests/integration/test_authz.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from timesliced import errors
from timesliced.cli import build_parser, config_from_args
from timesliced.client.protocol import auth_args
from timesliced.daemon.authz import checked_pids
from timesliced.daemon.server import Peer
from timesliced.dashboard import admin, make_app
from timesliced.env import PEER_TOKEN_ENV, TOKEN_ENV, TOKEN_FILE_ENV, read_token
from timesliced.util.processes import descends_from, owner_uid
from timesliced.wire.proof import Purpose, new_challenge, proof_matches, prove

TOKEN = "a-token-of-the-deployment-0f3c9e"
OTHER_USER = 1000  # the peer's user when the tests run as root
NOT_A_PID = (1 << 22) + 12345


@pytest.fixture(autouse=True)
def no_token_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (TOKEN_ENV, TOKEN_FILE_ENV, PEER_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)


# --- the token proof ----------------------------------------------------------------------


def client_proof(token: str, challenge: str) -> str:
    """What a TCP client sends: the hex proof of the hex challenge of the daemon's hello."""
    return prove(token, Purpose.CLIENT, bytes.fromhex(challenge)).hex()


def test_a_proof_answers_one_challenge_with_one_token() -> None:
    challenge = new_challenge()
    assert len(challenge) == 32
    assert new_challenge() != challenge  # fresh per connection
    proof = prove(TOKEN, Purpose.CLIENT, challenge)
    assert proof == prove(TOKEN, Purpose.CLIENT, challenge) and len(proof) == 32
    assert TOKEN.encode() not in proof
    assert proof_matches(TOKEN, Purpose.CLIENT, challenge, proof)
    assert proof_matches(TOKEN, Purpose.CLIENT, challenge, proof.hex())  # as a client sends it
    assert not proof_matches(TOKEN, Purpose.CLIENT, new_challenge(), proof)  # good for its challenge only
    assert not proof_matches(TOKEN + "x", Purpose.CLIENT, challenge, proof)
    for wrong in (proof.hex().upper() + "0", proof[:-1], "", "é" * 64, "not hex", None, 7, [proof]):
        assert not proof_matches(TOKEN, Purpose.CLIENT, challenge, wrong), wrong


def test_a_proof_is_good_for_its_purpose_and_its_ends_only() -> None:
    challenge = new_challenge()
    hello = prove(TOKEN, Purpose.PEER_HELLO, challenge, "a", "b")
    for purpose in (Purpose.CLIENT, Purpose.PEER_WELCOME):
        assert not proof_matches(TOKEN, purpose, challenge, hello, "a", "b")
    assert not proof_matches(TOKEN, Purpose.PEER_HELLO, challenge, hello, "b", "a")
    assert not proof_matches(TOKEN, Purpose.PEER_HELLO, challenge, hello, "a", "")
    assert prove(TOKEN, Purpose.PEER_HELLO, challenge, "ab", "c") != prove(
        TOKEN, Purpose.PEER_HELLO, challenge, "a", "bc"
    )


def test_auth_args_answer_only_a_challenge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    challenge = new_challenge().hex()  # as the daemon's hello carries it
    assert auth_args({"version": 1, "session": 3}, None) is None  # a Unix socket: no challenge, no token needed
    assert auth_args({"challenge": challenge}, TOKEN) == {"proof": client_proof(TOKEN, challenge)}
    with pytest.raises(errors.PermissionDenied, match=r"pass token= or set \$TIMESLICED_TOKEN"):
        auth_args({"challenge": challenge}, None)
    with pytest.raises(errors.ProtocolError, match="malformed challenge"):
        auth_args({"challenge": "zz"}, TOKEN)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert auth_args({"challenge": challenge}, None) == {"proof": client_proof(TOKEN, challenge)}
    assert auth_args({"challenge": challenge}, "x" * 20) == {
        "proof": client_proof("x" * 20, challenge)
    }  # explicit wins
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(errors.PermissionDenied, match="at least 16 characters") as info:
        auth_args({"challenge": challenge}, None)
    assert "short" not in info.value.message.replace("$TIMESLICED_TOKEN", "")
    monkeypatch.delenv(TOKEN_ENV)
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    assert auth_args({"challenge": challenge}, None) == {"proof": client_proof(TOKEN, challenge)}
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(errors.PermissionDenied, match="cannot read the token file"):
        auth_args({"challenge": challenge}, None)


def test_read_token_sources_and_older_spellings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_token() is None
    monkeypatch.setenv(PEER_TOKEN_ENV, TOKEN)  # the older spelling still works
    assert read_token() == TOKEN
    monkeypatch.setenv(TOKEN_ENV, f" {TOKEN}\n")  # the same token under both names is fine
    assert read_token() == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "another-token-altogether")
    with pytest.raises(ValueError, match="different tokens") as info:
        read_token()
    assert TOKEN not in str(info.value) and "altogether" not in str(info.value)
    monkeypatch.delenv(PEER_TOKEN_ENV)
    assert read_token() == "another-token-altogether"
    path = tmp_path / "token"
    path.write_text(TOKEN)
    assert read_token(path) == TOKEN  # a file named on the command line comes first
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    assert read_token() == TOKEN  # then $TIMESLICED_TOKEN_FILE, before $TIMESLICED_TOKEN
    path.write_text("tooshort")
    with pytest.raises(ValueError, match="at least 16 characters") as info:
        read_token(path)
    assert "tooshort" not in str(info.value)
    with pytest.raises(ValueError, match="cannot read the token file"):
        read_token(tmp_path / "missing")


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_serve_listen_needs_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit, match=r"--listen .* --token-file PATH or set \$TIMESLICED_TOKEN"):
        config_from_args(serve_args("--listen", "127.0.0.1:0"))
    path = tmp_path / "token"
    path.write_text(TOKEN)
    for flag in ("--token-file", "--peer-token-file"):  # the older spelling names the same token
        config = config_from_args(serve_args("--listen", "127.0.0.1:0", flag, str(path)))
        assert config.token == TOKEN and config.shared_token() == TOKEN
        assert TOKEN not in repr(config)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert config_from_args(serve_args("--listen", "127.0.0.1:0")).token == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(SystemExit, match="at least 16 characters"):
        config_from_args(serve_args())


def test_a_cluster_takes_the_same_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    peers = "a=127.0.0.1:7801,b=127.0.0.1:7802"
    config = config_from_args(
        serve_args("--peers", peers, "--node-id", "a", "--listen", "127.0.0.1:0", "--token-file", str(path))
    )
    assert config.cluster is not None and config.cluster.token == config.token == TOKEN
    assert TOKEN not in repr(config) and TOKEN not in repr(config.cluster)
    with pytest.raises(SystemExit, match="a cluster needs a shared token"):
        config_from_args(serve_args("--peers", peers, "--node-id", "a"))


# --- whose processes a connection may register ------------------------------------------


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
    others = [pid for pid in (os.getpid(), os.getppid()) if owner_uid(pid) not in (None, user)]
    for pid in others:  # another user's process: the older check still says so first
        with pytest.raises(errors.PermissionDenied, match="belongs to another user"):
            checked_pids([pid], peer)
    with pytest.raises(errors.BadRequest, match="no process"):
        checked_pids([(1 << 22) - 1], peer)
    # root may register any process; over TCP the PIDs are another machine's and are ignored
    assert checked_pids([stranger], Peer("unix", pid=peer_pid, uid=0)) == {peer_pid, stranger}
    assert checked_pids([stranger], Peer("tcp")) == set()


# --- the dashboard's admin token ----------------------------------------------------------


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

    def ready(self) -> bool:
        return True


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
