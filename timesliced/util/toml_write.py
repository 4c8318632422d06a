"""A small TOML writer for the values a config file holds (pure): keys, strings, numbers, booleans, lists.

What it writes, ``tomllib`` reads back to the same values (tests/unit/test_toml_write.py).
"""

from __future__ import annotations

import math
from typing import Any

_BARE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def key(name: str) -> str:
    """A TOML key: bare where it may be, else a quoted string."""
    return name if name and set(name) <= _BARE else string(name)


def string(text: str) -> str:
    """A TOML basic string. Escaped: the quote, the backslash, and every control character but none else."""
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def value(v: Any) -> str:
    """A TOML value: a boolean, an integer, a finite float, a string, or a list of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"not a TOML value here: {v!r}")
        return repr(v)
    if isinstance(v, str):
        return string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(item) for item in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")
