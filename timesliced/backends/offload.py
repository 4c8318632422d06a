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

**Swaps** (``swap``: a park and the restore that streams into its room). Both jobs' processes are
told at once: the outgoing one to park region by region and report each region's device memory as
it frees it (``offload_progress``), the incoming one to unpark into the room it is granted (the
free room on its GPUs less the headroom, where the daemon can read it; else none). A
:class:`Relay` passes each freed region on as room (``offload_room``) to the incoming processes
that need room on that GPU, never more than was freed plus the free room, and lifts the limit once
the park ended. Both directions of the host link run at once, each in its own job's processes.
Failures follow the simulated GPU's swap:

- the park fails before any of its room was passed on: it is undone as a lone park is (the
  incoming processes hold free room only); when every process undid its part it is a
  ``ParkRefused`` and the unpark is called off (its regions go back to parked: ``RestoreRefused``);
- the park fails after some of its room was passed on (it cannot be undone: that room may be in
  use): its processes are told to finish it, and the park stands if they all do;
- either way, when the outgoing job's state is unknown (a process closed its connection, an undo
  failed) it is faulted (``BackendError``) and the unpark goes on without a limit, as a lone restore
  after a failed park would: it maps what the device has, or fails with every region still parked;
- the unpark fails (or a process of it closes its connection): the park goes on; the unpark is
  called off at once in the incoming job's other processes (even after the limit was lifted) and
  undone as a lone restore's;
- the swap is cut short (``--op-timeout``, the daemon stopping): the unpark is called off; the
  daemon's timeout faults both jobs, as for a lone move;
- the daemon dies: every client ends the unparks waiting for room when its connection drops (their
  regions stay parked), the parks run on in the clients, and a restarted daemon takes both jobs up
  as parked (``daemon/recovery.py``); the next restore unparks what is parked and skips the rest.

These hold in whatever order the two halves move: a park that ends before the unpark is told (its
job has no connection, say) leaves the relay ended, and an unpark told after that gets the end with
its directive (the limit lifted, or the call-off), as if it had been told first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .. import errors
from ..util.compat import timeout
from .base import GpuMemory, JobTarget, MoveResult, SwapResult

log = logging.getLogger(__name__)

UNDO_TIMEOUT_S = 120.0

# (directive, data): push ``offload_room`` with ``data`` to the connection ``directive`` went to
Push = Callable[[int, dict[str, Any]], None]


@dataclass(frozen=True)
class Opening:
    """What an incoming directive is sent as it registers: the room it may map at once, and the relay's end.

    ``end`` is None while the relay runs; once it ended it is the end's data (``{"rest": True}`` or
    ``{"cancel": reason}``), to push as ``offload_room`` right after the directive itself.
    """

    room: dict[int, int]
    end: dict[str, Any] | None = None


