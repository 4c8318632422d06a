"""``timesliced bench scale``: the pure cores' cost per event as the cluster grows (no sockets, no processes).

The leader's orchestrator (and the scheduler inside it) is driven directly, as the nodes would drive it:
16 nodes (slots) of 8 simulated GPUs each, groups of jobs on one GPU each, every job taking turns:
acquire, allocate simulated memory on its first grant (more than half a GPU, so every handoff parks
the previous holder and restores the next), release, acquire again. The bench plays the nodes: it
answers every move (snapshot, restore) at once, and turns each grant into the job's next request.
``per_event_us`` is the time inside ``Orchestrator.handle`` and ``drain`` per input (the median of
``CHUNKS`` stretches of the run, registrations included), keyed by the number of jobs; ``rebuild_ms``
is a new leader's ``Orchestrator.rebuild`` from the nodes' reports of that state. Correctness is
checked as it runs (never two holders of a group, fences strictly increasing, every input accepted)
and, with ``check=True``, the scheduler's invariants after every input; the figures are for reading,
no test asserts them.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..cluster.asks import Acquire, Alloc, MoveDone, Notice, Register, Release, Request
from ..cluster.messages import Allotted, Failed, Grant, Move, Queued
from ..cluster.orchestrator import Orchestrator
from ..cluster.report import NodeReport, ReportedHolder, ReportedJob, ReportedSession, ReportedWait
from ..core.ids import global_gpu, local_gpu

NODES = 16
GPUS_PER_NODE = 8
MAX_GROUPS = 100
CAPACITY = 16 << 30
FOOTPRINT = CAPACITY * 6 // 10  # two jobs of a group never fit together: every handoff is a switch
SIZES = (10, 1000)
CHUNKS = 20  # the run is timed in this many stretches; their median resists a pause of the machine's


@dataclass
class _Job:
    name: str
    group: str
    slot: int
    conn: int
    gpu: int  # the node's own GPU index
    rid: int = 0
    allocated: bool = False
    waiting: int | None = None  # the request id of its acquire in the queue
    seq: int | None = None  # the place the leader gave that acquire


@dataclass
class _Run:
    """What the bench, playing the nodes, knows: the jobs and the inputs still to feed."""

    jobs: dict[str, _Job]
    by_conn: dict[tuple[int, int], _Job]
    inbox: deque[tuple[int, Request | Notice]] = field(default_factory=deque)
    holders: dict[str, str] = field(default_factory=dict)  # group -> job, as grants and releases said
    fences: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    events: int = 0
    grants: int = 0
    moves: int = 0
    seconds: float = 0.0  # inside the orchestrator only
    chunks: list[float] = field(default_factory=list)  # the per-event time of each stretch of CHUNKS


def run_scale(
    sizes: tuple[int, ...] = SIZES, events: int = 20000, check: bool = False, seed: int = 1
) -> dict[str, Any]:
    """Per-event cost and rebuild time at each job count in ``sizes``; see the module's docstring.

    ``check``: also the scheduler's invariants after every input (slow; for tests).
    Raises ``ValueError`` for sizes below 2 or fewer than 10 events.
    """
    if not sizes or min(sizes) < 2 or events < 10:
        raise ValueError("need job counts of at least 2 and at least 10 events")
    per_event: dict[str, float] = {}
    rebuild: dict[str, float] = {}
    detail: dict[str, dict[str, Any]] = {}
    for jobs in sizes:
        orch, run = _drive(jobs, events, check, random.Random(seed))
        per_event[str(jobs)] = statistics.median(run.chunks) * 1e6
        rebuild_s, rebuilt_problems = _rebuild(orch, run)
        rebuild[str(jobs)] = rebuild_s * 1000
        detail[str(jobs)] = {
            "groups": _groups(jobs),
            "events": run.events,
            "grants": run.grants,
            "moves": run.moves,
            "problems": run.problems[:10],
            "rebuild_problems": rebuilt_problems[:10],
        }
    small, large = str(min(sizes)), str(max(sizes))
    return {
        "nodes": NODES,
        "gpus_per_node": GPUS_PER_NODE,
        "per_event_us": per_event,
        "per_event_ratio": per_event[large] / per_event[small],
        "rebuild_ms": rebuild,
        "runs": detail,
        "checked_invariants": check,
        "ok": all(not d["problems"] and not d["rebuild_problems"] for d in detail.values()),
    }


def _groups(jobs: int) -> int:
    return max(1, min(MAX_GROUPS, jobs // 2))  # every group has rivals, so every size hands over


def _drive(jobs: int, events: int, check: bool, rng: random.Random) -> tuple[Orchestrator, _Run]:
    capacities = {global_gpu(s, g): CAPACITY for s in range(NODES) for g in range(GPUS_PER_NODE)}
    orch = Orchestrator((1, 1), capacities)
    groups = _groups(jobs)
    table: dict[str, _Job] = {}
    for i in range(jobs):
        g = i % groups
        slot = g % NODES
        job = _Job(f"job-{i}", f"group-{g}", slot, conn=i + 1, gpu=(g // NODES) % GPUS_PER_NODE)
        table[job.name] = job
    run = _Run(table, {(j.slot, j.conn): j for j in table.values()})
    order = list(table.values())
    rng.shuffle(order)  # jobs start in no particular order
    for job in order:
        job.rid += 1
        run.inbox.append(
            (job.slot, Register(job.conn, job.rid, job.name, job.group, gpus=(job.gpu,), pids=(10000 + job.conn,)))
        )
    for job in order:
        run.inbox.append((job.slot, _acquire(job)))
    stretch = max(1, events // CHUNKS)
    while run.inbox and run.events < events:
        mark, spent = run.events, run.seconds
        while run.inbox and run.events < min(events, mark + stretch):
            _feed(orch, run, *run.inbox.popleft(), check)
        run.chunks.append((run.seconds - spent) / (run.events - mark))
    # The nodes report once their moves ended: finish those (and nothing else) before a rebuild.
    while any(isinstance(ask, MoveDone) for _, ask in run.inbox):
        slot, ask = run.inbox.popleft()
        if isinstance(ask, MoveDone):
            _feed(orch, run, slot, ask, check)
    return orch, run


def _acquire(job: _Job) -> Acquire:
    job.rid += 1
    job.waiting = job.rid
    return Acquire(job.conn, job.rid)


def _feed(orch: Orchestrator, run: _Run, slot: int, ask: Request | Notice, check: bool) -> None:
    start = time.perf_counter()
    try:
        orch.handle(slot, ask, float(run.events))
    except Exception as exc:  # every input the bench makes is a valid one
        run.problems.append(f"{type(ask).__name__} refused: {exc}")
    out = orch.drain()
    run.seconds += time.perf_counter() - start
    run.events += 1
    if check:
        orch.scheduler.check_invariants(float(run.events))
    if isinstance(ask, Release):
        job = run.by_conn[(slot, ask.conn)]
        if run.holders.pop(job.group, None) != job.name:
            run.problems.append(f"{job.name} released {job.group} without holding it")
        run.inbox.append((slot, _acquire(job)))
    for outgoing in out:
        _on_message(run, outgoing.slot, outgoing.message)


def _on_message(run: _Run, slot: int, message: Any) -> None:
    if isinstance(message, Grant):
        if message.again:
            return
        info = message.info
        run.grants += 1
        if (held := run.holders.get(info.group)) is not None:
            run.problems.append(f"{info.job} granted {info.group} while {held} holds it")
        if info.fence <= run.fences.get(info.group, 0):
            run.problems.append(f"{info.group}: fence {info.fence} after {run.fences[info.group]}")
        run.holders[info.group] = info.job
        run.fences[info.group] = info.fence
        for conn, _rid in message.tickets:
            job = run.by_conn[(slot, conn)]
            job.waiting = job.seq = None
            job.rid += 1
            if job.allocated:
                run.inbox.append((slot, Release(conn, job.rid)))
            else:
                run.inbox.append((slot, Alloc(conn, job.rid, job.gpu, FOOTPRINT, FOOTPRINT)))
    elif isinstance(message, Allotted):
        job = run.by_conn[(slot, message.conn)]
        job.allocated = True
        job.rid += 1
        run.inbox.append((slot, Release(message.conn, job.rid)))
    elif isinstance(message, Move):
        run.moves += 1
        run.inbox.append((slot, MoveDone(message.op, True, FOOTPRINT, 0.01)))
    elif isinstance(message, Queued):
        run.by_conn[(slot, message.conn)].seq = message.seq
    elif isinstance(message, Failed):
        run.problems.append(f"request {message.rid} of connection {message.conn} failed: {message.error.message}")


def _rebuild(orch: Orchestrator, run: _Run) -> tuple[float, list[str]]:
    """A new leader's rebuild from what each node would report of this state; its time (median of 3)."""
    reports = _reports(orch, run)
    times: list[float] = []
    problems: list[str] = []
    for _ in range(3):
        start = time.perf_counter()
        rebuilt, problems = Orchestrator.rebuild((2, 1), reports, (), float(run.events))
        rebuilt.drain()
        times.append(time.perf_counter() - start)
    return statistics.median(times), problems


