"""Where a job's device state lives, and the one table of how it may change (pure).

Every change of a job's location, in the scheduler and in a cluster node's picture of its own
jobs, goes through ``moved``: a change the table does not allow is a bug and raises before
anything changes. The table reads as a state diagram::

    resident --snapshot starts--> parking --ok--> parked --restore starts--> restoring --ok--> resident
                                  parking --failed--> resident            restoring --failed--> parked
                                                                          restoring --failed, outcome
                                                                                      unknown--> resident

A move that finds nothing to do (a snapshot of a job already parked on this node, a restore of one
already resident) ends where it started.
"""

from __future__ import annotations

import enum


class Location(enum.Enum):
    """Where a job's device state lives on this node."""

    RESIDENT = "resident"
    PARKING = "parking"
    PARKED = "parked"
    RESTORING = "restoring"

    @property
    def occupies_device(self) -> bool:
        return self is not Location.PARKED

    @property
    def moving(self) -> bool:
        return self in (Location.PARKING, Location.RESTORING)


class Cause(enum.Enum):
    """Why a location changes."""

    SNAPSHOT_STARTED = "snapshot started"
    SNAPSHOT_DONE = "snapshot done"
    SNAPSHOT_FAILED = "snapshot failed"  # the backend keeps the job resident
    RESTORE_STARTED = "restore started"
    RESTORE_DONE = "restore done"
    RESTORE_FAILED = "restore failed"  # the backend keeps the job parked
    RESTORE_UNKNOWN = "restore outcome unknown"  # a node did not answer: its memory counts as taken


L, C = Location, Cause
TRANSITIONS: dict[tuple[Location, Cause], Location] = {
    (L.RESIDENT, C.SNAPSHOT_STARTED): L.PARKING,
    (L.PARKING, C.SNAPSHOT_DONE): L.PARKED,
    (L.PARKING, C.SNAPSHOT_FAILED): L.RESIDENT,
    (L.PARKED, C.RESTORE_STARTED): L.RESTORING,
    (L.RESTORING, C.RESTORE_DONE): L.RESIDENT,
    (L.RESTORING, C.RESTORE_FAILED): L.PARKED,
    (L.RESTORING, C.RESTORE_UNKNOWN): L.RESIDENT,
    # a move with nothing to do on this node
    (L.PARKED, C.SNAPSHOT_DONE): L.PARKED,
    (L.RESIDENT, C.RESTORE_DONE): L.RESIDENT,
}
del L, C


class IllegalTransition(ValueError):
    """A location change the table does not allow: a bug in the caller, raised before anything changed."""


def moved(current: Location, cause: Cause) -> Location:
    """Where a job at ``current`` is after ``cause``; raises ``IllegalTransition``."""
    target = TRANSITIONS.get((current, cause))
    if target is None:
        raise IllegalTransition(f"a job that is {current.value} cannot have its {cause.value}")
    return target
