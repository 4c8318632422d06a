"""asyncio names that arrived in Python 3.11, with a backport on 3.10."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup, timeout
else:  # pragma: no cover - exercised only on Python 3.10
    from taskgroup import TaskGroup, timeout

__all__ = ["TaskGroup", "timeout"]
