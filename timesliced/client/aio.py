"""``AsyncClient``: the asyncio client, on the same protocol core as ``Client``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from .. import errors
from ..wire.messages import Push, Reply
from ..wire.park import ParkSpec
from .directives import OffloadExecutor, directive_worker, run_directive
from .protocol import (
    ClientProtocol,
    Grant,
    LockState,
    acquire_args,
    auth_args,
    hello_args,
    lease_of,
    register_args,
    resolve_address,
    result_of,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncClient:
    """One job's connection to its node daemon, for asyncio code.

    Same behaviour as ``Client`` (``token``, reconnection, heartbeats and
    ``parked_access`` too); a cancelled ``acquire()`` leaves the queue at once,
    and a grant that raced with the cancellation is given back.
    """

    def __init__(
        self,
        job: str,
        group: str,
        *,
        address: str | os.PathLike[str] | None = None,
        gpus: list[int] | None = None,
        pids: list[int] | None = None,
        connect_timeout: float = 10.0,
        request_timeout: float = 60.0,
        on_push: Callable[[str, dict[str, Any]], None] | None = None,
        park: str | ParkSpec | None = None,
        offloader: OffloadExecutor | None = None,
        token: str | None = None,
        reconnect: float = 60.0,
        parked_access: str = "wait",
    ) -> None:
        if parked_access not in ("wait", "raise"):
            raise ValueError("parked_access must be 'wait' or 'raise'")
        self.job = job
        self.group = group
        self.address = resolve_address(address)
        self._register = register_args(job, group, gpus, pids, park)
        self.offloader = offloader
        self._token = token  # over TCP; None: $TIMESLICED_TOKEN_FILE or $TIMESLICED_TOKEN when asked
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.on_push = on_push
        self.reconnect = reconnect
        self.parked_access = parked_access
        self.session: int | None = None
        self.gpus: list[int] = []
        self.lock = LockState(job)
        self.reconnects = 0
        self._lease: float | None = None
        self._ready = asyncio.Event()  # connected and registered: requests may go out
        self._closing = False
        self._reached = False
        self._requests: dict[int, tuple[str, dict[str, Any] | None]] = {}  # pending rid -> what to re-send
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._proto = ClientProtocol()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._abandoned: set[int] = set()
        self._lost: errors.TimeslicedError | None = None
        self._connecting = asyncio.Lock()
        # One worker: directives run in the order the daemon sent them (a park before its unpark).
        self._directives: concurrent.futures.ThreadPoolExecutor | None = None  # while connected
        self._directive_tasks: set[asyncio.Task[None]] = set()

    @property
    def faulted(self) -> str | None:
        return self.lock.faulted

    @property
    def preempted(self) -> str | None:
        return self.lock.preempted

    async def connect(self) -> None:
        """Connect, say hello and register the job (idempotent); see ``Client.connect``."""
        deadline = time.monotonic() + self.reconnect
        delay = 0.05
        reached = False
        while True:
            try:
                await self._connect_once()
                return
            except errors.ConnectionLost:
                reached |= self.session is not None or self._reached or self._socket_left()
                if not reached or time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _socket_left(self) -> bool:
        return self.address.kind == "unix" and os.path.exists(self.address.path)

    async def _open(self, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            if self.address.kind == "unix":
                opening = asyncio.open_unix_connection(self.address.path)
            else:
                opening = asyncio.open_connection(self.address.host, self.address.port)
            return await asyncio.wait_for(opening, timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise errors.ConnectionLost(f"cannot reach the timesliced daemon at {self.address}: {exc}") from None

    async def _connect_once(self) -> None:
        self._reached = False
        async with self._connecting:
            if self._writer is not None:
                if self._lost is not None:
                    raise self._lost
                return
            reader, writer = await self._open(self.connect_timeout)
            self._reached = True
            self._writer = writer
            self._lost = None
            self._closing = False
            if self._directives is None:
                self._directives = directive_worker(self.job)
            self._proto = ClientProtocol()
            self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))
        try:
            hello = await self._call("hello", hello_args(), ready=False)
            if (auth := auth_args(hello, self._token)) is not None:
                await self._call("auth", auth, ready=False)
            reg = await self._call("register", self._register, ready=False)
        except BaseException:
            await self.close()
            raise
        self.session = reg["session"]
        self.gpus = list(reg["gpus"])
        self._lease = lease_of(hello)
        self._ready.set()
        self._start_heartbeat()

    async def close(self) -> None:
        self._closing = True
        self._ready.clear()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None
        writer, self._writer = self._writer, None
        if writer is None:
            return
        writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await asyncio.wait_for(self._reader_task, 5)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
        try:
            await asyncio.wait_for(writer.wait_closed(), 5)
        except (OSError, asyncio.TimeoutError):
            pass
        pool, self._directives = self._directives, None
        tasks = list(self._directive_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if pool is not None:
            # A park in progress finishes (the job's bytes are in flight), off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown, True)

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def acquire(self, timeout: float | None = None) -> Grant:
        """Wait for the group's lock. See ``Client.acquire``."""
        await self._ensure_connected()
        await self._wait_ready()
        rid, future = self._send("acquire", acquire_args(timeout))
        try:
            reply = await asyncio.shield(future)
        except BaseException:  # cancelled: withdraw at once, never leave a ghost waiter
            self._abandon(rid)
            raise
        grant = Grant.from_wire(result_of(reply))
        self.lock.granted()
        return grant

    async def release(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("release")
        self.lock.released()
        return result

    @asynccontextmanager
    async def aslice(self, timeout: float | None = None) -> AsyncIterator[Grant]:
        """``async with client.aslice(): ...`` holds the lock for the block."""
        grant = await self.acquire(timeout)
        try:
            yield grant
        except BaseException:
            try:
                await asyncio.shield(self.release())
            except errors.TimeslicedError as exc:
                log.warning("release after a failed slice failed too: %s", exc)
            raise
        await self.release()

    def on_accelerators(
        self, timeout: float | None = None
    ) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
        """Decorator for coroutine functions: every call runs inside ``aslice()``."""

        def decorate(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> T:
                async with self.aslice(timeout):
                    return await fn(*args, **kwargs)

            return wrapper

        return decorate

    async def sim_alloc(self, nbytes: int, gpu: int = 0) -> Any:
        from ..sim.layout import RegionInfo
        from ..sim.region import SimRegion

        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError("nbytes must be a positive integer")
        region = SimRegion.open(RegionInfo.from_wire(await self._call("sim_alloc", {"nbytes": nbytes, "gpu": gpu})))
        if self.parked_access == "wait":
            # An access waits by blocking its thread; on the event loop's own thread it would block
            # the very push that ends the wait, so there it raises NotResident instead.
            loop_thread = threading.get_ident()
            region.hold = lambda: self.lock.preempted is not None and threading.get_ident() != loop_thread
        return region

    async def sim_free(self, region: Any) -> None:
        rid = region if isinstance(region, int) else region.region
        await self._call("sim_free", {"region": rid})
        if not isinstance(region, int):
            region.close()

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("status")
        return result

    async def ping(self) -> None:
        await self._call("ping")

    # --- plumbing --------------------------------------------------------------------

    async def _ensure_connected(self) -> None:
        if self._writer is None:
            await self.connect()

    async def _wait_ready(self) -> None:
        """While connecting or reconnecting, requests wait for the handshake, which goes first."""
        if self._writer is not None and not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), self.reconnect + self.connect_timeout + self.request_timeout)
            except asyncio.TimeoutError:
                pass

    async def _call(self, op: str, args: dict[str, Any] | None = None, *, ready: bool = True) -> Any:
        """``ready=False``: part of the handshake, sent before the connection is ready."""
        if ready:
            await self._ensure_connected()
            await self._wait_ready()
        _, future = self._send(op, args, ready=ready)
        try:
            reply = await asyncio.wait_for(future, self.request_timeout)
        except asyncio.TimeoutError:
            raise errors.ConnectionLost(f"the daemon did not answer {op!r} within {self.request_timeout}s") from None
        return result_of(reply)

    def _send(
        self, op: str, args: dict[str, Any] | None, track: bool = True, *, ready: bool = True
    ) -> tuple[int, asyncio.Future[Reply]]:
        if self._lost is not None:
            raise self._lost
        if self._writer is None:
            raise errors.ConnectionLost("the client is closed")
        rid, frame = self._proto.request(op, args)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if track:  # an untracked request's reply is dropped on arrival
            self._pending[rid] = future
            if ready:  # re-sent after a reconnection (a handshake is not: it belongs to its connection)
                self._requests[rid] = (op, args)
        if ready and not self._ready.is_set():
            return rid, future  # the connection is being replaced: a tracked request goes with the resumption
        self._writer.write(frame)
        return rid, future

    def _abandon(self, rid: int) -> None:
        self._pending.pop(rid, None)
        self._requests.pop(rid, None)
        self._abandoned.add(rid)
        try:
            self._send("cancel", {"request": rid}, track=False)
        except errors.TimeslicedError:
            pass

    async def _carry_out(self, data: dict[str, Any]) -> None:
        """Run one offload directive in a worker thread, then report back."""
        loop = asyncio.get_running_loop()
        pool = self._directives
        if pool is None:
            return  # closed meanwhile
        answer = await loop.run_in_executor(pool, run_directive, self.offloader, data)
        try:
            self._send("offload_done", answer, track=False, ready=False)
        except errors.TimeslicedError:
            pass  # the daemon saw the connection close and gave up on the directive

    async def _read_loop(self, reader: asyncio.StreamReader | None) -> None:
        error: errors.TimeslicedError = errors.ConnectionLost("the daemon closed the connection")
        try:
            while reader is not None:
                error = await self._read_until_lost(reader)
                lost = isinstance(error, errors.ConnectionLost)
                if self._closing or not lost or self.reconnect <= 0 or self.session is None:
                    break
                reader = await self._reconnect(error)
                if reader is None:
                    error = errors.ConnectionLost(f"the daemon did not come back within {self.reconnect:g}s: {error}")
        finally:
            if self._lost is None:
                self._lost = error if self._writer is not None else errors.ConnectionLost("the client is closed")
            pending, self._pending = self._pending, {}
            self._requests.clear()
            self._ready.set()  # wakes requests waiting for a reconnection: they raise ``_lost``
            for future in pending.values():
                if not future.done():
                    future.set_exception(self._lost)

    async def _read_until_lost(self, reader: asyncio.StreamReader) -> errors.TimeslicedError:
        try:
            while data := await reader.read(1 << 16):
                for message in self._proto.receive(data):
                    self._dispatch(message)
        except errors.TimeslicedError as exc:
            return exc
        except OSError as exc:
            return errors.ConnectionLost(f"connection to the daemon failed: {exc}")
        return errors.ConnectionLost("the daemon closed the connection")

    async def _reconnect(self, why: errors.TimeslicedError) -> asyncio.StreamReader | None:
        """Connect again (backing off), register again and re-send what waits; None if the daemon is gone."""
        self._ready.clear()
        log.warning("job %r lost its daemon (%s); reconnecting for up to %gs", self.job, why.message, self.reconnect)
        deadline = time.monotonic() + self.reconnect
        delay = 0.05
        while not self._closing and time.monotonic() < deadline:
            try:
                reader, writer = await self._open(max(0.1, min(self.connect_timeout, deadline - time.monotonic())))
            except errors.ConnectionLost:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            old, self._writer = self._writer, writer
            if old is None:  # closed meanwhile
                writer.close()
                return None
            old.close()
            self._proto.new_connection()
            self._abandoned.clear()
            try:
                await self._resume(reader, writer)
            except errors.ConnectionLost as exc:
                log.warning("job %r: the daemon went away again while resuming (%s)", self.job, exc.message)
                continue
            except errors.TimeslicedError as exc:
                log.error("job %r cannot resume on the restarted daemon: %s", self.job, exc)
                return None
            self.reconnects += 1
            self._ready.set()
            self._start_heartbeat()
            return reader
        return None

    async def _resume(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hello and register on the new connection; take the lock back if it was held; re-send the rest."""
        hello = await self._ask(reader, writer, "hello", hello_args(), self.connect_timeout)
        if (auth := auth_args(hello, self._token)) is not None:
            await self._ask(reader, writer, "auth", auth, self.connect_timeout)
        reg = await self._ask(reader, writer, "register", self._register, self.connect_timeout)
        self.session, self.gpus, self._lease = reg["session"], list(reg["gpus"]), lease_of(hello)
        if self.lock.holding:  # the restarted daemon kept our turn: we are granted first
            answer = await self._ask(reader, writer, "acquire", acquire_args(None), self.request_timeout)
            grant = Grant.from_wire(answer)
            log.info("job %r holds group %r again (fence %d)", self.job, grant.group, grant.fence)
        for rid, (op, args) in sorted(self._requests.items()):  # same ids: the answers reach the original waiters
            writer.write(self._proto.frame(rid, op, args))

    async def _ask(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, op: str, args: dict[str, Any], wait: float
    ) -> Any:
        """One request on a connection nobody else reads yet; pushes that come meanwhile are handled."""
        rid, frame = self._proto.request(op, args)
        try:
            writer.write(frame)
            while True:
                data = await asyncio.wait_for(reader.read(1 << 16), wait)
                if not data:
                    raise errors.ConnectionLost(f"the daemon closed the connection during {op!r}")
                for message in self._proto.receive(data):
                    if isinstance(message, Reply) and message.id == rid:
                        return result_of(message)
                    self._dispatch(message)
        except (OSError, asyncio.TimeoutError) as exc:
            raise errors.ConnectionLost(f"lost the daemon during {op!r}: {exc!r}") from None

    def _start_heartbeat(self) -> None:
        if self._lease and (self._heartbeat_task is None or self._heartbeat_task.done()):
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        """Tell the daemon we are alive, every third of its lease."""
        while self._lease and not self._closing:
            await asyncio.sleep(self._lease / 3)
            if self._ready.is_set() and self._writer is not None:
                try:
                    self._send("ping", None, track=False)
                except errors.TimeslicedError:
                    pass

    def _dispatch(self, message: Reply | Push) -> None:
        if isinstance(message, Push):
            self.lock.on_push(message.event, message.data)
            if message.event == "offload":
                task = asyncio.get_running_loop().create_task(self._carry_out(message.data))
                self._directive_tasks.add(task)
                task.add_done_callback(self._directive_tasks.discard)
            if self.on_push is not None:
                try:
                    self.on_push(message.event, message.data)
                except Exception:
                    log.exception("on_push callback failed")
            return
        future = self._pending.pop(message.id, None)
        self._requests.pop(message.id, None)
        if message.id in self._abandoned:
            self._abandoned.discard(message.id)
            if message.ok:
                try:
                    self._send("release", None, track=False)  # a grant nobody waits for any more
                except errors.TimeslicedError:
                    pass
        elif future is not None and not future.done():
            future.set_result(message)
