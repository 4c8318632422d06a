"""Daemon configuration, default paths and size parsing."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30
SOCKET_ENV = "TIMESLICED_SOCKET"
STATE_DIR_ENV = "TIMESLICED_STATE_DIR"
SOCKET_NAME = "timesliced.sock"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"16G"``, ``"512MiB"``, ``"4096"`` -> bytes (powers of 1024 for both spellings)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 512MiB, 1048576)")
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * (1 << (10 * " kmgt".index(unit or " "))))


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


ADMIN_TOKEN_ENV = "TIMESLICED_ADMIN_TOKEN"
DEFAULT_WEB = ("127.0.0.1", 7712)


def read_admin_token(path: Path | None) -> str | None:
    """The admin token from ``path`` or ``$TIMESLICED_ADMIN_TOKEN``; raises ``ValueError`` if empty or unreadable."""
    if path is None:
        token = os.environ.get(ADMIN_TOKEN_ENV)
        if token is None:
            return None
        where = f"${ADMIN_TOKEN_ENV}"
    else:
        try:
            token = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the admin token file {path}: {exc.strerror}") from None
        where = str(path)
    token = token.strip()
    if len(token) < 16:
        raise ValueError(f"the admin token in {where} must be at least 16 characters")
    return token


def default_state_dir() -> Path:
    if env := os.environ.get(STATE_DIR_ENV):
        return Path(env)
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(runtime) / "timesliced"
    return Path(tempfile.gettempdir()) / f"timesliced-{os.getuid()}"


def default_socket_path(state_dir: Path | None = None) -> Path:
    """Where local clients find the daemon: ``$TIMESLICED_SOCKET`` or the state dir."""
    if env := os.environ.get(SOCKET_ENV):
        return Path(env)
    return (state_dir or default_state_dir()) / SOCKET_NAME


def default_sim_dir(state_dir: Path) -> Path:
    """Simulated device memory lives on tmpfs, one directory per state dir."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return base / f"timesliced-{os.getuid()}-{digest}"


@dataclass(frozen=True)
class ClusterConfig:
    """Several daemons that elect one leader (``--peers`` and friends)."""

    members: dict[str, tuple[str, int]]  # node id -> the address its peers dial, this node's own included
    listen: tuple[str, int]  # where this node accepts its peers
    token: str = field(repr=False)  # shared by every member; never logged, never sent
    election_timeout: tuple[float, float] = (1.0, 2.0)
    heartbeat_interval: float = 0.25


PEER_TOKEN_ENV = "TIMESLICED_PEER_TOKEN"


def read_peer_token(path: Path | None) -> str:
    """The cluster's shared token from ``path`` or ``$TIMESLICED_PEER_TOKEN``; raises ``ValueError``."""
    if path is None:
        token = os.environ.get(PEER_TOKEN_ENV, "")
        where = f"${PEER_TOKEN_ENV}"
    else:
        try:
            token = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the peer token file {path}: {exc.strerror}") from None
        where = str(path)
    token = token.strip()
    if len(token) < 16:
        raise ValueError(f"a cluster needs a shared token of at least 16 characters in {where} (--peer-token-file)")
    return token


@dataclass
class DaemonConfig:
    state_dir: Path = field(default_factory=default_state_dir)
    socket_path: Path | None = None  # None: default_socket_path(state_dir)
    listen: tuple[str, int] | None = None  # optional TCP listener for remote clients
    node: str = field(default_factory=socket.gethostname)
    backend: str = "auto"  # the parking method of jobs that name none; see node/parking.py
    gpus: int = 2
    gpu_memory: int = 16 * GiB  # per simulated GPU; sparse, costs RAM only when written
    page_size: int = 2 << 20
    bandwidth: float = 25e9  # bytes/s of the simulated host link; 0 = as fast as memory allows
    sim_dir: Path | None = None  # None: default_sim_dir(state_dir)
    max_frame: int = 1 << 20
    max_connections: int = 4096
    max_waiters: int = 1024
    handshake_timeout: float = 10.0  # a new connection must say hello within this
    stall_timeout: float = 10.0  # a half-received frame must complete within this
    op_timeout: float = 600.0  # a single snapshot / restore
    max_write_buffer: int = 8 << 20  # a client that stops reading is disconnected past this
    pid_poll_interval: float = 0.5
    lock_timeout: float = 10.0  # cuda-checkpoint: how long a process may take to reach a safe point
    engine_timeout: float = 120.0  # vllm / sglang: one sleep or wake-up call
    offload_verify: bool = False  # offload: checksum every region after its restore
    telemetry_interval: float = 1.0  # seconds between GPU samples
    web: tuple[str, int] | None = None  # the dashboard, /metrics and /api/v1 (``serve`` turns it on by default)
    web_any_port: bool = False  # True: if the web address is taken, take a free port (and log it)
    admin_token: str | None = field(default=None, repr=False)  # dashboard admin actions; never logged
    cluster: ClusterConfig | None = None  # None: a single daemon, its own leader

    def resolved_socket(self) -> Path:
        return self.socket_path or default_socket_path(self.state_dir)

    def resolved_sim_dir(self) -> Path:
        return self.sim_dir or default_sim_dir(self.state_dir)
