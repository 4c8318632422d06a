"""A stand-in for NVIDIA's driver checkpoint API, faithful where the backend can tell.

``FakeCheckpointDriver`` plugs into the cuda-checkpoint backend at the same
seam as ``CudaDriver`` (``timesliced.backends.cuda_driver.CheckpointDriver``),
so the backend code under test is the production code. It returns the real
``cuda.bindings.driver`` enum values (``CUresult``, ``CUprocessState``) where
cuda-python is installed. Where it is not, it returns stand-ins with the same
names and numbers (``StandInCUresult``, ``StandInCUprocessState``; a test checks
them against the bindings where those are installed), so importing this module
and collecting the tests that use it never needs cuda-python:

- each PID is a state machine with the real API's transitions (``_TRANSITIONS``);
  a call in the wrong state returns ``CUDA_ERROR_ILLEGAL_STATE`` and changes nothing;
- a PID that has exited, or never existed, returns ``CUDA_ERROR_INVALID_VALUE``; a live
  process that has not initialised CUDA returns ``CUDA_ERROR_NOT_INITIALIZED``
  (``no_cuda_result`` picks the other answer, which some drivers may give);
- every checkpoint call before ``init()`` returns ``CUDA_ERROR_NOT_INITIALIZED``;
- ``init()`` reads ``CUDA_VISIBLE_DEVICES`` (from ``environ``, empty unless given) once, as ``cuInit`` does, and
  ``devices()`` then lists the UUIDs it leaves visible (indices and ``GPU-`` UUID prefixes;
  the first entry that names no GPU ends the list);
- a lock waits for the process's submitted GPU work (``busy``) up to its timeout,
  then returns ``lock_timeout_result`` and leaves the process running;
- a PID's device memory sits in a ``FakeGpuMemory`` while it runs or is locked and
  moves to host memory when checkpointed, so NVML figures see it freed and taken
  back; a restore onto a GPU without room returns ``CUDA_ERROR_OUT_OF_MEMORY`` and,
  like the real driver, leaves a process that later restores refuse
  (``CUDA_ERROR_OPERATING_SYSTEM``).

``FakeGpuMemory`` is NVML's view of the same GPUs: ``used_bytes`` counts the driver's
own ``reserved`` memory as NVML's ``used`` does; the process lists carry NVML's PIDs,
which are the host's: with ``pid_offset`` the daemon is in a container whose PID ``p``
is host PID ``p + pid_offset``; ``unreported`` PIDs are listed with their usage not
available (None, as pynvml gives NVML_VALUE_NOT_AVAILABLE); ``outsider`` adds a process
of another container, which the daemon cannot see at all; ``broken`` GPUs fail their
memory queries as :class:`timesliced.nvml.Nvml` does (``BackendError``).

Tests inject failures (``fail``), delays (``delay``), hangs (``hang``), an action that
runs inside a call (``during``: another process allocating while a checkpoint runs) and a
rendezvous that only parallel calls can pass (``rendezvous``), and read the call
log (``calls``, ``events``) to check parallelism and ordering. The fake also
owns a process table (``descendants``, ``alive``) for the backend to read.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from timesliced import errors


class StandInCUresult(enum.IntEnum):
    """The ``CUresult`` values the fake and its tests use, numbered as in cuda.h."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_TIMEOUT = 909
    CUDA_ERROR_UNKNOWN = 999


class StandInCUprocessState(enum.IntEnum):
    """Every ``CUprocessState`` value, numbered as in cuda.h (CUDA 13)."""

    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3
    CU_PROCESS_STATE_CHECKPOINTING = 4
    CU_PROCESS_STATE_RESTORING = 5


HAVE_CUDA_PYTHON: bool
if TYPE_CHECKING:  # the stand-ins have the names and values the fake uses; checkers need no bindings
    CUresult = StandInCUresult
    CUprocessState = StandInCUprocessState
else:
    try:
        from cuda.bindings.driver import CUprocessState, CUresult

        HAVE_CUDA_PYTHON = True
    except ImportError:  # cuda-python is not installed
        CUresult, CUprocessState = StandInCUresult, StandInCUprocessState
        HAVE_CUDA_PYTHON = False

