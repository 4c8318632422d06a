"""Inputs to the scheduler core (past tense) and its outputs (imperative).

Both are plain data so that a shell can log them, a test can build them by
hand, and a later multi-node transport can carry them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import TimeslicedError

SessionId = int
Ticket = tuple[SessionId, int]  # (session, request id): who gets the reply


# --- events --------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRegistered:
    session: SessionId
    job: str
    group: str
    gpus: tuple[int, ...] | None  # None: the group's GPUs, or every GPU for a new group
    pids: tuple[int, ...] = ()
    # True: the job's device memory is not accounted by the scheduler (a real process parked by
    # cuda-checkpoint, offload or an engine endpoint), so it must have its GPUs to itself when granted.
    exclusive: bool = False
    # The cluster slot of the node the session is on (see core/ids.py); ``gpus`` are its GPUs.
    slot: int = 0
    # True: the parking method stops the job's device work before it parks it (cuda-checkpoint
    # locks the process, the simulated GPU guards its pages), so a holder that did not yield may be
    # preempted. False (offload, engines): parking unmaps memory under running kernels, so the job
    # may join no group that preempts.
    freezes: bool = True
    # gpu -> the device memory the job declares it needs there (a request, as in Kubernetes); None: it
    # declares nothing. A job with a declaration is planned by its footprint (the larger of this and its
    # measured peak) and may stay resident beside others; without one, an ``exclusive`` job has its GPUs to itself.
    memory: dict[int, int] | None = None
    memory_each: int | None = None  # the same declaration for each of its GPUs on its node (with ``memory``'s on top)
    # The group's queue policy (core/policy.py) reads these: ``priority`` orders waiters under
    # ``priority`` (higher first), ``weight`` is the job's share of the group under ``fair``.
    priority: int = 0
    weight: float = 1.0
    # The party the session acts for: by default its process (the client makes one up), or what the
    # user named for processes that work as one (an RL run's trainer and sampler actors). A single
    # acquire of a party that holds a group a gang waits for may go before that gang (``arbiter``):
    # kept behind it, the party would never let that group go. "": a party of its own.
    party: str = ""


@dataclass(frozen=True)
class SessionClosed:
    session: SessionId


@dataclass(frozen=True)
class AcquireRequested:
    session: SessionId
    request_id: int
    deadline: float | None = None
    # A member of gang ``gang`` of ``members`` acquires (core/gangs.py): the gang's members, each in
    # another group, are granted together or not at all.
    gang: str | None = None
    members: int = 0


@dataclass(frozen=True)
class AcquireWithdrawn:
    session: SessionId
    request_id: int


@dataclass(frozen=True)
class ReleaseRequested:
    session: SessionId


@dataclass(frozen=True)
class MemoryRequested:
    session: SessionId
    request_id: int
    gpu: int
    nbytes: int  # what the ledger counts (the backend's rounded size)
    requested: int = 0  # what the caller asked for, passed on to AllocateRegion; 0: nbytes


@dataclass(frozen=True)
class MemoryReleased:
    job: str
    gpu: int
    nbytes: int


@dataclass(frozen=True)
class MoveFinished:
    """A snapshot or restore started by ``SnapshotJob`` / ``RestoreJob`` ended."""

    op: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    # A failed restore whose outcome is unknown on some node (it did not answer): count the
    # job's memory as taken there rather than risk putting a second job on top of it.
    kept_memory: bool = False
    # A failed move that left the job's state intact where it began (the backend said so,
    # ``errors.StateIntact``): the job stays usable and the move is tried again later. False (the
    # state is damaged, or nobody knows): the job is faulted until an operator resumes it.
    intact: bool = False
    code: str = ""  # the error code of the failure (``insufficient_host_memory``, ...), if known
    # slot -> the bytes this move moved on that node (what its parked state takes in host memory
    # after a snapshot); empty: all of ``nbytes`` on the job's first node.
    by_slot: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryMeasured:
    """The device memory ``job`` was seen to hold now (gpu -> bytes: NVML's per-process figures of its
    processes, its offload registrations, its engine's figures); the scheduler keeps the peak."""

    job: str
    gpus: dict[int, int]


@dataclass(frozen=True)
class JobExited:
    """Every process of the job is gone: its state can be dropped."""

    job: str


@dataclass(frozen=True)
class ReclaimFinished:
    op: int


@dataclass(frozen=True)
class ForceReleaseRequested:
    """An administrator takes the lock from the group's holder (a stuck job)."""

    group: str


@dataclass(frozen=True)
class DrainRequested:
    """An administrator stops (``on``) or resumes granting the group."""

    group: str
    on: bool


@dataclass(frozen=True)
class GroupsFrozen:
    """These groups may grant and move nothing now, and why (a node they span is out of reach).

    Every group not named is free again.
    """

    reasons: dict[str, str]


@dataclass(frozen=True)
class HostMemoryRead:
    """A node's daemon read how much host memory parked state may take there (no park was under way).

    ``room``: bytes more parked state could take on the node now, its margin taken off (host
    memory); ``limit``: the operator's budget for all parked state on the node, if any. ``pools``:
    the places with limits of their own where parked state lives (a cgroup, the simulated GPU's
    tmpfs) and the room left in each; ``members``: job -> the pools its parked state counts
    against. ``sizes``: job -> the host bytes its park is expected to take, as measured (its
    device memory). ``source``: the figures behind ``room`` and each pool, for status and errors.
    """

    slot: int
    room: int
    limit: int | None = None
    pools: dict[str, int] = field(default_factory=dict)
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)  # "host" or a pool -> how its room was found


