"""The client's session core: one job's connection to its node daemon, as a state machine (pure).

No sockets, asyncio, threads, clock or logging. Every input carries ``now`` (a
monotonic time in seconds, from one clock per session), and the outputs are
buffered for the shell:

- ``data_to_send()``: the bytes to write on the open connection;
- ``drain()``: what happened, in order: ``Answered`` / ``Failed`` (a waiter's
  request is done: resolve its future), ``Pushed`` (a push of the daemon, for
  ``on_push`` and offload directives), ``Logged`` (a line for the log) and
  ``Disconnect`` (close the open connection; the core has already left it, so
  its ``connection_lost`` is ignored).

The shell's side of the contract:

- callers hand in requests (``request``, ``acquire``, ``wait_ready``), each
  with an id their waiter is keyed by, and call ``abandon(rid)`` when they stop
  waiting (cancellation, ``KeyboardInterrupt``). A caller waits no longer than
  ``deadline_of(rid)`` and then calls ``handle_timers(now)``, which fails what
  is due; asking early is harmless. A request made while no connection is
  wanted (``IDLE``, ``CLOSED``) starts connecting.
- one driver opens connections and moves bytes: while ``wants_connection``, in
  ``WAITING`` it calls ``start_attempt(now)`` at ``attempt_at`` (the timeout
  for the attempt comes back) and reports ``connection_made`` (which numbers
  the connection) or ``connection_failed`` with why: a socket file with nothing
  listening (``Unreachable.STALE``) is worded as such. Connected, it feeds
  every byte read to ``receive_data(connection, ...)`` and reports
  ``connection_lost(connection, ...)``; it calls ``handle_timers(now)`` at
  ``next_deadline()``. Reports about a connection that is no longer the open
  one are ignored, so a shell needs no lock between its threads and the core
  beyond calling it one input at a time.

What the core keeps: request ids (they keep growing across connections, so a
request re-sent after a reconnection keeps its id and its waiter), the pending
requests and the connection they were last sent on, acquires given up on (a
grant that comes for one anyway is released), the handshake (hello, the token
proof over TCP, register, then the lock again if the job held it), the
heartbeat cadence from the lease that the latest hello announced, the backoff
and the window (``reconnect`` seconds) within which a lost daemon is waited
for, and ``LockState``.

Allowed moves are the table ``TRANSITIONS``: an input that is not in it for
the current state raises ``ValueError`` (a request in ``LOST`` raises the
error the session was lost with) and changes nothing, outputs included.

Timeouts, from the caller's side:

- ``acquire(timeout=T)`` gives up ``T + GRACE_S`` after it was made, whatever
  the connection is doing (the daemon is asked with what is left of ``T``, so
  its own answer normally comes first): ``AcquireTimeout``, or
  ``ConnectionLost`` saying why when the client never got through to the daemon;
- any other request: ``request_timeout`` after it went out on the open connection;
- connecting: a first connection fails at once when nothing is there, and
  otherwise (a socket file that refuses, a daemon lost during the handshake,
  a registered client's lost daemon) tries again, backing off, for
  ``reconnect`` seconds; a first connection nobody waits for any more stops.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..wire.codec import DEFAULT_MAX_FRAME
from ..wire.messages import MAX_REQUEST_ID, Push, Reply
from .codec import ClientProtocol, Grant, acquire_args, lease_of

GRACE_S = 1.0  # past its timeout, how long an acquire waits for the daemon's own answer
FIRST_DELAY_S = 0.05  # backoff between connection attempts: doubles up to MAX_DELAY_S
MAX_DELAY_S = 1.0
MIN_ATTEMPT_S = 0.1  # the shortest time an attempt is given, even at the end of the window

# the numeric levels of the logging module, for ``Logged``
INFO, WARNING, ERROR = 20, 30, 40


class State(enum.Enum):
    IDLE = "idle"  # no connection wanted: never used, or the first connection failed
    WAITING = "waiting"  # between attempts: the shell starts the next one at ``attempt_at``
    CONNECTING = "connecting"  # the shell is opening a connection
    HELLO = "hello"  # connected, the hello sent
    AUTH = "auth"  # the token proof sent (TCP)
    REGISTER = "register"  # the job's registration sent
    REACQUIRE = "reacquire"  # registered again after a reconnection, asking for the lock the job held
    READY = "ready"  # requests go out as they come
    LOST = "lost"  # the daemon did not come back, or refused the job on a reconnection: requests raise ``error``
    CLOSED = "closed"  # closed by the user; a request connects afresh


class Input(enum.Enum):
    REQUEST = "request"  # request, acquire, wait_ready
    ABANDON = "abandon"
    SEND = "send"  # an untracked request (an offload directive's answer)
    START_ATTEMPT = "start_attempt"
    CONNECTION_MADE = "connection_made"
    CONNECTION_FAILED = "connection_failed"
    RECEIVE_DATA = "receive_data"
    CONNECTION_LOST = "connection_lost"
    TIMERS = "handle_timers"
    CLOSE = "close"


class Unreachable(enum.Enum):
    """Why an attempt to connect failed, as far as the shell can tell."""

    ABSENT = "absent"  # nothing there (no socket file, TCP refused or timed out): a first connection fails at once
    STALE = "stale"  # connection refused and the socket file exists: a daemon that died (or is restarting)
    BUSY = "busy"  # the socket file exists but the attempt failed otherwise (a full backlog, a timeout)


S, In = State, Input
_QUIET = (In.REQUEST, In.ABANDON, In.SEND, In.TIMERS)  # the inputs every state takes; alone they change no state
_MAY_STAY = (In.ABANDON, In.TIMERS, In.RECEIVE_DATA)  # a row listing one of these may also stay where it is
_GONE = {S.WAITING, S.IDLE, S.LOST}  # where a connection cut short leads: try again, or give up
_MOVES: dict[State, dict[Input, set[State]]] = {
    S.IDLE: {In.REQUEST: {S.WAITING}},
    S.CLOSED: {In.REQUEST: {S.WAITING}},
    S.WAITING: {In.ABANDON: {S.IDLE}, In.TIMERS: {S.IDLE}, In.START_ATTEMPT: {S.CONNECTING}},
    S.CONNECTING: {
        In.ABANDON: {S.IDLE},
        In.TIMERS: {S.IDLE},
        In.CONNECTION_MADE: {S.HELLO},
        In.CONNECTION_FAILED: _GONE,
    },
    S.HELLO: {
        In.ABANDON: {S.IDLE},
        In.TIMERS: _GONE,
        In.RECEIVE_DATA: {S.AUTH, S.REGISTER, *_GONE},
        In.CONNECTION_LOST: _GONE,
    },
    S.AUTH: {In.ABANDON: {S.IDLE}, In.TIMERS: _GONE, In.RECEIVE_DATA: {S.REGISTER, *_GONE}, In.CONNECTION_LOST: _GONE},
    S.REGISTER: {
        In.ABANDON: {S.IDLE},
        In.TIMERS: _GONE,
        In.RECEIVE_DATA: {S.REACQUIRE, S.READY, *_GONE},
        In.CONNECTION_LOST: _GONE,
    },
    # only on a reconnection: the job was registered before, so it is never IDLE again before a close
    S.REACQUIRE: {
        In.TIMERS: {S.WAITING, S.LOST},
        In.RECEIVE_DATA: {S.READY, S.WAITING, S.LOST},
        In.CONNECTION_LOST: {S.WAITING, S.LOST},
    },
    S.READY: {In.RECEIVE_DATA: {S.WAITING, S.LOST}, In.CONNECTION_LOST: {S.WAITING, S.LOST}},
    S.LOST: {},
}
# state -> input -> the states it may lead to (staying is allowed where listed). An input missing is refused:
# LOST takes no request (each raises the error it was lost with), and only WAITING starts an attempt.
TRANSITIONS: dict[State, dict[Input, frozenset[State]]] = {
    state: {
        **{i: frozenset({state}) for i in _QUIET if not (state is S.LOST and i is In.REQUEST)},
        **{i: frozenset(targets | ({state} if i in _MAY_STAY else set())) for i, targets in row.items()},
        In.CLOSE: frozenset({S.CLOSED}),
    }
    for state, row in _MOVES.items()
}


# --- outputs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Answered:
    """Request ``rid`` succeeded: ``value`` is its result (a ``Grant`` for an acquire, None for ``wait_ready``)."""

    rid: int
    value: Any


@dataclass(frozen=True)
class Failed:
    """Request ``rid`` failed: its caller raises ``error``."""

    rid: int
    error: errors.TimeslicedError


@dataclass(frozen=True)
class Pushed:
    """The daemon pushed ``event`` on ``connection``: for ``on_push``, and an ``offload`` directive for the executor.

    A directive belongs to the connection it came on: its rooms and its answers go with that
    connection, never with a later one (whose daemon may number its own directives alike).
    """

    event: str
    data: dict[str, Any]
    connection: int


@dataclass(frozen=True)
class Logged:
    level: int  # a logging level: INFO, WARNING, ERROR
    message: str


@dataclass(frozen=True)
class Disconnect:
    """Close the open connection, ``connection`` (the core has already left it)."""

    reason: str
    connection: int


Output = Answered | Failed | Pushed | Logged | Disconnect


# --- what the client knows of its hold ------------------------------------------------


@dataclass
class LockState:
    """What a client knows of its hold on the lock, from its own calls and the daemon's pushes."""

    job: str
    holding: bool = False  # granted and not released: a reconnection asks for the lock back first
    preempted: str | None = None  # why, while it waits to be granted again after a preemption
    faulted: str | None = None

    def on_push(self, event: str, data: dict[str, Any]) -> None:
        if event == "faulted":
            self.faulted = str(data.get("reason", "faulted"))
        elif event == "resumed":  # an operator cleared the fault
            self.faulted = None
        elif event == "preempted":
            self.preempted = str(data.get("reason", "preempted"))
        elif event == "granted":
            self.preempted = None
        elif event == "lock_lost":
            self.holding, self.preempted = False, None

    def granted(self) -> None:
        self.holding = True

    def released(self) -> None:
        self.holding, self.preempted = False, None


