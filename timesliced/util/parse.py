"""Sizes and addresses: parsed from command lines, config files and the environment, and shown to people (pure)."""

from __future__ import annotations

import math
import re

# A number (``16``, ``1.5``, ``.5``), optional blanks, then an optional unit: K, M, G, T with an optional
# ``i`` and an optional ``B`` (``16G``, ``16GB``, ``16GiB``, ``16gib``), or ``B`` alone. Every unit is a power
# of 1024, whatever the spelling: device and host memory are counted that way (nvidia-smi's "MiB", the
# kernel's "kB" in /proc/meminfo), so ``80GB`` means what a user reading either of them means.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
SIZE_FORMS = "a number of bytes or a size like 16GiB, 512MiB or 1.5GB; K, M, G and T are powers of 1024"


def parse_size(text: str) -> int:
    """``"80GiB"``, ``"16G"``, ``"1.5GB"``, ``"512MiB"``, ``"4096"`` -> bytes (powers of 1024 for every spelling).

    A fraction of a byte is rounded down. Raises ``ValueError`` saying what is accepted.
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected {SIZE_FORMS})")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    value = number * (1 << (10 * _UNITS[unit]))
    if not math.isfinite(value):
        raise ValueError(f"not a size: {text!r} (too large; expected {SIZE_FORMS})")
    return int(value)


def size_value(value: object) -> int:
    """A size from a config file or an API: an integer number of bytes (>= 0) or a string for ``parse_size``.

    Raises ``ValueError`` saying what is accepted (``True`` is not a size).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"not a size: {value!r} (expected {SIZE_FORMS})")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"not a size: {value!r} (a size is at least 0; expected {SIZE_FORMS})")
        return value
    return parse_size(value)


def human_size(n: float) -> str:
    """A size for people: ``512 B``, ``1.5 MiB``, ``12.0 GiB`` (negative figures keep their sign)."""
    if n < 0:
        return "-" + human_size(-n)
    if n < 1024:
        return f"{n:.0f} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def exact_size(n: int) -> str:
    """``human_size`` with the exact count where a user may need it: ``40.0 MiB (41943040 bytes)``."""
    shown = human_size(n)
    return shown if abs(n) < 1024 else f"{shown} ({n} bytes)"


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)
