"""The node daemon: the composition root that wires the shells to the core.

The scheduler core decides; this module feeds it events (requests from
connections, finished backend moves, timers, exited processes) and carries out
the effects it returns. All scheduler state is touched from the event loop
thread only, within one step, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .. import errors
from ..backends.base import JobTarget, MoveResult
from ..backends.offload import Direct
from ..cluster.asks import Acquire, Alloc, Cancel, Register, Release, Request
from ..cluster.effects import Allocate, Fail, Noted, Push, RecordGrant, Reply, RunMove, Send
from ..cluster.messages import MalformedMessage
from ..cluster.node import PENDING, ClusterNode
from ..cluster.transport import PeerTransport
from ..config import DaemonConfig
from ..core.election import Persist
from ..core.events import DrainRequested, ForceReleaseRequested
from ..core.history import GroupView, History
from ..metrics import Metrics
from ..telemetry import MoveLog, SimGpuSource, Telemetry
from ..util.compat import TaskGroup, timeout
from ..util.processes import descendants, pid_alive
from ..version import __version__
from ..wire.messages import arg_int, arg_int_list, arg_opt_float, arg_str, quoted
from ..wire.park import ParkSpec
from .authz import checked_pids
from .dashboard_source import DaemonView
from .election_file import load_election, save_election
from .journal import Journal
from .parking import Parking, open_parking
from .server import DEFERRED, ClientServer, Connection

log = logging.getLogger(__name__)

JOURNAL_DELAY_S = 0.02  # how stale the journal's holders and queues may be (moves are written before they start)
MID_MOVE_S = 0.05  # a "mid-" crash point fires this long into the move (give it a slow bandwidth)
WEB_SHUTDOWN_S = 2.0  # open dashboard streams get this long to end when the daemon stops


class Daemon:
    """One per node. ``await run()`` serves until ``stop()``."""

    def __init__(self, config: DaemonConfig, parking: Callable[[Direct], Parking] | None = None) -> None:
        """``parking`` builds the node's backends in place of probing the node (tests, embedding)."""
        self.config = config
        self.parking = (parking or functools.partial(open_parking, config))(self._direct)
        devices = self.parking.devices
        members = tuple(config.cluster.members) if config.cluster else (config.node,)
        self.cluster = ClusterNode(
            config.node,
            members,
            {d.index: d.capacity for d in devices},
            rng=random.Random(),
            election_timeout=config.cluster.election_timeout if config.cluster else (1.0, 2.0),
            heartbeat_interval=config.cluster.heartbeat_interval if config.cluster else 0.25,
            # Also alone: a restarted daemon leads in a new term, so its grants' (term, fence) exceed the old ones.
            persisted=load_election(config.state_dir),
            max_waiters=config.max_waiters,
            op_timeout=config.op_timeout,
            policies=config.slice_policies,
        )
        self.journal = Journal(config.state_dir)
        self._journal_due = False
        self._journal_frozen = False  # set once stopping: see run()
        self._crashes: dict[str, int] = {}  # crash point -> times reached (fault injection)
        self.peers: PeerTransport | None = None
        self.server = ClientServer(
            self,
            max_frame=config.max_frame,
            max_connections=config.max_connections,
            handshake_timeout=config.handshake_timeout,
            stall_timeout=config.stall_timeout,
            max_write_buffer=config.max_write_buffer,
            node=config.node,
            backend=self.parking.default,
            token=config.shared_token(),
            lease=config.lease,
            max_per_client=config.max_connections_per_client,
        )
        self._sim_source = self._sim_gpu_source()
        self.telemetry = Telemetry(
            self.parking.nvml or self._sim_source, interval=config.telemetry_interval, clock=self._now
        )
        self.metrics = Metrics(self.status, node=config.node)
        self.web_url: str | None = None
        self._web: web.AppRunner | None = None
        self.moves = MoveLog()
        self.history = History()
        self.started_at = time.time()
        self.started_loop = 0.0  # loop time at run()
        self.tcp_address: tuple[str, int] | None = None
        self._conns: dict[int, Connection] = {}  # connections that sent a request, by id
        self._regions: dict[tuple[str, int], tuple[int, int]] = {}  # (job, region) -> (gpu, bytes)
        self._park: dict[str, ParkSpec] = {}  # job -> how it is parked
        self._measured: dict[str, dict[int, int]] = {}  # job -> device bytes per GPU, from its last move
        self._directives: dict[int, tuple[int, asyncio.Future[dict[str, Any]]]] = {}  # id -> (session, answer)
        self._next_directive = 1
        self._tasks: TaskGroup | None = None
        self._children: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- life cycle ------------------------------------------------------------------

    async def run(self, ready: Callable[[Daemon], None] | None = None) -> None:
        """Bind the sockets, call ``ready(self)``, serve until ``stop()``."""
        self._loop = asyncio.get_running_loop()
        self.started_loop = self._loop.time()
        self.config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        bound = False
        try:
            await self._take_up_journal()
            await self._start_cluster()
            await self.server.start_unix(self.config.resolved_socket())
            bound = True
            if self.config.listen is not None:
                self.tcp_address = await self.server.start_tcp(*self.config.listen)
            if self.config.web is not None:
                await self._start_web(*self.config.web)
            log.info(
                "timesliced %s serving on %s; jobs are parked with %s by default (%s); %d %s GPUs",
                __version__,
                ", ".join(self.server.addresses),
                self.parking.default,
                self.parking.why,
                len(self.cluster.devices),
                "simulated" if self.parking.device_source == "sim" else "real",
            )
            async with TaskGroup() as tasks:
                self._tasks = tasks
                self._spawn(self._watch_processes())
                if self.config.lease:
                    self._spawn(self._watch_leases())
                self._spawn(self.telemetry.run())
                if ready is not None:
                    ready(self)
                await self._stopping.wait()
                # The state to come back to is the one at the stop, not what closing connections undo.
                self._save_journal()
                self._journal_frozen = True
                # Stop listening and drop the connections while nothing new can start:
                # sessions that close now must not begin moves on the way out.
                await self._close_front()
                self._tasks = None
                for task in list(self._children):
                    task.cancel()
        finally:
            self._tasks = None
            self._stopping.set()
            await self._close_front()
            if self.peers is not None:
                await self.peers.close()
            if self._timer is not None:
                self._timer.cancel()
            if bound:  # never the socket of another daemon that is serving
                try:
                    self.config.resolved_socket().unlink()
                except FileNotFoundError:
                    pass
            await self.parking.aclose()
            self.journal.close()

    async def _start_cluster(self) -> None:
        """Listen for peers (in a cluster), then start the election: a single daemon leads at once."""
        cluster = self.config.cluster
        if cluster is not None:
            dial = {m: addr for m, addr in cluster.members.items() if m != self.config.node}
            self.peers = PeerTransport(
                self.config.node, dial, cluster.token, self._on_peer_message, on_link=self._on_peer_link
            )
            host, port = await self.peers.start(*cluster.listen)
            log.info(
                "cluster of %d: node %r listens for peers on %s:%d", len(cluster.members), self.config.node, host, port
            )
        self._step(self.cluster.start, self._now())

    def _on_peer_message(self, sender: str, message: dict[str, Any]) -> None:
        try:
            self._step(self.cluster.receive, sender, message, self._now())
        except MalformedMessage as exc:  # one peer's bad message never stops the daemon
            log.warning("dropped a malformed message from node %r: %s", sender, exc)
        except Exception:  # the node checked the message: this is ours
            log.exception("bug: the cluster core failed on a message from node %r", sender)

    def _on_peer_link(self, peer: str, up: bool) -> None:
        log.info("link to node %r is %s", peer, "up" if up else "down")
        self._step(self.cluster.link, peer, up, self._now())

    async def _close_front(self) -> None:
        """Close the dashboard and the client listeners and connections (idempotent)."""
        web_runner, self._web = self._web, None
        if web_runner is not None:
            await web_runner.cleanup()
        await self.server.close()

    def stop(self) -> None:
        self._stopping.set()

    async def _start_web(self, host: str, port: int) -> None:
        """The dashboard, the JSON API and /metrics on ``host:port`` (port 0: any free port)."""
        from ..dashboard import make_app, serve

        def app() -> web.Application:
            return make_app(DaemonView(self), admin_token=self.config.admin_token, metrics=self.metrics.render)

        try:
            self._web, (_, bound) = await serve(app(), host, port, shutdown_timeout=WEB_SHUTDOWN_S)
        except OSError as exc:
            if not self.config.web_any_port:
                raise
            log.warning("the dashboard cannot use %s:%d (%s); it takes a free port instead", host, port, exc)
            self._web, (_, bound) = await serve(app(), host, 0, shutdown_timeout=WEB_SHUTDOWN_S)
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
        self.web_url = f"http://{shown}:{bound}/"
        log.info("dashboard on %s (admin actions %s)", self.web_url, "on" if self.config.admin_token else "off")

    # --- connections (called by ClientServer) ----------------------------------------

    def close_connection(self, conn: Connection) -> None:
        for session, answer in self._directives.values():
            if session == conn.id and not answer.done():
                answer.set_result({"ok": False, "error": "the connection closed before it carried out the offload"})
        if self._conns.pop(conn.id, None) is not None:
            self._step(self.cluster.closed, conn.id, self._now())

    def handle_request(self, conn: Connection, request_id: int, op: str, args: dict[str, Any]) -> Any:
        handler = self._ops.get(op)
        if handler is None:
            raise errors.UnknownOp(f"unknown op {op!r}; known: {', '.join(sorted(self._ops))}")
        return handler(self, conn, request_id, args)

    def _request(self, conn: Connection, request: Request) -> Any:
        """Hand a client's request to the cluster (the leader, wherever it is)."""
        self._conns[conn.id] = conn
        result = self._step(self.cluster.request, request, self._now())
        return DEFERRED if result is PENDING else result

    def _op_register(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        pids = checked_pids(arg_int_list(args, "pids") or [], conn.peer)
        gpus = arg_int_list(args, "gpus", max_len=64)
        job = arg_str(args, "job")
        group = arg_str(args, "group")
        spec = ParkSpec.from_wire(args.get("park"), self.parking.default)
        self.parking.backend(spec.method)  # refuses a method this node cannot run
        known = self._park.get(job)
        if known is not None and known != spec and job in self.cluster.jobs:
            raise errors.BadRequest(f"job {job!r} is already registered to be parked with {known}")
        extra = {"session": conn.id, "park": spec.method}
        request = Register(
            conn.id,
            rid,
            job,
            group,
            gpus=None if gpus is None else tuple(gpus),
            pids=tuple(sorted(pids)),
            exclusive=spec.method != "sim",
            extra=extra,
        )
        result = self._request(conn, request)
        self._park[job] = spec  # the same as before, or the job is not (yet) registered here
        self.history.record("registered", self._now(), group=group, job=job, detail=spec.method)
        return result

    def _op_acquire(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._request(conn, Acquire(conn.id, rid, arg_opt_float(args, "timeout")))

    def _op_cancel(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._request(conn, Cancel(conn.id, rid, arg_int(args, "request")))

    def _op_release(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._request(conn, Release(conn.id, rid))

    def _job_of(self, conn: Connection) -> str:
        job = self.cluster.sessions.get(conn.id)
        if job is None:
            raise errors.NotRegistered("register a job before using the lock")
        return job

    def _op_sim_alloc(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        nbytes = arg_int(args, "nbytes", minimum=1)
        gpu = arg_int(args, "gpu", default=0)
        job = self._job_of(conn)
        if self._park[job].method != "sim":
            raise errors.BadRequest(f"job {job!r} is parked with {self._park[job].method}: it has no simulated memory")
        if gpu not in self.cluster.local_gpus(job):
            raise errors.UnknownDevice(f"GPU {gpu} is not one of this node's GPUs of job {job!r}")
        return self._request(conn, Alloc(conn.id, rid, gpu, self._sim().rounded(nbytes), nbytes))

    def _op_sim_free(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        job = self._job_of(conn)
        region = arg_int(args, "region")
        if (job, region) not in self._regions:
            raise errors.UnknownRegion(f"job {job!r} has no region {region}")
        freed = self._sim().free(job, region)
        gpu, nbytes = self._regions.pop((job, region))
        self._step(self.cluster.freed, job, gpu, nbytes, self._now())
        return {"region": region, "freed": freed}

    def _op_offload_done(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        directive = arg_int(args, "directive")
        entry = self._directives.get(directive)
        if entry is None or entry[0] != conn.id:
            raise errors.BadRequest(f"no offload directive {directive} is waiting on this connection")
        answer = parse_offload_done(args, set(self.cluster.devices))
        if not entry[1].done():
            entry[1].set_result(answer)
        return {}

    def _op_status(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self.status()

    def _op_ping(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return {}

    _ops: dict[str, Callable[[Daemon, Connection, int, dict[str, Any]], Any]] = {
        "register": _op_register,
        "acquire": _op_acquire,
        "cancel": _op_cancel,
        "release": _op_release,
        "sim_alloc": _op_sim_alloc,
        "sim_free": _op_sim_free,
        "offload_done": _op_offload_done,
        "status": _op_status,
        "ping": _op_ping,
    }

    def admin(self, event: ForceReleaseRequested | DrainRequested) -> dict[str, Any]:
        """An administrator's action (the dashboard checked the token); raises ``TimeslicedError``."""
        result: dict[str, Any] = self._step(self.cluster.admin, event, self._now())
        if isinstance(event, ForceReleaseRequested):
            what = f"force-released from {result['released']}"
        else:
            what = "drained" if event.on else "resumed"
        log.warning("administrator: group %r %s", event.group, what)
        self.history.record("admin", self._now(), group=event.group, detail=what)
        return result

    @property
    def serving(self) -> bool:
        return self._tasks is not None and not self._stopping.is_set()

    def status(self) -> dict[str, Any]:
        if self._sim_source is not None:  # simulated figures cost nothing to read: always current
            self.telemetry.ingest(self._sim_source.sample(), self.telemetry.clock())
        now = self._now()
        scheduler = self.cluster.scheduler
        # a follower shows this node's GPUs and jobs; the groups are on the leader's dashboard
        picture = scheduler.describe(now) if scheduler is not None else self._local_picture()
        for job in picture["jobs"]:
            spec = self._park.get(job["job"])
            job["park"] = spec.method if spec else None
            job["measured"] = {str(gpu): n for gpu, n in sorted(self._measured.get(job["job"], {}).items())}
        return {
            "node": self.config.node,
            "version": __version__,
            "pid": os.getpid(),
            "backend": self.parking.default,
            "parking": self.parking.describe(),
            "addresses": list(self.server.addresses),
            "uptime_s": time.time() - self.started_at,
            "connections": len(self.server.connections),
            "counters": dict(self.server.counters),
            **picture,
            "cluster": {**self.cluster.describe(now), "peers": self.peers.describe() if self.peers else None},
            "telemetry": self.telemetry.describe(now),
            "moves": self._moves_with_wall_times(),
        }

    def _local_picture(self) -> dict[str, Any]:
        c = self.cluster
        return {
            "devices": [
                {
                    "index": gpu,
                    "capacity": cap,
                    "used": sum(j.footprint.get(gpu, 0) for j in c.jobs.values() if j.location.occupies_device),
                    "jobs": {
                        j.name: {"bytes": j.footprint[gpu], "location": j.location.value}
                        for j in c.jobs.values()
                        if j.footprint.get(gpu)
                    },
                }
                for gpu, cap in sorted(c.devices.items())
            ],
            "groups": [],
            "jobs": [
                {
                    "job": j.name,
                    "group": j.group,
                    "location": j.location.value,
                    "faulted": j.faulted or None,
                    "sessions": len(j.sessions),
                    "pids": sorted(j.pids),
                    "footprint": {str(k): v for k, v in sorted(j.footprint.items())},
                }
                for j in c.jobs.values()
            ],
        }

    def _moves_with_wall_times(self) -> dict[str, Any]:
        moves = self.moves.describe()
        wall = time.time() - self._now()
        for move in moves["recent"]:
            move["t"] = move["at"] + wall  # epoch seconds, like every time the dashboard shows
        return moves

    def _sim_gpu_source(self) -> SimGpuSource | None:
        sim = self.parking.sim
        if self.parking.nvml is not None or sim is None:
            return None
        return SimGpuSource(tuple(self.parking.devices), memory_used=lambda gpu: sim.capacity - sim.free_bytes(gpu))

    # --- the core --------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def loop_time(self) -> float:
        """The clock of the scheduler and the history (the event loop's)."""
        return self._now()

    def _step(self, call: Callable[..., Any], *args: Any) -> Any:
        """One input to the cluster core, then carry out everything it decided."""
        try:
            return call(*args)
        finally:
            effects = self.cluster.drain()
            if any(isinstance(e, RunMove) and e.kind != "reclaim" for e in effects):
                self._save_journal()  # what a switch is about to do is on record before it starts
            elif not self._journal_due and self._loop is not None:
                # Grants, queues and registrations: coalesced, so a burst of them costs one write.
                self._journal_due = True
                self._loop.call_later(JOURNAL_DELAY_S, self._save_journal)
            self._apply(effects)
            self._rearm_timer()
            self._after_step()

    def _apply(self, effects: list[Any]) -> None:
        for effect in effects:
            try:
                self._apply_one(effect)
            except Exception:
                log.exception("carrying out %r failed", effect)

    def _apply_one(self, effect: Any) -> None:
        if isinstance(effect, Reply):
            if conn := self._conns.get(effect.conn):
                conn.reply(effect.rid, effect.result)
        elif isinstance(effect, Fail):
            if conn := self._conns.get(effect.conn):
                conn.fail(effect.rid, effect.error)
        elif isinstance(effect, Send):
            if self.peers is not None:
                self.peers.send(effect.to, effect.message.to_wire())
        elif isinstance(effect, Persist):
            save_election(self.config.state_dir, effect.state)  # durable before any later Send
        elif isinstance(effect, Push):
            for conn_id in effect.conns:
                if conn := self._conns.get(conn_id):
                    conn.push(effect.event, effect.data)
        elif isinstance(effect, RunMove):
            if self._stopping.is_set():
                log.debug("stopping: %r is not started", effect)
            else:
                self._spawn(self._move(effect))
        elif isinstance(effect, Allocate):
            self._allocate(effect)
        elif isinstance(effect, RecordGrant):
            g = effect.grant
            self._crash_point("at-grant")
            log.debug("grant %s fence %d to %s (restored=%s)", g.group, g.fence, g.job, g.restored)
            self.metrics.observe_grant(g.group, g.waited_s, g.switch_s, g.switched)
        elif isinstance(effect, Noted):
            level = logging.INFO if effect.kind == "leader" else logging.WARNING
            log.log(level, "%s%s", f"job {effect.job!r}: " if effect.job else "", effect.text)
            if effect.kind in ("faulted", "slice_overdue", "preempted"):
                local = self.cluster.jobs.get(effect.job or "")
                group = effect.group or (local.group if local else None)
                self.history.record(effect.kind, self._now(), group=group, job=effect.job, detail=effect.text)

    def _allocate(self, effect: Allocate) -> None:
        conn = self._conns.get(effect.conn)
        try:
            info = self._sim().alloc(effect.job, effect.gpu, effect.requested)
        except Exception as exc:
            self._step(self.cluster.freed, effect.job, effect.gpu, effect.nbytes, self._now())
            if conn is not None:
                conn.fail(effect.rid, exc if isinstance(exc, errors.TimeslicedError) else errors.BackendError(str(exc)))
            return
        self._regions[(effect.job, info.region)] = (effect.gpu, effect.nbytes)
        if conn is not None:
            conn.reply(effect.rid, info.to_wire())

    def _spawn(self, coro: Any) -> None:
        if self._tasks is None:
            coro.close()
            raise RuntimeError("daemon is not running")
        task = self._tasks.create_task(_guarded(coro))
        self._children.add(task)
        task.add_done_callback(self._children.discard)

    async def _move(self, effect: RunMove) -> None:
        """This node's part of a snapshot, restore or reclaim; the cluster core hears how it went."""
        kind = effect.kind
        try:
            target = self._target(effect.job)
            backend = self.parking.backend(target.park.method)
            if kind == "reclaim":
                await self._reclaim(target, backend)
                self._step(self.cluster.move_finished, effect.key, True, 0, 0.0, "", self._now())
                return
            operation = backend.snapshot if kind == "snapshot" else backend.restore
            self._crash_point(f"before-{kind}")
            if f"mid-{kind}" in self.config.crash_at and self._loop is not None:  # the copy runs in a thread
                self._loop.call_later(MID_MOVE_S, self._crash_point, f"mid-{kind}")
            async with timeout(self.config.op_timeout):
                result: MoveResult = await operation(target)
            self._crash_point(f"after-{kind}")
        except Exception as exc:  # a failed move faults the job, never the daemon
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{exc.__class__.__name__}: {exc}"
            log.error("%s of job %r failed: %s", kind, effect.job, reason)
            self._step(self.cluster.move_finished, effect.key, False, 0, 0.0, reason, self._now())
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
                self._measured[effect.job] = dict(result.footprint)
            self.moves.record(effect.job, kind, result.nbytes, result.seconds, self._now())
            self.metrics.observe_move(kind, backend.name, result.nbytes, result.seconds)
        except Exception:  # figures are not worth a lost move: the scheduler must hear of it
            log.exception("recording the %s of job %r failed", kind, effect.job)
        self._step(self.cluster.move_finished, effect.key, True, result.nbytes, result.seconds, "", self._now())

    async def _reclaim(self, target: JobTarget, backend: Any) -> None:
        try:
            async with timeout(self.config.op_timeout):
                await backend.reclaim(target)
        except Exception:
            log.exception("reclaiming job %r failed", target.name)
        for key in [k for k in self._regions if k[0] == target.name]:
            del self._regions[key]
        self._park.pop(target.name, None)
        self._measured.pop(target.name, None)
        log.info("job %r exited; its device and host memory is reclaimed", target.name)
        self.history.record("exited", self._now(), job=target.name)

    def _rearm_timer(self) -> None:
        deadline = self.cluster.next_deadline()
        if self._timer is not None:
            if deadline is not None and self._timer_at == deadline:
                return
            self._timer.cancel()
            self._timer = None
        if deadline is not None and self._loop is not None:
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._step(self.cluster.handle_timers, self._now())

    def _after_step(self) -> None:
        """Follow the groups: history spans, and simulated GPUs' duty (busy while a holder has them)."""
        now = self._now()
        scheduler = self.cluster.scheduler
        if scheduler is not None:
            groups = scheduler.groups.values()
            self.history.observe(
                (GroupView(g.name, g.gpus, g.holder, g.switch.incoming if g.switch else None) for g in groups), now
            )
        self.telemetry.record_held(self.cluster.held_gpus(), now)

    async def _watch_processes(self) -> None:
        """A job none of whose processes on this node is alive or connected is reported gone."""
        while True:
            await asyncio.sleep(self.config.pid_poll_interval)
            for job in list(self.cluster.jobs.values()):
                if not job.sessions and not job.gone and not any(pid_alive(p) for p in job.pids):
                    self._step(self.cluster.gone, job.name, self._now())

    async def _watch_leases(self) -> None:
        """Close connections whose client went quiet: a holder among them loses the lock."""
        while True:
            await asyncio.sleep(self.config.lease / 4)
            self.server.expire_leases(self._now())

    def _sim(self) -> Any:
        if self.parking.sim is None:
            raise errors.BackendUnavailable("simulated device memory needs simulated GPUs (--backend sim)")
        return self.parking.sim

    # --- the journal: taking jobs up again after a restart ----------------------------

    def _save_journal(self) -> None:
        self._journal_due = False
        if self._journal_frozen:
            return
        picture = self.cluster.durable(self._now())
        jobs = self.cluster.jobs
        picture["park"] = {job: spec.to_wire() for job, spec in self._park.items() if job in jobs}
        checkpoint: Any = self.parking.backends.get("cuda-checkpoint")
        if checkpoint is not None:  # where each parked job's processes stand, for the driver after a restart
            picture["backend"] = {job: record for job in jobs if (record := checkpoint.parked(job)) is not None}
        try:
            self.journal.save(picture)
        except OSError as exc:
            log.error("cannot write the journal in %s: %s", self.config.state_dir, exc)

    async def _take_up_journal(self) -> None:
        """Find the jobs of the last run: where their state is now, and the turns they had."""
        picture = self.journal.load()
        sim = self.parking.sim
        recovered = sim.recovered_jobs() if sim is not None else {}
        if picture is None:
            for job, (state, _) in recovered.items():
                log.warning("simulated state of job %r (%s) is on this node but in no journal", job, state)
            return
        kept = []
        for entry in picture["jobs"]:
            name = entry.get("job")
            try:
                spec = ParkSpec.from_wire(picture["park"].get(name), self.parking.default)
                settled = await self._settle_after_restart(entry, spec, picture.get("backend", {}).get(name))
            except Exception as exc:  # one bad entry never stops the others
                log.error("job %r of the journal is not taken up: %s", name, exc)
                continue
            if settled is not None:
                kept.append(settled)
                self._park[name] = spec
                log.info("took up job %r from the last run: %s", name, settled["location"])
        # Simulated state the journal does not know is a reclaim that the last run did not finish.
        for job in set(recovered) - {entry["job"] for entry in kept}:
            log.warning("reclaiming simulated state of job %r: no job of the journal owns it", job)
            await sim.reclaim(job)
        self.cluster.restore({**picture, "jobs": kept}, self._now(), self.config.recovery_grace)
        self._save_journal()

    async def _settle_after_restart(self, entry: dict[str, Any], spec: ParkSpec, record: Any) -> dict[str, Any] | None:
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
            state, footprint = recovered[name]
            for info in sim.regions(name):
                self._regions[(name, info.region)] = (info.gpu, sim.rounded(info.nbytes))
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

    def _crash_point(self, point: str) -> None:
        """Fault injection for crash tests (``DaemonConfig.crash_at``): die here as ``kill -9`` would."""
        if point in self.config.crash_at:
            self._crashes[point] = seen = self._crashes.get(point, 0) + 1
            if seen == self.config.crash_at[point]:
                log.critical("crash point %s: killing the daemon", point)
                os.kill(os.getpid(), signal.SIGKILL)

    # --- offload directives ------------------------------------------------------------

    async def _direct(self, job: str, action: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        """Tell every connection of ``job`` to park or unpark its regions; their answers, in order."""
        local = self.cluster.jobs.get(job)
        conns = [c for s in sorted(local.sessions) if (c := self._conns.get(s))] if local else []
        if not conns:
            raise errors.BackendError(f"job {job!r} has no connection to carry out an offload {action}")
        answers = []
        for conn in conns:
            directive = self._next_directive
            self._next_directive += 1
            answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._directives[directive] = (conn.id, answer)
            conn.push("offload", {"directive": directive, "action": action, **args})
            answers.append((directive, answer))
        try:
            return list(await asyncio.gather(*(a for _, a in answers)))  # an answer never raises
        finally:
            for directive, _ in answers:
                self._directives.pop(directive, None)

    def _target(self, job: str) -> JobTarget:
        local = self.cluster.jobs[job]
        spec = self._park[job]
        pids = set(local.pids)
        if spec.method in ("vllm", "sglang"):
            pids |= descendants(pids)  # an engine's memory sits in its worker processes
        return JobTarget(job, self.cluster.local_gpus(job), tuple(sorted(pids)), spec)


async def _guarded(coro: Any) -> None:
    """A child task that fails is logged; it never takes the daemon down with it."""
    try:
        await coro
    except Exception:
        log.exception("a daemon task failed")


MAX_ERROR_CHARS = 1024


def parse_offload_done(args: dict[str, Any], gpus: set[int]) -> dict[str, Any]:
    """A client's answer to an offload directive, checked; raises ``BadRequest``."""
    ok = args.get("ok")
    if not isinstance(ok, bool):
        raise errors.BadRequest("'ok' must be true or false")
    if not ok:
        error = args.get("error")
        return {"ok": False, "error": (error if isinstance(error, str) else "no reason given")[:MAX_ERROR_CHARS]}
    footprint = args.get("footprint") or {}
    if not isinstance(footprint, dict) or len(footprint) > len(gpus):
        raise errors.BadRequest("'footprint' must map GPUs of this node to byte counts")
    checked: dict[str, int] = {}
    for gpu, n in footprint.items():
        if not (isinstance(gpu, str) and gpu.isdigit() and int(gpu) in gpus):
            raise errors.BadRequest(f"'footprint' names GPU {quoted(gpu)}, which this node does not have")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise errors.BadRequest("'footprint' byte counts must be non-negative integers")
        checked[gpu] = n
    return {"ok": True, "nbytes": arg_int(args, "nbytes", minimum=0), "footprint": checked}
