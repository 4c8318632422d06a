"""Each job's GPU phases and gaps as the scheduler records them (``core/phases.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from timesliced.core.events import RestoreJob, SnapshotJob
from timesliced.core.phases import KEPT, Phases, summary
from timesliced.core.scheduler import Scheduler
from timesliced.core.slices import SlicePolicy

from ..helpers.harness import Harness


def phases_of(h: Harness, job: str) -> Phases:
    return h.s.jobs[job].phases


def test_a_job_alone_records_its_phases_and_gaps(h: Harness) -> None:
    a = h.register("A")
    for busy, gap in [(2.0, 1.0), (4.0, 3.0), (6.0, 5.0)]:
        h.acquire(a)
        h.advance(busy)
        h.release(a)
        h.advance(gap)
    h.drain()
    p = phases_of(h, "A")
    assert list(p.busy) == [2.0, 4.0, 6.0]
    assert list(p.gaps) == [1.0, 3.0]  # the first phase has no gap before it; the last gap is still open
    doc = h.s.describe(h.now)["jobs"][0]["phases"]
    assert doc["count"] == 3 and doc["gaps"] == 2
    assert doc["busy_median_s"] == 4.0 and doc["gap_median_s"] == 2.0
    assert doc["busy_mean_s"] == 4.0 and doc["gap_mean_s"] == 2.0
    assert doc["own_duty"] == pytest.approx(4.0 / 6.0)


def test_a_gap_does_not_count_the_time_waiting_in_the_queue(h: Harness) -> None:
    a, b = h.register("A"), h.register("B")
    h.acquire(a)
    h.advance(1.0)
    h.release(a)  # A's gap begins at 1
    h.acquire(b)
    h.advance(0.5)
    h.acquire(a)  # A asks at 1.5 (its gap: 0.5) and waits for B
    h.advance(10.0)
    h.release(b)  # A is granted at 11.5, after 10 s in the queue
    h.advance(1.0)
    h.release(a)
    h.drain()
    p = phases_of(h, "A")
    assert list(p.gaps) == [0.5]  # not 10.5: the wait is the queue's, not A's own time
    assert list(p.busy) == [1.0, 1.0]
    assert list(phases_of(h, "B").busy) == [10.5] and not phases_of(h, "B").gaps


def test_a_preempted_holder_has_no_gap(harness: Callable[..., Harness]) -> None:
    h = harness(policies={"*": SlicePolicy(max_slice=5.0, action="preempt", grace=1.0)})
    a, b = h.register("A"), h.register("B")
    h.acquire(a)
    h.acquire(b)
    h.timers(5.0)  # warned
    h.timers(6.0)  # preempted (and parked): A asks again at once
    (snapshot,) = [e for e in h.drain() if isinstance(e, SnapshotJob)]
    h.finish(snapshot)
    h.advance(2.0)
    h.release(b)
    (restore,) = [e for e in h.drain() if isinstance(e, RestoreJob)]
    h.finish(restore)
    assert h.holder() == "A"
    p = phases_of(h, "A")
    assert list(p.busy) == [6.0] and p.released_at is None and list(p.gaps) == [0.0]


def test_memory_peak_is_the_most_on_one_gpu_at_a_phase_end(harness: Callable[..., Harness]) -> None:
    h = harness({0: 100, 1: 100})
    a = h.register("A", gpus=(0, 1))
    h.acquire(a)
    h.alloc(a, 30, gpu=0)
    h.alloc(a, 20, gpu=1)
    h.release(a)
    h.free("A", 30, gpu=0)
    h.acquire(a)
    h.release(a)
    h.drain()
    assert phases_of(h, "A").memory_peak == 30
    assert h.s.describe(h.now)["jobs"][0]["phases"]["memory_peak_bytes"] == 30


def test_the_record_is_bounded() -> None:
    p = Phases()
    for i in range(KEPT + 50):
        p.began(float(2 * i))
        p.ended(float(2 * i + 1), 1.0, {})
    assert len(p.busy) == KEPT and len(p.gaps) == KEPT
    assert p.count == KEPT + 50 and p.gap_count == KEPT + 49
    doc = summary(p)
    assert doc["busy_p90_s"] == 1.0 and doc["gap_p90_s"] == 1.0 and doc["own_duty"] == 0.5


def test_no_phases_have_no_statistics() -> None:
    doc = summary(Phases())
    assert doc["count"] == 0 and doc["busy_median_s"] is None and doc["own_duty"] is None


def test_a_refused_step_records_nothing(h: Harness) -> None:
    """A release by a job that does not hold raises: the figures (phases too) are counted only at commit."""
    from timesliced import errors
    from timesliced.core.events import ReleaseRequested

    a, b = h.register("A"), h.register("B")
    h.acquire(a)
    h.advance(1.0)
    h.fails(ReleaseRequested(b), errors.NotHolder)
    assert not phases_of(h, "A").busy and not phases_of(h, "B").busy


def test_phases_carry_over_to_a_leader_that_takes_stock_again(h: Harness) -> None:
    a = h.register("A")
    for _ in range(3):
        h.acquire(a)
        h.advance(1.0)
        h.release(a)
        h.advance(2.0)
    new = Scheduler({0: 100})
    new.adopt_group("g", (0,), h.now)
    new.adopt_job("A", "g", False, h.s.jobs["A"].location, {}, "")
    new.carry_figures(h.s)
    doc = new.describe(h.now)["jobs"][0]["phases"]
    assert doc["count"] == 3 and doc["gap_median_s"] == 2.0 and doc["busy_median_s"] == 1.0
