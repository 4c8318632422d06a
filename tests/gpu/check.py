"""The GPU check: run the real parking backends on a real GPU and print what they achieve.

::

    python3 tests/gpu/check.py [--gib 4] [--rounds 10] [--backends cuda-checkpoint,offload] [--deadline 270] [--json]

Stages, each reported under ``stages`` with ``ok`` or its ``error`` (see README.md):

1. ``preflight`` (seconds, standard library only): kill what an earlier run of
   the check left behind, then NVML (through ``ctypes``) must list a GPU and
   say which CUDA version its driver supports. Without a usable GPU it prints
   ``{"ok": false, "stage": "preflight", "error": "no GPU: ..."}`` and exits 2.
2. ``install``: cuda-python of the driver's CUDA major (no known-bad release),
   the package's dependencies and pytest, into the check's own folder where
   missing (``install.py``).
3. ``cuda``: cuda-python initialises the driver (``cuInit``), the checkpoint
   API's verdict, and NVML's list of the processes already on the GPU.
4. ``pytest``: the quick checks of ``test_real_gpu.py``.
5. ``ceiling``: the pinned-copy bandwidth of GPU 0 each way and both at once
   (``ceiling.py``, a child), and whether NVML sees the PIDs of this machine's
   processes.
6. ``cuda-checkpoint``, ``offload``: a fresh daemon and two job processes
   (``workload.py``) that fill GiBs, take turns and verify every byte after
   every turn; the number of turns is planned from the first measured switch
   (``budget.py``) so that the run fits its slot.
7. ``crash``: the daemon SIGKILLs itself before its first restore and a new one
   must take the jobs over without losing a byte; skipped when the measured
   switch says it would not fit.
8. ``cleanup``, always: every process group the check started is stopped and
   NVML must show no process on the GPU that was not there at the start.

One deadline (``--deadline``, 270 s) bounds it all: each stage gets a slot from
it (``budget.slot``), and a watchdog kills everything and prints the document
should anything overrun. SIGTERM, SIGINT and SIGHUP end it the same way.
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
    from . import budget, install, procs, runner, workload
except ImportError:  # run as a script: this directory is on sys.path
    import budget  # type: ignore[no-redef]
    import install  # type: ignore[no-redef]
    import procs  # type: ignore[no-redef]
    import runner  # type: ignore[no-redef]
    import workload  # type: ignore[no-redef]

T = TypeVar("T")

HERE = Path(__file__).resolve().parent
REPO = workload.REPO
WORKLOAD = Path(workload.__file__).resolve()
CEILING = HERE / "ceiling.py"
BACKENDS = ("cuda-checkpoint", "offload")
NOT_RUN = {
    "vllm": "not run: needs a vLLM server started with sleep mode enabled; no inference engine is installed here",
    "sglang": "not run: needs an SGLang server with memory saver enabled; no inference engine is installed here",
}
JOBS = ("check-a", "check-b")
GiB = 1 << 30
GB = 1e9
TAIL_LINES = 20
DEADLINE_ENV = "TIMESLICED_GPU_CHECK_DEADLINE"
# The pytest stage leaves the two-job runs and the crash run to the stages that do them in full.
PYTEST_SELECTION = "not two_jobs and not kill_9"

# Every process this check starts, in its own process group (procs.py).
CHILDREN = procs.Children()

STAGES = {
    s.name: s
    for s in (
        budget.StageSpec("preflight", cap_s=25, floor_s=0),
        budget.StageSpec("install", cap_s=90, floor_s=5),
        budget.StageSpec("cuda", cap_s=40, floor_s=5),
        budget.StageSpec("pytest", cap_s=60, floor_s=20, required=False),
        budget.StageSpec("ceiling", cap_s=45, floor_s=10),
        budget.StageSpec("cuda-checkpoint", cap_s=150, floor_s=40),
        budget.StageSpec("offload", cap_s=90, floor_s=30),
        budget.StageSpec("crash", cap_s=90, floor_s=40, required=False),
    )
}


class PreflightError(Exception):
    """The machine cannot run the check; the message says why.

    ``no_gpu``: there is no usable GPU (exit status 2), rather than a package the check lacks
    (exit status 1: install it, or give the install stage wheels to install it from).
    """

    def __init__(self, message: str, *, no_gpu: bool = True) -> None:
        super().__init__(message)
        self.no_gpu = no_gpu


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


# --- cuda-python and the driver (the cuda stage; the pytest checks use it too) ---------------


def preflight(timeout: float = 15.0) -> dict[str, Any]:
    """What GPU 0 is; raises :class:`PreflightError` when there is no usable GPU."""
    workload.bootstrap()
    try:
        from timesliced.nvml import Nvml
    except ImportError as exc:
        raise PreflightError(
            f"timesliced cannot be imported ({exc}): pip install -e '.[cuda,test]' first", no_gpu=False
        ) from None

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
        raise PreflightError(f"cuda-python is not installed (pip install -e '.[cuda]'): {exc}", no_gpu=False) from None

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


# --- the GPU's processes --------------------------------------------------------------------


def gpu_processes(timeout: float = 10.0) -> dict[int, int]:
    """pid -> bytes (over every GPU) of the processes NVML lists; raises when NVML cannot say."""
    from timesliced.nvml import Nvml

    def query() -> dict[int, int]:
        with contextlib.closing(Nvml.open()) as nvml:
            if not nvml.available:
                raise RuntimeError(f"NVML: {nvml.reason}")
            return {pid: sum(per_gpu.values()) for pid, per_gpu in nvml.process_memory().items()}

    return call_with_timeout(query, timeout, "NVML's process list")


def describe_pids(pids: dict[int, int]) -> list[dict[str, Any]]:
    """Each PID with its bytes and, where this PID namespace has it, its command line."""
    out = []
    for pid, nbytes in sorted(pids.items()):
        try:
            cmdline = (procs.PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = None
        out.append({"pid": pid, "bytes": nbytes, "cmdline": cmdline.strip() if cmdline else None})
    return out


def left_behind(at_start: dict[int, int], wait: float = 8.0) -> str | None:
    """Why the GPU is not as the check found it (new processes on it), or None; NVML may trail a few seconds."""
    end = time.monotonic() + wait
    while True:
        try:
            now = gpu_processes(5.0)
        except Exception as exc:
            return f"could not check that the GPU is empty again: {exc}"
        new = {pid: n for pid, n in now.items() if pid not in at_start}
        if not new:
            return None
        if time.monotonic() > end:
            return (
                f"NVML still lists processes that were not on the GPU when the check started: {describe_pids(new)}; "
                "kill them before a rerun"
            )
        time.sleep(0.5)


def pid_blind(pids: list[int], visible: list[int], whose: str) -> str:
    """The reason the cuda-checkpoint stage ends early when NVML cannot see this PID namespace's processes."""
    return (
        f"NVML does not list {whose} ({', '.join(map(str, pids))}) among the GPU's processes "
        f"(it lists {', '.join(map(str, visible)) or 'none'}): the check runs in a PID namespace other than the "
        "driver's (a container without the host's PID namespace), so the daemon cannot find its jobs' processes "
        "to checkpoint them. Run the check with the host's PID namespace (docker run --pid=host; hostPID: true "
        "in Kubernetes) to test cuda-checkpoint"
    )


