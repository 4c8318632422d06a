"""A TCP fault-injection proxy for partition tests.

Multi-daemon tests run each directed link "node A dials node B" through its
own ``FaultProxy``: A is told that B lives at the proxy's port, and the proxy
forwards to B's real port. ``ProxyMesh`` holds one proxy per ordered pair of
nodes. Tests drive both from ordinary synchronous code; each proxy runs its own
asyncio loop on a daemon thread, and every control call returns once it is in
effect on that loop.

Faults:

- ``cut("blackhole")``: like a dropped network. Bytes in both directions are
  silently discarded on existing connections (end-of-stream and errors are not
  passed on either); new connections are accepted but never reach the target.
  The peers notice only through their own timeouts.
- ``cut("reset")``: every live connection is reset at once, and new ones are
  reset right after accept.
- ``heal()``: new connections are forwarded again. Connections that lived
  through a blackhole are reset, since their streams lost bytes and must not
  resume; the peers reconnect.

Run as ``python -m tests.fakes.proxy LISTEN_PORT TARGET_HOST:TARGET_PORT`` to
forward until killed (port 0 picks a free port; the first line printed is
``listening on HOST:PORT``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TypeVar

from timesliced.util.compat import TaskGroup, timeout

log = logging.getLogger(__name__)

MODES = ("blackhole", "reset")
CHUNK = 65536
CONNECT_TIMEOUT = 5.0  # the target is on loopback: it answers at once or not at all
CONTROL_TIMEOUT = 10.0  # how long a control call waits for the proxy's loop
T = TypeVar("T")


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close ``writer``'s connection with a TCP reset (SO_LINGER 0), so that the peer sees ECONNRESET."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError as e:
            log.debug("SO_LINGER failed: %s", e)
    writer.transport.abort()


class _Link:
    """One accepted connection and, unless black-holed from the start, its connection to the target."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, blackholed: bool) -> None:
        self.client_reader = reader
        self.client = writer
        self.target: asyncio.StreamWriter | None = None
        # Once True, stays True: a stream that lost bytes is never forwarded again.
        self.blackholed = blackholed
        self.done = asyncio.Event()

    def reset(self) -> None:
        self.done.set()
        _reset(self.client)
        _reset(self.target)

    def close(self) -> None:
        self.done.set()
        for writer in (self.client, self.target):
            if writer is not None:
                writer.close()


