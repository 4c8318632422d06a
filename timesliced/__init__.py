"""timesliced: co-operative GPU time-slicing for LLM post-training jobs."""

from __future__ import annotations

__version__ = "0.1.0"

from .backends.base import ParkSpec
from .client import AsyncClient, Client, Grant
from .errors import (
    AcquireCancelled,
    AcquireTimeout,
    BackendError,
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
    "BackendError",
    "Client",
    "ConnectionLost",
    "Grant",
    "JobFaulted",
    "NotHolder",
    "NotResident",
    "OutOfMemory",
    "ParkSpec",
    "ProtocolError",
    "TimeslicedError",
    "__version__",
]
