"""Typed fields of the peer messages: how each is checked, written to the wire and read back (pure).

A peer message is a frozen dataclass whose fields each name their ``Field`` in their annotation
(``conn: Annotated[int, CONN]``). The field writes a value as plain msgpack values (``to_wire``) and
reads it back from what a peer sent (``from_wire``), refusing anything else with
``MalformedPeerMessage`` before any state is touched; the error names the field by its path
(``report.report.jobs[2].footprint['0']``). What this node builds is typed for mypy and not checked
again at run time: every message on the lock's path is built here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import reprlib
import typing
from collections.abc import Iterator
from typing import Any, ClassVar, NoReturn, TypeVar

MAX_INT = (1 << 63) - 1  # integers travel as msgpack int64
MAX_NAME = 256  # job and group names (the daemon takes no longer ones from its clients)
PLAIN_DEPTH = 8  # plain data (a client's result or push payload) nests no deeper

_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 60


class MalformedPeerMessage(ValueError):
    """A peer message the protocol does not allow; raised before anything changed. The text names the field."""


def refuse(path: str, what: str, value: Any) -> NoReturn:
    raise MalformedPeerMessage(f"{path or 'message'} must be {what}, not {_QUOTE.repr(value)}")


class Field:
    """One field's type and range: ``load`` reads a wire value (and refuses a wrong one), ``dump`` writes one."""

    what = "a value"

    def load(self, value: Any, path: str) -> Any:
        """The Python value for a wire value (normalised, e.g. an int as a float); raises ``MalformedPeerMessage``."""
        raise NotImplementedError

    def dump(self, value: Any) -> Any:
        """The wire value (plain msgpack data)."""
        return value


class Int(Field):
    def __init__(self, lo: int = 0, hi: int = MAX_INT) -> None:
        self.lo, self.hi = lo, hi
        self.what = f"an integer in [{lo}, {hi}]"

    def load(self, value: Any, path: str) -> int:
        # bool is an int subclass: ``True`` must not pass for 1
        if type(value) is not int or not self.lo <= value <= self.hi:
            refuse(path, self.what, value)
        return value


class Float(Field):
    """A finite number (an integer is taken as a float); ``any_sign``: negative too (a figure, not a duration)."""

    def __init__(self, *, any_sign: bool = False) -> None:
        self.lo = -math.inf if any_sign else 0.0
        self.what = "a finite number" if any_sign else "a finite number >= 0"

    def load(self, value: Any, path: str) -> float:
        if type(value) is float:
            number = value
        elif type(value) is int and -MAX_INT <= value <= MAX_INT:
            number = float(value)
        else:
            refuse(path, self.what, value)
        if not (self.lo <= number < math.inf and math.isfinite(number)):
            refuse(path, self.what, value)
        return number