class FaultProxy:
    """Forwards TCP connections from a local port to ``target``; can cut and heal the link.

    ``port`` is the bound port once ``start()`` has returned. ``cut``, ``heal``,
    ``connections`` and ``stop`` may be called from any thread.
    """

    def __init__(self, target: tuple[str, int], *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = target
        self.host = host
        self.port = port
        self._mode: str | None = None  # None: forwarding
        self._links: set[_Link] = set()  # live: accepted, neither closed nor dropped
        self._serving: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()  # guards _loop against a stop() racing a control call
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._tasks: TaskGroup | None = None

    def __repr__(self) -> str:
        return f"<FaultProxy {self.host}:{self.port} -> {self.target[0]}:{self.target[1]} mode={self._mode}>"

    # --- control, from the test's thread ----------------------------------------------------

    def start(self) -> FaultProxy:
        """Start the proxy's thread; returns once it listens. Raises ``OSError`` if it cannot bind."""
        if self._thread is not None:
            raise RuntimeError("FaultProxy.start() called twice")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"proxy->{self.target}", daemon=True)
        self._thread.start()
        try:
            ready.result(timeout=CONTROL_TIMEOUT)
        except BaseException:
            self._thread.join(CONTROL_TIMEOUT)
            raise
        return self

    def cut(self, mode: str = "blackhole") -> None:
        """Cut the link: ``"blackhole"`` drops bytes silently, ``"reset"`` resets connections."""
        if mode not in MODES:
            raise ValueError(f"unknown cut mode {mode!r} (want one of {', '.join(MODES)})")
        self._call(lambda: self._cut(mode))

    def heal(self) -> None:
        """Forward new connections again; resets the connections that lived through a blackhole."""
        self._call(self._heal)

    @property
    def mode(self) -> str | None:
        """``"blackhole"`` or ``"reset"`` while cut, None while forwarding."""
        return self._mode

    @property
    def connections(self) -> int:
        """Live accepted connections, forwarded or black-holed."""
        return self._call(lambda: len(self._links))

    def stop(self) -> None:
        """Reset every connection, stop listening and join the thread. Idempotent."""
        with self._lock:
            loop, stopping = self._loop, self._stopping
            self._loop = None
        if loop is not None and stopping is not None:
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop already ended
                pass
        if self._thread is not None:
            self._thread.join(CONTROL_TIMEOUT)
            if self._thread.is_alive():
                log.debug("%r: thread did not end within %.0f s", self, CONTROL_TIMEOUT)

    def __enter__(self) -> FaultProxy:
        return self if self._thread is not None else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the proxy's loop and wait for it; directly when the loop is not running."""
        with self._lock:
            loop = self._loop
            if loop is None:
                return fn()
            result: concurrent.futures.Future[T] = concurrent.futures.Future()

            def run() -> None:
                try:
                    result.set_result(fn())
                except BaseException as e:
                    result.set_exception(e)

            loop.call_soon_threadsafe(run)
        return result.result(timeout=CONTROL_TIMEOUT)

    # --- on the proxy's loop ----------------------------------------------------------------

    def _cut(self, mode: str) -> None:
        self._mode = mode
        for link in list(self._links):
            if mode == "reset":
                self._drop(link)
            else:
                link.blackholed = True

    def _heal(self) -> None:
        self._mode = None
        for link in list(self._links):
            if link.blackholed:
                self._drop(link)

    def _drop(self, link: _Link) -> None:
        """Reset ``link`` now; its task ends on its own (both its streams see end of stream)."""
        self._links.discard(link)
        link.reset()

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            asyncio.run(self._main(ready))
        except BaseException as e:  # never raise from the thread; start() reports a failure to bind
            if not ready.done():
                ready.set_exception(e)
            log.debug("%r ended with %r", self, e)

    async def _main(self, ready: concurrent.futures.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: log.debug("%r: %s", self, context.get("message")))
        self._stopping = asyncio.Event()
        # Bound before the task group exists, so that a failure to bind reaches start() as a plain OSError.
        server = await asyncio.start_server(self._accepted, self.host, self.port, start_serving=False)
        async with TaskGroup() as tasks:
            self._tasks = tasks
            try:
                await server.start_serving()
                self.port = server.sockets[0].getsockname()[1]
                with self._lock:
                    self._loop = loop
                ready.set_result(None)
                log.debug("%r listening", self)
                await self._stopping.wait()
            finally:
                with self._lock:
                    self._loop = None
                server.close()
                for link in list(self._links):
                    self._drop(link)
                for task in list(self._serving):  # including dropped links still connecting to the target
                    task.cancel()
        await server.wait_closed()
        log.debug("%r stopped", self)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._mode == "reset" or self._tasks is None:
            _reset(writer)
            return
        link = _Link(reader, writer, blackholed=self._mode == "blackhole")
        try:
            task = self._tasks.create_task(self._serve(link))
        except RuntimeError:  # the task group is closing: the proxy is stopping
            _reset(writer)
            return
        self._links.add(link)
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, link: _Link) -> None:
        graceful = False
        target_reader: asyncio.StreamReader | None = None
        try:
            if not link.blackholed:
                try:
                    async with timeout(CONNECT_TIMEOUT):
                        target_reader, link.target = await asyncio.open_connection(*self.target)
                except (OSError, TimeoutError) as e:
                    log.debug("%r: cannot reach the target: %s", self, e)
                    return
            if link.done.is_set():  # reset or stopped while connecting
                return
            async with TaskGroup() as pumps:
                pumps.create_task(self._pump(link, link.client_reader, link.target))
                if target_reader is not None:
                    pumps.create_task(self._pump(link, target_reader, link.client))
            graceful = True
        except Exception as e:
            log.debug("%r: connection failed: %r", self, e)
        finally:
            self._links.discard(link)
            if graceful and not link.blackholed:
                link.close()
            else:
                link.reset()

    async def _pump(self, link: _Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter | None) -> None:
        """Copy ``source`` to ``sink`` until end of stream; discard while the link is black-holed."""
        try:
            while data := await source.read(CHUNK):
                if link.blackholed or sink is None:
                    continue
                sink.write(data)
                await sink.drain()
            if not link.blackholed and sink is not None:
                if sink.can_write_eof():
                    sink.write_eof()  # pass the half-close on
                return
        except OSError as e:
            log.debug("%r: %s", self, e)
            if not link.blackholed:
                link.reset()
                return
        # A dropped network carries no end-of-stream and no reset either: wait for heal or stop.
        await link.done.wait()


