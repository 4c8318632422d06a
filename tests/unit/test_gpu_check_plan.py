"""The GPU check's pieces around a backend run: the plan files the jobs share, the figures, the early ends."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import check, runner, workload
from tests.gpu.workload import FIRST_TURN, PLAN, Round, announce, planned_rounds, write_once

# --- the plan files ---------------------------------------------------------------------------


def test_write_once_creates_the_file_once_and_leaves_no_scratch(tmp_path: Path) -> None:
    path = tmp_path / PLAN
    assert write_once(path, {"rounds": 3})
    assert not write_once(path, {"rounds": 9})
    assert json.loads(path.read_text()) == {"rounds": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == [PLAN]


@pytest.mark.parametrize(
    ("content", "asked", "planned"),
    [(None, 10, None), ({"rounds": 4}, 10, 4), ({"rounds": 40}, 10, 10), ({"rounds": 0}, 10, 1), ({"x": 1}, 10, None)],
)
def test_planned_rounds(tmp_path: Path, content: dict[str, Any] | None, asked: int, planned: int | None) -> None:
    if content is not None:
        write_once(tmp_path / PLAN, content)
    assert planned_rounds(tmp_path, asked) == planned


def test_a_half_written_plan_is_no_plan(tmp_path: Path) -> None:
    (tmp_path / PLAN).write_text('{"rounds": ')
    assert planned_rounds(tmp_path, 10) is None


def turn(rnd: int = 1) -> Round:
    return Round(rnd, restored=True, switch_s=30.5, waited_s=31.0, verify_s=0.4, fill_s=0.3, done=True)


def test_the_first_restored_turn_is_announced_and_the_plan_waited_for(tmp_path: Path) -> None:
    write_once(tmp_path / PLAN, {"rounds": 2})  # the check answers at once
    assert announce(tmp_path, "check-a", turn(), asked=10, timeout=5) is None
    first = json.loads((tmp_path / FIRST_TURN).read_text())
    assert first["job"] == "check-a" and first["round"] == 1
    assert (first["switch_s"], first["verify_s"], first["fill_s"]) == (30.5, 0.4, 0.3)


def test_only_the_first_job_announces(tmp_path: Path) -> None:
    write_once(tmp_path / FIRST_TURN, {"job": "check-b", "round": 1})
    assert announce(tmp_path, "check-a", turn(), asked=10, timeout=5) is None
    assert json.loads((tmp_path / FIRST_TURN).read_text())["job"] == "check-b"
    assert not (tmp_path / PLAN).exists()  # it did not wait for, nor write, a plan


def test_a_job_that_waits_in_vain_writes_every_round_as_the_plan_for_all(tmp_path: Path) -> None:
    note = announce(tmp_path, "check-a", turn(), asked=10, timeout=0.05)
    assert note is not None and "no plan within" in note
    assert planned_rounds(tmp_path, 10) == 10  # the other job reads the same
    # The check, coming late, cannot replace it.
    assert not write_once(tmp_path / PLAN, {"rounds": 1})
    assert planned_rounds(tmp_path, 10) == 10


def test_the_check_plans_from_the_announced_turn(tmp_path: Path) -> None:
    run = check.BackendRun("cuda-checkpoint", tmp_path, check._quiet, plan=True)
    assert run.plan_dir is not None
    run.plan_dir.mkdir()
    run.maybe_plan(10, deadline=check.time.monotonic() + 100)
    assert run.plan is None  # nothing announced yet
    write_once(
        run.plan_dir / FIRST_TURN, {"job": "check-a", "round": 1, "switch_s": 30.0, "verify_s": 0.5, "fill_s": 0.5}
    )
    run.maybe_plan(10, deadline=check.time.monotonic() + 100)
    assert run.plan is not None and run.plan["rounds"] == 1 and run.plan["first_switch_s"] == 30.0
    assert planned_rounds(run.plan_dir, 10) == 1


# --- figures -------------------------------------------------------------------------------


def job_report(data_errors: int = 0, rounds: int = 2) -> dict[str, Any]:
    turns = [{"round": r, "restored": r > 0, "switch_s": 0.5, "verify_s": 0.1, "done": True} for r in range(rounds + 1)]
    return {
        "ok": data_errors == 0,
        "rounds": turns,
        "rounds_done": rounds,
        "nbytes": 1 << 30,
        "data_errors": data_errors,
    }


def move(at: float, kind: str, nbytes: int = 1 << 30) -> dict[str, Any]:
    return {"at": at, "job": "check-a", "kind": kind, "nbytes": nbytes, "seconds": 0.1, "gbps": nbytes / 0.1 / 1e9}


def summarize(reports: dict[str, dict[str, Any]], moves: list[dict[str, Any]]) -> dict[str, Any]:
    return check.summarize("offload", reports, moves, 2, errors=[], notes=[], faults={}, missed=0, seconds=1.0)


def test_a_data_error_in_one_job_fails_the_backend() -> None:
    moves = [move(1, "snapshot"), move(2, "restore")]
    good = summarize({"check-a": job_report(), "check-b": job_report()}, moves)
    assert good["ok"] and good["data_errors"] == 0
    bad = summarize({"check-a": job_report(), "check-b": job_report(data_errors=1)}, moves)
    assert not bad["ok"] and bad["data_errors"] == 1
    assert "1 chunks did not hold what their job wrote" in check._errors_text(bad)


def test_bandwidth_puts_every_method_next_to_the_ceiling() -> None:
    moves = [move(1, "snapshot"), move(2, "restore")]
    result = summarize({"check-a": job_report(), "check-b": job_report()}, moves)
    ceiling = {"h2d_gbps": 21.5, "d2h_gbps": 10.74, "bidir_gbps": 30.0, "bidir_h2d_gbps": 15.0, "bidir_d2h_gbps": 15.0}
    check.against_ceiling(result, ceiling)
    table = check.bandwidth(ceiling, {"offload": result})
    assert table["ceiling"] == ceiling
    got = table["methods"]["offload"]
    assert got["d2h_gbps_p50"] == pytest.approx(10.737, rel=1e-3)
    assert got["d2h_of_ceiling"] == pytest.approx(1.0, rel=1e-3) and got["h2d_of_ceiling"] == pytest.approx(
        0.5, rel=1e-2
    )
    assert check.bandwidth(None, {})["ceiling"] is None


# --- cuda-checkpoint ends early where NVML cannot see this PID namespace ------------------------


class Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def test_an_empty_first_snapshot_with_the_jobs_missing_from_nvml_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "gpu_processes", lambda timeout=10.0: {90001: 5 << 30, 90002: 5 << 30})
    run = check.BackendRun("cuda-checkpoint", tmp_path, check._quiet)
    jobs: Any = {"check-a": Proc(101), "check-b": Proc(102)}
    assert run.unseen_pids(jobs) is None  # no snapshot yet: nothing to tell
    run.moves[(1.0, "check-a", "snapshot")] = move(1.0, "snapshot", nbytes=0)
    why = run.unseen_pids(jobs)
    assert why is not None and "101, 102" in why and "90001, 90002" in why and "--pid=host" in why
    assert run.unseen_pids(jobs) is None  # asked once


@pytest.mark.parametrize(("nbytes", "visible"), [(1 << 30, {}), (0, {101: 1 << 30})])
def test_a_snapshot_that_moved_bytes_or_a_visible_job_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int, visible: dict[int, int]
) -> None:
    monkeypatch.setattr(check, "gpu_processes", lambda timeout=10.0: visible)
    run = check.BackendRun("cuda-checkpoint", tmp_path, check._quiet)
    run.moves[(1.0, "check-a", "snapshot")] = move(1.0, "snapshot", nbytes=nbytes)
    assert run.unseen_pids({"check-a": Proc(101), "check-b": Proc(102)}) is None  # type: ignore[dict-item]


def test_the_cuda_checkpoint_stage_runs_when_the_probe_is_not_seen_and_notes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend finds processes through the driver and measures from used memory where NVML's PIDs are not
    its own: the stage runs, and its notes say why its footprints are not NVML's per-process figures."""
    ran: list[str] = []

    def run_backend(name: str, **kw: Any) -> dict[str, Any]:
        ran.append(name)
        return {"ok": True, "rounds": 1, "rounds_asked": 1, "data_errors": 0, "d2h": {"gbps_p50": 10.0}}

    monkeypatch.setattr(check, "run_backend", run_backend)
    run = runner.Run(deadline_s=270, children=check.CHILDREN, stages=["cuda-checkpoint"], out=io.StringIO())
    ceiling = {"nvml_sees_own_pid": {"ok": False, "pid": 4321, "nvml_pids": [777]}, "d2h_gbps": 40.0}
    run.report.update(backends={}, ceiling=ceiling)
    check.Check(run, check.build_parser().parse_args([]), ["cuda-checkpoint"], tmp_path).backend("cuda-checkpoint")
    entry = run.report["stages"]["cuda-checkpoint"]
    assert ran == ["cuda-checkpoint"] and entry["ok"] is True
    assert entry["notes"] == [
        "NVML does not list the probe's PID 4321 among the GPU's processes (it lists 777): footprints come from "
        "each GPU's used memory across a checkpoint, not NVML's per-process figures"
    ]
    assert run.report["backends"]["cuda-checkpoint"]["d2h"]["of_ceiling"] == 0.25


