"""``Client``: the blocking, thread-safe client for training code."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .. import errors
from ..backends.base import ParkSpec
from ..wire.messages import Push, Reply
from .directives import OffloadExecutor, directive_worker, run_directive
from .protocol import (
    Address,
    ClientProtocol,
    Grant,
    acquire_args,
    hello_args,
    register_args,
    resolve_address,
    result_of,
)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

REPLY_GRACE_S = 30.0  # how long past its own timeout an acquire waits for the daemon's answer


class Client:
    """One job's connection to its node daemon.

    ``Client(job="sql-rl", group="trainer-pool")`` connects on first use (or
    ``connect()``), registers the calling process (plus ``pids``) for the job
    and then serves ``acquire`` / ``release`` / ``slice()``. All methods may be
    called from any thread; threads of one client share its hold on the lock.

    Raises ``ConnectionLost`` when the daemon cannot be reached or goes away,
    and the typed errors of ``timesliced.errors`` for refusals.
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
        self._lock = threading.Lock()  # guards the socket's send side, _pending and _proto ids
        self._connect_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proto = ClientProtocol()
        self._pending: dict[int, concurrent.futures.Future[Reply]] = {}
        self._abandoned: set[int] = set()  # acquires given up on: a late grant is released
        self._reader: threading.Thread | None = None
        self._lost: errors.TimeslicedError | None = None
        # One worker: directives run in the order the daemon sent them (a park before its unpark).
        self._directives: concurrent.futures.ThreadPoolExecutor | None = None  # while connected

    # --- connection ------------------------------------------------------------------

    def connect(self) -> None:
        """Connect, say hello and register the job (idempotent)."""
        with self._connect_lock:
            if self._sock is not None:
                if self._lost is not None:
                    raise self._lost
                return
            sock = open_socket(self.address, self.connect_timeout)
            sock.settimeout(None)
            self._sock = sock
            self._lost = None
            if self._directives is None:
                self._directives = directive_worker(self.job)
            self._proto = ClientProtocol()
            self._reader = threading.Thread(target=self._read_loop, name=f"timesliced-{self.job}", daemon=True)
            self._reader.start()
        try:
            self._call("hello", hello_args())
            reg = self._call("register", self._register)
        except BaseException:
            self.close()
            raise
        self.session = reg["session"]
        self.gpus = list(reg["gpus"])

    def close(self) -> None:
        """Close the connection; a held lock is released by the daemon."""
        with self._connect_lock:
            sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        pool, self._directives = self._directives, None
        if pool is not None:
            pool.shutdown(wait=True)  # a park in progress finishes: the job's bytes are in flight

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the lock --------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> Grant:
        """Wait for the group's lock; returns the ``Grant``.

        Raises ``AcquireTimeout`` after ``timeout`` seconds, ``JobFaulted`` if
        the job's state could not be restored, ``ConnectionLost``.
        """
        self._ensure_connected()
        rid, future = self._send("acquire", acquire_args(timeout))
        wait = None if timeout is None else timeout + REPLY_GRACE_S
        try:
            reply = future.result(wait)
        except concurrent.futures.TimeoutError:
            self._abandon(rid)
            raise errors.AcquireTimeout("the daemon did not answer the acquire in time") from None
        except BaseException:  # KeyboardInterrupt, ConnectionLost: never leave a ghost waiter
            self._abandon(rid)
            raise
        return Grant.from_wire(result_of(reply))

    def release(self) -> dict[str, Any]:
        """Yield the lock (``yield`` is a keyword). Raises ``NotHolder`` if not held."""
        result: dict[str, Any] = self._call("release")
        return result

    @contextmanager
    def slice(self, timeout: float | None = None) -> Iterator[Grant]:
        """``with client.slice(): ...`` holds the lock for the block, released on exceptions too."""
        grant = self.acquire(timeout)
        try:
            yield grant
        except BaseException:
            try:
                self.release()
            except errors.TimeslicedError as exc:
                log.warning("release after a failed slice failed too: %s", exc)
            raise
        self.release()

    def on_accelerators(self, timeout: float | None = None) -> Callable[[F], F]:
        """Decorator: every call of the function runs inside ``slice()``."""

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with self.slice(timeout):
                    return fn(*args, **kwargs)

            return wrapper  # type: ignore[return-value]

        return decorate

    # --- simulated device memory -----------------------------------------------------

    def sim_alloc(self, nbytes: int, gpu: int = 0) -> Any:
        """Allocate ``nbytes`` of simulated device memory on ``gpu``; returns a ``SimRegion``.

        Raises ``OutOfMemory`` when it does not fit (idle jobs are parked first
        to make room), ``NotResident`` if this job's state is parked.
        """
        from ..backends.sim_layout import RegionInfo, SimRegion

        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError("nbytes must be a positive integer")
        return SimRegion.open(RegionInfo.from_wire(self._call("sim_alloc", {"nbytes": nbytes, "gpu": gpu})))

    def sim_free(self, region: Any) -> None:
        rid = region if isinstance(region, int) else region.region
        self._call("sim_free", {"region": rid})
        if not isinstance(region, int):
            region.close()

    # --- other requests --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("status")
        return result

    def ping(self) -> None:
        self._call("ping")

    # --- plumbing --------------------------------------------------------------------

    def _ensure_connected(self) -> None:
        if self._sock is None:
            self.connect()

    def _call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        if op not in ("hello", "register"):
            self._ensure_connected()
        _, future = self._send(op, args)
        try:
            reply = future.result(self.request_timeout)
        except concurrent.futures.TimeoutError:
            raise errors.ConnectionLost(f"the daemon did not answer {op!r} within {self.request_timeout}s") from None
        return result_of(reply)

    def _send(
        self, op: str, args: dict[str, Any] | None, track: bool = True
    ) -> tuple[int, concurrent.futures.Future[Reply]]:
        future: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._sock is None:
                raise errors.ConnectionLost("the client is closed")
            rid, frame = self._proto.request(op, args)
            if track:  # an untracked request's reply is dropped on arrival
                self._pending[rid] = future
            try:
                self._sock.sendall(frame)
            except OSError as exc:
                self._pending.pop(rid, None)
                raise errors.ConnectionLost(f"lost the daemon while sending {op!r}: {exc}") from None
        return rid, future

    def _abandon(self, rid: int) -> None:
        """Withdraw an acquire we stopped waiting for; a grant that wins the race is released."""
        with self._lock:
            self._abandoned.add(rid)
            self._pending.pop(rid, None)
        try:
            self._send("cancel", {"request": rid}, track=False)
        except errors.TimeslicedError:
            pass  # no connection: the daemon drops our place in the queue by itself

    def _carry_out(self, data: dict[str, Any]) -> None:
        """Run one offload directive off the reader thread, then report back."""
        answer = run_directive(self.offloader, data)
        try:
            self._send("offload_done", answer, track=False)
        except errors.TimeslicedError:
            pass  # the daemon saw the connection close and gave up on the directive

    def _read_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        error: errors.TimeslicedError = errors.ConnectionLost("the daemon closed the connection")
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    break
                for message in self._proto.receive(data):
                    self._dispatch(message)
        except errors.TimeslicedError as exc:
            error = exc
        except OSError as exc:
            error = errors.ConnectionLost(f"connection to the daemon failed: {exc}")
        with self._lock:
            self._lost = error
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def _dispatch(self, message: Reply | Push) -> None:
        if isinstance(message, Push):
            if message.event == "faulted":
                self.faulted = str(message.data.get("reason", "faulted"))
            elif message.event == "offload":
                pool = self._directives
                if pool is not None:  # None once closed: nothing may move after close() returns
                    try:
                        pool.submit(self._carry_out, message.data)
                    except RuntimeError:
                        pass  # closing
            if self.on_push is not None:
                try:
                    self.on_push(message.event, message.data)
                except Exception:
                    log.exception("on_push callback failed")
            return
        with self._lock:
            future = self._pending.pop(message.id, None)
            abandoned = message.id in self._abandoned
            self._abandoned.discard(message.id)
        if abandoned and message.ok:
            try:
                self._send("release", None, track=False)  # a grant nobody waits for any more
            except errors.TimeslicedError:
                pass
        elif future is not None and not future.done():
            future.set_result(message)


