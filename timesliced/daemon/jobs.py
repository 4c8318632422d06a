"""What the daemon keeps of each job of this node beside the cluster core's picture.

How the job is parked (its ``ParkSpec``), what its last move measured on each GPU, and its simulated
regions. The cluster core knows where a job's state lives and who holds what; this is what only
this node's backends need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.base import JobTarget
from ..cluster.node import ClusterNode
from ..util.processes import descendants
from ..wire.park import ENGINES, ParkSpec


@dataclass
class NodeJobs:
    park: dict[str, ParkSpec] = field(default_factory=dict)  # job -> how it is parked
    measured: dict[str, dict[int, int]] = field(default_factory=dict)  # job -> device bytes per GPU, last move
    regions: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # (job, region) -> (gpu, bytes)

    def forget(self, job: str) -> None:
        """The job was reclaimed: nothing of it is kept."""
        for key in [k for k in self.regions if k[0] == job]:
            del self.regions[key]
        self.park.pop(job, None)
        self.measured.pop(job, None)

    def target(self, cluster: ClusterNode, job: str) -> JobTarget:
        """What a backend needs to move ``job``'s state on this node."""
        local = cluster.jobs[job]
        spec = self.park[job]
        pids = set(local.pids)
        if spec.method in ENGINES:
            pids |= descendants(pids)  # an engine's memory sits in its worker processes
        return JobTarget(job, cluster.local_gpus(job), tuple(sorted(pids)), spec)
