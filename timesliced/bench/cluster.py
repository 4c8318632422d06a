"""A cluster of daemons on this machine (loopback), and the multi-node benchmarks.

``LocalCluster`` starts N ``timesliced serve`` processes, each with its own
state dir, socket and simulated GPUs, that elect a leader over TCP. The tests
use it to kill and partition daemons; ``timesliced bench handoff --nodes N``
and ``timesliced bench failover`` use it to measure.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..client.sync import daemon_status
from ..util.stats import median
from .common import double_grants, free_port, read_grants


class LocalCluster:
    """``n`` daemons named n0, n1, ... on loopback. ``peers_arg(name)`` may route links through proxies."""

    def __init__(
        self,
        root: Path,
        n: int = 3,
        *,
        gpus: int = 1,
        gpu_memory: str = "64MiB",
        bandwidth: float = 0.0,
        election_timeout: float = 1.0,
        peers_arg: Callable[[str], str] | None = None,
        ports: dict[str, int] | None = None,
    ) -> None:
        self.root = root
        self.names = [f"n{i}" for i in range(n)]
        self.ports = ports or {name: free_port() for name in self.names}
        self.token = root / "peer-token"
        self.token.write_text(secrets.token_hex(16))
        self.token.chmod(0o600)
        self.gpus, self.gpu_memory, self.bandwidth = gpus, gpu_memory, bandwidth
        self.election_timeout = election_timeout
        self.peers_arg = peers_arg or (lambda _: self.real_peers())
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def real_peers(self) -> str:
        return ",".join(f"{n}=127.0.0.1:{p}" for n, p in self.ports.items())

    def socket(self, name: str) -> Path:
        return self.root / name / "timesliced.sock"

    def start(self, name: str) -> None:
        state = self.root / name
        state.mkdir(exist_ok=True)
        sock = self.socket(name)
        sock.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "timesliced", "serve",
            "--backend", "sim", "--web", "off",
            "--gpus", str(self.gpus), "--gpu-memory", self.gpu_memory, "--bandwidth", str(self.bandwidth),
            "--state-dir", str(state), "--sim-dir", str(state / "sim"),
            "--peers", self.peers_arg(name), "--node-id", name,
            "--peer-listen", f"127.0.0.1:{self.ports[name]}", "--peer-token-file", str(self.token),
            "--election-timeout", str(self.election_timeout), "--log-level", "WARNING",
        ]  # fmt: skip
        with open(state / "daemon.log", "ab") as log:  # the process keeps its own descriptor
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 20
        while not sock.exists():
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon {name} did not start: {(state / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.02)

    def start_all(self) -> LocalCluster:
        for name in self.names:
            self.start(name)
        return self

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def status(self, name: str) -> dict[str, Any]:
        return daemon_status(self.socket(name), timeout=5.0)

    def leader(self, among: list[str] | None = None, timeout: float = 20.0) -> str:
        """The node every live daemon in ``among`` follows, once they agree and it is ready."""
        among = among or list(self.procs)
        deadline = time.monotonic() + timeout
        while True:
            try:
                views = {n: self.status(n)["cluster"] for n in among}
                leaders = {v["leader"] for v in views.values()}
                if len(leaders) == 1 and None not in leaders and all(v["ready"] for v in views.values()):
                    (leader,) = leaders
                    if leader in views and views[leader]["leading"]:
                        return str(leader)
            except Exception:  # a daemon mid-start or just killed: ask again
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no agreed leader among {among} within {timeout}s")
            time.sleep(0.05)


# --- a worker that logs its grants ------------------------------------------------------

WORKER = r"""
import json, os, sys, time, timesliced
from timesliced import errors
job, group, address, log = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[6]
seconds, size, at_least = float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[7])
client = timesliced.Client(job=job, group=group, address=address, gpus=[0])
region, expected, data_errors, grants = None, None, 0, 0
end = time.monotonic() + seconds
out = open(log, "a", buffering=1)
try:
    with client:
        # for ``seconds``, and on (for at most a minute) until this process had ``at_least`` grants
        while time.monotonic() < end or (grants < at_least and time.monotonic() < end + 60):
            asked = time.monotonic()
            grant = client.acquire(timeout=60)
            start = time.monotonic()
            if region is None:
                region = client.sim_alloc(size, gpu=0)
            elif region.checksum() != expected:
                data_errors += 1
            region.fill(f"{job}/{grants}".encode())
            expected = region.checksum()
            time.sleep(0.01)
            stop = time.monotonic()
            client.release()
            grants += 1
            out.write(json.dumps({"job": job, "group": group, "term": grant.term, "fence": grant.fence,
                                  "asked": asked, "start": start, "end": stop, "pid": os.getpid()}) + "\n")
            time.sleep(0.005)
except errors.TimeslicedError as exc:
    print(json.dumps({"job": job, "lost": exc.code, "grants": grants, "data_errors": data_errors}), flush=True)
    sys.exit(0)
print(json.dumps({"job": job, "grants": grants, "data_errors": data_errors}), flush=True)
"""


def spawn_worker(
    job: str, group: str, sock: Path, seconds: float, size: int, log: Path, *, at_least: int = 0
) -> subprocess.Popen[str]:
    """A process of ``job`` taking turns for ``seconds`` (and until it had ``at_least`` grants), logging each."""
    args = [job, group, str(sock), str(seconds), str(size), str(log), str(at_least)]
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# --- benchmarks ------------------------------------------------------------------------------


def bench_failover(kills: int, workers_per_node: int = 2) -> dict[str, Any]:
    """Kill -9 the leader ``kills`` times while jobs on the other nodes take turns; time to their next grant."""
    times: list[float] = []
    lost_acquires = 0
    lost_reasons: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="timesliced-bench-") as tmp, LocalCluster(Path(tmp), 3) as cluster:
        root = Path(tmp)
        cluster.start_all()
        all_logs: list[Path] = []
        for k in range(kills):
            leader = cluster.leader()
            others = [n for n in cluster.names if n != leader]
            runs = [(n, i, root / f"grants-{k}-{n}-{i}.jsonl") for n in others for i in range(workers_per_node)]
            logs = [log for _, _, log in runs]
            procs = [spawn_worker(f"job{i}", "pool", cluster.socket(n), 5.0, 1 << 20, log) for n, i, log in runs]
            all_logs += logs
            time.sleep(1.5)  # the jobs take turns
            killed_at = time.monotonic()
            cluster.kill(leader)
            for p in procs:
                out, _ = p.communicate(timeout=120)
                result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"lost": "crashed"}
                if "lost" in result:
                    lost_acquires += 1
                    lost_reasons[result["lost"]] = lost_reasons.get(result["lost"], 0) + 1
            after = [g["start"] for g in read_grants(*logs) if g["start"] > killed_at]
            if after:
                times.append(min(after) - killed_at)
            cluster.start(leader)  # it comes back as a follower
        grants = read_grants(*all_logs)
        return {
            "kills": kills,
            "failover_p50_s": median(times),
            "failover_max_s": max(times) if times else None,
            "failovers_measured": len(times),
            "double_grants": double_grants(grants),
            "lost_acquires": lost_acquires,
            "lost_reasons": lost_reasons,
            "grants": len(grants),
        }
