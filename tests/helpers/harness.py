"""A small harness around the pure scheduler core (its fixtures are in ``tests/unit/conftest.py``).

Every input goes through ``Harness``, which checks the core's invariants after
each step and, for an input that must fail, that nothing changed at all.
``Faults`` makes any call inside the core raise, to show that a step that fails
half-way changes nothing either.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from timesliced.core import moves as moves_module
from timesliced.core.arbiter import Arbiter
from timesliced.core.events import (
    AcquireRequested,
    AcquireWithdrawn,
    AllocateRegion,
    Effect,
    Event,
    FaultCleared,
    GrantLock,
    HostMemoryRead,
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
from timesliced.core.figures import Figures
from timesliced.core.host import HostLedger
from timesliced.core.ledger import MemoryLedger
from timesliced.core.location import Location
from timesliced.core.moves import Moves
from timesliced.core.policy import QueuePolicy
from timesliced.core.queues import LockQueues
from timesliced.core.registry import Registry
from timesliced.core.scheduler import Scheduler
from timesliced.core.slices import SlicePolicies, SlicePolicy
from timesliced.core.undo import Journal

E = TypeVar("E", bound=Exception)


class Harness:
    """Drives one ``Scheduler`` with an explicit clock."""

    def __init__(
        self,
        capacities: dict[int, int] | None = None,
        *,
        max_waiters: int = 1024,
        policies: dict[str, SlicePolicy] | None = None,
        queue_policies: dict[str, QueuePolicy] | None = None,
    ) -> None:
        self.s = Scheduler(
            capacities or {0: 100}, max_waiters=max_waiters, policies=policies, queue_policies=queue_policies
        )
        self.now = 0.0
        self._next_session = 1
        self._next_rid = 1

    # --- raw inputs --------------------------------------------------------------------

    def handle(self, event: Event) -> Any:
        result = self.s.handle(event, self.now)
        self.s.check_invariants(self.now)
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
        self.s.check_invariants(self.now)
        return info.value

    def state(self) -> tuple[Any, ...]:
        return core_state(self.s, self.now)

    def timers(self, now: float | None = None) -> None:
        if now is not None:
            self.now = now
        self.s.handle_timers(self.now)
        self.s.check_invariants(self.now)

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
        freezes: bool = True,
        priority: int = 0,
        weight: float = 1.0,
        party: str = "",
    ) -> int:
        sid = self.session()
        self.handle(
            JobRegistered(
                sid, job, group, gpus, pids, exclusive, freezes=freezes, priority=priority, weight=weight, party=party
            )
        )
        return sid

    def acquire(self, session: int, deadline: float | None = None, *, gang: str | None = None, members: int = 0) -> int:
        rid = self.rid()
        self.handle(AcquireRequested(session, rid, deadline, gang=gang, members=members))
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

    def finish(
        self,
        effect: SnapshotJob | RestoreJob,
        ok: bool = True,
        *,
        nbytes: int = 0,
        error: str = "",
        intact: bool = False,
        code: str = "",
    ) -> None:
        self.handle(MoveFinished(effect.op, ok, nbytes, 0.0, error, intact=intact, code=code))

    def host(self, room: int, limit: int | None = None, slot: int = 0, **more: Any) -> None:
        """A reading of the host's memory for parked state (``HostMemoryRead``)."""
        self.handle(HostMemoryRead(slot, room, limit, **more))

    def resume(self, job: str) -> Any:
        return self.handle(FaultCleared(job))

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


def core_state(s: Scheduler, now: float) -> tuple[Any, ...]:
    """Everything the core knows, as comparable plain data (figures are in the groups and jobs)."""
    return (
        s.describe(now),
        plain(s.groups),
        plain(s.jobs),
        plain(s.sessions),
        plain(s.capacities),
        plain(s.moves.in_flight),
        plain(s.moves.settled),
        plain(s.moves.streams),
        plain(s.moves.prefetches),
        plain(s.moves.declined),
        s.moves.next_op,
        plain(s.ledger.pending),
        plain(s.host.nodes),
        sorted(s.queues.deadlines),  # a heap: its order is its own
        plain(s._frozen),
        s.queues.seq,
        plain(s.queues.gangs),
    )