# --- children -------------------------------------------------------------------------------


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


def last_json(path: Path) -> dict[str, Any] | None:
    """The last line of ``path`` as a JSON object, or None."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        data = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def spawned(
    argv: list[str],
    out: Path,
    err: Path | None = None,
    grace: float = 10.0,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own process group, its output in files (``err`` None: with stdout); the group is stopped after."""
    with contextlib.ExitStack() as files:
        stdout = files.enter_context(out.open("wb"))
        stderr: Any = files.enter_context(err.open("wb")) if err is not None else subprocess.STDOUT
        proc = CHILDREN.spawn(argv, stdout=stdout, stderr=stderr, cwd=REPO, env={**child_env(), **(env or {})})
    try:
        yield proc
    finally:
        stop(proc, grace)


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds, and reap the child."""
    CHILDREN.stop(proc, grace)


def run_child(
    argv: list[str], *, timeout: float, out: Path, err: Path | None = None, env: dict[str, str] | None = None
) -> tuple[int | None, bool]:
    """(exit status, whether it ran past ``timeout`` and was killed) of a child run to its end."""
    with spawned(argv, out, err, grace=3.0, env=env) as proc:
        try:
            return proc.wait(timeout), False
        except subprocess.TimeoutExpired:
            return None, True


def pip_runner(workdir: Path) -> install.Runner:
    """install.ensure's runner: pip as a child of this check, so a signal or the deadline stops it too."""

    def run(argv: list[str], timeout: float) -> tuple[int, str]:
        log = workdir / "pip.log"
        rc, timed_out = run_child(argv, timeout=timeout, out=log)
        text = tail(log, 40)
        if timed_out:
            return 124, f"{text}\n(pip did not finish within {timeout:.0f}s and was killed)"
        return (rc if rc is not None else 1), text

    return run


