"""Which parking methods a node offers, and which GPUs it schedules (``--backend``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from timesliced import errors, nvml
from timesliced.backends import cuda_checkpoint
from timesliced.config import DaemonConfig
from timesliced.daemon.parking import Parking, open_parking
from timesliced.env import default_sim_dir
from timesliced.wire import status as schema

from ..fakes.cuda_driver import FakeCheckpointDriver, FakeGpuMemory
from ..fakes.nvml import FakeGpu, FakeNvml
from ..helpers import status_docs

GiB = 1 << 30


async def no_directives(job: str, action: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    raise AssertionError("no offload directive expected")


class Opened:
    """Builds ``Parking`` for a config and closes what it opened."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.opened: list[Parking] = []

    def __call__(self, backend: str, **settings: Any) -> Parking:
        config = DaemonConfig(state_dir=self.tmp_path / "state", backend=backend, gpus=2, gpu_memory=64 << 20)
        for key, value in settings.items():
            setattr(config, key, value)
        parking = open_parking(config, no_directives)
        self.opened.append(parking)
        return parking

    def close(self) -> None:
        import asyncio
        import shutil

        for parking in self.opened:
            asyncio.run(parking.aclose())
        shutil.rmtree(default_sim_dir(self.tmp_path / "state"), ignore_errors=True)


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Opened]:
    o = Opened(tmp_path)
    yield o
    o.close()


class StubCheckpoint:
    name = "cuda-checkpoint"

    def __init__(self, memory: Any, **options: Any) -> None:
        self.memory = memory
        self.options = options

    async def aclose(self) -> None:
        pass


def test_sim_simulates_gpus_and_offers_every_method_but_cuda_checkpoint(opened: Opened) -> None:
    p = opened("sim")
    assert (p.default, p.device_source) == ("sim", "sim")
    assert [(d.index, d.capacity) for d in p.devices] == [(0, 64 << 20), (1, 64 << 20)]
    methods = p.describe()["methods"]
    assert [m for m, v in methods.items() if v == "available"] == ["sim", "offload", "vllm", "sglang"]
    assert "simulates" in methods["cuda-checkpoint"]
    with pytest.raises(errors.BackendUnavailable, match=r"cuda-checkpoint.*simulates its GPUs"):
        p.backend("cuda-checkpoint")


def test_auto_without_a_driver_falls_back_to_sim_and_says_why(opened: Opened) -> None:
    p = opened("auto")  # this machine has no NVIDIA driver
    assert (p.default, p.device_source) == ("sim", "sim")
    assert p.why.startswith("auto: ") and len(p.why) > len("auto: ")
    assert p.nvml is None


