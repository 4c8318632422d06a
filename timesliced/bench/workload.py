"""``timesliced bench workload``: the published experiment's shape, for real on the simulated GPU.

Two synchronous RL jobs and one SFT job (``scenario.py``, from a TOML file) run as real client
processes on a real daemon process (``serve --backend sim``) with checked bytes, in four modes
(``MODES``): ``dedicated`` (a GPU per worker), ``serial`` (one job after another on the two
shared GPUs), ``reference`` (time-sliced, parking on every handoff, no prefetch) and
``timesliced`` (the daemon as it is). A fifth, ``anticipating`` (``--modes`` names it), is the
daemon with switch-cost awareness (``--anticipate``). Each mode gets a fresh daemon.

How the jobs map onto the daemon: every worker process is a registered job of its own, since a
job belongs to one group. An RL job ``rl-a`` is ``rl-a-sampler`` (group ``sampler``, the sampler
GPU) and ``rl-a-trainer`` (group ``trainer``, the trainer GPU); the SFT job ``sft`` is
``sft-trainer`` in ``trainer``. The two processes of an RL job talk over a socket pair: the
sampler sends each rollout's batch, the trainer trains on it and then syncs the weights, which
needs both GPUs: the trainer process holds its own lock and the sampler job's lock (through a
second session of the sampler job, ``hold_both``), hands the weights over the socket, and the
sampler process writes them into its device memory while its job is held.

Checked bytes: every worker writes known contents into its simulated regions after each phase
and compares them with what it finds at the start of the next (after whatever restore happened
between); the batch and the weights are compared on arrival. A mismatch is a data error. Each
worker records its slices (GPU, job, start, end) so that overlaps of two jobs on a GPU are
counted, and the grants' waits and switch times.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..util.stats import median
from .common import DaemonProcess
from .scenario import Job, Scenario

log = logging.getLogger(__name__)

BATCH = 64 << 10  # bytes of one rollout batch handed from the sampler to the trainer
TRAINER, SAMPLER = "trainer", "sampler"


# --- the modes: a small table of daemon and client options ------------------------------------


@dataclass(frozen=True)
class Mode:
    """How one mode runs: where the workers go, whether jobs run one after another, and options.

    ``daemon_flags`` are passed to ``serve``; ``declare_memory``: each worker registers the memory
    it will hold (``memory=``), so jobs that fit stay resident together.
    """

    name: str
    placement: str  # "dedicated": a GPU (and group) per worker; "shared": a trainer GPU and a sampler GPU
    serial: bool  # jobs one after another
    daemon_flags: tuple[str, ...] = ()
    declare_memory: bool = False
    about: str = ""
    default: bool = True  # run when no ``--modes`` are named


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("dedicated", "dedicated", False, about="a GPU per worker process, nothing shared"),
        Mode("serial", "shared", True, about="the jobs one after another on the two GPUs"),
        Mode(
            "reference",
            "shared",
            False,
            daemon_flags=("--park-every-handoff", "--no-prefetch"),
            about="time-sliced FIFO that parks on every handoff, no prefetch",
        ),
        Mode("timesliced", "shared", False, declare_memory=True, about="the daemon as it is, memory declared"),
        Mode(
            "anticipating",
            "shared",
            False,
            daemon_flags=("--anticipate", "5"),
            declare_memory=True,
            about="the daemon with switch-cost awareness (--anticipate 5), memory declared",
            default=False,
        ),
    )
}


def placement(scenario: Scenario, mode: Mode) -> tuple[int, dict[str, tuple[str, int]]]:
    """The daemon's GPU count and, per worker (``JOB-ROLE``), its group and GPU."""
    workers = [f"{j.name}-{role}" for j in scenario.jobs for role in j.workers]
    if mode.placement == "dedicated":
        return len(workers), {w: (w, i) for i, w in enumerate(workers)}
    shared = {TRAINER: (TRAINER, 0), SAMPLER: (SAMPLER, 1)}
    return 2, {w: shared[w.rsplit("-", 1)[1]] for w in workers}


