"""What a cluster node tells its shell to do (pure data), carried out front to back.

A ``Persist`` (the election's) must be durable before any later ``Send`` is handed to the transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import errors
from ..core.election import Persist
from ..core.events import GrantLock
from .messages import PeerMessage


@dataclass(frozen=True)
class Send:
    """Hand ``message.to_wire()`` to the transport for peer ``to`` (best effort: it may be lost)."""

    to: str
    message: PeerMessage


@dataclass(frozen=True)
class Reply:
    conn: int
    rid: int
    result: Any


@dataclass(frozen=True)
class Fail:
    conn: int
    rid: int
    error: errors.TimeslicedError


@dataclass(frozen=True)
class Push:
    conns: tuple[int, ...]
    event: str
    data: dict[str, Any]


@dataclass(frozen=True)
class RunMove:
    """Carry out ``kind`` (snapshot, restore, reclaim) of this node's part of ``job``; answer ``move_finished(key)``."""

    key: tuple[int, int, int]  # (term, gen, op)
    kind: str
    job: str
    # a restore streaming into the room of these snapshots (their keys, the ones this node runs): the
    # shell streams them together where its backend can, else starts the restore once they ended
    streams_with: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Allocate:
    """Create a simulated region; on failure call ``freed`` so the leader's ledger gives the bytes back."""

    conn: int
    rid: int
    job: str
    gpu: int
    nbytes: int
    requested: int


@dataclass(frozen=True)
class RecordGrant:
    """The leader granted (figures); ``grant`` is the scheduler's own."""

    grant: GrantLock


@dataclass(frozen=True)
class Noted:
    """Something for the log and the history: ``kind`` is leader, problem, faulted, slice_overdue or preempted."""

    kind: str
    text: str
    job: str | None = None
    group: str | None = None


Effect = Send | Persist | Reply | Fail | Push | RunMove | Allocate | RecordGrant | Noted
