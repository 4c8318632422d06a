"""``AsyncClient``: the asyncio client, a streams shell around the same ``ClientSession`` as ``Client``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from .. import errors
from .codec import Grant
from .directives import directive_worker
from .protocol import dial_failure
from .session import Answered, Disconnect, Failed, Logged, Pushed, State, Unreachable
from .shell import ShellBase

if TYPE_CHECKING:
    from ..util.compat import TaskGroup

log = logging.getLogger(__name__)
T = TypeVar("T")

CLOSE_S = 5.0  # how long close() waits for the supervisor, and a closing connection for its transport
CLEANUP_S = 5.0  # how long a slice that failed waits for its release


class AsyncClient(ShellBase):
    """One job's connection to its node daemon, for asyncio code.

    Same arguments and behaviour as ``Client`` (``token``, reconnection,
    heartbeats, ``parked_access``, ``acquire(timeout=...)`` bounding the whole
    call); a cancelled ``acquire()`` leaves the queue at once, and a grant that
    raced with the cancellation is given back. It may be used with or without
    ``async with``.

    The first call starts one supervisor task; its task group holds everything
    else the client runs (offload directives in flight), and it reads the
    connection and keeps the session's timers. ``close()`` ends it.
    """

    def _start_io(self) -> None:
        self._waiters: dict[int, asyncio.Future[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None  # the open connection, for writing; the supervisor owns it
        self._driving = False  # a supervisor drives the session (it clears this when it ends)
        self._supervisors: set[asyncio.Task[None]] = set()  # the running one, and any still finishing
        self._tasks: TaskGroup | None = None  # the running supervisor's
        self._wakeup: asyncio.Event | None = None  # wakes the supervisor while it waits between attempts
        # One worker: directives run in the order the daemon sent them (a park before its unpark).
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # None once closed

    async def connect(self) -> None:
        """Connect, say hello and register the job (idempotent); see ``Client.connect``."""
        await self._wait(self._submit(self._core.wait_ready))

    async def close(self) -> None:
        """Close the connection; a held lock is released by the daemon. Waiting calls raise ``ConnectionLost``.

        In a process forked from the one that made the client, it forgets the parent's connection and
        sends nothing: the connection, and the lock it may hold, stay the parent's.
        """
        if self._foreign() is not None:
            # The transport is the parent's event loop's: closing it would unregister its socket from the
            # epoll set the two processes share. Dropped as it is; this process's copy goes when it exits.
            self._writer = None
            return
        self._step(self._core.close)
        me = asyncio.current_task()
        supervisors = [task for task in self._supervisors if task is not me]
        if supervisors:
            try:
                async with _timeout(CLOSE_S):
                    await asyncio.wait(supervisors)
            except TimeoutError:
                for task in supervisors:
                    task.cancel()
                await asyncio.wait(supervisors)
        pool, self._pool = self._pool, None
        self._rooms.lost("the client closed")  # a streamed unpark waiting for room ends (its regions stay parked)
        if pool is not None:
            # A park in progress finishes (the job's bytes are in flight), off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown, True)

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def acquire(self, timeout: float | None = None, *, gang: str | None = None, members: int = 0) -> Grant:
        """Wait for the group's lock. See ``Client.acquire`` (gangs too)."""
        start = functools.partial(self._core.acquire, timeout, gang=gang, members=members)
        grant: Grant = await self._wait(self._submit(start))
        return grant

    async def release(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("release")
        return result

    @asynccontextmanager
    async def aslice(self, timeout: float | None = None) -> AsyncIterator[Grant]:
        """``async with client.aslice(): ...`` holds the lock for the block, released on exceptions too."""
        grant = await self.acquire(timeout)
        try:
            yield grant
        except BaseException:
            await self._release_after_failure()
            raise
        await self.release()

    async def _release_after_failure(self) -> None:
        try:
            async with _timeout(CLEANUP_S):  # bounded: the block may have been cancelled
                await self.release()
        except (errors.TimeslicedError, TimeoutError) as exc:
            log.warning("release after a failed slice failed too: %s", exc or "no answer in time")

    def on_accelerators(
        self, timeout: float | None = None, *, pass_grant: bool = False
    ) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
        """Decorator for coroutine functions: every call runs inside ``aslice()``.

        ``pass_grant=True``: the function also gets the call's ``Grant`` as the keyword argument
        ``grant``, which its callers leave out (as ``Client.on_accelerators``).
        """

        def decorate(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> T:
                async with self.aslice(timeout) as grant:
                    if pass_grant:
                        kwargs["grant"] = grant
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

    # --- waiting for the core ----------------------------------------------------------

    async def _call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        return await self._wait(self._submit(lambda now: self._core.request(op, args, now)))

    def _submit(self, start: Callable[[float], int]) -> tuple[int, asyncio.Future[Any]]:
        """Hand the core a request (connecting first if need be); returns its id and future.

        Raises ``ConnectionLost`` at once in a process forked from the client's own. Whatever raises
        once ``start`` made the request (a callback's ``BaseException`` in ``_pump``, say) withdraws it,
        as the sync client does: an acquire is never left to be granted to nobody.
        """
        if (foreign := self._foreign()) is not None:
            raise foreign
        loop = asyncio.get_running_loop()
        rid = start(loop.time())
        try:
            future = self._waiters[rid] = loop.create_future()
            self._pump()
            self._ensure_supervisor()
        except BaseException:
            self._withdraw(rid)
            raise
        return rid, future

    async def _wait(self, waiter: tuple[int, asyncio.Future[Any]]) -> Any:
        """The request's result; the caller keeps the core's deadline for it, at the call site."""
        rid, future = waiter
        loop = asyncio.get_running_loop()
        try:
            while not future.done():
                deadline = self._core.deadline_of(rid)
                try:
                    async with _timeout(None if deadline is None else max(0.0, deadline - loop.time())):
                        await asyncio.wait((future,))
                except TimeoutError:
                    self._step(self._core.handle_timers)
        except BaseException:  # cancelled: withdraw at once, never leave a ghost waiter
            if future.done() and not future.cancelled():
                future.exception()  # seen: the caller raises its own
            self._withdraw(rid)
            raise
        return future.result()

    def _withdraw(self, rid: int) -> None:
        """The caller of ``rid`` stopped waiting: the core abandons it (an acquire leaves the queue)."""
        self._waiters.pop(rid, None)
        self._step(functools.partial(self._core.abandon, rid))

    def _step(self, action: Callable[[float], T]) -> T:
        """One input into the core, then its outputs carried out."""
        result = action(asyncio.get_running_loop().time())
        self._pump()
        if self._wakeup is not None:
            self._wakeup.set()
        return result

    def _pump(self) -> None:
        """Write what the core wrote, close what it left, wake the waiters, run the callbacks."""
        data = self._core.data_to_send()
        if data and self._writer is not None:
            self._writer.write(data)
        for out in self._core.drain():
            if isinstance(out, Disconnect):
                writer, self._writer = self._writer, None
                if writer is not None:
                    writer.close()  # the supervisor's read ends; it waits for the transport
                self._rooms.lost(out.reason, out.connection)  # never read again: its end would not tell the rooms
            elif isinstance(out, Answered):
                if (future := self._waiters.pop(out.rid, None)) is not None and not future.done():
                    future.set_result(out.value)
            elif isinstance(out, Failed):
                if (future := self._waiters.pop(out.rid, None)) is not None and not future.done():
                    future.set_exception(out.error)
            elif isinstance(out, Pushed):  # the loop's one thread carries them out in the stream's order
                self._directed(out)
                self._pushed(out)
            elif isinstance(out, Logged):
                self._logged(out)

    # --- the supervisor ------------------------------------------------------------------

    def _ensure_supervisor(self) -> None:
        """Start the supervisor if the core wants a connection and none drives it."""
        if self._core.wants_connection and not self._driving:
            self._driving = True
            if self._pool is None:
                self._pool = directive_worker(self.job)
            self._wakeup = asyncio.Event()
            # The client's one root task: close() awaits it, and it is the parent of all the others.
            task = asyncio.get_running_loop().create_task(self._supervise(), name=f"timesliced-{self.job}")
            self._supervisors.add(task)
            task.add_done_callback(self._supervisors.discard)

    async def _supervise(self) -> None:
        """The client's root task: its task group holds the directives in flight, and it drives the session."""
        group = _task_group()
        ended = False
        try:
            async with group:
                self._tasks = group
                await self._drive()
            ended = True
        except Exception:
            log.exception("job %r: the client's supervisor failed; closing the client", self.job)
            self._step(self._core.close)
        finally:
            if self._tasks is group:
                self._tasks = None
            if not ended:  # cancelled (its event loop ends) or failed: a later call starts another
                self._driving = False

    async def _drive(self) -> None:
        """Open connections, read them and keep the core's timers, while the core wants a connection."""
        loop = asyncio.get_running_loop()
        wakeup = self._wakeup
        assert wakeup is not None
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        conn = 0
        try:
            while True:
                self._step(self._core.handle_timers)
                wakeup.clear()  # set by that step itself; the state is read afresh below, with no await between
                if not self._core.wants_connection:
                    self._driving = False
                    return
                now, current = loop.time(), self._core.connection
                deadline = self._core.next_deadline()
                if writer is not None and current != conn:  # the core left this connection
                    await _closed(writer)
                    reader = writer = None
                if not current:
                    attempt_at = self._core.attempt_at
                    if attempt_at is None or attempt_at > now:
                        await _until(wakeup, deadline, loop)
                    else:
                        reader, writer, conn = await self._attempt()
                    continue
                assert reader is not None
                scope = _timeout(None if deadline is None else max(0.0, deadline - loop.time()))
                try:
                    async with scope:
                        data = await reader.read(1 << 16)
                    reason = "the daemon closed the connection"
                except OSError as exc:  # TimeoutError included: the deadline's, or the connection's own
                    if isinstance(exc, TimeoutError) and scope.expired():
                        continue  # a deadline: the timers run at the top
                    data, reason = b"", f"connection to the daemon failed: {exc or 'timed out'}"
                if data:
                    self._step(functools.partial(self._core.receive_data, conn, data))
                else:
                    self._step(functools.partial(self._core.connection_lost, conn, reason=reason))
                    self._rooms.lost(reason, conn)
                    if self._writer is writer:
                        self._writer = None
        finally:
            if writer is not None:
                if self._core.connection == conn:  # cut short (cancelled): the connection goes with this task
                    self._step(functools.partial(self._core.connection_lost, conn, reason="the client's task ended"))
                    self._rooms.lost("the client's task ended", conn)
                if self._writer is writer:
                    self._writer = None
                await _closed(writer)

    async def _attempt(self) -> tuple[asyncio.StreamReader | None, asyncio.StreamWriter | None, int]:
        loop = asyncio.get_running_loop()
        self._refresh_token()
        limit = self._core.start_attempt(loop.time())
        try:
            async with _timeout(limit):
                if self.address.kind == "unix":
                    reader, writer = await asyncio.open_unix_connection(self.address.path)
                else:
                    reader, writer = await asyncio.open_connection(self.address.host, self.address.port)
        except OSError as exc:  # TimeoutError included
            reason, why = dial_failure(self.address, exc)
            if self._core.state is State.CONNECTING:  # else given up meanwhile
                self._step(lambda now: self._core.connection_failed(now, reason, why))
            return None, None, 0
        except BaseException:  # cancelled: the next supervisor must find no attempt in flight
            if self._core.state is State.CONNECTING:
                self._step(lambda now: self._core.connection_failed(now, "cancelled", Unreachable.BUSY))
            raise
        if self._core.state is not State.CONNECTING:
            await _closed(writer)
            return None, None, 0
        self._writer = writer
        conn = self._step(self._core.connection_made)
        return reader, writer, conn

    # --- offload directives --------------------------------------------------------------

    def _run_directive(self, data: dict[str, Any], connection: int) -> None:
        if self._tasks is not None and self._pool is not None:  # else closed: nothing may move any more
            work = self._carry_out(self._pool, data, connection)
            try:
                self._tasks.create_task(work)
            except RuntimeError:  # the task group is shutting down
                work.close()

    async def _carry_out(
        self, pool: concurrent.futures.ThreadPoolExecutor, data: dict[str, Any], connection: int
    ) -> None:
        """Run one offload directive in the worker thread, then report back on its connection (if still open)."""
        try:
            loop = asyncio.get_running_loop()

            def send(op: str, args: dict[str, Any]) -> None:  # from the worker thread: the core is the loop's
                try:
                    loop.call_soon_threadsafe(
                        self._step, functools.partial(self._core.send, op, args, connection=connection)
                    )
                except RuntimeError:
                    pass  # the loop closed: nobody is left to tell

            answer = await loop.run_in_executor(pool, self._directive, data, connection, send)
        except RuntimeError:
            return  # the pool shut down: closing
        self._step(functools.partial(self._core.send, "offload_done", answer, connection=connection))


async def _until(event: asyncio.Event, deadline: float | None, loop: asyncio.AbstractEventLoop) -> None:
    """Wait for ``event`` or ``deadline`` (loop time), whichever comes first."""
    try:
        async with _timeout(None if deadline is None else max(0.0, deadline - loop.time())):
            await event.wait()
    except TimeoutError:
        pass


async def _closed(writer: asyncio.StreamWriter) -> None:
    """Close a connection and wait, bounded, for its transport to go."""
    writer.close()
    try:
        async with _timeout(CLOSE_S):
            await writer.wait_closed()
    except (OSError, TimeoutError):
        pass


# ``util.compat`` is imported on first use: ``import timesliced`` loads only the client, the wire and
# what they stand on at import time (tests/unit/test_layers.py).


def _timeout(delay: float | None) -> Any:
    """``asyncio.timeout(delay)``, or its backport on Python 3.10."""
    from ..util.compat import timeout

    return timeout(delay)


def _task_group() -> TaskGroup:
    from ..util.compat import TaskGroup

    return TaskGroup()
