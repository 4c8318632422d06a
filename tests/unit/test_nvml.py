"""The NVML seam: opening, sampling and the GpuMemory protocol, against a fake NVML at pynvml's boundary."""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import pytest

from tests.fakes.nvml import FakeGpu, FakeNvml, GiB, pynvml
from timesliced import errors
from timesliced.backends.base import DeviceInfo, GpuMemory
from timesliced.nvml import PROC_PID_INIT_INO, GpuSample, Nvml, NvmlState, pid_view


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Two GPUs: an H100 with two processes, an idle A100."""
    gpus = [
        FakeGpu(used=30 * GiB, util_gpu=87, util_memory=40, processes=[(1001, 20 * GiB), (1002, 10 * GiB)]),
        FakeGpu(name="NVIDIA A100-SXM4-40GB", total=40 * GiB, uuid="GPU-a100"),
    ]
    return FakeNvml(gpus).install(monkeypatch)


def has_nvml_library() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


# --- no NVML ---------------------------------------------------------------------------------


@pytest.mark.skipif(has_nvml_library(), reason="this machine has an NVIDIA driver")
def test_real_pynvml_without_a_driver_reports_unavailable_and_never_raises() -> None:
    nvml = Nvml.open()
    assert not nvml.available
    assert nvml.state is NvmlState.NO_LIBRARY
    assert "libnvidia-ml.so.1" in nvml.reason and "not found" in nvml.reason
    assert nvml.devices() == [] and nvml.sample() == []
    assert nvml.driver_version == "" and nvml.driver_major == 0 and nvml.cuda_driver_version == 0
    with pytest.raises(errors.BackendUnavailable, match="not found"):
        nvml.free_bytes(0)
    with pytest.raises(errors.BackendUnavailable):
        nvml.process_memory()
    assert nvml.describe()["state"] == "no_library"
    nvml.close()  # nothing was initialised: nothing to shut down, no error
    assert nvml.state is NvmlState.NO_LIBRARY


def test_missing_package_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    nvml = Nvml.open()
    assert nvml.state is NvmlState.NO_PACKAGE
    assert "nvidia-ml-py" in nvml.reason


@pytest.mark.parametrize(
    ("code", "state", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, NvmlState.NO_LIBRARY, "not found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, NvmlState.DRIVER_NOT_LOADED, "not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, NvmlState.NO_PERMISSION, "permission"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, NvmlState.VERSION_MISMATCH, "different versions"),
        (pynvml.NVML_ERROR_UNKNOWN, NvmlState.FAILED, "Unknown Error"),
    ],
)
def test_init_errors_map_to_a_state_and_reason(
    monkeypatch: pytest.MonkeyPatch, code: int, state: NvmlState, words: str
) -> None:
    fake = FakeNvml(init_error=code).install(monkeypatch)
    nvml = Nvml.open()
    assert nvml.state is state and not nvml.available
    assert words in nvml.reason
    nvml.close()
    assert fake.shutdowns == 0  # a failed nvmlInit is not shut down


def test_an_error_after_init_shuts_nvml_down_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count_error=pynvml.NVML_ERROR_UNKNOWN).install(monkeypatch)
    nvml = Nvml.open()
    assert nvml.state is NvmlState.FAILED
    assert nvml.reason == "NVML failed to start: Unknown Error"
    assert fake.refcount == 0 and fake.shutdowns == 1


def test_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([]).install(monkeypatch)
    nvml = Nvml.open()
    assert nvml.state is NvmlState.NO_DEVICES and nvml.reason == "NVML lists no GPUs"
    assert fake.refcount == 0


# --- opening -----------------------------------------------------------------------------------


def test_open_reads_driver_and_devices(fake: FakeNvml) -> None:
    nvml = Nvml.open()
    assert nvml.available and nvml.state is NvmlState.OPEN and nvml.reason == ""
    assert nvml.driver_version == "570.86.15" and nvml.driver_major == 570
    assert nvml.cuda_driver_version == 12080 and nvml.cuda_version == "12.8"
    assert nvml.devices() == [
        DeviceInfo(0, 80 * GiB, "NVIDIA H100 80GB HBM3", "GPU-00000000-0000-4000-8000-000000000000"),
        DeviceInfo(1, 40 * GiB, "NVIDIA A100-SXM4-40GB", "GPU-a100"),
    ]
    assert nvml.skipped == {}
    assert nvml.describe() == {
        "available": True,
        "state": "open",
        "reason": None,
        "driver": "570.86.15",
        "cuda": "12.8",
        "skipped": {},
    }
    assert fake.refcount == 1
    nvml.close()


def test_close_shuts_down_once_and_leaves_a_closed_handle(fake: FakeNvml) -> None:
    nvml = Nvml.open()
    nvml.close()
    nvml.close()
    assert fake.shutdowns == 1 and fake.refcount == 0
    assert nvml.state is NvmlState.CLOSED and not nvml.available
    assert nvml.devices() == [] and nvml.sample() == []
    with pytest.raises(errors.BackendUnavailable, match="closed"):
        nvml.free_bytes(0)
    with Nvml.open() as again:  # NVML can be opened again
        assert again.available
    assert fake.refcount == 0


@pytest.mark.parametrize(
    ("version", "major"), [("570.86.15", 570), ("535.104.05", 535), ("580", 580), ("", 0), ("N/A", 0)]
)
def test_driver_major(monkeypatch: pytest.MonkeyPatch, version: str, major: int) -> None:
    FakeNvml(driver=version).install(monkeypatch)
    with Nvml.open() as nvml:
        assert nvml.driver_major == major


def test_failing_optional_queries_do_not_stop_open(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([FakeGpu(fail={"name": pynvml.NVML_ERROR_UNKNOWN, "uuid": pynvml.NVML_ERROR_NOT_SUPPORTED})])
    fake.install(monkeypatch)

    def no_version() -> str:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", no_version)
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", no_version)
    with Nvml.open() as nvml:
        assert nvml.available
        assert nvml.devices() == [DeviceInfo(0, 80 * GiB, "GPU 0", "")]
        assert nvml.driver_version == "" and nvml.driver_major == 0
        assert nvml.cuda_driver_version == 0 and nvml.cuda_version == ""


def test_gpus_without_permission_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    denied = {"handle": pynvml.NVML_ERROR_NO_PERMISSION}
    FakeNvml([FakeGpu(fail=denied), FakeGpu(name="usable")]).install(monkeypatch)
    with Nvml.open() as nvml:
        assert [d.index for d in nvml.devices()] == [1]
        assert nvml.skipped == {0: "Insufficient Permissions"}
        assert nvml.describe()["skipped"] == {"0": "Insufficient Permissions"}
        with pytest.raises(errors.UnknownDevice):
            nvml.free_bytes(0)


@pytest.mark.parametrize(
    ("fails", "state"),
    [
        ([{"handle": pynvml.NVML_ERROR_NO_PERMISSION}] * 2, NvmlState.NO_PERMISSION),
        (
            [{"handle": pynvml.NVML_ERROR_NO_PERMISSION}, {"memory": pynvml.NVML_ERROR_GPU_IS_LOST}],
            NvmlState.NO_DEVICES,
        ),
    ],
)
def test_no_usable_gpu_makes_nvml_unavailable(
    monkeypatch: pytest.MonkeyPatch, fails: list[dict[str, int]], state: NvmlState
) -> None:
    fake = FakeNvml([FakeGpu(fail=f) for f in fails]).install(monkeypatch)
    nvml = Nvml.open()
    assert nvml.state is state
    assert nvml.reason.startswith("no usable GPU (GPU 0: Insufficient Permissions; GPU 1: ")
    assert fake.refcount == 0


# --- sampling ----------------------------------------------------------------------------------


def test_sample_reports_memory_utilization_and_processes(fake: FakeNvml) -> None:
    with Nvml.open() as nvml:
        first, second = nvml.sample()
    assert first == GpuSample(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-00000000-0000-4000-8000-000000000000",
        memory_total=80 * GiB,
        memory_used=30 * GiB,
        memory_free=50 * GiB,
        utilization_gpu=87,
        utilization_memory=40,
        processes={1001: 20 * GiB, 1002: 10 * GiB},
    )
    assert second.index == 1 and second.processes == {} and second.utilization_gpu == 0
    assert second.memory_free == 40 * GiB and second.errors == ()


def test_sample_follows_the_device(fake: FakeNvml) -> None:
    with Nvml.open() as nvml:
        fake.gpus[0].used, fake.gpus[0].util_gpu, fake.gpus[0].processes = 1 * GiB, 3, []
        s = nvml.sample()[0]
    assert (s.memory_used, s.utilization_gpu, s.processes) == (1 * GiB, 3, {})


@pytest.mark.parametrize("raw", [False, True])
def test_unreported_process_memory_counts_zero(monkeypatch: pytest.MonkeyPatch, raw: bool) -> None:
    gpu = FakeGpu(processes=[(7, None), (8, 5 * GiB)])
    FakeNvml([gpu], raw_not_available=raw).install(monkeypatch)
    with Nvml.open() as nvml:
        assert nvml.sample()[0].processes == {7: 0, 8: 5 * GiB}
        assert nvml.process_memory() == {7: {0: 0}, 8: {0: 5 * GiB}}


@pytest.mark.parametrize("raw", [False, True])
def test_unreported_process_memory_is_told_apart_from_none(monkeypatch: pytest.MonkeyPatch, raw: bool) -> None:
    # Listed with NVML_VALUE_NOT_AVAILABLE: the process holds a context, its size unknown.
    gpus = [FakeGpu(processes=[(7, None), (8, 5 * GiB)]), FakeGpu(processes=[(7, 2 * GiB)])]
    FakeNvml(gpus, raw_not_available=raw).install(monkeypatch)
    with Nvml.open() as nvml:
        assert nvml.process_memory_reported() == {7: {0: None, 1: 2 * GiB}, 8: {0: 5 * GiB}}


def test_a_process_listed_twice_on_one_gpu_is_summed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under MIG, one process may appear once per GPU instance.
    FakeNvml([FakeGpu(processes=[(7, 1 * GiB), (7, 2 * GiB), (9, 1 * GiB), (9, None)])]).install(monkeypatch)
    with Nvml.open() as nvml:
        assert nvml.sample()[0].processes == {7: 3 * GiB, 9: 1 * GiB}
        assert nvml.process_memory_reported() == {7: {0: 3 * GiB}, 9: {0: None}}  # one unknown part: unknown


def test_one_failing_query_leaves_the_rest(fake: FakeNvml) -> None:
    fake.gpus[0].fail["utilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    with Nvml.open() as nvml:
        s = nvml.sample()[0]
    assert s.utilization_gpu is None and s.utilization_memory is None
    assert s.memory_used == 30 * GiB and s.processes == {1001: 20 * GiB, 1002: 10 * GiB}
    assert s.errors == ("utilization: Not Supported",)


def test_a_lost_gpu_still_appears_and_the_others_report(fake: FakeNvml) -> None:
    with Nvml.open() as nvml:
        for query in ("memory", "utilization", "processes"):
            fake.gpus[0].fail[query] = pynvml.NVML_ERROR_GPU_IS_LOST
        lost, fine = nvml.sample()
    assert (lost.memory_total, lost.memory_used, lost.memory_free, lost.utilization_gpu) == (None,) * 4
    assert lost.processes == {}
    assert lost.errors == ("memory: GPU is lost", "utilization: GPU is lost", "processes: GPU is lost")
    assert fine.errors == () and fine.memory_total == 40 * GiB


def test_process_getter_falls_back_to_v2_on_an_older_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([FakeGpu(processes=[(5, 1)])], process_getters=("v2",)).install(monkeypatch)
    with Nvml.open() as nvml:
        assert nvml.sample()[0].processes == {5: 1}
        assert nvml.sample()[0].processes == {5: 1}
    getters = [c for c in fake.calls if c.startswith("nvmlDeviceGetComputeRunningProcesses")]
    # v3 is tried once; once v2 answered, it is used directly.
    assert getters == [
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v2",
    ]


def test_v3_is_used_when_the_driver_has_it(fake: FakeNvml) -> None:
    with Nvml.open() as nvml:
        nvml.sample()
    getters = {c for c in fake.calls if c.startswith("nvmlDeviceGetComputeRunningProcesses")}
    assert getters == {"nvmlDeviceGetComputeRunningProcesses_v3"}


def test_no_process_getter_at_all_is_a_field_error(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml([FakeGpu(util_gpu=5)], process_getters=()).install(monkeypatch)
    with Nvml.open() as nvml:
        s = nvml.sample()[0]
        assert s.errors == ("processes: Function Not Found",)
        assert s.utilization_gpu == 5
        with pytest.raises(errors.BackendError, match="processes on GPU 0: Function Not Found"):
            nvml.process_memory()


# --- GpuMemory ---------------------------------------------------------------------------------


def test_gpu_memory_protocol(fake: FakeNvml) -> None:
    fake.gpus[1].processes = [(1001, 4 * GiB), (3000, 1 * GiB)]
    with Nvml.open() as opened:
        nvml: GpuMemory = opened
        assert nvml.free_bytes(0) == 50 * GiB
        assert nvml.free_bytes(1) == 40 * GiB
        assert nvml.process_memory() == {
            1001: {0: 20 * GiB, 1: 4 * GiB},
            1002: {0: 10 * GiB},
            3000: {1: 1 * GiB},
        }


def test_what_cuda_checkpoint_reads(fake: FakeNvml) -> None:
    fake.gpus[0].persistence = True
    with Nvml.open() as opened:
        nvml = opened
        assert (nvml.used_bytes(0), nvml.used_bytes(1)) == (30 * GiB, 0)
        assert opened.persistence_mode(0) is True and opened.persistence_mode(1) is False
        fake.gpus[1].fail["persistence"] = pynvml.NVML_ERROR_NOT_SUPPORTED
        assert opened.persistence_mode(1) is None
        fake.gpus[1].fail["memory"] = pynvml.NVML_ERROR_GPU_IS_LOST
        with pytest.raises(errors.BackendError, match="memory of GPU 1: GPU is lost"):
            nvml.used_bytes(1)
        with pytest.raises(errors.UnknownDevice):
            opened.persistence_mode(5)


@pytest.mark.parametrize(
    ("link", "shared", "words"),
    [
        (f"pid:[{PROC_PID_INIT_INO}]", True, "host's PID namespace"),
        ("pid:[4026532512]", False, "PID namespace 4026532512, not the host's"),
        ("pid:[garbage]", None, "unexpected"),
        (OSError(13, "Permission denied"), None, "Permission denied"),
    ],
)
def test_pid_view_compares_the_pid_namespace_with_the_hosts(link: Any, shared: bool | None, words: str) -> None:
    def readlink(path: str) -> str:
        assert path == "/proc/self/ns/pid"
        if isinstance(link, OSError):
            raise link
        return str(link)

    view = pid_view(readlink)
    assert view.shared is shared and words in view.why


def test_pid_view_here_answers_without_raising() -> None:
    view = pid_view()
    assert view.shared in (True, False, None) and view.why


def test_gpu_memory_errors(fake: FakeNvml) -> None:
    with Nvml.open() as nvml:
        with pytest.raises(errors.UnknownDevice) as unknown:
            nvml.free_bytes(2)
        assert unknown.value.details == {"gpu": 2}
        fake.gpus[0].fail["memory"] = pynvml.NVML_ERROR_GPU_IS_LOST
        with pytest.raises(errors.BackendError, match="memory of GPU 0: GPU is lost") as lost:
            nvml.free_bytes(0)
        assert lost.value.details == {"gpu": 0}
        fake.gpus[1].fail["processes"] = pynvml.NVML_ERROR_UNKNOWN
        with pytest.raises(errors.BackendError, match="GPU 1: Unknown Error"):
            nvml.process_memory()


# --- threads -----------------------------------------------------------------------------------


def _block_on(fake: FakeNvml, query: str) -> tuple[threading.Event, threading.Event]:
    """Make ``query`` wait: returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()

    def hook(name: str) -> None:
        if name == query and threading.current_thread() is not threading.main_thread():
            entered.set()
            assert release.wait(10), "test did not release the blocked query"

    fake.on_call = hook
    return entered, release


def test_close_waits_for_a_query_in_flight(fake: FakeNvml) -> None:
    nvml = Nvml.open()
    entered, release = _block_on(fake, "nvmlDeviceGetUtilizationRates")
    results: list[list[GpuSample]] = []
    sampler = threading.Thread(target=lambda: results.append(nvml.sample()))
    sampler.start()
    assert entered.wait(10)
    closer = threading.Thread(target=nvml.close)
    closer.start()
    closer.join(0.05)
    assert closer.is_alive() and fake.shutdowns == 0  # close waits for the sample
    release.set()
    sampler.join(10)
    closer.join(10)
    assert len(results[0]) == 2
    assert fake.shutdowns == 1 and fake.calls[-1] == "nvmlShutdown"


def test_close_gives_up_on_a_hung_query(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("timesliced.nvml._CLOSE_WAIT", 0.01)
    nvml = Nvml.open()
    entered, release = _block_on(fake, "nvmlDeviceGetMemoryInfo")
    sampler = threading.Thread(target=nvml.sample)
    sampler.start()
    try:
        assert entered.wait(10)
        nvml.close()
        assert nvml.state is NvmlState.CLOSED and fake.shutdowns == 0  # leaked, not shut down under a query
    finally:
        release.set()
        sampler.join(10)
