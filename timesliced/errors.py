"""The one exception tree of timesliced.

Every error that can cross the wire has a stable ``code``. The daemon maps
exceptions to error frames at one boundary (``to_wire``) and the client maps
them back (``from_wire``), so user code catches the same classes whether the
failure happened in its own process or in the daemon.

Misuse of the Python API (wrong argument types, negative sizes) raises
builtins such as ``ValueError`` instead.
"""

from __future__ import annotations

from typing import Any


class TimeslicedError(Exception):
    """Base class of every timesliced error."""

    code = "error"

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        self.details = details


# --- connection and protocol ---------------------------------------------------------


class ConnectionLost(TimeslicedError):
    """The connection to the daemon was lost or could not be made."""

    code = "connection_lost"


class ProtocolError(TimeslicedError):
    """A message broke the wire protocol."""

    code = "protocol_error"


class FrameTooLarge(ProtocolError):
    """A frame exceeded the maximum frame size."""

    code = "frame_too_large"


class MalformedMessage(ProtocolError):
    """A frame was not a valid msgpack map."""

    code = "malformed_message"


class BadRequest(ProtocolError):
    """A request had missing or wrongly typed fields."""

    code = "bad_request"


class UnknownOp(ProtocolError):
    """A request named an operation the daemon does not know."""

    code = "unknown_op"


class VersionMismatch(ProtocolError):
    """Client and daemon speak incompatible protocol versions."""

    code = "version_mismatch"


class HandshakeRequired(ProtocolError):
    """A connection sent a request before its hello."""

    code = "handshake_required"


# --- jobs, groups and locks ----------------------------------------------------------


class NotRegistered(TimeslicedError):
    """The connection has not registered a job yet."""

    code = "not_registered"


class AlreadyRegistered(TimeslicedError):
    """The connection already registered a (different) job."""

    code = "already_registered"


class GroupMismatch(TimeslicedError):
    """The job or group is already known with a different configuration."""

    code = "group_mismatch"


class UnknownDevice(TimeslicedError):
    """A GPU index that this daemon or group does not have."""

    code = "unknown_device"


class UnknownGroup(TimeslicedError):
    """No group of that name exists."""

    code = "unknown_group"


class UnknownJob(TimeslicedError):
    """No job of that name is registered."""

    code = "unknown_job"


class GroupDraining(TimeslicedError):
    """The group is drained by an administrator: it grants nothing until it is resumed."""

    code = "group_draining"


class NotHolder(TimeslicedError):
    """Only the holder of a group's lock can yield it."""

    code = "not_holder"


class AcquireTimeout(TimeslicedError):
    """The lock was not granted before the acquire's timeout."""

    code = "acquire_timeout"


class AcquireCancelled(TimeslicedError):
    """The acquire was cancelled before the lock was granted."""

    code = "acquire_cancelled"


class GangWaiting(TimeslicedError):
    """A party that went before a waiting gang, and has held one of its groups since, asked to go before it again."""

    code = "gang_waiting"


class JobFaulted(TimeslicedError):
    """The job's GPU state is damaged or unknown after a failed move; it is faulted until an operator resumes it."""

    code = "job_faulted"


class PreemptionUnsafe(TimeslicedError):
    """The group preempts holders, and the job's parking method cannot park a process that did not yield."""

    code = "preempt_unsafe"


class SwitchFailed(TimeslicedError):
    """The switch to this job could not be made (a park or a restore failed, or room cannot be made now)."""

    code = "switch_failed"


class LimitExceeded(TimeslicedError):
    """A configured limit (connections, waiters, regions) was reached."""

    code = "limit_exceeded"


class PermissionDenied(TimeslicedError):
    """The caller is not allowed to do this."""

    code = "permission_denied"


# --- device memory and backends ------------------------------------------------------


class OutOfMemory(TimeslicedError):
    """A device allocation does not fit in the device's free memory."""

    code = "out_of_memory"


class NotResident(TimeslicedError):
    """Device memory was touched while its job's state is not on the device."""

    code = "not_resident"


class UnknownRegion(TimeslicedError):
    """No such device region for this job."""

    code = "unknown_region"


class BackendError(TimeslicedError):
    """A backend operation (snapshot, restore, allocation) failed."""

    code = "backend_error"


class BackendUnavailable(BackendError):
    """The parking method cannot run on this node (no driver, too old a driver, missing package)."""

    code = "backend_unavailable"


class BackendTimeout(BackendError):
    """A backend operation did not finish within its timeout."""

    code = "backend_timeout"


class StateIntact:
    """A marker for a failed move that left the job's state intact where it was.

    A backend raises an error that is also a ``StateIntact`` (``ParkRefused``, ``RestoreRefused``,
    ``InsufficientHostMemory``, or a class of its own that inherits this marker) when it knows that
    the job is still whole where the move began: a snapshot that did not start or was rolled back
    (the job is resident and runs on), a restore that left the parked copy untouched. The scheduler
    then keeps the job usable and retries later; any other failure faults the job (its state is
    damaged or unknown) until an operator resumes it.
    """


class ParkRefused(BackendError, StateIntact):
    """A backend did not park the job, and its state is intact where it was (still on its GPUs)."""

    code = "park_refused"


class RestoreRefused(BackendError, StateIntact):
    """A backend did not restore the job, and its parked state is intact (in host memory)."""

    code = "restore_refused"


class InsufficientMemory(BackendError, StateIntact):
    """A restore was refused, before it touched anything, because a GPU lacks the free memory the job needs."""

    code = "insufficient_memory"


class InsufficientHostMemory(TimeslicedError, StateIntact):
    """The host cannot hold the parked state a park needs (host memory, a cgroup's limit, the budget)."""

    code = "insufficient_host_memory"


def state_intact(exc: BaseException) -> bool:
    """Whether a failed move's ``exc`` says that the job's state is intact where the move began."""
    return isinstance(exc, StateIntact)


class EndpointError(BackendError):
    """An inference engine's HTTP endpoint refused, failed or did not answer."""

    code = "endpoint_error"


class InternalError(TimeslicedError):
    """The daemon hit an unexpected error while serving the request."""

    code = "internal"


def _all_subclasses(cls: type[TimeslicedError]) -> list[type[TimeslicedError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


ERRORS_BY_CODE: dict[str, type[TimeslicedError]] = {c.code: c for c in _all_subclasses(TimeslicedError)}
assert len(ERRORS_BY_CODE) == len(_all_subclasses(TimeslicedError)), "error codes must be unique"


def to_wire(exc: TimeslicedError) -> dict[str, Any]:
    """The ``error`` map of a reply frame for ``exc``."""
    out: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if exc.details:
        out["details"] = exc.details
    return out


def from_wire(error: Any) -> TimeslicedError:
    """Rebuild the exception a daemon sent; unknown codes become the base class."""
    if not isinstance(error, dict):
        return ProtocolError(f"malformed error in reply: {error!r}")
    code = error.get("code")
    message = error.get("message")
    details = error.get("details")
    cls = ERRORS_BY_CODE.get(code, TimeslicedError) if isinstance(code, str) else TimeslicedError
    exc = cls(str(message) if message is not None else "")
    if isinstance(details, dict):
        exc.details = details
    if cls is TimeslicedError and isinstance(code, str):
        exc.code = code  # keep a newer daemon's code visible to the caller
    return exc
