"""A stand-in for the NVML C library, installed at pynvml's function boundary.

``FakeNvml(...).install(monkeypatch)`` replaces the ``pynvml`` functions that
timesliced calls. The replacements answer the way pynvml's own wrappers do:
they return pynvml's real ctypes structs (``c_nvmlMemory_t``,
``c_nvmlUtilization_t``), process lists built from ``c_nvmlProcessInfo_v3_t``
through ``nvmlStructToFriendlyObject`` (with ``usedGpuMemory`` None where the
driver reports NVML_VALUE_NOT_AVAILABLE), device handles of pynvml's
``c_nvmlDevice_t`` pointer type, and they raise real ``pynvml.NVMLError``
subclasses. Everything above that boundary is the real code. Test modules take
``pynvml`` from here, so that they are skipped where nvidia-ml-py is missing.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

# nvidia-ml-py is pure Python and needs no driver; without it, the tests that use this fake are skipped.
pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")

GiB = 1 << 30
NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value

# Query names usable in FakeGpu.fail.
QUERIES = ("handle", "name", "uuid", "memory", "utilization", "processes", "persistence")


def nvml_error(code: int) -> Exception:
    """The exception pynvml raises for ``code`` (an ``NVMLError`` subclass such as ``NVMLError_NotSupported``)."""
    error: Exception = pynvml.NVMLError(code)
    return error


@dataclass
class FakeGpu:
    """One fake GPU; change its fields between samples to move its figures."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""  # "" -> a fixed UUID derived from the index
    total: int = 80 * GiB
    used: int = 0
    util_gpu: int = 0
    util_memory: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes); None: not reported
    persistence: bool = False  # persistence mode (nvidia-smi -pm 1)
    fail: dict[str, int] = field(default_factory=dict)  # query (see QUERIES) -> NVML_ERROR_* code it raises


class FakeNvml:
    """The NVML library as seen through pynvml, with GPUs described by :class:`FakeGpu`."""

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        driver: str = "570.86.15",
        cuda: int = 12080,
        init_error: int | None = None,
        count_error: int | None = None,
        process_getters: tuple[str, ...] = ("v3", "v2"),
        raw_not_available: bool = False,
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.driver = driver
        self.cuda = cuda
        self.init_error = init_error
        self.count_error = count_error
        self.process_getters = process_getters  # which _vN getters the "driver" has
        self.raw_not_available = raw_not_available  # hand back the raw sentinel instead of None
        self.refcount = 0
        self.inits = 0
        self.shutdowns = 0
        self.calls: list[str] = []
        self.on_call: Callable[[str], None] | None = None  # called before every query (e.g. to block)
        self._lock = threading.Lock()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlSystemGetDriverVersion",
            "nvmlSystemGetCudaDriverVersion",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetName",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetPersistenceMode",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetComputeRunningProcesses_v3",
        ):
            monkeypatch.setattr(pynvml, name, getattr(self, name))
        return self

    # --- library life cycle ------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        with self._lock:
            self.refcount += 1
            self.inits += 1

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        with self._lock:
            if self.refcount == 0:
                raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
            self.refcount -= 1
            self.shutdowns += 1

    # --- system ------------------------------------------------------------------------

    def nvmlSystemGetDriverVersion(self) -> str:
        self._initialized("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._initialized("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._initialized("nvmlDeviceGetCount")
        if self.count_error is not None:
            raise nvml_error(self.count_error)
        return len(self.gpus)

    # --- devices -----------------------------------------------------------------------

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._initialized("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._maybe_fail(self.gpus[index], "handle")
        # A real nvmlDevice_t pointer type; its address encodes the index (never dereferenced).
        return ctypes.cast(ctypes.c_void_p(index + 1), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle, "name", "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu = self._gpu(handle, "uuid", "nvmlDeviceGetUUID")
        index = self._index(handle)
        return gpu.uuid or f"GPU-{index:08x}-0000-4000-8000-{index:012x}"

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu(handle, "memory", "nvmlDeviceGetMemoryInfo")
        if version:
            mem2 = pynvml.c_nvmlMemory_v2_t()
            mem2.version = version
            mem2.total, mem2.used, mem2.free, mem2.reserved = gpu.total, gpu.used, gpu.total - gpu.used, 0
            return mem2
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used, mem.free = gpu.total, gpu.used, gpu.total - gpu.used
        return mem

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "utilization", "nvmlDeviceGetUtilizationRates")
        util = pynvml.c_nvmlUtilization_t()
        util.gpu, util.memory = gpu.util_gpu, gpu.util_memory
        return util

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        # pynvml returns the nvmlEnableState_t value: NVML_FEATURE_ENABLED (1) or NVML_FEATURE_DISABLED (0).
        gpu = self._gpu(handle, "persistence", "nvmlDeviceGetPersistenceMode")
        return pynvml.NVML_FEATURE_ENABLED if gpu.persistence else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self._processes(handle, "v3")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._processes(handle, "v2")

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        # pynvml's unversioned wrapper calls _v3 and turns FunctionNotFound into NVMLLibraryMismatchError.
        try:
            return self._processes(handle, "v3")
        except pynvml.NVMLError_FunctionNotFound:
            raise pynvml.NVMLLibraryMismatchError("unversioned function called") from None

    # --- helpers -----------------------------------------------------------------------

    def _processes(self, handle: Any, version: str) -> list[Any]:
        name = f"nvmlDeviceGetComputeRunningProcesses_{version}"
        if version not in self.process_getters:
            self._call(name)
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        gpu = self._gpu(handle, "processes", name)
        out = []
        for pid, nbytes in gpu.processes:
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid = pid
            info.usedGpuMemory = NOT_AVAILABLE if nbytes is None else nbytes
            obj = pynvml.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == NOT_AVAILABLE and not self.raw_not_available:
                obj.usedGpuMemory = None  # what pynvml's getters do with the sentinel
            out.append(obj)
        return out

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.on_call is not None:
            self.on_call(name)

    def _initialized(self, name: str) -> None:
        self._call(name)
        if self.refcount == 0:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _index(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        if not address or address > len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return address - 1

    def _gpu(self, handle: Any, query: str, name: str) -> FakeGpu:
        self._initialized(name)
        gpu = self.gpus[self._index(handle)]
        self._maybe_fail(gpu, query)
        return gpu

    @staticmethod
    def _maybe_fail(gpu: FakeGpu, query: str) -> None:
        code = gpu.fail.get(query)
        if code is not None:
            raise nvml_error(code)
