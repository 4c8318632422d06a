"""The status document: one typed schema for its producers, its consumers and the tests (pure).

A daemon answers the ``status`` op (and ``/api/v1/status``) with a ``Status``. Its parts are built
where the facts live: the scheduler (``devices``, ``groups``, ``jobs``), the cluster node
(``cluster``), telemetry (``telemetry``), the move log (``moves``), the parking probe (``parking``)
and the client server (``counters``); the daemon puts them together. The dashboard, the metrics,
``timesliced status`` and the tests' fixtures read it through these types, and ``problems`` checks
a document against them at run time (the tests hold every fixture and a live daemon's status to it,
so the two cannot drift apart).

The document is plain data (msgpack and JSON safe): maps have string keys, times are seconds
(``*_s`` durations; ``t`` and ``at`` points in time), sizes are bytes.
"""

from __future__ import annotations

import types
import typing
from typing import Any, TypedDict, Union

# --- the scheduler's picture --------------------------------------------------------------


class DeviceJob(TypedDict):
    bytes: int
    location: str  # resident | parking | parked | restoring


class Device(TypedDict):
    index: int
    capacity: int
    used: int
    jobs: dict[str, DeviceJob]  # the jobs with memory on the device


class QueuePlace(TypedDict):
    job: str
    waited_s: float
    requests: int  # acquires waiting on this place (one per process of the job that asks)
    kept_for_s: float | None  # a turn kept after a restart, with no request yet: how long it is kept
    preempted: bool  # queued again after a preemption
    priority: int  # its job's, as registered
    weight: float  # its job's share of the group under ``fair``, as registered
    share_s: float  # seconds its job held the group, per unit of weight (what ``fair`` orders by)
    effective_priority: float | None  # under ``priority``: its priority plus a level per ``aging_s`` waited
    gang: str | None  # the gang it is a member of


class Group(TypedDict):
    group: str
    gpus: list[int]
    state: str  # idle | idle-yielded | locked | switching | faulted
    holder: str | None
    held_s: float | None
    fence: int
    queue: list[QueuePlace]
    overdue_s: float | None  # how long the holder is past its maximum slice
    max_slice_s: float | None
    slice_action: str | None  # warn | preempt
    policy: str  # the queue policy: fifo | priority | fair
    aging_s: float  # a priority level, or a second of weighted hold, per this many seconds waited
    preemptions: int
    switching_to: str | None
    draining: bool
    frozen: str | None  # why the group grants nothing now (a node it spans is out of reach)
    waiting_for: str | None  # what the head of the queue waits for (memory, a rival, host memory being freed)
    deferred: int  # times the head of the queue had to wait for memory or for a rival
    grants: int
    switches: int
    bytes_moved: int
    median_switch_s: float | None
    p95_switch_s: float | None
    median_wait_s: float | None
    lock_duty: float  # the share of the group's life that a job held it


class JobPlace(TypedDict):
    """A job as any node knows it."""

    job: str
    group: str
    location: str
    faulted: str | None
    sessions: int
    pids: list[int]
    footprint: dict[str, int]  # GPU -> bytes the job holds there when resident


class JobPhases(TypedDict):
    """A job's GPU phases (its slices) and gaps (a release to its next acquire, queueing not counted).

    The statistics are of the last 256 of each (``core/phases.py``); the placement advisor reads them.
    """

    count: int  # phases ended, ever
    gaps: int  # gaps measured, ever (a job's first phase has none before it)
    busy_median_s: float | None
    busy_p90_s: float | None
    busy_mean_s: float | None
    gap_median_s: float | None
    gap_p90_s: float | None
    gap_mean_s: float | None
    own_duty: float | None  # busy / (busy + gap), mean lengths: its share of its GPUs when it runs alone
    memory_peak_bytes: int  # the most the scheduler accounted it on one GPU at the end of a phase