def plain(value: Any) -> Any:
    """``value`` as nested tuples, in the order of its lists and dicts, sets as sets.

    The order of a dict can matter (the scheduler visits jobs and groups in it); the order of a
    set never does, nor does anything the scheduler puts out depend on it.
    """
    kind = type(value)
    if kind in SCALARS:
        return value
    if kind is dict:
        return ("dict", *((k, plain(v)) for k, v in value.items()))
    if kind in (list, tuple, deque):
        return (kind.__name__, *(plain(v) for v in value))
    if kind is set:
        return frozenset(value)
    assert dataclasses.is_dataclass(value), value
    return (kind.__name__, *(plain(v) for v in vars(value).values()))  # a dataclass: its fields in order


SCALARS = {int, float, str, bool, type(None), frozenset, Location}


class Fault(Exception):
    """An exception from inside the core, of a kind nothing there expects: a bug."""


# Every method of every concern of the scheduler, the journal's notes and the location table:
# all but what takes a step back or commits it.
FAULTY = (Registry, LockQueues, MemoryLedger, HostLedger, Moves, Arbiter, Figures, SlicePolicies, SlicePolicy, Journal)
NOT_FAULTY = {"rollback", "commit", "discard"}


class Faults:
    """Wraps the core's functions; once ``arm(n)`` is called, the ``n``-th call after it raises ``Fault``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.at: int | None = None
        self.where = ""
        for cls in FAULTY:
            for name, fn in list(vars(cls).items()):
                if callable(fn) and not name.startswith("__") and name not in NOT_FAULTY:
                    monkeypatch.setattr(cls, name, self._wrap(f"{cls.__name__}.{name}", fn))
        monkeypatch.setattr(moves_module, "moved", self._wrap("location.moved", moves_module.moved))

    def _wrap(self, where: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def faulty(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.at:
                self.at, self.where = None, where
                raise Fault(f"injected into call {self.calls} ({where})")
            return fn(*args, **kwargs)

        return faulty

    def arm(self, at: int | None) -> None:
        """Raise at the ``at``-th call from now (None: never); counts from zero again."""
        self.calls, self.at, self.where = 0, at, ""


# --- what several scheduler tests build and look for ----------------------------------------------


def only(effects: list[Effect], kind: type[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def kinds(effects: list[Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def one_grant(effects: list[Effect]) -> GrantLock:
    grants = only(effects, GrantLock)
    assert len(grants) == 1, effects
    grant: GrantLock = grants[0]
    return grant


def holding(h: Harness, job: str, nbytes: int = 0, group: str = "g", gpu: int = 0) -> int:
    """Register ``job``, get it the lock and ``nbytes`` on ``gpu``; effects drained."""
    sid = h.register(job, group)
    h.acquire(sid)
    assert h.holder(group) == job
    if nbytes:
        h.alloc(sid, nbytes, gpu)
        assert only(h.drain(), AllocateRegion)
    h.drain()
    return sid


def two_jobs_one_parked(h: Harness, a_bytes: int = 60, b_bytes: int = 60) -> tuple[int, int]:
    """A holds 'a_bytes', then yields; B takes the lock and allocates, which parks A.

    Ends with B holding the lock and A parked.
    """
    a = holding(h, "A", a_bytes)
    h.release(a)
    b = h.register("B")
    h.acquire(b)
    assert h.holder() == "B"
    h.drain()
    h.alloc(b, b_bytes)
    (snap,) = h.drain()
    assert snap == SnapshotJob(snap.op, "A")
    h.finish(snap, nbytes=a_bytes)
    assert kinds(h.drain()) == ["AllocateRegion"]
    assert h.location("A") == "parked"
    return a, b