def daemon_status(address: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """The status of a daemon, without registering a job (``timesliced status``)."""
    proto = ClientProtocol()
    with open_socket(resolve_address(address), timeout) as sock:
        results: list[Any] = []
        for op, args in (("hello", hello_args()), ("status", {})):
            rid, frame = proto.request(op, args)
            sock.sendall(frame)
            reply: Reply | None = None
            while reply is None:
                data = sock.recv(1 << 16)
                if not data:
                    raise errors.ConnectionLost("the daemon closed the connection")
                reply = next((m for m in proto.receive(data) if isinstance(m, Reply) and m.id == rid), None)
            results.append(result_of(reply))
    status: dict[str, Any] = results[-1]
    return status


def open_socket(address: Address, timeout: float) -> socket.socket:
    """A connected socket to the daemon; raises ``ConnectionLost``.

    A Unix socket whose accept backlog is momentarily full answers EAGAIN;
    that is retried until ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if address.kind == "tcp":
                sock = socket.create_connection((address.host, address.port), timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(address.path)
            except BaseException:
                sock.close()
                raise
            return sock
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise errors.ConnectionLost(
                    f"the timesliced daemon at {address} is not accepting connections"
                ) from None
            time.sleep(0.01)
        except OSError as exc:
            raise errors.ConnectionLost(f"cannot reach the timesliced daemon at {address}: {exc}") from None
