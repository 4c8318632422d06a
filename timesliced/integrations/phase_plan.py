"""The phase hooks' rules, pure: which locks a phase's begin or end gives back and takes.

Roles are ``"trainer"`` and ``"sampler"`` (a colocated run has only the trainer's lock, which every
phase takes). A rollout needs the sampler's lock, a train phase the trainer's, a weight sync both;
a phase inside another needs what both need. Both locks are only ever taken together, as one gang;
one lock is never held while the other is asked for (see ``phases`` for why), so:

- a weight sync inside a train or rollout phase gives back the one lock held, then takes both;
- a rollout inside a train phase, or a train phase inside a rollout, is refused (``ValueError``);
- an end gives back what the phases still open do not need.

The shells (``PhaseHooks``, ``AsyncPhaseHooks``) carry a ``Step`` out: ``release`` first, then
``take`` (two roles: one gang, the trainer first); ``held`` is what they hold after it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

TRAINER = "trainer"
SAMPLER = "sampler"


class Phase(enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    WEIGHT_SYNC = "weight_sync"


_NEEDS = {
    Phase.ROLLOUT: frozenset({SAMPLER}),
    Phase.TRAIN: frozenset({TRAINER}),
    Phase.WEIGHT_SYNC: frozenset({TRAINER, SAMPLER}),
}


@dataclass(frozen=True)
class Step:
    """What a begin or an end does: give back ``release``, then take ``take``; ``held`` after it."""

    release: frozenset[str]
    take: frozenset[str]
    held: frozenset[str]

    @property
    def gang(self) -> bool:
        """Both locks are taken: as one gang."""
        return len(self.take) == 2


def needs(stack: Iterable[Phase], colocated: bool) -> frozenset[str]:
    """The locks the open phases ``stack`` need together."""
    phases = list(stack)
    if colocated:
        return frozenset({TRAINER}) if phases else frozenset()
    out: frozenset[str] = frozenset()
    for phase in phases:
        out |= _NEEDS[phase]
    return out


def begin(stack: tuple[Phase, ...], held: frozenset[str], phase: Phase, colocated: bool) -> Step:
    """The step that begins ``phase`` inside ``stack`` holding ``held``.

    Raises ``ValueError`` for a rollout inside a train phase or the reverse.
    """
    want = needs((*stack, phase), colocated)
    missing = want - held
    if not missing:
        return Step(frozenset(), frozenset(), held)
    if phase is not Phase.WEIGHT_SYNC and held:
        raise ValueError(
            f"a {phase.value} phase cannot begin inside a {stack[-1].value} phase: it would hold one pool's "
            "lock while waiting for the other's, which can deadlock; end it first, or use weight_sync() "
            "for work that needs both pools"
        )
    if len(want) == 2:
        return Step(held, want, want)  # give back the one held, take both as a gang
    return Step(frozenset(), missing, want)


def end(stack: tuple[Phase, ...], held: frozenset[str], phase: Phase, colocated: bool) -> Step:
    """The step that ends ``phase``, the innermost of ``stack``. Raises ``ValueError`` if it is not."""
    if not stack or stack[-1] is not phase:
        open_ = stack[-1].value if stack else "none"
        raise ValueError(f"end of {phase.value} while the innermost phase is {open_}: end phases in reverse order")
    keep = needs(stack[:-1], colocated)
    return Step(held - keep, frozenset(), held & keep)


def retake(stack: tuple[Phase, ...], colocated: bool) -> frozenset[str]:
    """After a gang that failed inside ``stack``: the one lock to take back for the open phases."""
    return needs(stack, colocated)
