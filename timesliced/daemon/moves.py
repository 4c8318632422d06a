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
from ..backends.base import JobTarget, MoveResult
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
        result: MoveResult | None = None
        try:
            job = target(effect.job)
            backend = self.parking.backend(job.park.method)
            if kind == "reclaim":
                await self._reclaim(job, backend)  # a reclaim that fails is logged there
            else:
                operation = backend.snapshot if kind == "snapshot" else backend.restore
                self.crash.move_starting(kind, asyncio.get_running_loop())
                async with timeout(self.op_timeout):
                    result = await operation(job)
                self.crash.reached(f"after-{kind}")
        except Exception as exc:  # a failed move never takes the daemon down
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
                kind,
                effect.job,
                "its state is intact where it was" if intact else "its state is damaged or unknown",
                reason,
            )
            finished(effect.key, False, 0, 0.0, reason, intact, code)
            return
        if result is None:  # the reclaim
            finished(effect.key, True, 0, 0.0, "", False, "")
            return
        log.info(
            "%s of job %r with %s: %d bytes in %.3fs (%.1f GB/s)",
            kind,
            effect.job,
            backend.name,
            result.nbytes,
            result.seconds,
            result.gbps,
        )
        try:
            if result.footprint:
                self.jobs.measured[effect.job] = dict(result.footprint)
            self.log.record(effect.job, kind, result.nbytes, result.seconds, self.clock())
            self.metrics.observe_move(kind, backend.name, result.nbytes, result.seconds)
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
