"""Whole-process parking with NVIDIA's driver checkpoint API (the ``cuda-checkpoint`` method).

A snapshot locks, then checkpoints, every process of the job that has CUDA state
on this node: the driver copies each process's device memory into host memory
that it keeps inside that process, and releases its GPUs. A restore puts the
memory back and unlocks the processes. The job's code needs no change: while
parked, its next CUDA call simply blocks.

Which processes: the job's registered PIDs and their descendants (``/proc``) whose
checkpoint state the driver reports (``cuCheckpointProcessGetState``); the others
(never used CUDA, or exited) are left alone. The driver takes PIDs of the daemon's
own PID namespace, so this works in a container too.

How much memory, per GPU (the footprint, which the scheduler plans with and a
restore checks the room for). Two ways, chosen per node at start (``footprints``,
shown in ``status`` under ``parking.checkpoint``):

- ``per-process``: NVML's per-process figures, where NVML sees the daemon's PIDs
  (the daemon is in the host's PID namespace; NVML always reports host PIDs,
  :func:`timesliced.nvml.pid_view`). A process that NVML lists with its usage not
  available holds a context: it is parked like the others, and its GPU's figure is
  taken as in ``gpu-delta``. A move for which NVML lists none of the job's CUDA
  processes falls back to ``gpu-delta`` too.
- ``gpu-delta``: each GPU's used memory (NVML) read after the locks and again after
  the whole job's checkpoint; the difference is what the job released. It counts
  any change by others between the two readings: a process allocating meanwhile
  (a job starting CUDA while it waits for its first grant, a process timesliced does
  not manage) makes the figure smaller, even 0, and one freeing memory makes it
  larger. The scheduler gives real-process jobs their GPUs to themselves, so the
  window (the checkpoint's copy) is quiet on a GPU used only through timesliced. An
  undercount makes the restore check too lenient, and a restore that runs out of
  memory can leave a process the driver never restores again (NVIDIA/cuda-checkpoint#44):
  keep ``restore_margin`` above what may start on the GPU meanwhile.

In the record (:meth:`~CudaCheckpointBackend.parked`), footprints are per process;
bytes measured for the job as a whole sit under the key :data:`JOB_WIDE` (0, never a
process), kept while any of the job's processes lives.

A restore first checks that every GPU has the footprint free (plus a margin) and
refuses with :class:`~timesliced.errors.InsufficientMemory` otherwise, before
touching any process, because a restore that runs out of memory can leave a
process that the driver will never restore again.

Restores need the daemon's driver initialised on the GPU (its ``cuInit``) or the GPU
in persistence mode. :func:`probe` initialises the driver without the
``CUDA_VISIBLE_DEVICES`` the daemon may have inherited (it is read once, at
``cuInit``; the variable is put back afterwards), then checks that the driver sees
every GPU of the node, and refuses to start the method on a node where a GPU is
neither seen nor in persistence mode. A job on such a GPU is refused before anything
moves (:class:`~timesliced.errors.BackendUnavailable`), never parked for good.

All processes move in parallel, one driver call per worker thread: every lock,
then every checkpoint (or every restore, then every unlock).

Failures leave the job where it was. A failed snapshot is rolled back so the
job runs on; a failed restore puts back into the checkpointed state whatever
it can, so the job stays parked. Rollback asks the driver for each process's
state and drives it from there (``_TO_RUNNING`` / ``_TO_PARKED``). The error
names the PID, the driver call and the ``CUresult``.

Bounds and cancellation: the lock passes ``lock_timeout`` to the driver; the
daemon bounds whole operations with its own timeout, which should be longer.
Cancelling an operation does not stop driver calls already running: they finish
in their worker threads (a lock by its own timeout at the latest; a checkpoint
or restore when its copy is done). The backend records nothing for a cancelled
operation and refuses further operations on that job until those calls have
returned, so they never race with a new one; :meth:`states` tells where the
processes ended up. :meth:`aclose` does not wait for them either.

After a daemon restart the parked state is still inside the processes:
:meth:`states` reads it from the driver, and :meth:`adopt` hands the backend
back the record that :meth:`parked` gave out, so the job can be restored.

Limits are the driver's: Linux x86-64; no UVM or CUDA IPC memory; a multi-process
job whose processes share device memory or NCCL communicators may not lock. The
daemon must see the job's PIDs in its own PID namespace and be allowed to act
on them (NVIDIA's examples run as root); in a container it needs every GPU of the
node (restores fail in a container given only some of them, NVIDIA/cuda-checkpoint#12).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from timesliced import errors
from timesliced.backends.base import GpuMemory, JobTarget, MoveResult
from timesliced.backends.cuda_driver import (
    API_NAMES,
    CUDA_SUCCESS,
    KNOWN_BAD_BINDINGS,
    MIN_CUDA,
    CheckpointDriver,
    CudaDriver,
    cuda_text,
    error_for,
    install_command,
    no_cuda_state,
    result_name,
    state_name,
)
from timesliced.util import processes
from timesliced.wire import status

T = TypeVar("T")

log = logging.getLogger(__name__)

MIN_DRIVER = 570  # display driver branch with the checkpoint driver API

PER_PROCESS = "per-process"  # footprints from NVML's per-process figures
GPU_DELTA = "gpu-delta"  # footprints from each GPU's used-memory change across the checkpoint
FOOTPRINTS = (PER_PROCESS, GPU_DELTA)

JOB_WIDE = 0  # the record's key for bytes measured for the job as a whole (no process has PID 0)

# Variables that narrow which GPUs the daemon's own cuInit brings up.
NARROWING_ENV = ("CUDA_VISIBLE_DEVICES",)

# A move whose every process was rolled back to where it began left the job whole: the error says so
# (``errors.StateIntact``), and the scheduler keeps the job usable instead of faulting it.
_INTACT: dict[str, type[errors.BackendError]] = {"running": errors.ParkRefused, "parked": errors.RestoreRefused}

# How rollback drives a process from the state the driver reports; a state not
# listed (failed, or mid custom-storage copy) cannot be driven and is reported.
_TO_RUNNING: dict[str, tuple[str, ...]] = {"running": (), "locked": ("unlock",), "checkpointed": ("restore", "unlock")}
_TO_PARKED: dict[str, tuple[str, ...]] = {
    "running": ("lock", "checkpoint"),
    "locked": ("checkpoint",),
    "checkpointed": (),
}

Footprints = dict[int, dict[int, int]]  # pid (or JOB_WIDE) -> gpu -> bytes


class CheckpointMemory(GpuMemory, Protocol):
    """What the backend reads of NVML (:class:`timesliced.nvml.Nvml` implements it)."""

    def used_bytes(self, gpu: int) -> int:
        """Device memory in use on ``gpu`` now, by everyone (NVML's ``used``)."""
        ...

    def process_memory_reported(self) -> dict[int, dict[int, int | None]]:
        """NVML PID -> {gpu -> bytes, or None where NVML lists the process without a figure}."""
        ...


# --- availability ----------------------------------------------------------------------


@dataclass(frozen=True)
class GpuFacts:
    """One of the node's GPUs as NVML knows it, for the probe to check the daemon's driver against."""

    index: int
    uuid: str
    persistence: bool | None = None  # persistence mode; None when NVML cannot tell


@dataclass(frozen=True)
class Availability:
    """Whether the cuda-checkpoint method can run on this node, and why not."""

    ok: bool
    reason: str = ""  # one sentence when not ok
    details: dict[str, Any] = field(default_factory=dict)
    driver: CheckpointDriver | None = None  # initialised (cuInit done) when ok
    # How restores reach each GPU the probe was given: "driver" (the daemon's cuInit brought it
    # up) or "persistence" (persistence mode keeps it up). Empty when no GPUs were given.
    reach: dict[int, str] = field(default_factory=dict)

    def require(self) -> CheckpointDriver:
        """The initialised driver; raises :class:`~timesliced.errors.BackendUnavailable` with the reason."""
        if not self.ok or self.driver is None:
            raise errors.BackendUnavailable(self.reason, **self.details)
        return self.driver


def probe(
    driver: CheckpointDriver | None = None,
    *,
    nvml_driver_version: Callable[[], str] | None = None,
    nvml_cuda_version: int | None = None,
    gpus: Sequence[GpuFacts] | None = None,
    environ: MutableMapping[str, str] | None = None,
    system: str | None = None,
    machine: str | None = None,
) -> Availability:
    """Check that the checkpoint API can run here and initialise the driver (``cuInit``).

    The daemon calls this once at start: restores need the driver initialised
    in the calling process. ``driver`` defaults to :class:`CudaDriver`;
    ``nvml_driver_version`` (e.g. NVML's ``nvmlSystemGetDriverVersion``) gives the
    display driver version and ``nvml_cuda_version`` (``nvmlSystemGetCudaDriverVersion``,
    e.g. 13000) the CUDA version it supports, when available: with it a refusal of the
    bindings names the ``pip install`` that fits. ``gpus`` are the node's GPUs (NVML's):
    each must be seen by the daemon's driver after ``cuInit`` or be in persistence mode.
    ``environ`` (default ``os.environ``) loses :data:`NARROWING_ENV` while the driver
    initialises, and gets it back afterwards. ``system`` and ``machine`` default to this
    node's. Never raises for an unavailable node: the verdict's ``reason`` says which check
    failed (platform, cuda-python, bindings release, driver library, driver version,
    bindings/driver mismatch, ``cuInit``, GPUs the driver does not see).
    """
    env = os.environ if environ is None else environ
    try:
        return _probe(
            driver,
            nvml_driver_version,
            nvml_cuda_version or None,
            gpus,
            env,
            system or platform.system(),
            machine or platform.machine(),
        )
    except errors.BackendUnavailable as exc:
        return Availability(False, exc.message, dict(exc.details))


def _probe(
    driver: CheckpointDriver | None,
    nvml_driver_version: Callable[[], str] | None,
    nvml_cuda: int | None,
    gpus: Sequence[GpuFacts] | None,
    env: MutableMapping[str, str],
    system: str,
    machine: str,
) -> Availability:
    if system != "Linux" or machine.lower() not in ("x86_64", "amd64"):
        raise errors.BackendUnavailable(
            f"the CUDA checkpoint API runs on Linux x86-64 only; this node is {system} {machine}",
            system=system,
            machine=machine,
        )
    details: dict[str, Any] = {}
    if nvml_cuda:
        details["nvml_cuda_version"] = cuda_text(nvml_cuda)
    with _initialising(env) as cleared:
        if cleared:
            details["cleared_env"] = dict(cleared)
        if driver is None:
            driver = _load_bindings(nvml_cuda, details)
        details["bindings_version"] = driver.bindings_version
        cuda_version = _driver_cuda_version(driver, nvml_cuda, details)
        details["cuda_version"] = cuda_text(cuda_version)
        if nvml_driver_version is not None:
            try:
                version = str(nvml_driver_version())
            except Exception as exc:
                raise errors.BackendUnavailable(f"NVML could not report the driver version: {exc}", **details) from exc
            details["driver_version"] = version
            if _driver_major(version) < MIN_DRIVER:
                raise errors.BackendUnavailable(
                    f"NVIDIA driver {version} found; the CUDA checkpoint API needs driver {MIN_DRIVER} or newer",
                    **details,
                )
        if cuda_version < MIN_CUDA:
            found = f" {details['driver_version']}" if "driver_version" in details else ""
            raise errors.BackendUnavailable(
                f"the NVIDIA driver{found} supports CUDA {cuda_text(cuda_version)}; the CUDA checkpoint API needs "
                f"CUDA {cuda_text(MIN_CUDA)} (driver {MIN_DRIVER} or newer)",
                **details,
            )
        _check_bindings_fit(driver, cuda_version, details)
        result = driver.init()
        if result != CUDA_SUCCESS:
            raise errors.BackendUnavailable(
                f"cuInit(0) failed: {result_name(result)}; no usable GPU for the daemon (check the driver is loaded, "
                "device permissions and CUDA_VISIBLE_DEVICES). Restores need the driver initialised in the daemon "
                "(or persistence mode, nvidia-smi -pm 1)",
                **details,
            )
    reach = _reach(driver, gpus, cleared, details)
    return Availability(True, details=details, driver=driver, reach=reach)


@contextlib.contextmanager
def _initialising(env: MutableMapping[str, str]) -> Iterator[dict[str, str]]:
    """Take :data:`NARROWING_ENV` out of ``env`` while the driver initialises; put it back after.

    The driver reads ``CUDA_VISIBLE_DEVICES`` once, at ``cuInit``: taking it away for that
    moment is enough for the daemon's own driver to see every GPU, and leaves the variable
    to whatever reads it later (processes the daemon starts). A driver that this process
    initialised earlier (an embedding program using CUDA) keeps what it saw; :func:`_reach`
    tells.
    """
    cleared = {name: env[name] for name in NARROWING_ENV if name in env}
    for name, value in cleared.items():
        log.warning(
            "%s=%s is set for the daemon: its CUDA driver is initialised without it, so that restores can reach "
            "every GPU (the variable narrows only the GPUs a process sees, not the ones timesliced schedules)",
            name,
            value,
        )
        del env[name]
    try:
        yield cleared
    finally:
        for name, value in cleared.items():
            env.setdefault(name, value)


def _fix(cuda_version: int | None, *, say_version: bool = True) -> str:
    """What to run to get fitting bindings, for a driver supporting ``cuda_version`` (None: unknown)."""
    if cuda_version and cuda_version >= MIN_CUDA:
        said = f" (the NVIDIA driver supports CUDA {cuda_text(cuda_version)})" if say_version else ""
        return f"run {install_command(cuda_version)}{said}"
    bad = ", ".join(sorted(KNOWN_BAD_BINDINGS))
    return (
        f"install cuda-bindings of the driver's CUDA major, 12.8 or newer but not {bad}: "
        "pip install 'timesliced[cuda12]' for a CUDA 12 driver, 'timesliced[cuda13]' for CUDA 13 "
        "(nvidia-smi shows the driver's CUDA version)"
    )


def _load_bindings(nvml_cuda: int | None, details: dict[str, Any]) -> CheckpointDriver:
    try:
        return CudaDriver()
    except errors.BackendUnavailable as exc:
        raise errors.BackendUnavailable(f"{exc.message}; {_fix(nvml_cuda)}", **{**details, **exc.details}) from exc


def _driver_cuda_version(driver: CheckpointDriver, nvml_cuda: int | None, details: dict[str, Any]) -> int:
    """cuDriverGetVersion; when the bindings cannot call it, NVML's figure says whether they are the wrong ones."""
    try:
        result, version = driver.driver_version()
    except errors.BackendUnavailable as exc:
        if nvml_cuda and driver.bindings_cuda_version // 1000 > nvml_cuda // 1000:
            raise _mismatch(driver, nvml_cuda, details) from exc
        raise errors.BackendUnavailable(exc.message, **{**details, **exc.details}) from exc
    if result != CUDA_SUCCESS:
        raise errors.BackendUnavailable(f"cuDriverGetVersion failed: {result_name(result)}", **details)
    return version


def _mismatch(driver: CheckpointDriver, cuda_version: int, details: dict[str, Any]) -> errors.BackendUnavailable:
    bindings_major = driver.bindings_cuda_version // 1000
    found = f" {details['driver_version']}" if "driver_version" in details else ""
    return errors.BackendUnavailable(
        f"cuda-bindings {driver.bindings_version} is built for CUDA {bindings_major} but the NVIDIA driver{found} "
        f"supports CUDA {cuda_text(cuda_version)}: {_fix(cuda_version, say_version=False)}, or upgrade the driver",
        **details,
    )


def _check_bindings_fit(driver: CheckpointDriver, cuda_version: int, details: dict[str, Any]) -> None:
    # The driver API is backward compatible: bindings built for an older CUDA major work on a
    # newer driver, but bindings built for a newer major than the driver supports do not.
    bindings_major = driver.bindings_cuda_version // 1000
    if bindings_major > cuda_version // 1000:
        raise _mismatch(driver, cuda_version, details)
    known = KNOWN_BAD_BINDINGS.get(driver.bindings_version)
    if known:  # CudaDriver refuses these by their missing pieces; say so for any other driver seam too
        raise errors.BackendUnavailable(
            f"cuda-bindings {driver.bindings_version} cannot checkpoint: {known}; {_fix(cuda_version)}", **details
        )
    if bindings_major < cuda_version // 1000:
        details["bindings_note"] = (
            f"cuda-bindings {driver.bindings_version} (CUDA {bindings_major}) on a CUDA {cuda_text(cuda_version)} "
            f"driver works (the driver API is backward compatible); {install_command(cuda_version)} matches it"
        )


def _reach(
    driver: CheckpointDriver, gpus: Sequence[GpuFacts] | None, cleared: dict[str, str], details: dict[str, Any]
) -> dict[int, str]:
    """How restores reach each of ``gpus``; raises when one is neither seen by the daemon's driver nor persistent."""
    result, visible = driver.devices()
    if result != CUDA_SUCCESS:
        raise errors.BackendUnavailable(
            f"the daemon's CUDA driver cannot list its GPUs (cuDeviceGetCount/cuDeviceGetUuid: {result_name(result)})",
            **details,
        )
    details["cuda_devices"] = len(visible)
    seen = {uuid.lower() for uuid in visible}
    reach: dict[int, str] = {}
    blind: list[GpuFacts] = []
    for gpu in gpus or ():
        if gpu.uuid and gpu.uuid.lower() in seen:
            reach[gpu.index] = "driver"
        elif gpu.persistence:
            reach[gpu.index] = "persistence"
        else:
            blind.append(gpu)
    if blind:
        names = ", ".join(f"GPU {g.index} ({g.uuid or 'NVML gave no UUID'})" for g in blind)
        if cleared:
            narrowing = ", ".join(f"{k}={v}" for k, v in cleared.items())
            why = (
                f" ({narrowing} was taken away for the daemon's cuInit, but a CUDA driver this process initialised "
                "earlier keeps what it saw then)"
            )
        else:
            why = ""
        raise errors.BackendUnavailable(
            f"the daemon's CUDA driver does not see {names}{why} and persistence mode is off there: a restore onto it "
            "would fail, since it needs the GPU brought up by the daemon's cuInit or kept up by persistence mode. "
            "Start the daemon with every GPU visible (no CUDA_VISIBLE_DEVICES; in a container, all of the node's "
            "GPUs), or enable persistence mode (sudo nvidia-smi -pm 1)",
            unreachable=[g.index for g in blind],
            **details,
        )
    return reach


def _driver_major(version: str) -> int:
    try:
        return int(version.strip().split(".")[0])
    except ValueError:
        return 0


def gpu_facts(memory: Any) -> list[GpuFacts] | None:
    """The node's GPUs from an NVML handle (``devices()``, ``persistence_mode()``); None when it has no such methods."""
    devices = getattr(memory, "devices", None)
    if devices is None:
        return None
    persistence = getattr(memory, "persistence_mode", None)
    facts = []
    for info in devices():
        mode = None
        if persistence is not None:
            try:
                mode = persistence(info.index)
            except errors.TimeslicedError:
                mode = None
        facts.append(GpuFacts(info.index, info.uuid, mode))
    return facts


def open_backend(
    memory: CheckpointMemory,
    *,
    driver: CheckpointDriver | None = None,
    nvml_driver_version: Callable[[], str] | None = None,
    environ: MutableMapping[str, str] | None = None,
    footprints: str | None = None,
    **options: Any,
) -> CudaCheckpointBackend:
    """Probe this node (:func:`probe`, which runs ``cuInit``) and build the backend.

    ``memory`` is the node's NVML view (:class:`timesliced.nvml.Nvml`): when it says it is
    not ``available`` the backend cannot measure anything and is refused; its
    ``driver_version``, ``cuda_driver_version`` and GPUs (``devices()``,
    ``persistence_mode()``) go to the probe. ``footprints`` (:data:`FOOTPRINTS`) defaults to
    ``per-process`` where NVML sees the daemon's PIDs (:func:`timesliced.nvml.pid_view`),
    else ``gpu-delta``. ``driver`` defaults to :class:`CudaDriver`; ``environ`` goes to the
    probe; ``options`` go to :class:`CudaCheckpointBackend`.
    Raises :class:`~timesliced.errors.BackendUnavailable` with the reason.
    """
    if not getattr(memory, "available", True):
        reason = getattr(memory, "reason", "") or "unknown reason"
        raise errors.BackendUnavailable(
            f"NVML is not available ({reason}): cuda-checkpoint needs it to measure what a job holds on its GPUs"
        )
    if nvml_driver_version is None:
        version = getattr(memory, "driver_version", "")
        if isinstance(version, str) and version:
            nvml_driver_version = lambda: version  # noqa: E731
    cuda = getattr(memory, "cuda_driver_version", 0)
    gpus = gpu_facts(memory)
    verdict = probe(
        driver,
        nvml_driver_version=nvml_driver_version,
        nvml_cuda_version=cuda if isinstance(cuda, int) else None,
        gpus=gpus,
        environ=environ,
    )
    ready = verdict.require()
    if footprints is None:
        from timesliced.nvml import pid_view

        view = pid_view()
        footprints = PER_PROCESS if view.shared else GPU_DELTA
        why = view.why + (
            "; footprints from NVML's per-process figures"
            if view.shared
            else "; footprints from each GPU's used-memory change across the checkpoint"
        )
    else:
        why = "chosen by the daemon's configuration"
    return CudaCheckpointBackend(
        ready,
        memory,
        footprints=footprints,
        footprints_why=why,
        gpus=tuple(g.index for g in gpus) if gpus is not None else (),
        reach=verdict.reach if gpus is not None else None,
        facts=verdict.details,
        **options,
    )


# --- the backend -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    """How one worker's steps on one process ended: all done, or which one failed and how."""

    pid: int
    op: str = ""  # the failed step; "" when every step succeeded
    result: int = CUDA_SUCCESS
    state: str = ""  # rollback found the process in a state it cannot drive
    error: Exception | None = None  # the step raised instead of returning a result

    @property
    def ok(self) -> bool:
        return not self.op


@dataclass(frozen=True)
class _Found:
    """A job's processes to park, and how this move measures their footprint."""

    pids: tuple[int, ...]  # the processes with CUDA state, to lock and checkpoint
    reported: dict[int, dict[int, int | None]]  # NVML's figures of those processes (per-process mode)
    measure: tuple[int, ...]  # GPUs whose used memory is read around the checkpoint
    mode: str  # PER_PROCESS or GPU_DELTA, for this move
    gpus: tuple[int, ...]  # every GPU the job may hold memory on, for the reach check


class CudaCheckpointBackend:
    """The ``cuda-checkpoint`` parking method.

    ``driver`` is an initialised :class:`CheckpointDriver` (``probe(...).require()``;
    :func:`open_backend` does both); ``memory`` gives NVML's live figures. ``lock_timeout``
    (seconds) bounds each lock inside the driver; ``restore_margin`` (bytes per
    GPU) is kept free on top of the job's footprint at restore, for the contexts
    the driver recreates; ``max_workers`` caps the worker threads (one per
    process in flight). ``footprints`` is how a job's footprint is measured
    (:data:`FOOTPRINTS`; ``footprints_why`` says why, for ``status``). ``gpus`` are
    the node's GPUs, measured in ``gpu-delta`` mode for a job that names none;
    ``reach`` (gpu -> "driver" | "persistence", from the probe) lists the GPUs restores
    can reach, None when not checked; ``facts`` are the probe's details, for ``status``.
    ``descendants`` and ``alive`` read the process table.
    Raises ``ValueError`` for a non-positive timeout or worker count, a
    negative margin or an unknown ``footprints``.
    """

    name = "cuda-checkpoint"

    def __init__(
        self,
        driver: CheckpointDriver,
        memory: CheckpointMemory,
        *,
        lock_timeout: float = 30.0,
        restore_margin: int = 128 << 20,
        max_workers: int = 64,
        footprints: str = PER_PROCESS,
        footprints_why: str = "",
        gpus: Iterable[int] = (),
        reach: dict[int, str] | None = None,
        facts: dict[str, Any] | None = None,
        descendants: Callable[[Iterable[int]], set[int]] = processes.descendants,
        alive: Callable[[int], bool] = processes.pid_alive,
    ) -> None:
        if not lock_timeout > 0:
            raise ValueError(f"lock_timeout must be positive, not {lock_timeout!r}")
        if restore_margin < 0:
            raise ValueError(f"restore_margin must be >= 0, not {restore_margin!r}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, not {max_workers!r}")
        if footprints not in FOOTPRINTS:
            raise ValueError(f"footprints must be one of {', '.join(FOOTPRINTS)}, not {footprints!r}")
        self._driver = driver
        self._memory = memory
        # The driver takes an unsigned int of milliseconds, and 0 would mean no timeout at all.
        self.lock_timeout_ms = min(max(1, round(lock_timeout * 1000)), 2**32 - 1)
        self.restore_margin = restore_margin
        self.footprints = footprints
        self.footprints_why = footprints_why or f"footprints: {footprints}"
        self._gpus = tuple(sorted(set(gpus)))
        self._reach = dict(reach) if reach is not None else None
        self._facts = dict(facts or {})
        self._descendants = descendants
        self._alive = alive
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="cuda-checkpoint")
        self._parked: dict[str, Footprints] = {}
        self._busy: set[str] = set()
        self._inflight: dict[str, list[concurrent.futures.Future[Any]]] = {}
        self._closed = False

    def describe(self) -> status.CheckpointProbe:
        """How this node parks processes, for ``status`` (``parking.checkpoint``)."""
        return {
            "footprints": self.footprints,
            "footprints_why": self.footprints_why,
            "bindings": self._driver.bindings_version,
            "cuda": self._facts.get("cuda_version"),
            "restore_gpus": {str(gpu): how for gpu, how in sorted((self._reach or {}).items())},
            "cleared_env": dict(self._facts.get("cleared_env", {})),
        }

    # --- Backend -----------------------------------------------------------------------

    async def snapshot(self, job: JobTarget) -> MoveResult:
        """Lock, then checkpoint, every process of ``job`` that has CUDA state.

        Raises :class:`~timesliced.errors.ParkRefused` (the job runs on, whole) when a
        lock timed out, a call or a measurement failed and every process was rolled back
        to running (``details["cause"]`` names the first failure, ``backend_timeout`` for
        a lock), or when the job is on a GPU restores cannot reach (nothing touched);
        the first failure's own class when rolling back failed too (the job's state is
        unknown); :class:`~timesliced.errors.BackendError` when the job is already parked
        or busy.
        """
        started = time.perf_counter()
        with self._operation(job.name):
            if job.name in self._parked:
                raise errors.BackendError(f"job {job.name!r} is already parked by cuda-checkpoint", job=job.name)
            found = await self._in_thread(job.name, self._discover, job)
            self._check_reach(job, found.gpus, "parked")
            record: Footprints = {}
            if found.pids:
                pids = list(found.pids)
                locked = await self._each(job.name, pids, self._steps, ("lock",))
                await self._settle_failures(job, "snapshot", locked, _TO_RUNNING)
                # Locked processes make no CUDA calls: what they hold stays put from here on.
                before = await self._measure(job, found, "before the checkpoint")
                saved = await self._each(job.name, pids, self._steps, ("checkpoint",))
                await self._settle_failures(job, "snapshot", saved, _TO_RUNNING)
                after = await self._measure(job, found, "after the checkpoint")
                record = _record(found, before, after)
            self._parked[job.name] = record
        return _move(record, time.perf_counter() - started)

    async def restore(self, job: JobTarget) -> MoveResult:
        """Restore, then unlock, every parked process of ``job`` that is still alive.

        Raises :class:`~timesliced.errors.InsufficientMemory` (nothing touched, the job
        stays parked and whole) when a GPU lacks the free memory the job needs plus the
        margin; :class:`~timesliced.errors.RestoreRefused` when the job is on a GPU
        restores cannot reach (nothing touched) or a call failed and every process was
        checkpointed again; the first failure's own class when that failed too (the
        state is unknown); :class:`~timesliced.errors.BackendError` when nothing is
        parked for the job.
        """
        started = time.perf_counter()
        with self._operation(job.name):
            record = self._parked.get(job.name)
            if record is None:
                raise errors.BackendError(f"job {job.name!r} has nothing parked by cuda-checkpoint", job=job.name)
            live, free = await self._in_thread(job.name, self._before_restore, record)
            if self._parked.get(job.name) is record:
                self._parked[job.name] = live  # an exited process took its parked state with it
            self._check_reach(job, (*job.gpus, *_totals(live)), "restored")
            self._check_room(job, live, free)
            pids = sorted(pid for pid in live if pid != JOB_WIDE)
            if pids:
                restored = await self._each(job.name, pids, self._steps, ("restore",))
                await self._settle_failures(job, "restore", restored, _TO_PARKED)
                unlocked = await self._each(job.name, pids, self._steps, ("unlock",))
                await self._settle_failures(job, "restore", unlocked, _TO_PARKED)
            self._parked.pop(job.name, None)
        return _move(live, time.perf_counter() - started)

    async def reclaim(self, job: JobTarget) -> None:
        """Forget ``job``: its parked state lives in its processes, and the driver frees it when they exit."""
        self._parked.pop(job.name, None)

    async def aclose(self) -> None:
        """Stop the worker threads; driver calls still running finish on their own, unwaited."""
        self.close()

    def close(self) -> None:
        """:meth:`aclose`, for callers without an event loop."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- after a restart -----------------------------------------------------------------

    async def states(self, pids: Iterable[int]) -> dict[int, str]:
        """The driver's checkpoint state of each of ``pids`` that is a CUDA process.

        ``running``, ``locked``, ``checkpointed`` or ``failed``. PIDs the driver
        does not know (exited, or never used CUDA) are left out.
        """
        wanted = sorted(set(pids))
        futures = [self._submit("", self._driver.get_state, pid) for pid in wanted]
        answers = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        return {
            pid: state_name(state)
            for pid, (result, state) in zip(wanted, answers, strict=True)
            if result == CUDA_SUCCESS and state is not None
        }

    def parked(self, job: str) -> Footprints | None:
        """What the backend holds for a parked ``job`` (pid -> gpu -> bytes, :data:`JOB_WIDE` for the whole job).

        Plain data for the daemon to persist; :meth:`adopt` takes it back.
        """
        record = self._parked.get(job)
        return None if record is None else {pid: dict(per_gpu) for pid, per_gpu in record.items()}

    def adopt(self, job: str, record: Footprints) -> None:
        """Take back a parked job after a restart, from what :meth:`parked` gave out."""
        self._parked[job] = {
            int(pid): {int(gpu): int(n) for gpu, n in per_gpu.items()} for pid, per_gpu in record.items()
        }

    async def take_up(self, job: JobTarget, record: Footprints | None) -> str:
        """After a daemon restart: ``"parked"`` or ``"resident"``, finishing a move that was cut short.

        Every CUDA process of the job checkpointed: parked (``record``, what :meth:`parked` gave
        out before, is adopted; without it the footprints are unknown). All running: resident.
        Anything else (a lock or a checkpoint of some processes only) is driven back to running;
        raises :class:`~timesliced.errors.BackendError` when that fails.
        """
        family = set(job.pids) | await self._in_thread(job.name, self._descendants, job.pids)
        states = await self.states(family)
        if states and set(states.values()) == {"checkpointed"}:
            self.adopt(job.name, record or {pid: {} for pid in states})
            return "parked"
        if set(states.values()) <= {"running"}:
            return "resident"
        with self._operation(job.name):
            outcomes = await self._each(job.name, sorted(states), self._settle, _TO_RUNNING)
        failed = [o for o in outcomes if not o.ok and self._alive(o.pid)]
        if failed:
            raise self._failure(job, "taking the job up after a restart", failed, [], "in mixed states")
        return "resident"

    # --- work in the worker threads --------------------------------------------------------

    def _discover(self, job: JobTarget) -> _Found:
        """The job's processes with CUDA state now (the driver's answer), and how to measure them."""
        family = set(job.pids) | self._descendants(job.pids)
        initialized = getattr(self._driver, "initialized", True)
        cuda: list[int] = []
        for pid in sorted(family):
            result, state = self._driver.get_state(pid)
            if result == CUDA_SUCCESS and state is not None:
                cuda.append(pid)
            elif no_cuda_state(result, daemon_initialized=initialized) or not self._alive(pid):
                continue  # no CUDA state (never used CUDA, or exited): nothing to park
            else:
                error = error_for("get_state", pid, result, daemon_initialized=initialized)
                assert error is not None, "a failed state query has a failing result"
                raise error
        mode = self.footprints
        reported: dict[int, dict[int, int | None]] = {}
        measure: tuple[int, ...] = ()
        if mode == PER_PROCESS:
            table = self._memory.process_memory_reported()
            reported = {pid: dict(table[pid]) for pid in cuda if pid in table}
            strangers = sorted(pid for pid in family - set(cuda) if pid in table)
            if strangers:
                raise errors.BackendError(
                    f"job {job.name!r}: NVML lists PIDs {strangers} on the GPUs, but the driver finds no CUDA state "
                    "in them (a GPU user other than CUDA, or an MPS client): cuda-checkpoint cannot park them; park "
                    "this job with another method (offload)",
                    job=job.name,
                    pids=strangers,
                )
            if cuda and not reported:
                # NVML sees the daemon's PIDs (the probe's finding), yet lists none of these: trust the
                # driver's answer and measure the GPUs, right whether they hold nothing or NVML is wrong.
                log.info(
                    "job %r: NVML lists none of its CUDA processes %s; measuring its GPUs' used memory instead",
                    job.name,
                    cuda,
                )
                mode = GPU_DELTA
            else:
                measure = tuple(sorted({g for per in reported.values() for g, n in per.items() if n is None}))
        if mode == GPU_DELTA:
            measure = tuple(sorted(job.gpus)) or self._gpus
        gpus = {*job.gpus, *(g for per in reported.values() for g in per)}
        return _Found(tuple(cuda), reported, measure, mode, tuple(sorted(gpus)))

    def _used(self, gpus: tuple[int, ...]) -> dict[int, int]:
        return {gpu: self._memory.used_bytes(gpu) for gpu in gpus}

    async def _measure(self, job: JobTarget, found: _Found, when: str) -> dict[int, int]:
        """Each of ``found.measure``'s used memory; a failed reading rolls the job back to running and raises."""
        if not found.measure:
            return {}
        try:
            return await self._in_thread(job.name, self._used, found.measure)
        except errors.TimeslicedError as exc:
            failed = _Outcome(0, "measure", error=exc)
            rollback = await self._each(job.name, list(found.pids), self._settle, _TO_RUNNING)
            stuck = [o for o in rollback if not o.ok and self._alive(o.pid)]
            raise self._failure(job, f"snapshot (reading GPU memory {when})", [failed], stuck, "running") from exc

    def _before_restore(self, record: Footprints) -> tuple[Footprints, dict[int, int]]:
        live = {pid: per_gpu for pid, per_gpu in record.items() if pid != JOB_WIDE and self._alive(pid)}
        if live and JOB_WIDE in record:
            live[JOB_WIDE] = record[JOB_WIDE]  # measured for the whole job: kept while any process lives
        return live, {gpu: self._memory.free_bytes(gpu) for gpu in _totals(live)}

    def _call(self, op: str, pid: int) -> int:
        if op == "lock":
            return self._driver.lock(pid, self.lock_timeout_ms)
        call: Callable[[int], int] = getattr(self._driver, op)
        return call(pid)

    def _steps(self, pid: int, steps: tuple[str, ...]) -> _Outcome:
        """Run ``steps`` on ``pid`` in order, stopping at the first that fails."""
        for op in steps:
            try:
                result = self._call(op, pid)
            except Exception as exc:
                return _Outcome(pid, op, error=exc)
            if result != CUDA_SUCCESS:
                return _Outcome(pid, op, result)
        return _Outcome(pid)

    def _settle(self, pid: int, plan: dict[str, tuple[str, ...]]) -> _Outcome:
        """Drive ``pid`` from the state the driver reports to where ``plan`` leads."""
        try:
            result, state = self._driver.get_state(pid)
        except Exception as exc:
            return _Outcome(pid, "get_state", error=exc)
        if result != CUDA_SUCCESS or state is None:
            return _Outcome(pid, "get_state", result)
        steps = plan.get(state_name(state))
        if steps is None:
            return _Outcome(pid, "get_state", state=state_name(state))
        return self._steps(pid, steps)

    # --- plumbing ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self, job: str) -> Iterator[None]:
        """One operation per job at a time, and none while an abandoned one's calls still run."""
        if self._closed:
            raise errors.BackendError("the cuda-checkpoint backend is closed", job=job)
        if job in self._busy:
            raise errors.BackendError(f"job {job!r} already has a cuda-checkpoint operation in progress", job=job)
        running = sum(not f.done() for f in self._inflight.get(job, ()))
        if running:
            raise errors.BackendError(
                f"job {job!r}: {running} driver call(s) of an abandoned operation are still running; "
                "query states() and retry when they have returned",
                job=job,
            )
        self._inflight[job] = []
        self._busy.add(job)
        try:
            yield
        finally:
            self._busy.discard(job)
            if all(f.done() for f in self._inflight.get(job, ())):
                self._inflight.pop(job, None)

    def _submit(self, job: str, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        if self._closed:
            raise errors.BackendError("the cuda-checkpoint backend is closed")
        future = self._pool.submit(fn, *args)
        if job:
            self._inflight.setdefault(job, []).append(future)
        return future

    async def _in_thread(self, job: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.wrap_future(self._submit(job, fn, *args))
        except errors.TimeslicedError:
            raise
        except Exception as exc:
            raise errors.BackendError(f"job {job!r}: {type(exc).__name__}: {exc}", job=job) from exc

    async def _each(self, job: str, pids: list[int], fn: Callable[..., _Outcome], *args: Any) -> list[_Outcome]:
        """``fn(pid, *args)`` for every pid at once, each in its own worker thread."""
        futures = [self._submit(job, fn, pid, *args) for pid in pids]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    async def _settle_failures(
        self, job: JobTarget, what: str, outcomes: list[_Outcome], plan: dict[str, tuple[str, ...]]
    ) -> None:
        """If any process failed, roll every one back along ``plan`` and raise for the first failure."""
        failures = [o for o in outcomes if not o.ok]
        if not failures:
            return
        rollback = await self._each(job.name, [o.pid for o in outcomes], self._settle, plan)
        stuck = [o for o in rollback if not o.ok and self._alive(o.pid)]
        raise self._failure(job, what, failures, stuck, "running" if plan is _TO_RUNNING else "parked")

    def _error(self, outcome: _Outcome) -> errors.BackendError:
        call = API_NAMES.get(outcome.op, outcome.op)
        if outcome.error is not None:
            if isinstance(outcome.error, errors.BackendError):
                return outcome.error
            if isinstance(outcome.error, errors.TimeslicedError):
                return errors.BackendError(outcome.error.message, **outcome.error.details)
            return errors.BackendError(
                f"{call}(pid {outcome.pid}) raised {type(outcome.error).__name__}: {outcome.error}",
                call=call,
                pid=outcome.pid,
            )
        if outcome.state:
            return errors.BackendError(
                f"pid {outcome.pid} is {outcome.state}; it cannot be moved", call=call, pid=outcome.pid
            )
        error = error_for(
            outcome.op,
            outcome.pid,
            outcome.result,
            timeout_ms=self.lock_timeout_ms,
            daemon_initialized=getattr(self._driver, "initialized", True),
        )
        assert error is not None, "a failed outcome has a failing result"
        return error

    def _failure(
        self, job: JobTarget, what: str, failures: list[_Outcome], stuck: list[_Outcome], goal: str
    ) -> errors.BackendError:
        first = self._error(failures[0])
        message = f"{what} of job {job.name!r} failed: {first.message}"
        if len(failures) > 1:
            message += "; also " + "; ".join(self._error(o).message for o in failures[1:])
        if stuck:
            message += "; rolling back failed too (" + "; ".join(self._error(o).message for o in stuck) + ")"
            message += ": the job's processes may be in different states, see states()"
        else:
            message += f"; rolled back, the job is {goal}"
        details = dict(first.details)
        details.update(
            job=job.name,
            cause=first.code,
            failures=[_describe(o) for o in failures],
            rollback_failures=[_describe(o) for o in stuck],
        )
        if not stuck and goal in _INTACT:  # every process is back where the move began: the job is whole
            return _INTACT[goal](message, **details)
        return type(first)(message, **details)

    def _check_reach(self, job: JobTarget, gpus: Iterable[int], what: str) -> None:
        """Refuse, before anything moves, a job on a GPU that restores cannot reach (the job stays whole)."""
        if self._reach is None:
            return
        blind = sorted({gpu for gpu in gpus if gpu not in self._reach})
        if blind:
            refused = errors.ParkRefused if what == "parked" else errors.RestoreRefused
            raise refused(
                f"job {job.name!r} cannot be {what} by cuda-checkpoint: the daemon's CUDA driver does not see GPU(s) "
                f"{blind} and they are not in persistence mode, so a restore onto them would fail. Restart the daemon "
                "with every GPU visible (no CUDA_VISIBLE_DEVICES), or enable persistence mode (sudo nvidia-smi -pm 1)",
                job=job.name,
                gpus=blind,
            )

    def _check_room(self, job: JobTarget, live: Footprints, free: dict[int, int]) -> None:
        short = [
            {"gpu": gpu, "need": need, "margin": self.restore_margin, "free": free[gpu]}
            for gpu, need in sorted(_totals(live).items())
            if free[gpu] < need + self.restore_margin
        ]
        if short:
            raise errors.InsufficientMemory(
                f"restore of job {job.name!r} refused: "
                + "; ".join(
                    f"GPU {s['gpu']} has {_size(s['free'])} free, the job needs {_size(s['need'])} "
                    f"+ {_size(s['margin'])} margin"
                    for s in short
                ),
                job=job.name,
                gpus=short,
            )


def _record(found: _Found, before: dict[int, int], after: dict[int, int]) -> Footprints:
    """Per-process footprints where NVML gave them; the rest of each measured GPU's drop under JOB_WIDE."""
    record: Footprints = {pid: {} for pid in found.pids}
    if found.mode == PER_PROCESS:
        for pid, per_gpu in found.reported.items():
            record[pid] = {gpu: n for gpu, n in per_gpu.items() if n is not None and n > 0}
    known = _totals(record)
    job_wide = {}
    for gpu in found.measure:
        released = max(0, before[gpu] - after[gpu])  # others' allocations meanwhile make it smaller
        rest = released - known.get(gpu, 0)
        if rest > 0:
            job_wide[gpu] = rest
    if job_wide:
        record[JOB_WIDE] = job_wide
    return record


def _totals(record: Footprints) -> dict[int, int]:
    totals: dict[int, int] = {}
    for per_gpu in record.values():
        for gpu, n in per_gpu.items():
            totals[gpu] = totals.get(gpu, 0) + n
    return totals


def _move(record: Footprints, seconds: float) -> MoveResult:
    totals = _totals(record)
    return MoveResult(sum(totals.values()), seconds, totals)


def _describe(outcome: _Outcome) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": outcome.pid, "call": API_NAMES.get(outcome.op, outcome.op)}
    if outcome.error is not None:
        out["error"] = f"{type(outcome.error).__name__}: {outcome.error}"
    elif outcome.state:
        out["state"] = outcome.state
    else:
        out["result"] = result_name(outcome.result)
    return out


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