class ProxyMesh:
    """One ``FaultProxy`` per ordered pair of nodes, with helpers to partition them.

    ``real`` maps each node id to the address its daemon really listens on.
    """

    def __init__(self, real: dict[str, tuple[str, int]]) -> None:
        self.real = dict(real)
        self.proxies = {(src, dst): FaultProxy(self.real[dst]) for src in self.real for dst in self.real if src != dst}

    def start(self) -> ProxyMesh:
        try:
            for proxy in self.proxies.values():
                proxy.start()
        except BaseException:
            self.stop()
            raise
        return self

    def proxy(self, src: str, dst: str) -> FaultProxy:
        """The proxy that carries ``src`` dialling ``dst``. Raises ``ValueError`` for an unknown pair."""
        try:
            return self.proxies[(src, dst)]
        except KeyError:
            raise ValueError(f"no link {src!r} -> {dst!r} (nodes: {', '.join(sorted(self.real))})") from None

    def address(self, src: str, dst: str) -> tuple[str, int]:
        """Where ``src`` must dial ``dst``: the proxy's address (a node dials itself directly)."""
        if src == dst and src in self.real:
            return self.real[src]
        proxy = self.proxy(src, dst)
        return (proxy.host, proxy.port)

    def peers_arg(self, src: str) -> str:
        """The ``--peers`` value for node ``src``: its own real address, and the proxies for the others."""
        entries = []
        for node in sorted(self.real):
            host, port = self.address(src, node)
            entries.append(f"{node}=[{host}]:{port}" if ":" in host else f"{node}={host}:{port}")
        return ",".join(entries)

    def cut(self, src: str, dst: str, mode: str = "blackhole") -> None:
        self.proxy(src, dst).cut(mode)

    def heal(self, src: str, dst: str) -> None:
        self.proxy(src, dst).heal()

    def isolate(self, node: str, mode: str = "blackhole") -> None:
        """Cut every link to and from ``node``."""
        if node not in self.real:
            raise ValueError(f"unknown node {node!r} (nodes: {', '.join(sorted(self.real))})")
        self._cut_all(((s, d) for s, d in self.proxies if node in (s, d)), mode)

    def partition(self, *sides: Iterable[str], mode: str = "blackhole") -> None:
        """Cut every link between nodes on different ``sides``; nodes on no side stay connected to all."""
        side_of: dict[str, int] = {}
        for number, side in enumerate(sides):
            for node in side:
                if node not in self.real or node in side_of:
                    raise ValueError(f"node {node!r} is unknown or on two sides")
                side_of[node] = number
        self._cut_all(
            ((s, d) for s, d in self.proxies if s in side_of and d in side_of and side_of[s] != side_of[d]), mode
        )

    def cut_links(self) -> set[tuple[str, str]]:
        """The ``(src, dst)`` pairs that are cut now."""
        return {pair for pair, proxy in self.proxies.items() if proxy.mode is not None}

    def heal_all(self) -> None:
        for proxy in self.proxies.values():
            proxy.heal()

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()

    def __enter__(self) -> ProxyMesh:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _cut_all(self, pairs: Iterable[tuple[str, str]], mode: str) -> None:
        for pair in list(pairs):
            self.proxies[pair].cut(mode)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1].count(":") < 1:
        print("usage: python -m tests.fakes.proxy LISTEN_PORT TARGET_HOST:TARGET_PORT", file=sys.stderr)
        return 2
    host, _, port = argv[1].rpartition(":")
    stopped = threading.Event()
    # Before the first line is printed: whoever reads it may send SIGTERM at once.
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    proxy = FaultProxy((host.strip("[]"), int(port)), port=int(argv[0])).start()
    print(f"listening on {proxy.host}:{proxy.port}", flush=True)
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
