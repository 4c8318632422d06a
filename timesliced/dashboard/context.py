"""What the application holds: the source it shows (``DashboardSource``), its settings, and the
typed ``AppKey``s through which every handler reaches them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jinja2
from aiohttp import web

from ..wire.status import Status
from .resources import Asset

if TYPE_CHECKING:
    from .stream import StreamHub

__all__ = [
    "API",
    "ASSETS",
    "HUB",
    "SETTINGS",
    "SOURCE",
    "TEMPLATES",
    "DashboardSource",
    "Metrics",
    "Settings",
]

API = "/api/v1"


class DashboardSource(Protocol):
    """What the dashboard reads and drives; the daemon implements it. Wall-clock times are epoch seconds."""

    def status(self) -> Status:
        """The status document (node, devices, groups, jobs, telemetry, moves)."""

    def timeline(self, window_s: float) -> dict[str, Any]:
        """``{"now", "window_s", "groups": [{"group", "gpus"}],
        "spans": [{"group", "job", "kind", "start", "end"}]}``; ``end`` is None while a span is open."""

    def events(self, after: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` events with ``id > after``, oldest first."""

    def force_release(self, group: str) -> dict[str, Any]:
        """Take the lock from its holder. Raises ``UnknownGroup``, ``NotHolder`` (nobody holds it)."""

    def drain(self, group: str, on: bool) -> dict[str, Any]:
        """Stop (``on``) or resume granting the group. Raises ``UnknownGroup``."""

    def resume(self, group: str) -> dict[str, Any]:
        """Grant the group again (undo a drain) and clear the faults of its jobs whose cause is gone.

        The answer is ``drain``'s plus ``resumed`` (jobs) and ``still_faulted`` (job -> why not).
        Raises ``UnknownGroup``.
        """

    def resume_job(self, job: str) -> dict[str, Any]:
        """Clear the job's fault once its cause is gone: it may be granted again.

        Raises ``UnknownJob``, ``BadRequest`` (it is not faulted) or ``JobFaulted`` (its state is lost
        or it exited: it cannot be resumed).
        """

    def ready(self) -> bool:
        """Serving and able to grant."""


Metrics = Callable[[str | None], tuple[bytes, str]]


@dataclass(frozen=True)
class Settings:
    admin_token: str | None
    metrics: Metrics | None
    sse_interval: float
    max_streams: int


SOURCE: web.AppKey[DashboardSource] = web.AppKey("source")
SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
TEMPLATES: web.AppKey[jinja2.Environment] = web.AppKey("templates")
ASSETS: web.AppKey[dict[str, Asset]] = web.AppKey("assets")
HUB: web.AppKey[StreamHub] = web.AppKey("hub")
