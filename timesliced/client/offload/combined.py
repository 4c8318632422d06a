"""One park / unpark directive over several executors, moved back together when one of them fails.

:func:`execute` is what the client connection calls when a directive arrives;
:class:`CombinedOffload` hands several executors (an
:class:`~.regions.Offloader` and a :class:`~.torch_state.TorchOffload`, say) to
the client as one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from ...errors import TimeslicedError, UnknownRegion
from .parkable import MoveStats, Parkable, add_per_gpu, tag_set

OPS = ("park", "unpark")


def execute(
    op: str, executors: Sequence[Parkable], tags: Collection[str] = (), *, verify: bool | None = None
) -> MoveStats:
    """Run one park / unpark directive over every executor; returns the merged figures.

    ``tags`` empty means everything; otherwise each executor gets the tags it
    knows, and a tag that no executor knows raises ``UnknownRegion`` before
    anything moves. When an executor fails, the executors that already moved
    are moved back (a failed park leaves the job resident, a failed unpark
    leaves it parked) and the error is re-raised with ``details["rollback"]``.
    Raises ``ValueError`` for an unknown ``op``.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    wanted = tag_set(tags)
    known: set[str] = set().union(*(e.tags() for e in executors)) if executors else set()
    unknown = wanted - known
    if unknown:
        raise UnknownRegion(f"no parkable memory tagged {sorted(unknown)}", tags=sorted(unknown))
    ran: list[MoveStats] = []
    idle = MoveStats(op)  # executors the tags do not concern still report what they hold
    done: list[tuple[Parkable, set[str]]] = []
    for executor in executors:
        mine = wanted & executor.tags()
        if wanted and not mine:  # an empty set would mean "everything" to the executor
            idle.resident = add_per_gpu(idle.resident, executor.resident())
            idle.footprint = add_per_gpu(idle.footprint, executor.footprint())
            continue
        try:
            stats = executor.park(mine, verify=verify) if op == "park" else executor.unpark(mine, verify=verify)
        except TimeslicedError as exc:
            exc.details["rollback"] = _undo(op, done)
            raise
        ran.append(stats)
        done.append((executor, mine))
    if not ran:
        idle.verified = bool(verify)
        return idle
    total = ran[0]
    for stats in ran[1:]:
        total = total.merged(stats)
    total.resident = add_per_gpu(total.resident, idle.resident)
    total.footprint = add_per_gpu(total.footprint, idle.footprint)
    return total


class CombinedOffload:
    """Several executors answering directives as one (raw regions and torch state, say).

    Hand it to the client as its one executor; ``park`` / ``unpark`` run
    :func:`execute` over the parts, in order.
    """

    def __init__(self, *executors: Parkable, verify: bool | None = None) -> None:
        self.executors = list(executors)
        self.verify = verify

    def tags(self) -> set[str]:
        return set().union(*(e.tags() for e in self.executors)) if self.executors else set()

    def park(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        return execute("park", self.executors, tag_set(tags), verify=self.verify if verify is None else verify)

    def unpark(self, tags: Iterable[str] = (), *, verify: bool | None = None) -> MoveStats:
        return execute("unpark", self.executors, tag_set(tags), verify=self.verify if verify is None else verify)

    def footprint(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for e in self.executors:
            out = add_per_gpu(out, e.footprint())
        return out

    def resident(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for e in self.executors:
            out = add_per_gpu(out, e.resident())
        return out


def _undo(op: str, done: Sequence[tuple[Parkable, set[str]]]) -> str:
    problems: list[str] = []
    for executor, mine in reversed(done):
        try:
            if op == "park":
                executor.unpark(mine)
            else:
                executor.park(mine)
        except TimeslicedError as exc:
            problems.append(exc.message)
    if not done:
        return "none needed"
    return "ok" if not problems else "failed: " + "; ".join(problems)
