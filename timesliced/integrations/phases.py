"""RL phase hooks: begin/end of rollout, train and weight sync, each holding the locks it needs.

An RL run has two GPU pools: the trainer's (its group) and the sampler's (another group, on other
GPUs). Rollout needs the sampler's lock, training the trainer's, and a weight sync both at once.
``PhaseHooks`` takes them in that shape, for a controller that drives the phases (veRL's
``RayPPOTrainer.fit``, OpenRLHF's PPO trainer, slime's ``train.py``): ``with hooks.rollout(): ...``
or the callback pair ``hooks.begin_rollout()`` / ``hooks.end_rollout()``.

Why a weight sync never deadlocks. It asks for the trainer's and the sampler's locks as one gang
(``timesliced.client.gang.acquire_gang``, the trainer first), which the daemon grants whole or not
at all, ordering every gang alike in each group. Holding one lock while waiting for the other
would not do: a job holding the trainer pool and asking for the sampler's queues behind another
job's gang that waits for the trainer pool, and neither moves. So a weight sync inside a train or
rollout phase first gives back the lock it holds, takes both as a gang, and at its end keeps the
lock the enclosing phase needs (the job's state may be parked meanwhile, as at any yield). For the
same reason a rollout may not begin inside a train phase, nor a train phase inside a rollout
(``ValueError``): use a weight sync for work that needs both.

A colocated run (trainer and sampler on the same GPUs, veRL's hybrid engine) has one client:
``PhaseHooks(client)``; then every phase takes that one lock.

One thread drives a ``PhaseHooks``; the clients may be used by other code between phases.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from ..client.gang import acquire_gang
from ..client.sync import Client
from ..errors import NotHolder


class Phase(enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    WEIGHT_SYNC = "weight_sync"


class PhaseHooks:
    """The locks of an RL run's phases, for the trainer's and the sampler's clients.

    ``trainer`` and ``sampler``: connected or not, of one job each, in groups on different GPUs
    (``sampler=None``: colocated, every phase takes the trainer's lock). ``timeout`` bounds each
    wait for a lock. Each ``begin_*`` raises what ``Client.acquire`` raises (``AcquireTimeout``,
    ``ConnectionLost``, ``JobFaulted``, ``AcquireCancelled``), and then the hooks are as before it;
    ``ValueError`` for phases nested against the lock order, or an ``end_*`` of a phase that is not
    the innermost one.
    """

    def __init__(self, trainer: Client, sampler: Client | None = None, *, timeout: float | None = None) -> None:
        if sampler is trainer:
            sampler = None
        self.trainer = trainer
        self.sampler = sampler
        self.timeout = timeout
        self._stack: list[Phase] = []
        self._held: set[str] = set()  # "trainer", "sampler": the locks these hooks hold now
        self.switches = 0  # how many phase begins had to wait for a lock (were not already held)

    # --- what each phase needs ---------------------------------------------------------------

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases begun and not ended, outermost first."""
        return tuple(self._stack)

    def _needs(self, stack: list[Phase]) -> set[str]:
        if self.sampler is None:
            return {"trainer"} if stack else set()
        needed: set[str] = set()
        for phase in stack:
            if phase is Phase.WEIGHT_SYNC:
                needed |= {"trainer", "sampler"}
            elif phase is Phase.TRAIN:
                needed.add("trainer")
            else:
                needed.add("sampler")
        return needed

    def _client(self, role: str) -> Client:
        if role == "sampler" and self.sampler is not None:
            return self.sampler
        return self.trainer

    # --- begin / end ---------------------------------------------------------------------------

    def begin(self, phase: Phase) -> None:
        """Take the locks ``phase`` needs (see the class for what it raises)."""
        want = self._needs([*self._stack, phase])
        missing = want - self._held
        if not missing:
            self._stack.append(phase)
            return
        if self.sampler is not None and phase is not Phase.WEIGHT_SYNC and self._held:
            inner, outer = phase.value, self._stack[-1].value
            raise ValueError(
                f"a {inner} phase cannot begin inside a {outer} phase: it would hold one pool's lock while "
                "waiting for the other's, which can deadlock; end it first, or use weight_sync() for work "
                "that needs both pools"
            )
        if len(want) == 2:
            # Both pools: one gang, never one lock held while waiting for the other (see the module).
            self._release(self._held)
            try:
                acquire_gang(self.trainer, self._client("sampler"), timeout=self.timeout)
            except BaseException:
                self._retake(self._needs(self._stack))
                raise
        else:
            (role,) = missing
            self._client(role).acquire(self.timeout)
        self._held = set(want)
        self._stack.append(phase)
        self.switches += 1

    def end(self, phase: Phase) -> None:
        """Give back the locks that the phases still open do not need. Raises ``ValueError`` if
        ``phase`` is not the innermost one begun."""
        if not self._stack or self._stack[-1] is not phase:
            open_ = self._stack[-1].value if self._stack else "none"
            raise ValueError(f"end of {phase.value} while the innermost phase is {open_}: end phases in reverse order")
        self._stack.pop()
        self._release(self._held - self._needs(self._stack))

    def _release(self, roles: set[str]) -> None:
        for role in sorted(roles):  # "sampler" before "trainer": the reverse of the taking order
            self._held.discard(role)
            try:
                self._client(role).release()
            except NotHolder:
                pass  # lost meanwhile (a force-release, the daemon restarted): nothing to give back

    def _retake(self, roles: set[str]) -> None:
        """After a failed gang acquire inside a phase: take back the one lock the phase held."""
        for role in sorted(roles, reverse=True):  # "trainer" before "sampler"
            self._client(role).acquire(self.timeout)
            self._held.add(role)

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
