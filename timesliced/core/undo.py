"""Taking back a step of the scheduler that raised, without copying its state (pure).

A step (one event and the grants and switches it leads to) changes a handful of fields; the
scheduler is far larger. So each write is preceded by a note of what it is about to change, and
a step that raises (a refused input, or a bug) is rolled back from those notes, newest first:
apply, then commit or roll back. A step that completes commits, which forgets the notes.

Each note is taken before its write, and its undo is right whether the write happened or not
(a step may fail between the two). The notes are cheap by design, since a step runs on every
lock request: the old values of a few named fields, a shallow copy of a small container (a
queue, a set of sessions), the old value under one key of a large one, or a heap entry to take
out or put back.

Figures and effects need no notes: figures are counted at commit (``figures.Figures``) and the
scheduler cuts its effect buffer back to where the step began.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


Entry = TypeVar("Entry", bound=_Ordered)

_MISSING = object()


class Fields:
    """Names of fields that steps write together, read in one call."""

    __slots__ = ("names", "read", "undo")

    def __init__(self, name: str, *more: str) -> None:
        self.names = (name, *more)
        get = operator.attrgetter(*self.names)
        self.read: Callable[[object], tuple[Any, ...]] = get if more else (lambda obj: (get(obj),))
        self.undo = self.restore  # bound once: a note is taken on every grant

    def restore(self, obj: object, values: tuple[Any, ...]) -> None:
        for name, value in zip(self.names, values, strict=True):
            setattr(obj, name, value)


class Journal:
    """The notes of the step under way."""

    __slots__ = ("_notes",)

    def __init__(self) -> None:
        self._notes: list[tuple[Callable[..., object], tuple[Any, ...]]] = []

    def fields(self, obj: object, fields: Fields) -> None:
        """``fields`` of ``obj`` are about to be assigned (a container assigned anew counts as a field)."""
        self._notes.append((fields.undo, (obj, fields.read(obj))))

    def keep_list(self, items: list[T]) -> None:
        """``items`` is about to change in place."""
        self._notes.append((_refill_list, (items, items.copy())))

    def keep_set(self, items: set[T]) -> None:
        self._notes.append((_refill_set, (items, items.copy())))

    def keep_dict(self, items: dict[K, V]) -> None:
        self._notes.append((_refill_dict, (items, items.copy())))

    def keep_key(self, items: dict[K, V], key: K) -> None:
        """``key`` is about to be added to ``items``, or its value replaced (for a key that goes: ``delete``)."""
        self._notes.append((_put_back, (items, key, items.get(key, _MISSING))))

    def delete(self, items: dict[K, V], key: K) -> V:
        """Take ``key`` out of ``items``; returns its value. Undone, the key is back in its place.

        The order of a dict can matter (jobs and groups are visited in it): a key put back
        would go last, so unless it is the last already the whole dict is noted.
        """
        if next(reversed(items)) == key:
            self._notes.append((_put_back, (items, key, items[key])))
        else:
            self._notes.append((_refill_dict, (items, items.copy())))
        return items.pop(key)

    def push(self, heap: list[Entry], entry: Entry) -> None:
        """Push ``entry`` on ``heap`` (noted first, as every write)."""
        self._notes.append((_unpush, (heap, entry, len(heap))))
        heapq.heappush(heap, entry)

    def pop(self, heap: list[Entry]) -> Entry:
        """Pop the least entry off ``heap``."""
        self._notes.append((_unpop, (heap, heap[0], len(heap))))
        return heapq.heappop(heap)

    def rollback(self) -> None:
        """Put back everything noted, newest first (plain assignments: nothing here can fail)."""
        notes = self._notes
        while notes:
            undo, args = notes.pop()
            undo(*args)

    def commit(self) -> None:
        self._notes.clear()

    def __len__(self) -> int:
        return len(self._notes)


def _refill_list(items: list[Any], saved: list[Any]) -> None:
    items[:] = saved


def _refill_set(items: set[Any], saved: set[Any]) -> None:
    items.clear()
    items.update(saved)


def _refill_dict(items: dict[Any, Any], saved: dict[Any, Any]) -> None:
    items.clear()
    items.update(saved)


def _put_back(items: dict[Any, Any], key: Any, old: Any) -> None:
    if old is _MISSING:
        items.pop(key, None)
    else:
        items[key] = old


def _unpush(heap: list[Any], entry: Any, size: int) -> None:
    if len(heap) > size:  # pushed (equal entries are alike: which one goes does not matter)
        heap.remove(entry)  # on a rollback only: O(n) there keeps the push O(log n)
        heapq.heapify(heap)


def _unpop(heap: list[Any], entry: Any, size: int) -> None:
    if len(heap) < size:
        heapq.heappush(heap, entry)
