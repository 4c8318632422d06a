"""``timesliced bench load``: many job processes on one daemon for a while.

One ``timesliced serve --backend sim`` process, one simulated GPU per group,
and ``clients`` job processes spread round-robin over the groups (job ``i`` in
group ``i % groups``, on that group's GPU). Each job allocates a 1 MiB region
and then, until the end, takes rounds: acquire; check that the region still
holds the counter pattern the job wrote in its previous round; write the next
one; release; and in about half the gaps between rounds a little "CPU work"
(a sleep of 0.5 to 3 ms) off the lock.

Memory: the region takes one 2 MiB page of the simulated GPU, and each GPU
has room for half of its group's jobs (rounded up), so most grants park the
least recently granted job and restore the incoming one: real snapshots and
restores of real bytes through tmpfs. ``--bandwidth 0``: copies run as fast as
memory allows, so the figures are the daemon's, not the bandwidth model's.

The figures cover the measured window only: it opens once every job has
registered, allocated and finished one round, and it closes when the last job
has finished its last round (a job starts no acquire past ``seconds``).

- ``ops_per_s``: rounds (acquire + release) per second over all jobs.
- ``p50_ms`` / ``p99_ms``: per round, the time a job waits on the daemon:
  acquire (queueing behind the other jobs of its group, and the switch) plus
  release. The job's own time on the lock (the data check and the write) is
  not in it. ``acquire_*`` and ``release_*`` give the two parts on their own,
  and ``switch_*`` the part of an acquire spent moving state (grants that
  restored the job), as the daemon reports it.
- ``errors``: exceptions raised to the jobs (a lost connection included).
- ``data_errors``: rounds whose region did not hold the previous round's bytes.
- ``lost_grants``: grants the daemon made that no job received, plus acquires
  that never completed. The first are gaps in a group's fences: the daemon
  numbers each grant of a group 1, 2, 3, ... and every job logs the fences it
  is granted, so each fence up to the group's last one (from the daemon's
  status) that no log holds is a grant nobody received. The second are
  acquires still waiting ``GRACE_S`` (10 s) after the end, which the daemon
  times out, and job processes that gave no summary: those still stuck
  ``KILL_MARGIN_S`` after that are killed. Each such process counts once,
  whatever it was stuck in.
- ``double_grants``: two jobs holding one group at once, or one fence given
  to two jobs, from the jobs' grant logs.
- ``switches``: grants that moved state (the daemon's figure) in the window.
- ``daemon_cpu_s`` / ``daemon_cpu_percent`` / ``daemon_cpu_ms_per_op``: the
  daemon's CPU time (user and system, every thread) over the window, from
  ``/proc/PID/stat``.
- ``rss_start_mb`` / ``rss_end_mb``: the daemon's resident memory at both ends
  of the window, from ``/proc/PID/status``. It includes the pages of the
  simulated GPUs' shared memory that the daemon's copies touched, which grow
  until every page was copied once; ``rss_anon_start_mb`` / ``rss_anon_end_mb``
  are the private part alone (the heap), where a leak would show.

Any errors, data errors, lost grants or double grants make ``failed()`` true
(and the command exit non-zero).
"""

from __future__ import annotations

import json
import math
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from .. import errors
from ..client.codec import Grant
from ..client.sync import Client, daemon_status
from ..config import DaemonConfig
from ..util.stats import percentile
from .common import DaemonProcess, double_grants, read_grants
from .copy import link_figures

MiB = 1 << 20
REGION_BYTES = MiB
PAGE_BYTES = DaemonConfig.page_size  # the daemon's allocation unit: a region takes whole pages
GRACE_S = 10.0  # an acquire may complete this long after the end; past it, it is lost
KILL_MARGIN_S = 5.0  # a job that has not reported this long after the grace is killed
CPU_WORK_CHANCE = 0.5  # of a gap between two rounds
CPU_WORK_S = (0.0005, 0.003)
MAX_ERRORS = 100  # per job: past this it stops, rather than spin on a broken daemon
KEPT_MESSAGES = 3  # error messages each job reports


def start_timeout(clients: int) -> float:
    """How long the jobs may take to start, register and finish their first round."""
    return 60.0 + 0.5 * clients


def gpu_memory(jobs_per_group: int) -> int:
    """Bytes per simulated GPU: room for half the group's jobs (rounded up), whole pages each."""
    pages_per_job = math.ceil(REGION_BYTES / PAGE_BYTES)
    return max(1, math.ceil(jobs_per_group / 2)) * pages_per_job * PAGE_BYTES


