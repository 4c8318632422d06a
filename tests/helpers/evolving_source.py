"""A fake daemon for the dashboard's browser tests, whose state the test moves along."""

from __future__ import annotations

import threading
import time
from typing import Any

from timesliced import errors

from . import status_docs

MiB = 1 << 20
GiB = 1 << 30


class EvolvingSource:
    """A fake daemon: two GPUs, a group ``pool`` shared by three jobs and a group ``eval`` with one.

    The test calls ``enqueue`` / ``grant`` / ``leave`` to move the lock; ``status()`` and
    ``timeline()`` describe the current state with the real clock (unless ``frozen``). Called
    from the server's thread and the test's, so everything goes under one lock.
    """

    JOBS = {"rl-math": "pool", "sft-chat": "pool", "rl-code": "pool", "eval-harness": "eval"}

    def __init__(self, *, frozen: bool = False) -> None:
        self._lock = threading.Lock()
        self.frozen = frozen
        self.t0 = time.time() - 300
        self.now_fixed = time.time()
        self.holder: dict[str, str | None] = {"pool": "sft-chat", "eval": "eval-harness"}
        self.held_since: dict[str, float] = {"pool": self.t0 + 200, "eval": self.t0 + 100}
        self.queue: dict[str, list[tuple[str, float]]] = {"pool": [("rl-math", self.t0 + 250)], "eval": []}
        self.draining: dict[str, bool] = {"pool": False, "eval": False}
        self.resident = {"sft-chat", "eval-harness", "rl-code"}
        self.switches = 1
        self.fence = {"pool": 2, "eval": 1}
        self.spans: list[dict[str, Any]] = [
            {"group": "pool", "job": "rl-math", "kind": "held", "start": self.t0 + 60, "end": self.t0 + 180},
            {"group": "pool", "job": "sft-chat", "kind": "switching", "start": self.t0 + 180, "end": self.t0 + 200},
            {"group": "pool", "job": "sft-chat", "kind": "held", "start": self.t0 + 200, "end": None},
            {"group": "eval", "job": "eval-harness", "kind": "held", "start": self.t0 + 100, "end": None},
        ]
        self.event_log: list[dict[str, Any]] = []
        self.calls: list[tuple[str, Any]] = []
        self.faulted: dict[str, str] = {}  # job -> why (the test faults one; an admin's resume clears it)
        self.refused: dict[str, str] = {"eval-harness": "snapshot failed: no space left on device"}
        self._event("granted", "pool", "sft-chat", "fence 2")

    # --- what the test does -------------------------------------------------------------

    def now(self) -> float:
        return self.now_fixed if self.frozen else time.time()

    def enqueue(self, job: str) -> None:
        with self._lock:
            group = self.JOBS[job]
            self.queue[group].append((job, self.now()))
            self._event("registered", group, job, "acquire queued")

    def grant_next(self, group: str = "pool") -> str:
        """The holder yields; the head of the queue is switched in (a switching span, then a held one)."""
        with self._lock:
            now = self.now()
            old = self.holder[group]
            job, _ = self.queue[group].pop(0)
            for span in self.spans:
                if span["group"] == group and span["end"] is None:
                    span["end"] = now - 0.4
            self.spans.append({"group": group, "job": job, "kind": "switching", "start": now - 0.4, "end": now})
            self.spans.append({"group": group, "job": job, "kind": "held", "start": now, "end": None})
            if old is not None:
                self.resident.discard(old)
                self.queue[group].append((old, now))
            self.resident.add(job)
            self.holder[group] = job
            self.held_since[group] = now
            self.fence[group] += 1
            self.switches += 1
            self._event("switch_finished", group, job, f"from {old}")
            self._event("granted", group, job, f"fence {self.fence[group]}")
            return job

    def leave(self, job: str) -> None:
        with self._lock:
            group = self.JOBS[job]
            self.queue[group] = [(j, t) for j, t in self.queue[group] if j != job]
            self._event("exited", group, job, "")

    # --- the DashboardSource interface ---------------------------------------------------

    def _event(self, kind: str, group: str | None, job: str | None, detail: str) -> None:
        self.event_log.append(
            {"id": len(self.event_log) + 1, "t": self.now(), "kind": kind, "group": group, "job": job, "detail": detail}
        )

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self._status()

    def _status(self) -> dict[str, Any]:
        now = self.now()
        footprint = {"rl-math": 24 * MiB, "sft-chat": 20 * MiB, "rl-code": 8 * MiB, "eval-harness": 12 * MiB}
        devices = []
        for index in (0, 1):
            jobs = {}
            for job, group in self.JOBS.items():
                if index == 0 and group == "eval":
                    continue
                if index == 1 and group == "pool" and job != "rl-code":
                    continue
                jobs[job] = {"bytes": footprint[job], "location": "resident" if job in self.resident else "parked"}
            used = sum(j["bytes"] for j in jobs.values() if j["location"] == "resident")
            devices.append({"index": index, "capacity": 64 * MiB, "used": used, "jobs": jobs})
        groups = []
        for name, gpus in (("pool", [0, 1]), ("eval", [1])):
            holder = self.holder[name]
            groups.append(
                {
                    "group": name,
                    "gpus": gpus,
                    "state": "locked" if holder else "idle",
                    "holder": holder,
                    "held_s": now - self.held_since[name] if holder else None,
                    "fence": self.fence[name],
                    "queue": [
                        {
                            "job": j,
                            "waited_s": now - t,
                            "requests": 1,
                            "preempted": i == 0 and name == "pool",
                            "kept_for_s": 12.0 if i == 1 else None,
                            "priority": 0,
                            "weight": 1.0,
                            "share_s": 0.0,
                            "effective_priority": None,
                            "gang": None,
                        }
                        for i, (j, t) in enumerate(self.queue[name])
                    ],
                    "max_slice_s": 300.0 if name == "pool" else None,
                    "slice_action": "preempt" if name == "pool" else None,
                    "policy": "fifo",
                    "aging_s": 60.0,
                    "overdue_s": 4.0 if name == "pool" and holder else None,
                    "preemptions": 2 if name == "pool" else 0,
                    "switching_to": None,
                    "grants": self.fence[name],
                    "switches": self.switches if name == "pool" else 0,
                    "bytes_moved": 96 * MiB if name == "pool" else 0,
                    "median_switch_s": 0.42 if name == "pool" else None,
                    "p95_switch_s": 0.61 if name == "pool" else None,
                    "median_wait_s": 3.5,
                    "lock_duty": 0.87,
                    "draining": self.draining[name],
                    "frozen": None,
                    "waiting_for": None,
                    "deferred": 0,
                }
            )
        jobs = [
            {
                "job": job,
                "group": group,
                "location": "resident" if job in self.resident else "parked",
                "faulted": self.faulted.get(job),
                "sessions": 1,
                "pids": [4242 + i],
                "footprint": {"0": footprint[job]},
                "parked_bytes": 0 if job in self.resident else footprint[job],
                "park_refused": self.refused.get(job),
                "slices": 3 + i,
                "restores": 1,
                "snapshots": 1,
                "gpu_seconds": 61.5 + i,
                "bytes_moved": 2 * footprint[job],
                "median_wait_s": 2.25,
                "park": "sim",
                "measured": {},
            }
            for i, (job, group) in enumerate(self.JOBS.items())
        ]
        return {
            "node": "node-a",
            "version": "0.1.0",
            "pid": 4000,
            "backend": "sim",
            "parking": status_docs.parking(),
            "addresses": ["/run/timesliced/timesliced.sock"],
            "uptime_s": now - self.t0,
            "connections": 4,
            "counters": status_docs.counters(accepted=4),
            "devices": devices,
            "groups": groups,
            "jobs": jobs,
            "host": [
                status_docs.host_budget(
                    budget=512 * MiB,
                    parked=sum(footprint[j] for j in self.JOBS if j not in self.resident),
                    room=448 * MiB,
                    limit=768 * MiB,
                    pools={"tmpfs:/dev/shm": {"budget": 256 * MiB, "parked": 24 * MiB}},
                )
            ],
            "host_memory": status_docs.host_reading(
                available=600 * MiB,
                room=448 * MiB,
                cgroup={
                    "path": "/system.slice/timesliced.service",
                    "version": 2,
                    "limit": GiB,
                    "used": 300 * MiB,
                    "room": 600 * MiB,
                },
                tmpfs={"path": "/dev/shm", "size": 512 * MiB, "free": 232 * MiB},
                pools={"tmpfs:/dev/shm": 232 * MiB},
            ),
            "cluster": status_docs.cluster("node-a"),
            "telemetry": status_docs.telemetry(
                *(
                    status_docs.gpu(
                        i,
                        total=64 * MiB,
                        used=devices[i]["used"] + 2 * MiB,
                        duty_now=0.9 if i == 0 else 0.35,
                        duty_window=0.72 if i == 0 else 0.31,
                        processes={str(4242 + i): devices[i]["used"]},
                    )
                    for i in (0, 1)
                )
            ),
            "moves": {
                "recent": [
                    status_docs.move("rl-math", "snapshot", 24 * MiB, 0.2, now),
                    status_docs.move("rl-math", "restore", 24 * MiB, 0.25, now),
                ],
                "jobs": {"rl-math": status_docs.job_moves(2, 1, 1, 48 * MiB, 0.45)},
            },
        }

    def timeline(self, window_s: float) -> dict[str, Any]:
        with self._lock:
            now = self.now()
            return {
                "now": now,
                "window_s": window_s,
                "groups": [{"group": "pool", "gpus": [0, 1]}, {"group": "eval", "gpus": [1]}],
                "spans": [dict(s) for s in self.spans if s["end"] is None or s["end"] >= now - window_s],
            }

    def events(self, after: int, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self.event_log if e["id"] > after][:limit]

    def force_release(self, group: str) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("force_release", group))
            if group not in self.holder:
                raise errors.UnknownGroup(f"no group {group!r}")
            job = self.holder[group]
            if job is None:
                raise errors.NotHolder("nobody holds the group")
            self.holder[group] = None
            for span in self.spans:
                if span["group"] == group and span["end"] is None:
                    span["end"] = self.now()
            self._event("admin", group, job, "force-released")
            return {"group": group, "released": job}

    def drain(self, group: str, on: bool) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("drain", (group, on)))
            self.draining[group] = on
            return {"group": group, "draining": on}

    def resume(self, group: str) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("resume", group))
            self.draining[group] = False
            return {"group": group, "draining": False, "resumed": [], "still_faulted": {}}

    def resume_job(self, job: str) -> dict[str, Any]:
        with self._lock:
            self.calls.append(("resume_job", job))
            if job not in self.JOBS:
                raise errors.UnknownJob(f"no job {job!r}")
            if job not in self.faulted:
                raise errors.BadRequest(f"job {job!r} is not faulted: there is nothing to resume")
            was = self.faulted.pop(job)
            self._event("admin", self.JOBS[job], job, f"resumed (it was faulted: {was})")
            return {"job": job, "group": self.JOBS[job], "location": "resident", "was": was}

    def ready(self) -> bool:
        return True
