"""Offload directives inside the workload: the daemon says park or unpark, the executor copies.

Both client shells run each directive on one worker thread of their own (the
copies block, and directives must run in the order sent: a park before its
unpark), then answer with ``offload_done``.

A *streamed* switch (the daemon parks one job while it restores another into the room the first
frees) adds two things. The outgoing park is told ``stream``: an executor that can
(``streams = True``, :class:`~.offload.Offloader`) parks region by region and reports the device
memory each region gave back (``offload_progress``) as soon as it is unmapped. The incoming unpark
carries ``room`` (bytes per GPU it may map now); the daemon relays more room (``offload_room``) as
the outgoing job frees it, lifts the limit once that park ended (``rest``), or calls the unpark off
(``cancel``). :class:`Room` is that limit on the client's side: the reader thread grants, the worker
thread takes, and a lost connection ends its waits (:class:`Rooms`), so an unpark never waits on a
daemon that is gone: it puts its regions back as parked and answers with the failure, on no other
connection (the daemon that sent it failed it when the connection closed).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .. import errors

log = logging.getLogger(__name__)


def directive_worker(job: str) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"timesliced-offload-{job}")


class OffloadExecutor(Protocol):
    """What carries out the daemon's offload directives inside the workload.

    ``timesliced.client.offload.Offloader`` and ``timesliced.client.offload.TorchOffload``
    are such executors; ``park`` / ``unpark`` return figures (a mapping, or an
    object with ``to_wire()``) with at least ``nbytes`` and ``seconds``, and
    ``footprint`` (gpu -> bytes held when resident) where known. An executor with
    ``streams = True`` also takes ``freed=`` (park) and ``room=`` (unpark), see the module docstring.
    """

    def park(self, tags: Sequence[str] = ..., *, verify: bool | None = ...) -> Any: ...

    def unpark(self, tags: Sequence[str] = ..., *, verify: bool | None = ...) -> Any: ...


class Room:
    """The device memory a streamed unpark may map, per GPU (the node's numbers), as the daemon grants it.

    Thread-safe: ``grant`` / ``open`` / ``end`` come from the client's reader, ``take`` blocks the
    directive's worker. Once ``open``, nothing is limited any more (the outgoing park ended, so all
    the room the scheduler planned is free); once ``end``, every ``take`` raises.
    """

    def __init__(self, granted: Mapping[int, int] | None = None) -> None:
        self._cond = threading.Condition()
        self._granted: dict[int, int] = {int(g): int(n) for g, n in (granted or {}).items()}
        self._taken: dict[int, int] = {}
        self._open = False
        self._ended: str | None = None

    def grant(self, more: Mapping[int, int]) -> None:
        """``more`` bytes per GPU may be mapped on top of what was granted so far."""
        with self._cond:
            for gpu, n in more.items():
                self._granted[int(gpu)] = self._granted.get(int(gpu), 0) + int(n)
            self._cond.notify_all()

    def open(self) -> None:
        """No limit any more."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def end(self, reason: str) -> None:
        """Call the unpark off: the waiting ``take`` and every later one raise ``BackendError`` with ``reason``."""
        with self._cond:
            if self._ended is None:
                self._ended = reason
            self._cond.notify_all()

    def fits(self, gpu: int, nbytes: int) -> bool:
        """Whether ``take(gpu, nbytes)`` would return at once."""
        with self._cond:
            return self._ended is None and self._fits(gpu, nbytes)

    def take(self, gpu: int, nbytes: int) -> None:
        """Wait until ``nbytes`` more may be mapped on ``gpu``, and count them as mapped.

        Raises ``BackendError`` once the unpark is called off (``end``).
        """
        with self._cond:
            while self._ended is None and not self._fits(gpu, nbytes):
                self._cond.wait()
            if self._ended is not None:
                raise errors.BackendError(f"the streamed unpark was called off: {self._ended}", cancelled=True)
            self._taken[gpu] = self._taken.get(gpu, 0) + nbytes

    def wait_open(self) -> None:
        """Wait until the limit is lifted; raises ``BackendError`` once the unpark is called off."""
        with self._cond:
            while self._ended is None and not self._open:
                self._cond.wait()
            if self._ended is not None:
                raise errors.BackendError(f"the streamed unpark was called off: {self._ended}", cancelled=True)

    def _fits(self, gpu: int, nbytes: int) -> bool:
        return self._open or self._taken.get(gpu, 0) + nbytes <= self._granted.get(gpu, 0)


