"""Reservations and the mappings inside them: the rules of CUDA virtual memory, as bookkeeping (pure)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from ...errors import BackendError, NotResident


@dataclass(frozen=True)
class Span:
    """A virtual address range on one GPU."""

    va: int
    nbytes: int
    gpu: int

    @property
    def end(self) -> int:
        return self.va + self.nbytes


class _Spans:
    """Non-overlapping spans, sorted by address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._spans: dict[int, Span] = {}

    def __iter__(self) -> Iterator[Span]:
        return (self._spans[va] for va in self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    def at(self, va: int) -> Span | None:
        """The span that contains ``va``."""
        i = bisect.bisect_right(self._starts, va) - 1
        if i >= 0:
            span = self._spans[self._starts[i]]
            if va < span.end:
                return span
        return None

    def overlaps(self, va: int, nbytes: int) -> bool:
        i = bisect.bisect_left(self._starts, va + nbytes)
        return i > 0 and self._spans[self._starts[i - 1]].end > va

    def inside(self, outer: Span) -> list[Span]:
        lo = bisect.bisect_left(self._starts, outer.va)
        hi = bisect.bisect_left(self._starts, outer.end)
        return [self._spans[va] for va in self._starts[lo:hi]]

    def add(self, span: Span) -> None:
        bisect.insort(self._starts, span.va)
        self._spans[span.va] = span

    def remove(self, span: Span) -> None:
        self._starts.remove(span.va)
        del self._spans[span.va]


class AddressSpace:
    """Bookkeeping of reservations and the mappings inside them (no memory of its own).

    It enforces the rules of CUDA virtual memory management that both
    implementations share: a mapping lies inside one reservation and
    overlaps no other mapping; an unmap names exactly one earlier mapping;
    a reservation is released whole and only when nothing in it is mapped.
    Violations raise ``BackendError`` and change nothing.
    """

    def __init__(self) -> None:
        self.reservations = _Spans()
        self.mappings = _Spans()

    def reserve(self, va: int, nbytes: int, gpu: int) -> Span:
        if nbytes <= 0 or self.reservations.overlaps(va, nbytes):
            raise BackendError(f"cannot reserve {nbytes} bytes at {va:#x}", call="reserve", va=va)
        span = Span(va, nbytes, gpu)
        self.reservations.add(span)
        return span

    def unreserve(self, va: int, nbytes: int) -> Span:
        span = self.reservations.at(va)
        if span is None or span.va != va or span.nbytes != nbytes:
            raise BackendError(f"no reservation of {nbytes} bytes at {va:#x}", call="release_reservation", va=va)
        if self.mappings.inside(span):
            raise BackendError(f"reservation at {va:#x} still has mapped memory", call="release_reservation", va=va)
        self.reservations.remove(span)
        return span

    def map(self, va: int, nbytes: int) -> Span:
        res = self.reservations.at(va)
        if res is None or nbytes <= 0 or va + nbytes > res.end:
            raise BackendError(f"[{va:#x}, +{nbytes}) is not inside one reservation", call="map", va=va)
        if self.mappings.overlaps(va, nbytes):
            raise BackendError(f"[{va:#x}, +{nbytes}) is already mapped", call="map", va=va)
        span = Span(va, nbytes, res.gpu)
        self.mappings.add(span)
        return span

    def unmap(self, va: int, nbytes: int) -> Span:
        span = self.mappings.at(va)
        if span is None or span.va != va or span.nbytes != nbytes:
            raise BackendError(f"[{va:#x}, +{nbytes}) is not a mapping", call="unmap", va=va)
        self.mappings.remove(span)
        return span

    def resolve(self, va: int, nbytes: int) -> Span:
        """The mapping that holds all of ``[va, va + nbytes)``.

        Raises ``NotResident`` when the address is reserved but not mapped
        (parked memory) and ``BackendError`` for any other address.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must not be negative, got {nbytes}")
        span = self.mappings.at(va)
        if span is not None and va + nbytes <= span.end:
            return span
        if span is None and self.reservations.at(va) is not None:
            raise NotResident(f"device memory at {va:#x} is not mapped (parked)", va=va)
        raise BackendError(f"illegal address: [{va:#x}, +{nbytes}) is not mapped device memory", va=va)

    def mapped_bytes(self, gpu: int | None = None) -> int:
        return sum(s.nbytes for s in self.mappings if gpu is None or s.gpu == gpu)
