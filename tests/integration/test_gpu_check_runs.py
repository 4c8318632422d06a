"""The GPU check's backend runs without a GPU: a real daemon, two real job processes, "device" memory in host buffers.

``check.run_backend(..., host_memory=GB/s)`` runs the offload method exactly as
on a GPU (the daemon directs each job's ``Offloader`` to park and unpark, the
jobs verify every byte after every turn) over ``HostDeviceMemory``, so the
planning of rounds from the first measured switch, the crash and restart path
and the process cleanup are shown here; the real driver's figures are not.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import check, install, procs
from tests.gpu.budget import TAIL_S
from tests.gpu.runner import problems

pytestmark = pytest.mark.slow

MIB_64 = 1 / 16  # GiB


def no_leftovers() -> None:
    assert check.CHILDREN.groups() == []
    assert not [pid for pid, m in procs.marked().items() if m == check.CHILDREN.marker]


def test_two_jobs_take_every_turn_asked_when_switches_are_fast() -> None:
    result = check.run_backend("offload", gib=MIB_64, rounds=4, torch="off", timeout=60, plan=True, host_memory=0)
    assert result["ok"], result
    assert (result["rounds"], result["rounds_done"], result["rounds_asked"]) == (4, 4, 4)
    assert result["data_errors"] == 0 and result["restores"] >= 8
    assert result["d2h"]["moves"] >= 8 and result["h2d"]["moves"] >= 8
    assert result["d2h"]["bytes_per_move"] == 64 << 20
    plan = result["plan"]
    assert plan["rounds"] == 4 and plan["why"] == "all 4 rounds fit"
    assert plan["first_turn"]["round"] >= 1 and plan["first_switch_s"] > 0
    table = check.bandwidth({"h2d_gbps": 10.0, "d2h_gbps": 10.0, "bidir_gbps": 15.0}, {"offload": result})
    assert table["methods"]["offload"]["d2h_gbps_p50"] == result["d2h"]["gbps_p50"]
    no_leftovers()


def test_slow_switches_plan_fewer_rounds_and_the_run_still_passes() -> None:
    # 64 MiB at 0.2 GB/s: about 0.3 s a copy, so a turn (park, restore, verify, fill) over a second;
    # 20 rounds would take some 50 s, and the slot is 18 s.
    timeout = TAIL_S + 8
    result = check.run_backend(
        "offload", gib=MIB_64, rounds=20, torch="off", timeout=timeout, plan=True, host_memory=0.2
    )
    assert result["ok"], result
    assert 1 <= result["rounds"] < 20 and result["rounds_done"] == result["rounds"]
    assert result["rounds_asked"] == 20
    assert result["plan"]["needed_s"] <= result["plan"]["left_s"]
    assert not result["errors"]  # it ended by itself: nothing timed out, nothing was killed
    for job in result["jobs"].values():
        assert job["rounds_done"] == result["rounds"]
    no_leftovers()


def test_the_daemon_killed_before_its_first_restore_is_taken_over_without_a_lost_byte() -> None:
    result = check.run_backend(
        "offload", gib=MIB_64, rounds=3, torch="off", timeout=60, plan=True, host_memory=0, crash_at="before-restore"
    )
    assert result["ok"], result
    assert result["restarts"] == 1 and result["data_errors"] == 0 and result["rounds_done"] == 3
    no_leftovers()


def test_a_run_that_overruns_its_slot_is_stopped_and_reported() -> None:
    # Copies so slow that not even the first turns fit: the run is cut at its timeout and its processes stopped.
    result = check.run_backend("offload", gib=MIB_64, rounds=2, torch="off", timeout=4, plan=True, host_memory=0.02)
    assert not result["ok"]
    assert any("timed out after 4s; the jobs were killed" in e for e in result["errors"]), result["errors"]
    no_leftovers()


# --- the whole check on a stand-in GPU ----------------------------------------------------------

FAKE_CEILING = """\
import json
print(json.dumps({{"ok": True, "h2d_gbps": 50.0, "d2h_gbps": 48.0, "bidir_gbps": 80.0, "bidir_h2d_gbps": 40.0,
    "bidir_d2h_gbps": 40.0, "nvml_sees_own_pid": {{"ok": {seen}, "pid": 4321, "nvml_pids": [777]}}}}))
