"""The GPU check: run the real parking backends on a real GPU and print what they achieve.

::

    python tests/gpu/check.py [--gib 4] [--rounds 10] [--backends cuda-checkpoint,offload] [--torch auto] [--json]

1. Preflight (seconds): NVML must see a GPU and cuda-python must initialise the
   driver, each under a timeout. Without a usable GPU it prints
   ``{"ok": false, "stage": "preflight", "error": "no GPU: ..."}`` and exits 2.
2. Ceiling: the best pinned-memory copy bandwidth of GPU 0 (host to device,
   device to host, and both at once on two streams), with cuda-python.
3. For each backend: a fresh daemon (``timesliced serve --backend B``) and two
   job processes (``workload.py``) that each fill several GiB, take turns
   ``--rounds`` times and verify every byte after every turn. The daemon's
   move log gives the bytes and seconds of every snapshot (device to host)
   and restore (host to device); the jobs give switch times and data errors.
4. One JSON object on stdout (see README.md); exit 0 when every backend ran
   with no data error, 1 otherwise.

Everything is bounded: ``--deadline`` (default 185 s) covers the whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

try:
    from . import workload
except ImportError:  # run as a script: this directory is on sys.path
    import workload  # type: ignore[no-redef]

T = TypeVar("T")

REPO = workload.REPO
WORKLOAD = Path(workload.__file__).resolve()
BACKENDS = ("cuda-checkpoint", "offload")
NOT_RUN = {
    "vllm": "not run: needs a vLLM server started with sleep mode enabled; no inference engine is installed here",
    "sglang": "not run: needs an SGLang server with memory saver enabled; no inference engine is installed here",
}
JOBS = ("check-a", "check-b")
GiB = 1 << 30
GB = 1e9
TAIL_LINES = 20


class PreflightError(Exception):
    """The machine cannot run the check; the message says why."""


Progress = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


def call_with_timeout(fn: Callable[[], T], timeout: float, what: str) -> T:
    """``fn()`` on a helper thread; raises ``TimeoutError`` when it has not returned in ``timeout`` seconds.

    A driver call that hangs stays behind on its (daemon) thread: the check
    reports and moves on instead of hanging with it.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"gpu-check: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {timeout:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


# --- 1. preflight -------------------------------------------------------------------------


