"""Duty windows, the switch log and the Telemetry shell (on a fake NVML and on simulated GPUs)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from tests.fakes.nvml import FakeGpu, FakeNvml, GiB, pynvml
from timesliced.backends.base import DeviceInfo
from timesliced.nvml import GpuSample, Nvml
from timesliced.telemetry import (
    DutyWindow,
    GpuRecord,
    GpuSource,
    JobMoves,
    MoveKind,
    MoveLog,
    Sampler,
    SamplingLog,
    SimGpuSource,
    SourceKind,
    Telemetry,
)

MiB = 1 << 20


def window_state(w: DutyWindow) -> tuple[Any, ...]:
    return (list(w._spans), w._feed, w._fed_at, w._duty, list(w._memory), w._memory_at)


# --- DutyWindow: samples ---------------------------------------------------------------------


def test_an_empty_window_knows_nothing() -> None:
    w = DutyWindow()
    assert w.duty_now(0.0) is None
    assert w.mean_duty(0.0, 60) is None
    assert w.coverage(0.0, 60) == 0
    assert w.memory_now() is None and w.memory_series(0.0, 60) == []
    assert w.fed_at is None


def test_samples_cover_the_time_since_the_previous_one() -> None:
    w = DutyWindow()
    w.observe(0.5, 0.0)  # the first sample covers no time
    assert w.duty_now(0.0) == 0.5 and w.mean_duty(0.0, 60) is None
    w.observe(1.0, 1.0)  # [0, 1) was busy
    w.observe(0.0, 2.0)  # [1, 2) was idle
    w.observe(0.5, 4.0)  # [2, 4) half busy
    assert w.duty_now(4.0) == 0.5
    assert w.coverage(4.0, 60) == 4
    assert w.mean_duty(4.0, 60) == pytest.approx(2.0 / 4)
    assert w.mean_duty(4.0, 2) == pytest.approx(0.5)
    assert w.mean_duty(4.0, 3) == pytest.approx(1.0 / 3)  # [1, 2) idle, [2, 4) half
    assert w.mean_duty(2.0, 1) == 0.0


@pytest.mark.parametrize(
    ("samples", "now", "window", "expected"),
    [
        ([(1.0, 0), (1.0, 1), (1.0, 2)], 2, 10, 1.0),
        ([(0.0, 0), (0.0, 1), (0.0, 2)], 2, 10, 0.0),
        ([(0.0, 0), (0.3, 1), (0.9, 2)], 2, 10, 0.6),
        ([(0.0, 0), (0.3, 1), (0.9, 2)], 2.5, 1, 0.9),  # [1.5, 2) only; nothing after the last sample
        ([(0.0, 0), (0.3, 1), (0.9, 2)], 12, 10, None),  # the window starts where the data ends
        ([(0.0, 0), (1.0, 10)], 10, 5, 1.0),
    ],
)
def test_mean_duty_table(samples: list[tuple[float, float]], now: float, window: float, expected: float | None) -> None:
    w = DutyWindow(max_gap=100)
    for duty, t in samples:
        w.observe(duty, t)
    assert w.mean_duty(now, window) == (pytest.approx(expected) if expected is not None else None)


def test_a_long_gap_is_not_filled_in() -> None:
    w = DutyWindow(max_gap=5)
    w.observe(1.0, 0.0)
    w.observe(1.0, 100.0)  # a stalled sampler: only the last 5 s count
    assert w.coverage(100.0, 200) == 5
    assert w.mean_duty(100.0, 200) == 1.0
    assert w.mean_duty(94.0, 10) is None  # [84, 94] is a hole


def test_a_stale_sample_is_not_the_duty_now() -> None:
    w = DutyWindow(max_gap=5)
    w.observe(0.7, 10.0)
    assert w.duty_now(15.0) == 0.7
    assert w.duty_now(15.1) is None


def test_equal_neighbour_spans_merge() -> None:
    w = DutyWindow()
    for t in range(10):
        w.observe(1.0, float(t))
    assert list(w._spans) == [(0.0, 9.0, 1.0)]


# --- DutyWindow: transitions -----------------------------------------------------------------


def test_transitions_count_the_open_state_up_to_now() -> None:
    w = DutyWindow()
    w.set_busy(True, 0.0)
    assert w.duty_now(10.0) == 1.0 and w.mean_duty(10.0, 60) == 1.0
    w.set_busy(True, 5.0)  # no change
    w.set_busy(False, 10.0)
    assert w.duty_now(20.0) == 0.0
    assert w.mean_duty(20.0, 60) == pytest.approx(0.5)
    assert w.mean_duty(20.0, 10) == 0.0
    assert w.mean_duty(20.0, 15) == pytest.approx(5 / 15)
    assert w.coverage(20.0, 60) == 20
    assert w.fed_at == 10.0


def test_duty_series() -> None:
    w = DutyWindow()
    w.set_busy(True, 0.0)
    w.set_busy(False, 5.0)
    w.set_busy(True, 7.5)
    assert w.duty_series(10.0, 10.0, 5.0) == [(0.0, 1.0), (5.0, 0.5)]
    assert w.duty_series(10.0, 15.0, 5.0) == [(-5.0, None), (0.0, 1.0), (5.0, 0.5)]


def test_history_and_span_count_are_bounded() -> None:
    w = DutyWindow(history=100, max_spans=16)
    for i in range(1000):
        w.set_busy(i % 2 == 0, float(i))
    assert len(w._spans) == 16
    assert w.coverage(999.0, 1000) == 16  # what was dropped is no longer counted
    w2 = DutyWindow(history=10)
    for i in range(1000):
        w2.set_busy(i % 2 == 0, float(i))
    assert all(end > 999 - 10 for _, end, _ in w2._spans)


@pytest.mark.parametrize(
    "bad",
    [
        lambda w: w.set_busy(True, 5.0),  # a sampled window takes no transitions
        lambda w: w.observe(0.5, 0.5),  # time went backwards
        lambda w: w.observe(1.5, 2.0),  # duty outside 0..1
        lambda w: w.observe(-0.1, 2.0),
        lambda w: w.observe(0.5, 2.0, memory_used=-1),
        lambda w: w.set_memory(5, 0.5),  # memory time went backwards
        lambda w: w.mean_duty(2.0, 0),
        lambda w: w.duty_series(2.0, 10, 0),
        lambda w: w.duty_series(2.0, 1e6, 1),
    ],
)
def test_misuse_raises_and_changes_nothing(bad: Callable[[DutyWindow], object]) -> None:
    w = DutyWindow()
    w.observe(0.5, 0.0, memory_used=10)
    w.observe(0.25, 1.0, memory_used=20)
    before = window_state(w)
    with pytest.raises(ValueError):
        bad(w)
    assert window_state(w) == before


def test_a_transition_window_takes_no_samples() -> None:
    w = DutyWindow()
    w.set_busy(True, 0.0)
    with pytest.raises(ValueError, match="fed transitions"):
        w.observe(0.5, 1.0)
    with pytest.raises(ValueError, match="backwards"):
        w.set_busy(False, -1.0)


@pytest.mark.parametrize(("kwargs"), [{"history": 0}, {"max_gap": -1}, {"max_spans": 0}, {"max_points": 1}])
def test_bad_window_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        DutyWindow(**kwargs)


# --- DutyWindow: memory ----------------------------------------------------------------------


def test_memory_is_a_step_function() -> None:
    w = DutyWindow()
    w.set_memory(10, 0.0)
    w.set_memory(10, 1.0)  # unchanged: no new point
    w.set_memory(30, 2.0)
    w.set_memory(20, 5.0)
    assert w.memory_now() == 20
    assert w.memory_series(5.0, 10) == [(0.0, 10), (2.0, 30), (5.0, 20)]
    assert w.memory_series(5.0, 4) == [(1.0, 10), (2.0, 30), (5.0, 20)]  # 10 was in force at 1.0
    assert w.memory_series(5.0, 3) == [(2.0, 30), (5.0, 20)]
    assert w.memory_series(4.0, 1) == [(3.0, 30)]


def test_memory_history_keeps_the_value_in_force() -> None:
    w = DutyWindow(history=10)
    w.set_memory(1, 0.0)
    w.set_memory(2, 5.0)
    w.set_memory(3, 50.0)
    assert list(w._memory) == [(5.0, 2), (50.0, 3)]
    assert w.memory_series(50.0, 10) == [(40.0, 2), (50.0, 3)]


# --- SimGpuSource and record_busy -------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sim_telemetry(clock: Clock, used: dict[int, int] | None = None, **kwargs: Any) -> Telemetry:
    devices = (DeviceInfo(0, 64 * MiB, "sim-gpu0"), DeviceInfo(1, 64 * MiB, "sim-gpu1"))
    figures = used if used is not None else {0: 0, 1: 0}
    source = SimGpuSource(
        devices, memory_used=lambda gpu: figures[gpu], processes=lambda gpu: {4242: figures[gpu]} if gpu == 0 else {}
    )
    return Telemetry(source, clock=clock, **kwargs)


def test_sim_source_samples_the_daemons_figures() -> None:
    used = {0: 16 * MiB, 1: 0}
    source = SimGpuSource((DeviceInfo(0, 64 * MiB, "sim-gpu0"),), memory_used=lambda gpu: used[gpu])
    (s,) = source.sample()
    assert s == GpuSample(0, "sim-gpu0", "", 64 * MiB, 16 * MiB, 48 * MiB, None, None, {})


def test_sim_duty_is_lock_holding_time() -> None:
    clock = Clock(100.0)
    t = sim_telemetry(clock, window=10, history=60)
    t.record_held({0}, 100.0)
    t.record_held({0, 1}, 104.0)
    t.record_held(set(), 106.0)
    t.record_busy(1, True, 108.0)
    d = t.describe(110.0)
    g0, g1 = d["gpus"]
    assert d["source"] == "sim" and d["reason"] is None and d["driver"] is None
    assert g0["duty_window"] == pytest.approx(0.6) and g0["duty_now"] == 0.0
    assert g1["duty_window"] == pytest.approx(0.4) and g1["duty_now"] == 1.0
    assert g0["window_s"] == 10


def test_record_busy_tolerates_a_clock_a_hair_behind() -> None:
    t = sim_telemetry(Clock())
    t.record_busy(0, True, 100.0)
    t.record_busy(0, False, 99.999)  # another reader of the clock, cached a moment earlier
    assert t.duty(0).fed_at == 100.0


def test_record_busy_uses_the_clock_and_checks_the_gpu() -> None:
    clock = Clock(5.0)
    t = sim_telemetry(clock)
    t.record_busy(0, True)
    clock.now = 7.0
    assert t.duty(0).mean_duty(7.0, 10) == 1.0
    with pytest.raises(ValueError, match="no simulated GPU 9"):
        t.record_busy(9, True)


def test_sim_memory_comes_from_the_source_on_refresh() -> None:
    clock = Clock(1.0)
    used = {0: 8 * MiB, 1: 0}
    t = sim_telemetry(clock, used)
    asyncio.run(t.refresh())
    used[0] = 24 * MiB
    clock.now = 2.0
    asyncio.run(t.refresh())
    g0 = t.describe(2.5)["gpus"][0]
    assert (g0["memory_total"], g0["memory_used"], g0["memory_free"]) == (64 * MiB, 24 * MiB, 40 * MiB)
    assert g0["processes"] == {"4242": 24 * MiB}
    assert g0["duty_now"] is None  # nobody reported holding it
    assert t.duty(0).memory_series(2.0, 10) == [(1.0, 8 * MiB), (2.0, 24 * MiB)]


# --- Telemetry on NVML ---------------------------------------------------------------------------


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    gpus = [
        FakeGpu(used=30 * GiB, util_gpu=75, util_memory=20, processes=[(1001, 30 * GiB)]),
        FakeGpu(name="NVIDIA A100-SXM4-40GB", total=40 * GiB, fail={"utilization": pynvml.NVML_ERROR_NOT_SUPPORTED}),
    ]
    return FakeNvml(gpus).install(monkeypatch)


def run_until(
    telemetry: Telemetry, done: Callable[[], bool], then: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Run ``telemetry.run()`` until ``done()``, then cancel it and check that it ended by cancellation."""

    async def main() -> None:
        task = asyncio.create_task(telemetry.run())
        deadline = asyncio.get_running_loop().time() + 30
        while not done():
            assert not task.done(), "run() ended on its own"
            assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
            await asyncio.sleep(0.001)
        if then is not None:
            await then()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_run_samples_nvml_in_a_worker_thread(fake: FakeNvml) -> None:
    threads: set[int] = set()
    with Nvml.open() as nvml:
        fake.on_call = lambda name: threads.add(threading.get_ident())
        t = Telemetry(nvml, interval=0.01)
        fake.calls.clear()
        run_until(t, lambda: fake.calls.count("nvmlDeviceGetUtilizationRates") >= 6)
        assert threads and threading.get_ident() not in threads  # never on the event loop's thread
    d = t.describe()
    assert d["source"] == "nvml" and d["driver"] == "570.86.15" and d["cuda"] == "12.8" and d["error"] is None
    g0, g1 = d["gpus"]
    assert g0["memory_used"] == 30 * GiB and g0["memory_total"] == 80 * GiB
    assert g0["utilization_gpu"] == 75 and g0["duty_now"] == 0.75
    assert g0["duty_window"] == pytest.approx(0.75)
    assert g0["processes"] == {"1001": 30 * GiB}
    assert g1["duty_now"] is None and g1["duty_window"] is None
    assert g1["errors"] == ["utilization: Not Supported"]
    json.dumps(d)
    assert msgpack.unpackb(msgpack.packb(d), strict_map_key=True) == d  # safe for the wire codec


