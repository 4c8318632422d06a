"""Host memory for parked state: what it takes on each node, and whether a park may start (pure).

Parked state lives in host memory: inside the job's processes for cuda-checkpoint, in pinned
buffers of the job's processes for offload, in the engines' processes for vllm and sglang, in files
on a tmpfs for the simulated GPU. A park past what the host can hold gets the job OOM-killed with
its only copy of its state, so no park starts that does not fit.

Each node's daemon reads its host's figures (``HostMemoryRead``: the room left after a margin, the
operator's limit, the pools with limits of their own - a cgroup, the simulated GPU's tmpfs - and
the measured sizes of its jobs) only while none of its parks is under way, so that a reading never
counts half a park. At each reading the ledger fixes the node's *budget*: what parked state takes
there now plus the room left, at most the limit (and likewise for each pool). Between readings it
keeps the accounts itself:

- ``held``: the bytes of the parked (and restoring) jobs' parked state, as their snapshots measured it;
- ``reserved``: what the parks under way are expected to take (a job's *size*: the largest of its
  simulated memory, what the daemon measured of its device memory, and what its last park took);
- ``freeing``: what the restores and reclaims under way give back when they end.

A set of parks (one switch's) fits when ``held + reserved + their sizes <= budget`` on every node
and in every pool they touch. When it does not fit but would once the restores and reclaims under
way are done, the waiter that needs it waits (``Wait``); otherwise it is refused now (``Refuse``
with ``InsufficientHostMemory``, naming the numbers). A node never read has no budget: nothing is
known of it, so nothing is refused there.

A job whose park failed with its state intact carries a ``Refusal``: its park is not tried again
before the refusal lapses (``PARK_RETRY_S``), or before its cause may have gone (``freed``: for a
lack of host memory, once room came free on its node and the park fits; for any cause, once a job
exited). Readings alone, whose figures jitter, never retry a park that failed for another cause.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .. import errors
from ..util.parse import human_size
from .ids import gpu_slot
from .location import Location
from .model import PARK_RETRY_S, Job, Refusal, Refuse, Wait
from .registry import Registry
from .undo import Fields, Journal

REFUSAL = Fields("refusal")
PARKED = Fields("parked", "parked_size")
HOLDS_HOST = (Location.PARKED, Location.RESTORING)  # where a job's parked state takes host memory


@dataclass(frozen=True)
class NodeRoom:
    """One node's budget for parked state, fixed at its latest reading (replaced whole, never changed)."""

    budget: int
    room: int
    limit: int | None
    read_at: float
    pools: dict[str, int] = field(default_factory=dict)  # pool -> its budget
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)  # job -> its pools
    sizes: dict[str, int] = field(default_factory=dict)  # job -> its measured size
    source: dict[str, str] = field(default_factory=dict)  # "host" or a pool -> the figures behind it


