"""One daemon's part in the cluster (pure): election, forwarding, fencing, and the leader's orchestrator.

Every daemon runs a ``ClusterNode``. Its clients' requests go to the leader:
directly, inside the same call, when this node leads; otherwise as ``req``
messages whose answers come back later. What the leader decides comes back as
messages (a grant, a move to carry out on this node's part of a job, an
allocation) that this node turns into effects for its shell. A single daemon is
a cluster of one that leads at once, so the same code serves both.

No I/O and no clock: inputs carry ``now``; outputs are effects (``drain()``),
carried out front to back (a ``Persist`` must be durable before any later
``Send``). ``next_deadline()`` says when to call ``handle_timers``.

Fencing: a node takes directions only from the leader its election core follows,
in the era ``(term, gen)`` that leader opened with ``sync``; grants of a group
must carry a ``(term, fence)`` at least as high as the last one it delivered.
Everything else is refused and counted.

Leader change: the new leader sends ``sync``; every node answers with a
``report`` of what it knows (its sessions, where each of its jobs' state lives,
holders and their fences, waiting acquires with the order the last leader gave
them) once its own moves have finished; the leader rebuilds its scheduler from
the reports (``Orchestrator.rebuild``) and sends ``ready``, after which the
nodes forward again, resending what was never answered.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..core.election import BecameLeader, Election, LeaderChanged, Persist, Persisted, SteppedDown, message_from_wire
from ..core.election import Send as ElectionSend
from ..core.events import GrantLock
from ..core.ids import gpu_slot, local_gpu
from ..core.scheduler import AUTO, Scheduler, SlicePolicy
from .orchestrator import Era, Orchestrator

PENDING = object()  # the answer to a request comes later, as a Reply or Fail effect

LATER_OPS = ("acquire", "alloc")  # the reply comes as a grant, an allocation or a failure


# --- effects ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    to: str
    message: dict[str, Any]


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


# --- what this node knows --------------------------------------------------------------


@dataclass
class LocalJob:
    name: str
    group: str
    exclusive: bool
    span: tuple[int, ...]  # the group's GPUs, cluster-wide ids
    location: str = "resident"  # resident | parked | parking | restoring
    footprint: dict[int, int] = field(default_factory=dict)  # local GPU -> bytes (simulated memory)
    faulted: str = ""
    gone: bool = False  # reported: none of its processes on this node is alive
    sessions: set[int] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)


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


@dataclass
class Turn:
    """A place a restarted node keeps for its job: it held (``seq`` -1) or waited when the daemon died."""

    seq: int
    until: float


@dataclass
class Forwarded:
    op: str
    conn: int
    rid: int
    args: dict[str, Any]
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
    ) -> None:
        members = tuple(sorted(members))
        if node_id not in members:
            raise ValueError(f"node {node_id!r} is not one of the members {list(members)}")
        if len(set(members)) != len(members):
            raise ValueError(f"members are not distinct: {list(members)}")
        self.node_id = node_id
        self.members = members
        self.slot = members.index(node_id)
        self.majority = len(members) // 2 + 1
        self.devices = dict(devices)
        self.election = Election(
            node_id,
            tuple(m for m in members if m != node_id),
            rng=rng,
            election_timeout=election_timeout,
            heartbeat_interval=heartbeat_interval,
            persisted=persisted,
        )
        self.max_waiters = max_waiters
        self.op_timeout = op_timeout
        self.policies = dict(policies or {})
        self.sync_timeout = sync_timeout if sync_timeout is not None else election_timeout[1]
        # follower side
        self.era: Era | None = None  # the era this node takes directions in
        self.leader: str | None = None  # who opened it
        self.ready = False  # the leader rebuilt its state with our report: forward to it
        self.sessions: dict[int, str] = {}  # conn -> job
        self.jobs: dict[str, LocalJob] = {}
        self.holders: dict[str, Holding] = {}  # group -> holder, as delivered here
        self.fences: dict[str, tuple[int, int]] = {}  # group -> highest (term, fence) delivered here
        self.waiting: dict[tuple[int, int], Waiting] = {}  # (conn, rid) -> acquire waiting for its grant
        self.turns: dict[str, Turn] = {}  # job -> its place, kept after a restart until it asks again
        self._pending: dict[int, Forwarded] = {}  # forwarded requests without an answer, by req id
        self._sent: set[int] = set()  # which of them went to the current leader
        self._notes: list[dict[str, Any]] = []  # one-way notices for the leader, held until ready
        self._moving: dict[tuple[int, int, int], tuple[str, str]] = {}  # key -> (kind, job)
        self._report_due = False
        self._req = itertools.count(1)
        self._order = itertools.count(1)
        self.refused = 0
        # leader side
        self.orch: Orchestrator | None = None
        self._gen = 0
        self._fence_floor: tuple[int, dict[str, int]] = (0, {})  # (term, group -> highest fence given)
        self._figures: Scheduler | None = None  # the scheduler of this leader's previous era, for its figures
        self._collect: dict[str, dict[str, Any]] | None = None
        self._collect_era: Era | None = None
        self._collect_deadline = float("inf")
        self._reporters: set[str] = set()
        self.linked: set[str] = set()
        self.problems: list[str] = []
        self._effects: list[Effect] = []
        self._inbox: list[tuple[str, dict[str, Any]]] = []  # messages to this node from itself

    # --- queries -------------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler | None:
        """The cluster's scheduler, on the leader once it has rebuilt its state."""
        return self.orch.scheduler if self.orch is not None else None

    @property
    def leading(self) -> bool:
        return self.orch is not None

    def local_gpus(self, job: str) -> tuple[int, ...]:
        return tuple(local_gpu(g) for g in self.jobs[job].span if gpu_slot(g) == self.slot)

    def held_gpus(self) -> set[int]:
        """This node's GPUs whose group has a holder (as delivered here)."""
        return {g for h in self.holders.values() if h.job in self.jobs for g in self.local_gpus(h.job)}

    def next_deadline(self) -> float | None:
        times = [t for t in (self.election.next_deadline(), self._collect_deadline) if t is not None]
        if self.orch is not None and (d := self.orch.next_deadline()) is not None:
            times.append(d)
        deadline = min(times, default=float("inf"))
        return None if deadline == float("inf") else deadline

    def describe(self, now: float) -> dict[str, Any]:
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
            "reporters": sorted(self._reporters) if self.leading else [],
            "offline": sorted(self.members[s] for s in self.orch.offline) if self.orch else [],
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

    def request(self, conn: int, rid: int, op: str, args: dict[str, Any], now: float) -> Any:
        """A client's request (``args`` already checked); the result, ``PENDING``, or raises."""
        if op == "register" and conn in self.sessions:
            raise errors.AlreadyRegistered(f"this connection already registered job {self.sessions[conn]!r}")
        if op != "register" and conn not in self.sessions:
            raise errors.NotRegistered("register a job before using the lock")
        if op == "acquire":
            if rid == AUTO:
                raise errors.BadRequest(f"request id {AUTO} is reserved")
            timeout = args.get("timeout")
            self.waiting[(conn, rid)] = Waiting(next(self._order), None if timeout is None else now + timeout)
            self.turns.pop(self.sessions[conn], None)
        elif op == "release":
            self._let_go(conn, self.sessions[conn])
        try:
            return self._forward(Forwarded(op, conn, rid, args), now)
        except errors.TimeslicedError:
            self.waiting.pop((conn, rid), None)
            raise
        finally:
            self._pump(now)

    def admin(self, op: str, args: dict[str, Any], now: float) -> Any:
        """An administrator's action; only the leader takes them (its dashboard)."""
        if self.orch is None:
            leader = self.election.leader
            raise errors.BadRequest(
                f"node {self.node_id!r} does not lead the cluster"
                + (f"; use the dashboard of {leader!r}" if leader else " (no leader right now)")
            )
        try:
            return self.orch.handle(self.slot, op, args, now)
        finally:
            self._route_orch()
            self._pump(now)

    def closed(self, conn: int, now: float) -> None:
        job_name = self.sessions.pop(conn, None)
        for key in [k for k in self.waiting if k[0] == conn]:
            del self.waiting[key]
        registering = False  # the leader may have registered it: it must hear of the close
        for req in [r for r, f in self._pending.items() if f.conn == conn]:
            registering |= self._pending.pop(req).op == "register" and req in self._sent
            self._sent.discard(req)
        if job_name is not None and job_name in self.jobs:
            self.jobs[job_name].sessions.discard(conn)
            self._let_go(conn, job_name)
        if job_name is not None or registering:
            self._note("closed", {"conn": conn}, now)
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
        local = self.jobs.get(job)
        if local is not None:
            left = local.footprint.get(gpu, 0) - nbytes
            if left > 0:
                local.footprint[gpu] = left
            else:
                local.footprint.pop(gpu, None)
        self._note("freed", {"job": job, "gpu": gpu, "nbytes": nbytes}, now)
        self._pump(now)

    def gone(self, job: str, now: float) -> None:
        """No process of ``job`` is alive on this node and none is connected."""
        local = self.jobs.get(job)
        if local is None or local.gone:
            return
        local.gone = True
        self._note("gone", {"job": job}, now)
        self._pump(now)

    def move_finished(
        self, key: tuple[int, int, int], ok: bool, nbytes: int, seconds: float, error: str, now: float
    ) -> None:
        """This node's part of a move (``RunMove``) ended."""
        self._move_finished(key, ok, nbytes, seconds, error, now)
        self._pump(now)

    def _move_finished(
        self, key: tuple[int, int, int], ok: bool, nbytes: int, seconds: float, error: str, now: float
    ) -> None:
        kind, name = self._moving.pop(key)
        job = self.jobs.get(name)
        if kind == "reclaim":
            if job is not None and not job.sessions:
                del self.jobs[name]
        elif job is not None:
            parked = (kind == "snapshot") == ok
            job.location = "parked" if parked else "resident"
        era = key[:2]
        if era == self.era and self.leader is not None:
            done = {"op": key[2], "ok": ok, "nbytes": nbytes, "seconds": seconds, "error": error}
            self._to_leader({"k": "note", "op": "move_done", "args": done}, now)
        self._maybe_report(now)

    def link(self, peer: str, up: bool, now: float) -> None:
        """The transport's outbound link to ``peer`` came up or went down."""
        was = peer in self.linked
        if up:
            self.linked.add(peer)
        else:
            self.linked.discard(peer)
        if self._collect is not None and not up:
            self._maybe_build(now)
        if self.orch is not None:
            if not up and was:
                self.orch.node_offline(self.members.index(peer), now)
                self._route_orch()
            elif up and not was and self._collect is None:
                self._start_sync(now)  # it may have missed messages, or it is new: take stock again
        elif up and not was and peer == self.leader and self.era is not None:
            self._effects.append(Send(peer, {"k": "resync", "era": list(self.era)}))
        self._pump(now)

    def receive(self, sender: str, message: dict[str, Any], now: float) -> None:
        """A message from peer ``sender`` (authenticated by the transport). Raises ``ValueError`` if malformed."""
        if sender not in self.members or sender == self.node_id:
            raise ValueError(f"message from unknown node {sender!r}")
        self._dispatch(sender, message, now)
        self._pump(now)

    def handle_timers(self, now: float) -> None:
        self.election.handle_timers(now)
        if self.orch is not None:
            self.orch.handle_timers(now)
            self._route_orch()
        if self._collect is not None and now >= self._collect_deadline:
            if len(self._collect) >= self.majority:
                self._build(now)
            else:
                self._collect_deadline = now + self.sync_timeout
        self._pump(now)

    # --- the loop of messages to ourselves and election effects ----------------------------

    def _pump(self, now: float) -> None:
        while True:
            became = False
            for effect in self.election.drain():
                if isinstance(effect, ElectionSend):
                    self._effects.append(Send(effect.to, {"k": "elect", "m": effect.message.to_wire()}))
                elif isinstance(effect, Persist):
                    self._effects.append(effect)
                elif isinstance(effect, BecameLeader):
                    became = True
                    self._effects.append(Noted("leader", f"leads the cluster in term {effect.term}"))
                elif isinstance(effect, SteppedDown):
                    self.orch, self._collect, self._collect_deadline = None, None, float("inf")
                    self._effects.append(Noted("leader", f"stepped down from term {effect.term}: {effect.reason}"))
                elif isinstance(effect, LeaderChanged):
                    self._leader_changed(effect, now)
            if became:
                self._start_sync(now)  # after the heartbeats, so followers know us before our sync
            if not self._inbox:
                return
            inbox, self._inbox = self._inbox, []
            for sender, message in inbox:
                self._dispatch(sender, message, now)

    def _leader_changed(self, effect: LeaderChanged, now: float) -> None:
        if effect.leader is None or effect.leader != self.leader or self.era is None or effect.term != self.era[0]:
            self.ready = False  # a new leader will send its sync; until then requests wait
        if effect.leader is not None and effect.leader != self.node_id and not self.ready:
            # We may have missed (or refused, not knowing it yet) its sync: ask for one.
            era = self.era if self.era is not None and self.era[0] == effect.term else (effect.term, 0)
            self._effects.append(Send(effect.leader, {"k": "resync", "era": list(era)}))

    def _dispatch(self, sender: str, m: dict[str, Any], now: float) -> None:
        kind = m.get("k")
        if kind == "elect":
            self.election.receive(sender, message_from_wire(m.get("m")), now)
            return
        if kind in ("req", "note", "report", "resync"):
            self._on_from_node(sender, m, now)
            return
        era = _era(m.get("era"))
        if kind == "sync":
            self._on_sync(sender, era, now)
            return
        if sender != self.leader or era != self.era or sender != self.election.leader:
            self.refused += 1
            return
        handler = _FROM_LEADER.get(kind) if isinstance(kind, str) else None
        if handler is None:
            raise ValueError(f"unknown message kind {kind!r}")
        handler(self, m, now)

    # --- forwarding to the leader ---------------------------------------------------------------

    def _forward(self, f: Forwarded, now: float) -> Any:
        if self.orch is not None and self.ready:  # we lead: answer within this call
            try:
                result = self.orch.handle(self.slot, f.op, {**f.args, "conn": f.conn, "rid": f.rid}, now)
            finally:
                self._route_orch()
            return self._answered(f, result)
        req = next(self._req)
        self._pending[req] = f
        if self.ready and self.leader is not None:
            self._send_req(req, now)
        return PENDING

    def _send_req(self, req: int, now: float) -> None:
        f = self._pending[req]
        self._sent.add(req)
        args = {**f.args, "conn": f.conn, "rid": f.rid}
        self._to_leader({"k": "req", "id": req, "op": f.op, "args": args}, now)

    def _to_leader(self, message: dict[str, Any], now: float) -> None:
        assert self.leader is not None and self.era is not None
        message = {**message, "era": list(self.era)}
        if self.leader == self.node_id:
            self._inbox.append((self.node_id, message))
        else:
            self._effects.append(Send(self.leader, message))

    def _note(self, op: str, args: dict[str, Any], now: float) -> None:
        if self.ready and self.leader is not None:
            self._to_leader({"k": "note", "op": op, "args": args}, now)
        else:
            self._notes.append({"k": "note", "op": op, "args": args})

    def _answered(self, f: Forwarded, result: Any) -> Any:
        """The leader's result for ``f``; what the client gets now (or ``PENDING``)."""
        if f.op in LATER_OPS:
            return PENDING
        if f.op == "register":
            return self._registered(f, result)
        return result

    def _registered(self, f: Forwarded, result: dict[str, Any]) -> dict[str, Any]:
        name = f.args["job"]
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = LocalJob(name, f.args["group"], bool(f.args.get("exclusive")), ())
        job.span = tuple(result["gpus"])
        job.sessions.add(f.conn)
        job.pids.update(f.args.get("pids", ()))
        job.gone = False
        self.sessions[f.conn] = name
        extra = f.args.get("extra") or {}  # what the node's shell adds to the reply (its own session id)
        return {**result, "gpus": list(self.local_gpus(name)), "cluster_gpus": list(result["gpus"]), **extra}

    # --- messages from the leader ---------------------------------------------------------------

    def _on_sync(self, sender: str, era: Era, now: float) -> None:
        if sender != self.election.leader or era[0] != self.election.term or (self.era and era <= self.era):
            self.refused += 1
            return
        self.era, self.leader, self.ready = era, sender, False
        # The report carries the effect of every notice and waiting acquire: those are not resent.
        self._notes.clear()
        for req, f in list(self._pending.items()):
            if f.op == "acquire":
                del self._pending[req]
            elif req in self._sent:
                f.resent = True
        self._sent.clear()
        self._report_due = True
        self._maybe_report(now)

    def _maybe_report(self, now: float) -> None:
        if not self._report_due or self._moving or self.leader is None:
            return
        self._report_due = False
        self._to_leader({"k": "report", "report": self._report(now)}, now)

    def _report(self, now: float) -> dict[str, Any]:
        return {
            "devices": {str(g): cap for g, cap in self.devices.items()},
            "sessions": [
                {"conn": c, "job": j, "pids": sorted(self.jobs[j].pids)} for c, j in sorted(self.sessions.items())
            ],
            "jobs": [
                {
                    "job": j.name,
                    "group": j.group,
                    "exclusive": j.exclusive,
                    "location": j.location,
                    "footprint": {str(g): n for g, n in j.footprint.items()},
                    "faulted": j.faulted,
                    "span": list(j.span),
                    "gone": j.gone,
                }
                for j in self.jobs.values()
            ],
            "holders": [
                {"group": g, "job": h.job, "fence": h.fence, "conns": sorted(h.conns)} for g, h in self.holders.items()
            ],
            "waiting": [
                {
                    "conn": conn,
                    "rid": rid,
                    "seq": w.seq,
                    "order": w.order,
                    "deadline_in": None if w.deadline is None else max(0.0, w.deadline - now),
                }
                for (conn, rid), w in self.waiting.items()
            ],
            "fences": {g: f for g, (_, f) in self.fences.items()},
            "turns": [
                {"job": job, "seq": t.seq, "order": 0, "kept_for": t.until - now}
                for job, t in sorted(self.turns.items(), key=lambda kv: kv[1].seq)
                if t.until > now and job in self.jobs
            ],
        }

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
                    "location": j.location,
                    "footprint": {str(g): n for g, n in j.footprint.items()},
                    "faulted": j.faulted,
                    "pids": sorted(j.pids),
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
        """
        for j in picture["jobs"]:
            job = LocalJob(j["job"], j["group"], bool(j["exclusive"]), tuple(j["span"]), j["location"])
            job.footprint = {int(g): int(n) for g, n in j["footprint"].items()}
            job.faulted, job.pids = str(j["faulted"]), set(j["pids"])
            self.jobs[job.name] = job
        for job, seq in picture["turns"].items():
            if job in self.jobs:
                self.turns[job] = Turn(int(seq), now + keep_turns_for)
        for group, (term, fence) in picture["fences"].items():
            self.fences[group] = (int(term), int(fence))

    def _on_ready(self, m: dict[str, Any], now: float) -> None:
        self.ready = True
        for req in sorted(self._pending):
            self._send_req(req, now)
        notes, self._notes = self._notes, []
        for note in notes:
            self._to_leader(note, now)

    def _on_res(self, m: dict[str, Any], now: float) -> None:
        req = m.get("id")
        f = self._pending.pop(req, None) if isinstance(req, int) else None
        if f is None:
            return
        self._sent.discard(m["id"])
        if m.get("ok"):
            result = self._answered(f, m.get("result"))
            if result is not PENDING:
                self._effects.append(Reply(f.conn, f.rid, result))
            return
        error = errors.from_wire(m.get("error"))
        if f.op == "release" and f.resent and isinstance(error, errors.NotHolder):
            self._effects.append(Reply(f.conn, f.rid, {"released": True, "after_leader_change": True}))
            return
        self.waiting.pop((f.conn, f.rid), None)
        self._effects.append(Fail(f.conn, f.rid, error))

    def _on_grant(self, m: dict[str, Any], now: float) -> None:
        info = m["info"]
        group, job, fence = info["group"], info["job"], info["fence"]
        stamp = (info["term"], fence)
        last = self.fences.get(group)
        if last is not None and (stamp < last or (stamp == last and not m.get("again"))):
            self.refused += 1
            return
        self.fences[group] = stamp
        conns = set()
        for conn, rid in m["tickets"]:
            if rid == AUTO:  # queued again after a preemption: granted without asking
                if conn in self.sessions:
                    self._effects.append(Push((conn,), "granted", info))
            elif self.waiting.pop((conn, rid), None) is not None or conn in self.sessions:
                self._effects.append(Reply(conn, rid, info))
            if self.sessions.get(conn) == job:
                conns.add(conn)
        holding = self.holders.get(group)
        if m.get("again") and holding is not None and holding.job == job:
            holding.conns |= conns
        elif conns:
            self.holders[group] = Holding(job, info["term"], fence, conns)

    def _on_fail(self, m: dict[str, Any], now: float) -> None:
        error = errors.from_wire(m.get("error"))
        if m["rid"] == AUTO:  # a preempted job will not be granted again: its client must not wait for it
            self._effects.append(Push((m["conn"],), "lock_lost", {"reason": error.message}))
            return
        self.waiting.pop((m["conn"], m["rid"]), None)
        self._effects.append(Fail(m["conn"], m["rid"], error))

    def _on_queued(self, m: dict[str, Any], now: float) -> None:
        w = self.waiting.get((m["conn"], m["rid"]))
        if w is not None:
            w.seq = m["seq"]

    def _on_notify(self, m: dict[str, Any], now: float) -> None:
        name, event, data = m["job"], m["event"], m.get("data") or {}
        job = self.jobs.get(name)
        if job is None:
            return
        if event == "faulted" and not data.get("until_resync"):
            job.faulted = str(data.get("reason", "faulted"))
        elif event in ("lock_lost", "preempted"):
            holding = self.holders.get(job.group)
            if holding is not None and holding.job == name:
                del self.holders[job.group]
        self._effects.append(Push(tuple(sorted(job.sessions)), event, data))

    def _on_move(self, m: dict[str, Any], now: float) -> None:
        assert self.era is not None
        key = (*self.era, m["op"])
        kind, name = m["kind"], m["job"]
        job = self.jobs.get(name)
        nothing_to_do = job is None or (
            (kind == "snapshot" and job.location == "parked") or (kind == "restore" and job.location == "resident")
        )
        self._moving[key] = (kind, name)
        if nothing_to_do and kind != "reclaim":
            self._move_finished(key, True, 0, 0.0, "", now)
            return
        if job is not None and kind != "reclaim":
            job.location = "parking" if kind == "snapshot" else "restoring"
        self._effects.append(RunMove(key, kind, name))

    def _on_span(self, m: dict[str, Any], now: float) -> None:
        for job in self.jobs.values():
            if job.group == m["group"]:
                job.span = tuple(m["gpus"])

    def _on_alloc(self, m: dict[str, Any], now: float) -> None:
        job = self.jobs.get(m["job"])
        if job is not None:
            job.footprint[m["gpu"]] = job.footprint.get(m["gpu"], 0) + m["nbytes"]
        self._effects.append(Allocate(m["conn"], m["rid"], m["job"], m["gpu"], m["nbytes"], m["requested"]))

    # --- the leader: taking stock, and requests from nodes ----------------------------------------

    def _start_sync(self, now: float) -> None:
        self._gen += 1
        era = (self.election.term, self._gen)
        if self._fence_floor[0] != era[0]:
            self._fence_floor = (era[0], {})
        if self.orch is not None and self.orch.era[0] == era[0]:  # fences go on growing within a term
            self._fence_floor[1].update(self.orch.fence_floor)
            self._fence_floor[1].update({g.name: g.fence for g in self.orch.scheduler.groups.values()})
            self._figures = self.orch.scheduler  # and so do the figures
        else:
            self._figures = None
        self.orch = None
        self._collect, self._collect_era = {}, era
        self._collect_deadline = now + self.sync_timeout
        for member in self.members:
            message = {"k": "sync", "era": list(era)}
            if member == self.node_id:
                self._inbox.append((member, message))
            else:
                self._effects.append(Send(member, message))

    def _on_from_node(self, sender: str, m: dict[str, Any], now: float) -> None:
        era = _era(m.get("era"))
        kind = m["k"]
        if kind == "report":
            if self._collect is not None and era == self._collect_era:
                self._collect[sender] = m["report"]
                self._maybe_build(now)
            return
        if kind == "resync":
            if self._collect is not None and self._collect_era is not None:
                self._effects.append(Send(sender, {"k": "sync", "era": list(self._collect_era)}))
            elif self.orch is not None:
                self._start_sync(now)
            return
        if self.orch is None or era != self.orch.era:
            return  # an older era's request: the node resends it once the new era is ready
        slot = self.members.index(sender)
        if kind == "note":
            self.orch.handle(slot, m["op"], m["args"], now)
            self._route_orch()
            return
        reply: dict[str, Any] = {"k": "res", "id": m["id"]}
        try:
            reply["result"] = self.orch.handle(slot, m["op"], m["args"], now)
            reply["ok"] = True
        except errors.TimeslicedError as exc:
            reply.update(ok=False, error=errors.to_wire(exc))
        self._route_orch()
        self._to_node(slot, {**reply, "era": list(self.orch.era)})

    def _maybe_build(self, now: float) -> None:
        """Build once every member that can answer has: a member whose link is down will not."""
        if self._collect is None:
            return
        reachable = {self.node_id} | self.linked
        if reachable <= set(self._collect) and len(self._collect) >= self.majority:
            self._build(now)

    def _build(self, now: float) -> None:
        assert self._collect is not None and self._collect_era is not None
        reports = {self.members.index(m): r for m, r in self._collect.items()}
        missing = [i for i, m in enumerate(self.members) if m not in self._collect]
        self.orch, problems = Orchestrator.rebuild(
            self._collect_era,
            reports,
            missing,
            now,
            max_waiters=self.max_waiters,
            op_timeout=self.op_timeout,
            fence_floor=self._fence_floor[1],
            policies=self.policies,
        )
        if self._figures is not None:
            self.orch.scheduler.carry_figures(self._figures)
            self._figures = None
        self._reporters = set(self._collect)
        self._collect, self._collect_deadline = None, float("inf")
        for text in problems:
            self.problems.append(text)
            self._effects.append(Noted("problem", text))
        for member in sorted(self._reporters):
            self._to_node(self.members.index(member), {"k": "ready", "era": list(self.orch.era)})
        self._route_orch()

    def _route_orch(self) -> None:
        if self.orch is None:
            return
        for out in self.orch.drain():
            self._to_node(out.slot, out.message)
        grants, self.orch.grants = self.orch.grants, []
        self._effects.extend(RecordGrant(g) for g in grants)
        notices, self.orch.notices = self.orch.notices, []
        for n in notices:
            group = n.data.get("group")
            reason = str(n.data.get("reason", ""))
            self._effects.append(Noted(n.event, reason, job=n.job, group=group if isinstance(group, str) else None))

    def _to_node(self, slot: int, message: dict[str, Any]) -> None:
        member = self.members[slot]
        if member == self.node_id:
            self._inbox.append((member, message))
        else:
            self._effects.append(Send(member, message))


_FROM_LEADER = {
    "ready": ClusterNode._on_ready,
    "span": ClusterNode._on_span,
    "res": ClusterNode._on_res,
    "grant": ClusterNode._on_grant,
    "fail": ClusterNode._on_fail,
    "queued": ClusterNode._on_queued,
    "notify": ClusterNode._on_notify,
    "move": ClusterNode._on_move,
    "alloc": ClusterNode._on_alloc,
}


def _era(value: Any) -> Era:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
        raise ValueError(f"not an era: {value!r}")
    return (value[0], value[1])