@dataclass(frozen=True)
class FaultCleared:
    """An administrator found the cause of the job's fault gone: it may be granted again."""

    job: str


Event = (
    JobRegistered
    | SessionClosed
    | AcquireRequested
    | AcquireWithdrawn
    | ReleaseRequested
    | MemoryRequested
    | MemoryReleased
    | MoveFinished
    | MemoryMeasured
    | JobExited
    | ReclaimFinished
    | ForceReleaseRequested
    | DrainRequested
    | GroupsFrozen
    | HostMemoryRead
    | FaultCleared
)


# --- effects -------------------------------------------------------------------------


@dataclass(frozen=True)
class GrantLock:
    group: str
    job: str
    fence: int
    waited_s: float
    switch_s: float
    restored: bool
    tickets: tuple[Ticket, ...]
    again: bool = False  # the job already held the lock: same fence, nothing moved
    # Something moved for this grant (the job was restored, or only others were parked).
    # Figures only, so it takes no part in equality.
    switched: bool = field(default=False, compare=False)

    def info(self) -> dict[str, object]:
        return {
            "group": self.group,
            "job": self.job,
            "fence": self.fence,
            "waited_s": self.waited_s,
            "switch_s": self.switch_s,
            "restored": self.restored,
        }


@dataclass(frozen=True)
class FailRequest:
    ticket: Ticket
    error: TimeslicedError


@dataclass(frozen=True)
class SnapshotJob:
    op: int
    job: str


@dataclass(frozen=True)
class RestoreJob:
    op: int
    job: str
    # The snapshots (ops) whose room this restore streams into: they run together, the restore taking
    # each GPU's memory as the snapshots free it. Empty: the room is free already (or the shell runs
    # the restore only once those snapshots ended, the sequential form of the same switch).
    streams_with: tuple[int, ...] = ()


@dataclass(frozen=True)
class AllocateRegion:
    """Memory is reserved in the ledger: create the region and reply to ``ticket``."""

    ticket: Ticket
    job: str
    gpu: int
    nbytes: int
    requested: int


@dataclass(frozen=True)
class ReclaimJob:
    op: int
    job: str


@dataclass(frozen=True)
class NotifyJob:
    """Push ``event`` to every connected session of ``job``."""

    job: str
    event: str
    data: dict[str, object]


Effect = GrantLock | FailRequest | SnapshotJob | RestoreJob | AllocateRegion | ReclaimJob | NotifyJob
