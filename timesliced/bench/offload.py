"""``timesliced bench offload``: what in-process offload achieves on this machine.

Two figures:

- *copy*: the executor alone parks and unparks ``mib`` MiB of regions
  ``rounds`` times, on the CPU stand-in (``--device host``) or on GPU 0
  (``--device cuda``), and reports GB/s per direction (copy time only, as
  ``MoveStats.gbps``) and the whole park / unpark time.
- *switch*: two job processes with 1 MiB offload regions take turns through a
  real daemon; each grant's ``switch_s`` is one park directive, one unpark
  directive and the scheduling around them, so this is the fixed cost the
  offload method adds to a switch.
- *swap*: two job processes of ``swap_mib`` MiB each (in regions of ``swap_region_mib``) take
  turns on a GPU too small for both, once with streamed switches (the outgoing park frees region
  by region and the incoming unpark maps into that room as it comes: both directions of the link
  at once) and once park then restore; it reports each run's switch time (the grants'
  ``switch_s``) and the move log's GB/s per direction. On the CPU stand-in each process's copies
  are paced to ``swap_gbps`` per direction (0: as fast as memory copies go), as on a link with one
  copy engine each way; with ``--device cuda`` the jobs' regions are on GPU 0 (the daemon models
  the GPU as a simulated one of the same room, so the switches are planned alike).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from ..client.offload import CudaDeviceMemory, HostDeviceMemory, Offloader
from ..util.stats import median, percentile
from .common import DaemonProcess

MiB = 1 << 20
REGION = 256 * MiB


def _memory(device: str) -> CudaDeviceMemory | HostDeviceMemory:
    return CudaDeviceMemory() if device == "cuda" else HostDeviceMemory(gpus=1)


def copy_figures(mib: int, rounds: int, device: str) -> dict[str, Any]:
    off = Offloader(_memory(device))
    try:
        left, regions = mib * MiB, []
        while left > 0:
            regions.append(off.alloc(min(left, REGION), tag="weights"))
            left -= REGION
        pattern = bytes(range(256)) * (MiB // 256)
        for r in regions:
            for at in range(0, r.nbytes, MiB):
                r.write(pattern[: min(MiB, r.nbytes - at)], at)
        parks, unparks = [], []
        for _ in range(rounds):
            parks.append(off.park())
            unparks.append(off.unpark())
        checked = off.park(verify=True), off.unpark(verify=True)
        return {
            "device": device,
            "bytes": mib * MiB,
            "rounds": rounds,
            "d2h_gbps_p50": median(s.gbps for s in parks),
            "d2h_gbps_max": max(s.gbps for s in parks),
            "h2d_gbps_p50": median(s.gbps for s in unparks),
            "h2d_gbps_max": max(s.gbps for s in unparks),
            "park_s_p50": median(s.seconds for s in parks),
            "unpark_s_p50": median(s.seconds for s in unparks),
            "verified_round_trip_s": checked[0].seconds + checked[1].seconds,
        }
    finally:
        off.close()


def switch_worker(address: str, job: str, turns: int) -> dict[str, Any]:
    import timesliced

    off = Offloader(HostDeviceMemory(gpus=1))
    off.alloc(MiB, tag="weights")
    switches = []
    with timesliced.Client(job=job, group="bench", address=address, park="offload", offloader=off) as client:
        while len(client.status()["jobs"]) < 2:  # start together, or one job takes every turn alone
            time.sleep(0.01)
        for _ in range(turns):
            with client.slice() as grant:
                if grant.restored:
                    switches.append(grant.switch_s)
        # Stay connected until the other job is done: its last turn parks this one.
        while any(j["slices"] < turns for j in client.status()["jobs"]):
            time.sleep(0.01)
    return {"job": job, "switch_s": switches}


def switch_figures(switches: int) -> dict[str, Any]:
    with DaemonProcess("--gpus", "1", "--gpu-memory", "64MiB") as daemon:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "timesliced.bench.offload", json.dumps([daemon.socket, job, switches // 2])],
                stdout=subprocess.PIPE,
                text=True,
            )
            for job in ("a", "b")
        ]
        outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("an offload benchmark worker failed")
    times = [s * 1000 for out in outs for s in json.loads(out.strip().splitlines()[-1])["switch_s"]]
    if not times:
        raise RuntimeError("the jobs never switched")
    return {"switches": len(times), "switch_p50_ms": percentile(times, 0.5), "switch_p99_ms": percentile(times, 0.99)}


def swap_worker(
    address: str, job: str, turns: int, mib: int, region_mib: int, device: str, gbps: float
) -> dict[str, Any]:
    """One job of the swap figures: ``turns`` slices, each writing its regions; the restored grants' switch times."""
    import timesliced

    off = Offloader(_memory(device))
    left, regions = mib * MiB, []
    while left > 0:
        regions.append(off.alloc(min(left, region_mib * MiB), tag="weights"))
        left -= region_mib * MiB
    block = bytes(range(256)) * (MiB // 256)
    switches = []
    executor = _Paced(off, gbps)
    with timesliced.Client(
        job=job, group="bench", address=address, park="offload", offloader=executor, memory=mib * MiB
    ) as client:
        while len([j for j in client.status()["jobs"] if j["group"] == "bench"]) < 2:
            time.sleep(0.01)
        for _ in range(turns):
            with client.slice(timeout=600) as grant:
                if grant.restored:
                    switches.append(grant.switch_s)
                for r in regions:
                    r.write(block[: min(MiB, r.nbytes)], 0)
        # Stay connected until the other job is done: its last turns swap this one out.
        while any(j["slices"] < turns for j in client.status()["jobs"] if j["group"] == "bench"):
            time.sleep(0.01)
    off.close()
    return {"job": job, "switch_s": switches}


class _Paced:
    """An ``Offloader`` whose stand-in memory is paced to ``gbps`` during its moves only (0: not paced)."""

    streams = True

    def __init__(self, off: Offloader, gbps: float) -> None:
        self.off, self.gbps = off, gbps

    def _paced(self, move: Any, tags: Any, kw: dict[str, Any]) -> Any:
        memory = self.off.memory
        if isinstance(memory, HostDeviceMemory) and self.gbps > 0:
            memory.bandwidth = self.gbps * 1e9
        try:
            return move(tags, **kw)
        finally:
            if isinstance(memory, HostDeviceMemory):
                memory.bandwidth = None

    def park(self, tags: Any = (), **kw: Any) -> Any:
        return self._paced(self.off.park, tags, kw)

    def unpark(self, tags: Any = (), **kw: Any) -> Any:
        return self._paced(self.off.unpark, tags, kw)


def swap_figures(mib: int, region_mib: int, swaps: int, device: str, gbps: float) -> dict[str, Any]:
    import timesliced

    from ..daemon.embedded import EmbeddedDaemon

    out: dict[str, Any] = {
        "device": device,
        "swap_mib": mib,
        "swap_region_mib": region_mib,
        "swap_gbps": gbps,
        "swaps": swaps,
    }
    for streamed in (True, False):
        daemon = EmbeddedDaemon(
            gpus=1,
            gpu_memory=(mib + mib // 2) * MiB,  # room for one job and a half: every switch moves both
            memory_headroom=0,
            bandwidth=0,
            stream_switches=streamed,
        )
        with daemon:
            args = [(daemon.socket, job, swaps // 2 + 1, mib, region_mib, device, gbps) for job in ("a", "b")]
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "timesliced.bench.offload", json.dumps(["swap", *a])],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for a in args
            ]
            outs = [p.communicate(timeout=1800)[0] for p in procs]
            if any(p.returncode for p in procs):
                raise RuntimeError("an offload swap benchmark worker failed")
            with timesliced.Client(job="bench-observer", group="observer", address=daemon.socket) as observer:
                moves = observer.status()["moves"]
        times = [s for o in outs for s in json.loads(o.strip().splitlines()[-1])["switch_s"]]
        key = "streamed" if streamed else "sequential"
        recent = [m for m in moves["recent"] if m["nbytes"]]
        out[f"{key}_switches"] = len(times)
        out[f"{key}_switch_s_p50"] = median(times) if times else None
        out[f"{key}_switch_s_min"] = min(times) if times else None
        out[f"{key}_switch_s_max"] = max(times) if times else None
        for direction in ("to_host", "to_device"):
            rates = [m["gbps"] for m in recent if m["direction"] == direction and bool(m["swap_with"]) == streamed]
            out[f"{key}_{direction}_gbps_p50"] = median(rates) if rates else None
    if out["streamed_switch_s_p50"] and out["sequential_switch_s_p50"]:
        out["swap_speedup"] = out["sequential_switch_s_p50"] / out["streamed_switch_s_p50"]
    return out


def run_offload(
    mib: int = 1024,
    rounds: int = 5,
    device: str = "host",
    switches: int = 200,
    *,
    swap_mib: int = 256,
    swap_region_mib: int = 16,
    swaps: int = 8,
    swap_gbps: float = 2.0,
) -> dict[str, Any]:
    if mib < 1 or rounds < 1 or switches < 2:
        raise ValueError("need at least 1 MiB, 1 round and 2 switches")
    if swap_mib < 1 or swap_region_mib < 1 or swaps < 0 or swap_gbps < 0:
        raise ValueError("need at least 1 MiB per swapped job and region, and no negative swaps or GB/s")
    result = {**copy_figures(mib, rounds, device), **switch_figures(switches)}
    if swaps:
        result.update(swap_figures(swap_mib, swap_region_mib, swaps, device, swap_gbps))
    return result


def format_offload(r: dict[str, Any]) -> str:
    """The figures as text: the copy and switch figures where ``r`` has them, the swap figures where it has them."""
    lines = _format_copy_and_switch(r) if "bytes" in r else []
    if "swap_mib" in r:
        lines += _format_swap(r)
    return "\n".join(lines)


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GB/s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _format_swap(r: dict[str, Any]) -> list[str]:
    link = f"paced to {r['swap_gbps']:g} GB/s each way" if r["swap_gbps"] and r["device"] == "host" else "unpaced"
    speedup = r.get("swap_speedup")
    return [
        f"swap of two {r['swap_mib']} MiB jobs on a GPU too small for both ({r['swap_region_mib']} MiB regions, "
        f"{r['device']} device, {link})",
        f"  streamed (swap)            switch p50 {_ms(r['streamed_switch_s_p50'])} "
        f"(min {_ms(r['streamed_switch_s_min'])}, max {_ms(r['streamed_switch_s_max'])}, "
        f"{r['streamed_switches']} switches)   to host {_gbps(r['streamed_to_host_gbps_p50'])}   "
        f"to device {_gbps(r['streamed_to_device_gbps_p50'])}",
        f"  park then restore          switch p50 {_ms(r['sequential_switch_s_p50'])} "
        f"(min {_ms(r['sequential_switch_s_min'])}, max {_ms(r['sequential_switch_s_max'])}, "
        f"{r['sequential_switches']} switches)   to host {_gbps(r['sequential_to_host_gbps_p50'])}   "
        f"to device {_gbps(r['sequential_to_device_gbps_p50'])}",
        f"  park then restore / swap   {speedup:.2f}x" if speedup else "  park then restore / swap   -",
    ]


def _format_copy_and_switch(r: dict[str, Any]) -> list[str]:
    return [
        f"offload of {r['bytes'] / MiB:.0f} MiB on the {r['device']} device, {r['rounds']} rounds",
        f"  device -> host (park)      p50 {r['d2h_gbps_p50']:.1f} GB/s   max {r['d2h_gbps_max']:.1f} GB/s   "
        f"whole park p50 {r['park_s_p50'] * 1000:.0f} ms",
        f"  host -> device (unpark)    p50 {r['h2d_gbps_p50']:.1f} GB/s   max {r['h2d_gbps_max']:.1f} GB/s   "
        f"whole unpark p50 {r['unpark_s_p50'] * 1000:.0f} ms",
        f"  with checksums             round trip {r['verified_round_trip_s'] * 1000:.0f} ms",
        f"switch through a daemon (1 MiB per job, {r['switches']} switches)",
        f"  park + unpark directives   p50 {r['switch_p50_ms']:.2f} ms   p99 {r['switch_p99_ms']:.2f} ms",
    ]


if __name__ == "__main__":
    worker_args = json.loads(sys.argv[1])
    if worker_args and worker_args[0] == "swap":
        print(json.dumps(swap_worker(*worker_args[1:])))
    else:
        print(json.dumps(switch_worker(*worker_args)))
