"""Switch-cost awareness: keep a yielded holder's turn when it will be back before a switch pays (pure).

A holder that yields while another job waits is normally switched out at once. When that switch
parks the holder (the waiter needs its room), and the holder's measured gaps (release to its next
acquire) are shorter than the switch away and back would take, the group keeps a turn for the
holder instead (``Waiter.anticipated``, at the head): if it asks again within the window it is
granted with nothing moved; if not, the turn lapses and the switch goes ahead. It is the
rent-or-buy choice: the window is at most the switch's own cost (and ``--anticipate``), so a holder
that does not come back costs the waiters no more than the switch it was meant to save.

The inputs are scheduling state, kept per job as moves and phases end while anticipation is on
(a scheduler without it keeps none, so its lock path does no more work): its last ``RECENT`` gaps
(``Job.gaps``) and move durations (``Job.move_times``). A job with fewer than ``MIN_SAMPLES`` of
either is never kept for. A switch's cost is twice the sum of the typical (median) move of every
job it moves now: the victims it parks and the waiter it restores, then as much again to come back.

Bound: every waiter that waits while a turn is kept (there when it is kept, or asking before its
holder is granted again: that grant goes before it too) is marked (``Waiter.delayed``) until it is
granted or stops waiting, and no turn is kept while any waiter of the group that asks is marked
(under ``priority`` or ``fair`` the policy's choice may be a waiter that came since, so looking at
the choice alone is not enough). So a waiter is passed by at most one kept holder per wait, under
every queue policy: its policy's bound grows by one grant and one window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..util.stats import median
from .location import Location
from .model import Job

RECENT = 8  # gaps and move durations kept per job
MIN_SAMPLES = 3  # of each, before a job is ever kept for


def recent(values: tuple[float, ...], value: float) -> tuple[float, ...]:
    """``values`` with ``value`` appended, the oldest dropped past ``RECENT``."""
    return (*values[-(RECENT - 1) :], value)


def typical(values: tuple[float, ...]) -> float | None:
    """The median of ``values``, or None with fewer than ``MIN_SAMPLES``."""
    return median(values) if len(values) >= MIN_SAMPLES else None


@dataclass(frozen=True)
class Keep:
    """Keep the holder's turn until ``until``: it is expected back after ``gap_s``; the switch costs ``switch_s``."""

    until: float
    gap_s: float
    switch_s: float


def decide(holder: Job, incoming: Job, victims: list[Job], now: float, max_keep_s: float) -> Keep | None:
    """Whether to keep ``holder``'s turn rather than park it (one of ``victims``) for ``incoming``."""
    if max_keep_s <= 0 or holder not in victims:
        return None
    gap = typical(holder.gaps)
    if gap is None:
        return None
    movers = [*victims, incoming] if incoming.location is Location.PARKED else victims
    costs = [typical(j.move_times) for j in movers]
    if any(c is None for c in costs):
        return None
    switch_s = 2 * sum(c for c in costs if c is not None)
    if gap >= switch_s:
        return None
    return Keep(now + min(switch_s, max_keep_s), gap, switch_s)