def _reports(orch: Orchestrator, run: _Run) -> dict[int, NodeReport]:
    scheduler = orch.scheduler
    per_slot: dict[int, dict[str, list[Any]]] = {
        s: {"sessions": [], "jobs": [], "holders": [], "waiting": []} for s in range(NODES)
    }
    fences: dict[int, dict[str, int]] = {s: {} for s in range(NODES)}
    for job in run.jobs.values():
        core = scheduler.jobs.get(job.name)
        if core is None:
            continue  # its registration was refused: a problem of the run already
        group = scheduler.groups[job.group]
        part = per_slot[job.slot]
        part["sessions"].append(ReportedSession(job.conn, job.name, (10000 + job.conn,)))
        footprint = {local_gpu(g): n for g, n in core.footprint.items()}
        part["jobs"].append(
            ReportedJob(job.name, job.group, False, core.location, footprint, core.faulted, tuple(group.gpus))
        )
        if job.waiting is not None:
            part["waiting"].append(ReportedWait(job.conn, job.waiting, job.seq, len(part["waiting"]), None))
        if group.fence:
            fences[job.slot][job.group] = group.fence
        if group.holder == job.name:
            part["holders"].append(ReportedHolder(job.group, job.name, group.fence, (job.conn,)))
    return {
        s: NodeReport(
            devices={g: CAPACITY for g in range(GPUS_PER_NODE)},
            sessions=tuple(sorted(p["sessions"], key=lambda r: r.conn)),
            jobs=tuple(p["jobs"]),
            holders=tuple(p["holders"]),
            waiting=tuple(p["waiting"]),
            fences=fences[s],
        )
        for s, p in per_slot.items()
    }


def format_scale(r: dict[str, Any]) -> str:
    lines = [f"pure cores (orchestrator + scheduler), {r['nodes']} nodes of {r['gpus_per_node']} GPUs"]
    for jobs, us in r["per_event_us"].items():
        run = r["runs"][jobs]
        lines.append(
            f"  {jobs:>5} jobs over {run['groups']:>3} groups   {us:7.1f} us per event   "
            f"rebuild {r['rebuild_ms'][jobs]:8.2f} ms   ({run['events']} events, {run['grants']} grants, "
            f"{run['moves']} moves)"
        )
    lines.append(f"  per event, largest / smallest      {r['per_event_ratio']:.2f}x")
    if not r["ok"]:
        lines.append("  PROBLEMS: " + "; ".join(p for run in r["runs"].values() for p in run["problems"][:3]))
    return "\n".join(lines)
