"""The daemon as the dashboard sees it: plain data with wall-clock times, and the admin actions.

Everything here runs on the daemon's event loop (the dashboard is served by
the same loop), so it reads the scheduler within one step, like any request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..core.events import DrainRequested, ForceReleaseRequested
from ..wire.status import Status

if TYPE_CHECKING:
    from .root import Daemon


MIN_WINDOW_S = 10.0


class DaemonView:
    def __init__(self, daemon: Daemon) -> None:
        self._d = daemon

    def status(self) -> Status:
        return self._d.status()

    def timeline(self, window_s: float) -> dict[str, Any]:
        """Spans of the last ``window_s`` seconds, or since the daemon started if that is shorter."""
        now = self._d.loop_time()
        wall = time.time() - now  # loop time + wall = epoch seconds
        window_s = min(window_s, max(MIN_WINDOW_S, now - self._d.started_loop))
        since = now - window_s
        return {
            "now": now + wall,
            "window_s": window_s,
            "groups": [{"group": g, "gpus": list(gpus)} for g, gpus in self._d.history.groups.items()],
            "spans": [
                {
                    "group": s.group,
                    "job": s.job,
                    "kind": s.kind,
                    "start": max(s.start, since) + wall,
                    "end": None if s.end is None else s.end + wall,
                }
                for s in self._d.history.spans_since(since)
            ],
        }

    def events(self, after: int, limit: int) -> list[dict[str, Any]]:
        wall = time.time() - self._d.loop_time()
        return [{**e.to_dict(), "t": e.t + wall} for e in self._d.history.events_after(after, limit)]

    def force_release(self, group: str) -> dict[str, Any]:
        return self._d.admin(ForceReleaseRequested(group))

    def drain(self, group: str, on: bool) -> dict[str, Any]:
        return self._d.admin(DrainRequested(group, on))

    def resume(self, group: str) -> dict[str, Any]:
        return self._d.resume_group(group)

    def resume_job(self, job: str) -> dict[str, Any]:
        return self._d.resume_job(job)

    def ready(self) -> bool:
        return self._d.serving