class JobFigures(JobPlace, total=False):
    """A job with the scheduler's figures (the leader has them; a follower shows its jobs without)."""

    parked_bytes: int  # host memory its parked state takes now (0 while resident), on every node
    park_refused: str | None  # why its last park failed with its state intact, while it is not tried again
    declared: dict[str, int]  # GPU -> the device memory it declared (register ``memory=``); empty: none
    peak: dict[str, int]  # GPU -> the most device memory it was measured to hold (NVML, offload, engines)
    over_declared_bytes: int  # the most it was measured past its declaration on any GPU (0: within it)
    slices: int
    restores: int
    snapshots: int
    preemptions: int
    gpu_seconds: float
    bytes_moved: int
    median_wait_s: float | None
    phases: JobPhases


class Job(JobFigures):
    """A job in the status document: what the node adds to the scheduler's picture."""

    park: str | None  # its parking method, where this node knows it
    measured: dict[str, int]  # GPU -> bytes its last move measured


class HostPool(TypedDict):
    budget: int  # what parked state may take in the pool (a cgroup, the simulated GPU's tmpfs)
    parked: int  # what it takes now


class HostBudget(TypedDict):
    """One node's host memory for parked state, as the scheduler accounts it (``core/host.py``)."""

    slot: int
    budget: int  # what all parked state on the node may take: parked now + room at the last reading, <= limit
    limit: int | None  # --host-memory-limit
    room: int  # what the host could still take at the last reading (its margin taken off)
    parked: int  # what parked state takes now
    reserved: int  # what the parks under way are expected to take
    freeing: int  # what the restores and reclaims under way give back
    read_s_ago: float
    pools: dict[str, HostPool]
    source: dict[str, str]  # "host" or a pool -> the figures behind its room


class SchedulerPicture(TypedDict):
    """What the scheduler shows (``Scheduler.describe``)."""

    devices: list[Device]
    groups: list[Group]
    jobs: list[JobFigures]
    host: list[HostBudget]


class LocalPicture(TypedDict):
    """What a cluster node knows of its own GPUs and jobs (``ClusterNode.describe_local``)."""

    devices: list[Device]
    jobs: list[JobPlace]


class Picture(TypedDict):
    """The node's picture: the scheduler's on the leader, a follower's own GPUs and jobs elsewhere."""

    devices: list[Device]
    groups: list[Group]
    jobs: list[Job]
    host: list[HostBudget]  # the scheduler's accounts of every node (a follower shows none)


# --- the cluster ----------------------------------------------------------------------------


class Election(TypedDict):
    node: str
    peers: list[str]
    role: str  # follower | pre-candidate | candidate | leader
    term: int
    leader: str | None
    voted_for: str | None
    pre_vote: bool
    quorum: bool
    leader_since: float | None
    leader_heard_s_ago: float | None
    acked_s_ago: dict[str, float]
    next_deadline: float | None


class PeerLink(TypedDict):
    address: str
    connected: bool
    queued: int
    sent: int
    received: int
    dropped: int
    reconnects: int
    last_error: str | None


class Peers(TypedDict):
    listen: str  # HOST:PORT where the node accepts its peers ("" before it listens)
    peers: dict[str, PeerLink]


class ClusterCore(TypedDict):
    """What the cluster node knows (``ClusterNode.describe``)."""

    node: str
    slot: int
    members: list[str]
    election: Election
    leader: str | None
    era: list[int] | None  # [term, gen] of the leader this node follows
    ready: bool
    leading: bool
    linked: list[str]
    reporters: list[str]
    offline: list[str]
    pending: int
    refused: int
    problems: list[str]


class MembersLook(TypedDict):
    """Under ``--dns``: the last look at the members the name lists (``daemon/members_watch.py``)."""

    name: str  # the --dns name
    listed: list[str] | None  # the member ids it resolved to; None when the look failed
    differs: bool  # they are not the members this daemon started with: restart every daemon
    error: str | None  # why the look failed
    checked_at: float  # wall-clock time of the look


