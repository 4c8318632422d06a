"""Builders of status documents (``timesliced.wire.status``) for the tests' fixtures.

Each builder gives a complete part, so a fixture names only what it is about and still holds to
the schema; ``tests/unit/test_status_schema.py`` checks every fixture, and the integration test of
the same name a live daemon's
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
    return {
        "default": default,
        "why": "--backend",
        "device_source": "sim",
        "methods": {default: "available"},
        "checkpoint": None,
        "sim_held": {},
    }


def checkpoint_probe(footprints: str = "gpu-delta") -> schema.CheckpointProbe:
    """A cuda-checkpoint node in a container: NVML's PIDs are not the daemon's."""
    return {
        "footprints": footprints,
        "footprints_why": "the daemon is in PID namespace 4026532512, not the host's (4026531836)",
        "bindings": "13.4.4",
        "cuda": "13.0",
        "restore_gpus": {"0": "driver", "1": "persistence"},
        "cleared_env": {"CUDA_VISIBLE_DEVICES": "0"},
    }


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
        "dns": None,
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
        "direction": "to_host" if kind == "snapshot" else "to_device",
        "swap_with": None,
    }


def job_moves(count: int, snapshots: int, restores: int, nbytes: int, seconds: float) -> schema.JobMoves:
    return {
        "count": count,
        "snapshots": snapshots,
        "restores": restores,
        "nbytes": nbytes,
        "seconds": seconds,
        "median_gbps": nbytes / seconds / 1e9 if seconds else None,
        "median_to_host_gbps": nbytes / seconds / 1e9 if seconds and snapshots else None,
        "median_to_device_gbps": nbytes / seconds / 1e9 if seconds and restores else None,
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
        "policy": "fifo",
        "aging_s": 60.0,
        "preemptions": 0,
        "switching_to": None,
        "draining": False,
        "frozen": None,
        "waiting_for": None,
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


def phases(
    count: int, *, busy_s: float | None = None, gap_s: float | None = None, peak: int = 0, gaps: int | None = None
) -> schema.JobPhases:
    """A job's phase statistics, every phase ``busy_s`` long and every gap ``gap_s``."""
    gap_count = max(count - 1, 0) if gaps is None else gaps
    gap = gap_s if gap_count else None
    busy = busy_s if count else None
    duty = busy / (busy + gap) if busy is not None and gap is not None and busy + gap > 0 else None
    return {
        "count": count,
        "gaps": gap_count,
        "busy_median_s": busy,
        "busy_p90_s": busy,
        "busy_mean_s": busy,
        "gap_median_s": gap,
        "gap_p90_s": gap,
        "gap_mean_s": gap,
        "own_duty": duty,
        "memory_peak_bytes": peak,
    }


def host_budget(slot: int = 0, *, budget: int, parked: int, room: int, **fields: Any) -> schema.HostBudget:
    """The scheduler's accounts of one node's host memory for parked state."""
    base: dict[str, Any] = {
        "slot": slot,
        "budget": budget,
        "limit": None,
        "room": room,
        "parked": parked,
        "reserved": 0,
        "freeing": 0,
        "read_s_ago": 0.4,
        "pools": {},
        "source": {"host": f"MemAvailable {room} B less a margin of 0 B"},
    }
    return {**base, **fields}  # type: ignore[return-value]


def host_reading(*, available: int, room: int, **fields: Any) -> schema.HostReading:
    """What the node's daemon last read of its host."""
    base: dict[str, Any] = {
        "available": available,
        "total": 2 * available,
        "margin": available - room,
        "limit": None,
        "room": room,
        "cgroup": None,
        "tmpfs": None,
        "sim_pool": None,
        "jobs": {},
        "pools": {},
        "age_s": 0.4,
        "error": None,
    }
    return {**base, **fields}  # type: ignore[return-value]


def place(
    job: str,
    waited_s: float,
    requests: int = 1,
    *,
    kept_for_s: float | None = None,
    preempted: bool = False,
    priority: int = 0,
    effective_priority: float | None = None,
    gang: str | None = None,
) -> schema.QueuePlace:
    return {
        "job": job,
        "waited_s": waited_s,
        "requests": requests,
        "kept_for_s": kept_for_s,
        "preempted": preempted,
        "priority": priority,
        "weight": 1.0,
        "share_s": 0.0,
        "effective_priority": effective_priority,
        "gang": gang,
    }


# --- whole documents ----------------------------------------------------------------------

MiB = 1 << 20
NOW = 1_700_000_000.0


