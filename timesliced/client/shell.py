"""What ``Client`` and ``AsyncClient`` share around their session core: configuration, what they show, pushes, logs.

Each shell adds only its I/O: how it waits, moves bytes and runs offload
directives (``_start_io`` and ``_run_directive``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from .. import errors
from ..wire.park import ParkSpec
from .codec import auth_args
from .directives import OffloadExecutor, Rooms, run_directive
from .protocol import find_token, hello_args, member, register_args, resolve_address
from .session import ClientSession, LockState, Logged, Pushed

log = logging.getLogger("timesliced.client")

_NOT_YET = errors.PermissionDenied("the token is read before the client connects over TCP")


class _Process:
    """This process's id, kept by a fork hook, so a client's check on every call makes no system call."""

    pid = os.getpid()


def _forked() -> None:
    _Process.pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


class ShellBase:
    """The constructor and the read-only view of a client; see ``Client`` for the arguments.

    ``job``, ``group``, ``address``, ``gpus``, ``park``, ``memory``, ``priority`` and ``weight`` left
    out (None) come from the environment where it has them: ``timesliced run`` sets
    ``$TIMESLICED_ADDRESS``, ``$TIMESLICED_JOB``, ``$TIMESLICED_GROUP`` and the rest for the command it
    launches, so ``Client()`` needs no arguments there (``protocol.member``). Raises ``ValueError``
    when neither names the job and group, or a variable is malformed.

    ``gpus``: the GPUs of the job's group as the node numbers them (NVML's
    indices, as ``nvidia-smi`` and ``timesliced status`` show them), ``None``
    for the daemon's choice, or ``"visible"`` for every GPU this process's
    CUDA sees, however ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``
    number them (matched by UUID; ``timesliced.client.gpus.node_gpus`` does
    it for chosen CUDA ordinals).
    """

    _refresh_token: Callable[[], None]  # reads the token (TCP) before a connection: I/O the core does not do

    def __init__(
        self,
        job: str | None = None,
        group: str | None = None,
        *,
        address: str | os.PathLike[str] | None = None,
        gpus: list[int] | str | None = None,
        pids: list[int] | None = None,
        connect_timeout: float = 10.0,
        request_timeout: float = 60.0,
        on_push: Callable[[str, dict[str, Any]], None] | None = None,
        park: str | ParkSpec | None = None,
        offloader: OffloadExecutor | None = None,
        token: str | None = None,
        reconnect: float = 60.0,
        parked_access: str = "wait",
        memory: int | str | Mapping[int, int | str] | None = None,
        priority: int | None = None,
        weight: float | None = None,
        party: str | None = None,
    ) -> None:
        if parked_access not in ("wait", "raise"):
            raise ValueError("parked_access must be 'wait' or 'raise'")
        # What is not given comes from the environment that `timesliced run` sets (explicit arguments win).
        who = member(job, group, gpus=gpus, park=park, memory=memory, priority=priority, weight=weight, party=party)
        self.job = job = who.job
        self.group = group = who.group
        self.address = resolve_address(address)
        self.offloader = offloader
        self._rooms = Rooms()  # the room of each streamed unpark in flight (directives.py)
        self.on_push = on_push
        self.parked_access = parked_access

        # The token (or why there is none) as last found; read by the shell before each connection,
        # so the core proves it without reading the environment. A closure: it shows in no repr.
        found: list[str | errors.PermissionDenied] = [find_token(token) if token is not None else _NOT_YET]

        def prove(hello: Any) -> dict[str, Any] | None:
            return auth_args(hello, found[0])

        def refresh() -> None:
            if self.address.kind == "tcp":  # only a TCP daemon asks for it
                found[0] = find_token(token)

        self._refresh_token = refresh

        self._core = ClientSession(
            job,
            register_args(
                job,
                group,
                who.gpus,
                pids,
                who.park,
                who.memory,
                priority=who.priority,
                weight=who.weight,
                party=who.party,
            ),
            hello_args(),
            address=str(self.address),
            auth=prove,
            reconnect=reconnect,
            connect_timeout=connect_timeout,
            request_timeout=request_timeout,
        )
        self._pid = _Process.pid  # the process whose connection this is (``_foreign``)
        self._start_io()

    def _foreign(self) -> errors.ConnectionLost | None:
        """In a process forked from the one that made this client: the error its calls raise, else None.

        The child shares the parent's socket: anything it wrote would act for the parent (a release),
        and the parent's reader thread, which answers, is not in the child.
        """
        if self._pid == _Process.pid:
            return None
        return errors.ConnectionLost(
            f"this client was made by process {self._pid}, and process {_Process.pid} is a fork of it: "
            "its connection is the parent's; make a new client in this process"
        )

    def _start_io(self) -> None:
        """The shell's own state (sockets, waiters, its driver)."""
        raise NotImplementedError

    # --- what the client shows ------------------------------------------------------------

    @property
    def session(self) -> int | None:
        """The daemon's number for this client's registration (a new one after each reconnection)."""
        return self._core.session

    @property
    def gpus(self) -> list[int]:
        """The GPUs of the job's group, as the daemon registered them (the node's numbers, not CUDA ordinals)."""
        return self._core.gpus

    @property
    def lock(self) -> LockState:
        """What the client knows of its hold on the lock."""
        return self._core.lock

    @property
    def reconnects(self) -> int:
        """How many times the client connected again and resumed after losing its daemon."""
        return self._core.reconnects

    @property
    def faulted(self) -> str | None:
        """Why the job is faulted (its state could not be moved), or None; an operator's resume clears it."""
        return self._core.lock.faulted

    @property
    def preempted(self) -> str | None:
        """Why, while the job waits to be granted again after the daemon preempted it; else None."""
        return self._core.lock.preempted

    @property
    def reconnect(self) -> float:
        """How long a lost daemon (or a first connection that is refused) is waited for, in seconds."""
        return self._core.reconnect

    @reconnect.setter
    def reconnect(self, value: float) -> None:
        self._core.reconnect = value

    @property
    def connect_timeout(self) -> float:
        return self._core.connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, value: float) -> None:
        self._core.connect_timeout = value

    @property
    def request_timeout(self) -> float:
        return self._core.request_timeout

    @request_timeout.setter
    def request_timeout(self, value: float) -> None:
        self._core.request_timeout = value

    # --- the core's outputs that both shells carry out alike ------------------------------------

    def _logged(self, out: Logged) -> None:
        log.log(out.level, "%s", out.message)

    def _directed(self, out: Pushed) -> None:
        """A push's rooms and directive, carried out in the order the core put the pushes out.

        Cheap, never blocks, runs no user code: the sync client does it under its lock, as it drains
        the core, so a room is never opened after its connection's end was handled, nor relayed to
        before its directive arrived, whichever thread read the bytes.
        """
        if out.event == "offload":
            self._rooms.opened(out.connection, out.data)  # before any room relayed for it can arrive
            self._run_directive(out.data, out.connection)
        elif out.event == "offload_room":
            self._rooms.relayed(out.connection, out.data)

    def _pushed(self, out: Pushed) -> None:
        """A push for the user's ``on_push`` (after ``_directed``)."""
        if self.on_push is not None:
            try:
                self.on_push(out.event, out.data)
            except Exception:
                log.exception("on_push callback failed")

    def _run_directive(self, data: dict[str, Any], connection: int) -> None:
        """Hand an offload directive to the worker, which answers ``offload_done`` on ``connection`` only."""
        raise NotImplementedError

    def _directive(
        self, data: dict[str, Any], connection: int, send: Callable[[str, dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Run one directive of ``connection`` (in the worker thread); ``send(op, args)`` hands a request to the core.

        A streamed park reports each freed region as ``offload_progress``; a streamed unpark
        waits on its room. Returns the ``offload_done`` args.
        """
        directive = data.get("directive")

        def freed(gpus: dict[int, int]) -> None:
            send("offload_progress", {"directive": directive, "freed": {str(g): n for g, n in gpus.items()}})

        try:
            return run_directive(self.offloader, data, room=self._rooms.room(connection, directive), freed=freed)
        finally:
            self._rooms.closed(connection, directive)
