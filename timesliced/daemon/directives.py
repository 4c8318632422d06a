"""Offload directives: the ``offload`` method's moves, carried out by the job's own processes.

The daemon pushes an ``offload`` directive (``park`` or ``unpark``, with tags) to every connection
of the job and waits for each ``offload_done``; a connection that closes first answers with a
failure, so a move never waits on a process that is gone. ``backends/offload.py`` turns these
answers into the move's result.

A swap's directives carry a ``Relay`` (``backends/offload.py``): a park is sent with ``stream`` and
each ``offload_progress`` it reports (a region freed) goes into the relay; an unpark is sent with
the ``room`` the relay grants it at once, and every later grant, the limit's end (``rest``) or a
call-off (``cancel``) goes to its connection as ``offload_room``; an unpark told after the relay
ended gets that end right after its directive. What each connection needs per GPU is its latest
answer's footprint (its job's memory there when resident).

Directive numbers never repeat across restarts of the node's daemon: a client still finishing a
directive of the daemon that died must not have its answer taken for the restarted daemon's directive
of the same number. They start from the wall clock in microseconds (``time.time_ns() // 1000``) and
count up by one: a restarted daemon starts above every number the one before it sent, unless that one
sent more directives than microseconds it ran (each is a push over a socket, and a daemon starts in
far more than that) or the wall clock was set back between the two starts. No write per directive
and no file: the client's side holds without it anyway (its rooms and answers go with the connection
a directive came on). The numbers stay below 2**53 until the year 2255, so they are exact in JSON too,
and the wire takes any non-negative integer (``arg_int``; msgpack up to 2**64 - 1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .. import errors
from ..backends.offload import Relay
from ..wire.messages import arg_int, quoted
from .server import Connection

MAX_ERROR_CHARS = 1024


class Directives:
    def __init__(self, connections_of: Callable[[str], list[Connection]], *, first: int | None = None) -> None:
        """``connections_of(job)``: the job's connections on this node, in a stable order.

        ``first``: the first directive's number (default: the wall clock's microseconds, module docstring).
        """
        self._connections_of = connections_of
        self._waiting: dict[int, tuple[Connection, asyncio.Future[dict[str, Any]]]] = {}  # id -> (conn, answer)
        self._relays: dict[int, tuple[Relay, bool]] = {}  # directive -> (its swap's relay, is it the park)
        self._footprints: dict[int, dict[int, int]] = {}  # connection -> its latest answer's footprint
        self._first = self._next = time.time_ns() // 1_000 if first is None else first

    @property
    def last(self) -> int:
        """The id of the latest directive sent (0: none yet)."""
        return 0 if self._next == self._first else self._next - 1

    async def direct(
        self, job: str, action: str, args: dict[str, Any], *, relay: Relay | None = None
    ) -> list[dict[str, Any]]:
        """Tell every connection of ``job`` to park or unpark; their answers, in order (an answer never raises).

        ``relay``: the directive is one side of a swap (module docstring). Raises ``BackendError``
        when the job has no connection here.
        """
        conns = self._connections_of(job)
        if not conns:
            raise errors.BackendError(f"job {job!r} has no connection to carry out an offload {action}")
        if relay is not None:
            relay.attach(self._push_room)
        answers = []
        for conn in conns:
            directive = self._next
            self._next += 1
            answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._waiting[directive] = (conn, answer)
            extra: dict[str, Any] = {}
            end: dict[str, Any] | None = None
            if relay is not None:
                self._relays[directive] = (relay, action == "park")
                if action == "park":
                    extra["stream"] = True
                else:
                    opening = relay.incoming(directive, self._footprints.get(conn.id))
                    extra["room"] = {str(g): n for g, n in opening.room.items()}
                    end = opening.end
            conn.push("offload", {"directive": directive, "action": action, **args, **extra})
            if end is not None:  # the relay ended before this unpark was told (the park could not start, say)
                conn.push("offload_room", {"directive": directive, **end})
            answers.append((directive, answer))
        try:
            return list(await asyncio.gather(*(a for _, a in answers)))
        finally:
            for (directive, answer), conn in zip(answers, conns, strict=True):
                if relay is not None and action == "unpark" and (answer.cancelled() or not answer.done()):
                    # Cut short (a timeout, the daemon stopping): nobody relays room to it any more.
                    conn.push("offload_room", {"directive": directive, "cancel": "the swap was cut short"})
                self._waiting.pop(directive, None)
                self._relays.pop(directive, None)

    def answered(self, conn: Connection, args: dict[str, Any], gpus: set[int]) -> None:
        """A connection's ``offload_done``; raises ``BadRequest`` for a directive it was not sent, or a bad answer."""
        directive = arg_int(args, "directive")
        entry = self._waiting.get(directive)
        if entry is None or entry[0].id != conn.id:
            raise errors.BadRequest(f"no offload directive {directive} is waiting on this connection")
        answer = parse_offload_done(args, gpus)
        if answer["ok"]:
            self._footprints[conn.id] = {int(g): n for g, n in answer["footprint"].items()}
        self._settle(directive, answer)

    def progressed(self, conn: Connection, args: dict[str, Any], gpus: set[int]) -> None:
        """A connection's ``offload_progress`` (a streamed park freed device memory); raises ``BadRequest``."""
        directive = arg_int(args, "directive")
        entry = self._waiting.get(directive)
        if entry is None or entry[0].id != conn.id:
            raise errors.BadRequest(f"no offload directive {directive} is waiting on this connection")
        freed = parse_gpu_bytes(args.get("freed"), gpus, "freed")
        relay = self._relays.get(directive)
        if relay is not None and relay[1]:  # progress of a lone park has nobody to tell
            relay[0].freed({int(g): n for g, n in freed.items()})

    def connection_closed(self, conn_id: int) -> None:
        """Directives the connection did not answer fail now."""
        self._footprints.pop(conn_id, None)
        for directive, (waiting_on, answer) in list(self._waiting.items()):
            if waiting_on.id == conn_id and not answer.done():
                self._settle(
                    directive, {"ok": False, "error": "the connection closed before it carried out the offload"}
                )

    def _settle(self, directive: int, answer: dict[str, Any]) -> None:
        entry = self._waiting.get(directive)
        if entry is None or entry[1].done():
            return
        relay = self._relays.get(directive)
        if relay is not None and not relay[1]:  # an unpark that failed calls the others off
            relay[0].left(directive, None if answer["ok"] else str(answer.get("error")))
        entry[1].set_result(answer)

    def _push_room(self, directive: int, data: dict[str, Any]) -> None:
        entry = self._waiting.get(directive)
        if entry is not None and not entry[1].done():
            entry[0].push("offload_room", {"directive": directive, **data})