# --- one backend ----------------------------------------------------------------------------


class BackendRun:
    """One backend's daemon, its two jobs and what was seen of them.

    ``plan``: the jobs plan their rounds with this run (``workload.py --plan-dir``):
    the first restored turn is measured and :func:`budget.plan_rounds` decides
    how many rounds fit what is left of ``timeout``. ``host_memory`` (GB/s, 0:
    unlimited; offload only): the jobs keep their "device" memory in host
    buffers, for the check's own tests on a machine without a GPU.
    """

    def __init__(
        self,
        backend: str,
        workdir: Path,
        progress: Progress,
        crash_at: str | None = None,
        plan: bool = False,
        host_memory: float | None = None,
    ) -> None:
        self.backend = backend
        self.host_memory = host_memory
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
        self.plan_dir = workdir / "plan" if plan else None
        self.plan: dict[str, Any] | None = None
        self.pids_checked = False

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

    def maybe_plan(self, rounds: int, deadline: float) -> None:
        """Once a job announced its first restored turn: plan the rounds from it and let the jobs go on."""
        if self.plan is not None or self.plan_dir is None:
            return
        first = workload.read_json(self.plan_dir / workload.FIRST_TURN)
        if first is None:
            return
        turn = budget.FirstTurn(
            round=int(first["round"]),
            switch_s=float(first["switch_s"]),
            work_s=float(first.get("verify_s", 0.0)) + float(first.get("fill_s", 0.0)),
        )
        plan = budget.plan_rounds(turn, asked=rounds, left_s=deadline - time.monotonic())
        self.plan = {**plan.to_dict(), "first_switch_s": turn.switch_s, "first_turn": first}
        if not workload.write_once(self.plan_dir / workload.PLAN, {"rounds": plan.rounds, "why": plan.why}):
            self.plan["note"] = "the job had stopped waiting and wrote the plan itself: " + json.dumps(
                workload.read_json(self.plan_dir / workload.PLAN)
            )
        self.progress(
            f"{self.backend}: first switch {turn.switch_s:.2f}s (turn {turn.switch_s + turn.work_s:.2f}s); "
            f"{plan.rounds} of {rounds} rounds: {plan.why}"
        )

    def unseen_pids(self, jobs: dict[str, subprocess.Popen[bytes]]) -> str | None:
        """cuda-checkpoint: the first snapshot moved nothing and NVML does not list the jobs: why, else None."""
        if self.pids_checked:
            return None
        snapshots = [m for m in self.moves.values() if m["kind"] == "snapshot"]
        if not snapshots:
            return None
        self.pids_checked = True
        if any(int(m["nbytes"]) > 0 for m in snapshots):
            return None
        try:
            visible = gpu_processes(5.0)
        except Exception:
            return None  # cannot tell: the run goes on, and its figures will say
        pids = sorted(p.pid for p in jobs.values())
        if set(pids) & set(visible):
            return None
        return pid_blind(pids, sorted(visible), "the jobs' PIDs")

    def run(self, *, gib: float, rounds: int, torch: str, timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + timeout
        reports: dict[str, dict[str, Any]] = {}
        if self.plan_dir is not None:
            self.plan_dir.mkdir(exist_ok=True)
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
                return self.result(reports, rounds, rounds, started)
            if not self.check_parking():
                return self.result(reports, rounds, rounds, started)  # nothing to learn from jobs it cannot park
            self.progress(f"{self.backend}: daemon up; two jobs of {gib:g} GiB, at most {rounds} turns each")
            with contextlib.ExitStack() as stack:
                jobs = {
                    job: stack.enter_context(
                        spawned(
                            self.workload_argv(job, gib, rounds, torch, deadline - time.monotonic()),
                            self.workdir / f"{job}.out",
                            self.workdir / f"{job}.err",
                            grace=3.0,
                        )
                    )
                    for job in JOBS
                }
                while any(p.poll() is None for p in jobs.values()):
                    self.maybe_plan(rounds, deadline)
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
                    if self.backend == "cuda-checkpoint":
                        why = self.unseen_pids(jobs)
                        if why:
                            self.errors.append(f"ended early: {why}")
                            break
                    time.sleep(0.1)
                if daemon.poll() is None:
                    with contextlib.suppress(Exception):
                        self.poll()
            for job in JOBS:
                reports[job] = self.read_report(job)
        if self.errors or any(not r.get("ok") for r in reports.values()):
            self.notes.append("daemon log tail:\n" + tail(log))
        planned = rounds
        if self.plan_dir is not None:
            planned = workload.planned_rounds(self.plan_dir, rounds) or rounds
        return self.result(reports, planned, rounds, started)

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

    def workload_argv(self, job: str, gib: float, rounds: int, torch: str, timeout: float) -> list[str]:
        argv = [
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
            # Nothing in a job waits longer than the run may last.
            "--start-timeout",
            f"{min(60.0, max(timeout, 1.0)):.0f}",
            "--acquire-timeout",
            f"{max(timeout, 1.0):.0f}",
            "--end-timeout",
            f"{max(timeout, 1.0):.0f}",
        ]
        if self.plan_dir is not None:
            argv += ["--plan-dir", str(self.plan_dir)]
        if self.host_memory is not None:
            argv += ["--host-memory", "--host-bandwidth", repr(self.host_memory)]
        return argv

    def check_parking(self) -> bool:
        """Whether the daemon can park with this backend on a real GPU; errors that say why not."""
        methods = self.parking.get("methods") or {}
        if methods.get(self.backend) != "available":
            self.errors.append(f"ended early: the daemon cannot park with {self.backend}: {methods.get(self.backend)}")
        if self.parking.get("device_source") != "nvml" and self.host_memory is None:
            self.errors.append("ended early: the daemon simulates its GPUs: it found no usable GPU through NVML")
        return not self.errors

    def read_report(self, job: str) -> dict[str, Any]:
        report = last_json(self.workdir / f"{job}.out")
        if report is None:
            stderr = tail(self.workdir / f"{job}.err", 8)
            return {"job": job, "ok": False, "errors": [f"no report from the job; its stderr: {stderr}"]}
        return report

    def result(self, reports: dict[str, dict[str, Any]], rounds: int, asked: int, started: float) -> dict[str, Any]:
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
        report["rounds_asked"] = asked
        if self.plan_dir is not None:
            report["plan"] = self.plan
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
    plan: bool = False,
    workdir: Path | None = None,
    host_memory: float | None = None,
) -> dict[str, Any]:
    """Run ``backend`` with two jobs of ``gib`` GiB taking ``rounds`` turns each; its report (see README.md).

    ``crash_at`` (a point of ``$TIMESLICED_CRASH_AT``): the daemon kills itself with SIGKILL there once,
    and a new one is started on the same state dir; the jobs must reconnect and lose nothing.
    ``plan``: ``rounds`` is the most; the run takes as many as fit ``timeout`` after its first switch.
    ``workdir``: where the logs go (a new temporary folder, removed unless ``keep``, by default).
    ``host_memory``: see :class:`BackendRun` (no GPU; the check's own tests).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    workload.bootstrap()
    own = workdir is None
    folder = Path(tempfile.mkdtemp(prefix=f"tsgpu-{backend}-")) if workdir is None else workdir
    folder.mkdir(parents=True, exist_ok=True)
    try:
        run = BackendRun(backend, folder, progress, crash_at, plan, host_memory)
        result = run.run(gib=gib, rounds=rounds, torch=torch, timeout=timeout)
    finally:
        if own and not keep:
            shutil.rmtree(folder, ignore_errors=True)
    if keep:
        result["logs"] = str(folder)
    return result


# --- figures ----------------------------------------------------------------------------------


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


def bandwidth(ceiling: dict[str, Any] | None, backends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ceiling next to what each parking method achieved, in GB/s (10^9 bytes/s)."""
    methods: dict[str, Any] = {}
    for name, report in backends.items():
        d2h, h2d = report.get("d2h") or {}, report.get("h2d") or {}
        methods[name] = {
            "d2h_gbps_p50": d2h.get("gbps_p50"),
            "d2h_gbps_max": d2h.get("gbps_max"),
            "d2h_of_ceiling": d2h.get("of_ceiling"),
            "h2d_gbps_p50": h2d.get("gbps_p50"),
            "h2d_gbps_max": h2d.get("gbps_max"),
            "h2d_of_ceiling": h2d.get("of_ceiling"),
            "bytes_per_move": max(d2h.get("bytes_per_move") or 0, h2d.get("bytes_per_move") or 0),
        }
    top = None
    if ceiling:
        top = {k: ceiling.get(k) for k in ("h2d_gbps", "d2h_gbps", "bidir_gbps", "bidir_h2d_gbps", "bidir_d2h_gbps")}
    return {"unit": "GB/s (1e9 bytes/s)", "ceiling": top, "methods": methods}


