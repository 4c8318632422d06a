"""One test body for both client shells: ``Client`` as it is, ``AsyncClient`` behind the same blocking calls.

A test takes the ``shell`` fixture (parametrized ``sync`` / ``async``) and makes its clients with
``shell.client(...)``. The async ones run on an event loop of their own in a background thread,
so the test (and the threads it starts) call them exactly as they call a ``Client``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import socket
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

import timesliced

T = TypeVar("T")
SHELLS = ["sync", "async"]


class LoopThread:
    """An event loop running on a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-client-loop", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def stop(self) -> None:
        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


class AsyncFacade:
    """An ``AsyncClient`` on a ``LoopThread``, called like a ``Client`` (its attributes pass through)."""

    def __init__(self, runner: LoopThread, client: timesliced.AsyncClient) -> None:
        self.runner = runner
        self.inner = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def connect(self) -> None:
        self.runner.run(self.inner.connect())

    def close(self) -> None:
        self.runner.run(self.inner.close())

    def __enter__(self) -> AsyncFacade:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def acquire(self, timeout: float | None = None) -> timesliced.Grant:
        return self.runner.run(self.inner.acquire(timeout))

    def release(self) -> dict[str, Any]:
        return self.runner.run(self.inner.release())

    @contextmanager
    def slice(self, timeout: float | None = None) -> Iterator[timesliced.Grant]:
        """``aslice()``, entered and left on the loop."""
        manager = self.inner.aslice(timeout)
        grant = self.runner.run(manager.__aenter__())
        try:
            yield grant
        except BaseException as exc:
            if not self.runner.run(manager.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self.runner.run(manager.__aexit__(None, None, None))

    def sim_alloc(self, nbytes: int, gpu: int = 0) -> Any:
        return self.runner.run(self.inner.sim_alloc(nbytes, gpu))

    def sim_free(self, region: Any) -> None:
        self.runner.run(self.inner.sim_free(region))

    def status(self) -> dict[str, Any]:
        return self.runner.run(self.inner.status())

    def ping(self) -> None:
        self.runner.run(self.inner.ping())


Any_Client = Any  # a timesliced.Client or an AsyncFacade: the same blocking calls


class Shell:
    """Makes clients of one kind and closes them at the end of the test."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._runner = LoopThread() if kind == "async" else None
        self._made: list[Any_Client] = []

    def client(self, address: str, job: str, group: str = "g", *, connect: bool = False, **kw: Any) -> Any_Client:
        made: Any_Client
        if self._runner is None:
            made = timesliced.Client(job=job, group=group, address=address, **kw)
        else:
            made = AsyncFacade(self._runner, timesliced.AsyncClient(job=job, group=group, address=address, **kw))
        self._made.append(made)
        if connect:
            made.connect()
        return made

    def interrupt_acquire(self, client: Any_Client, after: float) -> None:
        """Start ``client.acquire()`` and interrupt it after ``after`` seconds (the lock must be held elsewhere).

        ``Client``: a ``KeyboardInterrupt`` (SIGINT to the main thread); ``AsyncClient``: its task is cancelled.
        """
        if isinstance(client, AsyncFacade):

            async def cancelled() -> bool:
                task = asyncio.ensure_future(client.inner.acquire())
                await asyncio.sleep(after)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    return True
                return False

            assert client.runner.run(cancelled()), "the acquire was granted before it could be cancelled"
            return
        assert threading.current_thread() is threading.main_thread()
        main = threading.main_thread().ident
        assert main is not None
        timer = threading.Timer(after, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                client.acquire()
        finally:
            timer.join()

    def close(self) -> None:
        for made in self._made:
            try:
                made.close()
            except Exception:
                pass
        if self._runner is not None:
            self._runner.stop()


@contextmanager
def shell_of(kind: str) -> Iterator[Shell]:
    made = Shell(kind)
    try:
        yield made
    finally:
        made.close()


def stale_socket(path: str | Path) -> Path:
    """A socket file with nothing listening on it, as a daemon that was killed leaves behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the file stays; connecting to it is refused
    return path