def preflight(timeout: float = 15.0) -> dict[str, Any]:
    """What GPU 0 is; raises :class:`PreflightError` when there is no usable GPU."""
    workload.bootstrap()
    try:
        from timesliced.nvml import Nvml
    except ImportError as exc:
        raise PreflightError(f"timesliced cannot be imported ({exc}): pip install -e '.[cuda,test]' first") from None

    try:
        nvml = call_with_timeout(Nvml.open, timeout, "NVML (nvmlInit)")
    except TimeoutError as exc:
        raise PreflightError(f"no GPU: {exc}") from None
    if not nvml.available:
        raise PreflightError(f"no GPU: {nvml.reason}")
    try:
        devices = nvml.devices()
        sample = nvml.sample()[0]
        gpu: dict[str, Any] = {
            "count": len(devices),
            "index": devices[0].index,
            "name": devices[0].name,
            "uuid": devices[0].uuid,
            "memory_total": devices[0].capacity,
            "memory_used": sample.memory_used,
            "driver": nvml.driver_version,
            "cuda": nvml.cuda_version,
        }
    finally:
        nvml.close()
    try:
        cu = workload.Driver()
    except ImportError as exc:
        raise PreflightError(f"cuda-python is not installed (pip install -e '.[cuda]'): {exc}") from None

    def init() -> tuple[int, str, int]:
        cu("cuInit", 0)
        count = int(cu("cuDeviceGetCount"))
        if count < 1:
            raise RuntimeError("the driver lists no CUDA device (check CUDA_VISIBLE_DEVICES)")
        name = cu("cuDeviceGetName", 256, cu("cuDeviceGet", 0))
        text = name if isinstance(name, str) else bytes(name).split(b"\0", 1)[0].decode(errors="replace")
        return count, text, int(cu("cuDriverGetVersion"))

    try:
        count, cuda_name, cuda_version = call_with_timeout(init, timeout, "cuInit")
    except Exception as exc:
        raise PreflightError(f"no GPU: cuda-python cannot use the CUDA driver: {type(exc).__name__}: {exc}") from None
    from timesliced.backends import cuda_checkpoint

    verdict = cuda_checkpoint.probe(nvml_driver_version=lambda: gpu["driver"])
    gpu.update(
        cuda_devices=count,
        cuda_name=cuda_name,
        cuda_driver_api=f"{cuda_version // 1000}.{cuda_version % 1000 // 10}",
        cuda_python=_version("cuda-bindings") or _version("cuda-python"),
        torch=_version("torch"),
        checkpoint_api="ok" if verdict.ok else verdict.reason,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    return gpu


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- 2. the ceiling -----------------------------------------------------------------------


def measure_ceiling(nbytes: int = GiB, repeats: int = 5, gpu: int = 0) -> dict[str, Any]:
    """Best-of-``repeats`` copy bandwidth between pinned host memory and GPU ``gpu``, in GB/s (1e9 B/s).

    One ``nbytes`` copy per direction, timed with CUDA events; ``bidir``
    copies half of it each way at once on two streams and counts both halves.
    Frees everything and releases the primary context before it returns.
    """
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

        def timed(issue: Callable[[], None]) -> float:
            cu("cuEventRecord", start, s1)
            cu("cuStreamWaitEvent", s2, start, 0)
            issue()
            cu("cuEventRecord", end1, s1)
            cu("cuEventRecord", end2, s2)
            cu("cuEventSynchronize", end1)
            cu("cuEventSynchronize", end2)
            ms = max(float(cu("cuEventElapsedTime", start, end1)), float(cu("cuEventElapsedTime", start, end2)))
            return ms / 1000

        def both_ways() -> None:
            h2d(s1, 0, half)
            d2h(s2, half, nbytes - half)

        def best(issue: Callable[[], None]) -> float:
            timed(issue)  # warm-up
            return nbytes / min(timed(issue) for _ in range(repeats)) / GB

        return {
            # Whether NVML sees this process's memory under its PID: cuda-checkpoint finds a job's
            # processes that way, which a daemon outside the host's PID namespace cannot.
            "nvml_sees_own_pid_bytes": _own_pid_bytes(gpu),
            "h2d_gbps": best(lambda: h2d(s1, 0, nbytes)),
            "d2h_gbps": best(lambda: d2h(s1, 0, nbytes)),
            "bidir_gbps": best(both_ways),
            "nbytes": nbytes,
            "repeats": repeats,
            "how": "cuMemcpy{HtoD,DtoH}Async from/to cuMemHostAlloc memory, CUDA events, best of repeats",
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


def _own_pid_bytes(gpu: int) -> int | None:
    from timesliced.nvml import Nvml

    with contextlib.closing(Nvml.open()) as nvml:
        if not nvml.available:
            return None
        return nvml.process_memory().get(os.getpid(), {}).get(gpu)


# --- 3. one backend -----------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


@contextlib.contextmanager
def spawned(
    argv: list[str], out: Path, err: Path, grace: float = 10.0, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process with its output in files; terminated (killed after ``grace`` s) and reaped on the way out."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            argv,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**child_env(), **(env or {})},
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop(proc, grace)


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


class BackendRun:
    """One backend's daemon, its two jobs and what was seen of them."""

    def __init__(self, backend: str, workdir: Path, progress: Progress, crash_at: str | None = None) -> None:
        self.backend = backend
        self.crash_at = crash_at
        self.restarts = 0
        self.workdir = workdir
        self.socket = workdir / "s.sock"
        self.progress = progress
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.moves: dict[tuple[float, str, str], dict[str, Any]] = {}  # (at, job, kind) -> move
        self.move_totals: dict[str, int] = {}  # job -> moves the daemon counted
        self.faults: dict[str, str] = {}
        self.parking: dict[str, Any] = {}

    def wait_ready(self, daemon: subprocess.Popen[bytes], timeout: float) -> None:
        from timesliced.client.sync import daemon_status
        from timesliced.errors import TimeslicedError

        deadline = time.monotonic() + timeout
        while True:
            if daemon.poll() is not None:
                log = tail(self.workdir / "daemon.log", 5)
                raise RuntimeError(f"the daemon exited with status {daemon.returncode}: {log}")
            if self.socket.exists():
                try:
                    status = daemon_status(str(self.socket), timeout=2)
                except TimeslicedError:
                    pass
                else:
                    self.parking = status.get("parking") or {}
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not answer within {timeout:.0f}s")
            time.sleep(0.1)

    def poll(self) -> None:
        """Read the daemon's move log before it forgets the jobs (it does when they exit)."""
        from timesliced.client.sync import daemon_status

        status = daemon_status(str(self.socket), timeout=5)
        moves = status.get("moves") or {}
        for move in moves.get("recent", []):
            self.moves[(float(move["at"]), str(move["job"]), str(move["kind"]))] = move
        for job, summary in (moves.get("jobs") or {}).items():
            self.move_totals[job] = int(summary.get("count", 0))
        for job in status.get("jobs", []):
            if job.get("faulted"):
                self.faults[job["job"]] = str(job["faulted"])

    def run(self, *, gib: float, rounds: int, torch: str, timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + timeout
        reports: dict[str, dict[str, Any]] = {}
        daemon_argv = [
            sys.executable,
            "-m",
            "timesliced",
            "serve",
            "--backend",
            self.backend,
            "--state-dir",
            str(self.workdir / "state"),
            "--socket",
            str(self.socket),
            "--log-level",
            "INFO",
            "--web",
            "off",
        ]
        log = self.workdir / "daemon.log"
        crash = {"TIMESLICED_CRASH_AT": self.crash_at} if self.crash_at else None
        with contextlib.ExitStack() as daemons:
            daemon = daemons.enter_context(spawned(daemon_argv, self.workdir / "daemon.out", log, env=crash))
            try:
                self.wait_ready(daemon, min(30.0, timeout))
            except RuntimeError as exc:
                self.errors.append(str(exc))
                return self.result(reports, rounds, started)
            self.check_parking()
            self.progress(f"{self.backend}: daemon up; two jobs of {gib:g} GiB, {rounds} turns each")
            with contextlib.ExitStack() as stack:
                procs = {
                    job: stack.enter_context(
                        spawned(
                            self.workload_argv(job, gib, rounds, torch),
                            self.workdir / f"{job}.out",
                            self.workdir / f"{job}.err",
                            grace=3.0,
                        )
                    )
                    for job in JOBS
                }
                while any(p.poll() is None for p in procs.values()):
                    if time.monotonic() > deadline:
                        self.errors.append(f"timed out after {timeout:.0f}s; the jobs were killed")
                        break
                    if daemon.poll() is not None:
                        if self.crash_at and daemon.returncode == -signal.SIGKILL and not self.restarts:
                            restarted = self.restart(daemons, daemon_argv)
                            if restarted is not None:
                                daemon = restarted
                                continue
                        self.errors.append(f"the daemon exited with status {daemon.returncode} during the run")
                        break
                    with contextlib.suppress(Exception):
                        self.poll()
                    time.sleep(0.25)
                if daemon.poll() is None:
                    with contextlib.suppress(Exception):
                        self.poll()
            for job in JOBS:
                reports[job] = self.read_report(job)
        if self.errors or any(not r.get("ok") for r in reports.values()):
            self.notes.append("daemon log tail:\n" + tail(log))
        return self.result(reports, rounds, started)

    def restart(self, daemons: contextlib.ExitStack, argv: list[str]) -> subprocess.Popen[bytes] | None:
        """The daemon killed itself at the crash point: start a new one on the same state dir (None: it failed)."""
        self.restarts += 1
        self.notes.append(f"the daemon was killed with SIGKILL at {self.crash_at} and started again")
        self.progress(f"{self.backend}: daemon killed at {self.crash_at}; starting it again")
        n = self.restarts + 1
        out, log = self.workdir / f"daemon-{n}.out", self.workdir / f"daemon-{n}.log"
        daemon = daemons.enter_context(spawned(argv, out, log))
        try:
            self.wait_ready(daemon, 30.0)
        except RuntimeError as exc:
            self.errors.append(f"the restarted daemon: {exc}")
            return None
        return daemon

    def workload_argv(self, job: str, gib: float, rounds: int, torch: str) -> list[str]:
        return [
            sys.executable,
            str(WORKLOAD),
            "--job",
            job,
            "--socket",
            str(self.socket),
            "--method",
            self.backend,
            "--gib",
            repr(gib),
            "--rounds",
            str(rounds),
            "--torch",
            torch,
            "--peers",
            str(len(JOBS)),
        ]

    def check_parking(self) -> None:
        methods = self.parking.get("methods") or {}
        if methods.get(self.backend) != "available":
            self.errors.append(f"the daemon cannot park with {self.backend}: {methods.get(self.backend)}")
        if self.parking.get("device_source") != "nvml":
            self.errors.append("the daemon simulates its GPUs: it found no usable GPU through NVML")

    def read_report(self, job: str) -> dict[str, Any]:
        out = self.workdir / f"{job}.out"
        lines = [line for line in out.read_text(errors="replace").splitlines() if line.strip()] if out.exists() else []
        try:
            report = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            report = None
        if not isinstance(report, dict):
            stderr = tail(self.workdir / f"{job}.err", 8)
            return {"job": job, "ok": False, "errors": [f"no report from the job; its stderr: {stderr}"]}
        return report

    def result(self, reports: dict[str, dict[str, Any]], rounds: int, started: float) -> dict[str, Any]:
        if self.crash_at and not self.restarts:
            self.errors.append(f"the daemon never reached the crash point {self.crash_at}")
        report = summarize(
            self.backend,
            reports,
            sorted(self.moves.values(), key=lambda m: float(m["at"])),
            rounds,
            errors=self.errors,
            notes=self.notes,
            faults=self.faults,
            missed=sum(self.move_totals.values()) - len(self.moves),
            seconds=time.monotonic() - started,
        )
        if self.crash_at:
            report.update(crash_at=self.crash_at, restarts=self.restarts)
        return report


def run_backend(
    backend: str,
    *,
    gib: float = 4.0,
    rounds: int = 10,
    torch: str = "auto",
    timeout: float = 100.0,
    keep: bool = False,
    progress: Progress = _quiet,
    crash_at: str | None = None,
) -> dict[str, Any]:
    """Run ``backend`` with two jobs of ``gib`` GiB taking ``rounds`` turns each; its report (see README.md).

    ``crash_at`` (a point of ``$TIMESLICED_CRASH_AT``): the daemon kills itself with SIGKILL there once,
    and a new one is started on the same state dir; the jobs must reconnect and lose nothing.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    workload.bootstrap()
    workdir = Path(tempfile.mkdtemp(prefix=f"tsgpu-{backend}-"))
    try:
        run = BackendRun(backend, workdir, progress, crash_at)
        result = run.run(gib=gib, rounds=rounds, torch=torch, timeout=timeout)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if keep:
        result["logs"] = str(workdir)
    return result


# --- figures ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": percentile(values, 0.5),
        "p95": percentile(values, 0.95),
        "max": max(values) if values else None,
    }


def direction(moves: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Figures of the daemon's moves of one kind (snapshot: device to host, restore: host to device)."""
    mine = [m for m in moves if m["kind"] == kind]
    real = [m for m in mine if m["nbytes"] > 0 and m["seconds"] > 0]
    rates = [float(m["gbps"]) for m in real]
    return {
        "kind": kind,
        "moves": len(real),
        "empty_moves": len(mine) - len(real),
        "bytes_per_move": int(statistics.median(m["nbytes"] for m in real)) if real else 0,
        "seconds_p50": percentile([float(m["seconds"]) for m in real], 0.5),
        "gbps_p50": statistics.median(rates) if rates else None,
        "gbps_max": max(rates) if rates else None,
    }


def summarize(
    backend: str,
    reports: dict[str, dict[str, Any]],
    moves: list[dict[str, Any]],
    rounds: int,
    *,
    errors: list[str],
    notes: list[str],
    faults: dict[str, str],
    missed: int,
    seconds: float,
) -> dict[str, Any]:
    """One backend's report from its jobs' reports and the daemon's move log."""
    errors = list(errors)
    notes = list(notes)
    for job, why in sorted(faults.items()):
        errors.append(f"the daemon faulted {job}: {why}")
    jobs: dict[str, Any] = {}
    switches: list[float] = []
    verify_rates: list[float] = []
    for job, report in sorted(reports.items()):
        turns = [r for r in report.get("rounds", []) if r.get("round", 0) > 0]
        restored = [r for r in turns if r.get("restored")]
        switches += [float(r["switch_s"]) for r in restored]
        nbytes = int(report.get("nbytes", 0))
        verify_rates += [nbytes / r["verify_s"] / GB for r in turns if r.get("done") and r.get("verify_s")]
        errors += [f"{job}: {e}" for e in report.get("errors", [])]
        done = int(report.get("rounds_done", 0))
        if done < rounds and not report.get("errors"):
            errors.append(f"{job}: {done} of {rounds} turns done")
        if turns and not restored:
            errors.append(f"{job}: never restored: the jobs did not take turns")
        elif len(restored) < len(turns):
            notes.append(f"{job}: {len(restored)} of {len(turns)} turns came with a restore")
        jobs[job] = {
            "ok": bool(report.get("ok")),
            "rounds_done": done,
            "restores": len(restored),
            "data_errors": int(report.get("data_errors", 0)),
            "mismatches": report.get("mismatches", []),
            "nbytes": nbytes,
            "allocations": report.get("allocations"),
            "torch": report.get("torch"),
            "seconds": report.get("seconds"),
            "notes": report.get("notes", []),
        }
    d2h, h2d = direction(moves, "snapshot"), direction(moves, "restore")
    if reports and not d2h["moves"] and not errors:
        hint = ""
        if backend == "cuda-checkpoint":
            hint = (
                ": NVML attributed no device memory to the jobs' PIDs (a PID namespace between the processes "
                "and the driver, e.g. a container without --pid=host, or per-process memory not reported)"
            )
        errors.append(f"the daemon parked nothing{hint}")
    if missed > 0:
        notes.append(f"{missed} moves left the daemon's log before they were read")
    data_errors = sum(j["data_errors"] for j in jobs.values())
    return {
        "ok": not errors and data_errors == 0 and len(jobs) == len(JOBS) and all(j["ok"] for j in jobs.values()),
        "rounds": rounds,
        "rounds_done": min((j["rounds_done"] for j in jobs.values()), default=0),
        "restores": sum(j["restores"] for j in jobs.values()),
        "data_errors": data_errors,
        "switch_s": spread(switches),
        "d2h": d2h,
        "h2d": h2d,
        "verify_gbps_p50": statistics.median(verify_rates) if verify_rates else None,
        "jobs": jobs,
        "errors": errors,
        "notes": notes,
        "seconds": seconds,
    }


def against_ceiling(result: dict[str, Any], ceiling: dict[str, Any]) -> None:
    """Add each direction's median rate as a fraction of the measured ceiling."""
    for key, limit in (("d2h", "d2h_gbps"), ("h2d", "h2d_gbps")):
        rate, top = result.get(key, {}).get("gbps_p50"), ceiling.get(limit)
        if rate and top:
            result[key]["of_ceiling"] = rate / top


# --- 4. the whole check -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Run timesliced's real parking backends on this machine's GPU 0.")
    p.add_argument("--gib", type=float, default=4.0, help="device memory per job (GiB, default 4)")
    p.add_argument("--rounds", type=int, default=10, help="turns each job takes, each verified (default 10)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated (default {','.join(BACKENDS)})")
    p.add_argument("--torch", choices=["auto", "on", "off"], default="auto", help="a torch tensor in each job")
    p.add_argument("--deadline", type=float, default=185.0, help="seconds for the whole check (default 185)")
    p.add_argument("--backend-timeout", type=float, default=120.0, help="seconds per backend at most")
    p.add_argument("--keep", action="store_true", help="keep the daemon and job logs (their folder is reported)")
    p.add_argument(
        "--crash-at",
        default=None,
        metavar="POINT",
        help="the daemon kills itself with SIGKILL at this step of a switch once (e.g. before-restore) and is "
        "started again; the jobs must lose nothing",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON object, on one line")
    return p


def as_interrupt(signum: int, frame: Any) -> None:
    """A signal handler that raises ``KeyboardInterrupt``, so ``finally`` blocks stop the child processes."""
    raise KeyboardInterrupt(f"signal {signum}")


def emit(result: dict[str, Any], compact: bool) -> None:
    print(json.dumps(result, indent=None if compact else 2), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise SystemExit(f"check.py: unknown backends {unknown} (choose from {', '.join(BACKENDS)})")
    if args.gib <= 0 or args.rounds < 1:
        raise SystemExit("check.py: --gib and --rounds must be positive")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's GPU 0 is NVML's GPU 0
    signal.signal(signal.SIGTERM, as_interrupt)  # a timeout's SIGTERM still stops the children
    started = time.monotonic()
    deadline = started + args.deadline

    def progress(message: str) -> None:
        if not args.json:
            print(f"[gpu-check {time.monotonic() - started:5.1f}s] {message}", file=sys.stderr, flush=True)

    progress("preflight")
    try:
        gpu = preflight()
    except PreflightError as exc:
        emit({"ok": False, "stage": "preflight", "error": str(exc)}, args.json)
        return 2
    except KeyboardInterrupt as exc:
        emit({"ok": False, "stage": "preflight", "error": f"interrupted ({exc or 'SIGINT'})"}, args.json)
        return 1
    result: dict[str, Any] = {
        "ok": False,
        "gpu": gpu,
        "config": {"gib": args.gib, "rounds": args.rounds, "torch": args.torch, "backends": backends},
        "ceiling": None,
        "backends": {},
        "not_run": dict(NOT_RUN),
        "errors": [],
        "seconds": None,
    }
    try:
        progress(f"{gpu['name']}, driver {gpu['driver']}; measuring the pinned copy ceiling")
        try:
            result["ceiling"] = call_with_timeout(measure_ceiling, 60.0, "the ceiling measurement")
        except Exception as exc:
            result["errors"].append(f"ceiling: {type(exc).__name__}: {exc}")
        for i, backend in enumerate(backends):
            budget = min(args.backend_timeout, (deadline - time.monotonic() - 5) / (len(backends) - i))
            if budget < 20:
                result["backends"][backend] = {"ok": False, "errors": ["not run: the time budget is spent"]}
                continue
            progress(f"{backend}: starting (at most {budget:.0f}s)")
            report = run_backend(
                backend,
                gib=args.gib,
                rounds=args.rounds,
                torch=args.torch,
                timeout=budget,
                keep=args.keep,
                progress=progress,
                crash_at=args.crash_at,
            )
            if result["ceiling"]:
                against_ceiling(report, result["ceiling"])
            result["backends"][backend] = report
            progress(f"{backend}: {'ok' if report['ok'] else 'FAILED'} in {report['seconds']:.0f}s")
    except KeyboardInterrupt as exc:
        result["errors"].append(f"interrupted ({exc or 'SIGINT'})")
    result["ok"] = (
        not result["errors"]
        and result["ceiling"] is not None
        and len(result["backends"]) == len(backends)
        and all(b.get("ok") for b in result["backends"].values())
    )
    result["seconds"] = time.monotonic() - started
    emit(result, args.json)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
