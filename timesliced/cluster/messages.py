"""The peer protocol: every message between cluster nodes, typed (pure).

Each message is a frozen dataclass, checked when read, with ``to_wire()`` (a map of plain values
with a ``k`` key naming its kind) and ``from_wire()``. ``message_from_wire`` reads any of them and
raises ``MalformedPeerMessage`` for anything the protocol does not allow, naming the field, before any
state is touched. Peers of one release talk to each other only.

Nodes to the leader: ``Report`` (the answer to ``Sync``), ``Resync`` (take stock again), ``Req``
(a client's request, answered by ``Res``) and ``Note`` (a notice). The leader to nodes: ``Sync``
opens an era, ``Ready`` ends it being taken stock of, then ``Res``, ``Grant``, ``Failed``,
``Queued``, ``Notify``, ``Move``, ``Span`` and ``Allotted``. Each but ``Elect`` (which wraps the
election core's own messages) carries the era ``(term, gen)`` it belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeVar

from ..core import election
from .asks import CONN, NAME, NOTICES, REQUESTS, RID, Notice, Registered, Request, WireError
from .fields import (
    Choice,
    Field,
    Flag,
    Float,
    Int,
    Nested,
    Optional,
    Pair,
    Plain,
    Seq,
    Text,
    Wire,
    refuse,
)
from .fields import MalformedPeerMessage as MalformedPeerMessage  # what message_from_wire raises
from .report import LOCAL_GPU, NodeReport

M = TypeVar("M", bound="Message")
Era = tuple[int, int]  # (term, gen): gen counts the leader's resynchronisations within its term
ERA = Pair(Int(), Int())
MOVE_KINDS = ("snapshot", "restore", "reclaim")


class Message(Wire):
    K: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"k": self.K, **super().to_wire()}

    @classmethod
    def from_wire(cls: type[M], data: Any, path: str = "") -> M:
        return super().from_wire(data, path or cls.K)


# --- the election's own messages ---------------------------------------------------------


class ElectionMessage(Field):
    """One of the election core's own messages (``core/election.py``), which read and check themselves."""

    what = "an election message"

    def load(self, value: Any, path: str) -> election.Message:
        try:
            return election.message_from_wire(value)
        except ValueError as exc:
            raise MalformedPeerMessage(f"{path}: {exc}") from None

    def dump(self, value: Any) -> Any:
        return value.to_wire()


@dataclass(frozen=True)
class Elect(Message):
    K = "elect"
    m: Annotated[election.Message, ElectionMessage()]


# --- taking stock ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sync(Message):
    """The leader opens ``era``: answer with a ``Report`` once this node's moves are done."""

    K = "sync"
    era: Annotated[Era, ERA]


@dataclass(frozen=True)
class Resync(Message):
    """A node asks its leader to take stock again (it may have missed messages)."""

    K = "resync"
    era: Annotated[Era, ERA]


@dataclass(frozen=True)
class Report(Message):
    K = "report"
    era: Annotated[Era, ERA]
    report: Annotated[NodeReport, Nested(NodeReport)]


@dataclass(frozen=True)
class Ready(Message):
    """The leader rebuilt its state with this node's report: forward again."""

    K = "ready"
    era: Annotated[Era, ERA]


# --- requests and notices, and their answers ------------------------------------------------


class Carried(Field):
    """An ``Ask`` of one of ``table``'s types, written beside its message's fields as ``op`` and ``args``."""

    def __init__(self, table: Mapping[str, type[Wire]]) -> None:
        self.table = table
        self.what = f"one of {sorted(table)}"

    def read(self, data: dict[str, Any], kind: str) -> Any:
        """The ask held by ``data["op"]`` and ``data["args"]``."""
        op = data.get("op")
        cls = self.table.get(op) if isinstance(op, str) else None
        if cls is None:
            refuse(f"{kind}.op", self.what, op)
        return cls.from_wire(data.get("args"), f"{kind}.args")


def _read(data: dict[str, Any], kind: str, name: str, field: Field) -> Any:
    if name not in data:
        raise MalformedPeerMessage(f"{kind}.{name} is missing")
    return field.load(data[name], f"{kind}.{name}")


REQUEST = Carried(REQUESTS)
NOTICE = Carried(NOTICES)
REQ_ID = Int(1)


@dataclass(frozen=True)
class Req(Message):
    """A client's request, forwarded; ``id`` (the node's own) comes back in the ``Res``."""

    K = "req"
    era: Annotated[Era, ERA]
    id: Annotated[int, REQ_ID]
    request: Annotated[Request, REQUEST]

    def to_wire(self) -> dict[str, Any]:
        return {
            "k": self.K,
            "era": list(self.era),
            "id": self.id,
            "op": self.request.OP,
            "args": self.request.to_wire(),
        }

    @classmethod
    def from_wire(cls, data: Any, path: str = "") -> Req:
        return cls(_read(data, "req", "era", ERA), _read(data, "req", "id", REQ_ID), REQUEST.read(data, "req"))


@dataclass(frozen=True)
class Note(Message):
    K = "note"
    era: Annotated[Era, ERA]
    notice: Annotated[Notice, NOTICE]

    def to_wire(self) -> dict[str, Any]:
        return {"k": self.K, "era": list(self.era), "op": self.notice.OP, "args": self.notice.to_wire()}

    @classmethod
    def from_wire(cls, data: Any, path: str = "") -> Note:
        return cls(_read(data, "note", "era", ERA), NOTICE.read(data, "note"))


