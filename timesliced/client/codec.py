"""What a client reads and writes on the wire (pure): request numbering, frames, replies, grants.

``ClientProtocol`` numbers requests and decodes the daemon's stream;
``ClientSession`` (``session.py``) and ``daemon_status`` stand on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import errors
from ..wire.codec import DEFAULT_MAX_FRAME, FrameDecoder, encode
from ..wire.messages import Push, Reply, Request, parse_incoming
from ..wire.proof import Purpose, prove


@dataclass(frozen=True)
class Grant:
    """What an acquire returns: the lock is held until ``release()``."""

    group: str
    job: str
    fence: int  # grows with every grant of the group
    waited_s: float  # time spent in the queue
    switch_s: float  # time spent parking others and restoring this job
    restored: bool  # False: the job's state was still on the GPU, nothing moved
    term: int = 0  # the leader's election term: (term, fence) grows with every grant, across leaders

    @classmethod
    def from_wire(cls, result: Any) -> Grant:
        try:
            return cls(
                str(result["group"]),
                str(result["job"]),
                int(result["fence"]),
                float(result["waited_s"]),
                float(result["switch_s"]),
                bool(result["restored"]),
                int(result.get("term", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise errors.ProtocolError(f"malformed grant from daemon: {result!r}") from None


class ClientProtocol:
    """Request numbering and frame decoding for one client.

    Request ids keep growing across connections (``new_connection``), so a request
    re-sent after a reconnection keeps its id and its waiter.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._decoder = FrameDecoder(max_frame)
        self._max_frame = max_frame
        self._next_id = 1

    def new_connection(self) -> None:
        """Start decoding a new connection's stream."""
        self._decoder = FrameDecoder(self._max_frame)

    def peek_id(self) -> int:
        """The id the next request gets."""
        return self._next_id

    def next_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def request(self, op: str, args: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """A new request's id and frame; raises ``FrameTooLarge`` (and then uses up no id)."""
        frame = self.frame(self._next_id, op, args)
        return self.next_id(), frame

    def frame(self, rid: int, op: str, args: dict[str, Any] | None = None) -> bytes:
        """Raises ``FrameTooLarge``."""
        return encode(Request(rid, op, args or {}).to_wire(), self._max_frame)

    def receive(self, data: bytes) -> list[Reply | Push]:
        """Decode ``data``; raises ``ProtocolError`` if the daemon broke the protocol.

        A reply without an id is the daemon closing the connection with an
        error; it is raised as that error.
        """
        out: list[Reply | Push] = []
        for message in self._decoder.feed(data):
            out.append(incoming(message))
        return out

    def receive_until_error(self, data: bytes) -> tuple[list[Reply | Push], errors.TimeslicedError | None]:
        """Like ``receive``, but the messages before the error come back with it (never raises)."""
        messages, error = self._decoder.feed_until_error(data)
        out: list[Reply | Push] = []
        for message in messages:
            try:
                out.append(incoming(message))
            except errors.TimeslicedError as exc:
                return out, exc
        return out, error


def incoming(message: dict[str, Any]) -> Reply | Push:
    """One decoded map from the daemon; a closing error (a reply without an id) is raised as its error."""
    if "push" not in message and message.get("id") is None and message.get("ok") is False:
        raise errors.from_wire(message.get("error"))
    return parse_incoming(message)


def lease_of(hello: Any) -> float | None:
    """The heartbeat lease the daemon announced in its hello, if any."""
    lease = hello.get("lease_s") if isinstance(hello, dict) else None
    return float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0 else None


MAX_GANG = 64  # members of one gang (the daemon refuses more)


def acquire_args(timeout: float | None, gang: str | None = None, members: int = 0) -> dict[str, Any]:
    """Raises ``ValueError`` for a negative timeout, or a gang without an id or a size of 1 to 64."""
    if timeout is not None and not timeout >= 0:
        raise ValueError("timeout must be >= 0 or None")
    if gang is None:
        if members:
            raise ValueError("members is a gang's size: give the gang's id too")
        return {"timeout": timeout}
    if not isinstance(gang, str) or not 0 < len(gang) <= 256:
        raise ValueError("gang must be a non-empty string of at most 256 characters, the same for every member")
    if not isinstance(members, int) or isinstance(members, bool) or not 1 <= members <= MAX_GANG:
        raise ValueError(f"members must be the gang's size, 1 to {MAX_GANG}")
    return {"timeout": timeout, "gang": gang, "members": members}


def result_of(reply: Reply) -> Any:
    if reply.ok:
        return reply.result
    assert reply.error is not None
    raise reply.error


def auth_args(hello: Any, token: str | errors.PermissionDenied) -> dict[str, Any] | None:
    """The args of the ``auth`` request that answers the daemon's ``hello`` reply; None if it set no challenge.

    Over TCP the daemon challenges every connection; the proof is made with ``token`` (see
    ``protocol.find_token``). Raises the ``PermissionDenied`` given in its place when there is no
    token, before anything is sent, and ``ProtocolError`` for a malformed challenge.
    """
    challenge = hello.get("challenge") if isinstance(hello, dict) else None
    if challenge is None:
        return None
    if isinstance(token, errors.PermissionDenied):
        raise token
    try:
        return {"proof": prove(token, Purpose.CLIENT, bytes.fromhex(str(challenge))).hex()}
    except ValueError:
        raise errors.ProtocolError("the daemon sent a malformed challenge") from None
