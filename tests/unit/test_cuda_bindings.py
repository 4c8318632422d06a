"""Bindings that fit the driver, and a daemon driver that sees every GPU: the probe's checks, without a GPU.

The requirement helpers are held to pyproject.toml's extras and to pip's own reading of them; the
probe is driven over the fake driver and over stand-in bindings shaped like the releases that lack
checkpoint pieces. The probe takes CUDA_VISIBLE_DEVICES away for the driver's initialisation, which
the fake reads as cuInit does.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from tests.fakes.cuda_driver import CUresult, FakeCheckpointDriver, FakeGpuMemory, gpu_uuid, visible_devices
from timesliced import errors
from timesliced.backends import cuda_checkpoint, cuda_driver
from timesliced.backends.cuda_checkpoint import GpuFacts, probe
from timesliced.backends.cuda_driver import (
    KNOWN_BAD_BINDINGS,
    REQUIRED_BINDINGS,
    CudaDriver,
    bindings_requirement,
    format_uuid,
    install_command,
)

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def linux_probe(driver: Any = None, **options: Any) -> Any:
    options.setdefault("environ", {})  # whatever this machine's CUDA_VISIBLE_DEVICES, the same answer
    return probe(driver, system="Linux", machine="x86_64", **options)


def node(
    gpus: int = 2, *, env: dict[str, str] | None = None, **options: Any
) -> tuple[FakeCheckpointDriver, dict[str, str]]:
    environ = {} if env is None else env
    memory = FakeGpuMemory({i: 10 * GiB for i in range(gpus)})
    return FakeCheckpointDriver(memory, environ=environ, **options), environ


def facts(*persistent: int, gpus: int = 2) -> list[GpuFacts]:
    return [GpuFacts(i, gpu_uuid(i), i in persistent) for i in range(gpus)]


# --- the requirement that fits a driver ---------------------------------------------------------


@pytest.mark.parametrize(
    ("cuda", "allowed", "refused"),
    [
        (12080, ["12.8.0", "12.9.7", "12.9.10"], ["12.6.2", "13.0.2", "13.4.4"]),
        (12090, ["12.9.0"], ["13.1.0"]),
        (13000, ["13.0.2", "13.0.3", "13.3.1", "13.4.4", "13.5.0"], ["12.9.7", "13.0.0", "13.0.1", "13.3.0", "14.0.0"]),
        (13040, ["13.2.0"], ["13.3.0"]),
    ],
)
def test_the_requirement_takes_the_drivers_major_and_leaves_out_broken_releases(
    cuda: int, allowed: list[str], refused: list[str]
) -> None:
    requirement = Requirement(bindings_requirement(cuda))
    assert requirement.name == "cuda-bindings"
    assert [v for v in allowed if not requirement.specifier.contains(v)] == []
    assert [v for v in refused if requirement.specifier.contains(v)] == []


def test_a_future_major_gets_its_own_bindings_and_an_old_driver_none() -> None:
    assert bindings_requirement(14010) == bindings_requirement(13000)  # a newer driver runs the newest bindings
    with pytest.raises(ValueError, match=r"CUDA 12\.4 has no checkpoint API"):
        bindings_requirement(12040)


def test_the_install_command_is_shell_quoted() -> None:
    assert install_command(13000) == "pip install 'cuda-bindings>=13.0.2,!=13.3.0,<14'"


def test_the_extras_are_the_requirements() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and newer")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda12"] == [bindings_requirement(12080)]
    assert extras["cuda13"] == [bindings_requirement(13000)]
    (any_major,) = extras["cuda"]
    spec = Requirement(any_major).specifier
    assert not [v for v in KNOWN_BAD_BINDINGS if spec.contains(v)]
    assert spec.contains("12.8.0") and spec.contains("13.4.4") and not spec.contains("14.0.0")


def test_the_known_bad_releases_are_the_ones_whose_pieces_are_checked() -> None:
    # Every piece a known-bad release lacks is one CudaDriver requires.
    for lacks in KNOWN_BAD_BINDINGS.values():
        named = [name for name in REQUIRED_BINDINGS if name in lacks]
        assert named, lacks


# --- bindings the probe refuses ---------------------------------------------------------------


def bindings_module(*, without: tuple[str, ...] = (), cuda_version: int = 13000, **calls: Any) -> Any:
    """A module shaped like cuda.bindings.driver (only the names the seam looks for), minus ``without``."""
    module = types.SimpleNamespace(CUDA_VERSION=cuda_version, cuInit=lambda flags: (0,))
    for name in REQUIRED_BINDINGS:
        setattr(module, name, lambda *args: (0,))
    for name, fn in calls.items():
        setattr(module, name, fn)
    for name in without:
        delattr(module, name)
    return module


@pytest.mark.parametrize(
    ("version", "without"),
    [
        ("13.0.1", ("cuCheckpointProcessRestore", "CUcheckpointRestoreArgs")),
        ("13.3.0", ("CUcheckpointRestoreArgs",)),
    ],
)
def test_a_release_without_checkpoint_pieces_is_refused_with_the_command_that_fits(
    monkeypatch: pytest.MonkeyPatch, version: str, without: tuple[str, ...]
) -> None:
    module = bindings_module(without=without)
    monkeypatch.setattr(cuda_checkpoint, "CudaDriver", lambda: CudaDriver(module, version))
    verdict = linux_probe(nvml_cuda_version=13000)
    assert not verdict.ok
    assert f"cuda-bindings {version} lacks the checkpoint API ({KNOWN_BAD_BINDINGS[version]})" in verdict.reason
    assert (
        "run pip install 'cuda-bindings>=13.0.2,!=13.3.0,<14' (the NVIDIA driver supports CUDA 13.0)" in verdict.reason
    )
    assert verdict.details["missing"] == list(without)
    assert verdict.details["nvml_cuda_version"] == "13.0"


def test_without_nvmls_cuda_version_the_refusal_names_both_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    module = bindings_module(without=("CUcheckpointRestoreArgs",))
    monkeypatch.setattr(cuda_checkpoint, "CudaDriver", lambda: CudaDriver(module, "13.3.0"))
    reason = linux_probe().reason
    assert "timesliced[cuda12]" in reason and "timesliced[cuda13]" in reason and "13.3.0" in reason


def test_missing_cuda_python_names_the_command_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    verdict = linux_probe(nvml_cuda_version=12080)
    assert not verdict.ok and "cuda-python is not installed" in verdict.reason
    assert "pip install 'cuda-bindings>=12.8,<13'" in verdict.reason


def test_a_known_bad_release_is_refused_by_its_version_too() -> None:
    driver, env = node(bindings_version="13.3.0", bindings_cuda_version=13030)
    verdict = linux_probe(driver, environ=env)
    assert (
        not verdict.ok and "cuda-bindings 13.3.0 cannot checkpoint: it lost CUcheckpointRestoreArgs" in verdict.reason
    )
    assert driver.init_calls == 0


def test_newer_bindings_than_the_driver_whose_calls_fail_are_named_by_nvmls_version() -> None:
    class FunctionNotFoundError(RuntimeError):
        pass

    def missing(*args: Any) -> Any:
        raise FunctionNotFoundError("function cuDriverGetVersion is not found")

    driver = CudaDriver(bindings_module(cuDriverGetVersion=missing, cuda_version=13040), "13.4.4")
    verdict = linux_probe(driver, nvml_driver_version=lambda: "570.86.15", nvml_cuda_version=12080, environ={})
    assert not verdict.ok
    assert verdict.reason.startswith(
        "cuda-bindings 13.4.4 is built for CUDA 13 but the NVIDIA driver supports CUDA 12.8"
    )
    assert "pip install 'cuda-bindings>=12.8,<13'" in verdict.reason


def test_older_bindings_on_a_newer_driver_work_and_say_what_would_match() -> None:
    driver, env = node(cuda_version=13000, bindings_version="12.9.7", bindings_cuda_version=12090)
    verdict = linux_probe(driver, environ=env)
    assert verdict.ok
    assert "backward compatible" in verdict.details["bindings_note"]
    assert "pip install 'cuda-bindings>=13.0.2,!=13.3.0,<14'" in verdict.details["bindings_note"]


# --- the daemon's driver sees every GPU -------------------------------------------------------


@pytest.mark.parametrize("narrowing", ["1", "GPU-00000001", ""])
def test_an_inherited_cuda_visible_devices_is_taken_away_for_cuinit_and_put_back(
    narrowing: str, caplog: pytest.LogCaptureFixture
) -> None:
    driver, env = node(env={"CUDA_VISIBLE_DEVICES": narrowing, "HOME": "/root"})
    with caplog.at_level(logging.WARNING, logger="timesliced.backends.cuda_checkpoint"):
        verdict = linux_probe(driver, gpus=facts(), environ=env)
    assert verdict.ok, verdict.reason
    assert driver.seen_visible_devices is None and driver.visible == [gpu_uuid(0), gpu_uuid(1)]
    assert verdict.reach == {0: "driver", 1: "driver"}
    assert verdict.details["cleared_env"] == {"CUDA_VISIBLE_DEVICES": narrowing}
    assert env == {"CUDA_VISIBLE_DEVICES": narrowing, "HOME": "/root"}  # put back for what reads it later
    assert f"CUDA_VISIBLE_DEVICES={narrowing} is set for the daemon" in caplog.text


def test_the_fake_driver_does_narrow_what_cuinit_sees() -> None:
    # The check above can fail: a driver initialised with the variable sees one GPU.
    driver, _ = node(env={"CUDA_VISIBLE_DEVICES": "1"})
    driver.init()
    assert driver.devices() == (CUresult.CUDA_SUCCESS, [gpu_uuid(1)])
    uuids = [gpu_uuid(i) for i in range(3)]
    assert visible_devices(uuids, "2,0") == [uuids[2], uuids[0]]
    assert visible_devices(uuids, "0,7,1") == [uuids[0]]  # the first entry naming no GPU ends the list
    assert visible_devices(uuids, "GPU-00000002") == [uuids[2]]
    assert visible_devices(uuids, "GPU-0000") == []  # ambiguous prefix


def test_a_driver_initialised_earlier_with_fewer_gpus_is_refused() -> None:
    driver, env = node(env={"CUDA_VISIBLE_DEVICES": "1"})
    driver.init()  # an embedding program used CUDA before the daemon started
    verdict = linux_probe(driver, gpus=facts(), environ=env)
    assert not verdict.ok
    assert f"does not see GPU 0 ({gpu_uuid(0)})" in verdict.reason
    assert "a CUDA driver this process initialised earlier keeps what it saw" in verdict.reason
    assert "nvidia-smi -pm 1" in verdict.reason and "no CUDA_VISIBLE_DEVICES" in verdict.reason
    assert verdict.details["unreachable"] == [0]


def test_persistence_mode_lets_restores_reach_a_gpu_the_driver_does_not_see() -> None:
    driver, env = node(env={"CUDA_VISIBLE_DEVICES": "1"})
    driver.init()
    verdict = linux_probe(driver, gpus=facts(0), environ=env)
    assert verdict.ok and verdict.reach == {0: "persistence", 1: "driver"}


def test_a_gpu_hidden_from_the_daemon_otherwise_is_refused_without_blaming_the_variable() -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB})
    driver = FakeCheckpointDriver(memory, gpu_uuids=[gpu_uuid(1)], environ={})  # e.g. no access to /dev/nvidia0
    verdict = linux_probe(driver, gpus=facts(), environ={})
    assert not verdict.ok and "does not see GPU 0" in verdict.reason and "earlier" not in verdict.reason


def test_uuids_match_whatever_their_case() -> None:
    driver, env = node(gpus=1)
    assert linux_probe(driver, gpus=[GpuFacts(0, gpu_uuid(0).upper())], environ=env).ok


# --- CudaDriver's device listing over stand-in bindings ------------------------------------------


def test_format_uuid_spells_a_cuuuid_as_nvml_does() -> None:
    raw = bytes.fromhex("8932f937d72c4106c12f20bd9faed9f6")
    assert format_uuid(raw) == "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


def test_cuda_driver_lists_its_devices_and_stops_at_a_failure() -> None:
    uuids = {0: bytes(range(16)), 1: bytes(range(16, 32))}
    module = bindings_module(
        cuDeviceGetCount=lambda: (0, 2),
        cuDeviceGet=lambda ordinal: (0, ordinal),
        cuDeviceGetUuid=lambda dev: (0, types.SimpleNamespace(bytes=uuids[dev])),
    )
    assert CudaDriver(module, "13.4.4").devices() == (0, [format_uuid(uuids[0]), format_uuid(uuids[1])])
    module.cuDeviceGetUuid = lambda dev: (101, None)  # CUDA_ERROR_INVALID_DEVICE
    assert CudaDriver(module, "13.4.4").devices() == (101, [])
    module.cuDeviceGetCount = lambda: (3, None)  # CUDA_ERROR_NOT_INITIALIZED
    assert CudaDriver(module, "13.4.4").devices() == (3, [])


def test_cuda_driver_knows_whether_its_init_succeeded() -> None:
    results = iter([100, 0])  # CUDA_ERROR_NO_DEVICE, then success
    driver = CudaDriver(bindings_module(cuInit=lambda flags: (next(results),)), "13.4.4")
    assert driver.init() == 100 and not driver.initialized
    assert driver.init() == 0 and driver.initialized


# --- the requirement for this node, from NVML ----------------------------------------------------


def test_requirement_here_reads_nvmls_cuda_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fakes.nvml import FakeGpu, FakeNvml

    FakeNvml([FakeGpu()], driver="580.65.06", cuda=13000).install(monkeypatch)
    assert cuda_driver.requirement_here() == "cuda-bindings>=13.0.2,!=13.3.0,<14"
    FakeNvml([FakeGpu()], driver="550.54.15", cuda=12040).install(monkeypatch)
    with pytest.raises(errors.BackendUnavailable, match=r"550\.54\.15: CUDA 12\.4 has no checkpoint API"):
        cuda_driver.requirement_here()


def test_main_prints_the_requirement_or_says_why_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cuda_driver, "requirement_here", lambda: "cuda-bindings>=12.8,<13")
    assert cuda_driver.main() == 0 and capsys.readouterr().out == "cuda-bindings>=12.8,<13\n"

    def no_nvml() -> str:
        raise errors.BackendUnavailable("NVML cannot tell this node's CUDA version: no driver")

    monkeypatch.setattr(cuda_driver, "requirement_here", no_nvml)
    assert cuda_driver.main() == 2
    assert capsys.readouterr().err == "timesliced: NVML cannot tell this node's CUDA version: no driver\n"
