"""The ``timesliced`` command as a user runs it: real daemon process, real clients."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import timesliced
from timesliced.env import default_sim_dir

from ..helpers.processes import REPO, run_python, wait_for

pytestmark = pytest.mark.slow  # the quick loop (-m "not slow") leaves these out


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "timesliced", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    sock = str(tmp_path / "ts.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "timesliced",
            "serve",
            "--web",
            "off",
            "--backend",
            "sim",
            "--state-dir",
            str(tmp_path / "state"),
            "--socket",
            sock,
            "--gpus",
            "3",
            "--gpu-memory",
            "32MiB",
            "--bandwidth",
            "0",
            "--host-memory-limit",
            "1GiB",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_for(lambda: cli("status", "--address", sock).returncode == 0, timeout=30, interval=0.1)
        yield proc, sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert proc.stderr is not None
        proc.stderr.close()
        shutil.rmtree(default_sim_dir(tmp_path / "state"), ignore_errors=True)


def test_serve_status_and_clean_shutdown(served: tuple[subprocess.Popen[str], str]) -> None:
    proc, sock = served
    with timesliced.Client(job="trainer", group="pool", address=sock) as c:
        c.acquire()
        c.sim_alloc(8 << 20, gpu=2)
        status = json.loads(cli("status", "--json", "--address", sock).stdout)
        assert [d["capacity"] for d in status["devices"]] == [32 << 20] * 3
        (group,) = status["groups"]
        assert group["holder"] == "trainer" and group["fence"] == 1 and group["gpus"] == [0, 1, 2]
        assert status["devices"][2]["jobs"]["trainer"]["bytes"] == 8 << 20
        text = cli("status", "--address", sock).stdout
        assert "pool" in text and "holder=trainer" in text and "gpu2" in text
        (host,) = status["host"]
        assert host["limit"] == 1 << 30 and host["budget"] <= 1 << 30 and status["host_memory"]["limit"] == 1 << 30
        assert "HOST MEMORY FOR PARKED STATE" in text and "limit=1.0 GiB" in text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert not Path(sock).exists()


def test_status_without_daemon_is_a_clear_error(tmp_path: Path) -> None:
    result = cli("status", "--address", str(tmp_path / "none.sock"))
    assert result.returncode == 1
    assert "cannot reach the timesliced daemon" in result.stderr


def test_second_daemon_on_same_socket_refuses(served: tuple[subprocess.Popen[str], str], tmp_path: Path) -> None:
    _, sock = served
    result = cli(
        "serve",
        "--web",
        "off",
        "--backend",
        "sim",
        "--state-dir",
        str(tmp_path / "other"),
        "--socket",
        sock,
        timeout=30,
    )
    assert result.returncode == 1
    assert "already serving" in result.stderr
    shutil.rmtree(default_sim_dir(tmp_path / "other"), ignore_errors=True)


def test_demo_json_runs_real_jobs() -> None:
    result = cli("demo", "--json", "--scale", "0.15", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["data_errors"] == 0
    sliced, serial = report["timesliced"], report["serial"]
    assert {j["job"] for j in sliced["jobs"]} == {"rl-math", "rl-code", "sft-chat"}
    assert sliced["switches"] > 0 and serial["switches"] == 0
    assert all(0 < g["duty_cycle"] <= 1 for g in sliced["gpus"])
    assert report["speedup"] > 0


def test_demo_serves_its_dashboard_and_keeps_it_up() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["demo", "--scale", "0.1", "--no-serial", "--web", "127.0.0.1:0", "--keep"]
    proc = subprocess.Popen([sys.executable, "-m", "timesliced", *args], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        url = next(line for line in lines if line.startswith("dashboard: ")).split()[1]
        assert next(line for line in lines if "stays up" in line).strip().endswith(f"at {url} (Ctrl-C to stop)")
        with urllib.request.urlopen(url + "api/v1/status", timeout=10) as r:
            status = json.loads(r.read())
        assert [g["group"] for g in status["groups"]] == ["demo-pool"] and status["groups"][0]["grants"] > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "data errors" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_bench_handoff_prints_figures() -> None:
    result = cli("bench", "handoff", "--rounds", "200", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    keys = ("handoff_p50_ms", "handoff_p99_ms", "acquire_release_per_s", "loopback_rtt_p50_ms", "ping_rtt_p50_ms")
    noop = ("noop_handoff_p50_ms", "noop_ping_rtt_p50_ms", "noop_handoff_over_ping", "handoff_over_noop")
    for key in (*keys, "ping_after_idle_p50_ms", "handoff_over_ping", "handoff_over_ping_after_idle", *noop):
        assert figures[key] > 0, key
    assert figures["handoffs"] >= 150
    assert figures["fences_strictly_increasing"]


def test_bench_handoff_with_a_gap_between_slices() -> None:
    """``--gap``: each job is off the lock that long between its slices; every release still hands over."""
    result = cli("bench", "handoff", "--rounds", "100", "--gap", "0.4", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["gap_ms"] == 0.4 and figures["handoffs"] >= 75 and figures["fences_strictly_increasing"]
    refused = cli("bench", "handoff", "--gap", "1", timeout=60)
    assert refused.returncode != 0
    assert "bench handoff: the gap must be at least 0 and below the hold (1 ms)" in refused.stderr


def test_bench_handoff_across_nodes_prints_figures() -> None:
    result = cli("bench", "handoff", "--nodes", "3", "--rounds", "200", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["nodes"] == 3 and figures["clients_on"] != figures["leader"]
    assert figures["handoff_p50_ms"] > 0 and figures["handoffs"] >= 150
    assert figures["fences_strictly_increasing"]


def test_bench_failover_prints_figures() -> None:
    result = cli("bench", "failover", "--kills", "1", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["kills"] == 1 and figures["failovers_measured"] == 1
    assert 0 < figures["failover_p50_s"] == figures["failover_max_s"] < 30
    assert figures["double_grants"] == 0 and figures["lost_acquires"] == 0 and figures["grants"] > 10


def test_bench_offload_prints_figures() -> None:
    swap = ("--swaps", "4", "--swap-mib", "8", "--swap-region-mib", "2", "--swap-gbps", "0.2")
    result = cli("bench", "offload", "--mib", "8", "--rounds", "2", "--switches", "20", *swap, "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    for key in ("d2h_gbps_p50", "h2d_gbps_p50", "park_s_p50", "unpark_s_p50", "switch_p50_ms", "switch_p99_ms"):
        assert figures[key] > 0, key
    assert figures["bytes"] == 8 << 20 and figures["switches"] >= 1
    for run in ("streamed", "sequential"):  # the swap figures: both runs, each direction
        assert figures[f"{run}_switches"] >= 3 and figures[f"{run}_switch_s_p50"] > 0
        assert figures[f"{run}_to_host_gbps_p50"] > 0 and figures[f"{run}_to_device_gbps_p50"] > 0
    assert figures["swap_speedup"] > 0
    assert "ERROR" not in result.stderr  # the jobs start and end together: nothing is parked after it left


def test_daemon_kill_9_loses_no_parked_bytes(tmp_path: Path) -> None:
    import asyncio

    from timesliced.backends.sim import SimBackend
    from timesliced.sim.region import SimRegion

    state, sock = tmp_path / "state", str(tmp_path / "ts.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["serve", "--web", "off", "--backend", "sim", "--state-dir", str(state), "--socket", sock]
    args += ["--gpus", "1", "--gpu-memory", "32MiB"]
    proc = subprocess.Popen([sys.executable, "-m", "timesliced", *args], stderr=subprocess.DEVNULL, env=env)
    sim_dir = default_sim_dir(state)
    try:
        wait_for(lambda: cli("status", "--address", sock).returncode == 0, timeout=30, interval=0.1)
        a = timesliced.Client(job="a", group="g", address=sock)
        b = timesliced.Client(job="b", group="g", address=sock)
        with a.slice():
            region = a.sim_alloc(20 << 20)
            region.fill(b"training state")
            digest = region.checksum()
        with b.slice():
            b.sim_alloc(20 << 20)  # parks a
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        a.close()
        b.close()
        region.close()
        backend = SimBackend(sim_dir, gpus=1, capacity=32 << 20)  # what a restarted daemon builds
        try:
            assert backend.recovered_jobs()["a"][0] == "parked"
            assert backend.recovered_jobs()["b"][0] == "resident"
            asyncio.run(backend.reclaim("b"))
            asyncio.run(backend.restore("a"))
            (info,) = backend.regions("a")
            with SimRegion.open(info) as again:
                assert again.checksum() == digest
        finally:
            backend.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(sim_dir, ignore_errors=True)


def test_serve_with_an_unavailable_backend_exits_with_the_reason(tmp_path: Path) -> None:
    code = "import sys, timesliced.cli as c; sys.exit(c.main(sys.argv[1:]))"
    args = ["serve", "--web", "off", "--backend", "cuda-checkpoint", "--state-dir", str(tmp_path / "s")]
    result = run_python(code, *args, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("timesliced: cuda-checkpoint cannot run here: "), result.stderr


def test_serve_on_a_socket_path_too_long_for_its_address_says_so_in_one_line(tmp_path: Path) -> None:
    sock = tmp_path / ("d" * 120) / "timesliced.sock"
    result = cli("serve", "--web", "off", "--socket", str(sock), "--state-dir", str(tmp_path / "s"), timeout=60)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("timesliced: the socket path ") and last.endswith("give a shorter --socket or --state-dir")
    assert "Traceback" not in result.stderr, result.stderr
    sim = default_sim_dir(tmp_path / "s")  # the simulated GPU it had made went with it, but for its lock
    assert [p.name for p in sim.iterdir()] == ["daemon.lock"]
