"""The one way the deployment's shared token is proved, by TCP clients and by peers alike (pure).

The side that is asked sends a fresh random challenge (``CHALLENGE_BYTES`` from ``secrets``, drawn by
the shell: this module keeps no source of randomness); the other answers with an HMAC-SHA256
keyed by the token over a purpose, the challenge and the names it binds (both ends of a peer
link). The token never crosses the wire, a proof is good for one challenge only, and the purpose
keeps a proof made for one step (a client's ``auth``, a peer's hello, a peer's welcome) from ever
passing for another.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct

CHALLENGE_BYTES = 32


class Purpose(enum.Enum):
    """What a proof is for; its value is the MAC's domain separator."""

    CLIENT = b"timesliced client auth v1\0"  # a TCP client's ``auth`` answering the daemon's hello
    PEER_HELLO = b"timesliced peer hello v2\0"  # a dialing peer answering the accepter's challenge
    PEER_WELCOME = b"timesliced peer welcome v2\0"  # the accepter answering the dialer's own nonce


def prove(token: str | bytes, purpose: Purpose, challenge: bytes, *bound: str) -> bytes:
    """The proof that answers ``challenge`` with ``token``, bound to ``bound`` (each name length-prefixed)."""
    key = token.encode() if isinstance(token, str) else token
    names = b"".join(struct.pack(">H", len(b)) + b for b in (name.encode() for name in bound))
    return hmac.new(key, purpose.value + challenge + names, hashlib.sha256).digest()


def proof_matches(token: str | bytes, purpose: Purpose, challenge: bytes, proof: object, *bound: str) -> bool:
    """Whether ``proof`` (bytes, or their hex as a client sends them) answers ``challenge``; constant time."""
    if isinstance(proof, str):
        try:
            proof = bytes.fromhex(proof)
        except ValueError:
            return False
    if not isinstance(proof, bytes):
        return False
    return hmac.compare_digest(prove(token, purpose, challenge, *bound), proof)