@dataclass
class _Pending:
    """A request a caller waits for."""

    op: str  # "" for a waiter on the connection itself (``wait_ready``)
    args: dict[str, Any] | None = None
    timeout: float | None = None  # an acquire's
    give_up_at: float | None = None  # an acquire with a timeout: when its caller gives up (less GRACE_S)
    sent_on: int = 0  # the connection it last went out on; 0: not sent yet
    sent_at: float = 0.0


class ClientSession:
    """The pure core of ``Client`` and ``AsyncClient``; see the module docstring for the contract.

    ``register`` (the job's registration) and ``hello`` are the args of those
    requests; ``register`` is read at every registration. ``auth`` turns the
    daemon's hello into the args of the token proof, or None when it set no
    challenge; it may raise ``TimeslicedError`` (no token), which fails the
    connection like a refusal.
    """

    def __init__(
        self,
        job: str,
        register: dict[str, Any],
        hello: dict[str, Any],
        *,
        address: str,
        auth: Callable[[Any], dict[str, Any] | None] = lambda _hello: None,
        reconnect: float = 60.0,
        connect_timeout: float = 10.0,
        request_timeout: float = 60.0,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self.job = job
        self.register = register
        self.hello = hello
        self.address = address
        self.auth = auth
        self.reconnect = reconnect
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.lock = LockState(job)
        self.session: int | None = None  # the daemon's number for the latest registration
        self.gpus: list[int] = []
        self.reconnects = 0
        self.lease: float | None = None  # announced by the latest hello

        self._state = S.IDLE
        self._input: Input | None = None  # the input being handled, for the transition checks
        self._error: errors.TimeslicedError | None = None  # LOST's
        self._proto = ClientProtocol(max_frame)
        self._out = bytearray()
        self._outputs: list[Output] = []
        self._pending: dict[int, _Pending] = {}
        self._abandoned: set[int] = set()  # acquires sent on the open connection and given up
        self._fresh_grant: int | None = None  # the acquire whose grant took the lock, while it is held
        self._conn = 0  # the open connection's number; 0: none
        self._conns = 0  # connections made
        self._step: tuple[int, str, float] | None = None  # the handshake request waited for: id, op, deadline
        self._heartbeat_at: float | None = None  # when a ping is due, while the connection counts for the lease
        self._registered = False  # registered at least once since the last close: losing it is a reconnection
        self._resuming = False  # this connection replaces a registered one
        self._reached = False  # a connection was made since connecting began
        self._window_end = 0.0  # connecting: no attempt starts after this
        self._attempt_at = 0.0  # WAITING: when the next attempt is due
        self._delay = FIRST_DELAY_S
        self._failure = ""  # why the last attempt failed or the last connection ended

    # --- queries ----------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def error(self) -> errors.TimeslicedError | None:
        """What every request raises while ``LOST``."""
        return self._error

    @property
    def connection(self) -> int:
        """The open connection's number (from ``connection_made``), 0 when none is open."""
        return self._conn

    @property
    def next_request(self) -> int:
        """The id the next request will get: a shell knows it before ``request``/``acquire`` returns it."""
        return self._proto.peek_id()

    @property
    def wants_connection(self) -> bool:
        """Whether the shell's driver has work: connecting, connected, or waiting to try again."""
        return self._state not in (S.IDLE, S.LOST, S.CLOSED)

    @property
    def attempt_at(self) -> float | None:
        """In ``WAITING``: when the shell should call ``start_attempt``."""
        return self._attempt_at if self._state is S.WAITING else None

    def deadline_of(self, rid: int) -> float | None:
        """When the caller of request ``rid`` should call ``handle_timers``; None: no deadline for now."""
        pending = self._pending.get(rid)
        return None if pending is None else self._deadline(pending)

    def next_deadline(self) -> float | None:
        """The earliest time the core needs the shell: an attempt due, a timer to handle."""
        times = [d for p in self._pending.values() if (d := self._deadline(p)) is not None]
        if self._state is S.WAITING:
            times.append(self._attempt_at)
        if self._step is not None:
            times.append(self._step[2])
        if self._heartbeat_at is not None:
            times.append(self._heartbeat_at)
        return min(times, default=None)

    def pending(self) -> list[int]:
        """The ids of the requests waited for, in order."""
        return sorted(self._pending)

    def check_invariants(self) -> None:
        """What holds between any two inputs (the tests call this after every step)."""
        connected = self._state in (S.HELLO, S.AUTH, S.REGISTER, S.REACQUIRE, S.READY)
        assert bool(self._conn) == connected, (self._state, self._conn)
        assert (self._error is not None) == (self._state is S.LOST)
        assert (self._step is not None) == (self._state in (S.HELLO, S.AUTH, S.REGISTER, S.REACQUIRE))
        counted = self._state in (S.REGISTER, S.REACQUIRE, S.READY)  # past hello: the daemon counts its lease
        assert (self._heartbeat_at is not None) == (counted and self.lease is not None)
        if self._state in (S.IDLE, S.LOST, S.CLOSED):
            assert not self._pending and not self._abandoned
        for pending in self._pending.values():
            assert pending.sent_on in (0, self._conn)
            assert bool(pending.sent_on) == (self._state is S.READY and bool(pending.op)), (self._state, pending)
        assert not self._abandoned & set(self._pending)
        if self._state is S.WAITING:
            assert self._attempt_at <= self._window_end
        if self._state is S.REACQUIRE:
            assert self._registered and self.lock.holding
        if self._fresh_grant is not None:
            assert self.lock.holding

    # --- outputs ----------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out, self._out = bytes(self._out), bytearray()
        return out

    def drain(self) -> list[Output]:
        out, self._outputs = self._outputs, []
        return out

    # --- inputs from callers --------------------------------------------------------------

    def request(self, op: str, args: dict[str, Any] | None, now: float) -> int:
        """A request its caller waits for; returns its id. Raises ``ValueError``, ``FrameTooLarge``."""
        if not isinstance(op, str) or not op:
            raise ValueError("op must be a non-empty string")
        frame = self._proto.frame(self._proto.peek_id(), op, args)  # too large a frame is refused now
        self._accept(In.REQUEST)
        return self._submit(_Pending(op, args), now, frame)

    def acquire(self, timeout: float | None, now: float, gang: str | None = None, members: int = 0) -> int:
        """Ask for the lock; the caller gives up ``timeout + GRACE_S`` from ``now``. Raises ``ValueError``.

        ``gang``, ``members``: this acquire is one member of a gang of ``members``, granted with the
        others or not at all (every member gives the same ``gang``).
        """
        args = acquire_args(timeout, gang, members)
        del args["timeout"]  # what is left of it is sent each time
        self._accept(In.REQUEST)
        give_up_at = None if timeout is None else now + timeout
        return self._submit(_Pending("acquire", args or None, timeout=timeout, give_up_at=give_up_at), now)

    def wait_ready(self, now: float) -> int:
        """A waiter answered (with None) once the connection is ready: ``connect()``."""
        self._accept(In.REQUEST)
        return self._submit(_Pending(""), now)

    def abandon(self, rid: int, now: float) -> None:
        """The caller of ``rid`` stopped waiting: an acquire leaves the queue, a grant that won the race goes back.

        A request already answered is ignored, except the acquire whose grant took
        the lock: while no other acquire waits, that lock is released. A release
        given up on leaves the lock to the daemon: a reconnection does not ask for it.
        """
        self._accept(In.ABANDON)
        pending = self._pending.pop(rid, None)
        if pending is None:
            if rid == self._fresh_grant and self.lock.holding and not self._acquiring():
                self._give_back(now)
            return
        if pending.op == "acquire" and pending.sent_on and pending.sent_on == self._conn:
            self._abandoned.add(rid)
            self._send_untracked("cancel", {"request": rid}, now)
        elif pending.op == "release":  # whether or not it went out, the job no longer counts on the lock
            self.lock.released()
            self._fresh_grant = None
        self._stop_if_unwanted()

    def send(self, op: str, args: dict[str, Any] | None, now: float, *, connection: int = 0) -> None:
        """A request nobody waits for (its reply is dropped); dropped itself unless registered on a connection.

        ``connection``: only on that connection (a directive's answer, on the connection the directive
        came on: once that one is gone, its daemon failed the directive already); 0: on the open one.
        """
        if not isinstance(op, str) or not op:
            raise ValueError("op must be a non-empty string")
        self._proto.frame(MAX_REQUEST_ID, op, args)
        self._accept(In.SEND)
        if self._state in (S.REACQUIRE, S.READY) and connection in (0, self._conn):
            self._send_untracked(op, args, now)

    def close(self, now: float) -> None:
        """Close the session: the open connection goes, every waiter fails with ``ConnectionLost``."""
        self._accept(In.CLOSE)
        if self._state is S.CLOSED:
            return
        self._disconnect("the client is closed")
        self._fail_all(errors.ConnectionLost("the client is closed"))
        self._move(S.CLOSED)
        self._error = None
        self._registered = self._reached = False
        self.lock.released()  # the daemon releases a held lock when the connection closes
        self._fresh_grant = None

    # --- inputs from the connection ---------------------------------------------------------

    def start_attempt(self, now: float) -> float:
        """The shell opens a connection now; returns how long the attempt may take. Refused unless one is due."""
        if self._state is S.WAITING and now < self._attempt_at:
            raise ValueError(f"no connection attempt is due before {self._attempt_at}")
        self._accept(In.START_ATTEMPT)
        self._move(S.CONNECTING)
        return max(MIN_ATTEMPT_S, min(self.connect_timeout, self._window_end - now))

    def connection_made(self, now: float) -> int:
        """The attempt connected; returns the connection's number. The hello goes out."""
        self._accept(In.CONNECTION_MADE)
        self._conns += 1
        self._conn = self._conns
        self._proto.new_connection()
        self._out.clear()
        self._reached = True
        self._resuming = self._registered
        self._move(S.HELLO)
        self._ask("hello", self.hello, now, self.connect_timeout)
        return self._conn

    def connection_failed(self, now: float, reason: str, why: Unreachable = Unreachable.ABSENT) -> None:
        """The attempt failed (``reason``: the OS's words)."""
        self._accept(In.CONNECTION_FAILED)
        self._failure = (
            f"the socket {self.address} exists but nothing listens on it (a daemon that died?): "
            f"start the daemon, or remove the stale socket file {self.address}"
            if why is Unreachable.STALE
            else reason
        )
        self._try_again(now, worth_it=why is not Unreachable.ABSENT)

    def receive_data(self, connection: int, data: bytes, now: float) -> None:
        """Bytes read from ``connection``; ignored when it is no longer the open one."""
        if connection != self._conn or not connection:
            return
        self._accept(In.RECEIVE_DATA)
        messages, error = self._proto.receive_until_error(data)
        for message in messages:
            self._on_message(message, now)
            if self._conn != connection:
                return  # the connection ended on this message (a refusal): the rest is moot
        if error is not None:
            self._disconnect(f"the daemon closed the connection: {error.message}")
            if isinstance(error, errors.ConnectionLost):  # a lease that expired, say: connect again
                self._lost(now, error.message)
            else:
                self._refused(error, now)

    def connection_lost(self, connection: int, now: float, reason: str) -> None:
        """``connection`` ended; ignored when it is no longer the open one."""
        if connection != self._conn or not connection:
            return
        self._accept(In.CONNECTION_LOST)
        self._forget_connection()
        self._lost(now, reason)

    def handle_timers(self, now: float) -> None:
        """Fail the requests whose callers give up, end a handshake that stalls, send a heartbeat when due."""
        self._accept(In.TIMERS)
        for rid, pending in list(self._pending.items()):
            deadline = self._deadline(pending)
            if deadline is not None and now >= deadline:
                self._give_up(rid, pending, now)
        if self._step is not None and now >= self._step[2]:
            _, op, _ = self._step
            self._disconnect(f"no answer to {op!r}")
            self._lost(now, f"the daemon did not answer {op!r} within {self._step_timeout(op):g}s")
        if self._heartbeat_at is not None and now >= self._heartbeat_at:
            self._send_untracked("ping", None, now)
        self._stop_if_unwanted()

    # --- the machine ---------------------------------------------------------------------

    def _accept(self, event: Input) -> None:
        """Refuse ``event`` unless the table has it for the current state; every check on the args comes first."""
        if event in TRANSITIONS[self._state]:
            self._input = event
            return
        if self._state is S.LOST and event is In.REQUEST:
            assert self._error is not None
            raise self._error
        raise ValueError(f"{event.value} is refused in state {self._state.value}")

    def _move(self, to: State) -> None:
        assert self._input is not None
        assert to in TRANSITIONS[self._state][self._input], f"{self._state} -{self._input}-> {to} is not in the table"
        self._state = to

    def _emit(self, output: Output) -> None:
        self._outputs.append(output)

    def _log(self, level: int, message: str) -> None:
        self._emit(Logged(level, message))

    def _submit(self, pending: _Pending, now: float, frame: bytes | None = None) -> int:
        """``frame``: the request's, already made with the id it gets here (re-made if it waits)."""
        if self._state in (S.IDLE, S.CLOSED):  # connect on first use: the window opens now
            self._move(S.WAITING)
            self._window_end, self._attempt_at, self._delay = now + self.reconnect, now, FIRST_DELAY_S
            self._failure, self._reached = "", False  # a new window: what the last one reached counts no more
        rid = self._proto.next_id()
        if self._state is S.READY and not pending.op:
            self._emit(Answered(rid, None))
            return rid
        self._pending[rid] = pending
        if self._state is S.READY:
            self._send(rid, pending, now, frame)
        return rid

    def _deadline(self, pending: _Pending) -> float | None:
        if pending.op == "acquire":
            return None if pending.give_up_at is None else pending.give_up_at + GRACE_S
        if pending.op and pending.sent_on and pending.sent_on == self._conn:
            return pending.sent_at + self.request_timeout
        return None  # waiting for the connection: the window decides

    def _acquiring(self) -> bool:
        return any(p.op == "acquire" for p in self._pending.values())

    def _write(self, frame: bytes, now: float) -> None:
        if not self._conn:
            return  # nothing to write on: the connection just went
        self._out += frame
        if self._heartbeat_at is not None and self.lease is not None:
            self._heartbeat_at = now + self.lease / 3  # any bytes tell the daemon we are alive

    def _send(self, rid: int, pending: _Pending, now: float, frame: bytes | None = None) -> None:
        if frame is None:
            args = pending.args
            if pending.op == "acquire":  # what is left of the caller's timeout (and the gang it is a member of)
                left = None if pending.give_up_at is None else max(0.0, pending.give_up_at - now)
                args = {"timeout": left, **(pending.args or {})}
            frame = self._proto.frame(rid, pending.op, args)
        self._write(frame, now)
        pending.sent_on, pending.sent_at = self._conn, now

    def _send_untracked(self, op: str, args: dict[str, Any] | None, now: float) -> None:
        _, frame = self._proto.request(op, args)
        self._write(frame, now)

    def _ask(self, op: str, args: dict[str, Any], now: float, timeout: float) -> None:
        """A handshake request; its reply moves the handshake on (``_on_step``)."""
        rid, frame = self._proto.request(op, args)
        self._step = (rid, op, now + timeout)
        self._write(frame, now)

    def _step_timeout(self, op: str) -> float:
        return self.request_timeout if op == "acquire" else self.connect_timeout

    def _give_up(self, rid: int, pending: _Pending, now: float) -> None:
        del self._pending[rid]
        self._emit(Failed(rid, self._timeout_error(pending)))
        if pending.op == "acquire" and pending.sent_on and pending.sent_on == self._conn:
            self._abandoned.add(rid)
            self._send_untracked("cancel", {"request": rid}, now)

    def _timeout_error(self, pending: _Pending) -> errors.TimeslicedError:
        if pending.op != "acquire":
            return errors.ConnectionLost(f"the daemon did not answer {pending.op!r} within {self.request_timeout:g}s")
        if pending.sent_on and pending.sent_on == self._conn:
            return errors.AcquireTimeout("the daemon did not answer the acquire in time")
        if not self._registered:
            return errors.ConnectionLost(self._unreachable())
        return errors.AcquireTimeout(
            f"the lock was not granted within {pending.timeout:g}s: the client is reconnecting to the daemon"
            f" at {self.address} ({self._failure})"
        )

    def _unreachable(self, within: float | None = None) -> str:
        """Why a first connection did not get through, for its waiters."""
        where = f"the timesliced daemon at {self.address}" + ("" if within is None else f" within {within:g}s")
        if self._state in (S.HELLO, S.AUTH, S.REGISTER) and self._step is not None:
            return f"{where} took the connection but has not answered {self._step[1]!r}"
        return f"cannot reach {where}: {self._failure or 'no connection yet'}"

    def _stop_if_unwanted(self) -> None:
        """A first connection that nobody waits for any more stops (a reconnection goes on regardless)."""
        connecting = (S.WAITING, S.CONNECTING, S.HELLO, S.AUTH, S.REGISTER)
        if self._state in connecting and not self._registered and not self._pending:
            self._disconnect("nobody waits for the connection any more")
            self._move(S.IDLE)

    def _try_again(self, now: float, *, worth_it: bool) -> None:
        """After a failed attempt or a handshake cut short: back off and try again, or give up."""
        if (worth_it or self._reached or self._registered) and now < self._window_end:
            self._move(S.WAITING)
            self._attempt_at = min(now + self._delay, self._window_end)
            self._delay = min(2 * self._delay, MAX_DELAY_S)
            return
        if self._registered:
            within = f"the daemon did not come back within {self.reconnect:g}s: " if self.reconnect > 0 else ""
            self._lose(errors.ConnectionLost(within + self._failure))
        else:
            error = errors.ConnectionLost(self._unreachable(self.reconnect if worth_it or self._reached else None))
            self._fail_all(error)
            self._move(S.IDLE)

    def _lost(self, now: float, reason: str) -> None:
        """The open connection is gone (the shell's report, a closing error, a stalled handshake)."""
        was_ready = self._state is S.READY
        self._failure = reason
        if not was_ready:
            if self._resuming:
                self._log(WARNING, f"job {self.job!r}: the daemon went away again while resuming ({reason})")
            self._try_again(now, worth_it=True)
            return
        self._window_end = now + self.reconnect
        if self.reconnect <= 0:
            self._lose(errors.ConnectionLost(reason))
            return
        self._log(WARNING, f"job {self.job!r} lost its daemon ({reason}); reconnecting for up to {self.reconnect:g}s")
        self._move(S.WAITING)
        self._attempt_at, self._delay = now, FIRST_DELAY_S

    def _refused(self, error: errors.TimeslicedError, now: float) -> None:
        """The daemon refused this connection's handshake (or the token was missing): no point trying again."""
        self._disconnect(f"refused: {error.message}")
        if self._registered:
            self._log(ERROR, f"job {self.job!r} cannot resume on the restarted daemon: {error.message}")
            self._lose(error)
        else:
            self._fail_all(error)
            self._move(S.IDLE)

    def _lose(self, error: errors.TimeslicedError) -> None:
        self._disconnect(error.message)
        self._move(S.LOST)
        self._error = error
        self._fail_all(error)

    def _fail_all(self, error: errors.TimeslicedError) -> None:
        for rid in sorted(self._pending):
            self._emit(Failed(rid, error))
        self._pending.clear()

    def _disconnect(self, reason: str) -> None:
        if self._conn:
            self._emit(Disconnect(reason, self._conn))
            self._forget_connection()

    def _forget_connection(self) -> None:
        self._conn = 0
        self._out.clear()
        self._step = self._heartbeat_at = None
        self._abandoned.clear()
        for pending in self._pending.values():
            pending.sent_on = 0

    def _give_back(self, now: float) -> None:
        """Release a grant that nobody waits for any more."""
        if self._state in (S.REACQUIRE, S.READY):
            self._send_untracked("release", None, now)
        self.lock.released()
        self._fresh_grant = None

    # --- what the daemon sends ------------------------------------------------------------

    def _on_message(self, message: Reply | Push, now: float) -> None:
        if isinstance(message, Push):
            self._on_push(message)
            return
        if self._step is not None and message.id == self._step[0]:
            self._step = None
            self._on_step(message, now)
            return
        pending = self._pending.pop(message.id, None)
        if pending is not None:
            self._answer(message.id, pending, message)
        elif message.id in self._abandoned:
            self._abandoned.discard(message.id)
            if message.ok and not self.lock.holding and not self._acquiring():
                self._send_untracked("release", None, now)  # a grant nobody waits for any more
        # else: the reply to an untracked request (ping, cancel, an offload answer): dropped

    def _answer(self, rid: int, pending: _Pending, reply: Reply) -> None:
        if not reply.ok:
            assert reply.error is not None
            self._emit(Failed(rid, reply.error))
            return
        value = reply.result
        if pending.op == "acquire":
            try:
                value = Grant.from_wire(reply.result)
            except errors.ProtocolError as exc:
                self._emit(Failed(rid, exc))
                return
            if not self.lock.holding:
                self._fresh_grant = rid
            self.lock.granted()
        elif pending.op == "release":
            self.lock.released()
            self._fresh_grant = None
        self._emit(Answered(rid, value))

    def _on_step(self, reply: Reply, now: float) -> None:
        if not reply.ok:
            assert reply.error is not None
            self._refused(reply.error, now)
            return
        if self._state is S.HELLO:
            self.lease = lease_of(reply.result)  # the latest daemon's lease sets the heartbeat
            try:
                proof = self.auth(reply.result)
            except errors.TimeslicedError as exc:
                self._refused(exc, now)
                return
            if proof is None:
                self._register_step(now)
            else:
                self._move(S.AUTH)
                self._ask("auth", proof, now, self.connect_timeout)
        elif self._state is S.AUTH:
            self._register_step(now)
        elif self._state is S.REGISTER:
            try:
                session, gpus = int(reply.result["session"]), [int(g) for g in reply.result["gpus"]]
            except (KeyError, TypeError, ValueError):
                self._refused(errors.ProtocolError(f"malformed registration from daemon: {reply.result!r}"), now)
                return
            self.session, self.gpus, self._registered = session, gpus, True
            if self.lock.holding:  # the restarted daemon kept our turn: we are granted first
                self._move(S.REACQUIRE)
                self._ask("acquire", {"timeout": None}, now, self.request_timeout)
            else:
                self._ready(now)
        elif self._state is S.REACQUIRE:
            try:
                grant = Grant.from_wire(reply.result)
            except errors.ProtocolError as exc:
                self._refused(exc, now)
                return
            self._log(INFO, f"job {self.job!r} holds group {grant.group!r} again (fence {grant.fence})")
            self._ready(now)

    def _register_step(self, now: float) -> None:
        self._move(S.REGISTER)
        if self.lease is not None:  # the daemon counts this connection for the lease from now on
            self._heartbeat_at = now
        self._ask("register", self.register, now, self.connect_timeout)

    def _ready(self, now: float) -> None:
        self._move(S.READY)
        if self._resuming:
            self.reconnects += 1
        self._resuming = False
        self._delay, self._failure = FIRST_DELAY_S, ""
        for rid in sorted(self._pending):  # same ids: the answers reach the original waiters
            pending = self._pending[rid]
            if pending.op:
                self._send(rid, pending, now)
            else:
                del self._pending[rid]
                self._emit(Answered(rid, None))

    def _on_push(self, push: Push) -> None:
        self.lock.on_push(push.event, push.data)
        if push.event in ("preempted", "slice_overdue", "move_failed"):
            self._log(WARNING, f"job {self.job!r}: {push.data.get('reason', push.event.replace('_', ' '))}")
        if push.event == "lock_lost":
            self._fresh_grant = None
        self._emit(Pushed(push.event, push.data, self._conn))
