"""The narrow seam over NVML, NVIDIA's management library (the ``pynvml`` module of ``nvidia-ml-py``).

Everything timesliced asks the driver about a real GPU goes through :class:`Nvml`:
which GPUs there are, the driver version, memory, utilization and the processes
that hold device memory. Nothing else imports ``pynvml`` but ``client/gpus.py``, which reads the GPUs' UUIDs to
number a process's CUDA devices (the client may not import this module).

- :meth:`Nvml.open` never raises for a machine without a usable driver: it returns
  a handle whose ``available`` is false and whose ``state`` / ``reason`` say why
  (package missing, library not found, driver not loaded, no permission, no GPUs).
- Every method is a plain blocking call into the C library. Async code runs them
  in a worker thread (``asyncio.to_thread``), never on the event loop.
- One :class:`Nvml` may be used from several threads; ``close()`` waits for a call
  in flight, so shutting NVML down never races a query.

GPU indices are NVML's, which follow PCI bus order. CUDA numbers devices fastest
first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is set, and renumbers them under
``CUDA_VISIBLE_DEVICES``; the UUID is the stable name of a device.

Process IDs come from the kernel driver, which does not support PID namespaces: they
are always the PIDs of the initial (host) PID namespace, whatever namespace the caller is in
(NVIDIA's answer in NVIDIA/nvidia-docker#1483: "anytime you query it for the set of
processes that are using GPUs, you will always get the host pids"). Inside a container
without the host's PID namespace they do not match ``os.getpid()`` nor ``/proc``;
:func:`pid_view` tells which case this process is in.
"""

from __future__ import annotations

import enum
import importlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import Any

from . import errors
from .backends.base import DeviceInfo

log = logging.getLogger(__name__)

# NVML_VALUE_NOT_AVAILABLE for an unsigned long long field. pynvml's process getters
# already turn it into None; a raw value is handled too, in case one slips through.
_NOT_AVAILABLE = (1 << 64) - 1

# Newest first: the first one the installed library has is used.
_PROCESS_GETTERS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
)

_CLOSE_WAIT = 5.0  # seconds close() waits for a query in flight before it gives up on nvmlShutdown

# The inode of the initial PID namespace, as /proc/<pid>/ns/pid shows it: PROC_PID_INIT_INO
# (0xEFFFFFFC) in the kernel's include/linux/proc_ns.h, fixed since Linux 3.8.
PROC_PID_INIT_INO = 0xEFFFFFFC


class NvmlState(enum.Enum):
    """Whether NVML could be opened, and if not, why."""

    OPEN = "open"
    NO_PACKAGE = "no_package"  # nvidia-ml-py is not installed
    NO_LIBRARY = "no_library"  # libnvidia-ml.so.1 not found: no NVIDIA driver installed
    DRIVER_NOT_LOADED = "driver_not_loaded"
    NO_PERMISSION = "no_permission"
    VERSION_MISMATCH = "version_mismatch"  # user-space library and kernel driver differ
    NO_DEVICES = "no_devices"
    FAILED = "failed"  # any other NVML error while opening
    CLOSED = "closed"


# Error name in pynvml -> (state, what to tell the operator).
_OPEN_ERRORS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        NvmlState.NO_LIBRARY,
        "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver is installed",
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": (NvmlState.DRIVER_NOT_LOADED, "the NVIDIA kernel driver is not loaded"),
    "NVML_ERROR_NO_PERMISSION": (NvmlState.NO_PERMISSION, "no permission to use NVML (check access to /dev/nvidia*)"),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        NvmlState.VERSION_MISMATCH,
        "the NVML library and the loaded kernel driver are different versions (reload the driver or reboot)",
    ),
}


