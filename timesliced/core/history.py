"""What happened to each group over time: held and switching spans, and an event log (pure).

The daemon shows ``History`` the groups after every step of the scheduler
(``observe``); holders and switches that appeared or went away become spans
and events. Other events (a job registered, faulted, exited; an administrator
acted) are added with ``record``. Times are whatever clock the caller passes
(the daemon's loop time); everything is bounded: spans older than ``horizon``
seconds and events past ``max_events`` are dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)  # up to max_spans of these are kept: no per-instance dict
class Span:
    group: str
    job: str
    kind: str  # "held" | "switching"
    start: float
    end: float | None = None  # None while it lasts


@dataclass(frozen=True)
class GroupView:
    """The part of a group that the history follows."""

    name: str
    gpus: tuple[int, ...]
    holder: str | None
    switching_to: str | None


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    t: float
    # registered | granted | released | switch_started | switch_finished | faulted | slice_overdue | preempted
    # | exited | admin | policy (a waiter chosen out of arrival order)
    kind: str
    group: str | None
    job: str | None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "t": self.t,
            "kind": self.kind,
            "group": self.group,
            "job": self.job,
            "detail": self.detail,
        }


@dataclass
class History:
    horizon: float = 24 * 3600.0
    max_spans: int = 100_000
    max_events: int = 10_000
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    spans: deque[Span] = field(default_factory=deque)
    events: deque[Event] = field(default_factory=deque)
    _open: dict[tuple[str, str], Span] = field(default_factory=dict)  # (group, kind) -> open span
    _next_id: int = 1

    def observe(self, groups: Iterable[GroupView], now: float) -> None:
        """Compare the groups with what was seen last; close, then open, spans accordingly."""
        seen = list(groups)
        wanted: list[tuple[str, str, str | None]] = []
        for g in seen:
            self.groups[g.name] = g.gpus
            wanted += [(g.name, "held", g.holder), (g.name, "switching", g.switching_to)]
        for group, kind, job in wanted:
            span = self._open.get((group, kind))
            if span is not None and span.job != job:
                span.end = now
                del self._open[(group, kind)]
                closed = "released" if kind == "held" else "switch_finished"
                self.record(closed, now, group=group, job=span.job, detail=f"{now - span.start:.3f}s")
        for group, kind, job in reversed(wanted):  # a switch ends before the grant it led to
            if job is not None and (group, kind) not in self._open:
                span = Span(group, job, kind, now)
                self._open[(group, kind)] = span
                self.spans.append(span)
                self.record("granted" if kind == "held" else "switch_started", now, group=group, job=job)
        self._trim(now)

    def record(
        self, kind: str, now: float, *, group: str | None = None, job: str | None = None, detail: str = ""
    ) -> None:
        self.events.append(Event(self._next_id, now, kind, group, job, detail))
        self._next_id += 1
        while len(self.events) > self.max_events:
            self.events.popleft()

    def spans_since(self, since: float) -> list[Span]:
        """Spans that end after ``since`` (or still last), oldest first."""
        return [s for s in self.spans if s.end is None or s.end > since]

    def events_after(self, after: int, limit: int) -> list[Event]:
        return [e for e in self.events if e.id > after][:limit]

    def _trim(self, now: float) -> None:
        while self.spans and (
            len(self.spans) > self.max_spans
            or (self.spans[0].end is not None and self.spans[0].end < now - self.horizon)
        ):
            self.spans.popleft()
