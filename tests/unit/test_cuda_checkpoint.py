"""The cuda-checkpoint backend over a fake driver, and its probe, without a GPU."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

cu = pytest.importorskip(
    "cuda.bindings.driver",
    reason="cuda-python is not installed: these tests check the seam against the bindings' own types",
)

from tests.fakes.cuda_driver import (  # noqa: E402
    CHECKPOINTED,
    LOCKED,
    RUNNING,
    FakeCheckpointDriver,
    FakeGpuMemory,
)
from timesliced import errors  # noqa: E402
from timesliced.backends import cuda_driver  # noqa: E402
from timesliced.backends.base import JobTarget  # noqa: E402
from timesliced.backends.cuda_checkpoint import JOB_WIDE, CudaCheckpointBackend, open_backend, probe  # noqa: E402
from timesliced.backends.cuda_driver import CudaDriver, error_for  # noqa: E402
from timesliced.wire.park import ParkSpec  # noqa: E402

R = cu.CUresult
GiB = 1 << 30


def job(*pids: int, name: str = "a") -> JobTarget:
    return JobTarget(name, gpus=(0, 1), pids=pids, park=ParkSpec("cuda-checkpoint"))


@dataclass
class Node:
    fake: FakeCheckpointDriver
    memory: FakeGpuMemory
    backend: CudaCheckpointBackend

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    def states(self, *pids: int) -> list[Any]:
        return [self.fake.state(pid) for pid in pids]


@pytest.fixture
def make_node() -> Iterator[Callable[..., Node]]:
    """``make_node(**backend_options)``: two 10 GiB GPUs, an initialised fake driver, a backend."""
    made: list[CudaCheckpointBackend] = []

    def make(*, init: bool = True, fake: FakeCheckpointDriver | None = None, **options: Any) -> Node:
        memory = fake.memory if fake is not None else FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB})
        fake = fake or FakeCheckpointDriver(memory)
        if init:
            fake.init()
        options.setdefault("restore_margin", 0)
        backend = CudaCheckpointBackend(fake, memory, descendants=fake.descendants, alive=fake.alive, **options)
        made.append(backend)
        return Node(fake, memory, backend)

    yield make
    for backend in made:
        asyncio.run(backend.aclose())


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    """A trainer (pid 100) with two GPU workers (101 on GPU 0, 102 on both) and a CPU-only helper (103)."""
    n = make_node()
    n.fake.add_process(100, {0: 1 * GiB})
    n.fake.add_process(101, {0: 2 * GiB}, parent=100)
    n.fake.add_process(102, {0: 1 * GiB, 1: 3 * GiB}, parent=101)
    n.fake.add_process(103, parent=100, cuda=False)
    n.fake.add_process(200, {1: 1 * GiB})  # another job's process
    return n


def moved(fake: FakeCheckpointDriver) -> set[int]:
    """The PIDs the driver was asked to move (any call but the state query)."""
    return {c.pid for c in fake.calls if c.op != "get_state"}


def ended_before_started(events: list[tuple[str, str, int]], first: str, then: str) -> bool:
    """Every call of ``first`` returned before any call of ``then`` began."""
    last_end = max(i for i, (kind, op, _) in enumerate(events) if kind == "end" and op == first)
    first_start = min(i for i, (kind, op, _) in enumerate(events) if kind == "start" and op == then)
    return last_end < first_start


# --- success -----------------------------------------------------------------------------


def test_snapshot_and_restore_move_every_gpu_process_in_parallel(node: Node) -> None:
    for op in ("lock", "checkpoint", "restore", "unlock"):
        node.fake.rendezvous(op, 3)  # passes only if all three calls are in flight at once
    free_before = {gpu: node.memory.free_bytes(gpu) for gpu in (0, 1)}

    parked = node.run(node.backend.snapshot(job(100)))

    assert parked.nbytes == 7 * GiB
    assert parked.footprint == {0: 4 * GiB, 1: 3 * GiB}
    assert node.states(100, 101, 102) == [CHECKPOINTED] * 3
    assert node.states(103, 200) == [None, RUNNING]  # the CPU-only helper is no CUDA process
    assert node.memory.free_bytes(0) == free_before[0] + 4 * GiB
    assert node.memory.free_bytes(1) == free_before[1] + 3 * GiB
    assert node.fake.host_bytes(102) == {0: 1 * GiB, 1: 3 * GiB}
    assert ended_before_started(node.fake.events, "lock", "checkpoint")
    assert moved(node.fake) == {100, 101, 102}  # the CPU-only helper is only asked its state
    assert 200 not in {c.pid for c in node.fake.calls}  # another job's process is never even asked
    assert node.backend.parked("a") == {100: {0: GiB}, 101: {0: 2 * GiB}, 102: {0: GiB, 1: 3 * GiB}}

    restored = node.run(node.backend.restore(job(100)))

    assert (restored.nbytes, restored.footprint) == (7 * GiB, {0: 4 * GiB, 1: 3 * GiB})
    assert node.states(100, 101, 102) == [RUNNING] * 3
    assert {gpu: node.memory.free_bytes(gpu) for gpu in (0, 1)} == free_before
    assert ended_before_started(node.fake.events, "restore", "unlock")
    assert node.fake.broken_rendezvous == 0
    assert len({c.thread for c in node.fake.ops("lock")}) == 3
    assert node.backend.parked("a") is None


def test_the_lock_carries_the_configured_timeout(make_node: Callable[..., Node]) -> None:
    n = make_node(lock_timeout=2.5)
    seen: list[int] = []
    real_lock = n.fake.lock

    def lock(pid: int, timeout_ms: int) -> Any:
        seen.append(timeout_ms)
        return real_lock(pid, timeout_ms)

    n.fake.lock = lock  # type: ignore[method-assign]
    n.fake.add_process(7, {0: GiB})
    n.run(n.backend.snapshot(job(7)))
    assert seen == [2500]


# --- snapshot failures ----------------------------------------------------------------------


@pytest.mark.parametrize("timeout_result", [R.CUDA_ERROR_TIMEOUT, R.CUDA_ERROR_NOT_READY])
def test_lock_timeout_leaves_the_job_running(make_node: Callable[..., Node], timeout_result: Any) -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB})
    n = make_node(fake=FakeCheckpointDriver(memory, lock_timeout_result=timeout_result), lock_timeout=0.05)
    n.fake.add_process(1, {0: GiB})
    n.fake.add_process(2, {0: GiB}, parent=1)
    work = n.fake.busy(2)  # pid 2 is inside a kernel that outlasts the lock timeout
    try:
        with pytest.raises(errors.ParkRefused) as info:  # rolled back: the job is whole (state intact)
            n.run(n.backend.snapshot(job(1)))
    finally:
        work.set()
    err = info.value
    assert "cuCheckpointProcessLock(pid 2) timed out after 50 ms" in err.message
    assert timeout_result.name in err.message
    assert "rolled back, the job is running" in err.message
    assert err.details["pid"] == 2 and err.details["result"] == timeout_result.name
    assert err.details["cause"] == "backend_timeout" and errors.state_intact(err)
    assert n.states(1, 2) == [RUNNING, RUNNING]
    assert [c.pid for c in n.fake.ops("unlock")] == [1]
    assert n.fake.ops("checkpoint") == []
    assert n.memory.held(1) == {0: GiB} and n.memory.held(2) == {0: GiB}
    with pytest.raises(errors.BackendError, match="nothing parked"):
        n.run(n.backend.restore(job(1)))


def test_checkpoint_failure_rolls_every_process_back(node: Node) -> None:
    node.fake.fail("checkpoint", 101, R.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(errors.BackendError) as info:
        node.run(node.backend.snapshot(job(100)))
    err = info.value
    assert type(err) is errors.ParkRefused and err.details["cause"] == "backend_error"  # every process runs again
    assert "cuCheckpointProcessCheckpoint(pid 101) failed: CUDA_ERROR_NOT_SUPPORTED" in err.message
    assert (err.details["pid"], err.details["call"], err.details["result"]) == (
        101,
        "cuCheckpointProcessCheckpoint",
        "CUDA_ERROR_NOT_SUPPORTED",
    )
    assert err.details["rollback_failures"] == []
    assert node.states(100, 101, 102) == [RUNNING] * 3
    assert sorted(c.pid for c in node.fake.ops("restore")) == [100, 102]  # the two that were checkpointed
    assert sorted(c.pid for c in node.fake.ops("unlock")) == [100, 101, 102]
    assert node.memory.held(102) == {0: GiB, 1: 3 * GiB}
    assert node.backend.parked("a") is None


def test_a_failed_rollback_is_reported(node: Node) -> None:
    node.fake.fail("checkpoint", 101, R.CUDA_ERROR_NOT_SUPPORTED)
    node.fake.fail("restore", 102, R.CUDA_ERROR_ILLEGAL_STATE)
    with pytest.raises(errors.BackendError) as info:
        node.run(node.backend.snapshot(job(100)))
    err = info.value
    assert "rolling back failed too" in err.message and "pid 102" in err.message
    assert err.details["rollback_failures"] == [
        {"pid": 102, "call": "cuCheckpointProcessRestore", "result": "CUDA_ERROR_ILLEGAL_STATE"}
    ]
    assert node.states(100, 101, 102) == [RUNNING, RUNNING, CHECKPOINTED]


def test_snapshot_before_cuinit_is_unavailable(make_node: Callable[..., Node]) -> None:
    n = make_node(init=False)
    n.fake.add_process(5, {0: GiB})
    with pytest.raises(errors.BackendUnavailable, match="CUDA_ERROR_NOT_INITIALIZED"):
        n.run(n.backend.snapshot(job(5)))
    assert n.states(5) == [RUNNING]


# --- restore ------------------------------------------------------------------------------


def test_restore_is_refused_without_room_and_never_calls_the_driver(node: Node) -> None:
    node.run(node.backend.snapshot(job(100)))
    node.fake.add_process(300, {0: 7 * GiB, 1: 8 * GiB})  # another job took the memory meanwhile
    with pytest.raises(errors.InsufficientMemory) as info:
        node.run(node.backend.restore(job(100)))
    err = info.value
    assert err.details["gpus"] == [
        {"gpu": 0, "need": 4 * GiB, "margin": 0, "free": 3 * GiB},
        {"gpu": 1, "need": 3 * GiB, "margin": 0, "free": 1 * GiB},
    ]
    assert "GPU 0 has 3.0 GiB free, the job needs 4.0 GiB" in err.message
    assert node.fake.ops("restore") == []
    assert node.states(100, 101, 102) == [CHECKPOINTED] * 3

    node.fake.exit(300)
    node.run(node.backend.restore(job(100)))
    assert node.states(100, 101, 102) == [RUNNING] * 3


def test_restore_keeps_the_margin_free(make_node: Callable[..., Node]) -> None:
    n = make_node(restore_margin=512 << 20)
    n.fake.add_process(1, {0: 4 * GiB})
    n.run(n.backend.snapshot(job(1)))
    n.fake.add_process(2, {0: 6 * GiB})  # exactly the job's 4 GiB left: not enough with the margin
    with pytest.raises(errors.InsufficientMemory, match=r"4\.0 GiB \+ 512\.0 MiB margin"):
        n.run(n.backend.restore(job(1)))
    assert n.fake.ops("restore") == []


def test_restore_failure_leaves_the_job_parked(node: Node) -> None:
    node.run(node.backend.snapshot(job(100)))
    node.fake.fail("restore", 101, R.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(errors.BackendError) as info:
        node.run(node.backend.restore(job(100)))
    err = info.value
    assert "cuCheckpointProcessRestore(pid 101) failed: CUDA_ERROR_INVALID_VALUE" in err.message
    assert "rolled back, the job is parked" in err.message
    assert node.states(100, 101, 102) == [CHECKPOINTED] * 3  # 100 and 102 were checkpointed again
    assert node.memory.held(100) == {} and node.memory.held(102) == {}
    assert node.fake.ops("unlock") == []

    node.run(node.backend.restore(job(100)))  # the record survived: a retry works
    assert node.states(100, 101, 102) == [RUNNING] * 3


def test_unlock_failure_parks_the_job_again(node: Node) -> None:
    node.run(node.backend.snapshot(job(100)))
    node.fake.fail("unlock", 102, R.CUDA_ERROR_ILLEGAL_STATE)
    with pytest.raises(errors.BackendError, match=r"cuCheckpointProcessUnlock\(pid 102\)"):
        node.run(node.backend.restore(job(100)))
    assert node.states(100, 101, 102) == [CHECKPOINTED] * 3
    assert node.backend.parked("a") is not None


def test_an_out_of_memory_restore_says_the_process_may_be_wedged(make_node: Callable[..., Node]) -> None:
    n = make_node()
    n.fake.add_process(1, {0: GiB})
    n.run(n.backend.snapshot(job(1)))
    n.fake.fail("restore", 1, R.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(errors.BackendError, match="may refuse to restore this process again"):
        n.run(n.backend.restore(job(1)))


def test_the_fake_wedges_a_process_whose_restore_ran_out_of_memory() -> None:
    memory = FakeGpuMemory({0: 4 * GiB})
    fake = FakeCheckpointDriver(memory)
    fake.init()
    fake.add_process(1, {0: 3 * GiB})
    assert (fake.lock(1, 1000), fake.checkpoint(1)) == (R.CUDA_SUCCESS, R.CUDA_SUCCESS)
    fake.add_process(2, {0: 2 * GiB})
    assert fake.restore(1) == R.CUDA_ERROR_OUT_OF_MEMORY
    fake.exit(2)
    assert fake.restore(1) == R.CUDA_ERROR_OPERATING_SYSTEM
    assert fake.unlock(1) == R.CUDA_ERROR_ILLEGAL_STATE


# --- which processes -------------------------------------------------------------------------


def test_dead_unknown_and_memoryless_pids_are_skipped(make_node: Callable[..., Node]) -> None:
    n = make_node()
    n.fake.add_process(1, {0: GiB})
    n.fake.add_process(2, {1: GiB})
    n.fake.add_process(3, cuda=False)  # a data loader: no device memory
    parked = n.run(n.backend.snapshot(job(1, 2, 3, 4242)))  # 4242 does not exist
    assert parked.footprint == {0: GiB, 1: GiB}
    assert moved(n.fake) == {1, 2}

    n.fake.exit(2)  # died while parked: the driver freed its parked state
    restored = n.run(n.backend.restore(job(1, 2, 3, 4242)))
    assert restored.footprint == {0: GiB}
    assert [c.pid for c in n.fake.ops("restore")] == [1]


def test_a_job_without_device_memory_parks_as_a_no_op(make_node: Callable[..., Node]) -> None:
    n = make_node()
    n.fake.add_process(1, cuda=False)
    assert n.run(n.backend.snapshot(job(1))).nbytes == 0
    assert n.run(n.backend.restore(job(1))).nbytes == 0
    assert [(c.op, c.pid) for c in n.fake.calls] == [("get_state", 1)]  # only asked whether it is a CUDA process


def test_a_cuda_process_that_nvml_does_not_list_is_parked_and_measured_by_its_gpus(
    make_node: Callable[..., Node],
) -> None:
    # Per-process footprints were chosen, but NVML lists the process under another PID (the
    # probe's finding was wrong, or a driver translates PIDs): the driver's answer decides what
    # is parked, and the GPU's used memory what it weighed.
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB}, pid_offset=5000)
    n = make_node(fake=FakeCheckpointDriver(memory))
    n.fake.add_process(1, {0: 3 * GiB})
    parked = n.run(n.backend.snapshot(job(1)))
    assert n.fake.state(1) == CHECKPOINTED
    assert parked.footprint == {0: 3 * GiB}
    assert n.backend.parked("a") == {1: {}, JOB_WIDE: {0: 3 * GiB}}


# --- restart, reclaim, misuse -------------------------------------------------------------------


def test_states_after_a_daemon_restart(node: Node, make_node: Callable[..., Node]) -> None:
    node.run(node.backend.snapshot(job(100)))
    record = node.backend.parked("a")
    node.run(node.backend.aclose())

    after = make_node(fake=node.fake, init=False)  # a new daemon over the same driver state
    assert after.run(after.backend.states([100, 101, 102, 103, 200, 4242])) == {
        100: "checkpointed",
        101: "checkpointed",
        102: "checkpointed",
        200: "running",
    }
    with pytest.raises(errors.BackendError, match="nothing parked"):
        after.run(after.backend.restore(job(100)))
    assert record is not None
    after.backend.adopt("a", record)
    assert after.run(after.backend.restore(job(100))).nbytes == 7 * GiB
    assert after.run(after.backend.states([100, 101])) == {100: "running", 101: "running"}


def test_reclaim_forgets_the_job(node: Node) -> None:
    node.run(node.backend.snapshot(job(100)))
    node.run(node.backend.reclaim(job(100)))
    assert node.backend.parked("a") is None
    with pytest.raises(errors.BackendError, match="nothing parked"):
        node.run(node.backend.restore(job(100)))


def test_a_parked_job_cannot_be_parked_twice(node: Node) -> None:
    node.run(node.backend.snapshot(job(100)))
    with pytest.raises(errors.BackendError, match="already parked"):
        node.run(node.backend.snapshot(job(100)))


def test_one_operation_per_job_at_a_time(node: Node) -> None:
    release = node.fake.hang("checkpoint", 100)

    async def main() -> None:
        first = asyncio.ensure_future(node.backend.snapshot(job(100)))
        while not node.fake.ops("lock") or len(node.fake.ops("lock")) < 3:
            await asyncio.sleep(0.01)
        with pytest.raises(errors.BackendError, match="in progress"):
            await node.backend.restore(job(100))
        release.set()
        await first

    node.run(main())
    assert node.states(100, 101, 102) == [CHECKPOINTED] * 3


def test_a_cancelled_operation_blocks_the_job_until_its_calls_return(node: Node) -> None:
    release = node.fake.hang("checkpoint", 101)

    async def cancel() -> None:
        task = asyncio.ensure_future(node.backend.snapshot(job(100)))
        while ("start", "checkpoint", 101) not in node.fake.events:
            await asyncio.sleep(0.01)
        task.cancel()  # as the daemon's timeout would
        with pytest.raises(asyncio.CancelledError):
            await task

    node.run(cancel())
    with pytest.raises(errors.BackendError, match="abandoned operation are still running"):
        node.run(node.backend.snapshot(job(100)))
    release.set()
    deadline = time.monotonic() + 10
    while len(node.fake.ops("checkpoint")) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Nothing was recorded, and the driver says where the processes ended up.
    assert node.backend.parked("a") is None
    assert node.run(node.backend.states([100, 101, 102])) == dict.fromkeys((100, 101, 102), "checkpointed")


def test_aclose_does_not_wait_for_hung_calls(node: Node) -> None:
    release = node.fake.hang("lock", 100)

    async def main() -> None:
        task = asyncio.ensure_future(node.backend.snapshot(job(100)))
        while len(node.fake.ops("lock")) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await node.backend.aclose()

    try:
        node.run(main())
        with pytest.raises(errors.BackendError, match="closed"):
            node.run(node.backend.snapshot(job(100)))
    finally:
        release.set()


@pytest.mark.parametrize(
    "options", [{"lock_timeout": 0}, {"lock_timeout": -1.0}, {"restore_margin": -1}, {"max_workers": 0}]
)
def test_bad_options_are_value_errors(options: dict[str, Any]) -> None:
    memory = FakeGpuMemory({0: GiB})
    with pytest.raises(ValueError):
        CudaCheckpointBackend(FakeCheckpointDriver(memory), memory, **options)


# --- the fake's state machine -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state_ops", "op", "expected"),
    [
        ((), "checkpoint", R.CUDA_ERROR_ILLEGAL_STATE),
        ((), "restore", R.CUDA_ERROR_ILLEGAL_STATE),
        ((), "unlock", R.CUDA_ERROR_ILLEGAL_STATE),
        (("lock",), "lock", R.CUDA_ERROR_ILLEGAL_STATE),
        (("lock",), "restore", R.CUDA_ERROR_ILLEGAL_STATE),
        (("lock", "checkpoint"), "unlock", R.CUDA_ERROR_ILLEGAL_STATE),
        (("lock", "checkpoint"), "lock", R.CUDA_ERROR_ILLEGAL_STATE),
        (("lock", "checkpoint"), "checkpoint", R.CUDA_ERROR_ILLEGAL_STATE),
    ],
)
def test_fake_illegal_transitions_change_nothing(state_ops: tuple[str, ...], op: str, expected: Any) -> None:
    fake = FakeCheckpointDriver(FakeGpuMemory({0: GiB}))
    fake.init()
    fake.add_process(1, {0: 1})
    for step in state_ops:
        assert (fake.lock(1, 1000) if step == "lock" else getattr(fake, step)(1)) == R.CUDA_SUCCESS
    before = (fake.state(1), fake.memory.held(1))
    assert (fake.lock(1, 1000) if op == "lock" else getattr(fake, op)(1)) == expected
    assert (fake.state(1), fake.memory.held(1)) == before


def test_fake_full_cycle_and_unknown_pids() -> None:
    fake = FakeCheckpointDriver(FakeGpuMemory({0: GiB}))
    assert fake.lock(1, 1000) == R.CUDA_ERROR_NOT_INITIALIZED
    fake.init()
    fake.add_process(1, {0: 10})
    assert fake.get_state(1) == (R.CUDA_SUCCESS, RUNNING)
    assert fake.lock(1, 1000) == R.CUDA_SUCCESS and fake.get_state(1)[1] == LOCKED
    assert fake.checkpoint(1) == R.CUDA_SUCCESS and fake.get_state(1)[1] == CHECKPOINTED
    assert fake.memory.held(1) == {} and fake.host_bytes(1) == {0: 10}
    assert fake.restore(1) == R.CUDA_SUCCESS and fake.get_state(1)[1] == LOCKED
    assert fake.unlock(1) == R.CUDA_SUCCESS and fake.get_state(1)[1] == RUNNING
    assert fake.memory.held(1) == {0: 10}
    assert fake.get_state(2) == (R.CUDA_ERROR_INVALID_VALUE, None)
    assert fake.lock(2, 1000) == R.CUDA_ERROR_INVALID_VALUE


# --- result mapping ------------------------------------------------------------------------------


def test_result_constants_match_the_bindings() -> None:
    for name in (
        "CUDA_SUCCESS",
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_OUT_OF_MEMORY",
        "CUDA_ERROR_NOT_INITIALIZED",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_ERROR_NOT_READY",
        "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_ERROR_TIMEOUT",
    ):
        assert getattr(cuda_driver, name) == int(getattr(R, name))
    for value, name in cuda_driver.PROCESS_STATES.items():
        assert cu.CUprocessState(value).name == "CU_PROCESS_STATE_" + name.upper()


@pytest.mark.parametrize(
    ("op", "result", "cls", "text"),
    [
        ("lock", R.CUDA_ERROR_TIMEOUT, errors.BackendTimeout, "cuCheckpointProcessLock(pid 9) timed out after 30 ms"),
        ("lock", R.CUDA_ERROR_NOT_READY, errors.BackendTimeout, "CUDA_ERROR_NOT_READY"),
        ("checkpoint", R.CUDA_ERROR_TIMEOUT, errors.BackendError, "cuCheckpointProcessCheckpoint(pid 9) failed"),
        ("restore", R.CUDA_ERROR_NOT_INITIALIZED, errors.BackendError, "the process has no CUDA state"),
        ("unlock", R.CUDA_ERROR_ILLEGAL_STATE, errors.BackendError, "not in the state"),
        ("lock", R.CUDA_ERROR_INVALID_VALUE, errors.BackendError, "no such CUDA process"),
        ("checkpoint", R.CUDA_ERROR_NOT_SUPPORTED, errors.BackendError, "UVM"),
        ("restore", R.CUDA_ERROR_OUT_OF_MEMORY, errors.BackendError, "may refuse"),
        ("unlock", R.CUDA_ERROR_UNKNOWN, errors.BackendError, "CUDA_ERROR_UNKNOWN"),
    ],
)
def test_error_for_maps_results(op: str, result: Any, cls: type[errors.BackendError], text: str) -> None:
    err = error_for(op, 9, result, timeout_ms=30)
    assert type(err) is cls
    assert err is not None and text in err.message
    assert err.details["pid"] == 9 and err.details["code"] == int(result) and err.details["result"] == result.name
    assert error_for(op, 9, R.CUDA_SUCCESS) is None


def test_error_for_names_results_without_the_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    err = error_for("checkpoint", 3, 401)
    assert err is not None and "CUDA_ERROR_ILLEGAL_STATE" in err.message
    assert cuda_driver.result_name(12345) == "CUresult 12345"


# --- CudaDriver over stand-in bindings --------------------------------------------------------------


class DynamicLibNotFoundError(RuntimeError):
    pass


class FunctionNotFoundError(RuntimeError):
    pass


_UUID_BUFFERS: list[Any] = []  # keep the memory the CUuuid objects below point into


def uuid_of(ordinal: int) -> Any:
    """A real CUuuid over 16 bytes 0x10 * (ordinal + 1), +1, ..., as the driver fills one in."""
    buf = ctypes.create_string_buffer(bytes(range(0x10 * (ordinal + 1), 0x10 * (ordinal + 1) + 16)), 16)
    _UUID_BUFFERS.append(buf)
    return cu.CUuuid(ctypes.addressof(buf))


def stand_in(**overrides: Any) -> types.SimpleNamespace:
    """A module shaped like cuda.bindings.driver whose calls record their arguments."""
    seen: list[tuple[Any, ...]] = []

    def call(name: str, *outputs: Any) -> Callable[..., tuple[Any, ...]]:
        def fn(*args: Any) -> tuple[Any, ...]:
            seen.append((name, *args))
            return (R.CUDA_SUCCESS, *outputs)

        return fn

    module = types.SimpleNamespace(
        seen=seen,
        CUDA_VERSION=13040,
        CUresult=R,
        CUprocessState=cu.CUprocessState,
        CUcheckpointLockArgs=cu.CUcheckpointLockArgs,
        CUcheckpointRestoreArgs=cu.CUcheckpointRestoreArgs,
        CUuuid=cu.CUuuid,
        cuInit=call("cuInit"),
        cuDeviceGetCount=call("cuDeviceGetCount", 2),
        cuDeviceGet=lambda ordinal: (seen.append(("cuDeviceGet", ordinal)), (R.CUDA_SUCCESS, cu.CUdevice(ordinal)))[1],
        cuDeviceGetUuid=lambda dev: (R.CUDA_SUCCESS, uuid_of(int(dev))),
        cuDriverGetVersion=call("cuDriverGetVersion", 13000),
        cuCheckpointProcessLock=call("lock"),
        cuCheckpointProcessCheckpoint=call("checkpoint"),
        cuCheckpointProcessRestore=call("restore"),
        cuCheckpointProcessUnlock=call("unlock"),
        cuCheckpointProcessGetState=call("get_state", cu.CUprocessState.CU_PROCESS_STATE_LOCKED),
    )
    for name, value in overrides.items():
        setattr(module, name, value)
    return module


def test_cuda_driver_passes_the_lock_timeout_and_unpacks_results() -> None:
    module = stand_in()
    driver = CudaDriver(module, "13.4.4")
    assert (driver.bindings_version, driver.bindings_cuda_version) == ("13.4.4", 13040)
    assert driver.init() == 0 and driver.driver_version() == (0, 13000)
    assert driver.lock(11, 1500) == 0
    assert driver.checkpoint(11) == 0 and driver.restore(11) == 0 and driver.unlock(11) == 0
    assert driver.get_state(11) == (0, 1)
    lock_call = next(c for c in module.seen if c[0] == "lock")
    assert lock_call[1] == 11 and lock_call[2].timeoutMs == 1500
    assert [c[1:] for c in module.seen if c[0] in ("checkpoint", "restore", "unlock")] == [(11, None)] * 3


def test_cuda_driver_get_state_failure_and_bad_state_values() -> None:
    failing = stand_in(cuCheckpointProcessGetState=lambda pid: (R.CUDA_ERROR_INVALID_VALUE, None))
    assert CudaDriver(failing, "13.4.4").get_state(5) == (int(R.CUDA_ERROR_INVALID_VALUE), None)

    def garbage(pid: int) -> tuple[Any, ...]:
        raise ValueError("32718 is not a valid CUprocessState")

    assert CudaDriver(stand_in(cuCheckpointProcessGetState=garbage), "12.8.0").get_state(5)[1] is None


def test_cuda_driver_reports_missing_library_and_entry_points() -> None:
    def no_library(*args: Any) -> Any:
        raise DynamicLibNotFoundError('"cuda" is an NVIDIA driver library and can only be found via system search')

    def no_symbol(*args: Any) -> Any:
        raise FunctionNotFoundError("function cuCheckpointProcessLock is not found")

    with pytest.raises(errors.BackendUnavailable, match="driver library"):
        CudaDriver(stand_in(cuDriverGetVersion=no_library), "13.4.4").driver_version()
    with pytest.raises(errors.BackendUnavailable, match=r"has no cuCheckpointProcessLock.*570"):
        CudaDriver(stand_in(cuCheckpointProcessLock=no_symbol), "13.4.4").lock(1, 10)


def test_cuda_driver_refuses_bindings_without_the_checkpoint_api() -> None:
    module = stand_in()
    del module.cuCheckpointProcessLock
    with pytest.raises(errors.BackendUnavailable, match=r"cuda-bindings 12\.6\.0 lacks the checkpoint API") as info:
        CudaDriver(module, "12.6.0")
    assert info.value.details["missing"] == ["cuCheckpointProcessLock"]


def test_cuda_driver_bindings_version_from_the_package_when_not_built_in() -> None:
    module = stand_in()
    del module.CUDA_VERSION
    assert CudaDriver(module, "12.8.1").bindings_cuda_version == 12080


# --- probe ----------------------------------------------------------------------------------------


def ok_driver(**options: Any) -> FakeCheckpointDriver:
    return FakeCheckpointDriver(FakeGpuMemory({0: GiB}), **options)


def linux_probe(driver: Any = None, **options: Any) -> Any:
    options.setdefault("environ", {})  # whatever this machine's CUDA_VISIBLE_DEVICES, the same answer
    return probe(driver, system="Linux", machine="x86_64", **options)


def test_probe_accepts_a_good_node_and_initialises_the_driver() -> None:
    driver = ok_driver(cuda_version=12080, bindings_version="12.8.0", bindings_cuda_version=12080)
    verdict = linux_probe(driver, nvml_driver_version=lambda: "570.86.10")
    assert verdict.ok and verdict.reason == ""
    assert verdict.require() is driver and driver.init_calls == 1 and driver.initialized
    assert verdict.details == {
        "bindings_version": "12.8.0",
        "cuda_version": "12.8",
        "driver_version": "570.86.10",
        "cuda_devices": 1,
    }


def test_probe_accepts_older_bindings_on_a_newer_driver() -> None:
    driver = ok_driver(cuda_version=13000, bindings_version="12.9.0", bindings_cuda_version=12090)
    assert linux_probe(driver).ok


@pytest.mark.parametrize(
    ("system", "machine"), [("Darwin", "arm64"), ("Windows", "AMD64"), ("Linux", "aarch64"), ("Linux", "ppc64le")]
)
def test_probe_refuses_other_platforms(system: str, machine: str) -> None:
    driver = ok_driver()
    verdict = probe(driver, system=system, machine=machine)
    assert not verdict.ok and "Linux x86-64 only" in verdict.reason and machine in verdict.reason
    assert driver.init_calls == 0
    with pytest.raises(errors.BackendUnavailable, match="x86-64"):
        verdict.require()


def test_probe_without_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    verdict = linux_probe()
    assert not verdict.ok and "cuda-python is not installed" in verdict.reason


def test_probe_without_the_driver_library() -> None:
    def no_library(*args: Any) -> Any:
        raise DynamicLibNotFoundError("libcuda.so.1: cannot open shared object file")

    verdict = linux_probe(CudaDriver(stand_in(cuDriverGetVersion=no_library), "13.4.4"))
    assert not verdict.ok and "NVIDIA driver library (libcuda.so.1) was not found" in verdict.reason


@pytest.mark.parametrize(
    ("options", "nvml", "text"),
    [
        ({}, "550.54.15", "NVIDIA driver 550.54.15 found; the CUDA checkpoint API needs driver 570 or newer"),
        (
            {"cuda_version": 12040, "bindings_cuda_version": 12080},
            None,
            "supports CUDA 12.4; the CUDA checkpoint API needs CUDA 12.8 (driver 570 or newer)",
        ),
        (
            {"cuda_version": 12080, "bindings_version": "13.4.4", "bindings_cuda_version": 13040},
            "570.172.08",
            "cuda-bindings 13.4.4 is built for CUDA 13 but the NVIDIA driver 570.172.08 supports CUDA 12.8: "
            "run pip install 'cuda-bindings>=12.8,<13', or upgrade the driver",
        ),
        ({"init_result": R.CUDA_ERROR_NO_DEVICE}, None, "cuInit(0) failed: CUDA_ERROR_NO_DEVICE"),
    ],
)
def test_probe_refuses_with_the_reason(options: dict[str, Any], nvml: str | None, text: str) -> None:
    driver = ok_driver(**options)
    verdict = linux_probe(driver, nvml_driver_version=(lambda: nvml) if nvml else None)
    assert not verdict.ok and text in verdict.reason, verdict.reason
    assert verdict.driver is None
    if "cuInit" in text:
        assert "persistence mode" in verdict.reason


def test_probe_reports_an_nvml_failure() -> None:
    def broken() -> str:
        raise RuntimeError("NVML_ERROR_UNINITIALIZED")

    verdict = linux_probe(ok_driver(), nvml_driver_version=broken)
    assert not verdict.ok and "NVML_ERROR_UNINITIALIZED" in verdict.reason


def test_the_real_probe_here_says_why_without_hanging() -> None:
    if ctypes.util.find_library("cuda") or os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    verdict = probe()
    assert not verdict.ok
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert "NVIDIA driver library (libcuda.so.1) was not found" in verdict.reason
    with pytest.raises(errors.BackendUnavailable):
        open_backend(FakeGpuMemory({0: GiB}))


class NvmlLike(FakeGpuMemory):
    """Shaped like timesliced.nvml.Nvml where open_backend looks."""

    def __init__(self, driver_version: str, available: bool = True) -> None:
        super().__init__({0: GiB})
        self.driver_version = driver_version
        self.available = available
        self.reason = "" if available else "NVML library (libnvidia-ml.so.1) not found"


def test_open_backend_checks_the_nvml_driver_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.system", lambda: "Linux")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    driver = ok_driver()
    backend = open_backend(NvmlLike("580.65.06"), driver=driver, lock_timeout=5)
    try:
        assert driver.initialized and backend.lock_timeout_ms == 5000
    finally:
        backend.close()
    with pytest.raises(errors.BackendUnavailable, match=r"driver 535\.183\.01 found"):
        open_backend(NvmlLike("535.183.01"), driver=ok_driver())
    with pytest.raises(errors.BackendUnavailable, match=r"NVML is not available .*libnvidia-ml"):
        open_backend(NvmlLike("", available=False), driver=ok_driver())


def test_threads_are_named_for_the_backend(node: Node) -> None:
    node.run(node.backend.snapshot(job(100)))
    assert all(c.thread.startswith("cuda-checkpoint") for c in node.fake.calls)
    assert threading.current_thread().name not in {c.thread for c in node.fake.calls}


# --- after a daemon restart ----------------------------------------------------------------


def test_take_up_finds_a_parked_job_and_can_restore_it(node: Node, make_node: Callable[..., Node]) -> None:
    node.run(node.backend.snapshot(job(100)))
    record = node.backend.parked("a")
    fresh = make_node(fake=node.fake)  # a restarted daemon's backend: it knows nothing
    assert fresh.run(fresh.backend.take_up(job(100), record)) == "parked"
    assert fresh.backend.parked("a") == record
    fresh.run(fresh.backend.restore(job(100)))
    assert node.states(100, 101, 102) == [RUNNING] * 3


def test_take_up_without_a_record_still_restores_every_checkpointed_process(
    node: Node, make_node: Callable[..., Node]
) -> None:
    node.run(node.backend.snapshot(job(100)))
    fresh = make_node(fake=node.fake)
    assert fresh.run(fresh.backend.take_up(job(100), None)) == "parked"
    fresh.run(fresh.backend.restore(job(100)))
    assert node.states(100, 101, 102) == [RUNNING] * 3


def test_take_up_undoes_a_snapshot_cut_short(node: Node) -> None:
    # The daemon died with one process locked and one checkpointed: both go back to running.
    assert node.fake.lock(101, 1000) == R.CUDA_SUCCESS
    assert (node.fake.lock(102, 1000), node.fake.checkpoint(102)) == (R.CUDA_SUCCESS, R.CUDA_SUCCESS)
    assert node.run(node.backend.take_up(job(100), None)) == "resident"
    assert node.states(100, 101, 102) == [RUNNING] * 3
    assert node.memory.held(102) == {0: 1 * GiB, 1: 3 * GiB}


def test_take_up_of_running_processes_touches_nothing(node: Node) -> None:
    assert node.run(node.backend.take_up(job(100), None)) == "resident"
    assert {c.op for c in node.fake.calls} == {"get_state"}  # asked, nothing moved
