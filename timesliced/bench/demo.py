"""``timesliced demo``: RL and SFT jobs taking turns on two simulated GPUs.

Each job is a real process with its own ``Client``. It allocates simulated
device memory on both GPUs (two jobs do not fit at once, so every handover is
a real snapshot and restore of real bytes), then alternates GPU phases (inside
``slice()``) with CPU phases (outside). At the start of every GPU phase it
verifies that its device memory holds exactly what it left there.

The same jobs then run one after another on a fresh daemon for comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..daemon.embedded import EmbeddedDaemon
from ..sim import DEFAULT_BANDWIDTH
from ..util.stats import median
from .copy import describe_link, link_figures

MiB = 1 << 20
GPUS = 2
GPU_MEMORY = 64 * MiB
GROUP = "demo-pool"


@dataclass(frozen=True)
class JobSpec:
    job: str
    kind: str  # "RL" | "SFT"
    iterations: int
    phases: tuple[tuple[str, str, float], ...]  # (gpu|cpu, name, seconds)
    regions: tuple[int, ...] = (24 * MiB, 16 * MiB)  # per GPU: weights, optimizer state


WORKLOAD = (
    JobSpec(
        "rl-math",
        "RL",
        6,
        (("gpu", "rollout", 0.50), ("cpu", "reward", 0.45), ("gpu", "train", 0.35), ("cpu", "prep", 0.15)),
    ),
    JobSpec(
        "rl-code",
        "RL",
        6,
        (("gpu", "rollout", 0.40), ("cpu", "reward", 0.55), ("gpu", "train", 0.30), ("cpu", "prep", 0.15)),
    ),
    JobSpec("sft-chat", "SFT", 10, (("gpu", "train", 0.35), ("cpu", "load", 0.30))),
)


# --- the worker process --------------------------------------------------------------


def worker(spec: dict[str, Any], address: str, scale: float, prefix: str = "") -> dict[str, Any]:
    """One job: allocate, then GPU and CPU phases; returns its record.

    It registers as ``prefix + spec["job"]``, so that a second run on the same
    daemon never meets a job of the first that is still being reclaimed.
    """
    from ..client import Client

    client = Client(job=prefix + spec["job"], group=GROUP, address=address)
    slices: list[dict[str, Any]] = []
    data_errors = 0
    regions: list[Any] = []
    expected: list[str] = []
    step = 0
    with client:
        for iteration in range(spec["iterations"]):
            for where, name, seconds in spec["phases"]:
                if where == "cpu":
                    time.sleep(seconds * scale)
                    continue
                with client.slice() as grant:
                    start = time.time()
                    if not regions:  # first slice: load the "model" onto both GPUs
                        for gpu in range(GPUS):
                            for size in spec["regions"]:
                                regions.append(client.sim_alloc(size, gpu=gpu))
                    else:  # the kernel reads its weights: they must be exactly as left
                        data_errors += sum(r.checksum() != e for r, e in zip(regions, expected, strict=False))
                    step += 1
                    for i, region in enumerate(regions):  # the kernel writes new state
                        region.fill(f"{spec['job']}:{step}:{i}|".encode())
                    expected = [r.checksum() for r in regions]
                    remaining = seconds * scale - (time.time() - start)
                    if remaining > 0:
                        time.sleep(remaining)
                    end = time.time()
                slices.append(
                    {
                        "phase": name,
                        "iteration": iteration,
                        "start": start,
                        "end": end,
                        "waited_s": grant.waited_s,
                        "switch_s": grant.switch_s,
                        "restored": grant.restored,
                    }
                )
    return {"job": spec["job"], "kind": spec["kind"], "slices": slices, "data_errors": data_errors}


# --- the driver ----------------------------------------------------------------------


def _spawn(spec: JobSpec, address: str, scale: float, prefix: str) -> subprocess.Popen[str]:
    payload = json.dumps({"spec": spec.__dict__, "address": address, "scale": scale, "prefix": prefix})
    return subprocess.Popen(
        [sys.executable, "-m", "timesliced.bench.demo", "--worker", payload], stdout=subprocess.PIPE, text=True
    )


def _collect(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"demo worker failed with exit code {proc.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _run(workload: tuple[JobSpec, ...], scale: float, daemon: EmbeddedDaemon, *, concurrent: bool) -> dict[str, Any]:
    started = time.time()
    prefix = "" if concurrent else "serial-"
    if concurrent:
        procs = [_spawn(spec, daemon.socket, scale, prefix) for spec in workload]
        records = [_collect(p) for p in procs]
    else:
        records = [_collect(_spawn(spec, daemon.socket, scale, prefix)) for spec in workload]
    return _figures(records, started, time.time())


def _figures(records: list[dict[str, Any]], started: float, finished: float) -> dict[str, Any]:
    makespan = finished - started
    spans = sorted((s["start"], s["end"]) for r in records for s in r["slices"])
    busy = _union(spans)
    switches = [s["switch_s"] for r in records for s in r["slices"] if s["restored"]]
    waits = [s["waited_s"] for r in records for s in r["slices"]]
    jobs = []
    for r in records:
        js = [s["switch_s"] for s in r["slices"] if s["restored"]]
        jobs.append(
            {
                "job": r["job"],
                "kind": r["kind"],
                "slices": len(r["slices"]),
                "gpu_s": sum(s["end"] - s["start"] for s in r["slices"]),
                "switches": len(js),
                "median_switch_ms": _ms(js),
                "median_wait_ms": _ms([s["waited_s"] for s in r["slices"]]),
                "data_errors": r["data_errors"],
            }
        )
    return {
        "makespan_s": makespan,
        # Every job uses both GPUs, so both are busy exactly while some job holds the group.
        "gpus": [{"gpu": g, "duty_cycle": busy / makespan} for g in range(GPUS)],
        "switches": len(switches),
        "median_switch_ms": _ms(switches),
        "median_wait_ms": _ms(waits),
        "data_errors": sum(r["data_errors"] for r in records),
        "jobs": jobs,
    }


def _union(spans: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def _ms(values: list[float]) -> float | None:
    m = median(values)
    return None if m is None else m * 1000


def run_demo(
    scale: float = 1.0,
    serial: bool = True,
    progress: Callable[[str], Any] | None = None,
    *,
    web: tuple[str, int] | None = None,
    keep: Callable[[EmbeddedDaemon], None] | None = None,
) -> dict[str, Any]:
    """Run the workload time-sliced (and serially) on one daemon; returns the figures.

    With ``web`` the daemon serves its dashboard there (a free port if that one is
    taken) and says where; ``keep(daemon)`` runs after the workload, before the
    daemon stops (the CLI's ``--keep`` waits there for Ctrl-C).
    """
    say = progress or (lambda _msg: None)
    with EmbeddedDaemon(gpus=GPUS, gpu_memory=GPU_MEMORY, web=web, web_any_port=True) as daemon:
        if daemon.web_url:
            say(f"dashboard: {daemon.web_url}")
        say(f"time-sliced: {len(WORKLOAD)} jobs on {GPUS} simulated GPUs of {GPU_MEMORY // MiB} MiB ...")
        sliced = _run(WORKLOAD, scale, daemon, concurrent=True)
        report: dict[str, Any] = {"timesliced": sliced, "data_errors": sliced["data_errors"]}
        report["link"] = link_figures(DEFAULT_BANDWIDTH)  # the demo's daemon runs the default model
        if serial:
            say("serial: the same jobs one after another ...")
            alone = _run(WORKLOAD, scale, daemon, concurrent=False)
            report["serial"] = alone
            report["data_errors"] += alone["data_errors"]
            report["speedup"] = alone["makespan_s"] / sliced["makespan_s"]
        if keep is not None:
            keep(daemon)
    return report


def format_report(report: dict[str, Any]) -> str:
    def fmt(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:.1f}{unit}"

    lines = []
    for title, key in (("time-sliced", "timesliced"), ("serial", "serial")):
        r = report.get(key)
        if r is None:
            continue
        duty = "  ".join(f"gpu{g['gpu']} {g['duty_cycle'] * 100:.0f}%" for g in r["gpus"])
        lines += [
            "",
            f"{title}: makespan {r['makespan_s']:.1f} s   duty cycle {duty}   switches {r['switches']}   "
            f"median switch {fmt(r['median_switch_ms'], ' ms')}   median wait {fmt(r['median_wait_ms'], ' ms')}",
            f"  {'job':<10} {'kind':<4} {'slices':>6} {'GPU s':>7} {'switches':>8} {'med switch':>11} "
            f"{'med wait':>10} {'data errors':>11}",
        ]
        for j in r["jobs"]:
            lines.append(
                f"  {j['job']:<10} {j['kind']:<4} {j['slices']:>6} {j['gpu_s']:>7.1f} {j['switches']:>8} "
                f"{fmt(j['median_switch_ms'], ' ms'):>11} {fmt(j['median_wait_ms'], ' ms'):>10} {j['data_errors']:>11}"
            )
    if "speedup" in report:
        lines += ["", f"speedup over serial: {report['speedup']:.2f}x (serial makespan / time-sliced makespan)"]
    if "link" in report:
        lines.append(describe_link(report["link"]))
    lines.append(f"data errors: {report['data_errors']}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        job = json.loads(sys.argv[2])
        print(json.dumps(worker(job["spec"], job["address"], job["scale"], job.get("prefix", ""))))
    else:
        raise SystemExit("usage: python -m timesliced.bench.demo --worker SPEC (use `timesliced demo`)")
