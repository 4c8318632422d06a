"""Which parking methods a node offers, and which GPUs it schedules (``--backend``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from timesliced import errors
from timesliced.backends import cuda_checkpoint
from timesliced.config import DaemonConfig
from timesliced.daemon.parking import Parking, open_parking
from timesliced.env import default_sim_dir

from ..fakes.nvml import FakeGpu, FakeNvml

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
