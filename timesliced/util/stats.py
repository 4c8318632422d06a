"""The one percentile of the project (pure): every median and p95/p99 it reports comes from here."""

from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation between ranks; None for no values.

    Raises ``ValueError`` for ``q`` outside 0..1.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is between 0 and 1, not {q!r}")
    data = sorted(values)
    if not data:
        return None
    pos = q * (len(data) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 0.5)