# --- the whole check ------------------------------------------------------------------------


def default_deadline() -> float:
    text = os.environ.get(DEADLINE_ENV)
    try:
        return float(text) if text else budget.DEFAULT_DEADLINE_S
    except ValueError:
        raise SystemExit(f"check.py: ${DEADLINE_ENV} must be a number of seconds, not {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Run timesliced's real parking backends on this machine's GPU 0.")
    p.add_argument("--gib", type=float, default=4.0, help="device memory per job (GiB, default 4)")
    p.add_argument("--rounds", type=int, default=10, help="turns each job takes at most, each verified (default 10)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated (default {','.join(BACKENDS)})")
    p.add_argument("--torch", choices=["auto", "on", "off"], default="auto", help="a torch tensor in each job")
    p.add_argument(
        "--deadline",
        type=float,
        default=default_deadline(),
        help=f"seconds for the whole check (default ${DEADLINE_ENV} or {budget.DEFAULT_DEADLINE_S:.0f})",
    )
    p.add_argument("--backend-timeout", type=float, default=None, help="seconds per backend at most (default 150)")
    p.add_argument("--keep", action="store_true", help="keep the daemon and job logs (their folder is reported)")
    p.add_argument(
        "--crash-at",
        default="before-restore",
        metavar="POINT",
        help="the crash stage: the daemon kills itself with SIGKILL at this step of a switch once (default "
        "before-restore) and is started again; the jobs must lose nothing. 'off': no crash stage",
    )
    p.add_argument("--crash-gib", type=float, default=0.25, help="device memory per job in the crash stage")
    p.add_argument("--ceiling-mib", type=int, default=1024, help="the ceiling's buffer (MiB, default 1024)")
    p.add_argument("--no-pytest", dest="pytest", action="store_false", help="leave out the quick pytest checks")
    p.add_argument("--no-install", dest="install", action="store_false", help="install nothing; report what lacks")
    p.add_argument("--json", action="store_true", help="print only the JSON object, on one line")
    return p


