"""The scheduler's records: groups, jobs, their places in the queues, switches (pure data).

The scheduler's concerns (``queues``, ``ledger``, ``moves``, ``arbiter``, ``figures``) read and
write these; the records hold no logic, and the fields under "figures" are written by ``figures``
alone. Other packages read the fields named in the scheduler's public API (``holder``,
``holder_sessions``, ``switch.incoming``, ``gpus``, ``fence``, ``queue``, ``group``, ``sessions``,
``pids``, ``exclusive``, ``location``, ``footprint``, ``faulted``, ``last_holder``) and, in tests,
figures.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from ..errors import TimeslicedError
from .events import SessionId, Ticket
from .location import Location
from .phases import Phases

RECENT = 512  # samples kept per group and per job for medians and percentiles
MAX_REQUESTS_PER_JOB = 256  # acquires of one job waiting at once (each of its processes may wait)
AUTO = 0  # the request id of an acquire the scheduler made for a job (a preempted holder queued again)
PARK_RETRY_S = 10.0  # a park that failed with the job's state intact is not tried again before this, unless
# its cause may have gone sooner (host memory freed on its node, a job exited)


class GroupState(enum.Enum):
    IDLE = "idle"  # nobody holds, no job of the group resident
    IDLE_YIELDED = "idle-yielded"  # nobody holds, the last holder is still resident
    LOCKED = "locked"
    SWITCHING = "switching"
    FAULTED = "faulted"  # nobody holds, and a job of the group is faulted: it needs an operator


@dataclass
class Waiter:
    """One job's place in a group's queue; several requests may wait on it."""

    job: str
    enqueued_at: float
    tickets: dict[Ticket, float | None] = field(default_factory=dict)  # ticket -> deadline
    kept_until: float | None = None  # a turn kept without requests (see ``keep_turn``) lapses then
    seq: int = 0  # its place in the arrival order of all groups' waiters (``LockQueues.seq``)
    gang: str | None = None  # the gang it is a member of (core/gangs.py)
    anticipated: bool = False  # a turn kept at the head for the holder that just yielded (core/anticipation.py)
    # It was passed by such a turn in this wait (it asked when the turn was kept, or when the turn was
    # granted to its holder): no other is kept before it is granted.
    delayed: bool = False


@dataclass
class Gang:
    """Members (each a job's request in another group) granted together or not at all.

    ``seq`` is None until all ``size`` members have asked; then the gang waits in each of its
    groups at the tail, under one place in the arrival order (``seq``) that every group shares.
    ``ready``: group -> (switch_s, restored, switched) of a member whose switch is done.
    ``passes``: party -> (group, seq) of the one single acquire of that party that went before the
    gang in this wait (``Arbiter._passer``), until the party holds none of the gang's groups, or that
    acquire stops waiting without a grant (``LockQueues.drop``); all go with the gang (granted or
    withdrawn).
    """

    name: str
    size: int
    members: dict[Ticket, str] = field(default_factory=dict)  # ticket -> its group
    seq: int | None = None
    formed_at: float = 0.0
    ready: dict[str, tuple[float, bool, bool]] = field(default_factory=dict)
    passes: dict[str, tuple[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """Why a job's park failed, or was refused, with its state intact; the park is not tried again until ``until``."""

    reason: str
    code: str  # the error code of the cause (``insufficient_host_memory``, ``park_refused``, ...)
    until: float


@dataclass
class Job:
    name: str
    group: str
    sessions: set[SessionId] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)
    # Changed only by ``Moves`` through ``location.moved`` (a test walks the source to keep it so).
    location: Location = Location.RESIDENT
    footprint: dict[int, int] = field(default_factory=dict)  # gpu -> bytes
    exclusive: bool = False  # see JobRegistered.exclusive
    # see JobRegistered.memory: gpu -> declared bytes; empty: none declared. A job that is exclusive and
    # declared nothing has its GPUs to itself (``ledger.alone``); one that declared is ``ledger.sized``.
    declared: dict[int, int] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)  # gpu -> the most device memory it was measured to hold
    placed: bool = False  # the scheduler restored or granted it: its footprint is where a plan put it
    faulted: str = ""  # why, if faulted: its state is damaged or unknown, and an operator must resume it
    exiting: bool = False
    freezes: bool = True  # see JobRegistered.freezes: it may be preempted
    # Host memory (``host``): slot -> the bytes its parked state takes on that node's host while it
    # is parked (or restoring), and the size its last park measured there (what the next is expected to take).
    parked: dict[int, int] = field(default_factory=dict)
    parked_size: dict[int, int] = field(default_factory=dict)
    refusal: Refusal | None = None  # its last park failed with its state intact: not tried again for now
    last_granted: float = float("-inf")  # the least recently granted are parked first
    # The queue policy's inputs (core/policy.py): its priority and weight as registered, and the
    # seconds it held its group (scheduling state, not a figure: ``fair`` decides by it).
    priority: int = 0
    weight: float = 1.0
    held_s: float = 0.0
    # What switch-cost awareness decides by (core/anticipation.py; scheduling state too): when it last
    # released its group, its last gaps (release to its next acquire) and its last moves' durations.
    released_at: float | None = None
    gaps: tuple[float, ...] = ()
    move_times: tuple[float, ...] = ()
    # figures
    slices: int = 0
    preemptions: int = 0
    restores: int = 0
    snapshots: int = 0
    gpu_seconds: float = 0.0
    bytes_moved: int = 0
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    phases: Phases = field(default_factory=Phases)  # its GPU phases and gaps, for the placement advisor


@dataclass
class Switch:
    incoming: str
    started_at: float
    pending: set[int] = field(default_factory=set)  # snapshot / restore ops in flight
    restoring: bool = False


@dataclass
class Group:
    name: str
    gpus: tuple[int, ...]
    queue: list[Waiter] = field(default_factory=list)
    holder: str | None = None
    holder_sessions: set[SessionId] = field(default_factory=set)
    held_since: float = 0.0
    overdue_since: float | None = None  # when the holder was warned that its slice is over
    fence: int = 0
    switch: Switch | None = None
    last_holder: str | None = None
    draining: bool = False
    blocked: str | None = None  # the head job while it waits for memory or for a rival to leave
    waiting_for: str | None = None  # what the head waits for then (shown in status)
    # figures
    created_at: float = 0.0
    grants: int = 0
    switches: int = 0
    preemptions: int = 0
    bytes_moved: int = 0
    held_total_s: float = 0.0
    deferred: int = 0  # times the head of the queue had to wait for memory or for a rival to leave
    switch_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    wait_times: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


@dataclass(frozen=True)
class Wait:
    """A head of a queue that cannot be made room for now, but will be once ``on`` move on by themselves.

    ``on``: the jobs in its way that hold a lock, are on the move or are being reclaimed (never
    empty: a wait that nothing will end is a ``Refuse``). ``why`` is shown in status.
    """

    why: str
    on: frozenset[str]


@dataclass(frozen=True)
class Refuse:
    """A head of a queue that cannot be made room for, and nothing under way will change that: it is told now."""

    error: TimeslicedError
