"""Assembling the status document (``wire.status.Status``) from the parts that know each fact.

The leader shows the scheduler's picture of every node; a follower shows this node's GPUs and jobs
(the groups are on the leader's dashboard).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypedDict, cast

from ..cluster.node import ClusterNode
from ..cluster.transport import PeerTransport
from ..config import DaemonConfig
from ..telemetry import MoveLog, SimGpuSource, Telemetry
from ..version import __version__
from ..wire import status as schema
from .host_memory import HostMemory
from .jobs import NodeJobs
from .parking import Parking
from .server import ClientServer


class _Parked(TypedDict):
    park: str | None
    measured: dict[str, int]


class StatusReport:
    def __init__(
        self,
        config: DaemonConfig,
        *,
        parking: Parking,
        server: ClientServer,
        cluster: ClusterNode,
        jobs: NodeJobs,
        telemetry: Telemetry,
        sim_source: SimGpuSource | None,
        moves: MoveLog,
        peers: Callable[[], PeerTransport | None],
        members_look: Callable[[], schema.MembersLook | None],
        host_memory: HostMemory,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.parking = parking
        self.server = server
        self.cluster = cluster
        self.jobs = jobs
        self.telemetry = telemetry
        self.sim_source = sim_source
        self.moves = moves
        self.peers = peers
        self.members_look = members_look
        self.host_memory = host_memory
        self.clock = clock
        self.started_at = time.time()

    def status(self) -> schema.Status:
        if self.sim_source is not None:  # simulated figures cost nothing to read: always current
            self.telemetry.ingest(self.sim_source.sample(), self.telemetry.clock())
        now = self.clock()
        scheduler = self.cluster.scheduler
        picture = self.leader_picture(now) if scheduler is not None else self.local_picture()
        peers = self.peers()
        cluster: schema.Cluster = {
            **self.cluster.describe(now),
            "peers": peers.describe() if peers else None,
            "dns": self.members_look(),
        }
        return {
            "node": self.config.node,
            "version": __version__,
            "pid": os.getpid(),
            "backend": self.parking.default,
            "parking": self.parking.describe(),
            "addresses": list(self.server.addresses),
            "uptime_s": time.time() - self.started_at,
            "connections": len(self.server.connections),
            "counters": self.server.counters.copy(),
            **picture,
            "cluster": cluster,
            "telemetry": self.telemetry.describe(now),
            "moves": self.moves_with_wall_times(now),
            "host_memory": self.host_memory.describe(now),
        }

    def leader_picture(self, now: float) -> schema.Picture:
        """The scheduler's picture of every node, with what this node knows of each job's parking."""
        scheduler = self.cluster.scheduler
        assert scheduler is not None
        seen = scheduler.describe(now)
        jobs: list[schema.Job] = [{**job, **self._parking_of(job["job"])} for job in seen["jobs"]]
        return {"devices": seen["devices"], "groups": seen["groups"], "jobs": jobs, "host": seen["host"]}

    def _parking_of(self, job: str) -> _Parked:
        spec = self.jobs.park.get(job)
        measured = {str(gpu): n for gpu, n in sorted(self.jobs.measured.get(job, {}).items())}
        return {"park": spec.method if spec else None, "measured": measured}

    def local_picture(self) -> schema.Picture:
        """A follower's own GPUs and jobs."""
        seen = self.cluster.describe_local()
        # A Job without the scheduler's figures (they are the leader's): mypy cannot see that through **.
        jobs = [cast(schema.Job, {**place, **self._parking_of(place["job"])}) for place in seen["jobs"]]
        return {"devices": seen["devices"], "groups": [], "jobs": jobs, "host": []}

    def moves_with_wall_times(self, now: float) -> schema.Moves:
        log = self.moves.describe()
        wall = time.time() - now  # epoch seconds, like every time the dashboard shows
        return {"recent": [{**move, "t": move["at"] + wall} for move in log["recent"]], "jobs": log["jobs"]}
