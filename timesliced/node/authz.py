"""Who may do what: the token proof of TCP clients, and the processes a connection may register.

A Unix-socket client is trusted as far as the kernel vouches for it: the socket's
file mode decides who may connect, and SO_PEERCRED says which process and user
did. A TCP client proves the deployment's shared token instead: the daemon's
hello reply carries a fresh random challenge, and the client answers with an
HMAC-SHA256 of it keyed by the token, so the token never crosses the wire and a
proof is good for one connection only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from .. import errors
from .processes import PID_MAX, descends_from, owner_uid

CHALLENGE_BYTES = 32
# Keeps a client's proof from ever passing for any other MAC keyed by the same token (the peers' handshake).
PROOF_DOMAIN = b"timesliced client auth v1\0"


def new_challenge() -> str:
    """A fresh random challenge for one connection, as hex."""
    return secrets.token_hex(CHALLENGE_BYTES)


def client_proof(token: str, challenge: str) -> str:
    """The hex proof that answers ``challenge`` with ``token``; raises ``ValueError`` if it is not hex."""
    nonce = bytes.fromhex(challenge)
    return hmac.new(token.encode(), PROOF_DOMAIN + nonce, hashlib.sha256).hexdigest()


def proof_matches(token: str, challenge: str, proof: object) -> bool:
    """Whether ``proof`` answers ``challenge`` for ``token`` (compared in constant time)."""
    if not isinstance(proof, str):
        return False
    return hmac.compare_digest(client_proof(token, challenge).encode(), proof.encode("utf-8", "replace"))


def checked_pids(claimed: list[int], peer: Any) -> set[int]:
    """The PIDs a connection may register for its job; raises ``BadRequest`` / ``PermissionDenied``.

    The kernel's word (SO_PEERCRED) is always in. Any other PID must exist, belong
    to the peer's user and descend from the peer's process: a client registers its
    own process tree, so it can never have the daemon park (or follow) another
    program's memory. Root may register any process. Over TCP the PIDs would be
    another machine's: the job is followed through its connections alone.
    """
    if peer.pid is None:
        return set()
    pids = {peer.pid}
    for pid in sorted(set(claimed) - pids):
        if not 2 <= pid <= PID_MAX:
            raise errors.BadRequest(f"PID {pid} is not a process id")
        owner = owner_uid(pid)
        if owner is None:
            raise errors.BadRequest(f"no process {pid} on this node")
        if peer.uid != 0:
            if peer.uid != owner:
                raise errors.PermissionDenied(f"process {pid} belongs to another user")
            if not descends_from(pid, peer.pid):
                raise errors.PermissionDenied(
                    f"process {pid} is not a descendant of the connecting process {peer.pid}: "
                    "a client may register only its own process tree (root may register any process)"
                )
        pids.add(pid)
    return pids
