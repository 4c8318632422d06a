"""The ``offload`` backend, daemon side: direct the workload to park its own regions.

The copies happen inside the workload (``timesliced.client.offload``), which
knows its device allocations; the daemon only tells every connection of the
job what to do and waits for their figures. A job with several processes (one
per rank) parks in all of them at once. If any of them fails, every one of
them is told to undo what it did (a process that failed midway may have moved
part of its memory), so the job ends wholly resident (failed snapshot) or
wholly parked (failed restore), as the Backend contract asks. When every
process confirms the undo, the failure is a ``ParkRefused`` / ``RestoreRefused``
(the job is whole and the scheduler retries later); when one cannot (its
connection closed, its undo failed or timed out), the job's state is unknown and
the failure is a plain ``BackendError``, which faults the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .. import errors
from ..util.compat import timeout
from .base import JobTarget, MoveResult

log = logging.getLogger(__name__)

# (job, action, args) -> one answer per connection of the job; raises BackendError
Direct = Callable[[str, str, dict[str, Any]], Awaitable[list[dict[str, Any]]]]

UNDO_TIMEOUT_S = 120.0


class OffloadBackend:
    name = "offload"

    def __init__(self, direct: Direct, *, verify: bool = False) -> None:
        self._direct = direct
        self.verify = verify

    async def snapshot(self, job: JobTarget) -> MoveResult:
        return await self._move(job, "park", "unpark")

    async def restore(self, job: JobTarget) -> MoveResult:
        return await self._move(job, "unpark", "park")

    async def reclaim(self, job: JobTarget) -> None:
        """Nothing to do: the pinned copies live in the workload and die with it."""

    async def aclose(self) -> None:
        pass

    async def _move(self, job: JobTarget, action: str, undo: str) -> MoveResult:
        started = time.perf_counter()
        args = {"tags": list(job.park.tags), "verify": self.verify}
        answers = await self._direct(job.name, action, args)
        failed = [a for a in answers if not a.get("ok")]
        if failed:
            what = f"offload {action} of job {job.name!r} failed: {failed[0].get('error')}"
            problem = await self._undo(job, undo, args, len(answers))
            if problem is not None:
                raise errors.BackendError(
                    f"{what}; undoing it failed too ({problem}), so the job's state is unknown: "
                    "check the job's processes, then resume it (dashboard, or POST /api/v1/jobs/NAME/resume) "
                    "once its memory is whole, or restart the job"
                )
            where = "runs on, resident" if action == "park" else "stays parked in host memory"
            refused = errors.ParkRefused if action == "park" else errors.RestoreRefused
            raise refused(f"{what}; every process undid its part, so the job {where}; the daemon retries later")
        footprint: dict[int, int] = {}
        for answer in answers:
            for gpu, n in (answer.get("footprint") or {}).items():
                footprint[int(gpu)] = footprint.get(int(gpu), 0) + int(n)
        return MoveResult(
            sum(int(a.get("nbytes", 0)) for a in answers),
            time.perf_counter() - started,
            footprint,
        )

    async def _undo(self, job: JobTarget, action: str, args: dict[str, Any], processes: int) -> str | None:
        """Bring every connection back to where the job started; what went wrong, or None when all did.

        The failed ones are told too: a process that failed midway may have
        moved some of its regions, and the executor skips those already in place.
        A process whose connection closed since the move began (``processes``
        connections were told) cannot say where its memory is, so it counts as a failure.
        """
        try:
            async with timeout(UNDO_TIMEOUT_S):
                answers = await self._direct(job.name, action, args)
        except TimeoutError:
            problem = f"no answer within {UNDO_TIMEOUT_S:.0f} s"
        except errors.TimeslicedError as exc:
            problem = exc.message
        else:
            problems = [str(a.get("error")) for a in answers if not a.get("ok")]
            if len(answers) < processes:
                problems.append(f"{processes - len(answers)} of its {processes} processes closed their connection")
            if not problems:
                return None
            problem = "; ".join(problems)
        log.error("undoing a failed offload of job %r failed: %s", job.name, problem)
        return problem
