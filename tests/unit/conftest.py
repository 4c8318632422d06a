"""The scheduler harness's fixtures: ``harness`` (a factory) and ``h`` (one GPU of 100 bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from timesliced.core.policy import QueuePolicy
from timesliced.core.slices import SlicePolicy

from ..helpers.harness import Harness


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    """A factory: ``harness(capacities, max_waiters=..., policies=..., queue_policies=...)``."""
    made: list[Harness] = []

    def make(
        capacities: dict[int, int] | None = None,
        *,
        max_waiters: int = 1024,
        policies: dict[str, SlicePolicy] | None = None,
        queue_policies: dict[str, QueuePolicy] | None = None,
    ) -> Harness:
        h = Harness(capacities, max_waiters=max_waiters, policies=policies, queue_policies=queue_policies)
        made.append(h)
        return h

    yield make
    for h in made:
        h.s.check_invariants()


@pytest.fixture
def h(harness: Callable[..., Harness]) -> Harness:
    """One GPU of 100 bytes."""
    return harness()
