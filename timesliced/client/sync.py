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
from ..wire.messages import Push, Reply
from ..wire.park import ParkSpec
from .directives import OffloadExecutor, directive_worker, run_directive
from .protocol import (
    Address,
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
F = TypeVar("F", bound=Callable[..., Any])

REPLY_GRACE_S = 30.0  # how long past its own timeout an acquire waits for the daemon's answer


class Client:
    """One job's connection to its node daemon.

    ``Client(job="sql-rl", group="trainer-pool")`` connects on first use (or
    ``connect()``), registers the calling process (plus ``pids``) for the job
    and then serves ``acquire`` / ``release`` / ``slice()``. All methods may be
    called from any thread; threads of one client share its hold on the lock.

    Over TCP the daemon asks for its shared token: ``token``, else
    ``$TIMESLICED_TOKEN_FILE`` or ``$TIMESLICED_TOKEN`` (``PermissionDenied``
    without one, or with a wrong one).

    When the daemon goes away (a restart, a crash), the client connects again
    for up to ``reconnect`` seconds, registers the job again and re-sends what
    was waiting; a job that held the lock asks for it first, and the restarted
    daemon keeps its turn. It sends a heartbeat every third of the daemon's lease,
    so a daemon can tell a quiet client from a dead one.

    ``parked_access``: what a simulated region access does while the job is
    preempted (parked by the daemon after its maximum slice, queued again):
    ``"wait"`` until the lock is granted back, or ``"raise"`` ``NotResident``.

    Raises ``ConnectionLost`` when the daemon cannot be reached or does not come
    back, and the typed errors of ``timesliced.errors`` for refusals.
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
        self._lease: float | None = None  # the daemon's, from its hello
        self._ready = threading.Event()  # connected and registered: requests may go out
        self._closing = False
        self._reached = False  # the last connection attempt reached a daemon
        self._heartbeats = 0  # heartbeat threads started (the latest one runs)
        self._requests: dict[int, tuple[str, dict[str, Any] | None]] = {}  # pending rid -> what to re-send
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
        """Connect, say hello and register the job (idempotent).

        Raises ``ConnectionLost`` at once if there is no daemon. A daemon that is
        restarting (its socket is there but refuses connections after a crash, or it
        goes away during the handshake) is waited for like a reconnection.
        """
        deadline = time.monotonic() + self.reconnect
        delay = 0.05
        reached = False
        while True:
            try:
                self._connect_once()
                return
            except errors.ConnectionLost:
                reached |= self.session is not None or self._reached or self._socket_left()
                if not reached or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _socket_left(self) -> bool:
        """A daemon that was killed leaves its socket file behind; one that stopped removes it."""
        return self.address.kind == "unix" and os.path.exists(self.address.path)

    def _connect_once(self) -> None:
        self._reached = False
        with self._connect_lock:
            if self._sock is not None:
                if self._lost is not None:
                    raise self._lost
                return
            sock = open_socket(self.address, self.connect_timeout)
            self._reached = True
            sock.settimeout(None)
            self._sock = sock
            self._lost = None
            self._closing = False
            if self._directives is None:
                self._directives = directive_worker(self.job)
            self._proto = ClientProtocol()
            self._reader = threading.Thread(target=self._read_loop, name=f"timesliced-{self.job}", daemon=True)
            self._reader.start()
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise
        self._ready.set()
        if self._lease:
            self._heartbeats += 1  # a thread of an earlier connect() (closed since) sees this and ends
            name = f"timesliced-heartbeat-{self.job}"
            threading.Thread(target=self._heartbeat, args=(self._heartbeats,), name=name, daemon=True).start()

    def _handshake(self) -> None:
        """Hello, the token proof over TCP, and the job's registration, on a new connection."""
        hello = self._call("hello", hello_args(), ready=False)
        if (auth := auth_args(hello, self._token)) is not None:
            self._call("auth", auth, ready=False)
        reg = self._call("register", self._register, ready=False)
        self.session = reg["session"]
        self.gpus = list(reg["gpus"])
        self._lease = lease_of(hello)

    @property
    def faulted(self) -> str | None:
        """Why the job is faulted (its state could not be moved), or None."""
        return self.lock.faulted

    @property
    def preempted(self) -> str | None:
        """Why, while the job waits to be granted again after the daemon preempted it; else None."""
        return self.lock.preempted

    def close(self) -> None:
        """Close the connection; a held lock is released by the daemon."""
        with self._connect_lock:
            self._closing = True
            self._ready.clear()
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
        grant = Grant.from_wire(result_of(reply))
        self.lock.granted()
        return grant

    def release(self) -> dict[str, Any]:
        """Yield the lock (``yield`` is a keyword). Raises ``NotHolder`` if not held."""
        result: dict[str, Any] = self._call("release")
        self.lock.released()
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
        from ..sim.layout import RegionInfo
        from ..sim.region import SimRegion

        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError("nbytes must be a positive integer")
        region = SimRegion.open(RegionInfo.from_wire(self._call("sim_alloc", {"nbytes": nbytes, "gpu": gpu})))
        if self.parked_access == "wait":
            region.hold = lambda: self.lock.preempted is not None
        return region

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

    def _call(self, op: str, args: dict[str, Any] | None = None, *, ready: bool = True) -> Any:
        """``ready=False``: part of the handshake, sent before the connection is ready."""
        if ready:
            self._ensure_connected()
        _, future = self._send(op, args, ready=ready)
        try:
            reply = future.result(self.request_timeout)
        except concurrent.futures.TimeoutError:
            raise errors.ConnectionLost(f"the daemon did not answer {op!r} within {self.request_timeout}s") from None
        return result_of(reply)

    def _send(
        self, op: str, args: dict[str, Any] | None, track: bool = True, *, ready: bool = True
    ) -> tuple[int, concurrent.futures.Future[Reply]]:
        future: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        if ready and self._sock is not None and not self._ready.is_set():
            # connecting or reconnecting: requests wait for the handshake, which goes first
            self._ready.wait(self.reconnect + self.connect_timeout + self.request_timeout)
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._sock is None:
                raise errors.ConnectionLost("the client is closed")
            rid, frame = self._proto.request(op, args)
            if track:  # an untracked request's reply is dropped on arrival
                self._pending[rid] = future
                if ready:  # re-sent after a reconnection (a handshake is not: it belongs to its connection)
                    self._requests[rid] = (op, args)
            if ready and not self._ready.is_set():
                return rid, future  # the connection is being replaced: a tracked request goes with the resumption
            try:
                self._sock.sendall(frame)
            except OSError as exc:
                if ready and self.reconnect > 0 and self.session is not None and not self._closing:
                    return rid, future  # the reader sees the loss too; the request is re-sent once reconnected
                self._pending.pop(rid, None)
                self._requests.pop(rid, None)
                raise errors.ConnectionLost(f"lost the daemon while sending {op!r}: {exc}") from None
        return rid, future

    def _abandon(self, rid: int) -> None:
        """Withdraw an acquire we stopped waiting for; a grant that wins the race is released."""
        with self._lock:
            self._abandoned.add(rid)
            self._pending.pop(rid, None)
            self._requests.pop(rid, None)
        try:
            self._send("cancel", {"request": rid}, track=False)
        except errors.TimeslicedError:
            pass  # no connection: the daemon drops our place in the queue by itself

    def _carry_out(self, data: dict[str, Any]) -> None:
        """Run one offload directive off the reader thread, then report back."""
        answer = run_directive(self.offloader, data)
        try:
            self._send("offload_done", answer, track=False, ready=False)
        except errors.TimeslicedError:
            pass  # the daemon saw the connection close and gave up on the directive

    def _read_loop(self) -> None:
        sock = self._sock
        while sock is not None:
            error = self._read_until_lost(sock)
            lost = isinstance(error, errors.ConnectionLost)
            if self._closing or not lost or self.reconnect <= 0 or self.session is None:
                break
            sock = self._reconnect(sock, error)
            if sock is None:
                error = errors.ConnectionLost(f"the daemon did not come back within {self.reconnect:g}s: {error}")
                break
        else:
            return
        with self._lock:
            self._lost = error
            pending, self._pending = self._pending, {}
            self._requests.clear()
        self._ready.set()  # wakes requests waiting for a reconnection: they raise ``_lost``
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def _read_until_lost(self, sock: socket.socket) -> errors.TimeslicedError:
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    return errors.ConnectionLost("the daemon closed the connection")
                for message in self._proto.receive(data):
                    self._dispatch(message)
        except errors.TimeslicedError as exc:
            return exc
        except OSError as exc:
            return errors.ConnectionLost(f"connection to the daemon failed: {exc}")

    def _reconnect(self, old: socket.socket, why: errors.TimeslicedError) -> socket.socket | None:
        """Connect again (backing off), register again and re-send what waits; None if the daemon is gone.

        Runs on the reader thread, so nothing else reads the new connection until it
        is ready; requests from other threads wait for ``_ready``.
        """
        self._ready.clear()
        log.warning("job %r lost its daemon (%s); reconnecting for up to %gs", self.job, why.message, self.reconnect)
        deadline = time.monotonic() + self.reconnect
        delay = 0.05
        while not self._closing and time.monotonic() < deadline:
            try:
                sock = open_socket(self.address, max(0.1, min(self.connect_timeout, deadline - time.monotonic())))
            except errors.TimeslicedError:
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            with self._lock:
                if self._sock is not old:  # closed meanwhile
                    sock.close()
                    return None
                self._sock = sock
                self._proto.new_connection()
                self._abandoned.clear()
            old.close()
            old = sock
            try:
                self._resume(sock)
            except errors.ConnectionLost as exc:  # gone again: try again
                log.warning("job %r: the daemon went away again while resuming (%s)", self.job, exc.message)
                continue
            except errors.TimeslicedError as exc:  # refused (the job is faulted, say): give up
                log.error("job %r cannot resume on the restarted daemon: %s", self.job, exc)
                return None
            self.reconnects += 1
            return sock
        return None

    def _resume(self, sock: socket.socket) -> None:
        """Hello and register on the new connection; take the lock back if it was held; re-send the rest."""
        sock.settimeout(self.connect_timeout)
        hello = self._ask(sock, "hello", hello_args())
        if (auth := auth_args(hello, self._token)) is not None:
            self._ask(sock, "auth", auth)
        reg = self._ask(sock, "register", self._register)
        self.session, self.gpus = reg["session"], list(reg["gpus"])
        sock.settimeout(self.request_timeout)
        if self.lock.holding:  # the restarted daemon kept our turn: we are granted first
            grant = Grant.from_wire(self._ask(sock, "acquire", acquire_args(None)))
            log.info("job %r holds group %r again (fence %d)", self.job, grant.group, grant.fence)
        sock.settimeout(None)
        with self._lock:  # nothing else is sent until these are, and then the connection is ready
            frames = [self._proto.frame(rid, op, args) for rid, (op, args) in sorted(self._requests.items())]
            try:
                for frame in frames:  # same ids: the answers reach the original waiters
                    sock.sendall(frame)
            except OSError as exc:
                raise errors.ConnectionLost(f"lost the daemon while re-sending requests: {exc}") from None
            self._ready.set()

    def _ask(self, sock: socket.socket, op: str, args: dict[str, Any]) -> Any:
        """One request on a connection nobody else reads yet; pushes that come meanwhile are handled."""
        with self._lock:
            rid, frame = self._proto.request(op, args)
        try:
            sock.sendall(frame)
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    raise errors.ConnectionLost(f"the daemon closed the connection during {op!r}")
                for message in self._proto.receive(data):
                    if isinstance(message, Reply) and message.id == rid:
                        return result_of(message)
                    self._dispatch(message)
        except OSError as exc:
            raise errors.ConnectionLost(f"lost the daemon during {op!r}: {exc}") from None

    def _heartbeat(self, generation: int) -> None:
        """Tell the daemon we are alive, every third of its lease, until ``close()`` (reconnections included)."""
        while self._lease and not self._closing and generation == self._heartbeats:
            time.sleep(self._lease / 3)
            if self._sock is None or self._closing or generation != self._heartbeats:
                return
            if self._ready.is_set():
                try:
                    self._send("ping", None, track=False)
                except errors.TimeslicedError:
                    pass

    def _dispatch(self, message: Reply | Push) -> None:
        if isinstance(message, Push):
            self.lock.on_push(message.event, message.data)
            if message.event == "offload":
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
            self._requests.pop(message.id, None)
            abandoned = message.id in self._abandoned
            self._abandoned.discard(message.id)
        if abandoned and message.ok:
            try:
                self._send("release", None, track=False)  # a grant nobody waits for any more
            except errors.TimeslicedError:
                pass
        elif future is not None and not future.done():
            future.set_result(message)


def daemon_status(
    address: str | os.PathLike[str] | None = None, timeout: float = 10.0, token: str | None = None
) -> dict[str, Any]:
    """The status of a daemon, without registering a job (``timesliced status``).

    Over TCP it proves the token like ``Client``; raises ``PermissionDenied`` without it.
    """
    proto = ClientProtocol()
    with open_socket(resolve_address(address), timeout) as sock:

        def ask(op: str, args: dict[str, Any]) -> Any:
            rid, frame = proto.request(op, args)
            sock.sendall(frame)
            reply: Reply | None = None
            while reply is None:
                data = sock.recv(1 << 16)
                if not data:
                    raise errors.ConnectionLost("the daemon closed the connection")
                reply = next((m for m in proto.receive(data) if isinstance(m, Reply) and m.id == rid), None)
            return result_of(reply)

        if (auth := auth_args(ask("hello", hello_args()), token)) is not None:
            ask("auth", auth)
        status: dict[str, Any] = ask("status", {})
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