def pattern(job: str, counter: int) -> bytes:
    """What the region of ``job`` holds after its round ``counter``: a stamp repeated to the region's size."""
    stamp = f"{job}#{counter:012d};".encode()
    return (stamp * (REGION_BYTES // len(stamp) + 1))[:REGION_BYTES]


# --- a job (runs in its own process) ---------------------------------------------------


@dataclass
class Tally:
    """What one job counts; its summary line."""

    job: str
    rounds: int = 0  # in the measured window
    errors: int = 0
    data_errors: int = 0
    stuck: int = 0  # acquires the daemon timed out after the end + grace
    messages: list[str] = field(default_factory=list)

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if len(self.messages) < KEPT_MESSAGES:
            self.messages.append(f"{exc.__class__.__name__}: {exc}")


class LoadJob:
    """One job's rounds on the lock, each logged as one JSON line (``read_grants`` reads them)."""

    def __init__(self, client: Client, gpu: int, log: IO[str]) -> None:
        self.client, self.gpu, self.log = client, gpu, log
        self.region: Any = None  # a SimRegion, once allocated inside the first slice
        self.counter = 0
        self.expected = b""

    def one_round(self, tally: Tally, timeout: float, warmup: bool = False) -> None:
        """Acquire, check and rewrite the region, release. Raises what the client raises."""
        asked = time.monotonic()
        grant = self.client.acquire(timeout=timeout)
        start = time.monotonic()
        released: float | None = None
        try:
            if not self._check_and_write():
                tally.data_errors += 1
        finally:
            end = time.monotonic()
            try:
                self.client.release()
                released = time.monotonic()
            finally:  # a grant is logged whatever happened in it, or it would count as lost
                self._log(grant, asked, start, end, released, warmup)
        if not warmup:
            tally.rounds += 1

    def _check_and_write(self) -> bool:
        """False if the region lost the previous round's bytes."""
        intact = True
        if self.region is None:
            self.region = self.client.sim_alloc(REGION_BYTES, gpu=self.gpu)
        else:
            intact = self.region.read() == self.expected
        self.counter += 1
        self.expected = pattern(self.client.job, self.counter)
        self.region.write(self.expected)
        return intact

    def _log(self, grant: Grant, asked: float, start: float, end: float, released: float | None, warmup: bool) -> None:
        record = {
            "job": grant.job,
            "group": grant.group,
            "term": grant.term,
            "fence": grant.fence,
            "restored": grant.restored,
            "switch_s": grant.switch_s,
            "asked": asked,
            "start": start,
            "end": end,
            "released": released,
            "warmup": warmup,
        }
        self.log.write(json.dumps(record) + "\n")


def run_client(job: str, group: str, gpu: int, address: str, log: str, seed: int, start_timeout: float) -> None:
    """The job process: one round, ``ready``; wait for ``go DEADLINE``; rounds until then; the summary.

    Talks to the parent on stdin and stdout, one line each way per step; after the
    summary it stays connected (so the daemon keeps its group's figures) until stdin closes.
    """
    rng = random.Random(seed)
    tally = Tally(job)
    client = Client(job=job, group=group, address=address, gpus=[gpu])
    with open(log, "a", buffering=1) as out, client:
        load = LoadJob(client, gpu, out)
        load.one_round(tally, timeout=start_timeout, warmup=True)
        print("ready", flush=True)
        line = sys.stdin.readline().split()
        if len(line) != 2 or line[0] != "go":
            return  # the parent is gone or gave up
        deadline = float(line[1])  # CLOCK_MONOTONIC, shared by every process of the machine
        while time.monotonic() < deadline and tally.errors < MAX_ERRORS:
            try:
                load.one_round(tally, timeout=deadline + GRACE_S - time.monotonic())
            except errors.AcquireTimeout:
                tally.stuck += 1
                break
            except errors.ConnectionLost as exc:
                tally.error(exc)
                break
            except Exception as exc:
                tally.error(exc)
            if rng.random() < CPU_WORK_CHANCE:
                time.sleep(rng.uniform(*CPU_WORK_S))
        print(json.dumps(asdict(tally)), flush=True)
        sys.stdin.read()


# --- the job processes, seen from the parent ------------------------------------------


class Fleet:
    """The job processes: spawned at once, spoken to line by line, never left behind."""

    def __init__(self, root: Path, address: str, clients: int, groups: int) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self._buffers: list[bytes] = []
        try:
            for i in range(clients):
                self._spawn(i, i % groups, address, start_timeout(clients))
        except BaseException:
            self.close()
            raise

    def _spawn(self, i: int, group: int, address: str, timeout: float) -> None:
        job = f"load-{i:04d}"
        log = self.root / f"{job}.jsonl"
        spec = {
            "job": job,
            "group": f"load-{group}",
            "gpu": group,
            "address": address,
            "log": str(log),
            "seed": i,
            "start_timeout": timeout,
        }
        with open(self.root / f"{job}.err", "wb") as err:  # the child keeps its own descriptor
            cmd = [sys.executable, "-m", "timesliced.bench.load", "--client", json.dumps(spec)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err))
        self.logs.append(log)
        self._buffers.append(b"")

    def ready(self, deadline: float) -> None:
        """Wait for every job's ``ready``; raises ``RuntimeError`` naming one that did not make it."""
        lines = self._next_lines(deadline)
        for i, proc in enumerate(self.procs):
            if lines.get(i) != "ready":
                why = "exited" if proc.poll() is not None else "did not get through its first round in time"
                raise RuntimeError(f"job process {i} {why}: {self.stderr_tail(i)}")

    def go(self, deadline: float) -> None:
        """Tell every job to take rounds until ``deadline`` (CLOCK_MONOTONIC)."""
        for proc in self.procs:
            assert proc.stdin is not None
            try:
                proc.stdin.write(f"go {deadline!r}\n".encode())
                proc.stdin.flush()
            except OSError:
                pass  # it died since it was ready: it gives no summary, and that is counted

    def summaries(self, deadline: float) -> list[dict[str, Any] | None]:
        """Every job's summary; None for a job that gave none by ``deadline`` (it is killed)."""
        lines = self._next_lines(deadline)
        out: list[dict[str, Any] | None] = []
        for i, proc in enumerate(self.procs):
            line = lines.get(i)
            if line is None and proc.poll() is None:
                proc.kill()
            out.append(json.loads(line) if line else None)
        return out

    def stderr_tail(self, i: int) -> str:
        text = (self.root / f"load-{i:04d}.err").read_text(errors="replace").strip()
        return text[-2000:] or "(nothing on stderr)"

    def close(self) -> None:
        """Close every job's stdin (it disconnects and exits); kill those that do not exit in time."""
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass  # it is gone already
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:  # no summaries wanted: stop the jobs now, not at their deadline
            for proc in self.procs:
                if proc.poll() is None:
                    proc.terminate()
        self.close()

    def _next_lines(self, deadline: float) -> dict[int, str]:
        """The next line of each job that writes one before ``deadline``."""
        got: dict[int, str] = {}
        with selectors.DefaultSelector() as sel:
            for i, proc in enumerate(self.procs):
                if not self._take_line(i, got):
                    assert proc.stdout is not None
                    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, i)
            while sel.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    i = key.data
                    chunk = os.read(key.fd, 1 << 16)
                    self._buffers[i] += chunk
                    if not chunk or self._take_line(i, got):  # end of file, or a line
                        sel.unregister(key.fd)
        return got

    def _take_line(self, i: int, got: dict[int, str]) -> bool:
        line, newline, rest = self._buffers[i].partition(b"\n")
        if newline:
            self._buffers[i] = rest
            got[i] = line.decode(errors="replace").strip()
        return bool(newline)


