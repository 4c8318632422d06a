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


def run_offload(mib: int = 1024, rounds: int = 5, device: str = "host", switches: int = 200) -> dict[str, Any]:
    if mib < 1 or rounds < 1 or switches < 2:
        raise ValueError("need at least 1 MiB, 1 round and 2 switches")
    return {**copy_figures(mib, rounds, device), **switch_figures(switches)}


def format_offload(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"offload of {r['bytes'] / MiB:.0f} MiB on the {r['device']} device, {r['rounds']} rounds",
            f"  device -> host (park)      p50 {r['d2h_gbps_p50']:.1f} GB/s   max {r['d2h_gbps_max']:.1f} GB/s   "
            f"whole park p50 {r['park_s_p50'] * 1000:.0f} ms",
            f"  host -> device (unpark)    p50 {r['h2d_gbps_p50']:.1f} GB/s   max {r['h2d_gbps_max']:.1f} GB/s   "
            f"whole unpark p50 {r['unpark_s_p50'] * 1000:.0f} ms",
            f"  with checksums             round trip {r['verified_round_trip_s'] * 1000:.0f} ms",
            f"switch through a daemon (1 MiB per job, {r['switches']} switches)",
            f"  park + unpark directives   p50 {r['switch_p50_ms']:.2f} ms   p99 {r['switch_p99_ms']:.2f} ms",
        ]
    )


if __name__ == "__main__":
    print(json.dumps(switch_worker(*json.loads(sys.argv[1]))))