RUNNING = CUprocessState.CU_PROCESS_STATE_RUNNING
LOCKED = CUprocessState.CU_PROCESS_STATE_LOCKED
CHECKPOINTED = CUprocessState.CU_PROCESS_STATE_CHECKPOINTED
FAILED = CUprocessState.CU_PROCESS_STATE_FAILED

# op -> (state it needs, state it leaves on success)
_TRANSITIONS: dict[str, tuple[CUprocessState, CUprocessState]] = {
    "lock": (RUNNING, LOCKED),
    "checkpoint": (LOCKED, CHECKPOINTED),
    "restore": (CHECKPOINTED, LOCKED),
    "unlock": (LOCKED, RUNNING),
}

_HANG_LIMIT = 60.0  # a forgotten hang() ends here rather than wedging the test run


def gpu_uuid(index: int) -> str:
    """The fixed UUID of fake GPU ``index``, as NVML spells it (the NVML fake uses the same)."""
    return f"GPU-{index:08x}-0000-4000-8000-{index:012x}"


class FakeGpuMemory:
    """NVML's view of made-up GPUs: capacity per GPU, bytes per process (see the module docstring)."""

    def __init__(
        self,
        capacity: dict[int, int],
        *,
        reserved: dict[int, int] | None = None,
        pid_offset: int = 0,
        unreported: Iterable[int] = (),
    ) -> None:
        self.capacity = dict(capacity)
        self.reserved = dict(reserved or {})  # gpu -> bytes the driver keeps for itself
        self.pid_offset = pid_offset  # NVML's PID of the daemon's PID p is p + pid_offset
        self.unreported = set(unreported)  # daemon PIDs whose usage NVML lists as not available
        self._used: dict[int, dict[int, int]] = {}  # daemon PID -> gpu -> bytes
        self._outsiders: dict[int, dict[int, int]] = {}  # host PID -> gpu -> bytes, invisible to the daemon
        self.broken: set[int] = set()  # GPUs whose memory queries fail, as Nvml's do (BackendError)
        self._lock = threading.Lock()
        self.queries = 0  # calls of the GpuMemory methods

    def _query(self, gpu: int) -> None:
        self.queries += 1
        if gpu in self.broken:
            raise errors.BackendError(f"NVML could not read the memory of GPU {gpu}: GPU is lost", gpu=gpu)

    def _in_use(self, gpu: int) -> int:
        everyone = [*self._used.values(), *self._outsiders.values()]
        return self.reserved.get(gpu, 0) + sum(per_gpu.get(gpu, 0) for per_gpu in everyone)

    def free_bytes(self, gpu: int) -> int:
        with self._lock:
            self._query(gpu)
            return self.capacity[gpu] - self._in_use(gpu)

    def used_bytes(self, gpu: int) -> int:
        with self._lock:
            self._query(gpu)
            return self._in_use(gpu)

    def process_memory(self) -> dict[int, dict[int, int]]:
        return {pid: {g: n or 0 for g, n in per.items()} for pid, per in self.process_memory_reported().items()}

    def process_memory_reported(self) -> dict[int, dict[int, int | None]]:
        with self._lock:
            self.queries += 1
            out: dict[int, dict[int, int | None]] = {}
            for pid, per_gpu in self._used.items():
                if per_gpu:
                    hidden = pid in self.unreported
                    out[pid + self.pid_offset] = {g: None if hidden else n for g, n in per_gpu.items()}
            for host_pid, per_gpu in self._outsiders.items():
                out[host_pid] = dict(per_gpu)
            return out

    def take(self, pid: int, per_gpu: dict[int, int]) -> bool:
        """Give ``pid`` these bytes if every GPU has room; False (and nothing taken) otherwise."""
        with self._lock:
            if any(self._in_use(gpu) + n > self.capacity[gpu] for gpu, n in per_gpu.items()):
                return False
            mine = self._used.setdefault(pid, {})
            for gpu, n in per_gpu.items():
                mine[gpu] = mine.get(gpu, 0) + n
            return True

    def give_back(self, pid: int) -> dict[int, int]:
        """Free everything ``pid`` holds; what it held."""
        with self._lock:
            return self._used.pop(pid, {})

    def held(self, pid: int) -> dict[int, int]:
        with self._lock:
            return dict(self._used.get(pid, {}))

    def outsider(self, host_pid: int, per_gpu: dict[int, int]) -> None:
        """A process of another PID namespace (NVML lists it under ``host_pid``) takes memory, or frees it ({})."""
        with self._lock:
            if per_gpu:
                self._outsiders[host_pid] = dict(per_gpu)
            else:
                self._outsiders.pop(host_pid, None)


