"""The daemon's configuration (``timesliced serve``) and the parsing of its options.

Where the daemon's files live and how tokens are read is ``env``; sizes and addresses are parsed by
``util.parse``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from .core.policy import AGING_S, QueuePolicy
from .core.slices import SlicePolicy
from .env import default_sim_dir, default_socket_path, default_state_dir
from .sim import DEFAULT_BANDWIDTH, DEFAULT_POOL

GiB = 1 << 30
DEFAULT_WEB = ("127.0.0.1", 7712)


CRASH_AT_ENV = "TIMESLICED_CRASH_AT"
CRASH_POINTS = (
    "before-snapshot",
    "mid-snapshot",
    "after-snapshot",
    "before-restore",
    "mid-restore",
    "after-restore",
    "at-grant",
)


def parse_crash_points(text: str) -> dict[str, int]:
    """``"before-snapshot,at-grant@3"`` -> point -> the how-manieth time it fires (default the first).

    Raises ``ValueError`` for an unknown point or a bad count.
    """
    points: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        point, _, nth = item.partition("@")
        if point not in CRASH_POINTS or not (nth or "1").isdigit() or int(nth or "1") < 1:
            raise ValueError(f"not a crash point: {item!r} in ${CRASH_AT_ENV} (known: {', '.join(CRASH_POINTS)}[@N])")
        points[point] = int(nth or "1")
    return points


def parse_slice_policy(text: str, action: str = "warn", grace: float = 10.0) -> tuple[str, SlicePolicy]:
    """``"300"`` (every group), ``"trainers=300"`` or ``"trainers=300:preempt"`` -> (group or "*", policy)."""
    group, sep, rest = text.rpartition("=")
    seconds, _, named = rest.partition(":")
    try:
        return (group if sep else "*"), SlicePolicy(float(seconds), named or action, grace)
    except ValueError as exc:
        raise ValueError(f"not a maximum slice: {text!r} ({exc}; examples: 300, trainers=300:preempt)") from None


def parse_queue_policy(text: str, aging_s: float = AGING_S) -> tuple[str, QueuePolicy]:
    """``"fair"`` (every group) or ``"trainers=priority"`` -> (group or "*", policy)."""
    group, sep, name = text.rpartition("=")
    try:
        return (group if sep else "*"), QueuePolicy(name, aging_s)
    except ValueError as exc:
        raise ValueError(f"not a queue policy: {text!r} ({exc}; examples: fair, trainers=priority)") from None


@dataclass(frozen=True)
class ClusterConfig:
    """Several daemons that elect one leader (``--peers`` and friends)."""

    members: dict[str, tuple[str, int]]  # node id -> the address its peers dial, this node's own included
    listen: tuple[str, int]  # where this node accepts its peers
    token: str = field(repr=False)  # shared by every member; never logged, never sent
    election_timeout: tuple[float, float] = (1.0, 2.0)
    heartbeat_interval: float = 0.25
    dns: tuple[str, int] | None = None  # --dns: the name and the peer port its members take, looked at again
    dns_check_interval: float = 30.0  # how often (``daemon/members_watch.py``)


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
    bandwidth: float = DEFAULT_BANDWIDTH  # bytes/s of the simulated host link; 0 = as fast as memory allows
    sim_dir: Path | None = None  # None: default_sim_dir(state_dir)
    sim_pool: int = DEFAULT_POOL  # bytes of warm parked-file buffers the simulated GPU keeps; 0 = none
    max_frame: int = 1 << 20
    max_connections: int = 4096
    max_connections_per_client: int = 256  # from one process (Unix socket) or one host (TCP)
    max_waiters: int = 1024  # jobs waiting in one group's queue
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
    # The deployment's shared token: TCP clients must prove it (``listen`` needs one). None with a
    # cluster: the cluster's token. Never logged, never sent.
    token: str | None = field(default=None, repr=False)
    cluster: ClusterConfig | None = None  # None: a single daemon, its own leader
    # group -> how long a holder may keep it while others wait ("*": every other group)
    slice_policies: dict[str, SlicePolicy] = field(default_factory=dict)
    # group -> who of its waiters goes next ("*": every other group; default fifo)
    queue_policies: dict[str, QueuePolicy] = field(default_factory=dict)
    # group -> its GPUs on this node, declared in the config file ([groups.NAME] gpus): a registration in
    # the group gets them, and one that names other GPUs is refused (core.registry.declared_gpus)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    lease: float = 30.0  # a client connection silent this long is closed (clients send heartbeats); 0: never
    # Host memory for parked state (daemon/host_memory.py): a budget for all of it on this node (None: what
    # the host and its cgroups allow, less the margin), the margin (None: 5% of the host's memory, 512 MiB
    # to 8 GiB), and how often the host is read (also after every move).
    host_memory_limit: int | None = None
    host_memory_margin: int | None = None
    host_memory_interval: float = 1.0
    # Co-residency (core/residency.py): device memory kept free on each GPU of a job that declared its memory,
    # beside the footprints of the jobs resident there. 1 GiB: a CUDA context and the allocator's slack per
    # process take a few hundred MiB that no declaration names, and cuda-checkpoint keeps a margin of its own.
    memory_headroom: int = 1 * GiB
    prefetch: bool = True  # restore a held group's next waiter into free room before its turn
    # Every handoff with a waiter parks the outgoing job even when both fit: the behaviour of systems
    # without co-residency, for comparisons (every job registers as one that has its GPUs to itself).
    park_every_handoff: bool = False
    # A switch whose restore needs parked jobs' room starts both together (RestoreJob.streams_with); the
    # shell streams them where its backend can, else runs the restore once the snapshots are done.
    stream_switches: bool = True
    # Keep the turn of a holder that yielded, for at most this many seconds, when its measured gaps are
    # shorter than parking it for the next waiter and coming back would take (core/anticipation.py). 0: never.
    anticipate: float = 0.0
    host_root: Path = Path("/")  # where /proc and /sys are read from (tests point it at a fake tree)
    recovery_grace: float = 30.0  # after a restart, how long the jobs of the journal keep their turns
    # Fault injection for crash tests: points at which the daemon kills itself with SIGKILL
    # (CRASH_POINTS: before, in the middle of and after a snapshot or a restore; as a grant is made).
    crash_at: dict[str, int] = field(default_factory=lambda: parse_crash_points(os.environ.get(CRASH_AT_ENV, "")))

    def resolved_socket(self) -> Path:
        return self.socket_path or default_socket_path(self.state_dir)

    def resolved_sim_dir(self) -> Path:
        return self.sim_dir or default_sim_dir(self.state_dir)

    def shared_token(self) -> str | None:
        """The token TCP clients prove: ``token``, else the cluster's (one token per deployment)."""
        return self.token or (self.cluster.token if self.cluster is not None else None)
