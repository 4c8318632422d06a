"""What both client shells take from the process and its environment: the address, the hello, the token.

The pure parts live in ``codec.py`` (requests, frames, grants, the token proof's args) and
``session.py`` (the connection's state machine, ``LockState``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors
from ..env import TOKEN_ENV, default_socket_path, read_token
from ..util.parse import parse_host_port
from ..wire.messages import PROTOCOL_VERSION
from ..wire.park import METHODS, ParkSpec
from .gpus import node_gpus
from .session import Unreachable

VISIBLE = "visible"  # gpus=: every GPU this process's CUDA sees


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


def hello_args() -> dict[str, Any]:
    return {"version": PROTOCOL_VERSION, "role": "client", "pid": os.getpid(), "program": Path(sys.argv[0]).name}


def find_token(explicit: str | None) -> str | errors.PermissionDenied:
    """The token a TCP client proves: ``explicit``, else ``$TIMESLICED_TOKEN_FILE`` / ``$TIMESLICED_TOKEN``.

    Never raises: what stands in the way is returned as the ``PermissionDenied`` to raise if a
    daemon does ask for the token (over a Unix socket none does, and none is needed).
    """
    if explicit is not None:
        return explicit
    try:
        token = read_token()
    except ValueError as exc:
        return errors.PermissionDenied(f"the daemon asks for the shared token: {exc}")
    if not token:
        return errors.PermissionDenied(
            f"the daemon asks for the shared token over TCP: pass token= or set ${TOKEN_ENV}"
        )
    return token


def register_args(
    job: str,
    group: str,
    gpus: list[int] | str | None,
    pids: list[int] | None,
    park: str | ParkSpec | None = None,
    *,
    priority: int = 0,
    weight: float = 1.0,
) -> dict[str, Any]:
    """The ``register`` request's args.

    ``priority`` (an integer, higher first) and ``weight`` (> 0, the job's share) are what its
    group's queue policy reads (``--policy``: ``priority``, ``fair``); the job's first
    registration fixes them. Raises ``ValueError`` for a weight that is not a positive number.

    ``gpus``: the node's GPU numbers (NVML indices, as ``nvidia-smi`` and
    ``timesliced status`` show them; the simulated GPU's own numbers), ``None``
    for the daemon's choice, or ``"visible"``: every GPU this process's CUDA
    sees (``CUDA_VISIBLE_DEVICES`` applied), named by UUID as the node names
    it (:func:`timesliced.client.gpus.node_gpus`; raises ``BackendUnavailable``
    where CUDA or NVML cannot be asked).
    """
    if not isinstance(job, str) or not job or not isinstance(group, str) or not group:
        raise ValueError("job and group must be non-empty strings")
    if isinstance(gpus, str):
        if gpus != VISIBLE:
            raise ValueError(f"gpus must be a list of the node's GPU numbers, None or {VISIBLE!r}, got {gpus!r}")
        gpus = node_gpus()
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, not {priority!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise ValueError(f"weight must be a positive number, not {weight!r}")
    args: dict[str, Any] = {"job": job, "group": group, "gpus": gpus, "pids": sorted({os.getpid(), *(pids or [])})}
    if priority or weight != 1.0:  # the defaults go unsaid: older daemons take the args as before
        args.update(priority=priority, weight=float(weight))
    if park is not None:
        spec = ParkSpec(park) if isinstance(park, str) else park
        if spec.method not in METHODS:
            raise ValueError(f"unknown parking method {spec.method!r} (known: {', '.join(METHODS)})")
        args["park"] = spec.to_wire()
    return args


def dial_failure(address: Address, exc: OSError) -> tuple[str, Unreachable]:
    """How an attempt to connect failed, for ``ClientSession.connection_failed``.

    A daemon that was killed leaves its socket file behind (one that stopped
    removes it), and connecting to it is refused.
    """
    reason = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else exc.__class__.__name__)
    if address.kind == "unix" and os.path.exists(address.path):
        return reason, Unreachable.STALE if isinstance(exc, ConnectionRefusedError) else Unreachable.BUSY
    return reason, Unreachable.ABSENT
