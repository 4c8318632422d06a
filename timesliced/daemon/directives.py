"""Offload directives: the ``offload`` method's moves, carried out by the job's own processes.

The daemon pushes an ``offload`` directive (``park`` or ``unpark``, with tags) to every connection
of the job and waits for each ``offload_done``; a connection that closes first answers with a
failure, so a move never waits on a process that is gone. ``backends/offload.py`` turns these
answers into the move's result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .. import errors
from ..wire.messages import arg_int, quoted
from .server import Connection

MAX_ERROR_CHARS = 1024


class Directives:
    def __init__(self, connections_of: Callable[[str], list[Connection]]) -> None:
        """``connections_of(job)``: the job's connections on this node, in a stable order."""
        self._connections_of = connections_of
        self._waiting: dict[int, tuple[int, asyncio.Future[dict[str, Any]]]] = {}  # id -> (connection, answer)
        self._next = 1

    @property
    def last(self) -> int:
        """The id of the latest directive sent (0: none yet)."""
        return self._next - 1

    async def direct(self, job: str, action: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        """Tell every connection of ``job`` to park or unpark; their answers, in order (an answer never raises).

        Raises ``BackendError`` when the job has no connection here.
        """
        conns = self._connections_of(job)
        if not conns:
            raise errors.BackendError(f"job {job!r} has no connection to carry out an offload {action}")
        answers = []
        for conn in conns:
            directive = self._next
            self._next += 1
            answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._waiting[directive] = (conn.id, answer)
            conn.push("offload", {"directive": directive, "action": action, **args})
            answers.append((directive, answer))
        try:
            return list(await asyncio.gather(*(a for _, a in answers)))
        finally:
            for directive, _ in answers:
                self._waiting.pop(directive, None)

    def answered(self, conn: Connection, args: dict[str, Any], gpus: set[int]) -> None:
        """A connection's ``offload_done``; raises ``BadRequest`` for a directive it was not sent, or a bad answer."""
        directive = arg_int(args, "directive")
        entry = self._waiting.get(directive)
        if entry is None or entry[0] != conn.id:
            raise errors.BadRequest(f"no offload directive {directive} is waiting on this connection")
        answer = parse_offload_done(args, gpus)
        if not entry[1].done():
            entry[1].set_result(answer)

    def connection_closed(self, conn_id: int) -> None:
        """Directives the connection did not answer fail now."""
        for waiting_on, answer in self._waiting.values():
            if waiting_on == conn_id and not answer.done():
                answer.set_result({"ok": False, "error": "the connection closed before it carried out the offload"})


def parse_offload_done(args: dict[str, Any], gpus: set[int]) -> dict[str, Any]:
    """A client's answer to an offload directive, checked; raises ``BadRequest``."""
    ok = args.get("ok")
    if not isinstance(ok, bool):
        raise errors.BadRequest("'ok' must be true or false")
    if not ok:
        error = args.get("error")
        return {"ok": False, "error": (error if isinstance(error, str) else "no reason given")[:MAX_ERROR_CHARS]}
    footprint = args.get("footprint") or {}
    if not isinstance(footprint, dict) or len(footprint) > len(gpus):
        raise errors.BadRequest("'footprint' must map GPUs of this node to byte counts")
    checked: dict[str, int] = {}
    for gpu, n in footprint.items():
        if not (isinstance(gpu, str) and gpu.isdigit() and int(gpu) in gpus):
            raise errors.BadRequest(f"'footprint' names GPU {quoted(gpu)}, which this node does not have")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise errors.BadRequest("'footprint' byte counts must be non-negative integers")
        checked[gpu] = n
    return {"ok": True, "nbytes": arg_int(args, "nbytes", minimum=0), "footprint": checked}