def as_interrupt(signum: int, frame: Any) -> None:
    """A signal handler that raises ``KeyboardInterrupt``, so ``finally`` blocks stop the child processes."""
    raise KeyboardInterrupt(f"signal {signum}")


class Check:
    """The stages, in order, on one :class:`runner.Run`."""

    def __init__(self, run: runner.Run, args: argparse.Namespace, backends: list[str], workdir: Path) -> None:
        self.run = run
        self.args = args
        self.backends = backends
        self.workdir = workdir
        self.driver: install.DriverInfo | None = None
        self.install_error: str | None = None  # why the install stage failed, if it did
        self.crash_backend = self.pick_crash_backend()

    def pick_crash_backend(self) -> str | None:
        if self.args.crash_at == "off":
            return None
        return "cuda-checkpoint" if "cuda-checkpoint" in self.backends else self.backends[0]

    def spec(self, name: str) -> budget.StageSpec:
        spec = STAGES[name]
        if name in BACKENDS and self.args.backend_timeout is not None:
            spec = budget.StageSpec(name, self.args.backend_timeout, min(spec.floor_s, self.args.backend_timeout))
        return spec

    def later(self, name: str) -> list[budget.StageSpec]:
        names = self.run.planned
        return [self.spec(n) for n in names[names.index(name) + 1 :] if n in STAGES]

    def slot(self, name: str, floor_s: float | None = None) -> float | None:
        """The stage's slot, or None after recording it as not run."""
        spec = self.spec(name)
        got = self.run.slot(spec, self.later(name), floor_s=floor_s)
        if got.seconds is None:
            self.run.skip(name, got.why, required=spec.required)
        return got.seconds

    def all(self) -> None:
        self.preflight()
        self.install()
        self.cuda()
        if self.args.pytest:
            self.pytest()
        self.ceiling()
        for backend in self.backends:
            self.backend(backend)
        if self.crash_backend is not None:
            self.crash()
        report = self.run.report
        report["bandwidth"] = bandwidth(report.get("ceiling"), report["backends"])

    # --- the stages -------------------------------------------------------------------------

    def preflight(self) -> None:
        with self.run.stage("preflight", budget_s=self.spec("preflight").cap_s) as entry:
            leftovers = procs.orphans()
            if leftovers:
                entry["killed_leftovers"] = procs.kill_pids(sorted(leftovers))
                entry["notes"] = [f"killed processes an earlier run of the check left behind: {sorted(leftovers)}"]
            try:
                self.driver = install.read_driver(timeout=8.0)  # NVML, then nvidia-smi twice: 24 s at worst
            except install.NoDriver as exc:
                raise runner.Abort(f"no GPU: {exc}", code=2) from None
            entry.update(self.driver.to_dict())

    def install(self) -> None:
        assert self.driver is not None
        seconds = self.slot("install")
        if seconds is None:
            return
        with self.run.stage("install", budget_s=seconds) as entry:
            got = install.ensure(
                self.driver, timeout=seconds, run=pip_runner(self.workdir), allow_install=self.args.install
            )
            ok, error = got.pop("ok"), got.pop("error")
            entry.update(got)
            if not ok:
                self.install_error = error
                raise runner.StageFailed(error)

    def cuda(self) -> None:
        with self.run.stage("cuda", budget_s=self.spec("cuda").cap_s) as entry:
            try:
                gpu = preflight()
            except PreflightError as exc:
                if exc.no_gpu:
                    raise runner.Abort(str(exc), code=2) from None
                why = f"; the install stage failed: {self.install_error}" if self.install_error else ""
                raise runner.Abort(f"{exc}{why}", code=1) from None
            self.run.report["gpu"] = gpu
            entry.update(name=gpu["name"], cuda_python=gpu["cuda_python"], checkpoint_api=gpu["checkpoint_api"])
            try:
                at_start = gpu_processes()
            except Exception as exc:
                entry["notes"] = [f"NVML could not list the GPU's processes, so the cleanup cannot check them: {exc}"]
                return
            gpu["processes_at_start"] = describe_pids(at_start)
            if at_start:
                entry["notes"] = [
                    f"the GPU was not empty at the start: {gpu['processes_at_start']}; figures may suffer, and the "
                    "check may run out of memory"
                ]
            self.run.gpu_check = lambda: left_behind(at_start)

    def pytest(self) -> None:
        seconds = self.slot("pytest")
        if seconds is None:
            return
        with self.run.stage("pytest", budget_s=seconds) as entry:
            if not install.importable("pytest"):
                raise runner.StageFailed("pytest is not installed (the install stage says why)")
            argv = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider"]
            argv += ["-k", PYTEST_SELECTION]
            log = self.workdir / "pytest.log"
            rc, timed_out = run_child(argv, timeout=seconds, out=log, env={"TIMESLICED_GPU_TESTS": "1"})
            lines = [line for line in tail(log, 200).splitlines() if line.strip()]
            entry["summary"] = lines[-1] if lines else ""
            skipped = [line for line in lines if line.startswith("SKIPPED")]
            if skipped:
                entry["skipped_tests"] = skipped
            if timed_out:
                raise runner.StageFailed(f"pytest did not finish within {seconds:.0f}s and was killed")
            if rc != 0:
                entry["tail"] = "\n".join(lines[-30:])
                raise runner.StageFailed(f"pytest failed (exit status {rc}): {entry['summary']}")

    def ceiling(self) -> None:
        seconds = self.slot("ceiling")
        if seconds is None:
            return
        with self.run.stage("ceiling", budget_s=seconds) as entry:
            argv = [sys.executable, str(CEILING), "--mib", str(self.args.ceiling_mib)]
            out, err = self.workdir / "ceiling.out", self.workdir / "ceiling.err"
            rc, timed_out = run_child(argv, timeout=seconds, out=out, err=err)
            if timed_out:
                raise runner.StageFailed(f"the measurement did not finish within {seconds:.0f}s and was killed")
            got = last_json(out)
            if got is None:
                raise runner.StageFailed(f"ceiling.py gave no result (exit status {rc}): {tail(err, 8)}")
            if not got.get("ok"):
                raise runner.StageFailed(str(got.get("error")))
            self.run.report["ceiling"] = got
            seen = got.get("nvml_sees_own_pid") or {}
            entry.update(
                {k: got.get(k) for k in ("h2d_gbps", "d2h_gbps", "bidir_gbps")}, nvml_sees_own_pid=seen.get("ok")
            )

    def backend(self, name: str) -> None:
        seconds = self.slot(name)
        if seconds is None:
            self.run.report["backends"][name] = {"ok": False, "errors": [self.run.report["stages"][name]["error"]]}
            return
        with self.run.stage(name, budget_s=seconds) as entry:
            why = self.cannot_checkpoint() if name == "cuda-checkpoint" else None
            if why is not None:
                self.run.report["backends"][name] = {"ok": False, "errors": [why]}
                raise runner.StageFailed(why)
            if name == "cuda-checkpoint" and (note := self.nvml_blind()):
                entry["notes"] = [note]
            report = run_backend(
                name,
                gib=self.args.gib,
                rounds=self.args.rounds,
                torch=self.args.torch,
                timeout=seconds,
                keep=self.args.keep,
                progress=self.run.progress,
                plan=True,
                workdir=self.workdir / name,
            )
            if self.run.report.get("ceiling"):
                against_ceiling(report, self.run.report["ceiling"])
            self.run.report["backends"][name] = report
            entry.update(
                rounds=report["rounds"], rounds_asked=report["rounds_asked"], data_errors=report["data_errors"]
            )
            if report.get("plan"):
                entry["plan"] = {k: report["plan"][k] for k in ("first_switch_s", "turn_s", "why")}
            if not report["ok"]:
                raise runner.StageFailed(_errors_text(report))

    def cannot_checkpoint(self) -> str | None:
        """Why the cuda-checkpoint stage cannot do anything here, found before it starts a daemon; None if not known."""
        api = (self.run.report.get("gpu") or {}).get("checkpoint_api")
        if api not in (None, "ok"):
            return f"ended early: the driver's checkpoint API cannot run here: {api}"
        return None

    def nvml_blind(self) -> str | None:
        """A note when NVML does not list the ceiling probe's PID; the stage runs all the same.

        The backend finds a job's processes through the driver (``cuCheckpointProcessGetState`` on
        the job's PIDs and their children), not through NVML; where NVML's PIDs are not this
        namespace's, or NVML lists none of the job's, it measures footprints from each GPU's used
        memory across the checkpoint instead of NVML's per-process figures.
        """
        seen = (self.run.report.get("ceiling") or {}).get("nvml_sees_own_pid") or {}
        if seen.get("ok") is not False:
            return None
        listed = ", ".join(map(str, seen.get("nvml_pids", []))) or "none"
        return (
            f"NVML does not list the probe's PID {seen['pid']} among the GPU's processes (it lists {listed}): "
            "footprints come from each GPU's used memory across a checkpoint, not NVML's per-process figures"
        )

    def crash(self) -> None:
        name = self.crash_backend
        assert name is not None
        main = self.run.report["stages"].get(name) or {}
        if main.get("ok") is False:
            self.run.skip("crash", f"the {name} stage failed", required=False)
            return
        turn_s = ((self.run.report["backends"].get(name) or {}).get("plan") or {}).get("turn_s")
        floor = budget.crash_floor(turn_s, default_s=STAGES["crash"].floor_s)
        seconds = self.slot("crash", floor_s=floor)
        if seconds is None:
            return
        with self.run.stage("crash", budget_s=seconds) as entry:
            report = run_backend(
                name,
                gib=self.args.crash_gib,
                rounds=3,
                torch="off",
                timeout=seconds,
                keep=self.args.keep,
                progress=self.run.progress,
                crash_at=self.args.crash_at,
                plan=True,
                workdir=self.workdir / "crash",
            )
            self.run.report["crash"] = report
            entry.update(
                backend=name, crash_at=self.args.crash_at, restarts=report["restarts"], rounds=report["rounds"]
            )
            if report["restarts"] != 1:
                report["ok"] = False
                report["errors"].append(f"the daemon was restarted {report['restarts']} times, not once")
            if not report["ok"]:
                raise runner.StageFailed(_errors_text(report))


