"""One daemon's part in the cluster (pure): election, forwarding, fencing; the leader's half is ``leader.py``.

Every daemon runs a ``ClusterNode``. Its clients' requests (typed: ``asks.py``) go to the leader:
directly, inside the same call, when this node leads; otherwise as ``Req`` messages whose answers
come back later. What the leader decides comes back as messages (a grant, a move to carry out on
this node's part of a job, an allocation) that this node turns into effects for its shell. A
single daemon is a cluster of one that leads at once, so the same code serves both.

No I/O and no clock: inputs carry ``now``; outputs are effects (``drain()``), carried out front to
back (a ``Persist`` must be durable before any later ``Send``). ``next_deadline()`` says when to
call ``handle_timers``.

Fencing: a node takes directions only from the leader its election core follows, in the era
``(term, gen)`` that leader opened with ``Sync``; grants of a group must carry a ``(term, fence)``
at least as high as the last one it delivered. Everything else is refused and counted.

Leader change: the new leader sends ``Sync``; every node answers with a ``Report`` of what it
knows (its sessions, where each of its jobs' state lives, holders and their fences, waiting
acquires with the order the last leader gave them) once its own moves have finished; the leader
rebuilds its scheduler from the reports and sends ``Ready``, after which the nodes forward again,
resending what was never answered.

Inputs that raise change nothing. ``receive`` reads a peer's message at the boundary and refuses a
malformed one with ``MalformedPeerMessage``; a client's request that is refused raises
``TimeslicedError`` before anything is forwarded. Past those, each handler checks everything it
needs (lookups, location changes) before its first change, so any other exception is a bug, and
it too leaves the node as it was. (A refusal from a leader this node is, like one that comes over
the network, is an answer: the node's own part of the request stands — a release lets go, an
acquire gives up a kept turn.)
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..core.election import BecameLeader, Election, LeaderChanged, Persist, Persisted, SteppedDown
from ..core.election import Send as ElectionSend
from ..core.events import DrainRequested, FaultCleared, ForceReleaseRequested
from ..core.ids import gpu_slot, local_gpu
from ..core.location import Cause, Location, moved
from ..core.model import AUTO
from ..core.policy import QueuePolicy
from ..core.residency import Options
from ..core.scheduler import Scheduler
from ..core.slices import SlicePolicy
from ..wire import status
from .asks import (
    LATER,
    Acquire,
    Closed,
    Freed,
    Gone,
    HostRead,
    Measured,
    MoveDone,
    Notice,
    Register,
    Registered,
    Release,
    Request,
)
from .effects import Allocate, Effect, Fail, Noted, Push, Reply, RunMove, Send
from .fields import MalformedPeerMessage
from .leader import Leader
from .messages import (
    Allotted,
    Elect,
    Era,
    Failed,
    Grant,
    Move,
    Note,
    Notify,
    PeerMessage,
    Queued,
    Ready,
    Report,
    Req,
    Res,
    Resync,
    Span,
    Sync,
    message_from_wire,
)
from .report import NodeReport, ReportedHolder, ReportedJob, ReportedSession, ReportedTurn, ReportedWait

PENDING = object()  # the answer to a request comes later, as a Reply or Fail effect

STARTED = {"snapshot": Cause.SNAPSHOT_STARTED, "restore": Cause.RESTORE_STARTED}
FINISHED = {
    ("snapshot", True): Cause.SNAPSHOT_DONE,
    ("snapshot", False): Cause.SNAPSHOT_FAILED,  # the backend keeps it resident
    ("restore", True): Cause.RESTORE_DONE,
    ("restore", False): Cause.RESTORE_FAILED,  # the backend keeps it parked
}
NOTHING_TO_DO = {"snapshot": Location.PARKED, "restore": Location.RESIDENT}  # where a move has nothing to do


# --- what this node knows --------------------------------------------------------------


@dataclass
class LocalJob:
    name: str
    group: str
    exclusive: bool
    span: tuple[int, ...]  # the group's GPUs, cluster-wide ids
    location: Location = Location.RESIDENT  # changed only through ``moved`` (core/location.py)
    footprint: dict[int, int] = field(default_factory=dict)  # local GPU -> bytes (simulated memory)
    faulted: str = ""
    gone: bool = False  # reported: none of its processes on this node is alive
    sessions: set[int] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)
    freezes: bool = True  # its parking method stops its GPU work first (core JobRegistered.freezes)
    memory: dict[int, int] | None = None  # local GPU -> declared bytes (core JobRegistered.memory), for reports
    memory_each: int | None = None  # declared for each of its GPUs here (core JobRegistered.memory_each)
    priority: int = 0  # as registered (core JobRegistered.priority): the leader's queue policy reads it
    weight: float = 1.0


@dataclass
class Holding:
    job: str
    term: int
    fence: int
    conns: set[int]


@dataclass
class Waiting:
    order: int
    deadline: float | None
    seq: int | None = None
    gang: str | None = None  # a gang member's acquire (core AcquireRequested.gang)
    members: int = 0


@dataclass
class Turn:
    """A place a restarted node keeps for its job: it held (``seq`` -1) or waited when the daemon died."""

    seq: int
    until: float


@dataclass
class Pending:
    """A forwarded request without an answer; ``resent``: sent again in a later era."""

    ask: Request
    resent: bool = False


class ClusterNode:
    def __init__(
        self,
        node_id: str,
        members: tuple[str, ...],
        devices: dict[int, int],
        *,
        rng: random.Random,
        election_timeout: tuple[float, float] = (1.0, 2.0),
        heartbeat_interval: float = 0.25,
        persisted: Persisted | None = None,
        max_waiters: int = 1024,
        op_timeout: float = 600.0,
        sync_timeout: float | None = None,
        policies: dict[str, SlicePolicy] | None = None,
        residency: Options | None = None,
        queue_policies: dict[str, QueuePolicy] | None = None,
    ) -> None:
        members = tuple(sorted(members))
        if node_id not in members:
            raise ValueError(f"node {node_id!r} is not one of the members {list(members)}")
        if len(set(members)) != len(members):
            raise ValueError(f"members are not distinct: {list(members)}")
        self.node_id = node_id
        self.members = members
        self.slot = members.index(node_id)
        self.devices = dict(devices)
        self.election = Election(
            node_id,
            tuple(m for m in members if m != node_id),
            rng=rng,
            election_timeout=election_timeout,
            heartbeat_interval=heartbeat_interval,
            persisted=persisted,
        )
        self.lead = Leader(
            node_id,
            members,
            self.election,
            max_waiters=max_waiters,
            op_timeout=op_timeout,
            sync_timeout=sync_timeout if sync_timeout is not None else election_timeout[1],
            policies=dict(policies or {}),
            residency=residency,
            queue_policies=dict(queue_policies or {}),
        )
        self.era: Era | None = None  # the era this node takes directions in
        self.leader: str | None = None  # who opened it
        self.ready = False  # the leader rebuilt its state with our report: forward to it
        self.sessions: dict[int, str] = {}  # conn -> job
        self.parties: dict[int, str] = {}  # conn -> the party it acts for, if it named one (Register.party)
        self.jobs: dict[str, LocalJob] = {}
        self.holders: dict[str, Holding] = {}  # group -> holder, as delivered here
        self.fences: dict[str, tuple[int, int]] = {}  # group -> highest (term, fence) delivered here
        self.waiting: dict[tuple[int, int], Waiting] = {}  # (conn, rid) -> acquire waiting for its grant
        self.turns: dict[str, Turn] = {}  # job -> its place, kept after a restart until it asks again
        self.refused = 0
        self._pending: dict[int, Pending] = {}  # forwarded requests without an answer, by req id
        self._sent: set[int] = set()  # which of them went to the current leader
        self._notes: list[Notice] = []  # one-way notices for the leader, held until ready
        self.host: HostRead | None = None  # the latest reading of this node's host, for every new leader
        self._moving: dict[tuple[int, int, int], tuple[str, str]] = {}  # key -> (kind, job)
        self._report_due = False
        self._next_req = 1
        self._order = itertools.count(1)
        self._effects: list[Effect] = []
        self._inbox: list[tuple[str, PeerMessage]] = []  # messages to this node from itself

    # --- queries -------------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler | None:
        """The cluster's scheduler, on the leader once it has rebuilt its state."""
        return self.lead.orch.scheduler if self.lead.orch is not None else None

    @property
    def leading(self) -> bool:
        return self.lead.orch is not None

    @property
    def linked(self) -> set[str]:
        return self.lead.linked

    @property
    def problems(self) -> list[str]:
        return self.lead.problems

    def local_gpus(self, job: str) -> tuple[int, ...]:
        return tuple(local_gpu(g) for g in self.jobs[job].span if gpu_slot(g) == self.slot)

    def held_gpus(self) -> set[int]:
        """This node's GPUs whose group has a holder (as delivered here)."""
        return {g for h in self.holders.values() if h.job in self.jobs for g in self.local_gpus(h.job)}

    def next_deadline(self) -> float | None:
        times = [t for t in (self.election.next_deadline(), self.lead.next_deadline()) if t is not None]
        deadline = min(times, default=float("inf"))
        return None if deadline == float("inf") else deadline

    def describe_local(self) -> status.LocalPicture:
        """This node's own GPUs and jobs, as it knows them (a follower's status)."""
        jobs = self.jobs.values()
        return {
            "devices": [
                {
                    "index": gpu,
                    "capacity": cap,
                    "used": sum(j.footprint.get(gpu, 0) for j in jobs if j.location.occupies_device),
                    "jobs": {
                        j.name: {"bytes": j.footprint[gpu], "location": j.location.value}
                        for j in jobs
                        if j.footprint.get(gpu)
                    },
                }
                for gpu, cap in sorted(self.devices.items())
            ],
            "jobs": [
                {
                    "job": j.name,
                    "group": j.group,
                    "location": j.location.value,
                    "faulted": j.faulted or None,
                    "sessions": len(j.sessions),
                    "pids": sorted(j.pids),
                    "footprint": {str(k): v for k, v in sorted(j.footprint.items())},
                }
                for j in jobs
            ],
        }

    def describe(self, now: float) -> status.ClusterCore:
        return {
            "node": self.node_id,
            "slot": self.slot,
            "members": list(self.members),
            "election": self.election.describe(now),
            "leader": self.election.leader,
            "era": list(self.era) if self.era else None,
            "ready": self.ready,
            "leading": self.leading,
            "linked": sorted(self.linked),
            "reporters": sorted(self.lead.reporters) if self.leading else [],
            "offline": self.lead.offline(),
            "pending": len(self._pending),
            "refused": self.refused,
            "problems": self.problems[-20:],
        }

    def drain(self) -> list[Effect]:
        out, self._effects = self._effects, []
        return out

    # --- inputs --------------------------------------------------------------------------

    def start(self, now: float) -> None:
        self.election.start(now)
        self._pump(now)

    def request(self, ask: Request, now: float) -> Any:
        """A client's request; the result, ``PENDING`` (a ``Reply`` or ``Fail`` comes later), or raises.

        Raises ``TimeslicedError`` for a request this node or its leader refuses.
        """
        try:
            return self._request(ask, now)
        finally:
            self._pump(now)

    def _request(self, ask: Request, now: float) -> Any:
        job = self.sessions.get(ask.conn)
        if isinstance(ask, Register):
            if job is not None:
                raise errors.AlreadyRegistered(f"this connection already registered job {job!r}")
        elif job is None:
            raise errors.NotRegistered("register a job before using the lock")
        if isinstance(ask, Acquire) and ask.rid == AUTO:
            raise errors.BadRequest(f"request id {AUTO} is reserved")
        if self.lead.orch is not None and self.ready:  # we lead: answer within this call
            try:
                result = self.lead.request(self.slot, ask, now)
            except errors.TimeslicedError:
                self._asked(ask, now, queued=False)
                raise
            if isinstance(ask, Register):
                reply = self._register_reply(ask, result)
                self._take_registered(ask, result)
                return reply
            self._asked(ask, now, queued=True)
            return PENDING if isinstance(ask, LATER) else result
        req = self._next_req
        message = Req(self.era, req, ask) if self.ready and self.leader is not None and self.era else None
        self._next_req += 1
        self._pending[req] = Pending(ask)
        self._asked(ask, now, queued=True)
        if message is not None:
            self._sent.add(req)
            self._to_leader(message)
        return PENDING

    def _asked(self, ask: Request, now: float, *, queued: bool) -> None:
        """This node's own part of a client's request (``queued``: the leader did not refuse it)."""
        job = self.sessions.get(ask.conn)
        if isinstance(ask, Acquire) and job is not None:
            if queued:
                deadline = None if ask.timeout is None else now + ask.timeout
                self.waiting[(ask.conn, ask.rid)] = Waiting(
                    next(self._order), deadline, gang=ask.gang, members=ask.members
                )
            self.turns.pop(job, None)
        elif isinstance(ask, Release) and job is not None:
            self._let_go(ask.conn, job)

    def admin(self, event: ForceReleaseRequested | DrainRequested | FaultCleared, now: float) -> Any:
        """An administrator's action; only the leader takes them (its dashboard). Raises ``TimeslicedError``."""
        if self.lead.orch is None:
            leader = self.election.leader
            raise errors.BadRequest(
                f"node {self.node_id!r} does not lead the cluster"
                + (f"; use the dashboard of {leader!r}" if leader else " (no leader right now)")
            )
        try:
            return self.lead.admin(event, now)
        finally:
            self._pump(now)

    def closed(self, conn: int, now: float) -> None:
        job_name = self.sessions.get(conn)
        waits = [k for k in self.waiting if k[0] == conn]
        reqs = [r for r, p in self._pending.items() if p.ask.conn == conn]
        # the leader may have registered it: it must hear of the close
        registering = any(isinstance(self._pending[r].ask, Register) and r in self._sent for r in reqs)
        notice = Closed(conn) if job_name is not None or registering else None
        self.sessions.pop(conn, None)
        self.parties.pop(conn, None)
        for key in waits:
            del self.waiting[key]
        for req in reqs:
            del self._pending[req]
            self._sent.discard(req)
        if job_name is not None and job_name in self.jobs:
            self.jobs[job_name].sessions.discard(conn)
            self._let_go(conn, job_name)
        if notice is not None:
            self._note(notice)
        self._pump(now)

    def _let_go(self, conn: int, job_name: str) -> None:
        """``conn`` no longer holds its job's group here (it released, or it closed)."""
        group = self.jobs[job_name].group
        holding = self.holders.get(group)
        if holding is not None and holding.job == job_name:
            holding.conns.discard(conn)
            if not holding.conns:
                del self.holders[group]

    def freed(self, job: str, gpu: int, nbytes: int, now: float) -> None:
        """Simulated memory of ``job`` on local ``gpu`` was freed (or an allocation failed)."""
        notice = Freed(job, gpu, nbytes)
        local = self.jobs.get(job)
        if local is not None:
            left = local.footprint.get(gpu, 0) - nbytes
            if left > 0:
                local.footprint[gpu] = left
            else:
                local.footprint.pop(gpu, None)
        self._note(notice)
        self._pump(now)

    def measured(self, job: str, gpus: dict[int, int], now: float) -> None:
        """``job`` was seen to hold ``gpus`` (local GPU -> bytes), more than before: the leader keeps its peak."""
        if job in self.jobs:
            self._note(Measured(job, dict(gpus)))
            self._pump(now)

    def gone(self, job: str, now: float) -> None:
        """No process of ``job`` is alive on this node and none is connected."""
        local = self.jobs.get(job)
        if local is None or local.gone:
            return
        notice = Gone(job)
        local.gone = True
        self._note(notice)
        self._pump(now)

    def move_finished(
        self,
        key: tuple[int, int, int],
        ok: bool,
        nbytes: int,
        seconds: float,
        error: str,
        now: float,
        *,
        intact: bool = False,
        code: str = "",
    ) -> None:
        """This node's part of a move (``RunMove``) ended. Raises ``ValueError`` for a move it never started.

        ``intact``: it failed and left the job's state where it was (``errors.StateIntact``); ``code``:
        the failure's error code.
        """
        if key not in self._moving:
            raise ValueError(f"no move {list(key)} is under way on node {self.node_id!r}")
        kind, name = self._moving[key]
        done = MoveDone(key[2], ok, nbytes, seconds, error, intact=intact and not ok, code=code)
        self._finish_move(key, kind, name, ok, done, now)
        self._pump(now)

    def host_read(self, reading: HostRead, now: float) -> None:
        """The node's daemon read its host's memory for parked state; the leader's scheduler admits parks by it.

        The latest reading is kept and sent again to every new era's leader once it is ready.
        """
        self.host = reading
        if self.ready and self.leader is not None and self.era is not None:
            self._to_leader(Note(self.era, reading))
        # else: not held with the other notices (one a second would pile up): ``_on_ready`` sends the latest
        self._pump(now)

    @property
    def moving(self) -> bool:
        """A snapshot or restore of this node is under way (a reading of the host now would count half of it)."""
        return any(kind != "reclaim" for kind, _ in self._moving.values())

    def _finish_move(
        self, key: tuple[int, int, int], kind: str, name: str, ok: bool, done: MoveDone, now: float
    ) -> None:
        job = self.jobs.get(name)
        location = None if kind == "reclaim" or job is None else moved(job.location, FINISHED[(kind, ok)])
        tell = key[:2] == self.era and self.leader is not None
        message = Note(key[:2], done) if tell else None
        self._moving.pop(key, None)
        if kind == "reclaim":
            if job is not None and not job.sessions:
                del self.jobs[name]
        elif job is not None and location is not None:
            job.location = location
        if message is not None:
            self._to_leader(message)
        self._maybe_report(now)  # a step of its own: the report waits for the node's moves

    def link(self, peer: str, up: bool, now: float) -> None:
        """The transport's outbound link to ``peer`` came up or went down."""
        was = peer in self.lead.linked
        try:
            if self.lead.link(peer, up, now):
                return
            if up and not was and peer == self.leader and self.era is not None:
                self._effects.append(Send(peer, Resync(self.era)))
        finally:
            self._pump(now)

    def receive(self, sender: str, message: Any, now: float) -> None:
        """A message (its wire map) from peer ``sender``, as the transport authenticated it.

        Raises ``MalformedPeerMessage`` for a message the protocol does not allow (the node is left
        as it was), and ``ValueError`` for a sender that is not a peer.
        """
        if sender not in self.members or sender == self.node_id:
            raise ValueError(f"message from unknown node {sender!r}")
        parsed = message_from_wire(message)
        try:
            self._dispatch(sender, parsed, now)
        finally:
            self._pump(now)

    def handle_timers(self, now: float) -> None:
        try:
            self.election.handle_timers(now)
            self.lead.handle_timers(now)
        finally:
            self._pump(now)

    # --- the loop of messages to ourselves, the election's and the leader's effects -----------

    def _pump(self, now: float) -> None:
        while True:
            became = False
            for effect in self.election.drain():
                if isinstance(effect, ElectionSend):
                    self._effects.append(Send(effect.to, Elect(effect.message)))
                elif isinstance(effect, Persist):
                    self._effects.append(effect)
                elif isinstance(effect, BecameLeader):
                    became = True
                    self._effects.append(Noted("leader", f"leads the cluster in term {effect.term}"))
                elif isinstance(effect, SteppedDown):
                    self.lead.step_down()
                    self._effects.append(Noted("leader", f"stepped down from term {effect.term}: {effect.reason}"))
                elif isinstance(effect, LeaderChanged):
                    self._leader_changed(effect)
            if became:
                self.lead.start_sync(now)  # after the heartbeats, so followers know us before our sync
            for out in self.lead.drain():
                if isinstance(out, Send) and out.to == self.node_id:
                    self._inbox.append((self.node_id, out.message))
                else:
                    self._effects.append(out)
            if not self._inbox:
                return
            sender, message = self._inbox.pop(0)  # one at a time: a bug in one leaves the rest queued
            self._dispatch(sender, message, now)

    def _leader_changed(self, effect: LeaderChanged) -> None:
        if effect.leader is None or effect.leader != self.leader or self.era is None or effect.term != self.era[0]:
            self.ready = False  # a new leader will send its sync; until then requests wait
        if effect.leader is not None and effect.leader != self.node_id and not self.ready:
            # We may have missed (or refused, not knowing it yet) its sync: ask for one.
            era = self.era if self.era is not None and self.era[0] == effect.term else (effect.term, 0)
            self._effects.append(Send(effect.leader, Resync(era)))

    def _dispatch(self, sender: str, message: PeerMessage, now: float) -> None:
        match message:
            case Elect():
                try:
                    self.election.receive(sender, message.m, now)
                except ValueError as exc:  # one no correct peer could send; the election changed nothing
                    raise MalformedPeerMessage(f"elect: {exc}") from exc
            case Report() | Resync() | Req() | Note():
                self.lead.receive(sender, message, now)
            case Sync():
                self._on_sync(sender, message.era, now)
            case _ if not (sender == self.leader == self.election.leader and message.era == self.era):
                self.refused += 1  # not from the leader this node follows, in the era it opened
            case Ready():
                self._on_ready()
            case Res():
                self._on_res(message)
            case Grant():
                self._on_grant(message)
            case Failed():
                self._on_fail(message)
            case Queued():
                w = self.waiting.get((message.conn, message.rid))
                if w is not None:
                    w.seq = message.seq
            case Notify():
                self._on_notify(message)
            case Move():
                self._on_move(message, now)
            case Span():
                for job in self.jobs.values():
                    if job.group == message.group:
                        job.span = message.gpus
            case Allotted():
                self._on_allotted(message)

    # --- forwarding to the leader ---------------------------------------------------------------

    def _to_leader(self, message: PeerMessage) -> None:
        assert self.leader is not None
        if self.leader == self.node_id:
            self._inbox.append((self.node_id, message))
        else:
            self._effects.append(Send(self.leader, message))

    def _note(self, notice: Notice) -> None:
        if self.ready and self.leader is not None and self.era is not None:
            self._to_leader(Note(self.era, notice))
        else:
            self._notes.append(notice)

    def _register_reply(self, ask: Register, result: Registered) -> dict[str, Any]:
        """The client's reply to its register: this node's GPUs of the group, and the cluster's."""
        return {
            "job": result.job,
            "group": result.group,
            "gpus": [local_gpu(g) for g in result.gpus if gpu_slot(g) == self.slot],
            "location": result.location.value,
            "cluster_gpus": list(result.gpus),
            **ask.extra,  # what the node's shell adds to the reply (its own session id)
        }

    def _take_registered(self, ask: Register, result: Registered) -> None:
        """The job, as this node knows it from now on (the leader registered it)."""
        job = self.jobs.setdefault(
            ask.job,
            LocalJob(
                ask.job, ask.group, ask.exclusive, (), freezes=ask.freezes, priority=ask.priority, weight=ask.weight
            ),
        )
        job.span = result.gpus
        if ask.memory is not None or ask.memory_each is not None:
            job.memory, job.memory_each = ask.memory, ask.memory_each
        job.sessions.add(ask.conn)
        job.pids.update(ask.pids)
        job.gone = False
        self.sessions[ask.conn] = ask.job
        if ask.party:
            self.parties[ask.conn] = ask.party

    # --- messages from the leader ---------------------------------------------------------------

    def _on_sync(self, sender: str, era: Era, now: float) -> None:
        if sender != self.election.leader or era[0] != self.election.term or (self.era and era <= self.era):
            self.refused += 1
            return
        report = Report(era, self._report(now)) if not self._moving else None
        self.era, self.leader, self.ready = era, sender, False
        # The report carries the effect of every notice and waiting acquire: those are not resent.
        self._notes.clear()
        for req, p in list(self._pending.items()):
            if isinstance(p.ask, Acquire):
                del self._pending[req]
            elif req in self._sent:
                p.resent = True
        self._sent.clear()
        self._report_due = report is None
        if report is not None:
            self._to_leader(report)

    def _maybe_report(self, now: float) -> None:
        if not self._report_due or self._moving or self.leader is None or self.era is None:
            return
        report = Report(self.era, self._report(now))
        self._report_due = False
        self._to_leader(report)

    def _report(self, now: float) -> NodeReport:
        return NodeReport(
            devices=dict(self.devices),
            sessions=tuple(
                ReportedSession(c, j, tuple(sorted(self.jobs[j].pids)), self.parties.get(c))
                for c, j in sorted(self.sessions.items())
            ),
            jobs=tuple(
                ReportedJob(
                    j.name,
                    j.group,
                    j.exclusive,
                    j.location,
                    dict(j.footprint),
                    j.faulted,
                    tuple(j.span),
                    j.gone,
                    j.freezes,
                    j.memory,
                    j.memory_each,
                    j.priority,
                    j.weight,
                )
                for j in self.jobs.values()
            ),
            holders=tuple(ReportedHolder(g, h.job, h.fence, tuple(sorted(h.conns))) for g, h in self.holders.items()),
            waiting=tuple(
                ReportedWait(
                    conn,
                    rid,
                    w.seq,
                    w.order,
                    None if w.deadline is None else max(0.0, w.deadline - now),
                    w.gang,
                    w.members,
                )
                for (conn, rid), w in self.waiting.items()
            ),
            fences={g: f for g, (_, f) in self.fences.items()},
            turns=tuple(
                ReportedTurn(job, t.seq, 0, t.until - now)
                for job, t in sorted(self.turns.items(), key=lambda kv: kv[1].seq)
                if t.until > now and job in self.jobs
            ),
        )

    def _on_ready(self) -> None:
        assert self.era is not None
        messages: list[PeerMessage] = [Req(self.era, req, self._pending[req].ask) for req in sorted(self._pending)]
        notes = list(self._notes)
        if self.host is not None:
            notes.append(self.host)  # the leader of a new era knows nothing of this node's host yet
        messages += [Note(self.era, notice) for notice in notes]
        self.ready = True
        self._sent.update(self._pending)
        self._notes = []
        for message in messages:
            self._to_leader(message)

    def _on_res(self, m: Res) -> None:
        p = self._pending.get(m.id)
        if p is None:
            return
        if m.op != p.ask.OP:  # not the answer to this request: no correct leader sends it
            self.refused += 1
            return
        effect: Reply | Fail | None = None
        conn, rid = p.ask.conn, p.ask.rid
        registered = m.result if isinstance(p.ask, Register) and isinstance(m.result, Registered) else None
        if m.error is not None:
            error = m.error.exception()
            if isinstance(p.ask, Release) and p.resent and isinstance(error, errors.NotHolder):
                effect = Reply(conn, rid, {"released": True, "after_leader_change": True})
            else:
                effect = Fail(conn, rid, error)
        elif isinstance(p.ask, Register) and registered is not None:  # Res checks that it is one
            effect = Reply(conn, rid, self._register_reply(p.ask, registered))
        elif not isinstance(p.ask, LATER):
            effect = Reply(conn, rid, m.result)
        del self._pending[m.id]
        self._sent.discard(m.id)
        if isinstance(effect, Fail):
            self.waiting.pop((conn, rid), None)
        if isinstance(p.ask, Register) and registered is not None:
            self._take_registered(p.ask, registered)
        if effect is not None:
            self._effects.append(effect)

    def _on_grant(self, m: Grant) -> None:
        info = m.info
        stamp = (info.term, info.fence)
        last = self.fences.get(info.group)
        if last is not None and (stamp < last or (stamp == last and not m.again)):
            self.refused += 1
            return
        granted = info.to_wire()
        effects: list[Effect] = []
        answered, conns = [], set()
        for conn, rid in m.tickets:
            if rid == AUTO:  # queued again after a preemption: granted without asking
                if conn in self.sessions:
                    effects.append(Push((conn,), "granted", granted))
            elif (conn, rid) in self.waiting or conn in self.sessions:
                answered.append((conn, rid))
                effects.append(Reply(conn, rid, granted))
            if self.sessions.get(conn) == info.job:
                conns.add(conn)
        holding = self.holders.get(info.group)
        joins = m.again and holding is not None and holding.job == info.job
        new = Holding(info.job, info.term, info.fence, conns) if conns and not joins else None
        self.fences[info.group] = stamp
        for key in answered:
            self.waiting.pop(key, None)
        if joins and holding is not None:
            holding.conns |= conns
        elif new is not None:
            self.holders[info.group] = new
        self._effects.extend(effects)

    def _on_fail(self, m: Failed) -> None:
        error = m.error.exception()
        if m.rid == AUTO:  # a preempted job will not be granted again: its client must not wait for it
            self._effects.append(Push((m.conn,), "lock_lost", {"reason": error.message}))
            return
        fail = Fail(m.conn, m.rid, error)
        self.waiting.pop((m.conn, m.rid), None)
        self._effects.append(fail)

    def _on_notify(self, m: Notify) -> None:
        job = self.jobs.get(m.job)
        if job is None:
            return
        push = Push(tuple(sorted(job.sessions)), m.event, m.data)
        holding = self.holders.get(job.group)
        faulted = m.event == "faulted" and not m.data.get("until_resync")
        reason = str(m.data.get("reason", "faulted"))
        if faulted:
            job.faulted = reason
        elif m.event in ("lock_lost", "preempted") and holding is not None and holding.job == m.job:
            del self.holders[job.group]
        self._effects.append(push)

    def _on_move(self, m: Move, now: float) -> None:
        assert self.era is not None
        key = (*self.era, m.op)
        job = self.jobs.get(m.job)
        streams = tuple(k for op in m.streams_with if (k := (*self.era, op)) in self._moving)
        run = RunMove(key, m.kind, m.job, streams)
        if m.kind == "reclaim":
            self._moving[key] = (m.kind, m.job)
            self._effects.append(run)
            return
        if job is None or job.location is NOTHING_TO_DO[m.kind]:
            self._finish_move(key, m.kind, m.job, True, MoveDone(m.op, True), now)
            return
        location = moved(job.location, STARTED[m.kind])
        self._moving[key] = (m.kind, m.job)
        job.location = location
        self._effects.append(run)

    def _on_allotted(self, m: Allotted) -> None:
        job = self.jobs.get(m.job)
        if job is not None:
            job.footprint[m.gpu] = job.footprint.get(m.gpu, 0) + m.nbytes
        self._effects.append(Allocate(m.conn, m.rid, m.job, m.gpu, m.nbytes, m.requested))

    # --- durability: what a restarted daemon needs to take up its jobs again ------------------

    def durable(self, now: float) -> dict[str, Any]:
        """This node's jobs, where their state lives, and who held or waited (plain data, for the journal)."""
        order: dict[str, int] = {}  # job -> the earliest place of its waiting acquires
        for (conn, _), w in self.waiting.items():
            job = self.sessions.get(conn)
            if job is not None:
                order[job] = min(order.get(job, 1 << 62), w.seq if w.seq is not None else (1 << 40) + w.order)
        for job, t in self.turns.items():
            if t.until > now and job not in order:
                order[job] = t.seq
        for h in self.holders.values():
            order[h.job] = -1
        return {
            "jobs": [
                {
                    "job": j.name,
                    "group": j.group,
                    "exclusive": j.exclusive,
                    "span": list(j.span),
                    "location": j.location.value,
                    "footprint": {str(g): n for g, n in j.footprint.items()},
                    "faulted": j.faulted,
                    "pids": sorted(j.pids),
                    "freezes": j.freezes,
                    "priority": j.priority,
                    "weight": j.weight,
                }
                for j in self.jobs.values()
                if not j.gone
            ],
            "turns": {job: seq for job, seq in order.items() if job in self.jobs},
            "fences": {g: list(stamp) for g, stamp in self.fences.items()},
        }

    def restore(self, picture: dict[str, Any], now: float, keep_turns_for: float) -> None:
        """Take up the jobs of a journal written by an earlier run (before ``start``).

        Their processes reconnect with new sessions; until then each job is known by its
        PIDs, and the places it had in its group's queue are kept for ``keep_turns_for`` s.
        Raises ``ValueError`` for a picture ``durable`` did not write (nothing is taken up then).
        """
        try:
            jobs = {}
            for j in picture["jobs"]:
                where = Location(j["location"])
                job = LocalJob(j["job"], j["group"], bool(j["exclusive"]), tuple(j["span"]), where)
                job.footprint = {int(g): int(n) for g, n in j["footprint"].items()}
                job.faulted, job.pids = str(j["faulted"]), set(j["pids"])
                job.freezes = bool(j.get("freezes", True))  # journals of the release before it: every job froze
                job.priority, job.weight = int(j.get("priority", 0)), float(j.get("weight", 1.0))
                jobs[job.name] = job
            turns = {job: Turn(int(seq), now + keep_turns_for) for job, seq in picture["turns"].items() if job in jobs}
            fences = {group: (int(term), int(fence)) for group, (term, fence) in picture["fences"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a picture of this release's journal: {exc.__class__.__name__}: {exc}") from None
        self.jobs.update(jobs)
        self.turns.update(turns)
        self.fences.update(fences)