class Flag(Field):
    what = "true or false"

    def load(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            refuse(path, self.what, value)
        return value


class Text(Field):
    """A string; ``name``: a non-empty one of at most ``MAX_NAME`` characters (a job, a group)."""

    def __init__(self, *, name: bool = False) -> None:
        self.name = name
        self.what = f"a string of 1 to {MAX_NAME} characters" if name else "a string"

    def load(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or (self.name and not 0 < len(value) <= MAX_NAME):
            refuse(path, self.what, value)
        return value


class Choice(Field):
    def __init__(self, *values: str) -> None:
        self.values = values
        self.what = f"one of {list(values)}"

    def load(self, value: Any, path: str) -> str:
        if value not in self.values or not isinstance(value, str):
            refuse(path, self.what, value)
        return value


class Enum(Field):
    """An ``enum.Enum`` member, written as its value."""

    def __init__(self, cls: type[enum.Enum]) -> None:
        self.cls = cls
        self.what = f"one of {[m.value for m in cls]}"

    def load(self, value: Any, path: str) -> enum.Enum:
        for member in self.cls:
            if type(value) is type(member.value) and member.value == value:
                return member
        refuse(path, self.what, value)

    def dump(self, value: Any) -> Any:
        return value.value


class Optional(Field):
    def __init__(self, inner: Field) -> None:
        self.inner = inner
        self.what = f"{inner.what} or null"

    def load(self, value: Any, path: str) -> Any:
        return None if value is None else self.inner.load(value, path)

    def dump(self, value: Any) -> Any:
        return None if value is None else self.inner.dump(value)


class Seq(Field):
    """A tuple of ``inner`` values, written as a list."""

    def __init__(self, inner: Field) -> None:
        self.inner = inner
        self.what = f"a list of {inner.what}"

    def load(self, value: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            refuse(path, self.what, value)
        return tuple(self.inner.load(v, f"{path}[{i}]") for i, v in enumerate(value))

    def dump(self, value: Any) -> Any:
        return [self.inner.dump(v) for v in value]


class Pair(Field):
    """A tuple of two values, written as a list of two."""

    def __init__(self, first: Field, second: Field) -> None:
        self.first, self.second = first, second
        self.what = f"a list of two: {first.what}, {second.what}"

    def load(self, value: Any, path: str) -> tuple[Any, Any]:
        if not isinstance(value, list) or len(value) != 2:
            refuse(path, self.what, value)
        return self.first.load(value[0], f"{path}[0]"), self.second.load(value[1], f"{path}[1]")

    def dump(self, value: Any) -> Any:
        return [self.first.dump(value[0]), self.second.dump(value[1])]


class Map(Field):
    """A dict of ``key`` to ``value``. Integer keys are written as decimal strings (msgpack maps of a
    peer message have string keys only)."""

    def __init__(self, key: Int | Text, value: Field) -> None:
        self.key, self.value = key, value
        self.what = f"a map of {key.what} to {value.what}"

    def load(self, value: Any, path: str) -> dict[Any, Any]:
        if not isinstance(value, dict):
            refuse(path, self.what, value)
        out = {}
        for k, v in value.items():
            if isinstance(self.key, Int):
                if not (isinstance(k, str) and k.isdecimal() and k.isascii() and len(k) <= 19):
                    refuse(f"{path} key", f"{self.key.what}, in decimal", k)
                key: Any = self.key.load(int(k), f"{path} key")
            else:
                key = self.key.load(k, f"{path} key")
            out[key] = self.value.load(v, f"{path}[{k!r}]")
        return out

    def dump(self, value: Any) -> Any:
        str_keys = isinstance(self.key, Int)
        return {(str(k) if str_keys else k): self.value.dump(v) for k, v in value.items()}


class Plain(Field):
    """Plain data a peer passes on to a client as it is (a result, a push's data): maps with string
    keys, lists, strings, booleans, integers, finite numbers, null; ``map_only``: a map at the top."""

    def __init__(self, *, map_only: bool = False) -> None:
        self.map_only = map_only
        self.what = "a map of plain data" if map_only else "plain data"

    def load(self, value: Any, path: str) -> Any:
        if self.map_only and not isinstance(value, dict):
            refuse(path, self.what, value)
        for where, item in _walk(value, path, PLAIN_DEPTH):
            if item is None or isinstance(item, (bool, str)):
                continue
            if type(item) is int and -MAX_INT - 1 <= item <= MAX_INT:
                continue
            if type(item) is float and math.isfinite(item):
                continue
            refuse(where, "plain data", item)
        return value


def _walk(value: Any, path: str, depth: int) -> Iterator[tuple[str, Any]]:
    """Every leaf of nested maps and lists, with its path; refuses non-string keys and deep nesting."""
    stack = [(value, path, 0)]
    while stack:
        item, where, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level == depth:
                refuse(where, f"nested at most {depth} levels deep", "...")
            if isinstance(item, dict):
                for k, v in item.items():
                    if not isinstance(k, str):
                        refuse(f"{where} key", "a string", k)
                    stack.append((v, f"{where}[{k!r}]", level + 1))
            else:
                stack.extend((v, f"{where}[{i}]", level + 1) for i, v in enumerate(item))
        else:
            yield where, item


class Nested(Field):
    """A ``Wire`` dataclass inside a message, written as its map."""

    def __init__(self, cls: type[Wire]) -> None:
        self.cls = cls
        self.what = f"a {cls.__name__} map"

    def load(self, value: Any, path: str) -> Wire:
        return self.cls.from_wire(value, path)

    def dump(self, value: Any) -> Any:
        return value.to_wire()


W = TypeVar("W", bound="Wire")


class Wire:
    """A frozen dataclass of ``Annotated`` fields, with ``to_wire()`` and ``from_wire()``.

    Every field is checked where a peer's map is read (``from_wire``): unknown keys are ignored, a
    missing or wrong one is refused. What this node builds itself is not checked again at run time
    (its types are mypy's to check): building messages is on the lock's path.
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]
    _kinds_cache: ClassVar[tuple[tuple[str, Field], ...] | None] = None

    @classmethod
    def kinds(cls) -> tuple[tuple[str, Field], ...]:
        """``(name, Field)`` of every field, in order: the ``Field`` its annotation carries."""
        cached: tuple[tuple[str, Field], ...] | None = cls.__dict__.get("_kinds_cache")
        if cached is None:
            hints = typing.get_type_hints(cls, include_extras=True)
            cached = tuple(
                (f.name, next(m for m in hints[f.name].__metadata__ if isinstance(m, Field)))
                for f in dataclasses.fields(cls)
            )
            cls._kinds_cache = cached
        return cached

    def to_wire(self) -> dict[str, Any]:
        return {name: kind.dump(getattr(self, name)) for name, kind in self.kinds()}

    @classmethod
    def from_wire(cls: type[W], data: Any, path: str = "") -> W:
        """Read a peer's map; raises ``MalformedPeerMessage`` naming the first wrong field."""
        if not isinstance(data, dict):
            refuse(path, f"a {cls.__name__} map", data)
        prefix = f"{path}." if path else ""
        values = {}
        for name, kind in cls.kinds():
            if name not in data:
                raise MalformedPeerMessage(f"{prefix}{name} is missing")
            values[name] = kind.load(data[name], prefix + name)
        return cls(**values)
