"""Carrying out this node's part of a move: a snapshot, a restore or a reclaim through the job's backend.

Each move runs as a task of the daemon, bounded by ``--op-timeout``; whatever happens, the cluster
core hears how it ended (``finished``), and a failed move faults the job, never the daemon.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

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

# (key, ok, nbytes, seconds, error): the move of ``key`` ended
Finished = Callable[[tuple[int, int, int], bool, int, float, str], None]


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
        except Exception as exc:  # a failed move faults the job, never the daemon
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{exc.__class__.__name__}: {exc}"
            log.error("%s of job %r failed: %s", kind, effect.job, reason)
            finished(effect.key, False, 0, 0.0, reason)
            return
        if result is None:  # the reclaim
            finished(effect.key, True, 0, 0.0, "")
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
        finished(effect.key, True, result.nbytes, result.seconds, "")

    async def _reclaim(self, target: JobTarget, backend: Any) -> None:
        try:
            async with timeout(self.op_timeout):
                await backend.reclaim(target)
        except Exception:
            log.exception("reclaiming job %r failed", target.name)
        self.jobs.forget(target.name)
        log.info("job %r exited; its device and host memory is reclaimed", target.name)
        self.history.record("exited", self.clock(), job=target.name)