def _errors_text(report: dict[str, Any]) -> str:
    errors = list(report.get("errors") or [])
    if report.get("data_errors"):
        errors.append(f"{report['data_errors']} chunks did not hold what their job wrote")
    if not errors:
        errors = ["a job failed (see backends.*.jobs)"]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(errors[:3]) + more


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        raise SystemExit(f"check.py: unknown backends {unknown} (choose from {', '.join(BACKENDS)})")
    if args.gib <= 0 or args.rounds < 1 or args.deadline <= 0:
        raise SystemExit("check.py: --gib, --rounds and --deadline must be positive")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's GPU 0 is NVML's GPU 0
    stages = ["preflight", "install", "cuda", *(["pytest"] if args.pytest else []), "ceiling", *backends]
    if args.crash_at != "off":
        stages.append("crash")

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    run = runner.Run(
        deadline_s=args.deadline,
        children=CHILDREN,
        stages=stages,
        compact=args.json,
        progress=None if args.json else progress,
    )
    workdir = Path(tempfile.mkdtemp(prefix="tsgpu-"))
    run.report.update(
        config={
            "gib": args.gib,
            "rounds": args.rounds,
            "torch": args.torch,
            "backends": backends,
            "deadline_s": args.deadline,
            "crash_at": args.crash_at,
            "python": sys.executable,
        },
        gpu=None,
        ceiling=None,
        backends={},
        bandwidth=None,
        not_run=dict(NOT_RUN),
    )
    if args.keep:
        run.report["logs"] = str(workdir)
    else:
        run.at_exit.append(lambda: shutil.rmtree(workdir, ignore_errors=True))  # the watchdog's way out too
    try:
        return run.execute(lambda r: Check(r, args, backends, workdir).all())
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
