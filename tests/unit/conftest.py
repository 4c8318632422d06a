"""A small harness around the pure scheduler core.

Every input goes through ``Harness``, which checks the core's invariants after
each step and, for an input that must fail, that nothing changed at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from timesliced.core.events import (
    AcquireRequested,
    AcquireWithdrawn,
    Event,
    JobExited,
    JobRegistered,
    MemoryReleased,
    MemoryRequested,
    MoveFinished,
    ReclaimFinished,
    ReclaimJob,
    ReleaseRequested,
    RestoreJob,
    SessionClosed,
    SnapshotJob,
)
from timesliced.core.scheduler import Scheduler, SlicePolicy

E = TypeVar("E", bound=Exception)


class Harness:
    """Drives one ``Scheduler`` with an explicit clock."""

    def __init__(
        self,
        capacities: dict[int, int] | None = None,
        *,
        max_waiters: int = 1024,
        policies: dict[str, SlicePolicy] | None = None,
    ) -> None:
        self.s = Scheduler(capacities or {0: 100}, max_waiters=max_waiters, policies=policies)
        self.now = 0.0
        self._next_session = 1
        self._next_rid = 1

    # --- raw inputs --------------------------------------------------------------------

    def handle(self, event: Event) -> Any:
        result = self.s.handle(event, self.now)
        self.s.check_invariants()
        return result

    def fails(self, event: Event, error: type[E], match: str | None = None) -> E:
        """Feed ``event``, expect ``error``, and check that the core did not change."""
        pending = self.s.drain()
        before = self.state()
        with pytest.raises(error, match=match) as info:
            self.s.handle(event, self.now)
        assert self.state() == before, "a raising event changed the scheduler"
        assert self.s.drain() == [], "a raising event emitted effects"
        self.s._effects.extend(pending)
        self.s.check_invariants()
        return info.value

    def state(self) -> tuple[Any, ...]:
        return core_state(self.s, self.now)

    def timers(self, now: float | None = None) -> None:
        if now is not None:
            self.now = now
        self.s.handle_timers(self.now)
        self.s.check_invariants()

    def advance(self, dt: float) -> None:
        self.now += dt

    def drain(self) -> list[Any]:
        """The effects so far (typed loosely: tests unpack them by position)."""
        return self.s.drain()

    # --- conveniences --------------------------------------------------------------------

    def session(self) -> int:
        sid = self._next_session
        self._next_session += 1
        return sid

    def rid(self) -> int:
        rid = self._next_rid
        self._next_rid += 1
        return rid

    def register(
        self,
        job: str,
        group: str = "g",
        gpus: tuple[int, ...] | None = None,
        pids: tuple[int, ...] = (),
        *,
        exclusive: bool = False,
    ) -> int:
        sid = self.session()
        self.handle(JobRegistered(sid, job, group, gpus, pids, exclusive))
        return sid

    def acquire(self, session: int, deadline: float | None = None) -> int:
        rid = self.rid()
        self.handle(AcquireRequested(session, rid, deadline))
        return rid

    def cancel(self, session: int, rid: int) -> Any:
        return self.handle(AcquireWithdrawn(session, rid))

    def release(self, session: int) -> Any:
        return self.handle(ReleaseRequested(session))

    def close(self, session: int) -> None:
        self.handle(SessionClosed(session))

    def alloc(self, session: int, nbytes: int, gpu: int = 0) -> int:
        rid = self.rid()
        self.handle(MemoryRequested(session, rid, gpu, nbytes))
        return rid

    def free(self, job: str, nbytes: int, gpu: int = 0) -> None:
        self.handle(MemoryReleased(job, gpu, nbytes))

    def exit(self, job: str) -> None:
        self.handle(JobExited(job))

    def finish(self, effect: SnapshotJob | RestoreJob, ok: bool = True, *, nbytes: int = 0, error: str = "") -> None:
        self.handle(MoveFinished(effect.op, ok, nbytes, 0.0, error))

    def reclaimed(self, effect: ReclaimJob) -> None:
        self.handle(ReclaimFinished(effect.op))

    def holder(self, group: str = "g") -> str | None:
        return self.s.groups[group].holder

    def queue(self, group: str = "g") -> list[str]:
        return [w.job for w in self.s.groups[group].queue]

    def location(self, job: str) -> str:
        return self.s.jobs[job].location.value

    def group_state(self, group: str = "g") -> str:
        return self.s.group_state(self.s.groups[group]).value

    def used(self, gpu: int = 0) -> int:
        return self.s.used(gpu)


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    """A factory: ``harness(capacities, max_waiters=..., policies=...)``."""
    made: list[Harness] = []

    def make(
        capacities: dict[int, int] | None = None,
        *,
        max_waiters: int = 1024,
        policies: dict[str, SlicePolicy] | None = None,
    ) -> Harness:
        h = Harness(capacities, max_waiters=max_waiters, policies=policies)
        made.append(h)
        return h

    yield make
    for h in made:
        h.s.check_invariants()


@pytest.fixture
def h(harness: Callable[..., Harness]) -> Harness:
    """One GPU of 100 bytes."""
    return harness()


def core_state(s: Scheduler, now: float) -> tuple[Any, ...]:
    """Everything the core knows, as comparable plain data (figures are in the groups and jobs)."""
    return (
        s.describe(now),
        repr(s.groups),
        repr(s.jobs),
        repr(s.sessions),
        repr(s.capacities),
        repr(s.moves.in_flight),
        repr(s.moves.settled),
        s.moves.next_op,
        repr(s.ledger.pending),
        sorted(s.queues.deadlines),
        repr(s._frozen),
    )