# --- the daemon, seen from the parent ---------------------------------------------------


@dataclass(frozen=True)
class ProcessSample:
    cpu_s: float  # user + system, every thread
    rss_bytes: int
    anon_bytes: int  # the private part of the resident memory (heap, stacks): where a leak would show


def sample_process(pid: int) -> ProcessSample:
    """CPU time and resident memory of ``pid`` from ``/proc``; raises ``OSError`` if it is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    ticks = int(fields[11]) + int(fields[12])  # utime and stime, fields 14 and 15 of proc(5)
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    kib = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS:", "RssAnon:"))}
    return ProcessSample(ticks / os.sysconf("SC_CLK_TCK"), kib["VmRSS"] * 1024, kib["RssAnon"] * 1024)


@dataclass(frozen=True)
class DaemonSample:
    """The daemon at one end of the window: its process, and per group its last fence and switches."""

    process: ProcessSample
    fences: dict[str, int]
    switches: dict[str, int]


def sample_daemon(daemon: DaemonProcess) -> DaemonSample:
    """Raises ``RuntimeError`` if the daemon has exited."""
    if daemon.proc.poll() is not None:
        raise RuntimeError(f"the daemon exited during the run with code {daemon.proc.returncode}")
    process = sample_process(daemon.proc.pid)
    groups = daemon_status(daemon.socket)["groups"] or []
    return DaemonSample(
        process, {g["group"]: int(g["fence"]) for g in groups}, {g["group"]: int(g["switches"]) for g in groups}
    )


def start_daemon(groups: int, jobs_per_group: int) -> DaemonProcess:
    """A daemon with one simulated GPU per group, each with room for half its group's jobs."""
    return DaemonProcess("--gpus", str(groups), "--gpu-memory", str(gpu_memory(jobs_per_group)), "--bandwidth", "0")


# --- the benchmark ------------------------------------------------------------------------


