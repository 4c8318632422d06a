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


@dataclass(frozen=True)
class SessionClosed:
    session: SessionId


@dataclass(frozen=True)
class AcquireRequested:
    session: SessionId
    request_id: int
    deadline: float | None = None


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


Event = (
    JobRegistered
    | SessionClosed
    | AcquireRequested
    | AcquireWithdrawn
    | ReleaseRequested
    | MemoryRequested
    | MemoryReleased
    | MoveFinished
    | JobExited
    | ReclaimFinished
    | ForceReleaseRequested
    | DrainRequested
    | GroupsFrozen
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