@dataclass(frozen=True)
class GpuSample:
    """What NVML said about one GPU at one moment.

    A field is ``None`` when its query failed; ``errors`` says which and why
    (``"utilization: Not Supported"``), and the other fields are still filled in.

    ``utilization_gpu`` is NVML's percentage (0..100) of time over its last sample
    period, between 1/6 s and 1 s depending on the product, during which one or more
    kernels were executing. A single small kernel counts as fully busy.
    ``utilization_memory`` is the same for device memory being read or written.

    ``memory_used`` is NVML's (v1) figure, which includes the memory the driver
    reserves for itself, so an idle GPU shows a few hundred MiB used.

    ``processes`` maps pid to device bytes for every process with a compute context
    on this GPU; a process whose usage the driver does not report counts 0 bytes.
    """

    index: int
    name: str
    uuid: str
    memory_total: int | None
    memory_used: int | None
    memory_free: int | None
    utilization_gpu: int | None
    utilization_memory: int | None
    processes: dict[int, int] = field(default_factory=dict, hash=False)
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class PidView:
    """Whether NVML's process IDs are this process's own (see :func:`pid_view`).

    ``shared`` is True when this process is in the initial PID namespace, where NVML's
    PIDs are the ones ``/proc`` and the checkpoint API use; False in another PID namespace
    (a container without ``--pid=host``), where an NVML PID may even name an unrelated
    process here; None when it could not be told. ``why`` says how it was decided.
    """

    shared: bool | None
    why: str


def pid_view(readlink: Callable[[str], str] = os.readlink) -> PidView:
    """Whether this process sees PIDs as NVML reports them: compares its PID namespace with the initial one.

    ``/proc/self/ns/pid`` reads ``pid:[INODE]``; the initial namespace's inode is
    :data:`PROC_PID_INIT_INO`. (``NSpid`` in ``/proc/self/status`` cannot tell: a container
    that mounts its own procfs shows a single entry there too.) ``readlink`` is for tests.
    Never raises.
    """
    try:
        link = readlink("/proc/self/ns/pid")
    except OSError as exc:
        return PidView(None, f"cannot read /proc/self/ns/pid ({exc.strerror or exc})")
    inode = link.rpartition("[")[2].rstrip("]")
    if not inode.isdigit():
        return PidView(None, f"unexpected /proc/self/ns/pid link {link!r}")
    if int(inode) == PROC_PID_INIT_INO:
        return PidView(True, "the daemon is in the host's PID namespace, where NVML reports PIDs")
    return PidView(
        False,
        f"the daemon is in PID namespace {inode}, not the host's ({PROC_PID_INIT_INO}): NVML reports host PIDs",
    )


@dataclass(frozen=True)
class _Device:
    info: DeviceInfo
    handle: Any


