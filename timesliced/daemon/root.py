"""The node daemon: the composition root that wires the shells to the cluster core.

Its parts, each in a module of its own: the client server (``server``) and its ops (``ops``),
offload directives (``directives``), moves through the backends (``moves``), the journal and crash
recovery (``journal``, ``recovery``), the status document (``status``), and fault injection
(``crash``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .. import errors
from ..backends.base import JobTarget
from ..backends.offload import Direct
from ..cluster.asks import Register, Request
from ..cluster.effects import Allocate, Fail, Noted, Push, RecordGrant, Reply, RunMove, Send
from ..cluster.messages import MalformedPeerMessage
from ..cluster.node import PENDING, ClusterNode
from ..cluster.transport import PeerTransport
from ..config import DaemonConfig
from ..core.election import Persist
from ..core.events import DrainRequested, FaultCleared, ForceReleaseRequested
from ..core.history import GroupView, History
from ..core.residency import Options
from ..metrics import Metrics
from ..telemetry import MoveLog, SimGpuSource, Telemetry
from ..util.compat import TaskGroup
from ..util.processes import pid_alive
from ..version import __version__
from ..wire.park import ENGINES, FREEZING
from ..wire.status import Status
from .configfile import check_declared_gpus
from .crash import CrashPoints
from .dashboard_source import DaemonView
from .directives import Directives
from .election_file import load_election, save_election
from .host_memory import HostMemory, JobPlace
from .jobs import NodeJobs
from .journal import Journal
from .members_watch import MembersWatch
from .moves import Mover
from .ops import ClientOps
from .parking import Parking, open_parking
from .recovery import Recovery
from .server import DEFERRED, ClientServer, Connection
from .status import StatusReport

log = logging.getLogger(__name__)

JOURNAL_DELAY_S = 0.02  # how stale the journal's holders and queues may be (moves are written before they start)
WEB_SHUTDOWN_S = 2.0  # open dashboard streams get this long to end when the daemon stops


class Daemon:
    """One per node. ``await run()`` serves until ``stop()``.

    The composition root: it builds the parts, feeds the cluster core its inputs (client requests,
    peer messages, finished moves, timers, exited processes) and routes the core's effects to the
    parts that carry them out. All core state is touched from the event loop thread only, within
    one step, so no locks are needed.
    """

    def __init__(self, config: DaemonConfig, parking: Callable[[Direct], Parking] | None = None) -> None:
        """``parking`` builds the node's backends in place of probing the node (tests, embedding)."""
        self.config = config
        self._conns: dict[int, Connection] = {}  # connections that sent a request, by id
        self.directives = Directives(self._connections_of)
        self.parking = (parking or functools.partial(open_parking, config))(self.directives.direct)
        # A group declared on a GPU this node lacks is the config file's error, told at start, not at a register.
        check_declared_gpus(config.groups, [d.index for d in self.parking.devices])
        members = tuple(config.cluster.members) if config.cluster else (config.node,)
        self.cluster = ClusterNode(
            config.node,
            members,
            {d.index: d.capacity for d in self.parking.devices},
            rng=random.Random(),
            election_timeout=config.cluster.election_timeout if config.cluster else (1.0, 2.0),
            heartbeat_interval=config.cluster.heartbeat_interval if config.cluster else 0.25,
            # Also alone: a restarted daemon leads in a new term, so its grants' (term, fence) exceed the old ones.
            persisted=load_election(config.state_dir),
            max_waiters=config.max_waiters,
            op_timeout=config.op_timeout,
            policies=config.slice_policies,
            residency=Options(
                memory_headroom=config.memory_headroom,
                prefetch=config.prefetch,
                stream_switches=config.stream_switches,
                anticipate_s=config.anticipate,
            ),
            queue_policies=config.queue_policies,
        )
        self.jobs = NodeJobs()
        self.journal = Journal(config.state_dir)
        self.recovery = Recovery(config, self.journal, self.parking, self.jobs)
        self._journal_due = False
        self._journal_frozen = False  # set once stopping: see run()
        self.crash = CrashPoints(config.crash_at)
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
        self.host_memory = HostMemory(
            limit=config.host_memory_limit,
            margin=config.host_memory_margin,
            sim_dir=config.resolved_sim_dir() if self.parking.sim is not None else None,
            root=config.host_root,
            pool=self.parking.sim.pool.describe if self.parking.sim is not None else None,
        )
        self._host_failing = False  # log a run of failed readings once
        sim_source = self._sim_gpu_source()
        self.telemetry = Telemetry(self.parking.nvml or sim_source, interval=config.telemetry_interval, clock=self._now)
        self.moves = MoveLog()
        self.history = History()
        # Under --dns: whether the name still lists this daemon's members.
        self.members_watch: MembersWatch | None = None
        if config.cluster is not None and config.cluster.dns is not None:
            self.members_watch = MembersWatch(
                *config.cluster.dns, members=config.cluster.members, interval=config.cluster.dns_check_interval
            )
        self.report = StatusReport(
            config,
            parking=self.parking,
            server=self.server,
            cluster=self.cluster,
            jobs=self.jobs,
            telemetry=self.telemetry,
            sim_source=sim_source,
            moves=self.moves,
            peers=lambda: self.peers,
            members_look=lambda: self.members_watch.last if self.members_watch else None,
            host_memory=self.host_memory,
            clock=self._now,
        )
        self.metrics = Metrics(self.status, node=config.node)
        self.mover = Mover(
            self.parking,
            self.jobs,
            op_timeout=config.op_timeout,
            crash=self.crash,
            log_of_moves=self.moves,
            metrics=self.metrics,
            history=self.history,
            clock=self._now,
        )
        self.ops = ClientOps(
            cluster=self.cluster,
            parking=self.parking,
            jobs=self.jobs,
            directives=self.directives,
            history=self.history,
            forward=self._forward,
            freed=lambda job, gpu, nbytes: self._step(self.cluster.freed, job, gpu, nbytes, self._now()),
            status=self.status,
            clock=self._now,
            park_every_handoff=config.park_every_handoff,
            groups=config.groups,
        )
        self._device_peaks: dict[str, dict[int, int]] = {}  # job -> the most device memory last told the scheduler
        self._moves_running: dict[tuple[int, int, int], asyncio.Event] = {}  # key -> set once it ended
        self.web_url: str | None = None
        self._web: web.AppRunner | None = None
        self.started_loop = 0.0  # loop time at run()
        self.tcp_address: tuple[str, int] | None = None
        self._tasks: TaskGroup | None = None
        self._children: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seen_groups: list[GroupView] = []  # what the history and telemetry were last told
        self._seen_held: set[int] | None = None

    # --- life cycle ------------------------------------------------------------------

    async def run(self, ready: Callable[[Daemon], None] | None = None) -> None:
        """Bind the sockets, call ``ready(self)``, serve until ``stop()``."""
        self._loop = asyncio.get_running_loop()
        self.started_loop = self._loop.time()
        self.config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        bound = False
        try:
            await self.recovery.take_up(self.cluster, self._now())
            await self._start_cluster()
            self.read_host()  # before any park can be planned
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
            preempting = sorted(g for g, p in self.config.slice_policies.items() if p.action == "preempt")
            if preempting and self.parking.default not in FREEZING:
                log.warning(
                    "jobs parked with %s (the default method) cannot be preempted safely: groups %s, which preempt, "
                    "refuse them; park them with cuda-checkpoint, or make those groups warn",
                    self.parking.default,
                    ", ".join(preempting),
                )
            async with TaskGroup() as tasks:
                self._tasks = tasks
                self._spawn(self._watch_processes())
                self._spawn(self._watch_host())
                self._spawn(self._watch_device_memory())
                if self.config.lease:
                    self._spawn(self._watch_leases())
                self._spawn(self.telemetry.run())
                if self.members_watch is not None:
                    self._spawn(self.members_watch.run())
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
        except MalformedPeerMessage as exc:  # one peer's bad message never stops the daemon
            log.warning("dropped a malformed message from node %r: %s", sender, exc)
        except Exception:  # the node checked the message before it changed anything: this is ours
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
        self.directives.connection_closed(conn.id)
        if self._conns.pop(conn.id, None) is not None:
            self._step(self.cluster.closed, conn.id, self._now())

    def handle_request(self, conn: Connection, request_id: int, op: str, args: dict[str, Any]) -> Any:
        return self.ops.handle(conn, request_id, op, args)

    def _forward(self, conn: Connection, request: Request) -> Any:
        """Hand a client's request to the cluster (the leader, wherever it is)."""
        self._conns[conn.id] = conn
        result = self._step(self.cluster.request, request, self._now())
        if isinstance(request, Register):
            self.read_host()  # the new job's processes and their cgroups count before its first park
        return DEFERRED if result is PENDING else result

    def _connections_of(self, job: str) -> list[Connection]:
        local = self.cluster.jobs.get(job)
        return [c for s in sorted(local.sessions) if (c := self._conns.get(s))] if local else []

    def admin(self, event: ForceReleaseRequested | DrainRequested | FaultCleared) -> dict[str, Any]:
        """An administrator's action (the dashboard checked the token); raises ``TimeslicedError``."""
        result: dict[str, Any] = self._step(self.cluster.admin, event, self._now())
        if isinstance(event, FaultCleared):
            what = f"job {event.job!r} resumed (it was faulted: {result['was']})"
            log.warning("administrator: %s", what)
            self.history.record("admin", self._now(), group=result["group"], job=event.job, detail=what)
            return result
        if isinstance(event, ForceReleaseRequested):
            what = f"force-released from {result['released']}"
        else:
            what = "drained" if event.on else "resumed"
        log.warning("administrator: group %r %s", event.group, what)
        self.history.record("admin", self._now(), group=event.group, detail=what)
        return result

    def resume_job(self, job: str) -> dict[str, Any]:
        """Clear ``job``'s fault once its cause is gone; raises ``TimeslicedError`` (``JobFaulted``: it is not).

        Where this node's backend can tell (the simulated GPU), the job's state must be whole where the
        scheduler has it; elsewhere the operator vouches for it.
        """
        self._check_resumable(job)
        return self.admin(FaultCleared(job))

    def resume_group(self, group: str) -> dict[str, Any]:
        """Resume a drained group and clear the faults of its jobs whose cause is gone; raises ``TimeslicedError``."""
        result = self.admin(DrainRequested(group, False))
        scheduler = self.cluster.scheduler
        faulted = sorted(j.name for j in scheduler.jobs.values() if j.group == group and j.faulted) if scheduler else []
        resumed, kept = [], {}
        for job in faulted:
            try:
                self.resume_job(job)
                resumed.append(job)
            except errors.TimeslicedError as exc:
                kept[job] = exc.message
        return {**result, "resumed": resumed, "still_faulted": kept}

    def _check_resumable(self, job: str) -> None:
        scheduler = self.cluster.scheduler
        core = scheduler.jobs.get(job) if scheduler is not None else None
        spec = self.jobs.park.get(job)
        sim = self.parking.sim
        if core is None or spec is None or spec.method != "sim" or sim is None or not core.faulted:
            return  # the core refuses what is unknown or not faulted; other backends cannot tell
        state = sim.verify(job)
        if state == "faulted":
            raise errors.JobFaulted(
                f"job {job!r} cannot be resumed: its simulated GPU state is lost (its device copy, or a parked "
                "file, is gone); end the job and start it again"
            )
        if state in ("resident", "parked") and state != core.location.value:
            raise errors.JobFaulted(
                f"job {job!r} cannot be resumed: its simulated GPU state is {state}, not {core.location.value} "
                "as the scheduler has it; end the job and start it again"
            )

    @property
    def serving(self) -> bool:
        return self._tasks is not None and not self._stopping.is_set()

    def status(self) -> Status:
        return self.report.status()

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
                self._apply(effects)
            else:
                self._apply(effects)  # the grants go out first: the journal's write is 20 ms away anyway
                if not self._journal_due and self._loop is not None:
                    # Grants, queues and registrations: coalesced, so a burst of them costs one write.
                    self._journal_due = True
                    self._loop.call_later(JOURNAL_DELAY_S, self._save_journal)
            self._rearm_timer()
            self._after_step()

    def _apply(self, effects: list[Any]) -> None:
        grants: list[RecordGrant] = []
        swaps = _swaps(effects)
        for effect in effects:
            try:
                if isinstance(effect, RunMove) and (effect.key in swaps or effect in swaps.values()):
                    if effect.key in swaps and not self._stopping.is_set():
                        self._spawn(self._run_swap(effect, swaps[effect.key]))
                elif isinstance(effect, RecordGrant):
                    self.crash.reached("at-grant")  # before the grant is written to its client
                    grants.append(effect)
                else:
                    self._apply_one(effect)
            except Exception:
                log.exception("carrying out %r failed", effect)
        for effect in grants:  # the figures once the grants are on their way: a handoff waits for no metric
            try:
                g = effect.grant
                log.debug("grant %s fence %d to %s (restored=%s)", g.group, g.fence, g.job, g.restored)
                self.metrics.observe_grant(g.group, g.waited_s, g.switch_s, g.switched)
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
                self._spawn(self._run_move(effect))
        elif isinstance(effect, Allocate):
            self._allocate(effect)
        elif isinstance(effect, Noted):
            level = logging.INFO if effect.kind in ("leader", "policy") else logging.WARNING
            log.log(level, "%s%s", f"job {effect.job!r}: " if effect.job else "", effect.text)
            if effect.kind in ("faulted", "slice_overdue", "preempted", "move_failed", "policy"):
                local = self.cluster.jobs.get(effect.job or "")
                group = effect.group or (local.group if local else None)
                self.history.record(effect.kind, self._now(), group=group, job=effect.job, detail=effect.text)

    def _allocate(self, effect: Allocate) -> None:
        conn = self._conns.get(effect.conn)
        try:
            info = self.parking.sim_or_raise().alloc(effect.job, effect.gpu, effect.requested)
        except Exception as exc:
            self._step(self.cluster.freed, effect.job, effect.gpu, effect.nbytes, self._now())
            if conn is not None:
                conn.fail(effect.rid, exc if isinstance(exc, errors.TimeslicedError) else errors.BackendError(str(exc)))
            return
        self.jobs.regions[(effect.job, info.region)] = (effect.gpu, effect.nbytes)
        if conn is not None:
            conn.reply(effect.rid, info.to_wire())

    def _spawn(self, coro: Any) -> None:
        if self._tasks is None:
            coro.close()
            raise RuntimeError("daemon is not running")
        task = self._tasks.create_task(_guarded(coro))
        self._children.add(task)
        task.add_done_callback(self._children.discard)

    def _target(self, job: str) -> JobTarget:
        return self.jobs.target(self.cluster, job)

    async def _run_move(self, effect: RunMove) -> None:
        """Carry out one move. A restore that streams into snapshots' room (``streams_with``) starts
        once those snapshots ended: the sequential form of a streamed switch, the same outcome for
        the scheduler (it counts the pair as one move either way)."""
        done = self._moves_running.setdefault(effect.key, asyncio.Event())
        try:
            for key in effect.streams_with:
                if (before := self._moves_running.get(key)) is not None:
                    await before.wait()  # bounded: each snapshot ends within --op-timeout
            await self.mover.run(effect, self._target, self._move_finished)
        finally:
            done.set()
            self._moves_running.pop(effect.key, None)

    async def _run_swap(self, park: RunMove, restore: RunMove) -> None:
        """A snapshot and the restore that streams into its room, as one swap through the backend
        (both directions of the link at once where it can, else one after the other)."""
        done = [self._moves_running.setdefault(e.key, asyncio.Event()) for e in (park, restore)]
        try:
            await self.mover.swap(park, restore, self._target, self._move_finished)
        finally:
            for e, event in zip((park, restore), done, strict=True):
                event.set()
                self._moves_running.pop(e.key, None)

    def _move_finished(
        self, key: tuple[int, int, int], ok: bool, nbytes: int, seconds: float, error: str, intact: bool, code: str
    ) -> None:
        now = self._now()
        self._step(
            functools.partial(self.cluster.move_finished, intact=intact, code=code),
            key,
            ok,
            nbytes,
            seconds,
            error,
            now,
        )
        self.read_host()  # what the move took or gave back, before the next park is planned

    # --- host memory for parked state ----------------------------------------------------

    def read_host(self) -> None:
        """Read the host's memory for parked state and tell the scheduler, unless a move is under way here.

        A reading taken mid-move would count part of it; the next one after it ends is exact.
        """
        if self.cluster.moving:
            return
        try:
            reading = self.host_memory.read(self._host_jobs(), self._now())
        except Exception:  # a figure that cannot be read must not stop the daemon; the last reading stands
            if not self._host_failing:
                log.exception("reading the host's memory failed; parks are admitted by the last reading")
            self._host_failing = True
            return
        if self._host_failing:
            log.info("the host's memory can be read again")
            self._host_failing = False
        for problem in reading.errors:
            log.debug("host memory: %s", problem)
        self._step(self.cluster.host_read, reading.notice, self._now())

    def _host_jobs(self) -> list[JobPlace]:
        """This node's jobs as a reading needs them: method, processes, and measured device memory."""
        per_pid: dict[int, dict[int, int]] = {}
        nvml = self.parking.nvml
        if nvml is not None:
            try:
                per_pid = nvml.process_memory()
            except errors.TimeslicedError as exc:
                log.debug("host memory: no process figures from NVML: %s", exc.message)
        out = []
        for name, local in sorted(self.cluster.jobs.items()):
            spec = self.jobs.park.get(name)
            if spec is None or local.gone:
                continue
            target = self.jobs.target(self.cluster, name)
            # What its park is expected to put in host memory: its device memory (a checkpoint copies all of
            # it; offload and an engine's level 1 copy a part). A simulated job's is the scheduler's own
            # count, and an engine at sleep level 2 discards its weights: nothing is measured for those.
            measured = sum(sum(per_pid.get(pid, {}).values()) for pid in target.pids)
            size = measured or sum(self.jobs.measured.get(name, {}).values())
            if spec.method == "sim" or (spec.method in ENGINES and spec.level == 2):
                size = 0
            out.append(JobPlace(name, spec.method, target.pids, size))
        return out

    async def _watch_device_memory(self) -> None:
        """Each second, tell the scheduler how much device memory this node's real jobs hold, when it grew.

        Per GPU, the larger of NVML's per-process figures summed over the job's processes and what its
        last move measured (offload registrations, an engine's figures). The scheduler keeps the peak and
        plans jobs that declared their memory with it; a simulated job's memory is its own count already.
        """
        while True:
            await asyncio.sleep(self.config.telemetry_interval)
            for job, gpus in self._device_memory().items():
                seen = self._device_peaks.setdefault(job, {})
                grown = {g: n for g, n in gpus.items() if n > seen.get(g, 0)}
                if grown:
                    seen.update(grown)
                    self._step(self.cluster.measured, job, dict(seen), self._now())
            for gone in self._device_peaks.keys() - self.cluster.jobs.keys():
                del self._device_peaks[gone]

    def _device_memory(self) -> dict[str, dict[int, int]]:
        per_pid: dict[int, dict[int, int]] = {}
        nvml = self.parking.nvml
        if nvml is not None:
            try:
                per_pid = nvml.process_memory()  # pid -> {gpu -> bytes}; raises BackendError / BackendUnavailable
            except errors.TimeslicedError as exc:
                log.debug("device memory: no process figures from NVML: %s", exc.message)
        out: dict[str, dict[int, int]] = {}
        for name, local in self.cluster.jobs.items():
            spec = self.jobs.park.get(name)
            if spec is None or spec.method == "sim" or local.gone:
                continue
            seen: dict[int, int] = {}
            for pid in self.jobs.target(self.cluster, name).pids:
                for gpu, n in per_pid.get(pid, {}).items():
                    seen[gpu] = seen.get(gpu, 0) + n
            moved = self.jobs.measured.get(name, {})
            gpus = {g: max(seen.get(g, 0), moved.get(g, 0)) for g in seen.keys() | moved.keys()}
            if any(gpus.values()):
                out[name] = gpus
        return out

    async def _watch_host(self) -> None:
        while True:
            await asyncio.sleep(self.config.host_memory_interval)
            self.read_host()

    def _save_journal(self) -> None:
        self._journal_due = False
        if not self._journal_frozen:
            self.recovery.save(self.cluster, self._now())

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
        """Follow the groups: history spans, and simulated GPUs' duty (busy while a holder has them).

        Both are told only what changed (most steps, an acquire that queues, change neither).
        """
        now = self._now()
        scheduler = self.cluster.scheduler
        if scheduler is not None:
            views = [
                GroupView(g.name, g.gpus, g.holder, g.switch.incoming if g.switch else None)
                for g in scheduler.groups.values()
            ]
            if views != self._seen_groups:
                self._seen_groups = views
                self.history.observe(views, now)
        held = self.cluster.held_gpus()
        if held != self._seen_held:
            self._seen_held = held
            self.telemetry.record_held(held, now)

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


async def _guarded(coro: Any) -> None:
    """A child task that fails is logged; it never takes the daemon down with it."""
    try:
        await coro
    except Exception:
        log.exception("a daemon task failed")


def _swaps(effects: list[Any]) -> dict[tuple[int, int, int], RunMove]:
    """snapshot key -> the restore of the same batch that streams into that snapshot's room alone."""
    snapshots = {e.key for e in effects if isinstance(e, RunMove) and e.kind == "snapshot"}
    return {
        e.streams_with[0]: e
        for e in effects
        if isinstance(e, RunMove)
        and e.kind == "restore"
        and len(e.streams_with) == 1
        and e.streams_with[0] in snapshots
    }
