"""Carrying out this node's part of a move: a snapshot, a restore or a reclaim through the job's backend.

Each move runs as a task of the daemon, bounded by ``--op-timeout``; whatever happens, the cluster
core hears how it ended (``finished``), and a failed move never takes the daemon down. A failure
whose error says the job's state is intact where the move began (``errors.StateIntact``: the
backend rolled the move back, or never started it) leaves the job usable; any other failure (a
timeout too: nobody knows how far the move got) faults the job until an operator resumes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .. import errors
from ..backends.base import JobTarget, MoveResult, SwapResult
from ..cluster.effects import RunMove
from ..core.history import History
from ..metrics import Metrics
from ..telemetry import MoveLog
from ..util.compat import timeout
from .crash import CrashPoints
from .jobs import NodeJobs
from .parking import Parking

log = logging.getLogger(__name__)

# (key, ok, nbytes, seconds, error, intact, code): the move of ``key`` ended; ``intact``: it failed and
# left the job's state where it was; ``code``: the failure's error code
Finished = Callable[[tuple[int, int, int], bool, int, float, str, bool, str], None]


class Mover:
    def __init__(
        self,
        parking: Parking,
        jobs: NodeJobs,
        *,
        op_timeout: float,
        crash: CrashPoints,
        log_of_moves: MoveLog,
        metrics: Metrics,
        history: History,
        clock: Callable[[], float],
    ) -> None:
        self.parking = parking
        self.jobs = jobs
        self.op_timeout = op_timeout
        self.crash = crash
        self.log = log_of_moves
        self.metrics = metrics
        self.history = history
        self.clock = clock

    async def run(self, effect: RunMove, target: Callable[[str], JobTarget], finished: Finished) -> None:
        """This node's part of ``effect``; ``finished`` is told how it went, exactly once."""
        kind = effect.kind
        try:
            job = target(effect.job)
            backend = self.parking.backend(job.park.method)
            if kind == "reclaim":
                await self._reclaim(job, backend)  # a reclaim that fails is logged there
                finished(effect.key, True, 0, 0.0, "", False, "")
                return
            operation = backend.snapshot if kind == "snapshot" else backend.restore
            self.crash.move_starting(kind, asyncio.get_running_loop())
            async with timeout(self.op_timeout):
                result = await operation(job)
            self.crash.reached(f"after-{kind}")
        except Exception as exc:  # a failed move never takes the daemon down
            self._failed(effect, exc, finished)
            return
        self._done(effect, backend.name, result, finished)

    async def swap(
        self,
        park: RunMove,
        restore: RunMove,
        target: Callable[[str], JobTarget],
        finished: Finished,
    ) -> None:
        """Park ``park.job`` and restore ``restore.job`` together: streamed where their backend can, else in turn.

        Both jobs must be parked by the same method for a streamed swap (``Swapper.swap``: both
        directions of the host link at once, the restore taking the room the park frees); otherwise,
        or where the backend has no ``swap``, the snapshot runs and then the restore, each as
        ``run`` would run it. The whole swap is bounded by one ``--op-timeout``. ``finished`` is
        told how each of the two moves went, exactly once each, the park first.
        """
        if park.kind != "snapshot" or restore.kind != "restore":
            raise ValueError(f"a swap is a snapshot and a restore, not a {park.kind} and a {restore.kind}")
        try:
            out, in_ = target(park.job), target(restore.job)
            backend = self.parking.backend(out.park.method)
            swap: Any = getattr(backend, "swap", None)  # optional: ``backends.base.Swapper``
            streams = out.park.method == in_.park.method and callable(swap)
        except Exception as exc:
            self._failed(park, exc, finished)
            self._failed(restore, exc, finished)
            return
        if not streams:
            await self.run(park, target, finished)
            await self.run(restore, target, finished)
            return
        try:
            loop = asyncio.get_running_loop()
            self.crash.move_starting("snapshot", loop)  # both start now, and both run until the swap ends
            self.crash.move_starting("restore", loop)
            async with timeout(self.op_timeout):
                outcome: SwapResult = await swap(out, in_)
            self.crash.reached("after-snapshot")
            self.crash.reached("after-restore")
        except Exception as exc:  # cut short (a timeout) or not started: each move hears why
            self._failed(park, exc, finished)
            self._failed(restore, _needed_room(park.job, exc), finished)
            return
        for effect, half, other in ((park, outcome.park, restore.job), (restore, outcome.restore, park.job)):
            if isinstance(half, Exception):
                self._failed(effect, half, finished)
            else:
                self._done(effect, backend.name, half, finished, swap_with=other)

    def _failed(self, effect: RunMove, exc: Exception, finished: Finished) -> None:
        timed_out = isinstance(exc, TimeoutError)
        if timed_out:
            reason = f"timed out after {self.op_timeout:g} s"
        elif isinstance(exc, errors.TimeslicedError):
            reason = exc.message  # it says what happened; its class is in ``code``
        else:
            reason = f"{exc.__class__.__name__}: {exc}"
        intact = not timed_out and errors.state_intact(exc)
        code = exc.code if isinstance(exc, errors.TimeslicedError) else ""
        log.error(
            "%s of job %r failed (%s): %s",
            effect.kind,
            effect.job,
            "its state is intact where it was" if intact else "its state is damaged or unknown",
            reason,
        )
        finished(effect.key, False, 0, 0.0, reason, intact, code)

    def _done(
        self, effect: RunMove, method: str, result: MoveResult, finished: Finished, *, swap_with: str | None = None
    ) -> None:
        kind = effect.kind
        log.info(
            "%s of job %r with %s%s: %d bytes in %.3fs (%.1f GB/s %s)",
            kind,
            effect.job,
            method,
            f", swapped with {swap_with!r}" if swap_with else "",
            result.nbytes,
            result.seconds,
            result.gbps,
            "to the host" if kind == "snapshot" else "to the device",
        )
        try:
            if result.footprint:
                self.jobs.measured[effect.job] = dict(result.footprint)
            self.log.record(effect.job, kind, result.nbytes, result.seconds, self.clock(), swap_with=swap_with)
            self.metrics.observe_move(kind, method, result.nbytes, result.seconds)
        except Exception:  # figures are not worth a lost move: the core must hear of it
            log.exception("recording the %s of job %r failed", kind, effect.job)
        finished(effect.key, True, result.nbytes, result.seconds, "", False, "")

    async def _reclaim(self, target: JobTarget, backend: Any) -> None:
        try:
            async with timeout(self.op_timeout):
                await backend.reclaim(target)
        except Exception:
            log.exception("reclaiming job %r failed", target.name)
        self.jobs.forget(target.name)
        log.info("job %r exited; its device and host memory is reclaimed", target.name)
        self.history.record("exited", self.clock(), job=target.name)


def _needed_room(job: str, exc: Exception) -> Exception:
    """What the restore of a swap hears when the swap did not start because ``job`` could not be parked.

    A park refused with the state intact left the restore's parked copy untouched too: it is refused
    (with the same cause, so a lack of host memory is told as one); any other failure is the swap's.
    """
    if not errors.state_intact(exc) or not isinstance(exc, errors.TimeslicedError):
        return exc
    refused = errors.InsufficientHostMemory if isinstance(exc, errors.InsufficientHostMemory) else errors.RestoreRefused
    return refused(f"not started: job {job!r}, whose room it streams into, could not be parked ({exc.message})")
