"""Whole-process parking with NVIDIA's driver checkpoint API (the ``cuda-checkpoint`` method).

A snapshot locks, then checkpoints, every process of the job that holds device
memory on this node: the driver copies each process's device memory into host
memory that it keeps inside that process, and releases its GPUs. A restore
puts the memory back and unlocks the processes. The job's code needs no
change: while parked, its next CUDA call simply blocks.

Which processes: the job's registered PIDs and their descendants (``/proc``),
kept where NVML reports device memory; PIDs without any are left alone. Each
process's per-GPU footprint is recorded at snapshot. A restore first checks
that every GPU has that much free (plus a margin) and refuses with
:class:`~timesliced.errors.InsufficientMemory` otherwise, before touching any
process, because a restore that runs out of memory can leave a process that
the driver will never restore again.

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
on them (NVIDIA's examples run as root).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from timesliced import errors
from timesliced.backends.base import GpuMemory, JobTarget, MoveResult
from timesliced.backends.cuda_driver import (
    API_NAMES,
    CUDA_SUCCESS,
    CheckpointDriver,
    CudaDriver,
    error_for,
    result_name,
    state_name,
)
from timesliced.util import processes

T = TypeVar("T")

MIN_DRIVER = 570  # display driver branch with the checkpoint driver API
MIN_CUDA = 12080  # the same, as the CUDA version cuDriverGetVersion reports

# How rollback drives a process from the state the driver reports; a state not
# listed (failed, or mid custom-storage copy) cannot be driven and is reported.
_TO_RUNNING: dict[str, tuple[str, ...]] = {"running": (), "locked": ("unlock",), "checkpointed": ("restore", "unlock")}
_TO_PARKED: dict[str, tuple[str, ...]] = {
    "running": ("lock", "checkpoint"),
    "locked": ("checkpoint",),
    "checkpointed": (),
}

Footprints = dict[int, dict[int, int]]  # pid -> gpu -> bytes


# --- availability ----------------------------------------------------------------------


@dataclass(frozen=True)
class Availability:
    """Whether the cuda-checkpoint method can run on this node, and why not."""

    ok: bool
    reason: str = ""  # one sentence when not ok
    details: dict[str, Any] = field(default_factory=dict)
    driver: CheckpointDriver | None = None  # initialised (cuInit done) when ok

    def require(self) -> CheckpointDriver:
        """The initialised driver; raises :class:`~timesliced.errors.BackendUnavailable` with the reason."""
        if not self.ok or self.driver is None:
            raise errors.BackendUnavailable(self.reason, **self.details)
        return self.driver


def probe(
    driver: CheckpointDriver | None = None,
    *,
    nvml_driver_version: Callable[[], str] | None = None,
    system: str | None = None,
    machine: str | None = None,
) -> Availability:
    """Check that the checkpoint API can run here and initialise the driver (``cuInit``).

    The daemon calls this once at start: restores need the driver initialised
    in the calling process. ``driver`` defaults to :class:`CudaDriver`;
    ``nvml_driver_version`` (e.g. NVML's ``nvmlSystemGetDriverVersion``)
    gives the display driver version when available; ``system`` and
    ``machine`` default to this node's. Never raises for an unavailable node:
    the verdict's ``reason`` says which check failed (platform, cuda-python,
    driver library, driver version, bindings/driver mismatch, ``cuInit``).
    """
    try:
        return _probe(driver, nvml_driver_version, system or platform.system(), machine or platform.machine())
    except errors.BackendUnavailable as exc:
        return Availability(False, exc.message, dict(exc.details))


def _probe(
    driver: CheckpointDriver | None, nvml_driver_version: Callable[[], str] | None, system: str, machine: str
) -> Availability:
    if system != "Linux" or machine.lower() not in ("x86_64", "amd64"):
        raise errors.BackendUnavailable(
            f"the CUDA checkpoint API runs on Linux x86-64 only; this node is {system} {machine}",
            system=system,
            machine=machine,
        )
    if driver is None:
        driver = CudaDriver()
    details: dict[str, Any] = {"bindings_version": driver.bindings_version}
    result, cuda_version = driver.driver_version()
    if result != CUDA_SUCCESS:
        raise errors.BackendUnavailable(f"cuDriverGetVersion failed: {result_name(result)}", **details)
    details["cuda_version"] = _cuda_text(cuda_version)
    if nvml_driver_version is not None:
        try:
            version = str(nvml_driver_version())
        except Exception as exc:
            raise errors.BackendUnavailable(f"NVML could not report the driver version: {exc}", **details) from exc
        details["driver_version"] = version
        if _driver_major(version) < MIN_DRIVER:
            raise errors.BackendUnavailable(
                f"NVIDIA driver {version} found; the CUDA checkpoint API needs driver {MIN_DRIVER} or newer", **details
            )
    if cuda_version < MIN_CUDA:
        found = f" {details['driver_version']}" if "driver_version" in details else ""
        raise errors.BackendUnavailable(
            f"the NVIDIA driver{found} supports CUDA {_cuda_text(cuda_version)}; the CUDA checkpoint API needs "
            f"CUDA {_cuda_text(MIN_CUDA)} (driver {MIN_DRIVER} or newer)",
            **details,
        )
    # The driver API is backward compatible: bindings built for an older CUDA major work on
    # a newer driver, but bindings built for a newer major than the driver supports do not.
    bindings_major = driver.bindings_cuda_version // 1000
    if bindings_major > cuda_version // 1000:
        raise errors.BackendUnavailable(
            f"cuda-bindings {driver.bindings_version} is built for CUDA {bindings_major} but the NVIDIA driver "
            f"supports CUDA {_cuda_text(cuda_version)}: install cuda-python {cuda_version // 1000}.x or upgrade "
            "the driver",
            **details,
        )
    result = driver.init()
    if result != CUDA_SUCCESS:
        raise errors.BackendUnavailable(
            f"cuInit(0) failed: {result_name(result)}; no usable GPU for the daemon (check the driver is loaded, "
            "device permissions and CUDA_VISIBLE_DEVICES). Restores need the driver initialised in the daemon "
            "(or persistence mode, nvidia-smi -pm 1)",
            **details,
        )
    return Availability(True, details=details, driver=driver)


def _driver_major(version: str) -> int:
    try:
        return int(version.strip().split(".")[0])
    except ValueError:
        return 0


def _cuda_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def open_backend(
    memory: GpuMemory,
    *,
    driver: CheckpointDriver | None = None,
    nvml_driver_version: Callable[[], str] | None = None,
    **options: Any,
) -> CudaCheckpointBackend:
    """Probe this node (:func:`probe`, which runs ``cuInit``) and build the backend.

    ``memory`` is the node's NVML view; when it carries a ``driver_version``
    string (as :class:`timesliced.nvml.Nvml` does) that version is checked
    too, and when it says it is not ``available`` the backend cannot see which
    processes hold device memory. ``driver`` defaults to :class:`CudaDriver`;
    ``options`` go to :class:`CudaCheckpointBackend`.
    Raises :class:`~timesliced.errors.BackendUnavailable` with the reason.
    """
    if nvml_driver_version is None:
        version = getattr(memory, "driver_version", "")
        if isinstance(version, str) and version:
            nvml_driver_version = lambda: version  # noqa: E731
    ready = probe(driver, nvml_driver_version=nvml_driver_version).require()
    if not getattr(memory, "available", True):
        reason = getattr(memory, "reason", "") or "unknown reason"
        raise errors.BackendUnavailable(
            f"NVML is not available ({reason}): cuda-checkpoint needs it to find the processes holding device memory"
        )
    return CudaCheckpointBackend(ready, memory, **options)


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


class CudaCheckpointBackend:
    """The ``cuda-checkpoint`` parking method.

    ``driver`` is an initialised :class:`CheckpointDriver` (``probe(...).require()``;
    :func:`open_backend` does both); ``memory`` gives NVML's live figures. ``lock_timeout``
    (seconds) bounds each lock inside the driver; ``restore_margin`` (bytes per
    GPU) is kept free on top of the job's footprint at restore, for the contexts
    the driver recreates; ``max_workers`` caps the worker threads (one per
    process in flight). ``descendants`` and ``alive`` read the process table.
    Raises ``ValueError`` for a non-positive timeout or worker count or a
    negative margin.
    """

    name = "cuda-checkpoint"

    def __init__(
        self,
        driver: CheckpointDriver,
        memory: GpuMemory,
        *,
        lock_timeout: float = 30.0,
        restore_margin: int = 128 << 20,
        max_workers: int = 64,
        descendants: Callable[[Iterable[int]], set[int]] = processes.descendants,
        alive: Callable[[int], bool] = processes.pid_alive,
    ) -> None:
        if not lock_timeout > 0:
            raise ValueError(f"lock_timeout must be positive, not {lock_timeout!r}")
        if restore_margin < 0:
            raise ValueError(f"restore_margin must be >= 0, not {restore_margin!r}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, not {max_workers!r}")
        self._driver = driver
        self._memory = memory
        # The driver takes an unsigned int of milliseconds, and 0 would mean no timeout at all.
        self.lock_timeout_ms = min(max(1, round(lock_timeout * 1000)), 2**32 - 1)
        self.restore_margin = restore_margin
        self._descendants = descendants
        self._alive = alive
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="cuda-checkpoint")
        self._parked: dict[str, Footprints] = {}
        self._busy: set[str] = set()
        self._inflight: dict[str, list[concurrent.futures.Future[Any]]] = {}
        self._closed = False

    # --- Backend -----------------------------------------------------------------------

    async def snapshot(self, job: JobTarget) -> MoveResult:
        """Lock, then checkpoint, every process of ``job`` that holds device memory.

        Raises :class:`~timesliced.errors.BackendTimeout` when a lock timed
        out, :class:`~timesliced.errors.BackendError` for any other failed
        call (after rolling the job back to running) or when the job is
        already parked or busy.
        """
        started = time.perf_counter()
        with self._operation(job.name):
            if job.name in self._parked:
                raise errors.BackendError(f"job {job.name!r} is already parked by cuda-checkpoint", job=job.name)
            targets = await self._in_thread(job.name, self._discover, job.pids)
            pids = sorted(targets)
            if pids:
                locked = await self._each(job.name, pids, self._steps, ("lock",))
                await self._settle_failures(job, "snapshot", locked, _TO_RUNNING)
                saved = await self._each(job.name, pids, self._steps, ("checkpoint",))
                await self._settle_failures(job, "snapshot", saved, _TO_RUNNING)
            self._parked[job.name] = targets
        return _move(targets, time.perf_counter() - started)

    async def restore(self, job: JobTarget) -> MoveResult:
        """Restore, then unlock, every parked process of ``job`` that is still alive.

        Raises :class:`~timesliced.errors.InsufficientMemory` (nothing touched)
        when a GPU lacks the free memory the job needs plus the margin;
        :class:`~timesliced.errors.BackendError` for a failed call (after
        checkpointing again what it can, so the job stays parked) or when
        nothing is parked for the job.
        """
        started = time.perf_counter()
        with self._operation(job.name):
            record = self._parked.get(job.name)
            if record is None:
                raise errors.BackendError(f"job {job.name!r} has nothing parked by cuda-checkpoint", job=job.name)
            live, free = await self._in_thread(job.name, self._before_restore, record)
            if self._parked.get(job.name) is record:
                self._parked[job.name] = live  # an exited process took its parked state with it
            self._check_room(job, live, free)
            pids = sorted(live)
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
        """What the backend holds for a parked ``job`` (pid -> gpu -> bytes), for the daemon to persist."""
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

    def _discover(self, pids: tuple[int, ...]) -> Footprints:
        """The job's processes that hold device memory now, with their per-GPU footprint."""
        wanted = set(pids) | self._descendants(pids)
        usage = self._memory.process_memory()
        found: Footprints = {}
        for pid in sorted(wanted):
            per_gpu = {gpu: n for gpu, n in usage.get(pid, {}).items() if n > 0}
            if per_gpu:
                found[pid] = per_gpu
        if not found:
            # Nothing to park is right for a job that has not touched a GPU yet, but not when the
            # driver knows its processes: then NVML cannot see them (another PID namespace), and
            # "parking" nothing would leave the job on the GPU while the scheduler thinks it is gone.
            known = [pid for pid in sorted(wanted) if self._driver.get_state(pid)[0] == CUDA_SUCCESS]
            if known:
                raise errors.BackendError(
                    f"the driver knows PIDs {known} as CUDA processes, but NVML reports no device memory for "
                    "them: run the daemon in the host's PID namespace (e.g. a container with --pid=host)",
                    pids=known,
                )
        return found

    def _before_restore(self, record: Footprints) -> tuple[Footprints, dict[int, int]]:
        live = {pid: per_gpu for pid, per_gpu in record.items() if self._alive(pid)}
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
            return errors.BackendError(
                f"{call}(pid {outcome.pid}) raised {type(outcome.error).__name__}: {outcome.error}",
                call=call,
                pid=outcome.pid,
            )
        if outcome.state:
            return errors.BackendError(
                f"pid {outcome.pid} is {outcome.state}; it cannot be moved", call=call, pid=outcome.pid
            )
        error = error_for(outcome.op, outcome.pid, outcome.result, timeout_ms=self.lock_timeout_ms)
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
            failures=[_describe(o) for o in failures],
            rollback_failures=[_describe(o) for o in stuck],
        )
        return type(first)(message, **details)

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
