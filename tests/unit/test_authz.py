"""Authentication pieces on their own: token proofs, reading tokens, the serve options that need one.

Registering process trees (real processes) and the dashboard's delay for wrong admin tokens are in
tests/integration/test_process_authz.py; the daemon end to end in tests/integration/test_authz.py.
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

import pytest

from timesliced import errors
from timesliced.cli import build_parser, config_from_args
from timesliced.client.codec import auth_args
from timesliced.client.protocol import find_token
from timesliced.env import PEER_TOKEN_ENV, TOKEN_ENV, TOKEN_FILE_ENV, read_token
from timesliced.wire.proof import CHALLENGE_BYTES, Purpose, proof_matches, prove

TOKEN = "a-token-of-the-deployment-0f3c9e"


@pytest.fixture(autouse=True)
def no_token_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (TOKEN_ENV, TOKEN_FILE_ENV, PEER_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)


# --- the token proof ----------------------------------------------------------------------


def client_proof(token: str, challenge: str) -> str:
    """What a TCP client sends: the hex proof of the hex challenge of the daemon's hello."""
    return prove(token, Purpose.CLIENT, bytes.fromhex(challenge)).hex()


def test_a_proof_answers_one_challenge_with_one_token() -> None:
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    assert len(challenge) == 32
    assert secrets.token_bytes(CHALLENGE_BYTES) != challenge  # fresh per connection
    proof = prove(TOKEN, Purpose.CLIENT, challenge)
    assert proof == prove(TOKEN, Purpose.CLIENT, challenge) and len(proof) == 32
    assert TOKEN.encode() not in proof
    assert proof_matches(TOKEN, Purpose.CLIENT, challenge, proof)
    assert proof_matches(TOKEN, Purpose.CLIENT, challenge, proof.hex())  # as a client sends it
    assert not proof_matches(
        TOKEN, Purpose.CLIENT, secrets.token_bytes(CHALLENGE_BYTES), proof
    )  # good for its challenge only
    assert not proof_matches(TOKEN + "x", Purpose.CLIENT, challenge, proof)
    for wrong in (proof.hex().upper() + "0", proof[:-1], "", "é" * 64, "not hex", None, 7, [proof]):
        assert not proof_matches(TOKEN, Purpose.CLIENT, challenge, wrong), wrong


def test_a_proof_is_good_for_its_purpose_and_its_ends_only() -> None:
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    hello = prove(TOKEN, Purpose.PEER_HELLO, challenge, "a", "b")
    for purpose in (Purpose.CLIENT, Purpose.PEER_WELCOME):
        assert not proof_matches(TOKEN, purpose, challenge, hello, "a", "b")
    assert not proof_matches(TOKEN, Purpose.PEER_HELLO, challenge, hello, "b", "a")
    assert not proof_matches(TOKEN, Purpose.PEER_HELLO, challenge, hello, "a", "")
    assert prove(TOKEN, Purpose.PEER_HELLO, challenge, "ab", "c") != prove(
        TOKEN, Purpose.PEER_HELLO, challenge, "a", "bc"
    )


def test_auth_args_answer_only_a_challenge() -> None:
    challenge = secrets.token_hex(CHALLENGE_BYTES)  # as the daemon's hello carries it
    missing = errors.PermissionDenied("no token")
    assert auth_args({"version": 1, "session": 3}, missing) is None  # a Unix socket: no challenge, no token needed
    assert auth_args({"challenge": challenge}, TOKEN) == {"proof": client_proof(TOKEN, challenge)}
    with pytest.raises(errors.PermissionDenied, match="no token"):
        auth_args({"challenge": challenge}, missing)
    with pytest.raises(errors.ProtocolError, match="malformed challenge"):
        auth_args({"challenge": "zz"}, TOKEN)


def test_the_token_is_found_explicitly_or_in_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``find_token`` never raises: what stands in the way is the error a challenge then raises."""
    found = find_token(None)
    assert isinstance(found, errors.PermissionDenied) and "pass token= or set $TIMESLICED_TOKEN" in found.message
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert find_token(None) == TOKEN
    assert find_token("x" * 20) == "x" * 20  # explicit wins
    monkeypatch.setenv(TOKEN_ENV, "short")
    found = find_token(None)
    assert isinstance(found, errors.PermissionDenied) and "at least 16 characters" in found.message
    assert "short" not in found.message.replace("$TIMESLICED_TOKEN", "")
    monkeypatch.delenv(TOKEN_ENV)
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    assert find_token(None) == TOKEN
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    found = find_token(None)
    assert isinstance(found, errors.PermissionDenied) and "cannot read the token file" in found.message


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


# --- the dashboard's admin token ----------------------------------------------------------
