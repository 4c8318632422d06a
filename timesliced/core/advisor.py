"""The placement advisor: which jobs to group so that their busy phases interleave (pure).

It reads a status document (``wire.status``): each job's phase statistics (``jobs[].phases``:
mean busy phase ``b``, mean gap ``g``, memory peak), the GPUs of its group, the GPUs' capacity and
the groups' measured switch times, and suggests a grouping of the jobs.

The model, per group of jobs that take turns on the same GPUs:

- a job alone has duty ``d = b / (b + g)``;
- in a group of two or more, each phase may need a switch of ``s`` seconds first: the measured
  median switch (or the one given), or none when the jobs' memory fits on the GPU together and
  none is a whole-process job (then nobody is parked, and a switch is a lock handoff);
- the group's load is ``U = sum((b_i + s) / (b_i + g_i))``; past 1 the group is saturated and
  every job is slowed by ``U`` at least;
- below that, a job waits when it asks while another holds: ``w_i = sum_j u_j (b_j + s) / 2`` over
  the others (the chance one holds, times half its phase), so its slowdown is
  ``max(U, 1 + (s + w_i) / (b_i + g_i))``;
- the group's predicted duty is ``min(1, sum(d_i / slowdown_i))``, its slowdown the largest of its
  jobs', and its makespan ``work_s * slowdown``: each job is taken to have ``work_s`` seconds of its
  own run time left (the status does not say how much work a job has left), so the makespan is
  per unit of work.

A group of two or more is suggested only when its load is at most 1 (the busy phases fit into one
timeline) and its slowdown at most ``max_slowdown``; jobs are grouped only with jobs that use as
many GPUs. Among the groupings that hold to that, the one with the least GPU time (GPUs times
makespan, summed over groups) wins, then the smallest slowdown, then the fewest groups whose
memory does not fit together; ties go to the first in the order of the job names, so the answer
is deterministic. When that grouping needs more GPUs than the status shows (jobs of one GPU count),
the grouping on the GPUs there are with the smallest slowdown is suggested instead, over-full
groups allowed. Up to ``EXACT_UP_TO`` jobs of one GPU count every grouping is tried; beyond, a
greedy pass places the busiest jobs first, each where it adds the least GPU time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from ..util.stats import median

EXACT_UP_TO = 10  # jobs of one GPU count whose groupings are all tried (Bell(10) = 115975 at most)
EXACT_UP_TO_OVER_FULL = 8  # the same when over-full groups must be tried too, nothing pruned (Bell(8) = 4140)
DEFAULT_SWITCH_S = 0.5  # a switch's cost when no group has measured one and none is given


@dataclass(frozen=True)
class Options:
    min_phases: int = 5  # phases (and gaps) a job needs before it is advised on
    max_slowdown: float = 1.25  # the most a suggested group may slow any of its jobs
    switch_s: float | None = None  # None: the groups' measured median switch, else DEFAULT_SWITCH_S
    work_s: float = 3600.0  # each job's run time left, alone: the unit of the makespans


@dataclass(frozen=True)
class JobLoad:
    """One job as the advisor sees it."""

    name: str
    group: str
    gpus: int
    busy_s: float
    gap_s: float
    memory: int  # the most it holds on one GPU
    exclusive: bool  # a whole process parked by its method (not the simulated GPU's regions)

    @property
    def duty(self) -> float:
        cycle = self.busy_s + self.gap_s
        return self.busy_s / cycle if cycle > 0 else 1.0


class JobLine(TypedDict):
    job: str
    group: str
    gpus: int
    busy_s: float
    gap_s: float
    duty: float
    memory_bytes: int


class MissingLine(TypedDict):
    job: str
    phases: int
    gaps: int


class GroupAdvice(TypedDict):
    jobs: list[str]
    group: str | None  # its current group (the current grouping), or None (a suggestion)
    gpus: int
    load: float
    predicted_duty: float
    predicted_slowdown: float
    predicted_makespan_s: float
    memory_fits: bool
    switch_s: float
    reason: str


class PlanAdvice(TypedDict):
    groups: list[GroupAdvice]
    gpus: int  # the GPUs it takes (the current groups' distinct GPUs; a suggested group gets GPUs of its own)
    gpu_seconds: float
    makespan_s: float


class Advice(TypedDict):
    node_gpus: int
    gpu_capacity: int | None
    switch_s: float
    switch_source: str  # measured | given | default
    work_s: float
    max_slowdown: float
    min_phases: int
    exact: bool
    jobs: list[JobLine]
    missing: list[MissingLine]
    current: PlanAdvice
    suggested: list[GroupAdvice]
    plan: PlanAdvice
    summary: str
    message: str | None  # why no advice could be given, and what to do


@dataclass(frozen=True)
class _Prediction:
    jobs: tuple[JobLoad, ...]
    gpus: int
    load: float
    duty: float
    slowdown: float
    fits: bool
    switch_s: float

    def ok(self, max_slowdown: float) -> bool:
        return len(self.jobs) == 1 or (self.load <= 1.0 + 1e-9 and self.slowdown <= max_slowdown + 1e-9)


def predict(jobs: Sequence[JobLoad], gpus: int, switch_s: float, capacity: int | None) -> _Prediction:
    """The model above, for ``jobs`` sharing ``gpus`` GPUs of ``capacity`` bytes each."""
    if len(jobs) == 1:
        (j,) = jobs
        fits = capacity is None or j.memory <= capacity
        return _Prediction(tuple(jobs), gpus, j.duty, j.duty, 1.0, fits, 0.0)
    fits = not any(j.exclusive for j in jobs) and (capacity is None or sum(j.memory for j in jobs) <= capacity)
    s = 0.0 if fits else switch_s
    cycles = [max(j.busy_s + j.gap_s, 1e-9) for j in jobs]
    shares = [(j.busy_s + s) / c for j, c in zip(jobs, cycles, strict=True)]
    load = sum(shares)
    slowdowns = []
    for i, c in enumerate(cycles):
        waits = sum(shares[k] * (other.busy_s + s) / 2 for k, other in enumerate(jobs) if k != i)
        slowdowns.append(max(load, 1.0 + (s + waits) / c))
    duty = min(1.0, sum(j.duty / sd for j, sd in zip(jobs, slowdowns, strict=True)))
    return _Prediction(tuple(jobs), gpus, load, duty, max(slowdowns), fits, s)


def advise(status: Mapping[str, Any], options: Options = Options()) -> Advice:
    """Suggest a grouping of the jobs of ``status`` (a status document of the cluster's leader).

    Raises ``ValueError`` for options out of range. Jobs with fewer than ``min_phases`` phases or
    gaps are listed under ``missing`` and left out; with fewer than one job left, ``message`` says
    what to do and nothing is suggested.
    """
    if options.min_phases < 1 or options.max_slowdown < 1.0 or options.work_s <= 0:
        raise ValueError("min_phases must be >= 1, max_slowdown >= 1 and work_s > 0")
    if options.switch_s is not None and options.switch_s < 0:
        raise ValueError("switch_s must be >= 0")
    devices = status.get("devices") or []
    capacities = [int(d["capacity"]) for d in devices]
    capacity = min(capacities) if capacities else None
    groups = {g["group"]: g for g in status.get("groups") or []}
    switch_s, source = _switch_cost(groups.values(), options.switch_s)
    loads, missing, unknown = _loads(status, groups, options.min_phases)
    held = [(name, g) for name, g in groups.items() if any(j.group == name for j in loads)]
    current = _plan(
        [(name, tuple(j for j in loads if j.group == name), len(g["gpus"])) for name, g in held],
        switch_s,
        capacity,
        options,
    )
    # Groups may share GPUs: each GPU counts once, for as long as the longest of its groups lasts.
    spans = {gpu: 0.0 for _, g in held for gpu in g["gpus"]}
    for (_, g), advice in zip(held, current["groups"], strict=True):
        for gpu in g["gpus"]:
            spans[gpu] = max(spans[gpu], advice["predicted_makespan_s"])
    current["gpus"], current["gpu_seconds"] = len(spans), sum(spans.values())
    exact = True
    blocks: list[tuple[JobLoad, ...]] = []
    counts = sorted({j.gpus for j in loads})
    budget = len(devices) if len(counts) == 1 else None  # jobs of several GPU counts: not split between them
    for gpus in counts:
        same = sorted((j for j in loads if j.gpus == gpus), key=lambda j: j.name)
        found, was_exact = _search(same, gpus, switch_s, capacity, options, budget)
        blocks += found
        exact = exact and was_exact
    plan = _plan([(None, b, b[0].gpus) for b in blocks], switch_s, capacity, options)
    message = None
    if unknown:
        message = (
            "the status has no phase figures: this daemon is not the cluster's leader; "
            "ask the leader's daemon (timesliced advise --address LEADER)"
        )
    elif not loads:
        message = (
            "not enough history to advise: "
            + (
                "; ".join(f"job {m['job']} has {m['phases']} phases and {m['gaps']} gaps" for m in missing)
                or "no jobs are registered"
            )
            + f". Each job needs {options.min_phases} GPU phases (acquire to release) and as many gaps; "
            "run the jobs longer, then ask again"
        )
    return {
        "node_gpus": len(devices),
        "gpu_capacity": capacity,
        "switch_s": switch_s,
        "switch_source": source,
        "work_s": options.work_s,
        "max_slowdown": options.max_slowdown,
        "min_phases": options.min_phases,
        "exact": exact,
        "jobs": [
            {
                "job": j.name,
                "group": j.group,
                "gpus": j.gpus,
                "busy_s": j.busy_s,
                "gap_s": j.gap_s,
                "duty": j.duty,
                "memory_bytes": j.memory,
            }
            for j in sorted(loads, key=lambda j: j.name)
        ],
        "missing": missing,
        "current": current,
        "suggested": plan["groups"],
        "plan": plan,
        "summary": _summary(current, plan, len(devices), options.work_s) if loads else "",
        "message": message,
    }


# --- reading the status ---------------------------------------------------------------------


def _switch_cost(groups: Any, given: float | None) -> tuple[float, str]:
    if given is not None:
        return given, "given"
    measured = [g["median_switch_s"] for g in groups if g.get("switches") and g.get("median_switch_s") is not None]
    if measured:
        return float(median(measured) or 0.0), "measured"
    return DEFAULT_SWITCH_S, "default"


def _loads(
    status: Mapping[str, Any], groups: Mapping[str, Any], min_phases: int
) -> tuple[list[JobLoad], list[MissingLine], bool]:
    loads: list[JobLoad] = []
    missing: list[MissingLine] = []
    unknown = False
    for j in status.get("jobs") or []:
        phases = j.get("phases")
        if phases is None:
            unknown = True
            continue
        count, gaps = int(phases["count"]), int(phases["gaps"])
        busy, gap = phases.get("busy_mean_s"), phases.get("gap_mean_s")
        if count < min_phases or gaps < min_phases or busy is None or gap is None or j.get("faulted"):
            missing.append({"job": j["job"], "phases": count, "gaps": gaps})
            continue
        memory = max(
            int(phases.get("memory_peak_bytes") or 0),
            max((int(v) for v in (j.get("footprint") or {}).values()), default=0),
            max((int(v) for v in (j.get("measured") or {}).values()), default=0),
        )
        group = groups.get(j["group"])
        gpus = len(group["gpus"]) if group is not None else max(len(j.get("footprint") or {}), 1)
        park = j.get("park")
        loads.append(JobLoad(j["job"], j["group"], gpus, float(busy), float(gap), memory, park not in (None, "sim")))
    return loads, sorted(missing, key=lambda m: m["job"]), unknown


# --- the search -----------------------------------------------------------------------------


def _search(
    jobs: list[JobLoad], gpus: int, switch_s: float, capacity: int | None, options: Options, budget: int | None
) -> tuple[list[tuple[JobLoad, ...]], bool]:
    """The best grouping of ``jobs`` (all on ``gpus`` GPUs), and whether every grouping was tried.

    ``budget``: the GPUs there are for them; when the best grouping needs more, the one that fits
    with the smallest slowdown is taken instead (over-full groups allowed), for up to
    ``EXACT_UP_TO_OVER_FULL`` jobs.
    """
    memo: dict[tuple[int, ...], _Prediction] = {}

    def block(ids: tuple[int, ...]) -> _Prediction:
        p = memo.get(ids)
        if p is None:
            p = memo[ids] = predict([jobs[i] for i in ids], gpus, switch_s, capacity)
        return p

    def key(partition: Sequence[tuple[int, ...]]) -> tuple[float, float, int]:
        preds = [block(b) for b in partition]
        return (
            round(sum(p.gpus * p.slowdown for p in preds), 9),
            round(max(p.slowdown for p in preds), 9),
            sum(not p.fits for p in preds),
        )

    def best_of(partitions: Iterator[list[tuple[int, ...]]], fitting: bool) -> list[tuple[int, ...]] | None:
        best: list[tuple[int, ...]] | None = None
        best_key: tuple[float, ...] | None = None
        for partition in partitions:
            if fitting:
                k: tuple[float, ...] = (round(max(block(b).slowdown for b in partition), 9), *key(partition))
            else:
                k = key(partition)
            if best_key is None or k < best_key:
                best, best_key = partition, k
        return best

    if len(jobs) <= EXACT_UP_TO:
        best = best_of(_partitions(len(jobs), lambda ids: block(ids).ok(options.max_slowdown)), False)
        assert best is not None  # every job alone is always a grouping
        if budget is not None and len(best) * gpus > budget and len(jobs) <= EXACT_UP_TO_OVER_FULL:
            groups = budget // gpus
            fitting = best_of((p for p in _partitions(len(jobs), lambda ids: True) if len(p) <= groups), True)
            best = fitting or best
        return [tuple(jobs[i] for i in b) for b in best], True
    # Greedy: the busiest first, each into the group where it adds the least GPU time (or alone).
    order = sorted(range(len(jobs)), key=lambda i: (-jobs[i].duty, jobs[i].name))
    blocks: list[tuple[int, ...]] = []
    for i in order:
        choice, cost = None, float(gpus)  # alone: gpus GPUs at slowdown 1
        for n, b in enumerate(blocks):
            grown = tuple(sorted((*b, i)))
            p = block(grown)
            if p.ok(options.max_slowdown):
                added = p.gpus * p.slowdown - block(b).gpus * block(b).slowdown
                if added < cost - 1e-9:
                    choice, cost = n, added
        if choice is None:
            blocks.append((i,))
        else:
            blocks[choice] = tuple(sorted((*blocks[choice], i)))
    return [tuple(jobs[i] for i in b) for b in sorted(blocks)], False


def _partitions(n: int, allowed: Any) -> Iterator[list[tuple[int, ...]]]:
    """Every partition of ``range(n)`` whose blocks are all ``allowed``, in a fixed order.

    A block is only grown while it stays allowed: adding a job never lowers a group's load or
    slowdown, so a block that is not allowed has no allowed superset.
    """
    blocks: list[list[int]] = []

    def place(i: int) -> Iterator[list[tuple[int, ...]]]:
        if i == n:
            yield [tuple(b) for b in blocks]
            return
        for b in blocks:
            b.append(i)
            if allowed(tuple(b)):
                yield from place(i + 1)
            b.pop()
        blocks.append([i])
        yield from place(i + 1)
        blocks.pop()

    yield from place(0)


# --- describing ------------------------------------------------------------------------------


def _plan(
    groups: Sequence[tuple[str | None, tuple[JobLoad, ...], int]],
    switch_s: float,
    capacity: int | None,
    options: Options,
) -> PlanAdvice:
    out: list[GroupAdvice] = []
    for name, jobs, gpus in groups:
        p = predict(list(jobs), gpus, switch_s, capacity)
        out.append(
            {
                "jobs": [j.name for j in jobs],
                "group": name,
                "gpus": gpus,
                "load": p.load,
                "predicted_duty": p.duty,
                "predicted_slowdown": p.slowdown,
                "predicted_makespan_s": options.work_s * p.slowdown,
                "memory_fits": p.fits,
                "switch_s": p.switch_s,
                "reason": _reason(p, capacity, options, suggested=name is None),
            }
        )
    return {
        "groups": out,
        "gpus": sum(g["gpus"] for g in out),
        "gpu_seconds": sum(g["gpus"] * g["predicted_makespan_s"] for g in out),
        "makespan_s": max((g["predicted_makespan_s"] for g in out), default=0.0),
    }


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _names(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _reason(p: _Prediction, capacity: int | None, options: Options, *, suggested: bool) -> str:
    jobs = p.jobs
    if len(jobs) == 1:
        (j,) = jobs
        if capacity is not None and j.memory > capacity:
            return f"{j.name} holds {_mib(j.memory)} on a GPU of {_mib(capacity)}: it does not fit by itself"
        if not suggested:
            return f"{j.name} busy {j.duty:.0%} alone on {_gpus(p.gpus)}"
        if j.duty >= 0.9:
            return f"{j.name} busy {j.duty:.0%}: it leaves too little idle time to share; alone on {_gpus(p.gpus)}"
        return (
            f"{j.name} busy {j.duty:.0%}: no other job's busy phases fit into its gaps within a "
            f"{options.max_slowdown:g}x slowdown; alone on {_gpus(p.gpus)}"
        )
    busy = _names([f"{j.name} busy {j.duty:.0%}" for j in jobs])
    alone = _names([f"{j.duty:.0%}" for j in jobs])
    if p.fits:
        memory = (
            f"their memory fits together ({_mib(sum(j.memory for j in jobs))}"
            + (f" of {_mib(capacity)}" if capacity is not None else "")
            + "): switches move nothing"
        )
    else:
        memory = f"switches park and restore (about {p.switch_s * 1000:.0f} ms each)"
    line = (
        f"{busy}: together {p.duty:.0%} duty on {_gpus(p.gpus)} instead of {len(jobs) * p.gpus} GPUs at {alone}; "
        f"predicted makespan {p.slowdown:.2f}x alone; {memory}"
    )
    if p.load > 1.0 + 1e-9:
        line += f"; over-full ({p.load:.0%} load): every job waits its turn"
    return line


def _summary(current: PlanAdvice, plan: PlanAdvice, node_gpus: int, work_s: float) -> str:
    ratio = plan["gpu_seconds"] / current["gpu_seconds"] if current["gpu_seconds"] else 1.0
    line = (
        f"suggested: {_count(len(plan['groups']), 'group')} on {_gpus(plan['gpus'])} "
        f"(now {len(current['groups'])} on {_gpus(current['gpus'])}); GPU time {ratio:.2f}x of now; "
        f"makespan {plan['makespan_s'] / work_s:.2f}x of a job's run time alone "
        f"(now {current['makespan_s'] / work_s:.2f}x)"
    )
    if plan["gpus"] > node_gpus:
        line += f"; it needs {plan['gpus']} GPUs and the status shows {node_gpus}"
    return line
