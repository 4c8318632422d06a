"""``AsyncClient``: the asyncio client, on the same protocol core as ``Client``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from .. import errors
from ..backends.base import ParkSpec
from ..wire.messages import Push, Reply
from .directives import OffloadExecutor, directive_worker, run_directive
from .protocol import (
    ClientProtocol,
    Grant,
    acquire_args,
    hello_args,
    register_args,
    resolve_address,
    result_of,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncClient:
    """One job's connection to its node daemon, for asyncio code.

    Same behaviour as ``Client``; a cancelled ``acquire()`` leaves the queue at
    once, and a grant that raced with the cancellation is given back.
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
    ) -> None:
        self.job = job
        self.group = group
        self.address = resolve_address(address)
        self._register = register_args(job, group, gpus, pids, park)
        self.offloader = offloader
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.on_push = on_push
        self.session: int | None = None
        self.gpus: list[int] = []
        self.faulted: str | None = None
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

    async def connect(self) -> None:
        async with self._connecting:
            if self._writer is not None:
                if self._lost is not None:
                    raise self._lost
                return
            try:
                if self.address.kind == "unix":
                    opening = asyncio.open_unix_connection(self.address.path)
                else:
                    opening = asyncio.open_connection(self.address.host, self.address.port)
                reader, writer = await asyncio.wait_for(opening, self.connect_timeout)
            except (OSError, asyncio.TimeoutError) as exc:
                raise errors.ConnectionLost(f"cannot reach the timesliced daemon at {self.address}: {exc}") from None
            self._writer = writer
            self._lost = None
            if self._directives is None:
                self._directives = directive_worker(self.job)
            self._proto = ClientProtocol()
            self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))
        try:
            await self._call("hello", hello_args())
            reg = await self._call("register", self._register)
        except BaseException:
            await self.close()
            raise
        self.session = reg["session"]
        self.gpus = list(reg["gpus"])

    async def close(self) -> None:
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
        rid, future = self._send("acquire", acquire_args(timeout))
        try:
            reply = await asyncio.shield(future)
        except BaseException:  # cancelled: withdraw at once, never leave a ghost waiter
            self._abandon(rid)
            raise
        return Grant.from_wire(result_of(reply))

    async def release(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("release")
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
        from ..backends.sim_layout import RegionInfo, SimRegion

        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError("nbytes must be a positive integer")
        return SimRegion.open(RegionInfo.from_wire(await self._call("sim_alloc", {"nbytes": nbytes, "gpu": gpu})))

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

    async def _call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        if op not in ("hello", "register"):
            await self._ensure_connected()
        _, future = self._send(op, args)
        try:
            reply = await asyncio.wait_for(future, self.request_timeout)
        except asyncio.TimeoutError:
            raise errors.ConnectionLost(f"the daemon did not answer {op!r} within {self.request_timeout}s") from None
        return result_of(reply)

    def _send(self, op: str, args: dict[str, Any] | None, track: bool = True) -> tuple[int, asyncio.Future[Reply]]:
        if self._lost is not None:
            raise self._lost
        if self._writer is None:
            raise errors.ConnectionLost("the client is closed")
        rid, frame = self._proto.request(op, args)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if track:  # an untracked request's reply is dropped on arrival
            self._pending[rid] = future
        self._writer.write(frame)
        return rid, future

    def _abandon(self, rid: int) -> None:
        self._pending.pop(rid, None)
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
            self._send("offload_done", answer, track=False)
        except errors.TimeslicedError:
            pass  # the daemon saw the connection close and gave up on the directive

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        error: errors.TimeslicedError = errors.ConnectionLost("the daemon closed the connection")
        try:
            while data := await reader.read(1 << 16):
                for message in self._proto.receive(data):
                    self._dispatch(message)
        except errors.TimeslicedError as exc:
            error = exc
        except OSError as exc:
            error = errors.ConnectionLost(f"connection to the daemon failed: {exc}")
        finally:
            if self._lost is None:
                self._lost = error if self._writer is not None else errors.ConnectionLost("the client is closed")
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(self._lost)

    def _dispatch(self, message: Reply | Push) -> None:
        if isinstance(message, Push):
            if message.event == "faulted":
                self.faulted = str(message.data.get("reason", "faulted"))
            elif message.event == "offload":
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
        if message.id in self._abandoned:
            self._abandoned.discard(message.id)
            if message.ok:
                try:
                    self._send("release", None, track=False)  # a grant nobody waits for any more
                except errors.TimeslicedError:
                    pass
        elif future is not None and not future.done():
            future.set_result(message)
