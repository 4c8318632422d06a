"""Taking back a step of the scheduler that raised, without copying its state (pure).

A step (one event and the grants and switches it leads to) changes a handful of fields; the
scheduler is far larger. So each write is preceded by a note of what it is about to change, and
a step that raises (a refused input, or a bug) is rolled back from those notes, newest first:
apply, then commit or roll back. A step that completes commits, which forgets the notes.

The notes are cheap by design, since a step runs on every lock request: the old values of a
few named fields, a shallow copy of a small container (a queue, a set of sessions), the old
value under one key of a large one, or an inverse written by hand (a heap entry taken out).

Figures and effects need no notes: figures are counted at commit (``figures.Figures``) and the
scheduler cuts its effect buffer back to where the step began.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

_MISSING = object()


class Fields:
    """Names of fields that steps write together, read in one call."""

    __slots__ = ("names", "read")

    def __init__(self, name: str, *more: str) -> None:
        self.names = (name, *more)
        get = operator.attrgetter(*self.names)
        self.read: Callable[[object], tuple[Any, ...]] = get if more else (lambda obj: (get(obj),))

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
        self._notes.append((fields.restore, (obj, fields.read(obj))))

    def keep_list(self, items: list[T]) -> None:
        """``items`` is about to change in place."""
        self._notes.append((_refill_list, (items, items.copy())))

    def keep_set(self, items: set[T]) -> None:
        self._notes.append((_refill_set, (items, items.copy())))

    def keep_dict(self, items: dict[K, V]) -> None:
        self._notes.append((_refill_dict, (items, items.copy())))

    def keep_key(self, items: dict[K, V], key: K) -> None:
        """What ``items`` holds under ``key`` (or that it holds nothing) is about to change."""
        self._notes.append((_put_back, (items, key, items.get(key, _MISSING))))

    def pushed(self, heap: list[T], entry: T) -> None:
        """``entry`` was just pushed on ``heap``."""
        self._notes.append((_unpush, (heap, entry)))

    def popped(self, heap: list[T], entry: T) -> None:
        """``entry`` was just popped off ``heap``."""
        self._notes.append((heapq.heappush, (heap, entry)))

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


def _unpush(heap: list[Any], entry: Any) -> None:
    heap.remove(entry)  # on a rollback only: O(n) there keeps the push O(log n)
    heapq.heapify(heap)
