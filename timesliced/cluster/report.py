"""What a node reports to a new era's leader (pure, typed): the leader's state is rebuilt from these.

A node reports once its own moves have finished: its GPUs, its sessions, where each of its jobs'
state lives, the holders and fences it delivered, the acquires waiting for a grant (with the place
the previous leader gave them, ``seq``, and the order they arrived here), and the turns a restarted
node keeps for its jobs. Times travel as durations from the report (``deadline_in``, ``kept_for``),
since nodes do not share a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from ..core.ids import GPU_STRIDE
from ..core.location import Location
from .asks import BYTES, CONN, GPU, NAME, RID
from .fields import Enum, Flag, Float, Int, Map, Nested, Optional, Seq, Text, Wire

LOCAL_GPU = Int(0, GPU_STRIDE - 1)
FOOTPRINT = Map(LOCAL_GPU, BYTES)  # this node's GPU -> bytes


@dataclass(frozen=True)
class ReportedSession(Wire):
    conn: Annotated[int, CONN]
    job: Annotated[str, NAME]
    pids: Annotated[tuple[int, ...], Seq(Int())] = ()
    party: Annotated[str | None, Optional(NAME)] = None  # as registered (cluster Register.party)


@dataclass(frozen=True)
class ReportedJob(Wire):
    """``span``: its group's GPUs, cluster-wide; ``gone``: none of its processes here is alive."""

    job: Annotated[str, NAME]
    group: Annotated[str, NAME]
    exclusive: Annotated[bool, Flag()]
    location: Annotated[Location, Enum(Location)]
    footprint: Annotated[dict[int, int], FOOTPRINT]
    faulted: Annotated[str, Text()]
    span: Annotated[tuple[int, ...], Seq(Int())]
    gone: Annotated[bool, Flag()] = False
    freezes: Annotated[bool, Flag()] = True
    # the device memory it declared here (cluster Register.memory / memory_each), so a new leader plans with it
    memory: Annotated[dict[int, int] | None, Optional(Map(GPU, BYTES))] = None
    memory_each: Annotated[int | None, Optional(BYTES)] = None
    priority: Annotated[int, Int(-1_000_000, 1_000_000)] = 0  # as registered: the leader's queue policy reads it
    weight: Annotated[float, Float()] = 1.0


@dataclass(frozen=True)
class ReportedHolder(Wire):
    group: Annotated[str, NAME]
    job: Annotated[str, NAME]
    fence: Annotated[int, Int()]
    conns: Annotated[tuple[int, ...], Seq(CONN)]


@dataclass(frozen=True)
class ReportedWait(Wire):
    """``seq``: its place in the previous leader's queue (None: never queued); ``order``: as it arrived here."""

    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    seq: Annotated[int | None, Optional(Int())]
    order: Annotated[int, Int()]
    deadline_in: Annotated[float | None, Optional(Float())]
    gang: Annotated[str | None, Optional(NAME)] = None  # a gang member's acquire: queued again as one
    members: Annotated[int, Int(0, 64)] = 0


@dataclass(frozen=True)
class ReportedTurn(Wire):
    """A place kept for ``job`` for ``kept_for`` more seconds; ``seq`` -1: it held the group."""

    job: Annotated[str, NAME]
    seq: Annotated[int, Int(-1)]
    order: Annotated[int, Int()] = 0
    kept_for: Annotated[float, Float()] = 0.0


@dataclass(frozen=True)
class NodeReport(Wire):
    devices: Annotated[dict[int, int], Map(LOCAL_GPU, BYTES)]  # GPU -> capacity
    sessions: Annotated[tuple[ReportedSession, ...], Seq(Nested(ReportedSession))] = ()
    jobs: Annotated[tuple[ReportedJob, ...], Seq(Nested(ReportedJob))] = ()
    holders: Annotated[tuple[ReportedHolder, ...], Seq(Nested(ReportedHolder))] = ()
    waiting: Annotated[tuple[ReportedWait, ...], Seq(Nested(ReportedWait))] = ()
    fences: Annotated[dict[str, int], Map(NAME, Int())] = field(default_factory=dict)
    turns: Annotated[tuple[ReportedTurn, ...], Seq(Nested(ReportedTurn))] = ()
