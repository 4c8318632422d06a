"""Under ``--dns``: the members the name lists now, against those this daemon started with.

A daemon takes its members from the headless service once, as it starts, and keeps them: every
member must hold the same list, so it cannot change under a running cluster. Daemons started at
different times (a node that joined, an existing deployment switched over to the host network)
may hold different lists, and then no leader may form. This looks at the name again every
``interval`` seconds and says so (a warning, ``cluster.dns`` in ``status``, and the
``timesliced_cluster_dns_members_differ`` metric), with what to do: restart every daemon.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from ..cluster.discovery import Resolver, peers_from_dns
from ..wire.status import MembersLook

log = logging.getLogger(__name__)


class MembersWatch:
    """``look`` resolves the name (blocking) and keeps what it found; ``run`` does so every ``interval`` seconds."""

    def __init__(
        self,
        service: str,
        port: int,
        members: Iterable[str],
        *,
        interval: float = 30.0,
        resolve: Resolver | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service, self.port = service, port
        self.members = sorted(members)
        self.interval = interval
        self._resolve = resolve
        self._clock = clock
        self.last: MembersLook | None = None

    def look(self) -> MembersLook:
        """Resolve the name now; log what changed since the last look. Never raises for a failed look."""
        try:
            listed: list[str] | None = sorted(m.id for m in peers_from_dns(self.service, self.port, self._resolve))
            error = None
        except ValueError as exc:
            listed, error = None, str(exc)
        found: MembersLook = {
            "name": self.service,
            "listed": listed,
            "differs": listed is not None and listed != self.members,
            "error": error,
            "checked_at": self._clock(),
        }
        self._tell(found)
        self.last = found
        return found

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.to_thread(self.look)

    def _tell(self, now: MembersLook) -> None:
        before = self.last
        if now["error"] is not None:
            if before is None or before["error"] != now["error"]:
                log.warning("cannot look at the members --dns lists now: %s", now["error"])
            return
        listed = now["listed"] or []
        if now["differs"] and (before is None or before["listed"] != listed):
            joined = [m for m in listed if m not in self.members]
            gone = [m for m in self.members if m not in listed]
            log.warning(
                "--dns %r now lists %s (new: %s; gone: %s), not the members this daemon started with (%s): every "
                "daemon must hold the same members, and it took them once, at its start. Restart every daemon "
                "(on Kubernetes: kubectl rollout restart of the DaemonSet) once all of them run",
                self.service,
                ", ".join(listed),
                ", ".join(joined) or "none",
                ", ".join(gone) or "none",
                ", ".join(self.members),
            )
        elif not now["differs"] and before is not None and before["differs"]:
            log.info("--dns %r lists this daemon's members again", self.service)
