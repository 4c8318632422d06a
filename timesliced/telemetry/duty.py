"""One GPU's duty cycle and memory use over a sliding window (pure: every call takes ``now``)."""

from __future__ import annotations

import enum
import math
from collections import deque


class _Feed(enum.Enum):
    SAMPLES = "samples"
    TRANSITIONS = "transitions"


class DutyWindow:
    """Duty cycle and memory use of one GPU over time. Pure: every call takes ``now``.

    Duty is the fraction of time the GPU was busy. A window is fed one of two ways,
    never both (mixing raises ``ValueError``):

    - :meth:`observe`: a measured duty (0..1) for the time since the previous
      observation, as a sampler sees it. The first observation covers no time. A
      gap longer than ``max_gap`` is not filled in: the observation then counts
      for the last ``max_gap`` seconds only, and the rest is a hole in the record.
    - :meth:`set_busy`: busy/idle transitions. A state holds until the next
      transition, so a query at ``now`` counts the time since the last
      transition in the current state.

    Averages divide busy time by the time with data in the window, so a window
    that began recording ten seconds ago averages over those ten seconds.

    Bounded: spans and memory points older than ``history`` seconds are dropped,
    and at most ``max_spans`` / ``max_points`` are kept (oldest dropped first).
    Times of each kind of input must not decrease (``ValueError``).
    """

    def __init__(
        self, *, history: float = 600.0, max_gap: float = 5.0, max_spans: int = 4096, max_points: int = 4096
    ) -> None:
        if history <= 0 or max_gap <= 0:
            raise ValueError(f"history and max_gap must be positive, not {history} and {max_gap}")
        if max_spans < 1 or max_points < 2:
            raise ValueError(f"max_spans must be >= 1 and max_points >= 2, not {max_spans} and {max_points}")
        self.history = history
        self.max_gap = max_gap
        # Closed spans (start, end, duty), in time order, never overlapping.
        self._spans: deque[tuple[float, float, float]] = deque(maxlen=max_spans)
        self._feed: _Feed | None = None
        # samples: time and duty of the latest observation;
        # transitions: start and duty (1.0 / 0.0) of the open span, which runs until "now".
        self._fed_at: float | None = None
        self._duty = 0.0
        # Memory as a step function: (time, bytes) where the value changed.
        self._memory: deque[tuple[float, int]] = deque(maxlen=max_points)
        self._memory_at: float | None = None

    # --- inputs ------------------------------------------------------------------------

    def observe(self, duty: float, now: float, memory_used: int | None = None) -> None:
        """A sampled duty (0..1) for the period since the previous observation, and optionally memory."""
        if not 0.0 <= duty <= 1.0:
            raise ValueError(f"duty must be within 0..1, not {duty}")
        self._check_duty(_Feed.SAMPLES, now)
        if memory_used is not None:
            self._check_memory(memory_used, now)
        self._feed = _Feed.SAMPLES
        if self._fed_at is not None:
            self._add_span(max(self._fed_at, now - self.max_gap), now, duty)
        self._fed_at, self._duty = now, duty
        if memory_used is not None:
            self.set_memory(memory_used, now)
        self._prune(now)

    def set_busy(self, busy: bool, now: float) -> None:
        """The GPU became busy (``True``) or idle at ``now``; repeating the current state changes nothing."""
        self._check_duty(_Feed.TRANSITIONS, now)
        self._feed = _Feed.TRANSITIONS
        state = 1.0 if busy else 0.0
        if self._fed_at is not None:
            if state == self._duty:
                return
            self._add_span(self._fed_at, now, self._duty)
        self._fed_at, self._duty = now, state
        self._prune(now)

    def set_memory(self, used: int, now: float) -> None:
        """Device memory in use at ``now``, in bytes."""
        self._check_memory(used, now)
        self._memory_at = now
        if not self._memory or self._memory[-1][1] != used:
            self._memory.append((now, used))
        self._prune(now)

    # --- queries -----------------------------------------------------------------------

    @property
    def fed_at(self) -> float | None:
        """Time of the latest sample, or of the latest state change; None before any duty input."""
        return self._fed_at

    def duty_now(self, now: float) -> float | None:
        """The current duty: the latest sample (None once older than ``max_gap``) or the current state."""
        if self._fed_at is None:
            return None
        if self._feed is _Feed.SAMPLES and now - self._fed_at > self.max_gap:
            return None
        return self._duty

    def mean_duty(self, now: float, window: float) -> float | None:
        """Mean duty over ``[now - window, now]``; None when nothing in it has data."""
        busy, covered = self._integrate(now - _positive(window, "window"), now)
        return busy / covered if covered > 0 else None

    def coverage(self, now: float, window: float) -> float:
        """Seconds of ``[now - window, now]`` that have duty data."""
        return self._integrate(now - _positive(window, "window"), now)[1]

    def duty_series(self, now: float, window: float, step: float) -> list[tuple[float, float | None]]:
        """(start, mean duty) of consecutive ``step``-long slots ending at ``now``, oldest first."""
        n = math.ceil(_positive(window, "window") / _positive(step, "step") - 1e-9)
        if n > 100_000:
            raise ValueError(f"window / step gives {n} slots; at most 100000")
        out: list[tuple[float, float | None]] = []
        for i in range(n, 0, -1):
            lo = now - i * step
            busy, covered = self._integrate(lo, lo + step)
            out.append((lo, busy / covered if covered > 0 else None))
        return out

    def memory_now(self) -> int | None:
        """The latest memory figure, or None."""
        return self._memory[-1][1] if self._memory else None

    def memory_series(self, now: float, window: float) -> list[tuple[float, int]]:
        """Memory in use over ``[now - window, now]`` as (time, bytes) steps, oldest first.

        Each value holds until the next point; when a value was already in force at
        the window's start, the series begins with it at ``now - window``.
        """
        lo = now - _positive(window, "window")
        out: list[tuple[float, int]] = []
        before: int | None = None
        for t, used in self._memory:
            if t < lo:
                before = used
            elif t <= now:
                out.append((t, used))
        if before is not None and (not out or out[0][0] > lo):
            out.insert(0, (lo, before))
        return out

    # --- internals ---------------------------------------------------------------------

    def _check_duty(self, feed: _Feed, now: float) -> None:
        if self._feed is not None and self._feed is not feed:
            raise ValueError(f"this window is fed {self._feed.value}; it cannot also take {feed.value}")
        if self._fed_at is not None and now < self._fed_at:
            raise ValueError(f"time went backwards: {now} after {self._fed_at}")

    def _check_memory(self, used: int, now: float) -> None:
        if used < 0:
            raise ValueError(f"memory used must be >= 0, not {used}")
        if self._memory_at is not None and now < self._memory_at:
            raise ValueError(f"time went backwards: {now} after {self._memory_at}")

    def _add_span(self, start: float, end: float, duty: float) -> None:
        if end <= start:
            return
        if self._spans:
            a, b, d = self._spans[-1]
            if b == start and d == duty:
                self._spans[-1] = (a, end, duty)
                return
        self._spans.append((start, end, duty))

    def _prune(self, now: float) -> None:
        horizon = now - self.history
        while self._spans and self._spans[0][1] <= horizon:
            self._spans.popleft()
        # Keep the last point before the horizon: it is the value in force there.
        while len(self._memory) >= 2 and self._memory[1][0] <= horizon:
            self._memory.popleft()

    def _integrate(self, lo: float, hi: float) -> tuple[float, float]:
        """(busy seconds, seconds with data) within ``[lo, hi]``."""
        busy = covered = 0.0
        if self._feed is _Feed.TRANSITIONS and self._fed_at is not None:
            a = max(self._fed_at, lo)
            if hi > a:
                busy += (hi - a) * self._duty
                covered += hi - a
        for a, b, duty in reversed(self._spans):
            if b <= lo:
                break
            if a >= hi:
                continue
            d = min(b, hi) - max(a, lo)
            busy += d * duty
            covered += d
        return busy, covered


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be positive, not {value}")
    return value
