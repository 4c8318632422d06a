"""Live updates: the Server-Sent Events stream at ``/api/v1/stream`` and the hub that feeds it.

``GET /api/v1/stream?after=ID&timeline=SECONDS``: at most ``max_streams`` at once, past that 503
with ``Retry-After``; every stream ends as soon as the app shuts down. It sends:

``hello``
    ``{"interval_s", "after", "timeline_window_s"}`` once, first.
``status``
    the whole status document, at once and then every ``sse_interval`` seconds.
``events``
    ``{"events": [...]}``: events newer than the last one sent (or than
    ``after`` / the ``Last-Event-ID`` header; with neither, only events from now
    on), with ``id:`` set to the newest id so that a reconnecting browser
    resumes where it stopped. Omitted when nothing is new.
``timeline``
    only when ``timeline=SECONDS`` was given: ``{"now", "window_s", "groups",
    "spans", "full"}``. The first one is ``full`` (every span in the window);
    later ones carry only the spans still open or ended since the previous one.
    A client keys spans by (group, kind, job, start), replaces what it has, and
    drops spans that ended before ``now - window_s``.
``problem``
    ``{"error": {"code", "message"}}`` when the source failed this tick; the
    stream goes on.

One ``StreamHub`` per app reads the source once per tick for every open stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .. import errors
from ..util.compat import timeout
from .context import HUB, SETTINGS, SOURCE, DashboardSource
from .encoding import dumps
from .formatting import is_number
from .params import MAX_EVENTS, HttpError, int_param, window_param
from .views import timeline_delta

__all__ = ["MAX_STREAMS", "RECENT_EVENTS", "RETRY_MS", "WRITE_TIMEOUT_S", "Frame", "StreamHub", "serve_stream"]

log = logging.getLogger(__package__)  # the whole dashboard logs under one name

MAX_STREAMS = 64
RECENT_EVENTS = 1000  # events the stream hub keeps for pages and streams
WRITE_TIMEOUT_S = 10.0  # a stream whose client reads nothing for this long is dropped
RETRY_MS = 2000  # the reconnection delay the stream asks browsers for


@dataclass(frozen=True)
class Frame:
    """What every stream sends for one tick (the status encoded once for all of them)."""

    seq: int
    status: bytes | None
    problem: bytes | None
    timeline: dict[str, Any] | None
    newest_event: int


class StreamHub:
    """One producer for all live streams: every ``interval`` seconds, while any stream is open, it reads
    the source once (status, new events, the timeline for the widest window asked for) and wakes them."""

    def __init__(self, source: DashboardSource, interval: float) -> None:
        self._source = source
        self.interval = interval
        self.streams = 0
        self.closed = False
        self._windows: Counter[float] = Counter()
        self._closing = asyncio.Event()
        self._changed = asyncio.Event()
        self.frame = Frame(0, None, None, None, 0)
        self._events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self._cursor = 0
        self._failing = False

    # events

    def poll_events(self) -> None:
        """Take the source's new events into the ring (a few pages at most per call)."""
        for _ in range(20):
            batch = self._source.events(self._cursor, MAX_EVENTS)
            for event in batch:
                if is_number(event.get("id")) and event["id"] > self._cursor:
                    self._events.append(event)
                    self._cursor = event["id"]
            if len(batch) < MAX_EVENTS:
                return

    def recent_events(self) -> list[dict[str, Any]]:
        return list(self._events)

    @property
    def newest_event(self) -> int:
        return self._cursor

    def events_after(self, after: int) -> list[dict[str, Any]]:
        """Events newer than ``after``: from the ring when it reaches back that far, else from the source."""
        if self._events and after >= self._events[0]["id"] - 1:
            return [e for e in self._events if e["id"] > after][:MAX_EVENTS]
        return self._source.events(after, MAX_EVENTS)

    # streams

    def attach(self, window: float | None) -> None:
        self.streams += 1
        if window is not None:
            self._windows[window] += 1

    def detach(self, window: float | None) -> None:
        self.streams -= 1
        if window is not None:
            self._windows[window] -= 1
            if self._windows[window] <= 0:
                del self._windows[window]

    def close(self) -> None:
        """End every stream (at shutdown); new ones are refused."""
        self.closed = True
        self._closing.set()
        self._changed.set()

    async def next_frame(self, seq: int) -> Frame | None:
        """The first frame after ``seq``, or None once the hub is closed."""
        while not self.closed and self.frame.seq <= seq:
            await self._changed.wait()
        return None if self.closed else self.frame

    async def run(self) -> None:
        """Publish a frame every interval while streams are open; ends when the hub is closed."""
        while not self.closed:
            try:
                await asyncio.wait_for(self._closing.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            if self.streams and not self.closed:
                self.publish()

    def publish(self) -> None:
        status = problem = None
        timeline = None
        try:
            status = dumps(self._source.status())
            self.poll_events()
            if self._windows:
                timeline = self._source.timeline(max(self._windows))
            if self._failing:
                log.info("dashboard: the status source answers again")
                self._failing = False
        except Exception as exc:
            if not self._failing:
                log.exception("dashboard: reading the status source failed")
                self._failing = True
            problem = dumps({"error": _error_body(exc)})
            status = None
        self.frame = Frame(self.frame.seq + 1, status, problem, timeline, self._cursor)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _error_body(exc: Exception) -> dict[str, str]:
    if isinstance(exc, errors.TimeslicedError):
        return {"code": exc.code, "message": exc.message}
    return {"code": "internal", "message": "the daemon could not produce its status; its log has the details"}


def _sse(event: str, data: bytes, event_id: int | None = None) -> bytes:
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return head.encode() + b"data: " + data + b"\n\n"


async def serve_stream(request: web.Request) -> web.StreamResponse:
    """The handler of ``GET /api/v1/stream``."""
    hub = request.app[HUB]
    settings = request.app[SETTINGS]
    window = window_param(request, "timeline", None)
    after: int | None = None
    try:  # a reconnecting browser says where it stopped; that wins over the page's ?after=
        after = max(0, int(request.headers.get("Last-Event-ID", ""), 10))
    except ValueError:
        if "after" in request.query:
            after = int_param(request, "after", 0, 0, 2**63 - 1)
    if hub.closed:
        raise HttpError(503, "shutting_down", "the dashboard is shutting down", {"Retry-After": "5"})
    if hub.streams >= settings.max_streams:
        raise HttpError(
            503,
            errors.LimitExceeded.code,
            f"too many live streams ({settings.max_streams}); try again later",
            {"Retry-After": "5"},
        )
    hub.attach(window)
    try:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        try:
            await _feed_stream(request, response, hub, window, after)
        except (ConnectionError, TimeoutError, asyncio.TimeoutError):
            pass  # the client went away or stopped reading: only its own stream ends
        except Exception:
            log.exception("dashboard: a live stream failed")
        return response
    finally:
        hub.detach(window)


async def _feed_stream(
    request: web.Request, response: web.StreamResponse, hub: StreamHub, window: float | None, after: int | None
) -> None:
    source = request.app[SOURCE]

    async def send(chunk: bytes) -> None:
        async with timeout(WRITE_TIMEOUT_S):
            await response.write(chunk)

    # The first messages come straight from the source, so a page is current at once; if the
    # source fails, the stream says so and goes on (the next tick may succeed).
    seq = hub.frame.seq
    since: float | None = None
    problem: Exception | None = None
    if after is None:
        try:
            hub.poll_events()
        except Exception as exc:
            problem = exc
    cursor = after if after is not None else hub.newest_event
    hello = {"interval_s": hub.interval, "after": cursor, "timeline_window_s": window}
    await send(f"retry: {RETRY_MS}\n\n".encode() + _sse("hello", dumps(hello)))
    if problem is None:
        try:
            first = [_sse("status", dumps(source.status()))]
            if window is not None:
                timeline = timeline_delta(source.timeline(window), window, None)
                since = timeline["now"]
                first.append(_sse("timeline", dumps(timeline)))
            events = hub.events_after(cursor)
        except Exception as exc:
            problem = exc
        else:
            await send(b"".join(first))
            cursor = await _send_events(send, cursor, events)
    if problem is not None:
        if not isinstance(problem, errors.TimeslicedError):
            log.error("dashboard: reading the status source for a new stream failed", exc_info=problem)
        await send(_sse("problem", dumps({"error": _error_body(problem)})))
    while True:
        frame = await hub.next_frame(seq)
        if frame is None or request.transport is None or request.transport.is_closing():
            return
        seq = frame.seq
        if frame.status is not None:
            await send(_sse("status", frame.status))
        else:
            await send(_sse("problem", frame.problem or b"{}"))
        if frame.newest_event > cursor:
            cursor = await _send_events(send, cursor, hub.events_after(cursor))
        if window is not None and frame.timeline is not None:
            delta = timeline_delta(frame.timeline, window, since)
            since = delta["now"]
            await send(_sse("timeline", dumps(delta)))


async def _send_events(send: Callable[[bytes], Awaitable[None]], cursor: int, events: list[dict[str, Any]]) -> int:
    if events:
        cursor = max([cursor, *(e["id"] for e in events if is_number(e.get("id")))])
        await send(_sse("events", dumps({"events": events}), cursor))
    return cursor