class Cluster(ClusterCore):
    peers: Peers | None  # the peer transport; None for a single daemon
    dns: MembersLook | None  # under --dns, from the first look on (some seconds after the start); else None


# --- telemetry and moves ------------------------------------------------------------------


class GpuTelemetry(TypedDict):
    index: int
    name: str
    uuid: str
    memory_total: int | None
    memory_used: int | None
    memory_free: int | None
    utilization_gpu: float | None
    utilization_memory: float | None
    duty_now: float | None
    duty_window: float | None
    window_s: float
    processes: dict[str, int]  # PID -> device bytes
    errors: list[str]


class Telemetry(TypedDict):
    source: str  # nvml | sim | none
    reason: str | None  # why there is no NVML
    driver: str | None
    cuda: str | None
    interval_s: float
    age_s: float | None
    error: str | None
    gpus: list[GpuTelemetry]


class MoveEntry(TypedDict):
    """One move as the move log keeps it."""

    at: float  # the daemon's clock
    job: str
    kind: str  # snapshot | restore
    nbytes: int
    seconds: float
    gbps: float
    direction: str  # to_host (a snapshot) | to_device (a restore)
    swap_with: str | None  # the job moved the other way at the same time (a swap), else None


class Move(MoveEntry):
    t: float  # epoch seconds


class JobMoves(TypedDict):
    count: int
    snapshots: int
    restores: int
    nbytes: int
    seconds: float
    median_gbps: float | None
    median_to_host_gbps: float | None  # of the snapshots still in the log
    median_to_device_gbps: float | None  # of the restores still in the log


class MovesLog(TypedDict):
    """What the move log shows (``MoveLog.describe``)."""

    recent: list[MoveEntry]
    jobs: dict[str, JobMoves]


class Moves(TypedDict):
    recent: list[Move]
    jobs: dict[str, JobMoves]


class CheckpointProbe(TypedDict):
    """How the cuda-checkpoint method works on this node (the probe's findings at start)."""

    footprints: str  # per-process (NVML's per-process figures) | gpu-delta (each GPU's used-memory change)
    footprints_why: str  # why: whether NVML sees the daemon's PIDs
    bindings: str  # the cuda-bindings version
    cuda: str | None  # the CUDA version the driver supports, e.g. "13.0"
    restore_gpus: dict[str, str]  # GPU index -> how restores reach it: driver (the daemon's cuInit) | persistence
    cleared_env: dict[str, str]  # variables taken away for the daemon's cuInit (CUDA_VISIBLE_DEVICES), and their values


class SimHeld(TypedDict):
    """Simulated device memory a parked job still holds: its park's last control-file writes failed.

    Such a job is parked and whole; the pages hold its bytes until a write of its control file lands
    (its next restore, or another job's that needs the memory), and count as free to the scheduler.
    """

    bytes: int
    unfinished: bool  # its parked copy lacks what the pages hold: a host-file write failed too


class Parking(TypedDict):
    default: str
    why: str
    device_source: str  # nvml | sim
    methods: dict[str, str]  # method -> "available" or why not
    checkpoint: CheckpointProbe | None  # the cuda-checkpoint method's findings, where it is available
    sim_held: dict[str, SimHeld]  # job -> what it holds of the simulated GPUs ({}: none, or real GPUs)


class Cgroup(TypedDict):
    path: str  # the cgroup's path in its hierarchy
    version: int  # 1 or 2
    limit: int | None  # the tightest memory limit of it and its ancestors (None: none)
    used: int  # what it uses now, less what the kernel can reclaim without swapping (inactive file pages)
    room: int | None  # limit - used - margin (None: no limit)


class Tmpfs(TypedDict):
    path: str
    size: int
    free: int