def test_duty_from_nvml_utilization(fake: FakeNvml) -> None:
    with Nvml.open() as nvml:
        t = Telemetry(nvml)
        for now, util in [(0.0, 0), (1.0, 100), (2.0, 50), (3.0, 150)]:
            fake.gpus[0].util_gpu = util
            t.ingest(nvml.sample(), now)
    w = t.duty(0)
    assert w.duty_now(3.0) == 1.0  # 150 % clamped
    assert w.mean_duty(3.0, 3) == pytest.approx((1.0 + 0.5 + 1.0) / 3)


def test_per_gpu_errors_are_logged_once(fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "timesliced.telemetry")
    with Nvml.open() as nvml:
        t = Telemetry(nvml, interval=0.01)
        run_until(t, lambda: fake.calls.count("nvmlDeviceGetUtilizationRates") >= 8)
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "GPU 1: utilization: Not Supported" in m]) == 1


def test_a_failing_sample_is_logged_once_and_sampling_goes_on(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "timesliced.telemetry")
    calls = 0
    with Nvml.open() as nvml:
        real = nvml.sample

        def flaky() -> list[GpuSample]:
            nonlocal calls
            calls += 1
            if calls <= 4:
                raise RuntimeError("driver hiccup")
            return real()

        monkeypatch.setattr(nvml, "sample", flaky)
        t = Telemetry(nvml, interval=0.01)

        async def failing_state() -> None:
            assert t.error == "RuntimeError: driver hiccup"
            assert t.describe()["error"] == "RuntimeError: driver hiccup"
            assert t.latest == {}

        run_until(t, lambda: calls >= 3, failing_state)
        run_until(t, lambda: calls >= 8)  # a new run() on the same Telemetry
    assert t.error is None and t.latest[0].utilization_gpu == 75
    failures = [r for r in caplog.records if "driver hiccup" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_telemetry_never_touches_a_closed_nvml_it_did_not_open(fake: FakeNvml) -> None:
    nvml = Nvml.open()
    t = Telemetry(nvml, interval=0.01)
    nvml.close()  # the owner closed it: samples come back empty, nothing raises
    asyncio.run(t.refresh())
    assert t.latest == {} and t.error is None
    assert [g["index"] for g in t.describe()["gpus"]] == [0, 1]


def test_record_busy_is_ignored_for_real_gpus(fake: FakeNvml) -> None:
    with Nvml.open() as nvml:
        t = Telemetry(nvml)
        t.record_busy(0, True, 1.0)
        t.record_held({0}, 2.0)
        assert t.duty(0).fed_at is None


def test_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    for t, reason in [
        (Telemetry(Nvml.open()), "the NVIDIA kernel driver is not loaded"),
        (Telemetry(), "no GPU source"),
    ]:
        asyncio.run(asyncio.wait_for(t.run(), 10))  # returns at once
        assert asyncio.run(t.refresh()) == []
        t.record_busy(0, True, 1.0)
        assert t.describe(0.0) == {
            "source": "none",
            "reason": reason,
            "driver": None,
            "cuda": None,
            "interval_s": 1.0,
            "age_s": None,
            "error": None,
            "gpus": [],
        }


@pytest.mark.parametrize(("kwargs"), [{"interval": 0}, {"window": -1}, {"window": 100, "history": 50}])
def test_bad_telemetry_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Telemetry(**kwargs)


def test_sim_run_loop_samples_on_the_event_loop() -> None:
    seen: list[bool] = []

    def used(gpu: int) -> int:
        seen.append(threading.current_thread() is threading.main_thread())
        return 0

    t = Telemetry(SimGpuSource((DeviceInfo(0, 64 * MiB, "sim-gpu0"),), memory_used=used), interval=0.01)
    run_until(t, lambda: len(seen) >= 3)
    assert all(seen)
    assert t.describe()["gpus"][0]["memory_used"] == 0


# --- the parts on their own: GpuSource, GpuRecord, SamplingLog, Sampler ------------------------


def test_gpu_source_resolves_each_kind(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    with Nvml.open() as nvml:
        real = GpuSource.of(nvml)
        assert (real.kind, real.reason, real.driver, real.cuda, real.blocking) == (
            SourceKind.NVML,
            "",
            "570.86.15",
            "12.8",
            True,
        )
        assert [d.index for d in real.devices] == [0, 1] and real.sample is not None
    sim = SimGpuSource((DeviceInfo(0, 64 * MiB, "sim-gpu0"),), memory_used=lambda gpu: 0)
    simulated = GpuSource.of(sim)
    assert (simulated.kind, simulated.devices, simulated.blocking) == (SourceKind.SIM, sim.devices, False)
    assert simulated.sample is not None and simulated.sample() == sim.sample()
    FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    for source, reason in [(Nvml.open(), "the NVIDIA kernel driver is not loaded"), (None, "no GPU source")]:
        none = GpuSource.of(source)
        assert (none.kind, none.reason, none.devices, none.sample) == (SourceKind.NONE, reason, (), None)


def sample(index: int, used: int | None = None, util: int | None = None, errors: tuple[str, ...] = ()) -> GpuSample:
    return GpuSample(index, f"gpu{index}", "", 64 * MiB, used, None, util, None, {}, errors)


def test_gpu_record_returns_the_problems_and_records_a_gpu_first_seen_in_a_sample() -> None:
    record = GpuRecord((DeviceInfo(0, 64 * MiB, "gpu0"),), utilization_duty=True)
    problems = record.ingest([sample(0, 1, 50, ("memory: Unknown",)), sample(5, 2, 200)], 1.0)
    assert problems == ["GPU 0: memory: Unknown"]
    assert record.ingest([sample(0, 1, 50), sample(5, 2, 200)], 2.0) == []
    assert record.sampled_at == 2.0 and set(record.latest) == {0, 5}
    assert record.window(5).duty_now(2.0) == 1.0  # 200 % clamped
    assert [g["index"] for g in record.describe(2.0, 10)] == [0, 5]
    with pytest.raises(KeyError):
        record.window(6)


def test_gpu_record_without_utilization_duty_takes_only_memory_from_samples() -> None:
    record = GpuRecord((DeviceInfo(0, 64 * MiB, "gpu0"),))
    record.ingest([sample(0, 7, 100)], 1.0)
    assert record.window(0).fed_at is None and record.window(0).memory_now() == 7
    record.set_held({0}, 1.0)
    assert record.window(0).duty_now(2.0) == 1.0


def test_gpu_record_refuses_an_unknown_gpu_and_changes_nothing() -> None:
    record = GpuRecord((DeviceInfo(0, 64 * MiB, "gpu0"),))
    record.set_busy(0, True, 1.0)
    before = window_state(record.window(0))
    with pytest.raises(ValueError, match="no simulated GPU 3"):
        record.set_busy(3, True, 2.0)
    assert window_state(record.window(0)) == before and record.describe(2.0, 10)[0]["index"] == 0


def test_sampling_log_logs_each_message_once_within_its_bound(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "timesliced.telemetry")
    trouble = SamplingLog(interval=0.5)
    for _ in range(3):
        trouble.warn_once("GPU 0: utilization: Not Supported")
    assert len(caplog.records) == 1 and "retrying every 0.5s" in caplog.records[0].getMessage()
    for i in range(256):  # the bound: the set of remembered messages starts again
        trouble.warn_once(f"problem {i}")
    trouble.warn_once("GPU 0: utilization: Not Supported")
    assert len(caplog.records) == 1 + 256 + 1
    trouble.failed(RuntimeError("hiccup"))
    assert trouble.error == "RuntimeError: hiccup" and caplog.records[-1].exc_info is not None
    trouble.succeeded()
    assert trouble.error is None and caplog.records[-1].getMessage() == "GPU sampling works again"
    trouble.succeeded()  # nothing was wrong: nothing to say
    assert caplog.records[-1].getMessage() == "GPU sampling works again" and len(caplog.records) == 260


def test_sampler_reads_a_blocking_source_in_a_worker_thread_and_stamps_with_its_clock() -> None:
    threads: list[int] = []
    got: list[tuple[list[GpuSample], float]] = []

    def read() -> list[GpuSample]:
        threads.append(threading.get_ident())
        return [sample(0, 1)]

    def ingest(samples: Sequence[GpuSample], now: float) -> None:
        got.append((list(samples), now))

    clock = Clock(42.0)
    for blocking in (True, False):
        sampler = Sampler(
            GpuSource(SourceKind.SIM, sample=read, blocking=blocking), ingest, SamplingLog(1.0), interval=1, clock=clock
        )
        assert asyncio.run(sampler.refresh()) == [sample(0, 1)]
    assert got == [([sample(0, 1)], 42.0)] * 2
    assert threads[0] != threading.get_ident() and threads[1] == threading.get_ident()
    idle = Sampler(GpuSource(SourceKind.NONE, "off"), ingest, SamplingLog(1.0), interval=1, clock=clock)
    assert asyncio.run(idle.refresh()) == [] and len(got) == 2  # nothing to read: nothing ingested
    asyncio.run(asyncio.wait_for(idle.run(), 10))  # returns at once


# --- MoveLog -----------------------------------------------------------------------------------


def test_switch_log_summaries() -> None:
    log = MoveLog()
    log.record("a", "snapshot", 2_000_000_000, 1.0, 10.0)
    log.record("a", MoveKind.RESTORE, 4_000_000_000, 1.0, 12.0)
    log.record("a", "restore", 3_000_000_000, 1.0, 14.0)
    log.record("a", "snapshot", 0, 0.0, 15.0)  # moved nothing: counts, but not in the median
    rec = log.record("b", "snapshot", 1_000_000_000, 0.5, 16.0)
    assert rec.gbps == pytest.approx(2.0) and rec.kind is MoveKind.SNAPSHOT
    # rates 2, 4, 3 GB/s (exact in binary): to the host 2, to the device 4 and 3
    assert log.summary("a") == JobMoves(4, 2, 2, 9_000_000_000, 3.0, 3.0, 2.0, 3.5)
    log.record("a", "restore", 5_000_000_000, 1.0, 17.0, swap_with="b")
    assert log.summary("a").median_gbps == pytest.approx(3.5)  # type: ignore[union-attr]
    assert log.summary("nobody") is None
    assert [r.job for r in log.recent(limit=2)] == ["b", "a"]
    assert [r.at for r in log.recent("a")] == [10.0, 12.0, 14.0, 15.0, 17.0]
    assert log.recent(limit=0) == []
    d = log.describe(limit=1)
    assert d["recent"] == [
        {
            "at": 17.0,
            "job": "a",
            "kind": "restore",
            "nbytes": 5_000_000_000,
            "seconds": 1.0,
            "gbps": 5.0,
            "direction": "to_device",
            "swap_with": "b",
        }
    ]
    assert d["jobs"]["b"] == {
        "count": 1,
        "snapshots": 1,
        "restores": 0,
        "nbytes": 1_000_000_000,
        "seconds": 0.5,
        "median_gbps": pytest.approx(2.0),
        "median_to_host_gbps": pytest.approx(2.0),
        "median_to_device_gbps": None,
    }
    json.dumps(d)


def test_switch_log_is_bounded() -> None:
    log = MoveLog(maxlen=3, max_jobs=2)
    for i in range(5):
        log.record("a", "restore", 1_000_000_000 * (i + 1), 1.0, float(i))
    assert len(log.recent()) == 3
    a = log.summary("a")
    assert a is not None and a.count == 5 and a.nbytes == 15_000_000_000  # totals outlive the records
    assert a.median_gbps == pytest.approx(4.0)  # over the records kept: 3, 4, 5
    log.record("b", "snapshot", 1, 1.0, 6.0)
    log.record("c", "snapshot", 1, 1.0, 7.0)  # evicts "a", the least recently moved job
    assert set(log.summaries()) == {"b", "c"}
    log.forget("b")
    assert set(log.summaries()) == {"c"} and all(r.job != "b" for r in log.recent())


@pytest.mark.parametrize(
    "args", [("a", "park", 1, 1.0, 0.0), ("a", "snapshot", -1, 1.0, 0.0), ("a", "restore", 1, -1.0, 0.0)]
)
def test_switch_log_misuse(args: tuple[Any, ...]) -> None:
    log = MoveLog()
    with pytest.raises(ValueError):
        log.record(*args)
    assert log.recent() == [] and log.summaries() == {}