def test_the_host_stand_in_refuses_calls_it_does_not_have() -> None:
    from timesliced.client.offload import HostDeviceMemory

    cu = workload.HostDriver(HostDeviceMemory())
    with pytest.raises(workload.CudaError, match="cuMemAlloc failed: CUDA_ERROR_NOT_SUPPORTED"):
        cu("cuMemAlloc", 1 << 20)


def test_the_parser_keeps_the_deadline_under_five_minutes_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(check.DEADLINE_ENV, raising=False)
    assert check.build_parser().parse_args([]).deadline == 270
    monkeypatch.setenv(check.DEADLINE_ENV, "200")
    assert check.build_parser().parse_args([]).deadline == 200
    assert isinstance(check.build_parser().parse_args(["--deadline", "120"]), argparse.Namespace)


def test_the_cuda_checkpoint_stage_ends_early_when_the_api_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "run_backend", lambda *a, **kw: pytest.fail("the backend must not run"))
    run = runner.Run(deadline_s=270, children=check.CHILDREN, stages=["cuda-checkpoint"], out=io.StringIO())
    why = "NVIDIA driver 560.35 found; the CUDA checkpoint API needs driver 570 or newer"
    run.report.update(backends={}, gpu={"checkpoint_api": why}, ceiling=None)
    check.Check(run, check.build_parser().parse_args([]), ["cuda-checkpoint"], tmp_path).backend("cuda-checkpoint")
    entry = run.report["stages"]["cuda-checkpoint"]
    assert entry["ok"] is False and entry["error"] == f"ended early: the driver's checkpoint API cannot run here: {why}"
