"""The node daemon: the composition root that wires the shells to the core.

The scheduler core decides; this module feeds it events (requests from
connections, finished backend moves, timers, exited processes) and carries out
the effects it returns. All scheduler state is touched from the event loop
thread only, within one step, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from .. import __version__, errors
from ..backends.base import MoveResult
from ..config import DaemonConfig
from ..core.events import (
    AcquireCancelled,
    AcquireRequested,
    AllocateRegion,
    Effect,
    Event,
    FailRequest,
    GrantLock,
    JobExited,
    JobRegistered,
    MemoryReleased,
    MemoryRequested,
    MoveFinished,
    NotifyJob,
    ReclaimFinished,
    ReclaimJob,
    ReleaseRequested,
    RestoreJob,
    SessionClosed,
    SnapshotJob,
)
from ..core.scheduler import Scheduler
from ..wire.messages import arg_int, arg_int_list, arg_opt_float, arg_str
from .compat import TaskGroup, timeout
from .processes import pid_alive
from .server import DEFERRED, ClientServer, Connection

log = logging.getLogger(__name__)


class Daemon:
    """One per node. ``await run()`` serves until ``stop()``."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.backend = make_backend(config)
        devices = self.backend.devices()
        self.scheduler = Scheduler({d.index: d.capacity for d in devices}, max_waiters=config.max_waiters)
        self.server = ClientServer(
            self,
            max_frame=config.max_frame,
            max_connections=config.max_connections,
            handshake_timeout=config.handshake_timeout,
            stall_timeout=config.stall_timeout,
            max_write_buffer=config.max_write_buffer,
            node=config.node,
            backend=self.backend.name,
        )
        self.started_at = time.time()
        self.tcp_address: tuple[str, int] | None = None
        self._sessions: dict[int, Connection] = {}  # registered connections by session id
        self._regions: dict[tuple[str, int], tuple[int, int]] = {}  # (job, region) -> (gpu, bytes)
        self._tasks: TaskGroup | None = None
        self._children: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- life cycle ------------------------------------------------------------------

    async def run(self, ready: Callable[[Daemon], None] | None = None) -> None:
        """Bind the sockets, call ``ready(self)``, serve until ``stop()``."""
        self._loop = asyncio.get_running_loop()
        self.config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            await self.server.start_unix(self.config.resolved_socket())
            if self.config.listen is not None:
                self.tcp_address = await self.server.start_tcp(*self.config.listen)
            for job, (state, footprint) in self.backend.recovered_jobs().items():
                # The bytes are safe where the backend found them; handing them back to a
                # re-registering job after a restart is not done yet (see the README).
                log.warning("found job %r from an earlier run (%s, %s bytes per GPU)", job, state, footprint)
            log.info(
                "timesliced %s serving on %s with backend %s (%d GPUs)",
                __version__,
                ", ".join(self.server.addresses),
                self.backend.name,
                len(self.scheduler.capacities),
            )
            async with TaskGroup() as tasks:
                self._tasks = tasks
                self._spawn(self._watch_processes())
                if ready is not None:
                    ready(self)
                await self._stopping.wait()
                self._tasks = None
                for task in list(self._children):
                    task.cancel()
        finally:
            self._tasks = None
            if self._timer is not None:
                self._timer.cancel()
            await self.server.close()
            try:
                self.config.resolved_socket().unlink()
            except FileNotFoundError:
                pass
            self.backend.close()

    def stop(self) -> None:
        self._stopping.set()

    # --- connections (called by ClientServer) ----------------------------------------

    def close_connection(self, conn: Connection) -> None:
        if self._sessions.pop(conn.id, None) is not None:
            self._feed(SessionClosed(conn.id))

    def handle_request(self, conn: Connection, request_id: int, op: str, args: dict[str, Any]) -> Any:
        handler = self._ops.get(op)
        if handler is None:
            raise errors.UnknownOp(f"unknown op {op!r}; known: {', '.join(sorted(self._ops))}")
        return handler(self, conn, request_id, args)

    def _op_register(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        pids = set(arg_int_list(args, "pids") or [])
        if conn.peer.pid is not None:
            pids.add(conn.peer.pid)  # the kernel's word beats the client's
        gpus = arg_int_list(args, "gpus", max_len=64)
        event = JobRegistered(
            conn.id,
            arg_str(args, "job"),
            arg_str(args, "group"),
            tuple(gpus) if gpus is not None else None,
            tuple(sorted(pids)),
        )
        result = self._feed(event)
        self._sessions[conn.id] = conn
        return {**result, "session": conn.id}

    def _op_acquire(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        timeout_s = arg_opt_float(args, "timeout")
        deadline = None if timeout_s is None else self._now() + timeout_s
        self._feed(AcquireRequested(conn.id, rid, deadline))
        return DEFERRED

    def _op_cancel(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._feed(AcquireCancelled(conn.id, arg_int(args, "request")))

    def _op_release(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        return self._feed(ReleaseRequested(conn.id))

    def _op_sim_alloc(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        nbytes = arg_int(args, "nbytes", minimum=1)
        gpu = arg_int(args, "gpu", default=0)
        self._feed(MemoryRequested(conn.id, rid, gpu, self._sim().rounded(nbytes), nbytes))
        return DEFERRED

    def _op_sim_free(self, conn: Connection, rid: int, args: dict[str, Any]) -> Any:
        job = self.scheduler.job_of(conn.id).name
        region = arg_int(args, "region")
        if (job, region) not in self._regions:
            raise errors.UnknownRegion(f"job {job!r} has no region {region}")
        freed = self._sim().free(job, region)
        gpu, nbytes = self._regions.pop((job, region))
        self._feed(MemoryReleased(job, gpu, nbytes))
        return {"region": region, "freed": freed}

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
        "status": _op_status,
        "ping": _op_ping,
    }

    def status(self) -> dict[str, Any]:
        picture = self.scheduler.describe(self._now())
        return {
            "node": self.config.node,
            "version": __version__,
            "pid": os.getpid(),
            "backend": self.backend.name,
            "addresses": list(self.server.addresses),
            "uptime_s": time.time() - self.started_at,
            "connections": len(self.server.connections),
            "counters": dict(self.server.counters),
            **picture,
        }

    # --- the core --------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _feed(self, event: Event) -> Any:
        """Hand one event to the core, then carry out everything it decided."""
        try:
            return self.scheduler.handle(event, self._now())
        finally:
            self._apply(self.scheduler.drain())
            self._rearm_timer()

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            try:
                self._apply_one(effect)
            except Exception:
                log.exception("carrying out %r failed", effect)

    def _apply_one(self, effect: Effect) -> None:
        if isinstance(effect, GrantLock):
            log.debug("grant %s fence %d to %s (restored=%s)", effect.group, effect.fence, effect.job, effect.restored)
            for session, rid in effect.tickets:
                if conn := self._sessions.get(session):
                    conn.reply(rid, effect.info())
        elif isinstance(effect, FailRequest):
            if conn := self._sessions.get(effect.ticket[0]):
                conn.fail(effect.ticket[1], effect.error)
        elif isinstance(effect, (SnapshotJob, RestoreJob)):
            self._spawn(self._move(effect))
        elif isinstance(effect, ReclaimJob):
            self._spawn(self._reclaim(effect))
        elif isinstance(effect, AllocateRegion):
            self._allocate(effect)
        elif isinstance(effect, NotifyJob):
            for session in self.scheduler.jobs[effect.job].sessions if effect.job in self.scheduler.jobs else ():
                if conn := self._sessions.get(session):
                    conn.push(effect.event, effect.data)

    def _allocate(self, effect: AllocateRegion) -> None:
        session, rid = effect.ticket
        conn = self._sessions.get(session)
        try:
            info = self._sim().alloc(effect.job, effect.gpu, effect.requested)
        except Exception as exc:
            self._feed(MemoryReleased(effect.job, effect.gpu, effect.nbytes))
            if conn is not None:
                conn.fail(rid, exc if isinstance(exc, errors.TimeslicedError) else errors.BackendError(str(exc)))
            return
        self._regions[(effect.job, info.region)] = (effect.gpu, effect.nbytes)
        if conn is not None:
            conn.reply(rid, info.to_wire())

    def _spawn(self, coro: Any) -> None:
        if self._tasks is None:
            coro.close()
            raise RuntimeError("daemon is not running")
        task = self._tasks.create_task(coro)
        self._children.add(task)
        task.add_done_callback(self._children.discard)

    async def _move(self, effect: SnapshotJob | RestoreJob) -> None:
        kind = "snapshot" if isinstance(effect, SnapshotJob) else "restore"
        operation = self.backend.snapshot if kind == "snapshot" else self.backend.restore
        try:
            async with timeout(self.config.op_timeout):
                result: MoveResult = await operation(effect.job)
        except Exception as exc:  # a failed move faults the job, never the daemon
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{exc.__class__.__name__}: {exc}"
            log.error("%s of job %r failed: %s", kind, effect.job, reason)
            self._feed(MoveFinished(effect.op, False, error=reason))
            return
        log.info(
            "%s of job %r: %d bytes in %.3fs (%.1f GB/s)",
            kind,
            effect.job,
            result.nbytes,
            result.seconds,
            result.nbytes / result.seconds / 1e9 if result.seconds else 0.0,
        )
        self._feed(MoveFinished(effect.op, True, result.nbytes, result.seconds))

    async def _reclaim(self, effect: ReclaimJob) -> None:
        try:
            async with timeout(self.config.op_timeout):
                await self.backend.reclaim(effect.job)
        except Exception:
            log.exception("reclaiming job %r failed", effect.job)
        for key in [k for k in self._regions if k[0] == effect.job]:
            del self._regions[key]
        log.info("job %r exited; its device and host memory is reclaimed", effect.job)
        self._feed(ReclaimFinished(effect.op))

    def _rearm_timer(self) -> None:
        deadline = self.scheduler.next_deadline()
        if self._timer is not None:
            if deadline is not None and self._timer.when() == deadline:
                return
            self._timer.cancel()
            self._timer = None
        if deadline is not None and self._loop is not None:
            self._timer = self._loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        try:
            self.scheduler.handle_timers(self._now())
        finally:
            self._apply(self.scheduler.drain())
            self._rearm_timer()

    async def _watch_processes(self) -> None:
        """A job whose every process is gone is dropped and its memory reclaimed."""
        while True:
            await asyncio.sleep(self.config.pid_poll_interval)
            for job in list(self.scheduler.jobs.values()):
                if not job.sessions and not job.exiting and not any(pid_alive(p) for p in job.pids):
                    self._feed(JobExited(job.name))

    def _sim(self) -> Any:
        if self.backend.name != "sim":
            raise errors.BadRequest(f"simulated device memory needs the sim backend, not {self.backend.name!r}")
        return self.backend


def make_backend(config: DaemonConfig) -> Any:
    if config.backend == "sim":
        from ..backends.sim import SimBackend

        return SimBackend(
            config.resolved_sim_dir(),
            gpus=config.gpus,
            capacity=config.gpu_memory,
            page_size=config.page_size,
            bandwidth=config.bandwidth,
        )
    raise ValueError(f"unknown backend {config.backend!r} (available: sim)")
