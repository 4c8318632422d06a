"""The client's protocol core, shared by ``Client`` and ``AsyncClient`` (pure).

It numbers requests, frames them, decodes what the daemon sends and turns
replies into results or typed exceptions. The two shells only move bytes and
wait.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors
from ..env import TOKEN_ENV, default_socket_path, read_token
from ..util.parse import parse_host_port
from ..wire.codec import DEFAULT_MAX_FRAME, FrameDecoder, encode
from ..wire.messages import PROTOCOL_VERSION, Push, Reply, Request, parse_incoming
from ..wire.park import METHODS, ParkSpec
from ..wire.proof import Purpose, prove

log = logging.getLogger(__name__)


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
        except (KeyError, TypeError, ValueError):
            raise errors.ProtocolError(f"malformed grant from daemon: {result!r}") from None


@dataclass(frozen=True)
class Address:
    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return self.path if self.kind == "unix" else f"{self.host}:{self.port}"


def resolve_address(address: str | os.PathLike[str] | None) -> Address:
    """``None`` -> the local daemon's socket; ``"tcp://h:p"`` or ``"h:p"`` -> TCP; else a socket path."""
    if address is None:
        return Address("unix", path=str(default_socket_path()))
    text = os.fspath(address)
    if text.startswith("tcp://"):
        host, port = parse_host_port(text[len("tcp://") :])
        return Address("tcp", host=host, port=port)
    if not text.startswith(("/", ".")) and ":" in text and not Path(text).exists():
        host, port = parse_host_port(text)
        return Address("tcp", host=host, port=port)
    return Address("unix", path=text)


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

    def request(self, op: str, args: dict[str, Any] | None = None) -> tuple[int, bytes]:
        rid = self._next_id
        self._next_id += 1
        return rid, self.frame(rid, op, args)

    def frame(self, rid: int, op: str, args: dict[str, Any] | None = None) -> bytes:
        return encode(Request(rid, op, args or {}).to_wire(), self._max_frame)

    def receive(self, data: bytes) -> list[Reply | Push]:
        """Decode ``data``; raises ``ProtocolError`` if the daemon broke the protocol.

        A reply without an id is the daemon closing the connection with an
        error; it is raised as that error.
        """
        out: list[Reply | Push] = []
        for message in self._decoder.feed(data):
            if "push" not in message and message.get("id") is None and message.get("ok") is False:
                raise errors.from_wire(message.get("error"))
            out.append(parse_incoming(message))
        return out


@dataclass
class LockState:
    """What a client knows of its hold on the lock, from its own calls and the daemon's pushes."""

    job: str
    holding: bool = False  # granted and not released: a reconnection asks for the lock back first
    preempted: str | None = None  # why, while it waits to be granted again after a preemption
    faulted: str | None = None

    def on_push(self, event: str, data: dict[str, Any]) -> None:
        if event == "faulted":
            self.faulted = str(data.get("reason", "faulted"))
        elif event == "preempted":
            self.preempted = str(data.get("reason", "preempted"))
            log.warning("job %r: %s", self.job, self.preempted)
        elif event == "granted":
            self.preempted = None
        elif event == "lock_lost":
            self.holding, self.preempted = False, None
        elif event == "slice_overdue":
            log.warning("job %r: %s", self.job, data.get("reason", "its slice is over"))

    def granted(self) -> None:
        self.holding = True

    def released(self) -> None:
        self.holding, self.preempted = False, None


def lease_of(hello: dict[str, Any]) -> float | None:
    """The heartbeat lease the daemon announced in its hello, if any."""
    lease = hello.get("lease_s")
    return float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0 else None


def hello_args() -> dict[str, Any]:
    return {"version": PROTOCOL_VERSION, "role": "client", "pid": os.getpid(), "program": Path(sys.argv[0]).name}


def auth_args(hello: Any, token: str | None) -> dict[str, Any] | None:
    """The args of the ``auth`` request that answers the daemon's ``hello`` reply; None if it set no challenge.

    Over TCP the daemon challenges every connection; the proof is made with
    ``token``, else the token of ``$TIMESLICED_TOKEN_FILE`` / ``$TIMESLICED_TOKEN``
    (read only when asked for). Raises ``PermissionDenied`` when there is none,
    before anything is sent, and ``ProtocolError`` for a malformed challenge.
    """
    challenge = hello.get("challenge") if isinstance(hello, dict) else None
    if challenge is None:
        return None
    if token is None:
        try:
            token = read_token()
        except ValueError as exc:
            raise errors.PermissionDenied(f"the daemon asks for the shared token: {exc}") from None
    if not token:
        raise errors.PermissionDenied(f"the daemon asks for the shared token over TCP: pass token= or set ${TOKEN_ENV}")
    try:
        return {"proof": prove(token, Purpose.CLIENT, bytes.fromhex(str(challenge))).hex()}
    except ValueError:
        raise errors.ProtocolError("the daemon sent a malformed challenge") from None


def register_args(
    job: str, group: str, gpus: list[int] | None, pids: list[int] | None, park: str | ParkSpec | None = None
) -> dict[str, Any]:
    if not isinstance(job, str) or not job or not isinstance(group, str) or not group:
        raise ValueError("job and group must be non-empty strings")
    args: dict[str, Any] = {"job": job, "group": group, "gpus": gpus, "pids": sorted({os.getpid(), *(pids or [])})}
    if park is not None:
        spec = ParkSpec(park) if isinstance(park, str) else park
        if spec.method not in METHODS:
            raise ValueError(f"unknown parking method {spec.method!r} (known: {', '.join(METHODS)})")
        args["park"] = spec.to_wire()
    return args


def acquire_args(timeout: float | None) -> dict[str, Any]:
    if timeout is not None and not timeout >= 0:
        raise ValueError("timeout must be >= 0 or None")
    return {"timeout": timeout}


def result_of(reply: Reply) -> Any:
    if reply.ok:
        return reply.result
    assert reply.error is not None
    raise reply.error
