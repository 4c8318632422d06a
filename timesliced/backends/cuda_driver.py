"""The narrow seam between the cuda-checkpoint backend and NVIDIA's driver checkpoint API.

:class:`CheckpointDriver` is everything the backend asks of the driver.
:class:`CudaDriver` implements it in-process with ``cuda.bindings.driver``
(cuda-python); the tests plug a fake state machine into the same seam, so the
backend code they exercise is the production code.

Calls return the driver's ``CUresult`` (an ``int``; the bindings' enum is an
``int`` subclass) and do not raise for a failed call: :func:`error_for` is the
one place that turns a result into a timesliced error, and it is a pure
function. Only a driver that cannot be called at all (no cuda-python, no
driver library, no checkpoint entry point) raises, as
:class:`~timesliced.errors.BackendUnavailable`.

Every call blocks the calling thread (a lock waits for the process's submitted
GPU work; a checkpoint or restore copies all of its device memory), so the
backend runs them in worker threads. The bindings import and the driver
library load are lazy: this module imports without cuda-python.

Driver facts this module relies on (CUDA driver API, "CUDA Checkpointing"):

- The entry points exist from the CUDA 12.8 driver API (driver r570).
- ``cuCheckpointProcessLock(pid, CUcheckpointLockArgs)``: RUNNING -> LOCKED;
  ``timeoutMs`` (0 = wait forever); when it expires the process stays RUNNING.
- ``cuCheckpointProcessCheckpoint(pid, None)``: LOCKED -> CHECKPOINTED, device
  memory copied into host memory the driver keeps inside the target process.
- ``cuCheckpointProcessRestore(pid, None)``: CHECKPOINTED -> LOCKED; needs the
  memory back on the GPU, and ``cuInit`` in the caller or persistence mode.
- ``cuCheckpointProcessUnlock(pid, None)``: LOCKED -> RUNNING.
- ``cuCheckpointProcessGetState(pid)`` -> ``(CUresult, CUprocessState)``; the
  bindings return ``(CUresult, None)`` when the call failed.
- A call in the wrong state returns ``CUDA_ERROR_ILLEGAL_STATE``.
- A PID is one of the caller's PID namespace: the driver reaches the target
  process through the caller's ``/proc`` (NVIDIA/cuda-checkpoint#41). NVML's PIDs
  are the host's (:mod:`timesliced.nvml`), so the two agree only for a caller in
  the host's PID namespace.
- A PID without CUDA state answers ``CUDA_ERROR_INVALID_VALUE`` (exited, or never
  used CUDA) or ``CUDA_ERROR_NOT_INITIALIZED`` (a live process that has not
  initialised CUDA). Once the daemon's own ``cuInit`` succeeded, the second never
  means "the daemon did not call cuInit": NVIDIA's own checkpoint helper
  (ai-dynamo/snapshot, ``cuda-checkpoint-helper``) calls ``cuInit`` and then reads
  ``CUDA_ERROR_NOT_INITIALIZED`` or ``CUDA_ERROR_INVALID_VALUE`` from a PID's
  checkpoint query as "live but owns no CUDA checkpoint state", and CRIU's CUDA
  plugin skips any process whose query fails. :func:`no_cuda_state` is that rule.
- Restores need "persistence mode to be enabled or cuInit to have been called"
  in the caller (the driver API reference). The caller's ``cuInit`` brings up only
  the GPUs its ``CUDA_VISIBLE_DEVICES`` leaves visible (read once, at ``cuInit``),
  so the daemon initialises its driver without that variable and checks with
  :meth:`CheckpointDriver.devices` which GPUs its driver sees
  (``cuDeviceGetCount``, ``cuDeviceGet``, ``cuDeviceGetUuid``).

Bindings: the checkpoint entry points are in cuda-bindings 12.8 and newer, but
some releases lack pieces: 13.0.0 and 13.0.1 have no ``cuCheckpointProcessRestore``
nor ``CUcheckpointRestoreArgs`` (checked in their wheels; cuda-core's checkpoint
module asks for 13.0.2 or newer in the 13 series), and 13.3.0 lost
``CUcheckpointRestoreArgs`` (restored in 13.3.1, NVIDIA/cuda-python#2144).
:func:`bindings_requirement` is the pip requirement that fits a driver's CUDA
version; ``python -m timesliced.backends.cuda_driver`` prints it for this node's
driver (from NVML).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Protocol

from timesliced import errors

# CUresult values (cuda.h; the same numbers as cuda.bindings.driver.CUresult, which
# the tests check). Kept here so that error_for() needs neither the bindings nor a GPU.
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_TIMEOUT = 909

_KNOWN_RESULTS = {
    CUDA_SUCCESS: "CUDA_SUCCESS",
    CUDA_ERROR_INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
    CUDA_ERROR_OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY",
    CUDA_ERROR_NOT_INITIALIZED: "CUDA_ERROR_NOT_INITIALIZED",
    CUDA_ERROR_ILLEGAL_STATE: "CUDA_ERROR_ILLEGAL_STATE",
    CUDA_ERROR_NOT_READY: "CUDA_ERROR_NOT_READY",
    CUDA_ERROR_NOT_SUPPORTED: "CUDA_ERROR_NOT_SUPPORTED",
    CUDA_ERROR_TIMEOUT: "CUDA_ERROR_TIMEOUT",
}

# CUprocessState values, by the name states() reports. CUDA 13 added CHECKPOINTING and
# RESTORING, which only custom-storage checkpoints (not used here) pass through.
PROCESS_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed", 4: "checkpointing", 5: "restoring"}

# The driver entry point behind each operation of the seam.
API_NAMES = {
    "init": "cuInit",
    "driver_version": "cuDriverGetVersion",
    "device_count": "cuDeviceGetCount",
    "device": "cuDeviceGet",
    "device_uuid": "cuDeviceGetUuid",
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
    "get_state": "cuCheckpointProcessGetState",
}

REQUIRED_BINDINGS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
    "CUcheckpointLockArgs",
    "CUcheckpointRestoreArgs",
    "CUprocessState",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetUuid",
)

# cuda-bindings releases that lack checkpoint pieces, and what they lack.
KNOWN_BAD_BINDINGS = {
    "13.0.0": "it has no cuCheckpointProcessRestore nor CUcheckpointRestoreArgs",
    "13.0.1": "it has no cuCheckpointProcessRestore nor CUcheckpointRestoreArgs",
    "13.3.0": "it lost CUcheckpointRestoreArgs (fixed in 13.3.1)",
}

# The pip requirement per CUDA major version of the driver; the same as the [cuda12] and
# [cuda13] extras in pyproject.toml (a test holds the two together).
_REQUIREMENTS = {
    12: "cuda-bindings>=12.8,<13",
    13: "cuda-bindings>=13.0.2,!=13.3.0,<14",
}
MIN_CUDA = 12080  # the CUDA version (cuDriverGetVersion's encoding) of the first driver with the checkpoint API


class CheckpointDriver(Protocol):
    """The driver checkpoint API, one process at a time; every call blocks.

    Results are ``CUresult`` values (``0`` is success). Implementations raise
    only :class:`~timesliced.errors.BackendUnavailable`, when the driver cannot
    be called at all.
    """

    bindings_version: str  # the cuda-bindings package version, e.g. "13.4.4"
    bindings_cuda_version: int  # the CUDA version the bindings were built for, 1000 * major + 10 * minor
    initialized: bool  # init() succeeded in this process

    def init(self) -> int:
        """``cuInit(0)``: once per process, before any restore."""
        ...

    def driver_version(self) -> tuple[int, int]:
        """``cuDriverGetVersion``: (result, CUDA version the driver supports, e.g. 12080)."""
        ...

    def devices(self) -> tuple[int, list[str]]:
        """(result, the UUIDs, ``GPU-...`` as NVML spells them, of the GPUs this process's driver sees).

        After :meth:`init`; honours the ``CUDA_VISIBLE_DEVICES`` that ``cuInit`` saw.
        """
        ...

    def lock(self, pid: int, timeout_ms: int) -> int:
        """Block ``pid``'s further CUDA calls, waiting at most ``timeout_ms`` for its submitted work."""
        ...

    def checkpoint(self, pid: int) -> int:
        """Copy locked ``pid``'s device memory to host memory and release its GPUs."""
        ...

    def restore(self, pid: int) -> int:
        """Put checkpointed ``pid``'s memory back on its GPUs; it stays locked."""
        ...

    def unlock(self, pid: int) -> int:
        """Let locked ``pid`` make CUDA calls again."""
        ...

    def get_state(self, pid: int) -> tuple[int, int | None]:
        """(result, ``CUprocessState`` value); the state is None when the call failed."""
        ...


def result_name(result: int) -> str:
    """``CUDA_ERROR_...`` for a CUresult value, from the bindings when they know it."""
    try:
        name = importlib.import_module("cuda.bindings.driver").CUresult(result).name
    except Exception:  # no bindings, or a value they do not know
        name = _KNOWN_RESULTS.get(int(result), f"CUresult {int(result)}")
    return str(name)


def state_name(state: int) -> str:
    """``running`` / ``locked`` / ``checkpointed`` / ``failed`` / ... for a CUprocessState value."""
    return PROCESS_STATES.get(int(state), f"unknown({int(state)})")


def no_cuda_state(result: int, *, daemon_initialized: bool = True) -> bool:
    """Whether ``result`` of a PID's checkpoint call says the PID has no CUDA state (see the module's facts).

    ``CUDA_ERROR_INVALID_VALUE`` always; ``CUDA_ERROR_NOT_INITIALIZED`` once the daemon's
    own ``cuInit`` succeeded (before it, the daemon's driver is what is not initialised).
    """
    return result == CUDA_ERROR_INVALID_VALUE or (result == CUDA_ERROR_NOT_INITIALIZED and daemon_initialized)


def error_for(
    op: str, pid: int, result: int, *, timeout_ms: int | None = None, daemon_initialized: bool = True
) -> errors.BackendError | None:
    """The error that ``result`` of ``op`` (a :class:`CheckpointDriver` method) on ``pid`` means.

    None on success. Pure: the same result always maps to the same error.

    - lock ``CUDA_ERROR_TIMEOUT`` / ``CUDA_ERROR_NOT_READY``: :class:`~timesliced.errors.BackendTimeout`
      (the driver left the process running);
    - ``CUDA_ERROR_NOT_INITIALIZED``: :class:`~timesliced.errors.BackendError` saying the process has no
      CUDA state, once the daemon's driver is initialised (``daemon_initialized``);
      :class:`~timesliced.errors.BackendUnavailable` before (``cuInit`` was not called in the daemon);
    - anything else: :class:`~timesliced.errors.BackendError`.

    The message names the driver call, the PID and the result name; ``details``
    carry them as ``call``, ``pid``, ``result`` and ``code``.
    """
    if result == CUDA_SUCCESS:
        return None
    call = API_NAMES.get(op, op)
    name = result_name(result)
    details: dict[str, Any] = {"call": call, "pid": pid, "result": name, "code": int(result)}
    head = f"{call}(pid {pid}) failed: {name}"
    if op == "lock" and result in (CUDA_ERROR_TIMEOUT, CUDA_ERROR_NOT_READY):
        waited = f" after {timeout_ms} ms" if timeout_ms is not None else ""
        details["timeout_ms"] = timeout_ms
        return errors.BackendTimeout(
            f"{call}(pid {pid}) timed out{waited} ({name}): its submitted GPU work did not finish; "
            "the process keeps running",
            **details,
        )
    if result == CUDA_ERROR_NOT_INITIALIZED and not daemon_initialized:
        return errors.BackendUnavailable(
            f"{head}: the CUDA driver is not initialised in the daemon (cuInit): restart the daemon, "
            "whose start initialises it",
            **details,
        )
    if result == CUDA_ERROR_NOT_INITIALIZED:
        return errors.BackendError(
            f"{head}: the process has no CUDA state (it has not initialised CUDA; the daemon's own cuInit "
            "did succeed): it has nothing to park, or it exited and its PID was reused",
            **details,
        )
    if result == CUDA_ERROR_ILLEGAL_STATE:
        return errors.BackendError(f"{head}: the process is not in the state this call needs", **details)
    if result == CUDA_ERROR_INVALID_VALUE:
        return errors.BackendError(f"{head}: no such CUDA process (exited, or never used CUDA)", **details)
    if result == CUDA_ERROR_NOT_SUPPORTED:
        return errors.BackendError(
            f"{head}: the driver cannot checkpoint this process (UVM and IPC memory are not supported)", **details
        )
    if op == "restore" and result == CUDA_ERROR_OUT_OF_MEMORY:
        return errors.BackendError(
            f"{head}: the GPU ran out of memory during the restore; the driver may refuse to restore "
            "this process again",
            **details,
        )
    return errors.BackendError(head, **details)


def unavailable_for(call: str, exc: BaseException) -> errors.BackendUnavailable:
    """The error for a driver entry point that could not be called at all.

    The bindings load the driver library on the first call and resolve each
    entry point when it is first used, raising ``RuntimeError`` subclasses.
    """
    kind = type(exc).__name__
    if kind == "FunctionNotFoundError":
        message = f"the NVIDIA driver has no {call}: the checkpoint API needs driver 570 (CUDA 12.8) or newer"
    elif "Lib" in kind or "dlopen" in str(exc) or "libcuda" in str(exc):
        message = f"the NVIDIA driver library (libcuda.so.1) was not found: {exc}"
    else:
        message = f"{call} could not be called: {kind}: {exc}"
    return errors.BackendUnavailable(message, call=call, exception=kind)


class CudaDriver:
    """:class:`CheckpointDriver` through ``cuda.bindings.driver``, in this process.

    Raises :class:`~timesliced.errors.BackendUnavailable` when cuda-python is
    missing or its bindings lack a piece of the checkpoint API (older than 12.8, or a
    release in :data:`KNOWN_BAD_BINDINGS`; ``details`` carry ``bindings_version`` and
    ``missing``), and from any call when the driver library or an entry point is missing.
    ``module`` replaces ``cuda.bindings.driver`` (with ``version``), for tests.
    """

    def __init__(self, module: Any = None, version: str | None = None) -> None:
        if module is None:
            try:
                version = str(getattr(importlib.import_module("cuda.bindings"), "__version__", "unknown"))
                module = importlib.import_module("cuda.bindings.driver")
            except ImportError as exc:
                raise errors.BackendUnavailable(
                    "cuda-python is not installed (pip install 'timesliced[cuda]')", missing="cuda-python"
                ) from exc
        self._cu: Any = module
        self.bindings_version = version or "unknown"
        self.initialized = False
        built_for = getattr(self._cu, "CUDA_VERSION", None)
        self.bindings_cuda_version = int(built_for) if built_for is not None else _version_number(self.bindings_version)
        missing = [name for name in REQUIRED_BINDINGS if not hasattr(self._cu, name)]
        if missing:
            known = KNOWN_BAD_BINDINGS.get(self.bindings_version)
            why = f" ({known})" if known else ""
            raise errors.BackendUnavailable(
                f"cuda-bindings {self.bindings_version} lacks the checkpoint API{why}: missing {', '.join(missing)}",
                bindings_version=self.bindings_version,
                missing=missing,
            )

    def _call(self, op: str, *args: Any) -> Any:
        name = API_NAMES[op]
        try:
            out = getattr(self._cu, name)(*args)
        except RuntimeError as exc:
            raise unavailable_for(name, exc) from exc
        # The bindings return (CUresult, *outputs).
        return out if isinstance(out, tuple) else (out,)

    def init(self) -> int:
        result = int(self._call("init", 0)[0])
        self.initialized = self.initialized or result == CUDA_SUCCESS
        return result

    def driver_version(self) -> tuple[int, int]:
        result, version = self._call("driver_version")[:2]
        return int(result), int(version or 0)

    def devices(self) -> tuple[int, list[str]]:
        result, count = self._call("device_count")[:2]
        if result != CUDA_SUCCESS:
            return int(result), []
        uuids = []
        for ordinal in range(int(count or 0)):
            result, device = self._call("device", ordinal)[:2]
            if result != CUDA_SUCCESS:
                return int(result), []
            result, uuid = self._call("device_uuid", device)[:2]
            if result != CUDA_SUCCESS:
                return int(result), []
            uuids.append(format_uuid(uuid.bytes))
        return CUDA_SUCCESS, uuids

    def lock(self, pid: int, timeout_ms: int) -> int:
        args = self._cu.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        return int(self._call("lock", pid, args)[0])

    def checkpoint(self, pid: int) -> int:
        return int(self._call("checkpoint", pid, None)[0])

    def restore(self, pid: int) -> int:
        return int(self._call("restore", pid, None)[0])

    def unlock(self, pid: int) -> int:
        return int(self._call("unlock", pid, None)[0])

    def get_state(self, pid: int) -> tuple[int, int | None]:
        try:
            result, state = self._call("get_state", pid)[:2]
        except ValueError:
            # Some cuda-bindings releases convert the output even when the call failed,
            # and an uninitialised value is no CUprocessState: the PID is no CUDA process.
            return CUDA_ERROR_INVALID_VALUE, None
        if result != CUDA_SUCCESS or state is None:
            return int(result), None
        return CUDA_SUCCESS, int(state)


def format_uuid(raw: Any) -> str:
    """A ``CUuuid``'s 16 bytes as NVML and ``CUDA_VISIBLE_DEVICES`` spell a GPU: ``GPU-8-4-4-4-12`` hex digits."""
    data = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
    h = data.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _version_number(version: str) -> int:
    """A version string as cuDriverGetVersion encodes it ("12.8.0" is 12080); 0 if unparsable."""
    parts = version.split(".")
    try:
        return int(parts[0]) * 1000 + (int(parts[1]) * 10 if len(parts) > 1 else 0)
    except ValueError:
        return 0


def cuda_text(version: int) -> str:
    """cuDriverGetVersion's encoding as text: 12080 is "12.8"."""
    return f"{version // 1000}.{version % 1000 // 10}"


# --- which bindings fit a driver -------------------------------------------------------------


def bindings_requirement(cuda_version: int) -> str:
    """The pip requirement of the cuda-bindings that drive a driver supporting ``cuda_version`` (e.g. 13000).

    The bindings' major must not be newer than the driver's CUDA major (bindings built
    for CUDA 13 cannot use a CUDA 12 driver), and the release must have every checkpoint
    piece (:data:`KNOWN_BAD_BINDINGS` excluded). A driver newer than any major known here
    gets the newest known major's bindings: the driver API is backward compatible, and
    bindings of an unreleased major would not install. Pure. Raises ``ValueError`` for a
    driver older than CUDA 12.8, which has no checkpoint API at all.
    """
    if cuda_version < MIN_CUDA:
        raise ValueError(f"CUDA {cuda_text(cuda_version)} has no checkpoint API (needs {cuda_text(MIN_CUDA)})")
    return _REQUIREMENTS[min(cuda_version // 1000, max(_REQUIREMENTS))]


def install_command(cuda_version: int) -> str:
    """The shell command that installs :func:`bindings_requirement`, quoted for a shell."""
    return f"pip install '{bindings_requirement(cuda_version)}'"


def requirement_here() -> str:
    """:func:`bindings_requirement` for this node's driver, whose CUDA version NVML reports.

    Needs no cuda-python (only nvidia-ml-py). Raises
    :class:`~timesliced.errors.BackendUnavailable` when NVML cannot tell.
    """
    from ..nvml import Nvml

    with Nvml.open() as nvml:
        if not nvml.available or nvml.cuda_driver_version <= 0:
            why = nvml.reason or "it reports no CUDA version"
            raise errors.BackendUnavailable(f"NVML cannot tell this node's CUDA version: {why}")
        try:
            return bindings_requirement(nvml.cuda_driver_version)
        except ValueError as exc:
            raise errors.BackendUnavailable(f"NVIDIA driver {nvml.driver_version}: {exc}") from None


def main() -> int:
    """``python -m timesliced.backends.cuda_driver``: print this node's cuda-bindings requirement.

    For install scripts: ``pip install "$(python -m timesliced.backends.cuda_driver)"``.
    Exits 2, with the reason on stderr, where NVML cannot tell.
    """
    try:
        print(requirement_here())
    except errors.BackendUnavailable as exc:
        print(f"timesliced: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
