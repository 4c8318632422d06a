"""What a node asks of the leader for its clients, and what the leader answers (pure, typed).

Requests (``Register``, ``Acquire``, ``Cancel``, ``Release``, ``Alloc``) carry the client's
connection and request id, and get an answer; notices (``Closed``, ``Freed``, ``Gone``,
``MoveDone``) tell the leader what happened on the node and get none. The daemon builds a request
from its client's op; the node forwards it (a ``req``/``note`` message) or, when it leads, hands it
to its orchestrator in the same call. Each type knows its ``OP``: the wire name of what is asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from .. import errors
from ..core.ids import SESSION_STRIDE
from ..core.location import Location
from .fields import MAX_INT, Enum, Flag, Float, Int, Map, Optional, Plain, Seq, Text, Wire

CONN = Int(0, SESSION_STRIDE - 1)  # a connection of one node; the leader makes it a session (core/ids.py)
RID = Int()
NAME = Text(name=True)
GPU = Int()  # a GPU index as a node's client names it; the leader refuses one the node cannot have
BYTES = Int()
MAX_BYTES = MAX_INT
PRIORITY = Int(-1_000_000, 1_000_000)  # a job's priority (core JobRegistered.priority)
MEMBERS = Int(0, 64)  # a gang's members (0: not a gang member)


class Ask(Wire):
    OP: ClassVar[str]


# --- requests: answered ----------------------------------------------------------------


@dataclass(frozen=True)
class Register(Ask):
    """``extra``: what the node's shell adds to the client's reply (its own session id, the parking method)."""

    OP = "register"
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    job: Annotated[str, NAME]
    group: Annotated[str, NAME]
    gpus: Annotated[tuple[int, ...] | None, Optional(Seq(GPU))] = None
    pids: Annotated[tuple[int, ...], Seq(Int())] = ()
    exclusive: Annotated[bool, Flag()] = False
    extra: Annotated[dict[str, Any], Plain(map_only=True)] = field(default_factory=dict)
    freezes: Annotated[bool, Flag()] = True  # its parking method stops its GPU work first (core JobRegistered)
    # the device memory it declares (core JobRegistered.memory / memory_each): per GPU, or for each of its GPUs
    memory: Annotated[dict[int, int] | None, Optional(Map(GPU, BYTES))] = None
    memory_each: Annotated[int | None, Optional(BYTES)] = None
    priority: Annotated[int, PRIORITY] = 0  # what the group's queue policy reads (core JobRegistered)
    weight: Annotated[float, Float()] = 1.0
    party: Annotated[str | None, Optional(NAME)] = None  # who the session acts for (core JobRegistered.party)


@dataclass(frozen=True)
class Acquire(Ask):
    OP = "acquire"
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    timeout: Annotated[float | None, Optional(Float())] = None
    gang: Annotated[str | None, Optional(NAME)] = None  # a gang member's (core AcquireRequested.gang)
    members: Annotated[int, MEMBERS] = 0


@dataclass(frozen=True)
class Cancel(Ask):
    """Withdraw the acquire with request id ``request``."""

    OP = "cancel"
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    request: Annotated[int, RID]


@dataclass(frozen=True)
class Release(Ask):
    OP = "release"
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]


@dataclass(frozen=True)
class Alloc(Ask):
    """Simulated memory: ``nbytes`` (rounded) on the node's ``gpu``, of ``requested`` asked."""

    OP = "alloc"
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    gpu: Annotated[int, GPU]
    nbytes: Annotated[int, Int(1)]
    requested: Annotated[int, Int(1)]


Request = Register | Acquire | Cancel | Release | Alloc
REQUESTS: dict[str, type[Request]] = {cls.OP: cls for cls in (Register, Acquire, Cancel, Release, Alloc)}
LATER = (Acquire, Alloc)  # answered by a grant, an allocation or a failure, not by the result


# --- notices: not answered ----------------------------------------------------------------


@dataclass(frozen=True)
class Closed(Ask):
    OP = "closed"
    conn: Annotated[int, CONN]


@dataclass(frozen=True)
class Freed(Ask):
    """Simulated memory of ``job`` on the node's ``gpu`` was freed (or its allocation failed)."""

    OP = "freed"
    job: Annotated[str, NAME]
    gpu: Annotated[int, GPU]
    nbytes: Annotated[int, BYTES]


@dataclass(frozen=True)
class Gone(Ask):
    """No process of ``job`` is alive on the node and none is connected."""

    OP = "gone"
    job: Annotated[str, NAME]


@dataclass(frozen=True)
class MoveDone(Ask):
    """The node's part of move ``op`` ended."""

    OP = "move_done"
    op: Annotated[int, Int()]
    ok: Annotated[bool, Flag()]
    nbytes: Annotated[int, BYTES] = 0
    seconds: Annotated[float, Float(any_sign=True)] = 0.0
    error: Annotated[str, Text()] = ""
    intact: Annotated[bool, Flag()] = False  # a failure that left the job's state where it was (errors.StateIntact)
    code: Annotated[str, Text()] = ""  # the failure's error code


@dataclass(frozen=True)
class HostRead(Ask):
    """The node read its host's memory for parked state (see core ``HostMemoryRead``), with no park under way."""

    OP = "host_read"
    room: Annotated[int, Int(-MAX_BYTES, MAX_BYTES)]
    limit: Annotated[int | None, Optional(BYTES)] = None
    pools: Annotated[dict[str, int], Map(Text(), Int(-MAX_BYTES, MAX_BYTES))] = field(default_factory=dict)
    members: Annotated[dict[str, tuple[str, ...]], Map(NAME, Seq(Text()))] = field(default_factory=dict)
    sizes: Annotated[dict[str, int], Map(NAME, BYTES)] = field(default_factory=dict)
    source: Annotated[dict[str, str], Map(Text(), Text())] = field(default_factory=dict)


@dataclass(frozen=True)
class Measured(Ask):
    """The device memory ``job`` was seen to hold on the node's GPUs (core ``MemoryMeasured``), sent when it grew."""

    OP = "measured"
    job: Annotated[str, NAME]
    held: Annotated[dict[int, int], Map(GPU, BYTES)]  # GPU -> bytes


Notice = Closed | Freed | Gone | MoveDone | HostRead | Measured
NOTICES: dict[str, type[Notice]] = {cls.OP: cls for cls in (Closed, Freed, Gone, MoveDone, HostRead, Measured)}


# --- answers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registered(Wire):
    """The leader's answer to ``Register``; ``gpus`` are the group's, cluster-wide."""

    job: Annotated[str, NAME]
    group: Annotated[str, NAME]
    gpus: Annotated[tuple[int, ...], Seq(Int())]
    location: Annotated[Location, Enum(Location)]


@dataclass(frozen=True)
class WireError(Wire):
    """A ``TimeslicedError`` as it crosses between nodes (``errors.to_wire``)."""

    code: Annotated[str, Text()]
    message: Annotated[str, Text()]
    details: Annotated[dict[str, Any], Plain(map_only=True)] = field(default_factory=dict)

    @classmethod
    def of(cls, exc: errors.TimeslicedError) -> WireError:
        return cls(exc.code, exc.message, dict(exc.details))

    def exception(self) -> errors.TimeslicedError:
        return errors.from_wire(self.to_wire())

    def to_wire(self) -> dict[str, Any]:
        out = super().to_wire()
        if not self.details:  # as errors.to_wire writes it
            del out["details"]
        return out

    @classmethod
    def from_wire(cls, data: Any, path: str = "") -> WireError:
        if isinstance(data, dict) and "details" not in data:
            data = {**data, "details": {}}
        return super().from_wire(data, path)