def visible_devices(uuids: list[str], value: str | None) -> list[str]:
    """The GPUs ``CUDA_VISIBLE_DEVICES=value`` leaves visible, in its order (CUDA's rules, as far as the fake goes).

    Unset: all. Entries are indices or ``GPU-`` UUIDs (a unique prefix is enough); the first
    entry that names no GPU, or names one again, ends the list, so ``""`` leaves none.
    """
    if value is None:
        return list(uuids)
    seen: list[str] = []
    for entry in value.split(","):
        entry = entry.strip()
        if entry.isdigit():
            found = [uuids[int(entry)]] if int(entry) < len(uuids) else []
        elif entry.startswith("GPU-"):
            found = [u for u in uuids if u.startswith(entry)]
        else:
            found = []
        if len(found) != 1 or found[0] in seen:
            break
        seen.append(found[0])
    return seen


@dataclass
class _Process:
    parent: int | None
    cuda: bool
    state: CUprocessState = RUNNING
    host: dict[int, int] = field(default_factory=dict)  # device memory parked in host memory
    wedged: bool = False  # a restore ran out of memory: the driver will not restore it again
    work_done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Call:
    op: str
    pid: int
    result: CUresult
    thread: str


@dataclass
class _Fault:
    op: str
    pid: int | None  # None: any pid
    result: CUresult | None = None  # return this instead of doing the call
    seconds: float = 0.0  # sleep first
    release: threading.Event | None = None  # wait for this first
    barrier: threading.Barrier | None = None  # wait here with the other parallel calls first
    action: Callable[[], None] | None = None  # run this first
    times: int = 1  # how many calls it applies to; -1 = all