class Nvml:
    """An opened NVML session, or the reason there is none.

    Build it with :meth:`open`. Implements the ``GpuMemory`` protocol of
    :mod:`timesliced.backends.base` with live driver queries.
    """

    def __init__(
        self,
        state: NvmlState,
        reason: str = "",
        *,
        lib: ModuleType | None = None,
        devices: tuple[_Device, ...] = (),
        driver_version: str = "",
        cuda_driver_version: int = 0,
        skipped: dict[int, str] | None = None,
    ) -> None:
        """Use :meth:`open`; this constructor only records what ``open`` found."""
        self.state = state
        self.reason = reason
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        # GPUs NVML counts but this process cannot use (index -> why), e.g. no permission.
        self.skipped: dict[int, str] = dict(skipped or {})
        self._lib = lib
        self._devices = {d.info.index: d for d in devices}
        self._lock = threading.Lock()
        self._process_getter: str | None = None  # chosen on first use

    # --- opening and closing -------------------------------------------------------------

    @classmethod
    def open(cls) -> Nvml:
        """Initialise NVML and enumerate the GPUs.

        Never raises for a missing or unusable driver: the result's ``available`` is
        false and ``reason`` says why. A GPU that NVML lists but that cannot be
        queried (its handle or memory fails) is left out and noted in ``skipped``;
        with no usable GPU at all, NVML is shut down again and reported unavailable.
        """
        try:
            lib = importlib.import_module("pynvml")
        except ImportError:
            return cls(NvmlState.NO_PACKAGE, "the nvidia-ml-py package is not installed")
        try:
            lib.nvmlInit()
        except lib.NVMLError as exc:
            state, reason = _explain_open_error(lib, exc)
            return cls(state, reason)
        try:
            return cls._enumerate(lib)
        except lib.NVMLError as exc:
            _shutdown(lib)
            state, reason = _explain_open_error(lib, exc)
            return cls(state, reason)
        except BaseException:
            _shutdown(lib)
            raise

    @classmethod
    def _enumerate(cls, lib: ModuleType) -> Nvml:
        driver = _optional(lib, "", lib.nvmlSystemGetDriverVersion)
        cuda = _optional(lib, 0, lib.nvmlSystemGetCudaDriverVersion)
        devices: list[_Device] = []
        skipped: dict[int, str] = {}
        denied = 0
        for index in range(int(lib.nvmlDeviceGetCount())):
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                total = int(lib.nvmlDeviceGetMemoryInfo(handle).total)
            except lib.NVMLError as exc:
                # nvmlDeviceGetCount also counts GPUs this process may not touch (NO_PERMISSION).
                skipped[index] = str(exc)
                denied += getattr(exc, "value", None) == lib.NVML_ERROR_NO_PERMISSION
                continue
            name = str(_optional(lib, f"GPU {index}", lib.nvmlDeviceGetName, handle))
            uuid = str(_optional(lib, "", lib.nvmlDeviceGetUUID, handle))
            devices.append(_Device(DeviceInfo(index, total, name, uuid), handle))
        if not devices:
            _shutdown(lib)
            if not skipped:
                return cls(NvmlState.NO_DEVICES, "NVML lists no GPUs")
            state = NvmlState.NO_PERMISSION if denied == len(skipped) else NvmlState.NO_DEVICES
            detail = "; ".join(f"GPU {i}: {why}" for i, why in sorted(skipped.items()))
            return cls(state, f"no usable GPU ({detail})", skipped=skipped)
        return cls(
            NvmlState.OPEN,
            lib=lib,
            devices=tuple(devices),
            driver_version=str(driver),
            cuda_driver_version=int(cuda),
            skipped=skipped,
        )

    def close(self) -> None:
        """Shut NVML down (once; later calls do nothing). Waits a few seconds for a query in flight."""
        if not self._lock.acquire(timeout=_CLOSE_WAIT):
            # A query hangs in the driver; shutting down under it is undefined, leaking is not.
            log.warning("an NVML query is still running after %.0fs; leaving NVML initialised", _CLOSE_WAIT)
            self._mark_closed()
            return
        try:
            lib = self._lib
            self._mark_closed()
            if lib is not None:
                _shutdown(lib)
        finally:
            self._lock.release()

    def _mark_closed(self) -> None:
        if self.state is NvmlState.OPEN:
            self.state = NvmlState.CLOSED
            self.reason = "NVML was closed"
        self._lib = None
        self._devices = {}

    def __enter__(self) -> Nvml:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- facts -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True while NVML is open with at least one usable GPU."""
        return self.state is NvmlState.OPEN

    @property
    def driver_major(self) -> int:
        """The driver's major version (570 for "570.86.15"); 0 when unknown."""
        head = self.driver_version.split(".", 1)[0]
        return int(head) if head.isdigit() else 0

    @property
    def cuda_version(self) -> str:
        """The CUDA version the driver supports, as "12.8"; "" when unknown."""
        v = self.cuda_driver_version
        return f"{v // 1000}.{v % 1000 // 10}" if v > 0 else ""

    def devices(self) -> list[DeviceInfo]:
        """The usable GPUs, by NVML index, with their total memory as capacity; [] when unavailable."""
        return [d.info for _, d in sorted(self._devices.items())]

    def describe(self) -> dict[str, Any]:
        """Plain data about the session, for status output."""
        return {
            "available": self.available,
            "state": self.state.value,
            "reason": self.reason or None,
            "driver": self.driver_version or None,
            "cuda": self.cuda_version or None,
            "skipped": {str(i): why for i, why in sorted(self.skipped.items())},
        }

    # --- sampling ----------------------------------------------------------------------

    def sample(self) -> list[GpuSample]:
        """Memory, utilization and processes of every usable GPU; [] when unavailable.

        Tolerant per field: an NVML error in one query of one GPU (utilization not
        supported, a lost GPU) is recorded in that sample's ``errors`` and the rest
        is still reported. Blocking: call it from a worker thread in async code.
        """
        with self._lock:
            lib = self._lib
            if lib is None:
                return []
            return [self._sample_one(lib, d) for _, d in sorted(self._devices.items())]

    def _sample_one(self, lib: ModuleType, device: _Device) -> GpuSample:
        problems: list[str] = []

        def query(what: str, fn: Callable[..., Any], *args: Any) -> Any:
            try:
                return fn(*args)
            except lib.NVMLError as exc:
                problems.append(f"{what}: {exc}")
                return None

        h = device.handle
        memory = query("memory", lib.nvmlDeviceGetMemoryInfo, h)
        util = query("utilization", lib.nvmlDeviceGetUtilizationRates, h)
        procs = query("processes", self._processes, lib, h)
        return GpuSample(
            index=device.info.index,
            name=device.info.name,
            uuid=device.info.uuid,
            memory_total=int(memory.total) if memory is not None else None,
            memory_used=int(memory.used) if memory is not None else None,
            memory_free=int(memory.free) if memory is not None else None,
            utilization_gpu=int(util.gpu) if util is not None else None,
            utilization_memory=int(util.memory) if util is not None else None,
            processes=procs if procs is not None else {},
            errors=tuple(problems),
        )

    def _processes(self, lib: ModuleType, handle: Any) -> dict[int, int]:
        """pid -> bytes of the compute processes on one GPU (0 where not reported). Raises ``NVMLError``."""
        return {pid: sum(n or 0 for n in parts) for pid, parts in _by_pid(self._infos(lib, handle)).items()}

    def _reported(self, lib: ModuleType, handle: Any) -> dict[int, int | None]:
        """pid -> bytes, or None where not reported, of the compute processes on one GPU. Raises ``NVMLError``."""
        return {
            pid: None if None in parts else sum(n for n in parts if n is not None)
            for pid, parts in _by_pid(self._infos(lib, handle)).items()
        }

    def _infos(self, lib: ModuleType, handle: Any) -> Any:
        """The process entries of one GPU from the newest getter the driver has. Raises ``NVMLError``."""
        if self._process_getter is not None:
            return getattr(lib, self._process_getter)(handle)
        names = [n for n in _PROCESS_GETTERS if hasattr(lib, n)]
        for i, name in enumerate(names):
            try:
                infos = getattr(lib, name)(handle)
            except lib.NVMLError_FunctionNotFound:
                if i + 1 < len(names):
                    continue  # the driver predates this getter: try the next older one
                raise
            self._process_getter = name
            return infos
        raise lib.NVMLError(lib.NVML_ERROR_FUNCTION_NOT_FOUND)

    # --- GpuMemory -----------------------------------------------------------------------

    def free_bytes(self, gpu: int) -> int:
        """Free device memory of ``gpu`` now.

        Raises ``BackendUnavailable`` when NVML is not open, ``UnknownDevice`` for a
        GPU it does not have, ``BackendError`` when the driver query fails.
        """
        with self._lock:
            lib, device = self._device(gpu)
            try:
                return int(lib.nvmlDeviceGetMemoryInfo(device.handle).free)
            except lib.NVMLError as exc:
                raise errors.BackendError(f"NVML could not read the memory of GPU {gpu}: {exc}", gpu=gpu) from None

    def used_bytes(self, gpu: int) -> int:
        """Device memory of ``gpu`` in use now, by every process and the driver (NVML's ``used``).

        Raises like :meth:`free_bytes`.
        """
        with self._lock:
            lib, device = self._device(gpu)
            try:
                return int(lib.nvmlDeviceGetMemoryInfo(device.handle).used)
            except lib.NVMLError as exc:
                raise errors.BackendError(f"NVML could not read the memory of GPU {gpu}: {exc}", gpu=gpu) from None

    def process_memory(self) -> dict[int, dict[int, int]]:
        """pid -> {gpu -> bytes} for every process with a compute context on a usable GPU.

        A process whose usage NVML does not report counts 0 bytes (see
        :meth:`process_memory_reported` to tell the two apart). All or nothing, since
        callers plan with it: raises ``BackendError`` when the query fails on any GPU,
        ``BackendUnavailable`` when NVML is not open.
        """
        table = self._per_pid(self._processes)  # every figure an int: unreported parts count 0
        return {pid: {gpu: n or 0 for gpu, n in per.items()} for pid, per in table.items()}

    def process_memory_reported(self) -> dict[int, dict[int, int | None]]:
        """pid -> {gpu -> bytes or None} for every process with a compute context on a usable GPU.

        None where NVML lists the process but reports its usage as NVML_VALUE_NOT_AVAILABLE
        (pynvml's getters turn that into ``usedGpuMemory = None``): the process holds a
        context on that GPU, its size unknown. PIDs are NVML's (see :func:`pid_view`).
        Raises like :meth:`process_memory`.
        """
        return self._per_pid(self._reported)

    def _per_pid(self, read: Callable[[ModuleType, Any], Mapping[int, int | None]]) -> dict[int, dict[int, int | None]]:
        """``read`` (one GPU's pid -> bytes) over every usable GPU, as pid -> {gpu -> bytes}; all or nothing."""
        with self._lock:
            lib = self._open_lib()
            out: dict[int, dict[int, int | None]] = {}
            for gpu, device in sorted(self._devices.items()):
                try:
                    procs = read(lib, device.handle)
                except lib.NVMLError as exc:
                    raise errors.BackendError(
                        f"NVML could not list the processes on GPU {gpu}: {exc}", gpu=gpu
                    ) from None
                for pid, nbytes in procs.items():
                    out.setdefault(pid, {})[gpu] = nbytes
            return out

    def persistence_mode(self, gpu: int) -> bool | None:
        """Whether ``gpu`` is in persistence mode (``nvidia-smi -pm 1``); None when NVML cannot tell.

        Raises ``BackendUnavailable`` when NVML is not open, ``UnknownDevice`` for a GPU it
        does not have.
        """
        with self._lock:
            lib, device = self._device(gpu)
            try:
                return bool(lib.nvmlDeviceGetPersistenceMode(device.handle) == lib.NVML_FEATURE_ENABLED)
            except lib.NVMLError as exc:
                log.debug("NVML cannot read the persistence mode of GPU %d: %s", gpu, exc)
                return None

    def _open_lib(self) -> ModuleType:
        if self._lib is None:
            raise errors.BackendUnavailable(f"NVML is not available: {self.reason}")
        return self._lib

    def _device(self, gpu: int) -> tuple[ModuleType, _Device]:
        lib = self._open_lib()
        device = self._devices.get(gpu)
        if device is None:
            raise errors.UnknownDevice(f"NVML has no usable GPU {gpu}", gpu=gpu)
        return lib, device

    def __repr__(self) -> str:
        return f"<Nvml {self.state.value} gpus={sorted(self._devices)} driver={self.driver_version or '?'}>"


def _by_pid(infos: Any) -> dict[int, list[int | None]]:
    """pid -> its entries' bytes (None: not reported). Under MIG one process may be listed once per instance."""
    out: dict[int, list[int | None]] = {}
    for p in infos:
        used = p.usedGpuMemory
        out.setdefault(int(p.pid), []).append(None if used is None or used == _NOT_AVAILABLE else int(used))
    return out


def _explain_open_error(lib: ModuleType, exc: BaseException) -> tuple[NvmlState, str]:
    value = getattr(exc, "value", None)
    for name, (state, reason) in _OPEN_ERRORS.items():
        if value == getattr(lib, name, object()):
            return state, reason
    return NvmlState.FAILED, f"NVML failed to start: {exc}"


def _optional(lib: ModuleType, default: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or ``default`` when NVML cannot answer (an old driver, an unsupported query)."""
    try:
        return fn(*args)
    except lib.NVMLError as exc:
        log.debug("NVML query %s failed: %s", getattr(fn, "__name__", fn), exc)
        return default


def _shutdown(lib: ModuleType) -> None:
    try:
        lib.nvmlShutdown()
    except lib.NVMLError as exc:
        log.warning("nvmlShutdown failed: %s", exc)
