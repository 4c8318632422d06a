"""The scheduler as plain data, for ``status``, the metrics and the dashboard (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from ..util.stats import median, percentile
from ..wire import status as schema
from .host import HostLedger, refused
from .ledger import MemoryLedger
from .location import Location
from .model import AUTO, Gang, Group, GroupState, Job
from .phases import summary
from .policy import QueuePolicies, share
from .registry import Registry
from .residency import over_declared
from .slices import SlicePolicies


def group_state(registry: Registry, group: Group) -> GroupState:
    if group.switch is not None:
        return GroupState.SWITCHING
    if group.holder is not None:
        return GroupState.LOCKED
    if any(j.faulted and not j.exiting for j in registry.jobs.values() if j.group == group.name):
        return GroupState.FAULTED
    last = registry.jobs.get(group.last_holder or "")
    if last is not None and last.location is Location.RESIDENT and not last.faulted:
        return GroupState.IDLE_YIELDED
    return GroupState.IDLE


def describe(
    registry: Registry,
    ledger: MemoryLedger,
    slices: SlicePolicies,
    frozen: Mapping[str, str],
    now: float,
    policies: QueuePolicies | None = None,
    gangs: Mapping[str, Gang] | None = None,
) -> schema.SchedulerPicture:
    """A plain-data picture of the scheduler at ``now`` (``wire.status``)."""
    jobs = registry.jobs.values()
    return {
        "devices": [
            {
                "index": gpu,
                "capacity": cap,
                "used": ledger.used(gpu),
                "jobs": {
                    j.name: {"bytes": j.footprint[gpu], "location": j.location.value}
                    for j in jobs
                    if j.footprint.get(gpu)
                },
            }
            for gpu, cap in sorted(ledger.capacities.items())
        ],
        "groups": [
            _group(registry, slices, policies or QueuePolicies({}), frozen, g, now) for g in registry.groups.values()
        ],
        "jobs": [_job(registry, ledger.host, j, now) for j in jobs],
        "host": [_host(ledger.host, slot, now) for slot in sorted(ledger.host.nodes)],
    }


def _host(host: HostLedger, slot: int, now: float) -> schema.HostBudget:
    node = host.nodes[slot]
    held, reserved, freeing = host.accounts(slot)
    pools: dict[str, schema.HostPool] = {
        pool: {"budget": budget, "parked": host.accounts(slot, pool)[0]} for pool, budget in sorted(node.pools.items())
    }
    return {
        "slot": slot,
        "budget": node.budget,
        "limit": node.limit,
        "room": node.room,
        "parked": held,
        "reserved": reserved,
        "freeing": freeing,
        "read_s_ago": max(0.0, now - node.read_at),
        "pools": pools,
        "source": dict(node.source),
    }


def _job(registry: Registry, host: HostLedger, j: Job, now: float) -> schema.JobFigures:
    group = registry.groups[j.group]
    held = now - group.held_since if group.holder == j.name else 0.0
    refusal = refused(j, now)
    return {
        "job": j.name,
        "group": j.group,
        "location": j.location.value,
        "faulted": j.faulted or None,
        "sessions": len(j.sessions),
        "pids": sorted(j.pids),
        "footprint": {str(k): v for k, v in sorted(j.footprint.items())},
        "parked_bytes": host.parked_bytes(j),
        "park_refused": refusal.reason if refusal is not None else None,
        "declared": {str(k): v for k, v in sorted(j.declared.items())},
        "peak": {str(k): v for k, v in sorted(j.peak.items())},
        "over_declared_bytes": max(over_declared(j).values(), default=0),
        "slices": j.slices,
        "restores": j.restores,
        "snapshots": j.snapshots,
        "preemptions": j.preemptions,
        "gpu_seconds": j.gpu_seconds + (held * len(group.gpus)),
        "bytes_moved": j.bytes_moved,
        "median_wait_s": median(j.waits),
        "phases": summary(j.phases),
    }


def _group(
    registry: Registry, slices: SlicePolicies, policies: QueuePolicies, frozen: Mapping[str, str], g: Group, now: float
) -> schema.Group:
    p = slices.policy(g.name)
    order = policies.policy(g.name)
    jobs = registry.jobs
    return {
        "group": g.name,
        "gpus": list(g.gpus),
        "state": group_state(registry, g).value,
        "holder": g.holder,
        "held_s": now - g.held_since if g.holder else None,
        "fence": g.fence,
        "queue": [
            {
                "job": w.job,
                "waited_s": now - w.enqueued_at,
                "requests": len(w.tickets),
                "kept_for_s": None if w.tickets or w.kept_until is None else max(0.0, w.kept_until - now),
                "preempted": any(t[1] == AUTO for t in w.tickets),
                "priority": jobs[w.job].priority,
                "weight": jobs[w.job].weight,
                "share_s": share(jobs[w.job]),
                "effective_priority": (
                    jobs[w.job].priority + (now - w.enqueued_at) / order.aging_s if order.name == "priority" else None
                ),
                "gang": w.gang,
            }
            for w in g.queue
        ],
        "overdue_s": None if g.overdue_since is None else now - g.overdue_since,
        "max_slice_s": p.max_slice if p else None,
        "slice_action": p.action if p else None,
        "policy": order.name,
        "aging_s": order.aging_s,
        "preemptions": g.preemptions,
        "switching_to": g.switch.incoming if g.switch else None,
        "draining": g.draining,
        "frozen": frozen.get(g.name),
        "waiting_for": g.waiting_for,
        "deferred": g.deferred,
        "grants": g.grants,
        "switches": g.switches,
        "bytes_moved": g.bytes_moved,
        "median_switch_s": median(g.switch_times),
        "p95_switch_s": percentile(g.switch_times, 0.95),
        "median_wait_s": median(g.wait_times),
        "lock_duty": (g.held_total_s + (now - g.held_since if g.holder else 0.0)) / max(now - g.created_at, 1e-9),
    }
