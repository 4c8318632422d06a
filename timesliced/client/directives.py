"""Offload directives inside the workload: the daemon says park or unpark, the executor copies.

Both client shells run each directive on one worker thread of their own (the
copies block, and directives must run in the order sent: a park before its
unpark), then answer with ``offload_done``.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
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
    ``footprint`` (gpu -> bytes held when resident) where known.
    """

    def park(self, tags: Sequence[str] = ..., *, verify: bool | None = ...) -> Any: ...

    def unpark(self, tags: Sequence[str] = ..., *, verify: bool | None = ...) -> Any: ...


def run_directive(executor: OffloadExecutor | None, data: Mapping[str, Any]) -> dict[str, Any]:
    """Carry out one ``offload`` push; returns the args of the ``offload_done`` request.

    Runs in a worker thread: the copies block. A client without an executor
    has nothing registered and answers at once with zero bytes.
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
        move = executor.park if action == "park" else executor.unpark
        stats = move(tags, verify=verify)
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
