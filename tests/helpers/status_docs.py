"""Builders of status documents (``timesliced.wire.status``) for the tests' fixtures.

Each builder gives a complete part, so a fixture names only what it is about and still holds to
the schema; ``tests/integration/test_status_schema.py`` checks every fixture and a live daemon's
status against it.
"""

from __future__ import annotations

from typing import Any

from timesliced.wire import status as schema


def counters(accepted: int = 0, **more: int) -> schema.Counters:
    base = {
        "accepted": accepted,
        "refused": 0,
        "protocol_errors": 0,
        "internal_errors": 0,
        "auth_failures": 0,
        "leases_expired": 0,
    }
    return {**base, **more}  # type: ignore[typeddict-item]


def parking(default: str = "sim") -> schema.Parking:
    return {"default": default, "why": "--backend", "device_source": "sim", "methods": {default: "available"}}


def cluster(node: str) -> schema.Cluster:
    """A single daemon: its own leader, no peers."""
    return {
        "node": node,
        "slot": 0,
        "members": [node],
        "election": {
            "node": node,
            "peers": [],
            "role": "leader",
            "term": 1,
            "leader": node,
            "voted_for": node,
            "pre_vote": True,
            "quorum": True,
            "leader_since": 0.0,
            "leader_heard_s_ago": None,
            "acked_s_ago": {},
            "next_deadline": None,
        },
        "leader": node,
        "era": [1, 1],
        "ready": True,
        "leading": True,
        "linked": [],
        "reporters": [node],
        "offline": [],
        "pending": 0,
        "refused": 0,
        "problems": [],
        "peers": None,
    }


def gpu(
    index: int,
    *,
    total: int,
    used: int | None,
    duty_now: float | None,
    duty_window: float | None,
    processes: dict[str, int] | None = None,
) -> schema.GpuTelemetry:
    return {
        "index": index,
        "name": f"sim-gpu{index}",
        "uuid": "",
        "memory_total": total,
        "memory_used": used,
        "memory_free": None if used is None else total - used,
        "utilization_gpu": None,
        "utilization_memory": None,
        "duty_now": duty_now,
        "duty_window": duty_window,
        "window_s": 60.0,
        "processes": processes or {},
        "errors": [],
    }


def telemetry(*gpus: schema.GpuTelemetry) -> schema.Telemetry:
    return {
        "source": "sim",
        "reason": None,
        "driver": None,
        "cuda": None,
        "interval_s": 1.0,
        "age_s": 0.1,
        "error": None,
        "gpus": list(gpus),
    }


def move(job: str, kind: str, nbytes: int, seconds: float, t: float) -> schema.Move:
    return {
        "at": 0.0,
        "t": t,
        "job": job,
        "kind": kind,
        "nbytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
    }


def job_moves(count: int, snapshots: int, restores: int, nbytes: int, seconds: float) -> schema.JobMoves:
    return {
        "count": count,
        "snapshots": snapshots,
        "restores": restores,
        "nbytes": nbytes,
        "seconds": seconds,
        "median_gbps": nbytes / seconds / 1e9 if seconds else None,
    }


def group(name: str, gpus: list[int], **fields: Any) -> schema.Group:
    """An idle group with nothing queued; ``fields`` set what the fixture is about."""
    base: dict[str, Any] = {
        "group": name,
        "gpus": gpus,
        "state": "idle",
        "holder": None,
        "held_s": None,
        "fence": 0,
        "queue": [],
        "overdue_s": None,
        "max_slice_s": None,
        "slice_action": None,
        "preemptions": 0,
        "switching_to": None,
        "draining": False,
        "frozen": None,
        "deferred": 0,
        "grants": 0,
        "switches": 0,
        "bytes_moved": 0,
        "median_switch_s": None,
        "p95_switch_s": None,
        "median_wait_s": None,
        "lock_duty": 0.0,
    }
    return {**base, **fields}  # type: ignore[return-value]


def place(
    job: str, waited_s: float, requests: int = 1, *, kept_for_s: float | None = None, preempted: bool = False
) -> schema.QueuePlace:
    return {"job": job, "waited_s": waited_s, "requests": requests, "kept_for_s": kept_for_s, "preempted": preempted}