class Rooms:
    """The rooms of the streamed unparks a client has in flight, by connection and directive (thread-safe).

    A room belongs to the connection its directive came on: a restarted daemon numbers its own
    directives, so directive ``N`` of a new connection is not ``N`` of the old one. ``opened`` runs as
    the directive arrives, before any ``offload_room`` for it can (each shell carries both out in the
    order its core put them out); ``relayed`` carries such a push to its room; ``lost`` ends the rooms
    of a connection that is gone (and of every older one), with whoever granted them. Connections are
    numbered upwards (``ClientSession.connection``), so a room opened for a connection already lost is
    ended at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[tuple[int, int], Room] = {}
        self._lost = 0  # the latest connection lost: its rooms, and those of every older one, are ended
        self._lost_why = ""

    def opened(self, connection: int, data: Mapping[str, Any]) -> None:
        """An ``offload`` push on ``connection``: a streamed unpark (one with ``room``) gets its room now."""
        directive, granted = data.get("directive"), data.get("room")
        if isinstance(directive, int) and isinstance(granted, dict):
            room = Room(_gpu_bytes(granted))
            with self._lock:
                if connection <= self._lost:
                    room.end(self._lost_why)  # its connection is gone: nobody will grant it anything
                self._rooms[connection, directive] = room

    def room(self, connection: int, directive: Any) -> Room | None:
        with self._lock:
            return self._rooms.get((connection, directive)) if isinstance(directive, int) else None

    def closed(self, connection: int, directive: Any) -> None:
        with self._lock:
            if isinstance(directive, int):
                self._rooms.pop((connection, directive), None)

    def relayed(self, connection: int, data: Mapping[str, Any]) -> None:
        """An ``offload_room`` push: more room, the limit lifted (``rest``), or the unpark called off (``cancel``)."""
        room = self.room(connection, data.get("directive"))
        if room is None:
            return  # its unpark is over already
        if isinstance(data.get("room"), dict):
            room.grant(_gpu_bytes(data["room"]))
        if data.get("rest"):
            room.open()
        if data.get("cancel"):
            room.end(str(data["cancel"]))

    def lost(self, reason: str, connection: int | None = None) -> None:
        """``connection`` ended (None: the client closed): its rooms and every older connection's end."""
        with self._lock:
            if connection is None:
                rooms = list(self._rooms.values())
            else:
                if connection > self._lost:
                    self._lost, self._lost_why = connection, reason
                rooms = [room for (conn, _), room in self._rooms.items() if conn <= connection]
        for room in rooms:
            room.end(reason)


def _gpu_bytes(d: Mapping[Any, Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for gpu, n in d.items():
        if isinstance(gpu, (str, int)) and str(gpu).isdigit() and isinstance(n, int) and n >= 0:
            out[int(gpu)] = n
    return out


Freed = Callable[[dict[int, int]], None]


def run_directive(
    executor: OffloadExecutor | None,
    data: Mapping[str, Any],
    *,
    room: Room | None = None,
    freed: Freed | None = None,
) -> dict[str, Any]:
    """Carry out one ``offload`` push; returns the args of the ``offload_done`` request.

    Runs in a worker thread: the copies block. A client without an executor
    has nothing registered and answers at once with zero bytes. ``room``: the
    limit of a streamed unpark; ``freed``: how a streamed park reports each region it gave back.
    An executor that cannot stream waits, for a streamed unpark, until the limit is lifted, and
    parks as ever (its room is relayed when its park ends).
    """
    directive = data.get("directive")
    action = data.get("action")
    tags = [str(t) for t in data.get("tags") or ()]
    verify = bool(data.get("verify"))
    try:
        if action not in ("park", "unpark"):
            raise errors.BadRequest(f"unknown offload action {action!r}")
        if executor is None:
            return {"directive": directive, "ok": True, "nbytes": 0, "footprint": {}}
        streams = bool(getattr(executor, "streams", False))
        if action == "park":
            if streams and freed is not None and data.get("stream"):
                stats = executor.park(tags, verify=verify, freed=freed)  # type: ignore[call-arg]
            else:
                stats = executor.park(tags, verify=verify)
        elif room is not None and streams:
            stats = executor.unpark(tags, verify=verify, room=room)  # type: ignore[call-arg]
        else:
            if room is not None:
                room.wait_open()  # it maps all at once: only once the outgoing park ended
            stats = executor.unpark(tags, verify=verify)
        figures = stats.to_wire() if hasattr(stats, "to_wire") else dict(stats)
        footprint = figures.get("footprint") or figures.get("per_gpu") or {}
        return {
            "directive": directive,
            "ok": True,
            "nbytes": int(figures.get("nbytes", 0)),
            "footprint": {str(gpu): int(n) for gpu, n in footprint.items()},
        }
    except Exception as exc:
        log.exception("offload %s failed", action)
        message = exc.message if isinstance(exc, errors.TimeslicedError) else f"{exc.__class__.__name__}: {exc}"
        return {"directive": directive, "ok": False, "error": message}
