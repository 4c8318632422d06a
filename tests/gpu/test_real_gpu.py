"""Quick checks of the real backends on a real GPU (each well under 30 s there).

The longer measured run is ``check.py``; ``check.sh`` runs both.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from timesliced.backends import cuda_checkpoint
from timesliced.client.offload import CudaDeviceMemory, Offloader
from timesliced.config import DaemonConfig
from timesliced.daemon.parking import open_parking
from timesliced.errors import NotResident

from . import check

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

MiB = 1 << 20


def used_memory(nvml: Any, gpu: int = 0) -> int:
    """Device memory in use on ``gpu`` as NVML reports it (every process and the driver's own)."""
    sample = next(s for s in nvml.sample() if s.index == gpu)
    assert sample.memory_used is not None, sample.errors
    return int(sample.memory_used)


def settle(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Whether ``predicate`` became true within ``timeout`` (NVML's figures may trail the driver a little)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def _no_directives(job: str, action: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    raise AssertionError(f"no offload directive expected, got {action} for {job}")


def test_nvml_sees_a_gpu_and_auto_picks_cuda_checkpoint(gpu: dict[str, Any], nvml: Any, tmp_path: Path) -> None:
    assert gpu["count"] >= 1 and nvml.devices(), "NVML lists no GPU"
    verdict = cuda_checkpoint.probe(nvml_driver_version=lambda: nvml.driver_version)
    assert verdict.ok, f"the checkpoint API cannot run here: {verdict.reason} ({verdict.details})"
    parking = open_parking(DaemonConfig(state_dir=tmp_path / "state", backend="auto"), _no_directives)
    try:
        assert parking.default == "cuda-checkpoint", parking.why
        assert parking.device_source == "nvml"
        assert parking.describe()["methods"]["cuda-checkpoint"] == "available"
    finally:
        asyncio.run(parking.aclose())


def test_offloader_round_trip_keeps_the_pointer_and_frees_the_gpu(nvml: Any) -> None:
    nbytes = 256 * MiB
    rng = random.Random(20250101)
    data = b"".join(rng.randbytes(MiB) for _ in range(nbytes // MiB))  # randbytes caps at 2**31 bits
    memory = CudaDeviceMemory()
    offloader = Offloader(memory, verify=True)
    try:
        region = offloader.alloc(nbytes, tag="weights")
        region.write(data)
        ptr = region.ptr
        before = used_memory(nvml)

        parked = offloader.park()
        assert parked.nbytes == nbytes and parked.verified
        assert not region.resident
        assert settle(lambda: before - used_memory(nvml) >= nbytes * 3 // 4), (
            f"NVML used memory went from {before} to {used_memory(nvml)} after parking {nbytes} bytes"
        )
        low = used_memory(nvml)
        with pytest.raises(NotResident):
            region.read(0, 16)

        restored = offloader.unpark()  # verify=True: raises if any byte differs from the parked copy
        assert restored.nbytes == nbytes and restored.verified
        assert region.resident and region.ptr == ptr
        assert region.read() == data
        assert settle(lambda: used_memory(nvml) - low >= nbytes * 3 // 4)
    finally:
        offloader.close()
        memory.close()


@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy:UserWarning")
def test_torch_offload_round_trip_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch is installed without CUDA")
    from timesliced.client.offload import TorchOffload

    device = torch.device("cuda", 0)
    model = torch.nn.Linear(1024, 1024).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device=device)).square().mean().backward()
    optimizer.step()
    big = torch.arange(64 * MiB, dtype=torch.int32, device=device)  # 256 MiB
    tensors = [big, *model.parameters(), *(v for s in optimizer.state.values() for v in s.values() if v.is_cuda)]
    expected = [t.detach().cpu().clone() for t in tensors]

    offload = TorchOffload(verify=True)
    offload.register(big, tag="weights", name="big")
    offload.register(model, tag="weights")
    offload.register(optimizer, tag="optimizer")
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(device)

    parked = offload.park()
    assert parked.nbytes >= 256 * MiB
    assert big.untyped_storage().nbytes() == 0 and big.numel() == 64 * MiB  # parked per storage: shape kept
    assert torch.cuda.memory_allocated(device) <= allocated - 256 * MiB

    restored = offload.unpark()
    assert restored.verified and restored.nbytes == parked.nbytes
    for t, want in zip(tensors, expected, strict=True):
        assert t.is_cuda and torch.equal(t.detach().cpu(), want)
    model(torch.randn(8, 1024, device=device)).sum().backward()  # still a working model
    optimizer.step()


def test_cuda_ordinals_match_nvml_by_uuid() -> None:
    """The client numbers a process's CUDA devices by UUID (CUDA's and NVML's must agree on real hardware)."""
    from timesliced.client.gpus import discover

    numbering = discover()
    assert not numbering.problem and numbering.nodes is not None and numbering.nodes, numbering


def test_the_driver_says_a_live_process_without_cuda_has_no_state() -> None:
    """``CUDA_ERROR_NOT_INITIALIZED`` (or ``INVALID_VALUE``) for a live non-CUDA PID means "no CUDA state"."""
    import subprocess

    from timesliced.backends.cuda_driver import CudaDriver, no_cuda_state

    driver = CudaDriver()
    driver.init()
    child = subprocess.Popen(["sleep", "30"])
    try:
        result, _ = driver.get_state(child.pid)
        assert no_cuda_state(result), result
    finally:
        child.kill()
        child.wait()


def test_the_daemon_driver_sees_every_gpu_nvml_knows(nvml: Any) -> None:
    from timesliced.backends.cuda_driver import CudaDriver

    driver = CudaDriver()
    driver.init()
    result, uuids = driver.devices()
    assert result == 0, result
    assert {d.uuid.lower() for d in nvml.devices()} <= {u.lower() for u in uuids}


@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy:UserWarning")
def test_a_torch_park_waits_for_work_queued_on_another_stream() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch is installed without CUDA")
    from timesliced.client.offload import TorchOffload

    x = torch.zeros(64 * MiB, device="cuda")
    view = x[1:]
    offload = TorchOffload(verify=True)
    offload.register(x, tag="w")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e8))  # keeps the side stream busy before the fill lands
        x.fill_(7)
    offload.park()
    offload.unpark()
    assert bool((x == 7).all()) and view.data_ptr() - x.data_ptr() == 4  # the view still shares x's storage


def test_tensors_in_a_cuda_graph_pool_are_refused() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch is installed without CUDA")
    from timesliced.client.offload import TorchOffload

    graph, source = torch.cuda.CUDAGraph(), torch.zeros(1024, device="cuda")
    with torch.cuda.graph(graph):
        out = source * 2
    with pytest.raises(ValueError, match="private memory pool"):
        TorchOffload().register(out, tag="t")


# The two runs below plan their rounds from the first switch (at most the rounds asked), so a slow
# cuda-checkpoint toggle means fewer turns, not a timeout. check.sh leaves them out: its backend and
# crash stages run the same in full.


@pytest.mark.parametrize("backend", check.BACKENDS)
def test_two_jobs_take_turns_without_losing_a_byte(backend: str) -> None:
    result = check.run_backend(backend, gib=0.25, rounds=2, torch="off", timeout=50, plan=True)
    summary = json.dumps(result, indent=2)
    assert result["ok"], summary
    assert result["data_errors"] == 0, summary
    assert 1 <= result["rounds"] <= 2 and result["rounds_done"] == result["rounds"], summary
    assert result["restores"] >= 2, summary
    assert result["d2h"]["moves"] >= 1 and result["h2d"]["moves"] >= 1, summary


def test_kill_9_of_the_daemon_mid_switch_loses_no_byte() -> None:
    """cuda-checkpoint: the daemon dies with one job checkpointed and the other about to be restored."""
    result = check.run_backend(
        "cuda-checkpoint", gib=0.25, rounds=3, torch="off", timeout=55, crash_at="before-restore", plan=True
    )
    summary = json.dumps(result, indent=2)
    assert result["ok"], summary
    assert result["restarts"] == 1 and result["data_errors"] == 0, summary
    assert 1 <= result["rounds"] <= 3 and result["rounds_done"] == result["rounds"], summary


def test_an_offload_swap_streams_on_the_gpu(tmp_path: Path) -> None:
    """Two offload jobs with regions on GPU 0 swap through a daemon that plans the GPU as too small for both.

    The incoming job maps each region only once the outgoing one freed room for it, and its first
    map comes before the outgoing park ends (both read from the jobs' traces, around the driver's
    cuMemMap / cuMemUnmap); no byte is lost. The swap figures (streamed against park then restore,
    GB/s each way) are ``timesliced bench offload --device cuda``'s: this stage's time is short.
    """
    from timesliced.daemon.embedded import EmbeddedDaemon

    from ..helpers.offload_swap import read_trace, results, spawn_worker, streaming_problems, swaps

    # 32 regions of 2 MiB (the driver's usual granularity) per job; room for one job and a half.
    with EmbeddedDaemon(gpus=1, gpu_memory=96 * MiB, memory_headroom=0, bandwidth=0) as daemon:
        procs = [
            spawn_worker(job, daemon.socket, tmp_path / f"{job}.trace", rounds=3, regions=32, device="cuda")
            for job in ("a", "b")
        ]
        outs = results(procs, timeout=50)
    assert [o["data_errors"] for o in outs] == [0, 0] and [o["failures"] for o in outs] == [[], []], outs
    a, b = read_trace(tmp_path / "a.trace"), read_trace(tmp_path / "b.trace")
    pairs = swaps(a, b) + swaps(b, a)
    assert len(pairs) >= 3, (a, b)
    for park, unpark in pairs:
        assert streaming_problems(park, unpark) == []
