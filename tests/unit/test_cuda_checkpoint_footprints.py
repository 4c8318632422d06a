"""Which processes cuda-checkpoint parks and what they weigh: the driver's answer, NVML's figures, the GPUs' drop.

A daemon in the host's PID namespace reads NVML's per-process figures; one in a container (NVML's
PIDs are the host's) weighs a job by its GPUs' used-memory drop across the checkpoint. Either way
the driver's checkpoint state says which processes are parked. Over the fakes, without cuda-python.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fakes.cuda_driver import CHECKPOINTED, RUNNING, CUresult, FakeCheckpointDriver, FakeGpuMemory
from timesliced import errors
from timesliced.backends.base import JobTarget
from timesliced.backends.cuda_checkpoint import GPU_DELTA, JOB_WIDE, PER_PROCESS, CudaCheckpointBackend
from timesliced.wire.park import ParkSpec

GiB = 1 << 30
MiB = 1 << 20
CONTAINER = 40_000  # the container's PID p is the host's p + CONTAINER


def job(*pids: int, name: str = "a", gpus: tuple[int, ...] = (0, 1)) -> JobTarget:
    return JobTarget(name, gpus=gpus, pids=pids, park=ParkSpec("cuda-checkpoint"))


@dataclass
class Node:
    fake: FakeCheckpointDriver
    memory: FakeGpuMemory
    backend: CudaCheckpointBackend

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    def states(self, *pids: int) -> list[Any]:
        return [self.fake.state(pid) for pid in pids]

    def moved(self) -> set[int]:
        return {c.pid for c in self.fake.calls if c.op != "get_state"}


@pytest.fixture
def make_node() -> Iterator[Callable[..., Node]]:
    """``make_node(footprints, memory=..., **backend_options)``: an initialised fake driver over two 10 GiB GPUs."""
    made: list[CudaCheckpointBackend] = []

    def make(footprints: str, *, memory: FakeGpuMemory | None = None, fake: Any = None, **options: Any) -> Node:
        memory = memory or FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB}, reserved={0: 500 * MiB, 1: 500 * MiB})
        fake = fake or FakeCheckpointDriver(memory)
        fake.init()
        options.setdefault("restore_margin", 0)
        backend = CudaCheckpointBackend(
            fake, memory, footprints=footprints, descendants=fake.descendants, alive=fake.alive, **options
        )
        made.append(backend)
        return Node(fake, memory, backend)

    yield make
    for backend in made:
        backend.close()


def trainer(n: Node) -> None:
    """pid 100 (2 GiB on GPU 0) with a worker 101 (1 GiB on GPU 0, 3 GiB on GPU 1) and a CPU-only loader 103."""
    n.fake.add_process(100, {0: 2 * GiB})
    n.fake.add_process(101, {0: 1 * GiB, 1: 3 * GiB}, parent=100)
    n.fake.add_process(103, parent=100, cuda=False)


# --- a daemon in a container -----------------------------------------------------------------


def test_in_a_container_the_driver_picks_the_processes_and_the_gpus_weigh_them(
    make_node: Callable[..., Node],
) -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB}, reserved={0: 500 * MiB, 1: 500 * MiB}, pid_offset=CONTAINER)
    n = make_node(GPU_DELTA, memory=memory)
    trainer(n)
    # Another container's process happens to have host PID 100, our trainer's PID here.
    memory.outsider(100, {1: 5 * GiB})
    assert memory.process_memory_reported()[100] == {1: 5 * GiB}  # what NVML says "100" holds: not ours

    parked = n.run(n.backend.snapshot(job(100)))

    assert n.states(100, 101) == [CHECKPOINTED] * 2
    assert n.moved() == {100, 101}  # the loader was only asked its state
    assert parked.footprint == {0: 3 * GiB, 1: 3 * GiB} and parked.nbytes == 6 * GiB
    assert n.backend.parked("a") == {100: {}, 101: {}, JOB_WIDE: {0: 3 * GiB, 1: 3 * GiB}}
    assert memory.free_bytes(1) == 10 * GiB - 500 * MiB - 5 * GiB  # the outsider is untouched

    restored = n.run(n.backend.restore(job(100)))

    assert n.states(100, 101) == [RUNNING] * 2
    assert restored.footprint == {0: 3 * GiB, 1: 3 * GiB}
    assert memory.held(101) == {0: 1 * GiB, 1: 3 * GiB}


def test_in_a_container_per_process_figures_would_name_the_wrong_process(make_node: Callable[..., Node]) -> None:
    # Why a container gets gpu-delta: NVML's "100" is another container's process, and reading it
    # as ours gives a footprint that has nothing to do with the job.
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB}, pid_offset=CONTAINER)
    n = make_node(PER_PROCESS, memory=memory)
    trainer(n)
    memory.outsider(100, {1: 5 * GiB})
    parked = n.run(n.backend.snapshot(job(100)))
    assert parked.footprint == {1: 5 * GiB}  # wrong: the job released 3 GiB on each GPU


def test_a_restore_weighed_by_the_gpus_is_refused_without_room(make_node: Callable[..., Node]) -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB}, pid_offset=CONTAINER)
    n = make_node(GPU_DELTA, memory=memory, restore_margin=256 * MiB)
    trainer(n)
    n.run(n.backend.snapshot(job(100)))
    memory.outsider(7, {1: 7 * GiB})  # leaves exactly the 3 GiB the job needs on GPU 1: not the margin
    with pytest.raises(errors.InsufficientMemory, match=r"GPU 1 has 3\.0 GiB free, the job needs 3\.0 GiB"):
        n.run(n.backend.restore(job(100)))
    assert [c for c in n.fake.calls if c.op == "restore"] == []
    memory.outsider(7, {})
    n.run(n.backend.restore(job(100)))
    assert n.states(100, 101) == [RUNNING] * 2


def test_the_job_wide_figure_survives_a_restart_and_outlives_all_but_the_last_process(
    make_node: Callable[..., Node],
) -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB}, pid_offset=CONTAINER)
    n = make_node(GPU_DELTA, memory=memory)
    trainer(n)
    n.run(n.backend.snapshot(job(100)))
    record = n.backend.parked("a")
    assert record is not None
    n.backend.close()

    again = make_node(GPU_DELTA, memory=memory, fake=n.fake)  # a restarted daemon over the same driver
    # The journal carries the record as plain data, keys and all.
    plain: Any = {str(pid): {str(g): b for g, b in per.items()} for pid, per in record.items()}
    again.backend.adopt("a", plain)
    n.fake.exit(100)  # one process dies while parked: the job-wide bytes stay with the survivor
    memory.outsider(7, {1: 7 * GiB + 1})
    with pytest.raises(errors.InsufficientMemory):
        again.run(again.backend.restore(job(100)))
    memory.outsider(7, {})
    restored = again.run(again.backend.restore(job(100)))
    assert restored.footprint == {0: 3 * GiB, 1: 3 * GiB}
    assert [c.pid for c in n.fake.ops("restore")] == [101]


def test_when_every_process_died_while_parked_nothing_is_restored(make_node: Callable[..., Node]) -> None:
    n = make_node(GPU_DELTA)
    trainer(n)
    n.run(n.backend.snapshot(job(100)))
    n.fake.exit(101)
    n.fake.exit(100)
    assert n.run(n.backend.restore(job(100))).footprint == {}
    assert n.fake.ops("restore") == []


def test_gpu_delta_measures_the_nodes_gpus_for_a_job_that_names_none(make_node: Callable[..., Node]) -> None:
    n = make_node(GPU_DELTA, gpus=(0, 1))
    trainer(n)
    assert n.run(n.backend.snapshot(job(100, gpus=()))).footprint == {0: 3 * GiB, 1: 3 * GiB}


# --- concurrent activity on the GPU ---------------------------------------------------------


@pytest.mark.parametrize(
    ("footprints", "expected"),
    [(GPU_DELTA, {0: 2 * GiB, 1: 3 * GiB}), (PER_PROCESS, {0: 3 * GiB, 1: 3 * GiB})],
)
def test_an_allocation_during_the_checkpoint_shrinks_only_a_gpu_delta_figure(
    make_node: Callable[..., Node], footprints: str, expected: dict[int, int]
) -> None:
    n = make_node(footprints)
    trainer(n)
    # Another process creates a 1 GiB context on GPU 0 while the job's memory goes to the host.
    n.fake.during("checkpoint", 101, lambda: n.memory.outsider(9999, {0: 1 * GiB}))
    assert n.run(n.backend.snapshot(job(100))).footprint == expected


def test_a_gpu_delta_figure_never_goes_below_zero(make_node: Callable[..., Node]) -> None:
    n = make_node(GPU_DELTA)
    trainer(n)
    n.fake.during("checkpoint", 101, lambda: n.memory.outsider(9999, {1: 4 * GiB}))  # more than the job freed
    assert n.run(n.backend.snapshot(job(100))).footprint == {0: 3 * GiB}


# --- NVML lists a process without a figure ------------------------------------------------------


def test_a_process_listed_without_a_figure_is_parked_and_weighed_by_its_gpus(make_node: Callable[..., Node]) -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB}, reserved={0: 500 * MiB, 1: 500 * MiB}, unreported={101})
    n = make_node(PER_PROCESS, memory=memory)
    trainer(n)
    n.fake.add_process(102, {1: 1 * GiB}, parent=100)
    assert memory.process_memory_reported()[101] == {0: None, 1: None}  # NVML_VALUE_NOT_AVAILABLE
    assert memory.process_memory()[101] == {0: 0, 1: 0}  # what the old reading took for "no memory"

    parked = n.run(n.backend.snapshot(job(100)))

    assert n.states(100, 101, 102) == [CHECKPOINTED] * 3
    assert parked.footprint == {0: 3 * GiB, 1: 4 * GiB}
    # Known figures stay per process; the GPUs' drop covers the rest.
    assert n.backend.parked("a") == {
        100: {0: 2 * GiB},
        101: {},
        102: {1: 1 * GiB},
        JOB_WIDE: {0: 1 * GiB, 1: 3 * GiB},
    }


def test_with_every_figure_known_the_gpus_are_not_read(make_node: Callable[..., Node]) -> None:
    n = make_node(PER_PROCESS)
    trainer(n)
    n.memory.broken = {0, 1}  # any used-memory reading would fail the snapshot
    assert n.run(n.backend.snapshot(job(100))).footprint == {0: 3 * GiB, 1: 3 * GiB}


def test_nvml_listing_a_process_the_driver_does_not_know_refuses_before_anything_moves(
    make_node: Callable[..., Node],
) -> None:
    n = make_node(PER_PROCESS)
    trainer(n)
    assert n.memory.take(103, {0: GiB})  # the loader uses the GPU, but not through CUDA
    with pytest.raises(errors.BackendError, match=r"NVML lists PIDs \[103\].*no CUDA state.*offload"):
        n.run(n.backend.snapshot(job(100)))
    assert n.moved() == set() and n.states(100, 101) == [RUNNING] * 2


# --- the state query ----------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [CUresult.CUDA_ERROR_NOT_INITIALIZED, CUresult.CUDA_ERROR_INVALID_VALUE])
def test_a_live_process_without_cuda_state_is_left_alone(make_node: Callable[..., Node], answer: Any) -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB})
    n = make_node(GPU_DELTA, memory=memory, fake=FakeCheckpointDriver(memory, no_cuda_result=answer))
    trainer(n)
    assert n.fake.get_state(103) == (answer, None)
    n.run(n.backend.snapshot(job(100)))
    assert n.moved() == {100, 101}


def test_before_the_daemons_cuinit_not_initialized_means_the_daemon(make_node: Callable[..., Node]) -> None:
    memory = FakeGpuMemory({0: 10 * GiB, 1: 10 * GiB})
    fake = FakeCheckpointDriver(memory)
    n = make_node(GPU_DELTA, memory=memory, fake=fake)
    fake.initialized = False  # as if the probe had never run cuInit
    trainer(n)
    with pytest.raises(errors.BackendUnavailable, match="not initialised in the daemon"):
        n.run(n.backend.snapshot(job(100)))
    assert n.moved() == set()


def test_a_failing_state_query_of_a_live_process_refuses_before_anything_moves(make_node: Callable[..., Node]) -> None:
    n = make_node(GPU_DELTA)
    trainer(n)
    n.fake.fail("get_state", 101, CUresult.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(errors.BackendError, match=r"cuCheckpointProcessGetState\(pid 101\) failed"):
        n.run(n.backend.snapshot(job(100)))
    assert n.moved() == set()


def test_a_failing_state_query_of_an_exited_process_is_skipped(make_node: Callable[..., Node]) -> None:
    n = make_node(GPU_DELTA)
    trainer(n)
    n.fake.fail("get_state", 4242, CUresult.CUDA_ERROR_NOT_SUPPORTED)
    n.run(n.backend.snapshot(job(100, 4242)))  # 4242 is registered but gone
    assert n.moved() == {100, 101}


# --- a failed measurement rolls back --------------------------------------------------------------


def test_a_failed_reading_after_the_locks_leaves_the_job_running(make_node: Callable[..., Node]) -> None:
    n = make_node(GPU_DELTA)
    trainer(n)
    n.memory.broken = {1}
    with pytest.raises(errors.BackendError) as info:
        n.run(n.backend.snapshot(job(100)))
    assert "reading GPU memory before the checkpoint" in info.value.message
    assert "rolled back, the job is running" in info.value.message
    assert n.states(100, 101) == [RUNNING] * 2 and n.fake.ops("checkpoint") == []
    assert n.backend.parked("a") is None


def test_a_failed_reading_after_the_checkpoint_restores_the_job(make_node: Callable[..., Node]) -> None:
    n = make_node(GPU_DELTA)
    trainer(n)
    n.fake.during("checkpoint", 101, lambda: n.memory.broken.add(0))
    with pytest.raises(errors.BackendError, match="reading GPU memory after the checkpoint"):
        n.run(n.backend.snapshot(job(100)))
    assert n.states(100, 101) == [RUNNING] * 2
    assert n.memory.held(101) == {0: 1 * GiB, 1: 3 * GiB}
    assert n.backend.parked("a") is None


# --- GPUs that restores cannot reach ----------------------------------------------------------------


def test_a_job_on_a_gpu_restores_cannot_reach_is_refused_before_anything_moves(
    make_node: Callable[..., Node],
) -> None:
    n = make_node(PER_PROCESS, reach={0: "driver"})  # GPU 1: not seen by the daemon's driver, no persistence
    trainer(n)
    with pytest.raises(errors.ParkRefused, match=r"GPU\(s\) \[1\].*CUDA_VISIBLE_DEVICES.*nvidia-smi -pm 1"):
        n.run(n.backend.snapshot(job(100)))
    assert n.moved() == set() and n.backend.parked("a") is None

    # A job only on GPU 0 parks and comes back.
    n.fake.add_process(300, {0: GiB})
    n.run(n.backend.snapshot(job(300, name="b", gpus=(0,))))
    n.run(n.backend.restore(job(300, name="b", gpus=(0,))))
    assert n.fake.state(300) == RUNNING


def test_a_parked_job_is_not_restored_onto_a_gpu_restores_cannot_reach(make_node: Callable[..., Node]) -> None:
    n = make_node(PER_PROCESS)
    trainer(n)
    n.run(n.backend.snapshot(job(100)))
    record = n.backend.parked("a")
    assert record is not None
    narrowed = make_node(PER_PROCESS, memory=n.memory, fake=n.fake, reach={0: "driver", 1: "persistence"})
    narrowed.backend.adopt("a", record)
    narrowed.run(narrowed.backend.restore(job(100)))  # persistence mode keeps GPU 1 reachable
    assert n.states(100, 101) == [RUNNING] * 2

    narrowed.run(narrowed.backend.snapshot(job(100, name="c")))
    blind = make_node(PER_PROCESS, memory=n.memory, fake=n.fake, reach={0: "driver"})
    blind.backend.adopt("c", narrowed.backend.parked("c") or {})
    restores = len(n.fake.ops("restore"))
    with pytest.raises(errors.RestoreRefused, match=r"cannot be restored"):
        blind.run(blind.backend.restore(job(100, name="c")))
    assert n.states(100, 101) == [CHECKPOINTED] * 2 and len(n.fake.ops("restore")) == restores


def test_an_unknown_footprints_mode_is_refused() -> None:
    memory = FakeGpuMemory({0: GiB})
    with pytest.raises(ValueError, match="footprints must be one of"):
        CudaCheckpointBackend(FakeCheckpointDriver(memory), memory, footprints="guess")
