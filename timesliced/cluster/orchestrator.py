"""The leader's side of the cluster (pure): one scheduler for every node, and what each node must do.

The orchestrator wraps the scheduler core. Nodes hand it requests from their
clients (``handle``); it feeds them to the scheduler and turns each effect into
messages for the nodes concerned (``drain``): a grant goes to the nodes of the
waiting sessions, a snapshot to every node where the job has state, and the
scheduler only hears that the move finished once every one of those nodes said
so. Every message carries the era ``(term, gen)`` it was decided in.

A new leader builds its orchestrator from what the nodes report
(``Orchestrator.rebuild``): registered jobs and sessions, where each job's
state lives, current holders and the fences they hold, and every waiting
acquire in the order the previous leader queued it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..core.events import (
    AcquireRequested,
    AcquireWithdrawn,
    AllocateRegion,
    DrainRequested,
    Effect,
    Event,
    FailRequest,
    ForceReleaseRequested,
    GrantLock,
    GroupsFrozen,
    JobExited,
    JobRegistered,
    MemoryReleased,
    MemoryRequested,
    MoveFinished,
    NotifyJob,
    ReclaimFinished,
    ReclaimJob,
    ReleaseRequested,
    RestoreJob,
    SessionClosed,
    SnapshotJob,
)
from ..core.ids import global_gpu, global_session, gpu_slot, local_conn, local_gpu, session_slot
from ..core.location import Location
from ..core.scheduler import Scheduler, SlicePolicy

Era = tuple[int, int]  # (term, gen): gen counts the leader's resynchronisations within its term
NOTED = ("faulted", "slice_overdue", "preempted")  # notices that also go to the log and the history
MOVE_GRACE_S = 5.0  # on top of the node's own operation timeout, for the messages


@dataclass
class _Fanout:
    """A snapshot, restore or reclaim carried out on several nodes."""

    kind: str
    job: str
    waiting: set[int]
    deadline: float
    ok: bool = True
    nbytes: int = 0
    seconds: float = 0.0
    unknown: bool = False  # a node never answered: its outcome is not known
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Outgoing:
    """A message for the node in ``slot``."""

    slot: int
    message: dict[str, Any]


class Orchestrator:
    """The leader's scheduler and the routing of its decisions to nodes (slots)."""

    def __init__(
        self,
        era: Era,
        capacities: dict[int, int],
        *,
        max_waiters: int = 1024,
        op_timeout: float = 600.0,
        policies: dict[str, SlicePolicy] | None = None,
    ) -> None:
        self.era = era
        self.scheduler = Scheduler(capacities, max_waiters=max_waiters, policies=policies)
        self.op_timeout = op_timeout
        self.job_nodes: dict[str, set[int]] = {}  # job -> slots where it has sessions or state
        self.gone: dict[str, set[int]] = {}  # job -> slots whose processes of it are all gone
        self.offline: set[int] = set()  # slots out of reach in this era
        self.spans: dict[str, set[int]] = {}  # group -> slots its GPUs are on, as far as anyone knows
        self.grants: list[GrantLock] = []  # new grants since the last drain, for figures
        self.notices: list[NotifyJob] = []  # faults, overdue slices and preemptions, for the log and history
        self._fanouts: dict[int, _Fanout] = {}
        self.fence_floor: dict[str, int] = {}  # fences this leader already gave (earlier eras of its term)
        self._unknown: set[str] = set()  # jobs whose last move has an unknown outcome on some node
        self._out: list[Outgoing] = []
        self._seq = itertools.count(1)

    # --- inputs ----------------------------------------------------------------------

    def handle(self, slot: int, op: str, args: dict[str, Any], now: float) -> Any:
        """A request or notice from a node's client ``args["conn"]``; returns the result or raises.

        Raises ``TimeslicedError`` for a refused request (nothing changed).
        """
        conn = args.get("conn", 0)
        session = global_session(slot, conn)
        if op == "register":
            return self._register(slot, session, args, now)
        if op == "acquire":
            timeout = args.get("timeout")
            self._feed(AcquireRequested(session, args["rid"], None if timeout is None else now + timeout), now)
            self._to(slot, {"k": "queued", "conn": conn, "rid": args["rid"], "seq": next(self._seq)})
            return None
        if op == "cancel":
            return self._feed(AcquireWithdrawn(session, args["request"]), now)
        if op == "release":
            return self._feed(ReleaseRequested(session), now)
        if op == "alloc":
            gpu = global_gpu(slot, args["gpu"])
            return self._feed(MemoryRequested(session, args["rid"], gpu, args["nbytes"], args["requested"]), now)
        if op == "closed":
            return self._feed(SessionClosed(session), now)
        if op == "freed":
            return self._feed(MemoryReleased(args["job"], global_gpu(slot, args["gpu"]), args["nbytes"]), now)
        if op == "gone":
            self.gone.setdefault(args["job"], set()).add(slot)
            self._maybe_exited(args["job"], now)
            return None
        if op == "move_done":
            self._fanout_done(slot, args, now)
            return None
        if op == "force_release":
            return self._feed(ForceReleaseRequested(args["group"]), now)
        if op == "drain":
            return self._feed(DrainRequested(args["group"], bool(args["on"])), now)
        raise errors.UnknownOp(f"the leader has no operation {op!r}")

    def _register(self, slot: int, session: int, args: dict[str, Any], now: float) -> dict[str, Any]:
        gpus = args.get("gpus")
        event = JobRegistered(
            session,
            args["job"],
            args["group"],
            tuple(global_gpu(slot, g) for g in gpus) if gpus is not None else None,
            tuple(args.get("pids", ())),
            exclusive=bool(args.get("exclusive")),
            slot=slot,
        )
        group = self.scheduler.groups.get(args["group"])
        before = group.gpus if group is not None else ()
        result: dict[str, Any] = self._feed(event, now)
        if not before:  # a new group: its fences go on from where this leader's earlier eras left them
            self.scheduler.raise_fence(args["group"], self.fence_floor.get(args["group"], 0))
        self.job_nodes.setdefault(args["job"], set()).add(slot)
        self.gone.get(args["job"], set()).discard(slot)
        self._note_span(args["group"])
        if before and tuple(result["gpus"]) != before:  # the group grew onto another node: tell its nodes
            jobs = [j.name for j in self.scheduler.jobs.values() if j.group == args["group"]]
            for s in sorted({s for j in jobs for s in self.job_nodes.get(j, ())}):
                self._to(s, {"k": "span", "group": args["group"], "gpus": result["gpus"]})
        return result

    def handle_timers(self, now: float) -> None:
        for op, fan in list(self._fanouts.items()):
            if fan.deadline <= now:
                for slot in list(fan.waiting):
                    self._node_lost_in(op, fan, slot, "did not answer in time", now)
        self.scheduler.handle_timers(now)
        self._route(now)

    def next_deadline(self) -> float | None:
        times = [f.deadline for f in self._fanouts.values()]
        if (d := self.scheduler.next_deadline()) is not None:
            times.append(d)
        return min(times) if times else None

    def node_offline(self, slot: int, now: float) -> None:
        """The node in ``slot`` is out of reach: its groups stop, its moves fail."""
        self.offline.add(slot)
        for op, fan in list(self._fanouts.items()):
            if slot in fan.waiting:
                self._node_lost_in(op, fan, slot, "is out of reach", now)
        self._refreeze(now)
        self._route(now)

    def drain(self) -> list[Outgoing]:
        out, self._out = self._out, []
        return out

    # --- the scheduler's decisions -> node messages ------------------------------------

    def _feed(self, event: Event, now: float) -> Any:
        try:
            return self.scheduler.handle(event, now)
        finally:
            self._route(now)

    def _route(self, now: float) -> None:
        for effect in self.scheduler.drain():
            self._route_one(effect, now)

    def _route_one(self, effect: Effect, now: float) -> None:
        if isinstance(effect, GrantLock):
            by_slot: dict[int, list[list[int]]] = {}
            for session, rid in effect.tickets:
                by_slot.setdefault(session_slot(session), []).append([local_conn(session), rid])
            info = {**effect.info(), "term": self.era[0]}
            for slot, tickets in by_slot.items():
                self._to(slot, {"k": "grant", "tickets": tickets, "info": info, "again": effect.again})
            if not effect.again:
                self.grants.append(effect)
        elif isinstance(effect, FailRequest):
            session, rid = effect.ticket
            self._to(
                session_slot(session),
                {"k": "fail", "conn": local_conn(session), "rid": rid, "error": errors.to_wire(effect.error)},
            )
        elif isinstance(effect, (SnapshotJob, RestoreJob, ReclaimJob)):
            kind = (
                "snapshot"
                if isinstance(effect, SnapshotJob)
                else "restore"
                if isinstance(effect, RestoreJob)
                else "reclaim"
            )
            nodes = self.job_nodes.get(effect.job, set())
            fan = _Fanout(kind, effect.job, set(nodes), now + self.op_timeout + MOVE_GRACE_S)
            self._fanouts[effect.op] = fan
            for slot in sorted(nodes):
                if slot in self.offline:
                    self._node_lost_in(effect.op, fan, slot, "is out of reach", now)
                else:
                    self._to(slot, {"k": "move", "op": effect.op, "kind": kind, "job": effect.job})
            self._finish_fanout(effect.op, now)
        elif isinstance(effect, AllocateRegion):
            session, rid = effect.ticket
            self._to(
                session_slot(session),
                {
                    "k": "alloc",
                    "conn": local_conn(session),
                    "rid": rid,
                    "job": effect.job,
                    "gpu": local_gpu(effect.gpu),
                    "nbytes": effect.nbytes,
                    "requested": effect.requested,
                },
            )
        elif isinstance(effect, NotifyJob):
            data = effect.data
            if effect.event in NOTED:
                self.notices.append(effect)
            if effect.event == "faulted":
                # A node that did not answer may have done its part: the next leader's stock-taking decides.
                data = {**data, "until_resync": effect.job in self._unknown}
            for slot in sorted(self.job_nodes.get(effect.job, ())):
                self._to(slot, {"k": "notify", "job": effect.job, "event": effect.event, "data": data})

    def _to(self, slot: int, message: dict[str, Any]) -> None:
        self._out.append(Outgoing(slot, {**message, "era": list(self.era)}))

    # --- moves on several nodes ----------------------------------------------------------

    def _fanout_done(self, slot: int, args: dict[str, Any], now: float) -> None:
        op = args["op"]
        fan = self._fanouts.get(op)
        if fan is None or slot not in fan.waiting:
            return  # late: the node was given up on
        fan.waiting.discard(slot)
        if not args["ok"]:
            fan.ok = False
            fan.errors.append(f"node {slot}: {args.get('error') or 'failed'}")
        fan.nbytes += args.get("nbytes", 0)
        fan.seconds = max(fan.seconds, args.get("seconds", 0.0))
        self._finish_fanout(op, now)

    def _node_lost_in(self, op: int, fan: _Fanout, slot: int, why: str, now: float) -> None:
        fan.waiting.discard(slot)
        fan.ok = False
        fan.unknown = True
        fan.errors.append(f"node {slot} {why}")
        self._finish_fanout(op, now)

    def _finish_fanout(self, op: int, now: float) -> None:
        fan = self._fanouts.get(op)
        if fan is None or fan.waiting:
            return
        del self._fanouts[op]
        if fan.kind == "reclaim":
            group = self.scheduler.jobs[fan.job].group
            self.job_nodes.pop(fan.job, None)
            self.gone.pop(fan.job, None)
            self.scheduler.handle(ReclaimFinished(op), now)
            self._trim(group, now)
        else:
            if fan.unknown:
                self._unknown.add(fan.job)
            error = "; ".join(fan.errors)
            event = MoveFinished(op, fan.ok, fan.nbytes, fan.seconds, error, kept_memory=fan.unknown)
            self.scheduler.handle(event, now)
        self._route(now)

    # --- jobs that are gone, and groups that cannot move -------------------------------------

    def _maybe_exited(self, job: str, now: float) -> None:
        core = self.scheduler.jobs.get(job)
        if core is None or core.sessions or not self.job_nodes.get(job, set()) <= self.gone.get(job, set()):
            return
        self._feed(JobExited(job), now)

    def _note_span(self, group: str) -> None:
        g = self.scheduler.groups.get(group)
        if g is not None:
            self.spans.setdefault(group, set()).update(gpu_slot(gpu) for gpu in g.gpus)

    def _trim(self, group: str, now: float) -> None:
        """A group stops spanning nodes where none of its jobs is left, so it never waits for them.

        A group spanning several nodes is forgotten with its last job (a single node's stays,
        with its figures); its fence stays the floor of this leader's grants.
        """
        g = self.scheduler.groups[group]
        slots = {s for j in self.scheduler.jobs.values() if j.group == group for s in self.job_nodes.get(j.name, ())}
        before = g.gpus
        if not slots and len({gpu_slot(gpu) for gpu in before}) > 1:
            self.fence_floor[group] = self.scheduler.forget_group(group)
            self.spans.pop(group, None)
            self._refreeze(now)
            return
        self.scheduler.shrink_group(group, [gpu for gpu in g.gpus if gpu_slot(gpu) in slots])
        if g.gpus != before:
            self.spans[group] = {gpu_slot(gpu) for gpu in g.gpus}
            self._refreeze(now)
            for s in sorted(slots):
                self._to(s, {"k": "span", "group": group, "gpus": list(g.gpus)})

    def _refreeze(self, now: float) -> None:
        frozen = {}
        for group, slots in self.spans.items():
            missing = sorted(slots & self.offline)
            if missing:
                frozen[group] = f"waiting for node(s) {missing} to be back"
        self.scheduler.handle(GroupsFrozen(frozen), now)

    # --- a new leader -------------------------------------------------------------------------

    @classmethod
    def rebuild(
        cls,
        era: Era,
        reports: dict[int, dict[str, Any]],
        missing: Iterable[int],
        now: float,
        *,
        max_waiters: int = 1024,
        op_timeout: float = 600.0,
        fence_floor: dict[str, int] | None = None,
        policies: dict[str, SlicePolicy] | None = None,
    ) -> tuple[Orchestrator, list[str]]:
        """The orchestrator of a new era from the nodes' reports (slot -> report).

        ``missing`` are member slots that did not report: groups with GPUs on them are
        frozen until they do. ``fence_floor``: the fences this leader gave in earlier eras
        of its term, which new grants must exceed. Returns the orchestrator and a list of what did not fit
        (inconsistent reports), for the log; those pieces are left out.
        """
        capacities = {global_gpu(s, int(g)): cap for s, r in reports.items() for g, cap in r["devices"].items()}
        orch = cls(era, capacities, max_waiters=max_waiters, op_timeout=op_timeout, policies=policies)
        orch.offline = set(missing)
        orch.fence_floor = dict(fence_floor or {})
        sched = orch.scheduler
        problems: list[str] = []
        # 1. jobs and where their state lives, merged over the nodes that hold any of it
        merged: dict[str, dict[str, Any]] = {}
        for slot, report in sorted(reports.items()):
            for j in report["jobs"]:
                m = merged.setdefault(
                    j["job"],
                    {
                        "group": j["group"],
                        "exclusive": j["exclusive"],
                        "locations": set(),
                        "footprint": {},
                        "faulted": [],
                        "span": set(),
                        "slots": set(),
                        "gone": set(),
                        "resident": {},
                    },
                )
                if m["group"] != j["group"] or m["exclusive"] != j["exclusive"]:
                    problems.append(
                        f"job {j['job']!r} is registered differently on node {slot}; that node's part is left out"
                    )
                    continue
                m["locations"].add(j["location"])
                for gpu, n in j["footprint"].items():
                    key = global_gpu(slot, int(gpu))
                    m["footprint"][key] = m["footprint"].get(key, 0) + n
                    if j["location"] == "resident":
                        m["resident"][key] = m["resident"].get(key, 0) + n
                if j["faulted"]:
                    m["faulted"].append(j["faulted"])
                m["span"].update(j["span"])
                m["slots"].add(slot)
                if j["gone"]:
                    m["gone"].add(slot)
        settle: list[tuple[str, dict[int, int]]] = []
        for name, m in merged.items():
            gpus = sorted(g for g in m["span"] if g in capacities)
            if not gpus:
                problems.append(f"job {name!r}: none of its group's GPUs reported; left out")
                continue
            group = sched.groups.get(m["group"])
            if group is None:
                sched.adopt_group(m["group"], tuple(gpus), now)
            else:
                sched.extend_group(m["group"], gpus)
            orch.spans.setdefault(m["group"], set()).update(gpu_slot(g) for g in m["span"])
            location = Location.PARKED if m["locations"] == {"parked"} else Location.RESIDENT
            footprint = {g: n for g, n in m["footprint"].items() if g in capacities}
            if m["locations"] == {"parked", "resident"}:
                # Count what the GPUs hold now; the rest is the job's again once it is parked everywhere.
                settle.append((name, footprint))
                footprint = {g: n for g, n in m["resident"].items() if g in capacities}
            sched.adopt_job(name, m["group"], m["exclusive"], location, footprint, "; ".join(m["faulted"]))
            orch.job_nodes[name] = set(m["slots"])
            orch.gone[name] = set(m["gone"])
        orch._refreeze(now)  # before anything below may grant
        # 2. sessions
        for slot, report in sorted(reports.items()):
            for s in report["sessions"]:
                if s["job"] not in sched.jobs:
                    problems.append(f"session {slot}/{s['conn']} of job {s['job']!r} is left out")
                    continue
                job = sched.jobs[s["job"]]
                event = JobRegistered(
                    global_session(slot, s["conn"]),
                    job.name,
                    job.group,
                    None,
                    tuple(s["pids"]),
                    exclusive=job.exclusive,
                    slot=slot,
                )
                try:
                    sched.handle(event, now)
                except errors.TimeslicedError as exc:
                    problems.append(f"session {slot}/{s['conn']} of job {s['job']!r}: {exc.message}")
        # 3. fences and holders: the highest fence any node saw, and the holder under it
        claims: dict[str, list[tuple[int, int, str, set[int]]]] = {}  # group -> (fence, slot, job, sessions)
        for name, fence in orch.fence_floor.items():
            if name in sched.groups:
                sched.raise_fence(name, fence)
        for slot, report in sorted(reports.items()):
            for name, fence in report["fences"].items():
                if name in sched.groups:
                    sched.raise_fence(name, fence)
            for h in report["holders"]:
                sessions = {global_session(slot, c) for c in h["conns"]}
                claims.setdefault(h["group"], []).append((h["fence"], slot, h["job"], sessions))
        for name, held in claims.items():
            fence, _, holder, _ = max(held, key=lambda c: c[0])
            sessions = set().union(*(c[3] for c in held if c[0] == fence and c[2] == holder))
            try:
                sched.adopt_holder(name, holder, sessions & sched.jobs[holder].sessions, fence, now)
                adopted = True
            except (KeyError, ValueError) as exc:
                problems.append(f"holder {holder!r} of {name!r} is not adopted: {exc}")
                adopted = False
            lost = {"group": name, "reason": "the new leader found another holder or an inconsistent state"}
            for f, slot, other, _ in held:
                if not adopted or (f, other) != (fence, holder):
                    orch._to(slot, {"k": "notify", "job": other, "event": "lock_lost", "data": lost})
        # 4. half-switched jobs are parked everywhere before anyone waits for them
        for name, whole in settle:
            if sched.groups[sched.jobs[name].group].holder != name:
                sched.settle(name, now, whole)
        # 5. waiting acquires, in the order the previous leader queued them (then as they arrived),
        # after the turns a restarted node kept for its jobs (the holder's first)
        waiting = [
            (w["seq"] is None, w["seq"] or 0, w["order"], slot, w)
            for slot, report in reports.items()
            for w in [*report.get("turns", ()), *report["waiting"]]
        ]
        for _, _, _, slot, w in sorted(waiting, key=lambda t: t[:4]):
            if "kept_for" in w:
                try:
                    sched.keep_turn(w["job"], now + w["kept_for"], now)
                except (KeyError, ValueError) as exc:
                    problems.append(f"the turn of job {w['job']!r} is not kept: {exc}")
                continue
            session = global_session(slot, w["conn"])
            deadline = None if w["deadline_in"] is None else now + w["deadline_in"]
            try:
                sched.handle(AcquireRequested(session, w["rid"], deadline), now)
            except errors.TimeslicedError as exc:
                orch._to(slot, {"k": "fail", "conn": w["conn"], "rid": w["rid"], "error": errors.to_wire(exc)})
        for name in list(sched.jobs):
            orch._maybe_exited(name, now)
        orch._route(now)
        return orch, problems
