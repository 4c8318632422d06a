"""timesliced: co-operative GPU time-slicing for LLM post-training jobs."""

from __future__ import annotations

__version__ = "0.1.0"

from .client import AsyncClient, Client, Grant
from .errors import (
    AcquireCancelled,
    AcquireTimeout,
    ConnectionLost,
    JobFaulted,
    NotHolder,
    NotResident,
    OutOfMemory,
    ProtocolError,
    TimeslicedError,
)

__all__ = [
    "AcquireCancelled",
    "AcquireTimeout",
    "AsyncClient",
    "Client",
    "ConnectionLost",
    "Grant",
    "JobFaulted",
    "NotHolder",
    "NotResident",
    "OutOfMemory",
    "ProtocolError",
    "TimeslicedError",
    "__version__",
]
