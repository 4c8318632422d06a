"""Pure views of the status document: what the pages, the JSON API and the stream derive from it.

The browser code (``static/dashboard.js``) derives the same from the live status, so a page reads
the same before and after its first update. Every view tolerates a malformed document: missing or
mistyped parts read as empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .formatting import fixed, is_number

__all__ = [
    "SPAN_SLACK_S",
    "devices_view",
    "gpu_views",
    "group_detail",
    "items",
    "job_detail",
    "node_view",
    "timeline_delta",
]

SPAN_SLACK_S = 1.0  # timeline deltas overlap the previous one by this much


def items(value: Any) -> list[dict[str, Any]]:
    """The objects in ``value`` when it is a list, else none."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _num(value: Any) -> float | None:
    return value if is_number(value) else None


def _find(values: Any, key: str, name: str) -> dict[str, Any] | None:
    return next((item for item in items(values) if item.get(key) == name), None)


def gpu_views(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per GPU: index, name, duty, memory total/used and the bar's segments (jobs on the device, then other use)."""
    tele = {g.get("index"): g for g in items(_obj(status.get("telemetry")).get("gpus"))}
    devices = items(status.get("devices"))
    known = {d.get("index") for d in devices}
    indexes = [d.get("index") for d in devices] + [i for i in tele if i not in known]
    views = []
    for index in indexes:
        device = next((d for d in devices if d.get("index") == index), {})
        t = tele.get(index, {})
        total = _num(t.get("memory_total"))
        if total is None:
            total = _num(device.get("capacity"))
        total = total if total is not None and total > 0 else 0
        jobs = {str(job): info for job, info in _obj(device.get("jobs")).items() if isinstance(info, dict)}
        on_device: list[tuple[str, float, Any]] = sorted(
            (job, nbytes, info.get("location"))
            for job, info in jobs.items()
            if info.get("location") != "parked" and (nbytes := _num(info.get("bytes"))) is not None
        )
        jobs_bytes = sum(nbytes for _, nbytes, _ in on_device)
        memory_used = _num(t.get("memory_used"))
        other = memory_used - jobs_bytes if memory_used is not None and memory_used > jobs_bytes else 0
        segments = []
        x = 0.0
        for job, nbytes, location in on_device + ([("", other, "other")] if other > 0 else []):
            width = nbytes / total * 1000 if total else 0.0
            segments.append(
                {"job": job, "bytes": nbytes, "location": location, "x": fixed(x, 1), "width": fixed(width, 1)}
            )
            x += width
        views.append(
            {
                "index": index,
                "name": t.get("name") or f"GPU {index}",
                "duty_now": t.get("duty_now"),
                "duty_window": t.get("duty_window"),
                "window_s": t.get("window_s"),
                "total": total,
                "used": jobs_bytes + other,
                "segments": segments,
                "parked": sorted(job for job, info in jobs.items() if info.get("location") == "parked"),
            }
        )
    return views


def group_detail(status: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The group named ``name`` plus ``members`` (its jobs) and ``gbps`` (bytes over seconds of their moves)."""
    group = _find(status.get("groups"), "group", name)
    if group is None:
        return None
    members = [j["job"] for j in items(status.get("jobs")) if j.get("group") == name and "job" in j]
    per_job = _obj(_obj(status.get("moves")).get("jobs"))
    total_bytes = total_seconds = 0.0
    for job in members:
        m = _obj(per_job.get(job))
        nbytes, seconds = _num(m.get("nbytes")), _num(m.get("seconds"))
        if nbytes is not None and seconds is not None:
            total_bytes += nbytes
            total_seconds += seconds
    gbps = total_bytes / total_seconds / 1e9 if total_seconds > 0 else None
    return {**group, "members": members, "gbps": gbps}


def job_detail(status: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The job named ``name`` plus ``lock`` (its place in its group), ``residency``, ``processes`` and ``moves``."""
    job = _find(status.get("jobs"), "job", name)
    if job is None:
        return None
    lock: dict[str, Any] = {"state": "idle", "position": None, "waited_s": None, "held_s": None}
    group = _find(status.get("groups"), "group", str(job.get("group")))
    if group is not None:
        queue = items(group.get("queue"))
        position = next((i for i, w in enumerate(queue) if w.get("job") == name), None)
        if group.get("holder") == name:
            lock.update(state="holding", held_s=group.get("held_s"))
        elif group.get("switching_to") == name:
            lock.update(state="switching")
        elif position is not None:
            lock.update(state="waiting", position=position + 1, waited_s=queue[position].get("waited_s"))
    residency = []
    for device in items(status.get("devices")):
        info = _obj(device.get("jobs")).get(name)
        if isinstance(info, dict):
            residency.append({"gpu": device.get("index"), "bytes": info.get("bytes"), "location": info.get("location")})
    gpus = items(_obj(status.get("telemetry")).get("gpus"))
    processes = []
    for pid in job.get("pids") or []:
        found = {}
        for gpu in gpus:
            procs = _obj(gpu.get("processes"))
            nbytes = _num(procs.get(str(pid), procs.get(pid)))  # str keys once through JSON, int ones before
            if nbytes is not None:
                found[str(gpu.get("index"))] = nbytes
        processes.append({"pid": pid, "gpus": found})
    moves = _obj(status.get("moves"))
    recent = [m for m in items(moves.get("recent")) if m.get("job") == name][-20:]
    return {
        **job,
        "lock": lock,
        "residency": residency,
        "processes": processes,
        "moves": {"summary": _obj(moves.get("jobs")).get(name), "recent": recent},
    }


def node_view(status: Mapping[str, Any]) -> dict[str, Any]:
    """The document without its bulky lists, plus ``gpus`` (how many devices)."""
    bulky = ("devices", "groups", "jobs", "telemetry", "moves")
    node = {k: v for k, v in status.items() if k not in bulky}
    node["gpus"] = len(items(status.get("devices")))
    return node


def devices_view(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each device plus ``telemetry`` (its GPU's, or None)."""
    tele = {g.get("index"): g for g in items(_obj(status.get("telemetry")).get("gpus"))}
    return [{**d, "telemetry": tele.get(d.get("index"))} for d in items(status.get("devices"))]


def timeline_delta(timeline: Mapping[str, Any], window_s: float, since: float | None) -> dict[str, Any]:
    """The part of ``timeline`` a stream sends: spans in the last ``window_s``; with ``since``, only
    those still open or ended after ``since`` (less a little slack, since duplicates are harmless)."""
    now = _num(timeline.get("now")) or 0.0
    # The source may show less than asked (a daemon younger than the window): keep its window.
    window_s = min(window_s, _num(timeline.get("window_s")) or window_s)
    start = now - window_s
    spans = []
    for span in items(timeline.get("spans")):
        end = span.get("end")
        if end is not None and not (is_number(end) and end >= start):
            continue
        if since is not None and end is not None and end < since - SPAN_SLACK_S:
            continue
        spans.append(span)
    return {
        "now": now,
        "window_s": window_s,
        "groups": timeline.get("groups", []),
        "spans": spans,
        "full": since is None,
    }
