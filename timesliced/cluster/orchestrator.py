"""The leader's side of the cluster (pure): one scheduler for every node, and what each node must do.

The orchestrator wraps the scheduler core. Nodes hand it their clients' requests and their own
notices (``handle``, typed: see ``asks.py``); it feeds them to the scheduler and turns each effect
into messages for the nodes concerned (``drain``): a grant goes to the nodes of the waiting
sessions, a snapshot to every node where the job has state, and the scheduler only hears that the
move finished once every one of those nodes said so. Every message carries the era ``(term, gen)``
it was decided in.

A new leader builds its orchestrator from what the nodes report (``Orchestrator.rebuild``, its
steps in ``rebuild.py``): registered jobs and sessions, where each job's state lives, current
holders and the fences they hold, and every waiting acquire in the order the previous leader
queued it.

Never half-changed: an input checks what it needs before the scheduler's first step, and the
scheduler changes nothing when it raises, so an input that raises before or in that step leaves
the orchestrator as it was. Should anything raise after it (a bug), the scheduler is ahead of what
the nodes were told: ``broken`` is set, and the leader drops this orchestrator and takes stock again.
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
    FaultCleared,
    ForceReleaseRequested,
    GrantLock,
    GroupsFrozen,
    HostMemoryRead,
    JobExited,
    JobRegistered,
    MemoryMeasured,
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
from ..core.ids import GPU_STRIDE, global_gpu, global_session, gpu_slot, local_conn, local_gpu, session_slot
from ..core.location import Location
from ..core.model import AUTO
from ..core.policy import QueuePolicy
from ..core.residency import Options
from ..core.scheduler import Scheduler
from ..core.slices import SlicePolicy
from . import rebuild as steps
from .asks import (
    Acquire,
    Alloc,
    Cancel,
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
    WireError,
)
from .messages import Allotted, Era, Failed, FromLeader, Grant, GrantInfo, Move, Notify, Queued, Span
from .report import NodeReport

# notices that also go to the log and the history
NOTED = ("faulted", "slice_overdue", "preempted", "move_failed", "resumed", "policy")
MOVE_GRACE_S = 5.0  # on top of the node's own operation timeout, for the messages
MOVE_KINDS: dict[type[Effect], str] = {SnapshotJob: "snapshot", RestoreJob: "restore", ReclaimJob: "reclaim"}


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
    by_slot: dict[int, int] = field(default_factory=dict)  # what each node moved
    done: int = 0  # nodes whose part succeeded
    intact: bool = True  # every node that failed left its part where it was
    codes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Outgoing:
    """A message for the node in ``slot``."""

    slot: int
    message: FromLeader


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
        residency: Options | None = None,
        queue_policies: dict[str, QueuePolicy] | None = None,
    ) -> None:
        self.era = era
        r = residency or Options()
        self.residency = r
        self.scheduler = Scheduler(
            capacities,
            max_waiters=max_waiters,
            policies=policies,
            memory_headroom=r.memory_headroom,
            prefetch=r.prefetch,
            stream_switches=r.stream_switches,
            queue_policies=queue_policies,
            anticipate_s=r.anticipate_s,
        )
        self.op_timeout = op_timeout
        self.job_nodes: dict[str, set[int]] = {}  # job -> slots where it has sessions or state
        self.gone: dict[str, set[int]] = {}  # job -> slots whose processes of it are all gone
        self.offline: set[int] = set()  # slots out of reach in this era
        self.spans: dict[str, set[int]] = {}  # group -> slots its GPUs are on, as far as anyone knows
        self.grants: list[GrantLock] = []  # new grants since the last drain, for figures
        self.notices: list[NotifyJob] = []  # faults, overdue slices and preemptions, for the log and history
        self.fence_floor: dict[str, int] = {}  # fences this leader already gave (earlier eras of its term)
        self.broken = False  # an input failed after the scheduler changed: see the module's docstring
        self._fanouts: dict[int, _Fanout] = {}
        self._unknown: set[str] = set()  # jobs whose last move has an unknown outcome on some node
        self._out: list[Outgoing] = []
        self._seq = itertools.count(1)
        self._changed = False  # the current input changed something (the scheduler, or the fanouts)

    @classmethod
    def rebuild(
        cls,
        era: Era,
        reports: dict[int, NodeReport],
        missing: Iterable[int],
        now: float,
        *,
        max_waiters: int = 1024,
        op_timeout: float = 600.0,
        fence_floor: dict[str, int] | None = None,
        policies: dict[str, SlicePolicy] | None = None,
        residency: Options | None = None,
        queue_policies: dict[str, QueuePolicy] | None = None,
    ) -> tuple[Orchestrator, list[str]]:
        """The orchestrator of a new era from the nodes' reports (slot -> report).

        ``missing`` are member slots that did not report: groups with GPUs on them are
        frozen until they do. ``fence_floor``: the fences this leader gave in earlier eras
        of its term, which new grants must exceed. Returns the orchestrator and a list of what did not fit
        (inconsistent reports), for the log; those pieces are left out. Nothing exists but what it returns.
        """
        capacities = {global_gpu(s, g): cap for s, r in reports.items() for g, cap in r.devices.items()}
        orch = cls(
            era,
            capacities,
            max_waiters=max_waiters,
            op_timeout=op_timeout,
            policies=policies,
            residency=residency,
            queue_policies=queue_policies,
        )
        orch.offline = set(missing)
        orch.fence_floor = dict(fence_floor or {})
        with orch._input():  # its first: should it raise, nobody ever sees this orchestrator
            merged, problems = steps.merge_jobs(reports)
            settle = steps.adopt_jobs(orch, merged, now, problems)
            orch.refreeze(now)  # before anything below may grant
            steps.adopt_sessions(orch, reports, now, problems)
            steps.adopt_fences_and_holders(orch, reports, now, problems)
            steps.settle_half_switched(orch, settle, now)
            steps.queue_waiting(orch, reports, now, problems)
            for name in list(orch.scheduler.jobs):
                orch.maybe_exited(name, now)
            orch.route(now)
        return orch, problems

    # --- inputs ----------------------------------------------------------------------

    def handle(self, slot: int, ask: Request | Notice, now: float) -> Registered | Any:
        """A request of a client of the node in ``slot``, or a notice of that node; the result.

        A notice's result is None. Raises ``TimeslicedError`` for a refused request (nothing changed).
        """
        with self._input():
            match ask:
                case Register():
                    return self._register(slot, ask, now)
                case Acquire():
                    session = global_session(slot, ask.conn)
                    if ask.rid == AUTO:
                        raise errors.BadRequest(f"request id {AUTO} is reserved")
                    deadline = None if ask.timeout is None else now + ask.timeout
                    self._feed(AcquireRequested(session, ask.rid, deadline, ask.gang, ask.members), now)
                    self.send(slot, Queued(self.era, ask.conn, ask.rid, next(self._seq)))
                    return None
                case Cancel():
                    return self._feed(AcquireWithdrawn(global_session(slot, ask.conn), ask.request), now)
                case Release():
                    return self._feed(ReleaseRequested(global_session(slot, ask.conn)), now)
                case Alloc():
                    event = MemoryRequested(
                        global_session(slot, ask.conn), ask.rid, _gpu(slot, ask.gpu), ask.nbytes, ask.requested
                    )
                    return self._feed(event, now)
                case Closed():
                    return self._feed(SessionClosed(global_session(slot, ask.conn)), now)
                case Freed():
                    self._freed(slot, ask, now)
                    return None
                case Gone():
                    self._changed = True
                    self.gone.setdefault(ask.job, set()).add(slot)
                    self.maybe_exited(ask.job, now)
                    return None
                case MoveDone():
                    self._fanout_done(slot, ask, now)
                    return None
                case Measured():
                    gpus = {_gpu(slot, g): n for g, n in ask.held.items()}
                    return self._feed(MemoryMeasured(ask.job, gpus), now)
                case HostRead():
                    reading = HostMemoryRead(
                        slot, ask.room, ask.limit, dict(ask.pools), dict(ask.members), dict(ask.sizes), dict(ask.source)
                    )
                    return self._feed(reading, now)
                case _:
                    raise TypeError(f"not a request or a notice: {ask!r}")

    def admin(self, event: ForceReleaseRequested | DrainRequested | FaultCleared, now: float) -> Any:
        """An administrator's action; raises ``TimeslicedError`` (nothing changed)."""
        with self._input():
            return self._feed(event, now)

    def handle_timers(self, now: float) -> None:
        with self._input():
            for op, fan in list(self._fanouts.items()):
                if fan.deadline <= now:
                    for slot in list(fan.waiting):
                        self._node_lost_in(op, fan, slot, "did not answer in time", now)
            self._changed = True  # the scheduler's timers may change it, and do not say whether they raised before
            self.scheduler.handle_timers(now)
            self.route(now)

    def next_deadline(self) -> float | None:
        times = [f.deadline for f in self._fanouts.values()]
        if (d := self.scheduler.next_deadline()) is not None:
            times.append(d)
        return min(times) if times else None

    def node_offline(self, slot: int, now: float) -> None:
        """The node in ``slot`` is out of reach: its groups stop, its moves fail."""
        with self._input():
            self.offline.add(slot)
            self._changed = True
            for op, fan in list(self._fanouts.items()):
                if slot in fan.waiting:
                    self._node_lost_in(op, fan, slot, "is out of reach", now)
            self.refreeze(now)
            self.route(now)

    def drain(self) -> list[Outgoing]:
        out, self._out = self._out, []
        return out

    def _input(self) -> _Input:
        return _Input(self)

    # --- requests and notices ---------------------------------------------------------------

    def _register(self, slot: int, ask: Register, now: float) -> Registered:
        gpus = None if ask.gpus is None else tuple(_gpu(slot, g) for g in ask.gpus)
        event = JobRegistered(
            global_session(slot, ask.conn),
            ask.job,
            ask.group,
            gpus,
            ask.pids,
            exclusive=ask.exclusive,
            slot=slot,
            freezes=ask.freezes,
            memory=None if ask.memory is None else {_gpu(slot, g): n for g, n in ask.memory.items()},
            memory_each=ask.memory_each,
            priority=ask.priority,
            weight=ask.weight,
            party=ask.party or "",
        )
        group = self.scheduler.groups.get(ask.group)
        before = group.gpus if group is not None else ()
        result: dict[str, Any] = self._feed(event, now)
        registered = Registered(result["job"], result["group"], tuple(result["gpus"]), Location(result["location"]))
        if not before:  # a new group: its fences go on from where this leader's earlier eras left them
            self.scheduler.raise_fence(ask.group, self.fence_floor.get(ask.group, 0))
        self.job_nodes.setdefault(ask.job, set()).add(slot)
        self.gone.get(ask.job, set()).discard(slot)
        self.note_span(ask.group)
        if before and registered.gpus != before:  # the group grew onto another node: tell its nodes
            for s in self._group_slots(ask.group):
                self.send(s, Span(self.era, ask.group, registered.gpus))
        return registered

    def _freed(self, slot: int, ask: Freed, now: float) -> None:
        gpu = _gpu(slot, ask.gpu)
        job = self.scheduler.jobs.get(ask.job)
        if job is None:
            return
        # The node freed what it had; the ledger frees no more than it counts (a node's part that a
        # new leader did not count yet, while a switch cut short settles, was never counted).
        nbytes = min(ask.nbytes, job.footprint.get(gpu, 0))
        if nbytes:
            self._feed(MemoryReleased(ask.job, gpu, nbytes), now)

    def _group_slots(self, group: str) -> list[int]:
        jobs = [j.name for j in self.scheduler.jobs.values() if j.group == group]
        return sorted({s for j in jobs for s in self.job_nodes.get(j, ())})

    # --- the scheduler's decisions -> node messages ------------------------------------

    def _feed(self, event: Event, now: float) -> Any:
        result = self._step(event, now)
        self.route(now)
        return result

    def _step(self, event: Event, now: float) -> Any:
        result = self.scheduler.handle(event, now)  # when it raises, it changed nothing
        self._changed = True
        return result

    def route(self, now: float) -> None:
        """Turn what the scheduler decided into messages for the nodes."""
        for effect in self.scheduler.drain():
            self._route_one(effect, now)

    def _route_one(self, effect: Effect, now: float) -> None:
        match effect:
            case GrantLock():
                by_slot: dict[int, list[tuple[int, int]]] = {}
                for session, rid in effect.tickets:
                    by_slot.setdefault(session_slot(session), []).append((local_conn(session), rid))
                info = GrantInfo(
                    effect.group,
                    effect.job,
                    effect.fence,
                    effect.waited_s,
                    effect.switch_s,
                    effect.restored,
                    self.era[0],
                )
                for slot, tickets in by_slot.items():
                    self.send(slot, Grant(self.era, tuple(tickets), info, effect.again))
                if not effect.again:
                    self.grants.append(effect)
            case FailRequest():
                session, rid = effect.ticket
                self.send(session_slot(session), Failed(self.era, local_conn(session), rid, WireError.of(effect.error)))
            case SnapshotJob() | RestoreJob() | ReclaimJob():
                kind = MOVE_KINDS[type(effect)]
                nodes = self.job_nodes.get(effect.job, set())
                fan = _Fanout(kind, effect.job, set(nodes), now + self.op_timeout + MOVE_GRACE_S)
                self._fanouts[effect.op] = fan
                for slot in sorted(nodes):
                    if slot in self.offline:
                        self._node_lost_in(effect.op, fan, slot, "is out of reach", now)
                    else:
                        streams = effect.streams_with if isinstance(effect, RestoreJob) else ()
                        self.send(slot, Move(self.era, effect.op, kind, effect.job, streams))
                self._finish_fanout(effect.op, now)
            case AllocateRegion():
                session, rid = effect.ticket
                message = Allotted(
                    self.era,
                    local_conn(session),
                    rid,
                    effect.job,
                    local_gpu(effect.gpu),
                    effect.nbytes,
                    effect.requested,
                )
                self.send(session_slot(session), message)
            case NotifyJob():
                data = dict(effect.data)
                if effect.event in NOTED:
                    self.notices.append(effect)
                if effect.event == "faulted":
                    # A node that did not answer may have done its part: the next leader's stock-taking decides.
                    data["until_resync"] = effect.job in self._unknown
                for slot in sorted(self.job_nodes.get(effect.job, ())):
                    self.send(slot, Notify(self.era, effect.job, effect.event, data))

    def send(self, slot: int, message: FromLeader) -> None:
        self._out.append(Outgoing(slot, message))

    # --- moves on several nodes ----------------------------------------------------------

    def _fanout_done(self, slot: int, done: MoveDone, now: float) -> None:
        fan = self._fanouts.get(done.op)
        if fan is None or slot not in fan.waiting:
            return  # late: the node was given up on
        self._changed = True  # the fanout's own bookkeeping is part of the leader's state
        fan.waiting.discard(slot)
        if not done.ok:
            fan.ok = False
            fan.errors.append(
                f"node {slot}: {done.error or 'failed'}"
                if len(self.job_nodes.get(fan.job, ())) > 1
                else done.error or "failed"
            )
            fan.intact = fan.intact and done.intact
            if done.code:
                fan.codes.append(done.code)
        else:
            fan.done += 1
        fan.nbytes += done.nbytes
        if done.nbytes:
            fan.by_slot[slot] = fan.by_slot.get(slot, 0) + done.nbytes
        fan.seconds = max(fan.seconds, done.seconds)
        self._finish_fanout(done.op, now)

    def _node_lost_in(self, op: int, fan: _Fanout, slot: int, why: str, now: float) -> None:
        self._changed = True
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
        self._changed = True
        if fan.kind == "reclaim":
            group = self.scheduler.jobs[fan.job].group
            self.job_nodes.pop(fan.job, None)
            self.gone.pop(fan.job, None)
            self._step(ReclaimFinished(op), now)
            self._trim(group, now)
        else:
            if fan.unknown:
                self._unknown.add(fan.job)
            error = "; ".join(fan.errors)
            # Whole where it was only if no node moved its part and every failing one kept its part intact.
            intact = not fan.ok and not fan.unknown and fan.intact and not fan.done
            code = fan.codes[0] if fan.codes and len(set(fan.codes)) == 1 else ""
            finished = MoveFinished(
                op,
                fan.ok,
                fan.nbytes,
                fan.seconds,
                error,
                kept_memory=fan.unknown,
                intact=intact,
                code=code,
                by_slot=dict(fan.by_slot),
            )
            self._step(finished, now)
        self.route(now)

    # --- jobs that are gone, and groups that cannot move -------------------------------------

    def maybe_exited(self, job: str, now: float) -> None:
        """Tell the scheduler that ``job`` exited once every node it was on reported it gone."""
        core = self.scheduler.jobs.get(job)
        if core is None or core.sessions or not self.job_nodes.get(job, set()) <= self.gone.get(job, set()):
            return
        self._feed(JobExited(job), now)

    def note_span(self, group: str) -> None:
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
            self.refreeze(now)
            return
        self.scheduler.shrink_group(group, [gpu for gpu in g.gpus if gpu_slot(gpu) in slots])
        if g.gpus != before:
            self.spans[group] = {gpu_slot(gpu) for gpu in g.gpus}
            self.refreeze(now)
            for s in sorted(slots):
                self.send(s, Span(self.era, group, g.gpus))

    def refreeze(self, now: float) -> None:
        """Groups with GPUs on a node out of reach grant nothing until it is back."""
        frozen = {}
        for group, slots in self.spans.items():
            missing = sorted(slots & self.offline)
            if missing:
                frozen[group] = f"waiting for node(s) {missing} to be back"
        self._step(GroupsFrozen(frozen), now)


def _gpu(slot: int, gpu: int) -> int:
    """The cluster-wide id of GPU ``gpu`` of the node in ``slot``; raises ``UnknownDevice``."""
    if gpu >= GPU_STRIDE:
        raise errors.UnknownDevice(f"no GPU {gpu} on any node (a node has at most {GPU_STRIDE})")
    return global_gpu(slot, gpu)


class _Input:
    """Around one input: an orchestrator that raises after its scheduler stepped is ``broken``.

    A class rather than a generator context manager: it is on the lock's path.
    """

    __slots__ = ("orch",)

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch

    def __enter__(self) -> None:
        self.orch._changed = False

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None and self.orch._changed:
            self.orch.broken = True
        self.orch._changed = False
