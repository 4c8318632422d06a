"""How the pages write numbers, sizes, durations, times and job colours.

``static/dashboard.js`` has the same functions, so that what the browser rewrites in place reads
exactly as the server's first paint: keep the two in step (the browser tests compare them).
"""

from __future__ import annotations

import math
import time
from typing import Any
from urllib.parse import quote

__all__ = [
    "clock",
    "fixed",
    "fmt_bytes",
    "fmt_duration",
    "fmt_gbps",
    "fmt_num",
    "fmt_pct",
    "is_number",
    "job_color",
    "pathseg",
    "window_label",
]


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fixed(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals, halves rounded up, exactly as the browser code does it."""
    scale = 10**digits
    return f"{math.floor(value * scale + 0.5) / scale:.{digits}f}"


def fmt_bytes(n: Any) -> str:
    if not is_number(n):
        return "—"
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):  # noqa: B007 - the unit the loop stops at is the answer
        value /= 1024
        if abs(value) < 1024:
            break
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{fixed(value, digits)} {unit}"


def fmt_duration(s: Any) -> str:
    if not is_number(s):
        return "—"
    if s < 1:
        ms = s * 1000
        return f"{fixed(ms, 1 if ms < 10 else 0)} ms"
    if s < 60:
        return f"{fixed(s, 1)} s"
    if s < 3600:
        return f"{math.floor(s / 60)} min {math.floor(s % 60):02d} s"
    return f"{math.floor(s / 3600)} h {math.floor(s % 3600 / 60):02d} min"


def fmt_pct(x: Any) -> str:
    return f"{fixed(x * 100, 0)}%" if is_number(x) else "—"


def fmt_gbps(x: Any) -> str:
    return f"{fixed(x, 2)} GB/s" if is_number(x) else "—"


def fmt_num(x: Any) -> str:
    return str(x) if is_number(x) else "—"


def job_color(name: Any) -> str:
    """The colour of ``name`` everywhere (FNV-1a of its UTF-8 bytes to a hue and a lightness)."""
    h = 0x811C9DC5
    for byte in str(name).encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return f"hsl({h % 360}, 62%, {40 + (h >> 12) % 3 * 8}%)"


def pathseg(name: Any) -> str:
    """``name`` quoted as one URL path segment, as the browser's ``encodeURIComponent`` does."""
    return quote(str(name), safe="!~*'()")


def clock(t: Any) -> str:
    """``HH:MM:SS`` (UTC) of an epoch time; the browser rewrites it in its own time zone."""
    return time.strftime("%H:%M:%S", time.gmtime(t)) if is_number(t) else "—"


def window_label(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