def run_load(clients: int = 64, groups: int = 8, seconds: float = 30.0) -> dict[str, Any]:
    """Run the benchmark and return its figures (see the module docstring).

    Raises ``ValueError`` for impossible arguments, ``RuntimeError`` if the daemon
    or a job process does not start or the daemon dies, ``ConnectionLost`` if the
    daemon stops answering its status.
    """
    if groups < 1 or clients < groups:
        raise ValueError("need at least one group and at least one client per group")
    if not seconds > 0:
        raise ValueError("seconds must be positive")
    jobs_per_group = math.ceil(clients / groups)
    with (
        tempfile.TemporaryDirectory(prefix="timesliced-bench-") as tmp,
        start_daemon(groups, jobs_per_group) as daemon,
        Fleet(Path(tmp), daemon.socket, clients, groups) as fleet,
    ):
        fleet.ready(time.monotonic() + start_timeout(clients))
        before = sample_daemon(daemon)
        opened = time.monotonic()
        fleet.go(opened + seconds)
        summaries = fleet.summaries(opened + seconds + GRACE_S + KILL_MARGIN_S)
        after = sample_daemon(daemon)
        grants = read_grants(*fleet.logs)
        silent = [
            f"job process {i} gave no summary: {fleet.stderr_tail(i).splitlines()[-1]}"
            for i, summary in enumerate(summaries)
            if summary is None
        ]
    figures = summarize(grants, summaries, before, after, opened, silent)
    return {
        "clients": clients,
        "groups": groups,
        "seconds": seconds,
        "gpu_memory_mb": gpu_memory(jobs_per_group) / MiB,
        "region_mb": REGION_BYTES / MiB,
        **figures,
    }


def summarize(
    grants: list[dict[str, Any]],
    summaries: list[dict[str, Any] | None],
    before: DaemonSample,
    after: DaemonSample,
    opened: float,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The figures, from the jobs' grant logs and summaries and the daemon at both ends of the window."""
    measured = [g for g in grants if not g["warmup"] and g["released"] is not None]
    closed = max((g["released"] for g in measured), default=opened)
    elapsed = max(closed - opened, 1e-9)
    acquire = [(g["start"] - g["asked"]) * 1000 for g in measured]
    release = [(g["released"] - g["end"]) * 1000 for g in measured]
    rounds = [a + r for a, r in zip(acquire, release, strict=True)]
    switch = [g["switch_s"] * 1000 for g in measured if g["restored"]]
    reported = [s for s in summaries if s is not None]
    cpu_s = after.process.cpu_s - before.process.cpu_s
    return {
        "elapsed_s": elapsed,
        "ops": len(measured),
        "ops_per_s": len(measured) / elapsed,
        "p50_ms": percentile(rounds, 0.5),
        "p99_ms": percentile(rounds, 0.99),
        "max_ms": max(rounds, default=None),
        "acquire_p50_ms": percentile(acquire, 0.5),
        "acquire_p99_ms": percentile(acquire, 0.99),
        "release_p50_ms": percentile(release, 0.5),
        "release_p99_ms": percentile(release, 0.99),
        "switch_p50_ms": percentile(switch, 0.5),
        "switch_p99_ms": percentile(switch, 0.99),
        **{f"link_{k}": v for k, v in link_figures(0.0).items()},  # the daemon runs unpaced (--bandwidth 0)
        "errors": sum(s["errors"] for s in reported),
        "data_errors": sum(s["data_errors"] for s in reported),
        "lost_grants": lost_fences(grants, after.fences) + sum(s["stuck"] for s in reported) + summaries.count(None),
        "double_grants": double_grants(grants),
        "silent_clients": summaries.count(None),
        "switches": sum(after.switches.values()) - sum(before.switches.values()),
        "restored_grants": sum(1 for g in measured if g["restored"]),
        "daemon_cpu_s": cpu_s,
        "daemon_cpu_percent": 100 * cpu_s / elapsed,
        "daemon_cpu_ms_per_op": 1000 * cpu_s / len(measured) if measured else None,
        "rss_start_mb": before.process.rss_bytes / MiB,
        "rss_end_mb": after.process.rss_bytes / MiB,
        "rss_anon_start_mb": before.process.anon_bytes / MiB,
        "rss_anon_end_mb": after.process.anon_bytes / MiB,
        "error_messages": sorted({m for s in reported for m in s["messages"]}) + list(notes),
    }


def lost_fences(grants: list[dict[str, Any]], fences: dict[str, int]) -> int:
    """Grants the daemon made (fences 1 .. the group's last) that no job logged."""
    seen: dict[str, set[int]] = {}
    for g in grants:
        seen.setdefault(g["group"], set()).add(g["fence"])
    return sum(len(set(range(1, last + 1)) - seen.get(group, set())) for group, last in fences.items())


def failed(figures: dict[str, Any]) -> bool:
    """True if the run saw any error, data error, lost grant or double grant."""
    return any(figures[key] for key in ("errors", "data_errors", "lost_grants", "double_grants"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        run_client(**json.loads(sys.argv[2]))
    else:
        raise SystemExit("usage: timesliced bench load")