@dataclass(frozen=True)
class Res(Message):
    """The answer to ``Req`` ``id``, whose request was ``op``: its ``result``, or an ``error``."""

    K = "res"
    era: Annotated[Era, ERA]
    id: Annotated[int, REQ_ID]
    op: Annotated[str, Choice(*REQUESTS)]
    result: Annotated[Registered | Any, Plain()] = None  # read by from_wire below
    error: Annotated[WireError | None, Optional(Nested(WireError))] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": self.K, "era": list(self.era), "id": self.id, "op": self.op, "ok": self.ok}
        if self.error is not None:
            out["error"] = self.error.to_wire()
        else:
            out["result"] = self.result.to_wire() if isinstance(self.result, Registered) else self.result
        return out

    @classmethod
    def from_wire(cls, data: Any, path: str = "") -> Res:
        era, rid = _read(data, "res", "era", ERA), _read(data, "res", "id", REQ_ID)
        op = _read(data, "res", "op", Choice(*REQUESTS))
        if not _read(data, "res", "ok", Flag()):
            return cls(era, rid, op, error=_read(data, "res", "error", Nested(WireError)))
        result = Nested(Registered) if op == "register" else Plain()
        return cls(era, rid, op, _read(data, "res", "result", result))


# --- the leader's directions ------------------------------------------------------------------


@dataclass(frozen=True)
class GrantInfo(Wire):
    """What a granted client gets (its reply, or its ``granted`` push), as the scheduler's grant says."""

    group: Annotated[str, NAME]
    job: Annotated[str, NAME]
    fence: Annotated[int, Int()]
    waited_s: Annotated[float, Float(any_sign=True)]
    switch_s: Annotated[float, Float(any_sign=True)]
    restored: Annotated[bool, Flag()]
    term: Annotated[int, Int()]


@dataclass(frozen=True)
class Grant(Message):
    """``tickets``: the ``(conn, rid)`` on this node that wait for it; ``again``: another session of
    the job that holds already, under the same fence."""

    K = "grant"
    era: Annotated[Era, ERA]
    tickets: Annotated[tuple[tuple[int, int], ...], Seq(Pair(CONN, RID))]
    info: Annotated[GrantInfo, Nested(GrantInfo)]
    again: Annotated[bool, Flag()] = False


@dataclass(frozen=True)
class Failed(Message):
    """The request ``(conn, rid)`` failed (``rid`` 0: a preempted job that will not be granted again)."""

    K = "fail"
    era: Annotated[Era, ERA]
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    error: Annotated[WireError, Nested(WireError)]


@dataclass(frozen=True)
class Queued(Message):
    """The acquire ``(conn, rid)`` has place ``seq`` in its group's queue (kept across leaders)."""

    K = "queued"
    era: Annotated[Era, ERA]
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    seq: Annotated[int, Int(1)]


@dataclass(frozen=True)
class Notify(Message):
    """Push ``event`` with ``data`` to the clients of ``job`` on this node."""

    K = "notify"
    era: Annotated[Era, ERA]
    job: Annotated[str, NAME]
    event: Annotated[str, Text(name=True)]
    data: Annotated[dict[str, Any], Plain(map_only=True)] = field(default_factory=dict)


@dataclass(frozen=True)
class Move(Message):
    """Carry out ``kind`` of this node's part of ``job``; answer ``MoveDone(op)``."""

    K = "move"
    era: Annotated[Era, ERA]
    op: Annotated[int, Int()]
    kind: Annotated[str, Choice(*MOVE_KINDS)]
    job: Annotated[str, NAME]
    # a restore that streams into the room of these snapshots (ops; core RestoreJob.streams_with)
    streams_with: Annotated[tuple[int, ...], Seq(Int())] = ()


@dataclass(frozen=True)
class Span(Message):
    """The GPUs of ``group``, cluster-wide, are now ``gpus``."""

    K = "span"
    era: Annotated[Era, ERA]
    group: Annotated[str, NAME]
    gpus: Annotated[tuple[int, ...], Seq(Int())]


@dataclass(frozen=True)
class Allotted(Message):
    """The leader's ledger gave ``nbytes`` on this node's ``gpu`` to the alloc ``(conn, rid)``: create it."""

    K = "alloc"
    era: Annotated[Era, ERA]
    conn: Annotated[int, CONN]
    rid: Annotated[int, RID]
    job: Annotated[str, NAME]
    gpu: Annotated[int, LOCAL_GPU]
    nbytes: Annotated[int, Int(1)]
    requested: Annotated[int, Int(1)]


FromNode = Report | Resync | Req | Note
FromLeader = Ready | Res | Grant | Failed | Queued | Notify | Move | Span | Allotted
PeerMessage = Elect | Sync | FromNode | FromLeader
MESSAGES: tuple[type[PeerMessage], ...] = (
    Elect,
    Sync,
    Resync,
    Report,
    Ready,
    Req,
    Note,
    Res,
    Grant,
    Failed,
    Queued,
    Notify,
    Move,
    Span,
    Allotted,
)
_BY_KIND: dict[str, type[PeerMessage]] = {cls.K: cls for cls in MESSAGES}


def message_from_wire(value: Any) -> PeerMessage:
    """Read any peer message; raises ``MalformedPeerMessage`` (naming the field) for anything else."""
    kind = value.get("k") if isinstance(value, dict) else None
    cls = _BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None:
        if not isinstance(value, dict):
            refuse("message", "a map", value)
        refuse("k", f"one of {sorted(_BY_KIND)}", kind)
    message: PeerMessage = cls.from_wire(value)
    return message
