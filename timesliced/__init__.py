"""timesliced: co-operative GPU time-slicing for LLM post-training jobs.

``import timesliced`` loads the client library and the wire protocol only, so that training code
pays for nothing else; the daemon's parts are imported on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .client import AsyncClient, Client, Grant
from .client.gang import gang, gang_async
from .errors import (  # every class of the exception tree (errors.py is loaded anyway)
    AcquireCancelled,
    AcquireTimeout,
    AlreadyRegistered,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    ConnectionLost,
    EndpointError,
    FrameTooLarge,
    GangWaiting,
    GroupDraining,
    GroupMismatch,
    HandshakeRequired,
    InsufficientHostMemory,
    InsufficientMemory,
    InternalError,
    JobFaulted,
    LimitExceeded,
    MalformedMessage,
    NotHolder,
    NotRegistered,
    NotResident,
    OutOfMemory,
    ParkRefused,
    PermissionDenied,
    PreemptionUnsafe,
    ProtocolError,
    RestoreRefused,
    StateIntact,
    SwitchFailed,
    TimeslicedError,
    UnknownDevice,
    UnknownGroup,
    UnknownJob,
    UnknownOp,
    UnknownRegion,
    VersionMismatch,
)
from .version import __version__
from .wire.park import ParkSpec

if TYPE_CHECKING:
    from .config import DaemonConfig
    from .daemon.embedded import EmbeddedDaemon
    from .daemon.root import Daemon

# name -> the module that defines it, imported when the name is first used
_LAZY = {
    "Daemon": "timesliced.daemon.root",
    "DaemonConfig": "timesliced.config",
    "EmbeddedDaemon": "timesliced.daemon.embedded",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'timesliced' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AcquireCancelled",
    "AcquireTimeout",
    "AlreadyRegistered",
    "AsyncClient",
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "BadRequest",
    "Client",
    "ConnectionLost",
    "Daemon",
    "DaemonConfig",
    "EmbeddedDaemon",
    "EndpointError",
    "FrameTooLarge",
    "GangWaiting",
    "Grant",
    "GroupDraining",
    "GroupMismatch",
    "HandshakeRequired",
    "InsufficientHostMemory",
    "InsufficientMemory",
    "InternalError",
    "JobFaulted",
    "LimitExceeded",
    "MalformedMessage",
    "NotHolder",
    "NotRegistered",
    "NotResident",
    "OutOfMemory",
    "ParkRefused",
    "ParkSpec",
    "PermissionDenied",
    "PreemptionUnsafe",
    "ProtocolError",
    "RestoreRefused",
    "StateIntact",
    "SwitchFailed",
    "TimeslicedError",
    "UnknownDevice",
    "UnknownGroup",
    "UnknownJob",
    "UnknownOp",
    "UnknownRegion",
    "VersionMismatch",
    "__version__",
    "gang",
    "gang_async",
]