class HostLedger:
    """The parked state on each node's host, and the admission of parks against its budget."""

    def __init__(self, registry: Registry, journal: Journal) -> None:
        self.nodes: dict[int, NodeRoom] = {}  # slot -> its latest reading's budget
        # every job with a refusal (lapsed ones too), so that ``freed`` looks at those only
        self.refused_jobs: dict[str, Job] = {}
        self._registry = registry
        self._journal = journal

    # --- where a job's parked state lives --------------------------------------------

    def slots(self, job: Job) -> tuple[int, ...]:
        """The nodes where ``job`` has state: those of its group's GPUs."""
        group = self._registry.groups.get(job.group)
        gpus: Iterable[int] = group.gpus if group is not None else job.footprint
        return tuple(sorted({gpu_slot(g) for g in gpus}))

    def size(self, job: Job, slot: int) -> int:
        """What parking ``job`` is expected to take on ``slot``'s host (0: nothing known)."""
        node = self.nodes.get(slot)
        device = sum(n for g, n in job.footprint.items() if gpu_slot(g) == slot)
        measured = node.sizes.get(job.name, 0) if node is not None else 0
        return max(device, measured, job.parked_size.get(slot, 0))

    def accounts(self, slot: int, pool: str | None = None) -> tuple[int, int, int]:
        """(held, reserved, freeing) on ``slot``, or in ``pool`` there."""
        node = self.nodes.get(slot)
        members = node.members if node is not None else {}
        held = reserved = freeing = 0
        for job in self._registry.jobs.values():
            if pool is not None and pool not in members.get(job.name, ()):
                continue
            if job.location in HOLDS_HOST:
                n = job.parked.get(slot, 0)
                held += n
                if job.location is Location.RESTORING or job.exiting:
                    freeing += n  # a restore or a reclaim under way gives it back
            elif job.location is Location.PARKING:
                reserved += self.size(job, slot)
        return held, reserved, freeing

    def parked_bytes(self, job: Job) -> int:
        """The host bytes ``job``'s parked state takes now, on every node."""
        return sum(job.parked.values()) if job.location in HOLDS_HOST else 0

    # --- admission ---------------------------------------------------------------------

    def admit(self, parks: list[Job], incoming: str, now: float, *, may_wait: bool = True) -> Wait | Refuse | None:
        """Whether ``parks`` (to make room for ``incoming``) fit every budget they touch: None if they do.

        A refused park's ``Refuse`` names the numbers; ``Wait`` (only when ``may_wait``): they fit
        once the restores and reclaims under way are done.
        """
        if not parks or not self.nodes:
            return None
        waits: set[str] = set()
        for slot in sorted({s for job in parks for s in self.slots(job)}):
            node = self.nodes.get(slot)
            if node is None:
                continue
            here = [j for j in parks if slot in self.slots(j)]
            checks: list[tuple[str | None, int, list[Job]]] = [(None, node.budget, here)]
            checks += [
                (pool, budget, [j for j in here if pool in node.members.get(j.name, ())])
                for pool, budget in sorted(node.pools.items())
            ]
            for pool, budget, jobs in checks:
                need = sum(self.size(j, slot) for j in jobs)
                if not need:
                    continue
                held, reserved, freeing = self.accounts(slot, pool)
                if held + reserved + need <= budget:
                    continue
                if may_wait and freeing and held + reserved + need - freeing <= budget:
                    waits |= self._freeing_jobs(slot, pool)
                    continue
                return Refuse(self._refusal(node, slot, pool, budget, jobs, incoming, (held, reserved, freeing)))
        if waits:
            return Wait(
                f"host memory: waiting for restores and reclaims of {', '.join(sorted(waits))}", frozenset(waits)
            )
        return None

    def _freeing_jobs(self, slot: int, pool: str | None) -> set[str]:
        node = self.nodes.get(slot)
        members = node.members if node is not None else {}
        return {
            j.name
            for j in self._registry.jobs.values()
            if j.location in HOLDS_HOST
            and (j.location is Location.RESTORING or j.exiting)
            and j.parked.get(slot, 0)
            and (pool is None or pool in members.get(j.name, ()))
        }

    def _refusal(
        self,
        node: NodeRoom,
        slot: int,
        pool: str | None,
        budget: int,
        jobs: list[Job],
        incoming: str,
        accounts: tuple[int, int, int],
    ) -> errors.InsufficientHostMemory:
        held, reserved, freeing = accounts
        need = sum(self.size(j, slot) for j in jobs)
        parks = ", ".join(f"{j.name!r} ({human_size(self.size(j, slot))})" for j in jobs)
        where = f"node {slot}" if pool is None else f"{pool} on node {slot}"
        source = node.source.get(pool or "host", "")
        under_way = f", parks under way {human_size(reserved)}" if reserved else ""
        taken = f"parked state there takes {human_size(held)}{under_way}"
        free = max(0, budget - held - reserved)
        limit = f"; --host-memory-limit {human_size(node.limit)}" if pool is None and node.limit is not None else ""
        message = (
            f"insufficient host memory to park {parks} for job {incoming!r} on {where}: it needs {human_size(need)}, "
            f"{taken} of a budget of {human_size(budget)} ({source or 'as last read'}{limit}), so {human_size(free)} "
            "is free. Free host memory there, raise --host-memory-limit, or try again once parked jobs "
            "have been restored or have exited"
        )
        details: dict[str, object] = {"node": slot, "needed": need, "budget": budget, "parked": held}
        details.update(reserved=reserved, freeing=freeing, pool=pool)
        return errors.InsufficientHostMemory(message, **details)

    # --- readings and measurements -----------------------------------------------------

    def read(
        self,
        slot: int,
        room: int,
        limit: int | None,
        pools: dict[str, int],
        members: dict[str, tuple[str, ...]],
        sizes: dict[str, int],
        source: dict[str, str],
        now: float,
    ) -> None:
        """A reading of ``slot``'s host: its budget is what parked state takes there now plus ``room``."""
        if limit is not None and limit < 0:
            raise ValueError(f"a host memory limit cannot be negative ({limit})")
        before = self.nodes.get(slot)
        held = self.accounts(slot)[0]
        budget = held + max(room, 0)
        if limit is not None:
            budget = min(budget, limit)
        budgets: dict[str, int] = {}
        for pool, left in pools.items():
            in_pool = sum(
                j.parked.get(slot, 0)
                for j in self._registry.jobs.values()
                if j.location in HOLDS_HOST and pool in members.get(j.name, ())
            )
            budgets[pool] = in_pool + max(left, 0)
        self._journal.keep_key(self.nodes, slot)
        self.nodes[slot] = NodeRoom(
            budget, room, limit, now, budgets, {j: tuple(p) for j, p in members.items()}, dict(sizes), dict(source)
        )
        if before is None or room > before.room or budget > before.budget:
            self.freed(slot, now)

    def parked(self, job: Job, by_slot: dict[int, int], nbytes: int) -> None:
        """``job`` is parked now; its snapshot moved ``by_slot`` (or ``nbytes``, on its first node)."""
        measured = dict(by_slot) if by_slot else {self.slots(job)[0]: nbytes} if self.slots(job) else {}
        self._journal.fields(job, PARKED)
        job.parked = {s: n for s, n in measured.items() if n}
        job.parked_size = dict(job.parked)

    def unparked(self, job: Job, now: float) -> None:
        """``job``'s parked state was given back (restored, or about to be forgotten): its nodes have room again."""
        if job.parked:
            slots = list(job.parked)
            self._journal.fields(job, PARKED)
            job.parked = {}
            for slot in slots:
                self.freed(slot, now)

    # --- refusals ----------------------------------------------------------------------

    def refuse(self, job: Job, reason: str, code: str, now: float) -> None:
        """``job``'s park failed with its state intact: not tried again for ``PARK_RETRY_S``, or until freed."""
        self._journal.fields(job, REFUSAL)
        job.refusal = Refusal(reason, code or errors.ParkRefused.code, now + PARK_RETRY_S)
        self._journal.keep_key(self.refused_jobs, job.name)
        self.refused_jobs[job.name] = job

    def freed(self, slot: int | None, now: float) -> None:
        """Host memory came free on ``slot``: parks refused for want of it are tried again once they fit.

        ``None``: a job exited, which may have ended any cause: every refusal goes.
        """
        registry = self._registry
        for job in sorted(self.refused_jobs.values(), key=lambda j: registry.rank.get(j.name, -1)):
            r = job.refusal
            if r is None or registry.jobs.get(job.name) is not job:
                self._journal.delete(self.refused_jobs, job.name)  # cleared, or the job is gone
                continue
            for_memory = r.code == errors.InsufficientHostMemory.code and slot in self.slots(job)
            if slot is None or (for_memory and self.admit([job], job.name, now, may_wait=False) is None):
                self.clear(job)

    def clear(self, job: Job) -> None:
        if job.refusal is not None:
            self._journal.fields(job, REFUSAL)
            job.refusal = None
        if self.refused_jobs.get(job.name) is job:
            self._journal.delete(self.refused_jobs, job.name)


def refused(job: Job, now: float) -> Refusal | None:
    """``job``'s refusal while it stands."""
    r = job.refusal
    return r if r is not None and now < r.until else None
