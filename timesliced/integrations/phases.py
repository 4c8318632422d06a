"""RL phase hooks: begin/end of rollout, train and weight sync, each holding the locks it needs.

An RL run has two GPU pools: the trainer's (its group) and the sampler's (another group, on other
GPUs). Rollout needs the sampler's lock, training the trainer's, and a weight sync both at once.
``PhaseHooks`` (``Client``s) and ``AsyncPhaseHooks`` (``AsyncClient``s) take them in that shape, for
a controller that drives the phases (veRL's ``RayPPOTrainer.fit``, OpenRLHF's PPO trainer, slime's
``train.py``): ``with hooks.rollout(): ...`` or the callback pair ``hooks.begin_rollout()`` /
``hooks.end_rollout()``. The rules are pure, in ``phase_plan``; these shells carry them out.

Why a weight sync never deadlocks. It asks for the trainer's and the sampler's locks as one gang
(``timesliced.client.gang.acquire_gang``, the trainer first), which the daemon grants whole or not
at all, ordering every gang alike in each group. Holding one lock while waiting for the other
would not do: a run training (holding the trainer pool) and a run rolling out (holding the
sampler's) that each ask for the other's pool wait for each other for ever. So a weight sync inside a train or
rollout phase first gives back the lock it holds, takes both as a gang, and at its end keeps the
lock the enclosing phase needs (the job's state may be parked meanwhile, as at any yield). For the
same reason a rollout may not begin inside a train phase, nor a train phase inside a rollout
(``ValueError``): use a weight sync for work that needs both.

A colocated run (trainer and sampler on the same GPUs, veRL's hybrid engine) has one client:
``PhaseHooks(client)``; then every phase takes that one lock.

One thread (or task) drives a hooks object; the clients may be used by other code between phases.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager, contextmanager
from typing import Generic, TypeVar

from ..client.aio import AsyncClient
from ..client.gang import acquire_gang, acquire_gang_async
from ..client.sync import Client
from ..errors import NotHolder
from . import phase_plan
from .phase_plan import SAMPLER, Phase, Step

__all__ = ["AsyncPhaseHooks", "Phase", "PhaseHooks"]

C = TypeVar("C", Client, AsyncClient)


class _Hooks(Generic[C]):
    """What both shells keep: the clients, the open phases and the locks held."""

    def __init__(self, trainer: C, sampler: C | None = None, *, timeout: float | None = None) -> None:
        if sampler is trainer:
            sampler = None
        self.trainer: C = trainer
        self.sampler: C | None = sampler
        self.timeout = timeout
        self._stack: tuple[Phase, ...] = ()
        self._held: frozenset[str] = frozenset()
        self.switches = 0  # how many phase begins had to take a lock (it was not held already)

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases begun and not ended, outermost first."""
        return self._stack

    @property
    def held(self) -> frozenset[str]:
        """The locks these hooks hold now: ``"trainer"``, ``"sampler"``."""
        return self._held

    @property
    def colocated(self) -> bool:
        return self.sampler is None

    def _client(self, role: str) -> C:
        return self.sampler if role == SAMPLER and self.sampler is not None else self.trainer

    def _plan_begin(self, phase: Phase) -> Step:
        return phase_plan.begin(self._stack, self._held, phase, self.colocated)

    def _plan_end(self, phase: Phase) -> Step:
        return phase_plan.end(self._stack, self._held, phase, self.colocated)

    def _began(self, phase: Phase, step: Step) -> None:
        self._held = step.held
        self._stack = (*self._stack, phase)
        if step.take:
            self.switches += 1

    def _ended(self, step: Step) -> None:
        self._held = step.held
        self._stack = self._stack[:-1]


