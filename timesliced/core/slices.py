"""Maximum slices: how long a holder may keep its group while others wait, and what then (pure).

Past its ``max_slice`` a holder is warned once (``slice_overdue``); under ``preempt`` it loses the
lock ``grace`` seconds later, is parked and queued again. The policies only judge; the arbiter
carries out what they find.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import Group


@dataclass(frozen=True)
class SlicePolicy:
    """How long a holder may keep its group while others wait, and what happens then.

    Past ``max_slice`` the holder is warned (``slice_overdue``); with action
    ``preempt`` it is parked ``grace`` seconds later and queued again.
    """

    max_slice: float
    action: str = "warn"  # "warn" | "preempt"
    grace: float = 10.0

    def __post_init__(self) -> None:
        if not self.max_slice > 0 or not self.grace >= 0:
            raise ValueError("a maximum slice must be > 0 s and its grace >= 0 s")
        if self.action not in ("warn", "preempt"):
            raise ValueError(f"slice action must be 'warn' or 'preempt', not {self.action!r}")

    def due(self, group: Group) -> float | None:
        """When the holder of ``group``, with others waiting, is due its warning or its preemption."""
        if group.holder is None:
            return None
        if group.overdue_since is None:
            return group.held_since + self.max_slice
        if self.action == "preempt":
            return group.overdue_since + self.grace
        return None

    def check(self, group: Group, now: float) -> Overdue | None:
        """What is due at ``now`` for the holder of ``group``, with others waiting, if anything."""
        if now < group.held_since + self.max_slice:
            return None
        held = now - group.held_since
        data: dict[str, object] = {"group": group.name, "fence": group.fence, "held_s": held}
        data.update(max_slice_s=self.max_slice, action=self.action)
        warning = None
        if group.overdue_since is None:
            why = f"held group {group.name!r} for {held:.1f} s, past its maximum slice of {self.max_slice:g} s"
            if self.action == "preempt":
                why += f"; it is parked in {self.grace:g} s unless it yields"
            warning = {**data, "reason": why + " (others wait)"}
        since = now if group.overdue_since is None else group.overdue_since
        preempt = None
        if self.action == "preempt" and now >= since + self.grace:
            preempt = (
                f"preempted: held group {group.name!r} for {held:.1f} s, past its maximum slice of "
                f"{self.max_slice:g} s, while others waited; queued again"
            )
        return Overdue(data, warning, preempt)


@dataclass(frozen=True)
class Overdue:
    """A holder past its slice: the warning to push (the first time only), and why it is preempted now, if so."""

    data: dict[str, object]  # group, fence, held_s, max_slice_s, action
    warning: dict[str, object] | None
    preempt: str | None


class SlicePolicies:
    """The policy of each group (``"*"``: every other group's)."""

    def __init__(self, policies: dict[str, SlicePolicy]) -> None:
        self.policies = policies

    def policy(self, group: str) -> SlicePolicy | None:
        policies = self.policies
        return (policies.get(group) or policies.get("*")) if policies else None