# --- checked contents -----------------------------------------------------------------------


def contents(tag: str, version: int, nbytes: int) -> bytes:
    """What a region tagged ``tag`` holds at ``version``: a pattern naming both, repeated."""
    p = f"{tag}@{version}|".encode()
    return (p * (nbytes // len(p) + 1))[:nbytes]


class Checked:
    """A simulated region with the contents it must hold."""

    def __init__(self, region: Any, tag: str) -> None:
        self.region, self.tag = region, tag
        self.expected = b""
        self._scratch = bytearray(region.nbytes)

    def put(self, data: bytes) -> None:
        self.region.write(data)
        self.expected = data

    def write(self, version: int) -> None:
        self.put(contents(self.tag, version, self.region.nbytes))

    def intact(self) -> bool:
        self.region.readinto(self._scratch)
        return self._scratch == self.expected


# --- the pipe between an RL job's two processes ---------------------------------------------


def send(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(struct.pack("!II", len(head), len(payload)) + head + payload)


def receive(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    n_head, n_payload = struct.unpack("!II", _exactly(sock, 8))
    header: dict[str, Any] = json.loads(_exactly(sock, n_head))
    return header, _exactly(sock, n_payload)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the other process of the job went away")
        buf += chunk
    return bytes(buf)


# --- the worker process ----------------------------------------------------------------------


class Recorder:
    """A worker's record: its slices per GPU, its grants and its data errors."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.grants: list[dict[str, float]] = []
        self.data_errors = 0
        self.error_notes: list[str] = []

    def grant(self, g: Any) -> None:
        self.grants.append({"waited_s": g.waited_s, "switch_s": g.switch_s, "restored": g.restored})

    def span(self, job: str, gpu: int, phase: str, start: float, end: float) -> None:
        self.spans.append({"job": job, "gpu": gpu, "phase": phase, "start": start, "end": end})

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.data_errors += 1
            if len(self.error_notes) < 5:
                self.error_notes.append(what)


def work(seconds: float, since: float) -> None:
    """The rest of a GPU (or CPU) phase begun at ``since``."""
    left = seconds - (time.monotonic() - since)
    if left > 0:
        time.sleep(left)


@contextmanager
def hold_both(trainer: Any, sampler: Any, rec: Recorder) -> Iterator[None]:
    """The weight sync's hold on the trainer's and the sampler's GPUs at once: a gang acquire, so
    both are granted in one step and neither GPU is held idle while the other is awaited."""
    from ..client.gang import gang

    with gang(trainer, sampler) as grants:
        for g in grants:
            rec.grant(g)
        yield


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One worker process: registers, says ``ready``, waits for ``go`` on stdin, runs its role."""
    from ..client import Client

    job = Job(**spec["job"])
    role: str = spec["role"]
    spm: float = spec["seconds_per_minute"]
    sizes: dict[str, int] = spec["sizes"]
    groups: dict[str, list[Any]] = spec["groups"]
    memory_kw: bool = spec["declare_memory"]
    rec = Recorder()

    def client(worker_role: str) -> Any:
        group, gpu = groups[worker_role]
        kwargs: dict[str, Any] = {}
        if memory_kw:  # the memory the worker will hold, where the client lets it be declared
            kwargs["memory"] = {gpu: sizes[worker_role]}
        return Client(job=f"{job.name}-{worker_role}", group=group, gpus=[gpu], address=spec["address"], **kwargs)

    pair = socket.socket(fileno=spec["fd"]) if spec.get("fd") is not None else None
    with ExitStack() as stack:
        own = stack.enter_context(client(role))
        peer = stack.enter_context(client(SAMPLER)) if job.kind == "rl" and role == TRAINER else None
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the driver went away before the start")
        started = time.monotonic()
        if job.kind == "sft":
            regions = _sft(job, own, groups[TRAINER][1], sizes, spm, rec)
        elif role == SAMPLER:
            assert pair is not None
            regions = _sampler(job, own, groups[SAMPLER][1], sizes, spm, pair, rec)
        else:
            assert pair is not None and peer is not None
            regions = _trainer(job, own, peer, groups, sizes, spm, pair, rec)
        finished = time.monotonic()
        # Freed inside a slice (where nobody moves the job's state: outside one a prefetch or a switch
        # may be moving it), so that the next job of a serial run finds the memory free.
        with own.slice():
            for r in regions:
                own.sim_free(r.region)
    return {
        "worker": f"{job.name}-{role}",
        "job": job.name,
        "started": started,
        "finished": finished,
        "spans": rec.spans,
        "grants": rec.grants,
        "data_errors": rec.data_errors,
        "error_notes": rec.error_notes,
    }


def _sft(job: Job, client: Any, gpu: int, sizes: dict[str, int], spm: float, rec: Recorder) -> list[Checked]:
    name = f"{job.name}-{TRAINER}"
    state: Checked | None = None
    for step in range(job.iterations):
        with client.slice() as g:
            t0 = time.monotonic()
            rec.grant(g)
            if state is None:
                state = Checked(client.sim_alloc(sizes[TRAINER], gpu=gpu), f"{name}/state")
            else:
                rec.check(state.intact(), f"{name}: state before step {step}")
            state.write(step + 1)
            work(job.train_min * spm, t0)
            t1 = time.monotonic()
        rec.span(name, gpu, "train", t0, t1)
        work(job.load_min * spm, time.monotonic())
    return [state] if state is not None else []


def _sampler(
    job: Job, client: Any, gpu: int, sizes: dict[str, int], spm: float, pair: socket.socket, rec: Recorder
) -> list[Checked]:
    name = f"{job.name}-{SAMPLER}"
    weights: Checked | None = None
    kv: Checked | None = None
    for it in range(job.iterations):
        with client.slice() as g:
            t0 = time.monotonic()
            rec.grant(g)
            if weights is None or kv is None:
                weights = Checked(client.sim_alloc(sizes["weights"], gpu=gpu), f"{job.name}/weights")
                kv = Checked(client.sim_alloc(sizes[SAMPLER] - sizes["weights"], gpu=gpu), f"{name}/kv")
                weights.write(0)
            else:
                rec.check(weights.intact(), f"{name}: weights before rollout {it}")
                rec.check(kv.intact(), f"{name}: KV cache before rollout {it}")
            kv.write(it)
            batch = contents(f"{job.name}/batch", it, BATCH)
            work(job.rollout_min * spm, t0)
            t1 = time.monotonic()
        rec.span(name, gpu, "rollout", t0, t1)
        work(job.reward_min * spm, time.monotonic())  # the reward, on the CPU
        send(pair, {"batch": it}, batch)
        header, data = receive(pair)  # the trainer holds both GPUs now: write the new weights
        rec.check(data == contents(f"{job.name}/weights", it + 1, len(data)), f"{name}: weights {it + 1} received")
        weights.put(data)
        rec.check(weights.intact(), f"{name}: weights {it + 1} written")
        send(pair, {"synced": header["weights"]})
        receive(pair)  # the sync's end: the next rollout starts after it, as in synchronous RL
    return [r for r in (weights, kv) if r is not None]


def _trainer(
    job: Job,
    client: Any,
    peer: Any,
    groups: dict[str, list[Any]],
    sizes: dict[str, int],
    spm: float,
    pair: socket.socket,
    rec: Recorder,
) -> list[Checked]:
    name, sampler_job = f"{job.name}-{TRAINER}", f"{job.name}-{SAMPLER}"
    gpu, sampler_gpu = groups[TRAINER][1], groups[SAMPLER][1]
    weights: Checked | None = None
    optim: Checked | None = None
    for it in range(job.iterations):
        header, batch = receive(pair)
        rec.check(header.get("batch") == it and batch == contents(f"{job.name}/batch", it, BATCH), f"batch {it}")
        with client.slice() as g:
            t0 = time.monotonic()
            rec.grant(g)
            if weights is None or optim is None:
                weights = Checked(client.sim_alloc(sizes["weights"], gpu=gpu), f"{job.name}/weights")
                optim = Checked(client.sim_alloc(sizes[TRAINER] - sizes["weights"], gpu=gpu), f"{name}/optim")
            else:
                rec.check(weights.intact(), f"{name}: weights before train {it}")
                rec.check(optim.intact(), f"{name}: optimizer state before train {it}")
            weights.write(it + 1)
            optim.write(it + 1)
            work(job.train_min * spm, t0)
            t1 = time.monotonic()
        rec.span(name, gpu, "train", t0, t1)
        with hold_both(client, peer, rec):
            t0 = time.monotonic()
            rec.check(weights.intact(), f"{name}: weights before sync {it}")
            send(pair, {"weights": it + 1}, weights.region.read())
            answer, _ = receive(pair)
            rec.check(answer.get("synced") == it + 1, f"{name}: sync {it} acknowledged")
            work(job.sync_min * spm, t0)
            t1 = time.monotonic()
            send(pair, {"done": it + 1})
        rec.span(name, gpu, "sync", t0, t1)
        rec.span(sampler_job, sampler_gpu, "sync", t0, t1)
    return [r for r in (weights, optim) if r is not None]


# --- the driver ------------------------------------------------------------------------------


class _Worker:
    def __init__(self, spec: dict[str, Any], fd: int | None, logs: Path) -> None:
        self.name = f"{spec['job']['name']}-{spec['role']}"
        self.stderr_path = logs / f"{self.name}.log"
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "timesliced.bench.workload", "--worker", json.dumps({**spec, "fd": fd})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            pass_fds=() if fd is None else (fd,),
        )

    def ready(self) -> None:
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.fail("did not start")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self.fail(f"did not finish within {timeout:.0f} s")
        if self.proc.returncode != 0 or not out.strip():
            self.fail(f"exited with code {self.proc.returncode}")
        record: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return record

    def fail(self, what: str) -> None:
        self._stderr.flush()
        tail = self.stderr_path.read_text()[-2000:]
        raise RuntimeError(f"workload worker {self.name} {what}; its log ends:\n{tail}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


def run_mode(scenario: Scenario, mode: Mode) -> dict[str, Any]:
    """One mode on a fresh daemon: its figures (see ``figures``) and its timeline."""
    gpus, where = placement(scenario, mode)
    sizes = {
        j.name: {
            TRAINER: scenario.nbytes(j.trainer_gb),
            SAMPLER: scenario.nbytes(j.sampler_gb) if j.kind == "rl" else 0,
            "weights": scenario.nbytes(j.weights_gb) if j.kind == "rl" else 0,
        }
        for j in scenario.jobs
    }
    args = ["--gpus", str(gpus), "--gpu-memory", str(scenario.gpu_memory)]
    args += ["--bandwidth", f"{scenario.sim_bandwidth_gbps:.6g}", "--lease", "0", *mode.daemon_flags]
    expected = scenario.serial_s() if mode.serial else max(j.alone_min for j in scenario.jobs) * 3
    timeout = 60 + 4 * scenario.seconds(expected)
    with tempfile.TemporaryDirectory(prefix="timesliced-workload-") as tmp, DaemonProcess(*args) as daemon:
        poller = _StatusPoller(daemon.socket)
        workers: dict[str, list[_Worker]] = {}
        try:
            for j in scenario.jobs:
                pairs = socket.socketpair() if j.kind == "rl" else None
                workers[j.name] = []
                for i, role in enumerate(j.workers):
                    spec = {
                        "job": asdict(j),
                        "role": role,
                        "address": daemon.socket,
                        "seconds_per_minute": scenario.seconds_per_minute,
                        "sizes": sizes[j.name],
                        "groups": {r: list(where[f"{j.name}-{r}"]) for r in j.workers},
                        "declare_memory": mode.declare_memory,
                    }
                    fd = None if pairs is None else pairs[i].fileno()
                    workers[j.name].append(_Worker(spec, fd, Path(tmp)))
                if pairs is not None:
                    for s in pairs:
                        s.close()
            for ws in workers.values():
                for w in ws:
                    w.ready()
            poller.start()
            records: list[dict[str, Any]] = []
            if mode.serial:
                for ws in workers.values():
                    for w in ws:
                        w.go()
                    records += [w.result(timeout) for w in ws]
            else:
                for ws in workers.values():
                    for w in ws:
                        w.go()
                records = [w.result(timeout) for ws in workers.values() for w in ws]
        finally:
            poller.stop()
            for ws in workers.values():
                for w in ws:
                    w.kill()
    return figures(records, gpus, where, poller.latest, scenario)


class _StatusPoller:
    """Reads the daemon's status every half second while the mode runs; keeps the latest."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.latest: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="workload-status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(15)
            self._read()  # the figures once every worker is done

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._read()

    def _read(self) -> None:
        from ..client.sync import daemon_status

        try:
            self.latest = daemon_status(self.address, timeout=5)
        except Exception as exc:  # a reading missed is a figure a bit older, not a failed run
            log.debug("status: %s", exc)


def figures(
    records: list[dict[str, Any]],
    gpus: int,
    where: dict[str, tuple[str, int]],
    status: dict[str, Any],
    scenario: Scenario,
) -> dict[str, Any]:
    """A mode's figures from its workers' records and the daemon's last status."""
    t0 = min(r["started"] for r in records)
    makespan = max(r["finished"] for r in records) - t0
    spans = [s for r in records for s in r["spans"]]
    grants = [g for r in records for g in r["grants"]]
    busy = {gpu: _union([(s["start"], s["end"]) for s in spans if s["gpu"] == gpu]) for gpu in range(gpus)}
    groups = {g["group"]: g for g in status.get("groups", [])}
    gpu_group = {gpu: group for group, gpu in where.values()}
    daemon_duty = {
        str(gpu): groups[gpu_group[gpu]]["lock_duty"] if gpu_group.get(gpu) in groups else None for gpu in range(gpus)
    }
    switched = [g["switch_s"] for g in grants if g["restored"] or g["switch_s"] > 0]
    return {
        "gpus": gpus,
        "makespan_s": makespan,
        "gpu_hours": gpus * makespan / 3600,
        "duty": {str(gpu): busy[gpu] / makespan for gpu in range(gpus)},
        "mean_duty": sum(busy.values()) / (gpus * makespan),
        "daemon_duty": daemon_duty,
        "switches": sum(int(g.get("switches", 0)) for g in groups.values()),
        "bytes_moved": sum(int(g.get("bytes_moved", 0)) for g in groups.values()),
        "median_switch_s": median(switched),
        "median_wait_s": median([g["waited_s"] for g in grants]),
        "grants": len(grants),
        "data_errors": sum(r["data_errors"] for r in records),
        "error_notes": [n for r in records for n in r["error_notes"]],
        "overlaps": overlaps(spans),
        "lower_bound_s": scenario.lower_bound_s(),
        "gpu_of": {w: gpu for w, (_group, gpu) in where.items()},
        "timeline": [
            {**s, "start": round(s["start"] - t0, 4), "end": round(s["end"] - t0, 4)}
            for s in sorted(spans, key=lambda s: (s["gpu"], s["start"]))
        ],
    }


def overlaps(spans: list[dict[str, Any]]) -> int:
    """Pairs of slices of two different jobs on one GPU whose times overlap."""
    bad = 0
    by_gpu: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        by_gpu.setdefault(s["gpu"], []).append(s)
    for held in by_gpu.values():
        held.sort(key=lambda s: s["start"])
        for i, a in enumerate(held):
            for b in held[i + 1 :]:
                if b["start"] >= a["end"]:
                    break
                if b["job"] != a["job"]:
                    bad += 1
    return bad


def _union(spans: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, 0.0, -1.0
    for start, end in sorted(spans):
        if start > cur_end:
            total += max(0.0, cur_end - cur_start)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + max(0.0, cur_end - cur_start)


def run_workload(
    scenario: Scenario, modes: list[str] | None = None, progress: Callable[[str], Any] = lambda _m: None
) -> dict[str, Any]:
    """Every chosen mode (all by default) one after another; the report ``--json`` prints."""
    names = modes or [name for name, mode in MODES.items() if mode.default]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    report: dict[str, Any] = {
        "scenario": scenario.source,
        "lower_bound_s": scenario.lower_bound_s(),
        "serial_bound_s": scenario.serial_s(),
        "modes": {},
    }
    for name in names:
        progress(f"{name}: {MODES[name].about} ...")
        report["modes"][name] = run_mode(scenario, MODES[name])
    report["ratios"] = ratios(report)
    return report


def ratios(report: dict[str, Any]) -> dict[str, float | None]:
    """The issue's targets as ratios (None where a mode is missing)."""
    m = report["modes"]

    def get(mode: str, key: str) -> float | None:
        return m[mode][key] if mode in m else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    ts = get("timesliced", "makespan_s")
    return {
        "timesliced_over_serial": ratio(ts, get("serial", "makespan_s")),  # target <= 0.72
        "timesliced_over_lower_bound": ratio(ts, report["lower_bound_s"]),  # target <= 1.10
        "bytes_timesliced_over_reference": ratio(get("timesliced", "bytes_moved"), get("reference", "bytes_moved")),
        "duty_timesliced_over_dedicated": ratio(get("timesliced", "mean_duty"), get("dedicated", "mean_duty")),
    }


def failed(report: dict[str, Any]) -> bool:
    return any(m["data_errors"] or m["overlaps"] for m in report["modes"].values())


def format_workload(report: dict[str, Any]) -> str:
    def fmt(v: float | None, spec: str = ".2f", unit: str = "") -> str:
        return "-" if v is None else f"{v:{spec}}{unit}"

    lines = [
        f"scenario: {report['scenario']}   lower bound {report['lower_bound_s']:.1f} s   "
        f"serial without overhead {report['serial_bound_s']:.1f} s",
        "",
        f"{'mode':<11} {'makespan':>9} {'GPU h':>7} {'duty per GPU':<26} {'switches':>8} {'moved':>9} "
        f"{'med switch':>10} {'med wait':>9} {'errors':>6} {'overlaps':>8}",
    ]
    for name, r in report["modes"].items():
        duty = " ".join(f"{float(d) * 100:.0f}%" for d in r["duty"].values())
        lines.append(
            f"{name:<11} {r['makespan_s']:>8.1f}s {r['gpu_hours']:>7.4f} {duty:<26} {r['switches']:>8} "
            f"{r['bytes_moved'] / (1 << 20):>6.0f}MiB {fmt(r['median_switch_s'], '.3f', 's'):>10} "
            f"{fmt(r['median_wait_s'], '.3f', 's'):>9} {r['data_errors']:>6} {r['overlaps']:>8}"
        )
    q = report["ratios"]
    lines += [
        "",
        f"timesliced / serial makespan        {fmt(q['timesliced_over_serial'])}   (target <= 0.72)",
        f"timesliced / lower bound            {fmt(q['timesliced_over_lower_bound'])}   (target <= 1.10)",
        f"bytes moved timesliced / reference  {fmt(q['bytes_timesliced_over_reference'])}   (target <= 0.5)",
        f"duty timesliced / dedicated         {fmt(q['duty_timesliced_over_dedicated'])}   (target >= 2)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
    else:
        raise SystemExit("usage: timesliced bench workload")