def parse_gpu_bytes(value: Any, gpus: set[int], name: str) -> dict[str, int]:
    """A map of this node's GPUs (as strings) to byte counts, checked; raises ``BadRequest``."""
    value = value or {}
    if not isinstance(value, dict) or len(value) > len(gpus):
        raise errors.BadRequest(f"{name!r} must map GPUs of this node to byte counts")
    checked: dict[str, int] = {}
    for gpu, n in value.items():
        if not (isinstance(gpu, str) and gpu.isdigit() and int(gpu) in gpus):
            raise errors.BadRequest(f"{name!r} names GPU {quoted(gpu)}, which this node does not have")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise errors.BadRequest(f"{name!r} byte counts must be non-negative integers")
        checked[gpu] = n
    return checked


def parse_offload_done(args: dict[str, Any], gpus: set[int]) -> dict[str, Any]:
    """A client's answer to an offload directive, checked; raises ``BadRequest``."""
    ok = args.get("ok")
    if not isinstance(ok, bool):
        raise errors.BadRequest("'ok' must be true or false")
    if not ok:
        error = args.get("error")
        return {"ok": False, "error": (error if isinstance(error, str) else "no reason given")[:MAX_ERROR_CHARS]}
    checked = parse_gpu_bytes(args.get("footprint"), gpus, "footprint")
    return {"ok": True, "nbytes": arg_int(args, "nbytes", minimum=0), "footprint": checked}