class Relay:
    """One swap's device room, relayed from the outgoing job's processes to the incoming job's.

    Bookkeeping only (no I/O): the daemon's directives register each incoming directive with
    what its process needs per GPU (``incoming``: None when unknown, i.e. all it can get), feed it
    every region an outgoing process freed (``freed``) and every incoming answer (``left``); what
    each incoming process may map goes out through ``push`` (``attach``). Room is granted in the
    order the processes were told, each up to its need, free room first; ``handed`` counts the
    bytes of freed room granted on (once it is above 0 the park can no longer be undone).
    Invariant: per GPU, what was granted never exceeds the free room plus what was freed.

    The order of the calls never matters: what was freed before a process registered is granted
    as it registers, and the relay's end (``rest``, ``cancel``) reaches a process that registers
    after it, in its :class:`Opening`. ``rest`` lifts the limit and ``cancel`` calls the unpark
    off; a cancel still goes out after a rest (the unpark failed in one process, or the swap was
    cut short, while the others map), a rest after a cancel never does.
    """

    def __init__(self, free: Mapping[int, int]) -> None:
        self._free = {int(g): max(0, int(n)) for g, n in free.items()}  # gpu -> free room not granted yet
        self._freed: dict[int, int] = {}  # gpu -> freed room not granted yet
        self._needs: dict[int, dict[int, int] | None] = {}  # incoming directive -> its need left per gpu
        self._push: Push | None = None
        self._end: dict[str, Any] | None = None  # {"rest": True} or {"cancel": reason} once ended
        self.free_room = dict(self._free)
        self.handed = 0
        self.freed_total = 0
        self.granted: dict[int, dict[int, int]] = {}  # incoming directive -> gpu -> bytes granted
        self.holding = False  # the park failed: freed room (what it freed so far, and from now on) is not passed on

    @property
    def ended(self) -> bool:
        """The limit lifted or the unpark called off: no more room is relayed."""
        return self._end is not None

    @property
    def cancelled(self) -> bool:
        """The unpark was called off: nothing more is sent, and a process told from now on gets only the cancel."""
        return self._end is not None and "cancel" in self._end

    def attach(self, push: Push) -> None:
        self._push = push

    def incoming(self, directive: int, need: Mapping[int, int] | None) -> Opening:
        """Register an incoming process's directive; returns what to send it with the directive (:class:`Opening`).

        After a ``cancel`` it gets no room, only the cancel; after a ``rest``, the room there is
        and the rest, so it maps as a lone unpark would.
        """
        self.granted[directive] = {}
        if self.cancelled:
            return Opening({}, dict(self._end or {}))
        self._needs[directive] = None if need is None else {int(g): int(n) for g, n in need.items()}
        room = self._grant(directive)
        return Opening(room, None if self._end is None else dict(self._end))

    def freed(self, gpus: Mapping[int, int]) -> None:
        """An outgoing process freed ``gpus`` (gpu -> bytes): pass it on to those who need it."""
        if self.ended or self.holding:
            return
        for gpu, n in gpus.items():
            self._freed[gpu] = self._freed.get(gpu, 0) + n
            self.freed_total += n
        for directive in list(self._needs):
            more = self._grant(directive)
            if more:
                self._send(directive, {"room": {str(g): n for g, n in more.items()}})

    def left(self, directive: int, error: str | None = None) -> None:
        """An incoming process answered (``error``: it failed, or its connection closed): it maps nothing more.

        A failed one calls the unpark off in the others still at work: it is undone anyway.
        """
        self._needs.pop(directive, None)
        if error is not None:
            self.cancel(f"another process of the unpark failed ({error})")

    def rest(self) -> None:
        """The park ended: every incoming process still at work may map all it needs (none, once cancelled)."""
        if self._end is None:
            self._ending({"rest": True})

    def cancel(self, reason: str) -> None:
        """Call off the unpark in every incoming process still at work (each puts its regions back as parked)."""
        if not self.cancelled:
            self._ending({"cancel": reason})

    def _ending(self, data: dict[str, Any]) -> None:
        self._end = data
        for directive in list(self._needs):
            self._send(directive, data)

    def _grant(self, directive: int) -> dict[int, int]:
        need = self._needs[directive]
        granted = self.granted[directive]
        more: dict[int, int] = {}
        # While the park is held back its freed room is not passed on, not even to a process that
        # registers now: the undo of a park nobody took room from re-maps into it.
        pools = ((self._free, False),) if self.holding else ((self._free, False), (self._freed, True))
        for gpu in sorted(set(self._free) | set(self._freed)):
            want = None if need is None else need.get(gpu, 0) - granted.get(gpu, 0)
            for pool, handed in pools:
                have = pool.get(gpu, 0)
                n = have if want is None else min(have, want - more.get(gpu, 0))
                if n <= 0:
                    continue
                pool[gpu] = have - n
                more[gpu] = more.get(gpu, 0) + n
                if handed:
                    self.handed += n
        for gpu, n in more.items():
            granted[gpu] = granted.get(gpu, 0) + n
        return more

    def _send(self, directive: int, data: dict[str, Any]) -> None:
        if self._push is not None:
            self._push(directive, data)


