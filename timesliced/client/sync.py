"""``Client``: the blocking, thread-safe client for training code, a socket shell around ``ClientSession``."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .. import errors
from ..wire.messages import Reply
from .codec import ClientProtocol, Grant, auth_args, result_of
from .directives import directive_worker
from .protocol import Address, dial_failure, find_token, hello_args, resolve_address
from .session import Answered, Disconnect, Failed, Logged, Output, Pushed, State
from .shell import ShellBase
from .signals import HELD

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

JOIN_S = 5.0  # how long close() waits for the reader thread

Waiter = tuple[int, "_Answer", float | None]  # id, answer, its first deadline


class Client(ShellBase):
    """One job's connection to its node daemon.

    ``Client(job="sql-rl", group="trainer-pool")`` connects on first use (or
    ``connect()``), registers the calling process (plus ``pids``) for the job
    and then serves ``acquire`` / ``release`` / ``slice()``. All methods may be
    called from any thread; threads of one client share its hold on the lock.

    Inside a command launched by ``timesliced run --job J --group G -- CMD``,
    ``Client()`` needs no arguments: the job, group, daemon address, parking
    method and memory declaration come from ``$TIMESLICED_JOB``,
    ``$TIMESLICED_GROUP``, ``$TIMESLICED_ADDRESS``, ``$TIMESLICED_PARK`` and
    ``$TIMESLICED_MEMORY`` (an argument given explicitly wins).

    Over TCP the daemon asks for its shared token: ``token``, else
    ``$TIMESLICED_TOKEN_FILE`` or ``$TIMESLICED_TOKEN`` (``PermissionDenied``
    without one, or with a wrong one).

    When the daemon goes away (a restart, a crash), the client connects again
    for up to ``reconnect`` seconds, registers the job again and re-sends what
    was waiting; a job that held the lock asks for it first, and the restarted
    daemon keeps its turn. It sends a heartbeat every third of the lease that
    the daemon it is connected to announced, so a daemon can tell a quiet client
    from a dead one.

    ``priority`` (an integer, higher first) and ``weight`` (> 0, its share of the
    group's time) are what the group's queue policy reads (``--policy``); the
    job's first registration fixes them.

    ``party``: who this client acts for; by default its process
    (``$TIMESLICED_PARTY`` when set). A process that holds one group and asks
    for another by a single acquire goes before a gang that waits for the group
    it holds (kept behind the gang, neither would ever go on). Give processes
    that hold and ask on each other's behalf (an RL run's trainer and sampler
    actors) one party.

    ``parked_access``: what a simulated region access does while the job is
    preempted (parked by the daemon after its maximum slice, queued again):
    ``"wait"`` until the lock is granted back, or ``"raise"`` ``NotResident``.

    ``memory``: the device memory the job declares it needs on each of its GPUs
    (bytes, or a size string like ``"20GiB"``; or a dict GPU -> size), like a
    Kubernetes request. Jobs whose footprints (the larger of the declaration
    and the peak the daemon measured) plus the daemon's ``--memory-headroom``
    fit a GPU stay resident together, and a handoff between them moves nothing.
    Without it, a job parked by any method but ``sim`` has its GPUs to itself.

    Raises ``ConnectionLost`` when the daemon cannot be reached or does not come
    back, and the typed errors of ``timesliced.errors`` for refusals.

    The logic lives in ``ClientSession``; this shell is a socket, a reader
    thread (which opens connections, reads them and keeps the session's timers)
    and one lock through which every thread hands the session its inputs. A
    caller that waits for an answer on an open connection reads the socket
    itself, so the kernel wakes the waiting thread directly (one thread wake
    per answer instead of two), unless it is the main thread, where a
    signal's exception could land between the read and the core; the reader
    thread reads whenever no caller does, for the daemon's pushes and
    directives.
    """

    def _start_io(self) -> None:
        self._lock = threading.Lock()  # one input at a time into the core; guards _sock, _waiters, _driving
        self._guarded = _Guarded(self._lock)  # the lock as the main thread takes it (``_guard``)
        self._waiters: dict[int, _Answer] = {}
        self._sock: socket.socket | None = None  # the open connection, for sending; the reader owns it
        self._sock_conn = 0  # the core's id of the connection ``_sock`` is
        # Who reads the socket. Bytes are read only under ``_lock``, by a non-blocking recv whose bytes go to
        # the core in the same critical section, so their order holds whoever reads. The reader thread
        # waits in an epoll set that holds the socket; a caller that reads the socket itself takes it out
        # of that set (its events masked) and puts it back when it leaves. epoll_ctl(2) wakes no thread
        # for that, unless the socket holds bytes by then (which the reader thread must read anyway).
        self._caller_reading = 0  # the thread (its ident) that waits on the socket for its answer; 0: none
        self._wakes: _Wakes | None = None  # the reader thread's epoll set and wake-ups, while it runs
        # When the reader thread looks at the core's timers next unless woken (-inf: it is about to look). It
        # keeps the timers (heartbeats above all), and input fed by another thread (a caller that reads the
        # socket) can bring one sooner: the register step arms the heartbeat, say.
        self._reader_until = -math.inf
        self._driving = False  # a reader thread runs (it clears this, under the lock, when it ends)
        self._reader: threading.Thread | None = None
        self._wakeup = threading.Event()  # wakes the reader while it waits between connection attempts
        # One worker: directives run in the order the daemon sent them (a park before its unpark).
        self._directives: concurrent.futures.ThreadPoolExecutor | None = None  # None once closed

    # --- connection ------------------------------------------------------------------

    def connect(self) -> None:
        """Connect, say hello and register the job (idempotent).

        Raises ``ConnectionLost`` at once if there is no daemon. A daemon that is
        restarting (its socket is there but refuses connections after a crash, or it
        goes away during the handshake) is waited for like a reconnection, up to
        ``reconnect`` seconds; the error then says what was found (a socket file
        with nothing listening on it, say).
        """
        self._request(self._core.wait_ready)

    def close(self) -> None:
        """Close the connection; a held lock is released by the daemon. Waiting calls raise ``ConnectionLost``.

        In a process forked from the one that made the client, it only closes this process's copy of
        the socket: the connection, and the lock it may hold, stay the parent's.
        """
        if self._foreign() is not None:
            self._forsake()
            return
        self._step(self._core.close)
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=JOIN_S)
        pool, self._directives = self._directives, None
        self._rooms.lost("the client closed")  # a streamed unpark waiting for room ends (its regions stay parked)
        if pool is not None:
            pool.shutdown(wait=True)  # a park in progress finishes: the job's bytes are in flight

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the lock --------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, gang: str | None = None, members: int = 0) -> Grant:
        """Wait for the group's lock; returns the ``Grant``.

        ``timeout`` bounds the whole call, connecting included: it raises within
        ``timeout`` plus a second. Raises ``AcquireTimeout`` (also while the
        client is reconnecting to a lost daemon), ``ConnectionLost`` when the
        client never got through to a daemon (the message says why: a socket
        file with nothing listening, say), ``JobFaulted`` if the job's state
        could not be restored. An acquire given up on (timeout,
        ``KeyboardInterrupt``) leaves the queue at once; a grant that won the race
        is released.

        ``gang``, ``members``: this acquire is one member of gang ``gang`` of ``members``
        acquires (each of another group, from any process or node), all granted in one step
        or none (``timesliced.gang`` does it for clients of one process). One member that
        stops waiting withdraws the gang: the others raise ``AcquireCancelled``.
        """
        grant: Grant = self._request(functools.partial(self._core.acquire, timeout, gang=gang, members=members))
        return grant

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

    def on_accelerators(self, timeout: float | None = None, *, pass_grant: bool = False) -> Callable[[F], F]:
        """Decorator: every call of the function runs inside ``slice()``.

        ``pass_grant=True``: the function also gets the call's ``Grant`` (its fence, how long it waited,
        whether its state was restored) as the keyword argument ``grant``, which its callers leave out::

            @client.on_accelerators(pass_grant=True)
            def train_step(batch, *, grant):
                log.info("fence %d, waited %.3fs", grant.fence, grant.waited_s)

        Raises what ``acquire`` raises, and what the function raises (the lock is released either way).
        """

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with self.slice(timeout) as grant:
                    if pass_grant:
                        kwargs["grant"] = grant
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

    # --- waiting for the core ----------------------------------------------------------

    def _guard(self) -> _Guarded | threading.Lock:
        """The lock, as this thread takes it: in the main thread with the signals' handlers held (``HELD``).

        A handler there then runs once the lock is let go, never in the middle of a section: it cannot
        cut the core's input from what was read, or a socket's hand-back, and it may call the client.
        """
        return self._guarded if threading.get_ident() == threading.main_thread().ident else self._lock

    def _call(self, op: str, args: dict[str, Any] | None = None) -> Any:
        return self._request(lambda now: self._core.request(op, args, now))

    def _request(self, start: Callable[[float], int]) -> Any:
        """``_submit`` then ``_wait``, with nothing between them that an interrupt could land in unseen."""
        rid = 0
        try:
            rid, future, deadline = self._submit(start)
            return self._follow(rid, future, deadline)
        except errors.TimeslicedError:
            raise  # the request's own answer
        except BaseException:  # KeyboardInterrupt: never leave a ghost waiter
            if rid:
                self._withdraw(rid)
            raise

    def _submit(self, start: Callable[[float], int]) -> Waiter:
        """Hand the core a request (connecting first if need be); returns its id, answer and first deadline.

        Raises ``ConnectionLost`` at once in a process forked from the client's own. Whatever raises
        once ``start`` made the request (a signal's exception in the main thread, say) withdraws it, as
        ``_wait`` does: an acquire is never left to be granted to nobody.
        """
        if (foreign := self._foreign()) is not None:
            raise foreign
        future = _Answer()
        later: list[tuple[_Answer | None, Output]] = []
        rid = 0  # set: the request is made and not withdrawn
        try:
            with self._guard():
                rid = self._core.next_request  # what ``start`` numbers it: no other thread starts one meanwhile
                try:
                    self._waiters[rid] = future
                    made = start(time.monotonic())
                    assert made == rid, (made, rid)
                    self._flush(later)
                    self._ensure_reader()
                    deadline = self._core.deadline_of(rid)
                except BaseException:
                    self._waiters.pop(rid, None)
                    if self._core.next_request > rid:  # it was made (under this lock: by this call)
                        self._core.abandon(rid, time.monotonic())
                        self._flush(later)
                        self._wakeup.set()  # as ``_step``: the reader may wait for an attempt nobody wants now
                    rid = 0  # withdrawn here, or never made
                    raise
            self._dispatch(later)
        except BaseException:
            try:
                if rid:
                    self._withdraw(rid)
            finally:
                self._dispatch(later)  # what is left of it
            raise
        return rid, future, deadline

    def _wait(self, waiter: Waiter) -> Any:
        """The request's result; a caller that stops waiting (KeyboardInterrupt) withdraws it."""
        rid, future, deadline = waiter
        try:
            return self._follow(rid, future, deadline)
        except errors.TimeslicedError:
            raise  # the request's own answer
        except BaseException:  # KeyboardInterrupt: never leave a ghost waiter
            self._withdraw(rid)
            raise

    def _follow(self, rid: int, future: _Answer, deadline: float | None) -> Any:
        """Wait for ``future``; the caller keeps the core's deadline for it (the reader may be busy connecting).

        On an open connection this thread reads the socket itself while it waits (``_read_for``), so the
        answer wakes it directly, not the reader thread first.
        """
        while True:
            self._read_for(future, deadline)
            try:
                return future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self._step(self._core.handle_timers)
            with self._guard():
                deadline = self._core.deadline_of(rid)

    def _withdraw(self, rid: int) -> None:
        """The caller of ``rid`` stopped waiting: the core abandons it (an acquire leaves the queue)."""
        with self._guard():
            self._waiters.pop(rid, None)
        self._step(functools.partial(self._core.abandon, rid))

    def _forsake(self) -> None:
        """In a forked child: let go of the parent's socket here, sending nothing, taking no lock.

        Closing this process's descriptor leaves the connection open (the parent's descriptor still
        refers to it), and ``shutdown`` would end it for the parent too, so it is not called. The
        epoll set is shared with the parent's reader thread, so it is not touched either. The lock may
        have been copied held (another thread of the parent had it): it is not taken.
        """
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _read_for(self, future: _Answer, deadline: float | None) -> None:
        """Read the socket in this thread until ``future`` is answered or ``deadline`` passes.

        Returns at once when there is no open connection or another thread reads it (the reader thread
        or that caller then answers ``future``), and when the connection goes (the reader thread reconnects).
        A call made by the thread that reads, from below its own read (a signal handler, ``on_push``), reads
        too, then wakes the read below it, which looks at its own answer again.

        In the main thread every section under the lock is taken with the signals' handlers held
        (``_guard``), so a ``KeyboardInterrupt`` (or a SIGTERM handler's ``SystemExit``) comes once the bytes
        read are in the core and its outputs in ``later``, which is dispatched whatever raises, and never
        cuts the hand-back of the socket in two. The wait itself (``poll``) is not held: Ctrl-C ends it.
        """
        me = threading.get_ident()
        taken = nested = False  # this call took the socket / reads under a read of its own thread
        sock: socket.socket | None = None
        wakes: _Wakes | None = None
        failed: BaseException | None = None
        try:
            with self._guard():
                sock, conn, wakes = self._sock, self._sock_conn, self._wakes
                if sock is None or wakes is None or self._caller_reading not in (0, me):
                    return
                future.watch(wakes)  # before the look below: an answer set from now on wakes this thread
                if future.settled:
                    return
                if self._caller_reading == me:
                    nested = True
                else:
                    taken = True
                    self._caller_reading = me
                    wakes.watch(sock, False)  # the reader thread stays asleep when the answer comes
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            poller.register(wakes.caller, select.POLLIN)
            while not future.settled:
                wait = None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))
                events = poller.poll(wait)
                if not events:
                    return  # the deadline: the caller keeps the core's timers
                if any(fd == wakes.caller for fd, _ in events):
                    wakes.drain(wakes.caller)
                later: list[tuple[_Answer | None, Output]] = []
                try:
                    with self._guard():
                        if self._sock is not sock:
                            return  # the connection ended or was left
                        self._receive(sock, conn, later)
                        gone = self._core.connection != conn
                        if taken and any(answer is future for answer, _ in later):  # back in this section
                            self._hand_back(future, sock, wakes)
                            taken = False
                finally:
                    self._dispatch(later)
                if gone:
                    return
        except BaseException as exc:
            failed = exc
            raise
        finally:
            late = self._give_back(future, sock, wakes, taken, nested)
            if late is not None and failed is None:
                raise late

    def _give_back(
        self, future: _Answer, sock: socket.socket | None, wakes: _Wakes | None, taken: bool, nested: bool
    ) -> BaseException | None:
        """``_read_for``'s way out: the socket back to the reader thread, whatever raises; returns what raised.

        Tried until it lands: a socket left taken would never be read again by anyone. With nothing to
        give back (the read that brought the answer gave it back in its section) it only stops watching.
        """
        if not taken and not nested:
            future.watch(None)
            return None
        error: BaseException | None = None
        while True:
            try:
                with self._guard():
                    if taken and sock is not None and wakes is not None:  # both set before ``taken``
                        self._hand_back(future, sock, wakes)
                    elif wakes is not None:
                        future.watch(None)
                        wakes.wake(wakes.caller)  # the read below this nested one may have had its answer read here
                return error
            except BaseException as exc:  # a signal's exception before the section began: try again
                error = error or exc

    def _hand_back(self, future: _Answer, sock: socket.socket, wakes: _Wakes) -> None:
        """Under the lock: the socket this thread took goes back to the reader thread (each step can be done again)."""
        future.watch(None)
        if self._caller_reading == threading.get_ident():
            self._caller_reading = 0
            if self._sock is sock:
                wakes.watch(sock, True)  # the reader thread's again, for the pushes
            else:
                wakes.wake(wakes.reader)  # left by the core: the reader thread closes it now

    def _receive(self, sock: socket.socket, conn: int, later: list[tuple[_Answer | None, Output]]) -> None:
        """Under the lock: what the socket holds now into the core (its end too); the outputs into ``later``."""
        try:
            data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            reason = "the daemon closed the connection"
        except BlockingIOError:
            return  # another thread read it first
        except OSError as exc:
            data, reason = b"", f"connection to the daemon failed: {exc}"
        if data:
            self._core.receive_data(conn, data, time.monotonic())
        else:
            self._core.connection_lost(conn, time.monotonic(), reason)
            self._rooms.lost(reason, conn)  # a streamed unpark waiting for room ends (its regions stay parked)
        self._flush(later)

    def _step(self, action: Callable[[float], T]) -> T:
        """One input into the core, then its outputs carried out (all of them, whatever raises)."""
        later: list[tuple[_Answer | None, Output]] = []
        try:
            with self._guard():
                result = action(time.monotonic())
                self._flush(later)
                idle = not self._core.connection
            if idle:
                self._wakeup.set()  # the reader may be waiting for its next attempt: let it look again
        finally:
            self._dispatch(later)
        return result

    def _flush(self, later: list[tuple[_Answer | None, Output]] | None = None) -> list[tuple[_Answer | None, Output]]:
        """Under the lock: send what the core wrote, close what it left, carry out the pushes' rooms and
        directives in the core's order; the rest (answers, pushes, logs) is added to ``later`` for ``_dispatch``.
        """
        if later is None:
            later = []
        try:
            data = self._core.data_to_send()
            if data and self._sock is not None:
                self._sock.sendall(data)
        except OSError:
            self._shutdown()  # the reader sees the connection end and tells the core
        except BaseException:
            # A signal's exception between taking the frames and sending them all: the stream is cut
            # (frames lost, or half a frame sent). The connection ends; the next one re-sends every request.
            self._shutdown()
            raise
        wakes, due = self._wakes, self._core.next_deadline()
        if wakes is not None and due is not None and due < self._reader_until:
            self._reader_until = due
            wakes.wake(wakes.reader)  # a timer came sooner than the reader thread sleeps
        for out in self._core.drain():
            if isinstance(out, Disconnect):
                self._shutdown()
                self._rooms.lost(out.reason, out.connection)  # never read again: its end would not tell the rooms
            elif isinstance(out, (Answered, Failed)):
                if (future := self._waiters.pop(out.rid, None)) is not None:
                    later.append((future, out))
            else:
                if isinstance(out, Pushed):
                    self._directed(out)  # rooms and directives here, in the stream's order
                later.append((None, out))
        return later

    def _dispatch(self, later: list[tuple[_Answer | None, Output]]) -> None:
        """Outside the lock: wake the waiters, then run the user's callbacks and log.

        It gets through the whole list whatever raises (a signal's exception in the main thread, which
        dispatches other threads' answers too): the answers first, since a waiter left unanswered waits
        for ever; then the first error is raised again. It takes what it carried out from ``later``,
        so a caller may hand it what is left again.
        """
        error: BaseException | None = None
        while later:
            try:
                for i, (future, out) in enumerate(later):
                    if future is not None:
                        if not future.settled:  # a pass cut short looks at it again: it is set once
                            if isinstance(out, Answered):
                                future.set_result(out.value)
                            elif isinstance(out, Failed):
                                future.set_exception(out.error)
                        later[i] = (None, out)
                while later:
                    out = later.pop(0)[1]  # taken before it runs: a callback runs at most once
                    if isinstance(out, Pushed):
                        self._pushed(out)
                    elif isinstance(out, Logged):
                        self._logged(out)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def _shutdown(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the reader's select wakes; it closes the socket
            except OSError:
                pass

    # --- the reader thread ---------------------------------------------------------------

    def _ensure_reader(self) -> None:
        """Under the lock: start the reader thread if the core wants a connection and none runs."""
        if self._core.wants_connection and not self._driving:
            self._driving = True
            if self._directives is None:
                self._directives = directive_worker(self.job)
            self._wakes = wakes = _Wakes()
            self._reader = threading.Thread(
                target=self._read_loop, args=(wakes,), name=f"timesliced-{self.job}", daemon=True
            )
            self._reader.start()

    def _read_loop(self, wakes: _Wakes) -> None:
        """Open connections, read them and keep the core's timers, while the core wants a connection.

        One pass per event (bytes read, the connection gone, a deadline, a wake): what was read goes to
        the core first, and its answers to their callers, before the books (timers, the connection's
        state). While a caller reads the socket itself (``_read_for``), the socket is out of this thread's
        epoll set, and this thread keeps the timers; a socket the core left is closed once no caller reads it.
        """
        sock: socket.socket | None = None
        conn = 0
        readable = False  # the last pass found the socket readable
        registered = False  # ``sock`` is in the epoll set
        try:
            while True:
                if readable and sock is not None:  # the answers first: their callers wake while this keeps the books
                    later: list[tuple[_Answer | None, Output]] = []
                    with self._lock:
                        self._reader_until = -math.inf
                        self._receive(sock, conn, later)
                    self._dispatch(later)
                with self._lock:
                    self._reader_until = -math.inf
                    now = time.monotonic()
                    deadline = self._core.next_deadline()
                    if deadline is not None and now >= deadline:
                        self._core.handle_timers(now)
                        deadline = self._core.next_deadline()
                    later = self._flush()
                    self._reader_until = math.inf if deadline is None else deadline
                    done = not self._core.wants_connection
                    current, attempt_at = self._core.connection, self._core.attempt_at
                    leave = sock is not None and (done or current != conn)
                    busy = bool(self._caller_reading)  # a caller reads the socket: it is closed once that caller left
                    if leave and self._sock is sock:
                        self._sock = None
                        if busy:
                            wakes.wake(wakes.caller)  # that caller leaves the socket too
                    if done and not busy:
                        self._driving = False
                        self._wakes = None
                self._dispatch(later)
                readable = False
                if leave and registered:  # out of the set at once: a hang-up would wake this thread again and again
                    assert sock is not None
                    wakes.forget(sock)
                    registered = False
                if leave and not busy:  # the core left this connection, and no caller waits on it
                    assert sock is not None
                    sock.close()
                    sock = None
                if done and not busy:
                    return
                if not current and not busy:
                    if attempt_at is None or attempt_at > now:
                        self._wakeup.wait(None if deadline is None else max(0.0, deadline - now))
                        self._wakeup.clear()
                    else:
                        sock, conn = self._attempt(wakes)
                        registered = sock is not None
                    continue
                for fd, _ in wakes.epoll.poll(None if deadline is None else max(0.0, deadline - time.monotonic())):
                    if fd == wakes.reader:
                        wakes.drain(fd)
                    else:
                        readable = True
        except BaseException:
            log.exception("job %r: the client's reader failed; closing the client", self.job)
            with self._lock:
                self._driving = False
                self._wakes = None
            self._step(self._core.close)  # a caller reading the socket sees it shut, and leaves
            end = time.monotonic() + JOIN_S
            while self._caller_reading and time.monotonic() < end:
                time.sleep(0.01)  # it polls these descriptors: closed under it, their numbers could be reused
        finally:
            if sock is not None:
                sock.close()
            wakes.close()

    def _attempt(self, wakes: _Wakes) -> tuple[socket.socket | None, int]:
        self._refresh_token()  # reads the environment: before the lock
        with self._lock:
            now = time.monotonic()
            due = self._core.attempt_at
            if due is None or due > now:  # closed, given up or re-armed since the reader looked: it looks again
                return None, 0
            limit = self._core.start_attempt(now)
        try:
            sock = _dial(self.address, limit)
        except OSError as exc:
            reason, why = dial_failure(self.address, exc)
            with self._lock:
                if self._core.state is State.CONNECTING:  # else given up meanwhile
                    self._core.connection_failed(time.monotonic(), reason, why)
                later = self._flush()
            self._dispatch(later)
            return None, 0
        with self._lock:
            if self._core.state is not State.CONNECTING:  # given up meanwhile
                sock.close()
                return None, 0
            conn = self._core.connection_made(time.monotonic())
            self._sock, self._sock_conn = sock, conn
            wakes.add(sock)  # with ``_sock``: a caller that finds the one finds the other
            later = self._flush()
        self._dispatch(later)
        return sock, conn

    # --- offload directives --------------------------------------------------------------

    def _run_directive(self, data: dict[str, Any], connection: int) -> None:
        """Under the lock (``_flush``): directives reach the worker in the order the daemon sent them."""
        pool = self._directives
        if pool is not None:  # None once closed: nothing may move after close() returns
            try:
                pool.submit(self._carry_out, data, connection)
            except RuntimeError:
                pass  # closing

    def _carry_out(self, data: dict[str, Any], connection: int) -> None:
        def send(op: str, args: dict[str, Any]) -> None:  # on the directive's own connection, or not at all
            self._step(functools.partial(self._core.send, op, args, connection=connection))

        send("offload_done", self._directive(data, connection, send))


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

        if (auth := auth_args(ask("hello", hello_args()), find_token(token))) is not None:
            ask("auth", auth)
        status: dict[str, Any] = ask("status", {})
    return status


def open_socket(address: Address, timeout: float) -> socket.socket:
    """A connected socket to the daemon (with ``timeout`` set on it); raises ``ConnectionLost``.

    A Unix socket whose accept backlog is momentarily full answers EAGAIN;
    that is retried until ``timeout``.
    """
    try:
        sock = _dial(address, timeout)
    except BlockingIOError:
        raise errors.ConnectionLost(f"the timesliced daemon at {address} is not accepting connections") from None
    except OSError as exc:
        raise errors.ConnectionLost(f"cannot reach the timesliced daemon at {address}: {exc}") from None
    sock.settimeout(timeout)
    return sock


def _dial(address: Address, timeout: float) -> socket.socket:
    """A connected, blocking socket; raises ``OSError`` (``BlockingIOError`` for a backlog full past ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if address.kind == "tcp":
                sock = socket.create_connection((address.host, address.port), timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(timeout)
                    sock.connect(address.path)
                except BaseException:
                    sock.close()
                    raise
            sock.settimeout(None)
            return sock
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class _Guarded:
    """``with``: ``HELD``, then the lock; out: the lock let go, then the held handlers run (they may raise)."""

    __slots__ = ("_lock",)

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        HELD.__enter__()
        try:
            self._lock.acquire()
        except BaseException:
            HELD.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        HELD.__exit__(None, None, None)


class _Wakes:
    """The reader thread's epoll set (its wake-up counter and the socket), and a wake-up counter for a reading caller.

    The counters are eventfds: a write wakes the poller with a plain wake-up (``wake_up_locked_poll`` in
    the kernel's fs/eventfd.c), where a pipe's is a "sync" one (``wake_up_interruptible_sync_poll``,
    fs/pipe.c) that runs the woken thread at once on the writer's CPU, ahead of the writer. Writes are
    refused once closed, and so are reads, so a late wake or drain never touches a file descriptor number
    that was reused.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._closed = False
        # Non-blocking: a read of a zero counter raises BlockingIOError (eventfd(2)); not inherited (PEP 446).
        self.reader = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.caller = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoll = select.epoll()
        self.epoll.register(self.reader, select.EPOLLIN)
        self.watching = False  # the socket is in the set, unmasked

    def add(self, sock: socket.socket) -> None:
        self.epoll.register(sock, select.EPOLLIN)
        self.watching = True

    def watch(self, sock: socket.socket, on: bool) -> None:
        """Under the client's lock: the socket's readiness wakes the reader thread (``on``) or nobody.

        EPOLL_CTL_MOD wakes the waiter only if the socket is ready under its new mask (``ep_modify`` in
        fs/eventpoll.c); a mask of 0 leaves only EPOLLERR and EPOLLHUP, which epoll always reports
        (epoll_ctl(2)): a connection's end still wakes the reader thread, which then takes the socket out.
        """
        with self._guard:
            if not self._closed:
                self.epoll.modify(sock, select.EPOLLIN if on else 0)
                self.watching = on

    def forget(self, sock: socket.socket) -> None:
        self.epoll.unregister(sock)
        self.watching = False

    def wake(self, fd: int) -> None:
        with self._guard:
            if not self._closed:
                os.eventfd_write(fd, 1)

    def drain(self, fd: int) -> None:
        with self._guard:
            if self._closed:
                return  # its number may be another file's by now
            try:
                os.eventfd_read(fd)  # resets the counter to zero
            except BlockingIOError:  # zero already (EAGAIN)
                pass

    def close(self) -> None:
        with self._guard:
            if not self._closed:
                self._closed = True
                self.epoll.close()
                os.close(self.reader)
                os.close(self.caller)


class _Answer:
    """A request's answer, for the one caller that waits for it (lighter than a ``Future``: on the lock's path).

    While its caller reads the socket itself (``watch``), an answer set by another thread also wakes that
    caller through its wake-up counter: the caller waits on the socket, not on this answer.
    """

    __slots__ = ("_done", "_error", "_value", "_watched_by", "_watcher", "settled")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()  # released once the answer is in
        self._value: Any = None
        self._error: BaseException | None = None
        self._watcher: _Wakes | None = None
        self._watched_by = 0  # the thread that reads the socket for this answer
        self.settled = False

    def watch(self, wakes: _Wakes | None) -> None:
        """From the calling thread, which reads the socket for this answer: wake it through ``wakes`` (None: stop)."""
        self._watched_by = threading.get_ident()
        self._watcher = wakes

    def set_result(self, value: Any) -> None:
        self._value = value
        self._settle()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._settle()

    def _settle(self) -> None:
        self.settled = True
        self._done.release()
        watcher = self._watcher  # after the answer is in: a caller that looks after this line sees it
        if watcher is not None and self._watched_by != threading.get_ident():
            watcher.wake(watcher.caller)

    def result(self, timeout: float | None) -> Any:
        """The value, or raises the error; raises ``TimeoutError`` when none came within ``timeout``."""
        if not self._done.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError
        self._done.release()  # a second look (after a timeout's race) finds it again
        if self._error is not None:
            raise self._error
        return self._value