"""


@pytest.fixture
def stand_in_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[bool], None]:
    """NVML, cuda-python and the ceiling answer as on a GPU; the offload runs use host memory."""
    bindings = install.installed_version("cuda-bindings") or "13.0.2"
    major = int(bindings.split(".")[0])
    monkeypatch.setattr(
        install, "read_driver", lambda timeout=15.0: install.DriverInfo("580.65", major * 1000, 1, "nvml")
    )
    monkeypatch.setattr(install, "deps_dir", lambda cuda: tmp_path / "deps")
    gpu = {"name": "Stand-in H200", "driver": "580.65", "cuda_python": bindings, "checkpoint_api": "ok"}
    monkeypatch.setattr(check, "preflight", lambda timeout=15.0: dict(gpu))
    monkeypatch.setattr(check, "gpu_processes", lambda timeout=10.0: {})
    real = check.run_backend

    def on_host(backend: str, **kw: Any) -> dict[str, Any]:
        return real(backend, **{**kw, "host_memory": 0})

    monkeypatch.setattr(check, "run_backend", on_host)

    def ceiling(seen: bool) -> None:
        script = tmp_path / "ceiling.py"
        script.write_text(FAKE_CEILING.format(seen=seen))
        monkeypatch.setattr(check, "CEILING", script)

    return ceiling


def test_the_whole_check_passes_on_a_stand_in_gpu(stand_in_gpu: Callable[[bool], None], capsys: Any) -> None:
    stand_in_gpu(True)
    argv = ["--backends", "offload", "--gib", "0.0625", "--crash-gib", "0.0625", "--rounds", "3", "--no-pytest"]
    code = check.main([*argv, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert problems(doc) == []
    assert code == 0 and doc["ok"], json.dumps(doc["stages"], indent=1)
    assert list(doc["stages"]) == ["preflight", "install", "cuda", "ceiling", "offload", "crash", "cleanup"]
    assert doc["stages"]["install"]["installed"] == []
    assert doc["stages"]["offload"]["rounds"] == 3 and doc["stages"]["crash"]["restarts"] == 1
    assert doc["bandwidth"]["ceiling"]["bidir_gbps"] == 80.0
    assert doc["bandwidth"]["methods"]["offload"]["d2h_of_ceiling"] is not None
    assert doc["backends"]["offload"]["data_errors"] == 0
    no_leftovers()


def test_cuda_checkpoint_runs_where_nvml_cannot_see_the_probe_and_says_so(
    stand_in_gpu: Callable[[bool], None], capsys: Any
) -> None:
    """The backend finds a job's processes through the driver, not NVML, and measures footprints from used memory
    where NVML's PIDs are not its own: the stage used to end before it started, so that case was never tried."""
    stand_in_gpu(False)
    code = check.main(["--gib", "0.0625", "--crash-gib", "0.0625", "--rounds", "2", "--no-pytest", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert problems(doc) == []
    stage = doc["stages"]["cuda-checkpoint"]
    assert stage["notes"] == [
        "NVML does not list the probe's PID 4321 among the GPU's processes (it lists 777): footprints come from "
        "each GPU's used memory across a checkpoint, not NVML's per-process figures"
    ]
    # it ran: on this stand-in its daemon finds no NVML library, and says so
    assert code == 1 and doc["stage"] == "cuda-checkpoint" and "NVML is not available" in doc["error"]
    assert doc["stages"]["offload"]["ok"] is True  # the other backend still ran
    assert doc["stages"]["crash"] == {
        "ok": None,
        "error": None,
        "seconds": None,
        "skipped": "the cuda-checkpoint stage failed",
    }
    no_leftovers()


def test_a_daemon_that_cannot_park_with_the_method_ends_the_run_with_its_reason() -> None:
    # This machine has no NVIDIA driver: the cuda-checkpoint daemon refuses to start, and says why.
    if Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists():
        pytest.skip("this machine has an NVIDIA driver")
    result = check.run_backend("cuda-checkpoint", gib=MIB_64, rounds=2, torch="off", timeout=30, plan=True)
    assert not result["ok"]
    assert any("cuda-checkpoint cannot run here" in e for e in result["errors"]), result["errors"]
    assert result["jobs"] == {}  # no job was started
    no_leftovers()


@pytest.mark.parametrize("no_gpu", [True, False])
def test_a_package_the_install_could_not_bring_is_not_reported_as_no_gpu(
    stand_in_gpu: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch, capsys: Any, no_gpu: bool
) -> None:
    """Exit status 2 says "no usable GPU"; a machine without network whose install failed used to get it too."""
    stand_in_gpu(True)
    failed = {"ok": False, "error": "pip could not install msgpack (exit status 1): no network", "installed": []}
    monkeypatch.setattr(install, "ensure", lambda *a, **k: dict(failed))

    def preflight(timeout: float = 15.0) -> dict[str, Any]:
        if no_gpu:
            raise check.PreflightError("no GPU: the driver lists no device")
        raise check.PreflightError("timesliced cannot be imported (No module named 'msgpack')", no_gpu=False)

    monkeypatch.setattr(check, "preflight", preflight)
    code = check.main(["--backends", "offload", "--gib", "0.0625", "--rounds", "2", "--no-pytest", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["stage"] == "install" and not doc["ok"]  # the first stage that failed
    cuda = doc["stages"]["cuda"]["error"]
    if no_gpu:
        assert code == 2 and cuda == "no GPU: the driver lists no device"
    else:
        assert code == 1 and "the install stage failed: pip could not install msgpack" in cuda
    no_leftovers()
