"""The pinned-copy ceiling of a GPU, and whether NVML sees this process: run by ``check.py`` as a child.

::

    python3 tests/gpu/ceiling.py [--gpu 0] [--mib 1024] [--repeats 5]

Prints one JSON object on stdout. A child process, not a thread of the check,
so that a hung driver call can be killed with its process group, and the check
itself never holds a CUDA context on the GPU it measures.

- ``h2d_gbps`` / ``d2h_gbps``: the best of ``--repeats`` ``cuMemcpyHtoDAsync`` /
  ``cuMemcpyDtoHAsync`` copies of the whole buffer between ``cuMemHostAlloc``
  (page-locked) host memory and ``cuMemAlloc`` device memory, timed with CUDA
  events (``cuEventElapsedTime``, milliseconds), in GB/s (10^9 bytes/s).
- Both at once: half the buffer each way, on two non-blocking streams that
  start together (the second waits on the first's start event): ``bidir_gbps``
  counts both halves over the longer of the two, ``bidir_h2d_gbps`` and
  ``bidir_d2h_gbps`` each direction over its own stream's time.
- ``nvml_sees_own_pid``: while this process holds its buffers, whether NVML's
  per-process list of the GPU has this process's PID. Where it does not, a
  daemon started like this process (in the same PID namespace) measures what
  cuda-checkpoint moves from each GPU's used memory instead of NVML's
  per-process figures; it finds the processes through the driver either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

try:
    from . import workload
except ImportError:  # run as a script: this directory is on sys.path
    import workload  # type: ignore[no-redef]

GB = 1e9
MiB = 1 << 20


def nvml_view(pid: int, wait: float = 2.0) -> dict[str, Any]:
    """Whether NVML lists ``pid`` on any GPU (CUDA_VISIBLE_DEVICES may renumber them), and the PIDs it lists.

    Asks again for up to ``wait`` seconds, in case NVML's list trails the new context.
    """
    workload.bootstrap()
    from timesliced.nvml import Nvml

    end = time.monotonic() + wait
    with contextlib.closing(Nvml.open()) as nvml:
        if not nvml.available:
            return {"ok": None, "error": f"NVML: {nvml.reason}"}
        while True:
            try:
                procs = nvml.process_memory()
            except Exception as exc:
                return {"ok": None, "error": f"NVML could not list the GPUs' processes: {exc}"}
            if pid in procs or time.monotonic() > end:
                break
            time.sleep(0.1)
    return {
        "ok": pid in procs,
        "pid": pid,
        "bytes": {str(g): n for g, n in sorted(procs.get(pid, {}).items())},
        "nvml_pids": sorted(procs),
    }


def measure(gpu: int = 0, nbytes: int = 1024 * MiB, repeats: int = 5) -> dict[str, Any]:
    """The ceiling figures and NVML's view of this process (see the module docstring)."""
    cu = workload.Driver()
    d = cu.d
    device, context = cu.primary_context(gpu)
    cu("cuCtxPushCurrent", context)
    host = dev = 0
    streams: list[Any] = []
    events: list[Any] = []
    try:
        host = int(cu("cuMemHostAlloc", nbytes, 0))
        dev = int(cu("cuMemAlloc", nbytes))
        for _ in range(2):
            streams.append(cu("cuStreamCreate", int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)))
        for _ in range(3):
            events.append(cu("cuEventCreate", int(d.CUevent_flags.CU_EVENT_DEFAULT)))
        s1, s2 = streams
        start, end1, end2 = events
        half = nbytes // 2

        def h2d(stream: Any, off: int, n: int) -> None:
            cu("cuMemcpyHtoDAsync", cu.ptr(dev + off), host + off, n, stream)

        def d2h(stream: Any, off: int, n: int) -> None:
            cu("cuMemcpyDtoHAsync", host + off, cu.ptr(dev + off), n, stream)

        def timed(issue: Callable[[], None]) -> tuple[float, float]:
            """Seconds on stream 1 and on stream 2, both from one start event."""
            cu("cuEventRecord", start, s1)
            cu("cuStreamWaitEvent", s2, start, 0)
            issue()
            cu("cuEventRecord", end1, s1)
            cu("cuEventRecord", end2, s2)
            cu("cuEventSynchronize", end1)
            cu("cuEventSynchronize", end2)
            return (
                float(cu("cuEventElapsedTime", start, end1)) / 1000,
                float(cu("cuEventElapsedTime", start, end2)) / 1000,
            )

        def best(issue: Callable[[], None]) -> float:
            timed(issue)  # warm-up
            return nbytes / min(max(timed(issue)) for _ in range(repeats)) / GB

        def both_ways() -> None:
            h2d(s1, 0, half)
            d2h(s2, half, nbytes - half)

        seen = nvml_view(os.getpid())  # while the buffers are held
        h2d_gbps = best(lambda: h2d(s1, 0, nbytes))
        d2h_gbps = best(lambda: d2h(s1, 0, nbytes))
        timed(both_ways)
        runs = [timed(both_ways) for _ in range(repeats)]
        t1, t2 = min(runs, key=max)
        return {
            "h2d_gbps": h2d_gbps,
            "d2h_gbps": d2h_gbps,
            "bidir_gbps": nbytes / max(t1, t2) / GB,
            "bidir_h2d_gbps": half / t1 / GB,
            "bidir_d2h_gbps": (nbytes - half) / t2 / GB,
            "nbytes": nbytes,
            "repeats": repeats,
            "nvml_sees_own_pid": seen,
            "how": "cuMemcpy{HtoD,DtoH}Async between cuMemHostAlloc and cuMemAlloc memory, timed with CUDA events, "
            "best of repeats; both at once: half each way on two streams",
        }
    finally:
        cleanup: list[tuple[str, Any]] = [("cuEventDestroy", e) for e in events]
        cleanup += [("cuStreamDestroy", s) for s in streams]
        if dev:
            cleanup.append(("cuMemFree", cu.ptr(dev)))
        if host:
            cleanup.append(("cuMemFreeHost", host))
        for name, *args in [*cleanup, ("cuCtxPopCurrent",), ("cuDevicePrimaryCtxRelease", device)]:
            with contextlib.suppress(workload.CudaError):
                cu(name, *args)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's GPU 0 is NVML's GPU 0
    p = argparse.ArgumentParser(description="The pinned-copy ceiling of a GPU (see tests/gpu/README.md).")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--mib", type=int, default=1024, help="buffer size (MiB, default 1024)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    try:
        out: dict[str, Any] = {"ok": True, **measure(args.gpu, args.mib * MiB, args.repeats)}
    except Exception as exc:
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
