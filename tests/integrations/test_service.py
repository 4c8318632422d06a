"""The Tinker-style service: two jobs' ordinary training loops share one simulated GPU through a daemon.

Each job's device state is too big to sit beside the other's, so every turn parks one and restores
the other: the daemon moves the model's bytes to host memory and back. The results must equal, bit
for bit, the same loops run on plain memory with no daemon.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np  # the test extra has it: a missing numpy fails here rather than skipping
import pytest

from timesliced import errors
from timesliced.client.offload import HostDeviceMemory, Offloader
from timesliced.config import DaemonConfig
from timesliced.daemon.embedded import EmbeddedDaemon
from timesliced.integrations.linear import LinearModel
from timesliced.integrations.service import TrainingService

from ..helpers.daemon import serving

MiB = 1 << 20
GPU = 4 * MiB
FOOTPRINT = 3 * MiB  # what each job occupies: two do not fit on the GPU at once
STEPS = 6


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[EmbeddedDaemon]:
    config = DaemonConfig(state_dir=tmp_path / "state", backend="sim", gpus=1, gpu_memory=GPU, bandwidth=0)
    with serving(config) as embedded:
        yield embedded


def data(seed: int) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(seed)
    true_w = rng.standard_normal((16, 4)).astype(np.float32)
    batches = []
    for _ in range(STEPS):
        x = rng.standard_normal((32, 16)).astype(np.float32)
        batches.append((x, x @ true_w))
    return batches


PROMPTS = np.arange(48, dtype=np.float32).reshape(3, 16) / 48


def reference(seed: int, batches: list[tuple[Any, Any]]) -> tuple[list[float], list[Any], bytes]:
    """The same loop on plain memory: what the service must give back, bit for bit."""
    model = LinearModel(16, 4, seed=seed)
    state = memoryview(bytearray(model.nbytes))
    model.init(state)
    losses, samples = [], []
    for batch in batches:
        losses.append(model.forward_backward(state, batch)["loss"])
        model.optim_step(state, learning_rate=0.05)
        samples.append(model.sample(state, PROMPTS))
    return losses, samples, bytes(state)


def host_offloader(job: str) -> Offloader:
    """Each job's own offloader over the CPU stand-in for device memory."""
    return Offloader(HostDeviceMemory(gpus=1))


@pytest.mark.parametrize("parking", ["sim", "offload"])
def test_two_jobs_training_loops_share_one_gpu_and_get_exact_results(daemon: EmbeddedDaemon, parking: str) -> None:
    """sim: the daemon moves the jobs' simulated regions; offload: it directs each job's offloader."""
    seeds = {"sft-a": 1, "sft-b": 2}
    batches = {job: data(seed + 10) for job, seed in seeds.items()}
    offloader = host_offloader if parking == "offload" else None
    with TrainingService(
        group="gpu0", gpus=[0], address=str(daemon.socket), timeout=30, offloader=offloader
    ) as service:
        clients = {
            job: service.create_training_client(job, LinearModel(16, 4, seed=seed), device_memory=FOOTPRINT)
            for job, seed in seeds.items()
        }
        losses: dict[str, list[float]] = {job: [] for job in seeds}
        samples: dict[str, list[Any]] = {job: [] for job in seeds}
        for step in range(STEPS):  # two ordinary loops, interleaved: each step of each job waits its turn
            futures = {}
            for job, client in clients.items():
                fwd = client.forward_backward(batches[job][step])
                client.optim_step(learning_rate=0.05)
                futures[job] = (fwd, client.sample(PROMPTS))
            for job, (fwd, sample) in futures.items():
                losses[job].append(fwd.result(30)["loss"])
                samples[job].append(sample.result(30))
        finals = {job: client.state().result(30) for job, client in clients.items()}
        records = {job: list(client.slices) for job, client in clients.items()}
        status = clients["sft-a"].client.status()
        kinds = {type(c.region).__name__ for c in clients.values()}

    for job, seed in seeds.items():
        want_losses, want_samples, want_state = reference(seed, batches[job])
        assert losses[job] == want_losses  # floats compared exactly
        assert all(np.array_equal(got, want) for got, want in zip(samples[job], want_samples, strict=True))
        assert finals[job] == want_state
        assert want_losses[-1] < want_losses[0]  # it really trains
        assert any(r.restored for r in records[job])  # parked and restored: its bytes went to host memory
        assert [u for r in records[job] for u in r.units][:3] == ["forward_backward", "optim_step", "sample"]
    # Which job's worker asks first within a step is up to the threads, but each step's first turn
    # finds the other job resident (the two never fit together), so every step restores one at least.
    assert sum(r.restored for rs in records.values() for r in rs) >= STEPS
    assert not np.array_equal(samples["sft-a"][-1], samples["sft-b"][-1])
    assert {j["job"] for j in status["jobs"]} == set(seeds)  # one job each, no more
    assert kinds == {"SimRegion" if parking == "sim" else "Region"}


def test_the_units_work_on_the_device_bytes(daemon: EmbeddedDaemon) -> None:
    """The bit-for-bit check above can fail: the units read the job's device region, not a host copy."""
    with TrainingService(group="gpu0", address=str(daemon.socket), timeout=30) as service:
        client = service.create_training_client("sft", LinearModel(4, 2))
        before = client.state().result(30)
        with client.client.slice(10):
            client.region.write((7).to_bytes(8, "little"))  # the Adam step count, changed on the device
        assert client.optim_step(learning_rate=0.1).result(30) == {"step": 8}
        after = client.state().result(30)
        assert after[:8] == (8).to_bytes(8, "little") and before[:8] == bytes(8)


def test_a_failing_unit_fails_its_future_and_the_job_goes_on(daemon: EmbeddedDaemon) -> None:
    with TrainingService(group="gpu0", address=str(daemon.socket), timeout=30) as service:
        client = service.create_training_client("sft", LinearModel(4, 2))
        bad = client.forward_backward((np.ones((3, 5)), np.ones((3, 2))))  # 5 inputs for a 4-input model
        good = client.forward_backward((np.ones((3, 4)), np.ones((3, 2))))
        with pytest.raises(ValueError):
            bad.result(30)
        assert good.result(30)["loss"] > 0
        with pytest.raises(ValueError, match="has a training client already"):
            service.create_training_client("sft", LinearModel(4, 2))
        client.close()  # as the message says: closed, the job may have one again
        again = service.create_training_client("sft", LinearModel(4, 2))
        assert again.sample(np.ones((1, 4))).result(30).shape == (1, 2)
    with pytest.raises(RuntimeError, match="is closed"):
        client.sample(np.ones((1, 4)))


def test_a_unit_that_cannot_get_its_turn_fails_with_the_acquire_error(daemon: EmbeddedDaemon) -> None:
    import timesliced

    with (
        timesliced.Client("hog", "gpu0", address=str(daemon.socket)) as hog,
        TrainingService(group="gpu0", address=str(daemon.socket), timeout=0.3) as service,
    ):
        client = service.create_training_client("sft", LinearModel(4, 2))
        hog.acquire(10)
        with pytest.raises(errors.AcquireTimeout):
            client.sample(np.ones((1, 4))).result(30)
        hog.release()
        assert client.sample(np.ones((1, 4))).result(30).shape == (1, 2)


def test_no_daemon_is_a_connection_error(tmp_path: Path) -> None:
    service = TrainingService(address=str(tmp_path / "nothing.sock"), timeout=1)
    with pytest.raises(errors.ConnectionLost):
        service.create_training_client("sft", LinearModel(4, 2))
    assert service.clients == {}