class Direct(Protocol):
    """Tell every connection of ``job`` to park or unpark; one answer per connection (``daemon.directives``).

    With ``relay`` the directive is one side of a swap: a park streams its freed room into the
    relay, an unpark maps only the room the relay grants. Raises ``BackendError`` when the job
    has no connection.
    """

    def __call__(
        self, job: str, action: str, args: dict[str, Any], *, relay: Relay | None = None
    ) -> Awaitable[list[dict[str, Any]]]: ...


def free_room(memory: GpuMemory | None, headroom: int) -> Callable[[JobTarget], dict[int, int]]:
    """The room a swap's restore may take before the park frees any: free device memory less the headroom.

    Read from the driver's figures (NVML's free memory) where the node has them; without them
    (simulated GPUs) nothing is taken for free and the restore waits for the room the park frees.
    """

    def room(job: JobTarget) -> dict[int, int]:
        if memory is None:
            return {}
        out: dict[int, int] = {}
        for gpu in job.gpus:
            try:
                out[gpu] = max(0, memory.free_bytes(gpu) - headroom)
            except Exception:  # a figure it cannot read is room it does not take
                log.warning("reading the free memory of GPU %d failed; the swap waits for freed room", gpu)
                out[gpu] = 0
        return out

    return room


class OffloadBackend:
    name = "offload"

    def __init__(
        self,
        direct: Direct,
        *,
        verify: bool = False,
        room: Callable[[JobTarget], dict[int, int]] | None = None,
    ) -> None:
        self._direct = direct
        self.verify = verify
        self._room = room or free_room(None, 0)

    async def snapshot(self, job: JobTarget) -> MoveResult:
        return await self._move(job, "park", "unpark")

    async def restore(self, job: JobTarget) -> MoveResult:
        return await self._move(job, "unpark", "park")

    async def reclaim(self, job: JobTarget) -> None:
        """Nothing to do: the pinned copies live in the workload and die with it."""

    async def aclose(self) -> None:
        pass

    async def swap(self, out: JobTarget, in_: JobTarget) -> SwapResult:
        """Park ``out`` and restore ``in_`` at once, the restore mapping the room the park frees (module docstring).

        Raises ``ValueError`` for one job swapped with itself; never raises for a failed half
        (each half's error is in the result, by the rules of a lone move and the module docstring).
        """
        if out.name == in_.name:
            raise ValueError(f"a swap needs two jobs, not {out.name!r} twice")
        relay = Relay(self._room(in_))
        started = time.perf_counter()
        park_failed: list[str] = []  # why the park failed, for the restore's error

        async def park() -> MoveResult | Exception:
            try:
                return await self._swap_park(out, relay, started, park_failed)
            except Exception as exc:  # each failure told the unpark already, but one that never started
                park_failed.append(str(exc))
                if errors.state_intact(exc):
                    relay.cancel(f"the park of job {out.name!r} failed: {exc}")
                else:  # no connection, say: its state is unknown, the unpark goes on as a lone one would
                    relay.rest()
                return exc

        async def restore() -> MoveResult | Exception:
            try:
                return await self._swap_restore(in_, out.name, relay, started, park_failed)
            except Exception as exc:
                return exc

        try:
            halves = await asyncio.gather(park(), restore())
        except BaseException:  # cut short: no incoming process may wait for room that will never come
            relay.cancel(f"the swap of job {in_.name!r} in for {out.name!r} was cut short")
            raise
        return SwapResult(halves[0], halves[1])

    async def _swap_park(self, out: JobTarget, relay: Relay, started: float, park_failed: list[str]) -> MoveResult:
        args = {"tags": list(out.park.tags), "verify": self.verify}
        answers = await self._direct(out.name, "park", {**args, "stream": True}, relay=relay)
        failed = [a for a in answers if not a.get("ok")]
        if not failed:
            relay.rest()
            return self._result(answers, started)
        what = f"offload park of job {out.name!r} failed: {failed[0].get('error')}"
        park_failed.append(what)
        relay.holding = True  # nothing freed from now on is passed on
        handed = relay.handed
        if not handed:
            # The incoming processes hold free room only, so the undo re-maps into room nobody took.
            problem = await self._undo(out, "unpark", args, len(answers))
            if problem is not None:
                # Where the outgoing job's memory is nobody knows (a process gone frees its own): the
                # unpark goes on without a limit, as a lone restore after a failed park would; it maps
                # what the device has, or fails with every region still parked.
                relay.rest()
                raise errors.BackendError(
                    f"{what}; undoing it failed too ({problem}), so the job's state is unknown: check the job's "
                    "processes, then resume it (dashboard, or POST /api/v1/jobs/NAME/resume) once its memory is "
                    "whole, or restart the job"
                )
            relay.cancel(f"{what}, so its room never comes")
            raise errors.ParkRefused(
                f"{what}; every process undid its part, so the job runs on, resident; the daemon retries later"
            )
        # Part of its room is another job's now: the park cannot be undone, only finished.
        log.warning("%s after %d bytes of its room were passed on; finishing the park", what, handed)
        problem, again = await self._again(out, "park", args, len(answers))
        if problem is not None:
            relay.rest()  # its state is unknown: the unpark goes on as after a failed lone park (see above)
            raise errors.BackendError(
                f"{what} after part of its room was passed on, and finishing the park failed too ({problem}), so the "
                "job is faulted: check the job's processes, then resume it (dashboard, or POST "
                "/api/v1/jobs/NAME/resume) once its memory is whole, or restart the job"
            )
        relay.rest()
        done = self._result([a for a in answers if a.get("ok")] + again, started)
        return MoveResult(max(done.nbytes, relay.freed_total), done.seconds, done.footprint)

    async def _swap_restore(
        self, in_: JobTarget, out: str, relay: Relay, started: float, park_failed: list[str]
    ) -> MoveResult:
        args = {"tags": list(in_.park.tags), "verify": self.verify}
        answers = await self._direct(in_.name, "unpark", args, relay=relay)
        failed = [a for a in answers if not a.get("ok")]
        if not failed:
            return self._result(answers, started)
        relay.cancel(f"another process of job {in_.name!r} could not unpark")  # the others were told already
        # A process called off because another one failed says so; the one that failed says why.
        first = next((a for a in failed if "called off" not in str(a.get("error"))), None)
        if park_failed and first is None:
            what = (
                f"offload unpark of job {in_.name!r} was called off: job {out!r}, whose room it streams into, "
                f"could not be parked ({park_failed[0]})"
            )
        else:
            what = f"offload unpark of job {in_.name!r} failed: {(first or failed[0]).get('error')}"
        problem = await self._undo(in_, "park", args, len(answers))
        if problem is not None:
            raise errors.BackendError(
                f"{what}; undoing it failed too ({problem}), so the job's state is unknown: check the job's "
                "processes, then resume it (dashboard, or POST /api/v1/jobs/NAME/resume) once its memory is whole, "
                "or restart the job"
            )
        raise errors.RestoreRefused(
            f"{what}; every process undid its part, so the job stays parked in host memory; the daemon retries later"
        )

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
        return self._result(answers, started)

    @staticmethod
    def _result(answers: list[dict[str, Any]], started: float) -> MoveResult:
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
        problem, _ = await self._again(job, action, args, processes)
        if problem is not None:
            log.error("undoing a failed offload of job %r failed: %s", job.name, problem)
        return problem

    async def _again(
        self, job: JobTarget, action: str, args: dict[str, Any], processes: int
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """Tell every connection ``action`` once more; (what went wrong or None, their answers)."""
        try:
            async with timeout(UNDO_TIMEOUT_S):
                answers = await self._direct(job.name, action, args)
        except TimeoutError:
            return f"no answer within {UNDO_TIMEOUT_S:.0f} s", []
        except errors.TimeslicedError as exc:
            return exc.message, []
        problems = [str(a.get("error")) for a in answers if not a.get("ok")]
        if len(answers) < processes:
            problems.append(f"{processes - len(answers)} of its {processes} processes closed their connection")
        return ("; ".join(problems) if problems else None), answers
