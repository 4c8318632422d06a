"""The client ops: each request's arguments checked at this boundary, then handed on (one dispatch table).

The client server handles the connection-level ops itself (``hello``, ``auth``); everything else comes
here. Lock and memory requests go to the cluster core (the leader, wherever it is); simulated
memory, offload answers, ``status`` and ``ping`` are answered on this node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .. import errors
from ..cluster.asks import Acquire, Alloc, Cancel, Register, Release, Request
from ..cluster.node import ClusterNode
from ..core.history import History
from ..core.registry import declared_gpus
from ..wire.messages import (
    arg_gang,
    arg_int,
    arg_int_list,
    arg_memory,
    arg_opt_float,
    arg_party,
    arg_priority,
    arg_str,
    arg_weight,
)
from ..wire.park import FREEZING, ParkSpec
from .authz import checked_pids
from .directives import Directives
from .jobs import NodeJobs
from .parking import Parking
from .server import Connection

log = logging.getLogger(__name__)

# (connection, its typed request) -> the result, or DEFERRED when the reply comes later
Forward = Callable[[Connection, Request], Any]
Op = Callable[["ClientOps", Connection, int, dict[str, Any]], Any]


class ClientOps:
    def __init__(
        self,
        *,
        cluster: ClusterNode,
        parking: Parking,
        jobs: NodeJobs,
        directives: Directives,
        history: History,
        forward: Forward,
        freed: Callable[[str, int, int], None],
        status: Callable[[], Any],
        clock: Callable[[], float],
        park_every_handoff: bool = False,
        groups: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        """``forward`` hands a request to the cluster core; ``freed(job, gpu, nbytes)`` tells it memory was freed;
        ``park_every_handoff``: register every job as one that has its GPUs to itself (no co-residency);
        ``groups``: group -> its GPUs on this node, as the config file declares them."""
        self.park_every_handoff = park_every_handoff
        self.groups = dict(groups or {})
        self.cluster = cluster
        self.parking = parking
        self.jobs = jobs
        self.directives = directives
        self.history = history
        self._forward = forward
        self._freed = freed
        self._status = status
        self._clock = clock

    def handle(self, conn: Connection, rid: int, op: str, args: dict[str, Any]) -> Any:
        """One request; raises ``TimeslicedError`` (``UnknownOp`` for an op nobody serves)."""
        handler = OPS.get(op)
        if handler is None:
            raise errors.UnknownOp(f"unknown op {op!r}; known: {', '.join(sorted(OPS))}")
        return handler(self, conn, rid, args)

    def register(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        pids = checked_pids(arg_int_list(args, "pids") or [], conn.peer)
        job = arg_str(args, "job")
        group = arg_str(args, "group")
        asked = arg_int_list(args, "gpus", max_len=64)
        gpus = declared_gpus(self.groups, group, None if asked is None else tuple(asked))  # refuses other GPUs
        memory, memory_each = arg_memory(args)
        priority, weight = arg_priority(args), arg_weight(args)
        spec = ParkSpec.from_wire(args.get("park"), self.parking.default)
        self.parking.backend(spec.method)  # refuses a method this node cannot run
        known = self.jobs.park.get(job)
        if known is not None and known != spec and job in self.cluster.jobs:
            raise errors.BadRequest(f"job {job!r} is already registered to be parked with {known}")
        request = Register(
            conn.id,
            rid,
            job,
            group,
            gpus=None if gpus is None else tuple(gpus),
            pids=tuple(sorted(pids)),
            # --park-every-handoff: every job has its GPUs to itself, declared or not (systems without co-residency)
            exclusive=spec.method != "sim" or self.park_every_handoff,
            extra={"session": conn.id, "park": spec.method},  # what the reply carries besides the core's answer
            freezes=spec.method in FREEZING,
            memory=None if self.park_every_handoff else memory,
            memory_each=None if self.park_every_handoff else memory_each,
            priority=priority,
            weight=weight,
            party=arg_party(args) or None,
        )
        result = self._forward(conn, request)
        self.jobs.park[job] = spec  # the same as before, or the job is not (yet) registered here
        self.history.record("registered", self._clock(), group=group, job=job, detail=spec.method)
        return result

    def acquire(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        gang, members = arg_gang(args)
        return self._forward(conn, Acquire(conn.id, rid, arg_opt_float(args, "timeout"), gang, members))

    def cancel(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._forward(conn, Cancel(conn.id, rid, arg_int(args, "request")))

    def release(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._forward(conn, Release(conn.id, rid))

    def sim_alloc(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        nbytes = arg_int(args, "nbytes", minimum=1)
        gpu = arg_int(args, "gpu", default=0)
        job = self._job_of(conn)
        method = self.jobs.park[job].method
        if method != "sim":
            raise errors.BadRequest(f"job {job!r} is parked with {method}: it has no simulated memory")
        if gpu not in self.cluster.local_gpus(job):
            raise errors.UnknownDevice(f"GPU {gpu} is not one of this node's GPUs of job {job!r}")
        return self._forward(conn, Alloc(conn.id, rid, gpu, self.parking.sim_or_raise().rounded(nbytes), nbytes))

    def sim_free(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        job = self._job_of(conn)
        region = arg_int(args, "region")
        if (job, region) not in self.jobs.regions:
            raise errors.UnknownRegion(f"job {job!r} has no region {region}")
        freed = self.parking.sim_or_raise().free(job, region)
        gpu, nbytes = self.jobs.regions.pop((job, region))
        self._freed(job, gpu, nbytes)
        return {"region": region, "freed": freed}

    def offload_done(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        self.directives.answered(conn, args, set(self.cluster.devices))
        return {}

    def offload_progress(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        self.directives.progressed(conn, args, set(self.cluster.devices))
        return {}

    def status(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._status()

    def ping(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return {}

    def _job_of(self, conn: Connection) -> str:
        job = self.cluster.sessions.get(conn.id)
        if job is None:
            raise errors.NotRegistered("register a job before using the lock")
        return job


OPS: dict[str, Op] = {
    "register": ClientOps.register,
    "acquire": ClientOps.acquire,
    "cancel": ClientOps.cancel,
    "release": ClientOps.release,
    "sim_alloc": ClientOps.sim_alloc,
    "sim_free": ClientOps.sim_free,
    "offload_done": ClientOps.offload_done,
    "offload_progress": ClientOps.offload_progress,
    "status": ClientOps.status,
    "ping": ClientOps.ping,
}
