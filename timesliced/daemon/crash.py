"""Fault injection for the crash tests: the daemon kills itself with SIGKILL at a named step of a switch.

``DaemonConfig.crash_at`` (``$TIMESLICED_CRASH_AT``, e.g. ``before-restore@3``) names the points and
the how-manieth time each fires. A real ``kill -9`` lands anywhere; these land exactly where a
recovery bug would show.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger(__name__)

MID_MOVE_S = 0.05  # a "mid-" point fires this long into the move (give it a slow bandwidth)


class CrashPoints:
    def __init__(self, plan: dict[str, int]) -> None:
        self._plan = dict(plan)
        self._seen: dict[str, int] = {}  # point -> times reached

    def reached(self, point: str) -> None:
        """Die here, as ``kill -9`` would, if ``point`` is planned for this time."""
        if point in self._plan:
            self._seen[point] = seen = self._seen.get(point, 0) + 1
            if seen == self._plan[point]:
                log.critical("crash point %s: killing the daemon", point)
                os.kill(os.getpid(), signal.SIGKILL)

    def move_starting(self, kind: str, loop: asyncio.AbstractEventLoop) -> None:
        """A snapshot or restore starts: ``before-KIND`` now, ``mid-KIND`` soon after (the copy runs in a thread)."""
        self.reached(f"before-{kind}")
        if f"mid-{kind}" in self._plan:
            loop.call_later(MID_MOVE_S, self.reached, f"mid-{kind}")