class PhaseHooks(_Hooks[Client]):
    """The locks of an RL run's phases, for the trainer's and the sampler's ``Client``.

    ``trainer`` and ``sampler``: connected or not, of one job each, in groups on different GPUs
    (``sampler=None``: colocated, every phase takes the trainer's lock). ``timeout`` bounds each
    wait for a lock. Each ``begin_*`` raises what ``Client.acquire`` raises (``AcquireTimeout``,
    ``ConnectionLost``, ``JobFaulted``, ``AcquireCancelled``); the phase has then not begun, and
    the enclosing phase holds its lock again (a weight sync gave it back to ask for the gang; were
    taking it back to fail too, that error is raised). ``ValueError`` for phases nested against
    the lock order, or an ``end_*`` of a phase that is not the innermost one; these change nothing.
    """

    def begin(self, phase: Phase) -> None:
        """Take the locks ``phase`` needs (see the class for what it raises)."""
        step = self._plan_begin(phase)
        self._release(step.release)
        try:
            if step.gang:
                acquire_gang(self.trainer, self._client(SAMPLER), timeout=self.timeout)
            for role in step.take if not step.gang else ():
                self._client(role).acquire(self.timeout)
        except BaseException:
            for role in sorted(phase_plan.retake(self._stack, self.colocated) - self._held, reverse=True):
                self._client(role).acquire(self.timeout)
                self._held |= {role}
            raise
        self._began(phase, step)

    def end(self, phase: Phase) -> None:
        """Give back the locks that the phases still open do not need (see the class)."""
        step = self._plan_end(phase)
        self._ended(step)
        self._release(step.release)

    def _release(self, roles: frozenset[str]) -> None:
        for role in sorted(roles):  # the sampler's before the trainer's: the reverse of the taking order
            self._held -= {role}
            try:
                self._client(role).release()
            except NotHolder:
                pass  # lost meanwhile (a force-release, the daemon restarted): nothing to give back

    def begin_rollout(self) -> None:
        self.begin(Phase.ROLLOUT)

    def end_rollout(self) -> None:
        self.end(Phase.ROLLOUT)

    def begin_train(self) -> None:
        self.begin(Phase.TRAIN)

    def end_train(self) -> None:
        self.end(Phase.TRAIN)

    def begin_weight_sync(self) -> None:
        self.begin(Phase.WEIGHT_SYNC)

    def end_weight_sync(self) -> None:
        self.end(Phase.WEIGHT_SYNC)

    @contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        """``with hooks.phase(Phase.TRAIN):``: begin, and end on leaving (exceptions too)."""
        self.begin(phase)
        try:
            yield
        finally:
            self.end(phase)

    def rollout(self) -> AbstractContextManager[None]:
        """``with hooks.rollout():``: the sampler's lock for the block."""
        return self.phase(Phase.ROLLOUT)

    def train(self) -> AbstractContextManager[None]:
        """``with hooks.train():``: the trainer's lock for the block."""
        return self.phase(Phase.TRAIN)

    def weight_sync(self) -> AbstractContextManager[None]:
        """``with hooks.weight_sync():``: both locks for the block, taken as one gang."""
        return self.phase(Phase.WEIGHT_SYNC)

    def close(self) -> None:
        """End every open phase (innermost first), giving back every lock."""
        while self._stack:
            self.end(self._stack[-1])


class AsyncPhaseHooks(_Hooks[AsyncClient]):
    """``PhaseHooks`` for ``AsyncClient``s: ``await hooks.begin_train()``, ``async with hooks.train():``
    (same arguments and raises)."""

    async def begin(self, phase: Phase) -> None:
        step = self._plan_begin(phase)
        await self._release(step.release)
        try:
            if step.gang:
                await acquire_gang_async(self.trainer, self._client(SAMPLER), timeout=self.timeout)
            for role in step.take if not step.gang else ():
                await self._client(role).acquire(self.timeout)
        except BaseException:
            for role in sorted(phase_plan.retake(self._stack, self.colocated) - self._held, reverse=True):
                await self._client(role).acquire(self.timeout)
                self._held |= {role}
            raise
        self._began(phase, step)

    async def end(self, phase: Phase) -> None:
        step = self._plan_end(phase)
        self._ended(step)
        await self._release(step.release)

    async def _release(self, roles: frozenset[str]) -> None:
        for role in sorted(roles):
            self._held -= {role}
            try:
                await self._client(role).release()
            except NotHolder:
                pass

    async def begin_rollout(self) -> None:
        await self.begin(Phase.ROLLOUT)

    async def end_rollout(self) -> None:
        await self.end(Phase.ROLLOUT)

    async def begin_train(self) -> None:
        await self.begin(Phase.TRAIN)

    async def end_train(self) -> None:
        await self.end(Phase.TRAIN)

    async def begin_weight_sync(self) -> None:
        await self.begin(Phase.WEIGHT_SYNC)

    async def end_weight_sync(self) -> None:
        await self.end(Phase.WEIGHT_SYNC)

    @asynccontextmanager
    async def phase(self, phase: Phase) -> AsyncIterator[None]:
        await self.begin(phase)
        try:
            yield
        finally:
            await self.end(phase)

    def rollout(self) -> AbstractAsyncContextManager[None]:
        return self.phase(Phase.ROLLOUT)

    def train(self) -> AbstractAsyncContextManager[None]:
        return self.phase(Phase.TRAIN)

    def weight_sync(self) -> AbstractAsyncContextManager[None]:
        return self.phase(Phase.WEIGHT_SYNC)

    async def close(self) -> None:
        while self._stack:
            await self.end(self._stack[-1])