def dashboard_status() -> dict[str, Any]:
    """The dashboard tests' document: one group, three jobs, two GPUs."""
    return {
        "node": "node-7",
        "version": "0.1.0",
        "pid": 1234,
        "backend": "sim",
        "parking": parking(),
        "addresses": ["/tmp/x.sock"],
        "uptime_s": 75.0,
        "connections": 3,
        "counters": counters(accepted=3),
        "devices": [
            {
                "index": 0,
                "capacity": 64 * MiB,
                "used": 40 * MiB,
                "jobs": {
                    "rl-math": {"bytes": 40 * MiB, "location": "parked"},
                    "sft-chat": {"bytes": 40 * MiB, "location": "resident"},
                },
            },
            {"index": 1, "capacity": 64 * MiB, "used": 0, "jobs": {}},
        ],
        "groups": [
            {
                "group": "pool",
                "gpus": [0, 1],
                "state": "locked",
                "holder": "sft-chat",
                "held_s": 12.5,
                "fence": 7,
                "queue": [
                    place("rl-math", 3.25, preempted=True, priority=2, effective_priority=2.05),
                    place("rl-code", 1.5, 2, kept_for_s=12.0, effective_priority=0.025),
                ],
                "frozen": None,
                "max_slice_s": 300.0,
                "slice_action": "preempt",
                "policy": "priority",
                "aging_s": 60.0,
                "overdue_s": 4.0,
                "preemptions": 2,
                "switching_to": None,
                "grants": 7,
                "switches": 4,
                "bytes_moved": 160 * MiB,
                "median_switch_s": 0.42,
                "p95_switch_s": 0.9,
                "median_wait_s": 2.0,
                "lock_duty": 0.87,
                "draining": False,
                "waiting_for": None,
                "deferred": 0,
            }
        ],
        "jobs": [
            {
                "job": "rl-math",
                "group": "pool",
                "location": "parked",
                "faulted": None,
                "sessions": 1,
                "pids": [5001],
                "footprint": {"0": 40 * MiB},
                "parked_bytes": 41 * MiB,
                "park_refused": None,
                "declared": {},
                "peak": {},
                "over_declared_bytes": 0,
                "slices": 3,
                "restores": 2,
                "snapshots": 3,
                "gpu_seconds": 33.0,
                "bytes_moved": 200 * MiB,
                "median_wait_s": 1.25,
                "phases": phases(3, busy_s=11.0, gap_s=4.0, peak=40 * MiB),
                "park": "sim",
                "measured": {"0": 41 * MiB},
            },
            {
                "job": "sft-chat",
                "group": "pool",
                "location": "resident",
                "faulted": None,
                "sessions": 1,
                "pids": [5002],
                "footprint": {"0": 40 * MiB},
                "parked_bytes": 0,
                "park_refused": "snapshot failed: the process did not reach a safe point",
                "declared": {},
                "peak": {},
                "over_declared_bytes": 0,
                "slices": 4,
                "restores": 1,
                "snapshots": 1,
                "gpu_seconds": 40.0,
                "bytes_moved": 80 * MiB,
                "median_wait_s": 0.5,
                "phases": phases(4, busy_s=10.0, gap_s=9.0, peak=40 * MiB),
                "park": "cuda-checkpoint",
                "measured": {},
            },
            {
                "job": "rl-code",
                "group": "pool",
                "location": "resident",
                "faulted": "restore failed: out of memory",
                "sessions": 2,
                "pids": [],
                "footprint": {},
                "parked_bytes": 0,
                "park_refused": None,
                "declared": {},
                "peak": {},
                "over_declared_bytes": 0,
                "slices": 0,
                "restores": 0,
                "snapshots": 0,
                "gpu_seconds": 0.0,
                "bytes_moved": 0,
                "median_wait_s": None,
                "phases": phases(0),
                "park": "sim",
                "measured": {},
            },
        ],
        "host": [
            host_budget(
                budget=1024 * MiB,
                parked=41 * MiB,
                room=983 * MiB,
                pools={"tmpfs:/dev/shm": {"budget": 512 * MiB, "parked": 41 * MiB}},
            )
        ],
        "host_memory": host_reading(
            available=1500 * MiB,
            room=983 * MiB,
            tmpfs={"path": "/dev/shm", "size": 1024 * MiB, "free": 471 * MiB},
            sim_pool={"held": 40 * MiB, "limit": 1024 * MiB, "taken": 3, "missed": 1},
            jobs={"rl-math": ["tmpfs:/dev/shm"]},
            pools={"tmpfs:/dev/shm": 471 * MiB},
        ),
        "cluster": cluster("node-7"),
        "telemetry": telemetry(
            gpu(
                0,
                total=64 * MiB,
                used=48 * MiB,
                duty_now=0.93,
                duty_window=0.61,
                processes={"5002": 40 * MiB, "5001": 0},
            ),
            gpu(1, total=64 * MiB, used=0, duty_now=0.0, duty_window=0.0),
        ),
        "moves": {
            "recent": [
                move("rl-math", "snapshot", 40 * MiB, 0.05, NOW),
                move("sft-chat", "restore", 40 * MiB, 0.08, NOW),
            ],
            "jobs": {
                "rl-math": job_moves(5, 3, 2, 200 * MiB, 0.25),
                "sft-chat": job_moves(2, 1, 1, 80 * MiB, 0.15),
            },
        },
    }