def test_auto_with_a_capable_driver_picks_cuda_checkpoint_on_real_gpus(
    opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeNvml([FakeGpu(total=80 * GiB), FakeGpu(total=80 * GiB)], driver="575.51.03").install(monkeypatch)
    monkeypatch.setattr(cuda_checkpoint, "open_backend", lambda memory, **kw: StubCheckpoint(memory, **kw))
    p = opened("auto", lock_timeout=3.0)
    assert (p.default, p.device_source) == ("cuda-checkpoint", "nvml")
    assert p.why == "auto: the driver supports checkpoints"
    assert [(d.index, d.capacity) for d in p.devices] == [(0, 80 * GiB), (1, 80 * GiB)]
    backend = p.backend("cuda-checkpoint")
    assert isinstance(backend, StubCheckpoint) and backend.options == {"lock_timeout": 3.0}
    assert backend.memory is p.nvml  # the backend reads live memory figures from NVML
    assert "real GPUs" in p.describe()["methods"]["sim"]


def test_auto_with_gpus_but_no_checkpoint_support_keeps_sim(opened: Opened, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml([FakeGpu()], driver="550.54.15").install(monkeypatch)

    def refuse(memory: Any, **kw: Any) -> Any:
        raise errors.BackendUnavailable("the driver is 550.54.15; the checkpoint API needs 570 or newer")

    monkeypatch.setattr(cuda_checkpoint, "open_backend", refuse)
    p = opened("auto")
    assert (p.default, p.device_source) == ("sim", "sim")
    assert "550.54.15" in p.why and "570" in p.why


def test_an_explicit_cuda_checkpoint_without_a_driver_is_a_clear_error(opened: Opened) -> None:
    with pytest.raises(errors.BackendUnavailable, match="cuda-checkpoint cannot run here: "):
        opened("cuda-checkpoint")


@pytest.mark.parametrize("method", ["offload", "vllm", "sglang"])
def test_other_defaults_simulate_gpus_where_there_is_no_driver(opened: Opened, method: str) -> None:
    p = opened(method)
    assert (p.default, p.device_source) == (method, "sim")
    assert p.backend(method).name == method


def test_offload_on_real_gpus(opened: Opened, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml([FakeGpu(total=141 * GiB)]).install(monkeypatch)
    monkeypatch.setattr(cuda_checkpoint, "open_backend", lambda memory, **kw: StubCheckpoint(memory, **kw))
    p = opened("offload")
    assert (p.default, p.device_source) == ("offload", "nvml")
    assert p.devices[0].capacity == 141 * GiB
    assert p.backend("cuda-checkpoint").name == "cuda-checkpoint"  # a job may still ask for it


def test_an_unknown_backend(opened: Opened) -> None:
    with pytest.raises(errors.BackendUnavailable, match="unknown backend 'teleport'"):
        opened("teleport")


# --- the cuda-checkpoint probe, through NVML and the driver seam ---------------------------------


@pytest.fixture
def linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.system", lambda: "Linux")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")


def fake_driver(monkeypatch: pytest.MonkeyPatch, gpus: int = 2) -> FakeCheckpointDriver:
    """The driver seam the probe builds, as a fake over ``gpus`` GPUs whose UUIDs are the NVML fake's."""
    memory = FakeGpuMemory({i: 80 * GiB for i in range(gpus)})
    driver = FakeCheckpointDriver(memory, cuda_version=13000, environ=os.environ)
    monkeypatch.setattr(cuda_checkpoint, "CudaDriver", lambda: driver)
    return driver


def test_a_sim_node_describes_no_checkpoint_probe(opened: Opened) -> None:
    assert opened("sim").describe()["checkpoint"] is None


@pytest.mark.usefixtures("linux")
def test_a_container_node_parks_whole_processes_and_says_how_it_weighs_them(
    opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeNvml([FakeGpu(), FakeGpu(persistence=True)], driver="580.65.06", cuda=13000).install(monkeypatch)
    driver = fake_driver(monkeypatch)
    monkeypatch.setattr(nvml, "pid_view", lambda: nvml.PidView(False, "the daemon is in PID namespace 4026532512"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # inherited from whoever started the daemon

    p = opened("auto")

    assert (p.default, p.device_source) == ("cuda-checkpoint", "nvml")
    assert driver.initialized and driver.seen_visible_devices is None  # cuInit saw every GPU
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    doc = p.describe()
    assert schema.problems(doc, schema.Parking) == []
    checkpoint = doc["checkpoint"]
    assert checkpoint is not None
    assert checkpoint["footprints"] == "gpu-delta"
    assert checkpoint["footprints_why"].startswith("the daemon is in PID namespace 4026532512")
    assert checkpoint["restore_gpus"] == {"0": "driver", "1": "driver"}
    assert checkpoint["cleared_env"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert (checkpoint["bindings"], checkpoint["cuda"]) == ("13.0.2", "13.0")


@pytest.mark.usefixtures("linux")
def test_a_host_node_weighs_by_nvmls_per_process_figures(opened: Opened, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml([FakeGpu()], driver="580.65.06", cuda=13000).install(monkeypatch)
    fake_driver(monkeypatch, gpus=1)
    monkeypatch.setattr(nvml, "pid_view", lambda: nvml.PidView(True, "the daemon is in the host's PID namespace"))
    checkpoint = opened("cuda-checkpoint").describe()["checkpoint"]
    assert checkpoint is not None and checkpoint["footprints"] == "per-process"


@pytest.mark.usefixtures("linux")
def test_a_gpu_the_daemons_driver_cannot_reach_keeps_cuda_checkpoint_off(
    opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeNvml([FakeGpu(), FakeGpu()], driver="580.65.06", cuda=13000).install(monkeypatch)
    driver = fake_driver(monkeypatch)
    driver.gpu_uuids = driver.gpu_uuids[1:]  # GPU 0's device node is not in the daemon's container
    p = opened("auto")
    assert p.default == "sim" and "does not see GPU 0" in p.why
    with pytest.raises(errors.BackendUnavailable, match=r"does not see GPU 0.*persistence mode"):
        opened("cuda-checkpoint")


def test_the_checkpoint_builder_holds_to_the_schema() -> None:
    doc = {**status_docs.parking("cuda-checkpoint"), "checkpoint": status_docs.checkpoint_probe()}
    assert schema.problems(doc, schema.Parking) == []
    doc["checkpoint"]["restore_gpus"] = {"0": 1}
    assert schema.problems(doc, schema.Parking) == ["status.checkpoint.restore_gpus['0']: expected str, got int"]