class SimPool(TypedDict):
    """The simulated GPU's pool of warm parked-file buffers (``backends/sim_buffers.py``)."""

    held: int  # bytes the pool holds now: host memory (on the tmpfs) counted as room for parked state
    limit: int  # --sim-pool: the most it keeps (0: no pool)
    taken: int  # parks that wrote into a pool buffer since the daemon started
    missed: int  # parks that found none big enough, and wrote new pages


class HostReading(TypedDict):
    """What this node's daemon last read of its host for parked state (``daemon/host_memory.py``)."""

    available: int | None  # MemAvailable of /proc/meminfo
    total: int | None  # MemTotal
    margin: int  # kept free of parked state
    limit: int | None  # --host-memory-limit
    room: int  # what more parked state may take on the host now
    cgroup: Cgroup | None  # the daemon's own
    tmpfs: Tmpfs | None  # where the simulated GPU parks its jobs
    sim_pool: SimPool | None  # the simulated GPU's warm buffers for parks (None: no simulated GPU)
    jobs: dict[str, list[str]]  # job -> the pools its parked state counts against
    pools: dict[str, int]  # pool -> the room left in it
    age_s: float | None  # since the reading (None: never read)
    error: str | None  # why a figure could not be read


class Counters(TypedDict):
    accepted: int
    refused: int
    protocol_errors: int
    internal_errors: int
    auth_failures: int
    leases_expired: int


# --- the whole document ---------------------------------------------------------------------


class Status(Picture):
    node: str
    version: str
    pid: int
    backend: str
    parking: Parking
    addresses: list[str]
    uptime_s: float
    connections: int
    counters: Counters
    cluster: Cluster
    telemetry: Telemetry
    moves: Moves
    host_memory: HostReading


# --- checking a document ----------------------------------------------------------------------


def problems(value: Any, schema: Any = Status, where: str = "status") -> list[str]:
    """Every way ``value`` differs from ``schema`` (a TypedDict or a type expression), one line each.

    Missing and unknown keys, and values of the wrong type; an int passes for a float, a bool for
    neither. An empty list: the document is well formed.
    """
    origin = typing.get_origin(schema)
    if schema is Any:
        return []
    if schema is type(None) or schema is None:
        return [] if value is None else [f"{where}: expected null, got {_kind(value)}"]
    if origin in (Union, types.UnionType):
        options = typing.get_args(schema)
        if any(not problems(value, option, where) for option in options):
            return []
        others = [o for o in options if o is not type(None)]
        structured = len(others) == 1 and (_is_typed_dict(others[0]) or typing.get_origin(others[0]) in (list, dict))
        if value is not None and structured:  # an object or a list that is wrong inside: say where
            return problems(value, others[0], where)
        return [f"{where}: expected {' or '.join(_name(o) for o in options)}, got {_kind(value)}"]
    if _is_typed_dict(schema):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {_kind(value)}"]
        hints = typing.get_type_hints(schema)
        out = [f"{where}: missing {key!r}" for key in sorted(schema.__required_keys__) if key not in value]
        out += [f"{where}: unknown key {key!r}" for key in sorted(map(str, value)) if key not in hints]
        for key, hint in hints.items():
            if key in value:
                out += problems(value[key], hint, f"{where}.{key}")
        return out
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {_kind(value)}"]
        (item,) = typing.get_args(schema)
        return [p for i, v in enumerate(value) for p in problems(v, item, f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {_kind(value)}"]
        key_type, item = typing.get_args(schema)
        out = [f"{where}: key {k!r} is not a {key_type.__name__}" for k in value if not isinstance(k, key_type)]
        return out + [p for k, v in value.items() for p in problems(v, item, f"{where}[{k!r}]")]
    if schema is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, schema)
    return [] if ok else [f"{where}: expected {_name(schema)}, got {_kind(value)}"]


def _is_typed_dict(schema: Any) -> bool:
    return isinstance(schema, type) and issubclass(schema, dict) and hasattr(schema, "__required_keys__")


def _name(schema: Any) -> str:
    return "null" if schema is type(None) else getattr(schema, "__name__", str(schema))


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