def metrics_status() -> dict[str, Any]:
    """The metrics tests' document: one group of two GPUs held by sft-chat, two jobs queued, rl-math parked."""
    return {
        "node": "vm",
        "version": "0.1.0",
        "pid": 18684,
        "backend": "sim",
        "parking": parking(),
        "addresses": ["/run/timesliced/timesliced.sock"],
        "uptime_s": 12.5,
        "connections": 3,
        "counters": counters(accepted=3),
        "devices": [
            {
                "index": 0,
                "capacity": 67108864,
                "used": 41943040,
                "jobs": {
                    "rl-math": {"bytes": 41943040, "location": "parked"},
                    "sft-chat": {"bytes": 41943040, "location": "resident"},
                },
            },
            {"index": 1, "capacity": 67108864, "used": 0, "jobs": {}},
        ],
        "groups": [
            {
                "group": "pool",
                "gpus": [0, 1],
                "state": "locked",
                "holder": "sft-chat",
                "held_s": 0.37,
                "fence": 2,
                "queue": [place("rl-math", 0.30), place("rl-code", 0.30)],
                "overdue_s": None,
                "max_slice_s": None,
                "slice_action": None,
                "policy": "fifo",
                "aging_s": 60.0,
                "preemptions": 0,
                "frozen": None,
                "switching_to": None,
                "draining": False,
                "waiting_for": "memory on GPU 0: waiting for sft-chat",
                "deferred": 1,
                "grants": 2,
                "switches": 0,
                "bytes_moved": 41943040,
                "median_switch_s": None,
                "p95_switch_s": None,
                "median_wait_s": 0.0,
                "lock_duty": 0.99,
            }
        ],
        "jobs": [
            {
                "job": "rl-math",
                "group": "pool",
                "location": "parked",
                "faulted": None,
                "sessions": 1,
                "pids": [18684],
                "footprint": {"0": 41943040},
                "parked_bytes": 41943040,
                "park_refused": None,
                "declared": {},
                "peak": {},
                "over_declared_bytes": 0,
                "slices": 1,
                "restores": 0,
                "snapshots": 1,
                "gpu_seconds": 0.25,
                "bytes_moved": 41943040,
                "median_wait_s": 0.0,
                "phases": phases(1, busy_s=0.25, gap_s=None, peak=41943040),
                "park": "sim",
                "measured": {},
            },
            {
                "job": "sft-chat",
                "group": "pool",
                "location": "resident",
                "faulted": None,
                "sessions": 1,
                "pids": [18684],
                "footprint": {"0": 41943040},
                "parked_bytes": 0,
                "park_refused": None,
                "declared": {},
                "peak": {},
                "over_declared_bytes": 0,
                "slices": 1,
                "restores": 0,
                "snapshots": 0,
                "gpu_seconds": 0.75,
                "bytes_moved": 0,
                "median_wait_s": 0.0,
                "phases": phases(1, busy_s=0.75, gap_s=None, peak=41943040),
                "park": "sim",
                "measured": {},
            },
            {
                "job": "rl-code",
                "group": "pool",
                "location": "resident",
                "faulted": "restore failed: timed out",
                "sessions": 1,
                "pids": [18684],
                "footprint": {},
                "parked_bytes": 0,
                "park_refused": None,
                "declared": {},
                "peak": {},
                "over_declared_bytes": 0,
                "slices": 0,
                "restores": 0,
                "snapshots": 0,
                "gpu_seconds": 0.0,
                "bytes_moved": 0,
                "median_wait_s": None,
                "phases": phases(0),
                "park": "sim",
                "measured": {},
            },
        ],
        "host": [host_budget(budget=1 << 30, parked=41943040, room=(1 << 30) - 41943040)],
        "host_memory": host_reading(available=2 << 30, room=(1 << 30) - 41943040),
        "cluster": cluster("vm"),
        "telemetry": telemetry(
            gpu(0, total=67108864, used=50331648, duty_now=1.0, duty_window=0.75),
            # no sample yet: the scheduler's figure stands in
            gpu(1, total=67108864, used=None, duty_now=0.0, duty_window=0.5),
        ),
        "moves": {"recent": [], "jobs": {}},
    }
