"""Crash recovery: what the journal records, and taking the jobs of the last run up again.

The journal holds the cluster node's durable picture (``ClusterNode.durable()``: jobs, where their
state lives, who held or waited in which order, fences), each job's parking spec, and where the
cuda-checkpoint backend left each parked job's processes. At start, each journaled job is settled
against its backend (the truth about where its state is now) before the cluster node takes the
picture up (``ClusterNode.restore``) and the election starts.
"""

from __future__ import annotations

import logging
from typing import Any

from ..backends.base import JobTarget
from ..cluster.node import ClusterNode
from ..config import DaemonConfig
from ..util.compat import timeout
from ..wire.park import ParkSpec
from .jobs import NodeJobs
from .journal import Journal
from .parking import Parking

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, config: DaemonConfig, journal: Journal, parking: Parking, jobs: NodeJobs) -> None:
        self.config = config
        self.journal = journal
        self.parking = parking
        self.jobs = jobs

    def save(self, cluster: ClusterNode, now: float) -> None:
        """Write what a restarted daemon needs (a failed write is logged: the daemon goes on)."""
        picture = cluster.durable(now)
        known = cluster.jobs
        picture["park"] = {job: spec.to_wire() for job, spec in self.jobs.park.items() if job in known}
        checkpoint: Any = self.parking.backends.get("cuda-checkpoint")
        if checkpoint is not None:  # where each parked job's processes stand, for the driver after a restart
            picture["backend"] = {job: record for job in known if (record := checkpoint.parked(job)) is not None}
        try:
            self.journal.save(picture)
        except OSError as exc:
            log.error("cannot write the journal in %s: %s", self.config.state_dir, exc)

    async def take_up(self, cluster: ClusterNode, now: float) -> None:
        """Find the jobs of the last run, where their state is now, and the turns they had; give them to ``cluster``."""
        picture = self.journal.load()
        sim = self.parking.sim
        recovered = sim.recovered_jobs() if sim is not None else {}
        if picture is None and any(path.exists() for path in self.journal.paths):
            # A journal that is there but cannot be read (another release's, damaged, unreadable): what
            # the simulated GPU holds may be parked jobs' only copy, so it is kept for a daemon that can.
            for job, (state, _) in recovered.items():
                log.warning(
                    "job %r: its simulated state (%s) is kept, but the journal in %s cannot be read; "
                    "run the release that wrote it, or remove the state with `timesliced sim clean`",
                    job,
                    state,
                    self.config.state_dir,
                )
            return
        if picture is None:
            # No journal (a first start, or a state dir that was removed while the sim's tmpfs was not):
            # no job can claim what the simulated GPU holds, so it is given back rather than held forever.
            for job, (state, _) in recovered.items():
                log.warning("reclaiming simulated state of job %r (%s): it is in no journal", job, state)
                assert sim is not None
                await sim.reclaim(job)
            return
        kept = []
        for entry in picture["jobs"]:
            name = entry.get("job")
            try:
                spec = ParkSpec.from_wire(picture["park"].get(name), self.parking.default)
                settled = await self._settle(entry, spec, picture.get("backend", {}).get(name))
            except Exception as exc:  # one bad entry never stops the others
                log.error("job %r of the journal is not taken up: %s", name, exc)
                continue
            if settled is not None:
                kept.append(settled)
                self.jobs.park[name] = spec
                log.info("took up job %r from the last run: %s", name, settled["location"])
        # Simulated state the journal does not know is a reclaim that the last run did not finish.
        for job in set(recovered) - {entry["job"] for entry in kept}:
            log.warning("reclaiming simulated state of job %r: no job of the journal owns it", job)
            assert sim is not None
            await sim.reclaim(job)
        try:
            cluster.restore({**picture, "jobs": kept}, now, self.config.recovery_grace)
        except ValueError as exc:  # a journal of another release, say: start afresh rather than not at all
            log.error(
                "the journal in %s cannot be taken up (%s); starting without the last run's turns and fences",
                self.config.state_dir,
                exc,
            )
        self.save(cluster, now)

    async def _settle(self, entry: dict[str, Any], spec: ParkSpec, record: Any) -> dict[str, Any] | None:
        """``entry`` with where the job's state really is now, or None if nothing of it is left."""
        name, location = entry["job"], entry["location"]
        if spec.method == "sim":
            sim = self.parking.sim
            recovered = sim.recovered_jobs() if sim is not None else {}
            if name not in recovered:
                if sim is not None and not any(entry["footprint"].values()):
                    return {**entry, "location": "resident"}  # it never allocated: nothing to find
                log.warning("job %r: its simulated state is gone (the node's shared memory was cleared)", name)
                return None
            assert sim is not None
            state, footprint = recovered[name]
            for info in sim.regions(name):
                self.jobs.regions[(name, info.region)] = (info.gpu, sim.rounded(info.nbytes))
            faulted = entry["faulted"] or ("its simulated state was damaged" if state == "faulted" else "")
            where = state if state in ("resident", "parked") else "parked"
            footprint_wire = {str(g): n for g, n in footprint.items()}
            return {**entry, "location": where, "faulted": faulted, "footprint": footprint_wire}
        if spec.method == "cuda-checkpoint":
            backend = self.parking.backend("cuda-checkpoint")
            target = JobTarget(name, (), tuple(entry["pids"]), spec)
            try:
                async with timeout(self.config.op_timeout):
                    where = await backend.take_up(target, record)  # type: ignore[attr-defined]
            except Exception as exc:  # its processes are in mixed states: an operator must look
                return {**entry, "location": "resident", "faulted": f"taking it up after a restart failed: {exc}"}
            return {**entry, "location": where}
        # offload and engines: their state is in the job's processes; a move cut short is finished by a restore
        return {**entry, "location": "parked" if location in ("parking", "restoring") else location}
