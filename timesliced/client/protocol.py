"""What both client shells take from the process and its environment: the address, the hello, the token.

The pure parts live in ``codec.py`` (requests, frames, grants, the token proof's args) and
``session.py`` (the connection's state machine, ``LockState``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import errors
from ..env import (
    ADDRESS_ENV,
    GPUS_ENV,
    GROUP_ENV,
    JOB_ENV,
    MEMORY_ENV,
    PARK_ENV,
    PARTY_ENV,
    PRIORITY_ENV,
    TOKEN_ENV,
    WEIGHT_ENV,
    default_socket_path,
    read_token,
)
from ..util.parse import parse_host_port, parse_size
from ..wire.messages import EVERY_GPU, MAX_PARTY, PROTOCOL_VERSION
from ..wire.park import METHODS, ParkSpec
from .gpus import node_gpus
from .session import Unreachable

N = TypeVar("N", int, float)

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
    """``None`` -> ``$TIMESLICED_ADDRESS``, else the local daemon's socket; ``"tcp://h:p"`` or ``"h:p"`` -> TCP;
    else a socket path. Raises ``ValueError`` for a TCP address without a port."""
    if address is None:
        named = os.environ.get(ADDRESS_ENV, "").strip()
        if not named:
            return Address("unix", path=str(default_socket_path()))
        try:
            return resolve_address(named)
        except ValueError as exc:
            raise ValueError(f"${ADDRESS_ENV}={named!r}: {exc}; give a socket path or tcp://HOST:PORT") from None
    text = os.fspath(address)
    if text.startswith("tcp://"):
        host, port = parse_host_port(text[len("tcp://") :])
        return Address("tcp", host=host, port=port)
    if not text.startswith(("/", ".")) and ":" in text and not Path(text).exists():
        host, port = parse_host_port(text)
        return Address("tcp", host=host, port=port)
    return Address("unix", path=text)


@dataclass(frozen=True)
class Member:
    """Who a client registers as: its arguments, with the environment filling what they leave out."""

    job: str
    group: str
    gpus: list[int] | str | None
    park: str | ParkSpec | None
    memory: int | str | Mapping[int, int | str] | None
    priority: int
    weight: float
    party: str  # who it acts for (``process_party`` unless named)


def member(
    job: str | None,
    group: str | None,
    *,
    gpus: list[int] | str | None,
    park: str | ParkSpec | None,
    memory: int | str | Mapping[int, int | str] | None,
    priority: int | None,
    weight: float | None,
    party: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Member:
    """The client's job, group and registration, each from its argument or else from the environment.

    ``timesliced run`` sets ``$TIMESLICED_JOB``, ``$TIMESLICED_GROUP`` and, where given,
    ``$TIMESLICED_PARK`` (a method's name, or the ``park`` map as JSON), ``$TIMESLICED_MEMORY``
    (a size), ``$TIMESLICED_GPUS`` (``0,1`` or ``visible``), ``$TIMESLICED_PRIORITY`` and
    ``$TIMESLICED_WEIGHT`` for the command it launches. An argument given (not None) always wins.
    ``party`` is the process's, not the job's: ``$TIMESLICED_PARTY`` when set, else this process
    (``process_party``), whatever job the client registers.
    Those registration settings are the launched job's: a client for another job or group than the
    environment names (a driver that also registers its samplers, say) takes none of them. Raises
    ``ValueError`` naming the variable when a value there is malformed, and when no job or group is
    given either way.
    """

    def env(name: str) -> str | None:
        value = environ.get(name, "").strip()
        return value or None

    job = job if job is not None else env(JOB_ENV)
    group = group if group is not None else env(GROUP_ENV)
    if job is None or group is None:
        missing = " and ".join(what for what, value in (("job", job), ("group", group)) if value is None)
        raise ValueError(
            f"no {missing} given: pass job= and group=, or launch the program with "
            f"`timesliced run --job J --group G -- CMD` (which sets ${JOB_ENV} and ${GROUP_ENV})"
        )
    if party is None:
        party = env(PARTY_ENV) or process_party()
        if len(party) > MAX_PARTY:
            raise ValueError(f"${PARTY_ENV} is {len(party)} characters long; give a name of at most {MAX_PARTY}")
    if (env(JOB_ENV) or job, env(GROUP_ENV) or group) != (job, group):  # another job's settings: not ours
        environ = {}
    if gpus is None and (text := env(GPUS_ENV)) is not None:
        try:
            gpus = parse_gpus(text)
        except ValueError as exc:
            raise ValueError(f"${GPUS_ENV}={text!r} is {exc}") from None
    if park is None and (text := env(PARK_ENV)) is not None:
        park = _env_park(text)
    if memory is None and (text := env(MEMORY_ENV)) is not None:
        try:
            memory = parse_size(text)
        except ValueError:
            raise ValueError(f"${MEMORY_ENV}={text!r} is not a size; give one like 16GiB, 512MiB or 1.5GB") from None
    if priority is None:
        priority = _env_number(env(PRIORITY_ENV), PRIORITY_ENV, int, 0, "an integer")
    if weight is None:
        weight = _env_number(env(WEIGHT_ENV), WEIGHT_ENV, float, 1.0, "a number")
    return Member(job, group, gpus, park, memory, priority, weight, party)


_party: tuple[int, str] | None = None  # (pid, party): a forked child makes its own


def process_party() -> str:
    """This process's party: its host and pid, and a random part so that no other process shares it."""
    global _party
    if _party is None or _party[0] != os.getpid():
        _party = (os.getpid(), f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}")
    return _party[1]


def _env_number(text: str | None, name: str, kind: Callable[[str], N], default: N, what: str) -> N:
    """``text`` (``$name``'s value) as ``kind``, ``default`` when unset; raises ``ValueError`` naming the variable."""
    try:
        return kind(text) if text is not None else default
    except ValueError:
        raise ValueError(f"${name}={text!r} is not {what}") from None


def parse_gpus(text: str) -> list[int] | str:
    """``"0,1"`` -> ``[0, 1]``; ``"visible"`` -> ``VISIBLE``. Raises ``ValueError`` saying what it is not."""
    if text == VISIBLE:
        return VISIBLE
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        gpus = []
    if not gpus or any(g < 0 for g in gpus):
        raise ValueError(f"neither the node's GPU numbers (like 0,1) nor {VISIBLE!r}")
    return gpus


def _env_park(text: str) -> str | ParkSpec:
    if not text.startswith("{"):
        if text not in METHODS:
            raise ValueError(f"${PARK_ENV}={text!r} is no parking method (known: {', '.join(METHODS)})")
        return text
    try:
        return ParkSpec.from_wire(json.loads(text), "sim")
    except (ValueError, errors.BadRequest) as exc:
        reason = exc.message if isinstance(exc, errors.BadRequest) else str(exc)
        raise ValueError(f"${PARK_ENV} holds no valid park map: {reason}") from None


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
    memory: int | str | Mapping[int, int | str] | None = None,
    *,
    priority: int = 0,
    weight: float = 1.0,
    party: str = "",
) -> dict[str, Any]:
    """The ``register`` request's args.

    ``memory``: the device memory the job declares per GPU, like a Kubernetes request: bytes or a
    size string (``"20GiB"``) for each of its GPUs, or a dict GPU -> size; None declares nothing
    (the job then has its GPUs to itself when granted). ``priority`` (an integer, higher first) and
    ``weight`` (> 0, the job's share) are what its group's queue policy reads (``--policy``:
    ``priority``, ``fair``); the job's first registration fixes them. ``party``: who the session acts
    for (a single acquire of a party that holds a group a gang waits for goes before that gang).
    Raises ``ValueError`` for a size that is not one or is below a byte, for a weight that is not a
    positive number, and for a party that is not a string of at most 256 characters.

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
    if not isinstance(party, str) or len(party) > MAX_PARTY:
        raise ValueError(f"party must be a string of at most {MAX_PARTY} characters, not {party!r}")
    if party:
        args["party"] = party
    if park is not None:
        spec = ParkSpec(park) if isinstance(park, str) else park
        if spec.method not in METHODS:
            raise ValueError(f"unknown parking method {spec.method!r} (known: {', '.join(METHODS)})")
        args["park"] = spec.to_wire()
    if memory is not None:
        args["memory"] = memory_args(memory)
    return args


def memory_args(memory: int | str | Mapping[int, int | str]) -> dict[str, int]:
    """A ``memory=`` declaration as the wire carries it (``{"*": bytes}`` or ``{"<gpu>": bytes}``).

    Raises ``ValueError``.
    """

    def size(value: int | str, what: str) -> int:
        n = parse_size(value) if isinstance(value, str) else value
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"memory {what} must be a number of bytes >= 1 or a size like '20GiB', not {value!r}")
        return n

    if isinstance(memory, Mapping):
        if not memory:
            raise ValueError("memory must name at least one GPU (or be one size for each GPU)")
        out = {}
        for gpu, value in memory.items():
            if not isinstance(gpu, int) or isinstance(gpu, bool) or gpu < 0:
                raise ValueError(f"memory keys must be the node's GPU numbers, not {gpu!r}")
            out[str(gpu)] = size(value, f"for GPU {gpu}")
        return out
    return {EVERY_GPU: size(memory, "for each GPU")}


def dial_failure(address: Address, exc: OSError) -> tuple[str, Unreachable]:
    """How an attempt to connect failed, for ``ClientSession.connection_failed``.

    A daemon that was killed leaves its socket file behind (one that stopped
    removes it), and connecting to it is refused.
    """
    reason = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else exc.__class__.__name__)
    if address.kind == "unix" and os.path.exists(address.path):
        return reason, Unreachable.STALE if isinstance(exc, ConnectionRefusedError) else Unreachable.BUSY
    return reason, Unreachable.ABSENT