class FakeCheckpointDriver:
    """The driver checkpoint API over in-memory processes; thread-safe, calls block like the real ones."""

    def __init__(
        self,
        memory: FakeGpuMemory,
        *,
        cuda_version: int = 13000,
        bindings_version: str = "13.0.2",
        bindings_cuda_version: int = 13000,
        init_result: CUresult = CUresult.CUDA_SUCCESS,
        lock_timeout_result: CUresult = CUresult.CUDA_ERROR_TIMEOUT,
        no_cuda_result: CUresult = CUresult.CUDA_ERROR_NOT_INITIALIZED,
        gpu_uuids: list[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.memory = memory
        self.no_cuda_result = no_cuda_result  # a live process without CUDA state answers this
        self.gpu_uuids = gpu_uuids if gpu_uuids is not None else [gpu_uuid(i) for i in sorted(memory.capacity)]
        self.environ = environ if environ is not None else {}  # pass os.environ to read this process's
        self.visible: list[str] = []  # what init() left visible
        self.seen_visible_devices: str | None = None  # the CUDA_VISIBLE_DEVICES init() read
        self.cuda_version = cuda_version
        self.bindings_version = bindings_version
        self.bindings_cuda_version = bindings_cuda_version
        self.init_result = init_result
        self.lock_timeout_result = lock_timeout_result
        self.initialized = False
        self.init_calls = 0
        self.calls: list[Call] = []
        self.events: list[tuple[str, str, int]] = []  # ("start" | "end", op, pid), in order
        self.broken_rendezvous = 0
        self._procs: dict[int, _Process] = {}
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()

    # --- the process table ---------------------------------------------------------------

    def add_process(
        self, pid: int, footprint: dict[int, int] | None = None, *, parent: int | None = None, cuda: bool = True
    ) -> None:
        """A live process; with ``footprint`` (gpu -> bytes) it holds that much device memory."""
        if footprint and not cuda:
            raise ValueError("only a CUDA process holds device memory")
        proc = _Process(parent, cuda)
        proc.work_done.set()
        with self._lock:
            self._procs[pid] = proc
        if footprint and not self.memory.take(pid, footprint):
            raise ValueError(f"no room for pid {pid}'s {footprint}")

    def exit(self, pid: int) -> None:
        """``pid`` dies: the driver frees its device memory and its parked copy; children are orphaned."""
        with self._lock:
            self._procs.pop(pid, None)
            for proc in self._procs.values():
                if proc.parent == pid:
                    proc.parent = None
        self.memory.give_back(pid)

    def alive(self, pid: int) -> bool:
        with self._lock:
            return pid in self._procs

    def descendants(self, pids: Iterable[int]) -> set[int]:
        roots = set(pids)
        with self._lock:
            found: set[int] = set()
            todo = list(roots)
            while todo:
                parent = todo.pop()
                for pid, proc in self._procs.items():
                    if proc.parent == parent and pid not in found and pid not in roots:
                        found.add(pid)
                        todo.append(pid)
            return found

    def state(self, pid: int) -> CUprocessState | None:
        """``pid``'s checkpoint state; None for no (CUDA) process."""
        with self._lock:
            proc = self._procs.get(pid)
            return None if proc is None or not proc.cuda else proc.state

    def host_bytes(self, pid: int) -> dict[int, int]:
        with self._lock:
            return dict(self._procs[pid].host)

    # --- injection ---------------------------------------------------------------------

    def fail(self, op: str, pid: int | None, result: CUresult, *, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` on ``pid`` (None: any) return ``result`` and change nothing."""
        with self._lock:
            self._faults.append(_Fault(op, pid, result=result, times=times))

    def delay(self, op: str, pid: int | None, seconds: float, *, times: int = 1) -> None:
        with self._lock:
            self._faults.append(_Fault(op, pid, seconds=seconds, times=times))

    def hang(self, op: str, pid: int | None, *, times: int = 1) -> threading.Event:
        """Calls of ``op`` on ``pid`` block until the returned event is set, then proceed."""
        release = threading.Event()
        with self._lock:
            self._faults.append(_Fault(op, pid, release=release, times=times))
        return release

    def during(self, op: str, pid: int | None, action: Callable[[], None], *, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` on ``pid`` (None: any) run ``action`` first, then proceed."""
        with self._lock:
            self._faults.append(_Fault(op, pid, action=action, times=times))

    def rendezvous(self, op: str, parties: int, *, timeout: float = 10.0) -> None:
        """The next ``parties`` calls of ``op`` each wait until all of them have started.

        Calls made one after another can never all be waiting at once: each
        then gives up after ``timeout`` and returns ``CUDA_ERROR_UNKNOWN``.
        """
        barrier = threading.Barrier(parties, timeout=timeout)
        with self._lock:
            self._faults.append(_Fault(op, None, barrier=barrier, times=parties))

    def busy(self, pid: int) -> threading.Event:
        """``pid`` has GPU work in flight: a lock waits until the returned event is set."""
        with self._lock:
            proc = self._procs[pid]
            proc.work_done.clear()
            return proc.work_done

    # --- CheckpointDriver ----------------------------------------------------------------

    def init(self) -> CUresult:
        self.init_calls += 1
        if self.init_result == CUresult.CUDA_SUCCESS and not self.initialized:
            # cuInit reads CUDA_VISIBLE_DEVICES once; later changes do not matter to this process.
            self.seen_visible_devices = self.environ.get("CUDA_VISIBLE_DEVICES")
            self.visible = visible_devices(self.gpu_uuids, self.seen_visible_devices)
            self.initialized = True
        return self.init_result

    def driver_version(self) -> tuple[CUresult, int]:
        return CUresult.CUDA_SUCCESS, self.cuda_version

    def devices(self) -> tuple[CUresult, list[str]]:
        if not self.initialized:
            return CUresult.CUDA_ERROR_NOT_INITIALIZED, []
        return CUresult.CUDA_SUCCESS, list(self.visible)

    def lock(self, pid: int, timeout_ms: int) -> CUresult:
        return self._do("lock", pid, timeout_ms)

    def checkpoint(self, pid: int) -> CUresult:
        return self._do("checkpoint", pid)

    def restore(self, pid: int) -> CUresult:
        return self._do("restore", pid)

    def unlock(self, pid: int) -> CUresult:
        return self._do("unlock", pid)

    def get_state(self, pid: int) -> tuple[CUresult, CUprocessState | None]:
        self._event("start", "get_state", pid)
        injected = self._inject("get_state", pid)
        if injected is not None:
            self._log("get_state", pid, injected)
            return injected, None
        with self._lock:
            proc = self._procs.get(pid)
            if not self.initialized:
                answer: tuple[CUresult, CUprocessState | None] = (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
            elif proc is None:
                answer = (CUresult.CUDA_ERROR_INVALID_VALUE, None)
            elif not proc.cuda:
                answer = (self.no_cuda_result, None)
            else:
                answer = (CUresult.CUDA_SUCCESS, proc.state)
        self._log("get_state", pid, answer[0])
        return answer

    # --- the state machine ---------------------------------------------------------------

    def _do(self, op: str, pid: int, timeout_ms: int = 0) -> CUresult:
        self._event("start", op, pid)
        injected = self._inject(op, pid)
        result = injected if injected is not None else self._transition(op, pid, timeout_ms)
        self._log(op, pid, result)
        return result

    def _inject(self, op: str, pid: int) -> CUresult | None:
        with self._lock:
            fault = next((f for f in self._faults if f.op == op and f.pid in (None, pid) and f.times), None)
            if fault is not None and fault.times > 0:
                fault.times -= 1
        if fault is None:
            return None
        if fault.action is not None:
            fault.action()
        if fault.barrier is not None:
            try:
                fault.barrier.wait()
            except threading.BrokenBarrierError:
                with self._lock:
                    self.broken_rendezvous += 1
                return CUresult.CUDA_ERROR_UNKNOWN
        if fault.release is not None:
            fault.release.wait(_HANG_LIMIT)
        if fault.seconds:
            time.sleep(fault.seconds)
        return fault.result

    def _transition(self, op: str, pid: int, timeout_ms: int) -> CUresult:
        with self._lock:
            if not self.initialized:
                return CUresult.CUDA_ERROR_NOT_INITIALIZED
            proc = self._procs.get(pid)
            if proc is None:
                return CUresult.CUDA_ERROR_INVALID_VALUE
            if not proc.cuda:
                return self.no_cuda_result
            need, leave = _TRANSITIONS[op]
            if proc.state != need:
                return CUresult.CUDA_ERROR_ILLEGAL_STATE
            work_done = proc.work_done
        if op == "lock" and not work_done.wait(timeout_ms / 1000 if timeout_ms else _HANG_LIMIT):
            return self.lock_timeout_result  # the process stays running
        with self._lock:
            if self._procs.get(pid) is not proc:
                return CUresult.CUDA_ERROR_INVALID_VALUE  # it exited meanwhile
            if proc.state != need:
                return CUresult.CUDA_ERROR_ILLEGAL_STATE
            if op == "checkpoint":
                proc.host = self.memory.give_back(pid)
            elif op == "restore":
                if proc.wedged:
                    return CUresult.CUDA_ERROR_OPERATING_SYSTEM
                if not self.memory.take(pid, proc.host):
                    proc.wedged = True
                    return CUresult.CUDA_ERROR_OUT_OF_MEMORY
                proc.host = {}
            proc.state = leave
        return CUresult.CUDA_SUCCESS

    def _event(self, kind: str, op: str, pid: int) -> None:
        with self._lock:
            self.events.append((kind, op, pid))

    def _log(self, op: str, pid: int, result: CUresult) -> None:
        with self._lock:
            self.events.append(("end", op, pid))
            self.calls.append(Call(op, pid, result, threading.current_thread().name))

    # --- views for tests -----------------------------------------------------------------

    def ops(self, op: str) -> list[Call]:
        """The finished calls of ``op``, in the order they returned."""
        with self._lock:
            return [c for c in self.calls if c.op == op]
